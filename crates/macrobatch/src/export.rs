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
//! renamed over it), and only when it is an export of ours — never the
//! model being exported, a folder holding it, or a file or folder of the
//! user's. One export at a time writes a path (`PATH.lock`).

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
    check_out(args)
}

/// Checks that `--out` may be written: it is not the model being exported
/// nor a folder holding it, and if it exists, `--force` is given and it is
/// an export of ours outside the model ([`replaceable`]).
fn check_out(args: &ExportArgs) -> Result<()> {
    let (out, run) = (&args.out, &args.run);
    let (out_abs, run_abs) = (crate::folder::resolved(out), crate::folder::resolved(run));
    if out_abs == run_abs {
        bail!("--out {} is the model being exported; choose another path", out.display());
    }
    if run_abs.starts_with(&out_abs) {
        bail!(
            "--out {} holds the model being exported ({}): replacing it would delete the model and everything beside it; choose a new path outside it",
            out.display(),
            run.display()
        );
    }
    if !(out.exists() || out.is_symlink()) {
        return Ok(());
    }
    if !args.force {
        bail!(
            "--out {} exists; nothing is overwritten without --force (which replaces it only once the new export is complete), or choose another path",
            out.display()
        );
    }
    if out_abs.starts_with(&run_abs) {
        bail!(
            "--out {} is inside the model being exported ({}): replacing it would change the model being read; choose a new path",
            out.display(),
            run.display()
        );
    }
    replaceable(out, args.format)
}

/// The files an export of ours holds (a Hugging Face folder).
const EXPORT_FILES: &[&str] = &[
    family::CONFIG_FILE,
    family::WEIGHTS_FILE,
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
];

/// Checks that the existing `out` is what `--force` may replace: an empty
/// folder or one holding only an export of ours (`hf`), or a GGUF file
/// (`gguf`). Anything else may be the user's, and is never deleted.
fn replaceable(out: &Path, format: Format) -> Result<()> {
    let refuse = |what: String| -> Result<()> {
        bail!(
            "--out {} is not an export of ours ({what}); --force replaces only a previous export, never what may be yours: choose another --out, or remove {} yourself if nothing in it is needed",
            out.display(),
            out.display()
        )
    };
    match format {
        Format::Gguf => {
            let mut magic = [0u8; 4];
            let read = std::fs::File::open(out).and_then(|mut f| std::io::Read::read_exact(&mut f, &mut magic));
            if read.is_err() || &magic != b"GGUF" {
                return refuse("not a GGUF file".into());
            }
        }
        Format::Hf => {
            let mut names = Vec::new();
            let mut foreign = Vec::new();
            for e in std::fs::read_dir(out).with_context(|| format!("cannot read the folder {}", out.display()))? {
                let e = e.with_context(|| format!("cannot read the folder {}", out.display()))?;
                let name = e.file_name().to_string_lossy().into_owned();
                let is_file = e.file_type().is_ok_and(|t| t.is_file());
                if !is_file || !EXPORT_FILES.contains(&name.as_str()) {
                    foreign.push(name.clone());
                }
                names.push(name);
            }
            foreign.sort();
            if !foreign.is_empty() {
                let shown: Vec<&str> = foreign.iter().take(5).map(String::as_str).collect();
                let more = if foreign.len() > 5 { format!(" and {} more", foreign.len() - 5) } else { String::new() };
                return refuse(format!("it holds {}{more}, which export does not write", shown.join(", ")));
            }
            let missing: Vec<&str> = [family::CONFIG_FILE, family::WEIGHTS_FILE, "generation_config.json"]
                .into_iter()
                .filter(|f| !names.iter().any(|n| n == f))
                .collect();
            if !names.is_empty() && !missing.is_empty() {
                return refuse(format!("it has no {}", missing.join(", ")));
            }
        }
    }
    Ok(())
}

