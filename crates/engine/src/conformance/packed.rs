//! Packed rows keep their documents apart: documents packed back to back in
//! one row, with their positions ([`TokenBatch::positions`]), give the loss
//! and gradient of the same documents one per row.

use super::{err, Check};
use crate::batch::{TokenBatch, IGNORE_INDEX};
use crate::model::Model;
use crate::rng::SplitMix64;
use crate::store::FullStore;

/// Summed loss, target count and gradient of one micro-batch.
fn loss_and_grad<M: Model<Batch = TokenBatch>>(
    model: &mut M,
    params: &[f32],
    batch: &TokenBatch,
) -> Result<(f64, u64, Vec<f32>), String> {
    let mut g = vec![0.0; model.layout().n_trainable()];
    let mut store = FullStore::for_model(model, params, &mut g).map_err(err("store"))?;
    let stats = model.micro_step(&mut store, batch, 1.0).map_err(err("micro-step"))?;
    Ok((stats.loss_sum, stats.n_targets, g))
}

/// Documents of `lens` tokens (random below `vocab`, the first target of
/// each ignored as a packer leaves it) packed into one row of Σ lens
/// positions, against the same documents one per row, padded with token 0
/// and ignored targets to the longest. Loss and gradient must agree within
/// `rtol` (relative to the larger loss and to the largest gradient
/// magnitude): the sums are the same, grouped differently (attention tiles
/// start at other positions, GEMMs see other row counts). And the packed
/// row without positions — documents attending to earlier ones — must
/// not agree, or the check could not fail.
pub fn check_packed_documents<M: Model<Batch = TokenBatch>>(
    model: &mut M,
    params: &[f32],
    (lens, vocab): (&[usize], u64),
    rtol: f32,
) -> Check {
    let mut rng = SplitMix64::new(0x9ac4ed);
    let docs: Vec<(Vec<u32>, Vec<i32>)> = lens
        .iter()
        .map(|&l| {
            let toks: Vec<u32> = (0..l).map(|_| rng.below(vocab) as u32).collect();
            let targets = (0..l).map(|k| if k == 0 { IGNORE_INDEX } else { rng.below(vocab) as i32 }).collect();
            (toks, targets)
        })
        .collect();
    let total: usize = lens.iter().sum();
    let packed = TokenBatch {
        n_seqs: 1,
        seq_len: total,
        inputs: docs.iter().flat_map(|d| d.0.clone()).collect(),
        targets: docs.iter().flat_map(|d| d.1.clone()).collect(),
        positions: lens.iter().flat_map(|&l| 0..l as u32).collect(),
    };
    let t = lens.iter().copied().max().unwrap_or(0);
    let pad = |l: usize| std::iter::repeat_n(0, t - l);
    let rows = TokenBatch {
        n_seqs: docs.len(),
        seq_len: t,
        inputs: docs.iter().flat_map(|d| d.0.iter().copied().chain(pad(d.0.len()))).collect(),
        targets: docs.iter().flat_map(|d| d.1.iter().copied().chain(pad(d.1.len()).map(|_| IGNORE_INDEX))).collect(),
        positions: Vec::new(),
    };
    let (loss_p, n_p, g_p) = loss_and_grad(model, params, &packed)?;
    let (loss_r, n_r, g_r) = loss_and_grad(model, params, &rows)?;
    if n_p != n_r {
        return Err(format!("packed row counts {n_p} targets, the rows {n_r}"));
    }
    let scale = g_r.iter().fold(0.0f32, |a, x| a.max(x.abs()));
    let g_err = g_p.iter().zip(&g_r).fold(0.0f32, |a, (x, y)| a.max((x - y).abs())) / scale;
    let l_err = ((loss_p - loss_r) / loss_r.abs().max(1e-30)).abs() as f32;
    if !(l_err <= rtol && g_err <= rtol) {
        return Err(format!(
            "packed documents: loss {loss_p} vs {loss_r} one per row ({l_err:.1e}), gradient {g_err:.1e} of its scale (rtol {rtol:e})"
        ));
    }
    let unmasked = TokenBatch { positions: Vec::new(), ..packed };
    let (loss_u, _, _) = loss_and_grad(model, params, &unmasked)?;
    if ((loss_u - loss_r) / loss_r).abs() as f32 <= 100.0 * rtol {
        return Err(format!("without positions the packed row's loss {loss_u} still equals the rows' {loss_r}"));
    }
    Ok(())
}
