//! One rank's shard of a decoder-only model (Llama, Mistral, Qwen2, Qwen3, Phi-3, SmolLM3, Gemma,
//! OLMo 2, Granite, the mixtures of experts)
//! and its forward pass.
//! Owns: loading the shard's tensors by their HF names and the layer math. Sees communication
//! only through the [`Comm`] trait: exactly two allreduces per layer, one for the embedding.
//!
//! ```text
//! per layer, on one rank:   x ─ rmsnorm ─ qkv (its heads) ─ rope ─ kv append ─ attention
//!                             └──────────────── + allreduce(o_proj partial) ◄─┘
//!                           x ─ rmsnorm ─ gate/up (its columns) ─ act·mul ─── down partial
//!                             └──────────────── + allreduce ◄───────────────────┘
//! ```

pub mod kv_cache;

use crate::comm::Comm;
use crate::config::{Arch, LayerRope, ModelConfig, NormPlace};
use crate::error::Result;
use crate::grid::ShardPlan;
use crate::kernels::{self, AttendOut, Region, SharedSlice, Team};
use crate::kernels::{PackedMat, Quant};
use crate::weights::checkpoint::Checkpoint;
use crate::weights::{DType, Mat, Source, Transposed};
pub use kv_cache::{KvCache, KvPool, PAGE};
use serde::{Deserialize, Serialize};
use std::ops::Range;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

struct Layer {
    /// The attention's input norm (none in OLMo 2).
    input_norm: Option<Norm>,
    /// The FFN's input norm (`post_attention_layernorm`, Gemma's `pre_feedforward_layernorm`;
    /// none in OLMo 2).
    post_norm: Option<Norm>,
    /// Gemma 2 and 3's norms of the attention and FFN outputs, before they join the residual
    /// stream.
    out_norms: Option<(Vec<f32>, Vec<f32>)>,
    /// Index of its attention's window ([`ModelConfig::layer_window`]) in [`Shard::windows`],
    /// and of its layout of a step's attention items.
    layout: usize,
    /// How it rotates its queries and keys.
    rope: LayerRope,
    /// Rows: this rank's q heads, then its k heads, then its v heads.
    qkv: PackedMat,
    qkv_bias: Option<Vec<f32>>,
    /// Qwen3's RMSNorm weights over each query head and each key head (`head_dim` each).
    head_norms: Option<(Vec<f32>, Vec<f32>)>,
    /// OLMo 2's RMSNorm weights over the whole q and k projections: this rank's heads' slices.
    full_norms: Option<(Vec<f32>, Vec<f32>)>,
    /// Input columns of this rank's q heads.
    o_proj: PackedMat,
    /// o_proj's bias (StarCoder 2's), whole on every rank: added once, to the stage's sum.
    o_bias: Option<Vec<f32>>,
    ffn: Ffn,
    /// A dense FFN's biases (StarCoder 2's): of this rank's columns of its first matrix, and
    /// the whole of its down matrix's (added once, to the stage's sum).
    ffn_bias: Option<(Vec<f32>, Vec<f32>)>,
}

/// A norm's weights (as it multiplies by them), and its biases if it is a LayerNorm.
struct Norm {
    w: Vec<f32>,
    b: Option<Vec<f32>>,
}

impl Norm {
    /// Each `w.len()`-long row of `x` normed into `out`.
    fn apply(&self, x: &[f32], eps: f32, out: &mut [f32]) {
        match &self.b {
            Some(b) => kernels::layernorm(x, &self.w, b, eps, out),
            None => kernels::rmsnorm(x, &self.w, eps, out),
        }
    }

    /// Its f32 values.
    fn len(&self) -> usize {
        self.w.len() + self.b.as_ref().map_or(0, Vec::len)
    }
}

/// A layer's FFN.
enum Ffn {
    Dense {
        /// Rows: this rank's gate columns, then the same up columns.
        gate_up: PackedMat,
        /// Input columns of this rank's FFN range.
        down: PackedMat,
    },
    Experts(Experts),
}

/// A mixture of experts ([`crate::config::Moe`]), each expert split over the tp ranks as a
/// dense FFN is (its columns `ShardPlan::expert_ffn`).
struct Experts {
    /// The router's rows, one per expert: the whole router on every rank, never quantized.
    /// Each rank routes every token itself, without a message: MPI requires an allreduce to
    /// give every rank identical results, so the ranks' residual streams, and so their
    /// routings, are the same bits.
    router: PackedMat,
    /// Per expert, as `Ffn::Dense`'s.
    gate_up: Vec<PackedMat>,
    down: Vec<PackedMat>,
    /// Qwen2-MoE's shared expert: gate/up and down as `Ffn::Dense`'s (its columns
    /// `ShardPlan::shared_ffn`), and its gate's one row (whole on every rank).
    shared: Option<(PackedMat, PackedMat, Vec<f32>)>,
}

impl Ffn {
    /// Bytes of its matrices: of a mixture, the router's, the shared expert's and `experts`
    /// of the others (`None`: all).
    fn bytes(&self, experts: Option<f64>) -> f64 {
        match self {
            Ffn::Dense { gate_up, down } => (gate_up.bytes() + down.bytes()) as f64,
            Ffn::Experts(x) => {
                let all: usize = x.gate_up.iter().chain(&x.down).map(|m| m.bytes()).sum();
                let share = experts.map_or(1.0, |n| n / x.gate_up.len() as f64);
                let shared = x.shared.as_ref().map_or(0, |(gu, d, g)| gu.bytes() + d.bytes() + 4 * g.len());
                (x.router.bytes() + shared) as f64 + all as f64 * share
            }
        }
    }

    /// Its matrices in the order a one-token step runs them (of experts, the router, the
    /// first `per_token` and the shared one).
    fn mats(&self, per_token: usize) -> Vec<&PackedMat> {
        match self {
            Ffn::Dense { gate_up, down } => vec![gate_up, down],
            Ffn::Experts(x) => std::iter::once(&x.router)
                .chain(x.gate_up.iter().zip(&x.down).take(per_token).flat_map(|(a, b)| [a, b]))
                .chain(x.shared.iter().flat_map(|(gu, d, _)| [gu, d]))
                .collect(),
        }
    }
}

/// Layer `i`'s router tensor and expert `e`'s gate, up and down tensors: Qwen2- and
/// Qwen3-MoE's `mlp.experts.E.{gate,up,down}_proj`, Mixtral's
/// `block_sparse_moe.experts.E.{w1,w3,w2}`.
pub(crate) fn expert_names(arch: Arch, i: usize, e: usize) -> [String; 4] {
    let p = |s: &str| format!("model.layers.{i}.{s}");
    if arch == Arch::Mixtral {
        let x = |w: &str| p(&format!("block_sparse_moe.experts.{e}.{w}.weight"));
        [p("block_sparse_moe.gate.weight"), x("w1"), x("w3"), x("w2")]
    } else {
        let x = |w: &str| p(&format!("mlp.experts.{e}.{w}_proj.weight"));
        [p("mlp.gate.weight"), x("gate"), x("up"), x("down")]
    }
}

/// GraniteMoE's layer `i` router and its stacked experts' tensors: `router.layer`,
/// `input_linear` (`[experts, 2 · ffn, hidden]`: each expert's gate rows, then its up rows) and
/// `output_linear` (`[experts, hidden, ffn]`).
pub(crate) fn stacked_expert_names(i: usize) -> [String; 3] {
    let p = |s: &str| format!("model.layers.{i}.block_sparse_moe.{s}.weight");
    [p("router.layer"), p("input_linear"), p("output_linear")]
}

/// Qwen3-VL-MoE's layer `i` experts' transposed stacks: `gate_up_proj` (`[experts, hidden,
/// 2 · ffn]`: each expert's gate columns, then its up columns) and `down_proj` (`[experts, ffn,
/// hidden]`).
fn transposed_expert_names(i: usize) -> [String; 2] {
    let p = |s: &str| format!("model.layers.{i}.mlp.experts.{s}");
    [p("gate_up_proj"), p("down_proj")]
}

/// Layer `i`'s router tensor: [`expert_names`]'s, GraniteMoE's [`stacked_expert_names`]'.
pub(crate) fn router_name(arch: Arch, i: usize) -> String {
    match arch {
        Arch::GraniteMoe => stacked_expert_names(i)[0].clone(),
        _ => expert_names(arch, i, 0)[0].clone(),
    }
}

/// The gate, up and down matrices of an expert of `ffn` columns stored each in a tensor of its
/// own, named `[gate, up, down]`.
fn separate_parts([g, u, d]: [String; 3], ffn: usize, h: usize) -> [StoredRows; 3] {
    [(g, vec![ffn, h], 0), (u, vec![ffn, h], 0), (d, vec![h, ffn], 0)]
}

/// Where layer `i`'s expert `e`'s gate, up and down matrices sit: tensors of their own
/// ([`expert_names`]), or GraniteMoE's slices of the layer's stacked tensors
/// ([`stacked_expert_names`]).
fn expert_parts(cfg: &ModelConfig, moe: &crate::config::Moe, i: usize, e: usize) -> [StoredRows; 3] {
    let (h, ffn, n) = (cfg.hidden_size, moe.expert_ffn, moe.experts);
    if cfg.arch == Arch::GraniteMoe {
        let [_, input, output] = stacked_expert_names(i);
        let shape = vec![n, 2 * ffn, h];
        [
            (input.clone(), shape.clone(), e * 2 * ffn),
            (input, shape, e * 2 * ffn + ffn),
            (output, vec![n, h, ffn], e * h),
        ]
    } else {
        let [_, g, u, d] = expert_names(cfg.arch, i, e);
        separate_parts([g, u, d], ffn, h)
    }
}

/// Layer `i`'s shared expert's gate, up and down tensors and its gate's (Qwen2-MoE).
pub(crate) fn shared_expert_names(i: usize) -> [String; 4] {
    let p = |s: &str| format!("model.layers.{i}.mlp.shared_expert{s}.weight");
    [p(".gate_proj"), p(".up_proj"), p(".down_proj"), p("_gate")]
}

impl Layer {
    /// Bytes of its f32 vectors: norms and biases.
    fn vector_bytes(&self) -> usize {
        let pair = |p: &Option<(Vec<f32>, Vec<f32>)>| p.as_ref().map_or(0, |(a, b)| a.len() + b.len());
        let one = |v: &Option<Vec<f32>>| v.as_ref().map_or(0, Vec::len);
        let norm = |n: &Option<Norm>| n.as_ref().map_or(0, Norm::len);
        4 * (norm(&self.input_norm)
            + norm(&self.post_norm)
            + one(&self.qkv_bias)
            + one(&self.o_bias)
            + pair(&self.ffn_bias)
            + pair(&self.head_norms)
            + pair(&self.full_norms)
            + pair(&self.out_norms))
    }
}

/// Where some of a layer's matrix rows are stored: (tensor name, the tensor's shape, the row
/// they start at among the tensor's rows, leading dimensions flattened as
/// [`crate::weights::Source`] reads them).
type StoredRows = (String, Vec<usize>, usize);

/// Where layer `i`'s q, k, v, gate and up rows are stored: each in a tensor of its own, or,
/// in Phi-3 checkpoints, q, k and v one after the other in `qkv_proj` and gate and up in
/// `gate_up_proj` (GLM: gate and up in `gate_up_proj`; Granite 4: in
/// `shared_mlp.input_linear`).
fn stored_rows(cfg: &ModelConfig, i: usize) -> [StoredRows; 5] {
    let (h, ff, qd, kvd) = (cfg.hidden_size, cfg.intermediate_size, cfg.q_dim(), cfg.kv_dim());
    let p = |s: &str| format!("{}{s}", layer_prefix(cfg, i));
    // Rows from `row` on of the tensor `name` of `rows` rows.
    let at = |name: &str, rows: usize, row: usize| (p(name), vec![rows, h], row);
    let separate = |s: &str, rows: usize| at(&format!("self_attn.{s}_proj.weight"), rows, 0);
    match cfg.arch {
        Arch::Phi3 => {
            let (qkv, qkv_rows, gate_up) =
                ("self_attn.qkv_proj.weight", qd + 2 * kvd, "mlp.gate_up_proj.weight");
            [
                at(qkv, qkv_rows, 0),
                at(qkv, qkv_rows, qd),
                at(qkv, qkv_rows, qd + kvd),
                at(gate_up, 2 * ff, 0),
                at(gate_up, 2 * ff, ff),
            ]
        }
        Arch::GraniteMoeHybrid | Arch::Glm | Arch::Glm4 => {
            let gate_up = match cfg.arch {
                Arch::Glm | Arch::Glm4 => "mlp.gate_up_proj.weight",
                _ => "shared_mlp.input_linear.weight",
            };
            [
                separate("q", qd),
                separate("k", kvd),
                separate("v", kvd),
                at(gate_up, 2 * ff, 0),
                at(gate_up, 2 * ff, ff),
            ]
        }
        // Falcon's and GPT-NeoX's q, k and v in one tensor, grouped by KV head
        // ([`fused_qkv_rows`]); their FFN's first matrix read as the gate's rows.
        Arch::Falcon | Arch::GptNeoX => {
            let attention = if cfg.arch == Arch::Falcon { "self_attention" } else { "attention" };
            let qkv = at(&format!("{attention}.query_key_value.weight"), qd + 2 * kvd, 0);
            let first = at("mlp.dense_h_to_4h.weight", ff, 0);
            [qkv.clone(), qkv.clone(), qkv, first.clone(), first]
        }
        // GPT-2's and GPT-BigCode's `c_attn` (GPT-2's: q, k and v one after another;
        // GPT-BigCode's grouped, [`fused_qkv_rows`]), and their FFN's `c_fc` read as the gate.
        Arch::Gpt2 | Arch::GptBigCode => {
            let qkv = |row: usize| at("attn.c_attn.weight", qd + 2 * kvd, row);
            let first = at("mlp.c_fc.weight", ff, 0);
            [qkv(0), qkv(qd), qkv(qd + kvd), first.clone(), first]
        }
        // StarCoder 2's and Phi's FFN has one matrix before its activation (`c_fc`, `fc1`), no
        // gate: read as the gate's rows, the up rows unread.
        Arch::Starcoder2 | Arch::Phi => {
            let first = if cfg.arch == Arch::Phi { "mlp.fc1.weight" } else { "mlp.c_fc.weight" };
            [separate("q", qd), separate("k", kvd), separate("v", kvd), at(first, ff, 0), at(first, ff, 0)]
        }
        _ => [
            separate("q", qd),
            separate("k", kvd),
            separate("v", kvd),
            at("mlp.gate_proj.weight", ff, 0),
            at("mlp.up_proj.weight", ff, 0),
        ],
    }
}

/// Where layer `i`'s tensors are named: `model.layers.i.` (Falcon's, GPT-2's and
/// GPT-BigCode's `transformer.h.i.`, GPT-NeoX's `gpt_neox.layers.i.`).
fn layer_prefix(cfg: &ModelConfig, i: usize) -> String {
    match cfg.arch {
        Arch::Falcon | Arch::Gpt2 | Arch::GptBigCode => format!("transformer.h.{i}."),
        Arch::GptNeoX => format!("gpt_neox.layers.{i}."),
        _ => format!("model.layers.{i}."),
    }
}

