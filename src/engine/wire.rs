//! Plans and step results as bytes, written into and read back into buffers that are reused
//! from step to step, so a decode step allocates nothing on any rank. A step's spans and tokens
//! are little-endian words; what is rare goes through bincode: admissions (once per sequence),
//! `Begin`, `Read` and `End`, and the prompt logits a caller may ask for.
//!
//! ```text
//! step:   0u8, want_logits u8, side u8, spans u64, admit bytes u64,
//!         spans × (seq u64, pos0 u64, len u64, emit u8), tokens,
//!         scored u64, scored × (span u64, next u64 (u64::MAX: none), k u64),
//!         drafted u64, drafted × (span u64, k u64),
//!         allowed u64, allowed × seq u64, words u64, words × u64,
//!         pooled u64, pooled × (span u64, how u8, ends u8), admit (bincode)
//! other:  1u8, the plan (bincode)
//! result: tokens, 0u8 | 1u8 and (logits, log-probabilities, prompt log-probabilities,
//!         embeddings) (bincode)
//! tokens: count u64, then the tokens × u32
//! ```

use super::{Drafted, Plan, Pooled, Pooling, Scored, Step, StepResult};
use crate::error::{Error, Result};
use crate::model::Span;

const STEP: u8 = 0;
const OTHER: u8 = 1;
/// Bytes of one span on the wire.
const SPAN_BYTES: usize = 3 * 8 + 1;
/// Bytes of one scored span on the wire.
const SCORED_BYTES: usize = 3 * 8;
/// Bytes of one drafted span on the wire.
const DRAFTED_BYTES: usize = 2 * 8;
/// Bytes of one pooled span on the wire.
const POOLED_BYTES: usize = 8 + 2;
/// How a pooled span pools, as a byte.
const POOLINGS: [Pooling; 3] = [Pooling::Last, Pooling::Mean, Pooling::Cls];

fn word(out: &mut Vec<u8>, v: usize) {
    out.extend_from_slice(&(v as u64).to_le_bytes());
}

/// A list of tokens: its length, then the tokens.
fn tokens(out: &mut Vec<u8>, t: &[u32]) {
    word(out, t.len());
    t.iter().for_each(|t| out.extend_from_slice(&t.to_le_bytes()));
}

/// `plan` as bytes, in `out` (cleared first).
pub fn encode_plan(plan: &Plan, out: &mut Vec<u8>) -> Result<()> {
    out.clear();
    let step = match plan {
        Plan::Step(s) => s,
        other => {
            out.push(OTHER);
            return bincode::serialize_into(&mut *out, other)
                .map_err(|e| Error::Comm(format!("cannot encode a plan: {e}")));
        }
    };
    out.extend([STEP, u8::from(step.want_logits), step.side]);
    word(out, step.spans.len());
    let admit_at = out.len();
    word(out, 0);
    for s in &step.spans {
        [s.seq, s.pos0, s.len].into_iter().for_each(|v| word(out, v));
        out.push(u8::from(s.emit));
    }
    tokens(out, &step.tokens);
    word(out, step.scored.len());
    for s in &step.scored {
        word(out, s.span);
        out.extend_from_slice(&s.next.map_or(u64::MAX, u64::from).to_le_bytes());
        word(out, s.k);
    }
    word(out, step.drafted.len());
    for d in &step.drafted {
        word(out, d.span);
        word(out, d.k);
    }
    word(out, step.allowed_seqs.len());
    step.allowed_seqs.iter().for_each(|&s| word(out, s));
    word(out, step.allowed.len());
    step.allowed.iter().for_each(|w| out.extend_from_slice(&w.to_le_bytes()));
    word(out, step.pooled.len());
    for p in &step.pooled {
        word(out, p.span);
        let how = POOLINGS.iter().position(|&h| h == p.how).unwrap_or_default();
        out.extend([how as u8, u8::from(p.ends)]);
    }
    if !step.admit.is_empty() {
        let start = out.len();
        bincode::serialize_into(&mut *out, &step.admit)
            .map_err(|e| Error::Comm(format!("cannot encode a plan's admissions: {e}")))?;
        let n = (out.len() - start) as u64;
        out[admit_at..admit_at + 8].copy_from_slice(&n.to_le_bytes());
    }
    Ok(())
}

