//! Byte-level BPE tokenizers (GPT-2 style) on the `tokenizers` crate: from a
//! Hugging Face `tokenizer.json`, from a GGUF file's `tokenizer.ggml.*`
//! metadata, or GPT-2's own vocabulary bundled in `assets/gpt2/`.
//!
//! The GGUF path rebuilds what the model was trained with: the vocabulary
//! (`tokenizer.ggml.tokens`, ids = positions), the merges, control tokens
//! (token type 3) as special added tokens and user-defined ones (type 4) as
//! plain added tokens, and the pre-tokenizer named by `tokenizer.ggml.pre`:
//! - `gpt2`: GPT-2's regex split, then bytes to the byte-level alphabet;
//! - `smollm`: every numeric character (`\p{N}`) first split off on its own,
//!   then as `gpt2` — llama.cpp's rule for this name, and the
//!   `Digits(individual_digits) + ByteLevel` of SmolLM2's own `tokenizer.json`.
//!   transformers' GGUF loader leaves out the digit split. The two agree
//!   except where whitespace precedes a numeral: a run of two or more
//!   whitespace characters before any numeral ("\n\n1.", "  2.": transformers
//!   splits the run's last character off) or a space before a non-ASCII one
//!   (" ½": transformers merges the space into the numeral's first byte). We
//!   follow the model's tokenizer; `tests/tokenizers.rs` pins both id lists.
//!
//! Any other name is an error listing these, rather than a silent guess.

use crate::chat::ChatTemplate;
use crate::error::DataError;
use std::collections::HashMap;
use std::io::Read;
use std::path::Path;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::{AddedToken, PreTokenizerWrapper};

/// GGUF token types (llama.cpp's `llama_token_type`).
const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// How text is split before BPE merges apply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PreTokenizer {
    /// GPT-2's regex (`'s|'t|… | ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`).
    Gpt2,
    /// Each numeric character alone, then [`PreTokenizer::Gpt2`] (SmolLM).
    SmolLm,
}

impl PreTokenizer {
    /// Every pre-tokenizer, for matching one a `tokenizer.json` holds.
    pub const ALL: [PreTokenizer; 2] = [PreTokenizer::Gpt2, PreTokenizer::SmolLm];

    /// The pre-tokenizer of a `tokenizer.ggml.pre` name (`gpt-2`, as
    /// llama.cpp spells GPT-2's, or `gpt2`; `smollm`).
    pub fn from_gguf_name(name: &str) -> Option<Self> {
        match name {
            "gpt-2" | "gpt2" => Some(Self::Gpt2),
            "smollm" => Some(Self::SmolLm),
            _ => None,
        }
    }

    /// The `tokenizer.ggml.pre` name llama.cpp knows it by.
    pub fn gguf_name(self) -> &'static str {
        match self {
            Self::Gpt2 => "gpt-2",
            Self::SmolLm => "smollm",
        }
    }

    /// The `tokenizers` crate's pre-tokenizer.
    pub fn build(self) -> PreTokenizerWrapper {
        let byte_level = ByteLevel::new(false, true, true);
        match self {
            Self::Gpt2 => byte_level.into(),
            Self::SmolLm => Sequence::new(vec![Digits::new(true).into(), byte_level.into()]).into(),
        }
    }
}

/// Everything a byte-level BPE tokenizer is built from. Tokens are spelled in
/// the byte-level alphabet (`Ġ` for a space), as GGUF and `vocab.json` store
/// them; the id of a token is its index.
#[derive(Debug, Clone)]
pub struct BpeParts {
    /// For messages: the file or asset it came from.
    pub source_name: String,
    /// The vocabulary; `tokens[id]`.
    pub tokens: Vec<String>,
    /// Merges, highest priority first.
    pub merges: Vec<(String, String)>,
    /// Ids matched whole in any text and marked special (skipped by
    /// `decode_skip_special`), e.g. `<|im_end|>`.
    pub special_ids: Vec<u32>,
    /// Ids matched whole in any text but not special (e.g. `<think>`).
    pub added_ids: Vec<u32>,
    /// The splitting rule.
    pub pre_tokenizer: PreTokenizer,
    /// Beginning-of-sequence id.
    pub bos_id: Option<u32>,
    /// End-of-sequence id (also the end of an assistant turn in chat data).
    pub eos_id: Option<u32>,
    /// Padding id.
    pub pad_id: Option<u32>,
    /// Prepend BOS in [`BpeTokenizer::encode`].
    pub add_bos: bool,
    /// Append EOS in [`BpeTokenizer::encode`].
    pub add_eos: bool,
    /// Jinja chat template, if the model has one.
    pub chat_template: Option<String>,
}

