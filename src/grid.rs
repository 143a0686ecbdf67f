//! The rank grid: world rank → (stage, tp rank), and which layers, heads, FFN columns and
//! vocabulary rows each rank holds. Pure arithmetic; knows nothing about MPI or weights.
//!
//! ```text
//! world ranks (pp=2, tp=2)          stage = rank / tp, tp_rank = rank % tp
//!   stage 0:  rank 0 (driver)  rank 1      embedding (vocab-split), layers [0, L/2)
//!               |  send/recv     |
//!   stage 1:  rank 2           rank 3      layers [L/2, L), final norm, lm_head (vocab-split)
//! ```

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use std::ops::Range;

/// FFN column ranges are multiples of this (the widest SIMD register in f32 lanes).
pub const FFN_ALIGN: usize = 16;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grid {
    pub pp: usize,
    pub tp: usize,
    pub rank: usize,
}

impl Grid {
    pub fn new(pp: usize, tp: usize, rank: usize, world_size: usize) -> Result<Self> {
        if pp == 0 || tp == 0 {
            return Err(Error::Input(format!("invalid grid --pp {pp} --tp {tp}: both must be at least 1")));
        }
        if pp * tp != world_size {
            return Err(Error::Input(format!(
                "invalid grid: --pp {pp} × --tp {tp} = {}, but the job has {}",
                crate::count(pp * tp, "rank"),
                crate::count(world_size, "rank")
            )));
        }
        Ok(Grid { pp, tp, rank })
    }
    pub fn single() -> Self {
        Grid { pp: 1, tp: 1, rank: 0 }
    }
    pub fn stage(&self) -> usize {
        self.rank / self.tp
    }
    pub fn tp_rank(&self) -> usize {
        self.rank % self.tp
    }
    pub fn is_first_stage(&self) -> bool {
        self.stage() == 0
    }
    pub fn is_last_stage(&self) -> bool {
        self.stage() + 1 == self.pp
    }
    /// World rank of (stage, tp_rank).
    pub fn rank_of(&self, stage: usize, tp_rank: usize) -> usize {
        stage * self.tp + tp_rank
    }
}

/// Part `i` of `n` items split into `parts` contiguous ranges as evenly as possible; the first
/// `n % parts` ranges get one more.
pub fn split_even(n: usize, parts: usize, i: usize) -> Range<usize> {
    let base = n / parts;
    let extra = n % parts;
    let start = i * base + i.min(extra);
    start..start + base + usize::from(i < extra)
}

/// Like [`split_even`] but in whole blocks of `align` (the last block may be short).
pub fn split_aligned(n: usize, parts: usize, i: usize, align: usize) -> Range<usize> {
    let blocks = split_even(n.div_ceil(align), parts, i);
    (blocks.start * align).min(n)..(blocks.end * align).min(n)
}

/// Vocabulary rows (of the embedding and lm_head) held by tp rank `t` of `tp`.
pub fn vocab_range(vocab_size: usize, tp: usize, t: usize) -> Range<usize> {
    split_aligned(vocab_size, tp, t, FFN_ALIGN)
}

/// Layers per stage so that every stage reads about the same weight bytes per decode step: the
/// last stage also reads the output head (`vocab × hidden`, often several layers' worth; a
/// sixth of SmolLM2), so it gets fewer layers, and the others share the rest evenly. A pipeline
/// runs at the pace of its slowest stage.
pub fn balanced_layers(cfg: &ModelConfig, pp: usize) -> Vec<usize> {
    let n = cfg.n_layers;
    if pp <= 1 {
        return vec![n];
    }
    let h = cfg.hidden_size as f64;
    // Of a mixture of experts, the router and the experts one token chooses.
    let ffn = (0..n).map(|i| cfg.ffn_params_per_token(i)).sum::<f64>() / n as f64;
    let layer = cfg.attention_params() + ffn;
    let head = cfg.vocab_size as f64 * h / layer;
    let share = (n as f64 + head) / pp as f64;
    let last = ((share - head).round().max(1.0) as usize).min(n - (pp - 1));
    let mut split: Vec<usize> = (0..pp - 1).map(|s| split_even(n - last, pp - 1, s).len()).collect();
    split.push(last);
    split
}

