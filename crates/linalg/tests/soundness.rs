//! Soundness of the GEMM layer: bounds checks that overflow, overlapping dst
//! rows, `Split` against `Crate` at larger thread counts, and concurrent /
//! nested bf16 calls.

mod common;
use common::*;
use linalg::{backend, gemm_into, Backend, Call, GemmDims, GemmOut, Operands, Par, Strided};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// `dst_offset + (m - 1)·dst_rs + n` wraps around in release builds: with
/// `dst_rs = usize::MAX` the check passes and row 1 is written one element
/// *before* `dst` (the gemm crate takes the stride as isize −1).
#[test]
fn dst_bounds_check_does_not_wrap() {
    let a = data(2, 1);
    let b = data(2, 2);
    let mut buf = [7.0f32; 8];
    let r = catch_unwind(AssertUnwindSafe(|| {
        gemm_into(
            GemmDims { m: 2, n: 2, k: 1 },
            &mut buf[1..],
            GemmOut { offset: 0, rs: usize::MAX, accumulate: false },
            Strided::rows(&a, 1),
            Strided::rows(&b, 2),
            1.0,
            Par::ONE,
        )
    }));
    assert_eq!(buf[0], 7.0, "gemm_into wrote outside the dst slice it was given");
    assert!(r.is_err(), "a dst view past the end of the slice must be rejected");
}

/// The same wrap in `Strided::check`: row 1 of lhs is read one element
/// before the view's slice.
#[test]
fn operand_bounds_check_does_not_wrap() {
    let buf = data(8, 3);
    let b = data(2, 4);
    let lhs = Strided { data: &buf[1..], offset: 0, rs: usize::MAX, cs: 1 };
    let mut dst = vec![0.0f32; 2];
    let r = catch_unwind(AssertUnwindSafe(|| {
        gemm_into(
            GemmDims { m: 2, n: 1, k: 2 },
            &mut dst,
            GemmOut::overwrite(1),
            lhs,
            Strided::rows(&b, 1),
            1.0,
            Par::ONE,
        )
    }));
    assert!(r.is_err(), "an lhs view past the start of its slice must be rejected (read buf[0])");
}

/// `dst_rs < n` makes rows of dst overlap; on the pool (Split by rows, the
/// gemm crate's threads, the bf16 row split) two tasks then write the same
/// elements: a data race from a safe function. It must be rejected.
#[test]
fn overlapping_dst_rows_are_rejected() {
    let (m, n, k) = (512usize, 256usize, 64usize);
    let a = data(m * k, 5);
    let b = data(k * n, 6);
    let mut dst = vec![0.0f32; (m - 1) * 8 + n];
    let p = pool(2);
    let par = p.install(|| linalg::parallelism(false));
    let r = catch_unwind(AssertUnwindSafe(|| {
        p.install(|| {
            gemm_into(
                GemmDims { m, n, k },
                &mut dst,
                GemmOut::overwrite(8),
                Strided::rows(&a, k),
                Strided::rows(&b, n),
                1.0,
                par,
            )
        })
    }));
    assert!(r.is_err(), "dst_rs < n with m > 1 (overlapping rows written in parallel) must be rejected");
}

fn run(backend: Backend, m: usize, n: usize, k: usize) -> Vec<f32> {
    let a = data(m * k, 7);
    let b = data(k * n, 8);
    let mut dst = data(m * n, 9);
    let call = Call {
        m,
        n,
        k,
        dst: dst.as_mut_ptr(),
        dst_rs: n,
        accumulate: true,
        lhs: Strided::rows(&a, k),
        rhs: Strided::rows(&b, n),
        alpha: 0.5,
    };
    // SAFETY: dst is m × n; the views are exactly m × k and k × n.
    unsafe { backend::run(backend, &call) };
    dst
}

