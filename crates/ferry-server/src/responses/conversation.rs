//! A Responses request's `input` read into the template's conversation: a string is one user message; items
//! (messages of any role, an earlier turn's `function_call`s and their `function_call_output`s, and `reasoning`,
//! which joins the assistant output it led to) become chat messages in order, each mistake a 400 naming the item's
//! field (request.rs reads the rest of the body).

use ferry_core::loader::ChatMessage;
use serde_json::Value;

use super::request::required;
use super::tools::function_call;
use crate::body::{wrong_type, Body};
use crate::error::ApiError;

/// `input`: a string (one user message) or a non-empty array of items.
pub(super) fn input(body: &Body, keeps_reasoning: bool) -> Result<Vec<ChatMessage>, ApiError> {
    let items = match body.get("input") {
        Some(Value::String(text)) => return Ok(vec![ChatMessage::text("user", text)]),
        Some(Value::Array(_)) | None => body.nonempty_array("input", "a string or an array of input items")?,
        Some(other) => return Err(wrong_type("input", "a string or an array of input items", other)),
    };
    let mut history = History::default();
    for (index, item) in items.iter().enumerate() {
        history.add(&format!("input[{index}]"), item, keeps_reasoning)?;
    }
    match history.reasoning {
        Some(_) => Err(ApiError::invalid_param(
            &format!("input[{}]", items.len() - 1),
            "a `reasoning` item must be followed by the message or function call it led to",
        )),
        None => Ok(history.messages),
    }
}

/// The conversation as the templates read it, built item by item.
#[derive(Default)]
struct History {
    messages: Vec<ChatMessage>,
    /// A `reasoning` item's text, waiting for the assistant output it led to.
    reasoning: Option<String>,
}

impl History {
    fn add(&mut self, param: &str, item: &Value, keeps_reasoning: bool) -> Result<(), ApiError> {
        let item = nested(param, item)?;
        // The fields the items of a response carry, which a client sends back with them.
        item.string("id")?;
        item.string("status")?;
        match item.string("type")?.as_deref() {
            None | Some("message") => self.message(param, &item)?,
            Some("function_call") => {
                let call = function_call(&item)?;
                match (self.reasoning.take(), self.messages.last_mut()) {
                    // A call after the assistant's message (or an earlier call) of the same turn.
                    (None, Some(last)) if last.role == "assistant" => last.tool_calls.push(call),
                    (thinking, _) => self.messages.push(ChatMessage {
                        role: "assistant".into(),
                        tool_calls: vec![call],
                        thinking,
                        ..Default::default()
                    }),
                }
            }
            Some("function_call_output") => {
                self.no_reasoning_before(param)?;
                let call_id = item.string("call_id")?.ok_or_else(|| required(&item, "call_id"))?;
                let content = match item.get("output") {
                    Some(Value::String(text)) => text.clone(),
                    Some(Value::Array(parts)) => parts_text(&item.param("output"), parts, "input_text")?,
                    Some(other) => {
                        return Err(wrong_type(
                            &item.param("output"),
                            "a string or an array of parts",
                            other,
                        ))
                    }
                    None => return Err(required(&item, "output")),
                };
                self.messages.push(ChatMessage {
                    role: "tool".into(),
                    content,
                    tool_call_id: Some(call_id),
                    ..Default::default()
                });
            }
            Some("reasoning") => {
                let encrypted = match item.get("encrypted_content") {
                    None | Some(Value::Null) => None,
                    Some(Value::String(sealed)) => Some(super::output::unseal_reasoning(sealed).ok_or_else(|| {
                        ApiError::invalid_param(
                            &item.param("encrypted_content"),
                            "this `encrypted_content` was not written by this server, which can read only its own",
                        )
                    })?),
                    Some(other) => return Err(wrong_type(&item.param("encrypted_content"), "a string", other)),
                };
                let parts = |name: &str, part_type: &str| match item.get(name) {
                    Some(Value::Array(parts)) => parts_text(&item.param(name), parts, part_type),
                    Some(other) => Err(wrong_type(&item.param(name), "an array of parts", other)),
                    None => Ok(String::new()),
                };
                let (content, summary) = (parts("content", "reasoning_text")?, parts("summary", "summary_text")?);
                // Reasoning given back as a summary alone: the summary is what the model reasoned, in short.
                let text = match (encrypted, content.is_empty()) {
                    (Some(text), _) => text,
                    (None, true) => summary,
                    (None, false) => content,
                };
                if keeps_reasoning {
                    self.reasoning.get_or_insert_with(String::new).push_str(&text);
                }
            }
            Some(kind) => {
                return Err(ApiError::invalid_param(
                    &item.param("type"),
                    format!(
                        "`{}` is \"{}\": this server reads messages, `function_call`, `function_call_output` and \
                         `reasoning` items",
                        item.param("type"),
                        crate::error::quote(kind)
                    ),
                ))
            }
        }
        item.refuse_unread(&[])
    }

