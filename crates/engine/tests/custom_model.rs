//! The engine's conformance suite on the character-level MLP of
//! `examples/custom_model.rs` (the same source, included here), so the
//! example a library user copies is a model the engine is proven to train
//! correctly: finite differences, K/W/ZeRO invariance, several steps,
//! frozen tensors and bit-exact resume.

#[allow(dead_code)] // the example's `main` and its run settings are not used here
#[path = "../examples/custom_model.rs"]
mod custom_model;

use custom_model::{CharMlp, V};
use engine::conformance::{self, ModelUnderTest, TokenSamples};
use engine::{TensorSpec, TokenBatch};

struct CharMlpFamily(TokenSamples);

impl ModelUnderTest for CharMlpFamily {
    type M = CharMlp;

    fn model(&self) -> CharMlp {
        CharMlp::default()
    }

    fn init(&self) -> Vec<f32> {
        CharMlp::init(3)
    }

    fn batch(&self, samples: &[usize]) -> TokenBatch {
        self.0.batch(samples)
    }

    fn n_samples(&self) -> usize {
        self.0.len()
    }

    /// The output layer trains, the embedding and hidden bias are frozen.
    fn frozen(&self, t: &TensorSpec) -> bool {
        t.name == "embed" || t.name == "b1"
    }

    /// The loss is summed in f64 from f32 logits over up to 32 targets of
    /// magnitude ~5: rounding of the forward is ~1e-5 of the loss, so with
    /// h = 1e-2 the central difference is good to ~1e-3 absolute.
    fn fd_tolerance(&self) -> (f64, f64, f64) {
        (1e-2, 1e-2, 2e-3)
    }

    /// Sums in a different order agree to a few f32 ulps of the largest value.
    fn rtol(&self) -> f32 {
        1e-5
    }
}

#[test]
fn the_custom_model_example_passes_the_conformance_suite() {
    let family = CharMlpFamily(TokenSamples::new(12, 8, V as u64, 21));
    conformance::run_all(&family).unwrap();
}
