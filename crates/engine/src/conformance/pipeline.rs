//! Pipeline and tensor parallelism against one rank: a model cut into P
//! stages and split over T tensor-parallel ranks on thread ranks,
//! data-parallel over D, under GPipe or 1F1B, trains the same steps as the
//! model uncut on D ranks — per-step losses and final parameters — over a
//! global batch of 16 sequences in windows that include a micro-batch
//! without targets, an uneven last window and micro-batches without rows.
//! World rank r = s·(D·T) + d·T + t (Megatron-LM's order); with C
//! context-parallel ranks, r = s·(D·C·T) + d·(C·T) + c·T + t.

use super::{err, Check};
use crate::optim::{AdamW, Optimizer, Sgd};
use crate::pipeline::{partition_layers, ScheduleKind, StagedModel};
use crate::schedule::LrSchedule;
use crate::tensor::{Shard, TpRank};
use crate::trainer::{PipelineStage, Trainer, TrainerOptions};
use crate::zero::ZeroConfig;
use crate::{Checkpointing, ContextAttention, ContextRank, Precision, TokenBatch, IGNORE_INDEX};
use comm::Communicator;
use std::time::Duration;

/// A staged model family and its data for the pipeline checks.
pub struct PipelineCase<'a, M> {
    /// A fresh model (at least 4 blocks) with this storage precision and
    /// checkpointing, as tensor-parallel rank `TpRank` holds it
    /// ([`TpRank::WHOLE`]: the whole model).
    pub model: &'a (dyn Fn(Precision, Checkpointing, TpRank) -> M + Sync),
    /// Initial parameters.
    pub init: Vec<f32>,
    /// At least 16 samples.
    pub seqs: &'a super::TokenSamples,
}

/// One layout of the checks.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Layout {
    /// Pipeline stages.
    pub p: usize,
    /// Data-parallel ranks per stage.
    pub d: usize,
    /// Tensor-parallel ranks per (stage, data rank).
    pub t: usize,
    /// Context-parallel ranks per (stage, data rank): each holds its
    /// positions of every sequence.
    pub c: usize,
    /// How attention reaches the other context ranks' keys and values.
    pub attention: ContextAttention,
    /// Each sequence packs two documents (positions restart after the
    /// first 3 tokens): neither attends to the other.
    pub packed: bool,
    /// The schedule.
    pub kind: ScheduleKind,
    /// Storage precision of activations and the model's parameter copy.
    pub precision: Precision,
    /// Activation checkpointing.
    pub checkpointing: Checkpointing,
    /// ZeRO stage (0 or 1).
    pub zero: u8,
    /// Clip the gradient to a norm of 1e-3 (always active), and record
    /// each step's gradient norm after its loss: a norm that counted a
    /// tensor twice (or a piece not at all) moves every update.
    pub clip: bool,
    /// One step of plain SGD at learning rate 1 instead of three AdamW
    /// steps: the final parameters are `init − g`, so a comparison of them
    /// compares the first step's gradient, which no optimizer amplified
    /// (see [`check_tensor_layouts`]).
    pub first_gradient: bool,
}

impl Layout {
    /// The model uncut on `d` data ranks (1F1B named but unused), ZeRO-0,
    /// no clipping: the reference the other layouts vary from.
    pub fn uncut(d: usize, precision: Precision, checkpointing: Checkpointing) -> Self {
        Layout {
            p: 1,
            d,
            t: 1,
            c: 1,
            attention: ContextAttention::Ring,
            packed: false,
            kind: ScheduleKind::OneFOneB,
            precision,
            checkpointing,
            zero: 0,
            clip: false,
            first_gradient: false,
        }
    }
}

/// Per-step losses and the final parameters of a run.
pub type Run = (Vec<f64>, Vec<f32>);

/// One rank's losses and, on rank 0, the model-wide final parameters.
type RankRun = Result<(Vec<f64>, Option<Vec<f32>>), String>;

