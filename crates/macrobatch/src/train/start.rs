//! Where a run starts from: a new run, `--resume DIR` (its checkpoint,
//! config and run id, refused when it does not match the plan) or
//! `--init-from` a pretrained model; and the handing of those parameters to
//! each rank once.

use super::stop::StopRequests;
use crate::checkpoint::{self, Loaded};
use crate::dist::Fault;
use crate::family::{self, base_ref, base_ref::BaseRef};
use crate::folder::{self, FolderLock, RUN_ID_FILE};
use crate::memory;
use crate::setup::Plan;
use crate::TrainArgs;
use anyhow::{bail, Context, Result};
use config::{Config, ModelConfig};
use data::TokenizerSpec;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Where a run starts from, and when it stops early.
#[derive(Clone)]
pub struct Start {
    /// A checkpoint to continue from.
    pub resume: Option<Arc<Handoff<Loaded>>>,
    /// Pretrained parameters (`--init-from`).
    pub init_params: Option<Arc<Handoff<Vec<f32>>>>,
    /// `--stop-after`, SIGINT / SIGTERM, and whether the ranks stopped early.
    pub stop: StopRequests,
    /// Test fault injection.
    pub fault: Option<Fault>,
    /// This run's identity, written into every checkpoint.
    pub run_id: String,
    /// `--dump-steps`: where the initial trainable tensors and every step's
    /// micro-batches go (one rank).
    pub dump_steps: Option<PathBuf>,
    /// `--merge`: also save the model with its LoRA adapters merged.
    pub merge: bool,
    /// A LoRA run's frozen base file, as the run read it: checkpoints and
    /// the final folder hold the adapters and this reference, not the base.
    pub base: Option<BaseRef>,
    /// `--tensorboard DIR`: where the TensorBoard log goes instead of the
    /// run folder's `tensorboard/`.
    pub tensorboard: Option<PathBuf>,
    /// `dist.offload_optimizer = "disk"`: the run folder's `offload/`
    /// (each rank's files in `rank-R/`, removed at the end of the run).
    /// Set once the run folder is known (rank 0 may pick a fresh name).
    pub offload_root: Arc<std::sync::OnceLock<PathBuf>>,
}

/// A value each of `n` ranks of this process takes once; after the last
/// take it is released (the ranks' own references go when they are done).
pub struct Handoff<T> {
    slot: std::sync::Mutex<Option<Arc<T>>>,
    remaining: AtomicUsize,
}

impl<T> Handoff<T> {
    /// `value` for `n` ranks.
    pub fn new(value: T, n: usize) -> Arc<Self> {
        Arc::new(Self { slot: std::sync::Mutex::new(Some(Arc::new(value))), remaining: AtomicUsize::new(n) })
    }

    /// The value (`None` once every rank took it).
    pub fn take(&self) -> Option<Arc<T>> {
        let mut slot = self.slot.lock().ok()?;
        let v = slot.clone();
        if self.remaining.fetch_sub(1, Ordering::SeqCst) <= 1 {
            *slot = None;
        }
        v
    }
}

/// The run folder `--resume` continues, if any: `--resume DIR`, or
/// `--resume` with `--out DIR`.
pub fn resume_dir(args: &TrainArgs) -> Result<Option<PathBuf>> {
    Ok(match &args.resume {
        None => None,
        Some(Some(d)) => {
            if let Some(out) = args.out.as_ref().filter(|o| !folder::same_path(o, d)) {
                bail!(
                    "--resume {} continues that run in its own folder, so --out {} would be ignored; drop --out (or copy the run folder to {} and resume that)",
                    d.display(),
                    out.display(),
                    out.display()
                );
            }
            Some(d.clone())
        }
        Some(None) => Some(args.out.clone().context("--resume needs the run directory: --resume DIR (or --out DIR)")?),
    })
}

