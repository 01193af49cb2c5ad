//! The Llama model: its layer ([`crate::block`]) walked by `nn::stack`
//! inside `nn::shell`'s decoder — the embedding (scaled for Gemma), the
//! final RMSNorm and the head (tied or not, soft-capped for Gemma 2).
//!
//! Each layer reads only its own segment's parameters and activations, so
//! a layer's parameters can be gathered just before it runs (ZeRO-3) or the
//! layer recomputed later (activation checkpointing).

use crate::block::{ActSizes, Dims, Layer};
use crate::config::LlamaConfig;
use crate::error::LlamaError;
use crate::frozen::FrozenBase;
use crate::layout::{build_layout, Adapters, LayerParams, ParamRanges, Proj};
use engine::rng::SplitMix64;
use engine::{Checkpointing, Model, ParamStore, Precision, StageSpec, TensorShards, TpRank};
use nn::attention::AttnShape;
use nn::kv::Attention;
use nn::lora::LoraConfig;
use nn::lora_dropout::Dropout;
use nn::rope::Rope;
use nn::shell::{Acts, Decoder, Ends, FinalNorm, Pass, Shell, Walk};
use nn::stack::Part;
use nn::{Operands, Positions};
use std::cell::Cell;
use std::ops::Range;
use std::sync::Arc;

pub use engine::batch::{TokenBatch, IGNORE_INDEX};

mod decode;
mod moe;

/// Llama's buffers of one micro-batch in flight outside the layer stack.
#[derive(Debug, Default)]
pub struct LlamaActs {
    /// The rotary tables of the micro-batch's rows.
    rope: Rope,
    /// The micro-batch's LoRA dropout masks (training passes with dropout).
    drop: Option<Dropout>,
    /// A mixture's routing tally and router-loss coefficients of this micro-batch.
    moe: std::sync::Mutex<crate::block::MoeState>,
}

impl nn::shell::Extra for LlamaActs {
    fn bytes(&self) -> usize {
        4 * (self.rope.cos.len() + self.rope.sin.len())
    }
}

/// The Llama model with its activation buffers.
#[derive(Debug)]
pub struct Llama {
    cfg: LlamaConfig,
    lora: Option<LoraConfig>,
    adapters: Option<Adapters>,
    ranges: ParamRanges,
    /// The embedding, final norm and head around the layers; the activations.
    shell: Shell<LlamaActs>,
    /// Built for one rank of a tensor-parallel group (`cfg` is its shape).
    split: Option<Box<RankShard>>,
    /// The frozen projections, packed outside the layout (shared by the
    /// models of one process); `None`: they are f32 tensors of the layout.
    base: Option<Arc<FrozenBase>>,
    /// The layout leaves the projections' weights out (held in `base`).
    packed: bool,
    /// Whether the token embedding is kept packed too (forward passes only).
    packed_embed: bool,
    /// The optimizer step being taken ([`engine::Model::begin_step`]): LoRA
    /// dropout's masks are keyed on it.
    step: u64,
    /// A mixture's global-batch routing counts of step `.0`
    /// ([`engine::Model::set_step_stats`]): per expert its choices, then the
    /// (layer, row) pairs routed and the targets.
    step_stats: Option<(u64, Vec<f64>)>,
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
    Layer { cfg, r, rope, d, attn, pos, visible, base, at: Cell::new(0), drop: None, moe: None, counting: false }
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
    /// holds of the model shaped `whole` ([`LlamaConfig::for_rank`]): its
    /// layout is that rank's slices and the replicated tensors;
    /// [`engine::StagedModel::tensor_shards`] maps it onto the whole model's.
    pub fn tensor_parallel(
        whole: LlamaConfig,
        lora: Option<LoraConfig>,
        precision: Precision,
        tp: TpRank,
    ) -> Result<Self, LlamaError> {
        if !tp.is_split() {
            return Self::build(whole, lora, precision);
        }
        if let Some(l) = lora.as_ref().filter(|_| whole.fused_modules) {
            let targets = crate::layout::targets(l, true)?;
            if targets[Proj::Q as usize] || targets[Proj::Gate as usize] {
                return Err(LlamaError::lora(
                    "target_modules",
                    format!(
                        "on fused modules (qkv_proj, gate_up_proj: one adapter over q|k|v, whose rows the ranks cut by heads) is not supported with tensor parallelism ({} ranks); target o_proj and down_proj only, or set dist.tensor_parallel = 1",
                        tp.size
                    ),
                ));
            }
        }
        // A row-parallel projection's row norms span the ranks.
        if let Some(l) = lora.as_ref().filter(|l| l.use_dora) {
            let targets = crate::layout::targets(l, whole.fused_modules)?;
            if let Some(p) = [Proj::O, Proj::Down].into_iter().find(|&p| targets[p as usize]) {
                return Err(LlamaError::lora(
                    "use_dora",
                    format!(
                        "on {} (row-parallel) is not supported with tensor parallelism ({} ranks); target the q/k/v and gate/up projections only, or set dist.tensor_parallel = 1",
                        p.name(),
                        tp.size
                    ),
                ));
            }
        }
        let local = whole.for_rank(tp)?;
        let whole = Self::build(whole, lora.clone(), Precision::F32)?;
        let mut model = Self::assemble(local, lora, (precision, tp), None, (false, false))?;
        let split = RankShard { tp, whole };
        split.shards(&model)?;
        model.split = Some(Box::new(split));
        Ok(model)
    }