/// Layer `i`'s dense FFN's down tensor (Granite 4's `shared_mlp.output_linear`, StarCoder 2's
/// and GPT-2's `mlp.c_proj`, Phi's `mlp.fc2`, Falcon's and GPT-NeoX's `mlp.dense_4h_to_h`).
fn ffn_down_name(cfg: &ModelConfig, i: usize) -> String {
    let name = match cfg.arch {
        Arch::GraniteMoeHybrid => "shared_mlp.output_linear",
        Arch::Starcoder2 | Arch::Gpt2 | Arch::GptBigCode => "mlp.c_proj",
        Arch::Phi => "mlp.fc2",
        Arch::Falcon | Arch::GptNeoX => "mlp.dense_4h_to_h",
        _ => "mlp.down_proj",
    };
    format!("{}{name}.weight", layer_prefix(cfg, i))
}

/// Layer `i`'s attention output matrix (Phi's `self_attn.dense`, Falcon's
/// `self_attention.dense`, GPT-NeoX's `attention.dense`, GPT-2's `attn.c_proj`).
fn o_proj_name(cfg: &ModelConfig, i: usize) -> String {
    let name = match cfg.arch {
        Arch::Phi => "self_attn.dense",
        Arch::Falcon => "self_attention.dense",
        Arch::GptNeoX => "attention.dense",
        Arch::Gpt2 | Arch::GptBigCode => "attn.c_proj",
        _ => "self_attn.o_proj",
    };
    format!("{}{name}.weight", layer_prefix(cfg, i))
}

/// The final norm (Phi's `model.final_layernorm`, Falcon's and GPT-2's `transformer.ln_f`,
/// GPT-NeoX's `gpt_neox.final_layer_norm`).
fn final_norm_name(cfg: &ModelConfig) -> &'static str {
    match cfg.arch {
        Arch::Phi => "model.final_layernorm.weight",
        Arch::Falcon | Arch::Gpt2 | Arch::GptBigCode => "transformer.ln_f.weight",
        Arch::GptNeoX => "gpt_neox.final_layer_norm.weight",
        _ => "model.norm.weight",
    }
}

/// The token embedding (Falcon's `transformer.word_embeddings`, GPT-NeoX's
/// `gpt_neox.embed_in`, GPT-2's `transformer.wte`).
pub(crate) fn embed_name(cfg: &ModelConfig) -> &'static str {
    match cfg.arch {
        Arch::Falcon => "transformer.word_embeddings.weight",
        Arch::Gpt2 | Arch::GptBigCode => "transformer.wte.weight",
        Arch::GptNeoX => "gpt_neox.embed_in.weight",
        _ => "model.embed_tokens.weight",
    }
}

/// The learned position embedding ([`ModelConfig::learned_positions`]: GPT-2's).
pub(crate) const POSITIONS_NAME: &str = "transformer.wpe.weight";

/// Whether tensor `name` is one of GPT-2's `Conv1D` matrices, stored `[in, out]`.
pub(crate) fn conv1d(name: &str) -> bool {
    ["attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight"]
        .iter()
        .any(|s| name.ends_with(s))
}

/// `src` as the family stores its matrices: GPT-2's `Conv1D`s read by their `[out, in]`
/// shape; every other family's passed through.
fn as_stored<'a>(cfg: &ModelConfig, src: &'a dyn Source) -> Transposed<'a> {
    let turned = if cfg.arch == Arch::Gpt2 { conv1d } else { |_: &str| false };
    Transposed { inner: src, turned }
}

/// The output head: `lm_head`, or GPT-NeoX's `embed_out` where a folder written before
/// transformers 5 names it so.
fn head_name(cfg: &ModelConfig, src: &dyn Source) -> &'static str {
    let shape = [cfg.vocab_size, cfg.hidden_size];
    let legacy = "embed_out.weight";
    if cfg.arch == Arch::GptNeoX
        && src.dtype("lm_head.weight", &shape).is_err()
        && src.dtype(legacy, &shape).is_ok()
    {
        legacy
    } else {
        "lm_head.weight"
    }
}

/// Whether q, k and v are stored in one tensor by KV group ([`fused_qkv_rows`]).
fn fused_by_group(cfg: &ModelConfig) -> bool {
    matches!(cfg.arch, Arch::Falcon | Arch::GptNeoX | Arch::GptBigCode)
}

/// The rows of Falcon's and GPT-NeoX's fused `query_key_value` tensor, GPT-BigCode's
/// `c_attn` (or elements of its bias) that hold heads `heads` of q (`part` 0), k (1) or v (2),
/// head by head. Per KV head the tensor holds its group's query heads, then its key, then its
/// value: Falcon-7B's and GPT-BigCode's one group of all queries (`multi_query`), Falcon-40B's
/// groups (`new_decoder_architecture`), or a group per head (GPT-NeoX's, GPT-BigCode's
/// without `multi_query`).
fn fused_qkv_rows(cfg: &ModelConfig, part: usize, heads: Range<usize>) -> impl Iterator<Item = Range<usize>> {
    let (hd, group) = (cfg.head_dim, cfg.n_heads / cfg.n_kv_heads);
    heads.map(move |j| {
        let slot = match part {
            0 => j / group * (group + 2) + j % group,
            _ => j * (group + 2) + group + part - 1,
        };
        slot * hd..(slot + 1) * hd
    })
}

/// `b` added to each `b.len()`-long row of `x` (a projection's bias).
fn add_bias(x: &mut [f32], b: &[f32]) {
    for row in x.chunks_exact_mut(b.len()) {
        row.iter_mut().zip(b).for_each(|(v, b)| *v += b);
    }
}

/// The bias beside the weight tensor `name` (`….weight` → `….bias`).
fn bias_name(name: &str) -> String {
    format!("{}.bias", name.strip_suffix(".weight").unwrap_or(name))
}

/// Rows of a dense FFN's first product a token takes: gate and up, or (without a gate) one
/// set.
fn ffn_rows(cfg: &ModelConfig, cols: usize) -> usize {
    if cfg.gated_ffn {
        2 * cols
    } else {
        cols
    }
}

/// A layer's norms after `model.layers.N.`, where it has them: the attention's input norm, the
/// FFN's input norm, the attention's output norm, the FFN's output norm.
fn layer_norm_names(cfg: &ModelConfig) -> [Option<&'static str>; 4] {
    let input = Some("input_layernorm.weight");
    let (post_attention, post_ffn) =
        (Some("post_attention_layernorm.weight"), Some("post_feedforward_layernorm.weight"));
    match cfg.norm_place {
        NormPlace::Pre if matches!(cfg.arch, Arch::Gpt2 | Arch::GptBigCode) => {
            [Some("ln_1.weight"), Some("ln_2.weight"), None, None]
        }
        // Two norms of the layer's input: GPT-NeoX's, by Llama's names; Falcon-40B's.
        NormPlace::Pre if cfg.parallel_ffn_norm && cfg.arch == Arch::GptNeoX => {
            [input, post_attention, None, None]
        }
        NormPlace::Pre if cfg.parallel_ffn_norm => {
            [Some("ln_attn.weight"), Some("ln_mlp.weight"), None, None]
        }
        // Phi's one norm, read by the attention and the FFN alike.
        NormPlace::Pre if cfg.parallel_residual => [input, None, None, None],
        NormPlace::Pre => [input, post_attention, None, None],
        NormPlace::Sandwich if cfg.arch == Arch::Glm4 => [
            input,
            post_attention,
            Some("post_self_attn_layernorm.weight"),
            Some("post_mlp_layernorm.weight"),
        ],
        NormPlace::Sandwich => [input, Some("pre_feedforward_layernorm.weight"), post_attention, post_ffn],
        NormPlace::Post => [None, None, post_attention, post_ffn],
    }
}

/// Each token's sums of squares of its q and of its k values on this rank (of the KV heads
/// `counted` here), side by side into `sums`, from its QKV rows (`nq` q heads, `nkv` k and `nkv`
/// v heads of `hd`).
fn full_norm_factors(
    qkv: &[f32],
    sums: &mut [f32],
    (nq, nkv, hd): (usize, usize, usize),
    counted: impl Fn(usize) -> bool,
) {
    let rows = (nq + 2 * nkv) * hd;
    let squares = |v: &[f32]| v.iter().map(|x| x * x).sum::<f32>();
    for (row, s) in qkv.chunks_exact(rows).zip(sums.chunks_exact_mut(2)) {
        s[0] = squares(&row[..nq * hd]);
        s[1] =
            (0..nkv).filter(|&k| counted(k)).map(|k| squares(&row[(nq + k) * hd..(nq + k + 1) * hd])).sum();
    }
}

/// `x` normed by `norm` into `out`, or copied where there is no norm.
fn norm_into(x: &[f32], norm: &Option<Norm>, eps: f32, out: &mut [f32]) {
    match norm {
        Some(n) => n.apply(x, eps, out),
        None => out.copy_from_slice(x),
    }
}

/// Positions of one span attended together (one tile of queries).
const QUERY_BLOCK: usize = 16;

/// Most parts one row's keys are split into when a step has too few (KV head, block) items
/// to keep every kernel thread busy.
const MAX_PARTS: usize = 8;

/// The pages the queries of block `(t0, nt)` of `tokens` see: (first page, count).
fn key_pages(tokens: &[(usize, usize)], window: Option<usize>, (t0, nt): (usize, usize)) -> (usize, usize) {
    let (pos0, last) = (tokens[t0].1, tokens[t0 + nt - 1].1);
    let lo = window.map_or(0, |w| (pos0 + 1).saturating_sub(w)) / PAGE;
    (lo, last / PAGE + 1 - lo)
}

/// The first and last position of `keys` within the first [`kernels::FAR_PAGES`] pages'
/// worth of them (`(1, 0)`, first after last, if `keys` is empty): what is asked for ahead of
/// an attention item.
fn first_pages(keys: &std::ops::Range<usize>) -> (usize, usize) {
    if keys.is_empty() {
        return (1, 0);
    }
    (keys.start, keys.end.min(keys.start + kernels::FAR_PAGES * PAGE) - 1)
}

/// The attention tiles (fixed by position, [`kernels::tile_pages`]) that hold the `np` pages
/// from page `lo` ([`key_pages`]).
fn key_tiles((lo, np): (usize, usize)) -> std::ops::Range<usize> {
    kernels::tile_of(lo)..kernels::tile_of(lo + np - 1) + 1
}

/// Tile states a split row of a sequence whose page table holds `pages` pages may store: one
/// per attention tile those pages reach.
fn tile_room(pages: usize) -> usize {
    kernels::tile_of(pages.max(1) - 1) + 1
}

/// One attention item of a step: a local KV head, a block of a span's positions and a part of
/// the keys its rows see.
struct AttItem {
    /// Index into the step's blocks, with the block's first token and count.
    block: usize,
    t0: usize,
    nt: usize,
    kvl: usize,
    part: usize,
    parts: usize,
    /// The block's tiles, and the part's share of them (whole tiles).
    tiles: std::ops::Range<usize>,
    mine: std::ops::Range<usize>,
    /// Positions whose keys the item reads: those of its tiles that the block's rows see
    /// (empty for a part with none).
    keys: std::ops::Range<usize>,
}

/// Steps of at most this many tokens (decode) ask for the KV lines they will write before the
/// QKV product, so those lines arrive while it streams its weights.
const PREFETCH_TOKENS: usize = 8;

/// Steps of at most this many tokens compute the FFN activation on every kernel thread, each
/// into its own copy, rather than split over the threads with a barrier after it.
const REPLICATE_TOKENS: usize = 8;

/// The KV pool inside a step's team region: read by every thread, written either by thread 0
/// alone between barriers (`get_mut`), or one KV head's new position at a time by the
/// attention item that alone reads that head's last page (`KvPool::write_head`).
struct KvAccess(*mut KvPool);
// SAFETY: see `get` and `get_mut`.
unsafe impl Sync for KvAccess {}

impl KvAccess {
    /// # Safety
    /// No thread may be writing the pool.
    unsafe fn get(&self) -> &KvPool {
        &*self.0
    }
    /// # Safety
    /// No other thread may be using the pool.
    #[allow(clippy::mut_from_ref)]
    unsafe fn get_mut(&self) -> &mut KvPool {
        &mut *self.0
    }
}

/// The stage's communicator inside a team region, used on thread 0 (the one that owns it) only.
struct MainThread<'a>(&'a dyn Comm);
// SAFETY: only thread 0 of the region, the thread the communicator belongs to, calls it.
unsafe impl Sync for MainThread<'_> {}

/// Sums a sublayer's output `o[..x.len()]` over the stage's tensor-parallel ranks and adds it
/// to this thread's copy of the residual stream `x`, each token's row normed first by `norm`
/// (weights, epsilon) if given (Gemma 2, 3), or else with `bias` added (StarCoder 2's o_proj and
/// down biases: once, to the sum; no family has both), then times `scale` (Granite's residual
/// multiplier; 1 changes no bit): thread 0 calls MPI while the other threads wait at a barrier
/// (none when the stage has one rank). `o` is complete on entry (the product that wrote it ended
/// with a barrier), and nothing writes it again before every thread has passed another barrier.
fn add_reduced(
    r: &Region,
    comm: &MainThread,
    o: &SharedSlice,
    x: &mut [f32],
    norm: Option<(&[f32], f32)>,
    scale: f32,
    bias: Option<&[f32]>,
) {
    let len = x.len();
    if comm.0.size() > 1 {
        if r.tid() == 0 {
            // SAFETY: the other threads wait at the barrier below.
            comm.0.allreduce_sum(unsafe { o.range(0, len) });
        }
        r.barrier();
    }
    // SAFETY: as above, `o` is only read until the next barrier.
    let o = unsafe { &*o.range(0, len) };
    match (norm, bias) {
        (Some((w, eps)), _) => kernels::add_rmsnormed(x, o, w, eps, scale),
        (None, Some(bias)) => {
            for (xr, or) in x.chunks_exact_mut(bias.len()).zip(o.chunks_exact(bias.len())) {
                xr.iter_mut().zip(or).zip(bias).for_each(|((a, v), b)| *a += (v + b) * scale);
            }
        }
        (None, None) => x.iter_mut().zip(o).for_each(|(a, b)| *a += b * scale),
    }
}

/// Floats of each kernel thread's own buffers in a step of `n` tokens: its copy of the
/// attention rows (a short step's, where blocks are `split`), of the activations (a short
/// step's), and in all, with its copies of the residual stream and of its norm, a multiple of
/// 16 (each thread's on cache lines of its own).
fn own_lens(m: &Shard, n: usize, split: bool) -> [usize; 3] {
    let (nq, hd, ffl) = (m.plan.q_heads.len(), m.cfg.head_dim, m.plan.ffn.len());
    let replicate = n <= REPLICATE_TOKENS;
    let att = if replicate && split { n * nq * hd } else { 0 };
    let act = if replicate { n * ffl } else { 0 };
    [att, act, (2 * n * m.cfg.hidden_size + att + act).next_multiple_of(16)]
}

