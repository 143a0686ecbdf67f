//! Per-rank KV cache in pages: one pool for all sequences, sized for this rank's layers and KV
//! heads only. A page holds [`PAGE`] consecutive positions of one sequence; a sequence's page
//! table (chosen by the driver's allocator, the same on every rank) lists its pages in position
//! order. Layout per layer `[kv_head][page]` (a head's pages side by side, so a sequence whose
//! pages are consecutive is read as one stream), each block one head's page: keys transposed
//! (`[head_dim][PAGE]`, the page's keys side by side per dimension) and values as rows
//! (`[PAGE][head_dim]`), the order [`kernels::attend_tiled`] reads them in. Stored in f16 by
//! default (half the memory and half the bytes attention reads per token), or in f32 / bf16;
//! values are rounded once, when written.

use crate::kernels::{self, dot::Elem};
use crate::weights::DType;
use half::{bf16, f16};

/// Positions per page.
pub const PAGE: usize = 16;

/// Elements of a key converted at a time when it is written (a whole head's in the models
/// gridlm runs).
const PUT_PIECE: usize = 256;

/// One dtype's keys and values, per layer. The buffers are only ever reached through `k` and
/// `v`, pointers taken when they were made: a step writes one KV head's slot of a page on one
/// kernel thread while others read other heads' pages, which references to whole buffers
/// would not allow.
///
/// Keys and values are each one mapping asking for huge pages, as the weights are
/// ([`kernels::arena`]): a decode step reads every KV head's pages of every layer, and in 4 KiB
/// pages under a hypervisor each one it reaches costs a long address-translation walk. On the
/// 2-core Zen 4 machine (SmolLM2, batch 1, steps taken from the two ways in turn within a run)
/// steps took 2.2–4.4% less time at 2000–2128 positions (six alternations, the cores together)
/// and 0.2–1.4% less at 64–192 (eleven of twelve, in either placement of the cores).
struct Store<T> {
    _buffers: [kernels::arena::HugeBuf<T>; 2],
    k: Vec<*mut T>,
    v: Vec<*mut T>,
    per_layer: usize,
}

// SAFETY: the pointers are into buffers the store owns; who may write what, when, is stated at
// each writing method (`put` and `KvPool::write_head`).
unsafe impl<T: Send> Send for Store<T> {}
unsafe impl<T: Sync> Sync for Store<T> {}

impl<T> Store<T> {
    /// `len` elements of `layer` in `bufs` (`self.k` or `self.v`) from `at`, as a raw slice: no
    /// reference is made, so another thread may be writing them (enough for prefetching).
    fn span(&self, bufs: &[*mut T], layer: usize, at: usize, len: usize) -> *const [T] {
        assert!(at + len <= self.per_layer, "KV range past its layer");
        std::ptr::slice_from_raw_parts(bufs[layer].wrapping_add(at).cast_const(), len)
    }

    /// `len` keys and `len` values of `layer` from `at` (one KV head's block of a page), to
    /// read.
    fn page_block(&self, layer: usize, at: usize, len: usize) -> (&[T], &[T]) {
        // SAFETY: in bounds (`span`); no write overlaps a range while it is read (see `put`).
        unsafe { (&*self.span(&self.k, layer, at, len), &*self.span(&self.v, layer, at, len)) }
    }
}

impl<T: Elem + Default + bytemuck::Zeroable + Send + Copy> Store<T> {
    fn new(n_layers: usize, per_layer: usize) -> Self {
        let mut buffers = [(); 2].map(|_| {
            let mut b = kernels::arena::HugeBuf::<T>::alone(n_layers * per_layer);
            // Written once now (it reads as zeros already), so that its pages are in place
            // before the first step rather than faulted in by one; by as many threads as the
            // process may run on, as the kernel clears each page as it is first written (1.5 GB
            // took 3.0 s on one thread of the 2-core test machine).
            let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
            let part = b.len().div_ceil(threads).max(1);
            std::thread::scope(|s| {
                for chunk in b.chunks_mut(part) {
                    s.spawn(move || chunk.fill(T::default()));
                }
            });
            b
        });
        let [k, v] = buffers.each_mut().map(|b| {
            let base = b.as_mut_ptr();
            (0..n_layers).map(|l| base.wrapping_add(l * per_layer)).collect()
        });
        Store { _buffers: buffers, k, v, per_layer }
    }

