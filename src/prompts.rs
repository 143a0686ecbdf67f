//! Prompts for batched generation and the text of their completions. Owns: reading a prompts
//! file (one prompt per line, or JSONL with per-prompt settings), and following a completion's
//! text as tokens arrive, so stop strings end it.

use crate::engine::sampling::{SamplingParams, TokenRules, MAX_LOGIT_BIAS};
use crate::error::{Error, Result};
use crate::grammar::{Format, VLLM_FORMATS};
use crate::tokenizer::{check_template_vars, Message, StreamDecoder, TemplateVars, Tokenizer};
use crate::tools::{Parser, Tools};
use serde::Deserialize;
use std::path::Path;

/// Settings every prompt starts from; a JSONL line may override each of them.
#[derive(Debug, Clone)]
pub struct Defaults {
    pub max_tokens: usize,
    pub ignore_eos: bool,
    pub chat: bool,
    /// A system message before the prompt in the chat template (with `chat` only).
    pub system: Option<String>,
    /// Further variables of the chat template (`enable_thinking`, say).
    pub template_vars: TemplateVars,
    pub stop: Vec<String>,
    /// The text keeps the stop string or token that ends it.
    pub keep_stop: bool,
    pub params: SamplingParams,
    /// Logit biases, stop tokens and least number of tokens.
    pub rules: TokenRules,
    /// What the answer must be (structured output).
    pub format: Option<Format>,
    /// How calls are read from an answer whose tool choice is `auto` (`--tool-call-parser`).
    pub tool_parser: Option<Parser>,
}

/// One prompt of a prompts file, with its settings resolved.
#[derive(Debug, Clone)]
pub struct PromptSpec {
    /// Line number in the file (1-based).
    pub line: usize,
    /// The JSONL `id`, if any, echoed in the results.
    pub id: Option<serde_json::Value>,
    /// The prompt (the user's message, with `chat`).
    pub text: String,
    /// A JSONL line's conversation (`messages`), the system message first where the line has
    /// none and the command gives one; in place of `text` where not empty.
    pub messages: Vec<Message>,
    pub max_tokens: usize,
    pub ignore_eos: bool,
    pub chat: bool,
    pub system: Option<String>,
    /// Further variables of the chat template: the command's, a line's over them.
    pub template_vars: TemplateVars,
    pub stop: Vec<String>,
    pub keep_stop: bool,
    /// The text leaves out special tokens (vLLM's `skip_special_tokens`, true unless false).
    pub skip_special: bool,
    pub params: SamplingParams,
    pub rules: TokenRules,
    pub format: Option<Format>,
    /// A conversation's tools and how the answer may call them (`tools`, `tool_choice`,
    /// `parallel_tool_calls`, as in serve's chat requests).
    pub tools: Option<Tools>,
    /// The line is an embeddings request (OpenAI's batch input to `/v1/embeddings`).
    pub embedding: bool,
}

/// Keys a JSONL line may have (and [`ANSWER_KEYS`]).
const KEYS: [&str; 20] = [
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "prompt",
    "messages",
    "id",
    "max_tokens",
    "ignore_eos",
    "chat",
    "system",
    "chat_template_kwargs",
    "stop",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
];

/// Keys of an answer's settings beyond sampling, which prompts-file lines and serve's requests
/// both take and read alike ([`answer_fields`]).
pub(crate) const ANSWER_KEYS: [&str; 11] = [
    "skip_special_tokens",
    "min_tokens",
    "stop_token_ids",
    "logit_bias",
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "include_stop_str_in_output",
];

/// A stop setting: one string or a list.
#[derive(Deserialize)]
#[serde(untagged)]
enum Stop {
    One(String),
    Many(Vec<String>),
}

/// The value of `key` in a JSON object, if present and not null, as a `T`; the error names the
/// key.
pub(crate) fn field<T: serde::de::DeserializeOwned>(
    obj: &serde_json::Map<String, serde_json::Value>,
    key: &str,
) -> std::result::Result<Option<T>, String> {
    match obj.get(key) {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(v) => serde_json::from_value(v.clone()).map(Some).map_err(|e| format!("`{key}`: {e}")),
    }
}

/// The stop strings of a JSON object's `stop` (a string or a list), if it has one.
pub(crate) fn stop_field(
    obj: &serde_json::Map<String, serde_json::Value>,
) -> std::result::Result<Option<Vec<String>>, String> {
    let stop = field::<Stop>(obj, "stop").map_err(|_| "`stop` must be a string or a list of strings")?;
    Ok(stop.map(|s| match s {
        Stop::One(x) => vec![x],
        Stop::Many(x) => x,
    }))
}

/// The conversation of a JSON object's `messages` (OpenAI's: each with a `role` and a `content`,
/// a string, null or a list of text parts; an assistant's `tool_calls`, a tool's
/// `tool_call_id`, a `name`) as [`Message`]s, if it has one; the error names the message and
/// what is wrong. A tool call's `arguments`, JSON text, reach the template as the JSON value
/// it writes (as vLLM gives them: templates write them with `tojson`).
pub(crate) fn messages_field(
    obj: &serde_json::Map<String, serde_json::Value>,
) -> std::result::Result<Option<Vec<Message>>, String> {
    use serde_json::Value;
    let Some(msgs) = field::<Vec<serde_json::Map<String, Value>>>(obj, "messages")? else { return Ok(None) };
    if msgs.is_empty() {
        return Err("`messages` is empty".into());
    }
    let mut out = Vec::with_capacity(msgs.len());
    for (i, m) in msgs.iter().enumerate() {
        let role = match m.get("role") {
            Some(Value::String(r)) => r.clone(),
            Some(_) => return Err(format!("`messages[{i}].role` must be a string")),
            None => return Err(format!("`messages[{i}]` has no `role`")),
        };
        let text = match m.get("content") {
            None | Some(Value::Null) => String::new(),
            Some(Value::String(t)) => t.clone(),
            Some(Value::Array(parts)) => {
                let mut text = String::new();
                for p in parts {
                    match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                        (Some("text"), Some(t)) => text.push_str(t),
                        (kind, _) => {
                            return Err(format!(
                                "`messages[{i}]`: a content part of type {} (only text is read)",
                                kind.unwrap_or("(none)")
                            ))
                        }
                    }
                }
                text
            }
            Some(_) => {
                return Err(format!("`messages[{i}].content` must be a string or a list of text parts"))
            }
        };
        let mut more = serde_json::Map::new();
        for key in ["tool_call_id", "name"] {
            match m.get(key) {
                None | Some(Value::Null) => {}
                Some(Value::String(v)) => _ = more.insert(key.into(), v.clone().into()),
                Some(_) => return Err(format!("`messages[{i}].{key}` must be a string")),
            }
        }
        match m.get("tool_calls") {
            None | Some(Value::Null) => {}
            Some(calls) if role == "assistant" => {
                let calls = crate::tools::calls_for_template(calls)
                    .map_err(|e| format!("`messages[{i}].tool_calls{e}"))?;
                more.insert("tool_calls".into(), calls);
            }
            Some(_) => return Err(format!("`messages[{i}]`: only an assistant's message has `tool_calls`")),
        }
        out.push(Message { role, content: text, more });
    }
    Ok(Some(out))
}