/// With more threads than the existing tests use (2, 3), `split` leaves a
/// small last block: 769 rows over 8 threads gives blocks of 144 and a last
/// one of 49 rows; with n ≤ 64 that block takes the gemm crate's
/// small-matrix path (k blocked by 512 instead of its cache-derived kc), and
/// 1153 rows over 16 threads leaves a last block of one row (the gemv path).
#[test]
fn split_is_bit_identical_to_crate_at_8_and_16_threads() {
    let one = pool(1);
    let mut bad = Vec::new();
    for &(threads, m, n, k) in &[(8usize, 769usize, 32usize, 1500usize), (16, 1153, 32, 1500), (16, 1153, 100, 700)] {
        let base = one.install(|| run(Backend::Crate, m, n, k));
        let p = pool(threads);
        for b in [Backend::Crate, Backend::Split] {
            let got = p.install(|| run(b, m, n, k));
            if bits(&got) != bits(&base) {
                let first = got.iter().zip(&base).position(|(x, y)| x.to_bits() != y.to_bits()).unwrap_or(0);
                bad.push(format!("{b:?} {m}x{k}x{n} at {threads} threads: first difference at row {}", first / n));
            }
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

fn bf16_par(pool: bool) -> Par {
    Par { pool, operands: Operands::F32 }.with(Operands::Bf16)
}

fn bf16_product(m: usize, n: usize, k: usize, seed: u32, par: Par) -> Vec<f32> {
    let a = data(m * k, seed);
    let b = data(k * n, seed + 1);
    let mut dst = vec![0.0f32; m * n];
    gemm_into(
        GemmDims { m, n, k },
        &mut dst,
        GemmOut::overwrite(n),
        Strided::rows(&a, k),
        Strided::transposed(&b, k),
        1.0,
        par,
    );
    dst
}

/// Pool-wide bf16 GEMMs started at once from several threads outside the
/// pool (each enters the pool; workers steal each other's tasks, so one
/// worker's thread-local pack buffers serve several GEMMs), and from inside
/// a parallel loop of the pool (nested): every result equals the serial one.
#[test]
fn bf16_concurrent_and_nested_pool_calls_match_serial() {
    if linalg::bf16::skip_without_bf16("bf16_concurrent_and_nested_pool_calls_match_serial") {
        return;
    }
    let shapes = [(300usize, 200usize, 1100usize), (20, 1000, 700), (130, 70, 2050), (64, 300, 900)];
    let serial: Vec<Vec<f32>> =
        shapes.iter().enumerate().map(|(i, &(m, n, k))| bf16_product(m, n, k, i as u32, bf16_par(false))).collect();
    let p = &pool(4);
    for _round in 0..3 {
        std::thread::scope(|s| {
            let handles: Vec<_> = shapes
                .iter()
                .enumerate()
                .map(|(i, &(m, n, k))| s.spawn(move || p.install(|| bf16_product(m, n, k, i as u32, bf16_par(true)))))
                .collect();
            for (i, h) in handles.into_iter().enumerate() {
                assert_eq!(bits(&h.join().expect("thread")), bits(&serial[i]), "concurrent call {i}");
            }
        });
        let nested: Vec<Vec<f32>> = p.install(|| {
            use rayon::prelude::*;
            (0..shapes.len() * 2)
                .into_par_iter()
                .map(|j| {
                    let i = j % shapes.len();
                    let (m, n, k) = shapes[i];
                    bf16_product(m, n, k, i as u32, bf16_par(true))
                })
                .collect()
        });
        for (j, got) in nested.iter().enumerate() {
            assert_eq!(bits(got), bits(&serial[j % shapes.len()]), "nested call {j}");
        }
    }
}

/// The same for the f32 pool backends (the probe runs `crate` and `split`
/// calls of one shape at once from several threads).
#[test]
fn f32_concurrent_pool_calls_match_serial() {
    // Keep the probe's cache out of $HOME.
    let dir = std::env::temp_dir().join(format!("linalg-review-{}", std::process::id()));
    std::env::set_var("MACROBATCH_CACHE_DIR", &dir);
    let (m, n, k) = (700usize, 300usize, 600usize);
    let a = data(m * k, 11);
    let b = data(k * n, 12);
    let one = |par: Par| {
        let mut dst = vec![0.0f32; m * n];
        gemm_into(
            GemmDims { m, n, k },
            &mut dst,
            GemmOut::overwrite(n),
            Strided::rows(&a, k),
            Strided::rows(&b, n),
            1.0,
            par,
        );
        dst
    };
    // `crate` and `split` give these bits; an OpenBLAS build may also run
    // OpenBLAS on a probe call, which sums in its own order.
    let mut wants = vec![bits(&one(Par::ONE))];
    let p = pool(3);
    if Backend::f32_candidates().contains(&Backend::OpenBlas) {
        let mut blas = vec![0.0f32; m * n];
        p.install(|| {
            let (lhs, rhs) = (Strided::rows(&a, k), Strided::rows(&b, n));
            let call = Call { m, n, k, dst: blas.as_mut_ptr(), dst_rs: n, accumulate: false, lhs, rhs, alpha: 1.0 };
            // SAFETY: `blas` is m × n; the views are in bounds.
            unsafe { backend::run(Backend::OpenBlas, &call) }
        });
        wants.push(bits(&blas));
    }
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..6).map(|_| s.spawn(|| p.install(|| one(linalg::parallelism(false))))).collect();
        for h in hs {
            let got = bits(&h.join().expect("thread"));
            assert!(wants.contains(&got), "a concurrent pool call differs from every backend's serial result");
        }
    });
    let _ = std::fs::remove_dir_all(&dir);
}

