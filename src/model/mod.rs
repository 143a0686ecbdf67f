//! One rank's shard of a decoder-only model (Llama, Mistral, Qwen2) and its forward pass.
//! Owns: loading the shard's tensors by their HF names and the layer math. Sees communication
//! only through the [`Comm`] trait: exactly two allreduces per layer, one for the embedding.
//!
//! ```text
//! per layer, on one rank:   x ─ rmsnorm ─ qkv (its heads) ─ rope ─ kv append ─ attention
//!                             └──────────────── + allreduce(o_proj partial) ◄─┘
//!                           x ─ rmsnorm ─ gate/up (its columns) ─ silu·mul ─ down partial
//!                             └──────────────── + allreduce ◄───────────────────┘
//! ```

pub mod kv_cache;

use crate::comm::Comm;
use crate::config::ModelConfig;
use crate::error::Result;
use crate::grid::ShardPlan;
use crate::kernels;
use crate::weights::checkpoint::Checkpoint;
use crate::weights::Mat;
use crate::weights::Source;
pub use kv_cache::KvCache;
use rayon::prelude::*;
use std::path::Path;
use std::sync::Arc;

struct Layer {
    input_norm: Vec<f32>,
    post_norm: Vec<f32>,
    /// Rows: this rank's q heads, then its k heads, then its v heads.
    qkv: Mat,
    qkv_bias: Option<Vec<f32>>,
    /// Input columns of this rank's q heads.
    o_proj: Mat,
    /// Rows: this rank's gate columns, then the same up columns.
    gate_up: Mat,
    /// Input columns of this rank's FFN range.
    down: Mat,
}

pub struct Shard {
    pub cfg: ModelConfig,
    pub plan: ShardPlan,
    layers: Vec<Layer>,
    /// Vocabulary rows of the embedding (first stage).
    embed: Option<Arc<Mat>>,
    final_norm: Option<Vec<f32>>,
    /// Vocabulary rows of the output head (last stage); shares `embed` when tied on one stage.
    lm_head: Option<Arc<Mat>>,
    inv_freq: Vec<f64>,
}

impl Shard {
    /// Loads only this rank's shard from the checkpoint in `dir`.
    pub fn load(dir: &Path, cfg: ModelConfig, plan: ShardPlan) -> Result<Self> {
        let ckpt = Checkpoint::open(dir)?;
        Self::from_source(&ckpt, cfg, plan)
    }

