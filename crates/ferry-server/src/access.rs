//! One log line per request (target `ferry::access`), rejected ones included: method, path, status, latency, the
//! request id its answer carries (the `X-Request-Id` response header of chat and text completions), and for a
//! generation its prompt and completion tokens and how it ended. The line is written when the response body
//! is done (a stream's last event, or the client hanging up), so a stream's latency is the whole of it.
//!
//! The generation handlers report their counts through [`record_generation`], which finds the request's record in
//! a task-local set around the handler and around every poll of its response body.

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::http::{Method, StatusCode};
use axum::middleware::Next;
use axum::response::Response;
use http_body::{Body as HttpBody, Frame, SizeHint};

use crate::error::quote;

/// What a generation reports of itself.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Generation {
    outcome: &'static str,
    prompt_tokens: usize,
    completion_tokens: usize,
}

type Record = Arc<Mutex<Option<Generation>>>;

tokio::task_local! {
    static RECORD: Record;
}

/// Notes how the current request's generation ended (stop, length, cancelled, error) and its token counts. The
/// choices of one response (OpenAI's `n`) add up: the prompt once, every choice's completion, the last outcome.
pub(crate) fn record_generation(outcome: &'static str, prompt_tokens: usize, completion_tokens: usize) {
    let _ = RECORD.try_with(|record| {
        let mut record = record.lock().unwrap_or_else(|e| e.into_inner());
        let earlier = record.unwrap_or_default();
        *record = Some(Generation {
            outcome,
            prompt_tokens,
            completion_tokens: earlier.completion_tokens + completion_tokens,
        });
    });
}

pub(crate) async fn log_requests(request: Request, next: Next) -> Response {
    let line = Line {
        method: request.method().clone(),
        path: quote(request.uri().path()).into_owned(),
        status: StatusCode::OK,
        request_id: None,
        started: Instant::now(),
        record: Record::default(),
    };
    let response = RECORD.scope(line.record.clone(), next.run(request)).await;
    let line = Line {
        status: response.status(),
        request_id: response
            .headers()
            .get(crate::openai::REQUEST_ID_HEADER)
            .map(|id| quote(&String::from_utf8_lossy(id.as_bytes())).into_owned()),
        ..line
    };
    response.map(|body| Body::new(LoggedBody { body: Some(body), line }))
}

struct Line {
    method: Method,
    path: String,
    status: StatusCode,
    request_id: Option<String>,
    started: Instant,
    record: Record,
}

impl Line {
    fn write(&self) {
        let seconds = self.started.elapsed().as_secs_f64();
        let (method, path, status) = (&self.method, &self.path, self.status.as_u16());
        let id = self
            .request_id
            .as_ref()
            .map(|id| format!(" request_id={id}"))
            .unwrap_or_default();
        match *self.record.lock().unwrap_or_else(|e| e.into_inner()) {
            Some(g) => tracing::info!(
                target: "ferry::access",
                "{method} {path} {status} {seconds:.3}s{id} prompt_tokens={} completion_tokens={} outcome={}",
                g.prompt_tokens,
                g.completion_tokens,
                g.outcome
            ),
            None => tracing::info!(target: "ferry::access", "{method} {path} {status} {seconds:.3}s{id}"),
        }
    }
}

/// The response body, polled and dropped inside the request's record scope; writes the line when dropped.
struct LoggedBody {
    /// None only while being dropped.
    body: Option<Body>,
    line: Line,
}

impl HttpBody for LoggedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let this = &mut *self;
        let Some(body) = this.body.as_mut() else {
            return Poll::Ready(None);
        };
        RECORD.sync_scope(this.line.record.clone(), || Pin::new(body).poll_frame(cx))
    }

    fn is_end_stream(&self) -> bool {
        self.body.as_ref().is_none_or(Body::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        self.body.as_ref().map_or(SizeHint::with_exact(0), Body::size_hint)
    }
}

impl Drop for LoggedBody {
    fn drop(&mut self) {
        // A generation cut short by the client records itself as cancelled while its stream is dropped.
        let body = self.body.take();
        RECORD.sync_scope(self.line.record.clone(), || drop(body));
        self.line.write();
    }
}
