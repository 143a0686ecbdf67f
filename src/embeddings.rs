//! OpenAI's embeddings requests (`POST /v1/embeddings`): what a request asks, how the model's
//! folder says its embeddings are pooled (sentence-transformers' `modules.json`), and the
//! answer's body. The engine pools ([`crate::engine::Pooling`]); `serve` carries the requests.

use crate::engine::{normalized, Pooling};
use base64::Engine as _;
use serde_json::{json, Map, Value};
use std::path::Path;

/// The most inputs one request may give (OpenAI's bound).
pub const MAX_INPUTS: usize = 2048;

/// Keys an embeddings request may have.
const KEYS: [&str; 6] = ["model", "input", "encoding_format", "dimensions", "user", "normalize"];

/// What an embeddings request asks.
#[derive(Debug, Clone, PartialEq)]
pub struct Ask {
    /// Its inputs: texts, or token ids.
    pub input: Input,
    /// Each embedding as a base64 text of its little-endian f32 values (`encoding_format`
    /// `base64`) rather than a list of numbers.
    pub base64: bool,
    /// Each embedding scaled to length 1 (vLLM's `normalize`; the default).
    pub normalize: bool,
}

/// An embeddings request's `input`.
#[derive(Debug, Clone, PartialEq)]
pub enum Input {
    Texts(Vec<String>),
    Ids(Vec<Vec<u32>>),
}

