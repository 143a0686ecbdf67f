//! The grid under mpirun: invalid layouts, failing ranks, and per-rank weight memory.

use super::*;
use gridlm_reference::{launch_command, run_with_timeout, TinyModel};

/// `launch/local RANKS gridlm generate --model DIR ARGS...` with a deadline (one kernel thread
/// per rank unless ARGS say otherwise).
pub(super) fn local(ranks: usize, dir: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    std::env::set_var("GRIDLM_BIN", bin());
    let n = ranks.to_string();
    let mut cmd = launch_command(&["local", &n]);
    cmd.args(["generate", "--model", path_str(dir)]).args(args);
    if !args.contains(&"--threads") {
        cmd.args(["--threads", "1"]);
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    run_with_timeout(cmd, 120)
}

/// Every rank printed `line`, the job failed, and nothing panicked.
#[track_caller]
fn assert_every_rank_says(out: &Output, ranks: usize, line: &str) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "expected failure:\n{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    let n = stderr.lines().filter(|l| l.starts_with("error: ") && l.contains(line)).count();
    assert_eq!(n, ranks, "expected {ranks} ranks to print `{line}`:\n{stderr}");
}

#[test]
fn world_size_must_equal_pp_times_tp() {
    let (_t, dir) = tiny_llama();
    let out = local(3, &dir, &["--prompt", "t1", "--pp", "2", "--tp", "2"], &[]);
    assert_every_rank_says(&out, 3, "invalid grid: --pp 2 × --tp 2 = 4 ranks, but the job has 3 ranks");
}

#[test]
fn tp_larger_than_heads_and_pp_larger_than_layers() {
    let (_t, dir) = tiny_llama(); // 6 heads, 4 layers
    let out = local(7, &dir, &["--prompt", "t1", "--tp", "7"], &[]);
    assert_every_rank_says(&out, 7, "--tp 7 exceeds the model's 6 attention heads");
    let out = local(5, &dir, &["--prompt", "t1", "--pp", "5"], &[]);
    assert_every_rank_says(&out, 5, "--pp 5 exceeds the model's 4 layers");
    let out = local(2, &dir, &["--prompt", "t1", "--pp", "2", "--layers", "3,2"], &[]);
    assert_every_rank_says(&out, 2, "invalid --layers [3, 2]");
}

/// A sharded checkpoint whose second file only the last stage reads.
fn sharded_tiny_llama(dir: &Path) {
    let m = TinyModel::llama();
    m.write(dir);
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    let (a, b): (Vec<_>, Vec<_>) = m.tensors().into_iter().partition(|(n, _, _)| {
        n == "model.embed_tokens.weight"
            || n.starts_with("model.layers.0.")
            || n.starts_with("model.layers.1.")
    });
    let files = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"];
    gridlm_reference::write_safetensors(&dir.join(files[0]), &a);
    gridlm_reference::write_safetensors(&dir.join(files[1]), &b);
    let mut map = serde_json::Map::new();
    for (part, file) in [(&a, files[0]), (&b, files[1])] {
        for (n, _, _) in part {
            map.insert(n.clone(), file.into());
        }
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": map});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
}

#[test]
fn sharded_checkpoint_runs_on_every_layout() {
    let tmp = tempfile::tempdir().unwrap();
    sharded_tiny_llama(tmp.path());
    let (_t, plain) = tiny_llama();
    let args = ["--prompt", "t7 t8 t9", "--max-tokens", "8", "--ignore-eos", "--json"];
    let want = local(1, &plain, &args, &[]);
    assert!(want.status.success(), "{}", String::from_utf8_lossy(&want.stderr));
    let want: serde_json::Value = serde_json::from_slice(&want.stdout).unwrap();
    for (ranks, grid) in [
        (1, vec!["--pp", "1"]),
        (2, vec!["--pp", "2"]),
        (2, vec!["--tp", "2"]),
        (4, vec!["--pp", "2", "--tp", "2"]),
    ] {
        let mut a = args.to_vec();
        a.extend(grid.iter());
        let out = local(ranks, tmp.path(), &a, &[]);
        assert!(out.status.success(), "{grid:?}: {}", String::from_utf8_lossy(&out.stderr));
        let got: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(got["token_ids"], want["token_ids"], "{grid:?}");
    }
}

#[test]
fn a_rank_with_a_corrupt_shard_ends_the_job() {
    let tmp = tempfile::tempdir().unwrap();
    sharded_tiny_llama(tmp.path());
    let second = tmp.path().join("model-00002-of-00002.safetensors");
    let bytes = std::fs::read(&second).unwrap();
    std::fs::write(&second, &bytes[..bytes.len() / 2]).unwrap();
    let t0 = std::time::Instant::now();
    let out = local(2, tmp.path(), &["--prompt", "t1 t2", "--pp", "2"], &[]);
    // Only rank 1 (the last stage) reads the second file; both ranks report its error.
    assert_every_rank_says(&out, 2, "rank 1: ");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("model-00002-of-00002.safetensors: truncated or corrupt"), "{stderr}");
    assert!(t0.elapsed().as_secs() < 60, "took {:?}", t0.elapsed());
}

