//! The tool fields of a chat request, read field by field like params.rs (a 400 naming the field): OpenAI's
//! `tools`, `tool_choice` and `parallel_tool_calls`, and the tool calls and tool results of the history.
//!
//! What ferry does with them: the definitions go to the chat template as transformers' `tools=` passes them and
//! the output is parsed for calls (`auto`); `none` leaves the tools out of the prompt and parses nothing, so no
//! call can come back (vLLM's `--exclude-tools-when-tool-choice-none`); `required` and a named function force
//! calls by constrained decoding (forced.rs), which enforces the tools' schemas, so `strict` is accepted there and
//! refused under `auto`, where nothing would enforce it. OpenAI's `allowed_tools` narrows the calls to some of the
//! tools: in `required` mode the grammar takes only those (every tool still rendered), in `auto` mode only those
//! are rendered and parsed.

use ferry_core::loader::{FunctionCall, ToolCall};
use serde_json::{Map, Value};

use super::{ToolCallFormat, ToolCallParser};
use crate::body::{wrong_type, Body};
use crate::error::ApiError;

/// Longest tool name accepted (Anthropic's limit; OpenAI's is 64).
const MAX_NAME_CHARS: usize = 128;

/// One tool a request offers.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolSpec {
    pub name: String,
    /// The JSON schema of the arguments (`{}` when the definition has none).
    pub parameters: Value,
    /// The definition as the client sent it, which the template renders.
    pub definition: Value,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolChoice {
    Auto,
    None,
    /// At least one call, of any tool offered.
    Required,
    /// Calls of this tool only.
    Function(String),
    /// OpenAI's `allowed_tools`: only these tools may be called; `required`: at least one call (as "required"),
    /// else the model may also answer in text (as "auto").
    Allowed {
        names: Vec<String>,
        required: bool,
    },
}

impl ToolChoice {
    /// Whether the output must be tool calls (constrained decoding sees to it).
    pub fn forces_calls(&self) -> bool {
        matches!(
            self,
            ToolChoice::Required | ToolChoice::Function(_) | ToolChoice::Allowed { required: true, .. }
        )
    }
}

/// A request's tools and what the model may do with them.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolRequest {
    pub tools: Vec<ToolSpec>,
    pub choice: ToolChoice,
    pub parallel_calls: bool,
}

impl Default for ToolRequest {
    fn default() -> Self {
        ToolRequest {
            tools: vec![],
            choice: ToolChoice::Auto,
            parallel_calls: true,
        }
    }
}

/// A name a template can write and a parser can read back: letters, digits, `_`, `-`, `.`, `:`.
pub(crate) fn check_name(param: &str, name: &str) -> Result<(), ApiError> {
    let valid = !name.is_empty()
        && name.chars().count() <= MAX_NAME_CHARS
        && name.chars().all(|c| c.is_ascii_alphanumeric() || "_-.:".contains(c));
    match valid {
        true => Ok(()),
        false => Err(ApiError::invalid_param(
            param,
            format!("`{param}` must be 1 to {MAX_NAME_CHARS} letters, digits, `_`, `-`, `.` or `:`"),
        )),
    }
}

/// The object at `param` as a [`Body`] of its own, so that its fields are checked and its unknown ones refused.
fn nested(param: &str, value: &Value) -> Result<Body, ApiError> {
    match value {
        Value::Object(fields) => Ok(Body::nested(fields.clone(), format!("{param}."))),
        other => Err(wrong_type(param, "an object", other)),
    }
}

fn required<T>(body: &Body, name: &str, value: Option<T>) -> Result<T, ApiError> {
    let param = body.param(name);
    value.ok_or_else(|| ApiError::invalid_param(&param, format!("`{param}` is required")))
}

/// The function a `{"type": "function", "function": {"name": ...}}` object names (a named `tool_choice`, or a tool
/// of `allowed_tools`), its function's other fields refused; the object's own fields are the caller's to check.
fn named_function(object: &Body) -> Result<String, ApiError> {
    check_function_type(object)?;
    let function = required(object, "function", object.get("function"))?;
    let function = nested(&object.param("function"), function)?;
    let name = required(&function, "name", function.string("name")?)?;
    function.refuse_unread(&[])?;
    Ok(name)
}

