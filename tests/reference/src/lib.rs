//! Helpers for the parity tests: finding the gridlm binary and the real model, running gridlm,
//! and reading what it wrote. The reference implementation itself (candle-transformers) is used
//! only from the tests, so a normal build of gridlm never compiles it.

use std::path::{Path, PathBuf};
use std::process::Command;

pub mod falcon;
pub mod gpt2;
pub mod neox;
pub mod sentencepiece;

/// Root of the gridlm repository.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().expect("repo root")
}

/// The `gridlm` binary built by the same `cargo test` run (it sits in the profile directory
/// above this test's `deps/` directory), or `$GRIDLM_BIN`.
pub fn gridlm_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("GRIDLM_BIN") {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().expect("current_exe");
    let profile_dir = exe.parent().and_then(Path::parent).expect("target/<profile>");
    let bin = profile_dir.join("gridlm");
    assert!(
        bin.exists(),
        "{} not found: run the tests with `cargo test --workspace --release` so the gridlm binary is built",
        bin.display()
    );
    bin
}

/// The SmolLM2-135M-Instruct folder in `dtype`, fetched and converted on first use by
/// `launch/get-model` (idempotent and locked, so concurrent tests are safe).
pub fn smollm2(dtype: &str) -> PathBuf {
    let mut cmd = Command::new(repo_root().join("launch/get-model"));
    cmd.arg(dtype).env("GRIDLM_BIN", gridlm_bin());
    let out = run_with_timeout(cmd, 1800);
    assert!(
        out.status.success(),
        "launch/get-model {dtype} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).expect("utf8");
    PathBuf::from(stdout.lines().last().expect("get-model printed the folder").trim())
}

/// What one `gridlm generate --json --logits-out` run gave.
pub struct Run {
    pub json: serde_json::Value,
    pub prompt_ids: Vec<u32>,
    pub token_ids: Vec<u32>,
    pub logits: Vec<f32>,
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array().expect("id array").iter().map(|x| x.as_u64().expect("id") as u32).collect()
}

/// Runs `gridlm generate --json --ignore-eos --logits-out … <args>` on one rank (no
/// `--logits-out` with `--embed`: the run's logits are then empty).
pub fn generate(model: &Path, args: &[&str]) -> Run {
    generate_on(&[], model, args)
}

/// Like [`generate`], started through a launch script: `launcher` is e.g. `["local", "4"]` for
/// `launch/local 4 …` or `["emulated-nodes", "4"]`; empty for a plain single-rank run.
pub fn generate_on(launcher: &[&str], model: &Path, args: &[&str]) -> Run {
    let dir = tempfile::tempdir().expect("tempdir");
    let logits_path = dir.path().join("logits.f32");
    let mut cmd = launch_command(launcher);
    cmd.arg("generate").arg("--model").arg(model).args(["--json", "--ignore-eos"]);
    // A run for embeddings brings no token, so no logits.
    let embeds = args.contains(&"--embed");
    if !embeds {
        cmd.arg("--logits-out").arg(&logits_path);
    }
    cmd.args(args);
    let out = run_with_timeout(cmd, 600);
    assert!(
        out.status.success(),
        "gridlm generate {launcher:?} {args:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let json: serde_json::Value = stdout
        .lines()
        .find_map(|l| serde_json::from_str(l).ok())
        .unwrap_or_else(|| panic!("gridlm printed no JSON line:\n{stdout}"));
    let bytes = if embeds { Vec::new() } else { std::fs::read(&logits_path).expect("logits file") };
    let logits = bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
    Run { prompt_ids: ids(&json["prompt_token_ids"]), token_ids: ids(&json["token_ids"]), json, logits }
}

/// `gridlm` itself, or `launch/<script> <args>` running it.
pub fn launch_command(launcher: &[&str]) -> Command {
    match launcher.split_first() {
        None => Command::new(gridlm_bin()),
        Some((script, rest)) => {
            let mut c = Command::new(repo_root().join("launch").join(script));
            c.args(rest).env("GRIDLM_BIN", gridlm_bin());
            c
        }
    }
}

/// Runs a command, killing it (and failing the test) if it takes longer than `secs`. The
/// command runs in its own process group, so a hang kills what it started too (mpirun's ranks),
/// and output pipes still held open after it exits (by a leftover rank) count as a hang.
///
/// A run that fails only because Open MPI lost track of a rank's exit
/// ([`launcher_lost_an_exit`]) runs once more.
pub fn run_with_timeout(mut cmd: Command, secs: u64) -> std::process::Output {
    let out = run_once(&mut cmd, secs);
    if !out.status.success() && launcher_lost_an_exit(&String::from_utf8_lossy(&out.stderr)) {
        eprintln!("{cmd:?}: Open MPI reported a rank with PID 0 exiting improperly; running it again");
        return run_once(&mut cmd, secs);
    }
    out
}

/// Whether a failed run's stderr is Open MPI's report of a rank "with PID 0" "exiting
/// improperly" and holds no error line of gridlm's own (`error: ...`): a race in the runtime of
/// Open MPI 4.x, which now and then loses the exit of a rank that finished (open-mpi/ompi#7833:
/// about one single-rank launch in one to two thousand; #12607: more often with unrelated
/// mpiruns side by side, as the test threads run them). It ended one CI run here, a
/// one-rank `generate` whose rank had finished; a rank that really fails has a PID there.
pub fn launcher_lost_an_exit(stderr: &str) -> bool {
    stderr.contains("with PID 0 on")
        && stderr.contains("exiting improperly")
        && !stderr.lines().any(|l| l.starts_with("error:"))
}

fn run_once(cmd: &mut Command, secs: u64) -> std::process::Output {
    use std::os::unix::process::CommandExt;
    use std::process::Stdio;
    use std::time::{Duration, Instant};
    let mut child =
        cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).process_group(0).spawn().expect("spawn");
    let group = child.id() as i32;
    let (out_pipe, err_pipe) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
    let read = |mut p: Box<dyn std::io::Read + Send>| {
        std::thread::spawn(move || {
            let mut v = Vec::new();
            let _ = p.read_to_end(&mut v);
            v
        })
    };
    let (out_t, err_t) = (read(Box::new(out_pipe)), read(Box::new(err_pipe)));
    let deadline = Instant::now() + Duration::from_secs(secs);
    // The command leads its own group: killing the group ends it and everything it started.
    let kill_group = || {
        let _ = Command::new("kill").args(["-KILL", "--", &format!("-{group}")]).status();
    };
    let status = loop {
        if let Some(st) = child.try_wait().expect("wait") {
            break st;
        }
        if Instant::now() > deadline {
            kill_group();
            let _ = child.wait();
            panic!("{cmd:?} did not finish within {secs} s (hang)");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    while !(out_t.is_finished() && err_t.is_finished()) {
        if Instant::now() > deadline {
            kill_group();
            panic!("{cmd:?} left processes holding its output after {secs} s (hang)");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    std::process::Output { status, stdout: out_t.join().unwrap(), stderr: err_t.join().unwrap() }
}

/// The largest |a − b|; infinite where either holds a NaN or an infinity (which `f32::max`
/// would pass over), so that no comparison against a tolerance passes on them.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "logit vectors differ in length");
    let d = |(x, y): (&f32, &f32)| if x.is_finite() && y.is_finite() { (x - y).abs() } else { f32::INFINITY };
    a.iter().zip(b).map(d).fold(0.0, f32::max)
}

/// Index of the largest value (lowest index on ties).
pub fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}

/// Deterministic values in [-scale, scale).
pub fn rand_vec(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed ^ 0x9E37_79B9_7F4A_7C15;
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0) * scale
        })
        .collect()
}