/// Whether `bytes` (from [`encode_plan`]) hold a step.
pub fn is_step(bytes: &[u8]) -> bool {
    bytes.first() == Some(&STEP)
}

/// Reads what [`encode_plan`] wrote into `into`, reusing its buffers when both are steps.
pub fn decode_plan(bytes: &[u8], into: &mut Plan) -> Result<()> {
    let mut r = Reader { bytes, what: "a plan" };
    if r.u8()? == OTHER {
        *into =
            bincode::deserialize(r.rest()).map_err(|e| Error::Comm(format!("cannot decode a plan: {e}")))?;
        return Ok(());
    }
    let want_logits = r.u8()? != 0;
    let side = r.u8()?;
    let (n_spans, admit_bytes) = (r.len(SPAN_BYTES)?, r.len(1)?);
    if !matches!(into, Plan::Step(_)) {
        *into = Plan::Step(Step::default());
    }
    let Plan::Step(step) = into else { unreachable!("made a step just above") };
    step.want_logits = want_logits;
    step.side = side;
    step.spans.clear();
    for _ in 0..n_spans {
        let (seq, pos0, len) = (r.usize()?, r.usize()?, r.usize()?);
        step.spans.push(Span { seq, pos0, len, emit: r.u8()? != 0 });
    }
    r.tokens(&mut step.tokens)?;
    let n_scored = r.len(SCORED_BYTES)?;
    step.scored.clear();
    for _ in 0..n_scored {
        let span = r.usize()?;
        let next = u64::from_le_bytes(r.array()?);
        let next = if next == u64::MAX {
            None
        } else {
            Some(u32::try_from(next).map_err(|_| Error::Comm(format!("a plan scores token {next}")))?)
        };
        step.scored.push(Scored { span, next, k: r.usize()? });
    }
    let n_drafted = r.len(DRAFTED_BYTES)?;
    step.drafted.clear();
    for _ in 0..n_drafted {
        let span = r.usize()?;
        step.drafted.push(Drafted { span, k: r.usize()? });
    }
    let n_allowed = r.len(8)?;
    step.allowed_seqs.clear();
    for _ in 0..n_allowed {
        step.allowed_seqs.push(r.usize()?);
    }
    let n_words = r.len(8)?;
    step.allowed.clear();
    for _ in 0..n_words {
        step.allowed.push(u64::from_le_bytes(r.array()?));
    }
    let n_pooled = r.len(POOLED_BYTES)?;
    step.pooled.clear();
    for _ in 0..n_pooled {
        let span = r.usize()?;
        let how = r.u8()?;
        let how =
            *POOLINGS.get(how as usize).ok_or_else(|| Error::Comm(format!("a plan pools by way {how}")))?;
        step.pooled.push(Pooled { span, how, ends: r.u8()? != 0 });
    }
    let admit = r.take(admit_bytes)?;
    if admit.is_empty() {
        step.admit.clear();
    } else {
        step.admit = bincode::deserialize(admit)
            .map_err(|e| Error::Comm(format!("cannot decode a plan's admissions: {e}")))?;
    }
    r.end()
}

/// `r` as bytes, in `out` (cleared first).
pub fn encode_result(r: &StepResult, out: &mut Vec<u8>) -> Result<()> {
    out.clear();
    tokens(out, &r.tokens);
    if r.logits.is_none() && r.logprobs.is_empty() && r.prompt_logprobs.is_empty() && r.embeddings.is_empty()
    {
        out.push(0);
    } else {
        out.push(1);
        bincode::serialize_into(&mut *out, &(&r.logits, &r.logprobs, &r.prompt_logprobs, &r.embeddings))
            .map_err(|e| Error::Comm(format!("cannot encode a step's logits: {e}")))?;
    }
    Ok(())
}