    /// Writes slot `slot` of KV head blocks (`start(h)` is where head `h`'s block of this
    /// page begins) from `k` and `v` (`heads.len() × hd` each): the key into column `slot` of
    /// the transposed key block, the value into row `slot` of the value block.
    ///
    /// # Safety
    /// No other thread may read or write those heads' blocks of this page meanwhile.
    #[allow(clippy::too_many_arguments)] // one position: where, its shape, and its two vectors
    unsafe fn put(
        &self,
        layer: usize,
        start: impl Fn(usize) -> usize,
        slot: usize,
        hd: usize,
        heads: std::ops::Range<usize>,
        k: &[f32],
        v: &[f32],
    ) {
        assert!(k.len() == heads.len() * hd && v.len() == k.len(), "KV write of the wrong length");
        // The key is converted here, then written down its column; the value straight into
        // its row. (Converted one by one, an f16 KV cache took a call per value.)
        let mut key = [T::default(); PUT_PIECE];
        for (i, h) in heads.enumerate() {
            let a = start(h);
            assert!(a + PAGE * hd <= self.per_layer, "KV block past its layer");
            let (kb, vr) = (self.k[layer].add(a), self.v[layer].add(a + slot * hd));
            for d0 in (0..hd).step_by(PUT_PIECE) {
                let n = PUT_PIECE.min(hd - d0);
                let src = i * hd + d0..i * hd + d0 + n;
                T::from_f32_slice(&k[src.clone()], &mut key[..n]);
                for (d, &x) in key[..n].iter().enumerate() {
                    kb.add((d0 + d) * PAGE + slot).write(x);
                }
                // SAFETY (of the slice): this head's row `slot` of the page, in bounds (the
                // assert above), and no other thread reads or writes it meanwhile (the caller).
                T::from_f32_slice(&v[src], std::slice::from_raw_parts_mut(vr.add(d0), n));
            }
        }
    }
}

/// Where KV head `kv`'s block of pool page `page` begins in a layer's store, in a pool of
/// `pages` pages of heads `hd` wide (the layout in the module's doc).
fn block(pages: usize, hd: usize, kv: usize, page: usize) -> usize {
    (kv * pages + page) * PAGE * hd
}

enum Data {
    F32(Store<f32>),
    F16(Store<f16>),
    BF16(Store<bf16>),
}

/// A rank's KV cache: the pool of pages the driver hands out (its page tables), and, where it
/// takes less memory, rings for the layers that attend through a window (Gemma 2 and 3's local
/// layers, Mistral's and Phi-3's windows). A slot's ring is `ring_pages` pages of its own,
/// logical page `p` of its sequence kept in ring page `p % ring_pages`, so position `pos` in
/// slot `pos % (ring_pages × PAGE)`. A step's attention reads, of a sequence, the window before
/// each of its at most `chunk` positions: `window - 1 + chunk` positions in a row, as many
/// slots, which `ceil((window - 1 + chunk) / PAGE)` pages hold; one page more keeps the pages
/// themselves apart (a range that starts mid-page spans one more), so no kernel thread reads a
/// page another writes into. A windowed layer holds a window and a step of each sequence
/// rather than its whole length.
pub struct KvCache {
    /// The pages in the driver's tables, for the layers not in a ring.
    pub pool: KvPool,
    /// Every slot's ring, one after the other, for the windowed layers.
    pub ring: KvPool,
    /// Pages of a slot's ring (0: no ring).
    ring_pages: usize,
    /// Each layer of the shard: whether it keeps its keys in the ring, and its index there or
    /// in the pool.
    place: Vec<(bool, usize)>,
}