/// An attention item's query rows, its output rows and each row's key bounds.
type TileRows = (Vec<f32>, Vec<f32>, Vec<(usize, usize)>);

/// One step's routing of its tokens to experts, worked out by every kernel thread for itself
/// (the same on each, so none waits for another's).
#[derive(Default)]
struct Routing {
    /// Each token's chosen experts and their weights, in expert order.
    choice: Vec<(usize, f32)>,
    /// The rows of each expert's tokens in the step's expert-ordered rows: `starts[x]..
    /// starts[x + 1]` (one entry more than experts).
    starts: Vec<usize>,
    /// The token of each expert-ordered row, and the row of each (token, choice).
    token: Vec<usize>,
    row: Vec<usize>,
    /// Softmax shares of one token, and the next free row of each expert.
    probs: Vec<f32>,
    fill: Vec<usize>,
}

impl Routing {
    /// Routes `n` tokens by their router `logits` (`[n, experts]`): softmax over all
    /// experts, the `per_token` largest shares chosen (the lower index first among equal
    /// ones), renormalized to sum to one if `norm`. Allocates only when `n` or the experts
    /// grow past what it held before.
    fn route(&mut self, logits: &[f32], n: usize, experts: usize, per_token: usize, norm: bool) {
        let k = per_token;
        self.choice.clear();
        self.probs.resize(experts, 0.0);
        for lg in logits.chunks_exact(experts).take(n) {
            let max = lg.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
            self.probs.iter_mut().zip(lg).for_each(|(p, &v)| *p = (v - max).exp());
            let sum: f32 = self.probs.iter().sum();
            let first = self.choice.len();
            for _ in 0..k {
                let (mut best, mut at) = (f32::NEG_INFINITY, 0);
                for (x, &p) in self.probs.iter().enumerate() {
                    if p > best {
                        (best, at) = (p, x);
                    }
                }
                self.choice.push((at, best / sum));
                self.probs[at] = f32::NEG_INFINITY;
            }
            let chosen = &mut self.choice[first..];
            if norm {
                let total: f32 = chosen.iter().map(|c| c.1).sum();
                chosen.iter_mut().for_each(|c| c.1 /= total);
            }
            chosen.sort_unstable_by_key(|c| c.0);
        }
        self.starts.clear();
        self.starts.resize(experts + 1, 0);
        for &(x, _) in &self.choice {
            self.starts[x + 1] += 1;
        }
        for x in 0..experts {
            self.starts[x + 1] += self.starts[x];
        }
        self.fill.clear();
        self.fill.extend_from_slice(&self.starts[..experts]);
        self.token.clear();
        self.token.resize(n * k, 0);
        self.row.clear();
        for (i, &(x, _)) in self.choice.iter().enumerate() {
            let row = self.fill[x];
            self.fill[x] += 1;
            self.token[row] = i / k;
            self.row.push(row);
        }
    }
}

/// The shared buffers of a step's mixture-of-experts FFNs: router logits `[n, experts]`, and
/// in expert-ordered rows (`n · per_token` of them) the tokens' inputs, gate and up products,
/// activations and outputs.
struct ExpertBufs {
    logits: SharedSlice,
    x: SharedSlice,
    gu: SharedSlice,
    act: SharedSlice,
    out: SharedSlice,
    /// The shared expert's gate and up products, activations and outputs, by token.
    shared_gu: SharedSlice,
    shared_act: SharedSlice,
    shared_out: SharedSlice,
}

/// A mixture-of-experts FFN of `n` tokens, `xn` their normed inputs (this thread's copy):
/// this rank's share of its output (its columns of each expert; every rank's sum to the
/// whole) into `o`. Every thread of the region calls it at once with the same inputs. Each
/// expert multiplies the rows of the tokens that chose it at once; a token's output sums its
/// experts' weighted rows in expert order. Thread 0 adds the experts it ran to `tally`.
#[allow(clippy::too_many_arguments)]
fn experts(
    r: &Region,
    cfg: &ModelConfig,
    x: &Experts,
    xn: &[f32],
    n: usize,
    b: &ExpertBufs,
    o: &SharedSlice,
    tally: Option<&AtomicU64>,
) {
    let Some(moe) = &cfg.moe else { return };
    let (e, k, h) = (moe.experts, moe.per_token, cfg.hidden_size);
    let Experts { router, gate_up, down, shared } = x;
    let fl = down[0].cols;
    // SAFETY (every `range` below): each buffer is written in disjoint ranges (by expert
    // rows, by the team's ranges or by token) and read only after the barrier (or the end of
    // the product) that ends its writing.
    kernels::matmul(r, router, xn, n, unsafe { b.logits.range(0, n * e) });
    let logits = unsafe { &*b.logits.range(0, n * e) };
    ROUTING.with_borrow_mut(|rt| {
        rt.route(logits, n, e, k, moe.norm_topk);
        if let Some(count) = tally.filter(|_| r.tid() == 0) {
            count.fetch_add(
                (0..e).filter(|&x| rt.starts[x + 1] > rt.starts[x]).count() as u64,
                Ordering::Relaxed,
            );
        }
        for row in r.share(n * k) {
            let t = rt.token[row];
            unsafe { b.x.range(row * h, h) }.copy_from_slice(&xn[t * h..(t + 1) * h]);
        }
        r.barrier();
        let rows = |x: usize| rt.starts[x]..rt.starts[x + 1];
        for x in (0..e).filter(|&x| !rows(x).is_empty()) {
            let (at, m) = (rows(x).start, rows(x).len());
            let input = unsafe { &*b.x.range(at * h, m * h) };
            kernels::matmul(r, &gate_up[x], input, m, unsafe { b.gu.range(at * 2 * fl, m * 2 * fl) });
        }
        for row in r.share(n * k) {
            let a = unsafe { b.act.range(row * fl, fl) };
            let (g, u) = unsafe { &*b.gu.range(row * 2 * fl, 2 * fl) }.split_at(fl);
            a.copy_from_slice(g);
            kernels::act_mul(a, u, cfg.activation);
        }
        r.barrier();
        for x in (0..e).filter(|&x| !rows(x).is_empty()) {
            let (at, m) = (rows(x).start, rows(x).len());
            let input = unsafe { &*b.act.range(at * fl, m * fl) };
            kernels::matmul(r, &down[x], input, m, unsafe { b.out.range(at * h, m * h) });
        }
        // The shared expert: every token through it, as through a dense FFN.
        if let Some((gu, dn, _)) = shared {
            let sl = dn.cols;
            kernels::matmul(r, gu, xn, n, unsafe { b.shared_gu.range(0, n * 2 * sl) });
            for t in r.share(n) {
                let a = unsafe { b.shared_act.range(t * sl, sl) };
                let (g, u) = unsafe { &*b.shared_gu.range(t * 2 * sl, 2 * sl) }.split_at(sl);
                a.copy_from_slice(g);
                kernels::act_mul(a, u, cfg.activation);
            }
            r.barrier();
            let input = unsafe { &*b.shared_act.range(0, n * sl) };
            kernels::matmul(r, dn, input, n, unsafe { b.shared_out.range(0, n * h) });
        }
        for t in r.share(n) {
            let out = unsafe { o.range(t * h, h) };
            out.fill(0.0);
            for (&(_, w), &row) in rt.choice[t * k..(t + 1) * k].iter().zip(&rt.row[t * k..(t + 1) * k]) {
                let y = unsafe { &*b.out.range(row * h, h) };
                out.iter_mut().zip(y).for_each(|(o, y)| *o += w * y);
            }
            if let Some((_, _, gate)) = shared {
                // Weighted by sigmoid(x · gate), from the whole input on every rank.
                let x = &xn[t * h..(t + 1) * h];
                let w = 1.0 / (1.0 + (-x.iter().zip(gate).map(|(a, b)| a * b).sum::<f32>()).exp());
                let y = unsafe { &*b.shared_out.range(t * h, h) };
                out.iter_mut().zip(y).for_each(|(o, y)| *o += w * y);
            }
        }
        r.barrier();
    });
}

thread_local! {
    static ROUTING: std::cell::RefCell<Routing> = std::cell::RefCell::new(Routing::default());
}

thread_local! {
    static QROWS: std::cell::RefCell<TileRows> =
        const { std::cell::RefCell::new((Vec::new(), Vec::new(), Vec::new())) };
}

/// Sizes the calling thread's buffers for attention items of up to `rows` query rows of `hd`
/// and for many-token products (widened weight panels, running sums).
fn reserve_thread_buffers(rows: usize, hd: usize) {
    QROWS.with_borrow_mut(|(q, o, bounds)| {
        crate::grow(q, rows * hd);
        crate::grow(o, rows * hd);
        crate::grow(bounds, rows);
    });
    kernels::reserve_attention(rows, PAGE, hd);
    kernels::packed::reserve_thread_buffers();
}

/// A run of consecutive tokens of one sequence in a step: positions `pos0..pos0 + len` of
/// sequence `seq` (the index of its page table). `emit`: the step yields a next token after
/// the span's last position (false for a prompt chunk that is not the prompt's last).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Span {
    pub seq: usize,
    pub pos0: usize,
    pub len: usize,
    pub emit: bool,
}

pub struct Shard {
    pub cfg: ModelConfig,
    pub plan: ShardPlan,
    layers: Vec<Layer>,
    /// The distinct windows of its layers' attention, in layer order (one layout of a step's
    /// attention items each).
    windows: Vec<Option<usize>>,
    /// Vocabulary rows of the embedding (first stage).
    embed: Option<Arc<PackedMat>>,
    /// Factor of the embedding's rows (Gemma: `sqrt(hidden_size)`; else 1).
    embed_scale: f32,
    /// Rows `plan.positions` of the learned position embedding (first stage, GPT-2's).
    positions: Option<PackedMat>,
    final_norm: Option<Norm>,
    /// Vocabulary rows of the output head (last stage); shares `embed` when tied on one stage.
    lm_head: Option<Arc<PackedMat>>,
    /// The output head's bias, of this rank's vocabulary rows (Phi's).
    head_bias: Option<Vec<f32>>,
    inv_freq: Vec<f64>,
    /// The local layers' RoPE frequencies (Gemma 3's).
    inv_freq_local: Option<Vec<f64>>,
    /// LongRoPE's frequencies past the original context, and that context.
    inv_freq_long: Option<(Vec<f64>, usize)>,
    /// Decode steps run and experts multiplied by in them, by the step's tokens.
    tally: ExpertTally,
}

/// Most tokens of a decode step whose experts [`ExpertTally`] counts.
const TALLY_TOKENS: usize = 64;

/// For decode steps of each token count up to [`TALLY_TOKENS`]: how many ran, and how many
/// experts' products they ran in all (each expert a token chose, once a layer however many of
/// the step's tokens chose it). Counted on the main thread; read by `bench`.
struct ExpertTally([(AtomicU64, AtomicU64); TALLY_TOKENS + 1]);

impl Default for ExpertTally {
    fn default() -> Self {
        ExpertTally(std::array::from_fn(|_| (AtomicU64::new(0), AtomicU64::new(0))))
    }
}

impl Shard {
    /// Loads only this rank's shard from the checkpoint in `dir`.
    /// `quant`: quantize the matrices at load (`None` keeps the stored dtype).
    pub fn load(dir: &Path, cfg: ModelConfig, plan: ShardPlan, quant: Option<Quant>) -> Result<Self> {
        let ckpt = Checkpoint::open(dir)?;
        Self::from_source(&ckpt, cfg, plan, quant)
    }

