//! Tool calling in chat requests and the Responses API's (OpenAI's `tools`, `tool_choice`,
//! `parallel_tool_calls`; the Responses API's in the chat's form, [`chat_form_of_responses`]):
//! the tools reach the chat template (its `tools` variable, as HF's `apply_chat_template`
//! passes them), and the answer is read for the calls it makes. A named tool or `required`
//! holds the answer to the call's JSON (structured output, so any model gives a call that
//! parses); `auto` lets the model answer or call, its calls read from its text by the parser
//! the server was started with (`hermes`: `<tool_call>{"name": ..., "arguments": ...}</tool_call>`,
//! the form of Qwen2.5, Qwen3 and Hermes models; `llama3_json`: an answer that is
//! `{"name": ..., "parameters": ...}`, Llama 3.1's and 3.2's JSON calls).
//!
//! The same [`Reader`] reads a whole answer and a streamed one, so both give the same calls.

use crate::grammar::Format;
use serde_json::{json, Map, Value};

/// Which tools the answer may call (`tool_choice`).
#[derive(Debug, Clone, PartialEq)]
pub enum ToolChoice {
    /// No call: the answer is text.
    None,
    /// The model answers or calls, as it writes (read by the server's parser).
    Auto,
    /// One call or more, of any of the tools.
    Required,
    /// One call of this tool.
    Named(String),
}

/// A request's tools and how the answer may call them.
#[derive(Debug, Clone, PartialEq)]
pub struct Tools {
    /// The tools as given (`{"type": "function", "function": {...}}`), for the template.
    pub list: Vec<Value>,
    pub choice: ToolChoice,
    /// More than one call in an answer (`parallel_tool_calls`, true unless false).
    pub parallel: bool,
}

/// How calls are read from an answer whose tool choice is `auto` (`--tool-call-parser`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Parser {
    /// `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one a call (Qwen2.5, Qwen3,
    /// Hermes 2 Pro and later).
    Hermes,
    /// An answer that is `{"name": ..., "parameters": {...}}` (or several, `;` between them),
    /// after `<|python_tag|>` or not (Llama 3.1, 3.2, 3.3 with JSON tool calls).
    #[value(name = "llama3_json")]
    Llama3Json,
}

/// The most tools a request may give.
pub const MAX_TOOLS: usize = 128;

