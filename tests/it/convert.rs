//! `gridlm convert`'s tokenizers, against tokenizers written here from their algorithms.

use super::*;
use gridlm_reference::sentencepiece::SentencePiece;
use gridlm_reference::{rand_vec, write_gguf, GgufValue};

/// Words of a made-up language, two of them with a character beyond ASCII.
const WORDS: [&str; 24] = [
    "the", "then", "there", "other", "rank", "ranks", "tank", "pipe", "pipeline", "line", "tensor", "sensor",
    "grid", "rigid", "merge", "emerge", "score", "core", "naïve", "café", "a", "an", "and", "sand",
];

/// A llama's metadata with one layer, 4 heads of 8, a vocabulary of `tokens` (a byte-level BPE
/// without merges unless `extra` says otherwise), then `extra`'s keys, which take precedence.
fn llama_meta(tokens: usize, extra: Vec<(&str, GgufValue)>) -> Vec<(String, GgufValue)> {
    arch_meta("llama", tokens, extra)
}

/// [`llama_meta`] of the GGUF architecture `arch`.
fn arch_meta(arch: &str, tokens: usize, extra: Vec<(&str, GgufValue)>) -> Vec<(String, GgufValue)> {
    let mut meta = vec![
        ("general.architecture".to_string(), GgufValue::Str(arch.into())),
        (format!("{arch}.block_count"), GgufValue::U32(1)),
        (format!("{arch}.embedding_length"), GgufValue::U32(32)),
        (format!("{arch}.feed_forward_length"), GgufValue::U32(64)),
        (format!("{arch}.attention.head_count"), GgufValue::U32(4)),
        ("tokenizer.ggml.model".to_string(), GgufValue::Str("gpt2".into())),
        (
            "tokenizer.ggml.tokens".to_string(),
            GgufValue::Strs((0..tokens).map(|i| format!("t{i}")).collect()),
        ),
        ("tokenizer.ggml.merges".to_string(), GgufValue::Strs(vec![])),
    ];
    meta.retain(|(k, _)| !extra.iter().any(|(e, _)| e == k));
    meta.extend(extra.into_iter().map(|(k, v)| (k.to_string(), v)));
    meta
}

/// `gridlm convert` of a GGUF of `meta`, an embedding of its `tokens` rows and `more` tensors,
/// written as `name.gguf` in `dir`, into the folder `dir/name`.
fn convert(
    dir: &Path,
    name: &str,
    tokens: usize,
    meta: &[(String, GgufValue)],
    more: Vec<(String, Vec<usize>, Vec<f32>)>,
) -> (Output, PathBuf) {
    let gguf = dir.join(format!("{name}.gguf"));
    let mut tensors = vec![("token_embd.weight".to_string(), vec![tokens, 32], vec![0.5; tokens * 32])];
    tensors.extend(more);
    write_gguf(&gguf, meta, &tensors);
    let out_dir = dir.join(name);
    (gridlm(&["convert", "--gguf", path_str(&gguf), "--out", path_str(&out_dir)]), out_dir)
}

/// `convert` that must fail with one error line saying each of `says`, leaving no folder.
fn refused(
    dir: &Path,
    name: &str,
    meta: &[(String, GgufValue)],
    more: Vec<(String, Vec<usize>, Vec<f32>)>,
    says: &[&str],
) {
    let (out, folder) = convert(dir, name, 2, meta, more);
    assert_one_line_error(&out, says);
    assert!(!folder.exists(), "{name}");
}

