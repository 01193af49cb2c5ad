//! Llama's decoder layer as the shared stack walk runs it: RMSNorm,
//! grouped-query attention with rotary q/k (and optional q/k/v biases and
//! per-head q/k norms), a
//! SwiGLU MLP, LoRA on the targeted projections; and the sizes of every
//! activation buffer, the one definition that allocates them and reports
//! their bytes.

use crate::config::LlamaConfig;
use crate::dora;
use crate::frozen::{FrozenBase, Group};
use crate::layout::{Adapters, LayerParams, LoraRanges, Proj};
use crate::lora_dropout::Dropout;
use engine::{Checkpointing, EngineError, Inner, Precision, SavedTensor, SegmentGrads, TensorGroup};
use nn::attention::AttnShape;
use nn::flash::{flash_attention_backward, flash_attention_forward, Visible};
use nn::grad::{bias_backward, param_grad};
use nn::kv::Attention;
use nn::linear::{
    add_bias, add_into, columns, linear_backward_input, linear_backward_weight, linear_forward, Cols, LinearShape,
};
use nn::norm::{rmsnorm_backward, rmsnorm_forward, HeadNorm, NormSaved};
use nn::rope::{rope_apply, Rope};
use nn::stack::{Block, Part, Saved, SavedView, StackSizes, PRE_NORM_KINDS};
use nn::{Operands, Positions, Strided};
use std::cell::Cell;

/// Indices of a layer's saved tensors.
const H1: usize = 0; // input_layernorm's output
const QKV: usize = 1; // q | k | v, q and k rotated
const Y: usize = 2; // attention heads' output (o_proj's input)
const X2: usize = 3; // residual after attention
const H2: usize = 4; // post_attention_layernorm's output
const GU: usize = 5; // gate | up
const M: usize = 6; // silu(gate) · up (down_proj's input)
const OUT: usize = 7; // the layer's output
/// `XA + p`: projection `p`'s LoRA `x·Aᵀ` (`[n, r]`; empty without an adapter).
const XA: usize = 8;
/// `DZ + p`: with DoRA, projection `p`'s `x·Wᵀ + s·(x·Aᵀ)·Bᵀ` before the
/// magnitude's scaling (`[n, out]`; empty otherwise).
const DZ: usize = XA + 7;
/// With `qk_norm`: the query heads, then the key heads, before their norms
/// (`[n·H, d]` then `[n·KV, d]`; empty otherwise).
const QKN: usize = DZ + 7;
/// With Gemma's post norms: the attention's output (o_proj's, before its
/// norm) and the MLP's (down_proj's), `[n, C]` each (empty otherwise).
const PA: usize = QKN + 1;
const PF: usize = QKN + 2;

/// Staging buffers: row tensors, the heads' output beside q|k|v, LoRA's `x·Aᵀ`.
const ROWS: usize = 0;
const HEADS: usize = 1;
const LORA: usize = 2;

/// Shapes of one layer call.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Dims {
    /// Rows B·T.
    pub n: usize,
    pub c: usize,
    pub f: usize,
    /// Attention (its GEMMs on f32 operands in every precision).
    pub gqa: AttnShape,
    pub eps: f32,
    /// LoRA rank (0 without adapters) and scale α/r.
    pub r: usize,
    pub lora_scale: f32,
    /// GEMM operands of the precision ([`nn::operands`]).
    pub ops: Operands,
    /// Storage precision of saved tensors.
    pub prec: Precision,
}

impl Dims {
    /// A linear layer `[n, ic] → [n, oc]` at scale 1.
    fn lin(&self, ic: usize, oc: usize) -> LinearShape {
        LinearShape::new(self.n, ic, oc, self.ops)
    }
}

/// Element counts of every activation buffer of a Llama for one (B, T),
/// pass, storage precision and checkpointing: what the model allocates and
/// what [`ActSizes::bytes`] reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ActSizes {
    /// The layer stack: per layer h1, qkv, y, x2, h2, gate|up (2F), m (F),
    /// out, LoRA's x·Aᵀ per adapted projection, two f32 1/rms per row (four
    /// with Gemma's post norms, which also keep their inputs) and
    /// the attention's f32 log-sum-exp per (sequence, head, row) — no
    /// T × T matrix; working buffers dres, dc, dqkv, dgu, dm, dxa,
    /// attention scratch, the post norms' output and gradient; 16-bit staging (row tensors, heads' output, x·Aᵀ).
    pub stack: StackSizes,
    /// RoPE tables, the final norm's output and 1/rms, the logits, the
    /// per-row losses.
    pub head: [u128; 5],
    /// Micro-batches in flight, each with its own stack, RoPE tables and
    /// final-norm buffers (the logits and losses are shared: used within a forward).
    pub in_flight: usize,
}