    fn build(cfg: LlamaConfig, lora: Option<LoraConfig>, precision: Precision) -> Result<Self, LlamaError> {
        cfg.validate()?;
        Self::assemble(cfg, lora, (precision, TpRank::WHOLE), None, (false, false))
    }

    /// A model whose layout leaves the projections' weights out, as
    /// [`Llama::with_frozen_base`]'s does, before any base is loaded: for
    /// layouts, initialisation and plans (it cannot run a pass).
    pub fn with_packed_layout(cfg: LlamaConfig, lora: Option<LoraConfig>) -> Result<Self, LlamaError> {
        cfg.validate()?;
        Self::assemble(cfg, lora, (Precision::F32, TpRank::WHOLE), None, (true, false))
    }

    /// [`Llama::with_packed_layout`] without the token embedding either
    /// (a model file read for `generate` / `eval` with its embedding kept
    /// packed too, [`FrozenBase::embedding`], with `lora`'s adapters when
    /// given): forward passes only.
    pub fn with_packed_embedding_layout(cfg: LlamaConfig, lora: Option<LoraConfig>) -> Result<Self, LlamaError> {
        cfg.validate()?;
        Self::assemble(cfg, lora, (Precision::F32, TpRank::WHOLE), None, (true, true))
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
        let embed = base.embedding().is_some();
        Self::assemble(cfg, lora, (precision, TpRank::WHOLE), Some(base), (true, embed))
    }

    /// Whether the layout leaves the projections' weights out (a packed base).
    pub fn packs_base(&self) -> bool {
        self.packed
    }

    /// The same shape without adapters, with the same layout of the base
    /// (packed or not): the layout base parameters are handed over in.
    pub fn plain(&self) -> Result<Self, LlamaError> {
        match (self.packed, self.packed_embed) {
            (true, true) => Self::with_packed_embedding_layout(self.cfg.clone(), None),
            (true, false) => Self::with_packed_layout(self.cfg.clone(), None),
            (false, _) => Self::new(self.cfg.clone()),
        }
    }

    /// The packed frozen base, if the projections are held outside the layout.
    pub fn frozen_base(&self) -> Option<&Arc<FrozenBase>> {
        self.base.as_ref()
    }

