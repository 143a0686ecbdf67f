//! The machine's own limits, measured with the same thread team the kernels use: read
//! bandwidth over a buffer far larger than the last-level cache, and the f32 FMA peak.

use super::arena::HugeBuf;
use super::dot::{detect, Isa};
use super::team::Team;
use rayon::prelude::*;
use std::sync::atomic::{AtomicU32, Ordering::Relaxed};
use std::time::Instant;

/// The ways the probe reads: `ahead`, a prefetch distance (0: plain loads, the hardware
/// prefetcher alone; else that many bytes ahead, non-temporal, as the matrix kernels may
/// stream weights: [`super::Fetch::Nta`] asks 2 KiB ahead, 4 KiB in the float FMA
/// kernels); `streams`, each thread's share read as one stream or as two or three side by
/// side (its halves or thirds), as the one-token AVX2 int8 and float kernels read a range;
/// `page`, one line a 4 KiB page asked for into L2, as [`super::Fetch::Page`] asks. So that no way
/// the kernels read is faster than the fastest of these. (On the 2-core Zen 5 machine the 4 KiB
/// ways read at 0.94–1.04 of the fastest of the others, a median of 1.00 over 193 readings.)
const READS: [(usize, usize, bool); 11] = [
    (0, 1, false),
    (512, 1, false),
    (1024, 1, false),
    (2048, 1, false),
    (4096, 1, false),
    (0, 2, false),
    (1024, 2, false),
    (4096, 2, false),
    (0, 3, false),
    (1024, 3, false),
    (0, 1, true),
];

/// Sums `buf` with every team thread, each over its own contiguous share (as the kernels
/// split a matrix), with wide independent accumulators so loads are the limit, read the way
/// `read` says ([`READS`]).
fn read_all(team: &Team, buf: &[f32], isa: Isa, (ahead, streams, page): (usize, usize, bool)) -> f32 {
    let share = buf.len().div_ceil(team.threads()).max(1);
    let sums: Vec<AtomicU32> = (0..team.threads()).map(|_| AtomicU32::new(0)).collect();
    team.run(&|tid| {
        let c = buf.chunks(share).nth(tid).unwrap_or(&[]);
        let s = match isa {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: every non-portable Isa is only detected with avx2 and fma present.
            Isa::Avx2 | Isa::Avx512 | Isa::Avx512Bf16 => unsafe {
                match streams {
                    2 => avx2::sum::<2>(c, ahead, page),
                    3 => avx2::sum::<3>(c, ahead, page),
                    _ => avx2::sum::<1>(c, ahead, page),
                }
            },
            _ => c.iter().sum::<f32>(),
        };
        sums[tid].store(s.to_bits(), Relaxed);
    });
    sums.iter().map(|s| f32::from_bits(s.load(Relaxed))).sum()
}

/// A `bytes`-sized buffer mapped the way weights are (huge pages where the kernel gives them),
/// so the limit is the machine's, not that of 4 KiB-page address translation; written before
/// it is read (untouched pages would all be the one shared zero page).
fn filled(bytes: usize) -> HugeBuf<f32> {
    let mut buf = HugeBuf::<f32>::zeroed(bytes / 4);
    buf.par_chunks_mut(1 << 16).enumerate().for_each(|(c, v)| {
        v.iter_mut().enumerate().for_each(|(i, x)| *x = ((c + i) % 7) as f32);
    });
    buf
}

/// Seconds one full read of `buf` by every thread of `team` takes, `read` one of [`READS`].
fn time_read(team: &Team, buf: &[f32], isa: Isa, read: (usize, usize, bool)) -> f64 {
    let t = Instant::now();
    std::hint::black_box(read_all(team, buf, isa, read));
    t.elapsed().as_secs_f64()
}

/// A buffer the read probe reads, made and filled once and read as often as needed.
///
/// Keep one for as long as readings are taken. A buffer freed between readings goes back to
/// the kernel, and on a virtual machine with free page reporting (the test machines have it)
/// the kernel hands its pages back to the host a little later, on the cores the timed work
/// runs on, and each new buffer is faulted in and zeroed again. On the 2-core test machine,
/// about 2 s after 1 GiB was freed, a 200 ms slice of arithmetic on both cores ran 20–50%
/// slower: in the middle of the next timed decode run.
pub struct ReadProbe {
    buf: HugeBuf<f32>,
}

impl ReadProbe {
    /// A probe over `bytes` bytes (rounded down to whole f32s).
    pub fn new(bytes: usize) -> ReadProbe {
        ReadProbe { buf: filled(bytes) }
    }

