//! `GET /v1/responses/{id}/input_items`: the input items a kept response's request sent, as OpenAI lists them, a
//! page at a time (`limit` 1 to 100, default 20; `order` `desc`, the default, or `asc`; `after` an item's id). Each
//! item is shown in its full shape: a message given as `{role, content: "text"}` becomes a `message` item whose
//! content is one `input_text` part (`output_text` for the assistant's), and an item sent without an id gets one
//! from the response's id and its place, the same on every call.

use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use crate::error::ApiError;
use crate::AppState;

/// Most items a page holds, and how many without `limit` (OpenAI's).
const MAX_LIMIT: usize = 100;
const DEFAULT_LIMIT: usize = 20;

/// The id prefix of an item of `kind` sent without an id.
fn id_prefix(kind: &str) -> &'static str {
    match kind {
        "message" => "msg",
        "function_call" => "fc",
        "function_call_output" => "fco",
        "reasoning" => "rs",
        _ => "item",
    }
}

/// Input item `index` of response `response` in its full shape, with its id.
fn listed(response: &str, index: usize, item: &Value) -> Value {
    let mut item = item.clone();
    let Some(fields) = item.as_object_mut() else {
        return item;
    };
    let kind = fields
        .get("type")
        .and_then(Value::as_str)
        .unwrap_or("message")
        .to_string();
    if kind == "message" {
        fields.insert("type".into(), "message".into());
        fields.entry("status").or_insert_with(|| "completed".into());
        if let Some(Value::String(text)) = fields.get("content") {
            let part = match fields.get("role").and_then(Value::as_str) {
                Some("assistant") => "output_text",
                _ => "input_text",
            };
            let parts = json!([{"type": part, "text": text}]);
            fields.insert("content".into(), parts);
        }
    }
    if !fields.get("id").is_some_and(Value::is_string) {
        let hex = response.trim_start_matches("resp_");
        fields.insert("id".into(), format!("{}_{hex}{index:04x}", id_prefix(&kind)).into());
    }
    item
}

/// A page of `items` (in their listed order) after the item with id `after`, `limit` long.
fn page(items: Vec<Value>, after: Option<&str>, limit: usize) -> Result<Value, ApiError> {
    let start = match after {
        None => 0,
        Some(after) => {
            let at = items.iter().position(|item| item["id"] == after).ok_or_else(|| {
                ApiError::invalid_param(
                    "after",
                    format!(
                        "`after` is \"{}\", which is not an input item of this response",
                        crate::error::quote(after)
                    ),
                )
            })?;
            at + 1
        }
    };
    let rest = &items[start.min(items.len())..];
    let data: Vec<Value> = rest.iter().take(limit).cloned().collect();
    let first_id = data.first().map(|item| item["id"].clone()).unwrap_or(Value::Null);
    let last_id = data.last().map(|item| item["id"].clone()).unwrap_or(Value::Null);
    Ok(
        json!({"object": "list", "data": data, "first_id": first_id, "last_id": last_id,
              "has_more": rest.len() > limit}),
    )
}

/// The query: `limit`, `order`, `after`; anything else (`include`: input items carry nothing to include) is a 400.
fn query(pairs: &[(String, String)]) -> Result<(usize, bool, Option<String>), ApiError> {
    let (mut limit, mut ascending, mut after) = (DEFAULT_LIMIT, false, None);
    for (name, value) in pairs {
        match name.as_str() {
            "limit" => {
                limit = value
                    .parse::<usize>()
                    .ok()
                    .filter(|n| (1..=MAX_LIMIT).contains(n))
                    .ok_or_else(|| {
                        ApiError::invalid_param(
                            "limit",
                            format!(
                                "`limit` must be between 1 and {MAX_LIMIT}, got \"{}\"",
                                crate::error::quote(value)
                            ),
                        )
                    })?
            }
            "order" => {
                ascending = match value.as_str() {
                    "asc" => true,
                    "desc" => false,
                    other => {
                        return Err(ApiError::invalid_param(
                            "order",
                            format!(
                                "`order` is \"{}\"; expected \"asc\" or \"desc\"",
                                crate::error::quote(other)
                            ),
                        ))
                    }
                }
            }
            "after" => after = Some(value.clone()),
            other => {
                return Err(ApiError::invalid_param(
                    other,
                    format!("`{}` is not supported by this server", crate::error::quote(other)),
                ))
            }
        }
    }
    Ok((limit, ascending, after))
}

