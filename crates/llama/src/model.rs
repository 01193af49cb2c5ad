//! The Llama model: one micro-step (forward, fused loss, backward) over
//! flat buffers: the embedding, the layer stack (the shared walk of
//! `nn::stack` over [`crate::block`]'s layer), the final norm and the head
//! (tied or not).
//!
//! Each layer reads only its own segment's parameters and activations, so
//! a layer's parameters can be gathered just before it runs (ZeRO-3) or the
//! layer recomputed later (activation checkpointing).

use crate::block::{ActSizes, Dims, Layer, Pass};
use crate::config::LlamaConfig;
use crate::error::LlamaError;
use crate::frozen::FrozenBase;
use crate::layout::{build_layout, Adapters, LayerParams, ParamRanges, Proj};
use crate::lora::LoraConfig;
use crate::lora_dropout::Dropout;
use crate::split::Split;
use engine::rng::SplitMix64;
use engine::{
    Checkpointing, FullStore, GradOut, MicroStepStats, Model, ParamLayout, ParamStore, Precision, SegmentView,
    StageSpec, StagedModel, TensorShards, TpRank,
};
use nn::attention::AttnShape;
use nn::grad::param_grad;
use nn::kv::{Attention, KvCache};
use nn::linear::{linear_backward_input, linear_backward_weight, LinearShape};
use nn::norm::{rmsnorm_backward, rmsnorm_forward, NormSaved};
use nn::rope::Rope;
use nn::stack::{Part, Slots, Stack, DRES};
use nn::{parallelism, GemmDims, GemmOut, Operands, Positions, Strided};
use std::cell::Cell;
use std::ops::Range;
use std::sync::Arc;

pub use engine::batch::{TokenBatch, IGNORE_INDEX};

mod decode;

/// Activations and scratch for one (B, T) and pass: the layer stack, the
/// rotary tables, the final norm's output and 1/rms, logits and losses.
#[derive(Debug, Default)]
struct Acts {
    /// What they were sized for.
    sizes: Option<ActSizes>,
    b: usize,
    t: usize,
    stack: Stack,
    rope: Rope,
    /// Final norm's output and 1/rms.
    hf: Vec<f32>,
    rstd_f: Vec<f32>,
    /// Sized by each forward: all positions, or one per sequence when generating.
    logits: Vec<f32>,
    losses: Vec<f32>,
    /// The micro-batch's positions and document starts (packed rows; empty otherwise).
    pos: Vec<u32>,
    docs: Vec<u32>,
    /// The micro-batch's LoRA dropout masks (training passes with dropout).
    drop: Option<Dropout>,
}

/// Working buffer of the stack that holds d(hf) in backward.
const DC: usize = 1;

impl Acts {
    fn new(s: ActSizes, cfg: &LlamaConfig, b: usize, t: usize) -> Self {
        let [_, hf, rstd_f, logits, losses] = s.head.map(nn::stack::zeros);
        let rope = Rope::new(t, cfg.head_dim, cfg.rope_theta, cfg.llama3_scaling().as_ref());
        let (pos, docs) = (Vec::new(), Vec::new());
        let drop = None;
        Acts { stack: Stack::new(&s.stack), sizes: Some(s), b, t, rope, hf, rstd_f, logits, losses, pos, docs, drop }
    }

    /// Bytes held (activations and scratch), for memory accounting.
    fn bytes(&self) -> usize {
        let rest = [&self.rope.cos, &self.rope.sin, &self.hf, &self.rstd_f, &self.logits, &self.losses];
        self.stack.bytes() + 4 * rest.iter().map(|v| v.len()).sum::<usize>()
    }
}

/// The Llama model with its activation buffers.
#[derive(Debug)]
pub struct Llama {
    cfg: LlamaConfig,
    lora: Option<LoraConfig>,
    adapters: Option<Adapters>,
    layout: ParamLayout,
    ranges: ParamRanges,
    precision: Precision,
    checkpointing: Checkpointing,
    /// The part of the model this one runs (all of it without a pipeline).
    stage: StageSpec,
    /// The current micro-batch slot's activations.
    acts: Acts,
    slots: Slots<Acts>,
    /// Built for one rank of a tensor-parallel group (`cfg` is its shape).
    split: Option<Box<Split>>,
    /// Generation's key/value cache, when one is kept (`decode`).
    kv: Option<KvCache>,
    /// The frozen projections, packed outside the layout (shared by the
    /// models of one process); `None`: they are f32 tensors of the layout.
    base: Option<Arc<FrozenBase>>,
    /// The layout leaves the projections' weights out (held in `base`).
    packed: bool,
    /// What the training loss adds to cross-entropy.
    loss_terms: engine::LossTerms,
    /// The optimizer step being taken ([`Model::begin_step`]): LoRA
    /// dropout's masks are keyed on it.
    step: u64,
}