/// GPT-2's reversible map from bytes to printable characters: printable
/// Latin-1 bytes stand for themselves, the other 68 take the characters
/// from U+0100 on, in byte order.
pub fn byte_to_char() -> [char; 256] {
    let mut map = ['\0'; 256];
    let mut next = 256u32;
    for (b, slot) in map.iter_mut().enumerate() {
        let printable = (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
        let code = if printable {
            b as u32
        } else {
            next += 1;
            next - 1
        };
        *slot = char::from_u32(code).unwrap_or('\0');
    }
    map
}

/// A token as the BPE model stores it: unchanged if every character is in
/// the byte-level alphabet, else its UTF-8 bytes respelled in that alphabet
/// (transformers does the same for GGUF vocabularies).
fn respell(token: &str, map: &[char; 256]) -> String {
    if token.chars().all(|c| map.contains(&c)) {
        token.to_string()
    } else {
        token.bytes().map(|b| map[b as usize]).collect()
    }
}

fn format_err(source_name: &str, problem: impl Into<String>) -> DataError {
    DataError::TokenizerFormat { source_name: source_name.into(), problem: problem.into() }
}

fn tk_err(what: impl Into<String>) -> impl FnOnce(tokenizers::Error) -> DataError {
    let what = what.into();
    move |source| DataError::Tokenizer { what, source }
}

/// A BPE tokenizer with its special ids and chat template.
pub struct BpeTokenizer {
    name: String,
    inner: tokenizers::Tokenizer,
    bos_id: Option<u32>,
    eos_id: Option<u32>,
    pad_id: Option<u32>,
    unk_id: Option<u32>,
    add_bos: bool,
    add_eos: bool,
    chat_template: Option<ChatTemplate>,
}

impl std::fmt::Debug for BpeTokenizer {
    // The derived form would print the whole vocabulary.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BpeTokenizer")
            .field("name", &self.name)
            .field("vocab_size", &self.vocab_size())
            .field("bos_id", &self.bos_id)
            .field("eos_id", &self.eos_id)
            .field("pad_id", &self.pad_id)
            .field("add_bos", &self.add_bos)
            .field("add_eos", &self.add_eos)
            .field("chat_template", &self.chat_template.is_some())
            .finish()
    }
}

/// Token ids with the byte range of the text each came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Encoded {
    /// Token ids.
    pub ids: Vec<u32>,
    /// `offsets[i]`: bytes of the input that token `i` covers.
    pub offsets: Vec<(usize, usize)>,
}

