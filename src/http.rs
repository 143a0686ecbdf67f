//! The HTTP/1.1 side of `serve`: std's sockets, request heads read by `httparse`, a thread for
//! each connection and its requests one after another (keep-alive). What a client sends is
//! bounded before it is read, so no request can take the server down: the head (64 KiB, 64
//! headers), the body (refused from its declared length before a byte of it is read, or once
//! its chunks pass the bound), the connections open at once, the wait for a request's head and
//! each read and write of its body and answer.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// The largest request head (request line and headers) read.
pub const MAX_HEAD: usize = 64 << 10;
/// The most headers a request may have.
const MAX_HEADERS: usize = 64;
/// The longest line of a chunked body's framing (a chunk's size and extensions, a trailer).
const MAX_CHUNK_LINE: usize = 4096;

/// What a client may send and how long it may take.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// The largest request body read.
    pub max_body: usize,
    /// Connections open at once; one more is answered 503 and closed.
    pub max_connections: usize,
    /// How long a connection may wait for its next request's head to begin; then it closes.
    pub idle: Duration,
    /// How long a request's head (once begun) and its body may take to come, and how long each
    /// write of an answer may wait.
    pub io: Duration,
}

/// What answers the requests.
pub trait Handler: Send + Sync + 'static {
    /// Answers `req` (through [`Request::respond`] or [`Request::start_chunked`]; a request
    /// dropped unanswered gets status 500).
    fn request(&self, req: Request);

    /// A request refused before it could be read (a malformed or too large head, one too slow
    /// to come, one connection too many, the server stopped): the body of the answer of
    /// `status` saying `why`, and its content type.
    fn refused(&self, status: u16, why: &str) -> (Vec<u8>, &'static str);
}

/// A listening socket.
pub struct Server {
    listener: TcpListener,
    stopped: Arc<AtomicBool>,
}

