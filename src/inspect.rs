//! `gridlm inspect`: what a model folder holds and how a grid would split it, without reading a
//! weight. Owns: the summary of a config and the per-rank plan of a layout; every tensor a rank
//! would read is looked up in the safetensors headers (name, shape, dtype), as loading checks.

use crate::config::ModelConfig;
use crate::error::Result;
use crate::grid::{Grid, ShardPlan};
use crate::kernels::Quant;
use crate::model::{KvPool, Shard, PAGE};
use crate::weights::{DType, Source};
use serde::Serialize;
use std::ops::Range;

/// A model folder and one grid layout of it.
#[derive(Debug, Serialize)]
pub struct Inspection {
    pub model_type: &'static str,
    pub layers: usize,
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub vocab: usize,
    pub context: usize,
    /// The FFN in words: dense columns, or experts.
    pub ffn: String,
    /// Layers that attend through a window, and the widest window (see [`crate::model::KvCache`]).
    pub windowed_layers: usize,
    pub window: Option<usize>,
    /// Weights of the matrices (norms and biases left out), and those one token multiplies by
    /// (of a mixture of experts, the ones it chooses).
    pub params: f64,
    pub params_per_token: f64,
    /// The embedding's stored dtype, and the matrices' as they would be loaded.
    pub stored_dtype: &'static str,
    pub weight_dtype: &'static str,
    pub pp: usize,
    pub tp: usize,
    pub ranks: Vec<RankPlan>,
}

/// One rank's share of the model.
#[derive(Debug, Serialize)]
pub struct RankPlan {
    pub rank: usize,
    pub stage: usize,
    pub tp_rank: usize,
    pub layers: Range<usize>,
    pub q_heads: Range<usize>,
    pub kv_heads: Range<usize>,
    /// Columns of the dense FFN and of each expert this rank holds.
    pub ffn_columns: usize,
    pub expert_columns: usize,
    pub vocab: Range<usize>,
    /// Bytes of weights it would hold (as loading would count them).
    pub weight_bytes: usize,
    /// Bytes of keys and values one position takes on it, in an f16 KV cache.
    pub kv_bytes_per_position: usize,
    /// Of those, its windowed layers' (which a run whose pool holds more than a window and a
    /// step of each sequence keeps in rings instead).
    pub kv_windowed_bytes_per_position: usize,
}

/// The dtype `src` gives a folder's weights in (its embedding's): as stored, or as a
/// [`crate::weights::Cast`] converts them.
pub fn stored_dtype(src: &dyn Source, cfg: &ModelConfig) -> Result<DType> {
    src.dtype(crate::model::embed_name(cfg), &[cfg.vocab_size, cfg.hidden_size])
}