    /// Loads this rank's shard from any weight source (checkpoint or synthetic).
    pub fn from_source(ckpt: &dyn Source, cfg: ModelConfig, plan: ShardPlan) -> Result<Self> {
        let (h, hd, ff) = (cfg.hidden_size, cfg.head_dim, cfg.intermediate_size);
        let (qd, kvd) = (cfg.q_dim(), cfg.kv_dim());
        let qr = plan.q_heads.start * hd..plan.q_heads.end * hd;
        let kr = plan.kv_heads.start * hd..plan.kv_heads.end * hd;
        let mut layers = Vec::with_capacity(plan.layers.len());
        for i in plan.layers.clone() {
            let p = |s: &str| format!("model.layers.{i}.{s}");
            let q = ckpt.rows(&p("self_attn.q_proj.weight"), &[qd, h], qr.clone())?;
            let k = ckpt.rows(&p("self_attn.k_proj.weight"), &[kvd, h], kr.clone())?;
            let v = ckpt.rows(&p("self_attn.v_proj.weight"), &[kvd, h], kr.clone())?;
            let qkv_bias = if cfg.qkv_bias {
                let mut b = ckpt.vector_range_f32(&p("self_attn.q_proj.bias"), qd, qr.clone())?;
                b.extend(ckpt.vector_range_f32(&p("self_attn.k_proj.bias"), kvd, kr.clone())?);
                b.extend(ckpt.vector_range_f32(&p("self_attn.v_proj.bias"), kvd, kr.clone())?);
                Some(b)
            } else {
                None
            };
            let gate = ckpt.rows(&p("mlp.gate_proj.weight"), &[ff, h], plan.ffn.clone())?;
            let up = ckpt.rows(&p("mlp.up_proj.weight"), &[ff, h], plan.ffn.clone())?;
            layers.push(Layer {
                input_norm: ckpt.vector_f32(&p("input_layernorm.weight"), h)?,
                post_norm: ckpt.vector_f32(&p("post_attention_layernorm.weight"), h)?,
                qkv: Mat::vstack(vec![q, k, v]),
                qkv_bias,
                o_proj: ckpt.cols(&p("self_attn.o_proj.weight"), &[h, qd], qr.clone())?,
                gate_up: Mat::vstack(vec![gate, up]),
                down: ckpt.cols(&p("mlp.down_proj.weight"), &[h, ff], plan.ffn.clone())?,
            });
        }
        let vocab_shape = [cfg.vocab_size, h];
        let embed = if plan.first_stage {
            Some(Arc::new(ckpt.rows("model.embed_tokens.weight", &vocab_shape, plan.vocab.clone())?))
        } else {
            None
        };
        let (final_norm, lm_head) = if plan.last_stage {
            let head = if cfg.tie_word_embeddings {
                match &embed {
                    Some(e) => e.clone(),
                    None => {
                        Arc::new(ckpt.rows("model.embed_tokens.weight", &vocab_shape, plan.vocab.clone())?)
                    }
                }
            } else {
                Arc::new(ckpt.rows("lm_head.weight", &vocab_shape, plan.vocab.clone())?)
            };
            (Some(ckpt.vector_f32("model.norm.weight", h)?), Some(head))
        } else {
            (None, None)
        };
        let inv_freq = cfg.rope_inv_freq();
        Ok(Shard { cfg, plan, layers, embed, final_norm, lm_head, inv_freq })
    }

    /// Bytes of weights this rank holds (shared tensors counted once).
    pub fn weight_bytes(&self) -> usize {
        let mut n = 0;
        for l in &self.layers {
            n += l.qkv.bytes() + l.o_proj.bytes() + l.gate_up.bytes() + l.down.bytes();
            n += 4 * (l.input_norm.len() + l.post_norm.len() + l.qkv_bias.as_ref().map_or(0, |b| b.len()));
        }
        n += self.embed.as_ref().map_or(0, |e| e.bytes());
        n += self.final_norm.as_ref().map_or(0, |v| 4 * v.len());
        if let (Some(head), embed) = (&self.lm_head, &self.embed) {
            if !embed.as_ref().is_some_and(|e| Arc::ptr_eq(e, head)) {
                n += head.bytes();
            }
        }
        n
    }

    /// Bytes of weights one token's decode step reads on this rank: all layers, one embedding
    /// row, the final norm and the whole lm_head shard.
    pub fn bytes_per_token(&self) -> usize {
        let mut n: usize = self
            .layers
            .iter()
            .map(|l| {
                l.qkv.bytes()
                    + l.o_proj.bytes()
                    + l.gate_up.bytes()
                    + l.down.bytes()
                    + 4 * (l.input_norm.len()
                        + l.post_norm.len()
                        + l.qkv_bias.as_ref().map_or(0, |b| b.len()))
            })
            .sum();
        n += self.embed.as_ref().map_or(0, |e| e.bytes() / e.rows.max(1));
        n += self.final_norm.as_ref().map_or(0, |v| 4 * v.len());
        n += self.lm_head.as_ref().map_or(0, |m| m.bytes());
        n
    }

    pub fn new_cache(&self, capacity: usize) -> KvCache {
        KvCache::new(self.layers.len(), self.plan.kv_heads.len(), self.cfg.head_dim, capacity)
    }

    /// Rows of vocabulary this rank's embedding / lm_head holds.
    pub fn vocab_range(&self) -> std::ops::Range<usize> {
        self.plan.vocab.clone()
    }

