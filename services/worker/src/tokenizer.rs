//! Text <-> token ids with the `tokenizers` crate, built either from a GGUF file's metadata
//! (byte-level BPE vocabulary and merges plus the *name* of the pre-tokenizer rule, or a
//! SentencePiece vocabulary with scores) or from a Hugging Face `tokenizer.json`. Also the
//! incremental detokeniser used while streaming.

use std::collections::HashMap;
use std::path::Path;

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::normalizers::unicode::NFC;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior};

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error(
        "unsupported tokenizer model {0:?} (supported: gpt2 byte-level BPE, llama \
         SentencePiece BPE)"
    )]
    UnsupportedModel(String),
    #[error("SentencePiece vocabulary of {tokens} tokens with {scores} scores")]
    BadScores { tokens: usize, scores: usize },
    #[error(
        "unsupported pre-tokenizer {0:?} (supported: smollm, qwen2, gpt2, default); \
         the GGUF names the rule and we must apply exactly that one"
    )]
    UnsupportedPreTokenizer(String),
    #[error("malformed merge rule {0:?}: expected two tokens separated by a space")]
    BadMerge(String),
    #[error("tokenizer: {0}")]
    Library(String),
    #[error("read {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
}

fn lib_err(e: impl std::fmt::Display) -> TokenizerError {
    TokenizerError::Library(e.to_string())
}

/// GGUF's `tokenizer.ggml.token_type` values: ordinary pieces, and those that mark a token as
/// special (matched whole).
const TOKEN_TYPE_NORMAL: i32 = 1;
const TOKEN_TYPE_CONTROL: i32 = 3;
const TOKEN_TYPE_USER_DEFINED: i32 = 4;

/// SentencePiece's whitespace mark.
const SPM_SPACE: &str = "\u{2581}";

/// What a GGUF file says about its tokenizer.
#[derive(Debug, Clone, Default)]
pub struct GgufTokenizerSpec {
    /// `tokenizer.ggml.model`, e.g. "gpt2".
    pub model: String,
    /// `tokenizer.ggml.pre`, e.g. "smollm" or "qwen2".
    pub pre: String,
    pub tokens: Vec<String>,
    pub merges: Vec<String>,
    pub token_types: Vec<i32>,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub add_bos: bool,
    /// SentencePiece ("llama"): each piece's score (merge priority), whether a space goes
    /// before the text (and after each special token), the unknown token.
    pub scores: Vec<f32>,
    pub add_space_prefix: bool,
    pub unknown: Option<u32>,
}

/// Each token of a GGUF vocabulary with its id (its place in the list).
fn vocab_of(spec: &GgufTokenizerSpec) -> Vocab {
    spec.tokens
        .iter()
        .enumerate()
        .map(|(id, t)| (t.clone(), id as u32))
        .collect()
}

/// SentencePiece BPE as merges: a pair (left, right) merges with the priority of the piece it
/// makes, so ranking every split of every piece by that piece's score reproduces
/// SentencePiece's "merge the best-scoring adjacent pair" rule (as Hugging Face converts
/// these vocabularies). Why by hand: the `tokenizers` crate takes merges, not scores, and no
/// crate converts one to the other.
fn merges_from_scores(spec: &GgufTokenizerSpec) -> Vec<(String, String)> {
    let ids: HashMap<&str, usize> = spec
        .tokens
        .iter()
        .enumerate()
        .map(|(id, t)| (t.as_str(), id))
        .collect();
    let normal = |id: usize| {
        spec.token_types
            .get(id)
            .is_none_or(|&t| t == TOKEN_TYPE_NORMAL)
    };
    // (score of the merged piece, its id, the left part's id): best score first, then the
    // order SentencePiece lists pieces in.
    let mut ranked: Vec<(f32, usize, usize, &str, &str)> = Vec::new();
    for (id, piece) in spec.tokens.iter().enumerate() {
        if !normal(id) {
            continue;
        }
        for (cut, _) in piece.char_indices().skip(1) {
            let (left, right) = piece.split_at(cut);
            if let (Some(&l), Some(&r)) = (ids.get(left), ids.get(right))
                && normal(l)
                && normal(r)
            {
                ranked.push((spec.scores[id], id, l, left, right));
            }
        }
    }
    ranked.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    ranked
        .into_iter()
        .map(|(_, _, _, l, r)| (l.to_string(), r.to_string()))
        .collect()
}

