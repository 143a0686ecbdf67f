//! `gridlm bench`: the documented JSON keys, on a synthetic shape and on a model folder, on one
//! rank and on a 2x1 grid. Values are checked for sense, never against a time limit; decode
//! steps must make no heap allocation on any rank.

use super::*;

const KEYS: &[&str] = &[
    "first_token_ms",
    "next_token_ms_p50",
    "next_token_ms_p90",
    "decode_tokens_per_s",
    "prefill_tokens_per_s",
    "weight_bytes_per_token",
    "kv_bytes_per_token",
    "achieved_gb_per_s",
    "measured_gb_per_s",
    "best_gb_per_s",
    "decode_efficiency",
    "prefill_gflops",
    "measured_peak_gflops",
    "prefill_efficiency",
    "ranks",
];

fn check(j: &serde_json::Value, ranks: usize) {
    for k in KEYS {
        assert!(j.get(k).is_some(), "missing {k} in {j}");
    }
    for k in &KEYS[..KEYS.len() - 1] {
        let v = j[k].as_f64().unwrap();
        assert!(v.is_finite() && v > 0.0, "{k} = {v}");
    }
    assert!(j["next_token_ms_p90"].as_f64() >= j["next_token_ms_p50"].as_f64());
    // The team's handoff: measured wherever a rank has more than one kernel thread.
    let handoff = j["handoff_us"].as_f64().unwrap();
    let threads = j["threads_per_rank"].as_u64().unwrap();
    assert!(
        handoff.is_finite() && (handoff > 0.0) == (threads > 1),
        "handoff {handoff} with {threads} threads"
    );
    assert_eq!(j["ranks"].as_array().unwrap().len(), ranks);
    // One entry per timed run, each with its own bandwidth; their mean rate and bandwidth are
    // the report's.
    let runs = j["runs"].as_array().unwrap();
    assert_eq!(runs.len() as u64, j["reps"].as_u64().unwrap(), "{j}");
    let f = |v: &serde_json::Value, k: &str| v[k].as_f64().unwrap();
    for r in runs {
        for k in ["decode_tokens_per_s", "measured_gb_per_s", "decode_efficiency"] {
            assert!(f(r, k).is_finite() && f(r, k) > 0.0, "{k} in {r}");
        }
        assert!((f(r, "handoff_us") > 0.0) == (threads > 1), "handoff_us in {r}");
        let bytes = f(j, "weight_bytes_per_token") + f(j, "kv_bytes_per_token");
        let achieved = bytes * f(r, "decode_tokens_per_s") / 1e9;
        assert!((achieved / f(r, "measured_gb_per_s") / f(r, "decode_efficiency") - 1.0).abs() < 1e-9, "{r}");
    }
    let mean = |k: &str| runs.iter().map(|r| f(r, k)).sum::<f64>() / runs.len() as f64;
    // The CPU time the host took, per run and in all (Linux says; whole clock ticks).
    for r in runs {
        assert!(f(r, "stolen_ms") >= 0.0, "stolen_ms in {r}");
        assert!((0.0..=1.0).contains(&f(r, "stolen_share")), "stolen_share in {r}");
    }
    let stolen = runs.iter().map(|r| f(r, "stolen_ms")).sum::<f64>();
    assert!((f(j, "stolen_ms") - stolen).abs() < 1e-6, "stolen_ms in {j}");
    for k in ["decode_tokens_per_s", "measured_gb_per_s"] {
        assert!((mean(k) / f(j, k) - 1.0).abs() < 1e-9, "{k}: {} vs {j}", mean(k));
    }
    // The bf16 dot-product peak where the bf16 kernels use `vdpbf16ps` (null elsewhere), and
    // prefill against it where the weights are bf16.
    let bf16_peak = j["measured_bf16_peak_gflops"].as_f64();
    let bf16_isa = gridlm::kernels::dot::detect() == gridlm::kernels::dot::Isa::Avx512Bf16;
    assert!(j.get("measured_bf16_peak_gflops").is_some() && bf16_peak.is_some() == bf16_isa, "{j}");
    match (bf16_peak, j["weight_dtype"].as_str()) {
        (Some(g), Some("bf16")) => {
            assert!(g > 0.0, "{j}");
            let e = f(j, "prefill_bf16_efficiency");
            assert!((e * g / f(j, "prefill_gflops") - 1.0).abs() < 1e-9, "{j}");
        }
        _ => assert!(j["prefill_bf16_efficiency"].is_null(), "{j}"),
    }
    // Every rep decodes the same prompts: one digest of the tokens, each run's the same.
    let digest = j["tokens_digest"].as_str().unwrap_or_else(|| panic!("no one tokens_digest in {j}"));
    assert!(digest.len() == 16 && digest.chars().all(|c| c.is_ascii_hexdigit()), "{digest}");
    assert!(runs.iter().all(|r| r["tokens_digest"] == digest), "{j}");
    // The last repetition's decode steps, whether or not runs came before it (buffers are
    // sized when a run begins): no heap allocation on any rank, kernel threads included.
    for r in j["ranks"].as_array().unwrap() {
        assert_eq!(r["allocations_per_step"].as_f64(), Some(0.0), "{r}");
        // Streams not timed nor named: the CPU's preferred way. A pick decided by one timing
        // kept the preferred way (one that would leave it is timed again), for the prefetch
        // and the streams alike.
        if r["streams_by"] == "default" || (r["streams_by"] == "timed" && r["streams_timings"] == 1) {
            assert_eq!(r["streams"], gridlm::kernels::dot::preferred_streams().name(), "{r}");
        }
        if r["prefetch_by"] == "timed" && r["prefetch_timings"] == 1 {
            assert_eq!(r["prefetch"], gridlm::kernels::dot::preferred_fetch().name(), "{r}");
        }
    }
}

