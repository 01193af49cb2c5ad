//! GPT-2's block as the shared stack walk runs it: pre-LayerNorm
//! multi-head attention and a tanh-GELU MLP, every linear layer with a bias
//! (`Conv1D` layout); and the sizes of every activation buffer, the one
//! definition that allocates them and reports their bytes.

use crate::config::GptConfig;
use crate::layout::BlockParams;
use engine::{Checkpointing, EngineError, Precision, SegmentGrads, TensorGroup};
use nn::attention::{attention_backward, attention_forward, AttnShape};
use nn::grad::param_grad;
use nn::linear::{conv1d_backward, conv1d_forward, LinearShape};
use nn::norm::{layernorm_backward, layernorm_forward, NormSaved};
use nn::stack::{Block, Part, Saved, SavedView, StackSizes};

/// Indices of a block's saved tensors.
const LN1: usize = 0;
const QKV: usize = 1;
const ATT: usize = 2;
const ATTY: usize = 3;
const RES2: usize = 4;
const LN2: usize = 5;
const FCH: usize = 6;
const FCH_GELU: usize = 7;
/// The block's output.
const RES3: usize = 8;

/// Shapes of one block call.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Dims {
    pub b: usize,
    pub t: usize,
    pub c: usize,
    pub nh: usize,
}

impl Dims {
    /// Multi-head attention: grouped-query attention with a key/value head per query head.
    fn attn(&self, ops: nn::Operands) -> AttnShape {
        let Dims { b, t, c, nh } = *self;
        AttnShape { b, t, n_head: nh, n_kv_head: nh, head_dim: c / nh, ops }
    }
}

/// Element counts of every activation buffer of a GPT-2 for one (B, T),
/// storage precision and checkpointing: what the model allocates and what
/// [`ActSizes::bytes`] reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ActSizes {
    /// The block stack: per block ln1, qkv (3C), att (T×T per head), atty,
    /// res2, ln2, fch (4C), fch_gelu (4C), res3 (C per row), four f32 row
    /// statistics; working buffers dres, dc, d4c, dqkv, datt; staging: GELU's
    /// output / a decoded tensor (4C), the decoded probabilities (16-bit only).
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

    /// The sizes of one part of the model (a pipeline stage: its blocks,
    /// its micro-batches in flight, the head buffers on the last stage only).
    pub fn for_part(
        cfg: &GptConfig,
        b: usize,
        t: usize,
        (precision, checkpointing): (Precision, Checkpointing),
        part: Part,
    ) -> Self {
        let w = |x: usize| x as u128;
        let (n, c, v) = (w(b) * w(t), w(cfg.n_embd), w(cfg.vocab_size));
        let att = w(b) * w(cfg.n_head) * w(t) * w(t);
        let stack = StackSizes {
            precision,
            checkpointing,
            n_slots: part.n_blocks,
            large: [n * c, n * 3 * c, att, n * c, n * c, n * c, n * 4 * c, n * 4 * c, n * c].to_vec(),
            output: RES3,
            stats: vec![n; 4],
            x: n * c,
            bufs: vec![n * c, n * c, n * 4 * c, n * 3 * c, att],
            staging: vec![n * 4 * c, if precision.is_low() { att } else { 0 }],
            extra: vec![n * 4 * c],
        };
        let head = if part.last { [n * c, n, n, n * v, n] } else { [0; 5] };
        ActSizes { stack, head, in_flight: part.in_flight }
    }

    /// Bytes of every buffer.
    pub fn bytes(&self) -> u128 {
        let [a, b, c, logits, losses] = self.head;
        self.in_flight.max(1) as u128 * (self.stack.bytes() + 4 * (a + b + c)) + 4 * (logits + losses)
    }
}

