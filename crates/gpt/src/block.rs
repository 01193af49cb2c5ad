//! GPT-2's block as the shared stack walk runs it: pre-LayerNorm
//! multi-head attention and a tanh-GELU MLP, every linear layer with a bias
//! (`Conv1D` layout), each optionally with a LoRA adapter; and the sizes
//! of every activation buffer, the one definition that allocates them and
//! reports their bytes.

use crate::config::GptConfig;
use crate::layout::{Adapters, BlockParams, LoraRanges, Widths};
use engine::{Checkpointing, EngineError, Precision, SavedTensor, SegmentGrads, TensorGroup, TpRank};
use nn::attention::AttnShape;
use nn::flash::{flash_attention_backward, flash_attention_forward, Visible};
use nn::grad::param_grad;
use nn::kv::Attention;
use nn::linear::{add_bias, add_into, conv1d_backward, conv1d_forward, Cols, LinearShape};
use nn::lora::Branch;
use nn::norm::{layernorm_backward, layernorm_forward, NormSaved};
use nn::stack::{Block, Part, Saved, SavedView, StackSizes, PRE_NORM_KINDS};

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
}

impl Dims {
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
    /// fch_gelu (4C), res3 (C per row), four f32 row statistics and the
    /// attention's f32 log-sum-exp per (sequence, head, row) — no T × T
    /// matrix; working buffers dres, dc, d4c, dqkv; staging: GELU's output
    /// / a decoded tensor (4C), the decoded heads' output (16-bit only).
    pub stack: StackSizes,
    /// The final LayerNorm's output, mean, 1/std (per micro-batch in
    /// flight); the logits; the per-row losses (one of each: used within a
    /// forward). Zeros off the last pipeline stage.
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
    /// MLP columns; the residual stream and the head whole).
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
        let (n, c, v) = (w(b) * w(t), w(cfg.n_embd), w(cfg.vocab_size));
        let Widths { a, m } = Widths::of(cfg, tp);
        let (a, m) = (w(a), w(m));
        let lse = w(b) * w(cfg.n_head / tp.size) * w(t);
        let r = w(adapters.map_or(0, |ad| ad.r));
        let xa = |i: usize| if adapters.is_some_and(|ad| ad.targets[i]) { n * r } else { 0 };
        let mut large = vec![n * c, n * 3 * a, n * a, n * c, n * c, n * m, n * m, n * c];
        large.extend((0..4).map(xa));
        let mut kinds = PRE_NORM_KINDS.to_vec(); // the adapters' x·Aᵀ (after the eight) are kept
        kinds.resize(large.len(), engine::Inner::Kept);
        let low = |x: u128| if precision.is_low() { x } else { 0 };
        let stack = StackSizes {
            precision,
            checkpointing,
            n_slots: part.n_blocks,
            large,
            kinds,
            redo_scratch: (2 * n).max(lse),
            output: RES3,
            stats: vec![n, n, n, n, lse],
            x: n * c,
            bufs: vec![n * c, n * c, n * m.max(3 * a), n * 3 * a, n * r],
            staging: vec![n * m.max(3 * a).max(c), low(n * a), low(n * r)],
            extra: vec![n * m],
        };
        let head = if part.last { [n * c, n, n, n * v, n] } else { [0; 5] };
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
        self.in_flight.max(1) as u128 * (self.stack.bytes() + 4 * (a + b + c)) + 4 * (logits + losses)
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
}

impl GptBlock<'_> {
    /// Linear layer `i`'s adapter as a branch on this call's rows, if it has one.
    fn branch<'p>(&self, i: usize, p: &'p [f32], ops: nn::Operands) -> Option<(Branch<'p>, &LoraRanges)> {
        let (lr, (r, scale)) = (self.r.lora[i].as_ref()?, self.lora?);
        let n = self.d.b * self.d.t;
        Some((Branch { a: &p[lr.a.clone()], b: &p[lr.b.clone()], r, scale, n, ops }, lr))
    }

    /// Linear layer `i`'s adapter in forward, if it has one: `xa = x·Aᵀ`
    /// (in `buf`, then kept in `xa`), `y += s·xa·Bᵀ`.
    fn adapt(&self, i: usize, p: &[f32], y: Cols<'_>, x: &[f32], (xa, buf): (&mut SavedTensor, &mut Vec<f32>)) {
        let Some((br, _)) = self.branch(i, p, nn::operands(self.prec)) else { return };
        engine::profile::timed(engine::profile::Kind::Adapter, || {
            br.down(buf, x);
            xa.keep(buf, self.prec);
            br.up(y, xa.cur(buf));
        })
    }

    /// Linear layer `i`'s adapter in backward, if it has one, from the
    /// output gradient `dy` (`rs` wide) and saved input `x_idx` (decoded
    /// into staging buffer `stage`): A's and B's gradients, and
    /// `dx += dxa·A` (the base's `dy·W` is already in `dx`).
    #[allow(clippy::too_many_arguments)]
    fn adapt_back(
        &self,
        i: usize,
        p: &[f32],
        (grads, saved): (&mut SegmentGrads<'_>, &mut SavedView<'_>),
        dx: &mut [f32],
        (dy, rs): (&[f32], usize),
        (x_idx, stage): (usize, usize),
        dxa: &mut [f32],
    ) {
        let Some((br, lr)) = self.branch(i, p, nn::operands(saved.precision())) else { return };
        engine::profile::timed(engine::profile::Kind::Adapter, || {
            let (ga, gb) = grads.pair(lr.a.clone(), lr.b.clone());
            let (x, xa) = saved.pair((x_idx, stage), (XA + i, LORA));
            br.backward((param_grad(ga), param_grad(gb)), nn::Strided::rows(dy, rs), (x, xa), dxa);
            br.input_grad(dx, true, dxa);
        })
    }
}