#[test]
fn bench_synthetic_shape_one_rank() {
    let mut cmd = std::process::Command::new(bin());
    // The rank chooses its one-token prefetch and streams itself, unless told.
    cmd.env_remove("GRIDLM_PREFETCH").env_remove("GRIDLM_STREAMS").args([
        "bench",
        "--shape",
        "smollm2-135m",
        "--prompt-len",
        "8",
        "--new-tokens",
        "4",
        "--warmup",
        "0",
        "--reps",
        "2",
        "--bandwidth-mib",
        "64",
        "--json",
    ]);
    let (j, stderr) = bench_one_rank(cmd);
    // One rank, nothing overlaps: decode's bandwidth is read between its steps.
    assert_eq!(j["bandwidth_reads"], "between_steps", "{j}");
    // SmolLM2's ~210 MB of layers are past any cache: the prefetch was timed on them.
    let rank = &j["ranks"][0];
    assert_eq!(rank["prefetch_by"], "timed", "{rank}");
    assert!(["none", "near", "far", "nta", "page"].contains(&rank["prefetch"].as_str().unwrap()), "{rank}");
    // One timing of every way, or two where the first would have left `page`.
    assert!([1, 2].contains(&rank["prefetch_timings"].as_u64().unwrap()), "{rank}");
    // Which pieces the AVX2 kernels read in streams: timed where they run (the layers are
    // bf16), else not.
    let timed_streams = rank["isa"] == "avx2";
    let streams_by = if timed_streams { "timed" } else { "default" };
    assert_eq!(rank["streams_by"], streams_by, "{rank}");
    assert!(["long", "every"].contains(&rank["streams"].as_str().unwrap()), "{rank}");
    let timings = rank["streams_timings"].as_u64().unwrap();
    assert!(if timed_streams { [1, 2].contains(&timings) } else { timings == 0 }, "{rank}");
    // One token a step: the many-token prefetch is not timed.
    assert_eq!(
        (&rank["many_prefetch"], &rank["many_prefetch_by"], &rank["many_prefetch_timings"]),
        (&"l2".into(), &"default".into(), &0.into()),
        "{rank}"
    );
    // The kernels it ran: a SIMD path, and no int8 ones for bf16 weights.
    let isas = ["portable", "avx2", "avx512", "avx512bf16"];
    assert!(isas.contains(&rank["isa"].as_str().unwrap()), "{rank}");
    assert!(rank["int8_kernel"].is_null(), "{rank}");
    // bf16 SmolLM2: ~135M weights at 2 bytes, all read for each token.
    let bytes = j["weight_bytes_per_token"].as_f64().unwrap();
    assert!((2.5e8..2.9e8).contains(&bytes), "{bytes}");
    // Its keys and values in f16: 30 layers × 3 KV heads × 64 × 2 × 2 bytes a position, and
    // the decode steps of 4 new tokens after 8 see 10 positions on average.
    assert_eq!(j["kv_bytes_per_token"], 30 * 3 * 64 * 2 * 2 * 10, "{j}");
    assert_eq!(rank["kv_bytes_per_position"], 30 * 3 * 64 * 2 * 2, "{rank}");
    assert!(stderr.contains("bench: rep 2/2"), "progress lines");
}

/// A mixture of experts reads only the experts its tokens chose: one layer of Qwen3-30B-A3B's
/// shape (128 experts of 3 × 2048 × 768 bf16 weights, 8 a token) reads 8 experts a token at a
/// batch of 1 — all it holds but 120 experts and the embedding's unread rows — and a step of
/// four tokens between 8 and 32 of them (as counted in its steps).
#[test]
fn bench_reads_only_the_chosen_experts() {
    let expert = (3 * 2048 * 768 * 2) as f64;
    let embed_unread = ((151936 - 1) * 2048 * 2) as f64;
    let read = |batch: &str| {
        let mut cmd = std::process::Command::new(bin());
        let shape = ["bench", "--shape", "qwen3-30b-a3b", "--shape-layers", "1", "--batch", batch];
        let short = ["--prompt-len", "8", "--new-tokens", "4", "--warmup", "0", "--reps", "1"];
        cmd.args(shape).args(short).args(["--bandwidth-mib", "16", "--json"]);
        let (j, _) = bench_one_rank(cmd);
        let held = j["ranks"][0]["weight_bytes"].as_f64().unwrap();
        let step = j["weight_bytes_per_token"].as_f64().unwrap() * batch.parse::<f64>().unwrap();
        // Experts a step read (only experts' bytes change with the batch).
        128.0 - (held - embed_unread - step) / expert
    };
    assert_eq!(read("1"), 8.0);
    let four = read("4");
    assert!((8.0..=32.0).contains(&four), "{four} experts a step of 4 tokens");
}