/// A GGUF's RoPE scaling: linear (as metadata, new and old keys) is HF's linear, YaRN HF's yarn;
/// what HF's config cannot say is one error line naming it, and no folder.
#[test]
fn convert_reads_rope_scaling_and_refuses_what_hf_cannot_say() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let type_linear = || ("llama.rope.scaling.type", GgufValue::Str("linear".into()));
    let linears = [
        ("linear", vec![type_linear(), ("llama.rope.scaling.factor", GgufValue::F32(4.0))]),
        ("old", vec![("llama.rope.scale_linear", GgufValue::F32(4.0))]),
    ];
    for (name, extra) in linears {
        let (out, folder) = convert(dir, name, 2, &llama_meta(2, extra), vec![]);
        assert!(out.status.success(), "{name}: {}", String::from_utf8_lossy(&out.stderr));
        let cfg: serde_json::Value =
            serde_json::from_slice(&std::fs::read(folder.join("config.json")).unwrap()).unwrap();
        assert_eq!(cfg["rope_scaling"], serde_json::json!({"rope_type": "linear", "factor": 4.0}), "{name}");
    }
    let freqs = |v: Vec<f32>| vec![("rope_freqs.weight".to_string(), vec![v.len()], v)];
    // YaRN as llama.cpp writes HF's (a Qwen3 "-128K" GGUF's form), with HF's attention factor
    // where the GGUF gives one; what HF's YaRN has no number for is refused.
    let yarn = || ("llama.rope.scaling.type", GgufValue::Str("yarn".into()));
    let factor = || ("llama.rope.scaling.factor", GgufValue::F32(4.0));
    let ctx = || ("llama.rope.scaling.original_context_length", GgufValue::U32(32768));
    let yarns = [
        ("yarn", vec![yarn(), factor(), ctx()], serde_json::json!({})),
        (
            "yarn-attn",
            vec![yarn(), factor(), ctx(), ("llama.rope.scaling.yarn_attn_factor", GgufValue::F32(1.5))],
            serde_json::json!({"attention_factor": 1.5}),
        ),
        (
            "yarn-beta",
            vec![yarn(), factor(), ctx(), ("llama.rope.scaling.yarn_beta_fast", GgufValue::F32(16.0))],
            serde_json::json!({"beta_fast": 16.0}),
        ),
    ];
    for (name, extra, more) in yarns {
        let (out, folder) = convert(dir, name, 2, &llama_meta(2, extra), vec![]);
        assert!(out.status.success(), "{name}: {}", String::from_utf8_lossy(&out.stderr));
        let cfg: serde_json::Value =
            serde_json::from_slice(&std::fs::read(folder.join("config.json")).unwrap()).unwrap();
        let mut want = serde_json::json!({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768});
        want.as_object_mut().unwrap().extend(more.as_object().unwrap().clone());
        assert_eq!(cfg["rope_scaling"], want, "{name}");
    }
    let says = ["`llama.rope.scaling.yarn_ext_factor` is 0.5", "has no such number"];
    let ext = ("llama.rope.scaling.yarn_ext_factor", GgufValue::F32(0.5));
    refused(dir, "yarn-ext", &llama_meta(2, vec![yarn(), factor(), ext]), vec![], &says);
    let says = ["yarn RoPE scaling without the metadata number `llama.rope.scaling.factor`"];
    refused(dir, "yarn-bare", &llama_meta(2, vec![yarn()]), vec![], &says);
    let says = ["rope_freqs.weight", "beside YaRN"];
    refused(dir, "yarn-freqs", &llama_meta(2, vec![yarn(), factor()]), freqs(vec![1.0; 4]), &says);
    let says = ["unsupported RoPE scaling `longrope`", "llama.rope.scaling.type"];
    let other = ("llama.rope.scaling.type", GgufValue::Str("longrope".into()));
    refused(dir, "other", &llama_meta(2, vec![other]), vec![], &says);
    let says = ["without the metadata number `llama.rope.scaling.factor`"];
    refused(dir, "no-factor", &llama_meta(2, vec![type_linear()]), vec![], &says);
    let says = ["rope_freqs.weight", "holds 2 RoPE frequency factors", "rotates 4"];
    refused(dir, "few", &llama_meta(2, vec![]), freqs(vec![1.0, 2.0]), &says);
    let says = ["rope_freqs.weight", "NaN"];
    refused(dir, "nan", &llama_meta(2, vec![]), freqs(vec![1.0, f32::NAN, 2.0, 2.0]), &says);
    // Divisors that fall again at a longer wavelength.
    let says = ["rope_freqs.weight", "no Llama 3 scaling"];
    refused(dir, "off", &llama_meta(2, vec![]), freqs(vec![1.0, 1.5, 3.0, 2.0]), &says);
    // RoPE over part of each head but Phi-3's, or over an odd number of its dimensions.
    let partial = ("llama.rope.dimension_count", GgufValue::U32(4));
    let says = [
        "`llama.rope.dimension_count` is 4: RoPE over part of a head's 8 dimensions",
        "but for Phi's, Phi-3's, StableLM's, GLM-4's and GPT-NeoX's",
    ];
    refused(dir, "partial", &llama_meta(2, vec![partial]), vec![], &says);
    let odd = ("phi3.rope.dimension_count", GgufValue::U32(5));
    let says = ["`phi3.rope.dimension_count` is 5", "but an even number of them"];
    refused(dir, "odd", &arch_meta("phi3", 2, vec![odd]), vec![], &says);
    // Phi-3's LongRoPE (its 128k-context models) with a factor tensor missing, too few factors,
    // no original context; as Phi-4-mini (6 of 8 dimensions rotated) it converts.
    let factors = |n: usize| {
        ["short", "long"].map(|k| (format!("rope_factors_{k}.weight"), vec![n], vec![1.5; n])).to_vec()
    };
    let original = || ("phi3.rope.scaling.original_context_length", GgufValue::U32(64));
    let says = ["rope_factors_long.weight", "LongRoPE's factors without `rope_factors_short.weight`"];
    refused(dir, "longrope-half", &arch_meta("phi3", 2, vec![original()]), factors(4)[1..].to_vec(), &says);
    let says = ["rope_factors_short.weight", "holds 3 factors (expected 4"];
    refused(dir, "longrope-few", &arch_meta("phi3", 2, vec![original()]), factors(3), &says);
    let says = ["LongRoPE's factors without `phi3.rope.scaling.original_context_length`"];
    refused(dir, "longrope-ctx", &arch_meta("phi3", 2, vec![]), factors(4), &says);
    let dims = ("phi3.rope.dimension_count", GgufValue::U32(6));
    let (out, folder) =
        convert(dir, "longrope", 2, &arch_meta("phi3", 2, vec![original(), dims]), factors(3));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(folder.join("config.json")).unwrap()).unwrap();
    let want = serde_json::json!({"type": "longrope", "short_factor": [1.5, 1.5, 1.5], "long_factor": [1.5, 1.5, 1.5]});
    assert_eq!((&cfg["rope_scaling"], &cfg["partial_rotary_factor"]), (&want, &serde_json::json!(0.75)));
    assert_eq!(cfg["original_max_position_embeddings"], 64);
    let old_linear = ("llama.rope.scale_linear", GgufValue::F32(2.0));
    let says = ["beside linear scaling (`llama.rope.scale_linear`)"];
    refused(dir, "both", &llama_meta(2, vec![old_linear]), freqs(vec![1.0; 4]), &says);
}

