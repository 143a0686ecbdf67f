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

/// Two sides run step by step in one run (`RunOptions::sides`, `bench`'s comparisons): each
/// side's sequences get the tokens their own weights give alone, the steps alternate (the
/// readings between them are told whose step came before), each side's token times count its
/// own steps only, the profile is side 0's, and the engine holds its own weights after.
#[test]
fn two_sides_step_by_step_compute_as_each_alone() {
    use gridlm::engine::{OtherSide, Request, RunOptions};
    use gridlm::{config::ModelConfig, grid::Grid, grid::ShardPlan, model::Shard};
    use std::{cell::RefCell, rc::Rc};
    let (_t, dir) = tiny_llama();
    // The prompt logits of each side's first sequence (a step gives its first emitting span's).
    let request = |prompt: Vec<u32>, keep_logits: bool| greedy_request(prompt, 5, keep_logits);
    let requests =
        [request(vec![1, 5, 9], true), request(vec![2, 4, 6, 8], false), request(vec![1, 5, 9], true)];
    let alone = |quant: Option<Quant>, requests: &[Request]| {
        let mut e = local_engine(&dir, quant);
        let opts = RunOptions { max_batch: requests.len(), ..RunOptions::default() };
        let done = e.run(requests, &opts, &Single, &Single, |_, _| Ok(true)).unwrap();
        done.into_iter().map(|c| (c.token_ids, c.prompt_logits)).collect::<Vec<_>>()
    };
    // Side 0: int8, two sequences; side 1: the unquantized weights, one.
    let (int8, float) = (alone(Some(Quant::Int8), &requests[..2]), alone(None, &requests[2..]));
    assert_ne!(
        int8[0].1, float[0].1,
        "int8 and unquantized logits are the same: the test would not see a swap"
    );

    let mut engine = local_engine(&dir, Some(Quant::Int8));
    let cfg = ModelConfig::from_dir(&dir).unwrap();
    let plan = ShardPlan::new(&cfg, &Grid::single(), None).unwrap();
    let spare = engine.spare_weights(Shard::load(&dir, cfg, plan, None).unwrap(), 1).unwrap();
    assert!(engine.set_other_side(Some(OtherSide::Weights(Box::new(spare)))).is_none());
    let sides = Rc::new(RefCell::new(Vec::new()));
    let seen = sides.clone();
    engine.set_reader(Some(Box::new(move |_, side| seen.borrow_mut().push(side))));
    let opts = RunOptions { max_batch: 3, read_between_steps: true, sides: Some(2), ..RunOptions::default() };
    let (done, stats) = engine.run_with_stats(&requests, &opts, &Single, &Single, |_, _| Ok(true)).unwrap();
    let got: Vec<_> = done.iter().map(|c| (c.token_ids.clone(), c.prompt_logits.clone())).collect();
    assert_eq!((&got[..2], &got[2..]), (&int8[..], &float[..]));
    // Five steps a side (a prompt, then four tokens), side 0's first, in turn; a reading after
    // each but the last.
    assert_eq!(stats.steps, 10);
    assert_eq!(*sides.borrow(), [0, 1].repeat(5)[..9]);
    // Each side's clock: its tokens' times rise, and the two clocks together stay within the run.
    for c in &done {
        assert!(c.times_ms.windows(2).all(|w| w[0] < w[1]), "{:?}", c.times_ms);
    }
    let (t0, t1) = (done[0].times_ms[4], done[2].times_ms[4]);
    assert!(t0 + t1 <= stats.elapsed_ms * 1.0001, "{t0} + {t1} ms of {} ms", stats.elapsed_ms);
    // The profile counts side 0's four decode steps.
    assert_eq!(engine.profile().steps, 4);
    // Back to its own weights, and the spare handed back.
    let Some(OtherSide::Weights(spare)) = engine.set_other_side(None) else { panic!("no spare back") };
    assert_eq!((engine.shard.weight_dtype(), spare.shard().weight_dtype()), ("int8", "f32"));
    // A step of side 1 with no other side is an error, not a run on the wrong weights.
    let err = engine.run_with_stats(&requests, &opts, &Single, &Single, |_, _| Ok(true)).unwrap_err();
    assert!(err.to_string().contains("side 1"), "{err}");
}

/// Side by side on the engine's own weights under another many-token way (`bench
/// --compare-batch`) or one-token way (`bench --compare-prefetch`): the engine holds the way of
/// the side whose step ran last, and hands the other side's back when the other side is taken
/// away. (The process's way, which the kernels read, is not checked here: the tests of this
/// process set it at once.)
#[test]
fn two_sides_step_by_step_swap_the_prefetch_ways() {
    use gridlm::engine::{OtherSide, PrefetchBy};
    use gridlm::kernels::{Fetch, ManyFetch};
    let (_t, dir) = tiny_llama();
    let mut engine = local_engine(&dir, None);
    let own = engine.many_prefetch();
    let theirs = (if own.0 == ManyFetch::Nta { ManyFetch::L2 } else { ManyFetch::Nta }, PrefetchBy::Env);
    run_both_sides(&mut engine, OtherSide::ManyPrefetch(theirs));
    // Side 1's step ran last.
    assert_eq!(engine.many_prefetch(), theirs);
    let Some(OtherSide::ManyPrefetch(back)) = engine.set_other_side(None) else { panic!("no way back") };
    assert_eq!((engine.many_prefetch(), back), (own, theirs));
    let own = engine.prefetch();
    let theirs = (if own.0 == Fetch::Nta { Fetch::Far } else { Fetch::Nta }, PrefetchBy::Compared);
    run_both_sides(&mut engine, OtherSide::Prefetch(theirs));
    assert_eq!(engine.prefetch(), theirs);
    let Some(OtherSide::Prefetch(back)) = engine.set_other_side(None) else { panic!("no way back") };
    assert_eq!((engine.prefetch(), back), (own, theirs));
}

/// One prompt run on each side of `engine`, side 1 on `other`, step by step: on the same
/// weights, the same tokens on both sides.
fn run_both_sides(engine: &mut gridlm::engine::Engine, other: gridlm::engine::OtherSide) {
    assert!(engine.set_other_side(Some(other)).is_none());
    let request = greedy_request(vec![1, 5, 9], 3, false);
    let opts = gridlm::engine::RunOptions { max_batch: 2, sides: Some(1), ..Default::default() };
    let done = engine.run(&[request.clone(), request], &opts, &Single, &Single, |_, _| Ok(true)).unwrap();
    assert_eq!(done[0].token_ids, done[1].token_ids);
}
