//! gridlm against an independent implementation (candle-transformers) on the real
//! SmolLM2-135M-Instruct weights and on random-weight Qwen2-, Qwen3-, Phi-3-, SmolLM3-,
//! Gemma-style (1, 2 and 3), Granite-style (3 and 4) and other models.

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models::smol::smollm3;
use candle_transformers::models::{
    bigcode, falcon, gemma, gemma2, gemma3, glm4, glm4_new, granitemoehybrid, helium, llama, mistral,
    mixtral, olmo, olmo2, phi, phi3, qwen2, qwen2_moe, qwen3, qwen3_moe, stable_lm, starcoder2,
};
use gridlm_reference::falcon::{FalconKind, TinyFalcon};
use gridlm_reference::gpt2::{Gpt2Kind, TinyGpt2};
use gridlm_reference::neox::TinyNeoX;
use gridlm_reference::{
    argmax, byte_chars, generate, generate_on, gridlm_bin, launch_command, llama_cpp_rope_factors,
    max_abs_diff, rename_tensor, run_with_timeout, smollm2, write_gguf, GgufValue, Run,
};
use std::path::Path;

const N_TOKENS: usize = 32;
const LOGIT_TOL: f32 = 1e-3;
/// Comparisons with candle's f32 keep the KV cache in f32 too (the default is f16).
const KV_F32: [&str; 2] = ["--kv-dtype", "f32"];

/// The prompts every parity check runs: plain text, code, and a chat-templated question.
const PROMPTS: &[(&str, &[&str])] = &[
    ("plain", &["--prompt", "The history of the Roman Empire began when"]),
    ("code", &["--prompt", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"]),
    ("chat", &["--chat", "--prompt", "What is the tallest mountain in the world?"]),
];

/// candle's Llama on the f32 folder: last-position logits of the prompt and `n` greedy tokens.
fn candle_llama(dir: &Path, prompt: &[u32], n: usize) -> (Vec<f32>, Vec<u32>, Vec<Vec<f32>>) {
    let mut forward = candle_llama_forward(folder_config(dir), dir);
    let mut logits = forward(prompt, 0);
    let prompt_logits = logits.clone();
    let mut tokens = Vec::new();
    let mut all = Vec::new();
    for i in 0..n {
        let next = argmax(&logits);
        tokens.push(next);
        all.push(logits.clone());
        if i + 1 == n {
            break;
        }
        logits = forward(&[next], prompt.len() + i);
    }
    (prompt_logits, tokens, all)
}

/// The folder's config.json.
fn folder_config(dir: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap()
}

#[test]
fn smollm2_f32_matches_candle() {
    let dir = smollm2("f32");
    let n = N_TOKENS.to_string();
    for (name, args) in PROMPTS {
        let mut a = args.to_vec();
        a.extend(["--max-tokens", &n]);
        a.extend(KV_F32);
        let ours: Run = generate(&dir, &a);
        let (ref_logits, ref_tokens, _) = candle_llama(&dir, &ours.prompt_ids, N_TOKENS);
        let d = max_abs_diff(&ours.logits, &ref_logits);
        eprintln!("{name}: {} prompt tokens, max |Δ logits| = {d:.2e}", ours.prompt_ids.len());
        assert!(d <= LOGIT_TOL, "{name}: last-position logits differ from candle by {d} (> {LOGIT_TOL})");
        assert_eq!(ours.token_ids, ref_tokens, "{name}: greedy tokens differ from candle");
        assert_eq!(ours.token_ids.len(), N_TOKENS);
    }
}

/// candle's Llama on the f32 folder, fed `prompt` and then `forced` a token at a time: the
/// logits before each token of `forced`.
fn candle_llama_along(dir: &Path, prompt: &[u32], forced: &[u32]) -> Vec<Vec<f32>> {
    let mut forward = candle_llama_forward(folder_config(dir), dir);
    let mut out = Vec::new();
    let mut input = prompt.to_vec();
    let mut pos = 0;
    for &t in forced {
        out.push(forward(&input, pos));
        pos += input.len();
        input = vec![t];
    }
    out
}

/// log-softmax of `logits`, in f64.
fn log_softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = max + logits.iter().map(|&l| (l as f64 - max).exp()).sum::<f64>().ln();
    logits.iter().map(|&l| l as f64 - lse).collect()
}

/// [`generate`] with `args` on one rank where `grid` (among `args`) is empty, else on two local
/// ranks.
fn generate_on_grid(dir: &Path, grid: &[&str], args: &[&str]) -> Run {
    if grid.is_empty() {
        generate(dir, args)
    } else {
        generate_on(&["local", "2"], dir, args)
    }
}

/// `generate --embed` (a prompt's last hidden states, after the final norm, pooled) against
/// candle's Llama on one rank, two tensor-parallel ranks and two stages, the prompt run in one
/// chunk and in two (16 and 4 positions). SmolLM2 ties its output head to its embedding matrix E,
/// so candle's logits at a position are E times the normed hidden state there, and the head is
/// linear: E times the last position's embedding is candle's last logits, E times the mean
/// embedding the mean of candle's logits over the positions, E times the first position's candle's
/// first logits.
#[test]
fn smollm2_embeddings_match_candle() {
    let dir = smollm2("f32");
    let cfg = folder_config(&dir);
    let (vocab, hidden) =
        (cfg["vocab_size"].as_u64().unwrap() as usize, cfg["hidden_size"].as_u64().unwrap() as usize);
    let e = candle_weights(&dir).get((vocab, hidden), "model.embed_tokens.weight").unwrap();
    let head = |v: &[f32]| -> Vec<f32> {
        let v = Tensor::from_slice(v, (hidden, 1), &Device::Cpu).unwrap();
        e.matmul(&v).unwrap().flatten_all().unwrap().to_vec1().unwrap()
    };
    let prompt = "The history of the Roman Empire began when Romulus founded the city on the Palatine Hill.";
    let mut theirs: Option<Vec<Vec<f32>>> = None;
    for grid in [&[][..], &["--tp", "2"][..], &["--pp", "2"][..]] {
        for (pooling, chunk) in [("last", "512"), ("mean", "512"), ("cls", "512"), ("mean", "8")] {
            let mut args =
                vec!["--prompt", prompt, "--embed", pooling, "--step-tokens", chunk, "--threads", "1"];
            args.extend(KV_F32);
            args.extend(grid);
            let run = generate_on_grid(&dir, grid, &args);
            let ids = &run.prompt_ids;
            // candle's logits at each position: after the first token, then after each next one.
            let along = theirs.get_or_insert_with(|| {
                let forced: Vec<u32> = ids[1..].iter().copied().chain([0]).collect();
                candle_llama_along(&dir, &ids[..1], &forced)
            });
            assert_eq!(along.len(), ids.len());
            let want: Vec<f32> = match pooling {
                "last" => along[ids.len() - 1].clone(),
                "cls" => along[0].clone(),
                _ => (0..vocab).map(|t| along.iter().map(|l| l[t]).sum::<f32>() / ids.len() as f32).collect(),
            };
            let embedding: Vec<f32> = run.json["embedding"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_f64().unwrap() as f32)
                .collect();
            assert_eq!((embedding.len(), &run.json["token_ids"]), (hidden, &serde_json::json!([])));
            let d = max_abs_diff(&head(&embedding), &want);
            eprintln!(
                "{pooling} in chunks of {chunk} on {grid:?}: {} positions, max |Δ logits| = {d:.2e}",
                ids.len()
            );
            assert!(
                d <= LOGIT_TOL,
                "{pooling} on {grid:?}: E · embedding differs from candle's logits by {d}"
            );
        }
    }
}

/// `generate --logprobs 5` reports each token's log-probability and the five most likely
/// tokens' as candle's logits give them (within 1e-3; an alternative may differ only where
/// candle's own values nearly tie), on one rank, two tensor-parallel ranks (the vocabulary
/// split: the normalizer is summed over both shards) and two stages; greedy, and sampled with
/// a repetition penalty and a temperature, which change the pick but not the reported values.
#[test]
fn smollm2_logprobs_match_candle() {
    let dir = smollm2("f32");
    let prompt = ["--prompt", "The history of the Roman Empire began when", "--max-tokens", "12"];
    let sampled = ["--temperature", "0.9", "--seed", "7", "--repetition-penalty", "1.3"];
    let mut reference: Option<(Vec<u32>, Vec<Vec<f32>>)> = None;
    for (how, extra) in [("greedy", &[][..]), ("sampled", &sampled[..])] {
        for grid in [&[][..], &["--tp", "2"][..], &["--pp", "2"][..]] {
            let mut args = prompt.to_vec();
            args.extend(["--logprobs", "5", "--threads", "1"]);
            args.extend(KV_F32);
            args.extend(extra);
            args.extend(grid);
            let run = generate_on_grid(&dir, grid, &args);
            let lps = run.json["logprobs"].as_array().expect("a logprobs list");
            assert_eq!(lps.len(), run.token_ids.len(), "{how} {grid:?}: one entry a token");
            // candle along these tokens (the same for every grid of one way).
            let same = reference.as_ref().is_some_and(|(t, _)| *t == run.token_ids);
            if !same {
                let steps = candle_llama_along(&dir, &run.prompt_ids, &run.token_ids);
                reference = Some((run.token_ids.clone(), steps));
            }
            let steps = &reference.as_ref().unwrap().1;
            let mut worst = 0.0f64;
            for (i, (lp, l)) in lps.iter().zip(steps).enumerate() {
                let want = log_softmax(l);
                let t = run.token_ids[i] as usize;
                assert_eq!(lp["token"].as_u64(), Some(t as u64), "{how} {grid:?}: token {i}");
                let got = lp["logprob"].as_f64().unwrap();
                worst = worst.max((got - want[t]).abs());
                assert!(
                    (got - want[t]).abs() <= 1e-3,
                    "{how} {grid:?}: token {i}: logprob {got}, candle {}",
                    want[t]
                );
                let top = lp["top"].as_array().unwrap();
                assert_eq!(top.len(), 5, "{how} {grid:?}: token {i}");
                let mut order: Vec<usize> = (0..want.len()).collect();
                order.sort_by(|&a, &b| want[b].total_cmp(&want[a]).then(a.cmp(&b)));
                for (j, alt) in top.iter().enumerate() {
                    let (id, v) = (alt["token"].as_u64().unwrap() as usize, alt["logprob"].as_f64().unwrap());
                    assert!(
                        (v - want[id]).abs() <= 1e-3,
                        "{how} {grid:?}: token {i} alternative {j}: {v} against {}",
                        want[id]
                    );
                    let tie = (want[order[j]] - want[id]).abs() <= 1e-3;
                    assert!(
                        id == order[j] || tie,
                        "{how} {grid:?}: token {i}: alternative {j} is {id}, candle's {}",
                        order[j]
                    );
                }
                if grid.is_empty() && extra.is_empty() {
                    assert_eq!(top[0]["token"], lp["token"], "greedy: the token is the most likely");
                }
            }
            eprintln!("{how} {grid:?}: {} tokens, max |Δ logprob| = {worst:.2e}", lps.len());
        }
    }
}

/// `entry` (a token's log-probabilities from `generate --json`: `token`, `logprob`, `top`) agrees
/// with candle's logits `l` at that position within 1e-3, its alternatives candle's most likely
/// tokens (but where candle's own values nearly tie); the largest difference.
fn agrees_with_candle(what: &str, entry: &serde_json::Value, token: u32, l: &[f32], k: usize) -> f64 {
    let want = log_softmax(l);
    assert_eq!(entry["token"].as_u64(), Some(token as u64), "{what}");
    let got = entry["logprob"].as_f64().unwrap();
    let mut worst = (got - want[token as usize]).abs();
    assert!(worst <= 1e-3, "{what}: logprob {got}, candle {}", want[token as usize]);
    let top = entry["top"].as_array().unwrap();
    assert_eq!(top.len(), k, "{what}");
    let mut order: Vec<usize> = (0..want.len()).collect();
    order.sort_by(|&a, &b| want[b].total_cmp(&want[a]).then(a.cmp(&b)));
    for (j, alt) in top.iter().enumerate() {
        let (id, v) = (alt["token"].as_u64().unwrap() as usize, alt["logprob"].as_f64().unwrap());
        worst = worst.max((v - want[id]).abs());
        assert!((v - want[id]).abs() <= 1e-3, "{what}: alternative {j}: {v} against {}", want[id]);
        let tie = (want[order[j]] - want[id]).abs() <= 1e-3;
        assert!(id == order[j] || tie, "{what}: alternative {j} is {id}, candle's {}", order[j]);
    }
    worst
}

/// `generate --prompt-logprobs 5` scores each prompt token after the first as candle's logits
/// give it, the prompt fed whole or 16 positions a step (a chunk's last position scored by the
/// next chunk's first token), on one rank, two tp ranks and two stages; with `--max-tokens 0`
/// nothing is generated, otherwise the same scores come with the tokens.
#[test]
fn smollm2_prompt_logprobs_match_candle() {
    let dir = smollm2("f32");
    let text = "The history of the Roman Empire began when Augustus became the first emperor, and \
                it lasted for centuries until the fall of Constantinople in 1453.";
    let mut steps: Option<Vec<Vec<f32>>> = None;
    for (grid, chunk) in
        [(&[][..], "512"), (&[][..], "16"), (&["--tp", "2"][..], "16"), (&["--pp", "2"][..], "16")]
    {
        for new in ["0", "3"] {
            let mut args =
                vec!["--prompt", text, "--max-tokens", new, "--prompt-logprobs", "5", "--threads", "1"];
            args.extend(["--step-tokens", chunk]);
            args.extend(KV_F32);
            args.extend(grid);
            let what = format!("{grid:?}, {chunk} a step, {new} new");
            // (`generate` asks for the logits of the first new token, so not with none.)
            let mut cmd = launch_command(if grid.is_empty() { &[] } else { &["local", "2"] });
            cmd.args(["generate", "--model", dir.to_str().unwrap(), "--json", "--ignore-eos"]).args(&args);
            let out = run_with_timeout(cmd, 600);
            assert!(out.status.success(), "{what}: {}", String::from_utf8_lossy(&out.stderr));
            let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
            let ids = |v: &serde_json::Value| -> Vec<u32> {
                v.as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect()
            };
            assert_eq!(ids(&json["token_ids"]).len(), new.parse::<usize>().unwrap(), "{what}");
            let p = &ids(&json["prompt_token_ids"]);
            assert!(p.len() > 16, "{what}: {} prompt tokens", p.len());
            let steps = steps.get_or_insert_with(|| candle_llama_along(&dir, &p[..1], &p[1..]));
            let lps = json["prompt_logprobs"].as_array().expect("a prompt_logprobs list");
            assert_eq!(lps.len(), p.len(), "{what}: one entry a prompt token");
            assert!(lps[0].is_null(), "{what}: the first token has none");
            let mut worst = 0.0f64;
            for (i, l) in steps.iter().enumerate() {
                worst = worst.max(agrees_with_candle(
                    &format!("{what}: prompt token {}", i + 1),
                    &lps[i + 1],
                    p[i + 1],
                    l,
                    5,
                ));
            }
            eprintln!("{what}: {} prompt tokens, max |Δ logprob| = {worst:.2e}", p.len());
        }
    }
}

/// `other` gives the same greedy tokens as `full` (f32 weights, f32 KV cache), or departs
/// from them only where f32 itself nearly ties: at the first differing position, candle's f32
/// logits prefer f32's token over `other`'s by less than 0.1.
fn same_or_near_tie(name: &str, what: &str, f32_dir: &Path, full: &Run, other: &Run) {
    assert_eq!(full.prompt_ids, other.prompt_ids);
    if full.token_ids == other.token_ids {
        return;
    }
    let i = full.token_ids.iter().zip(&other.token_ids).position(|(a, b)| a != b).unwrap();
    let (_, _, steps) = candle_llama(f32_dir, &full.prompt_ids, i + 1);
    let l = &steps[i];
    let gap = l[full.token_ids[i] as usize] - l[other.token_ids[i] as usize];
    eprintln!("{name}: {what} diverges at token {i}; f32 logit gap between the two choices = {gap:.4}");
    assert!(
        gap < 0.1,
        "{name}: {what} diverges at token {i} where f32 prefers its token by {gap} (not a near-tie)"
    );
}

#[test]
fn smollm2_bf16_same_greedy_tokens_as_f32() {
    let f32_dir = smollm2("f32");
    let bf16_dir = smollm2("bf16");
    let n = N_TOKENS.to_string();
    for (name, args) in PROMPTS {
        let mut a = args.to_vec();
        a.extend(["--max-tokens", &n]);
        a.extend(KV_F32);
        let full = generate(&f32_dir, &a);
        let half = generate(&bf16_dir, &a);
        assert_eq!(half.json["weight_dtype"], "bf16");
        same_or_near_tie(name, "bf16 weights", &f32_dir, &full, &half);
    }
}

/// The default f16 KV cache (and bf16) keeps greedy text as f32's, on f32 weights.
#[test]
fn smollm2_half_precision_kv_cache_same_greedy_tokens() {
    let f32_dir = smollm2("f32");
    let n = N_TOKENS.to_string();
    for (name, args) in PROMPTS {
        let mut a = args.to_vec();
        a.extend(["--max-tokens", &n]);
        let default = generate(&f32_dir, &a);
        assert_eq!(default.json["kv_dtype"], "f16", "the KV cache is f16 by default");
        a.extend(KV_F32);
        let full = generate(&f32_dir, &a);
        assert_eq!(full.json["kv_dtype"], "f32");
        let d = max_abs_diff(&default.logits, &full.logits);
        eprintln!("{name}: f16 KV cache: max |Δ logits| = {d:.2e}");
        assert!(d < 0.05, "{name}: f16 KV cache moves last-position logits by {d}");
        same_or_near_tie(name, "f16 KV cache", &f32_dir, &full, &default);
        a.truncate(a.len() - 2);
        a.extend(["--kv-dtype", "bf16"]);
        let b = generate(&f32_dir, &a);
        same_or_near_tie(name, "bf16 KV cache", &f32_dir, &full, &b);
    }
}

/// Every tensor of the converted folder equals candle's own dequantization of the GGUF
/// (after applying llama.cpp's Q/K row permutation to ours).
#[test]
fn gguf_conversion_matches_candle_dequantization() {
    use candle_core::quantized::gguf_file;
    let dir = smollm2("f32");
    let gguf_path = dir.parent().unwrap().join("gguf/SmolLM2-135M-Instruct.Q4_1.gguf");
    let mut f = std::fs::File::open(&gguf_path).unwrap();
    let content = gguf_file::Content::read(&mut f).unwrap();
    let dev = Device::Cpu;
    let ours = candle_core::safetensors::load(dir.join("model.safetensors"), &dev).unwrap();
    let cfg = folder_config(&dir);
    let n_heads = cfg["num_attention_heads"].as_u64().unwrap() as usize;
    let n_kv = cfg["num_key_value_heads"].as_u64().unwrap() as usize;
    let mut checked = 0;
    for name in content.tensor_infos.keys() {
        let hf = rename_tensor(name, true).unwrap_or_else(|| panic!("unexpected tensor {name}"));
        let theirs = content.tensor(&mut f, name, &dev).unwrap().dequantize(&dev).unwrap();
        let mut mine = ours.get(&hf).unwrap_or_else(|| panic!("{hf} missing")).clone();
        if name.ends_with("attn_q.weight") || name.ends_with("attn_k.weight") {
            let heads = if name.ends_with("attn_q.weight") { n_heads } else { n_kv };
            let (rows, cols) = mine.dims2().unwrap();
            // llama.cpp: reshape(heads, 2, hd/2, cols).swapaxes(1, 2)
            mine = mine
                .reshape((heads, 2, rows / heads / 2, cols))
                .unwrap()
                .transpose(1, 2)
                .unwrap()
                .reshape((rows, cols))
                .unwrap();
        }
        let a: Vec<f32> = mine.flatten_all().unwrap().to_vec1().unwrap();
        let b: Vec<f32> = theirs.flatten_all().unwrap().to_vec1().unwrap();
        assert!(max_abs_diff(&a, &b) <= 1e-6, "{name} → {hf} differs from candle's dequantization");
        checked += 1;
    }
    assert_eq!(checked, 272);
}

/// The prompt of the random-weight models' checks (word-level tokens `t0`, `t1`, ...).
const TINY_PROMPT: [&str; 6] =
    ["--prompt", "t5 t17 t42 t3 t99 t250 t7", "--max-tokens", "32", "--kv-dtype", "f32"];

/// gridlm's last-position logits and 32 greedy tokens on a random-weight model in `dir`
/// against candle's: `forward(ids, pos)` runs candle's model on `ids` from position `pos` and
/// gives its last position's logits. Returns gridlm's run.
fn tiny_matches_candle(name: &str, dir: &Path, forward: impl FnMut(&[u32], usize) -> Vec<f32>) -> Run {
    tiny_matches_candle_with(name, dir, &TINY_PROMPT, 32, forward)
}

/// [`tiny_matches_candle`] of a run of gridlm with `args`, `new` greedy tokens.
fn tiny_matches_candle_with(
    name: &str,
    dir: &Path,
    args: &[&str],
    new: usize,
    mut forward: impl FnMut(&[u32], usize) -> Vec<f32>,
) -> Run {
    let ours = generate(dir, args);
    assert!(ours.prompt_ids.len() >= 7, "{name}: prompt ids {:?}", ours.prompt_ids);
    let mut logits = forward(&ours.prompt_ids, 0);
    let d = max_abs_diff(&ours.logits, &logits);
    eprintln!("{name}: max |Δ logits| = {d:.2e}");
    assert!(d <= LOGIT_TOL, "{name}: logits differ from candle by {d}");
    let mut tokens = Vec::new();
    for i in 0..new {
        let next = argmax(&logits);
        tokens.push(next);
        if i + 1 < new {
            logits = forward(&[next], ours.prompt_ids.len() + i);
        }
    }
    assert_eq!(ours.token_ids, tokens, "{name}: greedy tokens differ from candle");
    ours
}

/// The f32 weights of the folder `dir`, for candle.
fn candle_weights(dir: &Path) -> VarBuilder<'static> {
    // SAFETY (test): the file is not modified while mapped.
    unsafe { VarBuilder::from_mmaped_safetensors(&[dir.join("model.safetensors")], DType::F32, &Device::Cpu) }
        .unwrap()
}