/// Micro-batches per data rank at micro-batch 2: the global batch of 16
/// sequences over D data ranks.
fn n_micro(d: usize) -> usize {
    16 / (2 * d)
}

/// Step `s`'s micro-batches of data rank `r` of `d`: the window's samples
/// `(k·D + r)·2 …` (step 1: micro-batch 1 of every rank has no targets;
/// step 2: a window of 11, so some micro-batches are short or empty).
fn batches(seqs: &super::TokenSamples, step: usize, r: usize, d: usize, packed: bool) -> Vec<TokenBatch> {
    let window: Vec<usize> = match step {
        2 => (32..43).collect(),
        s => (16 * s..16 * s + 16).collect(),
    };
    (0..n_micro(d))
        .map(|k| {
            let at = (k * d + r) * 2;
            let idx: Vec<usize> = window.iter().skip(at).take(2).copied().collect();
            let mut b = seqs.batch(&idx);
            if step == 1 && k == 1 {
                b.targets.fill(IGNORE_INDEX);
            }
            if packed {
                let t = b.seq_len;
                b.positions = (0..b.n_seqs * t).map(|i| i % t).map(|p| if p < 3 { p } else { p - 3 } as u32).collect();
            }
            b
        })
        .collect()
}

/// Runs `l` for 3 steps (1 with [`Layout::first_gradient`]) on P·D·T
/// thread ranks; rank 0's losses and the model-wide final parameters.
pub fn run_layout<M: StagedModel<Batch = TokenBatch> + Send>(
    case: &PipelineCase<'_, M>,
    l: Layout,
) -> Result<Run, String> {
    let world = l.p * l.d * l.c * l.t;
    let comms = comm::threads::group(world, Duration::from_secs(60));
    let results: Vec<RankRun> = std::thread::scope(|sc| {
        let handles: Vec<_> = comms.into_iter().map(|mut c| sc.spawn(move || one_rank(case, l, &mut c))).collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err("a rank panicked".into()))).collect()
    });
    let mut losses = None;
    let mut params = None;
    for (r, res) in results.into_iter().enumerate() {
        let (ls, p) = res.map_err(|e| format!("rank {r} of {l:?}: {e}"))?;
        if r == 0 {
            losses = Some(ls);
            params = p;
        }
    }
    Ok((losses.unwrap_or_default(), params.ok_or("rank 0 assembled no parameters")?))
}

