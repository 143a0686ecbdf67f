//! Random-weight GPT-NeoX folders, and the same models as candle runs them.
//!
//! Candle has no GPT-NeoX. Its parallel form is handed to candle's `phi` (one norm a layer, a
//! parallel residual, every bias, RoPE over part of each head) as the model computing the same
//! function: q, k and v taken apart, the FFN's own norm (`post_attention_layernorm`) folded
//! into its first matrix and bias (`W · (n·w₂ + b₂) + c = W·diag(w₂/w₁) · (n·w₁ + b₁) + c + W ·
//! (b₂ − b₁·w₂/w₁)`, `n` the input standardized), the head's bias zero. Its sequential form,
//! rotating whole heads, is candle's `falcon` with biases, q, k and v stored alike.

use crate::{write_safetensors, RandomTensors};
use std::collections::HashMap;
use std::path::Path;

/// A random GPT-NeoX: 5 heads of 16 dimensions, an FFN of `4 · hidden`, untied.
pub struct TinyNeoX {
    /// `use_parallel_residual`; sequential models rotate whole heads (`rotary_pct` 1).
    pub parallel: bool,
    pub heads: usize,
    pub layers: usize,
    pub vocab: usize,
    /// Whether the head is named `embed_out` (as transformers 4 saves it) or `lm_head`.
    pub embed_out: bool,
}

type Tensors = Vec<(String, Vec<usize>, Vec<f32>)>;

const HEAD_DIM: usize = 16;

impl TinyNeoX {
    pub fn new(parallel: bool) -> Self {
        TinyNeoX { parallel, heads: 5, layers: 4, vocab: 300, embed_out: parallel }
    }

    pub fn hidden(&self) -> usize {
        self.heads * HEAD_DIM
    }

    /// Dimensions of each head RoPE turns.
    pub fn rotary_pct(&self) -> f64 {
        if self.parallel {
            0.5
        } else {
            1.0
        }
    }

    /// config.json as transformers 4 wrote Pythia's (`rotary_pct`, `rotary_emb_base`); GELU
    /// itself where parallel (candle's `phi` runs it), its tanh form where not (candle's
    /// `falcon` runs that).
    pub fn config(&self) -> serde_json::Value {
        let h = self.hidden();
        serde_json::json!({
            "architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox",
            "vocab_size": self.vocab, "hidden_size": h, "intermediate_size": 4 * h,
            "num_hidden_layers": self.layers, "num_attention_heads": self.heads,
            "hidden_act": if self.parallel { "gelu" } else { "gelu_new" },
            "rotary_pct": self.rotary_pct(), "rotary_emb_base": 10000, "layer_norm_eps": 1e-5,
            "max_position_embeddings": 2048, "use_parallel_residual": self.parallel,
            "tie_word_embeddings": false, "bos_token_id": 0, "eos_token_id": 0,
        })
    }

    /// The tensors by GPT-NeoX's names, q, k and v fused head by head.
    pub fn tensors(&self) -> Tensors {
        let (h, ff) = (self.hidden(), 4 * self.hidden());
        let mut t = RandomTensors::new(700);
        let mut add =
            |name: String, shape: Vec<usize>, scale: f32, offset: f32| t.add(name, shape, scale, offset);
        add("gpt_neox.embed_in.weight".into(), vec![self.vocab, h], 1.0, 0.0);
        let head = if self.embed_out { "embed_out.weight" } else { "lm_head.weight" };
        add(head.into(), vec![self.vocab, h], 0.5, 0.0);
        add("gpt_neox.final_layer_norm.weight".into(), vec![h], 0.2, 1.0);
        add("gpt_neox.final_layer_norm.bias".into(), vec![h], 0.2, 0.0);
        let w = 1.0 / (h as f32).sqrt();
        for l in 0..self.layers {
            let p = |s: &str| format!("gpt_neox.layers.{l}.{s}");
            for n in ["input_layernorm", "post_attention_layernorm"] {
                add(p(&format!("{n}.weight")), vec![h], 0.2, 1.0);
                add(p(&format!("{n}.bias")), vec![h], 0.2, 0.0);
            }
            add(p("attention.query_key_value.weight"), vec![3 * h, h], 2.0 * w, 0.0);
            add(p("attention.query_key_value.bias"), vec![3 * h], 0.5, 0.0);
            add(p("attention.dense.weight"), vec![h, h], w, 0.0);
            add(p("attention.dense.bias"), vec![h], 0.2, 0.0);
            add(p("mlp.dense_h_to_4h.weight"), vec![ff, h], 2.0 * w, 0.0);
            add(p("mlp.dense_h_to_4h.bias"), vec![ff], 0.2, 0.0);
            add(p("mlp.dense_4h_to_h.weight"), vec![h, ff], 1.0 / (ff as f32).sqrt(), 0.0);
            add(p("mlp.dense_4h_to_h.bias"), vec![h], 0.2, 0.0);
        }
        t.out
    }

    /// Writes the folder into `dir`, with the word-level vocabulary of the other random models.
    pub fn write(&self, dir: &Path) {
        std::fs::write(dir.join("config.json"), self.config().to_string()).expect("write config.json");
        write_safetensors(&dir.join("model.safetensors"), &self.tensors());
        crate::write_word_level_tokenizer(dir, self.vocab);
    }

