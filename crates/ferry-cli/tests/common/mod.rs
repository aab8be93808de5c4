//! What the tests of `ferry serve` share: a server on the bundled fixture on a free port, and raw HTTP/1.1 requests
//! to it (status and de-chunked body), so each test sees exactly what a client gets.
#![allow(dead_code)] // Each test binary uses its own part of these helpers.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

pub const KEY: &str = "test-key";

/// The bundled fixture most tests run on.
pub const FIXTURE: &str = "qwen3_moe";

/// A fixture's directory under tests/fixtures.
pub fn fixture(name: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

/// The `ferry` binary run to its end with `args`.
pub fn ferry(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_ferry"))
        .args(args)
        .output()
        .expect("run ferry")
}

/// A `ferry serve` process on a free port; killed when dropped.
pub struct Server {
    pub child: Child,
    pub address: String,
    log: Arc<Mutex<String>>,
}

impl Server {
    /// `ferry serve` on the fixture with the API key `KEY` and these options.
    pub fn start(extra: &[&str]) -> Server {
        Server::start_without_key(&[&["--api-key", KEY], extra].concat())
    }

    pub fn start_without_key(extra: &[&str]) -> Server {
        let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen3_moe");
        Server::start_serving(&[&["--model", fixture.to_str().unwrap()], extra].concat())
    }

    /// `ferry serve` with these model arguments (and options).
    pub fn start_serving(model: &[&str]) -> Server {
        let mut child = Command::new(env!("CARGO_BIN_EXE_ferry"))
            .args(["serve", "--port", "0"])
            .args(model)
            .args(["--served-model-name", "tiny"])
            // stderr is a pipe: the log must come without colour codes whatever the environment says.
            .env_remove("NO_COLOR")
            .stderr(Stdio::piped())
            .spawn()
            .expect("start ferry serve");
        let log = Arc::new(Mutex::new(String::new()));
        let (address_tx, address_rx) = std::sync::mpsc::channel();
        let stderr = child.stderr.take().unwrap();
        let sink = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(at) = line.find("listening on http://") {
                    let rest = &line[at + "listening on http://".len()..];
                    let _ = address_tx.send(rest.split_whitespace().next().unwrap().to_string());
                }
                let mut log = sink.lock().unwrap();
                log.push_str(&line);
                log.push('\n');
            }
        });
        let address = address_rx
            .recv_timeout(Duration::from_secs(30))
            .unwrap_or_else(|_| panic!("ferry serve did not start:\n{}", log.lock().unwrap()));
        let server = Server { child, address, log };
        let deadline = Instant::now() + Duration::from_secs(30);
        while server.get("/health", None).0 != 200 {
            assert!(Instant::now() < deadline, "never ready:\n{}", server.log());
            std::thread::sleep(Duration::from_millis(20));
        }
        server
    }

    pub fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    pub fn send(&self, method: &str, path: &str, body: Option<&str>, key: Option<&str>) -> TcpStream {
        self.send_typed(method, path, body, key, Some("application/json"))
    }

    /// A request with this `Content-Type` (none if `None`).
    pub fn send_typed(
        &self,
        method: &str,
        path: &str,
        body: Option<&str>,
        key: Option<&str>,
        content_type: Option<&str>,
    ) -> TcpStream {
        let auth = key.map(|k| format!("Bearer {k}"));
        let headers: Vec<(&str, &str)> = [("Authorization", auth.as_deref()), ("Content-Type", content_type)]
            .into_iter()
            .filter_map(|(name, value)| Some((name, value?)))
            .collect();
        self.send_with_headers(method, path, body, &headers)
    }

    /// A request with exactly these headers (besides Host, Content-Length and Connection).
    pub fn send_with_headers(
        &self,
        method: &str,
        path: &str,
        body: Option<&str>,
        headers: &[(&str, &str)],
    ) -> TcpStream {
        let mut stream = TcpStream::connect(&self.address).unwrap();
        let body = body.unwrap_or("");
        let headers: String = headers
            .iter()
            .map(|(name, value)| format!("{name}: {value}\r\n"))
            .collect();
        write!(
            stream,
            "{method} {path} HTTP/1.1\r\nHost: test\r\n{headers}\
             Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        stream
    }

    /// Status and (de-chunked) body.
    pub fn request(&self, method: &str, path: &str, body: Option<&str>, key: Option<&str>) -> (u16, String) {
        Server::response(self.send(method, path, body, key))
    }

    /// A POST with this `Content-Type` (none if `None`): status and body.
    pub fn post_typed(&self, path: &str, body: &Value, key: Option<&str>, content_type: Option<&str>) -> (u16, String) {
        Server::response(self.send_typed("POST", path, Some(&body.to_string()), key, content_type))
    }

    /// Status and (de-chunked) body.
    pub fn response(stream: TcpStream) -> (u16, String) {
        let (status, _, body) = Server::response_with_head(stream);
        (status, body)
    }

    /// Status, head (status line and headers) and (de-chunked) body.
    pub fn response_with_head(mut stream: TcpStream) -> (u16, String, String) {
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).unwrap();
        let raw = String::from_utf8(raw).unwrap();
        let (head, body) = raw.split_once("\r\n\r\n").unwrap();
        let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
        let body = match head.to_ascii_lowercase().contains("transfer-encoding: chunked") {
            true => dechunk(body),
            false => body.to_string(),
        };
        (status, head.to_string(), body)
    }

    pub fn get(&self, path: &str, key: Option<&str>) -> (u16, String) {
        self.request("GET", path, None, key)
    }

    pub fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let (status, text) = self.request("POST", path, Some(&body.to_string()), Some(KEY));
        let value = serde_json::from_str(&text).unwrap_or(Value::String(text));
        (status, value)
    }

    /// The `data:` payloads of a streamed response.
    pub fn post_stream(&self, path: &str, body: &Value) -> Vec<String> {
        let (status, text) = self.request("POST", path, Some(&body.to_string()), Some(KEY));
        assert_eq!(status, 200, "{text}");
        text.lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .map(str::to_string)
            .collect()
    }

    /// The chunks of `request`'s chat answer streamed with a usage chunk, checked to end with `[DONE]`.
    pub fn streamed_with_usage(&self, request: &Value) -> Vec<Value> {
        let mut streamed = request.clone();
        streamed["stream"] = json!(true);
        streamed["stream_options"] = json!({"include_usage": true});
        let events = self.post_stream("/v1/chat/completions", &streamed);
        assert_eq!(events.last().unwrap(), "[DONE]");
        events[..events.len() - 1]
            .iter()
            .map(|e| serde_json::from_str(e).unwrap())
            .collect()
    }

    pub fn metric(&self, name: &str) -> f64 {
        let (_, text) = self.get("/metrics", Some(KEY));
        text.lines()
            .find_map(|l| l.strip_prefix(name).and_then(|v| v.trim().parse().ok()))
            .unwrap_or_else(|| panic!("no {name} in\n{text}"))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A server-sent event stream whose events are named by their data's `type` (Anthropic's, Responses'):
/// (event name, data), each checked.
pub fn named_events(text: &str) -> Vec<(String, Value)> {
    let mut out = vec![];
    let mut name = None;
    for line in text.lines() {
        if let Some(event) = line.strip_prefix("event: ") {
            name = Some(event.to_string());
        } else if let Some(data) = line.strip_prefix("data: ") {
            let data: Value = serde_json::from_str(data).unwrap();
            let name = name.take().expect("every data line has its event line");
            assert_eq!(data["type"], name.as_str(), "the event name is the data's type");
            out.push((name, data));
        }
    }
    out
}

pub fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let size = usize::from_str_radix(size.trim(), 16).unwrap();
        if size == 0 {
            break;
        }
        out.push_str(&rest[..size]);
        body = &rest[size + 2..];
    }
    out
}

pub fn chat(content: &str, extra: Value) -> Value {
    let mut body = json!({"model": "tiny", "messages": [{"role": "user", "content": content}]});
    body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    body
}
