//! Forced tool calls (OpenAI's `tool_choice` "required" or a named function, Anthropic's `any` or `tool`): a
//! grammar in llguidance's Lark syntax under which the model can write nothing but calls of the allowed tools, in
//! the chat template's format, each call's arguments valid under its tool's schema, then end its turn. The tool call
//! parser (mod.rs) reads the calls back exactly as it reads calls the model chose to make.
//!
//! Thinking comes first, as the template's switch says. A model that reasons is let reason before it calls (vLLM
//! likewise constrains only the text after the reasoning): forcing the call at once would take away the thinking
//! its calls depend on, and the switch is the caller's way to turn it off. So where the generation prompt opened
//! `<think>` (Qwen3.5), the grammar starts inside the thinking; where the model may open it (Qwen3), a thinking
//! block may come first; where thinking is switched off, or the model does not reason, the first token is the call.
//! The thinking is free text up to the first `</think>`, bounded by `max_tokens` and Anthropic's `budget_tokens`.
//!
//! What is enforced: the Hermes format's arguments wholly, by their JSON schema; in the XML format, each parameter
//! the schema lists (the required ones always, in the schema's order), non-string values by their schema, string
//! values as free text (an `enum` or `const` of strings enforced, `pattern` and `format` not).

use serde_json::{json, Value};

use super::{ToolCallFormat, ToolRequest, ToolSpec, CLOSE, OPEN};
use crate::error::ApiError;

/// Where the output starts with respect to the model's thinking.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Thinking {
    /// The prompt ends inside `<think>`: the output starts with the thinking's text.
    Inside,
    /// The model may open a `<think>` block before its calls.
    Optional,
    /// No thinking: the output starts with a call.
    Off,
}

/// JSON as the templates write it: `", "` and `": "` between items, no other whitespace (as in constraint.rs).
fn layout() -> Value {
    json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "})
}

/// A Lark string literal holding `text` (Lark reads its strings as JSON strings).
fn literal(text: &str) -> String {
    Value::from(text).to_string()
}

/// `%json {schema}` in the templates' layout.
fn json_rule(schema: &Value) -> String {
    let mut schema = match schema {
        Value::Object(fields) => fields.clone(),
        // A schema `true` (anything) or a malformed one: llguidance names the fault when it compiles the grammar.
        other => return format!("%json {other}"),
    };
    schema.entry("x-guidance").or_insert_with(layout);
    format!("%json {}", Value::Object(schema))
}

/// A tool's arguments: always an object, whatever else its schema says.
fn arguments_schema(tool: &ToolSpec) -> Value {
    let mut schema = tool.parameters.as_object().cloned().unwrap_or_default();
    schema.entry("type").or_insert_with(|| "object".into());
    Value::Object(schema)
}

/// The grammar for `request`'s forced calls in `format`; an error (naming `tool_choice`) for a format no grammar
/// is written for.
pub fn grammar(request: &ToolRequest, format: ToolCallFormat, thinking: Thinking) -> Result<String, ApiError> {
    let allowed: Vec<&ToolSpec> = match &request.choice {
        super::request::ToolChoice::Function(name) => request.tools.iter().filter(|t| &t.name == name).collect(),
        _ => request.tools.iter().collect(),
    };
    let mut rules = vec![];
    let mut bodies = vec![];
    for (i, tool) in allowed.iter().enumerate() {
        let body = if format == ToolCallFormat::Hermes {
            hermes_body(tool)
        } else if format == ToolCallFormat::Qwen3Xml {
            xml_body(tool, i, &mut rules)
        } else {
            return Err(ApiError::invalid_param(
                "tool_choice",
                "this model's tool call format cannot be forced; use `tool_choice` \"auto\"",
            ));
        };
        rules.push(format!("call_{i}: {body}"));
        bodies.push(format!("call_{i}"));
    }
    let calls = match request.parallel_calls {
        true => "call (\"\\n\" call)*",
        false => "call",
    };
    let start = match thinking {
        Thinking::Inside => "start: think_text gap calls",
        Thinking::Optional => "start: (\"<think>\" think_text gap)? calls",
        Thinking::Off => "start: calls",
    };
    let mut grammar = vec![start.to_string()];
    if thinking != Thinking::Off {
        // The thinking ends at its first `</think>`; the template puts a blank line before the answer.
        grammar.push("think_text[suffix=\"</think>\"]: /(?s:.*)/".into());
        grammar.push("gap: (\"\\n\" | \"\\n\\n\")?".into());
    }
    grammar.extend([
        format!("calls: {calls}"),
        format!(
            "call: {} ({}) {}",
            literal(&format!("{OPEN}\n")),
            bodies.join(" | "),
            literal(&format!("\n{CLOSE}"))
        ),
    ]);
    grammar.extend(rules);
    Ok(grammar.join("\n"))
}

