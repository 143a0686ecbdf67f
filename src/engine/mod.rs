//! The generation loop over the grid. Owns: the kernel thread team, this rank's KV pool and
//! buffers, the step plans the driver sends, the pipeline hand-off between stages, and the
//! choice of the next token across a stage's vocabulary shards (greedy here, sampling in
//! [`sampling`]). The driver's scheduler ([`scheduler`]) decides what each step holds. Knows
//! nothing about SIMD or MPI types.
//!
//! ```text
//! driver (world rank 0)              every rank of stage 0        stage s > 0, rank (s, t)
//!   plan = Step{admit, spans,  ──►   broadcast in stage ──►       recv plan + hidden from (s-1, t)
//!                tokens}             embed, layers,               layers, then either send to
//!   (up to one per micro-batch       send plan + hidden ─────►    (s+1, t), or (last stage) logits,
//!    in flight)                                                   pick, allgather, tokens to rank 0
//!   tokens ◄─────────────────────────────────────────────────────
//! ```

mod prefix;
pub mod sampling;
pub mod scheduler;
mod wire;

use crate::comm::{Comm, CommTimes, Link, Tag};
use crate::error::{Error, Result};
use crate::grid::{vocab_range, Grid};
use crate::kernels::{self, Team};
use crate::model::{KvCache, Scratch, Shard, Span, PAGE};
use crate::weights::DType;
use sampling::SamplingParams;
pub use scheduler::{Completion, Request, RunOptions, Traffic};
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;

/// Why a sequence ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Finish {
    /// An end-of-sequence token was produced.
    Eos,
    /// `max_tokens` were produced.
    Length,
    /// The model's context is full.
    Context,
    /// A stop string appeared (or the caller stopped the sequence).
    Stop,
    /// The sequence could not run (see its error).
    Error,
}

impl Finish {
    /// Its name, as in `finish_reason` of the JSON reports.
    pub fn name(self) -> &'static str {
        match self {
            Finish::Eos => "eos",
            Finish::Length => "length",
            Finish::Context => "context",
            Finish::Stop => "stop",
            Finish::Error => "error",
        }
    }
}

/// What every rank does next; made by the driver, encoded with bincode, passed down the grid.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum Plan {
    /// A KV pool of `pages` pages and `slots` sequence slots, replacing any before; no step
    /// holds more than `chunk` positions of one sequence (the KV rings are sized by it), nor
    /// more than `rows` rows of the output head but a prompt's last chunks' (the slots, and
    /// their drafts: the buffers of decoding are sized for them).
    Begin {
        pages: usize,
        slots: usize,
        chunk: usize,
        rows: usize,
    },
    Step(Step),
    /// Every rank calls its reader ([`Engine::set_reader`]), then waits for all the others to
    /// be done: a measurement taken between steps, at the same moment on every rank.
    Read,
    /// The driver has nothing to do for now: every other rank sleeps until it wakes them
    /// (before its next plan).
    Idle,
    /// The job is over.
    End,
}

/// A sequence taking a slot: its KV pages (in position order), how it picks tokens and
/// whether its tokens' log-probabilities are reported (with how many alternatives).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Admit {
    pub slot: usize,
    pub pages: Vec<u32>,
    pub params: SamplingParams,
    pub logprobs: Option<usize>,
    /// The prompt's first tokens, whose keys and values the sequence's first pages hold
    /// already (from the prefix cache): never sent in a span, but part of its history.
    pub history: Vec<u32>,
    pub prompt_len: usize,
    /// Biases added to some tokens' logits before they are picked ([`sampling::TokenRules`]).
    pub logit_bias: Vec<(u32, f32)>,
    /// The tokens that end the sequence (its end-of-sequence tokens unless they are ignored,
    /// and its stop tokens): never picked as its first `min_tokens` tokens.
    pub enders: Vec<u32>,
    pub min_tokens: usize,
}

/// The most alternatives a token's log-probabilities list ([`TokenLogprobs::top`]).
pub const MAX_LOGPROBS: usize = 20;

/// A generated token's log-probability, and the most likely tokens' at its position, under
/// the model's own distribution: the log-softmax of the output head's logits (after a final
/// soft-cap, Gemma 2's), before any repetition penalty or temperature, so they do not depend
/// on how the token was picked.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct TokenLogprobs {
    pub logprob: f32,
    /// The most likely tokens, as many as asked, most likely first (the lower id on ties).
    pub top: Vec<(u32, f32)>,
}

/// One step of one micro-batch: sequences admitted first, then `tokens`, which are the `spans`
/// one after another (a span's `seq` is its slot). The last stage returns the next token of
/// every emitting span, and with `want_logits` the raw logits of the first emitting span.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Step {
    pub admit: Vec<Admit>,
    pub spans: Vec<Span>,
    pub tokens: Vec<u32>,
    pub want_logits: bool,
    /// Whose weights and many-token way it runs on: 0 the engine's own, 1 its
    /// [`OtherSide`] (a comparison run step by step, [`RunOptions::sides`]).
    pub side: u8,
    /// Prompt chunks whose positions' next tokens are scored, in span order.
    pub scored: Vec<Scored>,
    /// Emitting spans ending in draft tokens to verify, in span order.
    pub drafted: Vec<Drafted>,
    /// Sequences (slots) whose next token is held to a grammar (structured output), and the
    /// tokens each may bring: `vocab.div_ceil(64)` words a sequence, a bit per token id.
    pub allowed_seqs: Vec<usize>,
    pub allowed: Vec<u64>,
    /// Prompt chunks pooled into their prompt's embedding, in span order.
    pub pooled: Vec<Pooled>,
}

/// How a prompt's last hidden states (after the final norm, as HF's base models give them) make
/// its embedding ([`Request::embed`]; sentence-transformers' pooling modes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
pub enum Pooling {
    /// Its last position's (Qwen3-Embedding, e5-mistral and other decoder embedders).
    Last,
    /// The mean over its positions.
    Mean,
    /// Its first position's.
    Cls,
}

impl Pooling {
    /// Its name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Pooling::Last => "last",
            Pooling::Mean => "mean",
            Pooling::Cls => "cls",
        }
    }
}

/// `e` scaled to length 1 (a vector of zeros as it is), as embeddings are given to be compared
/// by their dot products; the length summed in f64.
pub fn normalized(e: &[f32]) -> Vec<f32> {
    let norm = e.iter().map(|&v| v as f64 * v as f64).sum::<f64>().sqrt();
    let scale = if norm > 0.0 { (1.0 / norm) as f32 } else { 1.0 };
    e.iter().map(|v| v * scale).collect()
}

/// A prompt chunk of a request for its prompt's embedding: the last stage pools the chunk's
/// positions into its sequence's pool (from the prompt's first position on: a pooled prompt
/// runs whole, none of it from the prefix cache) and, where the chunk `ends` the prompt,
/// returns the embedding ([`StepResult::embeddings`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pooled {
    /// Its span: an index into the step's spans.
    pub span: usize,
    pub how: Pooling,
    pub ends: bool,
}

/// An emitting span whose last `k` tokens are drafts (speculative decoding): guesses of the
/// tokens after its first, to be checked in one step. The last stage yields a token after each
/// of the span's last `k + 1` positions (its real last token's and each draft's), in order; the
/// driver keeps the drafts the model would have chosen itself and the token after the last of
/// them. A row's choice is the one its position gets decoded alone: a sampled row draws with
/// the noise of its token's number (`SlotState`), and a penalized row counts the drafts
/// before it among the sequence's tokens (`Engine::pick`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Drafted {
    /// Its span: an index into the step's spans.
    pub span: usize,
    pub k: usize,
}

/// A prompt chunk of a request that asked for its prompt's log-probabilities
/// ([`Request::prompt_logprobs`]): the last stage reports, for each of the span's positions, the
/// log-probabilities of the prompt's next token there ([`TokenLogprobs`]), with `k` alternatives;
/// at the prompt's last position the next token is the one generated, reported as a generated
/// token's are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Scored {
    /// Its span: an index into the step's spans.
    pub span: usize,
    /// The prompt's token after the span; `None` where the span ends the prompt.
    pub next: Option<u32>,
    pub k: usize,
}

/// An output-head row of the last stage: its token's number in its sequence (its draw's
/// index), and the draft fed after its position in the same span, if any (kept where the row
/// picks it).
#[derive(Debug, Clone, Copy)]
struct HeadRow {
    index: u64,
    draft: Option<u32>,
    /// Its sequence's place among the step's [`Step::allowed_seqs`], where a grammar holds its
    /// token.
    allowed: Option<usize>,
}

/// Marks in a sequence's `seen` bits (one per token of the vocabulary shard `vr`) the tokens
/// of `tokens` in the shard (the bits [`sampling::adjust`] reads for the repetition penalty).
pub fn mark_seen(seen: &mut [u64], tokens: &[u32], vr: std::ops::Range<usize>) {
    for &t in tokens {
        if vr.contains(&(t as usize)) {
            let i = t as usize - vr.start;
            seen[i / 64] |= 1 << (i % 64);
        }
    }
}

