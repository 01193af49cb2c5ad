//! Linear layers on the shared GEMM, in both weight layouts: GPT-2's
//! `Conv1D` (`w` `[in, out]`, [`conv1d_forward`]) and `nn.Linear`
//! (`w` `[out, in]`, [`linear_forward`]). Shapes are given as a
//! [`LinearShape`]: `n` rows of `ic` inputs to `oc` outputs. An
//! `nn.Linear` weight is a [`Weight`]: f32 values, or rows of a frozen
//! [`PackedMatrix`] that the GEMM dequantises a panel at a time.

use crate::grad::{bias_backward, ParamGrad};
use crate::{assert_len, gemm_into, parallelism, GemmDims, GemmOut, Operands, Strided};
pub use linalg::packed::{PackFormat, PackedMatrix};
use rayon::prelude::*;
use std::ops::Range;

/// The weight `[oc, ic]` of an `nn.Linear` layer: f32 values, or rows
/// `rows` of a packed (frozen) matrix.
#[derive(Debug, Clone)]
pub enum Weight<'a> {
    /// Row-major f32 values.
    F32(&'a [f32]),
    /// Rows of a packed matrix (`oc` of them, `ic` columns): a frozen
    /// weight, read by dequantising panels; it has no gradient.
    Packed(&'a PackedMatrix, Range<usize>),
}

impl<'a> From<&'a [f32]> for Weight<'a> {
    fn from(w: &'a [f32]) -> Self {
        Weight::F32(w)
    }
}

impl Weight<'_> {
    /// Checks that the weight is `[oc, ic]` (`what` names the caller).
    fn check(&self, what: &str, oc: usize, ic: usize) {
        match self {
            Weight::F32(w) => assert_len(what, "w", w.len(), &[oc, ic]),
            Weight::Packed(m, rows) => assert!(
                rows.len() == oc && rows.end <= m.rows() && m.cols() == ic,
                "{what}: packed rows {rows:?} of a {} × {} matrix as a [{oc}, {ic}] weight",
                m.rows(),
                m.cols()
            ),
        }
    }
}

/// The shape of one linear layer call: `[n, ic] → [n, oc]`, its output
/// scaled by `alpha`, on the GEMM operands `ops`.
#[derive(Debug, Clone, Copy)]
pub struct LinearShape {
    /// Rows (B·T).
    pub n: usize,
    /// Input features.
    pub ic: usize,
    /// Output features.
    pub oc: usize,
    /// Scale of the product (LoRA's α/r; 1 otherwise).
    pub alpha: f32,
    /// GEMM operands.
    pub ops: Operands,
}

impl LinearShape {
    /// `[n, ic] → [n, oc]` at scale 1.
    pub fn new(n: usize, ic: usize, oc: usize, ops: Operands) -> Self {
        LinearShape { n, ic, oc, alpha: 1.0, ops }
    }

    /// The same shape at scale `alpha`.
    pub fn scaled(self, alpha: f32) -> Self {
        LinearShape { alpha, ..self }
    }
}

/// `oc` columns of a row-major matrix, starting at column `col0` of rows
/// `rs` apart: where a projection writes inside a fused output (q | k | v).
#[derive(Debug)]
pub struct Cols<'a> {
    /// The matrix.
    pub buf: &'a mut [f32],
    /// First column written.
    pub col0: usize,
    /// Row width.
    pub rs: usize,
}

impl<'a> Cols<'a> {
    /// The whole matrix, rows `rs` wide.
    pub fn all(buf: &'a mut [f32], rs: usize) -> Self {
        Cols { buf, col0: 0, rs }
    }
}

/// Columns `col0..` of a row-major matrix whose rows are `row_width` apart.
pub fn columns(data: &[f32], col0: usize, row_width: usize) -> Strided<'_> {
    Strided { data, offset: col0, rs: row_width, cs: 1 }
}

