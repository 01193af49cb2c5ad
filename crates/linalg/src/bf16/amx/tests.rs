//! The AMX kernel's tests: its blocking and packing bit for bit with
//! emulated tiles (any CPU with AVX512-BF16), its instructions against f64,
//! `vdpbf16ps` and themselves (a CPU with AMX). Shared helpers: the bf16
//! kernels' tests.

use super::super::tests::{bf16_round, layout, rand_vec, run_case_on, Case};
use super::*;

/// The cases the AMX tests run: edges of its 32 × 32 tiles and of its
/// 16-pair depth, several k blocks (`KCP` pairs each), row blocks (`MC`),
/// both paths of its `A` packing (columns contiguous or not).
fn amx_cases() -> Vec<Case> {
    let mut v = Vec::new();
    let shapes = [
        (1usize, 1usize, 1usize),
        (31, 33, 31),
        (32, 32, 32),
        (33, 31, 33),
        (17, 70, 64),
        (70, 17, 65),
        (200, 45, 2 * 2 * KCP + 3),
        (5, 300, 700),
        (MC + 5, 40, 100),
    ];
    for (s, &(m, n, k)) in shapes.iter().enumerate() {
        for lk in 0..4u8 {
            let rk = (s as u8 + lk) % 4;
            // alpha 1 without accumulation: whole blocks stored by the tiles.
            let alpha = if lk % 2 == 0 { 1.0 } else { 0.75 };
            v.push(Case { m, n, k, lhs_kind: lk, rhs_kind: rk, accumulate: (s + lk as usize) % 2 == 1, alpha });
        }
    }
    v
}

/// The AMX kernel's blocking and packing, with the tile operations
/// emulated ([`Emulated`]), on any CPU with AVX512-BF16 (the packing's
/// instructions): every element bit for bit equal to the emulated dot
/// product applied to its own row of `A` and column of `B`, 16 pairs at a
/// time from `+0`, and written as `alpha · S` or `fma(alpha, S, dst)` —
/// so a packing or blocking slip (a pair from the wrong k block, a row of
/// the wrong tile, a pad not zero) shows as a wrong bit, whatever the tile
/// unit. Also within the f64 bound of [`run_case`], and the same bits on one
/// thread and on the pool.
#[test]
fn amx_blocking_and_packing_exact_with_emulated_tiles() {
    if !super::super::detect() {
        eprintln!("no AVX512-BF16 here: the AMX kernel's packing cannot run (every AMX CPU has it)");
        return;
    }
    for (s, c) in amx_cases().iter().enumerate() {
        let seed = 100 + s as u64;
        let got = run_case_on(Some(gemm_emulated), c, false, seed);
        let pooled = run_case_on(Some(gemm_emulated), c, true, seed);
        assert!(got.iter().zip(&pooled).all(|(x, y)| x.to_bits() == y.to_bits()), "pool vs one thread");
        // The reference: the same operands, one element at a time.
        let (m, n, k) = (c.m, c.n, c.k);
        let (a, ao, ars, acs) = layout(m, k, c.lhs_kind, seed);
        let (b, bo, brs, bcs) = layout(k, n, c.rhs_kind, seed + 1);
        let dst_rs = n + 7;
        let dst0 = rand_vec(m * dst_rs + 3, seed + 2);
        let bits = |x: f32| super::super::portable::round(x).to_bits() >> 16;
        let pair = |v: &dyn Fn(usize) -> f32, p: usize| {
            let at = |kk: usize| if kk < k { bits(v(kk)) } else { 0 };
            at(2 * p) | (at(2 * p + 1) << 16)
        };
        for i in 0..m {
            for j in 0..n {
                let row = |kk: usize| a[ao + i * ars + kk * acs];
                let col = |kk: usize| b[bo + kk * brs + j * bcs];
                let mut acc = 0f32;
                for p0 in (0..k.div_ceil(2)).step_by(16) {
                    acc = Emulated::dot_element(acc, |p| pair(&row, p0 + p), |p| pair(&col, p0 + p));
                }
                let want = if c.accumulate { c.alpha.mul_add(acc, dst0[i * dst_rs + j]) } else { c.alpha * acc };
                assert_eq!(
                    got[i * dst_rs + j].to_bits(),
                    want.to_bits(),
                    "({i},{j}) of {m}x{n}x{k} kinds {} {}",
                    c.lhs_kind,
                    c.rhs_kind
                );
            }
        }
    }
}