/// `{"name": "NAME", "arguments": {...}}`, as Qwen's templates write a call.
fn hermes_body(tool: &ToolSpec) -> String {
    let head = literal(&format!(
        "{{\"name\": {}, \"arguments\": ",
        Value::from(tool.name.as_str())
    ));
    format!("{head} {} \"}}\"", json_rule(&arguments_schema(tool)))
}

/// `<function=NAME>\n` then a `<parameter=P>\nvalue\n</parameter>\n` per parameter, then `</function>`; the
/// parameters' value rules go into `rules`.
fn xml_body(tool: &ToolSpec, index: usize, rules: &mut Vec<String>) -> String {
    let schema = arguments_schema(tool);
    let properties = schema
        .get("properties")
        .and_then(Value::as_object)
        .cloned()
        .unwrap_or_default();
    let required: Vec<&str> = schema
        .get("required")
        .and_then(Value::as_array)
        .map_or_else(Vec::new, |names| names.iter().filter_map(Value::as_str).collect());
    let mut parts = vec![literal(&format!("<function={}>\n", tool.name))];
    for (j, (name, property)) in properties.iter().enumerate() {
        let rule = format!("param_{index}_{j}");
        let parameter = xml_parameter(name, property, &rule, rules);
        rules.push(format!("{rule}: {parameter}"));
        parts.push(match required.contains(&name.as_str()) {
            true => rule,
            false => format!("{rule}?"),
        });
    }
    parts.push(literal("</function>"));
    parts.join(" ")
}

const PARAMETER_END: &str = "\n</parameter>\n";

/// One parameter: its tag, its value as the XML format writes it (strings bare, anything else as JSON), the end.
fn xml_parameter(name: &str, property: &Value, rule: &str, rules: &mut Vec<String>) -> String {
    let open = literal(&format!("<parameter={name}>\n"));
    let end = literal(PARAMETER_END);
    if let Some(values) = string_choices(property) {
        let values: Vec<String> = values.iter().map(|v| literal(v)).collect();
        return format!("{open} ({}) {end}", values.join(" | "));
    }
    if !takes_string(property) {
        return format!("{open} {} {end}", json_rule(property));
    }
    // Free text up to the closing tag, within the schema's length bounds.
    let bound = |key| property.get(key).and_then(Value::as_u64);
    let length = match (bound("minLength"), bound("maxLength")) {
        (None, None) => "*".to_string(),
        (min, max) => format!(
            "{{{},{}}}",
            min.unwrap_or(0),
            max.map_or(String::new(), |m| m.to_string())
        ),
    };
    rules.push(format!("{rule}_text[suffix={end}]: /(?s:.{length})/"));
    format!("{open} {rule}_text")
}

/// A property whose values are listed strings (`enum` or `const`): the list.
fn string_choices(property: &Value) -> Option<Vec<String>> {
    let values = match (property.get("enum"), property.get("const")) {
        (Some(Value::Array(values)), _) => values.clone(),
        (_, Some(value)) => vec![value.clone()],
        _ => return None,
    };
    values.iter().map(|v| v.as_str().map(str::to_string)).collect()
}

/// Whether the XML parser reads this property's value as a string (mod.rs converts by the schema's `type`).
fn takes_string(property: &Value) -> bool {
    match property.get("type") {
        Some(Value::String(kind)) => kind == "string",
        Some(Value::Array(kinds)) => kinds.iter().any(|k| k == "string"),
        // No type: the parser keeps the text as a string.
        _ => true,
    }
}