impl ActSizes {
    /// The sizes for `b` sequences of `t` tokens.
    pub(crate) fn new(
        cfg: &LlamaConfig,
        adapters: Option<Adapters>,
        (b, t): (usize, usize),
        (precision, checkpointing): (Precision, Checkpointing),
        train: bool,
        part: Part,
    ) -> Self {
        let w = |x: usize| x as u128;
        let (n, c, f, v) = (w(b) * w(t), w(cfg.hidden_size), w(cfg.intermediate_size), w(cfg.vocab_size));
        let qkvw = w(cfg.n_head + 2 * cfg.n_kv_head) * w(cfg.head_dim);
        let lse = w(b) * w(cfg.n_head) * w(t);
        let r = w(adapters.map_or(0, |a| a.r));
        let xa = Proj::ALL.map(|p| match adapters {
            Some(a) if a.targets[p as usize] => n * r,
            _ => 0,
        });
        let qd = w(cfg.q_dim());
        let dora = |p: Proj| adapters.is_some_and(|a| a.dora && a.targets[p as usize]);
        let dz = Proj::ALL.map(|p| if dora(p) { n * w(p.shape(cfg)[0]) } else { 0 });
        let max_dz = Proj::ALL.into_iter().filter(|&p| dora(p)).map(|p| w(p.shape(cfg)[0])).max().unwrap_or(0);
        let norms = Proj::ALL.iter().filter(|&&p| dora(p)).map(|p| w(p.shape(cfg)[0])).sum::<u128>();
        let dropout = adapters.is_some_and(|a| a.dropout);
        let max_in = if dropout { Proj::ALL.into_iter().map(|p| w(p.shape(cfg)[1])).max().unwrap_or(0) } else { 0 };
        let mut large = vec![n * c, n * qkvw, n * qd, n * c, n * c, n * 2 * f, n * f, n * c];
        large.extend(xa);
        large.extend(dz);
        // Per-head q/k norms: their inputs kept, one 1/rms per (row, head).
        let qk_heads = if cfg.qk_norm { w(cfg.n_head + cfg.n_kv_head) } else { 0 };
        large.push(n * qk_heads * w(cfg.head_dim));
        let post = if cfg.gemma.is_some() { n * c } else { 0 };
        large.extend([post, post]);
        // Working buffer: the q/k norms' (gathered heads) and, when the
        // heads are wider than the residual (H·d > C), the heads' output
        // and its gradient.
        let wide = (qk_heads * w(cfg.head_dim)).max(if qd > c { qd } else { 0 });
        let mut kinds = PRE_NORM_KINDS.to_vec(); // LoRA's and DoRA's tensors (after the eight) are kept
        kinds.resize(large.len(), Inner::Kept);
        let low = precision.is_low();
        let stack = StackSizes {
            precision,
            checkpointing,
            n_slots: if train { part.n_blocks } else { 1 },
            large,
            kinds,
            redo_scratch: n.max(lse),
            output: OUT,
            stats: vec![n, n, lse, norms, n * qk_heads, post / c.max(1), post / c.max(1)],
            x: n * c,
            bufs: vec![
                n * c,
                n * c,
                n * qkvw,
                n * 2 * f,
                n * f,
                n * r,
                n * qkvw,
                n * max_dz,
                n * max_in,
                n * wide,
                post,
            ],
            staging: if low { vec![n * c.max(qkvw).max(2 * f), n * qd, n * r] } else { vec![0; 3] },
            extra: Vec::new(),
        };
        let rope = Rope::len_for(t, cfg.head_dim) as u128;
        let head = if part.last { [rope, n * c, n, n * v, n] } else { [rope, 0, 0, 0, 0] };
        ActSizes { stack, head, in_flight: if train { part.in_flight } else { 1 } }
    }

    /// Bytes of every buffer.
    pub fn bytes(&self) -> u128 {
        let [a, b, c, logits, losses] = self.head;
        self.in_flight.max(1) as u128 * (self.stack.bytes() + 4 * (a + b + c)) + 4 * (logits + losses)
    }
}

/// One decoder layer: the configuration, its parameter ranges (relative
/// to the layer's segment), the rotary tables (of the rows' positions),
/// the call's shapes, its attention (causal over the call's rows, or over
/// a key/value cache when generating), the micro-batch's positions and
/// the keys each query sees (document starts of packed rows, the sliding
/// window); with a packed frozen base, the base and
/// the layer the stack is in.
pub(crate) struct Layer<'a> {
    pub cfg: &'a LlamaConfig,
    pub r: &'a LayerParams,
    pub rope: &'a Rope,
    pub d: Dims,
    pub attn: Attention<'a>,
    pub pos: Positions<'a>,
    pub visible: Visible<'a>,
    pub base: Option<&'a FrozenBase>,
    /// The layer being run (set by [`Block::enter`]).
    pub at: Cell<usize>,
    /// LoRA dropout's masks of this micro-batch (training passes only).
    pub drop: Option<&'a Dropout>,
}

/// What a projection's backward reads and writes besides its gradients.
struct Back<'s, 'g> {
    grads: &'s mut SegmentGrads<'g>,
    saved: SavedView<'s>,
    /// `[n, r]`: LoRA's `x·Aᵀ` gradient.
    dxa: &'s mut [f32],
    /// `[n, in]`: the dropped-out input and its gradient (LoRA dropout only).
    xd: &'s mut [f32],
}

