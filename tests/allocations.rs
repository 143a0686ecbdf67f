//! Decoding allocates nothing per token: a run of the scheduler and engine over a small
//! synthetic model (SmolLM2's shape, Gemma's with local and global layers and soft caps, and
//! Qwen2-MoE's with a mixture of experts and a shared expert)
//! makes exactly as many heap allocations for 40 new tokens as for 4, greedy
//! and sampled, and a fresh engine's first run makes none in its decode steps; sampling rows
//! whose nucleus takes several rounds of candidates makes none either. (The `bench` tests check
//! the same per decode step on every rank of a grid.)
//!
//! One test in its own binary: the count is the whole process's, so no other test may run
//! beside it.

use gridlm::comm::Single;
use gridlm::engine::sampling::{self, Buffers, Draw, SamplingParams, TokenRules};
use gridlm::engine::{Engine, Request, RunOptions};
use gridlm::grid::{Grid, ShardPlan};
use gridlm::model::Shard;
use gridlm::weights::synthetic::{self, Synthetic};
use gridlm::weights::DType;

#[global_allocator]
static ALLOCATOR: gridlm::allocs::Counting = gridlm::allocs::Counting;

/// Allocations made by one run of `requests`, each asking for `new_tokens`, with up to
/// `speculate` drafts a step; and the drafts its steps checked.
fn allocations(
    engine: &mut Engine,
    requests: &[Request],
    new_tokens: usize,
    speculate: usize,
) -> (u64, usize) {
    let requests: Vec<Request> =
        requests.iter().map(|r| Request { max_tokens: new_tokens, ..r.clone() }).collect();
    let opts = RunOptions { max_batch: requests.len(), speculate, ..RunOptions::default() };
    let before = gridlm::allocs::count().expect("the counting allocator is installed");
    let (done, stats) = engine.run_with_stats(&requests, &opts, &Single, &Single, |_, _| Ok(true)).unwrap();
    let after = gridlm::allocs::count().unwrap();
    for c in &done {
        assert_eq!(c.token_ids.len(), new_tokens, "{:?}", c.error);
    }
    drop(done);
    (after - before, stats.drafted)
}

#[test]
fn decode_steps_allocate_nothing_per_token() {
    sampling_rounds_allocate_nothing();
    // SmolLM2's widths and uneven heads (9 query, 3 KV), two layers, a small vocabulary.
    let mut cfg = synthetic::shape("smollm2-135m").unwrap();
    cfg.n_layers = 2;
    cfg.vocab_size = 3000;
    cfg.max_position_embeddings = 256;
    decode_allocates_nothing("SmolLM2", &cfg, true);
    // Gemma 3's widths, a local layer (a window of 16, which the runs pass) before a global
    // one, so a step lays its attention out twice; with Gemma 2's soft caps as well.
    let mut cfg = synthetic::shape("gemma3-1b").unwrap();
    (cfg.n_layers, cfg.vocab_size, cfg.max_position_embeddings) = (2, 3000, 256);
    (cfg.sliding_window, cfg.local_layers) = (Some(16), Some(vec![true, false]));
    (cfg.attn_softcap, cfg.final_softcap) = (Some(50.0), Some(30.0));
    decode_allocates_nothing("Gemma", &cfg, true);
    // Qwen1.5-MoE-A2.7B's widths, a dense layer and a mixture of 8 of its experts, 2 a token,
    // beside its shared expert: a batch's tokens choose different experts from step to step,
    // each expert's product taking one, two or three of its rows.
    let mut cfg = synthetic::shape("qwen1.5-moe-a2.7b").unwrap();
    (cfg.n_layers, cfg.vocab_size, cfg.max_position_embeddings) = (2, 3000, 256);
    let moe = cfg.moe.as_mut().unwrap();
    (moe.experts, moe.per_token, moe.sparse) = (8, 2, vec![false, true]);
    // (Its random experts never repeat what came before, so nothing to draft from.)
    decode_allocates_nothing("Qwen2-MoE", &cfg, false);
}

