//! `ferry serve` against slow, idle, greedy and malformed clients, over real sockets: idle connections, partial
//! heads and trickled bodies are closed after their timeouts; past the connection cap idle connections make room
//! and busy ones make newcomers wait; shutdown does not wait for half-sent requests; every error is OpenAI-shaped
//! JSON, hyper's own included, and never echoes unbounded input; a prompt too long in bytes is refused before it is
//! tokenized, and /health keeps answering while large prompts are prepared; every request is logged once.

mod common;

use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::process::Command;
use std::time::{Duration, Instant};

use common::{chat, Server, KEY};
use serde_json::{json, Value};

/// Generous: the server's timeouts in these tests are 1 s, and a loaded CI machine may be slow to act on them.
const PATIENCE: Duration = Duration::from_secs(20);

/// Whether the server closes `stream` within `within` (what it sends before closing is read and dropped).
fn closed_by_server(stream: &mut TcpStream, within: Duration) -> bool {
    stream.set_read_timeout(Some(within)).unwrap();
    let mut buf = [0; 4096];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => return false,
            Err(_) => return true,
        }
    }
}

/// Reads one response with a `content-length` from a connection that stays open: status and body.
fn read_response(stream: &mut TcpStream) -> (u16, String) {
    let mut reader = BufReader::new(stream);
    let mut head = String::new();
    while !head.ends_with("\r\n\r\n") {
        assert!(reader.read_line(&mut head).unwrap() > 0, "closed mid-head: {head}");
    }
    let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    let length: usize = head
        .lines()
        .find_map(|l| {
            l.to_ascii_lowercase()
                .strip_prefix("content-length:")
                .map(|v| v.trim().parse().unwrap())
        })
        .unwrap_or_else(|| panic!("no content-length in {head}"));
    let mut body = vec![0; length];
    reader.read_exact(&mut body).unwrap();
    (status, String::from_utf8(body).unwrap())
}

/// Sends `request` (from another thread, ignoring write errors: the server may answer and close before reading it
/// all) and reads the answer until the server closes: status, head and body.
fn exchange(address: &str, request: Vec<u8>) -> (u16, String, String) {
    let stream = TcpStream::connect(address).unwrap();
    let mut writer = stream.try_clone().unwrap();
    let sending = std::thread::spawn(move || {
        let _ = writer.write_all(&request);
    });
    let answer = read_until_closed(stream);
    sending.join().unwrap();
    answer
}

/// The answer on `stream` up to the server's close (or reset, which may follow an answer to a request whose body
/// was not read): status, head and body.
fn read_until_closed(mut stream: TcpStream) -> (u16, String, String) {
    stream.set_read_timeout(Some(PATIENCE)).unwrap();
    let mut raw = Vec::new();
    let mut buf = [0; 65536];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => raw.extend_from_slice(&buf[..n]),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => panic!("no answer"),
            Err(_) => break,
        }
    }
    let _ = stream.shutdown(Shutdown::Both);
    let raw = String::from_utf8(raw).unwrap();
    let (head, body) = raw
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("no response: {raw:?}"));
    let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    (status, head.to_string(), body.to_string())
}

/// An OpenAI-style error with this `code`.
fn assert_openai_error(body: &str, code: &str) -> Value {
    let error: Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {body}"));
    assert_eq!(error["error"]["code"], code, "{body}");
    assert!(error["error"]["type"].is_string(), "{body}");
    assert!(error["error"]["message"].as_str().unwrap().len() > 10, "{body}");
    error
}

fn health_request() -> &'static [u8] {
    b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n"
}

#[test]
fn idle_connections_are_closed_after_the_keep_alive_timeout() {
    let server = Server::start(&["--keep-alive-timeout", "1"]);
    let mut fresh = TcpStream::connect(&server.address).unwrap();
    let mut kept = TcpStream::connect(&server.address).unwrap();
    for _ in 0..2 {
        kept.write_all(health_request()).unwrap();
        assert_eq!(read_response(&mut kept).0, 200, "a kept-alive connection serves again");
    }
    assert!(
        closed_by_server(&mut fresh, PATIENCE),
        "a connection that never sent anything"
    );
    assert!(
        closed_by_server(&mut kept, PATIENCE),
        "a connection idle after its responses"
    );
}

#[test]
fn a_partial_head_is_closed_after_the_header_timeout() {
    let server = Server::start(&["--header-read-timeout", "1", "--keep-alive-timeout", "600"]);
    let mut slow = TcpStream::connect(&server.address).unwrap();
    slow.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Ty")
        .unwrap();
    assert!(closed_by_server(&mut slow, PATIENCE));
    assert_eq!(server.get("/health", None).0, 200);
}