/// `type` is optional but, when given, must be "function".
fn check_function_type(body: &Body) -> Result<(), ApiError> {
    match body.string("type")?.as_deref() {
        None | Some("function") => Ok(()),
        Some(_) => {
            let param = body.param("type");
            Err(ApiError::invalid_param(
                &param,
                format!("`{param}` must be \"function\", the only tool type ferry serves"),
            ))
        }
    }
}

/// `tool_choice: {"type": "allowed_tools", "allowed_tools": {"mode": "auto" | "required", "tools": [{"type":
/// "function", "function": {"name"}}, ...]}}` (OpenAI's), each name once.
fn allowed_tools(choice: &Body) -> Result<ToolChoice, ApiError> {
    choice.string("type")?;
    let allowed = required(choice, "allowed_tools", choice.get("allowed_tools"))?;
    let allowed = nested(&choice.param("allowed_tools"), allowed)?;
    let required_calls = match required(&allowed, "mode", allowed.string("mode")?)?.as_str() {
        "auto" => false,
        "required" => true,
        other => {
            let param = allowed.param("mode");
            return Err(ApiError::invalid_param(
                &param,
                format!(
                    "`{param}` is \"{}\"; expected \"auto\" or \"required\"",
                    crate::error::quote(other)
                ),
            ));
        }
    };
    let param = allowed.param("tools");
    let tools = match allowed.get("tools") {
        Some(Value::Array(tools)) if !tools.is_empty() => tools,
        Some(Value::Array(_)) | None => {
            return Err(ApiError::invalid_param(
                &param,
                format!("`{param}` must name at least one tool"),
            ))
        }
        Some(other) => return Err(wrong_type(&param, "an array of tools", other)),
    };
    let mut names: Vec<String> = vec![];
    for (i, tool) in tools.iter().enumerate() {
        let tool = nested(&format!("{param}[{i}]"), tool)?;
        let name = named_function(&tool)?;
        tool.refuse_unread(&[])?;
        if names.contains(&name) {
            let param = format!("{}.name", tool.param("function"));
            return Err(ApiError::invalid_param(
                &param,
                format!("`{param}`: `{name}` is allowed twice"),
            ));
        }
        names.push(name);
    }
    allowed.refuse_unread(&[])?;
    choice.refuse_unread(&[])?;
    Ok(ToolChoice::Allowed {
        names,
        required: required_calls,
    })
}

impl ToolSpec {
    #[cfg(test)]
    /// A tool offered by name and schema, in transformers' `{"type": "function", "function": {...}}` shape.
    pub fn function(name: &str, description: Option<&str>, parameters: Value) -> Self {
        let mut function = Map::new();
        function.insert("name".into(), name.into());
        if let Some(description) = description {
            function.insert("description".into(), description.into());
        }
        function.insert("parameters".into(), parameters.clone());
        let mut definition = Map::new();
        definition.insert("type".into(), "function".into());
        definition.insert("function".into(), function.into());
        ToolSpec {
            name: name.into(),
            parameters,
            definition: definition.into(),
        }
    }

    /// The tool and whether it asks for `strict` schema adherence.
    fn parse(index: usize, value: &Value) -> Result<(Self, bool), ApiError> {
        let tool = nested(&format!("tools[{index}]"), value)?;
        check_function_type(&tool)?;
        let function = required(&tool, "function", tool.get("function"))?;
        let function = nested(&tool.param("function"), function)?;
        let name = required(&function, "name", function.string("name")?)?;
        check_name(&function.param("name"), &name)?;
        // Read to check its type; the template renders it from `definition`.
        function.string("description")?;
        let parameters = Value::Object(function.object("parameters")?.cloned().unwrap_or_default());
        let strict = function.boolean("strict")?;
        function.refuse_unread(&[])?;
        tool.refuse_unread(&[])?;
        let spec = ToolSpec {
            name,
            parameters,
            definition: value.clone(),
        };
        Ok((spec, strict))
    }
}

