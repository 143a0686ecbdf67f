//! The driver's scheduler: many requests through the grid at once (continuous batching).
//!
//! Sequences live in slots and in micro-batches (groups). Each group has at most one step in
//! flight; with several groups and `overlap`, the driver launches a step of every group before
//! collecting the oldest, so with pp > 1 stage s works on one group while stage s+1 works on
//! another. A step of a group carries one decode token of each of its running sequences plus
//! chunks of prompts still being prefilled, up to `step_tokens`, so a long new prompt never
//! stalls the others for more than one chunk.
//!
//! KV memory is a pool of pages ([`PAGE`] positions each) with a free list. A request is
//! admitted (FIFO) when a slot is free and the pool holds the pages of its whole length
//! (prompt + `max_tokens`, within the context); otherwise it waits for a finishing sequence to
//! return pages. A request that could never fit gets its own error; the others run on.
//!
//! The whole pages a sequence has written stay cached after it ends (`PrefixCache`), so a
//! prompt beginning with the same tokens starts where they end and runs only the rest.

use super::prefix::{PrefixCache, ROOT};
use super::{
    check_prompt,
    sampling::{SamplingParams, TokenRules},
    Admit, Drafted, Engine, Finish, Plan, Pooled, Pooling, Scored, Step, StepResult, TokenLogprobs,
};
use crate::comm::{Comm, Link};
use crate::error::{Error, Result};
use crate::grammar::{Constrained, Format, Grammars};
use crate::model::{Span, PAGE};
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

/// One prompt to complete.
#[derive(Debug, Clone, Default)]
pub struct Request {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub ignore_eos: bool,
    pub params: SamplingParams,
    /// Keep the raw full-vocabulary logits of the last prompt position.
    pub keep_logits: bool,
    /// Report each token's log-probability and this many alternatives' (at most
    /// [`MAX_LOGPROBS`](super::MAX_LOGPROBS)).
    pub logprobs: Option<usize>,
    /// Report the log-probabilities of each prompt token after the first (given those before
    /// it), with this many alternatives'. With `max_tokens` 0 the request only scores its
    /// prompt.
    pub prompt_logprobs: Option<usize>,
    /// Its logit biases, stop tokens and least number of tokens.
    pub rules: TokenRules,
    /// What its answer must be (structured output; [`RunOptions::grammars`] reads it).
    pub format: Option<Format>,
    /// `format` already compiled ([`Grammars::start`]) where the request was made: the
    /// scheduler compiles it at admission where this is `None`, and the running sequences'
    /// steps wait for that (serve compiles each request's format in its own thread).
    pub grammar: Option<Constrained>,
    /// The request is for its prompt's embedding, pooled so ([`Completion::embedding`]): it
    /// brings no tokens (`max_tokens` 0) nor log-probabilities, and its prompt runs whole.
    pub embed: Option<Pooling>,
}

/// How the scheduler runs a set of requests.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// Sequences running at once (slots).
    pub max_batch: usize,
    /// Groups of sequences stepped separately (micro-batches).
    pub micro_batches: usize,
    /// Keep a step of every group in flight (pipeline overlap); otherwise one step at a time.
    pub overlap: bool,
    /// Most tokens in one step (decode tokens plus prompt chunks).
    pub step_tokens: usize,
    /// KV memory per rank, in bytes: at most what `max_batch` of these requests need at their
    /// full length or, with the prefix cache, the larger of that and the default; `None`:
    /// enough for `max_batch` of these requests at their full length, at most a quarter of the
    /// memory available on this node per local rank.
    pub kv_bytes: Option<usize>,
    pub eos_ids: Vec<u32>,
    /// After each step, when no other is in flight and work remains, every rank runs its
    /// reader ([`Engine::set_reader`], through [`Plan::Read`]). The time that takes is left
    /// out of the run's clock: token times and `elapsed_ms` are those of the steps alone.
    pub read_between_steps: bool,
    /// `Some(n)`: a comparison of two sides run step by step, so that both meet the same
    /// moments of the machine. The first `n` requests are side 0's (the engine's own weights
    /// and ways), the rest side 1's ([`super::OtherSide`]); each side is one group of its own
    /// (`micro_batches` and `overlap` are not used), their steps alternate while both have
    /// work, and each side's token times count its own steps only, as if it had run alone.
    pub sides: Option<usize>,
    /// Keep the KV pages of ended sequences' prompts and tokens for prompts that begin with
    /// the same tokens (`PrefixCache`). Never with `sides` nor for a model with windowed
    /// layers (their keys live in per-slot rings); a request scoring its prompt runs all of it.
    pub prefix_cache: bool,
    /// Speculative decoding by prompt lookup: at most this many draft tokens a step for each
    /// sequence, taken from what followed the latest earlier occurrence of its last tokens in
    /// its prompt and output, and checked in the step ([`Drafted`]; a penalized sequence's
    /// rows count the drafts before them, see `Engine::pick`). 0: none.
    pub speculate: usize,
    /// The model's vocabulary for structured output ([`Request::format`]); a request asking
    /// for it without them fails alone.
    pub grammars: Option<Arc<Grammars>>,
}

impl Default for RunOptions {
    fn default() -> Self {
        RunOptions {
            max_batch: 8,
            micro_batches: 1,
            overlap: true,
            step_tokens: 512,
            kv_bytes: None,
            eos_ids: Vec::new(),
            read_between_steps: false,
            sides: None,
            prefix_cache: true,
            speculate: 0,
            grammars: None,
        }
    }
}

