//! One projection type for every family's block: a base weight (trainable
//! f32 in either layout, or frozen and packed), an adapter on each of its
//! column blocks (LoRA, rsLoRA, DoRA, LoRA dropout) and a tensor-parallel
//! role with Megatron's collectives inside it. A block builds a
//! [`Projection`] for each of its linear layers and calls
//! [`Projection::forward`] / [`Projection::backward`]; it never mentions
//! adapters or tensor parallelism itself.
//!
//! A projection may be fused (q|k|v, gate|up): one base GEMM over all its
//! output columns, then each [`Module`] (a column block: one module of the
//! family's files, with its own weight, bias and adapter) adapted on its
//! columns. The arithmetic is the one the blocks had, call for call:
//! - column role (`y = x·Wᵀ`, output features split over the group): the
//!   base GEMM, its bias (after DoRA when a part has DoRA: PEFT scales
//!   `x·Wᵀ + LoRA` and adds the bias unscaled), each part's LoRA then
//!   DoRA; backward sums the input gradient over the group (Megatron's f);
//! - row role (`y = res + x·Wᵀ`, input features split): each rank's
//!   product is a part of the sum, all-reduced before the residual and
//!   bias are added (g); unsplit, the residual (and bias) prefill the
//!   output and the GEMM accumulates onto it. Beside a split, each rank's
//!   LoRA `x·Aᵀ` is a part too, summed over the group before it is kept,
//!   so `x·Aᵀ` and `B`'s gradient are whole on every rank and rounded
//!   once, as unsplit.
//!
//! Under sequence parallelism ([`Site::seq`]) the input of a column
//! projection and the output of a row one are this rank's rows of the
//! residual stream: the column role all-gathers its input's rows first
//! (and again in backward, for the weights' gradient) and reduce-scatters
//! its input gradient; the row role reduce-scatters its output (the
//! all-reduce's sums, each rank keeping its rows) and all-gathers its
//! output gradient, so its bias and `B` gradients still see every row.

use crate::dora;
use crate::grad::{bias_backward, param_grad};
use crate::linear::{
    add_bias, add_into, columns, conv1d_backward, conv1d_forward, linear_backward_input, linear_backward_weight,
    linear_forward, Cols, LinearShape, PackedMatrix, Weight,
};
use crate::lora::{Branch, LoraRanges};
use crate::lora_dropout::Dropout;
use crate::stack::SavedView;
use crate::{Operands, Strided};
use engine::{EngineError, Precision, SavedTensor, SegmentGrads, TensorGroup};
use std::ops::Range;

/// How a projection is split over a tensor-parallel group (Megatron).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Output features split (q|k|v, gate|up, `c_attn`, `c_fc`): no
    /// communication forward; backward sums the input gradient.
    Column,
    /// Input features split (o, down, `c_proj`): forward sums the output.
    Row,
}