    /// Loads this rank's shard from any weight source (checkpoint or synthetic).
    pub fn from_source(
        ckpt: &dyn Source,
        cfg: ModelConfig,
        plan: ShardPlan,
        quant: Option<Quant>,
    ) -> Result<Self> {
        let ckpt: &dyn Source = &as_stored(&cfg, ckpt);
        // The shard's weights in chunks of their own, which it returns whole when dropped.
        kernels::arena::close_chunk();
        let pack = |m: &Mat| PackedMat::pack_as(m, quant);
        let (h, hd, ff) = (cfg.hidden_size, cfg.head_dim, cfg.intermediate_size);
        let (qd, kvd) = (cfg.q_dim(), cfg.kv_dim());
        let qr = plan.q_heads.start * hd..plan.q_heads.end * hd;
        let kr = plan.kv_heads.start * hd..plan.kv_heads.end * hd;
        // A norm's weights as it multiplies by them (Gemma stores them less one).
        let norm = |name: &str, len: usize| -> Result<Vec<f32>> {
            let mut w = ckpt.vector_f32(name, len)?;
            if cfg.norm_plus_one {
                w.iter_mut().for_each(|w| *w += 1.0);
            }
            Ok(w)
        };
        // A norm of the residual stream, a LayerNorm with its biases where the model has them
        // (OLMo's without weights: weights of one, biases of zero).
        let stream_norm = |name: &str| -> Result<Norm> {
            if cfg.weightless_norms {
                return Ok(Norm { w: vec![1.0; h], b: Some(vec![0.0; h]) });
            }
            let b = if cfg.layer_norm { Some(ckpt.vector_f32(&bias_name(name), h)?) } else { None };
            Ok(Norm { w: norm(name, h)?, b })
        };
        let mut layers = Vec::with_capacity(plan.layers.len());
        let mut windows: Vec<Option<usize>> = Vec::new();
        for i in plan.layers.clone() {
            let p = |s: &str| format!("{}{s}", layer_prefix(&cfg, i));
            let [q, k, v, gate, up] = stored_rows(&cfg, i);
            let stored = [q.clone(), k.clone(), v.clone()];
            let part = |(name, shape, at): &StoredRows, rows: &std::ops::Range<usize>| {
                ckpt.rows(name, shape, at + rows.start..at + rows.end)
            };
            let (q, k, v) = if fused_by_group(&cfg) {
                // Head by head from the fused tensor.
                let (name, shape, _) = &q;
                let heads = |part: usize, heads: &Range<usize>| -> Result<Mat> {
                    let rows = fused_qkv_rows(&cfg, part, heads.clone());
                    Ok(Mat::vstack(rows.map(|r| ckpt.rows(name, shape, r)).collect::<Result<_>>()?))
                };
                (heads(0, &plan.q_heads)?, heads(1, &plan.kv_heads)?, heads(2, &plan.kv_heads)?)
            } else {
                (part(&q, &qr)?, part(&k, &kr)?, part(&v, &kr)?)
            };
            let qkv_bias = if cfg.qkv_bias && fused_by_group(&cfg) {
                // Head by head from the fused tensor's bias, as its rows.
                let (name, rows) = (bias_name(&stored[0].0), qd + 2 * kvd);
                let mut b = Vec::with_capacity(qr.len() + 2 * kr.len());
                for (part, heads) in [(0, &plan.q_heads), (1, &plan.kv_heads), (2, &plan.kv_heads)] {
                    for r in fused_qkv_rows(&cfg, part, heads.clone()) {
                        b.extend(ckpt.vector_range_f32(&name, rows, r)?);
                    }
                }
                Some(b)
            } else if cfg.qkv_bias && stored[0].0 == stored[1].0 {
                // From the bias of the tensor holding q, k and v one after another (GPT-2's).
                let (name, len) = (bias_name(&stored[0].0), stored[0].1[0]);
                let mut b = Vec::with_capacity(qr.len() + 2 * kr.len());
                for ((_, _, at), r) in stored.iter().zip([&qr, &kr, &kr]) {
                    b.extend(ckpt.vector_range_f32(&name, len, at + r.start..at + r.end)?);
                }
                Some(b)
            } else if cfg.qkv_bias {
                let mut b = ckpt.vector_range_f32(&p("self_attn.q_proj.bias"), qd, qr.clone())?;
                b.extend(ckpt.vector_range_f32(&p("self_attn.k_proj.bias"), kvd, kr.clone())?);
                b.extend(ckpt.vector_range_f32(&p("self_attn.v_proj.bias"), kvd, kr.clone())?);
                Some(b)
            } else {
                None
            };
            let head_norms = if cfg.qk_norm {
                Some((norm(&p("self_attn.q_norm.weight"), hd)?, norm(&p("self_attn.k_norm.weight"), hd)?))
            } else {
                None
            };
            let ffn = match cfg.moe.as_ref().filter(|m| m.sparse[i]) {
                Some(moe) => {
                    let (e, cols) = (moe.experts, plan.expert_ffn.clone());
                    let router =
                        PackedMat::pack_as(&ckpt.rows(&router_name(cfg.arch, i), &[e, h], 0..e)?, None);
                    let (mut gate_up, mut down) = (Vec::with_capacity(e), Vec::with_capacity(e));
                    // An expert's (or the shared expert's) gate/up rows of `cols` and down
                    // columns.
                    let expert = |[g, u, d]: &[StoredRows; 3], cols: &std::ops::Range<usize>| {
                        let (name, shape, at) = d;
                        Ok::<_, crate::Error>((
                            pack(&Mat::vstack(vec![part(g, cols)?, part(u, cols)?])),
                            pack(&ckpt.block(name, shape, *at..at + h, cols.clone())?),
                        ))
                    };
                    for x in 0..e {
                        let (gu, dn) = if cfg.arch == Arch::Qwen3VlMoe {
                            // Rows of the transposed stacks, turned into the expert's matrices.
                            let ([gu, dn], ffn) = (transposed_expert_names(i), moe.expert_ffn);
                            let stack = [e, h, 2 * ffn];
                            let part = |c: usize| {
                                ckpt.block(&gu, &stack, x * h..(x + 1) * h, c + cols.start..c + cols.end)
                            };
                            let rows = x * ffn + cols.start..x * ffn + cols.end;
                            (
                                pack(&Mat::vstack(vec![part(0)?.transpose(), part(ffn)?.transpose()])),
                                pack(&ckpt.rows(&dn, &[e, ffn, h], rows)?.transpose()),
                            )
                        } else {
                            expert(&expert_parts(&cfg, moe, i, x), &cols)?
                        };
                        gate_up.push(gu);
                        down.push(dn);
                    }
                    let shared = if moe.shared_ffn > 0 {
                        let [g, u, d, gate] = shared_expert_names(i);
                        let parts = separate_parts([g, u, d], moe.shared_ffn, h);
                        let (gu, dn) = expert(&parts, &plan.shared_ffn)?;
                        Some((gu, dn, ckpt.rows(&gate, &[1, h], 0..1)?.data.to_f32_vec()))
                    } else {
                        None
                    };
                    Ffn::Experts(Experts { router, gate_up, down, shared })
                }
                None => Ffn::Dense {
                    gate_up: pack(&if cfg.gated_ffn {
                        Mat::vstack(vec![part(&gate, &plan.ffn)?, part(&up, &plan.ffn)?])
                    } else {
                        part(&gate, &plan.ffn)?
                    }),
                    down: pack(&ckpt.cols(&ffn_down_name(&cfg, i), &[h, ff], plan.ffn.clone())?),
                },
            };
            let (o_bias, ffn_bias) = if cfg.linear_bias {
                let first = ckpt.vector_range_f32(&bias_name(&gate.0), ff, plan.ffn.clone())?;
                let down = ckpt.vector_f32(&bias_name(&ffn_down_name(&cfg, i)), h)?;
                (Some(ckpt.vector_f32(&bias_name(&o_proj_name(&cfg, i)), h)?), Some((first, down)))
            } else {
                (None, None)
            };
            let full_norms = if cfg.qk_norm_full {
                let q = ckpt.vector_range_f32(&p("self_attn.q_norm.weight"), qd, qr.clone())?;
                Some((q, ckpt.vector_range_f32(&p("self_attn.k_norm.weight"), kvd, kr.clone())?))
            } else {
                None
            };
            let [input_norm, post_norm, attn_out, ffn_out] = layer_norm_names(&cfg).map(|name| name.map(&p));
            let [input_norm, post_norm] =
                [input_norm, post_norm].map(|n| n.map(|n| stream_norm(&n)).transpose());
            let [attn_out, ffn_out] = [attn_out, ffn_out].map(|n| n.map(|n| norm(&n, h)).transpose());
            let out_norms = match (attn_out?, ffn_out?) {
                (Some(a), Some(f)) => Some((a, f)),
                _ => None,
            };
            layers.push(Layer {
                input_norm: input_norm?,
                post_norm: post_norm?,
                out_norms,
                layout: windows.iter().position(|w| *w == cfg.layer_window(i)).unwrap_or_else(|| {
                    windows.push(cfg.layer_window(i));
                    windows.len() - 1
                }),
                rope: cfg.layer_rope(i),
                qkv: pack(&Mat::vstack(vec![q, k, v])),
                qkv_bias,
                head_norms,
                full_norms,
                o_proj: pack(&ckpt.cols(&o_proj_name(&cfg, i), &[h, qd], qr.clone())?),
                o_bias,
                ffn,
                ffn_bias,
            });
        }
        let vocab_shape = [cfg.vocab_size, h];
        let embed = if plan.first_stage {
            Some(Arc::new(pack(&ckpt.rows(embed_name(&cfg), &vocab_shape, plan.vocab.clone())?)))
        } else {
            None
        };
        let positions = if plan.first_stage && cfg.learned_positions {
            let shape = [cfg.max_position_embeddings, h];
            Some(PackedMat::pack_as(&ckpt.rows(POSITIONS_NAME, &shape, plan.positions.clone())?, None))
        } else {
            None
        };
        let (final_norm, lm_head) = if plan.last_stage {
            let head = if cfg.tie_word_embeddings {
                match &embed {
                    Some(e) => e.clone(),
                    None => {
                        let m = ckpt.rows(embed_name(&cfg), &vocab_shape, plan.vocab.clone())?;
                        Arc::new(pack(&m))
                    }
                }
            } else {
                Arc::new(pack(&ckpt.rows(head_name(&cfg, ckpt), &vocab_shape, plan.vocab.clone())?))
            };
            (Some(stream_norm(final_norm_name(&cfg))?), Some(head))
        } else {
            (None, None)
        };
        let head_bias = if plan.last_stage && cfg.head_bias {
            Some(ckpt.vector_range_f32("lm_head.bias", cfg.vocab_size, plan.vocab.clone())?)
        } else {
            None
        };
        let embed_scale = if cfg.scale_embedding {
            // As HF does: the factor in the embedding's stored dtype.
            let s = (h as f32).sqrt();
            match ckpt.dtype(embed_name(&cfg), &vocab_shape)? {
                DType::F32 => s,
                DType::BF16 => half::bf16::from_f32(s).to_f32(),
                DType::F16 => half::f16::from_f32(s).to_f32(),
            }
        } else {
            cfg.embedding_multiplier
        };
        let (inv_freq, inv_freq_local) = (cfg.rope_inv_freq(), cfg.rope_local_inv_freq());
        let inv_freq_long = cfg.rope_inv_freq_long();
        kernels::arena::close_chunk();
        Ok(Shard {
            cfg,
            plan,
            layers,
            windows,
            embed,
            embed_scale,
            positions,
            final_norm,
            lm_head,
            head_bias,
            inv_freq,
            inv_freq_local,
            inv_freq_long,
            tally: ExpertTally::default(),
        })
    }

    /// The bytes [`Shard::weight_bytes`] will report once `plan` of `cfg` is loaded from `src`
    /// with `quant`, known before a weight is read: from the stored dtypes and the shapes alone
    /// (which are checked here, as loading would).
    pub fn planned_bytes(
        src: &dyn Source,
        cfg: &ModelConfig,
        plan: &ShardPlan,
        quant: Option<Quant>,
    ) -> Result<usize> {
        let src: &dyn Source = &as_stored(cfg, src);
        let (h, hd, ff) = (cfg.hidden_size, cfg.head_dim, cfg.intermediate_size);
        let qd = cfg.q_dim();
        let (q_rows, kv_rows) = (plan.q_heads.len() * hd, plan.kv_heads.len() * hd);
        let packed = |rows, cols, dtype| PackedMat::bytes_for(rows, cols, dtype, quant);
        // Mat::vstack keeps a shared dtype and falls back to f32 for mixed ones.
        let stacked = |a: DType, b: DType| if a == b { a } else { DType::F32 };
        // A norm of the residual stream: its weights, and its biases if it is a LayerNorm
        // (OLMo's made, not read).
        let stream_norm_bytes = |name: &str| -> Result<usize> {
            if !cfg.weightless_norms {
                src.dtype(name, &[h])?;
                if cfg.layer_norm {
                    src.dtype(&bias_name(name), &[h])?;
                }
            }
            Ok(4 * h * if cfg.layer_norm { 2 } else { 1 })
        };
        let mut n = 0;
        for i in plan.layers.clone() {
            let p = |s: &str| format!("{}{s}", layer_prefix(cfg, i));
            let [q, k, v, gate, up] = stored_rows(cfg, i);
            let dtype = |(name, shape, _): &StoredRows| src.dtype(name, shape);
            let [q, k, v] = [dtype(&q)?, dtype(&k)?, dtype(&v)?];
            n += packed(q_rows + 2 * kv_rows, h, stacked(stacked(q, k), v));
            n += packed(h, q_rows, src.dtype(&o_proj_name(cfg, i), &[h, qd])?);
            match cfg.moe.as_ref().filter(|m| m.sparse[i]) {
                Some(moe) => {
                    let (e, cols) = (moe.experts, plan.expert_ffn.len());
                    let router = src.dtype(&router_name(cfg.arch, i), &[e, h])?;
                    n += PackedMat::bytes_for(e, h, router, None);
                    // An expert's (or the shared expert's) bytes, `cols` of its columns here.
                    let expert = |parts: &[StoredRows; 3], cols: usize| {
                        let [g, u, d] = parts.each_ref().map(dtype);
                        Ok::<_, crate::Error>(packed(2 * cols, h, stacked(g?, u?)) + packed(h, cols, d?))
                    };
                    if cfg.arch == Arch::Qwen3VlMoe {
                        let ([gu, dn], ffn) = (transposed_expert_names(i), moe.expert_ffn);
                        let (gu, dn) = (src.dtype(&gu, &[e, h, 2 * ffn])?, src.dtype(&dn, &[e, ffn, h])?);
                        n += e * (packed(2 * cols, h, gu) + packed(h, cols, dn));
                    } else {
                        for x in 0..e {
                            n += expert(&expert_parts(cfg, moe, i, x), cols)?;
                        }
                    }
                    if moe.shared_ffn > 0 {
                        let [g, u, d, gate] = shared_expert_names(i);
                        n += expert(&separate_parts([g, u, d], moe.shared_ffn, h), plan.shared_ffn.len())?;
                        src.dtype(&gate, &[1, h])?;
                        n += 4 * h;
                    }
                }
                None => {
                    n += packed(ffn_rows(cfg, plan.ffn.len()), h, stacked(dtype(&gate)?, dtype(&up)?));
                    n += packed(h, plan.ffn.len(), src.dtype(&ffn_down_name(cfg, i), &[h, ff])?);
                }
            }
            for name in layer_norm_names(cfg).into_iter().flatten() {
                n += stream_norm_bytes(&p(name))?;
            }
            if cfg.linear_bias {
                // o_proj's and the down matrix's biases, this rank's columns of the first's.
                src.dtype(&bias_name(&gate.0), &[ff])?;
                src.dtype(&bias_name(&ffn_down_name(cfg, i)), &[h])?;
                src.dtype(&bias_name(&o_proj_name(cfg, i)), &[h])?;
                n += 4 * (2 * h + plan.ffn.len());
            }
            if cfg.qkv_bias {
                let kvd = cfg.kv_dim();
                let [(qkv, _, _), (k, _, _), ..] = stored_rows(cfg, i);
                if fused_by_group(cfg) || qkv == k {
                    src.dtype(&bias_name(&qkv), &[qd + 2 * kvd])?;
                } else {
                    for (name, len) in [("q_proj", qd), ("k_proj", kvd), ("v_proj", kvd)] {
                        src.dtype(&p(&format!("self_attn.{name}.bias")), &[len])?;
                    }
                }
                n += 4 * (q_rows + 2 * kv_rows);
            }
            if cfg.qk_norm {
                src.dtype(&p("self_attn.q_norm.weight"), &[hd])?;
                src.dtype(&p("self_attn.k_norm.weight"), &[hd])?;
                n += 4 * 2 * hd;
            }
            if cfg.qk_norm_full {
                src.dtype(&p("self_attn.q_norm.weight"), &[qd])?;
                src.dtype(&p("self_attn.k_norm.weight"), &[cfg.kv_dim()])?;
                n += 4 * (q_rows + kv_rows);
            }
        }
        let vocab_shape = [cfg.vocab_size, h];
        let vocab_rows =
            |name| Ok::<_, crate::Error>(packed(plan.vocab.len(), h, src.dtype(name, &vocab_shape)?));
        if plan.first_stage {
            n += vocab_rows(embed_name(cfg))?;
            if cfg.learned_positions {
                let dtype = src.dtype(POSITIONS_NAME, &[cfg.max_position_embeddings, h])?;
                n += PackedMat::bytes_for(plan.positions.len(), h, dtype, None);
            }
        }
        if plan.last_stage {
            n += stream_norm_bytes(final_norm_name(cfg))?;
            if cfg.head_bias {
                src.dtype("lm_head.bias", &[cfg.vocab_size])?;
                n += 4 * plan.vocab.len();
            }
            if !cfg.tie_word_embeddings {
                n += vocab_rows(head_name(cfg, src))?;
            } else if !plan.first_stage {
                n += vocab_rows(embed_name(cfg))?;
            }
        }
        Ok(n)
    }

