//! The GPT-2 model: one micro-step (forward, fused loss, backward) over
//! flat buffers: the embeddings, the block stack (the shared walk of
//! `nn::stack` over [`crate::block`]'s block), the final LayerNorm and the
//! tied head.
//!
//! Each block reads only its own segment's parameters and activations, so
//! a block can be recomputed (activation checkpointing) or its parameters
//! gathered just before it runs (ZeRO-3).

use crate::block::{ActSizes, Dims, GptBlock};
use crate::config::GptConfig;
use crate::error::GptError;
use crate::layout::{build_layout, conv_shape, Adapters, BlockParams, ParamRanges, Widths, TARGETS};
use engine::{
    Checkpointing, FullStore, GradOut, MicroStepStats, Model, ParamLayout, ParamStore, Precision, SegmentView,
    StageSpec, StagedModel, TpRank,
};
use nn::flash::Visible;
use nn::grad::param_grad;
use nn::kv::{Attention, KvCache};
use nn::lora::LoraConfig;
use nn::norm::{layernorm_backward, layernorm_forward, NormSaved};
use nn::stack::{Part, Slots, Stack, DRES};
use nn::{GemmDims, GemmOut, Positions, Strided};
use std::ops::Range;

pub use engine::batch::{TokenBatch as Batch, IGNORE_INDEX};

mod decode;

/// Activations and backward scratch for one (B, T): the block stack, the
/// final LayerNorm's output and statistics, the logits and the losses.
#[derive(Debug, Default)]
struct Acts {
    /// What they were sized for.
    sizes: Option<ActSizes>,
    b: usize,
    t: usize,
    stack: Stack,
    lnf: Vec<f32>,
    lnf_mean: Vec<f32>,
    lnf_rstd: Vec<f32>,
    logits: Vec<f32>,
    losses: Vec<f32>,
    /// The micro-batch's positions and document starts (packed rows; empty otherwise).
    pos: Vec<u32>,
    docs: Vec<u32>,
}

/// Working buffer of the stack that holds d(lnf) in backward.
const DC: usize = 1;

impl Acts {
    fn new(s: ActSizes, b: usize, t: usize) -> Self {
        let [lnf, lnf_mean, lnf_rstd, logits, losses] = s.head.map(nn::stack::zeros);
        let (pos, docs) = (Vec::new(), Vec::new());
        Acts { stack: Stack::new(&s.stack), sizes: Some(s), b, t, lnf, lnf_mean, lnf_rstd, logits, losses, pos, docs }
    }

    /// Bytes held (activations and scratch), for memory accounting.
    fn bytes(&self) -> usize {
        let head = [&self.lnf, &self.lnf_mean, &self.lnf_rstd, &self.logits, &self.losses];
        self.stack.bytes() + 4 * head.iter().map(|v| v.len()).sum::<usize>()
    }
}

/// Moves the buffers used only within one forward (logits, losses) from
/// the slot left to the slot entered.
fn carry(from: &mut Acts, to: &mut Acts) {
    to.logits = std::mem::take(&mut from.logits);
    to.losses = std::mem::take(&mut from.losses);
}

/// The GPT-2 model with its activation buffers.
#[derive(Debug)]
pub struct Gpt {
    cfg: GptConfig,
    layout: ParamLayout,
    ranges: ParamRanges,
    precision: Precision,
    checkpointing: Checkpointing,
    /// The part of the model this one runs (all of it without a pipeline).
    stage: StageSpec,
    /// The current micro-batch slot's activations.
    acts: Acts,
    slots: Slots<Acts>,
    /// The tensor-parallel rank this model is built for (whole: all of it).
    tp: TpRank,
    /// Generation's key/value cache, when one is kept (`decode`).
    kv: Option<KvCache>,
    /// What the training loss adds to cross-entropy.
    loss_terms: engine::LossTerms,
    /// LoRA adapters on the linear layers, if any.
    lora: Option<LoraConfig>,
    adapters: Option<Adapters>,
}

impl Gpt {
    /// A model of the given shape (parameters live outside, in a flat buffer).
    pub fn new(cfg: GptConfig) -> Result<Self, GptError> {
        Self::with_precision(cfg, Precision::F32)
    }

    /// A model whose saved activations (and, under f16, activation gradients
    /// between blocks) are stored in `precision`; kernels compute in f32.
    pub fn with_precision(cfg: GptConfig, precision: Precision) -> Result<Self, GptError> {
        Self::tensor_parallel(cfg, precision, TpRank::WHOLE)
    }

