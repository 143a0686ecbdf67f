//! Weight matrices in the layout the matrix kernels read: panels of four rows, each panel a run
//! of 16-column chunks with the four rows' chunks side by side.
//!
//! ```text
//! row-major [rows, cols]            packed: panel p = rows 4p..4p+4, chunk k = cols 16k..16k+16
//!   r0: c0 … c15 c16 … c31 …        [r0 c0..16][r1 c0..16][r2 c0..16][r3 c0..16][r0 c16..32] …
//!   r1: …                           then panel p+1
//! ```
//!
//! A matrix-vector product then reads memory strictly in order (one stream the hardware
//! prefetcher follows, however short the rows) while each load of the input serves four rows.
//! Rows are padded with zeros to a multiple of four and columns to a multiple of 16, so kernels
//! have no ragged tails; padded outputs are never written back.

use super::arena::HugeBuf;
use super::dot::{self, groups, Fetch, Int8Path, Isa, ManyFetch};
use super::{Par, SharedSlice};
use crate::weights::{DType, Data, Mat};
use half::{bf16, f16};
use rayon::prelude::*;
use std::ops::Range;

/// Rows per panel.
pub const PANEL: usize = 4;
/// Columns per chunk.
pub const CHUNK: usize = dot::BLOCK;

/// How weights are held once packed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Quant {
    /// Symmetric int8 per output row: `w ≈ q · scale[row]`, the scale of the row's largest
    /// |w| / 127 clipped as `clip_scale` finds least lossy. One scale per row keeps the
    /// kernel's inner loop free of scale work (it is applied to the finished dot product) and
    /// is accurate enough for greedy decoding (see the agreement test).
    Int8,
}

impl Quant {
    pub fn parse(s: &str) -> Option<Quant> {
        match s.to_ascii_lowercase().as_str() {
            "int8" | "i8" => Some(Quant::Int8),
            _ => None,
        }
    }
}

#[derive(Debug, Clone)]
enum Store {
    F32(HugeBuf<f32>),
    BF16(HugeBuf<bf16>),
    F16(HugeBuf<f16>),
    /// Quantized values and one scale per (padded) row.
    I8(HugeBuf<i8>, Vec<f32>),
}

/// A matrix `[rows, cols]` packed for the kernels, in its stored dtype or quantized.
#[derive(Debug, Clone)]
pub struct PackedMat {
    pub rows: usize,
    pub cols: usize,
    /// Columns after padding (a multiple of [`CHUNK`]).
    cols_p: usize,
    store: Store,
}

impl PackedMat {
    /// Packs `m` as it is stored.
    pub fn pack(m: &Mat) -> PackedMat {
        let (rows, cols) = (m.rows, m.cols);
        let (cols_p, store) = match &m.data {
            Data::F32(v) => pack_t(v, rows, cols, Store::F32),
            Data::BF16(v) => pack_t(v, rows, cols, Store::BF16),
            Data::F16(v) => pack_t(v, rows, cols, Store::F16),
        };
        PackedMat { rows, cols, cols_p, store }
    }

    /// Packs `m`, quantized as `quant` says (or as stored for `None`).
    pub fn pack_as(m: &Mat, quant: Option<Quant>) -> PackedMat {
        match quant {
            None => Self::pack(m),
            Some(Quant::Int8) => {
                let (rows, cols) = (m.rows, m.cols);
                let rows_p = rows.next_multiple_of(PANEL);
                let mut scales = vec![0.0f32; rows_p];
                let mut q = vec![0i8; rows * cols];
                // Rows in parallel: choosing a row's scale rounds it several times over. Each
                // worker widens its rows into one buffer of its own.
                q.par_chunks_mut(cols.max(1)).zip(scales[..rows].par_iter_mut()).enumerate().for_each_init(
                    || vec![0.0f32; cols],
                    |row, (r, (qr, sr))| {
                        m.data.to_f32_range(r * cols..(r + 1) * cols, row);
                        let max = row.iter().fold(0.0f32, |a, v| a.max(v.abs()));
                        *sr = if max > 0.0 { clip_scale(row, max) } else { 1.0 };
                        for (d, &v) in qr.iter_mut().zip(row.iter()) {
                            *d = <i8 as dot::Elem>::from_f32(v / *sr);
                        }
                    },
                );
                let (cols_p, store) = pack_t(&q, rows, cols, |v| Store::I8(v, scales));
                PackedMat { rows, cols, cols_p, store }
            }
        }
    }

    /// Bytes a `[rows, cols]` matrix stored as `dtype` will hold once packed as `quant` says:
    /// what [`PackedMat::bytes`] reports after packing, known before any weight is read.
    pub fn bytes_for(rows: usize, cols: usize, dtype: DType, quant: Option<Quant>) -> usize {
        let rows_p = rows.next_multiple_of(PANEL);
        let n = rows_p * cols.next_multiple_of(CHUNK);
        match quant {
            None => n * dtype.size_bytes(),
            Some(Quant::Int8) => n + 4 * rows_p,
        }
    }

    /// Bytes held (and read by one pass over the matrix), padding and scales included.
    pub fn bytes(&self) -> usize {
        match &self.store {
            Store::F32(v) => 4 * v.len(),
            Store::BF16(v) => 2 * v.len(),
            Store::F16(v) => 2 * v.len(),
            Store::I8(v, s) => v.len() + 4 * s.len(),
        }
    }

    /// Name of the element type the kernels read: f32, bf16, f16 or int8.
    pub fn dtype_name(&self) -> &'static str {
        match &self.store {
            Store::F32(_) => "f32",
            Store::BF16(_) => "bf16",
            Store::F16(_) => "f16",
            Store::I8(..) => "int8",
        }
    }

    /// Row `r` as f32 (an embedding lookup).
    pub fn row_f32(&self, r: usize, out: &mut [f32]) {
        self.row_into(r, out, false);
    }

    /// Row `r` added to `out` (a learned position's embedding to its token's).
    pub fn add_row_f32(&self, r: usize, out: &mut [f32]) {
        self.row_into(r, out, true);
    }

    fn row_into(&self, r: usize, out: &mut [f32], add: bool) {
        assert!(r < self.rows && out.len() == self.cols, "row_f32: row {r} of {}", self.rows);
        fn copy<T: dot::Elem>(v: &[T], at: usize, scale: f32, o: &mut [f32], add: bool) {
            let w = v[at..at + o.len()].iter().map(|w| w.to_f32() * scale);
            if add {
                o.iter_mut().zip(w).for_each(|(o, w)| *o += w);
            } else {
                o.iter_mut().zip(w).for_each(|(o, w)| *o = w);
            }
        }
        let (p, lane) = (r / PANEL, r % PANEL);
        for (k, o) in out.chunks_mut(CHUNK).enumerate() {
            let at = p * PANEL * self.cols_p + (k * PANEL + lane) * CHUNK;
            match &self.store {
                Store::F32(v) => copy(v, at, 1.0, o, add),
                Store::BF16(v) => copy(v, at, 1.0, o, add),
                Store::F16(v) => copy(v, at, 1.0, o, add),
                Store::I8(v, s) => copy(v, at, s[r], o, add),
            }
        }
    }
}

/// The int8 scale of a row whose largest |w| is `max`: of `max · c / 127` for clip ratios `c`
/// from 1 down to 0.7, the one whose rounding (values beyond the clip saturate) leaves the
/// least squared error over the row. A few outliers then no longer coarsen every other weight
/// of their row. (On SmolLM2 int8 then agreed with bf16 at 62 and 59 of 64 positions, not 59
/// and 58: `tests/it/quant.rs`.)
fn clip_scale(row: &[f32], max: f32) -> f32 {
    // Rounds by adding and taking away 1.5 · 2^23 (to nearest even, where the quantizer goes
    // away from zero: only exact halves differ), in eight lanes, so that the loop vectorizes:
    // with libm's `round` the search took longer than loading the weights.
    const MAGIC: f32 = 12_582_912.0;
    let err = |scale: f32| -> f32 {
        let inv = 1.0 / scale;
        let mut acc = [0.0f32; 8];
        for ch in row.chunks(8) {
            for (a, &v) in acc.iter_mut().zip(ch) {
                let e = ((v * inv + MAGIC) - MAGIC).clamp(-127.0, 127.0) * scale - v;
                *a += e * e;
            }
        }
        acc.iter().sum()
    };
    (0..=6)
        .map(|i| max * (1.0 - 0.05 * i as f32) / 127.0)
        .map(|s| (err(s), s))
        .fold((f32::INFINITY, max / 127.0), |best, c| if c.0 < best.0 { c } else { best })
        .1
}

/// Packs row-major `v` (`rows × cols`) into panels; returns the padded column count.
fn pack_t<T: dot::Elem + bytemuck::Zeroable>(
    v: &[T],
    rows: usize,
    cols: usize,
    wrap: impl FnOnce(HugeBuf<T>) -> Store,
) -> (usize, Store) {
    let cols_p = cols.next_multiple_of(CHUNK);
    let rows_p = rows.next_multiple_of(PANEL);
    let kc = cols_p / CHUNK;
    // Zeroed: padding rows and columns stay 0.
    let mut out = HugeBuf::<T>::zeroed(rows_p * cols_p);
    out.par_chunks_mut(PANEL * cols_p).enumerate().for_each(|(p, panel)| {
        for lane in 0..PANEL {
            let r = p * PANEL + lane;
            if r >= rows {
                break;
            }
            let src = &v[r * cols..(r + 1) * cols];
            for k in 0..kc {
                let c0 = k * CHUNK;
                let n = CHUNK.min(cols.saturating_sub(c0));
                let at = (k * PANEL + lane) * CHUNK;
                panel[at..at + n].copy_from_slice(&src[c0..c0 + n]);
            }
        }
    });
    (cols_p, wrap(out))
}

/// `out[t][r] = Σ_c w[r][c] · x[t][c]` for `n_tok` tokens: `x` is `[n_tok, w.cols]`, `out` is
/// `[n_tok, w.rows]` (no tokens: nothing to do). Parallel over runs of panels; see `schedule`
/// for the order of work.
/// `team` is a whole [`Team`](super::Team), called from its owner, or one thread of a
/// [`Region`](super::Region), where every thread calls it at once with the same inputs.
pub fn matmul(team: &dyn Par, w: &PackedMat, x: &[f32], n_tok: usize, out: &mut [f32]) {
    assert_eq!(x.len(), n_tok * w.cols, "matmul: input length");
    assert_eq!(out.len(), n_tok * w.rows, "matmul: output length");
    if n_tok == 0 {
        // Nothing to sum (the batch kernels index their last token). Every thread of a region
        // gets the same inputs, so all of them return here, before any barrier.
        return;
    }
    let isa = dot::detect();
    match &w.store {
        Store::F32(d) => matmul_float(team, w, d, x, n_tok, out, isa),
        Store::BF16(d) => matmul_float(team, w, d, x, n_tok, out, isa),
        Store::F16(d) => matmul_float(team, w, d, x, n_tok, out, isa),
        Store::I8(d, s) => matmul_int8(team, w, d, s, x, n_tok, out, isa),
    }
}