/// Whether a step counts as a decode step in the [`StepProfile`]: every span one token past
/// its sequence's first position, and its drafts ([`Drafted`]). The step of a one-token prompt
/// is its prefill (it admits the sequence, and in a fresh engine it is the step that sizes the
/// buffers); a longer prompt's last chunk of one token counts, as it does the same work as a
/// decode token.
fn is_decode(step: &Step) -> bool {
    let drafts = |i: usize| step.drafted.iter().find(|d| d.span == i).map_or(0, |d| d.k);
    !step.spans.is_empty()
        && step.spans.iter().enumerate().all(|(i, sp)| sp.len == 1 + drafts(i) && sp.pos0 > 0)
}

/// What the last stage sends back to the driver after a step.
#[derive(Debug, Default)]
pub struct StepResult {
    /// The next token of each row of the output head, in order: for each emitting span, the
    /// token after its last real one, then after each of its drafts ([`Drafted`]).
    pub tokens: Vec<u32>,
    pub logits: Option<Vec<f32>>,
    /// Each row's token's log-probabilities where its sequence asked for them; empty when none
    /// of the step's did.
    pub logprobs: Vec<Option<TokenLogprobs>>,
    /// The scored spans' positions' log-probabilities ([`Step::scored`]), one span's after
    /// another: a span's length of them, one fewer where it ends the prompt.
    pub prompt_logprobs: Vec<TokenLogprobs>,
    /// The embedding of each pooled span that ends its prompt ([`Step::pooled`]), one after
    /// another, `hidden_size` values each.
    pub embeddings: Vec<f32>,
}

/// Settings of one greedy or sampled generation ([`Engine::generate`]).
pub struct GenerateOptions {
    pub max_tokens: usize,
    pub ignore_eos: bool,
    pub eos_ids: Vec<u32>,
    /// Keep the full-vocabulary logits of the last prompt position.
    pub keep_prompt_logits: bool,
}

pub struct Generation {
    pub token_ids: Vec<u32>,
    pub finish: Finish,
    pub prefill_ms: f64,
    pub decode_ms: f64,
    /// Logits at the last prompt position (if asked for).
    pub prompt_logits: Option<Vec<f32>>,
}

impl Generation {
    /// Tokens per second of the decode phase (every token after the first).
    pub fn decode_tokens_per_s(&self) -> f64 {
        tokens_per_s(self.token_ids.len().saturating_sub(1), self.decode_ms)
    }
}

/// `n` tokens in `ms` milliseconds as tokens per second (0 when either is 0).
fn tokens_per_s(n: usize, ms: f64) -> f64 {
    if n == 0 || ms <= 0.0 {
        0.0
    } else {
        n as f64 / (ms / 1000.0)
    }
}

/// Checks that a prompt leaves room to generate in the model's context.
pub fn check_prompt(n_tokens: usize, max_context: usize) -> Result<()> {
    if n_tokens == 0 {
        return Err(Error::Input("the prompt is empty (it encodes to no tokens)".into()));
    }
    if n_tokens >= max_context {
        return Err(Error::Input(format!(
            "the prompt has {n_tokens} tokens but the model's context holds {max_context} (its max_position_embeddings), leaving no room to generate"
        )));
    }
    Ok(())
}

/// A sequence slot as the last stage sees it: how it samples, which tokens of this rank's
/// vocabulary shard it has seen (for the repetition penalty) and its prompt's length (a token
/// picked after position `p` is its token number `p + 1 - prompt_len`, which seeds its draw).
#[derive(Default)]
struct SlotState {
    params: SamplingParams,
    logprobs: Option<usize>,
    seen: Vec<u64>,
    /// How many times the sequence generated each token of this rank's shard, where the
    /// presence or frequency penalty is on (else empty).
    counts: Vec<u16>,
    prompt_len: usize,
    /// Its logit biases and the tokens that end it, as indices in this rank's shard, and how
    /// many tokens it brings before those may be picked ([`Admit`]).
    bias: Vec<(u32, f32)>,
    enders: Vec<u32>,
    min_tokens: u64,
    /// Where its prompt is pooled into an embedding ([`Step::pooled`]): the sum of its
    /// positions' last hidden states so far (mean), or the first position's (cls).
    pooled: Vec<f32>,
}

impl SlotState {
    /// Whether picking its token changes the logits of its row `r` ([`Engine::pick`]): its
    /// sampling settings, its token rules or a grammar do.
    fn adjusts(&self, r: &HeadRow) -> bool {
        sampling::adjusts(&self.params) || !self.bias.is_empty() || self.min_tokens > 0 || r.allowed.is_some()
    }

    /// Token `t`'s local index in the shard from `shard_start` and its count, where the
    /// sequence counts its tokens and the shard holds `t`.
    fn count_of(&mut self, t: u32, shard_start: usize) -> Option<(usize, &mut u16)> {
        let i = (t as usize).checked_sub(shard_start)?;
        self.counts.get_mut(i).map(|c| (i, c))
    }
}

/// Reusable buffers of the log-probabilities a step reports ([`Engine::pick`]).
#[derive(Default)]
struct LogprobBufs {
    /// The rows that report them and how many alternatives each lists.
    rows: Vec<(usize, usize)>,
    /// This rank's record of each such row ([`sampling::summarize`] after the picked token's
    /// logit), and every rank's.
    mine: Vec<f32>,
    all: Vec<f32>,
    idx: Vec<u32>,
    merged: Vec<(f32, u32)>,
    /// Those rows' logits before [`sampling::adjust`] changed them, where it does.
    raw: Vec<f32>,
    /// Scored prompt positions ([`Engine::score`]): (hidden row, target token, alternatives),
    /// and a block's hidden states and logits.
    targets: Vec<(usize, u32, usize)>,
    rows_x: Vec<f32>,
    rows_logits: Vec<f32>,
}

/// The logit of token `t` in a row of the vocabulary shard `vr`; −∞ where another rank holds it.
fn shard_logit(row: &[f32], vr: &std::ops::Range<usize>, t: u32) -> f32 {
    (t as usize).checked_sub(vr.start).and_then(|i| row.get(i)).copied().unwrap_or(f32::NEG_INFINITY)
}

/// Allgathers this rank's log-probability records over the stage `comm` (`mine`, `rec` floats a
/// row: the target token's logit, then [`sampling::summarize`] of the row) into `all` and hands
/// row `i`'s merged log-probabilities, with the `i`-th of `ks` alternatives, to `out(i, ..)`.
fn gather_logprobs(
    comm: &dyn Comm,
    mine: &[f32],
    all: &mut Vec<f32>,
    merged: &mut Vec<(f32, u32)>,
    rec: usize,
    ks: impl Iterator<Item = usize>,
    mut out: impl FnMut(usize, TokenLogprobs),
) {
    let (n, per_rank) = (comm.size(), mine.len());
    all.resize(n * per_rank, 0.0);
    comm.allgather(mine, all);
    for (i, k) in ks.enumerate() {
        let record = |r: usize| &all[r * per_rank + i * rec..r * per_rank + (i + 1) * rec];
        out(i, sampling::merge_logprobs(n, record, k, merged));
    }
}

/// Prompt positions whose logits one pass of the output head computes when a prompt is scored
/// ([`Engine::score`]): the head is read once for this many.
const SCORE_ROWS: usize = 64;

/// Where a rank's time went during decode steps (every span one token past its sequence's
/// first position) since the last `Begin`: from taking each step's plan to finishing its part,
/// so waiting for the stage before counts as point-to-point time.
#[derive(Debug, Clone, Copy, Default)]
pub struct StepProfile {
    pub steps: u64,
    pub wall_ns: u64,
    pub comm: CommTimes,
    /// Heap allocations made by the kernel team's threads (this one and its workers) in those
    /// windows (`None` unless the program counts them: see [`crate::allocs`]).
    pub allocations: Option<u64>,
}

impl StepProfile {
    /// Milliseconds per step: (wall, compute, allreduce, allgather, point-to-point).
    pub fn per_step_ms(&self) -> [f64; 5] {
        let n = self.steps.max(1) as f64 * 1e6;
        let c = self.comm;
        let compute = self.wall_ns.saturating_sub(c.total_ns());
        [self.wall_ns, compute, c.allreduce_ns, c.allgather_ns, c.p2p_ns].map(|v| v as f64 / n)
    }

    /// Heap allocations per step, where they are counted.
    pub fn allocations_per_step(&self) -> Option<f64> {
        self.allocations.map(|a| a as f64 / self.steps.max(1) as f64)
    }
}

