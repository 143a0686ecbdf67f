//! Text ↔ token ids: the HF `tokenizer.json` through the `tokenizers` crate, the chat template
//! from `tokenizer_config.json` rendered with minijinja, and streaming decode that never splits
//! a UTF-8 character. Only the driver rank uses this.

use crate::error::{Error, Result};
use std::path::{Path, PathBuf};

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
    /// The chat template and the file it was read from.
    chat_template: Option<(String, PathBuf)>,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

/// The byte that byte-level BPE writes as `c` (GPT-2's table: printable bytes as themselves,
/// the others, in order, as U+0100 on), if any.
fn byte_of_char(c: char) -> Option<u8> {
    let printable = |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let c = c as u32;
    if c < 256 {
        return printable(c).then_some(c as u8);
    }
    (0..256u32).filter(|&b| !printable(b)).nth((c - 256) as usize).map(|b| b as u8)
}

/// GPT-2's one special token, its tokenizer's default beginning, end and unknown token.
const GPT2_SPECIAL: &str = "<|endoftext|>";

/// GPT-2's byte-level BPE from the files its tokenizer was saved as before tokenizer.json
/// (`vocab.json`, `merges.txt`), built as HF's `GPT2TokenizerFast` builds it from them: the
/// byte-level pre-tokenizer (a space before the text where `add_prefix_space`), BPE, the
/// beginning token first where `add_bos_token`; the added tokens of `added_tokens_decoder`, and
/// the special tokens the config names (`<|endoftext|>` where it names none). Other tokenizers
/// saved so (Qwen2's, CodeGen's) split text otherwise, so the config must name GPT-2's class
/// (or name none, in a GPT-2 model's folder).
fn gpt2_files(dir: &Path, cfg: &serde_json::Value, cfg_path: &Path) -> Result<tokenizers::Tokenizer> {
    use tokenizers::{decoders, pre_tokenizers::byte_level::ByteLevel, processors, AddedToken};
    let vocab = dir.join("vocab.json");
    let class = cfg.get("tokenizer_class").and_then(|c| c.as_str());
    let model_type = || -> Option<String> {
        let text = std::fs::read_to_string(dir.join("config.json")).ok()?;
        let v: serde_json::Value = serde_json::from_str(&text).ok()?;
        v.get("model_type")?.as_str().map(String::from)
    };
    let gpt2 = match class {
        Some(c) => matches!(c, "GPT2Tokenizer" | "GPT2TokenizerFast"),
        None => model_type().as_deref() == Some("gpt2"),
    };
    if !gpt2 {
        let cfg_name = cfg_path.display();
        let what = match class {
            Some(c) => format!("{cfg_name} names {c}"),
            None => format!("{cfg_name} names no tokenizer_class, nor is config.json's model_type gpt2"),
        };
        let msg = format!(
            "not found; vocab.json and merges.txt gridlm reads only as GPT-2's tokenizer, and {what}: \
             HF's tokenizers write a tokenizer.json of them (`AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR)`)"
        );
        return Err(Error::file(&dir.join("tokenizer.json"), msg));
    }
    let text = |p: &Path| p.to_str().map(String::from).ok_or_else(|| Error::file(p, "not a UTF-8 path"));
    let bpe = tokenizers::models::bpe::BPE::from_file(&text(&vocab)?, &text(&dir.join("merges.txt"))?)
        .build()
        .map_err(|e| {
            crate::weights::unreadable(&vocab, || format!("with merges.txt, not GPT-2's BPE: {e}"))
        })?;
    let flag = |key: &str| cfg.get(key).and_then(|v| v.as_bool()).unwrap_or(false);
    let mut tok = tokenizers::Tokenizer::new(bpe);
    tok.with_pre_tokenizer(Some(ByteLevel::new(flag("add_prefix_space"), true, true)));
    tok.with_decoder(Some(decoders::byte_level::ByteLevel::default()));
    let bos = token_str(cfg.get("bos_token")).unwrap_or_else(|| GPT2_SPECIAL.into());
    if flag("add_bos_token") {
        let id = tok
            .token_to_id(&bos)
            .ok_or_else(|| Error::file(cfg_path, format!("bos_token {bos} is not in vocab.json")))?;
        let template = processors::template::TemplateProcessing::builder()
            .try_single(format!("{bos}:0 $A:0"))
            .and_then(|t| t.try_pair(format!("{bos}:0 $A:0 {bos}:1 $B:1")))
            .map_err(|e| Error::file(cfg_path, format!("add_bos_token: {e}")))?
            .special_tokens(vec![(bos.clone(), id)])
            .build()
            .map_err(|e| Error::file(cfg_path, format!("add_bos_token: {e}")))?;
        tok.with_post_processor(Some(template));
    } else {
        tok.with_post_processor(Some(processors::byte_level::ByteLevel::new(true, false, true)));
    }
    if let Some(added) = cfg.get("added_tokens_decoder").and_then(|a| a.as_object()) {
        for (id, t) in added {
            let t: AddedToken = serde_json::from_value(t.clone())
                .map_err(|e| Error::file(cfg_path, format!("added_tokens_decoder {id}: {e}")))?;
            if t.special {
                tok.add_special_tokens(&[t]);
            } else {
                tok.add_tokens(&[t]);
            }
        }
    }
    // As GPT2Tokenizer takes them: each of the beginning, end and unknown tokens
    // `<|endoftext|>` unless the config names another; padding only where it names one.
    let named =
        ["bos_token", "eos_token", "unk_token"].map(|k| token_str(cfg.get(k)).unwrap_or(GPT2_SPECIAL.into()));
    let specials: Vec<AddedToken> = named
        .into_iter()
        .chain(token_str(cfg.get("pad_token")))
        .filter(|t| tok.token_to_id(t).is_some())
        .map(|t| AddedToken::from(t, true))
        .collect();
    tok.add_special_tokens(&specials);
    Ok(tok)
}

