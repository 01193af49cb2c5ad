//! The memory model of a pipeline: the model's blocks cut into P stages
//! (`engine::pipeline::partition_layers`), each stage's model states counted
//! by the engine over the stage's own layout (`engine::PipelineStage`, the
//! one `Trainer::for_stage` allocates for), its activations for the
//! micro-batches its schedule keeps in flight, and the point-to-point
//! buffers between neighbouring stages. Ranks are laid out stage-major:
//! rank = stage · D + d for D = W / P data ranks per stage.

use super::Knobs;
use anyhow::{bail, Result};
use engine::pipeline::partition_layers;
use engine::{PipelineStage, Schedule, ScheduleKind, StageSpec, TokenBatch};
use family::LanguageModel;
use std::ops::Range;

/// Data ranks D = W / (P × T): the config's error when P × T does not
/// divide W, and an error at ZeRO stages 2–3, which neither a pipeline
/// (as in DeepSpeed) nor a tensor split composes with.
pub fn data_parallel(knobs: &Knobs) -> Result<usize> {
    let (w, p, t) = (knobs.world_size, knobs.pipeline_parallel, knobs.tensor_parallel);
    let dist = config::DistConfig { pipeline_parallel: p, tensor_parallel: t, ..Default::default() };
    let d = dist.data_parallel(w, "the planned world")?;
    if let Some(e) = engine::zero::composition_error(knobs.zero_stage, p, t) {
        bail!("{e}");
    }
    Ok(d)
}

/// What a pipeline needs of a model beyond its layout: its segments are
/// `[embedding, block 0, …, block L−1, head]`.
pub struct Stack {
    /// Blocks L.
    pub n_blocks: usize,
    /// Whether the head reads the embedding segment (tied embeddings: the
    /// last stage holds a copy).
    pub tied: bool,
    /// Elements per token of the activations passed between stages.
    pub width: usize,
    /// The tensor ranks a micro-batch's rows are split over between
    /// stages (sequence parallelism: T; otherwise 1).
    pub row_split: usize,
}

impl Stack {
    /// The stack of `model`, as it tells it.
    pub fn of(model: &dyn LanguageModel) -> Self {
        let (width, row_split) = residual_width(model);
        Stack { n_blocks: model.n_blocks(), tied: model.tied_head(), width, row_split }
    }
}

/// Elements per token of `model`'s residual stream and the ranks its rows
/// are split over (sequence parallelism: T, each rank holding ⌈rows / T⌉;
/// otherwise 1), from what the model passes between stages: T tokens,
/// one row on each rank when split, all T otherwise.
pub fn residual_width(model: &dyn LanguageModel) -> (usize, usize) {
    let tp = model.tensor_shards().map_or(engine::TpRank::WHOLE, |s| s.tp);
    let t = tp.size.max(1);
    let batch = TokenBatch { n_seqs: 1, seq_len: t, ..Default::default() };
    match tp.splits_seq() {
        true => (model.boundary_len(&batch), t),
        false => (model.boundary_len(&batch) / t, 1),
    }
}

/// Every stage of `model` cut into `stages` stages, evenly by layers or
/// `manual` (layers per stage; the errors are `partition_layers`'s), as the
/// trainer builds them (`PipelineStage::new`: the stage's own layout);
/// the model is left set to the last stage.
pub fn cut(
    model: &mut Box<dyn LanguageModel>,
    stack: &Stack,
    stages: usize,
    kind: ScheduleKind,
    manual: Option<&[usize]>,
) -> Result<Vec<PipelineStage>> {
    let cuts = partition_layers(stack.n_blocks, stages, manual)?;
    Ok((0..stages).map(|s| PipelineStage::new(model, &cuts, s, kind, 1)).collect::<Result<_, _>>()?)
}

