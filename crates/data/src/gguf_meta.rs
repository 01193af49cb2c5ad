//! A tokenizer as a GGUF file's `tokenizer.*` metadata, as llama.cpp's
//! converter (`convert_hf_to_gguf.py`) writes a byte-level BPE vocabulary:
//! `tokenizer.ggml.model = "gpt2"`, the pre-tokenizer's llama.cpp name, the
//! tokens in id order (spelled as the vocabulary spells them), their types
//! (1 normal, 3 control for special added tokens, 4 user-defined for other
//! added tokens, 5 unused for an id the vocabulary leaves empty, spelled
//! `[PAD{id}]`, as are ids past the tokenizer's up to the model's vocabulary),
//! the merges as `"a b"`, the special ids, `add_bos_token`
//! (and `add_eos_token` when set) and the chat template.
//!
//! The byte tokenizer (ids = byte values) is written as a vocabulary of the
//! 256 byte-level characters in byte order with no merges: byte-level BPE
//! maps each byte to its character and merges nothing, so it gives every
//! byte its own value as id, as [`crate::ByteTokenizer`] does.

use crate::bpe::{byte_to_char, BpeTokenizer, PreTokenizer};
use crate::error::DataError;
use crate::tokenizer::Tokenizer;
use gguf::{Value, ValueType};

/// llama.cpp's token types.
const NORMAL: i32 = 1;
const CONTROL: i32 = 3;
const USER_DEFINED: i32 = 4;
const UNUSED: i32 = 5;

fn format_err(source_name: &str, problem: impl Into<String>) -> DataError {
    DataError::TokenizerFormat { source_name: source_name.into(), problem: problem.into() }
}

fn strings(items: impl IntoIterator<Item = String>) -> Value {
    Value::Array(ValueType::String, items.into_iter().map(Value::String).collect())
}

/// The keys every byte-level vocabulary starts with.
fn head(pre: PreTokenizer, tokens: Vec<String>, types: Vec<i32>, merges: Vec<String>) -> Vec<(String, Value)> {
    vec![
        ("tokenizer.ggml.add_space_prefix".into(), Value::Bool(false)),
        ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
        ("tokenizer.ggml.pre".into(), Value::String(pre.gguf_name().into())),
        ("tokenizer.ggml.tokens".into(), strings(tokens)),
        ("tokenizer.ggml.token_type".into(), Value::Array(ValueType::I32, types.into_iter().map(Value::I32).collect())),
        ("tokenizer.ggml.merges".into(), strings(merges)),
    ]
}

impl Tokenizer {
    /// The tokenizer as GGUF `tokenizer.*` metadata (see the module's doc),
    /// in the order llama.cpp's converter writes the keys. Errors when a
    /// BPE tokenizer's pre-tokenizer is not one llama.cpp names (see
    /// [`PreTokenizer`]) or its vocabulary cannot be read back.
    pub fn gguf_metadata(&self) -> Result<Vec<(String, Value)>, DataError> {
        self.gguf_metadata_padded(self.vocab_size())
    }

    /// [`Tokenizer::gguf_metadata`] for a model of `n_vocab` ids: llama.cpp
    /// takes the vocabulary's size from the token list and refuses a model
    /// whose embedding has another, so ids past the tokenizer's are listed
    /// as llama.cpp's converter pads them (`[PAD{id}]`, type 5, unused). A
    /// tokenizer with more ids than the model is an error.
    pub fn gguf_metadata_padded(&self, n_vocab: usize) -> Result<Vec<(String, Value)>, DataError> {
        if self.vocab_size() > n_vocab {
            return Err(format_err(
                self.name(),
                format!("the tokenizer has {} ids, the model only {n_vocab}", self.vocab_size()),
            ));
        }
        match self {
            Tokenizer::Byte(_) => {
                let mut tokens: Vec<String> = byte_to_char().iter().map(|c| c.to_string()).collect();
                let mut types = vec![NORMAL; tokens.len()];
                pad(&mut tokens, &mut types, n_vocab);
                let mut m = head(PreTokenizer::Gpt2, tokens, types, Vec::new());
                m.insert(1, ("tokenizer.ggml.add_bos_token".into(), Value::Bool(false)));
                Ok(m)
            }
            Tokenizer::Bpe(t) => bpe_metadata(t, n_vocab),
        }
    }
}

