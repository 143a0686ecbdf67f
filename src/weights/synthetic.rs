//! Seeded random weights for benchmarking model shapes without files. Every element is a pure
//! function of (seed, tensor name, row, column), so each rank generates exactly its own shard
//! and every grid layout sees the same model. Values are scaled like a trained model's
//! (Linear rows ~ 1/sqrt(in), norms ~ 1) so activations stay in range.

use super::{matrix_dims, DType, Data, Mat, Source};
use crate::config::{Activation, Arch, ModelConfig, Moe, NormPlace, RopeScaling};
use crate::error::{Error, Result};
use half::{bf16, f16};
use rayon::prelude::*;
use std::ops::Range;

/// Named model shapes for `gridlm bench --shape`.
pub const SHAPES: &[&str] = &[
    "smollm2-135m",
    "qwen2-0.5b",
    "qwen3-0.6b",
    "gemma2-2b",
    "gemma3-1b",
    "gemma3-4b",
    "llama-3.2-1b",
    "smollm3-3b",
    "olmo2-1b",
    "llama-2-7b",
    "llama-3-8b",
    "llama-2-70b",
    "qwen1.5-moe-a2.7b",
    "qwen3-30b-a3b",
    "mixtral-8x7b",
    "falcon-7b",
    "pythia-1.4b",
    "gpt2-xl",
    "starcoderbase-1b",
];

