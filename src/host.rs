//! The node a rank runs on, as Linux reports it: memory available (to this process's memory
//! cgroup, where one limits it), this process's resident memory, the host's name, the CPU time
//! a hypervisor has taken from the process's CPUs. Owns: the
//! check, before any weight is read, that every node has memory for the weights of all its
//! ranks, so a model too large for the machine (or the container) ends with one clear line on
//! every rank instead of the kernel's OOM killer; and the room each node leaves for KV pages.

use crate::comm::Link;
use crate::error::{Error, Result};
use std::path::Path;

/// A `kB` field of a `/proc` file (`MemAvailable:` of meminfo, `VmRSS:` of status), in bytes.
fn proc_kb(path: &str, field: &str) -> Option<usize> {
    let text = std::fs::read_to_string(path).ok()?;
    let line = text.lines().find(|l| l.starts_with(field))?;
    Some(line.split_whitespace().nth(1)?.parse::<usize>().ok()? * 1024)
}

/// The caches of this process's first CPU as Linux lists them under `root`
/// (`/sys/devices/system/cpu`): each one's level, type (`Data`, `Instruction`, `Unified`) and
/// bytes, where it says.
fn caches(root: &Path) -> Vec<(u32, String, usize)> {
    let Some(cpu) = first_cpu().map(|c| root.join(format!("cpu{c}"))) else { return Vec::new() };
    (0..16)
        .filter_map(|i| {
            let dir = cpu.join(format!("cache/index{i}"));
            let field = |f: &str| std::fs::read_to_string(dir.join(f)).ok().map(|v| v.trim().to_string());
            Some((field("level")?.parse().ok()?, field("type")?, cache_size(&field("size")?)?))
        })
        .collect()
}

/// Bytes of a level-1 data cache of this process's first CPU, as Linux lists its caches
/// under `root` (`/sys/devices/system/cpu`), if it says.
pub fn l1d_bytes(root: &Path) -> Option<usize> {
    caches(root).into_iter().find(|c| c.0 == 1 && c.1 == "Data").map(|c| c.2)
}

/// Bytes of the last-level cache of this process's first CPU (its highest level's), as
/// Linux lists its caches under `root`, if it says.
pub fn last_level_cache_bytes(root: &Path) -> Option<usize> {
    caches(root).into_iter().max_by_key(|c| c.0).map(|c| c.2)
}

/// Whether this process runs on an AMD Zen 3 core, as CPUID tells (a hypervisor passes it
/// through): the one CPU on which reading every piece of a one-token product in three
/// streams ([`crate::kernels::dot::preferred_streams`]) and the kernels' own short prefetch
/// ([`crate::kernels::dot::preferred_fetch`]) were measured faster. Found once a process:
/// CPUID, which a hypervisor may trap, is not asked again.
pub fn zen3() -> bool {
    static ZEN3: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ZEN3.get_or_init(cpuid_zen3)
}

/// [`zen3`], from CPUID itself.
fn cpuid_zen3() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::__cpuid;
        // SAFETY: every x86_64 CPU has CPUID leaves 0 and 1.
        #[allow(unused_unsafe)]
        let (v, id) = unsafe { (__cpuid(0), __cpuid(1)) };
        let vendor = [v.ebx, v.edx, v.ecx].map(u32::to_le_bytes).concat();
        let (base, ext) = ((id.eax >> 8) & 0xF, (id.eax >> 20) & 0xFF);
        let family = if base == 0xF { base + ext } else { base };
        let model = ((id.eax >> 12) & 0xF0) | ((id.eax >> 4) & 0xF);
        is_zen3(&vendor, family, model)
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Whether a CPU of this vendor string, family and model (CPUID's, the extended parts added)
/// is AMD's Zen 3: family 19h, models 00h–0Fh (EPYC 7003) and 20h–5Fh (Ryzen 5000 and 6000);
/// 10h–1Fh and 60h on are Zen 4's.
fn is_zen3(vendor: &[u8], family: u32, model: u32) -> bool {
    vendor == b"AuthenticAMD" && family == 0x19 && matches!(model, 0x00..=0x0F | 0x20..=0x5F)
}

/// A cache size as sysfs writes it (`48K`, `1024K`, `32M`), in bytes.
fn cache_size(s: &str) -> Option<usize> {
    let (digits, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len()));
    let n: usize = digits.parse().ok()?;
    match unit {
        "" => Some(n),
        "K" => Some(n << 10),
        "M" => Some(n << 20),
        _ => None,
    }
}

