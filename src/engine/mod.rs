//! The generation loop over the grid. Owns: the kernel thread team, this rank's KV cache and buffers,
//! the step plans the driver sends, the pipeline hand-off between stages, and the greedy choice
//! of the next token across a stage's vocabulary shards. Knows nothing about SIMD or MPI types.
//!
//! ```text
//! driver (world rank 0)            every rank of stage 0         stage s > 0, rank (s, t)
//!   plan = Step{tokens, pos0} ──►  broadcast in stage ──►        recv plan + hidden from (s-1, t)
//!                                  embed, layers,                layers, then either send to
//!                                  send plan + hidden ──────►    (s+1, t), or (last stage) logits,
//!   token ◄───────────────────────────────────────────────────── argmax, allgather, token to rank 0
//! ```

use crate::comm::{Comm, Link, Tag};
use crate::error::{Error, Result};
use crate::grid::{vocab_range, Grid};
use crate::kernels::{self, Team};
use crate::model::{KvCache, Scratch, Shard, Span};
use crate::weights::DType;
use serde::{Deserialize, Serialize};
use std::time::Instant;

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Finish {
    /// An end-of-sequence token was produced.
    Eos,
    /// `max_tokens` were produced.
    Length,
    /// The model's context is full.
    Context,
}

/// What every rank does next; made by the driver, encoded with bincode, passed down the grid.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum Plan {
    /// New sequences: `seqs` KV caches of `capacity` positions each, replacing any before.
    Begin { capacity: usize, seqs: usize },
    /// Run `tokens`, which are the `spans` one after another; the last stage returns the greedy
    /// next token of each span (and the full logits of the first span's last token when
    /// `want_logits`).
    Step { spans: Vec<Span>, tokens: Vec<u32>, want_logits: bool },
    /// The job is over.
    End,
}

/// What the last stage sends back to the driver after a step.
#[derive(Debug, Serialize, Deserialize)]
struct StepResult {
    /// The greedy next token of each span.
    tokens: Vec<u32>,
    logits: Option<Vec<f32>>,
}

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
        let n = self.token_ids.len().saturating_sub(1);
        if n == 0 || self.decode_ms <= 0.0 {
            0.0
        } else {
            n as f64 / (self.decode_ms / 1000.0)
        }
    }
}

/// Checks that a prompt leaves room to generate in the model's context.
pub fn check_prompt(n_tokens: usize, max_context: usize) -> Result<()> {
    if n_tokens == 0 {
        return Err(Error::Input("the prompt is empty (it encodes to no tokens)".into()));
    }
    if n_tokens >= max_context {
        return Err(Error::Input(format!(
            "the prompt has {n_tokens} tokens but the model's context holds {max_context} (max_position_embeddings in config.json), leaving no room to generate"
        )));
    }
    Ok(())
}

/// One rank's engine: its shard, place in the grid, buffers and kernel thread team.
pub struct Engine {
    pub shard: Shard,
    pub grid: Grid,
    team: Team,
    kv_dtype: DType,
    scratch: Scratch,
    caches: Vec<KvCache>,
    hidden: Vec<f32>,
    /// Hidden states of each span's last token, for the output head.
    last: Vec<f32>,
    logits: Vec<f32>,
    candidates: Vec<f32>,
    /// Test hook: `GRIDLM_TEST_EXIT_AT=RANK:STEP` ends this process abruptly at that step.
    exit_at: Option<(usize, usize)>,
    steps: usize,
}

