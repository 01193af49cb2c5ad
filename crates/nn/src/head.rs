//! The LM head as the fused loss uses it: over chunks of rows, so the
//! logits of a whole micro-batch are never held (as Liger's and
//! torchtune's chunked losses do), and how many rows a chunk holds.

use crate::grad::ParamGrad;
use crate::linear::{head_gemm, head_gemm_packed, linear_backward_input, linear_backward_weight, LinearShape, Weight};
use crate::{GemmDims, GemmOut, Strided};
use engine::Precision;

/// f32 values of logits the loss holds at once by default (128 MiB), or
/// [`LOSS_CHUNK_MIN_ROWS`] rows of them where the vocabulary is larger
/// than 2¹⁷ (Gemma's 256,000: 250 MiB).
pub const LOSS_CHUNK_VALUES: u128 = 1 << 25;

/// Rows per chunk of the loss at least, whatever the vocabulary: fewer
/// would spend more time packing the head for each chunk's GEMMs than
/// computing.
pub const LOSS_CHUNK_MIN_ROWS: u128 = 256;

/// Rows of logits over a vocabulary of `vocab` the fused loss holds at
/// once, out of `rows`: the largest of [`chunks`] of at most
/// [`chunk_limit`] rows (u128: planning shapes far beyond this machine
/// never overflows).
pub fn loss_chunk_rows(rows: u128, vocab: u128) -> u128 {
    held_rows(rows, chunk_limit(vocab))
}

/// The largest of the [`chunks`] of `rows` of at most `most` rows.
pub fn held_rows(rows: u128, most: u128) -> u128 {
    rows.div_ceil(n_chunks(rows, most))
}

/// The most rows of a chunk over a vocabulary of `vocab`: as many as
/// fill [`LOSS_CHUNK_VALUES`], at least [`LOSS_CHUNK_MIN_ROWS`].
pub fn chunk_limit(vocab: u128) -> u128 {
    (LOSS_CHUNK_VALUES / vocab.max(1)).max(LOSS_CHUNK_MIN_ROWS)
}

/// As few chunks of at most `most` rows as hold `rows` (one for none).
fn n_chunks(rows: u128, most: u128) -> u128 {
    rows.div_ceil(most.max(1)).max(1)
}

/// `rows` cut into as few chunks of at most `most` rows as hold them, the
/// rows shared evenly (chunk i is `i·rows/n .. (i+1)·rows/n`: sizes differ
/// by one at most), so no chunk is left with a sliver of rows whose GEMMs
/// would take the `gemm` crate's small-matrix or vector paths, which sum
/// in another order: with [`chunk_limit`], every chunk of a cut holds
/// more than `LOSS_CHUNK_MIN_ROWS / 2` rows. No rows: one empty chunk.
pub fn chunks(rows: usize, most: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
    let n = n_chunks(rows as u128, most as u128) as usize;
    (0..n).map(move |i| i * rows / n..(i + 1) * rows / n)
}

/// The head's weights `[V, C]` (f32, or the packed embedding they are
/// tied to) as one chunk of rows uses them.
pub(crate) struct Head<'a> {
    /// The residual stream's width C.
    pub(crate) width: usize,
    /// The vocabulary V.
    pub(crate) vocab: usize,
    /// The weights.
    pub(crate) weight: Weight<'a>,
    /// Logits soft-capped at this (Gemma 2).
    pub(crate) soft_cap: Option<f32>,
    /// The operands' precision.
    pub(crate) precision: Precision,
}

impl Head<'_> {
    /// `logits[rows, V] = x · headᵀ`, soft-capped where the model caps
    /// them: (rows, C) @ (C, V) -> (rows, V).
    pub(crate) fn logits(&self, rows: usize, x: Strided<'_>, logits: &mut [f32]) {
        let (c, v) = (self.width, self.vocab);
        let par = crate::parallelism(false).with(crate::operands(self.precision));
        match &self.weight {
            Weight::Packed(m, _) => head_gemm_packed(rows, logits, x, m, par),
            Weight::F32(w) => {
                let head = Strided::transposed(w, c);
                head_gemm(GemmDims { m: rows, n: v, k: c }, logits, GemmOut::overwrite(v), x, head, par)
            }
        }
        if let Some(cap) = self.soft_cap {
            crate::loss_terms::soft_cap(logits, cap);
        }
    }

    /// From the gradient of the logits of rows `x` (in `dlogits`):
    /// `dx = dlogits · head` ((rows, V) @ (V, C)) and `dhead (+)=
    /// dlogitsᵀ · x` ((V, rows) @ (rows, C)).
    pub(crate) fn backward(&self, (dx, dhead): (&mut [f32], Option<ParamGrad<'_>>), x: &[f32], dlogits: &mut [f32]) {
        let (c, v, prec) = (self.width, self.vocab, self.precision);
        if prec == Precision::F16 {
            // The scaled logits gradient in f16: where a too-large loss scale overflows.
            prec.round(dlogits);
        }
        let lin = LinearShape::new(x.len() / c, c, v, crate::operands(prec));
        let dl = Strided::rows(dlogits, v);
        linear_backward_input(dx, false, dl, self.weight.clone(), lin);
        linear_backward_weight(dhead, dl, x, lin);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The chunks cover the rows in order, differ by one row at most, are
    /// as few as the limit allows, and the largest is what is held; with
    /// the default limit every chunk of a cut holds over 128 rows, even
    /// where the rows barely exceed a multiple of the limit.
    #[test]
    fn chunks_cover_the_rows_evenly() {
        for (rows, most) in [(0, 5), (1, 5), (21, 5), (300, 110), (300, 75), (65281, 256), (8192, 682), (513, 256)] {
            let cs: Vec<_> = chunks(rows, most).collect();
            assert_eq!(cs.len(), rows.div_ceil(most).max(1), "{rows} / {most}: as few chunks as hold them");
            assert_eq!(cs.first().map(|c| c.start), Some(0));
            assert!(cs.windows(2).all(|w| w[0].end == w[1].start) && cs.last().map(|c| c.end) == Some(rows));
            let (lo, hi) = (cs.iter().map(|c| c.len()).min(), cs.iter().map(|c| c.len()).max());
            assert!(hi.unwrap_or(0) <= most && hi.unwrap_or(0) - lo.unwrap_or(0) <= 1, "{rows} / {most}: {cs:?}");
            assert_eq!(held_rows(rows as u128, most as u128), hi.unwrap_or(0) as u128);
            if most == 256 && cs.len() > 1 {
                assert!(lo.unwrap_or(0) > 128, "{rows}: a chunk of {lo:?} rows");
            }
        }
        assert_eq!(loss_chunk_rows(8192, 49152), 631);
        assert_eq!(loss_chunk_rows(8192, 256_000), 256);
        assert_eq!(loss_chunk_rows(300, 160), 300);
    }
}