/// A small random-weight model written as a HuggingFace folder: `config.json`,
/// `model.safetensors` (f32) and a word-level `tokenizer.json` over `t0 … t{vocab-1}`.
#[derive(Clone, Debug)]
pub struct TinyModel {
    pub model_type: &'static str,
    pub vocab: usize,
    pub hidden: usize,
    pub inter: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    /// Dimensions of a head: `hidden / heads` unless given (Qwen3 sets it apart).
    pub head_dim: Option<usize>,
    pub tied: bool,
    pub max_pos: usize,
    /// A mixture of experts: (experts, chosen per token, columns of each expert).
    pub experts: Option<(usize, usize, usize)>,
    /// Llama 3's RoPE scaling: HF's `llama3` `[factor, low_freq_factor, high_freq_factor,
    /// original_max_position_embeddings]`.
    pub llama3_rope: Option<[f64; 4]>,
}

impl TinyModel {
    /// Qwen2-style: QKV bias, untied lm_head, GQA, an FFN width that is no multiple of 16.
    pub fn qwen2() -> Self {
        TinyModel {
            model_type: "qwen2",
            vocab: 320,
            hidden: 64,
            inter: 200,
            layers: 3,
            heads: 4,
            kv_heads: 2,
            head_dim: None,
            tied: false,
            max_pos: 256,
            experts: None,
            llama3_rope: None,
        }
    }
    /// Qwen3-style: per-head q/k norms, no QKV bias, heads wider than `hidden / heads` (so
    /// o_proj is not square), tied embeddings, GQA with three query heads per KV head.
    pub fn qwen3() -> Self {
        TinyModel {
            model_type: "qwen3",
            vocab: 300,
            hidden: 48,
            inter: 136,
            layers: 3,
            heads: 6,
            kv_heads: 2,
            head_dim: Some(16),
            tied: true,
            max_pos: 256,
            experts: None,
            llama3_rope: None,
        }
    }
    /// Phi-3-style: q, k and v rows in one `qkv_proj` tensor and gate and up rows in one
    /// `gate_up_proj`; otherwise Qwen2's shape (untied head, GQA) without the biases.
    pub fn phi3() -> Self {
        TinyModel { model_type: "phi3", vocab: 300, inter: 160, ..Self::qwen2() }
    }
    /// GLM-4-style (`glm4`, GLM-4-0414): Qwen2's shape and q/k/v biases, gate and up rows in one
    /// `gate_up_proj` (as Phi-3's), RoPE on interleaved pairs of the first half of each head,
    /// and RMSNorms on the attention's and the FFN's outputs too.
    pub fn glm4() -> Self {
        TinyModel { model_type: "glm4", ..Self::qwen2() }
    }
    /// StarCoder 2-style (`starcoder2`): LayerNorms with biases, biases on q, k, v, o and both
    /// FFN matrices, an FFN without a gate (`c_fc`, GELU, `c_proj`), tied embeddings, a RoPE
    /// base of 100000; Qwen2's shape otherwise.
    pub fn starcoder2() -> Self {
        TinyModel { model_type: "starcoder2", tied: true, ..Self::qwen2() }
    }
    /// StableLM 2-style (`stablelm`): LayerNorms with biases, RoPE over a quarter of each head
    /// (4 of 16 dimensions), q/k/v biases; Qwen2's shape otherwise.
    pub fn stablelm() -> Self {
        TinyModel { model_type: "stablelm", ..Self::qwen2() }
    }
    /// Phi-2-style (`phi`): one LayerNorm a layer read by the attention and the FFN alike (a
    /// parallel residual), biases on every projection and on the output head, an FFN without a
    /// gate (`fc1`, GELU, `fc2`), RoPE over half of each head; Qwen2's shape otherwise.
    pub fn phi() -> Self {
        TinyModel { model_type: "phi", ..Self::qwen2() }
    }
    /// The first GLM-4's style (`glm`): [`Self::glm4`] without the norms of the outputs.
    pub fn glm() -> Self {
        TinyModel { model_type: "glm", ..Self::qwen2() }
    }
    /// Gemma 3-style (`gemma3_text`): norms stored less one, sandwich norms around attention
    /// and FFN, per-head q/k norms, GELU, a scaled embedding, heads wider than `hidden /
    /// heads`; layers 0, 1 and 3 local (a window of 4 positions, their own RoPE base), layer 2
    /// global. Tied embeddings, as every Gemma 3.
    pub fn gemma3() -> Self {
        TinyModel {
            model_type: "gemma3_text",
            vocab: 300,
            hidden: 48,
            inter: 120,
            layers: 4,
            heads: 4,
            kv_heads: 2,
            head_dim: Some(32),
            tied: true,
            max_pos: 256,
            experts: None,
            llama3_rope: None,
        }
    }
    /// Gemma 2-style: Gemma 3's norms, GELU and scaled embedding without the per-head q/k norms,
    /// attention scores and logits soft-capped (caps of 1 and 2, which bend them far from
    /// linear), every other layer local through a window of 64 positions (longer than the
    /// test's sequence: candle's Gemma 2 has no windows in its decode steps).
    pub fn gemma2() -> Self {
        TinyModel { model_type: "gemma2", layers: 3, ..Self::gemma3() }
    }
    /// Gemma-style (the first Gemma): norms stored less one, GELU, the scaled embedding; no
    /// sandwich norms, no soft caps, every layer global.
    pub fn gemma() -> Self {
        TinyModel { model_type: "gemma", layers: 3, ..Self::gemma3() }
    }
    /// SmolLM3-style: Llama with tied embeddings whose second layer is not rotated (NoPE).
    pub fn smollm3() -> Self {
        TinyModel { model_type: "smollm3", ..Self::llama() }
    }
    /// Llama-style with tied embeddings and uneven heads (6 heads, 3 KV heads).
    pub fn llama() -> Self {
        TinyModel {
            model_type: "llama",
            vocab: 300,
            hidden: 48,
            inter: 100,
            layers: 4,
            heads: 6,
            kv_heads: 3,
            head_dim: None,
            tied: true,
            max_pos: 128,
            experts: None,
            llama3_rope: None,
        }
    }

