//! `gridlm convert`: a GGUF file → a HuggingFace-layout folder (`config.json`,
//! `model.safetensors`, `tokenizer.json`, `tokenizer_config.json`, `generation_config.json`).
//! The folder is written beside its destination and renamed into place at the end, so a failed
//! conversion never leaves a half-written model behind.

use super::gguf::{Gguf, TensorEntry, Value};
use super::DType;
use crate::config::{Arch, RopeScaling};
use crate::error::{Error, Result};
use half::{bf16, f16};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::models::bpe::BPE;
use tokenizers::normalizers::prepend::Prepend;
use tokenizers::normalizers::utils::Sequence as NormalizerSequence;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::processors::sequence::Sequence as PostSequence;
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::processors::PostProcessorWrapper;
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior, Tokenizer};

/// What `convert` did, for the CLI to report.
pub struct Summary {
    pub n_tensors: usize,
    pub bytes: usize,
}

pub fn convert(gguf_path: &Path, out: &Path, dtype: DType) -> Result<Summary> {
    if out.exists() {
        return Err(Error::file(out, "already exists; remove it or choose another --out"));
    }
    let g = Gguf::open(gguf_path)?;
    let arch = meta_str(&g, "general.architecture")?.to_string();
    // (GGUF architecture, HF architecture, the family: its `model_type`)
    let known = [
        ("llama", "LlamaForCausalLM", Arch::Llama),
        ("qwen2", "Qwen2ForCausalLM", Arch::Qwen2),
        ("qwen3", "Qwen3ForCausalLM", Arch::Qwen3),
        ("qwen2moe", "Qwen2MoeForCausalLM", Arch::Qwen2Moe),
        ("qwen3moe", "Qwen3MoeForCausalLM", Arch::Qwen3Moe),
        // The text models of Qwen2-VL and Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE: M-RoPE's
        // sections (`rope.dimension_sections`) turn by one position for text alone, which is
        // all gridlm takes: plain RoPE, the model a Qwen2, a Qwen3, a Qwen3-MoE.
        ("qwen2vl", "Qwen2ForCausalLM", Arch::Qwen2),
        ("qwen3vl", "Qwen3ForCausalLM", Arch::Qwen3),
        ("qwen3vlmoe", "Qwen3MoeForCausalLM", Arch::Qwen3Moe),
        ("phi3", "Phi3ForCausalLM", Arch::Phi3),
        ("gemma", "GemmaForCausalLM", Arch::Gemma),
        ("gemma2", "Gemma2ForCausalLM", Arch::Gemma2),
        ("gemma3", "Gemma3ForCausalLM", Arch::Gemma3),
        ("granite", "GraniteForCausalLM", Arch::Granite),
        ("granitemoe", "GraniteMoeForCausalLM", Arch::GraniteMoe),
        ("glm4", "Glm4ForCausalLM", Arch::Glm4),
        // The first GLM-4 (glm-4-9b-chat), as HF's `glm` has it.
        ("chatglm", "GlmForCausalLM", Arch::Glm),
        ("starcoder2", "Starcoder2ForCausalLM", Arch::Starcoder2),
        ("stablelm", "StableLmForCausalLM", Arch::StableLm),
        ("phi2", "PhiForCausalLM", Arch::Phi),
        ("olmo", "OlmoForCausalLM", Arch::Olmo),
        ("falcon", "FalconForCausalLM", Arch::Falcon),
        ("gptneox", "GPTNeoXForCausalLM", Arch::GptNeoX),
        ("gpt2", "GPT2LMHeadModel", Arch::Gpt2),
        // GPT-BigCode (StarCoder, SantaCoder).
        ("starcoder", "GPTBigCodeForCausalLM", Arch::GptBigCode),
    ];
    let Some((architecture, family)) =
        known.into_iter().find_map(|(a, hf, f)| (a == arch).then_some((hf, f)))
    else {
        return Err(Error::file(
            gguf_path,
            format!("unsupported architecture `{arch}` (expected llama (Mixtral too), qwen2, qwen3, qwen2moe, qwen3moe, qwen2vl, qwen3vl, qwen3vlmoe, phi3, gemma, gemma2, gemma3, granite, granitemoe, glm4, chatglm, starcoder2, stablelm, phi2, olmo, falcon, gptneox, gpt2 or starcoder)"),
        ));
    };
    // Mixtral is stored as a llama with experts.
    let mixtral =
        arch == "llama" && g.get("llama.expert_count").and_then(|v| v.as_u64()).is_some_and(|e| e > 0);
    let (architecture, family) =
        if mixtral { ("MixtralForCausalLM", Arch::Mixtral) } else { (architecture, family) };
    let key = |k: &str| format!("{arch}.{k}");
    let glm = arch == "glm4" || arch == "chatglm";
    // Families whose HF default rotates part of a head (a half, a quarter): the part is always
    // written, llama.cpp's default being the whole head.
    let partial_default = glm || matches!(arch.as_str(), "stablelm" | "phi2" | "gptneox");
    // LayerNorms, each with a bias.
    let layer_norms = matches!(arch.as_str(), "starcoder2" | "stablelm" | "phi2" | "gptneox");
    let moe = arch.ends_with("moe") || mixtral;
    let n_layers = meta_usize(&g, &key("block_count"))?;
    let hidden = meta_usize(&g, &key("embedding_length"))?;
    let n_heads = meta_usize(&g, &key("attention.head_count"))?;
    if n_heads == 0 {
        let msg = format!("`{}` is 0 (expected a positive number of heads)", key("attention.head_count"));
        return Err(Error::file(gguf_path, msg));
    }
    let n_kv_heads = g
        .get(&key("attention.head_count_kv"))
        .and_then(|v| v.as_u64())
        .map(|v| v as usize)
        .unwrap_or(n_heads);
    let tokens = meta_array(&g, "tokenizer.ggml.tokens")?;
    let vocab_size = tokens.len();
    let head_dim = g
        .get(&key("attention.key_length"))
        .and_then(|v| v.as_u64())
        .map(|v| v as usize)
        .unwrap_or(hidden / n_heads);
    let embd = g
        .tensor("token_embd.weight")
        .ok_or_else(|| Error::tensor(gguf_path, "token_embd.weight", "missing from the GGUF file"))?;
    if embd.shape() != [vocab_size, hidden] {
        return Err(Error::tensor(
            gguf_path,
            "token_embd.weight",
            format!(
                "shape {:?} disagrees with the vocabulary ({vocab_size}) and embedding_length ({hidden})",
                embd.shape()
            ),
        ));
    }
    // Made first, so a vocabulary it cannot convert is refused before any weight is written.
    let Vocabulary { tokenizer, config: tokenizer_config, ends } = tokenizer_of(&g)?;
    let theta = g.get(&key("rope.freq_base")).and_then(|v| v.as_f64()).unwrap_or(10000.0);
    let tied = g.tensor("output.weight").is_none();
    let bos = g.get("tokenizer.ggml.bos_token_id").and_then(|v| v.as_u64());
    let eos = g.get("tokenizer.ggml.eos_token_id").and_then(|v| v.as_u64());

    let mut config = serde_json::json!({
        "architectures": [architecture],
        "model_type": family.name(),
        "hidden_size": hidden,
        "intermediate_size": match g.get(&key("feed_forward_length")).and_then(|v| v.as_u64()) {
            Some(ff) => ff as usize,
            None if moe => meta_usize(&g, &key("expert_feed_forward_length"))?,
            None => meta_usize(&g, &key("feed_forward_length"))?,
        },
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab_size,
        "rms_norm_eps": g.get(&key("attention.layer_norm_rms_epsilon")).and_then(|v| v.as_f64()).unwrap_or(1e-5) as f32 as f64,
        "rope_theta": theta,
        "max_position_embeddings": g.get(&key("context_length")).and_then(|v| v.as_u64()).unwrap_or(2048),
        "tie_word_embeddings": tied,
        "hidden_act": "silu",
        // GLM-4's q/k/v biases, where its GGUF holds them (fused in the first GLM-4's).
        "attention_bias": arch.starts_with("qwen2")
            || (glm && ["attn_q", "attn_qkv"].iter().any(|t| g.tensor(&format!("blk.0.{t}.bias")).is_some())),
        "torch_dtype": match dtype { DType::F32 => "float32", DType::BF16 => "bfloat16", DType::F16 => "float16" },
        "rope_scaling": rope_scaling(&g, &arch, theta, head_dim)?,
    });
    if let Some(b) = bos {
        config["bos_token_id"] = b.into();
    }
    // Qwen2- and Qwen3-MoE: the layers with a router are sparse (as every
    // `decoder_sparse_step`-th where they fall so, else listed by their dense ones); llama.cpp
    // renormalizes the chosen experts' shares for Qwen3-MoE, as its own configs ask
    // (`norm_topk_prob`), and not for Qwen2-MoE, whose configs do not. Qwen2-MoE's shared
    // expert is as wide as `expert_shared_feed_forward_length` says.
    let experts = if moe { meta_usize(&g, &key("expert_count"))? } else { 0 };
    if mixtral || family == Arch::GraniteMoe {
        // Every layer sparse, experts as wide as `feed_forward_length`, shares renormalized.
        config["num_local_experts"] = experts.into();
        config["num_experts_per_tok"] = meta_usize(&g, &key("expert_used_count"))?.into();
    } else if moe {
        let sparse: Vec<bool> =
            (0..n_layers).map(|i| g.tensor(&format!("blk.{i}.ffn_gate_inp.weight")).is_some()).collect();
        let (step, only) = sparse_pattern(&sparse);
        let moe = serde_json::json!({
            "num_experts": experts,
            "num_experts_per_tok": meta_usize(&g, &key("expert_used_count"))?,
            "moe_intermediate_size": meta_usize(&g, &key("expert_feed_forward_length"))?,
            "norm_topk_prob": family == Arch::Qwen3Moe,
            "decoder_sparse_step": step,
            "mlp_only_layers": only,
        });
        if let (Some(c), Some(moe)) = (config.as_object_mut(), moe.as_object()) {
            c.extend(moe.clone());
        }
        if arch == "qwen2moe" {
            config["shared_expert_intermediate_size"] =
                meta_usize(&g, &key("expert_shared_feed_forward_length"))?.into();
        }
    }
    if let Some(e) = eos {
        config["eos_token_id"] = e.into();
    }
    let gemma = matches!(family, Arch::Gemma | Arch::Gemma2 | Arch::Gemma3);
    if gemma {
        gemma_config(&g, &arch, (n_layers, hidden, n_heads, head_dim), &mut config);
    }
    if matches!(family, Arch::Granite | Arch::GraniteMoe) {
        granite_config(&g, &arch, head_dim, &mut config)?;
    }
    if layer_norms {
        // The LayerNorms' epsilon, by each family's name for it.
        let eps = meta_f64(&g, &key("attention.layer_norm_epsilon"))?;
        if let Some(c) = config.as_object_mut() {
            c.remove("rms_norm_eps");
        }
        let name = if family == Arch::Starcoder2 { "norm_epsilon" } else { "layer_norm_eps" };
        config[name] = (eps as f32 as f64).into();
    }
    if family == Arch::StableLm {
        config["use_qkv_bias"] = g.tensor("blk.0.attn_q.bias").is_some().into();
    }
    if family == Arch::Olmo {
        olmo_config(&g, &mut config)?;
    }
    if family == Arch::Falcon {
        falcon_config(&g, n_kv_heads, &mut config)?;
    }
    if family == Arch::Phi {
        config["hidden_act"] = "gelu_new".into();
        config["qk_layernorm"] = false.into();
    }
    if family == Arch::Starcoder2 {
        // GELU, biases where the GGUF holds them (llama.cpp requires them), and the whole
        // context attended: llama.cpp keeps no window for StarCoder 2.
        config["hidden_act"] = "gelu_pytorch_tanh".into();
        config["use_bias"] = g.tensor("blk.0.attn_output.bias").is_some().into();
        config["sliding_window"] = serde_json::Value::Null;
    }
    // RoPE over part of a head: Phi-4-mini's and GLM's `partial_rotary_factor`, HF's reading
    // of which (`int(head_dim · factor)`) must give the GGUF's dimensions back. GLM's is always
    // written, as HF's default there is one half, llama.cpp's the whole head.
    let partial_arch = arch == "phi3" || partial_default;
    let rotated = g.get(&key("rope.dimension_count")).and_then(|v| v.as_u64()).map(|d| d as usize);
    if let Some(d) = rotated.or(partial_default.then_some(head_dim)) {
        let factor = d as f64 / head_dim as f64;
        let partial = partial_arch && d > 0 && d < head_dim && d.is_multiple_of(2);
        if partial && (head_dim as f64 * factor) as usize == d || (partial_default && d == head_dim) {
            config["partial_rotary_factor"] = factor.into();
        } else if d != head_dim {
            let msg = format!(
                "`{}` is {d}: RoPE over part of a head's {head_dim} dimensions is not supported{}",
                key("rope.dimension_count"),
                if partial_arch {
                    " (but an even number of them)"
                } else {
                    " (but for Phi's, Phi-3's, StableLM's, GLM-4's and GPT-NeoX's)"
                }
            );
            return Err(Error::file(gguf_path, msg));
        }
    }
    if family == Arch::GptNeoX {
        gpt_neox_config(&g, &mut config)?;
    }
    let gpt2 = matches!(family, Arch::Gpt2 | Arch::GptBigCode);
    if gpt2 {
        gpt2_config(&g, family, (n_heads, n_kv_heads), &mut config)?;
    }
    if arch == "phi3" {
        config["sliding_window"] = g
            .get(&key("attention.sliding_window"))
            .and_then(|v| v.as_u64())
            .map_or(serde_json::Value::Null, |w| w.into());
        if let Some(n) = g.get(&key("rope.scaling.original_context_length")).and_then(|v| v.as_u64()) {
            config["original_max_position_embeddings"] = n.into();
        }
        // Phi-3's long-context variants keep LongRoPE's factors as tensors.
        if let Some(longrope) = phi3_longrope(&g, &config)? {
            if !config["rope_scaling"].is_null() {
                let msg = "LongRoPE's factors beside another RoPE scaling have no HF equivalent";
                return Err(Error::tensor(gguf_path, "rope_factors_long.weight", msg));
            }
            config["rope_scaling"] = longrope;
        }
    }

    // Tensors, renamed to HF names; Q/K rows of llama GGUFs un-permuted (llama.cpp interleaves
    // the two halves of each head for its RoPE; HF rotates halves; its qwen2 and qwen3
    // converters leave them as HF has them). Each is dequantized only when the writer reaches
    // it, so a conversion holds one tensor at a time, not the model.
    let mut named: Vec<(String, Lazy)> = Vec::new();
    for t in &g.tensors {
        // A mixture's tensors take the names the model reads them by; each expert's part of a
        // stacked tensor ([experts, rows, columns]) becomes an HF tensor of its own.
        let hf = match moe_tensor(&t.name) {
            Some((layer, false, which @ 1..)) => {
                let shape = t.shape();
                if shape.len() != 3 || shape[0] != experts {
                    return Err(Error::tensor(
                        gguf_path,
                        &t.name,
                        format!("shape {shape:?} is not [{experts} experts, rows, columns]"),
                    ));
                }
                if g.dequantize_part(t, 0, experts).is_none() {
                    return Err(Error::tensor(
                        gguf_path,
                        &t.name,
                        "an expert's part does not end on a quantization block",
                    ));
                }
                let dt = dtype;
                if family == Arch::GraniteMoe {
                    // GraniteMoE's checkpoints keep each layer's stack.
                    named.extend(granite_moe_stack(&g, t, layer, which, experts, dt)?);
                    continue;
                }
                for e in 0..experts {
                    let g = &g;
                    let make = move || encode(&g.dequantize_part(t, e, experts).unwrap_or_default(), dt);
                    let name = crate::model::expert_names(family, layer, e)[which].clone();
                    named.push((name, Lazy::new(dt, shape[1..].to_vec(), make)));
                }
                continue;
            }
            Some((layer, true, which)) => crate::model::shared_expert_names(layer)[which].clone(),
            Some((layer, false, _)) => crate::model::router_name(family, layer),
            // The first GLM-4's (and some Phi-2 GGUFs') q, k and v rows and biases in one
            // tensor: HF's `glm` and `phi` keep them apart.
            None if (arch == "chatglm" || arch == "phi2") && t.name.contains(".attn_qkv.") => {
                named.extend(split_qkv(&g, t, (n_heads, n_kv_heads, head_dim), dtype)?);
                continue;
            }
            None if gpt2 => match gpt2_name(&t.name) {
                Some(hf) => hf,
                None => {
                    let msg = "not a tensor of llama.cpp's GPT-2 or StarCoder (the folder would hold another model)";
                    return Err(Error::tensor(gguf_path, &t.name, msg));
                }
            },
            None if family == Arch::GptNeoX => match gpt_neox_name(&t.name) {
                Some(hf) => hf,
                None => {
                    let msg = "not a tensor of llama.cpp's GPT-NeoX (the folder would hold another model)";
                    return Err(Error::tensor(gguf_path, &t.name, msg));
                }
            },
            None if family == Arch::Falcon => {
                match falcon_name(&t.name, config["num_ln_in_parallel_attn"] == 2) {
                    Some(hf) => hf,
                    None => {
                        let msg = "not a tensor of llama.cpp's Falcon (the folder would hold another model)";
                        return Err(Error::tensor(gguf_path, &t.name, msg));
                    }
                }
            }
            None => match hf_name(&arch, &t.name) {
                Some(hf) => hf,
                // A bias the model would add (Granite's optional ones on o_proj and the FFN,
                // say): left out, the folder would hold another model.
                None if t.name.ends_with(".bias") => {
                    let msg = "a bias gridlm does not load for this architecture (the folder would hold another model)";
                    return Err(Error::tensor(gguf_path, &t.name, msg));
                }
                // Not weights: RoPE frequency factors (read into `rope_scaling`), tables some
                // converters add.
                None => continue,
            },
        };
        // Qwen2-MoE's shared expert's gate: one row (GGUF stores it as a vector).
        let shape = if t.name.ends_with("ffn_gate_inp_shexp.weight") { vec![1, hidden] } else { t.shape() };
        let permuted = matches!(arch.as_str(), "llama" | "granite" | "granitemoe" | "olmo");
        let heads = [("attn_q.weight", n_heads), ("attn_k.weight", n_kv_heads)]
            .into_iter()
            .find_map(|(name, heads)| (permuted && t.name.ends_with(name)).then_some(heads));
        // Falcon's, GPT-NeoX's and GPT-BigCode's q, k and v rows (and their biases), which
        // llama.cpp's converters put one after the other, in HF's groups again (GPT-NeoX's a
        // head each; GPT-BigCode's one group with `multi_query`, else a head each).
        let fused = matches!(family, Arch::Falcon | Arch::GptNeoX | Arch::GptBigCode)
            && t.name.contains(".attn_qkv.");
        let regroup = fused.then_some((n_heads, n_kv_heads, head_dim));
        // GPT-2's `Conv1D` matrices, which llama.cpp stores as `nn.Linear`'s: `[in, out]` again.
        let turn = family == Arch::Gpt2 && shape.len() == 2 && crate::model::conv1d(&hf);
        // Norms and biases stay f32: tiny, and precision matters there.
        let dt = if shape.len() == 1 { DType::F32 } else { dtype };
        let cols = shape.get(1).copied().unwrap_or(1);
        let shape = if turn { vec![shape[1], shape[0]] } else { shape };
        // llama.cpp stores Gemma's norms as they multiply (`1 + w`); HF stores `w`.
        let less_one = gemma && hf.ends_with("norm.weight");
        let g = &g;
        let make = move || {
            let mut v = g.dequantize(t);
            if less_one {
                v.iter_mut().for_each(|x| *x -= 1.0);
            }
            let v = match heads {
                Some(heads) => unpermute_rows(&v, heads, cols),
                None => v,
            };
            let v = match regroup {
                Some(shape) => falcon_grouped_rows(&v, shape, cols),
                None => v,
            };
            let v = if turn { super::transposed(&v, v.len() / cols.max(1), cols) } else { v };
            encode(&v, dt)
        };
        named.push((hf, Lazy::new(dt, shape, make)));
    }
    let n_tensors = named.len();
    let bytes: usize = named.iter().map(|(_, t)| t.len).sum();

    write_aside(out, |tmp| {
        let st_path = tmp.join("model.safetensors");
        let mut meta = HashMap::new();
        meta.insert("format".to_string(), "pt".to_string());
        safetensors::serialize_to_file(named, Some(meta), &st_path).map_err(|e| match e {
            safetensors::SafeTensorError::IoError(e) => Error::io(&st_path, e),
            e => Error::file(&st_path, format!("cannot write: {e}")),
        })?;
        write_json(&tmp.join("config.json"), &config)?;
        let mut gen = serde_json::json!({});
        if let Some(b) = bos {
            gen["bos_token_id"] = b.into();
        }
        match ends[..] {
            [] => {}
            [e] => gen["eos_token_id"] = e.into(),
            _ => gen["eos_token_id"] = ends.clone().into(),
        }
        write_json(&tmp.join("generation_config.json"), &gen)?;
        write_tokenizer(tmp, &tokenizer, &tokenizer_config)
    })?;
    Ok(Summary { n_tensors, bytes })
}