/// The lowest CPU this process may run on.
fn first_cpu() -> Option<usize> {
    let set = affinity()?;
    // SAFETY: CPU_ISSET reads the set's bits within its size.
    (0..libc::CPU_SETSIZE as usize).find(|&c| unsafe { libc::CPU_ISSET(c, &set) })
}

/// Memory this process can still be given without swapping, if known: the node's
/// `MemAvailable`, or less where the process's memory cgroup (a container's limit) allows less.
pub fn mem_available() -> Option<usize> {
    let node = proc_kb("/proc/meminfo", "MemAvailable:");
    let group = std::fs::read_to_string("/proc/self/cgroup")
        .ok()
        .and_then(|own| cgroup_room(Path::new("/sys/fs/cgroup"), &own));
    match (node, group) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// Bytes the memory cgroups of a process still allow it (`own`: its `/proc/self/cgroup`;
/// `root`: where cgroups are mounted), at the tightest of its own group and the groups above:
/// limit minus usage, inactive file pages (cache the kernel reclaims first) not counted as
/// used. `None` where no group sets a limit or none can be read. Both hierarchies: v2
/// (`0::/path`, `memory.max`) and v1 (`N:memory:/path` under `memory/`). A container that
/// mounts only its own group shows it at the top, so the top counts too.
fn cgroup_room(root: &Path, own: &str) -> Option<usize> {
    let mut room: Option<u64> = None;
    for line in own.lines() {
        let mut f = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) = (f.next(), f.next(), f.next()) else { continue };
        let v2 = controllers.is_empty();
        if !v2 && !controllers.split(',').any(|c| c == "memory") {
            continue;
        }
        let base = if v2 { root.to_path_buf() } else { root.join("memory") };
        let mut dir = Some(Path::new(path.trim_start_matches('/')));
        while let Some(d) = dir {
            if let Some(r) = group_room(&base.join(d), v2) {
                room = Some(room.map_or(r, |m| m.min(r)));
            }
            dir = d.parent();
        }
    }
    room.map(|r| r as usize)
}

/// Limit minus usage of one memory cgroup directory (see [`cgroup_room`]); `None` without a
/// limit.
fn group_room(dir: &Path, v2: bool) -> Option<u64> {
    let read = |f: &str| std::fs::read_to_string(dir.join(f)).ok();
    let (limit, usage, inactive) = if v2 {
        ("memory.max", "memory.current", "inactive_file ")
    } else {
        ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file ")
    };
    // v2 writes "max" for no limit; v1 a number near 2^63.
    let limit: u64 = read(limit)?.trim().parse().ok().filter(|&l| l < 1 << 60)?;
    let usage: u64 = read(usage)?.trim().parse().ok()?;
    let cache = read("memory.stat")
        .and_then(|s| s.lines().find_map(|l| l.strip_prefix(inactive)?.trim().parse::<u64>().ok()))
        .unwrap_or(0);
    Some(limit.saturating_sub(usage.saturating_sub(cache)))
}

/// This process's resident memory (0 where unknown).
pub fn rss_bytes() -> usize {
    proc_kb("/proc/self/status", "VmRSS:").unwrap_or(0)
}

/// CPU time a hypervisor has so far taken from the CPUs this process may run on (its affinity
/// mask), summed over them, in ms: the time each virtual CPU had work but its host ran
/// something else (`steal` in `/proc/stat`, counted in clock ticks of 10 ms on most systems).
/// On a shared host it tells a run that lost time to its neighbours from one that did not.
/// `None` where the system does not say (not Linux, no such field, or an unreadable mask).
pub fn stolen_ms() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let set = affinity()?;
    let limit = 8 * std::mem::size_of::<libc::cpu_set_t>();
    // SAFETY: `cpu` is checked against the set's size first.
    let mine = |cpu: usize| cpu < limit && unsafe { libc::CPU_ISSET(cpu, &set) };
    // SAFETY: sysconf only reads a system constant.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    let ticks = stolen_ticks(&stat, mine)?;
    (hz > 0).then(|| ticks as f64 * 1e3 / hz as f64)
}