    /// The same model as candle's `phi` (parallel) or `falcon` (sequential) takes it, written
    /// into `dir` as `model.safetensors` (the module's note).
    pub fn write_for_candle(&self, dir: &Path) {
        let (h, hd) = (self.hidden(), HEAD_DIM);
        let mut t: HashMap<String, (Vec<usize>, Vec<f32>)> =
            self.tensors().into_iter().map(|(n, s, v)| (n, (s, v))).collect();
        let mut out: HashMap<String, (Vec<usize>, Vec<f32>)> = HashMap::new();
        let head = t.remove(if self.embed_out { "embed_out.weight" } else { "lm_head.weight" }).unwrap();
        out.insert("lm_head.weight".into(), head);
        let (top, layer, attention, final_norm) = if self.parallel {
            ("model.embed_tokens.weight", "model.layers", "self_attn", "model.final_layernorm")
        } else {
            ("transformer.word_embeddings.weight", "transformer.h", "self_attention", "transformer.ln_f")
        };
        out.insert(top.into(), t.remove("gpt_neox.embed_in.weight").unwrap());
        for part in ["weight", "bias"] {
            out.insert(
                format!("{final_norm}.{part}"),
                t.remove(&format!("gpt_neox.final_layer_norm.{part}")).unwrap(),
            );
        }
        if self.parallel {
            out.insert("lm_head.bias".into(), (vec![self.vocab], vec![0.0; self.vocab]));
        }
        for l in 0..self.layers {
            let mut take = |s: &str| t.remove(&format!("gpt_neox.layers.{l}.{s}")).unwrap();
            let ours = |s: &str| format!("{layer}.{l}.{s}");
            let (qkv_w, qkv_b) =
                (take("attention.query_key_value.weight"), take("attention.query_key_value.bias"));
            let (ln1_w, ln1_b) = (take("input_layernorm.weight"), take("input_layernorm.bias"));
            let (ln2_w, ln2_b) =
                (take("post_attention_layernorm.weight"), take("post_attention_layernorm.bias"));
            let (up_w, up_b) = (take("mlp.dense_h_to_4h.weight"), take("mlp.dense_h_to_4h.bias"));
            let dense = [take("attention.dense.weight"), take("attention.dense.bias")];
            let down = [take("mlp.dense_4h_to_h.weight"), take("mlp.dense_4h_to_h.bias")];
            for (part, v) in ["weight", "bias"].into_iter().zip(dense) {
                out.insert(ours(&format!("{attention}.dense.{part}")), v);
            }
            let down_name = if self.parallel { "mlp.fc2" } else { "mlp.dense_4h_to_h" };
            for (part, v) in ["weight", "bias"].into_iter().zip(down) {
                out.insert(ours(&format!("{down_name}.{part}")), v);
            }
            out.insert(ours("input_layernorm.weight"), ln1_w.clone());
            out.insert(ours("input_layernorm.bias"), ln1_b.clone());
            if !self.parallel {
                // Candle's Falcon reads q, k and v as GPT-NeoX stores them.
                out.insert(ours("self_attention.query_key_value.weight"), qkv_w);
                out.insert(ours("self_attention.query_key_value.bias"), qkv_b);
                out.insert(ours("post_attention_layernorm.weight"), ln2_w);
                out.insert(ours("post_attention_layernorm.bias"), ln2_b);
                out.insert(ours("mlp.dense_h_to_4h.weight"), up_w);
                out.insert(ours("mlp.dense_h_to_4h.bias"), up_b);
                continue;
            }
            // q, k and v apart, head by head.
            for (i, which) in ["q_proj", "k_proj", "v_proj"].into_iter().enumerate() {
                let (mut w, mut b) = (Vec::with_capacity(h * h), Vec::with_capacity(h));
                for j in 0..self.heads {
                    let rows = (3 * j + i) * hd..(3 * j + i + 1) * hd;
                    w.extend_from_slice(&qkv_w.1[rows.start * h..rows.end * h]);
                    b.extend_from_slice(&qkv_b.1[rows]);
                }
                out.insert(ours(&format!("self_attn.{which}.weight")), (vec![h, h], w));
                out.insert(ours(&format!("self_attn.{which}.bias")), (vec![h], b));
            }
            // The FFN's norm folded into fc1.
            let ff = up_b.1.len();
            let (mut folded, mut bias) = (up_w.1.clone(), up_b.1.clone());
            for r in 0..ff {
                let mut extra = 0.0f64;
                for c in 0..h {
                    let ratio = ln2_w.1[c] as f64 / ln1_w.1[c] as f64;
                    folded[r * h + c] = (up_w.1[r * h + c] as f64 * ratio) as f32;
                    extra += up_w.1[r * h + c] as f64 * (ln2_b.1[c] as f64 - ln1_b.1[c] as f64 * ratio);
                }
                bias[r] = (bias[r] as f64 + extra) as f32;
            }
            out.insert(ours("mlp.fc1.weight"), (vec![ff, h], folded));
            out.insert(ours("mlp.fc1.bias"), (vec![ff], bias));
        }
        assert!(t.is_empty(), "tensors left out: {:?}", t.keys().collect::<Vec<_>>());
        let mut tensors: Tensors = out.into_iter().map(|(n, (s, v))| (n, s, v)).collect();
        tensors.sort_by(|a, b| a.0.cmp(&b.0));
        write_safetensors(&dir.join("model.safetensors"), &tensors);
    }
}