/// The tokens that end a completion, for `generation_config.json` (as HF's instruct models list
/// them: Llama 3.1's end of text, of a message and of a turn, say), read as llama.cpp reads a
/// GGUF: its EOS, EOT and EOM tokens and the control tokens (`types` 3) named as ends of a turn
/// or a text by the chat formats it knows; EOS first.
fn end_tokens(g: &Gguf, tokens: &[&str], types: &[i64]) -> Vec<u64> {
    const NAMES: [&str; 9] = [
        "<|eot_id|>",
        "<|eom_id|>",
        "<|im_end|>",
        "<|end|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "<|end_of_text|>",
        "<EOT>",
        "<\u{ff5c}end\u{2581}of\u{2581}sentence\u{ff5c}>",
    ];
    let id = |k: &str| g.get(&format!("tokenizer.ggml.{k}_token_id")).and_then(|v| v.as_u64());
    let mut ends: Vec<u64> = [id("eos"), id("eot"), id("eom")].into_iter().flatten().collect();
    for (i, (t, &ty)) in tokens.iter().zip(types).enumerate() {
        if ty == 3 && NAMES.contains(t) {
            ends.push(i as u64);
        }
    }
    let mut seen = std::collections::HashSet::new();
    ends.retain(|e| seen.insert(*e));
    ends
}

