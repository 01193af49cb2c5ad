//! Hugging Face GPT-2 checkpoints: `model.safetensors` + `config.json`, with
//! `GPT2LMHeadModel`'s tensor names and `Conv1D` layouts, so `transformers`
//! loads our files as they are and we load theirs.

use crate::config::GptConfig;
use crate::error::GptError;
use engine::ParamLayout;
use safetensors::tensor::{Dtype, SafeTensors};
use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// File name of the weights.
pub const WEIGHTS_FILE: &str = "model.safetensors";
/// File name of the model configuration.
pub const CONFIG_FILE: &str = "config.json";

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> GptError + '_ {
    move |source| GptError::Io { path: path.to_path_buf(), source }
}

fn bad(path: &Path, problem: impl Into<String>) -> GptError {
    GptError::Checkpoint { path: path.to_path_buf(), problem: problem.into() }
}

/// Bytes this process may still write before writes fail with ENOSPC (test
/// fault injection; `u64::MAX`: no limit).
static WRITE_BUDGET: AtomicU64 = AtomicU64::new(u64::MAX);

/// Fault injection for tests: after `bytes` more bytes written through
/// [`write_all_budgeted`] (every file this crate and the `macrobatch` binary
/// write), writes fail with ENOSPC as on a full disk. `None` lifts the limit.
pub fn set_write_budget(bytes: Option<u64>) {
    WRITE_BUDGET.store(bytes.unwrap_or(u64::MAX), Ordering::SeqCst);
}

/// `f.write_all(bytes)`, honouring [`set_write_budget`]: past the budget the
/// allowed prefix is written (as a real full disk does) and the call fails
/// with ENOSPC.
pub fn write_all_budgeted(f: &mut impl Write, bytes: &[u8]) -> std::io::Result<()> {
    let want = bytes.len() as u64;
    let before = WRITE_BUDGET
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |b| (b != u64::MAX).then(|| b.saturating_sub(want)))
        .unwrap_or(u64::MAX);
    if before >= want {
        return f.write_all(bytes);
    }
    f.write_all(&bytes[..before as usize])?;
    Err(std::io::Error::from_raw_os_error(28)) // ENOSPC
}

/// Name of the temporary file [`write_atomic`] uses for `name`
/// (`.NAME.tmp-PID`); leftovers of killed writers match [`is_temp_file`].
fn temp_name(name: &str) -> String {
    format!(".{name}.tmp-{}", std::process::id())
}

/// Whether `file_name` is a temporary file of [`write_atomic`] (of any process).
pub fn is_temp_file(file_name: &str) -> bool {
    file_name.starts_with('.') && file_name.rsplit_once(".tmp-").is_some_and(|(_, pid)| pid.parse::<u32>().is_ok())
}

/// Writes `bytes` to `path` atomically: a temporary file in the same
/// directory, fsync, rename, fsync of the directory. A crash leaves either
/// the old file or the new one, never a torn one; a failed write (e.g. a full
/// disk) removes its temporary file.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), GptError> {
    write_atomic_with(path, |w| write_all_budgeted(w, bytes))
}

/// [`write_atomic`] with the contents produced by `fill` in pieces (through
/// [`write_all_budgeted`]), so a large file never needs a copy in memory.
pub fn write_atomic_with(
    path: &Path,
    fill: impl FnOnce(&mut std::io::BufWriter<std::fs::File>) -> std::io::Result<()>,
) -> Result<(), GptError> {
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp: PathBuf = dir.join(temp_name(&name));
    let write = || -> Result<(), GptError> {
        let f = std::fs::File::create(&tmp).map_err(io_err(&tmp))?;
        let mut w = std::io::BufWriter::with_capacity(1 << 20, f);
        fill(&mut w).map_err(io_err(&tmp))?;
        let f = w.into_inner().map_err(|e| io_err(&tmp)(e.into_error()))?;
        f.sync_all().map_err(io_err(&tmp))?;
        drop(f);
        std::fs::rename(&tmp, path).map_err(io_err(path))
    };
    if let Err(e) = write() {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all(); // best effort: not every filesystem syncs directories
    }
    Ok(())
}

