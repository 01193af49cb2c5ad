//! Paths the user may not write, as an unprivileged user: run as root (as
//! CI is), the binary runs as `nobody` through util-linux's `setpriv`;
//! otherwise as the user running the tests. Each is a clean error (exit 2)
//! naming the path, before anything is created, and nothing already saved
//! is touched.

mod common;

use common::*;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Output};

const NOBODY: [&str; 4] = ["--reuid=65534", "--regid=65534", "--clear-groups", "--"];

/// A copy of the binary that `nobody` may run (the checkout may lie below a
/// folder only root can enter), made once; `None` with the reason printed
/// where root cannot drop its powers here (no `setpriv`, or no CAP_SETUID).
fn nobodys_binary() -> Option<&'static Path> {
    static BIN: std::sync::OnceLock<Option<std::path::PathBuf>> = std::sync::OnceLock::new();
    BIN.get_or_init(|| {
        let probe = Command::new("setpriv").args(NOBODY).arg("true").output();
        if !probe.as_ref().is_ok_and(|o| o.status.success()) {
            eprintln!("skipped: root cannot run as nobody here (setpriv from util-linux): {probe:?}");
            return None;
        }
        let copy = std::env::temp_dir().join(format!("macrobatch-as-nobody-{}", std::process::id()));
        std::fs::copy(env!("CARGO_BIN_EXE_macrobatch"), &copy).unwrap();
        std::fs::set_permissions(&copy, std::fs::Permissions::from_mode(0o755)).unwrap();
        Some(copy)
    })
    .as_deref()
}

/// `macrobatch ARGS` without root's powers: as `nobody` when the tests run
/// as root, else as the user running them; `None` where root cannot drop
/// its powers.
fn unprivileged(args: &[&std::ffi::OsStr]) -> Option<Output> {
    // SAFETY: geteuid has no preconditions.
    let mut c = if unsafe { libc::geteuid() } == 0 {
        let mut c = Command::new("setpriv");
        c.args(NOBODY).arg(nobodys_binary()?);
        c
    } else {
        bin()
    };
    Some(c.args(args).current_dir(std::env::temp_dir()).output().expect("the binary runs"))
}

fn mode(p: &Path, m: u32) {
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(m)).unwrap();
}

fn os(s: &str) -> &std::ffi::OsStr {
    std::ffi::OsStr::new(s)
}

#[test]
fn unwritable_paths_are_clean_errors_before_anything_is_created() {
    let base = tmp("permissions");
    std::fs::create_dir_all(&base).unwrap();
    mode(&base, 0o755);
    // A finished run the unprivileged user may read but not write.
    let run = base.join("run");
    train_ok(&run, &tiny(&["train.steps=2", "train.checkpoint_every=1"]));
    let before = std::fs::read(run.join("model.safetensors")).unwrap();
    // A folder anyone may write, and one no one but root may.
    let open = base.join("open");
    let locked = base.join("locked");
    for (d, m) in [(&open, 0o777), (&locked, 0o555)] {
        std::fs::create_dir_all(d).unwrap();
        mode(d, m);
    }
    let mut sets: Vec<String> = Vec::new();
    for s in tiny(&["train.steps=1"]) {
        sets.extend(["--set".to_string(), s.to_string()]);
    }
    let sets: Vec<&std::ffi::OsStr> = sets.iter().map(|s| os(s)).collect();

    // train --out below the locked folder.
    let out = locked.join("new-run");
    let Some(o) = unprivileged(&[[os("train"), os("--out"), out.as_os_str()].as_slice(), &sets].concat()) else {
        return;
    };
    let err = fails(&o, "ermission denied");
    assert!(err.contains(&locked.display().to_string()), "names the path: {err}");
    assert!(!out.exists());

    // --tensorboard into the locked folder: refused before the run folder exists.
    let (out, tb) = (open.join("tb-run"), locked.join("tb"));
    let o = unprivileged(
        &[[os("train"), os("--out"), out.as_os_str(), os("--tensorboard"), tb.as_os_str()].as_slice(), &sets].concat(),
    )
    .unwrap();
    let err = fails(&o, "--tensorboard");
    assert!(err.contains("cannot write into"), "{err}");
    assert!(!out.exists() && !tb.exists(), "{err}");

    // Resuming a run folder the user may not write: refused, nothing changed.
    let o = unprivileged(&[os("train"), os("--resume"), run.as_os_str(), os("--set"), os("train.steps=3")]).unwrap();
    let err = fails(&o, "ermission denied");
    assert!(err.contains(&run.display().to_string()), "names the path: {err}");
    assert_eq!(std::fs::read(run.join("model.safetensors")).unwrap(), before);
    assert_eq!(metrics(&run).len(), 2);

    // export into the locked folder.
    let gguf = locked.join("x.gguf");
    let o = unprivileged(&[os("export"), run.as_os_str(), os("--format"), os("gguf"), os("--out"), gguf.as_os_str()])
        .unwrap();
    let err = fails(&o, "ermission denied");
    assert!(err.contains(&locked.display().to_string()), "names the path: {err}");
    assert_eq!(std::fs::read_dir(&locked).unwrap().count(), 0, "nothing written: {err}");

    let _ = std::fs::remove_dir_all(&base);
    if let Some(copy) = nobodys_binary() {
        let _ = std::fs::remove_file(copy);
    }
}
