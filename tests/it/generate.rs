//! `gridlm generate` as a user sees it: streamed text, JSON output, EOS handling.

use super::*;

fn json_of(out: &Output) -> serde_json::Value {
    assert!(out.status.success(), "gridlm failed:\n{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("one JSON object on stdout")
}

#[test]
fn json_output_has_the_documented_keys() {
    let (_t, dir) = tiny_llama();
    let out = gridlm(&[
        "generate",
        "--model",
        path_str(&dir),
        "--prompt",
        "t3 t4 t5",
        "--max-tokens",
        "5",
        "--ignore-eos",
        "--json",
    ]);
    let j = json_of(&out);
    for key in ["prompt_token_ids", "token_ids", "text", "prefill_ms", "decode_tokens_per_s", "ranks"] {
        assert!(j.get(key).is_some(), "missing key {key} in {j}");
    }
    assert_eq!(j["prompt_token_ids"], serde_json::json!([3, 4, 5]));
    assert_eq!(j["token_ids"].as_array().unwrap().len(), 5);
    assert_eq!(j["finish_reason"], "length");
    assert!(j["ranks"][0]["weight_bytes"].as_u64().unwrap() > 0);
    assert_eq!(j["ranks"][0]["allocations_per_step"].as_f64(), Some(0.0), "{j}");
    // Bench's comparison keys are bench's alone.
    let rank = j["ranks"][0].as_object().unwrap();
    assert!(rank.keys().all(|k| !k.starts_with("baseline_")), "{j}");
    // A prompt of one token: its prefill, the engine's first step, is not a decode step.
    let out =
        gridlm(&["generate", "--model", path_str(&dir), "--prompt", "t3", "--max-tokens", "5", "--json"]);
    let j = json_of(&out);
    assert_eq!(j["token_ids"].as_array().unwrap().len(), 5, "{j}");
    assert_eq!(j["ranks"][0]["allocations_per_step"].as_f64(), Some(0.0), "{j}");
}

/// `gridlm ARGS` streaming (succeeded), and the JSON object of `gridlm ARGS --json`.
fn streamed_and_json(args: &[&str]) -> (Output, serde_json::Value) {
    let streamed = gridlm(args);
    assert!(streamed.status.success(), "{}", String::from_utf8_lossy(&streamed.stderr));
    let mut with_json = args.to_vec();
    with_json.push("--json");
    (streamed, json_of(&gridlm(&with_json)))
}

#[test]
fn streamed_text_equals_json_text() {
    let dir = smollm2("bf16");
    let args = [
        "generate",
        "--model",
        path_str(&dir),
        "--prompt",
        "Write a haiku about the sea.",
        "--chat",
        "--max-tokens",
        "24",
    ];
    let (streamed, j) = streamed_and_json(&args);
    let text = String::from_utf8(streamed.stdout).unwrap();
    assert_eq!(text.trim_end_matches('\n'), j["text"].as_str().unwrap());
    assert!(!j["text"].as_str().unwrap().is_empty());
    // The summary on stderr names the finish as the JSON does, and the grid.
    let stderr = String::from_utf8_lossy(&streamed.stderr);
    let finish = format!(" new tokens ({}),", j["finish_reason"].as_str().unwrap());
    assert!(stderr.contains(&finish) && stderr.contains(", 1 rank (1x1)]"), "{stderr}");
}

/// A stop string that spans tokens (" 6" is a space token, then a digit): the streamed text
/// holds the space back until the digit tells, so it ends where the JSON text is cut.
#[test]
fn streamed_text_stops_before_a_stop_string_across_tokens() {
    let dir = smollm2("bf16");
    let args = [
        "generate",
        "--model",
        path_str(&dir),
        "--prompt",
        "1, 2, 3, 4,",
        "--stop",
        " 6",
        "--max-tokens",
        "16",
    ];
    let (streamed, j) = streamed_and_json(&args);
    assert_eq!((j["text"].as_str(), j["finish_reason"].as_str()), (Some(" 5,"), Some("stop")), "{j}");
    assert_eq!(String::from_utf8(streamed.stdout).unwrap(), " 5,\n");
}

#[test]
fn eos_stops_unless_ignored() {
    let dir = smollm2("bf16");
    // The chat model answers briefly and ends its turn with <|im_end|> (id 2).
    let base = [
        "generate",
        "--model",
        path_str(&dir),
        "--prompt",
        "Say hello.",
        "--chat",
        "--max-tokens",
        "200",
        "--json",
    ];
    let j = json_of(&gridlm(&base));
    let ids = j["token_ids"].as_array().unwrap();
    assert_eq!(j["finish_reason"], "eos");
    assert_eq!(ids.last().unwrap(), 2);
    assert!(ids.len() < 200);
    let mut ignore = base.to_vec();
    ignore.push("--ignore-eos");
    let j = json_of(&gridlm(&ignore));
    assert_eq!(j["token_ids"].as_array().unwrap().len(), 200);
    assert_eq!(j["finish_reason"], "length");
}

#[test]
fn streaming_decode_keeps_multibyte_characters_whole() {
    use gridlm::tokenizer::{StreamDecoder, Tokenizer};
    let dir = smollm2("bf16");
    let tok = Tokenizer::from_dir(&dir).unwrap();
    let text = "naïve café — 世界你好 🎉🚀 ok";
    let ids = tok.encode(text, false).unwrap();
    assert!(ids.len() > 8);
    let mut s = StreamDecoder::default();
    let mut pieces = Vec::new();
    for id in ids {
        if let Some(p) = s.push(&tok, id).unwrap() {
            assert!(!p.contains('\u{FFFD}'), "a piece split a character: {p:?}");
            pieces.push(p);
        }
    }
    assert_eq!(pieces.concat(), text);
}

/// Each token's bytes, one after another, spell the text, characters split between tokens
/// included (what serve's and generate's log-probabilities report of a token).
#[test]
fn token_bytes_spell_the_text() {
    use gridlm::tokenizer::Tokenizer;
    let tok = Tokenizer::from_dir(&smollm2("bf16")).unwrap();
    let text = "naïve café — 世界你好 🎉🚀 ok\n\tend";
    let ids = tok.encode(text, false).unwrap();
    let bytes: Vec<u8> = ids.iter().flat_map(|&t| tok.token_bytes(t).unwrap()).collect();
    assert_eq!(String::from_utf8(bytes).unwrap(), text);
    assert_eq!(tok.bytes_text(&ids), text);
    assert!(
        ids.iter().any(|&t| std::str::from_utf8(&tok.token_bytes(t).unwrap()).is_err()),
        "no split character"
    );
    let eos = tok.eos_id().unwrap();
    assert_eq!(tok.token_bytes(eos).unwrap(), b"<|im_end|>");
    assert_eq!(tok.token_bytes(u32::MAX), None);
}

/// Greedy with the presence and frequency penalties picks, at each position, the token whose
/// logit less the penalties of the tokens generated before it is largest: checked on the
/// reported log-probabilities (the model's own, before penalties: logit differences), among
/// the 20 most likely tokens and the one picked. Without the penalties the text differs.
#[test]
fn presence_and_frequency_penalties_pick_the_penalized_best() {
    let dir = smollm2("bf16");
    let run = |extra: &[&str]| {
        let mut args =
            vec!["generate", "--model", path_str(&dir), "--prompt", "1, 2, 3, 4,", "--max-tokens", "24"];
        args.extend(["--ignore-eos", "--json", "--logprobs", "20"]);
        args.extend(extra);
        json_of(&gridlm(&args))
    };
    let (presence, frequency) = (0.5, 1.5);
    let j = run(&["--presence-penalty", "0.5", "--frequency-penalty", "1.5"]);
    let tokens: Vec<u64> = j["token_ids"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap()).collect();
    let mut counts = std::collections::HashMap::<u64, f64>::new();
    for (i, lp) in j["logprobs"].as_array().unwrap().iter().enumerate() {
        let penalized = |t: u64, logprob: f64| {
            let c = counts.get(&t).copied().unwrap_or(0.0);
            logprob - if c > 0.0 { presence + frequency * c } else { 0.0 }
        };
        let picked = penalized(tokens[i], lp["logprob"].as_f64().unwrap());
        for alt in lp["top"].as_array().unwrap() {
            let (t, v) = (alt["token"].as_u64().unwrap(), alt["logprob"].as_f64().unwrap());
            assert!(
                penalized(t, v) <= picked + 1e-4,
                "token {i}: {t} scores {} over the pick's {picked}",
                penalized(t, v)
            );
        }
        *counts.entry(tokens[i]).or_default() += 1.0;
    }
    assert_ne!(j["token_ids"], run(&[])["token_ids"], "the penalties changed nothing");
    assert!(counts.values().any(|&c| c > 1.0), "no token came twice: the check saw no frequency");
}

/// A reader of the answer that goes away (`gridlm generate ... | head -c 1`) ends the run
/// quietly: exit status 0, no error line, for a streamed answer and for JSON alike, and so
/// for `plan`'s JSON (it panicked on the closed pipe).
#[test]
fn a_closed_stdout_ends_the_run_quietly() {
    let (_t, dir) = tiny_llama();
    let generate =
        ["generate", "--model", path_str(&dir), "--prompt", "t1 t2", "--max-tokens", "40", "--ignore-eos"];
    let plan =
        ["plan", "--shape", "llama-2-70b", "--nodes", "64", "--mem-bw", "200", "--peak-gflops", "3000"];
    for (args, json) in [(&generate[..], false), (&generate[..], true), (&plan[..], true)] {
        let mut cmd = std::process::Command::new(bin());
        cmd.args(args);
        if json {
            cmd.arg("--json");
        }
        let mut child = cmd
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("spawn");
        drop(child.stdout.take()); // closed before the first token
        let out = child.wait_with_output().expect("wait");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{args:?} json {json}: {stderr}");
        assert!(!stderr.contains("error"), "{args:?} json {json}: {stderr}");
    }
}

/// `--model-sampling` samples as the folder's generation_config.json says: the same tokens as
/// those settings given on the command line with the same seed; a setting given wins (there,
/// temperature 0: the greedy tokens); without the file, one error line naming it.
#[test]
fn model_sampling_follows_generation_config() {
    let (_t, dir) = tiny_llama();
    let run = |extra: &[&str]| {
        let mut args = vec!["generate", "--model", path_str(&dir), "--prompt", "t5 t9", "--max-tokens", "12"];
        args.extend(["--ignore-eos", "--seed", "3", "--json"]);
        args.extend(extra);
        json_of(&gridlm(&args))["token_ids"].clone()
    };
    let missing = gridlm(&["generate", "--model", path_str(&dir), "--prompt", "t5", "--model-sampling"]);
    assert_one_line_error(&missing, &["generation_config.json"]);
    // Hot enough that the random model's peaked logits give way.
    let config =
        r#"{"do_sample": true, "temperature": 8.0, "top_k": 40, "top_p": 0.95, "repetition_penalty": 1.2}"#;
    std::fs::write(dir.join("generation_config.json"), config).unwrap();
    let sampled = run(&["--model-sampling"]);
    let given = ["--temperature", "8", "--top-k", "40", "--top-p", "0.95", "--repetition-penalty", "1.2"];
    assert_eq!(sampled, run(&given));
    assert_ne!(sampled, run(&["--repetition-penalty", "1.2"]), "sampled as greedy");
    assert_eq!(run(&["--model-sampling", "--temperature", "0"]), run(&["--repetition-penalty", "1.2"]));
}

/// `--dtype` converts a folder's matrices at load: SmolLM2 stored in f32 and loaded in bf16
/// gives the tokens of the folder stored in bf16 (the same weights rounded alike), on one
/// rank and on two tp ranks, and `inspect --dtype` counts the bytes the bf16 folder holds.
#[test]
fn a_folder_loaded_in_another_dtype_runs_as_one_stored_in_it() {
    let (f32_dir, bf16_dir) = (smollm2("f32"), smollm2("bf16"));
    let prompt = "Write a haiku about the sea.";
    let run = |dir: &Path, extra: &[&str]| {
        let mut args = vec!["generate", "--model", path_str(dir), "--prompt", prompt, "--max-tokens", "24"];
        args.extend(["--ignore-eos", "--json"]);
        args.extend(extra);
        json_of(&gridlm(&args))
    };
    let stored = run(&bf16_dir, &[]);
    let loaded = run(&f32_dir, &["--dtype", "bf16"]);
    assert_eq!((&loaded["weight_dtype"], &stored["weight_dtype"]), (&"bf16".into(), &"bf16".into()));
    assert_eq!(loaded["token_ids"], stored["token_ids"]);
    assert_eq!(loaded["ranks"][0]["weight_bytes"], stored["ranks"][0]["weight_bytes"]);
    let args =
        ["--dtype", "bf16", "--tp", "2", "--prompt", prompt, "--max-tokens", "24", "--ignore-eos", "--json"];
    let two = json_of(&super::grid::local(2, &f32_dir, &args, &[]));
    let two_stored = json_of(&super::grid::local(2, &bf16_dir, &args[2..], &[]));
    assert_eq!(two["token_ids"], two_stored["token_ids"]);
    let inspect = |dir: &Path, extra: &[&str]| {
        let mut args = vec!["inspect", "--model", path_str(dir), "--tp", "2", "--json"];
        args.extend(extra);
        json_of(&gridlm(&args))
    };
    let (i_loaded, i_stored) = (inspect(&f32_dir, &["--dtype", "bf16"]), inspect(&bf16_dir, &[]));
    assert_eq!((&i_loaded["stored_dtype"], &i_loaded["weight_dtype"]), (&"f32".into(), &"bf16".into()));
    for r in 0..2 {
        assert_eq!(i_loaded["ranks"][r]["weight_bytes"], i_stored["ranks"][r]["weight_bytes"]);
    }
}