/// CPUs this process may run on (its affinity mask; 1 where unreadable).
pub fn own_cpus() -> usize {
    // SAFETY: CPU_COUNT only reads the set.
    affinity().map_or(1, |set| unsafe { libc::CPU_COUNT(&set) }.max(1) as usize)
}

/// This process's affinity mask.
fn affinity() -> Option<libc::cpu_set_t> {
    // SAFETY: `set` is a plain bit set, written by the call for its whole given size.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    let rc = unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
    (rc == 0).then_some(set)
}

/// The `steal` ticks of the CPUs `mine` takes in a `/proc/stat` text (the eighth number of each
/// `cpuN` line), summed; `None` where none of them has that field.
fn stolen_ticks(stat: &str, mine: impl Fn(usize) -> bool) -> Option<u64> {
    let mut total = None;
    for line in stat.lines() {
        let mut fields = line.split_ascii_whitespace();
        let Some(Ok(cpu)) = fields.next().and_then(|f| f.strip_prefix("cpu")).map(str::parse::<usize>) else {
            continue;
        };
        if let Some(steal) = fields.nth(7).and_then(|f| f.parse::<u64>().ok()).filter(|_| mine(cpu)) {
            total = Some(total.unwrap_or(0) + steal);
        }
    }
    total
}

/// The host's name (what `hostname` prints).
pub fn name() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is writable for its whole length, and one byte is kept back so the
    // name stays NUL-terminated even where the system truncates it.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len() - 1) };
    let len = buf.iter().position(|&b| b == 0).unwrap_or(0);
    if rc == 0 && len > 0 {
        String::from_utf8_lossy(&buf[..len]).into_owned()
    } else {
        "localhost".into()
    }
}

/// Bytes as GiB with one decimal.
fn gib(bytes: u64) -> String {
    format!("{:.1} GiB", bytes as f64 / (1u64 << 30) as f64)
}

/// The ranks on rank `me`'s node in `all` (as [`shortfall`] reads it), the bytes they need
/// together and the most any of them saw available.
fn node_of(me: usize, all: &[[u64; 3]]) -> (Vec<usize>, u64, u64) {
    let ranks: Vec<usize> = (0..all.len()).filter(|&r| all[r][0] == all[me][0]).collect();
    let need = ranks.iter().map(|&r| all[r][1]).sum();
    let avail = ranks.iter().map(|&r| all[r][2]).max().unwrap_or(u64::MAX);
    (ranks, need, avail)
}

/// What rank `me` (on host `host`) finds when every rank's `[node key, bytes needed, bytes
/// available]` is in `all`: an error when the ranks of its node need more than the node has
/// (the most any of them saw available; `u64::MAX` means unknown). `int8`, where the weights are
/// not quantized already, holds the same records of what `--quant int8` would need, which the
/// line then gives, as the way out where it fits and as the size to find room for where not.
fn shortfall(me: usize, host: &str, all: &[[u64; 3]], int8: Option<&[[u64; 3]]>) -> Result<()> {
    let (ranks, need, avail) = node_of(me, all);
    if need <= avail {
        return Ok(());
    }
    let need_of = |records: &[[u64; 3]]| ranks.iter().map(|&r| records[r][1]).sum::<u64>();
    let who = match ranks.as_slice() {
        [one] => format!("rank {one}"),
        many => format!("ranks {}", many.iter().map(usize::to_string).collect::<Vec<_>>().join(", ")),
    };
    let hint = match int8.map(need_of) {
        None => "run on more nodes".to_string(),
        Some(q) if q <= avail => format!("run on more nodes or with --quant int8 (then {})", gib(q)),
        Some(q) => format!("run on more nodes (with --quant int8 still {})", gib(q)),
    };
    Err(Error::Input(format!(
        "not enough memory on host {host}: the weights of {who} need {}, but {} is available; {hint}",
        gib(need),
        gib(avail)
    )))
}

