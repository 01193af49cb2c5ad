//! Direct Preference Optimization (Rafailov et al. 2023) over any
//! [`LanguageModel`] with LoRA adapters: the policy is the adapted model,
//! the reference is the same model with its adapters off — every
//! `lora_B` tensor read as zeros, so each adapter adds exactly nothing —
//! and no second copy of the base is held.
//!
//! A micro-batch holds pairs as consecutive rows `[chosen₀, rejected₀,
//! chosen₁, rejected₁, …]`, each row the prompt (targets ignored) and one
//! reply (targets counted). For pair `i`, with `π(y)` the summed log
//! probability of reply `y`'s target tokens under the policy and `ρ(y)`
//! under the reference:
//!
//! ```text
//! Δ = (π(c) − ρ(c)) − (π(r) − ρ(r)),   loss = −log σ(β·Δ) = softplus(−β·Δ)
//! ```
//!
//! TRL's `DPOTrainer` (`loss_type = "sigmoid"`, no label smoothing). Its
//! gradient is `w·∇CE(c) − w·∇CE(r)` with `w = β·σ(−β·Δ)` and `CE(y) =
//! −π(y)` the summed cross-entropy the wrapped model already differentiates,
//! so each row runs the model's own backward with its loss seed scaled by
//! `±w`. The pair counts as one target: the engine's token normalisation
//! then averages the loss over the pairs of the whole global batch, so
//! `micro 1 × K 32` and `micro 32 × K 1` take the same step.
//!
//! Each row is cut after its last target before it runs (causal attention:
//! the positions after it change nothing), so a pair's numbers do not
//! depend on which other rows share its micro-batch.
//!
//! Cost per pair: two reference forwards, two policy forwards (for `w`)
//! and two forward + backward passes.

use crate::{LanguageModel, ModelError, TextModel};
use engine::{
    AuxStats, EngineError, GradSpace, MicroStepStats, Model, ParamLayout, ParamStore, SegmentGrads, SegmentView,
    StageSpec, StagedModel, TensorSpec, TokenBatch, AUX_STATS,
};
use std::ops::Range;

/// [`AuxStats`] slot: the sum of `β·(π(c) − ρ(c))` (TRL's `rewards/chosen`).
pub const AUX_CHOSEN_REWARD: usize = 0;
/// [`AuxStats`] slot: the sum of `β·(π(r) − ρ(r))` (TRL's `rewards/rejected`).
pub const AUX_REJECTED_REWARD: usize = 1;
/// [`AuxStats`] slot: pairs whose chosen reward beats the rejected one
/// (TRL's `rewards/accuracies`, as a count).
pub const AUX_CORRECT: usize = 2;

/// The name suffix of the tensors that the reference reads as zeros.
pub const ADAPTER_OFF_SUFFIX: &str = ".lora_B.weight";

/// A language model trained with the DPO objective (see the module docs).
pub struct Dpo {
    inner: Box<dyn LanguageModel>,
    beta: f32,
    /// Per segment, the element ranges (relative to the segment) read as
    /// zeros by the reference.
    off: Vec<Vec<Range<usize>>>,
    /// The reference's copy of the segment being read.
    buf: Vec<f32>,
    aux: AuxStats,
}

impl Dpo {
    /// Wraps `inner` (whose layout must hold LoRA adapters: tensors named
    /// `….lora_B.weight`) with inverse temperature `beta`.
    pub fn new(inner: Box<dyn LanguageModel>, beta: f32) -> Result<Self, ModelError> {
        if !(beta.is_finite() && beta > 0.0) {
            return Err(format!("train.dpo_beta = {beta} must be a positive number (TRL's default is 0.1)").into());
        }
        let space = GradSpace::new(inner.layout(), inner.segments()).map_err(ModelError::new)?;
        let tensors = inner.layout().tensors();
        let off: Vec<Vec<Range<usize>>> = space
            .tensors
            .iter()
            .map(|seg| {
                seg.iter()
                    .filter(|t| tensors[t.idx].name.ends_with(ADAPTER_OFF_SUFFIX))
                    .map(|t| t.rel.clone())
                    .collect()
            })
            .collect();
        if off.iter().all(Vec::is_empty) {
            return Err(
                "train.objective = \"dpo\" needs LoRA adapters (a [lora] section): the reference model is the policy with its adapters off".into(),
            );
        }
        Ok(Self { inner, beta, off, buf: Vec::new(), aux: [0.0; AUX_STATS] })
    }

    /// The wrapped model.
    pub fn inner(&self) -> &dyn LanguageModel {
        self.inner.as_ref()
    }

