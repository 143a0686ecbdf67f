//! Random-weight Falcon folders, and the same models as candle's `falcon` runs them.
//!
//! Candle's Falcon has one KV head (`multi_query`) or one per query head, and one norm per
//! parallel layer. A Falcon-40B-style model (KV heads in groups, `ln_attn` and `ln_mlp`) is
//! handed to it as the model that computes the same function: each group's key and value
//! repeated for each of its query heads, and `ln_mlp` folded into the FFN's first matrix and a
//! bias beside it (`W · (n·w₂ + b₂) = W·diag(w₂/w₁) · (n·w₁ + b₁) + W · (b₂ − b₁·w₂/w₁)`, `n`
//! the input standardized), every other bias zero.

use crate::{write_safetensors, RandomTensors};
use std::path::Path;

/// How the layers are laid out.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum FalconKind {
    /// Falcon-7B's: one KV head (`multi_query`), the attention and the FFN reading one norm of
    /// the layer's input.
    MultiQuery,
    /// `multi_query` and `parallel_attn` false: a KV head per query head, q, k and v stored
    /// head by head, the FFN after the attention with a norm of its own.
    Sequential,
    /// Falcon-40B's (`new_decoder_architecture`): KV heads in groups, the FFN's norm of the
    /// layer's input its own (`ln_mlp`).
    Grouped,
}

/// A random Falcon of `kind`: `heads` query heads of 16 dimensions, `kv_heads` KV heads where
/// `kind` is [`FalconKind::Grouped`].
pub struct TinyFalcon {
    pub kind: FalconKind,
    pub heads: usize,
    pub kv_heads: usize,
    pub layers: usize,
    pub vocab: usize,
    /// `ffn_hidden_size`, or `None`: absent (HF's four times `hidden_size`).
    pub ffn: Option<usize>,
    pub tied: bool,
}

type Tensors = Vec<(String, Vec<usize>, Vec<f32>)>;

const HEAD_DIM: usize = 16;

impl TinyFalcon {
    pub fn new(kind: FalconKind) -> Self {
        let (heads, kv_heads) = match kind {
            FalconKind::MultiQuery => (5, 1),
            FalconKind::Sequential => (5, 5),
            FalconKind::Grouped => (6, 2),
        };
        // Candle's FFN is always four times as wide as the hidden state: said outright, or not.
        let (ffn, tied) = match kind {
            FalconKind::MultiQuery => (None, true),
            _ => (Some(4 * heads * HEAD_DIM), false),
        };
        TinyFalcon { kind, heads, kv_heads, layers: 4, vocab: 300, ffn, tied }
    }

    pub fn hidden(&self) -> usize {
        self.heads * HEAD_DIM
    }

    fn ffn_width(&self) -> usize {
        self.ffn.unwrap_or(4 * self.hidden())
    }

    /// config.json as HF's FalconConfig writes it; GELU's tanh form, as candle's Falcon runs.
    pub fn config(&self) -> serde_json::Value {
        let mut cfg = serde_json::json!({
            "architectures": ["FalconForCausalLM"], "model_type": "falcon",
            "vocab_size": self.vocab, "hidden_size": self.hidden(), "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads, "layer_norm_epsilon": 1e-5, "bias": false,
            "alibi": false, "activation": "gelu_pytorch_tanh", "max_position_embeddings": 2048,
            "bos_token_id": 11, "eos_token_id": 0, "tie_word_embeddings": self.tied,
        });
        let layout = match self.kind {
            FalconKind::MultiQuery => serde_json::json!({
                "multi_query": true, "parallel_attn": true, "new_decoder_architecture": false,
            }),
            FalconKind::Sequential => serde_json::json!({
                "multi_query": false, "parallel_attn": false, "new_decoder_architecture": false,
            }),
            FalconKind::Grouped => serde_json::json!({
                "new_decoder_architecture": true, "num_kv_heads": self.kv_heads,
                "num_ln_in_parallel_attn": 2, "multi_query": true, "parallel_attn": true,
            }),
        };
        cfg.as_object_mut().unwrap().extend(layout.as_object().unwrap().clone());
        if let Some(ffn) = self.ffn {
            cfg["ffn_hidden_size"] = ffn.into();
        }
        cfg
    }

