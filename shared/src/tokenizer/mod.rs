//! Tokenizer wrapper over the Hugging Face `tokenizers` crate, built from `tokenizer.json` or
//! from GGUF metadata (`tokenizer.ggml.*`), plus the model's special ids and chat template, and a
//! UTF-8-safe incremental decoder.

mod check;

use std::path::{Path, PathBuf};

use serde_json::Value;
use tokenizers::decoders::DecoderWrapper;
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::normalizers::{NormalizerWrapper, Prepend, Replace, Sequence as NormalizerSequence};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior};

use crate::gguf::{GgufFile, GgufValue};

/// Errors building or using a tokenizer.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("{source_name}: {message}")]
    Load { source_name: String, message: String },
    #[error("{source_name}: unsupported tokenizer: {message}")]
    Unsupported { source_name: String, message: String },
    #[error("tokenizer failed: {0}")]
    Run(String),
    #[error("token id {id} is out of range (vocabulary has {vocab} entries)")]
    IdOutOfRange { id: u32, vocab: usize },
}

/// A model's tokenizer with its special tokens and chat template.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// Beginning-of-sequence id, if the model has one.
    pub bos_id: Option<u32>,
    /// Ids that end generation.
    pub eos_ids: Vec<u32>,
    /// Whether `encode(.., add_special_tokens = true)` prepends BOS.
    pub add_bos: bool,
    /// Jinja chat template, if the model ships one.
    pub chat_template: Option<String>,
    vocab_size: usize,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size)
            .field("bos_id", &self.bos_id)
            .field("eos_ids", &self.eos_ids)
            .finish()
    }
}

/// GPT-2 style split used by Qwen2 tokenizers (single digits).
const QWEN2_PATTERN: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen3.5's split: Qwen2's, with combining marks (`\p{M}`) kept with the letters they mark.
const QWEN35_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Llama 3 split (digits in runs of up to three).
const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

fn load_err(source_name: &str, message: impl std::fmt::Display) -> TokenizerError {
    TokenizerError::Load {
        source_name: source_name.into(),
        message: message.to_string(),
    }
}

fn string_array<'a>(g: &'a GgufFile, key: &str) -> Result<Vec<&'a str>, TokenizerError> {
    let name = g.path().display().to_string();
    let arr = g
        .get(key)
        .and_then(GgufValue::as_array)
        .ok_or_else(|| load_err(&name, format!("missing metadata '{key}'")))?;
    arr.iter()
        .enumerate()
        .map(|(i, v)| {
            v.as_str()
                .ok_or_else(|| load_err(&name, format!("'{key}'[{i}] is not a string")))
        })
        .collect()
}

/// The pre-tokenizer for a GGUF `tokenizer.ggml.pre` name.
fn pre_tokenizer_for(source_name: &str, pre: &str) -> Result<PreTokenizerWrapper, TokenizerError> {
    let byte_level = |use_regex| PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, use_regex));
    let split = |pattern: &str| -> Result<PreTokenizerWrapper, TokenizerError> {
        let s = Split::new(
            SplitPattern::Regex(pattern.into()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(|e| load_err(source_name, e))?;
        Ok(PreTokenizerWrapper::Split(s))
    };
    Ok(match pre {
        "gpt-2" | "gpt2" | "default" => byte_level(true),
        // SmolLM2 (and StarCoder) isolate every digit before the GPT-2 byte-level split.
        "smollm" | "starcoder" | "refact" => PreTokenizerWrapper::Sequence(Sequence::new(vec![
            PreTokenizerWrapper::Digits(Digits::new(true)),
            byte_level(true),
        ])),
        "qwen2" => PreTokenizerWrapper::Sequence(Sequence::new(vec![split(QWEN2_PATTERN)?, byte_level(false)])),
        "qwen35" => PreTokenizerWrapper::Sequence(Sequence::new(vec![split(QWEN35_PATTERN)?, byte_level(false)])),
        "llama3" | "llama-bpe" => {
            PreTokenizerWrapper::Sequence(Sequence::new(vec![split(LLAMA3_PATTERN)?, byte_level(false)]))
        }
        other => {
            return Err(TokenizerError::Unsupported {
                source_name: source_name.into(),
                message: format!("pre-tokenizer '{other}' (supported: gpt2, smollm, qwen2, qwen35, llama-bpe)"),
            });
        }
    })
}

/// How the pre-tokenizer a GGUF file names in `tokenizer.ggml.pre` splits `text` (the pieces the
/// BPE model then encodes, in byte-level form); for checks against other implementations.
pub fn gguf_pre_tokenize(pre: &str, text: &str) -> Result<Vec<String>, TokenizerError> {
    use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};
    let p = pre_tokenizer_for("pre-tokenizer", pre)?;
    let mut s = PreTokenizedString::from(text);
    p.pre_tokenize(&mut s).map_err(|e| TokenizerError::Run(e.to_string()))?;
    Ok(s.get_splits(OffsetReferential::Original, OffsetType::Char)
        .into_iter()
        .map(|(piece, _, _)| piece.to_string())
        .collect())
}

