//! GPT-2's block as the shared stack walk runs it: pre-LayerNorm
//! multi-head attention and a tanh-GELU MLP, every linear layer with a bias
//! (`Conv1D` layout) an [`nn::proj::Projection`], which carries the
//! adapters (LoRA, DoRA, dropout) and the tensor-parallel split; and the sizes
//! of every activation buffer, the one definition that allocates them and
//! reports their bytes.

use crate::config::GptConfig;
use crate::layout::{conv_shape, Adapters, BlockParams, Widths};
use engine::{Checkpointing, EngineError, Precision, SegmentGrads, TensorGroup, TpRank};
use nn::attention::AttnShape;
use nn::flash::{flash_attention_forward, Visible};
use nn::grad::param_grad;
use nn::kv::Attention;
use nn::lora_dropout::Dropout;
use nn::norm::{layernorm_backward, layernorm_forward, NormSaved};
use nn::proj::{Base, Grad, Module, Projection, Role, Site, Work};
use nn::stack::{Block, Part, Saved, SavedView, StackSizes, PRE_NORM_KINDS};
use std::cell::Cell;

/// Indices of a block's saved tensors.
const LN1: usize = 0;
const QKV: usize = 1;
const ATTY: usize = 2;
const RES2: usize = 3;
const LN2: usize = 4;
const FCH: usize = 5;
const FCH_GELU: usize = 6;
/// The block's output.
const RES3: usize = 7;
/// `x·Aᵀ` of each linear layer's adapter (as [`crate::layout::CONVS`]): `XA + i`.
const XA: usize = 8;
/// Staging buffers: row tensors, the heads' output, an adapter's `x·Aᵀ`.
const ROWS: usize = 0;
const HEADS: usize = 1;
const LORA: usize = 2;

/// Shapes of one block call: this rank's heads `nh` of width `hd`, its
/// attention width `a = nh·hd` and MLP width `m` (C and 4C unsplit).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Dims {
    pub b: usize,
    pub t: usize,
    pub c: usize,
    pub nh: usize,
    pub hd: usize,
    pub w: Widths,
    /// Sequence parallelism: this rank's rows of the residual stream
    /// (start, end); `None`: all B·T.
    pub seq: Option<(usize, usize)>,
    /// Context parallelism: where the `t` rows of each sequence sit.
    pub cx: nn::context::Context,
}

impl Dims {
    /// Rows of the residual stream held here (norms, residual additions).
    fn local(&self) -> usize {
        self.seq.map_or(self.b * self.t, |(a, b)| b - a)
    }

    /// Multi-head attention: grouped-query attention with a key/value head per query head.
    fn attn(&self, ops: nn::Operands) -> AttnShape {
        let Dims { b, t, nh, hd, .. } = *self;
        AttnShape { b, t, n_head: nh, n_kv_head: nh, head_dim: hd, ops }
    }
}

/// Element counts of every activation buffer of a GPT-2 for one (B, T),
/// storage precision and checkpointing: what the model allocates and what
/// [`ActSizes::bytes`] reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ActSizes {
    /// The block stack: per block ln1, qkv (3C), atty, res2, ln2, fch (4C),
    /// fch_gelu (4C), res3 (C per row), the adapters' x·Aᵀ and DoRA's z,
    /// four f32 row statistics, the attention's f32 log-sum-exp per
    /// (sequence, head, row) — no T × T matrix — and DoRA's row norms;
    /// working buffers dres, dc, d4c, dqkv, x·Aᵀ, DoRA's z, the dropped-out
    /// input; staging: GELU's output / a decoded tensor (4C), the decoded
    /// heads' output, x·Aᵀ (16-bit only).
    pub stack: StackSizes,
    /// The final LayerNorm's output, mean, 1/std (per micro-batch in
    /// flight); the logits of one chunk of the loss
    /// ([`nn::head::loss_chunk_rows`]); the per-row losses (one of each:
    /// used within a forward). Zeros off the last pipeline stage.
    pub head: [u128; 5],
    /// Micro-batches in flight, each with its own stack and LayerNorm buffers.
    pub in_flight: usize,
}

impl ActSizes {
    /// The sizes for `b` sequences of `t` tokens through the whole model.
    pub fn new(cfg: &GptConfig, b: usize, t: usize, precision: Precision, checkpointing: Checkpointing) -> Self {
        Self::for_part(cfg, b, t, (precision, checkpointing), Part::whole(cfg.n_layer))
    }

