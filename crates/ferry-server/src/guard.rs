//! What a request passes before any handler sees it: the API key (when the operator set one), then JSON-only bodies.
//!
//! JSON-only is what keeps a web page from driving a server on the user's machine: a browser sends a cross-site POST
//! without asking first (a CORS preflight) only when its `Content-Type` is a "simple" one (text/plain, a form) or
//! absent. Requiring application/json forces the preflight, which this server never answers with CORS headers, so
//! the browser never sends the request. It applies with a key set too: every route takes JSON, so no client loses
//! anything, and the server behaves the same whatever the operator chose.
//!
//! Not here: validating the request body (params.rs), admission limits (openai/).

use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use subtle::ConstantTimeEq;

use crate::ApiError;

/// 401 unless the request carries `Authorization: Bearer KEY` or, as Anthropic's clients send it, `x-api-key: KEY`.
pub(crate) async fn require_api_key(State(key): State<String>, request: Request, next: Next) -> Response {
    let headers = request.headers();
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    let sent = bearer.or_else(|| headers.get("x-api-key").and_then(|v| v.to_str().ok()));
    if !sent.is_some_and(|sent| keys_match(sent, &key)) {
        return ApiError::unauthorized().into_response();
    }
    next.run(request).await
}

/// In time that depends on the lengths only, not on where the first differing byte is: an early exit would let a
/// client measure how much of a guess was right and find the key a byte at a time.
fn keys_match(sent: &str, key: &str) -> bool {
    sent.as_bytes().ct_eq(key.as_bytes()).into()
}

/// 415 for a POST whose body is not declared as JSON.
pub(crate) async fn require_json(request: Request, next: Next) -> Response {
    if request.method() == Method::POST && !is_json(request.headers().get(header::CONTENT_TYPE)) {
        return ApiError {
            status: StatusCode::UNSUPPORTED_MEDIA_TYPE,
            message: "the request body must be JSON, sent with `Content-Type: application/json`".into(),
            kind: "invalid_request_error",
            param: None,
            code: Some("unsupported_media_type"),
        }
        .into_response();
    }
    next.run(request).await
}

/// `application/json`, with or without parameters such as `; charset=utf-8`, in any case (media types are
/// case-insensitive).
fn is_json(content_type: Option<&HeaderValue>) -> bool {
    let Some(Ok(content_type)) = content_type.map(HeaderValue::to_str) else {
        return false;
    };
    let media_type = content_type
        .split_once(';')
        .map_or(content_type, |(media_type, _)| media_type);
    media_type.trim().eq_ignore_ascii_case("application/json")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_exact_key_matches() {
        let key = "sk-ferry-0123456789";
        assert!(keys_match(key, key));
        for wrong in [
            "",
            "sk-ferry-012345678",
            "sk-ferry-01234567890",
            "Sk-ferry-0123456789",
            "sk-ferry-0123456780",
        ] {
            assert!(!keys_match(wrong, key), "{wrong}");
        }
        assert!(!keys_match("anything", ""));
    }

    #[test]
    fn json_is_application_json_with_any_parameters_in_any_case() {
        let json = |value: &'static str| is_json(Some(&HeaderValue::from_static(value)));
        for yes in [
            "application/json",
            "application/json; charset=utf-8",
            " Application/JSON ;charset=UTF-8",
        ] {
            assert!(json(yes), "{yes}");
        }
        for no in [
            "text/plain",
            "application/x-www-form-urlencoded",
            "multipart/form-data; boundary=x",
            "",
            "application/jsonp",
            "application/json-seq",
            "text/json",
            "text/plain; application/json",
        ] {
            assert!(!json(no), "{no}");
        }
        assert!(!is_json(None));
        assert!(!is_json(Some(
            &HeaderValue::from_bytes(b"application/json\xff").unwrap()
        )));
    }
}