impl Server {
    /// Listens on `addr` (`HOST:PORT`; port 0 takes a free one).
    pub fn bind(addr: &str) -> io::Result<Server> {
        Ok(Server { listener: TcpListener::bind(addr)?, stopped: Arc::default() })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Stops [`Server::run`] (from another thread): no connection is taken after, and a
    /// request coming on an open one gets status 503 and its connection closes.
    pub fn stop(&self) {
        self.stopped.store(true, Ordering::SeqCst);
        // Shutting a listening socket down wakes the accept waiting on it (with EINVAL), and
        // later connections are refused.
        // SAFETY: the descriptor is this listener's own, open while `self` lives.
        unsafe { libc::shutdown(self.listener.as_raw_fd(), libc::SHUT_RDWR) };
    }

    /// Takes connections until [`Server::stop`], each on a thread of its own answering its
    /// requests with `handler`. A connection holds the handler only while it answers a
    /// request: once this returns and the last answer is done the handler is dropped, however
    /// long idle connections stay open.
    pub fn run<H: Handler>(&self, limits: Limits, handler: Arc<H>) {
        let open = Arc::new(AtomicUsize::new(0));
        for conn in self.listener.incoming() {
            if self.stopped.load(Ordering::SeqCst) {
                break;
            }
            let Ok(stream) = conn else {
                // Out of descriptors, or a connection reset before it was taken: a moment's
                // pause, then on.
                std::thread::sleep(Duration::from_millis(10));
                continue;
            };
            let count = Open::new(&open);
            if count.0 > limits.max_connections {
                let why =
                    format!("{} connections are open, the most this server takes", limits.max_connections);
                refuse(&stream, handler.as_ref(), 503, &why, limits.io);
                continue;
            }
            let (handler, stopped) = (Arc::downgrade(&handler), Arc::clone(&self.stopped));
            // Out of threads, the connection (in the closure that did not run) closes.
            let _ = std::thread::Builder::new().name("gridlm-http".into()).spawn(move || {
                let _count = count;
                connection(stream, limits, &handler, &stopped);
            });
        }
    }
}

/// One open connection, counted while it lives.
struct Open(usize, Arc<AtomicUsize>);

impl Open {
    fn new(open: &Arc<AtomicUsize>) -> Open {
        Open(open.fetch_add(1, Ordering::SeqCst) + 1, Arc::clone(open))
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        self.1.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A request: its method, target and headers, and its body or why it was not read.
pub struct Request {
    head: Head,
    /// The body, or the status and reason it was not read (too large, malformed, too slow).
    pub body: Result<Vec<u8>, (u16, String)>,
    /// Where the answer goes (`None` once it went).
    w: Option<TcpStream>,
    /// Whether the connection takes another request after this one's answer.
    keep_alive: bool,
    /// Set once the whole answer is written, so the connection may go on.
    done: Arc<AtomicBool>,
    /// Headers every answer to it carries, beside the status line's own.
    extra: Vec<(String, String)>,
}

impl Request {
    /// The request method (`GET`, `POST`, ...).
    pub fn method(&self) -> &str {
        &self.head.method
    }

    /// The request target (path and query).
    pub fn url(&self) -> &str {
        &self.head.url
    }

    /// The value of the first header named `name` (in any case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.head.header(name)
    }

    /// The body, or the status and reason it was not read, taken out (an empty body left).
    pub fn take_body(&mut self) -> Result<Vec<u8>, (u16, String)> {
        std::mem::replace(&mut self.body, Ok(Vec::new()))
    }

    /// Adds the header `name: value` to the answer, whichever it is.
    pub fn add_header(&mut self, name: &str, value: &str) {
        self.extra.push((name.to_string(), value.to_string()));
    }

    /// Whether the client went away (closed or reset the connection) before its answer: the
    /// connection reads as ended. Bytes it holds (a next request) are left for their reader.
    pub fn client_gone(&self) -> bool {
        let Some(w) = &self.w else { return false };
        let mut byte = 0u8;
        // SAFETY: the descriptor is the connection's own, open while `w` lives; at most one
        // byte is peeked into `byte`, without waiting.
        let n = unsafe {
            libc::recv(w.as_raw_fd(), (&raw mut byte).cast(), 1, libc::MSG_PEEK | libc::MSG_DONTWAIT)
        };
        match n {
            0 => true,
            1.. => false,
            _ => !matches!(
                io::Error::last_os_error().kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
            ),
        }
    }

    /// Answers with `status` and `body` of content type `kind`.
    pub fn respond(mut self, status: u16, kind: &str, body: &[u8]) -> io::Result<()> {
        // Taken only here and by the drop, each once: `self` is consumed.
        let Some(w) = self.w.take() else { return Err(io::ErrorKind::NotConnected.into()) };
        let head = head(status, kind, self.keep_alive, &self.extra);
        let sent = write_answer(&w, head, body, self.head.method == "HEAD");
        self.done.store(sent.is_ok(), Ordering::SeqCst);
        sent
    }

    /// Starts an answer of `status` whose body of content type `kind` comes in chunks.
    pub fn start_chunked(mut self, status: u16, kind: &str) -> io::Result<Chunked> {
        // Taken only here and by the drop, each once: `self` is consumed.
        let Some(w) = self.w.take() else { return Err(io::ErrorKind::NotConnected.into()) };
        let mut head = head(status, kind, self.keep_alive, &self.extra);
        head.push_str("Transfer-Encoding: chunked\r\n\r\n");
        (&w).write_all(head.as_bytes())?;
        Ok(Chunked { w, done: Arc::clone(&self.done) })
    }
}

impl Drop for Request {
    /// A request left unanswered (its thread failed): status 500, and the connection closes.
    fn drop(&mut self) {
        if let Some(w) = self.w.take() {
            let body = br#"{"error":{"message":"the server failed while answering","type":"server_error","param":null,"code":null}}"#;
            let _ = write_answer(&w, head(500, "application/json", false, &self.extra), body, false);
        }
    }
}

/// An answer's body being sent in chunks.
pub struct Chunked {
    w: TcpStream,
    done: Arc<AtomicBool>,
}

impl Chunked {
    /// Sends `data` (if any) as one chunk.
    pub fn chunk(&mut self, data: &[u8]) -> io::Result<()> {
        if data.is_empty() {
            return Ok(());
        }
        let mut c = format!("{:X}\r\n", data.len()).into_bytes();
        c.extend_from_slice(data);
        c.extend_from_slice(b"\r\n");
        self.w.write_all(&c)
    }