/// A batch's decode steps on AVX512_BF16 go through the many-token bf16 kernel, whose prefetch
/// the rank then times on its own layers at the batch's tokens; elsewhere it is not timed.
#[test]
fn bench_times_the_many_token_prefetch_for_a_batch() {
    let mut cmd = std::process::Command::new(bin());
    cmd.env_remove("GRIDLM_MANY_PREFETCH").args(["bench", "--shape", "smollm2-135m", "--batch", "4"]);
    cmd.args(["--prompt-len", "4", "--new-tokens", "2", "--warmup", "0", "--reps", "1"]);
    cmd.args(["--bandwidth-mib", "64", "--json"]);
    let (j, _) = bench_one_rank(cmd);
    let rank = &j["ranks"][0];
    assert_many_prefetch(rank, "many_prefetch", 4);
}

/// `gridlm bench --json` of the tiny model on two stages of one thread each (`launch/local 2`),
/// with `args` after the common ones and `envs` set; checked by [`check`].
fn bench_two_stages(dir: &Path, args: &[&str], envs: &[(&str, &str)]) -> serde_json::Value {
    std::env::set_var("GRIDLM_BIN", bin());
    let mut cmd = gridlm_reference::launch_command(&["local", "2"]);
    cmd.args(["bench", "--model", path_str(dir), "--pp", "2", "--threads", "1", "--prompt-len", "5"])
        .args(["--warmup", "1", "--bandwidth-mib", "32", "--json"])
        .args(args);
    cmd.envs(envs.iter().copied());
    let out = gridlm_reference::run_with_timeout(cmd, 120);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    check(&j, 2);
    j
}

#[test]
fn bench_model_folder_on_two_stages() {
    let (_t, dir) = tiny_llama();
    let args = ["--new-tokens", "4", "--reps", "1", "--batch", "3", "--quant", "int8", "--kv-dtype", "bf16"];
    let env = [("GRIDLM_PREFETCH", "far"), ("GRIDLM_MANY_PREFETCH", "nta"), ("GRIDLM_STREAMS", "every")];
    let j = bench_two_stages(&dir, &args, &env);
    assert_eq!(j["pp"], 2);
    assert_eq!(j["batch"], 3);
    assert_eq!(j["weight_dtype"], "int8");
    assert_eq!(j["kv_dtype"], "bf16");
    // Every rank prefetches as it was told.
    for r in j["ranks"].as_array().unwrap() {
        assert_eq!((&r["prefetch"], &r["prefetch_by"]), (&"far".into(), &"GRIDLM_PREFETCH".into()), "{r}");
        let many = (&r["many_prefetch"], &r["many_prefetch_by"]);
        assert_eq!(many, (&"nta".into(), &"GRIDLM_MANY_PREFETCH".into()), "{r}");
        assert_eq!((&r["streams"], &r["streams_by"]), (&"every".into(), &"GRIDLM_STREAMS".into()), "{r}");
        // Named, not timed.
        assert_eq!((&r["prefetch_timings"], &r["many_prefetch_timings"]), (&0.into(), &0.into()), "{r}");
        assert_eq!(r["streams_timings"], 0, "{r}");
        let int8 = ["portable", "maddubs", "avx-vnni", "avx512-vnni"];
        assert!(int8.contains(&r["int8_kernel"].as_str().unwrap_or("none")), "{r}");
    }
    // Two stages: two micro-batches in flight by default.
    assert_eq!(j["micro_batches"], 2);
    assert_eq!(j["overlap"], true);
    // Overlapping steps leave no moment between them: the bandwidth is read around the runs.
    assert_eq!(j["bandwidth_reads"], "around_runs", "{j}");
    // Bytes per generated token: each micro-batch's step reads the weights once, shared by
    // its sequences.
    let per_step: f64 =
        j["ranks"].as_array().unwrap().iter().map(|r| r["bytes_per_token"].as_f64().unwrap()).sum();
    let per_token = j["weight_bytes_per_token"].as_f64().unwrap();
    assert!((per_token * 3.0 - 2.0 * per_step).abs() <= 3.0, "{per_token} x 3 vs 2 x {per_step}");
}