/// A layer with rotary tables and attention `(rope, attn)`, for the
/// micro-batch whose positions and document starts are `pd`, reading a
/// packed frozen base if there is one.
fn layer<'a>(
    cfg: &'a LlamaConfig,
    r: &'a LayerParams,
    (rope, attn): (&'a Rope, Attention<'a>),
    d: Dims,
    pd: (&'a [u32], &'a [u32]),
    base: Option<&'a FrozenBase>,
) -> Layer<'a> {
    let pos = Positions { t: d.gqa.t, ids: pd.0 };
    // Each layer adds its own window (`LlamaConfig::window_of`).
    let visible = nn::flash::Visible::documents(pd.1).scored(cfg.scores());
    Layer { cfg, r, rope, d, attn, pos, visible, base, at: Cell::new(0), drop: None }
}

/// Moves the buffers used only within one forward (logits, losses) from
/// the slot left to the slot entered.
fn carry(from: &mut Acts, to: &mut Acts) {
    to.logits = std::mem::take(&mut from.logits);
    to.losses = std::mem::take(&mut from.losses);
}

impl Llama {
    /// A model of the given shape (parameters live outside, in a flat buffer).
    pub fn new(cfg: LlamaConfig) -> Result<Self, LlamaError> {
        Self::build(cfg, None, Precision::F32)
    }

    /// A model whose saved activations (and, under f16, activation gradients
    /// between layers) are stored in `precision`; kernels compute in f32.
    pub fn with_precision(cfg: LlamaConfig, precision: Precision) -> Result<Self, LlamaError> {
        Self::build(cfg, None, precision)
    }

    /// A model with LoRA adapters on `lora`'s target projections; its
    /// layout holds the base tensors and, inside each layer, the adapters.
    pub fn with_lora(cfg: LlamaConfig, lora: LoraConfig, precision: Precision) -> Result<Self, LlamaError> {
        Self::build(cfg, Some(lora), precision)
    }

    /// The model rank `tp.rank` of a tensor-parallel group of `tp.size`
    /// holds of the model shaped `whole` ([`LlamaConfig::split_for`]): its
    /// layout is that rank's slices and the replicated tensors;
    /// [`StagedModel::tensor_shards`] maps it onto the whole model's.
    pub fn tensor_parallel(
        whole: LlamaConfig,
        lora: Option<LoraConfig>,
        precision: Precision,
        tp: TpRank,
    ) -> Result<Self, LlamaError> {
        if !tp.is_split() {
            return Self::build(whole, lora, precision);
        }
        if let Some(l) = lora.as_ref().filter(|l| l.use_dora || l.dropout > 0.0) {
            let key = if l.use_dora { "use_dora" } else { "lora_dropout" };
            return Err(LlamaError::lora(
                key,
                format!("is not supported with tensor parallelism ({} ranks); set dist.tensor_parallel = 1", tp.size),
            ));
        }
        let local = whole.split_for(tp)?;
        let whole = Self::build(whole, lora.clone(), Precision::F32)?;
        let mut model = Self::assemble(local, lora, precision, None, false)?;
        let split = Split { tp, whole };
        split.shards(&model)?;
        model.split = Some(Box::new(split));
        Ok(model)
    }

    fn build(cfg: LlamaConfig, lora: Option<LoraConfig>, precision: Precision) -> Result<Self, LlamaError> {
        cfg.validate()?;
        Self::assemble(cfg, lora, precision, None, false)
    }

    /// A model whose layout leaves the projections' weights out, as
    /// [`Llama::with_frozen_base`]'s does, before any base is loaded: for
    /// layouts, initialisation and plans (it cannot run a pass).
    pub fn with_packed_layout(cfg: LlamaConfig, lora: Option<LoraConfig>) -> Result<Self, LlamaError> {
        cfg.validate()?;
        Self::assemble(cfg, lora, Precision::F32, None, true)
    }

    /// A model whose projections' weights are `base`, packed and frozen,
    /// outside its layout (which holds the embedding, the norms, the head
    /// and the adapters): the GEMMs read the base a panel at a time.
    pub fn with_frozen_base(
        cfg: LlamaConfig,
        lora: Option<LoraConfig>,
        precision: Precision,
        base: Arc<FrozenBase>,
    ) -> Result<Self, LlamaError> {
        cfg.validate()?;
        if base.n_layers() != cfg.n_layer {
            return Err(LlamaError::config(
                "frozen base",
                format!("{} layers packed for a model of {}", base.n_layers(), cfg.n_layer),
            ));
        }
        Self::assemble(cfg, lora, precision, Some(base), true)
    }

