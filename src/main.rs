//! The `gridlm` command line. Flags are parsed and validated here into settings; the library does
//! the work. Errors print as one line on stderr with a non-zero exit.

use anyhow::{Context, Result};
use clap::{ArgGroup, Args, CommandFactory, Parser, Subcommand};
use gridlm::bench::{
    decode_window, gb_per_s_around_runs, kv_positions_per_layer_token, mean_around_runs, percentile,
    prefill_flops, run_gb_per_s, tokens_digest, Alternated, Baseline, BenchReport, DecodeFigures, Measured,
    RankReport,
};
use gridlm::comm::mpi::{launched_by_mpirun, MpiJob};
use gridlm::comm::{Comm, Link, Single};
use gridlm::config::ModelConfig;
use gridlm::engine::sampling::{SamplingParams, TokenRules};
use gridlm::engine::{
    check_prompt, Completion, Engine, Pooling, PrefetchBy, Request, RunOptions, StepProfile,
};
use gridlm::grammar::{Format, Grammars};
use gridlm::grid::{Grid, ShardPlan};
use gridlm::kernels::{dot, Fetch, ManyFetch, Quant, Streams};
use gridlm::model::Shard;
use gridlm::prompts::{read_prompts, Defaults, PromptSpec, StopBy, TextTracker};
use gridlm::tokenizer::{check_template_vars, TemplateVars, Tokenizer};
use gridlm::tools::Reader;
use gridlm::weights::checkpoint::Checkpoint;
use gridlm::weights::{as_loaded, convert, synthetic, DType, Source};
use gridlm::{count, host};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// Counts heap allocations, so `bench` can show how many a decode step makes (none).
#[global_allocator]
static ALLOCATOR: gridlm::allocs::Counting = gridlm::allocs::Counting;

#[derive(Parser)]
#[command(name = "gridlm", version, about = "Run HuggingFace LLMs on CPUs over a grid of MPI ranks")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Generate text for a prompt, or for a file of prompts run together.
    Generate(GenerateArgs),
    /// Convert a GGUF file into a HuggingFace model folder.
    Convert(ConvertArgs),
    /// Measure latency, throughput, bandwidth and compute against the machine's own limits.
    Bench(BenchArgs),
    /// Turn `bench --json` results of several layouts into a scaling table and plot.
    Report(ReportArgs),
    /// Predict memory and speed of every layout on a cluster, from a stated cost model.
    Plan(PlanArgs),
    /// What a model folder holds and how a grid would split it, without reading a weight.
    Inspect(InspectArgs),
    /// Answer OpenAI-style completion requests over HTTP, each joining the running batch as
    /// it comes (continuous batching).
    Serve(ServeArgs),
}

#[derive(Args)]
struct ServeArgs {
    /// HuggingFace model folder (config.json, *.safetensors, tokenizer.json).
    #[arg(long)]
    model: PathBuf,
    /// Address to listen on, `HOST:PORT` (port 0: a free one; the address is printed).
    #[arg(long, default_value = "127.0.0.1:8000")]
    listen: String,
    /// The model's name in answers and in /v1/models (default: the folder's name).
    #[arg(long)]
    name: Option<String>,
    /// New tokens of a request that does not say (`max_tokens`).
    #[arg(long, default_value_t = 256)]
    max_tokens: usize,
    /// Completion requests answered at once (running or waiting for a slot or KV memory);
    /// more get status 429.
    #[arg(long, default_value_t = 256)]
    max_in_flight: usize,
    /// Requests must bring `Authorization: Bearer KEY` (all but /health); default: the
    /// environment's GRIDLM_API_KEY, else none needed.
    #[arg(long, env = "GRIDLM_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Further variables of the chat template for chat requests, a JSON object (a request's
    /// `chat_template_kwargs` go over them): `{"enable_thinking": false}`, say.
    #[arg(long, value_name = "JSON", value_parser = parse_template_vars)]
    chat_template_kwargs: Option<TemplateVars>,
    /// A web origin (`http://localhost:3000`) whose pages may call the server from a browser
    /// (CORS); again for more, `null` for pages opened from files, `*` for any. Default: none.
    #[arg(long = "allow-origin", value_name = "ORIGIN", value_parser = gridlm::serve::origin)]
    allow_origins: Vec<String>,
    /// How calls are read from the text of a chat answer that may call the request's tools or
    /// not (`tool_choice` auto, the default where a request gives `tools`): `hermes`,
    /// `<tool_call>{...}</tool_call>` (Qwen2.5, Qwen3, Hermes); `llama3_json`, an answer that
    /// is `{"name": ..., "parameters": ...}` (Llama 3.1–3.3). Without it such requests are
    /// refused; `required` and a tool by name need none.
    #[arg(long, value_name = "PARSER")]
    tool_call_parser: Option<gridlm::tools::Parser>,
    /// How /v1/embeddings pools a prompt's last hidden states (after the final norm): from its
    /// last position, the mean of its positions, or its first (default: as the model folder's
    /// sentence-transformers modules.json says, else last)
    #[arg(long, value_name = "POOLING")]
    pooling: Option<Pooling>,
    /// Sampling settings of a request that does not give them; request i's seed is seed + i.
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Start from the folder's generation_config.json sampling settings (as for generate).
    #[arg(long)]
    model_sampling: bool,
    #[command(flatten)]
    batching: BatchArgs,
    #[command(flatten)]
    engine: EngineArgs,
    #[command(flatten)]
    grid: GridArgs,
}

#[derive(Args)]
struct InspectArgs {
    /// HuggingFace model folder (config.json, and the safetensors headers: every tensor a rank
    /// would read is looked up by name, shape and dtype).
    #[arg(long)]
    model: PathBuf,
    /// Pipeline stages.
    #[arg(long, default_value_t = 1)]
    pp: usize,
    /// Tensor-parallel ranks per stage.
    #[arg(long, default_value_t = 1)]
    tp: usize,
    /// Layers per stage, e.g. `16,14` (default: as generate and bench split them).
    #[arg(long, value_delimiter = ',')]
    layers: Option<Vec<usize>>,
    /// Weight matrices converted to this dtype at load (as for generate and bench).
    #[arg(long, value_parser = parse_dtype)]
    dtype: Option<DType>,
    /// Weights quantized at load: `int8` (as for generate and bench).
    #[arg(long, value_parser = parse_quant)]
    quant: Option<Quant>,
    /// Print one JSON object instead of the text.
    #[arg(long)]
    json: bool,
}

/// The sequences a benchmark runs (or a plan predicts).
#[derive(Args)]
struct WorkloadArgs {
    /// Prompt tokens (random ids) of each sequence.
    #[arg(long, default_value_t = 128)]
    prompt_len: usize,
    /// Tokens generated per sequence (the first comes from the prompt).
    #[arg(long, default_value_t = 64)]
    new_tokens: usize,
    /// Sequences decoded together: each micro-batch's prompts in one prefill step, then one
    /// token of each per step, so each step reads the weights once for its sequences.
    #[arg(long, default_value_t = 1)]
    batch: usize,
}

impl WorkloadArgs {
    /// What bench asks of its workload before running it; plan predicts the same workload, so
    /// it asks the same.
    fn check(&self) -> Result<()> {
        at_least(&[
            ("--prompt-len", self.prompt_len, 1),
            ("--new-tokens", self.new_tokens, 2),
            ("--batch", self.batch, 1),
        ])
    }

    /// Every sequence must reach all its positions within the model's context, or bench's
    /// figures would count tokens that were never made.
    fn check_context(&self, cfg: &ModelConfig) -> gridlm::Result<()> {
        check_prompt(self.prompt_len, cfg.max_position_embeddings)?;
        let positions = self.prompt_len + self.new_tokens;
        if positions > cfg.max_position_embeddings {
            return Err(gridlm::Error::Input(format!(
                "--prompt-len {} + --new-tokens {} = {positions} positions, but the model's context holds {} (its max_position_embeddings)",
                self.prompt_len, self.new_tokens, cfg.max_position_embeddings
            )));
        }
        Ok(())
    }
}

#[derive(Args)]
struct PlanArgs {
    /// HuggingFace model folder (only config.json is read).
    #[arg(long, conflicts_with = "shape", required_unless_present = "shape")]
    model: Option<PathBuf>,
    /// A named model shape (as for bench).
    #[arg(long)]
    shape: Option<String>,
    /// Weight dtype: f32, bf16, f16 (or int8 with --quant int8); default: a --model folder's
    /// as stored (as generate loads it), bf16 for a --shape.
    #[arg(long, value_parser = parse_dtype)]
    dtype: Option<DType>,
    /// Weights quantized at load: `int8` (as for generate and bench).
    #[arg(long, value_parser = parse_quant)]
    quant: Option<Quant>,
    /// Element type of the KV cache: f32, bf16, f16.
    #[arg(long, default_value = "f16", value_parser = parse_dtype)]
    kv_dtype: DType,
    /// Nodes of the cluster.
    #[arg(long, default_value_t = 1)]
    nodes: usize,
    /// Sockets of each node; one memory and one set of cores each.
    #[arg(long, default_value_t = 1)]
    sockets_per_node: usize,
    /// MPI ranks per socket, sharing its bandwidth and cores.
    #[arg(long, default_value_t = 1)]
    ranks_per_socket: usize,
    /// Read bandwidth of one socket, GB/s (`bench --limits` measures it).
    #[arg(long, required_unless_present = "limits")]
    mem_bw: Option<f64>,
    /// f32 FMA peak of one socket, GFLOP/s (`bench --limits` measures it).
    #[arg(long, required_unless_present = "limits")]
    peak_gflops: Option<f64>,
    /// bf16 dot-product peak of one socket, GFLOP/s, where its CPU has AVX512_BF16 (`bench
    /// --limits` measures it there): bf16 weights compute at this rate instead of the f32 peak.
    #[arg(long)]
    bf16_peak_gflops: Option<f64>,
    /// Read bandwidth of one core reading alone, GB/s (`bench --limits` measures it): a rank
    /// whose stage takes its turn while the others wait reads at most this × its cores, more
    /// than its share of the socket's. Needs --cores-per-socket (or --limits).
    #[arg(long)]
    core_gbps: Option<f64>,
    /// Cores of one socket, shared evenly among its ranks.
    #[arg(long)]
    cores_per_socket: Option<usize>,
    /// Take --mem-bw, --peak-gflops, --bf16-peak-gflops (where measured), --core-gbps and
    /// --cores-per-socket (the threads it was measured with) from this `bench --limits --json`
    /// output (run on one socket with its cores); the flags win where given.
    #[arg(long)]
    limits: Option<PathBuf>,
    /// Memory of one socket, GB: each layout then says whether it fits (default: not known).
    #[arg(long, default_value_t = 0.0)]
    mem_gb: f64,
    /// Network bandwidth between nodes, Gbit/s.
    #[arg(long, default_value_t = 10.0)]
    net_gbps: f64,
    /// One network message's latency between nodes, µs.
    #[arg(long, default_value_t = 50.0)]
    net_latency_us: f64,
    /// One shared-memory message's latency inside a node, µs.
    #[arg(long, default_value_t = 10.0)]
    local_latency_us: f64,
    /// Shared-memory copy bandwidth inside a node, GB/s.
    #[arg(long, default_value_t = 5.0)]
    local_gb_per_s: f64,
    #[command(flatten)]
    work: WorkloadArgs,
    /// One JSON object (a list of layouts) instead of the table.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct ReportArgs {
    /// `bench --json` outputs, named `PPxTP[@placement].json` (as `launch/scale` writes them).
    #[arg(required = true)]
    runs: Vec<PathBuf>,
    /// Draw tokens/s and parallel efficiency against ranks into this SVG file.
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Title of the plot.
    #[arg(long, default_value = "gridlm scaling")]
    title: String,
}

#[derive(Args)]
#[command(group(ArgGroup::new("input").required(true).args(["prompt", "prompts_file"])))]
struct GenerateArgs {
    /// HuggingFace model folder (config.json, *.safetensors, tokenizer.json).
    #[arg(long)]
    model: PathBuf,
    /// The prompt text.
    #[arg(long)]
    prompt: Option<String>,
    /// A file of prompts generated together: one per line (`\n` for a newline), or JSONL
    /// objects with `prompt` (or a conversation, `messages`, as in OpenAI's chat requests) and
    /// optional `id`, `max_tokens`, `ignore_eos`, `chat`, `system`, `stop`, `temperature`,
    /// `top_k`, `top_p`, `min_p`, `repetition_penalty`, `presence_penalty`,
    /// `frequency_penalty`, `seed`, `min_tokens`, `stop_token_ids`, `logit_bias`,
    /// `response_format` (or vLLM's `structured_outputs`, `guided_json`, `guided_regex`,
    /// `guided_choice`, `guided_grammar`), a conversation's `tools`, `tool_choice` and
    /// `parallel_tool_calls`; or lines of OpenAI's batch input. `-` reads standard input.
    #[arg(long)]
    prompts_file: Option<PathBuf>,
    /// How calls are read from the answers of prompts-file conversations with tools whose tool
    /// choice is `auto` (as serve's --tool-call-parser)
    #[arg(long, value_name = "PARSER", requires = "prompts_file")]
    tool_call_parser: Option<gridlm::tools::Parser>,
    /// Wrap the prompt as a user message in the model's chat template.
    #[arg(long)]
    chat: bool,
    /// A system message before the prompt in the chat template (with --chat).
    #[arg(long, requires = "chat")]
    system: Option<String>,
    /// Further variables of the chat template, a JSON object, as HF's apply_chat_template
    /// takes them (`{"enable_thinking": false}`: Qwen3's and SmolLM3's answers without
    /// thinking first).
    #[arg(long, value_name = "JSON", value_parser = parse_template_vars)]
    chat_template_kwargs: Option<TemplateVars>,
    /// Maximum number of new tokens.
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// Keep generating after an end-of-sequence token.
    #[arg(long)]
    ignore_eos: bool,
    /// End a completion when this text appears (repeatable); the text is cut before it.
    #[arg(long)]
    stop: Vec<String>,
    /// Keep the stop string (or stop token) that ends a completion in its text (vLLM's
    /// include_stop_str_in_output).
    #[arg(long)]
    include_stop_str_in_output: bool,
    /// End a completion when one of these tokens is picked (ids, comma-separated or repeated;
    /// vLLM's stop_token_ids): it finishes as stopped, the token left out of its text.
    #[arg(long, value_name = "ID,...", value_delimiter = ',')]
    stop_token_ids: Vec<u32>,
    /// Bring at least N tokens before a completion may end: until then its end-of-sequence and
    /// stop tokens are never picked and no stop string ends it (vLLM's min_tokens).
    #[arg(long, value_name = "N", default_value_t = 0)]
    min_tokens: usize,
    /// Biases added to tokens' logits before they are picked, OpenAI's logit_bias: a JSON
    /// object of token ids and biases from -100 to 100 (`'{"198": -100}'` all but bans token
    /// 198; 100 all but forces it).
    #[arg(long, value_name = "JSON", value_parser = parse_logit_bias)]
    logit_bias: Option<LogitBias>,
    /// Structured output, OpenAI's response_format: `'{"type": "json_object"}'` holds the answer
    /// to a JSON object, `'{"type": "json_schema", "json_schema": {"schema": {...}}}'` to JSON
    /// its schema takes (llguidance's grammar engine picks the tokens that may come next).
    #[arg(long, value_name = "JSON", value_parser = parse_response_format)]
    response_format: Option<ResponseFormat>,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Sample as the model folder's generation_config.json says (do_sample, temperature,
    /// top_p, top_k, min_p, repetition_penalty, as HF's generate reads them), but for the
    /// settings given here.
    #[arg(long)]
    model_sampling: bool,
    #[command(flatten)]
    batching: BatchArgs,
    #[command(flatten)]
    engine: EngineArgs,
    /// Print one JSON object at the end instead of streaming text.
    #[arg(long)]
    json: bool,
    /// With --json: each new token's log-probability under the model (the log-softmax of its
    /// logits, before any repetition penalty or temperature) and the N most likely tokens' at
    /// its position (0 to 20)
    #[arg(long, value_name = "N", requires = "json", value_parser = clap::value_parser!(u64).range(0..=20))]
    logprobs: Option<u64>,
    /// With --json: the log-probability of each prompt token after the first, given those
    /// before it, and the N most likely tokens' at its position (0 to 20). With --max-tokens 0
    /// the prompt is only scored
    #[arg(long, value_name = "N", requires = "json", value_parser = clap::value_parser!(u64).range(0..=20))]
    prompt_logprobs: Option<u64>,
    /// With --json: each prompt's embedding (`embedding`: its last hidden states, after the
    /// final norm, pooled from its last position, the mean of its positions, or its first)
    /// instead of new tokens
    #[arg(long, value_name = "POOLING", requires = "json", conflicts_with_all = ["logprobs", "prompt_logprobs"])]
    embed: Option<Pooling>,
    /// With --embed: each embedding scaled to length 1 (as `serve`'s /v1/embeddings gives them)
    #[arg(long, requires = "embed")]
    normalize: bool,
    #[command(flatten)]
    grid: GridArgs,
    /// Write the logits of the last prompt position (f32, little-endian) to this file.
    #[arg(long, hide = true)]
    logits_out: Option<PathBuf>,
}