/// A stride along a dimension of size 1 is never used, whatever its value
/// (the bounds check ignores it): usize::MAX there (−1 as the gemm crate's
/// isize) gives the same result as the dense stride, on every path.
#[test]
fn unused_strides_of_unit_dimensions_do_not_matter() {
    let p = pool(2);
    let pars = [
        Par::ONE,
        p.install(|| linalg::parallelism(false)),
        Par::ONE.with(Operands::Bf16),
        p.install(|| linalg::parallelism(false).with(Operands::Bf16)),
    ];
    for &(m, n, k) in &[(1usize, 300usize, 700usize), (300, 1, 700), (200, 300, 1), (1, 1, 9)] {
        let a = data(m * k, 13);
        let b = data(k * n, 14);
        let dense = (Strided::rows(&a, k), Strided::rows(&b, n), n);
        let huge = |s: usize, dim: usize| if dim == 1 { usize::MAX } else { s };
        let odd = (
            Strided { rs: huge(k, m), cs: huge(1, k), ..dense.0 },
            Strided { rs: huge(n, k), cs: huge(1, n), ..dense.1 },
            huge(n, m),
        );
        for par in pars {
            let run = |(l, r, rs): (Strided<'_>, Strided<'_>, usize)| {
                let mut dst = vec![1.0f32; (m - 1) * n + n];
                p.install(|| {
                    gemm_into(
                        GemmDims { m, n, k },
                        &mut dst,
                        GemmOut { offset: 0, rs, accumulate: true },
                        l,
                        r,
                        0.5,
                        par,
                    )
                });
                dst
            };
            assert_eq!(bits(&run(odd)), bits(&run(dense)), "{m}x{k}x{n} {par:?}");
        }
    }
}

/// `split` against `crate` over thread counts 4..16 and long sides just
/// above multiples of the split threshold, both orientations.
#[test]
fn split_matches_crate_over_thread_counts() {
    let one = pool(1);
    let mut bad = Vec::new();
    for threads in [4usize, 6, 8, 12, 16] {
        let p = pool(threads);
        for len in [129usize, 300, 520, 769, 1041, 1153, 1297, 2047] {
            for other in [2usize, 40, 100] {
                for k in [3usize, 600] {
                    for (m, n) in [(len, other), (other, len)] {
                        let base = one.install(|| run(Backend::Crate, m, n, k));
                        let got = p.install(|| run(Backend::Split, m, n, k));
                        if bits(&got) != bits(&base) {
                            bad.push(format!("{m}x{k}x{n} at {threads} threads"));
                        }
                    }
                }
            }
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}
