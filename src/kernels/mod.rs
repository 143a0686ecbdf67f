//! Compute kernels: pure functions on slices. Owns: arithmetic of one rank. Must not know about
//! MPI, the grid or the model's structure. Parallel kernels run on the [`Team`] they are given
//! (the engine's, which stays awake for a whole step).

pub mod dot;
pub mod limits;
pub mod packed;
pub mod team;

pub use packed::{matmul, PackedMat, Quant};
pub use team::Team;

/// RMSNorm of each `w.len()`-sized row of `x` into `out`: `x / sqrt(mean(x²) + eps) · w`.
pub fn rmsnorm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let d = w.len();
    for (xr, or) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let ss: f32 = xr.iter().map(|v| v * v).sum::<f32>() / d as f32;
        let inv = 1.0 / (ss + eps).sqrt();
        for ((o, &v), &g) in or.iter_mut().zip(xr).zip(w) {
            *o = v * inv * g;
        }
    }
}

/// Rotates each head of `x` (`n_heads × head_dim`) in place by the HF "rotate half" rule:
/// pairs are `(i, i + head_dim/2)`, with `cos`/`sin` of length `head_dim/2` for this position.
pub fn rope(x: &mut [f32], head_dim: usize, cos: &[f32], sin: &[f32]) {
    let half = head_dim / 2;
    for h in x.chunks_exact_mut(head_dim) {
        let (a, b) = h.split_at_mut(half);
        for i in 0..half {
            let (x0, x1) = (a[i], b[i]);
            a[i] = x0 * cos[i] - x1 * sin[i];
            b[i] = x1 * cos[i] + x0 * sin[i];
        }
    }
}

/// `gate[i] = silu(gate[i]) · up[i]`.
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

/// In-place softmax.
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    x.iter_mut().for_each(|v| *v *= inv);
}

/// Attention of one query head over `n_keys` cached keys/values (each `head_dim` long,
/// contiguous): `out = softmax(q·Kᵀ · scale) · V`. `scores` is scratch of at least `n_keys`.
pub fn attend<T: dot::Elem + dot::Avx2Load>(
    q: &[f32],
    keys: &[T],
    values: &[T],
    n_keys: usize,
    scale: f32,
    scores: &mut [f32],
    out: &mut [f32],
) {
    let hd = q.len();
    let isa = dot::detect();
    let s = &mut scores[..n_keys];
    dot::dot_rows(&keys[..n_keys * hd], hd, q, s, isa);
    s.iter_mut().for_each(|v| *v *= scale);
    softmax(s);
    out.fill(0.0);
    for (p, &a) in s.iter().enumerate() {
        dot::axpy(a, &values[p * hd..(p + 1) * hd], out, isa);
    }
}