/// How each rank runs its shard (generate and bench).
#[derive(Args)]
struct EngineArgs {
    /// Kernel threads per rank (default: the cores this process may run on).
    #[arg(long)]
    threads: Option<usize>,
    /// Element type of the KV cache: f16 halves its memory and the bytes attention reads.
    #[arg(long, default_value = "f16", value_parser = parse_dtype)]
    kv_dtype: DType,
    /// Weight dtype: the checkpoint's matrices converted to f32, bf16 or f16 at load (default:
    /// as stored; bf16 halves what an f32 checkpoint reads a token); for bench's --shape, the
    /// random weights' (default bf16).
    #[arg(long, value_parser = parse_dtype)]
    dtype: Option<DType>,
    /// Quantize the weight matrices at load: `int8` (per output row; half the bytes of bf16).
    #[arg(long, value_parser = parse_quant)]
    quant: Option<Quant>,
}

impl EngineArgs {
    /// The folder `model`'s weights as this rank reads them: as stored, or their matrices
    /// converted to `--dtype`.
    fn source(&self, model: &Path) -> gridlm::Result<Box<dyn Source>> {
        Ok(as_loaded(Checkpoint::open(model)?, self.dtype, model))
    }

    /// Kernel threads per rank: as asked, else the cores this process may run on.
    fn threads(&self) -> usize {
        self.threads.unwrap_or_else(default_threads)
    }

    fn check(&self) -> Result<()> {
        at_least(&[("--threads", self.threads.unwrap_or(1), 1)])
    }

    /// Warns (once a node: from its first rank) when `--threads` asks for more kernel threads
    /// than this rank has cores: its threads then take turns on them, several times slower.
    /// Called once the threads have started, so that bad input before it stays one line.
    fn warn_if_oversubscribed(&self) {
        let (Some(asked), cores) = (self.threads, default_threads()) else { return };
        if asked > cores && gridlm::comm::mpi::local_rank() == 0 {
            let line = format!(
                "warning: --threads {asked} is more than the {cores} core(s) each rank here has; \
                 kernel threads will take turns on them, several times slower\n"
            );
            let _ = std::io::stderr().write_all(line.as_bytes());
        }
    }
}

/// How tokens are picked.
#[derive(Args)]
struct SamplingArgs {
    // Negative values reach the checks below and get their message (a bare `-1` would
    // otherwise read as an unknown option).
    /// Sampling temperature; 0 (the default) picks the most likely token.
    #[arg(long, allow_negative_numbers = true)]
    temperature: Option<f32>,
    /// Sample among the k most likely tokens only (0, the default: all).
    #[arg(long, allow_negative_numbers = true)]
    top_k: Option<usize>,
    /// Sample among the fewest most likely tokens whose probability reaches p (1, the default:
    /// all).
    #[arg(long, allow_negative_numbers = true)]
    top_p: Option<f32>,
    /// Sample among tokens at least this fraction as likely as the most likely one (0, the
    /// default: all).
    #[arg(long, allow_negative_numbers = true)]
    min_p: Option<f32>,
    /// Penalty on tokens already in the sequence (1, the default: none; 1.1–1.3 is usual).
    #[arg(long, allow_negative_numbers = true)]
    repetition_penalty: Option<f32>,
    /// Subtracted from the logit of every token already generated (-2 to 2; 0, the default:
    /// none), as OpenAI's presence_penalty.
    #[arg(long, allow_negative_numbers = true)]
    presence_penalty: Option<f32>,
    /// Subtracted from a token's logit once for each time it was generated (-2 to 2; 0, the
    /// default: none), as OpenAI's frequency_penalty.
    #[arg(long, allow_negative_numbers = true)]
    frequency_penalty: Option<f32>,
    /// Seed of the sampling draws (default: from the clock, printed with --json). The same
    /// seed gives the same tokens on any number of pipeline stages and kernel threads; tensor
    /// parallelism sums in another order, so its draws may part where two tokens nearly tie.
    /// Prompt i of a prompts file uses seed + i unless its line sets one.
    #[arg(long, allow_negative_numbers = true)]
    seed: Option<u64>,
}

impl SamplingArgs {
    /// The settings given, the others those of the model folder `model`'s generation_config.json
    /// where `from_model` (`--model-sampling`), else the defaults (greedy).
    fn params_over_model(&self, model: &Path, from_model: bool) -> Result<SamplingParams> {
        let base = if from_model {
            gridlm::engine::sampling::from_generation_config(&model.join("generation_config.json"))?
        } else {
            SamplingParams::default()
        };
        self.params(&base)
    }

    /// The settings given, the others `base`'s.
    fn params(&self, base: &SamplingParams) -> Result<SamplingParams> {
        let seed = self.seed.unwrap_or_else(|| {
            let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
            t.as_nanos() as u64 ^ (std::process::id() as u64) << 32
        });
        let p = SamplingParams {
            temperature: self.temperature.unwrap_or(base.temperature),
            top_k: self.top_k.unwrap_or(base.top_k),
            top_p: self.top_p.unwrap_or(base.top_p),
            min_p: self.min_p.unwrap_or(base.min_p),
            repetition_penalty: self.repetition_penalty.unwrap_or(base.repetition_penalty),
            presence_penalty: self.presence_penalty.unwrap_or(base.presence_penalty),
            frequency_penalty: self.frequency_penalty.unwrap_or(base.frequency_penalty),
            seed,
        };
        p.check().map_err(|e| anyhow::anyhow!("--{}", e.replacen('_', "-", 1)))?;
        Ok(p)
    }
}

/// How the running sequences are grouped for the pipeline (generate and bench).
#[derive(Args)]
struct OverlapArgs {
    /// Groups of sequences stepped separately, so pipeline stages work on different groups at
    /// once (default: the number of pipeline stages).
    #[arg(long)]
    micro_batches: Option<usize>,
    /// One step in flight at a time with every running sequence in it: no pipeline overlap.
    #[arg(long)]
    no_overlap: bool,
}

impl OverlapArgs {
    /// Micro-batches on a grid of `pp` stages: as asked, else one per stage with overlap and
    /// one without.
    fn micro_batches(&self, pp: usize) -> usize {
        self.micro_batches.unwrap_or(if self.no_overlap { 1 } else { pp })
    }

    fn check(&self) -> Result<()> {
        at_least(&[("--micro-batches", self.micro_batches.unwrap_or(1), 1)])
    }
}

/// How many sequences run together and how steps are formed.
#[derive(Args)]
struct BatchArgs {
    /// Sequences running at once; further prompts wait for a free slot (continuous batching).
    #[arg(long, default_value_t = 8)]
    max_batch: usize,
    #[command(flatten)]
    overlap: OverlapArgs,
    /// Most tokens in one step; longer prompts are prefilled in chunks between decode steps.
    #[arg(long, default_value_t = 512)]
    step_tokens: usize,
    /// KV cache memory per rank, in MiB (default: what max-batch of the prompts need at full
    /// length, within a quarter of the memory available; given, at most this, and with the
    /// prefix cache up to this: what running sequences leave keeps prefixes, within a quarter of
    /// the memory or what max-batch of the prompts need). Prompts wait for room; one that can
    /// never fit gets its own error.
    #[arg(long)]
    kv_mem_mib: Option<usize>,
    /// Run every prompt whole: keep no KV pages of ended sequences for prompts that begin with
    /// the same tokens (the prefix cache).
    #[arg(long)]
    no_prefix_cache: bool,
    /// Speculative decoding by prompt lookup: up to N draft tokens a step for each sequence,
    /// copied from what followed the latest earlier occurrence of its last tokens in its
    /// prompt and output, and checked by the model in the same step. The tokens are those
    /// decoded without (sampled and penalized ones too); faster where the output repeats its
    /// context (summaries, edits, code, quotes). 0 (the default): none; at most 64
    #[arg(long, value_name = "N", default_value_t = 0, value_parser = clap::value_parser!(u16).range(0..=64))]
    speculate: u16,
}

impl BatchArgs {
    fn options(&self, pp: usize, eos_ids: Vec<u32>) -> RunOptions {
        RunOptions {
            max_batch: self.max_batch,
            micro_batches: self.overlap.micro_batches(pp),
            overlap: !self.overlap.no_overlap,
            step_tokens: self.step_tokens,
            kv_bytes: self.kv_mem_mib.map(|m| m.saturating_mul(1 << 20)),
            eos_ids,
            read_between_steps: false,
            sides: None,
            prefix_cache: !self.no_prefix_cache,
            speculate: self.speculate.into(),
            grammars: None,
        }
    }

    fn check(&self) -> Result<()> {
        at_least(&[("--max-batch", self.max_batch, 1), ("--step-tokens", self.step_tokens, 1)])?;
        self.overlap.check()
    }
}

/// How the model is split over the ranks of the job.
#[derive(Args)]
struct GridArgs {
    /// Pipeline stages (default 1).
    #[arg(long)]
    pp: Option<usize>,
    /// Tensor-parallel ranks per stage (default: the number of ranks / pp).
    #[arg(long)]
    tp: Option<usize>,
    /// Layers per stage, e.g. `16,14` (default: equal weight bytes per decode step, the last
    /// stage counting the output head).
    #[arg(long, value_delimiter = ',')]
    layers: Option<Vec<usize>>,
}

#[derive(Args)]
struct BenchArgs {
    /// HuggingFace model folder to benchmark.
    #[arg(long, conflicts_with = "shape", required_unless_present_any = ["shape", "limits"])]
    model: Option<PathBuf>,
    /// A named model shape with seeded random weights, generated per shard (no files):
    /// smollm2-135m, qwen2-0.5b, qwen3-0.6b, gemma2-2b, gemma3-1b, gemma3-4b, llama-3.2-1b,
    /// smollm3-3b, olmo2-1b, llama-2-7b, llama-3-8b, llama-2-70b, falcon-7b, pythia-1.4b,
    /// gpt2-xl, starcoderbase-1b, and the mixtures of experts qwen1.5-moe-a2.7b, qwen3-30b-a3b
    /// and mixtral-8x7b.
    #[arg(long)]
    shape: Option<String>,
    /// Only the first N layers of the --shape model: a slice of a model too large for the
    /// machine, its layers read as the whole model's are (the output head whole).
    #[arg(long)]
    shape_layers: Option<usize>,
    #[command(flatten)]
    work: WorkloadArgs,
    /// Unmeasured sequences before the measured ones.
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Measured sequences.
    #[arg(long, default_value_t = 3)]
    reps: usize,
    #[command(flatten)]
    engine: EngineArgs,
    #[command(flatten)]
    overlap: OverlapArgs,
    /// Most tokens in one step (default: every prompt of a micro-batch in one step).
    #[arg(long)]
    step_tokens: Option<usize>,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Only measure the machine's limits (read bandwidth, f32 FMA peak and, with AVX512_BF16,
    /// bf16 dot peak, with these threads on every rank at once) and print them: the inputs of
    /// `gridlm plan`.
    #[arg(long, conflicts_with_all = ["model", "shape"])]
    limits: bool,
    /// MiB of the buffer the bandwidth measurement reads (1 MiB to 1 TiB; default 1024). Only a
    /// buffer far larger than the last-level cache measures memory; tests use small ones.
    #[arg(long, default_value_t = 1024,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1 << 20))]
    bandwidth_mib: usize,
    /// When decode's bandwidth is read: `between-steps`, a slice of the buffer (its first
    /// sixteenth, the same each time) after each step, its time left out of the step times, so
    /// decode and the reads meet the same moments of a host whose bandwidth wanders (a run's
    /// bandwidth from the median rates of stretches of its readings); or `around-runs`, whole
    /// reads before and after each run. Steps that overlap in a pipeline are always read around
    /// the runs.
    #[arg(long, value_enum, default_value_t = BandwidthReads::BetweenSteps)]
    bandwidth_reads: BandwidthReads,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
    /// With --quant: load the same weights unquantized beside the quantized ones and run the
    /// two in turn, rep by rep, so both meet the same moments of the host; report both and
    /// the quantized weights' decode speed-up.
    #[arg(long, requires = "quant")]
    compare_unquantized: bool,
    /// Run this batch size in turn with --batch, rep by rep, on the same weights; report both
    /// and --batch's decode speed-up over it.
    #[arg(long, conflicts_with = "compare_unquantized")]
    compare_batch: Option<usize>,
    /// Run one-token products prefetching this way (none, near, far, nta or page) in turn with
    /// the way each rank took at start-up (timed, or named by GRIDLM_PREFETCH), step by step on
    /// the same weights and batch; report both and the rank's own way's decode speed-up over
    /// it. No way changes a result: both sides generate the same tokens. For decode of one
    /// token a step (--batch 1, or as many micro-batches as sequences).
    #[arg(long, value_name = "WAY", value_parser = parse_fetch,
          conflicts_with_all = ["compare_unquantized", "compare_batch"])]
    compare_prefetch: Option<Fetch>,
    /// Run one-token products with the other choice of which pieces the AVX2 kernels read in
    /// three streams (long: from 1 MiB on; every: every piece) in turn with the choice each
    /// rank took at start-up (timed, or named by GRIDLM_STREAMS), step by step on the same
    /// weights and batch; report both and the rank's own choice's decode speed-up over it. No
    /// choice changes a result. For decode of one token a step, as --compare-prefetch; where no
    /// AVX2 kernel reads a rank's products (AVX-512, AVX512-VNNI int8) both sides read alike.
    #[arg(long, value_name = "WAY", value_parser = parse_streams,
          conflicts_with_all = ["compare_unquantized", "compare_batch", "compare_prefetch"])]
    compare_streams: Option<Streams>,
    #[command(flatten)]
    grid: GridArgs,
}