impl BpeTokenizer {
    /// Builds a byte-level BPE tokenizer from its parts.
    pub fn from_parts(parts: BpeParts) -> Result<Self, DataError> {
        let src = parts.source_name.as_str();
        let map = byte_to_char();
        let n_tokens = parts.tokens.len();
        let mut vocab = tokenizers::models::bpe::Vocab::default();
        for (id, token) in parts.tokens.iter().enumerate() {
            if vocab.insert(respell(token, &map), id as u32).is_some() {
                return Err(format_err(src, format!("token {token:?} (id {id}) appears twice")));
            }
        }
        let check = |what: &str, id: Option<u32>| match id {
            Some(id) if id as usize >= n_tokens => {
                Err(format_err(src, format!("{what} id {id} is outside the vocabulary of {n_tokens}")))
            }
            _ => Ok(()),
        };
        check("bos", parts.bos_id)?;
        check("eos", parts.eos_id)?;
        check("pad", parts.pad_id)?;
        for &id in parts.special_ids.iter().chain(&parts.added_ids) {
            check("added token", Some(id))?;
        }
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, parts.merges)
            .build()
            .map_err(tk_err(format!("building the BPE model of {src}")))?;
        let mut inner = tokenizers::Tokenizer::new(bpe);
        inner.with_pre_tokenizer(Some(parts.pre_tokenizer.build()));
        inner.with_decoder(Some(ByteLevelDecoder::default()));
        let added = |ids: &[u32], special: bool| -> Vec<AddedToken> {
            ids.iter()
                .map(|&id| AddedToken::from(respell(&parts.tokens[id as usize], &map), special).normalized(false))
                .collect()
        };
        inner.add_special_tokens(added(&parts.special_ids, true)).map_err(tk_err("adding special tokens"))?;
        inner.add_tokens(added(&parts.added_ids, false)).map_err(tk_err("adding tokens"))?;
        let token_str = |id: Option<u32>| id.map(|id| parts.tokens[id as usize].clone()).unwrap_or_default();
        let chat_template = parts
            .chat_template
            .as_deref()
            .map(|t| ChatTemplate::new(t, &token_str(parts.bos_id), &token_str(parts.eos_id)))
            .transpose()?;
        Ok(Self {
            name: parts.source_name,
            inner,
            bos_id: parts.bos_id,
            eos_id: parts.eos_id,
            pad_id: parts.pad_id,
            unk_id: None,
            add_bos: parts.add_bos,
            add_eos: parts.add_eos,
            chat_template,
        })
    }

    /// The tokenizer stored in a GGUF file's metadata (`tokenizer.ggml.model`
    /// must be `gpt2`, i.e. byte-level BPE).
    pub fn from_gguf(path: &Path) -> Result<Self, DataError> {
        let f = gguf::GgufFile::open(path)?;
        let src = path.display().to_string();
        let model = f.get_str("tokenizer.ggml.model")?;
        if model != "gpt2" {
            return Err(format_err(
                &src,
                format!("tokenizer.ggml.model = {model}; only gpt2 (byte-level BPE) is supported"),
            ));
        }
        let pre_name = f.get_str_opt("tokenizer.ggml.pre")?.ok_or_else(|| {
            format_err(&src, "no tokenizer.ggml.pre: the pre-tokenizer is unknown (supported: gpt-2, smollm)")
        })?;
        let pre_tokenizer = PreTokenizer::from_gguf_name(pre_name).ok_or_else(|| {
            format_err(&src, format!("tokenizer.ggml.pre = {pre_name} is not supported (supported: gpt-2, smollm)"))
        })?;
        let tokens: Vec<String> = f.get_str_array("tokenizer.ggml.tokens")?.into_iter().map(String::from).collect();
        let merges = f
            .get_str_array("tokenizer.ggml.merges")?
            .into_iter()
            .enumerate()
            .map(|(i, m)| match m.split_once(' ') {
                Some((a, b)) if !a.is_empty() && !b.is_empty() && !b.contains(' ') => Ok((a.into(), b.into())),
                _ => Err(format_err(&src, format!("merge {i} is {m:?}, not two tokens separated by one space"))),
            })
            .collect::<Result<Vec<_>, _>>()?;
        let types = f.get_i64_array_opt("tokenizer.ggml.token_type")?.unwrap_or_default();
        if !types.is_empty() && types.len() != tokens.len() {
            return Err(format_err(&src, format!("{} token types for {} tokens", types.len(), tokens.len())));
        }
        let alphabet = byte_to_char();
        let of_type = |ty: i64| -> Vec<u32> {
            types.iter().enumerate().filter(|&(_, &t)| t == ty).map(|(id, _)| id as u32).collect()
        };
        // A control token outside the byte alphabet cannot be a real token of
        // a byte-level vocabulary (transformers skips those too).
        let special_ids = of_type(TOKEN_TYPE_CONTROL)
            .into_iter()
            .filter(|&id| tokens[id as usize].chars().all(|c| alphabet.contains(&c)))
            .collect();
        let id = |k: &str| f.get_u64_opt(k).map(|v| v.map(|v| v as u32));
        let parts = BpeParts {
            source_name: src,
            special_ids,
            added_ids: of_type(TOKEN_TYPE_USER_DEFINED),
            pre_tokenizer,
            bos_id: id("tokenizer.ggml.bos_token_id")?,
            eos_id: id("tokenizer.ggml.eos_token_id")?,
            pad_id: id("tokenizer.ggml.padding_token_id")?,
            add_bos: f.get_bool_opt("tokenizer.ggml.add_bos_token")?.unwrap_or(false),
            add_eos: f.get_bool_opt("tokenizer.ggml.add_eos_token")?.unwrap_or(false),
            chat_template: f.get_str_opt("tokenizer.chat_template")?.map(String::from),
            tokens,
            merges,
        };
        let unk_id = id("tokenizer.ggml.unknown_token_id")?;
        let mut t = Self::from_parts(parts)?;
        if let Some(unk) = unk_id.filter(|&u| u as usize >= t.vocab_size()) {
            return Err(format_err(&t.name, format!("unk id {unk} is outside the vocabulary of {}", t.vocab_size())));
        }
        t.unk_id = unk_id;
        Ok(t)
    }

    /// GPT-2's tokenizer (vocabulary 50257, `<|endoftext|>` = 50256 as BOS and
    /// EOS, no padding token), from the copy bundled in `assets/gpt2/`
    /// (see its PROVENANCE.md).
    pub fn gpt2() -> Result<Self, DataError> {
        fn gunzip(name: &str, gz: &[u8]) -> Result<String, DataError> {
            let mut text = String::new();
            flate2::read::GzDecoder::new(gz)
                .read_to_string(&mut text)
                .map_err(|e| format_err(name, format!("cannot decompress: {e}")))?;
            Ok(text)
        }
        let vocab = gunzip("assets/gpt2/encoder.json.gz", include_bytes!("../assets/gpt2/encoder.json.gz"))?;
        let merges = gunzip("assets/gpt2/vocab.bpe.gz", include_bytes!("../assets/gpt2/vocab.bpe.gz"))?;
        Self::from_gpt2_files("bundled GPT-2", &vocab, &merges)
    }

    /// A GPT-2-style tokenizer from the text of `vocab.json` / `encoder.json`
    /// (token → id) and `merges.txt` / `vocab.bpe` (one merge a line, an
    /// optional `#version` line first). `<|endoftext|>`, if present, is
    /// special and serves as BOS and EOS, as in transformers' GPT2Tokenizer.
    pub fn from_gpt2_files(source_name: &str, vocab_json: &str, merges_txt: &str) -> Result<Self, DataError> {
        let map: HashMap<String, u32> = serde_json::from_str(vocab_json)
            .map_err(|e| format_err(source_name, format!("vocabulary is not a JSON object of ids: {e}")))?;
        let mut tokens = vec![None; map.len()];
        for (token, &id) in &map {
            match tokens.get_mut(id as usize) {
                Some(slot @ None) => *slot = Some(token.clone()),
                _ => {
                    return Err(format_err(source_name, format!("ids are not 0..{} exactly once (id {id})", map.len())))
                }
            }
        }
        let tokens: Vec<String> = tokens.into_iter().flatten().collect();
        let merges = merges_txt
            .lines()
            .enumerate()
            .filter(|(i, l)| !(l.is_empty() || (*i == 0 && l.starts_with("#version"))))
            .map(|(i, l)| match l.split_once(' ') {
                Some((a, b)) if !b.contains(' ') => Ok((a.to_string(), b.to_string())),
                _ => Err(format_err(source_name, format!("merges line {} is {l:?}", i + 1))),
            })
            .collect::<Result<Vec<_>, _>>()?;
        let eot = map.get("<|endoftext|>").copied();
        Self::from_parts(BpeParts {
            source_name: source_name.into(),
            tokens,
            merges,
            special_ids: eot.into_iter().collect(),
            added_ids: vec![],
            pre_tokenizer: PreTokenizer::Gpt2,
            bos_id: eot,
            eos_id: eot,
            pad_id: None,
            add_bos: false,
            add_eos: false,
            chat_template: None,
        })
    }

    /// A Hugging Face `tokenizer.json`. Special ids, `add_bos_token` /
    /// `add_eos_token` and the chat template come from a `tokenizer_config.json`
    /// beside it when there is one (its `bos_token`, `eos_token`, `pad_token`
    /// strings or `{content: …}` objects); without it the tokenizer has none.
    pub fn from_tokenizer_json(path: &Path) -> Result<Self, DataError> {
        let name = path.display().to_string();
        let inner = tokenizers::Tokenizer::from_file(path).map_err(tk_err(format!("loading {name}")))?;
        let config_path = path.with_file_name("tokenizer_config.json");
        let config: serde_json::Value = match std::fs::read_to_string(&config_path) {
            Ok(text) => serde_json::from_str(&text)
                .map_err(|e| format_err(&config_path.display().to_string(), format!("not JSON: {e}")))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => serde_json::Value::Null,
            Err(source) => return Err(DataError::Read { path: config_path, source }),
        };
        let token_of = |key: &str| -> Option<String> {
            let v = &config[key];
            v.as_str().or_else(|| v["content"].as_str()).map(String::from)
        };
        let id_of = |key: &str| -> Result<Option<u32>, DataError> {
            match token_of(key) {
                None => Ok(None),
                Some(t) => inner.token_to_id(&t).map(Some).ok_or_else(|| {
                    format_err(&name, format!("{key} {t:?} of tokenizer_config.json is not in the vocabulary"))
                }),
            }
        };
        let chat_template = match &config["chat_template"] {
            serde_json::Value::String(s) => Some(s.clone()),
            serde_json::Value::Array(named) => {
                named.iter().find(|t| t["name"] == "default").and_then(|t| t["template"].as_str()).map(String::from)
            }
            _ => None,
        };
        let (bos_id, eos_id, pad_id) = (id_of("bos_token")?, id_of("eos_token")?, id_of("pad_token")?);
        let unk_id = id_of("unk_token")?;
        let chat_template = chat_template
            .map(|t| {
                ChatTemplate::new(
                    &t,
                    &token_of("bos_token").unwrap_or_default(),
                    &token_of("eos_token").unwrap_or_default(),
                )
            })
            .transpose()?;
        Ok(Self {
            name,
            inner,
            bos_id,
            eos_id,
            pad_id,
            unk_id,
            add_bos: config["add_bos_token"].as_bool().unwrap_or(false),
            add_eos: config["add_eos_token"].as_bool().unwrap_or(false),
            chat_template,
        })
    }

    /// Writes `tokenizer.json` and `tokenizer_config.json` (special tokens,
    /// chat template) into `dir`, as Hugging Face does: what
    /// [`BpeTokenizer::from_tokenizer_json`] and transformers'
    /// `AutoTokenizer.from_pretrained(dir)` read back.
    pub fn save_pretrained(&self, dir: &Path) -> Result<(), DataError> {
        self.save_tokenizer_json(&dir.join("tokenizer.json"))?;
        let token = |id: Option<u32>| id.and_then(|i| self.inner.id_to_token(i));
        let config = serde_json::json!({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": token(self.bos_id),
            "eos_token": token(self.eos_id),
            "pad_token": token(self.pad_id),
            "unk_token": token(self.unk_id),
            "add_bos_token": self.add_bos,
            "add_eos_token": self.add_eos,
            "chat_template": self.chat_template.as_ref().map(|t| t.source().to_string()),
        });
        let path = dir.join("tokenizer_config.json");
        let text = serde_json::to_string_pretty(&config)
            .map_err(|e| format_err(&path.display().to_string(), e.to_string()))?;
        std::fs::write(&path, text).map_err(|source| DataError::Read { path, source })
    }

    /// Writes the tokenizer as a Hugging Face `tokenizer.json`.
    pub fn save_tokenizer_json(&self, path: &Path) -> Result<(), DataError> {
        self.inner.save(path, false).map_err(tk_err(format!("writing {}", path.display())))
    }

    /// Where it came from.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Text to ids with their byte offsets. Special-token strings in the text
    /// (`<|im_end|>`) become their ids; BOS / EOS are added only where the
    /// tokenizer is configured to (`add_bos` / `add_eos`; neither for SmolLM2
    /// and GPT-2), with an empty offset range at the start / end.
    pub fn encode_with_offsets(&self, text: &str) -> Result<Encoded, DataError> {
        self.encode_impl(text, true)
    }

    /// A rendered chat template to ids with offsets, as `apply_chat_template`
    /// tokenizes it: no BOS / EOS added whatever the configuration (a
    /// template writes the ones it wants).
    pub fn encode_chat(&self, rendered: &str) -> Result<Encoded, DataError> {
        self.encode_impl(rendered, false)
    }

    fn encode_impl(&self, text: &str, configured_specials: bool) -> Result<Encoded, DataError> {
        let enc = self.inner.encode(text, false).map_err(tk_err("encoding text"))?;
        let mut ids = Vec::with_capacity(enc.len() + 2);
        let mut offsets = Vec::with_capacity(enc.len() + 2);
        if let (true, true, Some(bos)) = (configured_specials, self.add_bos, self.bos_id) {
            ids.push(bos);
            offsets.push((0, 0));
        }
        ids.extend_from_slice(enc.get_ids());
        offsets.extend_from_slice(enc.get_offsets());
        if let (true, true, Some(eos)) = (configured_specials, self.add_eos, self.eos_id) {
            ids.push(eos);
            offsets.push((text.len(), text.len()));
        }
        Ok(Encoded { ids, offsets })
    }

    /// Text to ids (see [`Self::encode_with_offsets`]).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, DataError> {
        Ok(self.encode_with_offsets(text)?.ids)
    }

    /// Ids to text, special tokens included (byte-level BPE round-trips any
    /// text exactly; ids that end inside a UTF-8 character decode to U+FFFD).
    pub fn decode(&self, ids: &[u32]) -> Result<String, DataError> {
        self.inner.decode(ids, false).map_err(tk_err("decoding ids"))
    }

    /// Ids to text without the special tokens.
    pub fn decode_skip_special(&self, ids: &[u32]) -> Result<String, DataError> {
        self.inner.decode(ids, true).map_err(tk_err("decoding ids"))
    }

    /// Number of ids, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Beginning-of-sequence id.
    pub fn bos_id(&self) -> Option<u32> {
        self.bos_id
    }

    /// End-of-sequence id.
    pub fn eos_id(&self) -> Option<u32> {
        self.eos_id
    }

    /// Padding id.
    pub fn pad_id(&self) -> Option<u32> {
        self.pad_id
    }

    /// Unknown-token id (`unk_token`, `tokenizer.ggml.unknown_token_id`).
    pub fn unk_id(&self) -> Option<u32> {
        self.unk_id
    }

    /// Whether [`Self::encode`] prepends BOS and appends EOS.
    pub fn adds_special_tokens(&self) -> (bool, bool) {
        (self.add_bos, self.add_eos)
    }

    /// The `tokenizers` crate's tokenizer underneath.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// The id of a token spelled as the vocabulary spells it (`Ġthe`,
    /// `<|im_end|>`).
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The token of an id, as the vocabulary spells it.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The chat template, if the model has one.
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.chat_template.as_ref()
    }

    /// Whether [`Self::encode`] prepends BOS / appends EOS.
    pub fn set_add_special_tokens(&mut self, add_bos: bool, add_eos: bool) {
        self.add_bos = add_bos;
        self.add_eos = add_eos;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_map_is_gpt2s() {
        let m = byte_to_char();
        assert_eq!((m[b' ' as usize], m[b'\n' as usize], m[b'A' as usize]), ('Ġ', 'Ċ', 'A'));
        assert_eq!((m[0], m[0xAD], m[0xFF]), ('\u{100}', '\u{143}', 'ÿ'));
        let mut all: Vec<char> = m.to_vec();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), 256);
    }

    /// BOS / EOS only where configured, and never in a rendered chat (the
    /// template writes its own), as transformers does.
    #[test]
    fn specials_only_where_configured() {
        let mut tokens: Vec<String> = byte_to_char().iter().map(|c| c.to_string()).collect();
        tokens.extend(["<s>".to_string(), "</s>".to_string()]);
        let parts = BpeParts {
            source_name: "t".into(),
            tokens,
            merges: vec![],
            special_ids: vec![256, 257],
            added_ids: vec![],
            pre_tokenizer: PreTokenizer::Gpt2,
            bos_id: Some(256),
            eos_id: Some(257),
            pad_id: None,
            add_bos: true,
            add_eos: false,
            chat_template: None,
        };
        let mut t = BpeTokenizer::from_parts(parts.clone()).unwrap();
        let e = t.encode_with_offsets("ab").unwrap();
        assert_eq!((e.ids, e.offsets), (vec![256, 97, 98], vec![(0, 0), (0, 1), (1, 2)]));
        assert_eq!(t.encode_chat("<s>ab").unwrap().ids, vec![256, 97, 98]);
        t.set_add_special_tokens(false, true);
        assert_eq!(t.encode("ab").unwrap(), vec![97, 98, 257]);
        assert_eq!(t.decode_skip_special(&[256, 97, 257]).unwrap(), "a");
        let bad = BpeParts { bos_id: Some(999), ..parts };
        let e = BpeTokenizer::from_parts(bad).unwrap_err().to_string();
        assert!(e.contains("bos id 999 is outside the vocabulary of 258"), "{e}");
    }
}