#[test]
fn a_bad_prefetch_name_is_one_error_line_on_every_rank() {
    let (_t, dir) = tiny_llama();
    let out = local(2, &dir, &["--prompt", "t1", "--pp", "2"], &[("GRIDLM_PREFETCH", "sideways")]);
    assert_every_rank_says(&out, 2, "GRIDLM_PREFETCH is 'sideways': expected none, near, far, nta or page");
    let out = local(2, &dir, &["--prompt", "t1", "--pp", "2"], &[("GRIDLM_MANY_PREFETCH", "far")]);
    assert_every_rank_says(&out, 2, "GRIDLM_MANY_PREFETCH is 'far': expected l2, nta or whole");
    let out = local(2, &dir, &["--prompt", "t1", "--pp", "2"], &[("GRIDLM_STREAMS", "some")]);
    assert_every_rank_says(&out, 2, "GRIDLM_STREAMS is 'some': expected long or every");
}

#[test]
fn a_rank_that_dies_mid_generation_ends_the_job() {
    let (_t, dir) = tiny_llama();
    let t0 = std::time::Instant::now();
    let out = local(
        2,
        &dir,
        &["--prompt", "t1 t2", "--pp", "2", "--max-tokens", "20", "--ignore-eos"],
        &[("GRIDLM_TEST_EXIT_AT", "1:3")],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("rank 1: exiting at step 3"), "{stderr}");
    assert!(t0.elapsed().as_secs() < 60, "took {:?}", t0.elapsed());
}

/// A bug that panics in a kernel thread on one rank: that rank prints one error line (no panic
/// trace) and the job ends instead of the other rank waiting in a collective; on one rank the
/// same gives one line and status 101.
#[test]
fn a_panicking_rank_ends_the_job_with_one_line() {
    let (_t, dir) = tiny_llama();
    let t0 = std::time::Instant::now();
    // Two kernel threads per rank: rank 1's second thread panics, not its main thread (a
    // kernel thread's panic once deadlocked on the stdout lock the main thread held).
    let args = ["--prompt", "t1 t2", "--tp", "2", "--threads", "2", "--max-tokens", "20", "--ignore-eos"];
    let env = [("GRIDLM_TEST_EXIT_AT", "1:3:panic"), ("RUST_BACKTRACE", "0")];
    let out = local(2, &dir, &args, &env);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error: ")).collect();
    assert_eq!(errors.len(), 1, "{stderr}");
    assert!(errors[0].starts_with("error: rank 1: internal error at "), "{stderr}");
    assert!(t0.elapsed().as_secs() < 60, "took {:?}", t0.elapsed());

    let mut cmd = std::process::Command::new(bin());
    cmd.args([
        "generate",
        "--model",
        path_str(&dir),
        "--threads",
        "2",
        "--prompt",
        "t1",
        "--max-tokens",
        "5",
    ]);
    cmd.env("GRIDLM_TEST_EXIT_AT", "0:2:panic").env("RUST_BACKTRACE", "0");
    let out = run_with_timeout(cmd, 60);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(101), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.starts_with("error: internal error at ") && stderr.contains("kernel thread 1 failed"),
        "{stderr}"
    );
}

