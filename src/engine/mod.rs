//! The generation loop. Owns: the thread pool, the KV cache and scratch of this rank, and the
//! greedy choice of the next token across a stage's vocabulary shards. Knows nothing about SIMD.

use crate::comm::Comm;
use crate::error::{Error, Result};
use crate::kernels;
use crate::model::{KvCache, Scratch, Shard};
use std::time::Instant;

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Finish {
    /// An end-of-sequence token was produced.
    Eos,
    /// `max_tokens` were produced.
    Length,
    /// The model's context is full.
    Context,
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

/// One rank's engine: its shard, buffers and thread pool.
pub struct Engine {
    pub shard: Shard,
    pool: rayon::ThreadPool,
    scratch: Scratch,
    hidden: Vec<f32>,
    logits: Vec<f32>,
    candidates: Vec<f32>,
}

impl Engine {
    /// `threads`: size of the kernel pool; the calling (main) thread is one of its workers, so
    /// communication inside a step stays on the main thread.
    pub fn new(shard: Shard, threads: usize) -> Result<Self> {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads.max(1))
            .use_current_thread()
            .thread_name(|i| format!("gridlm-kernel-{i}"))
            .build()
            .map_err(|e| Error::Input(format!("cannot start {threads} kernel threads: {e}")))?;
        let vocab_local = shard.vocab_range().len();
        Ok(Engine {
            shard,
            pool,
            scratch: Scratch::default(),
            hidden: Vec::new(),
            logits: vec![0.0; vocab_local],
            candidates: Vec::new(),
        })
    }

    pub fn threads(&self) -> usize {
        self.pool.current_num_threads()
    }

    /// Largest number of positions a sequence may have.
    pub fn max_context(&self) -> usize {
        self.shard.cfg.max_position_embeddings
    }

    /// Runs `tokens` at positions `pos0..` through the whole (single-stage) model and returns
    /// the greedy next token, agreed by every rank of the stage.
    fn step(&mut self, tokens: &[u32], pos0: usize, cache: &mut KvCache, comm: &dyn Comm) -> u32 {
        let h = self.shard.cfg.hidden_size;
        let n = tokens.len();
        if self.hidden.len() < n * h {
            self.hidden.resize(n * h, 0.0);
        }
        // The pool was built with this thread as worker 0, so the kernels' parallel loops below
        // run on it without entering from outside, and every MPI call stays on this thread.
        debug_assert_eq!(
            rayon::current_thread_index(),
            Some(0),
            "step called off the engine's thread"
        );
        let Engine {
            shard,
            scratch,
            hidden,
            logits,
            candidates,
            ..
        } = self;
        shard.embed(tokens, hidden, comm);
        shard.forward(hidden, n, pos0, cache, scratch, comm);
        shard.logits(&hidden[(n - 1) * h..n * h], scratch, logits);
        greedy_pick(logits, shard.vocab_range().start, candidates, comm)
    }

    /// Greedy generation for one prompt on a single stage.
    pub fn generate(
        &mut self,
        prompt: &[u32],
        opts: &GenerateOptions,
        comm: &dyn Comm,
        mut on_token: impl FnMut(u32) -> Result<()>,
    ) -> Result<Generation> {
        let max_ctx = self.max_context();
        if prompt.is_empty() {
            return Err(Error::Input(
                "the prompt is empty (it encodes to no tokens)".into(),
            ));
        }
        if prompt.len() >= max_ctx {
            return Err(Error::Input(format!(
                "the prompt has {} tokens but the model's context holds {max_ctx} (max_position_embeddings in config.json), leaving no room to generate",
                prompt.len()
            )));
        }
        let capacity = (prompt.len() + opts.max_tokens).min(max_ctx);
        let mut cache = self.shard.new_cache(capacity);
        let mut out = Vec::with_capacity(opts.max_tokens);
        let t0 = Instant::now();
        let mut next = self.step(prompt, 0, &mut cache, comm);
        let prompt_logits = opts.keep_prompt_logits.then(|| self.logits.clone());
        let prefill_ms = t0.elapsed().as_secs_f64() * 1e3;
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
            next = self.step(&[next], pos, &mut cache, comm);
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