/// When `gridlm bench` reads decode's bandwidth (see `--bandwidth-reads`).
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum BandwidthReads {
    BetweenSteps,
    AroundRuns,
}

/// The slice of the probe's buffer read between steps: its first sixteenth (64 MiB of the
/// default 1 GiB), the same every time (`ReadProbe::rate_slice`), a millisecond or two at
/// these machines' bandwidth.
const READ_PARTS: usize = 16;

/// Which of a bench's runs a run is: one of those it reports on, or of the baseline they are
/// compared with, run in turn with them (`--compare-unquantized`: on spare weights;
/// `--compare-batch`: at another batch size). Indexes the figures of each side.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Side {
    Main = 0,
    Baseline = 1,
}

/// A bench run: a warm-up or a timed rep (numbered from 0).
#[derive(Clone, Copy)]
enum Run {
    Warmup(usize),
    Rep(usize),
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
    /// Write the tokenizer alone (tokenizer.json, tokenizer_config.json), of any GGUF with a
    /// vocabulary, weights or none
    #[arg(long, conflicts_with = "dtype")]
    vocab_only: bool,
}

fn parse_quant(s: &str) -> Result<Quant, String> {
    Quant::parse(s).ok_or_else(|| format!("unknown quantization `{s}` (expected int8)"))
}

fn parse_fetch(s: &str) -> Result<Fetch, String> {
    let names = Fetch::ALL.map(Fetch::name).join(", ");
    Fetch::parse(s).ok_or_else(|| format!("unknown prefetch way `{s}` (expected one of {names})"))
}

fn parse_streams(s: &str) -> Result<Streams, String> {
    let names = Streams::ALL.map(Streams::name).join(" or ");
    Streams::parse(s).ok_or_else(|| format!("unknown streams way `{s}` (expected {names})"))
}

/// A JSON object of further chat template variables (`{"enable_thinking": false}`).
fn parse_template_vars(s: &str) -> Result<TemplateVars, String> {
    let vars: TemplateVars =
        serde_json::from_str(s).map_err(|e| format!("not a JSON object of template variables: {e}"))?;
    check_template_vars(&vars)?;
    Ok(vars)
}

/// `--response-format`'s format (`None`: text).
#[derive(Clone)]
struct ResponseFormat(Option<Format>);

fn parse_response_format(s: &str) -> Result<ResponseFormat, String> {
    let v: serde_json::Value = serde_json::from_str(s).map_err(|e| format!("not JSON: {e}"))?;
    Format::from_response_format(&v).map(ResponseFormat)
}

/// `--logit-bias`'s (token, bias) pairs (one value to clap, not many).
#[derive(Clone)]
struct LogitBias(Vec<(u32, f32)>);

fn parse_logit_bias(s: &str) -> Result<LogitBias, String> {
    let obj =
        serde_json::from_str(s).map_err(|e| format!("not a JSON object of token ids and biases: {e}"))?;
    gridlm::prompts::logit_bias(&obj).map(LogitBias)
}

fn parse_dtype(s: &str) -> Result<DType, String> {
    DType::parse(s).ok_or_else(|| format!("unknown dtype `{s}` (expected f32, bf16 or f16)"))
}

/// A bug (a panic, on any thread) prints one `error:` line naming where it happened — and the
/// trace after it only when `RUST_BACKTRACE` asks — then ends the process at once with status
/// 101. Unwinding would finalize MPI while the other ranks wait in a collective; exiting
/// without finalizing makes mpirun take the whole job down instead.
fn one_line_panics() {
    std::panic::set_hook(Box::new(|info| {
        let msg = info
            .payload()
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| info.payload().downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".into());
        let at = info.location().map(|l| format!(" at {}:{}", l.file(), l.line())).unwrap_or_default();
        let rank = ["OMPI_COMM_WORLD_RANK", "PMI_RANK"]
            .iter()
            .find_map(|v| std::env::var(v).ok())
            .map(|r| format!("rank {r}: "))
            .unwrap_or_default();
        // Only the main thread writes to stdout. Another thread must not wait for its lock: the
        // main thread may hold it while it waits for this thread's kernel to finish. Exiting
        // flushes stdout anyway whenever the lock is free.
        if std::thread::current().name() == Some("main") {
            let _ = std::io::stdout().flush();
        }
        error_line(&format!(
            "{rank}internal error{at}: {msg} (a bug in gridlm; RUST_BACKTRACE=1 shows the trace)"
        ));
        if std::env::var_os("RUST_BACKTRACE").is_some_and(|v| v != "0") {
            let trace = std::backtrace::Backtrace::force_capture().to_string();
            let _ = std::io::stderr().write_all(trace.as_bytes());
        }
        // A server's HTTP threads (a connection's, named gridlm-http) end alone: their request gets
        // status 500 (or its connection closes) and the others are answered on. Any other
        // thread's panic (the main thread's, a kernel thread's) ends the rank, and so the job.
        let name = std::thread::current().name().map(str::to_string);
        let compute =
            matches!(name.as_deref(), Some("main")) || name.is_some_and(|n| n.starts_with("gridlm-kernel"));
        if compute || !SERVING.load(std::sync::atomic::Ordering::Relaxed) {
            std::process::exit(101);
        }
    }));
}

/// Set while this rank answers HTTP requests (`serve`'s driver): see [`one_line_panics`].
static SERVING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

fn main() -> ExitCode {
    one_line_panics();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return usage_error(e),
    };
    let result = match cli.cmd {
        Cmd::Generate(a) => generate(a),
        Cmd::Convert(a) => run_convert(a),
        Cmd::Bench(a) => bench(a),
        Cmd::Report(a) => report(a),
        Cmd::Plan(a) => plan(a),
        Cmd::Inspect(a) => inspect(a),
        Cmd::Serve(a) => serve(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        // The reader of stdout went away (`| head`): nothing is left to say, nor anyone to say
        // it to, so the run ends quietly, as a Unix tool's does.
        Err(e) if broken_pipe(&e) => ExitCode::SUCCESS,
        Err(e) => {
            if e.downcast_ref::<Reported>().is_none() {
                let _ = std::io::stdout().flush();
                error_line(&format!("{e:#}"));
            }
            ExitCode::FAILURE
        }
    }
}

/// Whether `e` comes from writing to a closed pipe.
fn broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>().is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

/// A command line clap rejects gets one `error:` line and status 1, like any other bad
/// input (clap's own report adds usage lines). Help and version go out as clap prints them.
fn usage_error(e: clap::Error) -> ExitCode {
    use clap::error::ErrorKind::*;
    if matches!(e.kind(), DisplayHelp | DisplayVersion | DisplayHelpOnMissingArgumentOrSubcommand) {
        e.exit();
    }
    if let Some(msg) = negative_value(&e) {
        error_line(&msg);
        return ExitCode::FAILURE;
    }
    // The message is the first paragraph (a list of missing arguments continues it).
    let text = e.render().to_string();
    let para: Vec<&str> = text.lines().take_while(|l| !l.trim().is_empty()).map(str::trim).collect();
    let msg = para.join(" ");
    let msg = msg.strip_prefix("error: ").unwrap_or(&msg);
    error_line(&format!("{msg} (gridlm --help lists the options)"));
    ExitCode::FAILURE
}

/// A negative number given as an option's value (`--warmup -1`), which clap reads as an
/// unknown option: the message names the option and says what is wrong with the value.
fn negative_value(e: &clap::Error) -> Option<String> {
    use clap::error::{ContextKind, ContextValue};
    use std::any::TypeId;
    if e.kind() != clap::error::ErrorKind::UnknownArgument {
        return None;
    }
    let Some(ContextValue::String(value)) = e.get(ContextKind::InvalidArg) else { return None };
    if !value.starts_with('-') || value.parse::<f64>().is_err() {
        return None;
    }
    // clap names `-3` of `-3.5`: the word on the command line is the one it starts. An
    // option that takes negative values (`--temperature -1`) kept its word, so the rejected
    // one is the first such word after any other option.
    let cli = Cli::command();
    let args: Vec<String> = std::env::args().collect();
    let (option, arg, value) = args.windows(2).find_map(|w| {
        let (option, word) = (w[0].strip_prefix("--")?, &w[1]);
        if !word.starts_with(value.as_str()) || word.parse::<f64>().is_err() {
            return None;
        }
        let arg =
            cli.get_subcommands().flat_map(|c| c.get_arguments()).find(|a| a.get_long() == Some(option))?;
        (!arg.is_allow_negative_numbers_set()).then_some((&w[0], arg, word))
    })?;
    let ty = arg.get_value_parser().type_id();
    let numeric = [
        TypeId::of::<usize>(),
        TypeId::of::<u32>(),
        TypeId::of::<u64>(),
        TypeId::of::<f32>(),
        TypeId::of::<f64>(),
    ];
    Some(if numeric.iter().any(|t| ty == *t) {
        format!("invalid value '{value}' for '{option}': it must not be negative")
    } else {
        format!("'{value}' after '{option}' reads as an option; write {option}={value} for that value")
    })
}

/// Prints `error: MSG` as one write, so lines from several ranks never interleave.
fn error_line(msg: &str) {
    let line = format!("error: {}\n", msg.replace('\n', " "));
    let _ = std::io::stderr().write_all(line.as_bytes());
}

/// Prints a status line on stderr after what went to stdout. An MPI launcher forwards the two
/// streams by separate channels (Open MPI: a pseudo-terminal and a pipe), so a line written to
/// stderr right after the answer can overtake the answer's end and land on its last line; under
/// a launcher this pauses 50 ms after flushing stdout, once, at the end of a run.
fn status_line(stdout: &mut impl Write, line: &str) {
    let _ = stdout.flush();
    if launched_by_mpirun() {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let _ = std::io::stderr().write_all(line.as_bytes());
}

fn inspect(a: InspectArgs) -> Result<()> {
    at_least(&[("--pp", a.pp, 1), ("--tp", a.tp, 1)])?;
    let cfg = ModelConfig::from_dir(&a.model)?;
    let ckpt = Checkpoint::open(&a.model)?;
    let stored = gridlm::inspect::stored_dtype(&ckpt, &cfg)?;
    let src = as_loaded(ckpt, a.dtype, &a.model);
    let x =
        gridlm::inspect::inspect(src.as_ref(), &cfg, (a.pp, a.tp, a.layers.as_deref()), (stored, a.quant))?;
    if a.json {
        writeln!(std::io::stdout(), "{}", serde_json::to_string(&x)?)?;
    } else {
        write!(std::io::stdout(), "gridlm inspect: {}\n{}", a.model.display(), gridlm::inspect::table(&x))?;
    }
    Ok(())
}

/// The dtype the folder `dir` stores its weights in, as generate would load them: from the
/// safetensors headers, or where the folder holds only its config (enough to plan a model not
/// yet fetched) from config.json's `torch_dtype` (`dtype` in transformers 5), else bf16.
fn folder_dtype(dir: &Path, cfg: &ModelConfig) -> Result<DType> {
    if let Ok(ckpt) = Checkpoint::open(dir) {
        return Ok(gridlm::inspect::stored_dtype(&ckpt, cfg)?);
    }
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).with_context(|| format!("{}: cannot read", path.display()))?;
    let v: serde_json::Value = serde_json::from_str(&text)?;
    let named = ["torch_dtype", "dtype"].iter().find_map(|k| v[k].as_str().or(v["text_config"][k].as_str()));
    Ok(named.and_then(DType::parse).unwrap_or(DType::BF16))
}

