//! `macrobatch export RUN --format hf|gguf`: a run (or any model `generate`
//! loads) as a standalone model for other tools. LoRA adapters are merged
//! into the base first (W + α/r·B·A, in f32), so what is written is a plain
//! model of the family:
//! - `hf`: a folder transformers loads — `config.json`, `model.safetensors`
//!   (f32, f16 or bf16, rounded to nearest even as torch's `.to()` does),
//!   the tokenizer files and `generation_config.json`;
//! - `gguf`: one file llama.cpp, Ollama, LM Studio and transformers' GGUF
//!   reader load — the family's architecture metadata and tensors in
//!   llama.cpp's names and layout (`Family::gguf_export`), the tokenizer's
//!   vocabulary, merges, special ids and chat template, and the weights in
//!   f32, f16, bf16, Q8_0 or Q4_0 (one-dimensional tensors stay f32, as
//!   llama.cpp's converter keeps them).
//!
//! Nothing is overwritten without `--force`, and with it the old output is
//! replaced only once the new one is complete (written beside it, then
//! renamed over it).

use crate::family::{self, Build, Family};
use crate::saved;
use crate::ExportArgs;
use anyhow::{bail, Context, Result};
use data::Tokenizer;
use safetensors::tensor::{Dtype as StDtype, SafeTensors, TensorView};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// A Hugging Face folder.
    Hf,
    /// One GGUF file.
    Gguf,
}

/// The weight type written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Dtype {
    /// 32-bit floats (exact).
    F32,
    /// IEEE half precision.
    F16,
    /// bfloat16.
    Bf16,
    /// ggml's 8-bit blocks of 32 (GGUF only).
    #[value(name = "q8_0")]
    Q8_0,
    /// ggml's 4-bit blocks of 32 (GGUF only).
    #[value(name = "q4_0")]
    Q4_0,
}

impl Dtype {
    fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "f32",
            Dtype::F16 => "f16",
            Dtype::Bf16 => "bf16",
            Dtype::Q8_0 => "q8_0",
            Dtype::Q4_0 => "q4_0",
        }
    }
}

/// Checks what can be checked before loading anything: the format takes
/// the dtype, and `--out` is free (or `--force`).
fn check_args(args: &ExportArgs) -> Result<()> {
    if args.format == Format::Hf && matches!(args.dtype, Dtype::Q8_0 | Dtype::Q4_0) {
        bail!(
            "--dtype {} is a GGUF block type; a Hugging Face folder holds f32, f16 or bf16 weights: give --format gguf, or --dtype f32/f16/bf16",
            args.dtype.name()
        );
    }
    if crate::folder::same_path(&args.run, &args.out) {
        bail!("--out {} is the model being exported; choose another path", args.out.display());
    }
    let out = &args.out;
    match args.format {
        Format::Gguf if out.is_dir() => {
            bail!("--out {} is a folder; --format gguf writes one file: give a path ending in .gguf", out.display())
        }
        Format::Hf if out.is_file() => {
            bail!("--out {} is a file; --format hf writes a folder: give a folder path", out.display())
        }
        _ => {}
    }
    if out.exists() && !args.force {
        bail!(
            "--out {} exists; nothing is overwritten without --force (which replaces it only once the new export is complete), or choose another path",
            out.display()
        );
    }
    Ok(())
}