/// A tool's name as OpenAI takes it: 1 to 64 of `a-z A-Z 0-9 _ -`.
fn good_name(n: &str) -> bool {
    (1..=64).contains(&n.len()) && n.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// A tool's name and the schema of its arguments (an object with no properties where it gives
/// none).
fn name_and_parameters(t: &Value) -> (&str, Value) {
    let f = &t["function"];
    let params = f.get("parameters").filter(|p| !p.is_null()).cloned();
    (
        f["name"].as_str().unwrap_or_default(),
        params.unwrap_or_else(|| json!({"type": "object", "properties": {}})),
    )
}

impl Tools {
    /// A request's `tools` (none where it gives none), each checked: a function with a good
    /// name, given once, and a schema of its parameters. The error names the tool.
    pub fn list(obj: &Map<String, Value>) -> Result<Vec<Value>, String> {
        let list = match obj.get("tools") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(a)) => a.clone(),
            Some(_) => return Err("`tools` must be a list of tools".into()),
        };
        if list.len() > MAX_TOOLS {
            return Err(format!("`tools`: at most {MAX_TOOLS} tools, got {}", list.len()));
        }
        let mut names: Vec<&str> = Vec::with_capacity(list.len());
        for (i, t) in list.iter().enumerate() {
            let at = |what: &str| format!("`tools[{i}]{what}");
            if t.get("type").and_then(Value::as_str) != Some("function") {
                return Err(at("`: only tools of type function are taken"));
            }
            let Some(f) = t.get("function").and_then(Value::as_object) else {
                return Err(at(".function` must be an object"));
            };
            let name = f.get("name").and_then(Value::as_str).unwrap_or_default();
            if !good_name(name) {
                return Err(at(".function.name` must be 1 to 64 letters, digits, `_` or `-`"));
            }
            if names.contains(&name) {
                return Err(at(&format!(".function.name`: `{name}` is given twice")));
            }
            names.push(name);
            if !matches!(f.get("parameters"), None | Some(Value::Null | Value::Object(_))) {
                return Err(at(".function.parameters` must be a JSON schema (an object)"));
            }
            if !matches!(f.get("description"), None | Some(Value::Null | Value::String(_))) {
                return Err(at(".function.description` must be a string"));
            }
        }
        Ok(list)
    }

    /// A chat request's `tools`, `tool_choice` and `parallel_tool_calls`, checked; `None`
    /// where it gives no tools (and no choice but `none`). `parser` is the server's: `auto`
    /// needs one. The error names the key and what is wrong.
    pub fn read(obj: &Map<String, Value>, parser: Option<Parser>) -> Result<Option<Tools>, String> {
        let list = Tools::list(obj)?;
        let names: Vec<&str> = list.iter().filter_map(|t| t["function"]["name"].as_str()).collect();
        let choice = match obj.get("tool_choice") {
            None | Some(Value::Null) if list.is_empty() => ToolChoice::None,
            None | Some(Value::Null) => ToolChoice::Auto,
            Some(Value::String(s)) => match s.as_str() {
                "none" => ToolChoice::None,
                "auto" => ToolChoice::Auto,
                "required" => ToolChoice::Required,
                _ => return Err(format!("`tool_choice` is \"{s}\": none, auto, required or a tool")),
            },
            Some(v) => {
                let name = v.get("function").and_then(|f| f.get("name")).and_then(Value::as_str);
                match (v.get("type").and_then(Value::as_str), name) {
                    (Some("function"), Some(n)) => ToolChoice::Named(n.to_string()),
                    _ => {
                        return Err("`tool_choice` must be none, auto, required or \
                                    {\"type\": \"function\", \"function\": {\"name\": ...}}"
                            .into())
                    }
                }
            }
        };
        let parallel = match obj.get("parallel_tool_calls") {
            None | Some(Value::Null) => true,
            Some(Value::Bool(b)) => *b,
            Some(_) => return Err("`parallel_tool_calls` must be true or false".into()),
        };
        match &choice {
            ToolChoice::None if list.is_empty() => return Ok(None),
            _ if list.is_empty() => return Err("`tool_choice` calls a tool, but `tools` gives none".into()),
            ToolChoice::Named(n) if !names.contains(&n.as_str()) => {
                return Err(format!("`tool_choice` names `{n}`, which is not among `tools`"))
            }
            ToolChoice::Auto if parser.is_none() => {
                let how = "calls are read from a model's text only with --tool-call-parser";
                return Err(format!(
                    "`tool_choice` auto (the default where `tools` are given): {how}; ask for `required` \
                     or a tool by name, or `none`"
                ));
            }
            _ => {}
        }
        Ok(Some(Tools { list, choice, parallel }))
    }

    /// What the answer must be: the named tool's arguments, or (`required`) a list of calls
    /// `[{"name": ..., "parameters": {...}}, ...]` of the tools (one at most where calls are
    /// not parallel); `None` where the model answers as it will.
    pub fn format(&self) -> Option<Format> {
        match &self.choice {
            ToolChoice::None | ToolChoice::Auto => None,
            ToolChoice::Named(n) => {
                let t = self.list.iter().find(|t| t["function"]["name"] == n.as_str())?;
                Some(Format::JsonSchema(name_and_parameters(t).1))
            }
            ToolChoice::Required => {
                let one = |t: &Value| {
                    let (name, params) = name_and_parameters(t);
                    json!({
                        "type": "object",
                        "properties": {"name": {"type": "string", "enum": [name]}, "parameters": params},
                        "required": ["name", "parameters"],
                        "additionalProperties": false,
                    })
                };
                let mut s = json!({"type": "array", "minItems": 1, "items": {"anyOf": self.list.iter().map(one).collect::<Vec<_>>()}});
                if !self.parallel {
                    s["maxItems"] = json!(1);
                }
                Some(Format::JsonSchema(s))
            }
        }
    }

    /// The answer's format (`format`, none where the request gives none) with these tools:
    /// where the choice holds the answer to calls ([`Tools::format`]), theirs, and then a
    /// format given beside them (by one of `keys`) is refused.
    pub fn held_format(&self, format: &mut Option<Format>, keys: &str) -> Result<(), String> {
        if let Some(calls) = self.format() {
            if format.is_some() {
                return Err(format!(
                    "`tool_choice` holds the answer to a tool call, so it takes no other format ({keys})"
                ));
            }
            *format = Some(calls);
        }
        Ok(())
    }

    /// The `finish_reason` of an answer that made calls: `tool_calls`, but `stop` for a tool
    /// called by name (as OpenAI and vLLM give it).
    pub fn finish_reason(&self) -> &'static str {
        match self.choice {
            ToolChoice::Named(_) => "stop",
            _ => "tool_calls",
        }
    }
}

