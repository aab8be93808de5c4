//! The Responses API's tool fields read into the neutral tool request (tools/request.rs): `tools` (function tools,
//! flat: `{"type": "function", "name", "description", "parameters", "strict"}`, and `namespace` tools grouping
//! function tools under a name: `{"type": "namespace", "name", "description", "tools"}`), `tool_choice` (`auto`,
//! `none`, `required` or `{"type": "function", "name"}`), `parallel_tool_calls`, and an earlier turn's
//! `function_call` items. The chat route's rules apply (tools/request.rs reads them): `strict` is accepted only where
//! `tool_choice` forces calls, the one case in which constrained decoding enforces the schemas; the response's
//! `tools` say whether they were.
//!
//! A chat template knows a flat list of functions, so a namespace's functions reach it as `namespace.name`,
//! described by the namespace's description and their own; a call of one comes back as OpenAI returns it, a
//! `function_call` item of `name` with its `namespace`, and goes back into the template's history qualified again.

use std::collections::BTreeMap;

use ferry_core::loader::{FunctionCall, ToolCall};
use serde_json::{json, Map, Value};

use super::in_responses_terms;
use super::request::required;
use crate::body::{wrong_type, Body};
use crate::error::ApiError;
use crate::tools::request::ToolChoice;
use crate::tools::ToolRequest;

/// The name the template shows for function `name` of namespace `namespace`.
fn qualified(namespace: &str, name: &str) -> String {
    format!("{namespace}.{name}")
}

/// The functions that `namespace` tools bring: by the name the model calls (`namespace.name`), their namespace and
/// their own name, as a `function_call` item gives them.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Namespaces(BTreeMap<String, (String, String)>);

impl Namespaces {
    /// The namespace and the name of the function the model called `called`, when it is a namespace's.
    pub fn split(&self, called: &str) -> Option<(&str, &str)> {
        self.0
            .get(called)
            .map(|(namespace, name)| (namespace.as_str(), name.as_str()))
    }
}

/// One entry of `tools` as the response repeats it: a function (its index among the chat-shaped tools), or a
/// namespace with its functions' indices and names.
enum Echoed {
    Function(usize),
    Namespace {
        name: String,
        description: Option<String>,
        functions: Vec<(usize, String)>,
    },
}

/// The object at `param`, without its null fields (null is absent here, as everywhere in a request).
fn tool_fields(param: &str, value: &Value) -> Result<Map<String, Value>, ApiError> {
    let mut fields = value
        .as_object()
        .ok_or_else(|| wrong_type(param, "an object", value))?
        .clone();
    fields.retain(|_, value| !value.is_null());
    Ok(fields)
}

/// The `type` of the tool at `param`.
fn tool_type(param: &str, fields: &mut Map<String, Value>) -> Result<String, ApiError> {
    match fields.remove("type") {
        Some(Value::String(kind)) => Ok(kind),
        Some(other) => Err(wrong_type(&format!("{param}.type"), "a string", &other)),
        None => Err(ApiError::invalid_param(
            &format!("{param}.type"),
            format!("`{param}.type` is required"),
        )),
    }
}

/// The error for a tool of a type this server does not serve. Tools OpenAI runs (web search, file search, ...) are
/// refused: this server runs none.
fn unserved(param: &str, kind: &str, served: &str) -> ApiError {
    ApiError::invalid_param(
        &format!("{param}.type"),
        format!(
            "`{param}.type` is \"{}\"; this server serves {served} only (it runs no hosted tools: turn them off in \
             the client, e.g. Codex's `web_search = \"disabled\"`)",
            crate::error::quote(kind)
        ),
    )
}

/// A request's `tools` in the chat shape.
#[derive(Default)]
struct ChatTools {
    /// Each function (`{"type": "function", "function": {...}}`), in order, with where it was (`tools[i]` or
    /// `tools[i].tools[j]`).
    chat: Vec<(Value, String)>,
    /// What the response repeats.
    echoed: Vec<Echoed>,
    namespaces: Namespaces,
}

