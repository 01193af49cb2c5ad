//! Llama GGUF files as Hugging Face `LlamaForCausalLM` tensors and config
//! (and, given the tensor names, files of Llama's relatives: [`LlamaGguf::read`]).
//!
//! Three things differ between a llama.cpp file and a Hugging Face checkpoint:
//! - **names**: `blk.N.attn_q.weight` is `model.layers.N.self_attn.q_proj.weight`, …
//!   ([`hf_name`]);
//! - **shapes**: GGUF lists dimensions fastest first, so the row-major shape is
//!   the GGUF one reversed (the bytes need no transposing);
//! - **Q and K rows**: llama.cpp's converter reorders the rows of `q_proj`
//!   (with `n_head` heads) and `k_proj` (with `n_head_kv` heads) so that its
//!   RoPE can rotate adjacent pairs `(2i, 2i+1)` where Hugging Face rotates the
//!   two halves `(i, i + d/2)` of each head. Within each head of `d` rows it
//!   moves Hugging Face row `half·d/2 + i` (half ∈ {0, 1}, i < d/2) to row
//!   `2i + half`; [`unpermute_rows`] moves it back.

use crate::error::GgufError;
use crate::file::GgufFile;
use crate::quant::GgmlType;
use serde_json::{json, Value as Json};
use std::path::Path;

/// One Hugging Face tensor: name, row-major shape, values.
pub type HfTensor = (String, Vec<usize>, Vec<f32>);

