//! Forced tool calls (OpenAI's `tool_choice` "required" or a named function, Anthropic's `any` or `tool`): a
//! grammar in llguidance's Lark syntax under which the model can write nothing but calls of the allowed tools, in
//! the chat template's format, each call's arguments valid under its tool's schema, then end its turn. The tool call
//! parser (mod.rs) reads the calls back exactly as it reads calls the model chose to make. A structured output
//! (`response_format`, `text.format`, `output_config.format`) of a model that reasons is let reason the same way
//! before its JSON ([`after_thinking`]).
//!
//! Thinking comes first, as the template's switch says. A model that reasons is let reason before it calls (vLLM
//! likewise constrains only the text after the reasoning): forcing the call at once would take away the thinking
//! its calls depend on, and the switch is the caller's way to turn it off. So where the generation prompt opened
//! `<think>` (Qwen3.5, DeepSeek-V3.1 thinking), the grammar starts inside the thinking; where the model may open it
//! (Qwen3, GLM-4.5), a thinking block may come first; where thinking is switched off, or the model does not reason,
//! the first token is the call. The thinking is free text up to the first `</think>`, bounded by `max_tokens` and
//! Anthropic's `budget_tokens`. gpt-oss's Harmony carries its reasoning in an `analysis` message, which may come
//! before its call.
//!
//! What is enforced: the arguments of the formats that write them as JSON (Hermes, DeepSeek-V3.1, Harmony) wholly,
//! by their JSON schema; in the formats that write each argument between tags (Qwen XML, GLM-4.5), each parameter
//! the schema lists (the required ones always, in the schema's order), non-string values by their schema, string
//! values as free text (an `enum` or `const` of strings enforced, `pattern` and `format` not).

use ferry_core::engine::{choice_alternatives, regex_terminal, ResponseFormat};
use serde_json::{json, Value};

use super::named_json::{CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEPARATOR};
use super::{ToolCallFormat, ToolRequest, ToolSpec, CLOSE, OPEN};

/// Where the output starts with respect to the model's thinking.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Thinking {
    /// The prompt ends inside `<think>`: the output starts with the thinking's text.
    Inside,
    /// The model may open a `<think>` block before its calls; `open` is the `<think>` token, where the vocabulary
    /// has one. The grammar then opens the thinking with that token alone: the thinking budget counts from it, and
    /// would not see the same text spelled in several tokens.
    Optional { open: Option<u32> },
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

/// The grammar for `request`'s forced calls in `format`.
pub fn grammar(request: &ToolRequest, format: ToolCallFormat, thinking: Thinking) -> String {
    let allowed = request.forced_tools();
    let mut rules = vec![];
    let mut bodies = vec![];
    for (i, tool) in allowed.iter().enumerate() {
        let body = match format {
            ToolCallFormat::Hermes => hermes_body(tool),
            ToolCallFormat::Qwen3Xml => keyed_body(tool, i, &XML, &mut rules),
            ToolCallFormat::Glm45 => keyed_body(tool, i, &GLM, &mut rules),
            ToolCallFormat::DeepSeekV31 => format!(
                "{} {}",
                literal(&format!("{}{SEPARATOR}", tool.name)),
                arguments_rule(tool)
            ),
            ToolCallFormat::Harmony => format!(
                "{} <|constrain|> \"json\" <|message|> {}",
                literal(&format!("{} ", tool.name)),
                arguments_rule(tool)
            ),
        };
        rules.push(format!("call_{i}: {body}"));
        bodies.push(format!("call_{i}"));
    }
    let bodies = bodies.join(" | ");
    let mut grammar = match format {
        ToolCallFormat::Harmony => harmony_calls(&bodies),
        _ => tagged_calls(format, &bodies, request.parallel_calls, thinking),
    };
    grammar.extend(rules);
    grammar.join("\n")
}

/// The calls of the formats that tag them, after the thinking the switch allows.
fn tagged_calls(format: ToolCallFormat, bodies: &str, parallel: bool, thinking: Thinking) -> Vec<String> {
    // GLM-4.5 writes a line break before its thinking and its calls.
    let lead = match format {
        ToolCallFormat::Glm45 => "\"\\n\"? ",
        _ => "",
    };
    let mut grammar = thinking_then(thinking, lead, "calls");
    let (open, close) = match format {
        ToolCallFormat::DeepSeekV31 => (CALL_BEGIN.to_string(), CALL_END.to_string()),
        ToolCallFormat::Glm45 => (OPEN.to_string(), format!("\n{CLOSE}")),
        _ => (format!("{OPEN}\n"), format!("\n{CLOSE}")),
    };
    let calls = match (format, parallel) {
        (ToolCallFormat::DeepSeekV31, _) => format!(
            "{} call{} {}",
            literal(CALLS_BEGIN),
            if parallel { "+" } else { "" },
            literal(CALLS_END)
        ),
        (_, true) => format!("{lead}call (\"\\n\" call)*"),
        (_, false) => format!("{lead}call"),
    };
    grammar.extend([
        format!("calls: {calls}"),
        format!("call: {} ({bodies}) {}", literal(&open), literal(&close)),
    ]);
    grammar
}