/// `ids` as a batch of one.
fn batch_of_one(ids: &[u32]) -> Tensor {
    Tensor::new(ids, &Device::Cpu).unwrap().unsqueeze(0).unwrap()
}

/// [`tiny_matches_candle`] on `TinyModel::$arch()` (or `TinyModel::$tiny()`, given as `$tiny
/// =>`) written into the folder `$dir`, against candle's `$arch::$model` (each family its own
/// types, hence a macro), made by `$model::new($($first,)* &cfg, weights)`, which takes the
/// prompt whole or, after `one at a time;`, token by token.
macro_rules! tiny_against_candle {
    ($tiny:ident => $arch:ident, $model:ident, $dir:expr) => {
        tiny_against_candle!(usize::MAX; $tiny => $arch, $model, $dir)
    };
    ($arch:ident, $model:ident, $dir:expr $(, $first:expr)*) => {
        tiny_against_candle!(usize::MAX; $arch => $arch, $model, $dir $(, $first)*)
    };
    (one at a time; $arch:ident, $model:ident, $dir:expr $(, $first:expr)*) => {
        tiny_against_candle!(1; $arch => $arch, $model, $dir $(, $first)*)
    };
    ($chunk:expr; $tiny:ident => $arch:ident, $model:ident, $dir:expr $(, $first:expr)*) => {{
        gridlm_reference::TinyModel::$tiny().write($dir);
        let text = std::fs::read($dir.join("config.json")).unwrap();
        let cfg: $arch::Config = serde_json::from_slice(&text).unwrap();
        let mut model = $arch::$model::new($($first,)* &cfg, candle_weights($dir)).unwrap();
        let run = tiny_matches_candle(concat!("random ", stringify!($tiny)), $dir, |ids, pos| {
            let mut logits = Vec::new();
            for (i, chunk) in ids.chunks($chunk).enumerate() {
                let out = model.forward(&batch_of_one(chunk), pos + i * chunk.len()).unwrap();
                logits = out.flatten_all().unwrap().to_vec1().unwrap();
            }
            logits
        });
        // One token a word of the word-level vocabulary.
        assert_eq!(run.prompt_ids, vec![5, 17, 42, 3, 99, 250, 7]);
        run
    }};
}

/// Mistral (Llama's forward with an untied head; its window longer than the sequence, the
/// windows being checked through Gemma 3's), against candle's `mistral`.
#[test]
fn random_mistral_matches_candle() {
    let tmp = tempfile::tempdir().unwrap();
    let single = tiny_against_candle!(mistral, Model, tmp.path());
    // As Mistral Small 3.x's image-and-text folders (`mistral3`) hold it.
    let defaults = ["rms_norm_eps", "hidden_act", "tie_word_embeddings"];
    same_as_image_and_text(
        tmp.path(),
        &single,
        gridlm_reference::TinyModel::mistral(),
        "mistral3",
        &defaults,
    );
}

/// Qwen2 against candle's `qwen2`; stored as Qwen2-VL's and Qwen2.5-VL's image-and-text
/// folders, the same bits: Qwen2-VL's first form (the text model's settings at the top, its
/// tensors by plain names, `visual.*` beside them), Qwen2.5-VL's later one (a `text_config`,
/// the tensors under `model.language_model.`), each with M-RoPE (`type: mrope`) in its
/// `rope_scaling` — plain RoPE for text alone — and the head tied or not by the outer config.
#[test]
fn random_qwen2_matches_candle() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let single = tiny_against_candle!(qwen2, ModelForCausalLM, dir);
    let m = gridlm_reference::TinyModel::qwen2();
    let mrope = serde_json::json!({"type": "mrope", "mrope_section": [4, 2, 2]});
    let mut flat = folder_config(dir);
    flat["model_type"] = "qwen2_vl".into();
    flat["rope_scaling"] = mrope.clone();
    flat["vision_config"] = serde_json::json!({"depth": 1, "embed_dim": 8});
    same_as_stored(dir, &single, &m, &flat, &[("model.", "lm_head.")], "visual.blocks.0.attn.qkv.weight");
    let mut text_config = folder_config(dir);
    text_config["model_type"] = "qwen2_5_vl_text".into();
    text_config["rope_scaling"] = mrope;
    text_config.as_object_mut().unwrap().remove("tie_word_embeddings");
    let nested = serde_json::json!({
        "model_type": "qwen2_5_vl", "text_config": text_config, "vision_config": {"depth": 1},
        "tie_word_embeddings": false, "eos_token_id": 0,
    });
    let prefixes = [("model.language_model.", "lm_head.")];
    same_as_stored(dir, &single, &m, &nested, &prefixes, "model.visual.blocks.0.attn.qkv.weight");
}

/// Phi-3's fused `qkv_proj` and `gate_up_proj`, against candle's Phi-3; and split over two
/// ranks by heads and FFN columns (each rank reading its rows of the fused tensors), the same
/// tokens and logits within 1e-4 of the single rank.
#[test]
fn random_phi3_matches_candle_on_one_and_two_ranks() {
    let tmp = tempfile::tempdir().unwrap();
    let single = tiny_against_candle!(phi3, Model, tmp.path());
    same_on_two_ranks("random phi3", tmp.path(), &single, &[&["--tp", "2"]]);
}

/// Phi-4-mini's RoPE for `TinyModel::phi3()`: its config's fields for LongRoPE over an
/// original context of 16 positions (of 256: an attention factor of √(1 + ln 16 / ln 16) =
/// √2, as HF works it out) on the first three quarters of each head (12 of 16 dimensions),
/// and the short and long factors.
fn longrope_phi3() -> (serde_json::Value, Vec<f64>, Vec<f64>) {
    let short: Vec<f64> = (0..6).map(|i| 1.0 + 0.25 * i as f64).collect();
    let long: Vec<f64> = (0..6).map(|i| 1.5 + 2.0 * i as f64).collect();
    let fields = serde_json::json!({
        "partial_rotary_factor": 0.75, "original_max_position_embeddings": 16,
        "rope_scaling": {"type": "longrope", "short_factor": short, "long_factor": long},
    });
    (fields, short, long)
}

/// Candle's `phi3` on the [`longrope_phi3`] model of config `cfg` in `dir`, as `(ids, pos) →
/// last logits`. Candle's LongRoPE differs from HF's (and llama.cpp's) twice, so its side
/// undoes both: it multiplies each frequency by its factor, so its config holds their
/// reciprocals, and it leaves the attention factor out, so its copy of the weights (in
/// `scratch`) carries it ([`candle_phi3_scaled`]).
fn candle_longrope_phi3(
    m: &gridlm_reference::TinyModel,
    dir: &Path,
    cfg: &serde_json::Value,
    scratch: &Path,
) -> impl FnMut(&[u32], usize) -> Vec<f32> {
    let mut cfg = cfg.clone();
    for k in ["short_factor", "long_factor"] {
        let f: Vec<f64> =
            cfg["rope_scaling"][k].as_array().unwrap().iter().map(|f| 1.0 / f.as_f64().unwrap()).collect();
        cfg["rope_scaling"][k] = f.into();
    }
    candle_phi3_scaled(m, dir, cfg, scratch, (12, 2f32.sqrt()))
}

/// Candle's `phi3` of config `cfg` on the weights of the Phi-3-style model `m` in `dir`, their
/// rows of q and k heads' first `rot` dimensions times `factor` (what the cos and sin of HF's
/// scaled RoPE carry, which candle's leave out; RoPE is linear), written into `scratch`.
fn candle_phi3_scaled(
    m: &gridlm_reference::TinyModel,
    dir: &Path,
    cfg: serde_json::Value,
    scratch: &Path,
    (rot, factor): (usize, f32),
) -> impl FnMut(&[u32], usize) -> Vec<f32> {
    let hd = m.hidden / m.heads;
    let dev = Device::Cpu;
    let mut tensors = candle_core::safetensors::load(dir.join("model.safetensors"), &dev).unwrap();
    for (name, t) in tensors.iter_mut() {
        if name.ends_with("qkv_proj.weight") {
            let rows = (m.heads + 2 * m.kv_heads) * hd;
            let scale: Vec<f32> = (0..rows)
                .map(|r| if r < (m.heads + m.kv_heads) * hd && r % hd < rot { factor } else { 1.0 })
                .collect();
            *t = t.broadcast_mul(&Tensor::new(scale, &dev).unwrap().unsqueeze(1).unwrap()).unwrap();
        }
    }
    std::fs::create_dir_all(scratch).unwrap();
    candle_core::safetensors::save(&tensors, scratch.join("model.safetensors")).unwrap();
    let cfg: phi3::Config = serde_json::from_value(cfg).unwrap();
    let mut model = phi3::Model::new(&cfg, candle_weights(scratch)).unwrap();
    move |ids: &[u32], pos: usize| -> Vec<f32> {
        model.forward(&batch_of_one(ids), pos).unwrap().flatten_all().unwrap().to_vec1().unwrap()
    }
}

/// YaRN on a random Phi-3-style model (heads of 16, base 10000; a factor of 4 over an original
/// context of 256 of 1024 positions, so the ramp between the pairs that turn 32 times and once
/// over 256 positions spans four of the eight, and the cos/sin factor is 1 + 0.1 ln 4), against
/// candle's YaRN, its DeepSeek-V2 RoPE: rotating `[1, 0, 1, 0, …]` at positions 0 and 1 gives
/// the factor and each pair's frequency, which candle's `phi3` then runs at every position as
/// the frequencies of its LongRoPE without an original context ([`candle_phi3_scaled`]). (The
/// check fails with the ramp the other way round or without the attention factor.)
#[test]
fn a_yarn_model_matches_candle() {
    use candle_transformers::models::deepseek2::{
        DeepSeekV2RopeConfig, DeepSeekV2RopeScaling, DeepSeekV2RotaryEmbedding, ScaledRopeType,
    };
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ours");
    let m = gridlm_reference::TinyModel::phi3();
    std::fs::create_dir_all(&dir).unwrap();
    m.write(&dir);
    let mut cfg = folder_config(&dir);
    cfg["max_position_embeddings"] = 1024.into();
    cfg["rope_scaling"] =
        serde_json::json!({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256});
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    let (hd, dev) = (m.hidden / m.heads, Device::Cpu);
    let yarn = DeepSeekV2RopeScaling::Yarn {
        original_max_position_embeddings: 256,
        beta_fast: 32.0,
        beta_slow: 1.0,
        // HF's factor where the config names no mscale: 1 + 0.1 ln 4 over 1.
        mscale: 1.0,
        mscale_all_dim: 0.0,
        factor: 4.0,
        scaling_type: ScaledRopeType::Yarn,
    };
    let rope_cfg = DeepSeekV2RopeConfig {
        rope_scaling: Some(yarn),
        max_position_embeddings: 1024,
        rope_theta: 10000.0,
        qk_rope_head_dim: hd,
    };
    let rope = DeepSeekV2RotaryEmbedding::new(&rope_cfg, DType::F32, &dev).unwrap();
    let pairs: Vec<f32> = (0..2 * hd).map(|j| if j % 2 == 0 { 1.0 } else { 0.0 }).collect();
    let x = Tensor::new(pairs, &dev).unwrap().reshape((1, 1, 2, hd)).unwrap();
    let (r, _) = rope.forward(&x, &x, 0).unwrap();
    let r: Vec<f32> = r.flatten_all().unwrap().to_vec1().unwrap();
    let factor = r[0];
    assert!((factor as f64 - (1.0 + 0.1 * 4f64.ln())).abs() < 1e-6, "{factor}");
    let freqs: Vec<f64> =
        (0..hd / 2).map(|i| (r[hd + 2 * i + 1] as f64).atan2(r[hd + 2 * i] as f64)).collect();
    // Pair 0 kept, pairs 4 on divided by 4.
    let unscaled = |i: usize| 10000f64.powf(-2.0 * i as f64 / hd as f64);
    assert!((freqs[0] - 1.0).abs() < 1e-6 && (freqs[7] / unscaled(7) - 0.25).abs() < 1e-4, "{freqs:?}");
    let mut theirs = cfg.clone();
    let candle_factors: Vec<f64> = (0..hd / 2).map(|i| freqs[i] / unscaled(i)).collect();
    theirs["rope_scaling"] = serde_json::json!({"type": "longrope", "short_factor": candle_factors, "long_factor": candle_factors});
    let candle = candle_phi3_scaled(&m, &dir, theirs, &tmp.path().join("candle"), (hd, factor));
    tiny_matches_candle("yarn phi3", &dir, candle);
}

/// Phi-4-mini's RoPE on a random Phi-3-style model ([`longrope_phi3`]): LongRoPE (each rotated
/// pair's frequency divided by its short factor, by its long one past the original context;
/// cos and sin times the attention factor) over part of each head (`partial_rotary_factor`),
/// against candle's `phi3` ([`candle_longrope_phi3`]), whose RoPE takes the factors by
/// position, as HF's does for a prompt within the original context and the tokens after it.
/// A prompt longer than the original context takes the long factors at every position (as
/// HF, which picks them for the whole pass): against candle with the long factors for short
/// ones. The same tokens and logits on tp = 2 and pp = 2. (The check fails with every prompt
/// position taking the factors by position, and with the long factors never taken.)
#[test]
fn a_partial_longrope_phi3_matches_candle() {
    let tmp = tempfile::tempdir().unwrap();
    let ours = tmp.path().join("ours");
    let m = gridlm_reference::TinyModel::phi3();
    std::fs::create_dir_all(&ours).unwrap();
    m.write(&ours);
    let (fields, _, long) = longrope_phi3();
    let mut cfg = folder_config(&ours);
    cfg.as_object_mut().unwrap().extend(fields.as_object().unwrap().clone());
    std::fs::write(ours.join("config.json"), cfg.to_string()).unwrap();
    // 7 prompt tokens and 32 new: positions 16 on take the long factors.
    let candle = candle_longrope_phi3(&m, &ours, &cfg, &tmp.path().join("candle"));
    let single = tiny_matches_candle("partial longrope phi3", &ours, candle);
    same_on_two_ranks("partial longrope phi3", &ours, &single, &[&["--tp", "2"], &["--pp", "2"]]);
    // 20 prompt tokens: every position takes them.
    let prompt: Vec<String> = (0..20).map(|i| format!("t{}", 7 * i + 3)).collect();
    let prompt = prompt.join(" ");
    let args = ["--prompt", &prompt, "--max-tokens", "8", "--kv-dtype", "f32"];
    cfg["rope_scaling"]["short_factor"] = long.into();
    let candle = candle_longrope_phi3(&m, &ours, &cfg, &tmp.path().join("candle-long"));
    tiny_matches_candle_with("partial longrope phi3, a long prompt", &ours, &args, 8, candle);
}

/// `cfg` (a config as transformers 4 wrote it) as transformers 5 writes it: `rope_theta`,
/// `rope_scaling` and `partial_rotary_factor` in `rope_parameters`, nested by layer type for
/// Gemma 3 (its sliding layers' base from `rope_local_base_freq`).
fn as_transformers5(cfg: &serde_json::Value) -> serde_json::Value {
    let mut v = cfg.as_object().unwrap().clone();
    let mut params = serde_json::Map::new();
    params.insert("rope_type".into(), "default".into());
    if let Some(serde_json::Value::Object(s)) = v.remove("rope_scaling") {
        params.extend(s);
        if let Some(t) = params.remove("type") {
            params.insert("rope_type".into(), t);
        }
    }
    for key in ["rope_theta", "partial_rotary_factor"] {
        if let Some(x) = v.remove(key) {
            params.insert(key.into(), x);
        }
    }
    let params = match v.remove("rope_local_base_freq") {
        Some(local) => serde_json::json!({
            "full_attention": params,
            "sliding_attention": {"rope_type": "default", "rope_theta": local},
        }),
        None => params.into(),
    };
    v.insert("rope_parameters".into(), params);
    v.into()
}

/// Folders whose config.json is in transformers 5's form (the RoPE settings in
/// `rope_parameters`), against candle on the same weights with the config in the form it
/// reads: Llama 3's scaled RoPE (a base of 500000), Phi-4-mini's LongRoPE over three quarters
/// of each head, and Gemma 3's settings nested by layer type (a global base of 10⁶, a local
/// one of 20000; candle's Gemma 3 has no scaling to check a scaled one against). Read as before (an
/// unknown key ignored: a base of 10000, no scaling, whole heads), each fails.
#[test]
fn transformers5_configs_match_candle() {
    let tmp = tempfile::tempdir().unwrap();
    let v5 = |dir: &Path, cfg: &serde_json::Value| {
        std::fs::write(dir.join("config.json"), as_transformers5(cfg).to_string()).unwrap();
        assert!(folder_config(dir).get("rope_theta").is_none());
    };
    // Llama 3.
    let dir = tmp.path().join("llama3");
    std::fs::create_dir_all(&dir).unwrap();
    let m = gridlm_reference::TinyModel::llama3();
    m.write(&dir);
    let mut cfg = m.config();
    cfg["rope_theta"] = 500000.0.into();
    v5(&dir, &cfg);
    tiny_matches_candle("transformers 5 llama3", &dir, candle_llama_forward(cfg, &dir));
    // Phi-4-mini's RoPE.
    let dir = tmp.path().join("phi3");
    std::fs::create_dir_all(&dir).unwrap();
    let m = gridlm_reference::TinyModel::phi3();
    m.write(&dir);
    let mut cfg = folder_config(&dir);
    cfg.as_object_mut().unwrap().extend(longrope_phi3().0.as_object().unwrap().clone());
    v5(&dir, &cfg);
    let candle = candle_longrope_phi3(&m, &dir, &cfg, &tmp.path().join("phi3-candle"));
    tiny_matches_candle("transformers 5 phi3", &dir, candle);
    // Gemma 3, its prompt one token at a time (as
    // `random_gemma3_matches_candle_on_one_and_two_ranks`).
    let dir = tmp.path().join("gemma3");
    std::fs::create_dir_all(&dir).unwrap();
    gridlm_reference::TinyModel::gemma3().write(&dir);
    let mut cfg = folder_config(&dir);
    cfg["rope_local_base_freq"] = 20000.0.into();
    v5(&dir, &cfg);
    let theirs: gemma3::Config = serde_json::from_value(cfg).unwrap();
    let mut model = gemma3::Model::new(false, &theirs, candle_weights(&dir)).unwrap();
    tiny_matches_candle("transformers 5 gemma3", &dir, |ids, pos| {
        let mut logits = Vec::new();
        for (i, &id) in ids.iter().enumerate() {
            let out = model.forward(&batch_of_one(&[id]), pos + i).unwrap();
            logits = out.flatten_all().unwrap().to_vec1().unwrap();
        }
        logits
    });
}

