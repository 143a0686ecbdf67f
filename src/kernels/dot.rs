//! Dot products of weight rows (f32, bf16 or f16, read in place) with an f32 vector.
//! AVX2 + FMA (+ F16C for f16) when the CPU has them, detected at run time; a portable
//! fallback otherwise. Sums are f32.
//!
//! Packed weight panels ([`super::packed`]) take the vector in the order their kernel wants
//! ([`prepare`]): for bf16 the AVX2 kernel widens sixteen weights with one mask and one shift
//! (even columns from the low halves of 32-bit lanes, odd ones from the high halves), so each
//! block of sixteen entries of `x` is stored as its eight even-column entries, then its eight
//! odd-column ones. That halves the conversion work per weight, which matters on cores that
//! split 256-bit operations in two.
//!
//! Where the CPU has AVX512_BF16 ([`Isa::Avx512Bf16`]), bf16 weights meet their inputs rounded
//! to bf16 in `vdpbf16ps` (no widening, twice the multiply-adds of an FMA), one token and many
//! alike: the one-token kernel's sums equal the many-token kernel's bit for bit.

use super::Activation;
use half::{bf16, f16};

/// Columns per block of a prepared vector.
pub const BLOCK: usize = 16;

/// A weight element that converts to f32.
pub trait Elem: Copy + Send + Sync + 'static {
    fn to_f32(self) -> f32;
    /// Rounds to nearest even.
    fn from_f32(v: f32) -> Self;
    /// [`Elem::from_f32`] of each of `src` into `dst` (as long).
    #[inline]
    fn from_f32_slice(src: &[f32], dst: &mut [Self]) {
        dst.iter_mut().zip(src).for_each(|(d, &v)| *d = Self::from_f32(v));
    }
    /// Whether the AVX2 panel kernel wants `x` in even/odd order within each [`BLOCK`] (the
    /// portable and AVX-512 ones take column order).
    const SPLIT_EVEN_ODD: bool = false;
}
impl Elem for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        v
    }
}
impl Elem for bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
    const SPLIT_EVEN_ODD: bool = true;
}
impl Elem for f16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
    /// Four at a time in F16C where the CPU has it (the same rounding, one call per four
    /// values instead of one per value).
    #[inline]
    fn from_f32_slice(src: &[f32], dst: &mut [Self]) {
        use half::slice::HalfFloatSliceExt;
        dst.convert_from_f32_slice(src);
    }
}

/// Whether [`prepare`] keeps `x` in column order for weights `T` on `isa` (then an input
/// whose length needs no padding can be used as it is).
pub fn keeps_order<T: Elem>(isa: Isa) -> bool {
    isa != Isa::Avx2 || !T::SPLIT_EVEN_ODD
}

/// Writes `x`, padded with zeros to `out.len()`, into `out` in the order the panel kernel
/// expects for weights `T` on `isa`. A trailing part shorter than [`BLOCK`] keeps its order.
pub fn prepare<T: Elem>(x: &[f32], out: &mut [f32], isa: Isa) {
    assert!(x.len() <= out.len(), "prepare: output shorter than input");
    let at = |i: usize| x.get(i).copied().unwrap_or(0.0);
    if keeps_order::<T>(isa) {
        out[..x.len()].copy_from_slice(x);
        out[x.len()..].fill(0.0);
        return;
    }
    let full = out.len() / BLOCK * BLOCK;
    // Blocks wholly inside `x` in AVX2 registers (every kernel thread prepares its own copy
    // before each product: element by element, it took ~2% of a SmolLM2 batch-8 step on Zen
    // 3); the last, padded ones element by element.
    let inside = x.len().min(full) / BLOCK;
    let n = inside * BLOCK;
    #[cfg(target_arch = "x86_64")]
    // SAFETY: an order other than the columns' is only kept for `Isa::Avx2`, itself only
    // detected with avx2 present; both slices are `n` long, a multiple of BLOCK.
    unsafe {
        avx2::split_even_odd(&x[..n], &mut out[..n])
    };
    #[cfg(not(target_arch = "x86_64"))]
    for (xb, ob) in x[..n].chunks_exact(BLOCK).zip(out.chunks_exact_mut(BLOCK)) {
        let (even, odd) = ob.split_at_mut(BLOCK / 2);
        for (i, pair) in xb.chunks_exact(2).enumerate() {
            even[i] = pair[0];
            odd[i] = pair[1];
        }
    }
    for (b, ob) in out[..full].chunks_exact_mut(BLOCK).enumerate().skip(inside) {
        for i in 0..BLOCK / 2 {
            ob[i] = at(b * BLOCK + 2 * i);
            ob[BLOCK / 2 + i] = at(b * BLOCK + 2 * i + 1);
        }
    }
    for (i, o) in out.iter_mut().enumerate().skip(full) {
        *o = at(i);
    }
}

/// `v` as [`Isa::Avx512Bf16`] gives it to bf16 weights: rounded to bf16 (nearest even), a
/// subnormal flushed to zero of its sign (as `vcvtne2ps2bf16` does), back in f32.
pub fn round_like_dot_bf16(v: f32) -> f32 {
    if v.is_subnormal() {
        0.0f32.copysign(v)
    } else {
        bf16::from_f32(v).to_f32()
    }
}

