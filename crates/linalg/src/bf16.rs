//! bf16-operand GEMM with f32 accumulation on AVX512-BF16 (`vdpbf16ps`),
//! and on AMX tiles (`tdpbf16ps`, [`amx`]) where the CPU has them.
//!
//! Below, "the kernel" is the `vdpbf16ps` one; the AMX kernel shares its
//! packing of `B`, its tasks and its write-back rule (see [`amx`]).
//!
//! `dst (+)= alpha · bf16(lhs) · bf16(rhs)`, where `bf16(x)` rounds an f32 to
//! bf16 to nearest even (`vcvtne2ps2bf16`, NaN stays NaN) while packing.
//! `vdpbf16ps` treats denormal operands and sums as zero (DAZ/FTZ), which
//! only matters for values below 2⁻¹²⁶.
//!
//! [`portable`] computes the same bits with f32 FMAs on any CPU (tested bit
//! for bit against this kernel where the CPU has it): [`kernel`] says which
//! one runs (`MACROBATCH_BF16=portable` selects it; tests of bf16
//! arithmetic take it where the instruction is missing).
//!
//! # Blocking (BLIS / GotoBLAS)
//!
//! * `n` is cut into chunks of `NC` columns, sized so the packed chunk of `B`
//!   (all of `k`) holds at most 32 MiB. Each chunk is packed once, in
//!   parallel (one task per `NR`-column panel), and shared by every thread.
//! * The rows of `dst` (or, for short `m`, the column panels of the chunk)
//!   are cut into about four tasks per thread, handed out by rayon, so that
//!   a core slowed down by other work takes fewer of them. A task walks its
//!   rows in blocks of at most `MC` rows; for each block it walks `k` in
//!   equal blocks of at most `KC = 2·KCP` values, packs that `MC × KC` block
//!   of `A` (L2 resident), and runs the `MR × NR` microkernel over every
//!   panel of the chunk, the row tiles of the block passing over one
//!   `KC × NR` micro-panel of `B` (L1/L2) before moving to the next panel.
//! * The microkernel keeps `MR × NR / 16 = 24` zmm accumulators (12 rows ×
//!   2 × 16 columns), loads two vectors of `B` and broadcasts 12 pairs of `A`
//!   per k pair, prefetches `B` a few pairs ahead and the next tile's
//!   accumulators (scratch or `dst`) while it computes.
//! * A call from outside the rayon pool enters it once (`rayon::scope`) so
//!   that its parallel loops are spawned from a worker.
//!
//! # Pack format
//!
//! `vdpbf16ps` multiplies pairs of bf16 in each 32-bit lane and adds both
//! products to an f32 lane, so both operands are packed as *k pairs*: a `u32`
//! whose low half is the bf16 of an even `k` index and whose high half the
//! bf16 of the following odd one (zero past the end of odd `k`).
//! * `B` panel (`NR` columns): for each pair `p`, `NR` consecutive `u32`
//!   `(B[2p][j], B[2p+1][j])`, `j` in the panel; columns past `n` are zero.
//! * `A` panel (`MR` rows): for each pair `p`, `MR` consecutive `u32`
//!   `(A[i][2p], A[i][2p+1])`; the microkernel broadcasts each one
//!   (`vdpbf16ps zmm, zmm, [mem]{1to16}`). Rows past `m` are zero.
//!
//! # Determinism
//!
//! Every element of `dst` is computed by the same instruction sequence
//! whatever `m`, `n`, the tile it falls in, the thread count or the split:
//! its f32 accumulator starts at `+0`, takes one `vdpbf16ps` per k pair in
//! increasing `k` order (between `KC` blocks the accumulator is stored to and
//! reloaded from an f32 scratch tile, which is exact, so the k blocking does
//! not change the result either), and after the last pair the result is
//! written once as `alpha · S` (`accumulate == false`) or as the fused
//! multiply-add `fma(alpha, S, dst)` (`accumulate == true`). `k` is never
//! split between threads. Edge tiles run the same full-size kernel on
//! zero-padded panels and write back through masked stores, so nothing of
//! `dst` outside the `m × n` block is read or written.

#[cfg(target_arch = "x86_64")]
pub mod amx;
pub mod portable;

use std::sync::atomic::{AtomicU8, Ordering};

/// Which arithmetic a GEMM with bf16 operands runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    /// `tdpbf16ps` on AMX tiles ([`amx`]).
    Amx,
    /// `vdpbf16ps` (AVX512-BF16).
    Hardware,
    /// [`portable`]: the same bits with f32 FMAs, on any CPU.
    Portable,
}