/// Exports the model and says what was written.
pub fn run(args: ExportArgs) -> Result<()> {
    check_args(&args)?;
    saved::point_to_checkpoints(&args.run)?;
    if args.run.is_dir() && !args.run.join(family::CONFIG_FILE).is_file() {
        bail!(
            "{} holds no model (no config.json): export takes a finished run folder (train --out DIR), a Hugging Face folder or a GGUF file",
            args.run.display()
        );
    }
    crate::memory::check_load(&args.run, &format!("export {}", args.run.display()))
        .with_context(|| format!("cannot load a model from {}", args.run.display()))?;
    let (family, params) =
        family::load_hf(&args.run).with_context(|| format!("cannot load a model from {}", args.run.display()))?;
    let (family, params, merged) = match family.merged(&params)? {
        Some((f, p)) => (f, p, true),
        None => (family, params, false),
    };
    let tok = saved::tokenizer_of(&args.run)?;
    let written = match args.format {
        Format::Hf => write_hf(&args, &family, &params, &tok)?,
        Format::Gguf => write_gguf(&args, &family, &params, &tok)?,
    };
    eprintln!(
        "exported {} ({}{}) as {} {} to {} ({:.1} MB)",
        args.run.display(),
        family.describe(),
        if merged { ", LoRA adapters merged" } else { "" },
        match args.format {
            Format::Hf => "a Hugging Face folder",
            Format::Gguf => "GGUF",
        },
        args.dtype.name(),
        args.out.display(),
        written as f64 / 1e6
    );
    Ok(())
}

/// A path beside `out` for writing the new output before it replaces `out`.
fn staging(out: &Path) -> Result<PathBuf> {
    let name = out.file_name().with_context(|| format!("--out {} names no file or folder", out.display()))?;
    let parent = out.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).with_context(|| format!("cannot create {}", parent.display()))?;
    Ok(parent.join(format!(".{}.part-{}", name.to_string_lossy(), std::process::id())))
}

/// Moves the finished `staged` output to `out`, replacing what is there
/// only now (`--force`).
fn publish(staged: &Path, out: &Path) -> Result<()> {
    if out.is_dir() {
        let old = staged.with_extension("old");
        std::fs::rename(out, &old).with_context(|| format!("cannot move the old {} aside", out.display()))?;
        std::fs::rename(staged, out).with_context(|| format!("cannot move the export to {}", out.display()))?;
        std::fs::remove_dir_all(&old).with_context(|| format!("cannot remove the old export {}", old.display()))?;
    } else {
        std::fs::rename(staged, out).with_context(|| format!("cannot move the export to {}", out.display()))?;
    }
    Ok(())
}

/// Runs `write` into a staging path, publishing it on success and removing
/// it on failure; returns the bytes written.
fn staged(out: &Path, write: impl FnOnce(&Path) -> Result<()>) -> Result<u64> {
    let tmp = staging(out)?;
    let result = write(&tmp).and_then(|()| {
        let bytes = bytes_of(&tmp);
        publish(&tmp, out).map(|()| bytes)
    });
    if result.is_err() {
        let _ = if tmp.is_dir() { std::fs::remove_dir_all(&tmp) } else { std::fs::remove_file(&tmp) };
    }
    result
}

fn bytes_of(p: &Path) -> u64 {
    match std::fs::read_dir(p) {
        Ok(rd) => rd.filter_map(|e| e.ok()).map(|e| bytes_of(&e.path())).sum(),
        Err(_) => std::fs::metadata(p).map_or(0, |m| m.len()),
    }
}

/// The tokenizer files a model folder may carry, copied as they are.
const TOKENIZER_FILES: &[&str] =
    &["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt"];

fn write_hf(args: &ExportArgs, family: &Arc<dyn Family>, params: &[f32], tok: &Tokenizer) -> Result<u64> {
    staged(&args.out, |dir| {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
        let model = family.build(Build::default())?;
        family.save_hf(dir, model.layout(), params)?;
        drop(model);
        if args.dtype != Dtype::F32 {
            to_half(&dir.join(family::WEIGHTS_FILE), args.dtype)?;
            set_torch_dtype(&dir.join(family::CONFIG_FILE), args.dtype)?;
        }
        // The tokenizer: its files as the source has them, else as ours writes them.
        let mut copied = false;
        if args.run.is_dir() {
            for f in TOKENIZER_FILES {
                let src = args.run.join(f);
                if src.is_file() {
                    std::fs::copy(&src, dir.join(f)).with_context(|| format!("cannot copy {}", src.display()))?;
                    copied = true;
                }
            }
        }
        if !copied && !tok.save_pretrained(dir)? {
            eprintln!(
                "note: the model's tokenizer is bytes (one token per UTF-8 byte), which has no Hugging Face tokenizer file: token ids are byte values"
            );
        }
        let generation = generation_config(tok);
        std::fs::write(dir.join("generation_config.json"), serde_json::to_string_pretty(&generation)? + "\n")
            .context("cannot write generation_config.json")?;
        Ok(())
    })
}