/// The outcome of one request.
#[derive(Debug, Clone)]
pub struct Completion {
    pub token_ids: Vec<u32>,
    pub finish: Finish,
    /// Why the request could not run (`finish` is then `Error`).
    pub error: Option<String>,
    /// When each token arrived, in ms since the run began.
    pub times_ms: Vec<f64>,
    pub prompt_logits: Option<Vec<f32>>,
    /// Each token's log-probabilities, where the request asked for them.
    pub logprobs: Vec<TokenLogprobs>,
    /// The log-probabilities of each prompt token after the first, where the request asked.
    pub prompt_logprobs: Vec<TokenLogprobs>,
    /// Prompt tokens whose keys and values came from the prefix cache, not run again.
    pub cached_tokens: usize,
    /// Draft tokens its steps checked ([`RunOptions::speculate`]), and those kept.
    pub drafted: usize,
    pub accepted: usize,
    /// The prompt's embedding, where the request asked for it ([`Request::embed`]): its last
    /// hidden states pooled, `hidden_size` values (not normalized).
    pub embedding: Option<Vec<f32>>,
}

impl Completion {
    /// Tokens per second after the first token.
    pub fn decode_tokens_per_s(&self) -> f64 {
        match (self.times_ms.first(), self.times_ms.last()) {
            (Some(a), Some(b)) => super::tokens_per_s(self.times_ms.len() - 1, b - a),
            _ => 0.0,
        }
    }
}

/// Totals of a run, for reports.
#[derive(Debug, Clone, Default)]
pub struct RunStats {
    /// Steps launched, and those with at least one prompt chunk.
    pub steps: usize,
    pub prefill_steps: usize,
    pub kv_pages: usize,
    pub kv_page_bytes: usize,
    /// Most pages in use at once (by running sequences; cached pages held by none are free
    /// to take).
    pub kv_pages_peak: usize,
    /// Prompt tokens read from the prefix cache rather than run.
    pub cached_tokens: usize,
    /// Draft tokens checked ([`RunOptions::speculate`]), and those kept.
    pub drafted: usize,
    pub accepted: usize,
    pub elapsed_ms: f64,
}

struct Seq {
    slot: usize,
    pages: Vec<u32>,
    group: usize,
    /// Prompt tokens sent so far.
    fed: usize,
    /// Pages at the front of its text in the prefix cache (found there or put there), and the
    /// last of them in the cache's chain ([`ROOT`] for none): its own page, or another
    /// sequence's that holds the same tokens (`borrowed`).
    cached: (usize, u32),
    /// Cached pages of other sequences it holds in its chain in place of its own: pages it ran
    /// at the same time as another (`PrefixCache::register` found the same tokens after the
    /// same parent), so its later pages follow theirs in the cache. (Room for all its pages
    /// made at admission.)
    borrowed: Vec<u32>,
    /// The drafts of its step in flight (room for them made at admission, where it may
    /// draft).
    drafts: Vec<u32>,
}

/// A launched step: the requests of its emitting spans, in order (each brings a token for its
/// span and one for each of its drafts: `rows` in all), of its scored spans (with the
/// log-probabilities each brings and whether it ends its prompt) and of its pooled spans
/// (whether each ends its prompt, and so brings its embedding).
struct InFlight {
    group: usize,
    emitting: Vec<usize>,
    rows: usize,
    scoring: Scoring,
    pooling: PooledChunks,
    want_logits: bool,
}

/// A step's scored chunks: (request, the scores it brings, whether it ends the prompt).
type Scoring = Vec<(usize, usize, bool)>;
/// A step's pooled chunks: (request, whether it ends the prompt).
type PooledChunks = Vec<(usize, bool)>;

/// The driver's side of a run: where its requests come from and where their tokens go.
pub trait Traffic {
    /// Appends to `into` the requests that came since the last call, numbered on from those
    /// before (the first is 0). With `wait` nothing runs or waits, and the call may block until
    /// a request comes. `Ok(false)`: no more will come; the run ends once those it has finish.
    fn arrivals(&mut self, wait: bool, into: &mut Vec<Request>) -> Result<bool>;
    /// Request `key` brought `token`, with its log-probabilities if the request asked for them;
    /// `false` stops it ([`Finish::Stop`]).
    fn token(&mut self, key: usize, token: u32, logprobs: Option<&TokenLogprobs>) -> Result<bool>;
    /// Request `key` is over.
    fn done(&mut self, key: usize, completion: Completion) -> Result<()>;
    /// Request `key`'s prompt is scored ([`Request::prompt_logprobs`]): the log-probabilities of
    /// its tokens after the first, before any token it brings.
    fn prompt_scored(&mut self, _key: usize, _logprobs: &[TokenLogprobs]) -> Result<()> {
        Ok(())
    }
    /// Whether nobody waits for request `key` any more (its client went away): asked while it
    /// waits to be admitted, it then ends without running ([`Finish::Stop`], no tokens).
    fn abandoned(&self, _key: usize) -> bool {
        false
    }
}

/// A list of requests known at the start: [`Engine::run`]'s traffic.
struct Listed<'a, F> {
    requests: &'a [Request],
    given: bool,
    out: Vec<Option<Completion>>,
    on_token: F,
}

impl<F: FnMut(usize, u32) -> Result<bool>> Traffic for Listed<'_, F> {
    fn arrivals(&mut self, _wait: bool, into: &mut Vec<Request>) -> Result<bool> {
        if !std::mem::replace(&mut self.given, true) {
            into.extend_from_slice(self.requests);
        }
        Ok(false)
    }
    fn token(&mut self, key: usize, token: u32, _: Option<&TokenLogprobs>) -> Result<bool> {
        (self.on_token)(key, token)
    }
    fn done(&mut self, key: usize, completion: Completion) -> Result<()> {
        self.out[key] = Some(completion);
        Ok(())
    }
}

/// A request the scheduler holds: waiting or running.
struct Live {
    key: usize,
    req: Request,
    out: Completion,
    /// Its place while it runs.
    seq: Option<Seq>,
    /// Its grammar so far, where it asks for structured output.
    grammar: Option<Constrained>,
}

impl Engine {
    /// Driver: completes every request, as many at a time as slots and KV memory allow, and
    /// calls `on_token(request, token)` as each token arrives (returning `false` stops that
    /// sequence with [`Finish::Stop`]). Per-request problems (a prompt too long for the context
    /// or the KV memory) end only that request. Call [`Engine::finish`] afterwards.
    pub fn run(
        &mut self,
        requests: &[Request],
        opts: &RunOptions,
        comm: &dyn Comm,
        link: &dyn Link,
        on_token: impl FnMut(usize, u32) -> Result<bool>,
    ) -> Result<Vec<Completion>> {
        self.run_with_stats(requests, opts, comm, link, on_token).map(|(c, _)| c)
    }

