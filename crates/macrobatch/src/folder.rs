//! Run folders: one process at a time (an advisory lock the kernel releases
//! when the holder dies), and a new run never writes into a folder that holds
//! anything but the leftovers of a run of ours that never finished a step.

use anyhow::{bail, Context, Result};
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

/// The file holding a run folder's identity.
pub const RUN_ID_FILE: &str = "run_id";

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

/// Who holds `dir`'s lock ("process PID (what)"), when another process
/// does: probed by taking the lock and at once releasing it, so never call
/// it while this process holds the lock itself.
fn lock_holder(dir: &Path) -> Option<String> {
    let path = dir.join(LOCK_FILE);
    let file = File::open(&path).ok()?;
    if !matches!(file.try_lock(), Err(std::fs::TryLockError::WouldBlock)) {
        return None;
    }
    let holder = std::fs::read_to_string(&path).unwrap_or_default();
    let holder = holder.trim();
    Some(if holder.is_empty() { "another process".to_string() } else { format!("process {holder}") })
}

/// [`check_new_run`] before this process locks `dir`: a folder another
/// process holds the lock of is refused as in use by that process (its
/// files, half-written ones included, are not the user's).
pub fn check_new_run_unlocked(dir: &Path, weights_file: &str) -> Result<()> {
    let Err(e) = check_new_run(dir, weights_file) else { return Ok(()) };
    let Some(who) = lock_holder(dir) else { return Err(e) };
    let doing = if started(dir) { "in use by" } else { "being set up by" };
    bail!(
        "--out {} is {doing} {who}, which holds its lock; one process at a time may write a run folder: wait for it to finish (or stop it), or choose another --out folder",
        dir.display()
    )
}

/// Takes the folder's lock, then runs `check` under it (what another
/// process may have changed since an earlier look). A refused folder keeps
/// no lock file it did not have before.
pub fn lock_then(dir: &Path, what: &str, check: impl FnOnce() -> Result<()>) -> Result<FolderLock> {
    let had_lock_file = dir.join(LOCK_FILE).exists();
    let lock = lock(dir, what)?;
    if let Err(e) = check() {
        if !had_lock_file {
            let _ = std::fs::remove_file(dir.join(LOCK_FILE));
        }
        return Err(e);
    }
    Ok(lock)
}

/// Whether this process is rank 0 — the one that writes the run folder —
/// of an MPI job (or runs alone). A launcher that announced a world size
/// but no rank is an error: every process would take itself for rank 0.
pub fn writes_run_folder() -> Result<bool> {
    match (comm::launcher::launcher_world_size(), comm::launcher::launcher_rank()) {
        // Without MPI support `dist::detect` refuses the launcher first.
        (Some(_), None) if !cfg!(feature = "mpi") => Ok(true),
        (Some((n, var)), None) => bail!(
            "the MPI launcher announced {n} processes ({var}) but no rank (OMPI_COMM_WORLD_RANK, PMI_RANK, PMIX_RANK or MV2_COMM_WORLD_RANK), so which process writes the run folder is unknown; start macrobatch with mpirun / srun"
        ),
        (_, rank) => Ok(rank.unwrap_or(0) == 0),
    }
}