/// A resumed run: the config saved in the newest valid checkpoint of `dir`
/// (with `--set`), that checkpoint, and the folder's lock when this process
/// writes the folder (taken before anything in it is read or moved).
pub fn load_resumed(dir: &Path, args: &TrainArgs, writes_folder: bool) -> Result<(Config, Loaded, Option<FolderLock>)> {
    if args.config.is_some() || args.deepspeed.config_model.is_some() || args.deepspeed.strict {
        bail!("--resume continues with the config saved in the checkpoint; drop the CONFIG argument (and --config-model, --strict; use --set to override single keys)");
    }
    if !dir.is_dir() {
        bail!("--resume {}: no such run folder", dir.display());
    }
    // Before anything in the folder is read or moved: one process
    // per run folder (rank 0 of an MPI job; the others only read).
    let mut lock = None;
    if writes_folder {
        lock = Some(folder::lock(dir, "train --resume")?);
        for line in checkpoint::clean_leftovers(dir)? {
            eprintln!("{line}");
        }
    }
    let loaded = crate::heap::during(crate::heap::Phase::Load, || checkpoint::latest_valid(dir, |w| eprintln!("{w}")))?;
    let folder_id = read_run_id(dir)?;
    match (&folder_id, &loaded.state.run_id) {
        (Some(f), Some(c)) if f != c => bail!(
            "checkpoint {} belongs to run {c}, but {} is run {f}: refusing to continue another run's checkpoint",
            loaded.dir.display(),
            dir.display()
        ),
        (Some(f), None) => bail!(
            "checkpoint {} has no run id, but {} is run {f}: it was not written by this run; refusing to adopt it",
            loaded.dir.display(),
            dir.display()
        ),
        _ => {}
    }
    eprintln!("resuming from {} (step {})", loaded.dir.display(), loaded.state.step);
    let origin = loaded.dir.join(checkpoint::CONFIG).display().to_string();
    let mut cfg = Config::from_toml(&loaded.config_toml, &origin, &args.set)?;
    keep_global_batch(&mut cfg, loaded.state.world_size, &args.set);
    if let Some(source) = cfg.train.frozen_source.as_deref().filter(|s| cfg.lora.is_some() && !s.exists()) {
        let bytes =
            loaded.base.as_ref().map_or(String::new(), |b| format!(" ({} bytes, sha256 {})", b.bytes, b.sha256));
        bail!(
            "cannot resume from {}: the run's frozen base {}{bytes} cannot be found (train.frozen_source); the checkpoint holds only what training changes. Put the base back there, or point --set train.frozen_source=PATH at a copy of it",
            loaded.dir.display(),
            source.display()
        );
    }
    Ok((cfg, loaded, lock))
}

/// A resume on another number of data-parallel ranks than wrote the
/// checkpoint (a host lost, or added) keeps the global batch — the data
/// position counts in it — by taking the difference into the accumulation
/// steps at the same micro-batch, unless `--set batch.…` says otherwise or
/// the new count does not divide the batch (validation then names the rule).
fn keep_global_batch(cfg: &mut Config, saved_data_ranks: usize, sets: &[String]) {
    let world = comm::launcher::launcher_world_size().map_or(cfg.dist.world_size, |(n, _)| n);
    // A grid that does not divide the world is refused later, by name.
    let Ok(data_ranks) = cfg.dist.data_parallel(world, "the ranks started") else { return };
    let b = &mut cfg.batch;
    let by_hand = sets.iter().any(|s| s.trim_start().starts_with("batch."));
    let (Some(global), Some(config::Micro::Sequences(micro))) = (b.global, b.micro) else { return };
    if by_hand || data_ranks == saved_data_ranks || data_ranks == 0 || !global.is_multiple_of(micro * data_ranks) {
        return;
    }
    let k = global / (micro * data_ranks);
    if b.accumulation_steps != Some(k) {
        eprintln!(
            "resuming on {data_ranks} data-parallel rank(s) instead of {saved_data_ranks}: batch.accumulation_steps {} -> {k} keeps the global batch {global} (micro {micro})",
            b.accumulation_steps.map_or("unset".to_string(), |k| k.to_string())
        );
        b.accumulation_steps = Some(k);
    }
}

