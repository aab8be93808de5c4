//! A connection's socket as hyper sees it: tells the connection when a request's first bytes arrive (its header
//! timeout starts then), and turns hyper's own answers to a head it cannot parse (400, 414 URI too long, 431
//! headers too large: empty bodies, written before any handler runs) into the same OpenAI-style JSON errors the
//! handlers write, logged like every other request.
//!
//! hyper offers no hook for those answers, so they are recognised here: written while a head is being read (no
//! handler called), with a 4xx status and an empty body, which no handler's error has.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use axum::http::StatusCode;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

use crate::connections::Connection;
use crate::error::ApiError;

pub(crate) struct WatchedIo {
    stream: TcpStream,
    connection: Arc<Connection>,
    /// The JSON answer written in place of hyper's, and how much of it is written.
    replacement: Option<(Vec<u8>, usize)>,
}

impl WatchedIo {
    pub(crate) fn new(stream: TcpStream, connection: Arc<Connection>) -> Self {
        WatchedIo {
            stream,
            connection,
            replacement: None,
        }
    }

    /// Writes what is left of the replacement answer.
    fn poll_replacement(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if let Some((bytes, written)) = &mut self.replacement {
            while *written < bytes.len() {
                match ready!(Pin::new(&mut self.stream).poll_write(cx, &bytes[*written..]))? {
                    0 => return Poll::Ready(Err(io::ErrorKind::WriteZero.into())),
                    n => *written += n,
                }
            }
        }
        Poll::Ready(Ok(()))
    }
}

impl AsyncRead for WatchedIo {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let read = Pin::new(&mut self.stream).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.connection.on_bytes_read();
        }
        read
    }
}

impl AsyncWrite for WatchedIo {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        if self.replacement.is_none() && self.connection.is_reading_head() {
            if let Some(status) = hyper_error_status(buf) {
                self.replacement = Some((json_answer(status), 0));
            }
        }
        if self.replacement.is_some() {
            // hyper's bytes are dropped: the connection closes after this answer.
            ready!(self.poll_replacement(cx))?;
            return Poll::Ready(Ok(buf.len()));
        }
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        ready!(self.poll_replacement(cx))?;
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        ready!(self.poll_replacement(cx))?;
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

/// The status of the answer hyper writes to a head it could not parse: a whole head with a 4xx status and
/// `content-length: 0`.
fn hyper_error_status(written: &[u8]) -> Option<StatusCode> {
    let head = std::str::from_utf8(written).ok()?.split("\r\n\r\n").next()?;
    let mut lines = head.split("\r\n");
    let status = lines.next()?.strip_prefix("HTTP/1.")?.get(2..5)?;
    let status = StatusCode::from_bytes(status.as_bytes()).ok()?;
    let empty = lines.any(|line| line.eq_ignore_ascii_case("content-length: 0"));
    (status.is_client_error() && empty).then_some(status)
}

/// A whole HTTP/1.1 response carrying the JSON error for `status`, closing the connection.
fn json_answer(status: StatusCode) -> Vec<u8> {
    let (message, code) = match status {
        StatusCode::URI_TOO_LONG => ("the request's URI is too long", "uri_too_long"),
        StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE => (
            "the request's headers are too large or too many",
            "request_header_fields_too_large",
        ),
        _ => ("the request is not valid HTTP/1.1", "malformed_request"),
    };
    let error = ApiError::new(status, message).with_code(code);
    tracing::info!(target: "ferry::access", "- - {}", status.as_u16());
    let body = error.body().to_string();
    format!(
        "HTTP/1.1 {} {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        status.as_u16(),
        status.canonical_reason().unwrap_or(""),
        body.len()
    )
    .into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_whole_empty_4xx_heads_are_taken_for_hypers_own_answers() {
        let hyper =
            |status: &str| format!("HTTP/1.1 {status}\r\nconnection: close\r\ncontent-length: 0\r\ndate: x\r\n\r\n");
        assert_eq!(
            hyper_error_status(hyper("431 Request Header Fields Too Large").as_bytes()),
            Some(StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE)
        );
        assert_eq!(
            hyper_error_status(hyper("400 Bad Request").as_bytes()),
            Some(StatusCode::BAD_REQUEST)
        );
        for not_hypers in [
            hyper("200 OK"),
            "HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: 91\r\n\r\n{}".into(),
            "0\r\n\r\n".into(),
            "{\"error\": 1}".into(),
        ] {
            assert_eq!(hyper_error_status(not_hypers.as_bytes()), None, "{not_hypers}");
        }
    }

    #[test]
    fn the_answer_is_a_json_error_that_closes_the_connection() {
        let answer = String::from_utf8(json_answer(StatusCode::URI_TOO_LONG)).unwrap();
        let (head, body) = answer.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 414 URI Too Long\r\n"), "{head}");
        assert!(head.contains("connection: close") && head.contains(&format!("content-length: {}", body.len())));
        let error: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(error["error"]["code"], "uri_too_long");
        assert_eq!(error["error"]["type"], "invalid_request_error");
    }
}
