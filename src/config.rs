//! HuggingFace `config.json` → [`ModelConfig`], the validated runtime description of a model.
//! Owns: parsing and checking model hyper-parameters. Must not touch weights or tokenizers.

use crate::error::{Error, Result};
pub use crate::kernels::Activation;
use serde::Deserialize;
use std::path::Path;

/// The decoder families gridlm runs. They share one forward pass; they differ in details
/// recorded in [`ModelConfig`] (QKV bias, per-head or whole-width q/k norms, sliding window,
/// where the norms sit, activation, local layers, soft-capping and mixtures of experts) and in
/// how the checkpoint names and stores some tensors (Phi-3's fused q/k/v and gate/up, see
/// `model::stored_rows`; experts', `model::expert_names`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
    Phi3,
    /// SmolLM3: Llama with some layers unrotated (NoPE).
    SmolLM3,
    /// The first Gemma (`gemma`).
    Gemma,
    Gemma2,
    /// Gemma 3's text model (`gemma3_text`).
    Gemma3,
    /// The first OLMo (`olmo`: OLMo-1B/7B-hf, OLMo-1.7): Llama with LayerNorms that have no
    /// weights or biases, and q, k and v clamped where `clip_qkv` says.
    Olmo,
    /// OLMo 2: norms on the sublayers' outputs only, q and k normed over their whole width.
    Olmo2,
    /// Qwen2 with mixture-of-experts FFNs and a shared expert (`qwen2_moe`).
    Qwen2Moe,
    /// Qwen3 with mixture-of-experts FFNs (`qwen3_moe`).
    Qwen3Moe,
    /// Qwen3-VL-MoE's text model (`qwen3_vl_moe_text`): Qwen3-MoE whose experts' shares are
    /// always renormalized and whose experts are stored per layer in two transposed stacks
    /// (`mlp.experts.gate_up_proj` `[experts, hidden, 2 · ffn]`, `mlp.experts.down_proj`
    /// `[experts, ffn, hidden]`).
    Qwen3VlMoe,
    /// Mistral with mixture-of-experts FFNs (`mixtral`).
    Mixtral,
    /// IBM's Granite 3 (`granite`): Llama with multipliers of the embedding, the attention
    /// scores, each sublayer's output and the logits.
    Granite,
    /// IBM's Granite 4 (`granitemoehybrid`) when every layer is attention and none has
    /// experts (Granite 4.0 Micro): Granite with its FFN's gate and up rows stored in one
    /// tensor (`shared_mlp.input_linear`), and RoPE only if `position_embedding_type` says so.
    GraniteMoeHybrid,
    /// IBM's GraniteMoE (`granitemoe`: Granite 3's 1B-A400M and 3B-A800M): Granite with
    /// Mixtral's mixture of experts on every layer, each layer's experts stacked in one tensor.
    GraniteMoe,
    /// GLM-4-0414 (`glm4`): Llama with q/k/v biases, Phi-3's fused `gate_up_proj`, RoPE on
    /// interleaved pairs over the first half of each head, and norms on the sublayers' outputs
    /// too (`post_self_attn_layernorm`, `post_mlp_layernorm`).
    Glm4,
    /// The first GLM-4 in HF's form (`glm`: glm-4-9b-chat-hf): GLM-4-0414 without the norms of
    /// the sublayers' outputs.
    Glm,
    /// StarCoder 2 (`starcoder2`): LayerNorms (with biases), biases on every projection
    /// (`use_bias`), and a plain FFN, `c_proj(act(c_fc(x)))`, without a gate.
    Starcoder2,
    /// StableLM 2 and StableLM-3B-4E1T (`stablelm`): Llama with LayerNorms (with biases), RoPE
    /// over a quarter of each head, and q/k/v biases where `use_qkv_bias` says.
    StableLm,
    /// Phi-1.5 and Phi-2 (`phi`): LayerNorms with biases, biases on every projection and on the
    /// output head, an FFN without a gate (`fc1`, GELU, `fc2`), RoPE over part of each head, and
    /// the attention and the FFN both reading the one norm of the layer's input, their outputs
    /// added to it together (a parallel residual).
    Phi,
    /// Kyutai's Helium (`helium`: helium-1-2b): Llama with RoPE on interleaved pairs (GLM's
    /// form, over the whole head).
    Helium,
    /// TII's Falcon (`falcon`: Falcon-7B/40B/180B, Falcon2-11B): LayerNorms (with biases), q,
    /// k and v fused in one tensor grouped by KV head (each group's queries, then its key, then
    /// its value), an FFN without a gate (`dense_h_to_4h`, GELU, `dense_4h_to_h`), a parallel
    /// residual (Falcon-7B: one norm read by both; Falcon-40B: `ln_attn` and `ln_mlp` of the
    /// same input) or, where `parallel_attn` is false, a sequential one; names under
    /// `transformer.`.
    Falcon,
    /// EleutherAI's GPT-NeoX (`gpt_neox`: Pythia, GPT-NeoX-20B): Falcon's q, k and v stored head
    /// by head in one tensor, with biases on it, on `dense` and on both FFN matrices,
    /// LayerNorms, RoPE over part of each head (`rotary_pct`), an FFN without a gate, and a
    /// parallel residual whose FFN reads a norm of the layer's input of its own
    /// (`post_attention_layernorm`) or, where `use_parallel_residual` is false, a sequential
    /// one; names under `gpt_neox.`.
    GptNeoX,
    /// OpenAI's GPT-2 (`gpt2`: GPT-2, DistilGPT2, DialoGPT, Cerebras-GPT): learned absolute
    /// positions (`wpe`) added to the token embedding, no RoPE, LayerNorms, biases on every
    /// projection, q, k and v one after another in `attn.c_attn`, an FFN without a gate
    /// (`c_fc`, GELU, `c_proj`), and every matrix stored transposed (`Conv1D`, `[in, out]`);
    /// names under `transformer.` (or none, in folders saved from the bare model).
    Gpt2,
    /// BigCode's GPT-BigCode (`gpt_bigcode`: StarCoder, StarCoderBase, SantaCoder,
    /// WizardCoder): GPT-2 with `nn.Linear` matrices (`[out, in]`) and one KV head
    /// (`multi_query`, q, k, v one after another in `c_attn`) or, without it, q, k and v
    /// stored head by head (GPT-NeoX's layout).
    GptBigCode,
}

impl Arch {
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Mistral => "mistral",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Phi3 => "phi3",
            Arch::SmolLM3 => "smollm3",
            Arch::Gemma => "gemma",
            Arch::Gemma2 => "gemma2",
            Arch::Gemma3 => "gemma3_text",
            Arch::Olmo => "olmo",
            Arch::Helium => "helium",
            Arch::Olmo2 => "olmo2",
            Arch::Qwen2Moe => "qwen2_moe",
            Arch::Qwen3Moe => "qwen3_moe",
            Arch::Qwen3VlMoe => "qwen3_vl_moe_text",
            Arch::Mixtral => "mixtral",
            Arch::Granite => "granite",
            Arch::GraniteMoeHybrid => "granitemoehybrid",
            Arch::GraniteMoe => "granitemoe",
            Arch::Glm4 => "glm4",
            Arch::Glm => "glm",
            Arch::Starcoder2 => "starcoder2",
            Arch::StableLm => "stablelm",
            Arch::Phi => "phi",
            Arch::Falcon => "falcon",
            Arch::GptNeoX => "gpt_neox",
            Arch::Gpt2 => "gpt2",
            Arch::GptBigCode => "gpt_bigcode",
        }
    }
}

/// HF's defaults (its config classes', transformers 4.5x–5) for the settings a family's
/// config.json may leave out.
struct HfDefaults {
    max_position_embeddings: usize,
    /// Of the family's norms, by whatever key it names their epsilon.
    eps: f64,
    rope_theta: f64,
    /// Its `hidden_act` (Gemma's `hidden_activation`).
    act: &'static str,
    /// Its `sliding_window` where the key is absent (a null says none).
    window: Option<usize>,
}

impl Arch {
    fn hf_defaults(self) -> HfDefaults {
        use Arch::*;
        let (max_position_embeddings, eps, rope_theta) = match self {
            Llama | Granite | GraniteMoeHybrid | GraniteMoe => (2048, 1e-6, 1e4),
            Olmo | Olmo2 | Phi | Falcon | GptNeoX => (2048, 1e-5, 1e4),
            Gpt2 | GptBigCode => (1024, 1e-5, 1e4),
            Phi3 | Starcoder2 | StableLm => (4096, 1e-5, 1e4),
            Helium => (4096, 1e-8, 1e5),
            Gemma | Gemma2 => (8192, 1e-6, 1e4),
            Qwen2 | Qwen2Moe | Qwen3 | Qwen3Moe => (32768, 1e-6, 1e4),
            Qwen3VlMoe => (128000, 1e-6, 5e5),
            SmolLM3 => (32768, 1e-6, 2e6),
            Mistral => (131072, 1e-6, 1e4),
            Mixtral => (131072, 1e-5, 1e6),
            Gemma3 => (131072, 1e-6, 1e6),
            Glm | Glm4 => (131072, 1.5625e-7, 1e4),
        };
        let act = match self {
            Gemma | Gemma2 | Gemma3 | Starcoder2 | GptBigCode => "gelu_pytorch_tanh",
            Phi | Gpt2 => "gelu_new",
            Falcon | GptNeoX => "gelu",
            _ => "silu",
        };
        let window = matches!(self, Mistral | Gemma2 | Gemma3).then_some(4096);
        HfDefaults { max_position_embeddings, eps, rope_theta, act, window }
    }
}

/// How a layer rotates its queries and keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerRope {
    /// By `rope_theta` and `rope_scaling`.
    Base,
    /// By the local layers' base, unscaled (Gemma 3).
    Local,
    /// Not at all (SmolLM3's NoPE layers).
    None,
}

/// A mixture-of-experts FFN (Qwen2-MoE, Qwen3-MoE, Mixtral): a router (a Linear of `experts`
/// rows) scores each token, softmax over all experts; the token's `per_token` best go through
/// their own gate/up/down FFN of `expert_ffn` columns, weighted by their softmax shares
/// (renormalized to sum to one over the chosen when `norm_topk`), and summed. Qwen2-MoE adds a
/// shared expert every token goes through (`shared_ffn` columns, 0: none), weighted by
/// `sigmoid(x · g)` (its `shared_expert_gate`, one row).
#[derive(Debug, Clone, PartialEq)]
pub struct Moe {
    pub experts: usize,
    pub per_token: usize,
    pub expert_ffn: usize,
    pub norm_topk: bool,
    pub shared_ffn: usize,
    /// Which layers route through experts; the others have a dense FFN of
    /// `intermediate_size` columns (Qwen-MoE's `mlp_only_layers` and `decoder_sparse_step`).
    pub sparse: Vec<bool>,
}

impl Moe {
    /// The distinct experts a step's `tokens` tokens choose, expected when each chooses its
    /// own at random: `experts · (1 − (1 − per_token/experts)^tokens)` (`per_token` for one).
    /// A trained router's choices are not uniform, so a real step may choose fewer.
    pub fn expected_experts(&self, tokens: usize) -> f64 {
        let (e, k) = (self.experts as f64, self.per_token as f64);
        e * (1.0 - (1.0 - k / e).powi(tokens.max(1) as i32))
    }

    /// Weights of the shared expert and its gate, per column of the hidden state.
    fn shared_params(&self) -> usize {
        if self.shared_ffn > 0 {
            3 * self.shared_ffn + 1
        } else {
            0
        }
    }
}

/// Where a layer's RMSNorms sit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NormPlace {
    /// On each sublayer's input (`input_layernorm`, `post_attention_layernorm` before the FFN).
    Pre,
    /// On each sublayer's input and output (Gemma 2 and 3: `input_layernorm`,
    /// `pre_feedforward_layernorm`, and `post_attention_layernorm`, `post_feedforward_layernorm`
    /// on the outputs before they join the residual stream; GLM-4: `input_layernorm`,
    /// `post_attention_layernorm`, and `post_self_attn_layernorm`, `post_mlp_layernorm`).
    Sandwich,
    /// On each sublayer's output only (OLMo 2: `post_attention_layernorm`,
    /// `post_feedforward_layernorm`); the inputs go in as they are.
    Post,
}

/// How RoPE frequencies are scaled for long context.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// Positions divided by `factor`.
    Linear { factor: f64 },
    /// Llama 3.1 frequency-dependent scaling.
    Llama3 { factor: f64, low_freq_factor: f64, high_freq_factor: f64, original_max_position_embeddings: f64 },
    /// Phi-3's LongRoPE: rotated pair `i`'s frequency divided by `short[i]`, or by `long[i]`
    /// where a sequence runs past `original` positions ([`ModelConfig::long_rope`]), every
    /// cos and sin times `attention_factor`.
    LongRope { short: Vec<f64>, long: Vec<f64>, original: usize, attention_factor: f64 },
    /// YaRN: rotated pair `i`'s frequency divided by `factor` (interpolated) where it turns
    /// fewer than `beta_slow` times over the original context, kept (extrapolated) where more
    /// than `beta_fast`, a linear ramp over the pairs between (`keep[i]`: the kept share);
    /// every cos and sin times `attention_factor`.
    Yarn { factor: f64, keep: Vec<f64>, attention_factor: f64 },
}

impl RopeScaling {
    /// LongRoPE's attention factor where a config gives none, for a context `factor` times
    /// the `original` one (HF's `_compute_longrope_parameters`): √(1 + ln factor / ln original).
    pub fn longrope_attention_factor(factor: f64, original: usize) -> f64 {
        if factor <= 1.0 {
            1.0
        } else {
            (1.0 + factor.ln() / (original as f64).ln()).sqrt()
        }
    }

    /// YaRN's `get_mscale(factor, m)`: 1 + 0.1 · m · ln factor (1 where factor ≤ 1); its
    /// attention factor where a config names no other is that of m = 1.
    pub fn yarn_mscale(factor: f64, m: f64) -> f64 {
        if factor <= 1.0 {
            1.0
        } else {
            0.1 * m * factor.ln() + 1.0
        }
    }

