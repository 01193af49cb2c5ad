//! The memory model of tensor parallelism: each of a group's T ranks holds
//! the shape `Family::tensor_parallel` gives it — the split matrices
//! (attention heads, MLP columns) / T, the replicated tensors (embeddings,
//! norms, biases after a reduction) whole — so its model states are counted by the engine over that
//! shape's layout and its activations by that shape's family. On top, the
//! tensor-parallel group's communicator stages the largest all-reduce
//! inside the model: a micro-batch's residual stream (tokens × width, after
//! each row-parallel product and before each column-parallel input
//! gradient) or, at the step boundary, the partial gradients (tensors
//! several ranks hold and feed from their own heads: grouped-query
//! key/value heads fewer than T, replicated ones). The world is P × D × T ranks, tensor
//! innermost: rank = s·(D·T) + d·T + t. Every tensor rank holds the same
//! shape (the splits are even), so one rank stands for its group.

use super::Knobs;
use crate::setup::{tensor_family, Plan};
use anyhow::Result;
use engine::TpRank;
use family::{Family, LanguageModel};
use std::sync::Arc;

/// The shape one tensor-parallel rank of `knobs` holds (the whole
/// family's without a split); the family's error names what cannot split.
pub fn rank_family(plan: &Plan, knobs: &Knobs) -> Result<Arc<dyn Family>> {
    match knobs.tensor_parallel {
        0 | 1 => Ok(plan.family.clone()),
        t => tensor_family(
            plan.family.as_ref(),
            TpRank::new(0, t).with_vocab(knobs.vocab_parallel).with_seq(knobs.sequence_parallel),
        ),
    }
}

/// What a tensor-parallel rank's model reduces over its group, per step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Traffic {
    /// Elements per token of the residual stream the model all-reduces
    /// after each row-parallel product (and the input gradient before
    /// each column-parallel one).
    pub width: usize,
    /// Elements of the one all-reduce at the step boundary that sums the
    /// gradients each rank holds a part of ([`engine::Shard::partial_gradient`]:
    /// replicated tensors fed by a rank's own heads, key/value heads shared
    /// by several ranks): each such trainable tensor whole, a shared piece
    /// placed in zeros at its place.
    pub partial: usize,
    /// Elements per token of the vocab-parallel loss's statistics
    /// all-reduce (`nn::loss_terms::SPLIT_STATS` per rank; 0 with the
    /// vocabulary whole).
    pub vocab_stats: usize,
}

impl Traffic {
    /// The traffic of a rank's `model` (none without a split).
    pub fn of(model: &dyn LanguageModel) -> Option<Self> {
        let shards = model.tensor_shards().filter(|s| s.tp.is_split())?;
        let partial = (shards.local.tensors().iter().zip(shards.full.tensors()))
            .zip(&shards.shards)
            .filter(|((local, _), s)| local.trainable && s.partial_gradient(shards.tp))
            .map(|((_, whole), _)| whole.numel())
            .sum();
        let vocab_stats = if shards.tp.splits_vocab() { nn::loss_terms::SPLIT_STATS * shards.tp.size } else { 0 };
        // Every row's width: an all-reduce, or an all-gather's result, of the whole micro-batch.
        let (width, _) = super::pipeline::residual_width(model);
        Some(Traffic { width, partial, vocab_stats })
    }

    /// Elements of the largest all-reduce over the group for micro-batches
    /// of `tokens` tokens (a vocab-parallel head's statistics of one chunk
    /// of rows are at most those of all of them).
    pub fn max_elems(&self, tokens: usize) -> usize {
        (tokens * self.width.max(self.vocab_stats)).max(self.partial)
    }