/// GLM-4-0414 against candle's `glm4_new`: q/k/v biases, the fused `gate_up_proj`, RoPE on
/// interleaved pairs over half of each head, norms on both sublayers' outputs. Split over two
/// ranks by heads (one KV head each) and by layers, the same tokens and logits within 1e-4 of
/// the single rank.
#[test]
fn random_glm4_matches_candle_on_one_and_two_ranks() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let single = tiny_against_candle!(glm4 => glm4_new, ModelForCausalLM, dir);
    same_on_two_ranks("random glm4", dir, &single, &[&["--tp", "2"], &["--pp", "2"]]);
}

/// The first GLM-4 in HF's form (`glm`: glm-4-9b-chat-hf) against candle's `glm4`, which runs
/// it as THUDM first published it (ChatGLM's names and config: q, k and v rows and biases in one
/// `query_key_value`, gate and up rows in `dense_h_to_4h`, the base as 10000 × `rope_ratio`):
/// q/k/v biases, RoPE on interleaved pairs over half of each head (a base of 500000), no
/// output norms. Split over two ranks by heads and by layers, the same tokens and logits
/// within 1e-4 of the single rank.
#[test]
fn random_glm_matches_candle_on_one_and_two_ranks() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("hf");
    std::fs::create_dir_all(&dir).unwrap();
    let m = gridlm_reference::TinyModel::glm();
    m.write(&dir);
    let mut cfg = folder_config(&dir);
    cfg["rope_theta"] = 500000.0.into();
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    let single =
        tiny_matches_candle("random glm", &dir, candle_chatglm(&m, &dir, &tmp.path().join("chatglm"), 50));
    same_on_two_ranks("random glm", &dir, &single, &[&["--tp", "2"], &["--pp", "2"]]);
}

/// candle's `glm4` (the first GLM-4 as THUDM published it: ChatGLM's names and config, q/k/v
/// rows and biases fused in `query_key_value`, gate and up rows in `dense_h_to_4h`, a RoPE base
/// of 10000 × `rope_ratio`) on the weights of the `glm`-style model `m` in `dir`, written by
/// those names into `scratch`, as `(ids, pos) → last logits`.
fn candle_chatglm(
    m: &gridlm_reference::TinyModel,
    dir: &Path,
    scratch: &Path,
    rope_ratio: usize,
) -> impl FnMut(&[u32], usize) -> Vec<f32> {
    std::fs::create_dir_all(scratch).unwrap();
    let hf = folder_tensors(dir);
    let t = |n: &str| hf[n].clone();
    let mut chatglm = std::collections::HashMap::new();
    let p = "transformer.";
    chatglm.insert(format!("{p}embedding.word_embeddings.weight"), t("model.embed_tokens.weight"));
    chatglm.insert(format!("{p}encoder.final_layernorm.weight"), t("model.norm.weight"));
    chatglm.insert(format!("{p}output_layer.weight"), t("lm_head.weight"));
    for l in 0..m.layers {
        let (ours, at) = (format!("model.layers.{l}."), format!("{p}encoder.layers.{l}."));
        let fused = |kind: &str| {
            let parts: Vec<Tensor> =
                ["q", "k", "v"].iter().map(|x| t(&format!("{ours}self_attn.{x}_proj.{kind}"))).collect();
            Tensor::cat(&parts, 0).unwrap()
        };
        chatglm.insert(format!("{at}self_attention.query_key_value.weight"), fused("weight"));
        chatglm.insert(format!("{at}self_attention.query_key_value.bias"), fused("bias"));
        for (from, to) in [
            ("self_attn.o_proj", "self_attention.dense"),
            ("input_layernorm", "input_layernorm"),
            ("post_attention_layernorm", "post_attention_layernorm"),
            ("mlp.gate_up_proj", "mlp.dense_h_to_4h"),
            ("mlp.down_proj", "mlp.dense_4h_to_h"),
        ] {
            chatglm.insert(format!("{at}{to}.weight"), t(&format!("{ours}{from}.weight")));
        }
    }
    candle_core::safetensors::save(&chatglm, scratch.join("model.safetensors")).unwrap();
    let cfg: glm4::Config = serde_json::from_value(serde_json::json!({
        "num_layers": m.layers, "padded_vocab_size": m.vocab, "hidden_size": m.hidden,
        "ffn_hidden_size": m.inter, "kv_channels": m.hidden / m.heads, "num_attention_heads": m.heads,
        "seq_length": m.max_pos, "layernorm_epsilon": 1e-6, "rmsnorm": true,
        "apply_residual_connection_post_layernorm": false, "post_layer_norm": true,
        "add_bias_linear": false, "add_qkv_bias": true, "bias_dropout_fusion": true,
        "multi_query_attention": true, "multi_query_group_num": m.kv_heads,
        "apply_query_key_layer_scaling": false, "attention_softmax_in_fp32": true,
        "fp32_residual_connection": false, "rope_ratio": rope_ratio, "eos_token_id": 0,
    }))
    .unwrap();
    let mut model = glm4::Model::new(&cfg, candle_weights(scratch)).unwrap();
    // candle's model keeps its own positions: a prompt from 0, then one token at a time.
    move |ids, _| model.forward(&batch_of_one(ids)).unwrap().flatten_all().unwrap().to_vec1().unwrap()
}

/// A `chatglm` GGUF as llama.cpp writes the first GLM-4 (glm-4-9b-chat): q, k and v rows and
/// biases fused in `attn_qkv`, gate and up rows in `ffn_up`, half of each head rotated, a base
/// of 500000, the `chatglm-bpe` vocabulary) converts into exactly the `glm` model it was
/// written from, q, k and v apart as HF's `glm` keeps them; gridlm on it agrees with candle's
/// `glm4`. A fused tensor one row short is one error line naming it, and no folder.
#[test]
fn a_chatglm_gguf_converts_to_the_model_it_holds() {
    let tmp = tempfile::tempdir().unwrap();
    let m = gridlm_reference::TinyModel::glm();
    let tensors = m.tensors();
    let (tokens, merges) = byte_level_vocabulary(m.vocab);
    let mut meta = qwen3_gguf_meta(&m, "chatglm", tokens, merges);
    meta.retain(|(k, _)| k != "tokenizer.ggml.pre" && k != "chatglm.rope.freq_base");
    meta.extend([
        ("tokenizer.ggml.pre".to_string(), GgufValue::Str("chatglm-bpe".into())),
        ("chatglm.rope.freq_base".into(), GgufValue::F32(500000.0)),
        ("chatglm.rope.dimension_count".into(), GgufValue::U32((m.hidden / m.heads / 2) as u32)),
    ]);
    let mut gguf_tensors = Vec::new();
    for (n, shape, v) in &tensors {
        let Some(prefix) =
            n.strip_suffix("self_attn.q_proj.weight").or(n.strip_suffix("self_attn.q_proj.bias"))
        else {
            if !n.contains("self_attn.k_proj.") && !n.contains("self_attn.v_proj.") {
                gguf_tensors.push((rename_tensor(n, false).unwrap(), shape.clone(), v.clone()));
            }
            continue;
        };
        let kind = if n.ends_with("weight") { "weight" } else { "bias" };
        let part =
            |x: &str| tensors.iter().find(|t| t.0 == format!("{prefix}self_attn.{x}_proj.{kind}")).unwrap();
        let (q, k, w) = (part("q"), part("k"), part("v"));
        let mut fused_shape = q.1.clone();
        fused_shape[0] += k.1[0] + w.1[0];
        let layer = prefix.trim_start_matches("model.layers.").trim_end_matches('.');
        gguf_tensors.push((
            format!("blk.{layer}.attn_qkv.{kind}"),
            fused_shape,
            [q.2.clone(), k.2.clone(), w.2.clone()].concat(),
        ));
    }
    // A fused tensor of another row count than q, k and v make: one error line, no folder.
    let mut short = gguf_tensors.clone();
    let fused = short.iter_mut().find(|t| t.0 == "blk.0.attn_qkv.weight").unwrap();
    fused.1[0] -= 1;
    fused.2.truncate(fused.1[0] * fused.1[1]);
    let bad = tmp.path().join("short.gguf");
    write_gguf(&bad, &meta, &short);
    convert_refused(&bad, &tmp.path().join("short"), "blk.0.attn_qkv.weight");
    let gguf = tmp.path().join("chatglm.gguf");
    write_gguf(&gguf, &meta, &gguf_tensors);
    let out = tmp.path().join("folder");
    let converted = convert_f32(&gguf, &out);
    assert_eq!(converted.len(), tensors.len());
    for (n, shape, v) in &tensors {
        let t = converted.get(n).unwrap_or_else(|| panic!("{n} missing"));
        assert_eq!((t.dims(), &t.flatten_all().unwrap().to_vec1::<f32>().unwrap()), (&shape[..], v), "{n}");
    }
    let want = serde_json::json!({
        "model_type": "glm", "partial_rotary_factor": 0.5, "attention_bias": true, "rope_theta": 500000.0,
    });
    converted_config(&out, want, m.layers);
    tiny_matches_candle("converted chatglm", &out, candle_chatglm(&m, &out, &tmp.path().join("candle"), 50));
}

/// StarCoder 2 against candle's `starcoder2`: LayerNorms with biases (the residual stream's and
/// the final one), biases on q, k, v and o and on both FFN matrices (o's and the down matrix's
/// added once to the stage's sum), an FFN without a gate, tied embeddings. Split over two ranks
/// by heads and FFN columns and by layers, the same tokens and logits within 1e-4 of the single
/// rank.
#[test]
fn random_starcoder2_matches_candle_on_one_and_two_ranks() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let single = tiny_against_candle!(starcoder2, Model, dir);
    same_on_two_ranks("random starcoder2", dir, &single, &[&["--tp", "2"], &["--pp", "2"]]);
}

/// A StarCoder 2 GGUF as llama.cpp writes one (the LayerNorms' and projections' biases, `ffn_up`
/// and `ffn_down` without a gate, `attention.layer_norm_epsilon`, no output matrix: tied)
/// converts into exactly the model it was written from, on which gridlm agrees with candle's
/// `starcoder2`.
#[test]
fn a_starcoder2_gguf_converts_to_the_model_it_holds() {
    let tmp = tempfile::tempdir().unwrap();
    let m = gridlm_reference::TinyModel::starcoder2();
    let out = tmp.path().join("folder");
    let meta = vec![
        ("starcoder2.attention.layer_norm_epsilon".to_string(), GgufValue::F32(1e-5)),
        ("starcoder2.rope.freq_base".into(), GgufValue::F32(100000.0)),
    ];
    gguf_with_converts_to_the_model_it_holds(&m, "starcoder2", &out, meta, Vec::new());
    let want = serde_json::json!({
        "model_type": "starcoder2", "use_bias": true, "tie_word_embeddings": true,
        "hidden_act": "gelu_pytorch_tanh", "rope_theta": 100000.0,
    });
    let cfg = converted_config(&out, want, m.layers);
    assert!((cfg["norm_epsilon"].as_f64().unwrap() - 1e-5).abs() < 1e-12, "{cfg}");
    let cfg: starcoder2::Config = serde_json::from_value(cfg).unwrap();
    let mut model = starcoder2::Model::new(&cfg, candle_weights(&out)).unwrap();
    tiny_matches_candle("converted starcoder2", &out, |ids, pos| {
        model.forward(&batch_of_one(ids), pos).unwrap().flatten_all().unwrap().to_vec1().unwrap()
    });
}

/// StableLM 2 against candle's `stable_lm`: LayerNorms with biases, RoPE over a quarter of each
/// head, q/k/v biases. Split over two ranks by heads and by layers, the same tokens and logits
/// within 1e-4 of the single rank.
#[test]
fn random_stablelm_matches_candle_on_one_and_two_ranks() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let single = tiny_against_candle!(stablelm => stable_lm, Model, dir);
    same_on_two_ranks("random stablelm", dir, &single, &[&["--tp", "2"], &["--pp", "2"]]);
}

/// A StableLM 2 GGUF as llama.cpp writes one (the LayerNorms' biases, q/k/v biases, q and k
/// rows as HF has them, a quarter of each head as `rope.dimension_count`) converts into exactly
/// the model it was written from, on which gridlm agrees with candle's `stable_lm`.
#[test]
fn a_stablelm_gguf_converts_to_the_model_it_holds() {
    let tmp = tempfile::tempdir().unwrap();
    let m = gridlm_reference::TinyModel::stablelm();
    let out = tmp.path().join("folder");
    let meta = vec![
        ("stablelm.attention.layer_norm_epsilon".to_string(), GgufValue::F32(1e-5)),
        ("stablelm.rope.dimension_count".into(), GgufValue::U32((m.hidden / m.heads / 4) as u32)),
    ];
    gguf_with_converts_to_the_model_it_holds(&m, "stablelm", &out, meta, Vec::new());
    let want =
        serde_json::json!({"model_type": "stablelm", "use_qkv_bias": true, "partial_rotary_factor": 0.25});
    let mut cfg = converted_config(&out, want, m.layers);
    cfg["use_cache"] = true.into();
    let cfg: stable_lm::Config = serde_json::from_value(cfg).unwrap();
    let mut model = stable_lm::Model::new(&cfg, candle_weights(&out)).unwrap();
    tiny_matches_candle("converted stablelm", &out, |ids, pos| {
        model.forward(&batch_of_one(ids), pos).unwrap().flatten_all().unwrap().to_vec1().unwrap()
    });
}

/// Phi-2 against candle's `phi`: the attention and the FFN reading the one LayerNorm of the
/// layer's input (a parallel residual), biases on every projection and the output head, an FFN
/// without a gate, RoPE over half of each head. Split over two ranks by heads and by layers, the
/// same tokens and logits within 1e-4 of the single rank.
#[test]
fn random_phi_matches_candle_on_one_and_two_ranks() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    gridlm_reference::TinyModel::phi().write(dir);
    let cfg: phi::Config = serde_json::from_value(folder_config(dir)).unwrap();
    let mut model = phi::Model::new(&cfg, candle_weights(dir)).unwrap();
    // candle's model keeps its own positions: a prompt from 0, then one token at a time.
    let single = tiny_matches_candle("random phi", dir, |ids, _| {
        model.forward(&batch_of_one(ids)).unwrap().flatten_all().unwrap().to_vec1().unwrap()
    });
    same_on_two_ranks("random phi", dir, &single, &[&["--tp", "2"], &["--pp", "2"]]);
}

/// Phi-2 with HF's `gelu` (GELU through erf, not its tanh form) against candle's `phi`, whose
/// `gelu` is erf's too: 32 greedy tokens and the logits within the tolerance.
#[test]
fn random_phi_with_erf_gelu_matches_candle() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    gridlm_reference::TinyModel::phi().write(dir);
    let mut cfg = folder_config(dir);
    cfg["hidden_act"] = "gelu".into();
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    let cfg: phi::Config = serde_json::from_value(cfg).unwrap();
    let mut model = phi::Model::new(&cfg, candle_weights(dir)).unwrap();
    let mut first = None;
    let ours = tiny_matches_candle("random phi, erf gelu", dir, |ids, _| {
        let logits: Vec<f32> =
            model.forward(&batch_of_one(ids)).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        first.get_or_insert_with(|| logits.clone());
        logits
    });
    // Closer than the shared tolerance, which GELU's tanh form meets here too (6.7e-4 off).
    let d = max_abs_diff(&ours.logits, &first.unwrap());
    assert!(d <= 2e-5, "random phi, erf gelu: logits differ from candle by {d}");
}

/// A random Falcon of `kind` against candle's `falcon` on the same model
/// ([`gridlm_reference::falcon`]: a grouped one as the model computing the same function that
/// candle's layout takes), 32 greedy tokens and the logits within the tolerance; then the same
/// tokens and logits within 1e-4 split by heads (KV heads replicated where there is one, or
/// split with their groups) and by layers.
fn falcon_matches_candle(kind: FalconKind, grids: &[(&str, &[&str])]) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("falcon");
    std::fs::create_dir_all(&dir).unwrap();
    let m = TinyFalcon::new(kind);
    m.write(&dir);
    let single = falcon_against_candle(&m, &dir, &tmp.path().join("candle"));
    for (ranks, grid) in grids {
        same_on_ranks(&format!("random falcon, {kind:?}"), &dir, &single, ranks, &[grid]);
    }
}

/// gridlm on the Falcon folder `dir` (holding the model `m`) against candle's `falcon` on the
/// same model, written for it into `theirs` ([`TinyFalcon::write_for_candle`]); gridlm's run.
fn falcon_against_candle(m: &TinyFalcon, dir: &Path, theirs: &Path) -> Run {
    let kind = m.kind;
    std::fs::create_dir_all(theirs).unwrap();
    let biased = m.write_for_candle(theirs);
    let cfg = falcon::Config {
        vocab_size: m.vocab,
        hidden_size: m.hidden(),
        num_hidden_layers: m.layers,
        num_attention_heads: m.heads,
        layer_norm_epsilon: 1e-5,
        initializer_range: 0.02,
        use_cache: true,
        bos_token_id: 11,
        eos_token_id: 0,
        hidden_dropout: 0.0,
        attention_dropout: 0.0,
        // Candle reads a KV head per query head only where it is told so.
        n_head_kv: (kind != FalconKind::MultiQuery).then_some(m.heads),
        alibi: false,
        new_decoder_architecture: false,
        multi_query: kind == FalconKind::MultiQuery,
        parallel_attn: kind != FalconKind::Sequential,
        bias: biased,
    };
    let mut model = falcon::Falcon::load(candle_weights(theirs), cfg).unwrap();
    // candle's model keeps its own positions: a prompt from 0, then one token at a time.
    tiny_matches_candle(&format!("falcon, {kind:?}, in {}", dir.display()), dir, |ids, _| {
        model.forward(&batch_of_one(ids)).unwrap().flatten_all().unwrap().to_vec1().unwrap()
    })
}