impl ToolRequest {
    /// `tools`, `tool_choice` and `parallel_tool_calls` of an OpenAI chat request.
    pub fn parse(body: &Body) -> Result<Self, ApiError> {
        let (tools, strict): (Vec<ToolSpec>, Vec<bool>) = match body.get("tools") {
            None => (vec![], vec![]),
            Some(Value::Array(list)) => list
                .iter()
                .enumerate()
                .map(|(i, tool)| ToolSpec::parse(i, tool))
                .collect::<Result<Vec<_>, _>>()?
                .into_iter()
                .unzip(),
            Some(other) => return Err(wrong_type("tools", "an array of tools", other)),
        };
        for (i, tool) in tools.iter().enumerate() {
            if tools[..i].iter().any(|t| t.name == tool.name) {
                return Err(ApiError::invalid_param(
                    &format!("tools[{i}].function.name"),
                    format!("two tools are named `{}`", tool.name),
                ));
            }
        }
        let choice = match body.get("tool_choice") {
            None => ToolChoice::Auto,
            Some(Value::String(choice)) if choice == "auto" => ToolChoice::Auto,
            Some(Value::String(choice)) if choice == "none" => ToolChoice::None,
            Some(Value::String(choice)) if choice == "required" => ToolChoice::Required,
            Some(choice @ Value::Object(fields)) if fields.get("type") == Some(&Value::from("allowed_tools")) => {
                allowed_tools(&nested("tool_choice", choice)?)?
            }
            Some(choice @ Value::Object(_)) => {
                let choice = nested("tool_choice", choice)?;
                let name = named_function(&choice)?;
                choice.refuse_unread(&[])?;
                ToolChoice::Function(name)
            }
            Some(_) => {
                return Err(ApiError::invalid_param(
                    "tool_choice",
                    "`tool_choice` must be \"auto\", \"none\", \"required\", {\"type\": \"function\", \
                     \"function\": {\"name\": ...}} or {\"type\": \"allowed_tools\", \"allowed_tools\": {...}}",
                ))
            }
        };
        let parallel_calls = match body.get("parallel_tool_calls") {
            None => true,
            Some(Value::Bool(parallel)) => *parallel,
            Some(other) => return Err(wrong_type("parallel_tool_calls", "a boolean", other)),
        };
        if let Some(i) = strict
            .iter()
            .position(|&strict| strict)
            .filter(|_| !choice.forces_calls())
        {
            let param = format!("tools[{i}].function.strict");
            return Err(ApiError::invalid_param(
                &param,
                format!(
                    "`{param}`: ferry enforces tool schemas only when `tool_choice` is \"required\" or names a \
                     function"
                ),
            ));
        }
        let request = ToolRequest {
            tools,
            choice,
            parallel_calls,
        };
        request.check_choice("tool_choice.function.name")?;
        Ok(request)
    }

    /// A forced choice needs tools, and a named one must be among them; `name_param` is where a protocol names it.
    pub fn check_choice(&self, name_param: &str) -> Result<(), ApiError> {
        match &self.choice {
            ToolChoice::Required if self.tools.is_empty() => Err(ApiError::invalid_param(
                "tool_choice",
                "`tool_choice` requires a tool call, but the request offers no `tools`",
            )),
            ToolChoice::Function(name) if !self.tools.iter().any(|t| &t.name == name) => Err(ApiError::invalid_param(
                name_param,
                format!("`{name_param}`: no tool named `{name}` is offered in `tools`"),
            )),
            ToolChoice::Allowed { names, .. } => {
                match names.iter().position(|n| !self.tools.iter().any(|t| &t.name == n)) {
                    Some(i) => {
                        let param = format!("tool_choice.allowed_tools.tools[{i}].function.name");
                        Err(ApiError::invalid_param(
                            &param,
                            format!("`{param}`: no tool named `{}` is offered in `tools`", names[i]),
                        ))
                    }
                    None => Ok(()),
                }
            }
            _ => Ok(()),
        }
    }