/// (llama.cpp, Hugging Face) names of the tensors outside the blocks.
const TOP_NAMES: [(&str, &str); 3] = [
    ("token_embd.weight", "model.embed_tokens.weight"),
    ("output_norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
];

/// (llama.cpp, Hugging Face) names of a block's tensors, after
/// `blk.N.` / `model.layers.N.`.
const BLOCK_NAMES: [(&str, &str); 11] = [
    ("attn_q.weight", "self_attn.q_proj.weight"),
    ("attn_k.weight", "self_attn.k_proj.weight"),
    ("attn_v.weight", "self_attn.v_proj.weight"),
    ("attn_output.weight", "self_attn.o_proj.weight"),
    ("ffn_gate.weight", "mlp.gate_proj.weight"),
    ("ffn_up.weight", "mlp.up_proj.weight"),
    ("ffn_down.weight", "mlp.down_proj.weight"),
    ("attn_norm.weight", "input_layernorm.weight"),
    ("ffn_norm.weight", "post_attention_layernorm.weight"),
    // Qwen3's per-head q/k norms (llama.cpp's `qwen3` architecture).
    ("attn_q_norm.weight", "self_attn.q_norm.weight"),
    ("attn_k_norm.weight", "self_attn.k_norm.weight"),
];

/// `name` through the tables: `from` picks the side it is written in.
fn map_name(name: &str, from: usize, prefixes: [&str; 2]) -> Option<String> {
    let side = |pair: &(&'static str, &'static str)| if from == 0 { (pair.0, pair.1) } else { (pair.1, pair.0) };
    if let Some((_, to)) = TOP_NAMES.iter().map(side).find(|(f, _)| *f == name) {
        return Some(to.into());
    }
    let (layer, part) = name.strip_prefix(prefixes[from])?.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (_, to) = BLOCK_NAMES.iter().map(side).find(|(f, _)| *f == part)?;
    Some(format!("{}{layer}.{to}", prefixes[1 - from]))
}

/// The Hugging Face name of a llama.cpp Llama tensor (`None` if the mapping
/// does not know it).
pub fn hf_name(gguf_name: &str) -> Option<String> {
    map_name(gguf_name, 0, ["blk.", "model.layers."])
}

/// The llama.cpp name of a Hugging Face `LlamaForCausalLM` tensor: the
/// inverse of [`hf_name`] (`None` for a name it does not produce).
pub fn gguf_name(hf: &str) -> Option<String> {
    map_name(hf, 1, ["blk.", "model.layers."])
}

/// llama.cpp's converter's Q/K row permutation of a `[rows, cols]` weight of
/// `n_heads` heads (Hugging Face row `h·d + half·d/2 + i` becomes row
/// `h·d + 2i + half`), in place: the inverse of [`unpermute_rows`].
///
/// # Panics
/// If `w.len() != rows · cols` or `rows` is not a multiple of `2·n_heads`.
pub fn permute_rows(w: &mut [f32], rows: usize, cols: usize, n_heads: usize) {
    move_rows(w, rows, cols, n_heads, true)
}

/// Moves the rows of `w` along [`unpermuted_row_order`]: Hugging Face row
/// `i` to GGUF row `order[i]` when `to_gguf`, else back.
fn move_rows(w: &mut [f32], rows: usize, cols: usize, n_heads: usize, to_gguf: bool) {
    assert_eq!(w.len(), rows * cols, "Q/K row permutation: {} values, shape [{rows}, {cols}]", w.len());
    let src = w.to_vec();
    for (hf, gguf) in unpermuted_row_order(rows, n_heads).into_iter().enumerate() {
        let (to, from) = if to_gguf { (gguf, hf) } else { (hf, gguf) };
        w[to * cols..][..cols].copy_from_slice(&src[from * cols..][..cols]);
    }
}

/// The row order that undoes llama.cpp's Q/K row permutation of a
/// `[rows, cols]` weight of `n_heads` heads: Hugging Face row `to` is GGUF
/// row `order[to]` (GGUF row `h·d + 2i + half` becomes Hugging Face row
/// `h·d + half·d/2 + i`, `d = rows / n_heads`).
///
/// # Panics
/// If `rows` is not a multiple of `2·n_heads`.
pub fn unpermuted_row_order(rows: usize, n_heads: usize) -> Vec<usize> {
    assert!(n_heads > 0 && rows.is_multiple_of(2 * n_heads), "unpermute_rows: {rows} rows, {n_heads} heads");
    let d = rows / n_heads;
    let mut order = vec![0; rows];
    for h in 0..n_heads {
        for i in 0..d / 2 {
            for half in 0..2 {
                order[h * d + half * (d / 2) + i] = h * d + 2 * i + half;
            }
        }
    }
    order
}

/// Undoes llama.cpp's Q/K row permutation in place ([`unpermuted_row_order`]).
/// `w` is `[rows, cols]` row-major with `rows = n_heads · d`, `d` even.
///
/// # Panics
/// If `w.len() != rows · cols` or `rows` is not a multiple of `2·n_heads`.
pub fn unpermute_rows(w: &mut [f32], rows: usize, cols: usize, n_heads: usize) {
    move_rows(w, rows, cols, n_heads, false)
}

/// One tensor as the file stores it, for a caller that keeps it packed.
#[derive(Debug)]
pub struct RawTensor<'a> {
    /// Hugging Face name.
    pub name: String,
    /// Row-major shape (Hugging Face's).
    pub shape: Vec<usize>,
    /// The GGML type of `bytes`.
    pub ty: GgmlType,
    /// The stored blocks, each row of `shape` a whole number of them.
    pub bytes: &'a [u8],
    /// For Q and K: the row order that undoes llama.cpp's permutation
    /// (Hugging Face row `i` is stored row `row_order[i]`).
    pub row_order: Option<Vec<usize>>,
}

/// Where a file's tensor goes: its Hugging Face name, and for Q and K of
/// the `llama` architecture the heads llama.cpp permuted its rows over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorName {
    /// The GGUF name (`blk.3.attn_q.weight`).
    pub gguf: String,
    /// The Hugging Face name (`model.layers.3.self_attn.q_proj.weight`).
    pub hf: String,
    /// The heads whose rows are stored permuted ([`unpermute_rows`]), if so.
    pub permuted_heads: Option<usize>,
}