/// The configuration of a named shape (hyper-parameters of the public models of that name).
pub fn shape(name: &str) -> Result<ModelConfig> {
    // (arch, hidden, intermediate, layers, heads, kv heads, head dim, vocab, tied, rope theta,
    // max pos)
    let (arch, h, ff, l, nh, nkv, hd, vocab, tied, theta, max_pos) = match name {
        "smollm2-135m" => (Arch::Llama, 576, 1536, 30, 9, 3, 64, 49152, true, 100000.0, 8192),
        "qwen2-0.5b" => (Arch::Qwen2, 896, 4864, 24, 14, 2, 64, 151936, true, 1000000.0, 32768),
        "qwen3-0.6b" => (Arch::Qwen3, 1024, 3072, 28, 16, 8, 128, 151936, true, 1000000.0, 40960),
        "gemma2-2b" => (Arch::Gemma2, 2304, 9216, 26, 8, 4, 256, 256000, true, 10000.0, 8192),
        "gemma3-1b" => (Arch::Gemma3, 1152, 6912, 26, 4, 1, 256, 262144, true, 1000000.0, 32768),
        "gemma3-4b" => (Arch::Gemma3, 2560, 10240, 34, 8, 4, 256, 262208, true, 1000000.0, 131072),
        "llama-3.2-1b" => (Arch::Llama, 2048, 8192, 16, 32, 8, 64, 128256, true, 500000.0, 131072),
        "smollm3-3b" => (Arch::SmolLM3, 2048, 11008, 36, 16, 4, 128, 128256, true, 5000000.0, 65536),
        "olmo2-1b" => (Arch::Olmo2, 2048, 8192, 16, 16, 16, 128, 100352, false, 500000.0, 4096),
        "llama-2-7b" => (Arch::Llama, 4096, 11008, 32, 32, 32, 128, 32000, false, 10000.0, 4096),
        "llama-3-8b" => (Arch::Llama, 4096, 14336, 32, 32, 8, 128, 128256, false, 500000.0, 8192),
        "llama-2-70b" => (Arch::Llama, 8192, 28672, 80, 64, 8, 128, 32000, false, 10000.0, 4096),
        "qwen1.5-moe-a2.7b" => (Arch::Qwen2Moe, 2048, 5632, 24, 16, 16, 128, 151936, false, 1000000.0, 8192),
        "qwen3-30b-a3b" => (Arch::Qwen3Moe, 2048, 6144, 48, 32, 4, 128, 151936, false, 1000000.0, 40960),
        "mixtral-8x7b" => (Arch::Mixtral, 4096, 14336, 32, 32, 8, 128, 32000, false, 1000000.0, 32768),
        // 71 query heads and one KV head, which every tp rank holds.
        "falcon-7b" => (Arch::Falcon, 4544, 18176, 32, 71, 1, 64, 65024, true, 10000.0, 2048),
        "pythia-1.4b" => (Arch::GptNeoX, 2048, 8192, 24, 16, 16, 128, 50304, false, 10000.0, 2048),
        "gpt2-xl" => (Arch::Gpt2, 1600, 6400, 48, 25, 25, 64, 50257, true, 10000.0, 1024),
        // StarCoder's one KV head, which every tp rank holds.
        "starcoderbase-1b" => (Arch::GptBigCode, 2048, 8192, 24, 16, 1, 128, 49152, true, 10000.0, 8192),
        other => {
            return Err(Error::Input(format!("unknown --shape `{other}` (known: {})", SHAPES.join(", "))));
        }
    };
    let rope_scaling = match name {
        "llama-3.2-1b" => Some(RopeScaling::Llama3 {
            factor: 32.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192.0,
        }),
        // Gemma 3 4B's global layers.
        "gemma3-4b" => Some(RopeScaling::Linear { factor: 8.0 }),
        _ => None,
    };
    let (gemma2, gemma3) = (arch == Arch::Gemma2, arch == Arch::Gemma3);
    let gemma = gemma2 || gemma3;
    // Gemma 2 2B: every other layer local, 4096 positions, soft caps of 50 (attention) and 30
    // (logits). Gemma 3 1B (4B): five of every six layers local, 512 (1024) positions, their own
    // RoPE base.
    let pattern = if gemma2 { 2 } else { 6 };
    // Falcon-7B: LayerNorms, no gate, GELU, the attention and the FFN reading one norm.
    // Pythia: those with every bias, a quarter of each head rotated, the FFN's own norm.
    // GPT-2 and GPT-BigCode: LayerNorms, every bias, no gate, GELU's tanh form, learned
    // positions and no RoPE.
    let (falcon, neox) = (arch == Arch::Falcon, arch == Arch::GptNeoX);
    let gpt2 = matches!(arch, Arch::Gpt2 | Arch::GptBigCode);
    Ok(ModelConfig {
        arch,
        hidden_size: h,
        intermediate_size: ff,
        n_layers: l,
        n_heads: nh,
        n_kv_heads: nkv,
        head_dim: hd,
        rotary_dim: if neox { hd / 4 } else { hd },
        vocab_size: vocab,
        rms_norm_eps: 1e-5,
        rope_theta: theta,
        rope_scaling,
        max_position_embeddings: max_pos,
        tie_word_embeddings: tied,
        qkv_bias: matches!(arch, Arch::Qwen2 | Arch::Qwen2Moe) || neox || gpt2,
        qk_norm: matches!(arch, Arch::Qwen3 | Arch::Qwen3Moe | Arch::Gemma3),
        qk_norm_full: arch == Arch::Olmo2,
        rope_interleaved: false,
        linear_bias: neox || gpt2,
        layer_norm: falcon || neox || gpt2,
        weightless_norms: false,
        clip_qkv: None,
        gated_ffn: !falcon && !neox && !gpt2,
        parallel_residual: falcon || neox,
        parallel_ffn_norm: neox,
        head_bias: false,
        learned_positions: gpt2,
        sliding_window: gemma.then_some(match name {
            "gemma2-2b" => 4096,
            "gemma3-4b" => 1024,
            _ => 512,
        }),
        local_layers: gemma.then(|| (0..l).map(|i| (i + 1) % pattern != 0).collect()),
        rope_local_theta: gemma3.then_some(10000.0),
        // SmolLM3 3B: every fourth layer unrotated.
        no_rope_layers: match arch {
            Arch::SmolLM3 => Some((0..l).map(|i| (i + 1) % 4 == 0).collect()),
            _ if gpt2 => Some(vec![true; l]),
            _ => None,
        },
        activation: match arch {
            _ if gemma || gpt2 => Activation::GeluTanh,
            Arch::Falcon | Arch::GptNeoX => Activation::Gelu,
            _ => Activation::Silu,
        },
        norm_plus_one: gemma,
        scale_embedding: gemma,
        norm_place: match arch {
            _ if gemma => NormPlace::Sandwich,
            Arch::Olmo2 => NormPlace::Post,
            _ => NormPlace::Pre,
        },
        attn_scale: 1.0 / (hd as f32).sqrt(),
        embedding_multiplier: 1.0,
        residual_multiplier: 1.0,
        logits_scaling: 1.0,
        attn_softcap: gemma2.then_some(50.0),
        final_softcap: gemma2.then_some(30.0),
        // (experts, a token, columns each, renormalized, shared expert's columns):
        // Qwen1.5-MoE-A2.7B, Qwen3-30B-A3B, Mixtral 8x7B.
        moe: match arch {
            Arch::Qwen2Moe => Some((60, 4, 1408, false, 5632)),
            Arch::Qwen3Moe => Some((128, 8, 768, true, 0)),
            Arch::Mixtral => Some((8, 2, ff, true, 0)),
            _ => None,
        }
        .map(|(experts, per_token, expert_ffn, norm_topk, shared_ffn)| Moe {
            experts,
            per_token,
            expert_ffn,
            norm_topk,
            shared_ffn,
            sparse: vec![true; l],
        }),
        bos_token_id: None,
        eos_token_ids: Vec::new(),
    })
}