    /// The tools the model may call: those `allowed_tools` names, else all offered.
    fn callable(&self) -> Vec<&ToolSpec> {
        match &self.choice {
            ToolChoice::Allowed { names, .. } => self.tools.iter().filter(|t| names.contains(&t.name)).collect(),
            _ => self.tools.iter().collect(),
        }
    }

    /// The definitions the chat template renders: none under `tool_choice: none`; under `allowed_tools` in `auto`
    /// mode only the allowed ones (nothing else keeps the model from calling the others; in `required` mode the
    /// grammar does, and all are rendered); all of them otherwise (a named function included, as vLLM renders them).
    pub fn template_tools(&self) -> Vec<Value> {
        let tools = match self.choice {
            ToolChoice::None => vec![],
            ToolChoice::Allowed { required: false, .. } => self.callable(),
            _ => self.tools.iter().collect(),
        };
        tools.into_iter().map(|t| t.definition.clone()).collect()
    }

    /// The parser for this request's output, of calls of the callable tools: none without tools, under
    /// `tool_choice: none`, or without a format.
    pub fn parser(&self, format: Option<ToolCallFormat>) -> Option<ToolCallParser> {
        match (self.choice != ToolChoice::None && !self.tools.is_empty(), format) {
            (true, Some(format)) => {
                let callable = self.callable().into_iter().cloned().collect();
                Some(ToolCallParser::new(format, callable, self.parallel_calls))
            }
            _ => None,
        }
    }

    /// The tools forced calls may be of: the named function, the allowed ones, or all.
    pub fn forced_tools(&self) -> Vec<&ToolSpec> {
        match &self.choice {
            ToolChoice::Function(name) => self.tools.iter().filter(|t| &t.name == name).collect(),
            _ => self.callable(),
        }
    }
}