/// The start of a grammar whose `rule` comes after the thinking `thinking` allows (`lead` before an opened
/// `<think>`), and the thinking's rules.
fn thinking_then(thinking: Thinking, lead: &str, rule: &str) -> Vec<String> {
    let start = match thinking {
        Thinking::Inside => format!("start: think_text gap {rule}"),
        Thinking::Optional { open } => {
            let open = open.map_or_else(|| literal("<think>"), |id| format!("<[{id}]>"));
            format!("start: ({lead}{open} think_text gap)? {rule}")
        }
        Thinking::Off => format!("start: {rule}"),
    };
    let mut grammar = vec![start];
    if thinking != Thinking::Off {
        // The thinking ends at its first `</think>`; the template puts a blank line before the answer.
        grammar.push("think_text[suffix=\"</think>\"]: /(?s:.*)/".into());
        grammar.push("gap: (\"\\n\" | \"\\n\\n\")?".into());
    }
    grammar
}

/// A structured output for a model whose thinking `thinking` allows: the format itself where there is none, else a
/// grammar of the thinking, then the format (as vLLM constrains only what follows the reasoning); a grammar of the
/// client's own constrains the output from its first token.
pub fn after_thinking(format: &ResponseFormat, thinking: Thinking) -> ResponseFormat {
    let answer = match (format, thinking) {
        (_, Thinking::Off) | (ResponseFormat::Lark(_), _) => return format.clone(),
        (ResponseFormat::JsonObject, _) => json_rule(&json!({"type": "object"})),
        (ResponseFormat::JsonSchema(schema), _) => json_rule(schema),
        (ResponseFormat::Regex(regex), _) => regex_terminal(regex),
        (ResponseFormat::Choice(choices), _) => choice_alternatives(choices),
    };
    let mut grammar = thinking_then(thinking, "", "answer");
    grammar.push(format!("answer: {answer}"));
    ResponseFormat::Lark(grammar.join("\n"))
}

/// Harmony's: an `analysis` message may come first, then one call (the end of a call ends gpt-oss's turn, so a
/// turn holds one). Its markup is special tokens, named as such (`<|channel|>`): a model whose tokenizer lacks them
/// cannot be forced in this format (the grammar does not compile).
fn harmony_calls(bodies: &str) -> Vec<String> {
    vec![
        "start: analysis? call".into(),
        "analysis: <|channel|> \"analysis\" <|message|> analysis_text <|end|> <|start|> \"assistant\"".into(),
        "analysis_text: /(?s:.*)/".into(),
        format!("call: <|channel|> \"commentary to=functions.\" ({bodies})"),
    ]
}

/// `{"name": "NAME", "arguments": {...}}`, as Qwen's templates write a call.
fn hermes_body(tool: &ToolSpec) -> String {
    let head = literal(&format!(
        "{{\"name\": {}, \"arguments\": ",
        Value::from(tool.name.as_str())
    ));
    format!("{head} {} \"}}\"", arguments_rule(tool))
}

/// A tool's arguments as JSON text valid under its schema.
fn arguments_rule(tool: &ToolSpec) -> String {
    json_rule(&arguments_schema(tool))
}

/// A format that writes each argument between tags of its own, its value bare if a string, else as JSON.
struct KeyedFormat {
    /// What comes before the arguments: `NAME` stands for the tool's name.
    head: &'static str,
    /// The tags before a value: `KEY` stands for the argument's name.
    key: &'static str,
    /// The tag after a value.
    value_end: &'static str,
    /// What comes after the arguments.
    tail: &'static str,
}

/// Qwen3-Coder's and Qwen3.5's: `<function=NAME>\n<parameter=P>\nvalue\n</parameter>\n</function>`.
const XML: KeyedFormat = KeyedFormat {
    head: "<function=NAME>\n",
    key: "<parameter=KEY>\n",
    value_end: "\n</parameter>\n",
    tail: "</function>",
};

/// GLM-4.5's: `NAME\n<arg_key>K</arg_key>\n<arg_value>V</arg_value>`.
const GLM: KeyedFormat = KeyedFormat {
    head: "NAME",
    key: "\n<arg_key>KEY</arg_key>\n<arg_value>",
    value_end: "</arg_value>",
    tail: "",
};

/// The head, then each parameter the schema lists (the required ones always, in the schema's order), then the
/// tail; the parameters' value rules go into `rules`.
fn keyed_body(tool: &ToolSpec, index: usize, format: &KeyedFormat, rules: &mut Vec<String>) -> String {
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
    let mut parts = vec![literal(&format.head.replace("NAME", &tool.name))];
    for (j, (name, property)) in properties.iter().enumerate() {
        let rule = format!("param_{index}_{j}");
        let parameter = keyed_parameter(format, name, property, &rule, rules);
        rules.push(format!("{rule}: {parameter}"));
        parts.push(match required.contains(&name.as_str()) {
            true => rule,
            false => format!("{rule}?"),
        });
    }
    if !format.tail.is_empty() {
        parts.push(literal(format.tail));
    }
    parts.join(" ")
}

/// One parameter: its tags, its value as the format writes it (strings bare, anything else as JSON), the end.
fn keyed_parameter(format: &KeyedFormat, name: &str, property: &Value, rule: &str, rules: &mut Vec<String>) -> String {
    let open = literal(&format.key.replace("KEY", name));
    let end = literal(format.value_end);
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

/// Whether the XML and GLM parsers read this property's value as a string (arg_value.rs converts by the schema's
/// `type`).
fn takes_string(property: &Value) -> bool {
    match property.get("type") {
        Some(Value::String(kind)) => kind == "string",
        Some(Value::Array(kinds)) => kinds.iter().any(|k| k == "string"),
        // No type: the parser keeps the text as a string.
        _ => true,
    }
}
