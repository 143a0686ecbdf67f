//! `gridlm serve`: OpenAI-style completions over HTTP, run by the scheduler as they come
//! (continuous batching: a request joins the running batch at its next step).
//!
//! Threads: on the driver, an HTTP listener and a thread per request read, check and tokenize
//! requests and write the answers; they never call MPI. The driver's main thread runs the
//! scheduler ([`Engine::drive`](crate::engine::Engine::drive)) with [`Served`] as its traffic:
//! requests reach it over a channel, and each token's text goes back over the request's own
//! channel, so a streamed answer shows each piece as its step ends. While no request runs or
//! waits, the other ranks sleep ([`crate::comm::Link::sleep_until_woken`]).

use crate::embeddings;
use crate::engine::sampling::{SamplingParams, TokenRules};
use crate::engine::{
    check_prompt, Completion, Finish, Pooling, Request, TokenLogprobs, Traffic, MAX_LOGPROBS,
};
use crate::error::Result;
use crate::grammar::{Format, Grammars};
use crate::http;
use crate::prompts::{
    answer_fields, field, messages_field, sampling_fields, stop_field, template_vars_over, StopBy,
    TextTracker, ANSWER_KEYS,
};
use crate::tokenizer::{ChatEnd, Message, TemplateVars, Tokenizer};
use crate::tools::{self, Piece, Reader, Tools};
use serde_json::{json, Map, Value};
use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// The three endpoints that generate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `/v1/completions`: a prompt text, continued as it is.
    Completion,
    /// `/v1/chat/completions`: messages, through the model's chat template.
    Chat,
    /// `/v1/responses` (OpenAI's Responses API): `input` and `instructions`, read as the chat
    /// they make; one answer, as a response object.
    Response,
}

/// What a request asks for, checked.
#[derive(Debug, Clone, PartialEq)]
pub struct Ask {
    pub kind: Kind,
    /// The prompt texts (completions: one, or a list), or their tokens (completions: a list
    /// of token ids, or a list of such lists), or the messages (chat).
    pub prompts: Vec<String>,
    pub token_prompts: Vec<Vec<u32>>,
    pub messages: Vec<Message>,
    /// Chat and Responses: the tools the answer may call (`tools`, `tool_choice`,
    /// `parallel_tool_calls`).
    pub tools: Option<Tools>,
    /// Chat: further variables of the chat template (`chat_template_kwargs`, over the
    /// server's).
    pub template_vars: TemplateVars,
    /// Chat: how the rendered conversation ends (`add_generation_prompt`,
    /// `continue_final_message`).
    pub chat_end: ChatEnd,
    /// Completions of each prompt (`n`); the `j`-th samples with seed + `j`.
    pub n: usize,
    pub max_tokens: usize,
    pub ignore_eos: bool,
    pub stop: Vec<String>,
    /// The text keeps the stop string or token that ends it (`include_stop_str_in_output`).
    pub keep_stop: bool,
    /// The text leaves out special tokens (`skip_special_tokens`, true unless false).
    pub skip_special: bool,
    pub params: SamplingParams,
    /// Logit biases, stop tokens and least number of tokens.
    pub rules: TokenRules,
    /// What the answer must be (`response_format`; structured output).
    pub format: Option<Format>,
    pub stream: bool,
    /// Streamed: a last chunk with the token counts (`stream_options.include_usage`).
    pub stream_usage: bool,
    /// Each token's log-probability, with this many alternatives' (completions: `logprobs`;
    /// chat: `logprobs` true, `top_logprobs`).
    pub logprobs: Option<usize>,
    /// Completions: the answer's text begins with the prompt's (and its log-probabilities
    /// with the prompt's tokens').
    pub echo: bool,
}

/// Settings a request starts from: the server's command line.
#[derive(Debug, Clone)]
pub struct Defaults {
    pub max_tokens: usize,
    /// Further variables of the chat template (`--chat-template-kwargs`).
    pub template_vars: TemplateVars,
    /// The seed of request `n` without its own is `params.seed + n`.
    pub params: SamplingParams,
    /// How calls are read from an answer that may call tools or not (`--tool-call-parser`).
    pub tool_parser: Option<tools::Parser>,
    /// How embeddings are pooled (`--pooling`, or as the model folder says), or why the
    /// folder's way is not one gridlm has.
    pub pooling: std::result::Result<Pooling, String>,
}

/// Keys a request may have.
const KEYS: [&str; 25] = [
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "ignore_eos",
    "n",
    "user",
    "presence_penalty",
    "frequency_penalty",
    "logprobs",
    "echo",
    "top_logprobs",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
];

/// A chat request's keys of tool calling ([`Tools::read`]).
const TOOL_KEYS: [&str; 3] = ["tools", "tool_choice", "parallel_tool_calls"];

/// Whether a setting's value asks for nothing beyond a request without it.
type AsksNothing = fn(&Value) -> bool;

/// OpenAI's request keys gridlm does not act on, each with whether a value asks for nothing
/// beyond what a request without it gets (null, an empty list or object, the default): such
/// a value is taken, as clients send them unasked; any other is refused by name, as something
/// gridlm does not do rather than an unknown key.
const OPENAI_NOT_TAKEN: [(&str, AsksNothing); 12] = [
    ("tools", |v| v.as_array().is_some_and(Vec::is_empty)),
    ("functions", |v| v.as_array().is_some_and(Vec::is_empty)),
    ("tool_choice", |v| v.as_str() == Some("none")),
    ("function_call", |v| v.as_str() == Some("none")),
    ("parallel_tool_calls", Value::is_boolean),
    ("store", |v| v.as_bool() == Some(false)),
    ("metadata", Value::is_object),
    ("service_tier", |v| matches!(v.as_str(), Some("auto" | "default"))),
    ("best_of", |v| v.as_u64() == Some(1)),
    ("suffix", |v| v.as_str() == Some("")),
    ("modalities", |v| v.as_array().is_some_and(|m| m.iter().all(|m| m == "text"))),
    ("prediction", |_| false),
];

/// The most completions one request may ask for (its prompts × `n`).
pub const MAX_CHOICES: usize = 64;

/// Reads and checks a request body of endpoint `kind`; `n` numbers the request (for its
/// default seed). The error says what is wrong, naming the key.
pub fn parse(kind: Kind, body: &[u8], d: &Defaults, n: u64) -> std::result::Result<Ask, String> {
    let obj: Map<String, Value> =
        serde_json::from_slice(body).map_err(|e| format!("the body is not a JSON object: {e}"))?;
    let obj = if kind == Kind::Response { response_as_chat(obj)? } else { obj };
    let tool_key = |k: &str| kind != Kind::Completion && TOOL_KEYS.contains(&k);
    let known = |k: &str| KEYS.contains(&k) || ANSWER_KEYS.contains(&k) || tool_key(k);
    for (k, v) in obj.iter().filter(|(k, _)| !known(k)) {
        match OPENAI_NOT_TAKEN.iter().find(|(name, _)| name == k) {
            None => return Err(format!("unknown key `{k}`")),
            Some((_, neutral)) if !v.is_null() && !neutral(v) => {
                // The value as sent, cut short (a list of tools can be long).
                let mut got = v.to_string();
                if let Some((at, _)) = got.char_indices().nth(60) {
                    got.replace_range(at.., "…");
                }
                return Err(format!("`{k}`: OpenAI's setting, which gridlm does not support (got {got})"));
            }
            Some(_) => {}
        }
    }
    let mut ask = Ask {
        kind,
        prompts: Vec::new(),
        token_prompts: Vec::new(),
        messages: Vec::new(),
        template_vars: d.template_vars.clone(),
        tools: None,
        chat_end: ChatEnd::Answer,
        n: 1,
        max_tokens: d.max_tokens,
        ignore_eos: false,
        stop: Vec::new(),
        keep_stop: false,
        skip_special: true,
        params: SamplingParams { seed: d.params.seed.wrapping_add(n), ..d.params.clone() },
        rules: TokenRules::default(),
        format: None,
        stream: false,
        stream_usage: false,
        logprobs: None,
        echo: false,
    };
    match kind {
        Kind::Completion => {
            for key in ["messages", "chat_template_kwargs", "add_generation_prompt", "continue_final_message"]
            {
                if obj.contains_key(key) {
                    let msg = "belongs to /v1/chat/completions; here the prompt is `prompt`";
                    return Err(format!("`{key}` {msg}"));
                }
            }
            // Token ids: a non-empty list of numbers that fit a u32.
            let ids = |v: &Value| -> Option<Vec<u32>> {
                let a = v.as_array().filter(|a| !a.is_empty())?;
                a.iter().map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok())).collect()
            };
            match obj.get("prompt") {
                Some(Value::String(s)) => ask.prompts = vec![s.clone()],
                Some(Value::Array(a)) if !a.is_empty() && a.iter().all(Value::is_string) => {
                    ask.prompts = a.iter().filter_map(|p| p.as_str().map(String::from)).collect()
                }
                Some(v) if ids(v).is_some() => ask.token_prompts = ids(v).into_iter().collect(),
                Some(Value::Array(a)) if !a.is_empty() && a.iter().all(|p| ids(p).is_some()) => {
                    ask.token_prompts = a.iter().filter_map(ids).collect()
                }
                Some(_) => {
                    return Err("`prompt` must be a string, a list of strings, a list of token ids or a list of such lists".into())
                }
                None => return Err("no `prompt`".into()),
            }
        }
        Kind::Chat | Kind::Response => {
            if obj.contains_key("prompt") {
                return Err("`prompt` belongs to /v1/completions; here the conversation is `messages`".into());
            }
            ask.messages = messages_field(&obj)?.ok_or("no `messages`")?;
            // vLLM's key, which clients send (`extra_body`) to turn a template's thinking off.
            template_vars_over(&mut ask.template_vars, &obj)?;
            ask.chat_end = chat_end_field(&obj)?;
            // A Responses API request's tools, in the chat's form here, are named in its own.
            let named = |e: String| if kind == Kind::Response { e.replace(".function.", ".") } else { e };
            ask.tools = Tools::read(&obj, d.tool_parser).map_err(named)?;
            tools::for_template(&mut ask.template_vars, ask.tools.as_ref().map_or(&[], |t| &t.list));
        }
    }
    let max: Option<usize> = field(&obj, "max_tokens")?;
    let max = max.or(field(&obj, "max_completion_tokens")?);
    ask.max_tokens = max.unwrap_or(ask.max_tokens);
    ask.echo = field(&obj, "echo")?.unwrap_or(false);
    if ask.echo && kind != Kind::Completion {
        return Err("`echo` belongs to /v1/completions".into());
    }
    if ask.max_tokens == 0 && !ask.echo {
        return Err("`max_tokens` must be at least 1 (0 only with `echo`)".into());
    }
    ask.ignore_eos = field(&obj, "ignore_eos")?.unwrap_or(false);
    ask.stream = field(&obj, "stream")?.unwrap_or(false);
    if let Some(o) = field::<Map<String, Value>>(&obj, "stream_options")? {
        ask.stream_usage =
            field(&o, "include_usage").map_err(|e| format!("`stream_options`: {e}"))?.unwrap_or(false);
    }
    ask.stop = stop_field(&obj)?.unwrap_or_default();
    if ask.stop.iter().any(String::is_empty) {
        return Err("`stop`: a stop string is empty".into());
    }
    sampling_fields(&obj, &mut ask.params)?;
    answer_fields(&obj, (&mut ask.keep_stop, &mut ask.skip_special), &mut ask.rules, &mut ask.format)?;
    if let Some(t) = &ask.tools {
        t.held_format(&mut ask.format, "`response_format`, `text.format`, `structured_outputs`")?;
    }
    // Settings gridlm does not carry out are refused unless they ask for nothing.
    ask.n = field::<usize>(&obj, "n")?.unwrap_or(1);
    let prompts = (ask.prompts.len() + ask.token_prompts.len()).max(1);
    if ask.n == 0 || ask.n * prompts > MAX_CHOICES {
        return Err(format!(
            "`n`: from 1 to {MAX_CHOICES} completions a request (prompts × n), got {prompts} × {}",
            ask.n
        ));
    }
    let top: Option<usize> = field(&obj, "top_logprobs")?;
    let (key, n) = match kind {
        Kind::Completion => {
            if top.is_some() {
                return Err("`top_logprobs` belongs to /v1/chat/completions; here `logprobs` is the number of alternatives".into());
            }
            ask.logprobs = field(&obj, "logprobs")?;
            ("logprobs", ask.logprobs)
        }
        Kind::Chat | Kind::Response => {
            let on: bool = field(&obj, "logprobs")?.unwrap_or(false);
            if top.is_some() && !on {
                return Err("`top_logprobs` needs `logprobs`: true".into());
            }
            ask.logprobs = on.then_some(top.unwrap_or(0));
            ("top_logprobs", top)
        }
    };
    if let Some(n) = n.filter(|&n| n > MAX_LOGPROBS) {
        return Err(format!("`{key}`: at most {MAX_LOGPROBS} alternatives a token, got {n}"));
    }
    Ok(ask)
}