    /// Embedding lookup for `tokens` into `x` (`[n, hidden]`): rows in this rank's vocabulary
    /// range are copied, others are zero, and the stage allreduce fills in the rest.
    pub fn embed(&self, tokens: &[u32], x: &mut [f32], comm: &dyn Comm) {
        let h = self.cfg.hidden_size;
        let e = self.embed.as_ref().expect("embed called on a rank outside the first stage");
        let v0 = self.plan.vocab.start;
        for (t, &id) in tokens.iter().enumerate() {
            let out = &mut x[t * h..(t + 1) * h];
            let id = id as usize;
            if self.plan.vocab.contains(&id) {
                let r = id - v0;
                e.data.to_f32_range(r * h..(r + 1) * h, out);
            } else {
                out.fill(0.0);
            }
        }
        if comm.size() > 1 {
            comm.allreduce_sum(&mut x[..tokens.len() * h]);
        }
    }

    /// Runs this shard's layers on `n` tokens at positions `pos0..pos0+n`, updating `x`
    /// (`[n, hidden]`) in place and appending to `cache`.
    pub fn forward(
        &self,
        x: &mut [f32],
        n: usize,
        pos0: usize,
        cache: &mut KvCache,
        s: &mut Scratch,
        comm: &dyn Comm,
    ) {
        let cfg = &self.cfg;
        let (h, hd) = (cfg.hidden_size, cfg.head_dim);
        let nq = self.plan.q_heads.len();
        let nkv = self.plan.kv_heads.len();
        let qkv_rows = (nq + 2 * nkv) * hd;
        let ffl = self.plan.ffn.len();
        // Sized for the whole cache at once, so decode steps never reallocate.
        s.ensure(n, cache.capacity(), self);
        let x = &mut x[..n * h];
        self.rope_tables(pos0, n, s);
        let group = cfg.n_heads / cfg.n_kv_heads;
        let q0 = self.plan.q_heads.start;
        let kv0 = self.plan.kv_heads.start;
        let scale = 1.0 / (hd as f32).sqrt();
        for (li, l) in self.layers.iter().enumerate() {
            // Attention block.
            kernels::rmsnorm(x, &l.input_norm, cfg.rms_norm_eps, &mut s.xn[..n * h]);
            let qkv = &mut s.qkv[..n * qkv_rows];
            kernels::matmul(&l.qkv, &s.xn[..n * h], n, qkv);
            for t in 0..n {
                let row = &mut qkv[t * qkv_rows..(t + 1) * qkv_rows];
                if let Some(b) = &l.qkv_bias {
                    row.iter_mut().zip(b).for_each(|(v, b)| *v += b);
                }
                let half = hd / 2;
                let (cos, sin) = (&s.cos[t * half..(t + 1) * half], &s.sin[t * half..(t + 1) * half]);
                kernels::rope(&mut row[..(nq + nkv) * hd], hd, cos, sin);
                cache.write(li, pos0 + t, &row[nq * hd..(nq + nkv) * hd], &row[(nq + nkv) * hd..]);
            }
            let qkv = &*qkv;
            let cache_r = &*cache;
            let att = crate::kernels::SharedSlice::new(&mut s.att[..n * nq * hd]);
            let window = cfg.sliding_window;
            let ctx_cap = s.ctx_cap;
            s.scores.par_chunks_mut(ctx_cap).take(nq).enumerate().for_each(|(hl, scores)| {
                let kvl = (q0 + hl) / group - kv0;
                let (keys, values) = cache_r.head(li, kvl);
                for t in 0..n {
                    let pos = pos0 + t;
                    let first = window.map_or(0, |w| (pos + 1).saturating_sub(w));
                    let q = &qkv[t * qkv_rows + hl * hd..t * qkv_rows + (hl + 1) * hd];
                    // SAFETY: (t, hl) pairs are disjoint between tasks: each task owns head hl.
                    let out = unsafe { att.range(t * nq * hd + hl * hd, hd) };
                    kernels::attend(
                        q,
                        &keys[first * hd..],
                        &values[first * hd..],
                        pos + 1 - first,
                        scale,
                        scores,
                        out,
                    );
                }
            });
            kernels::matmul(&l.o_proj, &s.att[..n * nq * hd], n, &mut s.o[..n * h]);
            comm.allreduce_sum(&mut s.o[..n * h]);
            x.iter_mut().zip(&s.o[..n * h]).for_each(|(a, b)| *a += b);

            // FFN block.
            kernels::rmsnorm(x, &l.post_norm, cfg.rms_norm_eps, &mut s.xn[..n * h]);
            kernels::matmul(&l.gate_up, &s.xn[..n * h], n, &mut s.gu[..n * 2 * ffl]);
            for t in 0..n {
                let (g, u) = s.gu[t * 2 * ffl..(t + 1) * 2 * ffl].split_at_mut(ffl);
                kernels::silu_mul(g, u);
                s.act[t * ffl..(t + 1) * ffl].copy_from_slice(g);
            }
            kernels::matmul(&l.down, &s.act[..n * ffl], n, &mut s.o[..n * h]);
            comm.allreduce_sum(&mut s.o[..n * h]);
            x.iter_mut().zip(&s.o[..n * h]).for_each(|(a, b)| *a += b);
        }
        cache.set_len(pos0 + n);
    }