/// `gridlm convert --vocab-only`: the tokenizer of a GGUF's vocabulary alone (`tokenizer.json`
/// and `tokenizer_config.json`), of any architecture, weights or none (as llama.cpp's
/// vocabulary-only files hold).
pub fn convert_vocab(gguf_path: &Path, out: &Path) -> Result<()> {
    if out.exists() {
        return Err(Error::file(out, "already exists; remove it or choose another --out"));
    }
    let g = Gguf::open(gguf_path)?;
    let Vocabulary { tokenizer, config, .. } = tokenizer_of(&g)?;
    write_aside(out, |tmp| write_tokenizer(tmp, &tokenizer, &config))
}

fn write_tokenizer(dir: &Path, tokenizer: &Tokenizer, config: &serde_json::Value) -> Result<()> {
    let path = dir.join("tokenizer.json");
    tokenizer.save(&path, false).map_err(|e| Error::file(&path, format!("cannot write: {e}")))?;
    write_json(&dir.join("tokenizer_config.json"), config)
}

/// The folder `out` written by `write` into a folder beside it, renamed into place once whole;
/// on failure removed, so nothing half-written is left.
fn write_aside(out: &Path, write: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let tmp = out.with_file_name(format!(
        ".{}.partial-{}",
        out.file_name().and_then(|s| s.to_str()).unwrap_or("model"),
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
    if let Err(e) = write(&tmp) {
        let _ = std::fs::remove_dir_all(&tmp);
        // The folder aside is gone: name the file as it would have been in `out`.
        let moved = |path: PathBuf| match path.strip_prefix(&tmp) {
            Ok(rest) => out.join(rest),
            Err(_) => path,
        };
        return Err(match e {
            Error::Io { path, err } => Error::Io { path: moved(path), err },
            Error::File { path, msg } => Error::File { path: moved(path), msg },
            Error::Tensor { path, tensor, msg } => Error::Tensor { path: moved(path), tensor, msg },
            e => e,
        });
    }
    std::fs::rename(&tmp, out).map_err(|e| Error::io(out, e))
}

/// A tensor of the folder being written whose bytes (`len` of them) are made only when the
/// safetensors writer asks for them.
struct Lazy<'a> {
    dtype: DType,
    shape: Vec<usize>,
    len: usize,
    make: Box<dyn Fn() -> Vec<u8> + 'a>,
}

impl<'a> Lazy<'a> {
    /// A tensor of `dtype` and `shape` whose bytes `make` makes.
    fn new(dtype: DType, shape: Vec<usize>, make: impl Fn() -> Vec<u8> + 'a) -> Self {
        let len = shape.iter().product::<usize>() * dtype.size_bytes();
        Lazy { dtype, shape, len, make: Box::new(make) }
    }
}

impl safetensors::View for Lazy<'_> {
    fn dtype(&self) -> safetensors::Dtype {
        match self.dtype {
            DType::F32 => safetensors::Dtype::F32,
            DType::BF16 => safetensors::Dtype::BF16,
            DType::F16 => safetensors::Dtype::F16,
        }
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        let bytes = (self.make)();
        assert_eq!(bytes.len(), self.len, "a converted tensor's bytes");
        bytes.into()
    }
    fn data_len(&self) -> usize {
        self.len
    }
}

/// The Gemma family's config fields from a GGUF of `arch` gemma, gemma2 or gemma3, as
/// llama.cpp reads them: GELU's tanh form; for Gemma 2 and 3 the query scale (llama.cpp's:
/// `1/sqrt(hidden / heads)` for the 27B models, known by their layers, 46 and 62, else
/// `1/sqrt(head_dim)`, as Google's own configs have it), the window and which layers are local
/// (`attention.sliding_window_pattern`, a number or a flag per layer; else every other layer for
/// Gemma 2, five of six for Gemma 3, whose local layers rotate by `rope.freq_base_swa`, 10000
/// where it is not given; none local where Gemma 3 has no window), and the soft caps (Gemma 2's
/// default to 50 and 30, as llama.cpp's).
fn gemma_config(
    g: &Gguf,
    arch: &str,
    (layers, hidden, heads, head_dim): (usize, usize, usize, usize),
    config: &mut serde_json::Value,
) {
    let key = |k: &str| format!("{arch}.{k}");
    let number = |k: &str| g.get(&key(k)).and_then(|v| v.as_f64());
    config["hidden_activation"] = "gelu_pytorch_tanh".into();
    if let Some(c) = config.as_object_mut() {
        c.remove("hidden_act");
    }
    if arch == "gemma" {
        return;
    }
    let big = (arch == "gemma2" && layers == 46) || (arch == "gemma3" && layers == 62);
    config["query_pre_attn_scalar"] = (if big { hidden / heads } else { head_dim }).into();
    let window = g.get(&key("attention.sliding_window")).and_then(|v| v.as_u64());
    match g.get(&key("attention.sliding_window_pattern")) {
        Some(Value::Array(flags)) => {
            let kinds: Vec<&str> = flags
                .iter()
                .map(|f| if matches!(f, Value::Bool(true)) { "sliding_attention" } else { "full_attention" })
                .collect();
            config["layer_types"] = kinds.into();
        }
        Some(v) => config["sliding_window_pattern"] = v.as_u64().into(),
        None => config["sliding_window_pattern"] = (if arch == "gemma2" { 2 } else { 6 }).into(),
    }
    if arch == "gemma2" {
        config["sliding_window"] = window.unwrap_or(4096).into();
        config["attn_logit_softcapping"] = number("attn_logit_softcapping").unwrap_or(50.0).into();
        config["final_logit_softcapping"] = number("final_logit_softcapping").unwrap_or(30.0).into();
        return;
    }
    config["rope_local_base_freq"] = number("rope.freq_base_swa").unwrap_or(10000.0).into();
    config["attn_logit_softcapping"] = serde_json::Value::Null;
    config["final_logit_softcapping"] = number("final_logit_softcapping").filter(|&c| c != 0.0).into();
    match window.filter(|&w| w > 0) {
        Some(w) => config["sliding_window"] = w.into(),
        None => {
            // Every layer global.
            config["sliding_window"] = 4096.into();
            config["sliding_window_pattern"] = 1.into();
            if let Some(c) = config.as_object_mut() {
                c.remove("layer_types");
            }
        }
    }
}

/// HF's `rope_scaling` of Phi-3's LongRoPE from a GGUF whose `rope_factors_short.weight` and
/// `rope_factors_long.weight` hold its factors (one per rotated pair of `config`'s heads), as
/// llama.cpp writes them; `None` if it holds neither. The attention factor llama.cpp stores
/// (`rope.scaling.attn_factor`) goes into `attention_factor` only where it is not the one HF
/// works out from the two contexts itself.
fn phi3_longrope(g: &Gguf, config: &serde_json::Value) -> Result<Option<serde_json::Value>> {
    let names = ["rope_factors_short.weight", "rope_factors_long.weight"];
    let (short, long) = match names.map(|n| g.tensor(n)) {
        [None, None] => return Ok(None),
        [Some(s), Some(l)] => (s, l),
        [s, _] => {
            let (have, lacks) = if s.is_some() { (names[0], names[1]) } else { (names[1], names[0]) };
            return Err(Error::tensor(&g.path, have, format!("LongRoPE's factors without `{lacks}`")));
        }
    };
    let head_dim = config["head_dim"].as_u64().unwrap_or(0) as usize;
    let rotated =
        config["partial_rotary_factor"].as_f64().map_or(head_dim, |f| (head_dim as f64 * f) as usize);
    let mut factors = Vec::new();
    for t in [short, long] {
        let f = g.dequantize(t);
        if f.len() != rotated / 2 || !f.iter().all(|f| f.is_finite() && *f > 0.0) {
            let msg = format!(
                "holds {} factors (expected {} finite positive numbers, one per rotated pair)",
                f.len(),
                rotated / 2
            );
            return Err(Error::tensor(&g.path, &t.name, msg));
        }
        // The shortest decimal of each f32, as the HF config it came from wrote it.
        factors.push(f.iter().map(|f| f.to_string().parse::<f64>().unwrap_or(*f as f64)).collect::<Vec<_>>());
    }
    let arch = config["model_type"].as_str().unwrap_or("phi3");
    let Some(original) = config["original_max_position_embeddings"].as_u64() else {
        let msg = format!("LongRoPE's factors without `{arch}.rope.scaling.original_context_length`");
        return Err(Error::tensor(&g.path, names[1], msg));
    };
    let mut scaling =
        serde_json::json!({"type": "longrope", "short_factor": factors[0], "long_factor": factors[1]});
    let whole = config["max_position_embeddings"].as_u64().unwrap_or(original) as f64;
    let factor = whole / original as f64;
    let hf = RopeScaling::longrope_attention_factor(factor, original as usize);
    if let Some(a) = g.get(&format!("{arch}.rope.scaling.attn_factor")).and_then(|v| v.as_f64()) {
        if (a - hf).abs() > 1e-6 * hf {
            scaling["attention_factor"] = a.into();
        }
    }
    Ok(Some(scaling))
}

/// HF's `yarn` `rope_scaling` of a GGUF whose `rope.scaling.type` is yarn, as llama.cpp's
/// converter writes HF's: `rope.scaling.factor`, `original_context_length`, `yarn_beta_fast`
/// and `yarn_beta_slow`, and HF's `attention_factor` as `yarn_attn_factor` (times
/// `rope.scaling.attn_factor`, which llama.cpp multiplies every cos and sin by). What HF's
/// YaRN has no number for (`yarn_ext_factor` other than 1, DeepSeek's `yarn_log_multiplier`)
/// is refused.
fn yarn_scaling(g: &Gguf, arch: &str) -> Result<serde_json::Value> {
    let key = |k: &str| format!("{arch}.rope.scaling.{k}");
    let number = |k: &str| g.get(&key(k)).and_then(|v| v.as_f64());
    let positive = |k: &str, x: f64| {
        if x.is_finite() && x > 0.0 {
            Ok(x)
        } else {
            Err(Error::file(&g.path, format!("`{}` is {x} (expected a finite positive number)", key(k))))
        }
    };
    let Some(factor) = number("factor") else {
        let msg = format!("yarn RoPE scaling without the metadata number `{}`", key("factor"));
        return Err(Error::file(&g.path, msg));
    };
    if let Some(t) = g.tensor("rope_freqs.weight") {
        let msg = format!("RoPE frequency factors beside YaRN (`{}`) have no HF equivalent", key("type"));
        return Err(Error::tensor(&g.path, &t.name, msg));
    }
    let mut scaling = serde_json::json!({"rope_type": "yarn", "factor": positive("factor", factor)?});
    for (k, hf) in [
        ("original_context_length", "original_max_position_embeddings"),
        ("yarn_beta_fast", "beta_fast"),
        ("yarn_beta_slow", "beta_slow"),
    ] {
        if let Some(x) = number(k) {
            let x = positive(k, x)?;
            scaling[hf] = if k == "original_context_length" { (x as u64).into() } else { x.into() };
        }
    }
    for (k, none) in [("yarn_ext_factor", 1.0), ("yarn_log_multiplier", 0.0)] {
        if let Some(x) = number(k).filter(|&x| x != none) {
            let msg = format!("`{}` is {x}: YaRN as HF computes it has no such number", key(k));
            return Err(Error::file(&g.path, msg));
        }
    }
    let given = number("yarn_attn_factor").map(|a| positive("yarn_attn_factor", a)).transpose()?;
    let times = number("attn_factor").map(|a| positive("attn_factor", a)).transpose()?.unwrap_or(1.0);
    if given.is_some() || times != 1.0 {
        // HF's own where the GGUF names none: 1 + 0.1 ln factor.
        let own = RopeScaling::yarn_mscale(factor, 1.0);
        scaling["attention_factor"] = (given.unwrap_or(own) * times).into();
    }
    Ok(scaling)
}

