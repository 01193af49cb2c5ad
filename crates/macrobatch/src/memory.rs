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

    /// The binding figure, if any is known: what a run with `threads`
    /// allocating threads may use for its planned bytes; under an address-space limit every such thread also reserves
    /// address space it never touches ([`ADDRESS_SPACE_PER_THREAD`]).
    pub fn usable(&self, threads: usize) -> Option<u64> {
        let reserved = ADDRESS_SPACE_PER_THREAD.saturating_mul(threads as u64);
        let address_space = self.address_space_left.map(|b| b.saturating_sub(reserved));
        match (self.mem_available, address_space) {
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

/// Address space each allocating thread reserves beyond what it touches:
/// glibc gives a thread its own malloc arena, a 64 MiB reservation, and a
/// 2 MiB stack. It counts against `ulimit -v` (RLIMIT_AS), not against RSS.
pub const ADDRESS_SPACE_PER_THREAD: u64 = 66 << 20;

/// Threads of a run that allocate beside the main thread (whose heap grows
/// in place): `compute` pool threads and, with several ranks in the
/// process, each rank's thread.
pub fn allocating_threads(compute: usize, ranks_per_process: usize) -> usize {
    compute + if ranks_per_process > 1 { ranks_per_process } else { 0 }
}

/// A `KEY: N kB` figure of a /proc file, in bytes.
pub fn read_kib(path: &str, key: &str) -> Option<u64> {
    let text = std::fs::read_to_string(path).ok()?;
    let line = text.lines().find(|l| l.starts_with(key))?;
    line.split_whitespace().nth(1)?.parse::<u64>().ok()?.checked_mul(1024)
}

/// Errors unless `need` fits in what is available to a run of `threads`
/// allocating threads ([`Available::usable`]); `what` names the job and
/// `advice` says what to change.
pub fn check(what: &str, need: u128, threads: usize, breakdown: &str, advice: &str) -> Result<()> {
    let avail = Available::now();
    let Some(have) = avail.usable(threads) else { return Ok(()) };
    if need > have as u128 {
        let reserve = match avail.address_space_left {
            Some(_) => format!(
                ", after the address space {threads} threads reserve ({} MiB each: malloc arena and stack)",
                ADDRESS_SPACE_PER_THREAD >> 20
            ),
            None => String::new(),
        };
        bail!(
            "{what} needs at least {need} bytes ({:.2} GiB: {breakdown}) but only {have} bytes are available ({}{reserve}); {advice}",
            need as f64 / (1u64 << 30) as f64,
            avail.describe()
        );
    }
    Ok(())
}

/// Checks that the model of `config.json` in `dir` can be loaded (weights
/// read, parameters and one copy of the file in memory) before reading it.
pub fn check_load(dir: &std::path::Path, what: &str) -> Result<()> {
    check_load_of(what, crate::family::read_hf_config(dir)?.n_params())
}

/// [`check_load`] of a model of `p` parameters whose shape is known.
pub fn check_load_of(what: &str, p: u128) -> Result<()> {
    check(
        what,
        8 * p,
        loading_threads(),
        &format!("{p} parameters × 4 bytes, twice: the file's bytes and the parameters"),
        "this machine cannot hold the model; use a machine with more memory (or check config.json)",
    )
}

/// Checks that a model whose projections stay packed can be loaded: the
/// `params` f32 parameters of its layout, the `frozen` bytes of its packed
/// projections and the `mapped` bytes of its file (mapped while read).
pub fn check_packed_load(what: &str, params: u128, frozen: u128, mapped: u64) -> Result<()> {
    check(
        what,
        4 * params + frozen + mapped as u128,
        loading_threads(),
        &format!(
            "{params} parameters × 4 bytes, {frozen} bytes of packed projections and the {mapped}-byte file mapped"
        ),
        "this machine cannot hold the model; use a machine with more memory",
    )
}

/// The allocating threads of a process loading a model. Not
/// rayon::current_num_threads(): that would start the global pool before
/// `train.threads` sizes it.
fn loading_threads() -> usize {
    allocating_threads(std::thread::available_parallelism().map_or(1, |n| n.get()), 0)
}

/// Bytes of the model file or folder `path` (its weight files: `*.gguf`,
/// `*.safetensors`), 0 where it cannot be read.
pub fn file_bytes(path: &std::path::Path) -> u64 {
    let size = |p: &std::path::Path| std::fs::metadata(p).map_or(0, |m| m.len());
    if path.is_file() {
        return size(path);
    }
    let Ok(entries) = std::fs::read_dir(path) else { return 0 };
    entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors" || x == "gguf"))
        .map(|p| size(&p))
        .sum()
}

/// A `/proc/self/status` memory figure of this process in bytes (`VmHWM:`:
/// the peak resident set, `VmRSS:`: the resident set now), if known.
pub fn proc_status_bytes(key: &str) -> Option<u64> {
    read_kib("/proc/self/status", key)
}

/// Bytes of physical memory this process has used at most (VmHWM), if known.
pub fn peak_rss_bytes() -> Option<u64> {
    proc_status_bytes("VmHWM:")
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