    /// [`Engine::run`], also returning the run's totals.
    pub fn run_with_stats(
        &mut self,
        requests: &[Request],
        opts: &RunOptions,
        comm: &dyn Comm,
        link: &dyn Link,
        on_token: impl FnMut(usize, u32) -> Result<bool>,
    ) -> Result<(Vec<Completion>, RunStats)> {
        // The most pages the run can use at once: its `max_batch` largest requests at full length.
        let ctx = self.max_context();
        let mut need: Vec<usize> = requests.iter().map(|r| pages_of(r, ctx)).collect();
        need.sort_unstable_by(|a, b| b.cmp(a));
        let want = need.iter().take(opts.max_batch).sum::<usize>().max(1);
        // No more slots than requests (each slot's buffers are reserved whether it runs or
        // not), and no more tokens a step than all the prompts and a decode token and its
        // drafts for every slot (a step's buffers are counted against the memory for as
        // many): neither changes what any step holds.
        let slots = opts.max_batch.min(requests.len()).max(1);
        let most = requests.iter().map(|r| r.prompt.len()).sum::<usize>() + slots * (1 + opts.speculate);
        let opts = &RunOptions { max_batch: slots, step_tokens: opts.step_tokens.min(most), ..opts.clone() };
        let mut listed = Listed { requests, given: false, out: vec![None; requests.len()], on_token };
        let stats = self.drive(&mut listed, opts, want, comm, link)?;
        let out = listed.out.into_iter().map(|c| c.expect("every listed request is done")).collect();
        Ok((out, stats))
    }