/// The chat template's `tools` (as HF's `apply_chat_template` passes them) where a request gives
/// any, over those of the variables `vars` had.
pub fn for_template(vars: &mut crate::tokenizer::TemplateVars, tools: &[Value]) {
    if !tools.is_empty() {
        vars.insert("tools".into(), Value::Array(tools.to_vec()));
    }
}

/// A call as OpenAI's `tool_calls` give it: its id, `type` function, and the tool's name and
/// the arguments' JSON text.
pub fn call_json(id: &str, name: &str, arguments: &str) -> Value {
    json!({"id": id, "type": "function", "function": {"name": name, "arguments": arguments}})
}

/// The keys of a function tool in the Responses API, beside its `type`.
const RESPONSES_TOOL_KEYS: [&str; 4] = ["name", "description", "parameters", "strict"];

/// A Responses API request's `tools` and `tool_choice` in the chat's form, which
/// [`Tools::read`] reads: a function tool there gives its `name`, `description`, `parameters`
/// and `strict` beside its `type` (the chat's, inside `function`), a chosen tool is
/// `{"type": "function", "name": ...}`. The error names the key as the request gives it.
pub fn chat_form_of_responses(obj: &mut Map<String, Value>) -> Result<(), String> {
    if let Some(Value::Array(list)) = obj.get_mut("tools") {
        for (i, t) in list.iter_mut().enumerate() {
            let at = |what: &str| format!("`tools[{i}]{what}");
            let Some(o) = t.as_object() else { return Err(at("` must be an object")) };
            match o.get("type").and_then(Value::as_str) {
                Some("function") => {}
                Some(kind) => {
                    return Err(at(&format!("`: a tool of type {kind} (only functions are taken)")))
                }
                None => return Err(at(".type` is missing")),
            }
            if let Some(k) = o.keys().find(|k| *k != "type" && !RESPONSES_TOOL_KEYS.contains(&k.as_str())) {
                let keys = RESPONSES_TOOL_KEYS.join(", ");
                return Err(at(&format!(".{k}`: not a key of a function tool (type, {keys})")));
            }
            let f: Map<String, Value> =
                o.iter().filter(|(k, _)| *k != "type").map(|(k, v)| (k.clone(), v.clone())).collect();
            *t = json!({"type": "function", "function": f});
        }
    }
    if let Some(c) = obj.get_mut("tool_choice").filter(|c| c.is_object()) {
        match (c.get("type").and_then(Value::as_str), c.get("name").and_then(Value::as_str)) {
            (Some("function"), Some(n)) => *c = json!({"type": "function", "function": {"name": n}}),
            _ => {
                return Err(
                    "`tool_choice` must be none, auto, required or {\"type\": \"function\", \"name\": ...}"
                        .into(),
                )
            }
        }
    }
    Ok(())
}

impl Tools {
    /// The tools as the Responses API gives them back: `{"type": "function", "name": ...,
    /// ...}`.
    pub fn responses_list(&self) -> Vec<Value> {
        let flat = |t: &Value| {
            let mut f = Map::from_iter([("type".to_string(), json!("function"))]);
            f.extend(t["function"].as_object().cloned().unwrap_or_default());
            Value::Object(f)
        };
        self.list.iter().map(flat).collect()
    }

    /// The choice as the Responses API gives it back.
    pub fn responses_choice(&self) -> Value {
        match &self.choice {
            ToolChoice::None => json!("none"),
            ToolChoice::Auto => json!("auto"),
            ToolChoice::Required => json!("required"),
            ToolChoice::Named(n) => json!({"type": "function", "name": n}),
        }
    }
}

/// A previous answer's `tool_calls` (in an assistant's message) as the chat template reads
/// them: each `{"id", "type": "function", "function": {"name", "arguments"}}` with its
/// arguments (JSON text) as the JSON value they write. The error (to follow the key's name)
/// says what is wrong.
pub fn calls_for_template(calls: &Value) -> Result<Value, String> {
    let Some(list) = calls.as_array() else { return Err("` must be a list of tool calls".into()) };
    let mut out = Vec::with_capacity(list.len());
    for (j, c) in list.iter().enumerate() {
        let f = c.get("function");
        let name = f.and_then(|f| f.get("name")).and_then(Value::as_str);
        let Some(name) = name else { return Err(format!("[{j}].function.name` is missing")) };
        let arguments = match f.and_then(|f| f.get("arguments")) {
            Some(Value::String(text)) => serde_json::from_str::<Value>(text)
                .map_err(|e| format!("[{j}].function.arguments` is not JSON: {e}"))?,
            Some(v @ Value::Object(_)) => v.clone(),
            None | Some(Value::Null) => json!({}),
            Some(_) => return Err(format!("[{j}].function.arguments` must be JSON text")),
        };
        let mut call = c.as_object().cloned().unwrap_or_default();
        call.insert("type".into(), json!("function"));
        call.insert("function".into(), json!({"name": name, "arguments": arguments}));
        out.push(Value::Object(call));
    }
    Ok(Value::Array(out))
}