impl Input {
    /// How many inputs there are.
    pub fn len(&self) -> usize {
        match self {
            Input::Texts(t) => t.len(),
            Input::Ids(i) => i.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Reads and checks an embeddings request's body; the error names the key and what is wrong.
pub fn parse(body: &[u8]) -> Result<Ask, String> {
    let obj: Map<String, Value> =
        serde_json::from_slice(body).map_err(|e| format!("the body is not a JSON object: {e}"))?;
    if let Some(k) = obj.keys().find(|k| !KEYS.contains(&k.as_str())) {
        return Err(format!("unknown key `{k}`"));
    }
    let given = |k: &str| obj.get(k).filter(|v| !v.is_null());
    if let Some(d) = given("dimensions") {
        return Err(format!(
            "`dimensions` {d}: gridlm gives the model's whole hidden state (its embeddings are not trained to be cut)"
        ));
    }
    let base64 = match given("encoding_format").map(|v| v.as_str()) {
        None | Some(Some("float")) => false,
        Some(Some("base64")) => true,
        Some(_) => return Err("`encoding_format` must be float or base64".into()),
    };
    let normalize = match given("normalize") {
        None => true,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err("`normalize` must be true or false".into()),
    };
    let ids = |v: &Value| -> Option<Vec<u32>> {
        v.as_array()?.iter().map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok())).collect()
    };
    let shape = "`input` must be a text, a list of texts, a list of token ids or a list of such lists";
    let input = match given("input") {
        None => return Err("no `input`".into()),
        Some(Value::String(t)) => Input::Texts(vec![t.clone()]),
        Some(Value::Array(a)) if a.is_empty() => return Err("`input` is an empty list".into()),
        Some(Value::Array(a)) if a.iter().all(Value::is_string) => {
            Input::Texts(a.iter().filter_map(|t| t.as_str().map(str::to_string)).collect())
        }
        Some(v @ Value::Array(a)) if a.iter().all(Value::is_number) => Input::Ids(vec![ids(v).ok_or(shape)?]),
        Some(Value::Array(a)) => Input::Ids(a.iter().map(ids).collect::<Option<_>>().ok_or(shape)?),
        Some(_) => return Err(shape.into()),
    };
    if input.len() > MAX_INPUTS {
        return Err(format!("`input`: at most {MAX_INPUTS} inputs a request, got {}", input.len()));
    }
    let empty = match &input {
        Input::Texts(t) => t.iter().position(String::is_empty),
        Input::Ids(i) => i.iter().position(Vec::is_empty),
    };
    if let Some(i) = empty {
        let at = if input.len() > 1 { format!("`input[{i}]`") } else { "`input`".into() };
        return Err(format!("{at} is empty"));
    }
    Ok(Ask { input, base64, normalize })
}

/// The answer to an embeddings request: OpenAI's list of `embedding` objects, in the inputs'
/// order, and the prompt tokens they took.
pub fn body(model: &str, ask: &Ask, embeddings: &[Vec<f32>], prompt_tokens: usize) -> Value {
    let data: Vec<Value> = embeddings
        .iter()
        .enumerate()
        .map(|(i, e)| {
            let e = if ask.normalize { normalized(e) } else { e.clone() };
            let embedding = if ask.base64 {
                let bytes: Vec<u8> = e.iter().flat_map(|v| v.to_le_bytes()).collect();
                json!(base64::engine::general_purpose::STANDARD.encode(bytes))
            } else {
                Value::Array(e.iter().map(|&v| number(v)).collect())
            };
            json!({"object": "embedding", "index": i, "embedding": embedding})
        })
        .collect();
    json!({"object": "list", "data": data, "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}})
}

/// `v` as JSON in the fewest digits that read back as the same f32 (`0.6`, not the
/// `0.6000000238418579` of its f64).
fn number(v: f32) -> Value {
    let shortest: f64 = v.to_string().parse().unwrap_or(f64::NAN);
    serde_json::Number::from_f64(shortest).map_or(Value::Null, Value::Number)
}

/// How the model folder `dir` says its embeddings are pooled: the pooling module of its
/// sentence-transformers pipeline (`modules.json`, then that module's `config.json`), `None`
/// where it has none. A pooling gridlm does not have is an error naming it.
pub fn folder_pooling(dir: &Path) -> Result<Option<Pooling>, String> {
    let modules = dir.join("modules.json");
    let Ok(text) = std::fs::read(&modules) else { return Ok(None) };
    let at = |e: String| format!("{}: {e}", modules.display());
    let list: Vec<Value> =
        serde_json::from_slice(&text).map_err(|e| at(format!("not a list of modules: {e}")))?;
    let pooling = list.iter().find(|m| m["type"].as_str().is_some_and(|t| t.ends_with(".Pooling")));
    let Some(path) = pooling.map(|m| m["path"].as_str().unwrap_or_default()) else { return Ok(None) };
    let config = dir.join(path).join("config.json");
    let at = |e: String| format!("{}: {e}", config.display());
    let text = std::fs::read(&config).map_err(|e| at(format!("cannot read it: {e}")))?;
    let c: Map<String, Value> =
        serde_json::from_slice(&text).map_err(|e| at(format!("not a pooling configuration: {e}")))?;
    let on: Vec<&str> = c
        .iter()
        .filter(|(k, v)| k.starts_with("pooling_mode_") && v.as_bool() == Some(true))
        .map(|(k, _)| &k["pooling_mode_".len()..])
        .collect();
    match on[..] {
        ["lasttoken"] => Ok(Some(Pooling::Last)),
        ["mean_tokens"] => Ok(Some(Pooling::Mean)),
        ["cls_token"] => Ok(Some(Pooling::Cls)),
        _ => Err(at(format!(
            "pooling by {}: gridlm pools by one of lasttoken, mean_tokens or cls_token (--pooling picks one)",
            if on.is_empty() { "nothing".to_string() } else { on.join(" and ") }
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_are_read_and_bad_ones_named() {
        let ask = |b: &str| parse(b.as_bytes());
        let texts = |t: &[&str]| Input::Texts(t.iter().map(|s| s.to_string()).collect());
        assert_eq!(
            ask(r#"{"input":"hi","model":"m"}"#).unwrap(),
            Ask { input: texts(&["hi"]), base64: false, normalize: true }
        );
        assert_eq!(
            ask(r#"{"input":["a","b"],"encoding_format":"base64"}"#).unwrap().input,
            texts(&["a", "b"])
        );
        assert!(ask(r#"{"input":"a","encoding_format":"base64"}"#).unwrap().base64);
        assert_eq!(ask(r#"{"input":[1,2,3]}"#).unwrap().input, Input::Ids(vec![vec![1, 2, 3]]));
        assert_eq!(
            ask(r#"{"input":[[1],[2,3]],"normalize":false}"#).unwrap().input,
            Input::Ids(vec![vec![1], vec![2, 3]])
        );
        assert!(!ask(r#"{"input":"a","normalize":false,"dimensions":null,"user":"u"}"#).unwrap().normalize);
        for (body, msg) in [
            ("[1]", "the body is not a JSON object"),
            (r#"{"input":"a","prompt":"b"}"#, "unknown key `prompt`"),
            (r#"{}"#, "no `input`"),
            (r#"{"input":[]}"#, "`input` is an empty list"),
            (r#"{"input":""}"#, "`input` is empty"),
            (r#"{"input":["a",""]}"#, "`input[1]` is empty"),
            (r#"{"input":[[1],[]]}"#, "`input[1]` is empty"),
            (r#"{"input":[1,"a"]}"#, "`input` must be a text, a list of texts"),
            (r#"{"input":[-1]}"#, "`input` must be a text"),
            (r#"{"input":5}"#, "`input` must be a text"),
            (
                r#"{"input":"a","dimensions":64}"#,
                "`dimensions` 64: gridlm gives the model's whole hidden state",
            ),
            (r#"{"input":"a","encoding_format":"int8"}"#, "`encoding_format` must be float or base64"),
            (r#"{"input":"a","normalize":1}"#, "`normalize` must be true or false"),
        ] {
            let e = ask(body).unwrap_err();
            assert!(e.starts_with(msg), "{body}: {e}");
        }
        let many = format!(r#"{{"input":[{}]}}"#, vec!["\"a\""; MAX_INPUTS + 1].join(","));
        assert!(ask(&many).unwrap_err().contains("at most 2048 inputs"));
    }

    /// The answer: each embedding of length 1 (or as pooled), as numbers or as base64 text of
    /// its little-endian f32 values.
    #[test]
    fn answers_are_openais() {
        let ask = parse(br#"{"input":["a","b"]}"#).unwrap();
        let v = body("m", &ask, &[vec![3.0, 4.0], vec![0.0, 0.0]], 5);
        assert_eq!(
            v,
            json!({"object": "list", "model": "m", "usage": {"prompt_tokens": 5, "total_tokens": 5},
                "data": [{"object": "embedding", "index": 0, "embedding": [0.6, 0.8]},
                    {"object": "embedding", "index": 1, "embedding": [0.0, 0.0]}]})
        );
        let ask = parse(br#"{"input":"a","encoding_format":"base64","normalize":false}"#).unwrap();
        let v = body("m", &ask, &[vec![1.0, -2.5]], 1);
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(v["data"][0]["embedding"].as_str().unwrap())
            .unwrap();
        assert_eq!(bytes, [1.0f32.to_le_bytes(), (-2.5f32).to_le_bytes()].concat());
    }

    /// The pooling a sentence-transformers folder names; none without its modules; a mode
    /// gridlm lacks named.
    #[test]
    fn folders_say_how_they_pool() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(folder_pooling(dir.path()), Ok(None));
        let modules = json!([
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]);
        std::fs::write(dir.path().join("modules.json"), modules.to_string()).unwrap();
        std::fs::create_dir(dir.path().join("1_Pooling")).unwrap();
        let write = |modes: &[&str]| {
            let mut c = json!({"word_embedding_dimension": 1024, "pooling_mode_cls_token": false,
                "pooling_mode_mean_tokens": false, "pooling_mode_max_tokens": false,
                "pooling_mode_lasttoken": false, "include_prompt": true});
            for m in modes {
                c[format!("pooling_mode_{m}")] = json!(true);
            }
            std::fs::write(dir.path().join("1_Pooling/config.json"), c.to_string()).unwrap();
        };
        for (mode, want) in
            [("lasttoken", Pooling::Last), ("mean_tokens", Pooling::Mean), ("cls_token", Pooling::Cls)]
        {
            write(&[mode]);
            assert_eq!(folder_pooling(dir.path()), Ok(Some(want)));
        }
        write(&["max_tokens"]);
        let e = folder_pooling(dir.path()).unwrap_err();
        assert!(e.contains("1_Pooling/config.json: pooling by max_tokens: gridlm pools by one of"), "{e}");
        write(&["mean_tokens", "cls_token"]);
        assert!(folder_pooling(dir.path()).unwrap_err().contains("pooling by cls_token and mean_tokens"));
    }
}