/// Writes `x` (prepared: a multiple of [`BLOCK`] long) rounded to bf16 as
/// [`round_like_dot_bf16`] into `out` (as long): the input as [`Isa::Avx512Bf16`]'s many-token
/// kernel reads it, each block loaded into both halves of one register, which serves two rows.
///
/// # Panics
/// Unless `isa` is [`Isa::Avx512Bf16`] and the lengths are as above.
pub fn round_for_dot_bf16(x: &[f32], out: &mut [bf16], isa: Isa) {
    assert!(x.len().is_multiple_of(BLOCK) && out.len() == x.len(), "round_for_dot_bf16: lengths");
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa::Avx512Bf16` is only produced after detecting avx512f and avx512bf16;
        // lengths checked above.
        Isa::Avx512Bf16 => unsafe { avx512::round_bf16(x, out) },
        _ => panic!("round_for_dot_bf16: not on {isa:?}"),
    }
}

pub fn dot1_portable<T: Elem>(row: &[T], x: &[f32]) -> f32 {
    row.iter().zip(x).map(|(w, xv)| w.to_f32() * xv).sum()
}

/// Quantized weights (the scale is applied by the caller).
impl Elem for i8 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self as f32
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        v.round().clamp(-127.0, 127.0) as i8
    }
}

/// Which implementation this CPU runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    Portable,
    Avx2,
    /// AVX-512F (with AVX2, FMA and F16C): the float panel kernels and attention's page kernels
    /// in 512-bit registers; every other kernel runs its AVX2 version.
    Avx512,
    /// [`Isa::Avx512`] with AVX512_BF16 (Zen 4, Cooper Lake, Sapphire Rapids): bf16 weights meet
    /// their inputs rounded to bf16, each instruction (`vdpbf16ps`) summing 32 products of bf16
    /// pairs into f32, twice the multiply-adds of an f32 FMA and no widening of the weights.
    /// The inputs are rounded to nearest even, with subnormals flushed to zero (as
    /// [`round_like_dot_bf16`]); every other weight type runs as on [`Isa::Avx512`].
    Avx512Bf16,
}

impl Isa {
    /// Every ISA, in the order declared.
    pub const ALL: [Isa; 4] = [Isa::Portable, Isa::Avx2, Isa::Avx512, Isa::Avx512Bf16];

    pub fn name(self) -> &'static str {
        match self {
            Isa::Portable => "portable",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
            Isa::Avx512Bf16 => "avx512bf16",
        }
    }
}

thread_local! {
    static FORCED: std::cell::Cell<Option<Isa>> = const { std::cell::Cell::new(None) };
}

/// The largest |q| of an int8 product's input, quantized per group (see `packed::matmul_int8`):
/// 255 levels on every [`Int8Path`].
pub const INT8_INPUT_MAX: i8 = 127;

/// How int8 products are summed, for inputs quantized per group to |q| ≤ [`INT8_INPUT_MAX`].
/// Every path gives the same integer sums.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Int8Path {
    Portable,
    /// AVX2 `maddubs`: neighbouring products summed into 16 bits (exact at |q|, |w| ≤ 127),
    /// then pairs of those into 32 bits by a `madd` each chunk.
    Maddubs,
    /// AVX-VNNI `vpdpbusd` (VEX, 256 bits): four products at a time summed straight into 32
    /// bits.
    AvxVnni,
    /// The same instruction in its AVX512-VNNI form (EVEX, 256 bits; with AVX512VL): Zen 4,
    /// Cascade Lake and Ice Lake have it without AVX-VNNI.
    Avx512Vnni,
}

impl Int8Path {
    /// Every path, in the order declared.
    pub const ALL: [Int8Path; 4] =
        [Int8Path::Portable, Int8Path::Maddubs, Int8Path::AvxVnni, Int8Path::Avx512Vnni];

    pub fn name(self) -> &'static str {
        match self {
            Int8Path::Portable => "portable",
            Int8Path::Maddubs => "maddubs",
            Int8Path::AvxVnni => "avx-vnni",
            Int8Path::Avx512Vnni => "avx512-vnni",
        }
    }
}

thread_local! {
    static NO_VNNI: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// The int8 path for [`detect`]'s ISA ([`int8_path_for`]).
pub fn int8_path() -> Int8Path {
    int8_path_for(detect())
}

/// The int8 path on `isa`: a VNNI one where the CPU has it (AVX512-VNNI only from
/// [`Isa::Avx512`] on) unless `GRIDLM_NO_VNNI` is set or [`without_vnni`] runs, else `maddubs`.
pub fn int8_path_for(isa: Isa) -> Int8Path {
    if isa == Isa::Portable {
        return Int8Path::Portable;
    }
    if !NO_VNNI.get() && vnni_native().0 {
        Int8Path::AvxVnni
    } else if int8_many(isa) {
        Int8Path::Avx512Vnni
    } else {
        Int8Path::Maddubs
    }
}

/// |q| as unsigned bytes, each of `q` into `out`: the unsigned side of the products of the
/// 256-bit token-group int8 kernel ([`avx2_panel_q8_tokens`]).
pub fn abs_q8(q: &[i8], out: &mut [u8]) {
    for (o, &v) in out.iter_mut().zip(q) {
        *o = v.unsigned_abs();
    }
}

/// `q + 128` as unsigned bytes, each of `q` into `out`: the input of the many-token VNNI
/// kernel ([`avx2_panel_q8_many`]).
pub fn offset_q8(q: &[i8], out: &mut [u8]) {
    for (o, &v) in out.iter_mut().zip(q) {
        *o = (v as u8) ^ 0x80;
    }
}

/// Whether int8 products of many tokens on `isa` take a token group through each panel at once
/// ([`avx2_panel_q8_many`]): where `isa` may run AVX512-VNNI, as [`int8_path_for`] asks before
/// picking [`Int8Path::Avx512Vnni`] (the CPU has it, `isa` is a 512-bit one, and neither
/// `GRIDLM_NO_VNNI` nor [`without_vnni`] holds). The int8 path is then a VNNI one, its inputs
/// |q| ≤ 127.
pub fn int8_many(isa: Isa) -> bool {
    !NO_VNNI.get() && vnni_native().1 && matches!(isa, Isa::Avx512 | Isa::Avx512Bf16)
}

/// Whether this CPU has AVX-VNNI, and AVX512-VNNI with AVX512VL (both false where
/// `GRIDLM_NO_VNNI` is set).
fn vnni_native() -> (bool, bool) {
    #[cfg(target_arch = "x86_64")]
    {
        static VNNI: std::sync::OnceLock<(bool, bool)> = std::sync::OnceLock::new();
        *VNNI.get_or_init(|| {
            if std::env::var_os("GRIDLM_NO_VNNI").is_some() {
                return (false, false);
            }
            (
                is_x86_feature_detected!("avxvnni"),
                is_x86_feature_detected!("avx512vnni") && is_x86_feature_detected!("avx512vl"),
            )
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        (false, false)
    }
}

/// Every SIMD int8 path this CPU runs (tests compare them all; [`int8_path`] picks one).
pub fn int8_kernels() -> Vec<Int8Path> {
    if detect_native() == Isa::Portable {
        return vec![];
    }
    let (avx, evex) = vnni_native();
    let mut all = vec![Int8Path::Maddubs];
    all.extend(avx.then_some(Int8Path::AvxVnni));
    all.extend(evex.then_some(Int8Path::Avx512Vnni));
    all
}

/// Runs `f` with [`int8_path`] answering `maddubs` rather than a VNNI path on this thread
/// (tests compare both).
pub fn without_vnni<R>(f: impl FnOnce() -> R) -> R {
    let before = NO_VNNI.replace(true);
    let r = f();
    NO_VNNI.set(before);
    r
}

/// Every implementation this CPU can run, the portable one first and [`detect`]'s last.
pub fn available() -> Vec<Isa> {
    match detect_native() {
        Isa::Portable => vec![Isa::Portable],
        Isa::Avx2 => vec![Isa::Portable, Isa::Avx2],
        Isa::Avx512 => vec![Isa::Portable, Isa::Avx2, Isa::Avx512],
        Isa::Avx512Bf16 => vec![Isa::Portable, Isa::Avx2, Isa::Avx512, Isa::Avx512Bf16],
    }
}

/// Runs `f` with [`detect`] answering `isa` on this thread (tests compare every path the CPU
/// can run against the portable one). `isa` must be one of [`available`].
pub fn with_isa<R>(isa: Isa, f: impl FnOnce() -> R) -> R {
    assert!(available().contains(&isa), "{isa:?} is not available on this CPU");
    let before = FORCED.replace(Some(isa));
    let r = f();
    FORCED.set(before);
    r
}

/// The implementation this CPU runs: the best it supports, unless `GRIDLM_PORTABLE` is set
/// (portable code only), `GRIDLM_NO_AVX512` is (AVX2 at most) or `GRIDLM_NO_AVX512BF16` is
/// (bf16 weights against f32 inputs, as [`Isa::Avx512`]).
pub fn detect() -> Isa {
    FORCED.get().unwrap_or_else(detect_native)
}

fn detect_native() -> Isa {
    #[cfg(target_arch = "x86_64")]
    {
        static ISA: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
        *ISA.get_or_init(|| {
            let avx2 = std::env::var_os("GRIDLM_PORTABLE").is_none()
                && is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c");
            let off = |var: &str| std::env::var_os(var).is_some();
            if avx2 && !off("GRIDLM_NO_AVX512") && is_x86_feature_detected!("avx512f") {
                if !off("GRIDLM_NO_AVX512BF16") && is_x86_feature_detected!("avx512bf16") {
                    Isa::Avx512Bf16
                } else {
                    Isa::Avx512
                }
            } else if avx2 {
                Isa::Avx2
            } else {
                Isa::Portable
            }
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        Isa::Portable
    }
}

/// Sets of accumulators the dimensions of a score go round-robin over, in every SIMD path and
/// for every number of rows sharing a call: a row's score for a key is summed in one order
/// whichever rows come with it, and on AVX2 and AVX-512 alike.
const SCORE_SETS: usize = 2;

/// How far ahead of what they read attention's page kernels ask for keys and values, into L2,
/// when their caller says so: 8 KiB, four pages of a SmolLM2 head's keys (or values) on. A
/// sequence's pages mostly lie one after the other, so its keys and its values are each one
/// stream; asked for a line for every line read, they come in while the kernels work on the
/// lines before. On the 2-core Zen 5 machine one thread over a SmolLM2 token's 90 items of
/// 2000 positions from memory took 1.65–1.75 ms asking so, against 2.07–2.36 with the
/// hardware prefetchers alone; 4 KiB into L1 1.84–1.99, non-temporal 1.93–1.98, 16 KiB
/// 1.70–2.01.
pub const PAGE_AHEAD: usize = 8192;

/// Asks for the lines of `bytes` bytes from `p`, [`PAGE_AHEAD`] further on, into L2 (a hint:
/// no effect on results, and none on an address past the pool either).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn page_ahead(p: *const u8, bytes: usize) {
    let mut off = 0;
    while off < bytes {
        // SAFETY: a prefetch never faults, whatever the address.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(
                p.wrapping_add(PAGE_AHEAD + off).cast(),
            )
        };
        off += 64;
    }
}

/// Scores of `q` (`[rows, hd]`) against one page of keys stored transposed (`kt` is
/// `[hd, page_len]`: for each dimension, the page's keys side by side):
/// `out[r * stride + j] = Σ_d q[r][d] · kt[d][j]` for every `j` in `0..page_len` (rows of
/// `out` are `stride >= page_len` apart). Each converted vector of keys serves up to four rows.
/// The AVX-512 path (pages a multiple of [`BLOCK`] long) gives the AVX2 path's scores bit for
/// bit: each of its lanes goes through the same operations in the same order. With `ahead`,
/// the first four rows' pass asks for what lies [`PAGE_AHEAD`] beyond each line of keys it
/// reads (no effect on results).
pub fn page_scores<T: Elem + Avx2Load>(
    kt: &[T],
    page_len: usize,
    q: &[f32],
    out: &mut [f32],
    stride: usize,
    ahead: bool,
    isa: Isa,
) {
    let hd = kt.len() / page_len.max(1);
    let rows = q.len() / hd.max(1);
    assert!(
        hd > 0
            && kt.len() == hd * page_len
            && q.len() == rows * hd
            && stride >= page_len
            && out.len() >= rows.saturating_sub(1) * stride + page_len,
        "page_scores: shapes"
    );
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: every AVX-512 `Isa` is only produced after detecting avx512f besides avx2,
        // fma and f16c; shapes are checked above.
        Isa::Avx512 | Isa::Avx512Bf16 if page_len.is_multiple_of(BLOCK) => unsafe {
            avx512::page_scores(kt, page_len, q, hd, rows, out, stride, ahead)
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 | Isa::Avx512 | Isa::Avx512Bf16 if page_len.is_multiple_of(8) => unsafe {
            avx2::page_scores(kt, page_len, q, hd, rows, out, stride, ahead)
        },
        _ => {
            let _ = ahead; // a hint the portable path has no way to give
            for (r, qr) in q.chunks_exact(hd).enumerate() {
                let or = &mut out[r * stride..r * stride + page_len];
                or.fill(0.0);
                for (d, &qd) in qr.iter().enumerate() {
                    let kd = &kt[d * page_len..(d + 1) * page_len];
                    or.iter_mut().zip(kd).for_each(|(o, k)| *o += qd * k.to_f32());
                }
            }
        }
    }
}

/// [`page_scores`] of two pages at once, their scores side by side: `out[r * stride + j]` for
/// `j` in `0..page_len` from `kt[0]`, in `page_len..2 * page_len` from `kt[1]`. The same bits
/// as two calls; where the CPU has AVX-512, one pass over both (more chains in flight, fewer
/// loads of the queries).
pub fn page_scores_pair<T: Elem + Avx2Load>(
    kt: [&[T]; 2],
    page_len: usize,
    q: &[f32],
    out: &mut [f32],
    stride: usize,
    isa: Isa,
) {
    let hd = kt[0].len() / page_len.max(1);
    let rows = q.len() / hd.max(1);
    assert!(
        hd > 0
            && kt[0].len() == hd * page_len
            && kt[1].len() == kt[0].len()
            && q.len() == rows * hd
            && stride >= 2 * page_len
            && out.len() >= rows.saturating_sub(1) * stride + 2 * page_len,
        "page_scores_pair: shapes"
    );
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in page_scores; shapes are checked above.
        Isa::Avx512 | Isa::Avx512Bf16 if page_len.is_multiple_of(BLOCK) => unsafe {
            avx512::page_scores_pair(kt, page_len, q, hd, rows, out, stride)
        },
        _ => {
            page_scores(kt[0], page_len, q, out, stride, false, isa);
            page_scores(kt[1], page_len, q, &mut out[page_len..], stride, false, isa);
        }
    }
}

/// `o[r] += Σ_j p[r][j] · v[j]` for `rows` rows: `p` is `[rows, n]` with rows `stride` apart
/// (only the first `n` of each row are read), `v` is `[n, hd]`, `o` is `[rows, hd]`. Each
/// converted vector of values serves up to four rows. The AVX-512 path gives the AVX2 path's
/// sums bit for bit, as [`page_scores`]. With `ahead`, the first four rows' pass asks for what
/// lies [`PAGE_AHEAD`] beyond each line of values it reads (no effect on results).
pub fn page_values<T: Elem + Avx2Load>(
    p: &[f32],
    stride: usize,
    v: &[T],
    hd: usize,
    o: &mut [f32],
    ahead: bool,
    isa: Isa,
) {
    assert!(hd > 0 && o.len().is_multiple_of(hd) && v.len().is_multiple_of(hd), "page_values: shapes");
    let (rows, n) = (o.len() / hd, v.len() / hd);
    assert!(rows == 0 || (n <= stride && p.len() >= (rows - 1) * stride + n), "page_values: shapes");
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx512 | Isa::Avx512Bf16 => unsafe { avx512::page_values(p, stride, v, n, hd, o, ahead) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 => unsafe { avx2::page_values(p, stride, v, n, hd, 0, o, ahead) },
        _ => {
            let _ = ahead; // a hint the portable path has no way to give
            for (r, or) in o.chunks_exact_mut(hd).enumerate() {
                for (j, vj) in v.chunks_exact(hd).enumerate() {
                    let pj = p[r * stride + j];
                    or.iter_mut().zip(vj).for_each(|(o, x)| *o += pj * x.to_f32());
                }
            }
        }
    }
}

/// How a one-token product asks for its weights ahead of its loads. A decode step streams
/// each weight once, from memory; which way streams fastest depends on the CPU and on where
/// its cores sit, not on the model, and no choice changes a result. On the 2-core Zen 4
/// machine, while the cores sat apart (`handoff_us` ~0.6, the probe at ~58 GB/s), one
/// token's SmolLM2 layer products in `vdpbf16ps` read at 0.69–0.77 of the probe with
/// [`Fetch::Far`], 0.87–0.99 with [`Fetch::Near`] and 0.95–1.08 with [`Fetch::None`] (0.88–0.93,
/// 0.94–1.00 and 0.96–0.99 while they sat together); on Zen 5, apart, `Far` decoded SmolLM2
/// 5% faster than `Near`, and [`Fetch::Nta`] 2–5% faster than either, together and apart. So
/// each rank times its own layers under every way at start-up ([`super::packed::pick_fetch`])
/// and keeps the fastest, or the CPU's preferred way ([`preferred_fetch`]) where it is within a
/// margin of the fastest (which ways are close changes with where the cores sit);
/// `GRIDLM_PREFETCH` names one instead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fetch {
    /// No software prefetch: the hardware prefetchers alone.
    None,
    /// The kernel's own short prefetch: 256 bytes ahead into L1 in 512-bit registers, 1 KiB
    /// ahead non-temporal in AVX2, 4 KiB ahead for int8.
    Near,
    /// [`Fetch::Near`], and 8 KiB ahead into L2 as well (as the many-token kernels ask), so
    /// the start of each thread's share is asked for before the hardware sees a stream.
    Far,
    /// 2 KiB ahead with the non-temporal hint (4 KiB for int8 and in the float FMA kernels:
    /// AVX2's, and the 512-bit one), as the bandwidth probe reads.
    /// The hint is meant to let weights, read once a step, displace less of what a step reads
    /// again (inputs, activations, KV pages). How much faster it streamed on Zen 5 is given at
    /// the kernels' `fetch_stream`; why was not measured.
    Nta,
    /// The hardware prefetchers, and one line into L2 per 4 KiB page of each stream,
    /// [`FETCH_PAGE_AHEAD`] ahead: the hardware's stream prefetcher stops at page boundaries,
    /// so the pages ahead are asked for before it reaches them. On the 2-core Zen 4 machine,
    /// six llama-3.2-1b-shaped layers' one-token products alone in `vdpbf16ps` streamed
    /// 2.2–3.8% faster than with [`Fetch::None`] while the cores sat apart (medians of 346–557
    /// rounds in turn, one or two lines 8–32 KiB ahead; four lines a page 1.1–1.2%, 4 KiB ahead
    /// 0.6%) and 0.9–1.7% together; SmolLM2's 0.7% and 0.3%. End to end it paid more: SmolLM2
    /// decode, runs with each way named in turn, reps together at a median of 0.963 of the
    /// probe against 0.884 (124.6 against 112.7 tokens/s), the llama-3.2-1b shape 0.989 against
    /// 0.970 (why more than alone was not measured: the matrices lie back to back, so the
    /// requests near a share's end may reach the next product's first pages). Step by step in
    /// one run (`gridlm bench --compare-prefetch`, six runs a way) SmolLM2 decoded only
    /// 1.001–1.020× (median 1.012) as fast as under none, 1.04–1.40× as fast as under
    /// [`Fetch::Far`] and 1.00–1.16× as under [`Fetch::Nta`] (the larger figures with the cores
    /// apart): most of the gap the runs in turn showed did not hold once both ways met the same
    /// moments of the host (why was not measured).
    Page,
}

/// How far ahead [`Fetch::Page`] asks for a page's first line, in bytes.
pub const FETCH_PAGE_AHEAD: usize = 24 << 10;

impl Fetch {
    /// In declared order, so a way's discriminant is its index.
    pub const ALL: [Fetch; 5] = [Fetch::None, Fetch::Near, Fetch::Far, Fetch::Nta, Fetch::Page];
    /// Each way as the const parameter of the kernels (`F` below): its discriminant.
    const NONE: u8 = Fetch::None as u8;
    const NEAR: u8 = Fetch::Near as u8;
    const FAR: u8 = Fetch::Far as u8;
    const NTA: u8 = Fetch::Nta as u8;
    const PAGE: u8 = Fetch::Page as u8;

    pub fn name(self) -> &'static str {
        match self {
            Fetch::None => "none",
            Fetch::Near => "near",
            Fetch::Far => "far",
            Fetch::Nta => "nta",
            Fetch::Page => "page",
        }
    }

    pub fn parse(s: &str) -> Option<Fetch> {
        Fetch::ALL.into_iter().find(|f| f.name() == s)
    }
}

/// The process's [`Fetch`], as its discriminant; [`Fetch::Near`] until one is set.
static FETCH: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(Fetch::NEAR);

/// The way one-token products prefetch in this process.
pub fn fetch() -> Fetch {
    let code = FETCH.load(std::sync::atomic::Ordering::Relaxed);
    Fetch::ALL.get(code as usize).copied().unwrap_or(Fetch::Near)
}

/// Sets the way one-token products prefetch in this process, from their next call on.
pub fn set_fetch(f: Fetch) {
    FETCH.store(f as u8, std::sync::atomic::Ordering::Relaxed);
}

/// The [`Fetch`] a rank keeps unless its start-up timing puts another way ahead by 2% twice running
/// ([`super::packed::pick_fetch`]): [`Fetch::Near`] on Zen 3 ([`crate::host::zen3`]),
/// [`Fetch::Page`] elsewhere. On the 2-core Zen 4 machine `page` decoded SmolLM2 ahead of none,
/// `far` and `nta` step by step (the figures are at [`Fetch::Page`]). On the 2-core Zen 3 machine,
/// each way against `near` step by step in one run (`gridlm bench --compare-prefetch`), `near`
/// decoded SmolLM2 1.12–1.17× as fast as `page`, 1.02–1.04× as fast as `nta` (5 runs of 5), and
/// 0.93–1.03× as fast as none (ahead in 3 of 5); the llama-3.2-1b shape 1.18–1.30×, 1.04× and 1.02×
/// (two runs each). Yet with `page` preferred, the start-up timing took none in 4 of 13 starts of
/// SmolLM2 in the same spell and `nta` in 2. Where the rank's layers are too small to time it takes
/// [`Fetch::Near`] on every CPU.
pub fn preferred_fetch() -> Fetch {
    if crate::host::zen3() {
        Fetch::Near
    } else {
        Fetch::Page
    }
}

/// How the many-token bf16 kernel of AVX512_BF16 (a batch's decode step, a short prompt) asks
/// for its weights: into L2 or non-temporal, 16 KiB ahead, or in rows of [`SPREAD_FROM`]
/// columns or more the next panels a share in every pass (see there); or, for a batch of up
/// to eight, how it streams them too ([`ManyFetch::Whole`]). On the 2-core Zen 5
/// machine the non-temporal hint made SmolLM2's layer products of 8 tokens 7–12% faster and of
/// 12 tokens 3% (of 2 and 4 the same), and whole runs at a batch of 8 decode at 965–1009
/// tokens/s against 881–908 (together) and 1130–1169 against 1078 (apart); but an 8192 × 2048
/// product of 8 tokens ran 4% slower with it and of 4 tokens 7% faster. The better one depends on
/// the shapes and the batch, so a run that decodes a batch times its own layers under each
/// at start-up ([`super::packed::pick_many_fetch`]); `GRIDLM_MANY_PREFETCH` names one
/// instead. No choice changes a result. (The requests of wide rows, spread over the passes,
/// read faster non-temporal there too: see [`SPREAD_FROM`].)
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ManyFetch {
    /// The T1 hint: into L2, where every token group of the call reads the chunk again.
    L2,
    /// The non-temporal hint.
    Nta,
    /// A batch of up to [`WHOLE_MAX`] tokens against each panel at once, one pass over its
    /// weights (every token's sums in two registers, 16 of the 32 at eight tokens), each chunk
    /// asked for 8 KiB ahead into L2 and [`whole_l1_ahead`] (2 or 4 KiB) ahead into L1 as well;
    /// a larger batch as `L2`.
    /// Two groups of four read a panel block from memory in the first group's pass and from
    /// L1 in the second's, so the stream came in bursts; one pass reads it at an even pace.
    /// On the 2-core Zen 4 machine (the ways taking turns in one process, medians of the
    /// rounds' ratios to `L2`), SmolLM2's layer products of 8 tokens and its head ran at
    /// 1.17–1.20 of `L2`'s rate while the cores sat apart and 1.01–1.03 together; asking only
    /// into L2, 8 KiB ahead: 1.16–1.17 and 0.97–0.98; 16 KiB: 1.15–1.17 and 0.95–0.97; 4 KiB:
    /// 1.04–1.06 and 0.99–1.01; 6 KiB 1.14–1.16 and 1.05. Four llama-3.2-1b-shaped layers,
    /// together: 1.06 (6 KiB alone 0.92, 8 KiB 0.95–0.97). The same bits as the other ways. On
    /// the 2-core Zen 5 machine an earlier eight-token kernel (16 KiB ahead into L2) made the
    /// step 7–12% slower together, so the pick ([`super::packed::pick_many_fetch`]) times this
    /// way beside the others.
    Whole,
}

/// The most tokens [`ManyFetch::Whole`] sums against a panel in one pass: two accumulators a
/// token, 16 of the 32 registers, and the two weight registers, and the input.
pub const WHOLE_MAX: usize = 8;

/// How far ahead of each chunk [`ManyFetch::Whole`] asks for it into L1: 4 KiB where a core's
/// L1 data cache holds 48 KiB or more, else 2 KiB (as chosen on Zen 4, whose L1 holds 32 KiB
/// and where a batch's eight inputs of a 2048-column block fill it alone). On the 2-core Zen 5
/// machine (48 KiB), under `whole` named, the batch-8 step's time over the batch-1 step's in
/// the same run (`--compare-batch 1`, steps alternating): the llama-3.2-1b shape 1.335–1.343
/// against 1.417–1.443 while the cores sat apart (two runs and four) and 1.174–1.181 against
/// 1.193–1.214 together (four and three); SmolLM2 and the llama-2-7b shape a little less
/// ("Many-token prefetch" in docs/performance-notes.md). Read when `whole` is set
/// ([`set_many_fetch`]), before a product streams under it.
pub fn whole_l1_ahead() -> usize {
    static AHEAD: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *AHEAD.get_or_init(|| {
        let l1 = crate::host::l1d_bytes(std::path::Path::new("/sys/devices/system/cpu"));
        if l1.is_some_and(|b| b >= 48 << 10) {
            4 << 10
        } else {
            2 << 10
        }
    })
}

impl ManyFetch {
    /// In declared order, so a way's discriminant is its index.
    pub const ALL: [ManyFetch; 3] = [ManyFetch::L2, ManyFetch::Nta, ManyFetch::Whole];

    pub fn name(self) -> &'static str {
        match self {
            ManyFetch::L2 => "l2",
            ManyFetch::Nta => "nta",
            ManyFetch::Whole => "whole",
        }
    }

    pub fn parse(s: &str) -> Option<ManyFetch> {
        ManyFetch::ALL.into_iter().find(|f| f.name() == s)
    }
}

/// The process's [`ManyFetch`], as its discriminant; [`ManyFetch::L2`] until one is set.
static MANY_FETCH: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(ManyFetch::L2 as u8);

/// The way the many-token bf16 kernel prefetches in this process.
pub fn many_fetch() -> ManyFetch {
    let code = MANY_FETCH.load(std::sync::atomic::Ordering::Relaxed);
    ManyFetch::ALL.get(code as usize).copied().unwrap_or(ManyFetch::L2)
}

/// Columns of a row from which a batch's bf16 products ([`avx512_panels_many_bf16`]), and its
/// int8 products on AVX512-VNNI ([`avx2_panel_q8_many`]), ask for the next panels' weights a
/// share in every pass over the current ones (an [`Ahead`]) rather than a fixed distance past
/// each chunk they read. With several token groups, only a panel block's first pass then read
/// it from memory: the later passes, over the block in L1 and L2, asked again for the lines the
/// first had asked for, so memory went idle while they ran. On the 2-core Zen 4 machine,
/// products of 8 tokens over two llama-2-7b-shaped layers (808 MB of weights) ran at 29.6–40.9
/// GB/s against 26.1–33.8 in 36 of 40 interleaved rounds (the rounds where one token read at
/// 44–50 GB/s: 36.2–40.9 against 31.0–33.8), over eight llama-3.2-1b-shaped layers at 28.3–31.1
/// against 23.9–27.2; over SmolLM2's shapes (rows of 576 and 1536 columns) no faster, also when
/// asking two pairs of panels ahead. (The int8 kernel likewise: [`avx2_panel_q8_many`].)
///
/// The bf16 kernel asks with the hint of the process's [`ManyFetch`]: into L2 (T1) or
/// non-temporal. On the 2-core Zen 5 machine, products of 8 tokens over four llama-3.2-1b-shaped
/// layers read at a median of 44.0 GB/s non-temporal against 38.6 into L2 in one spell (the cores
/// apart) and 36.1–37.3 against 35.1–35.7 in others (together; T0, into L1 and L2, as well as
/// non-temporal), over two llama-2-7b-shaped layers 36.0–37.3 against 34.9–35.6; whole runs at a
/// batch of 8 decoded the llama-3.2-1b shape at 119.6–127.0 tokens/s against 110.4–115.2 (six
/// pairs, together), the llama-2-7b shape at 21.9 against 21.1. The int8 kernel, bound by its
/// arithmetic, read as fast either way, and keeps T1.
pub const SPREAD_FROM: usize = 2048;

/// `_MM_HINT_T1` (into L2), named where the arch module is not.
const AHEAD_T1: i32 = 2;
#[cfg(target_arch = "x86_64")]
const _: () = assert!(AHEAD_T1 == std::arch::x86_64::_MM_HINT_T1);

/// Lines a many-token pass asks for, into L2 or non-temporally, as it goes: `per` at each
/// chunk, from `at` on, up to `end`. Prefetching reads nothing into the program and never
/// faults, so any address will do.
#[derive(Clone, Copy)]
pub struct Ahead {
    at: *const u8,
    end: *const u8,
    per: usize,
}

impl Ahead {
    /// Nothing asked for.
    pub const NONE: Ahead = Ahead { at: std::ptr::null(), end: std::ptr::null(), per: 0 };

    /// Pass `pass` of `passes`' even share of the `lines` lines from `next` on, over its
    /// `chunks` chunks.
    pub fn share(next: *const u8, lines: usize, (pass, passes): (usize, usize), chunks: usize) -> Ahead {
        let first = pass * lines / passes;
        let share = (pass + 1) * lines / passes - first;
        let at = next.wrapping_add(64 * first);
        Ahead { at, end: at.wrapping_add(64 * share), per: share.div_ceil(chunks.max(1)) }
    }

    /// Asks for this chunk's lines, into L2 (the T1 hint).
    #[inline(always)]
    pub fn ask(&mut self) {
        self.ask_with::<AHEAD_T1>();
    }

    /// Asks for this chunk's lines with the prefetch hint `HINT` (an `_MM_HINT_*` of x86-64).
    /// The first line goes without the count's arithmetic and loop, and a share of one line a
    /// request (the int8 kernel's usual) needs neither: on the 2-core Zen 5 machine 8-token
    /// int8 products over llama-3.2-1b-shaped rows ran at 43–44 GB/s of weights in cache against
    /// 38 (45 asking for nothing, but 19.5 then from memory), and `gridlm bench --quant int8`
    /// decoded a batch of 8 at 253–264 tokens/s against 231–243 (three pairs, together).
    #[inline(always)]
    pub fn ask_with<const HINT: i32>(&mut self) {
        if self.at >= self.end {
            return;
        }
        #[cfg(target_arch = "x86_64")]
        prefetch_lines::<HINT>(self.at as *const i8, 0..1);
        let n = if self.per == 1 { 1 } else { self.per.min((self.end as usize - self.at as usize) / 64) };
        #[cfg(target_arch = "x86_64")]
        prefetch_lines::<HINT>(self.at as *const i8, 1..n);
        self.at = self.at.wrapping_add(64 * n);
    }
}

/// Sets the way the many-token bf16 kernel prefetches in this process, from its next call on.
pub fn set_many_fetch(f: ManyFetch) {
    if f == ManyFetch::Whole {
        whole_l1_ahead();
    }
    MANY_FETCH.store(f as u8, std::sync::atomic::Ordering::Relaxed);
}

/// Held by the tests that set the process's one-token or many-token prefetch ([`set_fetch`],
/// [`set_many_fetch`]), so that one does not change it under another's comparison.
#[cfg(test)]
pub(crate) static FETCH_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Calls the kernel `$k` (generic last over `const F: u8`) with `F` the code of `$fetch`.
macro_rules! with_fetch {
    ($fetch:expr, $k:ident $(::<$($g:ty),*>)? ($($a:expr),* $(,)?)) => {
        match $fetch {
            Fetch::None => $k::<$($($g,)*)? { Fetch::NONE }>($($a),*),
            Fetch::Near => $k::<$($($g,)*)? { Fetch::NEAR }>($($a),*),
            Fetch::Far => $k::<$($($g,)*)? { Fetch::FAR }>($($a),*),
            Fetch::Nta => $k::<$($($g,)*)? { Fetch::NTA }>($($a),*),
            Fetch::Page => $k::<$($($g,)*)? { Fetch::PAGE }>($($a),*),
        }
    };
}

/// Asks the CPU to start loading every cache line of `data` into L1 and L2 (the T0 hint; a
/// hint: no effect on results). A raw slice, so memory another thread may be writing can be
/// asked for; any `&[T]` passes.
pub fn prefetch<T>(data: *const [T]) {
    let lines = (data.len() * std::mem::size_of::<T>()).div_ceil(64);
    #[cfg(target_arch = "x86_64")]
    prefetch_lines::<{ std::arch::x86_64::_MM_HINT_T0 }>(data.cast(), 0..lines);
    #[cfg(not(target_arch = "x86_64"))]
    let _ = lines;
}

/// Asks the CPU to start loading share `part` of `parts` of `data`'s cache lines into L2 (the
/// T1 hint; a hint: no effect on results): lines `part · n / parts` up to `(part + 1) · n /
/// parts` of its `n`, none for `part ≥ parts`. A caller spreads the request for a block it will
/// read next over the passes of the work before it, so that no one pass waits while a whole
/// block's requests queue.
pub fn prefetch_share<T>(data: &[T], part: usize, parts: usize) {
    let n = std::mem::size_of_val(data).div_ceil(64);
    let lines = if part < parts { part * n / parts..(part + 1) * n / parts } else { 0..0 };
    prefetch_l2(data, lines);
}

/// Asks the CPU to start loading the cache lines `lines` of `data` (those of them within it)
/// into L2 (the T1 hint; a hint: no effect on results). A raw slice, as for [`prefetch`].
pub fn prefetch_l2<T>(data: *const [T], lines: std::ops::Range<usize>) {
    let n = (data.len() * std::mem::size_of::<T>()).div_ceil(64);
    let lines = lines.start.min(n)..lines.end.min(n);
    #[cfg(target_arch = "x86_64")]
    prefetch_lines::<{ std::arch::x86_64::_MM_HINT_T1 }>(data.cast(), lines);
    #[cfg(not(target_arch = "x86_64"))]
    let _ = lines;
}

/// Asks for the 64-byte lines `lines` from `p` on with the prefetch hint `HINT`.
#[inline]
#[cfg(target_arch = "x86_64")]
fn prefetch_lines<const HINT: i32>(p: *const i8, lines: std::ops::Range<usize>) {
    for line in lines {
        // SAFETY: prefetching is a hint, never faults and reads nothing into the program.
        unsafe { std::arch::x86_64::_mm_prefetch::<HINT>(p.wrapping_add(64 * line)) };
    }
}

/// The request of [`Fetch::Page`] for a chunk of `bytes` at `p`, one of a stream of such
/// chunks: where the chunk begins a 4 KiB page, the line [`FETCH_PAGE_AHEAD`] past it, into L2.
/// (Exactly one chunk of a stream begins within `bytes` of each page's start.) The kernels ask
/// so under that way, and the bandwidth probe reads its `page` way with it.
#[inline]
#[cfg(target_arch = "x86_64")]
pub(crate) fn fetch_page(p: *const u8, bytes: usize) {
    if (p as usize) & 4095 < bytes {
        prefetch_lines::<{ std::arch::x86_64::_MM_HINT_T1 }>(p.wrapping_add(FETCH_PAGE_AHEAD).cast(), 0..1);
    }
}

/// `s[i] *= scale`; returns the largest result (−∞ when `s` is empty).
pub fn scale_max(s: &mut [f32], scale: f32, isa: Isa) -> f32 {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: every AVX-512 `Isa` is only produced after detecting avx512f besides avx2, fma
        // and f16c.
        Isa::Avx512 | Isa::Avx512Bf16 => unsafe { avx512::scale_max(s, scale) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: every non-portable `Isa` is only produced after detecting avx2, fma and f16c.
        Isa::Avx2 => unsafe { avx2::scale_max(s, scale) },
        _ => s.iter_mut().fold(f32::NEG_INFINITY, |m, v| {
            *v *= scale;
            m.max(*v)
        }),
    }
}

/// Each of `max.len()` rows of scores (`stride` apart in `s`) through [`scale_max`] and then
/// [`exp_sub_sum`] over the keys `keys(r)` it sees (from the row's start), with the rest of
/// `clear` zeroed (the whole of it for a row that sees none of them, whose max and sum are left
/// alone): the same bits as those calls row by row, in one call.
#[allow(clippy::too_many_arguments)] // the rows, their keys and what they give
pub fn softmax_rows(
    s: &mut [f32],
    stride: usize,
    keys: impl Fn(usize) -> std::ops::Range<usize>,
    clear: std::ops::Range<usize>,
    scale: f32,
    max: &mut [f32],
    sum: &mut [f32],
    isa: Isa,
) {
    assert!(sum.len() == max.len() && s.len() >= max.len() * stride, "softmax_rows: shapes");
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx512 | Isa::Avx512Bf16 => unsafe {
            avx512::softmax_rows(s, stride, keys, clear, scale, max, sum)
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 => unsafe { avx2::softmax_rows(s, stride, keys, clear, scale, max, sum) },
        _ => softmax_rows_with(
            s,
            stride,
            keys,
            clear,
            max,
            sum,
            |v| scale_max(v, scale, isa),
            |v, m| exp_sub_sum(v, m, isa),
        ),
    }
}

/// [`softmax_rows`] with the two row kernels given.
#[inline(always)]
#[allow(clippy::too_many_arguments)] // as softmax_rows
fn softmax_rows_with(
    s: &mut [f32],
    stride: usize,
    keys: impl Fn(usize) -> std::ops::Range<usize>,
    clear: std::ops::Range<usize>,
    max: &mut [f32],
    sum: &mut [f32],
    scale_max: impl Fn(&mut [f32]) -> f32,
    exp_sub_sum: impl Fn(&mut [f32], f32) -> f32,
) {
    for (r, (m, l)) in max.iter_mut().zip(sum.iter_mut()).enumerate() {
        let row = &mut s[r * stride..(r + 1) * stride];
        let k = keys(r);
        if k.start >= k.end {
            row[clear.clone()].fill(0.0);
            continue;
        }
        *m = scale_max(&mut row[k.clone()]);
        *l = exp_sub_sum(&mut row[k.clone()], *m);
        row[clear.start..k.start].fill(0.0);
        row[k.end..clear.end].fill(0.0);
    }
}

/// The vector exp's constants (`avx2::exp8`, `avx512::exp16`): its clamp, ln 2 in two parts and
/// the polynomial for `exp(r)` beyond `1 + r` (Cephes' coefficients), highest degree first.
#[cfg(target_arch = "x86_64")]
mod exp_consts {
    pub const LOW: f32 = -87.3;
    pub const HIGH: f32 = 88.0;
    pub const LN2_HI: f32 = 0.693_359_4;
    pub const LN2_LO: f32 = -2.121_944_4e-4;
    pub const POLY: [f32; 6] =
        [1.987_569_1e-4, 1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 0.166_666_65, 0.5];
}

/// `x[i] = x[i] · a + y[i] · b`, each product rounded and then their sum (no fused
/// multiply-add), so every path gives the same bits.
pub fn scale_add(x: &mut [f32], a: f32, y: &[f32], b: f32, isa: Isa) {
    assert_eq!(x.len(), y.len(), "scale_add: lengths");
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 | Isa::Avx512 | Isa::Avx512Bf16 => unsafe { avx2::scale_add(x, a, y, b) },
        _ => x.iter_mut().zip(y).for_each(|(x, y)| *x = *x * a + y * b),
    }
}

/// `s[i] = exp(s[i] − m)`; returns the sum of the results. The SIMD path's exp is a
/// polynomial within 2 ulp of the true value (inputs below −87.3 give ≈1e-38, not 0).
pub fn exp_sub_sum(s: &mut [f32], m: f32, isa: Isa) -> f32 {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx512 | Isa::Avx512Bf16 => unsafe { avx512::exp_sub_sum(s, m) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 => unsafe { avx2::exp_sub_sum(s, m) },
        _ => s.iter_mut().fold(0.0, |sum, v| {
            *v = (*v - m).exp();
            sum + *v
        }),
    }
}

/// `s[i] = cap · tanh(s[i] · scale / cap)`; the SIMD path's tanh is `1 − 2 / (exp(2x) + 1)` on
/// its vector exp (within ~2.5e-7 of the true tanh).
pub fn softcap(s: &mut [f32], scale: f32, cap: f32, isa: Isa) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 | Isa::Avx512 | Isa::Avx512Bf16 => unsafe { avx2::softcap(s, scale, cap) },
        _ => s.iter_mut().for_each(|v| *v = cap * (*v * (scale / cap)).tanh()),
    }
}

/// `√(8/π)` and `√(8/π) · 0.044715`: GELU's tanh form is `g/2 · (1 + tanh(√(2/π)·(g +
/// 0.044715·g³)))` = `g / (1 + exp(−(GELU_A·g + GELU_B·g³)))`.
const GELU_A: f32 = 1.595_769;
const GELU_B: f32 = GELU_A * 0.044715;