/// The functions of `tools`, namespaces flattened.
fn chat_tools(tools: &[Value]) -> Result<ChatTools, ApiError> {
    let (mut chat, mut echoed, mut namespaces) = (Vec::new(), Vec::new(), Namespaces::default());
    for (index, tool) in tools.iter().enumerate() {
        let param = format!("tools[{index}]");
        let mut fields = tool_fields(&param, tool)?;
        match tool_type(&param, &mut fields)?.as_str() {
            "function" => {
                echoed.push(Echoed::Function(chat.len()));
                chat.push((json!({"type": "function", "function": fields}), param));
            }
            "namespace" => {
                let group = Body::nested(fields, format!("{param}."));
                let name = group.string("name")?.ok_or_else(|| required(&group, "name"))?;
                let description = group.string("description")?;
                let members = match group.get("tools") {
                    Some(Value::Array(members)) if !members.is_empty() => members.clone(),
                    Some(other) => return Err(wrong_type(&group.param("tools"), "a non-empty array", other)),
                    None => return Err(required(&group, "tools")),
                };
                group.refuse_unread(&[])?;
                let mut functions = Vec::new();
                for (member_index, member) in members.iter().enumerate() {
                    let member_param = format!("{param}.tools[{member_index}]");
                    let mut member_fields = tool_fields(&member_param, member)?;
                    let kind = tool_type(&member_param, &mut member_fields)?;
                    if kind != "function" {
                        return Err(unserved(&member_param, &kind, "function tools in a namespace"));
                    }
                    let Some(Value::String(member_name)) = member_fields.get("name").cloned() else {
                        // The chat route's rules name what is wrong with it.
                        chat.push((json!({"type": "function", "function": member_fields}), member_param));
                        continue;
                    };
                    let called = qualified(&name, &member_name);
                    member_fields.insert("name".into(), called.clone().into());
                    let own = member_fields.get("description").and_then(Value::as_str);
                    if let Some(joined) = match (&description, own) {
                        (Some(group), Some(own)) => Some(format!("{group}\n{own}")),
                        (Some(group), None) => Some(group.clone()),
                        (None, _) => None,
                    } {
                        member_fields.insert("description".into(), joined.into());
                    }
                    namespaces.0.insert(called, (name.clone(), member_name.clone()));
                    functions.push((chat.len(), member_name));
                    chat.push((json!({"type": "function", "function": member_fields}), member_param));
                }
                echoed.push(Echoed::Namespace {
                    name,
                    description,
                    functions,
                });
            }
            other => return Err(unserved(&param, other, "function and namespace tools")),
        }
    }
    Ok(ChatTools {
        chat,
        echoed,
        namespaces,
    })
}

/// A named `tool_choice` in the chat shape (`{"type": "function", "function": {"name"}}`); an `allowed_tools` one
/// (`{"type": "allowed_tools", "mode", "tools": [{"type": "function", "name"}]}`) in the chat's (`{"type":
/// "allowed_tools", "allowed_tools": {"mode", "tools": [{"type": "function", "function": {"name"}}]}}`).
fn chat_choice(choice: &Value) -> Value {
    let Some(fields) = choice.as_object() else {
        return choice.clone();
    };
    let mut fields = fields.clone();
    if fields.get("type") == Some(&Value::from("allowed_tools")) {
        let mut allowed = Map::new();
        if let Some(mode) = fields.remove("mode") {
            allowed.insert("mode".into(), mode);
        }
        if let Some(tools) = fields.remove("tools") {
            let tools = match tools {
                Value::Array(tools) => tools.iter().map(chat_choice).collect::<Vec<_>>().into(),
                other => other,
            };
            allowed.insert("tools".into(), tools);
        }
        fields.insert("allowed_tools".into(), allowed.into());
        return Value::Object(fields);
    }
    let mut function = Map::new();
    if let Some(name) = fields.remove("name") {
        function.insert("name".into(), name);
    }
    fields.insert("function".into(), function.into());
    Value::Object(fields)
}

/// An error of the chat route's rules about chat-shaped tool `tools[k]`, named where that tool was in this request.
fn at_tool(mut error: ApiError, places: &[(Value, String)]) -> ApiError {
    let Some(param) = error.param.clone() else {
        return error;
    };
    let Some(rest) = param.strip_prefix("tools[") else {
        return error;
    };
    let Some((index, rest)) = rest.split_once(']') else {
        return error;
    };
    if let Some((_, place)) = index.parse::<usize>().ok().and_then(|k| places.get(k)) {
        let renamed = format!("{place}{rest}");
        error.message = error.message.replace(&param, &renamed);
        error.param = Some(renamed);
    }
    error
}

