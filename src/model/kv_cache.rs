//! Per-rank KV cache: for each of this rank's layers and KV heads, keys and values of every
//! position, `[layer][kv_head][position][head_dim]` so one head's history is contiguous.
//! Stored in f16 by default (half the memory and half the bytes attention reads per token),
//! or in f32 / bf16; values are rounded once, when written.

use crate::kernels::{self, dot::Elem};
use crate::weights::DType;
use half::{bf16, f16};

struct Store<T> {
    k: Vec<Vec<T>>,
    v: Vec<Vec<T>>,
}

impl<T: Elem + Default> Store<T> {
    fn new(n_layers: usize, per_layer: usize) -> Self {
        Store {
            k: (0..n_layers).map(|_| vec![T::default(); per_layer]).collect(),
            v: (0..n_layers).map(|_| vec![T::default(); per_layer]).collect(),
        }
    }
    fn elems(&self) -> usize {
        self.k.iter().chain(&self.v).map(Vec::len).sum()
    }
}

enum Data {
    F32(Store<f32>),
    F16(Store<f16>),
    BF16(Store<bf16>),
}

pub struct KvCache {
    n_kv: usize,
    head_dim: usize,
    capacity: usize,
    len: usize,
    data: Data,
}

impl KvCache {
    pub fn new(n_layers: usize, n_kv: usize, head_dim: usize, capacity: usize, dtype: DType) -> Self {
        let per_layer = n_kv * capacity * head_dim;
        let data = match dtype {
            DType::F32 => Data::F32(Store::new(n_layers, per_layer)),
            DType::F16 => Data::F16(Store::new(n_layers, per_layer)),
            DType::BF16 => Data::BF16(Store::new(n_layers, per_layer)),
        };
        KvCache { n_kv, head_dim, capacity, len: 0, data }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn set_len(&mut self, len: usize) {
        self.len = len;
    }
    pub fn dtype(&self) -> DType {
        match self.data {
            Data::F32(_) => DType::F32,
            Data::F16(_) => DType::F16,
            Data::BF16(_) => DType::BF16,
        }
    }
    pub fn bytes(&self) -> usize {
        let elems = match &self.data {
            Data::F32(s) => s.elems(),
            Data::F16(s) => s.elems(),
            Data::BF16(s) => s.elems(),
        };
        elems * self.dtype().size_bytes()
    }

    /// Stores keys and values (`n_kv × head_dim` each) of `pos` for `layer`.
    pub fn write(&mut self, layer: usize, pos: usize, k: &[f32], v: &[f32]) {
        assert!(pos < self.capacity, "KV cache overflow: position {pos} >= capacity {}", self.capacity);
        let (hd, cap, n_kv) = (self.head_dim, self.capacity, self.n_kv);
        fn put<T: Elem>(
            s: &mut Store<T>,
            layer: usize,
            at: impl Fn(usize) -> usize,
            hd: usize,
            n_kv: usize,
            k: &[f32],
            v: &[f32],
        ) {
            for h in 0..n_kv {
                let a = at(h);
                let src = h * hd..(h + 1) * hd;
                s.k[layer][a..a + hd].iter_mut().zip(&k[src.clone()]).for_each(|(d, &x)| *d = T::from_f32(x));
                s.v[layer][a..a + hd].iter_mut().zip(&v[src]).for_each(|(d, &x)| *d = T::from_f32(x));
            }
        }
        let at = |h: usize| (h * cap + pos) * hd;
        match &mut self.data {
            Data::F32(s) => put(s, layer, at, hd, n_kv, k, v),
            Data::F16(s) => put(s, layer, at, hd, n_kv, k, v),
            Data::BF16(s) => put(s, layer, at, hd, n_kv, k, v),
        }
    }

    /// Attention of query rows `q` (`[rows, head_dim]`) over local KV head `kv` of `layer`,
    /// row `r` seeing positions `bounds[r].0 ..= bounds[r].1`; see [`kernels::attend_tiled`].
    pub fn attend(
        &self,
        layer: usize,
        kv: usize,
        q: &[f32],
        bounds: &[(usize, usize)],
        scale: f32,
        out: &mut [f32],
    ) {
        let span = self.capacity * self.head_dim;
        let range = kv * span..(kv + 1) * span;
        match &self.data {
            Data::F32(s) => {
                kernels::attend_tiled(q, bounds, &s.k[layer][range.clone()], &s.v[layer][range], scale, out)
            }
            Data::F16(s) => {
                kernels::attend_tiled(q, bounds, &s.k[layer][range.clone()], &s.v[layer][range], scale, out)
            }
            Data::BF16(s) => {
                kernels::attend_tiled(q, bounds, &s.k[layer][range.clone()], &s.v[layer][range], scale, out)
            }
        }
    }
}
