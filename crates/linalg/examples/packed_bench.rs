//! Median time of the packed GEMMs (`gemm_x_wt`, `gemm_dy_w`) per format
//! against `gemm_into` on an f32 copy of the weight, on SmolLM2-135M's
//! linear shapes, and each format's dequantisation rate.
//!
//! `cargo run --release -p macrobatch-linalg --example packed_bench [reps [filter]]`
//! (`RAYON_NUM_THREADS` picks the thread count, all cores by default;
//! `filter` keeps the rows whose format or shape contains it; `dequant` as
//! the filter times only the dequantisation, on one thread, and the
//! quantisation).

use linalg::{gemm_dy_w, gemm_into, gemm_x_wt, GemmDims, GemmOut, PackFormat, PackedMatrix, Strided};
use std::time::Instant;

/// Median seconds of `reps` calls of `f` after one warm-up.
fn median(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    let mut t: Vec<f64> = (0..reps)
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}

/// Median and best seconds of `f` and of `g`, called in turn (so that a
/// change in the machine's load falls on both alike), after one warm-up
/// each: `[(median f, median g), (best f, best g)]`.
fn paired(reps: usize, mut f: impl FnMut(), mut g: impl FnMut()) -> [(f64, f64); 2] {
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for i in 0..=reps {
        let s = Instant::now();
        f();
        let tf = s.elapsed().as_secs_f64();
        let s = Instant::now();
        g();
        if i > 0 {
            a.push(tf);
            b.push(s.elapsed().as_secs_f64());
        }
    }
    a.sort_by(f64::total_cmp);
    b.sort_by(f64::total_cmp);
    [(a[a.len() / 2], b[b.len() / 2]), (a[0], b[0])]
}

fn values(len: usize, seed: u64) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.1
        })
        .collect()
}

fn main() {
    let reps: usize = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(9);
    let filter = std::env::args().nth(2).unwrap_or_default();
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let par = linalg::parallelism(false);
    println!("{cpu}, {} threads, median of {reps}", rayon::current_num_threads());
    if filter == "dequant" {
        dequant_rates(reps);
        return;
    }
    println!("(median times; ratio = packed / f32 of the medians, and of the best times in brackets;");
    println!(" dequant = values per ns decoding whole rows on one thread)");
    println!(
        "{:<8} {:>11} {:>4} {:>10} {:>10} {:>15} {:>10} {:>10} {:>15} {:>7}",
        "format", "out×in", "n", "x·Wᵀ f32", "packed", "ratio (best)", "dy·W f32", "packed", "ratio (best)", "dequant"
    );
    let shapes = [(960usize, 576usize), (576, 576), (3072, 576), (576, 1536)];
    for (out, inp) in shapes {
        let w = values(out * inp, (out * 31 + inp) as u64);
        for format in PackFormat::ALL {
            let label = format!("{out}×{inp}");
            if !format.name().contains(filter.as_str()) && !label.contains(filter.as_str()) {
                continue;
            }
            let Ok(m) = PackedMatrix::quantize(out, inp, &w, format) else { continue };
            let deq = m.dequantize();
            let mut buf = vec![0.0f32; out * inp];
            let rate = (out * inp) as f64 / median(reps, || m.dequantize_rows(0..out, &mut buf)) / 1e9;
            for n in [64usize, 128, 512] {
                let x = values(n * inp, 7);
                let dy = values(n * out, 8);
                let mut y = vec![0.0f32; n * out];
                let mut dx = vec![0.0f32; n * inp];
                let mut y2 = y.clone();
                let [(fwd_f32, fwd), (fwd_f32_best, fwd_best)] = paired(
                    reps,
                    || {
                        let dims = GemmDims { m: n, n: out, k: inp };
                        let rhs = Strided::transposed(&deq, inp);
                        gemm_into(dims, &mut y, GemmOut::overwrite(out), Strided::rows(&x, inp), rhs, 1.0, par)
                    },
                    || gemm_x_wt(n, &mut y2, GemmOut::overwrite(out), Strided::rows(&x, inp), &m, 0..out, 1.0, par),
                );
                let mut dx2 = dx.clone();
                let [(bwd_f32, bwd), (bwd_f32_best, bwd_best)] = paired(
                    reps,
                    || {
                        let dims = GemmDims { m: n, n: inp, k: out };
                        let rhs = Strided::rows(&deq, inp);
                        gemm_into(dims, &mut dx, GemmOut::overwrite(inp), Strided::rows(&dy, out), rhs, 1.0, par)
                    },
                    || gemm_dy_w(n, &mut dx2, GemmOut::overwrite(inp), Strided::rows(&dy, out), &m, 0..out, 1.0, par),
                );
                println!(
                    "{:<8} {:>11} {:>4} {:>8.1}µs {:>8.1}µs {:>6.3} ({:.3}) {:>8.1}µs {:>8.1}µs {:>6.3} ({:.3}) {:>7.2}",
                    format.name(),
                    label,
                    n,
                    fwd_f32 * 1e6,
                    fwd * 1e6,
                    fwd / fwd_f32,
                    fwd_best / fwd_f32_best,
                    bwd_f32 * 1e6,
                    bwd * 1e6,
                    bwd / bwd_f32,
                    bwd_best / bwd_f32_best,
                    rate
                );
            }
        }
    }
}

/// Values per ns of `dequantize_rows` (one thread) and `quantize` (the
/// pool) over a 3072 × 576 matrix, per format.
fn dequant_rates(reps: usize) {
    let (rows, cols) = (3072, 576);
    let w = values(rows * cols, 1);
    let mut buf = vec![0.0f32; rows * cols];
    for format in PackFormat::ALL {
        let Ok(m) = PackedMatrix::quantize(rows, cols, &w, format) else { continue };
        // Panel-sized pieces, as the GEMMs decode them.
        let t = median(reps, || {
            for r in (0..rows).step_by(256) {
                m.dequantize_rows(r..r + 256, &mut buf[..256 * cols]);
            }
        });
        let q = median(reps.min(5), || drop(PackedMatrix::quantize(rows, cols, &w, format)));
        let per_ns = |t: f64| (rows * cols) as f64 / t / 1e9;
        println!(
            "{:<8} dequantise {:>6.2} values/ns, quantise (pool) {:>6.3} values/ns",
            format.name(),
            per_ns(t),
            per_ns(q)
        );
    }
}