/// `--dtype` with `--model`: the checkpoint's matrices converted at load, so a folder stored in
/// f32 is measured in bf16 and f16 as well.
#[test]
fn bench_converts_a_model_folder_to_the_dtype_asked_for() {
    let (_t, dir) = tiny_llama();
    let bench = |dtype: Option<&str>| {
        let mut cmd = std::process::Command::new(bin());
        cmd.args(["bench", "--model", path_str(&dir), "--prompt-len", "4", "--new-tokens", "2"]);
        cmd.args(["--warmup", "0", "--reps", "1", "--bandwidth-mib", "32", "--json"]);
        cmd.args(dtype.map(|d| vec!["--dtype", d]).unwrap_or_default());
        bench_one_rank(cmd).0
    };
    let stored = bench(None);
    assert_eq!(stored["weight_dtype"], "f32", "{stored}");
    let f32_bytes = stored["weight_bytes_per_token"].as_f64().unwrap();
    for dtype in ["bf16", "f16"] {
        let j = bench(Some(dtype));
        assert_eq!(j["weight_dtype"], dtype, "{j}");
        // Half the bytes, less the norms' (f32 whatever the matrices' dtype).
        let ratio = f32_bytes / j["weight_bytes_per_token"].as_f64().unwrap();
        assert!((1.95..2.0).contains(&ratio), "{ratio}: {j}");
    }
}

#[test]
fn bench_rejects_unknown_shape() {
    let out = gridlm(&["bench", "--shape", "gpt-5"]);
    assert_one_line_error(&out, &["unknown --shape `gpt-5`", "llama-3-8b"]);
}

/// A run whose new tokens would not fit in the context is refused, not cut short.
#[test]
fn bench_rejects_new_tokens_beyond_the_context() {
    // smollm2-135m's context is 8192 positions.
    let out = gridlm(&["bench", "--shape", "smollm2-135m", "--prompt-len", "8180", "--new-tokens", "64"]);
    assert_one_line_error(&out, &["--prompt-len 8180 + --new-tokens 64 = 8244 positions", "holds 8192"]);
}

#[test]
fn bench_rejects_an_empty_bandwidth_buffer() {
    let out = gridlm(&["bench", "--limits", "--bandwidth-mib", "0"]);
    assert_one_line_error(&out, &["--bandwidth-mib", "1..=1048576"]);
}

/// `RunOptions::read_between_steps`: every rank's reader runs after each step while work is
/// left, with the rank's kernel team, and its time is left out of the run's clock.
#[test]
fn readers_run_between_steps_off_the_clock() {
    use gridlm::comm::Single;
    use gridlm::engine::RunOptions;
    use std::{cell::Cell, rc::Rc, time::Duration, time::Instant};
    let (_t, dir) = tiny_llama();
    let mut engine = local_engine(&dir, None);
    let calls = Rc::new(Cell::new(0));
    let seen = calls.clone();
    engine.set_reader(Some(Box::new(move |team, side| {
        assert_eq!((team.threads(), side), (2, 0));
        seen.set(seen.get() + 1);
        std::thread::sleep(Duration::from_millis(100));
    })));
    let request = greedy_request(vec![1, 2, 3], 5, false);
    let mut opts = RunOptions { max_batch: 1, read_between_steps: true, ..RunOptions::default() };
    let t = Instant::now();
    let (done, stats) = engine
        .run_with_stats(std::slice::from_ref(&request), &opts, &Single, &Single, |_, _| Ok(true))
        .unwrap();
    let wall_ms = t.elapsed().as_secs_f64() * 1e3;
    // Five steps (the prompt, then four single tokens): a reading after each but the last.
    assert_eq!(calls.get(), 4);
    assert_eq!(done[0].token_ids.len(), 5);
    // Their 400 ms and more are on neither the run's clock nor its tokens'.
    assert!(wall_ms - stats.elapsed_ms >= 400.0, "{wall_ms} ms in all, {} on the clock", stats.elapsed_ms);
    let times = &done[0].times_ms;
    assert!(times.windows(2).all(|w| w[0] <= w[1]) && times[4] <= stats.elapsed_ms, "{times:?}");
    // The same tokens as a run without readings, which calls no reader.
    opts.read_between_steps = false;
    let plain = engine.run(&[request], &opts, &Single, &Single, |_, _| Ok(true)).unwrap();
    assert_eq!(plain[0].token_ids, done[0].token_ids);
    assert_eq!(calls.get(), 4);
}

/// Between-step readings on a pipeline without overlap: every rank reads at each `Read` plan
/// passed down the stages, and each run has its own bandwidth.
#[test]
fn bench_reads_between_steps_on_two_stages() {
    let (_t, dir) = tiny_llama();
    let j = bench_two_stages(&dir, &["--new-tokens", "6", "--reps", "2", "--no-overlap"], &[]);
    assert_eq!((&j["overlap"], &j["bandwidth_reads"]), (&false.into(), &"between_steps".into()), "{j}");
}

