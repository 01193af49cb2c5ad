//! The causal language model around a family's block stack, written once:
//! the token embedding (learned positions and a scale optional), the final
//! norm (LayerNorm or RMSNorm), the head (tied to the embedding or not,
//! its logits soft-capped or not), the fused loss, a pipeline stage's
//! boundaries, micro-batches in flight, and generation with a key/value
//! cache.
//!
//! A family supplies its block and how to walk it ([`Decoder::walk`]),
//! its activation sizes ([`Decoder::new_acts`]) and where the shell's
//! tensors are ([`Ends`]); [`impl_decoder!`](crate::impl_decoder)
//! implements `engine::Model` and `engine::StagedModel` from that.
//!
//! Segments: 0 is the embedding (with the learned positions), `1..=L` the
//! blocks, `L + 1` the final norm (with an untied head). The head's
//! segment is held from the head's forward to its backward (or to the end
//! of a forward-only pass): a tied head shares segment 0 with the
//! embedding, whose gradient the head adds to first.

use crate::grad::param_grad;
use crate::head::{chunk_limit, chunks, held_rows, Head};
use crate::kv::{Attention, KvCache};
use crate::linear::{PackedMatrix, Weight};
use crate::norm::{layernorm_backward, layernorm_forward, rmsnorm_backward, rmsnorm_forward, NormSaved};
use crate::stack::{Part, Slots, Stack, StackSizes, DRES};
use crate::{Positions, Strided};
use engine::batch::TokenBatch;
use engine::{
    Checkpointing, ContextRank, EngineError, FullStore, GradOut, MicroStepStats, ParamLayout, ParamStore, Precision,
    SegmentView, StageSpec, TpRank,
};
use std::borrow::Cow;
use std::ops::Range;

#[doc(hidden)]
pub use engine;

/// What a forward pass keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pass {
    /// Keeps every block's activations for the backward; logits of every position.
    Train,
    /// Forward only: every block reuses one slot; logits of every position.
    Eval,
    /// Forward only: one slot; logits of each sequence's last position.
    NextToken,
}

/// The final norm.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum FinalNorm {
    /// LayerNorm: its weight at `..C` of its segment, its bias at `C..2C`.
    Layer,
    /// RMSNorm with `eps`: its gains at `..C`, applied as `1 + w` when
    /// `one_plus` (Gemma stores them so).
    Rms {
        /// Added to the mean square.
        eps: f32,
        /// Gains applied as `1 + w`.
        one_plus: bool,
    },
}

/// Where the shell's tensors are and what they compute.
#[derive(Debug, Clone, PartialEq)]
pub struct Ends {
    /// The residual stream's width C.
    pub width: usize,
    /// The vocabulary rows held here: V, or V / T where `tp` splits the
    /// vocabulary over T tensor-parallel ranks.
    pub vocab: usize,
    /// The tensor-parallel rank: whose slice of the vocabulary the
    /// embedding and head hold ([`TpRank::splits_vocab`]; otherwise
    /// whole), and whose rows of the residual stream this model holds
    /// ([`TpRank::splits_seq`]: the embedding's output, the blocks'
    /// residual stream, the final norm; the head sees every row, gathered).
    pub tp: TpRank,
    /// The context-parallel rank ([`engine::context`]): which positions of
    /// each sequence this model runs ([`ContextRank::local_batch`]).
    pub cp: ContextRank,
    /// Blocks of the whole model.
    pub n_blocks: usize,
    /// The most positions a row may hold, and the configuration key that sets it.
    pub context: (usize, &'static str),
    /// The token embedding `[vocab, C]` in segment 0.
    pub embed: Range<usize>,
    /// Learned positions `[context, C]` in segment 0, after the embedding (GPT-2's `wpe`).
    pub positions: Option<Range<usize>>,
    /// The embedding's output is multiplied by this (Gemma's √C).
    pub embed_scale: Option<f32>,
    /// The final norm, in segment `L + 1`.
    pub norm: FinalNorm,
    /// An untied head `[vocab, C]` inside the final norm's segment; `None`:
    /// the head is the embedding.
    pub head: Option<Range<usize>>,
    /// Logits soft-capped at this (`cap · tanh(x / cap)`, Gemma 2).
    pub soft_cap: Option<f32>,
    /// The token embedding (and a tied head) kept packed outside the
    /// parameters, `embed` then empty: forward passes only (`generate`,
    /// `eval` of a packed model file), reading the f32 table's values.
    pub frozen_embed: Option<std::sync::Arc<PackedMatrix>>,
}

/// A family's activation buffers outside the block stack (Llama's rotary
/// tables and LoRA dropout masks), kept per micro-batch in flight.
pub trait Extra: Default + std::fmt::Debug {
    /// Bytes held, for memory accounting.
    fn bytes(&self) -> usize;
}

impl Extra for () {
    fn bytes(&self) -> usize {
        0
    }
}

/// A micro-batch's LoRA dropout masks (drawn per training pass): a key
/// per sequence, not counted.
impl Extra for Option<crate::lora_dropout::Dropout> {
    fn bytes(&self) -> usize {
        0
    }
}

/// Activations and backward scratch for one (B, T): the block stack, the
/// final norm's output and statistics, the logits and the losses, the
/// micro-batch's positions, and the family's extra buffers.
#[derive(Debug, Default)]
pub struct Acts<X> {
    /// (precision, checkpointing) they were sized for; `None`: not sized.
    sized: Option<(Precision, Checkpointing)>,
    /// Sequences.
    pub b: usize,
    /// Positions per sequence (this rank's, under context parallelism).
    pub t: usize,
    /// Positions per whole sequence: `t`, or all the context group's.
    pub whole_t: usize,
    /// The blocks' activations and working buffers.
    pub stack: Stack,
    /// The final norm's output, mean (LayerNorm) and 1/std or 1/rms.
    pub norm: Vec<f32>,
    /// The final LayerNorm's means (empty for RMSNorm).
    pub mean: Vec<f32>,
    /// The final norm's 1/std or 1/rms.
    pub rstd: Vec<f32>,
    /// Sized by each forward: all positions, or one per sequence when generating.
    pub logits: Vec<f32>,
    /// Per-row losses.
    pub losses: Vec<f32>,
    /// The micro-batch's positions (packed rows; empty otherwise).
    pub pos: Vec<u32>,
    /// Document starts.
    pub docs: Vec<u32>,
    /// The family's own buffers.
    pub extra: X,
    /// The sizes of the shared scratch these activations need
    /// ([`StackSizes::scratch`], held by the [`Shell`]).
    pub scratch: Vec<u128>,
}

impl<X: Extra> Acts<X> {
    /// Buffers of the element counts `stack` and `[norm output, mean,
    /// 1/std, logits, losses]` for `b` sequences of `t` tokens.
    pub fn new(stack: &StackSizes, ends: [u128; 5], (b, t): (usize, usize), extra: X) -> Self {
        let [norm, mean, rstd, logits, losses] = ends.map(crate::stack::zeros);
        let sized = Some((stack.precision, stack.checkpointing));
        let (pos, docs, scratch) = (Vec::new(), Vec::new(), stack.scratch.clone());
        let stack = Stack::new(stack);
        Acts { sized, b, t, whole_t: t, stack, norm, mean, rstd, logits, losses, pos, docs, extra, scratch }
    }