/// Each stage's spec for `k` micro-batches per step: its blocks and the
/// activation slots its schedule needs (1F1B: min(P − s, K); GPipe: K).
pub fn specs(knobs: &Knobs, blocks: &[Range<usize>], k: usize) -> Result<(Vec<StageSpec>, Schedule)> {
    let p = blocks.len();
    let schedule = Schedule::new(knobs.pipeline_schedule, p, k.max(1))?;
    let specs = blocks
        .iter()
        .enumerate()
        .map(|(s, b)| StageSpec { stage: s, n_stages: p, blocks: b.clone(), in_flight: schedule.stages[s].in_flight })
        .collect();
    Ok((specs, schedule))
}

/// Bytes of the point-to-point buffers of `spec`'s stage for micro-batches
/// of `tokens` tokens: the received input and the sent output's gradient
/// (not on the first stage), the output and the received output gradient
/// (not on the last), one `tokens × width` f32 buffer each; and with a tied
/// embedding the other end's embedding gradient on the first and the last
/// stage (`embedding` elements).
pub fn p2p_bytes(spec: &StageSpec, stack: &Stack, tokens: usize, embedding: usize) -> u64 {
    if spec.n_stages == 1 {
        return 0;
    }
    let boundary = 4 * engine::tensor::seq_block(tokens, stack.row_split) as u64 * stack.width as u64;
    let buffers = 2 * u64::from(!spec.is_first()) + 2 * u64::from(!spec.is_last());
    let tied = stack.tied && (spec.is_first() || spec.is_last());
    buffers * boundary + if tied { 4 * embedding as u64 } else { 0 }
}

#[cfg(test)]
mod tests {
    use super::super::measure::{measure, plan};
    use super::super::{estimate_at, stage_estimates, stage_states, Estimate};
    use super::*;
    use crate::setup::Plan;
    use engine::ScheduleKind;

    fn knobs(plan: &Plan, p: usize, kind: ScheduleKind) -> Knobs {
        Knobs { pipeline_parallel: p, pipeline_schedule: kind, ..Knobs::of(plan) }
    }

    /// Every stage's estimate.
    fn stages(plan: &Plan, k: Knobs, layers: Option<&[usize]>) -> Vec<Estimate> {
        let states = stage_states(plan, k, layers).unwrap();
        stage_estimates(plan, k, &states).unwrap().0
    }

    /// Elements of the embedding segment (the tied copy the last stage holds).
    fn embedding_params(plan: &Plan) -> u64 {
        let model = plan.family.build(Default::default()).unwrap();
        model.segments()[0].len() as u64
    }

    #[test]
    fn stage_parameters_sum_to_the_model_plus_the_tied_copy() {
        for (sets, tied) in [
            (&["model.preset=mini"][..], true),
            (&["model.family=llama", "model.preset=tiny", "model.n_layer=4"][..], true),
            (
                &["model.family=llama", "model.preset=tiny", "model.n_layer=4", "model.tie_word_embeddings=false"][..],
                false,
            ),
        ] {
            let pl = plan(&[sets, &["batch.global=16", "batch.micro=1"]].concat(), 4);
            let n = pl.family.n_params() as u64;
            let copy = if tied { embedding_params(&pl) } else { 0 };
            let whole = stages(&pl, knobs(&pl, 1, ScheduleKind::OneFOneB), None);
            assert_eq!(whole.len(), 1);
            assert_eq!(whole[0].stage_params, n, "{sets:?}");
            for p in [2, 4] {
                let st = stages(&pl, knobs(&pl, p, ScheduleKind::OneFOneB), None);
                assert_eq!(st.len(), p);
                let sum: u64 = st.iter().map(|e| e.stage_params).sum();
                assert_eq!(sum, n + copy, "{sets:?} P = {p}");
                // f32, ZeRO 0: parameters and gradients of every stage add up the same way.
                assert_eq!(st.iter().map(|e| e.params).sum::<u64>(), 4 * (n + copy), "{sets:?} P = {p}");
                assert_eq!(st.iter().map(|e| e.grads).sum::<u64>(), 4 * (n + copy), "{sets:?} P = {p}");
                // The blocks are cut back to back, the first stages taking the remainder.
                assert_eq!(st[0].blocks.0, 0);
                for w in st.windows(2) {
                    assert_eq!(w[0].blocks.1, w[1].blocks.0);
                    assert!(w[0].blocks.1 - w[0].blocks.0 >= w[1].blocks.1 - w[1].blocks.0);
                }
            }
        }
    }

