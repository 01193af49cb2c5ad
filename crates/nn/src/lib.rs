//! Transformer layers shared by the model families, written once over flat
//! row-major f32 buffers: token and position embeddings, LayerNorm and
//! RMSNorm, one causal grouped-query attention kernel (multi-head attention
//! is the case `n_kv_head == n_head`) in two forms, materialised (it saves
//! the T × T probabilities) and tiled with an online softmax (it saves one
//! log-sum-exp per row), rotary embeddings (with Llama 3's
//! frequency scaling), the tanh-GELU and SwiGLU MLPs, linear layers in both
//! weight layouts, the fused softmax cross-entropy of the LM head, the walk
//! over a stack of blocks (segments, activation checkpointing, 16-bit
//! storage between blocks), the key/value cache generation attends over,
//! and safetensors / atomic file I/O.
//!
//! Kernel conventions: `n` (or `n_rows`) = B·T rows. Forward kernels
//! overwrite their outputs unless told to accumulate. Backward kernels
//! overwrite activation gradients, except the norms' backward, which *adds*
//! into the residual stream's gradient; a parameter gradient is a
//! [`ParamGrad`], which says whether to add into its buffer or overwrite it
//! (`None` where the tensor is frozen: not computed). Every reduction has a
//! fixed order, so results do not depend on the number of threads. All
//! kernels are safe code: slices are bounds-checked, and the kernels that
//! index by a shape (attention, RMSNorm, SwiGLU, `nn.Linear` layers) assert
//! the lengths it implies first.
//!
//! A family (GPT-2, Llama) keeps only what is its own: which norm, MLP and
//! attention options its block composes, its parameter names and layout,
//! its Hugging Face config mapping and presets.

#![warn(missing_docs)]

pub mod act;
pub mod attention;
pub mod context;
pub mod dora;
pub mod embed;
pub mod fd;
pub mod flash;
pub mod grad;
pub mod head;
pub mod io;
pub mod kv;
pub mod linear;
pub mod lora;
pub mod lora_dropout;
pub mod loss;
pub mod loss_terms;
pub mod moe;
pub mod norm;
pub mod proj;
pub mod rope;
pub mod shell;
pub mod stack;

pub use grad::ParamGrad;
/// The GEMM every kernel runs on (`linalg`), re-exported for the families.
pub use linalg::{gemm_into, parallelism, GemmDims, GemmOut, Operands, Par, Strided};

/// The position of each row of a `[B·T, …]` activation: its index in its
/// sequence (`r mod t`), or, for packed documents, the batch's own
/// positions (`engine::TokenBatch::positions`).
#[derive(Debug, Clone, Copy)]
pub struct Positions<'a> {
    /// Rows per sequence.
    pub t: usize,
    /// One position per row, or empty: `r mod t`.
    pub ids: &'a [u32],
}

impl Positions<'_> {
    /// Row `r` at position `r mod t`.
    pub fn rows(t: usize) -> Positions<'static> {
        Positions { t, ids: &[] }
    }

    /// The position of row `r`.
    pub fn at(&self, r: usize) -> usize {
        self.ids.get(r).map_or(r % self.t.max(1), |&p| p as usize)
    }
}

/// The GEMM operands a training precision asks for: bf16 in `bf16` mode, f32
/// otherwise (f16 mode computes in f32: no f16 dot-product instructions are
/// used). [`Par::with`] turns bf16 into f32 on a CPU without AVX512-BF16.
pub fn operands(prec: engine::Precision) -> Operands {
    match prec {
        engine::Precision::Bf16 => Operands::Bf16,
        engine::Precision::F32 | engine::Precision::F16 => Operands::F32,
    }
}

/// Panics unless `len` is the product of `factors` (checked: a product that
/// overflows never passes).
pub(crate) fn assert_len(kernel: &str, name: &str, len: usize, factors: &[usize]) {
    let want = factors.iter().try_fold(1usize, |acc, &f| acc.checked_mul(f));
    assert!(want == Some(len), "{kernel}: `{name}` has {len} elements, expected {want:?} (product of {factors:?})");
}

#[cfg(test)]
pub(crate) mod testutil {
    use engine::rng::SplitMix64;

    /// `n` standard normal values from stream `seed`.
    pub fn randn(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = SplitMix64::new(seed);
        (0..n).map(|_| rng.normal() as f32).collect()
    }

    /// Checks a backward `dx` against central differences of `Σ dout·f(x)`
    /// at every element. h = 1e-2 on O(1) inputs: f32 rounding of the
    /// probe (~1e-6 · its magnitude ~10) / h ≈ 1e-3, truncation O(h²) ≈ 1e-4;
    /// hence |error| ≤ 2e-3 + 1e-2·|fd|.
    pub fn check_fd(name: &str, f: &dyn Fn(&[f32]) -> Vec<f32>, x: &[f32], dout: &[f32], dx: &[f32]) {
        crate::fd::check_gradient(name, x, dx, (1e-2, 2e-3, 1e-2), |x| crate::fd::dot(&f(x), dout));
    }
}