/// The entries of `dir` other than the lock file, sorted; empty when `dir`
/// does not exist.
fn entries(dir: &Path) -> Result<Vec<String>> {
    let rd = match std::fs::read_dir(dir) {
        Ok(rd) => rd,
        // Absent, or below a file: nothing there (creating it reports the latter).
        Err(e) if matches!(e.kind(), std::io::ErrorKind::NotFound | std::io::ErrorKind::NotADirectory) => {
            return Ok(Vec::new())
        }
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

/// What a run writes into its folder before it finishes its first step:
/// its identity, resolved config, tokenizer, an empty metrics file, the
/// memory report, and the (empty) checkpoint and offload folders.
pub const BEFORE_FIRST_STEP: &[&str] = &[
    RUN_ID_FILE,
    "config.resolved.toml",
    "tokenizer.json",
    "tokenizer_config.json",
    "metrics.jsonl",
    "memory.json",
    "checkpoints",
    "offload",
];

/// Whether a run in `dir` recorded a step: a line in `metrics.jsonl` or a
/// checkpoint.
fn started(dir: &Path) -> bool {
    std::fs::metadata(dir.join("metrics.jsonl")).is_ok_and(|m| m.len() > 0)
        || std::fs::read_dir(dir.join("checkpoints")).is_ok_and(|mut e| e.next().is_some())
}

/// Whether `text` is what a run writes into `run_id`: four fields of digits
/// joined by `-` (seconds, nanoseconds, process id, counter) and a newline.
pub fn is_run_id(text: &str) -> bool {
    let id = text.strip_suffix('\n').unwrap_or(text);
    let fields: Vec<&str> = id.split('-').collect();
    fields.len() == 4 && fields.iter().all(|f| !f.is_empty() && f.len() <= 20 && f.bytes().all(|b| b.is_ascii_digit()))
}

/// Whether `dir/run_id` is a file holding a run id of ours ([`is_run_id`]).
fn has_our_run_id(dir: &Path) -> bool {
    let p = dir.join(RUN_ID_FILE);
    p.is_file() && !p.is_symlink() && std::fs::read_to_string(&p).is_ok_and(|t| is_run_id(&t))
}

/// True when `dir` holds a run of ours (a `run_id` of our format) that
/// never recorded a step, and nothing but what such a run writes
/// ([`BEFORE_FIRST_STEP`]): all of it ours to replace.
pub fn unstarted_run(dir: &Path) -> bool {
    has_our_run_id(dir)
        && !started(dir)
        && entries(dir).is_ok_and(|names| names.iter().all(|n| BEFORE_FIRST_STEP.contains(&n.as_str())))
}

/// Checks that a new run may write into `dir`: it does not exist, is empty
/// (but for the lock file), or holds only an unstarted run of ours.
/// Anything else is refused, naming what is there: the run would overwrite
/// files of the same names, and nothing of the user's is ever replaced.
pub fn check_new_run(dir: &Path, weights_file: &str) -> Result<()> {
    if dir.exists() && !dir.is_dir() {
        bail!("--out {} is a file, not a folder; choose a folder for the run", dir.display());
    }
    let names = entries(dir)?;
    if names.is_empty() || unstarted_run(dir) {
        return Ok(());
    }
    let shown: Vec<&str> = names.iter().take(5).map(String::as_str).collect();
    let more =
        if names.len() > shown.len() { format!(" and {} more", names.len() - shown.len()) } else { String::new() };
    let run_id = dir.join(RUN_ID_FILE);
    if (run_id.exists() || run_id.is_symlink()) && !has_our_run_id(dir) {
        bail!(
            "--out {} holds a file named {RUN_ID_FILE} that macrobatch did not write (it holds no run id of ours), beside {}{more}: the folder is not a run of ours, and nothing in it is replaced; choose another --out folder (or remove {} yourself if nothing in it is needed)",
            dir.display(),
            shown.join(", "),
            dir.display()
        );
    }
    if [RUN_ID_FILE, "metrics.jsonl", weights_file, "checkpoints"].iter().any(|f| dir.join(f).exists()) {
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

/// Removes what a run writes before its first step ([`BEFORE_FIRST_STEP`])
/// from `dir`, and nothing else: the leftovers of a run that failed or was
/// replaced before its first step. If that leaves only the lock file, it is
/// removed too, and with `remove_dir` the folder (one the run created).
pub fn clear_unstarted(dir: &Path, remove_dir: bool) {
    for name in BEFORE_FIRST_STEP {
        let p = dir.join(name);
        let _ = if *name == "offload" && p.is_dir() && !p.is_symlink() {
            // Each rank's optimizer-state files of this run.
            std::fs::remove_dir_all(&p)
        } else if p.is_dir() && !p.is_symlink() {
            // checkpoints/: only if empty (an unstarted run wrote none).
            std::fs::remove_dir(&p)
        } else {
            std::fs::remove_file(&p)
        };
    }
    // Nothing of the run left: its lock file goes too (unlinking a held
    // lock file is safe: a newcomer locks a new file), then the folder it made.
    if entries(dir).is_ok_and(|n| n.is_empty()) {
        let _ = std::fs::remove_file(dir.join(LOCK_FILE));
        if remove_dir {
            let _ = std::fs::remove_dir(dir);
        }
    }
}

/// After a run that failed: if it never recorded a step, removes what it
/// wrote ([`clear_unstarted`]), so the corrected rerun is not refused.
pub fn remove_unstarted(dir: &Path, created_dir: bool) {
    if !started(dir) {
        clear_unstarted(dir, created_dir);
    }
}

/// `a` and `b` name the same file or folder (`./s11`, `s11/` and an
/// absolute path all do, and so do links to it), whether or not it exists yet.
pub fn same_path(a: &Path, b: &Path) -> bool {
    resolved(a) == resolved(b)
}

/// `p` absolute, with links and `..` resolved as far as it exists (the rest
/// appended as written, `.` and `..` applied), so two spellings of one path
/// compare equal and a folder is a prefix of what is inside it.
pub fn resolved(p: &Path) -> PathBuf {
    let abs = if p.is_absolute() { p.to_path_buf() } else { std::env::current_dir().unwrap_or_default().join(p) };
    let mut head = abs.as_path();
    let mut tail = Vec::new();
    loop {
        if let Ok(mut r) = head.canonicalize() {
            for part in tail.iter().rev() {
                match part {
                    std::path::Component::ParentDir => {
                        r.pop();
                    }
                    std::path::Component::CurDir => {}
                    other => r.push(other),
                }
            }
            return r;
        }
        match (head.parent(), head.components().next_back()) {
            (Some(parent), Some(last)) => {
                tail.push(last);
                head = parent;
            }
            _ => return abs,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::is_run_id;

    #[test]
    fn only_our_run_ids_are_ours() {
        for ok in ["1764750000-000000123-4567-0\n", "1-2-3-0\n", "1-2-3-0"] {
            assert!(is_run_id(ok), "{ok:?}");
        }
        for bad in
            ["", "\n", "experiment 7\n", "1-2-3\n", "1-2-3-0-5\n", "1-2--0\n", "1-2-3-0\n\n", " 1-2-3-0\n", "a-2-3-0\n"]
        {
            assert!(!is_run_id(bad), "{bad:?}");
        }
    }
}
