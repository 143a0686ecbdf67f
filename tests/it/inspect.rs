//! `gridlm inspect`: a model folder's summary and a grid's split of it, from the headers alone.

use super::*;

/// `inspect` reads no weight but finds every tensor a rank would read: a Qwen3-MoE folder on two
/// tp ranks (its experts' 40 columns split 32 and 8), and one missing an expert's tensor refused
/// with one line naming it.
#[test]
fn inspect_splits_a_folder_without_loading_it() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path();
    let m = gridlm_reference::TinyModel::qwen3_moe();
    m.write(dir);
    let out = gridlm(&["inspect", "--model", path_str(dir), "--tp", "2", "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(j["model_type"], "qwen3_moe");
    assert!(j["ffn"]
        .as_str()
        .unwrap()
        .starts_with("3 of 6 experts a token, 40 columns each, in 2 of 4 layers"));
    let ranks = j["ranks"].as_array().unwrap();
    let cols: Vec<u64> = ranks.iter().map(|r| r["expert_columns"].as_u64().unwrap()).collect();
    assert_eq!(cols, [32, 8]);
    assert!(ranks.iter().all(|r| r["weight_bytes"].as_u64().unwrap() > 0));
    assert!(j["params_per_token"].as_f64() < j["params"].as_f64());
    let text = gridlm(&["inspect", "--model", path_str(dir)]);
    assert!(String::from_utf8_lossy(&text.stdout).contains("| rank | stage | tp | layers |"));
    let gone = "model.layers.1.mlp.experts.5.up_proj.weight";
    let tensors: Vec<_> = m.tensors().into_iter().filter(|(n, _, _)| n != gone).collect();
    gridlm_reference::write_safetensors(&dir.join("model.safetensors"), &tensors);
    let out = gridlm(&["inspect", "--model", path_str(dir), "--tp", "2"]);
    assert_one_line_error(&out, &[&format!("tensor `{gone}`"), "missing"]);
}

/// The folder `dir` with each of `gone` taken away from `tensors` in turn: `inspect` on two
/// stages refuses it with one line naming that tensor.
fn each_missing_is_named(dir: &std::path::Path, tensors: &[(String, Vec<usize>, Vec<f32>)], gone: &[&str]) {
    for gone in gone {
        let kept: Vec<_> = tensors.iter().filter(|(n, _, _)| n != gone).cloned().collect();
        assert!(kept.len() < tensors.len(), "{gone} is not among the tensors");
        gridlm_reference::write_safetensors(&dir.join("model.safetensors"), &kept);
        let out = gridlm(&["inspect", "--model", path_str(dir), "--pp", "2"]);
        assert_one_line_error(&out, &[&format!("tensor `{gone}`"), "missing"]);
    }
}

/// `inspect` finds the biases and LayerNorm biases a rank would read (a Phi-2-style folder:
/// each one taken away in turn is refused with one line naming it), and reads no norm of an
/// OLMo-style folder, which holds none.
#[test]
fn inspect_finds_every_bias_and_no_weightless_norm() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path();
    let m = gridlm_reference::TinyModel::phi();
    m.write(dir);
    let out = gridlm(&["inspect", "--model", path_str(dir), "--pp", "2"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let gone = [
        "model.layers.1.self_attn.k_proj.bias",
        "model.layers.2.self_attn.dense.bias",
        "model.layers.0.mlp.fc1.bias",
        "model.layers.2.mlp.fc2.bias",
        "model.layers.1.input_layernorm.bias",
        "model.final_layernorm.bias",
        "lm_head.bias",
    ];
    each_missing_is_named(dir, &m.tensors(), &gone);
    let olmo = tempfile::tempdir().unwrap();
    gridlm_reference::TinyModel::olmo().write(olmo.path());
    let out = gridlm(&["inspect", "--model", path_str(olmo.path()), "--tp", "2", "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(j["model_type"], "olmo");
}

/// A Falcon-40B-style folder (its names under `transformer.`, q, k and v in one tensor, two
/// norms of each layer's input) and a GPT-NeoX-style one: split without loading, and each
/// tensor a rank reads, taken away in turn, refused with one line naming it.
#[test]
fn inspect_reads_falcon_and_gpt_neox_names() {
    use gridlm_reference::falcon::{FalconKind, TinyFalcon};
    let t = tempfile::tempdir().unwrap();
    let dir = t.path();
    let m = TinyFalcon::new(FalconKind::Grouped);
    m.write(dir);
    let out = gridlm(&["inspect", "--model", path_str(dir), "--tp", "2", "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(j["model_type"], "falcon");
    let gone = [
        "transformer.word_embeddings.weight",
        "transformer.h.1.self_attention.query_key_value.weight",
        "transformer.h.2.self_attention.dense.weight",
        "transformer.h.0.mlp.dense_h_to_4h.weight",
        "transformer.h.3.mlp.dense_4h_to_h.weight",
        "transformer.h.1.ln_attn.bias",
        "transformer.h.2.ln_mlp.weight",
        "transformer.ln_f.bias",
        "lm_head.weight",
    ];
    each_missing_is_named(dir, &m.tensors(), &gone);
    // GPT-NeoX's: q, k and v with their bias in one tensor, the head as transformers 4 named it.
    let neox = tempfile::tempdir().unwrap();
    let m = gridlm_reference::neox::TinyNeoX::new(true);
    m.write(neox.path());
    let gone =
        ["gpt_neox.layers.1.attention.query_key_value.bias", "gpt_neox.layers.2.mlp.dense_h_to_4h.bias"];
    each_missing_is_named(neox.path(), &m.tensors(), &gone);
    // Without `embed_out` the head is missing by the name transformers 5 gives it.
    let tensors: Vec<_> = m.tensors().into_iter().filter(|(n, _, _)| n != "embed_out.weight").collect();
    gridlm_reference::write_safetensors(&neox.path().join("model.safetensors"), &tensors);
    let out = gridlm(&["inspect", "--model", path_str(neox.path()), "--pp", "2"]);
    assert_one_line_error(&out, &["tensor `lm_head.weight`", "missing"]);
}

/// A GPT-2 folder saved from the bare model (names without `transformer.`, `Conv1D` matrices
/// stored `[in, out]`) and a StarCoder-style GPT-BigCode one (one KV head, on both tp ranks):
/// split without loading, the learned positions counted, and each tensor a rank reads, taken
/// away in turn, refused with one line naming it; a matrix stored the other way round refused
/// with its shape.
#[test]
fn inspect_reads_gpt2_and_gpt_bigcode_names() {
    use gridlm_reference::gpt2::{Gpt2Kind, TinyGpt2};
    let t = tempfile::tempdir().unwrap();
    let dir = t.path();
    let m = TinyGpt2::new(Gpt2Kind::Gpt2);
    m.write(dir);
    let out = gridlm(&["inspect", "--model", path_str(dir), "--tp", "2", "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!((j["model_type"].as_str(), j["context"].as_u64()), (Some("gpt2"), Some(64)));
    // Per layer 12·h² (h = 64) and the biases and norms not counted; the embedding, tied, and
    // the 64 positions.
    let h = m.hidden() as f64;
    let expected = m.layers as f64 * 12.0 * h * h + (m.vocab + m.positions) as f64 * h;
    assert_eq!(j["params"].as_f64(), Some(expected), "{j}");
    let gone = [
        "wte.weight",
        "wpe.weight",
        "h.1.attn.c_attn.bias",
        "h.2.attn.c_proj.weight",
        "h.0.mlp.c_fc.bias",
        "h.1.ln_2.weight",
        "ln_f.bias",
    ];
    each_missing_is_named(dir, &m.tensors(), &gone);
    // `c_fc` as `nn.Linear` would store it.
    let turned: Vec<_> = m
        .tensors()
        .into_iter()
        .map(|(n, s, v)| if n == "h.0.mlp.c_fc.weight" { (n, vec![s[1], s[0]], v) } else { (n, s, v) })
        .collect();
    gridlm_reference::write_safetensors(&dir.join("model.safetensors"), &turned);
    let out = gridlm(&["inspect", "--model", path_str(dir)]);
    assert_one_line_error(&out, &["tensor `h.0.mlp.c_fc.weight`", "[64, 256]"]);
    let bigcode = tempfile::tempdir().unwrap();
    let m = TinyGpt2::new(Gpt2Kind::MultiQuery);
    m.write(bigcode.path());
    let out = gridlm(&["inspect", "--model", path_str(bigcode.path()), "--tp", "2", "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!((j["model_type"].as_str(), j["kv_heads"].as_u64()), (Some("gpt_bigcode"), Some(1)));
    let ranks = j["ranks"].as_array().unwrap();
    assert!(ranks.iter().all(|r| r["kv_heads"] == serde_json::json!({"start": 0, "end": 1})), "{j}");
    let gone = ["transformer.wpe.weight", "transformer.h.2.attn.c_attn.bias", "transformer.h.0.ln_1.bias"];
    each_missing_is_named(bigcode.path(), &m.tensors(), &gone);
}

/// A Gemma 3-style folder (layers 0, 1 and 3 local through a window of 4) on two stages (layers
/// 0–1 and 2–3): the windowed layers counted, and each rank's share of its KV bytes a position.
#[test]
fn inspect_counts_the_windowed_layers() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path();
    gridlm_reference::TinyModel::gemma3().write(dir);
    let out = gridlm(&["inspect", "--model", path_str(dir), "--pp", "2", "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!((j["windowed_layers"].as_u64(), j["window"].as_u64()), (Some(3), Some(4)), "{j}");
    let r = j["ranks"].as_array().unwrap();
    let of = |i: usize, k: &str| r[i][k].as_u64().unwrap();
    // Two windowed layers of two on stage 0, one of two on stage 1.
    assert_eq!(of(0, "kv_windowed_bytes_per_position"), of(0, "kv_bytes_per_position"));
    assert_eq!(2 * of(1, "kv_windowed_bytes_per_position"), of(1, "kv_bytes_per_position"));
    let text = String::from_utf8_lossy(&gridlm(&["inspect", "--model", path_str(dir)]).stdout).to_string();
    assert!(text.contains("attention: 3 of 4 layers through a window of 4 positions"), "{text}");
}