/// One rank's engine: its shard, place in the grid, KV pool, buffers and kernel thread team.
pub struct Engine {
    pub shard: Shard,
    pub grid: Grid,
    team: Team,
    kv_dtype: DType,
    /// Bytes of a KV page on the rank where it is largest (see [`Engine::share_sizes`]).
    max_page_bytes: usize,
    /// The job's nodes whose memory is known, with what their ranks take for a run's buffers
    /// (see [`Engine::share_sizes`]; until then this rank's own node, as if its every rank
    /// were this one).
    rooms: Vec<crate::host::NodeRoom>,
    scratch: Scratch,
    kv: KvCache,
    tables: Vec<Vec<u32>>,
    /// Each slot's pages in the KV rings (see [`KvCache`]).
    ring_tables: Vec<Vec<u32>>,
    /// Each slot's sequence rotates every position by LongRoPE's long factors (its prompt is
    /// longer than the original context: [`crate::config::ModelConfig::long_rope`]).
    long_rope: Vec<bool>,
    /// The most positions of one sequence a step may hold (since the last `Begin`).
    chunk: usize,
    slots: Vec<SlotState>,
    hidden: Vec<f32>,
    /// Hidden states of each emitting span's last token, for the output head.
    last: Vec<f32>,
    /// Pooled positions' last hidden states ([`Engine::pool`]).
    pool_x: Vec<f32>,
    logits: Vec<f32>,
    candidates: Vec<f32>,
    sampling: sampling::Buffers,
    logprob_bufs: LogprobBufs,
    /// Driver: results computed here (one stage) not yet collected.
    ready: VecDeque<StepResult>,
    /// Driver: the other ranks sleep (a [`Plan::Idle`] was the last plan).
    asleep: bool,
    /// Reused from step to step, so a decode step allocates nothing: the plan and result as
    /// bytes, the plan as received (ranks other than the driver) and the buffers of the last
    /// step received while another plan is there, the slot of each row of the output head,
    /// this rank's greedy candidates, token lists of results the driver has handed back, and
    /// the every-rank buffer a [`Plan::Read`] ends with.
    plan_wire: Vec<u8>,
    result_wire: Vec<u8>,
    incoming: Plan,
    spare_step: Step,
    emitting: Vec<usize>,
    /// Each emitting row's token number and the draft after it ([`HeadRow`]).
    head_rows: Vec<HeadRow>,
    /// The counts a step's drafts changed while its rows were adjusted ([`Engine::pick`]), to
    /// put back: (slot, local token, count before).
    undo: Vec<(usize, usize, u16)>,
    /// The most rows of the output head a decode step may have ([`Plan::Begin`]).
    rows: usize,
    mine: Vec<f32>,
    spare_tokens: Vec<Vec<u32>>,
    read_sync: Vec<u64>,
    /// Where each side's decode steps went (side 1: steps of the [`OtherSide`]).
    profiles: [StepProfile; 2],
    /// Test hook: `GRIDLM_TEST_EXIT_AT=RANK:STEP` ends this process abruptly at that step;
    /// `RANK:STEP:panic` makes a kernel thread panic there instead.
    exit_at: Option<(usize, usize, bool)>,
    steps: usize,
    /// How this rank's one-token products prefetch, and what decided it.
    prefetch: (kernels::Fetch, PrefetchBy),
    /// How this rank's many-token bf16 products prefetch, and what decided it.
    many_prefetch: (kernels::ManyFetch, PrefetchBy),
    /// Which pieces of this rank's one-token products the AVX2 kernels read in three streams,
    /// and what decided it.
    streams: (kernels::Streams, PrefetchBy),
    /// What [`Plan::Read`] runs on this rank (see [`Engine::set_reader`]).
    reader: Option<Reader>,
    /// What steps of side 1 run on, while the engine holds side 0's (its own), or the other
    /// way round while `side` is 1.
    other: Option<OtherSide>,
    side: u8,
}

/// What a comparison run step by step ([`RunOptions::sides`]) runs its side 1 on.
pub enum OtherSide {
    /// Other weights of the same layers, with their own prefetch ways.
    Weights(Box<SpareWeights>),
    /// The engine's own weights under another many-token way.
    ManyPrefetch((kernels::ManyFetch, PrefetchBy)),
    /// The engine's own weights under another one-token way (`gridlm bench
    /// --compare-prefetch`).
    Prefetch((kernels::Fetch, PrefetchBy)),
    /// The engine's own weights with the one-token kernels' other choice of which pieces they
    /// read in three streams (`gridlm bench --compare-streams`).
    Streams((kernels::Streams, PrefetchBy)),
}

/// Weights held aside with the prefetch ways chosen for them ([`Engine::spare_weights`]), to
/// run in turn with an engine's own ([`Engine::swap_weights`]).
pub struct SpareWeights {
    shard: Shard,
    prefetch: (kernels::Fetch, PrefetchBy),
    many_prefetch: (kernels::ManyFetch, PrefetchBy),
    streams: (kernels::Streams, PrefetchBy),
}

impl SpareWeights {
    pub fn shard(&self) -> &Shard {
        &self.shard
    }
}

/// A measurement a rank takes between steps with its kernel team ([`Plan::Read`]), told the
/// side of the step before it ([`Step::side`]).
pub type Reader = Box<dyn FnMut(&Team, u8)>;

/// What decided a rank's one-token prefetch ([`kernels::Fetch`]) or its many-token one
/// ([`kernels::ManyFetch`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefetchBy {
    /// `GRIDLM_PREFETCH` (`GRIDLM_MANY_PREFETCH`) named it.
    Env,
    /// It was the fastest on the rank's own layers ([`Shard::pick_fetch`],
    /// [`Shard::pick_many_fetch`]), or the one-token way `page` (the many-token `whole`)
    /// within 2% of the fastest (another way is taken over it only if ahead in two timings
    /// running), in one timing of every way.
    Timed,
    /// Not timed: the kernels' own ([`kernels::Fetch::Near`], [`kernels::ManyFetch::L2`],
    /// the CPU's preferred [`kernels::Streams`]). The layers were too small to time, or (many
    /// tokens) the run decodes one token a step or its products do not go through that kernel.
    Default,
    /// As [`PrefetchBy::Timed`], in two timings: the first would have left `page` (`whole`)
    /// and the second decided. Named `timed` too; [`PrefetchBy::timings`] tells them apart.
    TimedTwice,
    /// `gridlm bench --compare-prefetch` (`--compare-streams`) named it, for the baseline of
    /// a comparison.
    Compared,
}

impl PrefetchBy {
    pub const ALL: [PrefetchBy; 5] = [
        PrefetchBy::Env,
        PrefetchBy::Timed,
        PrefetchBy::Default,
        PrefetchBy::TimedTwice,
        PrefetchBy::Compared,
    ];

    /// What decided by a pick that took `timings` timings ([`kernels::Picked::timings`]).
    fn timed(timings: usize) -> PrefetchBy {
        if timings > 1 {
            PrefetchBy::TimedTwice
        } else {
            PrefetchBy::Timed
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            PrefetchBy::Env => "GRIDLM_PREFETCH",
            PrefetchBy::Timed | PrefetchBy::TimedTwice => "timed",
            PrefetchBy::Default => "default",
            PrefetchBy::Compared => "--compare-prefetch",
        }
    }

    /// How many timings of every way decided: 0 where none did (a variable named the way, or
    /// it was not timed), else 1 or 2.
    pub fn timings(self) -> usize {
        match self {
            PrefetchBy::Env | PrefetchBy::Default | PrefetchBy::Compared => 0,
            PrefetchBy::Timed => 1,
            PrefetchBy::TimedTwice => 2,
        }
    }

    /// [`PrefetchBy::name`] for the many-token prefetch, whose variable is another.
    pub fn many_name(self) -> &'static str {
        match self {
            PrefetchBy::Env => "GRIDLM_MANY_PREFETCH",
            b => b.name(),
        }
    }

    /// [`PrefetchBy::name`] for the one-token streams ([`kernels::Streams`]), whose variable
    /// is another.
    pub fn streams_name(self) -> &'static str {
        match self {
            PrefetchBy::Env => "GRIDLM_STREAMS",
            PrefetchBy::Compared => "--compare-streams",
            b => b.name(),
        }
    }
}

/// Bytes of a rank's buffers in a run beyond its weights and KV pages, `[per token of a
/// step, per sequence slot, per row of the output head]`: the forward pass's
/// ([`Scratch::bytes_per`]) and a step's hidden states; on the last stage each row's hidden
/// state and its logits over the stage's largest vocabulary shard. From below, as
/// [`Scratch::bytes_per`] is.
fn buffer_bytes(shard: &Shard, threads: usize, grid: &Grid) -> [usize; 3] {
    let [token, slot] = Scratch::bytes_per(shard, threads);
    let h = shard.cfg.hidden_size;
    let row =
        if grid.is_last_stage() { 4 * (h + largest_vocab_shard(shard.cfg.vocab_size, grid.tp)) } else { 0 };
    [token + 4 * h, slot, row]
}

/// The most tokens of a `vocab` split over `tp` ranks any one rank holds.
fn largest_vocab_shard(vocab: usize, tp: usize) -> usize {
    (0..tp).map(|t| vocab_range(vocab, tp, t).len()).max().unwrap_or(0)
}

/// This rank's one-token prefetch: the one `GRIDLM_PREFETCH` names (none, near, far, nta or
/// page), else the fastest on its own layers, timed on `team` ([`Shard::pick_fetch`]: the
/// CPU's preferred way, `near` on Zen 3 and `page` elsewhere, unless another is clearly
/// faster), else [`kernels::Fetch::Near`].
/// Set for the process ([`kernels::dot::set_fetch`]).
fn choose_prefetch(shard: &Shard, team: &Team) -> Result<(kernels::Fetch, PrefetchBy)> {
    let names = kernels::Fetch::ALL.map(kernels::Fetch::name);
    let named = named_in_env("GRIDLM_PREFETCH", kernels::Fetch::parse, &names)?;
    let chosen = named_or_timed(named, || shard.pick_fetch(team), kernels::Fetch::Near);
    kernels::dot::set_fetch(chosen.0);
    Ok(chosen)
}

/// The way `named` (by a variable), else the one `pick` timed, else `default`, with what
/// decided it.
fn named_or_timed<T, const W: usize>(
    named: Option<T>,
    pick: impl FnOnce() -> Option<kernels::Picked<T, W>>,
    default: T,
) -> (T, PrefetchBy) {
    if let Some(way) = named {
        (way, PrefetchBy::Env)
    } else if let Some(picked) = pick() {
        (picked.way, PrefetchBy::timed(picked.timings))
    } else {
        (default, PrefetchBy::Default)
    }
}

