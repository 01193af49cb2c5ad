//! DoRA on Llama's projections: the magnitudes' initialisation from the
//! base weights (the kernels are [`nn::dora`]'s).

use crate::frozen::FrozenBase;
use crate::layout::Proj;
use crate::model::Llama;
use nn::dora::initial_magnitude;
use std::ops::Range;

/// The magnitude's tensor name after the projection's path (PEFT's key in
/// `adapter_model.safetensors`: `…q_proj.lora_magnitude_vector`).
pub use nn::lora::MAGNITUDE;

pub(crate) use nn::dora::rescale_rows;

/// Sets layer `idx`'s DoRA magnitudes inside `layer` (the layer's segment
/// of `model`'s parameters) to the row norms of its base weights: those in
/// `layer`, or in `frozen` when the layout leaves them out (neither: left
/// as they are — a packed layout without its base runs no pass).
pub(crate) fn init_magnitudes(model: &Llama, idx: usize, layer: &mut [f32], frozen: Option<&FrozenBase>) {
    let (cfg, lp) = (model.config(), model.layer_params(idx));
    let at = |r: &Range<usize>| r.start - lp.attn_norm.start..r.end - lp.attn_norm.start;
    for (pr, lr) in Proj::ALL.into_iter().zip(&lp.lora) {
        let Some(m) = lr.as_ref().and_then(|l| l.m.as_ref()) else { continue };
        let [oc, ic] = pr.shape(cfg);
        let mut mags = vec![0.0f32; oc];
        match (model.packs_base(), frozen) {
            (false, _) => {
                let w = &layer[at(&lp.w(pr))];
                initial_magnitude([oc, ic], &|rows| w[rows.start * ic..rows.end * ic].to_vec(), &mut mags)
            }
            (true, Some(b)) => initial_magnitude([oc, ic], &|rows| b.proj_rows(cfg, idx, pr, rows), &mut mags),
            (true, None) => continue,
        }
        layer[at(m)].copy_from_slice(&mags);
    }
}
