//! OpenAI-style error responses: `{"error": {"message", "type", "param", "code"}}` with the matching status, for
//! every error the server answers: the handlers' own, and those axum writes as plain text or empty (405, 413, a
//! body that could not be read), which [`json_errors`] rewrites. (hyper's answers to heads it cannot parse are
//! rewritten by conn_io.rs.)
//!
//! A rendered [`ApiError`] also stays in its response's extensions: a layer on another API's routes (Anthropic's
//! `/v1/messages`) can take it from there and write that API's shape instead.
//!
//! Messages never echo unbounded input: [`quote`] shortens what a message repeats of the request, and the message
//! itself is capped when rendered.

use std::borrow::Cow;

use axum::extract::Request;
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;

/// Longest part of the caller's input an error message repeats.
const QUOTED_CHARS: usize = 64;

/// Longest message an error carries, whatever put it together.
const MESSAGE_CHARS: usize = 1024;

/// At most [`QUOTED_CHARS`] characters of `input`, with "…" when it was longer.
pub fn quote(input: &str) -> Cow<'_, str> {
    shorten(input, QUOTED_CHARS)
}

fn shorten(text: &str, chars: usize) -> Cow<'_, str> {
    match text.char_indices().nth(chars) {
        Some((cut, _)) => Cow::Owned(format!("{}…", &text[..cut])),
        None => Cow::Borrowed(text),
    }
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{message}")]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ApiError {
    /// An error of any status, typed as OpenAI types them: the server's fault for 5xx, the caller's otherwise.
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
            kind: match status.is_server_error() {
                true => "server_error",
                false => "invalid_request_error",
            },
            param: None,
            code: None,
        }
    }

    /// 400: the request is malformed or asks for something impossible.
    pub fn invalid(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: None,
            code: None,
        }
    }

    /// 400 about one named field.
    pub fn invalid_param(param: &str, message: impl Into<String>) -> Self {
        ApiError {
            param: Some(param.to_string()),
            ..Self::invalid(message)
        }
    }

    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    pub fn unauthorized() -> Self {
        ApiError {
            status: StatusCode::UNAUTHORIZED,
            message: "invalid API key: send it as `Authorization: Bearer KEY`".into(),
            kind: "authentication_error",
            param: None,
            code: Some("invalid_api_key"),
        }
    }

    pub fn model_not_found(requested: &str, served: &str) -> Self {
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!(
                "the model `{}` does not exist; this server serves `{served}`",
                quote(requested)
            ),
            kind: "invalid_request_error",
            param: Some("model".into()),
            code: Some("model_not_found"),
        }
    }

    /// 404 for an object this server does not have (`what`, e.g. "response", `id`).
    pub fn not_found(what: &str, id: &str) -> Self {
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!("no {what} with id `{}` is kept", quote(id)),
            kind: "invalid_request_error",
            param: None,
            code: None,
        }
    }

    /// 503: no room now; the client may retry.
    pub fn unavailable(message: impl Into<String>, code: &'static str) -> Self {
        ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: Some(code),
        }
    }

    /// 500: the engine failed this request.
    pub fn internal(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: None,
        }
    }

    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({
            "error": {
                "message": shorten(&self.message, MESSAGE_CHARS),
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, Json(self.body())).into_response();
        if self.status == StatusCode::SERVICE_UNAVAILABLE {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        response.extensions_mut().insert(self);
        response
    }
}

/// Rewrites an error response that is not JSON (axum's plain-text or empty ones) as an [`ApiError`], keeping its
/// status and headers such as `Allow`. JSON ones (an `ApiError`, /health's 503 while loading) pass as they are.
pub(crate) async fn json_errors(request: Request, next: Next) -> Response {
    let method = request.method().clone();
    let path = request.uri().path().to_string();
    let response = next.run(request).await;
    let status = response.status();
    let json = response.headers().get(header::CONTENT_TYPE) == Some(&HeaderValue::from_static("application/json"));
    if !(status.is_client_error() || status.is_server_error()) || json {
        return response;
    }
    let (mut parts, body) = response.into_parts();
    let error = match status {
        StatusCode::METHOD_NOT_ALLOWED => {
            let allowed = parts.headers.get(header::ALLOW).and_then(|v| v.to_str().ok());
            ApiError::new(
                status,
                format!(
                    "{} is not allowed on {}; allowed: {}",
                    quote(method.as_str()),
                    quote(&path),
                    allowed.unwrap_or("none")
                ),
            )
            .with_code("method_not_allowed")
        }
        StatusCode::PAYLOAD_TOO_LARGE => ApiError::new(
            status,
            format!(
                "the request body is larger than the limit of {} bytes",
                crate::MAX_REQUEST_BYTES
            ),
        )
        .with_code("request_too_large"),
        _ => {
            // axum's rejections say what went wrong in a short text of their own.
            let text = axum::body::to_bytes(body, MESSAGE_CHARS).await.unwrap_or_default();
            let text = String::from_utf8_lossy(&text);
            let message = match text.trim() {
                "" => status.canonical_reason().unwrap_or("error").to_lowercase(),
                text => text.to_string(),
            };
            ApiError::new(status, message)
        }
    };
    parts.headers.remove(header::CONTENT_TYPE);
    parts.headers.remove(header::CONTENT_LENGTH);
    let mut response = error.into_response();
    for (name, value) in &parts.headers {
        response.headers_mut().entry(name).or_insert(value.clone());
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quotes_and_messages_are_bounded() {
        assert_eq!(quote("short"), "short");
        let long = "é".repeat(100_000);
        let quoted = quote(&long);
        assert_eq!(quoted.chars().count(), QUOTED_CHARS + 1);
        assert!(quoted.ends_with('…'));
        let error = ApiError::model_not_found(&long, "tiny");
        assert!(error.message.chars().count() < 200, "{}", error.message);
        let body = ApiError::invalid(long).body().to_string();
        assert!(
            body.chars().count() < MESSAGE_CHARS + 100,
            "{} chars",
            body.chars().count()
        );
    }

    #[test]
    fn a_rendered_error_stays_in_the_response_for_another_api_to_reshape() {
        let error = ApiError::invalid_param("max_tokens", "too many");
        let response = error.clone().into_response();
        assert_eq!(response.extensions().get::<ApiError>(), Some(&error));
    }
}
