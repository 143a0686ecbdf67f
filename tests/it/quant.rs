//! int8 weights (`--quant int8`) on the real model stay close to bf16.

use super::*;
use gridlm::comm::Single;
use gridlm::engine::GenerateOptions;
use gridlm::kernels::Quant;
use gridlm::tokenizer::Tokenizer;

/// bf16 generates 64 greedy tokens; int8, forced along the same text, picks the same top-1 at
/// ≥ 90% of those 64 positions. (Inputs at 255 levels on every path: 63 and 60 with `vpdpbusd`
/// on Zen 5, 63 and 61 with `maddubs` on Zen 3, where at 129 levels it gave 59 and 59.)
#[test]
fn int8_top1_agrees_with_bf16_over_64_positions() {
    let dir = smollm2("bf16");
    let tok = Tokenizer::from_dir(&dir).unwrap();
    let prompts = [
        "The history of the Roman Empire began when",
        "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    ];
    let opts =
        GenerateOptions { max_tokens: 64, ignore_eos: true, eos_ids: vec![], keep_prompt_logits: false };
    let mut bf16 = local_engine(&dir, None);
    let mut int8 = local_engine(&dir, Some(Quant::Int8));
    assert_eq!(int8.shard.weight_dtype(), "int8");
    for p in prompts {
        let ids = tok.encode(p, true).unwrap();
        let reference = bf16.generate(&ids, &opts, &Single, &Single, |_| Ok(())).unwrap().token_ids;
        assert_eq!(reference.len(), 64);
        let picks = int8.greedy_along(&ids, &reference, &Single, &Single).unwrap();
        assert_eq!(picks.len(), 64);
        let same = picks.iter().zip(&reference).filter(|(a, b)| a == b).count();
        let kernel = gridlm::kernels::dot::int8_path().name();
        eprintln!("{p:?}: int8 top-1 agrees with bf16 at {same}/64 positions ({kernel})");
        assert!(same * 10 >= 64 * 9, "int8 agrees with bf16 at only {same}/64 positions for {p:?}");
    }
}

/// Weights run in turn on one engine (`bench --compare-unquantized`): after a swap the engine
/// computes what a fresh engine on those weights computes, bit for bit, and after the swap
/// back what it computed before.
#[test]
fn swapped_weights_compute_as_their_own_engine() {
    use gridlm::{config::ModelConfig, grid::Grid, grid::ShardPlan, model::Shard};
    let (_t, dir) = tiny_llama();
    let opts = GenerateOptions { max_tokens: 6, ignore_eos: true, eos_ids: vec![], keep_prompt_logits: true };
    let prompt = [1u32, 5, 9, 13, 2];
    let run = |e: &mut gridlm::engine::Engine| {
        let g = e.generate(&prompt, &opts, &Single, &Single, |_| Ok(())).unwrap();
        (g.token_ids, g.prompt_logits.unwrap())
    };
    let float = run(&mut local_engine(&dir, None));
    let mut engine = local_engine(&dir, Some(Quant::Int8));
    let int8 = run(&mut engine);
    assert_ne!(int8.1, float.1, "int8 and unquantized logits are the same: the test would not see a swap");
    let cfg = ModelConfig::from_dir(&dir).unwrap();
    let plan = ShardPlan::new(&cfg, &Grid::single(), None).unwrap();
    let mut spare = engine.spare_weights(Shard::load(&dir, cfg, plan, None).unwrap(), 1).unwrap();
    // The tiny model's weights are stored in f32.
    assert_eq!(spare.shard().weight_dtype(), "f32");
    engine.swap_weights(&mut spare);
    assert_eq!((engine.shard.weight_dtype(), spare.shard().weight_dtype()), ("f32", "int8"));
    assert_eq!(run(&mut engine), float);
    engine.swap_weights(&mut spare);
    assert_eq!(run(&mut engine), int8);
}

/// Weights of other layers (another stage's) are not run in turn with an engine's own.
#[test]
fn spare_weights_must_be_the_same_layers() {
    use gridlm::{config::ModelConfig, grid::Grid, grid::ShardPlan, model::Shard};
    let (_t, dir) = tiny_llama();
    let engine = local_engine(&dir, Some(Quant::Int8));
    let cfg = ModelConfig::from_dir(&dir).unwrap();
    let grid = Grid::new(2, 1, 0, 2).unwrap();
    let plan = ShardPlan::new(&cfg, &grid, None).unwrap();
    let err = engine.spare_weights(Shard::load(&dir, cfg, plan, None).unwrap(), 1).err().unwrap();
    assert!(err.to_string().contains("same layers"), "{err}");
}