/// Collective over the job: every rank says the bytes its weights will take (`need`, from
/// [`crate::model::Shard::planned_bytes`]); the ranks of each node (one running kernel) are
/// summed and compared with the memory the node has available. `int8_need`, the bytes the
/// weights would take quantized (`None` where they are already), only informs the error line;
/// every rank must give one or none alike. It is gathered only where some node falls short:
/// every rank holds the same records, so all of them know whether one does.
pub fn check_room(link: &dyn Link, need: usize, int8_need: Option<usize>) -> Result<()> {
    let all = gather_nodes(link, need).0;
    let short = (0..all.len()).any(|r| {
        let (_, need, avail) = node_of(r, &all);
        need > avail
    });
    let int8 = int8_need.filter(|_| short).map(|b| gather_nodes(link, b).0);
    shortfall(link.world_rank(), &name(), &all, int8.as_deref())
}

/// Bytes of a host name [`gather_nodes`] passes on (longer names are cut there).
const HOST_BYTES: usize = 64;
/// Words of a rank's record in [`gather_nodes`]: node key, bytes, bytes available, host name.
const RECORD: usize = 3 + HOST_BYTES / 8;

/// Collective over the job: every rank's `[node key, bytes, bytes available]`, `bytes` its
/// own figure, and its host name ([`name`], at most 64 bytes of it, so that a rank can name
/// another's node in an error line). Ranks share memory when they run under one kernel: the
/// same boot id, whatever the host names say (containers of one machine may have their own;
/// machines may share one).
pub fn gather_nodes(link: &dyn Link, bytes: usize) -> (Vec<[u64; 3]>, Vec<String>) {
    let host = name();
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_else(|_| host.clone());
    let mut mine = [0u64; RECORD];
    mine[..3].copy_from_slice(&[
        crate::fnv1a(boot.trim()),
        bytes as u64,
        mem_available().map_or(u64::MAX, |b| b as u64),
    ]);
    let mut text = [0u8; HOST_BYTES];
    let n = host.len().min(HOST_BYTES);
    text[..n].copy_from_slice(&host.as_bytes()[..n]);
    for (word, chunk) in mine[3..].iter_mut().zip(text.chunks_exact(8)) {
        *word = u64::from_le_bytes(chunk.try_into().unwrap_or_default());
    }
    let mut all = vec![0u64; RECORD * link.world_size()];
    link.allgather_u64(&mine, &mut all);
    let figures = all.chunks_exact(RECORD).map(|c| [c[0], c[1], c[2]]).collect();
    let hosts = all
        .chunks_exact(RECORD)
        .map(|c| {
            let text: Vec<u8> = c[3..].iter().flat_map(|w| w.to_le_bytes()).take_while(|&b| b != 0).collect();
            String::from_utf8_lossy(&text).into_owned()
        })
        .collect();
    (figures, hosts)
}

/// One node of the job as a run's buffers see it: what all its ranks take together per unit of
/// a run, and the memory it has available (the most any of its ranks saw).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeRoom {
    /// The lowest rank on the node, the node's host name (that rank's), its available bytes
    /// and its ranks.
    pub rank: usize,
    pub host: String,
    pub available: usize,
    pub ranks: usize,
    /// Bytes the node's ranks take together for a KV page (each rank's own size), a token of a
    /// step, a sequence slot and a row of the output head (see [`NodeRoom::need`]).
    pub per: [usize; 4],
}

impl NodeRoom {
    /// The KV pages the node holds for all its ranks, with nothing else beside them.
    pub fn pages(&self) -> usize {
        self.available / self.per[0].max(1)
    }

    /// Bytes the node's ranks take together for a run of `counts`: `[KV pages, tokens of its
    /// largest step, sequence slots, rows of the output head]`.
    pub fn need(&self, counts: [usize; 4]) -> usize {
        self.per.iter().zip(counts).fold(0usize, |sum, (&per, n)| sum.saturating_add(per.saturating_mul(n)))
    }
}