/// Bytes each rank should hold: its stage's layers split over tp (norms replicated), the
/// embedding rows on the first stage, the head rows (tied: the embedding again) on the last.
fn ideal_shard_bytes(dir: &Path, pp: usize, tp: usize, stage: usize, n_layers: usize) -> f64 {
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let cfg = gridlm::config::ModelConfig::from_dir(dir).unwrap();
    assert_eq!(cfg.n_layers, n_layers);
    let split = gridlm::grid::balanced_layers(&cfg, pp);
    let first: usize = split[..stage].iter().sum();
    let layers = first..first + split[stage];
    let mut total = 0.0;
    for (name, info) in header.as_object().unwrap() {
        let Some(offsets) = info.get("data_offsets") else { continue };
        let size = (offsets[1].as_u64().unwrap() - offsets[0].as_u64().unwrap()) as f64;
        let is_matrix = info["shape"].as_array().unwrap().len() == 2;
        let share = if is_matrix { size / tp as f64 } else { size };
        if let Some(rest) = name.strip_prefix("model.layers.") {
            let l: usize = rest.split('.').next().unwrap().parse().unwrap();
            if layers.contains(&l) {
                total += share;
            }
        } else if name == "model.embed_tokens.weight" {
            // First stage looks tokens up; a tied last stage uses the same rows as its head.
            total += share * ((stage == 0) as u8 + (stage == pp - 1 && pp > 1) as u8) as f64;
        } else if stage == pp - 1 {
            total += share; // model.norm, lm_head
        }
    }
    total
}

#[test]
fn each_rank_holds_only_its_shard() {
    let dir = smollm2("f32");
    let model_bytes = std::fs::metadata(dir.join("model.safetensors")).unwrap().len() as f64;
    for (pp, tp) in [(1, 2), (2, 2)] {
        let (p, t) = (pp.to_string(), tp.to_string());
        let out = local(
            pp * tp,
            &dir,
            &["--prompt", "Hi", "--max-tokens", "1", "--json", "--pp", &p, "--tp", &t],
            &[],
        );
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        for r in j["ranks"].as_array().unwrap() {
            let stage = r["stage"].as_u64().unwrap() as usize;
            let ideal = ideal_shard_bytes(&dir, pp, tp, stage, 30);
            let held = r["weight_bytes"].as_f64().unwrap();
            let resident = r["weight_rss_bytes"].as_f64().unwrap();
            eprintln!(
                "{pp}x{tp} rank {}: ideal {:.1} MB (model/ranks {:.1} MB), held {:.1} MB, resident growth {:.1} MB, rss {:.1} MB",
                r["rank"],
                ideal / 1e6,
                model_bytes / (pp * tp) as f64 / 1e6,
                held / 1e6,
                resident / 1e6,
                r["rss_bytes"].as_f64().unwrap() / 1e6
            );
            assert!((held / ideal - 1.0).abs() <= 0.10, "{pp}x{tp} rank {r}: holds {held} vs ideal {ideal}");
            assert!(
                (resident / ideal - 1.0).abs() <= 0.10,
                "{pp}x{tp} rank {r}: resident {resident} vs ideal {ideal}"
            );
        }
    }
}

/// A model larger than the node's available memory: refused before any weight is read, with
/// one line on every rank naming the host, its ranks and both sizes, instead of the OOM killer.
#[test]
fn a_model_larger_than_the_node_is_refused_before_loading() {
    // llama-2-70b in bf16: ~128.5 GiB of weights, split over the ranks of this one node.
    let avail_gib = gridlm::host::mem_available().unwrap() as f64 / (1u64 << 30) as f64;
    if avail_gib > 128.0 {
        eprintln!("skipped: this machine has {avail_gib:.0} GiB available, room for the model");
        return;
    }
    let fragments = ["not enough memory on host", "need 128.5 GiB", "GiB is available", "--quant int8"];
    let out = gridlm(&["bench", "--shape", "llama-2-70b"]);
    assert_one_line_error(&out, &fragments);
    assert!(String::from_utf8_lossy(&out.stderr).contains("weights of rank 0 need"));

    std::env::set_var("GRIDLM_BIN", bin());
    let mut cmd = launch_command(&["local", "2"]);
    cmd.args(["bench", "--shape", "llama-2-70b", "--tp", "2", "--threads", "1"]);
    let out = run_with_timeout(cmd, 120);
    assert_every_rank_says(&out, 2, "the weights of ranks 0, 1 need 128.5 GiB");
}