    #[test]
    fn zero_1_shards_each_stages_optimizer_state_over_its_data_ranks() {
        let pl = plan(&["model.preset=mini", "batch.global=16", "batch.micro=1"], 4);
        let k = knobs(&pl, 2, ScheduleKind::OneFOneB);
        let (z0, z1) = (stages(&pl, k, None), stages(&pl, Knobs { zero_stage: 1, ..k }, None));
        for (a, b) in z0.iter().zip(&z1) {
            // D = 2: half of the stage's AdamW state, up to the padding of its segments.
            let half = a.optimizer / 2;
            assert!(b.optimizer >= half && b.optimizer < half + 8 * 2 * 8, "{} vs {}", b.optimizer, a.optimizer);
            assert_eq!((a.params, a.grads), (b.params, b.grads));
        }
    }

    #[test]
    fn in_flight_follows_the_schedule_and_activations_the_family() {
        let pl = plan(&["model.preset=mini", "batch.global=8", "batch.micro=1"], 4);
        let seq = pl.train.seq_len();
        for (kind, want) in [(ScheduleKind::OneFOneB, [4, 3, 2, 1]), (ScheduleKind::GPipe, [8, 8, 8, 8])] {
            // P = 4 × D = 1: K = 8 micro-batches per step.
            let k = knobs(&pl, 4, kind);
            let st = stages(&pl, k, Some(&[2, 2, 1, 1]));
            let flight: Vec<usize> = st.iter().map(|e| e.in_flight).collect();
            assert_eq!(flight, want, "{kind}");
            for e in &st {
                assert_eq!(e.accumulation_steps, 8);
                let spec =
                    StageSpec { stage: e.stage, n_stages: 4, blocks: e.blocks.0..e.blocks.1, in_flight: e.in_flight };
                let build = family::Build { precision: k.precision, checkpointing: k.checkpointing, whole_len: None };
                let want = pl.family.stage_activation_bytes(1, seq, build, &spec);
                assert_eq!(e.activations as u128, want, "{kind} stage {}", e.stage);
            }
        }
        // 1F1B against GPipe on stage 0: P / K of the activations (4 of 8 micro-batches).
        let f = stages(&pl, knobs(&pl, 4, ScheduleKind::OneFOneB), None);
        let g = stages(&pl, knobs(&pl, 4, ScheduleKind::GPipe), None);
        let ratio = f[0].activations as f64 / g[0].activations as f64;
        assert!((ratio - 0.5).abs() < 0.05, "1F1B / GPipe on stage 0: {ratio}");
    }

    #[test]
    fn the_peak_is_the_largest_stage_and_middle_stages_send_and_receive() {
        let pl = plan(&["model.preset=mini", "batch.global=8", "batch.micro=1"], 4);
        let k = Knobs {
            ranks_per_process: 1,
            backend: super::super::Backend::Mpi,
            ..knobs(&pl, 4, ScheduleKind::OneFOneB)
        };
        let states = stage_states(&pl, k, None).unwrap();
        let (st, schedule) = stage_estimates(&pl, k, &states).unwrap();
        let peak = estimate_at(&pl, k, &states).unwrap();
        assert_eq!(peak.per_process(), st.iter().map(Estimate::per_process).max().unwrap());
        assert_eq!(st[peak.stage], peak);
        let schedule = schedule.unwrap();
        assert!((schedule.bubble_fraction() - 3.0 / 11.0).abs() < 1e-12);
        // One rank per process: no other rank's bytes; inner stages hold twice the boundary buffers.
        assert!(st.iter().all(|e| e.other_ranks == 0));
        let boundary = 4 * pl.train.seq_len() as u64 * 384;
        let tied = 4 * embedding_params(&pl);
        assert_eq!(
            [st[0].p2p, st[1].p2p, st[2].p2p, st[3].p2p],
            [2 * boundary + tied, 4 * boundary, 4 * boundary, 2 * boundary + tied]
        );
    }

