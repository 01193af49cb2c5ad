//! A family against transformers itself: `scripts/hf_reference.py` builds a
//! small random model of the family in transformers and saves it with
//! `save_pretrained`; the family must load it through its
//! [`Registration`], compute its logits at every position and its greedy
//! tokens, and write it back as a folder transformers loads and computes the
//! same logits from. No downloads: the model is made on the spot.
//!
//! Tolerance: logits agree to 1e-5 of the largest |logit|. Both sides
//! compute in f32 with different summation orders (GEMM blocking, row
//! reductions, exp within 2 ulp): ~1e-7 relative per operation through two
//! layers, measured at ~1e-6; a wrong tensor name, transpose, bias or RoPE
//! frequency moves logits by ~1e-1. Greedy tokens must be equal.

use crate::{Build, Registration, CONFIG_FILE};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The script (in the repository's `scripts/`).
fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/hf_reference.py")
}

/// Whether python3 with torch and transformers is here. Without them the
/// check is skipped with a note — unless `MACROBATCH_REQUIRE_PYTHON=1`
/// (CI), where a check that cannot run is a failure.
pub fn python_available() -> Result<bool, String> {
    python_with("torch, transformers")
}

/// Whether python3 can import `modules` (`import {modules}`), as
/// [`python_available`] says it.
pub fn python_with(modules: &str) -> Result<bool, String> {
    let import = format!("import {modules}");
    let ok = Command::new("python3").args(["-c", &import]).output().is_ok_and(|o| o.status.success());
    if !ok && std::env::var("MACROBATCH_REQUIRE_PYTHON").as_deref() == Ok("1") {
        return Err(format!("MACROBATCH_REQUIRE_PYTHON=1 but python3 cannot {import}"));
    }
    Ok(ok)
}