    /// Bytes of weights this rank holds (shared tensors counted once).
    pub fn weight_bytes(&self) -> usize {
        let mut n = 0;
        for l in &self.layers {
            n += l.qkv.bytes() + l.o_proj.bytes() + l.ffn.bytes(None) as usize;
            n += l.vector_bytes();
        }
        n += self.embed.as_ref().map_or(0, |e| e.bytes());
        n += self.positions.as_ref().map_or(0, |p| p.bytes());
        n += self.final_norm.as_ref().map_or(0, |v| 4 * v.len());
        n += self.head_bias.as_ref().map_or(0, |b| 4 * b.len());
        if let (Some(head), embed) = (&self.lm_head, &self.embed) {
            if !embed.as_ref().is_some_and(|e| Arc::ptr_eq(e, head)) {
                n += head.bytes();
            }
        }
        n
    }

    /// Bytes of weights one token's decode step reads on this rank: all layers, one embedding
    /// row, the final norm and the whole lm_head shard. Of a mixture of experts, the router
    /// and the experts the token chooses.
    pub fn bytes_per_token(&self) -> usize {
        self.bytes_per_step(1)
    }

    /// Bytes of weights a decode step of `tokens` tokens reads on this rank: as
    /// [`Self::bytes_per_token`], but of a mixture of experts the router and the distinct
    /// experts its tokens chose: on average over the decode steps of that many tokens run so
    /// far (up to 64 tokens), else as many as tokens choosing at random would
    /// ([`crate::config::Moe::expected_experts`]).
    pub fn bytes_per_step(&self, tokens: usize) -> usize {
        let sparse = self.layers.iter().filter(|l| matches!(l.ffn, Ffn::Experts(_))).count();
        let experts = self.cfg.moe.as_ref().map(|m| {
            let counted = self
                .tally
                .0
                .get(tokens)
                .map(|(steps, reads)| (steps.load(Ordering::Relaxed), reads.load(Ordering::Relaxed)));
            match counted {
                Some((steps, reads)) if steps > 0 && sparse > 0 => {
                    reads as f64 / (steps as f64 * sparse as f64)
                }
                _ => m.expected_experts(tokens),
            }
        });
        let mut n: usize = self
            .layers
            .iter()
            .map(|l| {
                l.qkv.bytes() + l.o_proj.bytes() + l.ffn.bytes(experts).round() as usize + l.vector_bytes()
            })
            .sum();
        n += self.embed.as_ref().map_or(0, |e| e.bytes() / e.rows.max(1));
        n += self.final_norm.as_ref().map_or(0, |v| 4 * v.len());
        n += self.head_bias.as_ref().map_or(0, |b| 4 * b.len());
        n += self.lm_head.as_ref().map_or(0, |m| m.bytes());
        n
    }

    /// Chooses how this rank's one-token products prefetch ([`kernels::pick_fetch`]) by timing
    /// its own layers' products, in the order a decode step runs them; `None` when they are
    /// too small to tell.
    pub fn pick_fetch(
        &self,
        team: &Team,
    ) -> Option<kernels::Picked<kernels::Fetch, { kernels::Fetch::ALL.len() }>> {
        kernels::pick_fetch(team, &self.layer_mats())
    }

    /// Chooses which pieces of this rank's one-token products the AVX2 kernels read in three
    /// streams ([`kernels::pick_streams`]) by timing its own layers' products, in the order a
    /// decode step runs them; `None` when they are too small to tell or no such kernel reads
    /// them.
    pub fn pick_streams(
        &self,
        team: &Team,
    ) -> Option<kernels::Picked<kernels::Streams, { kernels::Streams::ALL.len() }>> {
        kernels::pick_streams(team, &self.layer_mats())
    }

    /// Chooses how this rank's many-token bf16 products prefetch ([`kernels::pick_many_fetch`])
    /// by timing `tokens` tokens through its own layers' products, in the order a decode step
    /// runs them; `None` when they are too small to tell or do not go through that kernel.
    pub fn pick_many_fetch(
        &self,
        team: &Team,
        tokens: usize,
    ) -> Option<kernels::Picked<kernels::ManyFetch, { kernels::ManyFetch::ALL.len() }>> {
        kernels::pick_many_fetch(team, &self.layer_mats(), tokens)
    }

    /// This rank's layers' products, in the order a decode step runs them.
    fn layer_mats(&self) -> Vec<&PackedMat> {
        let per_token = self.cfg.moe.as_ref().map_or(0, |m| m.per_token);
        self.layers
            .iter()
            .flat_map(|l| [&l.qkv, &l.o_proj].into_iter().chain(l.ffn.mats(per_token)))
            .collect()
    }

    /// A KV cache for this rank's layers and KV heads: a pool of `pages` pages, and rings for
    /// `slots` sequences of at most `chunk` positions a step where they take less memory
    /// ([`KvCache`]).
    pub fn new_kv(&self, pages: usize, slots: usize, chunk: usize, dtype: DType) -> KvCache {
        let windows: Vec<Option<usize>> = self.layers.iter().map(|l| self.windows[l.layout]).collect();
        KvCache::new(&windows, self.plan.kv_heads.len(), self.cfg.head_dim, (pages, slots, chunk), dtype)
    }

    /// Bytes one KV page takes on this rank.
    pub fn kv_page_bytes(&self, dtype: DType) -> usize {
        KvPool::page_bytes(self.layers.len(), self.plan.kv_heads.len(), self.cfg.head_dim, dtype)
    }

    /// Rows of vocabulary this rank's embedding / lm_head holds.
    pub fn vocab_range(&self) -> std::ops::Range<usize> {
        self.plan.vocab.clone()
    }

    /// Embedding lookup for `tokens` into `x` (`[n, hidden]`): rows in this rank's vocabulary
    /// range are copied (scaled, for Gemma), others are zero, the rows of the positions in this
    /// rank's range of a learned position embedding are added (the tokens' positions: those of
    /// `spans`, in order), and the stage allreduce fills in the rest.
    pub fn embed(&self, tokens: &[u32], spans: &[Span], x: &mut [f32], comm: &dyn Comm) {
        let h = self.cfg.hidden_size;
        let e = self.embed.as_ref().expect("embed called on a rank outside the first stage");
        let v0 = self.plan.vocab.start;
        for (t, &id) in tokens.iter().enumerate() {
            let out = &mut x[t * h..(t + 1) * h];
            let id = id as usize;
            if self.plan.vocab.contains(&id) {
                e.row_f32(id - v0, out);
                if self.embed_scale != 1.0 {
                    out.iter_mut().for_each(|v| *v *= self.embed_scale);
                }
            } else {
                out.fill(0.0);
            }
        }
        if let Some(pe) = &self.positions {
            let p0 = self.plan.positions.start;
            let positions = spans.iter().flat_map(|s| s.pos0..s.pos0 + s.len);
            for (out, p) in x.chunks_exact_mut(h).zip(positions).take(tokens.len()) {
                if self.plan.positions.contains(&p) {
                    pe.add_row_f32(p - p0, out);
                }
            }
        }
        if comm.size() > 1 {
            comm.allreduce_sum(&mut x[..tokens.len() * h]);
        }
    }