/// Falcon-7B's and Falcon-40B's layouts as GGUFs the way llama.cpp's converter writes them —
/// q, k and v rows one after the other (all query heads, then the keys, then the values), a
/// 40B layer's `ln_mlp` as `attn_norm` (the norm its FFN reads) and `ln_attn` as `attn_norm_2`,
/// the `falcon` pre-tokenizer — convert into exactly the tensors they were written from, a
/// config HF's FalconConfig reads (none of other families' keys), on which gridlm agrees with
/// candle. A GGUF with a norm llama.cpp's Falcon never reads is refused in one line.
#[test]
fn falcon_ggufs_convert_to_the_models_they_hold() {
    let tmp = tempfile::tempdir().unwrap();
    for kind in [FalconKind::MultiQuery, FalconKind::Grouped] {
        let m = TinyFalcon::new(kind);
        let (h, hd) = (m.hidden(), m.hidden() / m.heads);
        let group = m.heads / m.kv_heads;
        let tensors = m.tensors();
        let top = [
            ("transformer.word_embeddings.weight", "token_embd.weight"),
            ("transformer.ln_f.weight", "output_norm.weight"),
            ("transformer.ln_f.bias", "output_norm.bias"),
            ("lm_head.weight", "output.weight"),
        ];
        // Each group's rows [its queries, its key, its value] → [queries; keys; values].
        let slots: Vec<usize> = (0..m.heads)
            .map(|j| j / group * (group + 2) + j % group)
            .chain((0..m.kv_heads).map(|g| g * (group + 2) + group))
            .chain((0..m.kv_heads).map(|g| g * (group + 2) + group + 1))
            .collect();
        let gguf_tensors = as_gguf_tensors(&tensors, &top, "transformer.h.", hd, &slots, |stem| match stem {
            "input_layernorm" | "ln_mlp" => "attn_norm",
            "ln_attn" => "attn_norm_2",
            "self_attention.query_key_value" => "attn_qkv",
            "self_attention.dense" => "attn_output",
            "mlp.dense_h_to_4h" => "ffn_up",
            "mlp.dense_4h_to_h" => "ffn_down",
            other => panic!("{other}"),
        });
        let u = |v: usize| GgufValue::U32(v as u32);
        let arch_meta = vec![
            ("attention.head_count_kv", u(m.kv_heads)),
            ("attention.layer_norm_epsilon", GgufValue::F32(1e-5)),
        ];
        let out = tmp.path().join(format!("{kind:?}"));
        let gguf = (&gguf_tensors[..], "falcon", arch_meta, "falcon");
        let meta =
            gguf_converts_back(&out, gguf, (m.layers, h, m.heads), m.vocab, &tensors, |n| n.to_string());
        let cfg = folder_config(&out);
        for key in ["intermediate_size", "num_key_value_heads", "head_dim", "rms_norm_eps", "hidden_act"] {
            assert!(cfg.get(key).is_none(), "{kind:?}: {key} in {cfg}");
        }
        let want = match kind {
            FalconKind::MultiQuery => {
                serde_json::json!({"multi_query": true, "new_decoder_architecture": false})
            }
            _ => {
                serde_json::json!({"new_decoder_architecture": true, "num_kv_heads": 2, "num_ln_in_parallel_attn": 2})
            }
        };
        for (key, want) in want.as_object().unwrap() {
            assert_eq!(&cfg[key], want, "{kind:?}: config.json's {key}");
        }
        assert_eq!(
            (cfg["ffn_hidden_size"].as_u64(), cfg["tie_word_embeddings"].as_bool()),
            (Some(4 * h as u64), Some(m.tied))
        );
        // Candle's Falcon runs GELU's tanh form, llama.cpp too; HF's default is GELU itself.
        assert!(cfg.get("activation").is_none(), "{cfg}");
        let mut tanh = cfg.clone();
        tanh["activation"] = "gelu_pytorch_tanh".into();
        std::fs::write(out.join("config.json"), tanh.to_string()).unwrap();
        falcon_against_candle(&m, &out, &tmp.path().join(format!("{kind:?}-candle")));
        if kind == FalconKind::MultiQuery {
            let mut bad = gguf_tensors.clone();
            bad.push(("blk.1.ffn_norm.weight".into(), vec![h], vec![1.0; h]));
            let gguf = tmp.path().join("ffn-norm.gguf");
            write_gguf(&gguf, &meta, &bad);
            convert_refused(&gguf, &tmp.path().join("ffn-norm"), "tensor `blk.1.ffn_norm.weight`");
        }
    }
}

/// Falcon-7B's layout: one KV head, which both ranks of a tensor-parallel split hold, five
/// query heads split three and two; the attention and the FFN reading one norm.
#[test]
fn random_falcon_7b_style_matches_candle_on_one_and_two_ranks() {
    falcon_matches_candle(FalconKind::MultiQuery, &[("2", &["--tp", "2"]), ("2", &["--pp", "2"])]);
}

/// Falcon without `multi_query` and `parallel_attn`: q, k and v stored head by head, the FFN
/// after the attention.
#[test]
fn random_sequential_falcon_matches_candle_on_one_and_two_ranks() {
    falcon_matches_candle(FalconKind::Sequential, &[("2", &["--tp", "2"]), ("2", &["--pp", "2"])]);
}

/// Falcon-40B's layout (`new_decoder_architecture`): two groups of three query heads, split
/// over two ranks (a group each) and over three (the middle rank holding a head of each
/// group), and `ln_mlp` beside `ln_attn`.
#[test]
fn random_falcon_40b_style_matches_candle_on_one_two_and_three_ranks() {
    falcon_matches_candle(
        FalconKind::Grouped,
        &[("2", &["--tp", "2"]), ("3", &["--tp", "3"]), ("2", &["--pp", "2"])],
    );
}

/// A random GPT-NeoX against candle on the same model ([`gridlm_reference::neox`]): the
/// parallel form (half of each head rotated, GELU through erf, the FFN's own norm, the head
/// named `embed_out` as transformers 4 saved Pythia's) as candle's `phi` takes it, the
/// sequential one (whole heads rotated, a head named `lm_head`) as its `falcon` with biases;
/// 32 greedy tokens and the logits within the tolerance, then split by heads (q, k, v and their
/// biases read head by head) and by layers, the same tokens and logits within 1e-4.
#[test]
fn random_gpt_neox_matches_candle_on_one_and_two_ranks() {
    for parallel in [true, false] {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("neox");
        std::fs::create_dir_all(&dir).unwrap();
        let m = TinyNeoX::new(parallel);
        m.write(&dir);
        let single = gpt_neox_against_candle(&m, &dir, &tmp.path().join("candle"));
        let name = format!("random gpt_neox, parallel {parallel}");
        same_on_two_ranks(&name, &dir, &single, &[&["--tp", "2"], &["--pp", "2"]]);
    }
}

/// Random GPT-BigCode and GPT-2 folders against candle's `bigcode` ([`gridlm_reference::gpt2`]):
/// learned positions added to the embedding (64 of them, so tp 2 and tp 3 split the table
/// inside the 39 positions run), no RoPE, LayerNorms, biases everywhere, GELU's tanh form,
/// tied head. StarCoder's one KV head as candle takes the folder; GPT-BigCode head by head and
/// GPT-2 (`Conv1D` matrices, tensors named without `transformer.`) with every head's key and
/// value the same, as that one KV head. 32 greedy tokens and the logits within the tolerance,
/// then split by heads (positions by rows) and by layers: the same tokens, logits within 1e-4.
#[test]
fn random_gpt2_and_gpt_bigcode_match_candle() {
    for kind in [Gpt2Kind::MultiQuery, Gpt2Kind::HeadByHead, Gpt2Kind::Gpt2] {
        let tmp = tempfile::tempdir().unwrap();
        let (dir, theirs) = (tmp.path().join("gpt2"), tmp.path().join("candle"));
        std::fs::create_dir_all(&dir).unwrap();
        let m = TinyGpt2::new(kind);
        m.write(&dir);
        let single = gpt2_against_candle(&m, &dir, &theirs);
        let name = format!("random {kind:?}");
        same_on_two_ranks(&name, &dir, &single, &[&["--tp", "2"], &["--pp", "2"]]);
        if kind == Gpt2Kind::Gpt2 {
            same_on_ranks(&name, &dir, &single, "3", &[&["--tp", "3"]]);
        }
    }
}

/// gridlm on the GPT-2 or GPT-BigCode folder `dir` (holding the model `m`) against candle's
/// `bigcode` on the same model, written for it into `theirs`; gridlm's run.
fn gpt2_against_candle(m: &TinyGpt2, dir: &Path, theirs: &Path) -> Run {
    std::fs::create_dir_all(theirs).unwrap();
    m.write_for_candle(theirs);
    let cfg = bigcode::Config {
        vocab_size: m.vocab,
        max_position_embeddings: m.positions,
        num_hidden_layers: m.layers,
        hidden_size: m.hidden(),
        layer_norm_epsilon: 1e-5,
        n_inner: None,
        num_attention_heads: m.heads,
        multi_query: true,
        use_cache: true,
    };
    let mut model = bigcode::GPTBigCode::load(candle_weights(theirs), cfg).unwrap();
    let name = format!("{:?} in {}", m.kind, dir.display());
    tiny_matches_candle(&name, dir, |ids, pos| {
        model.forward(&batch_of_one(ids), pos).unwrap().flatten_all().unwrap().to_vec1().unwrap()
    })
}

/// GPT-2 and StarCoder GGUFs as llama.cpp's converters write them — every matrix as an
/// `nn.Linear`'s (GPT-2's `Conv1D`s turned), q, k and v one after another, the positions as
/// `position_embd`, the context from `context_length` — convert into exactly the tensors they
/// were written from (GPT-2's turned back, under `transformer.`; GPT-BigCode's q, k and v head
/// by head again where the GGUF has a KV head a head), a config by HF's own key names, and the
/// model candle computes.
#[test]
fn gpt2_and_starcoder_ggufs_convert_to_the_models_they_hold() {
    let tmp = tempfile::tempdir().unwrap();
    for kind in [Gpt2Kind::Gpt2, Gpt2Kind::MultiQuery, Gpt2Kind::HeadByHead] {
        let m = TinyGpt2::new(kind);
        let (h, hd) = (m.hidden(), m.hidden() / m.heads);
        let kv = if kind == Gpt2Kind::MultiQuery { 1 } else { m.heads };
        let top = [
            ("transformer.wte.weight", "token_embd.weight"),
            ("transformer.wpe.weight", "position_embd.weight"),
            ("transformer.ln_f.weight", "output_norm.weight"),
            ("transformer.ln_f.bias", "output_norm.bias"),
        ];
        // GPT-BigCode head by head: head j's [q, k, v] → [all q; all k; all v].
        let slots: Vec<usize> = match kind {
            Gpt2Kind::HeadByHead => (0..3).flat_map(|part| (0..m.heads).map(move |j| 3 * j + part)).collect(),
            _ => (0..m.heads + 2 * kv).collect(),
        };
        let gguf_tensors =
            as_gguf_tensors(&m.laid_out(), &top, "transformer.h.", hd, &slots, |stem| match stem {
                "ln_1" => "attn_norm",
                "ln_2" => "ffn_norm",
                "attn.c_attn" => "attn_qkv",
                "attn.c_proj" => "attn_output",
                "mlp.c_fc" => "ffn_up",
                "mlp.c_proj" => "ffn_down",
                other => panic!("{other}"),
            });
        let u = |v: usize| GgufValue::U32(v as u32);
        let arch_meta = vec![
            ("context_length", u(m.positions)),
            ("attention.head_count_kv", u(kv)),
            ("attention.layer_norm_epsilon", GgufValue::F32(1e-5)),
        ];
        let arch = if kind == Gpt2Kind::Gpt2 { "gpt2" } else { "starcoder" };
        let out = tmp.path().join(format!("{kind:?}"));
        // The folder names its tensors under `transformer.`, as GPT2LMHeadModel saves them.
        let stored = |n: &str| if m.bare { format!("transformer.{n}") } else { n.to_string() };
        let pre = if kind == Gpt2Kind::Gpt2 { "gpt-2" } else { "starcoder" };
        let gguf = (&gguf_tensors[..], arch, arch_meta, pre);
        gguf_converts_back(&out, gguf, (m.layers, h, m.heads), m.vocab, &m.tensors(), stored);
        let cfg = folder_config(&out);
        for key in ["hidden_size", "num_attention_heads", "intermediate_size", "rms_norm_eps", "rope_theta"] {
            assert!(cfg.get(key).is_none(), "{key} in {cfg}");
        }
        assert_eq!(
            (cfg["n_embd"].as_u64(), cfg["n_positions"].as_u64()),
            (Some(h as u64), Some(64)),
            "{cfg}"
        );
        if kind != Gpt2Kind::Gpt2 {
            assert_eq!(cfg["multi_query"], kind == Gpt2Kind::MultiQuery, "{cfg}");
        }
        gpt2_against_candle(&m, &out, &tmp.path().join(format!("{kind:?}-candle")));
    }
}

/// gridlm on the GPT-NeoX folder `dir` (holding the model `m`) against candle on the same
/// model, written for it into `theirs` ([`TinyNeoX::write_for_candle`]); gridlm's run.
fn gpt_neox_against_candle(m: &TinyNeoX, dir: &Path, theirs: &Path) -> Run {
    std::fs::create_dir_all(theirs).unwrap();
    m.write_for_candle(theirs);
    let name = format!("gpt_neox, parallel {}, in {}", m.parallel, dir.display());
    let h = m.hidden();
    if m.parallel {
        let cfg = serde_json::json!({
            "vocab_size": m.vocab, "hidden_size": h, "intermediate_size": 4 * h,
            "num_hidden_layers": m.layers, "num_attention_heads": m.heads,
            "num_key_value_heads": m.heads, "hidden_act": "gelu", "max_position_embeddings": 2048,
            "layer_norm_eps": 1e-5, "tie_word_embeddings": false, "rope_theta": 10000.0,
            "partial_rotary_factor": m.rotary_pct(), "qk_layernorm": false,
        });
        let cfg: phi::Config = serde_json::from_value(cfg).unwrap();
        let mut model = phi::Model::new(&cfg, candle_weights(theirs)).unwrap();
        tiny_matches_candle(&name, dir, |ids, _| {
            model.forward(&batch_of_one(ids)).unwrap().flatten_all().unwrap().to_vec1().unwrap()
        })
    } else {
        let cfg = falcon::Config {
            vocab_size: m.vocab,
            hidden_size: h,
            num_hidden_layers: m.layers,
            num_attention_heads: m.heads,
            layer_norm_epsilon: 1e-5,
            initializer_range: 0.02,
            use_cache: true,
            bos_token_id: 0,
            eos_token_id: 0,
            hidden_dropout: 0.0,
            attention_dropout: 0.0,
            n_head_kv: Some(m.heads),
            alibi: false,
            new_decoder_architecture: false,
            multi_query: false,
            parallel_attn: false,
            bias: true,
        };
        let mut model = falcon::Falcon::load(candle_weights(theirs), cfg).unwrap();
        tiny_matches_candle(&name, dir, |ids, _| {
            model.forward(&batch_of_one(ids)).unwrap().flatten_all().unwrap().to_vec1().unwrap()
        })
    }
}

/// GPT-NeoX GGUFs as llama.cpp's converter writes them — q, k and v rows and their biases one
/// after the other (all queries, then all keys, then all values), the FFN's norm as
/// `ffn_norm`, `use_parallel_residual` and the rotated dimensions in the metadata, the `mpt`
/// pre-tokenizer its hash table gives the GPT-NeoX vocabulary — convert into exactly the
/// tensors they were written from (the head as `embed_out`), a config by GPTNeoXConfig's own
/// keys, on which gridlm agrees with candle.
#[test]
fn gpt_neox_ggufs_convert_to_the_models_they_hold() {
    let tmp = tempfile::tempdir().unwrap();
    for parallel in [true, false] {
        let m = TinyNeoX::new(parallel);
        let (h, hd) = (m.hidden(), m.hidden() / m.heads);
        let tensors = m.tensors();
        let top = [
            ("gpt_neox.embed_in.weight", "token_embd.weight"),
            ("gpt_neox.final_layer_norm.weight", "output_norm.weight"),
            ("gpt_neox.final_layer_norm.bias", "output_norm.bias"),
            ("lm_head.weight", "output.weight"),
            ("embed_out.weight", "output.weight"),
        ];
        // Head j's [q, k, v] rows (and biases) → [all q; all k; all v].
        let slots: Vec<usize> = (0..3).flat_map(|part| (0..m.heads).map(move |j| 3 * j + part)).collect();
        let gguf_tensors =
            as_gguf_tensors(&tensors, &top, "gpt_neox.layers.", hd, &slots, |stem| match stem {
                "input_layernorm" => "attn_norm",
                "post_attention_layernorm" => "ffn_norm",
                "attention.query_key_value" => "attn_qkv",
                "attention.dense" => "attn_output",
                "mlp.dense_h_to_4h" => "ffn_up",
                "mlp.dense_4h_to_h" => "ffn_down",
                other => panic!("{other}"),
            });
        let u = |v: usize| GgufValue::U32(v as u32);
        let arch_meta = vec![
            ("rope.dimension_count", u((hd as f64 * m.rotary_pct()) as usize)),
            ("use_parallel_residual", GgufValue::Bool(parallel)),
            ("attention.layer_norm_epsilon", GgufValue::F32(1e-5)),
        ];
        let out = tmp.path().join(format!("neox-{parallel}"));
        // The head as transformers 4 named it.
        let stored = |n: &str| if n == "lm_head.weight" { "embed_out.weight".into() } else { n.to_string() };
        let gguf = (&gguf_tensors[..], "gptneox", arch_meta, "mpt");
        gguf_converts_back(&out, gguf, (m.layers, h, m.heads), m.vocab, &tensors, stored);
        let cfg = folder_config(&out);
        for key in ["num_key_value_heads", "head_dim", "rms_norm_eps", "partial_rotary_factor", "rope_theta"]
        {
            assert!(cfg.get(key).is_none(), "{key} in {cfg}");
        }
        assert_eq!(cfg["use_parallel_residual"], parallel, "{cfg}");
        assert_eq!(
            (cfg["rotary_pct"].as_f64(), cfg["hidden_act"].as_str()),
            (Some(m.rotary_pct()), Some("gelu"))
        );
        if !parallel {
            // Candle's Falcon runs GELU's tanh form (the folder it was written from says so).
            let mut tanh = cfg.clone();
            tanh["hidden_act"] = "gelu_new".into();
            std::fs::write(out.join("config.json"), tanh.to_string()).unwrap();
        }
        gpt_neox_against_candle(&m, &out, &tmp.path().join(format!("neox-{parallel}-candle")));
    }
}

/// What [`gguf_converts_back`] writes.
type GgufSpec<'a> = (&'a [(String, Vec<usize>, Vec<f32>)], &'a str, Vec<(&'a str, GgufValue)>, &'a str);

/// A GGUF of `(tensors, architecture, its metadata by key under the architecture beside the
/// layers, the width and the heads of `shape` (a context of 2048, an FFN of four times the
/// width), the pre-tokenizer of a byte-level vocabulary of `vocab` words)`, written beside `out`
/// and converted (f32) into `out`, which must hold exactly `tensors` (each named as `stored`
/// says); returns the GGUF's metadata.
fn gguf_converts_back(
    out: &Path,
    (gguf_tensors, arch, arch_meta, pre): GgufSpec,
    shape: (usize, usize, usize),
    vocab: usize,
    tensors: &[(String, Vec<usize>, Vec<f32>)],
    stored: impl Fn(&str) -> String,
) -> Vec<(String, GgufValue)> {
    let u = |v: usize| GgufValue::U32(v as u32);
    let (layers, hidden, heads) = shape;
    let mut meta = vec![("general.architecture".to_string(), GgufValue::Str(arch.into()))];
    let common = [
        ("block_count", u(layers)),
        ("context_length", u(2048)),
        ("embedding_length", u(hidden)),
        ("feed_forward_length", u(4 * hidden)),
        ("attention.head_count", u(heads)),
    ];
    // The architecture's own value of a common key replaces it.
    let own: Vec<&str> = arch_meta.iter().map(|(k, _)| *k).collect();
    let common = common.into_iter().filter(|(k, _)| !own.contains(k));
    meta.extend(common.chain(arch_meta).map(|(k, v)| (format!("{arch}.{k}"), v)));
    let (tokens, merges) = byte_level_vocabulary(vocab);
    meta.extend(byte_level_meta(pre, tokens, merges));
    let gguf = out.with_extension("gguf");
    write_gguf(&gguf, &meta, gguf_tensors);
    let converted = convert_f32(&gguf, out);
    assert_eq!(converted.len(), tensors.len(), "{}", out.display());
    for (n, shape, v) in tensors {
        let name = stored(n);
        let t = converted.get(&name).unwrap_or_else(|| panic!("{}: {name} missing", out.display()));
        assert_eq!(
            (t.dims(), &t.flatten_all().unwrap().to_vec1::<f32>().unwrap()),
            (&shape[..], v),
            "{name}"
        );
    }
    meta
}

/// `tensors` as llama.cpp's converter names and stores them: `top` renames those outside the
/// layers; a layer's `{prefix}{i}.{stem}.{kind}` becomes `blk.{i}.{layer(stem)}.{kind}`, the
/// fused q/k/v (`attn_qkv`, weight or bias) its `head_dim`-row blocks taken in the order of
/// `qkv_slots`.
fn as_gguf_tensors(
    tensors: &[(String, Vec<usize>, Vec<f32>)],
    top: &[(&str, &str)],
    prefix: &str,
    head_dim: usize,
    qkv_slots: &[usize],
    layer: impl Fn(&str) -> &'static str,
) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let mut out = Vec::new();
    for (n, shape, v) in tensors {
        if let Some((_, gguf)) = top.iter().find(|(hf, _)| hf == n) {
            out.push((gguf.to_string(), shape.clone(), v.clone()));
            continue;
        }
        let (i, rest) = n.strip_prefix(prefix).unwrap().split_once('.').unwrap();
        let (stem, kind) = rest.rsplit_once('.').unwrap();
        let gguf = layer(stem);
        let v = if gguf == "attn_qkv" {
            let block = v.len() / qkv_slots.len();
            assert_eq!(block % head_dim, 0, "{n}");
            qkv_slots.iter().flat_map(|s| &v[s * block..(s + 1) * block]).copied().collect()
        } else {
            v.clone()
        };
        out.push((format!("blk.{i}.{gguf}.{kind}"), shape.clone(), v));
    }
    out
}