impl Layer<'_> {
    /// What this layer's queries see: the micro-batch's documents, the
    /// layer's window and the family's scores.
    fn visible_here(&self) -> Visible<'_> {
        self.visible.window(self.cfg.window_of(self.at.get()))
    }

    /// Gemma's post norm `k` (0: the attention's, 1: the MLP's) of the
    /// branch output `z`, kept in `kept` with its 1/rms in `rstd`: `z`
    /// becomes `res + norm(z)` (`out` is scratch).
    fn post_norm(
        &self,
        p: &[f32],
        k: usize,
        (kept, rstd): (&mut SavedTensor, &mut [f32]),
        z: &mut [f32],
        out: &mut [f32],
        res: &[f32],
    ) {
        let Some(norms) = &self.r.post_norms else { unreachable!("post norms without their gains") };
        kept.keep_copy(z, self.d.prec);
        rmsnorm_forward(out, rstd, z, &self.cfg.gains(&p[norms[k].clone()]), self.d.c, self.d.eps);
        add_into(out, res);
        z.copy_from_slice(out);
    }

    /// Backward of post norm `k` from the residual's gradient `dres` into
    /// `dz` (overwritten), its gains' gradient added.
    fn post_norm_backward(
        &self,
        p: &[f32],
        k: usize,
        dres: &[f32],
        dz: &mut [f32],
        (back, rstd): (&mut Back<'_, '_>, &[f32]),
    ) {
        let Some(norms) = &self.r.post_norms else { unreachable!("post norms without their gains") };
        dz.fill(0.0);
        let dw = param_grad(back.grads.tensor(norms[k].clone()));
        let saved = NormSaved { inp: back.saved.get([PA, PF][k]), mean: &[], rstd };
        rmsnorm_backward(dz, dw, dres, saved, &self.cfg.gains(&p[norms[k].clone()]));
    }

    /// The per-head norms of the query heads and of the key heads in a
    /// row of q|k|v.
    fn head_norms(&self) -> [HeadNorm; 2] {
        let g = &self.d.gqa;
        let (d, rs) = (g.head_dim, g.qkv_width());
        [HeadNorm { col0: 0, heads: g.n_head, d, rs }, HeadNorm { col0: g.q_dim(), heads: g.n_kv_head, d, rs }]
    }

    /// The f32 weight range of group `g` inside the segment.
    fn range(&self, g: Group) -> std::ops::Range<usize> {
        match g {
            Group::Qkv => self.r.qkv(),
            Group::O => self.r.w(Proj::O),
            Group::GateUp => self.r.gate_up(),
            Group::Down => self.r.w(Proj::Down),
        }
    }

    /// `y (+)= x · Wᵀ` for group `g`'s weight: the segment's f32 values, or
    /// the packed frozen base.
    fn base_forward(&self, g: Group, p: &[f32], y: Cols<'_>, accumulate: bool, x: &[f32], s: LinearShape) {
        match self.base {
            Some(b) => b.layer(self.at.get()).group(g).forward(y, accumulate, x, s),
            None => linear_forward(y, accumulate, x, &p[self.range(g)], s),
        }
    }

    /// `dx = dy · W` for group `g`'s weight (see [`Layer::base_forward`]).
    fn base_backward_input(&self, g: Group, p: &[f32], dx: &mut [f32], dy: Strided<'_>, s: LinearShape) {
        match self.base {
            Some(b) => b.layer(self.at.get()).group(g).backward_input(dx, false, dy, s),
            None => linear_backward_input(dx, false, dy, &p[self.range(g)], s),
        }
    }

    /// LoRA's forward for projection `pr`, if it has an adapter:
    /// `xa = x·Aᵀ` (kept for backward), then `y[:, col0..] += s · xa·Bᵀ`.
    /// Beside a row-parallel projection (`sum`: its input features split)
    /// each rank's `x·Aᵀ` is a part, summed over the group before it is
    /// kept — so `xa` and `B`'s gradient are whole on every rank, and `xa`
    /// is rounded once, as uncut.
    fn lora_forward(
        &self,
        pr: Proj,
        p: &[f32],
        y: Cols<'_>,
        x: &[f32],
        (xa, buf, xd): (&mut SavedTensor, &mut Vec<f32>, &mut [f32]),
        sum: Option<&mut TensorGroup<'_>>,
    ) -> Result<(), EngineError> {
        let Some(lr) = &self.r.lora[pr as usize] else { return Ok(()) };
        engine::profile::timed(engine::profile::Kind::Adapter, || {
            let (d, ic) = (&self.d, pr.shape(self.cfg)[1]);
            let x = match self.drop {
                Some(drop) => {
                    let xd = &mut xd[..x.len()];
                    xd.copy_from_slice(x);
                    drop.mask((self.at.get(), pr as usize), xd, ic);
                    &*xd
                }
                None => x,
            };
            let branch = self.branch(lr, p);
            branch.down(buf, x);
            if let Some(tp) = sum {
                tp.all_reduce(buf)?;
            }
            xa.keep(buf, d.prec);
            branch.up(y, xa.cur(buf));
            Ok(())
        })
    }

    /// Weight gradients of projection `pr` (input: saved tensor `x_idx`,
    /// output gradient the column block `dy`), and its LoRA branch if any:
    /// `dB (+)= s·dyᵀ·xa`, `dxa = s·dy·B`, `dA (+)= dxaᵀ·x`, and
    /// `dx += dxa·A` (the base's `dy·W` is already in `dx`). Frozen
    /// tensors' gradients are skipped, the input gradient never is.
    fn proj_backward(
        &self,
        pr: Proj,
        p: &[f32],
        dx: &mut [f32],
        dy: Strided<'_>,
        x_idx: usize,
        back: &mut Back<'_, '_>,
    ) {
        let (d, r, [oc, ic]) = (&self.d, self.r, pr.shape(self.cfg));
        let (x, xa) = back.saved.pair((x_idx, ROWS), (XA + pr as usize, LORA));
        // dW (+)= dyᵀ · x: (out, n) @ (n, in) -> (out, in); a packed base is frozen.
        if self.base.is_none() {
            linear_backward_weight(param_grad(back.grads.tensor(r.w(pr))), dy, x, d.lin(ic, oc));
        }
        let Some(lr) = &r.lora[pr as usize] else { return };
        let bufs = (&mut *back.grads, &mut *back.dxa, &mut *back.xd);
        engine::profile::timed(engine::profile::Kind::Adapter, || self.lora_backward(pr, lr, p, dx, dy, (x, xa), bufs));
    }

    /// [`Layer::proj_backward`]'s adapter part, for `pr`'s adapter `lr`
    /// (input `x`, its kept `xa`; [`Back`]'s gradients and buffers).
    #[allow(clippy::too_many_arguments)]
    fn lora_backward(
        &self,
        pr: Proj,
        lr: &LoraRanges,
        p: &[f32],
        dx: &mut [f32],
        dy: Strided<'_>,
        (x, xa): (&[f32], &[f32]),
        (grads, dxa_buf, xd_buf): (&mut SegmentGrads<'_>, &mut [f32], &mut [f32]),
    ) {
        let ic = pr.shape(self.cfg)[1];
        let (ga, gb) = grads.pair(lr.a.clone(), lr.b.clone());
        let (branch, gs) = (self.branch(lr, p), (param_grad(ga), param_grad(gb)));
        let dxa = &mut dxa_buf[..self.d.n * self.d.r];
        if let Some(drop) = self.drop {
            // The branch saw x ⊙ mask: A's gradient reads it, and the input
            // gradient through the branch is masked the same way.
            let at = (self.at.get(), pr as usize);
            let xd = &mut xd_buf[..x.len()];
            xd.copy_from_slice(x);
            drop.mask(at, xd, ic);
            branch.backward(gs, dy, (xd, xa), dxa);
            branch.input_grad(xd, false, dxa);
            drop.mask(at, xd, ic);
            add_into(dx, xd);
            return;
        }
        branch.backward(gs, dy, (x, xa), dxa);
        // dx += dxa · A (the base's dy·W is already in dx)
        branch.input_grad(dx, true, dxa);
    }

    /// Adapter `lr`'s branch (its tensors in the segment `p`) at this call's shape.
    fn branch<'p>(&self, lr: &LoraRanges, p: &'p [f32]) -> nn::lora::Branch<'p> {
        let d = &self.d;
        nn::lora::Branch { a: &p[lr.a.clone()], b: &p[lr.b.clone()], r: d.r, scale: d.lora_scale, n: d.n, ops: d.ops }
    }
}