/// Flash-style attention of several query rows against one KV head's cache, stored in pages
/// of `page_len` positions: `page(i)` gives the keys and values of positions
/// `i * page_len ..` (each `[page_len, head_dim]`), so a sequence's cache need not be
/// contiguous. Row `r` (`q[r]`, `head_dim` long) sees keys `bounds[r].0 ..= bounds[r].1`. Keys
/// go a page at a time; each page is scored against every row that sees part of it and folded
/// into that row's online softmax (running max and sum, earlier sums rescaled when the max
/// grows), so a page of keys and values is read once for all rows, while it sits in L1, and no
/// score buffer longer than a page exists. Pages that no row sees (past the causal edge of
/// the last row) are never touched. `out` is `[rows, head_dim]`.
pub fn attend_tiled<'a, T: dot::Elem + dot::Avx2Load + 'a>(
    q: &[f32],
    bounds: &[(usize, usize)],
    page_len: usize,
    page: impl Fn(usize) -> (&'a [T], &'a [T]),
    scale: f32,
    out: &mut [f32],
) {
    let nr = bounds.len();
    assert!(nr > 0 && q.len() % nr == 0 && out.len() == q.len() && page_len > 0, "attend_tiled: shapes");
    let hd = q.len() / nr;
    let isa = dot::detect();
    TILE.with_borrow_mut(|work| {
        // Running max and sum per row, one page of scores, and the page's keys and values
        // widened to f32 once for all rows.
        work.resize(2 * nr + page_len + 2 * page_len * hd, 0.0);
        let (m, rest) = work.split_at_mut(nr);
        let (l, rest) = rest.split_at_mut(nr);
        let (s, rest) = rest.split_at_mut(page_len);
        let (kf, vf) = rest.split_at_mut(page_len * hd);
        m.fill(f32::NEG_INFINITY);
        l.fill(0.0);
        out.fill(0.0);
        let lo = bounds.iter().map(|b| b.0).min().unwrap_or(0);
        let hi = bounds.iter().map(|b| b.1).max().unwrap_or(0);
        // One row (a decode step) reads the cache in place; several share a widened copy.
        let wide = nr > 1;
        for p in lo / page_len..=hi / page_len {
            let base = p * page_len;
            let (k0, k1) = (base.max(lo), (base + page_len).min(hi + 1));
            let (keys, values) = page(p);
            let (keys, values) = (&keys[..page_len * hd], &values[..page_len * hd]);
            if wide {
                let span = (k0 - base) * hd..(k1 - base) * hd;
                dot::widen(&keys[span.clone()], &mut kf[span.clone()], isa);
                dot::widen(&values[span.clone()], &mut vf[span], isa);
            }
            for (r, &(first, last)) in bounds.iter().enumerate() {
                let (a, b) = (first.max(k0), (last + 1).min(k1));
                if a >= b {
                    continue;
                }
                let n = b - a;
                let s = &mut s[..n];
                let (ka, kb) = ((a - base) * hd, (b - base) * hd);
                let qr = &q[r * hd..(r + 1) * hd];
                if wide {
                    dot::dot_rows(&kf[ka..kb], hd, qr, s, isa);
                } else {
                    dot::dot_rows(&keys[ka..kb], hd, qr, s, isa);
                }
                let mut block_max = f32::NEG_INFINITY;
                for v in s.iter_mut() {
                    *v *= scale;
                    block_max = block_max.max(*v);
                }
                let m_new = m[r].max(block_max);
                let o = &mut out[r * hd..(r + 1) * hd];
                if m[r] != f32::NEG_INFINITY && m[r] != m_new {
                    let corr = (m[r] - m_new).exp();
                    l[r] *= corr;
                    o.iter_mut().for_each(|v| *v *= corr);
                }
                m[r] = m_new;
                for v in s.iter_mut() {
                    *v = (*v - m_new).exp();
                    l[r] += *v;
                }
                if wide {
                    dot::weighted_rows(s, &vf[ka..kb], o, isa);
                } else {
                    for (j, &w) in s.iter().enumerate() {
                        dot::axpy(w, &values[ka + j * hd..ka + (j + 1) * hd], o, isa);
                    }
                }
            }
        }
        for (r, o) in out.chunks_exact_mut(hd).enumerate() {
            let inv = 1.0 / l[r];
            o.iter_mut().for_each(|v| *v *= inv);
        }
    });
}