fn plan(a: PlanArgs) -> Result<()> {
    use gridlm::plan::{layouts, table, Cluster, Workload};
    let cfg = match (&a.model, &a.shape) {
        (Some(dir), _) => ModelConfig::from_dir(dir)?,
        (None, Some(name)) => synthetic::shape(name)?,
        (None, None) => unreachable!("clap requires --model or --shape"),
    };
    let measured = match &a.limits {
        Some(f) => {
            let text = std::fs::read_to_string(f).with_context(|| format!("{}: cannot read", f.display()))?;
            let v: serde_json::Value = serde_json::from_str(text.trim())
                .with_context(|| format!("{}: not `bench --limits --json` output", f.display()))?;
            let get = |k: &str| {
                v[k].as_f64()
                    .with_context(|| format!("{}: no number `{k}` (from bench --limits --json)", f.display()))
            };
            // One core's bandwidth, and the cores it was all measured with (files written
            // before `core_gb_per_s` have neither).
            let cores =
                v["threads_per_rank"].as_u64().zip(v["ranks"].as_array()).map(|(t, r)| t as usize * r.len());
            let core = v["core_gb_per_s"].as_f64().zip(cores);
            // Null where the CPU has no AVX512_BF16; missing from files written before it.
            let bf16 = v["measured_bf16_peak_gflops"].as_f64();
            Some((get("measured_gb_per_s")?, get("measured_peak_gflops")?, core, bf16))
        }
        None => None,
    };
    let mem_bw = a.mem_bw.or(measured.map(|m| m.0)).unwrap_or(0.0);
    let peak_gflops = a.peak_gflops.or(measured.map(|m| m.1)).unwrap_or(0.0);
    let bf16_peak_gflops = a.bf16_peak_gflops.or(measured.and_then(|m| m.3));
    let from_file = measured.and_then(|m| m.2);
    let core_gbps = a.core_gbps.or(from_file.map(|f| f.0));
    let cores = a.cores_per_socket.or(from_file.map(|f| f.1));
    let (core_gbps, cores_per_socket) = match (core_gbps, cores) {
        (Some(g), Some(c)) => (g, c),
        (Some(_), None) => anyhow::bail!("--core-gbps needs --cores-per-socket (the cores of one socket)"),
        (None, _) => (0.0, 0),
    };
    a.work.check()?;
    a.work.check_context(&cfg)?;
    let mut positive = vec![
        ("--mem-bw", mem_bw),
        ("--peak-gflops", peak_gflops),
        ("--net-gbps", a.net_gbps),
        ("--local-gb-per-s", a.local_gb_per_s),
    ];
    if a.core_gbps.is_some() {
        positive.push(("--core-gbps", core_gbps));
    }
    if let Some(g) = bf16_peak_gflops {
        positive.push(("--bf16-peak-gflops", g));
    }
    if let Some((k, v)) = positive.iter().find(|(_, v)| !(v.is_finite() && *v > 0.0)) {
        anyhow::bail!("{k} must be a positive number, got {v}");
    }
    // Clap takes `nan` and `inf` as numbers; negative ones it refuses as options.
    let finite = [
        ("--mem-gb", a.mem_gb),
        ("--net-latency-us", a.net_latency_us),
        ("--local-latency-us", a.local_latency_us),
    ];
    if let Some((k, v)) = finite.iter().find(|(_, v)| !(v.is_finite() && *v >= 0.0)) {
        anyhow::bail!("{k} must be a number, at least 0, got {v}");
    }
    at_least(&[
        ("--nodes", a.nodes, 1),
        ("--sockets-per-node", a.sockets_per_node, 1),
        ("--ranks-per-socket", a.ranks_per_socket, 1),
        ("--cores-per-socket", a.cores_per_socket.unwrap_or(1), 1),
    ])?;
    let cluster = Cluster {
        nodes: a.nodes,
        sockets_per_node: a.sockets_per_node,
        ranks_per_socket: a.ranks_per_socket,
        mem_gb_per_s: mem_bw,
        peak_gflops,
        bf16_peak_gflops: bf16_peak_gflops.unwrap_or(0.0),
        core_gb_per_s: core_gbps,
        cores_per_socket,
        mem_gb: a.mem_gb,
        net_gbps: a.net_gbps,
        net_latency_us: a.net_latency_us,
        local_latency_us: a.local_latency_us,
        local_gb_per_s: a.local_gb_per_s,
    };
    let dtype = match (a.dtype, &a.model) {
        (Some(dtype), _) => dtype,
        (None, Some(dir)) => folder_dtype(dir, &cfg)?,
        (None, None) => DType::BF16,
    };
    let weight_bytes = if a.quant.is_some() { 1.0 } else { dtype.size_bytes() as f64 };
    let work = Workload {
        weight_bytes,
        bf16: a.quant.is_none() && dtype == DType::BF16,
        kv_bytes: a.kv_dtype.size_bytes() as f64,
        prompt_len: a.work.prompt_len,
        new_tokens: a.work.new_tokens,
        batch: a.work.batch,
    };
    let p = layouts(&cfg, &cluster, &work);
    if a.json {
        writeln!(std::io::stdout(), "{}", serde_json::to_string(&p)?)?;
    } else {
        write!(std::io::stdout(), "{}", table(&p))?;
    }
    Ok(())
}

fn report(a: ReportArgs) -> Result<()> {
    let runs = gridlm::scaling::read_runs(&a.runs)?;
    if let Some(p) = &a.plot {
        gridlm::scaling::plot(&runs, p, &a.title)?;
    }
    write!(std::io::stdout(), "{}", gridlm::scaling::table(&runs))?;
    Ok(())
}

fn run_convert(a: ConvertArgs) -> Result<()> {
    if a.vocab_only {
        convert::convert_vocab(&a.gguf, &a.out)?;
        // Not eprintln!, which panics where stderr is closed: the folder is written all the same.
        let _ = writeln!(std::io::stderr(), "wrote {} (the tokenizer)", a.out.display());
        return Ok(());
    }
    let s = convert::convert(&a.gguf, &a.out, a.dtype)?;
    let (mb, dtype) = (s.bytes as f64 / 1e6, a.dtype.name());
    let _ = writeln!(
        std::io::stderr(),
        "wrote {} ({} tensors, {mb:.1} MB of weights in {dtype})",
        a.out.display(),
        s.n_tensors
    );
    Ok(())
}

/// Kernel threads for this rank: the cores in its affinity mask when the launcher bound it to
/// a subset, else the machine's cores shared among the ranks on this node.
fn default_threads() -> usize {
    let mask = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let online = std::fs::read_to_string("/sys/devices/system/cpu/online")
        .ok()
        .and_then(|s| count_cpu_list(s.trim()))
        .unwrap_or(mask);
    if mask < online {
        return mask;
    }
    (mask / gridlm::comm::mpi::local_ranks()).max(1)
}

/// Number of CPUs in a list such as `0-3,8,10-11`.
fn count_cpu_list(s: &str) -> Option<usize> {
    s.split(',')
        .map(|part| match part.split_once('-') {
            Some((a, b)) => Some(b.parse::<usize>().ok()? + 1 - a.parse::<usize>().ok()?),
            None => part.parse::<usize>().ok().map(|_| 1),
        })
        .sum()
}

/// The prefetch ways a bench's baseline ran under where they differ from the rank's own: the
/// one-token way (`--compare-prefetch`), the many-token way (`--compare-batch`) and the
/// one-token streams (`--compare-streams`).
type BaselineWays =
    (Option<(Fetch, PrefetchBy)>, Option<(ManyFetch, PrefetchBy)>, Option<(Streams, PrefetchBy)>);

/// Collective: every rank's memory and time figures, in world-rank order. `weight_rss` is the
/// RSS growth while the rank loaded its shard; the current RSS is taken now. `profile` is where
/// the rank's decode steps went: the engine's own since its last run began, or (bench with a
/// baseline) since the last run of the side it reports on. `base_ways`: the one-token way the
/// baseline of `bench --compare-prefetch` ran under, the many-token way the baseline batch
/// of `bench --compare-batch` ran under, and the streams the baseline of `bench
/// --compare-streams` read in. `step_tokens`: the tokens of a decode step whose
/// weight bytes each rank reports (more of a mixture's experts for more tokens).
fn gather_rank_reports(
    link: &dyn Link,
    engine: &Engine,
    profile: StepProfile,
    weight_rss: usize,
    (base_prefetch, base_many, base_streams): BaselineWays,
    step_tokens: usize,
) -> Vec<RankReport> {
    let (grid, shard) = (engine.grid, &engine.shard);
    let t = profile.per_step_ms().map(f64::to_bits);
    // u64::MAX: not counted (no decode step, or allocations are not counted).
    let allocs = profile.allocations_per_step().map_or(u64::MAX, f64::to_bits);
    // Sent as indices into `Fetch::ALL`, `PrefetchBy::ALL`, `Isa::ALL`, `Int8Path::ALL`,
    // `ManyFetch::ALL` and `Streams::ALL` (the order they are declared in; u64::MAX: weights
    // not int8, or no baseline way).
    let (prefetch, many_prefetch, streams) = (engine.prefetch(), engine.many_prefetch(), engine.streams());
    let isa = dot::detect();
    let int8 = if shard.weight_dtype() == "int8" { dot::int8_path_for(isa) as u64 } else { u64::MAX };
    let mine = [
        grid.stage() as u64,
        grid.tp_rank() as u64,
        shard.weight_bytes() as u64,
        host::rss_bytes() as u64,
        weight_rss as u64,
        shard.bytes_per_step(step_tokens) as u64,
        (shard.kv_page_bytes(engine.kv_dtype()) / gridlm::model::PAGE) as u64,
        t[0],
        t[1],
        t[2],
        t[3],
        t[4],
        allocs,
        prefetch.0 as u64,
        prefetch.1 as u64,
        isa as u64,
        int8,
        many_prefetch.0 as u64,
        many_prefetch.1 as u64,
        base_many.map_or(u64::MAX, |m| m.0 as u64),
        base_many.map_or(u64::MAX, |m| m.1 as u64),
        base_prefetch.map_or(u64::MAX, |p| p.0 as u64),
        base_prefetch.map_or(u64::MAX, |p| p.1 as u64),
        streams.0 as u64,
        streams.1 as u64,
        base_streams.map_or(u64::MAX, |s| s.0 as u64),
        base_streams.map_or(u64::MAX, |s| s.1 as u64),
    ];
    let mut all = vec![0; mine.len() * link.world_size()];
    link.allgather_u64(&mine, &mut all);
    let by = |i: u64| PrefetchBy::ALL.get(i as usize).copied();
    all.chunks_exact(mine.len())
        .enumerate()
        .map(|(rank, v)| RankReport {
            rank,
            stage: v[0] as usize,
            tp: v[1] as usize,
            weight_bytes: v[2],
            rss_bytes: v[3],
            weight_rss_bytes: v[4],
            bytes_per_token: v[5],
            kv_bytes_per_position: v[6],
            step_ms: f64::from_bits(v[7]),
            compute_ms: f64::from_bits(v[8]),
            allreduce_ms: f64::from_bits(v[9]),
            allgather_ms: f64::from_bits(v[10]),
            sendrecv_ms: f64::from_bits(v[11]),
            allocations_per_step: (v[12] != u64::MAX).then(|| f64::from_bits(v[12])),
            prefetch: Fetch::ALL.get(v[13] as usize).map_or("?", |f| f.name()).to_string(),
            prefetch_by: by(v[14]).map_or("?", |b| b.name()).to_string(),
            prefetch_timings: by(v[14]).map_or(0, |b| b.timings()),
            isa: dot::Isa::ALL.get(v[15] as usize).map_or("?", |i| i.name()).to_string(),
            int8_kernel: (v[16] != u64::MAX)
                .then(|| dot::Int8Path::ALL.get(v[16] as usize).map_or("?", |k| k.name()).to_string()),
            many_prefetch: ManyFetch::ALL.get(v[17] as usize).map_or("?", |f| f.name()).to_string(),
            many_prefetch_by: by(v[18]).map_or("?", |b| b.many_name()).to_string(),
            many_prefetch_timings: by(v[18]).map_or(0, |b| b.timings()),
            baseline_many_prefetch: (v[19] != u64::MAX)
                .then(|| ManyFetch::ALL.get(v[19] as usize).map_or("?", |f| f.name()).to_string()),
            baseline_many_prefetch_by: (v[20] != u64::MAX)
                .then(|| by(v[20]).map_or("?", |b| b.many_name()).to_string()),
            baseline_many_prefetch_timings: (v[20] != u64::MAX).then(|| by(v[20]).map_or(0, |b| b.timings())),
            baseline_prefetch: (v[21] != u64::MAX)
                .then(|| Fetch::ALL.get(v[21] as usize).map_or("?", |f| f.name()).to_string()),
            baseline_prefetch_by: (v[22] != u64::MAX)
                .then(|| by(v[22]).map_or("?", |b| b.name()).to_string()),
            streams: Streams::ALL.get(v[23] as usize).map_or("?", |s| s.name()).to_string(),
            streams_by: by(v[24]).map_or("?", |b| b.streams_name()).to_string(),
            streams_timings: by(v[24]).map_or(0, |b| b.timings()),
            baseline_streams: (v[25] != u64::MAX)
                .then(|| Streams::ALL.get(v[25] as usize).map_or("?", |s| s.name()).to_string()),
            baseline_streams_by: (v[26] != u64::MAX)
                .then(|| by(v[26]).map_or("?", |b| b.streams_name()).to_string()),
        })
        .collect()
}

fn write_f32_file(path: &Path, v: &[f32]) -> Result<()> {
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    Ok(gridlm::write_whole(path, &bytes)?)
}

/// An error every rank already knows about (agreed collectively), so ranks can exit
/// normally; any other error in a multi-rank job aborts the job so no rank waits forever.
#[derive(Debug)]
struct Agreed(String);
impl std::fmt::Display for Agreed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}
impl std::error::Error for Agreed {}

/// Collective: every rank learns whether any rank failed this phase.
fn agree<T>(link: &dyn Link, r: gridlm::Result<T>) -> Result<T> {
    let outcome = r.as_ref().map(|_| ()).map_err(|e| e.to_string());
    match link.agree(outcome) {
        Ok(()) => Ok(r.expect("agree returned Ok only when every rank, this one included, succeeded")),
        Err(msg) => Err(Agreed(msg).into()),
    }
}

/// This rank's shard from `src`, once every node is known to have memory for the weights of
/// all its ranks. Collective; every step's error is agreed, so each rank reports it.
fn load_shard(
    link: &dyn Link,
    src: gridlm::Result<Box<dyn Source>>,
    cfg: ModelConfig,
    plan: ShardPlan,
    quant: Option<Quant>,
) -> Result<Shard> {
    let planned = src.and_then(|s| {
        let need = Shard::planned_bytes(s.as_ref(), &cfg, &plan, quant)?;
        // What quantizing would need instead, for the line should the weights not fit.
        let int8 = match quant {
            None => Some(Shard::planned_bytes(s.as_ref(), &cfg, &plan, Some(Quant::Int8))?),
            Some(_) => None,
        };
        Ok((need, int8, s))
    });
    let (need, int8, src) = agree(link, planned)?;
    agree(link, host::check_room(link, need, int8))?;
    agree(link, Shard::from_source(src.as_ref(), cfg, plan, quant))
}

/// An embedding as given: as pooled, or scaled to length 1 ([`gridlm::engine::normalized`]).
fn embedding(e: &[f32], normalize: bool) -> Vec<f32> {
    if normalize {
        gridlm::engine::normalized(e)
    } else {
        e.to_vec()
    }
}

fn generate(a: GenerateArgs) -> Result<()> {
    a.engine.check()?;
    a.batching.check()?;
    if a.stop.iter().any(String::is_empty) {
        anyhow::bail!("--stop needs a non-empty string");
    }
    if a.prompts_file.is_some() && a.logits_out.is_some() {
        anyhow::bail!("--logits-out works with --prompt only");
    }
    if a.logits_out.is_some() && (a.max_tokens == 0 || a.embed.is_some()) {
        // The prompt's logits come with its first new token; without one there are none.
        anyhow::bail!("--logits-out needs --max-tokens of at least 1");
    }
    let params = a.sampling.params_over_model(&a.model, a.model_sampling)?;
    on_grid(&a.grid, |grid, comm, link| run_generate(&a, &params, grid, comm, link))
}

