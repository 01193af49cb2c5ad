//! Median GFLOP/s of `gemm_into` with bf16 operands vs f32, on the pool.
//!
//! `cargo run --release -p macrobatch-linalg --example bf16_gemm [reps [filter [bf16|f32]]]`
//! (`RAYON_NUM_THREADS` picks the thread count; 2 by default here; `filter`
//! keeps the shapes whose name contains it; the last argument runs one path
//! only).

use linalg::{gemm_into, GemmDims, GemmOut, Operands, Par, Strided};
use std::time::Instant;

/// Operand layouts of `dst[m×n] = lhs[m×k] · rhs[k×n]`.
#[derive(Clone, Copy)]
enum Layout {
    /// Both row-major.
    Plain,
    /// rhs is the transpose of a row-major n×k matrix (dinp = dout·Wᵀ).
    RhsT,
    /// lhs is the transpose of a row-major k×m matrix (dW = inpᵀ·dout).
    LhsT,
}

fn main() {
    let reps: usize = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(7);
    let filter = std::env::args().nth(2).unwrap_or_default();
    let only = std::env::args().nth(3).unwrap_or_default();
    let threads = std::env::var("RAYON_NUM_THREADS").ok().and_then(|s| s.parse().ok()).unwrap_or(2);
    rayon::ThreadPoolBuilder::new().num_threads(threads).build_global().expect("rayon pool");
    println!("bf16 supported: {}, threads {}, reps {reps}", linalg::bf16::supported(), rayon::current_num_threads());
    let shapes = [
        ("1024x256x768", 1024, 256, 768, Layout::Plain),
        ("1024x256x1024", 1024, 256, 1024, Layout::Plain),
        ("1024x1024x256", 1024, 1024, 256, Layout::Plain),
        ("1024x256x256", 1024, 256, 256, Layout::Plain),
        ("4096x768x2304", 4096, 768, 2304, Layout::Plain),
        ("4096x768x3072", 4096, 768, 3072, Layout::Plain),
        ("4096x3072x768", 4096, 3072, 768, Layout::Plain),
        ("1024x768x50304", 1024, 768, 50304, Layout::Plain),
        ("dinp 4096x2304x768 (rhs T)", 4096, 2304, 768, Layout::RhsT),
        ("dW 768x4096x2304 (lhs T)", 768, 4096, 2304, Layout::LhsT),
    ];
    println!(
        "{:<30} {:>10} {:>10} {:>7} {:>10} {:>10}",
        "m x k x n (median GFLOP/s)", "bf16", "f32", "ratio", "best bf16", "best f32"
    );
    for (name, m, k, n, layout) in shapes {
        if !name.contains(filter.as_str()) {
            continue;
        }
        let a: Vec<f32> = (0..m * k).map(|i| ((i * 7919 % 1000) as f32 - 500.0) * 1e-3).collect();
        let b: Vec<f32> = (0..k * n).map(|i| ((i * 104729 % 1000) as f32 - 500.0) * 1e-3).collect();
        let lhs = match layout {
            Layout::LhsT => Strided::transposed(&a, m),
            _ => Strided::rows(&a, k),
        };
        let rhs = match layout {
            Layout::RhsT => Strided::transposed(&b, k),
            _ => Strided::rows(&b, n),
        };
        let mut dst = vec![0f32; m * n];
        let flops = 2.0 * (m * n * k) as f64;
        // Small shapes run more often (about 20 GFLOP per path at least).
        let reps = (reps as f64 * (20e9 / (flops * reps as f64)).clamp(1.0, 50.0)) as usize;
        let mut times = [Vec::new(), Vec::new()];
        let ops = [Operands::Bf16, Operands::F32];
        // Warm up, then interleave the two paths.
        for rep in 0..reps + 2 {
            for (t, &operands) in times.iter_mut().zip(ops.iter()) {
                if (only == "bf16" && operands != Operands::Bf16) || (only == "f32" && operands != Operands::F32) {
                    t.push(f64::INFINITY);
                    continue;
                }
                let start = Instant::now();
                gemm_into(
                    GemmDims { m, n, k },
                    &mut dst,
                    GemmOut::overwrite(n),
                    lhs,
                    rhs,
                    1.0,
                    Par { pool: true, operands },
                );
                let s = start.elapsed().as_secs_f64();
                if rep > 1 {
                    t.push(s);
                }
            }
        }
        // (median, best) GFLOP/s per path.
        let gf: Vec<(f64, f64)> = times
            .iter_mut()
            .map(|t| {
                t.sort_by(f64::total_cmp);
                (flops / t[t.len() / 2] / 1e9, flops / t[0] / 1e9)
            })
            .collect();
        println!(
            "{:<30} {:>10.1} {:>10.1} {:>7.2} {:>10.1} {:>10.1}",
            name,
            gf[0].0,
            gf[1].0,
            gf[0].0 / gf[1].0,
            gf[0].1,
            gf[1].1
        );
    }
}