thread_local! {
    /// Running maxima, sums and one block of scores for [`attend_tiled`].
    static TILE: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Index and value of the largest element; the lowest index wins a tie. NaN never wins.
pub fn argmax(x: &[f32]) -> (usize, f32) {
    let mut best = (0, f32::NEG_INFINITY);
    for (i, &v) in x.iter().enumerate() {
        if v > best.1 {
            best = (i, v);
        }
    }
    best
}

/// A mutable slice that parallel tasks may write through, each to its own disjoint ranges.
pub struct SharedSlice {
    ptr: *mut f32,
    len: usize,
}
// SAFETY: users promise (via the unsafe `range`) that concurrent ranges are disjoint.
unsafe impl Send for SharedSlice {}
unsafe impl Sync for SharedSlice {}

impl SharedSlice {
    pub fn new(s: &mut [f32]) -> Self {
        SharedSlice { ptr: s.as_mut_ptr(), len: s.len() }
    }
    /// # Safety
    /// No other live reference may overlap `start..start+len`.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn range(&self, start: usize, len: usize) -> &mut [f32] {
        assert!(start + len <= self.len, "SharedSlice range out of bounds");
        std::slice::from_raw_parts_mut(self.ptr.add(start), len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::weights::{DType, Data, Mat};
    use half::{bf16, f16};

    /// Deterministic pseudo-random values in [-1, 1).
    fn rand_vec(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    fn naive_matmul(w: &[f64], rows: usize, cols: usize, x: &[f32], n_tok: usize) -> Vec<f64> {
        let mut out = vec![0.0; n_tok * rows];
        for t in 0..n_tok {
            for r in 0..rows {
                out[t * rows + r] = (0..cols).map(|c| w[r * cols + c] * x[t * cols + c] as f64).sum();
            }
        }
        out
    }

    /// Every ISA this CPU runs, the portable one first.
    fn isas() -> Vec<dot::Isa> {
        let mut v = vec![dot::Isa::Portable];
        if dot::detect() != dot::Isa::Portable {
            v.push(dot::detect());
        }
        v
    }

    fn check_matmul(team: &Team, dtype: DType, rows: usize, cols: usize, n_tok: usize) {
        let wf = rand_vec(rows * cols, (rows * 31 + cols) as u64);
        let data = Data::F32(wf).cast(dtype);
        let w64: Vec<f64> = data.to_f32_vec().iter().map(|&v| v as f64).collect();
        let w = PackedMat::pack(&Mat { rows, cols, data: data.clone() });
        assert_eq!(packed::unpack(&w), data.to_f32_vec(), "pack/unpack round trip");
        let x = rand_vec(n_tok * cols, 7);
        let want = naive_matmul(&w64, rows, cols, &x, n_tok);
        assert_matmul_on_every_isa(team, &w, &x, n_tok, &want, 1e-6, &format!("{dtype:?}"));
    }

    /// `matmul` of `w` and `x` on every SIMD path is within `1e-5 √cols + rel |want|` of `want`.
    fn assert_matmul_on_every_isa(
        team: &Team,
        w: &PackedMat,
        x: &[f32],
        n_tok: usize,
        want: &[f64],
        rel: f64,
        what: &str,
    ) {
        let (rows, cols) = (w.rows, w.cols);
        for isa in isas() {
            let mut got = vec![f32::NAN; n_tok * rows];
            dot::with_isa(isa, || matmul(team, w, x, n_tok, &mut got));
            for (i, (g, e)) in got.iter().zip(want).enumerate() {
                let tol = 1e-5 * (cols as f64).sqrt() + rel * e.abs();
                assert!(
                    (*g as f64 - e).abs() <= tol,
                    "{isa:?} {what} {rows}x{cols} t={n_tok} at {i}: {g} vs {e}"
                );
            }
        }
    }

    #[test]
    fn matmul_all_dtypes_isas_and_odd_sizes() {
        for threads in [1, 2] {
            let team = Team::new(threads).unwrap();
            for dtype in [DType::F32, DType::BF16, DType::F16] {
                for &(rows, cols) in &[(1, 1), (3, 7), (5, 8), (17, 33), (64, 64), (130, 577), (1000, 96)] {
                    for n_tok in [1, 2, 3, 4, 7] {
                        check_matmul(&team, dtype, rows, cols, n_tok);
                    }
                }
                // Several column blocks and several token tiles.
                check_matmul(&team, dtype, 9, 4100, 70);
            }
        }
    }

    #[test]
    fn int8_matmul_matches_reference_on_both_isas() {
        let team = Team::new(2).unwrap();
        for &(rows, cols) in &[(1, 1), (3, 7), (5, 16), (17, 33), (130, 577), (64, 2048), (9, 4100)] {
            let wf = rand_vec(rows * cols, (rows * 7 + cols) as u64);
            let w = PackedMat::pack_as(&Mat { rows, cols, data: Data::F32(wf.clone()) }, Some(Quant::Int8));
            assert_eq!(w.dtype_name(), "int8");
            let wd = packed::unpack(&w);
            for r in 0..rows {
                let max = wf[r * cols..(r + 1) * cols].iter().fold(0.0f32, |a, v| a.max(v.abs()));
                for c in 0..cols {
                    let e = (wd[r * cols + c] - wf[r * cols + c]).abs();
                    assert!(e <= max / 127.0 * 0.5 + 1e-7, "weight ({r},{c}) off by {e}");
                }
            }
            for n_tok in [1, 2, 3, 5, 70] {
                let x = rand_vec(n_tok * cols, 11);
                // The kernel quantizes its input per group; the reference uses the same values.
                let cols_p = cols.next_multiple_of(16);
                let mut xd = vec![0.0f32; n_tok * cols];
                for t in 0..n_tok {
                    let mut q = vec![0i8; cols_p];
                    let mut s = vec![0.0f32; cols_p.div_ceil(32)];
                    packed::quantize_chunks(&x[t * cols..(t + 1) * cols], &mut q, &mut s);
                    for c in 0..cols {
                        xd[t * cols + c] = q[c] as f32 * s[c / 32];
                        assert!((xd[t * cols + c] - x[t * cols + c]).abs() <= s[c / 32] * 0.5 + 1e-7);
                    }
                }
                let w64: Vec<f64> = wd.iter().map(|&v| v as f64).collect();
                let want = naive_matmul(&w64, rows, cols, &xd, n_tok);
                assert_matmul_on_every_isa(&team, &w, &x, n_tok, &want, 1e-5, "int8");
            }
        }
    }

    #[test]
    fn prepared_vector_order() {
        let x: Vec<f32> = (0..35).map(|i| i as f32).collect();
        let mut out = vec![f32::NAN; 48];
        for isa in isas() {
            dot::prepare::<f32>(&x, &mut out, isa);
            assert_eq!(&out[..35], &x[..], "f32 keeps the order");
            assert!(out[35..].iter().all(|&v| v == 0.0), "padding is zero");
            dot::prepare::<bf16>(&x, &mut out, isa);
            if isa == dot::Isa::Portable {
                assert_eq!(&out[..35], &x[..]);
            } else {
                // Each block of 16: even columns, then odd ones; the padded tail too.
                assert_eq!(
                    &out[..16],
                    &[0., 2., 4., 6., 8., 10., 12., 14., 1., 3., 5., 7., 9., 11., 13., 15.]
                );
                assert_eq!(&out[32..40], &[32., 34., 0., 0., 0., 0., 0., 0.]);
                assert_eq!(&out[40..], &[33., 0., 0., 0., 0., 0., 0., 0.]);
            }
        }
    }

    #[test]
    fn portable_and_simd_agree_bitwise_close() {
        let cols = 203;
        let w: Vec<bf16> = rand_vec(4 * cols, 3).into_iter().map(bf16::from_f32).collect();
        let h: Vec<f16> = rand_vec(4 * cols, 4).into_iter().map(f16::from_f32).collect();
        let x = rand_vec(cols, 5);
        for isa in isas() {
            let mut a = [0.0; 4];
            dot::dot_rows(&w, cols, &x, &mut a, isa);
            let mut b = [0.0; 4];
            dot::dot_rows(&h, cols, &x, &mut b, isa);
            for r in 0..4 {
                let ea: f64 = (0..cols).map(|c| w[r * cols + c].to_f64() * x[c] as f64).sum();
                let eb: f64 = (0..cols).map(|c| h[r * cols + c].to_f64() * x[c] as f64).sum();
                assert!((a[r] as f64 - ea).abs() < 1e-4, "{isa:?} bf16 row {r}");
                assert!((b[r] as f64 - eb).abs() < 1e-4, "{isa:?} f16 row {r}");
            }
            for n in [1, 7, 8, 64, 67] {
                let v: Vec<f16> = rand_vec(n, 8).into_iter().map(f16::from_f32).collect();
                let mut out = rand_vec(n, 9);
                let want: Vec<f64> = out.iter().zip(&v).map(|(&o, w)| o as f64 + 0.37 * w.to_f64()).collect();
                dot::axpy(0.37, &v, &mut out, isa);
                for (g, e) in out.iter().zip(&want) {
                    assert!((*g as f64 - e).abs() < 1e-6, "{isa:?} axpy n={n}");
                }
            }
        }
    }

    #[test]
    fn rmsnorm_matches_reference() {
        for d in [1, 7, 64, 577] {
            let x = rand_vec(2 * d, d as u64);
            let w = rand_vec(d, 9);
            let mut out = vec![0.0; 2 * d];
            rmsnorm(&x, &w, 1e-5, &mut out);
            for t in 0..2 {
                let xr = &x[t * d..(t + 1) * d];
                let ms: f64 = xr.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / d as f64;
                for i in 0..d {
                    let e = xr[i] as f64 / (ms + 1e-5).sqrt() * w[i] as f64;
                    assert!((out[t * d + i] as f64 - e).abs() < 1e-5 * (1.0 + e.abs()));
                }
            }
        }
    }

    #[test]
    fn rope_rotates_half_pairs() {
        let hd = 6;
        let mut x = rand_vec(2 * hd, 11);
        let orig = x.clone();
        let angles = [0.3f64, 1.1, -2.0];
        let cos: Vec<f32> = angles.iter().map(|a| a.cos() as f32).collect();
        let sin: Vec<f32> = angles.iter().map(|a| a.sin() as f32).collect();
        rope(&mut x, hd, &cos, &sin);
        for h in 0..2 {
            for i in 0..3 {
                let (a, b) = (orig[h * hd + i] as f64, orig[h * hd + i + 3] as f64);
                let (c, s) = (angles[i].cos(), angles[i].sin());
                assert!((x[h * hd + i] as f64 - (a * c - b * s)).abs() < 1e-6);
                assert!((x[h * hd + i + 3] as f64 - (b * c + a * s)).abs() < 1e-6);
            }
        }
    }

    fn check_attend<T: dot::Elem + dot::Avx2Load>() {
        for isa in isas() {
            for (hd, n) in [(8, 1), (64, 5), (17, 33), (64, 300)] {
                let q = rand_vec(hd, 1);
                let k: Vec<T> = rand_vec(n * hd, 2).into_iter().map(T::from_f32).collect();
                let v: Vec<T> = rand_vec(n * hd, 3).into_iter().map(T::from_f32).collect();
                let scale = 1.0 / (hd as f32).sqrt();
                let mut scores = vec![0.0; n];
                let mut out = vec![0.0; hd];
                dot::with_isa(isa, || attend(&q, &k, &v, n, scale, &mut scores, &mut out));
                let kf = |i: usize| k[i].to_f32() as f64;
                let s: Vec<f64> = (0..n)
                    .map(|p| (0..hd).map(|i| q[i] as f64 * kf(p * hd + i)).sum::<f64>() * scale as f64)
                    .collect();
                let m = s.iter().cloned().fold(f64::MIN, f64::max);
                let e: Vec<f64> = s.iter().map(|v| (v - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for i in 0..hd {
                    let want: f64 = (0..n).map(|p| e[p] / z * v[p * hd + i].to_f32() as f64).sum();
                    assert!((out[i] as f64 - want).abs() < 1e-5, "{isa:?} hd={hd} n={n}");
                }
            }
        }
    }

    /// Positions per page in the tiled-attention tests.
    const PAGE: usize = 16;

    /// Tiled attention over query rows with causal and windowed bounds, keys in pages out of
    /// order, equals one row at a time through [`attend`] over keys in order.
    fn check_tiled<T: dot::Elem + dot::Avx2Load>() {
        for isa in isas() {
            for (hd, n_keys, rows, window) in
                [(64, 300usize, 40, None), (16, 70, 5, Some(20)), (8, 3, 3, None), (64, 130, 1, None)]
            {
                // Whole pages, scattered in reverse order to check the page lookup.
                let pages = n_keys.div_ceil(PAGE);
                let k: Vec<T> = rand_vec(pages * PAGE * hd, 21).into_iter().map(T::from_f32).collect();
                let v: Vec<T> = rand_vec(pages * PAGE * hd, 22).into_iter().map(T::from_f32).collect();
                let at = |p: usize| (pages - 1 - p) * PAGE * hd..(pages - p) * PAGE * hd;
                let page = |p: usize| (&k[at(p)], &v[at(p)]);
                let q = rand_vec(rows * hd, 23);
                let scale = 1.0 / (hd as f32).sqrt();
                // Rows are the last `rows` positions of a prompt of n_keys tokens.
                let bounds: Vec<(usize, usize)> = (0..rows)
                    .map(|r| {
                        let pos = n_keys - rows + r;
                        (window.map_or(0, |w: usize| (pos + 1).saturating_sub(w)), pos)
                    })
                    .collect();
                let mut got = vec![f32::NAN; rows * hd];
                dot::with_isa(isa, || attend_tiled(&q, &bounds, PAGE, page, scale, &mut got));
                // The row-by-row reference reads the keys in position order.
                let (k, v): (Vec<T>, Vec<T>) =
                    (0..pages).flat_map(|p| k[at(p)].iter().zip(&v[at(p)]).map(|(a, b)| (*a, *b))).unzip();
                for (r, &(first, last)) in bounds.iter().enumerate() {
                    let mut want = vec![0.0; hd];
                    let mut scores = vec![0.0; n_keys];
                    let n = last + 1 - first;
                    dot::with_isa(isa, || {
                        attend(
                            &q[r * hd..(r + 1) * hd],
                            &k[first * hd..],
                            &v[first * hd..],
                            n,
                            scale,
                            &mut scores,
                            &mut want,
                        )
                    });
                    for i in 0..hd {
                        let (g, w) = (got[r * hd + i], want[i]);
                        assert!((g - w).abs() < 1e-5, "{isa:?} hd={hd} row {r} col {i}: {g} vs {w}");
                    }
                }
            }
        }
    }

    #[test]
    fn tiled_attention_matches_row_by_row() {
        check_tiled::<f32>();
        check_tiled::<f16>();
        check_tiled::<bf16>();
    }

    #[test]
    fn attend_matches_reference_for_every_kv_dtype() {
        check_attend::<f32>();
        check_attend::<f16>();
        check_attend::<bf16>();
    }

    #[test]
    fn silu_and_argmax() {
        let mut g = vec![-2.0f32, 0.0, 3.0];
        silu_mul(&mut g, &[1.0, 5.0, 2.0]);
        for (got, x, u) in [(g[0], -2.0f64, 1.0), (g[1], 0.0, 5.0), (g[2], 3.0, 2.0)] {
            assert!((got as f64 - x / (1.0 + (-x).exp()) * u).abs() < 1e-6);
        }
        assert_eq!(argmax(&[1.0, 3.0, 3.0, f32::NAN, -1.0]), (1, 3.0));
    }
}
