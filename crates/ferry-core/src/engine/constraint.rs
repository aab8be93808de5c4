//! Structured outputs: a `response_format` (any JSON object, or JSON valid under a schema) or a grammar (the
//! server's forced tool calls) compiled by llguidance into a [`Constraint`], one per request, that the request's `Emitter` consults each step: the constraint masks the
//! logits row to the tokens the grammar allows next, the sampler picks among them, and the constraint is told the
//! chosen token. Generation ends when the grammar is complete and allows nothing more (its eos tokens).
//!
//! The mask is computed on the engine thread, after the step's forward pass, one constrained request at a time.
//! Computing it while the GPU runs the next step's forward pass would hide its cost (the mask depends only on the
//! tokens already committed), at the price of a pipelined sampler; see `GrammarCompiler::new` for where the one-off
//! cost of a model's token trie lies.
//!
//! Not here: how the server reads `response_format` (ferry-server), sampling itself (sampler.rs).

use std::fmt;
use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::{token_bytes_from_tokenizer_json, Matcher, ParserFactory};
use serde_json::{json, Value};
use toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};

use crate::loader::Tokenizer;
use crate::{Error, Result};

/// What a request's output must be.
#[derive(Clone, Debug, PartialEq)]
pub enum ResponseFormat {
    /// Any JSON object (OpenAI's `json_object`).
    JsonObject,
    /// JSON valid under this JSON Schema (OpenAI's `json_schema`).
    JsonSchema(Value),
    /// Text of this grammar in llguidance's Lark syntax (`%json {...}` embeds a schema).
    Lark(String),
    /// Text this regular expression matches, whole (vLLM's `structured_outputs.regex`).
    Regex(String),
    /// One of these texts (vLLM's `structured_outputs.choice`).
    Choice(Vec<String>),
}

/// `regex` as a Lark terminal, `/.../`, its unescaped slashes escaped.
pub fn regex_terminal(regex: &str) -> String {
    let mut out = String::with_capacity(regex.len());
    let mut escaped = false;
    for c in regex.chars() {
        if c == '/' && !escaped {
            out.push('\\');
        }
        escaped = c == '\\' && !escaped;
        out.push(c);
    }
    format!("/{out}/")
}

/// `"a" | "b" | ...`: each choice a Lark string literal (JSON's quoting).
pub fn choice_alternatives(choices: &[String]) -> String {
    choices
        .iter()
        .map(|choice| Value::from(choice.as_str()).to_string())
        .collect::<Vec<_>>()
        .join(" | ")
}

/// Compiles response formats for one model: its tokens' bytes in a trie, built once (a vocabulary's worth of
/// work: the first structured request pays it if the server builds it lazily) and shared by every request's
/// grammar.
pub struct GrammarCompiler {
    factory: Arc<ParserFactory>,
}

/// llguidance's JSON layout: no whitespace of the model's choosing between tokens (a free `\s*` lets a weak or
/// random model pad forever), and the separators `json.dumps` writes. A schema's own `x-guidance` overrides it.
fn layout() -> Value {
    json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "})
}

impl GrammarCompiler {
    /// For a model whose logits rows have `vocab_size` entries and which ends a turn with any of `eos_token_ids`.
    /// Fails for a tokenizer whose tokens' bytes llguidance cannot tell (neither byte-level nor byte-fallback).
    pub fn new(tokenizer: &Tokenizer, eos_token_ids: &[u32], vocab_size: usize) -> Result<Self> {
        let unsupported = |why: String| Error::Tokenizer(format!("structured outputs are unavailable: {why}"));
        let tokenizer_json = tokenizer.to_json()?;
        // llguidance asserts on token names it does not expect; that is this tokenizer's problem, not a crash.
        let words = std::panic::catch_unwind(|| token_bytes_from_tokenizer_json(&tokenizer_json))
            .map_err(|_| unsupported("llguidance could not read the tokenizer's vocabulary".into()))?
            .map_err(|e| unsupported(e.to_string()))?;
        let mut words = words;
        // Ids the model can produce but the tokenizer does not name stay empty: never allowed.
        words.resize(words.len().max(vocab_size), Vec::new());
        let Some(&first_eos) = eos_token_ids.first() else {
            return Err(unsupported(
                "the model has no eos token to end a structured output".into(),
            ));
        };
        if let Some(bad) = eos_token_ids.iter().find(|&&id| id as usize >= words.len()) {
            return Err(unsupported(format!("eos token {bad} is outside the vocabulary")));
        }
        let info = TokRxInfo::new(words.len() as u32, first_eos);
        let trie = TokTrie::from(&info, &words).with_eos_tokens(eos_token_ids);
        let tok_env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&tok_env).map_err(|e| unsupported(e.to_string()))?;
        factory.quiet();
        Ok(GrammarCompiler {
            factory: Arc::new(factory),
        })
    }

    /// The constraint for a request with this response format; a schema or grammar llguidance cannot compile is
    /// the caller's mistake (an `Error::Request` saying what failed, for the caller to name its field).
    pub fn compile(&self, format: &ResponseFormat) -> Result<Constraint> {
        let grammar = match format {
            ResponseFormat::JsonObject => json_schema(json!({"type": "object"}))?,
            ResponseFormat::JsonSchema(schema) => json_schema(schema.clone())?,
            ResponseFormat::Lark(grammar) => TopLevelGrammar::from_lark(grammar.clone()),
            ResponseFormat::Regex(regex) => TopLevelGrammar::from_regex(regex),
            ResponseFormat::Choice(choices) => {
                TopLevelGrammar::from_lark(format!("start: {}", choice_alternatives(choices)))
            }
        };
        let what = match format {
            ResponseFormat::Lark(_) | ResponseFormat::Choice(_) => "grammar",
            ResponseFormat::Regex(_) => "regex",
            _ => "schema",
        };
        let cannot = |e: &dyn fmt::Display| Error::Request(format!("the {what} cannot be compiled: {e}"));
        let parser = self.factory.create_parser(grammar).map_err(|e| cannot(&e))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(error) = matcher.get_error() {
            return Err(cannot(&error));
        }
        Ok(Constraint {
            matcher: Box::new(matcher),
        })
    }
}

