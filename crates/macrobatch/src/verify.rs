//! `macrobatch verify`: proves, on the user's own config, that the configured
//! factorization (micro × K × W) computes the same optimizer step as one big
//! batch of the same samples from the same parameters.

use crate::dist::Backend;
use crate::planning::plan;
use crate::ranks::run_thread_ranks;
use crate::setup::{load_config, model_for, rank_batches, trainer_for, trainer_from, Plan};
use crate::VerifyArgs;
use anyhow::{bail, Context, Result};
use comm::Communicator;
use data::{BatchShape, Sampler};
use engine::StepReport;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Relative gradient tolerance: the factorizations differ only in f32
/// summation order (≈1e-7 relative per addition), docs/contract.md asks ≤ 1e-5.
const GRAD_TOL: f32 = 1e-5;

struct StepResult {
    grads: Vec<f32>,
    params: Vec<f32>,
    report: StepReport,
}

/// One optimizer step of step 0's global batch, factored as `shape`
/// (with the configured ZeRO stage when W > 1), from `initial` parameters
/// (a pretrained model's) or the configured initialisation.
fn one_step(plan: &Arc<Plan>, shape: BatchShape, initial: &Option<Arc<Vec<f32>>>) -> Result<StepResult> {
    let cfg = &plan.cfg;
    let sampler = Sampler::new(plan.train.n_samples(), shape, cfg.data.shuffle, cfg.data.drop_last, cfg.train.seed)?
        .with_mixture(plan.sampler.mixture().cloned());
    let slot: Arc<Mutex<Option<StepResult>>> = Arc::new(Mutex::new(None));
    let run = {
        let (plan, slot, sampler, initial) = (plan.clone(), slot.clone(), sampler.clone(), initial.clone());
        move |c: &mut dyn Communicator| -> Result<()> {
            let mut model = model_for(&plan)?;
            let root = crate::setup::scratch_offload_root();
            let mut trainer = trainer_from(&plan, &model, c, initial.as_deref().map(Vec::as_slice), &root)?;
            let order = sampler.epoch_order(0);
            let batches = rank_batches(&plan, &sampler, &order, 0, c.rank())?;
            let report = trainer.step(&mut model, c, &batches)?;
            let (grads, params) = (trainer.full_gradient(c)?, trainer.full_params(c)?);
            if c.rank() == 0 {
                let r = StepResult { grads, params, report };
                *slot.lock().map_err(|_| anyhow::anyhow!("result slot poisoned"))? = Some(r);
            }
            Ok(())
        }
    };
    if shape.world_size == 1 {
        run(&mut comm::SingleProcess::new())?;
    } else {
        run_thread_ranks(shape.world_size, Duration::from_secs_f64(cfg.dist.timeout_s), move |c| run(c))?;
    }
    crate::setup::remove_scratch_offload_root();
    let r = slot.lock().map_err(|_| anyhow::anyhow!("result slot poisoned"))?.take();
    r.context("rank 0 produced no result")
}

fn max_abs(a: &[f32]) -> f32 {
    a.iter().fold(0.0f32, |m, x| m.max(x.abs()))
}

