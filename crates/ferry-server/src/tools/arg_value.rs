//! Arguments written as bare text, one value per parameter (the XML formats of Qwen3-Coder/Qwen3.5 and GLM-4.5):
//! each value becomes the JSON value the tool's schema asks for.

use serde_json::Value;

use super::ToolSpec;

/// The arguments' text piece for parameter `name` of `tool` written as `raw` (the `position`th parameter): its
/// value as the parameter's schema asks, after the object's opening brace or a comma.
pub fn argument_fragment(position: usize, raw: &str, tool: Option<&ToolSpec>, name: &str) -> String {
    let schema = tool.and_then(|t| t.parameters.get("properties")?.get(name));
    let separator = if position == 0 { "{" } else { "," };
    format!("{separator}{}:{}", Value::from(name), convert(raw, schema))
}

/// The piece that closes the arguments after `written` parameters.
pub fn arguments_end(written: usize) -> &'static str {
    if written == 0 {
        "{}"
    } else {
        "}"
    }
}

/// A parameter's text as the JSON value its schema asks for; text that does not read as any of the schema's
/// types stays a string, as does a parameter the schema does not describe.
fn convert(raw: &str, schema: Option<&Value>) -> Value {
    let types: Vec<&str> = match schema.and_then(|s| s.get("type")) {
        Some(Value::String(t)) => vec![t.as_str()],
        Some(Value::Array(list)) => list.iter().filter_map(Value::as_str).collect(),
        _ => vec![],
    };
    for kind in types {
        let value = match kind {
            "string" => Some(Value::from(raw)),
            "integer" => raw.trim().parse::<i64>().ok().map(Value::from),
            "number" => match raw.trim().parse::<i64>() {
                Ok(n) => Some(Value::from(n)),
                Err(_) => raw
                    .trim()
                    .parse::<f64>()
                    .ok()
                    .and_then(|x| serde_json::Number::from_f64(x).map(Value::Number)),
            },
            "boolean" => match raw.trim().to_ascii_lowercase().as_str() {
                "true" => Some(Value::Bool(true)),
                "false" => Some(Value::Bool(false)),
                _ => None,
            },
            "null" => (raw.trim() == "null").then_some(Value::Null),
            "object" => serde_json::from_str(raw).ok().filter(Value::is_object),
            "array" => serde_json::from_str(raw).ok().filter(Value::is_array),
            _ => None,
        };
        if let Some(value) = value {
            return value;
        }
    }
    Value::from(raw)
}