/// A `/v1/responses` request (OpenAI's Responses API) as the chat request it asks for:
/// `input` (a text, or a list of messages whose content is a text or `input_text` and
/// `output_text` parts, answers' `function_call` items and tools' `function_call_output` items)
/// as `messages`, after `instructions` as the system message; `max_output_tokens` as
/// `max_tokens`; `text.format` as `response_format`; function tools in the chat's form. What a response
/// would need kept (`previous_response_id`, `conversation`, `background`) or gridlm does not
/// give (reasoning, log-probabilities, other input items) is refused by name; `store` and
/// `metadata` are taken (nothing is kept: the answer says `"store": false`).
fn response_as_chat(mut obj: Map<String, Value>) -> std::result::Result<Map<String, Value>, String> {
    const CHATS: [&str; 9] = [
        "messages",
        "prompt",
        "n",
        "max_tokens",
        "max_completion_tokens",
        "response_format",
        "echo",
        "logprobs",
        "stop",
    ];
    for key in CHATS {
        if obj.contains_key(key) {
            return Err(format!("`{key}` is no key of /v1/responses (its input is `input`)"));
        }
    }
    let given = |obj: &Map<String, Value>, k: &str| obj.get(k).filter(|v| !v.is_null()).cloned();
    for key in ["previous_response_id", "conversation"] {
        if let Some(v) = given(&obj, key) {
            return Err(format!(
                "`{key}` {v}: gridlm keeps no responses; send the whole conversation in `input`"
            ));
        }
    }
    let nothing = |v: &Value| match v {
        Value::Bool(b) => !b,
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.values().all(Value::is_null),
        Value::Number(n) => n.as_u64() == Some(0),
        Value::String(s) => s == "disabled",
        Value::Null => true,
    };
    for key in ["background", "reasoning", "include", "top_logprobs", "truncation", "max_tool_calls"] {
        if let Some(v) = obj.remove(key).filter(|v| !nothing(v)) {
            return Err(format!("`{key}`: OpenAI's setting, which gridlm does not support (got {v})"));
        }
    }
    for key in ["store", "metadata", "prompt_cache_key", "safety_identifier", "stream_options"] {
        obj.remove(key);
    }
    let part = |p: &Value| match (p.get("type").and_then(Value::as_str), p.get("text")) {
        (Some("input_text" | "output_text" | "text"), Some(t)) => Ok(json!({"type": "text", "text": t})),
        (kind, _) => Err(format!("a content part of type {} (only text is read)", kind.unwrap_or("(none)"))),
    };
    tools::chat_form_of_responses(&mut obj)?;
    let mut messages: Vec<Value> = Vec::new();
    if let Some(i) = obj.remove("instructions").filter(|v| !v.is_null()) {
        messages.push(json!({"role": "system", "content": i}));
    }
    match obj.remove("input") {
        Some(Value::String(t)) => messages.push(json!({"role": "user", "content": t})),
        Some(Value::Array(items)) if !items.is_empty() => {
            for (i, item) in items.iter().enumerate() {
                let at = |e: String| format!("`input[{i}]`: {e}");
                let text = |k: &str| {
                    item.get(k).and_then(Value::as_str).ok_or_else(|| at(format!("`{k}` is missing")))
                };
                match item.get("type").and_then(Value::as_str) {
                    None | Some("message") => {}
                    Some("function_call") => {
                        // An answer's call: the assistant's message it follows (its text), or one
                        // of its own.
                        let (call_id, name, arguments) =
                            (text("call_id")?, text("name")?, text("arguments")?);
                        if let Err(e) = serde_json::from_str::<Value>(arguments) {
                            return Err(at(format!("`arguments` is not JSON: {e}")));
                        }
                        let call = json!({"id": call_id, "type": "function",
                            "function": {"name": name, "arguments": arguments}});
                        match messages.last_mut().and_then(Value::as_object_mut) {
                            Some(m) if m.get("role").and_then(Value::as_str) == Some("assistant") => {
                                let calls = m.entry("tool_calls").or_insert_with(|| json!([]));
                                if let Some(calls) = calls.as_array_mut() {
                                    calls.push(call);
                                }
                            }
                            _ => messages
                                .push(json!({"role": "assistant", "content": null, "tool_calls": [call]})),
                        }
                        continue;
                    }
                    Some("function_call_output") => {
                        let call_id = text("call_id")?;
                        let content = match item.get("output") {
                            Some(Value::String(t)) => json!(t),
                            Some(Value::Array(parts)) => Value::Array(
                                parts.iter().map(part).collect::<std::result::Result<_, _>>().map_err(at)?,
                            ),
                            _ => return Err(at("`output` must be a string or a list of text parts".into())),
                        };
                        messages.push(json!({"role": "tool", "tool_call_id": call_id, "content": content}));
                        continue;
                    }
                    Some(t) => {
                        return Err(at(format!(
                            "an item of type {t} (messages, function_call and function_call_output are read)"
                        )))
                    }
                }
                let role = match item.get("role").and_then(Value::as_str) {
                    Some("developer") => "system",
                    Some(r @ ("system" | "user" | "assistant")) => r,
                    r => {
                        return Err(at(format!(
                            "role {} (system, developer, user or assistant)",
                            r.unwrap_or("missing")
                        )))
                    }
                };
                let content = match item.get("content") {
                    Some(Value::String(t)) => json!(t),
                    Some(Value::Array(parts)) => Value::Array(
                        parts.iter().map(part).collect::<std::result::Result<_, _>>().map_err(at)?,
                    ),
                    _ => return Err(at("`content` must be a string or a list of text parts".into())),
                };
                messages.push(json!({"role": role, "content": content}));
            }
        }
        _ => return Err("`input` must be a string or a non-empty list of messages".into()),
    }
    obj.insert("messages".into(), Value::Array(messages));
    if let Some(m) = obj.remove("max_output_tokens") {
        obj.insert("max_tokens".into(), m);
    }
    if let Some(text) = obj.remove("text").filter(|v| !v.is_null()) {
        let t = text.as_object().ok_or("`text` must be an object")?;
        if let Some(k) = t.keys().find(|k| !matches!(k.as_str(), "format" | "verbosity")) {
            return Err(format!("`text.{k}`: not a setting of the text"));
        }
        if let Some(f) = t.get("format").filter(|v| !v.is_null()) {
            // The chat's form: a schema's name, schema and strictness inside `json_schema`.
            let chat_format = match f.get("type").and_then(Value::as_str) {
                Some("json_schema") => {
                    let inner: Map<String, Value> = ["name", "schema", "strict", "description"]
                        .iter()
                        .filter_map(|k| f.get(*k).map(|v| (k.to_string(), v.clone())))
                        .collect();
                    json!({"type": "json_schema", "json_schema": inner})
                }
                _ => f.clone(),
            };
            // Named as this request names it.
            let named =
                |e: String| format!("`text.format`: {}", e.replace("`json_schema.schema`", "`schema`"));
            crate::grammar::Format::from_response_format(&chat_format).map_err(named)?;
            obj.insert("response_format".into(), chat_format);
        }
    }
    Ok(obj)
}

/// A request on its way to the driver: what the scheduler runs, its stop strings, and where
/// its text goes.
pub struct Incoming {
    pub request: Request,
    pub stop: Vec<String>,
    /// The text keeps the stop string or token that ends it.
    pub keep_stop: bool,
    /// Special tokens the text keeps: the tags of the tool-call parser that reads it; or all
    /// of them (`skip_special_tokens` false).
    pub keep_special: (Vec<u32>, bool),
    /// Which of its HTTP request's completions it is (its events carry it).
    pub choice: usize,
    pub reply: Sender<(usize, Event)>,
    /// Upgradable while its HTTP thread waits for its events (not: the client went away).
    pub listener: Weak<()>,
}

/// Tokens and their log-probabilities (where the request asked for them), in order.
pub type Logprobs = Vec<(u32, TokenLogprobs)>;

/// What the driver tells a request's thread.
#[derive(Debug)]
pub enum Event {
    /// The prompt's log-probabilities (of its tokens after the first), before any text, where
    /// the request echoes its prompt with log-probabilities.
    Prompt(Vec<TokenLogprobs>),
    /// New text (never past a stop string), and the log-probabilities of the tokens since the
    /// last text.
    Text(String, Logprobs),
    /// The request is over: the rest of its text (what the last tokens completed) and its
    /// tokens' log-probabilities not sent yet, why it ended (and the stop string or token that
    /// ended it), its error if it could not run, how many tokens it brought, cached and
    /// drafted, and its prompt's embedding where it asked for that.
    Done {
        rest: String,
        logprobs: Logprobs,
        finish: Finish,
        stop_by: Option<StopBy>,
        error: Option<String>,
        tokens: usize,
        counts: Counts,
        embedding: Option<Vec<f32>>,
    },
}

/// A request the driver runs: its text so far and its thread's channel.
struct Client {
    tracker: TextTracker,
    choice: usize,
    reply: Sender<(usize, Event)>,
    listener: Weak<()>,
    /// The text could not be made (the request then stops with this error).
    error: Option<String>,
    /// Log-probabilities of the tokens since the last text sent.
    pending: Logprobs,
}

/// The driver's traffic while serving: requests from the HTTP threads, text back to them.
pub struct Served {
    rx: Receiver<Incoming>,
    tok: Arc<Tokenizer>,
    clients: HashMap<usize, Client>,
    next: usize,
    /// Opens the server to requests: called once, when the scheduler first asks for them (every
    /// rank's KV pool is in place then, so the first request does not wait for it).
    open: Option<Box<dyn FnOnce() -> std::io::Result<()>>>,
}

impl Served {
    pub fn new(
        rx: Receiver<Incoming>,
        tok: Arc<Tokenizer>,
        open: Box<dyn FnOnce() -> std::io::Result<()>>,
    ) -> Self {
        Served { rx, tok, clients: HashMap::new(), next: 0, open: Some(open) }
    }

    fn take(&mut self, inc: Incoming, into: &mut Vec<Request>) {
        let client = Client {
            tracker: TextTracker::new(inc.stop, inc.keep_stop, &inc.request.rules)
                .keeping(inc.keep_special.0, inc.keep_special.1),
            choice: inc.choice,
            reply: inc.reply,
            listener: inc.listener,
            error: None,
            pending: Vec::new(),
        };
        self.clients.insert(self.next, client);
        self.next += 1;
        into.push(inc.request);
    }
}

impl Traffic for Served {
    fn arrivals(&mut self, wait: bool, into: &mut Vec<Request>) -> Result<bool> {
        if let Some(open) = self.open.take() {
            open().map_err(|e| crate::Error::Input(format!("serve: cannot announce the server: {e}")))?;
        }
        if wait {
            match self.rx.recv() {
                Ok(inc) => self.take(inc, into),
                Err(_) => return Ok(false),
            }
        }
        loop {
            match self.rx.try_recv() {
                Ok(inc) => self.take(inc, into),
                Err(TryRecvError::Empty) => return Ok(true),
                Err(TryRecvError::Disconnected) => return Ok(false),
            }
        }
    }

    fn abandoned(&self, key: usize) -> bool {
        self.clients.get(&key).is_some_and(|c| c.listener.strong_count() == 0)
    }

    fn token(&mut self, key: usize, token: u32, logprobs: Option<&TokenLogprobs>) -> Result<bool> {
        let Some(c) = self.clients.get_mut(&key) else { return Ok(false) };
        if let Some(lp) = logprobs {
            c.pending.push((token, lp.clone()));
        }
        match c.tracker.push(&self.tok, token) {
            // The thread is gone (its client hung up): stop.
            Ok((piece, go_on)) => {
                let sent = piece.is_empty()
                    || c.reply.send((c.choice, Event::Text(piece, std::mem::take(&mut c.pending)))).is_ok();
                Ok(go_on && sent)
            }
            Err(e) => {
                c.error = Some(e.to_string());
                Ok(false)
            }
        }
    }

    fn prompt_scored(&mut self, key: usize, logprobs: &[TokenLogprobs]) -> Result<()> {
        if let Some(c) = self.clients.get(&key) {
            // A thread gone stops the request at its next token.
            let _ = c.reply.send((c.choice, Event::Prompt(logprobs.to_vec())));
        }
        Ok(())
    }

    fn done(&mut self, key: usize, completion: Completion) -> Result<()> {
        let Some(c) = self.clients.remove(&key) else { return Ok(()) };
        // The whole text as `generate` gives it; what the stream has not shown yet follows.
        let (shown, held) = (c.tracker.shown(), c.tracker.held());
        let rest = if c.tracker.stopped() || c.error.is_some() {
            held.to_string()
        } else {
            let all = match c.tracker.kept_text(&self.tok) {
                Ok(Some(kept)) => Ok(kept),
                _ => self.tok.decode(&completion.token_ids),
            };
            match all {
                Ok(all) => all.strip_prefix(shown).unwrap_or(held).to_string(),
                Err(_) => held.to_string(),
            }
        };
        let error = completion.error.or(c.error);
        let finish = if error.is_some() { Finish::Error } else { completion.finish };
        let tokens = completion.token_ids.len();
        let counts = Counts {
            cached: completion.cached_tokens,
            drafted: completion.drafted,
            accepted: completion.accepted,
        };
        let stop_by = c.tracker.stopped_by().cloned();
        let embedding = completion.embedding;
        let done =
            Event::Done { rest, logprobs: c.pending, finish, stop_by, error, tokens, counts, embedding };
        let _ = c.reply.send((c.choice, done));
        Ok(())
    }
}

/// OpenAI's `finish_reason` for a finish.
pub fn finish_reason(f: Finish) -> &'static str {
    match f {
        Finish::Eos | Finish::Stop => "stop",
        Finish::Length | Finish::Context => "length",
        Finish::Error => "error",
    }
}

/// What every request thread shares.
pub struct Front {
    pub tok: Arc<Tokenizer>,
    /// The model's name, as `/v1/models` lists it and answers carry it.
    pub model: String,
    pub context: usize,
    /// Tokens in the model's vocabulary (a prompt of token ids is checked against it).
    pub vocab: usize,
    /// The vocabulary as the grammar engine reads it (structured output), or why it cannot.
    pub grammars: std::result::Result<Arc<Grammars>, String>,
    pub defaults: Defaults,
    pub tx: Sender<Incoming>,
    /// Requests so far (for ids and default seeds).
    pub count: AtomicU64,
    /// When the server started (seconds since the epoch).
    pub created: u64,
    /// The key every request but `/health` must bring (`Authorization: Bearer KEY`).
    pub api_key: Option<String>,
    /// Completion requests answered at once, at most (others get 429).
    pub max_in_flight: usize,
    pub in_flight: AtomicUsize,
    pub metrics: Metrics,
    /// The web origins whose pages may call the server from a browser (CORS), as [`origin`]
    /// writes them; `*` takes any.
    pub allow_origins: Vec<String>,
}