    /// Llama 3.1-style: Llama with its RoPE frequencies scaled by their wavelength (a factor of
    /// 4 beyond 256 positions, none below 16, a ramp between: of a head's 8 frequencies, 1
    /// unscaled, 3 on the ramp, 4 scaled), heads of 16 dimensions, an untied head.
    pub fn llama3() -> Self {
        TinyModel {
            hidden: 64,
            inter: 128,
            layers: 3,
            heads: 4,
            kv_heads: 2,
            tied: false,
            max_pos: 512,
            llama3_rope: Some([4.0, 1.0, 16.0, 256.0]),
            ..Self::llama()
        }
    }

    /// Qwen3-MoE-style: Qwen3's shape with every second layer (`decoder_sparse_step` 2) a
    /// mixture of 6 experts of 40 columns (no multiple of 16), 3 chosen a token, their softmax
    /// shares not renormalized (`norm_topk_prob` false); an untied head.
    pub fn qwen3_moe() -> Self {
        TinyModel {
            model_type: "qwen3_moe",
            layers: 4,
            tied: false,
            experts: Some((6, 3, 40)),
            ..Self::qwen3()
        }
    }
    /// Qwen2-MoE-style: Qwen2's shape (QKV bias, untied head) with every second layer a
    /// mixture of 6 experts of 40 columns, 2 chosen a token, beside a shared expert of 56
    /// columns (no multiple of 16) weighted by its sigmoid gate.
    pub fn qwen2_moe() -> Self {
        TinyModel { model_type: "qwen2_moe", layers: 4, experts: Some((6, 2, 40)), ..Self::qwen2() }
    }
    /// Mistral-style: Llama's shape (uneven heads) with an untied head and a sliding window
    /// (of `max_pos`, longer than the tests' sequences: candle's Mistral applies no window in
    /// its decode steps, and one position wider than HF's in its prompt).
    pub fn mistral() -> Self {
        TinyModel { model_type: "mistral", tied: false, ..Self::llama() }
    }
    /// OLMo-style (`olmo`, the first OLMo): Llama's shape (uneven heads, tied embeddings) with
    /// LayerNorms that have no weights or biases (no norm tensors at all), and q, k and v
    /// clamped into [-0.6, 0.6] (`clip_qkv`, well inside the projections' spread, so that many
    /// values are cut).
    pub fn olmo() -> Self {
        TinyModel { model_type: "olmo", ..Self::llama() }
    }
    /// Helium-style (`helium`): Llama's shape (uneven heads) with RoPE on interleaved pairs of
    /// each whole head, an untied head, a RoPE base of 100000 and HF's epsilon of 1e-8.
    pub fn helium() -> Self {
        TinyModel { model_type: "helium", tied: false, ..Self::llama() }
    }
    /// OLMo 2-style: Llama's shape (uneven heads: under tp = 2 a KV head on both ranks) with
    /// norms on the attention's and the FFN's outputs only, q and k normed over their whole
    /// width, an untied head.
    pub fn olmo2() -> Self {
        TinyModel { model_type: "olmo2", tied: false, ..Self::llama() }
    }
    /// Mixtral-style: Llama's shape (uneven heads) with every layer a mixture of 4 experts of
    /// 64 columns, 2 chosen a token (their shares renormalized), an untied head.
    pub fn mixtral() -> Self {
        TinyModel {
            model_type: "mixtral",
            layers: 3,
            tied: false,
            experts: Some((4, 2, 64)),
            ..Self::llama()
        }
    }

    /// Granite 3-style (`granite`): Llama's shape (uneven heads, tied embeddings) with
    /// Granite's multipliers: embedding rows × 12, attention scores × 0.25 (not 1/√8), each
    /// sublayer's output × 0.22, logits ÷ 3.
    pub fn granite() -> Self {
        TinyModel { model_type: "granite", ..Self::llama() }
    }
    /// Granite 4-style (`granitemoehybrid`, as Granite 4.0 Micro): Granite's shape and
    /// multipliers with every layer attention, no experts, its dense FFN's gate and up rows in
    /// one `shared_mlp.input_linear` (of `shared_intermediate_size` columns; its
    /// `intermediate_size`, the experts' width, set apart), rotated by RoPE.
    pub fn granite_hybrid() -> Self {
        TinyModel { model_type: "granitemoehybrid", ..Self::llama() }
    }

    /// GraniteMoE-style (`granitemoe`): Mixtral's mixture (2 of 4 experts of 64 columns a
    /// token, every layer) with Granite's multipliers and tied embeddings, each layer's experts
    /// stacked as HF's checkpoints hold them: gate and up rows in `input_linear` (`[experts,
    /// 2 · 64, hidden]`), down in `output_linear`, the router `router.layer`.
    pub fn granite_moe() -> Self {
        TinyModel { model_type: "granitemoe", tied: true, ..Self::mixtral() }
    }

    /// Mixtral's naming and every layer a mixture.
    fn mixtral_like(&self) -> bool {
        matches!(self.model_type, "mixtral" | "granitemoe")
    }

    fn is_granite(&self) -> bool {
        self.model_type.starts_with("granite")
    }

    /// Whether layer `l`'s FFN is a mixture of experts.
    fn is_sparse(&self, l: usize) -> bool {
        self.experts.is_some() && (self.mixtral_like() || l % 2 == 1)
    }

    fn is_glm(&self) -> bool {
        self.model_type.starts_with("glm")
    }

    fn is_gemma3(&self) -> bool {
        self.model_type == "gemma3_text"
    }

    fn is_gemma(&self) -> bool {
        self.model_type.starts_with("gemma")
    }

    /// Gemma 2 and 3: norms around the attention's and the FFN's outputs as well.
    fn has_sandwich_norms(&self) -> bool {
        self.is_gemma() && self.model_type != "gemma"
    }

    fn hd(&self) -> usize {
        self.head_dim.unwrap_or(self.hidden / self.heads)
    }