/// HF's `rope_scaling` for what the GGUF says of RoPE scaling: linear scaling as metadata
/// (`rope.scaling.type` and `rope.scaling.factor`, or the older `rope.scale_linear`), and Llama
/// 3.1–3.3's scaling by frequency as the tensor `rope_freqs.weight` (what each rotated pair's
/// frequency is divided by), from which HF's `llama3` numbers are recovered
/// ([`llama3_scaling`]).
fn rope_scaling(g: &Gguf, arch: &str, theta: f64, head_dim: usize) -> Result<serde_json::Value> {
    let key = |k: &str| format!("{arch}.rope.{k}");
    let number = |k: &str| g.get(&key(k)).and_then(|v| v.as_f64());
    if g.get(&key("scaling.type")).and_then(|v| v.as_str()) == Some("yarn") {
        return yarn_scaling(g, arch);
    }
    let linear = match g.get(&key("scaling.type")).and_then(|v| v.as_str()) {
        None | Some("none") => number("scale_linear").filter(|&f| f != 1.0).map(|f| ("scale_linear", f)),
        Some("linear") => match number("scaling.factor") {
            Some(f) => Some(("scaling.factor", f)),
            None => {
                let msg = format!("linear RoPE scaling without the metadata number `{}`", key("scaling.factor"));
                return Err(Error::file(&g.path, msg));
            }
        },
        Some(other) => {
            return Err(Error::file(
                &g.path,
                format!(
                    "unsupported RoPE scaling `{other}` (`{}`; supported: none, linear, yarn, and Llama 3's frequency factors)",
                    key("scaling.type")
                ),
            ))
        }
    };
    let factors = g.tensor("rope_freqs.weight");
    match (linear, factors) {
        (None, None) => Ok(serde_json::Value::Null),
        (Some((_, f)), None) if f.is_finite() && f > 0.0 => {
            Ok(serde_json::json!({"rope_type": "linear", "factor": f}))
        }
        (Some((k, f)), None) => {
            Err(Error::file(&g.path, format!("`{}` is {f} (expected a finite positive number)", key(k))))
        }
        (Some((k, _)), Some(t)) => Err(Error::tensor(
            &g.path,
            &t.name,
            format!("RoPE frequency factors beside linear scaling (`{}`) have no HF equivalent", key(k)),
        )),
        (None, Some(t)) => {
            let factors = g.dequantize(t);
            if factors.len() != head_dim / 2 {
                let msg = format!(
                    "holds {} RoPE frequency factors; a head of {head_dim} dimensions rotates {} pairs",
                    factors.len(),
                    head_dim / 2
                );
                return Err(Error::tensor(&g.path, &t.name, msg));
            }
            if let Some(f) = factors.iter().find(|f| !(f.is_finite() && **f > 0.0)) {
                let msg = format!("holds the RoPE frequency factor {f} (expected finite positive numbers)");
                return Err(Error::tensor(&g.path, &t.name, msg));
            }
            let original = number("scaling.original_context_length");
            match llama3_scaling(&factors, theta, original) {
                Some(None) => Ok(serde_json::Value::Null),
                Some(Some([factor, low, high, old])) => Ok(serde_json::json!({
                    "rope_type": "llama3",
                    "factor": factor,
                    "low_freq_factor": low,
                    "high_freq_factor": high,
                    "original_max_position_embeddings": old as u64,
                })),
                None => Err(Error::tensor(
                    &g.path,
                    &t.name,
                    "RoPE frequency factors that no Llama 3 scaling (HF's `llama3` RoPE type) gives",
                )),
            }
        }
    }
}

/// HF's `llama3` RoPE scaling, `[factor, low_freq_factor, high_freq_factor,
/// original_max_position_embeddings]`, under which each rotated pair's frequency (RoPE base
/// `theta`, a pair a factor) is its unscaled one divided by its factor in `factors`, as
/// llama.cpp's converter writes them; `Some(None)` where every factor is 1 (no scaling), `None`
/// where no such scaling gives every factor within 1e-4 of it.
///
/// `factor` is the largest factor. Meta's releases (3.1 to 3.3) take 1, 4 and 8192 for the
/// others (`original_context_length` for 8192 where the GGUF gives it), tried first. Otherwise
/// the factors strictly between 1 and `factor` lie on the ramp between the unscaled and the
/// scaled frequencies, where the share `s` of the unscaled one (`1/r = (1 - s)/factor + s`) is
/// linear in a wavelength's inverse: `s = (old/λ - low)/(high - low)`. A line through two or
/// more of them gives `old/(high - low)` and `low/(high - low)`, which fix the three but for one
/// scale (times k, each, the same frequencies): `old` is taken as the integer nearest to where
/// `low` is 1. With fewer on the ramp only Meta's numbers are tried.
fn llama3_scaling(factors: &[f32], theta: f64, original: Option<f64>) -> Option<Option<[f64; 4]>> {
    use std::f64::consts::TAU;
    let d = 2.0 * factors.len() as f64;
    let freq = |i: usize| 1.0 / theta.powf(2.0 * i as f64 / d);
    let r: Vec<f64> = factors.iter().map(|&x| x as f64).collect();
    let near = |a: f64, b: f64| (a - b).abs() <= 1e-4 * b;
    if r.iter().all(|&x| near(x, 1.0)) {
        return Some(None);
    }
    let factor = r.iter().copied().fold(0.0, f64::max);
    let gives = |&[factor, low_freq_factor, high_freq_factor, old]: &[f64; 4]| {
        let s = RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings: old,
        };
        high_freq_factor > low_freq_factor && (0..r.len()).all(|i| near(freq(i) / s.scale(i, freq(i)), r[i]))
    };
    let mut tries = vec![[factor, 1.0, 4.0, original.unwrap_or(8192.0)]];
    // (1/λ, s) on the ramp.
    let ramp: Vec<(f64, f64)> = (0..r.len())
        .filter(|&i| !near(r[i], 1.0) && !near(r[i], factor))
        .map(|i| (freq(i) / TAU, (1.0 / r[i] - 1.0 / factor) / (1.0 - 1.0 / factor)))
        .collect();
    if ramp.len() >= 2 {
        let n = ramp.len() as f64;
        let (mx, ms) = (ramp.iter().map(|p| p.0).sum::<f64>() / n, ramp.iter().map(|p| p.1).sum::<f64>() / n);
        let cov: f64 = ramp.iter().map(|p| (p.0 - mx) * (p.1 - ms)).sum();
        let var: f64 = ramp.iter().map(|p| (p.0 - mx) * (p.0 - mx)).sum();
        // s = a/λ + b: a = old/(high - low), b = -low/(high - low).
        let a = cov / var;
        let b = ms - a * mx;
        if a > 0.0 && b < 0.0 {
            let tidy = |x: f64| (x * 1e3).round() / 1e3;
            for old in original.into_iter().chain([(-a / b).round().max(1.0)]) {
                let low = -b * old / a;
                let high = low + old / a;
                tries.push([factor, tidy(low), tidy(high), old]);
                tries.push([factor, low, high, old]);
            }
        }
    }
    tries.into_iter().find(gives).map(Some)
}

fn write_json(path: &Path, v: &serde_json::Value) -> Result<()> {
    let text = serde_json::to_string_pretty(v).map_err(|e| Error::file(path, e.to_string()))?;
    std::fs::write(path, text + "\n").map_err(|e| Error::io(path, e))
}

/// Granite's multipliers into `config`, as llama.cpp reads them (keys after the architecture
/// `arch`, granite or granitemoe): the logits' divisor (`logit_scale`, which it requires), the
/// attention scores' factor (`attention.scale`; 1/√head_dim where absent or 0, HF's default
/// being 1), the embedding's and each sublayer output's (`embedding_scale`, `residual_scale`;
/// none where absent or 0). Granite runs unrotated where `rope.scaling.finetuned` is false,
/// which HF's Granite cannot say, and GraniteMoeShared's shared expert
/// (`expert_shared_feed_forward_length`) is not supported: both refused.
fn granite_config(g: &Gguf, arch: &str, head_dim: usize, config: &mut serde_json::Value) -> Result<()> {
    let key = |k: &str| format!("{arch}.{k}");
    let number = |k: &str| g.get(&key(k)).and_then(|v| v.as_f64()).filter(|&v| v != 0.0);
    let logits = number("logit_scale")
        .ok_or_else(|| Error::file(&g.path, format!("missing metadata number `{}`", key("logit_scale"))))?;
    if g.get(&key("rope.scaling.finetuned")).and_then(|v| v.as_bool()) == Some(false) {
        let msg = format!(
            "`{}` is false: a Granite without RoPE has no HF folder (granite rotates every layer)",
            key("rope.scaling.finetuned")
        );
        return Err(Error::file(&g.path, msg));
    }
    if number("expert_shared_feed_forward_length").is_some() {
        let msg = format!(
            "`{}` is set: GraniteMoeShared's shared expert is not supported",
            key("expert_shared_feed_forward_length")
        );
        return Err(Error::file(&g.path, msg));
    }
    config["logits_scaling"] = logits.into();
    config["attention_multiplier"] =
        number("attention.scale").unwrap_or((1.0 / (head_dim as f32).sqrt()) as f64).into();
    for (gguf, hf) in [("embedding_scale", "embedding_multiplier"), ("residual_scale", "residual_multiplier")]
    {
        if let Some(v) = number(gguf) {
            config[hf] = v.into();
        }
    }
    Ok(())
}

fn meta_str<'a>(g: &'a Gguf, key: &str) -> Result<&'a str> {
    g.get(key)
        .and_then(|v| v.as_str())
        .ok_or_else(|| Error::file(&g.path, format!("missing metadata string `{key}`")))
}

/// The first OLMo's settings: q, k and v clamped where `olmo.attention.clamp_kqv` says (HF's
/// `clip_qkv`), and LayerNorms without weights whose epsilon HF fixes at 1e-5 — another
/// `attention.layer_norm_epsilon` (llama.cpp's converter always writes 1e-5) has no HF
/// equivalent, so it is refused. The folder keeps no `rms_norm_eps`.
fn olmo_config(g: &Gguf, config: &mut serde_json::Value) -> Result<()> {
    let key = "olmo.attention.layer_norm_epsilon";
    if let Some(eps) = g.get(key).and_then(|v| v.as_f64()).map(|e| e as f32).filter(|&e| e != 1e-5) {
        let msg = format!("`{key}` is {eps}: HF's OLMo normalizes with 1e-5 alone");
        return Err(Error::file(&g.path, msg));
    }
    if let Some(c) = config.as_object_mut() {
        c.remove("rms_norm_eps");
    }
    if let Some(clip) = g.get("olmo.attention.clamp_kqv").and_then(|v| v.as_f64()) {
        config["clip_qkv"] = (clip as f32 as f64).into();
    }
    Ok(())
}