/// `text` as a browser writes a page's origin in its requests' `Origin` header (the scheme and
/// host in lower case, the scheme's default port left out), or `*`; or why it is no origin.
pub fn origin(text: &str) -> std::result::Result<String, String> {
    // `null`: what browsers send for a page opened from a file.
    if text == "*" || text == "null" {
        return Ok(text.into());
    }
    let form = "an origin is SCHEME://HOST[:PORT] (as a browser's address bar shows a page's), \
                `null` (pages opened from files) or `*` (any)";
    let Some((scheme, rest)) = text.split_once("://") else { return Err(form.into()) };
    let (scheme, rest) = (scheme.to_ascii_lowercase(), rest.to_ascii_lowercase());
    if let Some(slash) = rest.find(['/', '?', '#']) {
        return Err(format!("an origin has no path: {scheme}://{}", &rest[..slash]));
    }
    let (host, port) = match rest.rsplit_once(':') {
        // A port, not the end of an IPv6 address in brackets.
        Some((host, port)) if !port.contains(']') => (host, Some(port)),
        _ => (rest.as_str(), None),
    };
    let scheme_ok =
        !scheme.is_empty() && scheme.bytes().all(|b| b.is_ascii_alphanumeric() || b"+-.".contains(&b));
    if !scheme_ok || host.is_empty() || host.contains('@') || port.is_some_and(|p| p.parse::<u16>().is_err())
    {
        return Err(form.into());
    }
    let default = match scheme.as_str() {
        "http" => Some("80"),
        "https" => Some("443"),
        _ => None,
    };
    Ok(match port {
        Some(p) if Some(p) != default => format!("{scheme}://{host}:{p}"),
        _ => format!("{scheme}://{host}"),
    })
}

/// Upper bounds of the latency histograms' buckets, in seconds.
const BOUNDS: [f64; 12] = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];

/// A latency histogram in Prometheus' form: cumulative bucket counts, a sum and a count.
#[derive(Default)]
struct Histogram {
    buckets: [AtomicU64; BOUNDS.len()],
    sum_us: AtomicU64,
    count: AtomicU64,
}

impl Histogram {
    fn observe(&self, d: Duration) {
        let s = d.as_secs_f64();
        for (b, &bound) in self.buckets.iter().zip(&BOUNDS) {
            if s <= bound {
                b.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.sum_us.fetch_add(d.as_micros() as u64, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    fn render(&self, name: &str, help: &str, out: &mut String) {
        use std::fmt::Write;
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (b, bound) in self.buckets.iter().zip(BOUNDS) {
            let _ = writeln!(out, "{name}_bucket{{le=\"{bound}\"}} {}", b.load(Ordering::Relaxed));
        }
        let count = self.count.load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {count}");
        let _ = writeln!(out, "{name}_sum {}", self.sum_us.load(Ordering::Relaxed) as f64 / 1e6);
        let _ = writeln!(out, "{name}_count {count}");
    }
}

/// What the server has done, as `GET /metrics` gives it (Prometheus' text format).
#[derive(Default)]
pub struct Metrics {
    /// Completion requests answered, by HTTP status.
    statuses: Mutex<BTreeMap<u16, u64>>,
    prompt_tokens: AtomicU64,
    /// Of those, read from the prefix cache.
    cached_tokens: AtomicU64,
    /// Draft tokens checked, and those kept (`--speculate`).
    draft_tokens: AtomicU64,
    accepted_drafts: AtomicU64,
    generation_tokens: AtomicU64,
    /// From a request's hand-over to the driver to its first token.
    first_token: Histogram,
    /// From a request's arrival to its answer's end.
    duration: Histogram,
}

impl Metrics {
    fn status(&self, status: u16) {
        // A panicking request thread cannot leave the map half-written: take it as it is.
        *self.statuses.lock().unwrap_or_else(|e| e.into_inner()).entry(status).or_default() += 1;
    }

    fn render(&self, in_flight: usize) -> String {
        use std::fmt::Write;
        let mut out = String::new();
        let _ = writeln!(
            out,
            "# HELP gridlm_requests_total Completion requests answered and requests refused, by HTTP status."
        );
        let _ = writeln!(out, "# TYPE gridlm_requests_total counter");
        for (status, n) in self.statuses.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            let _ = writeln!(out, "gridlm_requests_total{{status=\"{status}\"}} {n}");
        }
        let gauges = [(
            "gridlm_requests_in_flight",
            "gauge",
            "Completion requests being answered (running or waiting).",
            in_flight as u64,
        )];
        let counters = [
            (
                "gridlm_prompt_tokens_total",
                "counter",
                "Prompt tokens of the completions answered.",
                &self.prompt_tokens,
            ),
            (
                "gridlm_prompt_tokens_cached_total",
                "counter",
                "Prompt tokens of the completions answered whose keys and values came from the prefix cache.",
                &self.cached_tokens,
            ),
            (
                "gridlm_draft_tokens_total",
                "counter",
                "Draft tokens the completions answered checked (--speculate).",
                &self.draft_tokens,
            ),
            (
                "gridlm_draft_tokens_accepted_total",
                "counter",
                "Of those, the drafts kept.",
                &self.accepted_drafts,
            ),
            (
                "gridlm_generation_tokens_total",
                "counter",
                "Tokens of the completions answered.",
                &self.generation_tokens,
            ),
        ];
        let values = gauges
            .into_iter()
            .chain(counters.into_iter().map(|(n, t, h, v)| (n, t, h, v.load(Ordering::Relaxed))));
        for (name, kind, help, value) in values {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}");
        }
        let ttft = "Seconds from a request's hand-over to the scheduler to its first token.";
        self.first_token.render("gridlm_time_to_first_token_seconds", ttft, &mut out);
        let e2e = "Seconds from the arrival of a request handed to the scheduler to the end of its answer.";
        self.duration.render("gridlm_request_duration_seconds", e2e, &mut out);
        out
    }
}

/// A request's events from the driver, each with its completion's index. It counts as in
/// flight until its completions' last events come (before its answer is written, so a client
/// that waits for one answer before asking again is never turned away by its own last request).
struct Events<'a> {
    rx: Receiver<(usize, Event)>,
    /// Completions not done yet.
    open: usize,
    counted: Option<InFlight<'a>>,
    /// When the request went to the driver, and how long its first event took.
    sent: Instant,
    first: Option<Duration>,
    /// When [`Events::recv_unless`] last asked whether the client went away.
    asked: Instant,
    /// Held while the events are awaited: the driver's sign that the client is there (a
    /// request whose client went away before it ran ends without running).
    listening: Arc<()>,
}

impl<'a> Events<'a> {
    /// The events of a request of `k` completions, and the sender its completions' events go
    /// by, the request counted among those in flight; or why it may not be answered now
    /// (`--max-in-flight` requests are).
    fn counted(front: &'a Front, k: usize) -> std::result::Result<(Self, Sender<(usize, Event)>), String> {
        let counted = InFlight(&front.in_flight);
        if front.in_flight.fetch_add(1, Ordering::Relaxed) >= front.max_in_flight {
            let most = front.max_in_flight;
            return Err(format!(
                "{most} requests are being answered, the most --max-in-flight allows: try again later"
            ));
        }
        let (reply, rx) = channel();
        let events = Events {
            rx,
            open: k,
            counted: Some(counted),
            sent: Instant::now(),
            first: None,
            asked: Instant::now(),
            listening: Arc::new(()),
        };
        Ok((events, reply))
    }

    /// The next event, `None` once every completion is done (or the driver is gone).
    fn recv(&mut self) -> Option<(usize, Event)> {
        self.recv_unless(&|| false)
    }

    /// The next event as [`Events::recv`], or `None` once `gone` says the client went away
    /// (asked every quarter second, events coming or not).
    fn recv_unless(&mut self, gone: &dyn Fn() -> bool) -> Option<(usize, Event)> {
        const EVERY: Duration = Duration::from_millis(250);
        if self.open == 0 {
            return None;
        }
        let e = loop {
            if self.asked.elapsed() >= EVERY {
                self.asked = Instant::now();
                if gone() {
                    break None;
                }
            }
            match self.rx.recv_timeout(EVERY) {
                Ok(e) => break Some(e),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => break None,
            }
        };
        if self.first.is_none() {
            self.first = Some(self.sent.elapsed());
        }
        match &e {
            Some((_, Event::Done { .. })) => self.open -= 1,
            Some(_) => {}
            None => self.open = 0,
        }
        if self.open == 0 {
            self.counted = None;
        }
        e
    }
}

/// A completion request being answered (counted in [`Front::in_flight`] while it lives).
struct InFlight<'a>(&'a AtomicUsize);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Whether `req` brings `key` as its bearer token.
fn authorized(req: &http::Request, key: &str) -> bool {
    req.header("Authorization").and_then(|v| v.strip_prefix("Bearer ")).is_some_and(|k| k.trim() == key)
}

/// What a client may send and how long it may take: a body of 16 MiB (a prompt of token ids
/// for the longest context is under 2), twice the requests in flight in connections (at least
/// 64), a minute for a request to begin on a connection, for its head and body to come and for
/// each write of an answer.
fn limits(front: &Front) -> http::Limits {
    http::Limits {
        max_body: 16 << 20,
        max_connections: front.max_in_flight.saturating_mul(2).max(64),
        idle: Duration::from_secs(60),
        io: Duration::from_secs(60),
    }
}

/// Seconds since the epoch.
pub fn now_s() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// Starts the listener's thread: each connection gets a thread of its own.
pub fn start(server: http::Server, front: Front, drain: Arc<AtomicBool>) -> std::thread::JoinHandle<()> {
    let (server, front) = (Arc::new(server), Arc::new(front));
    // Draining: the listener stops taking connections, and once the last request is answered
    // (each holds the front, and with it the channel to the driver), the driver's traffic
    // ends: the scheduler finishes what it has and the job ends.
    let (listener, watched) = (Arc::clone(&server), Arc::clone(&front));
    std::thread::spawn(move || {
        while !drain.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(50));
        }
        let n = watched.in_flight.load(Ordering::Relaxed);
        drop(watched);
        let line =
            format!("serve: draining (SIGUSR1): no new requests; answering the {n} in flight, then ending\n");
        let _ = std::io::stderr().write_all(line.as_bytes());
        listener.stop();
    });
    std::thread::spawn(move || server.run(limits(&front), front))
}

impl http::Handler for Front {
    fn request(&self, req: http::Request) {
        answer(req, self);
    }

    fn refused(&self, status: u16, why: &str) -> (Vec<u8>, &'static str) {
        self.metrics.status(status);
        let _ = std::io::stderr().write_all(format!("serve: {status}: {why}\n").as_bytes());
        (error_body(status, why).to_string().into_bytes(), "application/json")
    }
}

/// An answer of `status` with `body` of the content type `kind`.
fn reply(req: http::Request, status: u16, kind: &str, body: String) {
    let _ = req.respond(status, kind, body.as_bytes());
}

/// An answer with a JSON body.
fn reply_json(req: http::Request, status: u16, body: &Value) {
    reply(req, status, "application/json", body.to_string());
}

/// An error answer, in OpenAI's form.
fn reply_error(req: http::Request, status: u16, msg: &str) {
    reply_json(req, status, &error_body(status, msg));
}

/// An error's body, in OpenAI's form.
fn error_body(status: u16, msg: &str) -> Value {
    let kind = if status >= 500 { "server_error" } else { "invalid_request_error" };
    json!({"error": {"message": msg, "type": kind, "param": null, "code": null}})
}

/// Answers a completion request with an error, and logs it (its path, status and why).
fn refuse(front: &Front, req: http::Request, url: &str, status: u16, msg: &str) {
    front.metrics.status(status);
    reply_error(req, status, msg);
    let _ = std::io::stderr().write_all(format!("serve: {url} {status}: {msg}\n").as_bytes());
}

/// The served model as OpenAI's `model` object.
fn model_object(front: &Front) -> Value {
    json!({"id": front.model, "object": "model", "created": front.created, "owned_by": "gridlm"})
}

/// Answers vLLM's `/tokenize` (a prompt, or a chat through the template, as token ids, their
/// count and the context) or `/detokenize` (token ids as text), `url` saying which; a bad
/// request gets 400 naming what is wrong.
fn tokens(mut req: http::Request, front: &Front, url: &str) {
    let body = match req.take_body() {
        Ok(body) => body,
        Err((status, why)) => return refuse(front, req, url, status, &why),
    };
    let answer = if url == "/tokenize" { tokenize(&body, front) } else { detokenize(&body, front) };
    match answer {
        Ok(v) => reply_json(req, 200, &v),
        Err(e) => refuse(front, req, url, 400, &e),
    }
}

/// How a chat request's rendered conversation ends, as its `add_generation_prompt` and
/// `continue_final_message` ask.
fn chat_end_field(obj: &Map<String, Value>) -> std::result::Result<ChatEnd, String> {
    ChatEnd::asked(field(obj, "add_generation_prompt")?, field(obj, "continue_final_message")?)
}

/// The JSON object of a request's `body`, with none but the keys `takes`.
fn object_of(body: &[u8], takes: &[&str]) -> std::result::Result<Map<String, Value>, String> {
    let obj: Map<String, Value> =
        serde_json::from_slice(body).map_err(|e| format!("the body is not a JSON object: {e}"))?;
    match obj.keys().find(|k| !takes.contains(&k.as_str())) {
        Some(k) => Err(format!("unknown key `{k}` (expected {})", takes.join(", "))),
        None => Ok(obj),
    }
}

