//! Where tests find the real SmolLM2-135M-Instruct GGUF file, in one place
//! for every crate: `$MACROBATCH_SMOLLM_GGUF`, else the path
//! `scripts/fetch-smollm.sh` writes to; and transformers' logits of a
//! written model, through `scripts/gguf_logits.py`.

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

/// `scripts/gguf_logits.py` (in the repository's `scripts/`).
fn logits_script() -> PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/gguf_logits.py")
}

/// Logits of `model` (a `.gguf` file, through transformers' GGUF loader, or
/// a Hugging Face folder) on `ids`, as transformers computes them in f32:
/// one row of the vocabulary's logits per position, by
/// `scripts/gguf_logits.py`. `Ok(None)` (with `skipped: …` printed) when
/// python3 cannot import torch, transformers and gguf — an error instead
/// under `MACROBATCH_REQUIRE_PYTHON=1` (CI). `test` names the caller in
/// messages and the scratch files.
pub fn transformers_logits(test: &str, model: &std::path::Path, ids: &[u32]) -> Result<Option<Vec<Vec<f32>>>, String> {
    use std::process::Command;
    let ok = Command::new("python3")
        .args(["-c", "import torch, transformers, gguf"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        if env_nonempty("MACROBATCH_REQUIRE_PYTHON").as_deref() == Some("1") {
            return Err(format!(
                "{test}: MACROBATCH_REQUIRE_PYTHON=1 but python3 cannot import torch, transformers and gguf"
            ));
        }
        println!("{test} skipped: python3 cannot import torch, transformers and gguf");
        return Ok(None);
    }
    let dir = std::env::temp_dir().join(format!("macrobatch-logits-{test}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let (ids_path, out_path) = (dir.join("ids.json"), dir.join("logits.json"));
    let ids_json = serde_json::to_string(ids).map_err(|e| e.to_string())?;
    std::fs::write(&ids_path, ids_json).map_err(|e| format!("{}: {e}", ids_path.display()))?;
    let out = Command::new("python3")
        .arg(logits_script())
        .arg(model)
        .arg(&ids_path)
        .arg(&out_path)
        .output()
        .map_err(|e| format!("cannot run python3: {e}"))?;
    if !out.status.success() {
        return Err(format!("{test}: gguf_logits.py failed:\n{}", String::from_utf8_lossy(&out.stderr)));
    }
    let text = std::fs::read_to_string(&out_path).map_err(|e| format!("{}: {e}", out_path.display()))?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| e.to_string())?;
    let rows = v["logits"]
        .as_array()
        .ok_or("gguf_logits.py wrote no logits")?
        .iter()
        .map(|row| row.as_array().into_iter().flatten().filter_map(|x| x.as_f64()).map(|x| x as f32).collect())
        .collect();
    let _ = std::fs::remove_dir_all(&dir);
    Ok(Some(rows))
}

/// (largest |ours − theirs|, largest |ours|) over every position's logits:
/// `ours(t)` gives position `t`'s row, `theirs` all of them.
///
/// # Panics
/// When a row of `ours` is not as long as `theirs`' (a vocabulary mismatch).
pub fn logits_gap(theirs: &[Vec<f32>], mut ours: impl FnMut(usize) -> Vec<f32>) -> (f32, f32) {
    let (mut worst, mut largest) = (0.0f32, 0.0f32);
    for (t, row) in theirs.iter().enumerate() {
        let mine = ours(t);
        assert_eq!(mine.len(), row.len(), "position {t}: {} logits, the reference has {}", mine.len(), row.len());
        for (a, b) in mine.iter().zip(row) {
            worst = worst.max((a - b).abs());
            largest = largest.max(a.abs());
        }
    }
    (worst, largest)
}

/// `n` parameters drawn uniformly from [−0.2, 0.2) by a xorshift stream
/// from `seed` — every tensor (norms and biases too) away from its usual
/// initial value, for tests that write a model and read it back elsewhere.
pub fn uniform_params(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.4
        })
        .collect()
}