/// Numerical Recipes' `erfcc`: `erfc(z) = t · exp(−z² + P(t))` for `z ≥ 0`, `t = 1/(1 + z/2)`,
/// `P` of degree 9 with these coefficients (the highest power's first), within 1.2e-7 of erfc
/// relative to it everywhere. As published, some digits past f32's.
#[allow(clippy::excessive_precision)]
const ERFC_P: [f32; 10] = [
    0.170_872_77,
    -0.822_152_23,
    1.488_515_87,
    -1.135_203_98,
    0.278_868_07,
    -0.186_288_06,
    0.096_784_18,
    0.374_091_96,
    1.000_023_68,
    -1.265_512_23,
];

/// GELU's factor `(1 + erf(g/√2))/2` of `g`, as `1 − erfc(z)/2` for `g ≥ 0` and `erfc(z)/2`
/// below, `z = |g|/√2` ([`ERFC_P`]): the small factors of negative `g` keep their relative
/// precision.
fn gelu_factor(g: f32) -> f32 {
    let z = g.abs() * std::f32::consts::FRAC_1_SQRT_2;
    let t = 1.0 / (1.0 + 0.5 * z);
    let p = ERFC_P[1..].iter().fold(ERFC_P[0], |p, c| p * t + c);
    let half = 0.5 * t * (p - z * z).exp();
    if g >= 0.0 {
        1.0 - half
    } else {
        half
    }
}

/// `gate[i] = act(gate[i]) · up[i]` (`up` 1 where there is none: an FFN without a gate): SiLU
/// and GELU's tanh form as `g / (1 + exp(−a))`, `a = g` for SiLU, `a = GELU_A·g + GELU_B·g³`
/// for the tanh form; GELU as `g · gelu_factor(g)`.
pub fn act_mul(gate: &mut [f32], up: Option<&[f32]>, act: Activation, isa: Isa) {
    assert!(up.is_none_or(|u| u.len() == gate.len()), "act_mul: lengths");
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 | Isa::Avx512 | Isa::Avx512Bf16 => unsafe { avx2::act_mul(gate, up, act) },
        _ => gate.iter_mut().enumerate().for_each(|(i, g)| {
            let u = up.map_or(1.0, |u| u[i]);
            *g = match act {
                Activation::Gelu => *g * gelu_factor(*g) * u,
                Activation::Silu => *g * u / (1.0 + (-*g).exp()),
                Activation::GeluTanh => *g * u / (1.0 + (-(*g * (GELU_A + GELU_B * *g * *g))).exp()),
            }
        }),
    }
}

/// Tokens the AVX2 float kernel sums together against a panel ([`avx2_panel_rows`]: all four
/// rows against three tokens fill its 16 registers).
pub(crate) const AVX2_FLOAT_GROUP: usize = 3;

/// Writes (`first`) or adds one token's sums for a panel's rows into `o` (the panel's rows of
/// the output, fewer than four in a matrix's last panel), with no call to `memcpy`: such
/// calls, one per panel and token in the scheduled path and one per panel and token group
/// where a kernel's sums were copied into a group's accumulators, took a tenth of the decode
/// time of SmolLM2 at batch 8 on the 2-core Zen 5 machine. A slice copy of a length known only
/// at run time is such a call, and LLVM made the whole panel's fixed copy beside it one as well
/// (the same call with the length 16 bytes, and a `vzeroupper` before it: ~2% of a batch-8
/// SmolLM2 profile's samples on the 2-core Zen 4 machine with AVX2, though with the two ways
/// alternating step by step the steps took the same time); so a last panel's rows go one by
/// one through volatile stores, which no pass turns into a call.
#[inline]
pub(crate) fn store_sums(o: &mut [f32], sums: &[f32; 4], first: bool) {
    match <&mut [f32; 4]>::try_from(&mut *o) {
        Ok(whole) if first => *whole = *sums,
        Ok(whole) => whole.iter_mut().zip(sums).for_each(|(o, v)| *o += v),
        Err(_) => {
            for (o, v) in o.iter_mut().zip(sums) {
                let s = if first { *v } else { *o + v };
                // SAFETY: `o` is a valid, exclusive reference.
                unsafe { std::ptr::write_volatile(o, s) };
            }
        }
    }
}

/// `ts` in order, cut into the groups of a many-token product against a panel: `g` ([1, 6])
/// tokens at a time and what is left, except that groups of three or more leave no lone token
/// where they can: four left go as two and two in groups of three, seven as five and two in
/// groups of six, since one token would take the one-token kernel, far fewer sums in flight.
#[inline]
pub(crate) fn groups(ts: std::ops::Range<usize>, g: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
    debug_assert!((1..=6).contains(&g));
    let mut t = ts.start;
    std::iter::from_fn(move || {
        let nt = match ts.end - t {
            0 => return None,
            4 if g == 3 => 2,
            left if g > 4 && left == g + 1 => g - 1,
            left => g.min(left),
        };
        t += nt;
        Some(t - nt..t)
    })
}