/// What a Gemma GGUF's metadata says, as llama.cpp reads it, in HF's config: Gemma 2's soft
/// caps, window and local layers where it gives none (50, 30, 4096, every other layer); the
/// 27B models' query scale (by their layers: 62 for Gemma 3) from `hidden / heads`, not the
/// head's width; a Gemma 3 without a window global throughout; local layers listed per layer
/// as HF's `layer_types`. An architecture convert does not know, or no heads, is one error line.
#[test]
fn convert_reads_gemma_metadata_as_llama_cpp_does() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let config = |name: &str, arch: &str, extra: Vec<(&str, GgufValue)>| {
        let (out, folder) = convert(dir, name, 2, &arch_meta(arch, 2, extra), vec![]);
        assert!(out.status.success(), "{name}: {}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice::<serde_json::Value>(&std::fs::read(folder.join("config.json")).unwrap())
            .unwrap()
    };
    let pick = |c: &serde_json::Value, keys: &[&str]| -> serde_json::Value {
        keys.iter().map(|k| (k.to_string(), c[*k].clone())).collect::<serde_json::Map<_, _>>().into()
    };
    let heads_of_16 = || GgufValue::U32(16);
    let c = config("gemma2", "gemma2", vec![("gemma2.attention.key_length", heads_of_16())]);
    let keys = ["model_type", "attn_logit_softcapping", "final_logit_softcapping", "sliding_window"];
    let keys =
        [&keys[..], &["sliding_window_pattern", "query_pre_attn_scalar", "hidden_activation", "hidden_act"]]
            .concat();
    let want = serde_json::json!({
        "model_type": "gemma2", "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
        "sliding_window": 4096, "sliding_window_pattern": 2, "query_pre_attn_scalar": 16,
        "hidden_activation": "gelu_pytorch_tanh", "hidden_act": null,
    });
    assert_eq!(pick(&c, &keys), want);
    let c = config(
        "gemma3-27b",
        "gemma3",
        vec![("gemma3.block_count", GgufValue::U32(62)), ("gemma3.attention.key_length", heads_of_16())],
    );
    assert_eq!((&c["model_type"], &c["query_pre_attn_scalar"]), (&"gemma3_text".into(), &8.into()));
    assert_eq!((&c["sliding_window_pattern"], &c["rope_local_base_freq"]), (&1.into(), &10000.0.into()));
    let flags = ("gemma3.attention.sliding_window_pattern", GgufValue::Bools(vec![true, false]));
    let window = ("gemma3.attention.sliding_window", GgufValue::U32(512));
    let c = config("gemma3-flags", "gemma3", vec![("gemma3.block_count", GgufValue::U32(2)), flags, window]);
    assert_eq!(c["layer_types"], serde_json::json!(["sliding_attention", "full_attention"]));
    assert_eq!((&c["sliding_window"], &c["query_pre_attn_scalar"]), (&512.into(), &8.into()));
    let says = ["unsupported architecture `bloom`", "gemma3"];
    refused(dir, "bloom", &arch_meta("bloom", 2, vec![]), vec![], &says);
    // No heads (a division by zero before it was checked).
    let says = ["`gemma3.attention.head_count` is 0"];
    let none = ("gemma3.attention.head_count", GgufValue::U32(0));
    refused(dir, "no-heads", &arch_meta("gemma3", 2, vec![none]), vec![], &says);
}