    #[test]
    fn thread_ranks_of_every_stage_share_one_process() {
        let pl = plan(&["model.preset=mini", "batch.global=8", "batch.micro=1"], 4);
        let k = knobs(&pl, 2, ScheduleKind::OneFOneB);
        let st = stages(&pl, k, None);
        let all: u64 = st.iter().map(|e| 2 * e.per_rank()).sum();
        for e in &st {
            assert_eq!(e.per_rank() + e.other_ranks, all, "stage {}", e.stage);
        }
    }

    #[test]
    fn bad_pipelines_are_errors() {
        let pl = plan(&["model.preset=mini", "batch.global=12", "batch.micro=1"], 6);
        let err = |k: Knobs, layers: Option<&[usize]>| {
            stage_states(&pl, k, layers).err().map(|e| e.to_string()).unwrap_or_default()
        };
        let k = knobs(&pl, 4, ScheduleKind::OneFOneB);
        assert!(
            err(k, None).contains("dist.pipeline_parallel = 4") && err(k, None).contains("world size 6"),
            "{}",
            err(k, None)
        );
        let k = knobs(&pl, 6, ScheduleKind::OneFOneB);
        assert!(err(Knobs { world_size: 12, ..k }, None).is_empty());
        let e = err(Knobs { world_size: 7, pipeline_parallel: 7, ..k }, None);
        assert!(e.contains("7 stages") && e.contains("6 layers"), "{e}");
        let e = err(knobs(&pl, 2, ScheduleKind::GPipe), Some(&[2, 3]));
        assert!(e.contains("pipeline_layers") && e.contains("6 layers"), "{e}");
        let e = err(Knobs { zero_stage: 2, ..knobs(&pl, 2, ScheduleKind::GPipe) }, None);
        assert!(
            e.contains("ZeRO stage 2") && e.contains("does not compose") && e.contains("dist.zero_stage = 1"),
            "{e}"
        );
    }

    #[test]
    fn measured_rank_peaks_match_the_plan_and_1f1b_keeps_p_of_gpipes_k() {
        let (k, micro) = (8, 1);
        let pl = plan(&["model.preset=mini", "batch.global=8", "batch.micro=1", "data.seq_len=128"], 4);
        let seq = pl.train.seq_len();
        for p in [2, 4] {
            let kn = Knobs { world_size: p, ranks_per_process: p, ..knobs(&pl, p, ScheduleKind::OneFOneB) };
            let planned = stages(&pl, kn, None);
            let measured = measure(&pl, p, 1, ScheduleKind::OneFOneB, k, micro);
            for (e, m) in planned.iter().zip(&measured) {
                let (peak, act) = (&m.peak, &m.activations);
                // With one rank per stage, each rank is the last to arrive
                // at its data-parallel group's collectives and allocates the
                // group's result (the process's shared staging) itself.
                let want = e.per_rank() + e.comm_staging;
                let err = *peak as f64 / want as f64 - 1.0;
                eprintln!(
                    "P = {p} stage {}: planned {want} B per rank ({} activations), measured heap peak {peak} ({act} activations), {:+.1}%",
                    e.stage,
                    e.activations,
                    100.0 * err
                );
                assert_eq!(*act, e.activations, "P = {p} stage {}: the model allocates what the family plans", e.stage);
                assert!(err.abs() < 0.10, "P = {p} stage {}: measured {peak} vs planned {want}", e.stage);
            }
        }
        // Stage 0 of 4 at K = 8: 1F1B keeps P = 4 micro-batches, GPipe all K = 8.
        let f = measure(&pl, 4, 1, ScheduleKind::OneFOneB, k, micro);
        let g = measure(&pl, 4, 1, ScheduleKind::GPipe, k, micro);
        let ratio = f[0].activations as f64 / g[0].activations as f64;
        eprintln!(
            "stage 0 activations at P = 4, K = 8 (seq {seq}): 1F1B {} B, GPipe {} B, ratio {ratio:.4}",
            f[0].activations, g[0].activations
        );
        assert!((ratio - 4.0 / 8.0).abs() < 0.02, "1F1B / GPipe on stage 0: {ratio}");
    }
}
