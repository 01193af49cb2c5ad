//! Token embeddings, with or without learned positions (GPT-2's `wpe`).

use crate::linear::Weight;
use crate::{assert_len, Positions};
use rayon::prelude::*;

/// A token whose embedding row another rank holds (the vocabulary split
/// over a tensor-parallel group): its row of the output is zero and it
/// adds to no gradient here.
pub const NOT_HERE: u32 = u32::MAX;

/// `tokens` as row indices into the slice `rows` of the vocabulary
/// (`tok − rows.start`), [`NOT_HERE`] for a token outside it.
pub fn local_tokens(tokens: &[u32], rows: std::ops::Range<usize>) -> Vec<u32> {
    let local = |t: u32| (rows.contains(&(t as usize))).then(|| (t as usize - rows.start) as u32);
    tokens.iter().map(|&t| local(t).unwrap_or(NOT_HERE)).collect()
}

/// `out[r] = wte[tokens[r]] (+ wpe[pos.at(r)])`: `out` `[n, c]`, `wte`
/// `[V, c]` (f32, or a packed matrix whose rows are dequantised: the f32
/// table's values exactly), `wpe` (learned positions, if any) `[≥ T, c]`.
/// A [`NOT_HERE`] token's row is zero (without positions; see
/// [`add_positions`]).
pub fn embedding_forward<'w>(
    out: &mut [f32],
    tokens: &[u32],
    wte: impl Into<Weight<'w>>,
    wpe: Option<&[f32]>,
    pos: Positions<'_>,
    c: usize,
) {
    engine::profile::timed(engine::profile::Kind::Embedding, || {
        assert_len("embedding_forward", "out", out.len(), &[tokens.len(), c]);
        let wte = match wte.into() {
            Weight::F32(w) => w,
            Weight::Packed(m, _) => {
                out.par_chunks_mut(c).zip(tokens.par_iter()).enumerate().for_each(|(r, (o, &tok))| {
                    if tok == NOT_HERE {
                        return o.fill(0.0);
                    }
                    m.dequantize_rows(tok as usize..tok as usize + 1, o);
                    if let Some(wpe) = wpe {
                        o.iter_mut().zip(&wpe[pos.at(r) * c..][..c]).for_each(|(o, p)| *o += p);
                    }
                });
                return;
            }
        };
        match wpe {
            Some(wpe) => out.par_chunks_mut(c).zip(tokens.par_iter()).enumerate().for_each(|(r, (o, &tok))| {
                if tok == NOT_HERE {
                    return o.fill(0.0);
                }
                let (e, p) = (&wte[tok as usize * c..][..c], &wpe[pos.at(r) * c..][..c]);
                for i in 0..c {
                    o[i] = e[i] + p[i];
                }
            }),
            None => out.par_chunks_mut(c).zip(tokens.par_iter()).for_each(|(o, &tok)| match tok {
                NOT_HERE => o.fill(0.0),
                _ => o.copy_from_slice(&wte[tok as usize * c..][..c]),
            }),
        }
    })
}

/// `out[r] += wpe[pos.at(row0 + r)]`: the learned positions added to
/// token embeddings already in `out` (`[n, c]`: rows `row0..` of the
/// micro-batch), the same sums as [`embedding_forward`] adds them in.
pub fn add_positions(out: &mut [f32], wpe: &[f32], (pos, row0): (Positions<'_>, usize), c: usize) {
    engine::profile::timed(engine::profile::Kind::Embedding, || {
        out.par_chunks_mut(c).enumerate().for_each(|(r, o)| {
            o.iter_mut().zip(&wpe[pos.at(row0 + r) * c..][..c]).for_each(|(o, p)| *o += p);
        })
    })
}

/// Adds the gradients of [`embedding_forward`] into `dwte` and `dwpe`
/// (either may be absent: a frozen tensor, or no positions). Embedding
/// gradients are only ever added to.
pub fn embedding_backward(
    mut dwte: Option<&mut [f32]>,
    mut dwpe: Option<&mut [f32]>,
    dout: &[f32],
    tokens: &[u32],
    pos: Positions<'_>,
    c: usize,
) {
    engine::profile::timed(engine::profile::Kind::Embedding, || {
        assert_len("embedding_backward", "dout", dout.len(), &[tokens.len(), c]);
        // Serial scatter-add in row order: deterministic, and O(B·T·C) is small.
        for (r, (d, &tok)) in dout.chunks(c).zip(tokens).enumerate() {
            if let Some(dwte) = dwte.as_deref_mut().filter(|_| tok != NOT_HERE) {
                let e = &mut dwte[tok as usize * c..][..c];
                for i in 0..c {
                    e[i] += d[i];
                }
            }
            if let Some(dwpe) = dwpe.as_deref_mut() {
                let p = &mut dwpe[pos.at(r) * c..][..c];
                for i in 0..c {
                    p[i] += d[i];
                }
            }
        }
    })
}
