//! Parameter gradients as backward kernels receive them, and the
//! deterministic row reductions that compute them.

use rayon::prelude::*;

/// Rows per task for reductions over rows (parameter gradients).
const ROWS_PER_TASK: usize = 32;

/// Where a backward kernel writes one parameter's gradient: the buffer, and
/// whether to add into it (`accumulate`) or overwrite every element. A
/// frozen tensor is `None` where a kernel takes `Option<ParamGrad>`: its
/// gradient is not computed.
#[derive(Debug)]
pub struct ParamGrad<'a> {
    /// The gradient buffer of the tensor.
    pub buf: &'a mut [f32],
    /// `true`: add into `buf`; `false`: overwrite it.
    pub accumulate: bool,
}

impl<'a> From<engine::GradOut<'a>> for ParamGrad<'a> {
    fn from(g: engine::GradOut<'a>) -> Self {
        ParamGrad { buf: g.buf, accumulate: g.accumulate }
    }
}

/// The store's gradient for a tensor (absent: frozen) as a kernel's [`ParamGrad`].
pub fn param_grad(g: Option<engine::GradOut<'_>>) -> Option<ParamGrad<'_>> {
    g.map(ParamGrad::from)
}

/// Sums per-task partial results of width `Σ targets' widths` over fixed
/// chunks of rows, in chunk order, and adds them into each target (or
/// writes them, where it says overwrite). Absent targets are skipped; with
/// none present nothing is computed.
pub(crate) fn reduce_rows(
    n_rows: usize,
    targets: &mut [Option<ParamGrad<'_>>],
    widths: &[usize],
    f: impl Fn(std::ops::Range<usize>, &mut [f32]) + Sync,
) {
    if targets.iter().all(Option::is_none) {
        return;
    }
    let width: usize = widths.iter().sum();
    let partials: Vec<Vec<f32>> = (0..n_rows.div_ceil(ROWS_PER_TASK))
        .into_par_iter()
        .map(|chunk| {
            let mut acc = vec![0.0f32; width];
            f(chunk * ROWS_PER_TASK..((chunk + 1) * ROWS_PER_TASK).min(n_rows), &mut acc);
            acc
        })
        .collect();
    for (t, &w) in targets.iter_mut().zip(widths) {
        if let Some(ParamGrad { buf, accumulate: false }) = t {
            assert_eq!(buf.len(), w, "gradient target length");
            buf.fill(0.0);
        }
    }
    for p in &partials {
        let mut off = 0;
        for (t, &w) in targets.iter_mut().zip(widths) {
            if let Some(t) = t {
                for (d, s) in t.buf.iter_mut().zip(&p[off..off + w]) {
                    *d += s;
                }
            }
            off += w;
        }
    }
}

/// Columns per task of [`column_sums`].
const COLS: usize = 64;

/// `g (+)= Σ_rows` of each row's contribution, parallel over blocks of
/// columns, rows summed in order: deterministic. `add_row(r, cols, acc)`
/// adds row `r`'s contribution to columns `cols` of `g` into `acc`
/// (`acc.len() == cols.len()`), as a loop over slices that vectorises.
pub(crate) fn column_sums(
    g: ParamGrad<'_>,
    n_rows: usize,
    add_row: impl Fn(usize, std::ops::Range<usize>, &mut [f32]) + Sync,
) {
    let ParamGrad { buf, accumulate } = g;
    buf.par_chunks_mut(COLS).enumerate().for_each(|(j, acc)| {
        if !accumulate {
            acc.fill(0.0);
        }
        let cols = j * COLS..j * COLS + acc.len();
        for r in 0..n_rows {
            add_row(r, cols.clone(), acc);
        }
    });
}

/// `db (+)= Σ_rows dout[:, col0..col0 + db.len()]` (rows of `dout` `rs`
/// wide), parallel over columns, rows summed in order.
pub fn bias_backward(db: ParamGrad<'_>, dout: &[f32], col0: usize, rs: usize) {
    assert!(col0 + db.buf.len() <= rs, "bias_backward: columns {col0}+{} exceed the row width {rs}", db.buf.len());
    let n_rows = dout.len().checked_div(rs).unwrap_or(0);
    column_sums(db, n_rows, |r, cols, acc| {
        for (a, d) in acc.iter_mut().zip(&dout[r * rs + col0 + cols.start..]) {
            *a += d;
        }
    });
}