    /// Whether the layout leaves the projections' weights out (a packed base).
    pub fn packs_base(&self) -> bool {
        self.packed
    }

    /// The same shape without adapters, with the same layout of the base
    /// (packed or not): the layout base parameters are handed over in.
    pub fn plain(&self) -> Result<Self, LlamaError> {
        match self.packed {
            true => Self::with_packed_layout(self.cfg.clone(), None),
            false => Self::new(self.cfg.clone()),
        }
    }

    /// The packed frozen base, if the projections are held outside the layout.
    pub fn frozen_base(&self) -> Option<&Arc<FrozenBase>> {
        self.base.as_ref()
    }

    /// The model of a shape already checked (a whole shape by
    /// [`LlamaConfig::validate`], a rank's by [`LlamaConfig::split_for`]).
    fn assemble(
        cfg: LlamaConfig,
        lora: Option<LoraConfig>,
        precision: Precision,
        base: Option<Arc<FrozenBase>>,
        packed: bool,
    ) -> Result<Self, LlamaError> {
        let adapters = match &lora {
            Some(l) => {
                crate::lora::validate(l)?;
                let targets = crate::lora::targets(l)?;
                let onto_branch_end = targets[Proj::O as usize] || targets[Proj::Down as usize];
                if l.use_dora && onto_branch_end && cfg.gemma.is_some() {
                    return Err(LlamaError::lora(
                        "use_dora",
                        "on o_proj or down_proj is not supported where their output is normed before the residual (Gemma 2's post norms); target the other projections or set use_dora = false",
                    ));
                }
                // The adapters' parameters and tensors count too.
                let on = Proj::ALL.into_iter().filter(|&p| targets[p as usize]);
                let per_layer: u128 = on.clone().map(|p| p.shape(&cfg).iter().map(|&d| d as u128).sum::<u128>()).sum();
                // DoRA: a magnitude of `out` values per adapted projection.
                let (dora, per_tensor) = (l.use_dora as u128, 2 + l.use_dora as u128);
                let mags: u128 = dora * on.clone().map(|p| p.shape(&cfg)[0] as u128).sum::<u128>();
                let n = cfg.param_count() + cfg.n_layer as u128 * (l.r as u128 * per_layer + mags);
                engine::check_shape_size(n, cfg.n_layer, cfg.tensors_per_layer() + per_tensor * on.count() as u128, 3)
                    .map_err(LlamaError::TooLarge)?;
                Some(Adapters { r: l.r, targets, dora: l.use_dora, dropout: l.dropout > 0.0 })
            }
            None => None,
        };
        let (layout, ranges) = build_layout(&cfg, adapters, packed);
        let (checkpointing, stage) = (Checkpointing::None, StageSpec::whole(cfg.n_layer));
        let (acts, slots) = (Acts::default(), Slots::default());
        Ok(Self {
            cfg,
            lora,
            adapters,
            layout,
            ranges,
            precision,
            checkpointing,
            stage,
            acts,
            slots,
            split: None,
            kv: None,
            base,
            packed,
            loss_terms: engine::LossTerms::default(),
            step: 0,
        })
    }

    /// The model's shape.
    pub fn config(&self) -> &LlamaConfig {
        &self.cfg
    }

    /// The LoRA configuration, if the model has adapters.
    pub fn lora(&self) -> Option<&LoraConfig> {
        self.lora.as_ref()
    }

    /// The storage precision of activations.
    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// Parameter ranges of layer `idx`.
    pub fn layer_params(&self, idx: usize) -> &LayerParams {
        &self.ranges.layers[idx]
    }

    /// Adds label smoothing and z-loss to the training loss (the reported
    /// loss stays plain cross-entropy, see [`engine::MicroStepStats`]).
    pub fn set_loss_terms(&mut self, terms: engine::LossTerms) {
        self.loss_terms = terms;
    }

    /// Bytes of activations and scratch currently allocated.
    pub fn activation_bytes(&self) -> usize {
        self.acts.bytes() + self.slots.parked().map(Acts::bytes).sum::<usize>()
    }

    /// The [`Llama::activation_bytes`] a training micro-step on `b`
    /// sequences of `t` tokens allocates, computed from the shape alone (u128:
    /// planning shapes far beyond this machine never overflows).
    pub fn planned_activation_bytes(&self, b: usize, t: usize) -> u128 {
        self.planned_activation_bytes_as(b, t, self.precision, self.checkpointing)
    }

    /// [`Llama::planned_activation_bytes`] of this shape built with another
    /// storage precision and checkpointing (no model is built for it): the
    /// bytes of the [`ActSizes`] a training pass allocates from.
    pub fn planned_activation_bytes_as(&self, b: usize, t: usize, precision: Precision, ck: Checkpointing) -> u128 {
        ActSizes::new(&self.cfg, self.adapters, (b, t), (precision, ck), true, Part::of(&self.stage)).bytes()
    }