/// This rank's one-token prefetch ([`choose_prefetch`]) and which pieces of its one-token
/// products the AVX2 kernels read in three streams, each set for the process. The streams:
/// as `GRIDLM_STREAMS` names them (long or every), else the faster on the rank's own layers,
/// timed on `team` under the prefetch way just chosen ([`Shard::pick_streams`]: the CPU's
/// preferred way unless the other is clearly faster), else the preferred way
/// ([`kernels::dot::preferred_streams`]). Before the prefetch pick the streams are set as
/// named, or else as preferred, so that its ways are timed under the streams the rank most
/// likely keeps.
fn choose_one_token_ways(
    shard: &Shard,
    team: &Team,
) -> Result<((kernels::Fetch, PrefetchBy), (kernels::Streams, PrefetchBy))> {
    let names = kernels::Streams::ALL.map(kernels::Streams::name);
    let named = named_in_env("GRIDLM_STREAMS", kernels::Streams::parse, &names)?;
    let preferred = kernels::dot::preferred_streams();
    kernels::dot::set_streams(named.unwrap_or(preferred));
    let prefetch = choose_prefetch(shard, team)?;
    let streams = named_or_timed(named, || shard.pick_streams(team), preferred);
    kernels::dot::set_streams(streams.0);
    Ok((prefetch, streams))
}

/// This rank's many-token prefetch as `GRIDLM_MANY_PREFETCH` names it (l2, nta or whole), set for
/// the process ([`kernels::dot::set_many_fetch`]); else [`kernels::ManyFetch::L2`], until
/// [`Engine::pick_many_prefetch`] times it.
fn many_prefetch_from_env() -> Result<(kernels::ManyFetch, PrefetchBy)> {
    let names = kernels::ManyFetch::ALL.map(kernels::ManyFetch::name);
    let named = named_in_env("GRIDLM_MANY_PREFETCH", kernels::ManyFetch::parse, &names)?;
    let chosen = named.map_or((kernels::ManyFetch::L2, PrefetchBy::Default), |f| (f, PrefetchBy::Env));
    kernels::dot::set_many_fetch(chosen.0);
    Ok(chosen)
}

/// The many-token prefetch of `shard` at `tokens` a decode step: `current` where
/// `GRIDLM_MANY_PREFETCH` named it or that kernel would not run such steps, else the fastest on
/// the shard's own layers, timed on `team` ([`Shard::pick_many_fetch`], which sets it for the
/// process).
fn timed_many_prefetch(
    shard: &Shard,
    team: &Team,
    tokens: usize,
    current: (kernels::ManyFetch, PrefetchBy),
) -> (kernels::ManyFetch, PrefetchBy) {
    if current.1 == PrefetchBy::Env {
        return current;
    }
    shard.pick_many_fetch(team, tokens).map_or(current, |p| (p.way, PrefetchBy::timed(p.timings)))
}

/// The way the environment variable `var` names, if it is set (`parse` reads its trimmed
/// value); a value `parse` does not know is an input error that lists the way's `names`
/// ("a, b or c"), so a way added to its type's `ALL` is listed without another edit.
fn named_in_env<T>(var: &str, parse: fn(&str) -> Option<T>, names: &[&str]) -> Result<Option<T>> {
    let Some(v) = std::env::var_os(var) else {
        return Ok(None);
    };
    let v = v.to_string_lossy();
    parse(v.trim()).map(Some).ok_or_else(|| {
        let expected = match names.split_last() {
            Some((last, rest)) if !rest.is_empty() => format!("{} or {last}", rest.join(", ")),
            _ => names.join(""),
        };
        Error::Input(format!("{var} is '{v}': expected {expected}"))
    })
}

impl Engine {
    /// `threads`: size of the kernel team; the calling (main) thread is its worker 0, so
    /// kernels start without crossing threads and every MPI call stays on the main thread.
    /// `kv_dtype`: element type of the KV cache.
    pub fn new(shard: Shard, grid: Grid, threads: usize, kv_dtype: DType) -> Result<Self> {
        let team = Team::new(threads)
            .map_err(|e| Error::Input(format!("cannot start {threads} kernel threads: {e}")))?;
        let exit_at = std::env::var("GRIDLM_TEST_EXIT_AT").ok().and_then(|v| {
            let mut parts = v.split(':');
            let (r, s) = (parts.next()?.parse().ok()?, parts.next()?.parse().ok()?);
            Some((r, s, parts.next() == Some("panic")))
        });
        let (prefetch, streams) = choose_one_token_ways(&shard, &team)?;
        let many_prefetch = many_prefetch_from_env()?;
        let max_page_bytes = shard.kv_page_bytes(kv_dtype);
        // Alone, a rank takes its share of its node: the others are not known yet.
        let ranks = crate::comm::mpi::local_ranks();
        let [token, slot, row] = buffer_bytes(&shard, team.threads(), &grid);
        let rooms = crate::host::mem_available()
            .map(|available| crate::host::NodeRoom {
                rank: grid.rank,
                host: crate::host::name(),
                available,
                ranks,
                per: [max_page_bytes, token, slot, row].map(|b| b.saturating_mul(ranks)),
            })
            .into_iter()
            .collect();
        let kv = shard.new_kv(0, 0, 1, kv_dtype);
        Ok(Engine {
            shard,
            grid,
            team,
            kv_dtype,
            max_page_bytes,
            rooms,
            scratch: Scratch::default(),
            kv,
            tables: Vec::new(),
            ring_tables: Vec::new(),
            long_rope: Vec::new(),
            chunk: 0,
            slots: Vec::new(),
            hidden: Vec::new(),
            last: Vec::new(),
            pool_x: Vec::new(),
            logits: Vec::new(),
            candidates: Vec::new(),
            sampling: sampling::Buffers::default(),
            logprob_bufs: LogprobBufs::default(),
            ready: VecDeque::new(),
            asleep: false,
            plan_wire: Vec::new(),
            result_wire: Vec::new(),
            incoming: Plan::End,
            spare_step: Step::default(),
            emitting: Vec::new(),
            head_rows: Vec::new(),
            undo: Vec::new(),
            rows: 0,
            mine: Vec::new(),
            spare_tokens: Vec::new(),
            read_sync: Vec::new(),
            profiles: Default::default(),
            exit_at,
            steps: 0,
            prefetch,
            many_prefetch,
            streams,
            reader: None,
            other: None,
            side: 0,
        })
    }

    /// Collective over the job: every rank learns the largest KV page of any rank, which
    /// sizes the pool the driver plans for (a page table is the same on every rank), and what
    /// each node's memory holds for the buffers of all its ranks.
    pub fn share_sizes(&mut self, link: &dyn Link) {
        let (all, hosts) = crate::host::gather_nodes(link, self.shard.kv_page_bytes(self.kv_dtype));
        self.max_page_bytes = all.iter().map(|r| r[1]).max().unwrap_or(0) as usize;
        let mine = buffer_bytes(&self.shard, self.team.threads(), &self.grid).map(|b| b as u64);
        let mut per = vec![0u64; 3 * link.world_size()];
        link.allgather_u64(&mine, &mut per);
        let per: Vec<[u64; 3]> = per.chunks_exact(3).map(|c| [c[0], c[1], c[2]]).collect();
        self.rooms = crate::host::node_rooms(&all, &per, &hosts);
    }

    /// The job's nodes whose memory is known (see [`Engine::share_sizes`]).
    pub fn rooms(&self) -> &[crate::host::NodeRoom] {
        &self.rooms
    }

    /// The node with room for the fewest KV pages, `None` where no node's memory is known.
    pub fn kv_room(&self) -> Option<&crate::host::NodeRoom> {
        crate::host::tightest(&self.rooms)
    }

    /// Bytes of one KV page on the rank where it is largest.
    pub fn max_page_bytes(&self) -> usize {
        self.max_page_bytes
    }

    pub fn kv_dtype(&self) -> DType {
        self.kv_dtype
    }

    /// Pages of each slot's KV ring in the last run on this rank (0: its windowed layers, if
    /// any, kept their keys in the pool; see [`KvCache`]).
    pub fn kv_ring_pages(&self) -> usize {
        self.kv.ring_pages()
    }

    pub fn threads(&self) -> usize {
        self.team.threads()
    }

    /// The kernel threads (for measurements that should use the same threads).
    pub fn team(&self) -> &Team {
        &self.team
    }

    /// What this rank does for each [`Plan::Read`] (nothing without one): `gridlm bench` reads
    /// memory between decode steps with it ([`RunOptions::read_between_steps`]).
    pub fn set_reader(&mut self, reader: Option<Reader>) {
        self.reader = reader;
    }

    /// How this rank's one-token products prefetch, and what decided it.
    pub fn prefetch(&self) -> (kernels::Fetch, PrefetchBy) {
        self.prefetch
    }

    /// How this rank's many-token bf16 products prefetch, and what decided it.
    pub fn many_prefetch(&self) -> (kernels::ManyFetch, PrefetchBy) {
        self.many_prefetch
    }

    /// Which pieces of this rank's one-token products the AVX2 kernels read in three streams,
    /// and what decided it.
    pub fn streams(&self) -> (kernels::Streams, PrefetchBy) {
        self.streams
    }