/// A vocabulary convert cannot make a tokenizer of is one error line naming what is wrong, and
/// no folder: an unknown tokenizer model, SentencePiece pieces without their scores or with
/// fewer scores than pieces, a BOS token asked for beyond the vocabulary.
#[test]
fn convert_refuses_a_vocabulary_it_cannot_read() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let model = |m: &str| ("tokenizer.ggml.model", GgufValue::Str(m.into()));
    let says = ["unsupported tokenizer model `bert`", "expected gpt2", "or llama"];
    refused(dir, "bert", &llama_meta(2, vec![model("bert")]), vec![], &says);
    refused(dir, "no-scores", &llama_meta(2, vec![model("llama")]), vec![], &["`tokenizer.ggml.scores`"]);
    let few = ("tokenizer.ggml.scores", GgufValue::F32s(vec![0.0]));
    let says = ["tokenizer.ggml.scores holds scores for 1 of 2 tokens"];
    refused(dir, "few-scores", &llama_meta(2, vec![model("llama"), few]), vec![], &says);
    let bos = [
        ("tokenizer.ggml.add_bos_token", GgufValue::Bool(true)),
        ("tokenizer.ggml.bos_token_id", GgufValue::U32(9)),
    ];
    let says = ["`tokenizer.ggml.bos_token_id` is 9, beyond the vocabulary of 2"];
    refused(dir, "bos", &llama_meta(2, bos.into()), vec![], &says);
}