/// A frozen base weight kept outside the parameters (packed: bf16, GGUF
/// blocks, NF4), `[oc, ic]` over all of a projection's output columns.
pub trait Frozen: Sync {
    /// `y[:, col0 ..] (+)= x · Wᵀ` (`s.oc` = all its rows).
    fn forward(&self, y: Cols<'_>, accumulate: bool, x: &[f32], s: LinearShape);
    /// `dx (+)= dy · W` (`dy` `[n, s.oc]`).
    fn backward_input(&self, dx: &mut [f32], accumulate: bool, dy: Strided<'_>, s: LinearShape);
    /// Rows `rows` of `W` as f32 `[rows, ic]` (DoRA's row norms).
    fn rows(&self, rows: Range<usize>) -> Vec<f32>;
}

/// One packed `[oc, ic]` matrix is a frozen base (a projection that is
/// not fused, GPT-2's `Conv1D` layers transposed).
impl Frozen for PackedMatrix {
    fn forward(&self, y: Cols<'_>, accumulate: bool, x: &[f32], s: LinearShape) {
        linear_forward(y, accumulate, x, Weight::Packed(self, 0..self.rows()), s)
    }

    fn backward_input(&self, dx: &mut [f32], accumulate: bool, dy: Strided<'_>, s: LinearShape) {
        linear_backward_input(dx, accumulate, dy, Weight::Packed(self, 0..self.rows()), s)
    }

    fn rows(&self, rows: Range<usize>) -> Vec<f32> {
        let mut out = vec![0.0; rows.len() * self.cols()];
        self.dequantize_rows(rows, &mut out);
        out
    }
}

/// Where a projection's base weight is.
#[derive(Clone, Copy)]
pub enum Base<'a> {
    /// `nn.Linear`: each part's f32 `[oc, ic]` weight in the segment, the
    /// parts' back to back (one fused matrix).
    Linear,
    /// GPT-2's `Conv1D`: one part, its f32 weight `[ic, oc]` and bias.
    Conv1d,
    /// Frozen and packed; the parts' weight ranges are unused.
    Frozen(&'a dyn Frozen),
}

/// One column block of a projection: a module of the family's files.
#[derive(Debug, Clone)]
pub struct Module {
    /// Its index in the block's adapter list ([`Site::lora`]): where its
    /// adapter, kept `x·Aᵀ` and DoRA `z` are, and its dropout stream.
    pub idx: usize,
    /// First output column and width.
    pub col0: usize,
    /// Output features.
    pub oc: usize,
    /// Output features its adapter spans from `col0`: `oc`, or a fused
    /// module's (Phi-3's `qkv_proj` adapted whole: q's block carries the
    /// adapter over q|k|v, whose weights follow its own).
    pub lora_oc: usize,
    /// Its weight in the segment (unused for a frozen base).
    pub w: Range<usize>,
    /// Its bias, if any.
    pub bias: Option<Range<usize>>,
}

/// A linear layer of a block: its role, input features and base, and its
/// parts (one unless fused).
#[derive(Clone)]
pub struct Projection<'a> {
    /// Tensor-parallel role.
    pub role: Role,
    /// Input features (this rank's).
    pub ic: usize,
    /// The base weight.
    pub base: Base<'a>,
    /// The column blocks, in column order.
    pub parts: &'a [Module],
}

/// What the projections of one block call share: rows, operands, storage
/// precision, and the block's adapters.
#[derive(Clone, Copy)]
pub struct Site<'a> {
    /// Rows B·T.
    pub n: usize,
    /// Sequence parallelism: this rank's rows of the residual stream
    /// (`TpRank::seq_rows` of `n`), which a column projection's input and
    /// a row projection's output hold (start, end); `None`: all `n`.
    pub seq: Option<(usize, usize)>,
    /// GEMM operands.
    pub ops: Operands,
    /// Storage precision of saved tensors.
    pub prec: Precision,
    /// Per adapter index ([`Module::idx`]): its tensors, if adapted.
    pub lora: &'a [Option<LoraRanges>],
    /// LoRA rank and scale (α/r or α/√r).
    pub r: usize,
    /// See `r`.
    pub scale: f32,
    /// LoRA dropout of this micro-batch (training passes), and the layer
    /// (its masks' stream).
    pub drop: Option<(&'a Dropout, usize)>,
    /// Saved-tensor indices of the first adapter's `x·Aᵀ` and DoRA `z`
    /// (one per adapter index after each), and the staging buffer `x·Aᵀ`
    /// is decoded into (after the input's).
    pub saved: (usize, usize, usize),
}

/// Working buffers of the adapters: `x·Aᵀ` (and its gradient), DoRA's
/// `z`, the dropped-out input.
pub struct Work<'b> {
    /// `[n, r]`.
    pub xa: &'b mut Vec<f32>,
    /// `[n, widest DoRA projection]`.
    pub z: &'b mut Vec<f32>,
    /// `[n, widest input]` (LoRA dropout only).
    pub xd: &'b mut [f32],
    /// `[n, C]` (sequence parallelism only): a column projection's
    /// gathered input.
    pub gx: &'b mut [f32],
    /// `[n, C]` (sequence parallelism only): a row projection's output
    /// before its reduce-scatter and gathered output gradient, a column
    /// projection's input gradient before its reduce-scatter.
    pub gd: &'b mut [f32],
}

