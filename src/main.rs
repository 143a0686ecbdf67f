//! The `gridlm` command line. Flags are parsed and validated here into settings; the library does
//! the work. Errors print as one line on stderr with a non-zero exit.

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};
use gridlm::comm::Single;
use gridlm::config::ModelConfig;
use gridlm::engine::{Engine, GenerateOptions};
use gridlm::grid::{Grid, ShardPlan};
use gridlm::model::Shard;
use gridlm::tokenizer::{StreamDecoder, Tokenizer};
use gridlm::weights::{convert, DType};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "gridlm",
    version,
    about = "Run HuggingFace LLMs on CPUs over a grid of MPI ranks"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Generate text for a prompt (greedy decoding).
    Generate(GenerateArgs),
    /// Convert a GGUF file into a HuggingFace model folder.
    Convert(ConvertArgs),
}

#[derive(Args)]
struct GenerateArgs {
    /// HuggingFace model folder (config.json, *.safetensors, tokenizer.json).
    #[arg(long)]
    model: PathBuf,
    /// The prompt text.
    #[arg(long)]
    prompt: String,
    /// Wrap the prompt as a user message in the model's chat template.
    #[arg(long)]
    chat: bool,
    /// Maximum number of new tokens.
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// Keep generating after an end-of-sequence token.
    #[arg(long)]
    ignore_eos: bool,
    /// Kernel threads per rank (default: the cores this process may run on).
    #[arg(long)]
    threads: Option<usize>,
    /// Print one JSON object at the end instead of streaming text.
    #[arg(long)]
    json: bool,
    /// Write the logits of the last prompt position (f32, little-endian) to this file.
    #[arg(long, hide = true)]
    logits_out: Option<PathBuf>,
}

#[derive(Args)]
struct ConvertArgs {
    /// GGUF file to read.
    #[arg(long)]
    gguf: PathBuf,
    /// Folder to create.
    #[arg(long)]
    out: PathBuf,
    /// Dtype of the written weight matrices (norms stay f32).
    #[arg(long, default_value = "bf16", value_parser = parse_dtype)]
    dtype: DType,
}

fn parse_dtype(s: &str) -> Result<DType, String> {
    DType::parse(s).ok_or_else(|| format!("unknown dtype `{s}` (expected f32, bf16 or f16)"))
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.cmd {
        Cmd::Generate(a) => generate(a),
        Cmd::Convert(a) => run_convert(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let _ = std::io::stdout().flush();
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run_convert(a: ConvertArgs) -> Result<()> {
    let s = convert::convert(&a.gguf, &a.out, a.dtype)?;
    eprintln!(
        "wrote {} ({} tensors, {:.1} MB of weights in {})",
        a.out.display(),
        s.n_tensors,
        s.bytes as f64 / 1e6,
        a.dtype.name()
    );
    Ok(())
}

/// Cores this process may run on (its affinity mask).
fn default_threads() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

/// Resident set size of this process, from /proc.
fn rss_bytes() -> usize {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<usize>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

fn write_f32_file(path: &Path, v: &[f32]) -> Result<()> {
    let tmp = path.with_extension("partial");
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    std::fs::write(&tmp, bytes).with_context(|| format!("{}: cannot write", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("{}: cannot write", path.display()))?;
    Ok(())
}

fn generate(a: GenerateArgs) -> Result<()> {
    let threads = a.threads.unwrap_or_else(default_threads);
    if threads == 0 {
        anyhow::bail!("--threads must be at least 1");
    }
    let cfg = ModelConfig::from_dir(&a.model)?;
    let tok = Tokenizer::from_dir(&a.model)?;
    let text = if a.chat {
        tok.apply_chat_template(&a.prompt)?
    } else {
        a.prompt.clone()
    };
    let prompt_ids = tok.encode(&text, !a.chat)?;
    let grid = Grid::single();
    let plan = ShardPlan::new(&cfg, &grid, None)?;
    let mut eos_ids = cfg.eos_token_ids.clone();
    if let Some(id) = tok.eos_id() {
        if !eos_ids.contains(&id) {
            eos_ids.push(id);
        }
    }
    let shard = Shard::load(&a.model, cfg, plan)?;
    let weight_bytes = shard.weight_bytes();
    let mut engine = Engine::new(shard, threads)?;
    let opts = GenerateOptions {
        max_tokens: a.max_tokens,
        ignore_eos: a.ignore_eos,
        eos_ids,
        keep_prompt_logits: a.logits_out.is_some(),
    };
    let mut stream = StreamDecoder::default();
    let mut stdout = std::io::stdout().lock();
    let stream_text = !a.json;
    let g = engine.generate(&prompt_ids, &opts, &Single, |id| {
        if stream_text {
            if let Some(piece) = stream.push(&tok, id)? {
                let _ = stdout.write_all(piece.as_bytes());
                let _ = stdout.flush();
            }
        }
        Ok(())
    })?;
    if let (Some(path), Some(l)) = (&a.logits_out, &g.prompt_logits) {
        write_f32_file(path, l)?;
    }
    let text = tok.decode(&g.token_ids)?;
    if a.json {
        let out = serde_json::json!({
            "prompt_token_ids": prompt_ids,
            "token_ids": g.token_ids,
            "text": text,
            "finish_reason": g.finish,
            "prefill_ms": g.prefill_ms,
            "decode_tokens_per_s": g.decode_tokens_per_s(),
            "threads": engine.threads(),
            "weight_dtype": engine.shard.weight_dtype(),
            "ranks": [{
                "rank": 0, "stage": 0, "tp": 0,
                "weight_bytes": weight_bytes,
                "rss_bytes": rss_bytes(),
            }],
        });
        writeln!(stdout, "{out}")?;
    } else {
        writeln!(stdout)?;
        eprintln!(
            "[{} prompt tokens, {} new tokens ({:?}), prefill {:.1} ms, decode {:.1} tokens/s]",
            prompt_ids.len(),
            g.token_ids.len(),
            g.finish,
            g.prefill_ms,
            g.decode_tokens_per_s()
        );
    }
    Ok(())
}