    /// Runs every pair of `batch`: the loss sum over its pairs and, with a
    /// `loss_seed`, the gradient of that sum times the seed.
    fn pairs(
        &mut self,
        store: &mut dyn ParamStore,
        batch: &TokenBatch,
        loss_seed: Option<f32>,
    ) -> Result<MicroStepStats, ModelError> {
        let rows = pair_rows(batch)?;
        let beta = self.beta as f64;
        let mut loss_sum = 0.0;
        for pair in rows.chunks_exact(2) {
            let (c, r) = (&pair[0], &pair[1]);
            let mut reference = AdaptersOff { inner: &mut *store, off: &self.off, buf: &mut self.buf };
            let ref_c = -self.inner.loss(&mut reference, c)?.loss_sum;
            let ref_r = -self.inner.loss(&mut reference, r)?.loss_sum;
            let pol_c = -self.inner.loss(store, c)?.loss_sum;
            let pol_r = -self.inner.loss(store, r)?.loss_sum;
            let (reward_c, reward_r) = (beta * (pol_c - ref_c), beta * (pol_r - ref_r));
            let z = reward_c - reward_r;
            loss_sum += softplus(-z);
            self.aux[AUX_CHOSEN_REWARD] += reward_c;
            self.aux[AUX_REJECTED_REWARD] += reward_r;
            self.aux[AUX_CORRECT] += f64::from(u8::from(z > 0.0));
            if let Some(seed) = loss_seed {
                // ∂loss/∂CE(c) = β·σ(−z), ∂loss/∂CE(r) = −β·σ(−z).
                let w = (beta * sigmoid(-z)) as f32;
                self.inner.micro_step(store, c, seed * w)?;
                self.inner.micro_step(store, r, -(seed * w))?;
            }
        }
        Ok(MicroStepStats { loss_sum, n_targets: (rows.len() / 2) as u64, ..MicroStepStats::default() })
    }
}

/// `log(1 + e^x)` without overflow.
fn softplus(x: f64) -> f64 {
    x.max(0.0) + (-x.abs()).exp().ln_1p()
}

/// `1 / (1 + e^−x)` without overflow.
fn sigmoid(x: f64) -> f64 {
    if x >= 0.0 {
        1.0 / (1.0 + (-x).exp())
    } else {
        let e = x.exp();
        e / (1.0 + e)
    }
}

/// The rows of a pair batch, each cut after its last target. An error
/// for an odd row count, packed rows, or a row without targets.
pub fn pair_rows(batch: &TokenBatch) -> Result<Vec<TokenBatch>, ModelError> {
    let (b, t) = (batch.n_seqs, batch.seq_len);
    if !b.is_multiple_of(2) {
        return Err(format!("a preference micro-batch holds (chosen, rejected) row pairs; got {b} rows").into());
    }
    if !batch.positions.is_empty() {
        return Err("preference pairs cannot be packed (set data.pack = false)".into());
    }
    (0..b)
        .map(|j| {
            let targets = &batch.targets[j * t..(j + 1) * t];
            let Some(last) = targets.iter().rposition(|&x| x >= 0) else {
                let which = if j % 2 == 0 { "chosen" } else { "rejected" };
                return Err(format!("pair {} of the micro-batch: the {which} reply has no target token", j / 2).into());
            };
            let n = last + 1;
            Ok(TokenBatch {
                n_seqs: 1,
                seq_len: n,
                inputs: batch.inputs[j * t..j * t + n].to_vec(),
                targets: targets[..n].to_vec(),
                positions: Vec::new(),
            })
        })
        .collect()
}

/// A read-only view of another store with the adapters' `lora_B` tensors
/// read as zeros: the base model, exactly.
struct AdaptersOff<'s> {
    inner: &'s mut dyn ParamStore,
    off: &'s [Vec<Range<usize>>],
    buf: &'s mut Vec<f32>,
}

impl ParamStore for AdaptersOff<'_> {
    fn segment(&mut self, seg: usize) -> Result<SegmentView<'_>, EngineError> {
        let view = self.inner.segment(seg)?;
        self.buf.clear();
        self.buf.extend_from_slice(view.params);
        for r in self.off.get(seg).into_iter().flatten() {
            self.buf[r.clone()].fill(0.0);
        }
        Ok(SegmentView { params: &self.buf[..], grads: SegmentGrads::none(), tp: view.tp })
    }

    fn done(&mut self, seg: usize, _backward: bool) -> Result<(), EngineError> {
        self.inner.done(seg, false)
    }
}

impl Model for Dpo {
    type Batch = TokenBatch;
    type Error = ModelError;

    fn layout(&self) -> &ParamLayout {
        self.inner.layout()
    }

    fn set_trainable(&mut self, trainable: &dyn Fn(&TensorSpec) -> bool) -> usize {
        self.inner.set_trainable(trainable)
    }

    fn segments(&self) -> Vec<Range<usize>> {
        self.inner.segments()
    }