impl Engine {
    /// `threads`: size of the kernel team; the calling (main) thread is its worker 0, so
    /// kernels start without crossing threads and every MPI call stays on the main thread.
    /// `kv_dtype`: element type of the KV cache.
    pub fn new(shard: Shard, grid: Grid, threads: usize, kv_dtype: DType) -> Result<Self> {
        let team = Team::new(threads)
            .map_err(|e| Error::Input(format!("cannot start {threads} kernel threads: {e}")))?;
        let exit_at = std::env::var("GRIDLM_TEST_EXIT_AT").ok().and_then(|v| {
            let (r, s) = v.split_once(':')?;
            Some((r.parse().ok()?, s.parse().ok()?))
        });
        Ok(Engine {
            shard,
            grid,
            team,
            kv_dtype,
            scratch: Scratch::default(),
            caches: Vec::new(),
            hidden: Vec::new(),
            last: Vec::new(),
            logits: Vec::new(),
            candidates: Vec::new(),
            exit_at,
            steps: 0,
        })
    }

    pub fn kv_dtype(&self) -> DType {
        self.kv_dtype
    }

    pub fn threads(&self) -> usize {
        self.team.threads()
    }

    /// The kernel threads (for measurements that should use the same threads).
    pub fn team(&self) -> &Team {
        &self.team
    }

    /// Largest number of positions a sequence may have.
    pub fn max_context(&self) -> usize {
        self.shard.cfg.max_position_embeddings
    }

    /// Every rank: obtains the next plan (the driver passes its own) and forwards it down the
    /// pipeline to the same tp rank of the next stage.
    fn next_plan(&self, own: Option<&Plan>, comm: &dyn Comm, link: &dyn Link) -> Result<Plan> {
        let g = self.grid;
        let mut bytes = match own {
            Some(p) => {
                bincode::serialize(p).map_err(|e| Error::Comm(format!("cannot encode a plan: {e}")))?
            }
            None => Vec::new(),
        };
        if g.is_first_stage() {
            comm.broadcast_bytes(&mut bytes);
        } else {
            bytes = link.recv_bytes(g.rank_of(g.stage() - 1, g.tp_rank()), Tag::Plan);
        }
        if !g.is_last_stage() {
            link.send_bytes(g.rank_of(g.stage() + 1, g.tp_rank()), Tag::Plan, &bytes);
        }
        bincode::deserialize(&bytes).map_err(|e| Error::Comm(format!("cannot decode a plan: {e}")))
    }

