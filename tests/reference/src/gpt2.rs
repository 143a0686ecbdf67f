//! Random-weight GPT-2 and GPT-BigCode folders, and the same models as candle runs them.
//!
//! Candle's `bigcode` runs GPT-BigCode with one KV head (`multi_query`, StarCoder's form) from
//! the folder as it is. Its other form (no `multi_query`) fails in candle, and candle has no
//! GPT-2, so those are written with every head's key and value weights and biases the same
//! (a model with several KV heads computing what one KV head computes) and handed to candle's
//! `bigcode` as that one KV head: GPT-2's `Conv1D` matrices turned into `nn.Linear`'s, q, k
//! and v rows regrouped.

use crate::{write_safetensors, RandomTensors};
use std::path::Path;

/// Which family and layout a [`TinyGpt2`] is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gpt2Kind {
    /// `gpt2`: `Conv1D` matrices (`[in, out]`), q, k and v one after another in `c_attn`.
    Gpt2,
    /// `gpt_bigcode` with `multi_query`: one KV head, `c_attn` = [q; k; v].
    MultiQuery,
    /// `gpt_bigcode` without it: q, k and v head by head in `c_attn`.
    HeadByHead,
}

/// A random GPT-2 / GPT-BigCode: 4 heads of 16 dimensions, an FFN of `4 · hidden`, tied, and
/// learned positions up to `positions`.
pub struct TinyGpt2 {
    pub kind: Gpt2Kind,
    pub heads: usize,
    pub layers: usize,
    pub vocab: usize,
    pub positions: usize,
    /// Tensors named without `transformer.` (a folder saved from the bare `GPT2Model`).
    pub bare: bool,
}

type Tensors = Vec<(String, Vec<usize>, Vec<f32>)>;

const HEAD_DIM: usize = 16;

impl TinyGpt2 {
    pub fn new(kind: Gpt2Kind) -> Self {
        TinyGpt2 { kind, heads: 4, layers: 3, vocab: 300, positions: 64, bare: kind == Gpt2Kind::Gpt2 }
    }

    pub fn hidden(&self) -> usize {
        self.heads * HEAD_DIM
    }

    fn kv_heads(&self) -> usize {
        if self.kind == Gpt2Kind::MultiQuery {
            1
        } else {
            self.heads
        }
    }

    /// config.json as HF writes GPT2Config's and GPTBigCodeConfig's (`n_embd`, ...); GELU's
    /// tanh form (candle's `bigcode` runs that).
    pub fn config(&self) -> serde_json::Value {
        let mut c = serde_json::json!({
            "vocab_size": self.vocab, "n_embd": self.hidden(), "n_layer": self.layers,
            "n_head": self.heads, "n_positions": self.positions, "n_inner": null,
            "layer_norm_epsilon": 1e-5, "bos_token_id": 0, "eos_token_id": 0,
        });
        let extra = match self.kind {
            Gpt2Kind::Gpt2 => serde_json::json!({
                "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
                "activation_function": "gelu_new", "scale_attn_by_inverse_layer_idx": false,
                "reorder_and_upcast_attn": false,
            }),
            _ => serde_json::json!({
                "architectures": ["GPTBigCodeForCausalLM"], "model_type": "gpt_bigcode",
                "activation_function": "gelu_pytorch_tanh",
                "multi_query": self.kind == Gpt2Kind::MultiQuery,
            }),
        };
        c.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        c
    }

    /// The tensors in HF's layout: by GPT-BigCode's names as `nn.Linear` stores them, q, k and
    /// v one KV head's worth after another in `[q; k; v]` order where `multi_query`, else each
    /// KV head with the same key and value (see the module's note). `Conv1D` turning and
    /// GPT-2's layout are [`Self::tensors`]'.
    fn linear_tensors(&self) -> Tensors {
        let (h, ff, hd) = (self.hidden(), 4 * self.hidden(), HEAD_DIM);
        let mut t = RandomTensors::new(900);
        let mut add =
            |name: String, shape: Vec<usize>, scale: f32, offset: f32| t.add(name, shape, scale, offset);
        add("transformer.wte.weight".into(), vec![self.vocab, h], 1.0, 0.0);
        add("transformer.wpe.weight".into(), vec![self.positions, h], 0.5, 0.0);
        add("transformer.ln_f.weight".into(), vec![h], 0.2, 1.0);
        add("transformer.ln_f.bias".into(), vec![h], 0.2, 0.0);
        let w = 1.0 / (h as f32).sqrt();
        for l in 0..self.layers {
            let p = |s: &str| format!("transformer.h.{l}.{s}");
            for n in ["ln_1", "ln_2"] {
                add(p(&format!("{n}.weight")), vec![h], 0.2, 1.0);
                add(p(&format!("{n}.bias")), vec![h], 0.2, 0.0);
            }
            // q of every head, then one key and one value.
            add(p("attn.c_attn.weight"), vec![h + 2 * hd, h], 2.0 * w, 0.0);
            add(p("attn.c_attn.bias"), vec![h + 2 * hd], 0.5, 0.0);
            add(p("attn.c_proj.weight"), vec![h, h], w, 0.0);
            add(p("attn.c_proj.bias"), vec![h], 0.2, 0.0);
            add(p("mlp.c_fc.weight"), vec![ff, h], 2.0 * w, 0.0);
            add(p("mlp.c_fc.bias"), vec![ff], 0.2, 0.0);
            add(p("mlp.c_proj.weight"), vec![h, ff], 1.0 / (ff as f32).sqrt(), 0.0);
            add(p("mlp.c_proj.bias"), vec![h], 0.2, 0.0);
        }
        t.out
    }