/// A Phi-2 GGUF as llama.cpp writes one (`phi2`: the final norm as `output_norm` and the head's
/// bias as `output.bias`, `dense`, `fc1` and `fc2` as `attn_output`, `ffn_up` and `ffn_down`
/// with their biases, half of each head as `rope.dimension_count`, the `phi-2` vocabulary)
/// converts into exactly the model it was written from, on which gridlm agrees with candle's
/// `phi`.
#[test]
fn a_phi2_gguf_converts_to_the_model_it_holds() {
    let tmp = tempfile::tempdir().unwrap();
    let m = gridlm_reference::TinyModel::phi();
    let out = tmp.path().join("folder");
    let meta = vec![
        ("phi2.attention.layer_norm_epsilon".to_string(), GgufValue::F32(1e-5)),
        ("phi2.rope.dimension_count".into(), GgufValue::U32((m.hidden / m.heads / 2) as u32)),
        ("tokenizer.ggml.pre".into(), GgufValue::Str("phi-2".into())),
    ];
    gguf_with_converts_to_the_model_it_holds(&m, "phi2", &out, meta, Vec::new());
    let want =
        serde_json::json!({"model_type": "phi", "partial_rotary_factor": 0.5, "hidden_act": "gelu_new"});
    let cfg: phi::Config = serde_json::from_value(converted_config(&out, want, m.layers)).unwrap();
    let mut model = phi::Model::new(&cfg, candle_weights(&out)).unwrap();
    tiny_matches_candle("converted phi2", &out, |ids, _| {
        model.forward(&batch_of_one(ids)).unwrap().flatten_all().unwrap().to_vec1().unwrap()
    });
}

/// Qwen3's per-head q/k norms and heads wider than hidden / heads, against candle's Qwen3; and
/// split over two ranks by heads (the norms' weights on both) and by layers, the same tokens
/// and logits within 1e-4 of the single rank.
#[test]
fn random_qwen3_matches_candle_on_one_and_two_ranks() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let single = tiny_against_candle!(qwen3, ModelForCausalLM, dir);
    same_on_two_ranks("random qwen3", dir, &single, &[&["--tp", "2"], &["--pp", "2"]]);
    // As Qwen3-VL's image-and-text folder holds it: a `text_config` with interleaved M-RoPE's
    // sections (plain RoPE for text alone), the head tied by the outer config alone.
    let mut text_config = folder_config(dir);
    text_config["model_type"] = "qwen3_vl_text".into();
    text_config["rope_scaling"] =
        serde_json::json!({"rope_type": "default", "mrope_section": [4, 2, 2], "mrope_interleaved": true});
    text_config.as_object_mut().unwrap().remove("tie_word_embeddings");
    let config = serde_json::json!({
        "model_type": "qwen3_vl", "text_config": text_config, "vision_config": {"depth": 1},
        "tie_word_embeddings": true,
    });
    let (m, tower) = (gridlm_reference::TinyModel::qwen3(), "model.visual.blocks.0.attn.qkv.weight");
    same_as_stored(dir, &single, &m, &config, &[("model.language_model.", "lm_head.")], tower);
}

/// Gemma 3's text model against candle's `gemma3`: norms stored less one, sandwich norms, per-head
/// q/k norms, GELU, the scaled embedding, and local layers (a window of 4 positions, shorter than
/// the 7-token prompt, and their own RoPE base) beside a global one; the check fails with the
/// window on every layer or on none. Split over two ranks by heads (one KV head each) and by layers
/// (the first stage all local), the same tokens and logits within 1e-4 of the single rank; and
/// stored as an image-and-text folder, the same bits. candle 0.9's Gemma 3 takes its prompt one
/// token at a time (a longer chunk fails in its KV cache: "slice-set only supports contiguous
/// tensors"), so its windows are those of its decode steps: the newest 4 positions, as in HF's
/// Gemma 3.
#[test]
fn random_gemma3_matches_candle_on_one_and_two_ranks() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let single = tiny_against_candle!(one at a time; gemma3, Model, dir, false);
    same_on_two_ranks("random gemma3", dir, &single, &[&["--tp", "2"], &["--pp", "2"]]);
    same_as_an_image_and_text_folder(dir, &single);
}

/// Gemma 3's local layers keep their keys in rings where the KV pool would give them more
/// pages: one slot (`--max-batch 1`) and a prompt of 100 tokens prefilled 20 positions a step,
/// so a local layer's ring is 3 pages (48 positions: a window of 4 and a step of 20 span at most
/// 3; the step from position 80 spans 3), against a sequence of 100 + 40 positions in 9 pages,
/// which wraps it three times. candle's 40 greedy tokens, token by token. The check fails with
/// rings of one page (16 positions, fewer than the 23 of a step's keys).
#[test]
fn random_gemma3_with_ringed_local_layers_matches_candle() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    gridlm_reference::TinyModel::gemma3().write(dir);
    let cfg: gemma3::Config = serde_json::from_value(folder_config(dir)).unwrap();
    let mut model = gemma3::Model::new(false, &cfg, candle_weights(dir)).unwrap();
    let prompt: Vec<String> = (0..100).map(|i| format!("t{}", (5 + 37 * i) % 300)).collect();
    let prompt = prompt.join(" ");
    let args = [
        "--prompt",
        &prompt,
        "--max-tokens",
        "40",
        "--kv-dtype",
        "f32",
        "--step-tokens",
        "20",
        "--max-batch",
        "1",
    ];
    let run = tiny_matches_candle_with("random gemma3, ringed", dir, &args, 40, |ids, pos| {
        let mut logits = Vec::new();
        for (i, id) in ids.iter().enumerate() {
            let out = model.forward(&batch_of_one(&[*id]), pos + i).unwrap();
            logits = out.flatten_all().unwrap().to_vec1().unwrap();
        }
        logits
    });
    assert_eq!(run.prompt_ids.len(), 100);
    assert_eq!(run.json["kv_ring_pages"], 3, "{}", run.json);
}

/// The Gemma 3 model in `dir`, stored as an image-and-text folder stores its text model (under
/// each of the two prefixes HF has written, beside an image tower's tensor, `text_config`
/// leaving out the fields whose values are HF's defaults): the same tokens and logits, bit for
/// bit, as the text-only folder gave (`single`).
fn same_as_an_image_and_text_folder(dir: &Path, single: &Run) {
    let defaults = [
        "rope_local_base_freq",
        "rms_norm_eps",
        "hidden_activation",
        "attention_bias",
        "tie_word_embeddings",
    ];
    same_as_image_and_text(dir, single, gridlm_reference::TinyModel::gemma3(), "gemma3", &defaults);
}

/// [`same_as_an_image_and_text_folder`] of the random model `m` in `dir`, as a folder of
/// `model_type` `outer` whose `text_config` leaves out the fields `defaults`.
fn same_as_image_and_text(
    dir: &Path,
    single: &Run,
    m: gridlm_reference::TinyModel,
    outer: &str,
    defaults: &[&str],
) {
    let mut text_config = folder_config(dir).as_object().unwrap().clone();
    for default in defaults {
        assert!(text_config.remove(*default).is_some(), "{default}");
    }
    let config = serde_json::json!({
        "architectures": [format!("{}ForConditionalGeneration", if outer == "gemma3" { "Gemma3" } else { "Mistral3" })],
        "model_type": outer,
        "text_config": text_config, "vision_config": {"hidden_size": 8}, "eos_token_id": 0,
    });
    let prefixes =
        [("language_model.model.", "language_model.lm_head."), ("model.language_model.", "lm_head.")];
    let tower = "vision_tower.vision_model.embeddings.patch_embedding.weight";
    same_as_stored(dir, single, &m, &config, &prefixes, tower);
}

/// The random model `m` (run from `dir` as `single`) stored as an image-and-text folder of
/// `config`, its text model's tensors under each of `prefixes` (of `model.*`, of `lm_head.*`)
/// beside an image tower's tensor `tower`: the same tokens and logits, bit for bit.
fn same_as_stored(
    dir: &Path,
    single: &Run,
    m: &gridlm_reference::TinyModel,
    config: &serde_json::Value,
    prefixes: &[(&str, &str)],
    tower: &str,
) {
    for &(model, head) in prefixes {
        let tmp = tempfile::tempdir().unwrap();
        let folder = tmp.path();
        std::fs::copy(dir.join("tokenizer.json"), folder.join("tokenizer.json")).unwrap();
        std::fs::write(folder.join("config.json"), config.to_string()).unwrap();
        let mut tensors: Vec<(String, Vec<usize>, Vec<f32>)> = m
            .tensors()
            .into_iter()
            .map(|(name, shape, v)| {
                let name = match (name.strip_prefix("model."), name.strip_prefix("lm_head.")) {
                    (Some(rest), _) => format!("{model}{rest}"),
                    (_, Some(rest)) => format!("{head}{rest}"),
                    _ => name,
                };
                (name, shape, v)
            })
            .collect();
        tensors.push((tower.into(), vec![8, 4], vec![0.5; 32]));
        gridlm_reference::write_safetensors(&folder.join("model.safetensors"), &tensors);
        let run = generate(folder, &TINY_PROMPT);
        assert_eq!(run.token_ids, single.token_ids, "image-and-text folder, {model}: greedy tokens differ");
        assert_eq!(run.logits, single.logits, "image-and-text folder, {model}: logits differ");
    }
}

/// SmolLM3's unrotated (NoPE) layer among rotated ones, against candle's `smollm3`; split over
/// two ranks by heads and by layers (the NoPE layer on the first stage), the same tokens and
/// logits within 1e-4 of the single rank.
#[test]
fn random_smollm3_matches_candle_on_one_and_two_ranks() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let single = tiny_against_candle!(smollm3, ModelForCausalLM, dir);
    same_on_two_ranks("random smollm3", dir, &single, &[&["--tp", "2"], &["--pp", "2"]]);
}

/// The first Gemma's norms stored less one, GELU (its folders' `hidden_act` may say `gelu`;
/// `hidden_activation` decides, GELU's tanh form unless it says otherwise) and scaled
/// embedding, against candle's `gemma` (taking the prompt one token at a time).
#[test]
fn random_gemma_matches_candle() {
    let tmp = tempfile::tempdir().unwrap();
    tiny_against_candle!(one at a time; gemma, Model, tmp.path(), false);
}

/// Gemma 2's soft-capped attention scores and logits, with its sandwich norms, GELU and scaled
/// embedding, against candle's `gemma2` (taking the prompt one token at a time, as its Gemma 3);
/// split over two ranks by heads and by layers, the same tokens and logits within 1e-4 of the
/// single rank (each rank caps its own vocabulary slice of the logits).
#[test]
fn random_gemma2_matches_candle_on_one_and_two_ranks() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let single = tiny_against_candle!(one at a time; gemma2, Model, dir, false);
    same_on_two_ranks("random gemma2", dir, &single, &[&["--tp", "2"], &["--pp", "2"]]);
}

/// Qwen3-MoE's mixture of experts (every second layer; the others dense), its experts' shares
/// not renormalized, against candle's `qwen3_moe`; split over two ranks by heads and each
/// expert's columns (40, as blocks of 16: 32 and 8), and by layers, and over a 2x2 grid, the
/// same tokens and logits within 1e-4 of the single rank.
#[test]
fn random_qwen3_moe_matches_candle_on_one_and_two_ranks() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let single = tiny_against_candle!(qwen3_moe, ModelForCausalLM, dir);
    same_on_two_ranks("random qwen3_moe", dir, &single, &[&["--tp", "2"], &["--pp", "2"]]);
    same_on_ranks("random qwen3_moe", dir, &single, "4", &[&["--pp", "2", "--tp", "2"]]);
}

/// Helium against candle's `helium`: Llama with RoPE on interleaved pairs of each whole head.
/// Split over two ranks by heads and by layers, the same tokens and logits within 1e-4 of the
/// single rank.
#[test]
fn random_helium_matches_candle_on_one_and_two_ranks() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let single = tiny_against_candle!(helium, Model, dir);
    same_on_two_ranks("random helium", dir, &single, &[&["--tp", "2"], &["--pp", "2"]]);
}

/// The first OLMo against candle's `olmo`: LayerNorms without weights or biases (the folder
/// holds no norm tensors), q, k and v clamped by `clip_qkv`. Split over two ranks by heads (a
/// KV head on both ranks) and by layers, the same tokens and logits within 1e-4 of the single
/// rank.
#[test]
fn random_olmo_matches_candle_on_one_and_two_ranks() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let single = tiny_against_candle!(olmo, Model, dir);
    same_on_two_ranks("random olmo", dir, &single, &[&["--tp", "2"], &["--pp", "2"]]);
}

/// An OLMo GGUF as llama.cpp writes one (no norm tensors, q and k rows interleaved as a
/// llama's, `clamp_kqv`, the LayerNorms' epsilon) converts into exactly the model it was
/// written from, on which gridlm agrees with candle's `olmo`; an epsilon HF's OLMo cannot hold
/// is refused in one line.
#[test]
fn an_olmo_gguf_converts_to_the_model_it_holds() {
    let tmp = tempfile::tempdir().unwrap();
    let m = gridlm_reference::TinyModel::olmo();
    let out = tmp.path().join("folder");
    let meta = |eps: f32| {
        vec![
            ("olmo.attention.layer_norm_epsilon".to_string(), GgufValue::F32(eps)),
            ("olmo.attention.clamp_kqv".into(), GgufValue::F32(0.6)),
        ]
    };
    gguf_with_converts_to_the_model_it_holds(&m, "olmo", &out, meta(1e-5), Vec::new());
    let want = serde_json::json!({"model_type": "olmo", "clip_qkv": 0.6f32 as f64, "attention_bias": false});
    let cfg = converted_config(&out, want, m.layers);
    assert!(cfg.get("rms_norm_eps").is_none(), "{cfg}");
    let cfg: olmo::Config = serde_json::from_value(cfg).unwrap();
    let mut model = olmo::Model::new(&cfg, candle_weights(&out)).unwrap();
    tiny_matches_candle("converted olmo", &out, |ids, pos| {
        model.forward(&batch_of_one(ids), pos).unwrap().flatten_all().unwrap().to_vec1().unwrap()
    });
    let (tokens, merges) = byte_level_vocabulary(m.vocab);
    let mut bad_meta = qwen3_gguf_meta(&m, "olmo", tokens, merges);
    bad_meta.extend(meta(1e-6));
    let gguf = tmp.path().join("eps.gguf");
    let embd = vec![0.0; m.vocab * m.hidden];
    write_gguf(&gguf, &bad_meta, &[("token_embd.weight".to_string(), vec![m.vocab, m.hidden], embd)]);
    let msg = "`olmo.attention.layer_norm_epsilon` is 0.000001: HF's OLMo normalizes with 1e-5 alone";
    convert_refused(&gguf, &tmp.path().join("eps"), msg);
}

/// OLMo 2's norms on the sublayers' outputs only and its q and k normed over their whole
/// width, against candle's `olmo2`; split over two ranks by heads (each rank's squares summed
/// over the stage, the KV head both ranks hold counted once) and by layers, the same tokens and
/// logits within 1e-4 of the single rank.
#[test]
fn random_olmo2_matches_candle_on_one_and_two_ranks() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let single = tiny_against_candle!(olmo2, Model, dir);
    same_on_two_ranks("random olmo2", dir, &single, &[&["--tp", "2"], &["--pp", "2"]]);
}

/// Qwen2-MoE's mixture of experts beside its shared expert (weighted by a sigmoid gate), with
/// Qwen2's QKV biases, against candle's `qwen2_moe`; split over two ranks by heads and the
/// experts' and the shared expert's columns (56: 32 and 24), and by layers, and over three by
/// heads and columns, the same tokens and logits within 1e-4 of the single rank.
#[test]
fn random_qwen2_moe_matches_candle_on_one_and_two_ranks() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let single = tiny_against_candle!(qwen2_moe, Model, dir);
    same_on_two_ranks("random qwen2_moe", dir, &single, &[&["--tp", "2"], &["--pp", "2"]]);
    // Three tp ranks route every token alike (each routes it itself): experts' columns 16, 16
    // and 8, the shared expert's 16, 16 and 24.
    same_on_ranks("random qwen2_moe", dir, &single, "3", &[&["--tp", "3"]]);
}

/// Mixtral's mixture of experts on every layer (2 of 4 a token, their shares renormalized),
/// against candle's `mixtral`; split over two ranks by heads and experts' columns, and by
/// layers, the same tokens and logits within 1e-4 of the single rank.
#[test]
fn random_mixtral_matches_candle_on_one_and_two_ranks() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let single = tiny_against_candle!(mixtral, Model, dir);
    same_on_two_ranks("random mixtral", dir, &single, &[&["--tp", "2"], &["--pp", "2"]]);
}

/// candle's Granite 4 (`granitemoehybrid`: attention layers only, each with its dense
/// `shared_mlp`) on `config` (HF's config.json) with `tensors` by candle's names:
/// `forward(ids, pos)` for [`tiny_matches_candle`].
fn candle_granite_forward(
    config: serde_json::Value,
    tensors: std::collections::HashMap<String, Tensor>,
) -> impl FnMut(&[u32], usize) -> Vec<f32> {
    let cfg: granitemoehybrid::GraniteMoeHybridConfig = serde_json::from_value(config).unwrap();
    let cfg = cfg.into_config(false);
    let vb = VarBuilder::from_tensors(tensors, DType::F32, &Device::Cpu);
    let model = granitemoehybrid::GraniteMoeHybrid::load(vb, &cfg).unwrap();
    let mut cache =
        granitemoehybrid::GraniteMoeHybridCache::new(true, DType::F32, &cfg, &Device::Cpu).unwrap();
    move |ids, pos| {
        let logits = model.forward(&batch_of_one(ids), pos, &mut cache).unwrap();
        logits.flatten_all().unwrap().to_vec1().unwrap()
    }
}

/// The f32 tensors of the folder `dir` by name.
fn folder_tensors(dir: &Path) -> std::collections::HashMap<String, Tensor> {
    candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap()
}

/// Granite 3's multipliers (of the embedding, the attention scores, each sublayer's output
/// and the logits), against candle's Granite 4 (`granitemoehybrid`) with every layer
/// attention, which is Granite 3 with its FFN's gate and up rows in one tensor (candle's
/// `granite` has no multipliers); split over two ranks by heads and by layers, the same
/// tokens and logits within 1e-4 of the single rank.
#[test]
fn random_granite_matches_candle_on_one_and_two_ranks() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let m = gridlm_reference::TinyModel::granite();
    m.write(dir);
    let forward = candle_granite_forward(m.config(), granite_as_hybrid(dir, m.layers));
    let single = tiny_matches_candle("random granite", dir, forward);
    same_on_two_ranks("random granite", dir, &single, &[&["--tp", "2"], &["--pp", "2"]]);
}

/// The tensors of the Granite 3 folder `dir` (of `layers` layers) by Granite 4's names: each
/// FFN's gate and up rows in one `shared_mlp.input_linear`, its down `shared_mlp.output_linear`.
fn granite_as_hybrid(dir: &Path, layers: usize) -> std::collections::HashMap<String, Tensor> {
    let mut tensors = folder_tensors(dir);
    for l in 0..layers {
        let p = |s: &str| format!("model.layers.{l}.{s}");
        let gate = tensors.remove(&p("mlp.gate_proj.weight")).unwrap();
        let up = tensors.remove(&p("mlp.up_proj.weight")).unwrap();
        tensors.insert(p("shared_mlp.input_linear.weight"), Tensor::cat(&[gate, up], 0).unwrap());
        let down = tensors.remove(&p("mlp.down_proj.weight")).unwrap();
        tensors.insert(p("shared_mlp.output_linear.weight"), down);
    }
    tensors
}

/// The test models' Granite multipliers as llama.cpp's keys of the GGUF architecture `arch`,
/// the attention's if given.
fn granite_scales(arch: &str, attention: Option<f32>) -> Vec<(String, GgufValue)> {
    let f = |k: &str, v: f32| (format!("{arch}.{k}"), GgufValue::F32(v));
    let mut meta = vec![f("embedding_scale", 12.0), f("residual_scale", 0.22), f("logit_scale", 3.0)];
    meta.extend(attention.map(|a| f("attention.scale", a)));
    meta
}