    /// The model of a shape already checked (a whole shape by
    /// [`LlamaConfig::validate`], a rank's by [`LlamaConfig::for_rank`],
    /// held by tensor-parallel rank `tp`: its vocabulary rows `cfg`'s).
    fn assemble(
        cfg: LlamaConfig,
        lora: Option<LoraConfig>,
        (precision, tp): (Precision, TpRank),
        base: Option<Arc<FrozenBase>>,
        (packed, packed_embed): (bool, bool),
    ) -> Result<Self, LlamaError> {
        let adapters = match &lora {
            Some(l) => {
                crate::layout::validate(l, cfg.fused_modules)?;
                let targets = crate::layout::targets(l, cfg.fused_modules)?;
                // The adapters' parameters and tensors count too.
                let on = Proj::ALL.into_iter().filter(|&p| targets[p as usize]).map(|p| p.adapter_shape(&cfg).0);
                let per_layer: u128 = on.clone().map(|s| s.iter().map(|&d| d as u128).sum::<u128>()).sum();
                // DoRA: a magnitude of `out` values per adapted projection.
                let (dora, per_tensor) = (l.use_dora as u128, 2 + l.use_dora as u128);
                let mags: u128 = dora * on.clone().map(|s| s[0] as u128).sum::<u128>();
                let n = cfg.param_count() + cfg.n_layer as u128 * (l.r as u128 * per_layer + mags);
                engine::check_shape_size(n, cfg.n_layer, cfg.tensors_per_layer() + per_tensor * on.count() as u128, 3)
                    .map_err(LlamaError::TooLarge)?;
                Some(Adapters { r: l.r, targets, dora: l.use_dora, dropout: l.dropout > 0.0 })
            }
            None => None,
        };
        Self::moe_refusals(&cfg, adapters, packed, tp)?;
        let (layout, ranges) = build_layout(&cfg, adapters, (packed, packed_embed));
        let ends = Ends {
            width: cfg.hidden_size,
            vocab: cfg.vocab_size,
            tp,
            cp: engine::ContextRank::WHOLE,
            n_blocks: cfg.n_layer,
            context: (cfg.max_position_embeddings, "max_position_embeddings"),
            embed: ranges.embed.clone(),
            positions: None,
            embed_scale: cfg.embed_scale(),
            norm: FinalNorm::Rms { eps: cfg.rms_norm_eps as f32, one_plus: cfg.gemma.is_some() },
            head: ranges.head.as_ref().map(|h| h.start - ranges.norm.start..h.end - ranges.norm.start),
            soft_cap: cfg.gemma.and_then(|g| g.final_softcap).map(|c| c as f32),
            frozen_embed: base.as_ref().and_then(|b| b.embedding().cloned()),
        };
        let shell = Shell::new(ends, layout, precision);
        Ok(Self {
            cfg,
            lora,
            adapters,
            ranges,
            shell,
            split: None,
            base,
            packed,
            packed_embed,
            step: 0,
            step_stats: None,
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
        self.shell.precision
    }

    /// Parameter ranges of layer `idx`.
    pub fn layer_params(&self, idx: usize) -> &LayerParams {
        &self.ranges.layers[idx]
    }

    /// The loss holds the logits of at most `rows` rows at once (`None`:
    /// [`nn::head::loss_chunk_rows`] of the vocabulary, what `plan` counts).
    pub fn with_loss_chunk(mut self, rows: Option<usize>) -> Self {
        self.shell.loss_chunk = rows;
        self
    }

    /// Adds label smoothing and z-loss to the training loss (the reported
    /// loss stays plain cross-entropy, see [`engine::MicroStepStats`]).
    pub fn set_loss_terms(&mut self, terms: engine::LossTerms) {
        self.shell.loss_terms = terms;
    }

    /// Bytes of activations and scratch currently allocated.
    pub fn activation_bytes(&self) -> usize {
        self.shell.activation_bytes()
    }

    /// The [`Llama::activation_bytes`] a training micro-step on `b`
    /// sequences of `t` tokens allocates, computed from the shape alone (u128:
    /// planning shapes far beyond this machine never overflows).
    pub fn planned_activation_bytes(&self, b: usize, t: usize) -> u128 {
        self.planned_activation_bytes_as(b, (t, None), self.shell.precision, self.shell.checkpointing)
    }

    /// [`Llama::planned_activation_bytes`] of this shape built with another
    /// storage precision and checkpointing (no model is built for it): the
    /// bytes of the [`ActSizes`] a training pass allocates from. `t`: the
    /// positions per sequence this rank runs and, under context
    /// parallelism, the whole sequences' (its rotary tables cover them).
    pub fn planned_activation_bytes_as(
        &self,
        b: usize,
        t: (usize, Option<usize>),
        precision: Precision,
        ck: Checkpointing,
    ) -> u128 {
        let part = self.shell.part();
        let s = ActSizes::new(&self.cfg, (self.shell.ends.tp, self.adapters), (b, t.0), (precision, ck), true, part);
        s.with_rope(t.1.unwrap_or(t.0), self.cfg.head_dim).bytes()
    }

    /// [`Llama::planned_activation_bytes_as`] of one pipeline stage of this
    /// shape: its layers, `spec.in_flight` micro-batches alive at once, the
    /// head's buffers on the last stage only.
    pub fn planned_stage_activation_bytes(
        &self,
        b: usize,
        t: (usize, Option<usize>),
        (precision, ck): (Precision, Checkpointing),
        spec: &StageSpec,
    ) -> u128 {
        let s = ActSizes::new(
            &self.cfg,
            (self.shell.ends.tp, self.adapters),
            (b, t.0),
            (precision, ck),
            true,
            Part::of(spec),
        );
        s.with_rope(t.1.unwrap_or(t.0), self.cfg.head_dim).bytes()
    }

    /// Bytes of the saved activations (every layer's slot and the embeddings' output).
    pub fn saved_activation_bytes(&self) -> usize {
        self.shell.saved_activation_bytes()
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
        if let Some(m) = &r.moe {
            let shared = m.shared.iter().flatten().cloned();
            for w in [m.router.clone(), m.experts.clone()].into_iter().chain(shared) {
                out[w.clone()].copy_from_slice(&normal(w.len()));
            }
        }
        self.init_adapters(seed, seg - 1, &mut out);
        self.init_magnitudes(seg - 1, &mut out, self.base.as_deref());
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
                layer[lr.a.clone()].copy_from_slice(&nn::lora::kaiming_uniform(&mut rng, lr.a.len(), fan_in));
                layer[lr.b.clone()].fill(0.0);
            }
        }
    }

