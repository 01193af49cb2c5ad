//! Where tests find the real SmolLM2-135M-Instruct GGUF file, in one place
//! for every crate: `$MACROBATCH_SMOLLM_GGUF`, else the path
//! `scripts/fetch-smollm.sh` writes to.

use std::path::PathBuf;

/// The file name `scripts/fetch-smollm.sh` stores.
pub const SMOLLM2_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

fn env_nonempty(key: &str) -> Option<String> {
    std::env::var(key).ok().filter(|v| !v.is_empty())
}

/// Where the SmolLM2 GGUF is expected (it may not exist): the same rule as
/// `scripts/fetch-smollm.sh`, `${MACROBATCH_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/macrobatch}/smollm2/`,
/// unless `$MACROBATCH_SMOLLM_GGUF` names the file.
pub fn smollm2_path() -> PathBuf {
    if let Some(p) = env_nonempty("MACROBATCH_SMOLLM_GGUF") {
        return PathBuf::from(p);
    }
    let cache = env_nonempty("MACROBATCH_CACHE").map(PathBuf::from).unwrap_or_else(|| {
        let base = env_nonempty("XDG_CACHE_HOME")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(env_nonempty("HOME").unwrap_or_default()).join(".cache"));
        base.join("macrobatch")
    });
    cache.join("smollm2").join(SMOLLM2_FILE)
}

/// For a test that needs the real file: its path if it exists; otherwise
/// prints `skipped: …` and returns `None`.
///
/// # Panics
/// When the file is absent and `MACROBATCH_REQUIRE_GGUF=1` (CI), so a check
/// that cannot run fails instead of passing silently.
pub fn smollm2_or_skip(test: &str) -> Option<PathBuf> {
    let path = smollm2_path();
    if path.is_file() {
        return Some(path);
    }
    if env_nonempty("MACROBATCH_REQUIRE_GGUF").as_deref() == Some("1") {
        panic!("{test}: {} is missing and MACROBATCH_REQUIRE_GGUF=1; run scripts/fetch-smollm.sh", path.display());
    }
    println!("{test} skipped: run scripts/fetch-smollm.sh ({} is missing)", path.display());
    None
}
