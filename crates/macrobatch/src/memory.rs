//! Will it fit? The memory a run needs, estimated from the shapes alone,
//! against what this machine and process may still allocate — checked before
//! anything big is allocated, so a model too large is an error with numbers
//! instead of an allocation failure that aborts the process.

use anyhow::{bail, Result};

/// What the process may still allocate: the smaller of the machine's
/// `MemAvailable` and the address-space limit's headroom (`ulimit -v`).
#[derive(Debug, Clone, Copy)]
pub struct Available {
    /// `MemAvailable` from /proc/meminfo.
    pub mem_available: Option<u64>,
    /// RLIMIT_AS (soft) minus this process's current virtual size.
    pub address_space_left: Option<u64>,
}

impl Available {
    /// Reads /proc (Linux); unknown figures stay `None`.
    pub fn now() -> Self {
        let mem_available = read_kib("/proc/meminfo", "MemAvailable:");
        let vm_size = read_kib("/proc/self/status", "VmSize:");
        let limit = std::fs::read_to_string("/proc/self/limits").ok().and_then(|t| {
            let line = t.lines().find(|l| l.starts_with("Max address space"))?;
            // "Max address space   <soft>   <hard>   bytes"
            line.trim_start_matches("Max address space").split_whitespace().next()?.parse::<u64>().ok()
        });
        let address_space_left = limit.map(|l| l.saturating_sub(vm_size.unwrap_or(0)));
        Self { mem_available, address_space_left }
    }

    /// The binding figure, if any is known.
    pub fn bytes(&self) -> Option<u64> {
        match (self.mem_available, self.address_space_left) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    fn describe(&self) -> String {
        let gib = |b: u64| format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64);
        let mut parts = Vec::new();
        if let Some(a) = self.mem_available {
            parts.push(format!("MemAvailable {a} bytes ({})", gib(a)));
        }
        if let Some(b) = self.address_space_left {
            parts.push(format!("address-space limit (ulimit -v) leaves {b} bytes ({})", gib(b)));
        }
        parts.join(", ")
    }
}

/// A `KEY: N kB` figure of a /proc file, in bytes.
pub fn read_kib(path: &str, key: &str) -> Option<u64> {
    let text = std::fs::read_to_string(path).ok()?;
    let line = text.lines().find(|l| l.starts_with(key))?;
    line.split_whitespace().nth(1)?.parse::<u64>().ok()?.checked_mul(1024)
}

/// Per-rank shapes of a training run, for [`train_need`].
#[derive(Debug, Clone, Copy)]
pub struct TrainShape {
    /// Parameters of the model.
    pub n_params: u128,
    /// Activation bytes of one rank's micro-batch (from the model family).
    pub activations: u128,
    /// Ranks in the group.
    pub world: usize,
    /// Ranks living in this process (thread ranks share it).
    pub ranks_here: usize,
    pub zero_stage: u8,
    /// 16-bit storage (bf16 / f16).
    pub low_precision: bool,
    /// f32 optimizer-state values per parameter (AdamW 2, SGD with momentum 1).
    pub optimizer_slots: u32,
}

/// A breakdown of the estimate (lower bounds: what the run allocates at least).
#[derive(Debug, Clone, Copy)]
pub struct Need {
    /// Parameters, gradients and optimizer state of one rank.
    pub model_states: u128,
    /// Activations and backward scratch of one rank.
    pub activations: u128,
    /// Ranks in this process.
    pub ranks_here: u128,
}

impl Need {
    /// Bytes this process needs.
    pub fn total(&self) -> u128 {
        (self.model_states + self.activations) * self.ranks_here
    }
}

/// The bytes a training run needs per process, from the shapes alone.
pub fn train_need(s: &TrainShape) -> Need {
    let p = s.n_params;
    let w = s.world.max(1) as u128;
    let shard = |bytes: u128, sharded: bool| if sharded { bytes.div_ceil(w) } else { bytes };
    let param_bytes = 4 * p + if s.low_precision { 2 * p } else { 0 };
    let model_states = shard(param_bytes, s.zero_stage >= 3)
        + shard(4 * p, s.zero_stage >= 3)
        + shard(4 * p * s.optimizer_slots as u128, s.zero_stage >= 1);
    Need { model_states, activations: s.activations, ranks_here: s.ranks_here.max(1) as u128 }
}

/// Errors unless `need` fits in what is available; `what` names the job and
/// `advice` says what to change.
pub fn check(what: &str, need: u128, breakdown: &str, advice: &str) -> Result<()> {
    let avail = Available::now();
    let Some(have) = avail.bytes() else { return Ok(()) };
    if need > have as u128 {
        bail!(
            "{what} needs at least {need} bytes ({:.2} GiB: {breakdown}) but only {have} bytes are available ({}); {advice}",
            need as f64 / (1u64 << 30) as f64,
            avail.describe()
        );
    }
    Ok(())
}

/// Checks that the model of `config.json` in `dir` can be loaded (weights
/// read, parameters and one copy of the file in memory) before reading it.
pub fn check_load(dir: &std::path::Path, what: &str) -> Result<()> {
    let p = crate::family::read_hf_config(dir)?.n_params();
    check(
        what,
        8 * p,
        &format!("{p} parameters × 4 bytes, twice: the file's bytes and the parameters"),
        "this machine cannot hold the model; use a machine with more memory (or check config.json)",
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::family::Family;

    #[test]
    fn need_grows_with_shape_and_shrinks_with_zero() {
        let family = crate::family::Gpt2(gpt::GptConfig::preset("gpt2").unwrap_or_else(|e| panic!("{e}")));
        let activations = |micro| family.activation_bytes(micro, 1024, crate::family::Build::default());
        let s = TrainShape {
            n_params: family.n_params(),
            activations: activations(8),
            world: 4,
            ranks_here: 1,
            zero_stage: 0,
            low_precision: false,
            optimizer_slots: 2,
        };
        let n0 = train_need(&s);
        assert_eq!(n0.model_states, 16 * 124_439_808, "f32 AdamW: 16 bytes per parameter");
        let n3 = train_need(&TrainShape { zero_stage: 3, ..s });
        assert_eq!(n3.model_states, 4 * 124_439_808, "stage 3 over 4 ranks: a quarter");
        assert!(activations(1) < n0.activations);
        // Hostile shapes do not overflow.
        assert!(train_need(&TrainShape { n_params: 1 << 100, ..s }).total() > u64::MAX as u128);
    }

    #[test]
    fn available_reads_proc() {
        let a = Available::now();
        assert!(a.mem_available.is_some_and(|b| b > 0), "{a:?}");
    }
}