/// `--compare-unquantized`: the same weights unquantized, run in turn with the int8 ones rep by
/// rep (which goes first alternating), each reported with its own runs, and the speed-up from
/// their rates.
#[test]
fn bench_compares_int8_with_the_unquantized_weights_in_turn() {
    let common = ["bench", "--shape", "smollm2-135m", "--quant", "int8", "--compare-unquantized"];
    let mut cmd = std::process::Command::new(bin());
    cmd.args(common).args(["--prompt-len", "8", "--new-tokens", "4", "--warmup", "1", "--reps", "3"]);
    cmd.args(["--bandwidth-mib", "64", "--json"]);
    let (j, stderr) = bench_one_rank(cmd);
    // The report and the rank's figures are the int8 weights'.
    assert_eq!(j["weight_dtype"], "int8");
    assert!(!j["ranks"][0]["int8_kernel"].is_null(), "{j}");
    let u = &j["baseline"];
    assert_eq!((&u["weight_dtype"], &u["batch"]), (&"bf16".into(), &1.into()), "{u}");
    let f = |v: &serde_json::Value, k: &str| v[k].as_f64().unwrap();
    // bf16 reads twice int8's bytes, less int8's scale per row.
    let ratio = f(u, "weight_bytes_per_token") / f(&j, "weight_bytes_per_token");
    assert!((1.9..2.0).contains(&ratio), "{ratio}");
    let (quantized, unquantized) = (j["runs"].as_array().unwrap(), u["runs"].as_array().unwrap());
    assert_eq!((quantized.len(), unquantized.len()), (3, 3));
    let bytes = f(u, "weight_bytes_per_token") + f(&j, "kv_bytes_per_token");
    for r in unquantized {
        let achieved = bytes * f(r, "decode_tokens_per_s") / 1e9;
        assert!((achieved / f(r, "measured_gb_per_s") / f(r, "decode_efficiency") - 1.0).abs() < 1e-9, "{r}");
    }
    let mean =
        |runs: &[serde_json::Value], k: &str| runs.iter().map(|r| f(r, k)).sum::<f64>() / runs.len() as f64;
    for k in ["decode_tokens_per_s", "measured_gb_per_s"] {
        assert!((mean(unquantized, k) / f(u, k) - 1.0).abs() < 1e-9, "{k} in {u}");
    }
    let close = |a: f64, b: f64| (a / b - 1.0).abs() < 1e-9;
    let tps = "decode_tokens_per_s";
    assert!(close(f(u, "speedup"), f(&j, tps) / f(u, tps)), "{u}");
    let same_reads = f(u, "speedup") * f(u, "measured_gb_per_s") / f(&j, "measured_gb_per_s");
    assert!(close(f(u, "speedup_at_same_reads"), same_reads), "{u}");
    let by_rep = u["speedup_by_rep"].as_array().unwrap();
    assert_eq!(by_rep.len(), 3);
    for k in 0..3 {
        assert!(close(by_rep[k].as_f64().unwrap(), f(&quantized[k], tps) / f(&unquantized[k], tps)), "{u}");
    }
    // The runs in order: one run of both weights at each warm-up and rep, step by step, each
    // side's figures on its own line.
    assert_eq!(u["alternated"], "steps", "{u}");
    let labels = progress_labels(&stderr);
    let (int8, bf16) = ("(int8, step by step with bf16)", "(bf16, step by step with int8)");
    let runs = ["warm-up 1/1", "rep 1/3", "rep 2/3", "rep 3/3"];
    let expected: Vec<String> =
        runs.iter().flat_map(|r| [format!("{r} {int8}"), format!("{r} {bf16}")]).collect();
    assert_eq!(labels, expected, "{stderr}");
    // The table gives the baseline's rows.
    let mut cmd = std::process::Command::new(bin());
    cmd.args(common).args(["--prompt-len", "8", "--new-tokens", "4", "--warmup", "0", "--reps", "1"]);
    cmd.args(["--bandwidth-mib", "64"]);
    let out = gridlm_reference::run_with_timeout(cmd, 600);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let table = String::from_utf8_lossy(&out.stdout);
    for row in ["baseline: bf16 weights", "speed-up", "at the same reads"] {
        assert!(table.contains(row), "no {row:?} in {table}");
    }
}

