//! Choosing the next token when the logits are split by vocabulary over a stage's ranks.
//!
//! Greedy is one allgather of (value, index) per row. Sampling is exact over the full
//! vocabulary without gathering it: each rank sends, per row, its local maximum and sum of
//! exponentials (so every rank knows the softmax normaliser) and its top candidates in order.
//! From these every rank reaches the same decision:
//!
//! * the kept set — top-k, then top-p (smallest prefix whose mass reaches p, renormalised over
//!   the top-k set), then min-p (probability at least `min_p` × the largest) — lies inside the
//!   candidates whose order is certain: the token is drawn from them directly;
//! * top-p reaches past the certain candidates: the round is repeated with more candidates;
//! * the kept set is "every token at least θ" with θ known (no truncation, or min-p only):
//!   each rank draws among its own kept tokens and one more allgather finds the winner.
//!
//! Draws use the Gumbel-max rule: the token is the kept one with the largest `l + g`, where
//! `g` is Gumbel noise fixed by the sequence's seed, the token's number in the sequence and
//! the token id. That is an exact sample of the kept tokens' softmax; it splits over shards
//! (a max of local maxima); it is the same on every path; and a tiny difference in the logits
//! (tensor parallelism sums in another order) changes the token only when the two best `l + g`
//! are that close, or a token is that close to the edge of the kept set. So the same seed gives
//! the same tokens on any number of stages and threads (the same logits), and on another
//! tensor-parallel split until such a near-tie. Order of processing (as in HF transformers):
//! repetition penalty, temperature, top-k, top-p, min-p.

use crate::comm::Comm;
use crate::room;
use serde::{Deserialize, Serialize};

/// The sampling settings of a model folder's `generation_config.json` (at `path`), as HF's
/// `generate` reads them: greedy unless `do_sample` is true; then `temperature` (1 where absent
/// or null), `top_p` (1), `top_k` (50, HF's default), `min_p` (none) and `repetition_penalty`
/// (1). The seed is left 0.
pub fn from_generation_config(path: &std::path::Path) -> crate::Result<SamplingParams> {
    use crate::Error;
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| Error::file(path, format!("invalid JSON: {e}")))?;
    let field = |key: &str| v.get(key).filter(|x| !x.is_null());
    let number = |key: &str, default: f64| match field(key) {
        None => Ok(default),
        Some(x) => x.as_f64().ok_or_else(|| Error::file(path, format!("`{key}` is {x}, not a number"))),
    };
    let sample = match field("do_sample") {
        None => false,
        Some(x) => {
            x.as_bool().ok_or_else(|| Error::file(path, format!("`do_sample` is {x}, not true or false")))?
        }
    };
    let mut p = SamplingParams {
        repetition_penalty: number("repetition_penalty", 1.0)? as f32,
        ..SamplingParams::default()
    };
    if sample {
        p.temperature = number("temperature", 1.0)? as f32;
        p.top_p = number("top_p", 1.0)? as f32;
        p.top_k = match field("top_k") {
            None => 50,
            Some(x) => {
                x.as_u64().ok_or_else(|| Error::file(path, format!("`top_k` is {x}, not a count")))? as usize
            }
        };
        p.min_p = number("min_p", 0.0)? as f32;
    }
    p.check().map_err(|e| Error::file(path, e))?;
    Ok(p)
}

/// How one sequence picks its tokens.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// 0 picks the most likely token (greedy); otherwise logits are divided by it.
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens (0: all).
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability reaches `top_p` (1: all).
    pub top_p: f32,
    /// Keep tokens whose probability is at least `min_p` × the largest (0: all).
    pub min_p: f32,
    /// Logits of tokens already in the sequence are divided by it when positive, multiplied
    /// when negative (1: off).
    pub repetition_penalty: f32,
    /// Subtracted from the logit of every token the sequence has generated (OpenAI's; 0: off).
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once for each time the sequence generated it (0: off).
    pub frequency_penalty: f32,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: 0,
        }
    }
}