/// KV memory asked for beyond what a node has, on two ranks of one node: the line counts the
/// pages of both ranks against the node and names it by host and first rank; every rank says it
/// (the driver's verdict on a run is agreed, not an abort of the others), as it says a lone
/// prompt's own error.
#[test]
fn kv_memory_beyond_the_node_counts_all_its_ranks() {
    // 2000 SmolLM2 sequences at its full context: ~370 GB of keys and values over the two.
    let model = smollm2("bf16");
    let tmp = tempfile::tempdir().unwrap();
    let prompts = tmp.path().join("prompts.txt");
    std::fs::write(&prompts, (0..2000).map(|i| format!("prompt {i}\n")).collect::<String>()).unwrap();
    let args = ["--prompts-file", path_str(&prompts), "--max-batch", "2000", "--max-tokens", "8192"];
    let out = local(2, &model, &[&args[..], &["--tp", "2", "--kv-mem-mib", "999999999"]].concat(), &[]);
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
    assert_every_rank_says(&out, 2, &format!("but host {} (the node of rank 0) has", host.trim()));
    assert_every_rank_says(&out, 2, "for its 2 rank(s): use a smaller batch");
    // bench's batch beyond the node, over two stages: its failed run is every rank's to report
    // (before, rank 0 alone printed it and the launcher aborted the job).
    let mut cmd = launch_command(&["local", "2"]);
    cmd.args(["bench", "--shape", "smollm2-135m", "--pp", "2", "--threads", "1", "--batch", "20000"]);
    cmd.args(["--prompt-len", "8"]);
    let out = run_with_timeout(cmd, 120);
    assert_every_rank_says(&out, 2, "a run of 20000 sequence(s) at once would take");
    // A lone prompt that needs more KV pages than 1 MiB holds.
    let out = local(2, &model, &["--prompt", "hello", "--max-tokens", "200", "--kv-mem-mib", "1"], &[]);
    assert_every_rank_says(&out, 2, "KV pages of");
    // KV memory that holds no page at all.
    let (_t, dir) = tiny_llama();
    let out = local(2, &dir, &["--prompt", "t1 t2 t3", "--kv-mem-mib", "0"], &[]);
    assert_every_rank_says(&out, 2, "holds no page");
}

/// A memory cgroup of this test's own, with a limit (what a container gets), that a child joins
/// before it execs; removed when dropped. `None` where this process cannot make one (not root,
/// no memory controller).
struct MemoryLimit(std::path::PathBuf);

impl MemoryLimit {
    fn new(bytes: u64) -> Option<MemoryLimit> {
        let v1 = std::path::Path::new("/sys/fs/cgroup/memory");
        let (root, file) = if v1.is_dir() {
            (v1, "memory.limit_in_bytes")
        } else {
            (std::path::Path::new("/sys/fs/cgroup"), "memory.max")
        };
        let dir = root.join(format!("gridlm-test-{}", std::process::id()));
        std::fs::create_dir(&dir).ok()?;
        let group = MemoryLimit(dir);
        std::fs::write(group.0.join(file), bytes.to_string()).ok()?;
        Some(group)
    }

    /// `args` of gridlm, run inside the group.
    fn run(&self, args: &[&str]) -> std::process::Output {
        let mut cmd = std::process::Command::new("sh");
        cmd.args(["-c", r#"echo $$ > "$1/cgroup.procs" && shift && exec "$@""#, "sh"])
            .arg(&self.0)
            .arg(bin())
            .args(args);
        run_with_timeout(cmd, 120)
    }
}

impl Drop for MemoryLimit {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.0);
    }
}