fn one_rank<M: StagedModel<Batch = TokenBatch>>(
    case: &PipelineCase<'_, M>,
    l: Layout,
    world: &mut dyn Communicator,
) -> RankRun {
    let r = world.rank();
    let (stage, dr, cr, tr) = (r / (l.d * l.c * l.t), (r / (l.c * l.t)) % l.d, (r / l.t) % l.c, r % l.t);
    // The context ranks are data ranks for gradients and statistics.
    let mut dp = world.split(stage * l.t + tr, dr * l.c + cr).map_err(err("split dp"))?;
    let mut pipe = world.split((dr * l.c + cr) * l.t + tr, stage).map_err(err("split pipe"))?;
    let mut tp = world.split((stage * l.d + dr) * l.c + cr, tr).map_err(err("split tp"))?;
    let mut cp = world.split((stage * l.d + dr) * l.t + tr, cr).map_err(err("split cp"))?;
    let mut model = (case.model)(l.precision, l.checkpointing, TpRank::new(tr, l.t));
    if l.c > 1 {
        model.context_parallel(ContextRank::new(cr, l.c).with(l.attention))?;
    }
    let n = case.init.len();
    let (opt, sched, steps) = if l.first_gradient {
        (Optimizer::Sgd(Sgd::new(n, 0.0, false, 0.0).map_err(err("SGD"))?), LrSchedule::constant(1.0), 1)
    } else {
        let adamw = Optimizer::AdamW(AdamW::new(n, 0.9, 0.95, 1e-4, 0.1).map_err(err("AdamW"))?);
        (adamw, LrSchedule { warmup_steps: 2, total_steps: 10, ..LrSchedule::constant(1e-2) }, 3)
    };
    let options =
        TrainerOptions { precision: l.precision, grad_clip: l.clip.then_some(1e-3), ..TrainerOptions::default() };
    let zero = ZeroConfig { stage: l.zero, ..ZeroConfig::default() };
    let mut losses = Vec::new();
    if l.p == 1 && l.t == 1 && l.c == 1 {
        let mut t = Trainer::distributed(&model, case.init.clone(), opt, sched, options, zero, &mut *dp)
            .map_err(err("trainer"))?;
        for s in 0..steps {
            let rep = t.step(&mut model, &mut *dp, &batches(case.seqs, s, dr, l.d, l.packed)).map_err(err("step"))?;
            losses.push(rep.loss);
            if l.clip {
                losses.push(rep.grad_norm);
            }
        }
        let full = t.full_params(&mut *dp).map_err(err("full params"))?;
        return Ok((losses, (r == 0).then_some(full)));
    }
    let cuts = partition_layers(model.n_blocks(), l.p, None).map_err(err("cut"))?;
    let st = PipelineStage::new(&mut model, &cuts, stage, l.kind, n_micro(l.d)).map_err(err("stage"))?;
    let segments = st.whole_segments();
    let init = |j: usize| std::borrow::Cow::Borrowed(&case.init[segments[j].clone()]);
    let mut t = Trainer::for_stage(&st, &init, opt, sched, options, zero, &mut *dp).map_err(err("trainer"))?;
    let split = l.t > 1;
    for s in 0..steps {
        let b = batches(case.seqs, s, dr, l.d, l.packed);
        let tpc = split.then_some(&mut *tp as &mut dyn Communicator);
        let cpc = (l.c > 1).then_some(&mut *cp as &mut dyn Communicator);
        let rep =
            t.step_pipeline(&mut model, &st, &mut *dp, &mut *pipe, (tpc, cpc), &b).map_err(err("pipeline step"))?;
        if l.c > 1 && rep.context.is_none_or(|x| x.calls == 0) {
            return Err(format!("step {s}: a context-parallel step reports no gathers"));
        }
        if rep.pipeline.as_ref().map(|p| p.stage) != Some(stage) {
            return Err(format!("step {s}: the report names stage {:?}, not {stage}", rep.pipeline.map(|p| p.stage)));
        }
        if split && rep.tensor.is_none_or(|x| x.calls == 0) {
            return Err(format!("step {s}: a tensor-parallel step reports no all-reduces"));
        }
        losses.push(rep.loss);
        if l.clip {
            losses.push(rep.grad_norm);
        }
    }
    let local = t.full_params(&mut *dp).map_err(err("full params"))?;
    if split {
        replicas_agree(&st, &mut *tp, &local)?;
        t.check_replicas_agree(&mut *tp, &st).map_err(err("replica checksums"))?;
    }
    if model.tied_head() {
        // The tied embedding's two copies (first and last stage) are equal, bit for bit.
        let own = st.layout.local(0).map(|j| local[st.layout.segments[j].clone()].to_vec()).unwrap_or_default();
        if stage == l.p - 1 {
            pipe.send(&own, 0, 99).map_err(err("send the tied copy"))?;
            pipe.flush_sends().map_err(err("flush"))?;
        } else if stage == 0 {
            let mut theirs = vec![0.0; own.len()];
            pipe.recv(&mut theirs, l.p - 1, 99).map_err(err("receive the tied copy"))?;
            if theirs.iter().zip(&own).any(|(a, b)| a.to_bits() != b.to_bits()) {
                return Err("the tied embedding's copies on the first and last stage differ".into());
            }
        }
    }
    let full = match (dr, cr) {
        (0, 0) => st.gather(&mut *pipe, split.then_some(&mut *tp as &mut dyn Communicator), &local, false),
        _ => Ok(None),
    }
    .map_err(err("gather"))?;
    Ok((losses, full))
}