    /// The inverse frequency `f` of rotated pair `i`, scaled (as HF's `rope_init_fn`s do;
    /// LongRoPE's short factors).
    pub fn scale(&self, i: usize, f: f64) -> f64 {
        match *self {
            RopeScaling::Linear { factor } => f / factor,
            RopeScaling::LongRope { ref short, .. } => f / short[i],
            RopeScaling::Yarn { factor, ref keep, .. } => f / factor * (1.0 - keep[i]) + f * keep[i],
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings: old,
            } => {
                let wavelen = 2.0 * std::f64::consts::PI / f;
                if wavelen < old / high_freq_factor {
                    f
                } else if wavelen > old / low_freq_factor {
                    f / factor
                } else {
                    let smooth = (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                    (1.0 - smooth) * f / factor + smooth * f
                }
            }
        }
    }
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
    /// Dimensions of each query and key head that RoPE rotates, from its first (HF's
    /// `int(head_dim · partial_rotary_factor)`: Phi-4-mini's three quarters); the rest pass.
    pub rotary_dim: usize,
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
    /// An RMSNorm over the whole q projection and the whole k projection (weights of `q_dim`
    /// and `kv_dim`) between the projection and RoPE (OLMo 2): under tensor parallelism each
    /// rank's share of the squares is summed over the stage.
    pub qk_norm_full: bool,
    /// Biases on o_proj and on the FFN's matrices too (StarCoder 2's `use_bias`), beside
    /// `qkv_bias`'s.
    pub linear_bias: bool,
    /// The norms are LayerNorms (the mean taken away, weights and biases) rather than RMSNorms
    /// (StarCoder 2).
    pub layer_norm: bool,
    /// The norms have no weights or biases to load (OLMo's LayerNorms: weights of one, biases
    /// of zero).
    pub weightless_norms: bool,
    /// Each q, k and v value (after its bias) clamped into `[-c, c]` before RoPE (OLMo's
    /// `clip_qkv`).
    pub clip_qkv: Option<f32>,
    /// The FFN is `down(act(gate(x)) · up(x))`; else `down(act(up(x)))` (StarCoder 2's `c_fc`
    /// and `c_proj`, Phi's `fc1` and `fc2`).
    pub gated_ffn: bool,
    /// The FFN reads the same norm of the layer's input as the attention, and both outputs
    /// join the residual stream (Phi's `x + attn(ln(x)) + ffn(ln(x))`).
    pub parallel_residual: bool,
    /// With `parallel_residual`, the FFN reads a norm of the layer's input of its own (Falcon-40B's
    /// `x + attn(ln_attn(x)) + ffn(ln_mlp(x))`).
    pub parallel_ffn_norm: bool,
    /// The output head has a bias (Phi's `lm_head.bias`).
    pub head_bias: bool,
    /// Positions are learned vectors added to the token embedding (GPT-2's `wpe`, one row per
    /// position up to `max_position_embeddings`); no layer rotates.
    pub learned_positions: bool,
    /// RoPE rotates the pairs `(2i, 2i + 1)` of a head's rotated dimensions (GLM's
    /// interleaved form) rather than `(i, i + rotary_dim/2)` (HF's "rotate half").
    pub rope_interleaved: bool,
    /// Attend to at most this many previous positions (Mistral; Gemma 2 and 3's local layers);
    /// `None` = full causal.
    pub sliding_window: Option<usize>,
    /// Which layers are local, attending through `sliding_window` with `rope_local_theta`
    /// (Gemma 2: every other one, Gemma 3: five of every six); `None`: every layer alike.
    pub local_layers: Option<Vec<bool>>,
    /// RoPE base of the local layers, unscaled (Gemma 3's `rope_local_base_freq`).
    pub rope_local_theta: Option<f64>,
    /// Layers whose queries and keys are not rotated at all (SmolLM3's NoPE layers).
    pub no_rope_layers: Option<Vec<bool>>,
    pub activation: Activation,
    /// Norm weights are stored as offsets from one: a norm multiplies by `1 + w` (Gemma).
    pub norm_plus_one: bool,
    /// Embedding rows are multiplied by `sqrt(hidden_size)` on the way in (Gemma).
    pub scale_embedding: bool,
    /// Where the layers' norms sit.
    pub norm_place: NormPlace,
    /// Factor of the attention scores: `1/sqrt(head_dim)`, Gemma's
    /// `1/sqrt(query_pre_attn_scalar)` or Granite's `attention_multiplier`.
    pub attn_scale: f32,
    /// Granite's multipliers (1 elsewhere): of the embedding rows on the way in
    /// (`embedding_multiplier`), of each sublayer's output before it joins the residual
    /// stream (`residual_multiplier`), and the divisor of the logits (`logits_scaling`).
    pub embedding_multiplier: f32,
    pub residual_multiplier: f32,
    pub logits_scaling: f32,
    /// Soft caps `c` of the attention scores and of the logits, each `c · tanh(x / c)`
    /// (Gemma 2's `attn_logit_softcapping` and `final_logit_softcapping`).
    pub attn_softcap: Option<f32>,
    pub final_softcap: Option<f32>,
    /// Mixture-of-experts FFNs (Qwen2-MoE, Qwen3-MoE, Mixtral); `None`: every FFN dense.
    pub moe: Option<Moe>,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

/// The `model_type`s gridlm runs, as errors list them.
const MODEL_TYPES: &str = "llama, mistral, qwen2, qwen3, phi3, smollm3, gemma, gemma2, gemma3_text, olmo, olmo2, qwen2_moe, qwen3_moe, mixtral, granite, granitemoehybrid, granitemoe, glm, glm4, starcoder2, stablelm, phi, helium, falcon, gpt_neox, gpt2, gpt_bigcode, and the image-and-text gemma3, mistral3, qwen2_vl, qwen2_5_vl, qwen3_vl and qwen3_vl_moe (their text models)";

/// Raw `config.json` as HuggingFace writes it; only the fields gridlm reads.
#[derive(Deserialize)]
struct HfConfig {
    model_type: Option<String>,
    hidden_size: usize,
    /// Every family's but Falcon's (its `ffn_hidden_size`, four times `hidden_size` where absent).
    intermediate_size: Option<usize>,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    vocab_size: usize,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    rope_scaling: Option<serde_json::Value>,
    max_position_embeddings: Option<usize>,
    original_max_position_embeddings: Option<usize>,
    tie_word_embeddings: Option<bool>,
    attention_bias: Option<bool>,
    mlp_bias: Option<bool>,
    /// Absent (`None`: the family's default) or given, perhaps as null.
    #[serde(default, deserialize_with = "present")]
    sliding_window: Option<Option<usize>>,
    use_sliding_window: Option<bool>,
    partial_rotary_factor: Option<f64>,
    norm_epsilon: Option<f64>,
    use_bias: Option<bool>,
    layer_norm_eps: Option<f64>,
    use_qkv_bias: Option<bool>,
    qk_layernorm: Option<bool>,
    use_parallel_residual: Option<bool>,
    hidden_act: Option<String>,
    hidden_activation: Option<String>,
    query_pre_attn_scalar: Option<f64>,
    rope_local_base_freq: Option<f64>,
    layer_types: Option<Vec<String>>,
    no_rope_layers: Option<Vec<u32>>,
    no_rope_layer_interval: Option<usize>,
    sliding_window_pattern: Option<usize>,
    attn_logit_softcapping: Option<f64>,
    final_logit_softcapping: Option<f64>,
    use_bidirectional_attention: Option<bool>,
    clip_qkv: Option<f64>,
    num_experts: Option<usize>,
    num_local_experts: Option<usize>,
    num_experts_per_tok: Option<usize>,
    moe_intermediate_size: Option<usize>,
    norm_topk_prob: Option<bool>,
    decoder_sparse_step: Option<usize>,
    mlp_only_layers: Option<Vec<usize>>,
    shared_expert_intermediate_size: Option<usize>,
    embedding_multiplier: Option<f64>,
    attention_multiplier: Option<f64>,
    residual_multiplier: Option<f64>,
    logits_scaling: Option<f64>,
    shared_intermediate_size: Option<usize>,
    position_embedding_type: Option<String>,
    layers_block_type: Option<Vec<String>>,
    bos_token_id: Option<serde_json::Value>,
    eos_token_id: Option<serde_json::Value>,
    // Falcon's.
    ffn_hidden_size: Option<usize>,
    layer_norm_epsilon: Option<f64>,
    activation: Option<String>,
    num_kv_heads: Option<usize>,
    multi_query: Option<bool>,
    new_decoder_architecture: Option<bool>,
    parallel_attn: Option<bool>,
    num_ln_in_parallel_attn: Option<usize>,
    bias: Option<bool>,
    alibi: Option<bool>,
    // GPT-NeoX's names for the RoPE base and the rotated part of a head (transformers 4's).
    rotary_emb_base: Option<f64>,
    rotary_pct: Option<f64>,
    // GPT-2's and GPT-BigCode's (their other keys renamed by `gpt2_keys`).
    scale_attn_weights: Option<bool>,
    scale_attn_by_inverse_layer_idx: Option<bool>,
    add_cross_attention: Option<bool>,
}

/// A key that is there, perhaps null (`Some(None)`); with `#[serde(default)]`, `None` where
/// the key is absent.
fn present<'de, D: serde::Deserializer<'de>, T: Deserialize<'de>>(
    d: D,
) -> std::result::Result<Option<Option<T>>, D::Error> {
    Option::<T>::deserialize(d).map(Some)
}

/// Token ids appear as a number, a list of numbers, or null.
fn token_ids(v: &Option<serde_json::Value>) -> Vec<u32> {
    match v {
        Some(serde_json::Value::Number(n)) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
        Some(serde_json::Value::Array(a)) => a.iter().filter_map(|x| x.as_u64()).map(|x| x as u32).collect(),
        _ => Vec::new(),
    }
}

/// The `quant_method` of a config.json's `quantization_config` (GPTQ, AWQ, bitsandbytes, FP8,
/// ...): its weights are stored in that method's tensors and types, not as plain matrices. At
/// the top (HF's place for it, an image-and-text folder's too) or in `text_config`.
fn quantized_before_saving(text: &str) -> Option<String> {
    let v: serde_json::Value = serde_json::from_str(text).ok()?;
    [&v, &v["text_config"]].iter().find_map(|c| {
        let q = c.get("quantization_config").filter(|q| !q.is_null())?;
        Some(q.get("quant_method").and_then(|m| m.as_str()).unwrap_or("unnamed").to_string())
    })
}

/// The error for a folder `dir` whose `config.json` (`path`) cannot be read (`e`), saying what
/// the folder holds instead where that tells what was meant: llama.cpp's files, a HuggingFace
/// hub cache's folder for a model (its model folders under `snapshots/`, one a revision), or
/// model folders below it.
fn without_config(dir: &Path, path: &Path, e: std::io::Error) -> Error {
    let named = crate::weights::checkpoint::files_named;
    let ggufs = named(dir, &[".gguf"], &[""]).len();
    if ggufs > 0 {
        let convert = crate::weights::gguf::CONVERT_HINT;
        return Error::file(
            path,
            format!("{e}, and the folder holds {}; {convert}", crate::count(ggufs, "GGUF file")),
        );
    }
    match named(&dir.join("snapshots"), &[""], &[""]).as_slice() {
        [] => {}
        [one] => {
            let at = dir.join("snapshots").join(one);
            return Error::file(
                path,
                format!("{e}; the folder is a HuggingFace hub cache's, its model folder is {}", at.display()),
            );
        }
        more => {
            let more: Vec<String> = more.iter().map(|r| format!("snapshots/{r}")).collect();
            let revisions = crate::weights::checkpoint::some_of(&more, 3);
            return Error::file(
                path,
                format!(
                    "{e}; the folder is a HuggingFace hub cache's, its model folder is one of {revisions}"
                ),
            );
        }
    }
    let mut models = named(dir, &[""], &[""]);
    models.retain(|n| dir.join(n).join("config.json").is_file());
    match models.len() {
        0 => Error::io(path, e),
        n => Error::file(
            path,
            format!(
                "{e}; the folder holds {}: {} (give one as --model)",
                crate::count(n, "model folder"),
                crate::weights::checkpoint::some_of(&models, 3)
            ),
        ),
    }
}