/// Writes `w` (a run of AVX2 panel chunks of `T`) to `out` as f32, each [`BLOCK`] as the two
/// halves `T`'s 16-element AVX2 load gives (for bf16 the even columns, then the odd), so the
/// AVX2 f32 kernels read from `out` exactly the values the `T` kernels read from `w`, with the
/// same inputs. A many-token product widens a panel once for all its tokens this way instead of
/// once per group of tokens. With `fetch` it asks for what lies 8 KiB past each chunk of `w`
/// as it goes (into L2), for a caller whose next block lies there.
///
/// # Panics
/// Unless `isa` is [`Isa::Avx2`], `w.len() == out.len()` and the length is a multiple of
/// [`BLOCK`].
pub fn widen_for_avx2<T: Elem + Avx2Load>(w: &[T], out: &mut [f32], isa: Isa, fetch: bool) {
    assert!(w.len() == out.len() && w.len().is_multiple_of(BLOCK), "widen_for_avx2: lengths");
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa::Avx2` is only produced after detecting avx2, fma and f16c; lengths
        // checked above.
        Isa::Avx2 if fetch => unsafe { avx2::widen::<T, true>(w, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 => unsafe { avx2::widen::<T, false>(w, out) },
        _ => panic!("widen_for_avx2: not on {isa:?}"),
    }
}

#[cfg(target_arch = "x86_64")]
/// [`softmax_rows`] in a SIMD module, on that module's `scale_max` and `exp_sub_sum`, compiled
/// with its features (`$feat`) so that both are inlined into the loop over the rows.
macro_rules! softmax_rows_kernel {
    ($feat:literal) => {
        /// [`super::softmax_rows`] with this module's `scale_max` and `exp_sub_sum`.
        ///
        /// # Safety
        /// The CPU must have the features this function is compiled with; as
        /// [`super::softmax_rows`].
        #[target_feature(enable = $feat)]
        #[allow(clippy::too_many_arguments)] // as softmax_rows
        pub unsafe fn softmax_rows(
            s: &mut [f32],
            stride: usize,
            keys: impl Fn(usize) -> std::ops::Range<usize>,
            clear: std::ops::Range<usize>,
            scale: f32,
            max: &mut [f32],
            sum: &mut [f32],
        ) {
            // SAFETY (both): this function has the kernels' features.
            super::softmax_rows_with(
                s,
                stride,
                keys,
                clear,
                max,
                sum,
                |v| unsafe { scale_max(v, scale) },
                |v, m| unsafe { exp_sub_sum(v, m) },
            )
        }
    };
}
#[cfg(target_arch = "x86_64")]
use softmax_rows_kernel;

/// The register blocks of attention's page kernels, written once for both vector widths
/// (instantiated in [`avx2`] with eight lanes and in [`avx512`] with sixteen): every lane goes
/// through the same operations in the same order on either, so the two paths give the same
/// scores and sums bit for bit.
///
/// `scores_block`: `NR` rows of scores against one page of transposed keys, keys
/// `j0..j0 + LANES * NV`. The dimensions go round-robin over [`SCORE_SETS`] sets of
/// accumulators, so several FMA chains are in flight however few the rows (one row alone would
/// wait on FMA latency). `values_block`: `NR` rows × `LANES * NV` columns (from `c0`) of
/// `o += p · v`.
#[cfg(target_arch = "x86_64")]
macro_rules! page_blocks {
    ($feat:literal, $v:ty, $lanes:expr, $bound:ident, $load:ident, $zero:ident, $set1:ident,
     $fma:ident, $add:ident, $loadu:ident, $storeu:ident) => {
        /// `fetch`: whether to ask for the page's rows ahead ([`scores_block_at`]'s `F`).
        #[inline]
        #[target_feature(enable = $feat)]
        #[allow(clippy::too_many_arguments)] // the block, its rows and outputs, and what to ask for
        unsafe fn scores_block<T: $bound, const NR: usize, const NV: usize>(
            kt: *const T,
            page_len: usize,
            j0: usize,
            q: *const f32,
            hd: usize,
            out: *mut f32,
            stride: usize,
            fetch: bool,
        ) {
            let keys = std::array::from_fn(|i| kt.add(j0 + $lanes * i));
            let outs = std::array::from_fn(|i| out.add(j0 + $lanes * i));
            // The vectors lie in one page: its rows are asked for from the first's.
            if fetch {
                scores_block_at::<T, NR, NV, 1>(keys, page_len, q, hd, outs, stride)
            } else {
                scores_block_at::<T, NR, NV, 0>(keys, page_len, q, hd, outs, stride)
            }
        }

        /// [`scores_block`] with each vector of keys where it lies: vector `i` of dimension `d`
        /// at `kt[i] + d * page_len`, its scores for row `r` to `out[i] + r * stride` (so a
        /// block may take keys from two pages). The rows of the pages the first `F` vectors
        /// lie in (from those vectors on) are asked for [`PAGE_AHEAD`](super::PAGE_AHEAD)
        /// ahead, a line for every line read. `F` is a constant so that a block that asks for
        /// nothing compiles as if the requests were not there: as a flag tested in the loop,
        /// it cost AVX2 prefill of 2000 tokens 10% (an accumulator spilled to the stack).
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn scores_block_at<T: $bound, const NR: usize, const NV: usize, const F: usize>(
            kt: [*const T; NV],
            page_len: usize,
            q: *const f32,
            hd: usize,
            out: [*mut f32; NV],
            stride: usize,
        ) {
            let span = SCORE_SETS * page_len * std::mem::size_of::<T>();
            let mut acc = [[[$zero(); NV]; NR]; SCORE_SETS];
            let step = |acc: &mut [[$v; NV]; NR], d: usize| {
                let k: [$v; NV] = std::array::from_fn(|i| T::$load(kt[i].add(d * page_len)));
                for (r, a) in acc.iter_mut().enumerate() {
                    let b = $set1(*q.add(r * hd + d));
                    for (ai, ki) in a.iter_mut().zip(&k) {
                        *ai = $fma(b, *ki, *ai);
                    }
                }
            };
            let mut d = 0;
            while d + SCORE_SETS <= hd {
                for k in &kt[..F] {
                    super::page_ahead(k.add(d * page_len).cast(), span);
                }
                for (s, a) in acc.iter_mut().enumerate() {
                    step(a, d + s);
                }
                d += SCORE_SETS;
            }
            while d < hd {
                step(&mut acc[0], d);
                d += 1;
            }
            for r in 0..NR {
                for i in 0..NV {
                    let mut v = acc[0][r][i];
                    for a in &acc[1..] {
                        v = $add(v, a[r][i]);
                    }
                    $storeu(out[i].add(r * stride), v);
                }
            }
        }

        /// `fetch`: whether to ask for the values' lines ahead ([`values_block_at`]'s `F`).
        #[inline]
        #[target_feature(enable = $feat)]
        #[allow(clippy::too_many_arguments)] // the block, its rows and outputs, and what to ask for
        unsafe fn values_block<T: $bound, const NR: usize, const NV: usize>(
            p: *const f32,
            stride: usize,
            v: *const T,
            n: usize,
            hd: usize,
            c0: usize,
            o: *mut f32,
            fetch: bool,
        ) {
            if fetch {
                values_block_at::<T, NR, NV, true>(p, stride, v, n, hd, c0, o)
            } else {
                values_block_at::<T, NR, NV, false>(p, stride, v, n, hd, c0, o)
            }
        }

        /// [`values_block`]; with `F`, each value row's columns of the block asked for
        /// [`PAGE_AHEAD`](super::PAGE_AHEAD) ahead as the row is read.
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn values_block_at<T: $bound, const NR: usize, const NV: usize, const F: bool>(
            p: *const f32,
            stride: usize,
            v: *const T,
            n: usize,
            hd: usize,
            c0: usize,
            o: *mut f32,
        ) {
            let mut acc: [[$v; NV]; NR] =
                std::array::from_fn(|r| std::array::from_fn(|i| $loadu(o.add(r * hd + c0 + $lanes * i))));
            for j in 0..n {
                if F {
                    super::page_ahead(v.add(j * hd + c0).cast(), NV * $lanes * std::mem::size_of::<T>());
                }
                let x: [$v; NV] = std::array::from_fn(|i| T::$load(v.add(j * hd + c0 + $lanes * i)));
                for (r, a) in acc.iter_mut().enumerate() {
                    let b = $set1(*p.add(r * stride + j));
                    for (ai, xi) in a.iter_mut().zip(&x) {
                        *ai = $fma(b, *xi, *ai);
                    }
                }
            }
            for (r, a) in acc.iter().enumerate() {
                for (i, ai) in a.iter().enumerate() {
                    $storeu(o.add(r * hd + c0 + $lanes * i), *ai);
                }
            }
        }
    };
}
#[cfg(target_arch = "x86_64")]
use page_blocks;

#[cfg(not(target_arch = "x86_64"))]
pub trait Avx2Load {}
#[cfg(not(target_arch = "x86_64"))]
impl<T> Avx2Load for T {}
#[cfg(not(target_arch = "x86_64"))]
pub trait Avx512Load {}
#[cfg(not(target_arch = "x86_64"))]
impl<T> Avx512Load for T {}

/// Bytes of a thread's piece of a one-token product from which the AVX2 float kernels read it in
/// three streams (its thirds side by side, [`avx2::panels`]), as the int8 ones of `maddubs` and
/// AVX-VNNI do; a shorter piece goes in one (and every piece where AVX512-VNNI runs int8:
/// [`ONE_STREAM`]). Two
/// streams from memory pay on long pieces and cost on short ones, whose streams each start anew. On
/// the 2-core Zen 4 machine whose virtual CPUs show no AVX-512 (`gridlm bench`, the two ways step
/// by step in one run): with two streams from 1 MiB on rather than for every piece, SmolLM2 bf16
/// decoded 2.8–5.1% faster while the cores sat together and 5.4–8.5% apart (six runs), int8
/// 4.9–7.4% (three); the llama-3.2-1b shape in bf16 and int8 (pieces of megabytes, the same streams
/// but for the tails) and the qwen2-0.5b shape within 1% either way. One stream for every piece
/// decoded SmolLM2 as fast as from 1 MiB on, but the llama-3.2-1b shape 0.7–7.2% slower (four runs,
/// slowest apart); from 4 MiB on, SmolLM2 as from 1 MiB and the shape up to 2% slower; from 256 KiB
/// on, SmolLM2 1.3–2.2% faster than two streams for every piece (together). On Zen 3, where
/// three streams replaced two later (in the float kernels, then the int8 ones), every piece in
/// three was faster: so the threshold is [`Streams::Long`]'s, one of two ways each rank times.
pub const STREAMS_FROM: usize = 1 << 20;

/// Which pieces of a one-token product the AVX2 float and int8 kernels read in three streams
/// (see [`STREAMS_FROM`]). Where streams pay depends on the CPU: on the 2-core Zen 4 machine
/// whose virtual CPUs show no AVX-512, two streams for every piece decoded SmolLM2 2.8–8.5%
/// slower than from 1 MiB on; on the 2-core Zen 3 machine, three streams for every piece
/// decoded it 6.5–7.4% faster than from 1 MiB on (four runs, the two ways step by step in one
/// run, the cores apart; two streams for every piece 0.96–1.05 of its speed), since SmolLM2's
/// layer products are 0.7–3.5 MB and a thread's pieces of them mostly shorter than 1 MiB. So
/// each rank times its own layers both ways at start-up ([`super::packed::pick_streams`]),
/// keeping the CPU's preferred way ([`preferred_streams`]) unless the other is clearly
/// faster; `GRIDLM_STREAMS` names one instead. No choice changes a result: each panel's sums
/// are the same bits either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Streams {
    /// Pieces of [`STREAMS_FROM`] bytes or more in three streams, shorter ones in one.
    Long,
    /// Every piece of three panels or more in three streams.
    Every,
}

impl Streams {
    /// In declared order, so a way's discriminant is its index.
    pub const ALL: [Streams; 2] = [Streams::Long, Streams::Every];

    pub fn name(self) -> &'static str {
        match self {
            Streams::Long => "long",
            Streams::Every => "every",
        }
    }

    pub fn parse(s: &str) -> Option<Streams> {
        Streams::ALL.into_iter().find(|f| f.name() == s)
    }
}

/// The process's [`Streams`], as its discriminant; [`Streams::Long`] until one is set.
static STREAMS: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(Streams::Long as u8);

/// Which pieces the AVX2 one-token kernels read in three streams in this process.
pub fn streams() -> Streams {
    let code = STREAMS.load(std::sync::atomic::Ordering::Relaxed);
    Streams::ALL.get(code as usize).copied().unwrap_or(Streams::Long)
}

/// Sets which pieces the AVX2 one-token kernels read in three streams, from their next call on.
pub fn set_streams(s: Streams) {
    STREAMS.store(s as u8, std::sync::atomic::Ordering::Relaxed);
}

/// The [`Streams`] a rank keeps unless its start-up timing puts the other ahead by 2% twice
/// running ([`super::packed::pick_streams`]), and takes where its layers are too small to
/// time: [`Streams::Every`] on Zen 3 ([`crate::host::zen3`]), the one CPU where it was measured
/// faster, [`Streams::Long`] elsewhere. On the 2-core Zen 3 machine `every` decoded SmolLM2
/// 2.8–7.8% faster than `long` in bf16 and 6.7–10.3% in int8 (`gridlm bench --compare-streams
/// long`, the two step by step in one run), the llama-3.2-1b shape 0.1–1.6%; yet with `long`
/// preferred, its start-up timing kept `long` in 7 of 20 starts of SmolLM2 in one spell of
/// the host (and took `every` in all of 12 starts 35 minutes later): the layers' products
/// alone, back to back, differ less than a decode step's, whose products attention and the
/// norms separate. On the 2-core Zen 4 machine (AVX-512 not shown to its virtual CPUs), two
/// streams for every piece had cost SmolLM2 2.8–8.5% against two from 1 MiB on
/// ([`STREAMS_FROM`]).
pub fn preferred_streams() -> Streams {
    if crate::host::zen3() {
        Streams::Every
    } else {
        Streams::Long
    }
}

/// The bytes of a thread's piece from which the AVX2 one-token kernels read it in three
/// streams under the process's [`Streams`].
pub(crate) fn streams_from() -> usize {
    match streams() {
        Streams::Long => STREAMS_FROM,
        Streams::Every => 0,
    }
}

/// The threshold for kernels that read every piece in one stream: the int8 one-token kernel of
/// AVX512-VNNI (the same loop as `maddubs`', one `vpdpbusd` a chunk instead of three
/// instructions). On the 2-core Zen 4 machine with AVX-512 (`gridlm bench`, the two ways step
/// by step in one run), one stream for every piece against two from [`STREAMS_FROM`] on:
/// the llama-3.2-1b shape's int8 decode 2–5% faster in 9 of 10 runs (the other 2% slower),
/// either placement of the cores; the qwen2-0.5b shape 0–6% faster (three runs); SmolLM2 within
/// 2% either way (three), where the same way both times gave 0.98–1.02 in nine runs of ten (1.08
/// in one). Two streams for every piece decoded SmolLM2 8–11% slower (three runs, apart and
/// between, every rep 3–14%).
pub const ONE_STREAM: usize = usize::MAX;

#[cfg(target_arch = "x86_64")]
pub use avx2::{
    panel_q8_many as avx2_panel_q8_many, panel_q8_tokens as avx2_panel_q8_tokens,
    panel_rows as avx2_panel_rows, panels as avx2_panels, panels_many as avx2_panels_many,
    panels_q8 as avx2_panels_q8, Avx2Load,
};

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{Activation, Ahead, Elem, Fetch, Int8Path, BLOCK, SCORE_SETS};
    use half::{bf16, f16};
    use std::arch::x86_64::*;

    /// Three rows of scores against sixteen keys of a page (two vectors) in one pass over the
    /// dimensions: twelve accumulators ([`SCORE_SETS`] × three rows × two vectors), the two
    /// vectors of keys of a dimension and one broadcast of the query: fifteen of the sixteen
    /// registers, so written in `asm!`. Compiled from intrinsics (`scores_block` with three rows
    /// and two vectors) the compiler kept some of the sums on the stack (each FMA chain then
    /// waits on a store and a load), and three rows went by eight keys instead, six chains,
    /// too few to cover the FMA's latency on both pipes (the broadcasts loaded twice as often
    /// besides). On the 2-core Zen 4 machine whose virtual CPUs hide AVX-512, one thread, a page
    /// of sixteen f16 keys × 64 dimensions against three rows in L2: ~72 ns against ~103 by
    /// eight keys (~0.94 of the core's FMA peak against ~0.66). Each sum is the same bits as
    /// `scores_block`'s: dimension `d` into set `d % 2` in order, the sets added at the end.
    ///
    /// Expands to [`Avx2Load::scores_3x16`] for key type `$ty`, whose four loads put dimension
    /// `d`'s keys 0–7 and 8–15 into `ymm12` and `ymm13`, then dimension `d + 1`'s (`{k}` is
    /// dimension `d`'s first key, `{pl}` a dimension's bytes, `{v1}` eight keys' bytes). With
    /// `fetch`, asks for the lines [`super::PAGE_AHEAD`] beyond each dimension pair's rows of
    /// the page, as `scores_block` does: one line or two ([`FETCH_3X16_BYTES`] at most).
    macro_rules! scores_3x16 {
        ($ty:ty, [$($k0:literal),+], [$($k1:literal),+], [$($k2:literal),+], [$($k3:literal),+]$(,)?) => {
            #[inline]
            #[target_feature(enable = "avx2,fma,f16c")]
            unsafe fn scores_3x16(
                kt: *const $ty,
                page_len: usize,
                q: *const f32,
                hd: usize,
                out: *mut f32,
                stride: usize,
                fetch: bool,
            ) {
                const _: () = assert!(SCORE_SETS == 2);
                debug_assert!(hd > 0 && hd.is_multiple_of(2));
                let span = SCORE_SETS * page_len * std::mem::size_of::<$ty>();
                debug_assert!(!fetch || span <= FETCH_3X16_BYTES);
                if fetch && span <= 64 {
                    scores_3x16!(@pass $ty, kt, page_len, q, hd, out, stride, "prefetcht1 [{k} + {ahead}]",
                        [$($k0),+], [$($k1),+], [$($k2),+], [$($k3),+])
                } else if fetch {
                    scores_3x16!(@pass $ty, kt, page_len, q, hd, out, stride,
                        "prefetcht1 [{k} + {ahead}]\n prefetcht1 [{k} + {ahead} + 64]",
                        [$($k0),+], [$($k1),+], [$($k2),+], [$($k3),+])
                } else {
                    scores_3x16!(@pass $ty, kt, page_len, q, hd, out, stride, "/* {ahead} */",
                        [$($k0),+], [$($k1),+], [$($k2),+], [$($k3),+])
                }
            }
        };
        (@pass $ty:ty, $kt:expr, $page_len:expr, $q:expr, $hd:expr, $out:expr, $stride:expr, $pf:literal,
         [$($k0:literal),+], [$($k1:literal),+], [$($k2:literal),+], [$($k3:literal),+]) => {
            std::arch::asm!(
                "vxorps ymm0, ymm0, ymm0",
                "vxorps ymm1, ymm1, ymm1",
                "vxorps ymm2, ymm2, ymm2",
                "vxorps ymm3, ymm3, ymm3",
                "vxorps ymm4, ymm4, ymm4",
                "vxorps ymm5, ymm5, ymm5",
                "vxorps ymm6, ymm6, ymm6",
                "vxorps ymm7, ymm7, ymm7",
                "vxorps ymm8, ymm8, ymm8",
                "vxorps ymm9, ymm9, ymm9",
                "vxorps ymm10, ymm10, ymm10",
                "vxorps ymm11, ymm11, ymm11",
                "2:",
                $pf,
                // Dimension d into set 0 (ymm0–5: row 0's two vectors, row 1's, row 2's).
                $($k0,)+
                $($k1,)+
                "vbroadcastss ymm14, [{q}]",
                "vfmadd231ps ymm0, ymm14, ymm12",
                "vfmadd231ps ymm1, ymm14, ymm13",
                "vbroadcastss ymm14, [{q} + {hd4}]",
                "vfmadd231ps ymm2, ymm14, ymm12",
                "vfmadd231ps ymm3, ymm14, ymm13",
                "vbroadcastss ymm14, [{q} + {hd4} * 2]",
                "vfmadd231ps ymm4, ymm14, ymm12",
                "vfmadd231ps ymm5, ymm14, ymm13",
                // Dimension d + 1 into set 1 (ymm6–11).
                $($k2,)+
                $($k3,)+
                "vbroadcastss ymm14, [{q} + 4]",
                "vfmadd231ps ymm6, ymm14, ymm12",
                "vfmadd231ps ymm7, ymm14, ymm13",
                "vbroadcastss ymm14, [{q} + {hd4} + 4]",
                "vfmadd231ps ymm8, ymm14, ymm12",
                "vfmadd231ps ymm9, ymm14, ymm13",
                "vbroadcastss ymm14, [{q} + {hd4} * 2 + 4]",
                "vfmadd231ps ymm10, ymm14, ymm12",
                "vfmadd231ps ymm11, ymm14, ymm13",
                "lea {k}, [{k} + {pl} * 2]",
                "add {q}, 8",
                "dec {n}",
                "jnz 2b",
                "vaddps ymm0, ymm0, ymm6",
                "vaddps ymm1, ymm1, ymm7",
                "vaddps ymm2, ymm2, ymm8",
                "vaddps ymm3, ymm3, ymm9",
                "vaddps ymm4, ymm4, ymm10",
                "vaddps ymm5, ymm5, ymm11",
                "vmovups [{o}], ymm0",
                "vmovups [{o} + 32], ymm1",
                "vmovups [{o} + {st4}], ymm2",
                "vmovups [{o} + {st4} + 32], ymm3",
                "vmovups [{o} + {st4} * 2], ymm4",
                "vmovups [{o} + {st4} * 2 + 32], ymm5",
                k = inout(reg) $kt => _,
                q = inout(reg) $q => _,
                n = inout(reg) $hd / 2 => _,
                hd4 = in(reg) $hd * 4,
                pl = in(reg) $page_len * std::mem::size_of::<$ty>(),
                o = in(reg) $out,
                st4 = in(reg) $stride * 4,
                v1 = const 8 * std::mem::size_of::<$ty>(),
                ahead = const super::PAGE_AHEAD,
                out("ymm0") _, out("ymm1") _, out("ymm2") _, out("ymm3") _,
                out("ymm4") _, out("ymm5") _, out("ymm6") _, out("ymm7") _,
                out("ymm8") _, out("ymm9") _, out("ymm10") _, out("ymm11") _,
                out("ymm12") _, out("ymm13") _, out("ymm14") _,
                options(nostack)
            )
        };
    }

    /// The most bytes of a page's dimension pair (`SCORE_SETS * page_len` keys) whose lines
    /// [`Avx2Load::scores_3x16`] asks for ahead: two lines.
    const FETCH_3X16_BYTES: usize = 128;

    /// Loads eight consecutive elements as f32 lanes. Every such type also has the 512-bit
    /// loads, so kernels generic over it can take either path.
    pub trait Avx2Load: Elem + super::Avx512Load {
        /// # Safety
        /// `p` must point to eight readable elements; the CPU must have avx2, fma and f16c.
        unsafe fn load8(p: *const Self) -> __m256;
        /// Sixteen consecutive elements as two vectors of f32 lanes, in the order of a
        /// prepared `x` (see [`super::prepare`]).
        /// # Safety
        /// As `load8`, for sixteen elements.
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn load16(p: *const Self) -> (__m256, __m256) {
            (Self::load8(p), Self::load8(p.add(8)))
        }
        /// One of [`Avx2Load::load16`]'s two vectors: the first for `HI == false`.
        /// # Safety
        /// As `load16`.
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn load_half<const HI: bool>(p: *const Self) -> __m256 {
            Self::load8(p.add(if HI { 8 } else { 0 }))
        }
        /// Three rows of scores against sixteen keys of a page, `kt` the first key of
        /// dimension 0 and `out` row 0's first score (the `scores_3x16` macro: the sums of
        /// `scores_block` with three rows, bit for bit).
        /// # Safety
        /// The CPU must have avx2, fma and f16c; `kt` has sixteen readable keys in each of `hd`
        /// (even) dimensions `page_len` apart, `q` three rows of `hd`, and `out` three rows of
        /// sixteen scores `stride` apart, writable.
        unsafe fn scores_3x16(
            kt: *const Self,
            page_len: usize,
            q: *const f32,
            hd: usize,
            out: *mut f32,
            stride: usize,
            fetch: bool,
        );
    }
    impl Avx2Load for f32 {
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn load8(p: *const f32) -> __m256 {
            _mm256_loadu_ps(p)
        }
        scores_3x16!(
            f32,
            ["vmovups ymm12, [{k}]"],
            ["vmovups ymm13, [{k} + {v1}]"],
            ["vmovups ymm12, [{k} + {pl}]"],
            ["vmovups ymm13, [{k} + {pl} + {v1}]"],
        );
    }
    impl Avx2Load for bf16 {
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn load8(p: *const bf16) -> __m256 {
            // bf16 is the top half of an f32: widen to 32 bits and shift left by 16.
            let h = _mm_loadu_si128(p as *const __m128i);
            _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
        }
        scores_3x16!(
            bf16,
            ["vpmovzxwd ymm12, [{k}]", "vpslld ymm12, ymm12, 16"],
            ["vpmovzxwd ymm13, [{k} + {v1}]", "vpslld ymm13, ymm13, 16"],
            ["vpmovzxwd ymm12, [{k} + {pl}]", "vpslld ymm12, ymm12, 16"],
            ["vpmovzxwd ymm13, [{k} + {pl} + {v1}]", "vpslld ymm13, ymm13, 16"],
        );
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn load16(p: *const bf16) -> (__m256, __m256) {
            // Lane i holds columns 2i (low half) and 2i+1 (high half): a shift gives the even
            // column as f32, a mask the odd one.
            let v = _mm256_loadu_si256(p as *const __m256i);
            let even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
            let odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(0xFFFF_0000u32 as i32)));
            (even, odd)
        }
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn load_half<const HI: bool>(p: *const bf16) -> __m256 {
            // Both halves lie in the same 32 bytes. Loaded by `asm!`, each half loads them
            // itself: the compiler, given one load for both, kept the 32 bytes from the first
            // half to the second and, in [`panel_rows`] with three tokens, whose sums take
            // twelve registers, spilled them to the stack. The odd columns' mask is read from
            // memory by the `vpand` itself: given the mask as a constant, the compiler made it
            // a blend with a zero register, which took a sum's register and spilled it once a
            // chunk (one core of Zen 3, three tokens through a panel in L1: 69–74 GFLOP/s this
            // way, 54–60 before).
            let v: __m256i;
            if HI {
                std::arch::asm!(
                    "vmovdqu {v}, [{p}]",
                    "vpand {v}, {v}, [{m}]",
                    v = out(ymm_reg) v,
                    p = in(reg) p,
                    m = in(reg) ODD_MASK.0.as_ptr(),
                    options(readonly, nostack, preserves_flags)
                );
                return _mm256_castsi256_ps(v);
            }
            std::arch::asm!(
                "vmovdqu {v}, [{p}]",
                v = out(ymm_reg) v,
                p = in(reg) p,
                options(readonly, nostack, preserves_flags)
            );
            _mm256_castsi256_ps(_mm256_slli_epi32(v, 16))
        }
    }
    /// Eight lanes of one value, aligned for a 256-bit memory operand.
    #[repr(align(32))]
    struct Lanes([u32; 8]);
    /// The high half of each 32-bit lane: a bf16 pair's odd column as f32.
    static ODD_MASK: Lanes = Lanes([0xFFFF_0000; 8]);
    impl Avx2Load for f16 {
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn load8(p: *const f16) -> __m256 {
            _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
        }
        scores_3x16!(
            f16,
            ["vcvtph2ps ymm12, [{k}]"],
            ["vcvtph2ps ymm13, [{k} + {v1}]"],
            ["vcvtph2ps ymm12, [{k} + {pl}]"],
            ["vcvtph2ps ymm13, [{k} + {pl} + {v1}]"],
        );
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn load_half<const HI: bool>(p: *const f16) -> __m256 {
            // By `asm!`, as bf16's: with the plain conversion the compiler converted all four
            // rows of a half before their FMAs, and with three tokens' sums in the other
            // registers it kept the sums on the stack.
            let v: __m256;
            std::arch::asm!(
                "vcvtph2ps {v}, [{p}]",
                v = out(ymm_reg) v,
                p = in(reg) p.add(if HI { 8 } else { 0 }),
                options(readonly, nostack, preserves_flags)
            );
            v
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
        _mm_cvtss_f32(s)
    }

    super::page_blocks!(
        "avx2,fma,f16c",
        __m256,
        8,
        Avx2Load,
        load8,
        _mm256_setzero_ps,
        _mm256_set1_ps,
        _mm256_fmadd_ps,
        _mm256_add_ps,
        _mm256_loadu_ps,
        _mm256_storeu_ps
    );

    /// # Safety
    /// The CPU must have avx2, fma and f16c; `page_len % 8 == 0`, `kt` is `[hd, page_len]`,
    /// `q` is `[rows, hd]` and `out` holds `rows` rows of `page_len` scores `stride` apart.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)] // as super::page_scores, with the shapes
    pub unsafe fn page_scores<T: Avx2Load>(
        kt: &[T],
        page_len: usize,
        q: &[f32],
        hd: usize,
        rows: usize,
        out: &mut [f32],
        stride: usize,
        fetch: bool,
    ) {
        let (k, o) = (kt.as_ptr(), out.as_mut_ptr());
        // Every block splits the dimensions over the same sets of accumulators, so a row's
        // score for a key is summed in one order whichever rows share its block: a query's
        // attention then does not depend on how many other rows (positions of its span, heads
        // of its group) come with it, and a prompt decoded in a batch gives the sums it gives
        // alone. (The split once ranged from one set for four rows to eight for one.)
        // Three rows by sixteen keys go in `asm!` (twelve accumulators) where the head size is
        // even, and, when it is to ask ahead, where a dimension pair's keys fit its requests.
        let by_asm = hd.is_multiple_of(2);
        let asks_fit = SCORE_SETS * page_len * std::mem::size_of::<T>() <= FETCH_3X16_BYTES;
        let mut r = 0;
        while r < rows {
            let nr = (rows - r).min(4);
            let (qr, or) = (q.as_ptr().add(r * hd), o.add(r * stride));
            let mut j = 0;
            while j < page_len {
                let ask = fetch && r == 0 && j == 0;
                if nr == 3 && page_len - j >= 16 && by_asm && (!ask || asks_fit) {
                    T::scores_3x16(k.add(j), page_len, qr, hd, or.add(j), stride, ask);
                    j += 16;
                    continue;
                }
                // Otherwise at most eight accumulators, as on AVX-512: from intrinsics, three
                // rows × sixteen keys kept some of their twelve on the stack (on the 2-core Zen 4
                // machine, three rows over a page of f16 keys took ~165 ns so, ~103 ns by eight
                // keys at a time, ~72 in `asm!`; the same sums every way).
                let wide = page_len - j >= 16 && nr <= 2;
                match (nr, wide) {
                    (2, true) => scores_block::<T, 2, 2>(k, page_len, j, qr, hd, or, stride, ask),
                    (1, true) => scores_block::<T, 1, 2>(k, page_len, j, qr, hd, or, stride, ask),
                    (4, _) => scores_block::<T, 4, 1>(k, page_len, j, qr, hd, or, stride, ask),
                    (3, _) => scores_block::<T, 3, 1>(k, page_len, j, qr, hd, or, stride, ask),
                    (2, false) => scores_block::<T, 2, 1>(k, page_len, j, qr, hd, or, stride, ask),
                    _ => scores_block::<T, 1, 1>(k, page_len, j, qr, hd, or, stride, ask),
                }
                j += if wide { 16 } else { 8 };
            }
            r += nr;
        }
    }

    /// Columns `c0..hd` of [`super::page_values`].
    ///
    /// # Safety
    /// The CPU must have avx2, fma and f16c; `p` holds `rows` rows of at least `n` values
    /// `stride` apart, `v` is `[n, hd]`, `o` is `[rows, hd]`, `c0 <= hd`.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)] // as super::page_values, with the shapes and the first column
    pub unsafe fn page_values<T: Avx2Load>(
        p: &[f32],
        stride: usize,
        v: &[T],
        n: usize,
        hd: usize,
        c0: usize,
        o: &mut [f32],
        fetch: bool,
    ) {
        let rows = o.len() / hd;
        let (pp, vp, op) = (p.as_ptr(), v.as_ptr(), o.as_mut_ptr());
        let mut r = 0;
        while r < rows {
            let nr = (rows - r).min(4);
            let (pr, or) = (pp.add(r * stride), op.add(r * hd));
            let ask = fetch && r == 0;
            let mut c = c0;
            while c + 8 <= hd {
                // Eight or nine accumulators (rows × column vectors): enough FMA chains in
                // flight to cover the FMA's latency on both pipes, and with the value vectors
                // and a broadcast they stay in registers. Three rows go by three vectors (nine
                // chains): by two (six), on the 2-core Zen 4 machine whose virtual CPUs hide
                // AVX-512, one thread, a page of sixteen f16 values × 64 columns against three
                // rows in L2 took ~93 ns against ~84. Each sum takes the keys in order however
                // the columns are blocked: the same bits.
                let cols = hd - c;
                let nv = match nr {
                    1 if cols >= 64 => 8,
                    1 | 2 if cols >= 32 => 4,
                    3 if cols >= 24 => 3,
                    _ if cols >= 16 => 2,
                    _ => 1,
                };
                match (nr, nv) {
                    (1, 8) => values_block::<T, 1, 8>(pr, stride, vp, n, hd, c, or, ask),
                    (1, 4) => values_block::<T, 1, 4>(pr, stride, vp, n, hd, c, or, ask),
                    (1, 2) => values_block::<T, 1, 2>(pr, stride, vp, n, hd, c, or, ask),
                    (1, _) => values_block::<T, 1, 1>(pr, stride, vp, n, hd, c, or, ask),
                    (2, 4) => values_block::<T, 2, 4>(pr, stride, vp, n, hd, c, or, ask),
                    (2, 2) => values_block::<T, 2, 2>(pr, stride, vp, n, hd, c, or, ask),
                    (2, _) => values_block::<T, 2, 1>(pr, stride, vp, n, hd, c, or, ask),
                    (3, 3) => values_block::<T, 3, 3>(pr, stride, vp, n, hd, c, or, ask),
                    (3, 2) => values_block::<T, 3, 2>(pr, stride, vp, n, hd, c, or, ask),
                    (3, _) => values_block::<T, 3, 1>(pr, stride, vp, n, hd, c, or, ask),
                    (_, 2) => values_block::<T, 4, 2>(pr, stride, vp, n, hd, c, or, ask),
                    _ => values_block::<T, 4, 1>(pr, stride, vp, n, hd, c, or, ask),
                }
                c += 8 * nv;
            }
            for rr in 0..nr {
                for cc in c..hd {
                    let mut sum = *or.add(rr * hd + cc);
                    for j in 0..n {
                        sum += *pr.add(rr * stride + j) * (*vp.add(j * hd + cc)).to_f32();
                    }
                    *or.add(rr * hd + cc) = sum;
                }
            }
            r += nr;
        }
    }

    /// `exp(x)` on eight lanes: `x = n·ln 2 + r` with |r| ≤ ln 2 / 2, a degree-6 polynomial
    /// for `exp(r)` (Cephes' coefficients), and `2^n` built in the exponent bits. Inputs are
    /// clamped to [−87.3, 88]: the result stays a normal number.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn exp8(x: __m256) -> __m256 {
        use super::exp_consts::*;
        let x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(LOW)), _mm256_set1_ps(HIGH));
        let n = _mm256_round_ps(
            _mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)),
            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC,
        );
        // ln 2 in two parts, so n · ln 2 is subtracted without rounding error.
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
        let mut y = _mm256_set1_ps(POLY[0]);
        for c in &POLY[1..] {
            y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(*c));
        }
        y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0)));
        let pow2 = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
        _mm256_mul_ps(y, _mm256_castsi256_ps(pow2))
    }

    /// # Safety
    /// The CPU must have avx2, fma and f16c.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn scale_max(s: &mut [f32], scale: f32) -> f32 {
        scale_max_from(s, scale, 0, _mm256_set1_ps(f32::NEG_INFINITY))
    }

    /// [`scale_max`] of `s[c..]`, the lanes' maxima so far in `mv` (the 512-bit kernel's
    /// remainder).
    ///
    /// # Safety
    /// The CPU must have avx2, fma and f16c; `c <= s.len()`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn scale_max_from(s: &mut [f32], scale: f32, mut c: usize, mut mv: __m256) -> f32 {
        let (n, p) = (s.len(), s.as_mut_ptr());
        let sc = _mm256_set1_ps(scale);
        while c + 8 <= n {
            let v = _mm256_mul_ps(_mm256_loadu_ps(p.add(c)), sc);
            _mm256_storeu_ps(p.add(c), v);
            mv = _mm256_max_ps(mv, v);
            c += 8;
        }
        let mut lanes = [0.0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), mv);
        let mut m = lanes.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        for v in &mut s[c..] {
            *v *= scale;
            m = m.max(*v);
        }
        m
    }

    /// # Safety
    /// The CPU must have avx2, fma and f16c; `x.len() == y.len()`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn scale_add(x: &mut [f32], a: f32, y: &[f32], b: f32) {
        let (n, px, py) = (x.len(), x.as_mut_ptr(), y.as_ptr());
        let (av, bv) = (_mm256_set1_ps(a), _mm256_set1_ps(b));
        let mut c = 0;
        while c + 8 <= n {
            let v = _mm256_add_ps(
                _mm256_mul_ps(_mm256_loadu_ps(px.add(c)), av),
                _mm256_mul_ps(_mm256_loadu_ps(py.add(c)), bv),
            );
            _mm256_storeu_ps(px.add(c), v);
            c += 8;
        }
        for (x, y) in x[c..].iter_mut().zip(&y[c..]) {
            *x = *x * a + y * b;
        }
    }

    super::softmax_rows_kernel!("avx2,fma,f16c");

    /// # Safety
    /// The CPU must have avx2, fma and f16c.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn exp_sub_sum(s: &mut [f32], m: f32) -> f32 {
        exp_sub_sum_from(s, m, 0, _mm256_setzero_ps())
    }

    /// [`exp_sub_sum`] of `s[c..]`, the lanes' sums so far in `acc` (the 512-bit kernel's
    /// remainder).
    ///
    /// # Safety
    /// The CPU must have avx2, fma and f16c; `c <= s.len()`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn exp_sub_sum_from(s: &mut [f32], m: f32, mut c: usize, mut acc: __m256) -> f32 {
        let (n, p) = (s.len(), s.as_mut_ptr());
        let mv = _mm256_set1_ps(m);
        while c + 8 <= n {
            let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p.add(c)), mv));
            _mm256_storeu_ps(p.add(c), e);
            acc = _mm256_add_ps(acc, e);
            c += 8;
        }
        let mut sum = hsum(acc);
        if c < n {
            // The tail through one padded vector, so every value goes through the same exp.
            let mut t = [0.0f32; 8];
            t[..n - c].copy_from_slice(&s[c..]);
            _mm256_storeu_ps(t.as_mut_ptr(), exp8(_mm256_sub_ps(_mm256_loadu_ps(t.as_ptr()), mv)));
            s[c..].copy_from_slice(&t[..n - c]);
            sum += t[..n - c].iter().sum::<f32>();
        }
        sum
    }

    /// [`super::softcap`].
    ///
    /// # Safety
    /// The CPU must have avx2, fma and f16c.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn softcap(s: &mut [f32], scale: f32, cap: f32) {
        let (n, p) = (s.len(), s.as_mut_ptr());
        let (k, c) = (_mm256_set1_ps(2.0 * scale / cap), _mm256_set1_ps(cap));
        let (one, two) = (_mm256_set1_ps(1.0), _mm256_set1_ps(2.0));
        let f = |v: __m256| {
            let e = exp8(_mm256_mul_ps(v, k));
            _mm256_mul_ps(c, _mm256_sub_ps(one, _mm256_div_ps(two, _mm256_add_ps(e, one))))
        };
        let mut i = 0;
        while i + 8 <= n {
            _mm256_storeu_ps(p.add(i), f(_mm256_loadu_ps(p.add(i))));
            i += 8;
        }
        if i < n {
            // The tail through one padded vector, so every value goes through the same exp.
            let mut t = [0.0f32; 8];
            t[..n - i].copy_from_slice(&s[i..]);
            _mm256_storeu_ps(t.as_mut_ptr(), f(_mm256_loadu_ps(t.as_ptr())));
            s[i..].copy_from_slice(&t[..n - i]);
        }
    }

    /// [`super::act_mul`]: SiLU, GELU's tanh form or GELU.
    ///
    /// # Safety
    /// The CPU must have avx2, fma and f16c; `gate.len() == up.len()`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn act_mul(gate: &mut [f32], up: Option<&[f32]>, act: Activation) {
        let (n, g) = (gate.len(), gate.as_mut_ptr());
        let one = _mm256_set1_ps(1.0);
        // `up`'s eight values from `c` on (ones where there is no `up`).
        let up_at = |c: usize| match up {
            Some(u) => _mm256_loadu_ps(u.as_ptr().add(c)),
            None => one,
        };
        let (ga, gb) = (_mm256_set1_ps(super::GELU_A), _mm256_set1_ps(super::GELU_B));
        let half = _mm256_set1_ps(0.5);
        // The same operations, in the same order, as the portable path (its `gelu_factor`).
        let f = |gv: __m256, uv: __m256| match act {
            Activation::Gelu => {
                let sign = _mm256_set1_ps(-0.0);
                let z = _mm256_mul_ps(
                    _mm256_andnot_ps(sign, gv),
                    _mm256_set1_ps(std::f32::consts::FRAC_1_SQRT_2),
                );
                let t = _mm256_div_ps(one, _mm256_add_ps(one, _mm256_mul_ps(half, z)));
                let mut p = _mm256_set1_ps(super::ERFC_P[0]);
                for c in &super::ERFC_P[1..] {
                    p = _mm256_add_ps(_mm256_mul_ps(p, t), _mm256_set1_ps(*c));
                }
                let e = exp8(_mm256_sub_ps(p, _mm256_mul_ps(z, z)));
                let tail = _mm256_mul_ps(_mm256_mul_ps(half, t), e);
                // 1 − tail where g ≥ 0, tail below.
                let below = _mm256_cmp_ps(gv, _mm256_setzero_ps(), _CMP_LT_OQ);
                let factor = _mm256_blendv_ps(_mm256_sub_ps(one, tail), tail, below);
                _mm256_mul_ps(_mm256_mul_ps(gv, factor), uv)
            }
            Activation::Silu | Activation::GeluTanh => {
                let a = if act == Activation::GeluTanh {
                    _mm256_mul_ps(gv, _mm256_add_ps(ga, _mm256_mul_ps(_mm256_mul_ps(gb, gv), gv)))
                } else {
                    gv
                };
                let e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), a));
                _mm256_div_ps(_mm256_mul_ps(gv, uv), _mm256_add_ps(one, e))
            }
        };
        let mut c = 0;
        while c + 8 <= n {
            _mm256_storeu_ps(g.add(c), f(_mm256_loadu_ps(g.add(c)), up_at(c)));
            c += 8;
        }
        if c < n {
            // The tail through one padded vector, so every value goes through the same exp.
            let (mut tg, mut tu) = ([0.0f32; 8], [1.0f32; 8]);
            tg[..n - c].copy_from_slice(&gate[c..]);
            if let Some(up) = up {
                tu[..n - c].copy_from_slice(&up[c..]);
            }
            _mm256_storeu_ps(tg.as_mut_ptr(), f(_mm256_loadu_ps(tg.as_ptr()), _mm256_loadu_ps(tu.as_ptr())));
            gate[c..].copy_from_slice(&tg[..n - c]);
        }
    }

    /// The four sums of `a[0..4]` in one vector: lane `i` is the sum of `a[i]`'s lanes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn hsum4(a: [__m256; 4]) -> __m128 {
        let c = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
        _mm_add_ps(_mm256_castps256_ps128(c), _mm256_extractf128_ps(c, 1))
    }

    /// The one-token prefetch of the AVX2 kernels: the chunk 1 KiB past the one at `wp`, read
    /// as one stream: far enough ahead to cover memory latency at full bandwidth. The hint is
    /// non-temporal: a decode step reads each weight once, so weights need not displace the
    /// inputs, activations and KV pages that are read again. On the 2-core Zen 1 machine one
    /// 256 MB bf16 matrix streamed ~4% faster with it than with the T0 hint, and SmolLM2-shaped
    /// layer products ~8% faster.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn fetch_ahead<T>(wp: *const T) {
        fetch_chunk::<T, 1024, _MM_HINT_NTA>(wp);
    }

    /// Asks for the float-weight chunk (four rows × [`BLOCK`] columns) lying `AHEAD` bytes past
    /// the one at `wp`, with the prefetch hint `HINT`. Prefetches never fault; the address is
    /// only computed, never read.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn fetch_chunk<T, const AHEAD: usize, const HINT: i32>(wp: *const T) {
        let ahead = (wp as *const u8).wrapping_add(AHEAD);
        let mut off = 0;
        while off < 4 * BLOCK * std::mem::size_of::<T>() {
            _mm_prefetch::<HINT>(ahead.wrapping_add(off) as *const i8);
            off += 64;
        }
    }

    /// The prefetch of the many-token kernels (and of [`widen`]): the panel chunk 8 KiB past
    /// the one at `wp`, into L2 (the T1 hint). Such a kernel spends several times longer on a
    /// chunk than the one-token kernel, and with [`fetch_ahead`] (1 KiB ahead, non-temporal)
    /// it waited on memory. On the 2-core Zen 4 machine (AVX2 measured there with
    /// `GRIDLM_NO_AVX512=1`) the bf16 products of SmolLM2's 30 layers took:
    /// - 8 tokens: 9.6 ms instead of 13.5 in 512-bit registers, 12.8 instead of 17.8 in AVX2;
    /// - 4 tokens: 7.0 ms instead of 10.2 in AVX2;
    /// - 16 and 64 tokens: 18.4 and 70.9 ms instead of 22.9 and 74.9 in 512-bit registers,
    ///   30.7 and 109 instead of 37.5 and 118 in AVX2 (widened first);
    ///
    /// and 8 tokens of four llama-3.2-1b-shaped layers 21.7–22.1 ms instead of 31.5–31.9.
    /// Distances of 6–16 KiB did as well, 4 KiB 7–11% worse, the T0 and NTA hints at 8 KiB
    /// ~25% worse. One-token kernels ask for it only under [`super::Fetch::Far`]: on Zen 4 they
    /// streamed slower with it (see there), on Zen 5 faster.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn fetch_far<T>(wp: *const T) {
        fetch_chunk::<T, FAR, _MM_HINT_T1>(wp);
    }

    /// How far ahead [`fetch_far`] asks, in bytes.
    const FAR: usize = 8 << 10;

    /// [`fetch_far`] within a panel's column block that ends at `end` and is followed, in the
    /// order its product reads them, by the block at `next`: past `end` the request goes as
    /// far into `next`. A prompt's product reads one column block of every panel of a run
    /// before the next block, so where blocks are narrower than the row (llama-3.2-1b's down
    /// product), 8 KiB past a block's end was the same panel's next block, read only in a
    /// later pass, and the next panel's block was not asked for. On the 2-core Zen 5 machine,
    /// with the requests going to the next panel's block, products of two 2048 × 8192 f16
    /// matrices in 512-bit registers ran at 326–350 GFLOP/s against 307–326 for 512 tokens
    /// and 301–337 against 267–312 for 64 (three rounds each, interleaved). A batch's decode
    /// reads a panel's blocks in turn (`schedule`), so its next block follows in memory: there
    /// the same request as before.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn fetch_far_then<T>(wp: *const T, end: *const T, next: *const T) {
        let far = (wp as *const u8).wrapping_add(FAR);
        let past = (far as usize).wrapping_sub(end as usize);
        let at = if far < end as *const u8 { far } else { (next as *const u8).wrapping_add(past) };
        fetch_chunk::<T, 0, _MM_HINT_T1>(at as *const T);
    }

    /// The one-token prefetch of [`super::Fetch::Nta`]: the chunk 2 KiB past the one at `wp`,
    /// non-temporal. On the 2-core Zen 5 machine, SmolLM2 bf16 decode in `vdpbf16ps` (steps
    /// alternating between two ways within a run) took 2–5% less time a step with it than
    /// with `Near` or `Far`, while the cores sat apart and together; 1 KiB ahead was ~1%
    /// slower than 2 KiB, 512 bytes 2–3%, and 4 KiB the same. At 2 KiB the hint counts: T0
    /// (into L1 and L2) 1–3% slower, T1 (into L2) 2–5% slower.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn fetch_stream<T>(wp: *const T) {
        fetch_chunk::<T, { 2 << 10 }, _MM_HINT_NTA>(wp);
    }

    /// [`fetch_stream`] for the float FMA kernels (all but `vdpbf16ps`), the AVX2 one-token
    /// kernel ([`panel_sums`], a thread's long range in three streams) and the 512-bit FMA one: the
    /// chunk 4 KiB past the one at `wp`. On the 2-core Zen 5 machine, two threads streaming
    /// SmolLM2's 120 layer products in a loop in AVX2 (`GRIDLM_NO_AVX512=1`) read, while the
    /// cores sat apart, at ~60 GB/s asking 2 KiB ahead, ~64 at 3 KiB, ~65.5 at 4 KiB, ~62.5 at
    /// 6 KiB and ~59 at 8 KiB (medians of rounds taken in turn), the 512-bit FMA kernel at
    /// 68.2 at 4 KiB against 64.8 at 2; while they sat together within 1% of each other up to
    /// 4 KiB (~48). SmolLM2 decode with `nta` named, interleaved, while the cores sat apart: in
    /// AVX2 228–245 tokens/s against 218–222, in the 512-bit FMA kernel (bf16 widened,
    /// `GRIDLM_NO_AVX512BF16=1`) 259–263 against 237–249 at the same reads; together the same
    /// or a little faster (medians 0.905 against 0.906 of the probe, 0.952 against 0.944). The
    /// `vdpbf16ps` kernel gained ~1% at 3–4 KiB in the loop and nothing end to end, so it
    /// keeps 2 KiB.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn fetch_stream_long<T>(wp: *const T) {
        fetch_chunk::<T, { 4 << 10 }, _MM_HINT_NTA>(wp);
    }

    /// Writes the first `out.len()` (at most four) lanes of `v` to `out`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn store_rows(v: __m128, out: &mut [f32]) {
        if out.len() >= 4 {
            _mm_storeu_ps(out.as_mut_ptr(), v);
        } else {
            let mut t = [0.0f32; 4];
            _mm_storeu_ps(t.as_mut_ptr(), v);
            out.copy_from_slice(&t[..out.len()]);
        }
    }

    /// Four rows' sums over `n` columns summed in column blocks of `kb`, for each of `N` panels
    /// summed side by side: `block(c0, end)` sums columns `c0..end` in one pass, and the
    /// blocks' sums are added in column order (the first block's as they are), as a
    /// many-token product adds the sums of its column blocks.
    ///
    /// `block` is called from one place, so it is inlined once and every block of a row is read
    /// by the same load instructions. Called first for the first block and then in a loop for
    /// the others, it was inlined twice, and where a row has more than one block (AVX2 reads
    /// rows past 1024 columns in blocks of at most 1024) each block's loads were other
    /// instructions than the block's before: by inference the hardware prefetchers, which
    /// follow streams per load instruction, lost the stream at every block. On the 2-core Zen 5
    /// machine the AVX2 kernel streamed 2048-column bf16 rows from memory (two threads, 1 GiB)
    /// at 41–43 GB/s in blocks of 1024 against 50–52 in one block, 38 against 68 with no
    /// software prefetch; with one call site 47–50 in blocks of 1024 against 46–48 in one. The
    /// llama-3.2-1b shape's bf16 decode with `GRIDLM_NO_AVX512=1` went from 0.81–0.83 of the
    /// bandwidth to 0.93–0.96 (three interleaved pairs), its f16 decode from 0.86–0.88 to 0.96;
    /// in 512-bit registers (blocks of 2048: llama-3.2-1b's down product) the same within the
    /// noise.
    #[inline(always)]
    pub(super) unsafe fn by_blocks<const N: usize>(
        n: usize,
        kb: usize,
        mut block: impl FnMut(usize, usize) -> [__m128; N],
    ) -> [__m128; N] {
        let mut sums = [_mm_setzero_ps(); N];
        let mut c = 0;
        while c < n {
            let more = block(c, (c + kb).min(n));
            if c == 0 {
                sums = more;
            } else {
                for (s, m) in sums.iter_mut().zip(more) {
                    *s = _mm_add_ps(*s, m);
                }
            }
            c += kb;
        }
        sums
    }

    /// Consecutive packed panels (four rows each, chunks of [`BLOCK`] columns side by side)
    /// against one prepared input: `out[4p + lane] = row lane of panel p · x`. `out` may end
    /// inside the last panel (the matrix's padding rows are not written). Each panel is read
    /// once, with nothing between two panels but four sums: from [`super::STREAMS_FROM`]
    /// bytes on (every range under [`super::Streams::Every`]) in three streams, the range's
    /// thirds side by side, below that in one.
    ///
    /// # Safety
    /// The CPU must have avx2, fma and f16c; `x.len()` is a multiple of [`BLOCK`] and
    /// `w.len() == 4 * x.len() * out.len().div_ceil(4)`.
    pub unsafe fn panels<T: Avx2Load>(w: &[T], x: &[f32], kb: usize, out: &mut [f32], fetch: Fetch) {
        with_fetch!(fetch, panels_with::<T>(w, x, kb, out))
    }

    /// [`panels`], prefetching as the [`Fetch`] of code `F` says. A long range's thirds are read
    /// side by side, a panel of each at a time (the last one or two panels alone): three streams
    /// from memory instead of one, each panel's sums the same bits. Against two streams (the
    /// halves side by side), step by step in one run on the 2-core Zen 3 machine while its reads
    /// ran at 25–42 GB/s (`gridlm bench --compare-prefetch` with a build whose `far` way meant
    /// three streams under `near`'s prefetch): the llama-3.2-1b shape in bf16 decoded 12–18% faster
    /// (five runs, together and apart), SmolLM2 0.7–3.2% faster (seven). Two streams against
    /// one, on the same machine: SmolLM2's layer and head products, one token in a loop, read
    /// at medians of 0.98–1.03 of a probe read beside them with two streams against 0.90–0.96
    /// with one (three series of 30–40 interleaved rounds); two neighbouring panels at a time,
    /// one stream read by two pointers, at 0.74. SmolLM2 decode (`gridlm bench`) ran at 0.852–0.901
    /// of the bandwidth against 0.832–0.871 (four interleaved pairs), less in the step than in the
    /// loop; with the cores' placement changing between runs, pairs fell either way. The hardware's
    /// prefetch alone ([`Fetch::None`]) gains most (0.78–0.82 → ~0.92 in the loop), so the start-up
    /// pick now and then takes it over `Near` (~0.96).
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn panels_with<T: Avx2Load, const F: u8>(w: &[T], x: &[f32], kb: usize, out: &mut [f32]) {
        let n = x.len();
        debug_assert!(n.is_multiple_of(BLOCK) && kb.is_multiple_of(BLOCK) && kb > 0);
        debug_assert_eq!(w.len(), 4 * n * out.len().div_ceil(4));
        let xp = x.as_ptr();
        let panel = |p: usize| w.as_ptr().add(p * 4 * n);
        let (groups, alone) =
            streams::<3>(out.len().div_ceil(4), std::mem::size_of_val(w), super::streams_from());
        for g in groups {
            let sums = panel_sums::<T, F, 3>(g.map(panel), xp, n, kb);
            for (s, p) in sums.into_iter().zip(g) {
                store_rows(s, panel_out(out, p));
            }
        }
        for p in alone {
            let [s] = panel_sums::<T, F, 1>([panel(p)], xp, n, kb);
            store_rows(s, panel_out(out, p));
        }
    }

    /// The panels `0..np` of a thread's range (`bytes` of weights) as the one-token kernels
    /// read them: from `from` bytes on ([`super::streams_from`], or
    /// [`super::ONE_STREAM`]) in `S` streams, groups `[p, p + np / S, …]` (the range's `S`
    /// parts side by side) and then the last `np % S` panels alone; below that in one stream,
    /// every panel alone, in order.
    pub(super) fn streams<const S: usize>(
        np: usize,
        bytes: usize,
        from: usize,
    ) -> (impl Iterator<Item = [usize; S]>, std::ops::Range<usize>) {
        let part = if bytes >= from { np / S } else { 0 };
        ((0..part).map(move |p| std::array::from_fn(|s| p + s * part)), S * part..np)
    }

    /// Panel `p`'s rows of `out` (fewer than four where `out` ends inside it).
    pub(super) fn panel_out(out: &mut [f32], p: usize) -> &mut [f32] {
        let end = (4 * p + 4).min(out.len());
        &mut out[4 * p..end]
    }

    /// The sums of `S` panels (`wp[s]` each one's first chunk) against the prepared input at
    /// `xp` (`n` columns), read side by side, chunk by chunk, prefetching as [`panels_with`].
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn panel_sums<T: Avx2Load, const F: u8, const S: usize>(
        mut wp: [*const T; S],
        xp: *const f32,
        n: usize,
        kb: usize,
    ) -> [__m128; S] {
        by_blocks(n, kb, |mut c, end| {
            let mut acc = [[_mm256_setzero_ps(); 4]; S];
            while c < end {
                for &w in &wp {
                    if F == Fetch::NEAR || F == Fetch::FAR {
                        fetch_ahead(w);
                    }
                    if F == Fetch::FAR {
                        fetch_far(w);
                    }
                    if F == Fetch::NTA {
                        fetch_stream_long(w);
                    }
                    if F == Fetch::PAGE {
                        super::fetch_page(w as *const u8, 4 * BLOCK * std::mem::size_of::<T>());
                    }
                }
                // A panel's four rows, then the next panel's: with a row of each panel in turn
                // instead, the two-stream kernel read SmolLM2's 120 layer products in a loop at
                // 58.5–59.6 GB/s against 61.4–63.0 (2-core Zen 5 machine, AVX2, the cores apart,
                // three interleaved pairs), and SmolLM2 decoded at 181–226 tokens/s against
                // 223–232 (nine pairs, apart). Each sum takes the same operations in the same
                // order either way.
                let (xl, xh) = (_mm256_loadu_ps(xp.add(c)), _mm256_loadu_ps(xp.add(c + 8)));
                for (a, w) in acc.iter_mut().zip(&wp) {
                    for (r, a) in a.iter_mut().enumerate() {
                        let (lo, hi) = T::load16(w.add(r * BLOCK));
                        *a = _mm256_fmadd_ps(hi, xh, _mm256_fmadd_ps(lo, xl, *a));
                    }
                }
                for w in &mut wp {
                    *w = w.add(4 * BLOCK);
                }
                c += BLOCK;
            }
            acc.map(|a| hsum4(a))
        })
    }

    /// All four rows of a packed panel against `NT` (at most three) prepared inputs
    /// (many-token products, with the panel in L1): `out[i] = [row 0 · xs[i], …, row 3 ·
    /// xs[i]]`. A chunk goes in two halves of eight columns: each half of every input is loaded
    /// once and serves four rows, each half-row of weights serves `NT` inputs, so with NT = 3
    /// there are 12 sums in flight, 7 loads per 12 FMAs and all 16 registers live. Each sum
    /// takes its columns in the order [`panels`] does, so one token's sums and many tokens' are
    /// the same bits.
    ///
    /// Twelve sums in flight cover the FMA's latency on both pipes of a Zen 3 core (4 cycles ×
    /// 2), which eight do not: on the 2-core Zen 3 machine, a 64-token tile of f32 panels in
    /// L1 ran at 74–86 GFLOP/s a thread this way against 50–67 for two rows × four tokens
    /// (the kernel before, whose inputs were also read twice from L2, once per pair of rows),
    /// of a 91–96 peak.
    ///
    /// # Safety
    /// As [`panels`]; `panel.len() == 4 * xs[i].len()`. (`next`, the block read after the
    /// panel's, is only asked for: any address will do.)
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn panel_rows<T: Avx2Load, const NT: usize, const FETCH: bool>(
        panel: &[T],
        xs: [&[f32]; NT],
        next: *const T,
    ) -> [[f32; 4]; NT] {
        let n = xs[0].len();
        debug_assert!(NT <= 3 && panel.len() == 4 * n);
        let x: [*const f32; NT] = std::array::from_fn(|i| xs[i].as_ptr());
        let mut acc = [[_mm256_setzero_ps(); 4]; NT];
        let (mut wp, end) = (panel.as_ptr(), panel.as_ptr_range().end);
        // With few tokens the panel comes from memory on the first pass: with `FETCH`, ask
        // for what lies ahead, past the block into `next`.
        let mut c = 0;
        while c < n {
            if FETCH {
                fetch_far_then(wp, end, next);
            }
            half::<T, NT, false>(wp, x, c, &mut acc);
            half::<T, NT, true>(wp, x, c + 8, &mut acc);
            wp = wp.add(4 * BLOCK);
            c += BLOCK;
        }
        // Each row's sum in the order [`panels`] sums it.
        let mut out = [[0.0f32; 4]; NT];
        for (o, a) in out.iter_mut().zip(acc) {
            _mm_storeu_ps(o.as_mut_ptr(), hsum4(a));
        }
        out
    }

    /// One half of a chunk (columns `c..c + 8` of the inputs) for [`panel_rows`]: no closures
    /// here, which would not take the target features.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn half<T: Avx2Load, const NT: usize, const HI: bool>(
        wp: *const T,
        x: [*const f32; NT],
        c: usize,
        acc: &mut [[__m256; 4]; NT],
    ) {
        let mut xv = [_mm256_setzero_ps(); NT];
        for (v, p) in xv.iter_mut().zip(x) {
            *v = _mm256_loadu_ps(p.add(c));
        }
        for (r, row) in [0, BLOCK, 2 * BLOCK, 3 * BLOCK].into_iter().enumerate() {
            let w = T::load_half::<HI>(wp.add(row));
            for (a, v) in acc.iter_mut().zip(xv) {
                a[r] = _mm256_fmadd_ps(w, v, a[r]);
            }
        }
    }

    /// Many tokens through consecutive whole panels (`w`, `n` columns each) against prepared
    /// inputs `xs` (token `t`'s `n` columns at `t * x_stride`): each panel's column blocks of
    /// `kb` in order, each block against every group of two or three tokens (cut as `groups`
    /// cuts them) by [`panel_rows`], the same sums bit for bit, stored straight into `out`
    /// (the first block's, unless `add`) or added to it (the others', in column order as the
    /// one-token kernel adds them): token `t`'s sum for the panels' row `r` goes to
    /// `out[t * stride + r]`, for `r` below `rows` (the last panel's padding rows are not
    /// written). Nothing passes through per-group calls or copies of the sums, which took
    /// about a tenth of a SmolLM2 batch step on Zen 3. A batch's decode step (2 to 15 tokens)
    /// streams its panels from memory this way, asking 8 KiB ahead (`FETCH`); a prompt's tile
    /// takes a panel's column block in f32, widened or as it is (`n` its columns, `x_stride`
    /// the inputs' rows, `add` for the blocks after the first), in L1. `before(k)` runs before
    /// the `k`th group of each panel's block (a caller's requests for what it reads next).
    ///
    /// # Safety
    /// The CPU must have avx2, fma and f16c; `n` and `kb` (not 0) are multiples of [`BLOCK`],
    /// `w.len()` a multiple of `4 n`, `xs.len() >= (n_tok - 1) x_stride + n` with `2 <= n_tok`
    /// and `n <= x_stride`, `rows <= w.len() / n`; `out` is valid for reads and writes at
    /// every such `t * stride + r`, and nothing else reads or writes those elements during the
    /// call.
    #[allow(clippy::too_many_arguments)] // the weights, the inputs, where the sums go
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn panels_many<T: Avx2Load, const FETCH: bool>(
        w: &[T],
        n: usize,
        (xs, x_stride): (&[f32], usize),
        n_tok: usize,
        out: *mut f32,
        stride: usize,
        rows: usize,
        (kb, add): (usize, bool),
        mut before: impl FnMut(usize),
    ) {
        debug_assert!(n.is_multiple_of(BLOCK) && w.len().is_multiple_of(4 * n) && n <= x_stride);
        debug_assert!(kb.is_multiple_of(BLOCK) && kb > 0 && n_tok >= 2);
        debug_assert!(xs.len() >= (n_tok - 1) * x_stride + n);
        let x = xs.as_ptr();
        let panels = w.len() / (4 * n);
        for p in 0..panels {
            let r0 = 4 * p;
            let nr = rows.saturating_sub(r0).min(4);
            let mut c0 = 0;
            while c0 < n {
                let cn = kb.min(n - c0);
                let panel = std::slice::from_raw_parts(w.as_ptr().add(4 * n * p + 4 * c0), 4 * cn);
                let block = |t: usize| std::slice::from_raw_parts(x.add(x_stride * t + c0), cn);
                // Read next: this panel's next block, or the next panel's first (both follow on).
                let next = panel.as_ptr_range().end;
                for (k, ts) in super::groups(0..n_tok, super::AVX2_FLOAT_GROUP).enumerate() {
                    before(k);
                    let t = ts.start;
                    let sums: &[[f32; 4]] = match ts.len() {
                        3 => &panel_rows::<T, 3, FETCH>(panel, [block(t), block(t + 1), block(t + 2)], next),
                        _ => &panel_rows::<T, 2, FETCH>(panel, [block(t), block(t + 1)], next),
                    };
                    for (i, s) in sums.iter().enumerate() {
                        let o = std::slice::from_raw_parts_mut(out.add((t + i) * stride + r0), nr);
                        super::store_sums(o, s, c0 == 0 && !add);
                    }
                }
                c0 += cn;
            }
        }
    }

    /// Each block of [`BLOCK`] floats of `x` into `out` as the AVX2 bf16 kernels take an
    /// input ([`super::prepare`]): its even columns, then its odd ones. Two shuffles pick the
    /// pairs of each 128-bit half and one permute puts the halves in order, per eight floats.
    ///
    /// # Safety
    /// The CPU must have avx2; `x.len() == out.len()`, a multiple of [`BLOCK`].
    #[target_feature(enable = "avx2")]
    pub unsafe fn split_even_odd(x: &[f32], out: &mut [f32]) {
        debug_assert!(x.len() == out.len() && x.len().is_multiple_of(BLOCK));
        for (xb, ob) in x.chunks_exact(BLOCK).zip(out.chunks_exact_mut(BLOCK)) {
            let (a, b) = (_mm256_loadu_ps(xb.as_ptr()), _mm256_loadu_ps(xb.as_ptr().add(8)));
            // Per 128-bit half: a's and b's even (odd) lanes, as 64-bit pairs in the order
            // (x0 x2) (x8 x10) (x4 x6) (x12 x14); the permute makes it (x0 x2) (x4 x6) ….
            let in_order =
                |v: __m256| _mm256_castpd_ps(_mm256_permute4x64_pd::<0b11_01_10_00>(_mm256_castps_pd(v)));
            let even = in_order(_mm256_shuffle_ps::<0b10_00_10_00>(a, b));
            let odd = in_order(_mm256_shuffle_ps::<0b11_01_11_01>(a, b));
            _mm256_storeu_ps(ob.as_mut_ptr(), even);
            _mm256_storeu_ps(ob.as_mut_ptr().add(8), odd);
        }
    }

    /// See [`super::widen_for_avx2`].
    ///
    /// # Safety
    /// The CPU must have avx2, fma and f16c; `w.len() == out.len()`, a multiple of [`BLOCK`].
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn widen<T: Avx2Load, const FETCH: bool>(w: &[T], out: &mut [f32]) {
        debug_assert!(w.len() == out.len() && w.len().is_multiple_of(BLOCK));
        let (src, dst) = (w.as_ptr(), out.as_mut_ptr());
        let mut i = 0;
        while i < w.len() {
            if FETCH && i % (4 * BLOCK) == 0 {
                fetch_far(src.add(i));
            }
            let (lo, hi) = T::load16(src.add(i));
            _mm256_storeu_ps(dst.add(i), lo);
            _mm256_storeu_ps(dst.add(i + 8), hi);
            i += BLOCK;
        }
    }

    /// Consecutive int8 packed panels (four rows each, chunks of [`BLOCK`] columns side by
    /// side) against an input quantized per group of two chunks (`q`, one scale per group in
    /// `s`) for `path`, times the rows' own scales:
    /// `out[4p + lane] = row_scale · Σ_g s[g] · (row · q)_g`.
    ///
    /// Each weight takes the sign of its input (`sign`) and meets |q| as an unsigned byte.
    /// `maddubs` adds neighbouring products into 16 bits (with |q|, |w| ≤ 127 at most 32258,
    /// exact) and a `madd` adds neighbouring pairs of those into 32 bits; `vpdpbusd` adds the
    /// same four products (the same four bytes to each 32-bit lane) straight into 32 bits. (The
    /// `madd` once a group of two chunks instead, which needed |q| ≤ 64 so that four products
    /// fit 16 bits, was no faster where memory sets the pace: one core of Zen 3 read 24–40 G
    /// weights/s from L2 with it and 31–43 without, in the host's noise, while memory delivers
    /// 8–11.) Per group they are
    /// converted and scaled once, in the same order on every path, so the paths agree bit for
    /// bit. Two rows share one register: lanes 0–3 sum row 0 (or 2), lanes 4–7 row 1 (or 3).
    /// `out` may end inside the last panel. A long range's panels go in three streams, as the
    /// float kernel's do ([`panels`], [`super::STREAMS_FROM`]; every range's under
    /// [`super::Streams::Every`]). On the 2-core Zen 3 machine two
    /// streams read the llama-3.2-1b shape's int8 decode at 0.91–0.97 of the bandwidth against
    /// 0.84–0.87 with one (three interleaved pairs); three against two, step by step in one run
    /// (`gridlm bench --compare-prefetch`, a build whose `far` way meant three streams under
    /// `near`'s prefetch): that shape 1.0–3.1% faster (five runs), SmolLM2 0.5–5.8% (four),
    /// where the same way on both sides gave 0.992–1.013 (five). With AVX512-VNNI every range
    /// goes in one stream ([`super::ONE_STREAM`]).
    ///
    /// # Safety
    /// The CPU must have avx2, fma and f16c, and what `path` names; every |q| ≤
    /// [`super::INT8_INPUT_MAX`], `q.len()` is a multiple of [`BLOCK`],
    /// `s.len() == q.len().div_ceil(2 * BLOCK)`, `w.len() == 4 * q.len() * np` and
    /// `row_scales.len() == 4 * np` with `np = out.len().div_ceil(4)`.
    pub unsafe fn panels_q8(
        w: &[i8],
        q: &[i8],
        s: &[f32],
        row_scales: &[f32],
        out: &mut [f32],
        fetch: Fetch,
        path: Int8Path,
    ) {
        match path {
            Int8Path::AvxVnni => with_fetch!(fetch, panels_q8_avx_vnni(w, q, s, row_scales, out)),
            Int8Path::Avx512Vnni => with_fetch!(fetch, panels_q8_avx512_vnni(w, q, s, row_scales, out)),
            _ => with_fetch!(fetch, panels_q8_maddubs(w, q, s, row_scales, out)),
        }
    }

    /// `acc` plus the sums of four neighbouring products of `ax` (unsigned) and `sw`: pairs
    /// summed into 16 bits by `maddubs` (|q|, |w| ≤ 127: at most 32258, exact), then pairs of
    /// those into 32 bits by `madd`, as `vpdpbusd` sums them.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn add_maddubs(acc: __m256i, ax: __m256i, sw: __m256i) -> __m256i {
        _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(ax, sw), _mm256_set1_epi16(1)))
    }

    #[inline]
    #[target_feature(enable = "avx2,avxvnni")]
    unsafe fn add_dpbusd_avx(acc: __m256i, ax: __m256i, sw: __m256i) -> __m256i {
        _mm256_dpbusd_avx_epi32(acc, ax, sw)
    }

    #[inline]
    #[target_feature(enable = "avx2,avx512vnni,avx512vl")]
    unsafe fn add_dpbusd_evex(acc: __m256i, ax: __m256i, sw: __m256i) -> __m256i {
        _mm256_dpbusd_epi32(acc, ax, sw)
    }

    /// One [`panels_q8`] kernel, prefetching as the [`Fetch`] of code `F` says: `$add(acc, ax,
    /// sw)` adds a chunk's products to a group's 32-bit sums.
    macro_rules! panels_q8_kernel {
        ($name:ident, $tokens:ident, $features:literal, $add:ident, $streams_from:expr) => {
            /// One panel against `NT` tokens at once, each token's four sums into `out[t]`: what
            /// [`panels_q8`] gives each token alone, bit for bit (see [`panel_q8_tokens`]).
            #[target_feature(enable = $features)]
            unsafe fn $tokens<const NT: usize>(
                w: &[i8],
                q: [*const i8; NT],
                qa: [*const u8; NT],
                s: [*const f32; NT],
                row_scales: &[f32],
                out: &mut [[f32; 4]],
            ) {
                let kc = w.len() / (4 * BLOCK);
                debug_assert!(out.len() == NT && row_scales.len() == 4);
                let zero = _mm256_setzero_si256();
                let mut acc = [(_mm256_setzero_ps(), _mm256_setzero_ps()); NT];
                let mut wp = w.as_ptr();
                let mut k = 0;
                while k < kc {
                    // A group of two chunks (one where the row ends after one): its weights
                    // loaded once for every token, the line 4 KiB past each asked for.
                    let two = k + 1 < kc;
                    _mm_prefetch(wp.wrapping_add(4096), _MM_HINT_T0);
                    let w01 = _mm256_loadu_si256(wp as *const __m256i);
                    let w23 = _mm256_loadu_si256(wp.add(32) as *const __m256i);
                    let (v01, v23) = if two {
                        _mm_prefetch(wp.wrapping_add(4096 + 4 * BLOCK), _MM_HINT_T0);
                        (
                            _mm256_loadu_si256(wp.add(4 * BLOCK) as *const __m256i),
                            _mm256_loadu_si256(wp.add(4 * BLOCK + 32) as *const __m256i),
                        )
                    } else {
                        (zero, zero)
                    };
                    for (a, ((&qt, &at), &st)) in acc.iter_mut().zip(q.iter().zip(&qa).zip(&s)) {
                        // Chunk `k` of the token's input and of its |q| (made once per product,
                        // not once per chunk and token), in both 128-bit lanes.
                        let input = |k: usize| {
                            let x = _mm_loadu_si128(qt.add(k * BLOCK) as *const __m128i);
                            let ax = _mm_loadu_si128(at.add(k * BLOCK) as *const __m128i);
                            (_mm256_broadcastsi128_si256(x), _mm256_broadcastsi128_si256(ax))
                        };
                        let (x, ax) = input(k);
                        let mut p = (
                            $add(zero, ax, _mm256_sign_epi8(w01, x)),
                            $add(zero, ax, _mm256_sign_epi8(w23, x)),
                        );
                        if two {
                            let (x, ax) = input(k + 1);
                            p = (
                                $add(p.0, ax, _mm256_sign_epi8(v01, x)),
                                $add(p.1, ax, _mm256_sign_epi8(v23, x)),
                            );
                        }
                        let sc = _mm256_set1_ps(*st.add(k / 2));
                        a.0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p.0), sc, a.0);
                        a.1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p.1), sc, a.1);
                    }
                    wp = wp.add(if two { 8 * BLOCK } else { 4 * BLOCK });
                    k += 2;
                }
                let rs = _mm_loadu_ps(row_scales.as_ptr());
                for (o, a) in out.iter_mut().zip(acc) {
                    _mm_storeu_ps(o.as_mut_ptr(), finish_q8(a.0, a.1, rs));
                }
            }

            #[target_feature(enable = $features)]
            unsafe fn $name<const F: u8>(w: &[i8], q: &[i8], s: &[f32], row_scales: &[f32], out: &mut [f32]) {
                let n = q.len();
                debug_assert_eq!(n % BLOCK, 0);
                debug_assert_eq!(w.len(), 4 * n * out.len().div_ceil(4));
                debug_assert_eq!(row_scales.len(), 4 * out.len().div_ceil(4));
                debug_assert_eq!(s.len(), n.div_ceil(2 * BLOCK));
                let kc = n / BLOCK;
                let panel = |p: usize| w.as_ptr().add(p * 4 * n);
                let rs = |p: usize| _mm_loadu_ps(row_scales.as_ptr().add(4 * p));
                // One stream or three, from `$streams_from` bytes on, as the float kernel
                // ([`panels_with`]).
                let (groups, alone) =
                    streams::<3>(out.len().div_ceil(4), std::mem::size_of_val(w), $streams_from);
                for g in groups {
                    let sums = sums::<F, 3>(g.map(panel), q.as_ptr(), s, kc);
                    for (a, p) in sums.into_iter().zip(g) {
                        store_rows(finish_q8(a.0, a.1, rs(p)), panel_out(out, p));
                    }
                }
                for p in alone {
                    let [a] = sums::<F, 1>([panel(p)], q.as_ptr(), s, kc);
                    store_rows(finish_q8(a.0, a.1, rs(p)), panel_out(out, p));
                }

                /// The group-scaled sums of `S` panels (`wp[i]` each one's first chunk), rows
                /// (0,1) and (2,3), against `kc` chunks of the input at `qp`, read side by side.
                #[inline]
                #[target_feature(enable = $features)]
                unsafe fn sums<const F: u8, const S: usize>(
                    mut wp: [*const i8; S],
                    qp: *const i8,
                    s: &[f32],
                    kc: usize,
                ) -> [(__m256, __m256); S] {
                    // One chunk (four rows of BLOCK int8) is one cache line. Fetch this far
                    // ahead: the kernel has less spare time per byte than the float ones, so it
                    // needs more lead.
                    const AHEAD: usize = 4096;
                    // Chunk `k` (its input `x`, |x| in `ax`) of the panel at `wp`: its products
                    // for rows (0,1) and (2,3) added to `acc`.
                    let chunk = |wp: *const i8, (x, ax): (__m256i, __m256i), acc: (__m256i, __m256i)| {
                        if F == Fetch::NEAR || F == Fetch::FAR {
                            _mm_prefetch(wp.wrapping_add(AHEAD), _MM_HINT_T0);
                        }
                        if F == Fetch::NTA {
                            _mm_prefetch(wp.wrapping_add(AHEAD), _MM_HINT_NTA);
                        }
                        if F == Fetch::FAR {
                            fetch_far(wp);
                        }
                        if F == Fetch::PAGE {
                            super::fetch_page(wp as *const u8, 64);
                        }
                        let w01 = _mm256_loadu_si256(wp as *const __m256i);
                        let w23 = _mm256_loadu_si256(wp.add(32) as *const __m256i);
                        ($add(acc.0, ax, _mm256_sign_epi8(w01, x)), $add(acc.1, ax, _mm256_sign_epi8(w23, x)))
                    };
                    let input = |k: usize| {
                        let x =
                            _mm256_broadcastsi128_si256(_mm_loadu_si128(qp.add(k * BLOCK) as *const __m128i));
                        (x, _mm256_sign_epi8(x, x))
                    };
                    let mut acc = [(_mm256_setzero_ps(), _mm256_setzero_ps()); S];
                    let mut k = 0;
                    while k < kc {
                        let (x0, x1) = (input(k), (k + 1 < kc).then(|| input(k + 1)));
                        let sc = _mm256_set1_ps(*s.get_unchecked(k / 2));
                        for (a, w) in acc.iter_mut().zip(&mut wp) {
                            let mut p = chunk(*w, x0, (_mm256_setzero_si256(), _mm256_setzero_si256()));
                            *w = w.add(4 * BLOCK);
                            if let Some(x1) = x1 {
                                p = chunk(*w, x1, p);
                                *w = w.add(4 * BLOCK);
                            }
                            a.0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p.0), sc, a.0);
                            a.1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p.1), sc, a.1);
                        }
                        k += 2;
                    }
                    acc
                }
            }
        };
    }

    panels_q8_kernel!(
        panels_q8_maddubs,
        tokens_q8_maddubs,
        "avx2,fma,f16c",
        add_maddubs,
        super::streams_from()
    );
    panels_q8_kernel!(
        panels_q8_avx_vnni,
        tokens_q8_avx_vnni,
        "avx2,fma,f16c,avxvnni",
        add_dpbusd_avx,
        super::streams_from()
    );
    panels_q8_kernel!(
        panels_q8_avx512_vnni,
        tokens_q8_avx512_vnni,
        "avx2,fma,f16c,avx512vnni,avx512vl",
        add_dpbusd_evex,
        super::ONE_STREAM
    );

    /// One int8 panel (`w`: four rows of `n` columns, chunk by chunk) against one to four
    /// tokens at once (`out.len()` of them; `q[t]`, `qa[t]` and `s[t]` token `t`'s quantized
    /// input, its |q| ([`super::abs_q8`]) and its scales), each token's four sums into
    /// `out[t]`: the sums [`panels_q8`] gives each token alone, bit for bit (the same integers
    /// per lane and group, converted, scaled and added in the same order), on the same `path`.
    /// A group of two chunks is loaded once for all the tokens, and one call goes through the
    /// panel, where a batch's decode step and a prompt's products called [`panels_q8`] on one
    /// panel for each token: on the 2-core Zen 4 machine (AVX2, `maddubs`), SmolLM2 int8
    /// decode steps at a batch of 8 took 15–17% less time (three runs, the two ways
    /// alternating step by step; int8 then at 1.02× bf16's tokens/s, 0.91× before), the
    /// llama-3.2-1b shape's int8 prefill of 512 tokens ran at 76.9–78.5 tokens/s against
    /// 70.1–74.8, and 2 to 64 tokens over SmolLM2's products in cache 5–30% faster; with each
    /// token's |q| made once per product rather than by a `vpsignb` per chunk, the batch's
    /// steps 4.7–5.2% shorter again (three runs, step by step). (Why int8 gains no more over
    /// bf16 there: the `vpsignb`, `vpmaddubsw` and `vpmaddwd` of 32 products seem to share the
    /// two pipes f32 FMAs take; in a loop of independent chains they took ~1.9 cycles per 32
    /// products, an FMA 0.5 per 8, so both make ~16 products a cycle.) Not measured with
    /// AVX-VNNI.
    ///
    /// # Safety
    /// The CPU must have avx2, fma and f16c, and what `path` names; `w.len()` is `4 n` with
    /// `n` a multiple of [`BLOCK`]; `row_scales.len() == 4`; `1 <= out.len() <= 4`; for each
    /// `t` below `out.len()`, `q[t]` is valid for `n` reads with every |q| ≤
    /// [`super::INT8_INPUT_MAX`], `qa[t]` for `n` reads holding their |q|, and `s[t]` for
    /// `n.div_ceil(2 BLOCK)`.
    pub unsafe fn panel_q8_tokens(
        w: &[i8],
        q: [*const i8; 4],
        qa: [*const u8; 4],
        s: [*const f32; 4],
        row_scales: &[f32],
        out: &mut [[f32; 4]],
        path: Int8Path,
    ) {
        macro_rules! by_tokens {
            ($f:ident) => {{
                let [a, b, c, d] = q;
                let [aa, ab, ac, ad] = qa;
                let [sa, sb, sc, sd] = s;
                match out.len() {
                    4 => $f::<4>(w, [a, b, c, d], [aa, ab, ac, ad], [sa, sb, sc, sd], row_scales, out),
                    3 => $f::<3>(w, [a, b, c], [aa, ab, ac], [sa, sb, sc], row_scales, out),
                    2 => $f::<2>(w, [a, b], [aa, ab], [sa, sb], row_scales, out),
                    _ => $f::<1>(w, [a], [aa], [sa], row_scales, out),
                }
            }};
        }
        match path {
            Int8Path::AvxVnni => by_tokens!(tokens_q8_avx_vnni),
            Int8Path::Avx512Vnni => by_tokens!(tokens_q8_avx512_vnni),
            _ => by_tokens!(tokens_q8_maddubs),
        }
    }

    /// One int8 panel (`w`: four rows of `n` columns, chunk by chunk) against up to four tokens
    /// at once, for inputs quantized for a VNNI path, each token's four sums into `out[i]`:
    /// the same sums as [`panels_q8`] gives each token alone, bit for bit. `xu[i]` is token
    /// `i`'s input offset to unsigned (`q + 128`, [`super::offset_q8`]), `s[i]` its scales.
    ///
    /// [`panels_q8`] multiplies |q| by the weights with their signs flipped where q is negative:
    /// three sign operations and two `vpdpbusd` per chunk and token. Here a chunk (four rows, one
    /// 512-bit register whose lanes are those of the one-token kernel's two) meets every token's
    /// `q + 128` in one `vpdpbusd`, and each token's sums over a group of two chunks start from the
    /// `−128 · w` that takes off (a `vpdpbusd` of 128s per chunk and a negation, shared by the
    /// tokens): each lane then holds the integer the one-token kernel's lane holds (the sums are
    /// exact), and is scaled and added in f32 as there. (Subtracting it from each token's sums
    /// after the group instead, one operation more a token, products of 512 tokens over
    /// llama-3.2-1b-shaped int8 layers ran at 736–768 GOP/s against 755–801 this way on the 2-core
    /// Zen 5 machine, of 8 tokens from memory at 653–724 against 658–751, five rounds each,
    /// interleaved; the shape's int8 prefill of 512 tokens at 331.8–341.7 tokens/s against
    /// 341.6–356.4, three pairs.) Each group of two chunks asks for `ahead`'s lines, if given (see
    /// [`super::SPREAD_FROM`]; its share is cut for that many requests), else each chunk for the
    /// line 4 KiB past it. (Asking at every chunk, the requests' bookkeeping cost as much as a
    /// fifth of the kernel: on the 2-core Zen 5 machine products of 8 tokens over
    /// llama-3.2-1b-shaped rows ran at 31–32 GB/s of weights in cache asking every other chunk
    /// against 25–27, 31–37.6 from memory against 23–30; `gridlm bench` at a batch of 8 with
    /// `--quant int8` decoded at 233–236 tokens/s against 188–192 and prefilled 512 tokens at
    /// 315–326 against 240–248. Every fourth chunk, prefill gained 3% more and the batch lost
    /// 6–10%.) (In 256-bit registers, two tokens a call with AVX-VNNI's 16 registers, it was no
    /// faster than token by token on the 2-core Zen 5 machine: int8 prefill of 512 tokens on the
    /// llama-3.2-1b shape at 177–186 tokens/s against 185–191 with `GRIDLM_NO_AVX512=1`.)
    ///
    /// # Safety
    /// The CPU must have avx2, fma, f16c, avx512f and avx512vnni; `n` is a multiple of
    /// [`BLOCK`], `w.len() == 4 n`, `row_scales.len() == 4`, `1 <= out.len() <= 4`, and for
    /// each `i` below `out.len()` `xu[i]` is valid for `n` reads and `s[i]` for
    /// `n.div_ceil(2 BLOCK)`.
    pub unsafe fn panel_q8_many(
        w: &[i8],
        xu: [*const u8; 4],
        s: [*const f32; 4],
        row_scales: &[f32],
        out: &mut [[f32; 4]],
        ahead: Option<Ahead>,
    ) {
        match ahead {
            Some(ahead) => panel_q8_many_by::<true>(w, xu, s, row_scales, out, ahead),
            None => panel_q8_many_by::<false>(w, xu, s, row_scales, out, Ahead::NONE),
        }
    }

    /// [`panel_q8_many`] asking for `ahead`'s lines (`SPREAD`) or 4 KiB past each chunk.
    ///
    /// # Safety
    /// As [`panel_q8_many`].
    unsafe fn panel_q8_many_by<const SPREAD: bool>(
        w: &[i8],
        xu: [*const u8; 4],
        s: [*const f32; 4],
        row_scales: &[f32],
        out: &mut [[f32; 4]],
        ahead: Ahead,
    ) {
        let [a, b, c, d] = xu;
        let [sa, sb, sc, sd] = s;
        match out.len() {
            4 => panel_q8_many_zmm::<4, SPREAD>(w, [a, b, c, d], [sa, sb, sc, sd], row_scales, out, ahead),
            3 => panel_q8_many_zmm::<3, SPREAD>(w, [a, b, c], [sa, sb, sc], row_scales, out, ahead),
            2 => panel_q8_many_zmm::<2, SPREAD>(w, [a, b], [sa, sb], row_scales, out, ahead),
            _ => panel_q8_many_zmm::<1, SPREAD>(w, [a], [sa], row_scales, out, ahead),
        }
    }

    /// A panel's four sums per token from its rows' f32 sums by lane (rows 0–1 in `acc01`,
    /// 2–3 in `acc23`), times the row scales `rs`, as [`panels_q8`] finishes a panel.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn finish_q8(acc01: __m256, acc23: __m256, rs: __m128) -> __m128 {
        // [r0 r0 r2 r2 | r1 r1 r3 r3] pairwise, then [r0 r2 · · | r1 r3 · ·], then in order.
        let h = _mm256_hadd_ps(acc01, acc23);
        let h = _mm256_hadd_ps(h, h);
        let v = _mm_unpacklo_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
        _mm_mul_ps(v, rs)
    }

    /// [`panel_q8_many`] on `NT` tokens: a chunk's four rows in one register, lanes 0–7 those of
    /// rows 0–1, 8–15 those of rows 2–3.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vnni")]
    unsafe fn panel_q8_many_zmm<const NT: usize, const SPREAD: bool>(
        w: &[i8],
        xu: [*const u8; NT],
        s: [*const f32; NT],
        row_scales: &[f32],
        out: &mut [[f32; 4]],
        mut ahead: Ahead,
    ) {
        let n = w.len() / 4;
        debug_assert!(n.is_multiple_of(BLOCK) && out.len() == NT && row_scales.len() == 4);
        let ones = _mm512_set1_epi8(-128); // 128 as the unsigned operand
        let zero = _mm512_setzero_si512();
        let mut acc = [_mm512_setzero_ps(); NT];
        let kc = n / BLOCK;
        // An int8 chunk's bytes: its four rows' BLOCK columns, one register.
        const CHUNK_BYTES: usize = 4 * BLOCK;
        let mut wp = w.as_ptr();
        let mut k = 0;
        while k < kc {
            if SPREAD {
                ahead.ask();
            }
            // The group's one or two chunks of weights, and their −128 · Σw to start each
            // token's sums from.
            let two = k + 1 < kc;
            if !SPREAD {
                _mm_prefetch(wp.wrapping_add(4096), _MM_HINT_T0);
                if two {
                    _mm_prefetch(wp.wrapping_add(4096 + CHUNK_BYTES), _MM_HINT_T0);
                }
            }
            let w0 = _mm512_loadu_si512(wp as *const __m512i);
            let w1 = if two { _mm512_loadu_si512(wp.add(CHUNK_BYTES) as *const __m512i) } else { zero };
            let off = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, ones, w0), ones, w1);
            let neg = _mm512_sub_epi32(zero, off);
            let mut p = [neg; NT];
            for (pt, x) in p.iter_mut().zip(xu) {
                let x0 = _mm512_broadcast_i32x4(_mm_loadu_si128(x.add(k * BLOCK) as *const __m128i));
                *pt = _mm512_dpbusd_epi32(*pt, x0, w0);
            }
            if two {
                for (pt, x) in p.iter_mut().zip(xu) {
                    let x1 =
                        _mm512_broadcast_i32x4(_mm_loadu_si128(x.add((k + 1) * BLOCK) as *const __m128i));
                    *pt = _mm512_dpbusd_epi32(*pt, x1, w1);
                }
            }
            wp = wp.add(if two { 2 * CHUNK_BYTES } else { CHUNK_BYTES });
            for ((a, pt), st) in acc.iter_mut().zip(p).zip(s) {
                let sc = _mm512_set1_ps(*st.add(k / 2));
                *a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(pt), sc, *a);
            }
            k += 2;
        }
        let rs = _mm_loadu_ps(row_scales.as_ptr());
        for (a, o) in acc.into_iter().zip(out.iter_mut()) {
            let acc23 = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(a)));
            _mm_storeu_ps(o.as_mut_ptr(), finish_q8(_mm512_castps512_ps256(a), acc23, rs));
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub use avx512::{
    pair_acc_bf16 as avx512_pair_acc_bf16, pair_acc_bf16_n as avx512_pair_acc_bf16_n,
    pair_acc_sums as avx512_pair_acc_sums, panel_quad as avx512_panel_quad, panels as avx512_panels,
    panels_bf16 as avx512_panels_bf16, panels_many_bf16 as avx512_panels_many_bf16, Avx512Load, PairAcc,
    NO_REQUESTS as AVX512_NO_REQUESTS, TO_L2 as AVX512_TO_L2,
};