/// A container whose memory limit is below the weights: the same one line as a node too small,
/// not the OOM killer (which ended such a run with SIGKILL and no word before the check read the
/// memory cgroup). Needs root (CI runs as root).
#[test]
fn a_memory_cgroup_too_small_for_the_weights_is_refused() {
    let Some(limit) = MemoryLimit::new(150 << 20) else {
        eprintln!("skipped: cannot make a memory cgroup here (needs root and a memory controller)");
        return;
    };
    // SmolLM2's shape in bf16: 0.25 GiB of weights against 150 MiB.
    let out = limit.run(&["bench", "--shape", "smollm2-135m", "--threads", "1"]);
    assert_one_line_error(&out, &["not enough memory on host", "need 0.3 GiB", "GiB is available"]);
    // With room, the same limit is no obstacle: a tiny model generates.
    let (_t, dir) = tiny_llama();
    let out = limit.run(&["generate", "--model", path_str(&dir), "--prompt", "hi", "--max-tokens", "2"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

/// A launch script given a rank count that is not a whole number of at least 1 says so in one
/// line (mpirun -n 0 would start a rank on every slot instead).
#[test]
fn a_bad_rank_count_is_one_line_from_the_launch_script() {
    for n in ["0", "x", "-1"] {
        let mut cmd = launch_command(&["local", n]);
        cmd.args(["generate", "--prompt", "hi"]);
        let out = run_with_timeout(cmd, 60);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        assert_eq!(stderr.lines().count(), 1, "{stderr}");
        assert!(
            stderr.contains(&format!("RANKS must be a whole number of at least 1, got '{n}'")),
            "{stderr}"
        );
    }
}

/// Ranks that mpirun starts on another node (through ssh; on the emulated nodes through a launch
/// agent that clears the environment as ssh does) do not inherit the launching shell's
/// environment: `launch/emulated-nodes`, as `launch/nodes`, passes every exported `GRIDLM_`
/// variable and `RUST_BACKTRACE` on, so all four ranks, two on each node, see them. Needs root
/// (network namespaces).
#[test]
fn gridlm_variables_reach_the_ranks_of_every_node() {
    let mut cmd = launch_command(&["emulated-nodes", "4"]);
    cmd.env("GRIDLM_BIN", "/bin/sh").env("GRIDLM_TEST_PASSED_ON", "yes").env("RUST_BACKTRACE", "full");
    cmd.args(["-c", r#"echo "$(hostname) ${GRIDLM_TEST_PASSED_ON:-unset} ${RUST_BACKTRACE:-unset}""#]);
    let out = run_with_timeout(cmd, 120);
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{stderr}");
    let mut lines: Vec<&str> = stdout.lines().collect();
    lines.sort_unstable();
    let want = ["gridlm-a yes full", "gridlm-a yes full", "gridlm-b yes full", "gridlm-b yes full"];
    assert_eq!(lines, want, "{stderr}");
}

/// A reader of the answer that goes away (`launch/local 2 generate ... | head -c 1`) ends a
/// multi-rank run quietly, as it does a single process's: status 0, no error line. Through
/// mpirun it did not: mpirun, finding its stdout closed, aborted the job (status 1, its own
/// `SIGPIPE detected` lines); `launch/local` now hands the driver the pipe itself.
#[test]
fn a_closed_stdout_ends_a_multi_rank_run_quietly() {
    use std::io::Read;
    use std::os::unix::process::CommandExt;
    // The real model: its tokens come slowly enough for mpirun to forward them one by one (the
    // tiny model's whole answer came in a few writes, and mpirun ran on past as many failures).
    let dir = smollm2("bf16");
    for json in [false, true] {
        let mut cmd = launch_command(&["local", "2"]);
        cmd.args(["generate", "--model", path_str(&dir), "--tp", "2", "--threads", "1"]);
        cmd.args(["--prompt", "Count: 1, 2, 3,", "--max-tokens", "300", "--ignore-eos"]);
        if json {
            cmd.arg("--json");
        }
        let mut child = cmd
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .process_group(0)
            .spawn()
            .expect("spawn");
        let group = child.id();
        // Ends the job should it hang (its pipes then close); told when it ended.
        let (ended, ending) = std::sync::mpsc::channel::<()>();
        let watchdog = std::thread::spawn(move || {
            let hung = ending.recv_timeout(std::time::Duration::from_secs(120)).is_err();
            if hung {
                let _ = Command::new("kill").args(["-KILL", "--", &format!("-{group}")]).status();
            }
            hung
        });
        let mut first = [0u8; 1];
        let read = child.stdout.as_mut().unwrap().read(&mut first).expect("read stdout");
        assert_eq!(read, 1, "json {json}: no answer");
        drop(child.stdout.take()); // the reader goes away after the first byte
        let out = child.wait_with_output().expect("wait");
        let _ = ended.send(());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!watchdog.join().unwrap(), "json {json}: the job hung:\n{stderr}");
        assert!(out.status.success(), "json {json}: {:?}\n{stderr}", out.status);
        for word in ["error", "SIGPIPE", "abort", "panicked"] {
            assert!(!stderr.contains(word), "json {json}: {stderr}");
        }
    }
}