    pub fn config(&self) -> serde_json::Value {
        let architecture = match self.model_type {
            "qwen2" => "Qwen2ForCausalLM",
            "qwen3" => "Qwen3ForCausalLM",
            "phi3" => "Phi3ForCausalLM",
            "gemma3_text" => "Gemma3ForCausalLM",
            "gemma2" => "Gemma2ForCausalLM",
            "gemma" => "GemmaForCausalLM",
            "smollm3" => "SmolLM3ForCausalLM",
            "qwen2_moe" => "Qwen2MoeForCausalLM",
            "qwen3_moe" => "Qwen3MoeForCausalLM",
            "mixtral" => "MixtralForCausalLM",
            "olmo" => "OlmoForCausalLM",
            "helium" => "HeliumForCausalLM",
            "olmo2" => "Olmo2ForCausalLM",
            "mistral" => "MistralForCausalLM",
            "granite" => "GraniteForCausalLM",
            "granitemoehybrid" => "GraniteMoeHybridForCausalLM",
            "granitemoe" => "GraniteMoeForCausalLM",
            "glm4" => "Glm4ForCausalLM",
            "glm" => "GlmForCausalLM",
            "starcoder2" => "Starcoder2ForCausalLM",
            "stablelm" => "StableLmForCausalLM",
            "phi" => "PhiForCausalLM",
            _ => "LlamaForCausalLM",
        };
        let mut cfg = serde_json::json!({
            "architectures": [architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab, "hidden_size": self.hidden, "intermediate_size": self.inter,
            "num_hidden_layers": self.layers, "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads, "max_position_embeddings": self.max_pos,
            "sliding_window": self.max_pos, "max_window_layers": self.layers, "use_sliding_window": false,
            "tie_word_embeddings": self.tied, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
            "hidden_act": "silu", "bos_token_id": null, "eos_token_id": 0,
        });
        if let Some(hd) = self.head_dim {
            cfg["head_dim"] = hd.into();
        }
        if let Some([factor, low, high, old]) = self.llama3_rope {
            cfg["rope_scaling"] = serde_json::json!({
                "rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                "original_max_position_embeddings": old as u64,
            });
        }
        if self.model_type.starts_with("qwen3") || self.model_type.starts_with("olmo") {
            cfg["attention_bias"] = false.into();
        }
        if self.model_type == "helium" {
            let helium = serde_json::json!({
                "rope_theta": 100000.0, "rms_norm_eps": 1e-8, "attention_bias": false, "mlp_bias": false,
                "head_dim": self.hd(), "bos_token_id": 1,
            });
            cfg.as_object_mut().unwrap().extend(helium.as_object().unwrap().clone());
        }
        if self.model_type == "olmo" {
            cfg["clip_qkv"] = 0.6.into();
            cfg.as_object_mut().unwrap().remove("rms_norm_eps");
        }
        if self.model_type == "olmo2" {
            cfg["clip_qkv"] = serde_json::Value::Null;
        }
        if self.model_type == "starcoder2" {
            let starcoder2 = serde_json::json!({
                "norm_epsilon": 1e-5, "use_bias": true, "hidden_act": "gelu_pytorch_tanh",
                "rope_theta": 100000.0,
            });
            cfg.as_object_mut().unwrap().remove("rms_norm_eps");
            cfg.as_object_mut().unwrap().extend(starcoder2.as_object().unwrap().clone());
        }
        if self.model_type == "stablelm" {
            let stablelm = serde_json::json!({
                "layer_norm_eps": 1e-5, "use_qkv_bias": true, "partial_rotary_factor": 0.25,
                "qk_layernorm": false, "use_parallel_residual": false, "use_cache": true,
            });
            cfg.as_object_mut().unwrap().remove("rms_norm_eps");
            cfg.as_object_mut().unwrap().extend(stablelm.as_object().unwrap().clone());
        }
        if self.model_type == "phi" {
            let phi = serde_json::json!({
                "layer_norm_eps": 1e-5, "partial_rotary_factor": 0.5, "hidden_act": "gelu_new",
                "qk_layernorm": false,
            });
            cfg.as_object_mut().unwrap().remove("rms_norm_eps");
            cfg.as_object_mut().unwrap().extend(phi.as_object().unwrap().clone());
        }
        if self.is_glm() {
            let glm = serde_json::json!({
                "partial_rotary_factor": 0.5, "attention_bias": true, "head_dim": self.hd(),
            });
            cfg.as_object_mut().unwrap().extend(glm.as_object().unwrap().clone());
        }
        if let Some((experts, per_token, width)) = self.experts {
            let moe = if self.mixtral_like() {
                cfg["intermediate_size"] = width.into();
                serde_json::json!({"num_local_experts": experts, "use_flash_attn": false})
            } else {
                serde_json::json!({
                    "num_experts": experts, "moe_intermediate_size": width, "decoder_sparse_step": 2,
                    "norm_topk_prob": false, "mlp_only_layers": [],
                    "shared_expert_intermediate_size": if self.model_type == "qwen2_moe" { 56 } else { 0 },
                })
            };
            cfg["num_experts_per_tok"] = per_token.into();
            cfg.as_object_mut().unwrap().extend(moe.as_object().unwrap().clone());
        }
        if self.is_granite() {
            let multipliers = serde_json::json!({
                "embedding_multiplier": 12.0, "attention_multiplier": 0.25, "residual_multiplier": 0.22,
                "logits_scaling": 3.0, "attention_bias": false, "mlp_bias": false,
            });
            cfg.as_object_mut().unwrap().extend(multipliers.as_object().unwrap().clone());
        }
        if self.model_type == "granitemoehybrid" {
            let hybrid = serde_json::json!({
                "intermediate_size": 2 * self.inter, "shared_intermediate_size": self.inter,
                "num_local_experts": 0, "num_experts_per_tok": 0, "position_embedding_type": "rope",
                "layer_types": vec!["attention"; self.layers],
            });
            cfg.as_object_mut().unwrap().extend(hybrid.as_object().unwrap().clone());
        }
        if self.model_type == "smollm3" {
            let flags: Vec<u32> = (0..self.layers).map(|i| u32::from(i != 1)).collect();
            cfg["no_rope_layers"] = flags.into();
        }
        if self.is_gemma() {
            let gemma = match self.model_type {
                "gemma3_text" => serde_json::json!({
                    "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "sliding_window": 4,
                    "sliding_window_pattern": 3, "attn_logit_softcapping": null,
                    "final_logit_softcapping": null,
                }),
                "gemma2" => serde_json::json!({
                    "sliding_window": 64, "attn_logit_softcapping": 1.0, "final_logit_softcapping": 2.0,
                }),
                _ => serde_json::json!({}),
            };
            let common = serde_json::json!({
                "attention_bias": false, "hidden_activation": "gelu_pytorch_tanh",
                "query_pre_attn_scalar": self.hd(),
            });
            cfg.as_object_mut().unwrap().extend(common.as_object().unwrap().clone());
            cfg.as_object_mut().unwrap().remove("hidden_act");
            cfg.as_object_mut().unwrap().extend(gemma.as_object().unwrap().clone());
        }
        cfg
    }

    /// Tensors by HF name: (name, shape, values).
    pub fn tensors(&self) -> Vec<(String, Vec<usize>, Vec<f32>)> {
        let (h, hd) = (self.hidden, self.hd());
        let mut out = Vec::new();
        let mut seed = 1;
        let mut add = |name: String, shape: Vec<usize>, scale: f32, offset: f32| {
            seed += 1;
            let n = shape.iter().product();
            let v = rand_vec(n, seed, scale).into_iter().map(|x| x + offset).collect();
            out.push((name, shape, v));
        };
        add("model.embed_tokens.weight".into(), vec![self.vocab, h], 1.0, 0.0);
        if !self.tied {
            add("lm_head.weight".into(), vec![self.vocab, h], 0.5, 0.0);
        }
        // Gemma stores norms less one.
        let norm = if self.is_gemma() { 0.0 } else { 1.0 };
        // OLMo's norms have no weights.
        let weighted = self.model_type != "olmo";
        if weighted {
            add("model.norm.weight".into(), vec![h], 0.2, norm);
        }
        let w = 1.0 / (h as f32).sqrt();
        for l in 0..self.layers {
            let p = |s: &str| format!("model.layers.{l}.{s}");
            if weighted && self.model_type != "olmo2" {
                add(p("input_layernorm.weight"), vec![h], 0.2, norm);
            }
            if weighted {
                add(p("post_attention_layernorm.weight"), vec![h], 0.2, norm);
            }
            if self.model_type == "olmo2" {
                add(p("post_feedforward_layernorm.weight"), vec![h], 0.2, norm);
                add(p("self_attn.q_norm.weight"), vec![self.heads * hd], 0.2, norm);
                add(p("self_attn.k_norm.weight"), vec![self.kv_heads * hd], 0.2, norm);
            }
            if self.has_sandwich_norms() {
                add(p("pre_feedforward_layernorm.weight"), vec![h], 0.2, norm);
                add(p("post_feedforward_layernorm.weight"), vec![h], 0.2, norm);
            }
            if self.model_type == "glm4" {
                add(p("post_self_attn_layernorm.weight"), vec![h], 0.2, norm);
                add(p("post_mlp_layernorm.weight"), vec![h], 0.2, norm);
            }
            add(p("self_attn.q_proj.weight"), vec![self.heads * hd, h], 2.0 * w, 0.0);
            add(p("self_attn.k_proj.weight"), vec![self.kv_heads * hd, h], 2.0 * w, 0.0);
            add(p("self_attn.v_proj.weight"), vec![self.kv_heads * hd, h], w, 0.0);
            if self.model_type.starts_with("qwen2")
                || self.is_glm()
                || matches!(self.model_type, "starcoder2" | "stablelm" | "phi")
            {
                add(p("self_attn.q_proj.bias"), vec![self.heads * hd], 0.5, 0.0);
                add(p("self_attn.k_proj.bias"), vec![self.kv_heads * hd], 0.5, 0.0);
                add(p("self_attn.v_proj.bias"), vec![self.kv_heads * hd], 0.5, 0.0);
            }
            if self.model_type.starts_with("qwen3") || self.is_gemma3() {
                add(p("self_attn.q_norm.weight"), vec![hd], 0.2, norm);
                add(p("self_attn.k_norm.weight"), vec![hd], 0.2, norm);
            }
            add(p("self_attn.o_proj.weight"), vec![h, self.heads * hd], w, 0.0);
            match self.experts.filter(|_| self.is_sparse(l)) {
                Some((experts, _, width)) => {
                    let mixtral = self.mixtral_like();
                    let moe = if mixtral { "block_sparse_moe" } else { "mlp" };
                    // The router's rows spread enough that tokens choose different experts.
                    add(p(&format!("{moe}.gate.weight")), vec![experts, h], 4.0 * w, 0.0);
                    let names =
                        if mixtral { ["w1", "w3", "w2"] } else { ["gate_proj", "up_proj", "down_proj"] };
                    for e in 0..experts {
                        let x = |n: &str| p(&format!("{moe}.experts.{e}.{n}.weight"));
                        add(x(names[0]), vec![width, h], w, 0.0);
                        add(x(names[1]), vec![width, h], w, 0.0);
                        add(x(names[2]), vec![h, width], 1.0 / (width as f32).sqrt(), 0.0);
                    }
                    if self.model_type == "qwen2_moe" {
                        let shared = 56;
                        add(p("mlp.shared_expert.gate_proj.weight"), vec![shared, h], w, 0.0);
                        add(p("mlp.shared_expert.up_proj.weight"), vec![shared, h], w, 0.0);
                        let down = 1.0 / (shared as f32).sqrt();
                        add(p("mlp.shared_expert.down_proj.weight"), vec![h, shared], down, 0.0);
                        add(p("mlp.shared_expert_gate.weight"), vec![1, h], 2.0 * w, 0.0);
                    }
                }
                None => {
                    add(p("mlp.gate_proj.weight"), vec![self.inter, h], w, 0.0);
                    add(p("mlp.up_proj.weight"), vec![self.inter, h], w, 0.0);
                    add(
                        p("mlp.down_proj.weight"),
                        vec![h, self.inter],
                        1.0 / (self.inter as f32).sqrt(),
                        0.0,
                    );
                }
            }
        }
        if self.model_type == "phi3" {
            out = fuse(
                out,
                ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"],
                "self_attn.qkv_proj.weight",
            );
            out = fuse(out, ["mlp.gate_proj.weight", "mlp.up_proj.weight"], "mlp.gate_up_proj.weight");
        }
        if self.is_glm() {
            out = fuse(out, ["mlp.gate_proj.weight", "mlp.up_proj.weight"], "mlp.gate_up_proj.weight");
        }
        if self.model_type == "starcoder2" {
            out = starcoder2_tensors(out, self.hidden);
        }
        if self.model_type == "stablelm" {
            out = with_biases(out, self.hidden, |name| name.ends_with("norm.weight"));
        }
        if self.model_type == "phi" {
            out = phi_tensors(out, self.hidden);
        }
        if self.model_type == "granitemoe" {
            out = stack_experts(out, self.layers, self.experts.map_or(0, |(e, _, _)| e));
        }
        if self.model_type == "granitemoehybrid" {
            out = fuse(out, ["mlp.gate_proj.weight", "mlp.up_proj.weight"], "shared_mlp.input_linear.weight");
            out = fuse(out, ["mlp.down_proj.weight"], "shared_mlp.output_linear.weight");
        }
        out
    }

    /// Writes the whole folder into `dir`.
    pub fn write(&self, dir: &Path) {
        std::fs::write(dir.join("config.json"), self.config().to_string()).expect("write config.json");
        write_safetensors(&dir.join("model.safetensors"), &self.tensors());
        write_word_level_tokenizer(dir, self.vocab);
    }
}

/// A Llama-style model's tensors as StarCoder 2's: no up matrix, the gate's rows as `c_fc` and
/// the down matrix as `c_proj`, and a random bias beside every norm and projection weight (Qwen2's
/// shape already carries q, k and v biases).
fn starcoder2_tensors(
    tensors: Vec<(String, Vec<usize>, Vec<f32>)>,
    hidden: usize,
) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let renames = [("mlp.gate_proj.", "mlp.c_fc."), ("mlp.down_proj.", "mlp.c_proj.")];
    let renamed = renamed(tensors, &["mlp.up_proj.weight"], &renames);
    with_biases(renamed, hidden, |name| {
        let qkv = ["q_proj", "k_proj", "v_proj"].iter().any(|p| name.contains(p));
        name.ends_with("norm.weight") || (!qkv && (name.contains("_proj.weight") || name.contains("mlp.c_")))
    })
}