/// One GPT-2 block: its parameter ranges (relative to the block's
/// segment), shapes and storage precision.
pub(crate) struct GptBlock<'a> {
    pub r: &'a BlockParams,
    pub d: Dims,
    pub prec: Precision,
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
        let Dims { b, t, c, .. } = self.d;
        let n = b * t;
        let [res2, buf_c, buf_4c, qkv, att] = bufs else { unreachable!("GPT-2 has five working buffers") };
        let gelu_out = &mut extra[0];
        let Saved { large, stats } = sv;
        let [ln1_mean, ln1_rstd, ln2_mean, ln2_rstd] = &mut stats[..] else { unreachable!("four row statistics") };
        let ops = nn::operands(prec);
        let lin = |ic: usize, oc: usize| LinearShape::new(n, ic, oc, ops);
        layernorm_forward(buf_c, ln1_mean, ln1_rstd, x, &p[r.ln1_w.clone()], &p[r.ln1_b.clone()], c);
        large[LN1].keep(buf_c, prec);
        // (B*T, C) @ (C, 3C) -> (B*T, 3C)
        conv1d_forward(
            qkv,
            large[LN1].cur(buf_c),
            &p[r.attn_w.clone()],
            Some(&p[r.attn_b.clone()]),
            None,
            lin(c, 3 * c),
        );
        large[QKV].keep(qkv, prec);
        // The MLP's 4C buffer is idle until c_fc: the heads' scratch.
        attention_forward(buf_c, att, &mut buf_4c[..n * c], large[QKV].cur(qkv), self.d.attn(ops));
        large[ATT].keep(att, prec);
        large[ATTY].keep(buf_c, prec);
        // (B*T, C) @ (C, C) -> (B*T, C), plus the residual
        let proj_b = Some(&p[r.proj_b.clone()]);
        conv1d_forward(res2, large[ATTY].cur(buf_c), &p[r.proj_w.clone()], proj_b, Some(x), lin(c, c));
        large[RES2].keep(res2, prec);
        let (ln2_w, ln2_b) = (&p[r.ln2_w.clone()], &p[r.ln2_b.clone()]);
        layernorm_forward(buf_c, ln2_mean, ln2_rstd, large[RES2].cur(res2), ln2_w, ln2_b, c);
        large[LN2].keep(buf_c, prec);
        // (B*T, C) @ (C, 4C) -> (B*T, 4C)
        conv1d_forward(
            buf_4c,
            large[LN2].cur(buf_c),
            &p[r.fc_w.clone()],
            Some(&p[r.fc_b.clone()]),
            None,
            lin(c, 4 * c),
        );
        large[FCH].keep(buf_4c, prec);
        nn::act::gelu_forward(gelu_out, large[FCH].cur(buf_4c));
        large[FCH_GELU].keep(gelu_out, prec);
        let (gelu, res) = (large[FCH_GELU].cur(gelu_out), Some(large[RES2].cur(res2)));
        // (B*T, 4C) @ (4C, C) -> (B*T, C), plus the residual
        conv1d_forward(x, gelu, &p[r.fcproj_w.clone()], Some(&p[r.fcproj_b.clone()]), res, lin(4 * c, c));
        // The output stays in `x` as the next block's input: kept by copy.
        large[RES3].keep_copy(x, prec);
        let _ = tp;
        Ok(())
    }

    /// Staging: 0 for row tensors, 1 for the attention probabilities.
    fn backward(
        &self,
        p: &[f32],
        tp: &mut TensorGroup<'_>,
        grads: &mut SegmentGrads<'_>,
        mut saved: SavedView<'_>,
        bufs: &mut [Vec<f32>],
    ) -> Result<(), EngineError> {
        let r = self.r;
        let Dims { b, t, c, .. } = self.d;
        let n = b * t;
        let [dres, dc, d4c, dqkv, datt] = bufs else { unreachable!("GPT-2 has five working buffers") };
        let sv = saved.sv;
        let [ln1_mean, ln1_rstd, ln2_mean, ln2_rstd] = &sv.stats[..] else { unreachable!("four row statistics") };
        let ops = nn::operands(saved.precision());
        let lin = |ic: usize, oc: usize| LinearShape::new(n, ic, oc, ops);
        // c_proj of the MLP: d(B*T, 4C) = d(B*T, C) @ (C, 4C)
        let (gw, gb) = grads.pair(r.fcproj_w.clone(), r.fcproj_b.clone());
        let (w, inp) = (&p[r.fcproj_w.clone()], saved.get(FCH_GELU));
        conv1d_backward(d4c, param_grad(gw), param_grad(gb), dres, inp, w, lin(4 * c, c));
        nn::act::gelu_backward_inplace(d4c, saved.get(FCH));
        // c_fc: d(B*T, C) = d(B*T, 4C) @ (4C, C)
        let (gw, gb) = grads.pair(r.fc_w.clone(), r.fc_b.clone());
        let (w, inp) = (&p[r.fc_w.clone()], saved.get(LN2));
        conv1d_backward(dc, param_grad(gw), param_grad(gb), d4c, inp, w, lin(c, 4 * c));
        let (gw, gb) = grads.pair(r.ln2_w.clone(), r.ln2_b.clone());
        let ln2 = NormSaved { inp: saved.get(RES2), mean: ln2_mean, rstd: ln2_rstd };
        layernorm_backward(dres, param_grad(gw), param_grad(gb), dc, ln2, &p[r.ln2_w.clone()]);
        // c_proj of attention: d(B*T, C) = d(B*T, C) @ (C, C)
        let (gw, gb) = grads.pair(r.proj_w.clone(), r.proj_b.clone());
        let (w, inp) = (&p[r.proj_w.clone()], saved.get(ATTY));
        conv1d_backward(dc, param_grad(gw), param_grad(gb), dres, inp, w, lin(c, c));
        // The MLP's 4C buffer is idle again: the heads' scratch.
        let qkv_att = saved.pair((QKV, 0), (ATT, 1));
        attention_backward(dqkv, datt, &mut d4c[..n * 3 * c], dc, qkv_att, self.d.attn(ops));
        // c_attn: d(B*T, C) = d(B*T, 3C) @ (3C, C)
        let (gw, gb) = grads.pair(r.attn_w.clone(), r.attn_b.clone());
        let (w, inp) = (&p[r.attn_w.clone()], saved.get(LN1));
        conv1d_backward(dc, param_grad(gw), param_grad(gb), dqkv, inp, w, lin(c, 3 * c));
        let (gw, gb) = grads.pair(r.ln1_w.clone(), r.ln1_b.clone());
        let ln1 = NormSaved { inp: saved.input(), mean: ln1_mean, rstd: ln1_rstd };
        layernorm_backward(dres, param_grad(gw), param_grad(gb), dc, ln1, &p[r.ln1_w.clone()]);
        let _ = tp;
        Ok(())
    }
}