    /// [`Llama::planned_activation_bytes_as`] of one pipeline stage of this
    /// shape: its layers, `spec.in_flight` micro-batches alive at once, the
    /// head's buffers on the last stage only.
    pub fn planned_stage_activation_bytes(
        &self,
        b: usize,
        t: usize,
        (precision, ck): (Precision, Checkpointing),
        spec: &StageSpec,
    ) -> u128 {
        ActSizes::new(&self.cfg, self.adapters, (b, t), (precision, ck), true, Part::of(spec)).bytes()
    }

    /// Bytes of the saved activations (every layer's slot and the embeddings' output).
    pub fn saved_activation_bytes(&self) -> usize {
        self.acts.stack.saved_bytes() + self.slots.parked().map(|a| a.stack.saved_bytes()).sum::<usize>()
    }

    /// Number of segments: the embedding, each layer, the final norm (+ head).
    pub fn n_segments(&self) -> usize {
        self.cfg.n_layer + 2
    }

    /// Hugging Face / PEFT initialisation: N(0, 0.02) for the embedding,
    /// projections and head, ones for the RMSNorm gains; LoRA A
    /// Kaiming-uniform as `nn.Linear`'s default (bound 1/√in), B zero.
    pub fn init_params(&self, seed: u64) -> Vec<f32> {
        (0..self.n_segments()).flat_map(|seg| self.init_segment(seed, seg)).collect()
    }

    /// The initial values of segment `seg` alone, from its own random
    /// streams (so a ZeRO-3 rank can initialise one segment at a time); the
    /// base tensors do not depend on whether adapters exist.
    pub fn init_segment(&self, seed: u64, seg: usize) -> Vec<f32> {
        if let Some(sp) = &self.split {
            return sp.init_segment(self, seed, seg);
        }
        let mut rng = SplitMix64::derive(seed, &[0x11a3a, seg as u64]);
        let mut normal = |n: usize| -> Vec<f32> { (0..n).map(|_| (rng.normal() * 0.02) as f32).collect() };
        let (v, c) = (self.cfg.vocab_size, self.cfg.hidden_size);
        if seg == 0 {
            return normal(v * c);
        }
        if seg == self.cfg.n_layer + 1 {
            let mut out = vec![1.0; c];
            if !self.cfg.tie_word_embeddings {
                out.extend(normal(v * c));
            }
            return out;
        }
        let r = &self.ranges.layer_rel;
        let mut out = vec![0.0f32; r.span().len()];
        out[r.attn_norm.clone()].fill(1.0);
        out[r.mlp_norm.clone()].fill(1.0);
        for g in r.qk_norm.iter().flatten() {
            out[g.clone()].fill(1.0);
        }
        for pr in Proj::ALL {
            let w = r.w(pr);
            out[w.clone()].copy_from_slice(&normal(w.len()));
        }
        self.init_adapters(seed, seg - 1, &mut out);
        crate::dora::init_magnitudes(self, seg - 1, &mut out, self.base.as_deref());
        out
    }

    /// Initialises layer `idx`'s adapters inside `layer` (the layer's
    /// parameters): A Kaiming-uniform from its own stream, B zero.
    pub(crate) fn init_adapters(&self, seed: u64, idx: usize, layer: &mut [f32]) {
        let r = &self.ranges.layer_rel;
        for (pr, lr) in Proj::ALL.iter().zip(&r.lora) {
            if let Some(lr) = lr {
                let fan_in = pr.shape(&self.cfg)[1];
                let mut rng = SplitMix64::derive(seed, &[0x10ea, idx as u64, *pr as u64]);
                layer[lr.a.clone()].copy_from_slice(&crate::lora::kaiming_uniform(&mut rng, lr.a.len(), fan_in));
                layer[lr.b.clone()].fill(0.0);
            }
        }
    }

    /// Errors unless this model runs all of itself (not a pipeline stage).
    fn whole_model_for(&self, what: &str) -> Result<(), LlamaError> {
        self.stage.require_whole(what).map_err(LlamaError::InvalidBatch)
    }

    fn check(&self, batch: &TokenBatch) -> Result<(), LlamaError> {
        let max = self.cfg.max_position_embeddings;
        match batch.problem(max, "max_position_embeddings", self.cfg.vocab_size) {
            Some(p) => Err(LlamaError::InvalidBatch(p)),
            None => Ok(()),
        }
    }