/// `vars` with the chat template variables of a JSON object's `chat_template_kwargs` over
/// them, where it has them, checked.
pub(crate) fn template_vars_over(
    vars: &mut TemplateVars,
    obj: &serde_json::Map<String, serde_json::Value>,
) -> std::result::Result<(), String> {
    if let Some(more) = field::<TemplateVars>(obj, "chat_template_kwargs")? {
        check_template_vars(&more).map_err(|e| format!("`chat_template_kwargs`: {e}"))?;
        vars.extend(more);
    }
    Ok(())
}

/// The answer settings a JSON object gives ([`ANSWER_KEYS`]) over those given: whether the text
/// keeps the stop string or token that ends it (`include_stop_str_in_output`) and whether it
/// leaves out special tokens (`skip_special_tokens`), the token rules and the format.
pub(crate) fn answer_fields(
    obj: &serde_json::Map<String, serde_json::Value>,
    (keep_stop, skip_special): (&mut bool, &mut bool),
    rules: &mut TokenRules,
    format: &mut Option<Format>,
) -> std::result::Result<(), String> {
    *keep_stop = field(obj, "include_stop_str_in_output")?.unwrap_or(*keep_stop);
    *skip_special = field(obj, "skip_special_tokens")?.unwrap_or(*skip_special);
    rules_fields(obj, rules)?;
    if let Some(f) = format_field(obj)? {
        *format = f;
    }
    Ok(())
}

/// Whether a JSONL line may have key `k`.
fn line_key(k: &str) -> bool {
    KEYS.contains(&k) || ANSWER_KEYS.contains(&k)
}

/// The token rules a JSON object gives (`min_tokens`, `stop_token_ids`, `logit_bias`: OpenAI's
/// object of token ids, as strings, and biases) over those of `r`, each bias checked (the
/// tokens are checked against the vocabulary later, [`TokenRules::check`]).
fn rules_fields(
    obj: &serde_json::Map<String, serde_json::Value>,
    r: &mut TokenRules,
) -> std::result::Result<(), String> {
    r.min_tokens = field(obj, "min_tokens")?.unwrap_or(r.min_tokens);
    if let Some(ids) = field(obj, "stop_token_ids")? {
        r.stop_token_ids = ids;
    }
    if let Some(bias) = field::<serde_json::Map<String, serde_json::Value>>(obj, "logit_bias")? {
        r.logit_bias = logit_bias(&bias).map_err(|e| format!("`logit_bias`: {e}"))?;
    }
    Ok(())
}

/// The answer's format a JSON object asks for, if it asks: OpenAI's `response_format`
/// (`Some(None)` for text), vLLM's `structured_outputs` (one of `json`, `regex`, `choice`,
/// `grammar`, `json_object`) or its earlier `guided_json`, `guided_regex`, `guided_choice`,
/// `guided_grammar`; more than one is an error naming them.
pub(crate) fn format_field(
    obj: &serde_json::Map<String, serde_json::Value>,
) -> std::result::Result<Option<Option<Format>>, String> {
    use serde_json::Value;
    let given = |key: &str| obj.get(key).filter(|v| !v.is_null());
    let mut found: Vec<(String, Option<Format>)> = Vec::new();
    if let Some(v) = given("response_format") {
        let f = Format::from_response_format(v).map_err(|e| format!("`response_format`: {e}"))?;
        found.push(("response_format".into(), f));
    }
    if let Some(v) = given("structured_outputs") {
        let o = v.as_object().ok_or("`structured_outputs` must be an object")?;
        for (k, v) in o.iter().filter(|(_, v)| !v.is_null() && **v != Value::Bool(false)) {
            let at = format!("structured_outputs.{k}");
            if !VLLM_FORMATS.iter().any(|f| f.0 == k) {
                let known: Vec<&str> = VLLM_FORMATS.iter().map(|f| f.0).collect();
                return Err(format!("`{at}`: not a format gridlm takes ({})", known.join(", ")));
            }
            let f = Format::from_vllm(k, v).map_err(|e| format!("`{at}` {e}"))?;
            found.push((at, Some(f)));
        }
    }
    for (key, legacy) in VLLM_FORMATS.iter().filter_map(|&(k, l)| Some((k, l?))) {
        if let Some(v) = given(legacy) {
            found.push((
                legacy.into(),
                Some(Format::from_vllm(key, v).map_err(|e| format!("`{legacy}` {e}"))?),
            ));
        }
    }
    match found.len() {
        0 | 1 => Ok(found.pop().map(|f| f.1)),
        _ => {
            let names: Vec<String> = found.iter().map(|f| format!("`{}`", f.0)).collect();
            Err(format!("{} each ask for a format: give one", names.join(" and ")))
        }
    }
}

/// OpenAI's `logit_bias` object (token ids as strings, each with a bias from -100 to 100) as
/// (token, bias) pairs, or what is wrong with it.
pub fn logit_bias(
    obj: &serde_json::Map<String, serde_json::Value>,
) -> std::result::Result<Vec<(u32, f32)>, String> {
    let pair = |(k, v): (&String, &serde_json::Value)| {
        let t: u32 = k.trim().parse().map_err(|_| format!("the key {k:?} is not a token id"))?;
        let b = v.as_f64().ok_or_else(|| format!("the bias of token {t} is {v}, not a number"))?;
        if !(-MAX_LOGIT_BIAS as f64..=MAX_LOGIT_BIAS as f64).contains(&b) {
            return Err(format!("the bias of token {t} must be in [-100, 100], got {b}"));
        }
        Ok((t, b as f32))
    };
    let mut out: Vec<(u32, f32)> = obj.iter().map(pair).collect::<std::result::Result<_, String>>()?;
    out.sort_by_key(|p| p.0);
    if let Some(w) = out.windows(2).find(|w| w[0].0 == w[1].0) {
        return Err(format!("token {} is given twice", w[0].0));
    }
    Ok(out)
}