/// 0: not decided yet; 1: f32 operands; 2: hardware; 3: portable; 4: AMX.
static MODE: AtomicU8 = AtomicU8::new(0);

fn code(k: Option<Kernel>) -> u8 {
    match k {
        None => 1,
        Some(Kernel::Hardware) => 2,
        Some(Kernel::Portable) => 3,
        Some(Kernel::Amx) => 4,
    }
}

/// The kernel GEMMs with bf16 operands run, or `None` where they run with
/// f32 operands. Decided once from the environment, unless [`set_kernel`]
/// overrides it:
/// * `MACROBATCH_BF16=portable`: the [`portable`] kernel, on any CPU (the
///   bf16 arithmetic where the CPU lacks the instruction; on a CPU that has
///   it, the same bits more slowly).
/// * `MACROBATCH_BF16=off` (or `MACROBATCH_NO_BF16=1`): f32 operands, to
///   measure the f32 fallback.
/// * `MACROBATCH_BF16=avx512`: the AVX512-BF16 kernel even where the CPU
///   has AMX (to compare them).
/// * otherwise: the AMX kernel where the CPU (and the operating system)
///   has AMX, else the AVX512-BF16 kernel where the CPU has it (and
///   AVX-512F/BW), else f32 operands (faster there than the portable
///   kernel; bf16 then only halves the stored activations). The choice is
///   per process, never per shape, so that a row's bits do not depend on
///   its batch's size.
pub fn kernel() -> Option<Kernel> {
    let m = match MODE.load(Ordering::Relaxed) {
        0 => {
            let m = code(from_env());
            // A racing set_kernel wins; otherwise every thread decides the same.
            match MODE.compare_exchange(0, m, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => m,
                Err(now) => now,
            }
        }
        m => m,
    };
    match m {
        2 => Some(Kernel::Hardware),
        3 => Some(Kernel::Portable),
        4 => Some(Kernel::Amx),
        _ => None,
    }
}

/// What the environment asks of bf16 GEMMs.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Choice {
    /// Unset, empty or `auto`: the hardware kernel where there is one.
    Auto,
    /// `portable`.
    Portable,
    /// `avx512`: `vdpbf16ps` even where there is AMX.
    Avx512,
    /// `off`, or `MACROBATCH_NO_BF16=1`: f32 operands.
    Off,
}

/// `MACROBATCH_BF16` (and the older `MACROBATCH_NO_BF16=1`) read.
fn env_choice() -> Result<Choice, String> {
    if std::env::var_os("MACROBATCH_NO_BF16").is_some_and(|v| v == "1") {
        return Ok(Choice::Off);
    }
    let Ok(v) = std::env::var("MACROBATCH_BF16") else { return Ok(Choice::Auto) };
    match v.as_str() {
        "" | "auto" => Ok(Choice::Auto),
        "portable" => Ok(Choice::Portable),
        "avx512" => Ok(Choice::Avx512),
        "off" => Ok(Choice::Off),
        _ => Err(format!(
            "MACROBATCH_BF16={v} is not a bf16 kernel choice; set it to portable|avx512|off|auto (or unset it)"
        )),
    }
}

/// Checks `MACROBATCH_BF16` up front, so a program can refuse a misspelt
/// choice before any work instead of running with another kernel.
pub fn check_env() -> Result<(), String> {
    env_choice().map(|_| ())
}

fn from_env() -> Option<Kernel> {
    let choice = env_choice().unwrap_or_else(|e| {
        // The binary refuses it first through check_env.
        eprintln!("warning: {e}; using the default");
        Choice::Auto
    });
    match choice {
        Choice::Off => None,
        Choice::Portable => Some(Kernel::Portable),
        Choice::Avx512 => detect().then_some(Kernel::Hardware),
        Choice::Auto if amx_detect() => Some(Kernel::Amx),
        Choice::Auto => detect().then_some(Kernel::Hardware),
    }
}

/// What GEMMs with bf16 operands run on this CPU, and what that costs, for
/// a run's header.
pub fn describe() -> &'static str {
    match kernel() {
        Some(Kernel::Amx) => "bf16 GEMMs: AMX tiles (tdpbf16ps, f32 accumulation)",
        Some(Kernel::Hardware) => "bf16 GEMMs: AVX512-BF16 (vdpbf16ps, f32 accumulation)",
        Some(Kernel::Portable) => {
            "bf16 GEMMs: the portable kernel (MACROBATCH_BF16=portable): the instruction's bits with f32 FMAs, about 5× its time and 3× f32's"
        }
        None if detect() => "bf16 GEMMs: f32 operands (MACROBATCH_BF16=off)",
        None => {
            "bf16 GEMMs: f32 operands: this CPU has no AVX512-BF16, so bf16 halves the stored parameters and activations but does not speed up the GEMMs (train.precision = \"f32\" runs as fast or faster here)"
        }
    }
}

