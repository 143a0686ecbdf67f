//! Structured output: a sequence's answer held to JSON, or to a JSON schema (OpenAI's
//! `response_format`), by llguidance's grammar engine. The driver keeps each such sequence's
//! matcher, advances it by the tokens the sequence brings, and sends with each of the
//! sequence's steps the tokens the grammar allows next (a bit per token of the vocabulary); the
//! last stage takes every other token out of the sequence's row before the pick, so its ranks
//! agree on the token as they do on any other.

use crate::error::{Error, Result};
use crate::tokenizer::Tokenizer;
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::sync::Arc;

/// What a sequence's answer must be.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Format {
    /// A JSON object (OpenAI's `json_object`).
    JsonObject,
    /// JSON that a JSON schema takes (OpenAI's `json_schema`).
    JsonSchema(Value),
    /// Text a regular expression matches whole (vLLM's `regex`).
    Regex(String),
    /// One of these texts (vLLM's `choice`).
    Choice(Vec<String>),
    /// Text of a Lark grammar, as llguidance reads it (vLLM's `grammar`).
    Grammar(String),
}

/// vLLM's formats: the keys of its `structured_outputs` and, but for `json_object`, the
/// request keys of its earlier versions (`guided_json`, ...).
pub const VLLM_FORMATS: [(&str, Option<&str>); 5] = [
    ("json", Some("guided_json")),
    ("regex", Some("guided_regex")),
    ("choice", Some("guided_choice")),
    ("grammar", Some("guided_grammar")),
    ("json_object", None),
];

impl Format {
    /// OpenAI's `response_format` (`{"type": "text"}`, `{"type": "json_object"}` or
    /// `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`): `None` for
    /// text; the error says what is wrong.
    pub fn from_response_format(v: &Value) -> std::result::Result<Option<Format>, String> {
        let kind = v.get("type").and_then(Value::as_str);
        match kind {
            Some("text") => Ok(None),
            Some("json_object") => Ok(Some(Format::JsonObject)),
            Some("json_schema") => {
                let schema = v.get("json_schema").and_then(|s| s.get("schema"));
                match schema {
                    Some(s) if s.is_object() || s.is_boolean() => Ok(Some(Format::JsonSchema(s.clone()))),
                    _ => Err("`json_schema.schema` must be a JSON schema (an object)".into()),
                }
            }
            _ => Err(format!(
                "`type` is {}: text, json_object or json_schema",
                v.get("type").map_or("missing".to_string(), |t| t.to_string())
            )),
        }
    }

    /// vLLM's format `key` ([`VLLM_FORMATS`]: `json`, a schema or its text; `regex`; `choice`,
    /// a list of texts; `grammar`, Lark; `json_object`, true) with its value `v`, or what is
    /// wrong with it (to follow the key's name).
    pub fn from_vllm(key: &str, v: &Value) -> std::result::Result<Format, String> {
        match (key, v) {
            ("json", Value::String(text)) => match serde_json::from_str::<Value>(text) {
                Ok(schema) if schema.is_object() => Ok(Format::JsonSchema(schema)),
                _ => Err("must be a JSON schema (an object, or its text)".into()),
            },
            ("json", s) if s.is_object() => Ok(Format::JsonSchema(s.clone())),
            ("json", _) => Err("must be a JSON schema (an object, or its text)".into()),
            ("regex", Value::String(r)) => Ok(Format::Regex(r.clone())),
            ("choice", Value::Array(a)) if !a.is_empty() && a.iter().all(Value::is_string) => {
                Ok(Format::Choice(a.iter().filter_map(|c| c.as_str().map(String::from)).collect()))
            }
            ("choice", _) => Err("must be a non-empty list of strings".into()),
            ("grammar", Value::String(g)) => Ok(Format::Grammar(g.clone())),
            ("json_object", Value::Bool(true)) => Ok(Format::JsonObject),
            ("json_object", _) => Err("must be true".into()),
            _ => Err("must be a string".into()),
        }
    }

    /// The grammar: JSON written compactly as Python's `json.dumps` writes it (`", "` and
    /// `": "` between items, no other whitespace), so a model cannot drift into endless
    /// whitespace.
    fn grammar(&self) -> TopLevelGrammar {
        let mut schema = match self {
            Format::JsonObject => json!({"type": "object"}),
            Format::JsonSchema(s) => s.clone(),
            Format::Regex(r) => return TopLevelGrammar::from_regex(r),
            Format::Choice(c) => {
                let any: Vec<String> = c.iter().map(|c| regex_syntax::escape(c)).collect();
                return TopLevelGrammar::from_regex(&format!("({})", any.join("|")));
            }
            Format::Grammar(g) => return TopLevelGrammar::from_lark(g.clone()),
        };
        let layout = json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "});
        match &mut schema {
            Value::Object(o) => {
                o.entry("x-guidance").or_insert(layout);
            }
            // `true` takes any JSON value.
            _ => schema = json!({"x-guidance": layout}),
        }
        TopLevelGrammar::from_json_schema(schema)
    }
}

/// A model's vocabulary as the grammar engine reads it (each token's bytes, special tokens
/// apart, the end-of-sequence tokens), from which each constrained sequence's matcher is made.
pub struct Grammars {
    factory: ParserFactory,
    vocab: usize,
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Grammars {{ vocab: {} }}", self.vocab)
    }
}

/// One constrained sequence's state: its grammar so far. A clone goes on alone from where
/// this one is; the compiled grammar and its lexer's states, built as matchers meet them, are
/// shared (behind a lock), not compiled again.
#[derive(Clone)]
pub struct Constrained(Matcher);

impl std::fmt::Debug for Constrained {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Constrained {{ done: {} }}", self.done())
    }
}

