//! `macrobatch prepare`: tokenize text files once into `DIR/train.bin` +
//! `DIR/val.bin` (u16 when the vocabulary fits, else u32) and `DIR/meta.json`,
//! for `data.format = "u16" | "u32"` training from token files.
//!
//! The inputs are cut into chunks at fixed places — the first newline at or
//! after every `chunk_bytes` of a file — that depend on the content only, so
//! the output bytes are the same for any number of threads. Chunks are
//! tokenized in parallel a wave at a time and written in input order, so
//! memory stays at one wave of chunks, whatever the size of the inputs.

use crate::setup::text_files;
use crate::PrepareArgs;
use anyhow::{bail, Context, Result};
use data::{SourceFile, TokenDtype, TokenFileMeta, Tokenizer, TokenizerSpec};
use indicatif::{ProgressBar, ProgressStyle};
use rayon::prelude::*;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

/// Every file named by `inputs`, in order: files as given, folders as
/// [`text_files`] lists them.
fn list_inputs(inputs: &[PathBuf]) -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for input in inputs {
        if !input.exists() {
            bail!("input {}: no such file or folder", input.display());
        }
        files.extend(text_files(input)?);
    }
    if files.is_empty() {
        let names: Vec<String> = inputs.iter().map(|p| p.display().to_string()).collect();
        bail!("the inputs hold no files to tokenize ({})", names.join(", "));
    }
    Ok(files)
}

/// A piece of one input: bytes `[start, end)` of file `file_idx`.
#[derive(Debug, Clone, Copy)]
struct Chunk {
    file_idx: usize,
    start: u64,
    end: u64,
}

/// Reads bytes `[start, end)` of `path`.
fn read_range(path: &Path, start: u64, end: u64) -> Result<Vec<u8>> {
    let mut f = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    f.seek(SeekFrom::Start(start)).with_context(|| format!("cannot read {}", path.display()))?;
    let mut buf = Vec::with_capacity((end - start) as usize);
    f.take(end - start).read_to_end(&mut buf).with_context(|| format!("cannot read {}", path.display()))?;
    if (buf.len() as u64) < end - start {
        bail!("{} shrank while being read", path.display());
    }
    Ok(buf)
}

/// The chunks of one file: cut at the first newline at or after every
/// `chunk_bytes` (so a cut never splits a line or a UTF-8 character).
fn chunks_of(file_idx: usize, path: &Path, n_bytes: u64, chunk_bytes: u64) -> Result<Vec<Chunk>> {
    let mut chunks = Vec::new();
    let mut start = 0;
    while start < n_bytes {
        let mut end = (start + chunk_bytes).min(n_bytes);
        // Look for the newline in small reads: only a few pages per cut.
        while end < n_bytes {
            let probe = read_range(path, end, (end + 4096).min(n_bytes))?;
            match probe.iter().position(|&b| b == b'\n') {
                Some(i) => {
                    end += i as u64 + 1;
                    break;
                }
                None => end += probe.len() as u64,
            }
        }
        chunks.push(Chunk { file_idx, start, end });
        start = end;
    }
    Ok(chunks)
}

/// The tokens of one chunk as `dtype` bytes, after the tokenizer's EOS when
/// the chunk starts a file other than the first (so documents are joined as
/// in `Corpus::load_files`).
fn tokenize_chunk(tok: &Tokenizer, dtype: TokenDtype, path: &Path, chunk: Chunk) -> Result<(Vec<u8>, u64)> {
    let bytes = read_range(path, chunk.start, chunk.end)?;
    let text = data::text_of(path, &bytes, chunk.start)?;
    let mut tokens = Vec::new();
    if chunk.file_idx > 0 && chunk.start == 0 {
        tokens.extend(tok.eos_id());
    }
    tokens.extend(tok.encode(text).with_context(|| format!("tokenizing {}", path.display()))?);
    let mut out = Vec::with_capacity(tokens.len() * dtype.width());
    dtype.encode(&tokens, &mut out).with_context(|| format!("tokenizing {}", path.display()))?;
    Ok((out, tokens.len() as u64))
}

/// Moves the last `n_val` tokens of `train` (holding `n_total`) into a new
/// `val` file and cuts them off `train`.
fn split_tail(train: &Path, val: &Path, n_total: u64, n_val: u64, width: u64) -> Result<()> {
    let cut = (n_total - n_val) * width;
    let mut src = File::options().read(true).write(true).open(train)?;
    src.seek(SeekFrom::Start(cut))?;
    let mut dst = File::create(val).with_context(|| format!("cannot create {}", val.display()))?;
    std::io::copy(&mut (&src).take(n_val * width), &mut dst)
        .with_context(|| format!("cannot write {}", val.display()))?;
    dst.sync_all()?;
    src.set_len(cut)?;
    src.sync_all()?;
    Ok(())
}

/// `macrobatch prepare`.
/// prepare never overwrites token files.
fn refuse_existing(paths: &[&Path]) -> Result<()> {
    if let Some(p) = paths.iter().find(|p| p.exists()) {
        bail!("{} exists already; choose another --out folder (prepare never overwrites token files)", p.display());
    }
    Ok(())
}