/// Bytes of weights [`pick_fetch`] times at the least: past the last-level cache of the CPUs
/// measured (32 MiB), so the products stream from memory as a decode step's do.
const PICK_MIN_BYTES: usize = 64 << 20;
/// Bytes it times at the most, so a large shard does not slow its start: each way is timed
/// [`PICK_ROUNDS`] times (twice that where a first timing would leave the preferred way), 70
/// passes of ~3–9 ms per 256 MiB for the five one-token ways on the 2-core test machines.
const PICK_MAX_BYTES: usize = 256 << 20;
/// Passes per way. Each way's median pass, as a share of its round, decides. On the 2-core
/// Zen 5 machine (SmolLM2 bf16) the fastest of three passes picked a way that decoded ~3%
/// slower than the best in 4 starts of 14, the plain median of five in 6 of 40, the median of
/// seven in 1 of 12. Fourteen, whichever way leads: on the 2-core Zen 3 machine (SmolLM2's
/// layers, `near` the fastest by 2–8% in most picks) seven rounds took another way in 5 picks
/// of 200, fourteen in 2 of them; and the passes right after a shard is loaded can run slow
/// (on Zen 4 the first one to four rounds of some picks took from 10% longer to three times as
/// long as the later ones), enough to put any way ahead for seven rounds. Before, the way used
/// before any was timed (`Near`, `L2`) was kept after seven rounds if it led them. On Zen 4
/// llama-3.2-1b-shaped int8 weights decoded at 0.77–0.81 of the bandwidth in the 3 runs of 51
/// (the cores apart or between) whose pick kept `near` (2) or took `nta` (1), against a median
/// of 0.98 in the 48 with none (0.80–1.11). In 22 starts of SmolLM2 and of the shape in bf16
/// whose picks were judged both ways, seven rounds kept `near` where fourteen took none in 3
/// (in 12 of the int8 shape, none either way).
const PICK_ROUNDS: usize = 14;

/// How much faster than the preferred way (for one token the CPU's, [`dot::preferred_fetch`]:
/// [`Fetch::Page`], or [`Fetch::Near`] on Zen 3; [`ManyFetch::Whole`] for a batch of up to
/// eight) another must time (its median share of a round at most
/// `1 / (1 + PICK_MARGIN)` of the preferred one's) to be picked over it. Each is far ahead
/// while the cores sit apart and ties with others while they sit together. Where the cores
/// sit decides which ways are close, and it changes while a process runs: on the 2-core Zen 4
/// machine, in 20 picks on SmolLM2's layers with the cores together or close, one of `None`,
/// `Near` and `Nta` timed within 0.5% of `Page` (or ahead of it) in 6 and within 2% in 16,
/// and in 20 on llama-3.2-1b's with them apart `None` and `Near` timed 1.1–6.5% behind it,
/// `Nta` 9.9–19.9%. A run whose pick took `Nta` then decoded the llama-3.2-1b shape apart at
/// 0.807 of the probe, where runs with `Page` apart reached 0.90–0.99. Within the margin the
/// pick keeps the preferred way, there `Page`; beyond it (where another CPU streams faster
/// another way) it takes the fastest. Likewise `Whole` (1.17–1.20 of `L2`'s rate apart,
/// 1.01–1.03 together): picked without a preference, it lost to `L2` in 2 of 8 starts of
/// SmolLM2 at a batch of 8, and one of those runs decoded apart at 833 tokens/s, where runs
/// with `Whole` apart reached 1004–1016.
const PICK_MARGIN: f64 = 0.02;

/// A way picked by timing ([`pick_fetch`], [`pick_many_fetch`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Picked<T, const W: usize> {
    pub way: T,
    /// Every way's median pass as a share of its round's mean, in the order of the ways'
    /// `ALL` (NaN for a way not timed), from the timing that decided.
    pub medians: [f64; W],
    /// How many timings of every way it took: 1, or 2 where the first would have left the
    /// preferred way and a second decided.
    pub timings: usize,
}

/// Chooses the way one-token products prefetch ([`Fetch`]) by timing them: one token through
/// `mats` in order (the first of them up to 256 MiB), in one region of `team` as a decode step
/// runs them, fourteen times (`PICK_ROUNDS`) under each way, interleaved, after one untimed
/// pass. Sets the way with the shortest median pass for the process ([`dot::set_fetch`]),
/// unless the CPU's preferred way's ([`dot::preferred_fetch`]: `Page`, `Near` on Zen 3) is
/// within 2% of it (`PICK_MARGIN`; then that way), and returns it, with each way's median pass
/// as a share of its round's mean (in [`Fetch::ALL`]'s order) and the number of timings.
/// Where that would leave the preferred way, every way is timed again and the second timing
/// decides, so another way is picked only if it is ahead by the margin twice running.
/// `None`, and nothing set, when the matrices hold less than 64 MiB: they would be timed in
/// cache, where the prefetch hardly matters.
pub fn pick_fetch(team: &super::Team, mats: &[&PackedMat]) -> Option<Picked<Fetch, { Fetch::ALL.len() }>> {
    pick_way(team, mats, 1, Fetch::ALL, Some(dot::preferred_fetch()), dot::set_fetch)
}

/// Chooses which pieces of one-token products the AVX2 kernels read in three streams
/// ([`dot::Streams`]) as [`pick_fetch`] chooses the prefetch way: one token through `mats`,
/// both ways timed fourteen times, interleaved, under the process's prefetch way; sets the
/// faster for the process ([`dot::set_streams`]) unless the CPU's preferred way's median
/// ([`dot::preferred_streams`]) is within 2% of it (`PICK_MARGIN`), in two timings running
/// where the first would leave the preferred way.
/// `None`, and nothing set, where no AVX2 one-token kernel reads `mats` (the 512-bit kernels
/// and AVX512-VNNI's int8 one read every piece in one stream) or they hold less than 64 MiB.
pub fn pick_streams(
    team: &super::Team,
    mats: &[&PackedMat],
) -> Option<Picked<dot::Streams, { dot::Streams::ALL.len() }>> {
    if !mats.iter().any(|m| reads_in_streams(m, dot::detect())) {
        return None;
    }
    let prefer = Some(dot::preferred_streams());
    pick_way(team, mats, 1, dot::Streams::ALL, prefer, dot::set_streams)
}

/// Whether one token through `m` on `isa` goes through an AVX2 kernel that reads long pieces
/// in several streams (the float one, or int8 on `maddubs` or AVX-VNNI).
fn reads_in_streams(m: &PackedMat, isa: Isa) -> bool {
    match m.store {
        Store::I8(..) => matches!(dot::int8_path_for(isa), dot::Int8Path::Maddubs | dot::Int8Path::AvxVnni),
        _ => isa == Isa::Avx2,
    }
}

/// Chooses the way the many-token bf16 kernel of AVX512_BF16 prefetches ([`ManyFetch`]) as
/// [`pick_fetch`] chooses the one-token way: `n_tok` tokens (2 to 15, a batch's decode
/// step) through `mats` (the way names the hint of every row's requests: 16 KiB ahead in rows
/// narrower than [`dot::SPREAD_FROM`], spread over the passes in wider ones), every way timed
/// fourteen times, interleaved; sets the fastest for the process ([`dot::set_many_fetch`]),
/// unless [`ManyFetch::Whole`]'s median is within 2% of it (`PICK_MARGIN`; then `Whole`), in
/// two timings running where the first would leave `Whole`.
/// Past [`dot::WHOLE_MAX`] tokens `Whole` streams as `L2` does, so it is not timed (its
/// median NaN). `None`, and nothing set, where that kernel does not run them (not
/// bf16 weights, not AVX512_BF16, a token count outside that range) or they hold less than
/// 64 MiB.
pub fn pick_many_fetch(
    team: &super::Team,
    mats: &[&PackedMat],
    n_tok: usize,
) -> Option<Picked<ManyFetch, { ManyFetch::ALL.len() }>> {
    let bf16 = mats.iter().all(|m| matches!(m.store, Store::BF16(_)));
    if !bf16 || dot::detect() != Isa::Avx512Bf16 || !(2..PROMPT_FROM).contains(&n_tok) {
        return None;
    }
    if n_tok <= dot::WHOLE_MAX {
        let set = dot::set_many_fetch;
        return pick_way(team, mats, n_tok, ManyFetch::ALL, Some(ManyFetch::Whole), set);
    }
    let ways = [ManyFetch::L2, ManyFetch::Nta];
    let picked = pick_way(team, mats, n_tok, ways, None, dot::set_many_fetch)?;
    let median = |w| ways.iter().position(|&v| v == w).map_or(f64::NAN, |i| picked.medians[i]);
    Some(Picked { way: picked.way, medians: ManyFetch::ALL.map(median), timings: picked.timings })
}

/// Picks one of the `ways` of streaming `mats` for [`pick_fetch`] and [`pick_many_fetch`]:
/// `n_tok` tokens through the matrices in order (the first of them up to 256 MiB) in one
/// region of `team`, [`PICK_ROUNDS`] times under each way (`set` makes a way the process's),
/// interleaved, after one untimed pass. Sets the way with the shortest median pass, each
/// pass as a share of its round's mean (`prefer` where its median is within [`PICK_MARGIN`]
/// of that), and returns it with every way's median (in `ways`' order) and the number of
/// timings; `None`, and no way set, when the matrices hold less than 64 MiB.
fn pick_way<T: Copy + PartialEq, const W: usize>(
    team: &super::Team,
    mats: &[&PackedMat],
    n_tok: usize,
    ways: [T; W],
    prefer: Option<T>,
    set: impl Fn(T),
) -> Option<Picked<T, W>> {
    let (mut timed, mut bytes) = (Vec::new(), 0);
    for &m in mats {
        if bytes >= PICK_MAX_BYTES {
            break;
        }
        timed.push(m);
        bytes += m.bytes();
    }
    if bytes < PICK_MIN_BYTES {
        return None;
    }
    let cols = timed.iter().map(|m| m.cols).max().unwrap_or(0);
    let rows = timed.iter().map(|m| m.rows).max().unwrap_or(0);
    let x: Vec<f32> = (0..n_tok * cols).map(|c| ((c % 13) as f32 - 6.0) / 64.0).collect();
    let mut out = vec![0.0f32; n_tok * rows];
    let shared = SharedSlice::new(&mut out);
    // One pass of every timed product under way `k`, in seconds.
    let pass = |k: usize| {
        set(ways[k]);
        let t = std::time::Instant::now();
        team.region(&|r| {
            for m in &timed {
                // SAFETY: each product writes its rows in disjoint ranges and ends with a
                // barrier before the next one writes them again.
                let out = unsafe { shared.range(0, n_tok * m.rows) };
                matmul(r, m, &x[..n_tok * m.cols], n_tok, out);
            }
        });
        t.elapsed().as_secs_f64()
    };
    let picked = pick_by(pass, prefer.and_then(|p| ways.iter().position(|&w| w == p)));
    set(ways[picked.way]);
    Some(Picked { way: ways[picked.way], medians: picked.medians, timings: picked.timings })
}

/// The timing behind [`pick_way`]: one untimed pass, then [`PICK_ROUNDS`] rounds of `pass(k)`
/// (seconds) for every way `k` of `W`, each round starting with another way. Returns the way
/// with the shortest median pass, each pass as a share of its round's mean (way `prefer`
/// where its median share is at most `1 + PICK_MARGIN` times that one's), every way's
/// median share and the number of timings. (The first pass after a shard is loaded took
/// 1.3–4.9 times the median of its way's later ones in most picks on the 2-core Zen 4
/// machine, so, timed, it counted against the way of the first round's first pass.)
///
/// Where those rounds would leave `prefer`, every way is timed again and the second rounds
/// decide (their medians returned): another way is picked only if it beats the preferred one
/// by the margin twice running. On the 2-core Zen 4 machine, in 200 picks in a row on
/// SmolLM2's layers (the cores together), one put `None` more than 2% ahead of `Page`, and no
/// two in a row did, while with the way named SmolLM2 had decoded at 0.842–0.870 of the probe
/// under `Page` against 0.822–0.833 under `None` (the cores between). One timing took another
/// way than `Page` in 6 of 100 starts of the table's commands; in the 100 after this rule, two
/// timings running did so in 1. Where another way is faster on a CPU, its second win costs the
/// start one more timing.
fn pick_by<const W: usize>(mut pass: impl FnMut(usize) -> f64, prefer: Option<usize>) -> Picked<usize, W> {
    pass(0);
    let (way, medians) = pick_rounds(&mut pass, prefer);
    match prefer {
        Some(p) if way != p => {
            let (way, medians) = pick_rounds(&mut pass, prefer);
            Picked { way, medians, timings: 2 }
        }
        _ => Picked { way, medians, timings: 1 },
    }
}