    /// [`ActSizes::for_part`] of tensor-parallel rank `tp` (its heads and
    /// MLP columns; the residual stream whole, the head's logits over its
    /// vocabulary rows).
    pub fn for_rank(
        cfg: &GptConfig,
        tp: TpRank,
        (b, t): (usize, usize),
        (precision, checkpointing): (Precision, Checkpointing),
        part: Part,
    ) -> Self {
        Self::adapted(cfg, (tp, None), (b, t), (precision, checkpointing), part)
    }

    /// [`ActSizes::for_rank`] with LoRA `adapters`: each one's `x·Aᵀ`
    /// kept (r per row), a working buffer for it and its gradient, and a
    /// staging buffer of r per row under 16-bit storage.
    pub(crate) fn adapted(
        cfg: &GptConfig,
        (tp, adapters): (TpRank, Option<Adapters>),
        (b, t): (usize, usize),
        (precision, checkpointing): (Precision, Checkpointing),
        part: Part,
    ) -> Self {
        let w = |x: usize| x as u128;
        let (n, c) = (w(b) * w(t), w(cfg.n_embd));
        // Sequence parallelism: the residual stream's tensors hold this rank's rows.
        let (nl, seq) = (w(tp.seq_rows(b * t).len()), tp.splits_seq());
        let sp = |x: u128| if seq { x } else { 0 };
        let Widths { a, m, v } = Widths::of(cfg, tp);
        let v = w(v);
        let (a, m) = (w(a), w(m));
        let lse = w(b) * w(cfg.n_head / tp.size) * w(t);
        let r = w(adapters.map_or(0, |ad| ad.r));
        let on = |i: usize| adapters.is_some_and(|ad| ad.targets[i]);
        let dora = |i: usize| on(i) && adapters.is_some_and(|ad| ad.dora);
        let shape = |i: usize| conv_shape(i, cfg.n_embd, Widths { a: a as usize, m: m as usize, v: 0 }).map(w);
        let mut large = vec![nl * c, n * 3 * a, n * a, nl * c, nl * c, n * m, n * m, nl * c];
        large.extend((0..4).map(|i| if on(i) { n * r } else { 0 }));
        large.extend((0..4).map(|i| if dora(i) { n * shape(i)[1] } else { 0 }));
        let norms: u128 = (0..4).filter(|&i| dora(i)).map(|i| shape(i)[1]).sum();
        let max_z = (0..4).filter(|&i| dora(i)).map(|i| shape(i)[1]).max().unwrap_or(0);
        let dropout = adapters.is_some_and(|ad| ad.dropout);
        let max_in = if dropout { (0..4).filter(|&i| on(i)).map(|i| shape(i)[0]).max().unwrap_or(0) } else { 0 };
        let mut kinds = PRE_NORM_KINDS.to_vec(); // the adapters' x·Aᵀ and DoRA's z (after the eight) are kept
        kinds.resize(large.len(), engine::Inner::Kept);
        let low = |x: u128| if precision.is_low() { x } else { 0 };
        let stack = StackSizes {
            precision,
            checkpointing,
            n_slots: part.n_blocks,
            large,
            kinds,
            redo_scratch: (2 * nl).max(lse),
            output: RES3,
            stats: vec![nl, nl, nl, nl, lse, norms],
            x: nl * c,
            bufs: vec![nl * c, n * c, n * m.max(3 * a), n * 3 * a, n * r, n * max_z, n * max_in],
            staging: vec![n * m.max(3 * a).max(c), low(n * a), low(n * r)],
            extra: vec![n * m],
            // Sequence parallelism: a column input gathered, a row output
            // before its reduce-scatter (the embedding's rows in the first).
            scratch: vec![sp(n * c), sp(n * c)],
        };
        // The final norm's output (gathered to every row: the head's input).
        let head = if part.last { [n * c, nl, nl, nn::head::loss_chunk_rows(n, v) * v, n] } else { [0; 5] };
        ActSizes { stack, head, in_flight: part.in_flight }
    }

    /// The sizes of one part of the model (a pipeline stage: its blocks,
    /// its micro-batches in flight, the head buffers on the last stage only).
    pub fn for_part(
        cfg: &GptConfig,
        b: usize,
        t: usize,
        (precision, checkpointing): (Precision, Checkpointing),
        part: Part,
    ) -> Self {
        Self::for_rank(cfg, TpRank::WHOLE, (b, t), (precision, checkpointing), part)
    }