/// A GGUF file of the Llama block (llama.cpp's `llama` architecture, or one
/// of its relatives: `qwen2`, `qwen3`, `phi3`, `gemma2`, whose tensor names
/// the caller gives), read lazily: the config at once, each tensor when asked.
#[derive(Debug)]
pub struct LlamaGguf {
    file: GgufFile,
    config: Json,
    names: Vec<TensorName>,
    /// `rope_freqs.weight`'s values, where the file has it: Llama 3's RoPE
    /// scaling as llama.cpp holds it (a setting, not a parameter).
    rope_freqs: Option<Vec<f32>>,
}

/// The tensor llama.cpp keeps Llama 3's RoPE scaling in: one divisor of
/// the plain inverse frequency per rotated pair.
pub const ROPE_FREQS: &str = "rope_freqs.weight";

impl LlamaGguf {
    /// Opens `path` and derives the Hugging Face config. Errors if the
    /// architecture is not `llama`, a required hyperparameter is missing, or
    /// the file holds tensors or RoPE settings this mapping cannot express.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, GgufError> {
        Self::from_file(GgufFile::open(path)?)
    }

    /// [`LlamaGguf::open`] on a file already open (its architecture read by
    /// the caller, say).
    pub fn from_file(file: GgufFile) -> Result<Self, GgufError> {
        let model = Self::read(file, "llama")?;
        let (n_heads, n_kv_heads) =
            (model.config["num_attention_heads"].as_u64(), model.config["num_key_value_heads"].as_u64());
        let (n_heads, n_kv_heads) = (n_heads.unwrap_or(0) as usize, n_kv_heads.unwrap_or(0) as usize);
        let mut names = Vec::new();
        for t in model.file.tensors() {
            let Some(hf) = hf_name(&t.name) else {
                return Err(model.unsupported(format!(
                    "tensor `{}` has no Hugging Face Llama counterpart (rope_freqs: Llama-3 RoPE scaling, not supported)",
                    t.name
                )));
            };
            let permuted_heads = if t.name.ends_with(".attn_q.weight") {
                Some(n_heads)
            } else if t.name.ends_with(".attn_k.weight") {
                Some(n_kv_heads)
            } else {
                None
            };
            names.push(TensorName { gguf: t.name.clone(), hf, permuted_heads });
        }
        model.with_names(names)
    }

    /// The file read as architecture `arch`: the hyperparameters every
    /// relative of Llama writes under `{arch}.` as a Hugging Face
    /// `LlamaConfig` (`model_type: "llama"`; the caller maps it onto its
    /// family), and no tensor names yet ([`LlamaGguf::with_names`]).
    /// Errors if the file is another architecture, a required key is
    /// missing, the heads do not fit, or RoPE is scaled or partial.
    pub fn read(file: GgufFile, arch: &'static str) -> Result<Self, GgufError> {
        let found = file.get_str("general.architecture")?;
        if found != arch {
            return Err(GgufError::WrongArchitecture { path: file.path().into(), expected: arch, found: found.into() });
        }
        let unsupported = |what: String| GgufError::UnsupportedModel { path: file.path().into(), what };
        let key = |k: &str| format!("{arch}.{k}");
        if let Some(kind) = file.get_str_opt(&key("rope.scaling.type"))? {
            if kind != "none" {
                return Err(unsupported(format!("{} = {kind} is not supported", key("rope.scaling.type"))));
            }
        }
        let u = |k: &str| file.get_u64(&key(k)).map(|v| v as usize);
        let u_opt = |k: &str| file.get_u64_opt(&key(k)).map(|v| v.map(|v| v as usize));
        let hidden = u("embedding_length")?;
        let n_layers = u("block_count")?;
        let n_heads = u("attention.head_count")?;
        let n_kv_heads = u_opt("attention.head_count_kv")?.unwrap_or(n_heads);
        if n_heads == 0 || n_kv_heads == 0 || !n_heads.is_multiple_of(n_kv_heads) {
            return Err(unsupported(format!("{n_heads} heads and {n_kv_heads} KV heads do not fit")));
        }
        // Heads as wide as hidden / heads unless the file says otherwise.
        let head_dim = match u_opt("attention.key_length")? {
            Some(d) => d,
            None if hidden.is_multiple_of(n_heads) => hidden / n_heads,
            None => return Err(unsupported(format!("hidden size {hidden} is not a multiple of {n_heads} heads"))),
        };
        if let Some(v) = u_opt("attention.value_length")?.filter(|&v| v != head_dim) {
            return Err(unsupported(format!("values {v} wide where keys are {head_dim}: not the Llama block")));
        }
        if let Some(rope_dim) = u_opt("rope.dimension_count")?.filter(|&r| r != head_dim) {
            return Err(unsupported(format!("RoPE over {rope_dim} of {head_dim} head dimensions is not Llama")));
        }
        let embd = file
            .tensor("token_embd.weight")
            .ok_or_else(|| GgufError::MissingTensor { path: file.path().into(), name: "token_embd.weight".into() })?;
        let vocab_size = u_opt("vocab_size")?.unwrap_or(embd.shape()[0]);
        let id = |k: &str| file.get_u64_opt(k).map(|v| v.map_or(Json::Null, |v| json!(v)));
        let config = json!({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": hidden,
            "intermediate_size": u("feed_forward_length")?,
            "num_hidden_layers": n_layers,
            "num_attention_heads": n_heads,
            "num_key_value_heads": n_kv_heads,
            "head_dim": head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": file.get_f64(&key("attention.layer_norm_rms_epsilon"))?,
            "rope_theta": file.get_f64_opt(&key("rope.freq_base"))?.unwrap_or(10000.0),
            "max_position_embeddings": u("context_length")?,
            "vocab_size": vocab_size,
            "tie_word_embeddings": file.tensor("output.weight").is_none(),
            "attention_bias": false,
            "mlp_bias": false,
            "bos_token_id": id("tokenizer.ggml.bos_token_id")?,
            "eos_token_id": id("tokenizer.ggml.eos_token_id")?,
            "pad_token_id": id("tokenizer.ggml.padding_token_id")?,
            "torch_dtype": "float32",
        });
        let rope_freqs = match file.tensor(ROPE_FREQS) {
            Some(t) => {
                let mut v = vec![0.0; t.shape().iter().product()];
                file.dequantize_into(ROPE_FREQS, &mut v)?;
                Some(v)
            }
            None => None,
        };
        Ok(Self { file, config, names: Vec::new(), rope_freqs })
    }

    /// The model with its tensors named: `names` must name every tensor of
    /// the file (a name it lacks is an error naming the tensor); names of
    /// tensors the file lacks are the loader's to miss.
    pub fn with_names(mut self, names: Vec<TensorName>) -> Result<Self, GgufError> {
        let named = |t: &str| t == ROPE_FREQS || names.iter().any(|n| n.gguf == t);
        if let Some(t) = self.file.tensors().iter().find(|t| !named(&t.name)) {
            let arch = self.file.get_str("general.architecture")?;
            return Err(self.unsupported(format!("tensor `{}` is not one of a `{arch}` model of this shape", t.name)));
        }
        self.names = names;
        Ok(self)
    }

    fn unsupported(&self, what: String) -> GgufError {
        GgufError::UnsupportedModel { path: self.file.path().into(), what }
    }

    /// The Hugging Face `config.json` of the model ([`LlamaGguf::read`]).
    pub fn config(&self) -> &Json {
        &self.config
    }

    /// The values of the file's `rope_freqs.weight` ([`ROPE_FREQS`]), if
    /// it has one: the caller turns them into its RoPE scaling or refuses
    /// them; [`LlamaGguf::with_names`] never asks them to be named.
    pub fn rope_freqs(&self) -> Option<&[f32]> {
        self.rope_freqs.as_deref()
    }

    /// The underlying file (metadata, tokenizer keys, raw tensors).
    pub fn file(&self) -> &GgufFile {
        &self.file
    }

    /// (GGUF name, Hugging Face name) of every tensor, in file order.
    pub fn tensor_names(&self) -> Vec<(String, String)> {
        let hf = |g: &str| Some(self.names.iter().find(|n| n.gguf == g)?.hf.clone());
        self.file.tensors().iter().filter_map(|t| Some((t.name.clone(), hf(&t.name)?))).collect()
    }

    /// One tensor by its GGUF name, as Hugging Face has it: name, row-major
    /// shape and f32 values (Q and K rows un-permuted).
    pub fn tensor(&self, gguf_name: &str) -> Result<HfTensor, GgufError> {
        let (name, shape) = self.hf_shape(gguf_name)?;
        let mut values = vec![0.0; shape.iter().product()];
        self.tensor_into(gguf_name, &mut values)?;
        Ok((name, shape, values))
    }

    /// The name entry of `gguf_name` and its row-major shape.
    fn entry(&self, gguf_name: &str) -> Result<(&TensorName, Vec<usize>), GgufError> {
        let info = self
            .file
            .tensor(gguf_name)
            .ok_or_else(|| GgufError::MissingTensor { path: self.file.path().into(), name: gguf_name.into() })?;
        let name = self
            .names
            .iter()
            .find(|n| n.gguf == gguf_name)
            .ok_or_else(|| self.unsupported(format!("tensor `{gguf_name}` has no Hugging Face counterpart")))?;
        Ok((name, info.shape()))
    }

    /// One tensor's Hugging Face name and row-major shape, by its GGUF name.
    pub fn hf_shape(&self, gguf_name: &str) -> Result<(String, Vec<usize>), GgufError> {
        let (name, shape) = self.entry(gguf_name)?;
        Ok((name.hf.clone(), shape))
    }

    /// [`LlamaGguf::tensor`]'s values written into `out` (exactly the
    /// tensor's elements): a loader dequantises each tensor straight into
    /// its place in the parameters.
    pub fn tensor_into(&self, gguf_name: &str, out: &mut [f32]) -> Result<(), GgufError> {
        let (_, shape) = self.entry(gguf_name)?;
        self.file.dequantize_into(gguf_name, out)?;
        if let Some(n_heads) = self.permuted_heads(gguf_name)? {
            unpermute_rows(out, shape[0], shape[1..].iter().product(), n_heads);
        }
        Ok(())
    }

    /// The heads llama.cpp permuted the rows of `gguf_name` over, checked
    /// against its shape; `None` for a tensor stored as it is.
    fn permuted_heads(&self, gguf_name: &str) -> Result<Option<usize>, GgufError> {
        let (name, shape) = self.entry(gguf_name)?;
        let Some(heads) = name.permuted_heads else { return Ok(None) };
        // A weight's rows, or a bias's values, which move with them.
        let rows = shape.first().copied().unwrap_or(0);
        if heads == 0 || !rows.is_multiple_of(2 * heads) {
            return Err(self.unsupported(format!("`{gguf_name}` has {rows} rows, not a multiple of 2 × {heads} heads")));
        }
        Ok(Some(heads))
    }

    /// One tensor by its GGUF name as stored (never dequantised): its
    /// Hugging Face name and shape, GGML type, bytes, and for Q and K the
    /// row order that undoes llama.cpp's permutation.
    pub fn raw_tensor(&self, gguf_name: &str) -> Result<RawTensor<'_>, GgufError> {
        let (info, bytes) = self.file.tensor_bytes(gguf_name)?;
        let (name, shape) = self.hf_shape(gguf_name)?;
        let ty = GgmlType::from_id(info.type_id).ok_or_else(|| GgufError::UnsupportedType {
            tensor: info.name.clone(),
            type_id: info.type_id,
            type_name: crate::quant::type_name(info.type_id),
        })?;
        let row_order = self.permuted_heads(gguf_name)?.map(|h| unpermuted_row_order(shape[0], h));
        Ok(RawTensor { name, shape, ty, bytes, row_order })
    }
}