    /// Driver: runs requests as `traffic` brings them until it brings no more and those it
    /// brought are done, with a KV pool of `want` pages where the KV memory allows (the
    /// pages the largest requests that can run at once need). Call [`Engine::finish`]
    /// afterwards.
    pub fn drive(
        &mut self,
        traffic: &mut dyn Traffic,
        opts: &RunOptions,
        want: usize,
        comm: &dyn Comm,
        link: &dyn Link,
    ) -> Result<RunStats> {
        if opts.max_batch == 0 || opts.micro_batches == 0 || opts.step_tokens == 0 {
            return Err(Error::Input("max batch, micro-batches and step tokens must be at least 1".into()));
        }
        let t0 = Instant::now();
        // Milliseconds since `t0`, less `paused` (the readers' time, see `read_between_steps`).
        let ms = |t0: Instant, paused: f64| t0.elapsed().as_secs_f64() * 1e3 - paused;
        let mut paused = 0.0;
        let ctx = self.max_context();
        let vocab = self.shard.cfg.vocab_size;
        let positions = |r: &Request| positions_of(r, ctx);
        let page_bytes = self.max_page_bytes().max(1);
        // Unasked, a quarter of the tightest node's memory (where none is known, 1 GiB a node,
        // shared by its ranks).
        let room = self.kv_room();
        let auto = room.map_or((1 << 30) / crate::comm::mpi::local_ranks() / page_bytes, |r| r.pages() / 4);
        let caching = opts.prefix_cache && opts.sides.is_none() && !self.windowed();
        // A prompt longer than LongRoPE's original context rotates every position by the long
        // factors, so its pages are neither read from the cache nor put there: shorter prompts
        // rotate the same tokens otherwise.
        let original = self.shard.cfg.long_rope_original();
        let long_rope = |prompt: &[u32]| original.is_some_and(|o| prompt.len() > o);
        // KV memory asked for is the pool's, with the prefix cache, up to the larger of what
        // the requests need at once and the unasked default: what the running sequences leave
        // of it keeps prefixes for later prompts.
        let pages = match opts.kv_bytes {
            Some(b) if caching => (b / page_bytes).min(want.max(auto)),
            Some(b) => (b / page_bytes).min(want.max(1)),
            None => want.max(1).min(auto).max(1),
        };
        if pages == 0 {
            return Err(Error::Input(format!(
                "the KV memory ({} bytes per rank) holds no page; a page of {PAGE} positions takes {page_bytes} bytes",
                opts.kv_bytes.unwrap_or(0)
            )));
        }
        let slots = opts.max_batch;
        // Every slot's token and its drafts: the most rows a step's output head takes but for
        // prompts' last chunks. A step holds at most `step_tokens` of a sequence (a page's
        // worth when it would hold none, see `build_step`), in all that or its decode tokens
        // where they are more.
        let rows = slots * (1 + opts.speculate);
        let chunk = opts.step_tokens.max(PAGE);
        let tokens = chunk.max(rows);
        let counts = [pages, tokens, slots, rows];
        if let Some(room) = self.rooms().iter().find(|r| r.need(counts) > r.available) {
            let (need, kv) = (room.need(counts), room.need([pages, 0, 0, 0]));
            return Err(Error::Input(format!(
                "a run of {slots} sequence(s) at once would take {} MiB ({} MiB of KV cache, {} MiB of buffers for steps of up to {tokens} tokens), but host {} (the node of rank {}) has {} MiB available for its {} rank(s): use a smaller batch, fewer tokens a step or less KV memory",
                need >> 20,
                kv >> 20,
                (need - kv) >> 20,
                room.host,
                room.rank,
                room.available >> 20,
                room.ranks
            )));
        }
        let mut cache = PrefixCache::new(if caching { pages } else { 0 });
        // A waiting request's cached pages, looked up at each try to admit it.
        let mut hit: Vec<u32> = Vec::with_capacity(if caching { pages } else { 0 });
        // Side by side: the first `n` requests side 0's, the rest side 1's; one group a side,
        // one step in flight, each side's own clock.
        let side_of = |key: usize| opts.sides.map_or(0, |n| usize::from(key >= n));
        // A group's side, and its queue of waiting requests: side by side the group's own.
        let side_of_group = |g: usize| if opts.sides.is_some() { g } else { 0 };
        let groups = if opts.sides.is_some() { 2 } else { opts.micro_batches.min(slots) };
        let depth = if opts.overlap && opts.sides.is_none() { groups } else { 1 };
        let mut clocks = [0.0f64; 2];
        let mut last = 0.0;
        self.begin((pages, slots, chunk, rows), comm, link)?;

        // The requests held, by place (a place is reused once its request is done).
        let mut live: Vec<Option<Live>> = Vec::new();
        let mut vacant: Vec<usize> = Vec::new();
        let mut arrived = 0;
        let mut came: Vec<Request> = Vec::new();
        let mut more = true;
        // Requests of each side so far (side by side, a side's slots).
        let mut per_side = [0usize; 2];
        // Requests waiting, first come first served: one queue, or side by side one a side.
        let mut waiting = vec![VecDeque::new(); if opts.sides.is_some() { 2 } else { 1 }];
        let mut free_slots: Vec<usize> = (0..slots).rev().collect();
        let mut free_pages = FreePages::new(pages);
        let mut members: Vec<Vec<usize>> = vec![Vec::new(); groups];
        let mut busy = vec![false; groups];
        let mut flight: VecDeque<InFlight> = VecDeque::new();
        let mut stats = RunStats { kv_pages: pages, kv_page_bytes: page_bytes, ..RunStats::default() };
        let mut next_group = 0;
        // Reused from step to step (as the engine's own buffers are), so a decode step
        // allocates nothing: the plan, and the emitting lists of collected steps.
        let mut plan = Plan::Step(Step::default());
        let mut spare: Vec<Vec<usize>> = Vec::new();
        // The requests a collected step ended, and how.
        let mut ended: Vec<(usize, Finish)> = Vec::with_capacity(slots);
        loop {
            // New requests: nothing running or waiting, wait for one (every other rank asleep
            // meanwhile); else take what came.
            if more {
                let idle = flight.is_empty() && live.len() == vacant.len();
                more = traffic.arrivals(false, &mut came)?;
                if more && idle && came.is_empty() {
                    self.launch(&Plan::Idle, comm, link)?;
                    more = traffic.arrivals(true, &mut came)?;
                }
            }
            for mut req in came.drain(..) {
                let key = arrived;
                arrived += 1;
                let need = pages_of(&req, ctx);
                let alternatives = req.logprobs.max(req.prompt_logprobs).unwrap_or(0);
                let mut problem = match check_prompt(req.prompt.len(), ctx) {
                    Err(e) => Some(e.to_string()),
                    Ok(()) if need > pages => Some(format!(
                        "the prompt of {} with max_tokens {} needs {need} KV pages of {PAGE} positions ({:.1} MiB per rank) but the KV memory holds {pages} ({:.1} MiB)",
                        crate::count(req.prompt.len(), "token"),
                        req.max_tokens,
                        (need * page_bytes) as f64 / (1 << 20) as f64,
                        (pages * page_bytes) as f64 / (1 << 20) as f64
                    )),
                    Ok(()) if alternatives > super::MAX_LOGPROBS => Some(format!(
                        "log-probabilities list at most {} alternatives a token, {alternatives} asked",
                        super::MAX_LOGPROBS
                    )),
                    Ok(()) if req.embed.is_some() && (req.max_tokens > 0 || req.prompt_logprobs.is_some()) => {
                        Some("a request for an embedding brings no tokens nor log-probabilities".into())
                    }
                    Ok(()) => req.params.check().err().or_else(|| req.rules.check(vocab, req.max_tokens).err()),
                };
                let mut grammar = req.grammar.take();
                if let (None, None, Some(f)) = (&problem, &grammar, &req.format) {
                    match opts.grammars.as_ref().map(|g| g.start(f)) {
                        Some(Ok(c)) => grammar = Some(c),
                        Some(Err(e)) => problem = Some(e),
                        None => problem = Some("structured output needs the model's vocabulary".into()),
                    }
                }
                let mut out = Completion {
                    token_ids: Vec::new(),
                    finish: Finish::Length,
                    error: None,
                    times_ms: Vec::new(),
                    prompt_logits: None,
                    logprobs: Vec::new(),
                    prompt_logprobs: Vec::new(),
                    cached_tokens: 0,
                    drafted: 0,
                    accepted: 0,
                    embedding: None,
                };
                let brings = req.max_tokens > 0 || req.prompt_logprobs.is_some() || req.embed.is_some();
                if problem.is_some() || !brings {
                    if problem.is_some() {
                        out.finish = Finish::Error;
                        out.error = problem;
                    }
                    traffic.done(key, out)?;
                    continue;
                }
                per_side[side_of(key)] += 1;
                let at = vacant.pop().unwrap_or_else(|| {
                    live.push(None);
                    live.len() - 1
                });
                live[at] = Some(Live { key, req, out, seq: None, grammar });
                waiting[side_of(key)].push_back(at);
            }
            // Slots a group may fill (side by side, a side's requests).
            let per_group = |g: usize| match opts.sides {
                Some(_) => per_side[g],
                None => slots.div_ceil(groups),
            };
            // Launch a step for every idle group with work, up to the depth.
            let mut tried = 0;
            while flight.len() < depth && tried < groups && !flight.iter().any(|f| f.want_logits) {
                let g = next_group;
                next_group = (next_group + 1) % groups;
                tried += 1;
                if busy[g] {
                    continue;
                }
                let Plan::Step(step) = &mut plan else { unreachable!("the scheduler's plan is a step") };
                step.side = side_of_group(g) as u8;
                // Admission, first come first served.
                step.admit.clear();
                let queue = &mut waiting[side_of_group(g)];
                while let Some(&at) = queue.front() {
                    if live[at].as_ref().is_some_and(|l| traffic.abandoned(l.key)) {
                        queue.pop_front();
                        vacant.push(at);
                        if let Some(mut l) = live[at].take() {
                            l.out.finish = Finish::Stop;
                            traffic.done(l.key, l.out)?;
                        }
                        continue;
                    }
                    let l = live[at].as_ref().expect("a waiting request is held");
                    let need = pages_of(&l.req, ctx);
                    if members[g].len() >= per_group(g) || free_slots.is_empty() {
                        break;
                    }
                    // The cached whole pages its prompt begins with, its last token left to run
                    // (none for a prompt to score or pool: all of it runs).
                    hit.clear();
                    let whole = l.req.prompt_logprobs.is_some() || l.req.embed.is_some();
                    if caching && !whole && !long_rope(&l.req.prompt) {
                        cache.lookup(&l.req.prompt, (l.req.prompt.len() - 1) / PAGE, &mut hit);
                        // A prompt whose pages a running sequence is writing waits for them
                        // (and the queue behind it, first come first served).
                        let running = members.iter().flatten().filter_map(|&m| live[m].as_ref());
                        if worth_waiting(&l.req.prompt, hit.len(), running) {
                            break;
                        }
                    }
                    let fresh = need - hit.len();
                    if free_pages.len() + cache.idle() - cache.idle_among(&hit) < fresh {
                        break;
                    }
                    queue.pop_front();
                    let l = live[at].as_mut().expect("a waiting request is held");
                    let slot = free_slots.pop().expect("checked");
                    cache.hold(&hit);
                    if free_pages.len() < fresh {
                        cache.reclaim(fresh - free_pages.len(), |p| free_pages.push(p));
                    }
                    let skipped = hit.len() * PAGE;
                    let cached = (hit.len(), hit.last().copied().unwrap_or(ROOT));
                    let borrowed = Vec::with_capacity(if caching { need } else { 0 });
                    let mut pg = Vec::with_capacity(need);
                    pg.extend_from_slice(&hit);
                    pg.extend(free_pages.take(fresh));
                    step.admit.push(Admit {
                        slot,
                        pages: pg.clone(),
                        params: l.req.params.clone(),
                        logprobs: l.req.logprobs,
                        history: l.req.prompt[..skipped].to_vec(),
                        prompt_len: l.req.prompt.len(),
                        logit_bias: l.req.rules.logit_bias.clone(),
                        enders: enders(&l.req, &opts.eos_ids),
                        min_tokens: l.req.rules.min_tokens,
                    });
                    let drafts = Vec::with_capacity(opts.speculate);
                    l.seq = Some(Seq { slot, pages: pg, group: g, fed: skipped, cached, borrowed, drafts });
                    l.out.cached_tokens = skipped;
                    stats.cached_tokens += skipped;
                    members[g].push(at);
                    // Room for every token the request can bring.
                    let r = &l.req;
                    let most = r.max_tokens.min(positions(r) + 1 - r.prompt.len());
                    l.out.token_ids.reserve_exact(most);
                    l.out.times_ms.reserve_exact(most);
                    if r.logprobs.is_some() {
                        l.out.logprobs.reserve_exact(most);
                    }
                    if r.prompt_logprobs.is_some() {
                        l.out.prompt_logprobs.reserve_exact(r.prompt.len() - 1);
                    }
                }
                stats.kv_pages_peak = stats.kv_pages_peak.max(pages - free_pages.len() - cache.idle());
                let mut emitting = spare.pop().unwrap_or_default();
                let (mut scoring, mut pooling) = (Vec::new(), Vec::new());
                let limits = Limits { step_tokens: opts.step_tokens, speculate: opts.speculate, ctx };
                let into = (&mut emitting, &mut scoring, &mut pooling);
                let Some(rows) = build_step(&members[g], &mut live, limits, step, into) else {
                    spare.push(emitting);
                    continue;
                };
                allowed_tokens(opts, &emitting, &mut live, step);
                stats.drafted += rows - emitting.len();
                if step.spans.iter().any(|s| s.len > 1 || !s.emit) {
                    stats.prefill_steps += 1;
                }
                stats.steps += 1;
                let want_logits = step.want_logits;
                busy[g] = true;
                self.launch(&plan, comm, link)?;
                flight.push_back(InFlight { group: g, emitting, rows, scoring, pooling, want_logits });
                tried = 0;
            }
            let Some(f) = flight.pop_front() else {
                if more {
                    continue;
                }
                if let Some(&at) = waiting.iter().find_map(|q| q.front()) {
                    // Nothing runs, so every page is free: only a bug leaves a request waiting.
                    let key = live[at].as_ref().map_or(at, |l| l.key);
                    return Err(Error::Comm(format!("request {key} waits with the KV pool empty")));
                }
                break;
            };
            let mut r: StepResult = self.collect(f.rows, link)?;
            busy[f.group] = false;
            // A step's tokens arrive together: one time for all of them, not one per token
            // taken after the ones before it were handed on (and, for `generate`, printed).
            // (Stamped one by one, a batch of 4 with 2 new tokens each had no gap that began
            // after the last first token and ended before the first last one, and `bench`
            // reported no decode at all.)
            let mut now = ms(t0, paused);
            if opts.sides.is_some() {
                // One step in flight: the time since the step before is this one's.
                clocks[f.group] += now - last;
                last = now;
                now = clocks[f.group];
            }
            // Scored prompt chunks first: a prompt's scores come before its first token.
            let brought: usize = f.scoring.iter().map(|s| s.1).sum();
            if brought != r.prompt_logprobs.len() {
                return Err(Error::Comm(format!(
                    "a step scoring {brought} prompt positions brought {} log-probabilities",
                    r.prompt_logprobs.len()
                )));
            }
            let mut scores = r.prompt_logprobs.drain(..);
            for &(at, count, last_chunk) in &f.scoring {
                let l = live[at].as_mut().expect("a scored request is held");
                l.out.prompt_logprobs.extend(scores.by_ref().take(count));
                if !last_chunk {
                    continue;
                }
                traffic.prompt_scored(l.key, &l.out.prompt_logprobs)?;
                if l.req.max_tokens == 0 {
                    // Its prompt scored, a request that brings no token is over.
                    ended.push((at, Finish::Length));
                }
            }
            drop(scores);
            // Pooled prompts that ended bring their embeddings, and are over.
            let h = self.shard.cfg.hidden_size;
            let ends = f.pooling.iter().filter(|p| p.1).count();
            if r.embeddings.len() != ends * h {
                return Err(Error::Comm(format!(
                    "a step ending {ends} pooled prompts brought {} values",
                    r.embeddings.len()
                )));
            }
            let mut embeddings = r.embeddings.chunks_exact(h);
            for &(at, _) in f.pooling.iter().filter(|p| p.1) {
                let l = live[at].as_mut().expect("a pooled request is held");
                l.out.embedding = embeddings.next().map(<[f32]>::to_vec);
                ended.push((at, Finish::Length));
            }
            let mut row = 0;
            for &at in &f.emitting {
                let l = live[at].as_mut().expect("an emitting request is held");
                let (req, c, s) = (&l.req, &mut l.out, l.seq.as_ref().expect("an emitting request runs"));
                // The span's rows: its last real token's, then each draft's. A draft is kept
                // where the row before it chose it, and each kept row brings its token.
                let rows = row..row + 1 + s.drafts.len();
                row = rows.end;
                c.drafted += s.drafts.len();
                for (i, r_i) in rows.enumerate() {
                    let tok = r.tokens[r_i];
                    if c.token_ids.is_empty() && req.keep_logits {
                        c.prompt_logits = r.logits.take();
                    }
                    c.token_ids.push(tok);
                    c.times_ms.push(now);
                    let lp = match r.logprobs.get_mut(r_i).and_then(Option::take) {
                        Some(lp) if req.logprobs.is_some() => {
                            c.logprobs.push(lp);
                            c.logprobs.last()
                        }
                        None if req.logprobs.is_some() => {
                            return Err(Error::Comm(format!(
                                "a step brought no log-probabilities for request {}",
                                l.key
                            )))
                        }
                        _ => None,
                    };
                    let go_on = traffic.token(l.key, tok, lp)?;
                    let pos = req.prompt.len() + c.token_ids.len() - 1;
                    // A grammar that takes nothing more (or fails) ends the answer.
                    let complete = l.grammar.as_mut().is_some_and(|g| match g.push(tok) {
                        Ok(()) => g.done(),
                        Err(e) => {
                            c.error.get_or_insert(e);
                            true
                        }
                    });
                    let finish = if !req.ignore_eos && opts.eos_ids.contains(&tok) {
                        Some(Finish::Eos)
                    } else if !go_on || complete || req.rules.stop_token_ids.contains(&tok) {
                        Some(Finish::Stop)
                    } else if c.token_ids.len() >= req.max_tokens {
                        Some(Finish::Length)
                    } else if pos >= positions(req) {
                        Some(Finish::Context)
                    } else {
                        None
                    };
                    if let Some(fin) = finish {
                        ended.push((at, fin));
                        break;
                    }
                    if s.drafts.get(i) != Some(&tok) {
                        break;
                    }
                    c.accepted += 1;
                    stats.accepted += 1;
                }
            }
            if caching {
                // Every token the group's sequences were sent is in their pages now.
                for &at in &members[f.group] {
                    let l = live[at].as_mut().expect("members are held");
                    if !long_rope(&l.req.prompt) {
                        cache_written(&mut cache, l);
                    }
                }
            }
            for (at, fin) in ended.drain(..) {
                let mut l = live[at].take().expect("an ended request is held");
                l.out.finish = if l.out.error.is_some() { Finish::Error } else { fin };
                let s = l.seq.take().expect("an ended request was running");
                members[s.group].retain(|&m| m != at);
                free_slots.push(s.slot);
                match caching {
                    true => {
                        cache.release(&s.pages, |p| free_pages.push(p));
                        cache.release(&s.borrowed, |p| free_pages.push(p));
                    }
                    false => free_pages.give(&s.pages),
                }
                vacant.push(at);
                traffic.done(l.key, l.out)?;
            }
            self.recycle(r);
            spare.push(f.emitting);
            if opts.read_between_steps
                && flight.is_empty()
                && (waiting.iter().any(|q| !q.is_empty()) || live.len() > vacant.len())
            {
                let t = Instant::now();
                self.launch(&Plan::Read, comm, link)?;
                paused += t.elapsed().as_secs_f64() * 1e3;
            }
        }
        stats.elapsed_ms = ms(t0, paused);
        Ok(stats)
    }
}

