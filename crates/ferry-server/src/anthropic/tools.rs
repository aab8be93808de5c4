//! Anthropic's tool fields read into the neutral tool request (tools/request.rs): `tools` (client tools with an
//! `input_schema`) as the template's function definitions, `tool_choice` (`auto`, `none`, and `any` and a named
//! `tool`, forced by constrained decoding as OpenAI's `required` and named function are) with
//! `disable_parallel_tool_use`, and the
//! history's `tool_use` blocks (an assistant's calls) and `tool_result` blocks (a user's answers, which become
//! `tool` messages as the templates expect).

use ferry_core::loader::{FunctionCall, ToolCall};
use serde_json::{json, Map, Value};

use crate::body::{wrong_type, Body};
use crate::error::ApiError;
use crate::tools::request::{check_name, ToolChoice};
use crate::tools::{ToolRequest, ToolSpec};

fn required(body: &Body, name: &str) -> ApiError {
    let param = body.param(name);
    ApiError::invalid_param(&param, format!("`{param}` is required"))
}

/// An object in the request at `param`, read field by field.
pub fn nested(param: &str, value: &Value) -> Result<Body, ApiError> {
    let fields = value.as_object().ok_or_else(|| wrong_type(param, "an object", value))?;
    Ok(Body::nested(fields.clone(), format!("{param}.")))
}

/// One client tool: `{"name", "description", "input_schema"}`; Anthropic's server tools (web search, code
/// execution, ...) run at Anthropic, and are refused.
fn tool_spec(index: usize, value: &Value) -> Result<ToolSpec, ApiError> {
    let param = format!("tools[{index}]");
    let tool = nested(&param, value)?;
    if let Some(kind) = tool.string("type")?.filter(|kind| kind != "custom") {
        return Err(ApiError::invalid_param(
            &tool.param("type"),
            format!(
                "`{param}.type` is \"{}\", a tool Anthropic runs; this server runs none",
                kind.chars().take(64).collect::<String>()
            ),
        ));
    }
    let name = tool.string("name")?.ok_or_else(|| required(&tool, "name"))?;
    check_name(&tool.param("name"), &name)?;
    let schema = Value::Object(
        tool.object("input_schema")?
            .ok_or_else(|| required(&tool, "input_schema"))?
            .clone(),
    );
    let mut function = Map::new();
    function.insert("name".into(), name.clone().into());
    if let Some(description) = tool.string("description")? {
        function.insert("description".into(), description.into());
    }
    function.insert("parameters".into(), schema.clone());
    Ok(ToolSpec {
        name,
        parameters: schema,
        definition: json!({"type": "function", "function": function}),
    })
}

/// `tools` and `tool_choice`.
pub fn tool_request(body: &Body) -> Result<ToolRequest, ApiError> {
    let tools = match body.get("tools") {
        None => vec![],
        Some(Value::Array(tools)) => tools
            .iter()
            .enumerate()
            .map(|(i, tool)| tool_spec(i, tool))
            .collect::<Result<_, _>>()?,
        Some(other) => return Err(wrong_type("tools", "an array of tools", other)),
    };
    let mut request = ToolRequest {
        tools,
        ..ToolRequest::default()
    };
    if let Some(choice) = body.get("tool_choice") {
        let choice = nested("tool_choice", choice)?;
        request.choice = match choice.string("type")?.as_deref() {
            Some("auto") => ToolChoice::Auto,
            Some("none") => ToolChoice::None,
            Some("any") => ToolChoice::Required,
            Some("tool") => ToolChoice::Function(choice.string("name")?.ok_or_else(|| required(&choice, "name"))?),
            _ => {
                return Err(ApiError::invalid_param(
                    "tool_choice.type",
                    "`tool_choice.type` must be \"auto\", \"none\", \"any\" or \"tool\"",
                ))
            }
        };
        request.parallel_calls = !choice.boolean("disable_parallel_tool_use")?;
        request.check_choice("tool_choice.name")?;
    }
    Ok(request)
}

/// A `tool_use` block of an assistant message: `{"id", "name", "input"}`.
pub fn tool_use(block: &Body) -> Result<ToolCall, ApiError> {
    let id = block.string("id")?.ok_or_else(|| required(block, "id"))?;
    let name = block.string("name")?.ok_or_else(|| required(block, "name"))?;
    let arguments = Value::Object(block.object("input")?.cloned().unwrap_or_default());
    Ok(ToolCall {
        id,
        function: FunctionCall { name, arguments },
    })
}

/// A `tool_result` block of a user message: the call it answers and its content (a string or text blocks).
pub fn tool_result(block: &Body) -> Result<(String, String), ApiError> {
    let id = block
        .string("tool_use_id")?
        .ok_or_else(|| required(block, "tool_use_id"))?;
    let content = match block.get("content") {
        None => String::new(),
        Some(Value::String(text)) => text.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .enumerate()
            .map(|(i, part)| {
                let part = nested(&block.param(&format!("content[{i}]")), part)?;
                match part.string("type")?.as_deref() {
                    Some("text") => part.string("text")?.ok_or_else(|| required(&part, "text")),
                    _ => Err(ApiError::invalid_param(
                        &part.param("type"),
                        "a tool result holds text blocks only: this server serves a text-only model",
                    )),
                }
            })
            .collect::<Result<Vec<_>, _>>()?
            .join("\n"),
        Some(other) => {
            return Err(wrong_type(
                &block.param("content"),
                "a string or an array of text blocks",
                other,
            ))
        }
    };
    Ok((id, content))
}