    /// Every rank: carries out its part of `plan`. The driver gets the step's result.
    fn execute(&mut self, plan: &Plan, comm: &dyn Comm, link: &dyn Link) -> Result<Option<StepResult>> {
        let (spans, tokens, want_logits) = match plan {
            Plan::Begin { capacity, seqs } => {
                self.caches.clear();
                let (shard, dtype) = (&self.shard, self.kv_dtype);
                self.caches.extend((0..*seqs).map(|_| shard.new_cache(*capacity, dtype)));
                return Ok(None);
            }
            Plan::End => return Ok(None),
            Plan::Step { spans, tokens, want_logits } => (spans, tokens, *want_logits),
        };
        self.steps += 1;
        if let Some((rank, step)) = self.exit_at {
            if rank == self.grid.rank && step == self.steps {
                let line = format!("error: rank {rank}: exiting at step {step} (GRIDLM_TEST_EXIT_AT)\n");
                let _ = std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes());
                std::process::exit(3);
            }
        }
        let g = self.grid;
        let h = self.shard.cfg.hidden_size;
        let n = tokens.len();
        if spans.iter().map(|s| s.len).sum::<usize>() != n || spans.iter().any(|s| s.seq >= self.caches.len())
        {
            return Err(Error::Comm("a step's spans do not match its tokens or sequences".into()));
        }
        if self.hidden.len() < n * h {
            self.hidden.resize(n * h, 0.0);
        }
        let Engine { shard, scratch, hidden, last, logits, candidates, team, caches, .. } = self;
        let x = &mut hidden[..n * h];
        if g.is_first_stage() {
            shard.embed(tokens, x, comm);
        } else {
            link.recv_f32(g.rank_of(g.stage() - 1, g.tp_rank()), Tag::Hidden, x);
        }
        shard.forward(x, spans, caches, scratch, comm, team);
        let last_stage_rank0 = g.rank_of(g.pp - 1, 0);
        if !g.is_last_stage() {
            link.send_f32(g.rank_of(g.stage() + 1, g.tp_rank()), Tag::Hidden, x);
        } else {
            let m = spans.len();
            let vl = shard.vocab_range().len();
            last.resize(m * h, 0.0);
            logits.resize(m * vl, 0.0);
            let mut end = 0;
            for (i, sp) in spans.iter().enumerate() {
                end += sp.len;
                last[i * h..(i + 1) * h].copy_from_slice(&x[(end - 1) * h..end * h]);
            }
            shard.logits(last, m, scratch, logits, team);
            let picked = greedy_pick(logits, m, shard.vocab_range().start, candidates, comm);
            let full = want_logits.then(|| {
                let vocab = shard.cfg.vocab_size;
                let counts: Vec<usize> = (0..g.tp).map(|t| vocab_range(vocab, g.tp, t).len()).collect();
                let mut full = vec![0.0; vocab];
                comm.allgatherv(&logits[..vl], &counts, &mut full);
                full
            });
            let result = StepResult { tokens: picked, logits: full };
            if g.rank == 0 {
                return Ok(Some(result));
            }
            if g.rank == last_stage_rank0 {
                let bytes = bincode::serialize(&result)
                    .map_err(|e| Error::Comm(format!("cannot encode a result: {e}")))?;
                link.send_bytes(0, Tag::Result, &bytes);
            }
        }
        if g.rank == 0 {
            let bytes = link.recv_bytes(last_stage_rank0, Tag::Result);
            let r = bincode::deserialize(&bytes)
                .map_err(|e| Error::Comm(format!("cannot decode a result: {e}")))?;
            return Ok(Some(r));
        }
        Ok(None)
    }

    /// Driver: runs a plan on the whole grid.
    fn drive(&mut self, plan: Plan, comm: &dyn Comm, link: &dyn Link) -> Result<Option<StepResult>> {
        let plan = self.next_plan(Some(&plan), comm, link)?;
        self.execute(&plan, comm, link)
    }

    /// Ranks other than the driver: follow plans until `End`.
    pub fn follow(&mut self, comm: &dyn Comm, link: &dyn Link) -> Result<()> {
        loop {
            let plan = self.next_plan(None, comm, link)?;
            self.execute(&plan, comm, link)?;
            if matches!(plan, Plan::End) {
                return Ok(());
            }
        }
    }

    /// Driver: tells every rank the job is over.
    pub fn finish(&mut self, comm: &dyn Comm, link: &dyn Link) -> Result<()> {
        self.drive(Plan::End, comm, link).map(|_| ())
    }

    /// Driver: starts `seqs` sequences whose prompts are at most `prompt_len` tokens and may
    /// grow by `new_tokens`; every rank sizes its KV caches. Returns the capacity (positions),
    /// capped at the context.
    fn begin(
        &mut self,
        prompt_len: usize,
        new_tokens: usize,
        seqs: usize,
        comm: &dyn Comm,
        link: &dyn Link,
    ) -> Result<usize> {
        let max_ctx = self.max_context();
        check_prompt(prompt_len, max_ctx)?;
        let capacity = (prompt_len + new_tokens).min(max_ctx);
        self.drive(Plan::Begin { capacity, seqs }, comm, link)?;
        Ok(capacity)
    }

    /// Driver: runs `spans` (their tokens one after another in `tokens`) over the whole grid;
    /// returns the greedy next token of each span.
    fn step(
        &mut self,
        spans: Vec<Span>,
        tokens: Vec<u32>,
        want_logits: bool,
        comm: &dyn Comm,
        link: &dyn Link,
    ) -> Result<StepResult> {
        let m = spans.len();
        let r = self
            .drive(Plan::Step { spans, tokens, want_logits }, comm, link)?
            .ok_or_else(|| Error::Comm("the last stage returned no result for a step".into()))?;
        if r.tokens.len() != m {
            return Err(Error::Comm(format!("a step of {m} spans returned {} tokens", r.tokens.len())));
        }
        Ok(r)
    }

    /// Driver: `tokens` of sequence 0 at positions `pos0..`; its greedy next token.
    fn step1(
        &mut self,
        tokens: Vec<u32>,
        pos0: usize,
        want_logits: bool,
        comm: &dyn Comm,
        link: &dyn Link,
    ) -> Result<StepResult> {
        let span = Span { seq: 0, pos0, len: tokens.len() };
        self.step(vec![span], tokens, want_logits, comm, link)
    }

    /// Driver: a timed batch for benchmarks — every prompt prefilled in one step (one span
    /// each), then `new_tokens - 1` decode steps of one token per sequence, regardless of EOS.
    /// Returns the prefill's latency and each decode step's, in ms.
    pub fn timed_batch(
        &mut self,
        prompts: &[Vec<u32>],
        new_tokens: usize,
        comm: &dyn Comm,
        link: &dyn Link,
    ) -> Result<(f64, Vec<f64>)> {
        let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
        let capacity = self.begin(longest, new_tokens, prompts.len(), comm, link)?;
        let (spans, tokens) = prompt_spans(prompts);
        let t0 = Instant::now();
        let mut next = self.step(spans, tokens, false, comm, link)?.tokens;
        let first_ms = t0.elapsed().as_secs_f64() * 1e3;
        let mut steps = Vec::with_capacity(new_tokens);
        for i in 0..new_tokens.saturating_sub(1) {
            if prompts.iter().any(|p| p.len() + i >= capacity) {
                break;
            }
            let spans =
                prompts.iter().enumerate().map(|(b, p)| Span { seq: b, pos0: p.len() + i, len: 1 }).collect();
            let t = Instant::now();
            next = self.step(spans, next, false, comm, link)?.tokens;
            steps.push(t.elapsed().as_secs_f64() * 1e3);
        }
        Ok((first_ms, steps))
    }

    /// Driver: greedy generation for several prompts at once (of any lengths): one prefill
    /// step with a span per prompt, then decode steps with a token per unfinished sequence, so
    /// the weights are read once per step for all of them. Each sequence finishes on its own.
    pub fn generate_batch(
        &mut self,
        prompts: &[Vec<u32>],
        opts: &GenerateOptions,
        comm: &dyn Comm,
        link: &dyn Link,
    ) -> Result<Vec<(Vec<u32>, Finish)>> {
        let max_ctx = self.max_context();
        for p in prompts {
            check_prompt(p.len(), max_ctx)?;
        }
        let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
        let capacity = self.begin(longest, opts.max_tokens, prompts.len(), comm, link)?;
        let mut out: Vec<(Vec<u32>, Option<Finish>)> = prompts.iter().map(|_| (Vec::new(), None)).collect();
        if opts.max_tokens == 0 {
            return Ok(out.into_iter().map(|(t, _)| (t, Finish::Length)).collect());
        }
        let (spans, tokens) = prompt_spans(prompts);
        let mut next = self.step(spans, tokens, false, comm, link)?.tokens;
        let mut active: Vec<usize> = (0..prompts.len()).collect();
        loop {
            let mut spans = Vec::with_capacity(active.len());
            let mut tokens = Vec::with_capacity(active.len());
            for (&b, &tok) in active.iter().zip(&next) {
                let (seq, fin) = &mut out[b];
                seq.push(tok);
                let pos = prompts[b].len() + seq.len() - 1;
                *fin = if !opts.ignore_eos && opts.eos_ids.contains(&tok) {
                    Some(Finish::Eos)
                } else if seq.len() >= opts.max_tokens {
                    Some(Finish::Length)
                } else if pos >= capacity {
                    Some(Finish::Context)
                } else {
                    spans.push(Span { seq: b, pos0: pos, len: 1 });
                    tokens.push(tok);
                    None
                };
            }
            active.retain(|&b| out[b].1.is_none());
            if active.is_empty() {
                break;
            }
            next = self.step(spans, tokens, false, comm, link)?.tokens;
        }
        Ok(out.into_iter().map(|(t, f)| (t, f.unwrap_or(Finish::Length))).collect())
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
        let capacity = self.begin(prompt.len(), forced.len(), 1, comm, link)?;
        let mut out = vec![self.step1(prompt.to_vec(), 0, false, comm, link)?.tokens[0]];
        for (i, &t) in forced.iter().enumerate().take(forced.len().saturating_sub(1)) {
            let pos = prompt.len() + i;
            if pos >= capacity {
                break;
            }
            out.push(self.step1(vec![t], pos, false, comm, link)?.tokens[0]);
        }
        Ok(out)
    }

    /// Driver: greedy generation for one prompt over the whole grid. Call [`Engine::finish`]
    /// afterwards (also after an error) so the other ranks stop.
    pub fn generate(
        &mut self,
        prompt: &[u32],
        opts: &GenerateOptions,
        comm: &dyn Comm,
        link: &dyn Link,
        mut on_token: impl FnMut(u32) -> Result<()>,
    ) -> Result<Generation> {
        let capacity = self.begin(prompt.len(), opts.max_tokens, 1, comm, link)?;
        let mut out = Vec::with_capacity(opts.max_tokens);
        let t0 = Instant::now();
        let first = self.step1(prompt.to_vec(), 0, opts.keep_prompt_logits, comm, link)?;
        let prefill_ms = t0.elapsed().as_secs_f64() * 1e3;
        let prompt_logits = first.logits;
        let mut next = first.tokens[0];
        let t1 = Instant::now();
        let finish = loop {
            if opts.max_tokens == 0 {
                break Finish::Length;
            }
            out.push(next);
            on_token(next)?;
            if !opts.ignore_eos && opts.eos_ids.contains(&next) {
                break Finish::Eos;
            }
            if out.len() >= opts.max_tokens {
                break Finish::Length;
            }
            let pos = prompt.len() + out.len() - 1;
            if pos >= capacity {
                break Finish::Context;
            }
            next = self.step1(vec![next], pos, false, comm, link)?.tokens[0];
        };
        Ok(Generation {
            token_ids: out,
            finish,
            prefill_ms,
            decode_ms: t1.elapsed().as_secs_f64() * 1e3,
            prompt_logits,
        })
    }
}