/// Qwen2's split rule (single digits, case-insensitive contractions, newlines kept apart).
const QWEN2_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// A token's byte range in the text it came from: (start, end).
pub type Span = (usize, usize);

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    bos: Option<u32>,
    eos: Option<u32>,
    add_bos: bool,
    specials: HashMap<String, u32>,
}

impl Tokenizer {
    /// Builds the tokenizer a GGUF file describes.
    pub fn from_gguf(spec: &GgufTokenizerSpec) -> Result<Self, TokenizerError> {
        if spec.model == "llama" {
            return Self::sentencepiece(spec);
        }
        if spec.model != "gpt2" {
            return Err(TokenizerError::UnsupportedModel(spec.model.clone()));
        }
        let split = |pattern: &str| -> Result<PreTokenizerWrapper, TokenizerError> {
            let regex = SplitPattern::Regex(pattern.to_string());
            Ok(Split::new(regex, SplitDelimiterBehavior::Isolated, false)
                .map_err(lib_err)?
                .into())
        };
        // ByteLevel(add_prefix_space, trim_offsets, use_regex): with use_regex it applies GPT-2's
        // split rule itself, as the models' own tokenizer.json files say.
        let gpt2_split: PreTokenizerWrapper = ByteLevel::new(false, true, true).into();
        let bytes_only: PreTokenizerWrapper = ByteLevel::new(false, true, false).into();
        let (pre_tokenizer, nfc): (PreTokenizerWrapper, bool) = match spec.pre.as_str() {
            // SmolLM2: every digit on its own, then GPT-2's rule.
            "smollm" => (
                Sequence::new(vec![Digits::new(true).into(), gpt2_split]).into(),
                false,
            ),
            "qwen2" => (
                Sequence::new(vec![split(QWEN2_PATTERN)?, bytes_only]).into(),
                true,
            ),
            "gpt2" | "default" => (gpt2_split, false),
            other => return Err(TokenizerError::UnsupportedPreTokenizer(other.to_string())),
        };

        let merges = spec
            .merges
            .iter()
            .map(|m| {
                m.split_once(' ')
                    .map(|(a, b)| (a.to_string(), b.to_string()))
                    .ok_or_else(|| TokenizerError::BadMerge(m.clone()))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let bpe = BPE::builder()
            .vocab_and_merges(vocab_of(spec), merges)
            .build()
            .map_err(lib_err)?;
        let mut inner = tokenizers::Tokenizer::new(bpe);
        inner.with_pre_tokenizer(Some(pre_tokenizer));
        inner.with_decoder(Some(ByteLevelDecoder::default()));
        if nfc {
            inner.with_normalizer(Some(NFC));
        }
        Ok(Self::with_specials(inner, spec))
    }

    /// A SentencePiece BPE vocabulary (GGUF "llama": Llama 1-2, Mistral, Gemma, Phi-3):
    /// spaces become `▁` (one before the text, and after each special token, when
    /// `add_space_prefix`, as llama.cpp does), pieces merge by score, and characters without
    /// a piece fall back to their bytes' `<0xXX>` tokens.
    fn sentencepiece(spec: &GgufTokenizerSpec) -> Result<Self, TokenizerError> {
        use tokenizers::decoders::byte_fallback::ByteFallback;
        use tokenizers::decoders::fuse::Fuse;
        use tokenizers::decoders::sequence::Sequence as DecoderSequence;
        use tokenizers::decoders::strip::Strip;
        use tokenizers::normalizers::{Prepend, Replace, Sequence as NormalizerSequence};
        if spec.scores.len() != spec.tokens.len() {
            return Err(TokenizerError::BadScores {
                tokens: spec.tokens.len(),
                scores: spec.scores.len(),
            });
        }
        let mut bpe = BPE::builder()
            .vocab_and_merges(vocab_of(spec), merges_from_scores(spec))
            .byte_fallback(true)
            .fuse_unk(true);
        let unknown = spec
            .unknown
            .and_then(|id| spec.tokens.get(id as usize))
            .or_else(|| spec.tokens.iter().find(|t| *t == "<unk>"));
        if let Some(unk) = unknown {
            bpe = bpe.unk_token(unk.clone());
        }
        let mut inner = tokenizers::Tokenizer::new(bpe.build().map_err(lib_err)?);
        let replace = Replace::new(" ", SPM_SPACE).map_err(lib_err)?;
        let mut decoders = vec![
            Replace::new(SPM_SPACE, " ").map_err(lib_err)?.into(),
            ByteFallback::new().into(),
            Fuse::new().into(),
        ];
        if spec.add_space_prefix {
            inner.with_normalizer(Some(NormalizerSequence::new(vec![
                Prepend::new(SPM_SPACE.to_string()).into(),
                replace.into(),
            ])));
            decoders.push(Strip::new(' ', 1, 0).into());
        } else {
            inner.with_normalizer(Some(replace));
        }
        inner.with_decoder(Some(DecoderSequence::new(decoders)));
        Ok(Self::with_specials(inner, spec))
    }

    /// `inner` with the control and user-defined tokens of `spec` matched whole.
    fn with_specials(mut inner: tokenizers::Tokenizer, spec: &GgufTokenizerSpec) -> Self {
        let mut specials = HashMap::new();
        let added: Vec<AddedToken> = spec
            .tokens
            .iter()
            .zip(&spec.token_types)
            .enumerate()
            .filter(|(_, (_, ty))| matches!(**ty, TOKEN_TYPE_CONTROL | TOKEN_TYPE_USER_DEFINED))
            .map(|(id, (t, ty))| {
                specials.insert(t.clone(), id as u32);
                AddedToken::from(t.clone(), *ty == TOKEN_TYPE_CONTROL)
            })
            .collect();
        inner.add_special_tokens(&added);
        Self {
            inner,
            bos: spec.bos,
            eos: spec.eos,
            add_bos: spec.add_bos,
            specials,
        }
    }

    /// Loads a Hugging Face `tokenizer.json`; `bos`/`eos` come from `tokenizer_config.json`.
    pub fn from_file(
        path: &Path,
        bos: Option<&str>,
        eos: Option<&str>,
        add_bos: bool,
    ) -> Result<Self, TokenizerError> {
        let bytes = std::fs::read(path).map_err(|source| TokenizerError::Io {
            path: path.display().to_string(),
            source,
        })?;
        let inner = tokenizers::Tokenizer::from_bytes(&bytes).map_err(lib_err)?;
        let specials: HashMap<String, u32> = inner
            .get_added_tokens_decoder()
            .into_iter()
            .map(|(id, t)| (t.content, id))
            .collect();
        let id = |t: Option<&str>| t.and_then(|t| inner.token_to_id(t));
        Ok(Self {
            bos: id(bos),
            eos: id(eos),
            add_bos,
            specials,
            inner,
        })
    }

    /// Token ids of `text`. Special tokens written in the text (e.g. `<|im_start|>` from a chat
    /// template) are matched whole; the BOS token is prepended when the model asks for it.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let encoding = self.inner.encode_fast(text, false).map_err(lib_err)?;
        let mut ids = Vec::with_capacity(encoding.len() + 1);
        if self.add_bos
            && let Some(bos) = self.bos
        {
            ids.push(bos);
        }
        ids.extend_from_slice(encoding.get_ids());
        Ok(ids)
    }

    /// `encode`'s ids, with the byte span in `text` of each token ((0, 0) for a BOS the model
    /// adds): where a message ends, no token may straddle.
    pub fn encode_with_spans(&self, text: &str) -> Result<(Vec<u32>, Vec<Span>), TokenizerError> {
        let encoding = self.inner.encode(text, false).map_err(lib_err)?;
        let mut ids = Vec::with_capacity(encoding.len() + 1);
        let mut spans = Vec::with_capacity(encoding.len() + 1);
        if self.add_bos
            && let Some(bos) = self.bos
        {
            ids.push(bos);
            spans.push((0, 0));
        }
        ids.extend_from_slice(encoding.get_ids());
        spans.extend_from_slice(encoding.get_offsets());
        Ok((ids, spans))
    }

    /// Text of `ids`, special tokens included as written (`<|im_end|>`) unless `skip_special`.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, TokenizerError> {
        self.inner.decode(ids, skip_special).map_err(lib_err)
    }

