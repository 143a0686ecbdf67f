//! Dot products of weight rows (f32, bf16 or f16, read in place) with an f32 vector.
//! AVX2 + FMA (+ F16C for f16) when the CPU has them, detected at run time; a portable
//! fallback otherwise. Sums are f32.

use half::{bf16, f16};

/// A weight element that converts to f32.
pub trait Elem: Copy + Send + Sync + 'static {
    fn to_f32(self) -> f32;
}
impl Elem for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
}
impl Elem for bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
}
impl Elem for f16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
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

/// Which implementation this CPU runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    Portable,
    Avx2,
}

pub fn detect() -> Isa {
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

#[cfg(not(target_arch = "x86_64"))]
pub trait Avx2Load {}
#[cfg(not(target_arch = "x86_64"))]
impl<T> Avx2Load for T {}

#[cfg(target_arch = "x86_64")]
pub use avx2::Avx2Load;

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::Elem;
    use half::{bf16, f16};
    use std::arch::x86_64::*;

    /// Loads eight consecutive elements as f32 lanes.
    pub trait Avx2Load: Elem {
        /// # Safety
        /// `p` must point to eight readable elements; the CPU must have avx2, fma and f16c.
        unsafe fn load8(p: *const Self) -> __m256;
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
}
