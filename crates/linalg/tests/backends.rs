//! The f32 backends agree bit for bit (`Crate` vs `Split`, any thread
//! count), and with a plain f64 reference to f32 rounding; the probe picks a
//! backend per shape and reports it.

mod common;
use common::*;
use linalg::{backend, gemm_into, Backend, Call, GemmDims, GemmOut, Par, Strided};

struct Case {
    m: usize,
    n: usize,
    k: usize,
    lhs_t: bool,
    rhs_t: bool,
}

impl Case {
    fn operands(&self) -> (Vec<f32>, Vec<f32>) {
        (data(self.m * self.k, 1), data(self.k * self.n, 2))
    }
    fn views<'a>(&self, a: &'a [f32], b: &'a [f32]) -> (Strided<'a>, Strided<'a>) {
        let l = if self.lhs_t { Strided::transposed(a, self.m) } else { Strided::rows(a, self.k) };
        let r = if self.rhs_t { Strided::transposed(b, self.k) } else { Strided::rows(b, self.n) };
        (l, r)
    }
    /// `dst` (row stride n + 3, starting from a fixed pattern) after one call.
    fn run(&self, backend: Backend, accumulate: bool) -> Vec<f32> {
        let (a, b) = self.operands();
        let (l, r) = self.views(&a, &b);
        let rs = self.n + 3;
        let mut dst = data(self.m * rs, 3);
        // SAFETY: dst holds m rows of stride rs ≥ n; the views are in bounds.
        unsafe {
            backend::run(
                backend,
                &Call {
                    m: self.m,
                    n: self.n,
                    k: self.k,
                    dst: dst.as_mut_ptr(),
                    dst_rs: rs,
                    accumulate,
                    lhs: l,
                    rhs: r,
                    alpha: 0.5,
                },
            )
        };
        dst
    }
}

fn cases() -> Vec<Case> {
    let mut v = Vec::new();
    // GPT-2 tiny / small micro-batch shapes (forward, dinp = dout·Wᵀ, dW = inpᵀ·dout),
    // odd sizes, and thin ones on both sides of the split threshold.
    for &(m, k, n) in &[
        (512, 256, 768),
        (1024, 1024, 256),
        (256, 512, 768),
        (300, 129, 77),
        (65, 700, 130),
        (128, 64, 40),
        (1000, 33, 129),
    ] {
        for (lhs_t, rhs_t) in [(false, false), (false, true), (true, false)] {
            v.push(Case { m, n, k, lhs_t, rhs_t });
        }
    }
    v
}

#[test]
fn split_and_crate_are_bit_identical_for_any_thread_count() {
    let one = pool(1);
    for threads in [2, 3] {
        let p = pool(threads);
        for c in cases() {
            for acc in [false, true] {
                let base = one.install(|| c.run(Backend::Crate, acc));
                for b in [Backend::Crate, Backend::Split] {
                    let got = p.install(|| c.run(b, acc));
                    let same = base.iter().zip(&got).all(|(x, y)| x.to_bits() == y.to_bits());
                    assert!(
                        same,
                        "{:?} at {threads} threads differs from 1 thread: {}x{}x{} lhs_t {} rhs_t {} acc {acc}",
                        b, c.m, c.k, c.n, c.lhs_t, c.rhs_t
                    );
                }
            }
        }
    }
}

#[test]
fn backends_match_an_f64_reference() {
    let p = pool(2);
    for c in cases() {
        let (a, b) = c.operands();
        let (l, r) = c.views(&a, &b);
        let rs = c.n + 3;
        let init = data(c.m * rs, 3);
        for backend in Backend::f32_candidates() {
            let got = p.install(|| c.run(backend, true));
            for i in 0..c.m {
                for j in 0..rs {
                    let idx = i * rs + j;
                    if j >= c.n {
                        assert_eq!(got[idx].to_bits(), init[idx].to_bits(), "{backend:?} wrote past column n");
                        continue;
                    }
                    let (mut s, mut mag) = (0.0f64, 0.0f64);
                    for p in 0..c.k {
                        let x = l.data[l.offset + i * l.rs + p * l.cs] as f64
                            * r.data[r.offset + p * r.rs + j * r.cs] as f64;
                        s += x;
                        mag += x.abs();
                    }
                    let want = init[idx] as f64 + 0.5 * s;
                    // f32 accumulation over k terms: |error| ≤ ~k·2⁻²⁴·Σ|a·b|;
                    // k·2⁻²⁴ ≤ 1024·6e-8 = 6e-5, bounded here by 1e-5 + 1e-4 of the magnitude.
                    let tol = 1e-5 + 1e-4 * (0.5 * mag + init[idx].abs() as f64);
                    assert!(
                        (got[idx] as f64 - want).abs() <= tol,
                        "{backend:?} {}x{}x{}: ({i},{j}) {} vs {want}",
                        c.m,
                        c.k,
                        c.n,
                        got[idx]
                    );
                }
            }
        }
    }
}