/// The sampling settings a JSON object gives (`temperature`, `top_k`, `top_p`, `min_p`,
/// `repetition_penalty`, `presence_penalty`, `frequency_penalty`, `seed`) over those of `p`,
/// checked.
pub(crate) fn sampling_fields(
    obj: &serde_json::Map<String, serde_json::Value>,
    p: &mut SamplingParams,
) -> std::result::Result<(), String> {
    p.temperature = field(obj, "temperature")?.unwrap_or(p.temperature);
    p.top_k = field(obj, "top_k")?.unwrap_or(p.top_k);
    p.top_p = field(obj, "top_p")?.unwrap_or(p.top_p);
    p.min_p = field(obj, "min_p")?.unwrap_or(p.min_p);
    p.repetition_penalty = field(obj, "repetition_penalty")?.unwrap_or(p.repetition_penalty);
    p.presence_penalty = field(obj, "presence_penalty")?.unwrap_or(p.presence_penalty);
    p.frequency_penalty = field(obj, "frequency_penalty")?.unwrap_or(p.frequency_penalty);
    p.seed = field(obj, "seed")?.unwrap_or(p.seed);
    // The check names a setting by its bare key first: here it is a JSON key.
    p.check().map_err(|e| format!("`{}", e.replacen(' ', "` ", 1)))
}

impl Defaults {
    /// The prompt on `line` (number `index` among the file's prompts; 0 and 0 for `--prompt`)
    /// with these settings; without an explicit seed, each prompt gets its own seed derived from
    /// the default one.
    pub fn spec(&self, line: usize, index: usize, text: String) -> PromptSpec {
        let mut params = self.params.clone();
        params.seed = self.params.seed.wrapping_add(index as u64);
        PromptSpec {
            line,
            id: None,
            text,
            messages: Vec::new(),
            max_tokens: self.max_tokens,
            ignore_eos: self.ignore_eos,
            chat: self.chat,
            system: self.system.clone(),
            template_vars: self.template_vars.clone(),
            stop: self.stop.clone(),
            keep_stop: self.keep_stop,
            skip_special: true,
            params,
            rules: self.rules.clone(),
            format: self.format.clone(),
            tools: None,
            embedding: false,
        }
    }
}

impl PromptSpec {
    /// The text the model reads: the prompt, or with `chat` the conversation through the
    /// model's chat template.
    pub fn rendered(&self, tok: &Tokenizer) -> Result<String> {
        if !self.chat {
            return Ok(self.text.clone());
        }
        if !self.messages.is_empty() {
            return tok.render_chat(&self.messages, &self.template_vars);
        }
        let system = self.system.as_deref().map(|s| ("system", s));
        let messages: Vec<(&str, &str)> = system.into_iter().chain([("user", self.text.as_str())]).collect();
        tok.render_chat(&messages, &self.template_vars)
    }
}

/// Reads a prompts file. JSONL when the name ends in `.jsonl` or the first non-blank line starts
/// with `{`: each non-blank line is an object with `prompt` (or a conversation, `messages`, as
/// OpenAI's chat requests give it: a chat) and optional `id`, `max_tokens`, `ignore_eos`,
/// `chat`, `system`, `chat_template_kwargs`, `stop` (string or list), `temperature`, `top_k`,
/// `top_p`, `min_p`, `repetition_penalty`, `presence_penalty`, `frequency_penalty`, `seed`,
/// `min_tokens`, `stop_token_ids`, `logit_bias`, `response_format` (or vLLM's
/// `structured_outputs`, `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`), or a
/// line of OpenAI's batch input (read as its request's body). Otherwise each non-blank line is
/// a prompt, with `\n` and `\\` as escapes. The path `-` reads standard input (under mpirun,
/// the first rank's, where the prompts are read). Errors name the file (or `stdin`) and line.
pub fn read_prompts(path: &Path, d: &Defaults) -> Result<Vec<PromptSpec>> {
    let (name, bytes) = if path == Path::new("-") {
        let mut bytes = Vec::new();
        std::io::Read::read_to_end(&mut std::io::stdin(), &mut bytes)
            .map_err(|e| Error::Input(format!("stdin: cannot read the prompts: {e}")))?;
        ("stdin".to_string(), bytes)
    } else {
        let name = path.display().to_string();
        let bytes = std::fs::read(path)
            .map_err(|e| Error::Input(format!("{name}: cannot read the prompts file: {e}")))?;
        (name, bytes)
    };
    let text = utf8_text(&name, bytes)?;
    // A byte-order mark, as Windows editors begin a UTF-8 file with, is no part of a prompt.
    let text = text.strip_prefix('\u{feff}').unwrap_or(&text);
    let lines: Vec<(usize, &str)> =
        text.lines().enumerate().map(|(i, l)| (i + 1, l)).filter(|(_, l)| !l.trim().is_empty()).collect();
    if lines.is_empty() {
        return Err(Error::Input(format!("{name}: the prompts file has no prompts")));
    }
    let jsonl = path.extension().is_some_and(|e| e == "jsonl") || lines[0].1.trim_start().starts_with('{');
    let mut out = Vec::with_capacity(lines.len());
    for (index, (n, l)) in lines.into_iter().enumerate() {
        if !jsonl {
            out.push(d.spec(n, index, unescape(l)));
            continue;
        }
        let at = |msg: String| Error::Input(format!("{name}:{n}: {msg}"));
        let obj: serde_json::Map<String, serde_json::Value> =
            serde_json::from_str(l).map_err(|e| at(format!("not a prompt object: {e}")))?;
        // OpenAI's batch input: the request's body, and whether it is a chat.
        let (obj, batch) = if obj.contains_key("body") {
            batch_request(obj).map(|(o, url)| (o, Some(url))).map_err(at)?
        } else {
            (obj, None)
        };
        if let Some(k) = obj.keys().find(|k| !line_key(k)) {
            let expected: Vec<&str> = KEYS.iter().chain(&ANSWER_KEYS).copied().collect();
            return Err(at(format!("unknown key `{k}` (expected {})", expected.join(", "))));
        }
        let messages = messages_field(&obj).map_err(at)?;
        let text: Option<String> = field(&obj, "prompt").map_err(at)?;
        let text = match (text, &messages) {
            (Some(_), Some(_)) => return Err(at("a line has a `prompt` or `messages`, not both".into())),
            (None, None) => return Err(at("no `prompt` (or `messages`)".into())),
            (text, _) => text.unwrap_or_default(),
        };
        let mut s = d.spec(n, index, text);
        s.id = obj.get("id").cloned();
        let get = |s: &mut PromptSpec| -> std::result::Result<(), String> {
            s.max_tokens = field(&obj, "max_tokens")?.unwrap_or(s.max_tokens);
            s.ignore_eos = field(&obj, "ignore_eos")?.unwrap_or(s.ignore_eos);
            s.chat = field(&obj, "chat")?.unwrap_or(s.chat);
            s.system = field(&obj, "system")?.or(s.system.take());
            template_vars_over(&mut s.template_vars, &obj)?;
            if let Some(stop) = stop_field(&obj)? {
                s.stop = stop;
            }
            answer_fields(&obj, (&mut s.keep_stop, &mut s.skip_special), &mut s.rules, &mut s.format)?;
            s.tools = Tools::read(&obj, d.tool_parser)?;
            if let Some(t) = &s.tools {
                t.held_format(&mut s.format, "`response_format`, `structured_outputs`, --response-format")?;
            }
            crate::tools::for_template(&mut s.template_vars, s.tools.as_ref().map_or(&[], |t| &t.list));
            sampling_fields(&obj, &mut s.params)
        };
        get(&mut s).map_err(at)?;
        if matches!(batch, Some(Endpoint::Completion | Endpoint::Embedding)) {
            // A completion request's prompt (an embeddings request's input) goes to the model as
            // it is.
            (s.chat, s.system) = (false, None);
        }
        s.embedding = batch == Some(Endpoint::Embedding);
        if s.stop.iter().any(String::is_empty) {
            return Err(at("a stop string is empty".into()));
        }
        if let Some(mut messages) = messages {
            if obj.contains_key("chat") && !s.chat {
                return Err(at("`messages` is a chat: `chat` false does not go with it".into()));
            }
            if obj.contains_key("system") {
                return Err(at("beside `messages`, the system message goes first in them".into()));
            }
            s.chat = true;
            // The command's --system, before a conversation without a system message.
            if let Some(system) = s.system.take().filter(|_| messages[0].role != "system") {
                messages.insert(0, Message::new("system", &system));
            }
            s.messages = messages;
        }
        if s.system.is_some() && !s.chat {
            return Err(at("a system message needs `chat` (it goes into the chat template)".into()));
        }
        if obj.contains_key("chat_template_kwargs") && !s.chat {
            return Err(at("`chat_template_kwargs` needs `chat` (they go into the chat template)".into()));
        }
        if s.tools.is_some() && !s.chat {
            return Err(at(
                "`tools` need a chat (`messages`, or `chat`: they go into the chat template)".into()
            ));
        }
        out.push(s);
    }
    Ok(out)
}