/// `/tokenize`: `prompt` encoded as a completion's is (`add_special_tokens`, default true), or
/// `messages` through the chat template as a chat request's are (`chat_template_kwargs`).
fn tokenize(body: &[u8], front: &Front) -> std::result::Result<Value, String> {
    let keys = [
        "model",
        "prompt",
        "add_special_tokens",
        "messages",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template_kwargs",
        "tools",
    ];
    let obj = object_of(body, &keys)?;
    let (text, special) = match (obj.get("prompt"), messages_field(&obj)?) {
        (Some(_), Some(_)) => return Err("a `prompt` or `messages`, not both".into()),
        (None, None) => return Err("no `prompt` (or `messages`)".into()),
        (Some(Value::String(p)), None) => (p.clone(), field(&obj, "add_special_tokens")?.unwrap_or(true)),
        (Some(_), None) => return Err("`prompt` must be a string".into()),
        (None, Some(messages)) => {
            let end = chat_end_field(&obj)?;
            let mut vars = front.defaults.template_vars.clone();
            template_vars_over(&mut vars, &obj)?;
            tools::for_template(&mut vars, &Tools::list(&obj)?);
            (front.tok.render_chat_to(&messages, &vars, end).map_err(|e| e.to_string())?, false)
        }
    };
    let ids = front.tok.encode(&text, special).map_err(|e| e.to_string())?;
    Ok(json!({"count": ids.len(), "max_model_len": front.context, "tokens": ids}))
}

/// `/detokenize`: `tokens` as text, special tokens written.
fn detokenize(body: &[u8], front: &Front) -> std::result::Result<Value, String> {
    let obj = object_of(body, &["model", "tokens"])?;
    let ids: Vec<u64> = field(&obj, "tokens")?.ok_or("no `tokens`")?;
    let ids: Vec<u32> = ids
        .iter()
        .map(|&t| match u32::try_from(t) {
            Ok(t) if (t as usize) < front.vocab => Ok(t),
            _ => Err(format!("`tokens`: token id {t} is outside the vocabulary ({} tokens)", front.vocab)),
        })
        .collect::<std::result::Result<_, _>>()?;
    Ok(json!({"prompt": front.tok.decode_as(&ids, false).map_err(|e| e.to_string())?}))
}

/// The methods the path `url` takes, or `None` where it is no endpoint.
fn takes(url: &str) -> Option<&'static str> {
    match url {
        "/health" | "/metrics" | "/v1/models" => Some("GET, HEAD, OPTIONS"),
        u if u.starts_with("/v1/models/") => Some("GET, HEAD, OPTIONS"),
        "/v1/completions"
        | "/v1/chat/completions"
        | "/v1/responses"
        | "/v1/embeddings"
        | "/tokenize"
        | "/detokenize" => Some("POST, OPTIONS"),
        _ => None,
    }
}

impl Front {
    /// Whether a browser's page at `origin` (an `Origin` header) may read the answers.
    fn allows(&self, origin: &str) -> bool {
        self.allow_origins.iter().any(|o| o == "*" || o.eq_ignore_ascii_case(origin))
    }
}

/// Answers an OPTIONS request to an endpoint taking `methods`: a browser's CORS preflight
/// (naming the method the page will send) from an `allowed` origin with the methods and
/// headers it may send, from another with 403 and why; any other with the methods.
fn options(mut req: http::Request, front: &Front, url: &str, methods: &str, allowed: bool) {
    let Some(origin) = req.header("Access-Control-Request-Method").and(req.header("Origin")) else {
        req.add_header("Allow", methods);
        return reply(req, 200, "text/plain", String::new());
    };
    if !allowed {
        let msg = format!(
            "a page at {origin} may not call this server from a browser (CORS): --allow-origin {origin} \
             lets it"
        );
        return refuse(front, req, url, 403, &msg);
    }
    // The headers the page asks to send (`Authorization`, `Content-Type`, a client's own).
    let asked = req.header("Access-Control-Request-Headers").unwrap_or("Authorization, Content-Type");
    let asked = asked.to_string();
    req.add_header("Access-Control-Allow-Methods", methods);
    req.add_header("Access-Control-Allow-Headers", &asked);
    req.add_header("Access-Control-Max-Age", "600");
    reply(req, 200, "text/plain", String::new())
}

/// Answers one HTTP request, and logs it on stderr (but for /health and /v1/models).
fn answer(mut req: http::Request, front: &Front) {
    let t0 = Instant::now();
    let url = req.url().split('?').next().unwrap_or("").to_string();
    // Tests: a request thread that fails (the server must answer on).
    if std::env::var_os("GRIDLM_TEST_SERVE_PANIC").is_some_and(|p| p == url.as_str()) {
        panic!("a request to {url} (GRIDLM_TEST_SERVE_PANIC)");
    }
    // Browsers (CORS): the answers to a page of an allowed origin say it may read them; its
    // preflights (OPTIONS, which browsers send without the API key) are answered here.
    let allowed = req.header("Origin").filter(|o| front.allows(o)).map(str::to_string);
    if let Some(o) = &allowed {
        req.add_header("Access-Control-Allow-Origin", o);
    }
    if !front.allow_origins.is_empty() {
        req.add_header("Vary", "Origin");
    }
    if let ("OPTIONS", Some(methods)) = (req.method(), takes(&url)) {
        return options(req, front, &url, methods, allowed.is_some());
    }
    if url != "/health" && front.api_key.as_deref().is_some_and(|k| !authorized(&req, k)) {
        return refuse(
            front,
            req,
            &url,
            401,
            "a missing or wrong API key (send `Authorization: Bearer KEY`)",
        );
    }
    // A HEAD request is answered as its GET, without the body.
    let method = if req.method() == "HEAD" { "GET" } else { req.method() };
    let kind = match (method, url.as_str()) {
        ("GET", "/health") => return reply_json(req, 200, &json!({"status": "ok"})),
        ("GET", "/metrics") => {
            let text = front.metrics.render(front.in_flight.load(Ordering::Relaxed));
            return reply(req, 200, "text/plain; version=0.0.4", text);
        }
        ("GET", "/v1/models") => {
            return reply_json(req, 200, &json!({"object": "list", "data": [model_object(front)]}));
        }
        // One model by its id (OpenAI's retrieve).
        (m, u) if u.starts_with("/v1/models/") => {
            // The name as the client wrote it, before a URL's escapes (`org%2Fname`).
            let name = percent_encoding::percent_decode_str(&u["/v1/models/".len()..]).decode_utf8_lossy();
            let (status, what) = match (name == front.model, m) {
                (true, "GET") => return reply_json(req, 200, &model_object(front)),
                (true, m) => (405, format!("{url} does not take {m}")),
                (false, _) => (404, format!("no model {name} (this server has {})", front.model)),
            };
            return refuse(front, req, &url, status, &what);
        }
        ("POST", "/tokenize" | "/detokenize") => return tokens(req, front, &url),
        ("POST", "/v1/completions") => Kind::Completion,
        ("POST", "/v1/chat/completions") => Kind::Chat,
        ("POST", "/v1/responses") => Kind::Response,
        ("POST", "/v1/embeddings") => return embed(req, front, &url, t0),
        (_, u) => {
            let Some(methods) = takes(u) else {
                let known =
                    "/v1/completions, /v1/chat/completions, /v1/responses, /v1/embeddings, /v1/models, \
                             /tokenize, /detokenize, /metrics and /health";
                return refuse(front, req, &url, 404, &format!("no endpoint {url} (there are {known})"));
            };
            let msg = format!("{url} does not take {}", req.method());
            req.add_header("Allow", methods);
            return refuse(front, req, &url, 405, &msg);
        }
    };
    let n = front.count.fetch_add(1, Ordering::Relaxed);
    let body = match req.take_body() {
        Ok(body) => body,
        Err((status, why)) => return refuse(front, req, &url, status, &why),
    };
    let ask = match parse(kind, &body, &front.defaults, n) {
        Ok(a) => a,
        Err(e) => return refuse(front, req, &url, 400, &e),
    };
    let prompts = match prompt_ids(&ask, front) {
        Ok(p) => p,
        Err(e) => return refuse(front, req, &url, 400, &e),
    };
    if let Err(e) = ask.rules.check(front.vocab, ask.max_tokens) {
        return refuse(front, req, &url, 400, &format!("`{}", e.replacen(' ', "` ", 1)));
    }
    // The format is compiled here, in the request's thread: one the grammar engine cannot
    // compile is refused before the request waits, and the driver does not stall the running
    // sequences' steps compiling it. Each completion goes on from a clone.
    let grammar = match &ask.format {
        Some(f) => {
            let compiled =
                front.grammars.as_ref().map_err(|e| format!("structured output is not available: {e}"));
            match compiled.and_then(|g| g.start(f)) {
                Ok(c) => Some(c),
                Err(e) => return refuse(front, req, &url, 400, &e),
            }
        }
        None => None,
    };
    // Each prompt's `n` completions, in that order; the `j`-th of a prompt samples with seed + j.
    let k = prompts.len() * ask.n;
    let (mut events, reply) = match Events::counted(front, k) {
        Ok(e) => e,
        Err(msg) => return refuse(front, req, &url, 429, &msg),
    };
    // The text keeps the tags its tool calls are read by, where they are special tokens.
    let reader = ask.tools.as_ref().and_then(|t| Reader::new(t, front.defaults.tool_parser));
    let tags = reader.map(|r| front.tok.special_ids(r.tags())).unwrap_or_default();
    for (i, ids) in prompts.iter().enumerate() {
        for j in 0..ask.n {
            let params =
                SamplingParams { seed: ask.params.seed.wrapping_add(j as u64), ..ask.params.clone() };
            let request = Request {
                prompt: ids.clone(),
                max_tokens: ask.max_tokens,
                ignore_eos: ask.ignore_eos,
                params,
                keep_logits: false,
                logprobs: ask.logprobs,
                prompt_logprobs: ask.logprobs.filter(|_| ask.echo),
                rules: ask.rules.clone(),
                format: ask.format.clone(),
                grammar: grammar.clone(),
                embed: None,
            };
            let inc = Incoming {
                request,
                stop: ask.stop.clone(),
                keep_stop: ask.keep_stop,
                keep_special: (tags.clone(), !ask.skip_special),
                choice: i * ask.n + j,
                reply: reply.clone(),
                listener: Arc::downgrade(&events.listening),
            };
            if front.tx.send(inc).is_err() {
                return refuse(front, req, &url, 503, "the server is shutting down");
            }
        }
    }
    drop(reply);
    let id = match kind {
        Kind::Completion => format!("cmpl-{n}"),
        Kind::Chat => format!("chatcmpl-{n}"),
        Kind::Response => format!("resp_{n}"),
    };
    let prompt_tokens = prompts.iter().map(Vec::len).sum();
    // An echoed prompt of token ids is their bytes.
    let echo_texts: Vec<String> = if ask.token_prompts.is_empty() {
        ask.prompts.clone()
    } else {
        prompts.iter().map(|ids| front.tok.bytes_text(ids)).collect()
    };
    let head = Head {
        id: &id,
        kind,
        model: &front.model,
        created: now_s(),
        prompt_tokens,
        n: ask.n,
        tok: &front.tok,
        logprobs: ask.logprobs.is_some(),
        echo: ask.echo.then_some(Echo { texts: &echo_texts, ids: &prompts, n: ask.n }),
        tools: ask.tools.as_ref().map(|t| (t, front.defaults.tool_parser)),
    };
    let (status, outcome) =
        if ask.stream { stream(req, &head, &ask, k, &mut events) } else { whole(req, &head, k, &mut events) };
    // The request's duration counted last, so what counts durations has counted the rest.
    let m = &front.metrics;
    if let (Some(o), Some(first)) = (&outcome, events.first) {
        if o.tokens > 0 {
            m.first_token.observe(first);
            m.prompt_tokens.fetch_add(prompt_tokens as u64, Ordering::Relaxed);
            m.cached_tokens.fetch_add(o.counts.cached as u64, Ordering::Relaxed);
            m.draft_tokens.fetch_add(o.counts.drafted as u64, Ordering::Relaxed);
            m.accepted_drafts.fetch_add(o.counts.accepted as u64, Ordering::Relaxed);
            m.generation_tokens.fetch_add(o.tokens as u64, Ordering::Relaxed);
        }
    }
    m.status(status);
    m.duration.observe(t0.elapsed());
    let streamed = if ask.stream { ", streamed" } else { "" };
    let how = match outcome {
        Some(o) => {
            let names: Vec<&str> = o.finish.iter().map(|f| f.name()).collect();
            let Counts { cached, drafted, accepted } = o.counts;
            let cached = if cached > 0 { format!(" ({cached} cached)") } else { String::new() };
            let drafts =
                if drafted > 0 { format!(", {accepted} of {drafted} drafts kept") } else { String::new() };
            let names = names.join(", ");
            format!("{prompt_tokens} prompt{cached} + {} new tokens ({names}{streamed}{drafts})", o.tokens)
        }
        None => format!("{prompt_tokens} prompt tokens, the client went away{streamed}"),
    };
    let line = format!("serve: {id} {url} {status}: {how}, {:.2} s\n", t0.elapsed().as_secs_f64());
    let _ = std::io::stderr().write_all(line.as_bytes());
}