    fn rope_tables(&self, pos0: usize, n: usize, s: &mut Scratch) {
        let half = self.inv_freq.len();
        for t in 0..n {
            let p = (pos0 + t) as f64;
            for (i, f) in self.inv_freq.iter().enumerate() {
                let a = p * f;
                s.cos[t * half + i] = a.cos() as f32;
                s.sin[t * half + i] = a.sin() as f32;
            }
        }
    }

    /// Final norm and this rank's vocabulary shard of the logits for one hidden state.
    pub fn logits(&self, x: &[f32], s: &mut Scratch, out: &mut [f32]) {
        let h = self.cfg.hidden_size;
        let norm = self.final_norm.as_ref().expect("logits called outside the last stage");
        let head = self.lm_head.as_ref().expect("logits called outside the last stage");
        kernels::rmsnorm(&x[..h], norm, self.cfg.rms_norm_eps, &mut s.xn[..h]);
        kernels::matmul(head, &s.xn[..h], 1, out);
    }

    pub fn weight_dtype(&self) -> &'static str {
        self.layers
            .first()
            .map(|l| l.qkv.data.dtype())
            .or(self.lm_head.as_ref().map(|m| m.data.dtype()))
            .map_or("f32", |d| d.name())
    }
}

/// Working buffers for one forward pass, grown when a longer chunk arrives (prefill) and
/// reused by every decode step, so decode allocates nothing.
#[derive(Default)]
pub struct Scratch {
    tok_cap: usize,
    ctx_cap: usize,
    xn: Vec<f32>,
    qkv: Vec<f32>,
    att: Vec<f32>,
    o: Vec<f32>,
    gu: Vec<f32>,
    act: Vec<f32>,
    scores: Vec<f32>,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl Scratch {
    fn ensure(&mut self, n: usize, ctx: usize, m: &Shard) {
        if n <= self.tok_cap && ctx <= self.ctx_cap && !self.xn.is_empty() {
            return;
        }
        let cfg = &m.cfg;
        let (nq, nkv, hd) = (m.plan.q_heads.len(), m.plan.kv_heads.len(), cfg.head_dim);
        let n = n.max(self.tok_cap).max(1);
        let ctx = ctx.max(self.ctx_cap).max(1);
        let ffl = m.plan.ffn.len();
        self.tok_cap = n;
        self.ctx_cap = ctx;
        self.xn = vec![0.0; n * cfg.hidden_size];
        self.qkv = vec![0.0; n * (nq + 2 * nkv) * hd];
        self.att = vec![0.0; n * nq * hd];
        self.o = vec![0.0; n * cfg.hidden_size];
        self.gu = vec![0.0; n * 2 * ffl];
        self.act = vec![0.0; n * ffl];
        self.scores = vec![0.0; nq.max(1) * ctx];
        self.cos = vec![0.0; n * hd / 2];
        self.sin = vec![0.0; n * hd / 2];
    }
}