    /// The fastest read of the buffer by every thread of `team` over `passes` passes, in
    /// GB/s, and the way of reading ([`ReadWay`]) that made it. Each pass reads the buffer once
    /// per way of reading (`READS`: plain loads; loads with software prefetches at four
    /// distances; plain and at two distances, each thread's share as two streams; plain and at
    /// 1 KiB as three): the limit is what the best of them reaches, not what one happens to.
    pub fn best(&self, team: &Team, passes: usize) -> (f64, ReadWay) {
        let isa = detect();
        let mut best = (f64::INFINITY, ReadWay(0));
        for _ in 0..passes.max(1) {
            for (way, read) in READS.into_iter().enumerate() {
                let t = time_read(team, &self.buf, isa, read);
                if t < best.0 {
                    best = (t, ReadWay(way));
                }
            }
        }
        (self.bytes() / best.0 / 1e9, best.1)
    }

    /// Bytes read and seconds taken by `reads` full reads of the buffer by every thread of
    /// `team`, all in one way: the bandwidth the machine gives at this moment, every read
    /// counted (no fastest-of), to set beside work timed the same way.
    pub fn rate(&self, team: &Team, way: ReadWay, reads: usize) -> (f64, f64) {
        let isa = detect();
        let secs: f64 = (0..reads).map(|_| time_read(team, &self.buf, isa, READS[way.0])).sum();
        (reads as f64 * self.bytes(), secs)
    }

    /// As [`ReadProbe::rate`] for one read of the buffer's first `1 / parts`, the same slice
    /// every time: a short reading to set beside each step of a decode run, which reads its
    /// weights once a step.
    ///
    /// The same slice, read once a step as the weights are, because on the virtual test
    /// machines memory read less often reads slower at times: on the 2-core Zen 4 machine,
    /// readings of slices taken in turn (each last read sixteen readings, ~1.2 s of
    /// llama-3.2-1b decode, before) fell to 4–18 GB/s for a second or so while a reading of
    /// this slice right after each read 28–48 and the decode steps kept their pace, and two
    /// runs' efficiencies came out at 1.48 and 1.58 against 1.03 and 0.93 set against this
    /// slice; in the others mostly within 2–3% of each other. Between two readings the
    /// step streams its weights (in a run bound by memory, many times the last-level cache),
    /// which pushes the slice out of the caches, so it is read from memory.
    pub fn rate_slice(&self, team: &Team, way: ReadWay, parts: usize) -> (f64, f64) {
        let parts = parts.clamp(1, self.buf.len().max(1));
        let len = self.buf.len() / parts;
        let secs = time_read(team, &self.buf[..len], detect(), READS[way.0]);
        (len as f64 * 4.0, secs)
    }

    fn bytes(&self) -> f64 {
        self.buf.len() as f64 * 4.0
    }
}

/// One of the ways the probe reads (`READS`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadWay(usize);

/// f32 FMA throughput of every team thread together, in GFLOP/s (an FMA counts as 2 flops).
pub fn fma_peak_gflops(team: &Team, iterations: usize) -> f64 {
    let isa = detect();
    let t = Instant::now();
    team.run(&|i| match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 => unsafe {
            avx2::fma_chains(iterations, i as f32);
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: Isa::Avx512 and Isa::Avx512Bf16 are only detected with avx512f present.
        Isa::Avx512 | Isa::Avx512Bf16 => unsafe {
            avx512::fma_chains(iterations, i as f32);
        },
        _ => {
            let mut acc = [i as f32; 8];
            for _ in 0..iterations {
                for a in acc.iter_mut() {
                    *a = a.mul_add(0.999_999, 1e-7);
                }
            }
            std::hint::black_box(acc);
        }
    });
    let per_thread = match isa {
        Isa::Avx2 => iterations * 12 * 8 * 2,
        Isa::Avx512 | Isa::Avx512Bf16 => iterations * 12 * 16 * 2,
        Isa::Portable => iterations * 8 * 2,
    };
    (per_thread * team.threads()) as f64 / t.elapsed().as_secs_f64() / 1e9
}