/// A Llama-style model's tensors as Phi's: one norm a layer (the attention's input norm, no
/// `post_attention_layernorm`), o_proj as `dense`, the gate's rows as `fc1` and the down matrix
/// as `fc2` (no up matrix), the final norm as `final_layernorm`, and a random bias beside every
/// norm and projection weight and the output head (q, k and v have theirs).
fn phi_tensors(
    tensors: Vec<(String, Vec<usize>, Vec<f32>)>,
    hidden: usize,
) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let renames = [
        ("self_attn.o_proj.", "self_attn.dense."),
        ("mlp.gate_proj.", "mlp.fc1."),
        ("mlp.down_proj.", "mlp.fc2."),
        ("model.norm.", "model.final_layernorm."),
    ];
    let kept = renamed(tensors, &["mlp.up_proj.weight", "post_attention_layernorm.weight"], &renames);
    with_biases(kept, hidden, |name| {
        let qkv = ["q_proj", "k_proj", "v_proj"].iter().any(|p| name.contains(p));
        !qkv && !name.contains("embed")
    })
}

/// `tensors` without those whose names end in one of `dropped`, each name's parts renamed by
/// `renames` (`(from, to)`, in turn).
fn renamed(
    tensors: Vec<(String, Vec<usize>, Vec<f32>)>,
    dropped: &[&str],
    renames: &[(&str, &str)],
) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    tensors
        .into_iter()
        .filter(|(name, _, _)| !dropped.iter().any(|d| name.ends_with(d)))
        .map(|(name, shape, v)| (renames.iter().fold(name, |n, (from, to)| n.replace(from, to)), shape, v))
        .collect()
}