    /// One target per pair.
    fn n_targets(&self, batch: &TokenBatch) -> u64 {
        (batch.n_seqs / 2) as u64
    }

    fn micro_step(
        &mut self,
        store: &mut dyn ParamStore,
        batch: &TokenBatch,
        loss_seed: f32,
    ) -> Result<MicroStepStats, ModelError> {
        self.pairs(store, batch, Some(loss_seed))
    }

    fn loss(&mut self, store: &mut dyn ParamStore, batch: &TokenBatch) -> Result<MicroStepStats, ModelError> {
        self.pairs(store, batch, None)
    }

    fn take_aux_stats(&mut self) -> AuxStats {
        std::mem::replace(&mut self.aux, [0.0; AUX_STATS])
    }

    fn begin_step(&mut self, step: u64) {
        self.inner.begin_step(step)
    }
}

impl StagedModel for Dpo {
    fn n_blocks(&self) -> usize {
        self.inner.n_blocks()
    }

    fn tied_head(&self) -> bool {
        self.inner.tied_head()
    }

    fn set_stage(&mut self, spec: StageSpec) {
        self.inner.set_stage(spec)
    }

    fn tensor_shards(&self) -> Option<engine::TensorShards> {
        self.inner.tensor_shards()
    }

    fn context_parallel(&mut self, cp: engine::ContextRank) -> Result<(), String> {
        Err(format!(
            "DPO compares each sequence's summed log-probabilities, which {cp} holds a part of; train DPO with dist.context_parallel = 1"
        ))
    }

    fn boundary_len(&self, batch: &TokenBatch) -> usize {
        self.inner.boundary_len(batch)
    }

    fn stage_forward(
        &mut self,
        _store: &mut dyn ParamStore,
        _batch: &TokenBatch,
        _slot: usize,
        _input: &[f32],
        _output: &mut [f32],
        _loss_seed: Option<f32>,
    ) -> Result<MicroStepStats, ModelError> {
        Err(PIPELINE.into())
    }

    fn stage_backward(
        &mut self,
        _store: &mut dyn ParamStore,
        _batch: &TokenBatch,
        _slot: usize,
        _grad_out: &[f32],
        _grad_in: &mut [f32],
    ) -> Result<(), ModelError> {
        Err(PIPELINE.into())
    }
}

const PIPELINE: &str = "train.objective = \"dpo\" runs without pipeline stages (dist.pipeline_parallel = 1)";

impl TextModel for Dpo {
    fn activation_bytes(&self) -> usize {
        self.inner.activation_bytes()
    }

    fn saved_activation_bytes(&self) -> usize {
        self.inner.saved_activation_bytes()
    }

    fn next_token_logits(&mut self, params: &[f32], tokens: &[u32]) -> Result<Vec<f32>, ModelError> {
        self.inner.next_token_logits(params, tokens)
    }

    fn set_kv_cache(&mut self, positions: usize) -> Result<(), ModelError> {
        self.inner.set_kv_cache(positions)
    }

    fn set_loss_terms(&mut self, terms: engine::LossTerms) {
        self.inner.set_loss_terms(terms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn softplus_and_sigmoid_are_stable_and_exact() {
        assert_eq!(softplus(0.0), std::f64::consts::LN_2);
        assert!((softplus(800.0) - 800.0).abs() < 1e-12);
        assert!(softplus(-800.0) >= 0.0 && softplus(-800.0) < 1e-300);
        assert_eq!(sigmoid(0.0), 0.5);
        assert!((sigmoid(3.0) + sigmoid(-3.0) - 1.0).abs() < 1e-15);
        assert!(sigmoid(-800.0) >= 0.0 && sigmoid(800.0) == 1.0);
    }

    #[test]
    fn rows_are_cut_after_their_last_target() {
        let ig = engine::IGNORE_INDEX;
        let batch = TokenBatch {
            n_seqs: 2,
            seq_len: 4,
            inputs: vec![1, 2, 3, 0, 1, 2, 0, 0],
            targets: vec![ig, 3, 4, ig, ig, 5, ig, ig],
            positions: Vec::new(),
        };
        let rows = pair_rows(&batch).unwrap();
        assert_eq!((rows[0].seq_len, rows[0].inputs.clone()), (3, vec![1, 2, 3]));
        assert_eq!((rows[1].seq_len, rows[1].targets.clone()), (2, vec![ig, 5]));
        let odd = TokenBatch { n_seqs: 1, seq_len: 4, ..batch.clone() };
        assert!(pair_rows(&odd).is_err());
        let empty = TokenBatch { targets: vec![ig; 8], ..batch };
        assert!(pair_rows(&empty).unwrap_err().to_string().contains("chosen reply has no target"));
    }
}
