//! A JSON request body read field by field, so that every mistake is a 400 that names the field (`param`) and says
//! what was expected, and so that a field nobody read can be refused: a request never gets a 200 for a field the
//! server silently ignored.
//!
//! Not here: what the fields of a protocol mean (params.rs for OpenAI, anthropic/ for Anthropic).

use std::cell::RefCell;
use std::collections::BTreeSet;

use serde_json::{Map, Value};

use crate::error::ApiError;

/// A request body (or an object inside one), remembering which fields were read.
pub struct Body {
    fields: Map<String, Value>,
    /// Where this object sits in the request (`"messages[2]."`), prefixed to the field names errors give.
    path: String,
    read: RefCell<BTreeSet<String>>,
}

pub fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

pub fn wrong_type(name: &str, expected: &str, got: &Value) -> ApiError {
    ApiError::invalid_param(name, format!("`{name}` must be {expected}, got {}", type_name(got)))
}

impl Body {
    /// The body as a JSON object, or a 400 that says why not.
    pub fn parse(bytes: &[u8]) -> Result<Body, ApiError> {
        match serde_json::from_slice::<Value>(bytes) {
            Ok(Value::Object(fields)) => Ok(Body::new(fields)),
            Ok(other) => Err(ApiError::invalid(format!(
                "the request body must be a JSON object, got {}",
                type_name(&other)
            ))),
            Err(e) => Err(ApiError::invalid(format!("the request body is not valid JSON: {e}"))),
        }
    }

    pub fn new(fields: Map<String, Value>) -> Body {
        Body::nested(fields, String::new())
    }

    /// An object found at `path` (ending in `.`) inside a request.
    pub fn nested(fields: Map<String, Value>, path: String) -> Body {
        Body {
            fields,
            path,
            read: RefCell::default(),
        }
    }

    /// This object with `name` set to `value`, nothing of it read yet.
    pub fn with(&self, name: &str, value: Value) -> Body {
        let mut fields = self.fields.clone();
        fields.insert(name.into(), value);
        Body::nested(fields, self.path.clone())
    }

    /// How errors name the field `name` of this object.
    pub fn param(&self, name: &str) -> String {
        format!("{}{name}", self.path)
    }

    /// A field's value as sent (null included).
    pub fn raw(&self, name: &str) -> Option<&Value> {
        self.read.borrow_mut().insert(name.to_string());
        self.fields.get(name)
    }

    /// A field's value; null counts as absent.
    pub fn get(&self, name: &str) -> Option<&Value> {
        self.raw(name).filter(|v| !v.is_null())
    }

