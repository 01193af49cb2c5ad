//! The GPT-2 model: its block ([`crate::block`]) walked by `nn::stack`
//! inside `nn::shell`'s decoder — the token and learned position
//! embeddings, the final LayerNorm and the head tied to the embedding.
//!
//! Each block reads only its own segment's parameters and activations, so
//! a block can be recomputed (activation checkpointing) or its parameters
//! gathered just before it runs (ZeRO-3).

use crate::block::{ActSizes, Dims, GptBlock};
use crate::config::GptConfig;
use crate::error::GptError;
use crate::frozen::FrozenBase;
use crate::layout::{build_layout, conv_shape, Adapters, BlockParams, ParamRanges, Widths, TARGETS};
use engine::{Checkpointing, ParamStore, Precision, TpRank};
use nn::flash::Visible;
use nn::kv::Attention;
use nn::lora::LoraConfig;
use nn::lora_dropout::Dropout;
use nn::shell::{Acts, Decoder, Ends, FinalNorm, Pass, Shell, Walk};
use std::ops::Range;
use std::sync::Arc;

pub use engine::batch::{TokenBatch as Batch, IGNORE_INDEX};

mod decode;

/// The GPT-2 model with its activation buffers.
#[derive(Debug)]
pub struct Gpt {
    cfg: GptConfig,
    ranges: ParamRanges,
    /// The embeddings, final LayerNorm and tied head around the blocks;
    /// the activations.
    shell: Shell<Option<Dropout>>,
    /// The tensor-parallel rank this model is built for (whole: all of it).
    tp: TpRank,
    /// LoRA adapters on the linear layers, if any.
    lora: Option<LoraConfig>,
    adapters: Option<Adapters>,
    /// The optimizer step (keys LoRA dropout's masks).
    step: u64,
    /// Whether the layout leaves the `Conv1D` weights out (a packed base).
    packed: bool,
    /// The packed frozen base (shared by the models of the process).
    base: Option<Arc<FrozenBase>>,
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
    /// holds ([`crate::shard`]): `n_head / T` heads and `4C / T` MLP
    /// columns of every block, the embeddings and norms whole;
    /// [`engine::StagedModel::tensor_shards`] maps its layout onto the whole model's.
    pub fn tensor_parallel(cfg: GptConfig, precision: Precision, tp: TpRank) -> Result<Self, GptError> {
        Self::assemble(cfg, precision, tp, None, false)
    }

    /// A model with LoRA adapters on `lora`'s target layers (`c_attn`,
    /// `c_proj`, `c_fc` as PEFT names them, or `all-linear`); its layout
    /// holds the base tensors and, at the end of each block, the adapters
    /// (`….attn.c_attn.lora_A.weight` `[r, C]`, `lora_B` `[3C, r]`, ...).
    pub fn with_lora(cfg: GptConfig, lora: LoraConfig, precision: Precision) -> Result<Self, GptError> {
        Self::assemble(cfg, precision, TpRank::WHOLE, Some(lora), false)
    }

    /// [`Gpt::with_lora`] as tensor-parallel rank `tp` holds it: each
    /// adapter cut with its layer ([`crate::shard`]).
    pub fn tensor_parallel_with_lora(
        cfg: GptConfig,
        lora: LoraConfig,
        precision: Precision,
        tp: TpRank,
    ) -> Result<Self, GptError> {
        Self::assemble(cfg, precision, tp, Some(lora), false)
    }

    /// A model whose layout leaves the four `Conv1D` weights of every
    /// block out, as [`Gpt::with_frozen_base`]'s does, before any base is
    /// loaded (`lora`: its adapters; none: the base's other tensors, what
    /// is read beside a packed base). It runs no pass.
    pub fn with_packed_layout(cfg: GptConfig, lora: Option<LoraConfig>) -> Result<Self, GptError> {
        Self::assemble(cfg, Precision::F32, TpRank::WHOLE, lora, true)
    }

    /// A model with `lora`'s adapters whose `Conv1D` weights are `base`,
    /// packed and frozen, outside the layout.
    pub fn with_frozen_base(
        cfg: GptConfig,
        lora: LoraConfig,
        precision: Precision,
        base: Arc<FrozenBase>,
    ) -> Result<Self, GptError> {
        if base.n_layers() != cfg.n_layer {
            let problem = format!("a frozen base of {} blocks for a model of {}", base.n_layers(), cfg.n_layer);
            return Err(GptError::InvalidConfig(problem));
        }
        let model = Self::assemble(cfg, precision, TpRank::WHOLE, Some(lora), true)?;
        Ok(Self { base: Some(base), ..model })
    }

    /// Whether the layout leaves the `Conv1D` weights out (a packed base).
    pub fn packs_base(&self) -> bool {
        self.packed
    }

