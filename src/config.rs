//! HuggingFace `config.json` → [`ModelConfig`], the validated runtime description of a model.
//! Owns: parsing and checking model hyper-parameters. Must not touch weights or tokenizers.

use crate::error::{Error, Result};
use serde::Deserialize;
use std::path::Path;

/// The decoder families gridlm runs. They share one forward pass; they differ in details
/// recorded in [`ModelConfig`] (QKV bias, per-head q/k norms, sliding window) and, for Phi-3,
/// in how the checkpoint stores q/k/v and gate/up (fused, see `model::stored_rows`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
    Phi3,
}

impl Arch {
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Mistral => "mistral",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Phi3 => "phi3",
        }
    }
}

/// How RoPE frequencies are scaled for long context.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// Positions divided by `factor`.
    Linear { factor: f64 },
    /// Llama 3.1 frequency-dependent scaling.
    Llama3 { factor: f64, low_freq_factor: f64, high_freq_factor: f64, original_max_position_embeddings: f64 },
}

#[derive(Debug, Clone)]
pub struct ModelConfig {
    pub arch: Arch,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f64,
    pub rope_scaling: Option<RopeScaling>,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// Bias on q/k/v projections (Qwen2).
    pub qkv_bias: bool,
    /// An RMSNorm over each query and key head (weights of `head_dim`, shared by the heads)
    /// between the projection and RoPE (Qwen3).
    pub qk_norm: bool,
    /// Attend to at most this many previous positions (Mistral); `None` = full causal.
    pub sliding_window: Option<usize>,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

/// The `model_type`s gridlm runs, as errors list them.
const MODEL_TYPES: &str = "llama, mistral, qwen2, qwen3, phi3";

/// Raw `config.json` as HuggingFace writes it; only the fields gridlm reads.
#[derive(Deserialize)]
struct HfConfig {
    model_type: Option<String>,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    vocab_size: usize,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    rope_scaling: Option<serde_json::Value>,
    max_position_embeddings: Option<usize>,
    tie_word_embeddings: Option<bool>,
    attention_bias: Option<bool>,
    sliding_window: Option<usize>,
    use_sliding_window: Option<bool>,
    partial_rotary_factor: Option<f64>,
    hidden_act: Option<String>,
    bos_token_id: Option<serde_json::Value>,
    eos_token_id: Option<serde_json::Value>,
}

/// Token ids appear as a number, a list of numbers, or null.
fn token_ids(v: &Option<serde_json::Value>) -> Vec<u32> {
    match v {
        Some(serde_json::Value::Number(n)) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
        Some(serde_json::Value::Array(a)) => a.iter().filter_map(|x| x.as_u64()).map(|x| x as u32).collect(),
        _ => Vec::new(),
    }
}

impl ModelConfig {
    /// Reads `DIR/config.json` and, when present, the EOS ids of `DIR/generation_config.json`.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        if dir.is_file() {
            return Err(Error::file(
                dir,
                "a file, not a model folder (one holding config.json, the safetensors files and tokenizer.json)",
            ));
        }
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
        let mut cfg = Self::from_json(&path, &text)?;
        let gen_path = dir.join("generation_config.json");
        if let Ok(gen_text) = std::fs::read_to_string(&gen_path) {
            let gen: serde_json::Value = serde_json::from_str(&gen_text)
                .map_err(|e| Error::file(&gen_path, format!("invalid JSON: {e}")))?;
            for id in token_ids(&gen.get("eos_token_id").cloned()) {
                if !cfg.eos_token_ids.contains(&id) {
                    cfg.eos_token_ids.push(id);
                }
            }
        }
        Ok(cfg)
    }

    /// Parses and validates config text; `path` is only used in error messages.
    pub fn from_json(path: &Path, text: &str) -> Result<Self> {
        let bad = |msg: String| Error::file(path, msg);
        let raw: HfConfig = serde_json::from_str(text).map_err(|e| bad(format!("invalid config: {e}")))?;
        let model_type = raw
            .model_type
            .clone()
            .ok_or_else(|| bad(format!("missing field `model_type` (expected one of {MODEL_TYPES})")))?;
        let arch = match model_type.as_str() {
            "llama" => Arch::Llama,
            "mistral" => Arch::Mistral,
            "qwen2" => Arch::Qwen2,
            "qwen3" => Arch::Qwen3,
            "phi3" => Arch::Phi3,
            other => {
                return Err(bad(format!("unsupported model_type `{other}` (expected one of {MODEL_TYPES})")))
            }
        };
        if let Some(act) = &raw.hidden_act {
            if act != "silu" {
                return Err(bad(format!("unsupported hidden_act `{act}` (expected silu)")));
            }
        }
        let n_heads = raw.num_attention_heads;
        let n_kv_heads = raw.num_key_value_heads.unwrap_or(n_heads);
        let positive = [
            ("hidden_size", raw.hidden_size),
            ("intermediate_size", raw.intermediate_size),
            ("num_hidden_layers", raw.num_hidden_layers),
            ("num_attention_heads", n_heads),
            ("num_key_value_heads", n_kv_heads),
            ("vocab_size", raw.vocab_size),
        ];
        for (name, v) in positive {
            if v == 0 {
                return Err(bad(format!("`{name}` is 0 (expected a positive number)")));
            }
        }
        if !n_heads.is_multiple_of(n_kv_heads) {
            return Err(bad(format!(
                "num_attention_heads ({n_heads}) is not a multiple of num_key_value_heads ({n_kv_heads})"
            )));
        }
        let head_dim = match raw.head_dim {
            Some(d) => d,
            None => {
                if !raw.hidden_size.is_multiple_of(n_heads) {
                    return Err(bad(format!(
                        "hidden_size ({}) is not a multiple of num_attention_heads ({n_heads}) and no head_dim is given",
                        raw.hidden_size
                    )));
                }
                raw.hidden_size / n_heads
            }
        };
        if head_dim == 0 || head_dim % 2 != 0 {
            return Err(bad(format!("head_dim {head_dim} must be even and positive (RoPE rotates pairs)")));
        }
        if let Some(f) = raw.partial_rotary_factor.filter(|&f| f != 1.0) {
            return Err(bad(format!(
                "partial_rotary_factor {f} is not supported (RoPE rotates whole heads here: expected 1 or none)"
            )));
        }
        // Numbers that would turn every hidden state or rotation into NaN or infinity.
        let eps = raw.rms_norm_eps.unwrap_or(1e-6);
        if !(eps.is_finite() && eps >= 0.0) {
            return Err(bad(format!("rms_norm_eps {eps} must be a finite number, not negative")));
        }
        let rope_theta = raw.rope_theta.unwrap_or(10000.0);
        if !(rope_theta.is_finite() && rope_theta > 0.0) {
            return Err(bad(format!("rope_theta {rope_theta} must be a finite positive number")));
        }
        let rope_scaling = match &raw.rope_scaling {
            None | Some(serde_json::Value::Null) => None,
            Some(v) => Some(parse_rope_scaling(v).map_err(bad)?),
        };
        let sliding_window = match (arch, raw.use_sliding_window) {
            (Arch::Qwen2 | Arch::Qwen3, Some(true)) => {
                return Err(bad(format!("use_sliding_window = true is not supported for {model_type}")));
            }
            (Arch::Mistral | Arch::Phi3, _) if raw.sliding_window == Some(0) => {
                return Err(bad(
                    "sliding_window is 0 (expected a positive number of positions, or null)".into()
                ));
            }
            (Arch::Mistral | Arch::Phi3, _) => raw.sliding_window,
            _ => None,
        };
        let eos_token_ids = token_ids(&raw.eos_token_id);
        Ok(ModelConfig {
            arch,
            hidden_size: raw.hidden_size,
            intermediate_size: raw.intermediate_size,
            n_layers: raw.num_hidden_layers,
            n_heads,
            n_kv_heads,
            head_dim,
            vocab_size: raw.vocab_size,
            rms_norm_eps: eps as f32,
            rope_theta,
            rope_scaling,
            max_position_embeddings: raw.max_position_embeddings.unwrap_or(4096),
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(false),
            qkv_bias: arch == Arch::Qwen2 || raw.attention_bias.unwrap_or(false),
            qk_norm: arch == Arch::Qwen3,
            sliding_window,
            bos_token_id: token_ids(&raw.bos_token_id).first().copied(),
            eos_token_ids,
        })
    }

    /// RoPE inverse frequencies, one per rotated pair, with any scaling applied.
    pub fn rope_inv_freq(&self) -> Vec<f64> {
        let d = self.head_dim as f64;
        (0..self.head_dim / 2)
            .map(|i| {
                let f = 1.0 / self.rope_theta.powf(2.0 * i as f64 / d);
                match &self.rope_scaling {
                    None => f,
                    Some(RopeScaling::Linear { factor }) => f / factor,
                    Some(RopeScaling::Llama3 {
                        factor,
                        low_freq_factor,
                        high_freq_factor,
                        original_max_position_embeddings: old,
                    }) => {
                        let wavelen = 2.0 * std::f64::consts::PI / f;
                        if wavelen < old / high_freq_factor {
                            f
                        } else if wavelen > old / low_freq_factor {
                            f / factor
                        } else {
                            let smooth =
                                (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * f / factor + smooth * f
                        }
                    }
                }
            })
            .collect()
    }

    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
}

