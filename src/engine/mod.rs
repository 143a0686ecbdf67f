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
use crate::model::{KvCache, Scratch, Shard};
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
    /// A new sequence: reset the KV cache to this many positions.
    Begin { capacity: usize },
    /// Run `tokens` at positions `pos0..`; the last stage returns the greedy next token (and the
    /// full logits when `want_logits`).
    Step { tokens: Vec<u32>, pos0: usize, want_logits: bool },
    /// The job is over.
    End,
}

/// What the last stage sends back to the driver after a step.
#[derive(Debug, Serialize, Deserialize)]
struct StepResult {
    token: u32,
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
    cache: Option<KvCache>,
    hidden: Vec<f32>,
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
        let vocab_local = shard.vocab_range().len();
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
            cache: None,
            hidden: Vec::new(),
            logits: vec![0.0; vocab_local],
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
        let (tokens, pos0, want_logits) = match plan {
            Plan::Begin { capacity } => {
                self.cache = Some(self.shard.new_cache(*capacity, self.kv_dtype));
                return Ok(None);
            }
            Plan::End => return Ok(None),
            Plan::Step { tokens, pos0, want_logits } => (tokens, *pos0, *want_logits),
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
        if self.hidden.len() < n * h {
            self.hidden.resize(n * h, 0.0);
        }
        let cache = self.cache.as_mut().ok_or_else(|| Error::Comm("a step arrived before Begin".into()))?;
        let Engine { shard, scratch, hidden, logits, candidates, team, .. } = self;
        let x = &mut hidden[..n * h];
        if g.is_first_stage() {
            shard.embed(tokens, x, comm);
        } else {
            link.recv_f32(g.rank_of(g.stage() - 1, g.tp_rank()), Tag::Hidden, x);
        }
        shard.forward(x, n, pos0, cache, scratch, comm, team);
        let last_stage_rank0 = g.rank_of(g.pp - 1, 0);
        if !g.is_last_stage() {
            link.send_f32(g.rank_of(g.stage() + 1, g.tp_rank()), Tag::Hidden, x);
        } else {
            shard.logits(&x[(n - 1) * h..], scratch, logits, team);
            let token = greedy_pick(logits, shard.vocab_range().start, candidates, comm);
            let full = want_logits.then(|| {
                let vocab = shard.cfg.vocab_size;
                let counts: Vec<usize> = (0..g.tp).map(|t| vocab_range(vocab, g.tp, t).len()).collect();
                let mut full = vec![0.0; vocab];
                comm.allgatherv(logits, &counts, &mut full);
                full
            });
            let result = StepResult { token, logits: full };
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

    /// Driver: starts a sequence of `prompt_len` tokens that may grow by `new_tokens`; every
    /// rank sizes its KV cache. Returns the capacity (positions), capped at the context.
    fn begin(
        &mut self,
        prompt_len: usize,
        new_tokens: usize,
        comm: &dyn Comm,
        link: &dyn Link,
    ) -> Result<usize> {
        let max_ctx = self.max_context();
        check_prompt(prompt_len, max_ctx)?;
        let capacity = (prompt_len + new_tokens).min(max_ctx);
        self.drive(Plan::Begin { capacity }, comm, link)?;
        Ok(capacity)
    }

    /// Driver: runs `tokens` at positions `pos0..` over the whole grid; returns its result.
    fn step(
        &mut self,
        tokens: Vec<u32>,
        pos0: usize,
        want_logits: bool,
        comm: &dyn Comm,
        link: &dyn Link,
    ) -> Result<StepResult> {
        self.drive(Plan::Step { tokens, pos0, want_logits }, comm, link)?
            .ok_or_else(|| Error::Comm("the last stage returned no result for a step".into()))
    }

    /// Driver: one timed sequence for benchmarks — the prompt, then `new_tokens - 1` decode
    /// steps regardless of EOS. Returns the prompt's latency and each decode step's, in ms.
    pub fn timed_sequence(
        &mut self,
        prompt: &[u32],
        new_tokens: usize,
        comm: &dyn Comm,
        link: &dyn Link,
    ) -> Result<(f64, Vec<f64>)> {
        let capacity = self.begin(prompt.len(), new_tokens, comm, link)?;
        let t0 = Instant::now();
        let mut next = self.step(prompt.to_vec(), 0, false, comm, link)?.token;
        let first_ms = t0.elapsed().as_secs_f64() * 1e3;
        let mut steps = Vec::with_capacity(new_tokens);
        for pos in prompt.len()..capacity.min(prompt.len() + new_tokens.saturating_sub(1)) {
            let t = Instant::now();
            next = self.step(vec![next], pos, false, comm, link)?.token;
            steps.push(t.elapsed().as_secs_f64() * 1e3);
        }
        Ok((first_ms, steps))
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
        let capacity = self.begin(prompt.len(), forced.len(), comm, link)?;
        let mut out = vec![self.step(prompt.to_vec(), 0, false, comm, link)?.token];
        for (i, &t) in forced.iter().enumerate().take(forced.len().saturating_sub(1)) {
            let pos = prompt.len() + i;
            if pos >= capacity {
                break;
            }
            out.push(self.step(vec![t], pos, false, comm, link)?.token);
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
        let capacity = self.begin(prompt.len(), opts.max_tokens, comm, link)?;
        let mut out = Vec::with_capacity(opts.max_tokens);
        let t0 = Instant::now();
        let first = self.step(prompt.to_vec(), 0, opts.keep_prompt_logits, comm, link)?;
        let prefill_ms = t0.elapsed().as_secs_f64() * 1e3;
        let prompt_logits = first.logits;
        let mut next = first.token;
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
            next = self.step(vec![next], pos, false, comm, link)?.token;
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

/// The stage agrees on the greedy token: each rank takes the argmax of its vocabulary shard,
/// the (value, index) pairs are allgathered, and the largest value wins (lowest index on ties).
pub fn greedy_pick(logits: &[f32], vocab_start: usize, buf: &mut Vec<f32>, comm: &dyn Comm) -> u32 {
    let (i, v) = kernels::argmax(logits);
    let mine = [v, f32::from_bits((vocab_start + i) as u32)];
    buf.resize(2 * comm.size(), 0.0);
    comm.allgather(&mine, buf);
    let mut best = (f32::NEG_INFINITY, u32::MAX);
    for pair in buf.chunks_exact(2) {
        let (v, id) = (pair[0], pair[1].to_bits());
        if v > best.0 || (v == best.0 && id < best.1) {
            best = (v, id);
        }
    }
    best.1
}
