//! Compute kernels: pure functions on slices. Owns: arithmetic of one rank. Must not know about
//! MPI, the grid or the model's structure. Parallel kernels run where they are told ([`Par`]):
//! on the engine's [`Team`], which stays awake for a whole step, or on one thread of a region
//! of it ([`Team::region`]), where every thread makes the same calls.

pub mod arena;
pub mod dot;
pub mod limits;
pub mod packed;
pub mod team;

pub use dot::{Fetch, ManyFetch, Streams};
pub use packed::{matmul, pick_fetch, pick_many_fetch, pick_streams, PackedMat, Picked, Quant};
pub use team::{Par, Region, Team};

/// RMSNorm of each `w.len()`-sized row of `x` into `out`: `x / sqrt(mean(x²) + eps) · w`.
pub fn rmsnorm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let d = w.len();
    for (xr, or) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let inv = inv_rms(xr, eps);
        for ((o, &v), &g) in or.iter_mut().zip(xr).zip(w) {
            *o = v * inv * g;
        }
    }
}

/// [`rmsnorm`] of each `w.len()`-long row of `x`, in place (Qwen3's per-head q/k norms).
pub fn rmsnorm_in_place(x: &mut [f32], w: &[f32], eps: f32) {
    for xr in x.chunks_exact_mut(w.len()) {
        let inv = inv_rms(xr, eps);
        for (v, &g) in xr.iter_mut().zip(w) {
            *v = *v * inv * g;
        }
    }
}

/// `x += rmsnorm(o) · scale` with weights `w`, row by row (`w.len()` long): a sublayer's
/// output normed as it joins the residual stream (Gemma 2, 3), each value as [`rmsnorm`]
/// computes it (a `scale` of 1 changes no bit).
pub fn add_rmsnormed(x: &mut [f32], o: &[f32], w: &[f32], eps: f32, scale: f32) {
    for (xr, or) in x.chunks_exact_mut(w.len()).zip(o.chunks_exact(w.len())) {
        let inv = inv_rms(or, eps);
        for ((x, &v), &g) in xr.iter_mut().zip(or).zip(w) {
            *x += v * inv * g * scale;
        }
    }
}

/// LayerNorm of each `w.len()`-long row of `x` into `out`: `(v − mean) / sqrt(var + eps) · w +
/// b`, the variance the mean of the squared deviations (StarCoder 2's norms).
pub fn layernorm(x: &[f32], w: &[f32], b: &[f32], eps: f32, out: &mut [f32]) {
    let d = w.len();
    for (xr, or) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let mean = xr.iter().sum::<f32>() / d as f32;
        or.iter_mut().zip(xr).for_each(|(o, v)| *o = v - mean);
        let inv = inv_rms(or, eps);
        for ((o, &g), &b) in or.iter_mut().zip(w).zip(b) {
            *o = *o * inv * g + b;
        }
    }
}

/// `1 / sqrt(mean(x²) + eps)`.
fn inv_rms(x: &[f32], eps: f32) -> f32 {
    1.0 / (sum_of_squares(x) / x.len() as f32 + eps).sqrt()
}

/// `Σ v²` over `x`, in 16 lanes (then summed) so that the compiler can use vector registers:
/// a plain `sum` must add in order, one add at a time. On the 2-core Zen 4 machine a row of 576
/// took ~0.6 µs that way, and a SmolLM2 token has 61 norms per sequence.
fn sum_of_squares(x: &[f32]) -> f32 {
    const LANES: usize = 16;
    let mut acc = [0.0f32; LANES];
    let chunks = x.chunks_exact(LANES);
    let rest = chunks.remainder();
    for c in chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a += v * v;
        }
    }
    acc.iter().sum::<f32>() + rest.iter().map(|v| v * v).sum::<f32>()
}

/// Rotates each head of `x` (`n_heads × head_dim`) in place by the HF "rotate half" rule over
/// its first `2 · cos.len()` dimensions (all of them, or a partial rotary part): pairs are
/// `(i, i + cos.len())`, with `cos`/`sin` of this position; the other dimensions pass.
pub fn rope(x: &mut [f32], head_dim: usize, cos: &[f32], sin: &[f32]) {
    let half = cos.len();
    debug_assert!(2 * half <= head_dim && sin.len() == half);
    for h in x.chunks_exact_mut(head_dim) {
        let (a, b) = h[..2 * half].split_at_mut(half);
        for i in 0..half {
            let (x0, x1) = (a[i], b[i]);
            a[i] = x0 * cos[i] - x1 * sin[i];
            b[i] = x1 * cos[i] + x0 * sin[i];
        }
    }
}

/// [`rope`] on interleaved pairs, as GLM rotates: pairs are `(2i, 2i + 1)` of each head's
/// first `2 · cos.len()` dimensions.
pub fn rope_interleaved(x: &mut [f32], head_dim: usize, cos: &[f32], sin: &[f32]) {
    let half = cos.len();
    debug_assert!(2 * half <= head_dim && sin.len() == half);
    for h in x.chunks_exact_mut(head_dim) {
        for (i, p) in h[..2 * half].chunks_exact_mut(2).enumerate() {
            let (x0, x1) = (p[0], p[1]);
            p[0] = x0 * cos[i] - x1 * sin[i];
            p[1] = x1 * cos[i] + x0 * sin[i];
        }
    }
}

/// How attention scores are formed from the dot products of a query with its keys: times
/// `scale`, then, with a cap `c`, `c · tanh(s / c)` (Gemma 2's soft-capping).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Scores {
    pub scale: f32,
    pub cap: Option<f32>,
}

/// `x[i] = cap · tanh(x[i] · scale / cap)` (Gemma 2's soft-capped logits and attention scores).
pub fn softcap(x: &mut [f32], scale: f32, cap: f32) {
    dot::softcap(x, scale, cap, dot::detect());
}

/// The activation of an FFN's gate (`act(gate) · up`, [`act_mul`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// `g · sigmoid(g)`.
    Silu,
    /// GELU in its tanh form (HF's `gelu_pytorch_tanh` and `gelu_new`, Gemma's).
    GeluTanh,
    /// GELU itself, `g/2 · (1 + erf(g/√2))` (HF's `gelu`, Falcon's).
    Gelu,
}

/// `gate[i] = act(gate[i]) · up[i]` (SiLU, GELU's tanh form or GELU).
pub fn act_mul(gate: &mut [f32], up: &[f32], act: Activation) {
    dot::act_mul(gate, Some(up), act, dot::detect());
}

/// `x[i] = act(x[i])` (an FFN without a gate: StarCoder 2's), each value as [`act_mul`] with an
/// `up` of 1 computes it.
pub fn act(x: &mut [f32], act: Activation) {
    dot::act_mul(x, None, act, dot::detect());
}

/// Takes a row's state over one tile: `(row, tile, max, sum, weighted values)`
/// ([`AttendOut::Tiles`]).
pub type TileSink<'a> = &'a mut dyn FnMut(usize, usize, f32, f32, &[f32]);

/// Called by [`attend_tiled`] at each page visit as `(visit, visits)`.
pub type Ahead<'a> = &'a dyn Fn(usize, usize);