/// The float panel kernels in 512-bit registers. A chunk row of a panel ([`BLOCK`] columns) is
/// one register, so a prepared input is in column order for every weight type (bf16 included:
/// it is widened with a zero-extend and a shift, not split into even and odd columns).
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::avx2::{
        by_blocks, exp_sub_sum_from as exp_sub_sum_avx2, fetch_chunk, fetch_far, fetch_far_then,
        fetch_stream, fetch_stream_long, page_values as page_values_avx2, scale_max_from as scale_max_avx2,
        store_rows, Avx2Load,
    };
    use super::{Ahead, Elem, Fetch, ManyFetch, BLOCK, SCORE_SETS};
    use half::{bf16, f16};
    use std::arch::x86_64::*;

    /// Loads [`BLOCK`] consecutive elements as f32 lanes.
    pub trait Avx512Load: Elem {
        /// # Safety
        /// `p` must point to sixteen readable elements; the CPU must have avx512f.
        unsafe fn load_zmm(p: *const Self) -> __m512;
    }
    impl Avx512Load for f32 {
        #[inline]
        #[target_feature(enable = "avx512f")]
        unsafe fn load_zmm(p: *const f32) -> __m512 {
            _mm512_loadu_ps(p)
        }
    }
    impl Avx512Load for bf16 {
        #[inline]
        #[target_feature(enable = "avx512f")]
        unsafe fn load_zmm(p: *const bf16) -> __m512 {
            // bf16 is the top half of an f32: widen to 32 bits and shift left by 16.
            let h = _mm256_loadu_si256(p as *const __m256i);
            _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
        }
    }
    impl Avx512Load for f16 {
        #[inline]
        #[target_feature(enable = "avx512f")]
        unsafe fn load_zmm(p: *const f16) -> __m512 {
            _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
        }
    }

    /// The one-token prefetch of the 512-bit kernel: the chunk 256 bytes past the one at `wp`,
    /// into L1. On the 2-core Zen 4 machine, SmolLM2 bf16 decode (`gridlm bench`, the variants
    /// run in turn for 7 minutes) read at 0.77–0.87 of the measured bandwidth while the host
    /// read 55–68 GB/s, and at 0.92–0.98 (mean 0.96) while it read 31–45; with the AVX2
    /// kernel's [`fetch_ahead`](super::avx2::fetch_ahead) (1 KiB ahead, non-temporal) at
    /// 0.68–0.77 and 0.84–1.00 (mean 0.93); with no software prefetch at 0.77–0.84 and
    /// 0.83–1.06 (mean 0.95). (The AVX2 kernel keeps its prefetch, measured on Zen 1.)
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn fetch_near<T>(wp: *const T) {
        fetch_chunk::<T, 256, _MM_HINT_T0>(wp);
    }

    /// What the 512-bit one-token kernels ask for ahead of the chunk at `wp`, as the
    /// [`Fetch`] of code `F` says; under [`Fetch::Nta`], 4 KiB ahead where `LONG` (the FMA
    /// kernel, [`fetch_stream_long`]), else 2 KiB ([`fetch_stream`]).
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn fetch_one_token<T, const F: u8, const LONG: bool>(wp: *const T) {
        if F == Fetch::NEAR || F == Fetch::FAR {
            fetch_near(wp);
        }
        if F == Fetch::FAR {
            fetch_far(wp);
        }
        if F == Fetch::NTA {
            if LONG {
                fetch_stream_long(wp);
            } else {
                fetch_stream(wp);
            }
        }
        if F == Fetch::PAGE {
            super::fetch_page(wp as *const u8, 4 * BLOCK * std::mem::size_of::<T>());
        }
    }

    /// `exp(x)` on sixteen lanes, each through exactly [`exp8`](super::avx2::exp8)'s operations,
    /// so a lane gives the same bits in either.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn exp16(x: __m512) -> __m512 {
        use super::exp_consts::*;
        let x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(LOW)), _mm512_set1_ps(HIGH));
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(
            x,
            _mm512_set1_ps(std::f32::consts::LOG2_E),
        ));
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
        let mut y = _mm512_set1_ps(POLY[0]);
        for c in &POLY[1..] {
            y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(*c));
        }
        y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0)));
        let pow2 = _mm512_slli_epi32::<23>(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)));
        _mm512_mul_ps(y, _mm512_castsi512_ps(pow2))
    }

    /// The low and high eight lanes of `v`.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn halves(v: __m512) -> (__m256, __m256) {
        (_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v))))
    }

    /// [`super::scale_max`] sixteen at a time, the rest by the AVX2 kernel: the products are
    /// the same, and so is the max (of the same values in another order: where +0 and −0 tie
    /// for it either may come back, which no exp or fold after it tells apart).
    ///
    /// # Safety
    /// The CPU must have avx512f, avx2, fma and f16c.
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub unsafe fn scale_max(s: &mut [f32], scale: f32) -> f32 {
        let (n, p) = (s.len(), s.as_mut_ptr());
        let sc = _mm512_set1_ps(scale);
        let mut mv = _mm512_set1_ps(f32::NEG_INFINITY);
        let mut c = 0;
        while c + BLOCK <= n {
            let v = _mm512_mul_ps(_mm512_loadu_ps(p.add(c)), sc);
            _mm512_storeu_ps(p.add(c), v);
            mv = _mm512_max_ps(mv, v);
            c += BLOCK;
        }
        let (lo, hi) = halves(mv);
        scale_max_avx2(s, scale, c, _mm256_max_ps(lo, hi))
    }

    /// [`super::exp_sub_sum`] sixteen at a time, the rest by the AVX2 kernel, with the AVX2
    /// kernel's bits: each lane's exp through the same operations, and the sums kept in eight
    /// lanes, a register's low half added before its high half, as eight at a time would.
    ///
    /// # Safety
    /// The CPU must have avx512f, avx2, fma and f16c.
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub unsafe fn exp_sub_sum(s: &mut [f32], m: f32) -> f32 {
        let (n, p) = (s.len(), s.as_mut_ptr());
        let mv = _mm512_set1_ps(m);
        let mut acc = _mm256_setzero_ps();
        let mut c = 0;
        while c + BLOCK <= n {
            let e = exp16(_mm512_sub_ps(_mm512_loadu_ps(p.add(c)), mv));
            _mm512_storeu_ps(p.add(c), e);
            let (lo, hi) = halves(e);
            acc = _mm256_add_ps(_mm256_add_ps(acc, lo), hi);
            c += BLOCK;
        }
        exp_sub_sum_avx2(s, m, c, acc)
    }

    super::softmax_rows_kernel!("avx512f,avx2,fma,f16c");

    super::page_blocks!(
        "avx512f,avx2,fma,f16c",
        __m512,
        BLOCK,
        Avx512Load,
        load_zmm,
        _mm512_setzero_ps,
        _mm512_set1_ps,
        _mm512_fmadd_ps,
        _mm512_add_ps,
        _mm512_loadu_ps,
        _mm512_storeu_ps
    );

    /// [`super::page_scores`] on pages a multiple of [`BLOCK`] long. In a profile of SmolLM2
    /// decode on the 2-core Zen 5 machine (three query heads per KV head, ~190 positions),
    /// the AVX2 page kernels took ~5.2% as long as the layer products, these ~4.6%: what is
    /// left is mostly waiting on the loads of keys and values.
    ///
    /// # Safety
    /// The CPU must have avx512f, avx2, fma and f16c; `page_len % 16 == 0`, `kt` is
    /// `[hd, page_len]`, `q` is `[rows, hd]` and `out` holds `rows` rows of `page_len` scores
    /// `stride` apart.
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)] // as super::page_scores, with the shapes
    pub unsafe fn page_scores<T: Avx512Load>(
        kt: &[T],
        page_len: usize,
        q: &[f32],
        hd: usize,
        rows: usize,
        out: &mut [f32],
        stride: usize,
        fetch: bool,
    ) {
        let (k, o) = (kt.as_ptr(), out.as_mut_ptr());
        let mut r = 0;
        while r < rows {
            let nr = (rows - r).min(4);
            let (qr, or) = (q.as_ptr().add(r * hd), o.add(r * stride));
            let mut j = 0;
            while j < page_len {
                let ask = fetch && r == 0 && j == 0;
                // At most eight accumulators: enough chains in flight for the FMA latency.
                let wide = page_len - j >= 2 * BLOCK && nr <= 2;
                match (nr, wide) {
                    (2, true) => scores_block::<T, 2, 2>(k, page_len, j, qr, hd, or, stride, ask),
                    (1, true) => scores_block::<T, 1, 2>(k, page_len, j, qr, hd, or, stride, ask),
                    (4, _) => scores_block::<T, 4, 1>(k, page_len, j, qr, hd, or, stride, ask),
                    (3, _) => scores_block::<T, 3, 1>(k, page_len, j, qr, hd, or, stride, ask),
                    (2, _) => scores_block::<T, 2, 1>(k, page_len, j, qr, hd, or, stride, ask),
                    _ => scores_block::<T, 1, 1>(k, page_len, j, qr, hd, or, stride, ask),
                }
                j += if wide { 2 * BLOCK } else { BLOCK };
            }
            r += nr;
        }
    }

    /// [`super::page_scores_pair`] on pages a multiple of [`BLOCK`] long: a vector of each page's
    /// keys per block, so twice the chains in flight and a broadcast of the query for every two
    /// multiply-adds; each score summed as [`page_scores`] sums it.
    ///
    /// # Safety
    /// As [`page_scores`], for both pages; `out` holds `rows` rows of `2 * page_len` scores.
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)] // as page_scores, with a second page
    pub unsafe fn page_scores_pair<T: Avx512Load>(
        kt: [&[T]; 2],
        page_len: usize,
        q: &[f32],
        hd: usize,
        rows: usize,
        out: &mut [f32],
        stride: usize,
    ) {
        let (k, o) = ([kt[0].as_ptr(), kt[1].as_ptr()], out.as_mut_ptr());
        let mut r = 0;
        while r < rows {
            let nr = (rows - r).min(4);
            let (qr, or) = (q.as_ptr().add(r * hd), o.add(r * stride));
            let mut j = 0;
            while j < page_len {
                let keys = [k[0].add(j), k[1].add(j)];
                let outs = [or.add(j), or.add(page_len + j)];
                match nr {
                    4 => scores_block_at::<T, 4, 2, 0>(keys, page_len, qr, hd, outs, stride),
                    3 => scores_block_at::<T, 3, 2, 0>(keys, page_len, qr, hd, outs, stride),
                    2 => scores_block_at::<T, 2, 2, 0>(keys, page_len, qr, hd, outs, stride),
                    _ => scores_block_at::<T, 1, 2, 0>(keys, page_len, qr, hd, outs, stride),
                }
                j += BLOCK;
            }
            r += nr;
        }
    }

    /// [`super::page_values`]: columns by sixteen, the rest (fewer than sixteen) by the AVX2
    /// kernel.
    ///
    /// # Safety
    /// The CPU must have avx512f, avx2, fma and f16c; `p` holds `rows` rows of at least `n`
    /// values `stride` apart, `v` is `[n, hd]`, `o` is `[rows, hd]`.
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub unsafe fn page_values<T: Avx2Load>(
        p: &[f32],
        stride: usize,
        v: &[T],
        n: usize,
        hd: usize,
        o: &mut [f32],
        fetch: bool,
    ) {
        let rows = o.len() / hd;
        let (pp, vp, op) = (p.as_ptr(), v.as_ptr(), o.as_mut_ptr());
        let wide = hd / BLOCK * BLOCK;
        let mut r = 0;
        while r < rows {
            let nr = (rows - r).min(4);
            let (pr, or) = (pp.add(r * stride), op.add(r * hd));
            let ask = fetch && r == 0;
            let mut c = 0;
            while c < wide {
                // Up to sixteen accumulators (rows × column vectors): with the value vectors
                // and a broadcast they stay in the 32 registers.
                let nv = match (nr, wide - c) {
                    (1, cols) if cols >= 8 * BLOCK => 8,
                    (_, cols) if cols >= 4 * BLOCK => 4,
                    (_, cols) if cols >= 2 * BLOCK => 2,
                    _ => 1,
                };
                match (nr, nv) {
                    (1, 8) => values_block::<T, 1, 8>(pr, stride, vp, n, hd, c, or, ask),
                    (1, 4) => values_block::<T, 1, 4>(pr, stride, vp, n, hd, c, or, ask),
                    (1, 2) => values_block::<T, 1, 2>(pr, stride, vp, n, hd, c, or, ask),
                    (1, _) => values_block::<T, 1, 1>(pr, stride, vp, n, hd, c, or, ask),
                    (2, 4) => values_block::<T, 2, 4>(pr, stride, vp, n, hd, c, or, ask),
                    (2, 2) => values_block::<T, 2, 2>(pr, stride, vp, n, hd, c, or, ask),
                    (2, _) => values_block::<T, 2, 1>(pr, stride, vp, n, hd, c, or, ask),
                    (3, 4) => values_block::<T, 3, 4>(pr, stride, vp, n, hd, c, or, ask),
                    (3, 2) => values_block::<T, 3, 2>(pr, stride, vp, n, hd, c, or, ask),
                    (3, _) => values_block::<T, 3, 1>(pr, stride, vp, n, hd, c, or, ask),
                    (_, 4) => values_block::<T, 4, 4>(pr, stride, vp, n, hd, c, or, ask),
                    (_, 2) => values_block::<T, 4, 2>(pr, stride, vp, n, hd, c, or, ask),
                    _ => values_block::<T, 4, 1>(pr, stride, vp, n, hd, c, or, ask),
                }
                c += BLOCK * nv;
            }
            r += nr;
        }
        if wide < hd {
            page_values_avx2(p, stride, v, n, hd, wide, o, fetch);
        }
    }

    /// Consecutive packed panels against one prepared input, as [`super::avx2_panels`]: four
    /// rows of a chunk meet one register of `x`, one accumulator per row. A row is summed in
    /// column blocks of `kb` (the last may be shorter), each block's sums finished as
    /// [`panel_quad`] finishes a many-token product's block and added in column order, so one
    /// token's sums are the many-token ones, bit for bit, however wide the rows.
    ///
    /// # Safety
    /// The CPU must have avx512f, avx2, fma and f16c; `x.len()` and `kb` (not 0) are multiples
    /// of [`BLOCK`] and `w.len() == 4 * x.len() * out.len().div_ceil(4)`.
    pub unsafe fn panels<T: Avx512Load>(w: &[T], x: &[f32], kb: usize, out: &mut [f32], fetch: Fetch) {
        with_fetch!(fetch, panels_with::<T>(w, x, kb, out))
    }

    /// [`panels`], prefetching as the [`Fetch`] of code `F` says.
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn panels_with<T: Avx512Load, const F: u8>(w: &[T], x: &[f32], kb: usize, out: &mut [f32]) {
        let n = x.len();
        debug_assert!(n.is_multiple_of(BLOCK) && kb.is_multiple_of(BLOCK) && kb > 0);
        debug_assert_eq!(w.len(), 4 * n * out.len().div_ceil(4));
        let xp = x.as_ptr();
        let mut wp = w.as_ptr();
        for o in out.chunks_mut(4) {
            let [sums] = by_blocks(n, kb, |mut c, end| {
                let mut acc = [_mm512_setzero_ps(); 4];
                while c < end {
                    fetch_one_token::<T, F, true>(wp);
                    let xv = _mm512_loadu_ps(xp.add(c));
                    for (r, a) in acc.iter_mut().enumerate() {
                        *a = _mm512_fmadd_ps(T::load_zmm(wp.add(r * BLOCK)), xv, *a);
                    }
                    wp = wp.add(4 * BLOCK);
                    c += BLOCK;
                }
                // The four rows' sums at once: by 128-bit lane, then the lanes added across.
                let v = lanes4(acc);
                let v = _mm512_add_ps(v, _mm512_shuffle_f32x4::<0b01_00_11_10>(v, v));
                let v = _mm512_add_ps(v, _mm512_shuffle_f32x4::<0b10_11_00_01>(v, v));
                [_mm512_castps512_ps128(v)]
            });
            store_rows(sums, o);
        }
    }

    /// All four rows of a packed panel against `NT` (at most six) prepared inputs (many-token
    /// products, the panel in L1 or L2): `out[i][lane] = row lane · xs[i]`. Each weight
    /// register serves `NT` tokens and each input register four rows: with NT = 4, 8 loads per
    /// 16 FMAs and 24 of the 32 registers live; with NT = 6 (a prompt's groups, see
    /// `PROMPT_GROUP` in `packed.rs`), 10 loads per 24 FMAs and 29 registers. Each token's sums
    /// are finished the same way whatever `NT`, so they are the one-token kernel's bits.
    ///
    /// # Safety
    /// The CPU must have avx512f, avx2, fma and f16c; every input has `n` entries, a multiple
    /// of [`BLOCK`], and `panel.len() == 4 * n`. (`next`, the block read after the panel's, is
    /// only asked for: any address will do.)
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub unsafe fn panel_quad<T: Avx512Load, const NT: usize>(
        panel: &[T],
        xs: [&[f32]; NT],
        next: *const T,
    ) -> [[f32; 4]; NT] {
        let n = xs[0].len();
        debug_assert_eq!(panel.len(), 4 * n);
        let x: [*const f32; NT] = std::array::from_fn(|i| xs[i].as_ptr());
        let mut acc = [[_mm512_setzero_ps(); 4]; NT];
        let (mut wp, end) = (panel.as_ptr(), panel.as_ptr_range().end);
        let mut c = 0;
        while c < n {
            fetch_far_then(wp, end, next);
            let w: [__m512; 4] = std::array::from_fn(|r| T::load_zmm(wp.add(r * BLOCK)));
            for (a, xi) in acc.iter_mut().zip(x) {
                let xv = _mm512_loadu_ps(xi.add(c));
                for (ar, wr) in a.iter_mut().zip(w) {
                    *ar = _mm512_fmadd_ps(wr, xv, *ar);
                }
            }
            wp = wp.add(4 * BLOCK);
            c += BLOCK;
        }
        // Four tokens' sums in one register: per token, its four rows' 128-bit lanes side by
        // side, then the four lanes of every token added across. (Sixteen horizontal sums took
        // ~128 operations, and with them LLVM kept one accumulator of the loop on the stack: on
        // a Zen 4 machine a panel of 576 columns against four tokens, in L1, ran at 62 or 108
        // GFLOP/s per core from one run to the next, and at 112 with this.)
        let four = |t0: usize| {
            let v: [__m512; 4] =
                std::array::from_fn(|i| if t0 + i < NT { lanes4(acc[t0 + i]) } else { _mm512_setzero_ps() });
            let lo = |a, b| _mm512_shuffle_f32x4::<0b01_00_01_00>(a, b);
            let hi = |a, b| _mm512_shuffle_f32x4::<0b11_10_11_10>(a, b);
            let (s01, s23) = (
                _mm512_add_ps(lo(v[0], v[1]), hi(v[0], v[1])),
                _mm512_add_ps(lo(v[2], v[3]), hi(v[2], v[3])),
            );
            by_token::<4>(_mm512_add_ps(
                _mm512_shuffle_f32x4::<0b10_00_10_00>(s01, s23),
                _mm512_shuffle_f32x4::<0b11_01_11_01>(s01, s23),
            ))
        };
        let first = four(0);
        if NT <= 4 {
            return std::array::from_fn(|t| first[t]);
        }
        let rest = four(4);
        std::array::from_fn(|t| if t < 4 { first[t] } else { rest[t - 4] })
    }

    /// Consecutive packed bf16 panels against one prepared input (f32), in `vdpbf16ps`: per
    /// chunk, the input block rounded to bf16 in both halves of one register meets a register
    /// of rows 0–1 and one of rows 2–3. Each panel's sums are those [`pair_acc_bf16`] gives
    /// the same input, bit for bit (the same chains of instructions, the same additions
    /// after), so one token agrees with many. (The FMA kernel on the same
    /// rounded inputs sums in another order; on the 2-core Zen 4 machine it streamed SmolLM2's
    /// layer products 2–3% faster, 0.866 of the measured bandwidth against 0.841 while the host
    /// read fast, 1.047 against 1.025 while it read slowly. Two panels at a time, four chains,
    /// read at 0.48 and 0.82.) Rows are summed in column blocks of `kb`, as in [`panels`].
    ///
    /// # Safety
    /// The CPU must have avx512f, avx512bf16, avx2, fma and f16c; `x.len()` and `kb` (not 0)
    /// are multiples of [`BLOCK`] and `w.len() == 4 * x.len() * out.len().div_ceil(4)`.
    pub unsafe fn panels_bf16(w: &[bf16], x: &[f32], kb: usize, out: &mut [f32], fetch: Fetch) {
        with_fetch!(fetch, panels_bf16_with(w, x, kb, out))
    }

    /// [`panels_bf16`], prefetching as the [`Fetch`] of code `F` says.
    #[target_feature(enable = "avx512f,avx512bf16,avx2,fma,f16c")]
    unsafe fn panels_bf16_with<const F: u8>(w: &[bf16], x: &[f32], kb: usize, out: &mut [f32]) {
        let n = x.len();
        debug_assert!(n.is_multiple_of(BLOCK) && kb.is_multiple_of(BLOCK) && kb > 0);
        debug_assert_eq!(w.len(), 4 * n * out.len().div_ceil(4));
        let xp = x.as_ptr();
        let mut wp = w.as_ptr();
        let zero = _mm512_setzero_ps();
        // Element 4 L of `lanes4`'s result is the first register's row L.
        let order = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
        for o in out.chunks_mut(4) {
            let [sums] = by_blocks(n, kb, |mut c, end| {
                let mut a = [zero; 2];
                while c < end {
                    a = chunk_bf16::<F>(a, wp, pair_block(xp.add(c)));
                    wp = wp.add(4 * BLOCK);
                    c += BLOCK;
                }
                let v = _mm512_permutexvar_ps(order, lanes4([rows_by_lane(a), zero, zero, zero]));
                [_mm512_castps512_ps128(v)]
            });
            store_rows(sums, o);
        }
    }

    /// The input block at `xp` rounded to bf16 into both halves of one register.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bf16")]
    unsafe fn pair_block(xp: *const f32) -> __m512bh {
        let v = _mm512_loadu_ps(xp);
        _mm512_cvtne2ps_pbh(v, v)
    }

    /// One chunk of a bf16 panel (at `wp`) against a paired input block, added to `acc` (rows
    /// 0–1, 2–3), prefetching as the [`Fetch`] of code `F` says. ([`Fetch::Far`] came from
    /// the 2-core Zen 5 machine: while the cores sat apart (`handoff_us` ~0.7), SmolLM2 bf16
    /// decode ran at 263–273 tokens/s with it against 248–263 with `Near`; on Zen 4 it was the
    /// slowest of the three, see [`Fetch`].)
    #[inline]
    #[target_feature(enable = "avx512f,avx512bf16,avx2,fma,f16c")]
    unsafe fn chunk_bf16<const F: u8>(acc: [__m512; 2], wp: *const bf16, xb: __m512bh) -> [__m512; 2] {
        fetch_one_token::<bf16, F, false>(wp);
        [
            _mm512_dpbf16_ps(acc[0], load_pbh(wp), xb),
            _mm512_dpbf16_ps(acc[1], load_pbh(wp.add(2 * BLOCK)), xb),
        ]
    }

    /// Consecutive whole bf16 panels (`w`, `n` columns each) against `n_tok` inputs rounded by
    /// [`super::round_for_dot_bf16`] (`xs`, `n` entries each), each panel against groups of up
    /// to four tokens as [`pair_acc_bf16`] (the same sums, bit for bit), every group's sums
    /// stored straight from their register: token `t`'s sum for the panels' row `r` goes to
    /// `out[t * stride + r]`, for `r` below `rows` (the last panel's padding rows are not
    /// written). Unlike the scheduled many-token path, nothing passes through per-panel calls
    /// or copies of the sums. With `pairs`, two panels at a time (the same sums again); under
    /// [`ManyFetch::Whole`], a batch of up to eight against each panel at once
    /// (`whole_acc_bf16`), whatever `pairs` says (the same sums again). Rows
    /// are summed in column blocks of `kb` (each block of a panel against every token group,
    /// then the next block), the blocks' sums added in column order as the one-token kernel
    /// ([`panels_bf16`]) adds them. Weights are asked for 16 KiB ahead, or, in rows of
    /// [`super::SPREAD_FROM`] columns or more, the next panels a share in each pass, with the
    /// hint `fetch` names (`Whole`'s own requests in its batches, `L2`'s past them).
    ///
    /// # Safety
    /// The CPU must have avx512f, avx512bf16, avx2, fma and f16c; `n` and `kb` (not 0) are
    /// multiples of [`BLOCK`], `w.len()` a multiple of `4 n`,
    /// `xs.len() == n n_tok`, `rows <= w.len() / n`; `out` is valid for reads and writes at
    /// every such `t * stride + r`, and nothing else reads or writes those elements during the
    /// call.
    #[allow(clippy::too_many_arguments)] // the weights, the inputs, where the sums go, and how
    #[target_feature(enable = "avx512f,avx512bf16,avx2,fma,f16c")]
    pub unsafe fn panels_many_bf16(
        w: &[bf16],
        n: usize,
        xs: &[bf16],
        n_tok: usize,
        out: *mut f32,
        stride: usize,
        rows: usize,
        pairs: bool,
        kb: usize,
        fetch: ManyFetch,
    ) {
        debug_assert!(n.is_multiple_of(BLOCK) && w.len().is_multiple_of(4 * n) && xs.len() == n * n_tok);
        debug_assert!(kb.is_multiple_of(BLOCK) && kb > 0);
        let x = |t: usize| xs.as_ptr().add(n * t);
        // Token t + i's four sums for the panel's rows r0.. are `v`'s 128-bit lane i, stored
        // for the first column block (`c0` 0) and added to what is there for the others.
        let put = |v: __m512, t: usize, nt: usize, r0: usize, c0: usize| {
            let nr = rows.saturating_sub(r0).min(4);
            let lanes = [
                _mm512_castps512_ps128(v),
                _mm512_extractf32x4_ps::<1>(v),
                _mm512_extractf32x4_ps::<2>(v),
                _mm512_extractf32x4_ps::<3>(v),
            ];
            for (i, lane) in lanes.into_iter().take(nt).enumerate() {
                let o = std::slice::from_raw_parts_mut(out.add((t + i) * stride + r0), nr);
                let mut four = [0.0f32; 4];
                _mm_storeu_ps(four.as_mut_ptr(), lane);
                super::store_sums(o, &four, c0 == 0);
            }
        };
        let panels = w.len() / (4 * n);
        if fetch == ManyFetch::Whole && (1..=super::WHOLE_MAX).contains(&n_tok) {
            // Each panel's column blocks in turn, against every token at once.
            let xs: [*const bf16; super::WHOLE_MAX] = std::array::from_fn(|i| x(i.min(n_tok - 1)));
            let near = super::whole_l1_ahead();
            for p in 0..panels {
                let mut c0 = 0;
                while c0 < n {
                    let cn = kb.min(n - c0);
                    let mut acc: PairAcc = std::mem::zeroed();
                    whole_acc_bf16_n(
                        near,
                        n_tok,
                        w.as_ptr().add(4 * (n * p + c0)),
                        cn,
                        xs.map(|x| x.add(c0)),
                        &mut acc,
                    );
                    put(pair_acc_finish(&acc, 0), 0, n_tok.min(4), 4 * p, c0);
                    if n_tok > 4 {
                        put(pair_acc_finish(&acc, 1), 4, n_tok - 4, 4 * p, c0);
                    }
                    c0 += cn;
                }
            }
            return;
        }
        let step = if pairs { 2 } else { 1 };
        let spread = n >= super::SPREAD_FROM;
        let passes = n.div_ceil(kb) * n_tok.div_ceil(4);
        let mut p = 0;
        while p < panels {
            let np = step.min(panels - p);
            // With wide rows, the next `np` panels' lines (each panel `4 n` weights, 2 bytes
            // each), a share asked for in each of these panels' passes.
            let (next, lines) =
                (w.as_ptr().wrapping_add(4 * n * (p + np)) as *const u8, (np * 8 * n).div_ceil(64));
            let mut pass = 0;
            // Each column block of the panels against every token group, then the next block:
            // the panels are still read in memory order.
            let mut c0 = 0;
            while c0 < n {
                let cn = kb.min(n - c0);
                let mut t = 0;
                while t < n_tok {
                    let nt = (n_tok - t).min(4);
                    let mut acc: PairAcc = std::mem::zeroed();
                    let xs = std::array::from_fn(|i| x(t + i.min(nt - 1)).add(c0));
                    let wp = w.as_ptr().add(4 * n * p + 4 * c0);
                    let ahead = if spread {
                        Ahead::share(next, lines, (pass, passes), cn / BLOCK)
                    } else {
                        Ahead::NONE
                    };
                    // The kernel's mode (a const generic): the way's hint, for the next panels'
                    // lines in wide rows or 16 KiB ahead in others (`Whole` past its batch as
                    // `L2`).
                    let a = &mut acc;
                    match (spread, fetch) {
                        (true, ManyFetch::L2 | ManyFetch::Whole) => {
                            pair_acc_bf16_n::<SPREAD>(np, nt, wp, 4 * n, cn, xs, a, ahead)
                        }
                        (true, ManyFetch::Nta) => {
                            pair_acc_bf16_n::<SPREAD_NTA>(np, nt, wp, 4 * n, cn, xs, a, ahead)
                        }
                        (false, ManyFetch::L2 | ManyFetch::Whole) => {
                            pair_acc_bf16_n::<TO_L2>(np, nt, wp, 4 * n, cn, xs, a, ahead)
                        }
                        (false, ManyFetch::Nta) => {
                            pair_acc_bf16_n::<NTA>(np, nt, wp, 4 * n, cn, xs, a, ahead)
                        }
                    }
                    pass += 1;
                    for k in 0..np {
                        put(pair_acc_finish(&acc, k), t, nt, 4 * (p + k), c0);
                    }
                    t += nt;
                }
                c0 += cn;
            }
            p += np;
        }
    }

    /// The running sums of up to two bf16 panels against up to four tokens in 512-bit
    /// registers: `[panel][token][rows 0–1, 2–3]`, each row's partial sums in eight lanes.
    pub type PairAcc = [[[__m512; 2]; 4]; 2];

    /// How [`pair_acc_bf16`] asks for weights ahead of its loads (its `F`): each chunk the one
    /// 16 KiB past it, into L2 ...
    pub const TO_L2: u8 = 0;
    /// ... or non-temporally, ...
    pub const NTA: u8 = 1;
    /// ... or the lines of an [`Ahead`], into L2, ...
    pub const SPREAD: u8 = 2;
    /// ... or non-temporally, ...
    pub const SPREAD_NTA: u8 = 3;
    /// ... or nothing.
    pub const NO_REQUESTS: u8 = 4;

    /// Continues the running sums `acc` of `P` consecutive bf16 panels (1 or 2; the first at `w`,
    /// the next `stride` elements on) against `NT` inputs rounded by [`super::round_for_dot_bf16`]
    /// (`x`), over `n` more columns: `w` and each `x[i]` point at the columns' first chunk, and
    /// weights are asked for as `F` says: 16 KiB ahead of each chunk, into L2 ([`TO_L2`]) or
    /// non-temporally (`NTA`), or `ahead`'s lines, into L2 (`SPREAD`) or non-temporally
    /// (`SPREAD_NTA`), or not at all (`NO_REQUESTS`). As in [`panel_quad`], each pair of weight
    /// registers (rows 0–1, 2–3) serves `NT` tokens, and each input register (an input block in
    /// both halves) two rows of each panel. A panel's accumulators take the chunks in column
    /// order whatever `P` and `NT` are and however the columns are split between calls, so
    /// finished sums ([`pair_acc_sums`]) are the same bits for each, and the one-token kernel's. At
    /// four tokens one panel takes 8 `vdpbf16ps` per 6 loads, two panels 16 per 8 (on the 2-core
    /// Zen 5 machine, 4 × 1024 columns against four tokens from L1 ran at 353 GFLOP/s on one core,
    /// 2 × 4 × 1024 at 520, 3 × 4 × 1024 no faster).
    ///
    /// # Safety
    /// The CPU must have avx512f, avx512bf16, avx2, fma and f16c; `n` is a multiple of
    /// [`BLOCK`]; `w + p stride` is valid for `4 n` reads for each panel `p`, `x[i]` for `n`.
    /// (`ahead`'s lines are only prefetched, which reads nothing: any address will do.)
    #[inline]
    #[target_feature(enable = "avx512f,avx512bf16,avx2,fma,f16c")]
    pub unsafe fn pair_acc_bf16<const P: usize, const NT: usize, const F: u8>(
        w: *const bf16,
        stride: usize,
        n: usize,
        x: [*const bf16; NT],
        acc: &mut PairAcc,
        mut ahead: Ahead,
    ) {
        let mut a = *acc;
        let mut c = 0;
        while c < n {
            if F == SPREAD {
                ahead.ask();
            } else if F == SPREAD_NTA {
                ahead.ask_with::<_MM_HINT_NTA>();
            }
            let wr: [[__m512bh; 2]; P] = std::array::from_fn(|p| {
                let wp = w.add(p * stride + 4 * c);
                // 16 KiB ahead: on the 2-core Zen 4 machine SmolLM2's layer products of 8
                // tokens took 3% less than with `fetch_far`'s 8 KiB (7.27 against 7.47 ms while
                // the host read slowly, 8.61 against 8.92 while it read fast); 32 KiB did as
                // well as 8. Into L2, or non-temporal ([`super::ManyFetch`]).
                if F == NTA {
                    fetch_chunk::<bf16, { 16 << 10 }, _MM_HINT_NTA>(wp);
                } else if F == TO_L2 {
                    fetch_chunk::<bf16, { 16 << 10 }, _MM_HINT_T1>(wp);
                }
                [load_pbh(wp), load_pbh(wp.add(2 * BLOCK))]
            });
            for (t, xi) in x.iter().enumerate() {
                let xb = load_twice(xi.add(c));
                for (ap, wp) in a.iter_mut().zip(&wr) {
                    for (ah, wh) in ap[t].iter_mut().zip(wp) {
                        *ah = _mm512_dpbf16_ps(*ah, *wh, xb);
                    }
                }
            }
            c += BLOCK;
        }
        *acc = a;
    }

    /// [`pair_acc_bf16`] on `np` panels (1 or 2) and the first `nt` inputs of `x` (1 to 4; the
    /// others are not read).
    ///
    /// # Safety
    /// As [`pair_acc_bf16`].
    #[inline]
    #[allow(clippy::too_many_arguments)] // the panels, the inputs, and the sums to continue
    #[target_feature(enable = "avx512f,avx512bf16,avx2,fma,f16c")]
    pub unsafe fn pair_acc_bf16_n<const F: u8>(
        np: usize,
        nt: usize,
        w: *const bf16,
        stride: usize,
        n: usize,
        x: [*const bf16; 4],
        acc: &mut PairAcc,
        ahead: Ahead,
    ) {
        let [a, b, c, d] = x;
        match (np, nt) {
            (2, 4) => pair_acc_bf16::<2, 4, F>(w, stride, n, [a, b, c, d], acc, ahead),
            (2, 3) => pair_acc_bf16::<2, 3, F>(w, stride, n, [a, b, c], acc, ahead),
            (2, 2) => pair_acc_bf16::<2, 2, F>(w, stride, n, [a, b], acc, ahead),
            (2, _) => pair_acc_bf16::<2, 1, F>(w, stride, n, [a], acc, ahead),
            (_, 4) => pair_acc_bf16::<1, 4, F>(w, stride, n, [a, b, c, d], acc, ahead),
            (_, 3) => pair_acc_bf16::<1, 3, F>(w, stride, n, [a, b, c], acc, ahead),
            (_, 2) => pair_acc_bf16::<1, 2, F>(w, stride, n, [a, b], acc, ahead),
            _ => pair_acc_bf16::<1, 1, F>(w, stride, n, [a], acc, ahead),
        }
    }

    /// Continues the running sums `acc` of one bf16 panel (at `w`) against `NT` (1 to
    /// [`super::WHOLE_MAX`]) inputs rounded by [`super::round_for_dot_bf16`] (`x`), over `n`
    /// more columns, as [`ManyFetch::Whole`] streams a batch: token `t`'s sums in
    /// `acc[t / 4][t % 4]`, where [`pair_acc_bf16`] keeps them for one panel and four tokens,
    /// and by the same instructions in the same order, so finished ([`pair_acc_finish`], the
    /// first four tokens as panel 0, the others as panel 1) they are the same bits. Each pair
    /// of weight registers serves every token; each chunk is asked for 8 KiB ahead into L2
    /// and `near` bytes ahead into L1 (see [`ManyFetch::Whole`], [`super::whole_l1_ahead`]).
    ///
    /// # Safety
    /// The CPU must have avx512f, avx512bf16, avx2, fma and f16c; `n` is a multiple of
    /// [`BLOCK`]; `w` is valid for `4 n` reads, each `x[i]` for `n`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bf16,avx2,fma,f16c")]
    unsafe fn whole_acc_bf16<const NT: usize>(
        w: *const bf16,
        n: usize,
        x: [*const bf16; NT],
        acc: &mut PairAcc,
        near: usize,
    ) {
        let mut a = *acc;
        let mut c = 0;
        while c < n {
            let wp = w.add(4 * c);
            fetch_chunk::<bf16, { 8 << 10 }, _MM_HINT_T1>(wp);
            fetch_chunk::<bf16, 0, _MM_HINT_T0>(wp.wrapping_byte_add(near));
            let wr = [load_pbh(wp), load_pbh(wp.add(2 * BLOCK))];
            for (t, xi) in x.iter().enumerate() {
                let xb = load_twice(xi.add(c));
                let sums = &mut a[t / 4][t % 4];
                for (s, wh) in sums.iter_mut().zip(wr) {
                    *s = _mm512_dpbf16_ps(*s, wh, xb);
                }
            }
            c += BLOCK;
        }
        *acc = a;
    }

    /// [`whole_acc_bf16`] on the first `nt` inputs of `x` (1 to [`super::WHOLE_MAX`]; the
    /// others are not read), asking `near` bytes ahead into L1 (2 or 4 KiB,
    /// [`super::whole_l1_ahead`]).
    ///
    /// # Safety
    /// As [`whole_acc_bf16`].
    #[inline]
    #[target_feature(enable = "avx512f,avx512bf16,avx2,fma,f16c")]
    unsafe fn whole_acc_bf16_n(
        near: usize,
        nt: usize,
        w: *const bf16,
        n: usize,
        x: [*const bf16; 8],
        acc: &mut PairAcc,
    ) {
        let [a, b, c, d, e, f, g, h] = x;
        match nt {
            8 => whole_acc_bf16::<8>(w, n, [a, b, c, d, e, f, g, h], acc, near),
            7 => whole_acc_bf16::<7>(w, n, [a, b, c, d, e, f, g], acc, near),
            6 => whole_acc_bf16::<6>(w, n, [a, b, c, d, e, f], acc, near),
            5 => whole_acc_bf16::<5>(w, n, [a, b, c, d, e], acc, near),
            4 => whole_acc_bf16::<4>(w, n, [a, b, c, d], acc, near),
            3 => whole_acc_bf16::<3>(w, n, [a, b, c], acc, near),
            2 => whole_acc_bf16::<2>(w, n, [a, b], acc, near),
            _ => whole_acc_bf16::<1>(w, n, [a], acc, near),
        }
    }

    /// Panel `p`'s finished sums from `acc` ([`pair_acc_bf16`]) in one register (element
    /// `4 t + L`: token `t`, row `L`): per token a register whose 128-bit lane L holds row L's
    /// partial sums; then, as in `panel_quad`, all tokens' sums in one register. Each token's
    /// sums are finished apart from the others' (tokens not summed give zeros).
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn pair_acc_finish(acc: &PairAcc, p: usize) -> __m512 {
        let v: [__m512; 4] = std::array::from_fn(|t| rows_by_lane(acc[p][t]));
        _mm512_permutexvar_ps(
            _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15),
            lanes4(v),
        )
    }

    /// Panel `p`'s finished sums from `acc` ([`pair_acc_bf16`]): token `t`'s four row sums.
    ///
    /// # Safety
    /// The CPU must have avx512f.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn pair_acc_sums(acc: &PairAcc, p: usize) -> [[f32; 4]; 4] {
        by_token(pair_acc_finish(acc, p))
    }

    /// The first `NT` tokens' four row sums from a register holding token `t`'s in elements
    /// `4 t..4 t + 4`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn by_token<const NT: usize>(sums: __m512) -> [[f32; 4]; NT] {
        let mut all = [[0.0f32; 4]; 4];
        _mm512_storeu_ps(all.as_mut_ptr() as *mut f32, sums);
        std::array::from_fn(|t| all[t])
    }

    /// Writes `x` rounded to bf16 into `out` (see [`super::round_for_dot_bf16`]), by
    /// `vcvtneps2bf16`, which rounds as [`pair_block`]'s `vcvtne2ps2bf16` does.
    ///
    /// # Safety
    /// The CPU must have avx512f and avx512bf16; `x.len()` is a multiple of [`BLOCK`] and
    /// `out.len() == x.len()`.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub unsafe fn round_bf16(x: &[f32], out: &mut [bf16]) {
        for (xb, ob) in x.chunks_exact(BLOCK).zip(out.chunks_exact_mut(BLOCK)) {
            let rounded =
                std::mem::transmute::<__m256bh, __m256i>(_mm512_cvtneps_pbh(_mm512_loadu_ps(xb.as_ptr())));
            _mm256_storeu_si256(ob.as_mut_ptr() as *mut __m256i, rounded);
        }
    }

    /// The [`BLOCK`] inputs rounded to bf16 at `p` ([`super::round_for_dot_bf16`]) in both
    /// halves of one register, as [`pair_block`] makes them of f32 inputs: one 32-byte
    /// broadcast load. (Stored twice over and loaded whole, as before, the inputs took twice
    /// the room in L1 and L2: on the 2-core Zen 5 machine llama-3.2-1b's prefill of 512 tokens
    /// ran at 240–257 tokens/s that way, at 276–290 this way, the same sums.)
    #[inline]
    #[target_feature(enable = "avx512f,avx512bf16")]
    unsafe fn load_twice(p: *const bf16) -> __m512bh {
        std::mem::transmute(_mm512_broadcast_i64x4(_mm256_loadu_si256(p as *const __m256i)))
    }

    /// 32 bf16 values, two rows' chunks of a panel, as one register.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bf16")]
    unsafe fn load_pbh(p: *const bf16) -> __m512bh {
        std::mem::transmute(_mm512_loadu_si512(p as *const __m512i))
    }

    /// A bf16 panel's two accumulators (rows 0–1, then 2–3; each row's partial sums in eight
    /// lanes) as one register whose 128-bit lane L holds four partial sums of row L.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn rows_by_lane([a, b]: [__m512; 2]) -> __m512 {
        let even = _mm512_shuffle_f32x4::<0b10_00_10_00>(a, b);
        let odd = _mm512_shuffle_f32x4::<0b11_01_11_01>(a, b);
        _mm512_add_ps(even, odd)
    }

    /// Four registers summed by 128-bit lane: lane `4 L + i` of the result is the sum of
    /// register `i`'s lane `L` (its elements `4 L..4 L + 4`).
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn lanes4([a, b, c, d]: [__m512; 4]) -> __m512 {
        let ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
        let cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
        _mm512_add_ps(_mm512_shuffle_ps::<0x44>(ab, cd), _mm512_shuffle_ps::<0xEE>(ab, cd))
    }
}

#[cfg(test)]
mod tests {
    use super::Ahead;

    /// The passes' shares of the next panels' lines follow on from each other and together
    /// cover them all, each asked for within its pass's chunks, none twice.
    #[test]
    fn the_passes_of_a_panel_ask_for_every_line_of_the_next_once() {
        let next = 4096 as *const u8;
        for (lines, passes, chunks) in
            [(1024, 4, 128), (144, 2, 36), (5, 3, 2), (3, 6, 1), (128, 128, 128), (0, 2, 8)]
        {
            let mut end = next;
            for pass in 0..passes {
                let mut a = Ahead::share(next, lines, (pass, passes), chunks);
                assert_eq!(a.at, end, "{lines} lines, pass {pass} of {passes}: where the last ended");
                for _ in 0..chunks {
                    a.ask();
                }
                assert_eq!(a.at, a.end, "{lines} lines, pass {pass} of {passes}: its share asked for");
                end = a.at;
            }
            assert_eq!(end, next.wrapping_add(64 * lines), "{lines} lines over {passes} passes");
        }
    }
}