/// Falcon's settings as llama.cpp runs its GGUFs: always a parallel residual, `attn_norm` read
/// by the FFN and, where a layer has an `attn_norm_2`, that read by the attention (Falcon-40B's
/// `ln_mlp` and `ln_attn`); one KV head (Falcon-7B's `multi_query`) or groups
/// (`new_decoder_architecture`, with two norms or, as Falcon2-11B, one). GELU itself, as HF's
/// default (llama.cpp runs its tanh form); the keys of other families' folders left out, as
/// HF's FalconConfig has none of them.
fn falcon_config(g: &Gguf, n_kv_heads: usize, config: &mut serde_json::Value) -> Result<()> {
    let eps = meta_f64(g, "falcon.attention.layer_norm_epsilon")?;
    if let Some(t) = g.tensors.iter().find(|t| t.name.ends_with(".ffn_norm.weight")) {
        let msg = "a norm llama.cpp's Falcon does not read (its FFN reads attn_norm)";
        return Err(Error::tensor(&g.path, &t.name, msg));
    }
    let two_norms = g.tensor("blk.0.attn_norm_2.weight").is_some();
    let Some(c) = config.as_object_mut() else { return Ok(()) };
    let ffn = c.remove("intermediate_size").unwrap_or_default();
    for key in ["num_key_value_heads", "head_dim", "rms_norm_eps", "hidden_act", "attention_bias"] {
        c.remove(key);
    }
    let falcon = serde_json::json!({
        "ffn_hidden_size": ffn,
        "layer_norm_epsilon": eps as f32 as f64,
        "parallel_attn": true,
        "bias": false,
        "alibi": false,
    });
    c.extend(falcon.as_object().cloned().unwrap_or_default());
    if n_kv_heads == 1 && !two_norms {
        c.insert("multi_query".into(), true.into());
        c.insert("new_decoder_architecture".into(), false.into());
    } else {
        c.insert("new_decoder_architecture".into(), true.into());
        c.insert("num_kv_heads".into(), n_kv_heads.into());
        c.insert("num_ln_in_parallel_attn".into(), if two_norms { 2 } else { 1 }.into());
    }
    Ok(())
}

/// A Falcon GGUF tensor's HF name; `two_norms`: a layer's `attn_norm` is `ln_mlp` (its
/// `attn_norm_2`, `ln_attn`), else `input_layernorm`.
fn falcon_name(gguf: &str, two_norms: bool) -> Option<String> {
    let top = [
        ("token_embd.weight", "transformer.word_embeddings.weight"),
        ("output_norm.weight", "transformer.ln_f.weight"),
        ("output_norm.bias", "transformer.ln_f.bias"),
        ("output.weight", "lm_head.weight"),
    ];
    name_by_tables(gguf, &top, "transformer.h.", |stem, kind| {
        Some(match (stem, kind) {
            ("attn_norm", _) if two_norms => "ln_mlp",
            ("attn_norm", _) => "input_layernorm",
            ("attn_norm_2", _) if two_norms => "ln_attn",
            ("attn_qkv", "weight") => "self_attention.query_key_value",
            ("attn_output", "weight") => "self_attention.dense",
            ("ffn_up", "weight") => "mlp.dense_h_to_4h",
            ("ffn_down", "weight") => "mlp.dense_4h_to_h",
            _ => return None,
        })
    })
}

/// A GGUF tensor's HF name by a family's tables: `top`, the tensors outside the layers (GGUF
/// name, HF name); `layer`, a layer's tensor by its GGUF stem and kind (`weight`, `bias`) →
/// its HF stem, under `prefix` and the layer's index.
fn name_by_tables(
    gguf: &str,
    top: &[(&str, &str)],
    prefix: &str,
    layer: impl Fn(&str, &str) -> Option<&'static str>,
) -> Option<String> {
    if let Some((_, hf)) = top.iter().find(|(g, _)| *g == gguf) {
        return Some(hf.to_string());
    }
    let (i, name) = gguf.strip_prefix("blk.")?.split_once('.')?;
    let i: usize = i.parse().ok()?;
    let (stem, kind) = name.rsplit_once('.')?;
    if !matches!(kind, "weight" | "bias") {
        return None;
    }
    Some(format!("{prefix}{i}.{}.{kind}", layer(stem, kind)?))
}

/// Falcon's fused q/k/v rows (`cols` wide) from llama.cpp's order — all query heads, then the
/// KV heads' keys, then their values — into HF's: per KV head, its group's query heads, its
/// key, its value.
pub fn falcon_grouped_rows(
    v: &[f32],
    (n_heads, n_kv_heads, head_dim): (usize, usize, usize),
    cols: usize,
) -> Vec<f32> {
    let group = n_heads / n_kv_heads;
    let head = head_dim * cols;
    let mut out = Vec::with_capacity(v.len());
    for g in 0..n_kv_heads {
        for j in g * group..(g + 1) * group {
            out.extend_from_slice(&v[j * head..(j + 1) * head]);
        }
        for start in [n_heads + g, n_heads + n_kv_heads + g] {
            out.extend_from_slice(&v[start * head..(start + 1) * head]);
        }
    }
    out
}

/// GPT-NeoX's settings by the names HF's GPTNeoXConfig reads in transformers 4 and 5:
/// `use_parallel_residual`, the rotated part of a head as `rotary_pct` and the base as
/// `rotary_emb_base`, biases on q/k/v and `dense` (llama.cpp requires them), GELU itself (HF's
/// default; llama.cpp runs its tanh form); other families' keys left out.
fn gpt_neox_config(g: &Gguf, config: &mut serde_json::Value) -> Result<()> {
    let parallel = g.get("gptneox.use_parallel_residual").and_then(|v| v.as_bool()).unwrap_or(true);
    let Some(c) = config.as_object_mut() else { return Ok(()) };
    for key in ["num_key_value_heads", "head_dim", "rms_norm_eps"] {
        c.remove(key);
    }
    if let Some(pct) = c.remove("partial_rotary_factor") {
        c.insert("rotary_pct".into(), pct);
    }
    if let Some(base) = c.remove("rope_theta") {
        c.insert("rotary_emb_base".into(), base);
    }
    c.insert("use_parallel_residual".into(), parallel.into());
    c.insert("attention_bias".into(), true.into());
    c.insert("hidden_act".into(), "gelu".into());
    Ok(())
}

/// GPT-2's and GPT-BigCode's settings by the names GPT2Config and GPTBigCodeConfig read
/// (`n_embd`, `n_layer`, `n_head`, `n_positions`, `n_inner`), their LayerNorms' epsilon and
/// GELU's tanh form (llama.cpp's); `multi_query` where StarCoder's GGUF says one KV head. HF
/// has no GPT-2 with KV groups, nor a GPT-BigCode with other than one KV head or one a head.
fn gpt2_config(
    g: &Gguf,
    family: Arch,
    (heads, kv_heads): (usize, usize),
    config: &mut serde_json::Value,
) -> Result<()> {
    let arch = if family == Arch::Gpt2 { "gpt2" } else { "starcoder" };
    if kv_heads != heads && (family == Arch::Gpt2 || kv_heads != 1) {
        let msg = format!(
            "`{arch}.attention.head_count_kv` is {kv_heads} of {heads} heads (HF's {} has {})",
            family.name(),
            if family == Arch::Gpt2 { "one KV head a head" } else { "one KV head, or one a head" }
        );
        return Err(Error::file(&g.path, msg));
    }
    let eps = meta_f64(g, &format!("{arch}.attention.layer_norm_epsilon"))?;
    let Some(c) = config.as_object_mut() else { return Ok(()) };
    for key in
        ["num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling", "attention_bias"]
    {
        c.remove(key);
    }
    for (from, to) in [
        ("hidden_size", "n_embd"),
        ("num_hidden_layers", "n_layer"),
        ("num_attention_heads", "n_head"),
        ("max_position_embeddings", "n_positions"),
        ("intermediate_size", "n_inner"),
        ("hidden_act", "activation_function"),
    ] {
        if let Some(v) = c.remove(from) {
            c.insert(to.into(), v);
        }
    }
    c.insert("layer_norm_epsilon".into(), (eps as f32 as f64).into());
    let act = if family == Arch::Gpt2 { "gelu_new" } else { "gelu_pytorch_tanh" };
    c.insert("activation_function".into(), act.into());
    if family == Arch::GptBigCode {
        c.insert("multi_query".into(), (kv_heads == 1).into());
    }
    Ok(())
}

/// A GPT-2 or StarCoder GGUF tensor's HF name (under `transformer.`).
fn gpt2_name(gguf: &str) -> Option<String> {
    let top = [
        ("token_embd.weight", "transformer.wte.weight"),
        ("position_embd.weight", "transformer.wpe.weight"),
        ("output_norm.weight", "transformer.ln_f.weight"),
        ("output_norm.bias", "transformer.ln_f.bias"),
        ("output.weight", "lm_head.weight"),
    ];
    name_by_tables(gguf, &top, "transformer.h.", |stem, _| {
        Some(match stem {
            "attn_norm" => "ln_1",
            "ffn_norm" => "ln_2",
            "attn_qkv" => "attn.c_attn",
            "attn_output" => "attn.c_proj",
            "ffn_up" => "mlp.c_fc",
            "ffn_down" => "mlp.c_proj",
            _ => return None,
        })
    })
}

/// A GPT-NeoX GGUF tensor's HF name; the head as `embed_out`, which transformers 4 reads and 5
/// renames on load.
fn gpt_neox_name(gguf: &str) -> Option<String> {
    let top = [
        ("token_embd.weight", "gpt_neox.embed_in.weight"),
        ("output_norm.weight", "gpt_neox.final_layer_norm.weight"),
        ("output_norm.bias", "gpt_neox.final_layer_norm.bias"),
        ("output.weight", "embed_out.weight"),
    ];
    name_by_tables(gguf, &top, "gpt_neox.layers.", |stem, _| {
        Some(match stem {
            "attn_norm" => "input_layernorm",
            "ffn_norm" => "post_attention_layernorm",
            "attn_qkv" => "attention.query_key_value",
            "attn_output" => "attention.dense",
            "ffn_up" => "mlp.dense_h_to_4h",
            "ffn_down" => "mlp.dense_4h_to_h",
            _ => return None,
        })
    })
}

fn meta_f64(g: &Gguf, key: &str) -> Result<f64> {
    g.get(key)
        .and_then(|v| v.as_f64())
        .ok_or_else(|| Error::file(&g.path, format!("missing metadata number `{key}`")))
}

fn meta_usize(g: &Gguf, key: &str) -> Result<usize> {
    g.get(key)
        .and_then(|v| v.as_u64())
        .map(|v| v as usize)
        .ok_or_else(|| Error::file(&g.path, format!("missing metadata integer `{key}`")))
}

fn meta_array<'a>(g: &'a Gguf, key: &str) -> Result<&'a [Value]> {
    g.get(key)
        .and_then(|v| v.as_array())
        .ok_or_else(|| Error::file(&g.path, format!("missing metadata array `{key}`")))
}

/// HF's description of which layers are sparse: `(decoder_sparse_step, mlp_only_layers)`, the
/// step alone where the sparse layers are every step-th, else step 1 and the dense layers.
fn sparse_pattern(sparse: &[bool]) -> (usize, Vec<usize>) {
    let every = |s: usize| sparse.iter().enumerate().all(|(i, &sp)| sp == (i + 1).is_multiple_of(s));
    match (1..=sparse.len()).find(|&s| every(s)) {
        Some(step) => (step, Vec::new()),
        None => (1, (0..sparse.len()).filter(|&i| !sparse[i]).collect()),
    }
}

