//! `gridlm serve`: OpenAI-style completions over HTTP on a grid of ranks, each request joining
//! the running batch as it comes, checked against the engine run alone on the real model.

use super::*;
use gridlm::comm::Single;
use gridlm::engine::GenerateOptions;
use gridlm::tokenizer::Tokenizer;
use gridlm_reference::launch_command;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// A `gridlm serve` job on local ranks, stopped (its whole process group) when dropped.
struct Server {
    child: std::process::Child,
    port: u16,
    /// Sent as the bearer token, when set.
    key: Option<String>,
    log: PathBuf,
    _tmp: tempfile::TempDir,
}

impl Server {
    /// `launch/local RANKS gridlm serve --model DIR --threads 1 --listen 127.0.0.1:0 ARGS...`,
    /// once it says where it listens.
    fn start(ranks: usize, dir: &Path, args: &[&str]) -> Server {
        Self::start_with(ranks, dir, args, &[])
    }

    /// [`Server::start`] with `env` set for it.
    fn start_with(ranks: usize, dir: &Path, args: &[&str], env: &[(&str, &str)]) -> Server {
        use std::os::unix::process::CommandExt;
        let tmp = tempfile::tempdir().unwrap();
        let log = tmp.path().join("stderr");
        let n = ranks.to_string();
        let mut cmd = launch_command(&["local", &n]);
        cmd.args(["serve", "--model", path_str(dir), "--threads", "1", "--listen", "127.0.0.1:0"]).args(args);
        cmd.envs(env.iter().copied()).process_group(0).stdout(std::process::Stdio::piped());
        cmd.stderr(std::fs::File::create(&log).unwrap());
        let mut child = cmd.spawn().unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut out = BufReader::new(stdout);
            let mut line = String::new();
            let _ = out.read_line(&mut line);
            let _ = tx.send(line);
            // Read on to the end: a launcher writing into a closed pipe would die of it.
            let _ = std::io::copy(&mut out, &mut std::io::sink());
        });
        let mut server = Server { child, port: 0, key: None, log, _tmp: tmp };
        let line = rx.recv_timeout(Duration::from_secs(300)).unwrap_or_default();
        let port = line.split("http://127.0.0.1:").nth(1).and_then(|r| r.split('/').next()?.parse().ok());
        server.port =
            port.unwrap_or_else(|| panic!("no address in {line:?}; stderr:\n{}", server.log_text()));
        server
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// A connection with the request `method path` with `body` sent.
    fn send(&self, method: &str, path: &str, body: &str) -> BufReader<TcpStream> {
        let mut s = TcpStream::connect(("127.0.0.1", self.port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(300))).unwrap();
        let auth = self.key.as_ref().map(|k| format!("Authorization: Bearer {k}\r\n")).unwrap_or_default();
        write!(
            s,
            "{method} {path} HTTP/1.1\r\nHost: localhost\r\n{auth}Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        BufReader::new(s)
    }

    /// The request `head` (its request line and headers, without the blank line) with `body`,
    /// on a connection of its own: the answer's head and body as sent.
    fn raw(&self, head: &str, body: &str) -> String {
        let mut s = TcpStream::connect(("127.0.0.1", self.port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(300))).unwrap();
        write!(s, "{head}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len()).unwrap();
        let mut answer = String::new();
        s.read_to_string(&mut answer).unwrap();
        answer
    }

    /// A streamed completion of thousands of tokens, once its first event has come: it runs on
    /// while other requests come, until its connection is dropped.
    fn long_stream(&self) -> BufReader<TcpStream> {
        let long =
            json!({"prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": true, "stream": true});
        let mut stream = self.send("POST", "/v1/completions", &long.to_string());
        let mut line = String::new();
        while !line.contains("data: ") {
            line.clear();
            assert!(stream.read_line(&mut line).unwrap() > 0, "the stream ended before its first event");
        }
        stream
    }

    /// Waits (a minute at most) until `/metrics` counts `n` requests in flight.
    fn wait_in_flight(&self, n: usize) {
        let want = format!("gridlm_requests_in_flight {n}");
        let deadline = Instant::now() + Duration::from_secs(60);
        while !self.http("GET", "/metrics", "").1.lines().any(|l| l == want) {
            assert!(Instant::now() < deadline, "never {want}:\n{}", self.log_text());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// `method path` with `body`: the status and the body (chunks joined).
    fn http(&self, method: &str, path: &str, body: &str) -> (u16, String) {
        let mut r = self.send(method, path, body);
        let mut line = String::new();
        r.read_line(&mut line).unwrap();
        let status: u16 = line.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or_else(|| {
            panic!("{method} {path}: a status line {line:?}; the server's stderr:\n{}", self.log_text())
        });
        let (mut length, mut chunked) = (None, false);
        loop {
            line.clear();
            r.read_line(&mut line).unwrap();
            let l = line.trim_end().to_ascii_lowercase();
            if l.is_empty() {
                break;
            }
            if let Some(v) = l.strip_prefix("content-length:") {
                length = v.trim().parse::<usize>().ok();
            }
            chunked |= l == "transfer-encoding: chunked";
        }
        let mut body = Vec::new();
        if chunked {
            loop {
                line.clear();
                r.read_line(&mut line).unwrap();
                let n =
                    usize::from_str_radix(line.trim(), 16).unwrap_or_else(|_| panic!("chunk size {line:?}"));
                let mut chunk = vec![0; n + 2];
                r.read_exact(&mut chunk).unwrap();
                if n == 0 {
                    break;
                }
                body.extend_from_slice(&chunk[..n]);
            }
        } else {
            let mut b = vec![0; length.expect("a length or chunks")];
            r.read_exact(&mut b).unwrap();
            body = b;
        }
        (status, String::from_utf8(body).unwrap())
    }

    /// A POST whose answer is JSON.
    fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let (status, text) = self.http("POST", path, &body.to_string());
        let v = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
        (status, v)
    }

    /// A streamed POST: the events' JSON objects, after checking the stream ends with `[DONE]`.
    fn events(&self, path: &str, body: &Value) -> Vec<Value> {
        let (status, text) = self.http("POST", path, &body.to_string());
        assert_eq!(status, 200, "{text}");
        let data: Vec<&str> =
            text.split("\n\n").filter(|e| !e.is_empty()).map(|e| e.strip_prefix("data: ").unwrap()).collect();
        assert_eq!(data.last(), Some(&"[DONE]"), "{text}");
        data[..data.len() - 1].iter().map(|d| serde_json::from_str(d).unwrap()).collect()
    }

    /// The typed events (the Responses API's) a request for a stream gets: each its type and its
    /// data, whose `type` and `sequence_number` are checked.
    fn typed_events(&self, path: &str, body: &Value) -> Vec<(String, Value)> {
        let (status, text) = self.http("POST", path, &body.to_string());
        assert_eq!(status, 200, "{text}");
        let events: Vec<(String, Value)> = text
            .split("\n\n")
            .filter(|e| !e.is_empty())
            .map(|e| {
                let (kind, data) = e.strip_prefix("event: ").and_then(|e| e.split_once("\ndata: ")).unwrap();
                (kind.to_string(), serde_json::from_str(data).unwrap())
            })
            .collect();
        for (i, (kind, data)) in events.iter().enumerate() {
            assert_eq!((&data["type"], &data["sequence_number"]), (&json!(kind), &json!(i)), "{data}");
        }
        events
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // SAFETY: signals the process group the server was started in.
        unsafe { libc::kill(-(self.child.id() as i32), libc::SIGTERM) };
        for _ in 0..100 {
            if self.child.try_wait().ok().flatten().is_some() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        // SAFETY: as above.
        unsafe { libc::kill(-(self.child.id() as i32), libc::SIGKILL) };
        let _ = self.child.wait();
    }
}

const TEXTS: [&str; 6] = [
    "The capital of France is",
    "def add(a, b):",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "1, 2, 3, 4,",
    "Water boils at",
    "In 1969, the first humans to walk on the Moon were",
];

/// A completion's text and token count.
fn text_of(v: &Value) -> (String, u64) {
    let c = &v["choices"][0];
    let text = c["text"].as_str().or(c["message"]["content"].as_str()).unwrap_or_else(|| panic!("{v}"));
    (text.to_string(), v["usage"]["completion_tokens"].as_u64().unwrap())
}

/// Two pipeline stages, a request at a time and six at once (so they join each other's steps
/// as they come), streamed and not, completions and chat: every answer is the engine's greedy
/// text for its prompt run alone in this process, token for token (without tensor parallelism a
/// sequence's sums do not depend on what shares its step). The stream's pieces make the same
/// text and end with the finish reason, the usage chunk and `[DONE]`; a stop string cuts the
/// text; bad requests get a 400 (404, 405) naming what is wrong, and the server runs on.
#[test]
fn serve_answers_as_the_engine_alone_on_two_stages() {
    let dir = smollm2("bf16");
    let tok = Tokenizer::from_dir(&dir).unwrap();
    let eos_ids = tok.eos_id().into_iter().collect::<Vec<_>>();
    let mut e = local_engine_on(&dir, None, 2);
    let opts = GenerateOptions { max_tokens: 16, ignore_eos: false, eos_ids, keep_prompt_logits: false };
    let mut alone = |ids: &[u32]| {
        let g = e.generate(ids, &opts, &Single, &Single, |_| Ok(())).unwrap();
        (tok.decode(&g.token_ids).unwrap(), g.token_ids.len() as u64)
    };
    let want: Vec<(String, u64)> = TEXTS.iter().map(|t| alone(&tok.encode(t, true).unwrap())).collect();
    let chat_prompt = "Explain in one sentence why the sky is blue.";
    let chat_ids = tok.encode(&tok.apply_chat_template(None, chat_prompt).unwrap(), false).unwrap();
    let chat_want = alone(&chat_ids);
    // A reply begun for the model (vLLM's `continue_final_message`): the rendered conversation
    // cut after the begun reply, its answer continuing it.
    let begun = [("user", chat_prompt), ("assistant", "The sky is blue because")];
    let vars = gridlm::tokenizer::TemplateVars::new();
    let open = tok.render_chat_to(&begun, &vars, gridlm::tokenizer::ChatEnd::Open).unwrap();
    assert!(open.ends_with("The sky is blue because"), "{open:?}");
    let begun_ids = tok.encode(&open, false).unwrap();
    let begun_want = alone(&begun_ids);

    let server = Server::start(2, &dir, &["--pp", "2", "--max-tokens", "16"]);
    let (status, models) = server.http("GET", "/v1/models", "");
    assert_eq!(status, 200);
    assert!(models.contains("\"SmolLM2-135M-Instruct-bf16\""), "{models}");
    let (status, model) = server.http("GET", "/v1/models/SmolLM2-135M-Instruct-bf16", "");
    assert_eq!(status, 200);
    assert!(model.contains("\"object\":\"model\""), "{model}");
    let (status, other) = server.http("GET", "/v1/models/gpt-4o", "");
    assert_eq!(status, 404);
    assert!(other.contains("no model gpt-4o (this server has SmolLM2-135M-Instruct-bf16)"), "{other}");
    assert_eq!(server.http("POST", "/v1/models/SmolLM2-135M-Instruct-bf16", "").0, 405);
    assert_eq!(server.http("GET", "/health", "").0, 200);
    // vLLM's /tokenize and /detokenize: a prompt's tokens as a completion's, a chat's as a chat
    // request's, and their text back, special tokens written.
    let ids = |v: &Value| -> Vec<u32> {
        v["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect()
    };
    let (status, v) = server.post("/tokenize", &json!({"prompt": TEXTS[0]}));
    assert_eq!((status, ids(&v)), (200, tok.encode(TEXTS[0], true).unwrap()), "{v}");
    assert_eq!(v["count"], tok.encode(TEXTS[0], true).unwrap().len());
    let chat = json!({"messages": [{"role": "user", "content": chat_prompt}]});
    let (status, v) = server.post("/tokenize", &chat);
    assert_eq!((status, ids(&v)), (200, chat_ids.clone()), "{v}");
    let (status, v) = server.post("/detokenize", &json!({"tokens": chat_ids}));
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["prompt"], tok.apply_chat_template(None, chat_prompt).unwrap());
    let (status, v) = server.post("/detokenize", &json!({"tokens": [49152]}));
    assert_eq!(status, 400, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("outside the vocabulary"), "{v}");

    // One at a time (each after the ranks went to sleep), then all at once.
    for (t, w) in TEXTS.iter().zip(&want).take(2) {
        let (status, v) = server.post("/v1/completions", &json!({"prompt": t}));
        assert_eq!(status, 200, "{v}");
        assert_eq!(&text_of(&v), w, "{t:?} alone");
        assert_eq!(v["object"], "text_completion");
        std::thread::sleep(Duration::from_millis(300));
    }
    let server_ref = &server;
    std::thread::scope(|s| {
        let handles: Vec<_> = TEXTS
            .iter()
            .map(|t| {
                s.spawn(move || server_ref.post("/v1/completions", &json!({"prompt": t, "max_tokens": 16})))
            })
            .collect();
        for ((h, t), w) in handles.into_iter().zip(TEXTS).zip(&want) {
            let (status, v) = h.join().unwrap();
            assert_eq!(status, 200, "{v}");
            assert_eq!(&text_of(&v), w, "{t:?} among the others");
            let finish = if w.1 == 16 { "length" } else { "stop" };
            assert_eq!(v["choices"][0]["finish_reason"], finish, "{t:?}");
            assert_eq!(v["usage"]["prompt_tokens"], tok.encode(t, true).unwrap().len());
        }
    });

    // Streamed: the same text in pieces, then the finish, the usage and [DONE].
    let req = json!({"prompt": TEXTS[2], "stream": true, "stream_options": {"include_usage": true}});
    let events = server.events("/v1/completions", &req);
    let (usage, pieces) = events.split_last().unwrap();
    assert!(pieces.len() > 2, "{events:?}");
    let text: String = pieces.iter().map(|e| e["choices"][0]["text"].as_str().unwrap()).collect();
    assert_eq!((text, usage["usage"]["completion_tokens"].as_u64().unwrap()), want[2]);
    assert!(pieces[..pieces.len() - 1].iter().all(|e| e["choices"][0]["finish_reason"].is_null()));
    assert_eq!(pieces.last().unwrap()["choices"][0]["finish_reason"], "length");

    // Chat, whole and streamed.
    let chat = json!({"messages": [{"role": "user", "content": chat_prompt}]});
    let (status, v) = server.post("/v1/chat/completions", &chat);
    assert_eq!(status, 200, "{v}");
    assert_eq!(text_of(&v), chat_want);
    let begun_messages: Vec<Value> = begun.iter().map(|(r, c)| json!({"role": r, "content": c})).collect();
    let begun_ask = json!({"messages": begun_messages, "continue_final_message": true, "max_tokens": 16});
    let (status, v) = server.post("/v1/chat/completions", &begun_ask);
    assert_eq!((status, text_of(&v)), (200, begun_want), "{v}");
    assert_eq!(
        (v["object"].as_str(), v["choices"][0]["message"]["role"].as_str()),
        (Some("chat.completion"), Some("assistant"))
    );
    let mut streamed = chat.clone();
    streamed["stream"] = json!(true);
    let events = server.events("/v1/chat/completions", &streamed);
    assert_eq!(events[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = events.iter().filter_map(|e| e["choices"][0]["delta"]["content"].as_str()).collect();
    assert_eq!(text, chat_want.0);
    assert_eq!(events.last().unwrap()["object"], "chat.completion.chunk");

    // Two prompts, two completions each (greedy: the same twice), whole and streamed.
    let pair = json!({"prompt": [TEXTS[0], TEXTS[4]], "n": 2});
    let (status, v) = server.post("/v1/completions", &pair);
    assert_eq!(status, 200, "{v}");
    let texts: Vec<&str> = (0..4).map(|i| v["choices"][i]["text"].as_str().unwrap()).collect();
    assert_eq!(texts, [&want[0].0, &want[0].0, &want[4].0, &want[4].0]);
    let prompt_tokens =
        [TEXTS[0], TEXTS[4]].iter().map(|t| tok.encode(t, true).unwrap().len()).sum::<usize>();
    assert_eq!(v["usage"]["prompt_tokens"], prompt_tokens);
    assert_eq!(v["usage"]["completion_tokens"], 2 * (want[0].1 + want[4].1));
    let mut streamed = pair.clone();
    streamed["stream"] = json!(true);
    let events = server.events("/v1/completions", &streamed);
    let mut joined = vec![String::new(); 4];
    for e in &events {
        let c = &e["choices"][0];
        joined[c["index"].as_u64().unwrap() as usize] += c["text"].as_str().unwrap();
    }
    assert_eq!(joined, texts);
    let finished = events.iter().filter(|e| !e["choices"][0]["finish_reason"].is_null()).count();
    assert_eq!(finished, 4, "a finish reason for each completion");

    // A stop string: the text up to it, finish reason `stop`.
    let (cut, _) = want[3].0.split_at(want[3].0.find(" 6").expect("the count goes on past 6"));
    let (_, v) = server.post("/v1/completions", &json!({"prompt": TEXTS[3], "stop": [" 6"]}));
    assert_eq!(
        (v["choices"][0]["text"].as_str(), v["choices"][0]["finish_reason"].as_str()),
        (Some(cut), Some("stop"))
    );

    // Bad requests: the status and a message naming what is wrong; the server runs on.
    let long = "word ".repeat(9000);
    for (path, body, status, fragment) in [
        ("/v1/completions", "{\"prompt\": 1}".to_string(), 400, "`prompt` must be a string"),
        ("/v1/completions", "not json".to_string(), 400, "not a JSON object"),
        ("/v1/completions", "{\"prompt\":\"a\",\"temprature\":1}".into(), 400, "unknown key `temprature`"),
        ("/v1/completions", "{\"prompt\":\"a\",\"top_p\":2}".into(), 400, "`top_p`"),
        ("/v1/completions", "{\"prompt\":\"a\",\"n\":65}".into(), 400, "`n`"),
        ("/v1/chat/completions", "{\"prompt\":\"a\"}".into(), 400, "`messages`"),
        ("/v1/completions", json!({"prompt": long}).to_string(), 400, "context"),
        ("/v1/embeddings", "{}".into(), 400, "no `input`"),
        ("/v1/audio/speech", "{}".into(), 404, "no endpoint /v1/audio/speech"),
    ] {
        let (got, text) = server.http("POST", path, &body);
        assert_eq!(got, status, "{path} {body:.40}: {text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(msg.contains(fragment), "{path} {body:.40}: {msg}");
    }
    assert_eq!(server.http("GET", "/v1/completions", "").0, 405);
    // A body declared larger than any memory is refused from the head alone (the HTTP library
    // once drained such a body into a buffer of its declared length, and the job aborted).
    let mut s = TcpStream::connect(("127.0.0.1", server.port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    s.write_all(b"POST /v1/completions HTTP/1.1\r\nContent-Length: 99999999999999\r\n\r\n{}").unwrap();
    let mut answer = String::new();
    let _ = s.read_to_string(&mut answer);
    assert!(answer.starts_with("HTTP/1.1 413 ") && answer.contains("larger than 16 MiB"), "{answer}");
    let (status, v) = server.post("/v1/completions", &json!({"prompt": TEXTS[0]}));
    assert_eq!((status, text_of(&v)), (200, want[0].clone()), "after the bad requests");
    let log = server.log_text();
    assert!(!log.contains("panicked") && !log.contains("error:"), "{log}");
    assert!(log.contains("serve: cmpl-0 /v1/completions 200"), "{log}");
    assert!(log.contains("serve: /v1/completions 400: unknown key `temprature`"), "{log}");
    assert!(log.contains("serve: /v1/completions 413: the body is larger than 16 MiB"), "{log}");
}

/// Tensor parallelism over two ranks (9 heads split 5 + 4): a request alone gets the text
/// `generate` gives on the same layout, whole and streamed, with the same log-probabilities
/// where asked, and a sampled request with a seed gets the same tokens twice.
#[test]
fn serve_on_two_tensor_parallel_ranks_answers_as_generate() {
    let dir = smollm2("bf16");
    let prompt = "The three primary colors are red,";
    let mut cmd = launch_command(&["local", "2"]);
    cmd.args(["generate", "--model", path_str(&dir), "--threads", "1", "--tp", "2", "--prompt", prompt]);
    cmd.args(["--max-tokens", "24", "--json", "--logprobs", "3", "--prompt-logprobs", "3"]);
    let out = gridlm_reference::run_with_timeout(cmd, 300);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let g: Value = serde_json::from_slice(&out.stdout).unwrap();
    let server = Server::start(2, &dir, &["--tp", "2"]);
    logprobs_as_generate(&server, prompt, &g);
    let (status, v) = server.post("/v1/completions", &json!({"prompt": prompt, "max_tokens": 24}));
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["text"], g["text"]);
    assert_eq!(v["usage"]["completion_tokens"], g["token_ids"].as_array().unwrap().len());
    // The prompt as its token ids: the same answer; an id outside the vocabulary: 400.
    let by_ids = json!({"prompt": g["prompt_token_ids"], "max_tokens": 24});
    let (status, w) = server.post("/v1/completions", &by_ids);
    assert_eq!((status, &w["choices"][0]["text"]), (200, &g["text"]), "{w}");
    let (status, e) = server.post("/v1/completions", &json!({"prompt": [[1, 2], [49152]]}));
    let msg = e["error"]["message"].as_str().unwrap_or_default();
    assert_eq!(status, 400, "{e}");
    assert!(msg.contains("`prompt[1]`: token id 49152 is outside the vocabulary (49152 tokens)"), "{e}");
    let events =
        server.events("/v1/completions", &json!({"prompt": prompt, "max_tokens": 24, "stream": true}));
    let text: String = events.iter().map(|e| e["choices"][0]["text"].as_str().unwrap()).collect();
    assert_eq!(text, g["text"].as_str().unwrap());
    let sampled =
        json!({"prompt": prompt, "max_tokens": 24, "temperature": 1.0, "seed": 7, "ignore_eos": true});
    let (a, b) = (server.post("/v1/completions", &sampled).1, server.post("/v1/completions", &sampled).1);
    assert_eq!(a["choices"][0]["text"], b["choices"][0]["text"]);
    assert_ne!(a["choices"][0]["text"], v["choices"][0]["text"], "sampled at temperature 1 as greedy");
    // Two completions of one request: the first samples with the seed, the second with seed + 1,
    // each as a request of its own with that seed.
    let mut seed8 = sampled.clone();
    seed8["seed"] = json!(8);
    let c = server.post("/v1/completions", &seed8).1;
    let mut two = sampled.clone();
    two["n"] = json!(2);
    let (status, both) = server.post("/v1/completions", &two);
    assert_eq!(status, 200, "{both}");
    let texts: Vec<&Value> = (0..2).map(|i| &both["choices"][i]["text"]).collect();
    assert_eq!(texts, [&a["choices"][0]["text"], &c["choices"][0]["text"]]);
    assert_eq!(both["choices"][1]["index"], 1);
    assert_ne!(texts[0], texts[1]);
    assert_eq!(both["usage"]["completion_tokens"], 48);

    // A conversation of several turns: the answer `generate` gives it from a prompts file's
    // `messages`, and from the same request as a line of OpenAI's batch input, with the same
    // prompt tokens.
    let messages = json!([
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy?"},
    ]);
    let request = json!({"messages": messages, "max_tokens": 16});
    let batch =
        json!({"custom_id": "turn-4", "method": "POST", "url": "/v1/chat/completions", "body": request});
    let g = generate_lines_on_two_tp_ranks(&dir, &[request.clone(), batch]);
    let (status, v) = server.post("/v1/chat/completions", &request);
    assert_eq!(status, 200, "{v}");
    for r in g["results"].as_array().unwrap() {
        assert_eq!(v["choices"][0]["message"]["content"], r["text"], "{g}");
        assert_eq!(v["usage"]["prompt_tokens"], r["prompt_tokens"], "{g}");
    }
    assert_eq!((g["results"].as_array().unwrap().len(), &g["results"][1]["id"]), (2, &json!("turn-4")));
}

/// `generate --json` of the prompts file of `lines` on two tensor-parallel ranks of the model
/// `dir`.
fn generate_lines_on_two_tp_ranks(dir: &Path, lines: &[Value]) -> Value {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("prompts.jsonl");
    std::fs::write(&file, lines.iter().map(|l| format!("{l}\n")).collect::<String>()).unwrap();
    let mut cmd = launch_command(&["local", "2"]);
    cmd.args(["generate", "--model", path_str(dir), "--threads", "1", "--tp", "2", "--json"]);
    cmd.args(["--prompts-file", path_str(&file)]);
    let out = gridlm_reference::run_with_timeout(cmd, 300);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Log-probabilities as OpenAI gives them, each token's those of `generate --logprobs 3
/// --prompt-logprobs 3` (`g`) for the same prompt: a completion's whole and streamed (the
/// chunks' lists one after another are the whole one's), the same with the prompt echoed (its
/// tokens first, the first without a value), the prompt alone scored (`max_tokens` 0), and a
/// chat answer's, whose tokens' bytes spell its text.
fn logprobs_as_generate(server: &Server, prompt: &str, g: &Value) {
    let ask = json!({"prompt": prompt, "max_tokens": 24, "logprobs": 3});
    let (status, v) = server.post("/v1/completions", &ask);
    assert_eq!(status, 200, "{v}");
    let (lp, want) = (&v["choices"][0]["logprobs"], g["logprobs"].as_array().unwrap());
    assert_eq!(want.len(), g["token_ids"].as_array().unwrap().len());
    let texts: Vec<&Value> = want.iter().map(|t| &t["text"]).collect();
    let values: Vec<&Value> = want.iter().map(|t| &t["logprob"]).collect();
    assert_eq!(lp["tokens"].as_array().unwrap().iter().collect::<Vec<_>>(), texts, "{lp}");
    assert_eq!(lp["token_logprobs"].as_array().unwrap().iter().collect::<Vec<_>>(), values, "{lp}");
    let mut offset = 0;
    for (i, w) in want.iter().enumerate() {
        let top = lp["top_logprobs"][i].as_object().unwrap();
        for alt in w["top"].as_array().unwrap() {
            let text = alt["text"].as_str().unwrap();
            assert!(top.contains_key(text), "token {i}: {text:?} not in {top:?}");
        }
        assert!(top.contains_key(w["text"].as_str().unwrap()) && top.len() <= 4, "token {i}: {top:?}");
        assert_eq!(lp["text_offset"][i], offset);
        offset += w["text"].as_str().unwrap().len();
    }
    // A streamed answer's chunks' lists, one after another, are the whole answer's.
    let same_streamed = |ask: &Value, whole: &Value| {
        let mut streamed = ask.clone();
        streamed["stream"] = json!(true);
        let events = server.events("/v1/completions", &streamed);
        for key in ["tokens", "token_logprobs", "text_offset"] {
            let joined =
                events.iter().flat_map(|e| e["choices"][0]["logprobs"][key].as_array().unwrap().clone());
            assert_eq!(&Value::Array(joined.collect()), &whole[key], "streamed {key} of {ask}");
        }
    };
    same_streamed(&ask, lp);
    // Echoed: the prompt's tokens and their log-probabilities first.
    let scored = g["prompt_logprobs"].as_array().unwrap();
    assert!(scored.len() > 4 && scored[0].is_null(), "{g}");
    let prompt_values: Vec<Value> =
        scored.iter().map(|e| if e.is_null() { Value::Null } else { e["logprob"].clone() }).collect();
    let tok = Tokenizer::from_dir(&smollm2("bf16")).unwrap();
    let text = |t: &Value| tok.bytes_text(&[t.as_u64().unwrap() as u32]);
    let prompt_texts: Vec<Value> =
        g["prompt_token_ids"].as_array().unwrap().iter().map(|t| json!(text(t))).collect();
    let mut echo = ask.clone();
    echo["echo"] = json!(true);
    let (status, e) = server.post("/v1/completions", &echo);
    assert_eq!(status, 200, "{e}");
    let elp = &e["choices"][0]["logprobs"];
    assert_eq!(
        e["choices"][0]["text"],
        json!(format!("{prompt}{}", v["choices"][0]["text"].as_str().unwrap()))
    );
    let cat = |a: &[Value], b: &Value| Value::Array(a.iter().chain(b.as_array().unwrap()).cloned().collect());
    assert_eq!(elp["token_logprobs"], cat(&prompt_values, &lp["token_logprobs"]), "echoed");
    assert_eq!(elp["tokens"], cat(&prompt_texts, &lp["tokens"]), "echoed");
    assert!(
        elp["top_logprobs"][0].is_null() && elp["top_logprobs"][1].as_object().unwrap().len() <= 4,
        "{elp}"
    );
    same_streamed(&echo, elp);
    echo["max_tokens"] = json!(0);
    let (status, e) = server.post("/v1/completions", &echo);
    assert_eq!(
        (status, &e["choices"][0]["text"], &e["usage"]["completion_tokens"]),
        (200, &json!(prompt), &json!(0))
    );
    assert_eq!(e["choices"][0]["logprobs"]["token_logprobs"], Value::Array(prompt_values), "scored alone");
    let chat = json!({"messages": [{"role": "user", "content": prompt}], "max_tokens": 12, "logprobs": true, "top_logprobs": 2});
    let (status, v) = server.post("/v1/chat/completions", &chat);
    assert_eq!(status, 200, "{v}");
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len() as u64, v["usage"]["completion_tokens"].as_u64().unwrap());
    let mut bytes = Vec::new();
    for c in content {
        let top = c["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 2, "{c}");
        assert_eq!(
            (&top[0]["token"], &top[0]["logprob"]),
            (&c["token"], &c["logprob"]),
            "greedy: the most likely"
        );
        assert!(top[1]["logprob"].as_f64() <= top[0]["logprob"].as_f64(), "{c}");
        bytes.extend(c["bytes"].as_array().unwrap().iter().map(|b| b.as_u64().unwrap() as u8));
    }
    let text = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(String::from_utf8(bytes).unwrap().starts_with(text), "{v}");
}

/// With `--api-key`, a request without the key (or with another) gets 401, but for /health;
/// with `--max-in-flight 1`, a request while a long stream runs gets 429; once the stream's
/// client has gone away (which stops it), requests one after another are answered, each at
/// once (the count drops before the answer is written); a request thread that fails ends
/// alone.
#[test]
fn serve_checks_the_api_key_and_turns_away_requests_beyond_the_most_in_flight() {
    let dir = smollm2("bf16");
    let env = [("GRIDLM_TEST_SERVE_PANIC", "/v1/fail")];
    let args = [
        ["--api-key", "secret"],
        ["--max-in-flight", "1"],
        ["--allow-origin", "http://LocalHost:3000"],
        ["--name", "org/Small LM"],
    ]
    .concat();
    let mut server = Server::start_with(1, &dir, &args, &env);
    let ask = json!({"prompt": "The capital of France is", "max_tokens": 3});
    for key in [None, Some("wrong")] {
        server.key = key.map(String::from);
        let (status, v) = server.post("/v1/completions", &ask);
        assert_eq!(status, 401, "{key:?}: {v}");
        assert!(v["error"]["message"].as_str().unwrap().contains("API key"), "{v}");
        assert_eq!(server.http("GET", "/v1/models", "").0, 401);
        assert_eq!(server.http("GET", "/health", "").0, 200);
    }
    server.key = Some("secret".into());
    // Tokens of the answers, for the metrics.
    let mut tokens = 0;
    let mut answered = |(status, v): (u16, Value)| {
        tokens += v["usage"]["completion_tokens"].as_u64().unwrap_or(0);
        status
    };
    assert_eq!(answered(server.post("/v1/completions", &ask)), 200);
    // Thousands of tokens: the stream runs on while the next request comes.
    let stream = server.long_stream();
    let (status, v) = server.post("/v1/completions", &ask);
    assert_eq!(status, 429, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("--max-in-flight"), "{v}");
    drop(stream);
    // The stream stops at its next token or two; until then, 429.
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    let mut refused = 1;
    while answered(server.post("/v1/completions", &ask)) == 429 {
        assert!(std::time::Instant::now() < deadline, "the stream never stopped:\n{}", server.log_text());
        std::thread::sleep(Duration::from_millis(20));
        refused += 1;
    }
    // The same unstreamed: nothing is written before its end, yet its client gone, it stops
    // (it ran to its end, thousands of tokens, when the HTTP library hid the hang-up).
    let whole = json!({"prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": true});
    let gone = server.send("POST", "/v1/completions", &whole.to_string());
    // Asked before it is counted in flight, a request would take its place and turn it away.
    server.wait_in_flight(1);
    assert_eq!(answered(server.post("/v1/completions", &ask)), 429);
    refused += 1;
    drop(gone);
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    while answered(server.post("/v1/completions", &ask)) == 429 {
        assert!(std::time::Instant::now() < deadline, "the request never stopped:\n{}", server.log_text());
        std::thread::sleep(Duration::from_millis(20));
        refused += 1;
    }
    for _ in 0..20 {
        assert_eq!(answered(server.post("/v1/completions", &ask)), 200, "one request after another");
    }
    // A request thread that fails gets its request a 500 and one error line; the server answers
    // on.
    assert_eq!(server.http("GET", "/v1/fail", "").0, 500);
    assert_eq!(answered(server.post("/v1/completions", &ask)), 200, "after a failed request thread");
    let log = server.log_text();
    assert!(log.contains("internal error") && log.contains("GRIDLM_TEST_SERVE_PANIC"), "{log}");
    // What /metrics counted: every status, the tokens of the answers, a first token of each. A
    // request thread counts its request once its answer is written, so the client may ask before
    // the last one has: wait for the answers' durations (counted after the rest).
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let durations = "gridlm_request_duration_seconds_count 26";
    let metrics = loop {
        let (status, metrics) = server.http("GET", "/metrics", "");
        assert_eq!(status, 200, "{metrics}");
        let settled = metrics.lines().any(|l| l == durations);
        if settled || std::time::Instant::now() > deadline {
            break metrics;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let value = |name: &str| -> u64 {
        let line = metrics.lines().find(|l| l.split(' ').next() == Some(name));
        line.and_then(|l| l.rsplit(' ').next()?.parse().ok())
            .unwrap_or_else(|| panic!("no {name}:\n{metrics}"))
    };
    // Answered: the first, the stream (its client gone), the one after each loop, twenty and
    // the one after the failed thread; the unstreamed one's client gone, 499.
    assert_eq!(value("gridlm_requests_total{status=\"200\"}"), 25, "{metrics}");
    assert_eq!(value("gridlm_requests_total{status=\"499\"}"), 1, "{metrics}");
    assert_eq!(value("gridlm_requests_total{status=\"401\"}"), 4, "{metrics}");
    assert_eq!(value("gridlm_requests_total{status=\"429\"}"), refused, "{metrics}");
    assert_eq!(value("gridlm_requests_in_flight"), 0, "{metrics}");
    assert_eq!(value("gridlm_generation_tokens_total"), tokens, "{metrics}");
    assert_eq!(value("gridlm_time_to_first_token_seconds_count"), 24, "{metrics}");
    assert_eq!(value("gridlm_request_duration_seconds_count"), 26, "{metrics}");
    let log = server.log_text();
    assert!(log.contains("200: 4 prompt tokens, the client went away, streamed"), "{log}");
    assert!(log.contains("499: 4 prompt tokens, the client went away, "), "{log}");

    // A browser's page at the origin --allow-origin names: its preflight, sent without the key,
    // gets the methods and the headers it asked for; its requests' answers (refusals too) let
    // it read them. A page elsewhere is refused its preflight and gets no such header.
    let page = "Origin: http://localhost:3000";
    let preflight = "OPTIONS /v1/chat/completions HTTP/1.1\r\nAccess-Control-Request-Method: POST\r\n\
                     Access-Control-Request-Headers: authorization, content-type";
    let got = server.raw(&format!("{preflight}\r\n{page}"), "");
    assert!(got.starts_with("HTTP/1.1 200 "), "{got}");
    for header in [
        "Access-Control-Allow-Origin: http://localhost:3000",
        "Access-Control-Allow-Methods: POST, OPTIONS",
        "Access-Control-Allow-Headers: authorization, content-type",
        "Vary: Origin",
    ] {
        assert!(got.contains(&format!("\r\n{header}\r\n")), "{header}: {got}");
    }
    let chat = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}).to_string();
    let post = "POST /v1/chat/completions HTTP/1.1\r\nContent-Type: application/json";
    for (key, status) in [("secret", 200), ("wrong", 401)] {
        let got = server.raw(&format!("{post}\r\n{page}\r\nAuthorization: Bearer {key}"), &chat);
        assert!(got.starts_with(&format!("HTTP/1.1 {status} ")), "{got}");
        assert!(got.contains("\r\nAccess-Control-Allow-Origin: http://localhost:3000\r\n"), "{got}");
    }
    let elsewhere = "Origin: http://localhost:3001";
    let got = server.raw(&format!("{preflight}\r\n{elsewhere}"), "");
    assert!(got.starts_with("HTTP/1.1 403 "), "{got}");
    assert!(
        got.contains("--allow-origin http://localhost:3001 lets it") && !got.contains("Allow-Origin"),
        "{got}"
    );
    let got = server.raw(&format!("{post}\r\n{elsewhere}\r\nAuthorization: Bearer secret"), &chat);
    assert!(got.starts_with("HTTP/1.1 200 ") && !got.contains("Allow-Origin"), "{got}");
    // OPTIONS outside a preflight, and a method an endpoint does not take, name the methods.
    let got = server.raw("OPTIONS /v1/models HTTP/1.1", "");
    assert!(got.starts_with("HTTP/1.1 200 ") && got.contains("\r\nAllow: GET, HEAD, OPTIONS\r\n"), "{got}");
    let got = server.raw("DELETE /v1/completions HTTP/1.1\r\nAuthorization: Bearer secret", "");
    assert!(got.starts_with("HTTP/1.1 405 ") && got.contains("\r\nAllow: POST, OPTIONS\r\n"), "{got}");
    // A model's name as clients write it into a URL, escaped (OpenAI's `models.retrieve`) or not.
    for path in ["/v1/models/org%2FSmall%20LM", "/v1/models/org/Small%20LM"] {
        let (status, v) = server.http("GET", path, "");
        assert!(status == 200 && v.contains(r#""id":"org/Small LM""#), "{path}: {v}");
    }
    // HEAD is answered as GET, without the body.
    let got = server.raw("HEAD /health HTTP/1.1", "");
    assert!(got.starts_with("HTTP/1.1 200 ") && got.ends_with("Content-Length: 15\r\n\r\n"), "{got}");
}

/// SIGUSR1 to the launcher (mpirun passes it on to every rank) drains the server: a stream in
/// flight runs to its last token and `[DONE]`, no new connection is taken, and the job ends
/// with status 0; an idle server ends at once.
#[test]
fn serve_drains_on_sigusr1() {
    let dir = smollm2("bf16");
    let mut server = Server::start(2, &dir, &["--tp", "2"]);
    let ask = json!({"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": true, "stream": true});
    std::thread::scope(|s| {
        let stream = s.spawn(|| server.events("/v1/completions", &ask));
        // Once the request runs (the count of requests in flight says so), the signal.
        server.wait_in_flight(1);
        unsafe { libc::kill(server.child.id() as i32, libc::SIGUSR1) };
        let events = stream.join().unwrap();
        let last = &events[events.len() - 1]["choices"][0];
        assert_eq!(last["finish_reason"], "length", "{events:?}");
        let text: String = events.iter().map(|e| e["choices"][0]["text"].as_str().unwrap()).collect();
        assert!(text.len() > 200, "{text:?}");
    });
    let status = wait_for(&mut server.child, Duration::from_secs(60));
    assert!(status.success(), "{status:?}: {}", server.log_text());
    assert!(std::net::TcpStream::connect(("127.0.0.1", server.port)).is_err(), "still listening");
    let log = server.log_text();
    assert!(log.contains("serve: draining (SIGUSR1): no new requests; answering the 1 in flight"), "{log}");
    assert!(log.contains("200 new tokens (length, streamed)"), "{log}");
    let mut idle = Server::start(2, &dir, &["--tp", "2"]);
    unsafe { libc::kill(idle.child.id() as i32, libc::SIGUSR1) };
    let status = wait_for(&mut idle.child, Duration::from_secs(30));
    assert!(status.success(), "{status:?}: {}", idle.log_text());
}

/// A conversation's next turn reads its earlier turns from the prefix cache: on two pipeline
/// stages, the second turn (the first turn's prompt, the answer the server gave, a new
/// question) reads from the cache more whole pages than the first turn's prompt fills (so the
/// pages of the tokens the server generated too), `usage.prompt_tokens_details.cached_tokens`
/// and `/metrics` say how many, and the answer, whole and streamed, is the one a server with
/// `--no-prefix-cache` gives (which reads none). The first server also drafts
/// (`--speculate 4`), and `/metrics` counts its drafts, some kept.
#[test]
fn serve_reads_a_conversations_earlier_turns_from_the_prefix_cache() {
    let dir = smollm2("bf16");
    let cached = Server::start(2, &dir, &["--pp", "2", "--speculate", "4"]);
    let whole = Server::start(2, &dir, &["--pp", "2", "--no-prefix-cache"]);
    let mut messages = vec![
        json!({"role": "system", "content": "You are a patient teacher who explains physics to curious students."}),
        json!({"role": "user", "content": "Why is the sky blue?"}),
    ];
    let ask = |m: &Vec<Value>| json!({"messages": m, "max_tokens": 40});
    let (status, first) = cached.post("/v1/chat/completions", &ask(&messages));
    assert_eq!(status, 200, "{first}");
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0, "{first}");
    let first_prompt = first["usage"]["prompt_tokens"].as_u64().unwrap();
    messages.push(json!({"role": "assistant", "content": text_of(&first).0}));
    messages.push(json!({"role": "user", "content": "And why are sunsets red?"}));
    let (_, second) = cached.post("/v1/chat/completions", &ask(&messages));
    let hit = second["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    let page = gridlm::model::PAGE as u64;
    assert!(hit > first_prompt / page * page && hit % page == 0, "{hit} of {}", second["usage"]);
    assert!(hit < second["usage"]["prompt_tokens"].as_u64().unwrap());
    let (_, again) = whole.post("/v1/chat/completions", &ask(&messages));
    assert_eq!(text_of(&second), text_of(&again));
    assert_eq!(again["usage"]["prompt_tokens_details"]["cached_tokens"], 0, "{again}");
    // Streamed, the same turn reads its last pages too (the second turn's own).
    let mut streamed = ask(&messages);
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let events = cached.events("/v1/chat/completions", &streamed);
    let text: String = events.iter().filter_map(|e| e["choices"][0]["delta"]["content"].as_str()).collect();
    assert_eq!(text, text_of(&second).0);
    let usage = &events[events.len() - 1]["usage"];
    let hit_again = usage["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    assert!(hit_again >= hit, "{usage}");
    // A request is counted after its answer is written: wait for the last one.
    let line = format!("gridlm_prompt_tokens_cached_total {}", hit + hit_again);
    let t0 = Instant::now();
    let metrics = loop {
        let metrics = cached.http("GET", "/metrics", "").1;
        if metrics.lines().any(|l| l == line) {
            break metrics;
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "{line} in:\n{metrics}");
        std::thread::sleep(Duration::from_millis(20));
    };
    let count = |name: &str| {
        let line = metrics.lines().find_map(|l| l.strip_prefix(&format!("{name} ")));
        line.and_then(|v| v.parse::<u64>().ok()).unwrap_or_else(|| panic!("{name} in:\n{metrics}"))
    };
    let (made, kept) = (count("gridlm_draft_tokens_total"), count("gridlm_draft_tokens_accepted_total"));
    assert!(kept > 0 && made >= kept, "{kept} of {made} drafts kept");
}

/// `child`'s exit status, waited for at most `most`.
fn wait_for(child: &mut std::process::Child, most: Duration) -> std::process::ExitStatus {
    let t0 = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        assert!(t0.elapsed() < most, "the server did not end within {most:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A port already taken, a key with spaces around it, no request in flight: one error line
/// naming the option, exit 1.
#[test]
fn serve_reports_an_address_it_cannot_listen_on() {
    let (_tmp, dir) = tiny_llama();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let out = gridlm(&["serve", "--model", path_str(&dir), "--listen", &addr]);
    assert_one_line_error(&out, &["--listen", &addr, "cannot listen there"]);
    let out = gridlm(&["serve", "--model", path_str(&dir), "--api-key", " x"]);
    assert_one_line_error(&out, &["--api-key", "without spaces"]);
    let out = gridlm(&["serve", "--model", path_str(&dir), "--max-in-flight", "0"]);
    assert_one_line_error(&out, &["--max-in-flight must be at least 1"]);
}

/// A request whose client goes away while it waits for a slot ends without running: with one
/// slot taken by a stream, a request queued behind it is dropped by its client; once the stream
/// ends too, the same prompt asked again finds none of its pages in the prefix cache (had the
/// queued request run its prompt when the slot came free, they would be there).
#[test]
fn a_request_whose_client_left_while_it_waited_never_runs() {
    let dir = smollm2("bf16");
    let server = Server::start(1, &dir, &["--max-batch", "1"]);
    let stream = server.long_stream();
    let prompt = "The history of the river valley is a long one: ".repeat(8);
    let queued =
        server.send("POST", "/v1/completions", &json!({"prompt": prompt, "max_tokens": 1}).to_string());
    server.wait_in_flight(2);
    drop(queued);
    server.wait_in_flight(1);
    drop(stream);
    server.wait_in_flight(0);
    let (status, v) = server.post("/v1/completions", &json!({"prompt": prompt, "max_tokens": 1}));
    assert_eq!(status, 200, "{v}");
    assert!(v["usage"]["prompt_tokens"].as_u64().unwrap() > 2 * gridlm::model::PAGE as u64, "{v}");
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 0, "{v}\n{}", server.log_text());
    let log = server.log_text();
    assert!(log.contains(" 499: ") && log.contains("the client went away, streamed"), "{log}");
}

/// Token rules (`logit_bias`, `min_tokens`, `stop_token_ids`) and `skip_special_tokens` in chat
/// requests, whole and streamed, on two tensor-parallel ranks: the answers and finish reasons
/// `generate` gives the same requests as prompts-file lines; rules that do not fit the vocabulary
/// or `max_tokens` are refused by name.
#[test]
fn serve_takes_token_rules_as_generate() {
    let dir = smollm2("bf16");
    let chat = json!([{"role": "user", "content": "Say hello."}]);
    let requests = [
        json!({"messages": chat, "max_tokens": 12, "logit_bias": {"19556": -100, "1535": 4.5}}),
        json!({"messages": chat, "max_tokens": 34, "min_tokens": 30}),
        json!({"messages": chat, "max_tokens": 48, "stop_token_ids": [282]}),
        json!({"messages": chat, "max_tokens": 48, "stop": ["!", "?"], "include_stop_str_in_output": true}),
        // A special token (SmolLM2's 3, `<repo_name>`, held to by a grammar) left out of the
        // text, and kept (vLLM's `skip_special_tokens`).
        json!({"messages": chat, "max_tokens": 9, "structured_outputs": {"grammar": "start: \"Hi\" <[3]> \" there\""}}),
        json!({"messages": chat, "max_tokens": 9, "structured_outputs": {"grammar": "start: \"Hi\" <[3]> \" there\""},
            "skip_special_tokens": false}),
    ];
    let g = generate_lines_on_two_tp_ranks(&dir, &requests);
    let texts: Vec<&Value> = g["results"].as_array().unwrap()[4..].iter().map(|r| &r["text"]).collect();
    assert_eq!(texts, [&json!("Hi there"), &json!("Hi<repo_name> there")]);
    let server = Server::start(2, &dir, &["--tp", "2"]);
    for (request, r) in requests.iter().zip(g["results"].as_array().unwrap()) {
        let (status, v) = server.post("/v1/chat/completions", request);
        assert_eq!(status, 200, "{v}");
        let finish = if r["finish_reason"] == "length" { "length" } else { "stop" };
        let choice = &v["choices"][0];
        assert_eq!(
            (&choice["message"]["content"], &choice["finish_reason"]),
            (&r["text"], &json!(finish)),
            "{r}"
        );
        assert_eq!(v["usage"]["completion_tokens"], r["token_ids"].as_array().unwrap().len(), "{r}");
        assert_eq!(choice["stop_reason"], r["stop_reason"], "{r}");
        let mut streamed = request.clone();
        streamed["stream"] = json!(true);
        let events = server.events("/v1/chat/completions", &streamed);
        let text: String =
            events.iter().filter_map(|e| e["choices"][0]["delta"]["content"].as_str()).collect();
        let last = events.iter().rev().find(|e| !e["choices"][0]["finish_reason"].is_null());
        let last = last.map(|e| (&e["choices"][0]["finish_reason"], &e["choices"][0]["stop_reason"]));
        assert_eq!(
            (text.as_str(), last),
            (r["text"].as_str().unwrap(), Some((&json!(finish), &r["stop_reason"]))),
            "{r}"
        );
    }
    assert_eq!(
        (&g["results"][2]["finish_reason"], &g["results"][2]["stop_reason"]),
        (&json!("stop"), &json!(282)),
        "{g}"
    );
    let kept = g["results"][3]["text"].as_str().unwrap();
    assert!(kept.ends_with(['!', '?']) && g["results"][3]["stop_reason"] == kept[kept.len() - 1..], "{g}");
    assert_eq!(g["results"][1]["token_ids"].as_array().unwrap().len(), 34, "{g}");
    for (rules, msg) in [
        (
            json!({"stop_token_ids": [49152]}),
            "`stop_token_ids` holds token 49152, outside the vocabulary of 49152 tokens",
        ),
        (
            json!({"logit_bias": {"60000": 1}}),
            "`logit_bias` holds token 60000, outside the vocabulary of 49152 tokens",
        ),
        (json!({"min_tokens": 9, "max_tokens": 8}), "`min_tokens` (9) must be at most max_tokens (8)"),
        (
            json!({"logit_bias": {"5": -101}}),
            "`logit_bias`: the bias of token 5 must be in [-100, 100], got -101",
        ),
        (json!({"logit_bias": {"five": 1}}), "`logit_bias`: the key \"five\" is not a token id"),
    ] {
        let mut request = json!({"messages": chat});
        request.as_object_mut().unwrap().extend(rules.as_object().unwrap().clone());
        let (status, e) = server.post("/v1/chat/completions", &request);
        assert_eq!((status, e["error"]["message"].as_str()), (400, Some(msg)), "{rules}");
    }
}

/// Structured output in chat requests on two tensor-parallel ranks: the answer held to a JSON
/// schema, whole and streamed, is the one `generate` gives the same request, JSON the schema
/// takes, and so is each of several sampled answers to one request; a format that is not one, or a schema the grammar engine cannot compile, is refused
/// by name before the request runs.
#[test]
fn serve_holds_answers_to_a_response_format_as_generate() {
    let dir = smollm2("bf16");
    let chat = json!([{"role": "user", "content": "Describe a cat as JSON with its name, age and color."}]);
    let format =
        json!({"type": "json_schema", "json_schema": {"name": "cat", "schema": super::batch::cat_schema()}});
    let request = json!({"messages": chat, "max_tokens": 60, "response_format": format});
    let g = generate_lines_on_two_tp_ranks(&dir, std::slice::from_ref(&request));
    let want = &g["results"][0];
    assert!(super::batch::is_a_cat(want["text"].as_str().unwrap()), "{want}");
    let server = Server::start(2, &dir, &["--tp", "2"]);
    let (status, v) = server.post("/v1/chat/completions", &request);
    assert_eq!(status, 200, "{v}");
    let choice = &v["choices"][0];
    assert_eq!(
        (&choice["message"]["content"], &choice["finish_reason"]),
        (&want["text"], &json!("stop")),
        "{v}"
    );
    let mut streamed = request.clone();
    streamed["stream"] = json!(true);
    let events = server.events("/v1/chat/completions", &streamed);
    let text: String = events.iter().filter_map(|e| e["choices"][0]["delta"]["content"].as_str()).collect();
    assert_eq!(text, want["text"].as_str().unwrap());
    // Several sampled answers to one request: each goes on from its own copy of the format
    // compiled once, and each is a cat.
    let mut several = request.clone();
    several["n"] = json!(3);
    several["temperature"] = json!(1.0);
    several["seed"] = json!(5);
    let (status, v) = server.post("/v1/chat/completions", &several);
    assert_eq!(status, 200, "{v}");
    let cats: Vec<&str> = (0..3).filter_map(|i| v["choices"][i]["message"]["content"].as_str()).collect();
    assert!(cats.len() == 3 && cats.iter().all(|c| super::batch::is_a_cat(c)), "{v}");
    assert!(cats[0] != cats[1] || cats[1] != cats[2], "{v}");
    // vLLM's formats, as its clients send them (`extra_body`).
    let yes_no = json!({"messages": [{"role": "user", "content": "Is the sky green? Answer yes or no."}],
        "structured_outputs": {"choice": ["Yes", "No"]}});
    let (status, v) = server.post("/v1/chat/completions", &yes_no);
    let answer = v["choices"][0]["message"]["content"].as_str().unwrap_or_default();
    assert!(status == 200 && ["Yes", "No"].contains(&answer), "{v}");
    let digits = json!({"prompt": "The year the Moon was first walked on:", "guided_regex": " [0-9]{4}"});
    let (status, v) = server.post("/v1/completions", &digits);
    let answer = v["choices"][0]["text"].as_str().unwrap_or_default();
    assert!(status == 200 && answer.len() == 5 && answer[1..].bytes().all(|b| b.is_ascii_digit()), "{v}");
    for (format, msg) in [
        (json!({"type": "yaml"}), "`response_format`: `type` is \"yaml\": text, json_object or json_schema"),
        (
            json!({"type": "json_schema", "json_schema": {"name": "x"}}),
            "`json_schema.schema` must be a JSON schema",
        ),
        (
            json!({"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}}),
            "the answer's format: ",
        ),
    ] {
        let (status, e) =
            server.post("/v1/chat/completions", &json!({"messages": chat, "response_format": format}));
        let got = e["error"]["message"].as_str().unwrap_or_default();
        assert!(status == 400 && got.contains(msg), "{format}: {status} {e}");
    }
}

/// OpenAI's Responses API (`/v1/responses`): `instructions` and `input` get the chat answer of
/// the same system and user messages, as a response object with its usage, whole and as the
/// stream of typed events (created … deltas … completed, numbered in order); one cut short by
/// `max_output_tokens` is incomplete; `text.format` holds it to a schema; what a response would
/// need kept, or gridlm does not give, is refused by name.
#[test]
fn serve_answers_the_responses_api_as_chat() {
    let dir = smollm2("bf16");
    let server = Server::start(1, &dir, &[]);
    let messages = json!([
        {"role": "system", "content": "Answer in one sentence."},
        {"role": "user", "content": "What is the capital of France?"},
    ]);
    let (status, chat) =
        server.post("/v1/chat/completions", &json!({"messages": messages, "max_tokens": 40}));
    assert_eq!(status, 200, "{chat}");
    let want = chat["choices"][0]["message"]["content"].as_str().unwrap();
    let request = json!({"instructions": "Answer in one sentence.", "input": "What is the capital of France?",
        "max_output_tokens": 40, "store": false, "metadata": {"who": "test"}});
    let (status, r) = server.post("/v1/responses", &request);
    assert_eq!(status, 200, "{r}");
    assert_eq!((&r["object"], &r["status"]), (&json!("response"), &json!("completed")), "{r}");
    assert_eq!(r["output"][0]["content"][0]["text"], want, "{r}");
    assert_eq!(r["usage"]["input_tokens"], chat["usage"]["prompt_tokens"], "{r}");
    assert_eq!(r["usage"]["output_tokens"], chat["usage"]["completion_tokens"], "{r}");
    // The same as a list of messages (a developer message is a system one).
    let listed = json!({"input": [{"role": "developer", "content": "Answer in one sentence."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "What is the capital of France?"}]}],
        "max_output_tokens": 40});
    assert_eq!(server.post("/v1/responses", &listed).1["output"][0]["content"][0]["text"], want);
    // Streamed: typed events in order, their deltas the answer.
    let mut streamed = request.clone();
    streamed["stream"] = json!(true);
    let events = server.typed_events("/v1/responses", &streamed);
    let kinds: Vec<&str> = events.iter().map(|e| e.0.as_str()).collect();
    let order = [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ];
    assert_eq!(kinds[..4], order, "{kinds:?}");
    let end = [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ];
    assert_eq!(kinds[kinds.len() - 4..], end, "{kinds:?}");
    let deltas: String = events.iter().filter_map(|e| e.1["delta"].as_str()).collect();
    assert_eq!(deltas, want);
    assert_eq!(events.last().unwrap().1["response"]["output"][0]["content"][0]["text"], want);
    // Cut short.
    let (_, cut) =
        server.post("/v1/responses", &json!({"input": "Tell me a story.", "max_output_tokens": 5}));
    assert_eq!(
        (&cut["status"], &cut["incomplete_details"]["reason"]),
        (&json!("incomplete"), &json!("max_output_tokens")),
        "{cut}"
    );
    assert_eq!(cut["usage"]["output_tokens"], 5, "{cut}");
    // Held to a schema.
    let cat = json!({"input": "Describe a cat as JSON with its name, age and color.", "max_output_tokens": 60,
        "text": {"format": {"type": "json_schema", "name": "cat", "schema": super::batch::cat_schema(), "strict": true}}});
    let (status, r) = server.post("/v1/responses", &cat);
    assert!(
        status == 200 && super::batch::is_a_cat(r["output"][0]["content"][0]["text"].as_str().unwrap()),
        "{r}"
    );
    for (more, msg) in [
        (
            json!({"previous_response_id": "resp_1"}),
            "`previous_response_id` \"resp_1\": gridlm keeps no responses",
        ),
        (
            json!({"reasoning": {"effort": "high"}}),
            "`reasoning`: OpenAI's setting, which gridlm does not support",
        ),
        (json!({"messages": []}), "`messages` is no key of /v1/responses"),
        (json!({"input": [{"type": "reasoning", "summary": []}]}), "`input[0]`: an item of type reasoning"),
    ] {
        let mut request = json!({"input": "x"});
        request.as_object_mut().unwrap().extend(more.as_object().unwrap().clone());
        let (status, e) = server.post("/v1/responses", &request);
        let got = e["error"]["message"].as_str().unwrap_or_default();
        assert!(status == 400 && got.starts_with(msg), "{more}: {status} {e}");
    }
}

/// A streamed chat answer gathered: its text, and its tool calls (name, arguments, id) with
/// their arguments' pieces joined, and how it ended.
fn gathered(events: &[Value]) -> (String, Vec<(String, String, String)>, String) {
    let (mut text, mut calls, mut finish) =
        (String::new(), Vec::<(String, String, String)>::new(), String::new());
    for e in events {
        let c = &e["choices"][0];
        text.push_str(c["delta"]["content"].as_str().unwrap_or_default());
        for call in c["delta"]["tool_calls"].as_array().into_iter().flatten() {
            let i = call["index"].as_u64().unwrap() as usize;
            let args = call["function"]["arguments"].as_str().unwrap_or_default();
            if let Some(name) = call["function"]["name"].as_str() {
                assert_eq!(i, calls.len(), "{e}");
                calls.push((name.to_string(), args.to_string(), call["id"].as_str().unwrap().to_string()));
            } else {
                calls[i].1.push_str(args);
            }
        }
        if let Some(f) = c["finish_reason"].as_str() {
            finish = f.to_string();
        }
    }
    (text, calls, finish)
}

/// `/v1/embeddings`: each input's embedding is the engine's own (the same prompt pooled the
/// same way, alone on one rank, scaled to length 1), on two tensor-parallel ranks (pooled from
/// the last position, the default) and on two stages (the mean, as the model folder's
/// sentence-transformers modules say), while a completion runs beside them; token ids give the
/// texts' embeddings, base64 the same values; bad requests are refused by name.
#[test]
fn serve_embeds_inputs_as_the_engine_pools_them() {
    use gridlm::engine::{normalized, Pooling, Request, RunOptions};
    let dir = smollm2("bf16");
    let tok = Tokenizer::from_dir(&dir).unwrap();
    let texts = ["The cat sat on the mat.", "Stock prices fell sharply today, as traders sold their shares."];
    let mut engine = local_engine(&dir, None);
    let mut alone = |how: Pooling| -> Vec<Vec<f32>> {
        let requests: Vec<Request> = texts
            .iter()
            .map(|t| Request { prompt: tok.encode(t, true).unwrap(), embed: Some(how), ..Request::default() })
            .collect();
        let done = engine.run(&requests, &RunOptions::default(), &Single, &Single, |_, _| Ok(true)).unwrap();
        done.iter().map(|c| normalized(c.embedding.as_ref().unwrap())).collect()
    };
    let (last, mean) = (alone(Pooling::Last), alone(Pooling::Mean));
    let near = |got: &Value, want: &[f32]| {
        let got: Vec<f32> = got.as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect();
        assert_eq!(got.len(), want.len());
        let d = got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
        assert!(d < 2e-3, "embedding differs from the engine's by {d}");
    };
    let folder = linked_copy(&dir, &[]);
    let modules = json!([{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]);
    std::fs::write(folder.path().join("modules.json"), modules.to_string()).unwrap();
    std::fs::create_dir(folder.path().join("1_Pooling")).unwrap();
    let pooling = json!({"word_embedding_dimension": 576, "pooling_mode_mean_tokens": true, "pooling_mode_lasttoken": false});
    std::fs::write(folder.path().join("1_Pooling/config.json"), pooling.to_string()).unwrap();
    for (grid, model, want) in [("--tp", dir.as_path(), &last), ("--pp", folder.path(), &mean)] {
        let server = Server::start(2, model, &[grid, "2"]);
        let long = json!({"prompt": "Once upon a time", "max_tokens": 64, "ignore_eos": true});
        let completion = std::thread::scope(|s| {
            let running = s.spawn(|| server.post("/v1/completions", &long));
            let (status, v) = server.post("/v1/embeddings", &json!({"model": "m", "input": texts}));
            assert_eq!(status, 200, "{v}");
            assert_eq!((&v["object"], v["data"].as_array().map(Vec::len)), (&json!("list"), Some(2)), "{v}");
            for (i, d) in v["data"].as_array().unwrap().iter().enumerate() {
                assert_eq!((&d["object"], &d["index"]), (&json!("embedding"), &json!(i)));
                near(&d["embedding"], &want[i]);
            }
            let tokens: usize = texts.iter().map(|t| tok.encode(t, true).unwrap().len()).sum();
            assert_eq!(v["usage"], json!({"prompt_tokens": tokens, "total_tokens": tokens}));
            running.join().unwrap()
        });
        assert_eq!(completion.1["usage"]["completion_tokens"], 64, "{}", completion.1);
        // Token ids, and base64.
        let ids = tok.encode(texts[1], true).unwrap();
        let (_, v) = server.post("/v1/embeddings", &json!({"input": [ids], "encoding_format": "base64"}));
        use base64::Engine as _;
        let b = base64::engine::general_purpose::STANDARD
            .decode(v["data"][0]["embedding"].as_str().unwrap())
            .unwrap();
        let floats: Vec<Value> =
            b.chunks_exact(4).map(|c| json!(f32::from_le_bytes(c.try_into().unwrap()))).collect();
        near(&Value::Array(floats), &want[1]);
        let (_, raw) = server.post("/v1/embeddings", &json!({"input": texts[0], "normalize": false}));
        let raw = raw["data"][0]["embedding"].as_array().unwrap();
        let length = raw.iter().map(|v| v.as_f64().unwrap().powi(2)).sum::<f64>().sqrt();
        assert!(length > 2.0, "an embedding as pooled has its own length, got {length}");
        for (body, msg) in [
            (json!({"input": ""}), "`input` is empty"),
            (json!({"input": "a", "dimensions": 8}), "`dimensions` 8"),
            (json!({"input": [[1], [70000]]}), "`input[1]`: token id 70000 is outside the vocabulary"),
        ] {
            let (status, e) = server.post("/v1/embeddings", &body);
            let got = e["error"]["message"].as_str().unwrap_or_default();
            assert!(status == 400 && got.starts_with(msg), "{body}: {status} {e}");
        }
    }
}

/// Tool calling in chat requests on two tensor-parallel ranks (server started with the hermes
/// parser): `required` and a tool by name give calls whose arguments are JSON the tool's
/// schema takes, whole and streamed alike; `auto` reads a model's `<tool_call>` (written here
/// because a regular expression holds the answer to one) as a call after its text, and gives a
/// model's plain answer as text, the answer the same chat without tools gets (SmolLM2's template
/// does not read them); the next turn, with the assistant's calls and the tool's answer, runs.
/// With the llama3_json parser, an answer that is a JSON call is one. Where the tags are special
/// tokens (which decoded text leaves out), the parsers read them all the same.
#[test]
fn serve_calls_tools_as_asked() {
    let dir = smollm2("bf16");
    let server = Server::start(2, &dir, &["--tp", "2", "--tool-call-parser", "hermes"]);
    let weather = json!({"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}}});
    let time = json!({"type": "function", "function": {"name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}});
    let chat = json!([{"role": "user", "content": "What is the weather in Paris?"}]);
    let ask = |choice: Value| json!({"messages": chat, "tools": [weather, time], "tool_choice": choice, "max_tokens": 60});
    // Arguments the tool's schema takes: an object with its required keys, as JSON text.
    let takes = |name: &str, args: &str| {
        let v: Value = serde_json::from_str(args).unwrap_or_else(|e| panic!("{e}: {args}"));
        match name {
            "get_weather" => {
                v["city"].is_string() && ["celsius", "fahrenheit"].contains(&v["unit"].as_str().unwrap_or(""))
            }
            "get_time" => v["zone"].is_string(),
            _ => false,
        }
    };
    let named = json!({"type": "function", "function": {"name": "get_weather"}});
    let mut chat_calls = Vec::new();
    for (choice, finish) in [(json!("required"), "tool_calls"), (named, "stop")] {
        let (status, v) = server.post("/v1/chat/completions", &ask(choice.clone()));
        assert_eq!(status, 200, "{v}");
        let c = &v["choices"][0];
        assert_eq!((&c["message"]["content"], &c["finish_reason"]), (&Value::Null, &json!(finish)), "{v}");
        let calls = c["message"]["tool_calls"].as_array().unwrap();
        assert!(!calls.is_empty(), "{v}");
        let mut whole = Vec::new();
        for call in calls {
            let (name, args) =
                (call["function"]["name"].as_str().unwrap(), call["function"]["arguments"].as_str().unwrap());
            assert!(takes(name, args) && call["type"] == "function", "{v}");
            assert!(call["id"].as_str().unwrap().starts_with("call_"), "{v}");
            whole.push((name.to_string(), args.to_string()));
        }
        if choice.is_object() {
            assert_eq!(whole.len(), 1, "{v}");
            assert_eq!(whole[0].0, "get_weather");
        }
        let mut streamed = ask(choice.clone());
        streamed["stream"] = json!(true);
        let (text, calls, end) = gathered(&server.events("/v1/chat/completions", &streamed));
        let calls: Vec<(String, String)> = calls.into_iter().map(|(n, a, _)| (n, a)).collect();
        assert_eq!((text.as_str(), &calls, end.as_str()), ("", &whole, finish), "{choice}");
        chat_calls.push(whole);
    }
    // One call at most where calls are not parallel.
    let mut one = ask(json!("required"));
    one["parallel_tool_calls"] = json!(false);
    let (_, v) = server.post("/v1/chat/completions", &one);
    assert_eq!(v["choices"][0]["message"]["tool_calls"].as_array().map(Vec::len), Some(1), "{v}");

    // `auto`: a call the model writes, after its text, whole and streamed.
    let forced = "Sure\\.\n<tool_call>\n\\{\"name\": \"get_weather\", \"arguments\": \\{\"city\": \"[A-Z][a-z]+\", \"unit\": \"celsius\"\\}\\}\n</tool_call>";
    let mut auto = ask(json!("auto"));
    auto["structured_outputs"] = json!({"regex": forced});
    auto["max_tokens"] = json!(120);
    let (status, v) = server.post("/v1/chat/completions", &auto);
    assert_eq!(status, 200, "{v}");
    let c = &v["choices"][0];
    assert_eq!(
        (&c["message"]["content"], &c["finish_reason"]),
        (&json!("Sure.\n"), &json!("tool_calls")),
        "{v}"
    );
    let call = &c["message"]["tool_calls"][0];
    let args = call["function"]["arguments"].as_str().unwrap();
    assert!(call["function"]["name"] == "get_weather" && takes("get_weather", args), "{v}");
    auto["stream"] = json!(true);
    let (text, calls, end) = gathered(&server.events("/v1/chat/completions", &auto));
    assert_eq!((text.as_str(), calls.len(), end.as_str()), ("Sure.\n", 1, "tool_calls"));
    assert_eq!((calls[0].0.as_str(), calls[0].1.as_str()), ("get_weather", args));
    // `auto` where the model answers in text: the answer without tools.
    let (_, plain) = server.post("/v1/chat/completions", &json!({"messages": chat, "max_tokens": 30}));
    let (_, v) =
        server.post("/v1/chat/completions", &json!({"messages": chat, "tools": [weather], "max_tokens": 30}));
    assert_eq!(v["choices"][0]["message"], plain["choices"][0]["message"], "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], plain["choices"][0]["finish_reason"]);

    // The next turn: the assistant's call and the tool's answer.
    let id = call["id"].as_str().unwrap();
    let turn = json!([
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": id, "type": "function",
            "function": {"name": "get_weather", "arguments": args}}]},
        {"role": "tool", "tool_call_id": id, "content": "{\"temperature\": 21, \"sky\": \"clear\"}"},
    ]);
    let (status, v) = server.post(
        "/v1/chat/completions",
        &json!({"messages": turn, "tools": [weather], "tool_choice": "none", "max_tokens": 20}),
    );
    assert!(status == 200 && v["choices"][0]["message"]["content"].is_string(), "{v}");
    let turn_tokens = v["usage"]["prompt_tokens"].clone();
    let (status, t) = server.post("/tokenize", &json!({"messages": turn, "tools": [weather]}));
    assert_eq!((status, &t["count"]), (200, &v["usage"]["prompt_tokens"]), "{t}");
    // Calls a request cannot make are refused by name.
    let mut bad = ask(json!({"type": "function", "function": {"name": "get_news"}}));
    let (status, e) = server.post("/v1/chat/completions", &bad);
    assert_eq!(
        (status, e["error"]["message"].as_str()),
        (400, Some("`tool_choice` names `get_news`, which is not among `tools`"))
    );
    bad["tool_choice"] = json!("required");
    bad["response_format"] = json!({"type": "json_object"});
    let (status, e) = server.post("/v1/chat/completions", &bad);
    assert!(
        status == 400 && e["error"]["message"].as_str().unwrap().contains("takes no other format"),
        "{e}"
    );

    // The Responses API: the same tools in its form give the chat's calls as `function_call`
    // items, whole and streamed; `auto` a message of the text before them.
    let flat = |t: &Value| {
        let mut f = t["function"].clone();
        f["type"] = json!("function");
        f
    };
    let respond = |choice: Value| {
        json!({"input": "What is the weather in Paris?", "tools": [flat(&weather), flat(&time)],
            "tool_choice": choice, "max_output_tokens": 60})
    };
    // An output item as (type, text or name, arguments); a call's ids checked.
    let item = |i: &Value| {
        assert_eq!(i["status"], "completed", "{i}");
        match i["type"].as_str() {
            Some("message") => {
                ("message".to_string(), i["content"][0]["text"].as_str().unwrap().to_string(), String::new())
            }
            _ => {
                let (call_id, id) = (i["call_id"].as_str().unwrap(), i["id"].as_str().unwrap());
                assert!(call_id.starts_with("call_") && id == format!("fc_{}", &call_id[5..]), "{i}");
                let (name, args) = (i["name"].as_str().unwrap(), i["arguments"].as_str().unwrap());
                (i["type"].as_str().unwrap().to_string(), name.to_string(), args.to_string())
            }
        }
    };
    let as_calls = |calls: &[(String, String)]| -> Vec<(String, String, String)> {
        calls.iter().map(|(n, a)| ("function_call".to_string(), n.clone(), a.clone())).collect()
    };
    let named = json!({"type": "function", "name": "get_weather"});
    let sure = vec![("message".to_string(), "Sure.\n".to_string(), String::new())];
    let auto_call = [sure, as_calls(&[("get_weather".into(), args.into())])].concat();
    for (choice, want) in [
        (json!("required"), as_calls(&chat_calls[0])),
        (named.clone(), as_calls(&chat_calls[1])),
        (json!("auto"), auto_call),
    ] {
        let mut request = respond(choice.clone());
        if choice == "auto" {
            request.as_object_mut().unwrap().insert("structured_outputs".into(), json!({"regex": forced}));
            request["max_output_tokens"] = json!(120);
        }
        let (status, r) = server.post("/v1/responses", &request);
        assert_eq!((status, &r["status"], &r["tool_choice"]), (200, &json!("completed"), &choice), "{r}");
        assert_eq!(
            (&r["tools"], &r["parallel_tool_calls"]),
            (&json!([flat(&weather), flat(&time)]), &json!(true))
        );
        let items: Vec<_> = r["output"].as_array().unwrap().iter().map(item).collect();
        assert_eq!(items, want, "{r}");
        // Streamed: each item added, its arguments (or text) as they come, done; the response
        // completed with them.
        request["stream"] = json!(true);
        let events = server.typed_events("/v1/responses", &request);
        let completed = &events.last().unwrap().1["response"];
        let items: Vec<_> = completed["output"].as_array().unwrap().iter().map(item).collect();
        assert_eq!(items, want, "{completed}");
        let mut sent: Vec<String> = Vec::new();
        for (kind, e) in &events[2..events.len() - 1] {
            let at = e["output_index"].as_u64().unwrap() as usize;
            match kind.as_str() {
                "response.output_item.added" => {
                    assert_eq!(at, sent.len(), "{e}");
                    sent.push(String::new());
                }
                "response.function_call_arguments.delta" | "response.output_text.delta" => {
                    sent[at].push_str(e["delta"].as_str().unwrap())
                }
                "response.function_call_arguments.done" => {
                    assert_eq!(
                        (e["arguments"].as_str(), e["name"].as_str()),
                        (Some(sent[at].as_str()), Some(want[at].1.as_str()))
                    )
                }
                "response.output_item.done" => {
                    assert_eq!(e["item"], completed["output"][at], "{e}");
                    assert_eq!(&sent[at], if want[at].0 == "message" { &want[at].1 } else { &want[at].2 });
                }
                _ => {}
            }
        }
        assert_eq!(sent.len(), want.len());
    }
    // The next turn: the call and its output as input items, the chat's prompt.
    let (status, r) = server.post(
        "/v1/responses",
        &json!({"input": [
            {"role": "user", "content": "What is the weather in Paris?"},
            {"type": "function_call", "call_id": id, "name": "get_weather", "arguments": args},
            {"type": "function_call_output", "call_id": id, "output": "{\"temperature\": 21, \"sky\": \"clear\"}"}],
            "tools": [flat(&weather)], "tool_choice": "none", "max_output_tokens": 20}),
    );
    assert_eq!((status, &r["usage"]["input_tokens"]), (200, &turn_tokens), "{r}");
    assert_eq!(r["output"][0]["type"], "message", "{r}");

    // Llama 3's JSON calls: an answer that is one (held to it here) is a call, whole and streamed.
    drop(server);
    let tagged = with_special_tags(&dir);
    let server = Server::start(1, tagged.path(), &["--tool-call-parser", "llama3_json"]);
    let json_call = "\\{\"name\": \"get_weather\", \"parameters\": \\{\"city\": \"[A-Z][a-z]+\", \"unit\": \"celsius\"\\}\\}";
    let mut auto = json!({"messages": chat, "tools": [weather], "max_tokens": 120, "structured_outputs": {"regex": json_call}});
    let (status, v) = server.post("/v1/chat/completions", &auto);
    let c = &v["choices"][0];
    assert_eq!(
        (status, &c["message"]["content"], &c["finish_reason"]),
        (200, &Value::Null, &json!("tool_calls")),
        "{v}"
    );
    let args = c["message"]["tool_calls"][0]["function"]["arguments"].as_str().unwrap();
    assert!(takes("get_weather", args), "{v}");
    auto["stream"] = json!(true);
    let (text, calls, end) = gathered(&server.events("/v1/chat/completions", &auto));
    assert_eq!((text.as_str(), calls.len(), end.as_str()), ("", 1, "tool_calls"));
    assert_eq!((calls[0].0.as_str(), calls[0].1.as_str()), ("get_weather", args));
    // After `<|python_tag|>` as a special token (id 5 here, which the grammar writes).
    let held = |grammar: &str| json!({"messages": chat, "tools": [weather], "max_tokens": 120, "structured_outputs": {"grammar": grammar}});
    let paris = r#"{\"city\": \"Paris\", \"unit\": \"celsius\"}"#;
    let paris_args = r#"{"city": "Paris", "unit": "celsius"}"#;
    // A call of get_weather for Paris, after `content`, whole and streamed.
    let paris_call = |server: &Server, mut ask: Value, content: Value| {
        let (status, v) = server.post("/v1/chat/completions", &ask);
        let c = &v["choices"][0];
        assert_eq!(
            (status, &c["message"]["content"], &c["finish_reason"]),
            (200, &content, &json!("tool_calls")),
            "{v}"
        );
        assert_eq!(c["message"]["tool_calls"][0]["function"]["arguments"], paris_args, "{v}");
        ask["stream"] = json!(true);
        let (text, calls, end) = gathered(&server.events("/v1/chat/completions", &ask));
        assert_eq!(
            (text.as_str(), calls.len(), end.as_str()),
            (content.as_str().unwrap_or(""), 1, "tool_calls")
        );
        assert_eq!((calls[0].0.as_str(), calls[0].1.as_str()), ("get_weather", paris_args));
    };
    let ask = held(&format!(r#"start: <[5]> "{{\"name\": \"get_weather\", \"parameters\": {paris}}}""#));
    paris_call(&server, ask, Value::Null);
    // Hermes' tags as special tokens (3 and 4 here): the text before them is the content.
    drop(server);
    let server = Server::start(1, tagged.path(), &["--tool-call-parser", "hermes"]);
    let call = format!(r#""\n{{\"name\": \"get_weather\", \"arguments\": {paris}}}\n""#);
    paris_call(&server, held(&format!(r#"start: "Sure." <[3]> {call} <[4]>"#)), json!("Sure."));
    // Without tools the tags are special tokens as any other: not in the text.
    let mut plain = held(&format!(r#"start: "Sure." <[3]> {call} <[4]>"#));
    plain.as_object_mut().unwrap().remove("tools");
    let (_, v) = server.post("/v1/chat/completions", &plain);
    let want = format!("Sure.\n{{\"name\": \"get_weather\", \"arguments\": {paris_args}}}\n");
    assert_eq!(v["choices"][0]["message"]["content"], want.as_str(), "{v}");
}