/// Every tensor-parallel rank holds the same bits of each tensor the ranks
/// share (replicated tensors; key/value pieces shared by several ranks are
/// compared where their pieces coincide): rank 0 of the group compares the
/// others' whole stage buffers against its own.
fn replicas_agree(st: &PipelineStage, tp: &mut dyn Communicator, local: &[f32]) -> Result<(), String> {
    let Some(map) = st.tensor_shards() else { return Ok(()) };
    if tp.rank() > 0 {
        tp.send(local, 0, 98).map_err(err("send for the replica check"))?;
        return tp.flush_sends().map_err(err("flush"));
    }
    for from in 1..tp.world_size() {
        let mut theirs = vec![0.0; local.len()];
        tp.recv(&mut theirs, from, 98).map_err(err("receive for the replica check"))?;
        let peer = TpRank { rank: from, ..map.tp };
        for (spec, shard) in st.layout.layout.tensors().iter().zip(st.stage_shards()) {
            let shared = match *shard {
                Shard::Split { parts, .. } => peer.piece(parts) == map.tp.piece(parts),
                _ => true,
            };
            let r = spec.range();
            if shared && local[r.clone()].iter().zip(&theirs[r]).any(|(a, b)| a.to_bits() != b.to_bits()) {
                return Err(format!("{} differs between tensor-parallel ranks 0 and {from}", spec.name));
            }
        }
    }
    Ok(())
}

/// Compares the pipeline layout `l` with the same data-parallel width
/// uncut (`reference`, from [`run_layout`] with P = 1): per-step losses
/// within `loss_rtol` (relative) and final parameters within `rtol` of
/// their largest magnitude. Returns whether both were bit-identical.
pub fn check_pipeline<M: StagedModel<Batch = TokenBatch> + Send>(
    case: &PipelineCase<'_, M>,
    l: Layout,
    reference: &Run,
    loss_rtol: f64,
    rtol: f32,
) -> Result<bool, String> {
    compare(l, &run_layout(case, l)?, reference, loss_rtol, rtol)
}

/// [`check_pipeline`]'s comparison of a run of `l` with `reference`.
fn compare(l: Layout, run: &Run, reference: &Run, loss_rtol: f64, rtol: f32) -> Result<bool, String> {
    let (losses, params) = run;
    let what = format!(
        "P={} D={} T={} C={}{} {} {:?} {:?} ZeRO-{}",
        l.p,
        l.d,
        l.t,
        l.c,
        if l.packed { " packed" } else { "" },
        l.kind,
        l.precision,
        l.checkpointing,
        l.zero
    );
    for (s, (a, b)) in losses.iter().zip(&reference.0).enumerate() {
        if (a - b).abs() > loss_rtol * b.abs() || !a.is_finite() {
            return Err(format!("{what}: step {s} loss {a} vs {b} uncut"));
        }
    }
    let c: Check = super::close(&format!("{what}: final parameters"), params, &reference.1, rtol);
    c?;
    Ok(*losses == reference.0 && params.iter().zip(&reference.1).all(|(a, b)| a.to_bits() == b.to_bits()))
}