    /// Bytes held (activations and scratch), for memory accounting.
    pub fn bytes(&self) -> usize {
        let ends = [&self.norm, &self.mean, &self.rstd, &self.logits, &self.losses];
        self.stack.bytes() + 4 * ends.iter().map(|v| v.len()).sum::<usize>() + self.extra.bytes()
    }
}

/// Moves the buffers used only within one forward (logits, losses) from
/// the slot left to the slot entered.
fn carry<X>(from: &mut Acts<X>, to: &mut Acts<X>) {
    to.logits = std::mem::take(&mut from.logits);
    to.losses = std::mem::take(&mut from.losses);
}

/// What every decoder holds besides its block: the layout, how it stores
/// activations, the part of the model it runs, the activations of each
/// micro-batch in flight, the generation cache and the loss terms.
#[derive(Debug)]
pub struct Shell<X> {
    /// Where the shell's tensors are.
    pub ends: Ends,
    /// The parameters' named layout.
    pub layout: ParamLayout,
    /// The storage precision of activations.
    pub precision: Precision,
    /// Which blocks are recomputed in backward.
    pub checkpointing: Checkpointing,
    /// The part of the model this one runs (all of it without a pipeline).
    pub stage: StageSpec,
    /// The current micro-batch slot's activations.
    pub acts: Acts<X>,
    slots: Slots<Acts<X>>,
    /// Generation's key/value cache, when one is kept.
    pub kv: Option<KvCache>,
    /// What the training loss adds to cross-entropy.
    pub loss_terms: engine::LossTerms,
    /// The most rows of logits the loss holds at once; `None`:
    /// [`chunk_limit`] of the vocabulary (which `plan` counts).
    pub loss_chunk: Option<usize>,
    /// Working buffers every micro-batch in flight shares
    /// ([`StackSizes::scratch`]), as large as the largest slot needs.
    pub scratch: Vec<Vec<f32>>,
}

impl<X: Extra> Shell<X> {
    /// The whole model (no pipeline stage), no checkpointing, no activations yet.
    pub fn new(ends: Ends, layout: ParamLayout, precision: Precision) -> Self {
        Shell {
            stage: StageSpec::whole(ends.n_blocks),
            ends,
            layout,
            precision,
            checkpointing: Checkpointing::None,
            acts: Acts::default(),
            slots: Slots::default(),
            kv: None,
            loss_terms: engine::LossTerms::default(),
            loss_chunk: None,
            scratch: Vec::new(),
        }
    }

    /// Drops every activation buffer (sized again by the next pass).
    pub fn reset(&mut self) {
        self.acts = Acts::default();
        self.slots = Slots::default();
        self.scratch = Vec::new();
    }

    /// Sizes the shared scratch for `sizes` (the slot just sized) and
    /// every parked slot: the largest each buffer is asked for, no larger
    /// (every micro-batch reads a prefix), freed before it is allocated.
    fn fit_scratch(&mut self, sizes: &[u128]) {
        let mut need = sizes.to_vec();
        for other in self.slots.parked() {
            if need.len() < other.scratch.len() {
                need.resize(other.scratch.len(), 0);
            }
            need.iter_mut().zip(&other.scratch).for_each(|(n, &o)| *n = (*n).max(o));
        }
        self.scratch.resize_with(need.len(), Vec::new);
        for (buf, &n) in self.scratch.iter_mut().zip(&need) {
            if buf.len() as u128 != n {
                *buf = Vec::new();
                *buf = crate::stack::zeros(n);
            }
        }
    }

    /// Runs the part `spec` of the model from now on.
    pub fn set_stage(&mut self, spec: StageSpec) {
        self.stage = spec;
        self.reset();
    }

    /// The blocks this model runs and the micro-batches in flight.
    pub fn part(&self) -> Part {
        Part::of(&self.stage)
    }

    /// Bytes of activations and backward scratch currently allocated.
    pub fn activation_bytes(&self) -> usize {
        let scratch = 4 * self.scratch.iter().map(Vec::len).sum::<usize>();
        self.acts.bytes() + self.slots.parked().map(Acts::bytes).sum::<usize>() + scratch
    }

    /// Bytes of the activations kept from forward for backward (every
    /// block's saved tensors and the embedding's output).
    pub fn saved_activation_bytes(&self) -> usize {
        self.acts.stack.saved_bytes() + self.slots.parked().map(|a| a.stack.saved_bytes()).sum::<usize>()
    }