/// Byte-level BPE from `tokenizer.ggml.merges`, with the pre-tokenizer `tokenizer.ggml.pre`
/// names.
fn byte_level_bpe(g: &GgufFile, name: &str, vocab: Vocab) -> Result<tokenizers::Tokenizer, TokenizerError> {
    let merges = string_array(g, "tokenizer.ggml.merges")?;
    let merges = merges
        .iter()
        .enumerate()
        .map(|(i, m)| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .ok_or_else(|| load_err(name, format!("merge #{i} '{m}' is not two tokens separated by a space")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    check::check_merges(
        name,
        |t| vocab.contains_key(t),
        merges.iter().map(|(a, b)| (a.as_str(), b.as_str())),
        "",
    )?;
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .map_err(|e| load_err(name, e))?;
    let pre = g.get_str("tokenizer.ggml.pre").unwrap_or("default");
    let mut inner = tokenizers::Tokenizer::new(bpe);
    inner.with_pre_tokenizer(Some(pre_tokenizer_for(name, pre)?));
    inner.with_decoder(Some(ByteLevelDecoder::default()));
    Ok(inner)
}

/// Longest SentencePiece piece accepted (real ones are at most 16 characters).
const MAX_PIECE_BYTES: usize = 256;

/// SentencePiece BPE (Llama 2, Mistral): spaces become `▁` (one prepended, unless
/// `tokenizer.ggml.add_space_prefix` is false), pieces merge in the order of their scores, and
/// characters outside the vocabulary fall back to `<0xNN>` byte pieces. GGUF files carry the
/// pieces and scores, not merges: a merge is every split of a piece into two pieces, ranked by
/// the whole piece's score (ties by the parts' ids), which is how SentencePiece's BPE applies
/// them.
fn sentencepiece_bpe(
    g: &GgufFile,
    name: &str,
    tokens: &[&str],
    vocab: Vocab,
) -> Result<tokenizers::Tokenizer, TokenizerError> {
    let scores = g
        .get("tokenizer.ggml.scores")
        .and_then(GgufValue::as_array)
        .ok_or_else(|| {
            load_err(
                name,
                "missing metadata 'tokenizer.ggml.scores' (SentencePiece needs them)",
            )
        })?;
    if scores.len() != tokens.len() {
        return Err(load_err(
            name,
            format!("{} scores for {} tokens", scores.len(), tokens.len()),
        ));
    }
    let scores: Vec<f64> = scores
        .iter()
        .enumerate()
        .map(|(i, v)| {
            v.as_f64()
                .filter(|x| x.is_finite())
                .ok_or_else(|| load_err(name, format!("'tokenizer.ggml.scores'[{i}] is not a finite number")))
        })
        .collect::<Result<_, _>>()?;
    let mut merges: Vec<(f64, u32, u32)> = Vec::new();
    for (id, piece) in tokens.iter().enumerate() {
        // Every split of a piece is looked up, so a hostile piece must not be long.
        if piece.len() > MAX_PIECE_BYTES {
            return Err(load_err(
                name,
                format!(
                    "token {id} is {} bytes long (SentencePiece pieces are at most {MAX_PIECE_BYTES})",
                    piece.len()
                ),
            ));
        }
        let start = merges.len();
        for (at, _) in piece.char_indices().skip(1) {
            if let (Some(&l), Some(&r)) = (vocab.get(&piece[..at]), vocab.get(&piece[at..])) {
                merges.push((scores[id], l, r));
            }
        }
        merges[start..].sort_by_key(|m| (m.1, m.2));
    }
    // Stable: equal scores keep the piece order above.
    merges.sort_by(|a, b| b.0.total_cmp(&a.0));
    let merges: Vec<(String, String)> = merges
        .into_iter()
        .map(|(_, l, r)| (tokens[l as usize].to_string(), tokens[r as usize].to_string()))
        .collect();
    let unk = g
        .get_u64("tokenizer.ggml.unknown_token_id")
        .and_then(|i| tokens.get(i as usize))
        .copied()
        .unwrap_or("<unk>");
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .unk_token(unk.to_string())
        .fuse_unk(true)
        .byte_fallback(true)
        .build()
        .map_err(|e| load_err(name, e))?;
    let mut inner = tokenizers::Tokenizer::new(bpe);
    let space = |to: &str| Replace::new(" ", to).map_err(|e| load_err(name, e));
    let add_prefix = g
        .get("tokenizer.ggml.add_space_prefix")
        .and_then(GgufValue::as_bool)
        .unwrap_or(true);
    let mut normalizers = Vec::new();
    if add_prefix {
        normalizers.push(NormalizerWrapper::Prepend(Prepend::new("▁".into())));
    }
    normalizers.push(NormalizerWrapper::Replace(space("▁")?));
    inner
        .with_normalizer(Some(NormalizerSequence::new(normalizers)))
        .map_err(|e| load_err(name, e))?;
    let mut decoders = vec![
        DecoderWrapper::Replace(Replace::new("▁", " ").map_err(|e| load_err(name, e))?),
        DecoderWrapper::ByteFallback(ByteFallback::new()),
        DecoderWrapper::Fuse(Fuse::new()),
    ];
    if add_prefix {
        decoders.push(DecoderWrapper::Strip(Strip::new(' ', 1, 0)));
    }
    inner.with_decoder(Some(DecoderSequence::new(decoders)));
    Ok(inner)
}

impl Tokenizer {
    /// Build the tokenizer described by a GGUF file's `tokenizer.ggml.*` metadata: byte-level
    /// BPE (`gpt2`: Llama 3, Qwen, SmolLM2) or SentencePiece BPE (`llama`: Llama 2, Mistral).
    pub fn from_gguf(g: &GgufFile) -> Result<Self, TokenizerError> {
        let name = g.path().display().to_string();
        let model = g
            .get_str("tokenizer.ggml.model")
            .ok_or_else(|| load_err(&name, "missing metadata 'tokenizer.ggml.model'"))?;
        let tokens = string_array(g, "tokenizer.ggml.tokens")?;
        let types: Vec<u64> = match g.get("tokenizer.ggml.token_type").and_then(GgufValue::as_array) {
            Some(a) => a.iter().map(|v| v.as_u64().unwrap_or(1)).collect(),
            None => vec![1; tokens.len()],
        };
        let vocab: Vocab = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| ((*t).to_string(), i as u32))
            .collect();
        if vocab.len() != tokens.len() {
            return Err(load_err(&name, "tokenizer.ggml.tokens contains duplicate tokens"));
        }
        let mut inner = match model {
            "gpt2" => byte_level_bpe(g, &name, vocab)?,
            "llama" => sentencepiece_bpe(g, &name, &tokens, vocab)?,
            other => {
                return Err(TokenizerError::Unsupported {
                    source_name: name,
                    message: format!(
                        "tokenizer model '{other}' (supported: 'gpt2', byte-level BPE; 'llama', SentencePiece BPE)"
                    ),
                });
            }
        };
        // Control tokens (type 3) are special; user-defined ones (type 4) match literally too.
        let added: Vec<AddedToken> = tokens
            .iter()
            .zip(&types)
            .filter(|(_, t)| **t == 3 || **t == 4)
            .map(|(tok, t)| AddedToken::from(tok.to_string(), *t == 3).normalized(false))
            .collect();
        inner.add_special_tokens(added).map_err(|e| load_err(&name, e))?;
        // An id past u32 is kept out of range (not truncated) so check_ids names it.
        let id = |key: &str| g.get_u64(key).map(|v| u32::try_from(v).unwrap_or(u32::MAX));
        let mut eos_ids: Vec<u32> = [
            "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.eot_token_id",
            "tokenizer.ggml.eom_token_id",
        ]
        .iter()
        .filter_map(|k| id(k))
        .collect();
        eos_ids.dedup();
        let tok = Tokenizer {
            vocab_size: tokens.len(),
            inner,
            bos_id: id("tokenizer.ggml.bos_token_id"),
            eos_ids,
            // llama.cpp's defaults: SentencePiece models start with BOS unless told otherwise.
            add_bos: g
                .get("tokenizer.ggml.add_bos_token")
                .and_then(GgufValue::as_bool)
                .unwrap_or(model == "llama"),
            chat_template: g.get_str("tokenizer.chat_template").map(str::to_string),
        };
        tok.check_ids(&name)?;
        Ok(tok)
    }

    /// Load `tokenizer.json` (+ `tokenizer_config.json`, `chat_template.jinja`,
    /// `generation_config.json`, `config.json`) from a Hugging Face model directory.
    pub fn from_hf_dir(dir: &Path) -> Result<Self, TokenizerError> {
        let path = dir.join("tokenizer.json");
        let name = path.display().to_string();
        let bytes = std::fs::read(&path).map_err(|e| load_err(&name, e))?;
        // Parsed to a value first: a syntax error is named here, and `tokenizers` then builds
        // from a checked value (its own parser panics on some malformed files).
        let json: Value = serde_json::from_slice(&bytes).map_err(|e| load_err(&name, format!("invalid JSON: {e}")))?;
        check::check_tokenizer_json(&name, &json)?;
        let inner: tokenizers::Tokenizer = serde_json::from_value(json).map_err(|e| load_err(&name, e))?;
        let read_json = |file: &str| -> Result<Option<Value>, TokenizerError> {
            let p: PathBuf = dir.join(file);
            match std::fs::read_to_string(&p) {
                Err(_) => Ok(None),
                Ok(text) => serde_json::from_str(&text)
                    .map(Some)
                    .map_err(|e| load_err(&p.display().to_string(), format!("invalid JSON: {e}"))),
            }
        };
        let tcfg = read_json("tokenizer_config.json")?.unwrap_or(Value::Null);
        let gen_cfg = read_json("generation_config.json")?.unwrap_or(Value::Null);
        let model_cfg = read_json("config.json")?.unwrap_or(Value::Null);
        let token_id = |v: &Value| -> Option<u32> {
            let text = v.as_str().or_else(|| v.get("content").and_then(Value::as_str))?;
            inner.token_to_id(text)
        };
        let ids_of = |v: &Value| -> Vec<u32> {
            match v {
                Value::Number(n) => n.as_u64().and_then(|x| u32::try_from(x).ok()).into_iter().collect(),
                Value::Array(a) => a
                    .iter()
                    .filter_map(Value::as_u64)
                    .filter_map(|x| u32::try_from(x).ok())
                    .collect(),
                _ => vec![],
            }
        };
        let mut eos_ids = ids_of(&gen_cfg["eos_token_id"]);
        for extra in ids_of(&model_cfg["eos_token_id"])
            .into_iter()
            .chain(token_id(&tcfg["eos_token"]))
        {
            if !eos_ids.contains(&extra) {
                eos_ids.push(extra);
            }
        }
        let bos_id = ids_of(&gen_cfg["bos_token_id"])
            .first()
            .copied()
            .or_else(|| token_id(&tcfg["bos_token"]));
        let chat_template = match std::fs::read_to_string(dir.join("chat_template.jinja")) {
            Ok(t) => Some(t),
            Err(_) => match &tcfg["chat_template"] {
                Value::String(s) => Some(s.clone()),
                // A list of named templates: use the default one.
                Value::Array(list) => list
                    .iter()
                    .find(|t| t["name"] == "default")
                    .or(list.first())
                    .and_then(|t| t["template"].as_str())
                    .map(str::to_string),
                _ => None,
            },
        };
        let tok = Tokenizer {
            vocab_size: inner.get_vocab_size(true),
            inner,
            bos_id,
            eos_ids,
            add_bos: tcfg["add_bos_token"].as_bool().unwrap_or(false),
            chat_template,
        };
        tok.check_ids(&name)?;
        Ok(tok)
    }

    fn check_ids(&self, source_name: &str) -> Result<(), TokenizerError> {
        for id in self.bos_id.iter().chain(&self.eos_ids) {
            if *id as usize >= self.vocab_size {
                return Err(load_err(
                    source_name,
                    format!("special token id {id} is outside the vocabulary of {}", self.vocab_size),
                ));
            }
        }
        Ok(())
    }

    /// Number of ids the tokenizer knows (including added tokens).
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The underlying `tokenizers` object (e.g. to save it as tokenizer.json).
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// Token ids for `text`; special-token text like `<|im_start|>` maps to its single id.
    /// With `add_special_tokens`, BOS is prepended when the model asks for it.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizerError> {
        // A tokenizer.json post-processor (e.g. Llama 3's) adds BOS itself; otherwise BOS
        // follows `add_bos_token` from the tokenizer config or GGUF metadata.
        let has_post = self.inner.get_post_processor().is_some();
        let enc = self
            .inner
            .encode(text, add_special_tokens && has_post)
            .map_err(|e| TokenizerError::Run(e.to_string()))?;
        let mut ids = Vec::with_capacity(enc.len() + 1);
        if add_special_tokens
            && !has_post
            && self.add_bos
            && let Some(bos) = self.bos_id
        {
            ids.push(bos);
        }
        ids.extend_from_slice(enc.get_ids());
        Ok(ids)
    }

    /// Text for `ids`, with special tokens dropped when `skip_special_tokens`.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, TokenizerError> {
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= self.vocab_size) {
            return Err(TokenizerError::IdOutOfRange {
                id,
                vocab: self.vocab_size,
            });
        }
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| TokenizerError::Run(e.to_string()))
    }

    /// Whether `id` ends generation.
    pub fn is_eos(&self, id: u32) -> bool {
        self.eos_ids.contains(&id)
    }

    /// The text of a single token, if `id` is in range.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }
}