/// A GraniteMoE GGUF (a llama's interleaved q and k rows, each layer's experts as llama.cpp
/// stores them: gate, up and down stacked apart, `ffn_*_exps`) converts into the model it holds
/// (HF's stacks: each expert's gate and up rows in `input_linear`), on which gridlm agrees with
/// candle; with a shared expert's width (GraniteMoeShared) it is one error line.
#[test]
fn a_granite_moe_gguf_converts_to_the_model_it_holds() {
    let tmp = tempfile::tempdir().unwrap();
    let m = gridlm_reference::TinyModel::granite_moe();
    let out = tmp.path().join("folder");
    let meta = granite_scales("granitemoe", Some(0.25));
    gguf_with_converts_to_the_model_it_holds(&m, "granitemoe", &out, meta, Vec::new());
    let want = serde_json::json!({
        "model_type": "granitemoe", "architectures": ["GraniteMoeForCausalLM"], "num_local_experts": 4,
        "num_experts_per_tok": 2, "intermediate_size": 64, "logits_scaling": 3.0, "attention_multiplier": 0.25,
    });
    converted_config(&out, want, m.layers);
    tiny_matches_candle("converted granitemoe", &out, candle_granite_moe(&m, &out));

    let (tokens, merges) = byte_level_vocabulary(m.vocab);
    let mut meta = qwen3_gguf_meta(&m, "granitemoe", tokens, merges);
    meta.extend(granite_scales("granitemoe", None));
    meta.push(("granitemoe.expert_shared_feed_forward_length".into(), GgufValue::U32(32)));
    let gguf = tmp.path().join("shared.gguf");
    write_gguf(
        &gguf,
        &meta,
        &[("token_embd.weight".to_string(), vec![m.vocab, m.hidden], vec![0.0; m.vocab * m.hidden])],
    );
    let msg = "GraniteMoeShared's shared expert is not supported";
    convert_refused(&gguf, &tmp.path().join("shared"), msg);
}

/// `gridlm convert` of `gguf` into `out` fails with one error line that holds `msg`, and
/// writes no folder.
fn convert_refused(gguf: &Path, out: &Path, msg: &str) {
    let mut cmd = std::process::Command::new(gridlm_bin());
    cmd.args(["convert", "--gguf"]).arg(gguf).arg("--out").arg(out);
    let o = run_with_timeout(cmd, 60);
    let err = String::from_utf8_lossy(&o.stderr);
    let name = gguf.display();
    assert!(!o.status.success() && err.lines().count() == 1 && err.contains(msg), "{name}: {err}");
    assert!(!out.exists(), "{name}: a folder was written");
}

/// A Granite 3 GGUF (q and k rows interleaved as a llama's, the multipliers as llama.cpp's
/// `granite.*scale` keys) converts into the model it holds, its config's multipliers HF's, on
/// which gridlm agrees with candle. Without `granite.attention.scale` the attention's
/// multiplier is 1/√head_dim (llama.cpp's default; HF's is 1); without `granite.logit_scale`
/// (which llama.cpp requires), with RoPE turned off, or with a bias gridlm does not load, the
/// conversion is one error line and writes nothing.
#[test]
fn a_granite_gguf_converts_to_the_model_it_holds() {
    let tmp = tempfile::tempdir().unwrap();
    let m = gridlm_reference::TinyModel::granite();
    let scales = |attention| granite_scales("granite", attention);
    let out = tmp.path().join("folder");
    gguf_with_converts_to_the_model_it_holds(&m, "granite", &out, scales(Some(0.25)), Vec::new());
    let want = serde_json::json!({
        "model_type": "granite", "architectures": ["GraniteForCausalLM"], "embedding_multiplier": 12.0,
        "attention_multiplier": 0.25, "residual_multiplier": 0.22f32 as f64, "logits_scaling": 3.0,
    });
    let cfg = converted_config(&out, want, m.layers);
    tiny_matches_candle(
        "converted granite",
        &out,
        candle_granite_forward(cfg, granite_as_hybrid(&out, m.layers)),
    );

    let out = tmp.path().join("default-scale");
    gguf_with_converts_to_the_model_it_holds(&m, "granite", &out, scales(None), Vec::new());
    let want = serde_json::json!({"attention_multiplier": (1.0 / 8f32.sqrt()) as f64});
    converted_config(&out, want, m.layers);

    let refused =
        |name: &str, meta: Vec<(String, GgufValue)>, more: Vec<(String, Vec<usize>, Vec<f32>)>, msg: &str| {
            let (tokens, merges) = byte_level_vocabulary(m.vocab);
            let mut all = qwen3_gguf_meta(&m, "granite", tokens, merges);
            all.extend(meta);
            let mut tensors: Vec<_> = m
                .tensors()
                .into_iter()
                .map(|(n, shape, v)| (rename_tensor(&n, false).unwrap(), shape, v))
                .collect();
            tensors.extend(more);
            let gguf = tmp.path().join(format!("{name}.gguf"));
            write_gguf(&gguf, &all, &tensors);
            convert_refused(&gguf, &tmp.path().join(name), msg);
        };
    let mut no_logits = scales(Some(0.25));
    no_logits.retain(|(k, _)| k != "granite.logit_scale");
    refused("no-logit-scale", no_logits, Vec::new(), "missing metadata number `granite.logit_scale`");
    let mut no_rope = scales(Some(0.25));
    no_rope.push(("granite.rope.scaling.finetuned".into(), GgufValue::Bool(false)));
    refused("no-rope", no_rope, Vec::new(), "`granite.rope.scaling.finetuned` is false");
    let bias = vec![("blk.0.attn_output.bias".to_string(), vec![m.hidden], vec![0.5; m.hidden])];
    refused("bias", scales(Some(0.25)), bias, "blk.0.attn_output.bias");
}

/// A Granite 4 folder (`granitemoehybrid`) whose layers are all attention and have no experts
/// (Granite 4.0 Micro's kind): its FFN of `shared_intermediate_size` columns, gate and up rows
/// in one tensor, against candle's `granitemoehybrid`; split over two ranks by heads and FFN
/// columns (100: 64 and 36 of each of gate and up) and by layers, the same tokens and logits
/// within 1e-4 of the single rank.
#[test]
fn random_granite_hybrid_matches_candle_on_one_and_two_ranks() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let m = gridlm_reference::TinyModel::granite_hybrid();
    m.write(dir);
    let forward = candle_granite_forward(m.config(), folder_tensors(dir));
    let single = tiny_matches_candle("random granitemoehybrid", dir, forward);
    same_on_two_ranks("random granitemoehybrid", dir, &single, &[&["--tp", "2"], &["--pp", "2"]]);
}

/// GraniteMoE (Mixtral's mixture, its experts stacked in one tensor a layer, the router's
/// softmax taken over the chosen experts' scores alone, with Granite's multipliers), against
/// candle's `mixtral` with the multipliers folded into its weights — embedding rows × 12, q rows
/// × 0.25·√8 (candle's 1/√8 then makes 0.25), o_proj's and each expert's down × 0.22, the head
/// the embedding ÷ 3 — and the experts unstacked; split over two ranks by heads and experts'
/// columns, and by layers, the same tokens and logits within 1e-4 of the single rank.
#[test]
fn random_granite_moe_matches_candle_on_one_and_two_ranks() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let m = gridlm_reference::TinyModel::granite_moe();
    m.write(dir);
    let single = tiny_matches_candle("random granitemoe", dir, candle_granite_moe(&m, dir));
    same_on_two_ranks("random granitemoe", dir, &single, &[&["--tp", "2"], &["--pp", "2"]]);
}

/// candle's `mixtral` on the GraniteMoE-style model `m` whose tensors are in `dir`, with
/// Granite's multipliers folded into its weights and the experts unstacked
/// ([`random_granite_moe_matches_candle_on_one_and_two_ranks`]): `forward(ids, pos)` for
/// [`tiny_matches_candle`].
fn candle_granite_moe(m: &gridlm_reference::TinyModel, dir: &Path) -> impl FnMut(&[u32], usize) -> Vec<f32> {
    let (experts, _, ffn) = m.experts.unwrap();
    let mut t = folder_tensors(dir);
    let mut take = |name: &str| t.remove(name).unwrap();
    let mut mixtral = std::collections::HashMap::new();
    let embed = take("model.embed_tokens.weight");
    mixtral.insert("lm_head.weight".to_string(), (&embed / 3.0).unwrap());
    mixtral.insert("model.embed_tokens.weight".to_string(), (&embed * 12.0).unwrap());
    for l in 0..m.layers {
        let p = |s: &str| format!("model.layers.{l}.{s}");
        let q_factor = 0.25 * ((m.hidden / m.heads) as f64).sqrt();
        mixtral
            .insert(p("self_attn.q_proj.weight"), (take(&p("self_attn.q_proj.weight")) * q_factor).unwrap());
        mixtral.insert(p("self_attn.o_proj.weight"), (take(&p("self_attn.o_proj.weight")) * 0.22).unwrap());
        mixtral.insert(p("block_sparse_moe.gate.weight"), take(&p("block_sparse_moe.router.layer.weight")));
        let input = take(&p("block_sparse_moe.input_linear.weight"));
        let output = take(&p("block_sparse_moe.output_linear.weight"));
        for e in 0..experts {
            let x = |w: &str| p(&format!("block_sparse_moe.experts.{e}.{w}.weight"));
            let gate_up = input.get(e).unwrap();
            mixtral.insert(x("w1"), gate_up.narrow(0, 0, ffn).unwrap().contiguous().unwrap());
            mixtral.insert(x("w3"), gate_up.narrow(0, ffn, ffn).unwrap().contiguous().unwrap());
            mixtral.insert(x("w2"), (output.get(e).unwrap() * 0.22).unwrap());
        }
    }
    mixtral.extend(t);
    let cfg: mixtral::Config = serde_json::from_value(m.config()).unwrap();
    let vb = VarBuilder::from_tensors(mixtral, DType::F32, &Device::Cpu);
    let mut model = mixtral::Model::new(&cfg, vb).unwrap();
    move |ids, pos| model.forward(&batch_of_one(ids), pos).unwrap().flatten_all().unwrap().to_vec1().unwrap()
}

/// candle's Llama on `config` (HF's config.json) with the weights in `dir`: `forward(ids, pos)`
/// for [`tiny_matches_candle`].
fn candle_llama_forward(config: serde_json::Value, dir: &Path) -> impl FnMut(&[u32], usize) -> Vec<f32> {
    let cfg: llama::LlamaConfig = serde_json::from_value(config).unwrap();
    let cfg = cfg.into_config(false);
    let model = llama::Llama::load(candle_weights(dir), &cfg).unwrap();
    let mut cache = llama::Cache::new(true, DType::F32, &cfg, &Device::Cpu).unwrap();
    move |ids, pos| {
        let logits = model.forward(&batch_of_one(ids), pos, &mut cache).unwrap();
        logits.flatten_all().unwrap().to_vec1().unwrap()
    }
}

/// Llama 3.1's RoPE scaled by wavelength (some frequencies unscaled, some on the ramp, the
/// rest scaled), against candle's `llama`; split over two ranks by heads and by layers, the
/// same tokens and logits within 1e-4 of the single rank.
#[test]
fn random_llama3_rope_scaling_matches_candle_on_one_and_two_ranks() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let m = gridlm_reference::TinyModel::llama3();
    m.write(dir);
    let single = tiny_matches_candle("random llama3", dir, candle_llama_forward(m.config(), dir));
    same_on_two_ranks("random llama3", dir, &single, &[&["--tp", "2"], &["--pp", "2"]]);
}

/// The model in `dir` on two local ranks under each of `grids`: `single`'s tokens, and logits
/// within 1e-4 of it.
fn same_on_two_ranks(name: &str, dir: &Path, single: &Run, grids: &[&[&str]]) {
    same_on_ranks(name, dir, single, "2", grids)
}

/// [`same_on_two_ranks`] on `ranks` local ranks.
fn same_on_ranks(name: &str, dir: &Path, single: &Run, ranks: &str, grids: &[&[&str]]) {
    for grid in grids {
        let mut args = TINY_PROMPT.to_vec();
        args.extend(*grid);
        args.extend(["--threads", "1"]);
        let run = generate_on(&["local", ranks], dir, &args);
        let d = max_abs_diff(&run.logits, &single.logits);
        eprintln!("{name} {grid:?}: max |Δ logits| vs single rank = {d:.2e}");
        assert_eq!(run.token_ids, single.token_ids, "{name} {grid:?}: greedy tokens differ");
        assert!(d <= 1e-4, "{name} {grid:?}: logits differ from the single-rank run by {d}");
    }
}

/// `gridlm convert --dtype f32` of `gguf` into `out`; its tensors.
fn convert_f32(gguf: &Path, out: &Path) -> std::collections::HashMap<String, Tensor> {
    let mut cmd = std::process::Command::new(gridlm_bin());
    cmd.args(["convert", "--dtype", "f32", "--gguf"]).arg(gguf).arg("--out").arg(out);
    let o = run_with_timeout(cmd, 120);
    assert!(o.status.success(), "convert failed:\n{}", String::from_utf8_lossy(&o.stderr));
    candle_core::safetensors::load(out.join("model.safetensors"), &Device::Cpu).unwrap()
}

/// A byte-level BPE vocabulary of `size` tokens for GGUF metadata: the 256 byte characters,
/// then merges of them: a space and a letter, common pairs (44 in all, for a vocabulary of 300),
/// then vowel-led pairs for a larger one.
fn byte_level_vocabulary(size: usize) -> (Vec<String>, Vec<String>) {
    let chars = byte_chars();
    let space = chars[b' ' as usize].to_string();
    let pairs: Vec<(String, String)> = ('a'..='z')
        .map(|c| (space.clone(), c.to_string()))
        .chain(
            [
                "th", "he", "in", "er", "an", "re", "on", "at", "en", "nd", "ti", "es", "or", "te", "of",
                "ed", "is", "it",
            ]
            .iter()
            .map(|p| (p[..1].to_string(), p[1..].to_string())),
        )
        .collect();
    // More vowel-led pairs where the vocabulary is larger.
    let more = "aeiou".chars().flat_map(|a| ('a'..='z').map(move |b| (a.to_string(), b.to_string())));
    let mut pairs = pairs;
    for pair in more {
        if 256 + pairs.len() >= size {
            break;
        }
        if !pairs.contains(&pair) {
            pairs.push(pair);
        }
    }
    let mut tokens: Vec<String> = chars.iter().map(|c| c.to_string()).collect();
    tokens.extend(pairs.iter().map(|(a, b)| format!("{a}{b}")));
    assert_eq!(tokens.len(), size);
    (tokens, pairs.iter().map(|(a, b)| format!("{a} {b}")).collect())
}

/// The GGUF metadata of a byte-level vocabulary (`tokens`, `merges`) whose pre-tokenizer is
/// `pre`, token 0 its end.
fn byte_level_meta(pre: &str, tokens: Vec<String>, merges: Vec<String>) -> Vec<(String, GgufValue)> {
    let n = tokens.len();
    vec![
        ("tokenizer.ggml.model".into(), GgufValue::Str("gpt2".into())),
        ("tokenizer.ggml.pre".into(), GgufValue::Str(pre.into())),
        ("tokenizer.ggml.tokens".into(), GgufValue::Strs(tokens)),
        ("tokenizer.ggml.token_type".into(), GgufValue::I32s(vec![1; n])),
        ("tokenizer.ggml.merges".into(), GgufValue::Strs(merges)),
        ("tokenizer.ggml.eos_token_id".into(), GgufValue::U32(0)),
    ]
}

/// The GGUF metadata llama.cpp writes for the Qwen model `m` (`arch` qwen3, or qwen2moe or
/// qwen3moe with its experts) with this vocabulary.
fn qwen3_gguf_meta(
    m: &gridlm_reference::TinyModel,
    arch: &str,
    tokens: Vec<String>,
    merges: Vec<String>,
) -> Vec<(String, GgufValue)> {
    let u = |v: usize| GgufValue::U32(v as u32);
    let mut meta = vec![
        ("general.architecture".to_string(), GgufValue::Str(arch.into())),
        (format!("{arch}.block_count"), u(m.layers)),
        (format!("{arch}.context_length"), u(m.max_pos)),
        (format!("{arch}.embedding_length"), u(m.hidden)),
        // As HF's config has it (Mixtral's is its experts' width).
        (
            format!("{arch}.feed_forward_length"),
            u(m.config()["intermediate_size"].as_u64().unwrap() as usize),
        ),
        (format!("{arch}.attention.head_count"), u(m.heads)),
        (format!("{arch}.attention.head_count_kv"), u(m.kv_heads)),
        (format!("{arch}.attention.key_length"), u(m.head_dim.unwrap_or(m.hidden / m.heads))),
        (format!("{arch}.attention.layer_norm_rms_epsilon"), GgufValue::F32(1e-6)),
        (format!("{arch}.rope.freq_base"), GgufValue::F32(10000.0)),
    ];
    meta.extend(byte_level_meta("qwen2", tokens, merges));
    if let Some((experts, per_token, width)) = m.experts {
        meta.push((format!("{arch}.expert_count"), u(experts)));
        meta.push((format!("{arch}.expert_used_count"), u(per_token)));
        meta.push((format!("{arch}.expert_feed_forward_length"), u(width)));
    }
    meta
}

/// The random model `m` written as a GGUF of architecture `arch` as llama.cpp stores one — a
/// llama's q and k rows interleaved, Llama 3's RoPE scaling as `rope_freqs.weight`, each
/// layer's experts stacked in one `ffn_{gate,up,down}_exps` tensor, the router as
/// `ffn_gate_inp`, a shared expert as `ffn_*_shexp` with its gate a vector — converted (f32)
/// into `dir`, which must then hold exactly `m`'s tensors.
fn gguf_converts_to_the_model_it_holds(m: &gridlm_reference::TinyModel, arch: &str, dir: &Path) {
    gguf_with_converts_to_the_model_it_holds(m, arch, dir, Vec::new(), Vec::new());
}