/// `--init-from`: the pretrained model's parameters (with `[lora]`, fresh
/// adapters beside them), its shape pinned into `cfg.model` and its
/// tokenizer into `cfg.data` unless one is configured. Refused on a resumed
/// run; without it, `[lora]` is warned about.
pub fn init_from(
    init_from: Option<&Path>,
    sets: &[String],
    cfg: &mut Config,
    resuming: bool,
) -> Result<Option<Vec<f32>>> {
    Ok(match init_from {
        Some(path) if !resuming => {
            // Absolute: a resume, `generate` or `eval` of the run may start elsewhere.
            let path = &std::path::absolute(path).with_context(|| format!("--init-from {}", path.display()))?;
            // A sharded run folder's model is its last checkpoint.
            let path = &crate::checkpoint::model_dir(path)?;
            if let Some(base) = BaseRef::read(path)? {
                bail!(
                    "--init-from {}: that folder holds LoRA adapters over the base {} (base.json), not a model; fine-tune from the base (--init-from {}), or export the adapted model first (macrobatch export {} --format hf --out DIR) and start from DIR",
                    path.display(),
                    base.path.display(),
                    base.path.display(),
                    path.display()
                );
            }
            if let Some(params) = init_packed(path, sets, cfg)? {
                return Ok(Some(params));
            }
            memory::check_load(path, &format!("--init-from {}", path.display()))
                .with_context(|| format!("--init-from {}: cannot load the model", path.display()))?;
            let (pretrained, params) = crate::heap::during(crate::heap::Phase::Load, || crate::saved::load_whole(path))
                .with_context(|| format!("--init-from {}: cannot load the model", path.display()))?;
            // The pretrained family and shape win over the preset; with
            // [lora], freshly initialised adapters join the pretrained base.
            adopt_pretrained(pretrained.as_ref(), path, sets, cfg)?;
            // The base a LoRA run's checkpoints refer to instead of copying it.
            if cfg.lora.is_some() && cfg.train.frozen_source.is_none() {
                cfg.train.frozen_source = Some(path.to_path_buf());
            }
            let family = family::from_config(&cfg.model, cfg.lora.as_ref())?;
            Some(family.start_from_pretrained(params, cfg.train.seed)?)
        }
        Some(_) => bail!("--init-from and --resume exclude each other: a resumed run continues from its checkpoint"),
        None => {
            let packs = !matches!(cfg.train.frozen_dtype, config::FrozenDtype::Auto | config::FrozenDtype::F32);
            if packs && !resuming && cfg.train.frozen_source.is_none() {
                bail!(
                    "train.frozen_dtype = \"{}\" packs a pretrained frozen base, and none is given: pass --init-from (a GGUF file or a Hugging Face folder), or set train.frozen_dtype = \"auto\"",
                    cfg.train.frozen_dtype.name()
                );
            }
            if cfg.lora.is_some() && !resuming {
                eprintln!(
                    "warning: [lora] without --init-from trains adapters on a randomly initialised, frozen base; fine-tuning means --init-from a pretrained model (a Hugging Face folder or a GGUF file)"
                );
            }
            None
        }
    })
}

/// `plan --init-from PATH`: what a run started from the pretrained model
/// at `path` takes from it, read from its metadata alone — its shape, its
/// tokenizer unless one is configured, and with `[lora]` the source of a
/// packed frozen base (used when `train.frozen_dtype` packs one).
pub fn plan_from_pretrained(path: &Path, sets: &[String], cfg: &mut Config) -> Result<()> {
    let shape = family::read_hf_config(path)
        .with_context(|| format!("--init-from {}: cannot read the model", path.display()))?;
    adopt_pretrained(shape.as_ref(), path, sets, cfg)?;
    if cfg.lora.is_some() && cfg.train.frozen_source.is_none() {
        cfg.train.frozen_source = Some(path.to_path_buf());
    }
    Ok(())
}

/// The pretrained model at `path` (`shape`) pinned into `cfg.model` — a
/// `--set model.…` it replaced is an error — and its tokenizer adopted.
fn adopt_pretrained(shape: &dyn family::Family, path: &Path, sets: &[String], cfg: &mut Config) -> Result<()> {
    let asked = serde_json::to_value(&cfg.model).unwrap_or_default();
    let before = cfg.model.clone();
    shape.pin_shape(&mut cfg.model);
    cfg.model.source = Some(source_name(path));
    keep_position_keys(shape, sets, &before, &mut cfg.model);
    refuse_shape_overrides(sets, &asked, &serde_json::to_value(&cfg.model).unwrap_or_default(), path)?;
    adopt_tokenizer(cfg, path);
    Ok(())
}

