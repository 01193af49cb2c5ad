//! `train.ema_decay`: an exponential moving average of the trainable
//! tensors, kept in f32 by rank 0 over the whole model (the configurations
//! where rank 0 holds every f32 weight after a step — ZeRO 0–2 in f32, no
//! pipeline or tensor split — so W ranks keep what one rank keeps), updated
//! after every optimizer step that was applied (an f16 step skipped for
//! overflow changes nothing, the average included):
//! `ema ← d·ema + (1 − d)·params`, starting from the initial parameters.
//! Saved in every checkpoint (`ema.safetensors`, so a resume continues it
//! bit for bit) and, after the last step, as a model folder `RUN/ema/`
//! that loads like the run's own model.

use anyhow::{bail, Result};
use engine::ParamLayout;
use std::collections::HashMap;
use std::ops::Range;

/// The run folder's subfolder the averaged model is saved in.
pub const DIR: &str = "ema";

/// The moving average of one run.
pub struct Ema {
    decay: f32,
    /// Each trainable tensor's name, shape and range in the parameters.
    tensors: Vec<(String, Vec<usize>, Range<usize>)>,
    /// The tensors' averages, back to back in `tensors`' order.
    values: Vec<f32>,
}

impl Ema {
    /// The average of `layout`'s trainable tensors with decay `decay`,
    /// starting from `params` or continuing `resumed` (a checkpoint's,
    /// by tensor name; every trainable tensor must be there).
    pub fn new(
        decay: f32,
        layout: &ParamLayout,
        params: &[f32],
        resumed: Option<&HashMap<String, Vec<f32>>>,
    ) -> Result<Self> {
        let tensors: Vec<_> = layout
            .tensors()
            .iter()
            .filter(|t| t.trainable)
            .map(|t| (t.name.clone(), t.shape.clone(), t.range()))
            .collect();
        let mut values = Vec::with_capacity(tensors.iter().map(|t| t.2.len()).sum());
        for (name, _, range) in &tensors {
            match resumed {
                None => values.extend_from_slice(&params[range.clone()]),
                Some(saved) => match saved.get(name) {
                    Some(v) if v.len() == range.len() => values.extend_from_slice(v),
                    _ => bail!(
                        "the checkpoint's moving average has no tensor `{name}` of {} values (train.ema_decay is on now: was it off, or were other tensors trainable, when the checkpoint was written?); resume with the run's own train.ema_decay and train.trainable",
                        range.len()
                    ),
                },
            }
        }
        Ok(Self { decay, tensors, values })
    }

    /// One applied optimizer step: `ema ← d·ema + (1 − d)·params`, in f32,
    /// element by element (no reduction, so the result does not depend on
    /// how the work is split).
    pub fn update(&mut self, params: &[f32]) {
        let (d, one_minus_d) = (self.decay, 1.0 - self.decay);
        let mut at = 0;
        for (_, _, range) in &self.tensors {
            let dst = &mut self.values[at..at + range.len()];
            dst.iter_mut().zip(&params[range.clone()]).for_each(|(e, &p)| *e = d * *e + one_minus_d * p);
            at += range.len();
        }
    }

    /// The averages as named tensors, for a checkpoint.
    pub fn tensors(&self) -> Vec<crate::checkpoint::NamedTensor<'_>> {
        let mut at = 0;
        self.tensors
            .iter()
            .map(|(name, shape, range)| {
                let v = &self.values[at..at + range.len()];
                at += range.len();
                (name.clone(), shape.clone(), v)
            })
            .collect()
    }

    /// `params` with every trainable tensor replaced by its average: the
    /// model the average describes (frozen tensors do not move).
    pub fn model(&self, params: &[f32]) -> Vec<f32> {
        let mut out = params.to_vec();
        let mut at = 0;
        for (_, _, range) in &self.tensors {
            out[range.clone()].copy_from_slice(&self.values[at..at + range.len()]);
            at += range.len();
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn averages_trainable_tensors_only_and_resumes_by_name() {
        let mut layout = ParamLayout::new();
        layout.push("a", &[2], true);
        layout.push("frozen", &[1], false);
        layout.push("b", &[1], true);
        layout.set_trainable(|t| t.name != "frozen");
        let p0 = [1.0f32, 2.0, 7.0, 3.0];
        let mut ema = Ema::new(0.5, &layout, &p0, None).unwrap();
        ema.update(&[3.0, 4.0, 9.0, 5.0]);
        assert_eq!(ema.model(&[0.0, 0.0, 9.0, 0.0]), [2.0, 3.0, 9.0, 4.0]);
        let saved: HashMap<String, Vec<f32>> = ema.tensors().into_iter().map(|(n, _, v)| (n, v.to_vec())).collect();
        assert_eq!(saved.len(), 2, "the frozen tensor has no average");
        let again = Ema::new(0.5, &layout, &p0, Some(&saved)).unwrap();
        assert_eq!(again.values, ema.values);
        let missing = HashMap::from([("a".to_string(), vec![0.0, 0.0])]);
        assert!(Ema::new(0.5, &layout, &p0, Some(&missing)).is_err());
    }
}