/// The bf16 dot-product throughput of every team thread together, in GFLOP/s, where this CPU
/// runs [`Isa::Avx512Bf16`]: the instruction the bf16 kernels multiply with there
/// (`vdpbf16ps`, 32 products of bf16 pairs summed into 16 f32 lanes, 64 flops), twice the
/// multiply-adds of an f32 FMA. `None` on every other ISA, where bf16 weights are widened and
/// multiplied by f32 FMAs, whose peak [`fma_peak_gflops`] measures.
pub fn bf16_peak_gflops(team: &Team, iterations: usize) -> Option<f64> {
    if detect() != Isa::Avx512Bf16 {
        return None;
    }
    let t = Instant::now();
    team.run(&|i| {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: Isa::Avx512Bf16 is only detected with avx512f and avx512bf16 present.
        unsafe {
            avx512::bf16_chains(iterations, i as f32)
        }
    });
    let per_thread = iterations * 12 * 32 * 2;
    Some((per_thread * team.threads()) as f64 / t.elapsed().as_secs_f64() / 1e9)
}

/// Both compute peaks of `team`, as bench and `bench --limits` take them: the f32 FMA peak
/// ([`fma_peak_gflops`]) and, where the bf16 kernels have `vdpbf16ps`, the bf16 dot-product
/// peak ([`bf16_peak_gflops`]), each over some tens of milliseconds.
pub fn peaks_gflops(team: &Team) -> (f64, Option<f64>) {
    (fma_peak_gflops(team, 20_000_000), bf16_peak_gflops(team, 10_000_000))
}

/// The round trip of one empty job from the calling thread to every other thread of `team`
/// and back, in µs: the median of `calls` jobs in a row (0 with one thread). A step's output
/// head hands its input to the team and waits for the last thread, and each kernel of the
/// step's region ends in a barrier, whose crossings (one each way, at once) are those of this
/// round trip: so it says what the cores' distance adds to each of them.
///
/// It shows how far apart the cores are. On the 2-core Zen 4 test machines it read 0.05–0.12
/// µs in some spells and 0.44–0.58 µs (once 0.5–0.8) in others, and the spells of the slow
/// handoff were those in which the read probe read 56–67 GB/s instead of 35–39: the two
/// virtual cores then sat apart, by all appearances each with its own path to memory. There
/// a one-token product of SmolLM2's shapes cost 2.7–4 µs beyond its stream, against 0.4–0.7
/// µs in the other spells. On the Zen 5 machines: 0.11–0.17 µs while the probe read 47–53
/// GB/s, 0.67–0.82 µs while it read 69–85.
pub fn handoff_us(team: &Team, calls: usize) -> f64 {
    if team.threads() < 2 {
        return 0.0;
    }
    let mut times: Vec<f64> = (0..calls.max(1))
        .map(|_| {
            let t = Instant::now();
            team.run(&|_| {});
            t.elapsed().as_secs_f64() * 1e6
        })
        .collect();
    let mid = times.len() / 2;
    *times.select_nth_unstable_by(mid, f64::total_cmp).1
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use crate::kernels::dot::fetch_page;
    use std::arch::x86_64::*;

    /// The sum of `c`, read as `S` streams side by side (its `S` equal parts, a pair of lines
    /// of each at a time, as the one-token AVX2 kernels read a thread's range in two or three);
    /// with `ahead > 0`, each pair of lines is asked for `ahead` bytes before it is loaded
    /// (non-temporal hint, as the matrix kernels do); with `page`, where a pair of lines begins
    /// a 4 KiB page, a line ahead into L2 as `Fetch::Page` asks ([`fetch_page`]).
    ///
    /// # Safety
    /// The CPU must have avx2 and fma.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn sum<const S: usize>(c: &[f32], ahead: usize, page: bool) -> f32 {
        let part = c.len() / S / 32 * 32;
        let mut a = [[_mm256_setzero_ps(); 4]; S];
        let p = c.as_ptr();
        let mut i = 0;
        while i < part {
            for (s, acc) in a.iter_mut().enumerate() {
                let at = p.add(s * part + i);
                if ahead > 0 {
                    // Prefetches never fault; the address is only computed, never read.
                    let f = (at as *const i8).wrapping_add(ahead);
                    _mm_prefetch(f, _MM_HINT_NTA);
                    _mm_prefetch(f.wrapping_add(64), _MM_HINT_NTA);
                }
                if page {
                    fetch_page(at as *const u8, 128);
                }
                for (k, acc) in acc.iter_mut().enumerate() {
                    *acc = _mm256_add_ps(*acc, _mm256_loadu_ps(at.add(8 * k)));
                }
            }
            i += 32;
        }
        let mut out = [0.0f32; 8];
        for acc in a {
            let v = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
            let mut lanes = [0.0f32; 8];
            _mm256_storeu_ps(lanes.as_mut_ptr(), v);
            out.iter_mut().zip(lanes).for_each(|(o, l)| *o += l);
        }
        out.iter().sum::<f32>() + c[S * part..].iter().sum::<f32>()
    }

    /// Twelve independent FMA chains (enough to cover FMA latency × ports) of `iterations` FMAs
    /// on eight lanes each.
    ///
    /// # Safety
    /// The CPU must have avx2 and fma.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn fma_chains(iterations: usize, seed: f32) {
        let mul = _mm256_set1_ps(0.999_999);
        let add = _mm256_set1_ps(1e-7);
        let mut a = [_mm256_set1_ps(seed); 12];
        for _ in 0..iterations {
            for acc in a.iter_mut() {
                *acc = _mm256_fmadd_ps(*acc, mul, add);
            }
        }
        std::hint::black_box(a);
    }
}