/// `model.source`: where a pinned shape came from, as an absolute path
/// (as given, if it cannot be resolved).
fn source_name(path: &Path) -> String {
    std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf()).display().to_string()
}

/// The pretrained model's tokenizer (a GGUF file's, a folder's
/// `tokenizer.json`), unless one is configured.
fn adopt_tokenizer(cfg: &mut Config, path: &Path) {
    if cfg.data.tokenizer.is_none() {
        if family::is_gguf(path) {
            cfg.data.tokenizer = Some(TokenizerSpec::Gguf(path.to_path_buf()));
        } else if path.join("tokenizer.json").exists() {
            cfg.data.tokenizer = Some(TokenizerSpec::TokenizerJson(path.join("tokenizer.json")));
        }
    }
}

/// `--init-from` when `train.frozen_dtype` packs the frozen base: the
/// shape read from the source's metadata, the layout's other tensors (and
/// fresh adapters) read from it, the base left to the family to pack when
/// the model is built, and the source kept as `train.frozen_source` for a
/// resume. `None`: the base stays f32 (`f32`, or `auto` on a source that is
/// not 16-bit), loaded as before.
fn init_packed(path: &Path, sets: &[String], cfg: &mut Config) -> Result<Option<Vec<f32>>> {
    if cfg.lora.is_none() || cfg.train.frozen_dtype == config::FrozenDtype::F32 {
        return Ok(None);
    }
    let context = || format!("--init-from {}: cannot load the model", path.display());
    let shape = family::read_hf_config(path).with_context(context)?;
    let asked = serde_json::to_value(&cfg.model).unwrap_or_default();
    let mut pinned = cfg.model.clone();
    shape.pin_shape(&mut pinned);
    pinned.source = Some(source_name(path));
    keep_position_keys(shape.as_ref(), sets, &cfg.model, &mut pinned);
    let family = family::from_config(&pinned, cfg.lora.as_ref())?;
    let storage = crate::setup::frozen_storage(cfg, Some(path));
    let Some(packed) = family.with_frozen_storage(&storage).with_context(context)? else { return Ok(None) };
    cfg.model = pinned;
    refuse_shape_overrides(sets, &asked, &serde_json::to_value(&cfg.model).unwrap_or_default(), path)?;
    adopt_tokenizer(cfg, path);
    cfg.train.frozen_source = Some(path.to_path_buf());
    let rest = crate::heap::during(crate::heap::Phase::Load, || packed.load_unfrozen(path)).with_context(context)?;
    Ok(Some(packed.start_from_pretrained(rest, cfg.train.seed)?))
}

/// The pretrained shape's [`family::Family::position_keys`] that `--set`
/// gives, as `before` had them (context extension: e.g. a longer
/// `model.block_size` with a `model.rope_scaling`), kept in `pinned`.
fn keep_position_keys(shape: &dyn ::family::Family, sets: &[String], before: &ModelConfig, pinned: &mut ModelConfig) {
    for key in shape.position_keys() {
        let given = sets.iter().any(|s| s.split_once('=').is_some_and(|(k, _)| k.trim() == format!("model.{key}")));
        if let (true, Some(v)) = (given, before.shape.get(*key)) {
            pinned.shape.insert(key.to_string(), v.clone());
        }
    }
}

