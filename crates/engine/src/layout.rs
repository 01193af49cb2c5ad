//! The named layout of the flat parameter buffer: one `(name, offset, shape)`
//! per tensor. Gradients, optimizer moments and (later) shards all share it.
//!
//! Invariant: tensors are laid out back to back in push order, so
//! `tensors[i].offset + tensors[i].numel() == tensors[i + 1].offset` and the
//! last one ends at `n_params()`.

use std::ops::Range;

/// The most parameters a model shape may have: 2^48 (2.8e14, over a
/// thousand times the largest models trained today). Byte counts of every
/// buffer (16 bytes per parameter and more) then stay far inside `usize`
/// and `u64`. Families check it on their shape, counted in `u128`, before any
/// layout exists.
pub const MAX_PARAMS: u128 = 1 << 48;

/// The most tensors a layout may hold (65,536: thousands of layers, ten
/// times the deepest transformers trained). A layout keeps a name and a
/// shape per tensor and a model its ranges per layer, so `macrobatch plan`,
/// which builds layouts but never parameters, stays under 50 MB at this
/// limit. Families turn it into a limit on their number of layers.
pub const MAX_TENSORS: u128 = 1 << 16;

/// Checks a shape's parameter count and tensor count (both computed
/// arithmetically, in `u128`) against [`MAX_PARAMS`] and [`MAX_TENSORS`];
/// the error says which limit and the largest number of layers that fits.
/// `tensors_per_layer` and `other_tensors` describe the family's layout.
pub fn check_shape_size(
    n_params: u128,
    n_layer: usize,
    tensors_per_layer: u128,
    other_tensors: u128,
) -> Result<(), String> {
    let max_layers = (MAX_TENSORS - other_tensors.min(MAX_TENSORS)) / tensors_per_layer.max(1);
    if n_layer as u128 > max_layers {
        return Err(format!(
            "model.n_layer = {n_layer} is more layers than macrobatch lays out (at most {max_layers}); lower model.n_layer"
        ));
    }
    if n_params > MAX_PARAMS {
        return Err(format!(
            "this shape has {n_params} parameters, more than the {MAX_PARAMS} (2^48) macrobatch plans or trains; lower model.n_layer, model.n_embd or model.vocab_size"
        ));
    }
    Ok(())
}

/// One tensor inside the flat buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    /// Hugging Face style name, e.g. `transformer.h.0.attn.c_attn.weight`.
    pub name: String,
    /// First element of the tensor in the flat buffer.
    pub offset: usize,
    /// Row-major shape.
    pub shape: Vec<usize>,
    /// Whether decoupled weight decay applies (matrices and embeddings: yes;
    /// biases and LayerNorm gains: no — the GPT-2/nanoGPT convention).
    pub decay: bool,
    /// Whether the optimizer updates it. A frozen tensor has no gradient
    /// buffer, no optimizer state and takes part in no gradient collective.
    pub trainable: bool,
}

impl TensorSpec {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Element range inside the flat buffer.
    pub fn range(&self) -> Range<usize> {
        self.offset..self.offset + self.numel()
    }
}

/// The ordered list of tensors of a model.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ParamLayout {
    tensors: Vec<TensorSpec>,
    n_params: usize,
}

/// The first non-finite value of a parameter buffer: its tensor, its
/// index in the tensor's row-major shape, the value, and how many there
/// are in all ([`ParamLayout::first_non_finite`]).
#[derive(Debug, Clone, PartialEq)]
pub struct NonFinite {
    /// The tensor's name.
    pub tensor: String,
    /// The tensor's shape.
    pub shape: Vec<usize>,
    /// The value's index in that shape.
    pub index: Vec<usize>,
    /// The value (NaN or an infinity).
    pub value: f32,
    /// How many non-finite values the buffer holds.
    pub count: usize,
}

impl ParamLayout {
    /// The first non-finite value of `params` laid out by this layout
    /// (`None`: every value is finite).
    pub fn first_non_finite(&self, params: &[f32]) -> Option<NonFinite> {
        let i = params.iter().position(|x| !x.is_finite())?;
        let count = params.iter().filter(|x| !x.is_finite()).count();
        let (tensor, shape, mut at) = match self.tensors().iter().find(|t| t.range().contains(&i)) {
            Some(t) => (t.name.clone(), t.shape.clone(), i - t.offset),
            None => ("?".to_string(), vec![params.len()], i),
        };
        let mut index = vec![0; shape.len()];
        for (slot, &d) in index.iter_mut().zip(&shape).rev() {
            *slot = at % d.max(1);
            at /= d.max(1);
        }
        Some(NonFinite { tensor, shape, index, value: params[i], count })
    }

    /// An empty layout.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends a tensor and returns its element range.
    pub fn push(&mut self, name: impl Into<String>, shape: &[usize], decay: bool) -> Range<usize> {
        let spec =
            TensorSpec { name: name.into(), offset: self.n_params, shape: shape.to_vec(), decay, trainable: true };
        let range = spec.range();
        self.n_params = range.end;
        self.tensors.push(spec);
        range
    }

    /// Total number of parameters.
    pub fn n_params(&self) -> usize {
        self.n_params
    }

    /// All tensors in buffer order.
    pub fn tensors(&self) -> &[TensorSpec] {
        &self.tensors
    }

    /// Marks each tensor trainable or frozen by `trainable(tensor)`; returns
    /// the number of trainable parameters.
    pub fn set_trainable(&mut self, trainable: impl Fn(&TensorSpec) -> bool) -> usize {
        for t in &mut self.tensors {
            t.trainable = trainable(t);
        }
        self.n_trainable()
    }

    /// Sets each tensor's weight-decay flag to `decay(tensor)`.
    pub fn set_decay(&mut self, decay: impl Fn(&TensorSpec) -> bool) {
        for t in &mut self.tensors {
            t.decay = decay(t);
        }
    }

    /// Number of trainable parameters (the length of the gradient space).
    pub fn n_trainable(&self) -> usize {
        self.tensors.iter().filter(|t| t.trainable).map(TensorSpec::numel).sum()
    }

    /// Looks a tensor up by name.
    pub fn get(&self, name: &str) -> Option<&TensorSpec> {
        self.tensors.iter().find(|t| t.name == name)
    }
}
