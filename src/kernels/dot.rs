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

use half::{bf16, f16};

/// Columns per block of a prepared vector.
pub const BLOCK: usize = 16;

/// A weight element that converts to f32.
pub trait Elem: Copy + Send + Sync + 'static {
    fn to_f32(self) -> f32;
    /// Rounds to nearest even.
    fn from_f32(v: f32) -> Self;
    /// Whether the AVX2 panel kernel wants `x` in even/odd order within each [`BLOCK`].
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
}

/// Writes `x`, padded with zeros to `out.len()`, into `out` in the order the panel kernel
/// expects for weights `T` on `isa`. A trailing part shorter than [`BLOCK`] keeps its order.
pub fn prepare<T: Elem>(x: &[f32], out: &mut [f32], isa: Isa) {
    assert!(x.len() <= out.len(), "prepare: output shorter than input");
    let at = |i: usize| x.get(i).copied().unwrap_or(0.0);
    if isa == Isa::Portable || !T::SPLIT_EVEN_ODD {
        out[..x.len()].copy_from_slice(x);
        out[x.len()..].fill(0.0);
        return;
    }
    let full = out.len() / BLOCK * BLOCK;
    for (b, ob) in out[..full].chunks_exact_mut(BLOCK).enumerate() {
        for i in 0..BLOCK / 2 {
            ob[i] = at(b * BLOCK + 2 * i);
            ob[BLOCK / 2 + i] = at(b * BLOCK + 2 * i + 1);
        }
    }
    for (i, o) in out.iter_mut().enumerate().skip(full) {
        *o = at(i);
    }
}

/// Portable: four rows at once so `x` is read once per four rows.
pub fn dot4_portable<T: Elem>(rows: [&[T]; 4], x: &[f32]) -> [f32; 4] {
    let mut acc = [0.0f32; 4];
    for (c, &xv) in x.iter().enumerate() {
        for k in 0..4 {
            acc[k] += rows[k][c].to_f32() * xv;
        }
    }
    acc
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
}

thread_local! {
    static FORCED: std::cell::Cell<Option<Isa>> = const { std::cell::Cell::new(None) };
}

/// Runs `f` with [`detect`] answering `isa` on this thread (tests compare every path the CPU
/// can run against the portable one). `isa` must be one [`detect`] could return here.
pub fn with_isa<R>(isa: Isa, f: impl FnOnce() -> R) -> R {
    assert!(isa == Isa::Portable || isa == detect(), "{isa:?} is not available on this CPU");
    let before = FORCED.replace(Some(isa));
    let r = f();
    FORCED.set(before);
    r
}