/// `config.json` in the format of `transformers`' `GPT2Config`.
pub fn config_json(cfg: &GptConfig) -> serde_json::Value {
    // GPT-2's <|endoftext|> is token 50256; a byte-level vocabulary has none.
    let eot = (cfg.vocab_size > 50256).then_some(50256);
    serde_json::json!({
        "bos_token_id": eot,
        "eos_token_id": eot,
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.block_size,
        "n_ctx": cfg.block_size,
        "n_embd": cfg.n_embd,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_inner": null,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "initializer_range": 0.02,
        "scale_attn_weights": true,
        "tie_word_embeddings": true,
        "torch_dtype": "float32",
    })
}

/// Writes named f32 tensors `(name, shape, data)` to a safetensors file,
/// atomically, with `format = pt` metadata plus `metadata`. The file is
/// streamed (header, then each tensor's little-endian bytes in chunks): no
/// copy of the tensors is ever held in memory, so saving a model costs no
/// more than a buffer, not two more copies of it.
pub fn write_safetensors(
    path: &Path,
    tensors: &[(String, Vec<usize>, &[f32])],
    metadata: &[(&str, String)],
) -> Result<(), GptError> {
    // The format: u64 LE header length, a JSON header (padded with spaces to
    // a multiple of 8) naming each tensor's dtype, shape and byte range in
    // the data that follows, then the data.
    let mut header = serde_json::Map::new();
    let mut meta = serde_json::Map::from_iter([("format".to_string(), serde_json::Value::from("pt"))]);
    meta.extend(metadata.iter().map(|(k, v)| (k.to_string(), serde_json::Value::from(v.as_str()))));
    header.insert("__metadata__".into(), serde_json::Value::Object(meta));
    let mut offset = 0usize;
    for (name, shape, data) in tensors {
        if shape.iter().product::<usize>() != data.len() {
            return Err(bad(path, format!("tensor `{name}`: shape {shape:?} does not hold {} values", data.len())));
        }
        if header.contains_key(name) {
            return Err(bad(path, format!("tensor `{name}` appears twice")));
        }
        let end = offset + 4 * data.len();
        header
            .insert(name.clone(), serde_json::json!({ "dtype": "F32", "shape": shape, "data_offsets": [offset, end] }));
        offset = end;
    }
    let mut head = serde_json::to_vec(&header).map_err(|e| bad(path, format!("cannot serialise the header: {e}")))?;
    head.resize(head.len().next_multiple_of(8), b' ');
    write_atomic_with(path, |w| {
        write_all_budgeted(w, &(head.len() as u64).to_le_bytes())?;
        write_all_budgeted(w, &head)?;
        let mut chunk = Vec::with_capacity(1 << 16);
        for (_, _, data) in tensors {
            for part in data.chunks(1 << 14) {
                chunk.clear();
                chunk.extend(part.iter().flat_map(|x| x.to_le_bytes()));
                write_all_budgeted(w, &chunk)?;
            }
        }
        Ok(())
    })
}

/// Named tensors as `(shape, data)`.
pub type Tensors = HashMap<String, (Vec<usize>, Vec<f32>)>;

/// Reads every F32 tensor of a safetensors file, and its metadata.
pub fn read_safetensors(path: &Path) -> Result<(Tensors, HashMap<String, String>), GptError> {
    let bytes = std::fs::read(path).map_err(io_err(path))?;
    let (_, meta) = SafeTensors::read_metadata(&bytes)
        .map_err(|e| bad(path, format!("not a valid safetensors file ({e}); it may be truncated or corrupt")))?;
    let st = SafeTensors::deserialize(&bytes)
        .map_err(|e| bad(path, format!("not a valid safetensors file ({e}); it may be truncated or corrupt")))?;
    let mut out = HashMap::new();
    for (name, view) in st.tensors() {
        if view.dtype() != Dtype::F32 {
            return Err(bad(path, format!("tensor `{name}` is {:?}; only F32 is supported so far", view.dtype())));
        }
        let data = view.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        out.insert(name, (view.shape().to_vec(), data));
    }
    Ok((out, meta.metadata().clone().unwrap_or_default()))
}