/// `tensors` with a random bias after each weight `biased` names (a norm's as wide as `hidden`,
/// a matrix's as its rows).
fn with_biases(
    tensors: Vec<(String, Vec<usize>, Vec<f32>)>,
    hidden: usize,
    biased: impl Fn(&str) -> bool,
) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let mut out = Vec::new();
    for (seed, (name, shape, v)) in tensors.into_iter().enumerate() {
        let bias = biased(&name).then(|| {
            let rows = if name.ends_with("norm.weight") { hidden } else { shape[0] };
            let stem = name.strip_suffix(".weight").unwrap_or(&name);
            (format!("{stem}.bias"), vec![rows], rand_vec(rows, 1000 + seed as u64, 0.3))
        });
        out.push((name, shape, v));
        out.extend(bias);
    }
    out
}

/// Each layer's experts (Mixtral's names) stacked as GraniteMoE's checkpoints hold them: expert
/// `e`'s `w1` (gate) and `w3` (up) rows as `input_linear`'s `[e]`, its `w2` (down) as
/// `output_linear`'s; the router `gate` renamed `router.layer`.
fn stack_experts(
    tensors: Vec<(String, Vec<usize>, Vec<f32>)>,
    layers: usize,
    experts: usize,
) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let mut out: Vec<_> = tensors.iter().filter(|(n, _, _)| !n.contains(".experts.")).cloned().collect();
    let find = |name: &str| tensors.iter().find(|(n, _, _)| n == name).expect("an expert's tensor");
    for l in 0..layers {
        let p = |s: &str| format!("model.layers.{l}.block_sparse_moe.{s}");
        let router = out.iter_mut().find(|(n, _, _)| *n == p("gate.weight")).expect("a router");
        router.0 = p("router.layer.weight");
        let x = |e: usize, w: &str| find(&p(&format!("experts.{e}.{w}.weight")));
        let (ffn, h) = (x(0, "w1").1[0], x(0, "w1").1[1]);
        let input =
            (0..experts).flat_map(|e| [x(e, "w1").2.clone(), x(e, "w3").2.clone()].concat()).collect();
        out.push((p("input_linear.weight"), vec![experts, 2 * ffn, h], input));
        let output = (0..experts).flat_map(|e| x(e, "w2").2.clone()).collect();
        out.push((p("output_linear.weight"), vec![experts, h, ffn], output));
    }
    out
}

/// Each layer's matrices named `parts` (after `model.layers.N.`), stacked by rows in that order
/// into one tensor named `into`, as Phi-3 checkpoints store them.
fn fuse<const N: usize>(
    tensors: Vec<(String, Vec<usize>, Vec<f32>)>,
    parts: [&str; N],
    into: &str,
) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let part_of = |name: &str| {
        let rest = name.strip_prefix("model.layers.")?;
        let (layer, t) = rest.split_once('.')?;
        Some((layer.to_string(), parts.iter().position(|p| *p == t)?))
    };
    let mut fused: Vec<(String, Vec<usize>, Vec<f32>)> = Vec::new();
    let mut out = Vec::new();
    for (name, shape, values) in tensors {
        let Some((layer, i)) = part_of(&name) else {
            out.push((name, shape, values));
            continue;
        };
        let name = format!("model.layers.{layer}.{into}");
        if i == 0 {
            fused.push((name, shape, values));
        } else {
            let f = fused.iter_mut().find(|(n, _, _)| *n == name).expect("parts in order");
            f.1[0] += shape[0];
            f.2.extend(values);
        }
    }
    out.extend(fused);
    out
}

