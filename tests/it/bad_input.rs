//! Bad input: one clear error line naming the file or tensor and what was expected, exit 1.

use super::*;

fn generate_on(dir: &Path, prompt: &str) -> Output {
    gridlm(&["generate", "--model", path_str(dir), "--prompt", prompt, "--max-tokens", "2"])
}

#[test]
fn missing_config() {
    let (_t, dir) = tiny_llama();
    std::fs::remove_file(dir.join("config.json")).unwrap();
    assert_one_line_error(&generate_on(&dir, "t1"), &["config.json", "No such file"]);
}

#[test]
fn malformed_config() {
    let (_t, dir) = tiny_llama();
    std::fs::write(dir.join("config.json"), "{\"model_type\": \"llama\", \"hidden_size\": 4,").unwrap();
    assert_one_line_error(&generate_on(&dir, "t1"), &["config.json", "invalid config"]);
    let mut cfg = gridlm_reference::TinyModel::llama().config();
    cfg.as_object_mut().unwrap().remove("num_attention_heads");
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    assert_one_line_error(&generate_on(&dir, "t1"), &["config.json", "missing field `num_attention_heads`"]);
}

/// A folder of weights quantized before saving (GPTQ, AWQ, FP8, ...: other tensors and types)
/// is refused by its config, naming the method; a `quantization_config` of null is none.
#[test]
fn weights_quantized_before_saving() {
    let (_t, dir) = tiny_llama();
    let mut cfg = gridlm_reference::TinyModel::llama().config();
    cfg["quantization_config"] = serde_json::json!(null);
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    assert!(generate_on(&dir, "t1").status.success());
    cfg["quantization_config"] = serde_json::json!({"quant_method": "awq", "bits": 4});
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    let want = ["config.json: quantization_config", "quant_method `awq`", "--quant int8"];
    assert_one_line_error(&generate_on(&dir, "t1"), &want);
}

#[test]
fn unknown_model_type() {
    let (_t, dir) = tiny_llama();
    let mut cfg = gridlm_reference::TinyModel::llama().config();
    cfg["model_type"] = "bloom".into();
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    assert_one_line_error(
        &generate_on(&dir, "t1"),
        &["config.json", "unsupported model_type `bloom`", "llama, mistral, qwen2"],
    );
}

#[test]
fn truncated_safetensors() {
    let (_t, dir) = tiny_llama();
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() - 1000]).unwrap();
    assert_one_line_error(&generate_on(&dir, "t1"), &["model.safetensors", "truncated or corrupt"]);
}

/// A repository cloned without Git LFS holds pointers in place of its large files: the weights,
/// the tokenizer or a GGUF given to convert are each named as one, with the command that
/// fetches them.
#[test]
fn git_lfs_pointers_in_place_of_files() {
    let (t, dir) = tiny_llama();
    let pointer = |size: u64| {
        format!("version https://git-lfs.github.com/spec/v1\noid sha256:{}\nsize {size}\n", "0".repeat(64))
    };
    let want = ["a Git LFS pointer, not the file itself", "git lfs pull"];
    let weights = dir.join("model.safetensors");
    let kept = std::fs::read(&weights).unwrap();
    std::fs::write(&weights, pointer(269060552)).unwrap();
    let out = generate_on(&dir, "t1");
    assert_one_line_error(
        &out,
        &[&["model.safetensors: ", want[0], " (its content of 269.1 MB"][..], &want[1..]].concat(),
    );
    std::fs::write(&weights, kept).unwrap();
    std::fs::write(dir.join("tokenizer.json"), pointer(2104556)).unwrap();
    assert_one_line_error(&generate_on(&dir, "t1"), &[&["tokenizer.json: "][..], &want].concat());
    let out_dir = t.path().join("converted");
    let out =
        gridlm(&["convert", "--gguf", path_str(&dir.join("tokenizer.json")), "--out", path_str(&out_dir)]);
    assert_one_line_error(&out, &want);
    assert!(!out_dir.exists());
}