/// JSON text as Python's `json.dumps(v, ensure_ascii=False)` writes it (`", "` and `": "`),
/// as vLLM writes a call's arguments.
pub fn dumps(v: &Value) -> String {
    crate::tokenizer::py_json(v, None)
}

/// A part of an answer that calls tools: text (`content`), a call begun (its id, name and the
/// first of its arguments' text), or more of a call's arguments' text.
#[derive(Debug, Clone, PartialEq)]
pub enum Piece {
    Text(String),
    Call { index: usize, id: String, name: String, arguments: String },
    Arguments { index: usize, text: String },
}

/// A new tool call's id: `call_` and 24 hexadecimal digits, drawn at random.
fn call_id() -> String {
    use std::hash::{BuildHasher, Hasher};
    let draw = || std::collections::hash_map::RandomState::new().build_hasher().finish();
    format!("call_{:016x}{:08x}", draw(), draw() as u32)
}

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

/// What a [`Reader`] looks for.
#[derive(Debug)]
enum Mode {
    /// The whole answer is the named tool's arguments.
    Named { name: String, begun: bool },
    /// The answer is `[{"name": ..., "parameters": ...}, ...]`: the JSON nesting so far,
    /// whether within a string (and after a backslash), and where the current call began.
    Listed { depth: usize, string: bool, escaped: bool, from: usize },
    /// Hermes' tags: within a call or not; text after a call kept back while it is blank.
    Hermes { within: bool, after_call: bool },
    /// Llama 3's JSON: whether the answer is calls (it begins with `{`), once its first
    /// character that is not blank has come.
    Llama { calls: Option<bool> },
}

/// Reads an answer, as its text comes, for the tool calls it makes ([`Piece`]s).
#[derive(Debug)]
pub struct Reader {
    mode: Mode,
    /// Text read and not yet given out.
    held: String,
    /// Calls given out.
    calls: usize,
}

impl Reader {
    /// A reader of answers to a request with `tools` (`parser` the server's, which `auto`
    /// needs); `None` where the answer is text alone.
    pub fn new(tools: &Tools, parser: Option<Parser>) -> Option<Reader> {
        let mode = match (&tools.choice, parser) {
            (ToolChoice::None, _) | (ToolChoice::Auto, None) => return None,
            (ToolChoice::Named(n), _) => Mode::Named { name: n.clone(), begun: false },
            (ToolChoice::Required, _) => Mode::Listed { depth: 0, string: false, escaped: false, from: 0 },
            (ToolChoice::Auto, Some(Parser::Hermes)) => Mode::Hermes { within: false, after_call: false },
            (ToolChoice::Auto, Some(Parser::Llama3Json)) => Mode::Llama { calls: None },
        };
        Some(Reader { mode, held: String::new(), calls: 0 })
    }

