//! Per-rank KV cache: for each of this rank's layers and KV heads, keys and values of every
//! position, `[layer][kv_head][position][head_dim]` so one head's history is contiguous.

pub struct KvCache {
    n_kv: usize,
    head_dim: usize,
    capacity: usize,
    len: usize,
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}

impl KvCache {
    pub fn new(n_layers: usize, n_kv: usize, head_dim: usize, capacity: usize) -> Self {
        let per_layer = n_kv * capacity * head_dim;
        KvCache {
            n_kv,
            head_dim,
            capacity,
            len: 0,
            k: (0..n_layers).map(|_| vec![0.0; per_layer]).collect(),
            v: (0..n_layers).map(|_| vec![0.0; per_layer]).collect(),
        }
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
    pub fn bytes(&self) -> usize {
        4 * (self.k.iter().map(Vec::len).sum::<usize>() + self.v.iter().map(Vec::len).sum::<usize>())
    }

    /// Stores keys and values (`n_kv × head_dim` each) of `pos` for `layer`.
    pub fn write(&mut self, layer: usize, pos: usize, k: &[f32], v: &[f32]) {
        assert!(pos < self.capacity, "KV cache overflow: position {pos} >= capacity {}", self.capacity);
        let hd = self.head_dim;
        for h in 0..self.n_kv {
            let at = (h * self.capacity + pos) * hd;
            self.k[layer][at..at + hd].copy_from_slice(&k[h * hd..(h + 1) * hd]);
            self.v[layer][at..at + hd].copy_from_slice(&v[h * hd..(h + 1) * hd]);
        }
    }

    /// Keys and values of one local KV head of `layer`, all positions up to capacity.
    pub fn head(&self, layer: usize, kv: usize) -> (&[f32], &[f32]) {
        let span = self.capacity * self.head_dim;
        (&self.k[layer][kv * span..(kv + 1) * span], &self.v[layer][kv * span..(kv + 1) * span])
    }
}