#[test]
fn corrupt_safetensors_header() {
    let (_t, dir) = tiny_llama();
    let path = dir.join("model.safetensors");
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[8..40].copy_from_slice(&[b'#'; 32]);
    std::fs::write(&path, &bytes).unwrap();
    assert_one_line_error(&generate_on(&dir, "t1"), &["model.safetensors", "truncated or corrupt"]);
    // A header length larger than the file.
    bytes[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    std::fs::write(&path, &bytes).unwrap();
    assert_one_line_error(&generate_on(&dir, "t1"), &["model.safetensors", "truncated or corrupt"]);
}

#[test]
fn tensor_shape_disagrees_with_config() {
    let (_t, dir) = tiny_llama();
    let mut cfg = gridlm_reference::TinyModel::llama().config();
    cfg["intermediate_size"] = 112.into();
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    assert_one_line_error(
        &generate_on(&dir, "t1"),
        &[
            "model.safetensors",
            "tensor `model.layers.0.mlp.gate_proj.weight`",
            "[100, 48]",
            "expected [112, 48]",
        ],
    );
}

#[test]
fn missing_tensor() {
    let (_t, dir) = tiny_llama();
    let tensors: Vec<_> = gridlm_reference::TinyModel::llama()
        .tensors()
        .into_iter()
        .filter(|(n, _, _)| n != "model.layers.2.self_attn.v_proj.weight")
        .collect();
    gridlm_reference::write_safetensors(&dir.join("model.safetensors"), &tensors);
    assert_one_line_error(
        &generate_on(&dir, "t1"),
        &["model.safetensors", "tensor `model.layers.2.self_attn.v_proj.weight`", "missing"],
    );
}

/// A mixture of experts' missing expert tensor, and a router of the wrong width, each named.
#[test]
fn missing_expert_and_a_router_of_the_wrong_width() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path();
    let m = gridlm_reference::TinyModel::qwen3_moe();
    m.write(dir);
    let gone = "model.layers.3.mlp.experts.4.down_proj.weight";
    let tensors: Vec<_> = m.tensors().into_iter().filter(|(n, _, _)| n != gone).collect();
    gridlm_reference::write_safetensors(&dir.join("model.safetensors"), &tensors);
    assert_one_line_error(
        &generate_on(dir, "t1"),
        &["model.safetensors", &format!("tensor `{gone}`"), "missing"],
    );
    let mut cfg = m.config();
    cfg["num_experts"] = 7.into();
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    gridlm_reference::write_safetensors(&dir.join("model.safetensors"), &m.tensors());
    assert_one_line_error(
        &generate_on(dir, "t1"),
        &["tensor `model.layers.1.mlp.gate.weight`", "[6, 48]", "expected [7, 48]"],
    );
}

#[test]
fn prompt_longer_than_context() {
    let (_t, dir) = tiny_llama();
    let prompt: Vec<String> = (0..130).map(|i| format!("t{}", i % 300)).collect();
    assert_one_line_error(
        &generate_on(&dir, &prompt.join(" ")),
        &["prompt has 130 tokens", "context holds 128", "max_position_embeddings"],
    );
}

#[test]
fn missing_tokenizer() {
    let (_t, dir) = tiny_llama();
    std::fs::remove_file(dir.join("tokenizer.json")).unwrap();
    assert_one_line_error(&generate_on(&dir, "t1"), &["tokenizer.json", "not found"]);
    // SentencePiece's own file, which older folders hold alone: named, and the way to a tokenizer.json.
    std::fs::write(dir.join("tokenizer.model"), b"").unwrap();
    assert_one_line_error(
        &generate_on(&dir, "t1"),
        &["tokenizer.json", "its tokenizer.model", "save_pretrained"],
    );
}