/// Saves `params` (laid out by `layout`) and the config into `dir`.
pub fn save(dir: &Path, cfg: &GptConfig, layout: &ParamLayout, params: &[f32]) -> Result<(), GptError> {
    std::fs::create_dir_all(dir).map_err(io_err(dir))?;
    let tensors: Vec<(String, Vec<usize>, &[f32])> =
        layout.tensors().iter().map(|t| (t.name.clone(), t.shape.clone(), &params[t.range()])).collect();
    write_safetensors(&dir.join(WEIGHTS_FILE), &tensors, &[])?;
    let cfg_path = dir.join(CONFIG_FILE);
    let text = serde_json::to_string_pretty(&config_json(cfg)).map_err(|e| bad(&cfg_path, e.to_string()))?;
    write_atomic(&cfg_path, text.as_bytes())
}

/// Reads a `GPT2Config`-style `config.json`.
pub fn load_config(path: &Path) -> Result<GptConfig, GptError> {
    let text = std::fs::read_to_string(path).map_err(io_err(path))?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(path, format!("not valid JSON: {e}")))?;
    let field =
        |names: &[&str]| -> Result<usize, GptError> {
            names.iter().find_map(|n| v.get(*n).and_then(|x| x.as_u64())).map(|x| x as usize).ok_or_else(|| {
                bad(path, format!("missing integer field `{}` (is this a GPT-2 config.json?)", names[0]))
            })
        };
    if let Some(act) = v.get("activation_function").and_then(|a| a.as_str()) {
        if !matches!(act, "gelu_new" | "gelu_pytorch_tanh") {
            return Err(bad(
                path,
                format!("activation_function `{act}` is not supported; GPT-2 uses gelu_new (tanh GELU)"),
            ));
        }
    }
    let cfg = GptConfig {
        n_layer: field(&["n_layer"])?,
        n_head: field(&["n_head"])?,
        n_embd: field(&["n_embd"])?,
        block_size: field(&["n_positions", "n_ctx"])?,
        vocab_size: field(&["vocab_size"])?,
    };
    if let Some(inner) = v.get("n_inner").and_then(|x| x.as_u64()) {
        if inner as usize != 4 * cfg.n_embd {
            return Err(bad(
                path,
                format!(
                    "n_inner = {inner} is not 4 × n_embd = {}; only the standard MLP width is supported",
                    4 * cfg.n_embd
                ),
            ));
        }
    }
    cfg.validate().map_err(|e| bad(path, e.to_string()))?;
    Ok(cfg)
}

/// Tensors a Hugging Face file may hold that are not parameters of ours.
fn is_known_extra(name: &str) -> bool {
    name == "lm_head.weight"
        || name.ends_with(".attn.bias") && !name.contains("c_attn")
        || name.ends_with(".attn.masked_bias")
}

/// Loads weights from a safetensors file into a fresh flat buffer laid out by
/// `layout`. Names may carry the `transformer.` prefix or not (the Hub's
/// `gpt2` file does not).
pub fn load_weights(path: &Path, layout: &ParamLayout) -> Result<Vec<f32>, GptError> {
    let bytes = std::fs::read(path).map_err(io_err(path))?;
    let st = SafeTensors::deserialize(&bytes)
        .map_err(|e| bad(path, format!("not a valid safetensors file ({e}); it may be truncated or corrupt")))?;
    // Fallible: a config.json that claims a huge model is an error, not an abort.
    let mut params = Vec::new();
    params.try_reserve_exact(layout.n_params()).map_err(|_| {
        bad(path, format!("cannot allocate {} bytes for the parameters", 4 * layout.n_params() as u128))
    })?;
    params.resize(layout.n_params(), 0.0f32);
    let mut used = std::collections::HashSet::new();
    for spec in layout.tensors() {
        let short = spec.name.strip_prefix("transformer.").unwrap_or(&spec.name);
        let (name, view) = [spec.name.as_str(), short]
            .iter()
            .find_map(|n| st.tensor(n).ok().map(|v| (n.to_string(), v)))
            .ok_or_else(|| bad(path, format!("tensor `{}` is missing", spec.name)))?;
        if view.shape() != spec.shape.as_slice() {
            return Err(bad(
                path,
                format!(
                    "tensor `{name}` has shape {:?} but the model needs {:?} (is config.json from the same model?)",
                    view.shape(),
                    spec.shape
                ),
            ));
        }
        if view.dtype() != Dtype::F32 {
            return Err(bad(
                path,
                format!("tensor `{name}` is {:?}; only F32 checkpoints are supported so far", view.dtype()),
            ));
        }
        for (dst, src) in params[spec.range()].iter_mut().zip(view.data().chunks_exact(4)) {
            *dst = f32::from_le_bytes([src[0], src[1], src[2], src[3]]);
        }
        used.insert(name);
    }
    let mut unexpected: Vec<String> =
        st.names().into_iter().filter(|n| !used.contains(*n) && !is_known_extra(n)).map(str::to_string).collect();
    if !unexpected.is_empty() {
        unexpected.sort();
        unexpected.truncate(5);
        return Err(bad(
            path,
            format!("unexpected tensors {unexpected:?}: the file does not hold a GPT-2 of this shape"),
        ));
    }
    Ok(params)
}