    /// Sets layer `idx`'s DoRA magnitudes inside `layer` (the layer's segment
    /// of the parameters) to the row norms of its base weights: those in
    /// `layer`, or in `frozen` when the layout leaves them out (neither: left
    /// as they are — a packed layout without its base runs no pass).
    pub(crate) fn init_magnitudes(&self, idx: usize, layer: &mut [f32], frozen: Option<&FrozenBase>) {
        let (cfg, lp) = (&self.cfg, self.layer_params(idx));
        let at = |r: &Range<usize>| r.start - lp.attn_norm.start..r.end - lp.attn_norm.start;
        for (pr, lr) in Proj::ALL.into_iter().zip(&lp.lora) {
            let Some(m) = lr.as_ref().and_then(|l| l.m.as_ref()) else { continue };
            let ([oc, ic], _) = pr.adapter_shape(cfg);
            let mut mags = vec![0.0f32; oc];
            match (self.packs_base(), frozen) {
                (false, _) => {
                    let w = &layer[at(&lp.adapted_w(pr, cfg.fused_modules))];
                    nn::dora::initial_magnitude([oc, ic], &|rows| w[rows.start * ic..rows.end * ic].to_vec(), &mut mags)
                }
                (true, Some(b)) => {
                    // Rows of the projections the adapter spans, stacked.
                    let rows_of = |rows: Range<usize>| {
                        let (mut out, mut at) = (Vec::with_capacity(rows.len() * ic), 0);
                        for &part in pr.adapted(cfg.fused_modules) {
                            let n = part.shape(cfg)[0];
                            let (lo, hi) = (rows.start.max(at), rows.end.min(at + n));
                            if lo < hi {
                                out.extend(b.proj_rows(cfg, idx, part, lo - at..hi - at));
                            }
                            at += n;
                        }
                        out
                    };
                    nn::dora::initial_magnitude([oc, ic], &rows_of, &mut mags)
                }
                (true, None) => continue,
            }
            layer[at(m)].copy_from_slice(&mags);
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
            ops: nn::operands(self.shell.precision),
            prec: self.shell.precision,
            seq: self.shell.ends.tp.held_rows(b * t),
            cx: self.shell.context(),
            moe: cfg.moe.as_ref().map(|m| nn::moe::MoeShape {
                n: b * t,
                c: cfg.hidden_size,
                f: m.expert_size,
                experts: m.n_experts,
                top_k: m.top_k,
                norm_topk: m.norm_topk_prob,
                glu: cfg.glu(),
            }),
        }
    }