#[test]
fn pool_calls_are_probed_once_per_shape_and_reported() {
    let dir = std::env::temp_dir().join(format!("linalg-probe-{}", std::process::id()));
    std::env::set_var("MACROBATCH_CACHE_DIR", &dir);
    let p = pool(2);
    let (m, k, n) = (256, 128, 192);
    let (a, b) = (data(m * k, 4), data(k * n, 5));
    let mut dst = vec![0.0f32; m * n];
    let par = p.install(|| linalg::parallelism(false));
    assert!(par.pool);
    let calls = 3 * Backend::f32_candidates().len() as u64 + 2;
    for _ in 0..calls {
        p.install(|| {
            gemm_into(
                GemmDims { m, n, k },
                &mut dst,
                GemmOut::overwrite(n),
                Strided::rows(&a, k),
                Strided::rows(&b, n),
                1.0,
                par,
            )
        });
    }
    let stats = backend::stats();
    let (key, s) = stats.iter().find(|(key, _)| (key.m, key.k, key.n) == (m, k, n)).expect("shape recorded");
    assert_eq!(s.calls, calls);
    assert_eq!(s.probe.len(), Backend::f32_candidates().len(), "every candidate timed in the first calls");
    let best = s.probe.iter().max_by(|x, y| x.1.total_cmp(&y.1)).map(|x| x.0);
    assert_eq!(s.backend, best, "the fastest candidate is used");
    assert!(s.gflops(key) > 0.0);
    // The choice is cached for the next process on this machine.
    let path = backend::cache_path().expect("cache path");
    let text = std::fs::read_to_string(&path).expect("cache written");
    assert!(text.contains("256x128x192nn"), "{text}");
    let _ = std::fs::remove_dir_all(&dir);
    let _: Par = par;
}

/// Every combination of small and large sides and depths around the `gemm`
/// crate's own thresholds (64-wide small path, kc ≥ 512, vector paths).
#[test]
fn split_is_bit_identical_around_the_gemm_crates_thresholds() {
    let one = pool(1);
    let p = pool(2);
    let mut bad = Vec::new();
    for &m in &[1usize, 4, 16, 64, 65, 128, 130, 257, 688] {
        for &n in &[1usize, 4, 16, 62, 64, 128, 255, 688] {
            for &k in &[1usize, 2, 3, 8, 16, 32, 513, 688, 1500] {
                for (lhs_t, rhs_t) in [(false, false), (false, true), (true, false)] {
                    let c = Case { m, n, k, lhs_t, rhs_t };
                    let base = one.install(|| c.run(Backend::Crate, true));
                    for b in [Backend::Crate, Backend::Split] {
                        let got = p.install(|| c.run(b, true));
                        if !base.iter().zip(&got).all(|(x, y)| x.to_bits() == y.to_bits()) {
                            bad.push(format!("{b:?} {m}x{k}x{n} {lhs_t} {rhs_t}"));
                        }
                    }
                }
            }
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// A shape seen first with bf16 operands must not hand its backend to f32
/// calls of the same shape (a bug once: the key lacked the operand type,
/// and an f32 GEMM ran on the bf16 kernel).
#[test]
fn f32_calls_of_a_shape_first_seen_in_bf16_stay_f32() {
    // Its f32 calls are probed: keep the cache out of $HOME (as the probe
    // test does; whichever runs first names the directory for both).
    std::env::set_var(
        "MACROBATCH_CACHE_DIR",
        std::env::temp_dir().join(format!("linalg-probe-{}", std::process::id())),
    );
    let p = pool(2);
    let (m, k, n) = (96, 80, 200);
    let (a, b) = (data(m * k, 6), data(k * n, 7));
    let (l, r) = (Strided::rows(&a, k), Strided::rows(&b, n));
    let bf16 = p.install(|| linalg::parallelism(false).with(linalg::Operands::Bf16));
    let f32p = p.install(|| linalg::parallelism(false));
    let mut dst = vec![0.0f32; m * n];
    for _ in 0..2 {
        p.install(|| gemm_into(GemmDims { m, n, k }, &mut dst, GemmOut::overwrite(n), l, r, 1.0, bf16));
    }
    // What each f32 backend of this build gives (OpenBLAS, when built, sums
    // in its own order and may be the one a probe call runs).
    let wants: Vec<Vec<f32>> = Backend::f32_candidates()
        .into_iter()
        .map(|backend| {
            let mut want = vec![0.0f32; m * n];
            p.install(|| {
                let call =
                    Call { m, n, k, dst: want.as_mut_ptr(), dst_rs: n, accumulate: false, lhs: l, rhs: r, alpha: 1.0 };
                // SAFETY: `want` is m × n; the views are in bounds.
                unsafe { backend::run(backend, &call) }
            });
            want
        })
        .collect();
    for _ in 0..8 {
        p.install(|| gemm_into(GemmDims { m, n, k }, &mut dst, GemmOut::overwrite(n), l, r, 1.0, f32p));
        let same = |w: &Vec<f32>| dst.iter().zip(w).all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(wants.iter().any(same), "f32 call ran another kernel");
    }
    let stats = backend::stats();
    let f32_key = stats.iter().find(|(key, _)| (key.m, key.k, key.n, key.bf16) == (m, k, n, false)).expect("f32 key");
    assert_ne!(f32_key.1.backend, Some(Backend::Bf16));
}