/// Loads `config.json` and `model.safetensors` from `dir`.
pub fn load(dir: &Path) -> Result<(GptConfig, Vec<f32>), GptError> {
    let cfg = load_config(&dir.join(CONFIG_FILE))?;
    let model = crate::Gpt::new(cfg)?;
    let params = load_weights(&dir.join(WEIGHTS_FILE), engine::Model::layout(&model))?;
    Ok((cfg, params))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{init_params, Gpt};
    use engine::Model;

    fn tmpdir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("macrobatch-hf-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn round_trips_by_name_and_shape() {
        let cfg = GptConfig { n_layer: 2, n_head: 2, n_embd: 8, block_size: 6, vocab_size: 11 };
        let params = init_params(&cfg, 1);
        let model = Gpt::new(cfg).unwrap();
        let dir = tmpdir("rt");
        save(&dir, &cfg, model.layout(), &params).unwrap();
        let (cfg2, params2) = load(&dir).unwrap();
        assert_eq!(cfg2, cfg);
        assert_eq!(params2, params, "bit-identical");
        // Every tensor is stored under its Hugging Face name with its shape.
        let bytes = std::fs::read(dir.join(WEIGHTS_FILE)).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(st.tensor("transformer.h.1.attn.c_attn.weight").unwrap().shape(), &[8, 24]);
        assert_eq!(st.tensor("transformer.h.0.mlp.c_proj.weight").unwrap().shape(), &[32, 8]);
        assert_eq!(st.len(), model.layout().tensors().len());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_failed_atomic_write_leaves_no_temporary_file() {
        // The publishing rename fails (the target is a non-empty directory);
        // the temporary file must not stay behind. (ENOSPC is covered by the
        // CLI tests: the write budget is process-wide.)
        let dir = tmpdir("failed-write");
        std::fs::create_dir_all(dir.join("x.json").join("inside")).unwrap();
        assert!(write_atomic(&dir.join("x.json"), b"new contents").is_err());
        let names: Vec<String> =
            std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        assert_eq!(names, vec!["x.json".to_string()], "no .x.json.tmp-PID left behind");
        assert!(is_temp_file(".x.json.tmp-1234") && !is_temp_file("x.json") && !is_temp_file(".x.tmp-abc"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn mismatched_or_truncated_files_are_named_errors() {
        let cfg = GptConfig { n_layer: 1, n_head: 2, n_embd: 8, block_size: 6, vocab_size: 11 };
        let model = Gpt::new(cfg).unwrap();
        let dir = tmpdir("bad");
        save(&dir, &cfg, model.layout(), &init_params(&cfg, 1)).unwrap();
        let other = Gpt::new(GptConfig { n_embd: 4, ..cfg }).unwrap();
        let e = load_weights(&dir.join(WEIGHTS_FILE), other.layout()).unwrap_err().to_string();
        assert!(e.contains("model.safetensors") && e.contains("shape"), "{e}");
        let deeper = Gpt::new(GptConfig { n_layer: 2, ..cfg }).unwrap();
        let e = load_weights(&dir.join(WEIGHTS_FILE), deeper.layout()).unwrap_err().to_string();
        assert!(e.contains("missing"), "{e}");
        let w = dir.join(WEIGHTS_FILE);
        let bytes = std::fs::read(&w).unwrap();
        std::fs::write(&w, &bytes[..bytes.len() / 2]).unwrap();
        let e = load(&dir).unwrap_err().to_string();
        assert!(e.contains("truncated or corrupt"), "{e}");
        std::fs::write(dir.join(CONFIG_FILE), "{\"n_layer\": 1}").unwrap();
        assert!(load(&dir).unwrap_err().to_string().contains("n_head"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
