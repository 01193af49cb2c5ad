//! Checkpoints that lose nothing: `DIR/checkpoints/step-XXXXXXXX/` holds the
//! model (Hugging Face format; a LoRA run's on a base file: the adapters in
//! PEFT's format and the base by reference, `family::base_ref`), the optimizer state, the trainer state (step,
//! data position, seed) and the resolved config, plus a manifest of SHA-256
//! checksums. A checkpoint is written into a temporary directory, fsynced and
//! renamed into place, so a crash mid-write never leaves a directory that
//! looks valid; a checkpoint whose files do not match its manifest is
//! skipped in favour of the previous one (and moved aside as
//! `corrupt-step-N`, so pruning never counts it). Leftovers of writes that
//! were killed (`.tmp-step-*`, `.old-step-*`, `.NAME.tmp-PID`) are removed
//! — or, for a step folder moved aside while being replaced, restored — by
//! [`clean_leftovers`] when a run starts and after a failed write.

use crate::digest::sha256_file;
use crate::family::base_ref::{self, BaseRef};
use crate::family::{self, Family};
use anyhow::{bail, Context, Result};
use engine::ParamLayout;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

mod final_model;
pub mod sharded;

pub use final_model::{model_dir, write_final_pointer, FINAL_POINTER};

const MANIFEST: &str = "manifest.json";
const OPTIMIZER: &str = "optimizer.safetensors";
const STATE: &str = "trainer_state.json";
/// The moving average of the trainable tensors (`train.ema_decay`), by name.
const EMA: &str = "ema.safetensors";

/// A tensor to write: its name, shape and values.
pub type NamedTensor<'a> = (String, Vec<usize>, &'a [f32]);
/// The run's resolved config, saved beside the weights.
pub const CONFIG: &str = "config.resolved.toml";

/// Everything besides tensors needed to continue exactly.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct TrainerState {
    /// Optimizer steps taken, skipped ones included (= the data position).
    pub step: u64,
    /// Optimizer updates applied (AdamW's t).
    pub n_updates: u64,
    /// Epoch of the next step.
    pub epoch: u64,
    /// Step within that epoch.
    pub step_in_epoch: usize,
    /// Seed of initialisation and sample order.
    pub seed: u64,
    /// Global batch the data position is counted in.
    pub global_batch: usize,
    /// Ranks that wrote it.
    pub world_size: usize,
    /// Optimizer (`adamw` / `sgd`).
    pub optimizer: config::OptimizerKind,
    /// Optimizer steps applied (the LR schedule's position): fewer than
    /// `step` when f16 overflows skipped steps.
    #[serde(default)]
    pub schedule_step: Option<u64>,
    /// The f16 loss scaler.
    #[serde(default)]
    pub loss_scaler: Option<ScalerState>,
    /// Identity of the run that wrote it (also in `DIR/run_id`): resume
    /// refuses a checkpoint of another run.
    #[serde(default)]
    pub run_id: Option<String>,
    /// Samples each of `data.sources` had given before `step` (the
    /// mixture's position); a resume checks the config draws the same.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mixture_drawn: Option<Vec<u64>>,
    /// What early stopping and keep-best know of the validation losses so
    /// far (absent when neither is on).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub val_watch: Option<ValWatchState>,
}

/// The validation-loss history early stopping and keep-best continue from.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Default)]
pub struct ValWatchState {
    /// The lowest validation loss so far and its step.
    pub best: Option<(u64, f64)>,
    /// Early stopping's reference: the loss of the last evaluation that
    /// improved on the one before it by more than `min_delta`.
    pub reference: Option<f64>,
    /// Evaluations since that improvement.
    pub evals_without_improvement: u32,
}

/// The loss scaler's state.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ScalerState {
    /// Current scale.
    pub scale: f32,
    /// Good steps since the last change.
    pub good_steps: u64,
    /// Overflows left before the next halving.
    pub hysteresis_left: u32,
    /// Steps skipped so far.
    pub n_skipped: u64,
}

#[derive(Debug, Serialize, Deserialize)]
struct Manifest {
    step: u64,
    files: BTreeMap<String, FileEntry>,
    /// A sharded checkpoint's pieces (their data files are not in `files`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    sharded: Option<sharded::Index>,
}

#[derive(Debug, Serialize, Deserialize)]
struct FileEntry {
    bytes: u64,
    sha256: String,
}