    /// The model rank `tp.rank` of a tensor-parallel group of `tp.size`
    /// holds ([`crate::split`]): `n_head / T` heads and `4C / T` MLP
    /// columns of every block, the embeddings and norms whole;
    /// [`StagedModel::tensor_shards`] maps its layout onto the whole model's.
    pub fn tensor_parallel(cfg: GptConfig, precision: Precision, tp: TpRank) -> Result<Self, GptError> {
        Self::assemble(cfg, precision, tp, None)
    }

    /// A model with LoRA adapters on `lora`'s target layers (`c_attn`,
    /// `c_proj`, `c_fc` as PEFT names them, or `all-linear`); its layout
    /// holds the base tensors and, at the end of each block, the adapters
    /// (`….attn.c_attn.lora_A.weight` `[r, C]`, `lora_B` `[3C, r]`, ...).
    pub fn with_lora(cfg: GptConfig, lora: LoraConfig, precision: Precision) -> Result<Self, GptError> {
        Self::assemble(cfg, precision, TpRank::WHOLE, Some(lora))
    }

    fn assemble(cfg: GptConfig, precision: Precision, tp: TpRank, lora: Option<LoraConfig>) -> Result<Self, GptError> {
        cfg.validate()?;
        crate::split::check(&cfg, tp)?;
        let adapters = lora.as_ref().map(|l| Self::size_adapters(&cfg, l, tp)).transpose()?;
        let (layout, ranges) = build_layout(&cfg, Widths::of(&cfg, tp), adapters);
        let stage = StageSpec::whole(cfg.n_layer);
        let (checkpointing, acts, slots) = (Checkpointing::None, Acts::default(), Slots::default());
        Ok(Self {
            cfg,
            layout,
            ranges,
            precision,
            checkpointing,
            stage,
            acts,
            slots,
            tp,
            kv: None,
            loss_terms: Default::default(),
            lora,
            adapters,
        })
    }

    /// Checks `lora` for GPT-2 (what is not implemented for its block is
    /// named with the fix) and sizes its adapters.
    fn size_adapters(cfg: &GptConfig, lora: &LoraConfig, tp: TpRank) -> Result<Adapters, GptError> {
        lora.validate(&TARGETS)?;
        let refuse = |field: &str, problem: String| Err(nn::lora::LoraError::invalid(field, problem).into());
        if lora.use_dora {
            return refuse(
                "use_dora",
                "is not supported for gpt2; set use_dora = false (DoRA runs on the Llama-block families)".into(),
            );
        }
        if lora.dropout > 0.0 {
            return refuse(
                "lora_dropout",
                format!("= {} is not supported for gpt2; set lora_dropout = 0.0", lora.dropout),
            );
        }
        if tp.is_split() {
            return refuse(
                "target_modules",
                format!(
                    "LoRA on gpt2 is not supported with tensor parallelism ({} ranks); set dist.tensor_parallel = 1",
                    tp.size
                ),
            );
        }
        let on = lora.targets(&TARGETS)?;
        let targets: [bool; 4] = std::array::from_fn(|i| on[i]);
        let w = Widths::of(cfg, tp);
        let per_layer: u128 = (0..4)
            .filter(|&i| targets[i])
            .map(|i| conv_shape(i, cfg.n_embd, w).iter().map(|&d| d as u128).sum::<u128>())
            .sum();
        let n = cfg.param_count() + cfg.n_layer as u128 * lora.r as u128 * per_layer;
        let tensors = 12 + 2 * targets.iter().filter(|&&t| t).count() as u128;
        engine::check_shape_size(n, cfg.n_layer, tensors, 4).map_err(GptError::InvalidConfig)?;
        Ok(Adapters { r: lora.r, targets })
    }

    /// The LoRA configuration, if the model has adapters.
    pub fn lora(&self) -> Option<&LoraConfig> {
        self.lora.as_ref()
    }

    /// Which layers carry adapters, and their rank.
    pub(crate) fn adapter_set(&self) -> Option<Adapters> {
        self.adapters
    }

    /// The adapters as the block reads them: rank and scale.
    fn lora_rank_scale(&self) -> Option<(usize, f32)> {
        self.lora.as_ref().map(|l| (l.r, l.scale()))
    }

    /// Initial parameters (GPT-2's initialisation, adapters as PEFT starts
    /// them): the base's values do not depend on whether adapters exist.
    pub fn init_params(&self, seed: u64) -> Vec<f32> {
        (0..self.cfg.n_layer + 2).flat_map(|seg| self.init_segment(seed, seg)).collect()
    }