/// [`check_tensor_layouts`]'s tolerances for the first step in 16 bits
/// (bf16 GEMM operands, or f16 storage), `(loss, gradient)`:
/// * loss, relative: 2⁻¹⁰. A reordered f32 sum rounds a stored 16-bit
///   activation to its neighbour (2⁻⁸ relative in bf16) only when it lies
///   within a few f32 ulps of a rounding boundary (about 2⁻¹⁵ of values),
///   and the loss averages over every target. Measured: 0 (bf16, T = 2
///   and 4), 9.5e-6 (f16, T = 4).
/// * gradient, per tensor and normwise: 2⁻⁴. A product of bf16 operands is
///   within 2⁻⁸ of the exact one (each operand within 2⁻⁹), so the split
///   and the uncut gradient are each within 2⁻⁸ of the exact sum of |parts|
///   and within 2⁻⁷ of each other; where the ranks' parts cancel by a
///   factor c (replicated key/value heads at T = 4, whose parts are rounded
///   to bf16 separately before the all-reduce while uncut rounds their sum;
///   a whole LoRA A beside a split B), that is 2⁻⁷·c of the gradient, and
///   c ≤ 8 is allowed. Measured on an Intel Xeon (AVX512-BF16, family 6
///   model 207), the same with the portable kernel: largest 2.3e-2 (LoRA
///   A of q_proj, bf16, T = 2), 7.5e-3 without LoRA (bf16, T = 4), 9.5e-4
///   whole-model (f16, T = 4). A defect of the split moves a tensor's
///   gradient by O(1).
pub const FIRST_STEP_16BIT: (f64, f64) = (1.0 / 1024.0, 1.0 / 16.0);

/// [`check_tensor_layouts`]'s comparison of the first step in 16 bits:
/// the loss within `loss_rtol` (relative), and for every trainable tensor
/// the gradient `init − final` (one SGD step at learning rate 1) within
/// `grad_rtol` of the reference's, normwise, plus what reading it out
/// rounds: `‖g − g_ref‖ ≤ grad_rtol · ‖g_ref‖ + 2⁻²³ · ‖θ₀‖` — each run's
/// `final = θ₀ − g` is rounded to within 2⁻²⁴ of `|θ₀|` per element (and
/// `θ₀ − final` is then exact), which for a tensor whose gradient is small
/// against its values (a clipped step) is all one can read. With clipping
/// (`l.clip`), the recorded gradient norm is compared too, within
/// `loss_rtol`. Frozen tensors (no gradient in the reference) must not move.
///
/// A defect of the split (a part of a sum missing or counted twice, a piece
/// applied to the wrong rows) moves a tensor's gradient by a part of it,
/// O(1) relative; rounding moves it by the 16-bit unit (2⁻⁸ per bf16
/// product) times how much the ranks' parts cancel. See the callers for
/// the measured values.
fn compare_first_gradient(
    l: Layout,
    run: &Run,
    reference: &Run,
    init: &[f32],
    tensors: &[(String, std::ops::Range<usize>)],
    (loss_rtol, grad_rtol): (f64, f64),
) -> Result<f64, String> {
    let what = format!("P={} D={} T={} C={} {:?} {:?}, first step", l.p, l.d, l.t, l.c, l.precision, l.checkpointing);
    let recorded = if l.clip { 2 } else { 1 };
    for (i, (a, b)) in run.0.iter().zip(&reference.0).take(recorded).enumerate() {
        if (a - b).abs() > loss_rtol * b.abs() || !a.is_finite() {
            let what_value = if i == 0 { "loss" } else { "gradient norm" };
            return Err(format!("{what}: {what_value} {a} vs {b} uncut"));
        }
    }
    let mut worst = 0.0f64;
    for (name, r) in tensors {
        let (mut diff, mut norm, mut values) = (0f64, 0f64, 0f64);
        for j in r.clone() {
            let (g, want) = (f64::from(init[j] - run.1[j]), f64::from(init[j] - reference.1[j]));
            if !g.is_finite() {
                return Err(format!("{what}: {name}: element {} of the gradient is {g}", j - r.start));
            }
            diff += (g - want) * (g - want);
            norm += want * want;
            values += f64::from(init[j]).powi(2);
        }
        let (diff, norm, readout) = (diff.sqrt(), norm.sqrt(), values.sqrt() * f64::from(f32::EPSILON));
        if norm > 0.0 {
            worst = worst.max((diff - readout).max(0.0) / norm);
        }
        if diff > grad_rtol * norm + readout {
            return Err(format!(
                "{what}: {name}: gradient differs from uncut by {:.3e} of its norm {norm:.3e} (tolerance {grad_rtol:e})",
                diff / norm.max(f64::MIN_POSITIVE)
            ));
        }
    }
    Ok(worst)
}