impl ModelConfig {
    /// Reads `DIR/config.json` and, when present, the EOS ids of `DIR/generation_config.json`.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        // What `gridlm convert` makes a folder of (llama.cpp's files), named as such.
        let convert = crate::weights::gguf::CONVERT_HINT;
        if dir.is_file() {
            return Err(Error::file(
                dir,
                if crate::weights::gguf::is_gguf(dir) {
                    format!("a GGUF file, not a model folder; {convert}")
                } else {
                    "a file, not a model folder (one holding config.json, the safetensors files and tokenizer.json)"
                        .into()
                },
            ));
        }
        if !dir.exists() {
            // Often a hub id (`HuggingFaceTB/SmolLM2-135M-Instruct`), as other tools take.
            return Err(Error::file(
                dir,
                "no such folder; --model takes a model folder on this machine (config.json, the safetensors files and tokenizer.json), gridlm downloads nothing",
            ));
        }
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| without_config(dir, &path, e))?;
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
        if let Some(method) = quantized_before_saving(text) {
            return Err(bad(format!(
                "quantization_config: weights quantized before saving (quant_method `{method}`) are not read; gridlm loads f32, bf16 or f16 weights (and quantizes them itself with --quant int8)"
            )));
        }
        if let Some(text_model) = image_text_config(text).map_err(bad)? {
            return Self::from_json(path, &text_model);
        }
        let legacy = legacy_rope_keys(text).map_err(bad)?;
        let text = legacy.as_deref().unwrap_or(text);
        let renamed = gpt2_keys(text).map_err(bad)?;
        let text = renamed.as_deref().unwrap_or(text);
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
            "smollm3" => Arch::SmolLM3,
            "gemma" => Arch::Gemma,
            "gemma2" => Arch::Gemma2,
            "gemma3_text" => Arch::Gemma3,
            "olmo" => Arch::Olmo,
            "helium" => Arch::Helium,
            "olmo2" => Arch::Olmo2,
            "qwen2_moe" => Arch::Qwen2Moe,
            "qwen3_moe" => Arch::Qwen3Moe,
            "qwen3_vl_moe_text" => Arch::Qwen3VlMoe,
            "mixtral" => Arch::Mixtral,
            "granite" => Arch::Granite,
            "granitemoehybrid" => Arch::GraniteMoeHybrid,
            "granitemoe" => Arch::GraniteMoe,
            "glm4" => Arch::Glm4,
            "glm" => Arch::Glm,
            "starcoder2" => Arch::Starcoder2,
            "stablelm" => Arch::StableLm,
            "phi" => Arch::Phi,
            "falcon" => Arch::Falcon,
            "gpt_neox" => Arch::GptNeoX,
            "gpt2" => Arch::Gpt2,
            "gpt_bigcode" => Arch::GptBigCode,
            other => {
                return Err(bad(format!("unsupported model_type `{other}` (expected one of {MODEL_TYPES})")))
            }
        };
        // Gemma 2 and 3 add sandwich norms, local layers and `query_pre_attn_scalar` to Gemma's
        // norms, activation and scaled embedding.
        let gemma23 = matches!(arch, Arch::Gemma2 | Arch::Gemma3);
        let gemma = gemma23 || arch == Arch::Gemma;
        let defaults = arch.hf_defaults();
        // Gemma's activation is `hidden_activation`, GELU's tanh form when it is not set (as
        // HF runs Gemma folders whose `hidden_act` says `gelu`).
        let act = match arch {
            _ if gemma => &raw.hidden_activation,
            Arch::Falcon => &raw.activation,
            _ => &raw.hidden_act,
        };
        let activation = match act.as_deref().unwrap_or(defaults.act) {
            "silu" => Activation::Silu,
            "gelu_pytorch_tanh" | "gelu_new" => Activation::GeluTanh,
            "gelu" => Activation::Gelu,
            act => {
                return Err(bad(format!(
                "unsupported hidden activation `{act}` (expected silu, gelu, gelu_new or gelu_pytorch_tanh)"
            )))
            }
        };
        // Soft caps, which HF's Gemma models apply when they are set.
        let [attn_softcap, final_softcap] = [
            ("attn_logit_softcapping", raw.attn_logit_softcapping),
            ("final_logit_softcapping", raw.final_logit_softcapping),
        ]
        .map(|(name, cap)| match cap.filter(|_| gemma23) {
            Some(c) => {
                finite_positive(name, c).map(|c| Some(c as f32)).map_err(|e| bad(format!("{e}, or null")))
            }
            None => Ok(None),
        });
        let (attn_softcap, final_softcap) = (attn_softcap?, final_softcap?);
        // Biases these families would carry on o_proj and the FFN's matrices, which gridlm does
        // not load (Qwen2's q/k/v biases are its own, whatever `attention_bias` says).
        // GLM's biases are on q, k and v alone (HF's GlmAttention has none on o_proj).
        let glm = matches!(arch, Arch::Glm | Arch::Glm4);
        let neox = arch == Arch::GptNeoX;
        let gpt2 = matches!(arch, Arch::Gpt2 | Arch::GptBigCode);
        for (key, on) in [
            ("add_cross_attention", raw.add_cross_attention),
            ("scale_attn_by_inverse_layer_idx", raw.scale_attn_by_inverse_layer_idx),
        ] {
            if on == Some(true) {
                return Err(bad(format!("{key} = true is not supported for {model_type}")));
            }
        }
        if neox && raw.attention_bias == Some(false) {
            return Err(bad(
                "attention_bias = false (q/k/v and dense without biases, the FFN's kept) is not supported for gpt_neox".into(),
            ));
        }
        if raw.attention_bias == Some(true) && !matches!(arch, Arch::Qwen2 | Arch::Qwen2Moe) && !glm && !neox
        {
            return Err(bad(format!(
                "attention_bias = true (biases on q/k/v and o_proj) is not supported for {model_type}"
            )));
        }
        if raw.mlp_bias == Some(true) {
            return Err(bad("mlp_bias = true (biases on the FFN's matrices) is not supported".into()));
        }
        // Per-head LayerNorms of q and k (StableLM 2 12B's, Phi's option) and StableLM 2 12B's
        // parallel residual (Phi's is always there).
        let refused = match arch {
            Arch::StableLm => {
                vec![("qk_layernorm", raw.qk_layernorm), ("use_parallel_residual", raw.use_parallel_residual)]
            }
            Arch::Phi => vec![("qk_layernorm", raw.qk_layernorm)],
            _ => Vec::new(),
        };
        if let Some((key, _)) = refused.iter().find(|(_, on)| *on == Some(true)) {
            return Err(bad(format!("{key} = true is not supported for {model_type}")));
        }
        // OLMo's bound on every q, k and v value.
        let clip_qkv = match raw.clip_qkv {
            Some(c) if arch == Arch::Olmo => Some(finite_positive("clip_qkv", c).map_err(bad)? as f32),
            Some(c) => {
                return Err(bad(format!("clip_qkv {c} is not supported for {model_type} (but for olmo)")));
            }
            None => None,
        };
        if raw.use_bidirectional_attention == Some(true) {
            return Err(bad(
                "use_bidirectional_attention = true is not supported (a causal decoder runs here)".into(),
            ));
        }
        let granite = matches!(arch, Arch::Granite | Arch::GraniteMoeHybrid | Arch::GraniteMoe);
        // Granite 4's dense FFN is its `shared_mlp`, of `shared_intermediate_size` columns.
        let intermediate_size = match arch {
            Arch::GraniteMoeHybrid => granite_hybrid_dense_ffn(&raw).map_err(bad)?,
            Arch::Falcon => raw.ffn_hidden_size.unwrap_or(4 * raw.hidden_size),
            _ => raw
                .intermediate_size
                .ok_or_else(|| bad("invalid config: missing field `intermediate_size`".into()))?,
        };
        let n_heads = raw.num_attention_heads;
        let falcon = match arch {
            Arch::Falcon => Some(falcon_layout(&raw).map_err(bad)?),
            _ => None,
        };
        let n_kv_heads = match &falcon {
            Some(f) => f.kv_heads,
            // GPT-NeoX's q, k and v stored head by head: a KV head per query head.
            None if neox || arch == Arch::Gpt2 => n_heads,
            None if arch == Arch::GptBigCode => {
                if raw.multi_query.unwrap_or(true) {
                    1
                } else {
                    n_heads
                }
            }
            None => raw.num_key_value_heads.unwrap_or(n_heads),
        };
        let positive = [
            ("hidden_size", raw.hidden_size),
            (
                match arch {
                    Arch::GraniteMoeHybrid => "shared_intermediate_size",
                    Arch::Falcon => "ffn_hidden_size",
                    _ => "intermediate_size",
                },
                intermediate_size,
            ),
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
        // Falcon's heads are always `hidden_size / num_attention_heads` wide.
        let head_dim = match raw.head_dim.filter(|_| !matches!(arch, Arch::Falcon | Arch::GptNeoX) && !gpt2) {
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
        // The families whose heads HF may rotate in part, each with HF's default part where the
        // config does not say (`None`: the whole head); the others rotate whole heads.
        let partial_default = match arch {
            Arch::Phi3 => Some(None),
            Arch::StableLm => Some(Some(0.25)),
            Arch::Phi | Arch::Glm | Arch::Glm4 => Some(Some(0.5)),
            Arch::GptNeoX => Some(Some(0.25)),
            _ => None,
        };
        let given_part = raw.partial_rotary_factor.or(raw.rotary_pct.filter(|_| neox));
        let rotary_dim = match given_part.or(partial_default.flatten()) {
            None => head_dim,
            Some(f) if f != 1.0 && partial_default.is_none() => {
                return Err(bad(format!(
                    "partial_rotary_factor {f} is not supported for {model_type} (RoPE over part of a head: phi's, phi3's, stablelm's, glm's, glm4's and gpt_neox's)"
                )));
            }
            Some(f) => {
                let d = (head_dim as f64 * f) as usize;
                if !(f > 0.0 && f <= 1.0) || d == 0 || !d.is_multiple_of(2) {
                    return Err(bad(format!(
                        "partial_rotary_factor {f} rotates {d} of a head's {head_dim} dimensions (expected a factor in (0, 1] giving an even number above 0)"
                    )));
                }
                d
            }
        };
        // Numbers that would turn every hidden state or rotation into NaN or infinity.
        // HF's defaults where the config is silent.
        let (starcoder2, phi) = (arch == Arch::Starcoder2, arch == Arch::Phi);
        // The norms' epsilon: its key in the family's config and the value given.
        let (key, given) = match arch {
            Arch::Starcoder2 => ("norm_epsilon", raw.norm_epsilon),
            Arch::StableLm | Arch::Phi | Arch::GptNeoX => ("layer_norm_eps", raw.layer_norm_eps),
            Arch::Falcon | Arch::Gpt2 | Arch::GptBigCode => ("layer_norm_epsilon", raw.layer_norm_epsilon),
            // HF's OlmoLayerNorm: always 1e-5, whatever the config says.
            Arch::Olmo => ("", None),
            _ => ("rms_norm_eps", raw.rms_norm_eps),
        };
        let eps = given.unwrap_or(defaults.eps);
        if !(eps.is_finite() && eps >= 0.0) {
            return Err(bad(format!("{key} {eps} must be a finite number, not negative")));
        }
        let theta = raw.rope_theta.or(raw.rotary_emb_base.filter(|_| neox));
        let rope_theta = finite_positive("rope_theta", theta.unwrap_or(defaults.rope_theta)).map_err(bad)?;
        let max_position_embeddings = raw.max_position_embeddings.unwrap_or(defaults.max_position_embeddings);
        let window = raw.sliding_window.unwrap_or(defaults.window);
        let rope_scaling = match &raw.rope_scaling {
            None | Some(serde_json::Value::Null) => None,
            // HF's unscaled RoPE, as transformers 5 names it.
            Some(v) if [v.get("rope_type"), v.get("type")].iter().flatten().any(|t| *t == "default") => None,
            Some(v) => Some(
                parse_rope_scaling(
                    v,
                    (rotary_dim, rope_theta),
                    max_position_embeddings,
                    raw.original_max_position_embeddings,
                )
                .map_err(bad)?,
            ),
        };
        let sliding_window = match (arch, raw.use_sliding_window) {
            (
                Arch::Qwen2
                | Arch::Qwen2Moe
                | Arch::Qwen3
                | Arch::Qwen3Moe
                | Arch::Qwen3VlMoe
                | Arch::SmolLM3,
                Some(true),
            ) => {
                return Err(bad(format!("use_sliding_window = true is not supported for {model_type}")));
            }
            (
                Arch::Mistral | Arch::Mixtral | Arch::Phi3 | Arch::Starcoder2 | Arch::Gemma2 | Arch::Gemma3,
                _,
            ) if window == Some(0) => {
                return Err(bad(
                    "sliding_window is 0 (expected a positive number of positions, or null)".into()
                ));
            }
            // A window at least as long as the context leaves out no key: none, so no rings
            // and the prefix cache kept.
            (Arch::Mistral | Arch::Mixtral | Arch::Phi3 | Arch::Starcoder2, _) => {
                window.filter(|&w| w < max_position_embeddings)
            }
            // Gemma's local layers always have a window: HF's default where it is null.
            (Arch::Gemma2 | Arch::Gemma3, _) => Some(window.unwrap_or(4096)),
            _ => None,
        };
        let local_layers = match arch {
            // Gemma 2: every other layer local, from the first; Gemma 3: five of every six.
            Arch::Gemma2 => Some(gemma_local_layers(&raw, 2).map_err(bad)?),
            Arch::Gemma3 => Some(gemma_local_layers(&raw, 6).map_err(bad)?),
            _ => None,
        };
        let no_rope_layers = match arch {
            Arch::SmolLM3 => Some(smollm3_no_rope_layers(&raw).map_err(bad)?),
            // Granite 4 rotates only when asked (its hybrid models' attention has no positions).
            // GPT-2's positions are in its embedding.
            Arch::Gpt2 | Arch::GptBigCode => Some(vec![true; raw.num_hidden_layers]),
            Arch::GraniteMoeHybrid => match raw.position_embedding_type.as_deref() {
                Some("rope") => None,
                None => Some(vec![true; raw.num_hidden_layers]),
                Some(other) => {
                    return Err(bad(format!(
                        "position_embedding_type `{other}` is not supported (expected rope, or null: none)"
                    )))
                }
            },
            _ => None,
        };
        let rope_local_theta = match arch {
            Arch::Gemma3 => Some(
                finite_positive("rope_local_base_freq", raw.rope_local_base_freq.unwrap_or(10000.0))
                    .map_err(bad)?,
            ),
            _ => None,
        };
        // Granite's multipliers, 1 where not given (as HF's defaults).
        let multiplier = |name: &str, v: Option<f64>| match v.filter(|_| granite) {
            Some(v) => finite_positive(name, v).map(|v| v as f32).map_err(bad),
            None => Ok(1.0),
        };
        let embedding_multiplier = multiplier("embedding_multiplier", raw.embedding_multiplier)?;
        let residual_multiplier = multiplier("residual_multiplier", raw.residual_multiplier)?;
        let logits_scaling = multiplier("logits_scaling", raw.logits_scaling)?;
        let attn_scale = if granite {
            multiplier("attention_multiplier", raw.attention_multiplier)?
        } else if gemma23 {
            let s = finite_positive("query_pre_attn_scalar", raw.query_pre_attn_scalar.unwrap_or(256.0))
                .map_err(bad)?;
            (1.0 / s.sqrt()) as f32
        } else if gpt2 && raw.scale_attn_weights == Some(false) {
            1.0
        } else {
            1.0 / (head_dim as f32).sqrt()
        };
        let moe = moe(arch, &raw).map_err(bad)?;
        // Biases on every projection: StarCoder 2's `use_bias`, Phi's always.
        let linear_bias = (starcoder2 && raw.use_bias.unwrap_or(true)) || phi || neox || gpt2;
        let neox_parallel = neox && raw.use_parallel_residual.unwrap_or(true);
        let mut eos_token_ids = token_ids(&raw.eos_token_id);
        if glm && eos_token_ids.is_empty() {
            // HF's GlmConfig and Glm4Config: <|endoftext|>, <|user|>, <|observation|>.
            eos_token_ids = vec![151329, 151336, 151338];
        }
        Ok(ModelConfig {
            arch,
            hidden_size: raw.hidden_size,
            intermediate_size,
            n_layers: raw.num_hidden_layers,
            n_heads,
            n_kv_heads,
            head_dim,
            rotary_dim,
            vocab_size: raw.vocab_size,
            rms_norm_eps: eps as f32,
            rope_theta,
            rope_scaling,
            max_position_embeddings,
            // HF's default where the folder says nothing: tied for Gemma, SmolLM3, StarCoder 2,
            // Falcon, GPT-2 and GPT-BigCode (the first Gemma's folders leave it out), untied for
            // the others.
            tie_word_embeddings: raw
                .tie_word_embeddings
                .unwrap_or(gemma || gpt2 || matches!(arch, Arch::SmolLM3 | Arch::Starcoder2 | Arch::Falcon)),
            qkv_bias: matches!(arch, Arch::Qwen2 | Arch::Qwen2Moe)
                || (glm && raw.attention_bias.unwrap_or(true))
                || linear_bias
                || (arch == Arch::StableLm && raw.use_qkv_bias.unwrap_or(false)),
            linear_bias,
            layer_norm: starcoder2
                || phi
                || neox
                || gpt2
                || matches!(arch, Arch::StableLm | Arch::Olmo | Arch::Falcon),
            weightless_norms: arch == Arch::Olmo,
            clip_qkv,
            gated_ffn: !starcoder2 && !phi && !neox && !gpt2 && falcon.is_none(),
            parallel_residual: phi || neox_parallel || falcon.as_ref().is_some_and(|f| f.parallel),
            parallel_ffn_norm: neox_parallel || falcon.as_ref().is_some_and(|f| f.two_norms),
            head_bias: phi,
            learned_positions: gpt2,
            qk_norm: matches!(arch, Arch::Qwen3 | Arch::Qwen3Moe | Arch::Qwen3VlMoe | Arch::Gemma3),
            qk_norm_full: arch == Arch::Olmo2,
            rope_interleaved: glm || arch == Arch::Helium,
            sliding_window,
            local_layers,
            rope_local_theta,
            no_rope_layers,
            activation,
            norm_plus_one: gemma,
            scale_embedding: gemma,
            norm_place: match arch {
                Arch::Gemma2 | Arch::Gemma3 | Arch::Glm4 => NormPlace::Sandwich,
                Arch::Olmo2 => NormPlace::Post,
                _ => NormPlace::Pre,
            },
            attn_scale,
            embedding_multiplier,
            residual_multiplier,
            logits_scaling,
            attn_softcap,
            final_softcap,
            moe,
            bos_token_id: token_ids(&raw.bos_token_id).first().copied(),
            eos_token_ids,
        })
    }

    /// The window layer `i` (of the whole model) attends through: `sliding_window` on every
    /// layer, or only on the local ones.
    pub fn layer_window(&self, i: usize) -> Option<usize> {
        match &self.local_layers {
            Some(local) if !local[i] => None,
            _ => self.sliding_window,
        }
    }

    /// Whether layer `i` is a local layer (its own RoPE base, [`Self::rope_local_theta`]).
    pub fn is_local(&self, i: usize) -> bool {
        self.local_layers.as_ref().is_some_and(|l| l[i])
    }

    /// How layer `i` rotates its queries and keys.
    pub fn layer_rope(&self, i: usize) -> LayerRope {
        if self.no_rope_layers.as_ref().is_some_and(|l| l[i]) {
            LayerRope::None
        } else if self.is_local(i) && self.rope_local_theta.is_some() {
            LayerRope::Local
        } else {
            LayerRope::Base
        }
    }

    /// RoPE inverse frequencies, one per rotated pair, with any scaling applied.
    pub fn rope_inv_freq(&self) -> Vec<f64> {
        self.inv_freq(self.rope_theta, self.rope_scaling.as_ref())
    }

    /// The local layers' RoPE inverse frequencies (unscaled), if the model has local layers.
    pub fn rope_local_inv_freq(&self) -> Option<Vec<f64>> {
        self.rope_local_theta.map(|theta| self.inv_freq(theta, None))
    }

    /// LongRoPE's frequencies for sequences past the original context (divided by its long
    /// factors), and that context: positions from it on take them, and so does every position
    /// of a sequence whose prompt is longer ([`Self::long_rope`]).
    pub fn rope_inv_freq_long(&self) -> Option<(Vec<f64>, usize)> {
        match &self.rope_scaling {
            Some(RopeScaling::LongRope { long, original, .. }) => {
                let unscaled = self.inv_freq(self.rope_theta, None);
                Some((unscaled.iter().zip(long).map(|(f, l)| f / l).collect(), *original))
            }
            _ => None,
        }
    }

    /// Whether a sequence whose prompt has `prompt_len` tokens rotates every position by
    /// LongRoPE's long factors: as HF's Phi-3 does, which picks them for a whole forward pass
    /// (a prompt, or one new token) reaching past the original context. So a prompt longer
    /// than that takes them throughout, and a shorter one only for the positions past it.
    pub fn long_rope(&self, prompt_len: usize) -> bool {
        self.long_rope_original().is_some_and(|o| prompt_len > o)
    }

    /// LongRoPE's original context, if the model rotates by LongRoPE.
    pub fn long_rope_original(&self) -> Option<usize> {
        match self.rope_scaling {
            Some(RopeScaling::LongRope { original, .. }) => Some(original),
            _ => None,
        }
    }

    /// The factor of every cos and sin of the (global) RoPE: LongRoPE's or YaRN's attention
    /// factor, else 1.
    pub fn rope_attention_factor(&self) -> f64 {
        match self.rope_scaling {
            Some(
                RopeScaling::LongRope { attention_factor, .. } | RopeScaling::Yarn { attention_factor, .. },
            ) => attention_factor,
            _ => 1.0,
        }
    }

    fn inv_freq(&self, theta: f64, scaling: Option<&RopeScaling>) -> Vec<f64> {
        let d = self.rotary_dim as f64;
        (0..self.rotary_dim / 2)
            .map(|i| {
                let f = 1.0 / theta.powf(2.0 * i as f64 / d);
                scaling.map_or(f, |s| s.scale(i, f))
            })
            .collect()
    }

    /// Weights of a layer's q, k, v and o projections.
    pub fn attention_params(&self) -> f64 {
        let (h, qd, kvd) = (self.hidden_size as f64, self.q_dim() as f64, self.kv_dim() as f64);
        h * (qd + 2.0 * kvd) + qd * h
    }

    /// Weights of layer `i`'s FFN: gate, up and down of every expert (and the router), or
    /// of its dense FFN (two matrices where it has no gate).
    pub fn ffn_params(&self, i: usize) -> f64 {
        let h = self.hidden_size as f64;
        let matrices = if self.gated_ffn { 3.0 } else { 2.0 };
        match self.moe.as_ref().filter(|m| m.sparse[i]) {
            Some(m) => (3 * m.expert_ffn * m.experts + m.experts + m.shared_params()) as f64 * h,
            None => matrices * h * self.intermediate_size as f64,
        }
    }

    /// Weights of layer `i`'s FFN a step of `tokens` tokens reads: the router and, of a sparse
    /// layer, the experts its tokens choose ([`Moe::expected_experts`]).
    pub fn ffn_params_read(&self, i: usize, tokens: usize) -> f64 {
        let h = self.hidden_size as f64;
        match self.moe.as_ref().filter(|m| m.sparse[i]) {
            Some(m) => {
                let experts = 3.0 * m.expert_ffn as f64 * m.expected_experts(tokens);
                (experts + (m.experts + m.shared_params()) as f64) * h
            }
            None => self.ffn_params(i),
        }
    }

    /// Weights of layer `i`'s FFN one token multiplies by (its flops are twice this).
    pub fn ffn_params_per_token(&self, i: usize) -> f64 {
        self.ffn_params_read(i, 1)
    }

    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
}

/// A flag per layer: from `list` (the config field `name`, one entry per layer, each read by
/// `flag`), or else set on each `every`-th layer (the field `every_name`; `default` if absent)
/// when `on_multiples`, or on every layer but those.
fn layer_flags<T>(
    n: usize,
    (name, list): (&str, &Option<Vec<T>>),
    flag: impl Fn(&T) -> std::result::Result<bool, String>,
    (every_name, every, default): (&str, Option<usize>, usize),
    on_multiples: bool,
) -> std::result::Result<Vec<bool>, String> {
    if let Some(list) = list {
        if list.len() != n {
            return Err(format!("{name} has {} entries for {n} layers", list.len()));
        }
        return list.iter().map(flag).collect();
    }
    match every.unwrap_or(default) {
        0 => Err(format!("{every_name} is 0 (expected a positive number of layers)")),
        k => Ok((0..n).map(|i| ((i + 1) % k == 0) == on_multiples).collect()),
    }
}