/// llama.cpp's tensor names beside HuggingFace's: whole-model tensors, then a layer's (after
/// `blk.N.` and `model.layers.N.`). Written here, not taken from gridlm's converter, so the
/// tests check it.
pub const GGUF_NAMES: [(&str, &str); 7] = [
    ("token_embd.weight", "model.embed_tokens.weight"),
    ("output_norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
    ("output_norm.bias", "model.norm.bias"),
    // Phi's final norm and output head's bias.
    ("output_norm.weight", "model.final_layernorm.weight"),
    ("output_norm.bias", "model.final_layernorm.bias"),
    ("output.bias", "lm_head.bias"),
];
pub const GGUF_LAYER_NAMES: [(&str, &str); 31] = [
    ("attn_norm.weight", "input_layernorm.weight"),
    ("ffn_norm.weight", "post_attention_layernorm.weight"),
    ("attn_q.weight", "self_attn.q_proj.weight"),
    ("attn_k.weight", "self_attn.k_proj.weight"),
    ("attn_v.weight", "self_attn.v_proj.weight"),
    ("attn_q.bias", "self_attn.q_proj.bias"),
    ("attn_k.bias", "self_attn.k_proj.bias"),
    ("attn_v.bias", "self_attn.v_proj.bias"),
    ("attn_q_norm.weight", "self_attn.q_norm.weight"),
    ("attn_k_norm.weight", "self_attn.k_norm.weight"),
    ("attn_output.weight", "self_attn.o_proj.weight"),
    ("ffn_gate.weight", "mlp.gate_proj.weight"),
    ("ffn_up.weight", "mlp.up_proj.weight"),
    ("ffn_down.weight", "mlp.down_proj.weight"),
    // Phi-3's fused rows (after the llama names, which GGUF names map to first).
    ("attn_qkv.weight", "self_attn.qkv_proj.weight"),
    ("ffn_up.weight", "mlp.gate_up_proj.weight"),
    // GLM-4's norms of the sublayers' outputs.
    ("post_attention_norm.weight", "post_self_attn_layernorm.weight"),
    ("post_ffw_norm.weight", "post_mlp_layernorm.weight"),
    // StarCoder 2's biases and its FFN without a gate.
    ("attn_norm.bias", "input_layernorm.bias"),
    ("ffn_norm.bias", "post_attention_layernorm.bias"),
    ("attn_output.bias", "self_attn.o_proj.bias"),
    ("ffn_up.weight", "mlp.c_fc.weight"),
    ("ffn_up.bias", "mlp.c_fc.bias"),
    ("ffn_down.weight", "mlp.c_proj.weight"),
    ("ffn_down.bias", "mlp.c_proj.bias"),
    // Phi's projections.
    ("attn_output.weight", "self_attn.dense.weight"),
    ("attn_output.bias", "self_attn.dense.bias"),
    ("ffn_up.weight", "mlp.fc1.weight"),
    ("ffn_up.bias", "mlp.fc1.bias"),
    ("ffn_down.weight", "mlp.fc2.weight"),
    ("ffn_down.bias", "mlp.fc2.bias"),
];

/// A tensor's name in one naming (`from_gguf`: llama.cpp's to HuggingFace's, else back).
pub fn rename_tensor(name: &str, from_gguf: bool) -> Option<String> {
    let pick = |(g, h): (&'static str, &'static str)| if from_gguf { (g, h) } else { (h, g) };
    if let Some((_, to)) = GGUF_NAMES.into_iter().map(pick).find(|(from, _)| *from == name) {
        return Some(to.to_string());
    }
    let (prefix, to_prefix) = pick(("blk.", "model.layers."));
    let (layer, rest) = name.strip_prefix(prefix)?.split_once('.')?;
    let (_, to) = GGUF_LAYER_NAMES.into_iter().map(pick).find(|(from, _)| *from == rest)?;
    Some(format!("{to_prefix}{layer}.{to}"))
}

/// A GGUF metadata value, as [`write_gguf`] writes it.
pub enum GgufValue {
    U32(u32),
    F32(f32),
    Bool(bool),
    Str(String),
    Strs(Vec<String>),
    I32s(Vec<i32>),
    F32s(Vec<f32>),
    Bools(Vec<bool>),
}

/// Writes a GGUF file (version 3, 32-byte alignment) of f32 tensors, each `(name, shape as
/// HuggingFace gives it, values)` (GGUF lists the dimensions innermost first), with `meta`.
pub fn write_gguf<K: AsRef<str>>(
    path: &Path,
    meta: &[(K, GgufValue)],
    tensors: &[(String, Vec<usize>, Vec<f32>)],
) {
    let raw: Vec<_> = tensors
        .iter()
        .map(|(name, shape, v)| {
            (name.clone(), shape.clone(), 0, v.iter().flat_map(|x| x.to_le_bytes()).collect())
        })
        .collect();
    write_gguf_raw(path, meta, &raw);
}

/// [`write_gguf`] of tensors already in GGML's bytes: (name, shape, GGML type id, bytes).
pub fn write_gguf_raw<K: AsRef<str>>(
    path: &Path,
    meta: &[(K, GgufValue)],
    tensors: &[(String, Vec<usize>, u32, Vec<u8>)],
) {
    fn string(out: &mut Vec<u8>, s: &str) {
        out.extend((s.len() as u64).to_le_bytes());
        out.extend(s.as_bytes());
    }
    let mut out = b"GGUF".to_vec();
    out.extend(3u32.to_le_bytes());
    out.extend((tensors.len() as u64).to_le_bytes());
    out.extend((meta.len() as u64).to_le_bytes());
    for (key, value) in meta {
        string(&mut out, key.as_ref());
        match value {
            GgufValue::U32(v) => {
                out.extend(4u32.to_le_bytes());
                out.extend(v.to_le_bytes());
            }
            GgufValue::F32(v) => {
                out.extend(6u32.to_le_bytes());
                out.extend(v.to_le_bytes());
            }
            GgufValue::Bool(v) => {
                out.extend(7u32.to_le_bytes());
                out.push(u8::from(*v));
            }
            GgufValue::Str(v) => {
                out.extend(8u32.to_le_bytes());
                string(&mut out, v);
            }
            GgufValue::Strs(v) => {
                out.extend(9u32.to_le_bytes());
                out.extend(8u32.to_le_bytes());
                out.extend((v.len() as u64).to_le_bytes());
                v.iter().for_each(|s| string(&mut out, s));
            }
            GgufValue::I32s(v) => {
                out.extend(9u32.to_le_bytes());
                out.extend(5u32.to_le_bytes());
                out.extend((v.len() as u64).to_le_bytes());
                v.iter().for_each(|x| out.extend(x.to_le_bytes()));
            }
            GgufValue::F32s(v) => {
                out.extend(9u32.to_le_bytes());
                out.extend(6u32.to_le_bytes());
                out.extend((v.len() as u64).to_le_bytes());
                v.iter().for_each(|x| out.extend(x.to_le_bytes()));
            }
            GgufValue::Bools(v) => {
                out.extend(9u32.to_le_bytes());
                out.extend(7u32.to_le_bytes());
                out.extend((v.len() as u64).to_le_bytes());
                out.extend(v.iter().map(|&b| u8::from(b)));
            }
        }
    }
    let aligned = |n: usize| n.div_ceil(32) * 32;
    let mut offset = 0;
    for (name, shape, ty, bytes) in tensors {
        string(&mut out, name);
        out.extend((shape.len() as u32).to_le_bytes());
        shape.iter().rev().for_each(|d| out.extend((*d as u64).to_le_bytes()));
        out.extend(ty.to_le_bytes());
        out.extend((offset as u64).to_le_bytes());
        offset += aligned(bytes.len());
    }
    out.resize(aligned(out.len()), 0);
    for (_, _, _, bytes) in tensors {
        out.extend(bytes);
        out.resize(aligned(out.len()), 0);
    }
    std::fs::write(path, out).expect("write GGUF");
}

/// The tensor `rope_freqs.weight` llama.cpp's converter writes for HF's `llama3` RoPE scaling
/// `[factor, low_freq_factor, high_freq_factor, original_max_position_embeddings]` of heads of
/// `head_dim` with RoPE base `theta`: what each rotated pair's frequency is divided by
/// (frequencies in f32, the rest in Python's floats).
pub fn llama_cpp_rope_factors([factor, low, high, old]: [f64; 4], theta: f32, head_dim: usize) -> Vec<f32> {
    (0..head_dim / 2)
        .map(|i| {
            let freq = 1.0 / theta.powf((2 * i) as f32 / head_dim as f32);
            let wavelen = 2.0 * std::f64::consts::PI / freq as f64;
            let r = if wavelen < old / high {
                1.0
            } else if wavelen > old / low {
                factor
            } else {
                let smooth = (old / wavelen - low) / (high - low);
                1.0 / ((1.0 - smooth) / factor + smooth)
            };
            r as f32
        })
        .collect()
}

/// GPT-2's byte-level alphabet: the character that stands for each byte in a byte-level BPE
/// vocabulary (printable Latin-1 bytes as themselves, the others from U+0100 on).
pub fn byte_chars() -> Vec<char> {
    let printable =
        |b: u32| (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b);
    let mut next = 0x100;
    (0..256u32)
        .map(|b| {
            if printable(b) {
                char::from_u32(b).unwrap()
            } else {
                next += 1;
                char::from_u32(next - 1).unwrap()
            }
        })
        .collect()
}

/// Random tensors made one after another, each from the next seed.
pub struct RandomTensors {
    pub out: Vec<(String, Vec<usize>, Vec<f32>)>,
    seed: u64,
}

impl RandomTensors {
    pub fn new(seed: u64) -> Self {
        RandomTensors { out: Vec::new(), seed }
    }

    /// A tensor of `shape`, its values `rand · scale + offset` ([`rand_vec`]).
    pub fn add(&mut self, name: impl Into<String>, shape: Vec<usize>, scale: f32, offset: f32) {
        self.seed += 1;
        let v = rand_vec(shape.iter().product(), self.seed, scale).into_iter().map(|x| x + offset).collect();
        self.out.push((name.into(), shape, v));
    }
}

/// `DIR/tokenizer.json`: a word-level vocabulary of `vocab` words `t0`, `t1`, ..., split at
/// whitespace.
pub fn write_word_level_tokenizer(dir: &Path, vocab: usize) {
    let vocab_map: serde_json::Map<String, serde_json::Value> =
        (0..vocab).map(|i| (format!("t{i}"), serde_json::Value::from(i))).collect();
    let tok = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": null, "model": {"type": "WordLevel", "vocab": vocab_map, "unk_token": "t1"},
    });
    std::fs::write(dir.join("tokenizer.json"), tok.to_string()).expect("write tokenizer.json");
}