/// The endpoint a line of OpenAI's batch input asks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Endpoint {
    Chat,
    Completion,
    Embedding,
}

/// A line of OpenAI's batch input (`custom_id`, `method` POST, `url` `/v1/chat/completions`,
/// `/v1/completions` or `/v1/embeddings`, `body` the request) as the prompt line it asks for:
/// `custom_id` as `id`, the body's keys as a line's (`max_completion_tokens` as `max_tokens`;
/// an embeddings request's one text `input` as `prompt`; `model` and an `n` of 1 asking
/// nothing), and its endpoint.
fn batch_request(
    mut obj: serde_json::Map<String, serde_json::Value>,
) -> std::result::Result<(serde_json::Map<String, serde_json::Value>, Endpoint), String> {
    use serde_json::Value;
    const BATCH: [&str; 4] = ["custom_id", "method", "url", "body"];
    if let Some(k) = obj.keys().find(|k| !BATCH.contains(&k.as_str())) {
        return Err(format!("unknown key `{k}` of a batch request (expected {})", BATCH.join(", ")));
    }
    if let Some(m) = obj.get("method").filter(|m| m.as_str() != Some("POST")) {
        return Err(format!("`method` {m}: a batch request is a POST"));
    }
    let endpoint = match obj.get("url").and_then(Value::as_str) {
        Some("/v1/chat/completions") => Endpoint::Chat,
        Some("/v1/completions") => Endpoint::Completion,
        Some("/v1/embeddings") => Endpoint::Embedding,
        url => {
            let got = url.map_or_else(|| "is missing".to_string(), |u| format!("is {u}"));
            return Err(format!(
                "`url` {got}: a prompts file takes /v1/chat/completions, /v1/completions or /v1/embeddings"
            ));
        }
    };
    let chat = endpoint == Endpoint::Chat;
    let Some(Value::Object(mut body)) = obj.remove("body") else {
        return Err("`body` must be a request object".into());
    };
    body.remove("model");
    if endpoint == Endpoint::Embedding {
        // One text, its embedding in floats (generate --embed says how it is pooled and scaled).
        body.remove("user");
        if let Some(f) = body.remove("encoding_format").filter(|f| f != "float") {
            return Err(format!("`body.encoding_format` {f}: a prompts file's results give floats"));
        }
        match body.remove("input") {
            Some(Value::String(t)) => _ = body.insert("prompt".into(), Value::String(t)),
            Some(_) => return Err("`body.input`: a line's input is one text".into()),
            None => return Err("`body.input` is missing".into()),
        }
        if let Some(k) = body.keys().find(|k| *k != "prompt") {
            return Err(format!("`body.{k}`: an embeddings request's setting a prompts file does not take"));
        }
    }
    if let Some(n) = body.remove("n").filter(|n| n.as_u64() != Some(1)) {
        return Err(format!("`body.n` {n}: a line gives one completion"));
    }
    if let Some(max) = body.remove("max_completion_tokens") {
        body.entry("max_tokens").or_insert(max);
    }
    let chats = ["messages", "chat_template_kwargs", "tools", "tool_choice", "parallel_tool_calls"];
    if let Some(k) = chats.into_iter().find(|k| !chat && body.contains_key(*k)) {
        return Err(format!("`body.{k}` belongs to /v1/chat/completions"));
    }
    if chat && body.contains_key("prompt") {
        return Err("`body.prompt` belongs to /v1/completions".into());
    }
    if body.get("prompt").is_some_and(|p| !p.is_string()) {
        return Err("`body.prompt`: a line's prompt is one string".into());
    }
    let taken = |k: &str| line_key(k) && !matches!(k, "id" | "chat" | "system");
    if let Some(k) = body.keys().find(|k| !taken(k)) {
        return Err(format!("`body.{k}`: a request's setting a prompts file does not take"));
    }
    if let Some(id) = obj.remove("custom_id") {
        body.insert("id".into(), id);
    }
    Ok((body, endpoint))
}