/// A JSON Schema as a grammar, in [`layout`] unless the schema sets its own.
fn json_schema(mut schema: Value) -> Result<TopLevelGrammar> {
    let Some(object) = schema.as_object_mut() else {
        return Err(Error::Request("the schema must be a JSON object".into()));
    };
    object.entry("x-guidance").or_insert_with(layout);
    Ok(TopLevelGrammar::from_json_schema(schema))
}

/// One request's grammar state: what it allows next, given the tokens committed so far.
#[derive(Clone)]
pub struct Constraint {
    /// Boxed: a matcher is over a kilobyte, and requests travel by value to the engine thread.
    matcher: Box<Matcher>,
}

impl fmt::Debug for Constraint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Constraint")
            .field("stopped", &self.matcher.is_stopped())
            .finish()
    }
}

impl Constraint {
    /// A copy with its own parser state, for a request's emitter (the request keeps the grammar's start).
    pub(super) fn fork(&self) -> Self {
        Constraint {
            matcher: Box::new(self.matcher.deep_clone()),
        }
    }

    /// Sets every logit the grammar forbids next to -inf. An error if the grammar failed or allows no token the
    /// row can give (the request cannot go on).
    pub(super) fn mask(&mut self, logits: &mut [f32]) -> Result<()> {
        let allowed = self.matcher.compute_mask().map_err(|e| grammar_error(&e))?;
        let mut any = false;
        for (id, logit) in logits.iter_mut().enumerate() {
            if id < allowed.len() && allowed.is_allowed(id as u32) {
                any |= logit.is_finite();
            } else {
                *logit = f32::NEG_INFINITY;
            }
        }
        match any {
            true => Ok(()),
            false => Err(Error::Request(
                "constrained decoding: the grammar allows no token the model can produce here".into(),
            )),
        }
    }

    /// Advances the grammar by the chosen token; returns whether the output is now complete (the grammar took
    /// an eos token or allows nothing more).
    pub(super) fn commit(&mut self, token: u32) -> Result<bool> {
        self.matcher.consume_token(token).map_err(|e| grammar_error(&e))?;
        if let Some(error) = self.matcher.get_error() {
            return Err(Error::Request(format!("constrained decoding: {error}")));
        }
        Ok(self.matcher.is_stopped())
    }
}