/// The query heads of tp rank `t` of `tp`, and the KV heads they read (GQA: a KV head may be
/// read by query heads on two ranks, and then lives on both).
pub fn heads_of(cfg: &ModelConfig, tp: usize, t: usize) -> (Range<usize>, Range<usize>) {
    let q_heads = split_even(cfg.n_heads, tp, t);
    let group = cfg.n_heads / cfg.n_kv_heads;
    let kv_heads = q_heads.start / group..(q_heads.end - 1) / group + 1;
    (q_heads, kv_heads)
}

/// Everything one rank holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardPlan {
    pub layers: Range<usize>,
    pub q_heads: Range<usize>,
    pub kv_heads: Range<usize>,
    pub ffn: Range<usize>,
    /// Columns of each expert's FFN (mixture-of-experts layers; empty for dense models), and
    /// of the shared expert (Qwen2-MoE's; empty without one).
    pub expert_ffn: Range<usize>,
    pub shared_ffn: Range<usize>,
    pub vocab: Range<usize>,
    /// Rows of the learned position embedding (GPT-2's `wpe`; empty for models without one),
    /// split over the tp ranks as the vocabulary is: each adds its own rows before the
    /// embedding's allreduce.
    pub positions: Range<usize>,
    pub first_stage: bool,
    pub last_stage: bool,
}