/// Writes f32 tensors to a safetensors file.
pub fn write_safetensors(path: &Path, tensors: &[(String, Vec<usize>, Vec<f32>)]) {
    let bytes: Vec<Vec<u8>> =
        tensors.iter().map(|(_, _, v)| v.iter().flat_map(|x| x.to_le_bytes()).collect()).collect();
    let views: Vec<(String, safetensors::tensor::TensorView)> = tensors
        .iter()
        .zip(&bytes)
        .map(|((n, s, _), b)| {
            let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b)
                .expect("tensor view");
            (n.clone(), view)
        })
        .collect();
    safetensors::serialize_to_file(views, None, path).expect("write safetensors");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hang_message(script: &str) -> (String, std::time::Duration) {
        let t0 = std::time::Instant::now();
        let mut cmd = Command::new("sh");
        cmd.args(["-c", script]);
        let err = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run_with_timeout(cmd, 1)))
            .expect_err("a hang must fail");
        let msg = err.downcast_ref::<String>().cloned().unwrap_or_default();
        (msg, t0.elapsed())
    }

    /// Open MPI's message as it ended a CI run (a one-rank `generate` whose rank had finished).
    const LOST_EXIT: &str = "--------------------------------------------------------------------------
mpirun has exited due to process rank 0 with PID 0 on
node vm exiting improperly. There are three reasons this could occur:
";

    #[test]
    fn only_a_lost_exit_without_an_error_of_ours_runs_again() {
        assert!(launcher_lost_an_exit(LOST_EXIT));
        assert!(!launcher_lost_an_exit(&LOST_EXIT.replace("PID 0", "PID 4711")));
        assert!(!launcher_lost_an_exit(&format!("error: rank 0: model.safetensors: truncated\n{LOST_EXIT}")));
        assert!(!launcher_lost_an_exit("error: rank 1: exiting at step 3\n"));
        // A command that fails that way runs twice: the second time it finds the mark of the
        // first and succeeds.
        let dir = tempfile::tempdir().expect("tempdir");
        let mark = dir.path().join("ran");
        let mut cmd = Command::new("sh");
        cmd.args([
            "-c",
            "if [ -e \"$1\" ]; then echo second; else touch \"$1\"; printf '%s' \"$2\" >&2; exit 1; fi",
            "sh",
        ])
        .arg(&mark)
        .arg(LOST_EXIT);
        let out = run_with_timeout(cmd, 10);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        assert_eq!(&out.stdout[..], &b"second\n"[..]);
        // Any other failure is returned as it is.
        let mut cmd = Command::new("sh");
        cmd.args(["-c", "echo 'error: rank 0: bad' >&2; exit 1"]);
        assert!(!run_with_timeout(cmd, 10).status.success());
    }

    #[test]
    fn a_hung_command_and_a_leftover_child_both_fail_at_the_deadline() {
        let (msg, took) = hang_message("sleep 60");
        assert!(msg.contains("did not finish"), "{msg}");
        assert!(took.as_secs() < 10, "{took:?}");
        let (msg, took) = hang_message("sleep 60 & echo started");
        assert!(msg.contains("left processes holding its output"), "{msg}");
        assert!(took.as_secs() < 10, "{took:?}");
        let mut ok = Command::new("sh");
        ok.args(["-c", "echo out; echo err >&2"]);
        let out = run_with_timeout(ok, 10);
        assert!(out.status.success());
        assert_eq!((&out.stdout[..], &out.stderr[..]), (&b"out\n"[..], &b"err\n"[..]));
    }
}