/// Puts into the prefix cache each whole page of a running sequence that its steps have
/// written (every token it was sent: its prompt so far, then each token it brought but the
/// last), after those it has there. Where another sequence's page with the same tokens after
/// the same parent is cached already (the two ran them at the same time), the sequence holds
/// that one instead and its later pages follow it: their keys and values are the same bits
/// (a sequence's tokens are, whatever shares its steps), so a later prompt may read them
/// after either.
fn cache_written(cache: &mut PrefixCache, l: &mut Live) {
    let s = l.seq.as_mut().expect("a running request");
    let (p, brought) = (&l.req.prompt, &l.out.token_ids);
    let written = if s.fed < p.len() { s.fed } else { p.len() + brought.len().saturating_sub(1) };
    while (s.cached.0 + 1) * PAGE <= written {
        let (n, parent) = s.cached;
        let mut block = [0; PAGE];
        for (i, b) in block.iter_mut().enumerate() {
            *b = token_at(p, brought, n * PAGE + i);
        }
        let page = s.pages[n];
        s.cached = match cache.register(parent, &block, page) {
            Ok(()) => (n + 1, page),
            Err(there) => {
                cache.hold(&[there]);
                s.borrowed.push(there);
                (n + 1, there)
            }
        };
    }
}

/// Whether a waiting `prompt`, `have` of whose whole pages are in the prefix cache, should wait
/// for a `running` sequence to write more of them: one whose prompt it begins with, in more
/// whole pages (its own last token left to run), which go into the cache once written. It
/// waits where the pages still to come spare at least half of what it would run now.
/// Requests that arrive together after one preamble then run it once, the first of them
/// alone: the others wait a step, not the time of running it again beside it. A prompt that
/// shares only a few pages with a running one (a chat template's opening) does not wait.
fn worth_waiting<'a>(prompt: &[u32], have: usize, running: impl Iterator<Item = &'a Live>) -> bool {
    let most = (prompt.len() - 1) / PAGE;
    let shared = |r: &Live| prompt.iter().zip(&r.req.prompt).take_while(|(a, b)| a == b).count() / PAGE;
    let coming = running.map(shared).max().unwrap_or(0).min(most);
    let gain = coming.saturating_sub(have) * PAGE;
    gain > 0 && 2 * gain >= prompt.len() - have * PAGE
}

