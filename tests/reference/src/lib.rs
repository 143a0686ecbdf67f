//! Helpers for the parity tests: finding the gridlm binary and the real model, running gridlm,
//! and reading what it wrote. The reference implementation itself (candle-transformers) is used
//! only from the tests, so a normal build of gridlm never compiles it.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Root of the gridlm repository.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .expect("repo root")
}

/// The `gridlm` binary built by the same `cargo test` run (it sits in the profile directory
/// above this test's `deps/` directory), or `$GRIDLM_BIN`.
pub fn gridlm_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("GRIDLM_BIN") {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().expect("current_exe");
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target/<profile>");
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
    let out = Command::new(repo_root().join("launch/get-model"))
        .arg(dtype)
        .env("GRIDLM_BIN", gridlm_bin())
        .output()
        .expect("run launch/get-model");
    assert!(
        out.status.success(),
        "launch/get-model {dtype} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).expect("utf8");
    PathBuf::from(
        stdout
            .lines()
            .last()
            .expect("get-model printed the folder")
            .trim(),
    )
}

/// What one `gridlm generate --json --logits-out` run gave.
pub struct Run {
    pub json: serde_json::Value,
    pub prompt_ids: Vec<u32>,
    pub token_ids: Vec<u32>,
    pub logits: Vec<f32>,
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .expect("id array")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

/// Runs `gridlm generate --json --ignore-eos --logits-out … <args>` on one rank.
pub fn generate(model: &Path, args: &[&str]) -> Run {
    let dir = tempfile::tempdir().expect("tempdir");
    let logits_path = dir.path().join("logits.f32");
    let out = Command::new(gridlm_bin())
        .arg("generate")
        .arg("--model")
        .arg(model)
        .args(["--json", "--ignore-eos", "--logits-out"])
        .arg(&logits_path)
        .args(args)
        .output()
        .expect("run gridlm");
    assert!(
        out.status.success(),
        "gridlm generate {args:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("gridlm printed JSON");
    let bytes = std::fs::read(&logits_path).expect("logits file");
    let logits = bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    Run {
        prompt_ids: ids(&json["prompt_token_ids"]),
        token_ids: ids(&json["token_ids"]),
        json,
        logits,
    }
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "logit vectors differ in length");
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
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