/// Every node of the job whose memory is known (`u64::MAX`: unknown), in the order of its
/// lowest rank, from every rank's `[node key, KV page bytes, bytes available]`
/// ([`gather_nodes`]) and its own `[token, slot, row]` bytes (`per_rank`, in rank order; see
/// [`NodeRoom::per`]), each node named by its lowest rank's entry in `hosts` (one a rank, or
/// none).
pub fn node_rooms(all: &[[u64; 3]], per_rank: &[[u64; 3]], hosts: &[String]) -> Vec<NodeRoom> {
    let mut nodes: Vec<(u64, NodeRoom, u64)> = Vec::new(); // key, the node, bytes available
    let size = |b: u64| usize::try_from(b).unwrap_or(usize::MAX);
    for (rank, &[key, page, avail]) in all.iter().enumerate() {
        let [token, slot, row] = per_rank.get(rank).copied().unwrap_or_default();
        let per = [page, token, slot, row].map(size);
        match nodes.iter_mut().find(|n| n.0 == key) {
            Some((_, node, most)) => {
                for (sum, p) in node.per.iter_mut().zip(per) {
                    *sum = sum.saturating_add(p);
                }
                *most = (*most).max(avail);
                node.ranks += 1;
            }
            None => {
                let host = hosts.get(rank).cloned().unwrap_or_else(|| "unknown".into());
                nodes.push((key, NodeRoom { rank, host, available: 0, ranks: 1, per }, avail));
            }
        }
    }
    nodes
        .into_iter()
        .filter(|n| n.2 != u64::MAX)
        .map(|(_, node, avail)| NodeRoom { available: size(avail), ..node })
        .collect()
}

/// The node with room for the fewest KV pages ([`NodeRoom::pages`]; of equals, the lowest rank's).
pub fn tightest(nodes: &[NodeRoom]) -> Option<&NodeRoom> {
    nodes.iter().min_by_key(|n| (n.pages(), n.rank))
}

#[cfg(test)]
mod tests {
    use super::*;

    const G: u64 = 1 << 30;

    #[test]
    fn zen3_is_amd_family_19h_zen3_models() {
        let amd = b"AuthenticAMD";
        // EPYC 7003 (this project's Zen 3 machine: family 25, model 1), Ryzen 5000 and 6000.
        for model in [0x01, 0x08, 0x21, 0x44, 0x50] {
            assert!(is_zen3(amd, 0x19, model), "{model:#x}");
        }
        // Zen 4 (EPYC 9004: model 17, as the Zen 4 machine; Ryzen 7000), Zen 2, Zen 5, Intel.
        for (family, model) in
            [(0x19, 0x11), (0x19, 0x61), (0x19, 0x74), (0x19, 0xA0), (0x17, 0x31), (0x1A, 0x02)]
        {
            assert!(!is_zen3(amd, family, model), "{family:#x} {model:#x}");
        }
        assert!(!is_zen3(b"GenuineIntel", 0x19, 0x01));
        // CPUID as Linux reads it.
        let Ok(info) = std::fs::read_to_string("/proc/cpuinfo") else { return };
        let field = |name: &str| {
            let line = info.lines().find(|l| l.split(':').next().is_some_and(|k| k.trim() == name))?;
            Some(line.split_once(':')?.1.trim().to_string())
        };
        if let (Some(vendor), Some(family), Some(model)) =
            (field("vendor_id"), field("cpu family"), field("model"))
        {
            let (family, model) = (family.parse().unwrap_or(0), model.parse().unwrap_or(0));
            assert_eq!(zen3(), is_zen3(vendor.as_bytes(), family, model), "{vendor} {family} {model}");
        }
    }