    fn assemble(
        cfg: GptConfig,
        precision: Precision,
        tp: TpRank,
        lora: Option<LoraConfig>,
        packed: bool,
    ) -> Result<Self, GptError> {
        cfg.validate()?;
        crate::shard::check(&cfg, tp)?;
        let adapters = lora.as_ref().map(|l| Self::size_adapters(&cfg, l, tp)).transpose()?;
        let (layout, ranges) = build_layout(&cfg, Widths::of(&cfg, tp), adapters, packed);
        let ends = Ends {
            width: cfg.n_embd,
            vocab: Widths::of(&cfg, tp).v,
            tp,
            cp: engine::ContextRank::WHOLE,
            n_blocks: cfg.n_layer,
            context: (cfg.block_size, "block_size"),
            embed: ranges.wte.clone(),
            positions: Some(ranges.wpe.clone()),
            embed_scale: None,
            norm: FinalNorm::Layer,
            head: None,
            soft_cap: None,
            frozen_embed: None,
        };
        let shell = Shell::new(ends, layout, precision);
        Ok(Self { cfg, ranges, shell, tp, lora, adapters, step: 0, packed, base: None })
    }

    /// Checks `lora` for GPT-2 (what is not implemented for its block is
    /// named with the fix) and sizes its adapters.
    fn size_adapters(cfg: &GptConfig, lora: &LoraConfig, tp: TpRank) -> Result<Adapters, GptError> {
        lora.validate(&TARGETS)?;
        let refuse = |field: &str, problem: String| Err(nn::lora::LoraError::invalid(field, problem).into());
        let on = lora.targets(&TARGETS)?;
        let targets: [bool; 4] = std::array::from_fn(|i| on[i]);
        // Split, a row-parallel layer's row norms span the ranks.
        if tp.is_split() && lora.use_dora && (targets[1] || targets[3]) {
            return refuse(
                "use_dora",
                format!(
                    "on c_proj (row-parallel) is not supported with tensor parallelism ({} ranks); target c_attn and c_fc only, or set dist.tensor_parallel = 1",
                    tp.size
                ),
            );
        }
        let w = Widths::of(cfg, tp);
        let per_layer: u128 = (0..4)
            .filter(|&i| targets[i])
            .map(|i| {
                let [inp, out] = conv_shape(i, cfg.n_embd, w).map(|d| d as u128);
                lora.r as u128 * (inp + out) + if lora.use_dora { out } else { 0 }
            })
            .sum();
        let n = cfg.param_count() + cfg.n_layer as u128 * per_layer;
        let per_target = if lora.use_dora { 3 } else { 2 };
        let tensors = 12 + per_target * targets.iter().filter(|&&t| t).count() as u128;
        engine::check_shape_size(n, cfg.n_layer, tensors, 4).map_err(GptError::InvalidConfig)?;
        Ok(Adapters { r: lora.r, targets, dora: lora.use_dora, dropout: lora.dropout > 0.0 })
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
        crate::layout::init_segment_with(&self.cfg, (self.adapters, self.packed), seed, seg)
    }

    /// The tensor-parallel rank this model is built for.
    pub fn tensor_rank(&self) -> TpRank {
        self.tp
    }

    /// The same model recomputing the blocks `checkpointing` selects in
    /// backward (keeping only their outputs in forward). Gradients are
    /// bit-identical: the same kernels run on the same inputs.
    pub fn with_checkpointing(mut self, checkpointing: Checkpointing) -> Self {
        self.shell.checkpointing = checkpointing;
        self.shell.reset();
        self
    }

    /// Which blocks are recomputed.
    pub fn checkpointing(&self) -> Checkpointing {
        self.shell.checkpointing
    }

    /// The storage precision of activations.
    pub fn precision(&self) -> Precision {
        self.shell.precision
    }

    /// The model's shape.
    pub fn config(&self) -> &GptConfig {
        &self.cfg
    }

    /// Parameter ranges of block `idx`.
    pub fn block_params(&self, idx: usize) -> &BlockParams {
        &self.ranges.blocks[idx]
    }

    /// A block's parameter ranges relative to its first parameter.
    pub(crate) fn block_rel(&self) -> &BlockParams {
        &self.ranges.block_rel
    }

    /// Adds label smoothing and z-loss to the training loss (the reported
    /// loss stays plain cross-entropy, see [`engine::MicroStepStats`]).
    pub fn set_loss_terms(&mut self, terms: engine::LossTerms) {
        self.shell.loss_terms = terms;
    }

    /// Bytes of activations and backward scratch currently allocated.
    pub fn activation_bytes(&self) -> usize {
        self.shell.activation_bytes()
    }