/// Deterministic indices below `n`.
fn picks(count: usize, seed: u64, n: usize) -> Vec<usize> {
    rand_vec(count, seed, 1.0)
        .into_iter()
        .map(|x| (((x + 1.0) / 2.0 * n as f32) as usize).min(n - 1))
        .collect()
}

/// A SentencePiece GGUF (llama.cpp's `llama` tokenizer model: pieces, their scores and types,
/// as Llama 2, Mistral and Mixtral GGUFs hold them) converts into a tokenizer that encodes as
/// SentencePiece does — merges by score, characters beyond the vocabulary (CJK, emoji, tabs,
/// newlines, digits) as their bytes, runs of spaces, spaces first and last — decodes back to the
/// text, and puts the BOS token first as the GGUF asks.
#[test]
fn a_sentencepiece_gguf_converts_to_a_tokenizer_that_encodes_as_sentencepiece() {
    let corpus: Vec<&str> = picks(4000, 7, WORDS.len()).into_iter().map(|i| WORDS[i]).collect();
    let sp = SentencePiece::learn(&corpus.join(" "), 120);
    let n = sp.pieces.len();
    let meta = llama_meta(
        n,
        vec![
            ("tokenizer.ggml.model", GgufValue::Str("llama".into())),
            ("tokenizer.ggml.tokens", GgufValue::Strs(sp.pieces.clone())),
            ("tokenizer.ggml.scores", GgufValue::F32s(sp.scores.clone())),
            ("tokenizer.ggml.token_type", GgufValue::I32s(sp.types.clone())),
            ("tokenizer.ggml.unknown_token_id", GgufValue::U32(SentencePiece::UNK)),
            ("tokenizer.ggml.bos_token_id", GgufValue::U32(SentencePiece::BOS)),
            ("tokenizer.ggml.eos_token_id", GgufValue::U32(SentencePiece::EOS)),
            ("tokenizer.ggml.add_bos_token", GgufValue::Bool(true)),
        ],
    );
    let tmp = tempfile::tempdir().unwrap();
    let (out, dir) = convert(tmp.path(), "spm", n, &meta, vec![]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let tok = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();

    let mut texts: Vec<String> =
        ["the tank", "  two spaces", "trailing ", "naïve café", "a\nb\tc", "emerge 2024 😀 中文"]
            .map(String::from)
            .to_vec();
    // Words and characters beyond them, spaces among them.
    let chars: Vec<char> = "theranksipl gdcoméï  \n\t09中😀".chars().collect();
    for t in 0..1500u64 {
        let len = 1 + picks(1, 100 + t, 40)[0];
        let words: String =
            picks(len, 200 + t, WORDS.len()).into_iter().map(|i| WORDS[i]).collect::<Vec<_>>().join(" ");
        let mixed: String = picks(len, 300 + t, chars.len()).into_iter().map(|i| chars[i]).collect();
        texts.extend([words, mixed]);
    }
    let mut merged = 0;
    for text in &texts {
        let want = sp.encode(text);
        let got = tok.encode(text.as_str(), false).unwrap().get_ids().to_vec();
        assert_eq!(got, want, "{text:?}");
        assert_eq!(sp.decode(&want), *text);
        assert_eq!(tok.decode(&got, true).unwrap(), *text);
        let with_bos = tok.encode(text.as_str(), true).unwrap().get_ids().to_vec();
        assert_eq!(with_bos, [&[SentencePiece::BOS][..], &want].concat(), "{text:?}");
        merged += want.iter().filter(|&&id| sp.pieces[id as usize].chars().count() > 1).count();
    }
    // The check meets the learned pieces, not single characters alone.
    assert!(merged > texts.len(), "{merged} merged pieces in {} texts", texts.len());
    let cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("tokenizer_config.json")).unwrap()).unwrap();
    assert_eq!((cfg["bos_token"].as_str(), cfg["eos_token"].as_str()), (Some("<s>"), Some("</s>")));
}