/// Every layout against uncut: P ∈ {2, 4} × {1F1B, GPipe} × D ∈ {1, 2} ×
/// f32/bf16 × checkpointing off/on, and P = 2 × D = 2 at ZeRO-1 — losses
/// within `loss_rtol`, parameters within `rtol` (see [`check_pipeline`]);
/// with `bit_identical`, each must also match bit for bit.
pub fn check_all_layouts<M: StagedModel<Batch = TokenBatch> + Send>(
    case: &PipelineCase<'_, M>,
    loss_rtol: f64,
    rtol: f32,
    bit_identical: bool,
) -> Check {
    let check = |l: Layout, reference: &Run| -> Check {
        let same = check_pipeline(case, l, reference, loss_rtol, rtol)?;
        if bit_identical && !same {
            return Err(format!("{l:?}: not bit-identical to the model uncut"));
        }
        Ok(())
    };
    for precision in [Precision::F32, Precision::Bf16] {
        for checkpointing in [Checkpointing::None, Checkpointing::Blocks] {
            for d in [1, 2] {
                let base = Layout::uncut(d, precision, checkpointing);
                let reference = run_layout(case, base)?;
                for p in [2, 4] {
                    for kind in [ScheduleKind::OneFOneB, ScheduleKind::GPipe] {
                        check(Layout { p, kind, ..base }, &reference)?;
                    }
                }
            }
        }
    }
    let base = Layout { zero: 1, ..Layout::uncut(2, Precision::F32, Checkpointing::None) };
    let reference = run_layout(case, base)?;
    check(Layout { p: 2, ..base }, &reference)
}

/// Tensor parallelism against uncut: T ∈ `ts` (P = 1, D = 1) ×
/// f32/bf16/f16 (dynamic loss scale) × checkpointing off/on; 3D (P = 2 ×
/// T = 2 × D = 2) and T = 2 × D = 2 at ZeRO-1 against uncut at D = 2; with
/// clipping always active, T = 2 and P = 2 × T = 2 at ZeRO-1 against uncut
/// (gradient norms compared too). f32 runs: three AdamW steps, losses
/// within `loss_rtol`, parameters within `rtol` (see [`check_pipeline`]).
/// 16-bit runs compare the first step ([`Layout::first_gradient`]): its
/// loss within `low.0` (relative) and each tensor's gradient within `low.1`
/// of that tensor's gradient norm (see [`FIRST_STEP_16BIT`]); later
/// steps are not compared there, since a parameter that moved by a rounding
/// difference rounds to a neighbouring 16-bit operand (2⁻⁸ relative in bf16)
/// and AdamW turns a gradient difference near its ε into a move of up to
/// lr. Returns the largest relative loss difference seen.
pub fn check_tensor_layouts<M: StagedModel<Batch = TokenBatch> + Send>(
    case: &PipelineCase<'_, M>,
    (loss_rtol, rtol): (f64, f32),
    low: (f64, f64),
    ts: &[usize],
) -> Result<f64, String> {
    let mut worst = 0.0f64;
    let whole = (case.model)(Precision::F32, Checkpointing::None, TpRank::WHOLE);
    let tensors: Vec<(String, std::ops::Range<usize>)> =
        whole.layout().tensors().iter().map(|t| (t.name.clone(), t.range())).collect();
    let mut check = |l: Layout, reference: &Run, tol: (f64, f32)| -> Result<(), String> {
        let run = run_layout(case, l)?;
        if l.first_gradient {
            compare_first_gradient(l, &run, reference, &case.init, &tensors, low)?;
        } else {
            compare(l, &run, reference, tol.0, tol.1)?;
        }
        for (a, b) in run.0.iter().zip(&reference.0) {
            worst = worst.max((a - b).abs() / b.abs().max(f64::MIN_POSITIVE));
        }
        Ok(())
    };
    for precision in [Precision::F32, Precision::Bf16, Precision::F16] {
        for checkpointing in [Checkpointing::None, Checkpointing::Blocks] {
            let base = Layout { first_gradient: precision.is_low(), ..Layout::uncut(1, precision, checkpointing) };
            let reference = run_layout(case, base)?;
            for &t in ts {
                check(Layout { t, ..base }, &reference, (loss_rtol, rtol))?;
            }
        }
    }
    let base = Layout::uncut(2, Precision::F32, Checkpointing::None);
    let reference = run_layout(case, base)?;
    check(Layout { p: 2, t: 2, ..base }, &reference, (loss_rtol, rtol))?;
    check(Layout { t: 2, zero: 1, ..base }, &reference, (loss_rtol, rtol))?;
    // Clipping always active: the global norm (each piece once) decides every update.
    let clipped = Layout { d: 1, clip: true, ..base };
    let reference = run_layout(case, clipped)?;
    check(Layout { t: 2, ..clipped }, &reference, (loss_rtol, rtol))?;
    check(Layout { p: 2, t: 2, zero: 1, ..clipped }, &reference, (loss_rtol, rtol))?;
    Ok(worst)
}