impl KvCache {
    /// A cache for layers attending through `windows` (one a layer, `None`: all positions) of
    /// `n_kv` KV heads, `pages` pages in the pool and `slots` sequences of at most `chunk`
    /// positions a step. The windowed layers take rings only where these hold fewer pages than
    /// the pool would give them.
    pub fn new(
        windows: &[Option<usize>],
        n_kv: usize,
        head_dim: usize,
        (pages, slots, chunk): (usize, usize, usize),
        dtype: DType,
    ) -> Self {
        let widest = windows.iter().flatten().max();
        let ring_pages = widest.map_or(0, |w| (w.saturating_sub(1) + chunk.max(1)).div_ceil(PAGE) + 1);
        let ring_pages = if ring_pages > 0 && slots * ring_pages < pages { ring_pages } else { 0 };
        let (mut in_pool, mut in_ring) = (0, 0);
        let place = windows
            .iter()
            .map(|w| {
                let ringed = ring_pages > 0 && w.is_some();
                let n = if ringed { &mut in_ring } else { &mut in_pool };
                *n += 1;
                (ringed, *n - 1)
            })
            .collect();
        KvCache {
            pool: KvPool::new(in_pool, n_kv, head_dim, pages, dtype),
            ring: KvPool::new(in_ring, n_kv, head_dim, slots * ring_pages, dtype),
            ring_pages,
            place,
        }
    }

    /// The pool, the ring and each layer's place, borrowed apart (a step writes the stores
    /// while it reads the places).
    pub fn parts(&mut self) -> (&mut KvPool, &mut KvPool, &[(bool, usize)]) {
        (&mut self.pool, &mut self.ring, &self.place)
    }

    /// Pages of a slot's ring (0: the windowed layers keep theirs in the pool).
    pub fn ring_pages(&self) -> usize {
        self.ring_pages
    }

    /// Into `out`, the ring pages of slot `slot` for a sequence of `pages` pages, in position
    /// order (empty without rings).
    pub fn ring_table(&self, slot: usize, pages: usize, out: &mut Vec<u32>) {
        out.clear();
        if self.ring_pages > 0 {
            let r = self.ring_pages;
            out.extend((0..pages).map(|p| (slot * r + p % r) as u32));
        }
    }
}

pub struct KvPool {
    n_kv: usize,
    head_dim: usize,
    pages: usize,
    data: Data,
}

impl KvPool {
    /// A pool of `pages` pages for `n_layers` layers of `n_kv` KV heads. Memory is reserved but
    /// not touched until written.
    pub fn new(n_layers: usize, n_kv: usize, head_dim: usize, pages: usize, dtype: DType) -> Self {
        let per_layer = pages * n_kv * PAGE * head_dim;
        let data = match dtype {
            DType::F32 => Data::F32(Store::new(n_layers, per_layer)),
            DType::F16 => Data::F16(Store::new(n_layers, per_layer)),
            DType::BF16 => Data::BF16(Store::new(n_layers, per_layer)),
        };
        KvPool { n_kv, head_dim, pages, data }
    }

    /// Bytes one page takes on a rank with these layers and KV heads (keys and values).
    pub fn page_bytes(n_layers: usize, n_kv: usize, head_dim: usize, dtype: DType) -> usize {
        2 * n_layers * n_kv * PAGE * head_dim * dtype.size_bytes()
    }

    pub fn pages(&self) -> usize {
        self.pages
    }

    pub fn dtype(&self) -> DType {
        match self.data {
            Data::F32(_) => DType::F32,
            Data::F16(_) => DType::F16,
            Data::BF16(_) => DType::BF16,
        }
    }

    /// Stores keys and values (`n_kv × head_dim` each) of position `pos` of the sequence whose
    /// pages are `table`, for `layer`.
    pub fn write(&mut self, layer: usize, table: &[u32], pos: usize, k: &[f32], v: &[f32]) {
        // SAFETY: `&mut self`: nothing else reads or writes the pool.
        unsafe { self.write_heads(layer, table, pos, 0..self.n_kv, k, v) }
    }