/// Turns a growing list of token ids into text deltas without ever emitting half a UTF-8
/// character: a delta is released only once it no longer ends in a replacement character.
#[derive(Debug, Clone, Default)]
pub struct IncrementalDecoder {
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
    skip_special_tokens: bool,
}

impl IncrementalDecoder {
    /// A decoder that drops special tokens from the text when `skip_special_tokens`.
    pub fn new(skip_special_tokens: bool) -> Self {
        Self {
            skip_special_tokens,
            ..Self::default()
        }
    }

    /// Add one token; returns the text it completes (possibly empty).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String, TokenizerError> {
        self.ids.push(id);
        // Decoding from a few tokens back keeps byte-level merges and leading spaces right.
        let prefix = tok.decode(
            &self.ids[self.prefix_offset..self.read_offset],
            self.skip_special_tokens,
        )?;
        let full = tok.decode(&self.ids[self.prefix_offset..], self.skip_special_tokens)?;
        if full.len() > prefix.len() && !full.ends_with('\u{FFFD}') && full.is_char_boundary(prefix.len()) {
            let delta = full[prefix.len()..].to_string();
            self.prefix_offset = self.read_offset;
            self.read_offset = self.ids.len();
            Ok(delta)
        } else {
            Ok(String::new())
        }
    }

    /// Text still held back (an incomplete character at the very end), flushed lossily.
    pub fn finish(&mut self, tok: &Tokenizer) -> Result<String, TokenizerError> {
        let prefix = tok.decode(
            &self.ids[self.prefix_offset..self.read_offset],
            self.skip_special_tokens,
        )?;
        let full = tok.decode(&self.ids[self.prefix_offset..], self.skip_special_tokens)?;
        self.prefix_offset = self.ids.len();
        self.read_offset = self.ids.len();
        Ok(if full.len() > prefix.len() && full.is_char_boundary(prefix.len()) {
            full[prefix.len()..].to_string()
        } else {
            String::new()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::writer::to_bytes;

    fn tiny_gguf(model: &str, pre: &str, add_bos: bool) -> (tempfile::TempDir, std::path::PathBuf) {
        let s = |v: &str| GgufValue::String(v.into());
        let tokens = ["<s>", "</s>", "a", "b", "ab", "Ġ", "Ġab"];
        let meta = vec![
            ("tokenizer.ggml.model".to_string(), s(model)),
            ("tokenizer.ggml.pre".into(), s(pre)),
            (
                "tokenizer.ggml.tokens".into(),
                GgufValue::Array(tokens.iter().map(|t| s(t)).collect()),
            ),
            (
                "tokenizer.ggml.merges".into(),
                GgufValue::Array(vec![s("a b"), s("Ġ ab")]),
            ),
            (
                "tokenizer.ggml.token_type".into(),
                GgufValue::Array([3, 3, 1, 1, 1, 1, 1].iter().map(|&t| GgufValue::I32(t)).collect()),
            ),
            ("tokenizer.ggml.bos_token_id".into(), GgufValue::U32(0)),
            ("tokenizer.ggml.eos_token_id".into(), GgufValue::U32(1)),
            ("tokenizer.ggml.add_bos_token".into(), GgufValue::Bool(add_bos)),
        ];
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tok.gguf");
        std::fs::write(&path, to_bytes(&meta, &[])).unwrap();
        (dir, path)
    }

    #[test]
    fn gguf_bpe_with_bos_and_special_tokens() {
        let (_d, p) = tiny_gguf("gpt2", "gpt2", true);
        let tok = Tokenizer::from_gguf(&GgufFile::open(&p).unwrap()).unwrap();
        assert_eq!(tok.encode("ab ab", true).unwrap(), vec![0, 4, 6]);
        assert_eq!(tok.encode("ab ab", false).unwrap(), vec![4, 6]);
        assert_eq!(tok.encode("ab</s>", false).unwrap(), vec![4, 1]);
        assert_eq!(tok.decode(&[0, 4, 6, 1], true).unwrap(), "ab ab");
        assert!(tok.is_eos(1));
        assert!(matches!(
            tok.decode(&[7], false),
            Err(TokenizerError::IdOutOfRange { id: 7, vocab: 7 })
        ));
    }

    /// Files the fuzzer found panicking inside `tokenizers` (fuzz/regressions/tokenizer_json)
    /// are refused with an error naming the file.
    #[test]
    fn hostile_tokenizer_json_is_an_error_not_a_panic() {
        let dir = tempfile::tempdir().unwrap();
        for (text, want) in [
            (r#"{"decoder":{"a"}}"#, "invalid JSON"),
            (
                r#"{"model":{"type":"BPE","vocab":{"a":0,"b":1},"merges":["a b"]}}"#,
                "merged token 'ab'",
            ),
            (r#"{"normalizer":{"type":"Precompiled"}}"#, "normalizer 'Precompiled'"),
        ] {
            std::fs::write(dir.path().join("tokenizer.json"), text).unwrap();
            let e = Tokenizer::from_hf_dir(dir.path()).unwrap_err().to_string();
            assert!(e.contains("tokenizer.json") && e.contains(want), "{text}: {e}");
        }
    }

    #[test]
    fn unsupported_tokenizers_are_named() {
        let (_d, p) = tiny_gguf("t5", "default", false);
        let e = Tokenizer::from_gguf(&GgufFile::open(&p).unwrap())
            .unwrap_err()
            .to_string();
        assert!(e.contains("tokenizer model 't5'") && e.contains("SentencePiece"), "{e}");
        // A SentencePiece vocabulary without its scores cannot rank its merges.
        let (_d, p) = tiny_gguf("llama", "default", false);
        let e = Tokenizer::from_gguf(&GgufFile::open(&p).unwrap())
            .unwrap_err()
            .to_string();
        assert!(e.contains("tokenizer.ggml.scores"), "{e}");
        let (_d, p) = tiny_gguf("gpt2", "mystery", false);
        let e = Tokenizer::from_gguf(&GgufFile::open(&p).unwrap())
            .unwrap_err()
            .to_string();
        assert!(e.contains("pre-tokenizer 'mystery'"), "{e}");
    }
}