impl Layer<'_> {
    /// Projection `pr`'s DoRA magnitude (its range in the segment), if it has one.
    fn dora(&self, pr: Proj) -> Option<std::ops::Range<usize>> {
        self.r.lora[pr as usize].as_ref().and_then(|l| l.m.clone())
    }

    /// Where projection `pr`'s row norms sit in the norms statistic (the fourth)
    /// (the DoRA projections' output rows back to back, in layout order).
    fn norm_range(&self, pr: Proj) -> std::ops::Range<usize> {
        let before: usize =
            Proj::ALL[..pr as usize].iter().filter(|&&q| self.dora(q).is_some()).map(|q| q.shape(self.cfg)[0]).sum();
        before..before + pr.shape(self.cfg)[0]
    }

    /// DoRA: `‖W + s·B·A‖` of each of `pr`'s rows (current A and B; W
    /// from the segment or the packed base) into its place in `norms`.
    fn dora_norms(&self, pr: Proj, p: &[f32], norms: &mut [f32]) {
        let (Some(_), Some(lr)) = (self.dora(pr), &self.r.lora[pr as usize]) else { return };
        let [oc, ic] = pr.shape(self.cfg);
        let ad = dora::Adapted {
            shape: [oc, ic],
            r: self.d.r,
            a: &p[lr.a.clone()],
            b: &p[lr.b.clone()],
            scale: self.d.lora_scale,
        };
        let w0 = |rows: std::ops::Range<usize>| match self.base {
            Some(b) => b.proj_rows(self.cfg, self.at.get(), pr, rows),
            None => p[self.r.w(pr)][rows.start * ic..rows.end * ic].to_vec(),
        };
        dora::row_norms(&ad, &w0, &mut norms[self.norm_range(pr)]);
    }

    /// DoRA's forward for projection `pr`, once `z = x·Wᵀ + LoRA` is
    /// complete: in `y`'s columns (`res` none), or in `zb` (`res`: the
    /// residual `y` is to hold, `res + (m/‖·‖) ⊙ z`). `z` is kept for the
    /// magnitude's gradient, then `y`'s columns become `(m/‖·‖) ⊙ z` (+ res).
    fn dora_forward(
        &self,
        pr: Proj,
        p: &[f32],
        y: Cols<'_>,
        (zt, zb): (&mut SavedTensor, &mut Vec<f32>),
        norms: &[f32],
        res: Option<&[f32]>,
    ) {
        let Some(m) = self.dora(pr) else { return };
        let (n, oc, prec) = (self.d.n, pr.shape(self.cfg)[0], self.d.prec);
        let (m, norms) = (&p[m], &norms[self.norm_range(pr)]);
        let Cols { buf, col0, rs } = y;
        if res.is_none() {
            for i in 0..n {
                zb[i * oc..(i + 1) * oc].copy_from_slice(&buf[i * rs + col0..i * rs + col0 + oc]);
            }
        }
        zt.keep_prefix(zb, n * oc, prec);
        match res {
            None => dora::scale_columns(buf, (col0, rs), n, m, norms),
            Some(res) => {
                let z = zt.cur(&zb[..n * oc]);
                dora::scaled_copy(buf, Strided::rows(z, oc), n, m, norms);
                add_into(&mut buf[..n * oc], res);
            }
        }
    }

    /// DoRA's backward at projection `pr` whose output gradient is the
    /// column block `col0..` of `g` (rows `rs` apart): the magnitude's
    /// gradient, then the block scaled in place by `m/‖·‖` (the gradient
    /// of `z`, which the base and LoRA backward then read).
    fn dora_backward(
        &self,
        pr: Proj,
        p: &[f32],
        (g, col0, rs): (&mut [f32], usize, usize),
        norms: &[f32],
        back: &mut Back<'_, '_>,
    ) {
        let Some(mr) = self.dora(pr) else { return };
        let norms = &norms[self.norm_range(pr)];
        let z = back.saved.get(DZ + pr as usize);
        if let Some(dm) = param_grad(back.grads.tensor(mr.clone())) {
            dora::magnitude_grad(dm, Strided { data: g, offset: col0, rs, cs: 1 }, z, norms);
        }
        dora::scale_columns(g, (col0, rs), self.d.n, &p[mr], norms);
    }

    /// [`Layer::dora_backward`] at a projection added to the residual
    /// (o, down), whose output gradient `dres` must stay unscaled: the
    /// scaled copy goes to `zb`. Returns the gradient the projection's
    /// backward reads (`dres` itself without DoRA).
    fn dora_backward_residual<'b>(
        &self,
        pr: Proj,
        p: &[f32],
        (dres, zb): (&'b [f32], &'b mut [f32]),
        norms: &[f32],
        back: &mut Back<'_, '_>,
    ) -> Strided<'b> {
        let c = self.d.c;
        let Some(mr) = self.dora(pr) else { return Strided::rows(dres, c) };
        let norms = &norms[self.norm_range(pr)];
        let z = back.saved.get(DZ + pr as usize);
        if let Some(dm) = param_grad(back.grads.tensor(mr.clone())) {
            dora::magnitude_grad(dm, Strided::rows(dres, c), z, norms);
        }
        let zb = &mut zb[..self.d.n * c];
        dora::scaled_copy(zb, Strided::rows(dres, c), self.d.n, &p[mr], norms);
        Strided::rows(zb, c)
    }
}