/// `generation_config.json`: the special ids generation stops and pads with.
fn generation_config(tok: &Tokenizer) -> serde_json::Value {
    let mut g = serde_json::json!({ "_from_model_config": true });
    for (key, id) in [("bos_token_id", tok.bos_id()), ("eos_token_id", tok.eos_id()), ("pad_token_id", tok.pad_id())] {
        if let Some(id) = id {
            g[key] = id.into();
        }
    }
    g
}

/// Rewrites an f32 safetensors file with 16-bit values (round to nearest even).
fn to_half(path: &Path, dtype: Dtype) -> Result<()> {
    let bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    let st =
        SafeTensors::deserialize(&bytes).with_context(|| format!("{} is not a safetensors file", path.display()))?;
    let (_, meta) = SafeTensors::read_metadata(&bytes)?;
    let mut converted: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, view) in st.tensors() {
        let f32s = view.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]));
        let data: Vec<u8> = match dtype {
            Dtype::F16 => f32s.flat_map(|x| half::f16::from_f32(x).to_le_bytes()).collect(),
            _ => f32s.flat_map(|x| half::bf16::from_f32(x).to_le_bytes()).collect(),
        };
        converted.push((name, view.shape().to_vec(), data));
    }
    drop(bytes);
    let st_dtype = if dtype == Dtype::F16 { StDtype::F16 } else { StDtype::BF16 };
    let views = converted
        .iter()
        .map(|(n, s, d)| Ok((n.clone(), TensorView::new(st_dtype, s.clone(), d)?)))
        .collect::<Result<Vec<_>>>()?;
    let tmp = path.with_extension("half");
    safetensors::serialize_to_file(views, meta.metadata().clone(), &tmp)
        .with_context(|| format!("cannot write {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("cannot write {}", path.display()))?;
    Ok(())
}

fn set_torch_dtype(path: &Path, dtype: Dtype) -> Result<()> {
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let mut v: serde_json::Value = serde_json::from_str(&text)?;
    v["torch_dtype"] = if dtype == Dtype::F16 { "float16" } else { "bfloat16" }.into();
    std::fs::write(path, serde_json::to_string_pretty(&v)? + "\n")
        .with_context(|| format!("cannot write {}", path.display()))?;
    Ok(())
}

fn write_gguf(args: &ExportArgs, family: &Arc<dyn Family>, params: &[f32], tok: &Tokenizer) -> Result<u64> {
    let id = match args.dtype {
        Dtype::F32 => gguf::GgmlType::F32,
        Dtype::F16 => gguf::GgmlType::F16,
        Dtype::Bf16 => gguf::GgmlType::BF16,
        Dtype::Q8_0 => gguf::GgmlType::Q8_0,
        Dtype::Q4_0 => gguf::GgmlType::Q4_0,
    };
    let ty = gguf::GgmlType::from_id(id).context("every --dtype is a ggml type")?;
    let model = family.build(Build::default())?;
    let layout = model.layout().clone();
    drop(model);
    let mut g = family.gguf_export(&layout, params)?;
    // The tokenizer, its token list padded to the model's vocabulary
    // (llama.cpp sizes the vocabulary by it).
    let vocab = tok
        .gguf_metadata_padded(family.vocab_size())
        .with_context(|| format!("cannot write the tokenizer of {} into a GGUF file", args.run.display()))?;
    g.metadata.extend(vocab);
    // The writer goes through PATH.part and renames it over --out when
    // complete: an existing file (--force) is replaced only then.
    if let Some(parent) = args.out.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).with_context(|| format!("cannot create {}", parent.display()))?;
    }
    g.write(&args.out, ty)?;
    Ok(bytes_of(&args.out))
}