    /// Times this rank's many-token prefetch on its own layers at `tokens` a decode step (the
    /// most its run decodes at once; [`Shard::pick_many_fetch`]) and keeps the fastest, unless
    /// `GRIDLM_MANY_PREFETCH` named one or that kernel would not run such steps. Local to the
    /// rank: no MPI.
    pub fn pick_many_prefetch(&mut self, tokens: usize) {
        self.many_prefetch = timed_many_prefetch(&self.shard, &self.team, tokens, self.many_prefetch);
    }

    /// Makes `way` this rank's one-token prefetch (and the process's): `gridlm bench
    /// --compare-prefetch` runs its baseline under the way it names.
    pub fn set_prefetch(&mut self, way: (kernels::Fetch, PrefetchBy)) {
        self.prefetch = way;
        kernels::dot::set_fetch(way.0);
    }

    /// Makes `way` this rank's choice of which pieces of one-token products the AVX2 kernels
    /// read in three streams (and the process's): `gridlm bench --compare-streams` runs its
    /// baseline under the way it names.
    pub fn set_streams(&mut self, way: (kernels::Streams, PrefetchBy)) {
        self.streams = way;
        kernels::dot::set_streams(way.0);
    }

    /// Makes `way` this rank's many-token prefetch (and the process's), as a pick of
    /// [`Engine::pick_many_prefetch`] returned by [`Engine::many_prefetch`] left it: `gridlm
    /// bench --compare-batch` runs each batch size under the way picked for its own steps.
    pub fn set_many_prefetch(&mut self, way: (kernels::ManyFetch, PrefetchBy)) {
        self.many_prefetch = way;
        kernels::dot::set_many_fetch(way.0);
    }

    /// `shard` (this rank's layers of the same model, other weights: another dtype, or not
    /// quantized) made ready to run in turn with the engine's own, on the same kernel threads,
    /// KV cache and buffers ([`Engine::swap_weights`]): its prefetch ways are chosen on this
    /// rank's team as [`Engine::new`] and [`Engine::pick_many_prefetch`] (at `tokens` a
    /// decode step) choose them, and the engine's own stay set. `gridlm bench
    /// --compare-unquantized` runs the two in turn, so both meet the same moments of a shared
    /// host. Local to the rank: no MPI.
    pub fn spare_weights(&self, shard: Shard, tokens: usize) -> Result<SpareWeights> {
        let (mine, theirs) = (&self.shard, &shard);
        if theirs.plan != mine.plan
            || theirs.cfg.hidden_size != mine.cfg.hidden_size
            || theirs.kv_page_bytes(self.kv_dtype) != mine.kv_page_bytes(self.kv_dtype)
        {
            return Err(Error::Input("weights run in turn must be the same layers of the same model".into()));
        }
        let (prefetch, streams) = choose_one_token_ways(&shard, &self.team)?;
        let many_prefetch = timed_many_prefetch(&shard, &self.team, tokens, many_prefetch_from_env()?);
        self.apply_prefetch();
        Ok(SpareWeights { shard, prefetch, many_prefetch, streams })
    }

    /// Runs on `spare`'s weights from now on, leaving the engine's in `spare`. Between runs
    /// only (each starts with its prefill): the KV cache holds the keys and values of the
    /// weights that wrote them.
    pub fn swap_weights(&mut self, spare: &mut SpareWeights) {
        std::mem::swap(&mut self.shard, &mut spare.shard);
        std::mem::swap(&mut self.prefetch, &mut spare.prefetch);
        std::mem::swap(&mut self.many_prefetch, &mut spare.many_prefetch);
        std::mem::swap(&mut self.streams, &mut spare.streams);
        self.apply_prefetch();
    }

    /// What steps of side 1 run on from now on ([`Step::side`]); returns the one before. The
    /// engine holds its own weights and ways (side 0's) when this returns.
    pub fn set_other_side(&mut self, other: Option<OtherSide>) -> Option<OtherSide> {
        if self.side != 0 {
            self.swap_sides();
        }
        std::mem::replace(&mut self.other, other)
    }

    /// Holds side `side`'s weights and ways, swapping them with the other side's where the
    /// engine holds the other's: a few words moved, no allocation.
    fn hold_side(&mut self, side: u8) -> Result<()> {
        if side == self.side {
            return Ok(());
        }
        if side > 1 || self.other.is_none() {
            return Err(Error::Comm(format!("a step of side {side}, where the engine has no such side")));
        }
        self.swap_sides();
        Ok(())
    }

    /// Swaps the engine's weights or prefetch way with its other side's (see [`OtherSide`]).
    fn swap_sides(&mut self) {
        let Some(mut other) = self.other.take() else { return };
        match &mut other {
            OtherSide::Weights(spare) => self.swap_weights(spare),
            OtherSide::ManyPrefetch(many) => {
                let way = std::mem::replace(many, self.many_prefetch);
                self.set_many_prefetch(way);
            }
            OtherSide::Prefetch(one) => {
                let way = std::mem::replace(one, self.prefetch);
                self.set_prefetch(way);
            }
            OtherSide::Streams(streams) => {
                let way = std::mem::replace(streams, self.streams);
                self.set_streams(way);
            }
        }
        self.other = Some(other);
        self.side = 1 - self.side;
    }

    /// Sets this engine's prefetch ways for the process (they are read by the kernels).
    fn apply_prefetch(&self) {
        kernels::dot::set_fetch(self.prefetch.0);
        kernels::dot::set_many_fetch(self.many_prefetch.0);
        kernels::dot::set_streams(self.streams.0);
    }

    /// Whether some layer of the model attends through a window (its keys may live in a
    /// per-slot ring rather than the pages of the driver's tables).
    pub fn windowed(&self) -> bool {
        let cfg = &self.shard.cfg;
        (0..cfg.n_layers).any(|i| cfg.layer_window(i).is_some())
    }

    /// Largest number of positions a sequence may have.
    pub fn max_context(&self) -> usize {
        self.shard.cfg.max_position_embeddings
    }

    /// Every rank: obtains the next plan and forwards it down the pipeline to the same tp rank
    /// of the next stage. The driver passes its own; every other rank finds it in
    /// `self.incoming`.
    fn next_plan(&mut self, own: Option<&Plan>, comm: &dyn Comm, link: &dyn Link) -> Result<()> {
        let g = self.grid;
        let bytes = &mut self.plan_wire;
        match own {
            Some(p) => wire::encode_plan(p, bytes)?,
            None => bytes.clear(),
        }
        if g.is_first_stage() {
            comm.broadcast_bytes(bytes);
        } else {
            link.recv_bytes(g.rank_of(g.stage() - 1, g.tp_rank()), Tag::Plan, bytes);
        }
        if !g.is_last_stage() {
            link.send_bytes(g.rank_of(g.stage() + 1, g.tp_rank()), Tag::Plan, bytes);
        }
        if own.is_none() {
            // A step's buffers wait in `spare_step` while other plans pass (a `Read` between
            // every two steps of a bench), so the next step reuses them.
            match (&mut self.incoming, wire::is_step(bytes)) {
                (Plan::Step(s), false) => std::mem::swap(s, &mut self.spare_step),
                (other, true) if !matches!(other, Plan::Step(_)) => {
                    *other = Plan::Step(std::mem::take(&mut self.spare_step))
                }
                _ => {}
            }
            wire::decode_plan(bytes, &mut self.incoming)?;
        }
        Ok(())
    }

    /// Where this rank's time went in the decode steps since the last `Begin` (those of side 0,
    /// the engine's own, where a run compares two sides step by step).
    pub fn profile(&self) -> StepProfile {
        self.profiles[0]
    }

    /// Every rank: takes the next plan (see [`Engine::next_plan`]) and carries out its part,
    /// timing decode steps into the profile. Returns the step's result where it is complete on
    /// this rank, and whether the plan was `End`.
    fn handle(
        &mut self,
        own: Option<&Plan>,
        comm: &dyn Comm,
        link: &dyn Link,
    ) -> Result<(bool, Option<StepResult>)> {
        let (t0, c0, a0) = (std::time::Instant::now(), comm.times() + link.times(), crate::allocs::count());
        self.next_plan(own, comm, link)?;
        let incoming = std::mem::replace(&mut self.incoming, Plan::End);
        let plan = own.unwrap_or(&incoming);
        let r = self.execute(plan, comm, link);
        match plan {
            Plan::Begin { .. } => self.profiles = Default::default(),
            Plan::Step(s) if is_decode(s) => {
                let p = &mut self.profiles[self.side as usize];
                p.steps += 1;
                p.wall_ns += t0.elapsed().as_nanos() as u64;
                p.comm = p.comm + (comm.times() + link.times() - c0);
                if let (Some(a0), Some(a1)) = (a0, crate::allocs::count()) {
                    p.allocations = Some(p.allocations.unwrap_or(0) + (a1 - a0));
                }
            }
            _ => {}
        }
        let end = matches!(plan, Plan::End);
        self.incoming = incoming;
        Ok((end, r?))
    }