/// A special token in tokenizer_config.json: a string or `{"content": "..."}`.
fn token_str(v: Option<&serde_json::Value>) -> Option<String> {
    match v? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o.get("content")?.as_str().map(String::from),
        _ => None,
    }
}

impl Tokenizer {
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let cfg_path = dir.join("tokenizer_config.json");
        let cfg: serde_json::Value = match std::fs::read_to_string(&cfg_path) {
            Ok(text) => serde_json::from_str(&text)
                .map_err(|e| Error::file(&cfg_path, format!("invalid JSON: {e}")))?,
            Err(_) => serde_json::Value::Null,
        };
        let mut path = dir.join("tokenizer.json");
        let (mut bos_token, mut eos_token) =
            (token_str(cfg.get("bos_token")), token_str(cfg.get("eos_token")));
        let inner = if path.exists() {
            tokenizers::Tokenizer::from_file(&path)
                .map_err(|e| crate::weights::unreadable(&path, || format!("invalid tokenizer: {e}")))?
        } else if dir.join("vocab.json").exists() && dir.join("merges.txt").exists() {
            // GPT-2's tokenizer as saved before tokenizer.json: its special tokens are
            // `<|endoftext|>` unless the config names others.
            let tok = gpt2_files(dir, &cfg, &cfg_path)?;
            bos_token.get_or_insert_with(|| GPT2_SPECIAL.into());
            eos_token.get_or_insert_with(|| GPT2_SPECIAL.into());
            path = dir.join("vocab.json");
            tok
        } else {
            let hint = if dir.join("tokenizer.model").exists() {
                "; its tokenizer.model (SentencePiece's file) gridlm does not read: HF's tokenizers write a tokenizer.json of it (`AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR)`)"
            } else {
                ""
            };
            return Err(Error::file(
                &path,
                format!("not found: the model folder needs a tokenizer.json{hint}"),
            ));
        };
        Ok(Tokenizer {
            inner,
            path,
            chat_template: chat_template(dir, &cfg, &cfg_path)?,
            bos_token,
            eos_token,
        })
    }

    /// Ids of `text`; `add_special` lets the tokenizer add BOS etc. as configured.
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, add_special)
            .map_err(|e| Error::file(&self.path, format!("cannot encode the prompt: {e}")))?;
        Ok(enc.get_ids().to_vec())
    }

    /// The text of `ids`, special tokens left out.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.decode_as(ids, true)
    }

    /// The text of `ids`, special tokens left out or not.
    pub fn decode_as(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special)
            .map_err(|e| Error::file(&self.path, format!("cannot decode tokens: {e}")))
    }

    /// Ids of the special tokens (those decoded text leaves out) whose text is one of `texts`.
    pub fn special_ids(&self, texts: &[&str]) -> Vec<u32> {
        let added = self.inner.get_added_tokens_decoder();
        let mut ids: Vec<u32> = added
            .iter()
            .filter(|(_, t)| t.special && texts.contains(&t.content.as_str()))
            .map(|(&id, _)| id)
            .collect();
        ids.sort_unstable();
        ids
    }

    /// The bytes token `id` stands for in text (`None` for an id outside the vocabulary): a
    /// byte-level BPE token's characters mapped back to their bytes (GPT-2's table), a
    /// `<0xHH>` byte token's byte, `▁` as a space in SentencePiece pieces, a special token's
    /// own text. A token may be part of a UTF-8 character, so its bytes need not be text.
    pub fn token_bytes(&self, id: u32) -> Option<Vec<u8>> {
        let piece = self.inner.id_to_token(id)?;
        let byte_level = matches!(self.inner.get_decoder(), Some(tokenizers::DecoderWrapper::ByteLevel(_)));
        if byte_level {
            let mut out = Vec::with_capacity(piece.len());
            for c in piece.chars() {
                match byte_of_char(c) {
                    Some(b) => out.push(b),
                    None => out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
                }
            }
            return Some(out);
        }
        let hex = piece.strip_prefix("<0x").and_then(|h| h.strip_suffix('>'));
        if let Some(b) = hex.filter(|h| h.len() == 2).and_then(|h| u8::from_str_radix(h, 16).ok()) {
            return Some(vec![b]);
        }
        Some(piece.replace('\u{2581}', " ").into_bytes())
    }

    /// The text of tokens' bytes one after another ([`Tokenizer::token_bytes`]; none for an id
    /// outside the vocabulary), U+FFFD where they end within a character.
    pub fn bytes_text(&self, ids: &[u32]) -> String {
        let bytes: Vec<u8> = ids.iter().flat_map(|&t| self.token_bytes(t).unwrap_or_default()).collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// Whether token `id` is a special token (an added token marked special: `<|im_end|>`).
    pub fn is_special(&self, id: u32) -> bool {
        self.inner.get_added_tokens_decoder().get(&id).is_some_and(|t| t.special)
    }

    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Id of the EOS token named in tokenizer_config.json.
    pub fn eos_id(&self) -> Option<u32> {
        self.eos_token.as_deref().and_then(|t| self.token_id(t))
    }

    /// The prompt as one user message, after a system message if given, through the model's
    /// chat template, ready for generation.
    pub fn apply_chat_template(&self, system: Option<&str>, user: &str) -> Result<String> {
        let system = system.map(|s| ("system", s));
        let messages: Vec<(&str, &str)> = system.into_iter().chain([("user", user)]).collect();
        self.render_chat(&messages, &TemplateVars::new())
    }

    /// A conversation of messages (`(role, content)` pairs or [`Message`]s) through the model's
    /// chat template, with the prompt for the assistant's next turn, ready for generation;
    /// `vars` are further variables the template reads (as HF's `apply_chat_template` takes
    /// them: `enable_thinking`, `tools`, say), over the special tokens'.
    pub fn render_chat<M: AsMessage>(&self, messages: &[M], vars: &TemplateVars) -> Result<String> {
        self.render_chat_to(messages, vars, ChatEnd::Answer)
    }

    /// [`Tokenizer::render_chat`], ending as `end` says.
    pub fn render_chat_to<M: AsMessage>(
        &self,
        messages: &[M],
        vars: &TemplateVars,
        end: ChatEnd,
    ) -> Result<String> {
        let (tpl, tpl_path) = self.chat_template.as_ref().ok_or_else(|| {
            let cfg_path = self.path.with_file_name("tokenizer_config.json");
            let msg = "no `chat_template` here, in chat_template.jinja or in chat_template.json: a chat \
                       (generate's --chat, serve's /v1/chat/completions) needs one";
            Error::file(&cfg_path, msg)
        })?;
        let mut env = minijinja::Environment::new();
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> std::result::Result<String, minijinja::Error> {
            Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
        });
        // JSON as HF's templates get it: Python's json.dumps (keys in their order, `", "` and
        // `": "`, or lines indented by `indent`), not minijinja's (sorted, compact, escaped for
        // HTML). Templates write tools and tool calls' arguments with it.
        env.add_filter(
            "tojson",
            |v: minijinja::Value,
             kwargs: minijinja::value::Kwargs|
             -> std::result::Result<String, minijinja::Error> {
                let indent: Option<usize> = kwargs.get("indent")?;
                kwargs.assert_all_used()?;
                let v = serde_json::to_value(&v).map_err(|e| {
                    minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, format!("tojson: {e}"))
                })?;
                Ok(py_json(&v, indent))
            },
        );
        // Today's date in the template's format, as HF gives templates (Llama 3.x and SmolLM3
        // write it into the system turn).
        env.add_function("strftime_now", |format: String| -> std::result::Result<String, minijinja::Error> {
            use std::fmt::Write;
            let mut out = String::new();
            write!(out, "{}", chrono::Local::now().format(&format)).map_err(|_| {
                let msg = format!("strftime_now: `{format}` is not a date format");
                minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg)
            })?;
            Ok(out)
        });
        let bad = |e: minijinja::Error| Error::file(tpl_path, format!("chat_template: {e}"));
        env.add_template("chat", tpl).map_err(bad)?;
        let t = env.get_template("chat").map_err(bad)?;
        let mut more = TemplateVars::new();
        for (name, token) in [("bos_token", &self.bos_token), ("eos_token", &self.eos_token)] {
            more.insert(name.into(), token.clone().unwrap_or_default().into());
        }
        more.extend(vars.iter().map(|(k, v)| (k.clone(), v.clone())));
        let text = t
            .render(minijinja::context! {
                messages => messages
                    .iter()
                    .map(|m| {
                        let mut v = serde_json::Map::new();
                        v.insert("role".into(), m.role().into());
                        v.insert("content".into(), m.content().into());
                        v.extend(m.more().into_iter().flatten().map(|(k, x)| (k.clone(), x.clone())));
                        minijinja::Value::from_serialize(&v)
                    })
                    .collect::<Vec<_>>(),
                add_generation_prompt => end == ChatEnd::Answer,
                ..minijinja::Value::from_serialize(&more)
            })
            .map_err(bad)?;
        if end != ChatEnd::Open {
            return Ok(text);
        }
        // Cut after the last message's content, as HF does: where the template writes it last,
        // as given or (templates that trim messages) trimmed.
        let last = messages.last().map_or("", |m| m.content());
        let at = [last, last.trim()].into_iter().find_map(|c| text.rfind(c).map(|at| at + c.len()));
        let at = at.ok_or_else(|| {
            let msg = "continue_final_message: the chat template does not write the last message's content";
            Error::file(tpl_path, msg)
        })?;
        Ok(text[..at].to_string())
    }
}