    /// The initial values of segment `seg` alone (see [`crate::init_segment`]).
    pub fn init_segment(&self, seed: u64, seg: usize) -> Vec<f32> {
        crate::layout::init_segment_with(&self.cfg, self.adapters, seed, seg)
    }

    /// The tensor-parallel rank this model is built for.
    pub fn tensor_rank(&self) -> TpRank {
        self.tp
    }

    /// The same model recomputing the blocks `checkpointing` selects in
    /// backward (keeping only their outputs in forward). Gradients are
    /// bit-identical: the same kernels run on the same inputs.
    pub fn with_checkpointing(mut self, checkpointing: Checkpointing) -> Self {
        self.checkpointing = checkpointing;
        self.acts = Acts::default();
        self.slots = Slots::default();
        self
    }

    /// Which blocks are recomputed.
    pub fn checkpointing(&self) -> Checkpointing {
        self.checkpointing
    }

    /// The storage precision of activations.
    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// The model's shape.
    pub fn config(&self) -> &GptConfig {
        &self.cfg
    }

    /// Parameter ranges of block `idx`.
    pub fn block_params(&self, idx: usize) -> &BlockParams {
        &self.ranges.blocks[idx]
    }

    /// Adds label smoothing and z-loss to the training loss (the reported
    /// loss stays plain cross-entropy, see [`engine::MicroStepStats`]).
    pub fn set_loss_terms(&mut self, terms: engine::LossTerms) {
        self.loss_terms = terms;
    }

    /// Bytes of activations and backward scratch currently allocated.
    pub fn activation_bytes(&self) -> usize {
        self.acts.bytes() + self.slots.parked().map(Acts::bytes).sum::<usize>()
    }

    /// Bytes of the activations kept from forward for backward: every
    /// block's saved tensors (16-bit under mixed precision; a recomputed
    /// block's output only, plus the one block being recomputed) and the
    /// embeddings.
    pub fn saved_activation_bytes(&self) -> usize {
        self.acts.stack.saved_bytes() + self.slots.parked().map(|a| a.stack.saved_bytes()).sum::<usize>()
    }

    /// The sizes of every activation buffer a micro-step on `b` sequences
    /// of `t` tokens allocates (their [`ActSizes::bytes`] is what
    /// [`Gpt::activation_bytes`] reports then).
    pub fn act_sizes(&self, b: usize, t: usize) -> ActSizes {
        let how = (self.precision, self.checkpointing);
        ActSizes::adapted(&self.cfg, (self.tp, self.adapters), (b, t), how, Part::of(&self.stage))
    }

    /// Errors unless this model runs all of itself (not a pipeline stage).
    fn whole_model_for(&self, what: &str) -> Result<(), GptError> {
        self.stage.require_whole(what).map_err(GptError::InvalidBatch)
    }

    fn check(&self, batch: &Batch) -> Result<(), GptError> {
        match batch.problem(self.cfg.block_size, "block_size", self.cfg.vocab_size) {
            Some(p) => Err(GptError::InvalidBatch(p)),
            None => Ok(()),
        }
    }

    /// Makes micro-batch slot `flight` current, sized for `b` sequences of `t` tokens.
    fn ensure_acts(&mut self, flight: usize, b: usize, t: usize) {
        self.slots.enter(&mut self.acts, flight, self.stage.in_flight.max(1), carry);
        let sizes = self.act_sizes(b, t);
        if self.acts.sizes.as_ref() != Some(&sizes) {
            // The old buffers go before the new ones are allocated: micro-batches
            // of changing length would otherwise hold both at once.
            self.acts = Acts::default();
            self.acts = Acts::new(sizes, b, t);
        }
    }

    /// Shapes of a block call at the current (B, T).
    fn dims(&self) -> Dims {
        let cfg = &self.cfg;
        let (nh, hd, w) = (cfg.n_head / self.tp.size, cfg.head_dim(), Widths::of(cfg, self.tp));
        Dims { b: self.acts.b, t: self.acts.t, c: cfg.n_embd, nh, hd, w }
    }

    fn lnf_seg(&self) -> usize {
        1 + self.cfg.n_layer
    }

    /// The segments of this stage's blocks.
    fn stage_segs(&self) -> Range<usize> {
        1 + self.stage.blocks.start..1 + self.stage.blocks.end
    }