    /// The tensors by Falcon's names, q, k and v fused by KV group.
    pub fn tensors(&self) -> Tensors {
        let (h, ff) = (self.hidden(), self.ffn_width());
        let mut t = RandomTensors::new(500);
        let mut add =
            |name: String, shape: Vec<usize>, scale: f32, offset: f32| t.add(name, shape, scale, offset);
        add("transformer.word_embeddings.weight".into(), vec![self.vocab, h], 1.0, 0.0);
        if !self.tied {
            add("lm_head.weight".into(), vec![self.vocab, h], 0.5, 0.0);
        }
        add("transformer.ln_f.weight".into(), vec![h], 0.2, 1.0);
        add("transformer.ln_f.bias".into(), vec![h], 0.2, 0.0);
        let w = 1.0 / (h as f32).sqrt();
        let rows = (self.heads + 2 * self.kv_heads) * HEAD_DIM;
        for l in 0..self.layers {
            let p = |s: &str| format!("transformer.h.{l}.{s}");
            let norms: &[&str] = match self.kind {
                FalconKind::MultiQuery => &["input_layernorm"],
                FalconKind::Sequential => &["input_layernorm", "post_attention_layernorm"],
                FalconKind::Grouped => &["ln_attn", "ln_mlp"],
            };
            for n in norms {
                add(p(&format!("{n}.weight")), vec![h], 0.2, 1.0);
                add(p(&format!("{n}.bias")), vec![h], 0.2, 0.0);
            }
            add(p("self_attention.query_key_value.weight"), vec![rows, h], 2.0 * w, 0.0);
            add(p("self_attention.dense.weight"), vec![h, h], w, 0.0);
            add(p("mlp.dense_h_to_4h.weight"), vec![ff, h], 2.0 * w, 0.0);
            add(p("mlp.dense_4h_to_h.weight"), vec![h, ff], 1.0 / (ff as f32).sqrt(), 0.0);
        }
        t.out
    }

    /// Writes the folder into `dir`, with the word-level vocabulary of the other random models.
    pub fn write(&self, dir: &Path) {
        std::fs::write(dir.join("config.json"), self.config().to_string()).expect("write config.json");
        write_safetensors(&dir.join("model.safetensors"), &self.tensors());
        crate::write_word_level_tokenizer(dir, self.vocab);
    }

    /// The same model as candle's `falcon` takes it (the module's note), written into `dir`
    /// as `model.safetensors`; returns whether the FFN's first matrix has a bias there (then
    /// every projection has one).
    pub fn write_for_candle(&self, dir: &Path) -> bool {
        let (h, hd, ff) = (self.hidden(), HEAD_DIM, self.ffn_width());
        let mut t: std::collections::HashMap<String, (Vec<usize>, Vec<f32>)> =
            self.tensors().into_iter().map(|(n, s, v)| (n, (s, v))).collect();
        if self.tied {
            let e = t["transformer.word_embeddings.weight"].clone();
            t.insert("lm_head.weight".into(), e);
        }
        let biased = self.kind == FalconKind::Grouped;
        if biased {
            let group = self.heads / self.kv_heads;
            for l in 0..self.layers {
                let p = |s: &str| format!("transformer.h.{l}.{s}");
                // q, k and v head by head, each group's key and value for each of its queries.
                let (_, fused) = t.remove(&p("self_attention.query_key_value.weight")).unwrap();
                let row = |slot: usize| &fused[slot * hd * h..(slot + 1) * hd * h];
                let mut qkv = Vec::with_capacity(3 * h * h);
                for j in 0..self.heads {
                    let (g, i) = (j / group, j % group);
                    for slot in [g * (group + 2) + i, g * (group + 2) + group, g * (group + 2) + group + 1] {
                        qkv.extend_from_slice(row(slot));
                    }
                }
                t.insert(p("self_attention.query_key_value.weight"), (vec![3 * h, h], qkv));
                t.insert(p("self_attention.query_key_value.bias"), (vec![3 * h], vec![0.0; 3 * h]));
                t.insert(p("self_attention.dense.bias"), (vec![h], vec![0.0; h]));
                t.insert(p("mlp.dense_4h_to_h.bias"), (vec![h], vec![0.0; h]));
                // ln_mlp folded into the FFN's first matrix and its bias.
                let (w1, b1) = (t[&p("ln_attn.weight")].1.clone(), t[&p("ln_attn.bias")].1.clone());
                let (w2, b2) = (t[&p("ln_mlp.weight")].1.clone(), t[&p("ln_mlp.bias")].1.clone());
                let (_, up) = t.remove(&p("mlp.dense_h_to_4h.weight")).unwrap();
                let (mut folded, mut bias) = (up.clone(), vec![0.0f32; ff]);
                for r in 0..ff {
                    let mut b = 0.0f64;
                    for c in 0..h {
                        let ratio = w2[c] as f64 / w1[c] as f64;
                        folded[r * h + c] = (up[r * h + c] as f64 * ratio) as f32;
                        b += up[r * h + c] as f64 * (b2[c] as f64 - b1[c] as f64 * ratio);
                    }
                    bias[r] = b as f32;
                }
                t.insert(p("mlp.dense_h_to_4h.weight"), (vec![ff, h], folded));
                t.insert(p("mlp.dense_h_to_4h.bias"), (vec![ff], bias));
                for (from, to) in [("ln_attn", "input_layernorm")] {
                    for part in ["weight", "bias"] {
                        let v = t.remove(&p(&format!("{from}.{part}"))).unwrap();
                        t.insert(p(&format!("{to}.{part}")), v);
                    }
                }
                t.remove(&p("ln_mlp.weight"));
                t.remove(&p("ln_mlp.bias"));
            }
        }
        let mut tensors: Tensors = t.into_iter().map(|(n, (s, v))| (n, s, v)).collect();
        tensors.sort_by(|a, b| a.0.cmp(&b.0));
        write_safetensors(&dir.join("model.safetensors"), &tensors);
        biased
    }
}