/// llama.cpp's tokenizer test vocabularies, fetched by `launch/get-vocabs`: (name, the BOS
/// token HF's tokenizer puts first, if it does). Real models' vocabularies: Llama 2's and
/// Phi-3's SentencePiece; Llama 3's, Qwen2's, Qwen3.5's, DeepSeek LLM's and DeepSeek Coder's,
/// GPT-2's, StarCoder's and Refact's byte-level BPE.
const REAL_VOCABULARIES: [(&str, Option<u32>); 10] = [
    ("llama-spm", Some(1)),
    ("phi-3", Some(1)),
    ("llama-bpe", Some(128000)),
    ("qwen2", None),
    ("qwen35", None),
    ("deepseek-llm", Some(100000)),
    ("deepseek-coder", Some(32013)),
    ("gpt-2", None),
    ("starcoder", None),
    ("refact", None),
];

/// Each real vocabulary converts (`--vocab-only`: these files hold no weights) into a tokenizer
/// that encodes llama.cpp's test strings (accents, CJK, emoji, runs of spaces, tabs and
/// newlines, digits, code) into exactly the ids HF's own tokenizer gave them, and puts the BOS
/// token first where HF's does.
#[test]
fn real_vocabularies_encode_as_hf_tokenizers_do() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let fetched = Command::new(root.join("launch/get-vocabs")).output().unwrap();
    assert!(fetched.status.success(), "{}", String::from_utf8_lossy(&fetched.stderr));
    let vocabs = PathBuf::from(String::from_utf8(fetched.stdout).unwrap().trim());
    let tmp = tempfile::tempdir().unwrap();
    for (name, bos) in REAL_VOCABULARIES {
        let gguf = vocabs.join(format!("ggml-vocab-{name}.gguf"));
        let dir = tmp.path().join(name);
        let out = gridlm(&["convert", "--vocab-only", "--gguf", path_str(&gguf), "--out", path_str(&dir)]);
        assert!(out.status.success(), "{name}: {}", String::from_utf8_lossy(&out.stderr));
        let tok = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
        let read = |ext: &str| std::fs::read_to_string(format!("{}{ext}", gguf.display())).unwrap();
        let (texts, ids) = (read(".inp"), read(".out"));
        // Each text ends with a line of its own saying so.
        let texts: Vec<&str> = texts.split_terminator("\n__ggml_vocab_test__\n").collect();
        let ids: Vec<Vec<u32>> =
            ids.lines().map(|l| l.split_whitespace().map(|t| t.parse().unwrap()).collect()).collect();
        assert!(
            texts.len() >= 40 && ids.len() == texts.len(),
            "{name}: {} texts, {} answers",
            texts.len(),
            ids.len()
        );
        for (text, want) in texts.iter().zip(&ids) {
            let got = tok.encode(*text, false).unwrap().get_ids().to_vec();
            assert_eq!(&got, want, "{name}: {text:?}");
        }
        let hello = tok.encode("Hello", true).unwrap().get_ids().to_vec();
        assert_eq!(hello.len(), 1 + usize::from(bos.is_some()), "{name}: {hello:?}");
        assert_eq!(bos.is_some_and(|b| hello[0] == b), bos.is_some(), "{name}: {hello:?}");
    }
}