fn parse_rope_scaling(v: &serde_json::Value) -> std::result::Result<RopeScaling, String> {
    let kind = v
        .get("rope_type")
        .or_else(|| v.get("type"))
        .and_then(|t| t.as_str())
        .ok_or("rope_scaling has no `rope_type`")?;
    let num = |k: &str| {
        let x = v.get(k).and_then(|x| x.as_f64());
        let x = x.ok_or(format!("rope_scaling of type `{kind}` lacks the number `{k}`"))?;
        if x.is_finite() && x > 0.0 {
            Ok(x)
        } else {
            Err(format!("rope_scaling's `{k}` is {x} (expected a finite positive number)"))
        }
    };
    match kind {
        "linear" => Ok(RopeScaling::Linear { factor: num("factor")? }),
        "llama3" => Ok(RopeScaling::Llama3 {
            factor: num("factor")?,
            low_freq_factor: num("low_freq_factor")?,
            high_freq_factor: num("high_freq_factor")?,
            original_max_position_embeddings: num("original_max_position_embeddings")?,
        }),
        other => Err(format!("unsupported rope_scaling type `{other}` (expected linear or llama3)")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<ModelConfig> {
        ModelConfig::from_json(Path::new("config.json"), text)
    }

    const BASE: &str = r#"{"model_type":"llama","hidden_size":64,"intermediate_size":128,
        "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"vocab_size":100}"#;

    /// [`BASE`] as `model_type` with the fields `extra` (JSON members, comma-separated) added.
    fn config(model_type: &str, extra: &str) -> String {
        BASE.replace("llama", model_type)
            .replace("\"vocab_size\":100", &format!("\"vocab_size\":100,{extra}"))
    }

    #[test]
    fn defaults_and_head_dim() {
        let c = parse(BASE).unwrap();
        assert_eq!(c.head_dim, 16);
        assert_eq!(c.rope_theta, 10000.0);
        assert!(!c.tie_word_embeddings);
    }

    #[test]
    fn errors_name_the_field() {
        let e = parse(r#"{"model_type":"llama","hidden_size":1}"#).unwrap_err().to_string();
        assert!(e.contains("missing field `intermediate_size`"), "{e}");
        let e = parse(&BASE.replace("llama", "bert")).unwrap_err().to_string();
        assert!(e.contains("unsupported model_type `bert`"), "{e}");
        let e = parse(&BASE.replace("\"num_key_value_heads\":2", "\"num_key_value_heads\":3")).unwrap_err();
        assert!(e.to_string().contains("not a multiple"), "{e}");
    }

    #[test]
    fn numbers_that_would_make_nan_are_errors() {
        let cases = [
            (r#""rms_norm_eps":-1e-6"#, "rms_norm_eps -0.000001 must be"),
            (r#""rope_theta":0"#, "rope_theta 0 must be"),
            (r#""rope_theta":-10000"#, "rope_theta -10000 must be"),
            (r#""rope_scaling":{"type":"linear","factor":0}"#, "rope_scaling's `factor` is 0"),
            (
                r#""rope_scaling":{"rope_type":"llama3","factor":8,"low_freq_factor":-1,"high_freq_factor":4,
                   "original_max_position_embeddings":8192}"#,
                "rope_scaling's `low_freq_factor` is -1",
            ),
        ];
        for (extra, msg) in cases {
            let e = parse(&config("llama", extra)).unwrap_err().to_string();
            assert!(e.contains(msg), "{extra}: {e}");
        }
        let e = parse(&config("mistral", r#""sliding_window":0"#)).unwrap_err().to_string();
        assert!(e.contains("sliding_window is 0"), "{e}");
        // Zero epsilon and a null window are allowed.
        assert!(parse(&config("llama", r#""rms_norm_eps":0"#)).is_ok());
        assert_eq!(parse(&config("mistral", r#""sliding_window":null"#)).unwrap().sliding_window, None);
    }

    #[test]
    fn qwen3_has_head_norms_an_explicit_head_dim_and_no_bias() {
        let c = parse(&config("qwen3", r#""head_dim":32"#)).unwrap();
        assert_eq!(
            (c.arch, c.head_dim, c.q_dim(), c.qk_norm, c.qkv_bias),
            (Arch::Qwen3, 32, 128, true, false)
        );
        assert!(parse(&config("qwen3", r#""head_dim":32,"attention_bias":true"#)).unwrap().qkv_bias);
        let e =
            parse(&config("qwen3", r#""head_dim":32,"use_sliding_window":true"#)).unwrap_err().to_string();
        assert!(e.contains("use_sliding_window = true is not supported for qwen3"), "{e}");
        // The others have no head norms.
        assert!(!parse(BASE).unwrap().qk_norm);
        assert!(!parse(&BASE.replace("llama", "qwen2")).unwrap().qk_norm);
    }

    #[test]
    fn phi3_keeps_its_window_and_refuses_a_partial_rotation() {
        let c = parse(&config("phi3", r#""sliding_window":2047"#)).unwrap();
        assert_eq!((c.arch, c.sliding_window, c.qkv_bias, c.qk_norm), (Arch::Phi3, Some(2047), false, false));
        let e = parse(&config("phi3", r#""partial_rotary_factor":0.75"#)).unwrap_err().to_string();
        assert!(e.contains("partial_rotary_factor 0.75 is not supported"), "{e}");
        assert!(parse(&config("phi3", r#""partial_rotary_factor":1.0"#)).is_ok());
        let e = parse(&config("phi3", r#""sliding_window":0"#)).unwrap_err().to_string();
        assert!(e.contains("sliding_window is 0"), "{e}");
    }

    #[test]
    fn llama3_scaling_keeps_high_freqs() {
        let text = config(
            "llama",
            r#""rope_scaling":{"rope_type":"llama3","factor":8.0,"low_freq_factor":1.0,
               "high_freq_factor":4.0,"original_max_position_embeddings":8192}"#,
        );
        let c = parse(&text).unwrap();
        let f = c.rope_inv_freq();
        assert_eq!(f[0], 1.0);
        let unscaled = 1.0 / 10000f64.powf(2.0 * 7.0 / 16.0);
        assert!((f[7] - unscaled / 8.0).abs() < 1e-12);
    }
}
