//! Heap bytes per thread: a global allocator that counts, on the thread
//! that allocates or frees, the live bytes and their peak. A rank that runs
//! as a thread then has a measured peak of its own (the OS's VmHWM is the
//! whole process's): everything its trainer and model allocate happens on
//! its thread. Kernel temporaries of the shared worker pool count on the
//! workers, not on a rank.
//!
//! It also turns a failed allocation into a report instead of the default
//! abort (SIGABRT, exit 134, "memory allocation of N bytes failed"): the
//! phase the run was in ([`set_phase`]), the bytes asked for and what to
//! change, then exit [`EXIT_OUT_OF_MEMORY`]. Allocations that handle their
//! own failure (`engine::alloc`) get null back as usual.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicU8, Ordering};

/// Exit code of a process that ran out of memory (not 134: no abort).
pub const EXIT_OUT_OF_MEMORY: i32 = 3;

/// What the process is doing, for the out-of-memory report.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Phase {
    /// Reading the configuration, the data, planning.
    Setup = 0,
    /// Reading a checkpoint or a pretrained model.
    Load,
    /// Building the model and the trainers.
    Build,
    /// An optimizer step.
    Step,
    /// Evaluation.
    Eval,
    /// Writing a checkpoint.
    Checkpoint,
    /// Saving the trained model.
    Save,
}

static PHASE: AtomicU8 = AtomicU8::new(Phase::Setup as u8);

/// Records the phase the process is in (any thread; one value per process).
pub fn set_phase(phase: Phase) {
    if matches!(phase, Phase::Build | Phase::Checkpoint | Phase::Save) {
        trim();
    }
    PHASE.store(phase as u8, Ordering::Relaxed);
}

/// Hands the allocator's free memory back to the OS. glibc keeps what
/// was freed in its per-thread arenas (and raises its mmap threshold after
/// large frees), so without this the memory of a finished phase (loading,
/// the kernels' temporaries on the worker threads) stays resident beside
/// the next phase's: before a save that was 150 MB on the SmolLM2 example.
pub fn trim() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns unused pages of the allocator's own arenas.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Runs `f` in `phase`, then returns to [`Phase::Setup`] (loading while the
/// run is still being set up).
pub fn during<T>(phase: Phase, f: impl FnOnce() -> T) -> T {
    set_phase(phase);
    let r = f();
    set_phase(Phase::Setup);
    r
}

/// What to change when `phase` runs out of memory.
pub fn advice(phase: Phase) -> &'static str {
    phase_text(phase as u8).1
}

/// The phase's name and the change that needs less memory in it.
fn phase_text(phase: u8) -> (&'static str, &'static str) {
    const STEP: &str = "lower batch.micro (batch.micro = \"auto\" keeps the global batch), set train.activation_checkpointing = \"blocks\" or train.precision = \"bf16\", or raise the memory limit";
    match phase {
        x if x == Phase::Load as u8 => (
            "loading the checkpoint or pretrained model",
            "raise the memory limit (ulimit -v) or use a machine with more memory",
        ),
        x if x == Phase::Build as u8 => ("building the model and trainer", STEP),
        x if x == Phase::Step as u8 => ("an optimizer step", STEP),
        x if x == Phase::Eval as u8 => ("evaluation", STEP),
        x if x == Phase::Checkpoint as u8 => {
            ("writing a checkpoint (a full copy of parameters and optimizer state)", STEP)
        }
        x if x == Phase::Save as u8 => ("saving the model (a full copy of the parameters)", STEP),
        _ => ("setting up", "raise the memory limit or use a machine with more memory"),
    }
}

/// Formats into a fixed buffer: no allocation (there is no memory left).
struct Fixed {
    buf: [u8; 1024],
    len: usize,
}

impl std::fmt::Write for Fixed {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        let n = s.len().min(self.buf.len() - self.len);
        self.buf[self.len..self.len + n].copy_from_slice(&s.as_bytes()[..n]);
        self.len += n;
        Ok(())
    }
}

/// A failed allocation of `size` bytes: returns when its caller handles
/// the failure; otherwise reports it and ends the process.
fn failed(size: usize) {
    if engine::alloc::failure_is_handled() {
        return;
    }
    use std::fmt::Write;
    let (phase, advice) = phase_text(PHASE.load(Ordering::Relaxed));
    let mut msg = Fixed { buf: [0; 1024], len: 0 };
    let _ = writeln!(
        msg,
        "error: out of memory while {phase}: {size} more bytes could not be allocated (the memory limit is tighter than the plan, or other processes took memory); {advice}. Checkpoints already written are intact (continue with `macrobatch train --resume DIR`)."
    );
    // SAFETY: writes our own buffer to fd 2, then ends the process without
    // running destructors or atexit handlers (which could allocate).
    unsafe {
        libc::write(2, msg.buf.as_ptr().cast(), msg.len);
        libc::_exit(EXIT_OUT_OF_MEMORY);
    }
}

/// [`System`], counting.
pub struct Counting;

thread_local! {
    static LIVE: Cell<i64> = const { Cell::new(0) };
    static PEAK: Cell<i64> = const { Cell::new(0) };
    /// A second peak, restarted by [`mark`] without touching [`PEAK`].
    static MARK_PEAK: Cell<i64> = const { Cell::new(0) };
}

fn add(delta: i64) {
    // `try_with`: during a thread's teardown the counters may be gone.
    let _ = LIVE.try_with(|live| {
        let now = live.get() + delta;
        live.set(now);
        let _ = PEAK.try_with(|peak| peak.set(peak.get().max(now)));
        let _ = MARK_PEAK.try_with(|peak| peak.set(peak.get().max(now)));
    });
}

/// Starts a second peak of this thread at its current live bytes (the
/// peak since [`reset_peak`] goes on); returns them.
pub fn mark() -> i64 {
    restart(&MARK_PEAK)
}

/// The most bytes this thread held at once since [`mark`].
pub fn peak_since_mark() -> i64 {
    MARK_PEAK.try_with(Cell::get).unwrap_or(0)
}

/// Restarts `peak` at this thread's live bytes; returns them.
fn restart(peak: &'static std::thread::LocalKey<Cell<i64>>) -> i64 {
    let live = LIVE.try_with(Cell::get).unwrap_or(0);
    let _ = peak.try_with(|p| p.set(live));
    live
}

// SAFETY: every call forwards to `System` with the same arguments; the
// counting touches only const-initialised thread-locals (no allocation);
// a failure report formats into a stack buffer.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc(layout);
        if p.is_null() {
            failed(layout.size());
        } else {
            add(layout.size() as i64);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc_zeroed(layout);
        if p.is_null() {
            failed(layout.size());
        } else {
            add(layout.size() as i64);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout);
        add(-(layout.size() as i64));
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = System.realloc(ptr, layout, new_size);
        if p.is_null() {
            failed(new_size);
        } else {
            add(new_size as i64 - layout.size() as i64);
        }
        p
    }
}

/// Starts this thread's peak afresh at its current live bytes; returns them.
pub fn reset_peak() -> i64 {
    restart(&PEAK)
}

/// The most bytes this thread held at once since [`reset_peak`].
pub fn peak() -> i64 {
    PEAK.try_with(Cell::get).unwrap_or(0)
}