impl ShardPlan {
    /// `layer_split`: explicit layers per stage (must sum to the layer count), else
    /// [`balanced_layers`].
    pub fn new(cfg: &ModelConfig, grid: &Grid, layer_split: Option<&[usize]>) -> Result<Self> {
        if grid.tp > cfg.n_heads {
            return Err(Error::Input(format!(
                "invalid grid: --tp {} exceeds the model's {} attention heads",
                grid.tp, cfg.n_heads
            )));
        }
        if grid.pp > cfg.n_layers {
            return Err(Error::Input(format!(
                "invalid grid: --pp {} exceeds the model's {}",
                grid.pp,
                crate::count(cfg.n_layers, "layer")
            )));
        }
        // FFN columns and vocabulary rows are split in blocks of `FFN_ALIGN`: every tp rank
        // needs at least one of each (a rank with none would hold empty products).
        let (expert_ffn, shared_ffn) = cfg.moe.as_ref().map_or((0, 0), |m| (m.expert_ffn, m.shared_ffn));
        for (what, n) in [
            ("intermediate_size", cfg.intermediate_size),
            ("vocab_size", cfg.vocab_size),
            ("expert FFN size", expert_ffn),
            ("shared expert FFN size", shared_ffn),
        ] {
            if n == 0 {
                continue; // no experts
            }
            if n.div_ceil(FFN_ALIGN) < grid.tp {
                return Err(Error::Input(format!(
                    "invalid grid: --tp {} leaves a tp rank nothing of the model's {what} {n} \
                     (split in blocks of {FFN_ALIGN}, so at most {} tp ranks)",
                    grid.tp,
                    n.div_ceil(FFN_ALIGN)
                )));
            }
        }
        let stage = grid.stage();
        let split = match layer_split {
            Some(split) => {
                if split.len() != grid.pp || split.iter().sum::<usize>() != cfg.n_layers || split.contains(&0)
                {
                    return Err(Error::Input(format!(
                        "invalid --layers {split:?}: expected one positive count per pipeline stage ({} with --pp {}), summing to the model's {}",
                        grid.pp,
                        grid.pp,
                        crate::count(cfg.n_layers, "layer")
                    )));
                }
                split.to_vec()
            }
            None => balanced_layers(cfg, grid.pp),
        };
        let start: usize = split[..stage].iter().sum();
        let layers = start..start + split[stage];
        let t = grid.tp_rank();
        let (q_heads, kv_heads) = heads_of(cfg, grid.tp, t);
        Ok(ShardPlan {
            layers,
            q_heads,
            kv_heads,
            ffn: split_aligned(cfg.intermediate_size, grid.tp, t, FFN_ALIGN),
            expert_ffn: split_aligned(expert_ffn, grid.tp, t, FFN_ALIGN),
            shared_ffn: split_aligned(shared_ffn, grid.tp, t, FFN_ALIGN),
            vocab: vocab_range(cfg.vocab_size, grid.tp, t),
            positions: if cfg.learned_positions {
                split_even(cfg.max_position_embeddings, grid.tp, t)
            } else {
                0..0
            },
            first_stage: grid.is_first_stage(),
            last_stage: grid.is_last_stage(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layers_balance_the_output_head() {
        let mut cfg = crate::weights::synthetic::shape("smollm2-135m").unwrap();
        assert_eq!(balanced_layers(&cfg, 1), vec![30]);
        // The head is ~8 layers' worth: the last stage gets 8 fewer.
        assert_eq!(balanced_layers(&cfg, 2), vec![19, 11]);
        assert_eq!(balanced_layers(&cfg, 3), vec![13, 12, 5]);
        cfg.n_layers = 4;
        assert_eq!(balanced_layers(&cfg, 4), vec![1, 1, 1, 1]);
        assert_eq!(balanced_layers(&cfg, 2), vec![3, 1]);
        let big = crate::weights::synthetic::shape("llama-2-70b").unwrap();
        assert_eq!(balanced_layers(&big, 4), vec![20, 20, 20, 20]);
    }

    #[test]
    fn a_grid_that_does_not_fill_the_job_says_so() {
        let err = |pp, tp, world| Grid::new(pp, tp, 0, world).err().map(|e| e.to_string());
        assert!(err(2, 2, 4).is_none());
        let one = err(1, 2, 1).unwrap();
        assert!(one.contains("--pp 1 × --tp 2 = 2 ranks, but the job has 1 rank"), "{one}");
        let many = err(1, 1, 3).unwrap();
        assert!(many.contains("--pp 1 × --tp 1 = 1 rank, but the job has 3 ranks"), "{many}");
        assert!(err(0, 2, 2).unwrap().contains("both must be at least 1"));
    }

    #[test]
    fn even_and_uneven_splits() {
        assert_eq!(split_even(9, 2, 0), 0..5);
        assert_eq!(split_even(9, 2, 1), 5..9);
        assert_eq!(split_even(30, 3, 2), 20..30);
        assert_eq!(split_aligned(1536, 3, 2, 16), 1024..1536);
        assert_eq!(split_aligned(100, 2, 1, 16), 64..100);
        let covered: usize = (0..7).map(|i| split_aligned(49152, 7, i, 16).len()).sum();
        assert_eq!(covered, 49152);
    }

    #[test]
    fn kv_heads_follow_q_heads() {
        let cfg = crate::config::ModelConfig::from_json(
            std::path::Path::new("c"),
            r#"{"model_type":"llama","hidden_size":576,"intermediate_size":1536,"num_hidden_layers":30,
                "num_attention_heads":9,"num_key_value_heads":3,"vocab_size":49152}"#,
        )
        .unwrap();
        let p0 = ShardPlan::new(&cfg, &Grid::new(1, 2, 0, 2).unwrap(), None).unwrap();
        let p1 = ShardPlan::new(&cfg, &Grid::new(1, 2, 1, 2).unwrap(), None).unwrap();
        assert_eq!((p0.q_heads.clone(), p0.kv_heads.clone()), (0..5, 0..2));
        assert_eq!((p1.q_heads.clone(), p1.kv_heads.clone()), (5..9, 1..3));
        assert!(Grid::new(2, 2, 0, 3).is_err());
        assert!(ShardPlan::new(&cfg, &Grid::new(1, 10, 0, 10).unwrap(), None).is_err());
        // Every tp rank needs FFN columns and vocabulary rows (blocks of 16).
        let mut narrow = cfg.clone();
        narrow.intermediate_size = 32;
        assert!(ShardPlan::new(&narrow, &Grid::new(1, 2, 1, 2).unwrap(), None).is_ok());
        let e = ShardPlan::new(&narrow, &Grid::new(1, 3, 2, 3).unwrap(), None).unwrap_err();
        assert!(e.to_string().contains("intermediate_size 32"), "{e}");
        let mut small_vocab = cfg.clone();
        small_vocab.vocab_size = 40;
        assert!(ShardPlan::new(&small_vocab, &Grid::new(1, 4, 0, 4).unwrap(), None).is_err());
        let split = ShardPlan::new(&cfg, &Grid::new(2, 1, 1, 2).unwrap(), Some(&[16, 14])).unwrap();
        assert_eq!(split.layers, 16..30);
    }
}