/// One timing of [`pick_by`]: [`PICK_ROUNDS`] rounds of every way, the way picked and every
/// way's median share of its rounds.
fn pick_rounds<const W: usize>(
    pass: &mut impl FnMut(usize) -> f64,
    prefer: Option<usize>,
) -> (usize, [f64; W]) {
    let mut secs: [Vec<f64>; W] = std::array::from_fn(|_| Vec::with_capacity(PICK_ROUNDS));
    for round in 0..PICK_ROUNDS {
        for k in 0..W {
            // Each round starts with another way, so none is always the first after the last.
            let k = (k + round) % W;
            secs[k].push(pass(k));
        }
    }
    // Each pass as a share of its round's mean, so that a host's drift from round to round
    // does not count for the ways timed while it read faster.
    let mean: Vec<f64> =
        (0..PICK_ROUNDS).map(|r| secs.iter().map(|s| s[r]).sum::<f64>() / W as f64).collect();
    let median: [f64; W] = std::array::from_fn(|k| {
        let mut rel: Vec<f64> = secs[k].iter().zip(&mean).map(|(t, m)| t / m).collect();
        rel.sort_by(f64::total_cmp);
        rel[rel.len() / 2]
    });
    let k = (0..W).min_by(|&a, &b| median[a].total_cmp(&median[b])).unwrap_or(0);
    match prefer {
        Some(p) if median[p] <= median[k] * (1.0 + PICK_MARGIN) => (p, median),
        _ => (k, median),
    }
}

thread_local! {
    /// The inputs in the kernel's order and padding; grows to the largest input, then is reused.
    static PREPARED: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    /// One panel's column block widened to f32 ([`dot::widen_for_avx2`]), reused.
    static WIDE: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    /// The inputs rounded to bf16 for [`Isa::Avx512Bf16`]'s many-token kernel.
    static ROUNDED: std::cell::RefCell<Vec<bf16>> = const { std::cell::RefCell::new(Vec::new()) };
    /// Each token group's running sums between the column sub-blocks of a paired product
    /// ([`PAIR_SUB_BLOCK`]), reused.
    #[cfg(target_arch = "x86_64")]
    static RUNNING: std::cell::RefCell<Vec<dot::PairAcc>> = const { std::cell::RefCell::new(Vec::new()) };
    /// The inputs quantized for int8 weights: values, one scale per chunk, and for many
    /// tokens on a VNNI path the values offset to unsigned ([`dot::offset_q8`]).
    static QUANTIZED: std::cell::RefCell<(Vec<i8>, Vec<f32>, Vec<u8>)> =
        const { std::cell::RefCell::new((Vec::new(), Vec::new(), Vec::new())) };
}

/// Sizes the calling thread's buffers for widened panels and for the running sums of paired
/// products, so that many-token products allocate nothing on it.
pub fn reserve_thread_buffers() {
    WIDE.with_borrow_mut(|buf| crate::grow(buf, PANEL * WIDE_K_BLOCK));
    #[cfg(target_arch = "x86_64")]
    RUNNING.with_borrow_mut(|running| {
        let groups = running_groups();
        if running.len() < groups {
            // SAFETY: all-zero bits are valid f32 registers.
            running.resize(groups, unsafe { std::mem::zeroed() });
        }
    });
}

/// Most tokens summed together against one panel: a group in 512-bit registers and in int8
/// (AVX2 float products take three: [`float_group`]; a prompt's float products in 512-bit
/// registers six, [`PROMPT_GROUP`]).
const TOK_GROUP: usize = 4;

/// Tokens a prompt's float products sum together against one panel in 512-bit FMAs (f16 and
/// f32 weights, bf16 without AVX512_BF16; [`dot::avx512_panel_quad`]): each group's pass over a
/// run of panels reads their blocks from L2 ([`PANEL_RUN_BYTES`]), so groups of six read them
/// two thirds as often as groups of four, 29 of the 32 registers live. With tiles of
/// [`AVX512_TILE_BYTES`] (each pass of the weights from memory serving twice the tokens) and
/// [`SPLIT_RUN_PANELS`], on the 2-core Zen 5 machine products of 512 tokens ran, in GFLOP/s, f16
/// weights: 2048 × 2048 429–434 against 422–424, 16384 × 2048 426–429 against 386–399, 2048 ×
/// 8192 385–389 against 351–355; f32 weights 342–344 against 296–309, 307–313 against 251–258
/// and 283 against 227–233; llama-3.2-1b's prefill of 512 tokens at 0.735–0.749 of the FMA peak
/// against 0.678–0.701 with f16 weights, 0.731–0.736 against 0.694–0.706 with bf16 in FMAs,
/// 0.508–0.552 against 0.448–0.457 with f32 (three pairs each, interleaved), SmolLM2's shape
/// with f16 weights 1430–1539 tokens/s against 1307–1419. Groups of six with tiles of 256 KiB,
/// or tiles of 512 KiB with groups of four, gained nothing alone. The sums are the same bits as
/// in groups of four.
const PROMPT_GROUP: usize = 6;

/// Tokens a float product of `n_tok` tokens sums together against one panel on `isa`: three in
/// AVX2, whose kernel takes all four rows of a panel and fills its 16 registers with three
/// tokens ([`dot::avx2_panel_rows`]); [`PROMPT_GROUP`] for a prompt in 512-bit registers; else
/// [`TOK_GROUP`].
fn float_group(isa: Isa, n_tok: usize) -> usize {
    match isa {
        Isa::Avx2 => dot::AVX2_FLOAT_GROUP,
        Isa::Avx512 | Isa::Avx512Bf16 if n_tok >= PROMPT_FROM => PROMPT_GROUP,
        _ => TOK_GROUP,
    }
}

/// Float weights: inputs in f32, rearranged for the weight type.
fn matmul_float<T: dot::Elem + dot::Avx2Load>(
    team: &dyn Par,
    w: &PackedMat,
    d: &[T],
    x: &[f32],
    n_tok: usize,
    out: &mut [f32],
    isa: Isa,
) {
    let (cols, cols_p) = (w.cols, w.cols_p);
    // Inputs already in the kernel's order and padding are read where they are: a copy of
    // them on the calling thread would hold up the team before every product.
    if cols == cols_p && dot::keeps_order::<T>(isa) {
        return float_products(team, w, d, &x[..n_tok * cols], n_tok, out, isa);
    }
    PREPARED.with_borrow_mut(|buf| {
        crate::grow(buf, n_tok * cols_p);
        for t in 0..n_tok {
            dot::prepare::<T>(&x[t * cols..(t + 1) * cols], &mut buf[t * cols_p..(t + 1) * cols_p], isa);
        }
        float_products(team, w, d, &buf[..n_tok * cols_p], n_tok, out, isa)
    })
}

/// [`matmul_float`] on prepared inputs `xp` (`[n_tok, cols_p]`).
fn float_products<T: dot::Elem + dot::Avx2Load>(
    team: &dyn Par,
    w: &PackedMat,
    d: &[T],
    xp: &[f32],
    n_tok: usize,
    out: &mut [f32],
    isa: Isa,
) {
    let cols_p = w.cols_p;
    if n_tok == 1 {
        let fetch = dot::fetch();
        one_token(team, w.rows, PANEL * cols_p * std::mem::size_of::<T>(), out, &|panels, o| {
            float_panels(&d[panels.start * PANEL * cols_p..panels.end * PANEL * cols_p], xp, o, isa, fetch);
        });
        return;
    }
    if let (Isa::Avx512Bf16, Some(d)) = (isa, as_bf16(d)) {
        return paired_products(team, w, d, xp, n_tok, out);
    }
    let k_max = float_k_max(isa);
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx2 && n_tok < PROMPT_FROM {
        // A batch's decode step: each thread streams its panels through one kernel call per
        // range, every panel against every token group while it is in L1.
        let (rows, kb, shared) = (w.rows, column_block(cols_p, k_max), SharedSlice::new(out));
        team.for_ranges(rows.div_ceil(PANEL), 2, &|panels| {
            let ws = &d[panels.start * PANEL * cols_p..panels.end * PANEL * cols_p];
            let r0 = panels.start * PANEL;
            let o = shared.span(r0, (n_tok - 1) * rows + (rows - r0).min(ws.len() / cols_p));
            // SAFETY: `Isa::Avx2` is only produced after detecting avx2, fma and f16c; `ws` is
            // whole panels of `cols_p` columns (a multiple of the chunk, as `kb` is) and `xp`
            // `cols_p` entries per token; token t's rows r0.. of this range lie in `out`
            // (`[n_tok, rows]`), and the team hands out each panel in one range.
            unsafe {
                dot::avx2_panels_many::<T, true>(
                    ws,
                    cols_p,
                    (xp, cols_p),
                    n_tok,
                    o,
                    rows,
                    rows - r0,
                    (kb, false),
                    |_| {},
                )
            };
        });
        return;
    }
    let (g, tile_bytes) = (float_group(isa, n_tok), float_tile_bytes(isa));
    schedule(team, (w.rows, cols_p, k_max, tile_bytes), n_tok, out, &|panels, cr, ts, emit, dst| {
        let xs = |t: usize, nt: usize| -> [&[f32]; PROMPT_GROUP] {
            std::array::from_fn(|i| &xp[(t + i.min(nt - 1)) * cols_p..][cr.clone()])
        };
        let panel = |p: usize| &d[p * PANEL * cols_p..][cr.start * PANEL..cr.end * PANEL];
        #[cfg(not(target_arch = "x86_64"))]
        let _ = dst;
        #[cfg(target_arch = "x86_64")]
        if isa == Isa::Avx2 && ts.len() >= WIDEN_FROM {
            // Each panel's block once in f32 for all the tile's groups: f32 weights as they
            // are, others widened first (cheaper than widening again for every group: in the
            // AVX2 bf16 kernel the widening takes a fifth of the time). The groups then go
            // through one kernel call, which stores their sums itself (f32 weights went group
            // by group over runs of panels before: llama-3.2-1b's prefill of 512 tokens on Zen
            // 3 at 0.35–0.39 of the FMA peak, 0.55–0.66 this way).
            //
            // The next panel's block: where the block is the whole row and is widened, the
            // widening asks for it, 8 KiB ahead. Otherwise a share of it is asked for before
            // each group of this one, so that it is found in L2. (Where the block is narrower
            // than the row, the next one lies a panel ahead: asking 8 KiB ahead there asked for
            // this panel's next column block, read only in a later pass. In llama-3.2-1b's
            // prefill on Zen 3 the widening then took an eighth of the time, waiting on
            // memory, and 3% this way; its products ran ~10% faster.)
            let (split, n_groups) = (cr.len() < cols_p, groups(ts.clone(), g).count());
            let as_is = as_elem::<f32, T>(d).is_some();
            let rows = w.rows;
            let x = &xp[ts.start * cols_p + cr.start..];
            for p in panels.clone() {
                let (next, block) =
                    (((split || as_is) && p + 1 < panels.end).then(|| panel(p + 1)), panel(p));
                let r0 = p * PANEL;
                let o = dst.span(ts.start * rows + r0, (ts.len() - 1) * rows + PANEL.min(rows - r0));
                let ask = |k: usize| {
                    if let Some(next) = next {
                        dot::prefetch_share(next, k, n_groups);
                    }
                };
                // SAFETY: this path runs on `Isa::Avx2` alone, itself only produced after
                // detecting avx2, fma and f16c; `block` is one panel of `cr.len()` columns (a
                // multiple of the chunk, as column blocks are), `x` holds `ts`'s inputs
                // `cols_p` apart from column `cr.start`; tokens `ts`' rows r0.. of panel p lie
                // in `out` (`[n_tok, rows]`), and the team hands out each panel in one range.
                let many = |block: &[f32]| unsafe {
                    dot::avx2_panels_many::<f32, false>(
                        block,
                        cr.len(),
                        (x, cols_p),
                        ts.len(),
                        o,
                        rows,
                        PANEL.min(rows - r0),
                        (cr.len(), cr.start > 0),
                        ask,
                    )
                };
                match as_elem::<f32, T>(block) {
                    Some(block) => many(block),
                    None => WIDE.with_borrow_mut(|buf| {
                        crate::grow(buf, block.len());
                        let wide = &mut buf[..block.len()];
                        dot::widen_for_avx2(block, wide, isa, !split);
                        many(wide)
                    }),
                }
            }
            return;
        }
        // A prompt: token groups outer and panels inner, over runs of panels whose blocks fill
        // `PANEL_RUN_BYTES` (two panels where a block is narrower than the row:
        // `SPLIT_RUN_PANELS`), so that a group's inputs stay in L1 while the run's weights come
        // from L2. A batch's decode step: each panel against every group while it is in L1.
        let run = if ts.len() < PROMPT_FROM {
            1
        } else if cr.len() < cols_p {
            SPLIT_RUN_PANELS
        } else {
            (PANEL_RUN_BYTES / (PANEL * cr.len() * std::mem::size_of::<T>())).max(1)
        };
        let mut r0 = panels.start;
        while r0 < panels.end {
            let r1 = (r0 + run).min(panels.end);
            for group in groups(ts.clone(), g) {
                for p in r0..r1 {
                    // The block read after this one: for a prompt, the same column block of
                    // the next panel (this panel's next block comes in a later pass; past
                    // the last panel, an address only asked for); for a batch (`schedule`
                    // then takes a panel's blocks in turn), the one that follows in memory.
                    let next = if n_tok < PROMPT_FROM {
                        panel(p).as_ptr_range().end
                    } else {
                        block_at(d, p + 1, cols_p, cr.start)
                    };
                    by_groups(p, group.clone(), g, emit, |t, acc| {
                        panel_dot(panel(p), &xs(t, acc.len())[..acc.len()], acc, isa, next)
                    });
                }
            }
            r0 = r1;
        }
    });
}