/// The columns of a Granite 4 (`granitemoehybrid`) folder's dense FFN (`shared_intermediate_size`,
/// HF's default 1024), once its config shows a model gridlm runs: every layer attention (no
/// Mamba layers), no experts (HF's default is 8 where `num_local_experts` is not given).
fn granite_hybrid_dense_ffn(raw: &HfConfig) -> std::result::Result<usize, String> {
    let experts = raw.num_local_experts.unwrap_or(8);
    if experts > 0 {
        return Err(format!(
            "granitemoehybrid with {experts} experts a layer (num_local_experts) is not supported (only dense ones: num_local_experts 0)"
        ));
    }
    let types = raw.layer_types.as_ref().or(raw.layers_block_type.as_ref());
    let Some(types) = types else {
        return Err(
            "granitemoehybrid without layer_types: HF takes every layer as Mamba, which gridlm does not run"
                .into(),
        );
    };
    if types.len() != raw.num_hidden_layers {
        return Err(format!("layer_types has {} entries for {} layers", types.len(), raw.num_hidden_layers));
    }
    if let Some((i, t)) = types.iter().enumerate().find(|(_, t)| *t != "attention") {
        return Err(format!(
            "layer {i} is of type `{t}`: only attention layers are supported (Granite 4's Mamba layers are not)"
        ));
    }
    Ok(raw.shared_intermediate_size.unwrap_or(1024))
}

/// An image-and-text folder's config as its text model's: Gemma 3's (`model_type: gemma3`, its
/// text model `gemma3_text`), Mistral Small 3.x's (`mistral3`, its text model `mistral`),
/// Qwen2-VL's and Qwen2.5-VL's (`qwen2_vl`, `qwen2_5_vl`: a `qwen2`), Qwen3-VL's (`qwen3_vl`:
/// a `qwen3`) or Qwen3-VL-MoE's (`qwen3_vl_moe`: its `qwen3_vl_moe_text`), the `text_config` over
/// HF's defaults for that text model, with the folder's own end-of-sequence ids where it gives
/// them. `None` for any other config. The text model's weights are found under the folder's
/// `language_model` prefix (`weights::checkpoint`); the image tower's are never read.
///
/// Qwen's M-RoPE rotates by three position rows (time, height, width), which HF makes one
/// `arange` for text alone — all gridlm is given — so it is plain RoPE there, as HF's configs
/// name it (`rope_type: default`). Qwen2-VL's and Qwen2.5-VL's first configs keep the text
/// model's settings at the top, with no `text_config`.
fn image_text_config(text: &str) -> std::result::Result<Option<String>, String> {
    let Ok(serde_json::Value::Object(v)) = serde_json::from_str::<serde_json::Value>(text) else {
        return Ok(None); // the full parse names what is wrong
    };
    let outer = v.get("model_type").and_then(|t| t.as_str()).unwrap_or_default();
    // The text model's `model_type` as the folder stores it, gridlm's family for it, and HF's
    // defaults for the fields its `text_config` leaves out (Gemma3TextConfig's, MistralConfig's,
    // Qwen2_5_VLTextConfig's — Qwen2VLTextConfig's are the same —, Qwen3VLTextConfig's).
    let qwen2_vl = serde_json::json!({
        "vocab_size": 152064, "hidden_size": 8192, "intermediate_size": 29568,
        "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
        "hidden_act": "silu", "max_position_embeddings": 32768, "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0, "bos_token_id": 151643, "eos_token_id": 151645,
    });
    let (stored, inner, defaults) = match outer {
        "gemma3" => (
            "gemma3_text",
            "gemma3_text",
            serde_json::json!({
                "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216,
                "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
                "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131072,
                "rms_norm_eps": 1e-6, "bos_token_id": 2, "eos_token_id": 1, "tie_word_embeddings": true,
                "rope_theta": 1000000.0, "attention_bias": false, "query_pre_attn_scalar": 256,
                "sliding_window": 4096, "rope_local_base_freq": 10000.0, "sliding_window_pattern": 6,
            }),
        ),
        "mistral3" => (
            "mistral",
            "mistral",
            serde_json::json!({
                "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
                "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                "hidden_act": "silu", "max_position_embeddings": 131072, "rms_norm_eps": 1e-6,
                "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": false, "rope_theta": 10000.0,
                "sliding_window": 4096,
            }),
        ),
        "qwen2_vl" => ("qwen2_vl_text", "qwen2", qwen2_vl),
        "qwen2_5_vl" => ("qwen2_5_vl_text", "qwen2", qwen2_vl),
        "qwen3_vl_moe" => (
            "qwen3_vl_moe_text",
            "qwen3_vl_moe_text",
            serde_json::json!({
                "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632,
                "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16,
                "hidden_act": "silu", "max_position_embeddings": 128000, "rms_norm_eps": 1e-6,
                "rope_theta": 500000.0, "attention_bias": false,
            }),
        ),
        "qwen3_vl" => (
            "qwen3_vl_text",
            "qwen3",
            serde_json::json!({
                "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
                "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
                "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 128000,
                "rms_norm_eps": 1e-6, "rope_theta": 500000.0, "attention_bias": false,
            }),
        ),
        _ => return Ok(None),
    };
    let qwen = outer.starts_with("qwen");
    let given = match v.get("text_config") {
        Some(serde_json::Value::Object(t)) => t.clone(),
        None if qwen && !outer.starts_with("qwen3") => {
            let mut t = v.clone();
            t.remove("vision_config");
            t.remove("model_type");
            t
        }
        _ => {
            return Err(format!(
                "model_type `{outer}` without an object `text_config` (its text model's settings)"
            ))
        }
    };
    if let Some(t) = given.get("model_type").and_then(|t| t.as_str()).filter(|t| ![stored, inner].contains(t))
    {
        return Err(format!(
            "model_type `{outer}` whose text_config has model_type `{t}` (expected {stored})"
        ));
    }
    let mut merged = defaults.as_object().cloned().unwrap_or_default();
    merged.extend(given.clone());
    merged.insert("model_type".into(), inner.into());
    if let Some(eos) = v.get("eos_token_id") {
        merged.insert("eos_token_id".into(), eos.clone());
    }
    if qwen {
        // HF ties the head by the outer config's `tie_word_embeddings` (false where absent);
        // Qwen2-VL's and Qwen2.5-VL's also by the text model's, as their first saves put it
        // there (Qwen3-VL's: the text model's only where the outer config is silent).
        let tie = |c: &serde_json::Map<String, serde_json::Value>| c.get("tie_word_embeddings")?.as_bool();
        let tied = match outer {
            "qwen3_vl" | "qwen3_vl_moe" => tie(&v).or(tie(&given)).unwrap_or(false),
            _ => tie(&v).unwrap_or(false) || tie(&given).unwrap_or(false),
        };
        merged.insert("tie_word_embeddings".into(), tied.into());
        for key in ["rope_scaling", "rope_parameters"] {
            if let Some(serde_json::Value::Object(r)) = merged.get_mut(key) {
                if [r.get("type"), r.get("rope_type")].iter().flatten().any(|t| *t == "mrope") {
                    r.remove("type");
                    r.remove("rope_type");
                }
                r.remove("mrope_section");
                r.remove("mrope_interleaved");
                if !r.contains_key("type") {
                    r.entry("rope_type").or_insert("default".into());
                }
            }
        }
    }
    Ok(Some(serde_json::Value::Object(merged).to_string()))
}

/// A config in transformers 5's form, its RoPE settings in `rope_parameters` (`rope_theta`,
/// `rope_type` and the scaling's numbers, `partial_rotary_factor`), rewritten into the keys
/// transformers 4 wrote (`rope_theta`, `rope_scaling`, `partial_rotary_factor`) and the rest of
/// this module reads; `None` where there is no `rope_parameters`. As HF 5 reads it, a value in
/// `rope_parameters` wins over the same key beside it. Nested by layer type (Gemma 3's
/// `full_attention` and `sliding_attention`), the full-attention layers' settings are the
/// model's and the sliding layers' base is Gemma 3's `rope_local_base_freq`; other families
/// rotate every layer alike, so theirs must be the same.
/// How a Falcon config lays out its layers.
struct FalconLayout {
    /// KV heads: one with `multi_query` (Falcon-7B), `num_kv_heads` with
    /// `new_decoder_architecture` (Falcon-40B's groups), else one per query head.
    kv_heads: usize,
    /// The attention and the FFN both read the layer's input (`parallel_attn`, always with
    /// `new_decoder_architecture`).
    parallel: bool,
    /// Each reads a norm of its own (`ln_attn`, `ln_mlp`: `new_decoder_architecture` with
    /// `num_ln_in_parallel_attn` 2, its default there).
    two_norms: bool,
}

/// Falcon's layout as HF's FalconConfig and FalconDecoderLayer read it; the settings HF does
/// not run (ALiBi positions aside, which gridlm does not run either) refused.
fn falcon_layout(raw: &HfConfig) -> std::result::Result<FalconLayout, String> {
    if raw.alibi == Some(true) {
        return Err(
            "alibi = true (ALiBi positions, Falcon-RW's) is not supported for falcon (RoPE only)".into()
        );
    }
    if raw.bias == Some(true) {
        return Err(
            "bias = true (biases on every projection, Falcon-RW's) is not supported for falcon".into()
        );
    }
    let n_heads = raw.num_attention_heads;
    let new = raw.new_decoder_architecture.unwrap_or(false);
    let given_kv = raw.num_kv_heads.unwrap_or(n_heads);
    if new {
        if raw.parallel_attn == Some(false) {
            return Err(
                "parallel_attn = false with new_decoder_architecture = true (HF's Falcon does not run it)"
                    .into(),
            );
        }
        let two_norms = match raw.num_ln_in_parallel_attn.unwrap_or(2) {
            1 => false,
            2 => true,
            n => return Err(format!("num_ln_in_parallel_attn {n} (expected 1 or 2)")),
        };
        return Ok(FalconLayout { kv_heads: given_kv, parallel: true, two_norms });
    }
    let parallel = raw.parallel_attn.unwrap_or(true);
    if let Some(n) = raw.num_ln_in_parallel_attn.filter(|&n| n != 1 && parallel) {
        return Err(format!(
            "num_ln_in_parallel_attn {n} without new_decoder_architecture (HF's Falcon reads one norm there)"
        ));
    }
    if raw.multi_query.unwrap_or(true) {
        return Ok(FalconLayout { kv_heads: 1, parallel, two_norms: false });
    }
    if given_kv != n_heads {
        return Err(format!(
            "num_kv_heads ({given_kv}) differs from num_attention_heads ({n_heads}) without multi_query or new_decoder_architecture (q, k and v are stored head by head there)"
        ));
    }
    Ok(FalconLayout { kv_heads: n_heads, parallel, two_norms: false })
}

/// GPT-2's and GPT-BigCode's config.json in the keys the other families use: `n_embd`,
/// `n_layer`, `n_head`, `n_positions`, `n_inner` (null or absent: four times `n_embd`) and
/// `activation_function` renamed as HF's `attribute_map` reads them, with HF's defaults
/// (GPT2Config's, GPTBigCodeConfig's) for those left out. `None` for other families.
fn gpt2_keys(text: &str) -> std::result::Result<Option<String>, String> {
    let Ok(serde_json::Value::Object(mut v)) = serde_json::from_str::<serde_json::Value>(text) else {
        return Ok(None); // the full parse names what is wrong
    };
    let model_type = v.get("model_type").and_then(|t| t.as_str()).unwrap_or_default().to_string();
    if !matches!(model_type.as_str(), "gpt2" | "gpt_bigcode") {
        return Ok(None);
    }
    let renames = [
        ("n_embd", "hidden_size", 768),
        ("n_layer", "num_hidden_layers", 12),
        ("n_head", "num_attention_heads", 12),
        ("n_positions", "max_position_embeddings", 1024),
        ("vocab_size", "vocab_size", 50257),
    ];
    for (from, to, default) in renames {
        if from != to && v.contains_key(to) {
            return Err(format!(
                "both `{from}` and `{to}` are given (expected {model_type}'s `{from}` alone)"
            ));
        }
        let value = v.remove(from).unwrap_or(default.into());
        v.insert(to.into(), value);
    }
    if v.contains_key("intermediate_size") {
        return Err(format!(
            "both `n_inner` and `intermediate_size` are given (expected {model_type}'s `n_inner`)"
        ));
    }
    let inner = match v.remove("n_inner") {
        None | Some(serde_json::Value::Null) => v["hidden_size"].as_u64().map(|h| (4 * h).into()),
        Some(n) => Some(n),
    };
    if let Some(n) = inner {
        v.insert("intermediate_size".into(), n);
    }
    if let Some(act) = v.remove("activation_function") {
        v.insert("hidden_act".into(), act);
    }
    serde_json::to_string(&v).map(Some).map_err(|e| e.to_string())
}

fn legacy_rope_keys(text: &str) -> std::result::Result<Option<String>, String> {
    let Ok(serde_json::Value::Object(mut v)) = serde_json::from_str::<serde_json::Value>(text) else {
        return Ok(None); // the full parse names what is wrong
    };
    let params = match v.remove("rope_parameters") {
        None | Some(serde_json::Value::Null) => return Ok(None),
        Some(serde_json::Value::Object(p)) => p,
        Some(other) => return Err(format!("rope_parameters is {other} (expected an object)")),
    };
    if v.get("rope_scaling").is_some_and(|s| !s.is_null()) {
        return Err("both rope_scaling and rope_parameters are given (expected one: transformers 4 wrote the first, 5 writes the second)".into());
    }
    let layer_types = ["full_attention", "sliding_attention"];
    let (full, sliding) = if layer_types.iter().any(|k| params.contains_key(*k)) {
        let part = |k: &str| match params.get(k) {
            None | Some(serde_json::Value::Null) => Ok(None),
            Some(serde_json::Value::Object(p)) => Ok(Some(p.clone())),
            Some(other) => Err(format!("rope_parameters.{k} is {other} (expected an object)")),
        };
        if let Some(other) = params.keys().find(|k| !layer_types.contains(&k.as_str())) {
            return Err(format!(
                "rope_parameters has `{other}` beside its layer types (expected full_attention and sliding_attention only)"
            ));
        }
        (part("full_attention")?, part("sliding_attention")?)
    } else {
        (Some(params), None)
    };
    let kind = |p: &serde_json::Map<String, serde_json::Value>| {
        let t = p.get("rope_type").or_else(|| p.get("type")).and_then(|t| t.as_str());
        t.unwrap_or("default").to_string()
    };
    if let Some(sliding) = sliding {
        let gemma3 = v.get("model_type").and_then(|t| t.as_str()) == Some("gemma3_text");
        if gemma3 {
            if kind(&sliding) != "default" {
                return Err(format!(
                    "rope_parameters.sliding_attention has rope_type `{}` (Gemma 3's local layers rotate unscaled: expected default)",
                    kind(&sliding)
                ));
            }
            if let Some(theta) = sliding.get("rope_theta") {
                v.insert("rope_local_base_freq".into(), theta.clone());
            }
        } else if full.as_ref() != Some(&sliding) {
            return Err(
                "rope_parameters gives the sliding_attention layers RoPE settings of their own (read only for gemma3_text; expected the same as full_attention's)".into(),
            );
        }
    }
    if let Some(full) = full {
        for key in ["rope_theta", "partial_rotary_factor"] {
            if let Some(x) = full.get(key) {
                v.insert(key.into(), x.clone());
            }
        }
        if kind(&full) != "default" {
            v.insert("rope_scaling".into(), serde_json::Value::Object(full));
        }
    }
    Ok(Some(serde_json::Value::Object(v).to_string()))
}

/// SmolLM3's unrotated layers: from `no_rope_layers` (0 for a layer without RoPE, 1 for one
/// with it), or else each `no_rope_layer_interval`-th layer (4 by default), as HF reads them.
fn smollm3_no_rope_layers(raw: &HfConfig) -> std::result::Result<Vec<bool>, String> {
    let flag = |f: &u32| match f {
        0 => Ok(true),
        1 => Ok(false),
        other => Err(format!("no_rope_layers holds {other} (expected 0, no RoPE, or 1)")),
    };
    let every = ("no_rope_layer_interval", raw.no_rope_layer_interval, 4);
    layer_flags(raw.num_hidden_layers, ("no_rope_layers", &raw.no_rope_layers), flag, every, true)
}

/// Gemma's local layers: from `layer_types` (`sliding_attention` / `full_attention`), or else
/// every layer but each `sliding_window_pattern`-th (`pattern` by default).
fn gemma_local_layers(raw: &HfConfig, pattern: usize) -> std::result::Result<Vec<bool>, String> {
    let flag = |t: &String| match t.as_str() {
        "sliding_attention" => Ok(true),
        "full_attention" => Ok(false),
        other => Err(format!("layer_types holds `{other}` (expected sliding_attention or full_attention)")),
    };
    let every = ("sliding_window_pattern", raw.sliding_window_pattern, pattern);
    layer_flags(raw.num_hidden_layers, ("layer_types", &raw.layer_types), flag, every, false)
}