/// The prompts file's `bytes` as text; else an error naming the line and byte that are not
/// UTF-8 (a file saved as Latin-1 or UTF-16, say).
fn utf8_text(name: &str, bytes: Vec<u8>) -> Result<String> {
    String::from_utf8(bytes).map_err(|e| {
        let at = e.utf8_error().valid_up_to();
        let bytes = e.as_bytes();
        let line = 1 + bytes[..at].iter().filter(|&&b| b == b'\n').count();
        Error::Input(format!(
            "{name}:{line}: not UTF-8 text (byte 0x{:02x} at offset {at}); save the prompts as UTF-8",
            bytes[at]
        ))
    })
}

/// The length of the longest proper start of `stop` that `text` ends with.
fn begun(text: &str, stop: &str) -> usize {
    (1..stop.len()).rev().find(|&k| stop.is_char_boundary(k) && text.ends_with(&stop[..k])).unwrap_or(0)
}

/// `\n` → newline, `\t` → tab, `\\` → backslash in a plain-text prompt line.
fn unescape(l: &str) -> String {
    let mut out = String::with_capacity(l.len());
    let mut chars = l.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('n') => out.push('\n'),
            Some('t') => out.push('\t'),
            Some('\\') => out.push('\\'),
            Some(o) => {
                out.push('\\');
                out.push(o);
            }
            None => out.push('\\'),
        }
    }
    out
}

/// What ended a completion before its end-of-sequence token or its length: a stop string or a
/// stop token (vLLM's `stop_reason`).
#[derive(Debug, Clone, PartialEq)]
pub enum StopBy {
    Text(String),
    Token(u32),
}

impl StopBy {
    /// As vLLM writes it: the string, or the token id.
    pub fn json(&self) -> serde_json::Value {
        match self {
            StopBy::Text(s) => serde_json::json!(s),
            StopBy::Token(t) => serde_json::json!(t),
        }
    }
}

/// The text of one completion as its tokens arrive, cut at the first stop string or before its
/// first stop token ([`TokenRules`]; no stop string ends it before its `min_tokens`), or after
/// them where the text keeps them (vLLM's `include_stop_str_in_output`). Text that may be the
/// start of a stop string is held back until the next tokens tell, so a stream never shows what
/// the cut takes away.
pub struct TextTracker {
    stream: StreamDecoder,
    text: String,
    stop: Vec<String>,
    stop_ids: Vec<u32>,
    /// The text keeps the stop string or token that ends it.
    keep_stop: bool,
    min_tokens: usize,
    /// Tokens pushed.
    tokens: usize,
    stopped: Option<StopBy>,
    /// Bytes of `text` handed out.
    shown: usize,
}

impl TextTracker {
    pub fn new(stop: Vec<String>, keep_stop: bool, rules: &TokenRules) -> Self {
        TextTracker {
            stream: StreamDecoder::default(),
            text: String::new(),
            stop,
            stop_ids: rules.stop_token_ids.clone(),
            keep_stop,
            min_tokens: rules.min_tokens,
            tokens: 0,
            stopped: None,
            shown: 0,
        }
    }

    /// The same, its text keeping the special tokens `ids` (a tool-call parser's tags), or
    /// with `all` every special token's.
    pub fn keeping(mut self, ids: Vec<u32>, all: bool) -> Self {
        self.stream = StreamDecoder::keeping(ids, all);
        self
    }

    /// Adds a token. Returns the new text to show (never past a stop string, nor the start of
    /// one that may still come) and whether the completion goes on.
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<(String, bool)> {
        if self.stopped.is_some() {
            return Ok((String::new(), false));
        }
        self.tokens += 1;
        if self.stop_ids.contains(&id) {
            // A stop token ends the completion and, as vLLM leaves it, is no part of its text
            // unless the text keeps it (it comes with the rest).
            if self.keep_stop {
                if let Some(piece) = self.stream.push(tok, id)? {
                    self.text.push_str(&piece);
                }
            }
            self.stopped = Some(StopBy::Token(id));
            return Ok((String::new(), false));
        }
        let Some(piece) = self.stream.push(tok, id)? else { return Ok((String::new(), true)) };
        let start = self.text.len();
        self.text.push_str(&piece);
        // Only a stop string ending in this piece: one begun at most its length less one before
        // it (one whole before it was looked for already, or came among the first
        // `min_tokens`, which no stop string ends). Not before the least number of tokens.
        let text = &self.text;
        let ending_here = |(k, s): (usize, &String)| {
            let mut from = start.saturating_sub(s.len().saturating_sub(1));
            while !text.is_char_boundary(from) {
                from += 1;
            }
            text[from..].find(s.as_str()).map(|i| (from + i, k))
        };
        let cut = self
            .stop
            .iter()
            .enumerate()
            .filter_map(ending_here)
            .min()
            .filter(|_| self.tokens > self.min_tokens);
        let upto = match cut {
            Some((at, k)) => {
                let s = &self.stop[k];
                let cut = if self.keep_stop { at + s.len() } else { at };
                self.stopped = Some(StopBy::Text(s.clone()));
                self.text.truncate(cut);
                cut
            }
            // Hold back the longest end of the text that begins a stop string.
            None => self.text.len() - self.stop.iter().map(|s| begun(&self.text, s)).max().unwrap_or(0),
        };
        let new = self.text.get(self.shown..upto).unwrap_or_default().to_string();
        self.shown = self.shown.max(upto);
        Ok((new, self.stopped.is_none()))
    }

    /// The text handed out by [`TextTracker::push`] so far.
    pub fn shown(&self) -> &str {
        &self.text[..self.shown]
    }

    /// The text not handed out: held back as the possible start of a stop string.
    pub fn held(&self) -> &str {
        &self.text[self.shown..]
    }

    pub fn stopped(&self) -> bool {
        self.stopped.is_some()
    }

    /// The stop string or token that ended the completion, if one did.
    pub fn stopped_by(&self) -> Option<&StopBy> {
        self.stopped.as_ref()
    }