/// Runs the check; `Ok(true)` when it passes.
pub fn run(args: VerifyArgs) -> Result<bool> {
    if let Some((n, var)) = comm::launcher::launcher_world_size() {
        bail!("verify simulates the ranks in one process; run it without mpirun ({var}={n} is set)");
    }
    let mut cfg = load_config(args.config.as_deref(), &args.set, &args.deepspeed)?;
    // The pretrained model's shape and tokenizer pinned into the config, its
    // parameters (with [lora], fresh adapters beside them) the start of both runs.
    let initial = crate::train::start::init_from(args.init_from.as_deref(), &args.set, &mut cfg, false)?.map(Arc::new);
    if cfg.dist.pipeline_parallel > 1 {
        bail!(
            "verify compares data-parallel shapes of one step (dist.pipeline_parallel = {}); run it with --set dist.pipeline_parallel=1 (a pipeline's step equals the unpipelined one: `train` with both and compare metrics.jsonl)",
            cfg.dist.pipeline_parallel
        );
    }
    if cfg.dist.tensor_parallel > 1 {
        bail!(
            "verify compares data-parallel shapes of one step (dist.tensor_parallel = {}); run it with --set dist.tensor_parallel=1 (a tensor-parallel step equals the unsplit one within rounding: `train` with both and compare metrics.jsonl)",
            cfg.dist.tensor_parallel
        );
    }
    if cfg.dist.context_parallel > 1 {
        bail!(
            "verify compares data-parallel shapes of one step (dist.context_parallel = {}); run it with --set dist.context_parallel=1 (a context-parallel step equals the unsplit one within rounding: `train` with both and compare metrics.jsonl)",
            cfg.dist.context_parallel
        );
    }
    let world = cfg.dist.world_size;
    let backend = if world > 1 { Backend::Threads(world) } else { Backend::Single };
    let plan = Arc::new(plan(cfg, backend)?);
    if plan.cfg.train.threads > 0 {
        rayon::ThreadPoolBuilder::new().num_threads(plan.cfg.train.threads).build_global()?;
    }
    let b = plan.batch;
    let g = b.global;
    let ref_micro = args.reference_micro.unwrap_or(g);
    if ref_micro == 0 || g % ref_micro != 0 {
        bail!("--reference-micro {ref_micro} must divide the global batch {g}");
    }
    let configured = BatchShape { micro: b.micro, accumulation_steps: b.accumulation_steps, world_size: b.world_size };
    let reference = BatchShape { micro: ref_micro, accumulation_steps: g / ref_micro, world_size: 1 };
    let from = match &args.init_from {
        Some(p) => format!("the parameters of {}", p.display()),
        None => "the same initial parameters".into(),
    };
    println!(
        "verify: global batch {g} as micro {} × K {} × W {} vs micro {} × K {} × W 1 — same samples, {from}, one {} step",
        configured.micro, configured.accumulation_steps, configured.world_size, reference.micro, reference.accumulation_steps, plan.cfg.optim.name
    );
    let a = one_step(&plan, configured, &initial)?;
    let r = one_step(&plan, reference, &initial)?;

    let dl = (a.report.loss - r.report.loss).abs();
    println!("  loss        {:.10} vs {:.10} (|Δ| {dl:.1e})", a.report.loss, r.report.loss);
    if a.report.aux_loss != 0.0 || r.report.aux_loss != 0.0 {
        // The training loss beyond the cross-entropy (smoothing, z-loss, a
        // mixture's router losses): the step's gradient is that of both.
        let da = (a.report.aux_loss - r.report.aux_loss).abs();
        println!(
            "  aux loss    {:.10} vs {:.10} (|Δ| {da:.1e}, relative {:.1e})",
            a.report.aux_loss,
            r.report.aux_loss,
            da / r.report.aux_loss.abs().max(f64::MIN_POSITIVE)
        );
    }
    let g_scale = max_abs(&r.grads);
    let dg = a.grads.iter().zip(&r.grads).fold(0.0f32, |m, (x, y)| m.max((x - y).abs()));
    let grad_ok = dg <= GRAD_TOL * g_scale;
    println!(
        "  gradient    max |Δ| {dg:.2e}, max |g| {g_scale:.2e}, relative {:.2e} (tolerance {GRAD_TOL:.0e}) {}",
        dg / g_scale.max(f32::MIN_POSITIVE),
        if grad_ok { "PASS" } else { "FAIL" }
    );
    // Parameters: the gradient tolerance carried through the first update.
    let model = model_for(&plan)?;
    let opt = trainer_for(&plan, &model, &mut comm::SingleProcess::new())?.optimizer().clone();
    crate::setup::remove_scratch_offload_root();
    let lr = r.report.lr;
    let (mut dp, mut n_over) = (0.0f32, 0usize);
    // Gradients live in the gradient space (trainable tensors back to back);
    // a frozen tensor must not move at all.
    let mut g_at = 0;
    for t in engine::Model::layout(&model).tensors() {
        for (j, i) in t.range().enumerate() {
            let d = (a.params[i] - r.params[i]).abs();
            dp = dp.max(d);
            let allowed = if t.trainable {
                opt.first_step_tolerance(r.grads[g_at + j], r.params[i], lr, GRAD_TOL * g_scale)
            } else {
                0.0
            };
            if d > allowed {
                n_over += 1;
            }
        }
        if t.trainable {
            g_at += t.range().len();
        }
    }
    let params_ok = n_over == 0;
    println!(
        "  parameters  max |Δ| {dp:.2e} (lr {lr:.1e}); {n_over} of {} outside the gradient tolerance carried through the update {}",
        r.params.len(),
        if params_ok { "PASS" } else { "FAIL" }
    );
    let ok = grad_ok && params_ok;
    println!("{}", if ok { "PASS" } else { "FAIL" });
    Ok(ok)
}