/// [`gguf_converts_to_the_model_it_holds`] of a GGUF that also holds the metadata `more_meta`
/// (in place of the same keys) and the tensors `more` (not weights: the converted folder must
/// not hold them).
fn gguf_with_converts_to_the_model_it_holds(
    m: &gridlm_reference::TinyModel,
    arch: &str,
    dir: &Path,
    more_meta: Vec<(String, GgufValue)>,
    more: Vec<(String, Vec<usize>, Vec<f32>)>,
) {
    let experts = m.experts.map_or(0, |(experts, _, _)| experts);
    let tensors = m.tensors();
    let (tokens, merges) = byte_level_vocabulary(m.vocab);
    let mut meta = qwen3_gguf_meta(m, arch, tokens, merges);
    if m.model_type == "phi3" {
        meta.push(("phi3.attention.sliding_window".into(), GgufValue::U32(m.max_pos as u32)));
        meta.push(("phi3.rope.dimension_count".into(), GgufValue::U32((m.hidden / m.heads) as u32)));
    }
    if m.llama3_rope.is_some() {
        // As Llama 3's: a BOS token before every text.
        meta.push(("tokenizer.ggml.bos_token_id".into(), GgufValue::U32(LLAMA3_BOS)));
        meta.push(("tokenizer.ggml.add_bos_token".into(), GgufValue::Bool(true)));
    }
    if let Some((_, shape, _)) = tensors.iter().find(|t| t.0.ends_with("shared_expert.gate_proj.weight")) {
        meta.push((format!("{arch}.expert_shared_feed_forward_length"), GgufValue::U32(shape[0] as u32)));
    }
    meta.retain(|(k, _)| more_meta.iter().all(|(m, _)| m != k));
    meta.extend(more_meta);
    let mut gguf_tensors: Vec<(String, Vec<usize>, Vec<f32>)> = more;
    let permuted = arch == "llama" || arch == "olmo" || arch.starts_with("granite");
    for (n, shape, v) in &tensors {
        let Some((layer, rest)) = n.strip_prefix("model.layers.").and_then(|r| r.split_once('.')) else {
            gguf_tensors.push((rename_tensor(n, false).unwrap(), shape.clone(), v.clone()));
            continue;
        };
        let blk = |name: &str| format!("blk.{layer}.{name}.weight");
        // Mixtral's names, as Qwen-MoE's.
        let rest = rest.replace("block_sparse_moe.", "mlp.").replace("w1.", "gate_proj.");
        let rest = rest.replace("w3.", "up_proj.").replace("w2.", "down_proj.");
        if rest == "mlp.gate.weight" || rest == "mlp.router.layer.weight" {
            gguf_tensors.push((blk("ffn_gate_inp"), shape.clone(), v.clone()));
        } else if rest == "mlp.input_linear.weight" {
            // GraniteMoE's stack of each expert's gate and up rows, as llama.cpp splits it.
            let (rows, cols) = (shape[1] / 2, shape[2]);
            let half = |second: usize| -> Vec<f32> {
                v.chunks(2 * rows * cols)
                    .flat_map(|e| e[second * rows * cols..][..rows * cols].to_vec())
                    .collect()
            };
            gguf_tensors.push((blk("ffn_gate_exps"), vec![shape[0], rows, cols], half(0)));
            gguf_tensors.push((blk("ffn_up_exps"), vec![shape[0], rows, cols], half(1)));
        } else if rest == "mlp.output_linear.weight" {
            gguf_tensors.push((blk("ffn_down_exps"), shape.clone(), v.clone()));
        } else if rest == "mlp.shared_expert_gate.weight" {
            gguf_tensors.push((blk("ffn_gate_inp_shexp"), vec![shape[1]], v.clone()));
        } else if let Some(which) = rest.strip_prefix("mlp.shared_expert.") {
            let part = which.trim_end_matches("_proj.weight");
            gguf_tensors.push((blk(&format!("ffn_{part}_shexp")), shape.clone(), v.clone()));
        } else if let Some(which) = rest.strip_prefix("mlp.experts.0.") {
            // Expert 0's tensor stands for the stack of every expert's, in order.
            let stacked: Vec<f32> = (0..experts)
                .flat_map(|e| {
                    let name = n.replace("experts.0.", &format!("experts.{e}."));
                    tensors.iter().find(|t| t.0 == name).unwrap().2.clone()
                })
                .collect();
            let part = which.trim_end_matches("_proj.weight");
            gguf_tensors.push((blk(&format!("ffn_{part}_exps")), vec![experts, shape[0], shape[1]], stacked));
        } else if !rest.starts_with("mlp.experts.") {
            // llama.cpp interleaves the halves of each q and k head of a llama.
            let heads = match rest.as_str() {
                "self_attn.q_proj.weight" if permuted => m.heads,
                "self_attn.k_proj.weight" if permuted => m.kv_heads,
                _ => 0,
            };
            let v = if heads > 0 { permute_heads(v, heads, shape[1]) } else { v.clone() };
            gguf_tensors.push((rename_tensor(n, false).unwrap(), shape.clone(), v));
        }
    }
    if let Some(scaling) = m.llama3_rope {
        gguf_tensors.push((
            "rope_freqs.weight".into(),
            vec![m.hidden / m.heads / 2],
            llama_cpp_rope_factors(scaling, 10000.0, m.hidden / m.heads),
        ));
    }
    let gguf = dir.with_extension("gguf");
    write_gguf(&gguf, &meta, &gguf_tensors);
    let converted = convert_f32(&gguf, dir);
    assert_eq!(converted.len(), tensors.len());
    for (n, shape, v) in &tensors {
        let t = converted.get(n).unwrap_or_else(|| panic!("{n} missing"));
        assert_eq!((t.dims(), &t.flatten_all().unwrap().to_vec1::<f32>().unwrap()), (&shape[..], v), "{n}");
    }
}

/// Rows of `v` (`cols` wide, `heads` heads) as llama.cpp stores a llama's q and k: each head's
/// rows as (row pairs of its halves) — its row `2j + k` is the head's row `k · hd/2 + j`.
fn permute_heads(v: &[f32], heads: usize, cols: usize) -> Vec<f32> {
    let hd = v.len() / cols / heads;
    let mut out = Vec::with_capacity(v.len());
    for h in 0..heads {
        for j in 0..hd / 2 {
            for k in 0..2 {
                let row = h * hd + k * hd / 2 + j;
                out.extend_from_slice(&v[row * cols..(row + 1) * cols]);
            }
        }
    }
    out
}

/// The config.json converted into `dir`, after checking the fields of `want`, with the
/// sliding-window fields candle's Qwen configs ask for (gridlm needs none).
fn converted_config(dir: &Path, want: serde_json::Value, layers: usize) -> serde_json::Value {
    let mut cfg = folder_config(dir);
    for (key, want) in want.as_object().unwrap() {
        assert_eq!(&cfg[key], want, "config.json's {key}");
    }
    cfg["max_window_layers"] = layers.into();
    cfg["use_sliding_window"] = false.into();
    cfg
}

/// Qwen3-MoE with its shares renormalized against candle's `qwen3_moe`; stored as Qwen3-VL-MoE's
/// image-and-text folder — each layer's experts in two transposed stacks
/// (`mlp.experts.gate_up_proj` `[experts, hidden, 2 · ffn]`, `mlp.experts.down_proj`
/// `[experts, ffn, hidden]`), the tensors under `model.language_model.`, the shares renormalized
/// without `norm_topk_prob` — the same bits, and split over two ranks by heads and the experts'
/// columns (each rank reading its columns of the stacks) and by layers, the same tokens and
/// logits within 1e-4.
#[test]
fn random_qwen3_moe_as_qwen3_vl_moe_matches_candle() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let m = gridlm_reference::TinyModel::qwen3_moe();
    let (experts, _, ffn) = m.experts.unwrap();
    m.write(dir);
    let mut cfg = folder_config(dir);
    cfg["norm_topk_prob"] = true.into();
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    let candle_cfg: qwen3_moe::Config = serde_json::from_value(cfg.clone()).unwrap();
    let mut model = qwen3_moe::ModelForCausalLM::new(&candle_cfg, candle_weights(dir)).unwrap();
    let single = tiny_matches_candle("random qwen3_moe, shares renormalized", dir, |ids, pos| {
        model.forward(&batch_of_one(ids), pos).unwrap().flatten_all().unwrap().to_vec1().unwrap()
    });
    let vl = tmp.path().join("vl");
    std::fs::create_dir(&vl).unwrap();
    std::fs::copy(dir.join("tokenizer.json"), vl.join("tokenizer.json")).unwrap();
    let mut text_config = cfg.clone();
    text_config["model_type"] = "qwen3_vl_moe_text".into();
    text_config.as_object_mut().unwrap().remove("norm_topk_prob");
    let config = serde_json::json!({
        "model_type": "qwen3_vl_moe", "text_config": text_config, "vision_config": {"depth": 1},
        "tie_word_embeddings": m.tied,
    });
    std::fs::write(vl.join("config.json"), config.to_string()).unwrap();
    let tensors = m.tensors();
    let find = |name: String| tensors.iter().find(|t| t.0 == name).unwrap().2.clone();
    // Rows of `v` ([rows, cols]) as columns.
    let turn = |v: &[f32], rows: usize| -> Vec<f32> {
        let cols = v.len() / rows;
        (0..cols).flat_map(|c| (0..rows).map(move |r| v[r * cols + c])).collect()
    };
    let h = m.hidden;
    let mut stored = Vec::new();
    for (name, shape, v) in &tensors {
        if name.contains(".mlp.experts.") {
            if let Some(layer) = name.strip_suffix(".mlp.experts.0.gate_proj.weight") {
                let x = |e: usize, w: &str| find(format!("{layer}.mlp.experts.{e}.{w}_proj.weight"));
                let mut gate_up = Vec::new();
                let mut down = Vec::new();
                for e in 0..experts {
                    let (g, u) = (turn(&x(e, "gate"), ffn), turn(&x(e, "up"), ffn));
                    gate_up.extend(
                        (0..h)
                            .flat_map(|r| [&g[r * ffn..(r + 1) * ffn], &u[r * ffn..(r + 1) * ffn]].concat()),
                    );
                    down.extend(turn(&x(e, "down"), h));
                }
                let layer = layer.replacen("model.", "model.language_model.", 1);
                stored.push((
                    format!("{layer}.mlp.experts.gate_up_proj"),
                    vec![experts, h, 2 * ffn],
                    gate_up,
                ));
                stored.push((format!("{layer}.mlp.experts.down_proj"), vec![experts, ffn, h], down));
            }
            continue;
        }
        let name = name.replacen("model.", "model.language_model.", 1);
        stored.push((name, shape.clone(), v.clone()));
    }
    stored.push(("model.visual.blocks.0.attn.qkv.weight".into(), vec![8, 4], vec![0.5; 32]));
    gridlm_reference::write_safetensors(&vl.join("model.safetensors"), &stored);
    let run = generate(&vl, &TINY_PROMPT);
    assert_eq!(run.token_ids, single.token_ids, "qwen3_vl_moe folder: greedy tokens differ");
    assert_eq!(run.logits, single.logits, "qwen3_vl_moe folder: logits differ");
    same_on_two_ranks("random qwen3_vl_moe", &vl, &single, &[&["--tp", "2"], &["--pp", "2"]]);
}

/// The text models of Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE as llama.cpp writes them
/// (`qwen2vl`, `qwen3vl`, `qwen3vlmoe`, with M-RoPE's `rope.dimension_sections`) convert into
/// the Qwen2, Qwen3 and Qwen3-MoE they hold (the last with its shares renormalized, as HF's
/// Qwen3-VL-MoE and llama.cpp do), on which gridlm agrees with candle's.
#[test]
fn qwen_vl_ggufs_convert_to_their_text_models() {
    let tmp = tempfile::tempdir().unwrap();
    let sections =
        |arch: &str| vec![(format!("{arch}.rope.dimension_sections"), GgufValue::I32s(vec![4, 2, 2, 0]))];
    let out = tmp.path().join("qwen2vl");
    let m = gridlm_reference::TinyModel::qwen2();
    gguf_with_converts_to_the_model_it_holds(&m, "qwen2vl", &out, sections("qwen2vl"), Vec::new());
    let want = serde_json::json!({"model_type": "qwen2", "attention_bias": true});
    let mut cfg = converted_config(&out, want, m.layers);
    cfg["sliding_window"] = m.max_pos.into();
    let cfg: qwen2::Config = serde_json::from_value(cfg).unwrap();
    let mut model = qwen2::ModelForCausalLM::new(&cfg, candle_weights(&out)).unwrap();
    tiny_matches_candle("converted qwen2vl", &out, |ids, pos| {
        model.forward(&batch_of_one(ids), pos).unwrap().flatten_all().unwrap().to_vec1().unwrap()
    });
    let out = tmp.path().join("qwen3vl");
    let m = gridlm_reference::TinyModel::qwen3();
    gguf_with_converts_to_the_model_it_holds(&m, "qwen3vl", &out, sections("qwen3vl"), Vec::new());
    let mut cfg = converted_config(&out, serde_json::json!({"model_type": "qwen3"}), m.layers);
    cfg["sliding_window"] = serde_json::Value::Null;
    let cfg: qwen3::Config = serde_json::from_value(cfg).unwrap();
    let mut model = qwen3::ModelForCausalLM::new(&cfg, candle_weights(&out)).unwrap();
    tiny_matches_candle("converted qwen3vl", &out, |ids, pos| {
        model.forward(&batch_of_one(ids), pos).unwrap().flatten_all().unwrap().to_vec1().unwrap()
    });
    let out = tmp.path().join("qwen3vlmoe");
    let m = gridlm_reference::TinyModel::qwen3_moe();
    gguf_with_converts_to_the_model_it_holds(&m, "qwen3vlmoe", &out, sections("qwen3vlmoe"), Vec::new());
    let want = serde_json::json!({"model_type": "qwen3_moe", "norm_topk_prob": true});
    let mut cfg = converted_config(&out, want, m.layers);
    cfg["sliding_window"] = serde_json::Value::Null;
    let cfg: qwen3_moe::Config = serde_json::from_value(cfg).unwrap();
    let mut model = qwen3_moe::ModelForCausalLM::new(&cfg, candle_weights(&out)).unwrap();
    tiny_matches_candle("converted qwen3vlmoe", &out, |ids, pos| {
        model.forward(&batch_of_one(ids), pos).unwrap().flatten_all().unwrap().to_vec1().unwrap()
    });
}

/// A Qwen3-MoE GGUF (every second layer dense) converts into the model it holds (the dense
/// layers found as every `decoder_sparse_step`-th), on which gridlm agrees with candle's
/// `qwen3_moe`.
#[test]
fn a_qwen3_moe_gguf_converts_to_the_model_it_holds() {
    let tmp = tempfile::tempdir().unwrap();
    let m = gridlm_reference::TinyModel::qwen3_moe();
    let out = tmp.path().join("folder");
    gguf_converts_to_the_model_it_holds(&m, "qwen3moe", &out);
    let want = serde_json::json!({
        "model_type": "qwen3_moe", "num_experts": 6, "num_experts_per_tok": 3,
        "moe_intermediate_size": 40, "decoder_sparse_step": 2, "mlp_only_layers": [],
        "intermediate_size": m.inter, "norm_topk_prob": true,
    });
    let mut cfg = converted_config(&out, want, m.layers);
    cfg["sliding_window"] = serde_json::Value::Null;
    let cfg: qwen3_moe::Config = serde_json::from_value(cfg).unwrap();
    let mut model = qwen3_moe::ModelForCausalLM::new(&cfg, candle_weights(&out)).unwrap();
    tiny_matches_candle("converted qwen3_moe", &out, |ids, pos| {
        model.forward(&batch_of_one(ids), pos).unwrap().flatten_all().unwrap().to_vec1().unwrap()
    });
}

/// A Mixtral GGUF (a llama with experts: q and k rows interleaved, every layer sparse)
/// converts into the model it holds, on which gridlm agrees with candle's `mixtral`.
#[test]
fn a_mixtral_gguf_converts_to_the_model_it_holds() {
    let tmp = tempfile::tempdir().unwrap();
    let m = gridlm_reference::TinyModel::mixtral();
    let out = tmp.path().join("folder");
    gguf_converts_to_the_model_it_holds(&m, "llama", &out);
    let want = serde_json::json!({
        "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 64,
    });
    let mut cfg = converted_config(&out, want, m.layers);
    (cfg["sliding_window"], cfg["use_flash_attn"]) = (m.max_pos.into(), false.into());
    let cfg: mixtral::Config = serde_json::from_value(cfg).unwrap();
    let mut model = mixtral::Model::new(&cfg, candle_weights(&out)).unwrap();
    tiny_matches_candle("converted mixtral", &out, |ids, pos| {
        model.forward(&batch_of_one(ids), pos).unwrap().flatten_all().unwrap().to_vec1().unwrap()
    });
}

/// The BOS token of the Llama 3-style GGUF the tests write.
const LLAMA3_BOS: u32 = 2;

/// A Llama 3.1-style GGUF (its RoPE scaling as llama.cpp writes it: a divisor of each
/// frequency, the tensor `rope_freqs.weight`; a BOS token before every text) converts into the
/// model it holds, its config's `rope_scaling` HF's `llama3` numbers, its tokenizer putting the
/// BOS token first; gridlm on it agrees with candle's `llama` on the original config.
#[test]
fn a_llama3_gguf_converts_to_the_model_it_holds() {
    let tmp = tempfile::tempdir().unwrap();
    let m = gridlm_reference::TinyModel::llama3();
    let out = tmp.path().join("folder");
    gguf_converts_to_the_model_it_holds(&m, "llama", &out);
    let [factor, low, high, old] = m.llama3_rope.unwrap();
    let want = serde_json::json!({"rope_scaling": {
        "rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
        "original_max_position_embeddings": old as u64,
    }});
    converted_config(&out, want, m.layers);
    let run = tiny_matches_candle("converted llama3", &out, candle_llama_forward(m.config(), &out));
    assert_eq!(run.prompt_ids[0], LLAMA3_BOS, "{:?}", run.prompt_ids);
    assert_eq!(run.prompt_ids.iter().filter(|&&t| t == LLAMA3_BOS).count(), 1, "{:?}", run.prompt_ids);
}

/// A GLM-4 GGUF as llama.cpp writes one (gate and up rows as `ffn_up`, the output norms as
/// `post_attention_norm` and `post_ffw_norm`, q and k rows as HF has them, the rotated part of a
/// head as `rope.dimension_count`, the `glm4` vocabulary with a BOS token it asks for, which
/// llama.cpp never puts first) converts into the model it holds, its config saying half of each
/// head rotated and the q/k/v biases; gridlm on it agrees with candle's `glm4_new`, and no BOS
/// token comes first. Without `rope.dimension_count` the whole head is rotated, as llama.cpp
/// reads it, which the folder must say (HF's default is half).
#[test]
fn a_glm4_gguf_converts_to_the_model_it_holds() {
    let tmp = tempfile::tempdir().unwrap();
    let m = gridlm_reference::TinyModel::glm4();
    let out = tmp.path().join("folder");
    let meta = |rotated: Option<u32>| {
        let mut meta = vec![
            ("tokenizer.ggml.pre".to_string(), GgufValue::Str("glm4".into())),
            ("tokenizer.ggml.bos_token_id".into(), GgufValue::U32(LLAMA3_BOS)),
            ("tokenizer.ggml.add_bos_token".into(), GgufValue::Bool(true)),
        ];
        meta.extend(rotated.map(|d| ("glm4.rope.dimension_count".to_string(), GgufValue::U32(d))));
        meta
    };
    gguf_with_converts_to_the_model_it_holds(&m, "glm4", &out, meta(Some(8)), Vec::new());
    let want =
        serde_json::json!({"model_type": "glm4", "partial_rotary_factor": 0.5, "attention_bias": true});
    let cfg: glm4_new::Config = serde_json::from_value(converted_config(&out, want, m.layers)).unwrap();
    let mut model = glm4_new::ModelForCausalLM::new(&cfg, candle_weights(&out)).unwrap();
    let run = tiny_matches_candle("converted glm4", &out, |ids, pos| {
        model.forward(&batch_of_one(ids), pos).unwrap().flatten_all().unwrap().to_vec1().unwrap()
    });
    assert!(!run.prompt_ids.contains(&LLAMA3_BOS), "{:?}", run.prompt_ids);
    let whole = tmp.path().join("whole");
    gguf_with_converts_to_the_model_it_holds(&m, "glm4", &whole, meta(None), Vec::new());
    converted_config(&whole, serde_json::json!({"partial_rotary_factor": 1.0}), m.layers);
}

/// A Phi-3 GGUF (q, k and v rows fused as `attn_qkv`, gate and up as `ffn_up`, a sliding window
/// in the metadata) converts into the model it holds, on which gridlm agrees with candle's
/// `phi3`.
#[test]
fn a_phi3_gguf_converts_to_the_model_it_holds() {
    let tmp = tempfile::tempdir().unwrap();
    let m = gridlm_reference::TinyModel::phi3();
    let out = tmp.path().join("folder");
    gguf_converts_to_the_model_it_holds(&m, "phi3", &out);
    let want =
        serde_json::json!({"model_type": "phi3", "sliding_window": m.max_pos, "tie_word_embeddings": false});
    let cfg = converted_config(&out, want, m.layers);
    let cfg: phi3::Config = serde_json::from_value(cfg).unwrap();
    let mut model = phi3::Model::new(&cfg, candle_weights(&out)).unwrap();
    tiny_matches_candle("converted phi3", &out, |ids, pos| {
        model.forward(&batch_of_one(ids), pos).unwrap().flatten_all().unwrap().to_vec1().unwrap()
    });
}