/// The experts of a `qwen2_moe`, `qwen3_moe`, `qwen3_vl_moe_text` or `mixtral` config, with
/// HF's defaults (Qwen2MoeConfig's, Qwen3MoeConfig's, Qwen3VLMoeTextConfig's, MixtralConfig's)
/// for the fields it leaves out; `None` for the other families.
fn moe(arch: Arch, raw: &HfConfig) -> std::result::Result<Option<Moe>, String> {
    let n = raw.num_hidden_layers;
    let qwen2 = arch == Arch::Qwen2Moe;
    let moe = match arch {
        Arch::Qwen2Moe | Arch::Qwen3Moe | Arch::Qwen3VlMoe => {
            let only = raw.mlp_only_layers.clone().unwrap_or_default();
            if let Some(&l) = only.iter().find(|&&l| l >= n) {
                return Err(format!("mlp_only_layers names layer {l} of {n}"));
            }
            let step = raw.decoder_sparse_step.unwrap_or(1);
            if step == 0 {
                return Err("decoder_sparse_step is 0 (expected a positive number of layers)".into());
            }
            // Qwen3-VL-MoE's router always renormalizes (it has no `norm_topk_prob`).
            let vl = arch == Arch::Qwen3VlMoe;
            let (experts, per_token, expert_ffn) =
                if arch == Arch::Qwen3Moe { (128, 8, 768) } else { (60, 4, 1408) };
            Moe {
                experts: raw.num_experts.unwrap_or(experts),
                per_token: raw.num_experts_per_tok.unwrap_or(per_token),
                expert_ffn: raw.moe_intermediate_size.unwrap_or(expert_ffn),
                norm_topk: vl || raw.norm_topk_prob.unwrap_or(false),
                shared_ffn: if qwen2 { raw.shared_expert_intermediate_size.unwrap_or(5632) } else { 0 },
                sparse: (0..n).map(|i| !only.contains(&i) && (i + 1) % step == 0).collect(),
            }
        }
        // GraniteMoE's router takes the softmax of the chosen experts' scores alone, which is
        // the softmax over all renormalized over the chosen.
        Arch::Mixtral | Arch::GraniteMoe => Moe {
            experts: raw.num_local_experts.unwrap_or(8),
            per_token: raw.num_experts_per_tok.unwrap_or(2),
            // Given (its absence is refused before).
            expert_ffn: raw.intermediate_size.unwrap_or(0),
            norm_topk: true,
            shared_ffn: 0,
            sparse: vec![true; n],
        },
        _ => return Ok(None),
    };
    if !qwen2 && raw.shared_expert_intermediate_size.is_some_and(|s| s > 0) {
        return Err(format!(
            "a shared expert (shared_expert_intermediate_size) is not part of {} models",
            arch.name()
        ));
    }
    if moe.experts == 0 || moe.expert_ffn == 0 {
        return Err(format!(
            "{} experts of {} columns (expected positive numbers)",
            moe.experts, moe.expert_ffn
        ));
    }
    if !(1..=moe.experts).contains(&moe.per_token) {
        return Err(format!(
            "num_experts_per_tok {} (expected 1 to the {} experts)",
            moe.per_token, moe.experts
        ));
    }
    Ok(Some(moe))
}

/// `x`, if it is a finite positive number; else the error naming the field `name`.
fn finite_positive(name: &str, x: f64) -> std::result::Result<f64, String> {
    if x.is_finite() && x > 0.0 {
        Ok(x)
    } else {
        Err(format!("{name} {x} must be a finite positive number"))
    }
}