/// [`check_context_layouts`]'s tolerance for the first f32 gradient of a
/// layout that splits sequences (with the ring, or with something else: T,
/// P, D, ZeRO-1, the clipped step), per tensor and normwise beyond the
/// readout's rounding (see `compare_first_gradient`): 2e-4. Each gradient
/// element is the same f32 products summed in another order: within a
/// few units of 2⁻²⁴ (6e-8) of the sum of their magnitudes, which exceeds
/// the sum itself by the factor c by which the parts cancel (LoRA's
/// factors sum the parts of every position and rank: c ≈ 30 measured in
/// the tensor suite), so a few·6e-8·c ≈ 1e-5. The ring also rounds the
/// forward differently: each fold of a row's softmax moves the attention
/// output by 1–2 ulp (2e-7 relative measured in the kernel's test), and
/// the tiny Llama with LoRA on packed documents is ill-conditioned in it —
/// a pseudo-random 1-ulp perturbation of every attention output alone
/// moves its first gradient by 3.1e-5 normwise (measured), the ring by
/// 3.9e-5 at C 2; 2e-4 leaves a factor 2.5 over two ulp of that for other
/// CPUs' GEMM blocking. A defect (a rank's part missing or counted twice,
/// a position attending to the wrong keys) moves a tensor's gradient by
/// O(1e-2) or more. Measured on an AMD EPYC (Zen 3): 3.9e-5 (Llama with
/// LoRA, packed, ring), 8.0e-6 (Llama with LoRA), 7.3e-6 (Llama), 7.3e-8
/// (GPT-2). Three AdamW steps are not compared there: a gradient near ε
/// (1e-4) turns a rounding difference into a parameter move of up to lr,
/// and each further split reorders more sums (the same q_proj element of
/// the tiny GQA Llama moves 3.9e-6 at T 2, 4.8e-6 at C 2, 1.6e-5 at T 4
/// and 3.8e-5 at T 2 × C 2, against parameters of 1.7).
pub const FIRST_STEP_F32: f64 = 2e-4;