/// Loads a Llama GGUF file whole: the Hugging Face `config.json` and every
/// tensor with its Hugging Face name, row-major shape and f32 values, in file
/// order. Without `output.weight` the config says `tie_word_embeddings: true`
/// and no `lm_head.weight` is returned.
pub fn load(path: impl AsRef<Path>) -> Result<(Json, Vec<HfTensor>), GgufError> {
    let model = LlamaGguf::open(path)?;
    let tensors = model.tensor_names().iter().map(|(g, _)| model.tensor(g)).collect::<Result<_, _>>()?;
    Ok((model.config, tensors))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// llama.cpp's forward permutation, written the way its converter states
    /// it (reshape to (heads, 2, d/2, cols), swap axes 1 and 2), applied to
    /// row indices; un-permuting must give the identity.
    #[test]
    fn unpermute_inverts_the_converter_permutation() {
        for (n_heads, d, cols) in [(1, 2, 1), (3, 8, 2), (2, 64, 3)] {
            let rows = n_heads * d;
            let hf: Vec<f32> = (0..rows * cols).map(|v| v as f32).collect();
            // permuted row p = (h, i, half) in (heads, d/2, 2) comes from hf row (h, half, i) in (heads, 2, d/2)
            let mut gguf = vec![0.0; rows * cols];
            for h in 0..n_heads {
                for i in 0..d / 2 {
                    for half in 0..2 {
                        let p = (h * (d / 2) + i) * 2 + half;
                        let src = (h * 2 + half) * (d / 2) + i;
                        gguf[p * cols..][..cols].copy_from_slice(&hf[src * cols..][..cols]);
                    }
                }
            }
            assert!(n_heads * d <= 2 || gguf != hf, "the permutation must move something");
            unpermute_rows(&mut gguf, rows, cols, n_heads);
            assert_eq!(gguf, hf, "heads {n_heads}, d {d}, cols {cols}");
        }
    }

    #[test]
    fn permute_and_unpermute_are_inverses() {
        for (n_heads, d, cols) in [(1, 2, 1), (3, 8, 2), (4, 16, 5)] {
            let rows = n_heads * d;
            let hf: Vec<f32> = (0..rows * cols).map(|v| v as f32).collect();
            let mut w = hf.clone();
            permute_rows(&mut w, rows, cols, n_heads);
            assert!(d <= 2 || w != hf, "the permutation must move something");
            // Row h·d + 2i + half of the permuted weight is Hugging Face row h·d + half·d/2 + i.
            if n_heads > 1 {
                assert_eq!(w[cols * (d + 2)], hf[cols * (d + 1)], "heads {n_heads}, d {d}");
            }
            unpermute_rows(&mut w, rows, cols, n_heads);
            assert_eq!(w, hf);
            permute_rows(&mut w, rows, cols, n_heads);
            let mut back = w.clone();
            unpermute_rows(&mut back, rows, cols, n_heads);
            permute_rows(&mut back, rows, cols, n_heads);
            assert_eq!(back, w);
        }
    }

    #[test]
    fn gguf_names_invert_hf_names() {
        let names = ["token_embd.weight", "output_norm.weight", "output.weight"].map(String::from).into_iter().chain(
            ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "attn_norm", "ffn_norm"]
                .map(|p| format!("blk.12.{p}.weight")),
        );
        for g in names {
            let hf = hf_name(&g).unwrap();
            assert_eq!(gguf_name(&hf).as_deref(), Some(g.as_str()), "{hf}");
        }
        assert_eq!(gguf_name("model.layers.0.self_attn.q_proj.lora_a"), None);
    }

    #[test]
    fn names_map_like_transformers() {
        assert_eq!(hf_name("token_embd.weight").as_deref(), Some("model.embed_tokens.weight"));
        assert_eq!(hf_name("blk.29.attn_output.weight").as_deref(), Some("model.layers.29.self_attn.o_proj.weight"));
        assert_eq!(hf_name("blk.3.ffn_norm.weight").as_deref(), Some("model.layers.3.post_attention_layernorm.weight"));
        assert_eq!(hf_name("blk.x.attn_q.weight"), None);
        assert_eq!(hf_name("rope_freqs.weight"), None);
    }
}
