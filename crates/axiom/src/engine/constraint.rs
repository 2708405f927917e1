//! Constrained decoding: a sequence's output held to a JSON schema, a regular expression, a list
//! of choices or a grammar, by masking out every token that cannot continue it.
//!
//! llguidance compiles the constraint and computes each step's mask over the tokenizer's
//! vocabulary ([`super::token_env`] describes the vocabulary to it). A [`Constraint`] is one
//! sequence's parser state: [`Constraint::mask`] gives the tokens allowed next (the scheduler
//! computes it on another thread while the model runs the step), [`Constraint::accept`] advances
//! it by the sampled token and says when the grammar is complete.

use super::gbnf::gbnf_to_lark;
use super::token_env::tok_env;
use crate::tokenizer::Tokenizer;
use crate::Result;
use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use serde_json::{json, Value};
use toktrie::SimpleVob;

/// What a sequence's output must match.
#[derive(Debug, Clone, PartialEq)]
pub enum ConstraintSpec {
    /// Any JSON object.
    JsonObject,
    /// JSON valid under `schema`. `strict`: every keyword of the schema must be enforced (one
    /// llguidance cannot enforce is an error); otherwise such keywords are ignored.
    JsonSchema { schema: Value, strict: bool },
    /// Text the regular expression matches as a whole.
    Regex(String),
    /// Exactly one of these texts.
    Choice(Vec<String>),
    /// A grammar in llguidance's Lark syntax, from its `start` rule.
    Lark(String),
    /// A grammar in llama.cpp's GBNF, from its `root` rule.
    Gbnf(String),
}

/// A constraint that cannot be compiled (a bad schema, regex or grammar), or a failure while
/// following one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ConstraintError(pub String);

impl ConstraintSpec {
    fn grammar(&self) -> std::result::Result<TopLevelGrammar, ConstraintError> {
        Ok(match self {
            ConstraintSpec::JsonObject => json_schema(json!({"type": "object"}), true)?,
            ConstraintSpec::JsonSchema { schema, strict } => json_schema(schema.clone(), *strict)?,
            ConstraintSpec::Regex(regex) => TopLevelGrammar::from_regex(regex),
            ConstraintSpec::Choice(choices) => {
                if choices.is_empty() {
                    return Err(ConstraintError("the list of choices is empty".into()));
                }
                // Lark string literals are JSON strings.
                let literals: Vec<String> = choices.iter().map(|c| Value::from(c.as_str()).to_string()).collect();
                TopLevelGrammar::from_lark(format!("start: {}", literals.join(" | ")))
            }
            ConstraintSpec::Lark(grammar) => TopLevelGrammar::from_lark(grammar.clone()),
            ConstraintSpec::Gbnf(grammar) => TopLevelGrammar::from_lark(gbnf_to_lark(grammar)?),
        })
    }
}

fn json_schema(schema: Value, strict: bool) -> std::result::Result<TopLevelGrammar, ConstraintError> {
    Ok(TopLevelGrammar::from_json_schema(with_json_options(schema, strict)?))
}

/// `schema` with llguidance's options for it: at most a short run of whitespace between tokens
/// (the layout a model expects, but no endless whitespace), and unenforceable keywords an error
/// when `strict`. The schema's own `x-guidance` options override these.
pub(crate) fn with_json_options(mut schema: Value, strict: bool) -> std::result::Result<Value, ConstraintError> {
    let Some(object) = schema.as_object_mut() else {
        return Err(ConstraintError("the JSON schema must be an object".into()));
    };
    let mut options = json!({"whitespace_pattern": WHITESPACE, "lenient": !strict});
    if let (Some(ours), Some(Value::Object(theirs))) = (options.as_object_mut(), object.get("x-guidance")) {
        ours.extend(theirs.clone());
    }
    object.insert("x-guidance".into(), options);
    Ok(schema)
}

/// Whitespace allowed between JSON tokens: enough for indented output a few levels deep.
const WHITESPACE: &str = r"[\x20\x0A\x0D\x09]{1,24}";

/// Compiles constraints for one tokenizer (building its token trie once).
pub struct Grammars {
    factory: ParserFactory,
}

impl Grammars {
    pub fn new(tokenizer: &Tokenizer) -> Result<Grammars> {
        let env = tok_env(tokenizer)?;
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| crate::Error::Tokenizer(e.to_string()))?;
        factory.quiet();
        Ok(Grammars { factory })
    }

    /// A fresh parser for `spec`, or why `spec` is invalid.
    pub fn compile(&self, spec: &ConstraintSpec) -> std::result::Result<Constraint, ConstraintError> {
        let parser = self
            .factory
            .create_parser(spec.grammar()?)
            .map_err(|e| ConstraintError(e.to_string()))?;
        let matcher = Matcher::new(Ok(parser));
        match matcher.get_error() {
            Some(e) => Err(ConstraintError(e)),
            None => Ok(Constraint { matcher }),
        }
    }
}

/// One sequence's place in its constraint.
pub struct Constraint {
    matcher: Matcher,
}

impl Constraint {
    /// The tokens that may come next; end-of-generation tokens only where the grammar may end.
    pub fn mask(&mut self) -> std::result::Result<TokenMask, ConstraintError> {
        self.matcher
            .compute_mask()
            .map(TokenMask)
            .map_err(|e| ConstraintError(format!("the constraint failed: {e}")))
    }

    /// Advances by the sampled token; true once the grammar is complete (nothing may follow).
    pub fn accept(&mut self, token: u32) -> std::result::Result<bool, ConstraintError> {
        self.matcher
            .consume_token(token)
            .map_err(|e| ConstraintError(format!("the constraint refused token {token}: {e}")))?;
        Ok(self.matcher.is_stopped())
    }
}

/// The tokens a constraint allows at one step.
pub struct TokenMask(SimpleVob);

impl TokenMask {
    /// Sets the logit of every token not allowed (and of any id past the vocabulary) to -inf.
    pub fn apply(&self, logits: &mut [f32]) {
        let bits = self.0.as_slice();
        for (word, logits) in logits.chunks_mut(32).enumerate() {
            let allowed = bits.get(word).copied().unwrap_or(0);
            // Most words of a mask are all one way: skip the bits of a fully allowed one.
            if allowed != u32::MAX {
                for (bit, logit) in logits.iter_mut().enumerate() {
                    if allowed >> bit & 1 == 0 {
                        *logit = f32::NEG_INFINITY;
                    }
                }
            }
        }
    }

    pub fn allows(&self, token: u32) -> bool {
        (token as usize) < self.0.len() && self.0.is_allowed(token)
    }

    /// The mask as `Kernels::argmax` takes it: token i is bit i % 32 of word i / 32 (ids past
    /// the vocabulary not allowed).
    pub fn write_bits(&self, words: &mut [u32]) {
        let bits = self.0.as_slice();
        let n = bits.len().min(words.len());
        words[..n].copy_from_slice(&bits[..n]);
        words[n..].fill(0);
    }
}