/// Token `i` of a sequence's text: its prompt, then the tokens it brought.
fn token_at(prompt: &[u32], brought: &[u32], i: usize) -> u32 {
    if i < prompt.len() {
        prompt[i]
    } else {
        brought[i - prompt.len()]
    }
}

/// Puts into `step` the tokens each of its emitting sequences that asks for structured output
/// (`emitting`, in span order) may bring next, as its grammar says. A grammar that fails lets
/// only the end-of-sequence tokens through, and the request ends with its error.
fn allowed_tokens(opts: &RunOptions, emitting: &[usize], live: &mut [Option<Live>], step: &mut Step) {
    step.allowed_seqs.clear();
    step.allowed.clear();
    let Some(grammars) = &opts.grammars else { return };
    for &at in emitting {
        let l = live[at].as_mut().expect("an emitting request is held");
        let (Some(g), Some(s)) = (l.grammar.as_mut(), l.seq.as_ref()) else { continue };
        let w = step.allowed.len();
        step.allowed.resize(w + grammars.words(), 0);
        let bits = &mut step.allowed[w..];
        if let Err(e) = grammars.allowed(g, bits) {
            bits.fill(0);
            for &t in &opts.eos_ids {
                if let Some(w) = bits.get_mut(t as usize / 64) {
                    *w |= 1 << (t % 64);
                }
            }
            l.out.error.get_or_insert(e);
        }
        step.allowed_seqs.push(s.slot);
    }
}