#[test]
fn a_trickled_body_is_cut_after_the_body_timeout() {
    let server = Server::start(&["--body-read-timeout", "1"]);
    let mut stream = TcpStream::connect(&server.address).unwrap();
    write!(
        stream,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {KEY}\r\n\
         Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n{{\"messages\": \""
    )
    .unwrap();
    let mut trickle = stream.try_clone().unwrap();
    let trickling = std::thread::spawn(move || {
        let started = Instant::now();
        while started.elapsed() < PATIENCE && trickle.write_all(b"x").is_ok() {
            std::thread::sleep(Duration::from_millis(100));
        }
    });
    let (status, _, body) = read_until_closed(stream);
    assert_eq!(status, 408, "{body}");
    assert_openai_error(&body, "request_timeout");
    trickling.join().unwrap();
}

#[test]
fn past_the_cap_idle_connections_make_room_and_busy_ones_make_newcomers_wait() {
    let server = Server::start(&[
        "--max-connections",
        "2",
        "--keep-alive-timeout",
        "600",
        "--max-running-requests",
        "2",
    ]);
    let mut oldest = TcpStream::connect(&server.address).unwrap();
    let mut older = TcpStream::connect(&server.address).unwrap();
    older.write_all(health_request()).unwrap();
    assert_eq!(read_response(&mut older).0, 200);
    // Both slots are taken by idle connections; a newcomer closes the one idle the longest.
    assert_eq!(server.get("/health", None).0, 200);
    assert!(closed_by_server(&mut oldest, PATIENCE));
    older.write_all(health_request()).unwrap();
    assert_eq!(read_response(&mut older).0, 200, "only one connection made room");

    // Two long streams take both slots; a newcomer waits until one of them is done.
    let long = chat(
        "Go on.",
        json!({"max_tokens": 4000, "ignore_eos": true, "stream": true}),
    );
    let mut streams: Vec<_> = (0..2)
        .map(|_| {
            let stream = server.send("POST", "/v1/chat/completions", Some(&long.to_string()), Some(KEY));
            let mut reader = BufReader::new(stream);
            let mut seen = String::new();
            while !seen.contains("data: {") {
                assert!(reader.read_line(&mut seen).unwrap() > 0, "stream ended early: {seen}");
            }
            reader
        })
        .collect();
    let mut waiting = TcpStream::connect(&server.address).unwrap();
    waiting.write_all(health_request()).unwrap();
    waiting.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
    let mut byte = [0];
    let early = waiting.read(&mut byte);
    assert!(
        matches!(&early, Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut)),
        "answered while every slot was busy: {early:?}"
    );
    streams.pop();
    waiting.set_read_timeout(Some(PATIENCE)).unwrap();
    assert_eq!(read_response(&mut waiting).0, 200);
}

#[test]
fn shutdown_closes_half_read_connections_at_once_and_lets_streams_finish() {
    let server = Server::start(&["--header-read-timeout", "600", "--keep-alive-timeout", "600"]);
    let mut half_read = TcpStream::connect(&server.address).unwrap();
    half_read.write_all(b"GET /health HTTP/1.1\r\nHo").unwrap();
    let mut idle = TcpStream::connect(&server.address).unwrap();
    let request = chat("Go on.", json!({"max_tokens": 200, "ignore_eos": true, "stream": true}));
    let stream = server.send("POST", "/v1/chat/completions", Some(&request.to_string()), Some(KEY));
    let mut stream = BufReader::new(stream);
    let mut seen = String::new();
    while !seen.contains("data: {") {
        assert!(stream.read_line(&mut seen).unwrap() > 0, "stream ended early: {seen}");
    }

    let pid = server.child.id().to_string();
    assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    assert!(closed_by_server(&mut half_read, PATIENCE));
    assert!(closed_by_server(&mut idle, PATIENCE));
    stream.read_to_string(&mut seen).unwrap();
    assert!(seen.contains("data: [DONE]"), "the stream was cut:\n{seen}");

    let mut server = server;
    let deadline = Instant::now() + PATIENCE;
    while server.child.try_wait().unwrap().is_none() {
        assert!(Instant::now() < deadline, "still running:\n{}", server.log());
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn every_error_is_openai_json_and_never_echoes_unbounded_input() {
    let server = Server::start(&[]);
    for (method, path) in [
        ("GET", "/v1/chat/completions"),
        ("POST", "/v1/models"),
        ("PUT", "/health"),
    ] {
        let request = format!(
            "{method} {path} HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {KEY}\r\nContent-Type: application/json\r\n\
             Content-Length: 0\r\nConnection: close\r\n\r\n"
        );
        let (status, head, body) = exchange(&server.address, request.into_bytes());
        assert_eq!(status, 405, "{method} {path}: {head}\n{body}");
        assert!(head.to_ascii_lowercase().contains("\r\nallow: "), "{head}");
        assert_openai_error(&body, "method_not_allowed");
    }

    let huge = format!("{{\"messages\": \"{}\"}}", "x".repeat(3 << 20));
    let request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {KEY}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{huge}",
        huge.len()
    );
    let (status, _, body) = exchange(&server.address, request.into_bytes());
    assert_eq!(status, 413, "{body}");
    assert!(assert_openai_error(&body, "request_too_large")["error"]["message"]
        .as_str()
        .unwrap()
        .contains("2097152 bytes"));

    // hyper's own answers to heads it cannot parse.
    let many_headers: String = (0..120).map(|i| format!("X-Header-{i}: {i}\r\n")).collect();
    for (request, status, code) in [
        ("NONSENSE\r\n\r\n".to_string(), 400, "malformed_request"),
        (
            format!("GET /{} HTTP/1.1\r\nHost: t\r\n\r\n", "a".repeat(70_000)),
            414,
            "uri_too_long",
        ),
        (
            format!("GET /health HTTP/1.1\r\nHost: t\r\n{many_headers}\r\n"),
            431,
            "request_header_fields_too_large",
        ),
    ] {
        let (got, head, body) = exchange(&server.address, request.into_bytes());
        assert_eq!(got, status, "{head}\n{body}");
        assert!(
            head.to_ascii_lowercase().contains("content-type: application/json"),
            "{head}"
        );
        assert_openai_error(&body, code);
    }

    let long_name = "m".repeat(100_000);
    let (status, error) = server.post("/v1/chat/completions", &chat("hi", json!({"model": long_name})));
    assert_eq!(status, 404, "{error}");
    let (status, body) = server.get(&format!("/v1/{}", "p".repeat(10_000)), Some(KEY));
    assert_eq!(status, 404);
    for message in [error.to_string(), body] {
        assert!(message.len() < 1000, "{} bytes echoed", message.len());
    }
    assert_eq!(server.get("/health", None).0, 200);
}

#[test]
fn a_prompt_too_long_in_bytes_is_refused_before_tokenizing_and_health_keeps_answering() {
    let server = Server::start(&["--max-model-len", "64"]);
    let text = "ferry ".repeat(200_000);
    for (path, body, param) in [
        ("/v1/chat/completions", chat(&text, json!({})), "messages"),
        ("/v1/completions", json!({"prompt": text}), "prompt"),
    ] {
        let (status, error) = server.post(path, &body);
        assert_eq!(status, 400, "{path}: {error}");
        assert_eq!(error["error"]["param"], param);
        assert_eq!(error["error"]["code"], "context_length_exceeded");
        let message = error["error"]["message"].as_str().unwrap();
        assert!(
            message.contains("1200000 bytes") && message.contains("64 tokens"),
            "{message}"
        );
    }

    // Large prompts that pass the byte bound are rendered and tokenized off the async threads.
    let server = Server::start(&[]);
    let large = chat(
        &"The ferry crossed the river. ".repeat(60_000),
        json!({"max_tokens": 1}),
    );
    let senders: Vec<_> = (0..6)
        .map(|_| server.send("POST", "/v1/chat/completions", Some(&large.to_string()), Some(KEY)))
        .collect();
    std::thread::sleep(Duration::from_millis(200));
    for _ in 0..3 {
        let asked = Instant::now();
        assert_eq!(server.get("/health", None).0, 200);
        assert!(
            asked.elapsed() < Duration::from_secs(2),
            "/health took {:?}",
            asked.elapsed()
        );
    }
    drop(senders);
}

#[test]
fn every_request_is_logged_once_without_colour_codes() {
    let server = Server::start(&[]);
    assert_eq!(server.get("/v1/models", None).0, 401);
    let (status, body) = server.post("/v1/chat/completions", &chat("hi", json!({"max_tokens": 2})));
    assert_eq!(status, 200, "{body}");
    let prompt_tokens = body["usage"]["prompt_tokens"].as_u64().unwrap();
    let accepted = format!("prompt_tokens={prompt_tokens} completion_tokens=2 outcome=length");
    let deadline = Instant::now() + PATIENCE;
    let log = loop {
        let log = server.log();
        if log.contains(&accepted) {
            break log;
        }
        assert!(Instant::now() < deadline, "no access line for the generation:\n{log}");
        std::thread::sleep(Duration::from_millis(20));
    };
    let access: Vec<&str> = log.lines().filter(|l| l.contains("ferry::access")).collect();
    let refused: Vec<_> = access.iter().filter(|l| l.contains("GET /v1/models 401")).collect();
    let generated: Vec<_> = access
        .iter()
        .filter(|l| l.contains("POST /v1/chat/completions 200") && l.contains(&accepted))
        .collect();
    assert_eq!((refused.len(), generated.len()), (1, 1), "{log}");
    assert!(!log.contains('\x1b'), "colour codes in a piped log:\n{log}");

    // Three choices are one request: one line, with the completions of all three.
    let (status, body) = server.post(
        "/v1/completions",
        &json!({"prompt": "ferries", "max_tokens": 3, "n": 3}),
    );
    assert_eq!(status, 200, "{body}");
    let prompt_tokens = body["usage"]["prompt_tokens"].as_u64().unwrap();
    let accepted = "POST /v1/completions 200";
    let counts = format!("prompt_tokens={prompt_tokens} completion_tokens=9 outcome=length");
    let deadline = Instant::now() + PATIENCE;
    while !server.log().contains(&counts) {
        assert!(
            Instant::now() < deadline,
            "no access line for the choices:\n{}",
            server.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let log = server.log();
    let lines: Vec<_> = log.lines().filter(|l| l.contains(accepted)).collect();
    assert_eq!(lines.len(), 1, "{log}");
    assert!(lines[0].contains(&counts), "{log}");
}

#[test]
fn a_request_id_names_the_response_its_header_and_its_log_line() {
    let server = Server::start(&[]);
    let auth = format!("Bearer {KEY}");
    let post = |path: &str, body: &Value, request_id: Option<&str>| {
        let mut headers = vec![("Authorization", auth.as_str()), ("Content-Type", "application/json")];
        headers.extend(request_id.map(|id| ("X-Request-Id", id)));
        let (status, head, body) =
            Server::response_with_head(server.send_with_headers("POST", path, Some(&body.to_string()), &headers));
        let header = head
            .lines()
            .find_map(|l| l.strip_prefix("x-request-id: "))
            .map(str::to_string);
        (status, header, body)
    };
    let asked = chat("hi", json!({"max_tokens": 2, "request_id": "agent-7.turn:3"}));
    let (status, header, body) = post("/v1/chat/completions", &asked, None);
    let body: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["id"], "chatcmpl-agent-7.turn:3");
    assert_eq!(header.as_deref(), Some("agent-7.turn:3"));
    let deadline = Instant::now() + PATIENCE;
    while !server.log().contains("request_id=agent-7.turn:3 prompt_tokens=") {
        assert!(
            Instant::now() < deadline,
            "no access line with the id:\n{}",
            server.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // The header wins over the body, as in vLLM; a stream's every chunk carries the id.
    let (_, header, body) = post("/v1/chat/completions", &asked, Some("from-header"));
    let body: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        (body["id"].as_str(), header.as_deref()),
        (Some("chatcmpl-from-header"), Some("from-header"))
    );
    let streamed = json!({"prompt": "ferries", "max_tokens": 3, "stream": true, "request_id": "s-1"});
    let (status, header, text) = post("/v1/completions", &streamed, None);
    assert_eq!((status, header.as_deref()), (200, Some("s-1")));
    let ids: Vec<Value> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str::<Value>(d).unwrap()["id"].clone())
        .collect();
    assert!(!ids.is_empty() && ids.iter().all(|id| id == "cmpl-s-1"), "{ids:?}");
    // Without one, a fresh id, the same in the body and the header.
    let (_, header, body) = post("/v1/chat/completions", &chat("hi", json!({"max_tokens": 1})), None);
    let body: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(body["id"], format!("chatcmpl-{}", header.unwrap()));
    let long = "x".repeat(129);
    for (body_id, header_id, param) in [
        (Some("two words"), None, "request_id"),
        (Some(""), None, "request_id"),
        (None, Some(long.as_str()), "X-Request-Id"),
    ] {
        let mut asked = chat("hi", json!({"max_tokens": 1}));
        if let Some(id) = body_id {
            asked["request_id"] = json!(id);
        }
        let (status, _, body) = post("/v1/chat/completions", &asked, header_id);
        let body: Value = serde_json::from_str(&body).unwrap();
        assert_eq!((status, body["error"]["param"].as_str()), (400, Some(param)), "{body}");
    }
}