/// The lock on a path being exported: `PATH.lock`, created exclusively and
/// holding this process's id, removed when dropped. A lock whose process is
/// gone (killed mid-export) is taken over.
struct OutLock {
    path: PathBuf,
}

impl OutLock {
    fn take(out: &Path) -> Result<Self> {
        let name = out.file_name().with_context(|| format!("--out {} names no file or folder", out.display()))?;
        let parent = out.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        std::fs::create_dir_all(parent).with_context(|| format!("cannot create {}", parent.display()))?;
        let path = parent.join(format!("{}.lock", name.to_string_lossy()));
        // A few tries: a holder that finishes (or a dead one's lock taken
        // over) between our create and our read lets us try again.
        for _ in 0..4 {
            match std::fs::OpenOptions::new().write(true).create_new(true).open(&path) {
                Ok(mut f) => {
                    let lock = OutLock { path };
                    std::io::Write::write_all(&mut f, format!("{}\n", std::process::id()).as_bytes())
                        .with_context(|| format!("cannot write the lock file {}", lock.path.display()))?;
                    return Ok(lock);
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(e).with_context(|| format!("cannot create the lock file {}", path.display())),
            }
            // The holder creates the file, then writes its id: give it a
            // moment to do so before calling the lock nameless.
            let mut holder = None;
            for _ in 0..20 {
                match std::fs::read_to_string(&path) {
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => break,
                    Ok(h) if !h.trim().is_empty() => {
                        holder = Some(h);
                        break;
                    }
                    _ => std::thread::sleep(std::time::Duration::from_millis(50)),
                }
            }
            // A lock file without a readable process id.
            let nameless = || {
                anyhow::anyhow!(
                    "--out {} is being written by another process (it holds {}); wait for it to finish, or choose another --out (if no export is running, remove {})",
                    out.display(),
                    path.display(),
                    path.display()
                )
            };
            let Some(holder) = holder else {
                if path.exists() {
                    return Err(nameless());
                }
                continue; // the holder finished: try again
            };
            match holder.trim().parse::<i32>() {
                Ok(pid) if pid > 0 && !alive(pid) => {
                    eprintln!("note: taking over {}, left by process {pid}, which has ended", path.display());
                    let _ = std::fs::remove_file(&path);
                }
                Ok(pid) => bail!(
                    "--out {} is being written by process {pid} (another export holds {}); wait for it to finish, or choose another --out (if no export is running, remove {})",
                    out.display(),
                    path.display(),
                    path.display()
                ),
                Err(_) => return Err(nameless()),
            }
        }
        bail!(
            "--out {} is being written by another process (it took {} first); choose another --out",
            out.display(),
            path.display()
        )
    }
}

impl Drop for OutLock {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Whether process `pid` exists (signal 0: a permission error means it does).
fn alive(pid: i32) -> bool {
    // SAFETY: kill with signal 0 sends nothing; it only checks the process.
    let r = unsafe { libc::kill(pid, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

/// Exports the model and says what was written.
pub fn run(args: ExportArgs) -> Result<()> {
    check_args(&args)?;
    let _lock = OutLock::take(&args.out)?;
    // Again under the lock: another export may have written --out since.
    check_out(&args)?;
    remove_stale_staging(&args.out);
    // Tests inject a full disk (or a kill) here: as rank 0's step 1.
    if let Some(fault) = crate::dist::Fault::from_env()? {
        fault.maybe_fire(0, 1)?;
    }
    saved::point_to_checkpoints(&args.run)?;
    // A sharded run's model is its last checkpoint.
    let model = crate::checkpoint::model_dir(&args.run)?;
    if model.is_dir() && !model.join(family::CONFIG_FILE).is_file() {
        bail!(
            "{} holds no model (no config.json): export takes a finished run folder (train --out DIR), a Hugging Face folder or a GGUF file",
            args.run.display()
        );
    }
    crate::memory::check_load(&model, &format!("export {}", args.run.display()))
        .with_context(|| format!("cannot load a model from {}", args.run.display()))?;
    let (family, params) = crate::saved::load_whole(&args.run)
        .with_context(|| format!("cannot load a model from {}", args.run.display()))?;
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

/// Under the lock: removes what an export to `out` killed before it
/// finished left beside it (`.NAME.part-PID`, and its `.old` of a replaced
/// folder), when process PID has ended; says so for each.
fn remove_stale_staging(out: &Path) {
    let (Some(name), Some(parent)) = (out.file_name(), out.parent()) else { return };
    let parent = if parent.as_os_str().is_empty() { Path::new(".") } else { parent };
    let prefix = format!(".{}.part-", name.to_string_lossy());
    let Ok(entries) = std::fs::read_dir(parent) else { return };
    for e in entries.filter_map(|e| e.ok()) {
        let file = e.file_name().to_string_lossy().into_owned();
        let Some(tail) = file.strip_prefix(&prefix) else { continue };
        let Ok(pid) = tail.strip_suffix(".old").unwrap_or(tail).parse::<i32>() else { continue };
        if pid <= 0 || alive(pid) {
            continue;
        }
        let path = e.path();
        let removed = if path.is_dir() && !path.is_symlink() {
            std::fs::remove_dir_all(&path)
        } else {
            std::fs::remove_file(&path)
        };
        match removed {
            Ok(()) => eprintln!(
                "note: removed {}, left by an export (process {pid}) that was killed before it finished",
                path.display()
            ),
            Err(e) => {
                eprintln!("warning: cannot remove {}, left by an ended export (process {pid}): {e}", path.display())
            }
        }
    }
}

/// Moves the finished `staged` output to `out` (under the lock), replacing
/// what is there only now, and only an export of ours with `--force`.
fn publish(staged: &Path, args: &ExportArgs) -> Result<()> {
    let out = &args.out;
    if out.exists() || out.is_symlink() {
        if !args.force {
            bail!(
                "--out {} appeared while exporting; nothing is overwritten without --force, so this export is not kept: choose another path",
                out.display()
            );
        }
        replaceable(out, args.format)?;
    }
    if out.is_dir() {
        let mut old = staged.as_os_str().to_owned();
        old.push(".old");
        let old = PathBuf::from(old);
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
fn staged(args: &ExportArgs, write: impl FnOnce(&Path) -> Result<()>) -> Result<u64> {
    let tmp = staging(&args.out)?;
    let result = write(&tmp).and_then(|()| {
        let bytes = bytes_of(&tmp);
        publish(&tmp, args).map(|()| bytes)
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
    staged(args, |dir| {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
        let model = family.build(Build::default())?;
        family.save_hf(dir, model.layout(), params).with_context(|| {
            format!("cannot write the model's weights for --out {} (nothing there was changed)", args.out.display())
        })?;
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
        let text = serde_json::to_string_pretty(&generation)? + "\n";
        nn::io::write_atomic(&dir.join("generation_config.json"), text.as_bytes())
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
    // The serialized file is as large as the f32 file read above, so the
    // peak stays that of reading it.
    let bytes = safetensors::serialize(views, meta.metadata().clone())?;
    nn::io::write_atomic(path, &bytes).with_context(|| format!("cannot write {}", path.display()))?;
    Ok(())
}

fn set_torch_dtype(path: &Path, dtype: Dtype) -> Result<()> {
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let mut v: serde_json::Value = serde_json::from_str(&text)?;
    v["torch_dtype"] = if dtype == Dtype::F16 { "float16" } else { "bfloat16" }.into();
    let text = serde_json::to_string_pretty(&v)? + "\n";
    nn::io::write_atomic(path, text.as_bytes()).with_context(|| format!("cannot write {}", path.display()))?;
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
    // Written under a name of this process's, renamed over --out when
    // complete: an existing file (--force) is replaced only then.
    staged(args, |tmp| Ok(g.write(tmp, ty)?))
}