    /// As [`KvPool::write`] for local KV head `head` alone (`k` and `v` `head_dim` long),
    /// through a shared reference: a step's attention item writes its own head's new position
    /// while other items read.
    ///
    /// # Safety
    /// No other thread may read or write this head's block of the page holding `pos` meanwhile.
    #[allow(clippy::too_many_arguments)] // as `write`, and the head
    pub unsafe fn write_head(
        &self,
        layer: usize,
        table: &[u32],
        pos: usize,
        head: usize,
        k: &[f32],
        v: &[f32],
    ) {
        assert!(head < self.n_kv, "KV head {head} of {}", self.n_kv);
        self.write_heads(layer, table, pos, head..head + 1, k, v)
    }

    /// # Safety
    /// As [`KvPool::write_head`], for each of `heads`.
    unsafe fn write_heads(
        &self,
        layer: usize,
        table: &[u32],
        pos: usize,
        heads: std::ops::Range<usize>,
        k: &[f32],
        v: &[f32],
    ) {
        let page = *table
            .get(pos / PAGE)
            .unwrap_or_else(|| panic!("KV position {pos} is past the sequence's {} pages", table.len()))
            as usize;
        assert!(page < self.pages, "KV page {page} outside a pool of {}", self.pages);
        let (hd, pages) = (self.head_dim, self.pages);
        let start = |h: usize| block(pages, hd, h, page);
        let slot = pos % PAGE;
        match &self.data {
            Data::F32(s) => s.put(layer, start, slot, hd, heads, k, v),
            Data::F16(s) => s.put(layer, start, slot, hd, heads, k, v),
            Data::BF16(s) => s.put(layer, start, slot, hd, heads, k, v),
        }
    }

    /// Asks for the cache lines that writing position `pos` of `layer` will touch (every line
    /// of the keys' transposed blocks, and the values' rows), so the write that follows a
    /// matrix product finds them in cache instead of waiting on memory for each.
    pub fn prefetch_write(&self, layer: usize, table: &[u32], pos: usize) {
        self.prefetch_write_heads(layer, table, pos, 0..self.n_kv)
    }

    /// As [`KvPool::prefetch_write`], for the lines of local KV heads `heads` alone.
    pub fn prefetch_write_heads(
        &self,
        layer: usize,
        table: &[u32],
        pos: usize,
        heads: std::ops::Range<usize>,
    ) {
        let Some(page) = table.get(pos / PAGE).map(|&p| p as usize).filter(|&p| p < self.pages) else {
            return;
        };
        let (hd, slot) = (self.head_dim, pos % PAGE);
        fn lines<T>(s: &Store<T>, layer: usize, a: usize, slot: usize, hd: usize) {
            kernels::dot::prefetch(s.span(&s.k, layer, a, PAGE * hd));
            kernels::dot::prefetch(s.span(&s.v, layer, a + slot * hd, hd));
        }
        for h in heads.start..heads.end.min(self.n_kv) {
            let a = block(self.pages, hd, h, page);
            match &self.data {
                Data::F32(s) => lines(s, layer, a, slot, hd),
                Data::F16(s) => lines(s, layer, a, slot, hd),
                Data::BF16(s) => lines(s, layer, a, slot, hd),
            }
        }
    }

    /// Asks, into L2, for share `part` of `parts` of the cache lines of the pages that an
    /// attention of local KV head `kv` of `layer` over positions `first ..= last` reads (keys
    /// and values; the lines of the pages one after another, cut in `parts` even shares). A
    /// caller asks for all of them at once (`parts` = 1) or spreads the requests over the work
    /// before it (see `Shard::forward`).
    #[allow(clippy::too_many_arguments)] // which cache (layer, head, sequence), which positions, which share
    pub fn prefetch_read(
        &self,
        layer: usize,
        kv: usize,
        table: &[u32],
        (first, last): (usize, usize),
        part: usize,
        parts: usize,
    ) {
        fn lines<T>(s: &Store<T>, layer: usize, a: usize, len: usize, lines: std::ops::Range<usize>) {
            kernels::dot::prefetch_l2(s.span(&s.k, layer, a, len), lines.clone());
            kernels::dot::prefetch_l2(s.span(&s.v, layer, a, len), lines);
        }
        if part >= parts || first > last {
            return;
        }
        let (hd, pages) = (self.head_dim, self.pages);
        let per_page = (PAGE * hd * self.dtype().size_bytes()).div_ceil(64);
        let (p0, p1) = (first / PAGE, last / PAGE + 1);
        let n = (p1 - p0) * per_page;
        let share = part * n / parts..(part + 1) * n / parts;
        for p in p0 + share.start / per_page..(p0 + share.end.div_ceil(per_page)).min(p1) {
            let Some(page) = table.get(p).map(|&p| p as usize).filter(|&p| p < pages) else {
                return;
            };
            // The share's lines within this page's block.
            let at = (p - p0) * per_page;
            let mine = share.start.max(at) - at..share.end.min(at + per_page) - at;
            let a = block(pages, hd, kv, page);
            match &self.data {
                Data::F32(s) => lines(s, layer, a, PAGE * hd, mine),
                Data::F16(s) => lines(s, layer, a, PAGE * hd, mine),
                Data::BF16(s) => lines(s, layer, a, PAGE * hd, mine),
            }
        }
    }