    /// Ends the body.
    pub fn finish(mut self) -> io::Result<()> {
        self.w.write_all(b"0\r\n\r\n")?;
        self.done.store(true, Ordering::SeqCst);
        Ok(())
    }
}

/// The status line and headers of an answer (with the `extra` ones), but for its length or
/// chunking and the blank line.
fn head(status: u16, kind: &str, keep_alive: bool, extra: &[(String, String)]) -> String {
    let connection = if keep_alive { "keep-alive" } else { "close" };
    let mut head = format!(
        "HTTP/1.1 {status} {}\r\nServer: gridlm\r\nContent-Type: {kind}\r\nConnection: {connection}\r\n",
        reason(status)
    );
    for (name, value) in extra {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head
}

/// Writes a whole answer, `head` then `body` (left out for a HEAD request), in one go.
fn write_answer(mut w: &TcpStream, mut head: String, body: &[u8], bare: bool) -> io::Result<()> {
    head.push_str(&format!("Content-Length: {}\r\n\r\n", body.len()));
    let mut out = head.into_bytes();
    if !bare {
        out.extend_from_slice(body);
    }
    w.write_all(&out)
}

/// Answers a request that is not read with `status` and closes the connection.
fn refuse(stream: &TcpStream, handler: &dyn Handler, status: u16, why: &str, io: Duration) {
    let _ = stream.set_write_timeout(Some(io));
    let (body, kind) = handler.refused(status, why);
    let _ = write_answer(stream, head(status, kind, false, &[]), &body, false);
}

fn reason(status: u16) -> &'static str {
    match status {
        100 => "Continue",
        200 => "OK",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        413 => "Content Too Large",
        417 => "Expectation Failed",
        429 => "Too Many Requests",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        501 => "Not Implemented",
        503 => "Service Unavailable",
        505 => "HTTP Version Not Supported",
        _ => "",
    }
}

/// A request's head as read.
struct Head {
    method: String,
    url: String,
    version: u8,
    headers: Vec<(String, String)>,
}

impl Head {
    /// The values of the headers named `name` (in any case), in order.
    fn values<'a, 'n>(&'a self, name: &'n str) -> impl Iterator<Item = &'a str> + use<'a, 'n> {
        self.headers.iter().filter(move |(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }

    /// The value of the first header named `name`.
    fn header(&self, name: &str) -> Option<&str> {
        self.values(name).next()
    }

    /// Whether a header named `name` (any of them) lists `token` (comma-separated, any case).
    fn lists(&self, name: &str, token: &str) -> bool {
        self.values(name).any(|v| v.split(',').any(|t| t.trim().eq_ignore_ascii_case(token)))
    }

    fn keep_alive(&self) -> bool {
        match self.version {
            1 => !self.lists("Connection", "close"),
            _ => self.lists("Connection", "keep-alive"),
        }
    }
}

/// Why a request could not be read: its status and reason, or `None` where the client is gone
/// (or never sent anything) and nothing is answered.
type Unread = Option<(u16, String)>;

/// Answers a connection's requests until it closes, the client asks it to, or an answer could
/// not be whole.
fn connection<H: Handler>(stream: TcpStream, limits: Limits, handler: &Weak<H>, stopped: &AtomicBool) {
    let _ = stream.set_nodelay(true);
    let _ = stream.set_write_timeout(Some(limits.io));
    let Ok(read) = stream.try_clone() else { return };
    let mut r = BufReader::new(read);
    loop {
        let _ = stream.set_read_timeout(Some(limits.idle));
        let head = read_head(&mut r, limits.io, &stream);
        let (head, live) = match (head, handler.upgrade()) {
            (Err(None), _) => return,
            (Err(Some((status, why))), Some(live)) => {
                refuse(&stream, live.as_ref(), status, &why, limits.io);
                return linger(&stream, &mut r);
            }
            (Ok(head), Some(live)) if !stopped.load(Ordering::SeqCst) => (head, live),
            // The server stopped (and, where the handler is gone, answered its last request).
            (_, live) => {
                if let Some(live) = live {
                    refuse(&stream, live.as_ref(), 503, "the server is shutting down", limits.io);
                }
                return linger(&stream, &mut r);
            }
        };
        let mut timed = Timed { r: &mut r, stream: &stream, deadline: Instant::now() + limits.io };
        let body = match read_body(&mut timed, &head, limits.max_body, &stream) {
            Ok(body) => Ok(body),
            Err(Some(refusal)) => Err(refusal),
            Err(None) => return,
        };
        let keep_alive = head.keep_alive() && body.is_ok();
        let done = Arc::new(AtomicBool::new(false));
        let Ok(w) = stream.try_clone() else { return };
        live.request(Request {
            head,
            body,
            w: Some(w),
            keep_alive,
            done: Arc::clone(&done),
            extra: Vec::new(),
        });
        drop(live);
        if !keep_alive || !done.load(Ordering::SeqCst) {
            return linger(&stream, &mut r);
        }
    }
}

/// Closes a connection whose client may still be sending (a body refused unread): the answer
/// is sent first, and what comes after is read and dropped for up to two seconds (64 MiB), so
/// the close does not reset the connection before the client has read the answer.
fn linger(stream: &TcpStream, r: &mut BufReader<TcpStream>) {
    let _ = stream.shutdown(std::net::Shutdown::Write);
    let _ = stream.set_read_timeout(Some(Duration::from_millis(500)));
    let (start, mut buf, mut left) = (Instant::now(), vec![0; 64 << 10], 64usize << 20);
    while left > 0 && start.elapsed() < Duration::from_secs(2) {
        match r.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => left = left.saturating_sub(n),
        }
    }
}

/// Reads a request's head: `Err(None)` where the connection closed or stayed idle before one
/// began. Once a head has begun, the whole of it must come within `io`.
fn read_head(r: &mut BufReader<TcpStream>, io: Duration, stream: &TcpStream) -> Result<Head, Unread> {
    let late = || Some((408, "the request's head did not come in time".into()));
    let (mut buf, mut deadline) = (Vec::new(), None);
    loop {
        if deadline.is_some_and(|d| left_until(stream, d).is_err()) {
            return Err(late());
        }
        let got = match r.fill_buf() {
            Ok(got) => got,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) if is_timeout(&e) && !buf.is_empty() => return Err(late()),
            Err(_) => return Err(None),
        };
        if got.is_empty() {
            return Err(None);
        }
        let before = buf.len();
        buf.extend_from_slice(&got[..got.len().min(MAX_HEAD + 1 - before)]);
        if before == 0 {
            deadline = Some(Instant::now() + io);
        }
        let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut req = httparse::Request::new(&mut headers);
        match req.parse(&buf) {
            Ok(httparse::Status::Complete(n)) => {
                r.consume(n - before);
                let headers = req
                    .headers
                    .iter()
                    .map(|h| (h.name.to_string(), String::from_utf8_lossy(h.value).into_owned()))
                    .collect();
                // A complete parse has all three.
                let (method, url, version) =
                    (req.method.unwrap_or_default(), req.path.unwrap_or_default(), req.version.unwrap_or(1));
                return Ok(Head { method: method.into(), url: url.into(), version, headers });
            }
            Ok(httparse::Status::Partial) if buf.len() > MAX_HEAD => {
                let why = format!("the request's head is larger than {} KiB", MAX_HEAD >> 10);
                return Err(Some((431, why)));
            }
            Ok(httparse::Status::Partial) => {
                let n = buf.len() - before;
                r.consume(n);
            }
            Err(httparse::Error::TooManyHeaders) => {
                return Err(Some((431, format!("the request has more than {MAX_HEADERS} headers"))))
            }
            Err(httparse::Error::Version) => {
                return Err(Some((505, "only HTTP/1.0 and HTTP/1.1 are spoken here".into())))
            }
            Err(e) => return Err(Some((400, format!("a malformed request head ({e})")))),
        }
    }
}

fn is_timeout(e: &io::Error) -> bool {
    matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut)
}