/// Many tokens of bf16 weights on [`Isa::Avx512Bf16`]: the prepared inputs `xp` (`[n_tok,
/// cols_p]`) rounded to bf16 once ([`dot::round_for_dot_bf16`]), then scheduled as
/// [`float_products`] does.
fn paired_products(team: &dyn Par, w: &PackedMat, d: &[bf16], xp: &[f32], n_tok: usize, out: &mut [f32]) {
    let cols_p = w.cols_p;
    ROUNDED.with_borrow_mut(|buf| {
        crate::grow(buf, n_tok * cols_p);
        let rounded = &mut buf[..n_tok * cols_p];
        dot::round_for_dot_bf16(xp, rounded, Isa::Avx512Bf16);
        let rounded = &*rounded;
        let (kb, tile) = blocks(cols_p, K_BLOCK, n_tok, TILE_BYTES);
        if n_tok < PROMPT_FROM || (kb == cols_p && n_tok <= tile) {
            // One tile (decode of a batch, a short prompt in one column block): each thread
            // streams its panels through one kernel call per range, the sums stored from their
            // registers (and added, for the column blocks of a batch's wide rows); two panels
            // at a time for a prompt's tokens, and for a batch of two token groups or more.
            let pairs = (n_tok >= PROMPT_FROM && cols_p <= PAIR_SUB_BLOCK)
                || (PAIRS_FROM..PROMPT_FROM).contains(&n_tok);
            let (rows, shared, fetch) = (w.rows, SharedSlice::new(out), dot::many_fetch());
            team.for_ranges(rows.div_ceil(PANEL), 2, &|panels| {
                let ws = &d[panels.start * PANEL * cols_p..panels.end * PANEL * cols_p];
                let r0 = panels.start * PANEL;
                // SAFETY: `Isa::Avx512Bf16` is only produced after detecting avx512f,
                // avx512bf16, avx2, fma and f16c; `ws` is whole panels of `cols_p` columns and
                // `rounded` `cols_p` entries per token; token t's rows r0.. of this range lie
                // in `out` (`[n_tok, rows]`), and the team hands out each panel in one range.
                let o = shared.span(r0, (n_tok - 1) * rows + (rows - r0).min(ws.len() / cols_p));
                unsafe {
                    dot::avx512_panels_many_bf16(
                        ws,
                        cols_p,
                        rounded,
                        n_tok,
                        o,
                        rows,
                        rows - r0,
                        pairs,
                        kb,
                        fetch,
                    )
                };
            });
            return;
        }
        schedule(team, (w.rows, cols_p, K_BLOCK, PAIRED_TILE), n_tok, out, &|panels, cr, ts, emit, _| {
            // SAFETY: `Isa::Avx512Bf16` is only produced after detecting avx512f, avx512bf16,
            // avx2, fma and f16c; `panels` lie in `d` (PANEL × cols_p each), `cr` in every
            // rounded input (cols_p each), `ts` among the `n_tok` inputs.
            unsafe { paired_panels(d, cols_p, rounded, panels, cr, ts, emit) }
        });
    });
}

/// Most columns the paired kernel sums against a group of tokens before the next group: two
/// panels' 768 columns (12 KiB) and four tokens' inputs (6 KiB) stay in L1, even in
/// the 32 KiB of a Zen 4 core. A wider column block goes by sub-blocks of at most this, each
/// token group's running sums kept between them ([`RUNNING`]), so that they are the sums of
/// one pass, bit for bit. (On the 2-core Zen 5 machine, 48 KiB of L1, llama-3.2-1b's products
/// of 512 tokens ran at 485–651 GFLOP/s two panels at a time in sub-blocks of 1024, against
/// 321–439 one panel at a time over 2048 columns; its prefill of 512 tokens took 2.03–2.04 s
/// in sub-blocks of 768, 2.07 in 1024 and 2.09 in 512.)
const PAIR_SUB_BLOCK: usize = 768;

/// Tokens of a batch's decode step from which its bf16 products on AVX512_BF16 go two panels
/// at a time (two full token groups or more): each input chunk then meets two panels' weights,
/// half the loads of inputs per multiply-add. On the 2-core Zen 5 machine SmolLM2 at a batch of
/// 8 decoded at 1002–1036 tokens/s against 837–911 while the cores sat apart (five pairs,
/// interleaved) and at 895–898 against 834–879 together (two pairs); the llama-2-7b shape at
/// 19.2 against 19.5 tokens/s together and 20.6 against 17.3 in a pair whose runs met different
/// spells; a batch of 12 the same or faster (1061 against 1066, 1126 against 1071). With fewer
/// tokens pairs did not pay: a batch of 2 slower (317 and 363 against 362 and 416 tokens/s), of
/// 4 and 6 the same, of 5 slower (582 against 648), its last group of one token reading two
/// panels' weights from L2 again. The sums are the same bits either way.
const PAIRS_FROM: usize = 2 * TOK_GROUP;

/// Tokens (of a tile) from which a many-token product is taken as a prompt's rather than a
/// batch's decode step: bf16 on AVX512_BF16 then goes two panels at a time in the one-tile
/// path, and the float kernels take token groups outer ([`PANEL_RUN_BYTES`]). (On the 2-core
/// Zen 5 machine SmolLM2's prompt of 64 tokens prefilled at 0.91 of the FMA peak with pairs,
/// 0.68–0.71 without, while at a batch of 8 decode steps pairs made no difference beyond the
/// noise where they applied only to rows of up to 768 columns (over every width they pay, see
/// [`PAIRS_FROM`]); with its products in FMAs (`GRIDLM_NO_AVX512BF16=1`) a batch
/// of 8 decoded at 857–875 tokens/s with groups outer against 893–906 with panels outer, as
/// now: 903–972 against 909–924 the build before.)
const PROMPT_FROM: usize = 16;

/// Token groups whose running sums a paired product keeps between sub-blocks at most: those
/// of a tile of the narrowest block that has two (see [`tile_tokens`]).
fn running_groups() -> usize {
    tile_tokens(PAIR_SUB_BLOCK + CHUNK, PAIRED_TILE).div_ceil(TOK_GROUP)
}

/// Sums columns `cr` of `panels` of bf16 weights `d` against tokens `ts` of the rounded
/// inputs (`cols_p` each), two panels at a time ([`dot::avx512_pair_acc_bf16`]), handing
/// each panel's sums per group of [`TOK_GROUP`] tokens to `emit` as [`PanelFn`] says.
///
/// # Safety
/// The CPU must have avx512f, avx512bf16, avx2, fma and f16c; `panels` are whole panels of
/// `d` (PANEL × cols_p each), `cr` lies within `cols_p` on chunk boundaries, and every token of
/// `ts` has its rounded input in `rounded`.
#[cfg(target_arch = "x86_64")]
unsafe fn paired_panels(
    d: &[bf16],
    cols_p: usize,
    rounded: &[bf16],
    panels: Range<usize>,
    cr: Range<usize>,
    ts: Range<usize>,
    emit: &mut Emit,
) {
    assert!(
        panels.end * PANEL * cols_p <= d.len() && cr.end <= cols_p && ts.end * cols_p <= rounded.len(),
        "paired_panels: panels, columns or tokens out of range"
    );
    let subs = cr.len().div_ceil(PAIR_SUB_BLOCK);
    let sub = cr.len().div_ceil(subs).next_multiple_of(CHUNK);
    let groups = ts.len().div_ceil(TOK_GROUP);
    let stride = PANEL * cols_p;
    // SAFETY: all-zero bits are valid f32 registers.
    let zero = || -> dot::PairAcc { unsafe { std::mem::zeroed() } };
    RUNNING.with_borrow_mut(|running| {
        if subs > 1 && running.len() < groups {
            running.resize(groups, zero());
        }
        let mut own = zero();
        // Where the block is narrower than the row, 16 KiB past a chunk lies in the same panel's
        // next column block, read only in a later pass: there the kernel asks for nothing. (On
        // the 2-core Zen 5 machine products of 512 tokens ran, in GFLOP/s, 2048 × 8192 at 634–668
        // against 585–609 with the requests, 4096 × 11008 616–632 against 593–600, 896 × 4864
        // 595–625 against 573–594 (three rounds each, interleaved); llama-3.2-1b's prefill of 512
        // tokens at 313.9–321.4 tokens/s against 311.2–313.7 (four pairs), llama-2-7b's of 256
        // at 43.0–43.8 against 41.4–42.1 (two).)
        let split = cr.len() < cols_p;
        let mut p = panels.start;
        while p < panels.end {
            let np = (panels.end - p).min(2);
            let mut s0 = cr.start;
            while s0 < cr.end {
                let s1 = (s0 + sub).min(cr.end);
                let wp = d.as_ptr().add(p * stride + s0 * PANEL);
                for (g, t) in ts.clone().step_by(TOK_GROUP).enumerate() {
                    let nt = TOK_GROUP.min(ts.end - t);
                    let acc = if subs > 1 { &mut running[g] } else { &mut own };
                    if s0 == cr.start {
                        *acc = zero();
                    }
                    let x = |i: usize| rounded.as_ptr().add((t + i.min(nt - 1)) * cols_p + s0);
                    let (n, x, none) = (s1 - s0, std::array::from_fn(x), dot::Ahead::NONE);
                    if split {
                        dot::avx512_pair_acc_bf16_n::<{ dot::AVX512_NO_REQUESTS }>(
                            np, nt, wp, stride, n, x, acc, none,
                        );
                    } else {
                        dot::avx512_pair_acc_bf16_n::<{ dot::AVX512_TO_L2 }>(
                            np, nt, wp, stride, n, x, acc, none,
                        );
                    }
                    if s1 == cr.end {
                        for k in 0..np {
                            emit(p + k, t, &dot::avx512_pair_acc_sums(acc, k)[..nt]);
                        }
                    }
                }
                s0 = s1;
            }
            p += np;
        }
    });
}