/// The implementation this CPU runs: the best it supports, unless `GRIDLM_PORTABLE` is set.
pub fn detect() -> Isa {
    if let Some(isa) = FORCED.get() {
        return isa;
    }
    #[cfg(target_arch = "x86_64")]
    {
        static ISA: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
        *ISA.get_or_init(|| {
            if std::env::var_os("GRIDLM_PORTABLE").is_none()
                && is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c")
            {
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

/// `out[i] = dot(row i of w, x)` for rows laid out contiguously with `cols` elements each.
pub fn dot_rows<T: Elem + Avx2Load>(w: &[T], cols: usize, x: &[f32], out: &mut [f32], isa: Isa) {
    debug_assert_eq!(w.len(), out.len() * cols);
    debug_assert_eq!(x.len(), cols);
    let n = out.len();
    let mut r = 0;
    while r + 4 <= n {
        let rows = [
            &w[r * cols..(r + 1) * cols],
            &w[(r + 1) * cols..(r + 2) * cols],
            &w[(r + 2) * cols..(r + 3) * cols],
            &w[(r + 3) * cols..(r + 4) * cols],
        ];
        let v = match isa {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `Isa::Avx2` is only produced after detecting avx2, fma and f16c.
            Isa::Avx2 => unsafe { avx2::dot4(rows, x) },
            _ => dot4_portable(rows, x),
        };
        out[r..r + 4].copy_from_slice(&v);
        r += 4;
    }
    while r < n {
        let row = &w[r * cols..(r + 1) * cols];
        out[r] = match isa {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            Isa::Avx2 => unsafe { avx2::dot1(row, x) },
            _ => dot1_portable(row, x),
        };
        r += 1;
    }
}

/// `out += a · v`.
pub fn axpy<T: Elem + Avx2Load>(a: f32, v: &[T], out: &mut [f32], isa: Isa) {
    assert_eq!(v.len(), out.len(), "axpy: lengths differ");
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa::Avx2` is only produced after detecting avx2, fma and f16c.
        Isa::Avx2 => unsafe { avx2::axpy(a, v, out) },
        _ => out.iter_mut().zip(v).for_each(|(o, w)| *o += a * w.to_f32()),
    }
}

/// `dst = src` as f32.
pub fn widen<T: Elem + Avx2Load>(src: &[T], dst: &mut [f32], isa: Isa) {
    assert_eq!(src.len(), dst.len(), "widen: lengths");
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa::Avx2` is only produced after detecting avx2, fma and f16c.
        Isa::Avx2 => unsafe { avx2::widen(src, dst) },
        _ => dst.iter_mut().zip(src).for_each(|(d, s)| *d = s.to_f32()),
    }
}

/// `o += Σ_j p[j] · v[j]` for rows `v[j]` of `o.len()` elements, contiguous in `v`.
pub fn weighted_rows(p: &[f32], v: &[f32], o: &mut [f32], isa: Isa) {
    let hd = o.len();
    assert_eq!(v.len(), p.len() * hd, "weighted_rows: lengths");
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa::Avx2` is only produced after detecting avx2, fma and f16c.
        Isa::Avx2 => unsafe { avx2::weighted_rows(p, v, o) },
        _ => {
            for (&pj, row) in p.iter().zip(v.chunks_exact(hd)) {
                o.iter_mut().zip(row).for_each(|(o, &x)| *o += pj * x);
            }
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
pub trait Avx2Load {}
#[cfg(not(target_arch = "x86_64"))]
impl<T> Avx2Load for T {}

#[cfg(target_arch = "x86_64")]
pub use avx2::{panel as avx2_panel, panel_pair as avx2_panel_pair, panel_q8 as avx2_panel_q8, Avx2Load};

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{Elem, BLOCK};
    use half::{bf16, f16};
    use std::arch::x86_64::*;

    /// Loads eight consecutive elements as f32 lanes.
    pub trait Avx2Load: Elem {
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
    }
    impl Avx2Load for f32 {
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn load8(p: *const f32) -> __m256 {
            _mm256_loadu_ps(p)
        }
    }
    impl Avx2Load for bf16 {
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn load8(p: *const bf16) -> __m256 {
            // bf16 is the top half of an f32: widen to 32 bits and shift left by 16.
            let h = _mm_loadu_si128(p as *const __m128i);
            _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
        }
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
    }
    impl Avx2Load for f16 {
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn load8(p: *const f16) -> __m256 {
            _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
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

    /// # Safety
    /// The CPU must have avx2, fma and f16c; all rows have `x.len()` elements.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot4<T: Avx2Load>(rows: [&[T]; 4], x: &[f32]) -> [f32; 4] {
        let n = x.len();
        let (p0, p1, p2, p3) = (rows[0].as_ptr(), rows[1].as_ptr(), rows[2].as_ptr(), rows[3].as_ptr());
        let xp = x.as_ptr();
        let mut a = [_mm256_setzero_ps(); 4];
        let mut c = 0;
        // Rows are short (often a few KiB), too short for the hardware prefetcher to ramp up
        // on four streams at once, so fetch the same columns of the next four rows (the next
        // block of a row-major matrix) while this block is summed. Prefetches never fault, and
        // the addresses are only computed (wrapping), never dereferenced.
        let ahead = 4 * n;
        while c + 32 <= n {
            for p in [p0, p1, p2, p3] {
                _mm_prefetch(p.wrapping_add(c + ahead) as *const i8, _MM_HINT_T0);
                _mm_prefetch(p.wrapping_add(c + ahead + 16) as *const i8, _MM_HINT_T0);
            }
            for k in 0..4 {
                let cc = c + 8 * k;
                let xv = _mm256_loadu_ps(xp.add(cc));
                a[0] = _mm256_fmadd_ps(T::load8(p0.add(cc)), xv, a[0]);
                a[1] = _mm256_fmadd_ps(T::load8(p1.add(cc)), xv, a[1]);
                a[2] = _mm256_fmadd_ps(T::load8(p2.add(cc)), xv, a[2]);
                a[3] = _mm256_fmadd_ps(T::load8(p3.add(cc)), xv, a[3]);
            }
            c += 32;
        }
        while c + 8 <= n {
            let xv = _mm256_loadu_ps(xp.add(c));
            a[0] = _mm256_fmadd_ps(T::load8(p0.add(c)), xv, a[0]);
            a[1] = _mm256_fmadd_ps(T::load8(p1.add(c)), xv, a[1]);
            a[2] = _mm256_fmadd_ps(T::load8(p2.add(c)), xv, a[2]);
            a[3] = _mm256_fmadd_ps(T::load8(p3.add(c)), xv, a[3]);
            c += 8;
        }
        let mut out = [hsum(a[0]), hsum(a[1]), hsum(a[2]), hsum(a[3])];
        while c < n {
            let xv = *xp.add(c);
            for (k, o) in out.iter_mut().enumerate() {
                *o += rows[k][c].to_f32() * xv;
            }
            c += 1;
        }
        out
    }

    /// # Safety
    /// As [`dot4`].
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot1<T: Avx2Load>(row: &[T], x: &[f32]) -> f32 {
        let n = x.len();
        let (p, xp) = (row.as_ptr(), x.as_ptr());
        let mut a0 = _mm256_setzero_ps();
        let mut a1 = _mm256_setzero_ps();
        let mut c = 0;
        while c + 16 <= n {
            a0 = _mm256_fmadd_ps(T::load8(p.add(c)), _mm256_loadu_ps(xp.add(c)), a0);
            a1 = _mm256_fmadd_ps(T::load8(p.add(c + 8)), _mm256_loadu_ps(xp.add(c + 8)), a1);
            c += 16;
        }
        if c + 8 <= n {
            a0 = _mm256_fmadd_ps(T::load8(p.add(c)), _mm256_loadu_ps(xp.add(c)), a0);
            c += 8;
        }
        let mut s = hsum(_mm256_add_ps(a0, a1));
        while c < n {
            s += row[c].to_f32() * *xp.add(c);
            c += 1;
        }
        s
    }

    /// # Safety
    /// The CPU must have avx2, fma and f16c; `v.len() == out.len()`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn axpy<T: Avx2Load>(a: f32, v: &[T], out: &mut [f32]) {
        let n = out.len();
        let (p, o) = (v.as_ptr(), out.as_mut_ptr());
        let av = _mm256_set1_ps(a);
        let mut c = 0;
        while c + 8 <= n {
            _mm256_storeu_ps(o.add(c), _mm256_fmadd_ps(T::load8(p.add(c)), av, _mm256_loadu_ps(o.add(c))));
            c += 8;
        }
        while c < n {
            *o.add(c) += a * v[c].to_f32();
            c += 1;
        }
    }

    /// # Safety
    /// The CPU must have avx2, fma and f16c; `src.len() == dst.len()`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn widen<T: Avx2Load>(src: &[T], dst: &mut [f32]) {
        let n = src.len();
        let mut c = 0;
        while c + 8 <= n {
            _mm256_storeu_ps(dst.as_mut_ptr().add(c), T::load8(src.as_ptr().add(c)));
            c += 8;
        }
        for i in c..n {
            dst[i] = src[i].to_f32();
        }
    }

    /// # Safety
    /// The CPU must have avx2, fma and f16c; `v.len() == p.len() * o.len()`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn weighted_rows(p: &[f32], v: &[f32], o: &mut [f32]) {
        let hd = o.len();
        let vp = v.as_ptr();
        // Columns in groups of 64 held in eight registers across all rows; the rest one by one.
        let mut c0 = 0;
        while c0 + 64 <= hd {
            let mut acc: [__m256; 8] = std::array::from_fn(|k| _mm256_loadu_ps(o.as_ptr().add(c0 + 8 * k)));
            for (j, &pj) in p.iter().enumerate() {
                let b = _mm256_set1_ps(pj);
                let row = vp.add(j * hd + c0);
                for (k, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(b, _mm256_loadu_ps(row.add(8 * k)), *a);
                }
            }
            for (k, a) in acc.iter().enumerate() {
                _mm256_storeu_ps(o.as_mut_ptr().add(c0 + 8 * k), *a);
            }
            c0 += 64;
        }
        for (c, oc) in o.iter_mut().enumerate().skip(c0) {
            for (j, &pj) in p.iter().enumerate() {
                *oc += pj * *vp.add(j * hd + c);
            }
        }
    }

    /// One packed panel (four rows, chunks of [`BLOCK`] columns side by side) against `NT`
    /// prepared inputs: `out[i][lane] = row lane · xs[i]`. Reads the panel in order, once.
    ///
    /// # Safety
    /// The CPU must have avx2, fma and f16c; `panel.len() == 4 * xs[i].len()` and every
    /// `xs[i].len()` is the same multiple of [`BLOCK`].
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn panel<T: Avx2Load, const NT: usize>(panel: &[T], xs: [&[f32]; NT]) -> [[f32; 4]; NT] {
        let n = xs[0].len();
        debug_assert_eq!(panel.len(), 4 * n);
        debug_assert_eq!(n % BLOCK, 0);
        let w = panel.as_ptr();
        let x: [*const f32; NT] = std::array::from_fn(|i| xs[i].as_ptr());
        let mut acc = [[_mm256_setzero_ps(); 4]; NT];
        // Bytes of one chunk of the panel (four rows × BLOCK columns) and how far ahead of the
        // read position to prefetch: far enough to cover memory latency at full bandwidth.
        let chunk_bytes = 4 * BLOCK * std::mem::size_of::<T>();
        const AHEAD: usize = 1024;
        let mut c = 0;
        let mut wp = w;
        while c < n {
            let ahead = (wp as *const u8).wrapping_add(AHEAD);
            let mut off = 0;
            while off < chunk_bytes {
                _mm_prefetch(ahead.wrapping_add(off) as *const i8, _MM_HINT_T0);
                off += 64;
            }
            // Two rows at a time, so each input vector is loaded once per pair of rows and
            // the loads stay fewer than the FMAs (with NT = 2, 14 registers are live).
            for pair in 0..2 {
                let (a_lo, a_hi) = T::load16(wp.add(2 * pair * BLOCK));
                let (b_lo, b_hi) = T::load16(wp.add((2 * pair + 1) * BLOCK));
                for (a, xi) in acc.iter_mut().zip(x) {
                    let (xl, xh) = (_mm256_loadu_ps(xi.add(c)), _mm256_loadu_ps(xi.add(c + 8)));
                    a[2 * pair] = _mm256_fmadd_ps(a_hi, xh, _mm256_fmadd_ps(a_lo, xl, a[2 * pair]));
                    a[2 * pair + 1] = _mm256_fmadd_ps(b_hi, xh, _mm256_fmadd_ps(b_lo, xl, a[2 * pair + 1]));
                }
            }
            wp = wp.add(4 * BLOCK);
            c += BLOCK;
        }
        let mut out = [[0.0f32; 4]; NT];
        for i in 0..NT {
            for lane in 0..4 {
                out[i][lane] = hsum(acc[i][lane]);
            }
        }
        out
    }

    /// Rows `lane` and `lane + 1` of a packed panel against `NT` prepared inputs (many-token
    /// products, with the panel in L1): `out[i] = [row lane · xs[i], row lane+1 · xs[i]]`.
    /// Each pair of weight vectors serves `NT` tokens and each input vector two rows, so with
    /// NT = 4 there are 10 loads per 16 FMAs and 14 registers live.
    ///
    /// # Safety
    /// As [`panel`]; `lane` is 0 or 2.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn panel_pair<T: Avx2Load, const NT: usize>(
        panel: &[T],
        lane: usize,
        xs: [&[f32]; NT],
    ) -> [[f32; 2]; NT] {
        let n = xs[0].len();
        debug_assert_eq!(panel.len(), 4 * n);
        debug_assert!(lane == 0 || lane == 2);
        let x: [*const f32; NT] = std::array::from_fn(|i| xs[i].as_ptr());
        let mut acc = [[_mm256_setzero_ps(); 2]; NT];
        let mut wp = panel.as_ptr().add(lane * BLOCK);
        // With few tokens the panel comes from memory on the first pass (rows 0–1): fetch
        // ahead in the panel's order, as the one-token kernel does.
        let chunk_bytes = 4 * BLOCK * std::mem::size_of::<T>();
        const AHEAD: usize = 1024;
        let mut c = 0;
        while c < n {
            if lane == 0 {
                let ahead = (wp as *const u8).wrapping_add(AHEAD);
                let mut off = 0;
                while off < chunk_bytes {
                    _mm_prefetch(ahead.wrapping_add(off) as *const i8, _MM_HINT_T0);
                    off += 64;
                }
            }
            let (a_lo, a_hi) = T::load16(wp);
            let (b_lo, b_hi) = T::load16(wp.add(BLOCK));
            for (a, xi) in acc.iter_mut().zip(x) {
                let (xl, xh) = (_mm256_loadu_ps(xi.add(c)), _mm256_loadu_ps(xi.add(c + 8)));
                a[0] = _mm256_fmadd_ps(a_hi, xh, _mm256_fmadd_ps(a_lo, xl, a[0]));
                a[1] = _mm256_fmadd_ps(b_hi, xh, _mm256_fmadd_ps(b_lo, xl, a[1]));
            }
            wp = wp.add(4 * BLOCK);
            c += BLOCK;
        }
        let mut out = [[0.0f32; 2]; NT];
        for (o, a) in out.iter_mut().zip(&acc) {
            *o = [hsum(a[0]), hsum(a[1])];
        }
        out
    }

    /// One int8 packed panel (four rows, chunks of [`BLOCK`] columns side by side) against an
    /// input quantized per group of two chunks (`q`, one scale per group in `s`). Per group the
    /// products are summed exactly in 32-bit integers (|q| ≤ 127, so the pairwise 16-bit sums
    /// of `maddubs` cannot saturate), then converted and scaled once. Two rows share one
    /// 256-bit register: lanes 0–3 sum row 0 (or 2), lanes 4–7 row 1 (or 3).
    ///
    /// # Safety
    /// The CPU must have avx2, fma and f16c; `panel.len() == 4 * q.len()`, `q.len()` is a
    /// multiple of [`BLOCK`] and `s.len() == q.len().div_ceil(2 * BLOCK)`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn panel_q8(panel: &[i8], q: &[i8], s: &[f32]) -> [f32; 4] {
        let n = q.len();
        debug_assert_eq!(panel.len(), 4 * n);
        debug_assert_eq!(s.len(), n.div_ceil(2 * BLOCK));
        let ones = _mm256_set1_epi16(1);
        let (mut acc01, mut acc23) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let mut wp = panel.as_ptr();
        let qp = q.as_ptr();
        const AHEAD: usize = 1024;
        // Integer sums of one chunk for rows (0,1) and (2,3).
        let chunk = |wp: *const i8, k: usize| {
            let x = _mm256_broadcastsi128_si256(_mm_loadu_si128(qp.add(k * BLOCK) as *const __m128i));
            let ax = _mm256_sign_epi8(x, x);
            let w01 = _mm256_loadu_si256(wp as *const __m256i);
            let w23 = _mm256_loadu_si256(wp.add(32) as *const __m256i);
            (
                _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(w01, x)), ones),
                _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(w23, x)), ones),
            )
        };
        let kc = n / BLOCK;
        let mut k = 0;
        while k < kc {
            _mm_prefetch(wp.wrapping_add(AHEAD), _MM_HINT_T0);
            _mm_prefetch(wp.wrapping_add(AHEAD + 64), _MM_HINT_T0);
            let (mut p01, mut p23) = chunk(wp, k);
            if k + 1 < kc {
                let (b01, b23) = chunk(wp.add(4 * BLOCK), k + 1);
                p01 = _mm256_add_epi32(p01, b01);
                p23 = _mm256_add_epi32(p23, b23);
            }
            let sc = _mm256_set1_ps(*s.get_unchecked(k / 2));
            acc01 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p01), sc, acc01);
            acc23 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p23), sc, acc23);
            wp = wp.add(8 * BLOCK);
            k += 2;
        }
        let half = |v: __m128| {
            let v = _mm_add_ps(v, _mm_movehl_ps(v, v));
            _mm_cvtss_f32(_mm_add_ss(v, _mm_shuffle_ps(v, v, 1)))
        };
        [
            half(_mm256_castps256_ps128(acc01)),
            half(_mm256_extractf128_ps(acc01, 1)),
            half(_mm256_castps256_ps128(acc23)),
            half(_mm256_extractf128_ps(acc23, 1)),
        ]
    }
}