/// Unused ids up to `n`, spelled as llama.cpp's converter spells them.
fn pad(tokens: &mut Vec<String>, types: &mut Vec<i32>, n: usize) {
    for id in tokens.len()..n {
        tokens.push(format!("[PAD{id}]"));
        types.push(UNUSED);
    }
}

/// The pre-tokenizer `t` splits with, by comparing it with each one
/// [`PreTokenizer`] builds.
fn pre_tokenizer_of(t: &BpeTokenizer) -> Result<PreTokenizer, DataError> {
    let ours = serde_json::to_value(t.inner().get_pre_tokenizer()).map_err(|e| format_err(t.name(), e.to_string()))?;
    PreTokenizer::ALL.into_iter().find(|p| serde_json::to_value(p.build()).ok().as_ref() == Some(&ours)).ok_or_else(
        || {
            format_err(
                t.name(),
                format!(
                    "its pre-tokenizer {ours} is none llama.cpp names here (GPT-2's ByteLevel → gpt-2, SmolLM's Digits + ByteLevel → smollm); a GGUF file needs tokenizer.ggml.pre"
                ),
            )
        },
    )
}

fn bpe_metadata(t: &BpeTokenizer, n_vocab: usize) -> Result<Vec<(String, Value)>, DataError> {
    let name = t.name();
    let pre = pre_tokenizer_of(t)?;
    // The tokenizer.json form: the model's vocabulary and merges in rank
    // order, and the added tokens with their special flags.
    let json: serde_json::Value = serde_json::from_str(
        &t.inner().to_string(false).map_err(|source| DataError::Tokenizer { what: "serialising".into(), source })?,
    )
    .map_err(|e| format_err(name, e.to_string()))?;
    let model = &json["model"];
    if model["type"] != "BPE" {
        return Err(format_err(name, format!("model type {} is not BPE", model["type"])));
    }
    let n = t.vocab_size();
    let mut tokens: Vec<Option<(String, i32)>> = vec![None; n];
    let mut put = |id: Option<u64>, token: &str, ty: i32| -> Result<(), DataError> {
        let slot = id
            .and_then(|id| tokens.get_mut(id as usize))
            .ok_or_else(|| format_err(name, format!("token {token:?} has id {id:?}, outside the vocabulary of {n}")))?;
        *slot = Some((token.to_string(), ty));
        Ok(())
    };
    for (token, id) in model["vocab"].as_object().into_iter().flatten() {
        put(id.as_u64(), token, NORMAL)?;
    }
    for added in json["added_tokens"].as_array().into_iter().flatten() {
        let ty = if added["special"].as_bool() == Some(true) { CONTROL } else { USER_DEFINED };
        put(added["id"].as_u64(), added["content"].as_str().unwrap_or_default(), ty)?;
    }
    let (mut tokens, mut types): (Vec<String>, Vec<i32>) =
        tokens.into_iter().enumerate().map(|(id, t)| t.unwrap_or_else(|| (format!("[PAD{id}]"), UNUSED))).unzip();
    pad(&mut tokens, &mut types, n_vocab);
    // Merges: "a b" strings (older tokenizers) or ["a", "b"] pairs.
    let merges = model["merges"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|m| match (m.as_str(), m.as_array().map(Vec::as_slice)) {
            (Some(s), _) => Ok(s.to_string()),
            (None, Some([a, b])) => {
                Ok(format!("{} {}", a.as_str().unwrap_or_default(), b.as_str().unwrap_or_default()))
            }
            _ => Err(format_err(name, format!("merge {m} is not a pair"))),
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut m = head(pre, tokens, types, merges);
    let (add_bos, add_eos) = t.adds_special_tokens();
    m.insert(1, ("tokenizer.ggml.add_bos_token".into(), Value::Bool(add_bos)));
    if add_eos {
        m.insert(2, ("tokenizer.ggml.add_eos_token".into(), Value::Bool(true)));
    }
    for (key, id) in [
        ("bos_token_id", t.bos_id()),
        ("eos_token_id", t.eos_id()),
        ("unknown_token_id", t.unk_id()),
        ("padding_token_id", t.pad_id()),
    ] {
        if let Some(id) = id {
            m.push((format!("tokenizer.ggml.{key}"), Value::U32(id)));
        }
    }
    if let Some(c) = t.chat_template() {
        m.push(("tokenizer.chat_template".into(), Value::String(c.source().into())));
    }
    Ok(m)
}