pub fn run(args: PrepareArgs) -> Result<()> {
    if !(args.val_fraction >= 0.0 && args.val_fraction < 1.0) {
        bail!(
            "--val-fraction {}: give a share from 0 (no val.bin) up to but not including 1, e.g. 0.1",
            args.val_fraction
        );
    }
    if args.chunk_bytes == 0 {
        bail!("--chunk-bytes must be at least 1");
    }
    let spec = TokenizerSpec::parse(&args.tokenizer).context("--tokenizer")?;
    let tok = spec.build()?;
    let dtype = TokenDtype::for_vocab(tok.vocab_size());
    let files = list_inputs(&args.inputs)?;
    let out = &args.out;
    let (train_path, val_path, meta_path) = (out.join("train.bin"), out.join("val.bin"), out.join(TokenFileMeta::FILE));
    refuse_existing(&[&train_path, &val_path, &meta_path])?;
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    // One process writes the folder; checked again under the lock, since
    // another prepare may have finished into it since the check above.
    let _lock = crate::folder::lock_then(out, "prepare", || refuse_existing(&[&train_path, &val_path, &meta_path]))?;

    let sizes: Vec<u64> = files
        .iter()
        .map(|p| std::fs::metadata(p).map(|m| m.len()).with_context(|| format!("cannot read {}", p.display())))
        .collect::<Result<_>>()?;
    let total_bytes: u64 = sizes.iter().sum();
    let (sha, chunks) = rayon::join(
        || files.par_iter().map(|p| crate::digest::sha256_file(p).map(|(_, h)| h)).collect::<Result<Vec<_>>>(),
        || {
            files
                .par_iter()
                .zip(&sizes)
                .enumerate()
                .map(|(i, (p, &n))| chunks_of(i, p, n, args.chunk_bytes as u64))
                .collect::<Result<Vec<_>>>()
        },
    );
    let (sha, chunks): (Vec<String>, Vec<Chunk>) = (sha?, chunks?.into_iter().flatten().collect());

    let bar = ProgressBar::new(total_bytes);
    bar.set_style(
        ProgressStyle::with_template("{bar:30} {bytes}/{total_bytes} {msg} [{elapsed_precise} < {eta_precise}]")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_message(format!("tokenizing ({})", spec.name()));
    // Written under a temporary name: a failed run leaves no train.bin that looks finished.
    let tmp_path = out.join("train.bin.partial");
    let written = (|| -> Result<u64> {
        let mut w = std::io::BufWriter::new(
            File::create(&tmp_path).with_context(|| format!("cannot create {}", tmp_path.display()))?,
        );
        let mut n_tokens = 0u64;
        // Two chunks per thread in flight: enough to balance, and memory stays
        // at a few chunks (text, ids and bytes) per thread.
        let wave = 2 * rayon::current_num_threads();
        for group in chunks.chunks(wave) {
            let done: Vec<(Vec<u8>, u64)> = group
                .par_iter()
                .map(|c| {
                    let r = tokenize_chunk(&tok, dtype, &files[c.file_idx], *c);
                    bar.inc(c.end - c.start);
                    r
                })
                .collect::<Result<_>>()?;
            for (bytes, n) in done {
                w.write_all(&bytes).with_context(|| format!("cannot write {}", tmp_path.display()))?;
                n_tokens += n;
            }
        }
        let f = w
            .into_inner()
            .map_err(|e| e.into_error())
            .with_context(|| format!("cannot write {}", tmp_path.display()))?;
        f.sync_all()?;
        Ok(n_tokens)
    })();
    bar.finish_and_clear();
    let n_tokens = match written {
        Ok(n) => n,
        Err(e) => {
            let _ = std::fs::remove_file(&tmp_path);
            return Err(e);
        }
    };
    if n_tokens == 0 {
        let _ = std::fs::remove_file(&tmp_path);
        bail!("the inputs hold no text: no tokens to write");
    }
    let n_val = data::n_val_tokens(n_tokens as usize, args.val_fraction) as u64;
    if n_val == n_tokens {
        let _ = std::fs::remove_file(&tmp_path);
        bail!(
            "--val-fraction {} holds out all {n_tokens} tokens, leaving train.bin empty; give a smaller share (e.g. 0.1) or more text",
            args.val_fraction
        );
    }
    let finish = || -> Result<()> {
        if n_val > 0 {
            split_tail(&tmp_path, &val_path, n_tokens, n_val, dtype.width() as u64)
                .with_context(|| format!("cannot split {} into train and validation", tmp_path.display()))?;
        }
        std::fs::rename(&tmp_path, &train_path).with_context(|| format!("cannot create {}", train_path.display()))?;
        let meta = TokenFileMeta {
            tokenizer: spec.name(),
            vocab_size: tok.vocab_size(),
            dtype,
            n_train_tokens: n_tokens - n_val,
            n_val_tokens: n_val,
            val_fraction: args.val_fraction,
            sources: files
                .iter()
                .zip(&sizes)
                .zip(sha)
                .map(|((p, &n_bytes), sha256)| SourceFile { path: p.display().to_string(), n_bytes, sha256 })
                .collect(),
        };
        nn::io::write_atomic(&meta_path, serde_json::to_string_pretty(&meta)?.as_bytes())?;
        Ok(())
    };
    if let Err(e) = finish() {
        for p in [&tmp_path, &train_path, &val_path] {
            let _ = std::fs::remove_file(p);
        }
        return Err(e);
    }
    let (val_written, val_set) = if n_val > 0 {
        (
            format!(" and {} ({n_val} tokens)", val_path.display()),
            format!(" --set data.val_path={}", val_path.display()),
        )
    } else {
        (
            " and no val.bin (--val-fraction 0: training holds out the last data.val_fraction of train.bin unless data.val_path names a file)".into(),
            String::new(),
        )
    };
    eprintln!(
        "wrote {} ({} tokens){val_written} as {} with tokenizer `{}` from {} file(s), {} bytes; train with --set data.path={}{val_set} --set data.format={}",
        train_path.display(),
        n_tokens - n_val,
        dtype.name(),
        spec.name(),
        files.len(),
        total_bytes,
        train_path.display(),
        dtype.name()
    );
    Ok(())
}
