//! The Responses API's tool fields read into the neutral tool request (tools/request.rs): `tools` (function tools,
//! flat: `{"type": "function", "name", "description", "parameters", "strict"}`), `tool_choice` (`auto`, `none`,
//! `required` or `{"type": "function", "name"}`), `parallel_tool_calls`, and an earlier turn's `function_call`
//! items. The chat route's rules apply (tools/request.rs reads them): `strict` is accepted only where `tool_choice`
//! forces calls, the one case in which constrained decoding enforces the schemas; the response's `tools` say whether
//! they were.

use ferry_core::loader::{FunctionCall, ToolCall};
use serde_json::{json, Map, Value};

use super::in_responses_terms;
use super::request::required;
use crate::body::{wrong_type, Body};
use crate::error::ApiError;
use crate::tools::request::ToolChoice;
use crate::tools::ToolRequest;

/// A function tool in the chat shape, its fields inside `function`, for the chat route's rules to read. Tools OpenAI
/// runs (web search, file search, ...) are refused: this server runs none.
fn chat_tool(index: usize, value: &Value) -> Result<Value, ApiError> {
    let param = format!("tools[{index}]");
    let mut fields = value
        .as_object()
        .ok_or_else(|| wrong_type(&param, "an object", value))?
        .clone();
    // Null is absent here, as everywhere in a request; the template renders what is left.
    fields.retain(|_, value| !value.is_null());
    match fields.remove("type") {
        Some(Value::String(kind)) if kind == "function" => Ok(json!({"type": "function", "function": fields})),
        Some(Value::String(kind)) => Err(ApiError::invalid_param(
            &format!("{param}.type"),
            format!(
                "`{param}.type` is \"{}\"; this server serves function tools only",
                crate::error::quote(&kind)
            ),
        )),
        Some(other) => Err(wrong_type(&format!("{param}.type"), "a string", &other)),
        None => Err(ApiError::invalid_param(
            &format!("{param}.type"),
            format!("`{param}.type` is required"),
        )),
    }
}

/// A named `tool_choice` in the chat shape (`{"type": "function", "function": {"name"}}`).
fn chat_choice(choice: &Value) -> Value {
    let Some(fields) = choice.as_object() else {
        return choice.clone();
    };
    let mut fields = fields.clone();
    let mut function = Map::new();
    if let Some(name) = fields.remove("name") {
        function.insert("name".into(), name);
    }
    fields.insert("function".into(), function.into());
    Value::Object(fields)
}

/// `tools`, `tool_choice` and `parallel_tool_calls`, read by the chat route's rules (tools/request.rs) from their
/// chat-shaped equivalents, errors named as this API names the fields; and the response's echo of them.
pub fn tool_request(body: &Body) -> Result<(ToolRequest, Map<String, Value>), ApiError> {
    let mut chat = Map::new();
    if let Some(tools) = body.get("tools") {
        let tools = match tools {
            Value::Array(tools) => tools
                .iter()
                .enumerate()
                .map(|(i, tool)| chat_tool(i, tool))
                .collect::<Result<Vec<_>, _>>()?
                .into(),
            other => other.clone(),
        };
        chat.insert("tools".into(), tools);
    }
    if let Some(choice) = body.get("tool_choice") {
        chat.insert("tool_choice".into(), chat_choice(choice));
    }
    if let Some(parallel) = body.get("parallel_tool_calls") {
        chat.insert("parallel_tool_calls".into(), parallel.clone());
    }
    let request = ToolRequest::parse(&Body::new(chat)).map_err(in_responses_terms)?;
    let enforced = request.choice.forces_calls();
    let echoed_choice = match &request.choice {
        ToolChoice::Auto => json!("auto"),
        ToolChoice::None => json!("none"),
        ToolChoice::Required => json!("required"),
        ToolChoice::Function(name) => json!({"type": "function", "name": name}),
    };
    let echoed_tools: Vec<Value> = request
        .tools
        .iter()
        .map(|tool| {
            json!({"type": "function", "name": tool.name, "description": tool.definition["function"].get("description"),
                   "parameters": tool.parameters, "strict": enforced})
        })
        .collect();
    let mut echo = Map::new();
    echo.insert("tools".into(), echoed_tools.into());
    echo.insert("tool_choice".into(), echoed_choice);
    echo.insert("parallel_tool_calls".into(), request.parallel_calls.into());
    Ok((request, echo))
}