/// JSON text as Python's `json.dumps(v, ensure_ascii=False, indent=indent)` writes it: keys in
/// their order; `", "` and `": "` between items, or with `indent` each item on a line of its
/// own indented by that many spaces a level (`","` ending lines).
pub fn py_json(v: &serde_json::Value, indent: Option<usize>) -> String {
    fn write(v: &serde_json::Value, indent: Option<usize>, level: usize, out: &mut String) {
        use serde_json::Value;
        let items: Vec<(Option<&String>, &Value)> = match v {
            Value::Array(a) if !a.is_empty() => a.iter().map(|x| (None, x)).collect(),
            Value::Object(o) if !o.is_empty() => o.iter().map(|(k, x)| (Some(k), x)).collect(),
            v => return out.push_str(&v.to_string()),
        };
        let (open, close) = if v.is_array() { ('[', ']') } else { ('{', '}') };
        out.push(open);
        for (i, (k, x)) in items.into_iter().enumerate() {
            match indent {
                Some(n) => {
                    out.push_str(if i > 0 { ",\n" } else { "\n" });
                    out.push_str(&" ".repeat(n * (level + 1)));
                }
                None if i > 0 => out.push_str(", "),
                None => {}
            }
            if let Some(k) = k {
                out.push_str(&Value::from(k.as_str()).to_string());
                out.push_str(": ");
            }
            write(x, indent, level + 1, out);
        }
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * level));
        }
        out.push(close);
    }
    let mut out = String::new();
    write(v, indent, 0, &mut out);
    out
}