/// `--compare-batch`: another batch size run in turn with `--batch` on the same weights, rep by
/// rep, each with its own bytes per token (a step's weights shared by its sequences): step by
/// step in one run where each side is one micro-batch, else whole runs in turn.
#[test]
fn bench_compares_a_batch_with_another_in_turn() {
    let bench = |more: &[&str]| {
        let mut cmd = std::process::Command::new(bin());
        cmd.args(["bench", "--shape", "smollm2-135m", "--batch", "3", "--compare-batch", "1"]);
        cmd.args(["--prompt-len", "8", "--new-tokens", "4", "--warmup", "0", "--reps", "2"]);
        cmd.args(["--bandwidth-mib", "64", "--json"]).args(more);
        bench_one_rank(cmd)
    };
    // Two micro-batches of the batch of 3: whole runs in turn, which goes first alternating.
    let (j, stderr) = bench(&["--micro-batches", "2"]);
    assert_eq!((&j["micro_batches"], &j["baseline"]["alternated"]), (&2.into(), &"runs".into()), "{j}");
    let labels = progress_labels(&stderr);
    let expected = ["rep 1/2 (batch 1)", "rep 1/2 (batch 3)", "rep 2/2 (batch 3)", "rep 2/2 (batch 1)"];
    assert_eq!(labels, expected, "{stderr}");
    assert_eq!(j["baseline"]["runs"].as_array().unwrap().len(), 2, "{j}");
    // One micro-batch each: step by step.
    let (j, stderr) = bench(&[]);
    let b = &j["baseline"];
    assert_eq!((&b["weight_dtype"], &b["batch"], &j["batch"]), (&"bf16".into(), &1.into(), &3.into()), "{b}");
    let f = |v: &serde_json::Value, k: &str| v[k].as_f64().unwrap();
    // One sequence a step reads all the weights for its token; three share them.
    let per_token = f(b, "weight_bytes_per_token") / f(&j, "weight_bytes_per_token");
    assert!((per_token - 3.0).abs() < 1e-6, "{per_token}");
    let tps = "decode_tokens_per_s";
    let close = |a: f64, b: f64| (a / b - 1.0).abs() < 1e-9;
    assert!(close(f(b, "speedup"), f(&j, tps) / f(b, tps)), "{b}");
    assert_eq!(b["runs"].as_array().unwrap().len(), 2, "{b}");
    assert_eq!(b["alternated"], "steps", "{b}");
    let labels = progress_labels(&stderr);
    let expected = [
        "rep 1/2 (batch 3, step by step with batch 1)",
        "rep 1/2 (batch 1, step by step with batch 3)",
        "rep 2/2 (batch 3, step by step with batch 1)",
        "rep 2/2 (batch 1, step by step with batch 3)",
    ];
    assert_eq!(labels, expected, "{stderr}");
    // Each side's many-token way picked at its own tokens a step: the batch of 3 timed where
    // its kernel runs, the baseline's one token not.
    let rank = &j["ranks"][0];
    assert_many_prefetch(rank, "many_prefetch", 3);
    assert_many_prefetch(rank, "baseline_many_prefetch", 1);
}

/// `--compare-prefetch`: the one-token products under another prefetch way, step by step with
/// the rank's own on the same weights and batch. No way changes a result, so both sides give
/// the same tokens; every rank reports both ways, on one rank and on two of a stage (tp);
/// a batch decoded many tokens a step, which the one-token way does not touch, is refused.
#[test]
fn bench_compares_one_token_prefetch_ways_step_by_step() {
    let (_t, dir) = tiny_llama();
    let mut cmd = std::process::Command::new(bin());
    // The rank's own way named, so the labels are known.
    cmd.env("GRIDLM_PREFETCH", "near").args(["bench", "--shape", "smollm2-135m"]);
    cmd.args(["--compare-prefetch", "none", "--prompt-len", "8", "--new-tokens", "4"]);
    cmd.args(["--warmup", "0", "--reps", "2", "--bandwidth-mib", "64", "--json"]);
    let (j, stderr) = bench_one_rank(cmd);
    let b = &j["baseline"];
    assert_eq!((&b["prefetch"], &b["batch"], &b["alternated"]), (&"none".into(), &1.into(), &"steps".into()));
    assert_eq!(b["tokens_digest"], j["tokens_digest"], "{j}");
    assert!(!j["tokens_digest"].is_null(), "{j}");
    let rank = &j["ranks"][0];
    assert_eq!((&rank["prefetch"], &rank["prefetch_by"]), (&"near".into(), &"GRIDLM_PREFETCH".into()));
    let base = (&rank["baseline_prefetch"], &rank["baseline_prefetch_by"]);
    assert_eq!(base, (&"none".into(), &"--compare-prefetch".into()), "{rank}");
    let f = |v: &serde_json::Value, k: &str| v[k].as_f64().unwrap();
    let tps = "decode_tokens_per_s";
    assert!((f(b, "speedup") / (f(&j, tps) / f(b, tps)) - 1.0).abs() < 1e-9, "{b}");
    // The same weights: the same bytes a token on both sides.
    assert_eq!(b["weight_bytes_per_token"], j["weight_bytes_per_token"], "{j}");
    let labels = progress_labels(&stderr);
    let expected = [
        "rep 1/2 (prefetch near, step by step with prefetch none)",
        "rep 1/2 (prefetch none, step by step with prefetch near)",
        "rep 2/2 (prefetch near, step by step with prefetch none)",
        "rep 2/2 (prefetch none, step by step with prefetch near)",
    ];
    assert_eq!(labels, expected, "{stderr}");
    // Without a comparison there is no baseline's way.
    let mut cmd = std::process::Command::new(bin());
    cmd.args(["bench", "--model", path_str(&dir), "--prompt-len", "4", "--new-tokens", "2"]);
    cmd.args(["--warmup", "0", "--reps", "1", "--bandwidth-mib", "32", "--json"]);
    let rank = &bench_one_rank(cmd).0["ranks"][0];
    assert!(["baseline_prefetch", "baseline_prefetch_by"].iter().all(|k| rank[k].is_null()), "{rank}");
    // Two ranks of a stage: each reports its own way and the baseline's.
    one_token_comparison_on_two_ranks(&dir, ("--compare-prefetch", "prefetch"), "far");
}