/// `--set model.KEY=…` that the pretrained model's shape replaced: an error
/// naming both values, instead of silently training another shape.
fn refuse_shape_overrides(
    sets: &[String],
    asked: &serde_json::Value,
    pinned: &serde_json::Value,
    source: &Path,
) -> Result<()> {
    // The last --set of a key is the one in effect.
    let mut seen = std::collections::HashSet::new();
    for set in sets.iter().rev() {
        let Some(key) = set.split_once('=').map(|(k, _)| k.trim()).and_then(|k| k.strip_prefix("model.")) else {
            continue;
        };
        if !seen.insert(key) {
            continue;
        }
        // Token ids are not shape: --set may choose them; the pretrained
        // shape replaces a preset whole.
        if matches!(key, "bos_token_id" | "eos_token_id" | "preset") {
            continue;
        }
        let (a, p) = (asked.get(key), pinned.get(key));
        // A float read from GGUF went through f32: equal within its precision.
        let same_float = matches!((a.and_then(|v| v.as_f64()), p.and_then(|v| v.as_f64())),
            (Some(x), Some(y)) if (x - y).abs() <= 1e-6 * x.abs().max(y.abs()));
        if a != p && !same_float {
            let show = |v: Option<&serde_json::Value>| v.map_or("unset".to_string(), |v| v.to_string());
            bail!(
                "--set {set} conflicts with --init-from {}: the pretrained model has model.{key} = {}, and its shape is what gets trained; drop --set model.{key} (the shape comes from the pretrained model)",
                source.display(),
                show(p)
            );
        }
    }
    Ok(())
}

/// The checkpoint's parameters in the run's layout. One holding only
/// adapters: the base read again from `train.frozen_source` as the run's
/// start read it (packed where the run packs it), checked to be the bytes
/// the checkpoint names, with the checkpoint's adapters. With a packed
/// frozen base: the checkpoint's parameters cut to the layout's tensors,
/// as the family reads a run folder — the base packed again from
/// `train.frozen_source`, the checkpoint's copy of it checked against it
/// to the bit. A base changed since the run is refused, naming the fix.
pub fn onto_run_layout(plan: &Plan, l: &mut Loaded) -> Result<()> {
    if let Some(saved) = &l.base {
        let source = plan.cfg.train.frozen_source.as_deref().with_context(|| {
            format!("{} holds adapters without their base, and train.frozen_source names none: set it to the run's base (--set train.frozen_source=PATH)", l.dir.display())
        })?;
        let resuming = || format!("cannot resume from {}", l.dir.display());
        let now = BaseRef::of(source, base_ref::held_as(&plan.cfg)).with_context(resuming)?;
        let fix = "or --set train.frozen_source=PATH to a copy of it";
        saved.same_as(&now, &l.dir, fix).with_context(resuming)?;
        l.params = base_ref::with_adapters(&l.dir, plan.family.as_ref(), source)?;
        l.base = Some(now);
        return Ok(());
    }
    if plan.family.frozen_bytes().is_none() {
        return Ok(());
    }
    let layout = plan.family.build(family::Build::default())?.layout().clone();
    l.params =
        plan.family.load_weights(&l.dir, &layout).with_context(|| format!("cannot resume from {}", l.dir.display()))?;
    Ok(())
}

/// The frozen base a LoRA run's checkpoints and final folder refer to
/// (`None`: they hold the whole model): for a run resumed from a
/// checkpoint that refers to one, that base as the resume read it; for a
/// LoRA run started `--init-from` a file (`from_file`, which is then its
/// `train.frozen_source`), that file as it is now, hashed by the process
/// that writes them. A run on a random base, one whose `train.trainable`
/// names tensors beside the adapters, one with `train.save_base`, or one
/// resumed from a whole checkpoint keeps writing whole ones.
pub fn base_reference(
    plan: &Plan,
    resume: Option<&Loaded>,
    (from_file, writes_folder): (Option<&Path>, bool),
) -> Result<Option<BaseRef>> {
    let cfg = &plan.cfg;
    if let Some(l) = resume {
        return Ok(l.base.clone());
    }
    // The default `["*"]` under `[lora]`: the adapters alone train.
    let adapters_only = cfg.lora.is_some() && cfg.train.trainable == ["*"] && !cfg.train.save_base;
    let Some(source) = cfg.train.frozen_source.as_deref().filter(|_| adapters_only) else { return Ok(None) };
    if !(from_file.is_some_and(|f| folder::same_path(f, source)) && writes_folder) {
        return Ok(None);
    }
    let held_as = base_ref::held_as(cfg);
    Ok(Some(BaseRef::of(source, held_as).context("train.frozen_source: the run's base cannot be read")?))
}