/// One message of a conversation as a chat template reads it: its role, its text and further
/// keys (an assistant's `tool_calls`, a tool's `tool_call_id` and `name`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Message {
    pub role: String,
    pub content: String,
    /// Its further keys, as the template reads them.
    pub more: serde_json::Map<String, serde_json::Value>,
}

impl Message {
    /// A message of `role` with `content` and nothing more.
    pub fn new(role: &str, content: &str) -> Message {
        Message { role: role.into(), content: content.into(), more: Default::default() }
    }
}

/// A message is a `(role, content)` pair where it has nothing more.
impl<R: AsRef<str>, C: AsRef<str>> PartialEq<(R, C)> for Message {
    fn eq(&self, (role, content): &(R, C)) -> bool {
        self.role == role.as_ref() && self.content == content.as_ref() && self.more.is_empty()
    }
}

/// What a chat template reads of a message ([`Message`], or a `(role, content)` pair).
pub trait AsMessage {
    fn role(&self) -> &str;
    fn content(&self) -> &str;
    /// Its further keys, if it has any.
    fn more(&self) -> Option<&serde_json::Map<String, serde_json::Value>> {
        None
    }
}

impl<R: AsRef<str>, C: AsRef<str>> AsMessage for (R, C) {
    fn role(&self) -> &str {
        self.0.as_ref()
    }
    fn content(&self) -> &str {
        self.1.as_ref()
    }
}

impl AsMessage for Message {
    fn role(&self) -> &str {
        &self.role
    }
    fn content(&self) -> &str {
        &self.content
    }
    fn more(&self) -> Option<&serde_json::Map<String, serde_json::Value>> {
        Some(&self.more)
    }
}

/// How a rendered chat ends.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ChatEnd {
    /// With the prompt for the assistant's answer (HF's `add_generation_prompt`).
    #[default]
    Answer,
    /// After the last message, as the template closes it.
    Closed,
    /// Within the last message, right after its content, so the answer continues it (HF's
    /// `continue_final_message`: a reply begun for the model).
    Open,
}

impl ChatEnd {
    /// The ending a request's `add_generation_prompt` and `continue_final_message` (vLLM's
    /// keys, HF's arguments) ask for: continuing the last message leaves out the prompt for an
    /// answer, so both true is an error.
    pub fn asked(
        add_generation_prompt: Option<bool>,
        continue_final: Option<bool>,
    ) -> std::result::Result<Self, String> {
        match (add_generation_prompt, continue_final.unwrap_or(false)) {
            (Some(true), true) => Err("`continue_final_message` continues the last message, so \
                                       `add_generation_prompt` must not be true beside it"
                .into()),
            (_, true) => Ok(ChatEnd::Open),
            (Some(false), false) => Ok(ChatEnd::Closed),
            (_, false) => Ok(ChatEnd::Answer),
        }
    }
}

/// Variables a chat template reads beside the conversation (HF's `apply_chat_template`
/// keyword arguments), by name.
pub type TemplateVars = serde_json::Map<String, serde_json::Value>;

/// `vars` checked as a chat template's further variables: none of them one gridlm sets for every
/// prompt (`messages`, `add_generation_prompt`); the error names it.
pub fn check_template_vars(vars: &TemplateVars) -> std::result::Result<(), String> {
    match vars.keys().find(|k| matches!(k.as_str(), "messages" | "add_generation_prompt")) {
        Some(k) => Err(format!("`{k}` is set by gridlm for every chat, not by a template variable")),
        None => Ok(()),
    }
}