/// A folder without model.safetensors or its index says what it holds instead: PyTorch's
/// weights (not a trainer's files), or safetensors shards without their index.
#[test]
fn missing_safetensors() {
    let (_t, dir) = tiny_llama();
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    let want = "not found (expected model.safetensors or model.safetensors.index.json)";
    std::fs::write(dir.join("training_args.bin"), b"").unwrap();
    let out = generate_on(&dir, "t1");
    assert_one_line_error(&out, &[want]);
    assert!(!String::from_utf8_lossy(&out.stderr).contains("PyTorch"));
    std::fs::write(dir.join("model-00001-of-00002.safetensors"), b"").unwrap();
    assert_one_line_error(&generate_on(&dir, "t1"), &[want, "model-00001-of-00002.safetensors, but no"]);
    std::fs::write(dir.join("pytorch_model.bin"), b"").unwrap();
    assert_one_line_error(&generate_on(&dir, "t1"), &[want, "holds pytorch_model.bin, PyTorch's format"]);
}

#[test]
fn corrupt_tokenizer() {
    let (_t, dir) = tiny_llama();
    std::fs::write(dir.join("tokenizer.json"), "{\"model\": 5}").unwrap();
    assert_one_line_error(&generate_on(&dir, "t1"), &["tokenizer.json", "invalid tokenizer"]);
}

#[test]
fn system_message_without_chat() {
    let (_t, dir) = tiny_llama();
    let out = gridlm(&["generate", "--model", path_str(&dir), "--prompt", "t1", "--system", "be brief"]);
    assert_one_line_error(&out, &["--chat"]);
}

#[test]
fn chat_without_template() {
    let (_t, dir) = tiny_llama();
    let out = gridlm(&["generate", "--model", path_str(&dir), "--prompt", "t1", "--chat"]);
    assert_one_line_error(&out, &["tokenizer_config.json", "chat_template"]);
}

#[test]
fn missing_model_folder() {
    let out = gridlm(&["generate", "--model", "/nonexistent/model", "--prompt", "hi"]);
    assert_one_line_error(&out, &["/nonexistent/model: no such folder", "downloads nothing"]);
    // A file of the folder given for the folder.
    let (_t, dir) = tiny_llama();
    let file = dir.join("model.safetensors");
    let out = gridlm(&["generate", "--model", path_str(&file), "--prompt", "hi"]);
    assert_one_line_error(&out, &["model.safetensors: a file, not a model folder"]);
    // llama.cpp's file, or a folder of them: named, and the command that makes a folder.
    let gguf = dir.join("model.gguf");
    std::fs::write(&gguf, b"GGUF\x03\0\0\0").unwrap();
    let out = gridlm(&["generate", "--model", path_str(&gguf), "--prompt", "hi"]);
    assert_one_line_error(&out, &["model.gguf: a GGUF file, not a model folder", "gridlm convert --gguf"]);
    std::fs::remove_file(dir.join("config.json")).unwrap();
    let out = gridlm(&["generate", "--model", path_str(&dir), "--prompt", "hi"]);
    assert_one_line_error(&out, &["config.json", "the folder holds 1 GGUF file", "gridlm convert --gguf"]);
    // A HuggingFace hub cache's folder for a model: its model folder is a revision below it.
    let hub = dir.join("models--owner--name");
    std::fs::create_dir_all(hub.join("snapshots/0123abc")).unwrap();
    let out = gridlm(&["generate", "--model", path_str(&hub), "--prompt", "hi"]);
    let want = format!("its model folder is {}", hub.join("snapshots/0123abc").display());
    assert_one_line_error(&out, &["config.json", "HuggingFace hub cache", &want]);
    // The folder above a model folder.
    let (above, _) = tiny_llama();
    let out = gridlm(&["generate", "--model", path_str(above.path()), "--prompt", "hi"]);
    assert_one_line_error(
        &out,
        &["config.json", "the folder holds 1 model folder: model (give one as --model)"],
    );
}