    /// Runs this shard's layers on a step's tokens, updating `x` (`[n, hidden]`, `n` the total
    /// of the spans' lengths) in place. Each span is a run of consecutive positions of one
    /// sequence, whose keys and values go to (and whose attention reads) the pages
    /// `tables[span.seq]` of `kv`'s pool (`ring_tables[span.seq]` of its ring, for windowed
    /// layers kept there): one span is a prompt (or a chunk of one) or a decode step, several
    /// are a batch of sequences. `long_rope[span.seq]`: the sequence rotates every position by
    /// LongRoPE's long factors, not only those past the original context.
    #[allow(clippy::too_many_arguments)] // the step's data, its cache, its buffers and its two kinds of parallelism
    pub fn forward(
        &self,
        x: &mut [f32],
        spans: &[Span],
        kv: &mut KvCache,
        tables: &[Vec<u32>],
        ring_tables: &[Vec<u32>],
        long_rope: &[bool],
        s: &mut Scratch,
        comm: &dyn Comm,
        team: &Team,
    ) {
        let cfg = &self.cfg;
        let (h, hd) = (cfg.hidden_size, cfg.head_dim);
        let nq = self.plan.q_heads.len();
        let nkv = self.plan.kv_heads.len();
        let qkv_rows = (nq + 2 * nkv) * hd;
        let ffl = self.plan.ffn.len();
        let n: usize = spans.iter().map(|sp| sp.len).sum();
        if n == 0 || self.layers.is_empty() {
            return;
        }
        // A decode step's experts are counted (for bench's bytes read).
        let tally = Some(&self.tally.0)
            .filter(|_| cfg.moe.is_some() && spans.iter().all(|sp| sp.len == 1))
            .and_then(|t| t.get(n));
        if let Some((steps, _)) = tally {
            steps.fetch_add(1, Ordering::Relaxed);
        }
        s.ensure(n, self);
        s.tokens.clear();
        s.blocks.clear();
        for sp in spans {
            assert!(sp.seq < tables.len(), "span of sequence {} but {} page tables", sp.seq, tables.len());
            let t0 = s.tokens.len();
            s.tokens.extend((sp.pos0..sp.pos0 + sp.len).map(|pos| (sp.seq, pos)));
            s.blocks.extend((0..sp.len).step_by(QUERY_BLOCK).map(|b| (t0 + b, QUERY_BLOCK.min(sp.len - b))));
        }
        let x = &mut x[..n * h];
        self.rope_tables(spans, long_rope, s);
        let group = cfg.n_heads / cfg.n_kv_heads;
        let q0 = self.plan.q_heads.start;
        let kv0 = self.plan.kv_heads.start;
        let scores = kernels::Scores { scale: cfg.attn_scale, cap: cfg.attn_softcap };
        // The local query heads that read local KV head `kvl` (heads are split in order, so
        // they are consecutive).
        let q_heads_of_kv = |kvl: usize| {
            let g = kv0 + kvl;
            (g * group).max(q0) - q0..((g + 1) * group).min(q0 + nq) - q0
        };
        // Steps with fewer (KV head, block) items than twice the kernel threads split the keys
        // of each one-token block (a decode step's) into parts, on the attention tiles'
        // boundaries, so every thread has work (one KV head per rank under tensor parallelism
        // would otherwise run on one thread). A split row's tiles are merged as one pass over
        // them folds them, so its bits are the same split or not.
        let items = nkv * s.blocks.len();
        let parts =
            if items < 2 * team.threads() { (2 * team.threads()).div_ceil(items).min(MAX_PARTS) } else { 1 };
        // For the layers of each window (Gemma 3's local and global layers have two): each
        // block's first item and first stored tile state (`splits`, one entry more than
        // blocks): a block has an item per (local KV head, part of its keys), and a split
        // block (one query) stores a state per (local query head, tile). The layers of one
        // window after another store their states in the same buffers.
        let (mut n_slots, mut any_split, mut room) = (0, false, 0);
        for (lay, &window) in s.layouts.iter_mut().zip(&self.windows) {
            lay.window = window;
            lay.splits.clear();
            let (mut n_items, mut slots, mut lay_room) = (0, 0, 0);
            for &b in &s.blocks {
                let tiles = key_tiles(key_pages(&s.tokens, window, b)).len();
                let parts = if b.1 == 1 { parts.min(tiles) } else { 1 };
                lay.splits.push((n_items, slots));
                n_items += nkv * parts;
                if parts > 1 {
                    slots += nq * tiles;
                    // Room for every tile the sequence can reach (its page table holds its
                    // whole length), so that its later steps allocate nothing as it grows.
                    lay_room += nq * tiles.max(tile_room(tables[s.tokens[b.0].0].len()));
                }
            }
            lay.splits.push((n_items, slots));
            (n_slots, room) = (n_slots.max(slots), room.max(lay_room));
            any_split |= lay.any_split();
        }
        // Every kernel thread's buffers are sized for the largest attention item before the
        // first step runs, not grown by the items a thread happens to take: otherwise a thread
        // that took only short items so far allocates in a later step.
        let item_rows = group * QUERY_BLOCK;
        if s.thread_rows < item_rows {
            team.run(&|_| reserve_thread_buffers(item_rows, hd));
            s.thread_rows = item_rows;
        }
        // Tile states are stored only for split blocks; other rows go straight to `att`.
        s.ensure_parts(room, self);
        // Each thread's own buffers: its copy of the residual stream and of its norm, of the
        // attention rows of a short step with split blocks (merged on every thread), and of
        // the activations of a short one; each thread's on cache lines of its own.
        let replicate = n <= REPLICATE_TOKENS;
        let [att_own_len, act_own_len, own_len] = own_lens(self, n, any_split);
        crate::grow(&mut s.own, team.threads() * own_len);
        let Scratch {
            tokens,
            blocks,
            layouts,
            cos,
            sin,
            cos_local,
            sin_local,
            qkv,
            att,
            o,
            gu,
            act,
            part_out,
            part_stats,
            own,
            moe_logits,
            moe_x,
            moe_gu,
            moe_act,
            moe_out,
            moe_shared_gu,
            moe_shared_act,
            moe_shared_out,
            qk_inv,
            ..
        } = s;
        let (tokens, blocks, layouts) = (&*tokens, &*blocks, &*layouts);
        let (cos, sin, cos_local, sin_local) = (&*cos, &*sin, &*cos_local, &*sin_local);
        // Item `i` of layout `lay`: a block's items are its local KV heads' parts, in that order.
        let item = |lay: &Layout, i: usize| {
            let (splits, window) = (&lay.splits, lay.window);
            let block = splits.partition_point(|sp| sp.0 <= i) - 1;
            let (first, (t0, nt)) = (splits[block].0, blocks[block]);
            let parts = (splits[block + 1].0 - first) / nkv;
            let (kvl, part) = ((i - first) / parts, (i - first) % parts);
            let (lo, np) = key_pages(tokens, window, (t0, nt));
            let tiles = key_tiles((lo, np));
            // Parts begin at the tiles holding the even shares' first pages.
            let cut = |p: usize| if p == parts { tiles.end } else { kernels::tile_of(lo + p * np / parts) };
            let mine = cut(part)..cut(part + 1);
            let keys = if mine.is_empty() {
                0..0
            } else {
                let pages =
                    kernels::tile_pages(mine.start).start.max(lo)..kernels::tile_pages(mine.end - 1).end;
                pages.start * PAGE..(pages.end * PAGE).min(tokens[t0 + nt - 1].1 + 1)
            };
            AttItem { block, t0, nt, kvl, part, parts, tiles, mine, keys }
        };
        // Decode steps (every span one token, of distinct sequences) leave the bias, RoPE and
        // the write of each new key and value to the attention items: an item's block is one
        // token, and the item of its KV head's last part (the only one to read the page the
        // new position is on) writes it before attending. Other steps do it on thread 0
        // between the QKV product and attention.
        let fold = spans.iter().all(|sp| sp.len == 1)
            && spans.iter().enumerate().all(|(i, a)| spans[..i].iter().all(|b| b.seq != a.seq));
        // Token `t`'s vector `j` of a QKV row (q heads, then k heads, then v heads) as it
        // comes from the product, finished: its bias added, clamped (OLMo) and, but for v,
        // normed (Qwen3, Gemma 3) and rotated (but in SmolLM3's NoPE layers).
        // The rotated pairs of a head (its tables' stride), from its first dimension.
        let half = cfg.rotary_dim / 2;
        let qk_inv = SharedSlice::new(&mut qk_inv[..2 * n]);
        let finish = |l: &Layer, t: usize, j: usize, out: &mut [f32]| {
            if let Some(b) = &l.qkv_bias {
                add_bias(out, &b[j * hd..(j + 1) * hd]);
            }
            if let Some(c) = cfg.clip_qkv {
                out.iter_mut().for_each(|v| *v = v.clamp(-c, c));
            }
            if let Some((qn, kn)) = l.head_norms.as_ref().filter(|_| j < nq + nkv) {
                kernels::rmsnorm_in_place(out, if j < nq { qn } else { kn }, cfg.rms_norm_eps);
            }
            if let Some((qn, kn)) = l.full_norms.as_ref().filter(|_| j < nq + nkv) {
                // SAFETY: the token's factors were written before the barrier that ended the
                // QKV product's sums (below).
                let inv = unsafe { &*qk_inv.range(2 * t, 2) };
                let (w, f) = if j < nq { (&qn[j * hd..], inv[0]) } else { (&kn[(j - nq) * hd..], inv[1]) };
                out.iter_mut().zip(w).for_each(|(v, w)| *v *= f * w);
            }
            if j < nq + nkv {
                let (cos, sin) = match l.rope {
                    LayerRope::Base => (cos, sin),
                    LayerRope::Local => (cos_local, sin_local),
                    LayerRope::None => return,
                };
                let (cos, sin) = (&cos[t * half..(t + 1) * half], &sin[t * half..(t + 1) * half]);
                if cfg.rope_interleaved {
                    kernels::rope_interleaved(out, hd, cos, sin);
                } else {
                    kernels::rope(out, hd, cos, sin);
                }
            }
        };
        let x_io = SharedSlice::new(x);
        let qkv = SharedSlice::new(&mut qkv[..n * qkv_rows]);
        let att = SharedSlice::new(&mut att[..n * nq * hd]);
        let o = SharedSlice::new(&mut o[..n * h]);
        let gu = SharedSlice::new(&mut gu[..n * 2 * ffl]);
        let act = SharedSlice::new(&mut act[..n * ffl]);
        let nk = n * cfg.moe.as_ref().map_or(0, |m| m.per_token);
        let (experts_n, efl) = (cfg.moe.as_ref().map_or(0, |m| m.experts), self.plan.expert_ffn.len());
        let sfl = self.plan.shared_ffn.len();
        let expert_bufs = ExpertBufs {
            logits: SharedSlice::new(&mut moe_logits[..n * experts_n]),
            x: SharedSlice::new(&mut moe_x[..nk * h]),
            gu: SharedSlice::new(&mut moe_gu[..nk * 2 * efl]),
            act: SharedSlice::new(&mut moe_act[..nk * efl]),
            out: SharedSlice::new(&mut moe_out[..nk * h]),
            shared_gu: SharedSlice::new(&mut moe_shared_gu[..n * 2 * sfl]),
            shared_act: SharedSlice::new(&mut moe_shared_act[..n * sfl]),
            shared_out: SharedSlice::new(&mut moe_shared_out[..n * sfl.min(1) * h]),
        };
        let part_out = SharedSlice::new(&mut part_out[..n_slots * hd]);
        let part_stats = SharedSlice::new(&mut part_stats[..n_slots * 2]);
        let own = SharedSlice::new(&mut own[..team.threads() * own_len]);
        let (pool, ring, places) = kv.parts();
        let (pool, ring) = (KvAccess(pool), KvAccess(ring));
        let comm = MainThread(comm);
        // The whole stage in one region of the team: every thread keeps its own copy of the
        // residual stream and computes the norms, residual sums (and, for a few tokens, SiLU
        // and the merge of attention parts) on it, so kernels follow each other with one
        // barrier between them, not a dispatch and a join around work done by thread 0 alone.
        // Thread 0 alone makes the MPI calls.
        team.region(&|r| {
            let tid = r.tid();
            // SAFETY (every `range` below): `own` is split by thread; the shared buffers are
            // written in disjoint ranges (by the team's ranges, by item, by token or by thread
            // 0 alone) and read only after the barrier that ends their writing, and each
            // buffer is written again only after every thread has passed a barrier that
            // follows its last read.
            let mine = unsafe { own.range(tid * own_len, own_len) };
            let (xo, rest) = mine.split_at_mut(n * h);
            let (xn, rest) = rest.split_at_mut(n * h);
            let (att_own, rest) = rest.split_at_mut(att_own_len);
            let act_own = &mut rest[..act_own_len];
            xo.copy_from_slice(unsafe { x_io.range(0, n * h) });
            for (i, l) in self.layers.iter().enumerate() {
                // Where the layer's keys and values are: its store, its index there and the
                // sequences' tables into it.
                let (ringed, li) = places[i];
                let (kv, tables) = if ringed { (&ring, ring_tables) } else { (&pool, tables) };
                let lay = &layouts[l.layout];
                let n_items = lay.n_items();
                // Attention block.
                norm_into(xo, &l.input_norm, cfg.rms_norm_eps, xn);
                if n <= PREFETCH_TOKENS {
                    // SAFETY: nothing writes the pool until after the product.
                    let kv = unsafe { kv.get() };
                    if fold {
                        // The heads whose new position this thread will likely write: those of
                        // the last parts in its first share of the items.
                        for it in r.share(n_items).map(|i| item(lay, i)) {
                            if it.part == it.parts - 1 {
                                let (seq, pos) = tokens[it.t0];
                                kv.prefetch_write_heads(li, &tables[seq], pos, it.kvl..it.kvl + 1);
                            }
                        }
                    } else if tid == 0 {
                        for &(seq, pos) in tokens {
                            kv.prefetch_write(li, &tables[seq], pos);
                        }
                    }
                    // The first pages (up to `FAR_PAGES`) of the attention item this thread
                    // takes first (the start of its share, see `Region::for_ranges`), into L2
                    // while the QKV product streams; each item asks for the next one's while
                    // it computes (below). On the 2-core Zen 5 machine the page kernels'
                    // profile share fell from ~4.6% to ~3.4% of the layer products' with the
                    // first items' pages asked for here (SmolLM2, batch 1).
                    if let Some(AttItem { kvl, t0, keys, .. }) = r.share(n_items).next().map(|i| item(lay, i))
                    {
                        kv.prefetch_read(li, kvl, &tables[tokens[t0].0], first_pages(&keys), 0, 1);
                    }
                }
                kernels::matmul(r, &l.qkv, xn, n, unsafe { qkv.range(0, n * qkv_rows) });
                if l.full_norms.is_some() {
                    if tid == 0 {
                        // SAFETY: the other threads wait at the barrier below.
                        let (qkv, inv) = unsafe { (&*qkv.range(0, n * qkv_rows), qk_inv.range(0, 2 * n)) };
                        full_norm_factors(qkv, inv, (nq, nkv, hd), |kvl| {
                            // A KV head is counted by the rank holding its first query head.
                            (q0..q0 + nq).contains(&((kv0 + kvl) * group))
                        });
                        if comm.0.size() > 1 {
                            comm.0.allreduce_sum(inv);
                        }
                        let dims = [cfg.q_dim(), cfg.kv_dim()];
                        for (v, d) in inv.iter_mut().zip(dims.iter().cycle()) {
                            *v = 1.0 / (*v / *d as f32 + cfg.rms_norm_eps).sqrt();
                        }
                    }
                    r.barrier();
                }
                if !fold {
                    if tid == 0 {
                        // SAFETY: the other threads wait at the barrier below.
                        let (kv, qkv) = unsafe { (kv.get_mut(), qkv.range(0, n * qkv_rows)) };
                        for (t, &(seq, pos)) in tokens.iter().enumerate() {
                            let row = &mut qkv[t * qkv_rows..(t + 1) * qkv_rows];
                            for (j, v) in row.chunks_exact_mut(hd).enumerate() {
                                finish(l, t, j, v);
                            }
                            kv.write(
                                li,
                                &tables[seq],
                                pos,
                                &row[nq * hd..(nq + nkv) * hd],
                                &row[(nq + nkv) * hd..],
                            );
                        }
                    }
                    r.barrier();
                }
                let qkv_r = unsafe { &*qkv.range(0, n * qkv_rows) };
                // SAFETY: from here to the next layer's write the pool is only read, but for
                // the heads' new positions, each written by the one item that reads its page.
                let kv_r = unsafe { kv.get() };
                // One item per (KV head, block of a span's positions, part of its keys),
                // holding every local query head that reads that KV head: the block's keys and
                // values are read (and widened) once for all its rows.
                r.for_ranges(n_items, 1, &|items| {
                    // The item after each one, worked out once: for its pages' requests, then
                    // (within a range) as the next item itself.
                    let mut following: Option<AttItem> = None;
                    for i in items {
                        let this = following.take().unwrap_or_else(|| item(lay, i));
                        // The first pages (up to `FAR_PAGES`) of the next item, into L2, asked
                        // for a share at each page this one visits: with short items (decode)
                        // the pages of one come from memory in less time than its own
                        // prefetches can cover, and asked for at once, when the item starts,
                        // the requests queue ahead of its own reads. On the 2-core Zen 4
                        // machine, spread so (and the first item's pages asked for into L2
                        // rather than L1), SmolLM2 decode steps at positions 64–320 took
                        // 1.6–3.0% less time while the cores sat apart (11 runs, the two ways
                        // alternating step by step), ~1% less together; at positions
                        // 1500–1630 the same time.
                        let next = Some(i + 1).filter(|&i| i < n_items).map(|i| item(lay, i));
                        let ahead = |visit: usize, visits: usize| {
                            if let Some(AttItem { kvl, t0, keys, .. }) = &next {
                                let table = &tables[tokens[*t0].0];
                                kv_r.prefetch_read(li, *kvl, table, first_pages(keys), visit, visits);
                            }
                        };
                        let AttItem { block, t0, nt, kvl, part, parts, tiles, mine, keys } = this;
                        let heads = q_heads_of_kv(kvl);
                        let seq = tokens[t0].0;
                        QROWS.with_borrow_mut(|(q, o, bounds)| {
                            q.clear();
                            bounds.clear();
                            // Where row `t`'s vector `j` (of q, then k, then v heads) begins.
                            let at = |t: usize, j: usize| t * qkv_rows + j * hd;
                            for hl in heads.clone() {
                                for (t, &(_, pos)) in tokens.iter().enumerate().skip(t0).take(nt) {
                                    q.extend_from_slice(&qkv_r[at(t, hl)..at(t, hl + 1)]);
                                    if fold {
                                        let end = q.len();
                                        finish(l, t, hl, &mut q[end - hd..]);
                                    }
                                    let lo = lay.window.map_or(0, |w| (pos + 1).saturating_sub(w));
                                    bounds.push((lo, pos));
                                }
                            }
                            if fold && part == parts - 1 {
                                // This item's block is one token, and only this item reads its
                                // KV head's last page: the new key and value go in here.
                                let (k, v) = (nq + kvl, nq + nkv + kvl);
                                o.clear();
                                o.extend_from_slice(&qkv_r[at(t0, k)..at(t0, k + 1)]);
                                o.extend_from_slice(&qkv_r[at(t0, v)..at(t0, v + 1)]);
                                let (ko, vo) = o.split_at_mut(hd);
                                finish(l, t0, k, ko);
                                finish(l, t0, v, vo);
                                // SAFETY: no other item reads or writes head `kvl`'s last page
                                // of this sequence (other parts read earlier pages only).
                                unsafe { kv_r.write_head(li, &tables[seq], tokens[t0].1, kvl, ko, vo) };
                            }
                            if parts == 1 {
                                o.resize(q.len(), 0.0);
                                kv_r.attend(
                                    li,
                                    kvl,
                                    &tables[seq],
                                    q,
                                    bounds,
                                    scores,
                                    AttendOut::Rows(o),
                                    &ahead,
                                );
                                for (i, row) in o.chunks_exact(hd).enumerate() {
                                    let dst = (t0 + i % nt) * nq + heads.start + i / nt;
                                    // SAFETY: (token, head) rows are disjoint between items.
                                    unsafe { att.range(dst * hd, hd) }.copy_from_slice(row);
                                }
                                return;
                            }
                            // Rows see only this part's keys (their bounds lie within the
                            // block's), and leave a state per tile of the part. A split block
                            // is one token: row `r` is head `heads.start + r`.
                            for b in bounds.iter_mut() {
                                *b = if keys.is_empty() {
                                    (1, 0)
                                } else {
                                    (b.0.max(keys.start), b.1.min(keys.end - 1))
                                };
                            }
                            let slot0 = lay.splits[block].1;
                            let mut emit = |r: usize, tile: usize, m: f32, l: f32, acc: &[f32]| {
                                let at = slot0 + (heads.start + r) * tiles.len() + tile - tiles.start;
                                // SAFETY: (head, tile) states of a block are disjoint between
                                // items (each takes its own tiles of its own heads).
                                unsafe { part_out.range(at * hd, hd) }.copy_from_slice(acc);
                                unsafe { part_stats.range(at * 2, 2) }.copy_from_slice(&[m, l]);
                            };
                            let out = AttendOut::Tiles { tiles: mine.clone(), emit: &mut emit };
                            kv_r.attend(li, kvl, &tables[seq], q, bounds, scores, out, &ahead);
                        });
                        following = next;
                    }
                });
                // Block `b`'s rows merged from their tile states into `out` (its `nt * nq`
                // rows), if it is split; returns whether it was.
                let merge = |b: usize, out: &mut [f32]| {
                    let ((_, slot), (_, end)) = (lay.splits[b], lay.splits[b + 1]);
                    if end == slot {
                        return false;
                    }
                    let tiles = (end - slot) / nq;
                    // SAFETY: the states were written before the barrier that ended attention.
                    let (po, ps) = unsafe {
                        (
                            &*part_out.range(slot * hd, (end - slot) * hd),
                            &*part_stats.range(slot * 2, (end - slot) * 2),
                        )
                    };
                    for ((out, po), ps) in out
                        .chunks_exact_mut(hd)
                        .zip(po.chunks_exact(tiles * hd))
                        .zip(ps.chunks_exact(tiles * 2))
                    {
                        kernels::merge_tiles(po, ps, out);
                    }
                    true
                };
                let att_in: &[f32] = if !lay.any_split() {
                    unsafe { &*att.range(0, n * nq * hd) }
                } else if replicate {
                    // Few rows (decode): every thread merges the split rows into its own copy,
                    // and copies the others, without a barrier.
                    for (b, &(t0, nt)) in blocks.iter().enumerate() {
                        let rows = t0 * nq * hd..(t0 + nt) * nq * hd;
                        if !merge(b, &mut att_own[rows.clone()]) {
                            att_own[rows.clone()]
                                .copy_from_slice(unsafe { att.range(rows.start, rows.len()) });
                        }
                    }
                    att_own
                } else {
                    for b in r.share(blocks.len()) {
                        let (t0, nt) = blocks[b];
                        // SAFETY: blocks' rows are disjoint, and only this thread merges block `b`.
                        merge(b, unsafe { att.range(t0 * nq * hd, nt * nq * hd) });
                    }
                    r.barrier();
                    unsafe { &*att.range(0, n * nq * hd) }
                };
                kernels::matmul(r, &l.o_proj, att_in, n, unsafe { o.range(0, n * h) });
                if cfg.parallel_ffn_norm {
                    // The FFN's own norm of the layer's input, while `xo` still holds it
                    // (this thread's `xn` was last read by the QKV product, barriers ago).
                    norm_into(xo, &l.post_norm, cfg.rms_norm_eps, xn);
                }
                let norm = l.out_norms.as_ref().map(|(a, _)| (&a[..], cfg.rms_norm_eps));
                add_reduced(r, &comm, &o, xo, norm, cfg.residual_multiplier, l.o_bias.as_deref());

                // FFN block: its input normed, or (a parallel residual) the attention's normed
                // input (or the FFN's own norm of it), in `xn` untouched since.
                if !cfg.parallel_residual {
                    norm_into(xo, &l.post_norm, cfg.rms_norm_eps, xn);
                }
                let (gate_up, down) = match &l.ffn {
                    Ffn::Dense { gate_up, down } => (gate_up, down),
                    Ffn::Experts(x) => {
                        let tally = tally.map(|t| &t.1);
                        experts(r, cfg, x, xn, n, &expert_bufs, &o, tally);
                        let norm = l.out_norms.as_ref().map(|(_, f)| (&f[..], cfg.rms_norm_eps));
                        add_reduced(r, &comm, &o, xo, norm, cfg.residual_multiplier, None);
                        continue;
                    }
                };
                let gu_w = ffn_rows(cfg, ffl);
                kernels::matmul(r, gate_up, xn, n, unsafe { gu.range(0, n * gu_w) });
                let gu_r = unsafe { &*gu.range(0, n * gu_w) };
                // Token `t`'s activations, act(gate) · up (or, without a gate, act(x · w + b)),
                // into `a`.
                let activate = |t: usize, a: &mut [f32]| {
                    let row = &gu_r[t * gu_w..(t + 1) * gu_w];
                    a.copy_from_slice(&row[..ffl]);
                    if let Some((b, _)) = &l.ffn_bias {
                        add_bias(a, b);
                    }
                    if cfg.gated_ffn {
                        kernels::act_mul(a, &row[ffl..], cfg.activation);
                    } else {
                        kernels::act(a, cfg.activation);
                    }
                };
                let act_in: &[f32] = if replicate {
                    // Few tokens: every thread its own copy, without a barrier.
                    act_own.chunks_exact_mut(ffl).enumerate().for_each(|(t, a)| activate(t, a));
                    act_own
                } else {
                    r.share(n).for_each(|t| activate(t, unsafe { act.range(t * ffl, ffl) }));
                    r.barrier();
                    unsafe { &*act.range(0, n * ffl) }
                };
                kernels::matmul(r, down, act_in, n, unsafe { o.range(0, n * h) });
                let norm = l.out_norms.as_ref().map(|(_, f)| (&f[..], cfg.rms_norm_eps));
                let bias = l.ffn_bias.as_ref().map(|(_, d)| &d[..]);
                add_reduced(r, &comm, &o, xo, norm, cfg.residual_multiplier, bias);
                // `o` is written next by the next layer's o_proj, two barriers or more from here.
            }
            if tid == 0 {
                unsafe { x_io.range(0, n * h) }.copy_from_slice(xo);
            }
        });
    }

