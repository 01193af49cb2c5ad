//! Terms a language model's training loss may add to plain cross-entropy.

/// Label smoothing and PaLM's z-loss, per target token of the training
/// loss (both summed over targets and divided by the global target count
/// like the cross-entropy itself). The default adds nothing: plain
/// cross-entropy, computed by the same code as without this type.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct LossTerms {
    /// ε of PyTorch's `cross_entropy(label_smoothing=ε)`: the target
    /// distribution is (1 − ε)·onehot + ε/V.
    pub label_smoothing: f32,
    /// c of PaLM's auxiliary loss c·log²Z, Z the softmax normaliser
    /// Σⱼ exp(logitⱼ).
    pub z_loss: f32,
}

impl LossTerms {
    /// Whether the loss is plain cross-entropy.
    pub fn is_plain(&self) -> bool {
        self.label_smoothing == 0.0 && self.z_loss == 0.0
    }
}
