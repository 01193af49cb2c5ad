//! Where a step's time goes, by kernel family, for `macrobatch bench`.
//!
//! The kernels of `nn` and the engine's boundary wrap their bodies in
//! [`timed`]. Off (the default) that costs one relaxed atomic load per
//! kernel call and changes nothing else; on ([`set_enabled`]) each call
//! adds its wall time to its [`Kind`]'s counter. Only the outermost timed
//! call of a thread counts, so a kernel that calls another (attention's
//! softmax, a norm inside a fused pass) is not counted twice. The counters
//! are process-wide sums over threads: with several thread ranks they add
//! the ranks' times.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::time::Instant;

/// A family of kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    /// Linear layers: the GEMMs of projections and their gradients, biases.
    Linear,
    /// LoRA / DoRA adapters: their rank-r products beside a projection,
    /// forward and backward (the projection's own GEMM is `Linear`).
    Adapter,
    /// Attention: scores, softmax, weighted sums and their backward.
    Attention,
    /// LayerNorm and RMSNorm, forward and backward.
    Norm,
    /// GELU and SwiGLU, forward and backward.
    Activation,
    /// Rotary position embeddings.
    Rope,
    /// Token (and position) embeddings and their gradients.
    Embedding,
    /// The head's softmax and cross-entropy.
    Loss,
    /// Residual additions and other elementwise passes.
    Elementwise,
    /// The optimizer's update.
    Optimizer,
    /// Encoding the 16-bit parameter copy (bf16 / f16) and decoding it.
    Convert,
    /// The gradient collective at the boundary.
    Collective,
}

/// Every kind, in report order.
pub const KINDS: [Kind; 12] = [
    Kind::Linear,
    Kind::Adapter,
    Kind::Attention,
    Kind::Norm,
    Kind::Activation,
    Kind::Rope,
    Kind::Embedding,
    Kind::Loss,
    Kind::Elementwise,
    Kind::Optimizer,
    Kind::Convert,
    Kind::Collective,
];

impl Kind {
    /// The name reports use.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Linear => "linear",
            Kind::Adapter => "adapters",
            Kind::Attention => "attention",
            Kind::Norm => "norm",
            Kind::Activation => "activation",
            Kind::Rope => "rope",
            Kind::Embedding => "embedding",
            Kind::Loss => "cross-entropy",
            Kind::Elementwise => "elementwise",
            Kind::Optimizer => "optimizer",
            Kind::Convert => "16-bit convert",
            Kind::Collective => "collective",
        }
    }
}

static ON: AtomicBool = AtomicBool::new(false);
static NANOS: [AtomicU64; KINDS.len()] = [const { AtomicU64::new(0) }; KINDS.len()];
static CALLS: [AtomicU64; KINDS.len()] = [const { AtomicU64::new(0) }; KINDS.len()];

thread_local! {
    /// Timed calls open on this thread (only the outermost counts).
    static DEPTH: Cell<u32> = const { Cell::new(0) };
}

/// Turns the counters on or off.
pub fn set_enabled(on: bool) {
    ON.store(on, Relaxed);
}

/// Zeroes the counters.
pub fn reset() {
    for (n, c) in NANOS.iter().zip(&CALLS) {
        n.store(0, Relaxed);
        c.store(0, Relaxed);
    }
}

/// Seconds and calls of each kind since the last [`reset`].
pub fn snapshot() -> Vec<(Kind, f64, u64)> {
    KINDS.iter().map(|&k| (k, NANOS[k as usize].load(Relaxed) as f64 * 1e-9, CALLS[k as usize].load(Relaxed))).collect()
}

/// Closes a timed call, also when its body panics.
struct Open(Option<(Kind, Instant)>);

impl Drop for Open {
    fn drop(&mut self) {
        DEPTH.with(|d| d.set(d.get().saturating_sub(1)));
        if let Some((kind, t)) = self.0 {
            NANOS[kind as usize].fetch_add(t.elapsed().as_nanos() as u64, Relaxed);
            CALLS[kind as usize].fetch_add(1, Relaxed);
        }
    }
}

/// Runs `f`, adding its wall time to `kind` when profiling is on and no
/// timed call is open on this thread.
#[inline]
pub fn timed<R>(kind: Kind, f: impl FnOnce() -> R) -> R {
    if !ON.load(Relaxed) {
        return f();
    }
    let outer = DEPTH.with(|d| {
        let v = d.get();
        d.set(v + 1);
        v == 0
    });
    let _open = Open(outer.then(|| (kind, Instant::now())));
    f()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Off, nothing is counted; on, the outermost call counts once and a
    /// nested one not at all. (One test: the counters are process-wide.)
    #[test]
    fn only_the_outermost_call_counts_and_only_when_on() {
        reset();
        set_enabled(false);
        timed(Kind::Norm, || std::thread::sleep(std::time::Duration::from_millis(2)));
        assert!(snapshot().iter().all(|s| s.2 == 0), "counted while off");
        set_enabled(true);
        let v = timed(Kind::Attention, || {
            timed(Kind::Norm, || std::thread::sleep(std::time::Duration::from_millis(5)));
            7
        });
        set_enabled(false);
        assert_eq!(v, 7);
        let s = snapshot();
        let get = |k: Kind| s.iter().find(|x| x.0 == k).map(|x| (x.1, x.2)).unwrap_or_default();
        assert_eq!(get(Kind::Attention).1, 1);
        assert!(get(Kind::Attention).0 >= 0.005, "{:?}", get(Kind::Attention));
        assert_eq!(get(Kind::Norm), (0.0, 0), "a nested call is counted inside its caller");
        reset();
        assert!(snapshot().iter().all(|s| s.1 == 0.0 && s.2 == 0));
    }
}