/// Answers an embeddings request (`POST /v1/embeddings`, [`embeddings`]): each input's
/// embedding, its prompt pooled as the server pools (`--pooling`, or as the model folder says),
/// the inputs run as one batch.
fn embed(mut req: http::Request, front: &Front, url: &str, t0: Instant) {
    let n = front.count.fetch_add(1, Ordering::Relaxed);
    let body = match req.take_body() {
        Ok(body) => body,
        Err((status, why)) => return refuse(front, req, url, status, &why),
    };
    let ask = match embeddings::parse(&body) {
        Ok(a) => a,
        Err(e) => return refuse(front, req, url, 400, &e),
    };
    let pooling = match &front.defaults.pooling {
        Ok(p) => *p,
        Err(e) => return refuse(front, req, url, 400, &format!("embeddings are not available: {e}")),
    };
    let ids: std::result::Result<Vec<Vec<u32>>, String> = match &ask.input {
        embeddings::Input::Texts(t) => {
            t.iter().map(|t| front.tok.encode(t, true).map_err(|e| e.to_string())).collect()
        }
        embeddings::Input::Ids(ids) => Ok(ids.clone()),
    };
    let prompts = match ids.and_then(|ids| checked_ids("input", ids, front)) {
        Ok(p) => p,
        Err(e) => return refuse(front, req, url, 400, &e),
    };
    let k = prompts.len();
    let (mut events, reply) = match Events::counted(front, k) {
        Ok(e) => e,
        Err(msg) => return refuse(front, req, url, 429, &msg),
    };
    for (i, prompt) in prompts.iter().enumerate() {
        let request = Request { prompt: prompt.clone(), embed: Some(pooling), ..Request::default() };
        let inc = Incoming {
            request,
            stop: Vec::new(),
            keep_stop: false,
            keep_special: (Vec::new(), false),
            choice: i,
            reply: reply.clone(),
            listener: Arc::downgrade(&events.listening),
        };
        if front.tx.send(inc).is_err() {
            return refuse(front, req, url, 503, "the server is shutting down");
        }
    }
    drop(reply);
    let prompt_tokens: usize = prompts.iter().map(Vec::len).sum();
    let mut vectors: Vec<Option<Vec<f32>>> = vec![None; k];
    let mut failed = None;
    while let Some((i, event)) = events.recv_unless(&|| req.client_gone()) {
        if let Event::Done { error, embedding, .. } = event {
            failed = failed.or(error);
            vectors[i] = embedding;
        }
    }
    let vectors: Option<Vec<Vec<f32>>> = vectors.into_iter().collect();
    let status = match (failed, vectors) {
        (Some(e), _) => {
            reply_error(req, 400, &e);
            400
        }
        (None, Some(v)) => {
            reply_json(req, 200, &embeddings::body(&front.model, &ask, &v, prompt_tokens));
            front.metrics.prompt_tokens.fetch_add(prompt_tokens as u64, Ordering::Relaxed);
            200
        }
        (None, None) => cut_short(req).0,
    };
    front.metrics.status(status);
    front.metrics.duration.observe(t0.elapsed());
    let line = format!(
        "serve: embd-{n} {url} {status}: {} of {prompt_tokens} prompt tokens ({} pooling), {:.2} s\n",
        crate::count(k, "input"),
        pooling.name(),
        t0.elapsed().as_secs_f64()
    );
    let _ = std::io::stderr().write_all(line.as_bytes());
}

/// Each prompt's token ids, checked against the context.
fn prompt_ids(ask: &Ask, front: &Front) -> std::result::Result<Vec<Vec<u32>>, String> {
    if !ask.token_prompts.is_empty() {
        return checked_ids("prompt", ask.token_prompts.clone(), front);
    }
    let texts: Vec<(String, bool)> = match ask.kind {
        Kind::Completion => ask.prompts.iter().map(|p| (p.clone(), true)).collect(),
        Kind::Chat | Kind::Response => {
            let text = front.tok.render_chat_to(&ask.messages, &ask.template_vars, ask.chat_end);
            vec![(text.map_err(|e| e.to_string())?, false)]
        }
    };
    let many = texts.len() > 1;
    texts
        .iter()
        .enumerate()
        .map(|(i, (text, special))| {
            let at = |e: String| if many { format!("`prompt[{i}]`: {e}") } else { e };
            let ids = front.tok.encode(text, *special).map_err(|e| at(e.to_string()))?;
            if ids.is_empty() {
                return Err(at("the prompt is empty".into()));
            }
            check_prompt(ids.len(), front.context).map_err(|e| at(e.to_string()))?;
            Ok(ids)
        })
        .collect()
}

/// Prompts of token ids, each checked against the vocabulary and the context; the error names
/// the prompt by the request's `key` (`key[i]` where there are several).
fn checked_ids(
    key: &str,
    prompts: Vec<Vec<u32>>,
    front: &Front,
) -> std::result::Result<Vec<Vec<u32>>, String> {
    let many = prompts.len() > 1;
    for (i, ids) in prompts.iter().enumerate() {
        let at = |e: String| if many { format!("`{key}[{i}]`: {e}") } else { format!("`{key}`: {e}") };
        if let Some(t) = ids.iter().find(|&&t| t as usize >= front.vocab) {
            return Err(at(format!("token id {t} is outside the vocabulary ({} tokens)", front.vocab)));
        }
        check_prompt(ids.len(), front.context).map_err(|e| at(e.to_string()))?;
    }
    Ok(prompts)
}

/// How a request's completions ended, and the tokens they brought together.
struct Outcome {
    finish: Vec<Finish>,
    tokens: usize,
    counts: Counts,
}

/// What a request's completions took from the prefix cache (prompt tokens, counted once a
/// prompt as `Head::usage` does) and drafted (tokens checked, and kept).
#[derive(Debug, Clone, Copy, Default)]
pub struct Counts {
    cached: usize,
    drafted: usize,
    accepted: usize,
}

/// What every answer to a request names.
struct Head<'a> {
    id: &'a str,
    kind: Kind,
    model: &'a str,
    created: u64,
    prompt_tokens: usize,
    /// Completions of each prompt.
    n: usize,
    tok: &'a Tokenizer,
    /// The request asked for log-probabilities.
    logprobs: bool,
    /// Echoed prompts.
    echo: Option<Echo<'a>>,
    /// The tools the answers may call, and how calls are read from answers that may call or
    /// not (the server's parser).
    tools: Option<(&'a Tools, Option<tools::Parser>)>,
}

/// A request's prompts, echoed: their texts and tokens, and the completions of each (`n`).
#[derive(Clone, Copy)]
struct Echo<'a> {
    texts: &'a [String],
    ids: &'a [Vec<u32>],
    n: usize,
}

/// A token with its log-probabilities, none for a prompt's first token.
type Entry<'a> = (u32, Option<&'a TokenLogprobs>);
type Entries<'a> = [Entry<'a>];

/// `lps` as [`Entries`].
fn entries(lps: &[(u32, TokenLogprobs)]) -> Vec<Entry<'_>> {
    lps.iter().map(|(t, lp)| (*t, Some(lp))).collect()
}

impl Head<'_> {
    /// The token counts: `cached` of the prompt tokens came from the prefix cache (counted as
    /// `prompt_tokens` is, once a prompt: its first completion's).
    fn usage(&self, tokens: usize, cached: usize) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": tokens,
            "total_tokens": self.prompt_tokens + tokens,
            "prompt_tokens_details": {"cached_tokens": cached},
        })
    }

    /// `sum` with completion `i`'s counts added (its cached prompt tokens as
    /// [`Head::usage`] counts them: once a prompt).
    fn add(&self, sum: &mut Counts, i: usize, c: Counts) {
        if i.is_multiple_of(self.n.max(1)) {
            sum.cached += c.cached;
        }
        sum.drafted += c.drafted;
        sum.accepted += c.accepted;
    }

    /// Choice `index` carrying `text` and its tokens' log-probabilities `lps` (the first of them
    /// `*offset` bytes into the choice's text, moved on past them): whole (`delta` false) or a
    /// streamed piece.
    fn choice(
        &self,
        index: usize,
        (text, lps): (&str, &Entries),
        offset: &mut usize,
        ended: Option<(Finish, Option<&StopBy>)>,
        delta: bool,
    ) -> Value {
        let reason = ended.map(|e| finish_reason(e.0));
        // vLLM's: the stop string or token that ended it.
        let stop = ended.and_then(|e| e.1).map(StopBy::json);
        let lp = if self.logprobs { self.logprobs_json(lps, offset) } else { Value::Null };
        match (self.kind, delta) {
            (Kind::Completion, _) => {
                json!({"index": index, "text": text, "logprobs": lp, "finish_reason": reason, "stop_reason": stop})
            }
            (Kind::Chat | Kind::Response, false) => {
                json!({"index": index, "message": {"role": "assistant", "content": text}, "logprobs": lp, "finish_reason": reason, "stop_reason": stop})
            }
            (Kind::Chat | Kind::Response, true) => {
                let delta = if text.is_empty() { json!({}) } else { json!({"content": text}) };
                json!({"index": index, "delta": delta, "logprobs": lp, "finish_reason": reason, "stop_reason": stop})
            }
        }
    }

    /// Log-probabilities as OpenAI gives them: completions' `tokens`, `token_logprobs`,
    /// `top_logprobs` (the alternatives and the token itself by text) and `text_offset` (from
    /// `*offset` on, in bytes); chat's `content`, a list of each token's text, log-probability,
    /// bytes and alternatives.
    fn logprobs_json(&self, lps: &Entries, offset: &mut usize) -> Value {
        let bytes = |t: u32| self.tok.token_bytes(t).unwrap_or_default();
        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        match self.kind {
            Kind::Completion => {
                let (mut tokens, mut logprobs, mut tops, mut offsets) = (vec![], vec![], vec![], vec![]);
                for &(t, lp) in lps {
                    let b = bytes(t);
                    tokens.push(json!(text(&b)));
                    match lp {
                        Some(lp) => {
                            let mut top = Map::new();
                            for &(a, v) in &lp.top {
                                top.entry(self.tok.bytes_text(&[a])).or_insert(json!(v));
                            }
                            top.entry(text(&b)).or_insert(json!(lp.logprob));
                            logprobs.push(json!(lp.logprob));
                            tops.push(Value::Object(top));
                        }
                        // A prompt's first token: nothing before it to give it a probability.
                        None => {
                            logprobs.push(Value::Null);
                            tops.push(Value::Null);
                        }
                    }
                    offsets.push(json!(*offset));
                    *offset += b.len();
                }
                json!({"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets})
            }
            Kind::Chat | Kind::Response => {
                let entry = |t: u32, v: f32| {
                    let b = bytes(t);
                    json!({"token": text(&b), "logprob": v, "bytes": b})
                };
                // (Chat never echoes, so every token has its log-probabilities.)
                let content = lps.iter().filter_map(|&(t, lp)| {
                    let lp = lp?;
                    let mut e = entry(t, lp.logprob);
                    e["top_logprobs"] = lp.top.iter().map(|&(a, v)| entry(a, v)).collect();
                    Some(e)
                });
                json!({"content": content.collect::<Vec<_>>()})
            }
        }
    }

    /// Choice `i`'s echoed prompt, if the request echoes: its text, and its tokens with the
    /// log-probabilities `scored` of those after the first (where they were asked for).
    fn echoed<'s>(&self, i: usize, scored: &'s [TokenLogprobs]) -> Option<(&str, Vec<Entry<'s>>)> {
        let Echo { texts, ids, n } = self.echo?;
        let ids = &ids[i / n];
        let lps = std::iter::once(None).chain(scored.iter().map(Some));
        Some((&texts[i / n], ids.iter().copied().zip(lps).collect()))
    }

    fn object(&self, streamed: bool) -> &'static str {
        match (self.kind, streamed) {
            (Kind::Completion, _) => "text_completion",
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
            (Kind::Response, _) => "response",
        }
    }

    /// The Responses API's object of an answer: while it streams (`done` `None`) in progress,
    /// without output; then its output items, how it ended, its token counts (`cached` of the
    /// prompt's from the prefix cache).
    fn response(&self, done: Option<(Vec<Value>, Finish, usize, usize)>) -> Value {
        let mut r = json!({
            "id": self.id, "object": "response", "created_at": self.created, "status": "in_progress",
            "error": null, "incomplete_details": null, "model": self.model, "output": [],
            "parallel_tool_calls": false, "tool_choice": "none", "tools": [], "store": false,
            "metadata": {}, "usage": null,
        });
        if let Some((t, _)) = self.tools {
            r["tools"] = json!(t.responses_list());
            r["tool_choice"] = t.responses_choice();
            r["parallel_tool_calls"] = json!(t.parallel);
        }
        if let Some((output, finish, tokens, cached)) = done {
            let cut = matches!(finish, Finish::Length | Finish::Context);
            r["status"] = json!(if cut { "incomplete" } else { "completed" });
            if cut {
                r["incomplete_details"] = json!({"reason": "max_output_tokens"});
            }
            r["output"] = Value::Array(output);
            r["usage"] = json!({
                "input_tokens": self.prompt_tokens,
                "input_tokens_details": {"cached_tokens": cached},
                "output_tokens": tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": self.prompt_tokens + tokens,
            });
        }
        r
    }

    /// The Responses API's output items of a whole answer's `text`: its message, or where it
    /// calls tools, a message of its text where it has any and a `function_call` item a call.
    fn response_output(&self, text: &str) -> Vec<Value> {
        let Some(mut reader) = self.reader() else {
            return vec![self.response_message(0, text, "completed")];
        };
        let (content, calls) = tools::read_whole(&mut reader, text);
        let message = content.map(|c| self.response_message(0, &c, "completed"));
        let calls = calls.iter().map(|(id, name, arguments)| function_call(id, name, arguments, "completed"));
        message.into_iter().chain(calls).collect()
    }

    /// The Responses API's message item `k` of an answer (its first, or after calls another),
    /// of `text` (none yet while `in_progress`).
    fn response_message(&self, k: usize, text: &str, status: &str) -> Value {
        let content = if status == "in_progress" { json!([]) } else { json!([output_text(text)]) };
        json!({"type": "message", "id": self.message_id(k), "status": status, "role": "assistant", "content": content})
    }

    /// The id of the Responses API's message item `k` of the answer.
    fn message_id(&self, k: usize) -> String {
        match k {
            0 => format!("msg_{}", self.id),
            k => format!("msg_{}_{k}", self.id),
        }
    }

    /// A reader of an answer's tool calls, where the answers may make them.
    fn reader(&self) -> Option<Reader> {
        self.tools.and_then(|(t, parser)| Reader::new(t, parser))
    }

    /// A whole answer's `choice` (from [`Head::choice`]) with the calls its text makes read
    /// out of it by `reader`: the message's content (null where it is all calls) and
    /// `tool_calls`, and the answer ended for them where it made any and was not cut short.
    fn with_calls(&self, choice: &mut Value, reader: &mut Reader, text: &str) {
        let (content, calls) = tools::read_whole(reader, text);
        if calls.is_empty() {
            return;
        }
        let m = &mut choice["message"];
        m["content"] = json!(content);
        m["tool_calls"] =
            calls.iter().map(|(id, name, arguments)| tools::call_json(id, name, arguments)).collect();
        self.ended_for_calls(choice);
    }

    /// The answer of `choice`, which made tool calls, ended for them (`finish_reason`) where it
    /// was not cut short.
    fn ended_for_calls(&self, choice: &mut Value) {
        if let (Some((t, _)), Some("stop")) = (self.tools, choice["finish_reason"].as_str()) {
            choice["finish_reason"] = json!(t.finish_reason());
        }
    }

    fn body(&self, choices: Vec<Value>, streamed: bool) -> Value {
        json!({"id": self.id, "object": self.object(streamed), "created": self.created, "model": self.model, "choices": choices})
    }
}