fn grammar_error(e: &anyhow::Error) -> Error {
    Error::Request(format!("constrained decoding: {e}"))
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;
    use std::path::Path;

    use rand::{rngs::StdRng, Rng, SeedableRng};

    use super::super::emit::Emitter;
    use super::super::request::{FinishReason, Request};
    use super::super::sampler::SamplingParams;
    use super::*;

    const EOS: [u32; 2] = [502, 500];

    fn fixture_tokenizer() -> Tokenizer {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen3_moe");
        Tokenizer::load(&dir).unwrap().unwrap()
    }

    /// What a request under `constraint` generates from random logits (the fixture's 512-token vocabulary).
    fn generate(tokenizer: &Tokenizer, constraint: &Constraint, seed: u64, ignore_eos: bool) -> String {
        let mut request = Request::new(vec![1], 64);
        request.sampling = SamplingParams {
            temperature: 1.0,
            seed: Some(seed),
            ..SamplingParams::default()
        };
        request.stop.eos_token_ids = EOS.to_vec();
        request.stop.ignore_eos = ignore_eos;
        request.constraint = Some(constraint.clone());
        let mut emitter = Emitter::new(&request);
        let mut tokens = request.prompt_ids.clone();
        let mut rng = StdRng::seed_from_u64(seed);
        let mut text = String::new();
        loop {
            let logits: Vec<f32> = (0..512).map(|_| rng.random::<f32>() * 4.0).collect();
            let emitted = emitter
                .next_token(&request, &mut tokens, &logits, tokenizer, 1000)
                .unwrap();
            text += &emitted.text;
            if let Some(finish) = emitted.finish {
                assert_eq!(finish, FinishReason::Stop, "{text:?} was cut short");
                return text;
            }
        }
    }

    #[test]
    fn random_logits_under_an_enum_schema_give_one_of_its_values() {
        let tokenizer = fixture_tokenizer();
        let compiler = GrammarCompiler::new(&tokenizer, &EOS, 512).unwrap();
        let schema = json!({"enum": ["yes", "no", 42]});
        let constraint = compiler.compile(&ResponseFormat::JsonSchema(schema)).unwrap();
        let mut seen = HashSet::new();
        for seed in 0..12 {
            // Ignoring eos, the grammar's own end still ends the request.
            let text = generate(&tokenizer, &constraint, seed, seed % 2 == 0);
            assert!(["\"yes\"", "\"no\"", "42"].contains(&text.as_str()), "{text:?}");
            seen.insert(text);
        }
        assert!(seen.len() > 1, "random logits always chose {seen:?}");
    }

    #[test]
    fn random_logits_under_a_regex_or_choices_give_what_they_allow() {
        let tokenizer = fixture_tokenizer();
        let compiler = GrammarCompiler::new(&tokenizer, &EOS, 512).unwrap();
        let dates = compiler
            .compile(&ResponseFormat::Regex(r"20[0-9]{2}/(0[1-9]|1[0-2])".into()))
            .unwrap();
        let choices = ["ferry", "boat", "a/b \"quoted\""].map(String::from).to_vec();
        let one_of = compiler.compile(&ResponseFormat::Choice(choices.clone())).unwrap();
        // The same, as the rule of a grammar that puts them after something else.
        let after = |rule: String| ResponseFormat::Lark(format!("start: \"=\" answer\nanswer: {rule}"));
        let dates_after = compiler
            .compile(&after(regex_terminal(r"20[0-9]{2}/(0[1-9]|1[0-2])")))
            .unwrap();
        let one_of_after = compiler.compile(&after(choice_alternatives(&choices))).unwrap();
        let date = |text: &str| {
            let (year, month) = text.split_once('/').unwrap_or_else(|| panic!("{text:?}"));
            year.len() == 4 && year.starts_with("20") && (1..=12).contains(&month.parse::<u32>().unwrap())
        };
        let mut seen = HashSet::new();
        for seed in 0..12 {
            let text = generate(&tokenizer, &dates, seed, false);
            assert!(date(&text), "{text:?}");
            let text = generate(&tokenizer, &dates_after, seed, false);
            assert!(date(text.strip_prefix('=').unwrap()), "{text:?}");
            let text = generate(&tokenizer, &one_of, seed, false);
            assert!(choices.contains(&text), "{text:?}");
            seen.insert(text);
            let text = generate(&tokenizer, &one_of_after, seed, false);
            assert!(choices.iter().any(|c| text == format!("={c}")), "{text:?}");
        }
        assert!(seen.len() > 1, "random logits always chose {seen:?}");
        assert_eq!(regex_terminal(r"a/b\/c"), r"/a\/b\/c/");
    }

    #[test]
    fn schemas_and_grammars_that_cannot_be_compiled_are_the_callers_mistake() {
        let compiler = GrammarCompiler::new(&fixture_tokenizer(), &EOS, 512).unwrap();
        for bad in [
            json!({"type": "nonsense"}),
            json!([1, 2]),
            json!({"minimum": "three", "type": "integer"}),
        ] {
            let error = compiler.compile(&ResponseFormat::JsonSchema(bad.clone())).unwrap_err();
            assert!(
                matches!(&error, Error::Request(m) if m.contains("schema")),
                "{bad}: {error}"
            );
        }
        let error = compiler
            .compile(&ResponseFormat::Lark("start: missing".into()))
            .unwrap_err();
        assert!(matches!(&error, Error::Request(m) if m.contains("grammar")), "{error}");
        let error = compiler
            .compile(&ResponseFormat::Regex("(unclosed".into()))
            .unwrap_err();
        assert!(matches!(&error, Error::Request(m) if m.contains("regex")), "{error}");
    }

    #[test]
    fn a_model_without_eos_cannot_end_a_structured_output() {
        let error = GrammarCompiler::new(&fixture_tokenizer(), &[], 512).err().unwrap();
        assert!(error.to_string().contains("no eos token"), "{error}");
    }
}
