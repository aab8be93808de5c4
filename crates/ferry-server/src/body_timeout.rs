//! The body read timeout: a request's body must arrive in full within a set time of its head, or the request is
//! answered 408 and its connection closed, so a client trickling a body a byte at a time cannot hold a handler (and
//! the memory of the body so far) for long.
//!
//! Not here: timeouts between requests and on heads (connections.rs).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http_body::{Body as HttpBody, Frame, SizeHint};
use tokio::time::{Instant, Sleep};

use crate::error::ApiError;

/// Gives the request's body `timeout` from now; answers 408 if it ran out before the body was read.
pub(crate) async fn limit_body_time(State(timeout): State<Duration>, request: Request, next: Next) -> Response {
    let timed_out = Arc::new(AtomicBool::new(false));
    let request = request.map(|body| {
        Body::new(TimedBody {
            body,
            deadline: Box::pin(tokio::time::sleep_until(Instant::now() + timeout)),
            timed_out: timed_out.clone(),
        })
    });
    let response = next.run(request).await;
    if !timed_out.load(Ordering::Acquire) {
        return response;
    }
    let mut response = ApiError::new(
        StatusCode::REQUEST_TIMEOUT,
        format!("the request body did not arrive within {} s", timeout.as_secs_f64()),
    )
    .with_code("request_timeout")
    .into_response();
    // What is left of the body is never read, so the connection cannot carry another request.
    response
        .headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    response
}

/// A request body that fails once its deadline passes.
struct TimedBody {
    body: Body,
    deadline: Pin<Box<Sleep>>,
    timed_out: Arc<AtomicBool>,
}

#[derive(Debug, thiserror::Error)]
#[error("the request body did not arrive in time")]
struct BodyTimedOut;

impl HttpBody for TimedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        if let Poll::Ready(frame) = Pin::new(&mut self.body).poll_frame(cx) {
            return Poll::Ready(frame);
        }
        match self.deadline.as_mut().poll(cx) {
            Poll::Ready(()) => {
                self.timed_out.store(true, Ordering::Release);
                Poll::Ready(Some(Err(axum::Error::new(BodyTimedOut))))
            }
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}