    fn dims(&self, b: usize, t: usize) -> Dims {
        let cfg = &self.cfg;
        let (n_head, n_kv_head, head_dim) = (cfg.n_head, cfg.n_kv_head, cfg.head_dim);
        let gqa = AttnShape { b, t, n_head, n_kv_head, head_dim, ops: Operands::F32 };
        Dims {
            n: b * t,
            c: cfg.hidden_size,
            f: cfg.intermediate_size,
            gqa,
            eps: cfg.rms_norm_eps as f32,
            r: self.adapters.map_or(0, |a| a.r),
            lora_scale: self.lora.as_ref().map_or(0.0, LoraConfig::scale),
            ops: nn::operands(self.precision),
            prec: self.precision,
        }
    }

    /// Sizes the activations for (b, t) and `pass`: a training pass needs a
    /// slot per layer, a forward-only pass one (evaluation between training
    /// steps reuses the training buffers instead of reallocating).
    fn ensure_acts(&mut self, flight: usize, b: usize, t: usize, pass: Pass) {
        self.slots.enter(&mut self.acts, flight, self.stage.in_flight.max(1), carry);
        let part = Part::of(&self.stage);
        let a = &self.acts;
        let same = a.b == b
            && a.t == t
            && a.sizes
                .as_ref()
                .is_some_and(|s| s.stack.precision == self.precision && s.stack.checkpointing == self.checkpointing);
        let n_slots = if pass == Pass::Train { part.n_blocks } else { 1 };
        if !same || a.stack.n_slots() < n_slots {
            let sizes = ActSizes::new(
                &self.cfg,
                self.adapters,
                (b, t),
                (self.precision, self.checkpointing),
                pass == Pass::Train,
                part,
            );
            // The old buffers go before the new ones are allocated: micro-batches
            // of changing length would otherwise hold both at once.
            self.acts = Acts::default();
            self.acts = Acts::new(sizes, &self.cfg, b, t);
        }
    }

    /// The same model recomputing the layers `checkpointing` selects in
    /// backward (keeping only their outputs in forward). Gradients are
    /// bit-identical: the same kernels run on the same inputs.
    pub fn with_checkpointing(mut self, checkpointing: Checkpointing) -> Self {
        self.checkpointing = checkpointing;
        self.acts = Acts::default();
        self.slots = Slots::default();
        self
    }

    /// Segment of the head: the embedding's (tied) or the final norm's.
    fn head_seg(&self) -> usize {
        if self.cfg.tie_word_embeddings {
            0
        } else {
            self.norm_seg()
        }
    }

    fn norm_seg(&self) -> usize {
        self.cfg.n_layer + 1
    }

    /// Range of the head inside its segment.
    fn head_rel(&self) -> Range<usize> {
        match &self.ranges.head {
            Some(h) => h.start - self.ranges.norm.start..h.end - self.ranges.norm.start,
            None => self.ranges.embed.clone(),
        }
    }

    /// The segments of this stage's layers.
    fn stage_segs(&self) -> Range<usize> {
        1 + self.stage.blocks.start..1 + self.stage.blocks.end
    }