/// A `function_call` item of an earlier turn: `call_id`, `name` and `arguments` (JSON text holding an object, kept as
/// sent: tools/history.rs gives the template the form it reads).
pub fn function_call(item: &Body) -> Result<ToolCall, ApiError> {
    let id = item.string("call_id")?.ok_or_else(|| required(item, "call_id"))?;
    let name = item.string("name")?.ok_or_else(|| required(item, "name"))?;
    let arguments = item.string("arguments")?.ok_or_else(|| required(item, "arguments"))?;
    if !matches!(serde_json::from_str(&arguments), Ok(Value::Object(_))) {
        let param = item.param("arguments");
        return Err(ApiError::invalid_param(
            &param,
            format!("`{param}` must be a JSON object (as a string)"),
        ));
    }
    Ok(ToolCall {
        id,
        function: FunctionCall {
            name,
            arguments: arguments.into(),
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(value: Value) -> Result<(ToolRequest, Map<String, Value>), ApiError> {
        tool_request(&Body::new(value.as_object().unwrap().clone()))
    }

    fn weather(strict: Value) -> Value {
        json!({"type": "function", "name": "get_weather", "description": "d", "strict": strict,
               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}})
    }

    #[test]
    fn function_tools_reach_the_template_and_the_echo_says_whether_schemas_were_enforced() {
        let (request, echo) = parse(json!({"tools": [weather(json!(null))], "parallel_tool_calls": false})).unwrap();
        assert_eq!(
            request.template_tools(),
            vec![
                json!({"type": "function", "function": {"name": "get_weather", "description": "d",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}})
            ]
        );
        assert!(!request.parallel_calls);
        assert_eq!(echo["tool_choice"], "auto");
        assert_eq!(echo["tools"][0]["strict"], false);
        let named = json!({"type": "function", "name": "get_weather"});
        let (forced, echo) = parse(json!({"tools": [weather(json!(true))], "tool_choice": named})).unwrap();
        assert_eq!(forced.choice, ToolChoice::Function("get_weather".into()));
        assert_eq!(echo["tool_choice"], named);
        assert_eq!(echo["tools"][0]["strict"], true);
    }

    #[test]
    fn every_bad_tool_field_is_named() {
        for (body, param) in [
            (json!({"tools": {}}), "tools"),
            (json!({"tools": [{"type": "web_search"}]}), "tools[0].type"),
            (json!({"tools": [{"name": "f"}]}), "tools[0].type"),
            (json!({"tools": [{"type": "function"}]}), "tools[0].name"),
            (json!({"tools": [{"type": "function", "name": "a b"}]}), "tools[0].name"),
            (json!({"tools": [weather(json!(true))]}), "tools[0].strict"),
            (
                json!({"tools": [weather(json!(null)), weather(json!(null))]}),
                "tools[1].name",
            ),
            (
                json!({"tools": [{"type": "function", "name": "f", "x": 1}]}),
                "tools[0].x",
            ),
            (
                json!({"tools": [{"type": "function", "name": "f", "parameters": []}]}),
                "tools[0].parameters",
            ),
            (
                json!({"tools": [weather(json!(null))], "tool_choice": {"type": "function"}}),
                "tool_choice.name",
            ),
            (json!({"tool_choice": "required"}), "tool_choice"),
            (json!({"tool_choice": "always"}), "tool_choice"),
            (json!({"tool_choice": {"type": "file_search"}}), "tool_choice.type"),
            (
                json!({"tools": [weather(json!(null))], "tool_choice": {"type": "function", "name": "g"}}),
                "tool_choice.name",
            ),
            (json!({"parallel_tool_calls": "yes"}), "parallel_tool_calls"),
        ] {
            assert_eq!(parse(body.clone()).unwrap_err().param.as_deref(), Some(param), "{body}");
        }
    }
}