/// Runs `job` on this rank's place in the grid: one rank without a launcher, else under MPI.
/// Errors every rank agreed on are printed by each rank (then a barrier, so the launcher's
/// clean-up cannot cut a rank off mid-message); any other error aborts the whole job.
fn on_grid(g: &GridArgs, job: impl FnOnce(Grid, &dyn Comm, &dyn Link) -> Result<()>) -> Result<()> {
    if !launched_by_mpirun() {
        let grid = Grid::new(g.pp.unwrap_or(1), g.tp.unwrap_or(1), 0, 1)?;
        return job(grid, &Single, &Single);
    }
    let mpi = MpiJob::init()?;
    let (rank, size) = (mpi.rank(), mpi.size());
    if rank == 0 {
        adopt_launcher_stdout();
    }
    let pp = g.pp.unwrap_or(1);
    let tp = g.tp.unwrap_or((size / pp.max(1)).max(1));
    // The same arguments reach every rank, so every rank reaches the same verdict here.
    let result = match Grid::new(pp, tp, rank, size) {
        Ok(grid) => {
            let (stage, link) = mpi.split(grid.stage(), grid.tp_rank());
            job(grid, &stage, &link)
        }
        Err(e) => Err(Agreed(e.to_string()).into()),
    };
    match result {
        Ok(()) => Ok(()),
        // Printed already by the driver, after every rank finished the job.
        Err(e) if e.downcast_ref::<Reported>().is_some() => Err(e),
        // The driver's reader went away (`| head`), the answer written after the other ranks
        // finished their part: the run ends quietly (see `main`), not by an abort of the job.
        Err(e) if broken_pipe(&e) => Err(e),
        Err(e) if e.downcast_ref::<Agreed>().is_some() => {
            let _ = std::io::stdout().flush();
            error_line(&format!("{e:#}"));
            mpi.barrier();
            Err(Reported.into())
        }
        Err(e) => {
            let _ = std::io::stdout().flush();
            error_line(&format!("rank {rank}: {e:#}"));
            mpi.abort(1)
        }
    }
}

/// Makes the pipe `GRIDLM_STDOUT` names this process's stdout, where it is one with a reader.
/// `launch/local` and `launch/sockets` name there the pipe their own stdout is
/// (`/proc/<mpirun's pid>/fd/1`), for the driver to write the answer into itself rather than
/// through mpirun: a reader that goes away (`| head`) then ends the run quietly with status 0,
/// where mpirun, finding its stdout closed, would abort the job with status 1 and lines of its
/// own. Only a pipe is taken (a file opened anew would be written from its start, not where the
/// shell's `>>` appends), and only while it has a reader (opening a pipe without one would wait
/// for one); otherwise stdout stays as the launcher gave it.
fn adopt_launcher_stdout() {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
    let Some(path) = std::env::var_os("GRIDLM_STDOUT") else { return };
    if !std::fs::metadata(&path).is_ok_and(|m| m.file_type().is_fifo()) {
        return;
    }
    let Ok(pipe) = std::fs::OpenOptions::new().write(true).custom_flags(libc::O_NONBLOCK).open(&path) else {
        return;
    };
    let fd = pipe.as_raw_fd();
    // SAFETY: plain calls on a descriptor this function owns and on fd 1, before any thread
    // writes to stdout; `pipe` closes its own descriptor after the copy.
    unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        if flags >= 0 && libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK) == 0 {
            libc::dup2(fd, 1);
        }
    }
}

/// An error already printed by this rank.
#[derive(Debug)]
struct Reported;
impl std::fmt::Display for Reported {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("reported")
    }
}
impl std::error::Error for Reported {}

/// A prompt ready to run: where it came from, its settings and its tokens.
struct Prepared {
    spec: PromptSpec,
    ids: Vec<u32>,
}

/// Driver: the prompts of this run (from `--prompt` or the prompts file), tokenized, their
/// token rules checked against the model's `vocab`.
fn prepare_prompts(
    a: &GenerateArgs,
    params: &SamplingParams,
    tok: &Tokenizer,
    vocab: usize,
) -> gridlm::Result<Vec<Prepared>> {
    let d = Defaults {
        max_tokens: a.max_tokens,
        ignore_eos: a.ignore_eos,
        chat: a.chat,
        system: a.system.clone(),
        template_vars: a.chat_template_kwargs.clone().unwrap_or_default(),
        stop: a.stop.clone(),
        keep_stop: a.include_stop_str_in_output,
        params: params.clone(),
        rules: TokenRules {
            min_tokens: a.min_tokens,
            stop_token_ids: a.stop_token_ids.clone(),
            logit_bias: a.logit_bias.as_ref().map_or_else(Vec::new, |b| b.0.clone()),
        },
        format: a.response_format.as_ref().and_then(|f| f.0.clone()),
        tool_parser: a.tool_call_parser,
    };
    let specs = match (&a.prompt, &a.prompts_file) {
        (Some(p), _) => vec![d.spec(0, 0, p.clone())],
        (None, Some(f)) => read_prompts(f, &d)?,
        (None, None) => unreachable!("clap requires --prompt or --prompts-file"),
    };
    if a.chat_template_kwargs.is_some() && !specs.iter().any(|s| s.chat) {
        let msg =
            "--chat-template-kwargs: no prompt is a chat (--chat, or a prompts file's `chat` or `messages`)";
        return Err(gridlm::Error::Input(msg.into()));
    }
    let file = a.prompts_file.as_ref().filter(|_| a.prompt.is_none());
    specs
        .into_iter()
        .map(|spec| {
            // A prompt of the file is named by its line (a chat template may refuse one); a rule
            // by its key there, else by its flag.
            let at = |e: String| match file {
                Some(f) => gridlm::Error::Input(format!("{}:{}: {e}", f.display(), spec.line)),
                None => gridlm::Error::Input(e),
            };
            if spec.embedding && a.embed.is_none() {
                return Err(at("an embeddings request (`url` /v1/embeddings) needs --embed POOLING".into()));
            }
            spec.rules.check(vocab, spec.max_tokens).map_err(|e| match file {
                Some(_) => at(format!("`{}", e.replacen(' ', "` ", 1))),
                None => {
                    let (key, rest) = e.split_once(' ').unwrap_or((&e, ""));
                    at(format!("--{} {rest}", key.replace('_', "-")))
                }
            })?;
            let ids = spec.rendered(tok).and_then(|text| tok.encode(&text, !spec.chat));
            let ids = ids.map_err(|e| if file.is_some() { at(e.to_string()) } else { e })?;
            Ok(Prepared { spec, ids })
        })
        .collect()
}

/// This rank's engine on its shard of the folder `model` (loaded as `engine` says), every rank
/// agreeing on the outcome; warns where the threads asked for exceed the cores.
fn open_engine(
    link: &dyn Link,
    model: &Path,
    (cfg, plan, grid): (ModelConfig, ShardPlan, Grid),
    engine: &EngineArgs,
) -> Result<Engine> {
    let shard = load_shard(link, engine.source(model), cfg, plan, engine.quant)?;
    let e = agree(link, Engine::new(shard, grid, engine.threads(), engine.kv_dtype))?;
    engine.warn_if_oversubscribed();
    Ok(e)
}

/// The end-of-sequence ids of the config (`cfg_eos`) and the tokenizer's own, once each.
fn eos_ids(mut cfg_eos: Vec<u32>, tok: &Tokenizer) -> Vec<u32> {
    if let Some(id) = tok.eos_id().filter(|id| !cfg_eos.contains(id)) {
        cfg_eos.push(id);
    }
    cfg_eos
}

/// "1 rank (1x1)", "4 ranks (2x2)": a grid's size and shape (pipeline stages × tp ranks), for
/// the summary lines.
fn ranks_of(grid: &Grid) -> String {
    format!("{} ({}x{})", count(grid.pp * grid.tp, "rank"), grid.pp, grid.tp)
}

/// Tokens' log-probabilities for `generate --json`: per token its id, text, log-probability
/// and the alternatives' (`null` where none were asked for).
fn logprobs_json(tok: &Tokenizer, ids: &[u32], lps: &[gridlm::engine::TokenLogprobs]) -> serde_json::Value {
    if lps.is_empty() {
        return serde_json::Value::Null;
    }
    let entry = |t: u32, v: f32| serde_json::json!({"token": t, "text": tok.bytes_text(&[t]), "logprob": v});
    let tokens = ids.iter().zip(lps).map(|(&t, lp)| {
        let mut e = entry(t, lp.logprob);
        e["top"] = lp.top.iter().map(|&(a, v)| entry(a, v)).collect();
        e
    });
    tokens.collect()
}

/// A prompt's log-probabilities for `generate --json`: `null` for its first token, then as
/// [`logprobs_json`] (`null` where none were asked for).
fn prompt_logprobs_json(
    tok: &Tokenizer,
    prompt: &[u32],
    c: &gridlm::engine::Completion,
) -> serde_json::Value {
    match logprobs_json(tok, prompt.get(1..).unwrap_or_default(), &c.prompt_logprobs) {
        serde_json::Value::Array(mut v) => {
            v.insert(0, serde_json::Value::Null);
            serde_json::Value::Array(v)
        }
        other => other,
    }
}