impl Block for Layer<'_> {
    /// Segment `seg` holds layer `seg - 1` (segment 0 is the embedding).
    fn enter(&self, seg: usize) {
        self.at.set(seg.saturating_sub(1));
    }

    /// Each tensor is produced in f32 in a working buffer and kept in `sv`
    /// at once; what follows reads the kept tensor.
    fn forward(
        &self,
        p: &[f32],
        tp: &mut TensorGroup<'_>,
        x: &mut [f32],
        sv: &mut Saved,
        bufs: &mut [Vec<f32>],
        _: &mut [Vec<f32>],
    ) -> Result<(), EngineError> {
        let (cfg, r, d) = (self.cfg, self.r, &self.d);
        let (n, c, f, prec) = (d.n, d.c, d.f, d.prec);
        let (qd, qkvw, kvd) = (d.gqa.q_dim(), d.gqa.qkv_width(), cfg.kv_dim());
        let [x2, buf_c, qkv, gu, m, dxa, heads, zb, xd, wide, pn] = bufs else {
            unreachable!("Llama has eleven working buffers")
        };
        let Saved { large, stats } = sv;
        let [rstd1, rstd2, lse, norms, rstd_qk, rstd_pa, rstd_pf] = &mut stats[..] else {
            unreachable!("row statistics, log-sum-exps, norms, head and post-norm statistics")
        };
        let (large, xa) = large.split_at_mut(XA);
        let (xa, zs) = xa.split_at_mut(DZ - XA);
        let (zs, qkn) = zs.split_at_mut(QKN - DZ);
        let (qkn, post) = qkn.split_at_mut(PA - QKN);
        let [pa, pf] = post else { unreachable!("the post norms' inputs") };
        let post = r.post_norms.is_some();
        for pr in Proj::ALL {
            self.dora_norms(pr, p, norms);
        }
        let norms = &*norms;
        // Attention: h1 = norm(x); q|k|v = h1·Wqkvᵀ (+ bias) (+ LoRA); rotate q, k.
        rmsnorm_forward(buf_c, rstd1, x, &self.cfg.gains(&p[r.attn_norm.clone()]), c, d.eps);
        large[H1].keep(buf_c, prec);
        let h1 = large[H1].cur(buf_c);
        // (n, C) @ (C, (H + 2·KV)·d) -> (n, (H + 2·KV)·d)
        self.base_forward(Group::Qkv, p, Cols::all(qkv, qkvw), false, h1, d.lin(c, qkvw));
        let qkv_cols = [(Proj::Q, 0), (Proj::K, qd), (Proj::V, qd + kvd)];
        // DoRA scales x·Wᵀ + LoRA and leaves the bias out: the bias comes last.
        let dora_qkv = qkv_cols.iter().any(|(pr, _)| self.dora(*pr).is_some());
        if let Some([q, _, v]) = r.qkv_bias.as_ref().filter(|_| !dora_qkv) {
            add_bias(qkv, &p[q.start..v.end]);
        }
        for (pr, col0) in qkv_cols {
            let y = Cols { buf: qkv, col0, rs: qkvw };
            self.lora_forward(pr, p, y, h1, (&mut xa[pr as usize], dxa, &mut xd[..]), None)?;
            self.dora_forward(pr, p, Cols { buf: qkv, col0, rs: qkvw }, (&mut zs[pr as usize], zb), norms, None);
        }
        if let Some([q, _, v]) = r.qkv_bias.as_ref().filter(|_| dora_qkv) {
            add_bias(qkv, &p[q.start..v.end]);
        }
        if let Some(gains) = &r.qk_norm {
            // Each query and key head normalised over its width, its input kept.
            let norms = self.head_norms();
            let [lq, lk] = norms.map(|h| h.len(n));
            norms[0].gather(&mut wide[..lq], qkv);
            norms[1].gather(&mut wide[lq..lq + lk], qkv);
            qkn[0].keep_prefix(wide, lq + lk, prec);
            let kept = qkn[0].cur(&wide[..lq + lk]);
            let (rq, rk) = rstd_qk.split_at_mut(n * norms[0].heads);
            norms[0].forward(qkv, heads, rq, &kept[..lq], &p[gains[0].clone()], d.eps);
            norms[1].forward(qkv, heads, rk, &kept[lq..], &p[gains[1].clone()], d.eps);
        }
        rope_apply(qkv, self.rope, qkvw, cfg.n_head + cfg.n_kv_head, false, self.pos);
        large[QKV].keep(qkv, prec);
        // The heads' output is n × H·d: all of buf_c (n × C) unless the heads
        // are split, or in the q|k|v-wide buffer when H·d > C.
        let yb = if qd <= c { &mut *buf_c } else { &mut *heads };
        match self.attn {
            Attention::Causal => {
                flash_attention_forward(&mut yb[..n * qd], lse, large[QKV].cur(qkv), d.gqa, self.visible_here())
            }
            Attention::Cached(kv) => kv.attend(&mut yb[..n * qd], large[QKV].cur(qkv), d.gqa),
        }
        large[Y].keep_prefix(yb, n * qd, prec);
        // x2 = x + y·Woᵀ (+ LoRA): (n, H·d) @ (H·d, C) -> (n, C); split
        // over heads, each rank's product is a part of the sum (row-parallel).
        let y = large[Y].cur(&yb[..n * qd]);
        let split = tp.is_split();
        if self.dora(Proj::O).is_some() {
            // x2 = x + (m/‖·‖) ⊙ z with z = y·Woᵀ + LoRA (never split: refused with DoRA).
            let z = Cols::all(&mut zb[..n * c], c);
            self.base_forward(Group::O, p, z, false, y, d.lin(qd, c));
            let lo = (&mut xa[Proj::O as usize], &mut *dxa, &mut xd[..]);
            self.lora_forward(Proj::O, p, Cols::all(&mut zb[..n * c], c), y, lo, None)?;
            x2.copy_from_slice(x);
            self.dora_forward(Proj::O, p, Cols::all(x2, c), (&mut zs[Proj::O as usize], zb), norms, Some(x));
        } else {
            // With post norms the branch's output z is normed before it joins
            // the residual: x2 = x + norm(z).
            if !split && !post {
                x2.copy_from_slice(x);
            }
            self.base_forward(Group::O, p, Cols::all(x2, c), !split && !post, y, d.lin(qd, c));
            if split {
                tp.all_reduce(x2)?;
                if !post {
                    add_into(x2, x);
                }
            }
            let lo = (&mut xa[Proj::O as usize], &mut *dxa, &mut xd[..]);
            self.lora_forward(Proj::O, p, Cols::all(x2, c), y, lo, split.then_some(&mut *tp))?;
            if post {
                self.post_norm(p, 0, (pa, rstd_pa), x2, pn, x);
            }
        }
        large[X2].keep(x2, prec);
        // MLP: h2 = norm(x2); g|u = h2·Wguᵀ (+ LoRA); m = silu(g)·u; out = x2 + m·Wdᵀ (+ LoRA).
        rmsnorm_forward(buf_c, rstd2, large[X2].cur(x2), &self.cfg.gains(&p[r.mlp_norm.clone()]), c, d.eps);
        large[H2].keep(buf_c, prec);
        let h2 = large[H2].cur(buf_c);
        // (n, C) @ (C, 2F) -> (n, 2F)
        self.base_forward(Group::GateUp, p, Cols::all(gu, 2 * f), false, h2, d.lin(c, 2 * f));
        for (pr, col0) in [(Proj::Gate, 0), (Proj::Up, f)] {
            let y = Cols { buf: gu, col0, rs: 2 * f };
            self.lora_forward(pr, p, y, h2, (&mut xa[pr as usize], dxa, &mut xd[..]), None)?;
            self.dora_forward(pr, p, Cols { buf: gu, col0, rs: 2 * f }, (&mut zs[pr as usize], zb), norms, None);
        }
        large[GU].keep(gu, prec);
        cfg.glu().forward(m, large[GU].cur(gu), f);
        large[M].keep(m, prec);
        let mm = large[M].cur(m);
        if self.dora(Proj::Down).is_some() {
            // out = x2 + (m/‖·‖) ⊙ z with z = m·Wdᵀ + LoRA.
            self.base_forward(Group::Down, p, Cols::all(&mut zb[..n * c], c), false, mm, d.lin(f, c));
            let lo = (&mut xa[Proj::Down as usize], &mut *dxa, &mut xd[..]);
            self.lora_forward(Proj::Down, p, Cols::all(&mut zb[..n * c], c), mm, lo, None)?;
            x.copy_from_slice(large[X2].cur(x2));
            let (zd, res) = (&mut zs[Proj::Down as usize], large[X2].cur(x2));
            self.dora_forward(Proj::Down, p, Cols::all(x, c), (zd, zb), norms, Some(res));
        } else {
            if !split && !post {
                x.copy_from_slice(large[X2].cur(x2));
            }
            // (n, F) @ (F, C) -> (n, C), added to the residual (row-parallel:
            // summed first; with post norms, normed first)
            self.base_forward(Group::Down, p, Cols::all(x, c), !split && !post, mm, d.lin(f, c));
            if split {
                tp.all_reduce(x)?;
                if !post {
                    add_into(x, large[X2].cur(x2));
                }
            }
            let lo = (&mut xa[Proj::Down as usize], &mut *dxa, &mut xd[..]);
            self.lora_forward(Proj::Down, p, Cols::all(x, c), mm, lo, split.then_some(&mut *tp))?;
            if post {
                self.post_norm(p, 1, (pf, rstd_pf), x, pn, large[X2].cur(x2));
            }
        }
        // The output stays in `x` as the next layer's input: kept by copy.
        large[OUT].keep_copy(x, prec);
        Ok(())
    }

    /// RMSNorm (its 1/rms into the scratch), the attention (its
    /// log-sum-exps into the scratch) or SwiGLU, run again on the kept input.
    fn redo(&self, p: &[f32], k: usize, saved: &mut SavedView<'_>, out: &mut [f32], scratch: &mut [f32]) {
        let (r, d) = (self.r, &self.d);
        let rstd = &mut scratch[..d.n];
        match k {
            H1 => rmsnorm_forward(out, rstd, saved.input(), &self.cfg.gains(&p[r.attn_norm.clone()]), d.c, d.eps),
            H2 => rmsnorm_forward(out, rstd, saved.get(X2), &self.cfg.gains(&p[r.mlp_norm.clone()]), d.c, d.eps),
            Y => {
                let lse = &mut scratch[..d.gqa.b * d.gqa.n_head * d.gqa.t];
                flash_attention_forward(out, lse, saved.get(QKV), d.gqa, self.visible_here());
            }
            M => self.cfg.glu().forward(out, saved.get(GU), d.f),
            _ => unreachable!("Llama keeps saved tensor {k}"),
        }
    }

    fn backward(
        &self,
        p: &[f32],
        tp: &mut TensorGroup<'_>,
        grads: &mut SegmentGrads<'_>,
        saved: SavedView<'_>,
        bufs: &mut [Vec<f32>],
    ) -> Result<(), EngineError> {
        let (cfg, r, d) = (self.cfg, self.r, &self.d);
        let (c, f) = (d.c, d.f);
        let (qd, qkvw, kvd) = (d.gqa.q_dim(), d.gqa.qkv_width(), cfg.kv_dim());
        let [dres, dc, dqkv, dgu, dm, dxa, heads, zb, xd, wide, dz] = bufs else {
            unreachable!("Llama has eleven working buffers")
        };
        let sv = saved.sv;
        let [rstd1, rstd2, lse, norms, rstd_qk, rstd_pa, rstd_pf] = &sv.stats[..] else {
            unreachable!("row statistics, log-sum-exps, norms, head and post-norm statistics")
        };
        let mut back = Back { grads, saved, dxa, xd };
        // down_proj: d(n, F) = d(n, C) @ (C, F); SwiGLU; gate|up: d(n, C) = d(n, 2F) @ (2F, C).
        // With post norms the branch's gradient is the norm's input gradient.
        let dy = if r.post_norms.is_some() {
            self.post_norm_backward(p, 1, dres, dz, (&mut back, rstd_pf));
            Strided::rows(dz, c)
        } else {
            self.dora_backward_residual(Proj::Down, p, (dres, zb), norms, &mut back)
        };
        self.base_backward_input(Group::Down, p, dm, dy, d.lin(f, c));
        self.proj_backward(Proj::Down, p, dm, dy, M, &mut back);
        cfg.glu().backward(dgu, dm, back.saved.get(GU), f);
        for (pr, col0) in [(Proj::Gate, 0), (Proj::Up, f)] {
            self.dora_backward(pr, p, (dgu, col0, 2 * f), norms, &mut back);
        }
        self.base_backward_input(Group::GateUp, p, dc, Strided::rows(dgu, 2 * f), d.lin(c, 2 * f));
        for (pr, col0) in [(Proj::Gate, 0), (Proj::Up, f)] {
            self.proj_backward(pr, p, dc, columns(dgu, col0, 2 * f), H2, &mut back);
        }
        // Column-parallel: each rank's input gradient is a part of the sum.
        tp.all_reduce(dc)?;
        let (w2, g2) = (self.cfg.gains(&p[r.mlp_norm.clone()]), param_grad(back.grads.tensor(r.mlp_norm.clone())));
        let x2 = NormSaved { inp: back.saved.get(X2), mean: &[], rstd: rstd2 };
        rmsnorm_backward(dres, g2, dc, x2, &w2);
        // o_proj: d(n, H·d) = d(n, C) @ (C, H·d); attention; rotation; q|k|v: d(n, C) = d(n, qkv) @ (qkv, C).
        let dy = if qd <= c { &mut dc[..d.n * qd] } else { &mut wide[..d.n * qd] };
        let g = if r.post_norms.is_some() {
            self.post_norm_backward(p, 0, dres, dz, (&mut back, rstd_pa));
            Strided::rows(dz, c)
        } else {
            self.dora_backward_residual(Proj::O, p, (dres, zb), norms, &mut back)
        };
        self.base_backward_input(Group::O, p, dy, g, d.lin(qd, c));
        self.proj_backward(Proj::O, p, dy, g, Y, &mut back);
        let (qkv, y) = back.saved.pair((QKV, ROWS), (Y, HEADS));
        flash_attention_backward(dqkv, heads, dy, (qkv, y, lse), d.gqa, self.visible_here());
        rope_apply(dqkv, self.rope, qkvw, cfg.n_head + cfg.n_kv_head, true, self.pos);
        if let Some(gains) = &r.qk_norm {
            // Through each head's norm, from the kept input (the gains'
            // gradients: under tensor parallelism a part, summed at the boundary).
            let norms = self.head_norms();
            let lq = norms[0].len(d.n);
            let kept = back.saved.get(QKN);
            let rstd = rstd_qk.split_at(d.n * norms[0].heads);
            for (i, (inp, rstd)) in [(&kept[..lq], rstd.0), (&kept[lq..], rstd.1)].into_iter().enumerate() {
                let dw = param_grad(back.grads.tensor(gains[i].clone()));
                let saved = NormSaved { inp, mean: &[], rstd };
                norms[i].backward(dqkv, (&mut heads[..], &mut wide[..]), saved, &p[gains[i].clone()], dw);
            }
        }
        let cols = [(Proj::Q, 0), (Proj::K, qd), (Proj::V, qd + kvd)];
        if let Some(biases) = &r.qkv_bias {
            for ((_, col0), b) in cols.iter().zip(biases) {
                if let Some(g) = param_grad(back.grads.tensor(b.clone())) {
                    bias_backward(g, dqkv, *col0, qkvw);
                }
            }
        }
        for (pr, col0) in cols {
            self.dora_backward(pr, p, (dqkv, col0, qkvw), norms, &mut back);
        }
        self.base_backward_input(Group::Qkv, p, dc, Strided::rows(dqkv, qkvw), d.lin(c, qkvw));
        for (pr, col0) in cols {
            self.proj_backward(pr, p, dc, columns(dqkv, col0, qkvw), H1, &mut back);
        }
        tp.all_reduce(dc)?;
        let (w1, g1) = (self.cfg.gains(&p[r.attn_norm.clone()]), param_grad(back.grads.tensor(r.attn_norm.clone())));
        let h = NormSaved { inp: back.saved.input(), mean: &[], rstd: rstd1 };
        rmsnorm_backward(dres, g1, dc, h, &w1);
        Ok(())
    }
}