    /// Bytes of every buffer.
    pub fn bytes(&self) -> u128 {
        let [a, b, c, logits, losses] = self.head;
        let shared = self.stack.scratch_bytes() + 4 * (logits + losses);
        self.in_flight.max(1) as u128 * (self.stack.bytes() + 4 * (a + b + c)) + shared
    }
}

/// One GPT-2 block: its parameter ranges (relative to the block's
/// segment), shapes, storage precision and attention (causal over the
/// call's rows, or over a key/value cache when generating), and the
/// keys each query sees (the micro-batch's document starts, packed rows).
pub(crate) struct GptBlock<'a> {
    pub r: &'a BlockParams,
    pub d: Dims,
    pub prec: Precision,
    pub attn: Attention<'a>,
    pub visible: Visible<'a>,
    /// The adapters' rank and scale (α/r or α/√r), when there are adapters.
    pub lora: Option<(usize, f32)>,
    /// LoRA dropout's masks of this micro-batch (training passes only).
    pub drop: Option<&'a Dropout>,
    /// The block being run (set by [`Block::enter`]).
    pub at: Cell<usize>,
    /// The packed frozen base, when the layout leaves the weights out.
    pub base: Option<&'a crate::FrozenBase>,
}

impl GptBlock<'_> {
    /// What the block's projections share in this call.
    fn site(&self) -> Site<'_> {
        let (r, scale) = self.lora.unwrap_or((0, 0.0));
        let (n, prec, seq) = (self.d.b * self.d.t, self.prec, self.d.seq);
        let drop = self.drop.map(|d| (d, self.at.get()));
        let saved = (XA, XA + 4, LORA);
        Site { n, seq, ops: nn::operands(prec), prec, lora: &self.r.lora, r, scale, drop, saved }
    }

    /// The four `Conv1D` layers as parts (as [`crate::layout::CONVS`]).
    fn parts(&self) -> [Module; 4] {
        let (r, Dims { c, w: Widths { a, m, .. }, .. }) = (self.r, self.d);
        let part = |idx, oc, w: &std::ops::Range<usize>, b: &std::ops::Range<usize>| Module {
            idx,
            col0: 0,
            oc,
            lora_oc: oc,
            w: w.clone(),
            bias: Some(b.clone()),
        };
        [
            part(0, 3 * a, &r.attn_w, &r.attn_b),
            part(1, c, &r.proj_w, &r.proj_b),
            part(2, m, &r.fc_w, &r.fc_b),
            part(3, c, &r.fcproj_w, &r.fcproj_b),
        ]
    }

    /// The block's projections over `parts`: `c_attn` and `c_fc`
    /// column-parallel, the two `c_proj` row-parallel; their weights in the
    /// segment, or the packed base's.
    fn projections<'s>(&'s self, parts: &'s [Module; 4]) -> [Projection<'s>; 4] {
        let Dims { c, w: Widths { a, m, .. }, .. } = self.d;
        let base = |i: usize| match self.base {
            Some(f) => Base::Frozen(f.conv(self.at.get(), i)),
            None => Base::Conv1d,
        };
        let proj = |role, ic, i: usize| Projection { role, ic, base: base(i), parts: &parts[i..i + 1] };
        [proj(Role::Column, c, 0), proj(Role::Row, a, 1), proj(Role::Column, c, 2), proj(Role::Row, m, 3)]
    }
}