    /// The segments of this stage's blocks.
    pub fn block_segs(&self) -> Range<usize> {
        1 + self.stage.blocks.start..1 + self.stage.blocks.end
    }

    fn norm_seg(&self) -> usize {
        self.ends.n_blocks + 1
    }

    /// The head's segment: the embedding's (tied) or the final norm's.
    pub fn head_seg(&self) -> usize {
        match self.ends.head {
            Some(_) => self.norm_seg(),
            None => 0,
        }
    }

    /// The head inside its segment.
    fn head_rel(&self) -> Range<usize> {
        self.ends.head.clone().unwrap_or_else(|| self.ends.embed.clone())
    }

    /// What is wrong with `batch` for this model, if anything.
    pub fn check(&self, batch: &TokenBatch) -> Result<(), String> {
        let (max, key) = self.ends.context;
        batch.problem(max, key, self.whole_vocab()).map_or(Ok(()), Err)
    }

    /// The whole vocabulary V (of which this rank may hold a slice).
    pub fn whole_vocab(&self) -> usize {
        match self.ends.tp.splits_vocab() {
            true => self.ends.vocab * self.ends.tp.size,
            false => self.ends.vocab,
        }
    }

    /// The vocabulary rows the embedding and head hold here.
    fn vocab_rows(&self) -> Range<usize> {
        self.ends.tp.vocab_rows(self.whole_vocab())
    }