/// The Responses API's text part of an answer.
fn output_text(text: &str) -> Value {
    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []})
}

/// The Responses API's item of a tool call: its id ([`function_call_id`]), the call's id, the
/// tool's name and the arguments' JSON text so far.
fn function_call(call_id: &str, name: &str, arguments: &str, status: &str) -> Value {
    let id = function_call_id(call_id);
    json!({"type": "function_call", "id": id, "call_id": call_id, "name": name, "arguments": arguments, "status": status})
}

/// The id of the Responses API's item of the call `call_...`: `fc_...`, the same digits.
fn function_call_id(call_id: &str) -> String {
    format!("fc_{}", call_id.strip_prefix("call_").unwrap_or(call_id))
}

/// Ends a request whose events stopped before its completions were done: the client went away
/// (nginx's 499; its completions stop at their next token, the driver finding their channel
/// closed once the events are dropped), or the driver stopped (500).
fn cut_short(req: http::Request) -> (u16, Option<Outcome>) {
    if req.client_gone() {
        return (499, None);
    }
    reply_error(req, 500, "the driver stopped before the completion was done");
    (500, None)
}

/// Waits for the `k` completions and answers with them. The status, and how they ended.
fn whole(req: http::Request, head: &Head, k: usize, events: &mut Events) -> (u16, Option<Outcome>) {
    let mut texts = vec![String::new(); k];
    let mut lps: Vec<Logprobs> = vec![Vec::new(); k];
    let mut prompt_lps: Vec<Vec<TokenLogprobs>> = vec![Vec::new(); k];
    let mut finish = vec![Finish::Length; k];
    let mut stop_by: Vec<Option<StopBy>> = vec![None; k];
    let (mut done, mut tokens, mut counts) = (0, 0, Counts::default());
    while let Some((i, event)) = events.recv_unless(&|| req.client_gone()) {
        match event {
            Event::Prompt(lp) => prompt_lps[i] = lp,
            Event::Text(piece, lp) => {
                texts[i].push_str(&piece);
                lps[i].extend(lp);
            }
            Event::Done { rest, logprobs, finish: f, stop_by: by, error, tokens: t, counts: c, .. } => {
                stop_by[i] = by;
                tokens += t;
                head.add(&mut counts, i, c);
                if let Some(e) = error {
                    // Before any token a completion could not run (the KV memory, its settings);
                    // after some, its text could not be made. The others stop at their next
                    // token, their channel gone.
                    let status = if t == 0 { 400 } else { 500 };
                    reply_error(req, status, &e);
                    return (status, Some(Outcome { finish: vec![Finish::Error], tokens, counts }));
                }
                texts[i].push_str(&rest);
                lps[i].extend(logprobs);
                finish[i] = f;
                done += 1;
            }
        }
    }
    if done < k {
        return cut_short(req);
    }
    if head.kind == Kind::Response {
        let output = head.response_output(&texts[0]);
        reply_json(req, 200, &head.response(Some((output, finish[0], tokens, counts.cached))));
        return (200, Some(Outcome { finish, tokens, counts }));
    }
    let choices = (0..k).map(|i| {
        let (mut text, mut all) =
            head.echoed(i, &prompt_lps[i]).map_or((String::new(), Vec::new()), |(t, e)| (t.to_string(), e));
        text.push_str(&texts[i]);
        all.extend(entries(&lps[i]));
        let mut c = head.choice(i, (&text, &all), &mut 0, Some((finish[i], stop_by[i].as_ref())), false);
        if let Some(mut r) = head.reader() {
            head.with_calls(&mut c, &mut r, &text);
        }
        c
    });
    let mut body = head.body(choices.collect(), false);
    body["usage"] = head.usage(tokens, counts.cached);
    reply_json(req, 200, &body);
    (200, Some(Outcome { finish, tokens, counts }))
}

/// Answers with server-sent events, a chunk as each piece of text of any of the `k` completions
/// comes (its `index` says which), then `[DONE]` once all are done. The answer starts with the
/// first event, so a request that cannot run gets a 400 as an unstreamed one does. The status,
/// and how they ended (`None` when the client went away: the driver stops the completions at
/// their next token, finding the channel closed).
fn stream(
    mut req: http::Request,
    head: &Head,
    ask: &Ask,
    k: usize,
    events: &mut Events,
) -> (u16, Option<Outcome>) {
    let Some(mut event) = events.recv_unless(&|| req.client_gone()) else {
        return cut_short(req);
    };
    if let (_, Event::Done { error: Some(e), tokens, .. }) = &event {
        reply_error(req, 400, e);
        let counts = Counts::default();
        return (400, Some(Outcome { finish: vec![Finish::Error], tokens: *tokens, counts }));
    }
    req.add_header("Cache-Control", "no-cache");
    let Ok(w) = req.start_chunked(200, "text/event-stream") else {
        return (200, None);
    };
    let mut sse = Sse { w, first: vec![true; k], offsets: vec![0; k], echoed: vec![false; k], sequence: 0 };
    if head.kind == Kind::Response {
        return stream_response(sse, head, event, events);
    }
    let mut finish = vec![Finish::Length; k];
    let (mut done, mut tokens, mut counts) = (0, 0, Counts::default());
    // Each answer's tool calls, read as its text comes.
    let mut readers: Vec<Option<Reader>> = (0..k).map(|_| head.reader()).collect();
    loop {
        let (i, e) = event;
        // An echoed prompt comes first, with its log-probabilities if they were asked for.
        let scored = match &e {
            Event::Prompt(lp) => &lp[..],
            _ => &[],
        };
        let mut sent = Ok(());
        if let Some((text, lps)) = head.echoed(i, scored).filter(|_| !sse.echoed[i]) {
            sse.echoed[i] = true;
            sent = sse.piece(head, i, (text, &lps), None);
        }
        let sent = sent.and_then(|()| match (e, &mut readers[i]) {
            (Event::Prompt(_), _) => Ok(()),
            (Event::Text(t, lp), None) => sse.piece(head, i, (&t, &entries(&lp)), None),
            (Event::Text(t, lp), Some(r)) => sse.calls(head, i, r, &t, &entries(&lp), None),
            (Event::Done { rest, logprobs, finish: f, stop_by, error, tokens: t, counts: c, .. }, r) => {
                (finish[i], done, tokens) = (f, done + 1, tokens + t);
                head.add(&mut counts, i, c);
                let ended = Some((f, stop_by.as_ref()));
                match (error, r) {
                    // The text could not be made after some was sent: say so in the stream.
                    (Some(e), _) => sse.event(&json!({"error": {"message": e, "type": "server_error", "param": null, "code": null}})),
                    (None, None) => sse.piece(head, i, (&rest, &entries(&logprobs)), ended),
                    (None, Some(r)) => sse.calls(head, i, r, &rest, &entries(&logprobs), ended),
                }
            }
        });
        if sent.is_err() {
            return (200, None);
        }
        if done == k {
            let mut end = Ok(());
            if ask.stream_usage {
                let mut last = head.body(Vec::new(), true);
                last["usage"] = head.usage(tokens, counts.cached);
                end = sse.event(&last);
            }
            let end = end.and_then(|()| sse.data("[DONE]")).and_then(|()| sse.w.finish());
            return (200, end.ok().map(|()| Outcome { finish, tokens, counts }));
        }
        event = match events.recv() {
            Some(e) => e,
            None => return (200, None),
        };
    }
}

/// The rest of a Responses API stream whose first event is `first`: the response created and in
/// progress, then its output items, each added, its text or arguments as they come and done
/// (a message: its text part added, deltas, the text and the part done; a tool call: deltas of
/// its arguments, then them whole), then the response completed (or an `error` event where the
/// text could not be made). Without tools the message is added at once; where the answer may
/// call them, once its text begins. The status, and how it ended (`None` when the client went
/// away).
fn stream_response(
    mut sse: Sse,
    head: &Head,
    first: (usize, Event),
    events: &mut Events,
) -> (u16, Option<Outcome>) {
    let mut reader = head.reader();
    let mut out = Output { head, done: Vec::new(), open: None, messages: 0 };
    let mut start = || -> std::io::Result<()> {
        sse.typed("response.created", json!({"response": head.response(None)}))?;
        sse.typed("response.in_progress", json!({"response": head.response(None)}))?;
        match reader {
            Some(_) => Ok(()),
            None => out.open_message(&mut sse),
        }
    };
    if start().is_err() {
        return (200, None);
    }
    let mut pieces = Vec::new();
    let mut event = first;
    loop {
        let sent = match event.1 {
            Event::Prompt(_) => Ok(()),
            Event::Text(piece, _) => out.read(&mut sse, reader.as_mut(), &piece, false, &mut pieces),
            Event::Done { rest, finish, error, tokens, counts, .. } => {
                let outcome = Outcome { finish: vec![finish], tokens, counts };
                let end = match error {
                    Some(e) => sse.typed("error", json!({"code": null, "message": e, "param": null})),
                    None => out.read(&mut sse, reader.as_mut(), &rest, true, &mut pieces).and_then(|()| {
                        // An answer of no text and no calls is an empty message.
                        if out.done.is_empty() && out.open.is_none() {
                            out.open_message(&mut sse)?;
                        }
                        out.close(&mut sse)?;
                        let r = head.response(Some((
                            std::mem::take(&mut out.done),
                            finish,
                            tokens,
                            counts.cached,
                        )));
                        sse.typed("response.completed", json!({"response": r}))
                    }),
                };
                return (200, end.and_then(|()| sse.w.finish()).ok().map(|()| outcome));
            }
        };
        if sent.is_err() {
            return (200, None);
        }
        event = match events.recv() {
            Some(e) => e,
            None => return (200, None),
        };
    }
}

/// The output item of a Responses API stream being sent.
enum Item {
    /// A message: its number among the answer's messages, and its text so far.
    Message { k: usize, text: String },
    /// A tool call: its id, the tool's name and the arguments so far.
    Call { call_id: String, name: String, arguments: String },
}

/// The output items of a Responses API stream: those sent whole, the one being sent.
struct Output<'h> {
    head: &'h Head<'h>,
    done: Vec<Value>,
    open: Option<Item>,
    /// Messages begun.
    messages: usize,
}

impl Output<'_> {
    /// `text`, the answer's next piece, sent: as text, or read for its calls by `reader` (and
    /// all it held where the answer has `ended`); `pieces` is room for what it reads.
    fn read(
        &mut self,
        sse: &mut Sse,
        reader: Option<&mut Reader>,
        text: &str,
        ended: bool,
        pieces: &mut Vec<Piece>,
    ) -> std::io::Result<()> {
        let Some(reader) = reader else { return self.text(sse, text) };
        pieces.clear();
        reader.push(text, pieces);
        if ended {
            reader.finish(pieces);
        }
        for p in pieces.drain(..) {
            match p {
                Piece::Text(t) => self.text(sse, &t)?,
                Piece::Call { id, name, arguments, .. } => self.call(sse, id, name, &arguments)?,
                Piece::Arguments { text, .. } => self.arguments(sse, &text)?,
            }
        }
        Ok(())
    }

    /// Where a message's events are: its item, its output index, its one text part.
    fn at(&self, k: usize) -> Value {
        json!({"item_id": self.head.message_id(k), "output_index": self.done.len(), "content_index": 0})
    }

    fn open_message(&mut self, sse: &mut Sse) -> std::io::Result<()> {
        let k = self.messages;
        self.messages += 1;
        let item = self.head.response_message(k, "", "in_progress");
        sse.typed("response.output_item.added", json!({"output_index": self.done.len(), "item": item}))?;
        sse.typed("response.content_part.added", with(self.at(k), json!({"part": output_text("")})))?;
        self.open = Some(Item::Message { k, text: String::new() });
        Ok(())
    }

    /// More text: in the message being sent, or a new one.
    fn text(&mut self, sse: &mut Sse, piece: &str) -> std::io::Result<()> {
        if piece.is_empty() {
            return Ok(());
        }
        if !matches!(self.open, Some(Item::Message { .. })) {
            self.close(sse)?;
            self.open_message(sse)?;
        }
        let Some(Item::Message { k, text }) = &mut self.open else { return Ok(()) };
        text.push_str(piece);
        let at =
            json!({"item_id": self.head.message_id(*k), "output_index": self.done.len(), "content_index": 0});
        sse.typed("response.output_text.delta", with(at, json!({"delta": piece, "logprobs": []})))
    }

    /// A call begun, with the first of its arguments.
    fn call(&mut self, sse: &mut Sse, call_id: String, name: String, arguments: &str) -> std::io::Result<()> {
        self.close(sse)?;
        let item = function_call(&call_id, &name, "", "in_progress");
        sse.typed("response.output_item.added", json!({"output_index": self.done.len(), "item": item}))?;
        self.open = Some(Item::Call { call_id, name, arguments: String::new() });
        self.arguments(sse, arguments)
    }

    /// More of the arguments of the call being sent.
    fn arguments(&mut self, sse: &mut Sse, delta: &str) -> std::io::Result<()> {
        let index = self.done.len();
        let Some(Item::Call { call_id, arguments, .. }) = &mut self.open else { return Ok(()) };
        if delta.is_empty() {
            return Ok(());
        }
        arguments.push_str(delta);
        let v = json!({"item_id": function_call_id(call_id), "output_index": index, "delta": delta});
        sse.typed("response.function_call_arguments.delta", v)
    }

    /// The item being sent, done.
    fn close(&mut self, sse: &mut Sse) -> std::io::Result<()> {
        let index = self.done.len();
        let item = match self.open.take() {
            None => return Ok(()),
            Some(Item::Message { k, text }) => {
                let at = self.at(k);
                sse.typed(
                    "response.output_text.done",
                    with(at.clone(), json!({"text": text, "logprobs": []})),
                )?;
                sse.typed("response.content_part.done", with(at, json!({"part": output_text(&text)})))?;
                self.head.response_message(k, &text, "completed")
            }
            Some(Item::Call { call_id, name, arguments }) => {
                let item = function_call(&call_id, &name, &arguments, "completed");
                let v = json!({"item_id": item["id"], "output_index": index, "name": name, "arguments": arguments});
                sse.typed("response.function_call_arguments.done", v)?;
                item
            }
        };
        sse.typed("response.output_item.done", json!({"output_index": index, "item": item}))?;
        self.done.push(item);
        Ok(())
    }
}