    /// Every rank: carries out its part of `plan`. Returns the step's result where it is
    /// complete on this rank (the last stage's tp rank 0 and, in a one-stage job, the driver).
    fn execute(&mut self, plan: &Plan, comm: &dyn Comm, link: &dyn Link) -> Result<Option<StepResult>> {
        let step = match plan {
            Plan::Begin { pages, slots, chunk, rows } => {
                self.kv = self.shard.new_kv(*pages, *slots, *chunk, self.kv_dtype);
                self.scratch.reserve_decode(&self.shard, *pages, *slots, self.team.threads());
                // The output head's buffers, for every row a decode step may have.
                let rows = (*rows).max(*slots);
                self.sampling.reserve(rows, comm.size(), self.max_vocab_shard());
                if self.grid.is_last_stage() {
                    let (h, vl) = (self.shard.cfg.hidden_size, self.shard.vocab_range().len());
                    crate::grow(&mut self.last, rows * h);
                    crate::room(&mut self.logits, rows * vl);
                    crate::room(&mut self.emitting, rows);
                    crate::room(&mut self.head_rows, rows);
                    crate::room(&mut self.undo, rows);
                    crate::room(&mut self.mine, 2 * rows);
                    crate::room(&mut self.candidates, 2 * rows * comm.size());
                }
                // Results' token lists, on the last stage and the driver.
                self.rows = rows;
                for t in &mut self.spare_tokens {
                    t.clear();
                    t.reserve(rows);
                }
                self.tables = vec![Vec::new(); *slots];
                self.ring_tables = vec![Vec::new(); *slots];
                self.long_rope = vec![false; *slots];
                self.chunk = *chunk;
                self.slots.clear();
                self.slots.resize_with(*slots, SlotState::default);
                return Ok(None);
            }
            Plan::End => return Ok(None),
            Plan::Idle => {
                if self.grid.rank != 0 {
                    link.sleep_until_woken(0);
                }
                return Ok(None);
            }
            Plan::Read => {
                if let Some(read) = &mut self.reader {
                    read(&self.team, self.side);
                }
                // Every rank leaves together, so the next step starts at once on all of them.
                self.read_sync.resize(link.world_size(), 0);
                link.allgather_u64(&[0], &mut self.read_sync);
                return Ok(None);
            }
            Plan::Step(step) => step,
        };
        self.hold_side(step.side)?;
        self.steps += 1;
        if let Some((rank, step, panic)) = self.exit_at {
            if rank == self.grid.rank && step == self.steps {
                if panic {
                    // The team's last thread: a kernel thread, not the main one, when there
                    // are several.
                    let last = self.team.threads() - 1;
                    self.team.run(&|tid| {
                        assert!(tid != last, "kernel thread {tid} failed (GRIDLM_TEST_EXIT_AT)");
                    });
                }
                let line = format!("error: rank {rank}: exiting at step {step} (GRIDLM_TEST_EXIT_AT)\n");
                let _ = std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes());
                std::process::exit(3);
            }
        }
        let g = self.grid;
        let words = self.shard.vocab_range().len().div_ceil(64);
        for a in &step.admit {
            if a.slot >= self.tables.len() || a.pages.iter().any(|&p| p as usize >= self.kv.pool.pages()) {
                return Err(Error::Comm("a step admits a sequence outside the slots or KV pages".into()));
            }
            self.tables[a.slot].clone_from(&a.pages);
            self.kv.ring_table(a.slot, a.pages.len(), &mut self.ring_tables[a.slot]);
            self.long_rope[a.slot] = self.shard.cfg.long_rope(a.prompt_len);
            let st = &mut self.slots[a.slot];
            st.params = a.params.clone();
            st.logprobs = a.logprobs.map(|k| k.min(MAX_LOGPROBS));
            st.seen.clear();
            st.seen.resize(words, 0);
            if g.is_last_stage() {
                mark_seen(&mut st.seen, &a.history, self.shard.vocab_range());
            }
            st.counts.clear();
            if st.params.counts_tokens() {
                st.counts.resize(self.shard.vocab_range().len(), 0);
            }
            st.prompt_len = a.prompt_len;
            let vr = self.shard.vocab_range();
            let local =
                |t: u32| (t as usize).checked_sub(vr.start).filter(|&i| i < vr.len()).map(|i| i as u32);
            st.bias.clear();
            st.bias.extend(a.logit_bias.iter().filter_map(|&(t, b)| Some((local(t)?, b))));
            st.enders.clear();
            st.enders.extend(a.enders.iter().filter_map(|&t| local(t)));
            st.min_tokens = a.min_tokens as u64;
        }
        let (spans, tokens) = (&step.spans, &step.tokens);
        let h = self.shard.cfg.hidden_size;
        let n = tokens.len();
        // A span longer than the `Begin`'s chunk could overwrite the keys of a ring it reads.
        let fits = |s: &Span| {
            s.seq < self.tables.len()
                && s.pos0 + s.len <= self.tables[s.seq].len() * PAGE
                && s.len <= self.chunk
        };
        if spans.iter().map(|s| s.len).sum::<usize>() != n || !spans.iter().all(fits) {
            return Err(Error::Comm("a step's spans do not match its tokens, slots or KV pages".into()));
        }
        crate::grow(&mut self.hidden, n * h);
        let Engine { shard, scratch, hidden, last, logits, team, kv, tables, ring_tables, long_rope, .. } =
            self;
        let x = &mut hidden[..n * h];
        if g.is_first_stage() {
            shard.embed(tokens, spans, x, comm);
        } else {
            link.recv_f32(g.rank_of(g.stage() - 1, g.tp_rank()), Tag::Hidden, x);
        }
        shard.forward(x, spans, kv, tables, ring_tables, long_rope, scratch, comm, team);
        if !g.is_last_stage() {
            link.send_f32(g.rank_of(g.stage() + 1, g.tp_rank()), Tag::Hidden, x);
            return Ok(None);
        }
        // Last stage: the tokens fed so far are each sequence's history. (Its drafts too: they
        // are copies of its earlier tokens, already there.)
        let vr = shard.vocab_range();
        let mut at = 0;
        for sp in spans {
            mark_seen(&mut self.slots[sp.seq].seen, &tokens[at..at + sp.len], vr.clone());
            at += sp.len;
        }
        // The output head's rows: each emitting span's last position, and before it those of
        // its drafts; `emitting` their slots.
        let (emitting, head_rows) = (&mut self.emitting, &mut self.head_rows);
        emitting.clear();
        head_rows.clear();
        if step.allowed.len() != step.allowed_seqs.len() * shard.cfg.vocab_size.div_ceil(64) {
            return Err(Error::Comm("a step's allowed tokens do not match its vocabulary".into()));
        }
        let (mut end, mut drafted) = (0, step.drafted.iter().peekable());
        for (i, sp) in spans.iter().enumerate() {
            end += sp.len;
            if !sp.emit {
                continue;
            }
            let k = drafted.next_if(|d| d.span == i).map_or(0, |d| d.k);
            if k >= sp.len {
                return Err(Error::Comm(format!("a step drafts {k} tokens in a span of {}", sp.len)));
            }
            let allowed = step.allowed_seqs.iter().position(|&s| s == sp.seq);
            if allowed.is_some() && k > 0 {
                return Err(Error::Comm("a step drafts tokens for a sequence held to a grammar".into()));
            }
            for p in end - 1 - k..end {
                let row = emitting.len();
                crate::grow(last, (row + 1) * h);
                last[row * h..(row + 1) * h].copy_from_slice(&x[p * h..(p + 1) * h]);
                emitting.push(sp.seq);
                let pos = sp.pos0 + p + sp.len - end;
                let index = (pos + 1).saturating_sub(self.slots[sp.seq].prompt_len) as u64;
                head_rows.push(HeadRow { index, draft: (p + 1 < end).then(|| tokens[p + 1]), allowed });
            }
        }
        if drafted.next().is_some() {
            return Err(Error::Comm("a step drafts tokens in a span that does not emit".into()));
        }
        let m = emitting.len();
        let vl = vr.len();
        logits.resize(m * vl, 0.0);
        let mut result = spare_result(&mut self.spare_tokens, self.rows);
        if m > 0 {
            shard.logits(&last[..m * h], m, scratch, logits, team);
            if step.want_logits {
                let vocab = shard.cfg.vocab_size;
                let counts: Vec<usize> = (0..g.tp).map(|t| vocab_range(vocab, g.tp, t).len()).collect();
                let mut full = vec![0.0; vocab];
                comm.allgatherv(&logits[..vl], &counts, &mut full);
                result.logits = Some(full);
            }
            self.pick(m, &step.allowed, comm, &mut result);
        }
        if !step.scored.is_empty() {
            self.score(step, comm, &mut result)?;
        }
        // The stage's ranks hold the same hidden states: the one that reports the step pools.
        if !step.pooled.is_empty() && g.tp_rank() == 0 {
            self.pool(step, &mut result)?;
        }
        if g.rank == 0 {
            return Ok(Some(result));
        }
        if g.rank == g.rank_of(g.pp - 1, 0) {
            wire::encode_result(&result, &mut self.result_wire)?;
            link.send_bytes(0, Tag::Result, &self.result_wire);
        }
        self.recycle(result);
        Ok(None)
    }

    /// Last stage, after the step's layers: the step's pooled spans' last hidden states (the
    /// final norm of `self.hidden`'s rows) into their sequences' pools, and the embedding of
    /// each span that ends its prompt into `result` ([`Step::pooled`]).
    fn pool(&mut self, step: &Step, result: &mut StepResult) -> Result<()> {
        let h = self.shard.cfg.hidden_size;
        let Engine { shard, hidden, slots, pool_x, .. } = self;
        for p in &step.pooled {
            let Some(sp) = step.spans.get(p.span) else {
                return Err(Error::Comm(format!("a step pools span {} of {}", p.span, step.spans.len())));
            };
            let at: usize = step.spans[..p.span].iter().map(|s| s.len).sum();
            let pool = &mut slots[sp.seq].pooled;
            if sp.pos0 == 0 {
                pool.clear();
                pool.resize(h, 0.0);
            } else if pool.len() != h {
                return Err(Error::Comm("a step pools a prompt from its middle".into()));
            }
            let rows = match p.how {
                Pooling::Last => p.ends.then(|| at + sp.len - 1..at + sp.len),
                Pooling::Mean => Some(at..at + sp.len),
                Pooling::Cls => (sp.pos0 == 0).then(|| at..at + 1),
            };
            if let Some(rows) = rows {
                let n = rows.len();
                crate::grow(pool_x, n * h);
                shard.final_normed(&hidden[rows.start * h..rows.end * h], &mut pool_x[..n * h]);
                match p.how {
                    Pooling::Mean => pool_x[..n * h].chunks_exact(h).for_each(|r| {
                        pool.iter_mut().zip(r).for_each(|(a, &v)| *a += v);
                    }),
                    Pooling::Last | Pooling::Cls => pool.copy_from_slice(&pool_x[..h]),
                }
            }
            if p.ends {
                let scale = match p.how {
                    Pooling::Mean => 1.0 / (sp.pos0 + sp.len) as f32,
                    Pooling::Last | Pooling::Cls => 1.0,
                };
                result.embeddings.extend(pool.iter().map(|v| v * scale));
            }
        }
        Ok(())
    }

    /// Last stage, after the step's layers: the log-probabilities of the prompt's next token at
    /// each position of the step's scored spans ([`Step::scored`]) into `result`, from the
    /// hidden states in `self.hidden`. The output head runs over [`SCORE_ROWS`] positions at a
    /// time; each rank summarizes its vocabulary shard of every row with the target token's
    /// logit where it holds it, and one allgather a block gives the stage every record.
    fn score(&mut self, step: &Step, comm: &dyn Comm, result: &mut StepResult) -> Result<()> {
        let h = self.shard.cfg.hidden_size;
        let vr = self.shard.vocab_range();
        let vl = vr.len();
        let lp = &mut self.logprob_bufs;
        // (hidden row, target token, alternatives) of every scored position.
        lp.targets.clear();
        for sc in &step.scored {
            let Some(sp) = step.spans.get(sc.span) else {
                return Err(Error::Comm(format!("a step scores span {} of {}", sc.span, step.spans.len())));
            };
            let at: usize = step.spans[..sc.span].iter().map(|s| s.len).sum();
            for p in 0..sp.len {
                let target = if p + 1 < sp.len { Some(step.tokens[at + p + 1]) } else { sc.next };
                if let Some(t) = target {
                    lp.targets.push((at + p, t, sc.k.min(MAX_LOGPROBS)));
                }
            }
        }
        let k_max = lp.targets.iter().map(|t| t.2).max().unwrap_or(0);
        let rec = 1 + sampling::summary_len(k_max);
        result.prompt_logprobs.clear();
        result.prompt_logprobs.reserve(lp.targets.len());
        for block in lp.targets.chunks(SCORE_ROWS) {
            let m = block.len();
            lp.rows_x.resize(m * h, 0.0);
            for (i, &(row, _, _)) in block.iter().enumerate() {
                lp.rows_x[i * h..(i + 1) * h].copy_from_slice(&self.hidden[row * h..(row + 1) * h]);
            }
            lp.rows_logits.resize(m * vl, 0.0);
            self.shard.logits(&lp.rows_x, m, &mut self.scratch, &mut lp.rows_logits, &self.team);
            lp.mine.resize(m * rec, 0.0);
            for (i, &(_, t, _)) in block.iter().enumerate() {
                let logits = &lp.rows_logits[i * vl..(i + 1) * vl];
                let r = &mut lp.mine[i * rec..(i + 1) * rec];
                sampling::summarize(logits, vr.start, k_max, &mut lp.idx, &mut r[1..]);
                r[0] = shard_logit(logits, &vr, t);
            }
            let out = &mut result.prompt_logprobs;
            let ks = block.iter().map(|t| t.2);
            gather_logprobs(comm, &lp.mine, &mut lp.all, &mut lp.merged, rec, ks, |_, l| out.push(l));
        }
        Ok(())
    }

    /// The largest vocabulary shard of the stage (the same on every rank).
    fn max_vocab_shard(&self) -> usize {
        largest_vocab_shard(self.shard.cfg.vocab_size, self.grid.tp)
    }

    /// Last stage: the next token of each of the `m` rows of `self.logits` (their slots in
    /// `self.emitting`), into `picked`, the same on every rank of the stage: greedy rows by one
    /// allgather of (value, index), sampled rows exactly over the whole vocabulary (see
    /// [`sampling`]). `allowed`: the step's tokens allowed by grammars ([`Step::allowed`]).
    fn pick(&mut self, m: usize, allowed: &[u64], comm: &dyn Comm, result: &mut StepResult) {
        let vr = self.shard.vocab_range();
        let vl = vr.len();
        let emitting = std::mem::take(&mut self.emitting);
        // Rows reporting log-probabilities are summarized before their logits are adjusted,
        // and kept as they were where adjusting changes them.
        let lp = &mut self.logprob_bufs;
        lp.rows.clear();
        lp.rows.extend(
            emitting.iter().enumerate().filter_map(|(row, &s)| self.slots[s].logprobs.map(|k| (row, k))),
        );
        let k_max = lp.rows.iter().map(|r| r.1).max().unwrap_or(0);
        let rec = 1 + sampling::summary_len(k_max);
        if !lp.rows.is_empty() {
            lp.mine.resize(lp.rows.len() * rec, 0.0);
            lp.raw.clear();
            for (i, &(row, _)) in lp.rows.iter().enumerate() {
                let logits = &self.logits[row * vl..(row + 1) * vl];
                sampling::summarize(
                    logits,
                    vr.start,
                    k_max,
                    &mut lp.idx,
                    &mut lp.mine[i * rec + 1..(i + 1) * rec],
                );
                if self.slots[emitting[row]].adjusts(&self.head_rows[row]) {
                    lp.raw.extend_from_slice(logits);
                }
            }
        }
        let picked = &mut result.tokens;
        // The presence and frequency penalties of a row after drafts count them among the
        // sequence's generated tokens, as decoding them one by one would (the row's pick
        // matters only where they are kept): each draft is counted after the row before it is
        // adjusted, and the counts are put back before the picks. (The repetition penalty's
        // history holds the drafts already.)
        let undo = &mut self.undo;
        undo.clear();
        for (row, &slot) in emitting.iter().enumerate() {
            let st = &mut self.slots[slot];
            let logits = &mut self.logits[row * vl..(row + 1) * vl];
            // The tokens that end it are out while it has brought fewer than its min_tokens.
            let banned = if self.head_rows[row].index < st.min_tokens { &st.enders[..] } else { &[] };
            if let Some(a) = self.head_rows[row].allowed {
                let words = self.shard.cfg.vocab_size.div_ceil(64);
                crate::grammar::keep_allowed(logits, vr.start, &allowed[a * words..(a + 1) * words]);
            }
            sampling::steer(logits, &st.bias, banned);
            sampling::adjust(logits, &st.params, &st.seen, &st.counts);
            if let Some((i, c)) = self.head_rows[row].draft.and_then(|d| st.count_of(d, vr.start)) {
                undo.push((slot, i, *c));
                *c = c.saturating_add(1);
            }
        }
        for &(slot, i, c) in undo.iter().rev() {
            self.slots[slot].counts[i] = c;
        }
        let (logits, mine, all) = (&self.logits[..m * vl], &mut self.mine, &mut self.candidates);
        greedy_pick(logits, m, vr.start, mine, all, comm, picked);
        let draws = &mut self.sampling.draws;
        draws.clear();
        for (row, &slot) in emitting.iter().enumerate() {
            let st = &self.slots[slot];
            if !st.params.is_greedy() {
                draws.push(sampling::Draw {
                    row,
                    params: st.params.clone(),
                    index: self.head_rows[row].index,
                });
            }
        }
        if !draws.is_empty() {
            let max_shard = self.max_vocab_shard();
            let logits = &self.logits[..m * vl];
            sampling::sample_rows(logits, vl, max_shard, vr.start, &mut self.sampling, comm, picked);
        }
        // Each sequence brings its rows' tokens up to the first that differs from the draft
        // after it (as the driver keeps them): those are counted.
        let mut kept = true;
        for ((&slot, &t), r) in emitting.iter().zip(&result.tokens).zip(&self.head_rows) {
            if let Some((_, c)) = self.slots[slot].count_of(t, vr.start).filter(|_| kept) {
                *c = c.saturating_add(1);
            }
            // The span's last row (no draft after it) ends it.
            kept = r.draft.is_none() || (kept && r.draft == Some(t));
        }
        if !self.logprob_bufs.rows.is_empty() {
            self.report_logprobs(&emitting, rec, comm, result);
        }
        self.emitting = emitting;
    }

    /// The log-probabilities of the picked tokens of the rows in `logprob_bufs.rows`, whose
    /// records of `rec` floats hold this rank's summaries: each record's first float becomes the
    /// picked token's logit as the head gave it (−∞ where another rank holds the token), the
    /// stage allgathers the records and every rank merges them alike.
    fn report_logprobs(&mut self, emitting: &[usize], rec: usize, comm: &dyn Comm, result: &mut StepResult) {
        let vr = self.shard.vocab_range();
        let vl = vr.len();
        let lp = &mut self.logprob_bufs;
        let mut raw = lp.raw.chunks_exact(vl);
        for (i, &(row, _)) in lp.rows.iter().enumerate() {
            let logits = if self.slots[emitting[row]].adjusts(&self.head_rows[row]) {
                raw.next().expect("a raw row for each adjusted one")
            } else {
                &self.logits[row * vl..(row + 1) * vl]
            };
            lp.mine[i * rec] = shard_logit(logits, &vr, result.tokens[row]);
        }
        result.logprobs.clear();
        result.logprobs.resize(emitting.len(), None);
        let LogprobBufs { rows, mine, all, merged, .. } = lp;
        let out = &mut result.logprobs;
        gather_logprobs(comm, mine, all, merged, rec, rows.iter().map(|r| r.1), |i, l| {
            out[rows[i].0] = Some(l)
        });
    }

    /// Driver: sends `plan` down the grid and does this rank's part of it. A step's result is
    /// taken later with [`Engine::collect`], so several steps can be in flight.
    fn launch(&mut self, plan: &Plan, comm: &dyn Comm, link: &dyn Link) -> Result<()> {
        if std::mem::replace(&mut self.asleep, matches!(plan, Plan::Idle)) {
            for rank in 1..link.world_size() {
                link.send_bytes(rank, Tag::Wake, &[]);
            }
        }
        if let (_, Some(r)) = self.handle(Some(plan), comm, link)? {
            self.ready.push_back(r);
        }
        Ok(())
    }

    /// Driver: the result of the oldest launched step not yet collected, which had `emitting`
    /// emitting spans (and so must bring as many tokens).
    fn collect(&mut self, emitting: usize, link: &dyn Link) -> Result<StepResult> {
        let r = match self.ready.pop_front() {
            Some(r) => r,
            None => {
                link.recv_bytes(self.grid.rank_of(self.grid.pp - 1, 0), Tag::Result, &mut self.result_wire);
                let mut r = spare_result(&mut self.spare_tokens, self.rows);
                wire::decode_result(&self.result_wire, &mut r)?;
                r
            }
        };
        if r.tokens.len() != emitting {
            return Err(Error::Comm(format!(
                "a step of {emitting} emitting spans returned {} tokens",
                r.tokens.len()
            )));
        }
        Ok(r)
    }

    /// Takes back a result's buffers for later steps (the driver, once it has collected it).
    fn recycle(&mut self, r: StepResult) {
        self.spare_tokens.push(r.tokens);
    }

    /// Ranks other than the driver: follow plans until `End`.
    pub fn follow(&mut self, comm: &dyn Comm, link: &dyn Link) -> Result<()> {
        loop {
            if let (true, _) = self.handle(None, comm, link)? {
                return Ok(());
            }
        }
    }

    /// Driver: tells every rank the job is over.
    pub fn finish(&mut self, comm: &dyn Comm, link: &dyn Link) -> Result<()> {
        self.launch(&Plan::End, comm, link)
    }

    /// Driver: a pool of `pages` KV pages and `slots` sequence slots on every rank.
    fn begin(
        &mut self,
        (pages, slots, chunk, rows): (usize, usize, usize, usize),
        comm: &dyn Comm,
        link: &dyn Link,
    ) -> Result<()> {
        self.ready.clear();
        self.launch(&Plan::Begin { pages, slots, chunk, rows }, comm, link)
    }

    /// Driver: runs one step and waits for its result.
    fn step(&mut self, step: Step, comm: &dyn Comm, link: &dyn Link) -> Result<StepResult> {
        let m = step.spans.iter().filter(|s| s.emit).count();
        self.launch(&Plan::Step(step), comm, link)?;
        self.collect(m, link)
    }

    /// Driver: the model's greedy choice at each position of a sequence forced along `forced`
    /// after `prompt` (teacher forcing): element `i` is the top-1 token after
    /// `prompt + forced[..i]`. Compares two configurations position by position, where free
    /// generation would stop being comparable after the first difference.
    pub fn greedy_along(
        &mut self,
        prompt: &[u32],
        forced: &[u32],
        comm: &dyn Comm,
        link: &dyn Link,
    ) -> Result<Vec<u32>> {
        check_prompt(prompt.len(), self.max_context())?;
        let positions = (prompt.len() + forced.len()).min(self.max_context());
        let pages = positions.div_ceil(PAGE);
        // The prompt in one step, then a token a step.
        self.begin((pages, 1, prompt.len(), 1), comm, link)?;
        let admit = vec![Admit {
            slot: 0,
            pages: (0..pages as u32).collect(),
            params: SamplingParams::default(),
            logprobs: None,
            prompt_len: prompt.len(),
            ..Admit::default()
        }];
        let span = Span { seq: 0, pos0: 0, len: prompt.len(), emit: true };
        let first = Step { admit, spans: vec![span], tokens: prompt.to_vec(), ..Step::default() };
        let mut out = vec![self.step(first, comm, link)?.tokens[0]];
        for (i, &t) in forced.iter().enumerate().take(forced.len().saturating_sub(1)) {
            let pos = prompt.len() + i;
            if pos >= positions {
                break;
            }
            let span = Span { seq: 0, pos0: pos, len: 1, emit: true };
            let step = Step { spans: vec![span], tokens: vec![t], ..Step::default() };
            out.push(self.step(step, comm, link)?.tokens[0]);
        }
        Ok(out)
    }

    /// Driver: greedy generation for one prompt over the whole grid, `on_token` called with
    /// each token as it comes. Call [`Engine::finish`] afterwards (also after an error) so the
    /// other ranks stop.
    pub fn generate(
        &mut self,
        prompt: &[u32],
        opts: &GenerateOptions,
        comm: &dyn Comm,
        link: &dyn Link,
        mut on_token: impl FnMut(u32) -> Result<()>,
    ) -> Result<Generation> {
        let req = Request {
            prompt: prompt.to_vec(),
            max_tokens: opts.max_tokens,
            ignore_eos: opts.ignore_eos,
            params: SamplingParams::default(),
            keep_logits: opts.keep_prompt_logits,
            logprobs: None,
            prompt_logprobs: None,
            rules: sampling::TokenRules::default(),
            format: None,
            grammar: None,
            embed: None,
        };
        let run = RunOptions { eos_ids: opts.eos_ids.clone(), ..RunOptions::default() };
        let mut done = self.run(&[req], &run, comm, link, |_, t| on_token(t).map(|()| true))?;
        let c = done.pop().expect("one completion per request");
        if let Some(e) = c.error {
            return Err(Error::Input(e));
        }
        let first = c.times_ms.first().copied().unwrap_or(0.0);
        Ok(Generation {
            token_ids: c.token_ids,
            finish: c.finish,
            prefill_ms: first,
            decode_ms: c.times_ms.last().copied().unwrap_or(first) - first,
            prompt_logits: c.prompt_logits,
        })
    }
}