    /// `tokens` as rows of this rank's slice of the vocabulary
    /// ([`crate::embed::local_tokens`]); themselves where it is whole.
    fn local_tokens<'t>(&self, tokens: &'t [u32]) -> Cow<'t, [u32]> {
        match self.ends.tp.splits_vocab() {
            true => Cow::Owned(crate::embed::local_tokens(tokens, self.vocab_rows())),
            false => Cow::Borrowed(tokens),
        }
    }

    /// Values of the residual stream this rank holds for `batch` (a
    /// pipeline stage's input and output): every row's, or its rows'
    /// under sequence parallelism, of its positions under context parallelism.
    pub fn residual_len(&self, batch: &TokenBatch) -> usize {
        let rows = batch.n_seqs * self.ends.cp.local_len(batch.seq_len);
        self.ends.tp.seq_rows(rows).len() * self.ends.width
    }

    /// This rank's share of `batch` ([`ContextRank::local_batch`]): the
    /// batch itself unless sequences are split over a context group.
    pub fn local_batch<'b>(&self, batch: &'b TokenBatch) -> Cow<'b, TokenBatch> {
        match self.ends.cp.is_split() {
            true => Cow::Owned(self.ends.cp.local_batch(batch)),
            false => Cow::Borrowed(batch),
        }
    }

    /// The current slot's whole sequences (`whole`, of which this rank runs
    /// its positions): their length and document starts.
    fn enter_whole(&mut self, whole: &TokenBatch) {
        self.acts.whole_t = whole.seq_len;
        if self.ends.cp.is_split() {
            self.acts.docs = whole.doc_starts();
        }
    }

    /// Where the current slot's rows sit in their sequences (attention
    /// under context parallelism).
    pub fn context(&self) -> crate::context::Context {
        crate::context::Context { rank: self.ends.cp, t: self.acts.whole_t }
    }

    /// Errors unless this model runs all of itself (not a pipeline stage).
    pub fn whole_model_for(&self, what: &str) -> Result<(), String> {
        self.stage.require_whole(what)
    }

    /// Makes micro-batch slot `flight` current; whether its buffers must be
    /// sized anew for `b` sequences of `t` tokens and `pass` (a training
    /// pass needs a slot per block, a forward-only pass one: evaluation
    /// between training steps reuses the training buffers).
    fn enter(&mut self, flight: usize, (b, t): (usize, usize), pass: Pass) -> bool {
        self.slots.enter(&mut self.acts, flight, self.stage.in_flight.max(1), carry);
        let a = &self.acts;
        let same = a.b == b && a.t == t && a.sized == Some((self.precision, self.checkpointing));
        let n_slots = if pass == Pass::Train { self.part().n_blocks } else { 1 };
        !same || a.stack.n_slots() < n_slots
    }

    /// The embedding's forward into the stack's input (first stage) or the
    /// previous stage's output `input`, kept as block 0's input; the rows'
    /// positions start at `first`.
    fn embed_forward(
        &mut self,
        store: &mut dyn ParamStore,
        batch: &TokenBatch,
        input: &[f32],
        first: usize,
    ) -> Result<(), EngineError> {
        self.acts.pos.clone_from(&batch.positions);
        if !self.ends.cp.is_split() {
            // Under context parallelism: the whole batch's, set by the caller.
            self.acts.docs = batch.doc_starts();
        }
        if self.stage.is_first() {
            let tokens = self.local_tokens(&batch.inputs);
            let (e, a, c) = (&self.ends, &mut self.acts, self.ends.width);
            {
                let mut seg = store.segment(0)?;
                let scratch = &mut self.scratch;
                let wpe = e.positions.as_ref().map(|p| &seg.params[p.clone()][first * c..]);
                let pos = Positions { t: a.t, ids: &a.pos };
                let wte = match &e.frozen_embed {
                    Some(m) => Weight::Packed(m, 0..m.rows()),
                    None => Weight::F32(&seg.params[e.embed.clone()]),
                };
                let n = a.b * a.t;
                let rows = e.tp.seq_rows(n);
                if e.tp.splits_seq() {
                    // This rank's rows: of the group's sum (each rank's
                    // slice of the vocabulary), or looked up here; then the
                    // positions, as uncut adds them.
                    match e.tp.splits_vocab() {
                        true => {
                            let full = &mut scratch[0][..n * c];
                            crate::embed::embedding_forward(full, &tokens, wte, None, pos, c);
                            seg.tp.reduce_scatter_rows(full, &mut a.stack.x, n, c)?;
                        }
                        false => {
                            let mine = &tokens[rows.clone()];
                            crate::embed::embedding_forward(&mut a.stack.x, mine, wte, None, pos, c);
                        }
                    }
                    if let Some(wpe) = wpe {
                        crate::embed::add_positions(&mut a.stack.x, wpe, (pos, rows.start), c);
                    }
                } else if e.tp.splits_vocab() {
                    // Each rank's rows of its tokens, zero elsewhere, summed
                    // over the group: each token's row exactly, then the
                    // positions added as uncut adds them.
                    crate::embed::embedding_forward(&mut a.stack.x, &tokens, wte, None, pos, c);
                    seg.tp.all_reduce(&mut a.stack.x)?;
                    if let Some(wpe) = wpe {
                        crate::embed::add_positions(&mut a.stack.x, wpe, (pos, 0), c);
                    }
                } else {
                    crate::embed::embedding_forward(&mut a.stack.x, &tokens, wte, wpe, pos, c);
                }
                if let Some(s) = e.embed_scale {
                    a.stack.x.iter_mut().for_each(|v| *v *= s);
                }
            }
            store.done(0, false)?;
        } else {
            self.acts.stack.x.copy_from_slice(input);
        }
        self.acts.stack.keep_input();
        Ok(())
    }

    /// The last stage's final norm into `norm` (its segment released
    /// unless it also holds the head). Under sequence parallelism each
    /// rank norms its rows (into the idle residual-gradient buffer), then
    /// every row is gathered into `norm`: the head's input.
    fn norm_forward(&mut self, store: &mut dyn ParamStore) -> Result<(), EngineError> {
        let (norm_seg, head_seg) = (self.norm_seg(), self.head_seg());
        let (e, a, c) = (&self.ends, &mut self.acts, self.ends.width);
        {
            let mut seg = store.segment(norm_seg)?;
            let seq = e.tp.splits_seq();
            let out = match seq {
                true => &mut a.stack.bufs[DRES][..a.stack.x.len()],
                false => &mut a.norm[..],
            };
            match e.norm {
                FinalNorm::Layer => {
                    let (w, b) = (&seg.params[..c], &seg.params[c..2 * c]);
                    layernorm_forward(out, &mut a.mean, &mut a.rstd, &a.stack.x, w, b, c);
                }
                FinalNorm::Rms { eps, one_plus } => {
                    let g = gains(&seg.params[..c], one_plus);
                    rmsnorm_forward(out, &mut a.rstd, &a.stack.x, &g, c, eps);
                }
            }
            if seq {
                seg.tp.all_gather_rows(&a.stack.bufs[DRES][..a.stack.x.len()], &mut a.norm, a.b * a.t, c)?;
            }
        }
        if head_seg != norm_seg {
            store.done(norm_seg, false)?;
        }
        Ok(())
    }

    /// The whole logits of the final norm's output (every row, or each
    /// sequence's last for [`Pass::NextToken`]) into `logits`, leaving the
    /// head's segment held: what [`logits`] returns.
    fn head_forward(&mut self, store: &mut dyn ParamStore, pass: Pass) -> Result<(), EngineError> {
        let (c, head_rel, head_seg) = (self.ends.width, self.head_rel(), self.head_seg());
        let a = &mut self.acts;
        let (b, t) = (a.b, a.t);
        let (rows, x) = match pass {
            Pass::NextToken => (b, Strided { data: &a.norm, offset: (t - 1) * c, rs: t * c, cs: 1 }),
            Pass::Train | Pass::Eval => (b * t, Strided::rows(&a.norm, c)),
        };
        a.logits.resize(rows * self.ends.vocab, 0.0);
        let seg = store.segment(head_seg)?;
        let head = head_of(&self.ends, &seg.params[head_rel], self.precision);
        head.logits(rows, x, &mut a.logits);
        Ok(())
    }

    /// The head and the fused loss over chunks of at most
    /// [`Shell::loss_chunk_limit`] rows, so the logits of the whole
    /// micro-batch are never held: per chunk the logits, their softmax
    /// cross-entropy (the loss terms included) and, with `grad_scale`,
    /// their gradient through the head (the final norm's output gradient
    /// into the working buffer `DC`, the head's gradient added chunk by
    /// chunk). Returns the cross-entropy and what the terms add, each
    /// summed in row order (f64; the same bits at any chunk size). The
    /// head's segment stays held, for the forward-only caller to release.
    ///
    /// With the vocabulary split, each rank's chunk holds the logits of its
    /// slice; the softmax's statistics are summed over the group
    /// ([`crate::loss_terms::split_cross_entropy_with`]) and so is the
    /// final norm's output gradient, once, after the last chunk.
    fn head_loss(
        &mut self,
        store: &mut dyn ParamStore,
        batch: &TokenBatch,
        grad_scale: Option<f32>,
    ) -> Result<(f64, f64), EngineError> {
        let rows = batch.n_seqs * batch.seq_len;
        let (c, v, head_rel, most) = (self.ends.width, self.ends.vocab, self.head_rel(), self.loss_chunk_limit());
        let chunk = held_rows(rows as u128, most as u128) as usize;
        let head_seg = self.head_seg();
        let (a, terms) = (&mut self.acts, self.loss_terms);
        let mut aux = if terms.is_plain() { Vec::new() } else { vec![0.0f32; rows] };
        if a.logits.len() < chunk * v {
            a.logits.resize(chunk * v, 0.0);
        }
        let SegmentView { params, mut grads, mut tp } = store.segment(head_seg)?;
        let head = head_of(&self.ends, &params[head_rel.clone()], self.precision);
        let split = self.ends.tp;
        let slice = crate::loss_terms::VocabSlice {
            first: split.vocab_rows(v * split.size).start,
            whole: v * split.size,
            rank: split.rank,
            ranks: split.size,
        };
        // A batch of no rows runs one empty chunk: the head's gradient is
        // written (zero) as by any other micro-step.
        for r in chunks(rows, most) {
            let x = &a.norm[r.start * c..r.end * c];
            let logits = &mut a.logits[..r.len() * v];
            head.logits(r.len(), Strided::rows(x, c), logits);
            let aux = if aux.is_empty() { &mut [][..] } else { &mut aux[r.clone()] };
            let (capped, out, targets) =
                ((&mut *logits, self.ends.soft_cap), (&mut a.losses[r.clone()], aux), &batch.targets[r.clone()]);
            match split.splits_vocab() {
                true => crate::loss_terms::split_cross_entropy_with(
                    capped,
                    out,
                    targets,
                    slice,
                    v,
                    grad_scale,
                    terms,
                    &mut |stats| tp.all_reduce(stats),
                )?,
                false => crate::loss_terms::capped_cross_entropy_with(capped, out, targets, v, grad_scale, terms),
            }
            if grad_scale.is_some() {
                let dx = &mut a.stack.bufs[DC][r.start * c..r.end * c];
                head.backward((dx, param_grad(grads.tensor(head_rel.clone()))), x, logits);
            }
        }
        if grad_scale.is_some() {
            let mine = split.seq_rows(rows);
            match (split.splits_vocab(), split.splits_seq()) {
                // Each rank's dx is its slice's part: summed, it is whole on every rank.
                (true, false) => tp.all_reduce(&mut a.stack.bufs[DC][..rows * c])?,
                // Summed, each rank keeping its rows (through the idle `norm`), at DC's start.
                (true, true) => {
                    let local = &mut a.norm[..mine.len() * c];
                    tp.reduce_scatter_rows(&a.stack.bufs[DC][..rows * c], local, rows, c)?;
                    a.stack.bufs[DC][..mine.len() * c].copy_from_slice(local);
                }
                // The same whole dx on every rank: this rank's rows, at DC's start.
                (false, true) => a.stack.bufs[DC].copy_within(mine.start * c..mine.end * c, 0),
                (false, false) => {}
            }
        }
        Ok((crate::loss::loss_sum(&a.losses, rows), crate::loss::loss_sum(&aux, aux.len())))
    }

    /// The most rows of a chunk of the loss: [`Shell::loss_chunk`], or
    /// [`chunk_limit`] of the vocabulary.
    pub fn loss_chunk_limit(&self) -> usize {
        self.loss_chunk.unwrap_or_else(|| chunk_limit(self.ends.vocab as u128) as usize).max(1)
    }

    /// The last stage's backward from the final norm's output gradient
    /// (in `DC`, from [`Shell::head_loss`]) into the residual gradient;
    /// the head's segment, held since the forward, is released first.
    fn norm_backward(&mut self, store: &mut dyn ParamStore) -> Result<(), EngineError> {
        let (norm_seg, head_seg) = (self.norm_seg(), self.head_seg());
        let (e, a) = (&self.ends, &mut self.acts);
        let c = e.width;
        if head_seg != norm_seg {
            // A tied head's share of the embedding's gradient is complete for this pass.
            store.done(head_seg, true)?;
        }
        {
            let SegmentView { params, mut grads, .. } = store.segment(norm_seg)?;
            let [dres, dc, ..] = &mut a.stack.bufs[..] else { unreachable!("the stack's working buffers") };
            dres.fill(0.0);
            // This rank's rows of the final norm's output gradient (all of them unless sequence-parallel).
            let dc = &dc[..dres.len()];
            // stack.x is still the last block's output.
            match e.norm {
                FinalNorm::Layer => {
                    let (gw, gb) = grads.pair(0..c, c..2 * c);
                    let saved = NormSaved { inp: &a.stack.x, mean: &a.mean, rstd: &a.rstd };
                    layernorm_backward(dres, param_grad(gw), param_grad(gb), dc, saved, &params[..c]);
                }
                FinalNorm::Rms { one_plus, .. } => {
                    let saved = NormSaved { inp: &a.stack.x, mean: &[], rstd: &a.rstd };
                    let g = gains(&params[..c], one_plus);
                    rmsnorm_backward(dres, param_grad(grads.tensor(0..c)), dc, saved, &g);
                }
            }
        }
        store.done(norm_seg, true)?;
        Ok(())
    }

    /// The first stage's embedding backward from the residual gradient
    /// (only ever added to the embedding's gradient).
    fn embed_backward(&mut self, store: &mut dyn ParamStore, inputs: &[u32]) -> Result<(), EngineError> {
        if !self.stage.is_first() {
            return Ok(());
        }
        let tokens = self.local_tokens(inputs);
        {
            let SegmentView { mut grads, mut tp, .. } = store.segment(0)?;
            let (e, a, scratch) = (&self.ends, &mut self.acts, &mut self.scratch);
            let (g, gp) = match &e.positions {
                Some(p) => grads.pair(e.embed.clone(), p.clone()),
                None => (grads.tensor(e.embed.clone()), None),
            };
            let mut dres = &mut a.stack.bufs[DRES][..];
            if let Some(s) = e.embed_scale {
                dres.iter_mut().for_each(|v| *v *= s);
            }
            if e.tp.splits_seq() {
                // Every row's gradient, gathered: the embedding's gradient
                // is then each rank's whole one (or its slice's), as unsplit.
                let n = a.b * a.t;
                tp.all_gather_rows(dres, &mut scratch[0], n, e.width)?;
                dres = &mut scratch[0][..n * e.width];
            }
            let pos = Positions { t: a.t, ids: &a.pos };
            let (g, gp) = (g.map(GradOut::for_adding), gp.map(GradOut::for_adding));
            crate::embed::embedding_backward(g, gp, dres, &tokens, pos, e.width);
        }
        store.done(0, true)
    }
}