/// The AMX kernel on the hardware (where `/proc/cpuinfo` lists `amx_bf16`:
/// CI sets `MACROBATCH_REQUIRE_AMX=1` there, so it cannot skip): within the
/// f64 bound of [`run_case`] (the bound holds for any order of the f32
/// additions, and the hardware's order is its own); against the `vdpbf16ps`
/// kernel, within the sum of both bounds (`2·k·2⁻²⁴·|alpha|·Σ|a·b|`, plus
/// twice the final rounding); and bit for bit the same on one thread and
/// on pools of 1, 2 and 3 threads, and for any row alone.
#[test]
fn amx_kernel_against_f64_vdpbf16ps_and_itself() {
    let required = std::env::var("MACROBATCH_REQUIRE_AMX").as_deref() == Ok("1");
    if !detect() {
        assert!(!required, "MACROBATCH_REQUIRE_AMX=1 but AMX is not detected (or Linux refused tile data)");
        eprintln!("no AMX here: the AMX kernel's instructions are not run (its blocking is, with emulated tiles)");
        return;
    }
    let (mut differ, mut total) = (0usize, 0usize);
    for (s, c) in amx_cases().iter().enumerate() {
        let seed = 300 + s as u64;
        let amx = run_case_on(Some(gemm), c, false, seed);
        let avx = run_case_on(Some(super::super::hardware::gemm), c, false, seed);
        let (m, n, k) = (c.m, c.n, c.k);
        let (a, ao, ars, acs) = layout(m, k, c.lhs_kind, seed);
        let (b, bo, brs, bcs) = layout(k, n, c.rhs_kind, seed + 1);
        let dst_rs = n + 7;
        for i in 0..m {
            for j in 0..n {
                let sabs: f64 = (0..k)
                    .map(|p| (bf16_round(a[ao + i * ars + p * acs]) * bf16_round(b[bo + p * brs + j * bcs])).abs())
                    .sum();
                let (x, y) = (amx[i * dst_rs + j] as f64, avx[i * dst_rs + j] as f64);
                let tol =
                    2.0 * (k as f64 * 6e-8) * (c.alpha.abs() as f64 * sabs) + 2.4e-7 * x.abs().max(y.abs()) + 1e-30;
                assert!((x - y).abs() <= tol, "({i},{j}) of {m}x{n}x{k}: AMX {x} vs vdpbf16ps {y}");
                differ += usize::from(x.to_bits() != y.to_bits());
                total += 1;
            }
        }
        for threads in [1usize, 2, 3] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("pool");
            let p = pool.install(|| run_case_on(Some(gemm), c, true, seed));
            assert!(amx.iter().zip(&p).all(|(x, y)| x.to_bits() == y.to_bits()), "{m}x{n}x{k}: {threads} threads");
        }
    }
    eprintln!("AMX vs vdpbf16ps: {differ} of {total} elements differ in their bits (all within the bound)");
    // One row alone, and a block of rows, give that row's bits.
    let (m, n, k) = (70usize, 90usize, 1500usize);
    let a = rand_vec(m * k, 11);
    let b = rand_vec(k * n, 12);
    let run = |i0: usize, rows: usize| {
        let mut d = vec![0f32; rows * n];
        let call = crate::Call {
            m: rows,
            n,
            k,
            dst: d.as_mut_ptr(),
            dst_rs: n,
            accumulate: false,
            lhs: Strided { data: &a, offset: i0 * k, rs: k, cs: 1 },
            rhs: Strided::rows(&b, n),
            alpha: 1.0,
        };
        // SAFETY: d holds rows × n; the views hold the operands; AMX detected.
        unsafe { gemm(&call, true) };
        d
    };
    let full = run(0, m);
    for (i0, rows) in [(0usize, 1usize), (33, 1), (69, 1), (5, 40)] {
        assert_eq!(run(i0, rows), full[i0 * n..(i0 + rows) * n], "rows {i0}..{}", i0 + rows);
    }
}