    /// Forward through this stage in the current micro-batch slot: from
    /// the embeddings (first stage) or `input`, keeping what the backward
    /// needs when `train` — on the last stage through the final LayerNorm
    /// and the tied head into `logits`, leaving segment 0 (the embeddings,
    /// whose `wte` is the head) held. The rows' positions start at
    /// `attn`'s first position.
    fn forward(
        &mut self,
        store: &mut dyn ParamStore,
        batch: &Batch,
        input: &[f32],
        (train, attn): (bool, Attention<'_>),
    ) -> Result<(), GptError> {
        let (t, c, v) = (self.acts.t, self.cfg.n_embd, self.cfg.vocab_size);
        self.acts.pos.clone_from(&batch.positions);
        self.acts.docs = batch.doc_starts();
        let n = self.acts.b * t;
        let (wte, wpe) = (self.ranges.wte.clone(), self.ranges.wpe.clone());
        if self.stage.is_first() {
            {
                let seg = store.segment(0)?;
                let x = &mut self.acts.stack.x;
                let wpe = &seg.params[wpe][attn.first_position() * c..];
                let wte = &seg.params[wte.clone()];
                let pos = Positions { t, ids: &self.acts.pos };
                nn::embed::embedding_forward(x, &batch.inputs, wte, Some(wpe), pos, c);
            }
            store.done(0, false)?;
        } else {
            self.acts.stack.x.copy_from_slice(input);
        }
        self.acts.stack.keep_input();
        let (d, prec, visible) = (self.dims(), self.precision, Visible::documents(&self.acts.docs));
        let block = GptBlock { r: &self.ranges.block_rel, d, prec, attn, visible, lora: self.lora_rank_scale() };
        self.acts.stack.forward(&block, store, self.stage_segs(), train)?;
        if !self.stage.is_last() {
            return Ok(());
        }
        let lnf = self.lnf_seg();
        {
            let seg = store.segment(lnf)?;
            let acts = &mut self.acts;
            layernorm_forward(
                &mut acts.lnf,
                &mut acts.lnf_mean,
                &mut acts.lnf_rstd,
                &acts.stack.x,
                &seg.params[..c],
                &seg.params[c..2 * c],
                c,
            );
        }
        store.done(lnf, false)?;
        // logits = lnf · wteᵀ (the head is tied to the token embedding):
        // (B*T, C) @ (C, V) -> (B*T, V)
        let seg = store.segment(0)?;
        nn::linear::head_gemm(
            GemmDims { m: n, n: v, k: c },
            &mut self.acts.logits,
            GemmOut::overwrite(v),
            Strided::rows(&self.acts.lnf, c),
            Strided::transposed(&seg.params[wte], c),
            nn::parallelism(false).with(nn::operands(self.precision)),
        );
        Ok(())
    }

    /// The last stage's backward from `dlogits` (held in `logits`) through
    /// the head and the final LayerNorm into the residual gradient;
    /// segment 0 is still held from the forward pass.
    fn head_backward(&mut self, store: &mut dyn ParamStore) -> Result<(), GptError> {
        let (t, c, v) = (self.acts.t, self.cfg.n_embd, self.cfg.vocab_size);
        let n = self.acts.b * t;
        let wte = self.ranges.wte.clone();
        let prec = self.precision;
        let par = nn::parallelism(false).with(nn::operands(prec));
        if prec == Precision::F16 {
            // The scaled logits gradient in f16: this is where a too-large loss scale overflows.
            prec.round(&mut self.acts.logits);
        }
        {
            let SegmentView { params, mut grads, .. } = store.segment(0)?;
            let acts = &mut self.acts;
            // dlnf = dlogits · wte: (B*T, V) @ (V, C) -> (B*T, C)
            nn::linear::head_gemm(
                GemmDims { m: n, n: c, k: v },
                &mut acts.stack.bufs[DC],
                GemmOut::overwrite(c),
                Strided::rows(&acts.logits, v),
                Strided::rows(&params[wte.clone()], c),
                par,
            );
            // dwte (+)= dlogitsᵀ · lnf: (V, B*T) @ (B*T, C) -> (V, C)
            if let Some(g) = grads.tensor(wte.clone()) {
                nn::linear::head_gemm(
                    GemmDims { m: v, n: c, k: n },
                    g.buf,
                    GemmOut { offset: 0, rs: c, accumulate: g.accumulate },
                    Strided::transposed(&acts.logits, v),
                    Strided::rows(&acts.lnf, c),
                    par,
                );
            }
        }
        // The head's share of wte's gradient is complete for this pass.
        store.done(0, true)?;
        let lnf = self.lnf_seg();
        {
            let SegmentView { params, mut grads, .. } = store.segment(lnf)?;
            let acts = &mut self.acts;
            let [dres, dc, ..] = &mut acts.stack.bufs[..] else { unreachable!("GPT-2's working buffers") };
            dres.fill(0.0);
            let (gw, gb) = grads.pair(0..c, c..2 * c);
            // stack.x is still the last block's output.
            let lnf = NormSaved { inp: &acts.stack.x, mean: &acts.lnf_mean, rstd: &acts.lnf_rstd };
            layernorm_backward(dres, param_grad(gw), param_grad(gb), dc, lnf, &params[..c]);
        }
        store.done(lnf, true)?;
        Ok(())
    }

    /// Backward of the current micro-batch slot through this stage's
    /// blocks from the residual gradient (in the stack's working buffer),
    /// then the embeddings (first stage) — frozen tensors' weight
    /// gradients are not computed.
    fn blocks_backward(&mut self, store: &mut dyn ParamStore, inputs: &[u32]) -> Result<(), GptError> {
        let (t, c) = (self.acts.t, self.cfg.n_embd);
        let (wte, wpe) = (self.ranges.wte.clone(), self.ranges.wpe.clone());
        let (d, prec, visible) = (self.dims(), self.precision, Visible::documents(&self.acts.docs));
        let attn = Attention::Causal;
        let block = GptBlock { r: &self.ranges.block_rel, d, prec, attn, visible, lora: self.lora_rank_scale() };
        self.acts.stack.backward(&block, store, self.stage_segs())?;
        if !self.stage.is_first() {
            return Ok(());
        }
        {
            let SegmentView { mut grads, .. } = store.segment(0)?;
            let (gwte, gwpe) = grads.pair(wte, wpe);
            // The embeddings' gradient is only ever added to.
            let (gwte, gwpe) = (gwte.map(GradOut::for_adding), gwpe.map(GradOut::for_adding));
            let pos = Positions { t, ids: &self.acts.pos };
            nn::embed::embedding_backward(gwte, gwpe, &self.acts.stack.bufs[DRES], inputs, pos, c);
        }
        store.done(0, true)?;
        Ok(())
    }

    /// Sums the per-row losses in row order (f64, deterministic).
    fn loss_sum(&self, n: usize) -> f64 {
        nn::loss::loss_sum(&self.acts.losses, n)
    }

    /// Logits of the last position of `tokens` (one sequence), for
    /// sampling; with a key/value cache ([`Gpt::set_kv_cache`]) only the
    /// tokens past the cached positions run.
    pub fn next_token_logits(&mut self, params: &[f32], tokens: &[u32]) -> Result<Vec<f32>, GptError> {
        match self.kv.take() {
            Some(kv) => self.cached_next_token_logits(params, tokens, kv),
            None => self.last_logits(params, tokens, Attention::Causal),
        }
    }

    /// Logits of the last of `tokens` (one sequence, its positions from
    /// `attn`'s first one), running them as one forward-only batch.
    fn last_logits(&mut self, params: &[f32], tokens: &[u32], attn: Attention<'_>) -> Result<Vec<f32>, GptError> {
        let (t, v) = (tokens.len(), self.cfg.vocab_size);
        self.logits_of(params, &Batch::prompt(tokens), attn)?;
        Ok(self.acts.logits[(t - 1) * v..t * v].to_vec())
    }

    /// Runs `batch` forward only (its positions from `attn`'s first one),
    /// leaving every row's logits in the activations.
    fn logits_of(&mut self, params: &[f32], batch: &Batch, attn: Attention<'_>) -> Result<(), GptError> {
        self.check(batch)?;
        self.whole_model_for("a forward pass over the whole model")?;
        self.ensure_acts(0, batch.n_seqs, batch.seq_len);
        let mut store = FullStore::read_only(&self.layout, self.segments(), params)?;
        self.forward(&mut store, batch, &[], (false, attn))?;
        Ok(store.done(0, false)?)
    }

    /// Logits `[B·T, V]` of every position of `batch` (targets unused).
    pub fn logits(&mut self, params: &[f32], batch: &Batch) -> Result<Vec<f32>, GptError> {
        self.logits_of(params, batch, Attention::Causal)?;
        Ok(self.acts.logits.clone())
    }
}

impl Model for Gpt {
    type Batch = Batch;
    type Error = GptError;