/// Inspects the model `cfg` whose tensors `src` holds on a `pp` × `tp` grid (`layers`: the
/// layers per stage, as `--layers`; `src` as loading reads the folder, whose weights are
/// `stored` in that dtype), its matrices quantized by `quant` if given.
pub fn inspect(
    src: &dyn Source,
    cfg: &ModelConfig,
    (pp, tp, layers): (usize, usize, Option<&[usize]>),
    (stored, quant): (DType, Option<Quant>),
) -> Result<Inspection> {
    let loaded = stored_dtype(src, cfg)?;
    let world = pp * tp;
    let mut ranks = Vec::with_capacity(world);
    for rank in 0..world {
        let grid = Grid::new(pp, tp, rank, world)?;
        let plan = ShardPlan::new(cfg, &grid, layers)?;
        let weight_bytes = Shard::planned_bytes(src, cfg, &plan, quant)?;
        let kv_of =
            |layers: usize| KvPool::page_bytes(layers, plan.kv_heads.len(), cfg.head_dim, DType::F16) / PAGE;
        let windowed = plan.layers.clone().filter(|&i| cfg.layer_window(i).is_some()).count();
        ranks.push(RankPlan {
            rank,
            stage: grid.stage(),
            tp_rank: grid.tp_rank(),
            layers: plan.layers.clone(),
            q_heads: plan.q_heads.clone(),
            kv_heads: plan.kv_heads.clone(),
            ffn_columns: plan.ffn.len(),
            expert_columns: plan.expert_ffn.len(),
            vocab: plan.vocab.clone(),
            weight_bytes,
            kv_bytes_per_position: kv_of(plan.layers.len()),
            kv_windowed_bytes_per_position: kv_of(windowed),
        });
    }
    let h = cfg.hidden_size as f64;
    let attention = cfg.attention_params();
    let vocab = cfg.vocab_size as f64 * h;
    // The embedding and the output head (one matrix where tied), and learned positions.
    let positions =
        if cfg.learned_positions { (cfg.max_position_embeddings * cfg.hidden_size) as f64 } else { 0.0 };
    let embeddings = if cfg.tie_word_embeddings { vocab } else { 2.0 * vocab } + positions;
    let layers_params =
        |ffn: &dyn Fn(usize) -> f64| (0..cfg.n_layers).map(|i| attention + ffn(i)).sum::<f64>();
    let ffn = match &cfg.moe {
        Some(m) => {
            let sparse = m.sparse.iter().filter(|&&s| s).count();
            let mut s = format!(
                "{} of {} experts a token, {} columns each, in {sparse} of {} layers",
                m.per_token, m.experts, m.expert_ffn, cfg.n_layers
            );
            if m.shared_ffn > 0 {
                s += &format!(", beside a shared expert of {}", m.shared_ffn);
            }
            if sparse < cfg.n_layers {
                s += &format!("; dense layers of {}", cfg.intermediate_size);
            }
            s
        }
        None => format!("dense, {} columns", cfg.intermediate_size),
    };
    Ok(Inspection {
        model_type: cfg.arch.name(),
        layers: cfg.n_layers,
        hidden: cfg.hidden_size,
        heads: cfg.n_heads,
        kv_heads: cfg.n_kv_heads,
        head_dim: cfg.head_dim,
        vocab: cfg.vocab_size,
        context: cfg.max_position_embeddings,
        ffn,
        windowed_layers: (0..cfg.n_layers).filter(|&i| cfg.layer_window(i).is_some()).count(),
        window: (0..cfg.n_layers).filter_map(|i| cfg.layer_window(i)).max(),
        params: layers_params(&|i| cfg.ffn_params(i)) + embeddings,
        params_per_token: layers_params(&|i| cfg.ffn_params_per_token(i)) + vocab,
        stored_dtype: stored.name(),
        weight_dtype: if quant.is_some() { "int8" } else { loaded.name() },
        pp,
        tp,
        ranks,
    })
}

/// The inspection as readable text: the model, then a table of the ranks.
pub fn table(x: &Inspection) -> String {
    let range = |r: &Range<usize>| format!("{}–{}", r.start, r.end.saturating_sub(1));
    let mut s = format!(
        "{}: {}, hidden {}, {} / {} of {}, vocabulary {}, context {}\n",
        x.model_type,
        crate::count(x.layers, "layer"),
        x.hidden,
        crate::count(x.heads, "head"),
        crate::count(x.kv_heads, "KV head"),
        x.head_dim,
        x.vocab,
        x.context
    );
    s += &format!("FFN: {}\n", x.ffn);
    if let Some(w) = x.window {
        s += &format!(
            "attention: {} of {} layers through a window of {w} positions (their keys in rings of a \
             window and a step a sequence, where a run's KV pool would give them more)\n",
            x.windowed_layers, x.layers
        );
    }
    s += &format!(
        "{:.1} M weights ({:.1} M a token), stored {}, loaded {}; grid {}x{}\n\n",
        x.params / 1e6,
        x.params_per_token / 1e6,
        x.stored_dtype,
        x.weight_dtype,
        x.pp,
        x.tp
    );
    s += "| rank | stage | tp | layers | q heads | KV heads | FFN cols | expert cols | vocab rows | weights (MB) | KV a position (KB, f16) |\n";
    s += "|---|---|---|---|---|---|---|---|---|---|---|\n";
    for r in &x.ranks {
        s += &format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.1} | {:.1} |\n",
            r.rank,
            r.stage,
            r.tp_rank,
            range(&r.layers),
            range(&r.q_heads),
            range(&r.kv_heads),
            r.ffn_columns,
            r.expert_columns,
            range(&r.vocab),
            r.weight_bytes as f64 / 1e6,
            r.kv_bytes_per_position as f64 / 1e3
        );
    }
    s
}