/// The folder's chat template, where HF looks for it: `chat_template.jinja`, then
/// `chat_template.json` (`{"chat_template": ...}`), then `chat_template` in tokenizer_config.json
/// (`cfg`, read from `cfg_path`), a string or a list of named templates (the one named
/// `default`).
fn chat_template(dir: &Path, cfg: &serde_json::Value, cfg_path: &Path) -> Result<Option<(String, PathBuf)>> {
    let jinja = dir.join("chat_template.jinja");
    if jinja.exists() {
        let text = std::fs::read_to_string(&jinja).map_err(|e| Error::io(&jinja, e))?;
        return Ok(Some((text, jinja)));
    }
    // A template given as a string, or as a list of {name, template}.
    let template = |v: &serde_json::Value| match v {
        serde_json::Value::String(t) => Some(t.clone()),
        serde_json::Value::Array(list) => list
            .iter()
            .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
            .and_then(|t| t.get("template")?.as_str().map(String::from)),
        _ => None,
    };
    let json = dir.join("chat_template.json");
    if json.exists() {
        let text = std::fs::read_to_string(&json).map_err(|e| Error::io(&json, e))?;
        let v: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| Error::file(&json, format!("invalid JSON: {e}")))?;
        let t = v.get("chat_template").and_then(template);
        let t = t.ok_or_else(|| Error::file(&json, "no `chat_template` string (or one named `default`)"))?;
        return Ok(Some((t, json)));
    }
    Ok(cfg.get("chat_template").and_then(template).map(|t| (t, cfg_path.to_path_buf())))
}

/// Incremental detokenizer: emits text only once it forms whole characters, re-decoding a
/// short window so byte-level tokens that split a character are joined first.
#[derive(Default)]
pub struct StreamDecoder {
    ids: Vec<u32>,
    prefix: usize,
    read: usize,
    /// Special tokens whose text the text keeps (others are left out).
    keep: Vec<u32>,
    /// The text keeps every special token's.
    all: bool,
}

impl StreamDecoder {
    /// A decoder keeping the text of special tokens `keep` (see [`Tokenizer::special_ids`]),
    /// or with `all` of every special token (vLLM's `skip_special_tokens` false).
    pub fn keeping(keep: Vec<u32>, all: bool) -> Self {
        StreamDecoder { keep, all, ..Default::default() }
    }

    /// Whether it keeps the text of some special tokens.
    pub fn keeps_special(&self) -> bool {
        self.all || !self.keep.is_empty()
    }

    /// The text of `ids` as this decoder decodes (special tokens left out unless all kept).
    fn decode(&self, tok: &Tokenizer, ids: &[u32]) -> Result<String> {
        tok.decode_as(ids, !self.all)
    }

    /// The text of the tokens pushed whose text has not come yet (the start of a character
    /// the next token would complete), as decoding them all gives it.
    pub fn rest(&self, tok: &Tokenizer) -> Result<String> {
        let before = self.decode(tok, &self.ids[self.prefix..self.read])?;
        let now = self.decode(tok, &self.ids[self.prefix..])?;
        Ok(now.strip_prefix(&before).unwrap_or_default().to_string())
    }

    /// Adds a token; returns the new text it completes, if any.
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<Option<String>> {
        self.ids.push(id);
        let before = self.decode(tok, &self.ids[self.prefix..self.read])?;
        let now = self.decode(tok, &self.ids[self.prefix..])?;
        let piece =
            |now: &str| if now.starts_with(&before) { now[before.len()..].to_string() } else { now.into() };
        if !self.all && self.keep.contains(&id) {
            // A kept special token: the text before it (all of it, a character cut short
            // there as decoding the whole gives it), then its own. The window still begins
            // before it, so the next token's text is what it is after those before it (a
            // SentencePiece word's space is not taken for the start of the text).
            let mut text = piece(&now);
            text.push_str(&tok.decode_as(&[id], false)?);
            self.read = self.ids.len();
            return Ok(Some(text));
        }
        if now.len() > before.len() && !now.ends_with('\u{FFFD}') {
            let text = piece(&now);
            self.prefix = self.read;
            self.read = self.ids.len();
            Ok(Some(text))
        } else {
            Ok(None)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `strftime_now` gives today's date as HF's templates ask for it, and a bad format is an
    /// error naming it, not a panic.
    #[test]
    fn templates_get_todays_date() {
        let dir = tempfile::tempdir().unwrap();
        let template = r#"{% if strftime_now is defined %}{{ strftime_now("%Y-%m-%d") }}{% endif %}"#;
        let t = tokenizer_with(dir.path(), template);
        assert_eq!(
            t.apply_chat_template(None, "x").unwrap(),
            chrono::Local::now().format("%Y-%m-%d").to_string()
        );
        let t = tokenizer_with(dir.path(), r#"{{ strftime_now("%Q") }}"#);
        let e = t.apply_chat_template(None, "x").unwrap_err().to_string();
        assert!(e.contains("`%Q` is not a date format"), "{e}");
    }

    /// Byte-level BPE's characters are GPT-2's table read backwards: every byte has one
    /// character, and no other character is a byte.
    #[test]
    fn byte_level_characters_are_bytes() {
        assert_eq!(byte_of_char('a'), Some(b'a'));
        assert_eq!(byte_of_char('\u{120}'), Some(b' '));
        assert_eq!(byte_of_char('\u{10A}'), Some(b'\n'));
        assert_eq!(byte_of_char('\u{143}'), Some(0xAD));
        assert_eq!(byte_of_char('\u{AD}'), None);
        assert_eq!(byte_of_char('\u{144}'), None);
        let chars = (0..0x200u32).filter_map(char::from_u32).filter_map(byte_of_char);
        let mut seen: Vec<u8> = chars.collect();
        seen.sort_unstable();
        assert_eq!(seen, (0..=255).collect::<Vec<u8>>());
    }

    /// Outside byte-level BPE, a token's bytes are its piece with `▁` as a space, and a
    /// `<0xHH>` byte token is that byte (SentencePiece's byte fallback).
    #[test]
    fn sentencepiece_pieces_and_byte_tokens_are_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let vocab =
            serde_json::json!({"<unk>": 0, "\u{2581}hi": 1, "<0x0A>": 2, "<0xE4>": 3, "a\u{2581}b": 4});
        let tok = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "pre_tokenizer": null, "post_processor": null,
            "decoder": {"type": "ByteFallback"}, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
        });
        std::fs::write(dir.path().join("tokenizer.json"), tok.to_string()).unwrap();
        let t = Tokenizer::from_dir(dir.path()).unwrap();
        let bytes: Vec<Vec<u8>> = (1..5).map(|id| t.token_bytes(id).unwrap()).collect();
        assert_eq!(bytes, [b" hi".to_vec(), vec![b'\n'], vec![0xE4], b"a b".to_vec()]);
        assert_eq!(t.token_bytes(5), None);
    }