/// `GET /v1/responses/{id}/input_items`.
pub async fn list(
    State(state): State<AppState>,
    Path(id): Path<String>,
    pairs: Result<Query<Vec<(String, String)>>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let listed_page = || -> Result<Value, ApiError> {
        let Query(pairs) = pairs.map_err(|e| ApiError::invalid_param("query", format!("the query string: {e}")))?;
        let (limit, ascending, after) = query(&pairs)?;
        let store = state.0.responses.lock().unwrap_or_else(|e| e.into_inner());
        let input = store.input(&id).ok_or_else(|| ApiError::not_found("response", &id))?;
        let mut items: Vec<Value> = input.iter().enumerate().map(|(i, item)| listed(&id, i, item)).collect();
        if !ascending {
            items.reverse();
        }
        page(items, after.as_deref(), limit)
    };
    match listed_page() {
        Ok(page) => Json(page).into_response(),
        Err(error) => error.into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn items_are_shown_whole_with_ids_stable_from_call_to_call() {
        let user = listed("resp_00ab", 0, &json!({"role": "user", "content": "hi"}));
        assert_eq!(
            user,
            json!({"type": "message", "role": "user", "status": "completed", "id": "msg_00ab0000",
                   "content": [{"type": "input_text", "text": "hi"}]})
        );
        let assistant = listed("resp_00ab", 1, &json!({"role": "assistant", "content": "yes"}));
        assert_eq!(assistant["content"][0]["type"], "output_text");
        let output = json!({"type": "function_call_output", "call_id": "c", "output": "sunny"});
        assert_eq!(listed("resp_00ab", 2, &output)["id"], "fco_00ab0002");
        let call = json!({"type": "function_call", "id": "fc_1", "call_id": "c", "name": "f", "arguments": "{}"});
        assert_eq!(
            listed("resp_00ab", 3, &call),
            call,
            "an item with an id is shown as sent"
        );
    }

    #[test]
    fn pages_follow_after_and_say_whether_more_remain() {
        let items: Vec<Value> = (0..5).map(|i| json!({"id": format!("msg_{i}")})).collect();
        let first = page(items.clone(), None, 2).unwrap();
        assert_eq!(
            (&first["first_id"], &first["last_id"], &first["has_more"]),
            (&json!("msg_0"), &json!("msg_1"), &json!(true))
        );
        let last = page(items.clone(), Some("msg_3"), 2).unwrap();
        assert_eq!(
            (last["data"].as_array().unwrap().len(), &last["has_more"]),
            (1, &json!(false))
        );
        let empty = page(items.clone(), Some("msg_4"), 2).unwrap();
        assert_eq!((&empty["data"], &empty["first_id"]), (&json!([]), &Value::Null));
        assert_eq!(
            page(items, Some("msg_9"), 2).unwrap_err().param.as_deref(),
            Some("after")
        );
    }

    #[test]
    fn the_query_is_read_field_by_field() {
        let pairs = |list: &[(&str, &str)]| -> Vec<(String, String)> {
            list.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
        };
        assert_eq!(query(&[]).unwrap(), (DEFAULT_LIMIT, false, None));
        assert_eq!(
            query(&pairs(&[("limit", "3"), ("order", "asc"), ("after", "msg_1")])).unwrap(),
            (3, true, Some("msg_1".into()))
        );
        for (bad, param) in [
            (("limit", "0"), "limit"),
            (("limit", "101"), "limit"),
            (("limit", "x"), "limit"),
            (("order", "up"), "order"),
            (("include", "message.output_text.logprobs"), "include"),
        ] {
            assert_eq!(
                query(&pairs(&[bad])).unwrap_err().param.as_deref(),
                Some(param),
                "{bad:?}"
            );
        }
    }
}