    /// Bytes of the activations kept from forward for backward: every
    /// block's saved tensors (16-bit under mixed precision; a recomputed
    /// block's output only, plus the one block being recomputed) and the
    /// embeddings.
    pub fn saved_activation_bytes(&self) -> usize {
        self.shell.saved_activation_bytes()
    }

    /// The sizes of every activation buffer a micro-step on `b` sequences
    /// of `t` tokens allocates (their [`ActSizes::bytes`] is what
    /// [`Gpt::activation_bytes`] reports then).
    pub fn act_sizes(&self, b: usize, t: usize) -> ActSizes {
        let how = (self.shell.precision, self.shell.checkpointing);
        ActSizes::adapted(&self.cfg, (self.tp, self.adapters), (b, t), how, self.shell.part())
    }

    /// Logits of the last position of `tokens` (one sequence), for
    /// sampling; with a key/value cache ([`Gpt::set_kv_cache`]) only the
    /// tokens past the cached positions run.
    pub fn next_token_logits(&mut self, params: &[f32], tokens: &[u32]) -> Result<Vec<f32>, GptError> {
        nn::shell::next_token_logits(self, params, tokens)
    }

    /// Logits `[B·T, V]` of every position of `batch` (targets unused).
    pub fn logits(&mut self, params: &[f32], batch: &Batch) -> Result<Vec<f32>, GptError> {
        nn::shell::logits(self, params, batch)
    }
}

impl Decoder for Gpt {
    type Error = GptError;
    type Extra = Option<Dropout>;

    fn shell(&self) -> &Shell<Option<Dropout>> {
        &self.shell
    }

    fn shell_mut(&mut self) -> &mut Shell<Option<Dropout>> {
        &mut self.shell
    }

    fn invalid_batch(problem: String) -> GptError {
        GptError::InvalidBatch(problem)
    }

    /// GPT-2's buffers do not depend on the pass.
    fn new_acts(&self, b: usize, t: usize, _train: bool) -> Acts<Option<Dropout>> {
        let s = self.act_sizes(b, t);
        Acts::new(&s.stack, s.head, (b, t), None)
    }

    /// Forward: the LoRA dropout masks of a training pass drawn first.
    fn walk(&mut self, store: &mut dyn ParamStore, batch: &Batch, walk: Walk<'_>) -> Result<(), GptError> {
        if let Walk::Forward(pass, _) = walk {
            let p_drop = self.lora.as_ref().map_or(0.0, |l| l.dropout);
            self.shell.acts.extra = (pass == Pass::Train && p_drop > 0.0)
                .then(|| Dropout::new(p_drop, self.step, batch).on_rank(self.tp.rank));
        }
        if self.packed && self.base.is_none() {
            return Err(GptError::InvalidConfig("a packed layout without its frozen base cannot run a pass".into()));
        }
        let cfg = &self.cfg;
        let (nh, w) = (cfg.n_head / self.tp.size, Widths::of(cfg, self.tp));
        let lora = self.lora_rank_scale();
        let (segs, prec, a) = (self.shell.block_segs(), self.shell.precision, &mut self.shell.acts);
        let scratch = &mut self.shell.scratch;
        let seq = self.tp.held_rows(a.b * a.t);
        let cx = nn::context::Context { rank: self.shell.ends.cp, t: a.whole_t };
        let d = Dims { b: a.b, t: a.t, c: cfg.n_embd, nh, hd: cfg.head_dim(), w, seq, cx };
        let attn = match walk {
            Walk::Forward(_, attn) => attn,
            Walk::Backward => Attention::Causal,
        };
        let (r, visible) = (&self.ranges.block_rel, Visible::documents(&a.docs));
        let (drop, at) = (a.extra.as_ref(), std::cell::Cell::new(0));
        let base = self.base.as_deref();
        let block = GptBlock { r, d, prec, attn, visible, lora, drop, at, base };
        match walk {
            Walk::Forward(pass, _) => a.stack.forward(&block, store, (segs, scratch), pass == Pass::Train)?,
            Walk::Backward => a.stack.backward(&block, store, (segs, scratch))?,
        }
        Ok(())
    }

    fn segments(&self) -> Vec<Range<usize>> {
        let r = &self.ranges;
        std::iter::once(r.wte.start..r.wpe.end)
            .chain(r.blocks.iter().map(|b| b.span()))
            .chain(std::iter::once(r.lnf_w.start..r.lnf_b.end))
            .collect()
    }

    fn tensor_shards(&self) -> Option<engine::TensorShards> {
        crate::shard::shards(&self.cfg, self.tp, &self.shell.layout, self.adapters).ok()
    }

    fn begin_step(&mut self, step: u64) {
        self.step = step;
    }
}

nn::impl_decoder!(Gpt);