#[test]
fn convert_rejects_non_gguf_and_leaves_nothing() {
    let (tmp, dir) = tiny_llama();
    let out_dir = tmp.path().join("converted");
    let out = gridlm(&["convert", "--gguf", path_str(&dir.join("config.json")), "--out", path_str(&out_dir)]);
    assert_one_line_error(&out, &["config.json", "not a GGUF file"]);
    assert!(!out_dir.exists());
    let leftovers: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().filter_map(|e| e.ok()).collect();
    assert_eq!(leftovers.len(), 1, "convert left files behind: {leftovers:?}");
    // A file that is not there: named, and the system's reason said once.
    let out = gridlm(&["convert", "--gguf", "/nonexistent.gguf", "--out", path_str(&out_dir)]);
    assert_one_line_error(&out, &["/nonexistent.gguf: No such file or directory"]);
    let said = String::from_utf8_lossy(&out.stderr).matches("No such file").count();
    assert_eq!(said, 1, "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn convert_truncated_gguf() {
    let gguf = smollm2("f32").parent().unwrap().join("gguf/SmolLM2-135M-Instruct.Q4_1.gguf");
    let tmp = tempfile::tempdir().unwrap();
    let cut = tmp.path().join("cut.gguf");
    let bytes = std::fs::read(&gguf).unwrap();
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    let out_dir = tmp.path().join("out");
    let out = gridlm(&["convert", "--gguf", path_str(&cut), "--out", path_str(&out_dir)]);
    assert_one_line_error(&out, &["cut.gguf", "truncated"]);
    assert!(!out_dir.exists());
}

#[test]
fn zero_threads() {
    let (_t, dir) = tiny_llama();
    let out = gridlm(&["generate", "--model", path_str(&dir), "--prompt", "t1", "--threads", "0"]);
    assert_one_line_error(&out, &["--threads"]);
}

/// More kernel threads than cores runs, with a warning (it is several times slower).
#[test]
fn more_threads_than_cores_warns() {
    let (_t, dir) = tiny_llama();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let run = |n: usize| {
        let threads = n.to_string();
        let args = ["generate", "--model", path_str(&dir), "--prompt", "t1", "--max-tokens", "2"];
        let out = gridlm(&[&args[..], &["--threads", &threads]].concat());
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let warned = run(cores + 1);
    assert!(
        warned.contains(&format!("warning: --threads {} is more than the {cores} core", cores + 1)),
        "{warned}"
    );
    assert!(!run(cores).contains("warning"));
}

#[test]
fn bad_prompts_files() {
    let (_t, dir) = tiny_llama();
    let tmp = tempfile::tempdir().unwrap();
    let run = |file: &Path, extra: &[&str]| {
        let mut args = vec!["generate", "--model", path_str(&dir), "--prompts-file", path_str(file)];
        args.extend(extra);
        gridlm(&args)
    };
    let missing = tmp.path().join("absent.txt");
    assert_one_line_error(&run(&missing, &[]), &["absent.txt", "cannot read the prompts file"]);
    let jl = tmp.path().join("p.jsonl");
    std::fs::write(&jl, "{\"prompt\":\"t1\"}\n{\"prompt\":\"t2\",\"top_k\":\"many\"}\n").unwrap();
    assert_one_line_error(&run(&jl, &[]), &["p.jsonl:2:", "top_k"]);
    std::fs::write(&jl, "{\"prompt\":\"t1\"}\nt2\n").unwrap();
    assert_one_line_error(&run(&jl, &[]), &["p.jsonl:2:", "not a prompt object"]);
    std::fs::write(&jl, "{\"prompt\":\"t1\",\"min_p\":1.5}\n").unwrap();
    assert_one_line_error(&run(&jl, &[]), &["p.jsonl:1:", "`min_p` must be in [0, 1]"]);
    std::fs::write(&jl, "{\"prompt\":\"t1\",\"logit_bias\":{\"3\":120}}\n").unwrap();
    assert_one_line_error(
        &run(&jl, &[]),
        &["p.jsonl:1:", "`logit_bias`: the bias of token 3 must be in [-100, 100]"],
    );
    // Token rules are checked against the model (its vocabulary) and the line's max_tokens.
    std::fs::write(&jl, "{\"prompt\":\"t1\"}\n{\"prompt\":\"t1\",\"stop_token_ids\":[1000000]}\n").unwrap();
    assert_one_line_error(
        &run(&jl, &[]),
        &["p.jsonl:2: `stop_token_ids` holds token 1000000, outside the vocabulary"],
    );
    std::fs::write(&jl, "{\"prompt\":\"t1\",\"max_tokens\":4}\n").unwrap();
    assert_one_line_error(
        &run(&jl, &["--min-tokens", "5"]),
        &["p.jsonl:1: `min_tokens` (5) must be at most max_tokens (4)"],
    );
    std::fs::write(&jl, "\n").unwrap();
    assert_one_line_error(&run(&jl, &[]), &["p.jsonl", "no prompts"]);
}

#[test]
fn bad_sampling_and_batching_flags() {
    let (_t, dir) = tiny_llama();
    let run = |extra: &[&str]| {
        let mut args = vec!["generate", "--model", path_str(&dir), "--prompt", "t1"];
        args.extend(extra);
        gridlm(&args)
    };
    assert_one_line_error(&run(&["--top-p", "0"]), &["--top-p must be in (0, 1]"]);
    assert_one_line_error(&run(&["--temperature=-1"]), &["--temperature must be a number >= 0"]);
    // A negative value as its own word is a value, not an unknown option.
    assert_one_line_error(&run(&["--temperature", "-1"]), &["--temperature must be a number >= 0"]);
    assert_one_line_error(&run(&["--min-p", "-0.5"]), &["--min-p must be in [0, 1]"]);
    assert_one_line_error(&run(&["--seed", "-3"]), &["invalid value '-3'", "--seed"]);
    assert_one_line_error(
        &run(&["--repetition-penalty", "0"]),
        &["--repetition-penalty must be a number > 0"],
    );
    assert_one_line_error(&run(&["--max-batch", "0"]), &["--max-batch"]);
    assert_one_line_error(&run(&["--speculate", "65"]), &["--speculate", "not in 0..=64"]);
    assert_one_line_error(&run(&["--stop", ""]), &["--stop"]);
    assert_one_line_error(
        &run(&["--min-tokens", "200"]),
        &["--min-tokens (200) must be at most max_tokens (128)"],
    );
    assert_one_line_error(
        &run(&["--stop-token-ids", "2,1000000"]),
        &["--stop-token-ids holds token 1000000"],
    );
    assert_one_line_error(&run(&["--stop-token-ids", "x"]), &["invalid value 'x'", "--stop-token-ids"]);
    assert_one_line_error(&run(&["--logit-bias", "{\"1000000\": 1}"]), &["--logit-bias holds token 1000000"]);
    assert_one_line_error(
        &run(&["--logit-bias", "{\"3\": 1, \"03\": 2}"]),
        &["--logit-bias", "token 3 is given twice"],
    );
    assert_one_line_error(&run(&["--logit-bias", "[3]"]), &["--logit-bias", "not a JSON object"]);
    assert_one_line_error(
        &run(&["--response-format", r#"{"type": "xml"}"#]),
        &["--response-format", "`type` is \"xml\": text, json_object or json_schema"],
    );
    let unknown_type = r#"{"type": "json_schema", "json_schema": {"schema": {"type": "strin"}}}"#;
    assert_one_line_error(&run(&["--response-format", unknown_type]), &["the answer's format: ", "strin"]);
    assert_one_line_error(&run(&["--max-tokens", "0", "--logits-out", "l.f32"]), &["--logits-out needs"]);
}

/// One prompt that does not fit the KV memory: the job fails with one line (no half output).
#[test]
fn single_prompt_larger_than_the_kv_memory() {
    let (_t, dir) = tiny_llama();
    let args = ["generate", "--model", path_str(&dir), "--prompt", "t1 t2 t3", "--max-tokens", "1000"];
    let out = gridlm(&[&args[..], &["--kv-mem-mib", "0"]].concat());
    assert_one_line_error(&out, &["KV memory", "holds no page"]);
}

/// `--kv-mem-mib` caps the KV pool: far more than the machine has is fine where the prompts
/// need little, and one line where they need more than the node has available (before, the
/// pool was the amount asked for, and mapping it failed with an abort and a backtrace).
#[test]
fn kv_memory_beyond_the_machine() {
    let (_t, dir) = tiny_llama();
    let args = ["generate", "--model", path_str(&dir), "--prompt", "t1 t2 t3", "--max-tokens", "4"];
    let out = gridlm(&[&args[..], &["--kv-mem-mib", "999999999999999"]].concat());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // 2000 SmolLM2 sequences at its full context of 8192 positions: ~370 GB of keys and values.
    let model = smollm2("bf16");
    let tmp = tempfile::tempdir().unwrap();
    let prompts = tmp.path().join("prompts.txt");
    std::fs::write(&prompts, (0..2000).map(|i| format!("prompt {i}\n")).collect::<String>()).unwrap();
    let out = gridlm(&[
        "generate",
        "--model",
        path_str(&model),
        "--prompts-file",
        path_str(&prompts),
        "--max-batch",
        "2000",
        "--max-tokens",
        "8192",
        "--kv-mem-mib",
        "999999999",
    ]);
    assert_one_line_error(&out, &["MiB of KV cache", "MiB available", "less KV memory"]);
}

/// A batch whose buffers the machine cannot hold is one line before any step, where it used to
/// fill the memory until the kernel killed the process (bench: 100 000 sequences' keys and
/// values and a first step of 6.4 million prompt tokens; serve: 100 000 slots, each with its row of
/// logits and a decode token's buffers); generate reserves no more slots than it has prompts and
/// counts no more tokens a step than they hold, so a larger `--max-batch` or `--step-tokens`
/// costs a lone prompt nothing.
#[test]
fn batches_beyond_the_machine() {
    let model = smollm2("bf16");
    let out = gridlm(&["bench", "--shape", "smollm2-135m", "--batch", "100000", "--prompt-len", "64"]);
    assert_one_line_error(
        &out,
        &["a run of 100000 sequence(s)", "MiB of KV cache", "steps of up to 6400000 tokens"],
    );
    let out =
        gridlm(&["serve", "--model", path_str(&model), "--max-batch", "100000", "--listen", "127.0.0.1:0"]);
    assert_one_line_error(&out, &["a run of 100000 sequence(s)", "MiB available", "a smaller batch"]);
    let args = ["generate", "--model", path_str(&model), "--prompt", "hi", "--max-tokens", "2"];
    let out = gridlm(&[&args[..], &["--max-batch", "1000000"]].concat());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // Nor more tokens a step than its prompts and decode tokens could ever fill.
    let out = gridlm(&[&args[..], &["--step-tokens", "100000000", "--speculate", "8"]].concat());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

/// Options clap rejects (unknown, malformed, missing) get the same one-line error as any other
/// bad input, not clap's usage block.
#[test]
fn bad_command_lines() {
    assert_one_line_error(&gridlm(&["generate", "--bogus"]), &["unexpected argument '--bogus'", "--help"]);
    assert_one_line_error(&gridlm(&["generate", "--prompt", "hi"]), &["--model"]);
    assert_one_line_error(&gridlm(&["bench", "--reps", "many"]), &["invalid value 'many'", "--reps"]);
    assert_one_line_error(&gridlm(&["frobnicate"]), &["frobnicate"]);
    // Nothing to compare with unquantized weights without quantized ones.
    let compare = ["bench", "--shape", "smollm2-135m", "--compare-unquantized"];
    assert_one_line_error(&gridlm(&compare), &["--quant"]);
    let batch = ["bench", "--shape", "smollm2-135m", "--batch", "2", "--compare-batch"];
    assert_one_line_error(&gridlm(&[&batch[..], &["2"]].concat()), &["--compare-batch 2 is --batch"]);
    assert_one_line_error(&gridlm(&[&batch[..], &["0"]].concat()), &["--compare-batch must be at least 1"]);
    // A one-token prefetch way: named from the list, and compared only where one token a step
    // runs through the one-token products.
    let prefetch = ["bench", "--shape", "smollm2-135m", "--compare-prefetch"];
    assert_one_line_error(
        &gridlm(&[&prefetch[..], &["fast"]].concat()),
        &["`fast`", "none, near, far, nta, page"],
    );
    let batch_of_2 = [&prefetch[..], &["nta", "--batch", "2"]].concat();
    assert_one_line_error(&gridlm(&batch_of_2), &["--compare-prefetch nta: --batch 2", "--batch 1"]);
    // The one-token streams likewise.
    let streams = ["bench", "--shape", "smollm2-135m", "--compare-streams"];
    assert_one_line_error(&gridlm(&[&streams[..], &["all"]].concat()), &["`all`", "long or every"]);
    let batch_of_2 = [&streams[..], &["every", "--batch", "2"]].concat();
    assert_one_line_error(&gridlm(&batch_of_2), &["--compare-streams every: --batch 2", "--batch 1"]);
    let both = [&streams[..], &["every", "--compare-prefetch", "nta"]].concat();
    assert_one_line_error(&gridlm(&both), &["--compare-streams", "--compare-prefetch"]);
    // A count below its least: the option named, with what it got.
    let shape = ["bench", "--shape", "smollm2-135m"];
    for (option, value, least) in
        [("--prompt-len", "0", "1"), ("--new-tokens", "1", "2"), ("--reps", "0", "1")]
    {
        let want = format!("{option} must be at least {least}, got {value}");
        assert_one_line_error(&gridlm(&[&shape[..], &[option, value]].concat()), &[&want]);
    }
    // A shape cut to more layers than it has, or a folder (read whole) cut at all.
    let cut = ["bench", "--shape", "qwen3-30b-a3b", "--shape-layers", "49"];
    assert_one_line_error(&gridlm(&cut), &["--shape-layers 49: expected 1 to the shape's 48 layers"]);
    let folder = ["bench", "--model", "m", "--shape-layers", "2"];
    assert_one_line_error(&gridlm(&folder), &["--shape-layers needs --shape"]);
    let plan = ["plan", "--shape", "smollm2-135m", "--nodes", "0", "--mem-bw", "20", "--peak-gflops", "100"];
    assert_one_line_error(&gridlm(&plan), &["--nodes must be at least 1, got 0"]);
    // Plan predicts bench's workload, so it asks what bench asks of it, and of its link
    // figures numbers (clap reads `nan` and `inf` as such), not a table of NaN.
    let plan = ["plan", "--shape", "smollm2-135m", "--mem-bw", "20", "--peak-gflops", "100"];
    for (option, value, want) in [
        ("--new-tokens", "1", "--new-tokens must be at least 2, got 1"),
        ("--prompt-len", "9000", "the prompt has 9000 tokens but the model's context holds 8192"),
        ("--new-tokens", "8190", "--prompt-len 128 + --new-tokens 8190 = 8318 positions"),
        ("--local-gb-per-s", "0", "--local-gb-per-s must be a positive number, got 0"),
        ("--local-latency-us", "nan", "--local-latency-us must be a number, at least 0, got NaN"),
        ("--mem-gb", "inf", "--mem-gb must be a number, at least 0, got inf"),
    ] {
        assert_one_line_error(&gridlm(&[&plan[..], &[option, value]].concat()), &[want]);
    }
    let generate = ["generate", "--model", "m", "--prompt", "hi", "--step-tokens", "0"];
    assert_one_line_error(&gridlm(&generate), &["--step-tokens must be at least 1, got 0"]);
    let both = ["--quant", "int8", "--compare-unquantized", "--compare-batch", "1"];
    assert_one_line_error(
        &gridlm(&[&compare[..3], &both[..]].concat()),
        &["--compare-batch", "cannot be used"],
    );
    // A negative number as a value, which clap reads as an option: named, and what to do.
    assert_one_line_error(&gridlm(&["bench", "--warmup", "-1"]), &["'-1' for '--warmup'", "not be negative"]);
    assert_one_line_error(&gridlm(&["generate", "--max-tokens", "-2.5"]), &["'-2.5' for '--max-tokens'"]);
    // Not the earlier option that takes the same word as a value of its own.
    let both = ["bench", "--temperature", "-1", "--warmup", "-1"];
    assert_one_line_error(&gridlm(&both), &["'-1' for '--warmup'"]);
    assert_one_line_error(&gridlm(&["generate", "--prompt", "-1"]), &["write --prompt=-1"]);
    let help = gridlm(&["generate", "--help"]);
    assert!(help.status.success() && String::from_utf8_lossy(&help.stdout).contains("--model"));
}