/// `out[n, oc] = residual + inp[n, ic] · w[ic, oc] + bias` (HF `Conv1D` layout).
pub fn conv1d_forward(
    out: &mut [f32],
    inp: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    residual: Option<&[f32]>,
    s: LinearShape,
) {
    engine::profile::timed(engine::profile::Kind::Linear, || {
        let LinearShape { n, ic, oc, ops, .. } = s;
        let init = bias.is_some() || residual.is_some();
        if init {
            out.par_chunks_mut(oc).enumerate().for_each(|(r, o)| {
                match residual {
                    Some(res) => o.copy_from_slice(&res[r * oc..][..oc]),
                    None => o.fill(0.0),
                }
                if let Some(b) = bias {
                    o.iter_mut().zip(b).for_each(|(o, b)| *o += b);
                }
            });
        }
        let par = parallelism(false).with(ops);
        // (n, ic) @ (ic, oc) -> (n, oc), added to the bias/residual rows.
        gemm_into(
            GemmDims { m: n, n: oc, k: ic },
            out,
            GemmOut { offset: 0, rs: oc, accumulate: init },
            Strided::rows(inp, ic),
            Strided::rows(w, oc),
            1.0,
            par,
        );
    })
}

/// Backward of [`conv1d_forward`]: overwrites `dinp`; `dw` and `db` as
/// their [`ParamGrad`]s say (absent: not computed).
pub fn conv1d_backward(
    dinp: &mut [f32],
    dw: Option<ParamGrad<'_>>,
    db: Option<ParamGrad<'_>>,
    dout: &[f32],
    inp: &[f32],
    w: &[f32],
    s: LinearShape,
) {
    engine::profile::timed(engine::profile::Kind::Linear, || {
        let LinearShape { n, ic, oc, ops, .. } = s;
        let par = parallelism(false).with(ops);
        // dinp = dout · wᵀ: (n, oc) @ (oc, ic) -> (n, ic)
        gemm_into(
            GemmDims { m: n, n: ic, k: oc },
            dinp,
            GemmOut::overwrite(ic),
            Strided::rows(dout, oc),
            Strided::transposed(w, oc),
            1.0,
            par,
        );
        if let Some(ParamGrad { buf: dw, accumulate }) = dw {
            assert_eq!(dw.len(), ic * oc, "dw length");
            // dw (+)= inpᵀ · dout: (ic, n) @ (n, oc) -> (ic, oc)
            let (inp_t, dout) = (Strided::transposed(inp, ic), Strided::rows(dout, oc));
            gemm_into(
                GemmDims { m: ic, n: oc, k: n },
                dw,
                GemmOut { offset: 0, rs: oc, accumulate },
                inp_t,
                dout,
                1.0,
                par,
            );
        }
        if let Some(db) = db {
            bias_backward(db, dout, 0, oc);
        }
    })
}

/// `y[:, col0..col0+oc] (+)= alpha · x · wᵀ`: x `[n, ic]`, w `[oc, ic]`
/// (`nn.Linear`; f32 or packed). Also LoRA's two halves: `x·Aᵀ` and `s·(x·Aᵀ)·Bᵀ`.
pub fn linear_forward<'w>(y: Cols<'_>, accumulate: bool, x: &[f32], w: impl Into<Weight<'w>>, s: LinearShape) {
    engine::profile::timed(engine::profile::Kind::Linear, || {
        let LinearShape { n, ic, oc, alpha, ops } = s;
        let w = w.into();
        assert_len("linear_forward", "x", x.len(), &[n, ic]);
        w.check("linear_forward", oc, ic);
        let Cols { buf, col0, rs } = y;
        assert!(col0 + oc <= rs, "linear_forward: columns {col0}+{oc} exceed the row width {rs}");
        let (xv, out, par) =
            (Strided::rows(x, ic), GemmOut { offset: col0, rs, accumulate }, parallelism(false).with(ops));
        match w {
            // (n, ic) @ (ic, oc) -> (n, oc), into columns col0.. of y
            Weight::F32(w) => {
                gemm_into(GemmDims { m: n, n: oc, k: ic }, buf, out, xv, Strided::transposed(w, ic), alpha, par)
            }
            Weight::Packed(m, rows) => linalg::packed::gemm_x_wt(n, buf, out, xv, m, rows, alpha, par),
        }
    })
}

/// `y (+)= b` on every row: `y` `[n, oc]`, `b` `[oc]`.
pub fn add_bias(y: &mut [f32], b: &[f32]) {
    engine::profile::timed(engine::profile::Kind::Linear, || {
        assert!(
            !b.is_empty() && y.len().is_multiple_of(b.len()),
            "add_bias: rows of {} do not tile {}",
            b.len(),
            y.len()
        );
        y.par_chunks_mut(b.len()).for_each(|row| row.iter_mut().zip(b).for_each(|(o, b)| *o += b));
    })
}

