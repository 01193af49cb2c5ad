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
use crate::layout::{build_layout, Adapters, LayerParams, ParamRanges, Proj};
use crate::lora::LoraConfig;
use engine::rng::SplitMix64;
use engine::{
    Checkpointing, FullStore, GradOut, MicroStepStats, Model, ParamLayout, ParamStore, Precision, SegmentView,
};
use nn::attention::AttnShape;
use nn::grad::param_grad;
use nn::linear::{linear_backward_input, linear_backward_weight, LinearShape};
use nn::norm::{rmsnorm_backward, rmsnorm_forward, NormSaved};
use nn::rope::Rope;
use nn::stack::{Stack, DRES};
use nn::{gemm_into, parallelism, GemmDims, GemmOut, Operands, Strided};
use std::ops::Range;

pub use engine::batch::{TokenBatch, IGNORE_INDEX};

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
}

/// Working buffer of the stack that holds d(hf) in backward.
const DC: usize = 1;

impl Acts {
    fn new(s: ActSizes, cfg: &LlamaConfig, b: usize, t: usize) -> Self {
        let [_, hf, rstd_f, logits, losses] = s.head.map(nn::stack::zeros);
        let rope = Rope::new(t, cfg.head_dim, cfg.rope_theta, cfg.llama3_scaling().as_ref());
        Acts { stack: Stack::new(&s.stack), sizes: Some(s), b, t, rope, hf, rstd_f, logits, losses }
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
    acts: Acts,
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

    fn build(cfg: LlamaConfig, lora: Option<LoraConfig>, precision: Precision) -> Result<Self, LlamaError> {
        cfg.validate()?;
        let adapters = match &lora {
            Some(l) => {
                l.validate()?;
                let targets = l.targets()?;
                // The adapters' parameters and tensors count too.
                let on = Proj::ALL.into_iter().filter(|&p| targets[p as usize]);
                let per_layer: u128 = on.clone().map(|p| p.shape(&cfg).iter().map(|&d| d as u128).sum::<u128>()).sum();
                let n = cfg.param_count() + cfg.n_layer as u128 * l.r as u128 * per_layer;
                engine::check_shape_size(n, cfg.n_layer, cfg.tensors_per_layer() + 2 * on.count() as u128, 3)
                    .map_err(LlamaError::TooLarge)?;
                Some(Adapters { r: l.r, targets })
            }
            None => None,
        };
        let (layout, ranges) = build_layout(&cfg, adapters);
        let checkpointing = Checkpointing::None;
        Ok(Self { cfg, lora, adapters, layout, ranges, precision, checkpointing, acts: Acts::default() })
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

    /// Bytes of activations and scratch currently allocated.
    pub fn activation_bytes(&self) -> usize {
        self.acts.bytes()
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
        ActSizes::new(&self.cfg, self.adapters, (b, t), (precision, ck), true).bytes()
    }

    /// Bytes of the saved activations (every layer's slot and the embeddings' output).
    pub fn saved_activation_bytes(&self) -> usize {
        self.acts.stack.saved_bytes()
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
        for pr in Proj::ALL {
            let w = r.w(pr);
            out[w.clone()].copy_from_slice(&normal(w.len()));
        }
        self.init_adapters(seed, seg - 1, &mut out);
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
    fn ensure_acts(&mut self, b: usize, t: usize, pass: Pass) {
        let a = &self.acts;
        let same = a.b == b
            && a.t == t
            && a.sizes
                .as_ref()
                .is_some_and(|s| s.stack.precision == self.precision && s.stack.checkpointing == self.checkpointing);
        let n_slots = if pass == Pass::Train { self.cfg.n_layer } else { 1 };
        if !same || a.stack.n_slots() < n_slots {
            let sizes = ActSizes::new(
                &self.cfg,
                self.adapters,
                (b, t),
                (self.precision, self.checkpointing),
                pass == Pass::Train,
            );
            self.acts = Acts::new(sizes, &self.cfg, b, t);
        }
    }

    /// The same model recomputing the layers `checkpointing` selects in
    /// backward (keeping only their outputs in forward). Gradients are
    /// bit-identical: the same kernels run on the same inputs.
    pub fn with_checkpointing(mut self, checkpointing: Checkpointing) -> Self {
        self.checkpointing = checkpointing;
        self.acts = Acts::default();
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

    /// Forward through the final norm and the head into `logits`. Leaves
    /// the head's segment ([`Llama::head_seg`]) held.
    fn forward(&mut self, store: &mut dyn ParamStore, inputs: &[u32], pass: Pass) -> Result<(), LlamaError> {
        let (c, v) = (self.cfg.hidden_size, self.cfg.vocab_size);
        let d = self.dims(self.acts.b, self.acts.t);
        {
            let seg = store.segment(0)?;
            let x = &mut self.acts.stack.x;
            nn::embed::embedding_forward(x, inputs, &seg.params[self.ranges.embed.clone()], None, self.acts.t, c);
            self.acts.stack.keep_embedding();
        }
        store.done(0, false)?;
        let acts = &mut self.acts;
        let layer = Layer { cfg: &self.cfg, r: &self.ranges.layer_rel, rope: &acts.rope, d };
        acts.stack.forward(&layer, store, 1..1 + self.cfg.n_layer, pass == Pass::Train)?;
        let norm_seg = self.norm_seg();
        {
            let seg = store.segment(norm_seg)?;
            let acts = &mut self.acts;
            rmsnorm_forward(&mut acts.hf, &mut acts.rstd_f, &acts.stack.x, &seg.params[..c], c, d.eps);
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
        gemm_into(
            GemmDims { m: rows, n: v, k: c },
            &mut self.acts.logits,
            GemmOut::overwrite(v),
            hf,
            head,
            1.0,
            parallelism(false).with(d.ops),
        );
        Ok(())
    }

    /// Backward from `dlogits` (held in `logits`) to every parameter,
    /// segment by segment in reverse; the head's segment is still held
    /// from the forward. Frozen tensors' weight gradients are skipped.
    fn backward(&mut self, store: &mut dyn ParamStore, inputs: &[u32]) -> Result<(), LlamaError> {
        let (c, v) = (self.cfg.hidden_size, self.cfg.vocab_size);
        let d = self.dims(self.acts.b, self.acts.t);
        let prec = self.precision;
        if prec == Precision::F16 {
            // The scaled logits gradient in f16: where a too-large loss scale overflows.
            prec.round(&mut self.acts.logits);
        }
        let (head_seg, norm_seg, head_rel) = (self.head_seg(), self.norm_seg(), self.head_rel());
        {
            let SegmentView { params, mut grads } = store.segment(head_seg)?;
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
            let SegmentView { params, mut grads } = store.segment(norm_seg)?;
            let acts = &mut self.acts;
            let [dres, dc, ..] = &mut acts.stack.bufs[..] else { unreachable!("Llama's working buffers") };
            dres.fill(0.0);
            let gw = param_grad(grads.tensor(0..c));
            // stack.x is still the last layer's output.
            let saved = NormSaved { inp: &acts.stack.x, mean: &[], rstd: &acts.rstd_f };
            rmsnorm_backward(dres, gw, dc, saved, &params[..c]);
        }
        store.done(norm_seg, true)?;
        let acts = &mut self.acts;
        let layer = Layer { cfg: &self.cfg, r: &self.ranges.layer_rel, rope: &acts.rope, d };
        acts.stack.backward(&layer, store, 1..1 + self.cfg.n_layer)?;
        {
            let SegmentView { mut grads, .. } = store.segment(0)?;
            // The embedding's gradient is only ever added to.
            let g = grads.tensor(self.ranges.embed.clone()).map(GradOut::for_adding);
            nn::embed::embedding_backward(g, None, &self.acts.stack.bufs[DRES], inputs, self.acts.t, c);
        }
        store.done(0, true)?;
        Ok(())
    }

    /// Checks `batch`, sizes the activations and runs the forward; the
    /// head's segment stays held.
    fn forward_batch(&mut self, store: &mut dyn ParamStore, batch: &TokenBatch, pass: Pass) -> Result<(), LlamaError> {
        self.check(batch)?;
        self.ensure_acts(batch.n_seqs, batch.seq_len, pass);
        self.forward(store, &batch.inputs, pass)
    }

    /// Fused softmax + cross-entropy of the logits (replaced by
    /// `grad_scale ·` their gradient when given); returns the loss summed in
    /// row order (f64, deterministic).
    fn cross_entropy(&mut self, batch: &TokenBatch, grad_scale: Option<f32>) -> f64 {
        let acts = &mut self.acts;
        let v = self.cfg.vocab_size;
        nn::loss::softmax_cross_entropy(&mut acts.logits, &mut acts.losses, &batch.targets, v, grad_scale);
        nn::loss::loss_sum(&acts.losses, batch.n_seqs * batch.seq_len)
    }

    fn logits_of(&mut self, params: &[f32], batch: &TokenBatch, pass: Pass) -> Result<Vec<f32>, LlamaError> {
        let mut store = FullStore::read_only(&self.layout, self.segments(), params)?;
        self.forward_batch(&mut store, batch, pass)?;
        store.done(self.head_seg(), false)?;
        Ok(std::mem::take(&mut self.acts.logits))
    }

    /// Logits `[B·T, V]` of every position of `batch` (targets unused).
    pub fn logits(&mut self, params: &[f32], batch: &TokenBatch) -> Result<Vec<f32>, LlamaError> {
        self.logits_of(params, batch, Pass::Eval)
    }

    /// Logits `[V]` of the last position of `tokens` (one sequence), for
    /// sampling: the head runs on that position only, and the layers keep
    /// no activations for a backward.
    pub fn next_token_logits(&mut self, params: &[f32], tokens: &[u32]) -> Result<Vec<f32>, LlamaError> {
        let t = tokens.len();
        let batch = TokenBatch { n_seqs: 1, seq_len: t, inputs: tokens.to_vec(), targets: vec![IGNORE_INDEX; t] };
        self.logits_of(params, &batch, Pass::NextToken)
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
        self.forward_batch(store, batch, Pass::Train)?;
        let loss_sum = self.cross_entropy(batch, Some(grad_scale));
        self.backward(store, &batch.inputs)?;
        Ok(MicroStepStats { loss_sum, n_targets: batch.n_targets() })
    }

    fn loss(&mut self, store: &mut dyn ParamStore, batch: &TokenBatch) -> Result<MicroStepStats, LlamaError> {
        self.forward_batch(store, batch, Pass::Eval)?;
        store.done(self.head_seg(), false)?;
        Ok(MicroStepStats { loss_sum: self.cross_entropy(batch, None), n_targets: batch.n_targets() })
    }
}