/// The tokens that end request `r` (the end-of-sequence tokens `eos` unless it ignores them, and
/// its stop tokens), where it brings a least number of tokens (none: no need to know them).
fn enders(r: &Request, eos: &[u32]) -> Vec<u32> {
    if r.rules.min_tokens == 0 {
        return Vec::new();
    }
    let eos = if r.ignore_eos { &[][..] } else { eos };
    eos.iter().chain(&r.rules.stop_token_ids).copied().collect()
}

/// The KV pages a request takes: its prompt and every token it may bring, within the context.
fn pages_of(r: &Request, ctx: usize) -> usize {
    positions_of(r, ctx).div_ceil(PAGE)
}

/// The positions a request may take: its prompt and every token it may bring, within the
/// context.
fn positions_of(r: &Request, ctx: usize) -> usize {
    (r.prompt.len() + r.max_tokens).min(ctx)
}

/// What bounds a step: its tokens, a sequence's drafts, the model's context.
#[derive(Clone, Copy)]
struct Limits {
    step_tokens: usize,
    speculate: usize,
    ctx: usize,
}

/// The next step of a group, into `step` (its admissions already there): a decode token of
/// each running member (after it, drafts where it may draft and its text offers some), then
/// prompt chunks while the step has room (at least one chunk, so prefill always advances);
/// into `emitting` the requests of the emitting spans, in order, into `scoring` those of
/// the scored chunks (prompts asking for their log-probabilities: the request, the scores the
/// chunk brings, whether it ends the prompt) and into `pooling` those of pooled chunks (prompts
/// asking for their embedding: the request, whether the chunk ends the prompt). The rows the
/// step brings (a token for each emitting span and for each draft), or `None` when the group
/// has nothing to run.
fn build_step(
    members: &[usize],
    live: &mut [Option<Live>],
    limits: Limits,
    step: &mut Step,
    (emitting, scoring, pooling): (&mut Vec<usize>, &mut Scoring, &mut PooledChunks),
) -> Option<usize> {
    let Step { spans, tokens, want_logits, scored, drafted, pooled, .. } = step;
    spans.clear();
    tokens.clear();
    emitting.clear();
    scored.clear();
    scoring.clear();
    drafted.clear();
    pooled.clear();
    pooling.clear();
    *want_logits = false;
    for &i in members {
        let l = live[i].as_mut().expect("members are held");
        let s = l.seq.as_mut().expect("members are running");
        let (r, done) = (&l.req, &l.out.token_ids);
        let p = &r.prompt;
        // A constrained sequence's next tokens are each allowed by the grammar after the one
        // before: it drafts none.
        let speculate = if l.grammar.is_some() { 0 } else { limits.speculate };
        s.drafts.clear();
        if s.fed < p.len() {
            continue;
        }
        let last = *done.last().expect("a fully fed prompt has its first token");
        let pos = p.len() + done.len() - 1;
        // Drafts take the positions after `pos` (within the sequence's pages), stand for
        // tokens before the last one it may bring, and leave the span within the chunk every
        // rank's buffers hold (`Engine::drive`'s `begin`).
        let most = speculate
            .min(positions_of(r, limits.ctx).saturating_sub(pos + 1))
            .min(r.max_tokens.saturating_sub(done.len() + 1))
            .min(limits.step_tokens.max(PAGE) - 1);
        if most > 0 {
            lookup_drafts(p, done, most, &mut s.drafts);
        }
        let k = s.drafts.len();
        if k > 0 {
            drafted.push(Drafted { span: spans.len(), k });
        }
        spans.push(Span { seq: s.slot, pos0: pos, len: 1 + k, emit: true });
        tokens.push(last);
        tokens.extend_from_slice(&s.drafts);
        emitting.push(i);
    }
    let mut room = limits.step_tokens.saturating_sub(tokens.len());
    for &i in members {
        let l = live[i].as_mut().expect("members are held");
        let s = l.seq.as_mut().expect("members are running");
        let p = &l.req.prompt;
        if s.fed == p.len() {
            continue;
        }
        let n = (p.len() - s.fed).min(room.max(if spans.is_empty() { PAGE } else { 0 }));
        if n == 0 {
            break;
        }
        let ends = s.fed + n == p.len();
        // A request that only scores its prompt brings no token.
        let emit = ends && l.req.max_tokens > 0;
        if let Some(k) = l.req.prompt_logprobs {
            let next = p.get(s.fed + n).copied();
            scored.push(Scored { span: spans.len(), next, k });
            scoring.push((i, if ends { n - 1 } else { n }, ends));
        }
        if let Some(how) = l.req.embed {
            pooled.push(Pooled { span: spans.len(), how, ends });
            pooling.push((i, ends));
        }
        spans.push(Span { seq: s.slot, pos0: s.fed, len: n, emit });
        tokens.extend_from_slice(&p[s.fed..s.fed + n]);
        s.fed += n;
        if emit {
            if l.req.keep_logits && !*want_logits && emitting.is_empty() {
                *want_logits = true;
            }
            emitting.push(i);
        }
        room = room.saturating_sub(n);
    }
    let drafts: usize = drafted.iter().map(|d| d.k).sum();
    (!spans.is_empty()).then_some(emitting.len() + drafts)
}