/// PEFT itself on a base and adapter we wrote: `scripts/peft_check.py`
/// loads `base_dir` with transformers' `AutoModelForCausalLM`, wraps it
/// with `PeftModel.from_pretrained(adapter_dir)` and compares its logits
/// (and loss, when given) with `expected` (the script's docstring has the
/// format and the tolerance). `Ok(Some(stdout))` when they agree, `None`
/// when skipped (no python3 with torch, transformers and peft).
pub fn peft_check(base_dir: &Path, adapter_dir: &Path, expected: &serde_json::Value) -> Result<Option<String>, String> {
    if !python_with("torch, transformers, peft")? {
        eprintln!("skipped: python3 with torch, transformers and peft is not available");
        return Ok(None);
    }
    let path = adapter_dir.with_extension("expected.json");
    std::fs::write(&path, expected.to_string()).map_err(|e| format!("{}: {e}", path.display()))?;
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/peft_check.py");
    let out = Command::new("python3")
        .arg(script)
        .args([base_dir, adapter_dir, &path])
        .output()
        .map_err(|e| format!("cannot run python3: {e}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    if !out.status.success() {
        return Err(format!("peft_check.py failed:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr)));
    }
    Ok(Some(stdout))
}

fn run(args: &[&dyn AsRef<std::ffi::OsStr>]) -> Result<String, String> {
    let mut cmd = Command::new("python3");
    cmd.arg(script());
    for a in args {
        cmd.arg(a);
    }
    let out = cmd.output().map_err(|e| format!("cannot run python3: {e}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    if !out.status.success() {
        return Err(format!("hf_reference.py failed:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr)));
    }
    Ok(stdout)
}

/// What the check measured.
#[derive(Debug)]
pub struct Agreement {
    /// Largest |logit difference| over the largest |logit|.
    pub logits_rel_err: f32,
    /// The greedy tokens (equal to transformers').
    pub greedy: Vec<u32>,
    /// transformers' line on loading the folder the family wrote.
    pub reloaded: String,
}

/// Runs the check for `r` on the reference model `kind` (a KIND of
/// `hf_reference.py`) in `work` (created, and removed on success). `None`:
/// skipped (no python3 with torch and transformers).
pub fn check(r: &dyn Registration, kind: &str, work: &Path) -> Result<Option<Agreement>, String> {
    if !python_available()? {
        eprintln!("skipped: python3 with torch and transformers is not available");
        return Ok(None);
    }
    let _ = std::fs::remove_dir_all(work);
    std::fs::create_dir_all(work).map_err(|e| format!("{}: {e}", work.display()))?;
    run(&[&"make", &kind, &work])?;
    let dir = work.join("model");
    let text = std::fs::read_to_string(work.join("reference.json")).map_err(|e| e.to_string())?;
    let reference: serde_json::Value = serde_json::from_str(&text).map_err(|e| e.to_string())?;
    let ids = |key: &str| -> Vec<u32> {
        let v = &reference[key];
        let v = v.get(0).filter(|_| key == "input_ids").unwrap_or(v);
        v.as_array().into_iter().flatten().filter_map(|x| x.as_u64()).map(|x| x as u32).collect()
    };
    let want: Vec<f32> =
        reference["logits"].as_array().into_iter().flatten().filter_map(|x| x.as_f64()).map(|x| x as f32).collect();
    let (input, prompt, greedy_want) = (ids("input_ids"), ids("prompt"), ids("greedy"));

    let config_text = std::fs::read_to_string(dir.join(CONFIG_FILE)).map_err(|e| e.to_string())?;
    let config: serde_json::Value = serde_json::from_str(&config_text).map_err(|e| e.to_string())?;
    let family = r.for_hf_dir(&dir, &config).map_err(|e| e.to_string())?;
    let mut model = family.build(Build::default()).map_err(|e| e.to_string())?;
    let params = family.load_weights(&dir, model.layout()).map_err(|e| e.to_string())?;

    // Logits at every position: the next-token logits of each prefix.
    let v = family.vocab_size();
    if want.len() != input.len() * v {
        return Err(format!("reference holds {} logits, expected {} × {v}", want.len(), input.len()));
    }
    let (mut worst, scale) = (0.0f32, want.iter().fold(0.0f32, |m, x| m.max(x.abs())));
    for t in 1..=input.len() {
        let got = model.next_token_logits(&params, &input[..t]).map_err(|e| e.to_string())?;
        for (g, w) in got.iter().zip(&want[(t - 1) * v..t * v]) {
            worst = worst.max((g - w).abs() / scale);
        }
    }
    if worst > 1e-5 {
        return Err(format!("logits differ from transformers' by {worst:e} of the largest logit (tolerance 1e-5)"));
    }

    let mut tokens = prompt;
    let mut greedy = Vec::new();
    for _ in 0..greedy_want.len() {
        let logits = model.next_token_logits(&params, &tokens).map_err(|e| e.to_string())?;
        let next = (0..logits.len()).fold(0, |b, i| if logits[i] > logits[b] { i } else { b }) as u32;
        tokens.push(next);
        greedy.push(next);
    }
    if greedy != greedy_want {
        return Err(format!("greedy tokens {greedy:?}, transformers' {greedy_want:?}"));
    }

    // Out again: the folder the family writes loads in transformers.
    let out = work.join("written");
    std::fs::create_dir_all(&out).map_err(|e| e.to_string())?;
    family.save_hf(&out, model.layout(), &params).map_err(|e| e.to_string())?;
    let reloaded = run(&[&"check", &out, &work.join("reference.json")])?.trim().to_string();
    let _ = std::fs::remove_dir_all(work);
    Ok(Some(Agreement { logits_rel_err: worst, greedy, reloaded }))
}

/// [`check`] as a test: in a fresh temporary folder, printing what it
/// measured; panics where the family disagrees with transformers.
pub fn assert_agrees(r: &dyn Registration, kind: &str) {
    let work = std::env::temp_dir().join(format!("macrobatch-{kind}-ref-{}", std::process::id()));
    match check(r, kind, &work) {
        Ok(Some(a)) => {
            println!("{kind}: logits within {:.1e} of scale, greedy {:?}; {}", a.logits_rel_err, a.greedy, a.reloaded)
        }
        Ok(None) => {}
        Err(e) => panic!("{kind}: {e}"),
    }
}