    /// Forward through this stage in the current micro-batch slot: from
    /// the embedding (first stage) or `input` (the previous stage's
    /// output) — on the last stage through the final norm and the head
    /// into `logits`, leaving the head's segment ([`Llama::head_seg`]) held.
    /// The rows' positions start at `attn`'s first position.
    fn forward(
        &mut self,
        store: &mut dyn ParamStore,
        batch: &TokenBatch,
        input: &[f32],
        (pass, attn): (Pass, Attention<'_>),
    ) -> Result<(), LlamaError> {
        let (c, v) = (self.cfg.hidden_size, self.cfg.vocab_size);
        if self.packed && self.base.is_none() {
            return Err(LlamaError::config("frozen base", "a packed layout without its base cannot run a pass"));
        }
        let d = self.dims(self.acts.b, self.acts.t);
        let inputs = &batch.inputs;
        self.acts.pos.clone_from(&batch.positions);
        self.acts.docs = batch.doc_starts();
        let p_drop = self.lora.as_ref().map_or(0.0, |l| l.dropout);
        self.acts.drop = (pass == Pass::Train && p_drop > 0.0).then(|| Dropout::new(p_drop, self.step, batch));
        if self.stage.is_first() {
            {
                let seg = store.segment(0)?;
                let x = &mut self.acts.stack.x;
                let wte = &seg.params[self.ranges.embed.clone()];
                nn::embed::embedding_forward(x, inputs, wte, None, Positions::rows(self.acts.t), c);
                if let Some(s) = self.cfg.embed_scale() {
                    x.iter_mut().for_each(|v| *v *= s);
                }
            }
            store.done(0, false)?;
        } else {
            self.acts.stack.x.copy_from_slice(input);
        }
        self.acts.stack.keep_input();
        let segs = self.stage_segs();
        // Rows after cached positions rotate by their own positions.
        let later = match attn {
            Attention::Causal => None,
            Attention::Cached(_) => Some(self.rope_for(attn.first_position(), self.acts.t)),
        };
        let acts = &mut self.acts;
        let rope = later.as_ref().unwrap_or(&acts.rope);
        let base = self.base.as_deref();
        let mut layer = layer(&self.cfg, &self.ranges.layer_rel, (rope, attn), d, (&acts.pos, &acts.docs), base);
        layer.drop = acts.drop.as_ref();
        acts.stack.forward(&layer, store, segs, pass == Pass::Train)?;
        if !self.stage.is_last() {
            return Ok(());
        }
        let norm_seg = self.norm_seg();
        {
            let seg = store.segment(norm_seg)?;
            let acts = &mut self.acts;
            let gains = self.cfg.gains(&seg.params[..c]);
            rmsnorm_forward(&mut acts.hf, &mut acts.rstd_f, &acts.stack.x, &gains, c, d.eps);
        }
        if self.head_seg() != norm_seg {
            store.done(norm_seg, false)?;
        }
        // logits = hf · headᵀ, for every row or each sequence's last one:
        // (rows, C) @ (C, V) -> (rows, V)
        let (b, t) = (self.acts.b, self.acts.t);
        let (rows, hf) = match pass {
            Pass::NextToken => (b, Strided { data: &self.acts.hf, offset: (t - 1) * c, rs: t * c, cs: 1 }),
            Pass::Train | Pass::Eval => (d.n, Strided::rows(&self.acts.hf, c)),
        };
        self.acts.logits.resize(rows * v, 0.0);
        let seg = store.segment(self.head_seg())?;
        let head = Strided::transposed(&seg.params[self.head_rel()], c);
        nn::linear::head_gemm(
            GemmDims { m: rows, n: v, k: c },
            &mut self.acts.logits,
            GemmOut::overwrite(v),
            hf,
            head,
            parallelism(false).with(d.ops),
        );
        if let Some(cap) = self.cfg.gemma.and_then(|g| g.final_softcap) {
            nn::loss_terms::soft_cap(&mut self.acts.logits, cap as f32);
        }
        Ok(())
    }

    /// The last stage's backward from `dlogits` (held in `logits`) through
    /// the head and the final norm into the residual gradient; the head's
    /// segment is still held from the forward.
    fn head_backward(&mut self, store: &mut dyn ParamStore) -> Result<(), LlamaError> {
        let (c, v) = (self.cfg.hidden_size, self.cfg.vocab_size);
        let d = self.dims(self.acts.b, self.acts.t);
        let prec = self.precision;
        if prec == Precision::F16 {
            // The scaled logits gradient in f16: where a too-large loss scale overflows.
            prec.round(&mut self.acts.logits);
        }
        let (head_seg, norm_seg, head_rel) = (self.head_seg(), self.norm_seg(), self.head_rel());
        {
            let SegmentView { params, mut grads, .. } = store.segment(head_seg)?;
            let acts = &mut self.acts;
            let dlogits = Strided::rows(&acts.logits, v);
            // dhf = dlogits · head: (B*T, V) @ (V, C) -> (B*T, C)
            let (head, lin) = (&params[head_rel.clone()], LinearShape::new(d.n, c, v, d.ops));
            linear_backward_input(&mut acts.stack.bufs[DC], false, dlogits, head, lin);
            // dhead (+)= dlogitsᵀ · hf: (V, B*T) @ (B*T, C) -> (V, C)
            linear_backward_weight(param_grad(grads.tensor(head_rel)), dlogits, &acts.hf, lin);
        }
        if head_seg != norm_seg {
            // The head's share of the embedding's gradient is complete for this pass.
            store.done(head_seg, true)?;
        }
        {
            let SegmentView { params, mut grads, .. } = store.segment(norm_seg)?;
            let acts = &mut self.acts;
            let [dres, dc, ..] = &mut acts.stack.bufs[..] else { unreachable!("Llama's working buffers") };
            dres.fill(0.0);
            let gw = param_grad(grads.tensor(0..c));
            // stack.x is still the last layer's output.
            let saved = NormSaved { inp: &acts.stack.x, mean: &[], rstd: &acts.rstd_f };
            rmsnorm_backward(dres, gw, dc, saved, &self.cfg.gains(&params[..c]));
        }
        store.done(norm_seg, true)?;
        Ok(())
    }

    /// Backward of the current micro-batch slot through this stage's
    /// layers from the residual gradient (in the stack's working buffer),
    /// then the embedding (first stage). Frozen tensors' weight gradients
    /// are skipped.
    fn blocks_backward(&mut self, store: &mut dyn ParamStore, inputs: &[u32]) -> Result<(), LlamaError> {
        let t = self.acts.t;
        let c = self.cfg.hidden_size;
        let d = self.dims(self.acts.b, self.acts.t);
        let segs = self.stage_segs();
        let acts = &mut self.acts;
        let (rope_attn, base) = ((&acts.rope, Attention::Causal), self.base.as_deref());
        let mut layer = layer(&self.cfg, &self.ranges.layer_rel, rope_attn, d, (&acts.pos, &acts.docs), base);
        layer.drop = acts.drop.as_ref();
        acts.stack.backward(&layer, store, segs)?;
        if !self.stage.is_first() {
            return Ok(());
        }
        {
            let SegmentView { mut grads, .. } = store.segment(0)?;
            // The embedding's gradient is only ever added to.
            let g = grads.tensor(self.ranges.embed.clone()).map(GradOut::for_adding);
            let dres = &mut self.acts.stack.bufs[DRES];
            if let Some(s) = self.cfg.embed_scale() {
                dres.iter_mut().for_each(|v| *v *= s);
            }
            nn::embed::embedding_backward(g, None, dres, inputs, Positions::rows(t), c);
        }
        store.done(0, true)?;
        Ok(())
    }

    /// Checks `batch`, sizes the activations and runs the forward; the
    /// head's segment stays held.
    fn forward_batch(
        &mut self,
        store: &mut dyn ParamStore,
        batch: &TokenBatch,
        (pass, attn): (Pass, Attention<'_>),
    ) -> Result<(), LlamaError> {
        self.check(batch)?;
        self.whole_model_for("a forward pass over the whole model")?;
        self.ensure_acts(0, batch.n_seqs, batch.seq_len, pass);
        self.forward(store, batch, &[], (pass, attn))
    }

    /// Fused softmax + cross-entropy of the logits (replaced by
    /// `grad_scale ·` their gradient when given, the loss terms included);
    /// returns the cross-entropy and what the terms add, each summed in row
    /// order (f64, deterministic).
    fn cross_entropy(&mut self, batch: &TokenBatch, grad_scale: Option<f32>) -> (f64, f64) {
        let acts = &mut self.acts;
        let v = self.cfg.vocab_size;
        let cap = self.cfg.gemma.and_then(|g| g.final_softcap).map(|c| c as f32);
        let aux = nn::loss_terms::capped_cross_entropy_with(
            (&mut acts.logits, cap),
            &mut acts.losses,
            &batch.targets,
            v,
            grad_scale,
            self.loss_terms,
        );
        (nn::loss::loss_sum(&acts.losses, batch.n_seqs * batch.seq_len), aux)
    }

    fn logits_of(
        &mut self,
        params: &[f32],
        batch: &TokenBatch,
        (pass, attn): (Pass, Attention<'_>),
    ) -> Result<Vec<f32>, LlamaError> {
        let mut store = FullStore::read_only(&self.layout, self.segments(), params)?;
        self.forward_batch(&mut store, batch, (pass, attn))?;
        store.done(self.head_seg(), false)?;
        Ok(std::mem::take(&mut self.acts.logits))
    }

    /// Logits `[B·T, V]` of every position of `batch` (targets unused).
    pub fn logits(&mut self, params: &[f32], batch: &TokenBatch) -> Result<Vec<f32>, LlamaError> {
        self.logits_of(params, batch, (Pass::Eval, Attention::Causal))
    }

    /// Logits `[V]` of the last position of `tokens` (one sequence), for
    /// sampling: the head runs on that position only, and the layers keep
    /// no activations for a backward. With a key/value cache
    /// ([`Llama::set_kv_cache`]) only the tokens past the cached positions run.
    pub fn next_token_logits(&mut self, params: &[f32], tokens: &[u32]) -> Result<Vec<f32>, LlamaError> {
        match self.kv.take() {
            Some(kv) => self.cached_next_token_logits(params, tokens, kv),
            None => self.last_logits(params, tokens, Attention::Causal),
        }
    }

    /// Logits of the last of `tokens` (one sequence, its positions from
    /// `attn`'s first one).
    fn last_logits(&mut self, params: &[f32], tokens: &[u32], attn: Attention<'_>) -> Result<Vec<f32>, LlamaError> {
        let batch = TokenBatch::prompt(tokens);
        self.logits_of(params, &batch, (Pass::NextToken, attn))
    }
}

impl Model for Llama {
    type Batch = TokenBatch;
    type Error = LlamaError;

    fn layout(&self) -> &ParamLayout {
        &self.layout
    }

    /// A frozen tensor's weight-gradient computation is skipped.
    fn set_trainable(&mut self, trainable: &dyn Fn(&engine::TensorSpec) -> bool) -> usize {
        self.layout.set_trainable(trainable)
    }

    fn segments(&self) -> Vec<Range<usize>> {
        let r = &self.ranges;
        let last = r.head.as_ref().map_or(r.norm.end, |h| h.end);
        std::iter::once(r.embed.clone())
            .chain(r.layers.iter().map(LayerParams::span))
            .chain(std::iter::once(r.norm.start..last))
            .collect()
    }

    fn n_targets(&self, batch: &TokenBatch) -> u64 {
        batch.n_targets()
    }

    /// A batch of zero sequences (a rank without data in the tail) runs the
    /// same code on zero rows: the same segment visits and collectives as
    /// every other rank, and a zero gradient.
    fn micro_step(
        &mut self,
        store: &mut dyn ParamStore,
        batch: &TokenBatch,
        grad_scale: f32,
    ) -> Result<MicroStepStats, LlamaError> {
        self.whole_model_for("a micro-step")?;
        let stats = self.stage_forward(store, batch, 0, &[], &mut [], Some(grad_scale))?;
        self.stage_backward(store, batch, 0, &[], &mut [])?;
        Ok(stats)
    }

    fn loss(&mut self, store: &mut dyn ParamStore, batch: &TokenBatch) -> Result<MicroStepStats, LlamaError> {
        self.whole_model_for("evaluation")?;
        self.stage_forward(store, batch, 0, &[], &mut [], None)
    }

    fn begin_step(&mut self, step: u64) {
        self.step = step;
    }
}

impl StagedModel for Llama {
    fn n_blocks(&self) -> usize {
        self.cfg.n_layer
    }

    fn tied_head(&self) -> bool {
        self.cfg.tie_word_embeddings
    }

    fn set_stage(&mut self, spec: StageSpec) {
        self.stage = spec;
        self.acts = Acts::default();
        self.slots = Slots::default();
    }

    fn tensor_shards(&self) -> Option<TensorShards> {
        self.split.as_ref().and_then(|sp| sp.shards(self).ok())
    }

    fn boundary_len(&self, batch: &TokenBatch) -> usize {
        batch.n_seqs * batch.seq_len * self.cfg.hidden_size
    }

    fn stage_forward(
        &mut self,
        store: &mut dyn ParamStore,
        batch: &TokenBatch,
        slot: usize,
        input: &[f32],
        output: &mut [f32],
        loss_seed: Option<f32>,
    ) -> Result<MicroStepStats, LlamaError> {
        self.check(batch)?;
        let n = batch.n_seqs * batch.seq_len;
        let want = n * self.cfg.hidden_size;
        self.stage
            .check_io(("the stage's input", input.len()), ("the stage's output", output.len()), want)
            .map_err(LlamaError::InvalidBatch)?;
        let pass = if loss_seed.is_some() { Pass::Train } else { Pass::Eval };
        self.ensure_acts(slot, batch.n_seqs, batch.seq_len, pass);
        self.forward(store, batch, input, (pass, Attention::Causal))?;
        if !self.stage.is_last() {
            output.copy_from_slice(&self.acts.stack.x);
            return Ok(MicroStepStats::default());
        }
        if loss_seed.is_none() {
            store.done(self.head_seg(), false)?;
        }
        let (loss_sum, aux_sum) = self.cross_entropy(batch, loss_seed);
        if loss_seed.is_some() {
            self.head_backward(store)?;
        }
        Ok(MicroStepStats { loss_sum, n_targets: batch.n_targets(), aux_sum })
    }

    fn stage_backward(
        &mut self,
        store: &mut dyn ParamStore,
        batch: &TokenBatch,
        slot: usize,
        grad_out: &[f32],
        grad_in: &mut [f32],
    ) -> Result<(), LlamaError> {
        let n = batch.n_seqs * batch.seq_len;
        let want = n * self.cfg.hidden_size;
        // Read as a backward: the gradient of the output comes in (not on
        // the last stage), that of the input goes out (not on the first).
        self.stage
            .check_io(
                ("the gradient of the stage's input", grad_in.len()),
                ("the gradient of the stage's output", grad_out.len()),
                want,
            )
            .map_err(LlamaError::InvalidBatch)?;
        self.ensure_acts(slot, batch.n_seqs, batch.seq_len, Pass::Train);
        if !self.stage.is_last() {
            self.acts.stack.bufs[DRES].copy_from_slice(grad_out);
        }
        self.blocks_backward(store, &batch.inputs)?;
        if !self.stage.is_first() {
            grad_in.copy_from_slice(&self.acts.stack.bufs[DRES]);
        }
        Ok(())
    }
}