/// The working buffer of the stack that holds the final norm's output
/// gradient in backward.
const DC: usize = 1;

/// The head of `ends` over its f32 values `params` (unused where it is the
/// packed embedding).
fn head_of<'a>(ends: &'a Ends, params: &'a [f32], precision: Precision) -> Head<'a> {
    let weight = match (&ends.frozen_embed, &ends.head) {
        (Some(m), None) => Weight::Packed(m, 0..m.rows()),
        _ => Weight::F32(params),
    };
    Head { width: ends.width, vocab: ends.vocab, weight, soft_cap: ends.soft_cap, precision }
}

/// RMSNorm gains as stored, or `1 + w`.
fn gains(w: &[f32], one_plus: bool) -> Cow<'_, [f32]> {
    match one_plus {
        false => Cow::Borrowed(w),
        true => Cow::Owned(w.iter().map(|x| 1.0 + x).collect()),
    }
}

/// Which way [`Decoder::walk`] runs this stage's blocks.
#[derive(Debug, Clone, Copy)]
pub enum Walk<'a> {
    /// [`Stack::forward`] on the embedding's output (a training pass keeps
    /// every block's activations).
    Forward(Pass, Attention<'a>),
    /// [`Stack::backward`] from the residual gradient.
    Backward,
}

/// A family's decoder: its block, walked inside the [`Shell`] it holds.
pub trait Decoder {
    /// What can go wrong inside the model.
    type Error: From<EngineError> + std::error::Error + Send + Sync + 'static;
    /// The family's per-micro-batch buffers outside the stack.
    type Extra: Extra;