    /// The text so far (cut at a stop string if one appeared).
    pub fn text(&self) -> &str {
        &self.text
    }

    /// The whole text of the tokens pushed, where it keeps special tokens' (which decoding
    /// the tokens again would leave out): the text so far and, unless a stop ended it, what
    /// its last tokens began; `None` where decoding the tokens gives it.
    pub fn kept_text(&self, tok: &Tokenizer) -> Result<Option<String>> {
        if !self.stream.keeps_special() {
            return Ok(None);
        }
        let rest = if self.stopped() { String::new() } else { self.stream.rest(tok)? };
        Ok(Some(format!("{}{rest}", self.text)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_started_part_of_a_stop_string_is_found() {
        assert_eq!(begun("1, 2, 3, 4, 5, ", " 6"), 1);
        assert_eq!(begun("one ends with</", "</end>"), 2);
        assert_eq!(begun("no start here", "</end>"), 0);
        // Whole stop strings are not held back (they cut), nor text past a partial character.
        assert_eq!(begun("ends with x", "x"), 0);
        assert_eq!(begun("café \u{e9}", "\u{e9}\u{e9}"), 2);
    }

    fn defaults() -> Defaults {
        Defaults {
            max_tokens: 16,
            ignore_eos: false,
            chat: false,
            system: None,
            template_vars: TemplateVars::new(),
            stop: vec![],
            keep_stop: false,
            params: SamplingParams { seed: 100, ..Default::default() },
            rules: TokenRules::default(),
            format: None,
            tool_parser: None,
        }
    }

    /// A byte-order mark is no part of the first prompt (nor keeps a JSONL file from being
    /// seen as one); bytes that are not UTF-8 are named by line.
    #[test]
    fn a_byte_order_mark_is_dropped_and_other_encodings_named() {
        let dir = tempfile::tempdir().unwrap();
        let plain = dir.path().join("p.txt");
        std::fs::write(&plain, "\u{feff}first\nsecond\n").unwrap();
        let p = read_prompts(&plain, &defaults()).unwrap();
        assert_eq!((p[0].text.as_str(), p[1].text.as_str()), ("first", "second"));
        let jl = dir.path().join("p.prompts");
        std::fs::write(&jl, "\u{feff}{\"prompt\":\"a\",\"max_tokens\":3}\n").unwrap();
        let p = read_prompts(&jl, &defaults()).unwrap();
        assert_eq!((p[0].text.as_str(), p[0].max_tokens), ("a", 3));
        let latin1 = dir.path().join("l.txt");
        std::fs::write(&latin1, b"tea\ncaf\xe9 au lait\n").unwrap();
        let err = read_prompts(&latin1, &defaults()).unwrap_err().to_string();
        assert!(
            err.ends_with("l.txt:2: not UTF-8 text (byte 0xe9 at offset 7); save the prompts as UTF-8"),
            "{err}"
        );
    }

    /// OpenAI's and vLLM's ways of asking for a format, one at a time; two at once, or a value
    /// of the wrong kind, named.
    #[test]
    fn formats_as_openai_and_vllm_ask_for_them() {
        let read = |text: &str| format_field(&serde_json::from_str(text).unwrap());
        assert_eq!(read(r#"{"prompt": "a"}"#), Ok(None));
        assert_eq!(read(r#"{"response_format": {"type": "text"}}"#), Ok(Some(None)));
        assert_eq!(
            read(r#"{"response_format": {"type": "json_object"}}"#),
            Ok(Some(Some(Format::JsonObject)))
        );
        let schema = serde_json::json!({"type": "integer"});
        for text in [
            r#"{"structured_outputs": {"json": {"type": "integer"}}}"#,
            r#"{"guided_json": "{\"type\": \"integer\"}"}"#,
        ] {
            assert_eq!(read(text), Ok(Some(Some(Format::JsonSchema(schema.clone())))), "{text}");
        }
        let choice = Format::Choice(vec!["a".into(), "b".into()]);
        assert_eq!(
            read(r#"{"guided_choice": ["a", "b"], "structured_outputs": null}"#),
            Ok(Some(Some(choice)))
        );
        let regex = r#"{"structured_outputs": {"regex": "[0-9]+", "json_object": false, "grammar": null}}"#;
        assert_eq!(read(regex), Ok(Some(Some(Format::Regex("[0-9]+".into())))));
        assert_eq!(
            read(r#"{"structured_outputs": {"json_object": true}}"#),
            Ok(Some(Some(Format::JsonObject)))
        );
        for (text, msg) in [
            (
                r#"{"response_format": {"type": "json_object"}, "guided_regex": "a"}"#,
                "`response_format` and `guided_regex` each ask for a format: give one",
            ),
            (r#"{"structured_outputs": {"regex": 3}}"#, "`structured_outputs.regex` must be a string"),
            (r#"{"structured_outputs": {"json": "[1]"}}"#, "`structured_outputs.json` must be a JSON schema"),
            (r#"{"structured_outputs": "json"}"#, "`structured_outputs` must be an object"),
            (
                r#"{"structured_outputs": {"xml": "a"}}"#,
                "`structured_outputs.xml`: not a format gridlm takes",
            ),
            (r#"{"guided_choice": "a"}"#, "`guided_choice` must be a non-empty list of strings"),
        ] {
            let e = read(text).unwrap_err();
            assert!(e.starts_with(msg), "{text}: {e}");
        }
    }

    #[test]
    fn plain_and_jsonl_files() {
        let dir = tempfile::tempdir().unwrap();
        let plain = dir.path().join("p.txt");
        std::fs::write(&plain, "first\n\n  \nsecond\\nline\n").unwrap();
        let p = read_prompts(&plain, &defaults()).unwrap();
        assert_eq!(p.len(), 2);
        assert_eq!((p[0].line, p[0].text.as_str(), p[0].params.seed), (1, "first", 100));
        assert_eq!((p[1].line, p[1].text.as_str(), p[1].params.seed), (4, "second\nline", 101));

        let jl = dir.path().join("p.jsonl");
        std::fs::write(
            &jl,
            "{\"prompt\":\"a\",\"max_tokens\":3,\"temperature\":0.7,\"top_k\":5,\"stop\":\"x\",\"id\":\"q1\"}\n{\"prompt\":\"b\",\"stop\":[\"y\",\"z\"],\"seed\":9}\n",
        )
        .unwrap();
        let p = read_prompts(&jl, &defaults()).unwrap();
        assert_eq!((p[0].max_tokens, p[0].params.top_k, p[0].stop.clone()), (3, 5, vec!["x".to_string()]));
        assert_eq!(p[0].id, Some(serde_json::json!("q1")));
        assert_eq!((p[1].max_tokens, p[1].params.seed, p[1].stop.len()), (16, 9, 2));

        std::fs::write(&jl, "{\"prompt\":\"a\"}\n{\"prompt\":\"b\",\"top_p\":2}\n").unwrap();
        let e = read_prompts(&jl, &defaults()).unwrap_err().to_string();
        assert!(e.contains("p.jsonl:2:") && e.contains("top_p"), "{e}");
        std::fs::write(&jl, "{\"prompt\":\"a\",\"top_k\":\"x\"}\n").unwrap();
        let e = read_prompts(&jl, &defaults()).unwrap_err().to_string();
        assert!(e.contains("p.jsonl:1:") && e.contains("`top_k`"), "{e}");
        std::fs::write(&jl, "{\"prompt\":\"a\",\"temprature\":1}\n").unwrap();
        let e = read_prompts(&jl, &defaults()).unwrap_err().to_string();
        assert!(e.contains("p.jsonl:1:") && e.contains("temprature"), "{e}");
        std::fs::write(&jl, "\n\n").unwrap();
        assert!(read_prompts(&jl, &defaults()).unwrap_err().to_string().contains("no prompts"));

        // A system message per line, or the default one; only with `chat`.
        let chat = Defaults { chat: true, system: Some("be brief".into()), ..defaults() };
        std::fs::write(&jl, "{\"prompt\":\"a\",\"system\":\"be kind\"}\n{\"prompt\":\"b\"}\n").unwrap();
        let p = read_prompts(&jl, &chat).unwrap();
        assert_eq!((p[0].system.as_deref(), p[1].system.as_deref()), (Some("be kind"), Some("be brief")));
        std::fs::write(&jl, "{\"prompt\":\"a\",\"system\":\"be kind\",\"chat\":false}\n").unwrap();
        let e = read_prompts(&jl, &chat).unwrap_err().to_string();
        assert!(e.contains("p.jsonl:1:") && e.contains("a system message needs `chat`"), "{e}");
    }

    /// A conversation's tools: to the template, the answer held to calls where the choice asks;
    /// what a line cannot do with them refused by name.
    #[test]
    fn lines_give_tools_to_conversations() {
        let dir = tempfile::tempdir().unwrap();
        let jl = dir.path().join("t.jsonl");
        let f = r#"{"type":"function","function":{"name":"f","parameters":{"type":"object"}}}"#;
        let line =
            |more: &str| format!(r#"{{"messages":[{{"role":"user","content":"a"}}],"tools":[{f}]{more}}}"#);
        std::fs::write(
            &jl,
            format!("{}\n{}\n", line(r#","tool_choice":"required""#), line(r#","tool_choice":"none""#)),
        )
        .unwrap();
        let p = read_prompts(&jl, &defaults()).unwrap();
        let t = p[0].tools.as_ref().unwrap();
        assert_eq!((&t.choice, p[0].format == t.format()), (&crate::tools::ToolChoice::Required, true));
        assert_eq!(
            p[0].template_vars["tools"],
            serde_json::json!([serde_json::from_str::<serde_json::Value>(f).unwrap()])
        );
        assert_eq!(
            (p[1].tools.as_ref().map(|t| &t.choice), &p[1].format),
            (Some(&crate::tools::ToolChoice::None), &None)
        );
        for (bad, want) in [
            (line(""), "t.jsonl:1: `tool_choice` auto (the default where `tools` are given)"),
            (
                line(r#","tool_choice":"required","response_format":{"type":"json_object"}"#),
                "t.jsonl:1: `tool_choice` holds the answer",
            ),
            (
                format!(r#"{{"prompt":"a","tools":[{f}],"tool_choice":"required"}}"#),
                "t.jsonl:1: `tools` need a chat",
            ),
            (
                format!(
                    r#"{{"custom_id":"c","method":"POST","url":"/v1/completions","body":{{"prompt":"a","tools":[{f}]}}}}"#
                ),
                "t.jsonl:1: `body.tools` belongs to /v1/chat/completions",
            ),
        ] {
            std::fs::write(&jl, bad).unwrap();
            let e = read_prompts(&jl, &defaults()).unwrap_err().to_string();
            assert!(e.contains(want), "{e}");
        }
        let hermes = Defaults { tool_parser: Some(crate::tools::Parser::Hermes), ..defaults() };
        std::fs::write(&jl, line("")).unwrap();
        assert_eq!(
            read_prompts(&jl, &hermes).unwrap()[0].tools.as_ref().map(|t| &t.choice),
            Some(&crate::tools::ToolChoice::Auto)
        );
    }

    /// OpenAI's batch input lines: the request's body as a line, its `custom_id` as the id, a
    /// completion's prompt as it is whatever the command says; what a line cannot do refused.
    #[test]
    fn openai_batch_input_lines() {
        let dir = tempfile::tempdir().unwrap();
        let jl = dir.path().join("batch.jsonl");
        let chat_line = r#"{"custom_id":"r1","method":"POST","url":"/v1/chat/completions","body":{"model":"m","messages":[{"role":"user","content":"a"}],"max_completion_tokens":5,"temperature":0.5,"seed":3}}"#;
        let text_line = r#"{"custom_id":"r2","method":"POST","url":"/v1/completions","body":{"model":"m","prompt":"b","max_tokens":4,"n":1,"stop":["x"]}}"#;
        std::fs::write(&jl, format!("{chat_line}\n{text_line}\n")).unwrap();
        let chat = Defaults { chat: true, system: Some("be brief".into()), ..defaults() };
        let p = read_prompts(&jl, &chat).unwrap();
        assert_eq!((p[0].id.clone(), p[0].chat, p[0].max_tokens), (Some(serde_json::json!("r1")), true, 5));
        assert_eq!((p[0].params.temperature, p[0].params.seed), (0.5, 3));
        assert_eq!(
            p[0].messages,
            [("system".to_string(), "be brief".to_string()), ("user".into(), "a".into())]
        );
        assert_eq!(
            (p[1].id.clone(), p[1].chat, p[1].system.clone()),
            (Some(serde_json::json!("r2")), false, None)
        );
        assert_eq!((p[1].text.as_str(), p[1].max_tokens, p[1].stop.clone()), ("b", 4, vec!["x".to_string()]));
        // An embeddings request: its input as the prompt, as it is.
        let embed_line = r#"{"custom_id":"e","method":"POST","url":"/v1/embeddings","body":{"model":"m","input":"c d","encoding_format":"float","user":"u"}}"#;
        std::fs::write(&jl, format!("{embed_line}\n")).unwrap();
        let p = read_prompts(&jl, &chat).unwrap();
        assert_eq!(
            (p[0].text.as_str(), p[0].chat, p[0].embedding, &p[0].id),
            ("c d", false, true, &Some(serde_json::json!("e")))
        );
        let line = |url: &str, body: &str| {
            format!(r#"{{"custom_id":"c","method":"POST","url":"{url}","body":{body}}}"#)
        };
        let (c, t) = ("/v1/chat/completions", "/v1/completions");
        for (line, want) in [
            (line("/v1/audio/speech", r#"{"input":"x"}"#), "`url` is /v1/audio/speech"),
            (line("/v1/embeddings", r#"{"input":["x","y"]}"#), "`body.input`: a line's input is one text"),
            (
                line("/v1/embeddings", r#"{"input":"x","dimensions":8}"#),
                "`body.dimensions`: an embeddings request's",
            ),
            (
                line("/v1/embeddings", r#"{"input":"x","encoding_format":"base64"}"#),
                "`body.encoding_format` \"base64\"",
            ),
            (line(t, r#"{"prompt":"x","n":2}"#), "`body.n` 2: a line gives one completion"),
            (line(t, r#"{"prompt":["x","y"]}"#), "`body.prompt`: a line's prompt is one string"),
            (line(t, r#"{"messages":[]}"#), "`body.messages` belongs to /v1/chat/completions"),
            (line(c, r#"{"prompt":"x"}"#), "`body.prompt` belongs to /v1/completions"),
            (line(c, r#"{"messages":[],"logprobs":true}"#), "`body.logprobs`: a request's setting"),
            (line(c, r#"{"messages":[],"system":"s"}"#), "`body.system`: a request's setting"),
            (line(c, "5"), "`body` must be a request object"),
            (
                r#"{"custom_id":"c","method":"GET","url":"/v1/completions","body":{}}"#.into(),
                "a batch request is a POST",
            ),
            (r#"{"custom_id":"c","body":{},"x":1}"#.into(), "unknown key `x` of a batch request"),
        ] {
            std::fs::write(&jl, format!("{line}\n")).unwrap();
            let e = read_prompts(&jl, &defaults()).unwrap_err().to_string();
            assert!(e.contains("batch.jsonl:1: ") && e.contains(want), "{line}: {e}");
        }
    }

    #[test]
    fn conversations_in_jsonl_files() {
        let dir = tempfile::tempdir().unwrap();
        let jl = dir.path().join("c.jsonl");
        let read = |text: &str, d: &Defaults| {
            std::fs::write(&jl, text).unwrap();
            read_prompts(&jl, d).map_err(|e| e.to_string())
        };
        let turns = r#"[{"role":"user","content":"a"},{"role":"assistant","content":[{"type":"text","text":"b"}]},{"role":"user","content":"c"}]"#;
        let owned = |m: &[(&str, &str)]| -> Vec<(String, String)> {
            m.iter().map(|(r, c)| (r.to_string(), c.to_string())).collect()
        };
        // A conversation is a chat, with or without --chat; the command's system message goes
        // first where it has none of its own.
        let p = read(&format!("{{\"messages\":{turns},\"max_tokens\":3}}\n"), &defaults()).unwrap();
        assert!(p[0].chat);
        assert_eq!(p[0].messages, owned(&[("user", "a"), ("assistant", "b"), ("user", "c")]));
        let chat = Defaults { chat: true, system: Some("be brief".into()), ..defaults() };
        let own = r#"{"messages":[{"role":"system","content":"s"},{"role":"user","content":"a"}]}"#;
        let p = read(&format!("{{\"messages\":{turns}}}\n{own}\n{{\"prompt\":\"q\"}}\n"), &chat).unwrap();
        assert_eq!(p[0].messages[0], ("system".to_string(), "be brief".to_string()));
        assert_eq!(p[0].messages.len(), 4);
        assert_eq!(p[1].messages, owned(&[("system", "s"), ("user", "a")]));
        assert_eq!((p[1].system.as_deref(), p[2].system.as_deref()), (None, Some("be brief")));
        assert!(p[2].messages.is_empty());
        // Template variables: the command's, a line's over them.
        let thinking = Defaults {
            template_vars: serde_json::from_value(serde_json::json!({"enable_thinking": true, "x": 1}))
                .unwrap(),
            ..chat.clone()
        };
        let off = r#"{"prompt":"q","chat_template_kwargs":{"enable_thinking":false}}"#;
        let p = read(&format!("{off}\n{{\"prompt\":\"q\"}}\n"), &thinking).unwrap();
        let vars = |i: usize| serde_json::Value::Object(p[i].template_vars.clone());
        assert_eq!(vars(0), serde_json::json!({"enable_thinking": false, "x": 1}));
        assert_eq!(vars(1), serde_json::json!({"enable_thinking": true, "x": 1}));
        for (line, want) in [
            (
                r#"{"prompt":"q","chat_template_kwargs":{"add_generation_prompt":false}}"#.into(),
                "is set by gridlm",
            ),
            (r#"{"prompt":"q","chat_template_kwargs":"x"}"#.into(), "`chat_template_kwargs`: invalid type"),
            (r#"{"prompt":"q","chat_template_kwargs":{}}"#.into(), "`chat_template_kwargs` needs `chat`"),
            (format!(r#"{{"messages":{turns},"prompt":"a"}}"#), "a `prompt` or `messages`, not both"),
            (format!(r#"{{"messages":{turns},"chat":false}}"#), "`chat` false does not go with it"),
            (format!(r#"{{"messages":{turns},"system":"s"}}"#), "the system message goes first in them"),
            (r#"{"messages":[]}"#.into(), "`messages` is empty"),
            (r#"{"messages":[{"content":"a"}]}"#.into(), "`messages[0]` has no `role`"),
            (r#"{"messages":"hi"}"#.into(), "`messages`: invalid type"),
            (r#"{"max_tokens":3}"#.into(), "no `prompt` (or `messages`)"),
        ] {
            let e = read(&format!("{line}\n"), &defaults()).unwrap_err();
            assert!(e.contains("c.jsonl:1: ") && e.contains(want), "{line}: {e}");
        }
    }
}