    /// cos/sin of every token's position, the spans' tokens in turn (as `s.tokens` lists them),
    /// for the local layers too if they have frequencies of their own. Under LongRoPE a token takes
    /// the long factors at positions past the original context, or at every position of a sequence
    /// marked in `long_rope`; the global tables are times its attention factor.
    fn rope_tables(&self, spans: &[Span], long_rope: &[bool], s: &mut Scratch) {
        let half = self.inv_freq.len();
        type Long = Option<(Vec<f64>, usize)>;
        let tables = |inv_freq: &[f64], long: &Long, factor: f64, cos: &mut [f32], sin: &mut [f32]| {
            let mut t = 0;
            for sp in spans {
                let long_all = long_rope[sp.seq];
                for pos in sp.pos0..sp.pos0 + sp.len {
                    let inv_freq = match long {
                        Some((long, original)) if long_all || pos >= *original => long,
                        _ => inv_freq,
                    };
                    let p = pos as f64;
                    for (i, f) in inv_freq.iter().enumerate() {
                        let a = p * f;
                        cos[t * half + i] = (a.cos() * factor) as f32;
                        sin[t * half + i] = (a.sin() * factor) as f32;
                    }
                    t += 1;
                }
            }
        };
        tables(&self.inv_freq, &self.inv_freq_long, self.cfg.rope_attention_factor(), &mut s.cos, &mut s.sin);
        if let Some(local) = &self.inv_freq_local {
            tables(local, &None, 1.0, &mut s.cos_local, &mut s.sin_local);
        }
    }

    /// Final norm and this rank's vocabulary shard of the logits for `m` hidden states `x`
    /// (`[m, hidden]`) into `out` (`[m, vocab shard]`), reading the output head once.
    /// The final norm of the rows of `x` into `out`: the model's last hidden states, as HF's
    /// base models give them (the output head reads these). Last stage only.
    pub fn final_normed(&self, x: &[f32], out: &mut [f32]) {
        let norm = self.final_norm.as_ref().expect("final_normed called outside the last stage");
        norm.apply(x, self.cfg.rms_norm_eps, &mut out[..x.len()]);
    }

    pub fn logits(&self, x: &[f32], m: usize, s: &mut Scratch, out: &mut [f32], team: &Team) {
        let h = self.cfg.hidden_size;
        let norm = self.final_norm.as_ref().expect("logits called outside the last stage");
        let head = self.lm_head.as_ref().expect("logits called outside the last stage");
        s.ensure(m, self);
        norm.apply(&x[..m * h], self.cfg.rms_norm_eps, &mut s.xn[..m * h]);
        kernels::matmul(team, head, &s.xn[..m * h], m, &mut out[..m * head.rows]);
        if let Some(b) = &self.head_bias {
            add_bias(&mut out[..m * head.rows], b);
        }
        if self.cfg.logits_scaling != 1.0 {
            out[..m * head.rows].iter_mut().for_each(|v| *v /= self.cfg.logits_scaling);
        }
        if let Some(cap) = self.cfg.final_softcap {
            kernels::softcap(&mut out[..m * head.rows], 1.0, cap);
        }
    }

    pub fn weight_dtype(&self) -> &'static str {
        self.layers
            .first()
            .map(|l| l.qkv.dtype_name())
            .or(self.lm_head.as_ref().map(|m| m.dtype_name()))
            .unwrap_or("f32")
    }
}

/// A step's attention items for the layers of one window: (first item, first stored tile
/// state) of each block, one entry more than blocks (the totals).
struct Layout {
    window: Option<usize>,
    splits: Vec<(usize, usize)>,
}

impl Layout {
    /// The step's attention items.
    fn n_items(&self) -> usize {
        self.splits.last().map_or(0, |s| s.0)
    }

    /// Whether any block is split (only split blocks store tile states).
    fn any_split(&self) -> bool {
        self.splits.last().is_some_and(|s| s.1 > 0)
    }
}

/// Working buffers for one forward pass, grown when a longer chunk arrives (prefill) and
/// reused by every decode step, so decode allocates nothing.
#[derive(Default)]
pub struct Scratch {
    /// (sequence, position) of each token of the current step.
    tokens: Vec<(usize, usize)>,
    /// (first token, count) of each block of consecutive positions of one span.
    blocks: Vec<(usize, usize)>,
    /// The step's attention items, one layout per window of the shard's layers.
    layouts: Vec<Layout>,
    tok_cap: usize,
    xn: Vec<f32>,
    qkv: Vec<f32>,
    att: Vec<f32>,
    o: Vec<f32>,
    gu: Vec<f32>,
    act: Vec<f32>,
    cos: Vec<f32>,
    sin: Vec<f32>,
    /// cos/sin of the local layers' RoPE (Gemma 3), empty if they have none of their own.
    cos_local: Vec<f32>,
    sin_local: Vec<f32>,
    /// Attention tile states of the split blocks (one token each), a row's tiles side by side:
    /// `[block, head, tile, head_dim]` weighted values and `[block, head, tile, 2]` (max and
    /// sum, [`kernels::AttendOut::Tiles`]).
    part_out: Vec<f32>,
    part_stats: Vec<f32>,
    /// Query rows per attention item that every kernel thread's buffers are sized for
    /// ([`reserve_thread_buffers`]).
    thread_rows: usize,
    /// Each kernel thread's own buffers in [`Shard::forward`]'s region.
    own: Vec<f32>,
    /// The mixture-of-experts FFNs' buffers ([`ExpertBufs`]).
    moe_logits: Vec<f32>,
    moe_x: Vec<f32>,
    moe_gu: Vec<f32>,
    moe_act: Vec<f32>,
    moe_out: Vec<f32>,
    moe_shared_gu: Vec<f32>,
    moe_shared_act: Vec<f32>,
    moe_shared_out: Vec<f32>,
    /// Each token's inverse RMS of its whole q and k projections (OLMo 2), side by side.
    qk_inv: Vec<f32>,
}

impl Scratch {
    /// Floats of each token-sized buffer [`Scratch::ensure`] makes for `n` tokens, in the order
    /// of the fields from `xn` to `sin_local`.
    fn lens(n: usize, m: &Shard) -> [usize; 19] {
        let cfg = &m.cfg;
        let (nq, nkv, hd, h) = (m.plan.q_heads.len(), m.plan.kv_heads.len(), cfg.head_dim, cfg.hidden_size);
        let ffl = m.plan.ffn.len();
        let (experts, nk) = cfg.moe.as_ref().map_or((0, 0), |moe| (moe.experts, n * moe.per_token));
        let (efl, sfl) = (m.plan.expert_ffn.len(), m.plan.shared_ffn.len());
        let local = if m.inv_freq_local.is_some() { n * hd / 2 } else { 0 };
        [
            n * h,
            n * (nq + 2 * nkv) * hd,
            n * nq * hd,
            n * h,
            n * 2 * ffl,
            n * ffl,
            n * hd / 2,
            n * hd / 2,
            n * experts,
            nk * h,
            nk * 2 * efl,
            nk * efl,
            nk * h,
            n * 2 * sfl,
            n * sfl,
            n * sfl.min(1) * h,
            2 * n,
            local,
            local,
        ]
    }

    fn ensure(&mut self, n: usize, m: &Shard) {
        if n <= self.tok_cap && !self.xn.is_empty() {
            return;
        }
        let n = n.max(self.tok_cap).max(1);
        self.tok_cap = n;
        self.tokens = Vec::with_capacity(n);
        self.blocks = Vec::with_capacity(n);
        self.layouts =
            m.windows.iter().map(|&window| Layout { window, splits: Vec::with_capacity(n + 1) }).collect();
        let buffers = [
            &mut self.xn,
            &mut self.qkv,
            &mut self.att,
            &mut self.o,
            &mut self.gu,
            &mut self.act,
            &mut self.cos,
            &mut self.sin,
            &mut self.moe_logits,
            &mut self.moe_x,
            &mut self.moe_gu,
            &mut self.moe_act,
            &mut self.moe_out,
            &mut self.moe_shared_gu,
            &mut self.moe_shared_act,
            &mut self.moe_shared_out,
            &mut self.qk_inv,
            &mut self.cos_local,
            &mut self.sin_local,
        ];
        for (b, len) in buffers.into_iter().zip(Self::lens(n, m)) {
            *b = vec![0.0; len];
        }
    }

    /// Bytes of the buffers of a run on `m` with `threads` kernel threads, beyond its weights
    /// and KV pages: `[per token of a step, per sequence slot]` — the token-sized buffers of
    /// [`Scratch::ensure`] and each thread's own ([`own_lens`], as [`Scratch::reserve_decode`]
    /// reserves them for the slots), and the tile states of a slot's split blocks. An estimate
    /// from below (tables, layouts and routing left out) for telling a run that cannot fit.
    pub(crate) fn bytes_per(m: &Shard, threads: usize) -> [usize; 2] {
        const SMALL: usize = kernels::TILE_PAGES / kernels::SMALL_TILE_PAGES;
        let token = Self::lens(1, m).iter().sum::<usize>() + threads * 2 * m.cfg.hidden_size;
        let slot = threads * 2 * m.cfg.hidden_size + m.plan.q_heads.len() * SMALL * (m.cfg.head_dim + 2);
        [4 * token, 4 * slot]
    }

    /// Room, before a run's first step, for the tile states of any decode step of at most
    /// `slots` sequences whose page tables hold at most `pages` pages together, so that its
    /// first decode steps allocate nothing either (without this they grew these buffers, in
    /// a run with no warm-up before it). A sequence of `P` pages has at most
    /// `tile_room(P) ≤ SMALL + P / TILE_PAGES` tiles (`SMALL` of the small ones), so the
    /// sequences together at most `SMALL · slots + pages / TILE_PAGES` per local query head:
    /// for SmolLM2 9.5 KB a sequence and 0.3 KB a page, beside the 369 KB of a page of keys
    /// and values.
    ///
    /// Likewise every kernel thread's own buffers (`threads` of them) for such a step with
    /// split blocks: a lone sequence's first steps have none, and its first split block (past
    /// position 32) would otherwise grow them.
    pub fn reserve_decode(&mut self, m: &Shard, pages: usize, slots: usize, threads: usize) {
        const SMALL: usize = kernels::TILE_PAGES / kernels::SMALL_TILE_PAGES;
        self.ensure_parts(m.plan.q_heads.len() * (SMALL * slots + pages / kernels::TILE_PAGES), m);
        let most = own_lens(m, slots, true)[2].max(own_lens(m, slots.min(REPLICATE_TOKENS), true)[2]);
        crate::grow(&mut self.own, threads * most);
    }