/// Context parallelism against uncut: C ∈ `cs` (P = T = 1, D = 1) ×
/// f32/bf16 × checkpointing off/on, and packed documents at each C: in
/// f32 attention as an all-gather runs three AdamW steps (losses within
/// `loss_rtol`, parameters within `rtol`; see [`check_pipeline`]) and as
/// a ring (the default) compares the first step (its loss within
/// `loss_rtol`, each tensor's gradient within [`FIRST_STEP_F32`]: the
/// ring's fold of each row's softmax over the blocks reorders the
/// forward's sums too, and AdamW near ε amplifies that past `rtol` —
/// 2.3e-5 on one tiny-Llama parameter of 0.14 after three steps at C 2,
/// from a first gradient 2.0e-6 off normwise, the all-gather's 8.4e-7);
/// in 16 bits the ring compares the first step (within `low`; see
/// [`check_tensor_layouts`]). C = 2 with D = 2, with
/// T = 2, with P = 2, at ZeRO-1 with D = 2, with clipping always active,
/// and the 4D layout D 2 × T 2 × P 2 × C 2 on 16 thread ranks compare the
/// first f32 step: its loss within `loss_rtol`, each tensor's gradient
/// within [`FIRST_STEP_F32`]. Returns the largest relative loss
/// difference and the largest normwise gradient difference seen.
pub fn check_context_layouts<M: StagedModel<Batch = TokenBatch> + Send>(
    case: &PipelineCase<'_, M>,
    (loss_rtol, rtol): (f64, f32),
    low: (f64, f64),
    cs: &[usize],
) -> Result<(f64, f64), String> {
    let (mut worst, mut worst_grad) = (0.0f64, 0.0f64);
    let whole = (case.model)(Precision::F32, Checkpointing::None, TpRank::WHOLE);
    let tensors: Vec<(String, std::ops::Range<usize>)> =
        whole.layout().tensors().iter().map(|t| (t.name.clone(), t.range())).collect();
    let mut check = |l: Layout, reference: &Run| -> Result<(), String> {
        let run = run_layout(case, l)?;
        match (l.first_gradient, l.precision.is_low()) {
            (true, true) => _ = compare_first_gradient(l, &run, reference, &case.init, &tensors, low)?,
            (true, false) => {
                let tol = (loss_rtol, FIRST_STEP_F32);
                worst_grad = worst_grad.max(compare_first_gradient(l, &run, reference, &case.init, &tensors, tol)?);
            }
            (false, _) => _ = compare(l, &run, reference, loss_rtol, rtol)?,
        }
        for (a, b) in run.0.iter().zip(&reference.0) {
            worst = worst.max((a - b).abs() / b.abs().max(f64::MIN_POSITIVE));
        }
        Ok(())
    };
    // The ring folds each row's softmax over the blocks in an order of its
    // own: in f32 its first gradient is compared, the all-gather's steps.
    let both = |base: Layout, check: &mut dyn FnMut(Layout, &Run) -> Result<(), String>| {
        let reference = run_layout(case, base)?;
        let first = Layout { first_gradient: true, ..base };
        let first_ref = if base.first_gradient { None } else { Some(run_layout(case, first)?) };
        for &c in cs {
            match &first_ref {
                Some(r) => {
                    check(Layout { c, attention: ContextAttention::AllGather, ..base }, &reference)?;
                    check(Layout { c, ..first }, r)?;
                }
                None => check(Layout { c, ..base }, &reference)?,
            }
        }
        Ok::<(), String>(())
    };
    for precision in [Precision::F32, Precision::Bf16] {
        for checkpointing in [Checkpointing::None, Checkpointing::Blocks] {
            let base = Layout { first_gradient: precision.is_low(), ..Layout::uncut(1, precision, checkpointing) };
            both(base, &mut check)?;
        }
    }
    both(Layout { packed: true, ..Layout::uncut(1, Precision::F32, Checkpointing::None) }, &mut check)?;
    let base = Layout { first_gradient: true, ..Layout::uncut(1, Precision::F32, Checkpointing::None) };
    let reference = run_layout(case, base)?;
    check(Layout { c: 2, t: 2, ..base }, &reference)?;
    check(Layout { c: 2, p: 2, ..base }, &reference)?;
    let base = Layout { d: 2, ..base };
    let reference = run_layout(case, base)?;
    check(Layout { c: 2, ..base }, &reference)?;
    check(Layout { c: 2, zero: 1, ..base }, &reference)?;
    check(Layout { c: 2, t: 2, p: 2, ..base }, &reference)?;
    let clipped = Layout { d: 1, clip: true, ..base };
    let reference = run_layout(case, clipped)?;
    check(Layout { c: 2, ..clipped }, &reference)?;
    Ok((worst, worst_grad))
}