fn run_generate(
    a: &GenerateArgs,
    params: &SamplingParams,
    grid: Grid,
    comm: &dyn Comm,
    link: &dyn Link,
) -> Result<()> {
    let driver = grid.rank == 0;
    // Phase 1: configuration, layout, and (driver) tokenizer and prompts.
    let setup = (|| -> gridlm::Result<_> {
        let cfg = ModelConfig::from_dir(&a.model)?;
        let plan = ShardPlan::new(&cfg, &grid, a.grid.layers.as_deref())?;
        let prompts = if driver {
            let tok = Tokenizer::from_dir(&a.model)?;
            let prompts = prepare_prompts(a, params, &tok, cfg.vocab_size)?;
            if a.prompt.is_some() {
                check_prompt(prompts[0].ids.len(), cfg.max_position_embeddings)?;
            }
            // The vocabulary as the grammar engine reads it, where an answer is held to one.
            let grammars = match prompts.iter().any(|p| p.spec.format.is_some()) {
                true => Some(Grammars::new(&tok, cfg.vocab_size, &eos_ids(cfg.eos_token_ids.clone(), &tok))?),
                false => None,
            };
            Some((tok, prompts, grammars))
        } else {
            None
        };
        Ok((cfg, plan, prompts))
    })();
    let (cfg, plan, prompts) = agree(link, setup)?;
    // Phase 2: this rank's shard. The RSS growth over loading is the memory its weights take.
    let rss_before = host::rss_bytes();
    let cfg_eos = cfg.eos_token_ids.clone();
    let mut engine = open_engine(link, &a.model, (cfg, plan, grid), &a.engine)?;
    let weight_rss = host::rss_bytes().saturating_sub(rss_before);
    engine.share_sizes(link);
    // The most tokens a decode step will hold, known to the driver (its prompts), for each
    // rank's many-token prefetch.
    let batch = prompts.as_ref().map_or(0, |(_, p, _)| p.len().min(a.batching.max_batch));
    let mut all = vec![0u64; link.world_size()];
    link.allgather_u64(&[batch as u64], &mut all);
    let micro_batches = a.batching.overlap.micro_batches(grid.pp);
    engine.pick_many_prefetch((all.into_iter().max().unwrap_or(0) as usize).div_ceil(micro_batches));

    let Some((tok, prompts, grammars)) = prompts else {
        engine.follow(comm, link)?;
        gather_rank_reports(link, &engine, engine.profile(), weight_rss, (None, None, None), 1);
        return agree(link, Ok(()));
    };
    let eos_ids = eos_ids(cfg_eos, &tok);
    let single = a.prompt.is_some();
    let requests: Vec<Request> = prompts
        .iter()
        .map(|p| Request {
            prompt: p.ids.clone(),
            max_tokens: if a.embed.is_some() { 0 } else { p.spec.max_tokens },
            ignore_eos: p.spec.ignore_eos,
            params: p.spec.params.clone(),
            keep_logits: a.logits_out.is_some(),
            logprobs: a.logprobs.map(|n| n as usize),
            prompt_logprobs: a.prompt_logprobs.map(|n| n as usize),
            rules: p.spec.rules.clone(),
            format: p.spec.format.clone(),
            grammar: None,
            embed: a.embed,
        })
        .collect();
    let mut opts = a.batching.options(grid.pp, eos_ids);
    opts.grammars = grammars;
    // Each answer's tool calls, where its prompt gives tools (its text keeps the tags they are
    // read by, where those are special tokens).
    let readers =
        || prompts.iter().map(|p| p.spec.tools.as_ref().and_then(|t| Reader::new(t, a.tool_call_parser)));
    let mut trackers: Vec<TextTracker> = prompts
        .iter()
        .zip(readers())
        .map(|(p, r)| {
            let tags = r.map(|r| tok.special_ids(r.tags())).unwrap_or_default();
            TextTracker::new(p.spec.stop.clone(), p.spec.keep_stop, &p.spec.rules)
                .keeping(tags, !p.spec.skip_special)
        })
        .collect();
    // Locked per write, never across a step: a kernel thread that panics must not find it held.
    let mut stdout = std::io::stdout();
    let stream_text = single && !a.json;
    let run = engine.run_with_stats(&requests, &opts, comm, link, |i, id| {
        let (piece, go_on) = trackers[i].push(&tok, id)?;
        if stream_text && !piece.is_empty() {
            let sent = stdout.write_all(piece.as_bytes()).and_then(|()| stdout.flush());
            // Nobody reads the answer any more: stop generating it.
            if sent.is_err_and(|e| e.kind() == std::io::ErrorKind::BrokenPipe) {
                return Ok(false);
            }
        }
        Ok(go_on)
    });
    // Whatever happened, release the other ranks, then collect their memory figures.
    engine.finish(comm, link)?;
    let ranks = generate_rank_values(gather_rank_reports(
        link,
        &engine,
        engine.profile(),
        weight_rss,
        (None, None, None),
        1,
    ));
    // The driver's verdict on the run (a lone prompt's own error included) reaches every rank,
    // so each says the same line and ends alone rather than being aborted by the launcher.
    let verdict = match &run {
        Err(e) => Err(gridlm::Error::Input(e.to_string())),
        Ok((done, _)) if single => done[0].error.clone().map_or(Ok(()), |e| Err(gridlm::Error::Input(e))),
        Ok(_) => Ok(()),
    };
    let _ = stdout.flush();
    agree(link, verdict)?;
    let (done, stats) = run?;
    let texts: Vec<String> = done
        .iter()
        .zip(&trackers)
        .map(|(c, t)| match t.kept_text(&tok)? {
            Some(kept) => Ok(kept),
            None if t.stopped() => Ok(t.text().to_string()),
            None => tok.decode(&c.token_ids),
        })
        .collect::<gridlm::Result<_>>()?;
    let layout = serde_json::json!({
        "pp": grid.pp,
        "tp": grid.tp,
        "threads": engine.threads(),
        "weight_dtype": engine.shard.weight_dtype(),
        "kv_dtype": engine.kv_dtype().name(),
        "kv_ring_pages": engine.kv_ring_pages(),
    });
    if single {
        // Its own error, if any, ended every rank at the verdict above.
        let (g, p) = (&done[0], &prompts[0]);
        if let (Some(path), Some(l)) = (&a.logits_out, &g.prompt_logits) {
            write_f32_file(path, l)?;
        }
        let first = g.times_ms.first().copied().unwrap_or(0.0);
        let tps = g.decode_tokens_per_s();
        if a.json {
            let mut out = serde_json::json!({
                "prompt_token_ids": p.ids,
                "token_ids": g.token_ids,
                "text": texts[0],
                "finish_reason": g.finish,
                "stop_reason": trackers[0].stopped_by().map(StopBy::json),
                "logprobs": logprobs_json(&tok, &g.token_ids, &g.logprobs),
                "prompt_logprobs": prompt_logprobs_json(&tok, &p.ids, g),
                "embedding": g.embedding.as_deref().map(|e| embedding(e, a.normalize)),
                "prefill_ms": first,
                "decode_tokens_per_s": tps,
                "seed": p.spec.params.seed,
                "ranks": ranks,
            });
            merge(&mut out, &layout);
            writeln!(stdout, "{out}")?;
        } else {
            // What the stream held back (as the possible start of a stop string) ends it.
            let t = &trackers[0];
            writeln!(stdout, "{}", texts[0].strip_prefix(t.shown()).unwrap_or(t.held()))?;
            let summary = format!(
                "[{}, {} ({}), prefill {:.1} ms, decode {:.1} tokens/s, {}]\n",
                count(p.ids.len(), "prompt token"),
                count(g.token_ids.len(), "new token"),
                g.finish.name(),
                first,
                tps,
                ranks_of(&grid)
            );
            status_line(&mut stdout, &summary);
        }
        return Ok(());
    }
    let file = a.prompts_file.as_ref().map(|f| f.display().to_string()).unwrap_or_default();
    let generated: usize = done.iter().map(|c| c.token_ids.len()).sum();
    // The calls each answer made, as serve gives them: its content (`None` where all calls) and
    // OpenAI's `tool_calls`.
    let calls: Vec<Option<(Option<String>, serde_json::Value)>> = readers()
        .zip(&texts)
        .map(|(r, text)| {
            let (content, calls) = gridlm::tools::read_whole(&mut r?, text);
            let calls =
                calls.iter().map(|(id, name, arguments)| gridlm::tools::call_json(id, name, arguments));
            Some((content, calls.collect()))
        })
        .collect();
    let rate = generated as f64 / (stats.elapsed_ms / 1e3).max(1e-9);
    if a.json {
        let results: Vec<_> = done
            .iter()
            .zip(&prompts)
            .zip(&texts)
            .zip(&trackers)
            .enumerate()
            .map(|(i, (((c, p), text), t))| {
                serde_json::json!({
                    "index": i,
                    "id": p.spec.id,
                    "line": p.spec.line,
                    "prompt_tokens": p.ids.len(),
                    "cached_tokens": c.cached_tokens,
                    "drafted_tokens": c.drafted,
                    "accepted_drafts": c.accepted,
                    "token_ids": c.token_ids,
                    "text": text,
                    "content": calls[i].as_ref().map_or(Some(text.as_str()), |c| c.0.as_deref()),
                    "tool_calls": calls[i].as_ref().map(|c| &c.1),
                    "finish_reason": c.finish,
                    "stop_reason": t.stopped_by().map(StopBy::json),
                    "logprobs": logprobs_json(&tok, &c.token_ids, &c.logprobs),
                    "prompt_logprobs": prompt_logprobs_json(&tok, &p.ids, c),
                    "embedding": c.embedding.as_deref().map(|e| embedding(e, a.normalize)),
                    "error": c.error,
                    "seed": p.spec.params.seed,
                    "first_token_ms": c.times_ms.first(),
                    "decode_tokens_per_s": c.decode_tokens_per_s(),
                })
            })
            .collect();
        let mut out = serde_json::json!({
            "results": results,
            "generated_tokens": generated,
            "elapsed_ms": stats.elapsed_ms,
            "tokens_per_s": rate,
            "steps": stats.steps,
            "max_batch": opts.max_batch,
            "micro_batches": opts.micro_batches,
            "overlap": opts.overlap,
            "kv_pages": stats.kv_pages,
            "kv_page_bytes": stats.kv_page_bytes,
            "kv_pages_peak": stats.kv_pages_peak,
            "cached_tokens": stats.cached_tokens,
            "drafted_tokens": stats.drafted,
            "accepted_drafts": stats.accepted,
            "ranks": ranks,
        });
        merge(&mut out, &layout);
        writeln!(stdout, "{out}")?;
    } else {
        for (i, ((c, p), text)) in done.iter().zip(&prompts).zip(&texts).enumerate() {
            let head =
                format!("=== {}/{} (line {}, {}) ===", i + 1, done.len(), p.spec.line, c.finish.name());
            writeln!(stdout, "{head}\n{text}\n")?;
        }
        // What the prefix cache and the drafts did, where they did anything.
        let mut extra = match stats.cached_tokens {
            0 => String::new(),
            n => format!(", {} from the prefix cache", count(n, "prompt token")),
        };
        if stats.drafted > 0 {
            extra += &format!(", {} of {} drafts kept", stats.accepted, stats.drafted);
        }
        let summary = format!(
            "[{}, {} in {:.2} s, {:.1} tokens/s, {}, KV peak {}/{} pages{extra}, {}]\n",
            count(done.len(), "prompt"),
            count(generated, "new token"),
            stats.elapsed_ms / 1e3,
            rate,
            count(stats.steps, "step"),
            stats.kv_pages_peak,
            stats.kv_pages,
            ranks_of(&grid)
        );
        status_line(&mut stdout, &summary);
    }
    let _ = stdout.flush();
    let failed: Vec<(usize, &Completion)> =
        done.iter().enumerate().filter(|(_, c)| c.error.is_some()).collect();
    for (i, c) in &failed {
        let e = c.error.as_deref().unwrap_or_default();
        error_line(&format!("{file}:{}: prompt {} of {}: {e}", prompts[*i].spec.line, i + 1, done.len()));
    }
    if failed.is_empty() {
        Ok(())
    } else {
        Err(Reported.into())
    }
}

fn serve(a: ServeArgs) -> Result<()> {
    a.engine.check()?;
    a.batching.check()?;
    at_least(&[("--max-tokens", a.max_tokens, 1), ("--max-in-flight", a.max_in_flight, 1)])?;
    if a.api_key.as_deref().is_some_and(|k| k.trim().is_empty() || k.trim() != k) {
        anyhow::bail!("--api-key (or GRIDLM_API_KEY) must be a key without spaces around it");
    }
    let params = a.sampling.params_over_model(&a.model, a.model_sampling)?;
    on_grid(&a.grid, |grid, comm, link| run_serve(&a, &params, grid, comm, link))
}

fn run_serve(
    a: &ServeArgs,
    params: &SamplingParams,
    grid: Grid,
    comm: &dyn Comm,
    link: &dyn Link,
) -> Result<()> {
    use gridlm::serve::{self, Front, Served};
    let driver = grid.rank == 0;
    // SIGUSR1, which mpirun passes on to every rank, drains the server: every rank lives on
    // through it, and the driver stops listening, answers what it has, then ends the job.
    let drain = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    // Phase 1: configuration, layout, and (driver) tokenizer and the listening socket.
    let setup = (|| -> gridlm::Result<_> {
        signal_hook::flag::register(signal_hook::consts::SIGUSR1, std::sync::Arc::clone(&drain))
            .map_err(|e| gridlm::Error::Input(format!("cannot take SIGUSR1 (to drain the server): {e}")))?;
        let cfg = ModelConfig::from_dir(&a.model)?;
        let plan = ShardPlan::new(&cfg, &grid, a.grid.layers.as_deref())?;
        let front = if driver {
            let tok = Tokenizer::from_dir(&a.model)?;
            let server = gridlm::http::Server::bind(&a.listen).map_err(|e| {
                gridlm::Error::Input(format!("--listen {}: cannot listen there: {e}", a.listen))
            })?;
            // The vocabulary as the grammar engine reads it, for structured output (requests
            // asking for it are refused with the reason where it cannot be read).
            let grammars = Grammars::new(&tok, cfg.vocab_size, &eos_ids(cfg.eos_token_ids.clone(), &tok))
                .map_err(|e| e.to_string());
            Some((tok, server, grammars))
        } else {
            None
        };
        Ok((cfg, plan, front))
    })();
    let (cfg, plan, front) = agree(link, setup)?;
    // Phase 2: this rank's shard.
    let cfg_eos = cfg.eos_token_ids.clone();
    let mut engine = open_engine(link, &a.model, (cfg, plan, grid), &a.engine)?;
    engine.share_sizes(link);
    let micro_batches = a.batching.overlap.micro_batches(grid.pp);
    engine.pick_many_prefetch(a.batching.max_batch.div_ceil(micro_batches));
    let Some((tok, server, grammars)) = front else {
        engine.follow(comm, link)?;
        return agree(link, Ok(()));
    };
    let eos_ids = eos_ids(cfg_eos, &tok);
    let mut opts = a.batching.options(grid.pp, eos_ids);
    opts.grammars = grammars.as_ref().ok().cloned();
    let context = engine.max_context();
    // KV pages for max-batch requests at the full context, where the KV memory allows.
    let want = a.batching.max_batch.saturating_mul(context.div_ceil(gridlm::model::PAGE));
    let name = a.name.clone().unwrap_or_else(|| {
        let dir = a.model.canonicalize().unwrap_or_else(|_| a.model.clone());
        dir.file_name().map_or_else(|| "model".into(), |n| n.to_string_lossy().into_owned())
    });
    let addr = server.local_addr().map_or_else(|_| a.listen.clone(), |a| a.to_string());
    let tok = std::sync::Arc::new(tok);
    let (tx, rx) = std::sync::mpsc::channel();
    let front = Front {
        tok: std::sync::Arc::clone(&tok),
        model: name.clone(),
        context,
        vocab: engine.shard.cfg.vocab_size,
        grammars,
        defaults: serve::Defaults {
            max_tokens: a.max_tokens,
            template_vars: a.chat_template_kwargs.clone().unwrap_or_default(),
            params: params.clone(),
            tool_parser: a.tool_call_parser,
            pooling: match a.pooling {
                Some(p) => Ok(p),
                None => gridlm::embeddings::folder_pooling(&a.model).map(|p| p.unwrap_or(Pooling::Last)),
            },
        },
        tx,
        count: Default::default(),
        created: serve::now_s(),
        api_key: a.api_key.clone(),
        max_in_flight: a.max_in_flight,
        in_flight: Default::default(),
        metrics: Default::default(),
        allow_origins: a.allow_origins.clone(),
    };
    SERVING.store(true, std::sync::atomic::Ordering::Relaxed);
    // Requests are taken, and the address announced, once every rank has its KV pool in place
    // (written through, ~2 s a GB): before, the first request waited for it.
    let ranks = ranks_of(&grid);
    let open = Box::new(move || {
        serve::start(server, front, drain);
        let mut stdout = std::io::stdout();
        writeln!(stdout, "gridlm serve: {name} on http://{addr}/v1 ({ranks})")?;
        stdout.flush()
    });
    let run = engine.drive(&mut Served::new(rx, tok, open), &opts, want, comm, link);
    engine.finish(comm, link)?;
    agree(link, run.map(|_| ()).map_err(|e| gridlm::Error::Input(e.to_string())))
}

/// The first of the options `(name, value, least)` whose value is below its least, as one
/// error naming it. An option that may be left out passes as its least when it is.
fn at_least(options: &[(&str, usize, usize)]) -> Result<()> {
    match options.iter().find(|(_, value, least)| value < least) {
        Some((name, value, least)) => anyhow::bail!("{name} must be at least {least}, got {value}"),
        None => Ok(()),
    }
}

/// The rank reports as `generate --json` prints them: without bench's `baseline_*` keys, which
/// only a bench comparison fills.
fn generate_rank_values(ranks: Vec<RankReport>) -> Vec<serde_json::Value> {
    ranks
        .into_iter()
        .map(|r| {
            let mut v = serde_json::to_value(r).unwrap_or_default();
            if let Some(o) = v.as_object_mut() {
                o.retain(|k, _| !k.starts_with("baseline_"));
            }
            v
        })
        .collect()
}

/// Adds `extra`'s keys to the JSON object `out`.
fn merge(out: &mut serde_json::Value, extra: &serde_json::Value) {
    if let (Some(o), Some(e)) = (out.as_object_mut(), extra.as_object()) {
        o.extend(e.iter().map(|(k, v)| (k.clone(), v.clone())));
    }
}

fn bench(a: BenchArgs) -> Result<()> {
    a.engine.check()?;
    a.work.check()?;
    at_least(&[
        ("--reps", a.reps, 1),
        ("--step-tokens", a.step_tokens.unwrap_or(1), 1),
        ("--compare-batch", a.compare_batch.unwrap_or(1), 1),
    ])?;
    a.overlap.check()?;
    if let Some(b) = a.compare_batch.filter(|&b| b == a.work.batch) {
        anyhow::bail!("--compare-batch {b} is --batch itself: give another size");
    }
    let params = a.sampling.params(&SamplingParams::default())?;
    if a.limits {
        return on_grid(&a.grid, |_, _, link| run_limits(&a, link));
    }
    on_grid(&a.grid, |grid, comm, link| run_bench(&a, &params, grid, comm, link))
}

/// A warning (from each node's first rank) where the bandwidth probe's buffer of `mib` MiB is
/// not far larger than the last-level cache: its reads then come partly from the cache, and
/// the bandwidth and every efficiency set against it are not the memory's.
fn warn_if_probe_fits_cache(mib: usize) {
    let llc = host::last_level_cache_bytes(Path::new("/sys/devices/system/cpu"));
    if let Some(llc) = llc.filter(|&b| mib << 20 < 4 * b) {
        if gridlm::comm::mpi::local_rank() == 0 {
            let line = format!(
                "warning: --bandwidth-mib {mib} is less than 4 times the {} MiB last-level cache: \
                 the bandwidth read is partly the cache's, not the memory's\n",
                llc >> 20
            );
            let _ = std::io::stderr().write_all(line.as_bytes());
        }
    }
}

