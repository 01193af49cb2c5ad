//! Time and memory of the two causal attention kernels, materialised
//! (`attention`) and tiled (`flash`), forward and backward, at SmolLM2's
//! attention shape (9 query heads, 3 key/value heads, head width 64),
//! one sequence of T = 1024 and 2048 (or the lengths given as arguments).
//!
//! "saved" is what the forward keeps for the backward besides `qkv` and
//! `y` (the probabilities, or one log-sum-exp per row); "scratch" is the
//! caller's scratch slices plus the peak of what the kernel allocates
//! itself, measured by a counting allocator.
//!
//! `cargo run --release -p macrobatch-nn --example attention_bench [T...]`

use nn::attention::{attention_backward, attention_forward, AttnShape};
use nn::flash::{flash_attention_backward, flash_attention_forward, Visible};
use nn::Operands;
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::time::Instant;

/// The system allocator, counting live bytes and their peak.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards every call to `System` unchanged; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let live = LIVE.fetch_add(layout.size(), Relaxed) + layout.size();
        PEAK.fetch_max(live, Relaxed);
        // SAFETY: the caller's layout, passed on.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Relaxed);
        // SAFETY: allocated by `System` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Median wall time of `reps` runs of `f` in ms (after one warm-up run),
/// and the peak bytes it allocated beyond what was live when it started.
fn measure(reps: usize, mut f: impl FnMut()) -> (f64, usize) {
    let base = LIVE.load(Relaxed);
    PEAK.store(base, Relaxed);
    f();
    let mut times: Vec<f64> = (0..reps)
        .map(|_| {
            let t0 = Instant::now();
            f();
            t0.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    times.sort_by(f64::total_cmp);
    (times[reps / 2], PEAK.load(Relaxed) - base)
}

fn mib(bytes: usize) -> f64 {
    bytes as f64 / (1 << 20) as f64
}

fn main() {
    let lens: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let lens = if lens.is_empty() { vec![1024, 2048] } else { lens };
    println!("threads: {}", rayon::current_num_threads());
    println!(
        "{:>5} {:>9} {:>9} {:>9} {:>11} {:>13} {:>13}",
        "T", "kernel", "fwd ms", "bwd ms", "saved MiB", "fwd scr MiB", "bwd scr MiB"
    );
    for t in lens {
        let s = AttnShape { b: 1, t, n_head: 9, n_kv_head: 3, head_dim: 64, ops: Operands::F32 };
        let (n, qd, w) = (s.b * t, s.q_dim(), s.qkv_width());
        let mut rng = 0x9e37_79b9_u32;
        let mut rand = move || {
            rng ^= rng << 13;
            rng ^= rng >> 17;
            rng ^= rng << 5;
            rng as f32 / u32::MAX as f32 - 0.5
        };
        let qkv: Vec<f32> = (0..n * w).map(|_| rand()).collect();
        let dy: Vec<f32> = (0..n * qd).map(|_| rand()).collect();
        let reps = 5;

        let (mut y, mut att, mut heads) = (vec![0.0; n * qd], vec![0.0; s.att_len()], vec![0.0; n * qd]);
        let (fwd, fwd_alloc) = measure(reps, || attention_forward(&mut y, &mut att, &mut heads, &qkv, s));
        let (mut dqkv, mut datt, mut hb) = (vec![0.0; n * w], vec![0.0; s.att_len()], vec![0.0; n * w]);
        let (bwd, bwd_alloc) =
            measure(reps, || attention_backward(&mut dqkv, &mut datt, &mut hb, &dy, (&qkv, &att), s));
        let saved = 4 * att.len();
        let (fs, bs) = (4 * heads.len() + fwd_alloc, 4 * (datt.len() + hb.len()) + bwd_alloc);
        println!(
            "{t:>5} {:>9} {fwd:>9.1} {bwd:>9.1} {:>11.2} {:>13.2} {:>13.2}",
            "attention",
            mib(saved),
            mib(fs),
            mib(bs)
        );
        drop((att, heads, datt, hb));

        let (mut fy, mut lse) = (vec![0.0; n * qd], vec![0.0; s.b * s.n_head * t]);
        let (ffwd, ffwd_alloc) = measure(reps, || flash_attention_forward(&mut fy, &mut lse, &qkv, s, Visible::CAUSAL));
        let (mut fdqkv, mut fh) = (vec![0.0; n * w], vec![0.0; n * w]);
        let (fbwd, fbwd_alloc) =
            measure(reps, || flash_attention_backward(&mut fdqkv, &mut fh, &dy, (&qkv, &fy, &lse), s, Visible::CAUSAL));
        let (saved, fs, bs) = (4 * lse.len(), ffwd_alloc, 4 * fh.len() + fbwd_alloc);
        println!(
            "{t:>5} {:>9} {ffwd:>9.1} {fbwd:>9.1} {:>11.2} {:>13.2} {:>13.2}",
            "flash",
            mib(saved),
            mib(fs),
            mib(bs)
        );
        let diff = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
        println!("      max |Δy| {:.1e}, max |Δdqkv| {:.1e}", diff(&fy, &y), diff(&fdqkv, &dqkv));
    }
}