/// GPT-2's tokenizer saved as `vocab.json` and `merges.txt` alone (no tokenizer.json, as
/// transformers saved it before tokenizer.json): read as HF's `GPT2Tokenizer` reads them, it
/// encodes llama.cpp's test strings into the ids HF's tokenizer gave them (transformers 5.25
/// from these two files gave the same, checked by hand), `<|endoftext|>` a special token and the
/// end of text; another tokenizer class saved so is refused, naming it.
#[test]
fn gpt2_vocab_and_merges_encode_as_hf_tokenizers_do() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let fetched = Command::new(root.join("launch/get-vocabs")).output().unwrap();
    assert!(fetched.status.success(), "{}", String::from_utf8_lossy(&fetched.stderr));
    let gguf = PathBuf::from(String::from_utf8(fetched.stdout).unwrap().trim()).join("ggml-vocab-gpt-2.gguf");
    let tmp = tempfile::tempdir().unwrap();
    let json_dir = tmp.path().join("json");
    let out = gridlm(&["convert", "--vocab-only", "--gguf", path_str(&gguf), "--out", path_str(&json_dir)]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // The vocabulary and merges of the converted tokenizer.json, as GPT-2's files hold them.
    let t: serde_json::Value =
        serde_json::from_slice(&std::fs::read(json_dir.join("tokenizer.json")).unwrap()).unwrap();
    let dir = tmp.path().join("slow");
    std::fs::create_dir(&dir).unwrap();
    std::fs::write(dir.join("vocab.json"), t["model"]["vocab"].to_string()).unwrap();
    let merges: Vec<String> = t["model"]["merges"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            m.as_str().map_or_else(
                || format!("{} {}", m[0].as_str().unwrap(), m[1].as_str().unwrap()),
                String::from,
            )
        })
        .collect();
    std::fs::write(dir.join("merges.txt"), format!("#version: 0.2\n{}\n", merges.join("\n"))).unwrap();
    std::fs::write(dir.join("config.json"), r#"{"model_type": "gpt2"}"#).unwrap();
    let tok = gridlm::tokenizer::Tokenizer::from_dir(&dir).unwrap();
    let read = |ext: &str| std::fs::read_to_string(format!("{}{ext}", gguf.display())).unwrap();
    let (texts, ids) = (read(".inp"), read(".out"));
    let texts: Vec<&str> = texts.split_terminator("\n__ggml_vocab_test__\n").collect();
    let ids: Vec<Vec<u32>> =
        ids.lines().map(|l| l.split_whitespace().map(|t| t.parse().unwrap()).collect()).collect();
    assert!(texts.len() >= 40 && ids.len() == texts.len());
    for (text, want) in texts.iter().zip(&ids) {
        assert_eq!(&tok.encode(text, true).unwrap(), want, "{text:?}");
    }
    assert_eq!(tok.encode("a<|endoftext|>b", true).unwrap(), [64, 50256, 65]);
    assert_eq!(tok.eos_id(), Some(50256));
    assert_eq!(tok.decode(&[15496, 995, 50256]).unwrap(), "Hello world");
    // Its config's switches, as transformers 5.25 takes them (its ids, by hand): the beginning
    // token first, a space before the text (and after a special token).
    let switches = r#"{"tokenizer_class": "GPT2Tokenizer", "add_bos_token": true, "add_prefix_space": true}"#;
    std::fs::write(dir.join("tokenizer_config.json"), switches).unwrap();
    let tok = gridlm::tokenizer::Tokenizer::from_dir(&dir).unwrap();
    assert_eq!(tok.encode("Hello world", true).unwrap(), [50256, 18435, 995]);
    assert_eq!(tok.encode("Hello world", false).unwrap(), [18435, 995]);
    assert_eq!(tok.encode("a<|endoftext|>b", true).unwrap(), [50256, 257, 50256, 275]);
    // Qwen2's tokenizer is saved so too, but splits text otherwise.
    std::fs::write(dir.join("tokenizer_config.json"), r#"{"tokenizer_class": "Qwen2Tokenizer"}"#).unwrap();
    let e = gridlm::tokenizer::Tokenizer::from_dir(&dir).err().unwrap().to_string();
    assert!(e.contains("only as GPT-2's tokenizer") && e.contains("names Qwen2Tokenizer"), "{e}");
    // Nor a class nor a GPT-2 model: nothing says how to split the text.
    std::fs::remove_file(dir.join("tokenizer_config.json")).unwrap();
    std::fs::write(dir.join("config.json"), r#"{"model_type": "qwen2"}"#).unwrap();
    let e = gridlm::tokenizer::Tokenizer::from_dir(&dir).err().unwrap().to_string();
    assert!(e.contains("names no tokenizer_class, nor is config.json's model_type gpt2"), "{e}");
}

/// A converted model stops where llama.cpp stops it: `generation_config.json` lists the GGUF's
/// EOS, EOT and EOM tokens and the control tokens that end a turn or a text in the chat formats
/// llama.cpp knows (here Llama 3's), EOS first; a word that only looks like one is not listed.
#[test]
fn convert_lists_the_tokens_that_end_a_completion() {
    let tmp = tempfile::tempdir().unwrap();
    let tokens =
        ["<|begin_of_text|>", "<|end_of_text|>", "<|eom_id|>", "<|eot_id|>", "a", "<|im_end|>", "<|end|>"];
    let meta = llama_meta(
        tokens.len(),
        vec![
            ("tokenizer.ggml.tokens", GgufValue::Strs(tokens.map(String::from).to_vec())),
            ("tokenizer.ggml.token_type", GgufValue::I32s(vec![3, 3, 3, 3, 1, 3, 1])),
            ("tokenizer.ggml.eos_token_id", GgufValue::U32(3)),
            ("tokenizer.ggml.eom_token_id", GgufValue::U32(2)),
        ],
    );
    let (out, dir) = convert(tmp.path(), "ends", tokens.len(), &meta, vec![]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let read = |f: &str| -> serde_json::Value {
        serde_json::from_slice(&std::fs::read(dir.join(f)).unwrap()).unwrap()
    };
    assert_eq!(read("generation_config.json")["eos_token_id"], serde_json::json!([3, 2, 1, 5]));
    assert_eq!(read("config.json")["eos_token_id"], serde_json::json!(3));
}

/// GPT-2 and StarCoder GGUFs with KV heads HF's `gpt2` and `gpt_bigcode` cannot hold (GPT-2:
/// one a head; GPT-BigCode: one, or one a head): one error line naming the count, no folder.
#[test]
fn convert_refuses_kv_groups_gpt2_and_gpt_bigcode_lack() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let one = ("gpt2.attention.head_count_kv", GgufValue::U32(1));
    let says = ["`gpt2.attention.head_count_kv` is 1 of 4 heads", "one KV head a head"];
    refused(dir, "gpt2-mqa", &arch_meta("gpt2", 2, vec![one]), vec![], &says);
    let two = ("starcoder.attention.head_count_kv", GgufValue::U32(2));
    let says = ["`starcoder.attention.head_count_kv` is 2 of 4 heads", "one KV head, or one a head"];
    refused(dir, "starcoder-groups", &arch_meta("starcoder", 2, vec![two]), vec![], &says);
}

/// A closed stderr (`gridlm convert ... 2>&1 | true`) leaves the run's result alone: the folder
/// written and status 0 (the closing `wrote` line panicked, status 101).
#[test]
fn convert_succeeds_with_stderr_closed() {
    let tmp = tempfile::tempdir().unwrap();
    let gguf = tmp.path().join("m.gguf");
    write_gguf(
        &gguf,
        &llama_meta(4, vec![]),
        &[("token_embd.weight".to_string(), vec![4, 32], vec![0.5; 128])],
    );
    for vocab_only in [false, true] {
        let out_dir = tmp.path().join(format!("m-{vocab_only}"));
        let mut cmd = std::process::Command::new(bin());
        cmd.args(["convert", "--gguf", path_str(&gguf), "--out", path_str(&out_dir)]);
        if vocab_only {
            cmd.arg("--vocab-only");
        }
        let mut child = cmd.stderr(std::process::Stdio::piped()).spawn().expect("spawn");
        drop(child.stderr.take());
        let status = child.wait().expect("wait");
        assert!(status.success(), "vocab only {vocab_only}: {status:?}");
        assert!(out_dir.join("tokenizer.json").exists(), "vocab only {vocab_only}");
    }
}