/// `bench --limits`: every rank measures with its own threads at the same time; the sums are
/// what the job's ranks get together.
fn run_limits(a: &BenchArgs, link: &dyn Link) -> Result<()> {
    let threads = a.engine.threads();
    let team = agree(
        link,
        gridlm::kernels::Team::new(threads)
            .map_err(|e| gridlm::Error::Input(format!("cannot start {threads} kernel threads: {e}"))),
    )?;
    a.engine.warn_if_oversubscribed();
    warn_if_probe_fits_cache(a.bandwidth_mib);
    // The probe's buffer is held until every figure is taken: once freed, its pages go back
    // to the host on these cores (see `ReadProbe`).
    let probe = gridlm::kernels::limits::ReadProbe::new(a.bandwidth_mib << 20);
    let bw = probe.best(&team, 5).0;
    // One core reading alone (every rank's main thread at once): what a rank reads while the
    // others wait, for `plan` (with one thread a rank, the same reading).
    let core = if threads == 1 {
        bw
    } else {
        let one = gridlm::kernels::Team::new(1)
            .map_err(|e| anyhow::anyhow!("cannot start a kernel thread: {e}"))?;
        probe.best(&one, 5).0
    };
    // The bf16 peak NaN where this CPU's bf16 kernels multiply with f32 FMAs (no `vdpbf16ps`).
    let (peak, bf16) = gridlm::kernels::limits::peaks_gflops(&team);
    let bf16 = bf16.unwrap_or(f64::NAN);
    let handoff = gridlm::kernels::limits::handoff_us(&team, 1000);
    drop(probe);
    let mut all = vec![0u64; 5 * link.world_size()];
    let mine = [bw, peak, handoff, core, bf16].map(f64::to_bits);
    link.allgather_u64(&mine, &mut all);
    if link.world_rank() != 0 {
        return Ok(());
    }
    let per_rank: Vec<[f64; 5]> =
        all.chunks_exact(5).map(|v| std::array::from_fn(|k| f64::from_bits(v[k]))).collect();
    let (gb, gf) = per_rank.iter().fold((0.0, 0.0), |(x, y), r| (x + r[0], y + r[1]));
    let handoff = per_rank.iter().fold(0.0, |h, r| r[2].max(h));
    let core = per_rank.iter().map(|r| r[3]).sum::<f64>() / per_rank.len() as f64;
    // Unknown (null) unless every rank has it.
    let bf16 = Some(per_rank.iter().map(|r| r[4]).sum::<f64>()).filter(|g| g.is_finite());
    if a.json {
        let ranks: Vec<_> = per_rank
            .iter()
            .map(|r| {
                serde_json::json!({"measured_gb_per_s": r[0], "measured_peak_gflops": r[1], "handoff_us": r[2],
                    "core_gb_per_s": r[3], "measured_bf16_peak_gflops": Some(r[4]).filter(|g| g.is_finite())})
            })
            .collect();
        let out = serde_json::json!({
            "measured_gb_per_s": gb,
            "measured_peak_gflops": gf,
            "measured_bf16_peak_gflops": bf16,
            "core_gb_per_s": core,
            "handoff_us": handoff,
            "threads_per_rank": threads,
            "ranks": ranks,
        });
        writeln!(std::io::stdout(), "{out}")?;
    } else {
        let bf16 = bf16.map(|g| format!(", bf16 dot peak {g:.1} GFLOP/s")).unwrap_or_default();
        writeln!(
            std::io::stdout(),
            "{} rank(s) × {threads} thread(s): read bandwidth {gb:.1} GB/s (one thread alone {core:.1}), \
             f32 FMA peak {gf:.1} GFLOP/s{bf16}, kernel-thread handoff {handoff:.2} µs",
            per_rank.len()
        )?;
    }
    Ok(())
}