/// Reads a request's body as its head declares it (a length, chunks, or none), at most `max`
/// bytes. A body declared larger is refused without reading it; an `Expect: 100-continue`
/// gets its interim answer once the body is to be read.
fn read_body(r: &mut Timed, head: &Head, max: usize, w: &TcpStream) -> Result<Vec<u8>, Unread> {
    let too_large = || Some((413, format!("the body is larger than {}", size_text(max))));
    let chunked = match head.header("Transfer-Encoding") {
        None => false,
        Some(_) if head.header("Content-Length").is_some() => {
            return Err(Some((400, "a request with both Content-Length and Transfer-Encoding".into())))
        }
        Some(te) if te.rsplit(',').next().is_some_and(|t| t.trim().eq_ignore_ascii_case("chunked")) => true,
        Some(te) => return Err(Some((501, format!("Transfer-Encoding {te} is not spoken here")))),
    };
    let mut lengths = head.values("Content-Length");
    let length = match lengths.next() {
        None => 0,
        Some(v) => {
            let digits = !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit());
            let n = v.parse::<u64>().ok().filter(|_| digits);
            match n {
                Some(_) if lengths.any(|o| o != v) => {
                    return Err(Some((400, "Content-Length headers that differ".into())))
                }
                Some(n) => n,
                None => return Err(Some((400, format!("a Content-Length of {v:?}")))),
            }
        }
    };
    if length > max as u64 {
        return Err(too_large());
    }
    if !chunked && length == 0 {
        return Ok(Vec::new());
    }
    match head.header("Expect") {
        None => {}
        Some(e) if e.trim().eq_ignore_ascii_case("100-continue") => {
            let mut w = w;
            w.write_all(b"HTTP/1.1 100 Continue\r\n\r\n").map_err(|_| None)?;
        }
        Some(e) => return Err(Some((417, format!("the expectation {e:?} is not met here")))),
    }
    let lost = |e: io::Error| match e.kind() {
        _ if is_timeout(&e) => Some((408, "the request's body did not come in time".to_string())),
        io::ErrorKind::InvalidData => Some((400, e.to_string())),
        _ => None,
    };
    if !chunked {
        let mut body = vec![0; length as usize];
        r.read_exact(&mut body).map_err(lost)?;
        return Ok(body);
    }
    let mut body = Vec::new();
    loop {
        let line = chunk_line(r).map_err(lost)?;
        let size = line.split(';').next().unwrap_or("").trim();
        let Some(size) = usize::from_str_radix(size, 16).ok().filter(|_| !size.is_empty()) else {
            return Err(Some((400, format!("a malformed chunk size {line:?}"))));
        };
        if size == 0 {
            // Trailers, up to the blank line.
            while !chunk_line(r).map_err(lost)?.is_empty() {}
            return Ok(body);
        }
        if size > max - body.len() {
            return Err(too_large());
        }
        let start = body.len();
        body.resize(start + size, 0);
        r.read_exact(&mut body[start..]).map_err(lost)?;
        if !chunk_line(r).map_err(lost)?.is_empty() {
            return Err(Some((400, "a chunk longer than its size".into())));
        }
    }
}

