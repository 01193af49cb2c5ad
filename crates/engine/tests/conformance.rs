//! The Model conformance suite on a toy model with closed-form gradients,
//! and a deliberately broken variant that it must reject.
//!
//! The toy: two segments, `[W (d×o), b (o)]` and `[s (o), c (o)]`; per
//! sample `i` and output `j` (where the sample's mask says the target
//! counts) the loss is `½ (s_j·z_ij + c_j − y_ij)²` with `z = x·W + b`.
//! Gradients, with `r = s_j·z_ij + c_j − y_ij`: `∂s_j = Σ r·z_ij`,
//! `∂c_j = Σ r`, `∂z_ij = r·s_j`, `∂W = xᵀ·∂z`, `∂b = Σ_i ∂z_ij`.

use engine::conformance::{self, ModelUnderTest};
use engine::rng::SplitMix64;
use engine::{MicroStepStats, Model, ParamLayout, ParamStore, TensorSpec};
use std::ops::Range;

const D: usize = 3;
const O: usize = 4;

#[derive(Debug, Clone)]
struct ToyBatch {
    x: Vec<f32>,
    y: Vec<f32>,
    mask: Vec<bool>,
}

#[derive(Debug, thiserror::Error)]
#[error("toy: {0}")]
struct ToyError(#[from] engine::EngineError);

struct Toy {
    layout: ParamLayout,
    /// The broken variant adds where the store says overwrite (it forgets
    /// that the buffer may hold a previous step's values).
    ignore_overwrite: bool,
    /// A variant that asks for segment 1 again after segment 0's backward
    /// (a backward that returns upward).
    revisit: bool,
    /// A variant whose backward on an empty batch skips segment 1 (visits
    /// that depend on the data, against the contract).
    skip_on_empty: bool,
}

impl Toy {
    fn new(ignore_overwrite: bool, revisit: bool) -> Self {
        let mut layout = ParamLayout::new();
        layout.push("w", &[D, O], true);
        layout.push("b", &[O], false);
        layout.push("s", &[O], false);
        layout.push("c", &[O], false);
        Toy { layout, ignore_overwrite, revisit, skip_on_empty: false }
    }

    /// z and the residuals r (0 where masked) for the batch.
    fn forward(p0: &[f32], p1: &[f32], b: &ToyBatch) -> (Vec<f32>, Vec<f32>, f64) {
        let n = b.mask.len() / O;
        let (w, bias) = p0.split_at(D * O);
        let (s, c) = p1.split_at(O);
        let mut z = vec![0.0f32; n * O];
        let mut r = vec![0.0f32; n * O];
        let mut loss = 0.0f64;
        for i in 0..n {
            for j in 0..O {
                let zij = bias[j] + (0..D).map(|k| b.x[i * D + k] * w[k * O + j]).sum::<f32>();
                z[i * O + j] = zij;
                if b.mask[i * O + j] {
                    let rij = s[j] * zij + c[j] - b.y[i * O + j];
                    r[i * O + j] = rij;
                    loss += 0.5 * (rij as f64) * (rij as f64);
                }
            }
        }
        (z, r, loss)
    }
}

impl Model for Toy {
    type Batch = ToyBatch;
    type Error = ToyError;

    fn layout(&self) -> &ParamLayout {
        &self.layout
    }

    fn set_trainable(&mut self, trainable: &dyn Fn(&TensorSpec) -> bool) -> usize {
        self.layout.set_trainable(trainable)
    }

    fn segments(&self) -> Vec<Range<usize>> {
        vec![0..D * O + O, D * O + O..D * O + 3 * O]
    }

    fn n_targets(&self, b: &ToyBatch) -> u64 {
        b.mask.iter().filter(|&&m| m).count() as u64
    }

    fn micro_step(
        &mut self,
        store: &mut dyn ParamStore,
        b: &ToyBatch,
        loss_seed: f32,
    ) -> Result<MicroStepStats, ToyError> {
        let n = b.mask.len() / O;
        let p0 = store.segment(0)?.params.to_vec();
        store.done(0, false)?;
        let p1 = store.segment(1)?.params.to_vec();
        let (z, r, loss) = Self::forward(&p0, &p1, b);
        let put = |out: Option<engine::GradOut<'_>>, vals: &[f32], broken: bool| {
            if let Some(g) = out {
                for (d, v) in g.buf.iter_mut().zip(vals) {
                    *d = if g.accumulate || broken { *d + v } else { *v };
                }
            }
        };
        let mut ds = vec![0.0f32; O];
        let mut dc = vec![0.0f32; O];
        for i in 0..n {
            for j in 0..O {
                ds[j] += loss_seed * r[i * O + j] * z[i * O + j];
                dc[j] += loss_seed * r[i * O + j];
            }
        }
        if !(self.skip_on_empty && n == 0) {
            {
                let mut v = store.segment(1)?;
                let (gs, gc) = v.grads.pair(0..O, O..2 * O);
                put(gs, &ds, self.ignore_overwrite);
                put(gc, &dc, self.ignore_overwrite);
            }
            store.done(1, true)?;
        }
        let mut dw = vec![0.0f32; D * O];
        let mut db = vec![0.0f32; O];
        for i in 0..n {
            for j in 0..O {
                let dz = loss_seed * r[i * O + j] * p1[j];
                db[j] += dz;
                for k in 0..D {
                    dw[k * O + j] += b.x[i * D + k] * dz;
                }
            }
        }
        {
            let mut v = store.segment(0)?;
            let (gw, gb) = v.grads.pair(0..D * O, D * O..D * O + O);
            put(gw, &dw, self.ignore_overwrite);
            put(gb, &db, self.ignore_overwrite);
        }
        store.done(0, true)?;
        if self.revisit {
            store.segment(1)?;
            store.done(1, true)?;
        }
        Ok(MicroStepStats { loss_sum: loss, n_targets: self.n_targets(b), ..Default::default() })
    }

    fn loss(&mut self, store: &mut dyn ParamStore, b: &ToyBatch) -> Result<MicroStepStats, ToyError> {
        let p0 = store.segment(0)?.params.to_vec();
        store.done(0, false)?;
        let p1 = store.segment(1)?.params.to_vec();
        store.done(1, false)?;
        let (_, _, loss) = Self::forward(&p0, &p1, b);
        Ok(MicroStepStats { loss_sum: loss, n_targets: self.n_targets(b), ..Default::default() })
    }
}