/// A projection's output gradient: its own buffer (DoRA may scale it in
/// place) or one the block reads again (a residual's: scaled into
/// [`Work::z`] instead).
pub enum Grad<'b> {
    /// Scaled in place.
    Own(&'b mut [f32]),
    /// Left as it is.
    Shared(&'b [f32]),
}

impl Grad<'_> {
    /// The gradient's values, whoever owns them.
    fn values(&self) -> &[f32] {
        match self {
            Grad::Own(g) => g,
            Grad::Shared(g) => g,
        }
    }
}

impl Site<'_> {
    fn adapter(&self, idx: usize) -> Option<&LoraRanges> {
        self.lora.get(idx).and_then(Option::as_ref)
    }

    /// Adapter `idx`'s DoRA magnitude, if it has one.
    fn dora(&self, idx: usize) -> Option<Range<usize>> {
        self.adapter(idx).and_then(|l| l.m.clone())
    }

    /// Where adapter `idx`'s row norms sit in the DoRA norms statistic
    /// (the DoRA adapters' output rows back to back, in index order).
    pub fn norm_range(&self, idx: usize) -> Range<usize> {
        let before: usize = (0..idx).filter_map(|i| self.dora(i)).map(|m| m.len()).sum();
        before..before + self.dora(idx).map_or(0, |m| m.len())
    }

    /// Elements of the DoRA norms statistic.
    pub fn norms_len(&self) -> usize {
        self.norm_range(self.lora.len()).start
    }

    /// The residual-stream rows this rank holds when they are split over
    /// `tp` (sequence parallelism), else `None`.
    fn seq_rows(&self, tp: &TensorGroup<'_>) -> Option<Range<usize>> {
        self.seq.filter(|_| tp.is_split()).map(|(a, b)| a..b)
    }

    fn branch<'p>(&self, lr: &LoraRanges, p: &'p [f32]) -> Branch<'p> {
        Branch { a: &p[lr.a.clone()], b: &p[lr.b.clone()], r: self.r, scale: self.scale, n: self.n, ops: self.ops }
    }

    fn lin(&self, ic: usize, oc: usize) -> LinearShape {
        LinearShape::new(self.n, ic, oc, self.ops)
    }
}