    /// Bytes a rank holds for the group's collectives besides the model's
    /// own buffers: the communicator's staging of the largest all-reduce
    /// (`per_elem` bytes an element: 8 for thread ranks' f64 slot, 4 for
    /// MPI's f32 buffer, 0 alone) and, at the boundary, the f32 buffer the
    /// partial gradients are packed into.
    pub fn staging_bytes(&self, tokens: usize, per_elem: u64) -> u64 {
        match per_elem {
            0 => 0,
            _ => per_elem * self.max_elems(tokens) as u64 + 4 * self.partial as u64,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::measure::{measure, measure_grid, plan};
    use super::super::tensor_shapes::{GPT, LLAMA};
    use super::super::{stage_estimates, stage_states, Estimate};
    use super::*;
    use engine::ScheduleKind;

    /// Thread ranks: `t` tensor × `p` pipeline × the rest data ranks.
    fn knobs(pl: &Plan, t: usize, p: usize) -> Knobs {
        Knobs { tensor_parallel: t, pipeline_parallel: p, pipeline_schedule: ScheduleKind::OneFOneB, ..Knobs::of(pl) }
    }

    fn stages(pl: &Plan, k: Knobs) -> Result<Vec<Estimate>> {
        Ok(stage_estimates(pl, k, &stage_states(pl, k, None)?)?.0)
    }

    #[test]
    fn a_tensor_rank_holds_the_split_tensors_over_t_and_the_replicated_whole() {
        let pl = plan(&[GPT, &["batch.global=8", "batch.micro=1"]].concat(), 4);
        let per_rank = |t: usize| stages(&pl, knobs(&pl, t, 1)).unwrap()[0];
        let (r1, r2, r4) = (per_rank(1), per_rank(2), per_rank(4));
        assert_eq!(r1.stage_params as u128, pl.family.n_params());
        // n = R + S (replicated, split): a rank holds R + S / T, so halving
        // the slices again saves half of what the first split saved.
        let (s1, s2, s4) = (r1.stage_params, r2.stage_params, r4.stage_params);
        assert!(s1 > s2 && s2 > s4, "{s1} {s2} {s4}");
        assert_eq!(s1 - s2, 2 * (s2 - s4), "{s1} {s2} {s4}");
        // Model states follow the parameters (f32, ZeRO 0: 4 + 4 + 8 bytes each).
        for e in [r1, r2, r4] {
            assert_eq!(e.params + e.grads + e.optimizer, 16 * e.stage_params);
        }
        // Activations: heads and MLP columns / T, the residual stream whole.
        assert!(r2.activations < r1.activations && r4.activations < r2.activations);
        assert!(2 * r2.activations > r1.activations, "the residual stream is not split");
        // T = 4 × D = 1: the tensor group stages a micro-batch's residual stream.
        assert_eq!(r4.knobs.data_parallel(), 1);
        assert_eq!(r4.tp_staging, 8 * 128 * 512);
        assert_eq!(r1.tp_staging, 0);
    }

    #[test]
    fn key_value_heads_shared_by_several_ranks_have_partial_gradients() {
        let pl = plan(&[LLAMA, &["batch.global=8", "batch.micro=1"]].concat(), 4);
        let states = |t: usize| stage_states(&pl, knobs(&pl, t, 1), None).unwrap();
        // T = 2: one of the 2 key/value heads per rank; T = 4: each head on
        // 2 ranks, its gradient in parts summed over them.
        assert_eq!(states(2).traffic.map(|t| t.partial), Some(0));
        let four = states(4).traffic.unwrap();
        // k and v of 4 layers, [2 heads × 96, 384] whole (each rank's head
        // placed in zeros), trainable.
        assert_eq!(four.partial, 4 * 2 * 2 * 96 * 384);
        assert_eq!(four.width, 384);
    }

    /// With the vocabulary split a rank holds V / T rows of the embedding
    /// and the head and a chunk of logits over V / T columns; the rest of
    /// its shape is the one it holds with the vocabulary whole.
    #[test]
    fn a_vocab_parallel_rank_holds_a_slice_of_the_embedding_and_the_head() {
        let with = |vocab: bool| {
            plan(&[LLAMA, &["batch.global=8", "batch.micro=1", &format!("dist.vocab_parallel={vocab}")]].concat(), 4)
        };
        let (whole, split) = (with(false), with(true));
        let rank = |pl: &Plan, t: usize| stages(pl, knobs(pl, t, 1)).unwrap()[0];
        let (v, c) = (whole.family.vocab_size() as u64, 384u64);
        for t in [2u64, 4] {
            let (w, s) = (rank(&whole, t as usize), rank(&split, t as usize));
            // The embedding (the `tiny` preset ties the head to it): V · C whole, V · C / T split.
            assert_eq!(w.stage_params - s.stage_params, v * c - v * c / t, "T = {t}");
            assert!(s.activations < w.activations, "T = {t}: the logits' chunk is over V / T");
            let stats = rank(&split, t as usize);
            assert_eq!(stats.tp_staging, w.tp_staging, "T = {t}: the statistics' all-reduce is the smaller");
        }
    }

    #[test]
    fn bad_grids_are_errors_naming_the_key() {
        let pl = plan(&["model.preset=mini", "batch.global=12", "batch.micro=1"], 6);
        let err = |k: Knobs| stages(&pl, k).err().map(|e| format!("{e:#}")).unwrap_or_default();
        // 6 heads: T = 4 does not divide them (the family's error).
        let e = err(Knobs { world_size: 4, ..knobs(&pl, 4, 1) });
        assert!(e.contains("n_head") || e.contains("heads"), "{e}");
        let e = err(knobs(&pl, 2, 2));
        assert!(e.contains("dist.tensor_parallel = 2") && e.contains("world size 6"), "{e}");
        let e = err(Knobs { zero_stage: 2, ..knobs(&pl, 2, 1) });
        assert!(e.contains("ZeRO stage 2") && e.contains("tensor parallelism"), "{e}");
        assert!(err(knobs(&pl, 3, 1)).is_empty() && err(knobs(&pl, 2, 3)).is_empty());
    }

    /// Every rank's heap peak over its build and first step against its
    /// plan, the vocabulary whole and split (`dist.vocab_parallel`: the
    /// embedding, head and one chunk of logits over V / T), with and
    /// without sequence parallelism (`dist.sequence_parallel`: the
    /// residual stream's tensors over B·T / T rows, the gathered inputs'
    /// and outputs' working buffers over all of them).
    #[test]
    fn measured_rank_peaks_match_the_plan_at_t_2_and_4() {
        for (name, sets, vocab, seq) in [
            ("Llama", LLAMA, false, false),
            ("GPT-2", GPT, false, false),
            ("Llama", LLAMA, true, false),
            ("GPT-2", GPT, true, false),
            ("Llama", LLAMA, false, true),
            ("GPT-2", GPT, true, true),
        ] {
            let name = match (vocab, seq) {
                (true, true) => format!("{name}, vocabulary and sequence split"),
                (true, false) => format!("{name}, vocabulary split"),
                (false, true) => format!("{name}, sequence split"),
                (false, false) => name.to_string(),
            };
            for (t, p) in [(2, 1), (4, 1), (2, 2)] {
                // One data rank: K = 2 micro-batches per step.
                let world = t * p;
                let (vp, sp) = (format!("dist.vocab_parallel={vocab}"), format!("dist.sequence_parallel={seq}"));
                let global = format!("batch.global={}", 2 * world);
                let sets = [sets, &[&global, "batch.micro=1", &vp, &sp]].concat();
                let pl = plan(&sets, world);
                let kn = Knobs { world_size: world, ranks_per_process: world, ..knobs(&pl, t, p) };
                let planned = stages(&pl, kn).unwrap();
                let k = planned[0].accumulation_steps;
                let measured = measure(&pl, p, t, ScheduleKind::OneFOneB, k, 1);
                for (r, m) in measured.iter().enumerate() {
                    let e = &planned[r / t];
                    // Each rank is alone in its data-parallel group and
                    // allocates the group's collective result itself.
                    let want = e.per_rank() + e.comm_staging;
                    let err = m.peak as f64 / want as f64 - 1.0;
                    eprintln!(
                        "{name} T = {t} P = {p} rank {r}: planned {want} B ({} activations, {} tensor staging), measured heap peak {} ({} activations), {:+.1}%",
                        e.activations,
                        e.tp_staging,
                        m.peak,
                        m.activations,
                        100.0 * err
                    );
                    assert_eq!(m.activations, e.activations, "{name} T = {t} P = {p} rank {r}: activations");
                    assert!(err.abs() < 0.10, "{name} T = {t} P = {p} rank {r}: measured {} vs planned {want}", m.peak);
                }
            }
        }
    }

    /// Context parallelism: each rank's activations are those of its
    /// positions of each sequence (`Knobs::rank_positions`), to the byte;
    /// its heap peak adds attention's per-layer working buffers of the
    /// whole sequences (the gathered keys and values, in backward the
    /// outputs and their gradients), which the plan does not count.
    #[test]
    fn measured_rank_peaks_match_the_plan_with_context_ranks() {
        for (name, sets) in [("Llama", LLAMA), ("GPT-2", GPT)] {
            for (c, t) in [(2, 1), (4, 1), (2, 2)] {
                let world = c * t;
                let (global, cp) = (format!("batch.global={}", 2 * c), format!("dist.context_parallel={c}"));
                let sets = [sets, &[&global, "batch.micro=1", &cp]].concat();
                let pl = plan(&sets, world);
                let kn = Knobs { world_size: world, ranks_per_process: world, ..knobs(&pl, t, 1) };
                let planned = stages(&pl, kn).unwrap();
                let e = &planned[0];
                let measured = measure_grid(&pl, (1, c, t), ScheduleKind::OneFOneB, e.accumulation_steps, 1);
                let whole = stages(&pl, Knobs { context_parallel: 1, world_size: t, ranks_per_process: t, ..kn });
                let whole = whole.unwrap()[0].activations;
                for (r, m) in measured.iter().enumerate() {
                    let want = e.per_rank() + e.comm_staging;
                    let err = m.peak as f64 / want as f64 - 1.0;
                    eprintln!(
                        "{name} C = {c} T = {t} rank {r}: planned {want} B ({} activations; {whole} at one context rank), measured heap peak {} ({} activations), {:+.1}%",
                        e.activations, m.peak, m.activations, 100.0 * err
                    );
                    assert_eq!(m.activations, e.activations, "{name} C = {c} T = {t} rank {r}: activations");
                }
                assert!(2 * e.activations < whole + whole / 4, "{name} C = {c}: activations split about C ways");
            }
        }
    }
}