    #[test]
    fn kv_room_is_the_tightest_nodes() {
        let (a, b) = (crate::fnv1a("node-a"), crate::fnv1a("node-b"));
        const M: u64 = 1 << 20;
        // node-a: ranks 0 and 2, pages of 3 and 1 MiB, 40 MiB (the most its ranks saw) → 10
        // pages; node-b: rank 1 alone, 2 MiB pages, 30 MiB → 15.
        let all = [[a, 3 * M, 40 * M], [b, 2 * M, 30 * M], [a, M, 38 * M]];
        let per = [[10, 20, 30], [1, 2, 3], [100, 200, 300]];
        let hosts = ["node-a", "node-b", "node-a"].map(String::from);
        let nodes = node_rooms(&all, &per, &hosts);
        let host = String::from("node-a");
        let room = NodeRoom { rank: 0, host, available: 40 << 20, ranks: 2, per: [4 << 20, 110, 220, 330] };
        assert_eq!(tightest(&nodes), Some(&room));
        assert_eq!(room.pages(), 10);
        // What a run takes there: its pages, and its steps' tokens, slots and rows, all ranks.
        assert_eq!(room.need([2, 1000, 3, 5]), (8 << 20) + 110_000 + 660 + 1650);
        assert_eq!(room.need([usize::MAX, 1, 1, 1]), usize::MAX);
        // node-b with less: it is the tightest now.
        let all = [[a, 3 * M, 40 * M], [b, 2 * M, 12 * M], [a, M, 38 * M]];
        let host = String::from("node-b");
        let room = NodeRoom { rank: 1, host, available: 12 << 20, ranks: 1, per: [2 << 20, 1, 2, 3] };
        assert_eq!(tightest(&node_rooms(&all, &per, &hosts)), Some(&room));
        assert_eq!(room.pages(), 6);
        // A node whose memory is unknown sets no bound; none known, no room at all.
        let all = [[a, 3 * M, u64::MAX], [b, 2 * M, 12 * M]];
        assert_eq!(node_rooms(&all, &per, &hosts).len(), 1);
        assert_eq!(tightest(&node_rooms(&all, &per, &hosts)).unwrap().rank, 1);
        assert_eq!(tightest(&node_rooms(&[[a, M, u64::MAX]], &per, &hosts)), None);
        // Without host names the host is `unknown` (the error line still names the rank).
        assert_eq!(node_rooms(&all, &per, &[])[0].host, "unknown");
    }

    #[test]
    fn a_node_must_hold_the_weights_of_all_its_ranks() {
        let (a, b) = (crate::fnv1a("node-a"), crate::fnv1a("node-b"));
        // Two ranks of 6 GiB each fit alone in node-a's 10 GiB, not together.
        let all = [[a, 6 * G, 10 * G], [a, 6 * G, 10 * G], [b, 6 * G, 10 * G]];
        // Quantized, 3 GiB each: the two fit.
        let int8 = all.map(|[node, bytes, avail]| [node, bytes / 2, avail]);
        let e = shortfall(0, "node-a", &all, Some(&int8)).unwrap_err().to_string();
        assert!(e.contains("host node-a") && e.contains("ranks 0, 1"), "{e}");
        assert!(e.contains("need 12.0 GiB") && e.contains("10.0 GiB is available"), "{e}");
        assert!(e.ends_with("run on more nodes or with --quant int8 (then 6.0 GiB)"), "{e}");
        assert!(shortfall(1, "node-a", &all, Some(&int8)).is_err());
        // node-b's one rank has room.
        assert!(shortfall(2, "node-b", &all, Some(&int8)).is_ok());
        // Too large quantized as well: the size it would need still.
        let big = all.map(|[node, _, avail]| [node, 12 * G, avail]);
        let e = shortfall(0, "node-a", &big, Some(&all)).unwrap_err().to_string();
        assert!(e.ends_with("run on more nodes (with --quant int8 still 12.0 GiB)"), "{e}");
        // Already quantized: no hint to quantize.
        let e = shortfall(0, "node-b", &[[b, 11 * G, 10 * G]], None).unwrap_err().to_string();
        assert!(e.contains("rank 0 need") && e.ends_with("run on more nodes"), "{e}");
        // Unknown available memory never refuses.
        assert!(shortfall(0, "x", &[[a, 100 * G, u64::MAX]], None).is_ok());
    }