/// `w` as bf16, if its elements are bf16.
fn as_bf16<T: 'static>(w: &[T]) -> Option<&[bf16]> {
    as_elem::<bf16, T>(w)
}

/// `w` as `[U]`, if its elements are `U`.
fn as_elem<U: 'static, T: 'static>(w: &[T]) -> Option<&[U]> {
    (std::any::TypeId::of::<T>() == std::any::TypeId::of::<U>())
        // SAFETY: T is U itself, so the slice is reinterpreted as its own type.
        .then(|| unsafe { std::slice::from_raw_parts(w.as_ptr() as *const U, w.len()) })
}

/// Int8 weights: each input is quantized per group of [`XGROUP`] columns to |q| ≤
/// [`dot::INT8_INPUT_MAX`] (its own scale per group, so an outlier only coarsens its
/// own group), and the products are summed in integers.
#[allow(clippy::too_many_arguments)]
fn matmul_int8(
    team: &dyn Par,
    w: &PackedMat,
    d: &[i8],
    scales: &[f32],
    x: &[f32],
    n_tok: usize,
    out: &mut [f32],
    isa: Isa,
) {
    let (cols, cols_p) = (w.cols, w.cols_p);
    let kc = cols_p.div_ceil(XGROUP);
    let path = dot::int8_path_for(isa);
    QUANTIZED.with_borrow_mut(|(xq, xs, xu)| {
        crate::grow(xq, n_tok * cols_p);
        crate::grow(xs, n_tok * kc);
        for t in 0..n_tok {
            quantize_groups(
                &x[t * cols..(t + 1) * cols],
                &mut xq[t * cols_p..(t + 1) * cols_p],
                &mut xs[t * kc..(t + 1) * kc],
                dot::INT8_INPUT_MAX,
            );
        }
        let (xq, xs) = (&xq[..n_tok * cols_p], &xs[..n_tok * kc]);
        // Weights of `o`'s panels against input `q` (scales `s`), times `row_scales`.
        let run = |wp: &[i8], q: &[i8], s: &[f32], row_scales: &[f32], o: &mut [f32], fetch: Fetch| match path
        {
            Int8Path::Portable => panels_q8_portable(wp, q, s, row_scales, o),
            #[cfg(target_arch = "x86_64")]
            // SAFETY: every other path is only produced on a non-portable `Isa`, itself only
            // produced after detecting avx2, fma and f16c, and a VNNI path after detecting its
            // VNNI; `q` was quantized for `path`; `wp` holds the panels of `o`'s rows over the
            // columns of `q` (a multiple of CHUNK), with one scale per XGROUP columns and one
            // row scale per panel row.
            _ => unsafe { dot::avx2_panels_q8(wp, q, s, row_scales, o, fetch, path) },
            #[cfg(not(target_arch = "x86_64"))]
            _ => panels_q8_portable(wp, q, s, row_scales, o),
        };
        if n_tok == 1 {
            let fetch = dot::fetch();
            one_token(team, w.rows, PANEL * cols_p, out, &|panels, o| {
                let rows = panels.start * PANEL..panels.end * PANEL;
                run(&d[rows.start * cols_p..rows.end * cols_p], xq, xs, &scales[rows], o, fetch);
            });
            return;
        }
        // A token group goes through each panel at once: with AVX512-VNNI in 512-bit registers,
        // its inputs offset to unsigned ([`dot::avx2_panel_q8_many`]); elsewhere in 256-bit
        // ones, as the one-token kernel sums them ([`dot::avx2_panel_q8_tokens`]). Portable
        // code goes token by token.
        let many = dot::int8_many(isa);
        // The inputs' unsigned side for those kernels: offset for AVX512-VNNI's, |q| for the
        // 256-bit one's; the portable path reads none.
        let unsigned = if path == Int8Path::Portable { 0 } else { n_tok * cols_p };
        crate::grow(xu, unsigned);
        if many {
            dot::offset_q8(xq, &mut xu[..unsigned]);
        } else {
            dot::abs_q8(xq, &mut xu[..unsigned]);
        }
        let xu = &xu[..unsigned];
        // A row in one column block, as one token sums it, however many tokens: a token's
        // sums are then the same bits in any step. The inputs are a byte a column, so a tile's
        // fill `TILE_BYTES` with four times the tokens of a float tile.
        schedule(team, (w.rows, cols_p, cols_p, 4 * TILE_BYTES), n_tok, out, &|panels, cr, ts, emit, _| {
            let groups = cr.start / XGROUP..cr.end.div_ceil(XGROUP);
            for p in panels {
                let panel = &d[p * PANEL * cols_p..][cr.start * PANEL..cr.end * PANEL];
                let row_scales = &scales[p * PANEL..(p + 1) * PANEL];
                by_groups(p, ts.clone(), TOK_GROUP, emit, |t, acc| {
                    #[cfg(target_arch = "x86_64")]
                    if path != Int8Path::Portable {
                        let rows = (t, acc.len());
                        let s = group_rows(xs, rows, kc, groups.start);
                        if many {
                            let x = group_rows(xu, rows, cols_p, cr.start);
                            // In wide rows, each group's share of the next panel's block (see
                            // `dot::SPREAD_FROM`; an int8 row is one block, `cr` all of it),
                            // asked for once per two chunks (a scale group of the inputs).
                            let ahead = (cols_p >= dot::SPREAD_FROM).then(|| {
                                let next = block_at(d, p + 1, cols_p, cr.start);
                                let pass = ((t - ts.start) / TOK_GROUP, ts.len().div_ceil(TOK_GROUP));
                                let lines = (PANEL * cr.len()).div_ceil(64);
                                dot::Ahead::share(
                                    next as *const u8,
                                    lines,
                                    pass,
                                    (cr.len() / CHUNK).div_ceil(2),
                                )
                            });
                            // SAFETY: `many` only after detecting AVX512-VNNI on a 512-bit ISA
                            // (itself only after detecting avx512f, avx2, fma and f16c), where
                            // the path is a VNNI one; `panel` is four rows of the block's columns
                            // (a multiple of CHUNK), and each token's offset input (`xu`) and
                            // scales cover them.
                            unsafe { dot::avx2_panel_q8_many(panel, x, s, row_scales, acc, ahead) };
                        } else {
                            let (x, xa) = (
                                group_rows(xq, rows, cols_p, cr.start),
                                group_rows(xu, rows, cols_p, cr.start),
                            );
                            // SAFETY: `path` is not the portable one, so it was produced on an
                            // ISA detected with avx2, fma and f16c (and its VNNI, if it names
                            // one); `panel` is four rows of the block's columns (a multiple of
                            // CHUNK), and each token's input (quantized for `path`), its |q|
                            // (`xu`, not `many`) and its scales cover them.
                            unsafe { dot::avx2_panel_q8_tokens(panel, x, xa, s, row_scales, acc, path) };
                        }
                        return;
                    }
                    for (i, a) in acc.iter_mut().enumerate() {
                        let (q, s) =
                            (&xq[(t + i) * cols_p..][cr.clone()], &xs[(t + i) * kc..][groups.clone()]);
                        run(panel, q, s, row_scales, a, Fetch::Near);
                    }
                });
            }
        });
    });
}

/// Columns of an input that share one scale (column blocks start on a group).
pub(crate) const XGROUP: usize = 2 * CHUNK;
const _: () = assert!(XGROUP.is_multiple_of(CHUNK));

/// `x` (padded with zeros to `q.len()`) as integers |q| ≤ `max` (at most 127) with one scale
/// per group of `XGROUP` columns: `x ≈ q · s[group]`.
pub fn quantize_groups(x: &[f32], q: &mut [i8], s: &mut [f32], max: i8) {
    assert!((1..=127).contains(&max), "quantize_groups: |q| ≤ {max}");
    #[cfg(target_arch = "x86_64")]
    if dot::detect() != Isa::Portable {
        // SAFETY: every non-portable Isa is only produced after detecting avx2 and fma.
        return unsafe { quantize_groups_avx2(x, q, s, max) };
    }
    quantize_groups_body(x, q, s, max);
}

/// [`quantize_groups`] in AVX2 for the groups wholly inside `x` (the rest as the portable
/// version), with the same results: the portable loop reduces each group's max one element
/// after another and calls libm's `round` for every element: 12.3 µs for a 2048-wide input
/// on the 2-core test machine, 1.8 µs here (a llama-3.2-1b int8 decode step quantizes 231 424
/// input elements).
///
/// # Safety
/// The CPU must have avx2 and fma.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn quantize_groups_avx2(x: &[f32], q: &mut [i8], s: &mut [f32], max_q: i8) {
    use std::arch::x86_64::*;
    let max_f = max_q as f32;
    const _: () = assert!(XGROUP == 32);
    let full = (x.len() / XGROUP).min(s.len()).min(q.len() / XGROUP);
    let sign = _mm256_set1_ps(-0.0);
    // `round` goes half away from zero: truncate after adding the largest float below one half,
    // with the value's sign.
    let half = _mm256_set1_ps(f32::from_bits(0.5f32.to_bits() - 1));
    let (lo, hi) = (_mm256_set1_epi32(-(max_q as i32)), _mm256_set1_epi32(max_q as i32));
    // The two packs leave the group's four-byte runs in the order 0 2 4 6 1 3 5 7.
    let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (k, sk) in s[..full].iter_mut().enumerate() {
        let xp = x.as_ptr().add(k * XGROUP);
        let v: [__m256; 4] = std::array::from_fn(|i| _mm256_loadu_ps(xp.add(8 * i)));
        // A NaN is passed over (the second operand wins), as by f32::max.
        let m = v.iter().fold(_mm256_setzero_ps(), |m, vi| _mm256_max_ps(_mm256_andnot_ps(sign, *vi), m));
        let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        let max = _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
        *sk = max / max_f;
        let inv = _mm256_set1_ps(if max > 0.0 { max_f / max } else { 0.0 });
        let t: [__m256i; 4] = std::array::from_fn(|i| {
            let r = _mm256_mul_ps(v[i], inv);
            // NaN becomes 0, as `as i8` makes it.
            let r = _mm256_and_ps(r, _mm256_cmp_ps(r, r, _CMP_ORD_Q));
            let r = _mm256_add_ps(r, _mm256_or_ps(half, _mm256_and_ps(r, sign)));
            _mm256_min_epi32(_mm256_max_epi32(_mm256_cvttps_epi32(r), lo), hi)
        });
        let b = _mm256_packs_epi16(_mm256_packs_epi32(t[0], t[1]), _mm256_packs_epi32(t[2], t[3]));
        let b = _mm256_permutevar8x32_epi32(b, order);
        _mm256_storeu_si256(q.as_mut_ptr().add(k * XGROUP) as *mut __m256i, b);
    }
    quantize_groups_body(&x[full * XGROUP..], &mut q[full * XGROUP..], &mut s[full..], max_q);
}

/// The portable [`quantize_groups`].
pub(crate) fn quantize_groups_body(x: &[f32], q: &mut [i8], s: &mut [f32], max_q: i8) {
    let max_f = max_q as f32;
    for (k, (qc, sc)) in q.chunks_mut(XGROUP).zip(s.iter_mut()).enumerate() {
        let xc = x.get(k * XGROUP..((k + 1) * XGROUP).min(x.len())).unwrap_or(&[]);
        let max = xc.iter().fold(0.0f32, |a, v| a.max(v.abs()));
        *sc = max / max_f;
        let inv = if max > 0.0 { max_f / max } else { 0.0 };
        for (i, d) in qc.iter_mut().enumerate() {
            *d = xc.get(i).map_or(0, |&v| (v * inv).round().clamp(-max_f, max_f) as i8);
        }
    }
}