    /// The shell the family's block runs in.
    fn shell(&self) -> &Shell<Self::Extra>;
    /// [`Decoder::shell`], to change.
    fn shell_mut(&mut self) -> &mut Shell<Self::Extra>;

    /// The error naming a batch or buffer this model cannot run.
    fn invalid_batch(problem: String) -> Self::Error;

    /// Activation buffers for `b` sequences of `t` tokens (a training
    /// pass's, with a slot per block, when `train`).
    fn new_acts(&self, b: usize, t: usize, train: bool) -> Acts<Self::Extra>;

    /// Runs this stage's blocks ([`Shell::block_segs`]) over the current
    /// slot's stack, as `walk` says, for `batch`.
    fn walk(&mut self, store: &mut dyn ParamStore, batch: &TokenBatch, walk: Walk<'_>) -> Result<(), Self::Error>;

    /// The segments: the embedding, each block, the final norm (with an untied head).
    fn segments(&self) -> Vec<Range<usize>>;

    /// Maps this tensor-parallel rank's layout onto the whole model's.
    fn tensor_shards(&self) -> Option<engine::TensorShards> {
        None
    }

    /// The optimizer step about to be taken.
    fn begin_step(&mut self, _step: u64) {}

    /// The blocks' own loss terms of the forward just run over a
    /// micro-batch of `targets` targets (a mixture's router losses),
    /// added to its `aux_sum`; `seed`: a training pass's loss seed, which
    /// the blocks' backward scales their gradients by. Default: none.
    fn blocks_aux(&mut self, _targets: u64, _seed: Option<f32>) -> Result<f64, Self::Error> {
        Ok(0.0)
    }

    /// [`engine::Model::step_stats_len`].
    fn step_stats_len(&self) -> usize {
        0
    }

    /// [`engine::Model::collect_step_stats`].
    fn collect_step_stats(
        &mut self,
        _store: &mut dyn ParamStore,
        _batch: &TokenBatch,
        _into: &mut [f64],
    ) -> Result<(), Self::Error> {
        Ok(())
    }

    /// [`engine::Model::set_step_stats`].
    fn set_step_stats(&mut self, _stats: &[f64]) {}
}

/// Makes slot `flight` current, sized for `b` × `t` and `pass`.
fn ensure_acts<D: Decoder>(d: &mut D, flight: usize, (b, t): (usize, usize), pass: Pass) {
    if d.shell_mut().enter(flight, (b, t), pass) {
        // The old buffers go before the new ones are allocated: micro-batches
        // of changing length would otherwise hold both at once.
        d.shell_mut().acts = Acts::default();
        let mut acts = d.new_acts(b, t, pass == Pass::Train);
        let sh = d.shell_mut();
        sh.fit_scratch(&acts.scratch);
        if sh.loss_chunk.is_some() && !acts.logits.is_empty() {
            // The family sized the logits for the default chunk.
            let rows = held_rows((b * t) as u128, sh.loss_chunk_limit() as u128) as usize;
            acts.logits = Vec::new();
            acts.logits = vec![0.0; rows * sh.ends.vocab];
        }
        sh.acts = acts;
    }
}

/// Forward through this stage in the current slot: from the embedding
/// (first stage) or `input`, through the blocks, and on the last stage
/// the final norm (its segment left held where it holds the head too).
/// The rows' positions start at `attn`'s first position.
fn forward<D: Decoder>(
    d: &mut D,
    store: &mut dyn ParamStore,
    batch: &TokenBatch,
    input: &[f32],
    (pass, attn): (Pass, Attention<'_>),
) -> Result<(), D::Error> {
    d.shell_mut().embed_forward(store, batch, input, attn.first_position())?;
    d.walk(store, batch, Walk::Forward(pass, attn))?;
    if d.shell().stage.is_last() {
        d.shell_mut().norm_forward(store)?;
    }
    Ok(())
}

/// [`engine::StagedModel::stage_forward`]: forward of micro-batch slot
/// `slot` from `input` (not on the first stage) into `output` (not on the
/// last); on the last stage the loss, and with `loss_seed` its gradient
/// back to the residual stream.
pub fn stage_forward<D: Decoder>(
    d: &mut D,
    store: &mut dyn ParamStore,
    batch: &TokenBatch,
    slot: usize,
    (input, output): (&[f32], &mut [f32]),
    loss_seed: Option<f32>,
) -> Result<MicroStepStats, D::Error> {
    let sh = d.shell();
    sh.check(batch).map_err(D::invalid_batch)?;
    let whole = batch;
    let local = sh.local_batch(whole);
    let batch = &*local;
    let want = sh.residual_len(whole);
    sh.stage
        .check_io(("the stage's input", input.len()), ("the stage's output", output.len()), want)
        .map_err(D::invalid_batch)?;
    if sh.ends.cp.is_split()
        && !matches!(sh.checkpointing, Checkpointing::None | Checkpointing::Blocks | Checkpointing::EveryK(_))
    {
        let problem = format!(
            "activation checkpointing {:?} recomputes the attention core alone, which under context parallelism ({}) needs the group's keys and values: use \"blocks\" or none",
            sh.checkpointing, sh.ends.cp
        );
        return Err(D::invalid_batch(problem));
    }
    let pass = if loss_seed.is_some() { Pass::Train } else { Pass::Eval };
    ensure_acts(d, slot, (batch.n_seqs, batch.seq_len), pass);
    d.shell_mut().enter_whole(whole);
    forward(d, store, batch, input, (pass, Attention::Causal))?;
    let sh = d.shell_mut();
    if !sh.stage.is_last() {
        output.copy_from_slice(&sh.acts.stack.x);
        return Ok(MicroStepStats::default());
    }
    let (loss_sum, aux_sum) = sh.head_loss(store, batch, loss_seed)?;
    let aux_sum = aux_sum + d.blocks_aux(batch.n_targets(), loss_seed)?;
    let sh = d.shell_mut();
    match loss_seed {
        Some(_) => sh.norm_backward(store)?,
        None => store.done(sh.head_seg(), false)?,
    }
    Ok(MicroStepStats { loss_sum, n_targets: batch.n_targets(), aux_sum })
}

/// [`engine::StagedModel::stage_backward`]: backward of slot `slot` from
/// `grad_out` (not on the last stage, where the loss's gradient is already
/// in) through the blocks into `grad_in` (not on the first stage, which
/// ends in the embedding). Frozen tensors' weight gradients are skipped.
pub fn stage_backward<D: Decoder>(
    d: &mut D,
    store: &mut dyn ParamStore,
    batch: &TokenBatch,
    slot: usize,
    (grad_out, grad_in): (&[f32], &mut [f32]),
) -> Result<(), D::Error> {
    let sh = d.shell();
    let want = sh.residual_len(batch);
    let local = sh.local_batch(batch);
    let batch = &*local;
    // Read as a backward: the gradient of the output comes in (not on
    // the last stage), that of the input goes out (not on the first).
    sh.stage
        .check_io(
            ("the gradient of the stage's input", grad_in.len()),
            ("the gradient of the stage's output", grad_out.len()),
            want,
        )
        .map_err(D::invalid_batch)?;
    ensure_acts(d, slot, (batch.n_seqs, batch.seq_len), Pass::Train);
    if !d.shell().stage.is_last() {
        d.shell_mut().acts.stack.bufs[DRES].copy_from_slice(grad_out);
    }
    d.walk(store, batch, Walk::Backward)?;
    let sh = d.shell_mut();
    sh.embed_backward(store, &batch.inputs)?;
    if !sh.stage.is_first() {
        grad_in.copy_from_slice(&sh.acts.stack.bufs[DRES]);
    }
    Ok(())
}

/// [`engine::Model::micro_step`]. A batch of zero sequences (a rank
/// without data in the tail) runs the same code on zero rows: the same
/// segment visits and collectives as every other rank, and a zero gradient.
pub fn micro_step<D: Decoder>(
    d: &mut D,
    store: &mut dyn ParamStore,
    batch: &TokenBatch,
    grad_scale: f32,
) -> Result<MicroStepStats, D::Error> {
    d.shell().whole_model_for("a micro-step").map_err(D::invalid_batch)?;
    let stats = stage_forward(d, store, batch, 0, (&[], &mut []), Some(grad_scale))?;
    stage_backward(d, store, batch, 0, (&[], &mut []))?;
    Ok(stats)
}

/// [`engine::Model::loss`]: the forward alone.
pub fn loss<D: Decoder>(d: &mut D, store: &mut dyn ParamStore, batch: &TokenBatch) -> Result<MicroStepStats, D::Error> {
    d.shell().whole_model_for("evaluation").map_err(D::invalid_batch)?;
    stage_forward(d, store, batch, 0, (&[], &mut []), None)
}

/// Runs `batch` forward only over the whole model with parameters
/// `params` (its positions from `attn`'s first one); returns the logits.
fn logits_of<D: Decoder>(
    d: &mut D,
    params: &[f32],
    batch: &TokenBatch,
    (pass, attn): (Pass, Attention<'_>),
) -> Result<Vec<f32>, D::Error> {
    let sh = d.shell();
    sh.check(batch).map_err(D::invalid_batch)?;
    sh.whole_model_for("a forward pass over the whole model").map_err(D::invalid_batch)?;
    if sh.ends.tp.splits_vocab() {
        let rows = sh.vocab_rows();
        let problem = format!(
            "the logits of the whole vocabulary ({}) are asked of a model holding its rows {}..{} (dist.vocab_parallel): run generation and logits on the whole model",
            sh.whole_vocab(), rows.start, rows.end
        );
        return Err(D::invalid_batch(problem));
    }
    if sh.ends.tp.is_split() || sh.ends.cp.is_split() {
        // Outside a trainer no group sums the ranks' parts.
        let problem = format!(
            "logits are asked of {}'s model, which holds a share of each layer and needs its group to sum them: run generation and logits on the whole model",
            sh.ends.tp
        );
        return Err(D::invalid_batch(problem));
    }
    let mut store = FullStore::read_only(&d.shell().layout, d.segments(), params)?;
    ensure_acts(d, 0, (batch.n_seqs, batch.seq_len), pass);
    forward(d, &mut store, batch, &[], (pass, attn))?;
    let sh = d.shell_mut();
    sh.head_forward(&mut store, pass)?;
    store.done(sh.head_seg(), false)?;
    Ok(std::mem::take(&mut sh.acts.logits))
}

/// Logits `[B·T, V]` of every position of `batch` (targets unused).
pub fn logits<D: Decoder>(d: &mut D, params: &[f32], batch: &TokenBatch) -> Result<Vec<f32>, D::Error> {
    logits_of(d, params, batch, (Pass::Eval, Attention::Causal))
}

/// Logits `[V]` of the last position of `tokens` (one sequence), for
/// sampling: the head runs on that position only, and the blocks keep no
/// activations for a backward. With a key/value cache ([`Shell::kv`])
/// only the tokens past the cached positions run.
pub fn next_token_logits<D: Decoder>(d: &mut D, params: &[f32], tokens: &[u32]) -> Result<Vec<f32>, D::Error> {
    match d.shell_mut().kv.take() {
        Some(mut kv) => {
            let logits = kv.pass(tokens, |rows, attn| last_logits(d, params, rows, attn));
            d.shell_mut().kv = Some(kv);
            logits
        }
        None => last_logits(d, params, tokens, Attention::Causal),
    }
}

/// Logits of the last of `tokens` (one sequence, its positions from
/// `attn`'s first one).
fn last_logits<D: Decoder>(
    d: &mut D,
    params: &[f32],
    tokens: &[u32],
    attn: Attention<'_>,
) -> Result<Vec<f32>, D::Error> {
    logits_of(d, params, &TokenBatch::prompt(tokens), (Pass::NextToken, attn))
}

/// Implements `engine::Model` and `engine::StagedModel` for a
/// [`Decoder`] (through [`micro_step`], [`stage_forward`], ...).
#[macro_export]
macro_rules! impl_decoder {
    ($model:ty) => {
        impl $crate::shell::engine::Model for $model {
            type Batch = $crate::shell::engine::batch::TokenBatch;
            type Error = <$model as $crate::shell::Decoder>::Error;

            fn layout(&self) -> &$crate::shell::engine::ParamLayout {
                &$crate::shell::Decoder::shell(self).layout
            }

            /// A frozen tensor's weight-gradient computation is skipped.
            fn set_trainable(&mut self, trainable: &dyn Fn(&$crate::shell::engine::TensorSpec) -> bool) -> usize {
                $crate::shell::Decoder::shell_mut(self).layout.set_trainable(trainable)
            }

            fn segments(&self) -> Vec<std::ops::Range<usize>> {
                $crate::shell::Decoder::segments(self)
            }

            fn n_targets(&self, batch: &Self::Batch) -> u64 {
                // This rank's positions' (the context group's ranks add theirs).
                $crate::shell::Decoder::shell(self).ends.cp.n_targets(batch)
            }

            fn micro_step(
                &mut self,
                store: &mut dyn $crate::shell::engine::ParamStore,
                batch: &Self::Batch,
                grad_scale: f32,
            ) -> Result<$crate::shell::engine::MicroStepStats, Self::Error> {
                $crate::shell::micro_step(self, store, batch, grad_scale)
            }

            fn loss(
                &mut self,
                store: &mut dyn $crate::shell::engine::ParamStore,
                batch: &Self::Batch,
            ) -> Result<$crate::shell::engine::MicroStepStats, Self::Error> {
                $crate::shell::loss(self, store, batch)
            }

            fn begin_step(&mut self, step: u64) {
                $crate::shell::Decoder::begin_step(self, step)
            }

            fn step_stats_len(&self) -> usize {
                $crate::shell::Decoder::step_stats_len(self)
            }

            fn collect_step_stats(
                &mut self,
                store: &mut dyn $crate::shell::engine::ParamStore,
                batch: &Self::Batch,
                into: &mut [f64],
            ) -> Result<(), Self::Error> {
                $crate::shell::Decoder::collect_step_stats(self, store, batch, into)
            }

            fn set_step_stats(&mut self, stats: &[f64]) {
                $crate::shell::Decoder::set_step_stats(self, stats)
            }
        }

        impl $crate::shell::engine::StagedModel for $model {
            fn n_blocks(&self) -> usize {
                $crate::shell::Decoder::shell(self).ends.n_blocks
            }

            fn tied_head(&self) -> bool {
                $crate::shell::Decoder::shell(self).ends.head.is_none()
            }

            fn set_stage(&mut self, spec: $crate::shell::engine::StageSpec) {
                $crate::shell::Decoder::shell_mut(self).set_stage(spec)
            }

            fn context_parallel(&mut self, cp: $crate::shell::engine::ContextRank) -> Result<(), String> {
                $crate::shell::Decoder::shell_mut(self).ends.cp = cp;
                Ok(())
            }

            fn tensor_shards(&self) -> Option<$crate::shell::engine::TensorShards> {
                $crate::shell::Decoder::tensor_shards(self)
            }

            fn boundary_len(&self, batch: &Self::Batch) -> usize {
                $crate::shell::Decoder::shell(self).residual_len(batch)
            }

            fn stage_forward(
                &mut self,
                store: &mut dyn $crate::shell::engine::ParamStore,
                batch: &Self::Batch,
                slot: usize,
                input: &[f32],
                output: &mut [f32],
                loss_seed: Option<f32>,
            ) -> Result<$crate::shell::engine::MicroStepStats, Self::Error> {
                $crate::shell::stage_forward(self, store, batch, slot, (input, output), loss_seed)
            }

            fn stage_backward(
                &mut self,
                store: &mut dyn $crate::shell::engine::ParamStore,
                batch: &Self::Batch,
                slot: usize,
                grad_out: &[f32],
                grad_in: &mut [f32],
            ) -> Result<(), Self::Error> {
                $crate::shell::stage_backward(self, store, batch, slot, (grad_out, grad_in))
            }
        }
    };
}