/// The prefix cache under LongRoPE ([`longrope_phi3`] with an original context of 40): three
/// prompts one after another, the first of 36 tokens, the second its first 32 and 12 more (44:
/// past the original context, so every position of it takes the long factors) and the third
/// its first 32 and 4 more (36). The third reads the first's two whole pages from the cache;
/// the second reads none (the first rotated them by the short factors), and each brings the
/// tokens it brings alone. (Without the second's exclusion it reads 32 and brings others.)
#[test]
fn a_prompt_past_longropes_original_context_reads_no_cached_pages() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("model");
    std::fs::create_dir_all(&dir).unwrap();
    gridlm_reference::TinyModel::phi3().write(&dir);
    let mut cfg = folder_config(&dir);
    cfg.as_object_mut().unwrap().extend(longrope_phi3().0.as_object().unwrap().clone());
    cfg["original_max_position_embeddings"] = 40.into();
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    let words =
        |range: std::ops::Range<usize>| range.map(|i| format!("t{}", 11 * i % 300)).collect::<Vec<_>>();
    let first = words(0..36);
    let prompts =
        [first.clone(), [&first[..32], &words(40..52)].concat(), [&first[..32], &words(60..64)].concat()];
    let prompts: Vec<String> = prompts.iter().map(|p| p.join(" ")).collect();
    let file = tmp.path().join("prompts.jsonl");
    let lines: Vec<String> = prompts.iter().map(|p| serde_json::json!({"prompt": p}).to_string()).collect();
    std::fs::write(&file, lines.join("\n")).unwrap();
    let mut cmd = std::process::Command::new(gridlm_bin());
    cmd.args(["generate", "--model"]).arg(&dir).arg("--prompts-file").arg(&file);
    cmd.args([
        "--max-tokens",
        "8",
        "--ignore-eos",
        "--max-batch",
        "1",
        "--kv-mem-mib",
        "4",
        "--kv-dtype",
        "f32",
        "--json",
    ]);
    let o = run_with_timeout(cmd, 120);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let results = v["results"].as_array().unwrap();
    let cached: Vec<u64> = results.iter().map(|r| r["cached_tokens"].as_u64().unwrap()).collect();
    for (r, p) in results.iter().zip(&prompts) {
        let alone = generate(&dir, &["--prompt", p, "--max-tokens", "8", "--kv-dtype", "f32"]);
        let ids: Vec<u64> = r["token_ids"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap()).collect();
        let want: Vec<u64> = alone.token_ids.iter().map(|&t| t as u64).collect();
        assert_eq!(ids, want, "{p}: differs from its run alone");
    }
    assert_eq!(cached, [0, 0, 32]);
}

/// A Phi-4-mini-style GGUF ([`longrope_phi3`] as llama.cpp writes it: RoPE over
/// `rope.dimension_count` of a head's dimensions, LongRoPE's factors as the tensors
/// `rope_factors_short.weight` and `rope_factors_long.weight`, the original context and the
/// attention factor as metadata) converts into the model it holds, its config HF's
/// `partial_rotary_factor` and `longrope` `rope_scaling`, on which gridlm agrees with candle.
#[test]
fn a_longrope_phi3_gguf_converts_to_the_model_it_holds() {
    let tmp = tempfile::tempdir().unwrap();
    let m = gridlm_reference::TinyModel::phi3();
    let out = tmp.path().join("folder");
    let (fields, short, long) = longrope_phi3();
    let meta = vec![
        ("phi3.rope.dimension_count".to_string(), GgufValue::U32(12)),
        ("phi3.rope.scaling.original_context_length".into(), GgufValue::U32(16)),
        ("phi3.rope.scaling.attn_factor".into(), GgufValue::F32(2f32.sqrt())),
    ];
    let f32s = |v: &[f64]| v.iter().map(|&x| x as f32).collect::<Vec<f32>>();
    let factors = vec![
        ("rope_factors_short.weight".to_string(), vec![6], f32s(&short)),
        ("rope_factors_long.weight".to_string(), vec![6], f32s(&long)),
    ];
    gguf_with_converts_to_the_model_it_holds(&m, "phi3", &out, meta, factors);
    let cfg = converted_config(&out, fields, m.layers);
    assert!(cfg["rope_scaling"].get("attention_factor").is_none(), "HF's own: {}", cfg["rope_scaling"]);
    let candle = candle_longrope_phi3(&m, &out, &cfg, &tmp.path().join("candle"));
    // A prompt of 8 byte-level tokens, within the original context, and 32 new past it.
    let args = ["--prompt", "t5 t17 t42", "--max-tokens", "32", "--kv-dtype", "f32"];
    let run = tiny_matches_candle_with("converted longrope phi3", &out, &args, 32, candle);
    assert_eq!(run.prompt_ids.len(), 8, "{:?}", run.prompt_ids);
}

/// A Gemma-family GGUF as llama.cpp writes one — norms stored as they multiply (`1 + w`),
/// Gemma 2 and 3's sandwich norms as `post_attention_norm`, `ffn_norm` (the FFN's input) and
/// `post_ffw_norm`, q and k rows as HF has them, the window, local layers, local RoPE base and
/// soft caps as metadata — of the random model `m` (`arch` gemma, gemma2 or gemma3), converted
/// (f32) into `dir`: every tensor of `m` (norms within an f32 rounding of adding one and taking
/// it away) and the config fields of `want`; gridlm on the folder agrees with candle's
/// `forward` of the folder's config and weights.
fn a_gemma_gguf_converts<M>(
    m: &gridlm_reference::TinyModel,
    arch: &str,
    dir: &Path,
    more_meta: Vec<(String, GgufValue)>,
    want: serde_json::Value,
    candle: impl FnOnce(serde_json::Value, VarBuilder<'static>) -> M,
) where
    M: FnMut(&[u32], usize) -> Vec<f32>,
{
    let tensors = m.tensors();
    let (tokens, merges) = byte_level_vocabulary(m.vocab);
    let mut meta = qwen3_gguf_meta(m, arch, tokens, merges);
    meta.retain(|(k, _)| more_meta.iter().all(|(m, _)| m != k));
    meta.extend(more_meta);
    let sandwich = arch != "gemma";
    let gguf_tensors: Vec<(String, Vec<usize>, Vec<f32>)> = tensors
        .iter()
        .map(|(n, shape, v)| {
            let renamed = match n.rsplit_once("layers.").map(|(_, r)| r.split_once('.').unwrap()) {
                Some((layer, rest)) if sandwich => {
                    let gguf = match rest {
                        "post_attention_layernorm.weight" => Some("post_attention_norm.weight"),
                        "pre_feedforward_layernorm.weight" => Some("ffn_norm.weight"),
                        "post_feedforward_layernorm.weight" => Some("post_ffw_norm.weight"),
                        _ => None,
                    };
                    gguf.map(|g| format!("blk.{layer}.{g}"))
                }
                _ => None,
            };
            let name = renamed.unwrap_or_else(|| rename_tensor(n, false).unwrap_or_else(|| panic!("{n}")));
            let v = if n.ends_with("norm.weight") { v.iter().map(|x| x + 1.0).collect() } else { v.clone() };
            (name, shape.clone(), v)
        })
        .collect();
    let gguf = dir.with_extension("gguf");
    write_gguf(&gguf, &meta, &gguf_tensors);
    let converted = convert_f32(&gguf, dir);
    assert_eq!(converted.len(), tensors.len());
    for (n, shape, v) in &tensors {
        let t = converted.get(n).unwrap_or_else(|| panic!("{n} missing"));
        let got = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(t.dims(), &shape[..], "{n}");
        let tol = if n.ends_with("norm.weight") { 2.5e-7 } else { 0.0 };
        assert!(max_abs_diff(&got, v) <= tol, "{n}: {}", max_abs_diff(&got, v));
    }
    let cfg = folder_config(dir);
    for (key, want) in want.as_object().unwrap() {
        assert_eq!(&cfg[key], want, "config.json's {key}");
    }
    let mut forward = candle(cfg, candle_weights(dir));
    tiny_matches_candle(&format!("converted {arch}"), dir, |ids, pos| {
        // One token at a time, as candle's Gemma models take a prompt here.
        let mut logits = Vec::new();
        for (i, &id) in ids.iter().enumerate() {
            logits = forward(&[id], pos + i);
        }
        logits
    });
}

/// Candle's Gemma-family model `$arch` of a config and weights, as `(ids, pos) → last logits`
/// (each family its own types, hence a macro).
macro_rules! candle_gemma {
    ($arch:ident) => {
        |cfg: serde_json::Value, vb: VarBuilder<'static>| {
            let cfg: $arch::Config = serde_json::from_value(cfg).unwrap();
            let mut model = $arch::Model::new(false, &cfg, vb).unwrap();
            move |ids: &[u32], pos: usize| -> Vec<f32> {
                model.forward(&batch_of_one(ids), pos).unwrap().flatten_all().unwrap().to_vec1().unwrap()
            }
        }
    };
}

/// Gemma 3, 2 and the first Gemma as GGUFs ([`a_gemma_gguf_converts`]): Gemma 3 with its window
/// of 4, every third layer global (`sliding_window_pattern` 3), a global RoPE base of 10^6 and
/// a local one of 10^4, against candle's `gemma3`; Gemma 2 with soft caps of 1 and 2 and a
/// window of 64, against its `gemma2`; Gemma against its `gemma`.
#[test]
fn gemma_ggufs_convert_to_the_models_they_hold() {
    let tmp = tempfile::tempdir().unwrap();
    let (u, f) = (|v: u32| GgufValue::U32(v), |v: f32| GgufValue::F32(v));
    let m = gridlm_reference::TinyModel::gemma3();
    let meta = vec![
        ("gemma3.attention.sliding_window".to_string(), u(4)),
        ("gemma3.attention.sliding_window_pattern".into(), u(3)),
        ("gemma3.rope.freq_base".into(), f(1e6)),
        ("gemma3.rope.freq_base_swa".into(), f(1e4)),
    ];
    let want = serde_json::json!({
        "model_type": "gemma3_text", "sliding_window": 4, "sliding_window_pattern": 3,
        "rope_local_base_freq": 10000.0, "rope_theta": 1e6, "query_pre_attn_scalar": 32,
        "final_logit_softcapping": null, "hidden_activation": "gelu_pytorch_tanh",
    });
    a_gemma_gguf_converts(&m, "gemma3", &tmp.path().join("gemma3"), meta, want, candle_gemma!(gemma3));
    let m = gridlm_reference::TinyModel::gemma2();
    let meta = vec![
        ("gemma2.attention.sliding_window".to_string(), u(64)),
        ("gemma2.attn_logit_softcapping".into(), f(1.0)),
        ("gemma2.final_logit_softcapping".into(), f(2.0)),
    ];
    let want = serde_json::json!({
        "model_type": "gemma2", "sliding_window": 64, "sliding_window_pattern": 2,
        "attn_logit_softcapping": 1.0, "final_logit_softcapping": 2.0, "query_pre_attn_scalar": 32,
    });
    a_gemma_gguf_converts(&m, "gemma2", &tmp.path().join("gemma2"), meta, want, candle_gemma!(gemma2));
    let m = gridlm_reference::TinyModel::gemma();
    let want = serde_json::json!({"model_type": "gemma", "tie_word_embeddings": true, "head_dim": 32});
    a_gemma_gguf_converts(&m, "gemma", &tmp.path().join("gemma"), vec![], want, candle_gemma!(gemma));
}

/// A Qwen2-MoE GGUF (QKV biases, a shared expert beside the experts, its gate a vector)
/// converts into the model it holds, on which gridlm agrees with candle's `qwen2_moe`.
#[test]
fn a_qwen2_moe_gguf_converts_to_the_model_it_holds() {
    let tmp = tempfile::tempdir().unwrap();
    let m = gridlm_reference::TinyModel::qwen2_moe();
    let out = tmp.path().join("folder");
    gguf_converts_to_the_model_it_holds(&m, "qwen2moe", &out);
    let want = serde_json::json!({
        "model_type": "qwen2_moe", "num_experts": 6, "num_experts_per_tok": 2,
        "shared_expert_intermediate_size": 56, "norm_topk_prob": false, "attention_bias": true,
    });
    let mut cfg = converted_config(&out, want, m.layers);
    cfg["sliding_window"] = m.max_pos.into();
    let cfg: qwen2_moe::Config = serde_json::from_value(cfg).unwrap();
    let mut model = qwen2_moe::Model::new(&cfg, candle_weights(&out)).unwrap();
    tiny_matches_candle("converted qwen2_moe", &out, |ids, pos| {
        model.forward(&batch_of_one(ids), pos).unwrap().flatten_all().unwrap().to_vec1().unwrap()
    });
}

/// A GGUF whose matrices are llama.cpp's quantized types — the k-quants Q2_K to Q6_K and the
/// blocks of 32 Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 in turn, quantized by candle from a random
/// Qwen3-style model 256 wide (k-quant blocks are 256 long) — converts to exactly candle's own
/// dequantization of each tensor.
#[test]
fn a_quantized_gguf_converts_to_candle_dequantization() {
    use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
    let tmp = tempfile::tempdir().unwrap();
    let m = gridlm_reference::TinyModel {
        hidden: 256,
        inter: 512,
        heads: 4,
        kv_heads: 2,
        head_dim: Some(64),
        layers: 4,
        ..gridlm_reference::TinyModel::qwen3()
    };
    let (tokens, merges) = byte_level_vocabulary(m.vocab);
    let meta = qwen3_gguf_meta(&m, "qwen3", tokens, merges);
    let dev = Device::Cpu;
    // (candle's type, GGML's type id)
    let kinds = [
        (GgmlDType::Q2K, 10),
        (GgmlDType::Q3K, 11),
        (GgmlDType::Q4K, 12),
        (GgmlDType::Q5K, 13),
        (GgmlDType::Q6K, 14),
        (GgmlDType::Q4_0, 2),
        (GgmlDType::Q4_1, 3),
        (GgmlDType::Q5_0, 6),
        (GgmlDType::Q5_1, 7),
        (GgmlDType::Q8_0, 8),
    ];
    let mut counts = vec![0; kinds.len()];
    let raw: Vec<(String, Vec<usize>, u32, Vec<u8>)> = m
        .tensors()
        .into_iter()
        .enumerate()
        .map(|(i, (n, shape, v))| {
            let name = rename_tensor(&n, false).unwrap();
            if shape.len() == 1 {
                return (name, shape, 0, v.iter().flat_map(|x| x.to_le_bytes()).collect());
            }
            let (kind, id) = kinds[i % kinds.len()];
            counts[i % kinds.len()] += 1;
            let t = Tensor::from_vec(v, (shape[0], shape[1]), &dev).unwrap();
            let q = QTensor::quantize(&t, kind).unwrap();
            (name, shape, id, q.data().unwrap().into_owned())
        })
        .collect();
    assert!(counts.iter().all(|&c| c >= 2), "each kind on several matrices: {counts:?}");
    let gguf = tmp.path().join("k-quants.gguf");
    gridlm_reference::write_gguf_raw(&gguf, &meta, &raw);
    let out = tmp.path().join("folder");
    let converted = convert_f32(&gguf, &out);
    let mut f = std::fs::File::open(&gguf).unwrap();
    let content = gguf_file::Content::read(&mut f).unwrap();
    for (name, shape, ty, _) in &raw {
        let theirs = content.tensor(&mut f, name, &dev).unwrap().dequantize(&dev).unwrap();
        let hf = rename_tensor(name, true).unwrap();
        let mine = converted.get(&hf).unwrap_or_else(|| panic!("{hf} missing"));
        assert_eq!(mine.dims(), &shape[..], "{hf}");
        let (a, b): (Vec<f32>, Vec<f32>) = (
            mine.flatten_all().unwrap().to_vec1().unwrap(),
            theirs.flatten_all().unwrap().to_vec1().unwrap(),
        );
        assert!(max_abs_diff(&a, &b) <= 1e-6, "{name} (type {ty}) differs from candle's dequantization");
    }
}

/// A Qwen3 GGUF written here (f32 tensors under llama.cpp's names, a byte-level BPE vocabulary;
/// candle reads it back as written) converts into a folder holding exactly the model it was
/// written from, on which gridlm agrees with candle's Qwen3.
#[test]
fn a_qwen3_gguf_converts_to_the_model_it_holds() {
    use candle_core::quantized::gguf_file;
    let tmp = tempfile::tempdir().unwrap();
    let m = gridlm_reference::TinyModel::qwen3();
    let tensors = m.tensors();
    let (tokens, merges) = byte_level_vocabulary(m.vocab);
    let meta = qwen3_gguf_meta(&m, "qwen3", tokens, merges);
    let renamed: Vec<_> =
        tensors.iter().map(|(n, s, v)| (rename_tensor(n, false).unwrap(), s.clone(), v.clone())).collect();
    let gguf = tmp.path().join("tiny-qwen3.gguf");
    write_gguf(&gguf, &meta, &renamed);
    let dev = Device::Cpu;
    let mut f = std::fs::File::open(&gguf).unwrap();
    let content = gguf_file::Content::read(&mut f).unwrap();
    assert_eq!(content.tensor_infos.len(), renamed.len());
    for (n, shape, v) in &renamed {
        let t = content.tensor(&mut f, n, &dev).unwrap().dequantize(&dev).unwrap();
        assert_eq!((t.dims(), &t.flatten_all().unwrap().to_vec1::<f32>().unwrap()), (&shape[..], v), "{n}");
    }

    let out = tmp.path().join("folder");
    let converted = convert_f32(&gguf, &out);
    assert_eq!(converted.len(), tensors.len());
    for (n, shape, v) in &tensors {
        let t = converted.get(n).unwrap_or_else(|| panic!("{n} missing"));
        assert_eq!((t.dims(), &t.flatten_all().unwrap().to_vec1::<f32>().unwrap()), (&shape[..], v), "{n}");
    }
    let mut cfg = folder_config(&out);
    let want = serde_json::json!({"model_type": "qwen3", "head_dim": 16, "attention_bias": false, "tie_word_embeddings": true});
    for (key, want) in want.as_object().unwrap() {
        assert_eq!(&cfg[key], want, "config.json's {key}");
    }
    // candle's Qwen3 config also wants the window fields HF writes (and gridlm does not need).
    cfg["max_window_layers"] = m.layers.into();
    cfg["use_sliding_window"] = false.into();
    cfg["sliding_window"] = serde_json::Value::Null;
    let cfg: qwen3::Config = serde_json::from_value(cfg).unwrap();
    let mut model = qwen3::ModelForCausalLM::new(&cfg, candle_weights(&out)).unwrap();
    tiny_matches_candle("converted qwen3", &out, |ids, pos| {
        model.forward(&batch_of_one(ids), pos).unwrap().flatten_all().unwrap().to_vec1().unwrap()
    });
}

/// Every grid layout, started through the launch scripts, gives candle's 32 greedy tokens and
/// the single-rank logits within 1e-4. Layouts run one after another: they share two cores.
#[test]
fn every_grid_layout_matches_candle_and_single_rank() {
    let layouts: &[(&str, &[&str], &[&str])] = &[
        ("1x1", &["local", "1"], &["--pp", "1", "--tp", "1"]),
        ("1x2", &["local", "2"], &["--tp", "2"]),
        ("2x1", &["local", "2"], &["--pp", "2"]),
        ("2x2", &["local", "4"], &["--pp", "2", "--tp", "2"]),
        ("1x3", &["local", "3"], &["--tp", "3"]),
        ("3x1", &["local", "3"], &["--pp", "3", "--layers", "11,10,9"]),
        ("2x2 over two emulated nodes", &["emulated-nodes", "4"], &["--pp", "2", "--tp", "2"]),
    ];
    let dir = smollm2("f32");
    let prompt = [
        "--prompt",
        "Once upon a time, in a small village by the sea,",
        "--max-tokens",
        "32",
        "--kv-dtype",
        "f32",
    ];
    let single = generate(&dir, &prompt);
    let (_, ref_tokens, _) = candle_llama(&dir, &single.prompt_ids, N_TOKENS);
    assert_eq!(single.token_ids, ref_tokens, "single rank differs from candle");
    for (name, launcher, grid) in layouts {
        let mut args = prompt.to_vec();
        args.extend_from_slice(grid);
        args.extend(["--threads", "1"]);
        let run = generate_on(launcher, &dir, &args);
        let d = max_abs_diff(&run.logits, &single.logits);
        eprintln!("{name}: max |Δ logits| vs single rank = {d:.2e}");
        assert_eq!(run.token_ids, ref_tokens, "{name}: greedy tokens differ from candle");
        assert!(d <= 1e-4, "{name}: logits differ from the single-rank run by {d}");
        let ranks = run.json["ranks"].as_array().unwrap();
        let (pp, tp) = (run.json["pp"].as_u64().unwrap(), run.json["tp"].as_u64().unwrap());
        assert_eq!(ranks.len() as u64, pp * tp, "{name}: one memory report per rank");
    }
}