    /// The same model recomputing the layers `checkpointing` selects in
    /// backward (keeping only their outputs in forward). Gradients are
    /// bit-identical: the same kernels run on the same inputs.
    pub fn with_checkpointing(mut self, checkpointing: Checkpointing) -> Self {
        self.shell.checkpointing = checkpointing;
        self.shell.reset();
        self
    }

    /// Logits `[B·T, V]` of every position of `batch` (targets unused).
    pub fn logits(&mut self, params: &[f32], batch: &TokenBatch) -> Result<Vec<f32>, LlamaError> {
        nn::shell::logits(self, params, batch)
    }

    /// Logits `[V]` of the last position of `tokens` (one sequence), for
    /// sampling: the head runs on that position only, and the layers keep
    /// no activations for a backward. With a key/value cache
    /// ([`Llama::set_kv_cache`]) only the tokens past the cached positions run.
    pub fn next_token_logits(&mut self, params: &[f32], tokens: &[u32]) -> Result<Vec<f32>, LlamaError> {
        nn::shell::next_token_logits(self, params, tokens)
    }
}

impl Decoder for Llama {
    type Error = LlamaError;
    type Extra = LlamaActs;

    fn shell(&self) -> &Shell<LlamaActs> {
        &self.shell
    }

    fn shell_mut(&mut self) -> &mut Shell<LlamaActs> {
        &mut self.shell
    }

    fn invalid_batch(problem: String) -> LlamaError {
        LlamaError::InvalidBatch(problem)
    }

    /// A training pass needs a slot per layer, a forward-only pass one.
    fn new_acts(&self, b: usize, t: usize, train: bool) -> Acts<LlamaActs> {
        let (cfg, sh) = (&self.cfg, &self.shell);
        let how = (sh.precision, sh.checkpointing);
        let s = ActSizes::new(cfg, (sh.ends.tp, self.adapters), (b, t), how, train, sh.part());
        let rope = Rope::new(t, cfg.head_dim, cfg.rope_theta, cfg.llama3_scaling().as_ref());
        let [_, hf, rstd_f, logits, losses] = s.head;
        Acts::new(
            &s.stack,
            [hf, 0, rstd_f, logits, losses],
            (b, t),
            LlamaActs { rope, drop: None, moe: Default::default() },
        )
    }

    /// Forward: the LoRA dropout masks of a training pass drawn first, the
    /// rows after cached positions rotated by their own positions.
    fn walk(&mut self, store: &mut dyn ParamStore, batch: &TokenBatch, walk: Walk<'_>) -> Result<(), LlamaError> {
        if self.packed && self.base.is_none() {
            return Err(LlamaError::config("frozen base", "a packed layout without its base cannot run a pass"));
        }
        if let (true, Walk::Forward(Pass::Train, _)) = (self.packed_embed, &walk) {
            return Err(LlamaError::config(
                "frozen base",
                "the token embedding is kept packed for generation and evaluation, and a training pass reads it from the parameters: train with --init-from FILE, which holds the embedding in f32",
            ));
        }
        let (b, t) = (self.shell.acts.b, self.shell.acts.t);
        let d = self.dims(b, t);
        if self.cfg.moe.is_some() {
            self.moe_supported()?;
        }
        let (attn, later) = match walk {
            Walk::Forward(pass, attn) => {
                let p_drop = self.lora.as_ref().map_or(0.0, |l| l.dropout);
                let rank = self.split.as_ref().map_or(0, |s| s.tp.rank);
                let drop =
                    (pass == Pass::Train && p_drop > 0.0).then(|| Dropout::new(p_drop, self.step, batch).on_rank(rank));
                self.shell.acts.extra.drop = drop;
                let later = match attn {
                    Attention::Causal => None,
                    Attention::Cached(_) => Some(self.rope_for(attn.first_position(), t)),
                };
                (attn, later)
            }
            Walk::Backward => (Attention::Causal, None),
        };
        let (segs, a, scratch) = (self.shell.block_segs(), &mut self.shell.acts, &mut self.shell.scratch);
        if a.extra.rope.t < a.whole_t {
            // Context parallelism: this rank's positions run to the whole sequence's.
            a.extra.rope =
                Rope::new(a.whole_t, self.cfg.head_dim, self.cfg.rope_theta, self.cfg.llama3_scaling().as_ref());
        }
        let rope = later.as_ref().unwrap_or(&a.extra.rope);
        let base = self.base.as_deref();
        let mut layer = layer(&self.cfg, &self.ranges.layer_rel, (rope, attn), d, (&a.pos, &a.docs), base);
        layer.drop = a.extra.drop.as_ref();
        if self.cfg.moe.is_some() {
            // A forward counts its routing afresh; a backward's recomputations do not.
            layer.counting = matches!(walk, Walk::Forward(..));
            if layer.counting {
                crate::block::state(&a.extra.moe).tally = Default::default();
            }
            layer.moe = Some(&a.extra.moe);
        }
        match walk {
            Walk::Forward(pass, _) => a.stack.forward(&layer, store, (segs, scratch), pass == Pass::Train)?,
            Walk::Backward => a.stack.backward(&layer, store, (segs, scratch))?,
        }
        Ok(())
    }