/// `cfg` cut to its first `n` layers (1 to all of them): a slice of a model too large for the
/// machine, whose decode steps read its layers as the whole model's do.
pub fn first_layers(mut cfg: ModelConfig, n: usize) -> Result<ModelConfig> {
    if !(1..=cfg.n_layers).contains(&n) {
        return Err(Error::Input(format!(
            "--shape-layers {n}: expected 1 to the shape's {} layers",
            cfg.n_layers
        )));
    }
    cfg.n_layers = n;
    for flags in [&mut cfg.local_layers, &mut cfg.no_rope_layers].into_iter().flatten() {
        flags.truncate(n);
    }
    if let Some(m) = &mut cfg.moe {
        m.sparse.truncate(n);
    }
    Ok(cfg)
}

pub struct Synthetic {
    pub dtype: DType,
    pub seed: u64,
}

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Synthetic {
    /// (scale, offset) of a tensor's values, by its role.
    fn law(name: &str, n_cols: usize) -> (f32, f32) {
        if name.ends_with("norm.weight") || name.ends_with("ln_f.weight") {
            (0.1, 1.0)
        } else if name.ends_with(".bias") {
            (0.1, 0.0)
        } else if [
            "model.embed_tokens.weight",
            "transformer.word_embeddings.weight",
            "gpt_neox.embed_in.weight",
        ]
        .contains(&name)
        {
            (1.0, 0.0)
        } else {
            ((3.0 / n_cols as f32).sqrt(), 0.0)
        }
    }

    /// Vectors (norms, biases) are f32; matrices are in the chosen dtype.
    fn dtype_of(&self, shape: &[usize]) -> DType {
        if shape.len() == 1 {
            DType::F32
        } else {
            self.dtype
        }
    }

    fn values(&self, name: &str, shape: &[usize], rows: Range<usize>, cols: Range<usize>) -> Mat {
        let n_cols = matrix_dims(shape).1;
        let key = splitmix(self.seed ^ crate::fnv1a(name));
        let (scale, offset) = Self::law(name, n_cols);
        let width = cols.len();
        let value = |r: usize, c: usize| {
            let u = splitmix(key ^ (r * n_cols + c) as u64);
            ((u >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale + offset
        };
        let mut v = vec![0.0f32; rows.len() * width];
        v.par_chunks_mut(width.max(1)).enumerate().for_each(|(i, row)| {
            for (j, x) in row.iter_mut().enumerate() {
                *x = value(rows.start + i, cols.start + j);
            }
        });
        let dtype = self.dtype_of(shape);
        let data = match dtype {
            DType::F32 => Data::F32(v),
            DType::BF16 => Data::BF16(v.par_iter().map(|&x| bf16::from_f32(x)).collect()),
            DType::F16 => Data::F16(v.par_iter().map(|&x| f16::from_f32(x)).collect()),
        };
        Mat { rows: rows.len(), cols: width, data }
    }
}

impl Source for Synthetic {
    fn rows(&self, name: &str, shape: &[usize], rows: Range<usize>) -> Result<Mat> {
        Ok(self.values(name, shape, rows, 0..matrix_dims(shape).1))
    }
    fn block(&self, name: &str, shape: &[usize], rows: Range<usize>, cols: Range<usize>) -> Result<Mat> {
        Ok(self.values(name, shape, rows, cols))
    }
    fn dtype(&self, _name: &str, shape: &[usize]) -> Result<DType> {
        Ok(self.dtype_of(shape))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_are_slices_of_one_model() {
        let s = Synthetic { dtype: DType::F32, seed: 7 };
        let shape = [6, 10];
        let full = s.rows("w", &shape, 0..6).unwrap().data.to_f32_vec();
        let part = s.rows("w", &shape, 2..4).unwrap().data.to_f32_vec();
        assert_eq!(&full[20..40], &part[..]);
        let cols = s.cols("w", &shape, 3..7).unwrap().data.to_f32_vec();
        assert_eq!(cols[4..8], full[13..17]);
        assert!(full.iter().any(|&x| x != 0.0));
        for n in SHAPES {
            assert!(super::shape(n).is_ok());
        }
    }

    #[test]
    fn a_shape_cut_to_its_first_layers() {
        let cut = first_layers(shape("gemma3-1b").unwrap(), 7).unwrap();
        assert_eq!((cut.n_layers, cut.local_layers.as_ref().map(Vec::len)), (7, Some(7)));
        let cut = first_layers(shape("qwen3-30b-a3b").unwrap(), 3).unwrap();
        assert_eq!(cut.moe.map(|m| m.sparse.len()), Some(3));
        for n in [0, 49] {
            let e = first_layers(shape("qwen3-30b-a3b").unwrap(), n).unwrap_err().to_string();
            assert!(e.contains(&format!("--shape-layers {n}: expected 1 to the shape's 48 layers")), "{e}");
        }
    }
}