/// Int8 panels against one quantized input: per group an exact integer sum, scaled by the
/// input's group scale, then by the row's (see [`dot::avx2_panels_q8`]).
fn panels_q8_portable(w: &[i8], q: &[i8], s: &[f32], row_scales: &[f32], out: &mut [f32]) {
    let n = q.len();
    for (p, o) in out.chunks_mut(PANEL).enumerate() {
        let panel = &w[p * PANEL * n..(p + 1) * PANEL * n];
        for (lane, ol) in o.iter_mut().enumerate() {
            let mut acc = 0.0f32;
            for (g, qg) in q.chunks(XGROUP).enumerate() {
                let mut isum = 0i64;
                for (k, qc) in qg.chunks_exact(CHUNK).enumerate() {
                    let wc = &panel[((g * XGROUP / CHUNK + k) * PANEL + lane) * CHUNK..][..CHUNK];
                    isum += wc.iter().zip(qc).map(|(&w, &x)| w as i64 * x as i64).sum::<i64>();
                }
                acc += isum as f32 * s[g];
            }
            *ol = acc * row_scales[p * PANEL + lane];
        }
    }
}

/// Float panels against one prepared input on `isa`: `out[PANEL·p + lane] = row lane of
/// panel p · x`, for the panels `w` holds (`out` may end inside the last one), prefetching
/// the weights as `fetch` says.
fn float_panels<T: dot::Elem + dot::Avx2Load>(w: &[T], x: &[f32], out: &mut [f32], isa: Isa, fetch: Fetch) {
    assert!(
        x.len().is_multiple_of(CHUNK) && w.len() == PANEL * x.len() * out.len().div_ceil(PANEL),
        "float_panels: shapes"
    );
    let kb = column_block(x.len(), float_k_max(isa));
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa::Avx2` is only produced after detecting avx2, fma and f16c; the shapes
        // are the kernel's, checked above.
        Isa::Avx2 => unsafe { dot::avx2_panels(w, x, kb, out, fetch) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa::Avx512` is only produced after detecting avx512f, avx2, fma and f16c;
        // shapes as above.
        Isa::Avx512 => unsafe { dot::avx512_panels(w, x, kb, out, fetch) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa::Avx512Bf16` is only produced after detecting avx512f, avx512bf16, avx2,
        // fma and f16c; shapes as above.
        Isa::Avx512Bf16 => unsafe {
            match as_bf16(w) {
                Some(w) => dot::avx512_panels_bf16(w, x, kb, out, fetch),
                None => dot::avx512_panels(w, x, kb, out, fetch),
            }
        },
        _ => panels_portable(w, x, kb, out),
    }
}

/// The portable [`float_panels`].
fn panels_portable<T: dot::Elem>(w: &[T], x: &[f32], kb: usize, out: &mut [f32]) {
    let n = x.len();
    for (p, o) in out.chunks_mut(PANEL).enumerate() {
        let panel = &w[p * PANEL * n..(p + 1) * PANEL * n];
        for (lane, ol) in o.iter_mut().enumerate() {
            let chunk =
                |k: usize, xc: &[f32]| dot::dot1_portable(&panel[(k * PANEL + lane) * CHUNK..][..CHUNK], xc);
            // Column blocks of `kb`, the first block's sum as it is and then each added in
            // order, as `store` adds a many-token product's blocks.
            let block = |b: usize, xb: &[f32]| -> f32 {
                xb.chunks_exact(CHUNK).enumerate().map(|(k, xc)| chunk(b * kb / CHUNK + k, xc)).sum()
            };
            let mut blocks = x.chunks(kb).enumerate();
            let first = blocks.next().map_or(0.0, |(b, xb)| block(b, xb));
            *ol = blocks.fold(first, |sums, (b, xb)| sums + block(b, xb));
        }
    }
}

/// Least bytes of weights a thread takes at a time in a one-token product (and at least two
/// panels): each piece starts a stream from memory anew (see `Pieces` in [`super::team`]). On
/// the 2-core Zen 3 machine SmolLM2's decode steps took the same time (within 1%) with halves
/// of at least 32, 64 or 128 KiB or 16 panels; halves of at least 64 KiB took 2–5% less than
/// the quarters of at least two panels used before.
const STREAM_PIECE_BYTES: usize = 64 << 10;

/// One token: runs of whole panels (`panel_bytes` each), each thread streaming its own share
/// of the matrix in halves of what it has left, at least [`STREAM_PIECE_BYTES`] at a time
/// (see [`Team::for_streams`]); `run(panels, o)` writes those panels' rows `o`.
fn one_token(
    team: &dyn Par,
    rows: usize,
    panel_bytes: usize,
    out: &mut [f32],
    run: &(dyn Fn(Range<usize>, &mut [f32]) + Sync),
) {
    let shared = SharedSlice::new(&mut out[..rows]);
    let min = (STREAM_PIECE_BYTES / panel_bytes.max(1)).max(2);
    team.for_streams(rows.div_ceil(PANEL), min, &|panels| {
        let (r0, r1) = (panels.start * PANEL, (panels.end * PANEL).min(rows));
        // SAFETY: the team hands out each panel in exactly one range, so row ranges are disjoint.
        run(panels, unsafe { shared.range(r0, r1 - r0) });
    });
}

/// Sums columns `cols` of a run of panels against tokens `ts`, handing the sums of each panel
/// and group of at most [`TOK_GROUP`] tokens to `emit(panel, first token, sums)` (see
/// [`by_groups`]), every panel's groups in order, or storing them itself into the output
/// (`[n_tok, rows]`, the last argument) as `emit` would.
type PanelFn<'a> = dyn Fn(Range<usize>, Range<usize>, Range<usize>, &mut Emit, &SharedSlice) + Sync + 'a;
/// Takes one group's sums: `sums[i][lane]` is token `t + i`'s sum for panel `p`'s row `lane`.
type Emit<'a> = dyn FnMut(usize, usize, &[[f32; PANEL]]) + 'a;

/// Runs `sum(t, acc)` for each of the [`groups`] of `ts` of at most `g` tokens in order (`acc`
/// zeroed, one entry per token of the group), and hands each group's sums for panel `p` to
/// `emit`.
fn by_groups(
    p: usize,
    ts: Range<usize>,
    g: usize,
    emit: &mut Emit,
    mut sum: impl FnMut(usize, &mut [[f32; PANEL]]),
) {
    for group in groups(ts, g) {
        let mut acc = [[0.0f32; PANEL]; PROMPT_GROUP];
        let acc = &mut acc[..group.len()];
        sum(group.start, acc);
        emit(p, group.start, acc);
    }
}

/// Tokens of a tile from which a float panel is widened to f32 once for all of them (on AVX2,
/// for bf16 and f16 weights) rather than by the kernel for each group ([`float_group`]), and
/// meets them all in one kernel call (f32 panels too, as they are).
const WIDEN_FROM: usize = 4 * TOK_GROUP;

/// Most columns per pass of a many-token product: a block's inputs for a tile of tokens stay
/// in L2, and one panel's block in L1 (16 KiB of 16-bit weights, 8 KiB of int8, 32 KiB of
/// f32: the whole L1 of a Zen 1 or Zen 4 core, yet in one trial on Zen 4 blocks of 1024 f32
/// columns were no faster).
const K_BLOCK: usize = 2048;
/// The same for panels widened to f32 ([`WIDEN_FROM`]), so that the widened block is 16 KiB.
/// (On the 2-core test machine a 4096 × 2048 bf16 product of 64 or 256 tokens ran at 0.75–0.90
/// of the FMA peak, median 0.79, before widening; widened, at 0.75–0.84 in blocks of 2048,
/// 0.85–0.93 in blocks of 1024 and 0.67–0.76 in blocks of 512.)
const WIDE_K_BLOCK: usize = 1024;
/// Bytes of inputs (one column block of a tile of tokens) kept in L2.
const TILE_BYTES: usize = 256 << 10;
/// The same on CPUs with AVX-512, whose L2 holds 1 MiB or more a core: for paired products
/// ([`paired_panels`]) and the float ones in 512-bit FMAs ([`float_tile_bytes`]). (On the
/// 2-core Zen 5 machine, paired, in sub-blocks of 1024, the 16384 × 2048
/// product of 512 tokens ran at 583–595 GFLOP/s with tiles of 512 KiB, 512–521 with 256 KiB,
/// llama-3.2-1b's other products the same within the noise. Since its inputs are rounded to
/// bf16 once, not stored twice over, llama-3.2-1b's prefill of 512 tokens ran at 305–332
/// tokens/s with tiles of 512 KiB of them, 128 tokens, against 270–315 with 256 KiB, as many
/// tokens as before, and 294–307 with 1 MiB. In FMAs, tiles of 512 KiB with groups of
/// [`PROMPT_GROUP`] tokens: see there.)
const AVX512_TILE_BYTES: usize = 512 << 10;
/// [`AVX512_TILE_BYTES`] as [`tile_tokens`] counts inputs (4 bytes a column): the rounded bf16
/// inputs take 2.
const PAIRED_TILE: usize = 2 * AVX512_TILE_BYTES;

/// Bytes of a float product's tile of inputs on `isa`: [`AVX512_TILE_BYTES`] in 512-bit
/// registers, else [`TILE_BYTES`] (the 512 KiB L2 of Zen 2 and 3 holds no more beside a run of
/// weights).
fn float_tile_bytes(isa: Isa) -> usize {
    match isa {
        Isa::Avx512 | Isa::Avx512Bf16 => AVX512_TILE_BYTES,
        _ => TILE_BYTES,
    }
}

/// Bytes of weights (a run of panels' column blocks) that the float kernels' many-token
/// products keep in L2 while every token group of a tile passes over them, each group's
/// inputs in L1 meanwhile: with the panel outer and the groups inner, each group's inputs
/// (four tokens, 32 KiB of f32 at 2048 columns) came from L2 for every panel, twice the bytes
/// of an f16 panel's block. Beside a tile's inputs ([`TILE_BYTES`]) it fits the 512 KiB L2 of
/// Zen 2 and 3. (On the 2-core Zen 5 machine llama-3.2-1b's products of 512 tokens ran, in
/// GFLOP/s, f16 weights: 344–415 against 302–339; bf16 in FMAs (`GRIDLM_NO_AVX512BF16=1`):
/// 352–420 against 308–350; f32: 221–270 against 224–232; f32 in AVX2: 160–170 against
/// 127–145; runs of 96 to 768 KiB did about as well. Its prefill of 512 tokens went from
/// 0.58–0.60 of the FMA peak to 0.67 with f16 weights, from 0.56–0.57 to 0.67–0.68 with bf16
/// in FMAs, from 0.43–0.44 to 0.46–0.47 with f32.)
const PANEL_RUN_BYTES: usize = 192 << 10;
/// Panels a prompt's run holds, instead of [`PANEL_RUN_BYTES`], where its column block is
/// narrower than the row: the run's blocks then lie a whole panel apart (a panel holds its
/// rows' blocks one after the other), and two of them a run did best; why two and not three
/// was not found out. (On the 2-core Zen 5 machine, products of 512 tokens in groups of
/// [`PROMPT_GROUP`], f16 weights, in GFLOP/s: 2048 × 8192 at 374–389 in runs of two panels
/// against 343–353 in runs of 192 KiB, 326–349 of one panel, 355–358 of three; 3072 × 8192
/// 359–368 against 337–347; 4096 × 11008 341–354 against 329–331; 896 × 4864 353–359 against
/// 342–354; f32 weights 278–293 against 247–259.)
const SPLIT_RUN_PANELS: usize = 2;

/// Tokens per tile of a many-token product whose column blocks are `kb` wide, when a tile's
/// inputs fill `bytes` at 4 bytes a column (f32; the rounded bf16 inputs of
/// [`paired_products`] take half that).
fn tile_tokens(kb: usize, bytes: usize) -> usize {
    (bytes / (kb * 4)).max(TOK_GROUP).next_multiple_of(TOK_GROUP)
}

/// The column block width and the tokens per tile of an `n_tok`-token product over `cols_p`
/// columns (see [`schedule`]): the blocks of [`column_block`], at most `k_max` wide, and tiles
/// whose inputs fill `tile_bytes`.
///
/// A batch's decode step (under [`PROMPT_FROM`] tokens) goes in one tile however wide the
/// rows: its inputs fit L2 (8 tokens of 8192 columns: 256 KiB). Its column blocks are the same
/// as every other step's ([`column_block`]), but `schedule` takes each panel's blocks one after
/// the other, so the kernels' prefetch, which runs ahead along a panel, fetches what is read
/// next. Each block over all panels before the next, it fetched the next block's columns, read
/// only a pass later: on the 2-core Zen 5 machine the llama-2-7b shape decoded a batch of 8 at
/// 10.7 tokens/s that way and 15.8–16.7 a panel at a time, a batch of 4 at 6.2 and 10.2.
fn blocks(cols_p: usize, k_max: usize, n_tok: usize, tile_bytes: usize) -> (usize, usize) {
    let kb = column_block(cols_p, k_max);
    if n_tok < PROMPT_FROM {
        return (kb, n_tok);
    }
    (kb, tile_tokens(kb, tile_bytes))
}

/// The width of the column blocks a product sums a row of `cols_p` columns in, given the
/// widest it takes (`k_max`): equal blocks, each starting on an input group (int8 inputs have
/// a scale per group), each summed in one pass, their sums added in f32 in column order. One
/// token, a batch's decode step and a prompt's tiles all sum a row this way (the one-token
/// kernels add their blocks' sums as `schedule` does), so a token's products are the same bits
/// whatever else shares its step.
#[inline]
fn column_block(cols_p: usize, k_max: usize) -> usize {
    // A row of one block without the divisions: many-token products ask this of every block of
    // every panel.
    if cols_p <= k_max {
        return cols_p;
    }
    cols_p.div_ceil(cols_p.div_ceil(k_max)).next_multiple_of(XGROUP).min(cols_p)
}

/// The widest column block of a float product on `isa`: [`WIDE_K_BLOCK`] on AVX2, whose
/// many-token products widen a panel's block to f32 at once, else [`K_BLOCK`]. (Int8 products
/// sum a row in one block on every path: see `matmul_int8`.)
fn float_k_max(isa: Isa) -> usize {
    if isa == Isa::Avx2 {
        WIDE_K_BLOCK
    } else {
        K_BLOCK
    }
}

/// Runs `panel_fn` over every panel, column block and token group, spread over the team, and
/// writes the sums into `out` (`[n_tok, rows]`).
///
/// Many tokens (one token goes by [`one_token`]) go by column blocks of equal width, at most
/// `k_max`, and tiles of tokens whose inputs fill `tile_bytes` (in L2); each thread streams
/// its own run of panels, as one token does ([`Team::for_ranges`]: on the 2-core Zen 4 machine
/// 8 and 16 tokens of SmolLM2's layer products took 2–3% less than with eight blocks handed
/// out in turn), and each panel's column block (see [`K_BLOCK`]; two panels' sub-block in
/// [`paired_panels`]) stays in L1 while every token group of the tile passes over it. Weights
/// are then read once per tile and inputs once per panel from L2, not from memory.
/// `panel_fn` gets each thread's run of panels whole.
fn schedule(
    team: &dyn Par,
    (rows, cols_p, k_max, tile_bytes): (usize, usize, usize, usize),
    n_tok: usize,
    out: &mut [f32],
    panel_fn: &PanelFn,
) {
    let n_panels = rows.div_ceil(PANEL);
    let shared = SharedSlice::new(out);
    // Sums panels × tokens t0..t1 over columns `cr`; the first column block writes, the
    // others add.
    let run = |panels: Range<usize>, cr: Range<usize>, t0: usize, t1: usize| {
        let first = cr.start == 0;
        let mut emit = |p: usize, t: usize, sums: &[[f32; PANEL]]| {
            let r0 = p * PANEL;
            let nr = PANEL.min(rows - r0);
            for (i, a) in sums.iter().enumerate() {
                // SAFETY: rows r0..r0+nr of token t+i belong to panel p, and each panel is in
                // exactly one range handed out by the team for this pass.
                dot::store_sums(unsafe { shared.range((t + i) * rows + r0, nr) }, a, first);
            }
        };
        panel_fn(panels, cr, t0..t1, &mut emit, &shared);
    };
    let (kb, tile) = blocks(cols_p, k_max, n_tok, tile_bytes);
    if kb < cols_p && n_tok < PROMPT_FROM {
        // A batch's decode step over wide rows: each panel's column blocks one after the
        // other, so the panels are read in memory order, as one token reads them, and the
        // kernels' prefetch, which runs ahead along a panel, fetches the next block.
        team.for_ranges(n_panels, 2, &|panels| {
            for p in panels {
                for c0 in (0..cols_p).step_by(kb) {
                    run(p..p + 1, c0..(c0 + kb).min(cols_p), 0, n_tok);
                }
            }
        });
        return;
    }
    for c0 in (0..cols_p).step_by(kb) {
        let cr = c0..(c0 + kb).min(cols_p);
        for t0 in (0..n_tok).step_by(tile) {
            let t1 = (t0 + tile).min(n_tok);
            team.for_ranges(n_panels, 2, &|panels| run(panels, cr.clone(), t0, t1));
        }
    }
}

/// All four rows of a panel against `NT` (two or three) inputs in AVX2, asking for the weights
/// ahead of the panel (it is read from memory).
///
/// # Safety
/// As [`dot::avx2_panel_rows`].
#[cfg(target_arch = "x86_64")]
unsafe fn rows<T: dot::Elem + dot::Avx2Load, const NT: usize>(
    panel: &[T],
    xs: [&[f32]; NT],
    acc: &mut [[f32; PANEL]],
    next: *const T,
) {
    for (a, v) in acc.iter_mut().zip(dot::avx2_panel_rows::<T, NT, true>(panel, xs, next)) {
        *a = v;
    }
}

/// All four rows of a panel against `NT` inputs in 512-bit registers.
///
/// # Safety
/// As [`dot::avx512_panel_quad`].
#[cfg(target_arch = "x86_64")]
unsafe fn quad<T: dot::Elem + dot::Avx2Load, const NT: usize>(
    panel: &[T],
    xs: [&[f32]; NT],
    acc: &mut [[f32; PANEL]],
    next: *const T,
) {
    for (a, v) in acc.iter_mut().zip(dot::avx512_panel_quad::<T, NT>(panel, xs, next)) {
        *a = v;
    }
}

/// Where the column block from `c0` of panel `p` begins in `d` (packed panels of `cols_p`
/// columns): an address only, computed wrapping, so `p` may be one past the last panel (for
/// requests ahead, which read nothing).
fn block_at<T>(d: &[T], p: usize, cols_p: usize, c0: usize) -> *const T {
    d.as_ptr().wrapping_add((p * cols_p + c0) * PANEL)
}

/// Where the int8 token-group kernels read a group's rows of `v` (one per token, `stride`
/// apart) from column `start`: tokens `t..t + n` of `(t, n)`, the last of them standing in for
/// the kernels' unused ones.
#[cfg(target_arch = "x86_64")]
fn group_rows<T>(v: &[T], (t, n): (usize, usize), stride: usize, start: usize) -> [*const T; TOK_GROUP] {
    std::array::from_fn(|k| v[(t + k.min(n - 1)) * stride + start..].as_ptr())
}

/// Sums one panel against 1 to 6 prepared inputs (AVX2 takes up to 3): `acc[i][lane] = row
/// lane · xs[i]`; the kernels' requests run on past the panel's block into `next` (the block
/// read after it).
#[inline]
fn panel_dot<T: dot::Elem + dot::Avx2Load>(
    panel: &[T],
    xs: &[&[f32]],
    acc: &mut [[f32; PANEL]],
    isa: Isa,
    next: *const T,
) {
    match (isa, xs.len()) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa::Avx2` is only produced after detecting avx2, fma and f16c; lengths are
        // checked by the callers (a panel is PANEL × cols_p, each input cols_p).
        (Isa::Avx2, 2) => unsafe { rows::<T, 2>(panel, [xs[0], xs[1]], acc, next) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        (Isa::Avx2, 3) => unsafe { rows::<T, 3>(panel, [xs[0], xs[1], xs[2]], acc, next) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa::Avx512` and `Isa::Avx512Bf16` are only produced after detecting
        // avx512f, avx2, fma and f16c; lengths as above (bf16 weights do not come here on
        // `Isa::Avx512Bf16`: see `paired_products`).
        (Isa::Avx512 | Isa::Avx512Bf16, 2) => unsafe { quad::<T, 2>(panel, [xs[0], xs[1]], acc, next) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        (Isa::Avx512 | Isa::Avx512Bf16, 3) => unsafe {
            quad::<T, 3>(panel, [xs[0], xs[1], xs[2]], acc, next)
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        (Isa::Avx512 | Isa::Avx512Bf16, 4) => unsafe {
            quad::<T, 4>(panel, [xs[0], xs[1], xs[2], xs[3]], acc, next)
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        (Isa::Avx512 | Isa::Avx512Bf16, 5) => unsafe {
            quad::<T, 5>(panel, [xs[0], xs[1], xs[2], xs[3], xs[4]], acc, next)
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        (Isa::Avx512 | Isa::Avx512Bf16, 6) => unsafe {
            quad::<T, 6>(panel, [xs[0], xs[1], xs[2], xs[3], xs[4], xs[5]], acc, next)
        },
        // One input, or the portable path.
        _ => {
            for (x, a) in xs.iter().zip(acc.iter_mut()) {
                // The panel's block is in L1 (see `schedule`): the kernel's own prefetch.
                float_panels(panel, x, a, isa, Fetch::Near);
            }
        }
    }
}

/// The matrix back in row-major f32 (tests).
#[cfg(test)]
pub(crate) fn unpack(w: &PackedMat) -> Vec<f32> {
    let mut out = vec![0.0; w.rows * w.cols];
    for r in 0..w.rows {
        w.row_f32(r, &mut out[r * w.cols..(r + 1) * w.cols]);
    }
    out
}

#[cfg(test)]
mod tests {
    // Not among `kernels::tests`: `launch/test-avx512` runs those under an emulator, where
    // timing 80 MiB of products nine times would take far too long.
    use super::*;
    use crate::kernels::Team;

    /// A `rows` × 1024 matrix of `dtype`, every weight 0.5.
    fn filled(rows: usize, dtype: DType) -> PackedMat {
        PackedMat::pack(&Mat { rows, cols: 1024, data: Data::F32(vec![0.5; rows * 1024]).cast(dtype) })
    }

    /// Every way of `all` was timed (`secs`, in `all`'s order), and `picked` was the fastest.
    fn assert_fastest<T: PartialEq + std::fmt::Debug>(all: &[T], picked: T, secs: &[f64]) {
        assert!(secs.iter().all(|s| s.is_finite() && *s > 0.0), "{secs:?}");
        let k = all.iter().position(|w| *w == picked).unwrap();
        assert!(secs.iter().all(|&s| s >= secs[k]), "{picked:?} {secs:?}");
    }

    /// `picked` was `prefer` while its time (`secs`, in `all`'s order) lay within
    /// [`PICK_MARGIN`] of the fastest, else the fastest ([`assert_fastest`]). Restates
    /// `pick_by`'s rule on purpose, as an independent check.
    fn assert_picked_preferring<T: Copy + PartialEq + std::fmt::Debug>(
        all: &[T],
        prefer: T,
        picked: T,
        secs: &[f64],
    ) {
        let p = all.iter().position(|w| *w == prefer).unwrap();
        if secs[p] <= secs.iter().copied().fold(f64::INFINITY, f64::min) * (1.0 + PICK_MARGIN) {
            assert_eq!(picked, prefer, "{secs:?}");
        } else {
            assert_fastest(all, picked, secs);
        }
    }

    /// Token groups cover their range in order, each of at most `g` tokens; groups of three
    /// and of six leave no lone token where there are two or more, and the other sizes cut as
    /// before.
    #[test]
    fn token_groups_cover_the_range_without_a_lone_token() {
        let sizes = |n: usize, g: usize| groups(10..10 + n, g).map(|r| r.len()).collect::<Vec<_>>();
        assert_eq!(sizes(8, 3), [3, 3, 2]);
        assert_eq!(sizes(4, 3), [2, 2]);
        assert_eq!(sizes(7, 3), [3, 2, 2]);
        assert_eq!(sizes(1, 3), [1]);
        assert_eq!(sizes(0, 3), [0usize; 0]);
        assert_eq!(sizes(9, 4), [4, 4, 1]);
        assert_eq!(sizes(5, 2), [2, 2, 1]);
        assert_eq!(sizes(19, 6), [6, 6, 5, 2]);
        assert_eq!(sizes(18, 6), [6, 6, 6]);
        assert_eq!(sizes(16, 6), [6, 6, 4]);
        for g in 1..=PROMPT_GROUP {
            for n in 0..40 {
                let gs: Vec<_> = groups(10..10 + n, g).collect();
                let mut next = 10;
                for r in &gs {
                    assert!(r.start == next && (1..=g).contains(&r.len()), "{n} tokens by {g}: {gs:?}");
                    next = r.end;
                }
                assert_eq!(next, 10 + n, "{n} tokens by {g}");
                if (g == 3 || g == 6) && n >= 2 {
                    assert!(gs.iter().all(|r| r.len() > 1), "{n} tokens by {g}: {gs:?}");
                }
            }
        }
    }

    /// The rounds behind a pick: an untimed first pass, then fourteen of every way, whichever
    /// leads; the way with the shortest median pass is picked, even where another led the
    /// first rounds, and a preferred way where it is within the margin of that one, or where a
    /// second timing finds it so.
    #[test]
    fn the_pick_is_the_fastest_way_over_fourteen_rounds_whichever_led_the_first() {
        // Scripted passes: `secs(k, round)` is way k's pass in that round; the first pass of
        // all is untimed, and takes ten times as long.
        let run_preferring = |secs: &dyn Fn(usize, usize) -> f64, prefer: Option<usize>| {
            let (mut passes, mut first) = ([0usize; 4], true);
            let picked = pick_by::<4>(
                |k| {
                    if std::mem::take(&mut first) {
                        return 10.0;
                    }
                    passes[k] += 1;
                    secs(k, passes[k] - 1)
                },
                prefer,
            );
            // Every way as many passes (one timing's or two's), as many timings as it says.
            assert!(passes.iter().all(|&p| p == passes[0]), "{passes:?}");
            assert_eq!(passes[0], PICK_ROUNDS * picked.timings, "{picked:?}");
            (picked.way, picked.medians, passes[0])
        };
        let run = |secs: &dyn Fn(usize, usize) -> f64| {
            let (k, median, passes) = run_preferring(secs, None);
            assert_eq!(passes, PICK_ROUNDS);
            (k, median)
        };
        // One way the fastest throughout: it is picked, whichever it is.
        for fast in 0..4 {
            let (k, median) = run(&|k, _| if k == fast { 0.9 } else { 1.0 });
            assert_eq!(k, fast, "{median:?}");
            assert!((0..4).all(|o| o == fast || median[o] > median[fast]), "{median:?}");
        }
        // A start that spares one way (ahead for the first five rounds, then behind another):
        // the other is picked. (Seven rounds alone would have picked the first.)
        let (k, median) = run(&|k, round| match k {
            1 if round < 5 => 0.8,
            0 => 0.95,
            _ => 1.0,
        });
        assert_eq!(k, 0, "{median:?}");
        // A preferred way is kept while the fastest is less than `PICK_MARGIN` ahead of it
        // (1% here), and left for one further ahead (3%), whichever way is preferred.
        for prefer in 0..4 {
            let fast = (prefer + 1) % 4;
            for (ahead, picked) in [(0.01, prefer), (0.03, fast)] {
                let secs = |k: usize, _| match k {
                    k if k == fast => 1.0,
                    k if k == prefer => 1.0 + ahead,
                    _ => 1.2,
                };
                let (k, median, passes) = run_preferring(&secs, Some(prefer));
                assert_eq!(k, picked, "{prefer} preferred, {fast} {ahead} ahead: {median:?}");
                // Left only after a second timing agrees.
                assert_eq!(passes, PICK_ROUNDS * if k == prefer { 1 } else { 2 });
            }
        }
        // Another way ahead of the preferred one by 3% in the first timing only: the second
        // keeps the preferred way. Ahead in the second only: the first kept it, no second.
        // Ahead in both: picked.
        for (first, second, picked, timings) in [(0.97, 1.0, 2, 2), (1.0, 0.97, 2, 1), (0.97, 0.97, 1, 2)] {
            let secs = |k: usize, round: usize| match k {
                1 if round < PICK_ROUNDS => first,
                1 => second,
                2 => 1.0,
                _ => 1.2,
            };
            let (k, median, passes) = run_preferring(&secs, Some(2));
            assert_eq!(k, picked, "{first} then {second}: {median:?}");
            assert_eq!(passes, PICK_ROUNDS * timings);
        }
    }

    #[test]
    fn pick_fetch_times_only_matrices_past_the_cache() {
        let _g = dot::FETCH_LOCK.lock().unwrap_or_else(|e| e.into_inner());
        let before = dot::fetch();
        let team = Team::new(2).unwrap();
        // 8 MiB: in cache, not timed, nothing set.
        dot::set_fetch(Fetch::Far);
        assert!(pick_fetch(&team, &[&filled(4096, DType::BF16)]).is_none());
        assert_eq!(dot::fetch(), Fetch::Far);
        // 2 x 40 MiB: timed; every way once at least, and the fastest is set (the CPU's
        // preferred way while it is within the margin).
        let (a, b) = (filled(20480, DType::BF16), filled(20480, DType::BF16));
        let picked = pick_fetch(&team, &[&a, &b]).expect("80 MiB are timed");
        assert_picked_preferring(&Fetch::ALL, dot::preferred_fetch(), picked.way, &picked.medians);
        assert_eq!(dot::fetch(), picked.way);
        // A second timing only where the first left the preferred way, and then it decided.
        assert!(picked.timings == 1 || picked.timings == 2, "{picked:?}");
        assert!(picked.timings == 2 || picked.way == dot::preferred_fetch(), "{picked:?}");
        dot::set_fetch(before);
    }

    #[test]
    fn pick_streams_times_where_an_avx2_kernel_streams_the_matrices() {
        let _g = dot::FETCH_LOCK.lock().unwrap_or_else(|e| e.into_inner());
        let before = dot::streams();
        let team = Team::new(2).unwrap();
        let (a, b) = (filled(20480, DType::BF16), filled(20480, DType::BF16));
        // int8 at one byte a weight: 2 x 40 MiB too.
        let [qa, qb] = [(); 2].map(|_| {
            let data = Data::F32(vec![0.5; 40960 * 1024]);
            PackedMat::pack_as(&Mat { rows: 40960, cols: 1024, data }, Some(Quant::Int8))
        });
        // 8 MiB: in cache, not timed, nothing set.
        dot::set_streams(dot::Streams::Every);
        assert!(pick_streams(&team, &[&filled(4096, DType::BF16)]).is_none());
        assert_eq!(dot::streams(), dot::Streams::Every);
        let isa = dot::detect();
        for mats in [[&a, &b], [&qa, &qb]] {
            let picked = pick_streams(&team, &mats);
            if !reads_in_streams(mats[0], isa) {
                // The 512-bit kernels (or AVX512-VNNI's int8 one) read each piece in one
                // stream: nothing to time, nothing set.
                assert!(picked.is_none());
                assert_eq!(dot::streams(), dot::Streams::Every);
                continue;
            }
            // 2 x 40 MiB: both ways timed, the faster set (the CPU's preferred one while
            // within the margin).
            let picked = picked.expect("80 MiB are timed");
            let prefer = dot::preferred_streams();
            assert_picked_preferring(&dot::Streams::ALL, prefer, picked.way, &picked.medians);
            assert_eq!(dot::streams(), picked.way);
            assert!(picked.timings == 1 || picked.timings == 2, "{picked:?}");
            dot::set_streams(dot::Streams::Every);
        }
        // Which kernels read in streams: AVX2's float one, int8 on maddubs or AVX-VNNI.
        assert!(reads_in_streams(&a, Isa::Avx2) && reads_in_streams(&qa, Isa::Avx2));
        assert!(!reads_in_streams(&a, Isa::Avx512) && !reads_in_streams(&a, Isa::Portable));
        assert!(!reads_in_streams(&qa, Isa::Portable));
        dot::set_streams(before);
    }

    #[test]
    fn pick_many_fetch_times_where_its_kernel_streams_a_batch() {
        let _g = dot::FETCH_LOCK.lock().unwrap_or_else(|e| e.into_inner());
        let before = dot::many_fetch();
        let team = Team::new(2).unwrap();
        let (a, b) = (filled(20480, DType::BF16), filled(20480, DType::BF16));
        dot::set_many_fetch(ManyFetch::Nta);
        // Not a batch's decode step (one token, or a prompt's 16), 8 MiB in cache, f16
        // weights: not timed, nothing set.
        for n_tok in [1, 16] {
            assert!(pick_many_fetch(&team, &[&a, &b], n_tok).is_none());
        }
        assert!(pick_many_fetch(&team, &[&filled(4096, DType::BF16)], 8).is_none());
        let (c, d) = (filled(20480, DType::F16), filled(20480, DType::F16));
        assert!(pick_many_fetch(&team, &[&c, &d], 8).is_none());
        assert_eq!(dot::many_fetch(), ManyFetch::Nta);
        // 2 x 40 MiB of bf16 at 8 tokens, in rows of 1024 columns (requests 16 KiB ahead) and
        // of 4096 (spread over the passes, with the way's hint too): timed where the kernel
        // runs, and the faster set.
        let wide = |rows| {
            let data = Data::F32(vec![0.5; rows * 4096]).cast(DType::BF16);
            PackedMat::pack(&Mat { rows, cols: 4096, data })
        };
        let (e, f) = (wide(5120), wide(5120));
        for mats in [[&a, &b], [&e, &f]] {
            match pick_many_fetch(&team, &mats, 8) {
                Some(Picked { way, medians, timings }) => {
                    assert_eq!(dot::detect(), Isa::Avx512Bf16);
                    assert_picked_preferring(&ManyFetch::ALL, ManyFetch::Whole, way, &medians);
                    assert_eq!(dot::many_fetch(), way);
                    assert!(timings == 1 || timings == 2, "{timings}");
                }
                None => assert_ne!(dot::detect(), Isa::Avx512Bf16),
            }
        }
        // Past `WHOLE_MAX` tokens `Whole` streams as `L2`: not timed, never picked.
        match pick_many_fetch(&team, &[&a, &b], dot::WHOLE_MAX + 1) {
            Some(Picked { way, medians, timings }) => {
                let timed = [ManyFetch::L2, ManyFetch::Nta];
                assert!(medians[ManyFetch::Whole as usize].is_nan(), "{medians:?}");
                assert_fastest(&timed, way, &timed.map(|w| medians[w as usize]));
                assert_eq!(dot::many_fetch(), way);
                // No preferred way: one timing.
                assert_eq!(timings, 1);
            }
            None => assert_ne!(dot::detect(), Isa::Avx512Bf16),
        }
        dot::set_many_fetch(before);
    }
}