/// GraniteMoE's stacked tensor of layer `layer` from its GGUF part `t` (`which`: 1 gate, 2 up,
/// 3 down, as [`moe_tensor`] numbers them; each `[experts, rows, columns]`), as HF's
/// checkpoints hold it: the gate's stack with the up's as `input_linear`, each expert's gate
/// rows then its up rows; the down's as `output_linear`; nothing of the up's (taken with the
/// gate's).
fn granite_moe_stack<'a>(
    g: &'a Gguf,
    t: &'a TensorEntry,
    layer: usize,
    which: usize,
    experts: usize,
    dt: DType,
) -> Result<Option<(String, Lazy<'a>)>> {
    let [_, input, output] = crate::model::stacked_expert_names(layer);
    let shape = t.shape();
    match which {
        1 => {
            let up_name = format!("blk.{layer}.ffn_up_exps.weight");
            let up = g.tensor(&up_name).ok_or_else(|| {
                Error::tensor(&g.path, &up_name, "missing beside ffn_gate_exps (GraniteMoE stacks the two)")
            })?;
            if up.shape() != shape || g.dequantize_part(up, 0, experts).is_none() {
                let msg = format!("shape {:?} or blocks unlike ffn_gate_exps' ({shape:?})", up.shape());
                return Err(Error::tensor(&g.path, &up_name, msg));
            }
            let make = move || {
                let mut v = Vec::with_capacity(2 * t.n_elements());
                for e in 0..experts {
                    v.extend(g.dequantize_part(t, e, experts).unwrap_or_default());
                    v.extend(g.dequantize_part(up, e, experts).unwrap_or_default());
                }
                encode(&v, dt)
            };
            Ok(Some((input, Lazy::new(dt, vec![experts, 2 * shape[1], shape[2]], make))))
        }
        2 => Ok(None),
        _ => Ok(Some((output, Lazy::new(dt, shape, move || encode(&g.dequantize(t), dt))))),
    }
}

/// A mixture's tensor from its GGUF name: its layer, whether it is the shared expert's, and
/// its index among the model's names for it: `model::expert_names`'s (0 the router,
/// `ffn_gate_inp`; 1–3 gate, up and down, stacked with one part an expert, `ffn_*_exps`) or
/// `model::shared_expert_names`'s (0–2 gate, up and down, `ffn_*_shexp`; 3 its gate,
/// `ffn_gate_inp_shexp`).
fn moe_tensor(gguf: &str) -> Option<(usize, bool, usize)> {
    let (layer, name) = gguf.strip_prefix("blk.")?.split_once('.')?;
    let (shared, which) = match name {
        "ffn_gate_inp.weight" => (false, 0),
        "ffn_gate_exps.weight" => (false, 1),
        "ffn_up_exps.weight" => (false, 2),
        "ffn_down_exps.weight" => (false, 3),
        "ffn_gate_shexp.weight" => (true, 0),
        "ffn_up_shexp.weight" => (true, 1),
        "ffn_down_shexp.weight" => (true, 2),
        "ffn_gate_inp_shexp.weight" => (true, 3),
        _ => return None,
    };
    Some((layer.parse().ok()?, shared, which))
}

/// The q, k and v parts of a fused `blk.N.attn_qkv` weight or bias (`heads`: q heads, KV heads,
/// head dimensions), as HF's separate `q_proj`, `k_proj` and `v_proj` tensors of `dtype` (a bias
/// stays f32).
fn split_qkv<'a>(
    g: &'a Gguf,
    t: &'a crate::weights::gguf::TensorEntry,
    (n_heads, n_kv, hd): (usize, usize, usize),
    dtype: DType,
) -> Result<Vec<(String, Lazy<'a>)>> {
    let shape = t.shape();
    let rows = (n_heads + 2 * n_kv) * hd;
    let cols = if shape.len() == 2 { shape[1] } else { 1 };
    let bad =
        || Error::tensor(&g.path, &t.name, format!("shape {shape:?} is not [{rows}, columns] or [{rows}]"));
    if shape.first() != Some(&rows) || shape.len() > 2 {
        return Err(bad());
    }
    let (layer, kind) =
        t.name.strip_prefix("blk.").and_then(|r| r.split_once(".attn_qkv.")).ok_or_else(bad)?;
    let dt = if shape.len() == 1 { DType::F32 } else { dtype };
    let parts =
        [("q", 0, n_heads * hd), ("k", n_heads * hd, n_kv * hd), ("v", (n_heads + n_kv) * hd, n_kv * hd)];
    Ok(parts
        .into_iter()
        .map(|(which, first, n)| {
            let make = move || encode(&g.dequantize(t)[first * cols..(first + n) * cols], dt);
            let shape = if cols == 1 && shape.len() == 1 { vec![n] } else { vec![n, cols] };
            (format!("model.layers.{layer}.self_attn.{which}_proj.{kind}"), Lazy::new(dt, shape, make))
        })
        .collect())
}

