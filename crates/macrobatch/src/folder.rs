//! Run folders: one process at a time (an advisory lock the kernel releases
//! when the holder dies), and a new run never writes into a folder that holds
//! anything but the leftovers of a run of ours that never finished a step.

use anyhow::{bail, Context, Result};
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

/// The lock file inside a folder a command writes. It stays after the run
/// (removing it would race with the next locker); the lock is the `flock`
/// on it, not its existence.
pub const LOCK_FILE: &str = ".macrobatch.lock";

/// An exclusive `flock` on `DIR/.macrobatch.lock`, held until dropped or
/// until the process dies (kill -9 included: the kernel releases it).
#[derive(Debug)]
pub struct FolderLock {
    _file: File,
}

/// Takes the folder's lock for `what` (e.g. "train"), or fails naming the
/// process that holds it. `dir` must exist.
pub fn lock(dir: &Path, what: &str) -> Result<FolderLock> {
    let path = dir.join(LOCK_FILE);
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .with_context(|| format!("cannot open the lock file {}", path.display()))?;
    match file.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => {
            let holder = std::fs::read_to_string(&path).unwrap_or_default();
            let holder = holder.trim();
            let who = if holder.is_empty() { "another process".to_string() } else { format!("process {holder}") };
            bail!(
                "{} is in use: {who} holds its lock ({}); one process at a time may write a run folder. Wait for it to finish (or stop it), then run again",
                dir.display(),
                path.display()
            );
        }
        Err(std::fs::TryLockError::Error(e)) => {
            return Err(e).with_context(|| format!("cannot lock {}", path.display()));
        }
    }
    // Who holds it, for the message a second process prints.
    let me = format!("{} ({what})\n", std::process::id());
    file.set_len(0)
        .and_then(|()| file.write_all(me.as_bytes()))
        .with_context(|| format!("cannot write {}", path.display()))?;
    Ok(FolderLock { _file: file })
}

/// The entries of `dir` other than the lock file, sorted; empty when `dir`
/// does not exist.
fn entries(dir: &Path) -> Result<Vec<String>> {
    let rd = match std::fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e).with_context(|| format!("cannot read the folder {}", dir.display())),
    };
    let mut names = Vec::new();
    for e in rd {
        let e = e.with_context(|| format!("cannot read the folder {}", dir.display()))?;
        let name = e.file_name().to_string_lossy().into_owned();
        if name != LOCK_FILE {
            names.push(name);
        }
    }
    names.sort();
    Ok(names)
}

/// True when `dir` holds a run of ours (its `run_id`) that never recorded a
/// step: no line in `metrics.jsonl`, no checkpoint, no saved model. What such
/// a run wrote (config, tokenizer, an empty metrics file) is ours to replace.
pub fn unstarted_run(dir: &Path, run_id_file: &str, weights_file: &str) -> bool {
    dir.join(run_id_file).is_file()
        && std::fs::metadata(dir.join("metrics.jsonl")).map_or(true, |m| m.len() == 0)
        && !std::fs::read_dir(dir.join("checkpoints")).is_ok_and(|mut e| e.next().is_some())
        && !dir.join(weights_file).exists()
}

/// Checks that a new run may write into `dir`: it does not exist, is empty
/// (but for the lock file), or holds only an unstarted run of ours.
/// Anything else is refused, naming what is there: the run would overwrite
/// files of the same names, and nothing of the user's is ever replaced.
pub fn check_new_run(dir: &Path, run_id_file: &str, weights_file: &str) -> Result<()> {
    if dir.exists() && !dir.is_dir() {
        bail!("--out {} is a file, not a folder; choose a folder for the run", dir.display());
    }
    let names = entries(dir)?;
    if names.is_empty() || unstarted_run(dir, run_id_file, weights_file) {
        return Ok(());
    }
    let shown: Vec<&str> = names.iter().take(5).map(String::as_str).collect();
    let more =
        if names.len() > shown.len() { format!(" and {} more", names.len() - shown.len()) } else { String::new() };
    if [run_id_file, "metrics.jsonl", weights_file, "checkpoints"].iter().any(|f| dir.join(f).exists()) {
        bail!(
            "{} already holds a run ({}{more}); choose another --out directory so nothing saved is overwritten (or continue it with --resume {})",
            dir.display(),
            shown.join(", "),
            dir.display()
        );
    }
    bail!(
        "--out {} is not empty: it holds {}{more}. A new run writes its files (config, tokenizer, metrics, plots, checkpoints, model) into a folder of its own and never overwrites what is there; choose a new or empty --out folder",
        dir.display(),
        shown.join(", ")
    )
}

/// Removes every entry of `dir` but the lock file: what a run that failed
/// before its first step wrote into a folder that was empty (or held only
/// such leftovers) when it started.
pub fn clear_unstarted(dir: &Path) {
    for name in entries(dir).unwrap_or_default() {
        let p = dir.join(&name);
        let _ = if p.is_dir() && !p.is_symlink() { std::fs::remove_dir_all(&p) } else { std::fs::remove_file(&p) };
    }
}

/// `a` and `b` name the same folder (`./s11`, `s11/` and an absolute path
/// all do), whether or not it exists yet.
pub fn same_folder(a: &Path, b: &Path) -> bool {
    normalise(a) == normalise(b)
}

fn normalise(p: &Path) -> PathBuf {
    if let Ok(c) = p.canonicalize() {
        return c;
    }
    let abs = if p.is_absolute() { p.to_path_buf() } else { std::env::current_dir().unwrap_or_default().join(p) };
    abs.components().filter(|c| !matches!(c, std::path::Component::CurDir)).collect()
}