    fn segments(&self) -> Vec<Range<usize>> {
        let r = &self.ranges;
        let last = r.head.as_ref().map_or(r.norm.end, |h| h.end);
        std::iter::once(r.embed.clone())
            .chain(r.layers.iter().map(LayerParams::span))
            .chain(std::iter::once(r.norm.start..last))
            .collect()
    }

    fn tensor_shards(&self) -> Option<TensorShards> {
        self.split.as_ref().and_then(|sp| sp.shards(self).ok())
    }

    fn begin_step(&mut self, step: u64) {
        self.step = step;
    }

    fn blocks_aux(&mut self, targets: u64, seed: Option<f32>) -> Result<f64, LlamaError> {
        self.router_losses(targets, seed)
    }

    fn step_stats_len(&self) -> usize {
        self.global_balance().map_or(0, |m| m.n_experts + 2)
    }

    fn collect_step_stats(
        &mut self,
        store: &mut dyn ParamStore,
        batch: &TokenBatch,
        into: &mut [f64],
    ) -> Result<(), LlamaError> {
        self.routing_counts(store, batch, into)
    }

    fn set_step_stats(&mut self, stats: &[f64]) {
        self.step_stats = Some((self.step, stats.to_vec()));
    }
}

nn::impl_decoder!(Llama);

/// A Llama built for one rank of a tensor-parallel group: the rank and
/// the whole model (layout only: no activations), for the shard map and
/// for initial values.
#[derive(Debug)]
pub(crate) struct RankShard {
    pub(crate) tp: TpRank,
    pub(crate) whole: Llama,
}

impl RankShard {
    /// The map of `local`'s layout (this rank's model) onto the whole model's.
    pub(crate) fn shards(&self, local: &Llama) -> Result<TensorShards, LlamaError> {
        let cfg = self.whole.config();
        let r = local.lora().map_or(0, |l| l.r);
        let shards = self
            .whole
            .layout()
            .tensors()
            .iter()
            .map(|t| cfg.shard_of(&t.name, (self.tp.size, self.tp.vocab, self.tp.seq), r))
            .collect();
        TensorShards::new(self.tp, self.whole.layout().clone(), local.layout().clone(), shards)
            .map_err(|e| LlamaError::config("tensor_parallel", e.to_string()))
    }

    /// This rank's part of the whole model's initial segment `seg`.
    pub(crate) fn init_segment(&self, local: &Llama, seed: u64, seg: usize) -> Vec<f32> {
        let whole = self.whole.init_segment(seed, seg);
        let Ok(map) = self.shards(local) else { return Vec::new() };
        map.take_range(Model::segments(&self.whole)[seg].clone(), &whole)
    }
}