impl Projection<'_> {
    /// Output features (this rank's).
    pub fn oc(&self) -> usize {
        self.parts.last().map_or(0, |q| q.col0 + q.oc)
    }

    /// The parts' weights together (one fused `[oc, ic]` matrix).
    fn w_span(&self) -> Range<usize> {
        let (first, last) = (&self.parts[0], &self.parts[self.parts.len() - 1]);
        first.w.start..last.w.end
    }

    /// The parts' biases together (`None` unless every part has one).
    fn bias_span(&self) -> Option<Range<usize>> {
        let b: Option<Vec<_>> = self.parts.iter().map(|q| q.bias.clone()).collect();
        let b = b?;
        Some(b[0].start..b[b.len() - 1].end)
    }

    fn any_dora(&self, s: &Site<'_>) -> bool {
        self.parts.iter().any(|q| s.dora(q.idx).is_some())
    }

    /// `y = (res +) x·Wᵀ (+ bias)` over all columns (`y` `[n, oc]`).
    fn base_forward(&self, p: &[f32], s: &Site<'_>, y: &mut [f32], x: &[f32], bias: bool, res: Option<&[f32]>) {
        let (ic, oc) = (self.ic, self.oc());
        let bias = self.bias_span().filter(|_| bias).map(|b| &p[b]);
        if let Base::Conv1d = self.base {
            return conv1d_forward(y, x, &p[self.parts[0].w.clone()], bias, res, s.lin(ic, oc));
        }
        if let Some(res) = res {
            y.copy_from_slice(res);
        }
        let cols = Cols::all(y, oc);
        match self.base {
            Base::Frozen(f) => f.forward(cols, res.is_some(), x, s.lin(ic, oc)),
            _ => linear_forward(cols, res.is_some(), x, &p[self.w_span()], s.lin(ic, oc)),
        }
        if let Some(b) = bias {
            add_bias(y, b);
        }
    }

    /// Rows `rows` of the base weight under part `q`'s adapter as f32
    /// `[rows, ic]` (past its own rows: the next parts', back to back).
    fn base_rows(&self, p: &[f32], q: &Module, rows: Range<usize>) -> Vec<f32> {
        let ic = self.ic;
        match self.base {
            Base::Linear => p[q.w.start + rows.start * ic..q.w.start + rows.end * ic].to_vec(),
            Base::Frozen(f) => f.rows(q.col0 + rows.start..q.col0 + rows.end),
            Base::Conv1d => {
                let (w, oc) = (&p[q.w.clone()], q.oc);
                rows.flat_map(|j| (0..ic).map(move |k| w[k * oc + j])).collect()
            }
        }
    }

    /// DoRA: `‖W + s·B·A‖` of each output row of every DoRA part (current
    /// A and B) into its place in `norms`.
    pub fn dora_norms(&self, s: &Site<'_>, p: &[f32], norms: &mut [f32]) {
        for q in self.parts {
            let (Some(_), Some(lr)) = (s.dora(q.idx), s.adapter(q.idx)) else { continue };
            let ad = dora::Adapted {
                shape: [q.lora_oc, self.ic],
                r: s.r,
                a: &p[lr.a.clone()],
                b: &p[lr.b.clone()],
                scale: s.scale,
            };
            dora::row_norms(&ad, &|rows| self.base_rows(p, q, rows), &mut norms[s.norm_range(q.idx)]);
        }
    }

    /// The forward: `y` (`[n, oc]`) becomes `x·Wᵀ` with its bias and
    /// adapters, plus `res` when given (row role: the residual the
    /// projection's output joins). `kept`: the block's saved tensors from
    /// [`Site::saved`]'s first `x·Aᵀ` on; `norms`: from
    /// [`Projection::dora_norms`].
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        s: &Site<'_>,
        p: &[f32],
        (y, x, res): (&mut [f32], &[f32], Option<&[f32]>),
        kept: &mut [SavedTensor],
        work: &mut Work<'_>,
        norms: &[f32],
        tp: &mut TensorGroup<'_>,
    ) -> Result<(), EngineError> {
        let (n, oc) = (s.n, self.oc());
        // `kept` holds the x·Aᵀ from index 0, DoRA's z from `dz_at`.
        let dz_at = s.saved.1 - s.saved.0;
        let rs = oc;
        let split = self.role == Role::Row && tp.is_split();
        let seq = s.seq_rows(tp);
        let x = match (&seq, self.role) {
            (Some(_), Role::Column) => {
                // This rank's rows of the input, gathered: every row.
                tp.all_gather_rows(x, work.gx, n, self.ic)?;
                &work.gx[..n * self.ic]
            }
            _ => x,
        };
        if self.role == Role::Row && self.any_dora(s) {
            // y = (res +) (m/‖·‖) ⊙ z with z = x·Wᵀ + LoRA kept (one module).
            // Split, a rank's rows are part of each row norm: the families refuse it.
            assert!(!split, "DoRA on a split row-parallel projection");
            let q = &self.parts[0];
            let z = &mut work.z[..n * oc];
            self.base_forward(p, s, z, x, false, None);
            let cols = Cols::all(&mut work.z[..n * oc], oc);
            self.lora_forward(s, q, p, (cols, x), (&mut kept[q.idx], &mut *work.xa, &mut *work.xd), None)?;
            let zt = &mut kept[dz_at + q.idx];
            zt.keep_prefix(work.z, n * oc, s.prec);
            let (m, norms) = (&p[s.dora(q.idx).unwrap_or_default()], &norms[s.norm_range(q.idx)]);
            dora::scaled_copy(y, Strided::rows(zt.cur(&work.z[..n * oc]), oc), n, m, norms);
            if let Some(b) = self.bias_span() {
                add_bias(y, &p[b]);
            }
            if let Some(res) = res {
                add_into(&mut y[..n * oc], res);
            }
            return Ok(());
        }
        if self.any_dora(s) {
            // Column role: each part's columns z = x·Wᵀ + LoRA, kept, then
            // scaled in place; the bias after.
            self.base_forward(p, s, y, x, false, None);
            for q in self.parts {
                let cols = Cols { buf: &mut *y, col0: q.col0, rs };
                self.lora_forward(s, q, p, (cols, x), (&mut kept[q.idx], &mut *work.xa, &mut *work.xd), None)?;
                let Some(m) = s.dora(q.idx) else { continue };
                let (zb, w) = (&mut *work.z, q.lora_oc);
                for i in 0..n {
                    zb[i * w..(i + 1) * w].copy_from_slice(&y[i * rs + q.col0..i * rs + q.col0 + w]);
                }
                kept[dz_at + q.idx].keep_prefix(zb, n * w, s.prec);
                dora::scale_columns(y, (q.col0, rs), n, &p[m], &norms[s.norm_range(q.idx)]);
            }
            if let Some(b) = self.bias_span() {
                add_bias(y, &p[b]);
            }
            if let Some(res) = res {
                add_into(y, res);
            }
            return Ok(());
        }
        if split {
            match &seq {
                Some(rows) => {
                    // The parts summed over the group, each rank keeping its rows.
                    self.base_forward(p, s, &mut work.gd[..n * oc], x, false, None);
                    tp.reduce_scatter_rows(&work.gd[..n * oc], &mut y[..rows.len() * oc], n, oc)?;
                }
                None => {
                    self.base_forward(p, s, y, x, false, None);
                    tp.all_reduce(y)?;
                }
            }
            if let Some(res) = res {
                add_into(y, res);
            }
            if let Some(b) = self.bias_span() {
                add_bias(y, &p[b]);
            }
        } else {
            self.base_forward(p, s, y, x, true, res);
        }
        for q in self.parts {
            let cols = Cols { buf: &mut *y, col0: q.col0, rs };
            let kept = (&mut kept[q.idx], &mut *work.xa, &mut *work.xd);
            let sum = split.then_some((&mut *tp, seq.clone()));
            self.lora_forward(s, q, p, (cols, x), kept, sum)?;
        }
        Ok(())
    }

    /// The input features a dropout mask row covers here: this rank's
    /// `ic`, from `rank·ic` for a row-parallel projection (its input is
    /// the rank's slice; 0 unsplit), from 0 for a column one (whole input).
    fn drop_cols(&self, drop: &Dropout) -> (usize, usize) {
        match self.role {
            Role::Row => (self.ic, drop.rank * self.ic),
            Role::Column => (self.ic, 0),
        }
    }

    /// Module `q`'s LoRA forward, if it has an adapter: `xa = x·Aᵀ` (of the
    /// dropped-out input under dropout; summed over the group beside a
    /// split row projection), kept, then `y[:, col0..] += s · xa·Bᵀ` (on
    /// the rows `y` holds: this rank's under sequence parallelism).
    fn lora_forward(
        &self,
        s: &Site<'_>,
        q: &Module,
        p: &[f32],
        (y, x): (Cols<'_>, &[f32]),
        (xa, buf, xd): (&mut SavedTensor, &mut Vec<f32>, &mut [f32]),
        sum: Option<(&mut TensorGroup<'_>, Option<Range<usize>>)>,
    ) -> Result<(), EngineError> {
        let Some(lr) = s.adapter(q.idx) else { return Ok(()) };
        engine::profile::timed(engine::profile::Kind::Adapter, || {
            let x = match s.drop {
                Some((drop, layer)) => {
                    let xd = &mut xd[..x.len()];
                    xd.copy_from_slice(x);
                    drop.mask((layer, q.idx), xd, self.drop_cols(drop));
                    &*xd
                }
                None => x,
            };
            let branch = s.branch(lr, p);
            branch.down(buf, x);
            // The rows `y` holds: all of them, or this rank's under sequence parallelism.
            let mut rows = 0..s.n;
            if let Some((tp, held)) = sum {
                tp.all_reduce(buf)?;
                rows = held.unwrap_or(rows);
            }
            xa.keep(buf, s.prec);
            let xa = &xa.cur(buf)[rows.start * s.r..rows.end * s.r];
            Branch { n: rows.len(), ..branch }.up(y, xa);
            Ok(())
        })
    }

    /// The backward from the output gradient `dy` (`[n, oc]`): the
    /// biases' and DoRA magnitudes' gradients (from `dy` before DoRA's
    /// scaling), `dx` (`[n, ic]`, overwritten) `= dy·W` plus each
    /// adapter's input gradient, the weights' and adapters' gradients
    /// (frozen ones skipped); a column projection's `dx` summed over the
    /// group. `x`: the input's saved-tensor index and staging buffer.
    #[allow(clippy::too_many_arguments)]
    pub fn backward(
        &self,
        s: &Site<'_>,
        p: &[f32],
        (dx, dy, x): (&mut [f32], Grad<'_>, (usize, usize)),
        (grads, saved): (&mut SegmentGrads<'_>, &mut SavedView<'_>),
        work: &mut Work<'_>,
        norms: &[f32],
        tp: &mut TensorGroup<'_>,
    ) -> Result<(), EngineError> {
        let (n, oc, ic) = (s.n, self.oc(), self.ic);
        let dora = self.any_dora(s);
        let dz_at = s.saved.1;
        let Work { xa: dxa, z: zb, xd, gx, gd } = work;
        // Sequence parallelism: a row projection's output gradient, a
        // column projection's input (once for all its parts), gathered to
        // every row; the column's input gradient summed in `gd` first.
        let (dy, gathered, dx, dx_local) = match (s.seq_rows(tp), self.role) {
            (Some(_), Role::Row) => {
                tp.all_gather_rows(dy.values(), gd, n, oc)?;
                (Grad::Own(&mut gd[..n * oc]), None, dx, None)
            }
            (Some(_), Role::Column) => {
                tp.all_gather_rows(saved.get(x.0), gx, n, ic)?;
                (dy, Some(&gx[..n * ic]), &mut gd[..n * ic], Some(dx))
            }
            (None, _) => (dy, None, dx, None),
        };
        // The biases come after DoRA's scaling: their gradients read dy unscaled.
        if dora || !matches!(self.base, Base::Conv1d) {
            for q in self.parts {
                let Some(b) = &q.bias else { continue };
                if let Some(g) = param_grad(grads.tensor(b.clone())) {
                    bias_backward(g, dy.values(), q.col0, oc);
                }
            }
        }
        let dy: &[f32] = match dy {
            Grad::Own(g) => {
                for q in self.parts {
                    let Some(mr) = s.dora(q.idx) else { continue };
                    let nr = &norms[s.norm_range(q.idx)];
                    let z = saved.get(dz_at + q.idx);
                    if let Some(dm) = param_grad(grads.tensor(mr.clone())) {
                        dora::magnitude_grad(dm, Strided { data: g, offset: q.col0, rs: oc, cs: 1 }, z, nr);
                    }
                    dora::scale_columns(g, (q.col0, oc), n, &p[mr], nr);
                }
                g
            }
            Grad::Shared(g) => match s.dora(self.parts[0].idx).filter(|_| self.parts.len() == 1) {
                Some(mr) => {
                    let idx = self.parts[0].idx;
                    let nr = &norms[s.norm_range(idx)];
                    let z = saved.get(dz_at + idx);
                    if let Some(dm) = param_grad(grads.tensor(mr.clone())) {
                        dora::magnitude_grad(dm, Strided::rows(g, oc), z, nr);
                    }
                    let zb = &mut zb[..n * oc];
                    dora::scaled_copy(zb, Strided::rows(g, oc), n, &p[mr], nr);
                    zb
                }
                None => g,
            },
        };
        let lin = s.lin(ic, oc);
        match self.base {
            Base::Conv1d => {
                let q = &self.parts[0];
                let (gw, gb) = match (&q.bias, dora) {
                    (Some(b), false) => grads.pair(q.w.clone(), b.clone()),
                    _ => (grads.tensor(q.w.clone()), None),
                };
                let (xv, xa) = part_inputs(saved, gathered, x, (s.saved.0 + q.idx, s.saved.2));
                conv1d_backward(dx, param_grad(gw), param_grad(gb), dy, xv, &p[q.w.clone()], lin);
                self.lora_backward(s, q, p, (dx, columns(dy, q.col0, oc)), (xv, xa), grads, (dxa, xd));
            }
            base => {
                match base {
                    Base::Frozen(f) => f.backward_input(dx, false, Strided::rows(dy, oc), lin),
                    _ => linear_backward_input(dx, false, Strided::rows(dy, oc), &p[self.w_span()], lin),
                }
                for q in self.parts {
                    let (xv, xa) = part_inputs(saved, gathered, x, (s.saved.0 + q.idx, s.saved.2));
                    let dyq = columns(dy, q.col0, oc);
                    // dW (+)= dyᵀ · x: (out, n) @ (n, in) -> (out, in); a packed base is frozen.
                    if let Base::Linear = base {
                        linear_backward_weight(param_grad(grads.tensor(q.w.clone())), dyq, xv, s.lin(ic, q.oc));
                    }
                    self.lora_backward(s, q, p, (dx, dyq), (xv, xa), grads, (dxa, xd));
                }
            }
        }
        match (self.role, dx_local) {
            // Each rank's part of every row's input gradient: summed, each rank keeping its rows.
            (Role::Column, Some(local)) => tp.reduce_scatter_rows(dx, local, n, ic)?,
            (Role::Column, None) => tp.all_reduce(dx)?,
            (Role::Row, _) => {}
        }
        Ok(())
    }

    /// Module `q`'s LoRA backward, if it has an adapter: `dB (+)= s·dyᵀ·xa`,
    /// `dxa = s·dy·B`, `dA (+)= dxaᵀ·x` and `dx += dxa·A` — under dropout
    /// of the dropped-out input, and the input gradient masked the same way.
    #[allow(clippy::too_many_arguments)]
    fn lora_backward(
        &self,
        s: &Site<'_>,
        q: &Module,
        p: &[f32],
        (dx, dy): (&mut [f32], Strided<'_>),
        (x, xa): (&[f32], &[f32]),
        grads: &mut SegmentGrads<'_>,
        (dxa, xd): (&mut Vec<f32>, &mut [f32]),
    ) {
        let Some(lr) = s.adapter(q.idx) else { return };
        engine::profile::timed(engine::profile::Kind::Adapter, || {
            let (ga, gb) = grads.pair(lr.a.clone(), lr.b.clone());
            let (branch, gs) = (s.branch(lr, p), (param_grad(ga), param_grad(gb)));
            let dxa = &mut dxa[..s.n * s.r];
            if let Some((drop, layer)) = s.drop {
                let xd = &mut xd[..x.len()];
                xd.copy_from_slice(x);
                drop.mask((layer, q.idx), xd, self.drop_cols(drop));
                branch.backward(gs, dy, (xd, xa), dxa);
                branch.input_grad(xd, false, dxa);
                drop.mask((layer, q.idx), xd, self.drop_cols(drop));
                add_into(dx, xd);
                return;
            }
            branch.backward(gs, dy, (x, xa), dxa);
            // dx += dxa · A (the base's dy·W is already in dx)
            branch.input_grad(dx, true, dxa);
        })
    }
}

/// A part's input — `gathered` (sequence parallelism's rows of every
/// rank), else saved tensor `x.0` decoded into staging `x.1` — and its
/// LoRA `x·Aᵀ`, saved tensor `xa.0` (decoded into staging `xa.1`).
fn part_inputs<'v>(
    saved: &'v mut SavedView<'_>,
    gathered: Option<&'v [f32]>,
    x: (usize, usize),
    xa: (usize, usize),
) -> (&'v [f32], &'v [f32]) {
    match gathered {
        Some(g) => (g, saved.get(xa.0)),
        None => saved.pair(x, xa),
    }
}

/// The projections' working buffers as a block holds them.
impl<'b> Work<'b> {
    /// From the block's buffers.
    pub fn new(
        xa: &'b mut Vec<f32>,
        z: &'b mut Vec<f32>,
        xd: &'b mut [f32],
        (gx, gd): (&'b mut [f32], &'b mut [f32]),
    ) -> Self {
        Work { xa, z, xd, gx, gd }
    }
}