/// Where [`attend_tiled`] puts its results.
pub enum AttendOut<'a> {
    /// The attention itself, `[rows, head_dim]` (0 for a row that saw nothing).
    Rows(&'a mut [f32]),
    /// Every row's state over each tile of `tiles` (tile `t` holds the pages
    /// [`tile_pages`]`(t)`), given to `emit(row, tile, max, sum, values)`: the max of the
    /// row's scaled scores in the tile, the sum of their exponentials less that max, and the
    /// values weighted by those exponentials (−∞, 0 and zeros for a tile the row sees nothing
    /// of). [`merge_tiles`] folds a row's tiles, from any number of calls, into exactly the
    /// bits one call over all of them gives.
    Tiles { tiles: std::ops::Range<usize>, emit: TileSink<'a> },
}

/// Flash-style attention of several query rows against one KV head's cache, stored in pages
/// of `page_len` positions: `page(i)` gives the keys and values of positions
/// `i * page_len ..`, keys transposed (`[head_dim, page_len]`: per dimension, the page's keys
/// side by side) and values as rows (`[page_len, head_dim]`), so a sequence's cache need not
/// be contiguous. Row `r` (`q[r]`, `head_dim` long) sees keys `bounds[r].0 ..= bounds[r].1`.
///
/// Keys go a tile at a time, tiles fixed by position ([`tile_pages`]). Each page is scored
/// against every row at once (each converted vector of keys serves several rows); a row's
/// scores in the tile give its tile state (their max, the sum of their exponentials less it,
/// the values weighted by those; keys a row does not see get weight 0), and the tile states
/// are folded in order into the row's running state (`fold_tile`). A page is read once for
/// all rows, and no score buffer longer than a tile exists. Pages that no row sees (past the
/// causal edge of the last row) are never touched. A row's result depends on its own query
/// and keys only, never on the other rows of the call, and its keys may be split over calls on
/// tile boundaries ([`AttendOut::Tiles`], [`merge_tiles`]) without changing a bit of it.
///
/// A row whose bounds are empty (`first > last`) sees nothing.
///
/// `ahead(visit, visits)` is called once at each of the call's `visits` page visits (each page
/// it reads is visited twice, for its keys and for its values), `visit` counting from 0: the
/// caller's hook for spreading its requests for what it reads next over this call's work.
pub fn attend_tiled<'a, T: dot::Elem + dot::Avx2Load + 'a>(
    q: &[f32],
    bounds: &[(usize, usize)],
    page_len: usize,
    page: impl Fn(usize) -> (&'a [T], &'a [T]),
    scores: Scores,
    mut out: AttendOut,
    ahead: Ahead,
) {
    let nr = bounds.len();
    assert!(nr > 0 && q.len().is_multiple_of(nr) && page_len > 0, "attend_tiled: shapes");
    assert!(!matches!(&out, AttendOut::Rows(o) if o.len() != q.len()), "attend_tiled: out shape");
    let hd = q.len() / nr;
    let isa = dot::detect();
    let tile_len = TILE_PAGES * page_len;
    TILE.with_borrow_mut(|work| {
        // Per row: its running max and sum, its tile's max and sum, the two factors of their
        // fold, one tile of scores and the tile's weighted values ([`reserve_attention`]).
        work.resize(nr * (WORK_PER_ROW + tile_len + hd), 0.0);
        let (m, rest) = work.split_at_mut(nr);
        let (l, rest) = rest.split_at_mut(nr);
        let (mt, rest) = rest.split_at_mut(nr);
        let (lt, rest) = rest.split_at_mut(nr);
        let (ab, rest) = rest.split_at_mut(2 * nr);
        let (s, acc) = rest.split_at_mut(nr * tile_len);
        m.fill(f32::NEG_INFINITY);
        l.fill(0.0);
        if let AttendOut::Rows(o) = &mut out {
            o.fill(0.0);
        }
        let seen = bounds.iter().filter(|b| b.0 <= b.1);
        let span = seen.clone().map(|b| b.0).min().zip(seen.map(|b| b.1).max());
        // The tiles to visit: those some row sees, or (`Tiles`) those asked for.
        let tiles = match (&out, span) {
            (AttendOut::Tiles { tiles, .. }, _) => tiles.clone(),
            (AttendOut::Rows(_), Some((lo, hi))) => tile_of(lo / page_len)..tile_of(hi / page_len) + 1,
            (AttendOut::Rows(_), None) => return,
        };
        let (lo, hi) = span.unwrap_or((usize::MAX, 0));
        let (first_page, last_page) = (lo / page_len, hi / page_len);
        // The first [`FAR_PAGES`] pages are asked for at once. After them, a page that does not
        // begin where the page before it ends (pages may be scattered through the pool, each
        // too short for the hardware prefetcher to follow) is asked for [`FAR_PAGES`] ahead of
        // the one being scored, and again AHEAD: sixteen pages are more than L1 holds, so one
        // asked for far ahead may have gone back to L2 by the time it is near. A run of
        // consecutive pages (a long sequence's, as the pool hands its pages out ascending) is
        // one stream of keys and one of values, and the hardware prefetcher follows it better
        // alone: asking for those pages too, a thread's 90 items of 2000 positions (a SmolLM2
        // token's) from memory took 3.7–3.9 ms against 2.0–2.3 without (2-core Zen 5 machine;
        // two threads, 2.0–2.2 against 1.3–1.4), and with each page somewhere else the
        // requests still paid (3.6 ms against 5.6 without them).
        const AHEAD: usize = 2;
        let fetch = |p: usize| {
            if p <= last_page {
                let (k, v) = page(p);
                dot::prefetch(&k[..hd * page_len]);
                dot::prefetch(&v[..hd * page_len]);
            }
        };
        // Whether page `p` is past the first and begins, keys and values alike, where page
        // `p - 1` ends.
        let follows = |p: usize| p > first_page && p <= last_page && runs_to(page(p - 1), page(p), 1);
        // Whether the page kernels, reading page `p`, ask for what lies [`dot::PAGE_AHEAD`]
        // on: for few rows, and only where that is still this call's pages, in one run.
        let reach = dot::PAGE_AHEAD.div_ceil(hd * page_len * std::mem::size_of::<T>());
        let ask = |p: usize| {
            nr <= PAGE_AHEAD_ROWS && p + reach <= last_page && runs_to(page(p), page(p + reach), reach)
        };
        let fetch_gap = |p: usize| {
            if !follows(p) {
                fetch(p);
            }
        };
        if span.is_some() {
            (first_page..first_page + FAR_PAGES).for_each(fetch);
        }
        let visits: usize = tiles
            .clone()
            .map(|t| {
                let tp = tile_pages(t);
                2 * tp.end.min(last_page + 1).saturating_sub(tp.start.max(first_page))
            })
            .sum();
        let mut visit = 0;
        let mut step = || {
            ahead(visit, visits);
            visit += 1;
        };
        for tile in tiles {
            let tp = tile_pages(tile);
            let (base, end) = (tp.start * page_len, tp.end * page_len);
            // The tile's pages and keys that some row sees (keys from the tile's start).
            let pages = tp.start.max(first_page)..tp.end.min(last_page + 1);
            let (ja, jb) = (lo.clamp(base, end) - base, (hi + 1).clamp(base, end) - base);
            mt.fill(f32::NEG_INFINITY);
            lt.fill(0.0);
            acc.fill(0.0);
            if ja < jb {
                // Many rows score two pages at a time ([`dot::page_scores_pair`]). Which pages'
                // kernels ask ahead, by page from the tile's start: found once, as the keys are
                // scored, and read again for the values (never for pairs: they have more rows).
                let mut asks = 0u32;
                let mut p = pages.start;
                while p < pages.end {
                    let n = (pages.end - p).min(if nr >= PAIR_ROWS { 2 } else { 1 });
                    for p in p..p + n {
                        fetch_gap(p + FAR_PAGES);
                        fetch_gap(p + AHEAD);
                        step();
                    }
                    let at = (p - tp.start) * page_len;
                    let keys = |p: usize| &page(p).0[..hd * page_len];
                    if n == 2 {
                        dot::page_scores_pair(
                            [keys(p), keys(p + 1)],
                            page_len,
                            q,
                            &mut s[at..],
                            tile_len,
                            isa,
                        );
                    } else {
                        let a = ask(p);
                        asks |= u32::from(a) << (p - tp.start);
                        dot::page_scores(keys(p), page_len, q, &mut s[at..], tile_len, a, isa);
                    }
                    p += n;
                }
                // Each row's keys in the tile (from its start).
                let keys = |r: usize| {
                    let (first, last) = bounds[r];
                    first.max(base + ja) - base..(last + 1).min(base + jb).saturating_sub(base)
                };
                let scale = match scores.cap {
                    None => scores.scale,
                    Some(cap) => {
                        // Scaled and capped here, then scaled by 1 (exactly) in softmax_rows.
                        for (r, row) in s.chunks_exact_mut(tile_len).enumerate() {
                            let k = keys(r);
                            if k.start < k.end {
                                dot::softcap(&mut row[k], scores.scale, cap, isa);
                            }
                        }
                        1.0
                    }
                };
                dot::softmax_rows(s, tile_len, keys, ja..jb, scale, mt, lt, isa);
                for p in pages {
                    step();
                    // This page's keys within ja..jb, from the tile's start.
                    let at = (p - tp.start) * page_len;
                    let (ka, kb) = (at.max(ja), (at + page_len).min(jb));
                    if ka < kb {
                        let values = page(p).1;
                        dot::page_values(
                            &s[ka..],
                            tile_len,
                            &values[(ka - at) * hd..(kb - at) * hd],
                            hd,
                            acc,
                            (asks >> (p - tp.start)) & 1 == 1,
                            isa,
                        );
                    }
                }
            }
            match &mut out {
                AttendOut::Rows(o) => {
                    // The rows' fold factors in one pass of the vector exp (rows whose fold
                    // takes none get values they do not use).
                    for (r, ab) in ab.chunks_exact_mut(2).enumerate() {
                        ab.copy_from_slice(&fold_exponents(m[r], mt[r]));
                    }
                    dot::exp_sub_sum(ab, 0.0, isa);
                    for (r, o) in o.chunks_exact_mut(hd).enumerate() {
                        let tile = (mt[r], lt[r], &acc[r * hd..(r + 1) * hd]);
                        fold_tile((&mut m[r], &mut l[r], o), tile, (ab[2 * r], ab[2 * r + 1]), isa);
                    }
                }
                AttendOut::Tiles { emit, .. } => {
                    for r in 0..nr {
                        emit(r, tile, mt[r], lt[r], &acc[r * hd..(r + 1) * hd]);
                    }
                }
            }
        }
        if let AttendOut::Rows(o) = out {
            for (o, &l) in o.chunks_exact_mut(hd).zip(l.iter()) {
                finish_row(o, l);
            }
        }
    });
}

/// Whether a page's keys and values (`next`) each begin `n` pages' lengths past those of
/// `before` (`n = 1`: where they end), as they do where the pages from `before` to `next` lie
/// one after the other.
fn runs_to<T>(before: (&[T], &[T]), next: (&[T], &[T]), n: usize) -> bool {
    before.0.as_ptr().wrapping_add(n * before.0.len()) == next.0.as_ptr()
        && before.1.as_ptr().wrapping_add(n * before.1.len()) == next.1.as_ptr()
}

/// Rows from which [`attend_tiled`] scores two pages at a time: more than one query position's
/// heads (a decode token's are at most 8 in the models gridlm runs), whose pages are read by
/// many rows and mostly from cache. On the 2-core Zen 5 machine, attention of 48 rows over 2000
/// positions in cache took 144–145 µs with pairs against 161–162 without, and a 2000-token
/// SmolLM2 prompt prefilled at 0.72–0.76 of the FMA peak against 0.65–0.72 (13 interleaved
/// pairs of 14; 0.74 against 0.76 in the other); but decode at 2000 positions with pairs
/// (three rows a KV head, the pages from memory) ran at 0.80–0.82 of the bandwidth against
/// 0.85–0.87 without, two pages read side by side a poorer stream than one after the other.
const PAIR_ROWS: usize = 9;

/// Rows up to which [`attend_tiled`] has the page kernels ask ahead ([`dot::PAGE_AHEAD`]): a
/// decode token's query heads of one KV head (at most 8 in the models gridlm runs), whose pages
/// come from memory. More rows are a prompt's, whose pages the same step has just written and
/// reads from cache, many times over: there the requests would only take up load slots.
const PAGE_AHEAD_ROWS: usize = 8;

// [`attend_tiled`] keeps which of a tile's pages ask ahead in a `u32`, and finds it only where
// it scores a page alone: pairs of pages are for more rows than ask.
const _: () = assert!(TILE_PAGES <= 32 && PAIR_ROWS > PAGE_AHEAD_ROWS);

/// [`attend_tiled`]'s working floats per row besides its tile of scores and values.
const WORK_PER_ROW: usize = 6;

/// The exponents of [`fold_tile`]'s two factors for a running max `m` and a tile's max `mt`:
/// each less the larger. Both [`attend_tiled`] and [`merge_tiles`] take them from here, through
/// the same vector exp.
#[inline]
fn fold_exponents(m: f32, mt: f32) -> [f32; 2] {
    let mx = m.max(mt);
    [m - mx, mt - mx]
}

/// Folds a row's tile state (`(max, sum, weighted values)`, see [`AttendOut::Tiles`]) into its
/// running state: both rescaled to the larger max and added. `(a, b)`: [`dot::exp_sub_sum`]'s
/// exp (an element-wise function) of [`fold_exponents`], used only when both maxima are
/// finite. The one fold of both [`attend_tiled`] and [`merge_tiles`], so
/// that they give the same bits.
#[inline]
fn fold_tile(
    (m, l, acc): (&mut f32, &mut f32, &mut [f32]),
    (mt, lt, at): (f32, f32, &[f32]),
    (a, b): (f32, f32),
    isa: dot::Isa,
) {
    if mt == f32::NEG_INFINITY {
        return;
    }
    if *m == f32::NEG_INFINITY {
        (*m, *l) = (mt, lt);
        acc.copy_from_slice(at);
        return;
    }
    *l = *l * a + lt * b;
    dot::scale_add(acc, a, at, b, isa);
    *m = m.max(mt);
}

/// A row's running state made its attention: the weighted values over their sum (0 for a row
/// that saw nothing).
#[inline]
fn finish_row(acc: &mut [f32], l: f32) {
    let inv = if l > 0.0 { 1.0 / l } else { 0.0 };
    acc.iter_mut().for_each(|v| *v *= inv);
}

/// One row's attention from its tile states in order of position, each from
/// [`AttendOut::Tiles`] (a row's tiles may come from several calls): `acc` is `[n, head_dim]`
/// weighted values, `stats` `[n, 2]` their (max, sum). The bits of one [`attend_tiled`] call
/// over all the row's keys.
pub fn merge_tiles(acc: &[f32], stats: &[f32], out: &mut [f32]) {
    let hd = out.len();
    assert!(hd > 0 && acc.len().is_multiple_of(hd) && stats.len() == 2 * (acc.len() / hd), "merge: shapes");
    let isa = dot::detect();
    out.fill(0.0);
    // Every tile's fold factors in one pass of the vector exp (the running max before and
    // after each tile follows from the tiles' maxima alone), in [`attend_tiled`]'s buffer.
    let l = TILE.with_borrow_mut(|ab| {
        crate::grow(ab, stats.len());
        let ab = &mut ab[..stats.len()];
        let mut m = f32::NEG_INFINITY;
        for (f, v) in ab.chunks_exact_mut(2).zip(stats.chunks_exact(2)) {
            f.copy_from_slice(&fold_exponents(m, v[0]));
            m = m.max(v[0]);
        }
        dot::exp_sub_sum(ab, 0.0, isa);
        let (mut m, mut l) = (f32::NEG_INFINITY, 0.0);
        for ((at, v), f) in acc.chunks_exact(hd).zip(stats.chunks_exact(2)).zip(ab.chunks_exact(2)) {
            fold_tile((&mut m, &mut l, out), (v[0], v[1], at), (f[0], f[1]), isa);
        }
        l
    });
    finish_row(out, l);
}

/// Pages per tile of keys in [`attend_tiled`] (the unit its softmax bookkeeping runs on, and on
/// whose boundaries a row's keys may be split between calls), but for the first
/// [`TILE_PAGES`] pages, which go in tiles of [`SMALL_TILE_PAGES`]: a decode step of a short
/// sequence can then still split its keys evenly, and a long one keeps the long tiles. Tiles
/// of 4 pages throughout made prefill attention over 2000 positions ~12% slower than tiles
/// of 8 (a timed loop on the 2-core Zen 5 machine, 48 rows of 64), the bookkeeping (a max,
/// a sum and the fold of each row) running twice as often.
pub const TILE_PAGES: usize = 8;

/// Pages per tile among the first [`TILE_PAGES`] pages.
pub const SMALL_TILE_PAGES: usize = 2;

/// The pages of attention tile `t`: tiles of [`SMALL_TILE_PAGES`] pages up to page
/// [`TILE_PAGES`], then of [`TILE_PAGES`].
pub fn tile_pages(t: usize) -> std::ops::Range<usize> {
    const SMALL: usize = TILE_PAGES / SMALL_TILE_PAGES;
    if t < SMALL {
        t * SMALL_TILE_PAGES..(t + 1) * SMALL_TILE_PAGES
    } else {
        (t + 1 - SMALL) * TILE_PAGES..(t + 2 - SMALL) * TILE_PAGES
    }
}

/// The attention tile that holds page `p` ([`tile_pages`]).
pub fn tile_of(p: usize) -> usize {
    if p < TILE_PAGES {
        p / SMALL_TILE_PAGES
    } else {
        TILE_PAGES / SMALL_TILE_PAGES - 1 + p / TILE_PAGES
    }
}

/// Pages [`attend_tiled`] asks for ahead (and a caller may ask for before it starts, see
/// `KvPool::prefetch_read`). A decode step's KV pages come from memory: the weights streamed
/// since the step before have pushed them out of cache. On the 2-core Zen 4 machine the
/// attention of a SmolLM2 batch of 8 (positions 64–128) took 2.2–2.5 ms of a ~14.5 ms step
/// when only the next two pages were fetched, its time spent waiting on their loads; 1.3–1.7
/// ms with these and the next item's pages asked for, batch 8 decoding 3–6% faster.
///
/// They are asked for with the T0 hint, into L1 and L2. With T1, into L2 only, each thread of
/// a SmolLM2 decode step (batch 1, positions 64–192, 2-core Zen 5 machine) spent 178–222 µs a
/// step in its attention items, against 160–168 with T0 (eight runs each, interleaved), and a
/// profile found the page kernels mostly waiting on their loads of values.
pub const FAR_PAGES: usize = 16;

thread_local! {
    /// Running and tile maxima and sums, one tile of scores and the tile's weighted values, per
    /// row, for [`attend_tiled`].
    static TILE: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Sizes the calling thread's [`attend_tiled`] buffer for calls of up to `rows` rows of
/// `head_dim` over pages of `page_len` positions, so that those calls allocate nothing.
pub fn reserve_attention(rows: usize, page_len: usize, head_dim: usize) {
    TILE.with_borrow_mut(|work| crate::grow(work, rows * (WORK_PER_ROW + TILE_PAGES * page_len + head_dim)));
}

/// Index and value of the largest element; the lowest index wins a tie. NaN never wins; with
/// no value above -inf the answer is (0, -inf).
///
/// Two passes that the compiler turns into vector code: the largest value by lanes, then the
/// first block holding it. The one-pass loop, whose branch on each element kept it scalar,
/// took 40 µs for one row of SmolLM2's 49152 logits (on the 2-core Zen 4 machine), which is
/// 2–3% of a batch-8 decode step's time for its eight rows.
pub fn argmax(x: &[f32]) -> (usize, f32) {
    const LANES: usize = 16;
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let chunks = x.chunks_exact(LANES);
    let rest = chunks.remainder();
    for c in chunks {
        for (l, &v) in lanes.iter_mut().zip(c) {
            // NaN compares false, so it never replaces a lane.
            *l = if v > *l { v } else { *l };
        }
    }
    let max = lanes.iter().chain(rest).fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m });
    if max == f32::NEG_INFINITY {
        return (0, max);
    }
    const BLOCK: usize = 256;
    for (b, c) in x.chunks(BLOCK).enumerate() {
        if c.iter().fold(false, |hit, &v| hit | (v == max)) {
            let i = c.iter().position(|&v| v == max).unwrap_or(0);
            return (b * BLOCK + i, max);
        }
    }
    (0, max)
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
    /// Where element `start` is, for a kernel that writes some elements of
    /// `start..start+len` while other threads write others (no reference to the whole span is
    /// made).
    pub fn span(&self, start: usize, len: usize) -> *mut f32 {
        assert!(start + len <= self.len, "SharedSlice span out of bounds");
        self.ptr.wrapping_add(start)
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
        dot::available()
    }

    /// Every (ISA, VNNI allowed) this CPU runs, the portable one first; with `int8`, each ISA
    /// whose int8 path is a VNNI one also without it (`maddubs`). Where `GRIDLM_TEST_ISAS_FROM`
    /// names an ISA, only that one and those after it in [`dot::Isa::ALL`]: the emulated
    /// AVX-512 run sets it to `avx512`, since the host's own run of the same tests took the
    /// portable and AVX2 paths, which under emulation took more time than the AVX-512 ones
    /// (the portable one most: scalar code, an instruction per element).
    fn paths(int8: bool) -> Vec<(dot::Isa, bool)> {
        let vnni = |isa| dot::with_isa(isa, dot::int8_path);
        let extra = |isa| int8 && !matches!(vnni(isa), dot::Int8Path::Portable | dot::Int8Path::Maddubs);
        let from = std::env::var("GRIDLM_TEST_ISAS_FROM").ok().map(|name| {
            dot::Isa::ALL
                .iter()
                .position(|i| format!("{i:?}").eq_ignore_ascii_case(&name))
                .unwrap_or_else(|| panic!("GRIDLM_TEST_ISAS_FROM={name} names no ISA"))
        });
        isas()
            .into_iter()
            .filter(|isa| from.is_none_or(|k| dot::Isa::ALL[k..].contains(isa)))
            .flat_map(|isa| std::iter::once((isa, true)).chain(extra(isa).then_some((isa, false))))
            .collect()
    }

    /// `f` on path `p` of [`paths`].
    fn on_path<R>(p: (dot::Isa, bool), f: impl FnOnce() -> R) -> R {
        dot::with_isa(p.0, || if p.1 { f() } else { dot::without_vnni(f) })
    }

    fn check_matmul(team: &Team, dtype: DType, rows: usize, cols: usize, n_tok: usize) {
        let wf = rand_vec(rows * cols, (rows * 31 + cols) as u64);
        let data = Data::F32(wf).cast(dtype);
        let w64: Vec<f64> = data.to_f32_vec().iter().map(|&v| v as f64).collect();
        let w = PackedMat::pack(&Mat { rows, cols, data: data.clone() });
        assert_eq!(packed::unpack(&w), data.to_f32_vec(), "pack/unpack round trip");
        let x = rand_vec(n_tok * cols, 7);
        let want = |x: &[f32]| naive_matmul(&w64, rows, cols, x, n_tok);
        assert_matmul_on_every_isa(team, &w, &x, n_tok, &want, 1e-6, &format!("{dtype:?}"));
    }

    /// `matmul` of `w` and `x` on every SIMD path is within `1e-5 √cols + rel |want|` of
    /// `want(x)`, where `x` is rounded as the path rounds it (bf16 weights on
    /// [`dot::Isa::Avx512Bf16`]; int8's `want` is called on each path, as it quantizes the
    /// input as the path does).
    fn assert_matmul_on_every_isa(
        team: &Team,
        w: &PackedMat,
        x: &[f32],
        n_tok: usize,
        want: &dyn Fn(&[f32]) -> Vec<f64>,
        rel: f64,
        what: &str,
    ) {
        let (rows, cols) = (w.rows, w.cols);
        let int8 = w.dtype_name() == "int8";
        // Each reference is computed once, when a path first needs it: the f64 reference took a
        // fifth of the kernel tests' instructions, and the rounded one is needed only where
        // AVX512_BF16 runs.
        let plain = std::cell::OnceCell::new();
        let rounded = std::cell::OnceCell::new();
        for path in paths(int8) {
            let isa = path.0;
            let own;
            let want = if int8 {
                own = on_path(path, || want(x));
                &own
            } else if isa == dot::Isa::Avx512Bf16 && w.dtype_name() == "bf16" {
                rounded
                    .get_or_init(|| want(&x.iter().map(|&v| dot::round_like_dot_bf16(v)).collect::<Vec<_>>()))
            } else {
                plain.get_or_init(|| want(x))
            };
            let mut got = vec![f32::NAN; n_tok * rows];
            on_path(path, || matmul(team, w, x, n_tok, &mut got));
            for (i, (g, e)) in got.iter().zip(want).enumerate() {
                let tol = 1e-5 * (cols as f64).sqrt() + rel * e.abs();
                assert!(
                    (*g as f64 - e).abs() <= tol,
                    "{path:?} {what} {rows}x{cols} t={n_tok} at {i}: {g} vs {e}"
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
                // Several column blocks and token tiles. f32 (like int8) goes by two blocks of
                // about 2048 columns, in tiles of 32 tokens; bf16 and f16 panels are widened to
                // f32 (from 16 tokens on) in five blocks of 832, in tiles of 80 tokens, so with
                // 170 tokens the last tile, of 10, is not widened.
                check_matmul(&team, dtype, 9, 4100, 70);
                check_matmul(&team, dtype, 9, 4100, 170);
                // One block and one tile of 33 tokens over 33 panels: bf16 on AVX512_BF16 two
                // panels at a time, the last alone.
                check_matmul(&team, dtype, 130, 577, 33);
            }
        }
    }

    #[test]
    fn one_token_products_are_the_same_whatever_the_prefetch() {
        let _g = dot::FETCH_LOCK.lock().unwrap_or_else(|e| e.into_inner());
        let before = dot::fetch();
        let team = Team::new(2).unwrap();
        for &(rows, cols) in &[(5, 16), (17, 33), (130, 577), (1000, 96)] {
            let wf = Data::F32(rand_vec(rows * cols, (rows * 5 + cols) as u64));
            let x = rand_vec(cols, 3);
            let mats = [DType::F32, DType::BF16, DType::F16]
                .map(|d| PackedMat::pack(&Mat { rows, cols, data: wf.cast(d) }))
                .into_iter()
                .chain([PackedMat::pack_as(&Mat { rows, cols, data: wf.clone() }, Some(Quant::Int8))]);
            for w in mats {
                for path in paths(w.dtype_name() == "int8") {
                    let run = |f: Fetch| {
                        dot::set_fetch(f);
                        let mut out = vec![f32::NAN; rows];
                        on_path(path, || matmul(&team, &w, &x, 1, &mut out));
                        out.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
                    };
                    let near = run(Fetch::Near);
                    for f in Fetch::ALL {
                        assert_eq!(run(f), near, "{path:?} {} {rows}x{cols} {f:?}", w.dtype_name());
                    }
                }
            }
        }
        dot::set_fetch(before);
    }

    /// The many-token bf16 kernel's prefetch ([`ManyFetch`]) changes no bit either: a batch's
    /// tokens (in one panel at a time and in pairs, in column blocks past 1376 columns; under
    /// [`ManyFetch::Whole`] up to eight at once) and a short prompt's, on every path (only
    /// AVX512_BF16 runs that kernel). From 2048 columns on it asks for the next panels
    /// instead, with the way's hint ([`dot::avx512_panels_many_bf16`]).
    #[test]
    fn many_token_products_are_the_same_whatever_the_prefetch() {
        let _g = dot::FETCH_LOCK.lock().unwrap_or_else(|e| e.into_inner());
        let before = dot::many_fetch();
        let team = Team::new(2).unwrap();
        for &(rows, cols) in &[(9, 64), (130, 577), (9, 2032), (9, 2048), (17, 4100)] {
            let data = Data::F32(rand_vec(rows * cols, (rows * 7 + cols) as u64)).cast(DType::BF16);
            let w = PackedMat::pack(&Mat { rows, cols, data });
            for n_tok in [2, 4, 5, 7, 8, 9, 13, 16] {
                let x = rand_vec(n_tok * cols, 5);
                for path in paths(false) {
                    let run = |f: ManyFetch| {
                        dot::set_many_fetch(f);
                        let mut out = vec![f32::NAN; n_tok * rows];
                        on_path(path, || matmul(&team, &w, &x, n_tok, &mut out));
                        out.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
                    };
                    let l2 = run(ManyFetch::L2);
                    for f in ManyFetch::ALL {
                        assert_eq!(run(f), l2, "{path:?} {rows}x{cols} {n_tok} tokens {f:?}");
                    }
                }
            }
        }
        dot::set_many_fetch(before);
    }

    #[test]
    fn fetch_names_round_trip_and_list_in_declared_order() {
        for (i, f) in Fetch::ALL.into_iter().enumerate() {
            assert_eq!(f as usize, i);
            assert_eq!(Fetch::parse(f.name()), Some(f));
        }
        assert_eq!(Fetch::parse("sideways"), None);
        for (i, f) in ManyFetch::ALL.into_iter().enumerate() {
            assert_eq!(f as usize, i);
            assert_eq!(ManyFetch::parse(f.name()), Some(f));
        }
        assert_eq!(ManyFetch::parse("far"), None);
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
                let absmax = |v: &[f32]| v.iter().fold(0.0f32, |a, v| a.max(v.abs()));
                let (row, got) = (&wf[r * cols..(r + 1) * cols], &wd[r * cols..(r + 1) * cols]);
                // The row's largest weight saturates, so its scale is the largest result / 127.
                let (max, s) = (absmax(row), absmax(got) / 127.0);
                assert!(
                    s <= max / 127.0 * 1.000_01 && s >= max * 0.7 / 127.0 * 0.999_99,
                    "row {r} scale {s}"
                );
                for (c, (&v, &d)) in row.iter().zip(got).enumerate() {
                    if v.abs() <= 127.0 * s {
                        assert!((d - v).abs() <= s * 0.5 + 1e-7, "weight ({r},{c}) off by {}", d - v);
                    } else {
                        assert!((d - 127.0 * s * v.signum()).abs() <= 1e-6, "weight ({r},{c}) not saturated");
                    }
                }
            }
            for n_tok in [1, 2, 3, 5, 70] {
                let x = rand_vec(n_tok * cols, 11);
                let want = |x: &[f32]| int8_reference(&w, x, n_tok);
                assert_matmul_on_every_isa(&team, &w, &x, n_tok, &want, 1e-5, "int8");
            }
        }
    }

    /// A row clips where that loses least: 4095 weights on the grid of 0.9 / 127 and one
    /// weight of 1 take the scale 0.9 / 127 (the bulk then exact, the one weight saturating
    /// at 0.9), not 1 / 127 (every weight of the bulk rounded).
    #[test]
    fn int8_scale_clips_where_that_loses_least() {
        let cols = 4096;
        let t = 0.9f32 / 127.0;
        let mut wf: Vec<f32> = rand_vec(cols, 9).iter().map(|u| (u * 127.0).round() * t).collect();
        wf[7] = 1.0;
        let w = PackedMat::pack_as(&Mat { rows: 1, cols, data: Data::F32(wf.clone()) }, Some(Quant::Int8));
        let wd = packed::unpack(&w);
        let s = wd.iter().fold(0.0f32, |a, v| a.max(v.abs())) / 127.0;
        assert!((s / t - 1.0).abs() < 1e-5, "scale {s}, want {t}");
        let err = |scale: f32| -> f64 {
            wf.iter().map(|&v| ((v / scale).round().clamp(-127.0, 127.0) * scale - v).powi(2) as f64).sum()
        };
        let got: f64 = wf.iter().zip(&wd).map(|(a, b)| ((a - b) as f64).powi(2)).sum();
        assert!(got < 0.011 && got < err(1.0 / 127.0) / 1.5, "{got} against {}", err(1.0 / 127.0));
    }

    /// The exact product of int8 weights `w` and `x` as the kernels see it: each input
    /// quantized per group of columns.
    fn int8_reference(w: &PackedMat, x: &[f32], n_tok: usize) -> Vec<f64> {
        let (rows, cols) = (w.rows, w.cols);
        let cols_p = cols.next_multiple_of(packed::CHUNK);
        let mut xd = vec![0.0f32; n_tok * cols];
        for t in 0..n_tok {
            let g = packed::XGROUP;
            let mut q = vec![0i8; cols_p];
            let mut s = vec![0.0f32; cols_p.div_ceil(g)];
            let max = dot::INT8_INPUT_MAX;
            packed::quantize_groups(&x[t * cols..(t + 1) * cols], &mut q, &mut s, max);
            for c in 0..cols {
                xd[t * cols + c] = q[c] as f32 * s[c / g];
                assert!((xd[t * cols + c] - x[t * cols + c]).abs() <= s[c / g] * 0.501 + 1e-7);
                assert!(q[c].abs() <= max);
            }
        }
        let w64: Vec<f64> = packed::unpack(w).iter().map(|&v| v as f64).collect();
        naive_matmul(&w64, rows, cols, &xd, n_tok)
    }

    /// Input quantization on every path against the portable loop, bit for bit: lengths that
    /// end inside a group and padding groups, exact halves (rounded away from zero), zeros,
    /// infinities and NaN.
    #[test]
    fn quantized_inputs_match_portable_on_every_isa() {
        let mut x = rand_vec(200, 17);
        x[32..64].iter_mut().enumerate().for_each(|(i, v)| *v = i as f32 - 15.5);
        x[32] = 64.0;
        // The largest float below one half rounds to 0 (a plain "add 0.5, truncate" gives 1).
        x[50] = f32::from_bits(0.5f32.to_bits() - 1);
        x[64..96].fill(0.0);
        x[100] = f32::INFINITY;
        x[140] = f32::NAN;
        x[150] = -1e30;
        for (len, max) in [0usize, 5, 32, 64, 96, 131, 200].into_iter().flat_map(|l| [(l, 64), (l, 127)]) {
            let padded = len.next_multiple_of(packed::XGROUP) + packed::XGROUP;
            let groups = padded / packed::XGROUP;
            let (mut q0, mut s0) = (vec![7i8; padded], vec![7.0f32; groups]);
            packed::quantize_groups_body(&x[..len], &mut q0, &mut s0, max);
            assert!(q0.iter().all(|q| q.abs() <= max));
            for isa in isas() {
                let (mut q, mut s) = (vec![7i8; padded], vec![7.0f32; groups]);
                dot::with_isa(isa, || packed::quantize_groups(&x[..len], &mut q, &mut s, max));
                assert_eq!(q, q0, "{isa:?} len {len} max {max}");
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&s), bits(&s0), "{isa:?} len {len} max {max}");
            }
        }
        // Halves round away from zero: the second group's max is 64, so its scale is 1 at 64
        // levels a side and 64 / 127 at 127.
        let (mut q, mut s) = (vec![0i8; 64], vec![0.0f32; 2]);
        packed::quantize_groups(&x[..64], &mut q, &mut s, 64);
        assert_eq!(s[1], 1.0);
        assert_eq!(&q[33..37], &[-15, -14, -13, -12]);
        assert_eq!(&q[47..51], &[-1, 1, 2, 0]);
        packed::quantize_groups(&x[..64], &mut q, &mut s, 127);
        assert_eq!(s[1], 64.0 / 127.0);
        assert_eq!((q[32], q[33], q[47], q[48]), (127, -29, -1, 1));
    }

    /// The largest products the int8 kernels can meet (every weight at its row's maximum,
    /// every input at its group's), of either sign: the integer sums stay exact.
    #[test]
    fn int8_matmul_extreme_values_stay_exact() {
        let team = Team::new(2).unwrap();
        let (rows, cols) = (8, 200);
        let wf: Vec<f32> = (0..rows * cols).map(|i| if (i / cols) % 2 == 0 { 1.0 } else { -1.0 }).collect();
        let w = PackedMat::pack_as(&Mat { rows, cols, data: Data::F32(wf) }, Some(Quant::Int8));
        for sign in [1.0f32, -1.0] {
            let x = vec![sign * 3.0; cols];
            let want = |_: &[f32]| -> Vec<f64> {
                (0..rows).map(|r| if r % 2 == 0 { 1.0 } else { -1.0 } * sign as f64 * 600.0).collect()
            };
            assert_matmul_on_every_isa(&team, &w, &x, 1, &want, 1e-6, "int8 extremes");
        }
    }

    /// The int8 kernels sum the same integers in the same order: `maddubs` and each VNNI path
    /// this CPU has (AVX512-VNNI too where AVX-VNNI is preferred) give the same bits, and the
    /// exact sums, with extreme weights and inputs (|q| = 127, whose pairs of products come
    /// nearest `maddubs`'s 16 bits) among random ones, and odd row counts.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn int8_kernels_agree_bit_for_bit() {
        let kernels = dot::int8_kernels();
        if kernels.is_empty() {
            return;
        }
        assert!(kernels.contains(&dot::Int8Path::Maddubs));
        for &(rows, n) in &[(1usize, 16usize), (4, 32), (7, 48), (13, 2048)] {
            let np = rows.div_ceil(4);
            let ints = |len: usize, max: i32, seed: u64| -> Vec<i8> {
                rand_vec(len, seed)
                    .iter()
                    .map(|v| (v * (max as f32 + 1.0)).floor().clamp(-(max as f32), max as f32) as i8)
                    .collect()
            };
            let mut w = ints(4 * n * np, 127, n as u64);
            let mut q = ints(n, 127, 5);
            w.iter_mut().step_by(5).for_each(|v| *v = -127);
            w[..32].fill(127);
            q[..16].fill(127);
            q[16..].iter_mut().step_by(7).for_each(|v| *v = -127);
            let s: Vec<f32> = rand_vec(n.div_ceil(32), 9).iter().map(|v| v.abs() + 0.01).collect();
            let rs: Vec<f32> = rand_vec(4 * np, 3).iter().map(|v| v.abs() + 0.01).collect();
            let run = |k: dot::Int8Path| {
                let mut out = vec![f32::NAN; rows];
                // SAFETY: `k` is a path this CPU runs (from `int8_kernels`); the lengths are as
                // the kernel asks, |q| ≤ 127.
                unsafe { dot::avx2_panels_q8(&w, &q, &s, &rs, &mut out, Fetch::Near, k) };
                out.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            };
            let base = run(dot::Int8Path::Maddubs);
            for &k in &kernels {
                assert_eq!(run(k), base, "{k:?} {rows}x{n}");
            }
            // And the exact value: the integers summed per group, scaled.
            for r in 0..rows {
                let (p, lane) = (r / 4, r % 4);
                let weight = |c: usize| w[((p * (n / 16) + c / 16) * 4 + lane) * 16 + c % 16] as i64;
                let mut want = 0.0f64;
                for (g, (qg, sg)) in q.chunks(32).zip(&s).enumerate() {
                    let isum: i64 = qg.iter().enumerate().map(|(i, &x)| weight(g * 32 + i) * x as i64).sum();
                    want += isum as f64 * *sg as f64;
                }
                want *= rs[r] as f64;
                let got = f32::from_bits(base[r]) as f64;
                assert!(
                    (got - want).abs() <= 1e-5 * want.abs().max(1.0),
                    "row {r} of {rows}x{n}: {got} vs {want}"
                );
            }
        }
    }

    /// One int8 panel of `n` columns and four tokens' inputs for the token-group kernels'
    /// tests: weights and inputs at |q| ≤ 127 with extremes (127 and −127) among random ones,
    /// positive scales.
    #[cfg(target_arch = "x86_64")]
    struct Q8Panel {
        w: Vec<i8>,
        qs: Vec<Vec<i8>>,
        ss: Vec<Vec<f32>>,
        rs: Vec<f32>,
    }

    #[cfg(target_arch = "x86_64")]
    impl Q8Panel {
        fn new(n: usize) -> Q8Panel {
            let ints = |len: usize, seed: u64| -> Vec<i8> {
                rand_vec(len, seed).iter().map(|v| (v * 128.0).floor().clamp(-127.0, 127.0) as i8).collect()
            };
            let mut w = ints(4 * n, n as u64);
            w.iter_mut().step_by(5).for_each(|v| *v = -127);
            w[..16].fill(127);
            let qs = (0..4)
                .map(|t| {
                    let mut q = ints(n, 11 + t as u64);
                    q[..16].fill(if t % 2 == 0 { 127 } else { -127 });
                    q
                })
                .collect();
            let ss = (0..4)
                .map(|t| rand_vec(n.div_ceil(32), 20 + t).iter().map(|v| v.abs() + 0.01).collect())
                .collect();
            let rs = rand_vec(4, 3).iter().map(|v| v.abs() + 0.01).collect();
            Q8Panel { w, qs, ss, rs }
        }

        /// Each token's input as the bytes `f` makes of it (`dot::offset_q8`, `dot::abs_q8`).
        fn unsigned(&self, f: fn(&[i8], &mut [u8])) -> Vec<Vec<u8>> {
            self.qs
                .iter()
                .map(|q| {
                    let mut u = vec![0u8; q.len()];
                    f(q, &mut u);
                    u
                })
                .collect()
        }

        /// Each token's four sums by the one-token kernel of path `k`, alone.
        fn alone(&self, k: dot::Int8Path) -> Vec<[f32; 4]> {
            (0..4)
                .map(|t| {
                    let mut out = [f32::NAN; 4];
                    // SAFETY: `k` is a path this CPU runs (the callers take it from
                    // `int8_kernels`); the lengths are as the kernel asks.
                    unsafe {
                        dot::avx2_panels_q8(
                            &self.w,
                            &self.qs[t],
                            &self.ss[t],
                            &self.rs,
                            &mut out,
                            Fetch::Near,
                            k,
                        )
                    };
                    out
                })
                .collect()
        }
    }

    /// The many-token int8 kernel (AVX512-VNNI) gives each token of a group the bits the
    /// one-token kernel of every VNNI path gives it alone (inputs at the VNNI range, |q| ≤ 127,
    /// extremes among random ones), for one to four tokens.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn int8_many_token_kernel_matches_one_token() {
        if !dot::int8_many(dot::detect()) {
            return;
        }
        let vnni: Vec<_> = dot::int8_kernels()
            .into_iter()
            .filter(|k| matches!(k, dot::Int8Path::AvxVnni | dot::Int8Path::Avx512Vnni))
            .collect();
        for &n in &[16usize, 32, 48, 2048] {
            let case = Q8Panel::new(n);
            let Q8Panel { w, ss, rs, .. } = &case;
            let us = case.unsigned(dot::offset_q8);
            for &k in &vnni {
                let alone = case.alone(k);
                for (nt, spread) in (1..=4).flat_map(|nt| [(nt, false), (nt, true)]) {
                    let mut out = vec![[f32::NAN; 4]; nt];
                    let x = std::array::from_fn(|t| us[t.min(nt - 1)].as_ptr());
                    let s = std::array::from_fn(|t| ss[t.min(nt - 1)].as_ptr());
                    // The lines after the panel asked for as it goes, or each chunk 4 KiB ahead:
                    // the same sums.
                    let next = w.as_ptr_range().end as *const u8;
                    let ahead = spread.then(|| dot::Ahead::share(next, w.len() / 64, (0, 1), n / 16));
                    // SAFETY: `int8_many` found AVX512-VNNI on a 512-bit ISA; each token's
                    // offset input and scales cover the `n` columns.
                    unsafe { dot::avx2_panel_q8_many(w, x, s, rs, &mut out, ahead) };
                    for t in 0..nt {
                        let (got, want) = (out[t].map(f32::to_bits), alone[t].map(f32::to_bits));
                        assert_eq!(
                            got, want,
                            "one token on {k:?}: n {n}, {nt} tokens, token {t}, spread {spread}"
                        );
                    }
                }
            }
        }
    }

    /// The 256-bit token-group int8 kernel gives each of one to four tokens the bits the
    /// one-token kernel of the same path gives it alone, on every path this CPU has (`maddubs`,
    /// and each VNNI form), with extreme weights and inputs (|q| = 127) among random ones, a
    /// row of one chunk (a group cut short), odd chunk counts and a long row.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn int8_token_group_kernel_matches_one_token() {
        let kernels = dot::int8_kernels();
        for &n in &[16usize, 32, 48, 80, 2048] {
            let case = Q8Panel::new(n);
            let Q8Panel { w, qs, ss, rs } = &case;
            let abs = case.unsigned(dot::abs_q8);
            for &k in &kernels {
                let alone = case.alone(k);
                for nt in 1..=4 {
                    let mut out = vec![[f32::NAN; 4]; nt];
                    let q = std::array::from_fn(|t| qs[t.min(nt - 1)].as_ptr());
                    let qa = std::array::from_fn(|t| abs[t.min(nt - 1)].as_ptr());
                    let s = std::array::from_fn(|t| ss[t.min(nt - 1)].as_ptr());
                    // SAFETY: `k` is a path this CPU runs; every |q| ≤ 127, and each token's
                    // input, its |q| and its scales cover the panel's `n` columns.
                    unsafe { dot::avx2_panel_q8_tokens(w, q, qa, s, rs, &mut out, k) };
                    for t in 0..nt {
                        let (got, want) = (out[t].map(f32::to_bits), alone[t].map(f32::to_bits));
                        assert_eq!(got, want, "{k:?}: n {n}, {nt} tokens, token {t}");
                    }
                }
            }
        }
    }

    /// The int8 path keeps its quantized inputs between calls. A narrow matrix needs more
    /// group scales per input value than a wide one, so after a wide product a narrow one with
    /// many tokens must still find room for its scales.
    #[test]
    fn int8_narrow_product_after_a_wide_one() {
        let team = Team::new(2).unwrap();
        for &(rows, cols, n_tok) in &[(4, 2048, 1), (5, 16, 128)] {
            let wf = rand_vec(rows * cols, cols as u64);
            let w = PackedMat::pack_as(&Mat { rows, cols, data: Data::F32(wf) }, Some(Quant::Int8));
            let x = rand_vec(n_tok * cols, 3);
            let want = |x: &[f32]| int8_reference(&w, x, n_tok);
            assert_matmul_on_every_isa(&team, &w, &x, n_tok, &want, 1e-5, "int8 narrow");
        }
    }

    /// Where `GRIDLM_EXPECT_ISA` names an ISA, this CPU must run it, and where
    /// `GRIDLM_EXPECT_INT8` lists int8 paths (by name, comma-separated), it must run exactly
    /// those, so the tests above did compare them against the reference and with each other
    /// (the emulated AVX-512 run sets both).
    #[test]
    fn the_expected_isa_is_the_one_detected() {
        if let Ok(want) = std::env::var("GRIDLM_EXPECT_ISA") {
            let got = format!("{:?}", dot::detect());
            assert!(got.eq_ignore_ascii_case(&want), "GRIDLM_EXPECT_ISA={want}, but this CPU runs {got}");
        }
        if let Ok(want) = std::env::var("GRIDLM_EXPECT_INT8") {
            let got: Vec<&str> = dot::int8_kernels().iter().map(|k| k.name()).collect();
            assert_eq!(got.join(","), want, "GRIDLM_EXPECT_INT8={want}, but this CPU runs {got:?}");
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
            if isa != dot::Isa::Avx2 {
                assert_eq!(&out[..35], &x[..]);
            } else {
                // Each block of 16: even columns, then odd ones; the padded tail too.
                assert_eq!(
                    &out[..16],
                    &[0., 2., 4., 6., 8., 10., 12., 14., 1., 3., 5., 7., 9., 11., 13., 15.]
                );
                assert_eq!(
                    &out[16..32],
                    &[16., 18., 20., 22., 24., 26., 28., 30., 17., 19., 21., 23., 25., 27., 29., 31.]
                );
                assert_eq!(&out[32..40], &[32., 34., 0., 0., 0., 0., 0., 0.]);
                assert_eq!(&out[40..], &[33., 0., 0., 0., 0., 0., 0., 0.]);
            }
        }
    }

    /// On `Isa::Avx512Bf16`, inputs of bf16 weights are rounded bit for bit as
    /// `round_like_dot_bf16` (ties to even, subnormals to zero, NaN kept) for the many-token
    /// kernel.
    #[test]
    fn bf16_rounded_inputs() {
        if !isas().contains(&dot::Isa::Avx512Bf16) {
            return;
        }
        let mut x = rand_vec(48, 5);
        let tie = f32::from_bits(0x3f80_8000); // halfway between two bf16 values: to even (1.0)
        let odd_tie = f32::from_bits(0x3f81_8000); // halfway again: up, to even
        let specials = [tie, odd_tie, -tie, 1e-40, -1e-40, f32::NAN, f32::INFINITY, -0.0, 3.0e38];
        for (i, &v) in specials.iter().enumerate() {
            x[2 * i] = v;
            x[40 - i] = v;
        }
        assert_eq!(dot::round_like_dot_bf16(tie), 1.0);
        assert_eq!(dot::round_like_dot_bf16(odd_tie), f32::from_bits(0x3f82_0000));
        assert_eq!(dot::round_like_dot_bf16(-1e-40).to_bits(), (-0.0f32).to_bits());
        let mut rounded = vec![bf16::ZERO; 48];
        dot::round_for_dot_bf16(&x, &mut rounded, dot::Isa::Avx512Bf16);
        for (&v, r) in x.iter().zip(&rounded) {
            let want = dot::round_like_dot_bf16(v);
            assert!(r.to_f32().to_bits() == want.to_bits() || want.is_nan() && r.is_nan(), "{v} → {r}");
        }
    }

    /// One token's product equals, bit for bit, the same token's row of a many-token product,
    /// however many tokens share it and however wide the rows (every path sums a row in the
    /// same column blocks, each block's sum added in order), so a sequence gives the same
    /// tokens alone as in a batch or beside a prompt: on every path (portable, AVX2, 512-bit,
    /// AVX512_BF16; every int8 kernel).
    #[test]
    fn one_token_sums_equal_many_token_sums() {
        let team = Team::new(2).unwrap();
        let float = [DType::F32, DType::BF16, DType::F16].map(|d| (d, None));
        for (dtype, quant) in float.into_iter().chain([(DType::F32, Some(Quant::Int8))]) {
            // 4100 columns go in three column blocks (1376, 1376, 1360), or on AVX2 in five
            // (832 × 4, 784); 1536 on AVX2 in two.
            for &(rows, cols) in &[(9, 64), (130, 576), (64, 1536), (9, 1536), (9, 4100)] {
                let data = Data::F32(rand_vec(rows * cols, cols as u64)).cast(dtype);
                let w = PackedMat::pack_as(&Mat { rows, cols, data }, quant);
                // bf16 on AVX512_BF16 goes two panels at a time from 8 tokens (a batch's decode
                // step, in column blocks past 1376 columns) and from 16 (a prompt's); past one tile
                // (44 tokens at 1536 columns) by column blocks and tiles, in two sub-blocks
                // past 768 columns. 45 to 48 end on each size of token group. AVX2 sums three
                // tokens at a time, four left as two and two (4, 7, 16), and from 16 tokens on
                // takes each panel's block in f32 (16-bit ones widened) through one kernel
                // call for all the tile's groups; 120 tokens span two of its tiles (88 at 1536
                // columns, 80 at 4100), the second widened too, and three of the others' (44 at
                // 1536 columns). The 512-bit FMA kernels take a prompt's tokens six at a time,
                // seven left as five and two (19); 16 and 17 end on groups of four and five, 45
                // to 48 on groups of three to six; 120 tokens span two of their tiles (88 at 1536
                // columns, 96 at 4100, in runs of two panels there).
                for n_tok in [2, 3, 4, 5, 6, 7, 8, 15, 16, 17, 19, 45, 46, 47, 48, 120] {
                    let x = rand_vec(n_tok * cols, 3);
                    for path in paths(quant.is_some()) {
                        let mut many = vec![0.0f32; n_tok * rows];
                        on_path(path, || matmul(&team, &w, &x, n_tok, &mut many));
                        for t in 0..n_tok {
                            let mut one = vec![0.0f32; rows];
                            on_path(path, || matmul(&team, &w, &x[t * cols..(t + 1) * cols], 1, &mut one));
                            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                            let many = &many[t * rows..(t + 1) * rows];
                            assert_eq!(
                                bits(&one),
                                bits(many),
                                "{path:?} {dtype:?} {quant:?} {rows}x{cols} token {t} of {n_tok}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// A thread's first piece of a one-token product long enough for several streams
    /// ([`dot::STREAMS_FROM`]: three in AVX2, floats and int8) and its later, shorter
    /// ones in one give the sums the reference gives, and the same bits as the many-token
    /// kernels, on every path and weight type (the int8 path of AVX512-VNNI reads every piece
    /// in one, [`dot::ONE_STREAM`]). One thread takes the whole matrix in halves of what it
    /// has left: 1208 rows of 2048 columns make a first piece of 151 panels (50 groups of three
    /// and one alone), 1.2 MiB of int8 and twice or four times that of
    /// the 16- and 32-bit types, then pieces below 1 MiB.
    #[test]
    fn long_and_short_one_token_pieces_give_the_same_sums() {
        let _g = dot::FETCH_LOCK.lock().unwrap_or_else(|e| e.into_inner());
        let before = dot::streams();
        let team = Team::new(1).unwrap();
        let (rows, cols) = (1208, 2048);
        assert!(rows / 2 * cols >= dot::STREAMS_FROM && rows / 4 * cols < dot::STREAMS_FROM);
        let wf = rand_vec(rows * cols, 41);
        let float = [DType::F32, DType::BF16, DType::F16].map(|d| (d, None));
        for (dtype, quant) in float.into_iter().chain([(DType::F32, Some(Quant::Int8))]) {
            let data = Data::F32(wf.clone()).cast(dtype);
            let w = PackedMat::pack_as(&Mat { rows, cols, data: data.clone() }, quant);
            let x = rand_vec(2 * cols, 13);
            if quant.is_some() {
                let want = |x: &[f32]| int8_reference(&w, x, 1);
                assert_matmul_on_every_isa(&team, &w, &x[..cols], 1, &want, 1e-5, "int8");
            } else {
                let w64: Vec<f64> = data.to_f32_vec().iter().map(|&v| v as f64).collect();
                let want = |x: &[f32]| naive_matmul(&w64, rows, cols, x, 1);
                assert_matmul_on_every_isa(&team, &w, &x[..cols], 1, &want, 1e-6, &format!("{dtype:?}"));
            }
            // Under either way of choosing the pieces read in streams (every piece: each of
            // the pieces after the first too).
            for (path, streams) in
                paths(quant.is_some()).into_iter().flat_map(|p| dot::Streams::ALL.map(|s| (p, s)))
            {
                dot::set_streams(streams);
                let mut many = vec![0.0f32; 2 * rows];
                on_path(path, || matmul(&team, &w, &x, 2, &mut many));
                for t in 0..2 {
                    let mut one = vec![0.0f32; rows];
                    on_path(path, || matmul(&team, &w, &x[t * cols..(t + 1) * cols], 1, &mut one));
                    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(&one),
                        bits(&many[t * rows..(t + 1) * rows]),
                        "{path:?} {dtype:?} {quant:?} {streams:?} token {t}"
                    );
                }
            }
        }
        dot::set_streams(before);
    }

    /// A product of no tokens does nothing, on every path and weight type, from a team or
    /// inside a region (the batch kernels would otherwise index a last token that is not there).
    #[test]
    fn a_product_of_no_tokens_does_nothing() {
        let team = Team::new(2).unwrap();
        let float = [DType::F32, DType::BF16, DType::F16].map(|d| (d, None));
        for (dtype, quant) in float.into_iter().chain([(DType::F32, Some(Quant::Int8))]) {
            let data = Data::F32(rand_vec(9 * 64, 5)).cast(dtype);
            let w = PackedMat::pack_as(&Mat { rows: 9, cols: 64, data }, quant);
            for path in paths(quant.is_some()) {
                on_path(path, || {
                    matmul(&team, &w, &[], 0, &mut []);
                    team.region(&|r| matmul(r, &w, &[], 0, &mut []));
                });
            }
        }
    }

    /// A row's scores are the same bits however many rows share the call (1 to 9: every
    /// register blocking, the three-row `asm!` kernel among them, with and without a tail of
    /// eight keys or an odd head size), so a query's attention does not depend on the rest of
    /// its step, and whether or not the kernel asks ahead, for every key type.
    #[test]
    fn page_scores_of_a_row_do_not_depend_on_the_other_rows() {
        fn check<T: dot::Elem + dot::Avx2Load>() {
            for (page_len, hd) in [(16, 64), (24, 18), (48, 17)] {
                let kt: Vec<T> = rand_vec(hd * page_len, 4).into_iter().map(T::from_f32).collect();
                let q = rand_vec(9 * hd, 6);
                for isa in isas() {
                    let mut alone = vec![0.0f32; 9 * page_len];
                    for r in 0..9 {
                        let o = &mut alone[r * page_len..(r + 1) * page_len];
                        dot::page_scores(&kt, page_len, &q[r * hd..(r + 1) * hd], o, page_len, false, isa);
                    }
                    for rows in 1..=9 {
                        let mut s = vec![0.0f32; rows * page_len];
                        let ahead = rows % 2 == 1;
                        dot::page_scores(&kt, page_len, &q[..rows * hd], &mut s, page_len, ahead, isa);
                        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                        assert_eq!(
                            bits(&s),
                            bits(&alone[..rows * page_len]),
                            "{isa:?} {page_len}/{hd}: {rows} rows of {}",
                            std::any::type_name::<T>()
                        );
                    }
                }
            }
        }
        check::<f32>();
        check::<f16>();
        check::<bf16>();
    }

    /// Two pages scored in one call give the bits of two calls, on every path, for every
    /// number of rows (each register blocking) and head sizes with and without a tail.
    #[test]
    fn a_pair_of_pages_scores_as_two_calls() {
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        for isa in isas() {
            for (page_len, hd) in [(16, 64), (32, 64), (16, 24), (48, 136)] {
                let a: Vec<f16> = rand_vec(hd * page_len, 11).into_iter().map(f16::from_f32).collect();
                let b: Vec<f16> = rand_vec(hd * page_len, 12).into_iter().map(f16::from_f32).collect();
                for rows in 1..=9 {
                    let q = rand_vec(rows * hd, 13);
                    let stride = 2 * page_len + 16;
                    let mut two = vec![0.0f32; rows * stride];
                    dot::page_scores(&a, page_len, &q, &mut two, stride, false, isa);
                    dot::page_scores(&b, page_len, &q, &mut two[page_len..], stride, false, isa);
                    let mut pair = vec![0.0f32; rows * stride];
                    dot::page_scores_pair([&a, &b], page_len, &q, &mut pair, stride, isa);
                    assert_eq!(bits(&pair), bits(&two), "{isa:?} {page_len}/{hd}: {rows} rows");
                }
            }
        }
    }

    /// The AVX-512 page kernels give the AVX2 ones' sums bit for bit (every blocking and tail
    /// of both, asking ahead or not), so attention does not change with the SIMD width of the
    /// machine.
    #[test]
    fn page_kernels_agree_between_avx2_and_avx512() {
        fn check<T: dot::Elem + dot::Avx2Load>() {
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            for (page_len, hd, rows) in
                [(16, 64, 3), (32, 64, 2), (16, 24, 5), (48, 136, 1), (32, 200, 9), (48, 40, 3), (32, 18, 7)]
            {
                let kt: Vec<T> = rand_vec(hd * page_len, 7).into_iter().map(T::from_f32).collect();
                let q = rand_vec(rows * hd, 8);
                let p = rand_vec(rows * page_len, 9);
                let o0 = rand_vec(rows * hd, 10);
                let run = |isa, ahead| {
                    let mut s = vec![0.0f32; rows * page_len];
                    dot::page_scores(&kt, page_len, &q, &mut s, page_len, ahead, isa);
                    let mut o = o0.clone();
                    dot::page_values(&p, page_len, &kt, hd, &mut o, ahead, isa);
                    (bits(&s), bits(&o))
                };
                let want = run(dot::Isa::Avx2, false);
                for (isa, ahead) in
                    [(dot::Isa::Avx2, true), (dot::Isa::Avx512, false), (dot::Isa::Avx512, true)]
                {
                    let ty = std::any::type_name::<T>();
                    assert_eq!(run(isa, ahead), want, "{ty} {page_len}/{hd}/{rows}, {isa:?}, ahead {ahead}");
                }
            }
        }
        if !isas().contains(&dot::Isa::Avx512) {
            return;
        }
        check::<f32>();
        check::<f16>();
        check::<bf16>();
    }

    /// Page scores and page value sums against f64 sums, for every key type and on every
    /// SIMD path, with row counts and head sizes that reach every register blocking and tail.
    #[test]
    fn page_kernels_match_reference() {
        fn check<T: dot::Elem + dot::Avx2Load>() {
            for (isa, ahead) in isas().into_iter().flat_map(|isa| [(isa, false), (isa, true)]) {
                for (page_len, hd, rows) in [
                    (16, 64, 3),
                    (16, 17, 5),
                    (8, 40, 1),
                    (16, 128, 4),
                    (24, 8, 2),
                    (5, 9, 2),
                    (32, 64, 2),
                    (48, 24, 1),
                    (16, 136, 1),
                    (32, 200, 6),
                    (24, 18, 3),
                    (48, 40, 3),
                    (16, 17, 3),
                ] {
                    let kt: Vec<T> = rand_vec(hd * page_len, 1).into_iter().map(T::from_f32).collect();
                    let q = rand_vec(rows * hd, 2);
                    // Rows of scores `stride` apart; what lies between them is not written.
                    let stride = page_len + 3;
                    let mut s = vec![f32::NAN; (rows - 1) * stride + page_len];
                    dot::page_scores(&kt, page_len, &q, &mut s, stride, ahead, isa);
                    for r in 0..rows {
                        for j in 0..page_len {
                            let want: f64 = (0..hd)
                                .map(|d| q[r * hd + d] as f64 * kt[d * page_len + j].to_f32() as f64)
                                .sum();
                            let got = s[r * stride + j] as f64;
                            assert!(
                                (got - want).abs() < 1e-4,
                                "{isa:?} scores {page_len}/{hd}/{rows} [{r}][{j}]"
                            );
                        }
                        if r + 1 < rows {
                            assert!(s[r * stride + page_len..(r + 1) * stride].iter().all(|v| v.is_nan()));
                        }
                    }
                    // Values: rows of p `page_len` apart, only the first n used.
                    let n = page_len - 1;
                    let v: Vec<T> = rand_vec(n * hd, 3).into_iter().map(T::from_f32).collect();
                    let p = rand_vec(rows * page_len, 4);
                    let o0 = rand_vec(rows * hd, 5);
                    let mut o = o0.clone();
                    dot::page_values(&p, page_len, &v, hd, &mut o, ahead, isa);
                    for r in 0..rows {
                        for c in 0..hd {
                            let want = o0[r * hd + c] as f64
                                + (0..n)
                                    .map(|j| p[r * page_len + j] as f64 * v[j * hd + c].to_f32() as f64)
                                    .sum::<f64>();
                            let got = o[r * hd + c] as f64;
                            assert!(
                                (got - want).abs() < 1e-4,
                                "{isa:?} values {page_len}/{hd}/{rows} [{r}][{c}]"
                            );
                        }
                    }
                }
            }
        }
        check::<f32>();
        check::<f16>();
        check::<bf16>();
    }

    /// The vector exp (inside exp_sub_sum, softcap and act_mul, SiLU and GELU) and scale_max
    /// against f64, and scale_add bit for bit against its scalar formula, on every path, over
    /// lengths that leave every kind of tail.
    #[test]
    fn softmax_parts_and_activations_match_reference() {
        for isa in isas() {
            for n in [1, 7, 8, 16, 37] {
                let x: Vec<f32> = rand_vec(n, n as u64).iter().map(|v| v * 30.0).collect();
                // The fold's scale-and-add: each product rounded, then the sum, on every path.
                let (mut z, y) = (x.clone(), rand_vec(n, 99));
                dot::scale_add(&mut z, 0.3, &y, 1.7, isa);
                for ((z, x), y) in z.iter().zip(&x).zip(&y) {
                    assert_eq!(z.to_bits(), (x * 0.3 + y * 1.7).to_bits(), "{isa:?} scale_add n={n}");
                }
                let mut s = x.clone();
                let m = dot::scale_max(&mut s, 0.7, isa);
                let want_m = x.iter().map(|v| v * 0.7).fold(f32::NEG_INFINITY, f32::max);
                assert_eq!(m, want_m, "{isa:?} max n={n}");
                let sum = dot::exp_sub_sum(&mut s, m, isa);
                let mut want_sum = 0.0f64;
                for (g, v) in s.iter().zip(&x) {
                    // The argument as the kernel forms it in f32; the exp itself is checked.
                    let e = ((*v * 0.7 - m) as f64).exp();
                    want_sum += e;
                    assert!(
                        (*g as f64 - e).abs() <= 2e-7 * e.max(1e-30) + 1e-37,
                        "{isa:?} exp n={n}: {g} vs {e}"
                    );
                }
                assert!((sum as f64 - want_sum).abs() < 1e-5 * want_sum, "{isa:?} sum n={n}");
                // Soft caps: small scores (near tanh's linear part) and saturated ones.
                for cap in [5.0f32, 50.0] {
                    let mut c = x.clone();
                    dot::softcap(&mut c, 0.7, cap, isa);
                    for (got, v) in c.iter().zip(&x) {
                        let want = cap as f64 * (*v as f64 * 0.7 / cap as f64).tanh();
                        assert!(
                            (*got as f64 - want).abs() <= 4e-7 * cap as f64,
                            "{isa:?} softcap {cap} n={n}: {got} vs {want}"
                        );
                    }
                }
                let g0: Vec<f32> = x.iter().map(|v| v / 3.0).collect();
                let u = rand_vec(n, 7);
                for act in [Activation::Silu, Activation::GeluTanh, Activation::Gelu] {
                    let mut g = g0.clone();
                    dot::act_mul(&mut g, Some(&u), act, isa);
                    // Without an up: the same as with an up of ones, bit for bit.
                    let (mut alone, mut ones) = (g0.clone(), g0.clone());
                    dot::act_mul(&mut alone, None, act, isa);
                    dot::act_mul(&mut ones, Some(&vec![1.0; n]), act, isa);
                    assert_eq!(alone, ones, "{isa:?} {act:?} n={n}: without an up");
                    for i in 0..n {
                        let xv = g0[i] as f64;
                        let want = u[i] as f64
                            * match act {
                                Activation::Silu => xv / (1.0 + (-xv).exp()),
                                Activation::GeluTanh => {
                                    let c = (2.0 / std::f64::consts::PI).sqrt();
                                    0.5 * xv * (1.0 + (c * (xv + 0.044715 * xv.powi(3))).tanh())
                                }
                                Activation::Gelu => 0.5 * xv * libm::erfc(-xv / 2f64.sqrt()),
                            };
                        assert!(
                            (g[i] as f64 - want).abs() < 1e-6 * (1.0 + want.abs()),
                            "{isa:?} {act:?} n={n} i={i}: {} vs {want}",
                            g[i]
                        );
                    }
                }
            }
            // Far below the clamp: tiny but not NaN or negative.
            let mut s = vec![-200.0f32, 0.0];
            let sum = dot::exp_sub_sum(&mut s, 0.0, isa);
            assert!(s[0] >= 0.0 && s[0] < 1e-37 && (sum - 1.0).abs() < 1e-6, "{isa:?} underflow");
        }
    }

    /// GELU (HF's `gelu`, through erfc) against f64's erfc from −14 to 14 on every path,
    /// relative to each value: within 1e-6, and the rounding of exp's argument `−x²/2` in f32
    /// (~x²/2 · 2⁻²³); the tiny values of the negative side too, until they leave f32's normal
    /// numbers.
    #[test]
    fn gelu_matches_erf_over_its_range() {
        let x: Vec<f32> = (-2800..=2800).map(|i| i as f32 / 200.0).collect();
        for isa in isas() {
            let mut g = x.clone();
            dot::act_mul(&mut g, None, Activation::Gelu, isa);
            for (got, v) in g.iter().zip(&x) {
                let v = *v as f64;
                let want = 0.5 * v * libm::erfc(-v / 2f64.sqrt());
                let tol = 1e-6 + 1.2e-7 * v * v;
                let ok = (*got as f64 - want).abs() <= tol * want.abs() || want.abs() < 1e-36;
                assert!(ok, "{isa:?} gelu({v}): {got} vs {want}");
            }
        }
    }

    /// The softmax kernels (scale and max, exp and sum) give the same bits on every SIMD path,
    /// over lengths that leave every kind of tail, with scores near each other (many terms of
    /// a sum alike) and far apart.
    #[test]
    fn softmax_kernels_give_the_same_bits_on_every_simd_path() {
        let simd: Vec<_> = isas().into_iter().filter(|&i| i != dot::Isa::Portable).collect();
        let lengths = [1, 7, 8, 9, 15, 16, 17, 24, 31, 32, 33, 100, 128, 129];
        for (n, spread) in lengths.into_iter().flat_map(|n| [(n, 1.0), (n, 30.0)]) {
            let x: Vec<f32> = rand_vec(n, n as u64).iter().map(|v| v * spread).collect();
            let run = |isa| {
                let mut s = x.clone();
                let m = dot::scale_max(&mut s, 0.7, isa);
                let scaled = s.clone();
                let sum = dot::exp_sub_sum(&mut s, m, isa);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                (m.to_bits(), bits(&scaled), sum.to_bits(), bits(&s))
            };
            let first = simd.first().map(|&i| run(i));
            for &isa in &simd {
                assert!(Some(run(isa)) == first, "{isa:?} n={n} spread {spread}");
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
    fn layernorm_matches_reference() {
        for d in [1, 7, 64, 577] {
            // Values far from zero on average, so the mean matters.
            let x: Vec<f32> = rand_vec(2 * d, d as u64).iter().map(|v| v + 3.0).collect();
            let (w, b) = (rand_vec(d, 9), rand_vec(d, 10));
            let mut out = vec![0.0; 2 * d];
            layernorm(&x, &w, &b, 1e-5, &mut out);
            for t in 0..2 {
                let xr: Vec<f64> = x[t * d..(t + 1) * d].iter().map(|&v| v as f64).collect();
                let mean = xr.iter().sum::<f64>() / d as f64;
                let var = xr.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / d as f64;
                for i in 0..d {
                    let e = (xr[i] - mean) / (var + 1e-5).sqrt() * w[i] as f64 + b[i] as f64;
                    assert!((out[t * d + i] as f64 - e).abs() < 1e-4 * (1.0 + e.abs()), "d={d} {i}");
                }
            }
        }
    }

    #[test]
    fn rope_interleaved_rotates_neighbouring_pairs() {
        let hd = 6;
        let orig = rand_vec(2 * hd, 11);
        let angles = [0.3f64, 1.1];
        let cos: Vec<f32> = angles.iter().map(|a| a.cos() as f32).collect();
        let sin: Vec<f32> = angles.iter().map(|a| a.sin() as f32).collect();
        let mut x = orig.clone();
        rope_interleaved(&mut x, hd, &cos, &sin);
        for h in 0..2 {
            let (o, r) = (&orig[h * hd..(h + 1) * hd], &x[h * hd..(h + 1) * hd]);
            for (i, a) in angles.iter().enumerate() {
                let (x0, x1) = (o[2 * i] as f64, o[2 * i + 1] as f64);
                assert!((r[2 * i] as f64 - (x0 * a.cos() - x1 * a.sin())).abs() < 1e-6);
                assert!((r[2 * i + 1] as f64 - (x1 * a.cos() + x0 * a.sin())).abs() < 1e-6);
            }
            // The dimensions past the rotated part pass.
            assert_eq!(r[4..], o[4..]);
        }
    }

    #[test]
    fn rope_rotates_half_pairs() {
        let hd = 6;
        let orig = rand_vec(2 * hd, 11);
        let angles = [0.3f64, 1.1, -2.0];
        let cos: Vec<f32> = angles.iter().map(|a| a.cos() as f32).collect();
        let sin: Vec<f32> = angles.iter().map(|a| a.sin() as f32).collect();
        // Whole heads (three pairs), and a partial rotary part: the first four dimensions
        // rotate as two pairs, the rest pass.
        for pairs in [3, 2] {
            let mut x = orig.clone();
            rope(&mut x, hd, &cos[..pairs], &sin[..pairs]);
            for h in 0..2 {
                for i in 0..pairs {
                    let (a, b) = (orig[h * hd + i] as f64, orig[h * hd + i + pairs] as f64);
                    let (c, s) = (angles[i].cos(), angles[i].sin());
                    assert!((x[h * hd + i] as f64 - (a * c - b * s)).abs() < 1e-6);
                    assert!((x[h * hd + i + pairs] as f64 - (b * c + a * s)).abs() < 1e-6);
                }
                let rest = h * hd + 2 * pairs..(h + 1) * hd;
                assert_eq!(x[rest.clone()], orig[rest]);
            }
        }
    }

    /// Positions per page in the tiled-attention tests.
    const PAGE: usize = 16;

    /// Tiled attention over query rows with causal and windowed bounds, keys in pages out of
    /// order, scores soft-capped or not, equals softmax attention computed in f64 from the same
    /// (rounded) keys and values; each row alone, and the rows' tile states from three calls
    /// over disjoint tiles merged, give the same bits as the whole call.
    fn check_tiled<T: dot::Elem + dot::Avx2Load>() {
        for isa in isas() {
            let shapes = [
                (64, 300usize, 40, None),
                (16, 70, 5, Some(20)),
                (8, 3, 3, None),
                (64, 130, 1, None),
                (40, 50, 4, Some(30)),
                (17, 40, 7, None),
            ];
            // A cap of 0.3, about the scores' typical size here, bends them well away from linear.
            for ((hd, n_keys, rows, window), cap) in
                shapes.into_iter().flat_map(|s| [(s, None), (s, Some(0.3))])
            {
                // Whole pages, scattered in reverse order to check the page lookup.
                let pages = n_keys.div_ceil(PAGE);
                let k: Vec<T> = rand_vec(pages * PAGE * hd, 21).into_iter().map(T::from_f32).collect();
                let v: Vec<T> = rand_vec(pages * PAGE * hd, 22).into_iter().map(T::from_f32).collect();
                let at = |p: usize| (pages - 1 - p) * PAGE * hd..(pages - p) * PAGE * hd;
                // Key `pos`, dimension `d`, in row-major order; the cache keeps each page's
                // keys transposed.
                let key = |pos: usize, d: usize| k[at(pos / PAGE).start + (pos % PAGE) * hd + d];
                let mut kt = k.clone();
                for pos in 0..pages * PAGE {
                    for d in 0..hd {
                        kt[at(pos / PAGE).start + d * PAGE + pos % PAGE] = key(pos, d);
                    }
                }
                let value =
                    |pos: usize, d: usize| v[at(pos / PAGE).start + (pos % PAGE) * hd + d].to_f32() as f64;
                let page = |p: usize| (&kt[at(p)], &v[at(p)]);
                let q = rand_vec(rows * hd, 23);
                let scale = 1.0 / (hd as f32).sqrt();
                let scores = Scores { scale, cap };
                // Rows are the last `rows` positions of a prompt of n_keys tokens.
                let bounds: Vec<(usize, usize)> = (0..rows)
                    .map(|r| {
                        let pos = n_keys - rows + r;
                        (window.map_or(0, |w: usize| (pos + 1).saturating_sub(w)), pos)
                    })
                    .collect();
                let mut got = vec![f32::NAN; rows * hd];
                dot::with_isa(isa, || {
                    attend_tiled(&q, &bounds, PAGE, page, scores, AttendOut::Rows(&mut got), &|_, _| {})
                });
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                // Each row alone: the same bits as among the others.
                for (r, b) in bounds.iter().enumerate() {
                    let mut one = vec![f32::NAN; hd];
                    let qr = &q[r * hd..(r + 1) * hd];
                    dot::with_isa(isa, || {
                        attend_tiled(qr, &[*b], PAGE, page, scores, AttendOut::Rows(&mut one), &|_, _| {})
                    });
                    assert_eq!(bits(&one), bits(&got[r * hd..(r + 1) * hd]), "{isa:?} hd={hd} row {r} alone");
                }
                // The same rows in three parts over disjoint ranges of tiles (a part may hold
                // no keys of a row, or none at all), merged: the same bits as one call.
                let tiles = tile_of((n_keys - 1) / PAGE) + 1;
                let cuts = [0, tiles / 3, 2 * tiles / 3, tiles];
                let (mut acc, mut st) = (vec![f32::NAN; rows * tiles * hd], vec![f32::NAN; rows * tiles * 2]);
                for w in cuts.windows(2) {
                    let (ka, kb) =
                        (tile_pages(w[0]).start * PAGE, (tile_pages(w[1]).start * PAGE).min(n_keys));
                    let clipped: Vec<(usize, usize)> = bounds
                        .iter()
                        .map(|&(f, l)| if ka >= kb { (1, 0) } else { (f.max(ka), l.min(kb - 1)) })
                        .collect();
                    let mut emit = |r: usize, t: usize, m: f32, l: f32, a: &[f32]| {
                        acc[(r * tiles + t) * hd..][..hd].copy_from_slice(a);
                        st[(r * tiles + t) * 2..][..2].copy_from_slice(&[m, l]);
                    };
                    let out = AttendOut::Tiles { tiles: w[0]..w[1], emit: &mut emit };
                    dot::with_isa(isa, || attend_tiled(&q, &clipped, PAGE, page, scores, out, &|_, _| {}));
                }
                let mut merged = vec![f32::NAN; rows * hd];
                // The merge takes its exp from the same kernels as the call.
                dot::with_isa(isa, || {
                    for (r, o) in merged.chunks_exact_mut(hd).enumerate() {
                        merge_tiles(
                            &acc[r * tiles * hd..(r + 1) * tiles * hd],
                            &st[r * tiles * 2..(r + 1) * tiles * 2],
                            o,
                        );
                    }
                });
                let differ = bits(&merged).iter().zip(bits(&got)).filter(|(a, b)| **a != *b).count();
                assert_eq!(differ, 0, "{isa:?} hd={hd}: merged tiles against one call, values that differ");
                for (r, &(first, last)) in bounds.iter().enumerate() {
                    let s: Vec<f64> = (first..=last)
                        .map(|pos| {
                            let dot: f64 =
                                (0..hd).map(|d| q[r * hd + d] as f64 * key(pos, d).to_f32() as f64).sum();
                            let s = dot * scale as f64;
                            cap.map_or(s, |c| c as f64 * (s / c as f64).tanh())
                        })
                        .collect();
                    let m = s.iter().cloned().fold(f64::MIN, f64::max);
                    let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
                    let z: f64 = e.iter().sum();
                    for d in 0..hd {
                        let want: f64 = (first..=last).zip(&e).map(|(pos, w)| w / z * value(pos, d)).sum();
                        let g = got[r * hd + d] as f64;
                        assert!((g - want).abs() < 1e-5, "{isa:?} hd={hd} row {r} col {d}: {g} vs {want}");
                    }
                }
            }
        }
    }

    /// The attention tiles cover the pages in order, without gaps: small ones first.
    #[test]
    fn attention_tiles_cover_the_pages() {
        let mut next = 0;
        for t in 0..12 {
            let pages = tile_pages(t);
            assert_eq!(pages.start, next, "tile {t}");
            assert_eq!(pages.len(), if pages.start < TILE_PAGES { SMALL_TILE_PAGES } else { TILE_PAGES });
            assert!(pages.clone().all(|p| tile_of(p) == t), "tile {t}");
            next = pages.end;
        }
    }

    /// A page continues the one before only where its keys and its values both follow on.
    #[test]
    fn a_page_continues_only_where_keys_and_values_follow_on() {
        let (k, v) = (vec![0u16; 64], vec![0u16; 64]);
        let page = |p: usize, q: usize| (&k[p * 16..p * 16 + 16], &v[q * 16..q * 16 + 16]);
        assert!(runs_to(page(0, 0), page(1, 1), 1));
        assert!(runs_to(page(1, 2), page(2, 3), 1));
        assert!(!runs_to(page(0, 0), page(2, 1), 1), "keys jump");
        assert!(!runs_to(page(0, 0), page(1, 2), 1), "values jump");
        assert!(!runs_to(page(1, 1), page(0, 0), 1), "backwards");
    }

    #[test]
    fn tiled_attention_matches_reference() {
        check_tiled::<f32>();
        check_tiled::<f16>();
        check_tiled::<bf16>();
    }

    #[test]
    fn silu_and_argmax() {
        let mut g = vec![-2.0f32, 0.0, 3.0];
        act_mul(&mut g, &[1.0, 5.0, 2.0], Activation::Silu);
        for (got, x, u) in [(g[0], -2.0f64, 1.0), (g[1], 0.0, 5.0), (g[2], 3.0, 2.0)] {
            assert!((got as f64 - x / (1.0 + (-x).exp()) * u).abs() < 1e-6);
        }
        assert_eq!(argmax(&[1.0, 3.0, 3.0, f32::NAN, -1.0]), (1, 3.0));
    }

    /// The two-pass argmax against the one-pass loop it replaced, on lengths around its lane
    /// and block sizes, with ties (values rounded to a few levels), NaN, infinities and zeros
    /// of both signs.
    #[test]
    fn argmax_is_the_first_largest() {
        let one_pass = |x: &[f32]| {
            let mut best = (0, f32::NEG_INFINITY);
            for (i, &v) in x.iter().enumerate() {
                if v > best.1 {
                    best = (i, v);
                }
            }
            best
        };
        let specials = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 0.0, -0.0];
        for (seed, n) in [0, 1, 15, 16, 17, 255, 256, 257, 1000, 49152].into_iter().enumerate() {
            for levels in [0.0f32, 3.0, 1000.0] {
                let mut x: Vec<f32> = rand_vec(n, seed as u64)
                    .into_iter()
                    .map(|v| if levels > 0.0 { (v * levels).round() } else { v })
                    .collect();
                // Every 7th element replaced by a special value, cycling through them.
                for (k, v) in x.iter_mut().step_by(7).enumerate() {
                    if (k + seed) % 3 == 0 {
                        *v = specials[k % specials.len()];
                    }
                }
                let (i, v) = argmax(&x);
                let (j, w) = one_pass(&x);
                assert_eq!((i, v == w), (j, true), "n {n}, levels {levels}: {v} at {i}, want {w} at {j}");
            }
        }
        assert_eq!(argmax(&[f32::NAN; 40]), (0, f32::NEG_INFINITY));
        assert_eq!(argmax(&[f32::NEG_INFINITY; 3]), (0, f32::NEG_INFINITY));
        assert_eq!(argmax(&[-0.0, 0.0, -1.0]).0, 0);
        let mut late = vec![-5.0f32; 3000];
        late[2999] = -4.0;
        assert_eq!(argmax(&late), (2999, -4.0));
    }
}