/// An empty result, on a token list from `spare` (lists handed back earlier) where there is one.
fn spare_result(spare: &mut Vec<Vec<u32>>, rows: usize) -> StepResult {
    let mut tokens = spare.pop().unwrap_or_else(|| Vec::with_capacity(rows));
    tokens.clear();
    StepResult { tokens, ..StepResult::default() }
}

/// The stage agrees on the greedy token of each of the `m` rows of `logits` (`[m, shard]`):
/// each rank takes the argmax of its vocabulary shard per row, the (value, index) pairs are
/// allgathered, and the largest value wins (lowest index on ties).
/// The tokens go to `out` (cleared first); `mine` and `all` are reused buffers.
pub fn greedy_pick(
    logits: &[f32],
    m: usize,
    vocab_start: usize,
    mine: &mut Vec<f32>,
    all: &mut Vec<f32>,
    comm: &dyn Comm,
    out: &mut Vec<u32>,
) {
    let vl = logits.len() / m.max(1);
    mine.clear();
    for row in logits.chunks_exact(vl).take(m) {
        let (i, v) = kernels::argmax(row);
        mine.extend([v, f32::from_bits((vocab_start + i) as u32)]);
    }
    all.resize(2 * m * comm.size(), 0.0);
    comm.allgather(mine, all);
    out.clear();
    out.extend((0..m).map(|row| {
        let pairs = all.chunks_exact(2 * m).map(|rank| (rank[2 * row] as f64, rank[2 * row + 1].to_bits()));
        pairs.fold((f64::NEG_INFINITY, u32::MAX), sampling::better).1
    }));
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The summary lines name a [`Finish`] as the JSON does.
    #[test]
    fn finish_names_match_the_json() {
        for f in [Finish::Eos, Finish::Length, Finish::Context, Finish::Stop, Finish::Error] {
            assert_eq!(serde_json::to_value(f).unwrap(), f.name());
        }
    }

    /// Rank reports send a [`PrefetchBy`] as its index in `ALL`.
    #[test]
    fn prefetch_by_lists_in_declared_order() {
        for (i, b) in PrefetchBy::ALL.into_iter().enumerate() {
            assert_eq!(b as usize, i, "{}", b.name());
        }
    }
}