    /// The tags this reader looks for in an answer's text. Where a model's tokenizer has them
    /// as special tokens (Hermes 3's `<tool_call>`, Llama 3's `<|python_tag|>`), which decoded
    /// text leaves out, the text of a request read this way must keep them.
    pub fn tags(&self) -> &'static [&'static str] {
        match self.mode {
            Mode::Hermes { .. } => &[OPEN, CLOSE],
            Mode::Llama { .. } => &[PYTHON_TAG],
            Mode::Named { .. } | Mode::Listed { .. } => &[],
        }
    }

    /// Whether the answer has made a call.
    pub fn called(&self) -> bool {
        self.calls > 0
    }

    /// Reads `text`, the answer's next piece, into `out`.
    pub fn push(&mut self, text: &str, out: &mut Vec<Piece>) {
        match &mut self.mode {
            Mode::Named { name, begun } => {
                if !*begun {
                    *begun = true;
                    self.calls = 1;
                    out.push(Piece::Call {
                        index: 0,
                        id: call_id(),
                        name: name.clone(),
                        arguments: text.into(),
                    });
                } else if !text.is_empty() {
                    out.push(Piece::Arguments { index: 0, text: text.into() });
                }
            }
            Mode::Listed { depth, string, escaped, from } => {
                let start = self.held.len();
                self.held.push_str(text);
                for (i, c) in self.held[start..].char_indices() {
                    let at = start + i;
                    if *string {
                        match c {
                            _ if *escaped => *escaped = false,
                            '\\' => *escaped = true,
                            '"' => *string = false,
                            _ => {}
                        }
                        continue;
                    }
                    match c {
                        '"' => *string = true,
                        '{' | '[' => {
                            *depth += 1;
                            if *depth == 2 {
                                *from = at;
                            }
                        }
                        '}' | ']' => {
                            *depth = depth.saturating_sub(1);
                            if *depth == 1 && c == '}' {
                                let call = serde_json::from_str::<Value>(&self.held[*from..=at]);
                                if let Ok(Value::Object(o)) = call {
                                    let name = o.get("name").and_then(Value::as_str).unwrap_or_default();
                                    let args = o.get("parameters").cloned().unwrap_or_else(|| json!({}));
                                    let (index, name) = (self.calls, name.to_string());
                                    out.push(Piece::Call {
                                        index,
                                        id: call_id(),
                                        name,
                                        arguments: dumps(&args),
                                    });
                                    self.calls += 1;
                                }
                            }
                        }
                        _ => {}
                    }
                }
            }
            Mode::Hermes { .. } => {
                self.held.push_str(text);
                self.hermes(out, false);
            }
            Mode::Llama { calls } => {
                self.held.push_str(text);
                if calls.is_none() {
                    let begun = self.held.trim_start().trim_start_matches(PYTHON_TAG).trim_start();
                    // Blank, or what may begin the tag: wait for more.
                    if PYTHON_TAG.starts_with(begun) {
                        return;
                    }
                    *calls = Some(begun.starts_with('{'));
                }
                if *calls == Some(false) && !self.held.is_empty() {
                    out.push(Piece::Text(std::mem::take(&mut self.held)));
                }
            }
        }
    }

    /// The answer is done: gives out what is held.
    pub fn finish(&mut self, out: &mut Vec<Piece>) {
        match self.mode {
            Mode::Named { .. } => self.push("", out),
            // A list cut short before its first call is whole: its text is the answer.
            Mode::Listed { .. } if self.calls == 0 => out.push(Piece::Text(std::mem::take(&mut self.held))),
            Mode::Listed { .. } => {}
            Mode::Hermes { .. } => self.hermes(out, true),
            Mode::Llama { .. } => {
                let text = std::mem::take(&mut self.held);
                match llama_calls(&text) {
                    Some(calls) => {
                        for (name, arguments) in calls {
                            out.push(Piece::Call { index: self.calls, id: call_id(), name, arguments });
                            self.calls += 1;
                        }
                    }
                    None if text.is_empty() => {}
                    None => out.push(Piece::Text(text)),
                }
            }
        }
    }

    /// Hermes' calls out of the held text: text before a call, and between or after calls where
    /// it is not blank, is the answer's text; a call whose JSON does not parse (or names no
    /// tool) is text as written. At the `end` a call left open is read as if closed.
    fn hermes(&mut self, out: &mut Vec<Piece>, end: bool) {
        let Mode::Hermes { within, after_call } = &mut self.mode else { return };
        loop {
            if *within {
                let close = self.held.find(CLOSE);
                let Some(body_end) = close.or(end.then_some(self.held.len())) else { return };
                let body = &self.held[OPEN.len()..body_end];
                let call = serde_json::from_str::<Value>(body.trim()).ok();
                let name = call.as_ref().and_then(|c| c.get("name")).and_then(Value::as_str);
                let taken = close.map_or(self.held.len(), |c| c + CLOSE.len());
                match name {
                    Some(name) => {
                        let args = call.as_ref().and_then(|c| c.get("arguments")).cloned();
                        let arguments = dumps(&args.unwrap_or_else(|| json!({})));
                        let (index, name) = (self.calls, name.to_string());
                        out.push(Piece::Call { index, id: call_id(), name, arguments });
                        self.calls += 1;
                        *after_call = true;
                    }
                    None => out.push(Piece::Text(self.held[..taken].to_string())),
                }
                self.held.drain(..taken);
                *within = false;
                continue;
            }
            match self.held.find(OPEN) {
                Some(at) => {
                    let before: String = self.held.drain(..at).collect();
                    if !(*after_call && before.trim().is_empty()) {
                        out.push(Piece::Text(before));
                    }
                    *within = true;
                }
                None => {
                    // Keep back what may begin a tag, and blank text after a call.
                    let keep = match end {
                        true => 0,
                        false => {
                            (1..OPEN.len()).rev().find(|&k| self.held.ends_with(&OPEN[..k])).unwrap_or(0)
                        }
                    };
                    let give = self.held.len() - keep;
                    let blank = self.held[..give].trim().is_empty();
                    if give > 0 && !(*after_call && blank) {
                        out.push(Piece::Text(self.held.drain(..give).collect()));
                        *after_call = false;
                    } else if end {
                        self.held.clear();
                    }
                    return;
                }
            }
        }
    }
}