    /// The `tokenizers` library's tokenizer (for the grammar engine's token table).
    pub fn library(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    pub fn bos_token(&self) -> Option<u32> {
        self.bos
    }

    pub fn eos_token(&self) -> Option<u32> {
        self.eos
    }

    pub fn token_text(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The id of a special token by its text, e.g. `<|im_end|>`.
    pub fn special_id(&self, text: &str) -> Option<u32> {
        self.specials.get(text).copied()
    }

    pub fn is_special(&self, id: u32) -> bool {
        self.token_text(id)
            .is_some_and(|t| self.specials.get(&t) == Some(&id))
    }
}

/// Turns a growing list of generated ids into text deltas without ever splitting a UTF-8
/// character (or a multi-token grapheme that byte-level BPE spreads over several tokens): a
/// delta is released only once the text decodes without a trailing replacement character.
pub struct StreamDecoder {
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
    skip_special: bool,
}

impl StreamDecoder {
    pub fn new(skip_special: bool) -> Self {
        Self {
            ids: Vec::new(),
            prefix_offset: 0,
            read_offset: 0,
            skip_special,
        }
    }

    /// Adds one token; returns the text it completes, if any.
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<Option<String>, TokenizerError> {
        self.ids.push(id);
        let prefix = tok.decode(
            &self.ids[self.prefix_offset..self.read_offset],
            self.skip_special,
        )?;
        let full = tok.decode(&self.ids[self.prefix_offset..], self.skip_special)?;
        if full.len() > prefix.len() && !full.ends_with('\u{FFFD}') {
            let delta = match full.strip_prefix(prefix.as_str()) {
                Some(rest) => rest.to_string(),
                // Decoding is not always prefix-stable (cleanup rules); release what is new.
                None => full.chars().skip(prefix.chars().count()).collect(),
            };
            self.prefix_offset = self.read_offset;
            self.read_offset = self.ids.len();
            Ok(Some(delta))
        } else {
            Ok(None)
        }
    }

    /// Whatever is still held back (an incomplete character at the very end is emitted as the
    /// replacement character, as any decoder would).
    pub fn flush(&mut self, tok: &Tokenizer) -> Result<Option<String>, TokenizerError> {
        let prefix = tok.decode(
            &self.ids[self.prefix_offset..self.read_offset],
            self.skip_special,
        )?;
        let full = tok.decode(&self.ids[self.prefix_offset..], self.skip_special)?;
        self.prefix_offset = self.ids.len();
        self.read_offset = self.ids.len();
        let rest = match full.strip_prefix(prefix.as_str()) {
            Some(rest) => rest.to_string(),
            // Byte-fallback pieces that no longer form valid UTF-8 together decode as one
            // replacement character each, changing text already released: release what is
            // new, as `push` does.
            None => full.chars().skip(prefix.chars().count()).collect(),
        };
        Ok(Some(rest).filter(|r| !r.is_empty()))
    }
}
