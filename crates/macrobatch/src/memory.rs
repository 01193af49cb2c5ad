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

    #[test]
    fn available_reads_proc() {
        let a = Available::now();
        assert!(a.mem_available.is_some_and(|b| b > 0), "{a:?}");
    }
}
