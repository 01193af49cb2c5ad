//! `torch.optim.SGD`: momentum, optional Nesterov, L2 weight decay.

use super::{check_non_negative, check_unit, slices_mut, Piece};
use crate::error::EngineError;
use rayon::prelude::*;
use std::ops::Range;

/// `torch.optim.SGD` with momentum, dampening 0, optional Nesterov, and L2
/// weight decay added to the gradient (PyTorch's SGD semantics).
#[derive(Debug, Clone, PartialEq)]
pub struct Sgd {
    /// Momentum μ (0 disables the buffer).
    pub momentum: f32,
    /// Nesterov momentum.
    pub nesterov: bool,
    /// L2 penalty added to the gradient of decaying tensors.
    pub weight_decay: f32,
    pub(super) buf: Vec<f32>,
    pub(super) n_updates: u64,
}

impl Sgd {
    /// A fresh optimizer for `n_params` parameters.
    pub fn new(n_params: usize, momentum: f32, nesterov: bool, weight_decay: f32) -> Result<Self, EngineError> {
        check_unit("optim.momentum", momentum)?;
        check_non_negative("optim.weight_decay", weight_decay)?;
        if nesterov && momentum == 0.0 {
            return Err(EngineError::InvalidHyperParameter {
                field: "optim.momentum",
                value: 0.0,
                rule: "Nesterov momentum needs momentum > 0",
            });
        }
        let buf = if momentum > 0.0 { vec![0.0; n_params] } else { Vec::new() };
        Ok(Self { momentum, nesterov, weight_decay, buf, n_updates: 0 })
    }

    /// Counts the update and fixes its constants.
    pub(super) fn begin(&mut self, lr: f32, grad_scale: f32) -> SgdStep {
        let first = self.n_updates == 0;
        self.n_updates += 1;
        SgdStep { first, mu: self.momentum, nesterov: self.nesterov, wd_all: self.weight_decay, lr, grad_scale }
    }

    pub(super) fn update(&mut self, pieces: Vec<Piece<'_>>, lr: f32, grad_scale: f32) {
        let c = self.begin(lr, grad_scale);
        let buf = (c.mu > 0.0).then_some(self.buf.as_mut_slice());
        sgd_apply(&c, pieces, 0, buf);
    }
}

/// One SGD update's constants.
pub(super) struct SgdStep {
    first: bool,
    mu: f32,
    nesterov: bool,
    wd_all: f32,
    lr: f32,
    grad_scale: f32,
}

/// The SGD update of `pieces`; the momentum buffer (if any) holds state
/// from index `base` on (the whole state, or an offloaded window of it).
pub(super) fn sgd_apply(c: &SgdStep, pieces: Vec<Piece<'_>>, base: usize, buf: Option<&mut [f32]>) {
    let &SgdStep { first, mu, nesterov, wd_all, lr, grad_scale } = c;
    let bufs: Vec<Option<&mut [f32]>> = match buf {
        Some(buf) => {
            let states: Vec<Range<usize>> = pieces.iter().map(|p| p.state.start - base..p.state.end - base).collect();
            slices_mut(buf, &states).into_iter().map(Some).collect()
        }
        None => pieces.iter().map(|_| None).collect(),
    };
    let work: Vec<_> = pieces.into_iter().zip(bufs).collect();
    work.into_par_iter().for_each(|(piece, b)| {
        let Piece { params: p, grads: g, decay, .. } = piece;
        let wd = if decay { wd_all } else { 0.0 };
        match b {
            None => {
                for i in 0..p.len() {
                    p[i] -= lr * (g[i] * grad_scale + wd * p[i]);
                }
            }
            Some(b) => {
                for i in 0..p.len() {
                    let d = g[i] * grad_scale + wd * p[i];
                    // torch: the buffer starts as a clone of the first gradient.
                    b[i] = if first { d } else { mu * b[i] + d };
                    let step = if nesterov { d + mu * b[i] } else { b[i] };
                    p[i] -= lr * step;
                }
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::ParamLayout;
    use crate::optim::Optimizer;

    /// torch.optim.SGD(lr=0.1, momentum=0.9, nesterov=...) on grads 1.0 then 2.0 from p=0:
    /// plain momentum: buf=1 → p=-0.1; buf=0.9+2=2.9 → p=-0.39.
    /// Nesterov: step = g + μ·buf: 1+0.9 = 1.9 → p=-0.19; buf=2.9, step=2+2.61=4.61 → p=-0.651.
    #[test]
    fn sgd_momentum_and_nesterov_match_pytorch() {
        let mut l = ParamLayout::new();
        l.push("w", &[1], true);
        for (nesterov, want) in [(false, [-0.1f32, -0.39]), (true, [-0.19, -0.651])] {
            let mut p = vec![0.0f32];
            let mut opt = Optimizer::Sgd(Sgd::new(1, 0.9, nesterov, 0.0).unwrap());
            opt.update(&l, &mut p, &[1.0], 0.1, 1.0).unwrap();
            assert!((p[0] - want[0]).abs() < 1e-6, "{nesterov} {p:?}");
            opt.update(&l, &mut p, &[2.0], 0.1, 1.0).unwrap();
            assert!((p[0] - want[1]).abs() < 1e-6, "{nesterov} {p:?}");
        }
    }

    #[test]
    fn nesterov_without_momentum_is_an_error() {
        assert!(Sgd::new(1, 0.0, true, 0.0).is_err());
    }
}