    fn layout(&self) -> &ParamLayout {
        &self.layout
    }

    /// A frozen tensor's weight-gradient computation is skipped.
    fn set_trainable(&mut self, trainable: &dyn Fn(&engine::TensorSpec) -> bool) -> usize {
        self.layout.set_trainable(trainable)
    }

    fn segments(&self) -> Vec<Range<usize>> {
        let r = &self.ranges;
        std::iter::once(r.wte.start..r.wpe.end)
            .chain(r.blocks.iter().map(|b| b.span()))
            .chain(std::iter::once(r.lnf_w.start..r.lnf_b.end))
            .collect()
    }

    fn n_targets(&self, batch: &Batch) -> u64 {
        batch.n_targets()
    }

    /// A batch of zero sequences (a rank without data in the tail) runs the
    /// same code on zero rows: the same segment visits and collectives as
    /// every other rank, and a zero gradient.
    fn micro_step(
        &mut self,
        store: &mut dyn ParamStore,
        batch: &Batch,
        grad_scale: f32,
    ) -> Result<MicroStepStats, GptError> {
        self.whole_model_for("a micro-step")?;
        let stats = self.stage_forward(store, batch, 0, &[], &mut [], Some(grad_scale))?;
        self.stage_backward(store, batch, 0, &[], &mut [])?;
        Ok(stats)
    }