impl Block for GptBlock<'_> {
    /// Segment `seg` holds block `seg - 1` (segment 0 is the embeddings).
    fn enter(&self, seg: usize) {
        self.at.set(seg.saturating_sub(1));
    }

    /// Each tensor is produced in f32 in a working buffer and kept in `sv`
    /// at once (swapped in for f32, encoded in 16 bits otherwise); what
    /// follows reads the kept tensor.
    fn forward(
        &self,
        p: &[f32],
        tp: &mut TensorGroup<'_>,
        x: &mut [f32],
        sv: &mut Saved,
        bufs: &mut [Vec<f32>],
        extra: &mut [Vec<f32>],
    ) -> Result<(), EngineError> {
        let (r, prec) = (self.r, self.prec);
        let Dims { b, t, c, w: Widths { a, m, .. }, .. } = self.d;
        let (n, nl) = (b * t, self.d.local());
        let [res2, buf_c, buf_4c, qkv, xab, zb, xd, gx, gd] = bufs else {
            unreachable!("GPT-2 has seven working buffers and two of scratch")
        };
        let gelu_out = &mut extra[0];
        let Saved { large, stats } = sv;
        let (large, xa) = large.split_at_mut(XA);
        let [ln1_mean, ln1_rstd, ln2_mean, ln2_rstd, lse, norms] = &mut stats[..] else {
            unreachable!("four row statistics, the log-sum-exps and DoRA's norms")
        };
        let ops = nn::operands(prec);
        let (site, parts) = (self.site(), self.parts());
        let [attn_p, proj_p, fc_p, fcproj_p] = self.projections(&parts);
        for pj in [&attn_p, &proj_p, &fc_p, &fcproj_p] {
            pj.dora_norms(&site, p, norms);
        }
        let norms = &*norms;
        let mut work = Work::new(xab, zb, xd, (gx, gd));
        // The norms and residual additions run on this rank's rows (all
        // of them unless sequence-parallel); the projections between see every row.
        layernorm_forward(&mut buf_c[..nl * c], ln1_mean, ln1_rstd, x, &p[r.ln1_w.clone()], &p[r.ln1_b.clone()], c);
        large[LN1].keep_prefix(buf_c, nl * c, prec);
        // (B*T, C) @ (C, 3A) -> (B*T, 3A): this rank's heads' q | k | v
        attn_p.forward(&site, p, (qkv, large[LN1].cur(&buf_c[..nl * c]), None), xa, &mut work, norms, tp)?;
        large[QKV].keep(qkv, prec);
        match self.attn {
            Attention::Causal => {
                let (shape, cx) = ((self.d.attn(ops), self.visible), self.d.cx);
                nn::context::attention_forward(&mut buf_c[..n * a], lse, large[QKV].cur(qkv), shape, cx, tp)?
            }
            Attention::Cached(kv) => kv.attend(&mut buf_c[..n * a], large[QKV].cur(qkv), self.d.attn(ops)),
        }
        large[ATTY].keep_prefix(buf_c, n * a, prec);
        let atty = large[ATTY].cur(&buf_c[..n * a]);
        // (B*T, A) @ (A, C) -> (B*T, C), plus the bias and the residual
        proj_p.forward(&site, p, (res2, atty, Some(&*x)), xa, &mut work, norms, tp)?;
        large[RES2].keep(res2, prec);
        let (ln2_w, ln2_b) = (&p[r.ln2_w.clone()], &p[r.ln2_b.clone()]);
        layernorm_forward(&mut buf_c[..nl * c], ln2_mean, ln2_rstd, large[RES2].cur(res2), ln2_w, ln2_b, c);
        large[LN2].keep_prefix(buf_c, nl * c, prec);
        // (B*T, C) @ (C, M) -> (B*T, M)
        let fch = &mut buf_4c[..n * m];
        fc_p.forward(&site, p, (fch, large[LN2].cur(&buf_c[..nl * c]), None), xa, &mut work, norms, tp)?;
        large[FCH].keep_prefix(buf_4c, n * m, prec);
        nn::act::gelu_forward(&mut gelu_out[..n * m], large[FCH].cur(&buf_4c[..n * m]));
        large[FCH_GELU].keep_prefix(gelu_out, n * m, prec);
        let (gelu, res) = (large[FCH_GELU].cur(&gelu_out[..n * m]), large[RES2].cur(res2));
        // (B*T, M) @ (M, C) -> (B*T, C), plus the bias and the residual
        fcproj_p.forward(&site, p, (x, gelu, Some(res)), xa, &mut work, norms, tp)?;
        // The output stays in `x` as the next block's input: kept by copy.
        large[RES3].keep_copy(x, prec);
        Ok(())
    }

    /// LayerNorm (its statistics into the scratch), the attention (its
    /// log-sum-exps into the scratch) or GELU, run again on the kept input.
    fn redo(&self, p: &[f32], k: usize, saved: &mut SavedView<'_>, out: &mut [f32], scratch: &mut [f32]) {
        let (r, Dims { b, t, c, nh, .. }) = (self.r, self.d);
        let nl = self.d.local();
        let mut ln = |inp: &[f32], w: &std::ops::Range<usize>, bias: &std::ops::Range<usize>| {
            let (mean, rstd) = scratch[..2 * nl].split_at_mut(nl);
            layernorm_forward(out, mean, rstd, inp, &p[w.clone()], &p[bias.clone()], c);
        };
        match k {
            LN1 => ln(saved.input(), &r.ln1_w, &r.ln1_b),
            LN2 => ln(saved.get(RES2), &r.ln2_w, &r.ln2_b),
            ATTY => {
                let shape = self.d.attn(nn::operands(self.prec));
                // Refused at assembly under context parallelism (no group here).
                assert!(!self.d.cx.is_split(), "attention recomputed without its context group");
                flash_attention_forward(out, &mut scratch[..b * nh * t], saved.get(QKV), shape, self.visible);
            }
            FCH_GELU => nn::act::gelu_forward(out, saved.get(FCH)),
            _ => unreachable!("GPT-2 keeps saved tensor {k}"),
        }
    }

    /// Staging: 0 for row tensors, 1 for the heads' output beside q|k|v.
    fn backward(
        &self,
        p: &[f32],
        tp: &mut TensorGroup<'_>,
        grads: &mut SegmentGrads<'_>,
        mut saved: SavedView<'_>,
        bufs: &mut [Vec<f32>],
    ) -> Result<(), EngineError> {
        let r = self.r;
        let Dims { b, t, w: Widths { a, m, .. }, .. } = self.d;
        let (n, nl, c) = (b * t, self.d.local(), self.d.c);
        let [dres, dc, d4c, dqkv, dxa, zb, xd, gx, gd] = bufs else {
            unreachable!("GPT-2 has seven working buffers and two of scratch")
        };
        let sv = saved.sv;
        let [ln1_mean, ln1_rstd, ln2_mean, ln2_rstd, lse, norms] = &sv.stats[..] else {
            unreachable!("four row statistics, the log-sum-exps and DoRA's norms")
        };
        let ops = nn::operands(saved.precision());
        let (site, parts) = (self.site(), self.parts());
        let [attn_p, proj_p, fc_p, fcproj_p] = self.projections(&parts);
        let mut work = Work::new(dxa, zb, xd, (gx, gd));
        // c_proj of the MLP: d(B*T, M) = d(B*T, C) @ (C, M)
        let dm = &mut d4c[..n * m];
        fcproj_p.backward(
            &site,
            p,
            (dm, Grad::Shared(dres), (FCH_GELU, ROWS)),
            (grads, &mut saved),
            &mut work,
            norms,
            tp,
        )?;
        nn::act::gelu_backward_inplace(dm, saved.get(FCH));
        // c_fc: d(B*T, C) = d(B*T, M) @ (M, C); column-parallel: summed over the ranks
        let dcl = &mut dc[..nl * c];
        fc_p.backward(&site, p, (dcl, Grad::Own(dm), (LN2, ROWS)), (grads, &mut saved), &mut work, norms, tp)?;
        let (gw, gb) = grads.pair(r.ln2_w.clone(), r.ln2_b.clone());
        let ln2 = NormSaved { inp: saved.get(RES2), mean: ln2_mean, rstd: ln2_rstd };
        layernorm_backward(dres, param_grad(gw), param_grad(gb), &dc[..nl * c], ln2, &p[r.ln2_w.clone()]);
        // c_proj of attention: d(B*T, A) = d(B*T, C) @ (C, A)
        let dy = &mut dc[..n * a];
        proj_p.backward(
            &site,
            p,
            (dy, Grad::Shared(dres), (ATTY, HEADS)),
            (grads, &mut saved),
            &mut work,
            norms,
            tp,
        )?;
        // The MLP's 4C buffer is idle again: the heads' scratch.
        let (qkv, y) = saved.pair((QKV, ROWS), (ATTY, HEADS));
        let (shape, cx) = ((self.d.attn(ops), self.visible), self.d.cx);
        nn::context::attention_backward(dqkv, &mut d4c[..n * 3 * a], dy, (qkv, y, lse), shape, cx, tp)?;
        // c_attn: d(B*T, C) = d(B*T, 3A) @ (3A, C); column-parallel: summed over the ranks
        let dcl = &mut dc[..nl * c];
        attn_p.backward(&site, p, (dcl, Grad::Own(dqkv), (LN1, ROWS)), (grads, &mut saved), &mut work, norms, tp)?;
        let (gw, gb) = grads.pair(r.ln1_w.clone(), r.ln1_b.clone());
        let ln1 = NormSaved { inp: saved.input(), mean: ln1_mean, rstd: ln1_rstd };
        layernorm_backward(dres, param_grad(gw), param_grad(gb), &dc[..nl * c], ln1, &p[r.ln1_w.clone()]);
        Ok(())
    }
}