/// Prompts as spans (sequence `b` at positions `0..len`) and their tokens one after another.
fn prompt_spans(prompts: &[Vec<u32>]) -> (Vec<Span>, Vec<u32>) {
    let spans = prompts.iter().enumerate().map(|(b, p)| Span { seq: b, pos0: 0, len: p.len() }).collect();
    (spans, prompts.concat())
}

/// The stage agrees on the greedy token of each of the `m` rows of `logits` (`[m, shard]`):
/// each rank takes the argmax of its vocabulary shard per row, the (value, index) pairs are
/// allgathered, and the largest value wins (lowest index on ties).
pub fn greedy_pick(
    logits: &[f32],
    m: usize,
    vocab_start: usize,
    buf: &mut Vec<f32>,
    comm: &dyn Comm,
) -> Vec<u32> {
    let vl = logits.len() / m.max(1);
    let mut mine = Vec::with_capacity(2 * m);
    for row in logits.chunks_exact(vl).take(m) {
        let (i, v) = kernels::argmax(row);
        mine.extend([v, f32::from_bits((vocab_start + i) as u32)]);
    }
    buf.resize(2 * m * comm.size(), 0.0);
    comm.allgather(&mine, buf);
    (0..m)
        .map(|row| {
            let mut best = (f32::NEG_INFINITY, u32::MAX);
            for rank in buf.chunks_exact(2 * m) {
                let (v, id) = (rank[2 * row], rank[2 * row + 1].to_bits());
                if v > best.0 || (v == best.0 && id < best.1) {
                    best = (v, id);
                }
            }
            best.1
        })
        .collect()
}