    #[test]
    fn container_limits_lower_the_room() {
        let t = tempfile::tempdir().unwrap();
        let write = |rel: &str, text: &str| {
            let p = t.path().join(rel);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, text).unwrap();
        };
        // v2: no limit at the top, 2 GiB on a/, 1 GiB on a/b with 512 MiB used of which 128 MiB
        // is inactive cache.
        write("memory.max", "max\n");
        write("a/memory.max", "2147483648\n");
        write("a/memory.current", "1610612736\n");
        write("a/b/memory.max", "1073741824\n");
        write("a/b/memory.current", "536870912\n");
        write("a/b/memory.stat", "anon 1\ninactive_file 134217728\nactive_file 5\n");
        // a/b allows 1 GiB - 384 MiB; a/ allows 512 MiB, the tighter.
        assert_eq!(cgroup_room(t.path(), "0::/a/b\n"), Some(512 << 20));
        assert_eq!(cgroup_room(t.path(), "0::/a/b/c\n"), Some(512 << 20));
        // Only unlimited groups, or none readable: no answer.
        assert_eq!(cgroup_room(t.path(), "0::/\n"), None);
        assert_eq!(cgroup_room(t.path(), "0::/nowhere\n"), None);
        // v1: the memory controller's own line, under memory/; "unlimited" is a huge number.
        write("memory/memory.limit_in_bytes", "9223372036854771712\n");
        write("memory/job/memory.limit_in_bytes", "1073741824\n");
        write("memory/job/memory.usage_in_bytes", "805306368\n");
        write("memory/job/memory.stat", "inactive_file 1\ntotal_inactive_file 268435456\n");
        let own = "9:cpu,cpuacct:/job\n4:memory:/job\n0::/\n";
        assert_eq!(cgroup_room(t.path(), own), Some(512 << 20));
        assert_eq!(cgroup_room(t.path(), "4:memory:/\n"), None);
    }

    #[test]
    fn cache_sizes_read_as_sysfs_writes_them() {
        assert_eq!(cache_size("48K"), Some(48 << 10));
        assert_eq!(cache_size("1024K"), Some(1 << 20));
        assert_eq!(cache_size("32M"), Some(32 << 20));
        assert_eq!(cache_size("512"), Some(512));
        assert_eq!(cache_size("K"), None);
        assert_eq!(cache_size("48KB"), None);
        let root = tempfile::tempdir().unwrap();
        let cpu = root.path().join(format!("cpu{}", first_cpu().unwrap()));
        for (i, level, kind, size) in
            [(0, "1", "Instruction", "32K"), (1, "2", "Unified", "1024K"), (2, "1", "Data", "48K")]
        {
            let dir = cpu.join(format!("cache/index{i}"));
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("level"), format!("{level}\n")).unwrap();
            std::fs::write(dir.join("type"), format!("{kind}\n")).unwrap();
            std::fs::write(dir.join("size"), format!("{size}\n")).unwrap();
        }
        assert_eq!(l1d_bytes(root.path()), Some(48 << 10));
        assert_eq!(last_level_cache_bytes(root.path()), Some(1 << 20));
        assert_eq!(l1d_bytes(&root.path().join("none")), None);
        assert_eq!(last_level_cache_bytes(&root.path().join("none")), None);
    }

    #[test]
    fn this_node_is_readable() {
        assert!(!name().is_empty());
        assert!(mem_available().is_some_and(|b| b > 0));
        assert!(rss_bytes() > 0);
        assert!(stolen_ms().is_some_and(|ms| ms >= 0.0));
        assert!(own_cpus() >= 1);
    }

    #[test]
    fn stolen_time_is_the_steal_field_of_the_process_cpus() {
        let stat = "cpu  900 0 90 9000 9 0 9 77 0 0\n\
                    cpu0 400 0 40 4000 4 0 4 30 0 0\n\
                    cpu1 500 0 50 5000 5 0 5 47 0 0\n\
                    cpu2 1 2 3 4\n\
                    intr 12345 0 0\n\
                    ctxt 999\n";
        // The total line and lines that are not a CPU's are left out.
        assert_eq!(stolen_ticks(stat, |_| true), Some(77));
        assert_eq!(stolen_ticks(stat, |c| c == 1), Some(47));
        // A CPU outside the mask, or one without the field (kernels before 2.6.11): no answer.
        assert_eq!(stolen_ticks(stat, |c| c == 3), None);
        assert_eq!(stolen_ticks(stat, |c| c == 2), None);
    }
}