impl Grammars {
    /// The vocabulary of `vocab` tokens (the model's; ids the tokenizer lacks are never
    /// allowed) as `tok` spells them, `eos` ending a finished answer.
    pub fn new(tok: &Tokenizer, vocab: usize, eos: &[u32]) -> Result<Arc<Grammars>> {
        let words: Vec<Vec<u8>> = (0..vocab as u32)
            .map(|id| match tok.token_bytes(id) {
                Some(b) if tok.is_special(id) => [&[TokTrie::SPECIAL_TOKEN_MARKER][..], &b].concat(),
                Some(b) => b,
                None => Vec::new(),
            })
            .collect();
        let eos: Vec<u32> = eos.iter().copied().filter(|&t| (t as usize) < vocab).collect();
        let Some(&first) = eos.first() else {
            return Err(Error::Input("structured output needs the model's end-of-sequence token".into()));
        };
        let trie = TokTrie::from(&TokRxInfo::new(vocab as u32, first), &words).with_eos_tokens(&eos);
        let env: llguidance::toktrie::TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&env)
            .map_err(|e| Error::Input(format!("the grammar engine cannot read the vocabulary: {e}")))?;
        factory.quiet();
        Ok(Arc::new(Grammars { factory, vocab }))
    }

    /// A fresh matcher of format `f`, or why `f` cannot be compiled.
    pub fn start(&self, f: &Format) -> std::result::Result<Constrained, String> {
        let parser =
            self.factory.create_parser(f.grammar()).map_err(|e| format!("the answer's format: {e}"))?;
        let m = Matcher::new(Ok(parser));
        match m.get_error() {
            Some(e) => Err(format!("the answer's format: {e}")),
            None => Ok(Constrained(m)),
        }
    }

    /// 64-bit words of a set of tokens ([`Grammars::allowed`]).
    pub fn words(&self) -> usize {
        self.vocab.div_ceil(64)
    }

    /// Writes into `out` ([`Grammars::words`] long) the tokens `c`'s grammar allows next, a
    /// bit per token id; an error where it allows none (or failed).
    pub fn allowed(&self, c: &mut Constrained, out: &mut [u64]) -> std::result::Result<(), String> {
        let mask = c.0.compute_mask().map_err(|e| format!("structured output: {e}"))?;
        out.fill(0);
        let words = mask.as_slice();
        for (i, o) in out.iter_mut().enumerate() {
            let lo = words.get(2 * i).copied().unwrap_or(0) as u64;
            let hi = words.get(2 * i + 1).copied().unwrap_or(0) as u64;
            *o = lo | hi << 32;
        }
        // Bits past the vocabulary (the mask's last word) are no tokens.
        if !self.vocab.is_multiple_of(64) {
            if let Some(last) = out.last_mut() {
                *last &= (1u64 << (self.vocab % 64)) - 1;
            }
        }
        if out.iter().all(|&w| w == 0) {
            return Err("structured output: the grammar allows no token".into());
        }
        Ok(())
    }
}

impl Constrained {
    /// Advances the grammar by token `t` (one it allowed).
    pub fn push(&mut self, t: u32) -> std::result::Result<(), String> {
        self.0.consume_token(t).map_err(|e| format!("structured output: {e}"))
    }

    /// Whether the answer is complete: the grammar takes nothing more.
    pub fn done(&self) -> bool {
        self.0.is_stopped()
    }
}

/// Takes out of a row of shard logits (token ids from `start`) every token `allowed` (a bit per
/// token id of the whole vocabulary) does not hold: their logits become −∞.
pub fn keep_allowed(row: &mut [f32], start: usize, allowed: &[u64]) {
    for (i, l) in row.iter_mut().enumerate() {
        let t = start + i;
        if allowed.get(t / 64).is_none_or(|w| w >> (t % 64) & 1 == 0) {
            *l = f32::NEG_INFINITY;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// OpenAI's three `response_format` types, and what is wrong with others, by name.
    #[test]
    fn response_formats_as_openai_writes_them() {
        let read = |v: Value| Format::from_response_format(&v);
        assert_eq!(read(json!({"type": "text"})), Ok(None));
        assert_eq!(read(json!({"type": "json_object"})), Ok(Some(Format::JsonObject)));
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let v =
            json!({"type": "json_schema", "json_schema": {"name": "a", "strict": true, "schema": schema}});
        assert_eq!(read(v), Ok(Some(Format::JsonSchema(schema))));
        for (v, msg) in [
            (json!({}), "`type` is missing: text, json_object or json_schema"),
            (json!({"type": 3}), "`type` is 3: text, json_object or json_schema"),
            (json!({"type": "json_schema"}), "`json_schema.schema` must be a JSON schema (an object)"),
            (json!({"type": "json_schema", "json_schema": {"schema": "x"}}), "`json_schema.schema` must be"),
        ] {
            let e = read(v.clone()).unwrap_err();
            assert!(e.starts_with(msg), "{v}: {e}");
        }
    }

    /// Only the allowed tokens of a shard keep their logits, wherever the shard starts.
    #[test]
    fn tokens_the_grammar_does_not_allow_are_taken_out() {
        let allowed = [1u64 << 3 | 1 << 63, 1 << 1];
        let mut row = vec![1.0f32; 8];
        keep_allowed(&mut row, 60, &allowed);
        let kept: Vec<usize> = (0..8).filter(|&i| row[i].is_finite()).map(|i| 60 + i).collect();
        assert_eq!(kept, [63, 65]);
        // Tokens past the bits (a shard beyond them) are never allowed.
        let mut row = vec![1.0f32; 4];
        keep_allowed(&mut row, 128, &allowed);
        assert!(row.iter().all(|l| *l == f32::NEG_INFINITY));
    }
}