    /// A message item: `role` user, system, developer (a system message to the templates) or assistant, and
    /// `content` a string or text parts (`input_text`, or an assistant's `output_text`).
    fn message(&mut self, param: &str, item: &Body) -> Result<(), ApiError> {
        let role = match item.string("role")?.as_deref() {
            Some("user") => "user",
            Some("system" | "developer") => "system",
            Some("assistant") => "assistant",
            Some(_) => {
                return Err(ApiError::invalid_param(
                    &item.param("role"),
                    format!("`{param}.role` must be \"user\", \"system\", \"developer\" or \"assistant\""),
                ))
            }
            None => return Err(required(item, "role")),
        };
        let part_type = match role {
            "assistant" => "output_text",
            _ => "input_text",
        };
        let content = match item.get("content") {
            Some(Value::String(text)) => text.clone(),
            Some(Value::Array(parts)) => parts_text(&item.param("content"), parts, part_type)?,
            Some(other) => {
                return Err(wrong_type(
                    &item.param("content"),
                    "a string or an array of parts",
                    other,
                ))
            }
            None => return Err(required(item, "content")),
        };
        let thinking = match role {
            "assistant" => self.reasoning.take(),
            _ => {
                self.no_reasoning_before(param)?;
                None
            }
        };
        self.messages.push(ChatMessage {
            role: role.into(),
            content,
            thinking,
            ..Default::default()
        });
        Ok(())
    }

    fn no_reasoning_before(&self, param: &str) -> Result<(), ApiError> {
        match self.reasoning {
            Some(_) => Err(ApiError::invalid_param(
                param,
                "a `reasoning` item must be followed by the message or function call it led to",
            )),
            None => Ok(()),
        }
    }
}

/// The text of content parts, all of type `part_type` (an `output_text`'s annotations and logprobs describe an
/// earlier answer and are passed over); other parts (images, files, refusals) are refused by name.
fn parts_text(param: &str, parts: &[Value], part_type: &str) -> Result<String, ApiError> {
    parts
        .iter()
        .enumerate()
        .map(|(i, part)| {
            let part = nested(&format!("{param}[{i}]"), part)?;
            let text = match part.string("type")?.as_deref() {
                Some(kind) if kind == part_type => part.string("text")?.ok_or_else(|| required(&part, "text"))?,
                _ => {
                    return Err(ApiError::invalid_param(
                        &part.param("type"),
                        format!(
                            "`{}` must be \"{part_type}\": this server serves a text-only model",
                            part.param("type")
                        ),
                    ))
                }
            };
            part.refuse_unread(&["annotations", "logprobs"])?;
            Ok(text)
        })
        .collect()
}

/// The object at `param` as a [`Body`] of its own.
fn nested(param: &str, value: &Value) -> Result<Body, ApiError> {
    let fields = value.as_object().ok_or_else(|| wrong_type(param, "an object", value))?;
    Ok(Body::nested(fields.clone(), format!("{param}.")))
}