/// Reads what [`encode_result`] wrote into `into`, reusing its token buffer.
pub fn decode_result(bytes: &[u8], into: &mut StepResult) -> Result<()> {
    let mut r = Reader { bytes, what: "a step result" };
    r.tokens(&mut into.tokens)?;
    if r.u8()? == 0 {
        into.logits = None;
        into.logprobs.clear();
        into.prompt_logprobs.clear();
        into.embeddings.clear();
        return r.end();
    }
    (into.logits, into.logprobs, into.prompt_logprobs, into.embeddings) = bincode::deserialize(r.rest())
        .map_err(|e| Error::Comm(format!("cannot decode a step's logits: {e}")))?;
    Ok(())
}

/// Reads little-endian fields from the front of `bytes`; running short is an error naming
/// `what` was being read.
struct Reader<'a> {
    bytes: &'a [u8],
    what: &'static str,
}

impl<'a> Reader<'a> {
    fn short(&self) -> Error {
        Error::Comm(format!("{} is cut short", self.what))
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let (head, rest) = self.bytes.split_at_checked(n).ok_or_else(|| self.short())?;
        self.bytes = rest;
        Ok(head)
    }

    /// The next `N` bytes.
    fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        let (head, rest) = self.bytes.split_first_chunk::<N>().ok_or_else(|| self.short())?;
        self.bytes = rest;
        Ok(*head)
    }

    fn u8(&mut self) -> Result<u8> {
        Ok(self.array::<1>()?[0])
    }

    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn usize(&mut self) -> Result<usize> {
        let v = u64::from_le_bytes(self.array()?);
        usize::try_from(v).map_err(|_| Error::Comm(format!("{} holds a count of {v}", self.what)))
    }

    /// A list of tokens (see [`tokens`]) into `out` (cleared first).
    fn tokens(&mut self, out: &mut Vec<u32>) -> Result<()> {
        let n = self.len(4)?;
        out.clear();
        for _ in 0..n {
            out.push(self.u32()?);
        }
        Ok(())
    }

    /// A count of items of `item_bytes` each, checked against the bytes left (so a damaged
    /// count cannot ask for a huge buffer).
    fn len(&mut self, item_bytes: usize) -> Result<usize> {
        let n = self.usize()?;
        if n.checked_mul(item_bytes).is_none_or(|b| b > self.bytes.len()) {
            return Err(self.short());
        }
        Ok(n)
    }

    fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.bytes)
    }

    fn end(&self) -> Result<()> {
        if self.bytes.is_empty() {
            Ok(())
        } else {
            Err(Error::Comm(format!("{} has {} bytes too many", self.what, self.bytes.len())))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::sampling::SamplingParams;
    use crate::engine::{Admit, TokenLogprobs};

    fn step() -> Step {
        Step {
            admit: vec![Admit {
                slot: 2,
                pages: vec![7, 3, 9],
                params: SamplingParams { temperature: 0.7, seed: 42, ..SamplingParams::default() },
                logprobs: Some(3),
                history: vec![4, 0, u32::MAX],
                prompt_len: 1 << 35,
                logit_bias: vec![(5, -100.0), (u32::MAX, 0.5)],
                enders: vec![2, 0],
                min_tokens: 3,
            }],
            spans: vec![
                Span { seq: 2, pos0: 0, len: 3, emit: false },
                Span { seq: 0, pos0: 1 << 40, len: 1, emit: true },
            ],
            tokens: vec![1, 2, u32::MAX, 5],
            want_logits: true,
            side: 1,
            scored: vec![
                Scored { span: 0, next: Some(u32::MAX), k: 2 },
                Scored { span: 1, next: None, k: 0 },
            ],
            drafted: vec![Drafted { span: 1, k: 3 }, Drafted { span: 4, k: 1 << 33 }],
            allowed_seqs: vec![0, 2],
            allowed: vec![u64::MAX, 1, 0, 1 << 63],
            pooled: vec![
                Pooled { span: 0, how: Pooling::Mean, ends: false },
                Pooled { span: 1 << 36, how: Pooling::Cls, ends: true },
                Pooled { span: 1, how: Pooling::Last, ends: true },
            ],
        }
    }

    fn same(a: &Plan, b: &Plan) -> bool {
        format!("{a:?}") == format!("{b:?}")
    }

    #[test]
    fn plans_round_trip_into_reused_buffers() {
        let mut bytes = Vec::new();
        let mut into = Plan::End;
        for plan in [
            Plan::Step(step()),
            Plan::Step(Step { admit: Vec::new(), want_logits: false, ..step() }),
            Plan::Begin { pages: 12, slots: 3, chunk: 16, rows: 15 },
            Plan::Read,
            Plan::Idle,
            Plan::End,
            Plan::Step(Step::default()),
        ] {
            encode_plan(&plan, &mut bytes).unwrap();
            assert_eq!(is_step(&bytes), matches!(plan, Plan::Step(_)), "{plan:?}");
            decode_plan(&bytes, &mut into).unwrap();
            assert!(same(&plan, &into), "{plan:?} came back as {into:?}");
        }
    }

    #[test]
    fn a_decode_step_reuses_the_buffers() {
        let plan = Plan::Step(Step { admit: Vec::new(), ..step() });
        let mut bytes = Vec::new();
        let mut into = Plan::End;
        encode_plan(&plan, &mut bytes).unwrap();
        decode_plan(&bytes, &mut into).unwrap();
        let Plan::Step(s) = &into else { panic!("{into:?}") };
        let (spans, tokens) = (s.spans.as_ptr(), s.tokens.as_ptr());
        let cap = bytes.capacity();
        encode_plan(&plan, &mut bytes).unwrap();
        decode_plan(&bytes, &mut into).unwrap();
        let Plan::Step(s) = &into else { panic!("{into:?}") };
        assert_eq!((s.spans.as_ptr(), s.tokens.as_ptr(), bytes.capacity()), (spans, tokens, cap));
    }

    #[test]
    fn results_round_trip() {
        let mut bytes = Vec::new();
        let mut into = StepResult { tokens: vec![9; 5], ..StepResult::default() };
        let lp = |v: f32| Some(TokenLogprobs { logprob: v, top: vec![(7, -0.25), (1, v)] });
        for r in [
            StepResult { tokens: vec![4, 0, 17], ..StepResult::default() },
            StepResult {
                tokens: vec![3],
                logits: Some(vec![0.5, -1.0, f32::MIN]),
                logprobs: vec![lp(-2.0)],
                ..StepResult::default()
            },
            StepResult {
                tokens: vec![5, 6, 8],
                logits: None,
                logprobs: vec![lp(-1.5), None, lp(-3.0)],
                prompt_logprobs: vec![lp(-0.5).unwrap(), lp(-4.0).unwrap()],
                embeddings: vec![],
            },
            StepResult {
                tokens: Vec::new(),
                embeddings: vec![0.25, -1.0, f32::MAX],
                ..StepResult::default()
            },
            StepResult { tokens: Vec::new(), ..StepResult::default() },
        ] {
            encode_result(&r, &mut bytes).unwrap();
            decode_result(&bytes, &mut into).unwrap();
            let got = (&into.tokens, &into.logits, &into.logprobs, &into.prompt_logprobs, &into.embeddings);
            assert_eq!(got, (&r.tokens, &r.logits, &r.logprobs, &r.prompt_logprobs, &r.embeddings));
        }
    }

    #[test]
    fn damaged_bytes_are_errors_not_panics() {
        let mut bytes = Vec::new();
        encode_plan(&Plan::Step(step()), &mut bytes).unwrap();
        let mut into = Plan::End;
        for cut in 0..bytes.len() {
            let e = decode_plan(&bytes[..cut], &mut into).unwrap_err().to_string();
            assert!(e.contains("plan"), "{e}");
        }
        bytes.push(0);
        assert!(decode_plan(&bytes, &mut into).unwrap_err().to_string().contains("too many"));
        // A count far beyond the bytes that follow.
        let mut huge = vec![STEP, 0];
        huge.extend(u64::MAX.to_le_bytes());
        assert!(decode_plan(&huge, &mut into).is_err());
        let mut r = Vec::new();
        encode_result(&StepResult { tokens: vec![1, 2], ..StepResult::default() }, &mut r).unwrap();
        let mut into = StepResult::default();
        for cut in 0..r.len() {
            assert!(decode_result(&r[..cut], &mut into).is_err());
        }
    }
}
