mod bad_input;
mod batch;
mod bench;
mod convert;
mod generate;
mod grid;
mod inspect;
mod quant;
mod scale;
mod serve;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub fn bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_gridlm"))
}

/// One gridlm process without a launcher; a run that hangs fails the test after ten minutes.
pub fn gridlm(args: &[&str]) -> Output {
    let mut cmd = Command::new(bin());
    cmd.args(args);
    gridlm_reference::run_with_timeout(cmd, 600)
}

/// Asserts a failed run reported exactly one `error:` line containing every fragment, with a
/// non-zero exit and no panic.
#[track_caller]
pub fn assert_one_line_error(out: &Output, fragments: &[&str]) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "expected failure, got success; stderr:\n{stderr}");
    assert_eq!(out.status.code(), Some(1), "exit code; stderr:\n{stderr}");
    assert!(!stderr.contains("panicked"), "panic instead of an error:\n{stderr}");
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "expected one error line, got:\n{stderr}");
    assert!(lines[0].starts_with("error: "), "{stderr}");
    for f in fragments {
        assert!(lines[0].contains(f), "error line lacks `{f}`:\n{stderr}");
    }
}

/// A fresh tiny Llama folder in a temp dir.
pub fn tiny_llama() -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("model");
    std::fs::create_dir(&dir).unwrap();
    gridlm_reference::TinyModel::llama().write(&dir);
    (tmp, dir)
}

pub fn path_str(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

/// The real SmolLM2 folder in `dtype`, fetched and converted on first use.
pub fn smollm2(dtype: &str) -> PathBuf {
    std::env::set_var("GRIDLM_BIN", bin());
    gridlm_reference::smollm2(dtype)
}

/// A greedy request for `max_tokens` new tokens past any EOS, keeping the prompt's logits if
/// asked.
pub fn greedy_request(prompt: Vec<u32>, max_tokens: usize, keep_logits: bool) -> gridlm::engine::Request {
    gridlm::engine::Request {
        prompt,
        max_tokens,
        ignore_eos: true,
        params: Default::default(),
        keep_logits,
        logprobs: None,
        prompt_logprobs: None,
        rules: Default::default(),
        format: None,
        grammar: None,
        embed: None,
    }
}

/// An in-process single-rank engine on `dir` (2 kernel threads, f16 KV cache).
pub fn local_engine(dir: &Path, quant: Option<gridlm::kernels::Quant>) -> gridlm::engine::Engine {
    local_engine_on(dir, quant, 2)
}

/// [`local_engine`] on `threads` kernel threads.
pub fn local_engine_on(
    dir: &Path,
    quant: Option<gridlm::kernels::Quant>,
    threads: usize,
) -> gridlm::engine::Engine {
    use gridlm::{config::ModelConfig, grid::Grid, grid::ShardPlan, model::Shard};
    let cfg = ModelConfig::from_dir(dir).unwrap();
    let grid = Grid::single();
    let plan = ShardPlan::new(&cfg, &grid, None).unwrap();
    let shard = Shard::load(dir, cfg, plan, quant).unwrap();
    gridlm::engine::Engine::new(shard, grid, threads, gridlm::weights::DType::F16).unwrap()
}

/// A folder of links to the files of model folder `dir`, but those named in `except`.
pub fn linked_copy(dir: &Path, except: &[&str]) -> tempfile::TempDir {
    let copy = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(dir).unwrap() {
        let e = e.unwrap();
        if !except.iter().any(|x| e.file_name() == *x) {
            std::os::unix::fs::symlink(e.path(), copy.path().join(e.file_name())).unwrap();
        }
    }
    copy
}

/// A copy of model folder `dir` (its other files linked) whose tokenizer has special tokens 3,
/// 4 and 5 (SmolLM2's `<repo_name>`, `<reponame>`, `<file_sep>`) as the tool-call tags some
/// models have as special tokens: `<tool_call>`, `</tool_call>` (Hermes 3), `<|python_tag|>`
/// (Llama 3).
pub fn with_special_tags(dir: &Path) -> tempfile::TempDir {
    let copy = linked_copy(dir, &["tokenizer.json"]);
    let mut t: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("tokenizer.json")).unwrap()).unwrap();
    for (id, tag) in [(3, "<tool_call>"), (4, "</tool_call>"), (5, "<|python_tag|>")] {
        let added = &mut t["added_tokens"][id];
        assert_eq!((added["id"].as_u64(), added["special"].as_bool()), (Some(id as u64), Some(true)));
        let was = added["content"].as_str().unwrap().to_string();
        added["content"] = serde_json::json!(tag);
        let vocab = t["model"]["vocab"].as_object_mut().unwrap();
        assert_eq!(vocab.remove(&was), Some(serde_json::json!(id)));
        vocab.insert(tag.to_string(), serde_json::json!(id));
    }
    std::fs::write(copy.path().join("tokenizer.json"), t.to_string()).unwrap();
    copy
}