/// `tools`, `tool_choice` and `parallel_tool_calls`, read by the chat route's rules (tools/request.rs) from their
/// chat-shaped equivalents, errors named as this API names the fields; the response's echo of them; and the
/// functions of the request's namespaces.
pub fn tool_request(body: &Body) -> Result<(ToolRequest, Map<String, Value>, Namespaces), ApiError> {
    let mut chat = Map::new();
    let mut flat = ChatTools::default();
    if let Some(tools) = body.get("tools") {
        let tools = match tools {
            Value::Array(tools) => {
                flat = chat_tools(tools)?;
                flat.chat
                    .iter()
                    .map(|(tool, _)| tool.clone())
                    .collect::<Vec<_>>()
                    .into()
            }
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
    let request = ToolRequest::parse(&Body::new(chat)).map_err(|e| at_tool(in_responses_terms(e), &flat.chat))?;
    let enforced = request.choice.forces_calls();
    let echoed_choice = match &request.choice {
        ToolChoice::Auto => json!("auto"),
        ToolChoice::None => json!("none"),
        ToolChoice::Required => json!("required"),
        ToolChoice::Function(name) => json!({"type": "function", "name": name}),
        ToolChoice::Allowed { names, required } => json!({
            "type": "allowed_tools", "mode": if *required { "required" } else { "auto" },
            "tools": names.iter().map(|name| json!({"type": "function", "name": name})).collect::<Vec<_>>(),
        }),
    };
    let function = |index: usize, name: &str| {
        let tool = &request.tools[index];
        json!({"type": "function", "name": name, "description": tool.definition["function"].get("description"),
               "parameters": tool.parameters, "strict": enforced})
    };
    let echoed_tools: Vec<Value> = flat
        .echoed
        .iter()
        .map(|entry| match entry {
            Echoed::Function(index) => function(*index, &request.tools[*index].name),
            Echoed::Namespace {
                name,
                description,
                functions,
            } => json!({"type": "namespace", "name": name, "description": description,
                        "tools": functions.iter().map(|(index, name)| function(*index, name)).collect::<Vec<_>>()}),
        })
        .collect();
    let mut echo = Map::new();
    echo.insert("tools".into(), echoed_tools.into());
    echo.insert("tool_choice".into(), echoed_choice);
    echo.insert("parallel_tool_calls".into(), request.parallel_calls.into());
    Ok((request, echo, flat.namespaces))
}

/// A `function_call` item of an earlier turn: `call_id`, `name` (with its `namespace`, when a namespace's: the
/// template knows it qualified) and `arguments` (JSON text holding an object, kept as sent: tools/history.rs gives the
/// template the form it reads).
pub fn function_call(item: &Body) -> Result<ToolCall, ApiError> {
    let id = item.string("call_id")?.ok_or_else(|| required(item, "call_id"))?;
    let name = item.string("name")?.ok_or_else(|| required(item, "name"))?;
    let name = match item.string("namespace")? {
        Some(namespace) => qualified(&namespace, &name),
        None => name,
    };
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
        tool_request(&Body::new(value.as_object().unwrap().clone())).map(|(request, echo, _)| (request, echo))
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
    fn a_namespaces_functions_reach_the_template_qualified_and_the_echo_keeps_the_group() {
        let crm = json!({"type": "namespace", "name": "crm", "description": "The customer records.", "tools": [
            {"type": "function", "name": "find", "description": "Finds a customer.",
             "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}},
            {"type": "function", "name": "close"},
        ]});
        let body = json!({"tools": [weather(json!(null)), crm]});
        let (request, echo, namespaces) = tool_request(&Body::new(body.as_object().unwrap().clone())).unwrap();
        let template = request.template_tools();
        let names: Vec<&str> = template
            .iter()
            .map(|t| t["function"]["name"].as_str().unwrap())
            .collect();
        assert_eq!(names, ["get_weather", "crm.find", "crm.close"]);
        assert_eq!(
            template[1]["function"]["description"],
            "The customer records.\nFinds a customer."
        );
        assert_eq!(template[2]["function"]["description"], "The customer records.");
        assert_eq!(namespaces.split("crm.find"), Some(("crm", "find")));
        assert_eq!(namespaces.split("get_weather"), None);
        assert_eq!(echo["tools"][0]["name"], "get_weather");
        assert_eq!(echo["tools"][1]["type"], "namespace");
        assert_eq!(echo["tools"][1]["name"], "crm");
        assert_eq!(echo["tools"][1]["tools"][0]["name"], "find");
        assert_eq!(echo["tools"][1]["tools"][1]["name"], "close");
        // An earlier call of a namespace's function goes back to the template qualified.
        let item =
            json!({"type": "function_call", "call_id": "c", "name": "find", "namespace": "crm", "arguments": "{}"});
        let call = function_call(&Body::new(item.as_object().unwrap().clone())).unwrap();
        assert_eq!(call.function.name, "crm.find");
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
            (json!({"tools": [{"type": "namespace", "tools": []}]}), "tools[0].name"),
            (
                json!({"tools": [{"type": "namespace", "name": "n", "tools": []}]}),
                "tools[0].tools",
            ),
            (json!({"tools": [{"type": "namespace", "name": "n"}]}), "tools[0].tools"),
            (
                json!({"tools": [{"type": "namespace", "name": "n", "tools": [{"type": "custom", "name": "f"}]}]}),
                "tools[0].tools[0].type",
            ),
            (
                json!({"tools": [{"type": "namespace", "name": "n", "tools": [{"type": "function", "name": "f", "x": 1}]}]}),
                "tools[0].tools[0].x",
            ),
            (
                json!({"tools": [{"type": "namespace", "name": "n", "x": 1, "tools": [{"type": "function", "name": "f"}]}]}),
                "tools[0].x",
            ),
            (
                json!({"tools": [weather(json!(null)), {"type": "namespace", "name": "n", "tools": [
                    {"type": "function", "name": "f"}, {"type": "function", "name": "f"}]}]}),
                "tools[1].tools[1].name",
            ),
        ] {
            assert_eq!(parse(body.clone()).unwrap_err().param.as_deref(), Some(param), "{body}");
        }
    }
}