/// `v` with the keys of `more` added.
fn with(mut v: Value, more: Value) -> Value {
    if let (Some(v), Value::Object(more)) = (v.as_object_mut(), more) {
        v.extend(more);
    }
    v
}

/// A stream of server-sent events in HTTP chunks, each flushed as it is written.
struct Sse {
    w: http::Chunked,
    /// Each choice not sent yet (a chat stream's first chunk of a choice carries the role).
    first: Vec<bool>,
    /// Bytes of each choice's text sent so far (the `text_offset` of its next token).
    offsets: Vec<usize>,
    /// Each choice whose echoed prompt was sent.
    echoed: Vec<bool>,
    /// Events of a Responses API stream sent so far (each event's `sequence_number`).
    sequence: u64,
}

impl Sse {
    fn data(&mut self, data: &str) -> std::io::Result<()> {
        self.w.chunk(format!("data: {data}\n\n").as_bytes())
    }

    /// A Responses API event of type `kind` (named in the event and in its data, with its
    /// sequence number) whose data is `v`, an object.
    fn typed(&mut self, kind: &str, mut v: Value) -> std::io::Result<()> {
        v["type"] = json!(kind);
        v["sequence_number"] = json!(self.sequence);
        self.sequence += 1;
        self.w.chunk(format!("event: {kind}\ndata: {v}\n\n").as_bytes())
    }

    fn event(&mut self, v: &Value) -> std::io::Result<()> {
        self.data(&v.to_string())
    }

    fn piece(
        &mut self,
        head: &Head,
        index: usize,
        piece: (&str, &Entries),
        ended: Option<(Finish, Option<&StopBy>)>,
    ) -> std::io::Result<()> {
        let c = head.choice(index, piece, &mut self.offsets[index], ended, true);
        self.send(head, index, c)
    }

    /// Sends chunk `c` of choice `index`, the choice's first carrying the role.
    fn send(&mut self, head: &Head, index: usize, mut c: Value) -> std::io::Result<()> {
        if std::mem::take(&mut self.first[index]) && head.kind == Kind::Chat {
            c["delta"]["role"] = json!("assistant");
        }
        self.event(&head.body(vec![c], true))
    }