/// `bytes` in MiB where they are whole MiB, else in bytes.
fn size_text(bytes: usize) -> String {
    match bytes {
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{} MiB", b >> 20),
        b => format!("{b} bytes"),
    }
}

/// Sets `stream`'s read timeout to what is left until `deadline`; an error once it has passed.
fn left_until(stream: &TcpStream, deadline: Instant) -> io::Result<()> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(io::ErrorKind::TimedOut.into());
    }
    stream.set_read_timeout(Some(left))
}

/// A connection's reader whose reads must all end by a deadline (a body trickling in a byte at a
/// time does not hold its connection for longer).
struct Timed<'a> {
    r: &'a mut BufReader<TcpStream>,
    stream: &'a TcpStream,
    deadline: Instant,
}

impl Read for Timed<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        left_until(self.stream, self.deadline)?;
        self.r.read(buf)
    }
}

impl BufRead for Timed<'_> {
    fn fill_buf(&mut self) -> io::Result<&[u8]> {
        left_until(self.stream, self.deadline)?;
        self.r.fill_buf()
    }

    fn consume(&mut self, n: usize) {
        self.r.consume(n);
    }
}

/// A line of a chunked body's framing, without its line end.
fn chunk_line(r: &mut impl BufRead) -> io::Result<String> {
    let mut line = Vec::new();
    (&mut *r).take(MAX_CHUNK_LINE as u64 + 2).read_until(b'\n', &mut line)?;
    if line.last() != Some(&b'\n') {
        let why = if line.len() > MAX_CHUNK_LINE { "a chunk line too long" } else { "the body ended early" };
        return Err(io::Error::new(io::ErrorKind::InvalidData, why));
    }
    while line.last().is_some_and(|b| *b == b'\n' || *b == b'\r') {
        line.pop();
    }
    Ok(String::from_utf8_lossy(&line).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::sync::atomic::AtomicUsize;

    /// Answers `METHOD URL BODY-LENGTH`, or the body's refusal, with the header `X-Url: URL`;
    /// `/fail` panics, `/chunks` answers in two chunks.
    struct Echo(AtomicUsize);

    impl Handler for Echo {
        fn request(&self, mut req: Request) {
            self.0.fetch_add(1, Ordering::SeqCst);
            let url = req.url().to_string();
            req.add_header("X-Url", &url);
            if url == "/fail" {
                panic!("a failing request thread (a test)");
            }
            if url == "/chunks" {
                let mut c = req.start_chunked(200, "text/plain").unwrap();
                c.chunk(b"one ").unwrap();
                c.chunk(b"two").unwrap();
                return c.finish().unwrap();
            }
            let text = match &req.body {
                Ok(b) => format!("{} {} {}", req.method(), req.url(), b.len()),
                Err((status, why)) => format!("{status} {why}"),
            };
            let status = req.body.as_ref().err().map_or(200, |e| e.0);
            req.respond(status, "text/plain", text.as_bytes()).unwrap();
        }

        fn refused(&self, status: u16, why: &str) -> (Vec<u8>, &'static str) {
            (format!("refused {status}: {why}").into_bytes(), "text/plain")
        }
    }

    const LIMITS: Limits = Limits {
        max_body: 1 << 10,
        max_connections: 4,
        idle: Duration::from_secs(5),
        io: Duration::from_millis(300),
    };

    /// A server on a free port with `limits`, its thread and its handler.
    fn start(limits: Limits) -> (Arc<Server>, std::thread::JoinHandle<()>, Arc<Echo>) {
        let server = Arc::new(Server::bind("127.0.0.1:0").unwrap());
        let echo = Arc::new(Echo(AtomicUsize::new(0)));
        let (s, e) = (Arc::clone(&server), Arc::clone(&echo));
        (server, std::thread::spawn(move || s.run(limits, e)), echo)
    }

    fn connect(server: &Server) -> TcpStream {
        let s = TcpStream::connect(server.local_addr().unwrap()).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s
    }

    /// Sends `bytes` on a new connection and reads until it closes.
    fn exchange(server: &Server, bytes: &[u8]) -> String {
        let mut s = connect(server);
        // A server refusing a body may close before all of it is sent.
        let _ = s.write_all(bytes);
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out);
        String::from_utf8_lossy(&out).into_owned()
    }

    /// The answers' status codes and bodies, in order (bodies by their length or chunks).
    fn answers(text: &str) -> Vec<(u16, String)> {
        let mut out = Vec::new();
        let mut rest = text;
        while let Some(end) = rest.find("\r\n\r\n") {
            let head = &rest[..end];
            let status = head[9..12].parse().unwrap();
            rest = &rest[end + 4..];
            if status == 100 {
                continue;
            }
            let mut body = String::new();
            if let Some(n) = head.lines().find_map(|l| l.strip_prefix("Content-Length: ")) {
                let n: usize = n.parse().unwrap();
                body.push_str(&rest[..n]);
                rest = &rest[n..];
            } else {
                loop {
                    let (size, after) = rest.split_once("\r\n").unwrap();
                    let n = usize::from_str_radix(size, 16).unwrap();
                    body.push_str(&after[..n]);
                    rest = &after[n + 2..];
                    if n == 0 {
                        break;
                    }
                }
            }
            out.push((status, body));
        }
        out
    }

    #[test]
    fn bodies_beyond_the_bound_are_refused_without_being_read() {
        let (server, ..) = start(LIMITS);
        // A length no memory holds: refused from the head alone (it aborted the server whose
        // HTTP library drained an unread body into a buffer of the declared length).
        let got = exchange(&server, b"POST /a HTTP/1.1\r\nContent-Length: 99999999999999\r\n\r\n{}");
        assert_eq!(answers(&got), [(413, "413 the body is larger than 1024 bytes".into())], "{got}");
        assert!(got.contains("Connection: close"), "{got}");
        // Chunks passing the bound; then a body within it, and one sent whole though refused.
        let chunks = format!(
            "POST /a HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n400\r\n{}\r\n1\r\nx\r\n0\r\n\r\n",
            "y".repeat(1024)
        );
        assert_eq!(answers(&exchange(&server, chunks.as_bytes()))[0].0, 413);
        let fits = format!(
            "POST /a HTTP/1.1\r\nContent-Length: 1024\r\nConnection: close\r\n\r\n{}",
            "z".repeat(1024)
        );
        assert_eq!(answers(&exchange(&server, fits.as_bytes())), [(200, "POST /a 1024".into())]);
        let big = format!("POST /a HTTP/1.1\r\nContent-Length: 300000\r\n\r\n{}", "z".repeat(300000));
        assert_eq!(answers(&exchange(&server, big.as_bytes()))[0].0, 413);
    }

    #[test]
    fn heads_beyond_the_bounds_and_malformed_ones_get_their_status() {
        let (server, ..) = start(LIMITS);
        let huge = format!("GET / HTTP/1.1\r\nX: {}", "a".repeat(MAX_HEAD + 10));
        let many: String = (0..MAX_HEADERS + 1).map(|i| format!("X{i}: y\r\n")).collect();
        for (bytes, status, why) in [
            (huge, 431, "head is larger than 64 KiB"),
            (format!("GET / HTTP/1.1\r\n{many}\r\n"), 431, "more than 64 headers"),
            ("GARBAGE\r\n\r\n".into(), 400, "malformed request head"),
            ("GET / HTTP/2.0\r\n\r\n".into(), 505, "HTTP/1.0 and HTTP/1.1"),
            ("POST / HTTP/1.1\r\nContent-Length: -5\r\n\r\n".into(), 400, "Content-Length of \"-5\""),
            ("POST / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab".into(), 400, "differ"),
            ("POST / HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n".into(), 501, "gzip"),
            ("POST / HTTP/1.1\r\nExpect: magic\r\nContent-Length: 1\r\n\r\na".into(), 417, "magic"),
            ("POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n".into(), 400, "chunk size"),
        ] {
            let got = answers(&exchange(&server, bytes.as_bytes()));
            assert_eq!(got.len(), 1, "{bytes:.60}: {got:?}");
            assert_eq!(got[0].0, status, "{bytes:.60}: {got:?}");
            assert!(got[0].1.contains(why), "{bytes:.60}: {got:?}");
        }
    }

    #[test]
    fn requests_on_one_connection_are_answered_in_turn_until_it_closes() {
        let (server, ..) = start(LIMITS);
        // Pipelined, the second body chunked after an interim answer, the third closing.
        let got = exchange(
            &server,
            b"GET /h HTTP/1.1\r\n\r\nPOST /b HTTP/1.1\r\nExpect: 100-continue\r\nTransfer-Encoding: chunked\r\n\r\n3;x=1\r\nabc\r\n2\r\nde\r\n0\r\nT: 1\r\n\r\nGET /chunks HTTP/1.1\r\nConnection: close\r\n\r\nGET /never HTTP/1.1\r\n\r\n",
        );
        assert!(got.contains("HTTP/1.1 100 Continue\r\n\r\n"), "{got}");
        // Each answer carries the headers added to its request, whole or in chunks.
        assert!(got.contains("X-Url: /h\r\nContent-Length: 8\r\n\r\n"), "{got}");
        assert!(got.contains("X-Url: /chunks\r\nTransfer-Encoding: chunked\r\n\r\n"), "{got}");
        let want = [(200, "GET /h 0".into()), (200, "POST /b 5".into()), (200, "one two".to_string())];
        assert_eq!(answers(&got), want, "{got}");
        // HTTP/1.0 closes unless asked not to.
        assert_eq!(answers(&exchange(&server, b"GET /a HTTP/1.0\r\n\r\nGET /b HTTP/1.0\r\n\r\n")).len(), 1);
        let kept = b"GET /a HTTP/1.0\r\nConnection: keep-alive\r\n\r\nGET /b HTTP/1.0\r\n\r\n";
        assert_eq!(answers(&exchange(&server, kept)).len(), 2);
    }

    #[test]
    fn a_failing_handler_answers_500_and_the_server_goes_on() {
        let (server, ..) = start(LIMITS);
        let text = exchange(&server, b"GET /fail HTTP/1.1\r\n\r\nGET /after HTTP/1.1\r\n\r\n");
        let got = answers(&text);
        assert_eq!(got.len(), 1, "the connection closes after the failure: {got:?}");
        assert_eq!(got[0].0, 500);
        assert!(text.contains("X-Url: /fail\r\n"), "the headers added before the failure: {text}");
        let next = answers(&exchange(&server, b"GET /next HTTP/1.1\r\nConnection: close\r\n\r\n"));
        assert_eq!(next, [(200, "GET /next 0".into())]);
    }

    #[test]
    fn slow_clients_and_connections_beyond_the_most_are_turned_away() {
        let (server, ..) = start(LIMITS);
        // A head begun but not ended in time: 408; so with a head or a body coming a byte at a
        // time, each byte well within the time (300 ms) but not the whole.
        let got = answers(&exchange(&server, b"GET / HTTP/1.1\r\nHost: x\r\n"));
        assert_eq!(got[0].0, 408, "{got:?}");
        for (head, body) in [
            ("GET / HTTP/1.1\r\nX: abcdefghij", ""),
            ("POST / HTTP/1.1\r\nContent-Length: 10\r\n\r\n", "abcdefghij"),
        ] {
            let mut s = connect(&server);
            let trickle = if body.is_empty() { head } else { body };
            if !body.is_empty() {
                s.write_all(head.as_bytes()).unwrap();
            }
            for b in trickle.bytes() {
                if s.write_all(&[b]).is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            let mut out = Vec::new();
            let _ = s.read_to_end(&mut out);
            let got = answers(&String::from_utf8_lossy(&out));
            assert_eq!(got[0].0, 408, "{head:?}: {got:?}");
            assert!(got[0].1.contains("did not come in time"), "{got:?}");
        }
        // Four connections open and idle, the fifth is turned away at once.
        let idle: Vec<TcpStream> = (0..LIMITS.max_connections).map(|_| connect(&server)).collect();
        std::thread::sleep(Duration::from_millis(100));
        let got = answers(&exchange(&server, b"GET / HTTP/1.1\r\n\r\n"));
        assert_eq!(got[0].0, 503, "{got:?}");
        assert!(got[0].1.contains("4 connections are open"), "{got:?}");
        drop(idle);
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(answers(&exchange(&server, b"GET /a HTTP/1.0\r\n\r\n")), [(200, "GET /a 0".into())]);
    }

    #[test]
    fn stopping_closes_the_port_and_lets_the_handler_go_though_connections_stay() {
        let (server, run, echo) = start(LIMITS);
        let mut open = connect(&server);
        open.write_all(b"GET /a HTTP/1.1\r\n\r\n").unwrap();
        let mut buf = [0; 256];
        assert!(open.read(&mut buf).unwrap() > 0);
        let addr = server.local_addr().unwrap();
        server.stop();
        run.join().unwrap();
        // The answer's bytes may come before its thread lets the handler go: the last answer
        // is done once `request` returns.
        let t = Instant::now();
        while Arc::strong_count(&echo) > 1 && t.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(Arc::strong_count(&echo), 1, "only the test holds the handler");
        assert!(TcpStream::connect(addr).is_err(), "a connection after the stop is refused");
        // The open connection's next request is not answered by the handler.
        let _ = open.write_all(b"GET /b HTTP/1.1\r\n\r\n");
        let mut rest = Vec::new();
        let _ = open.read_to_end(&mut rest);
        assert_eq!(echo.0.load(Ordering::SeqCst), 1, "{}", String::from_utf8_lossy(&rest));
    }
}