/// Refuses a checkpoint that does not continue `plan`: another model shape,
/// global batch or optimizer, or a step beyond `train.steps`.
pub fn check_resume(plan: &Plan, l: &Loaded) -> Result<()> {
    let (saved, wanted) = (l.model.hf_config(), plan.family.hf_config());
    if saved != wanted {
        let keys: std::collections::BTreeSet<&String> =
            saved.as_object().into_iter().chain(wanted.as_object()).flat_map(|o| o.keys()).collect();
        let differ: Vec<String> = keys
            .into_iter()
            .filter(|k| saved.get(k.as_str()) != wanted.get(k.as_str()))
            .map(|k| {
                let show = |v: Option<&serde_json::Value>| v.map_or("absent".to_string(), |v| v.to_string());
                format!("{k}: {} in the checkpoint, {} in the config", show(saved.get(k)), show(wanted.get(k)))
            })
            .collect();
        bail!(
            "the checkpoint in {} holds a model of shape {} {} but the config asks for {} {} ({}); resume with the run's own [model] settings",
            l.dir.display(),
            l.model.name(),
            l.model.describe(),
            plan.family.name(),
            plan.family.describe(),
            differ.join("; ")
        );
    }
    if l.state.global_batch != plan.batch.global {
        bail!(
            "the checkpoint was written with global batch {}, the config now gives {}; the data position counts in global batches, so keep batch.global",
            l.state.global_batch,
            plan.batch.global
        );
    }
    if let Some(saved) = &l.state.mixture_drawn {
        crate::setup::check_mixture_position(plan, l.state.step, saved)?;
    }
    if l.state.optimizer != plan.cfg.optim.name {
        bail!(
            "the checkpoint holds `{}` optimizer state but optim.name is `{}`",
            l.state.optimizer,
            plan.cfg.optim.name
        );
    }
    if plan.cfg.train.steps < l.state.step {
        bail!(
            "train.steps = {} is below the checkpoint's step {} ({}): a run cannot go back; resume with train.steps >= {} (or start a new run)",
            plan.cfg.train.steps,
            l.state.step,
            l.dir.display(),
            l.state.step
        );
    }
    Ok(())
}

/// This run's id: a resumed folder's (or, for a folder from before run ids,
/// its checkpoint's, written into the folder), else a new one.
pub fn run_id(resume_dir: Option<&Path>, resume: Option<&Loaded>, writes_folder: bool) -> Result<String> {
    Ok(match (resume_dir, resume) {
        (Some(dir), Some(l)) => match read_run_id(dir)? {
            Some(id) => id,
            None => {
                // A folder from before run ids: take the checkpoint's, or give it one.
                let id = l.state.run_id.clone().unwrap_or_else(new_run_id);
                if writes_folder {
                    nn::io::write_atomic(&dir.join(RUN_ID_FILE), format!("{id}\n").as_bytes())?;
                }
                id
            }
        },
        _ => new_run_id(),
    })
}

/// A new run id: sub-second time, process id and a per-process counter, so
/// two runs never share one.
fn new_run_id() -> String {
    static COUNTER: AtomicUsize = AtomicUsize::new(0);
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    format!(
        "{}-{:09}-{}-{}",
        now.as_secs(),
        now.subsec_nanos(),
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    )
}

/// The run id stored in `dir`, if any.
fn read_run_id(dir: &Path) -> Result<Option<String>> {
    match std::fs::read_to_string(dir.join(RUN_ID_FILE)) {
        Ok(t) => Ok(Some(t.trim().to_string())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e).with_context(|| format!("cannot read {}", dir.join(RUN_ID_FILE).display())),
    }
}

#[cfg(test)]
mod tests {
    /// Every id a run writes into `run_id` is one [`folder::is_run_id`]
    /// takes for ours (a new run may replace an unstarted run's folder).
    #[test]
    fn new_run_ids_are_recognised_as_ours() {
        for _ in 0..3 {
            let id = super::new_run_id();
            assert!(super::folder::is_run_id(&format!("{id}\n")), "{id}");
        }
    }
}