struct ToyFamily {
    broken: bool,
    revisit: bool,
    skip_on_empty: bool,
    /// 12 samples: x, y, and a mask keeping 1–4 of the 4 targets.
    data: Vec<(Vec<f32>, Vec<f32>, Vec<bool>)>,
}

impl ToyFamily {
    fn new(broken: bool) -> Self {
        let mut rng = SplitMix64::new(5);
        let data = (0..12)
            .map(|i| {
                let x = (0..D).map(|_| rng.normal() as f32).collect();
                let y = (0..O).map(|_| rng.normal() as f32).collect();
                let mask = (0..O).map(|j| j <= i % O).collect();
                (x, y, mask)
            })
            .collect();
        ToyFamily { broken, revisit: false, skip_on_empty: false, data }
    }
}

impl ModelUnderTest for ToyFamily {
    type M = Toy;

    fn model(&self) -> Toy {
        Toy { skip_on_empty: self.skip_on_empty, ..Toy::new(self.broken, self.revisit) }
    }

    fn init(&self) -> Vec<f32> {
        let mut rng = SplitMix64::new(11);
        (0..D * O + 3 * O).map(|_| (rng.normal() * 0.5 + 0.2) as f32).collect()
    }

    fn batch(&self, samples: &[usize]) -> ToyBatch {
        let mut b = ToyBatch { x: Vec::new(), y: Vec::new(), mask: Vec::new() };
        for &i in samples {
            let (x, y, m) = &self.data[i];
            b.x.extend(x);
            b.y.extend(y);
            b.mask.extend(m);
        }
        b
    }

    fn n_samples(&self) -> usize {
        self.data.len()
    }

    fn frozen(&self, t: &TensorSpec) -> bool {
        t.name == "w" || t.name == "c"
    }

    /// The toy's loss is a polynomial of degree 4 in the parameters, summed
    /// in f64 from f32 values: h = 1e-2 keeps the truncation error (h² ·
    /// third derivative, ~1e-4 of the gradient here) and the rounding of the
    /// f32 forward (ε_f32 · |loss| / h ≈ 6e-6 · 10 / 1e-2 ≈ 6e-5) small.
    fn fd_tolerance(&self) -> (f64, f64, f64) {
        (1e-2, 1e-3, 1e-3)
    }

    /// Sums in a different order agree to a few f32 ulps of the largest value.
    fn rtol(&self) -> f32 {
        1e-5
    }
}

#[test]
fn toy_model_passes_the_conformance_suite() {
    conformance::run_all(&ToyFamily::new(false)).unwrap();
}

#[test]
fn a_model_that_ignores_overwrite_fails_the_suite() {
    let f = ToyFamily::new(true);
    // A single pass from a zeroed buffer cannot tell…
    conformance::check_gradient(&f).unwrap();
    // …but the second step in a row does.
    let e = conformance::check_several_steps(&f).unwrap_err();
    assert!(e.contains("step 2"), "{e}");
    assert!(conformance::run_all(&f).is_err());
}

/// A backward that asks for a segment again after a lower one finished
/// passes everything that reduces at the boundary, and `overlap_comm`
/// refuses it by name rather than send that segment's gradient early.
#[test]
fn a_backward_that_returns_upward_is_refused_under_overlap() {
    let f = ToyFamily { revisit: true, ..ToyFamily::new(false) };
    conformance::check_ranks_and_zero(&f).unwrap();
    let e = conformance::check_overlap(&f).unwrap_err();
    assert!(e.contains("segment 1 after its gradient was already sent"), "{e}");
}

/// Ranks whose segment visits differ (rank 2's micro-batches are empty, and
/// this variant then skips segment 1's backward) start their buckets in
/// different orders under `overlap_comm`; the buckets have one length, so
/// no communicator can tell, and the step stops by name before any update
/// instead of summing one rank's bucket with another's (without overlap,
/// ZeRO 0 reduces at the boundary in one order and the run goes on).
#[test]
fn ranks_that_visit_segments_in_different_orders_stop_under_overlap() {
    let f = ToyFamily { skip_on_empty: true, ..ToyFamily::new(false) };
    let e = conformance::check_overlap(&f).unwrap_err();
    assert!(e.starts_with("ZeRO 0: ") && e.contains("different orders"), "{e}");
}