    /// A tool-call parser's tags that are special tokens stay in streamed text, in place, and
    /// the token after each comes as it does in the whole text (its SentencePiece space kept);
    /// other special tokens are left out, and tags that are not special tokens were never
    /// left out.
    #[test]
    fn special_tags_are_kept_where_asked() {
        let dir = tempfile::tempdir().unwrap();
        let words = [
            "\u{2581}Sure",
            ".",
            "\u{2581}call",
            "<tool_call>",
            "</tool_call>",
            "<|end|>",
            "<0xC3>",
            "<0xA9>",
        ];
        let vocab: serde_json::Map<String, serde_json::Value> =
            words.iter().enumerate().map(|(i, w)| (w.to_string(), serde_json::json!(i))).collect();
        let added = |id: usize, special: bool| {
            serde_json::json!({"id": id, "content": words[id], "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": special})
        };
        let decoder = serde_json::json!({"type": "Sequence", "decoders": [
            {"type": "ByteFallback"},
            {"type": "Metaspace", "replacement": "\u{2581}", "prepend_scheme": "always", "split": true}]});
        let write = |tags_special: bool| {
            let tok = serde_json::json!({
                "version": "1.0", "truncation": null, "padding": null,
                "added_tokens": [added(3, tags_special), added(4, tags_special), added(5, true)],
                "normalizer": null, "pre_tokenizer": null, "post_processor": null,
                "decoder": decoder, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "."},
            });
            std::fs::write(dir.path().join("tokenizer.json"), tok.to_string()).unwrap();
            Tokenizer::from_dir(dir.path()).unwrap()
        };
        let stream = |t: &Tokenizer, keep: Vec<u32>, ids: &[u32]| {
            let mut d = StreamDecoder::keeping(keep, false);
            let pieces: Vec<String> = ids.iter().filter_map(|&id| d.push(t, id).unwrap()).collect();
            pieces
        };
        let t = write(true);
        let tags = t.special_ids(&["<tool_call>", "</tool_call>"]);
        assert_eq!(tags, [3, 4]);
        // `é` in two byte tokens, cut by a tag: as the whole text gives it.
        let ids = [0, 1, 3, 2, 5, 6, 4, 2, 6, 7];
        assert_eq!(
            stream(&t, tags.clone(), &ids),
            ["Sure", ".", "<tool_call>", " call", "\u{FFFD}</tool_call>", " call", "é"]
        );
        assert_eq!(stream(&t, tags, &ids).concat(), "Sure.<tool_call> call\u{FFFD}</tool_call> callé");
        assert_eq!(stream(&t, vec![], &ids).concat(), t.decode(&ids).unwrap());
        assert_eq!(t.decode(&ids).unwrap(), "Sure. call\u{FFFD} callé");
        // What the last tokens began, as decoding them all gives it.
        let mut d = StreamDecoder::keeping(vec![3, 4], false);
        let shown: String = [0, 3, 6].iter().filter_map(|&id| d.push(&t, id).unwrap()).collect();
        assert_eq!((shown.as_str(), d.rest(&t).unwrap().as_str()), ("Sure<tool_call>", "\u{FFFD}"));
        // Tags that are plain added tokens are text already.
        let t = write(false);
        assert_eq!(t.special_ids(&["<tool_call>", "</tool_call>"]), Vec::<u32>::new());
        assert_eq!(stream(&t, vec![], &ids).concat(), "Sure.<tool_call> call\u{FFFD}</tool_call> callé");
    }

    /// A tokenizer in `dir` (a three-word vocabulary) whose chat template is `template`.
    fn tokenizer_with(dir: &Path, template: &str) -> Tokenizer {
        let vocab = serde_json::json!({"<bos>": 0, "<eos>": 1, "hi": 2});
        let tok = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
            "decoder": null, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "hi"},
        });
        std::fs::write(dir.join("tokenizer.json"), tok.to_string()).unwrap();
        let cfg = serde_json::json!({"chat_template": template, "bos_token": "<bos>", "eos_token": "<eos>"});
        std::fs::write(dir.join("tokenizer_config.json"), cfg.to_string()).unwrap();
        Tokenizer::from_dir(dir).unwrap()
    }

    /// Further variables reach the template as HF's `apply_chat_template` passes its keyword
    /// arguments (a thinking model's switch, say), over the special tokens; those gridlm sets
    /// for every chat are refused.
    #[test]
    fn template_variables_reach_the_template() {
        let template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>\
                        {% if enable_thinking is defined and enable_thinking is false %}<think></think>{% endif %}\
                        {{ eos_token }}";
        let dir = tempfile::tempdir().unwrap();
        let t = tokenizer_with(dir.path(), template);
        let vars = |v: serde_json::Value| -> TemplateVars { serde_json::from_value(v).unwrap() };
        let render = |v: serde_json::Value| t.render_chat(&[("user", "hi")], &vars(v)).unwrap();
        assert_eq!(render(serde_json::json!({})), "<user>hi<assistant><eos>");
        assert_eq!(render(serde_json::json!({"enable_thinking": true})), "<user>hi<assistant><eos>");
        assert_eq!(
            render(serde_json::json!({"enable_thinking": false})),
            "<user>hi<assistant><think></think><eos>"
        );
        assert_eq!(render(serde_json::json!({"eos_token": "</s>"})), "<user>hi<assistant></s>");
        for name in ["messages", "add_generation_prompt"] {
            let e = check_template_vars(&vars(serde_json::json!({ name: 1 }))).unwrap_err();
            assert_eq!(e, format!("`{name}` is set by gridlm for every chat, not by a template variable"));
        }
        assert!(check_template_vars(&vars(serde_json::json!({"enable_thinking": false}))).is_ok());
    }

    /// JSON as Python's json.dumps writes it (the texts are Python 3's, by hand), and so the
    /// templates' `tojson`, indented or not.
    #[test]
    fn json_is_written_as_python_writes_it() {
        let v = serde_json::json!({"a": [1, {"b": "é\n\u{1}"}], "c": {}, "d": [], "e": 1.5, "f": null, "g": true});
        let flat = r#"{"a": [1, {"b": "é\n\u0001"}], "c": {}, "d": [], "e": 1.5, "f": null, "g": true}"#;
        let indented = "{\n  \"a\": [\n    1,\n    {\n      \"b\": \"é\\n\\u0001\"\n    }\n  ],\n  \"c\": {},\n  \"d\": [],\n  \"e\": 1.5,\n  \"f\": null,\n  \"g\": true\n}";
        assert_eq!(py_json(&v, None), flat);
        assert_eq!(py_json(&v, Some(2)), indented);
        let dir = tempfile::tempdir().unwrap();
        let t = tokenizer_with(dir.path(), "{{ x | tojson }}|{{ x | tojson(indent=2) }}");
        let mut vars = TemplateVars::new();
        vars.insert("x".into(), v);
        assert_eq!(t.render_chat(&[("user", "hi")], &vars).unwrap(), format!("{flat}|{indented}"));
    }

    /// A request's tools, an assistant's calls and a tool's answer reach the template as HF's
    /// `apply_chat_template` gives them (`tools=`, messages with `tool_calls` whose arguments
    /// are objects, `tool_call_id`): the text below is transformers 5.25's for this template
    /// and conversation, by hand.
    #[test]
    fn tools_and_calls_reach_the_template_as_hf_gives_them() {
        let template = r#"{%- if tools %}<tools>{% for t in tools %}{{ t.function.name }}: {{ t.function.description }} {{ t.function.parameters | tojson }}
{% endfor %}</tools>
{% endif %}
{%- for m in messages %}<{{ m.role }}>
{%- if m.tool_calls %}{% for c in m.tool_calls %}<call id="{{ c.id }}">{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}</call>{% endfor %}
{%- elif m.role == "tool" %}<result for="{{ m.tool_call_id }}">{{ m.content }}</result>
{%- else %}{{ m.content }}{% endif %}</{{ m.role }}>
{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"#;
        let dir = tempfile::tempdir().unwrap();
        let t = tokenizer_with(dir.path(), template);
        let tools = serde_json::json!([{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}}, "required": ["city"]}}}]);
        let body = serde_json::json!({"messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"unit\": \"c\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"}]});
        let messages = crate::prompts::messages_field(body.as_object().unwrap()).unwrap().unwrap();
        let mut vars = TemplateVars::new();
        vars.insert("tools".into(), tools);
        let want = "<tools>get_weather: The weather in a city. {\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\"}, \"unit\": {\"enum\": [\"c\", \"f\"]}}, \"required\": [\"city\"]}\n</tools>\n<user>Weather in Paris?</user>\n<assistant><call id=\"call_1\">{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"c\"}}</call></assistant>\n<tool><result for=\"call_1\">21 degrees</result></tool>\n<assistant>";
        assert_eq!(t.render_chat(&messages, &vars).unwrap(), want);
    }

    /// A chat ends with the prompt for an answer, closed after its last message, or open within
    /// it (HF's `continue_final_message`: cut after the last message's content where the
    /// template writes it, as given or trimmed); both asked at once is refused.
    #[test]
    fn chats_end_as_asked() {
        let template =
            "{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}</{{ m.role }}>{% endfor %}\
                        {% if add_generation_prompt %}<assistant>{% endif %}";
        let dir = tempfile::tempdir().unwrap();
        let t = tokenizer_with(dir.path(), template);
        let chat = [("user", "hi"), ("assistant", "The answer is ")];
        let render = |end| t.render_chat_to(&chat, &TemplateVars::new(), end).unwrap();
        assert_eq!(render(ChatEnd::Answer), "<user>hi</user><assistant>The answer is</assistant><assistant>");
        assert_eq!(render(ChatEnd::Closed), "<user>hi</user><assistant>The answer is</assistant>");
        assert_eq!(render(ChatEnd::Open), "<user>hi</user><assistant>The answer is");
        let t = tokenizer_with(dir.path(), "{% for m in messages %}{{ m.role }}{% endfor %}");
        let e = t.render_chat_to(&[("user", "hi")], &TemplateVars::new(), ChatEnd::Open).unwrap_err();
        assert!(e.to_string().contains("does not write the last message's content"), "{e}");
        assert_eq!(ChatEnd::asked(None, None), Ok(ChatEnd::Answer));
        assert_eq!(ChatEnd::asked(Some(false), None), Ok(ChatEnd::Closed));
        assert_eq!(ChatEnd::asked(None, Some(true)), Ok(ChatEnd::Open));
        assert_eq!(ChatEnd::asked(Some(false), Some(true)), Ok(ChatEnd::Open));
        assert!(ChatEnd::asked(Some(true), Some(true)).unwrap_err().contains("must not be true"));
    }

    /// The template is found where HF finds it: chat_template.jinja before chat_template.json
    /// before tokenizer_config.json, whose template may be a list of named ones.
    #[test]
    fn chat_templates_are_found_where_hf_looks() {
        let dir = tempfile::tempdir().unwrap();
        let named = serde_json::json!([{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "list"}]);
        tokenizer_with(dir.path(), ""); // the vocabulary's files
        let cfg = serde_json::json!({"chat_template": named, "bos_token": "<bos>"});
        std::fs::write(dir.path().join("tokenizer_config.json"), cfg.to_string()).unwrap();
        let render = || Tokenizer::from_dir(dir.path()).unwrap().apply_chat_template(None, "x").unwrap();
        assert_eq!(render(), "list");
        std::fs::write(dir.path().join("chat_template.json"), r#"{"chat_template": "json"}"#).unwrap();
        assert_eq!(render(), "json");
        std::fs::write(dir.path().join("chat_template.jinja"), "jinja {{ bos_token }}").unwrap();
        assert_eq!(render(), "jinja <bos>");
        // A broken template names the file it came from.
        std::fs::write(dir.path().join("chat_template.jinja"), "{% if %}").unwrap();
        let e =
            Tokenizer::from_dir(dir.path()).unwrap().apply_chat_template(None, "x").unwrap_err().to_string();
        assert!(e.contains("chat_template.jinja") && e.contains("chat_template:"), "{e}");
        std::fs::remove_file(dir.path().join("chat_template.jinja")).unwrap();
        std::fs::write(dir.path().join("chat_template.json"), r#"{"template": "json"}"#).unwrap();
        let e = Tokenizer::from_dir(dir.path()).err().unwrap().to_string();
        assert!(e.contains("chat_template.json") && e.contains("no `chat_template` string"), "{e}");
    }

    /// A chat template written with the constructs Gemma 3's uses (the system message folded
    /// into the first user turn, `raise_exception` on roles that do not alternate, `is string`,
    /// `| trim`, `loop.first`, `loop.index0`, a list slice, `bos_token` written by the
    /// template itself) renders one user message as Gemma 3 expects it.
    #[test]
    fn a_gemma3_style_chat_template_renders() {
        let template = r#"{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
  {%- set prefix = messages[0]['content'] + '\n\n' -%}{%- set turns = messages[1:] -%}
{%- else -%}
  {%- set prefix = '' -%}{%- set turns = messages -%}
{%- endif -%}
{%- for m in turns -%}
  {%- if (m['role'] == 'user') != (loop.index0 % 2 == 0) -%}
    {{ raise_exception('roles must alternate') }}
  {%- endif -%}
  {%- set role = 'model' if m['role'] == 'assistant' else m['role'] -%}
  {{ '<start_of_turn>' + role + '\n' + (prefix if loop.first else '') }}
  {%- if m['content'] is string -%}{{ m['content'] | trim }}{%- endif -%}
  {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"#;
        let dir = tempfile::tempdir().unwrap();
        let t = tokenizer_with(dir.path(), template);
        assert_eq!(
            t.apply_chat_template(None, "  Why is the sky blue? ").unwrap(),
            "<bos><start_of_turn>user\nWhy is the sky blue?<end_of_turn>\n<start_of_turn>model\n"
        );
        // A system message goes where the template puts it: here, into the first user turn.
        assert_eq!(
            t.apply_chat_template(Some("Be brief."), "Why?").unwrap(),
            "<bos><start_of_turn>user\nBe brief.\n\nWhy?<end_of_turn>\n<start_of_turn>model\n"
        );
        assert_eq!(t.eos_id(), Some(1));
    }
}