fn run_bench(
    a: &BenchArgs,
    params: &SamplingParams,
    grid: Grid,
    comm: &dyn Comm,
    link: &dyn Link,
) -> Result<()> {
    let threads = a.engine.threads();
    // Micro-batches of a run of `batch` sequences, and whether their steps overlap.
    let micro = |batch: usize| a.overlap.micro_batches(grid.pp).min(batch);
    let overlapped = |batch: usize| micro(batch) > 1 && !a.overlap.no_overlap;
    let micro_batches = micro(a.work.batch);
    let tokens_per_step = a.work.batch.div_ceil(micro_batches);
    let setup = (|| -> gridlm::Result<_> {
        if a.model.is_some() && a.shape_layers.is_some() {
            let msg = "--shape-layers needs --shape (it cuts a named shape; a --model folder is read whole)";
            return Err(gridlm::Error::Input(msg.into()));
        }
        let cfg = match (&a.model, &a.shape) {
            (Some(dir), _) => ModelConfig::from_dir(dir)?,
            (None, Some(name)) => match a.shape_layers {
                Some(n) => synthetic::first_layers(synthetic::shape(name)?, n)?,
                None => synthetic::shape(name)?,
            },
            (None, None) => unreachable!("clap requires --model or --shape"),
        };
        let plan = ShardPlan::new(&cfg, &grid, a.grid.layers.as_deref())?;
        a.work.check_context(&cfg)?;
        let one_token_way = match (a.compare_prefetch, a.compare_streams) {
            (Some(way), _) => Some(("--compare-prefetch", way.name(), "prefetch")),
            (None, Some(way)) => Some(("--compare-streams", way.name(), "streams")),
            (None, None) => None,
        };
        if let Some((option, way, what)) = one_token_way.filter(|_| tokens_per_step > 1) {
            return Err(gridlm::Error::Input(format!(
                "{option} {way}: --batch {} decodes {} tokens a step, through the many-token kernels, which the one-token {what} does not touch; use --batch 1 (or --micro-batches {})",
                a.work.batch,
                tokens_per_step,
                a.work.batch
            )));
        }
        Ok((cfg, plan))
    })();
    let (cfg, plan) = agree(link, setup)?;
    let full_cfg = cfg.clone();
    let rss_before = host::rss_bytes();
    let open = || match &a.model {
        Some(dir) => a.engine.source(dir),
        None => {
            let dtype = a.engine.dtype.unwrap_or(DType::BF16);
            Ok(Box::new(synthetic::Synthetic { dtype, seed: 0x6772_6964 }) as Box<dyn Source>)
        }
    };
    let shard = load_shard(link, open(), cfg.clone(), plan.clone(), a.engine.quant)?;
    let mut engine = agree(link, Engine::new(shard, grid, threads, a.engine.kv_dtype))?;
    a.engine.warn_if_oversubscribed();
    let weight_rss = host::rss_bytes().saturating_sub(rss_before);
    engine.share_sizes(link);
    let unpicked = engine.many_prefetch();
    engine.pick_many_prefetch(tokens_per_step);
    // The baseline's batch size (`--compare-batch`), else the same.
    let base_batch = a.compare_batch.unwrap_or(a.work.batch);
    // Each batch size runs under the many-token way picked at its own tokens a step (the
    // baseline's, with `--compare-batch`, set before each of its runs; the main side's after).
    let main_many = engine.many_prefetch();
    let base_many = a.compare_batch.map(|_| {
        engine.set_many_prefetch(unpicked);
        engine.pick_many_prefetch(base_batch.div_ceil(micro(base_batch)));
        let picked = engine.many_prefetch();
        engine.set_many_prefetch(main_many);
        picked
    });
    // `--compare-prefetch`: the one-token way the baseline runs under, beside the rank's own.
    let main_prefetch = engine.prefetch();
    let base_prefetch = a.compare_prefetch.map(|way| (way, PrefetchBy::Compared));
    // `--compare-streams`: the streams the baseline's one-token products read in.
    let main_streams = engine.streams();
    let base_streams = a.compare_streams.map(|way| (way, PrefetchBy::Compared));
    // `--compare-unquantized`: the same layers unquantized, loaded beside the quantized ones
    // and run in turn with them on the same kernel threads (see the run schedule below).
    let mut spare = None;
    if a.compare_unquantized {
        let shard = load_shard(link, open(), cfg, plan, None)?;
        spare = Some(agree(link, engine.spare_weights(shard, tokens_per_step))?);
    }

    // The machine's limits, measured by every rank at once with its own kernel team, summed: the
    // same threads that run the kernels, competing for the same memory.
    // The FMA peak and the fastest read (and the way of reading that made it) are measured
    // before and after the timed runs; each rank's best of the two counts, so a passing
    // disturbance of the machine during one measurement does not lower them.
    warn_if_probe_fits_cache(a.bandwidth_mib);
    let probe = std::rc::Rc::new(gridlm::kernels::limits::ReadProbe::new(a.bandwidth_mib << 20));
    // The bf16 dot-product peak is NaN where the bf16 kernels have no `vdpbf16ps`.
    let limits = |engine: &Engine| {
        let (gb, way) = probe.best(engine.team(), 5);
        let (peak, bf16) = gridlm::kernels::limits::peaks_gflops(engine.team());
        (gb, way, peak, bf16.unwrap_or(f64::NAN))
    };
    let before = limits(&engine);
    // Decode is set against the bandwidth of the same moments: reads in that way, just before
    // the first timed run and after each one, every read counted. On a machine whose
    // bandwidth wanders (a shared host), the fastest read of the whole run would hold decode
    // to the best moment while its own time is an average over all of them. Every reading
    // reads the one probe buffer, held until the end (see `ReadProbe` for why).
    // With each reading, the team's handoff (see `handoff_us`): how far apart its cores are
    // at that moment, which sets what every product's start and end cost.
    // Between steps instead (`--bandwidth-reads`, the default): a slice of the buffer (the
    // same one each time, read once a step as the weights are) after every step, every rank
    // at once (`Plan::Read`), its time left out of the step times; a run's bandwidth is the
    // harmonic mean of the median rates of stretches of its readings (see `run_gb_per_s`: the
    // bandwidth may change within a run, and one paused reading must not halve it). Decode
    // and the reads then meet the same moments, where the readings around a run are seconds
    // from most of its steps. Steps that overlap in a pipeline leave no moment between them,
    // so those runs are read around.
    let between = a.bandwidth_reads == BandwidthReads::BetweenSteps
        && !overlapped(a.work.batch)
        && !overlapped(base_batch);
    let log = std::rc::Rc::new(std::cell::RefCell::new(Vec::new()));
    if between {
        let (probe, log, way) = (probe.clone(), log.clone(), before.1);
        engine.set_reader(Some(Box::new(move |team, side| {
            log.borrow_mut().push((side, probe.rate_slice(team, way, READ_PARTS)));
        })));
    }
    let mut readings = Vec::new();
    let mut by_run = Vec::new();
    let mut handoffs = Vec::new();
    // And the CPU time the host has taken from the rank's CPUs so far (NaN where unknown),
    // with the time of the reading.
    let mut stolen = Vec::new();
    let clock = std::time::Instant::now();
    let mut read_around = |engine: &Engine| {
        if !between {
            readings.push(probe.rate(engine.team(), before.1, 4));
        }
        handoffs.push(gridlm::kernels::limits::handoff_us(engine.team(), 1000));
        stolen.push((gridlm::host::stolen_ms().unwrap_or(f64::NAN), clock.elapsed().as_secs_f64()));
    };
    let driver = grid.rank == 0;
    let vocab = full_cfg.vocab_size as u64;
    // Driver: seeded random prompt ids.
    let prompts: Vec<Vec<u32>> = (0..a.work.batch.max(base_batch) as u64)
        .map(|b| {
            (0..a.work.prompt_len as u64)
                .map(|i| (((i + 7919 * b).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 17) % vocab) as u32)
                .collect()
        })
        .collect();
    let requests: Vec<Request> = prompts
        .iter()
        .map(|p| Request {
            prompt: p.clone(),
            max_tokens: a.work.new_tokens,
            ignore_eos: true,
            params: params.clone(),
            keep_logits: false,
            logprobs: None,
            prompt_logprobs: None,
            rules: TokenRules::default(),
            format: None,
            grammar: None,
            embed: None,
        })
        .collect();
    let options = |batch: usize| RunOptions {
        max_batch: batch,
        micro_batches: micro(batch),
        overlap: !a.overlap.no_overlap,
        step_tokens: a.step_tokens.unwrap_or(batch.div_ceil(micro(batch)) * a.work.prompt_len),
        // As much as the batch needs at full length, so that every sequence runs from the
        // first step to the last (a pool that holds fewer would have some wait, and the
        // figures would be those of a smaller batch); more than the memory holds is an error.
        kv_bytes: Some(usize::MAX),
        eos_ids: Vec::new(),
        read_between_steps: between,
        sides: None,
        // Every rep runs its prompts whole: a measurement of prefill, not of the cache.
        prefix_cache: false,
        speculate: 0,
        grammars: None,
    };
    // Each side's requests (the first prompts of one list) and options.
    let work =
        [(&requests[..a.work.batch], options(a.work.batch)), (&requests[..base_batch], options(base_batch))];
    // With a baseline, both sides run in one run, step by step in turn (`RunOptions::sides`),
    // where each side is one micro-batch: both then meet the same moments of the host, where
    // whole runs in turn a second apart can meet reads that differ by half (on the 2-core Zen 4
    // machine int8 against bf16 came out at 1.47x where the same runs at the same reads gave
    // 1.90x). Micro-batches of a pipeline keep whole runs in turn: each side's steps overlap
    // with its own.
    let comparing =
        spare.is_some() || a.compare_batch.is_some() || base_prefetch.is_some() || base_streams.is_some();
    let stepwise = comparing && micro(a.work.batch) == 1 && micro(base_batch) == 1;
    // Step by step, the one run of both: the main side's requests, then the baseline's.
    let both = stepwise.then(|| {
        let requests: Vec<Request> = work[0].0.iter().chain(work[1].0).cloned().collect();
        let opts = RunOptions {
            max_batch: requests.len(),
            micro_batches: 1,
            overlap: false,
            step_tokens: work[0].1.step_tokens.max(work[1].1.step_tokens),
            sides: Some(a.work.batch),
            ..options(a.work.batch)
        };
        (requests, opts)
    });
    // With spare weights, each side's weight dtype (the progress lines name the sides by it).
    let spare_dtypes = spare
        .as_ref()
        .map(|s| [engine.shard.weight_dtype().to_string(), s.shard().weight_dtype().to_string()]);
    if stepwise {
        // The engine holds the baseline's weights or prefetch way beside its own, and each
        // step says whose it runs on.
        let other = match (spare.take(), base_prefetch, base_streams) {
            (Some(spare), _, _) => gridlm::engine::OtherSide::Weights(Box::new(spare)),
            (None, Some(way), _) => gridlm::engine::OtherSide::Prefetch(way),
            (None, None, Some(way)) => gridlm::engine::OtherSide::Streams(way),
            (None, None, None) => gridlm::engine::OtherSide::ManyPrefetch(base_many.unwrap_or(main_many)),
        };
        engine.set_other_side(Some(other));
    }
    // The runs in order: each a run of the main side or of the baseline, a warm-up or a timed
    // rep (step by step, each run is both: `Side::Main` stands for it). Otherwise, with a
    // baseline, every warm-up and rep runs both, one right after the other, which goes first
    // alternating from rep to rep (AB, BA, ...) so that neither always meets the later moment
    // of a host whose bandwidth drifts.
    let sides = |k: usize| match (comparing && !stepwise, k % 2) {
        (false, _) => &[Side::Main][..],
        (true, 0) => &[Side::Baseline, Side::Main][..],
        (true, _) => &[Side::Main, Side::Baseline][..],
    };
    let schedule: Vec<(Side, Run)> = (0..a.warmup)
        .flat_map(|i| sides(0).iter().map(move |&w| (w, Run::Warmup(i))))
        .chain((0..a.reps).flat_map(|k| sides(k).iter().map(move |&w| (w, Run::Rep(k)))))
        .collect();
    // The sides a run measures: step by step both, in side order.
    let measures = |side: Side| -> &'static [Side] {
        match (stepwise, side) {
            (true, _) => &[Side::Main, Side::Baseline],
            (false, Side::Main) => &[Side::Main],
            (false, Side::Baseline) => &[Side::Baseline],
        }
    };
    // Per timed side of a run, in order: its side (known on every rank); and on the driver,
    // per side, each timed run's first-token latency and decode rate, and the gaps between
    // tokens.
    let timed: Vec<Side> =
        schedule.iter().filter(|r| matches!(r.1, Run::Rep(_))).flat_map(|r| measures(r.0).to_vec()).collect();
    let mut measured: [Measured; 2] = Default::default();
    // The side whose weights the engine holds (the baseline's only with spare weights).
    let mut holding = Side::Main;
    let mut main_profile = engine.profile();
    let mut failed = None;
    for (n, &(side, run)) in schedule.iter().enumerate() {
        // The driver's outcome of this run (every other rank's is `Ok`).
        let mut outcome = Ok(());
        if let Some(spare) = spare.as_mut().filter(|_| side != holding) {
            engine.swap_weights(spare);
            holding = side;
        }
        if let Some(base_many) = base_many.filter(|_| !stepwise) {
            engine.set_many_prefetch(if side == Side::Main { main_many } else { base_many });
        }
        if let Some(base_prefetch) = base_prefetch.filter(|_| !stepwise) {
            engine.set_prefetch(if side == Side::Main { main_prefetch } else { base_prefetch });
        }
        if let Some(base_streams) = base_streams.filter(|_| !stepwise) {
            engine.set_streams(if side == Side::Main { main_streams } else { base_streams });
        }
        if n == a.warmup * sides(0).len() {
            read_around(&engine);
        }
        // Each run ends with `End`, so every rank is free to read the buffer after it.
        if !driver {
            engine.follow(comm, link)?;
        } else {
            let label = |side: Side| {
                let mut label = match run {
                    Run::Warmup(i) => format!("warm-up {}/{}", i + 1, a.warmup),
                    Run::Rep(k) => format!("rep {}/{}", k + 1, a.reps),
                };
                let other = if side == Side::Main { Side::Baseline } else { Side::Main };
                let name = |side: Side| match (&spare_dtypes, base_prefetch, base_streams) {
                    (Some(d), _, _) => d[side as usize].clone(),
                    (None, Some(base), _) => {
                        let way = if side == Side::Main { main_prefetch.0 } else { base.0 };
                        format!("prefetch {}", way.name())
                    }
                    (None, None, Some(base)) => {
                        let way = if side == Side::Main { main_streams.0 } else { base.0 };
                        format!("streams {}", way.name())
                    }
                    (None, None, None) => format!("batch {}", work[side as usize].0.len()),
                };
                if stepwise {
                    label += &format!(" ({}, step by step with {})", name(side), name(other));
                } else if comparing {
                    label += &format!(" ({})", name(side));
                }
                label
            };
            let (requests, opts) = match &both {
                Some((requests, opts)) => (&requests[..], opts),
                None => (work[side as usize].0, &work[side as usize].1),
            };
            let result = engine.run(requests, opts, comm, link, |_, _| Ok(true));
            engine.finish(comm, link)?;
            match result {
                Ok(done) => {
                    // Each side's sequences: step by step, the main side's first.
                    let mut rest = &done[..];
                    for &side in measures(side) {
                        let (mine, more) = rest.split_at(work[side as usize].0.len().min(rest.len()));
                        rest = more;
                        // Every sequence's first token; decode measured while all of them decode.
                        let first = percentile(&mine.iter().map(|c| c.times_ms[0]).collect::<Vec<_>>(), 0.5);
                        let times: Vec<&[f64]> = mine.iter().map(|c| &c.times_ms[..]).collect();
                        let (tps, g) = decode_window(&times).unwrap_or((0.0, Vec::new()));
                        let line = format!(
                            "bench: {}: first token {first:.1} ms, decode {tps:.1} tokens/s\n",
                            label(side)
                        );
                        let _ = std::io::stderr().write_all(line.as_bytes());
                        if let Run::Rep(_) = run {
                            let m = &mut measured[side as usize];
                            m.firsts.push(first);
                            m.rates.push(tps);
                            m.digests.push(tokens_digest(mine.iter().map(|c| &c.token_ids[..])));
                            m.gaps.extend(g);
                        }
                    }
                }
                Err(e) => outcome = Err(e),
            }
        }
        // The driver's outcome decides for every rank whether the runs go on; a failure is
        // every rank's to report, once the collectives below are done.
        if let Err(msg) = link.agree(outcome.as_ref().map(|_| ()).map_err(|e| e.to_string())) {
            failed = Some(msg);
            break;
        }
        if side == Side::Main {
            main_profile = engine.profile();
        }
        // The readings taken between this run's steps (the warm-up's are dropped), each side's
        // after its own steps; one after the run where a side's steps left no moment between
        // them (a single new token).
        let run_log = std::mem::take(&mut *log.borrow_mut());
        if let Run::Rep(_) = run {
            if between {
                for &s in measures(side) {
                    let step_side = if stepwise { s as u8 } else { 0 };
                    let mut mine: Vec<(f64, f64)> =
                        run_log.iter().filter(|r| r.0 == step_side).map(|r| r.1).collect();
                    if mine.is_empty() {
                        mine.push(probe.rate_slice(engine.team(), before.1, READ_PARTS));
                    }
                    by_run.push(run_gb_per_s(&mine));
                }
            }
            read_around(&engine);
        }
    }
    // The rank's own weights again, and the main side's many-token way, for its report.
    if stepwise {
        if let Some(gridlm::engine::OtherSide::Weights(s)) = engine.set_other_side(None) {
            spare = Some(*s);
        }
    }
    if let Some(spare) = spare.as_mut().filter(|_| holding != Side::Main) {
        engine.swap_weights(spare);
    }
    engine.set_many_prefetch(main_many);
    engine.set_prefetch(main_prefetch);
    engine.set_streams(main_streams);
    let after = limits(&engine);
    // The resident memory reported below is the engine's, without the probe's buffer.
    engine.set_reader(None);
    drop(probe);
    // Per timed side, its run's figures (step by step both sides share their run's).
    let per_side = |per_run: Vec<f64>| -> Vec<f64> {
        per_run.into_iter().flat_map(|x| std::iter::repeat_n(x, if stepwise { 2 } else { 1 })).collect()
    };
    if !between {
        by_run = per_side(gb_per_s_around_runs(&readings));
    }
    let handoff_by_side = per_side(mean_around_runs(&handoffs));
    // The time stolen between two readings, and as a share of the rank's CPUs' time.
    let cpus = gridlm::host::own_cpus() as f64;
    let (stolen_by_run, share_by_run): (Vec<f64>, Vec<f64>) = stolen
        .windows(2)
        .map(|w| {
            let ms = w[1].0 - w[0].0;
            (ms, ms / ((w[1].1 - w[0].1) * 1e3 * cpus).max(1e-9))
        })
        .unzip();
    let (stolen_by_side, share_by_side) = (per_side(stolen_by_run), per_side(share_by_run));
    // Every rank read as often (all leave the runs together), so all send as many figures:
    // the limits, the median handoff, then per timed side its bandwidth, handoff, stolen time
    // and share. Bandwidths and peaks add up over ranks (the bf16 peak NaN, unknown, where a
    // rank has none); the handoff and the stolen time and share are the most any rank had
    // (NaN where any rank does not know its stolen time).
    let runs = by_run.len().min(handoff_by_side.len());
    const HEAD: usize = 4;
    let head: [f64; HEAD] =
        [before.0.max(after.0), before.2.max(after.2), percentile(&handoffs, 0.5), before.3.max(after.3)];
    let mine: Vec<u64> = head
        .into_iter()
        .chain(by_run.into_iter().take(runs))
        .chain(handoff_by_side.into_iter().take(runs))
        .chain(stolen_by_side.into_iter().take(runs))
        .chain(share_by_side.into_iter().take(runs))
        .map(f64::to_bits)
        .collect();
    let mut all = vec![0u64; mine.len() * link.world_size()];
    link.allgather_u64(&mine, &mut all);
    let of_ranks = || all.chunks_exact(mine.len());
    let sum = |k: usize| of_ranks().map(|v| f64::from_bits(v[k])).sum::<f64>();
    // The most of any rank; NaN (unknown) where a rank's is.
    let max = |k: usize| {
        let v = || of_ranks().map(|v| f64::from_bits(v[k]));
        if v().any(f64::is_nan) {
            f64::NAN
        } else {
            v().fold(0.0, f64::max)
        }
    };
    let (best_gb_per_s, measured_peak_gflops, handoff_us) = (sum(0), sum(1), max(2));
    let measured_bf16_peak_gflops = Some(sum(3)).filter(|g| g.is_finite());
    let read_by_run = gridlm::bench::ByRun {
        gb_per_s: (HEAD..HEAD + runs).map(sum).collect(),
        handoff_us: (HEAD + runs..HEAD + 2 * runs).map(max).collect(),
        stolen_ms: (HEAD + 2 * runs..HEAD + 3 * runs).map(max).collect(),
        stolen_share: (HEAD + 3 * runs..HEAD + 4 * runs).map(max).collect(),
    };
    // The baseline's weights (the spare ones, or the same) and bytes a step of its batch
    // (every rank's; a mixture of experts reads more of them as a step has more tokens), then
    // the report's resident memory without the spare weights.
    let base_weights = comparing.then(|| {
        let shard = spare.as_ref().map_or(&engine.shard, |spare| spare.shard());
        let mut all = vec![0u64; link.world_size()];
        let base_tokens = base_batch.div_ceil(micro(base_batch));
        link.allgather_u64(&[shard.bytes_per_step(base_tokens) as u64], &mut all);
        (shard.weight_dtype().to_string(), all.iter().sum::<u64>())
    });
    drop(spare.take());
    let base_ways = (base_prefetch, base_many, base_streams);
    let ranks = gather_rank_reports(link, &engine, main_profile, weight_rss, base_ways, tokens_per_step);
    if let Some(msg) = failed {
        return Err(Agreed(msg).into());
    }
    if !driver {
        return Ok(());
    }

    // Each micro-batch's decode step reads every rank's weights once.
    let weight_bytes_per_step: u64 = ranks.iter().map(|r| r.bytes_per_token).sum();
    let weight_bytes_per_token = weight_bytes_per_step * micro_batches as u64 / a.work.batch as u64;
    // Each decode token's attention reads its own sequence's keys and values, on every rank.
    let kv_per_position: u64 = ranks.iter().map(|r| r.kv_bytes_per_position).sum();
    let positions = kv_positions_per_layer_token(&full_cfg, a.work.prompt_len, a.work.new_tokens);
    let kv_bytes_per_token = (kv_per_position as f64 * positions).round() as u64;
    // Each side's figures from its own runs.
    let figures = |side: Side, weight_bytes_per_token: u64| {
        // Per timed side, in order: this side's.
        let side_by_run = read_by_run.only(|k| timed.get(k) == Some(&side));
        DecodeFigures::new(&measured[side as usize], weight_bytes_per_token, kv_bytes_per_token, &side_by_run)
    };
    let decode = figures(Side::Main, weight_bytes_per_token);
    let first_token_ms = decode.first_token_ms;
    let prefill_gflops =
        a.work.batch as f64 * prefill_flops(&full_cfg, a.work.prompt_len) / (first_token_ms / 1e3) / 1e9;
    let baseline = comparing.then(|| {
        let (weight_dtype, bytes_per_step) = base_weights.unwrap_or_default();
        let weight_bytes_per_token = bytes_per_step * micro(base_batch) as u64 / base_batch as u64;
        let alternated = if stepwise { Alternated::Steps } else { Alternated::Runs };
        Baseline::new(
            weight_dtype,
            base_batch,
            base_prefetch.map(|way| way.0.name().to_string()),
            base_streams.map(|way| way.0.name().to_string()),
            figures(Side::Baseline, weight_bytes_per_token),
            &decode,
            alternated,
        )
    });
    let report = BenchReport {
        model: match (&a.model, &a.shape) {
            (Some(d), _) => d.display().to_string(),
            (_, Some(s)) => match a.shape_layers {
                Some(1) => format!("{s}, its first layer (synthetic)"),
                Some(n) => format!("{s}, its first {n} layers (synthetic)"),
                None => format!("{s} (synthetic)"),
            },
            _ => String::new(),
        },
        weight_dtype: engine.shard.weight_dtype().to_string(),
        kv_dtype: engine.kv_dtype().name().to_string(),
        pp: grid.pp,
        tp: grid.tp,
        threads_per_rank: engine.threads(),
        prompt_len: a.work.prompt_len,
        new_tokens: a.work.new_tokens,
        batch: a.work.batch,
        micro_batches,
        overlap: !a.overlap.no_overlap,
        temperature: params.temperature,
        reps: a.reps,
        decode,
        prefill_tokens_per_s: (a.work.batch * a.work.prompt_len) as f64 / (first_token_ms / 1e3),
        bandwidth_reads: if between { "between_steps" } else { "around_runs" },
        best_gb_per_s,
        prefill_gflops,
        measured_peak_gflops,
        prefill_efficiency: prefill_gflops / measured_peak_gflops,
        measured_bf16_peak_gflops,
        prefill_bf16_efficiency: measured_bf16_peak_gflops
            .filter(|_| engine.shard.weight_dtype() == "bf16")
            .map(|g| prefill_gflops / g),
        handoff_us,
        baseline,
        ranks,
    };
    let mut stdout = std::io::stdout().lock();
    if a.json {
        for w in report.warnings() {
            let _ = std::io::stderr().write_all(format!("bench: {w}\n").as_bytes());
        }
        writeln!(stdout, "{}", serde_json::to_string(&report)?)?;
    } else {
        write!(stdout, "{}", report.table())?;
    }
    Ok(())
}
