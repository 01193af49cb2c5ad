//! Small shapes that split at T = 2 and 4, measured against the plan by
//! the planning tests and, through a real run, by tests/plan_tensor.rs.

/// GPT-2 `tiny` widened to d = 512 with 8 heads.
pub const GPT: &[&str] = &["model.preset=tiny", "model.n_embd=512", "model.n_head=8", "data.seq_len=128"];
/// Llama `tiny` at 4 layers, d = 384: 4 heads and 2 key/value heads (split
/// at T = 2, each shared by 2 ranks at T = 4).
pub const LLAMA: &[&str] = &[
    "model.family=llama",
    "model.preset=tiny",
    "model.n_layer=4",
    "model.n_embd=384",
    "model.n_head=4",
    "model.n_kv_head=2",
    "model.intermediate_size=1024",
    "data.seq_len=128",
];
