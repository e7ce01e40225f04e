//! Structured output: a request's constraint (a JSON schema or a Lark grammar, which the gateway
//! derives from `response_format` and forced tool calls) compiled with llguidance into a
//! matcher that says, before each token is sampled, which tokens may come next. The grammar
//! engine is a library (the one vLLM, SGLang and llama.cpp use); this module only connects it
//! to our tokenizer and to the sampler.

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};

/// The version compiled in, for `/admin` and the logs.
pub const LLGUIDANCE_VERSION: &str = "llguidance 1.9.1";

#[derive(Debug, thiserror::Error)]
pub enum GrammarError {
    #[error("structured output cannot be set up for this tokenizer: {0}")]
    Setup(String),
    /// The schema or grammar was refused by the engine (the request's fault).
    #[error("the grammar engine rejected the constraint: {0}")]
    Rejected(String),
    #[error("constrained decoding failed: {0}")]
    Matcher(String),
}

/// What a request asks generation to follow.
#[derive(Debug, Clone)]
pub enum Constraint {
    JsonSchema(serde_json::Value),
    Lark(String),
}

/// Our tokenizer as llguidance sees it: every token's bytes in a trie, and a way to tokenize
/// the grammar's literal strings.
struct TokenizerBridge {
    trie: TokTrie,
    tokenizer: tokenizers::Tokenizer,
}

impl TokenizerEnv for TokenizerBridge {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        // Literals are text; bytes that are not (a literal cut inside a character) fall back
        // to the trie's greedy split, which always succeeds.
        std::str::from_utf8(s)
            .ok()
            .and_then(|text| self.tokenizer.encode_fast(text, false).ok())
            .map(|e| e.get_ids().to_vec())
            .unwrap_or_else(|| self.trie.greedy_tokenize(s))
    }
}

/// Compiles constraints for one model; built once at load (the token trie takes a moment).
pub struct GrammarEngine {
    factory: ParserFactory,
}

impl GrammarEngine {
    /// `vocab` is the width of the model's logits (it may exceed the tokenizer's vocabulary:
    /// padding rows are never allowed); `eos` the token that ends a constrained answer.
    pub fn new(
        tokenizer: &tokenizers::Tokenizer,
        vocab: usize,
        eos: u32,
    ) -> Result<Self, GrammarError> {
        // The library asserts on tokenizer shapes it does not expect (they come from a model
        // file): such a model gets no structured output, and says so, rather than a crash.
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            Self::build(tokenizer, vocab, eos)
        }))
        .unwrap_or_else(|_| {
            Err(GrammarError::Setup(
                "the grammar engine cannot read this tokenizer".into(),
            ))
        })
    }

    fn build(
        tokenizer: &tokenizers::Tokenizer,
        vocab: usize,
        eos: u32,
    ) -> Result<Self, GrammarError> {
        let setup = |e: &dyn std::fmt::Display| GrammarError::Setup(e.to_string());
        let json: serde_json::Value = tokenizer
            .to_string(false)
            .map_err(|e| setup(&e))
            .and_then(|s| serde_json::from_str(&s).map_err(|e| setup(&e)))?;
        let mut words =
            llguidance::token_bytes_from_tokenizer_json(&json).map_err(|e| setup(&e))?;
        if words.len() > vocab {
            return Err(GrammarError::Setup(format!(
                "the tokenizer has {} tokens, more than the model's {vocab} logits",
                words.len()
            )));
        }
        words.resize(vocab, Vec::new());
        let info = TokRxInfo::new(vocab as u32, eos);
        let bridge = TokenizerBridge {
            trie: TokTrie::from(&info, &words),
            tokenizer: tokenizer.clone(),
        };
        let env: TokEnv = Arc::new(bridge);
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| setup(&e))?;
        // Errors come back to the caller; nothing is printed on the worker's stderr.
        factory.quiet();
        Ok(Self { factory })
    }

    /// A fresh matcher for `constraint`, or why the engine refuses it.
    pub fn compile(&self, constraint: &Constraint) -> Result<Guide, GrammarError> {
        let grammar = match constraint {
            Constraint::JsonSchema(schema) => TopLevelGrammar::from_json_schema(schema.clone()),
            Constraint::Lark(lark) => TopLevelGrammar::from_lark(lark.clone()),
        };
        // A constraint comes from a request: whatever the library does with it, a panic
        // included, is that request's error, never the worker's end.
        let parser = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.factory.create_parser(grammar)
        }))
        .map_err(|_| GrammarError::Rejected("the grammar engine failed on this constraint".into()))?
        .map_err(|e| GrammarError::Rejected(format!("{e:#}")))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(GrammarError::Rejected(e));
        }
        Ok(Guide { matcher })
    }
}

/// One request's position in its grammar.
pub struct Guide {
    matcher: Matcher,
}

impl std::fmt::Debug for Guide {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Guide")
    }
}

impl Clone for Guide {
    fn clone(&self) -> Self {
        Self {
            matcher: self.matcher.deep_clone(),
        }
    }
}

impl Guide {
    /// The tokens that may come next (only the end token once the grammar is complete).
    pub fn allowed(&mut self) -> Result<SimpleVob, GrammarError> {
        self.matcher
            .compute_mask_or_eos()
            .map_err(|e| GrammarError::Matcher(format!("{e:#}")))
    }

    /// Advances past a sampled token (one the mask allowed).
    pub fn accept(&mut self, token: u32) -> Result<(), GrammarError> {
        self.matcher
            .consume_token(token)
            .map_err(|e| GrammarError::Matcher(format!("{e:#}")))
    }

    /// The grammar is complete and allows nothing more.
    pub fn is_done(&self) -> bool {
        self.matcher.is_stopped()
    }
}