/// `bench` with a one-token comparison (`option`, whose table row names the baseline `what
/// way`) on two ranks of a stage: one table row says what the baseline ran under, each rank's
/// row names the baseline's way and what decided it, and both sides' digests are the same.
fn one_token_comparison_on_two_ranks(dir: &Path, (option, what): (&str, &str), way: &str) {
    std::env::set_var("GRIDLM_BIN", bin());
    let mut cmd = gridlm_reference::launch_command(&["local", "2"]);
    cmd.args(["bench", "--model", path_str(dir), "--tp", "2", "--threads", "1", "--prompt-len", "5"]);
    cmd.args(["--new-tokens", "4", "--warmup", "0", "--reps", "1", "--bandwidth-mib", "32"]);
    cmd.args([option, way]);
    let out = gridlm_reference::run_with_timeout(cmd, 120);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(table.contains(&format!("baseline: {what} {way}")), "{table}");
    assert_eq!(table.matches(&format!("the baseline's {way} ({option})")).count(), 2, "{table}");
    // The digests of both sides, in the table: the same.
    let digests: Vec<&str> =
        table.lines().filter_map(|l| l.split("digest ").nth(1)?.split(' ').next()).collect();
    assert_eq!(digests.len(), 2, "{table}");
    assert_eq!(digests[0], digests[1], "{table}");
}

/// `--compare-streams`: the one-token products with the other choice of which pieces the AVX2
/// kernels read in three streams, step by step with the rank's own. No choice changes a result,
/// so both sides give the same tokens; every rank reports both, on one rank and on two of a
/// stage (tp). (Where no AVX2 kernel runs, both sides read alike and still report so.)
#[test]
fn bench_compares_one_token_streams_step_by_step() {
    let (_t, dir) = tiny_llama();
    let mut cmd = std::process::Command::new(bin());
    // The rank's own choice named, so the labels are known.
    cmd.env("GRIDLM_STREAMS", "every").args(["bench", "--model", path_str(&dir)]);
    cmd.args(["--compare-streams", "long", "--prompt-len", "6", "--new-tokens", "4"]);
    cmd.args(["--warmup", "0", "--reps", "2", "--bandwidth-mib", "32", "--json"]);
    let (j, stderr) = bench_one_rank(cmd);
    let b = &j["baseline"];
    let ran = (&b["streams"], &b["prefetch"], &b["batch"], &b["alternated"]);
    assert_eq!(ran, (&"long".into(), &serde_json::Value::Null, &1.into(), &"steps".into()), "{b}");
    assert_eq!(b["tokens_digest"], j["tokens_digest"], "{j}");
    assert!(!j["tokens_digest"].is_null(), "{j}");
    assert_eq!(b["weight_bytes_per_token"], j["weight_bytes_per_token"], "{j}");
    let rank = &j["ranks"][0];
    assert_eq!(
        (&rank["streams"], &rank["streams_by"]),
        (&"every".into(), &"GRIDLM_STREAMS".into()),
        "{rank}"
    );
    let base = (&rank["baseline_streams"], &rank["baseline_streams_by"]);
    assert_eq!(base, (&"long".into(), &"--compare-streams".into()), "{rank}");
    assert!(rank["baseline_prefetch"].is_null(), "{rank}");
    let labels = progress_labels(&stderr);
    let expected = [
        "rep 1/2 (streams every, step by step with streams long)",
        "rep 1/2 (streams long, step by step with streams every)",
        "rep 2/2 (streams every, step by step with streams long)",
        "rep 2/2 (streams long, step by step with streams every)",
    ];
    assert_eq!(labels, expected, "{stderr}");
    // Two ranks of a stage, the choice timed or defaulted: each reports the baseline's.
    one_token_comparison_on_two_ranks(&dir, ("--compare-streams", "streams"), "every");
}

