//! A compiled constraint (JSON schema, any JSON object, Lark grammar or regex) over one
//! vocabulary. Compiled once; every [`Matcher`] made from it starts from the compiled state.

use crate::error::{llg_message, ConstrainError, Result};
use crate::matcher::Matcher;
use crate::vocab::Vocab;
use llguidance::api::TopLevelGrammar;
use std::str::FromStr;
use std::sync::Mutex;

/// What a grammar source is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GrammarKind {
    /// A JSON schema (text). Strict: a keyword llguidance cannot enforce (`not`, `if`,
    /// `uniqueItems`, `contains`, `dependentSchemas`, `propertyNames`, ...), an unknown `format`
    /// and a `oneOf` whose branches may overlap are compile errors, never silently dropped.
    JsonSchema,
    /// Any JSON object (the source is ignored): OpenAI's `{"type": "json_object"}`.
    JsonObject,
    /// llguidance's Lark dialect, including `%json {...}` inline schemas and special tokens
    /// (`<|im_end|>`, `<[id]>`). See llguidance's docs/syntax.md.
    Lark,
    /// A regular expression the whole output must match (Rust regex syntax).
    Regex,
}

impl FromStr for GrammarKind {
    type Err = ConstrainError;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "json_schema" => Ok(GrammarKind::JsonSchema),
            "json_object" => Ok(GrammarKind::JsonObject),
            "lark" => Ok(GrammarKind::Lark),
            "regex" => Ok(GrammarKind::Regex),
            // llguidance's converter is Python (llguidance.gbnf_to_lark), not in the Rust crate
            "gbnf" => Err(ConstrainError::UnsupportedKind(
                "GBNF grammars are not compiled here: convert them to Lark first".into(),
            )),
            _ => Err(ConstrainError::UnsupportedKind(format!(
                "unknown grammar kind {s:?} (expected json_schema, json_object, lark or regex)"
            ))),
        }
    }
}

/// Options of llguidance's `x-guidance` schema key that would make a schema enforce less than
/// it says; a `json_schema` source may set the other options (whitespace, separators).
const WEAKENING_OPTIONS: [&str; 2] = ["lenient", "coerce_one_of"];

/// One compiled constraint. `Send + Sync`: share it between threads and make a matcher per
/// sequence (each choice of an n > 1 request needs its own).
pub struct Grammar {
    vocab: Vocab,
    /// The freshly compiled matcher that [`Grammar::matcher`] copies; never advanced.
    template: Mutex<llguidance::Matcher>,
    warnings: Vec<String>,
}

impl Grammar {
    /// Compile `source` of `kind` for `vocab`.
    pub fn compile(vocab: &Vocab, kind: GrammarKind, source: &str) -> Result<Self> {
        let top = match kind {
            GrammarKind::JsonSchema => TopLevelGrammar::from_json_schema(json_schema(source)?),
            GrammarKind::JsonObject => {
                TopLevelGrammar::from_json_schema(serde_json::json!({"type": "object"}))
            }
            GrammarKind::Lark => TopLevelGrammar::from_lark(source.to_string()),
            GrammarKind::Regex => TopLevelGrammar::from_regex(source),
        };
        let parser = vocab
            .factory()
            .create_parser(top)
            .map_err(|e| ConstrainError::Compile(compile_message(&e)))?;
        let mut template = llguidance::Matcher::new(Ok(parser));
        if let Some(e) = template.get_error() {
            return Err(ConstrainError::Compile(compile_message(&e)));
        }
        let warnings = template.grammar_warnings();
        Ok(Grammar {
            vocab: vocab.clone(),
            template: Mutex::new(template),
            warnings,
        })
    }

    /// A new matcher at the start of the grammar. It copies the compiled lexer state (not
    /// shared with other matchers, so matchers of one grammar compute masks in parallel).
    pub fn matcher(&self) -> Matcher {
        let inner = self
            .template
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .deep_clone();
        Matcher::new(self.vocab.clone(), inner)
    }

    /// llguidance's warnings about the grammar (e.g. unused Lark rules).
    pub fn warnings(&self) -> &[String] {
        &self.warnings
    }

    pub fn vocab(&self) -> &Vocab {
        &self.vocab
    }
}

/// llguidance's compile error, with its advice to weaken `oneOf` (an option refused here)
/// replaced by what holds.
fn compile_message(e: &impl std::fmt::Display) -> String {
    const ONE_OF: &str = "oneOf constraints are not supported. Enable 'coerce_one_of' option \
                          to approximate oneOf with anyOf";
    llg_message(e).replace(
        ONE_OF,
        "oneOf is supported only when no value can match two of its branches \
         (these may overlap); use anyOf",
    )
}

/// Parse a JSON schema and refuse the `x-guidance` options that weaken it.
fn json_schema(source: &str) -> Result<serde_json::Value> {
    let schema: serde_json::Value = serde_json::from_str(source)
        .map_err(|e| ConstrainError::Compile(format!("JSON schema is not valid JSON: {e}")))?;
    if let Some(opts) = schema.get("x-guidance").and_then(|v| v.as_object()) {
        for key in WEAKENING_OPTIONS {
            if opts
                .get(key)
                .is_some_and(|v| v != &serde_json::Value::Bool(false))
            {
                return Err(ConstrainError::Compile(format!(
                    "x-guidance option {key:?} is not accepted: it would drop parts of the schema"
                )));
            }
        }
    }
    Ok(schema)
}