/// A message's `tool_calls` (OpenAI's shape): each call's `arguments`, a JSON string in OpenAI's API (an object is
/// taken too), checked to hold an object and kept as sent (history.rs gives the template the form it reads).
pub fn parse_tool_calls(message: &Body) -> Result<Vec<ToolCall>, ApiError> {
    let param = message.param("tool_calls");
    let calls = match message.get("tool_calls") {
        None => return Ok(vec![]),
        Some(Value::Array(calls)) => calls,
        Some(other) => return Err(wrong_type(&param, "an array of tool calls", other)),
    };
    calls
        .iter()
        .enumerate()
        .map(|(j, call)| {
            let call = nested(&format!("{param}[{j}]"), call)?;
            check_function_type(&call)?;
            let id = required(&call, "id", call.string("id")?)?;
            let function = required(&call, "function", call.get("function"))?;
            let function = nested(&call.param("function"), function)?;
            let name = required(&function, "name", function.string("name")?)?;
            let arguments_param = function.param("arguments");
            let arguments = match function.get("arguments") {
                None => Value::Object(Map::new()),
                Some(arguments @ Value::Object(_)) => arguments.clone(),
                Some(Value::String(text)) => match serde_json::from_str(text) {
                    Ok(Value::Object(_)) => text.as_str().into(),
                    _ => {
                        return Err(ApiError::invalid_param(
                            &arguments_param,
                            format!("`{arguments_param}` must be a JSON object (as a string)"),
                        ))
                    }
                },
                Some(other) => return Err(wrong_type(&arguments_param, "a string holding a JSON object", other)),
            };
            function.refuse_unread(&[])?;
            call.refuse_unread(&[])?;
            Ok(ToolCall {
                id,
                function: FunctionCall { name, arguments },
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(body: Value) -> Result<ToolRequest, ApiError> {
        ToolRequest::parse(&Body::new(body.as_object().unwrap().clone()))
    }

    fn read_calls(calls: Value) -> Result<Vec<ToolCall>, ApiError> {
        let message = json!({"role": "assistant", "tool_calls": calls});
        parse_tool_calls(&Body::nested(
            message.as_object().unwrap().clone(),
            "messages[1].".into(),
        ))
    }

    fn weather() -> Value {
        json!({"type": "function", "function": {"name": "get_weather", "description": "d",
               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}})
    }

    #[test]
    fn allowed_tools_restrict_the_calls_and_in_auto_mode_the_prompt() {
        let clock = json!({"type": "function", "function": {"name": "get_time", "parameters": {}}});
        let allowed = |mode: &str, names: &[&str]| {
            let tools: Vec<Value> = names
                .iter()
                .map(|n| json!({"type": "function", "function": {"name": n}}))
                .collect();
            json!({"tools": [weather(), clock.clone()],
                   "tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": mode, "tools": tools}}})
        };
        let auto = parse(allowed("auto", &["get_weather"])).unwrap();
        assert_eq!(
            auto.choice,
            ToolChoice::Allowed {
                names: vec!["get_weather".into()],
                required: false
            }
        );
        assert!(!auto.choice.forces_calls());
        assert_eq!(
            auto.template_tools(),
            vec![weather()],
            "only the allowed ones are offered"
        );
        let required = parse(allowed("required", &["get_time"])).unwrap();
        assert!(required.choice.forces_calls());
        assert_eq!(
            required.template_tools().len(),
            2,
            "the grammar restricts: every tool is rendered"
        );
        let forced: Vec<&str> = required.forced_tools().iter().map(|t| t.name.as_str()).collect();
        assert_eq!(forced, ["get_time"]);
        for (body, param) in [
            (allowed("sometimes", &["get_time"]), "tool_choice.allowed_tools.mode"),
            (allowed("auto", &[]), "tool_choice.allowed_tools.tools"),
            (
                allowed("auto", &["get_time", "get_time"]),
                "tool_choice.allowed_tools.tools[1].function.name",
            ),
            (
                allowed("auto", &["get_date"]),
                "tool_choice.allowed_tools.tools[0].function.name",
            ),
            (
                json!({"tools": [weather()], "tool_choice": {"type": "allowed_tools"}}),
                "tool_choice.allowed_tools",
            ),
        ] {
            assert_eq!(parse(body.clone()).unwrap_err().param.as_deref(), Some(param), "{body}");
        }
    }

    #[test]
    fn tools_are_read_and_rendered_as_sent() {
        let request = parse(json!({"tools": [weather()], "parallel_tool_calls": false})).unwrap();
        assert_eq!(request.tools[0].name, "get_weather");
        assert_eq!(request.tools[0].parameters["properties"]["city"]["type"], "string");
        assert_eq!(request.template_tools(), vec![weather()]);
        assert!(!request.parallel_calls);
        assert!(request.parser(Some(ToolCallFormat::Hermes)).is_some());
        assert!(request.parser(None).is_none());
        let none = parse(json!({"tools": [weather()], "tool_choice": "none"})).unwrap();
        assert!(none.template_tools().is_empty());
        assert!(none.parser(Some(ToolCallFormat::Hermes)).is_none());
        assert_eq!(parse(json!({})).unwrap(), ToolRequest::default());
        let required = parse(json!({"tools": [weather()], "tool_choice": "required"})).unwrap();
        assert_eq!(required.choice, ToolChoice::Required);
        assert_eq!(required.template_tools(), vec![weather()]);
        assert!(required.parser(Some(ToolCallFormat::Hermes)).is_some());
        let mut strict = weather();
        strict["function"]["strict"] = json!(true);
        let named = json!({"type": "function", "function": {"name": "get_weather"}});
        let named = parse(json!({"tools": [strict], "tool_choice": named})).unwrap();
        assert_eq!(named.choice, ToolChoice::Function("get_weather".into()));
        assert_eq!(
            ToolSpec::function("get_weather", Some("d"), weather()["function"]["parameters"].clone()),
            request.tools[0]
        );
    }

    #[test]
    fn every_bad_tool_field_is_named() {
        let cases = [
            (json!({"tools": {}}), "tools"),
            (json!({"tools": [3]}), "tools[0]"),
            (
                json!({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}),
                "tools[0].type",
            ),
            (json!({"tools": [{"type": "function"}]}), "tools[0].function"),
            (json!({"tools": [{"function": {}}]}), "tools[0].function.name"),
            (
                json!({"tools": [{"function": {"name": "a b"}}]}),
                "tools[0].function.name",
            ),
            (
                json!({"tools": [{"function": {"name": "f", "description": 1}}]}),
                "tools[0].function.description",
            ),
            (
                json!({"tools": [{"function": {"name": "f", "parameters": []}}]}),
                "tools[0].function.parameters",
            ),
            (
                json!({"tools": [{"function": {"name": "f", "strict": true}}]}),
                "tools[0].function.strict",
            ),
            (json!({"tool_choice": "required"}), "tool_choice"),
            (
                json!({"tools": [weather()], "tool_choice": {"type": "function", "function": {"name": "f"}}}),
                "tool_choice.function.name",
            ),
            (
                json!({"tools": [weather()], "tool_choice": {"type": "function"}}),
                "tool_choice.function",
            ),
            (
                json!({"tools": [weather()], "tool_choice": {"function": {"name": "get_weather", "x": 1}}}),
                "tool_choice.function.x",
            ),
            (
                json!({"tools": [{"function": {"name": "f", "strict": "y"}}]}),
                "tools[0].function.strict",
            ),
            (json!({"tools": [weather(), weather()]}), "tools[1].function.name"),
            (json!({"tool_choice": "always"}), "tool_choice"),
            (json!({"parallel_tool_calls": 1}), "parallel_tool_calls"),
        ];
        for (body, param) in cases {
            assert_eq!(parse(body.clone()).unwrap_err().param.as_deref(), Some(param), "{body}");
        }
    }

    #[test]
    fn history_tool_calls_keep_their_arguments_as_sent_and_bad_ones_are_named() {
        let calls = json!([
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": [1, {\"b\": null}]}"}},
            {"id": "call_2", "function": {"name": "g", "arguments": {"x": "y"}}},
            {"id": "call_3", "function": {"name": "h"}}
        ]);
        let calls = read_calls(calls).unwrap();
        assert_eq!(calls[0].function.arguments, json!("{\"a\": [1, {\"b\": null}]}"));
        assert_eq!(calls[1].function.arguments["x"], "y");
        assert_eq!(calls[2].function.arguments, json!({}));
        assert_eq!(
            serde_json::to_value(&calls[1]).unwrap(),
            json!({"type": "function", "id": "call_2", "function": {"name": "g", "arguments": {"x": "y"}}})
        );
        for (calls, param) in [
            (json!({}), "messages[1].tool_calls"),
            (json!([{"function": {"name": "f"}}]), "messages[1].tool_calls[0].id"),
            (
                json!([{"id": "c", "type": "tool", "function": {"name": "f"}}]),
                "messages[1].tool_calls[0].type",
            ),
            (json!([{"id": "c"}]), "messages[1].tool_calls[0].function"),
            (
                json!([{"id": "c", "function": {"arguments": "{}"}}]),
                "messages[1].tool_calls[0].function.name",
            ),
            (
                json!([{"id": "c", "function": {"name": "f", "arguments": "{"}}]),
                "messages[1].tool_calls[0].function.arguments",
            ),
            (
                json!([{"id": "c", "function": {"name": "f", "arguments": "[1]"}}]),
                "messages[1].tool_calls[0].function.arguments",
            ),
            (
                json!([{"id": "c", "function": {"name": "f", "arguments": 1}}]),
                "messages[1].tool_calls[0].function.arguments",
            ),
        ] {
            let error = read_calls(calls.clone()).unwrap_err();
            assert_eq!(error.param.as_deref(), Some(param), "{calls}");
        }
    }
}