    /// A piece of an answer that may call tools: `text` (the tokens `lps`) read by the answer's
    /// `reader`, then (where it `ended`) what the reader held. Text goes out as content, with
    /// the tokens' log-probabilities (even where the reader holds it back); each call as a
    /// chunk of `tool_calls` (its id, name and arguments so far), then more of its arguments
    /// as they come. The last chunk ends the answer for its calls where it made any.
    fn calls(
        &mut self,
        head: &Head,
        index: usize,
        reader: &mut Reader,
        text: &str,
        lps: &Entries,
        ended: Option<(Finish, Option<&StopBy>)>,
    ) -> std::io::Result<()> {
        let mut pieces = Vec::new();
        reader.push(text, &mut pieces);
        if ended.is_some() {
            reader.finish(&mut pieces);
        }
        let mut content = String::new();
        let mut calls = Vec::new();
        for p in pieces {
            match p {
                Piece::Text(t) => content.push_str(&t),
                Piece::Call { index: at, id, name, arguments } => {
                    calls.push(with(json!({"index": at}), tools::call_json(&id, &name, &arguments)))
                }
                Piece::Arguments { index: at, text } => {
                    calls.push(json!({"index": at, "function": {"arguments": text}}))
                }
            }
        }
        if !content.is_empty() || (head.logprobs && !lps.is_empty()) {
            self.piece(head, index, (&content, lps), None)?;
        }
        for call in calls {
            let mut c = head.choice(index, ("", &[]), &mut self.offsets[index], None, true);
            c["delta"] = json!({"tool_calls": [call]});
            c["logprobs"] = Value::Null;
            self.send(head, index, c)?;
        }
        let Some(ended) = ended else { return Ok(()) };
        let mut c = head.choice(index, ("", &[]), &mut self.offsets[index], Some(ended), true);
        if reader.called() {
            head.ended_for_calls(&mut c);
        }
        c["logprobs"] = Value::Null;
        self.send(head, index, c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tools::ToolChoice;

    fn defaults() -> Defaults {
        let template_vars = serde_json::from_value(json!({"enable_thinking": true, "x": 1})).unwrap();
        let params = SamplingParams { seed: 100, ..Default::default() };
        Defaults { max_tokens: 32, template_vars, params, tool_parser: None, pooling: Ok(Pooling::Last) }
    }

    fn ask(kind: Kind, body: &str) -> std::result::Result<Ask, String> {
        parse(kind, body.as_bytes(), &defaults(), 3)
    }

    #[test]
    fn completion_requests_take_openai_settings() {
        let a = ask(Kind::Completion, r#"{"model":"m","prompt":"hi","max_tokens":5,"temperature":0.7,"top_p":0.9,"stop":"x","stream":true,"stream_options":{"include_usage":true},"n":1,"presence_penalty":0,"logprobs":null,"user":"u"}"#).unwrap();
        assert_eq!(
            (a.prompts.concat().as_str(), a.max_tokens, a.stop.clone(), a.stream, a.stream_usage),
            ("hi", 5, vec!["x".into()], true, true)
        );
        assert_eq!((a.params.temperature, a.params.top_p, a.params.seed), (0.7, 0.9, 103));
        // The server's settings where the request gives none; a prompt as a list of one.
        let a = ask(Kind::Completion, r#"{"prompt":["hi"],"seed":5,"stop":["a","b"]}"#).unwrap();
        assert_eq!(
            (a.max_tokens, a.params.temperature, a.params.seed, a.stop.len(), a.stream),
            (32, 0.0, 5, 2, false)
        );
    }

    /// A completion's prompt may come as token ids: a list, or a list of lists.
    #[test]
    fn prompts_of_token_ids() {
        let a = ask(Kind::Completion, r#"{"prompt":[1,2,3]}"#).unwrap();
        assert_eq!((a.prompts.len(), a.token_prompts.clone()), (0, vec![vec![1, 2, 3]]));
        let a = ask(Kind::Completion, r#"{"prompt":[[4],[5,6]],"n":2}"#).unwrap();
        assert_eq!(a.token_prompts, vec![vec![4], vec![5, 6]]);
        for body in [
            r#"{"prompt":[1,-2]}"#,
            r#"{"prompt":[[1],[]]}"#,
            r#"{"prompt":[1,"a"]}"#,
            r#"{"prompt":[4294967296]}"#,
        ] {
            let e = ask(Kind::Completion, body).unwrap_err();
            assert!(e.contains("a list of token ids or a list of such lists"), "{body}: {e}");
        }
        let e = ask(Kind::Completion, r#"{"prompt":[[1],[2],[3]],"n":22}"#).unwrap_err();
        assert!(e.contains("got 3 × 22"), "{e}");
    }

    #[test]
    fn several_prompts_and_completions_a_request() {
        let a = ask(Kind::Completion, r#"{"prompt":["a","b","c"],"n":2}"#).unwrap();
        assert_eq!((a.prompts.clone(), a.n), (vec!["a".into(), "b".into(), "c".into()], 2));
        let a = ask(Kind::Chat, r#"{"messages":[{"role":"user","content":"hi"}],"n":64}"#).unwrap();
        assert_eq!(a.n, 64);
        for body in [r#"{"prompt":"a","n":0}"#, r#"{"prompt":["a","b"],"n":33}"#] {
            let e = ask(Kind::Completion, body).unwrap_err();
            assert!(e.contains("`n`: from 1 to 64 completions a request"), "{body}: {e}");
        }
        let e = ask(Kind::Completion, r#"{"prompt":[]}"#).unwrap_err();
        assert!(e.contains("a string, a list of strings"), "{e}");
    }

    /// Completions ask for log-probabilities with the number of alternatives, chat with
    /// `logprobs` true and `top_logprobs`; absent, null or false ask for none.
    #[test]
    fn log_probabilities_as_openai_asks() {
        let msgs = r#""messages":[{"role":"user","content":"a"}]"#;
        for (kind, body, want) in [
            (Kind::Completion, r#"{"prompt":"a","logprobs":3}"#.to_string(), Some(3)),
            (Kind::Completion, r#"{"prompt":"a","logprobs":0}"#.to_string(), Some(0)),
            (Kind::Completion, r#"{"prompt":"a","logprobs":null}"#.to_string(), None),
            (Kind::Chat, format!(r#"{{{msgs},"logprobs":true,"top_logprobs":4}}"#), Some(4)),
            (Kind::Chat, format!(r#"{{{msgs},"logprobs":true}}"#), Some(0)),
            (Kind::Chat, format!(r#"{{{msgs},"logprobs":false}}"#), None),
        ] {
            assert_eq!(ask(kind, &body).unwrap().logprobs, want, "{body}");
        }
    }

    #[test]
    fn chat_template_variables_go_over_the_server_s() {
        let a = ask(Kind::Chat, r#"{"messages":[{"role":"user","content":"a"}]}"#).unwrap();
        assert_eq!(Value::Object(a.template_vars), json!({"enable_thinking": true, "x": 1}));
        let body = r#"{"messages":[{"role":"user","content":"a"}],"chat_template_kwargs":{"enable_thinking":false}}"#;
        let a = ask(Kind::Chat, body).unwrap();
        assert_eq!(Value::Object(a.template_vars), json!({"enable_thinking": false, "x": 1}));
        let e = ask(Kind::Completion, r#"{"prompt":"a","chat_template_kwargs":{}}"#).unwrap_err();
        assert!(e.contains("`chat_template_kwargs` belongs to /v1/chat/completions"), "{e}");
        // How the chat ends: vLLM's keys.
        let body = r#"{"messages":[{"role":"user","content":"a"}],"continue_final_message":true}"#;
        assert_eq!(ask(Kind::Chat, body).unwrap().chat_end, ChatEnd::Open);
        let body = r#"{"messages":[{"role":"user","content":"a"}],"add_generation_prompt":false}"#;
        assert_eq!(ask(Kind::Chat, body).unwrap().chat_end, ChatEnd::Closed);
        let e = ask(Kind::Completion, r#"{"prompt":"a","continue_final_message":true}"#).unwrap_err();
        assert!(e.contains("`continue_final_message` belongs to /v1/chat/completions"), "{e}");
        let body = r#"{"messages":[{"role":"user","content":"a"}],"chat_template_kwargs":{"messages":[]}}"#;
        let e = ask(Kind::Chat, body).unwrap_err();
        assert!(e.starts_with("`chat_template_kwargs`: `messages` is set by gridlm"), "{e}");
        let body = r#"{"messages":[{"role":"user","content":"a"}],"chat_template_kwargs":[1]}"#;
        assert!(ask(Kind::Chat, body).unwrap_err().starts_with("`chat_template_kwargs`: invalid type"));
    }

    #[test]
    fn chat_requests_read_messages() {
        let a = ask(
            Kind::Chat,
            r#"{"messages":[{"role":"system","content":"be brief"},{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}],"max_completion_tokens":7}"#,
        )
        .unwrap();
        assert_eq!(a.messages, [("system", "be brief"), ("user", "ab")]);
        assert_eq!(a.max_tokens, 7);
    }

    /// OpenAI's settings gridlm does not act on are taken where they ask for nothing (as
    /// clients send them unasked), and the request is the one without them.
    #[test]
    fn openai_settings_that_ask_for_nothing_are_taken() {
        let plain = ask(Kind::Chat, r#"{"messages":[{"role":"user","content":"a"}]}"#).unwrap();
        let neutral = r#"{"messages":[{"role":"user","content":"a"}],"logit_bias":{},"tools":[],
            "tool_choice":"none","parallel_tool_calls":false,"response_format":{"type":"text"},
            "store":false,"metadata":{"who":"me"},"service_tier":"auto","functions":null,
            "modalities":["text"],"prediction":null}"#;
        let a = ask(Kind::Chat, neutral).unwrap();
        assert_eq!((a.messages, a.params, a.max_tokens), (plain.messages, plain.params, plain.max_tokens));
        assert_eq!((a.rules, a.format), (plain.rules, None));
        // vLLM's and OpenAI's token rules, taken.
        let rules =
            r#"{"prompt":"a","logit_bias":{"28":-100," 7":2.5},"min_tokens":3,"stop_token_ids":[2,9]}"#;
        let r = ask(Kind::Completion, rules).unwrap().rules;
        assert_eq!(
            r,
            TokenRules {
                min_tokens: 3,
                stop_token_ids: vec![2, 9],
                logit_bias: vec![(7, 2.5), (28, -100.0)]
            }
        );
        let a = ask(Kind::Completion, r#"{"prompt":"a","best_of":1,"suffix":"","logit_bias":null}"#).unwrap();
        assert_eq!(a.prompts, vec!["a".to_string()]);
    }

    /// A Responses API request read as the chat it makes: instructions first, the input's
    /// messages (a developer's as a system one, text parts), its limit and its format.
    #[test]
    fn responses_requests_are_read_as_chats() {
        let body = r#"{"model":"m","instructions":"be brief","input":[{"role":"developer","content":"d"},
            {"type":"message","role":"user","content":[{"type":"input_text","text":"a"},{"type":"input_text","text":"b"}]}],
            "max_output_tokens":7,"temperature":0.5,"store":true,"metadata":{"k":"v"},"reasoning":null,"include":[],
            "text":{"format":{"type":"json_schema","name":"x","schema":{"type":"integer"},"strict":true}}}"#;
        let a = ask(Kind::Response, body).unwrap();
        let m: Vec<(&str, &str)> = a.messages.iter().map(|m| (m.role.as_str(), m.content.as_str())).collect();
        assert_eq!(m, [("system", "be brief"), ("system", "d"), ("user", "ab")]);
        assert_eq!((a.max_tokens, a.params.temperature, a.n), (7, 0.5, 1));
        assert_eq!(a.format, Some(Format::JsonSchema(json!({"type": "integer"}))));
        let a = ask(Kind::Response, r#"{"input":"hi","text":{"format":{"type":"text"}}}"#).unwrap();
        assert_eq!((a.messages, a.format), (vec![Message::new("user", "hi")], None));
        // Tools in the chat's form; an answer's text and calls one assistant message, a call's
        // output a tool's message.
        let body = r#"{"input":[{"role":"user","content":"weather?"},
            {"type":"message","role":"assistant","content":[{"type":"output_text","text":"Let me see."}]},
            {"type":"function_call","call_id":"call_1","name":"w","arguments":"{\"city\": \"Oslo\"}"},
            {"type":"function_call","call_id":"call_2","name":"w","arguments":"{}"},
            {"type":"function_call_output","call_id":"call_1","output":"cold"},
            {"type":"function_call","call_id":"call_3","name":"w","arguments":"{}"}],
            "tools":[{"type":"function","name":"w","description":"d","parameters":{"type":"object"},"strict":true}],
            "tool_choice":{"type":"function","name":"w"},"parallel_tool_calls":false}"#;
        let a = ask(Kind::Response, body).unwrap();
        let t = a.tools.as_ref().unwrap();
        let chat_tool = json!({"type": "function", "function": {"name": "w", "description": "d",
            "parameters": {"type": "object"}, "strict": true}});
        assert_eq!(
            (&t.list, &t.choice, t.parallel),
            (&vec![chat_tool], &ToolChoice::Named("w".into()), false)
        );
        assert_eq!(
            (t.responses_list(), t.responses_choice()),
            (
                vec![
                    json!({"type": "function", "name": "w", "description": "d", "parameters": {"type": "object"}, "strict": true})
                ],
                json!({"type": "function", "name": "w"})
            )
        );
        let m: Vec<(&str, &str, usize)> = a
            .messages
            .iter()
            .map(|m| {
                (
                    m.role.as_str(),
                    m.content.as_str(),
                    m.more.get("tool_calls").and_then(Value::as_array).map_or(0, Vec::len),
                )
            })
            .collect();
        assert_eq!(
            m,
            [
                ("user", "weather?", 0),
                ("assistant", "Let me see.", 2),
                ("tool", "cold", 0),
                ("assistant", "", 1)
            ]
        );
        assert_eq!(a.messages[1].more["tool_calls"][0]["function"]["arguments"], json!({"city": "Oslo"}));
        assert_eq!(a.messages[2].more["tool_call_id"], "call_1");
        for (body, msg) in [
            (r#"{"input":[]}"#, "`input` must be a string or a non-empty list of messages"),
            (r#"{"input":"a","n":2}"#, "`n` is no key of /v1/responses"),
            (r#"{"input":[{"role":"tool","content":"a"}]}"#, "`input[0]`: role tool"),
            (
                r#"{"input":[{"role":"user","content":[{"type":"input_image"}]}]}"#,
                "`input[0]`: a content part of type input_image",
            ),
            (r#"{"input":"a","background":true}"#, "`background`: OpenAI's setting"),
            (r#"{"input":"a","text":{"format":{"type":"xml"}}}"#, "`text.format`: `type` is \"xml\""),
            (r#"{"input":"a","text":{"format":{"type":"json_schema"}}}"#, "`text.format`: `schema` must be"),
        ] {
            let e = ask(Kind::Response, body).unwrap_err();
            assert!(e.starts_with(msg), "{body}: {e}");
        }
    }

    #[test]
    fn bad_requests_name_what_is_wrong() {
        for (kind, body, fragment) in [
            (Kind::Completion, "[1]", "not a JSON object"),
            (Kind::Completion, r#"{"prompt":"a","temprature":1}"#, "unknown key `temprature`"),
            (
                Kind::Completion,
                r#"{"prompt":"a","prediction":{"type":"content","content":"b"}}"#,
                "`prediction`: OpenAI's setting, which gridlm does not support",
            ),
            (
                Kind::Completion,
                r#"{"prompt":"a","response_format":{"type":"xml"}}"#,
                "`response_format`: `type` is \"xml\": text, json_object or json_schema",
            ),
            (
                Kind::Chat,
                r#"{"messages":[{"role":"user","content":"a"}],"response_format":{"type":"json_schema"}}"#,
                "`response_format`: `json_schema.schema` must be a JSON schema (an object)",
            ),
            (
                Kind::Completion,
                r#"{"prompt":"a","logit_bias":{"28":-101}}"#,
                "`logit_bias`: the bias of token 28 must be in [-100, 100], got -101",
            ),
            (
                Kind::Chat,
                r#"{"messages":[{"role":"user","content":"a"}],"min_tokens":-1}"#,
                "`min_tokens`: invalid value",
            ),
            (Kind::Completion, r#"{"prompt":"a","stop_token_ids":2}"#, "`stop_token_ids`: invalid type"),
            // Tools are a chat's (and the Responses API's own are not taken).
            (
                Kind::Completion,
                r#"{"prompt":"a","tools":[{"type":"function"}]}"#,
                "`tools`: OpenAI's setting",
            ),
            (
                Kind::Response,
                r#"{"input":"a","tools":[{"type":"function"}]}"#,
                "`tools[0].name` must be 1 to 64 letters",
            ),
            (
                Kind::Response,
                r#"{"input":"a","tools":[{"type":"web_search"}]}"#,
                "`tools[0]`: a tool of type web_search (only functions are taken)",
            ),
            (
                Kind::Response,
                r#"{"input":"a","tools":[{"type":"function","name":"f","function":{}}]}"#,
                "`tools[0].function`: not a key of a function tool",
            ),
            (
                Kind::Response,
                r#"{"input":"a","tools":[{"type":"function","name":"f"}],"tool_choice":{"type":"allowed_tools"}}"#,
                "`tool_choice` must be none, auto, required or {\"type\": \"function\", \"name\": ...}",
            ),
            (
                Kind::Response,
                r#"{"input":"a","tools":[{"type":"function","name":"f"}]}"#,
                "`tool_choice` auto (the default where `tools` are given)",
            ),
            (
                Kind::Response,
                r#"{"input":"a","tools":[{"type":"function","name":"f"}],"tool_choice":"required","text":{"format":{"type":"json_object"}}}"#,
                "`tool_choice` holds the answer to a tool call, so it takes no other format",
            ),
            (
                Kind::Response,
                r#"{"input":[{"type":"function_call","call_id":"c","name":"f","arguments":"{"}]}"#,
                "`input[0]`: `arguments` is not JSON",
            ),
            (
                Kind::Response,
                r#"{"input":[{"type":"function_call_output","output":"x"}]}"#,
                "`input[0]`: `call_id` is missing",
            ),
            (
                Kind::Chat,
                r#"{"messages":[{"role":"user","content":"a"}],"tools":[{"type":"x"}]}"#,
                "`tools[0]`: only tools of type function are taken",
            ),
            (
                Kind::Chat,
                r#"{"messages":[{"role":"user","content":"a"}],"tool_choice":"required","tools":[{"type":"function","function":{"name":"f"}}],"response_format":{"type":"json_object"}}"#,
                "`tool_choice` holds the answer to a tool call, so it takes no other format",
            ),
            (
                Kind::Chat,
                r#"{"messages":[{"role":"assistant","tool_calls":[{"function":{"name":"f","arguments":"{"}}]}]}"#,
                "`messages[0].tool_calls[0].function.arguments` is not JSON",
            ),
            (Kind::Completion, r#"{"prompt":"a","best_of":2}"#, "`best_of`: OpenAI's setting"),
            (
                Kind::Completion,
                &format!(r#"{{"prompt":"a","tools":[{}]}}"#, ["{}"; 40].join(",")),
                "(got [{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{}…)",
            ),
            (Kind::Completion, r#"{"max_tokens":3}"#, "no `prompt`"),
            (Kind::Completion, r#"{"prompt":["a",1]}"#, "`prompt` must be a string"),
            (Kind::Completion, r#"{"messages":[]}"#, "belongs to /v1/chat/completions"),
            (Kind::Completion, r#"{"prompt":"a","max_tokens":0}"#, "`max_tokens` must be at least 1"),
            (
                Kind::Chat,
                r#"{"messages":[{"role":"user","content":"a"}],"echo":true}"#,
                "belongs to /v1/completions",
            ),
            (Kind::Completion, r#"{"prompt":"a","echo":1}"#, "`echo`"),
            (Kind::Completion, r#"{"prompt":"a","max_tokens":-1}"#, "`max_tokens`"),
            (Kind::Completion, r#"{"prompt":"a","temperature":-1}"#, "`temperature` must be"),
            (Kind::Completion, r#"{"prompt":"a","top_p":0}"#, "`top_p`"),
            (Kind::Completion, r#"{"prompt":"a","stop":""}"#, "stop string is empty"),
            (Kind::Completion, r#"{"prompt":"a","n":-1}"#, "`n`"),
            (
                Kind::Completion,
                r#"{"prompt":"a","frequency_penalty":2.5}"#,
                "`frequency_penalty` must be in [-2, 2]",
            ),
            (Kind::Completion, r#"{"prompt":"a","presence_penalty":"x"}"#, "`presence_penalty`"),
            (Kind::Completion, r#"{"prompt":"a","logprobs":21}"#, "`logprobs`: at most 20 alternatives"),
            (Kind::Completion, r#"{"prompt":"a","logprobs":true}"#, "`logprobs`"),
            (Kind::Completion, r#"{"prompt":"a","top_logprobs":2}"#, "belongs to /v1/chat/completions"),
            (
                Kind::Chat,
                r#"{"messages":[{"role":"user","content":"a"}],"top_logprobs":2}"#,
                "needs `logprobs`: true",
            ),
            (
                Kind::Chat,
                r#"{"messages":[{"role":"user","content":"a"}],"logprobs":true,"top_logprobs":30}"#,
                "`top_logprobs`: at most 20",
            ),
            (Kind::Completion, r#"{"prompt":"a","stream":"yes"}"#, "`stream`"),
            (Kind::Chat, r#"{"prompt":"a"}"#, "belongs to /v1/completions"),
            (Kind::Chat, r#"{"messages":[]}"#, "`messages` is empty"),
            (Kind::Chat, r#"{"messages":[{"content":"a"}]}"#, "`messages[0]` has no `role`"),
            (Kind::Chat, r#"{"messages":[{"role":"user","content":[{"type":"image_url"}]}]}"#, "image_url"),
            (Kind::Chat, r#"{"messages":[{"role":1}]}"#, "`messages[0].role` must be a string"),
            (
                Kind::Chat,
                r#"{"messages":[{"role":"user","content":"a"},{"role":"user","content":5}]}"#,
                "`messages[1].content` must be a string or a list of text parts",
            ),
            (Kind::Completion, r#"{"prompt":"a","top_k":-1}"#, "`top_k`: invalid value: integer `-1`"),
            (Kind::Completion, r#"{"prompt":"a","seed":-1}"#, "`seed`: invalid value"),
            (
                Kind::Completion,
                r#"{"prompt":"a","stop":[1]}"#,
                "`stop` must be a string or a list of strings",
            ),
        ] {
            let e = ask(kind, body).unwrap_err();
            assert!(e.contains(fragment), "{body}: {e}");
            // One pair of backticks around each name.
            assert!(!e.contains("``") && e.matches('`').count().is_multiple_of(2), "{body}: {e}");
        }
    }

    #[test]
    fn origins_are_written_as_browsers_send_them() {
        for (given, want) in [
            ("http://localhost:3000", "http://localhost:3000"),
            ("HTTP://LocalHost:80", "http://localhost"),
            ("https://chat.example.com:443", "https://chat.example.com"),
            ("https://[::1]:8443", "https://[::1]:8443"),
            ("https://[::1]", "https://[::1]"),
            ("app://desk", "app://desk"),
            ("null", "null"),
            ("*", "*"),
        ] {
            assert_eq!(origin(given).as_deref(), Ok(want), "{given}");
        }
        assert_eq!(
            origin("http://localhost:3000/").unwrap_err(),
            "an origin has no path: http://localhost:3000"
        );
        for bad in ["localhost:3000", "http://", "http://h:99999", "http://u@h", "://h", "ht tp://h"] {
            assert!(origin(bad).unwrap_err().starts_with("an origin is SCHEME://HOST[:PORT]"), "{bad}");
        }
    }

    #[test]
    fn finish_reasons_are_openai_s() {
        let reasons = [Finish::Eos, Finish::Stop, Finish::Length, Finish::Context].map(finish_reason);
        assert_eq!(reasons, ["stop", "stop", "length", "length"]);
    }
}