    /// Room for `rows` stored attention tile states (grows only).
    fn ensure_parts(&mut self, rows: usize, m: &Shard) {
        crate::grow(&mut self.part_out, rows * m.cfg.head_dim);
        crate::grow(&mut self.part_stats, rows * 2);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::Single;
    use crate::grid::Grid;
    use crate::weights::synthetic::{self, Synthetic};

    /// A sequence's decode step gives the same hidden state, bit for bit, alone, in a batch of
    /// other sequences' decode tokens and beside another sequence's prompt chunk (which sends the
    /// step's products through the many-token path's column blocks and tiles), on one, two or three
    /// kernel threads, for float and int8 weights. The model has one KV head, so its keys (six
    /// attention tiles) are split into two, four or six parts alone on one, two or three threads,
    /// and into two in the batch and beside the prompt on two or three (there merged by the team,
    /// the step being too long to merge on every thread), with a sliding window into two at most;
    /// and rows wider than one column block (the down product's 4100 columns). With QKV biases
    /// (Qwen2) or per-head q/k norms (Qwen3), which the batch and the prompt chunk apply before
    /// attention and a decode step alone inside its items; and Gemma 3's local layer (a window of
    /// 100, its own RoPE) before a global one, a step's attention in two layouts; Gemma 2's
    /// soft-capped scores, capped tile by tile; OLMo 2's output norms and q and k normed over their
    /// whole width (before attention, or inside its items alone); and a mixture of experts, whose
    /// products take the rows of the tokens that chose each expert.
    #[test]
    fn a_decode_token_is_the_same_alone_in_a_batch_and_on_any_threads() {
        let mut cfg = synthetic::shape("qwen2-0.5b").unwrap();
        (cfg.hidden_size, cfg.head_dim, cfg.rotary_dim, cfg.n_heads, cfg.n_kv_heads) = (64, 16, 16, 4, 1);
        (cfg.intermediate_size, cfg.n_layers, cfg.vocab_size) = (4100, 2, 300);
        let h = cfg.hidden_size;
        // Seq 0's prompt of 290 tokens (its next token sees 19 pages: tiles of pages 0–1, 2–3,
        // 4–5, 6–7, 8–15 and 16–18), seq 1's of 20 and seq 2's of 3; seq 3 is a new prompt.
        let tables: Vec<Vec<u32>> = vec![(0..19).collect(), vec![19, 20], vec![21], vec![22, 23]];
        let span = |seq, pos0, len| Span { seq, pos0, len, emit: true };
        let prompt =
            |len: usize, from: u32| -> Vec<u32> { (0..len as u32).map(|i| (from + 7 * i) % 300).collect() };
        // Bf16, f32 and int8 weights; bf16 with a sliding window of 100 positions (seq 0's
        // token then sees pages 11–18: tiles 8–15 and 16–23); bf16 with Qwen3's head norms
        // instead of Qwen2's biases; and Gemma 3's layers, the first local.
        let cases = [
            (DType::BF16, None, None, Arch::Qwen2),
            (DType::F32, None, None, Arch::Qwen2),
            (DType::F16, Some(Quant::Int8), None, Arch::Qwen2),
            (DType::BF16, None, Some(100), Arch::Qwen2),
            (DType::BF16, None, None, Arch::Qwen3),
            (DType::BF16, None, Some(100), Arch::Gemma3),
            (DType::BF16, None, Some(100), Arch::Gemma2),
            (DType::BF16, None, None, Arch::Olmo2),
            (DType::BF16, None, None, Arch::Mixtral),
            (DType::F16, Some(Quant::Int8), None, Arch::Qwen2Moe),
        ];
        for (dtype, quant, window, arch) in cases {
            let (qkv_bias, qk_norm) = (arch == Arch::Qwen2, matches!(arch, Arch::Qwen3 | Arch::Gemma3));
            let mut cfg = ModelConfig { sliding_window: window, arch, qkv_bias, qk_norm, ..cfg.clone() };
            if matches!(arch, Arch::Mixtral | Arch::Qwen2Moe) {
                // A dense layer, then a mixture of 5 experts of 100 columns, 2 a token: the
                // batch's tokens share some experts' products, seq 0's rows among others'
                // (Qwen2-MoE's with a shared expert of 60 columns, int8).
                let sparse = vec![false, true];
                cfg.moe = Some(crate::config::Moe {
                    experts: 5,
                    per_token: 2,
                    expert_ffn: 100,
                    norm_topk: false,
                    shared_ffn: if arch == Arch::Qwen2Moe { 60 } else { 0 },
                    sparse,
                });
            }
            if arch == Arch::Olmo2 {
                (cfg.norm_place, cfg.qk_norm_full) = (NormPlace::Post, true);
            }
            let plan = ShardPlan::new(&cfg, &Grid::new(1, 1, 0, 1).unwrap(), None).unwrap();
            if matches!(arch, Arch::Gemma2 | Arch::Gemma3) {
                cfg.local_layers = Some(vec![true, false]);
                (cfg.norm_plus_one, cfg.scale_embedding, cfg.norm_place) = (true, true, NormPlace::Sandwich);
                cfg.activation = crate::kernels::Activation::GeluTanh;
                // Gemma 3's local RoPE base, or Gemma 2's soft caps (small enough to bite).
                if arch == Arch::Gemma3 {
                    cfg.rope_local_theta = Some(10000.0);
                } else {
                    (cfg.attn_softcap, cfg.final_softcap) = (Some(1.0), Some(2.0));
                }
            }
            let shard = Shard::from_source(&Synthetic { dtype, seed: 3 }, cfg, plan.clone(), quant).unwrap();
            // Seq 0's hidden state after its decode step at position 290, in a step of `spans`
            // (tokens `toks`, seq 0's at `at`); with `ring`, its prompt prefilled 32 positions a
            // step, so that a window's layers keep their keys in rings of 10 pages, which its
            // 19 wrap around.
            let run_with =
                |ring: bool, threads: usize, spans: &[Span], toks: &[u32], at: usize| -> Vec<u32> {
                    let team = Team::new(threads).unwrap();
                    let chunk = if ring { 32 } else { 290 };
                    let mut kv = shard.new_kv(64, tables.len(), chunk, DType::F16);
                    assert_eq!(kv.ring_pages(), if ring && window.is_some() { 10 } else { 0 });
                    let ring_tables: Vec<Vec<u32>> = (0..tables.len())
                        .map(|i| {
                            let mut t = Vec::new();
                            kv.ring_table(i, tables[i].len(), &mut t);
                            t
                        })
                        .collect();
                    let mut s = Scratch::default();
                    let mut step = |spans: &[Span], tokens: &[u32]| {
                        let mut x = vec![0.0f32; tokens.len() * h];
                        shard.embed(tokens, spans, &mut x, &Single);
                        let long = vec![false; tables.len()];
                        shard.forward(
                            &mut x,
                            spans,
                            &mut kv,
                            &tables,
                            &ring_tables,
                            &long,
                            &mut s,
                            &Single,
                            &team,
                        );
                        x
                    };
                    let p0 = prompt(290, 11);
                    for (i, part) in p0.chunks(chunk).enumerate() {
                        step(&[span(0, i * chunk, part.len())], part);
                    }
                    step(&[span(1, 0, 20)], &prompt(20, 5));
                    step(&[span(2, 0, 3)], &prompt(3, 2));
                    let x = step(spans, toks);
                    x[at * h..(at + 1) * h].iter().map(|v| v.to_bits()).collect()
                };
            let run = |threads: usize, spans: &[Span], toks: &[u32], at: usize| {
                run_with(false, threads, spans, toks, at)
            };
            let alone = run(1, &[span(0, 290, 1)], &[16], 0);
            for threads in 1..=3 {
                let name = format!("{arch:?} {dtype:?} {quant:?} window {window:?}, {threads} threads");
                let batch = [span(1, 20, 1), span(0, 290, 1), span(2, 3, 1)];
                assert_eq!(run_with(true, threads, &batch, &[40, 16, 41], 1), alone, "rings, {name}");
                assert_eq!(run(threads, &[span(0, 290, 1)], &[16], 0), alone, "alone, {name}");
                let batch = [span(1, 20, 1), span(0, 290, 1), span(2, 3, 1)];
                assert_eq!(run(threads, &batch, &[40, 16, 41], 1), alone, "in a batch, {name}");
                let beside: Vec<u32> = std::iter::once(16).chain(prompt(20, 100)).collect();
                assert_eq!(
                    run(threads, &[span(0, 290, 1), span(3, 0, 20)], &beside, 0),
                    alone,
                    "beside a prompt, {name}"
                );
            }
        }
    }

    /// Routing against a plain sort of each token's softmax: the chosen experts and their
    /// weights (renormalized or not), and each expert's rows holding exactly its tokens.
    #[test]
    fn routing_chooses_the_largest_shares() {
        let (n, e, k) = (7, 9, 3);
        let logits: Vec<f32> = (0..n * e).map(|i| ((i * 37 % 101) as f32 - 50.0) / 13.0).collect();
        let mut rt = Routing::default();
        for norm in [false, true] {
            rt.route(&logits, n, e, k, norm);
            for t in 0..n {
                let lg = &logits[t * e..(t + 1) * e];
                let z: f64 = lg.iter().map(|&v| (v as f64).exp()).sum();
                let mut order: Vec<usize> = (0..e).collect();
                order.sort_by(|&a, &b| lg[b].total_cmp(&lg[a]));
                let mut want: Vec<(usize, f64)> =
                    order[..k].iter().map(|&x| (x, (lg[x] as f64).exp() / z)).collect();
                if norm {
                    let total: f64 = want.iter().map(|w| w.1).sum();
                    want.iter_mut().for_each(|w| w.1 /= total);
                }
                want.sort_by_key(|w| w.0);
                let got = &rt.choice[t * k..(t + 1) * k];
                for (g, w) in got.iter().zip(&want) {
                    assert_eq!(g.0, w.0, "token {t}");
                    assert!((g.1 as f64 - w.1).abs() < 1e-6, "token {t}: {} vs {}", g.1, w.1);
                }
                for (j, &(x, _)) in got.iter().enumerate() {
                    let row = rt.row[t * k + j];
                    assert!((rt.starts[x]..rt.starts[x + 1]).contains(&row) && rt.token[row] == t);
                }
            }
            assert_eq!(rt.starts[e], n * k);
        }
    }

    /// Known before loading, exactly what the loaded shard holds: uneven head and FFN splits, tied
    /// and untied heads, one or several stages, every dtype and int8, QKV biases (Qwen2), per-head
    /// norms (Qwen3), fused matrices (Phi-3), four norms a layer (Gemma 2 and 3), two output norms
    /// and whole-width q/k norms (OLMo 2) and mixtures of experts beside a dense layer (Qwen3-MoE's
    /// and Mixtral's tensor names).
    #[test]
    fn planned_bytes_are_the_loaded_bytes() {
        // Phi-3: a Llama shape read from fused q/k/v and gate/up tensors; Granite 4 from fused
        // gate/up (`shared_mlp`) tensors; GLM-4: Qwen2's with fused gate/up and four norms;
        // StarCoder 2: Qwen2's with LayerNorms, every bias and no gate; Phi: those, one norm a
        // layer and the head's bias; OLMo: LayerNorms without weights (nothing read, weights
        // and biases made); GraniteMoE: Mixtral's shape, each layer's experts read from
        // stacked tensors; Falcon: its names, q, k and v read head by head from one tensor;
        // GPT-NeoX: those with their bias, and every bias; GPT-2: learned positions (split by
        // rows), every matrix stored transposed, q, k and v one after another with their bias;
        // GPT-BigCode: those by KV group, as `nn.Linear`s.
        let shapes = [
            ("qwen2-0.5b", None),
            ("qwen3-0.6b", None),
            ("llama-3.2-1b", Some(Arch::Phi3)),
            ("llama-3.2-1b", Some(Arch::GraniteMoeHybrid)),
            ("qwen2-0.5b", Some(Arch::Glm4)),
            ("qwen2-0.5b", Some(Arch::Starcoder2)),
            ("qwen2-0.5b", Some(Arch::Phi)),
            ("llama-3.2-1b", Some(Arch::Falcon)),
            ("llama-3.2-1b", Some(Arch::GptNeoX)),
            ("gpt2-xl", None),
            ("starcoderbase-1b", None),
            ("llama-3.2-1b", Some(Arch::Olmo)),
            ("mixtral-8x7b", Some(Arch::GraniteMoe)),
            ("gemma2-2b", None),
            ("gemma3-1b", None),
            ("olmo2-1b", None),
            ("qwen1.5-moe-a2.7b", None),
            ("qwen3-30b-a3b", None),
            ("qwen3-30b-a3b", Some(Arch::Qwen3VlMoe)),
            ("mixtral-8x7b", None),
        ];
        for ((shape, arch), tied) in shapes.into_iter().flat_map(|s| [(s, true), (s, false)]) {
            let mut cfg = synthetic::shape(shape).unwrap();
            cfg.arch = arch.unwrap_or(cfg.arch);
            if cfg.arch == Arch::Glm4 {
                // Its four norms by their names, q/k/v biases beside fused gate/up rows.
                cfg.norm_place = NormPlace::Sandwich;
            }
            if matches!(cfg.arch, Arch::Starcoder2 | Arch::Phi) {
                // LayerNorms, biases on every projection, an FFN without a gate; Phi's one norm
                // a layer and its head's bias.
                (cfg.layer_norm, cfg.linear_bias, cfg.gated_ffn) = (true, true, false);
                (cfg.parallel_residual, cfg.head_bias) = (cfg.arch == Arch::Phi, cfg.arch == Arch::Phi);
            }
            if cfg.arch == Arch::GptNeoX {
                // A KV head per query head, q, k and v fused with their bias, every bias, no
                // gate, two norms of each layer's input.
                (cfg.layer_norm, cfg.gated_ffn, cfg.qkv_bias, cfg.linear_bias) = (true, false, true, true);
                (cfg.parallel_residual, cfg.parallel_ffn_norm) = (true, true);
            }
            if cfg.arch == Arch::Falcon {
                // Falcon-40B's: q, k and v fused by KV group, LayerNorms without biases
                // elsewhere, no gate, two norms of each layer's input.
                (cfg.layer_norm, cfg.gated_ffn, cfg.parallel_residual, cfg.parallel_ffn_norm) =
                    (true, false, true, true);
            }
            (cfg.hidden_size, cfg.head_dim, cfg.rotary_dim, cfg.n_heads, cfg.n_kv_heads) = (72, 8, 8, 9, 3);
            (cfg.intermediate_size, cfg.n_layers, cfg.vocab_size) = (100, 3, 1001);
            if let Some(moe) = &mut cfg.moe {
                // 5 experts of 40 columns (split 32 and 8 over two ranks), the middle layer
                // dense; Qwen2-MoE's shared expert of 56 (32 and 24).
                (moe.experts, moe.expert_ffn, moe.sparse) = (5, 40, vec![true, false, true]);
                moe.shared_ffn = moe.shared_ffn.min(56);
            }
            if cfg.arch == Arch::Olmo {
                (cfg.layer_norm, cfg.weightless_norms) = (true, true);
            }
            if cfg.learned_positions {
                cfg.max_position_embeddings = 100;
            }
            cfg.tie_word_embeddings = tied;
            for dtype in [DType::F32, DType::BF16, DType::F16] {
                let src = Synthetic { dtype, seed: 1 };
                for quant in [None, Some(Quant::Int8)] {
                    for (pp, tp) in [(1, 1), (1, 2), (3, 1), (2, 3)] {
                        for rank in 0..pp * tp {
                            let plan = ShardPlan::new(&cfg, &Grid::new(pp, tp, rank, pp * tp).unwrap(), None)
                                .unwrap();
                            let planned = Shard::planned_bytes(&src, &cfg, &plan, quant).unwrap();
                            let shard = Shard::from_source(&src, cfg.clone(), plan, quant).unwrap();
                            assert_eq!(
                                planned,
                                shard.weight_bytes(),
                                "{shape} tied {tied} {dtype:?} {quant:?} grid {pp}x{tp} rank {rank}"
                            );
                        }
                    }
                }
            }
        }
    }
}