/// Longest run of a sequence's last tokens looked up in its text, for drafts.
const DRAFT_NGRAM: usize = 3;
/// Shortest run looked up: a single token repeats too often in any text to predict the next.
const DRAFT_NGRAM_MIN: usize = 2;

/// Prompt lookup: into `out` (cleared first), at most `k` tokens of what followed the latest
/// earlier occurrence, in the sequence's text (`prompt` then `brought`), of its last
/// [`DRAFT_NGRAM`] tokens, or failing that of fewer, down to [`DRAFT_NGRAM_MIN`]; none where
/// none occurs. (Drafts are tokens of the sequence's own text: the last stage's repetition
/// penalty counts them as history already, see `Engine::pick`.)
fn lookup_drafts(prompt: &[u32], brought: &[u32], k: usize, out: &mut Vec<u32>) {
    out.clear();
    let len = prompt.len() + brought.len();
    let at = |i: usize| token_at(prompt, brought, i);
    for n in (DRAFT_NGRAM_MIN..=DRAFT_NGRAM).rev() {
        if len <= n {
            continue;
        }
        let tail = len - n;
        // The latest start before the tail's own whose n tokens are the tail's.
        if let Some(i) = (0..tail).rev().find(|&i| (0..n).all(|j| at(i + j) == at(tail + j))) {
            out.extend((i + n..(i + n + k).min(len)).map(at));
            return;
        }
    }
}

/// The KV pool's free pages, handed out so that a sequence's pages ascend through the pool
/// where they can: a stack whose top is the lowest page of the last run given back. A decode
/// step reads each KV head's pages of a sequence in order; over 2000 positions SmolLM2 decoded
/// faster with its pages ascending than descending in seven pairs of seven (by 1.5–13.5%,
/// median ~5%; 115.8–137.0 against 105.2–129.7 tokens/s, interleaved, while the cores of the
/// 2-core Zen 5 machine sat together), the hardware prefetcher following them better; at 64–192
/// positions and at batch 8 the same within the noise.
struct FreePages(Vec<u32>);

impl FreePages {
    fn new(pages: usize) -> Self {
        FreePages((0..pages as u32).rev().collect())
    }
    fn len(&self) -> usize {
        self.0.len()
    }
    /// `need` pages (at most [`FreePages::len`]), lowest first when they are one run.
    fn take(&mut self, need: usize) -> Vec<u32> {
        let mut pages = self.0.split_off(self.0.len() - need);
        pages.reverse();
        pages
    }
    /// Pages back, to be taken again in the order given.
    fn give(&mut self, pages: &[u32]) {
        self.0.extend(pages.iter().rev());
    }
    /// One page back, to be taken next.
    fn push(&mut self, page: u32) {
        self.0.push(page);
    }
}

#[cfg(test)]
mod tests {
    use super::{lookup_drafts, FreePages};

    #[test]
    fn drafts_follow_the_latest_earlier_run_of_the_last_tokens() {
        let mut out = Vec::new();
        // The last three tokens (7 8 9) occur twice before: the latest one's followers, across
        // the prompt's end, at most k of them.
        lookup_drafts(&[7, 8, 9, 1, 2, 7, 8, 9, 3], &[4, 5, 7, 8, 9], 3, &mut out);
        assert_eq!(out, [3, 4, 5]);
        // Up to the text's end: what follows may be shorter than k.
        lookup_drafts(&[5, 6, 1, 5, 6], &[], 4, &mut out);
        assert_eq!(out, [1, 5, 6]);
        // No earlier run of three: of two (8 9).
        lookup_drafts(&[8, 9, 4, 4], &[1, 8, 9], 2, &mut out);
        assert_eq!(out, [4, 4]);
        // A lone repeated token is not enough; nothing earlier, nothing.
        lookup_drafts(&[3, 1, 2, 5], &[3], 4, &mut out);
        assert!(out.is_empty());
        lookup_drafts(&[], &[1, 2], 4, &mut out);
        assert!(out.is_empty());
    }

    #[test]
    fn free_pages_ascend_and_come_back_in_order() {
        let mut free = FreePages::new(8);
        assert_eq!(free.take(3), [0, 1, 2]);
        assert_eq!(free.take(2), [3, 4]);
        free.give(&[0, 1, 2]);
        assert_eq!(free.len(), 6);
        assert_eq!(free.take(2), [0, 1]);
        assert_eq!(free.take(4), [2, 5, 6, 7]);
        assert_eq!(free.len(), 0);
    }
}