/// HF's `rope_scaling` `v` of a model whose RoPE rotates `dim` dimensions of a head with base
/// `theta`, of `max_pos` positions, `original` (`original_max_position_embeddings`) where its
/// config gives it beside `rope_scaling`.
fn parse_rope_scaling(
    v: &serde_json::Value,
    (dim, theta): (usize, f64),
    max_pos: usize,
    original: Option<usize>,
) -> std::result::Result<RopeScaling, String> {
    let pairs = dim / 2;
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
        "llama3" => {
            let (low_freq_factor, high_freq_factor) = (num("low_freq_factor")?, num("high_freq_factor")?);
            if high_freq_factor <= low_freq_factor {
                return Err(format!(
                    "rope_scaling's `high_freq_factor` ({high_freq_factor}) must exceed its `low_freq_factor` ({low_freq_factor})"
                ));
            }
            Ok(RopeScaling::Llama3 {
                factor: num("factor")?,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings: num("original_max_position_embeddings")?,
            })
        }
        "longrope" => {
            let factors = |k: &str| {
                let bad = || {
                    format!("rope_scaling's `{k}` must be a list of {pairs} finite positive numbers, one per rotated pair")
                };
                let given = v.get(k).and_then(|x| x.as_array()).ok_or_else(bad)?;
                let list: Vec<f64> =
                    given.iter().filter_map(|x| x.as_f64()).filter(|x| x.is_finite() && *x > 0.0).collect();
                if list.len() == pairs && given.len() == pairs {
                    Ok(list)
                } else {
                    Err(bad())
                }
            };
            let (short, long) = (factors("short_factor")?, factors("long_factor")?);
            // As HF's `_compute_longrope_parameters`: the original context beside
            // `rope_scaling` (Phi-3's place for it) or in it, the factor its ratio to the
            // whole context; without one, `factor` over the whole context.
            let inner =
                v.get("original_max_position_embeddings").and_then(|x| x.as_u64()).map(|x| x as usize);
            let (original, factor) = match original.or(inner) {
                Some(0) => {
                    return Err("original_max_position_embeddings is 0 (expected a positive number)".into())
                }
                Some(o) => (o, max_pos as f64 / o as f64),
                None => (max_pos, num("factor")?),
            };
            let attention_factor = match v.get("attention_factor").filter(|x| !x.is_null()) {
                Some(_) => num("attention_factor")?,
                None => RopeScaling::longrope_attention_factor(factor, original),
            };
            if !attention_factor.is_finite() {
                return Err(format!(
                    "rope_scaling's attention factor comes to {attention_factor} from an original context of {original}"
                ));
            }
            Ok(RopeScaling::LongRope { short, long, original, attention_factor })
        }
        "yarn" => {
            // As the YaRN paper, llama.cpp, vLLM and HF's `_compute_yarn_parameters` (before
            // HF took the factor from the two contexts where both are given) compute it.
            let factor = num("factor")?;
            let given = |k: &str| v.get(k).filter(|x| !x.is_null());
            let original = match given("original_max_position_embeddings") {
                Some(_) => num("original_max_position_embeddings")?,
                None => max_pos as f64,
            };
            let (beta_fast, beta_slow) = (
                given("beta_fast").map_or(Ok(32.0), |_| num("beta_fast"))?,
                given("beta_slow").map_or(Ok(1.0), |_| num("beta_slow"))?,
            );
            let mscale = |m: f64| RopeScaling::yarn_mscale(factor, m);
            let nonzero = |k: &str| given(k).and_then(|x| x.as_f64()).is_some_and(|x| x != 0.0);
            let attention_factor = if given("attention_factor").is_some() {
                num("attention_factor")?
            } else if nonzero("mscale") && nonzero("mscale_all_dim") {
                mscale(num("mscale")?) / mscale(num("mscale_all_dim")?)
            } else {
                mscale(1.0)
            };
            let truncate = given("truncate").is_none_or(|t| t.as_bool() != Some(false));
            // The dimension (of `dim`) at which a pair turns `turns` times over the original
            // context; the ramp runs between those of `beta_fast` and `beta_slow` turns.
            let at = |turns: f64| {
                dim as f64 * (original / (turns * 2.0 * std::f64::consts::PI)).ln() / (2.0 * theta.ln())
            };
            let (low, high) = match truncate {
                true => (at(beta_fast).floor(), at(beta_slow).ceil()),
                false => (at(beta_fast), at(beta_slow)),
            };
            let (low, high) = (low.max(0.0), high.min(dim as f64 - 1.0));
            let high = if low == high { high + 0.001 } else { high };
            let keep = (0..pairs).map(|i| 1.0 - ((i as f64 - low) / (high - low)).clamp(0.0, 1.0)).collect();
            Ok(RopeScaling::Yarn { factor, keep, attention_factor })
        }
        other => Err(format!(
            "unsupported rope_scaling type `{other}` (expected linear, llama3, longrope or yarn)"
        )),
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
        assert!(e.contains("missing field `num_hidden_layers`"), "{e}");
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
            (
                r#""rope_scaling":{"rope_type":"llama3","factor":8,"low_freq_factor":4,"high_freq_factor":4,
                   "original_max_position_embeddings":8192}"#,
                "rope_scaling's `high_freq_factor` (4) must exceed its `low_freq_factor` (4)",
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
        // HF's Qwen3 with attention_bias has an o_proj bias too, which gridlm does not load.
        let e = parse(&config("qwen3", r#""head_dim":32,"attention_bias":true"#)).unwrap_err().to_string();
        assert!(
            e.contains("attention_bias = true (biases on q/k/v and o_proj) is not supported for qwen3"),
            "{e}"
        );
        let e = parse(&config("llama", r#""mlp_bias":true"#)).unwrap_err().to_string();
        assert!(e.contains("mlp_bias = true"), "{e}");
        // Qwen2's biases are its own, whatever the field says.
        assert!(parse(&config("qwen2", r#""attention_bias":false"#)).unwrap().qkv_bias);
        let e =
            parse(&config("qwen3", r#""head_dim":32,"use_sliding_window":true"#)).unwrap_err().to_string();
        assert!(e.contains("use_sliding_window = true is not supported for qwen3"), "{e}");
        // The others have no head norms.
        assert!(!parse(BASE).unwrap().qk_norm);
        assert!(!parse(&BASE.replace("llama", "qwen2")).unwrap().qk_norm);
    }

    #[test]
    fn mixtures_of_experts() {
        // Qwen3-MoE: HF's defaults, every layer sparse.
        let c = parse(&config("qwen3_moe", r#""head_dim":32"#)).unwrap();
        let moe = c.moe.clone().unwrap();
        assert_eq!((c.arch, c.qk_norm), (Arch::Qwen3Moe, true));
        assert_eq!((moe.experts, moe.per_token, moe.expert_ffn, moe.norm_topk), (128, 8, 768, false));
        assert_eq!(moe.sparse, vec![true, true]);
        // Every second layer (decoder_sparse_step), but those named dense (mlp_only_layers).
        let c = parse(&config(
            "qwen3_moe",
            r#""num_experts":4,"num_experts_per_tok":2,"moe_intermediate_size":32,"norm_topk_prob":true,
               "decoder_sparse_step":2,"mlp_only_layers":[]"#,
        ))
        .unwrap();
        assert_eq!(c.moe.as_ref().unwrap().sparse, vec![false, true]);
        assert!(c.moe.as_ref().unwrap().norm_topk);
        let c = parse(&config("qwen3_moe", r#""mlp_only_layers":[1]"#)).unwrap();
        assert_eq!(c.moe.as_ref().unwrap().sparse, vec![true, false]);
        // What a layer holds, reads and multiplies a token by: 128 experts' 3 × 64 × 768 and
        // the router's 128 × 64; 8 experts for one token.
        assert_eq!(c.ffn_params(0), (3 * 64 * 768 * 128 + 128 * 64) as f64);
        assert_eq!(c.ffn_params_per_token(0), (3 * 64 * 768 * 8 + 128 * 64) as f64);
        assert_eq!(c.ffn_params(1), (3 * 64 * 128) as f64);
        assert!(c.ffn_params_read(0, 64) > 0.98 * c.ffn_params(0));
        // Qwen2-MoE: HF's defaults, a shared expert, Qwen2's QKV biases.
        let c = parse(&config("qwen2_moe", "").replace(",}", "}")).unwrap();
        let moe = c.moe.clone().unwrap();
        assert_eq!((c.arch, c.qkv_bias, c.qk_norm), (Arch::Qwen2Moe, true, false));
        assert_eq!((moe.experts, moe.per_token, moe.expert_ffn, moe.shared_ffn), (60, 4, 1408, 5632));
        assert_eq!(c.ffn_params(0), ((3 * 1408 * 60 + 60 + 3 * 5632 + 1) * 64) as f64);
        assert_eq!(c.ffn_params_per_token(0), ((3 * 1408 * 4 + 60 + 3 * 5632 + 1) * 64) as f64);
        // Mixtral: experts as wide as intermediate_size, always renormalized, Mistral's window.
        let c =
            parse(&config("mixtral", r#""sliding_window":4096,"max_position_embeddings":32768"#)).unwrap();
        let moe = c.moe.unwrap();
        assert_eq!((c.arch, c.sliding_window, c.qk_norm), (Arch::Mixtral, Some(4096), false));
        assert_eq!((moe.experts, moe.per_token, moe.expert_ffn, moe.norm_topk), (8, 2, 128, true));
        let cases = [
            (
                "qwen3_moe",
                r#""num_experts":4,"num_experts_per_tok":5"#,
                "num_experts_per_tok 5 (expected 1 to the 4",
            ),
            ("mixtral", r#""num_experts_per_tok":0"#, "num_experts_per_tok 0"),
            ("mixtral", r#""num_local_experts":0"#, "0 experts of 128 columns"),
            ("qwen3_moe", r#""moe_intermediate_size":0"#, "128 experts of 0 columns"),
            ("qwen3_moe", r#""decoder_sparse_step":0"#, "decoder_sparse_step is 0"),
            ("qwen3_moe", r#""mlp_only_layers":[2]"#, "mlp_only_layers names layer 2 of 2"),
            ("qwen3_moe", r#""shared_expert_intermediate_size":64"#, "a shared expert"),
            ("mixtral", r#""shared_expert_intermediate_size":64"#, "not part of mixtral models"),
            ("olmoe", "", "unsupported model_type `olmoe`"),
        ];
        for (model_type, extra, msg) in cases {
            let e = parse(&config(model_type, extra).replace(",}", "}")).unwrap_err().to_string();
            assert!(e.contains(msg), "{model_type} {extra}: {e}");
        }
        assert!(parse(BASE).unwrap().moe.is_none());
    }

    #[test]
    fn olmo2_norms_outputs_and_whole_q_and_k() {
        let c =
            parse(&config("olmo2", r#""rope_theta":500000,"attention_bias":false,"clip_qkv":null"#)).unwrap();
        assert_eq!(
            (c.arch, c.norm_place, c.qk_norm_full, c.qk_norm),
            (Arch::Olmo2, NormPlace::Post, true, false)
        );
        assert!(!c.tie_word_embeddings && !c.qkv_bias);
        let e = parse(&config("olmo2", r#""clip_qkv":8.0"#)).unwrap_err().to_string();
        assert!(e.contains("clip_qkv 8 is not supported"), "{e}");
        assert!(!parse(BASE).unwrap().qk_norm_full);
    }

    #[test]
    fn phi3_keeps_its_window_and_rotates_part_of_a_head() {
        let c = parse(&config("phi3", r#""sliding_window":2047"#)).unwrap();
        assert_eq!((c.arch, c.sliding_window, c.qkv_bias, c.qk_norm), (Arch::Phi3, Some(2047), false, false));
        assert_eq!(c.rotary_dim, 16);
        // Phi-4-mini's three quarters of a head: 12 of 16 dimensions, 6 frequencies.
        let c = parse(&config("phi3", r#""partial_rotary_factor":0.75"#)).unwrap();
        assert_eq!((c.head_dim, c.rotary_dim, c.rope_inv_freq().len()), (16, 12, 6));
        assert_eq!(c.rope_inv_freq()[1], 1.0 / 10000f64.powf(2.0 / 12.0));
        assert_eq!(parse(&config("phi3", r#""partial_rotary_factor":1.0"#)).unwrap().rotary_dim, 16);
        let e = parse(&config("llama", r#""partial_rotary_factor":0.5"#)).unwrap_err().to_string();
        assert!(e.contains("partial_rotary_factor 0.5 is not supported for llama"), "{e}");
        assert_eq!(parse(&config("llama", r#""partial_rotary_factor":1.0"#)).unwrap().rotary_dim, 16);
        for f in ["0.1", "0", "1.5", "-0.5"] {
            let e =
                parse(&config("phi3", &format!(r#""partial_rotary_factor":{f}"#))).unwrap_err().to_string();
            assert!(e.contains(&format!("partial_rotary_factor {f} rotates")), "{e}");
        }
        let c =
            parse(&config("phi3", r#""sliding_window":262144,"max_position_embeddings":131072"#)).unwrap();
        assert_eq!(c.sliding_window, None);
        let c = parse(&config("mistral", r#""sliding_window":4096,"max_position_embeddings":4096"#)).unwrap();
        assert_eq!(c.sliding_window, None);
        let e = parse(&config("phi3", r#""sliding_window":0"#)).unwrap_err().to_string();
        assert!(e.contains("sliding_window is 0"), "{e}");
    }

    /// Each config text refused with an error holding its message.
    fn refused_with(cases: &[(&str, &str)]) {
        for (text, msg) in cases {
            let e = parse(text).unwrap_err().to_string();
            assert!(e.contains(msg), "{text}: {e}");
        }
    }

    /// Mistral Small 3.x's image-and-text folder (`mistral3`): its text model, a Mistral, with
    /// MistralConfig's defaults where `text_config` is silent.
    #[test]
    fn mistral3_reads_its_text_model() {
        let folder = r#"{"model_type":"mistral3","vision_config":{"hidden_size":1024},"image_token_index":10,
            "text_config":{"head_dim":128,"hidden_size":5120,"intermediate_size":32768,"num_hidden_layers":40,
            "max_position_embeddings":131072,"model_type":"mistral","rms_norm_eps":1e-05,
            "rope_theta":1000000000.0,"sliding_window":null,"vocab_size":131072}}"#;
        let c = parse(folder).unwrap();
        assert_eq!(
            (c.arch, c.hidden_size, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, c.vocab_size),
            (Arch::Mistral, 5120, 40, 32, 8, 128, 131072)
        );
        assert_eq!(
            (c.rope_theta, c.sliding_window, c.rms_norm_eps, c.tie_word_embeddings),
            (1e9, None, 1e-5, false)
        );
        assert_eq!(c.eos_token_ids, vec![2]);
        // MistralConfig's window where the text model says nothing.
        let c = parse(r#"{"model_type":"mistral3","text_config":{"max_position_embeddings":8192}}"#).unwrap();
        assert_eq!((c.hidden_size, c.sliding_window), (4096, Some(4096)));
        let refused = [
            (r#"{"model_type":"mistral3"}"#, "model_type `mistral3` without an object `text_config`"),
            (
                r#"{"model_type":"mistral3","text_config":{"model_type":"ministral3"}}"#,
                "text_config has model_type `ministral3` (expected mistral)",
            ),
        ];
        refused_with(&refused);
    }

    /// Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's image-and-text folders: their text models (a Qwen2,
    /// a Qwen3) with HF's defaults where silent, M-RoPE read as plain RoPE (text alone) and any
    /// other scaling kept, the head tied by HF's rule for each.
    #[test]
    fn qwen_vl_reads_its_text_model() {
        // Qwen2.5-VL-3B-Instruct's first form: the text model's settings at the top.
        let flat = r#"{"model_type":"qwen2_5_vl","hidden_size":2048,"intermediate_size":11008,
            "num_hidden_layers":36,"num_attention_heads":16,"num_key_value_heads":2,
            "max_position_embeddings":128000,"rope_theta":1000000.0,"tie_word_embeddings":true,
            "vocab_size":151936,"use_sliding_window":false,"sliding_window":32768,"eos_token_id":151645,
            "rope_scaling":{"type":"mrope","mrope_section":[16,24,24]},"vision_config":{"depth":32}}"#;
        let c = parse(flat).unwrap();
        assert_eq!(
            (c.arch, c.hidden_size, c.n_layers, c.n_kv_heads, c.head_dim, c.vocab_size),
            (Arch::Qwen2, 2048, 36, 2, 128, 151936)
        );
        assert!(
            c.qkv_bias && c.tie_word_embeddings && c.rope_scaling.is_none() && c.sliding_window.is_none()
        );
        assert_eq!((c.rms_norm_eps, c.rope_theta, c.eos_token_ids.clone()), (1e-5, 1e6, vec![151645]));
        // Nested, the text model's tie forwarded (Qwen2-VL, Qwen2.5-VL), a YaRN kept.
        let nested = r#"{"model_type":"qwen2_vl","text_config":{"model_type":"qwen2_vl_text",
            "tie_word_embeddings":true,"rope_scaling":{"rope_type":"yarn","factor":4.0,
            "original_max_position_embeddings":32768,"mrope_section":[16,24,24]}}}"#;
        let c = parse(nested).unwrap();
        assert!(c.tie_word_embeddings && c.rope_scaling.is_some());
        assert_eq!((c.hidden_size, c.max_position_embeddings, c.rope_theta), (8192, 32768, 1e6));
        // Qwen3-VL: the outer config's tie (false where it is silent and the text model too).
        let qwen3 = |outer: &str, inner: &str| {
            let text = format!(
                r#"{{"model_type":"qwen3_vl"{outer},"text_config":{{"model_type":"qwen3_vl_text"{inner},
                "rope_scaling":{{"rope_type":"default","mrope_section":[24,20,20],"mrope_interleaved":true}}}}}}"#
            );
            parse(&text).unwrap()
        };
        let c = qwen3("", "");
        assert_eq!((c.arch, c.head_dim, c.rope_theta, c.tie_word_embeddings), (Arch::Qwen3, 128, 5e5, false));
        assert!(c.qk_norm && c.rope_scaling.is_none());
        assert!(
            qwen3(r#","tie_word_embeddings":true"#, r#","tie_word_embeddings":false"#).tie_word_embeddings
        );
        assert!(
            !qwen3(r#","tie_word_embeddings":false"#, r#","tie_word_embeddings":true"#).tie_word_embeddings
        );
        assert!(qwen3("", r#","tie_word_embeddings":true"#).tie_word_embeddings);
        // Qwen3-VL-MoE: Qwen3VLMoeTextConfig's experts where silent, shares always renormalized.
        let moe = r#"{"model_type":"qwen3_vl_moe","text_config":{"model_type":"qwen3_vl_moe_text",
            "norm_topk_prob":false,"decoder_sparse_step":2}}"#;
        let c = parse(moe).unwrap();
        let m = c.moe.clone().unwrap();
        assert_eq!(
            (c.arch, c.hidden_size, c.rope_theta, c.tie_word_embeddings),
            (Arch::Qwen3VlMoe, 2048, 5e5, false)
        );
        assert_eq!((m.experts, m.per_token, m.expert_ffn, m.norm_topk), (60, 4, 1408, true));
        assert!(c.qk_norm && m.sparse[1] && !m.sparse[0]);
        let refused = [
            (r#"{"model_type":"qwen3_vl"}"#, "model_type `qwen3_vl` without an object `text_config`"),
            (
                r#"{"model_type":"qwen2_5_vl","text_config":{"model_type":"qwen3_vl_text"}}"#,
                "text_config has model_type `qwen3_vl_text` (expected qwen2_5_vl_text)",
            ),
        ];
        refused_with(&refused);
    }

    /// StarCoder 2: `norm_epsilon`, LayerNorms, biases on every projection unless `use_bias`
    /// is false, no gate, tied embeddings and its window where the folder is silent.
    #[test]
    fn starcoder2_settings() {
        let c = parse(&config("starcoder2", r#""norm_epsilon":1e-4,"sliding_window":64"#)).unwrap();
        assert_eq!(
            (c.arch, c.rms_norm_eps, c.layer_norm, c.gated_ffn),
            (Arch::Starcoder2, 1e-4, true, false)
        );
        assert!(c.qkv_bias && c.linear_bias && c.tie_word_embeddings);
        assert_eq!(c.sliding_window, Some(64));
        assert_eq!(c.ffn_params(0), (2 * 64 * 128) as f64);
        let c = parse(&config("starcoder2", r#""use_bias":false,"tie_word_embeddings":false"#)).unwrap();
        assert!(!c.qkv_bias && !c.linear_bias && !c.tie_word_embeddings && c.rms_norm_eps == 1e-5);
        let e = parse(&config("starcoder2", r#""norm_epsilon":-1"#)).unwrap_err().to_string();
        assert!(e.contains("norm_epsilon -1 must be a finite number"), "{e}");
        let llama = parse(BASE).unwrap();
        assert!(!llama.layer_norm && !llama.linear_bias && llama.gated_ffn);
    }

    /// HF's defaults where a family's config.json is silent (its config classes'): the context,
    /// the norms' epsilon, the RoPE base, the activation and the window; a null window says
    /// none where HF's default is one.
    #[test]
    fn hf_defaults_where_the_config_is_silent() {
        let bare = r#"{"model_type":"llama","hidden_size":64,"intermediate_size":128,
            "num_hidden_layers":2,"num_attention_heads":4,"vocab_size":100}"#;
        let cases = [
            ("llama", 2048, 1e-6, 1e4, Activation::Silu, None),
            ("mistral", 131072, 1e-6, 1e4, Activation::Silu, Some(4096)),
            ("mixtral", 131072, 1e-5, 1e6, Activation::Silu, None),
            ("phi3", 4096, 1e-5, 1e4, Activation::Silu, None),
            ("smollm3", 32768, 1e-6, 2e6, Activation::Silu, None),
            ("olmo2", 2048, 1e-5, 1e4, Activation::Silu, None),
            ("starcoder2", 4096, 1e-5, 1e4, Activation::GeluTanh, None),
            ("phi", 2048, 1e-5, 1e4, Activation::GeluTanh, None),
            ("helium", 4096, 1e-8, 1e5, Activation::Silu, None),
        ];
        for (model_type, ctx, eps, theta, act, window) in cases {
            let c = parse(&bare.replace("llama", model_type)).unwrap();
            let got =
                (c.max_position_embeddings, c.rms_norm_eps, c.rope_theta, c.activation, c.sliding_window);
            assert_eq!(got, (ctx, eps, theta, act, window), "{model_type}");
        }
        let c = parse(&bare.replace("llama", "helium")).unwrap();
        assert!(c.rope_interleaved && c.rotary_dim == c.head_dim && !c.tie_word_embeddings && !c.qkv_bias);
        let c = parse(&bare.replace("llama", "gemma3_text")).unwrap();
        assert_eq!((c.max_position_embeddings, c.rope_theta, c.rope_local_theta), (131072, 1e6, Some(1e4)));
        // Given, as null or shorter than the context, the folder's window holds.
        let mistral = |extra: &str| parse(&bare.replace("llama", "mistral").replace("}", extra)).unwrap();
        assert_eq!(mistral(r#","sliding_window":null}"#).sliding_window, None);
        assert_eq!(mistral(r#","sliding_window":1024}"#).sliding_window, Some(1024));
        assert_eq!(mistral(r#","max_position_embeddings":4096}"#).sliding_window, None);
    }

    /// The first OLMo: LayerNorms without weights, of 1e-5 whatever the folder says, `clip_qkv`
    /// read (a bound above 0), its o_proj bias refused; other families' `clip_qkv` refused.
    #[test]
    fn olmo_settings() {
        let c =
            parse(&config("olmo", r#""clip_qkv":8.0,"rms_norm_eps":1e-3,"attention_bias":false"#)).unwrap();
        assert_eq!((c.arch, c.rms_norm_eps, c.clip_qkv), (Arch::Olmo, 1e-5, Some(8.0)));
        assert!(c.layer_norm && c.weightless_norms && c.gated_ffn && !c.qkv_bias && !c.tie_word_embeddings);
        assert_eq!((c.norm_place, c.rotary_dim), (NormPlace::Pre, c.head_dim));
        let c = parse(&config("olmo", r#""clip_qkv":null"#)).unwrap();
        assert_eq!(c.clip_qkv, None);
        let llama = parse(BASE).unwrap();
        assert!(!llama.weightless_norms && llama.clip_qkv.is_none());
        let cases = [
            ("olmo", r#""clip_qkv":0"#, "clip_qkv 0 must be"),
            ("olmo", r#""clip_qkv":-8"#, "clip_qkv -8 must be"),
            ("olmo", r#""attention_bias":true"#, "attention_bias = true (biases on q/k/v and o_proj)"),
            ("llama", r#""clip_qkv":8"#, "clip_qkv 8 is not supported for llama (but for olmo)"),
        ];
        for (model_type, extra, msg) in cases {
            let e = parse(&config(model_type, extra)).unwrap_err().to_string();
            assert!(e.contains(msg), "{model_type} {extra}: {e}");
        }
    }

    /// StableLM: LayerNorms of `layer_norm_eps`, a quarter of each head rotated and no q/k/v
    /// biases where the folder is silent; StableLM 2 12B's q/k LayerNorms and parallel
    /// residual refused.
    #[test]
    fn stablelm_settings() {
        let c = parse(&config("stablelm", r#""layer_norm_eps":1e-4"#)).unwrap();
        assert_eq!((c.arch, c.rms_norm_eps, c.layer_norm, c.rotary_dim), (Arch::StableLm, 1e-4, true, 4));
        assert!(!c.qkv_bias && !c.linear_bias && c.gated_ffn && !c.tie_word_embeddings);
        let c = parse(&config("stablelm", r#""use_qkv_bias":true,"partial_rotary_factor":0.5"#)).unwrap();
        assert_eq!((c.qkv_bias, c.rotary_dim, c.rms_norm_eps), (true, 8, 1e-5));
        for key in ["qk_layernorm", "use_parallel_residual"] {
            let e = parse(&config("stablelm", &format!(r#""{key}":true"#))).unwrap_err().to_string();
            assert!(e.contains(&format!("{key} = true is not supported")), "{e}");
        }
    }

    /// Phi-2: LayerNorms, every bias (the head's too), no gate, a parallel residual, half of
    /// each head rotated where the folder is silent; its per-head q/k LayerNorms refused.
    #[test]
    fn phi_settings() {
        let c = parse(&config("phi", r#""partial_rotary_factor":0.4,"hidden_act":"gelu_new""#)).unwrap();
        assert_eq!((c.arch, c.rotary_dim, c.activation), (Arch::Phi, 6, Activation::GeluTanh));
        assert!(c.layer_norm && c.qkv_bias && c.linear_bias && c.head_bias && c.parallel_residual);
        assert!(!c.gated_ffn && !c.tie_word_embeddings);
        assert_eq!(parse(&BASE.replace("llama", "phi")).unwrap().rotary_dim, 8);
        let e = parse(&config("phi", r#""qk_layernorm":true"#)).unwrap_err().to_string();
        assert!(e.contains("qk_layernorm = true is not supported for phi"), "{e}");
        let llama = parse(BASE).unwrap();
        assert!(!llama.parallel_residual && !llama.head_bias);
    }

    /// Falcon-7B's config.json as published (no `activation`, `ffn_hidden_size`, `rope_theta`,
    /// `max_position_embeddings` or `tie_word_embeddings`): HF's defaults (GELU itself, four
    /// times the hidden size, tied); one KV head with `multi_query`, `num_kv_heads` with
    /// `new_decoder_architecture` (its two norms by default, one where
    /// `num_ln_in_parallel_attn` says), one per head otherwise; what HF does not run refused.
    #[test]
    fn falcon_layouts_and_defaults() {
        let seven_b = r#"{"alibi":false,"architectures":["FalconForCausalLM"],"bias":false,
            "bos_token_id":11,"eos_token_id":11,"hidden_size":4544,"layer_norm_epsilon":1e-05,
            "model_type":"falcon","multi_query":true,"new_decoder_architecture":false,
            "num_attention_heads":71,"num_hidden_layers":32,"parallel_attn":true,"vocab_size":65024}"#;
        let c = parse(seven_b).unwrap();
        assert_eq!(
            (c.arch, c.n_heads, c.n_kv_heads, c.head_dim, c.rotary_dim),
            (Arch::Falcon, 71, 1, 64, 64)
        );
        assert_eq!((c.intermediate_size, c.activation, c.rms_norm_eps), (4 * 4544, Activation::Gelu, 1e-5));
        assert_eq!((c.max_position_embeddings, c.rope_theta, c.eos_token_ids.clone()), (2048, 1e4, vec![11]));
        assert!(c.tie_word_embeddings && c.layer_norm && c.parallel_residual && !c.parallel_ffn_norm);
        assert!(!c.gated_ffn && !c.qkv_bias && !c.linear_bias && !c.head_bias && !c.rope_interleaved);
        let falcon = |extra: &str| {
            let text = format!(
                r#"{{"model_type":"falcon","hidden_size":64,"num_hidden_layers":2,"num_attention_heads":4,
                "vocab_size":100,{extra}}}"#
            );
            parse(&text)
        };
        let forty_b =
            falcon(r#""new_decoder_architecture":true,"num_kv_heads":2,"ffn_hidden_size":96"#).unwrap();
        assert_eq!((forty_b.n_kv_heads, forty_b.intermediate_size), (2, 96));
        assert!(forty_b.parallel_residual && forty_b.parallel_ffn_norm);
        // Falcon2-11B: groups, one norm.
        let eleven_b =
            falcon(r#""new_decoder_architecture":true,"num_kv_heads":2,"num_ln_in_parallel_attn":1"#);
        let eleven_b = eleven_b.unwrap();
        assert!(eleven_b.parallel_residual && !eleven_b.parallel_ffn_norm);
        let c = falcon(r#""multi_query":false,"parallel_attn":false,"activation":"gelu_new""#).unwrap();
        assert_eq!((c.n_kv_heads, c.parallel_residual, c.activation), (4, false, Activation::GeluTanh));
        // A `head_dim` key (which HF's Falcon never reads) changes nothing.
        assert_eq!(falcon(r#""head_dim":8"#).unwrap().head_dim, 16);
        let refused = [
            (r#""alibi":true"#, "alibi = true (ALiBi positions, Falcon-RW's) is not supported"),
            (r#""bias":true"#, "bias = true (biases on every projection, Falcon-RW's)"),
            (
                r#""new_decoder_architecture":true,"parallel_attn":false"#,
                "parallel_attn = false with new_decoder",
            ),
            (r#""new_decoder_architecture":true,"num_ln_in_parallel_attn":3"#, "num_ln_in_parallel_attn 3"),
            (r#""num_ln_in_parallel_attn":2"#, "num_ln_in_parallel_attn 2 without new_decoder_architecture"),
            (
                r#""multi_query":false,"num_kv_heads":2"#,
                "num_kv_heads (2) differs from num_attention_heads (4)",
            ),
            (
                r#""new_decoder_architecture":true,"num_kv_heads":3"#,
                "not a multiple of num_key_value_heads (3)",
            ),
            (r#""ffn_hidden_size":0"#, "`ffn_hidden_size` is 0"),
            (r#""hidden_size":66"#, "hidden_size (66) is not a multiple of num_attention_heads (4)"),
        ];
        for (extra, msg) in refused {
            let text = format!(
                r#"{{"model_type":"falcon","num_hidden_layers":2,"num_attention_heads":4,"vocab_size":100,{extra}{}}}"#,
                if extra.starts_with(r#""hidden_size""#) { "" } else { r#","hidden_size":64"# }
            );
            let e = parse(&text).unwrap_err().to_string();
            assert!(e.contains(msg), "{extra}: {e}");
        }
        // Other families still need their FFN's width.
        let e = parse(&BASE.replace(r#""intermediate_size":128,"#, "")).unwrap_err().to_string();
        assert!(e.contains("missing field `intermediate_size`"), "{e}");
    }

    /// Pythia-70M's config.json as published (transformers 4's `rotary_pct`,
    /// `rotary_emb_base`): a quarter of each head rotated, GELU itself, every bias, two
    /// LayerNorms of each layer's input; transformers 5's `rope_parameters` read alike; the
    /// sequential form where `use_parallel_residual` is false; q/k/v without biases refused.
    #[test]
    fn gpt_neox_settings() {
        let pythia = r#"{"architectures":["GPTNeoXForCausalLM"],"bos_token_id":0,"eos_token_id":0,
            "hidden_act":"gelu","hidden_size":512,"initializer_range":0.02,"intermediate_size":2048,
            "layer_norm_eps":1e-05,"max_position_embeddings":2048,"model_type":"gpt_neox",
            "num_attention_heads":8,"num_hidden_layers":6,"rotary_emb_base":10000,"rotary_pct":0.25,
            "tie_word_embeddings":false,"use_cache":true,"use_parallel_residual":true,"vocab_size":50304}"#;
        let c = parse(pythia).unwrap();
        assert_eq!(
            (c.arch, c.n_heads, c.n_kv_heads, c.head_dim, c.rotary_dim),
            (Arch::GptNeoX, 8, 8, 64, 16)
        );
        assert_eq!(
            (c.activation, c.rms_norm_eps, c.rope_theta, c.intermediate_size),
            (Activation::Gelu, 1e-5, 1e4, 2048)
        );
        assert!(c.layer_norm && c.qkv_bias && c.linear_bias && c.parallel_residual && c.parallel_ffn_norm);
        assert!(!c.gated_ffn && !c.head_bias && !c.tie_word_embeddings && !c.rope_interleaved);
        let v5 = pythia.replace(
            r#""rotary_emb_base":10000,"rotary_pct":0.25,"#,
            r#""rope_parameters":{"rope_type":"default","rope_theta":50000.0,"partial_rotary_factor":0.5},"#,
        );
        let c = parse(&v5).unwrap();
        assert_eq!((c.rotary_dim, c.rope_theta), (32, 5e4));
        let c = parse(&pythia.replace(r#""use_parallel_residual":true"#, r#""use_parallel_residual":false"#))
            .unwrap();
        assert!(!c.parallel_residual && !c.parallel_ffn_norm);
        let e = parse(&pythia.replace(r#""use_cache":true"#, r#""attention_bias":false"#)).unwrap_err();
        assert!(e.to_string().contains("attention_bias = false"), "{e}");
    }

    /// GPT-2 and GPT-BigCode: their own key names (OpenAI's gpt2 and starcoderbase-1b's
    /// published config.json), HF's defaults for the keys left out, learned positions and no
    /// RoPE, one KV head where `multi_query` (its default); unscaled attention where
    /// `scale_attn_weights` is false; what HF would run otherwise refused.
    #[test]
    fn gpt2_and_gpt_bigcode_settings() {
        let gpt2 = r#"{"activation_function":"gelu_new","architectures":["GPT2LMHeadModel"],"attn_pdrop":0.1,
            "bos_token_id":50256,"embd_pdrop":0.1,"eos_token_id":50256,"initializer_range":0.02,
            "layer_norm_epsilon":1e-05,"model_type":"gpt2","n_ctx":1024,"n_embd":768,"n_head":12,
            "n_layer":12,"n_positions":1024,"resid_pdrop":0.1,"summary_activation":null,
            "summary_first_dropout":0.1,"summary_proj_to_labels":true,"summary_type":"cls_index",
            "summary_use_proj":true,"vocab_size":50257}"#;
        let c = parse(gpt2).unwrap();
        assert_eq!(
            (c.arch, c.hidden_size, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim),
            (Arch::Gpt2, 768, 12, 12, 12, 64)
        );
        assert_eq!(
            (c.intermediate_size, c.max_position_embeddings, c.vocab_size, c.activation, c.rms_norm_eps),
            (3072, 1024, 50257, Activation::GeluTanh, 1e-5)
        );
        assert_eq!(
            (c.attn_scale, c.eos_token_ids.clone(), c.bos_token_id),
            (0.125, vec![50256], Some(50256))
        );
        assert!(c.learned_positions && c.tie_word_embeddings && c.layer_norm && c.qkv_bias && c.linear_bias);
        assert!(!c.gated_ffn && !c.parallel_residual && !c.head_bias);
        assert!((0..12).all(|i| c.layer_rope(i) == LayerRope::None));
        // GPT2Config's defaults: the smallest GPT-2.
        let c = parse(r#"{"model_type":"gpt2"}"#).unwrap();
        assert_eq!((c.hidden_size, c.n_layers, c.n_heads, c.intermediate_size), (768, 12, 12, 3072));
        let c = parse(&gpt2.replace(r#""n_ctx":1024"#, r#""scale_attn_weights":false"#)).unwrap();
        assert_eq!(c.attn_scale, 1.0);
        let starcoder = r#"{"activation_function":"gelu_pytorch_tanh","architectures":["GPTBigCodeForCausalLM"],
            "attention_softmax_in_fp32":true,"multi_query":true,"attn_pdrop":0.1,"bos_token_id":0,
            "embd_pdrop":0.1,"eos_token_id":0,"inference_runner":0,"initializer_range":0.02,
            "layer_norm_epsilon":1e-05,"max_batch_size":null,"max_sequence_length":null,
            "model_type":"gpt_bigcode","n_embd":2048,"n_head":16,"n_inner":8192,"n_layer":24,
            "n_positions":8192,"pad_key_length":true,"pre_allocate_kv_cache":false,"resid_pdrop":0.1,
            "scale_attention_softmax_in_fp32":true,"scale_attn_weights":true,"use_cache":true,
            "vocab_size":49152}"#;
        let c = parse(starcoder).unwrap();
        assert_eq!(
            (c.arch, c.n_heads, c.n_kv_heads, c.head_dim, c.intermediate_size, c.max_position_embeddings),
            (Arch::GptBigCode, 16, 1, 128, 8192, 8192)
        );
        assert!(c.learned_positions && c.tie_word_embeddings && !c.gated_ffn);
        let c = parse(&starcoder.replace(r#""multi_query":true"#, r#""multi_query":false"#)).unwrap();
        assert_eq!(c.n_kv_heads, 16);
        let c = parse(&starcoder.replace(r#""multi_query":true,"#, "")).unwrap();
        assert_eq!(c.n_kv_heads, 1);
        refused_with(&[
            (&gpt2.replace(r#""n_ctx":1024"#, r#""add_cross_attention":true"#), "add_cross_attention = true"),
            (
                &gpt2.replace(r#""n_ctx":1024"#, r#""scale_attn_by_inverse_layer_idx":true"#),
                "scale_attn_by_inverse_layer_idx = true",
            ),
            (&gpt2.replace(r#""n_ctx":1024"#, r#""hidden_size":768"#), "both `n_embd` and `hidden_size`"),
            (&gpt2.replace(r#""n_ctx":1024"#, r#""n_inner":"wide""#), "invalid config"),
            (&gpt2.replace("gelu_new", "swish"), "unsupported hidden activation `swish`"),
        ]);
    }

    /// GLM-4: HF's Glm4Config defaults where the folder is silent (half of each head rotated,
    /// q/k/v biases, its norm epsilon and end tokens), interleaved pairs, four norms; the first
    /// GLM-4 (`glm`) the same with two.
    #[test]
    fn glm4_defaults_and_settings() {
        let c = parse(&BASE.replace("llama", "glm")).unwrap();
        assert_eq!((c.arch, c.rotary_dim, c.qkv_bias, c.rope_interleaved), (Arch::Glm, 8, true, true));
        assert_eq!((c.rms_norm_eps, c.eos_token_ids.len(), c.norm_place), (1.5625e-7, 3, NormPlace::Pre));
        let c = parse(&BASE.replace("llama", "glm4")).unwrap();
        assert_eq!((c.arch, c.rotary_dim, c.qkv_bias, c.rope_interleaved), (Arch::Glm4, 8, true, true));
        assert_eq!((c.rms_norm_eps, c.eos_token_ids.clone()), (1.5625e-7, vec![151329, 151336, 151338]));
        assert_eq!(
            (c.norm_place, c.norm_plus_one, c.tie_word_embeddings),
            (NormPlace::Sandwich, false, false)
        );
        let c = parse(&config(
            "glm4",
            r#""partial_rotary_factor":1.0,"attention_bias":false,"rms_norm_eps":1e-5,"eos_token_id":[7]"#,
        ))
        .unwrap();
        assert_eq!((c.rotary_dim, c.qkv_bias, c.rms_norm_eps, c.eos_token_ids), (16, false, 1e-5, vec![7]));
        assert!(!parse(&BASE.replace("llama", "qwen2")).unwrap().rope_interleaved);
    }

    #[test]
    fn longrope_factors_context_and_attention_factor() {
        // Phi-3-mini-128k's form: the original context beside `rope_scaling`.
        let short: Vec<f64> = (0..8).map(|i| 1.0 + i as f64 / 8.0).collect();
        let long: Vec<f64> = (0..8).map(|i| 2.0 + i as f64).collect();
        let scaling = serde_json::json!({"type": "longrope", "short_factor": short, "long_factor": long});
        let extra = format!(
            r#""max_position_embeddings":131072,"original_max_position_embeddings":4096,"rope_scaling":{scaling}"#
        );
        let c = parse(&config("phi3", &extra)).unwrap();
        let unscaled: Vec<f64> = (0..8).map(|i| 1.0 / 10000f64.powf(2.0 * i as f64 / 16.0)).collect();
        let f = c.rope_inv_freq();
        let (fl, original) = c.rope_inv_freq_long().unwrap();
        for i in 0..8 {
            assert_eq!((f[i], fl[i]), (unscaled[i] / short[i], unscaled[i] / long[i]));
        }
        assert_eq!(original, 4096);
        // HF's: sqrt(1 + ln(131072 / 4096) / ln 4096).
        assert!((c.rope_attention_factor() - (1.0 + 32f64.ln() / 4096f64.ln()).sqrt()).abs() < 1e-12);
        assert!(!c.long_rope(4096) && c.long_rope(4097));
        // The original context inside `rope_scaling`, an attention factor given.
        let inner = serde_json::json!({"rope_type": "longrope", "short_factor": short, "long_factor": long,
            "original_max_position_embeddings": 1024, "attention_factor": 1.25});
        let c = parse(&config("phi3", &format!(r#""max_position_embeddings":8192,"rope_scaling":{inner}"#)))
            .unwrap();
        assert_eq!((c.long_rope_original(), c.rope_attention_factor()), (Some(1024), 1.25));
        // Neither: `factor` over the whole context; 1 gives no attention factor.
        let none = serde_json::json!({"type": "longrope", "short_factor": short, "long_factor": long, "factor": 1.0});
        let c = parse(&config("phi3", &format!(r#""rope_scaling":{none}"#))).unwrap();
        assert_eq!((c.long_rope_original(), c.rope_attention_factor()), (Some(4096), 1.0));
        assert!(parse(BASE).unwrap().rope_inv_freq_long().is_none());
        // Factors one short, or not numbers; no factor and no original context.
        let bad = serde_json::json!({"type": "longrope", "short_factor": &short[..7], "long_factor": long, "factor": 2.0});
        let e = parse(&config("phi3", &format!(r#""rope_scaling":{bad}"#))).unwrap_err().to_string();
        assert!(e.contains("`short_factor` must be a list of 8 finite positive numbers"), "{e}");
        let bad = serde_json::json!({"type": "longrope", "short_factor": short, "long_factor": vec!["x"; 8], "factor": 2.0});
        let e = parse(&config("phi3", &format!(r#""rope_scaling":{bad}"#))).unwrap_err().to_string();
        assert!(e.contains("`long_factor` must be a list of 8"), "{e}");
        let bad = serde_json::json!({"type": "longrope", "short_factor": short, "long_factor": long});
        let e = parse(&config("phi3", &format!(r#""rope_scaling":{bad}"#))).unwrap_err().to_string();
        assert!(e.contains("lacks the number `factor`"), "{e}");
    }

    #[test]
    fn yarn_ramp_and_attention_factor() {
        // Heads of 16, base 10000, 4 times an original context of 256: the pairs that turn 32
        // times over it (dimension 0.21, down to 0) are kept, those turning once (3.22, up to
        // 4) and fewer divided by 4, a ramp between.
        let yarn = |more: &str| {
            let scaling = format!(
                r#"{{"rope_type":"yarn","factor":4.0,"original_max_position_embeddings":256{more}}}"#
            );
            parse(&config("qwen2", &format!(r#""max_position_embeddings":1024,"rope_scaling":{scaling}"#)))
                .unwrap()
        };
        let c = yarn("");
        let unscaled: Vec<f64> = (0..8).map(|i| 1.0 / 10000f64.powf(2.0 * i as f64 / 16.0)).collect();
        let keep = [1.0, 0.75, 0.5, 0.25, 0.0, 0.0, 0.0, 0.0];
        for (i, f) in c.rope_inv_freq().iter().enumerate() {
            let want = unscaled[i] * keep[i] + unscaled[i] / 4.0 * (1.0 - keep[i]);
            assert!((f - want).abs() < 1e-15, "pair {i}: {f} against {want}");
        }
        assert!((c.rope_attention_factor() - (1.0 + 0.1 * 4f64.ln())).abs() < 1e-15);
        assert!(c.rope_inv_freq_long().is_none() && !c.long_rope(100_000));
        // Without truncation the ramp runs from 0.21 to 3.22; DeepSeek's mscale pair; a given
        // attention factor.
        let c = yarn(r#","truncate":false"#);
        let (low, high) = (
            16.0 * (256.0 / (64.0 * std::f64::consts::PI)).ln(),
            16.0 * (256.0 / (2.0 * std::f64::consts::PI)).ln(),
        );
        let (low, high) = (low / (2.0 * 10000f64.ln()), high / (2.0 * 10000f64.ln()));
        let k1 = 1.0 - (1.0 - low) / (high - low);
        assert!((c.rope_inv_freq()[1] - (unscaled[1] * k1 + unscaled[1] / 4.0 * (1.0 - k1))).abs() < 1e-15);
        let c = yarn(r#","mscale":1.0,"mscale_all_dim":0.5"#);
        let want = (1.0 + 0.1 * 4f64.ln()) / (1.0 + 0.05 * 4f64.ln());
        assert!((c.rope_attention_factor() - want).abs() < 1e-15);
        assert_eq!(yarn(r#","attention_factor":1.25"#).rope_attention_factor(), 1.25);
        let e = parse(&config("qwen2", r#""rope_scaling":{"rope_type":"yarn"}"#)).unwrap_err().to_string();
        assert!(e.contains("lacks the number `factor`"), "{e}");
        let e = parse(&config("qwen2", r#""rope_scaling":{"rope_type":"yarn","factor":4,"beta_fast":-1}"#))
            .unwrap_err()
            .to_string();
        assert!(e.contains("`beta_fast` is -1"), "{e}");
    }

    /// transformers 5's `rope_parameters` read as the transformers 4 keys it replaces: flat,
    /// nested by layer type (Gemma 3), its values winning over the same keys beside it.
    #[test]
    fn transformers5_rope_parameters() {
        let rope = |c: &ModelConfig| (c.rope_theta, c.rope_scaling.clone(), c.rotary_dim, c.rope_local_theta);
        let llama3 =
            r#""factor":8,"low_freq_factor":1,"high_freq_factor":4,"original_max_position_embeddings":8192"#;
        let v4 = parse(&config(
            "llama",
            &format!(r#""rope_theta":5e5,"rope_scaling":{{"rope_type":"llama3",{llama3}}}"#),
        ));
        let v5 = parse(&config(
            "llama",
            &format!(
                r#""rope_theta":1e4,"rope_parameters":{{"rope_theta":5e5,"rope_type":"llama3",{llama3}}}"#
            ),
        ));
        assert_eq!(rope(&v5.unwrap()), rope(&v4.unwrap()));
        // Unscaled, by either version's name for it.
        let c =
            parse(&config("llama", r#""rope_parameters":{"rope_theta":5e5,"rope_type":"default"}"#)).unwrap();
        assert_eq!(rope(&c), (5e5, None, 16, None));
        let c = parse(&config("llama", r#""rope_scaling":{"type":"default"}"#)).unwrap();
        assert_eq!(rope(&c), (1e4, None, 16, None));
        // Part of a head (Phi-3's), and LongRoPE's original context beside the parameters.
        let pairs = "[1,1,1,1,1,1]";
        let phi = format!(
            r#""original_max_position_embeddings":64,"max_position_embeddings":256,"rope_parameters":{{"rope_type":"longrope","rope_theta":1e4,"partial_rotary_factor":0.75,"short_factor":{pairs},"long_factor":{pairs}}}"#
        );
        let c = parse(&config("phi3", &phi)).unwrap();
        assert_eq!((c.rotary_dim, c.long_rope_original()), (12, Some(64)));
        // Gemma 3: the full-attention layers' settings, the sliding layers' base.
        let nested = r#""rope_parameters":{"full_attention":{"rope_type":"linear","factor":8,"rope_theta":1e6},"sliding_attention":{"rope_type":"default","rope_theta":1e4}}"#;
        let c = parse(&config("gemma3_text", nested)).unwrap();
        assert_eq!(rope(&c), (1e6, Some(RopeScaling::Linear { factor: 8.0 }), 16, Some(1e4)));
        let local = nested.replace("1e4", "5e4");
        assert_eq!(parse(&config("gemma3_text", &local)).unwrap().rope_local_theta, Some(5e4));
        // An image-and-text folder's text model.
        let image_text = format!(r#"{{"model_type":"gemma3","text_config":{{"head_dim":16,{nested}}}}}"#);
        let c = parse(&image_text).unwrap();
        assert_eq!((c.rope_theta, c.rope_local_theta), (1e6, Some(1e4)));
        let refused = [
            ("llama", r#""rope_parameters":4"#, "rope_parameters is 4 (expected an object)"),
            (
                "llama",
                r#""rope_scaling":{"rope_type":"linear","factor":2},"rope_parameters":{"rope_theta":1e4}"#,
                "both rope_scaling and rope_parameters are given",
            ),
            (
                "llama",
                r#""rope_parameters":{"full_attention":{"rope_theta":1e4},"sliding_attention":{"rope_theta":1e6}}"#,
                "sliding_attention layers RoPE settings of their own",
            ),
            (
                "gemma3_text",
                r#""rope_parameters":{"full_attention":{},"sliding_attention":{"rope_type":"linear","factor":2}}"#,
                "sliding_attention has rope_type `linear`",
            ),
            (
                "gemma3_text",
                r#""rope_parameters":{"full_attention":{},"chunked":{}}"#,
                "has `chunked` beside",
            ),
            (
                "llama",
                r#""rope_parameters":{"rope_type":"dynamic","factor":2}"#,
                "unsupported rope_scaling type `dynamic`",
            ),
        ];
        for (model, extra, msg) in refused {
            let e = parse(&config(model, extra)).unwrap_err().to_string();
            assert!(e.contains(msg) && e.starts_with("config.json: "), "{extra}: {e}");
        }
    }

    #[test]
    fn gemma3_text_local_layers_norms_and_activation() {
        let c =
            parse(&config("gemma3_text", r#""head_dim":32,"sliding_window":512,"rope_theta":1e6"#)).unwrap();
        assert_eq!(
            (c.arch, c.head_dim, c.sliding_window, c.rope_local_theta),
            (Arch::Gemma3, 32, Some(512), Some(1e4))
        );
        assert_eq!(c.activation, Activation::GeluTanh);
        assert!(
            c.qk_norm
                && c.norm_plus_one
                && c.scale_embedding
                && c.norm_place == NormPlace::Sandwich
                && !c.qkv_bias
        );
        // query_pre_attn_scalar's default, 256, sets the scale, not head_dim.
        assert_eq!(c.attn_scale, 1.0 / 16.0);
        // The default pattern: every sixth layer global (two layers here: both local).
        assert_eq!((c.layer_window(0), c.layer_window(1), c.is_local(1)), (Some(512), Some(512), true));
        let c = parse(&config("gemma3_text", r#""sliding_window_pattern":2,"query_pre_attn_scalar":64"#))
            .unwrap();
        assert_eq!((c.layer_window(0), c.layer_window(1), c.is_local(1)), (Some(4096), None, false));
        assert_eq!(c.attn_scale, 0.125);
        let types = r#""layer_types":["full_attention","sliding_attention"],"sliding_window":8"#;
        let c = parse(&config("gemma3_text", types)).unwrap();
        assert_eq!((c.layer_window(0), c.layer_window(1), c.is_local(0)), (None, Some(8), false));
        // Local RoPE frequencies ignore the global scaling.
        let scaled = r#""rope_theta":10000,"rope_scaling":{"rope_type":"linear","factor":8}"#;
        let c = parse(&config("gemma3_text", scaled)).unwrap();
        let (global, local) = (c.rope_inv_freq(), c.rope_local_inv_freq().unwrap());
        assert_eq!((global[0], local[0], local[1] / global[1]), (0.125, 1.0, 8.0));
        let refused = [
            (r#""final_logit_softcapping":0"#, "final_logit_softcapping 0 must be a finite positive number"),
            (r#""attn_logit_softcapping":-50.0"#, "attn_logit_softcapping -50 must be a finite positive"),
            (r#""layer_types":["full_attention"]"#, "layer_types has 1 entries for 2 layers"),
            (r#""layer_types":["full_attention","chunked"]"#, "layer_types holds `chunked`"),
            (r#""sliding_window_pattern":0"#, "sliding_window_pattern is 0"),
            (r#""sliding_window":0"#, "sliding_window is 0"),
            (r#""hidden_activation":"relu""#, "unsupported hidden activation `relu`"),
            (r#""use_bidirectional_attention":true"#, "use_bidirectional_attention = true"),
        ];
        for (extra, msg) in refused {
            let e = parse(&config("gemma3_text", extra)).unwrap_err().to_string();
            assert!(e.contains(msg), "{extra}: {e}");
        }
        // An image-and-text folder: its text model, HF's defaults where `text_config` is silent.
        let folder = r#"{"model_type":"gemma3","eos_token_id":[1,106],"vision_config":{"hidden_size":1152},
            "text_config":{"hidden_size":2560,"intermediate_size":10240,"num_hidden_layers":34,
            "model_type":"gemma3_text","rope_scaling":{"factor":8.0,"rope_type":"linear"},"sliding_window":1024}}"#;
        let c = parse(folder).unwrap();
        assert_eq!(
            (c.arch, c.hidden_size, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim),
            (Arch::Gemma3, 2560, 34, 8, 4, 256)
        );
        assert_eq!(
            (c.vocab_size, c.rope_theta, c.rope_local_theta, c.attn_scale),
            (262208, 1e6, Some(1e4), 1.0 / 16.0)
        );
        assert_eq!(
            (c.layer_window(4), c.layer_window(5), c.eos_token_ids.clone()),
            (Some(1024), None, vec![1, 106])
        );
        assert_eq!(c.rope_scaling, Some(RopeScaling::Linear { factor: 8.0 }));
        assert!(c.tie_word_embeddings && c.qk_norm && c.norm_place == NormPlace::Sandwich);
        let e = parse(r#"{"model_type":"gemma3"}"#).unwrap_err().to_string();
        assert!(e.contains("model_type `gemma3` without an object `text_config`"), "{e}");
        let e = parse(r#"{"model_type":"gemma3","text_config":{"model_type":"gemma2"}}"#).unwrap_err();
        assert!(e.to_string().contains("text_config has model_type `gemma2` (expected gemma3_text)"), "{e}");
        // Logit soft-capping is Gemma's; other families ignore the fields, as HF does.
        let caps = r#""attn_logit_softcapping":50.0,"final_logit_softcapping":30.0"#;
        let c = parse(&config("llama", caps)).unwrap();
        assert_eq!((c.attn_softcap, c.final_softcap), (None, None));
        // The others keep SiLU and plain norms.
        let c = parse(BASE).unwrap();
        assert_eq!(
            (c.activation, c.norm_plus_one, c.norm_place, c.local_layers),
            (Activation::Silu, false, NormPlace::Pre, None)
        );
        assert_eq!(c.attn_scale, 0.25);
    }

    #[test]
    fn smollm3_leaves_some_layers_unrotated() {
        let extra = r#""num_hidden_layers":8"#;
        let c = parse(&config("smollm3", extra).replace(r#""num_hidden_layers":2,"#, "")).unwrap();
        let ropes: Vec<_> = (0..8).map(|i| c.layer_rope(i)).collect();
        // Every fourth layer by default, as HF reads a folder without `no_rope_layers`.
        let (b, n) = (LayerRope::Base, LayerRope::None);
        assert_eq!(ropes, [b, b, b, n, b, b, b, n]);
        let c = parse(&config("smollm3", r#""no_rope_layers":[0,1]"#)).unwrap();
        assert_eq!((c.arch, c.layer_rope(0), c.layer_rope(1)), (Arch::SmolLM3, n, b));
        let refused = [
            (r#""no_rope_layers":[1]"#, "no_rope_layers has 1 entries for 2 layers"),
            (r#""no_rope_layers":[1,2]"#, "no_rope_layers holds 2"),
            (r#""no_rope_layer_interval":0"#, "no_rope_layer_interval is 0"),
            (r#""use_sliding_window":true"#, "use_sliding_window = true is not supported for smollm3"),
        ];
        for (extra, msg) in refused {
            let e = parse(&config("smollm3", extra)).unwrap_err().to_string();
            assert!(e.contains(msg), "{extra}: {e}");
        }
        // Other families rotate every layer.
        assert_eq!(parse(BASE).unwrap().layer_rope(1), b);
    }

    #[test]
    fn gemma_takes_gelu_whatever_hidden_act_says() {
        // The first Gemma's folders say `"hidden_act": "gelu"`; HF runs GELU's tanh form.
        let c = parse(&config("gemma", r#""head_dim":32,"hidden_act":"gelu""#)).unwrap();
        assert_eq!((c.arch, c.activation), (Arch::Gemma, Activation::GeluTanh));
        // Its folders leave `tie_word_embeddings` out: tied, as HF's default for Gemma.
        assert!(c.tie_word_embeddings);
        assert!(c.norm_plus_one && c.scale_embedding && c.norm_place == NormPlace::Pre && !c.qk_norm);
        assert_eq!((c.sliding_window, c.local_layers, c.attn_softcap), (None, None, None));
        assert_eq!(c.attn_scale, 1.0 / 32f32.sqrt());
        // `hidden_activation` says what it means: GELU itself where it says `gelu`.
        let c = parse(&config("gemma", r#""head_dim":32,"hidden_activation":"gelu""#)).unwrap();
        assert_eq!(c.activation, Activation::Gelu);
    }

    #[test]
    fn gemma2_soft_caps_and_every_other_layer_local() {
        let extra = r#""head_dim":32,"attn_logit_softcapping":50.0,"final_logit_softcapping":30.0,
            "num_hidden_layers":3,"query_pre_attn_scalar":256,"sliding_window":4096"#;
        let c = parse(&config("gemma2", extra).replace(r#""num_hidden_layers":2,"#, "")).unwrap();
        assert_eq!((c.arch, c.attn_softcap, c.final_softcap), (Arch::Gemma2, Some(50.0), Some(30.0)));
        assert!(c.norm_plus_one && c.scale_embedding && c.norm_place == NormPlace::Sandwich && !c.qk_norm);
        assert_eq!(c.activation, Activation::GeluTanh);
        // Layers 0 and 2 local, through the window, on the one RoPE base.
        let windows: Vec<_> = (0..3).map(|i| c.layer_window(i)).collect();
        assert_eq!(windows, [Some(4096), None, Some(4096)]);
        assert_eq!((c.rope_local_theta, c.rope_local_inv_freq()), (None, None));
        assert_eq!(c.attn_scale, 1.0 / 16.0);
        // No caps: none applied.
        let c = parse(&config("gemma2", r#""head_dim":32"#)).unwrap();
        assert_eq!((c.attn_softcap, c.final_softcap), (None, None));
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

    /// Granite 3's multipliers as given (HF's 1 where not), the attention's replacing
    /// 1/√head_dim; another family's are ignored, as HF ignores them. GraniteMoE's mixture.
    #[test]
    fn granite_reads_its_multipliers() {
        let m = r#""embedding_multiplier":12.0,"attention_multiplier":0.015625,"residual_multiplier":0.22,
                   "logits_scaling":8.0"#;
        let c = parse(&config("granite", m)).unwrap();
        assert_eq!(c.arch, Arch::Granite);
        let got = (c.embedding_multiplier, c.attn_scale, c.residual_multiplier, c.logits_scaling);
        assert_eq!(got, (12.0, 0.015625, 0.22, 8.0));
        let c = parse(&config("granite", "").replace(",}", "}")).unwrap();
        let got = (c.embedding_multiplier, c.attn_scale, c.residual_multiplier, c.logits_scaling);
        assert_eq!(got, (1.0, 1.0, 1.0, 1.0));
        let c = parse(&config("llama", m)).unwrap();
        let got = (c.embedding_multiplier, c.attn_scale, c.residual_multiplier, c.logits_scaling);
        assert_eq!(got, (1.0, 0.25, 1.0, 1.0));
        // GraniteMoE: Mixtral's mixture on every layer (HF's defaults: 8 experts, 2 a token),
        // the shares of the chosen experts summing to one, the multipliers as Granite's.
        let c = parse(&config("granitemoe", m)).unwrap();
        let moe = c.moe.clone().unwrap();
        assert_eq!((c.arch, c.attn_scale, c.logits_scaling), (Arch::GraniteMoe, 0.015625, 8.0));
        assert_eq!((moe.experts, moe.per_token, moe.expert_ffn, moe.norm_topk), (8, 2, 128, true));
        assert_eq!((moe.shared_ffn, moe.sparse), (0, vec![true, true]));
        for (extra, msg) in [
            (r#""logits_scaling":0"#, "logits_scaling 0 must be a finite positive number"),
            (r#""residual_multiplier":-0.5"#, "residual_multiplier -0.5 must be a finite positive number"),
            (r#""mlp_bias":true"#, "mlp_bias = true"),
            (r#""attention_bias":true"#, "attention_bias = true"),
        ] {
            let e = parse(&config("granite", extra)).unwrap_err().to_string();
            assert!(e.contains(msg), "{extra}: {e}");
        }
    }

    /// Granite 4 (`granitemoehybrid`) runs when every layer is attention and none has experts:
    /// its FFN as wide as `shared_intermediate_size`, unrotated unless `position_embedding_type`
    /// is `rope`. Mamba layers, experts (HF's default 8), a missing layer list are one error each.
    #[test]
    fn granite_hybrid_runs_only_its_dense_attention_models() {
        let dense =
            r#""num_local_experts":0,"layer_types":["attention","attention"],"shared_intermediate_size":96"#;
        let c = parse(&config("granitemoehybrid", &format!(r#"{dense},"position_embedding_type":"rope""#)))
            .unwrap();
        assert_eq!(
            (c.arch, c.intermediate_size, c.no_rope_layers.clone()),
            (Arch::GraniteMoeHybrid, 96, None)
        );
        assert_eq!(c.layer_rope(1), LayerRope::Base);
        let c = parse(&config("granitemoehybrid", dense)).unwrap();
        assert_eq!(c.no_rope_layers, Some(vec![true, true]));
        assert_eq!(c.layer_rope(0), LayerRope::None);
        // The old name of the layer list; HF's default width.
        let old = r#""num_local_experts":0,"layers_block_type":["attention","attention"]"#;
        assert_eq!(parse(&config("granitemoehybrid", old)).unwrap().intermediate_size, 1024);
        for (extra, msg) in [
            (r#""layer_types":["attention","attention"]"#, "with 8 experts a layer (num_local_experts)"),
            (
                r#""num_local_experts":4,"layer_types":["attention","attention"]"#,
                "with 4 experts a layer (num_local_experts) is not supported",
            ),
            (r#""num_local_experts":0"#, "granitemoehybrid without layer_types"),
            (
                r#""num_local_experts":0,"layer_types":["attention"]"#,
                "layer_types has 1 entries for 2 layers",
            ),
            (
                r#""num_local_experts":0,"layer_types":["attention","mamba"]"#,
                "layer 1 is of type `mamba`: only attention layers are supported",
            ),
            (
                &format!(r#"{dense},"position_embedding_type":"alibi""#),
                "position_embedding_type `alibi` is not supported",
            ),
        ] {
            let e = parse(&config("granitemoehybrid", extra)).unwrap_err().to_string();
            assert!(e.contains(msg), "{extra}: {e}");
        }
    }
}