impl Block for GptBlock<'_> {
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
        let Dims { b, t, c, w: Widths { a, m }, .. } = self.d;
        let n = b * t;
        let split = tp.is_split();
        let [res2, buf_c, buf_4c, qkv, xab] = bufs else { unreachable!("GPT-2 has five working buffers") };
        let gelu_out = &mut extra[0];
        let Saved { large, stats } = sv;
        let (large, xa) = large.split_at_mut(XA);
        let [ln1_mean, ln1_rstd, ln2_mean, ln2_rstd, lse] = &mut stats[..] else {
            unreachable!("four row statistics and the log-sum-exps")
        };
        let ops = nn::operands(prec);
        let lin = |ic: usize, oc: usize| LinearShape::new(n, ic, oc, ops);
        layernorm_forward(buf_c, ln1_mean, ln1_rstd, x, &p[r.ln1_w.clone()], &p[r.ln1_b.clone()], c);
        large[LN1].keep(buf_c, prec);
        // (B*T, C) @ (C, 3A) -> (B*T, 3A): this rank's heads' q | k | v
        conv1d_forward(
            qkv,
            large[LN1].cur(buf_c),
            &p[r.attn_w.clone()],
            Some(&p[r.attn_b.clone()]),
            None,
            lin(c, 3 * a),
        );
        self.adapt(0, p, Cols::all(qkv, 3 * a), large[LN1].cur(buf_c), (&mut xa[0], xab));
        large[QKV].keep(qkv, prec);
        match self.attn {
            Attention::Causal => {
                flash_attention_forward(&mut buf_c[..n * a], lse, large[QKV].cur(qkv), self.d.attn(ops), self.visible)
            }
            Attention::Cached(kv) => kv.attend(&mut buf_c[..n * a], large[QKV].cur(qkv), self.d.attn(ops)),
        }
        large[ATTY].keep_prefix(buf_c, n * a, prec);
        let atty = large[ATTY].cur(&buf_c[..n * a]);
        // (B*T, A) @ (A, C) -> (B*T, C), plus the bias and the residual; split
        // over heads (row-parallel), the ranks' products are summed first.
        let (proj_w, proj_b) = (&p[r.proj_w.clone()], &p[r.proj_b.clone()]);
        if split {
            conv1d_forward(res2, atty, proj_w, None, None, lin(a, c));
            tp.all_reduce(res2)?;
            add_into(res2, x);
            add_bias(res2, proj_b);
        } else {
            conv1d_forward(res2, atty, proj_w, Some(proj_b), Some(x), lin(a, c));
        }
        self.adapt(1, p, Cols::all(res2, c), atty, (&mut xa[1], xab));
        large[RES2].keep(res2, prec);
        let (ln2_w, ln2_b) = (&p[r.ln2_w.clone()], &p[r.ln2_b.clone()]);
        layernorm_forward(buf_c, ln2_mean, ln2_rstd, large[RES2].cur(res2), ln2_w, ln2_b, c);
        large[LN2].keep(buf_c, prec);
        // (B*T, C) @ (C, M) -> (B*T, M)
        let fch = &mut buf_4c[..n * m];
        let ln2 = large[LN2].cur(buf_c);
        conv1d_forward(fch, ln2, &p[r.fc_w.clone()], Some(&p[r.fc_b.clone()]), None, lin(c, m));
        self.adapt(2, p, Cols::all(fch, m), ln2, (&mut xa[2], xab));
        large[FCH].keep_prefix(buf_4c, n * m, prec);
        nn::act::gelu_forward(&mut gelu_out[..n * m], large[FCH].cur(&buf_4c[..n * m]));
        large[FCH_GELU].keep_prefix(gelu_out, n * m, prec);
        let (gelu, res) = (large[FCH_GELU].cur(&gelu_out[..n * m]), large[RES2].cur(res2));
        // (B*T, M) @ (M, C) -> (B*T, C), plus the bias and the residual (row-parallel when split)
        let (fcproj_w, fcproj_b) = (&p[r.fcproj_w.clone()], &p[r.fcproj_b.clone()]);
        if split {
            conv1d_forward(x, gelu, fcproj_w, None, None, lin(m, c));
            tp.all_reduce(x)?;
            add_into(x, res);
            add_bias(x, fcproj_b);
        } else {
            conv1d_forward(x, gelu, fcproj_w, Some(fcproj_b), Some(res), lin(m, c));
        }
        self.adapt(3, p, Cols::all(x, c), gelu, (&mut xa[3], xab));
        // The output stays in `x` as the next block's input: kept by copy.
        large[RES3].keep_copy(x, prec);
        Ok(())
    }

    /// LayerNorm (its statistics into the scratch), the attention (its
    /// log-sum-exps into the scratch) or GELU, run again on the kept input.
    fn redo(&self, p: &[f32], k: usize, saved: &mut SavedView<'_>, out: &mut [f32], scratch: &mut [f32]) {
        let (r, Dims { b, t, c, nh, .. }) = (self.r, self.d);
        let n = b * t;
        let mut ln = |inp: &[f32], w: &std::ops::Range<usize>, bias: &std::ops::Range<usize>| {
            let (mean, rstd) = scratch[..2 * n].split_at_mut(n);
            layernorm_forward(out, mean, rstd, inp, &p[w.clone()], &p[bias.clone()], c);
        };
        match k {
            LN1 => ln(saved.input(), &r.ln1_w, &r.ln1_b),
            LN2 => ln(saved.get(RES2), &r.ln2_w, &r.ln2_b),
            ATTY => {
                let shape = self.d.attn(nn::operands(self.prec));
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
        let Dims { b, t, c, w: Widths { a, m }, .. } = self.d;
        let n = b * t;
        let [dres, dc, d4c, dqkv, dxa] = bufs else { unreachable!("GPT-2 has five working buffers") };
        let sv = saved.sv;
        let [ln1_mean, ln1_rstd, ln2_mean, ln2_rstd, lse] = &sv.stats[..] else {
            unreachable!("four row statistics and the log-sum-exps")
        };
        let ops = nn::operands(saved.precision());
        let lin = |ic: usize, oc: usize| LinearShape::new(n, ic, oc, ops);
        // c_proj of the MLP: d(B*T, M) = d(B*T, C) @ (C, M)
        let (gw, gb) = grads.pair(r.fcproj_w.clone(), r.fcproj_b.clone());
        let (w, inp) = (&p[r.fcproj_w.clone()], saved.get(FCH_GELU));
        let dm = &mut d4c[..n * m];
        conv1d_backward(dm, param_grad(gw), param_grad(gb), dres, inp, w, lin(m, c));
        self.adapt_back(3, p, (grads, &mut saved), dm, (dres, c), (FCH_GELU, ROWS), dxa);
        nn::act::gelu_backward_inplace(dm, saved.get(FCH));
        // c_fc: d(B*T, C) = d(B*T, M) @ (M, C); column-parallel: summed over the ranks
        let (gw, gb) = grads.pair(r.fc_w.clone(), r.fc_b.clone());
        let (w, inp) = (&p[r.fc_w.clone()], saved.get(LN2));
        conv1d_backward(dc, param_grad(gw), param_grad(gb), dm, inp, w, lin(c, m));
        self.adapt_back(2, p, (grads, &mut saved), dc, (dm, m), (LN2, ROWS), dxa);
        tp.all_reduce(dc)?;
        let (gw, gb) = grads.pair(r.ln2_w.clone(), r.ln2_b.clone());
        let ln2 = NormSaved { inp: saved.get(RES2), mean: ln2_mean, rstd: ln2_rstd };
        layernorm_backward(dres, param_grad(gw), param_grad(gb), dc, ln2, &p[r.ln2_w.clone()]);
        // c_proj of attention: d(B*T, A) = d(B*T, C) @ (C, A)
        let (gw, gb) = grads.pair(r.proj_w.clone(), r.proj_b.clone());
        let (w, inp) = (&p[r.proj_w.clone()], saved.get(ATTY));
        let dy = &mut dc[..n * a];
        conv1d_backward(dy, param_grad(gw), param_grad(gb), dres, inp, w, lin(a, c));
        self.adapt_back(1, p, (grads, &mut saved), dy, (dres, c), (ATTY, HEADS), dxa);
        // The MLP's 4C buffer is idle again: the heads' scratch.
        let (qkv, y) = saved.pair((QKV, ROWS), (ATTY, HEADS));
        flash_attention_backward(dqkv, &mut d4c[..n * 3 * a], dy, (qkv, y, lse), self.d.attn(ops), self.visible);
        // c_attn: d(B*T, C) = d(B*T, 3A) @ (3A, C); column-parallel: summed over the ranks
        let (gw, gb) = grads.pair(r.attn_w.clone(), r.attn_b.clone());
        let (w, inp) = (&p[r.attn_w.clone()], saved.get(LN1));
        conv1d_backward(dc, param_grad(gw), param_grad(gb), dqkv, inp, w, lin(c, 3 * a));
        self.adapt_back(0, p, (grads, &mut saved), dc, (dqkv, 3 * a), (LN1, ROWS), dxa);
        tp.all_reduce(dc)?;
        let (gw, gb) = grads.pair(r.ln1_w.clone(), r.ln1_b.clone());
        let ln1 = NormSaved { inp: saved.input(), mean: ln1_mean, rstd: ln1_rstd };
        layernorm_backward(dres, param_grad(gw), param_grad(gb), dc, ln1, &p[r.ln1_w.clone()]);
        Ok(())
    }
}