    pub fn number(&self, name: &str) -> Result<Option<f64>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| wrong_type(&self.param(name), "a number", v)),
        }
    }

    pub fn number_in(&self, name: &str, low: f64, high: f64) -> Result<Option<f32>, ApiError> {
        match self.number(name)? {
            Some(x) if !(low..=high).contains(&x) => {
                let param = self.param(name);
                Err(ApiError::invalid_param(
                    &param,
                    format!("`{param}` must be between {low} and {high}, got {x}"),
                ))
            }
            x => Ok(x.map(|x| x as f32)),
        }
    }

    pub fn integer(&self, name: &str) -> Result<Option<i64>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(v) => match (v.as_i64(), v.as_u64()) {
                (Some(i), _) => Ok(Some(i)),
                (None, Some(_)) => {
                    let param = self.param(name);
                    Err(ApiError::invalid_param(&param, format!("`{param}` is too large")))
                }
                _ => Err(wrong_type(&self.param(name), "an integer", v)),
            },
        }
    }

    /// A count that must be at least 1.
    pub fn positive(&self, name: &str) -> Result<Option<usize>, ApiError> {
        match self.integer(name)? {
            Some(n) if n < 1 => {
                let param = self.param(name);
                Err(ApiError::invalid_param(
                    &param,
                    format!("`{param}` must be at least 1, got {n}"),
                ))
            }
            n => Ok(n.map(|n| n as usize)),
        }
    }

    pub fn boolean(&self, name: &str) -> Result<bool, ApiError> {
        match self.get(name) {
            None => Ok(false),
            Some(Value::Bool(b)) => Ok(*b),
            Some(v) => Err(wrong_type(&self.param(name), "a boolean", v)),
        }
    }

    pub fn string(&self, name: &str) -> Result<Option<String>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(v) => Err(wrong_type(&self.param(name), "a string", v)),
        }
    }

    /// An array of strings; `one_string_too` accepts a lone string as a list of one (OpenAI's `stop`).
    pub fn strings(&self, name: &str, one_string_too: bool) -> Result<Vec<String>, ApiError> {
        let expected = match one_string_too {
            true => "a string or an array of strings",
            false => "an array of strings",
        };
        match self.get(name) {
            None => Ok(vec![]),
            Some(Value::String(s)) if one_string_too => Ok(vec![s.clone()]),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| match v {
                    Value::String(s) => Ok(s.clone()),
                    other => Err(wrong_type(&self.param(name), expected, other)),
                })
                .collect(),
            Some(other) => Err(wrong_type(&self.param(name), expected, other)),
        }
    }

    /// A required, non-empty array; `expected` says of what (`"an array of messages"`).
    pub fn nonempty_array(&self, name: &str, expected: &str) -> Result<&Vec<Value>, ApiError> {
        let param = self.param(name);
        match self.get(name) {
            None => Err(ApiError::invalid_param(&param, format!("`{param}` is required"))),
            Some(Value::Array(list)) if list.is_empty() => {
                Err(ApiError::invalid_param(&param, format!("`{param}` must not be empty")))
            }
            Some(Value::Array(list)) => Ok(list),
            Some(other) => Err(wrong_type(&param, expected, other)),
        }
    }

    pub fn object(&self, name: &str) -> Result<Option<&Map<String, Value>>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Object(fields)) => Ok(Some(fields)),
            Some(other) => Err(wrong_type(&self.param(name), "an object", other)),
        }
    }

    /// A 400 naming the first field (in name order) that was sent, not null, never read and not in `no_action`
    /// (fields that by their nature ask nothing of the server).
    pub fn refuse_unread(&self, no_action: &[&str]) -> Result<(), ApiError> {
        let read = self.read.borrow();
        let unread = self
            .fields
            .iter()
            .find(|(name, value)| !value.is_null() && !read.contains(*name) && !no_action.contains(&name.as_str()));
        match unread {
            None => Ok(()),
            Some((name, _)) => {
                let param = self.param(name);
                Err(ApiError::invalid_param(
                    &param,
                    format!("`{param}` is not supported by this server"),
                ))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn body(value: Value) -> Body {
        Body::new(value.as_object().unwrap().clone())
    }

    #[test]
    fn a_field_sent_but_never_read_is_refused_by_name() {
        let sent = body(json!({"a": 1, "b": null, "c": true, "d": "x"}));
        sent.integer("a").unwrap();
        let error = sent.refuse_unread(&[]).unwrap_err();
        assert_eq!(error.param.as_deref(), Some("c"), "null counts as not sent");
        assert_eq!(sent.refuse_unread(&["c"]).unwrap_err().param.as_deref(), Some("d"));
        sent.string("d").unwrap();
        sent.boolean("c").unwrap();
        sent.refuse_unread(&[]).unwrap();
        let inner = Body::nested(json!({"x": "1"}).as_object().unwrap().clone(), "outer[0].".into());
        assert_eq!(inner.integer("x").unwrap_err().param.as_deref(), Some("outer[0].x"));
        let inner = Body::nested(json!({"y": 1}).as_object().unwrap().clone(), "outer.".into());
        assert_eq!(inner.refuse_unread(&[]).unwrap_err().param.as_deref(), Some("outer.y"));
    }

    #[test]
    fn malformed_json_is_a_400() {
        let message = |bytes: &[u8]| Body::parse(bytes).err().unwrap().message;
        assert!(message(b"{\"a\":").contains("not valid JSON"));
        assert!(message(b"[1]").contains("JSON object"));
    }
}