    fn loss(&mut self, store: &mut dyn ParamStore, batch: &Batch) -> Result<MicroStepStats, GptError> {
        self.whole_model_for("evaluation")?;
        self.stage_forward(store, batch, 0, &[], &mut [], None)
    }
}

impl StagedModel for Gpt {
    fn n_blocks(&self) -> usize {
        self.cfg.n_layer
    }

    fn tied_head(&self) -> bool {
        true
    }

    fn tensor_shards(&self) -> Option<engine::TensorShards> {
        crate::split::shards(&self.cfg, self.tp, &self.layout).ok()
    }

    fn set_stage(&mut self, spec: StageSpec) {
        self.stage = spec;
        self.acts = Acts::default();
        self.slots = Slots::default();
    }

    fn boundary_len(&self, batch: &Batch) -> usize {
        batch.n_seqs * batch.seq_len * self.cfg.n_embd
    }

    fn stage_forward(
        &mut self,
        store: &mut dyn ParamStore,
        batch: &Batch,
        slot: usize,
        input: &[f32],
        output: &mut [f32],
        loss_seed: Option<f32>,
    ) -> Result<MicroStepStats, GptError> {
        self.check(batch)?;
        let n = batch.n_seqs * batch.seq_len;
        let want = n * self.cfg.n_embd;
        self.stage
            .check_io(("the stage's input", input.len()), ("the stage's output", output.len()), want)
            .map_err(GptError::InvalidBatch)?;
        self.ensure_acts(slot, batch.n_seqs, batch.seq_len);
        self.forward(store, batch, input, (loss_seed.is_some(), Attention::Causal))?;
        if !self.stage.is_last() {
            output.copy_from_slice(&self.acts.stack.x);
            return Ok(MicroStepStats::default());
        }
        if loss_seed.is_none() {
            store.done(0, false)?;
        }
        let aux_sum = nn::loss_terms::softmax_cross_entropy_with(
            &mut self.acts.logits,
            &mut self.acts.losses,
            &batch.targets,
            self.cfg.vocab_size,
            loss_seed,
            self.loss_terms,
        );
        let stats = MicroStepStats { loss_sum: self.loss_sum(n), n_targets: batch.n_targets(), aux_sum };
        if loss_seed.is_some() {
            self.head_backward(store)?;
        }
        Ok(stats)
    }

    fn stage_backward(
        &mut self,
        store: &mut dyn ParamStore,
        batch: &Batch,
        slot: usize,
        grad_out: &[f32],
        grad_in: &mut [f32],
    ) -> Result<(), GptError> {
        let n = batch.n_seqs * batch.seq_len;
        let want = n * self.cfg.n_embd;
        // Read as a backward: the gradient of the output comes in (not on
        // the last stage), that of the input goes out (not on the first).
        self.stage
            .check_io(
                ("the gradient of the stage's input", grad_in.len()),
                ("the gradient of the stage's output", grad_out.len()),
                want,
            )
            .map_err(GptError::InvalidBatch)?;
        self.ensure_acts(slot, batch.n_seqs, batch.seq_len);
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