/// `y += x`, element by element (a residual added after a tensor-parallel
/// reduction).
pub fn add_into(y: &mut [f32], x: &[f32]) {
    engine::profile::timed(engine::profile::Kind::Elementwise, || {
        assert_eq!(y.len(), x.len(), "add_into: lengths differ");
        y.par_chunks_mut(1 << 14)
            .zip(x.par_chunks(1 << 14))
            .for_each(|(y, x)| y.iter_mut().zip(x).for_each(|(y, x)| *y += x));
    })
}

/// Input gradient of [`linear_forward`]: `dx[n, ic] (+)= alpha · dy · w`
/// (f32 or packed `w`).
pub fn linear_backward_input<'w>(
    dx: &mut [f32],
    accumulate: bool,
    dy: Strided<'_>,
    w: impl Into<Weight<'w>>,
    s: LinearShape,
) {
    engine::profile::timed(engine::profile::Kind::Linear, || {
        let LinearShape { n, ic, oc, alpha, ops } = s;
        let w = w.into();
        assert_len("linear_backward_input", "dx", dx.len(), &[n, ic]);
        w.check("linear_backward_input", oc, ic);
        let (out, par) = (GemmOut { offset: 0, rs: ic, accumulate }, parallelism(false).with(ops));
        match w {
            // (n, oc) @ (oc, ic) -> (n, ic)
            Weight::F32(w) => gemm_into(GemmDims { m: n, n: ic, k: oc }, dx, out, dy, Strided::rows(w, ic), alpha, par),
            Weight::Packed(m, rows) => linalg::packed::gemm_dy_w(n, dx, out, dy, m, rows, alpha, par),
        }
    })
}

/// Weight gradient of [`linear_forward`]: `dw[oc, ic] (+)= alpha · dyᵀ · x`
/// (skipped when `dw` is `None`: a frozen weight).
pub fn linear_backward_weight(dw: Option<ParamGrad<'_>>, dy: Strided<'_>, x: &[f32], s: LinearShape) {
    engine::profile::timed(engine::profile::Kind::Linear, || {
        let LinearShape { n, ic, oc, alpha, ops } = s;
        let Some(ParamGrad { buf: dw, accumulate }) = dw else { return };
        assert_len("linear_backward_weight", "dw", dw.len(), &[oc, ic]);
        assert_len("linear_backward_weight", "x", x.len(), &[n, ic]);
        // (oc, n) @ (n, ic) -> (oc, ic)
        gemm_into(
            GemmDims { m: oc, n: ic, k: n },
            dw,
            GemmOut { offset: 0, rs: ic, accumulate },
            dy.t(),
            Strided::rows(x, ic),
            alpha,
            parallelism(false).with(ops),
        );
    })
}

/// A GEMM of a model's head (the logits and their gradients), counted as a
/// linear layer in `bench`'s profile (it is one; called directly it fell
/// under "other", a quarter of GPT-2's step there).
pub fn head_gemm(dims: GemmDims, dst: &mut [f32], out: GemmOut, lhs: Strided<'_>, rhs: Strided<'_>, par: crate::Par) {
    engine::profile::timed(engine::profile::Kind::Linear, || gemm_into(dims, dst, out, lhs, rhs, 1.0, par))
}

/// [`head_gemm`] on a packed head `[V, C]` (a tied embedding kept packed):
/// `logits[rows, V] = x · headᵀ`, the f32 product of its values.
pub fn head_gemm_packed(rows: usize, logits: &mut [f32], x: Strided<'_>, head: &PackedMatrix, par: crate::Par) {
    engine::profile::timed(engine::profile::Kind::Linear, || {
        let out = GemmOut::overwrite(head.rows());
        linalg::packed::gemm_x_wt(rows, logits, out, x, head, 0..head.rows(), 1.0, par)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn linear_forward_rejects_columns_past_the_row() {
        let bad = std::panic::catch_unwind(|| {
            let mut y = [0.0; 4];
            let s = LinearShape::new(1, 2, 2, Operands::F32);
            linear_forward(Cols { buf: &mut y, col0: 1, rs: 2 }, false, &[0.0; 2], &[0.0f32; 4][..], s)
        });
        assert!(bad.is_err(), "columns past the row");
    }
}