/// The FMA peak of the 512-bit registers the AVX-512 panel kernels use.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    /// As the AVX2 `fma_chains`, on sixteen lanes each.
    ///
    /// # Safety
    /// The CPU must have avx512f.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn fma_chains(iterations: usize, seed: f32) {
        let mul = _mm512_set1_ps(0.999_999);
        let add = _mm512_set1_ps(1e-7);
        let mut a = [_mm512_set1_ps(seed); 12];
        for _ in 0..iterations {
            for acc in a.iter_mut() {
                *acc = _mm512_fmadd_ps(*acc, mul, add);
            }
        }
        std::hint::black_box(a);
    }

    /// Twelve independent chains of `vdpbf16ps`, each adding the products of the same two
    /// vectors of bf16 pairs (1.0 and a small step) to its sixteen lanes.
    ///
    /// # Safety
    /// The CPU must have avx512f and avx512bf16.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub unsafe fn bf16_chains(iterations: usize, seed: f32) {
        let ones = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1.0), _mm512_set1_ps(1.0));
        let step = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-7), _mm512_set1_ps(1e-7));
        let mut a = [_mm512_set1_ps(seed); 12];
        for _ in 0..iterations {
            for acc in a.iter_mut() {
                *acc = _mm512_dpbf16_ps(*acc, ones, step);
            }
        }
        std::hint::black_box(a);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_way_of_reading_sums_the_whole_buffer() {
        // Small whole numbers, so every order of the additions gives the exact sum; lengths
        // that leave a tail past the last pair of lines, and halves of unequal length.
        for len in [0, 31, 64, 1000, 4099, 65_537] {
            let buf: Vec<f32> = (0..len).map(|i| (i % 7) as f32).collect();
            let want: f32 = (0..len).map(|i| (i % 7) as f32).sum();
            for threads in [1, 2] {
                let team = Team::new(threads).unwrap();
                for isa in [Isa::Portable, detect()] {
                    for read in READS {
                        assert_eq!(
                            read_all(&team, &buf, isa, read),
                            want,
                            "{len} {threads} {isa:?} {read:?}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn a_slice_reading_counts_the_bytes_of_one_slice() {
        let probe = ReadProbe::new(1 << 20);
        let team = Team::new(2).unwrap();
        for (parts, bytes) in [(16, 65_536.0), (1, 1_048_576.0), (0, 1_048_576.0), (1 << 30, 4.0)] {
            let (b, secs) = probe.rate_slice(&team, ReadWay(0), parts);
            assert_eq!(b, bytes, "{parts}");
            assert!(secs > 0.0 && secs.is_finite(), "{parts}: {secs}");
        }
    }

    #[test]
    fn handoff_is_measured_between_threads_only() {
        assert_eq!(handoff_us(&Team::new(1).unwrap(), 10), 0.0);
        // A real round trip, so above zero; no upper bound: other tests share the cores.
        let h = handoff_us(&Team::new(2).unwrap(), 200);
        assert!(h > 0.0 && h.is_finite(), "{h}");
    }

    /// The bf16 peak is measured exactly where the bf16 kernels multiply with `vdpbf16ps`,
    /// and is a positive rate there (no bound against the f32 one: other tests share the
    /// cores).
    #[test]
    fn bf16_peak_only_where_the_bf16_kernels_use_it() {
        let team = Team::new(2).unwrap();
        let peak = bf16_peak_gflops(&team, 10_000);
        assert_eq!(peak.is_some(), detect() == Isa::Avx512Bf16, "{peak:?} on {:?}", detect());
        if let Some(p) = peak {
            assert!(p > 0.0 && p.is_finite(), "{p}");
        }
    }
}
