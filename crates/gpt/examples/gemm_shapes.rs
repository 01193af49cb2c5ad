//! GEMM candidates on the shapes of a GPT training step, side by side in one run.
//!
//! `cargo run --release -p macrobatch-gpt --example gemm_shapes [THREADS]`
//! Prints the median GFLOP/s of `gemm` (0.19, AVX-512 kernels via `x86-v4`)
//! and `matrixmultiply` (0.3, threading) for C = A·B, row-major f32.

use std::time::Instant;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() {
    let threads: usize = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(2);
    rayon::ThreadPoolBuilder::new().num_threads(threads).build_global().expect("pool");
    // (m, k, n): tiny preset B·T = 1024 rows (qkv, mlp up, mlp down, head), then GPT-2 124M at B·T = 4096.
    // SHAPES=micro: the tiny preset's matmuls at 512 rows (micro-batch 4) and 4096 (32).
    let shapes: Vec<(usize, usize, usize)> = if std::env::var("SHAPES").as_deref() == Ok("micro") {
        vec![(512, 256, 768), (4096, 256, 768), (512, 1024, 256), (4096, 1024, 256), (256, 512, 768), (256, 4096, 768)]
    } else {
        vec![
            (1024, 256, 768),
            (1024, 256, 1024),
            (1024, 1024, 256),
            (1024, 256, 256),
            (4096, 768, 2304),
            (4096, 768, 3072),
            (4096, 3072, 768),
        ]
    };
    println!("threads {threads}");
    println!("{:>18} {:>12} {:>16}", "m×k×n", "gemm GF/s", "matrixmult GF/s");
    for (m, k, n) in shapes {
        let a: Vec<f32> = (0..m * k).map(|i| (i % 7) as f32 * 0.1).collect();
        let b: Vec<f32> = (0..k * n).map(|i| (i % 5) as f32 * 0.1).collect();
        let mut c = vec![0.0f32; m * n];
        let flops = 2.0 * (m * k * n) as f64;
        let reps = if m * k * n > 1 << 30 { 5 } else { 15 };
        let mut g = Vec::new();
        let mut mm = Vec::new();
        for _ in 0..reps {
            // Interleaved, so both see the same machine noise.
            let t = Instant::now();
            nn::gemm_into(
                nn::GemmDims { m, n, k },
                &mut c,
                nn::GemmOut::overwrite(n),
                nn::Strided::rows(&a, k),
                nn::Strided::rows(&b, n),
                1.0,
                nn::parallelism(false),
            );
            g.push(flops / t.elapsed().as_secs_f64() / 1e9);
            let t = Instant::now();
            // SAFETY: dimensions and strides describe the three dense buffers above.
            unsafe {
                matrixmultiply::sgemm(
                    m,
                    k,
                    n,
                    1.0,
                    a.as_ptr(),
                    k as isize,
                    1,
                    b.as_ptr(),
                    n as isize,
                    1,
                    0.0,
                    c.as_mut_ptr(),
                    n as isize,
                    1,
                );
            }
            mm.push(flops / t.elapsed().as_secs_f64() / 1e9);
        }
        println!("{:>18} {:>12.1} {:>16.1}", format!("{m}×{k}×{n}"), median(g), median(mm));
    }
}