/// A comparison run step by step gives each side the tokens that side gives run alone, on one
/// rank and on grids: under tensor parallelism every rank of the stage must switch to the step's
/// side (a rank left on the other weights would add int8 partial sums to unquantized ones), and
/// across stages every stage must (`--micro-batches 1` keeps two stages step by step). The
/// tokens are compared by the reports' digests.
#[test]
fn a_comparison_step_by_step_gives_each_side_its_own_tokens_on_a_grid() {
    // SmolLM2, whose int8 and bf16 tokens part within a few (the tiny model's do not).
    let dir = smollm2("bf16");
    let layouts: [&[&str]; 3] = [&[], &["--tp", "2"], &["--pp", "2", "--micro-batches", "1"]];
    for layout in layouts {
        let ranks = if layout.is_empty() { 1 } else { 2 };
        let bench = |more: &[&str]| {
            let mut cmd = gridlm_reference::launch_command(if ranks == 1 { &[] } else { &["local", "2"] });
            cmd.args(["bench", "--model", path_str(&dir), "--prompt-len", "5", "--new-tokens", "16"]);
            cmd.args(["--batch", "2", "--warmup", "0", "--reps", "2", "--bandwidth-mib", "32", "--json"]);
            cmd.args(["--threads", if ranks == 1 { "2" } else { "1" }]).args(layout).args(more);
            let out = gridlm_reference::run_with_timeout(cmd, 300);
            assert!(out.status.success(), "{layout:?} {more:?}: {}", String::from_utf8_lossy(&out.stderr));
            let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
            check(&j, ranks);
            j
        };
        let both = bench(&["--quant", "int8", "--compare-unquantized"]);
        let b = &both["baseline"];
        assert_eq!(
            (&b["alternated"], &b["weight_dtype"]),
            (&"steps".into(), &"bf16".into()),
            "{layout:?}: {b}"
        );
        let int8 = bench(&["--quant", "int8"]);
        let float = bench(&[]);
        assert_ne!(
            int8["tokens_digest"], float["tokens_digest"],
            "{layout:?}: int8 and bf16 weights gave the same tokens: the test would not see a side mixed up"
        );
        assert_eq!(both["tokens_digest"], int8["tokens_digest"], "{layout:?}: the int8 side");
        assert_eq!(b["tokens_digest"], float["tokens_digest"], "{layout:?}: the bf16 side");
    }
}

/// The other way round: the baseline is the batch, and its many-token way is timed for it
/// (where its kernel runs), not left as the main side's one token a step has it.
#[test]
fn bench_picks_the_baseline_batch_its_own_many_token_prefetch() {
    let mut cmd = std::process::Command::new(bin());
    cmd.env_remove("GRIDLM_MANY_PREFETCH").args(["bench", "--shape", "smollm2-135m", "--batch", "1"]);
    cmd.args(["--compare-batch", "4", "--prompt-len", "4", "--new-tokens", "2", "--warmup", "0"]);
    cmd.args(["--reps", "1", "--bandwidth-mib", "64", "--json"]);
    let (j, _) = bench_one_rank(cmd);
    assert_eq!(j["baseline"]["batch"], 4, "{j}");
    let rank = &j["ranks"][0];
    assert_many_prefetch(rank, "many_prefetch", 1);
    assert_many_prefetch(rank, "baseline_many_prefetch", 4);
    // Without a baseline batch there is no baseline's way.
    let mut cmd = std::process::Command::new(bin());
    cmd.args(["bench", "--shape", "smollm2-135m", "--prompt-len", "4", "--new-tokens", "2"]);
    cmd.args(["--warmup", "0", "--reps", "1", "--bandwidth-mib", "64", "--json"]);
    let (j, _) = bench_one_rank(cmd);
    let rank = &j["ranks"][0];
    assert!(
        ["", "_by", "_timings"]
            .iter()
            .all(|k| rank.get(format!("baseline_many_prefetch{k}")).is_some_and(|v| v.is_null())),
        "{rank}"
    );
}

/// A rank's many-token way under `key` (and `key`_by, `key`_timings) for a run of `tokens` a
/// step of SmolLM2's shape: timed (once, or twice where the first timing would have left
/// `whole`) where the AVX512_BF16 many-token kernel runs such steps, else the default `l2`.
fn assert_many_prefetch(rank: &serde_json::Value, key: &str, tokens: usize) {
    let (way, by, timings) = (&rank[key], &rank[format!("{key}_by")], &rank[format!("{key}_timings")]);
    if rank["isa"] == "avx512bf16" && tokens > 1 {
        assert_eq!(by, "timed", "{key} in {rank}");
        assert!(["l2", "nta", "whole"].contains(&way.as_str().unwrap()), "{key} in {rank}");
        assert!([1, 2].contains(&timings.as_u64().unwrap()), "{key} in {rank}");
    } else {
        assert_eq!((way, by, timings), (&"l2".into(), &"default".into(), &0.into()), "{key} in {rank}");
    }
}

/// Runs `cmd`, a one-rank `gridlm bench ... --json`, which must succeed: its report, checked
/// ([`check`]), and its stderr.
fn bench_one_rank(cmd: std::process::Command) -> (serde_json::Value, String) {
    let out = gridlm_reference::run_with_timeout(cmd, 600);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{stderr}");
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    check(&j, 1);
    (j, stderr)
}

/// The runs named by bench's progress lines on `stderr`, in order ("rep 1/2 (batch 1)"); a
/// warning of stalled readings may follow them on a busy machine.
fn progress_labels(stderr: &str) -> Vec<&str> {
    stderr
        .lines()
        .filter_map(|l| l.strip_prefix("bench: ")?.split(':').next())
        .filter(|l| l.starts_with("rep ") || l.starts_with("warm-up "))
        .collect()
}