/// GGUF tensor name → HF name, for a tensor of the GGUF architecture `arch`.
pub fn hf_name(arch: &str, gguf: &str) -> Option<String> {
    match gguf {
        "token_embd.weight" => return Some("model.embed_tokens.weight".into()),
        // Phi's final norm and its output head's bias.
        "output_norm.weight" if arch == "phi2" => return Some("model.final_layernorm.weight".into()),
        "output_norm.bias" if arch == "phi2" => return Some("model.final_layernorm.bias".into()),
        "output.bias" if arch == "phi2" => return Some("lm_head.bias".into()),
        "output_norm.weight" => return Some("model.norm.weight".into()),
        "output_norm.bias" if arch == "starcoder2" || arch == "stablelm" => {
            return Some("model.norm.bias".into())
        }
        "output.weight" => return Some("lm_head.weight".into()),
        _ => {}
    }
    let rest = gguf.strip_prefix("blk.")?;
    let (layer, name) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    // StarCoder 2's and Phi's projections, each with a bias, and their FFNs without a gate:
    // (GGUF name, HF name) before `.weight` or `.bias`.
    let biased: &[(&str, &str)] = match arch {
        "starcoder2" => {
            &[("attn_output", "self_attn.o_proj"), ("ffn_up", "mlp.c_fc"), ("ffn_down", "mlp.c_proj")]
        }
        "phi2" => &[("attn_output", "self_attn.dense"), ("ffn_up", "mlp.fc1"), ("ffn_down", "mlp.fc2")],
        _ => &[],
    };
    if let Some((stem, kind @ ("weight" | "bias"))) = name.rsplit_once('.') {
        if let Some((_, hf)) = biased.iter().find(|(g, _)| *g == stem) {
            return Some(format!("model.layers.{layer}.{hf}.{kind}"));
        }
    }
    let hf = match name {
        "attn_norm.weight" => "input_layernorm.weight",
        // The LayerNorms' biases.
        "attn_norm.bias" if matches!(arch, "starcoder2" | "stablelm" | "phi2") => "input_layernorm.bias",
        "ffn_norm.bias" if arch == "starcoder2" || arch == "stablelm" => "post_attention_layernorm.bias",
        // Gemma 2 and 3's sandwich norms: the FFN's input norm is HF's `pre_feedforward_*`.
        "ffn_norm.weight" if arch == "gemma2" || arch == "gemma3" => "pre_feedforward_layernorm.weight",
        "post_attention_norm.weight" if arch == "gemma2" || arch == "gemma3" => {
            "post_attention_layernorm.weight"
        }
        "post_ffw_norm.weight" if arch == "gemma2" || arch == "gemma3" => "post_feedforward_layernorm.weight",
        // GLM-4's norms of the attention's and the FFN's outputs.
        "post_attention_norm.weight" if arch == "glm4" => "post_self_attn_layernorm.weight",
        "post_ffw_norm.weight" if arch == "glm4" => "post_mlp_layernorm.weight",
        "ffn_norm.weight" => "post_attention_layernorm.weight",
        "attn_q.weight" => "self_attn.q_proj.weight",
        "attn_k.weight" => "self_attn.k_proj.weight",
        "attn_v.weight" => "self_attn.v_proj.weight",
        "attn_q.bias" => "self_attn.q_proj.bias",
        "attn_k.bias" => "self_attn.k_proj.bias",
        "attn_v.bias" => "self_attn.v_proj.bias",
        "attn_q_norm.weight" => "self_attn.q_norm.weight",
        "attn_k_norm.weight" => "self_attn.k_norm.weight",
        "attn_output.weight" => "self_attn.o_proj.weight",
        "ffn_gate.weight" => "mlp.gate_proj.weight",
        // Phi-3's fused q, k and v rows, and gate and up rows (twice the FFN's width; GLM-4's
        // too).
        "attn_qkv.weight" if arch == "phi3" => "self_attn.qkv_proj.weight",
        "ffn_up.weight" if arch == "phi3" || arch == "glm4" || arch == "chatglm" => "mlp.gate_up_proj.weight",
        "ffn_up.weight" => "mlp.up_proj.weight",
        "ffn_down.weight" => "mlp.down_proj.weight",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{hf}"))
}

/// Undoes llama.cpp's Q/K permutation. Within each head of `head_dim` rows, GGUF row `2i + j`
/// holds HF row `j * head_dim/2 + i`.
pub fn unpermute_rows(v: &[f32], n_heads: usize, cols: usize) -> Vec<f32> {
    let rows = v.len() / cols;
    let head_dim = rows / n_heads;
    let half = head_dim / 2;
    let mut out = vec![0.0; v.len()];
    for h in 0..n_heads {
        for i in 0..half {
            for j in 0..2 {
                let src = h * head_dim + 2 * i + j;
                let dst = h * head_dim + j * half + i;
                out[dst * cols..(dst + 1) * cols].copy_from_slice(&v[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

fn encode(v: &[f32], dtype: DType) -> Vec<u8> {
    match dtype {
        DType::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        DType::BF16 => v.iter().flat_map(|x| bf16::from_f32(*x).to_bits().to_le_bytes()).collect(),
        DType::F16 => v.iter().flat_map(|x| f16::from_f32(*x).to_bits().to_le_bytes()).collect(),
    }
}

/// The tokenizer's post-processor: byte-level (of a byte-level BPE), then the BOS and EOS tokens
/// around a text where the GGUF asks for them (`tokenizer.ggml.add_bos_token`, BOS where it says
/// nothing if `bos` is `Some(true)`; never if it is `None`, as llama.cpp reads GLM's
/// vocabularies; `add_eos_token`), as HF's own tokenizer.json files add them.
fn post_processor(
    g: &Gguf,
    tokens: &[&str],
    byte_level: bool,
    bos: Option<bool>,
) -> Result<Option<PostProcessorWrapper>> {
    let byte_level = byte_level.then(|| ByteLevel::new(true, false, true).into());
    let mut special = Vec::new();
    for (which, unless_said) in [("bos", bos), ("eos", Some(false))] {
        let Some(unless_said) = unless_said else { continue };
        let add = g.get(&format!("tokenizer.ggml.add_{which}_token")).and_then(|v| v.as_bool());
        let key = format!("tokenizer.ggml.{which}_token_id");
        // A token asked for must be there; one only assumed may be missing.
        if !add.unwrap_or(unless_said) || (add.is_none() && g.get(&key).is_none()) {
            continue;
        }
        let id = meta_usize(g, &key)?;
        let Some(token) = tokens.get(id) else {
            let msg = format!("`{key}` is {id}, beyond the vocabulary of {}", tokens.len());
            return Err(Error::file(&g.path, msg));
        };
        special.push((which, token.to_string(), id as u32));
    }
    if special.is_empty() {
        return Ok(byte_level);
    }
    let token = |which: &str, seq: &str| {
        special.iter().find(|s| s.0 == which).map(|s| format!("{}:{seq} ", s.1)).unwrap_or_default()
    };
    let (single, pair) = (
        format!("{}$A:0 {}", token("bos", "0"), token("eos", "0")),
        format!(
            "{}$A:0 {}{}$B:1 {}",
            token("bos", "0"),
            token("eos", "0"),
            token("bos", "1"),
            token("eos", "1")
        ),
    );
    let failed = |e: String| Error::file(&g.path, format!("cannot make the tokenizer's template: {e}"));
    let template = TemplateProcessing::builder()
        .try_single(single.trim_end())
        .and_then(|t| t.try_pair(pair.trim_end()))
        .map_err(failed)?
        .special_tokens(special.iter().map(|(_, t, id)| (t.clone(), *id)).collect::<Vec<_>>())
        .build()
        .map_err(|e| failed(e.to_string()))?;
    Ok(Some(match byte_level {
        Some(b) => PostSequence::new(vec![b, template.into()]).into(),
        None => template.into(),
    }))
}

/// llama.cpp's `tokenizer.ggml.pre` names of Llama 3's pre-tokenizer: its regex, whole-word
/// tokens taken whole (`ignore_merges`) and BOS first by default.
const LLAMA3_PRES: [&str; 4] = ["llama-bpe", "llama3", "llama-v3", "falcon3"];

/// GLM-4's vocabularies (`chatglm-bpe` GLM-4-9B-chat's, `glm4` GLM-4-0414's): Llama 3's
/// regex; llama.cpp never puts a BOS token before their text (their chat templates begin with
/// `[gMASK]<sop>` themselves), and takes a word that is a token whole in `glm4`'s.
const GLM_PRES: [&str; 2] = ["chatglm-bpe", "glm4"];

/// Pre-tokenizers for llama.cpp's `tokenizer.ggml.pre` names, with the regexes of the HF
/// tokenizer.json files they stand for (split in turn, each piece kept), then byte-level.
fn pre_tokenizer(pre: &str, path: &Path) -> Result<PreTokenizerWrapper> {
    let split = |res: &[&str]| -> Result<PreTokenizerWrapper> {
        let mut parts: Vec<PreTokenizerWrapper> = Vec::new();
        for re in res {
            let s = Split::new(SplitPattern::Regex(re.to_string()), SplitDelimiterBehavior::Isolated, false)
                .map_err(|e| Error::file(path, format!("cannot build pre-tokenizer `{pre}`: {e}")))?;
            parts.push(s.into());
        }
        parts.push(ByteLevel::new(false, false, false).into());
        Ok(Sequence::new(parts).into())
    };
    match pre {
        "smollm" | "starcoder" | "refact" => {
            Ok(Sequence::new(vec![Digits::new(true).into(), ByteLevel::new(false, true, true).into()]).into())
        }
        "gpt-2" | "gpt2" | "phi-2" | "olmo" | "mpt" | "default" => Ok(ByteLevel::new(false, true, true).into()),
        // Falcon's punctuation, GPT-2's words, and digits in threes, as llama.cpp splits them.
        "falcon" => split(&[
            r"[\p{P}\$\+<=>\^~\|`]+",
            r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
            "[0-9][0-9][0-9]",
        ]),
        p if LLAMA3_PRES.contains(&p) || GLM_PRES.contains(&p) => split(&[
            r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        ]),
        "qwen2" | "deepseek-r1-qwen" => split(&[
            r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        ]),
        "qwen35" => split(&[
            r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        ]),
        "deepseek-llm" => split(&[
            "[\\r\\n]",
            "\\s?[A-Za-z\u{b5}\u{c0}-\u{d6}\u{d8}-\u{f6}\u{f8}-\u{1ba}\u{1bc}-\u{1bf}\u{1c4}-\u{293}\u{295}-\u{2af}\u{370}-\u{373}\u{376}\u{377}\u{37b}-\u{37d}\u{37f}\u{386}\u{388}-\u{38a}\u{38c}\u{38e}-\u{3a1}\u{3a3}-\u{3f5}\u{3f7}-\u{481}\u{48a}-\u{52f}\u{531}-\u{556}\u{10a0}-\u{10c5}\u{13a0}-\u{13f5}\u{13f8}-\u{13fd}\u{1c90}-\u{1cba}\u{1cbd}-\u{1cbf}\u{1d00}-\u{1d2b}\u{1d6b}-\u{1d77}\u{1d79}-\u{1d9a}\u{1e00}-\u{1f15}\u{1f18}-\u{1f1d}\u{1f20}-\u{1f45}\u{1f48}-\u{1f4d}\u{1f50}-\u{1f57}\u{1f59}\u{1f5b}\u{1f5d}\u{1f5f}-\u{1f7d}\u{1f80}-\u{1fb4}\u{1fb6}-\u{1fbc}\u{1fbe}\u{1fc2}-\u{1fc4}\u{1fc6}-\u{1fcc}\u{1fd0}-\u{1fd3}\u{1fd6}-\u{1fdb}\u{1fe0}-\u{1fec}\u{1ff2}-\u{1ff4}\u{1ff6}-\u{1ffc}\u{2102}\u{2107}\u{210a}-\u{2113}\u{2115}\u{2119}-\u{211d}\u{2124}\u{2126}\u{2128}\u{212a}-\u{212d}\u{212f}-\u{2134}\u{2139}\u{213c}-\u{213f}\u{2145}-\u{2149}\u{214e}\u{2183}\u{2184}\u{2c00}-\u{2c7b}\u{2c7e}-\u{2ce4}\u{2ceb}-\u{2cee}\u{2cf2}\u{2cf3}\u{a640}-\u{a66d}\u{a680}-\u{a69b}\u{a722}-\u{a76f}\u{a771}-\u{a787}\u{a78b}-\u{a78e}\u{ab70}-\u{abbf}\u{fb00}-\u{fb06}\u{fb13}-\u{fb17}\u{ff21}-\u{ff3a}\u{ff41}-\u{ff5a}\u{10400}-\u{1044f}\u{104b0}-\u{104d3}\u{104d8}-\u{104fb}\u{10c80}-\u{10cb2}\u{10cc0}-\u{10cf2}\u{118a0}-\u{118df}\u{1e900}-\u{1e943}]+",
            "\\s?[!-/:-~\u{ff01}-\u{ff0f}\u{ff1a}-\u{ff5e}\u{2018}-\u{201f}\u{3000}-\u{3002}]+",
            "\\s+$",
            "[\u{4e00}-\u{9fa5}\u{800}-\u{4e00}\u{ac00}-\u{d7ff}]+",
            "\\p{N}+",
        ]),
        "deepseek-coder" => split(&[
            "[\\r\\n]",
            "\\s?\\p{L}+",
            "\\s?\\p{P}+",
            "[\u{4e00}-\u{9fa5}\u{800}-\u{4e00}\u{ac00}-\u{d7ff}]+",
            "\\p{N}",
        ]),
        "tekken" => split(&[
            r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        ]),
        other => Err(Error::file(
            path,
            format!(
                "unsupported tokenizer pre-tokenizer `{other}` (supported: smollm, starcoder, refact, gpt-2, phi-2, olmo, mpt, falcon, {}, {}, qwen2, deepseek-r1-qwen, qwen35, deepseek-llm, deepseek-coder, tekken)",
                LLAMA3_PRES.join(", "),
                GLM_PRES.join(", ")
            ),
        )),
    }
}

/// What a GGUF's vocabulary converts into.
struct Vocabulary {
    tokenizer: Tokenizer,
    /// `tokenizer_config.json`.
    config: serde_json::Value,
    /// The tokens that end a completion ([`end_tokens`]).
    ends: Vec<u64>,
}

/// The tokenizer (`tokenizer.json`) and `tokenizer_config.json` of the GGUF's vocabulary, as
/// HF's converters make them: byte-level BPE from its merges (`tokenizer.ggml.model` gpt2), or
/// SentencePiece's BPE from its pieces' scores (llama; [`sentencepiece`]).
fn tokenizer_of(g: &Gguf) -> Result<Vocabulary> {
    let path = &g.path;
    let model = meta_str(g, "tokenizer.ggml.model")?;
    let tokens: Vec<&str> = meta_array(g, "tokenizer.ggml.tokens")?
        .iter()
        .map(|v| v.as_str().ok_or_else(|| Error::file(path, "tokenizer.ggml.tokens holds a non-string")))
        .collect::<Result<_>>()?;
    let types: Vec<i64> = match g.get("tokenizer.ggml.token_type").and_then(|v| v.as_array()) {
        Some(a) => a
            .iter()
            .map(|v| if let Value::I64(x) = v { *x } else { v.as_u64().unwrap_or(1) as i64 })
            .collect(),
        None => vec![1; tokens.len()],
    };
    let vocab: tokenizers::models::bpe::Vocab =
        tokens.iter().enumerate().map(|(i, t)| (t.to_string(), i as u32)).collect();
    let name_of =
        |key: &str| g.get(key).and_then(|v| v.as_u64()).and_then(|i| tokens.get(i as usize)).copied();
    let byte_level = match model {
        "gpt2" => true,
        "llama" => false,
        other => {
            return Err(Error::file(
                path,
                format!(
                    "unsupported tokenizer model `{other}` (expected gpt2, a byte-level BPE, or llama, SentencePiece's BPE)"
                ),
            ))
        }
    };
    // Llama 3's vocabulary (and Mistral's Tekken) takes a word that is a token whole, whatever
    // the merges would make of it (HF's `ignore_merges`), and puts BOS first unless the GGUF
    // says otherwise, as llama.cpp reads it; so does SentencePiece's.
    let pre = g.get("tokenizer.ggml.pre").and_then(|v| v.as_str()).unwrap_or("default");
    let llama3 = byte_level && (LLAMA3_PRES.contains(&pre) || pre == "tekken" || pre == "glm4");
    // Whether BOS goes first where the GGUF does not say; `None`: never.
    let bos = (!(byte_level && GLM_PRES.contains(&pre))).then_some(llama3 || !byte_level);
    let mut tok = if byte_level {
        let merges: Vec<(String, String)> = meta_array(g, "tokenizer.ggml.merges")?
            .iter()
            .map(|v| {
                v.as_str()
                    .and_then(|s| s.split_once(' '))
                    .map(|(a, b)| (a.to_string(), b.to_string()))
                    .ok_or_else(|| {
                        Error::file(path, "tokenizer.ggml.merges holds an entry that is not `a b`")
                    })
            })
            .collect::<Result<_>>()?;
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .ignore_merges(llama3)
            .build()
            .map_err(|e| Error::file(path, format!("cannot build the BPE tokenizer: {e}")))?;
        let mut tok = Tokenizer::new(bpe);
        tok.with_pre_tokenizer(Some(pre_tokenizer(pre, path)?));
        tok.with_decoder(Some(ByteLevel::default()));
        tok
    } else {
        let unk =
            name_of("tokenizer.ggml.unknown_token_id").or(tokens.iter().copied().find(|t| *t == "<unk>"));
        sentencepiece(g, &tokens, vocab, unk)?
    };
    tok.with_post_processor(post_processor(g, &tokens, byte_level, bos)?);
    // Control (3) and user-defined (4) tokens are matched whole before BPE runs.
    let added: Vec<AddedToken> = tokens
        .iter()
        .zip(&types)
        .filter(|(_, &t)| t == 3 || t == 4)
        .map(|(s, &t)| AddedToken::from(s.to_string(), t == 3))
        .collect();
    tok.add_special_tokens(&added);

    let name = |key: &str| name_of(key).map_or(serde_json::Value::Null, |s| s.into());
    let mut cfg = serde_json::json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": name("tokenizer.ggml.bos_token_id"),
        "eos_token": name("tokenizer.ggml.eos_token_id"),
        "unk_token": name("tokenizer.ggml.unknown_token_id"),
        "pad_token": name("tokenizer.ggml.padding_token_id"),
        "add_bos_token": bos.is_some_and(|unless_said| g.get("tokenizer.ggml.add_bos_token").and_then(|v| v.as_bool()).unwrap_or(unless_said)),
        "model_max_length": g.get(&format!("{}.context_length", meta_str(g, "general.architecture")?)).and_then(|v| v.as_u64()).unwrap_or(2048),
    });
    if let Some(t) = g.get("tokenizer.chat_template").and_then(|v| v.as_str()) {
        cfg["chat_template"] = t.into();
    }
    Ok(Vocabulary { tokenizer: tok, config: cfg, ends: end_tokens(g, &tokens, &types) })
}

/// SentencePiece's BPE (llama.cpp's `llama` tokenizer model, as Llama 2, Mistral and Mixtral
/// GGUFs hold it) as HF's Llama converter makes it: a merge for each way a piece splits into two
/// pieces of the vocabulary, ranked by the merged piece's score (highest first; its splits by the
/// ids of their halves), so the BPE merges what SentencePiece would; a character outside the
/// vocabulary as its UTF-8 bytes' `<0xHH>` tokens (else `unk`); spaces as `▁`, one put before
/// the text unless `tokenizer.ggml.add_space_prefix` is false.
fn sentencepiece(
    g: &Gguf,
    tokens: &[&str],
    vocab: tokenizers::models::bpe::Vocab,
    unk: Option<&str>,
) -> Result<Tokenizer> {
    let path = &g.path;
    let scores: Vec<f64> = meta_array(g, "tokenizer.ggml.scores")?
        .iter()
        .map(|v| v.as_f64().ok_or_else(|| Error::file(path, "tokenizer.ggml.scores holds a non-number")))
        .collect::<Result<_>>()?;
    if scores.len() != tokens.len() {
        let msg =
            format!("tokenizer.ggml.scores holds scores for {} of {} tokens", scores.len(), tokens.len());
        return Err(Error::file(path, msg));
    }
    let mut merges: Vec<(f64, (String, String))> = Vec::new();
    for (piece, &score) in tokens.iter().zip(&scores) {
        let mut splits: Vec<(u32, u32, &str, &str)> = piece
            .char_indices()
            .skip(1)
            .filter_map(|(i, _)| {
                let (l, r) = piece.split_at(i);
                Some((*vocab.get(l)?, *vocab.get(r)?, l, r))
            })
            .collect();
        splits.sort_unstable();
        merges.extend(splits.into_iter().map(|(_, _, l, r)| (score, (l.to_string(), r.to_string()))));
    }
    // Stable: a piece's splits stay in their order.
    merges.sort_by(|a, b| b.0.total_cmp(&a.0));
    let mut bpe = BPE::builder()
        .vocab_and_merges(vocab, merges.into_iter().map(|m| m.1).collect())
        .fuse_unk(true)
        .byte_fallback(true);
    if let Some(unk) = unk {
        bpe = bpe.unk_token(unk.to_string());
    }
    let bpe = bpe.build().map_err(|e| Error::file(path, format!("cannot build the BPE tokenizer: {e}")))?;
    let mut tok = Tokenizer::new(bpe);
    let prefix = g.get("tokenizer.ggml.add_space_prefix").and_then(|v| v.as_bool()).unwrap_or(true);
    let space = |s: &str, by: &str| {
        tokenizers::normalizers::replace::Replace::new(s, by).map_err(|e| Error::file(path, e.to_string()))
    };
    let mut normalizers: Vec<tokenizers::NormalizerWrapper> = vec![space(" ", "\u{2581}")?.into()];
    let mut decoders: Vec<tokenizers::DecoderWrapper> =
        vec![space("\u{2581}", " ")?.into(), ByteFallback::new().into(), Fuse::new().into()];
    if prefix {
        normalizers.insert(0, Prepend::new("\u{2581}".into()).into());
        decoders.push(Strip::new(' ', 1, 0).into());
    }
    tok.with_normalizer(Some(NormalizerSequence::new(normalizers)));
    tok.with_decoder(Some(DecoderSequence::new(decoders)));
    Ok(tok)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A folder that cannot be written in full leaves nothing behind, and its error names the
    /// file as it would have been in `--out`, not in the folder aside that is gone.
    #[test]
    fn a_failed_write_leaves_no_folder_and_names_the_out_path() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("out");
        let err = write_aside(&out, |tmp| {
            std::fs::write(tmp.join("config.json"), "{}").unwrap();
            let full = tmp.join("model.safetensors");
            std::os::unix::fs::symlink("/dev/full", &full).unwrap();
            std::fs::write(&full, [0u8; 4096]).map_err(|e| Error::io(&full, e))
        })
        .unwrap_err()
        .to_string();
        let want = format!("{}: No space left on device", out.join("model.safetensors").display());
        assert!(err.starts_with(&want), "{err}");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    #[test]
    fn sparse_layers_as_hf_describes_them() {
        assert_eq!(sparse_pattern(&[true; 4]), (1, vec![]));
        assert_eq!(sparse_pattern(&[false, true, false, true]), (2, vec![]));
        assert_eq!(sparse_pattern(&[false, true, true, true]), (1, vec![0]));
        assert_eq!(sparse_pattern(&[true, false, true]), (1, vec![1]));
    }

    /// Falcon's pre-tokenizer splits as llama.cpp's three regexes do in turn, each piece kept:
    /// punctuation runs (`'` and `$` and `+` among them), GPT-2's words, then digits in threes.
    #[test]
    fn falcon_pre_tokenizer_splits_as_llama_cpp() {
        use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};
        let text = "Hello, world! 12345 it's $5+3";
        let pre = pre_tokenizer("falcon", Path::new("x.gguf")).unwrap();
        let mut s = PreTokenizedString::from(text);
        pre.pre_tokenize(&mut s).unwrap();
        let pieces: Vec<&str> = s
            .get_splits(OffsetReferential::Original, OffsetType::Byte)
            .into_iter()
            .map(|(_, (a, b), _)| &text[a..b])
            .collect();
        let want = ["Hello", ",", " world", "!", " ", "123", "45", " it", "'", "s", " ", "$", "5", "+", "3"];
        assert_eq!(pieces, want);
    }

    /// Llama.cpp's Falcon q/k/v rows (queries, keys, values) back in HF's groups: two groups of
    /// three query heads, heads one row wide.
    #[test]
    fn falcon_rows_regrouped() {
        // Rows q0..q5, k0, k1, v0, v1 as 0..10.
        let v: Vec<f32> = (0..10).map(|x| x as f32).collect();
        let grouped = falcon_grouped_rows(&v, (6, 2, 1), 1);
        assert_eq!(grouped, [0.0, 1.0, 2.0, 6.0, 8.0, 3.0, 4.0, 5.0, 7.0, 9.0]);
        // One KV head (Falcon-7B): the same order.
        assert_eq!(falcon_grouped_rows(&v[..8], (6, 1, 1), 1), v[..8]);
    }

    #[test]
    fn unpermute_inverts_llama_cpp_permutation() {
        // llama.cpp: reshape(n_head, 2, hd/2, cols).swapaxes(1, 2)
        let (n_heads, hd, cols) = (3, 8, 2);
        let hf: Vec<f32> = (0..n_heads * hd * cols).map(|x| x as f32).collect();
        let mut gg = vec![0.0; hf.len()];
        for h in 0..n_heads {
            for j in 0..2 {
                for i in 0..hd / 2 {
                    let src = h * hd + j * hd / 2 + i;
                    let dst = h * hd + i * 2 + j;
                    gg[dst * cols..(dst + 1) * cols].copy_from_slice(&hf[src * cols..(src + 1) * cols]);
                }
            }
        }
        assert_eq!(unpermute_rows(&gg, n_heads, cols), hf);
    }

    #[test]
    fn names() {
        assert_eq!(
            hf_name("llama", "blk.12.ffn_down.weight").unwrap(),
            "model.layers.12.mlp.down_proj.weight"
        );
        assert_eq!(hf_name("llama", "output_norm.weight").unwrap(), "model.norm.weight");
        assert_eq!(
            hf_name("qwen3", "blk.3.attn_k_norm.weight").unwrap(),
            "model.layers.3.self_attn.k_norm.weight"
        );
        assert!(hf_name("llama", "blk.x.attn_q.weight").is_none());
        assert_eq!(hf_name("llama", "blk.1.ffn_up.weight").unwrap(), "model.layers.1.mlp.up_proj.weight");
        assert_eq!(hf_name("phi3", "blk.1.ffn_up.weight").unwrap(), "model.layers.1.mlp.gate_up_proj.weight");
        assert_eq!(
            hf_name("phi3", "blk.1.attn_qkv.weight").unwrap(),
            "model.layers.1.self_attn.qkv_proj.weight"
        );
        assert!(hf_name("llama", "blk.1.attn_qkv.weight").is_none());
    }

    #[test]
    fn llama3_scaling_from_llama_cpp_frequency_factors() {
        use gridlm_reference::llama_cpp_rope_factors as llama_cpp_factors;
        // Llama 3.2 1B and 3B, Llama 3.1 8B and 70B: Meta's numbers.
        for (s, theta, hd) in
            [([32.0, 1.0, 4.0, 8192.0], 500000.0, 64), ([8.0, 1.0, 4.0, 8192.0], 500000.0, 128)]
        {
            let r = llama_cpp_factors(s, theta, hd);
            assert_eq!(llama3_scaling(&r, theta as f64, None), Some(Some(s)), "{s:?}");
        }
        // Others, from the ramp between: recovered, or at another scale of old, low and high.
        for (s, want, theta, hd) in [
            ([4.0, 1.0, 16.0, 256.0], [4.0, 1.0, 16.0, 256.0], 10000.0, 16),
            ([6.0, 2.0, 32.0, 512.0], [6.0, 1.0, 16.0, 256.0], 10000.0, 16),
            ([16.0, 1.5, 6.0, 16384.0], [16.0, 1.0, 4.0, 10923.0], 1000000.0, 128),
        ] {
            let r = llama_cpp_factors(s, theta, hd);
            let got = llama3_scaling(&r, theta as f64, None).unwrap().unwrap();
            assert!(got.iter().zip(want).all(|(g, w)| (g - w).abs() < 1e-3 * w), "{s:?}: {got:?}");
            assert_eq!(llama3_scaling(&r, theta as f64, Some(s[3])), Some(Some(s)), "{s:?} with its old");
        }
        // No scaling; factors no llama3 scaling gives (not growing with the wavelength, a ramp
        // off its line).
        assert_eq!(llama3_scaling(&[1.0; 32], 500000.0, None), Some(None));
        let mut r = llama_cpp_factors([8.0, 1.0, 4.0, 8192.0], 500000.0, 128);
        r.swap(0, 63);
        assert_eq!(llama3_scaling(&r, 500000.0, None), None);
        let mut r = llama_cpp_factors([4.0, 1.0, 16.0, 256.0], 10000.0, 16);
        r[2] *= 1.01;
        assert_eq!(llama3_scaling(&r, 10000.0, None), None);
    }
}