const PYTHON_TAG: &str = "<|python_tag|>";

/// Llama 3's JSON calls: `text` (after `<|python_tag|>` or not) as one JSON object or several,
/// `;` between them, each with a `name` and its `parameters` (or `arguments`); `None` where it
/// is not that (the answer is then text).
fn llama_calls(text: &str) -> Option<Vec<(String, String)>> {
    let mut rest = text.trim().trim_start_matches(PYTHON_TAG).trim_start();
    let mut calls = Vec::new();
    while !rest.is_empty() {
        let mut values = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
        let call = values.next()?.ok()?;
        let name = call.get("name")?.as_str()?.to_string();
        let args = call.get("parameters").or(call.get("arguments")).cloned().unwrap_or_else(|| json!({}));
        calls.push((name, dumps(&args)));
        rest = rest[values.byte_offset()..].trim_start();
        rest = rest.strip_prefix(';').unwrap_or(rest).trim_start();
    }
    (!calls.is_empty()).then_some(calls)
}

/// An answer's text and calls, read whole: its text (`None` where it is empty and calls were
/// made) and its calls (id, name, arguments).
pub fn read_whole(reader: &mut Reader, text: &str) -> (Option<String>, Vec<(String, String, String)>) {
    let mut pieces = Vec::new();
    reader.push(text, &mut pieces);
    reader.finish(&mut pieces);
    let mut content = String::new();
    let mut calls: Vec<(String, String, String)> = Vec::new();
    for p in pieces {
        match p {
            Piece::Text(t) => content.push_str(&t),
            Piece::Call { id, name, arguments, .. } => calls.push((id, name, arguments)),
            Piece::Arguments { index, text } => {
                if let Some(c) = calls.get_mut(index) {
                    c.2.push_str(&text);
                }
            }
        }
    }
    let content = if content.is_empty() && !calls.is_empty() { None } else { Some(content) };
    (content, calls)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weather() -> Value {
        json!({"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}})
    }

    fn tools(choice: Value) -> Tools {
        let obj = json!({"tools": [weather(), {"type": "function", "function": {"name": "time"}}], "tool_choice": choice});
        Tools::read(obj.as_object().unwrap(), Some(Parser::Hermes)).unwrap().unwrap()
    }

    /// The pieces of `text` read in pieces of `step` characters, text joined and arguments
    /// joined to their calls (ids left out).
    fn streamed(r: &mut Reader, text: &str, step: usize) -> (Option<String>, Vec<(String, String)>) {
        let chars: Vec<char> = text.chars().collect();
        let mut pieces = Vec::new();
        for c in chars.chunks(step) {
            r.push(&c.iter().collect::<String>(), &mut pieces);
        }
        r.finish(&mut pieces);
        let (mut content, mut calls) = (String::new(), Vec::<(String, String)>::new());
        for p in pieces {
            match p {
                Piece::Text(t) => content.push_str(&t),
                Piece::Call { index, name, arguments, .. } => {
                    assert_eq!(index, calls.len());
                    calls.push((name, arguments));
                }
                Piece::Arguments { index, text } => calls[index].1.push_str(&text),
            }
        }
        ((!content.is_empty() || calls.is_empty()).then_some(content), calls)
    }

    /// Whole and in pieces of every size, an answer gives the same text and calls.
    fn read_every_way(t: &Tools, text: &str) -> (Option<String>, Vec<(String, String)>) {
        let (content, calls) = read_whole(&mut Reader::new(t, Some(Parser::Hermes)).unwrap(), text);
        let whole = (
            content,
            calls
                .into_iter()
                .map(|(id, n, a)| {
                    assert!(id.starts_with("call_") && id.len() == 29, "{id}");
                    (n, a)
                })
                .collect::<Vec<_>>(),
        );
        for step in 1..=text.chars().count().max(1) {
            let got = streamed(&mut Reader::new(t, Some(Parser::Hermes)).unwrap(), text, step);
            assert_eq!(got, whole, "pieces of {step}: {text:?}");
        }
        whole
    }

    #[test]
    fn hermes_calls_are_read_from_the_text_whole_and_streamed() {
        let t = tools(json!("auto"));
        let call = |n: &str, a: &str| (n.to_string(), a.to_string());
        assert_eq!(read_every_way(&t, "Paris is sunny."), (Some("Paris is sunny.".into()), vec![]));
        assert_eq!(
            read_every_way(
                &t,
                "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\":\"Paris\"}}\n</tool_call>"
            ),
            (None, vec![call("get_weather", r#"{"city": "Paris"}"#)])
        );
        // Text before, two calls, blank text between and after them left out.
        let two = "Let me look.\n<tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}</tool_call>\n\
                   <tool_call>{\"name\": \"time\", \"arguments\": {}}</tool_call>\n";
        assert_eq!(
            read_every_way(&t, two),
            (
                Some("Let me look.\n".into()),
                vec![call("get_weather", r#"{"city": "Oslo"}"#), call("time", "{}")]
            )
        );
        // A call left open at the end; one that is not JSON is text; text after a call is kept.
        assert_eq!(read_every_way(&t, "<tool_call>{\"name\": \"time\"}"), (None, vec![call("time", "{}")]));
        assert_eq!(
            read_every_way(&t, "a <tool_call>{oops}</tool_call> b"),
            (Some("a <tool_call>{oops}</tool_call> b".into()), vec![])
        );
        assert_eq!(
            read_every_way(&t, "<tool_call>{\"name\": \"time\", \"arguments\": {}}</tool_call> Done."),
            (Some(" Done.".into()), vec![call("time", "{}")])
        );
        // Something like a tag that is not one is text.
        assert_eq!(read_every_way(&t, "x <tool_ca"), (Some("x <tool_ca".into()), vec![]));
    }

    /// Llama 3's JSON calls: an answer that is one or several, whole and streamed; any other
    /// answer is text as it comes.
    #[test]
    fn llama3_json_calls_are_read_from_an_answer_that_is_one() {
        let t = tools(json!("auto"));
        let read = |text: &str| {
            let (content, calls) = read_whole(&mut Reader::new(&t, Some(Parser::Llama3Json)).unwrap(), text);
            let whole: Vec<(String, String)> = calls.into_iter().map(|(_, n, a)| (n, a)).collect();
            for step in 1..=text.chars().count().max(1) {
                let got = streamed(&mut Reader::new(&t, Some(Parser::Llama3Json)).unwrap(), text, step);
                assert_eq!(got, (content.clone(), whole.clone()), "pieces of {step}: {text:?}");
            }
            (content, whole)
        };
        let call = |n: &str, a: &str| (n.to_string(), a.to_string());
        assert_eq!(
            read(" {\"name\": \"get_weather\", \"parameters\": {\"city\":\"Oslo\"}}"),
            (None, vec![call("get_weather", r#"{"city": "Oslo"}"#)])
        );
        assert_eq!(
            read("<|python_tag|>{\"name\": \"time\", \"arguments\": {}}; {\"name\": \"get_weather\", \"parameters\": {\"city\": \"Rome\"}}"),
            (None, vec![call("time", "{}"), call("get_weather", r#"{"city": "Rome"}"#)])
        );
        assert_eq!(read("It is sunny."), (Some("It is sunny.".into()), vec![]));
        assert_eq!(read("{\"no\": 1}"), (Some("{\"no\": 1}".into()), vec![]));
        assert_eq!(read("{\"name\": \"time\""), (Some("{\"name\": \"time\"".into()), vec![]));
    }

    #[test]
    fn required_and_named_calls_are_read_as_the_grammar_writes_them() {
        let t = tools(json!("required"));
        let text = r#"[{"name": "get_weather", "parameters": {"city": "a \"}\" b"}}, {"name": "time", "parameters": {}}]"#;
        let got = read_every_way(&t, text);
        assert_eq!(
            got,
            (
                None,
                vec![("get_weather".into(), r#"{"city": "a \"}\" b"}"#.into()), ("time".into(), "{}".into())]
            )
        );
        // Cut short before a call is whole: the text is the answer.
        assert_eq!(read_every_way(&t, r#"[{"name": "ti"#), (Some(r#"[{"name": "ti"#.into()), vec![]));
        let t = tools(json!({"type": "function", "function": {"name": "get_weather"}}));
        assert_eq!(
            read_every_way(&t, r#"{"city": "Rome"}"#),
            (None, vec![("get_weather".into(), r#"{"city": "Rome"}"#.into())])
        );
    }

    #[test]
    fn formats_hold_answers_to_calls() {
        let Some(Format::JsonSchema(s)) = tools(json!("required")).format() else { panic!() };
        assert_eq!(s["minItems"], 1);
        assert_eq!(s["items"]["anyOf"][0]["properties"]["name"]["enum"], json!(["get_weather"]));
        assert_eq!(
            s["items"]["anyOf"][1]["properties"]["parameters"],
            json!({"type": "object", "properties": {}})
        );
        assert!(s.get("maxItems").is_none());
        let Some(Format::JsonSchema(s)) =
            tools(json!({"type": "function", "function": {"name": "get_weather"}})).format()
        else {
            panic!()
        };
        assert_eq!(s, weather()["function"]["parameters"]);
        assert_eq!(tools(json!("auto")).format(), None);
        assert_eq!(tools(json!("none")).format(), None);
    }

    #[test]
    fn bad_tools_are_named() {
        let read =
            |v: Value, parser| Tools::read(v.as_object().unwrap(), parser).map(|t| t.map(|t| t.choice));
        assert_eq!(read(json!({}), None), Ok(None));
        assert_eq!(read(json!({"tools": [], "tool_choice": "none"}), None), Ok(None));
        assert_eq!(read(json!({"tools": [weather()]}), Some(Parser::Hermes)), Ok(Some(ToolChoice::Auto)));
        assert_eq!(
            read(json!({"tools": [weather()], "tool_choice": "none"}), None),
            Ok(Some(ToolChoice::None))
        );
        for (v, msg) in [
            (json!({"tools": {}}), "`tools` must be a list of tools"),
            (json!({"tools": [{"type": "code"}]}), "`tools[0]`: only tools of type function are taken"),
            (json!({"tools": [{"type": "function"}]}), "`tools[0].function` must be an object"),
            (json!({"tools": [{"type": "function", "function": {"name": "a b"}}]}), "`tools[0].function.name` must be 1 to 64"),
            (json!({"tools": [weather(), weather()]}), "`tools[1].function.name`: `get_weather` is given twice"),
            (json!({"tools": [{"type": "function", "function": {"name": "a", "parameters": 3}}]}), "`tools[0].function.parameters` must be a JSON schema"),
            (json!({"tools": [weather()], "tool_choice": "any"}), "`tool_choice` is \"any\": none, auto, required or a tool"),
            (json!({"tools": [weather()], "tool_choice": {"type": "function"}}), "`tool_choice` must be none, auto"),
            (json!({"tool_choice": "required"}), "`tool_choice` calls a tool, but `tools` gives none"),
            (json!({"tools": [weather()], "tool_choice": {"type": "function", "function": {"name": "x"}}}), "`tool_choice` names `x`, which is not among `tools`"),
            (json!({"tools": [weather()]}), "`tool_choice` auto (the default where `tools` are given): calls are read from a model's text only with --tool-call-parser"),
            (json!({"tools": [weather()], "parallel_tool_calls": 1}), "`parallel_tool_calls` must be true or false"),
        ] {
            let e = read(v.clone(), None).unwrap_err();
            assert!(e.starts_with(msg), "{v}: {e}");
        }
    }

    /// Earlier calls reach the template with their arguments as JSON values.
    #[test]
    fn earlier_calls_reach_the_template_with_their_arguments_read() {
        let calls = json!([{"id": "call_1", "type": "function", "function": {"name": "time", "arguments": "{\"tz\": \"UTC\"}"}}]);
        assert_eq!(
            calls_for_template(&calls),
            Ok(
                json!([{"id": "call_1", "type": "function", "function": {"name": "time", "arguments": {"tz": "UTC"}}}])
            )
        );
        let bad = json!([{"function": {"name": "time", "arguments": "{tz"}}]);
        assert!(calls_for_template(&bad).unwrap_err().starts_with("[0].function.arguments` is not JSON"));
        assert_eq!(dumps(&json!({"a": [1, "é", {"b": null}]})), r#"{"a": [1, "é", {"b": null}]}"#);
    }
}