fn fsync_dir(dir: &Path) {
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all(); // best effort: not every filesystem syncs directories
    }
}

/// Directory name of the checkpoint of `step`.
pub fn step_dir_name(step: u64) -> String {
    format!("step-{step:08}")
}

/// Writes a checkpoint under `run_dir`: full parameters and optimizer state
/// (assembled from every rank's shard under ZeRO), the trainer state, the
/// config and, when given, the moving average of the trainable tensors.
/// With `base` (a LoRA run's frozen base by reference), the parameters
/// written are the adapters alone, beside `base.json`.
#[allow(clippy::too_many_arguments)]
pub fn save(
    run_dir: &Path,
    (family, base): (&dyn Family, Option<&BaseRef>),
    layout: &ParamLayout,
    params: &[f32],
    optimizer_state: &[(String, Vec<f32>)],
    state: &TrainerState,
    config_toml: &str,
    ema: Option<&[NamedTensor<'_>]>,
) -> Result<PathBuf> {
    check_finite(layout, params, "checkpoint parameters")?;
    for (name, v) in optimizer_state {
        if let Some(i) = v.iter().position(|x| !x.is_finite()) {
            bail!("optimizer state `{name}` holds a non-finite value ({}) at index {i}; not saving a checkpoint that cannot be resumed (the previous checkpoints stay)", v[i]);
        }
    }
    let root = run_dir.join("checkpoints");
    std::fs::create_dir_all(&root).with_context(|| format!("cannot create {}", root.display()))?;
    let name = step_dir_name(state.step);
    let tmp = root.join(format!(".tmp-{name}-{}", std::process::id()));
    let (root, tmp, name) = (root.as_path(), tmp.as_path(), name.as_str());
    let r = (|| -> Result<PathBuf> {
        if tmp.exists() {
            std::fs::remove_dir_all(tmp).with_context(|| format!("cannot clear {}", tmp.display()))?;
        }
        std::fs::create_dir_all(tmp).with_context(|| format!("cannot create {}", tmp.display()))?;

        match base {
            Some(base) => base_ref::save(tmp, family, (layout, params), base)?,
            None => family.save_hf(tmp, layout, params)?,
        }
        let tensors: Vec<(String, Vec<usize>, &[f32])> =
            optimizer_state.iter().map(|(k, v)| (k.clone(), vec![v.len()], v.as_slice())).collect();
        nn::io::write_safetensors(&tmp.join(OPTIMIZER), &tensors, &[("n_updates", state.n_updates.to_string())])?;
        nn::io::write_atomic(&tmp.join(STATE), serde_json::to_string_pretty(state)?.as_bytes())?;
        nn::io::write_atomic(&tmp.join(CONFIG), config_toml.as_bytes())?;
        if let Some(ema) = ema {
            nn::io::write_safetensors(&tmp.join(EMA), ema, &[])?;
        }
        publish(root, tmp, name, state.step, None)
    })();
    if r.is_err() {
        discard(run_dir, tmp);
    }
    r
}

/// The folder every rank writes its pieces of step `step`'s sharded
/// checkpoint into (one name for all: rank 0 makes it empty first).
pub fn sharded_tmp(run_dir: &Path, step: u64) -> PathBuf {
    run_dir.join("checkpoints").join(format!(".tmp-{}-sharded", step_dir_name(step)))
}

/// Rank 0, once every rank wrote its pieces into `tmp` ([`sharded_tmp`]):
/// the trainer state, the config, the model's `config.json` and, when
/// given, the moving average beside them, then the manifest (with the
/// pieces of `ranks` ranks of `layout`'s tensors and `slots`), published
/// as the checkpoint of `state.step`. On failure nothing is published and
/// the pieces are removed.
pub fn commit_sharded(
    run_dir: &Path,
    tmp: &Path,
    family: &dyn Family,
    (layout, slots, ranks): (&ParamLayout, &[&str], usize),
    state: &TrainerState,
    config_toml: &str,
    ema: Option<&[NamedTensor<'_>]>,
) -> Result<PathBuf> {
    let r = (|| -> Result<PathBuf> {
        let index = sharded::merge(tmp, ranks, layout, slots)?;
        let hf = serde_json::to_string_pretty(&family.hf_config())?;
        nn::io::write_atomic(&tmp.join(family::CONFIG_FILE), hf.as_bytes())?;
        nn::io::write_atomic(&tmp.join(STATE), serde_json::to_string_pretty(state)?.as_bytes())?;
        nn::io::write_atomic(&tmp.join(CONFIG), config_toml.as_bytes())?;
        if let Some(ema) = ema {
            nn::io::write_safetensors(&tmp.join(EMA), ema, &[])?;
        }
        publish(&run_dir.join("checkpoints"), tmp, &step_dir_name(state.step), state.step, Some(index))
    })();
    if r.is_err() {
        discard(run_dir, tmp);
    }
    r
}

/// After a failed write (full disk, I/O error): nothing is left behind,
/// and what was published before stays as it was. Only `checkpoints/`:
/// the run folder's own files may be mid-write on another thread.
pub fn discard(run_dir: &Path, tmp: &Path) {
    let _ = std::fs::remove_dir_all(tmp);
    if let Ok(removed) = clean(run_dir, false) {
        for line in removed {
            eprintln!("{line}");
        }
    }
}

/// Writes the manifest of the checkpoint in `tmp` — last: it vouches for
/// every file written before it (a sharded checkpoint's data files by
/// length, their pieces by checksum) — and publishes `tmp` as `root/name`.
fn publish(root: &Path, tmp: &Path, name: &str, step: u64, sharded: Option<sharded::Index>) -> Result<PathBuf> {
    {
        let mut files = BTreeMap::new();
        for e in std::fs::read_dir(tmp).with_context(|| format!("cannot list {}", tmp.display()))? {
            let f = e.with_context(|| format!("cannot list {}", tmp.display()))?.file_name();
            let f = f.to_string_lossy();
            if sharded.as_ref().is_some_and(|i| i.data_files.contains_key(&*f)) {
                continue;
            }
            let (bytes, sha256) = sha256_file(&tmp.join(&*f))?;
            files.insert(f.into_owned(), FileEntry { bytes, sha256 });
        }
        nn::io::write_atomic(
            &tmp.join(MANIFEST),
            serde_json::to_string_pretty(&Manifest { step, files, sharded })?.as_bytes(),
        )?;
        fsync_dir(tmp);

        let dst = root.join(name);
        if dst.exists() {
            // A run resumed from an earlier checkpoint reaches this step again.
            // Between the two renames the step exists only as `.old-…`:
            // clean_leftovers restores it after a crash there.
            let old = root.join(format!(".old-{name}-{}", std::process::id()));
            std::fs::rename(&dst, &old).with_context(|| format!("cannot move aside {}", dst.display()))?;
            fsync_dir(root);
            if let Err(e) = std::fs::rename(tmp, &dst) {
                let _ = std::fs::rename(&old, &dst);
                return Err(e).with_context(|| format!("cannot publish {}", dst.display()));
            }
            fsync_dir(root);
            let _ = std::fs::remove_dir_all(&old);
        } else {
            std::fs::rename(tmp, &dst).with_context(|| format!("cannot publish {}", dst.display()))?;
        }
        fsync_dir(root);
        Ok(dst)
    }
}

/// Whether `dir` is a sharded checkpoint (its manifest lists pieces).
pub fn is_sharded(dir: &Path) -> bool {
    std::fs::read_to_string(dir.join(MANIFEST))
        .ok()
        .and_then(|t| serde_json::from_str::<Manifest>(&t).ok())
        .is_some_and(|m| m.sharded.is_some())
}

/// The whole parameters of the sharded checkpoint `dir` (for `export`,
/// `eval`, `generate`), read piece by piece into their places; `None` for
/// any other folder.
pub fn sharded_params(dir: &Path) -> Result<Option<family::Loaded>> {
    if !is_sharded(dir) {
        return Ok(None);
    }
    let index = validate(dir)?.sharded.context("manifest.json lost its pieces")?;
    let reader = sharded::Reader::new(dir, index)?;
    let model = family::read_hf_config(dir)?;
    let layout = model.build(family::Build::default())?.layout().clone();
    reader.check_layout(&layout)?;
    let mut params = engine::alloc::try_zeros(layout.n_params(), "the model's parameters")?;
    let wants: Vec<engine::Run> = (layout.tensors().iter().enumerate())
        .map(|(tensor, t)| engine::Run { tensor, start: 0, len: t.numel(), stride: t.numel(), count: 1, at: t.offset })
        .collect();
    reader.read(sharded::PARAMS, &wants, |w, _, col, vals| {
        params[w.at + col..w.at + col + vals.len()].copy_from_slice(vals);
    })?;
    family::check_finite(&layout, &params, dir)?;
    Ok(Some((model, params)))
}

/// Errors naming the first tensor of `layout` with a non-finite value.
pub fn check_finite(layout: &engine::ParamLayout, params: &[f32], what: &str) -> Result<()> {
    let Some(n) = layout.first_non_finite(params) else { return Ok(()) };
    bail!(
        "{what}: tensor `{}` holds a non-finite value ({}) at element {:?} ({} non-finite values in all); the training diverged, so nothing is saved and the previous checkpoints stay (lower optim.lr, raise optim.eps, or enable train.grad_clip)",
        n.tensor,
        n.value,
        n.index,
        n.count
    )
}

/// Removes what killed or failed writes left in `run_dir` and its
/// `checkpoints/` folder — from any process: `.tmp-step-*` folders,
/// `.NAME.tmp-PID` files, and `.old-step-*` folders whose step was published
/// again; an `.old-step-N-*` folder without a `step-N` (a crash between the
/// two renames of a replacement) is restored. Returns one line per action.
pub fn clean_leftovers(run_dir: &Path) -> Result<Vec<String>> {
    clean(run_dir, true)
}

/// [`clean_leftovers`] in `checkpoints/`, and in the run folder itself
/// when `run_folder`.
fn clean(run_dir: &Path, run_folder: bool) -> Result<Vec<String>> {
    let mut done = Vec::new();
    let root = run_dir.join("checkpoints");
    let dirs = if run_folder { vec![run_dir, root.as_path()] } else { vec![root.as_path()] };
    for dir in dirs {
        let Ok(entries) = std::fs::read_dir(dir) else { continue };
        let mut names: Vec<String> =
            entries.filter_map(|e| e.ok()).map(|e| e.file_name().to_string_lossy().into_owned()).collect();
        names.sort();
        for name in names {
            let path = dir.join(&name);
            if nn::io::is_temp_file(&name) {
                std::fs::remove_file(&path).with_context(|| format!("cannot remove {}", path.display()))?;
                done.push(format!("removed leftover temporary file {}", path.display()));
            } else if dir == root && name.starts_with(".tmp-step-") {
                std::fs::remove_dir_all(&path).with_context(|| format!("cannot remove {}", path.display()))?;
                done.push(format!("removed unfinished checkpoint {}", path.display()));
            } else if dir == root && name.starts_with(".old-step-") {
                // `.old-step-XXXXXXXX-PID`
                let step_name = name.trim_start_matches(".old-").rsplit_once('-').map(|(s, _)| s.to_string());
                match step_name.map(|s| root.join(s)) {
                    Some(published) if !published.exists() => {
                        std::fs::rename(&path, &published)
                            .with_context(|| format!("cannot restore {}", path.display()))?;
                        done.push(format!(
                            "restored {} from {} (a replacement was interrupted)",
                            published.display(),
                            path.display()
                        ));
                    }
                    _ => {
                        std::fs::remove_dir_all(&path).with_context(|| format!("cannot remove {}", path.display()))?;
                        done.push(format!("removed replaced checkpoint {}", path.display()));
                    }
                }
            }
        }
    }
    if !done.is_empty() {
        fsync_dir(&root);
        fsync_dir(run_dir);
    }
    Ok(done)
}

/// Deletes all but the newest `keep` checkpoints (0 keeps all), and never
/// that of step `spare` (the best one, which keep-best keeps besides them).
pub fn prune(run_dir: &Path, keep: usize, spare: Option<u64>) -> Result<()> {
    if keep == 0 {
        return Ok(());
    }
    let mut steps = list(run_dir)?;
    steps.retain(|(step, _)| Some(*step) != spare);
    while steps.len() > keep {
        let (_, dir) = steps.remove(0);
        std::fs::remove_dir_all(&dir).with_context(|| format!("cannot remove old checkpoint {}", dir.display()))?;
    }
    Ok(())
}

/// Points `checkpoints/best` (a symbolic link, replaced atomically) at the
/// checkpoint of `step`, and returns the link.
pub fn mark_best(run_dir: &Path, step: u64) -> Result<PathBuf> {
    let root = run_dir.join("checkpoints");
    let link = root.join(BEST);
    // Named as `write_atomic`'s temporary files, so `clean_leftovers`
    // removes one a crash left.
    let tmp = root.join(format!(".{BEST}.tmp-{}", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    std::os::unix::fs::symlink(step_dir_name(step), &tmp)
        .with_context(|| format!("cannot create the link {}", tmp.display()))?;
    std::fs::rename(&tmp, &link).with_context(|| format!("cannot publish {}", link.display()))?;
    fsync_dir(&root);
    Ok(link)
}

/// The link to the best checkpoint (`train.keep_best`), in `checkpoints/`.
pub const BEST: &str = "best";

/// Published checkpoints, oldest first.
pub fn list(run_dir: &Path) -> Result<Vec<(u64, PathBuf)>> {
    let root = run_dir.join("checkpoints");
    let Ok(entries) = std::fs::read_dir(&root) else { return Ok(Vec::new()) };
    let mut out = Vec::new();
    for e in entries {
        let e = e.with_context(|| format!("cannot list {}", root.display()))?;
        let name = e.file_name().to_string_lossy().into_owned();
        if let Some(step) = name.strip_prefix("step-").and_then(|s| s.parse::<u64>().ok()) {
            out.push((step, e.path()));
        }
    }
    out.sort();
    Ok(out)
}

/// Checks every file of a checkpoint against its manifest (a sharded
/// one's data files by length), and returns the manifest.
fn validate(dir: &Path) -> Result<Manifest> {
    let text =
        std::fs::read_to_string(dir.join(MANIFEST)).context("no readable manifest.json (incomplete checkpoint)")?;
    let manifest: Manifest = serde_json::from_str(&text).context("manifest.json is corrupt")?;
    for (name, want) in &manifest.files {
        let (bytes, sha) = sha256_file(&dir.join(name))?;
        if bytes != want.bytes || sha != want.sha256 {
            bail!(
                "{name} does not match its checksum ({bytes} bytes, expected {}): the file is truncated or corrupt",
                want.bytes
            );
        }
    }
    if let Some(index) = &manifest.sharded {
        sharded::validate(dir, index)?;
    }
    Ok(manifest)
}

/// A checkpoint read back.
pub struct Loaded {
    /// Its directory.
    pub dir: PathBuf,
    /// Trainer state.
    pub state: TrainerState,
    /// The resolved config it was written with.
    pub config_toml: String,
    /// Model family and shape.
    pub model: std::sync::Arc<dyn Family>,
    /// Parameters (empty while `base` is to be read).
    pub params: Vec<f32>,
    /// The frozen base by reference, for a checkpoint that holds only the
    /// adapters: the run's base with them are its parameters.
    pub base: Option<BaseRef>,
    /// Optimizer buffers by name.
    pub optimizer: std::collections::HashMap<String, Vec<f32>>,
    /// The moving average of the trainable tensors by name, when saved.
    pub ema: Option<std::collections::HashMap<String, Vec<f32>>>,
    /// A sharded checkpoint's pieces (`params` and `optimizer` are then
    /// empty: each rank reads what it keeps).
    pub sharded: Option<std::sync::Arc<sharded::Reader>>,
}

fn load(dir: &Path) -> Result<Loaded> {
    let manifest = validate(dir)?;
    let state: TrainerState =
        serde_json::from_str(&std::fs::read_to_string(dir.join(STATE))?).context("trainer_state.json")?;
    let config_toml = std::fs::read_to_string(dir.join(CONFIG))?;
    let ema = read_ema(dir)?;
    if let Some(index) = manifest.sharded {
        let reader = std::sync::Arc::new(sharded::Reader::new(dir, index)?);
        let model = family::read_hf_config(dir)?;
        let (params, optimizer, base) = (Vec::new(), Default::default(), None);
        let sharded = Some(reader);
        return Ok(Loaded { dir: dir.to_path_buf(), state, config_toml, model, params, base, optimizer, ema, sharded });
    }
    // Adapters alone: the run reads its base itself, as its start did
    // (packed, where the run packs it), never dequantised here.
    let base = BaseRef::read(dir)?;
    let (model, params) = match base {
        Some(_) => (family::read_hf_config(dir)?, Vec::new()),
        None => family::load_hf(dir)?,
    };
    let (tensors, meta) = nn::io::read_safetensors(&dir.join(OPTIMIZER))?;
    if meta.get("n_updates").and_then(|n| n.parse::<u64>().ok()) != Some(state.n_updates) {
        bail!("{OPTIMIZER} and {STATE} disagree on the number of updates");
    }
    let optimizer = tensors.into_iter().map(|(k, (_, v))| (k, v)).collect();
    Ok(Loaded { dir: dir.to_path_buf(), state, config_toml, model, params, base, optimizer, ema, sharded: None })
}

/// The moving average of the weights in checkpoint `dir`, if saved.
fn read_ema(dir: &Path) -> Result<Option<std::collections::HashMap<String, Vec<f32>>>> {
    let ema_path = dir.join(EMA);
    Ok(match ema_path.exists() {
        true => Some(nn::io::read_safetensors(&ema_path)?.0.into_iter().map(|(k, (_, v))| (k, v)).collect()),
        false => None,
    })
}

/// The newest checkpoint that validates; each one skipped is reported with
/// `warn`. Errors if there is none.
pub fn latest_valid(run_dir: &Path, warn: impl Fn(&str)) -> Result<Loaded> {
    let all = list(run_dir)?;
    if all.is_empty() {
        bail!(
            "no checkpoint to resume from in {} (expected {}/checkpoints/step-*/; enable train.checkpoint_every or stop a run with Ctrl-C)",
            run_dir.display(),
            run_dir.display()
        );
    }
    for (step, dir) in all.iter().rev() {
        match load(dir) {
            Ok(l) => return Ok(l),
            // Not a damaged checkpoint: this process could not map or
            // allocate what a whole one needs. It stays where it is.
            Err(e) if out_of_memory(&e) => {
                return Err(e.context(format!(
                    "cannot allocate the memory to read checkpoint {}; it is kept as it is: free memory (or raise ulimit -v) and resume again",
                    dir.display()
                )))
            }
            Err(e) => {
                warn(&format!(
                    "warning: skipping checkpoint {}: {e:#}; falling back to the previous one",
                    dir.display()
                ));
                // Out of the `step-*` namespace: pruning must never keep it in
                // place of a good checkpoint, nor a later resume try it again.
                let aside = (0..)
                    .map(|i| {
                        let suffix = if i == 0 { String::new() } else { format!("-{i}") };
                        run_dir.join("checkpoints").join(format!("corrupt-{}{suffix}", step_dir_name(*step)))
                    })
                    .find(|p| !p.exists())
                    .unwrap_or_else(|| dir.clone());
                if std::fs::rename(dir, &aside).is_ok() {
                    warn(&format!("warning: moved the invalid checkpoint aside to {}", aside.display()));
                }
            }
        }
    }
    bail!(
        "none of the {} checkpoints in {}/checkpoints is valid (see the warnings above)",
        all.len(),
        run_dir.display()
    )
}

/// Whether `e` comes from the OS refusing memory (ENOMEM: a map or an
/// allocation over the address-space limit), anywhere in its chain.
fn out_of_memory(e: &anyhow::Error) -> bool {
    e.chain().any(|c| c.downcast_ref::<std::io::Error>().is_some_and(|io| io.kind() == std::io::ErrorKind::OutOfMemory))
}

/// Keeps only the metrics of steps `<= step` (a resumed run re-logs the
/// rest); a torn last line (a write cut short by a crash or a full disk) is
/// dropped with a warning.
pub fn truncate_metrics(path: &Path, step: u64, warn: impl Fn(&str)) -> Result<()> {
    let Ok(bytes) = std::fs::read(path) else { return Ok(()) };
    let text = String::from_utf8_lossy(&bytes);
    let torn = !text.is_empty() && !text.ends_with('\n');
    if let (true, Some(last)) = (torn, text.lines().last()) {
        let shown: String = last.chars().take(80).collect();
        warn(&format!(
            "warning: {} ends in a torn line ({} bytes, `{shown}…`); dropping it",
            path.display(),
            last.len()
        ));
    }
    let complete = if torn { text.rsplit_once('\n').map_or("", |(a, _)| a) } else { &text };
    let kept: String = complete
        .lines()
        .filter(|l| {
            serde_json::from_str::<serde_json::Value>(l)
                .ok()
                .and_then(|v| v["step"].as_u64())
                .is_some_and(|s| s <= step)
        })
        .map(|l| format!("{l}\n"))
        .collect();
    nn::io::write_atomic(path, kept.as_bytes())?;
    Ok(())
}