    /// The tensors by their full names as `nn.Linear`s store them, q, k and v in this kind's
    /// layout (as llama.cpp's GGUFs hold GPT-2's matrices).
    pub fn laid_out(&self) -> Tensors {
        let (h, hd) = (self.hidden(), HEAD_DIM);
        let mut out = Vec::new();
        for (name, shape, v) in self.linear_tensors() {
            let (name, shape, v) =
                if name.ends_with("attn.c_attn.weight") || name.ends_with("attn.c_attn.bias") {
                    // [q; k; v] of one KV head → this kind's layout of `kv_heads` of them.
                    let cols = if shape.len() == 2 { h } else { 1 };
                    let row = |r: usize| &v[r * cols..(r + 1) * cols];
                    let q = |j: usize| (j * hd..(j + 1) * hd).flat_map(row).copied().collect::<Vec<f32>>();
                    let (k, v): (Vec<f32>, Vec<f32>) = (
                        (h..h + hd).flat_map(row).copied().collect(),
                        (h + hd..h + 2 * hd).flat_map(row).copied().collect(),
                    );
                    let mut out = Vec::new();
                    match self.kind {
                        Gpt2Kind::MultiQuery => out = (0..self.heads).flat_map(q).chain(k).chain(v).collect(),
                        Gpt2Kind::Gpt2 => {
                            out.extend((0..self.heads).flat_map(q));
                            (0..self.heads).for_each(|_| out.extend(&k));
                            (0..self.heads).for_each(|_| out.extend(&v));
                        }
                        Gpt2Kind::HeadByHead => {
                            for j in 0..self.heads {
                                out.extend(q(j));
                                out.extend(&k);
                                out.extend(&v);
                            }
                        }
                    }
                    let rows = (self.heads + 2 * self.kv_heads()) * hd;
                    let shape = if shape.len() == 2 { vec![rows, h] } else { vec![rows] };
                    (name, shape, out)
                } else {
                    (name, shape, v)
                };
            out.push((name, shape, v));
        }
        out
    }

    /// The tensors as the folder stores them: [`Self::laid_out`]'s, GPT-2's matrices turned
    /// (`Conv1D`, `[in, out]`) and, where `bare`, named without `transformer.`.
    pub fn tensors(&self) -> Tensors {
        let conv1d = ["attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight"];
        let mut out = Vec::new();
        for (name, shape, v) in self.laid_out() {
            let (shape, v) = if self.kind == Gpt2Kind::Gpt2 && conv1d.iter().any(|s| name.ends_with(s)) {
                let (r, c) = (shape[0], shape[1]);
                (
                    vec![c, r],
                    (0..c).flat_map(|j| (0..r).map(move |i| (i, j))).map(|(i, j)| v[i * c + j]).collect(),
                )
            } else {
                (shape, v)
            };
            let name = match name.strip_prefix("transformer.") {
                Some(rest) if self.bare => rest.to_string(),
                _ => name,
            };
            out.push((name, shape, v));
        }
        out
    }

    /// Writes the folder into `dir`, with the word-level vocabulary of the other random models.
    pub fn write(&self, dir: &Path) {
        std::fs::write(dir.join("config.json"), self.config().to_string()).expect("write config.json");
        write_safetensors(&dir.join("model.safetensors"), &self.tensors());
        crate::write_word_level_tokenizer(dir, self.vocab);
    }

    /// The same model as candle's `bigcode` takes it (`multi_query`, `nn.Linear` matrices,
    /// names under `transformer.`), written into `dir` as `model.safetensors`.
    pub fn write_for_candle(&self, dir: &Path) {
        write_safetensors(&dir.join("model.safetensors"), &self.linear_tensors());
    }
}