impl SamplingParams {
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// The first setting out of range, as a message naming it.
    pub fn check(&self) -> Result<(), String> {
        let t = self.temperature;
        if !(t.is_finite() && t >= 0.0) {
            return Err(format!("temperature must be a number >= 0 (0 is greedy), got {t}"));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        if !(self.min_p >= 0.0 && self.min_p <= 1.0) {
            return Err(format!("min_p must be in [0, 1], got {}", self.min_p));
        }
        let r = self.repetition_penalty;
        if !(r.is_finite() && r > 0.0) {
            return Err(format!("repetition_penalty must be a number > 0, got {r}"));
        }
        for (name, v) in
            [("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty)]
        {
            if !(-2.0..=2.0).contains(&v) {
                return Err(format!("{name} must be in [-2, 2], got {v}"));
            }
        }
        Ok(())
    }

    /// Whether the presence or frequency penalty is on (the sequence's generated tokens are
    /// counted).
    pub fn counts_tokens(&self) -> bool {
        self.presence_penalty != 0.0 || self.frequency_penalty != 0.0
    }

    /// Gumbel noise for `token` as the sequence's token number `index`.
    pub fn gumbel(&self, index: u64, token: u32) -> f64 {
        let bits = splitmix64(splitmix64(self.seed ^ splitmix64(index)) ^ token as u64);
        let u = ((bits >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
        -(-u.ln()).ln()
    }
}

/// What a sequence's tokens may be, beside how they are drawn: a bias added to some tokens'
/// logits (OpenAI's `logit_bias`), tokens that end it as its end-of-sequence token does (vLLM's
/// `stop_token_ids`; finished as stopped), and how many tokens it brings before anything may end
/// it (vLLM's `min_tokens`: until then neither its end-of-sequence nor its stop tokens are ever
/// picked, and no stop string ends it).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct TokenRules {
    pub min_tokens: usize,
    pub stop_token_ids: Vec<u32>,
    /// (token, bias) pairs, each token once.
    pub logit_bias: Vec<(u32, f32)>,
}

/// The largest bias `logit_bias` may add or take away (OpenAI's limit).
pub const MAX_LOGIT_BIAS: f32 = 100.0;

impl TokenRules {
    /// The first rule that does not fit a vocabulary of `vocab` tokens or `max_tokens`, as a
    /// message beginning with its name.
    pub fn check(&self, vocab: usize, max_tokens: usize) -> Result<(), String> {
        if self.min_tokens > max_tokens {
            return Err(format!(
                "min_tokens ({}) must be at most max_tokens ({max_tokens})",
                self.min_tokens
            ));
        }
        let outside = |t: &u32| *t as usize >= vocab;
        if let Some(t) = self.stop_token_ids.iter().find(|t| outside(t)) {
            return Err(format!("stop_token_ids holds token {t}, outside the vocabulary of {vocab} tokens"));
        }
        for (i, &(t, b)) in self.logit_bias.iter().enumerate() {
            if outside(&t) {
                return Err(format!("logit_bias holds token {t}, outside the vocabulary of {vocab} tokens"));
            }
            if !(-MAX_LOGIT_BIAS..=MAX_LOGIT_BIAS).contains(&b) {
                return Err(format!("logit_bias gives token {t} a bias of {b}, outside [-100, 100]"));
            }
            if self.logit_bias[..i].iter().any(|p| p.0 == t) {
                return Err(format!("logit_bias gives token {t} twice"));
            }
        }
        Ok(())
    }
}

/// Adds a sequence's logit biases (`bias`: index in the shard, bias) to one row of shard logits
/// and takes the tokens `banned` (indices in the shard) out of it: their logits become −∞.
/// Indices past the row are left alone.
pub fn steer(row: &mut [f32], bias: &[(u32, f32)], banned: &[u32]) {
    for &(i, b) in bias {
        if let Some(l) = row.get_mut(i as usize) {
            *l += b;
        }
    }
    for &i in banned {
        if let Some(l) = row.get_mut(i as usize) {
            *l = f32::NEG_INFINITY;
        }
    }
}

fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Applies the repetition penalty (to tokens of this shard marked in `seen`, a bit per shard
/// token), the presence and frequency penalties (to tokens of this shard the sequence generated,
/// `counts` times each, a count per shard token where they are on) and, when sampling, the
/// temperature, to one row of shard logits.
pub fn adjust(row: &mut [f32], p: &SamplingParams, seen: &[u64], counts: &[u16]) {
    if p.repetition_penalty != 1.0 {
        for (w, &bits) in seen.iter().enumerate() {
            let mut b = bits;
            while b != 0 {
                let i = w * 64 + b.trailing_zeros() as usize;
                b &= b - 1;
                if let Some(l) = row.get_mut(i) {
                    *l = if *l > 0.0 { *l / p.repetition_penalty } else { *l * p.repetition_penalty };
                }
            }
        }
    }
    if p.counts_tokens() {
        for (l, &c) in row.iter_mut().zip(counts).filter(|(_, &c)| c > 0) {
            *l -= p.presence_penalty + p.frequency_penalty * c as f32;
        }
    }
    if !p.is_greedy() && p.temperature != 1.0 {
        let inv = 1.0 / p.temperature;
        row.iter_mut().for_each(|l| *l *= inv);
    }
}

/// Whether [`adjust`] changes a row's logits under these settings.
pub fn adjusts(p: &SamplingParams) -> bool {
    p.repetition_penalty != 1.0 || p.counts_tokens() || (!p.is_greedy() && p.temperature != 1.0)
}

/// Candidates a rank sends in the first round for a row with these settings.
pub fn first_candidates(p: &SamplingParams) -> usize {
    p.top_k.max(64)
}

/// Length of one row's summary with `c` candidates.
pub fn summary_len(c: usize) -> usize {
    5 + 2 * c
}

fn f64_to_f32s(x: f64) -> [f32; 2] {
    let b = x.to_bits();
    [f32::from_bits(b as u32), f32::from_bits((b >> 32) as u32)]
}

fn f32s_to_f64(a: f32, b: f32) -> f64 {
    f64::from_bits(a.to_bits() as u64 | ((b.to_bits() as u64) << 32))
}

/// Orders candidates: larger value first, lower index on ties.
fn before(a: (f32, u32), b: (f32, u32)) -> std::cmp::Ordering {
    b.0.total_cmp(&a.0).then(a.1.cmp(&b.1))
}

/// One rank's summary of one (adjusted) shard row into `out` (`summary_len(c)` long): local
/// max, local sum of `exp(l - max)` (f64 in two halves), shard length, candidates sent, then
/// the top `c` (value, global index) in order, padded. `idx` is reusable scratch.
pub fn summarize(row: &[f32], vocab_start: usize, c: usize, idx: &mut Vec<u32>, out: &mut [f32]) {
    let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    // A shard whose every token is taken out (−∞) adds nothing (not exp(NaN)).
    let s: f64 = if m == f32::NEG_INFINITY { 0.0 } else { row.iter().map(|&l| ((l - m) as f64).exp()).sum() };
    let sent = c.min(row.len());
    idx.clear();
    idx.extend(0..row.len() as u32);
    let cmp = |a: &u32, b: &u32| before((row[*a as usize], *a), (row[*b as usize], *b));
    if sent < idx.len() && sent > 0 {
        idx.select_nth_unstable_by(sent - 1, cmp);
    }
    idx.truncate(sent);
    idx.sort_unstable_by(cmp);
    out.fill(f32::from_bits(u32::MAX));
    out[0] = m;
    [out[1], out[2]] = f64_to_f32s(s);
    out[3] = f32::from_bits(row.len() as u32);
    out[4] = f32::from_bits(sent as u32);
    for (j, &i) in idx.iter().enumerate() {
        out[5 + 2 * j] = row[i as usize];
        out[6 + 2 * j] = f32::from_bits(vocab_start as u32 + i);
    }
}

/// What the stage does for a row after a round of summaries.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Decision {
    /// The token is known.
    Token(u32),
    /// Send `c` candidates per rank and decide again.
    More(usize),
    /// Draw among every token whose logit is at least `theta`.
    Threshold { theta: f32 },
}

/// The stage's decision for one row from the summaries of its `n` ranks (`summary(r)`, in rank
/// order), the row's settings and the number of the token drawn (`index`); `merged` is
/// reusable scratch. Pure and identical on every rank that holds the same summaries.
pub fn decide<'s>(
    n: usize,
    summary: impl Fn(usize) -> &'s [f32],
    p: &SamplingParams,
    index: u64,
    merged: &mut Vec<(f32, u32)>,
) -> Decision {
    let summaries = || (0..n).map(&summary);
    let max = summaries().fold(f32::NEG_INFINITY, |m, s| m.max(s[0]));
    let z: f64 = summaries().map(|s| f32s_to_f64(s[1], s[2]) * ((s[0] - max) as f64).exp()).sum();
    let vocab: usize = summaries().map(|s| s[3].to_bits() as usize).sum();
    // Every token of a rank that did not send them all is at most its last sent value, so the
    // merged order is certain above the largest such value.
    let mut bound = f32::NEG_INFINITY;
    let mut sent_max = 0usize;
    merged.clear();
    for s in summaries() {
        let (len, sent) = (s[3].to_bits() as usize, s[4].to_bits() as usize);
        sent_max = sent_max.max(sent);
        for j in 0..sent {
            merged.push((s[5 + 2 * j], s[6 + 2 * j].to_bits()));
        }
        if sent < len {
            bound = bound.max(if sent == 0 { f32::INFINITY } else { s[5 + 2 * (sent - 1)] });
        }
    }
    merged.sort_unstable_by(|a, b| before(*a, *b));
    let certain = merged.iter().take_while(|c| c.0 > bound).count();
    let w = |v: f32| ((v - max) as f64).exp();

    // top-k: every rank sent at least its top k, so the first k merged are the global top k.
    let explicit_k = p.top_k > 0;
    let k = if explicit_k { p.top_k.min(vocab) } else { vocab };
    // min-p: the probability ratio to the largest is exp(l - max). Known when no unsent token
    // can reach the threshold.
    let theta = if p.min_p > 0.0 { max + p.min_p.ln() } else { f32::NEG_INFINITY };
    let all_certain = certain == vocab;
    let mut keep = k;
    if theta > bound || all_certain {
        keep = keep.min(merged.iter().take_while(|c| c.0 >= theta).count());
    }
    // Merged candidates are in true order up to here.
    let ordered = if explicit_k || all_certain { merged.len() } else { certain };
    // top-p, renormalised over the top-k set: the smallest prefix reaching the mass.
    if p.top_p < 1.0 {
        let z_k = if explicit_k { merged.iter().take(k).map(|c| w(c.0)).sum() } else { z };
        let target = p.top_p as f64 * z_k;
        let limit = keep.min(ordered);
        let mut acc = 0.0;
        let found = merged.iter().take(limit).position(|c| {
            acc += w(c.0);
            acc >= target
        });
        match found {
            Some(n) => keep = n + 1,
            None if limit < keep => return Decision::More(4 * sent_max.max(16)),
            None => {}
        }
    }
    if keep <= ordered {
        let best = merged[..keep.max(1)]
            .iter()
            .map(|c| (c.0 as f64 + p.gumbel(index, c.1), c.1))
            .fold((f64::NEG_INFINITY, u32::MAX), better);
        return Decision::Token(best.1);
    }
    Decision::Threshold { theta }
}

/// A picked token's log-probabilities and the `k` most likely tokens' from the records of the
/// `n` ranks of the stage (`record(r)`, in rank order): each the token's logit where that rank
/// holds it (−∞ elsewhere), then its [`summarize`] of the row with at least `k` candidates.
/// `merged` is reusable scratch. Pure and identical on every rank holding the same records.
pub fn merge_logprobs<'s>(
    n: usize,
    record: impl Fn(usize) -> &'s [f32],
    k: usize,
    merged: &mut Vec<(f32, u32)>,
) -> super::TokenLogprobs {
    let records = || (0..n).map(&record);
    let max = records().fold(f32::NEG_INFINITY, |m, r| m.max(r[1]));
    let z: f64 = records().map(|r| f32s_to_f64(r[2], r[3]) * ((r[1] - max) as f64).exp()).sum();
    let lse = max as f64 + z.ln();
    let chosen = records().fold(f32::NEG_INFINITY, |m, r| m.max(r[0]));
    merged.clear();
    for r in records() {
        let sent = r[5].to_bits() as usize;
        merged.extend((0..sent).map(|j| (r[6 + 2 * j], r[7 + 2 * j].to_bits())));
    }
    merged.sort_unstable_by(|a, b| before(*a, *b));
    let top = merged.iter().take(k).map(|&(v, t)| (t, (v as f64 - lse) as f32)).collect();
    super::TokenLogprobs { logprob: (chosen as f64 - lse) as f32, top }
}

/// The larger of two (value, token) pairs; the lower token on ties (greedy picks and draws).
pub(crate) fn better(a: (f64, u32), b: (f64, u32)) -> (f64, u32) {
    if b.0 > a.0 || (b.0 == a.0 && b.1 < a.1) {
        b
    } else {
        a
    }
}

/// This rank's best draw among its tokens at least `theta`: (`l + g`, token).
pub fn threshold_pick(
    row: &[f32],
    vocab_start: usize,
    theta: f32,
    p: &SamplingParams,
    index: u64,
) -> (f64, u32) {
    row.iter()
        .enumerate()
        // Never a token taken out (−∞), though θ be −∞ (no truncation).
        .filter(|(_, &l)| l >= theta && l > f32::NEG_INFINITY)
        .map(|(i, &l)| {
            let t = (vocab_start + i) as u32;
            (l as f64 + p.gumbel(index, t), t)
        })
        .fold((f64::NEG_INFINITY, u32::MAX), better)
}

/// A row to sample: its index in the logits, its settings, and the number of the sequence's
/// token it draws.
#[derive(Debug, Clone)]
pub struct Draw {
    pub row: usize,
    pub params: SamplingParams,
    pub index: u64,
}

/// Reusable buffers of [`sample_rows`], so sampling allocates nothing once they have grown.
/// The caller puts the rows to sample in `draws`.
#[derive(Default)]
pub struct Buffers {
    pub draws: Vec<Draw>,
    mine: Vec<f32>,
    all: Vec<f32>,
    idx: Vec<u32>,
    merged: Vec<(f32, u32)>,
    /// Per draw: candidates to send; draws still undecided (this round, next round); draws to
    /// settle by threshold.
    c_of: Vec<usize>,
    pending: Vec<usize>,
    again: Vec<usize>,
    thresholds: Vec<(usize, f32)>,
}

impl Buffers {
    /// Room, before a run's first step, for sampling up to `rows` rows a step on a stage of
    /// `ranks` ranks whose largest vocabulary shard is `max_shard`, with `top_k` up to 64: such
    /// steps then allocate nothing from the first, however many rounds their rows take (a wide
    /// top-p or min-p asks for more candidates, up to the whole shard: see `round_room`). A
    /// larger `top_k` grows them at its sequence's first token, in its prompt's step (not a
    /// decode step).
    pub fn reserve(&mut self, rows: usize, ranks: usize, max_shard: usize) {
        let len = round_room(rows, first_candidates(&SamplingParams::default()), max_shard);
        room(&mut self.draws, rows);
        room(&mut self.mine, len);
        room(&mut self.all, len * ranks);
        room(&mut self.idx, max_shard);
        room(&mut self.merged, ranks * max_shard);
        for v in [&mut self.c_of, &mut self.pending, &mut self.again] {
            room(v, rows);
        }
        room(&mut self.thresholds, rows);
    }
}

/// The most summary values a rank sends in one collective of [`sample_rows`]: its first round
/// (`rows` rows of `first` candidates, sent together, at most the largest shard's) or one row
/// of the whole largest shard, whichever is more. A later round whose rows ask for more candidates
/// than that holds is sent in as many collectives as it takes, so the buffers reserved for it never
/// grow. The same on every rank: it depends only on the draws and the stage's largest shard.
fn round_room(rows: usize, first: usize, max_shard: usize) -> usize {
    (summary_len(first.min(max_shard.max(1))) * rows).max(summary_len(max_shard))
}

/// The stage agrees on a sampled token for each of `b.draws` (rows of `logits`, `[m, shard]`,
/// already adjusted) and writes it to `picked[row]`. `max_shard`: the largest shard of the
/// stage (the same on every rank). Collective over the stage: every rank calls it with the
/// same draws.
pub fn sample_rows(
    logits: &[f32],
    shard: usize,
    max_shard: usize,
    vocab_start: usize,
    b: &mut Buffers,
    comm: &dyn Comm,
    picked: &mut [u32],
) {
    let n = comm.size();
    let Buffers { draws, mine, all, idx, merged, c_of, pending, again, thresholds } = b;
    let row = |i: usize| &logits[draws[i].row * shard..(draws[i].row + 1) * shard];
    c_of.clear();
    c_of.extend(draws.iter().map(|d| first_candidates(&d.params)));
    pending.clear();
    pending.extend(0..draws.len());
    thresholds.clear();
    let room = round_room(draws.len(), c_of.iter().copied().max().unwrap_or(0), max_shard);
    while !pending.is_empty() {
        // One round: a summary per pending row, all rows of the same length, in as few
        // collectives as keep each within `room` (the first round in one).
        let c = pending.iter().map(|&i| c_of[i]).max().unwrap_or(64).min(max_shard.max(1));
        let len = summary_len(c);
        again.clear();
        for part in pending.chunks((room / len).max(1)) {
            mine.resize(len * part.len(), 0.0);
            for (j, &i) in part.iter().enumerate() {
                summarize(row(i), vocab_start, c, idx, &mut mine[j * len..(j + 1) * len]);
            }
            all.resize(mine.len() * n, 0.0);
            comm.allgather(mine, all);
            let per_rank = mine.len();
            for (j, &i) in part.iter().enumerate() {
                let sum = |r: usize| &all[r * per_rank + j * len..r * per_rank + (j + 1) * len];
                match decide(n, sum, &draws[i].params, draws[i].index, merged) {
                    Decision::Token(t) => picked[draws[i].row] = t,
                    // Never once every rank sent its whole shard (then every candidate is
                    // certain).
                    Decision::More(more) => {
                        c_of[i] = more.max(c + 1);
                        again.push(i);
                    }
                    Decision::Threshold { theta } => thresholds.push((i, theta)),
                }
            }
        }
        std::mem::swap(pending, again);
    }
    if !thresholds.is_empty() {
        // Each rank's best draw per row: (value as f64 in two halves, token).
        let k = thresholds.len();
        mine.clear();
        for &(i, theta) in thresholds.iter() {
            let (v, t) = threshold_pick(row(i), vocab_start, theta, &draws[i].params, draws[i].index);
            mine.extend(f64_to_f32s(v));
            mine.push(f32::from_bits(t));
        }
        all.resize(3 * k * n, 0.0);
        comm.allgather(mine, all);
        for (j, &(i, _)) in thresholds.iter().enumerate() {
            picked[draws[i].row] = (0..n)
                .map(|r| {
                    let x = &all[r * 3 * k + 3 * j..r * 3 * k + 3 * j + 3];
                    (f32s_to_f64(x[0], x[1]), x[2].to_bits())
                })
                .fold((f64::NEG_INFINITY, u32::MAX), better)
                .1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A row's log-probabilities merged from its shards' records are the log-softmax of the
    /// whole row, whatever the split: the picked token's from the shard holding it, the `k`
    /// most likely tokens (the lower id on ties) from each shard's candidates.
    #[test]
    fn logprobs_merged_from_shards_are_the_whole_rows() {
        let row: Vec<f32> = (0..1000u32).map(|i| ((i * 7919 % 1009) as f32 / 40.0).sin() * 9.0).collect();
        let mut row = row;
        row[700] = row[3]; // a tie
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let lse = max + row.iter().map(|&l| (l as f64 - max).exp()).sum::<f64>().ln();
        let mut order: Vec<u32> = (0..1000).collect();
        order.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]).then(a.cmp(&b)));
        let (k, picked) = (5, 3u32);
        let (mut idx, mut merged) = (Vec::new(), Vec::new());
        for cuts in [vec![0, 1000], vec![0, 500, 1000], vec![0, 1, 333, 999, 1000]] {
            let shards = cuts.len() - 1;
            let rec = 1 + summary_len(k + 2);
            let mut records = vec![0.0f32; shards * rec];
            for s in 0..shards {
                let (a, b) = (cuts[s], cuts[s + 1]);
                let r = &mut records[s * rec..(s + 1) * rec];
                summarize(&row[a..b], a, k + 2, &mut idx, &mut r[1..]);
                let t = picked as usize;
                r[0] = if (a..b).contains(&t) { row[t] } else { f32::NEG_INFINITY };
            }
            let lp = merge_logprobs(shards, |s| &records[s * rec..(s + 1) * rec], k, &mut merged);
            assert!((lp.logprob as f64 - (row[3] as f64 - lse)).abs() < 1e-6, "{cuts:?}: {lp:?}");
            let ids: Vec<u32> = lp.top.iter().map(|t| t.0).collect();
            assert_eq!(ids, order[..k], "{cuts:?}");
            for &(t, v) in &lp.top {
                assert!((v as f64 - (row[t as usize] as f64 - lse)).abs() < 1e-6, "{cuts:?}: {t}");
            }
        }
    }

    /// generation_config.json read as HF's generate reads it: greedy without `do_sample`
    /// (a repetition penalty kept), its numbers with it (HF's defaults where absent or null),
    /// and a field of the wrong type or an invalid value named in one error.
    #[test]
    fn sampling_from_a_generation_config() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("generation_config.json");
        let read = |text: &str| {
            std::fs::write(&path, text).unwrap();
            from_generation_config(&path)
        };
        let greedy = read(r#"{"temperature": 0.6, "repetition_penalty": 1.1, "eos_token_id": 2}"#).unwrap();
        assert_eq!(greedy, SamplingParams { repetition_penalty: 1.1, ..SamplingParams::default() });
        let p = read(r#"{"do_sample": true, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": null}"#)
            .unwrap();
        assert_eq!(
            (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty),
            (0.6, 0.95, 20, 0.0, 1.0)
        );
        let p = read(r#"{"do_sample": true}"#).unwrap();
        assert_eq!((p.temperature, p.top_p, p.top_k), (1.0, 1.0, 50));
        for (text, msg) in [
            (r#"{"do_sample": "yes"}"#, "`do_sample` is \"yes\", not true or false"),
            (r#"{"do_sample": true, "top_k": -1}"#, "`top_k` is -1, not a count"),
            (r#"{"do_sample": true, "top_p": 1.5}"#, "top_p must be in (0, 1], got 1.5"),
            ("{", "invalid JSON"),
        ] {
            let e = read(text).unwrap_err().to_string();
            assert!(e.contains("generation_config.json") && e.contains(msg), "{text}: {e}");
        }
    }

    /// Runs the whole protocol for one row split into `shards` pieces, in one process: what
    /// `sample_rows` does with a stage of that many ranks.
    fn sample_split(logits: &[f32], shards: usize, p: &SamplingParams, index: u64) -> u32 {
        let v = logits.len();
        let ranges: Vec<(usize, usize)> =
            (0..shards).map(|r| (r * v / shards, (r + 1) * v / shards)).collect();
        let mut c = first_candidates(p);
        let mut idx = Vec::new();
        let mut merged = Vec::new();
        loop {
            let cc = c.min(v);
            let sums: Vec<Vec<f32>> = ranges
                .iter()
                .map(|&(a, b)| {
                    let mut s = vec![0.0; summary_len(cc)];
                    summarize(&logits[a..b], a, cc, &mut idx, &mut s);
                    s
                })
                .collect();
            let refs: Vec<&[f32]> = sums.iter().map(|s| &s[..]).collect();
            match decide(refs.len(), |r| refs[r], p, index, &mut merged) {
                Decision::Token(t) => return t,
                Decision::More(m) => {
                    assert!(cc < v, "more candidates asked for after all were sent");
                    c = m.max(cc + 1);
                }
                Decision::Threshold { theta } => {
                    let best = ranges
                        .iter()
                        .map(|&(a, b)| threshold_pick(&logits[a..b], a, theta, p, index))
                        .fold((f64::NEG_INFINITY, u32::MAX), better);
                    return best.1;
                }
            }
        }
    }

    /// The distribution the settings define, computed directly on the full row.
    fn reference(logits: &[f32], p: &SamplingParams) -> Vec<f64> {
        let mut order: Vec<usize> = (0..logits.len()).collect();
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        let max = logits[order[0]] as f64;
        let w: Vec<f64> = logits.iter().map(|&l| (l as f64 - max).exp()).collect();
        let mut keep = if p.top_k > 0 { p.top_k } else { logits.len() };
        let z: f64 = order.iter().take(keep).map(|&i| w[i]).sum();
        let mut acc = 0.0;
        for (n, &i) in order.iter().take(keep).enumerate() {
            acc += w[i] / z;
            if acc >= p.top_p as f64 {
                keep = n + 1;
                break;
            }
        }
        let kept: Vec<usize> =
            order.iter().take(keep).copied().filter(|&i| w[i] >= p.min_p as f64 * 0.999_999).collect();
        let total: f64 = kept.iter().map(|&i| w[i]).sum();
        let mut probs = vec![0.0; logits.len()];
        for i in kept {
            probs[i] = w[i] / total;
        }
        probs
    }

    fn logits(v: usize, seed: u64) -> Vec<f32> {
        (0..v)
            .map(|i| ((splitmix64(seed + i as u64) >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0)
            .collect()
    }

    /// Top-k, top-p, min-p and plain temperature sample only kept tokens, with the kept
    /// tokens' probabilities (chi-square against the direct computation), and every split of
    /// the vocabulary over ranks draws the same token for the same draw.
    #[test]
    fn samples_follow_the_truncated_distribution_for_every_split() {
        // 300 tokens: more than a first round's candidates, so shards of 300 and 150 take the
        // "more candidates" and threshold paths, while shards of 43 send everything.
        let l = logits(300, 3);
        let settings = [
            SamplingParams { temperature: 1.0, top_k: 5, ..Default::default() },
            SamplingParams { temperature: 1.0, top_p: 0.6, ..Default::default() },
            SamplingParams { temperature: 1.0, top_k: 12, top_p: 0.7, ..Default::default() },
            SamplingParams { temperature: 1.0, min_p: 0.3, ..Default::default() },
            SamplingParams { temperature: 1.0, min_p: 0.05, top_p: 0.8, ..Default::default() },
            SamplingParams { temperature: 1.0, ..Default::default() },
        ];
        for p in &settings {
            let want = reference(&l, p);
            let n = 25_000;
            let mut counts = vec![0usize; l.len()];
            for i in 0..n {
                let t = sample_split(&l, 1, p, i);
                for shards in [2, 3, 7] {
                    assert_eq!(
                        sample_split(&l, shards, p, i),
                        t,
                        "{p:?}: {shards} shards differ at draw {i}"
                    );
                }
                counts[t as usize] += 1;
            }
            let mut chi2 = 0.0;
            let mut dof = 0;
            for (t, &c) in counts.iter().enumerate() {
                if want[t] == 0.0 {
                    assert_eq!(c, 0, "{p:?}: token {t} is outside the kept set but was drawn {c} times");
                    continue;
                }
                let e = want[t] * n as f64;
                chi2 += (c as f64 - e).powi(2) / e;
                dof += 1;
            }
            // Far above the 99.9% quantile for these degrees of freedom would mean wrong
            // frequencies; a correct sampler stays below it except one time in a thousand.
            let limit = dof as f64 + 4.0 * (2.0 * dof as f64).sqrt() + 10.0;
            assert!(chi2 < limit, "{p:?}: chi-square {chi2:.1} over {dof} kept tokens (limit {limit:.1})");
        }
    }

    /// A nucleus larger than the first round's candidates (a flat distribution) is found by
    /// asking for more, and still matches the direct computation.
    #[test]
    fn wide_nucleus_asks_for_more_candidates() {
        let l: Vec<f32> = (0..3000).map(|i| (i % 7) as f32 * 0.01).collect();
        let p = SamplingParams { temperature: 1.0, top_p: 0.9, ..Default::default() };
        let want = reference(&l, &p);
        for i in 0..200 {
            let t = sample_split(&l, 1, &p, i);
            assert!(want[t as usize] > 0.0, "token {t} is outside the nucleus");
            assert_eq!(sample_split(&l, 4, &p, i), t);
        }
    }

    /// Rows sampled together pick what each picks alone, also where a round takes several
    /// collectives: on flat shards of 3000 a round of 1024 candidates a row goes two rows a
    /// collective, one of the whole shard one row a collective. A `top_k` beyond the
    /// vocabulary asks for the whole shard at once.
    #[test]
    fn rows_sampled_together_pick_what_each_picks_alone() {
        let v = 3000;
        let rows: Vec<Vec<f32>> =
            (0..4).map(|r| (0..v).map(|i| ((i * (r + 2)) % 7) as f32 * 0.01).collect()).collect();
        let logits = rows.concat();
        let params = [
            SamplingParams { temperature: 1.0, top_p: 0.9, ..Default::default() },
            SamplingParams { temperature: 0.7, top_p: 0.99, min_p: 0.5, ..Default::default() },
            SamplingParams { temperature: 1.5, top_p: 0.3, ..Default::default() },
            SamplingParams { temperature: 1.0, top_k: usize::MAX, top_p: 0.5, ..Default::default() },
        ];
        let mut b = Buffers::default();
        let mut picked = [u32::MAX; 4];
        for index in 0..30 {
            b.draws.clear();
            b.draws.extend(params.iter().enumerate().map(|(row, p)| Draw { row, params: p.clone(), index }));
            sample_rows(&logits, v, v, 0, &mut b, &crate::comm::Single, &mut picked);
            for (row, p) in params.iter().enumerate() {
                assert_eq!(picked[row], sample_split(&rows[row], 1, p, index), "row {row}, draw {index}");
            }
        }
    }

    /// Tokens taken out (−∞) are never picked, greedy or sampled, on any split of the
    /// vocabulary, also where they are a whole shard; a bias is added to its token's logit; the
    /// rules' check names what does not fit.
    #[test]
    fn tokens_taken_out_are_never_drawn() {
        let mut l = logits(300, 9);
        let best = (0..300).max_by(|&a, &b| l[a].total_cmp(&l[b])).unwrap() as u32;
        // 0..43 holds the first shard of 7 (0..42) whole.
        let banned: Vec<u32> = (0..43).chain([best]).collect();
        let before = l[50];
        steer(&mut l, &[(5, 2.0), (50, -1.5), (400, 1.0)], &banned);
        assert_eq!((l[5], l[50]), (f32::NEG_INFINITY, before - 1.5));
        let settings = [
            SamplingParams::default(),
            SamplingParams { temperature: 1.0, ..Default::default() },
            SamplingParams { temperature: 1.0, top_p: 0.9, ..Default::default() },
            SamplingParams { temperature: 1.0, top_k: 50, ..Default::default() },
            SamplingParams { temperature: 1.0, min_p: 0.2, ..Default::default() },
        ];
        for p in &settings {
            for i in 0..2000 {
                let t = if p.is_greedy() {
                    (0..300u32).fold(0, |b, t| if l[t as usize] > l[b as usize] { t } else { b })
                } else {
                    sample_split(&l, 1, p, i)
                };
                assert!(!banned.contains(&t), "{p:?}: drew {t}, taken out");
                if !p.is_greedy() {
                    for shards in [2, 3, 7] {
                        assert_eq!(sample_split(&l, shards, p, i), t, "{p:?}: {shards} shards at draw {i}");
                    }
                }
            }
        }
        let rules =
            |min_tokens, stop_token_ids, logit_bias| TokenRules { min_tokens, stop_token_ids, logit_bias };
        assert_eq!(rules(3, vec![299], vec![(0, -100.0), (7, 100.0)]).check(300, 3), Ok(()));
        for (r, msg) in [
            (rules(4, vec![], vec![]), "min_tokens (4) must be at most max_tokens (3)"),
            (
                rules(0, vec![300], vec![]),
                "stop_token_ids holds token 300, outside the vocabulary of 300 tokens",
            ),
            (
                rules(0, vec![], vec![(300, 1.0)]),
                "logit_bias holds token 300, outside the vocabulary of 300 tokens",
            ),
            (
                rules(0, vec![], vec![(1, 100.5)]),
                "logit_bias gives token 1 a bias of 100.5, outside [-100, 100]",
            ),
            (rules(0, vec![], vec![(1, 1.0), (1, 2.0)]), "logit_bias gives token 1 twice"),
        ] {
            assert_eq!(r.check(300, 3), Err(msg.to_string()));
        }
    }

    #[test]
    fn penalty_and_temperature() {
        let mut row = vec![2.0, -2.0, 1.0, 4.0];
        let p = SamplingParams { temperature: 2.0, repetition_penalty: 2.0, ..Default::default() };
        adjust(&mut row, &p, &[0b0011], &[]);
        assert_eq!(row, vec![0.5, -2.0, 0.5, 2.0]);
        // Presence and frequency penalties on the generated tokens (counted 2, 0, 1, 0), after
        // the repetition penalty and before the temperature.
        let mut row = vec![2.0, -2.0, 1.0, 4.0];
        let p = SamplingParams { presence_penalty: 0.5, frequency_penalty: 0.25, ..p };
        adjust(&mut row, &p, &[0b0011], &[2, 0, 1, 0]);
        assert_eq!(row, vec![(1.0 - 0.5 - 0.5) / 2.0, -2.0, (1.0 - 0.5 - 0.25) / 2.0, 2.0]);
        assert!(SamplingParams { frequency_penalty: 2.5, ..Default::default() }.check().is_err());
        assert!(SamplingParams { presence_penalty: -2.0, ..Default::default() }.check().is_ok());
        assert!(SamplingParams { top_p: 0.0, ..Default::default() }.check().is_err());
        assert!(SamplingParams { temperature: -1.0, ..Default::default() }.check().is_err());
        let d = SamplingParams::default();
        assert!((0..1000).map(|i| d.gumbel(i, 7)).all(f64::is_finite));
    }
}