    /// Attention of query rows `q` (`[rows, head_dim]`) over local KV head `kv` of `layer` of
    /// the sequence whose pages are `table`, row `r` seeing positions
    /// `bounds[r].0 ..= bounds[r].1`, into `out`: the rows, or their states over some of the
    /// attention tiles (one part of their keys), calling `ahead` at each page visit. See
    /// [`kernels::attend_tiled`].
    #[allow(clippy::too_many_arguments)] // which cache (layer, head, sequence), the queries and the output
    pub fn attend(
        &self,
        layer: usize,
        kv: usize,
        table: &[u32],
        q: &[f32],
        bounds: &[(usize, usize)],
        scores: kernels::Scores,
        out: kernels::AttendOut,
        ahead: kernels::Ahead,
    ) {
        let (hd, pages) = (self.head_dim, self.pages);
        let len = PAGE * hd;
        let at = |p: usize| block(pages, hd, kv, table[p] as usize);
        // One call for each dtype of the pool (`attend_tiled` is generic over it).
        macro_rules! attend {
            ($s:expr) => {
                kernels::attend_tiled(
                    q,
                    bounds,
                    PAGE,
                    |p| $s.page_block(layer, at(p), len),
                    scores,
                    out,
                    ahead,
                )
            };
        }
        match &self.data {
            Data::F32(s) => attend!(s),
            Data::F16(s) => attend!(s),
            Data::BF16(s) => attend!(s),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A written position reads back as each value rounded alone, its key down its column of
    /// the transposed block and its value along its row, for every dtype and for heads wider
    /// than one piece of conversion.
    #[test]
    fn written_keys_and_values_read_back_rounded() {
        fn check<T: Elem + Default + PartialEq + std::fmt::Debug>(
            s: &Store<T>,
            at: usize,
            slot: usize,
            hd: usize,
            k: &[f32],
            v: &[f32],
        ) {
            let (kb, vb) = s.page_block(0, at, PAGE * hd);
            for d in 0..hd {
                assert_eq!(kb[d * PAGE + slot], T::from_f32(k[d]), "key dim {d}");
                assert_eq!(vb[slot * hd + d], T::from_f32(v[d]), "value dim {d}");
            }
        }
        for hd in [64, PUT_PIECE + 44] {
            for dtype in [DType::F32, DType::F16, DType::BF16] {
                let (n_kv, pages) = (2, 3);
                let mut pool = KvPool::new(1, n_kv, hd, pages, dtype);
                let table = [2u32, 0];
                let k: Vec<f32> = (0..n_kv * hd).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
                let v: Vec<f32> = (0..n_kv * hd).map(|i| (i as f32 * 0.11).cos() / 7.0).collect();
                let pos = PAGE + 5;
                pool.write(0, &table, pos, &k, &v);
                for h in 0..n_kv {
                    let at = block(pages, hd, h, table[1] as usize);
                    let (k, v) = (&k[h * hd..(h + 1) * hd], &v[h * hd..(h + 1) * hd]);
                    match &pool.data {
                        Data::F32(s) => check(s, at, 5, hd, k, v),
                        Data::F16(s) => check(s, at, 5, hd, k, v),
                        Data::BF16(s) => check(s, at, 5, hd, k, v),
                    }
                }
            }
        }
    }
}