/// [`decode_steps_allocate_nothing_per_token`] on the model `cfg` (named `model`), with a
/// case of drafting sequences (`--speculate 4`) where `drafting`.
fn decode_allocates_nothing(model: &str, cfg: &gridlm::config::ModelConfig, drafting: bool) {
    let new_engine = || {
        let grid = Grid::single();
        let plan = ShardPlan::new(cfg, &grid, None).unwrap();
        let src = Synthetic { dtype: DType::BF16, seed: 7 };
        let shard = Shard::from_source(&src, cfg.clone(), plan, None).unwrap();
        Engine::new(shard, grid, 2, DType::F16).unwrap()
    };
    let mut engine = new_engine();
    let request = |len: usize, params: SamplingParams| Request {
        prompt: (0..len as u32).map(|i| (i * 37 + 11) % 3000).collect(),
        max_tokens: 0,
        ignore_eos: true,
        params,
        keep_logits: len == 9,
        logprobs: None,
        prompt_logprobs: None,
        rules: TokenRules::default(),
        format: None,
        grammar: None,
        embed: None,
    };
    let sampled = |temperature, top_p, top_k, seed| SamplingParams {
        temperature,
        top_p,
        top_k,
        repetition_penalty: 1.1,
        seed,
        ..SamplingParams::default()
    };
    // A prompt of one run of tokens over and over, for drafts: each of its runs of two or three
    // tokens occurs before, and so do the model's own loops.
    let looping = |len: usize, params: SamplingParams| Request {
        prompt: (0..len as u32).map(|i| 100 + i % 5).collect(),
        ..request(len, params)
    };
    let plain = SamplingParams { temperature: 0.9, seed: 4, ..SamplingParams::default() };
    // Penalized: its rows after drafts count them among its tokens, and put the counts back.
    let counting =
        SamplingParams { frequency_penalty: 0.5, presence_penalty: 0.2, ..SamplingParams::default() };
    // Biased, and its stop token kept out of its first three tokens.
    let ruled = |len: usize, params: SamplingParams| Request {
        rules: TokenRules {
            min_tokens: 3,
            stop_token_ids: vec![7],
            logit_bias: vec![(5, -100.0), (2999, 3.0)],
        },
        ..request(len, params)
    };
    let cases = [
        ("greedy", vec![request(5, SamplingParams::default())], 0),
        (
            "token rules, batch 2",
            vec![ruled(5, SamplingParams::default()), ruled(7, sampled(0.8, 0.9, 0, 5))],
            0,
        ),
        // Its one step of prefill, the engine's first, feeds one token as a decode step does.
        ("greedy, a one-token prompt", vec![request(1, SamplingParams::default())], 0),
        ("greedy, batch 3", (0..3).map(|i| request(5 + 4 * i, SamplingParams::default())).collect(), 0),
        (
            "sampled, batch 3",
            vec![
                request(5, sampled(0.8, 0.9, 0, 1)),
                request(9, sampled(1.0, 1.0, 20, 2)),
                request(17, SamplingParams::default()),
            ],
            0,
        ),
        (
            "drafting, batch 4",
            vec![
                looping(23, SamplingParams::default()),
                looping(17, plain),
                looping(9, counting),
                request(9, sampled(0.8, 1.0, 0, 3)),
            ],
            4,
        ),
    ];
    for (name, requests, speculate) in cases.iter().filter(|c| drafting || c.2 == 0) {
        // A fresh engine's first run: its decode steps, from the first, allocate nothing. The
        // buffers they reuse are sized when the run begins: the attention tile states of a
        // lone sequence's rows (past position 32 its keys span two tiles, split between the
        // two threads, its three KV heads being fewer items than twice the threads), and
        // sampling's (the sampled rows of the third case).
        let name = format!("{model}, {name}");
        let mut fresh = new_engine();
        let (_, drafted) = allocations(&mut fresh, requests, 40, *speculate);
        let first = fresh.profile();
        if *speculate == 0 {
            assert!(first.steps >= 39, "{name}: {} decode steps", first.steps);
        } else {
            assert!(drafted > 0, "{name}: no draft");
        }
        assert_eq!(first.allocations, Some(0), "{name}: the first run's {} decode steps", first.steps);
        // Buffers grow to their size in the first run; the two counted runs then differ only
        // in the number of decode steps.
        allocations(&mut engine, requests, 40, *speculate);
        let short = allocations(&mut engine, requests, 4, *speculate).0;
        let long = allocations(&mut engine, requests, 40, *speculate).0;
        assert_eq!(
            long,
            short,
            "{name}: 36 more decode steps made {} more allocations",
            long as i64 - short as i64
        );
    }
}

/// Sampling rows whose nucleus takes several rounds (flat rows: 64 candidates a row, then 256,
/// 1024 and the whole shard, the last rounds in several collectives) allocates nothing once its
/// buffers are reserved for the run's rows, from the first step: a decode step whose rows first
/// need more candidates than the prompt's did does not grow them.
fn sampling_rounds_allocate_nothing() {
    let (rows, shard) = (4, 3000);
    let logits: Vec<f32> = (0..rows * shard).map(|i| (i % 7) as f32 * 0.01).collect();
    let params = SamplingParams { temperature: 1.0, top_p: 0.99, ..SamplingParams::default() };
    gridlm::allocs::count_this_thread();
    let mut b = Buffers::default();
    b.reserve(rows, 1, shard);
    let mut picked = vec![u32::MAX; rows];
    for index in 0..3 {
        let before = gridlm::allocs::count().expect("the counting allocator is installed");
        b.draws.clear();
        b.draws.extend((0..rows).map(|row| Draw { row, params: params.clone(), index }));
        sampling::sample_rows(&logits, shard, shard, 0, &mut b, &Single, &mut picked);
        let made = gridlm::allocs::count().unwrap() - before;
        assert_eq!(made, 0, "sampling {rows} flat rows, draw {index}");
        assert!(picked.iter().all(|&t| (t as usize) < shard), "{picked:?}");
    }
}