/// Overrides [`kernel`] for the rest of the process (`Some(Amx)` where the
/// CPU lacks AMX is taken as `Some(Hardware)`, and `Some(Hardware)` where
/// the CPU lacks AVX512-BF16 as `None`). For tests and benchmarks: GEMMs
/// already running keep their kernel.
pub fn set_kernel(k: Option<Kernel>) {
    let k = if k == Some(Kernel::Amx) && !amx_detect() { Some(Kernel::Hardware) } else { k };
    let k = if k == Some(Kernel::Hardware) && !detect() { None } else { k };
    MODE.store(code(k), Ordering::Relaxed);
}

/// Whether GEMMs with bf16 operands run in bf16 ([`kernel`] is `Some`).
pub fn supported() -> bool {
    kernel().is_some()
}

/// For tests of bf16 arithmetic: where the CPU lacks AVX512-BF16, the
/// [`portable`] kernel runs instead of f32 operands (unless bf16 was turned
/// off in the environment), so the bf16 arithmetic is tested on every CPU.
/// Returns true (saying so on stderr) only when bf16 was turned off, so
/// there is nothing to run. Under `MACROBATCH_REQUIRE_BF16=1` (CI on a CPU
/// that has the instructions) it panics unless a hardware kernel runs, so
/// a detection failure cannot pass as the portable path; under
/// `MACROBATCH_REQUIRE_AMX=1` (CI on a CPU that lists `amx_bf16`) likewise
/// unless the AMX kernel runs.
pub fn skip_without_bf16(test: &str) -> bool {
    emulate_where_missing();
    let chosen = std::env::var("MACROBATCH_BF16").is_ok_and(|v| !v.is_empty() && v != "auto");
    if std::env::var("MACROBATCH_REQUIRE_BF16").as_deref() == Ok("1") {
        assert!(
            matches!(kernel(), Some(Kernel::Hardware | Kernel::Amx)) || chosen,
            "{test}: MACROBATCH_REQUIRE_BF16=1 but no AVX512-BF16 kernel is used (MACROBATCH_NO_BF16 set, or not detected)"
        );
    }
    if std::env::var("MACROBATCH_REQUIRE_AMX").as_deref() == Ok("1") {
        assert!(
            kernel() == Some(Kernel::Amx) || chosen,
            "{test}: MACROBATCH_REQUIRE_AMX=1 but the AMX kernel is not used (not detected, or Linux refused tile data)"
        );
    }
    if kernel().is_none() {
        eprintln!("{test}: bf16 turned off in the environment (MACROBATCH_BF16=off or MACROBATCH_NO_BF16=1): skipped");
        return true;
    }
    false
}

/// Where bf16 would fall back to f32 operands because the CPU lacks
/// AVX512-BF16 (and the environment did not turn it off), runs the
/// [`portable`] kernel from now on: for tests, so that bf16 runs have the
/// same arithmetic, and bits, on every CPU.
pub fn emulate_where_missing() {
    if kernel().is_none() && env_choice() != Ok(Choice::Off) {
        set_kernel(Some(Kernel::Portable));
    }
}

#[cfg(target_arch = "x86_64")]
fn detect() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512bf16")
}

#[cfg(not(target_arch = "x86_64"))]
fn detect() -> bool {
    false
}

/// Whether the AMX kernel can run here ([`amx`]'s detection).
pub fn amx_detect() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        amx::detect()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `dst (+)= alpha · bf16(lhs) · bf16(rhs)`; see [`crate::gemm_raw`].
///
/// Runs the [`kernel`] in force ([`portable`] unless it is the hardware's).
///
/// # Safety
/// As [`crate::gemm_raw`] (with `k > 0`).
pub(crate) unsafe fn gemm(call: &crate::Call<'_>, pool: bool) {
    match kernel() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as below; kernel() is Amx only where amx::detect() holds.
        Some(Kernel::Amx) => unsafe { amx::gemm(call, pool) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the caller guarantees the views and `dst` as documented;
        // the CPU has the features `hardware` is compiled for (kernel() checked).
        Some(Kernel::Hardware) => unsafe { hardware::gemm(call, pool) },
        // SAFETY: as above.
        _ => unsafe { portable::gemm(call, pool) },
    }
}

#[cfg(target_arch = "x86_64")]
mod hardware;
#[cfg(test)]
mod tests;
