use super::*;
use crate::{GemmDims, GemmOut, Strided};
use proptest::prelude::*;

/// bf16 rounding to nearest even, as `vcvtne2ps2bf16` (NaN stays NaN).
pub(super) fn bf16_round(x: f32) -> f64 {
    if x.is_nan() {
        return f64::NAN;
    }
    let b = x.to_bits();
    let r = (b.wrapping_add(0x7fff + ((b >> 16) & 1))) & 0xffff_0000;
    f32::from_bits(r) as f64
}

/// A deterministic pseudo-random f32 in [-1, 1).
pub(super) fn rand_vec(len: usize, seed: u64) -> Vec<f32> {
    let mut next = xorshift(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    (0..len).map(|_| ((next() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0).collect()
}

/// A xorshift64 stream from the (odd) state `s`.
fn xorshift(mut s: u64) -> impl FnMut() -> u64 {
    move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    }
}

/// A matrix of `rows × cols` in one of four layouts, with padding:
/// 0 row-major, 1 transposed storage, 2 row-major sub-view (rs > cols,
/// offset), 3 transposed sub-view.
pub(super) fn layout(rows: usize, cols: usize, kind: u8, seed: u64) -> (Vec<f32>, usize, usize, usize) {
    let (pad, off) = if kind >= 2 { (3, 5) } else { (0, 0) };
    if kind.is_multiple_of(2) {
        let rs = cols + pad;
        (rand_vec(off + rows.max(1) * rs, seed), off, rs, 1)
    } else {
        let cs = rows + pad;
        (rand_vec(off + cols.max(1) * cs, seed), off, 1, cs)
    }
}

pub(super) struct Case {
    pub(super) m: usize,
    pub(super) n: usize,
    pub(super) k: usize,
    pub(super) lhs_kind: u8,
    pub(super) rhs_kind: u8,
    pub(super) accumulate: bool,
    pub(super) alpha: f32,
}

/// A kernel called directly: `(call, pool)` as [`super::gemm`] takes them.
pub(super) type KernelFn = unsafe fn(&crate::Call<'_>, bool);

/// Runs one case through `gemm_into` and checks it against an f64
/// reference on bf16-rounded operands. Returns dst (with padding).
fn run_case(c: &Case, pool: bool, seed: u64) -> Vec<f32> {
    run_case_on(None, c, pool, seed)
}

/// As [`run_case`], through `kernel` (called directly) instead of
/// `gemm_into` where it is given.
pub(super) fn run_case_on(kernel: Option<KernelFn>, c: &Case, pool: bool, seed: u64) -> Vec<f32> {
    let (m, n, k) = (c.m, c.n, c.k);
    let (a, ao, ars, acs) = layout(m, k, c.lhs_kind, seed);
    let (b, bo, brs, bcs) = layout(k, n, c.rhs_kind, seed + 1);
    let lhs = Strided { data: &a, offset: ao, rs: ars, cs: acs };
    let rhs = Strided { data: &b, offset: bo, rs: brs, cs: bcs };
    let dst_rs = n + 7;
    let dst0 = rand_vec(m * dst_rs + 3, seed + 2);
    let mut dst = dst0.clone();
    match kernel {
        Some(f) => {
            let call = crate::Call {
                m,
                n,
                k,
                dst: dst.as_mut_ptr(),
                dst_rs,
                accumulate: c.accumulate,
                lhs,
                rhs,
                alpha: c.alpha,
            };
            // SAFETY: dst holds the m × n block (row stride dst_rs); the
            // views hold the operands; the caller picked a kernel this CPU runs.
            unsafe { f(&call, pool) };
        }
        None => crate::gemm_into(
            GemmDims { m, n, k },
            &mut dst,
            GemmOut { offset: 0, rs: dst_rs, accumulate: c.accumulate },
            lhs,
            rhs,
            c.alpha,
            crate::Par { pool, operands: crate::Operands::Bf16 },
        ),
    }
    for i in 0..m {
        for j in 0..n {
            let (mut s, mut sabs) = (0f64, 0f64);
            for p in 0..k {
                let x = bf16_round(a[ao + i * ars + p * acs]) * bf16_round(b[bo + p * brs + j * bcs]);
                s += x;
                sabs += x.abs();
            }
            let base = if c.accumulate { dst0[i * dst_rs + j] as f64 } else { 0.0 };
            let want = base + c.alpha as f64 * s;
            let got = dst[i * dst_rs + j] as f64;
            // f32 accumulation of k products: error ≲ k·2⁻²⁴·Σ|a·b|
            // in the worst case, in any order of the additions (each
            // product passes through at most k of them), ~√k·2⁻²⁴
            // typically; plus the final rounding of the result (relative
            // 2⁻²⁴ of |want|).
            let tol = (k as f64 * 6e-8 + 1e-6) * (c.alpha.abs() as f64 * sabs) + 1e-6 * want.abs() + 1e-30;
            assert!(
                (got - want).abs() <= tol,
                "m {m} n {n} k {k} lhs {} rhs {} acc {} alpha {}: ({i},{j}) got {got} want {want}",
                c.lhs_kind,
                c.rhs_kind,
                c.accumulate,
                c.alpha
            );
        }
        for j in n..dst_rs {
            if i * dst_rs + j < dst.len() {
                assert_eq!(dst[i * dst_rs + j].to_bits(), dst0[i * dst_rs + j].to_bits(), "padding touched");
            }
        }
    }
    for j in m * dst_rs..dst.len() {
        assert_eq!(dst[j].to_bits(), dst0[j].to_bits(), "tail touched");
    }
    dst
}

fn skip() -> bool {
    skip_without_bf16("bf16 GEMM test")
}

#[test]
fn shapes_and_layouts() {
    if skip() {
        return;
    }
    let dims = [1usize, 2, 11, 12, 13, 31, 33, 70];
    let ks = [1usize, 2, 3, 17, 32, 33, 64];
    let mut seed = 1;
    for &m in &dims {
        for &n in &dims {
            for &k in &ks {
                seed += 1;
                let kinds = ((seed % 4) as u8, ((seed / 4) % 4) as u8);
                let c = Case {
                    m,
                    n,
                    k,
                    lhs_kind: kinds.0,
                    rhs_kind: kinds.1,
                    accumulate: seed % 3 == 0,
                    alpha: if seed % 5 == 0 { -0.75 } else { 1.0 },
                };
                run_case(&c, false, seed);
            }
        }
    }
}

#[test]
fn multiple_k_blocks_all_layouts() {
    if skip() {
        return;
    }
    // k > KC = 2·KCP, odd, and m, n not multiples of MR, NR or MC.
    for (s, &(m, n, k)) in [(205usize, 77usize, 1101usize), (13, 290, 1025), (40, 40, 2 * 512 + 2)].iter().enumerate() {
        for lk in 0..4 {
            for rk in 0..4 {
                let c = Case { m, n, k, lhs_kind: lk, rhs_kind: rk, accumulate: (lk + rk) % 2 == 1, alpha: 0.5 };
                run_case(&c, true, (s * 16) as u64 + (lk * 4 + rk) as u64);
            }
        }
    }
}

#[test]
fn deterministic_across_threads_and_pool() {
    if skip() {
        return;
    }
    // Big enough to go parallel (2·m·n·k ≥ MIN_PAR_FLOPS), both row and
    // column splits.
    for &(m, n, k) in &[(300usize, 200usize, 1030usize), (20, 1000, 600), (1, 12000, 800), (530, 1, 16000)] {
        for accumulate in [false, true] {
            let c = Case { m, n, k, lhs_kind: 1, rhs_kind: 2, accumulate, alpha: 1.25 };
            let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().expect("pool");
            let two = rayon::ThreadPoolBuilder::new().num_threads(2).build().expect("pool");
            let three = rayon::ThreadPoolBuilder::new().num_threads(3).build().expect("pool");
            let serial = run_case(&c, false, 9);
            let p1 = one.install(|| run_case(&c, true, 9));
            let p2 = two.install(|| run_case(&c, true, 9));
            let p3 = three.install(|| run_case(&c, true, 9));
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&serial), bits(&p1));
            assert_eq!(bits(&serial), bits(&p2));
            assert_eq!(bits(&serial), bits(&p3));
        }
    }
}

#[test]
fn result_does_not_depend_on_position() {
    if skip() {
        return;
    }
    // Row i of a big product equals the 1-row product of row i alone.
    let (m, n, k) = (50usize, 70usize, 1200usize);
    let a = rand_vec(m * k, 3);
    let b = rand_vec(k * n, 4);
    let mut full = vec![0f32; m * n];
    let par = crate::Par { pool: true, operands: crate::Operands::Bf16 };
    crate::gemm_into(
        GemmDims { m, n, k },
        &mut full,
        GemmOut::overwrite(n),
        Strided::rows(&a, k),
        Strided::rows(&b, n),
        1.0,
        par,
    );
    for i in [0usize, 13, 49] {
        let mut row = vec![0f32; n];
        let lhs = Strided { data: &a, offset: i * k, rs: k, cs: 1 };
        crate::gemm_into(GemmDims { m: 1, n, k }, &mut row, GemmOut::overwrite(n), lhs, Strided::rows(&b, n), 1.0, par);
        assert_eq!(row, full[i * n..(i + 1) * n]);
    }
}

#[test]
fn nan_and_infinity_propagate() {
    if skip() {
        return;
    }
    let (m, n, k) = (30usize, 40usize, 70usize);
    let mut a = rand_vec(m * k, 5);
    let b = rand_vec(k * n, 6);
    a[7 * k + 3] = f32::NAN;
    a[11 * k + 69] = f32::INFINITY;
    let mut dst = vec![0f32; m * n];
    let par = crate::Par { pool: false, operands: crate::Operands::Bf16 };
    crate::gemm_into(
        GemmDims { m, n, k },
        &mut dst,
        GemmOut::overwrite(n),
        Strided::rows(&a, k),
        Strided::rows(&b, n),
        1.0,
        par,
    );
    for i in 0..m {
        for j in 0..n {
            let x = dst[i * n + j];
            match i {
                7 => assert!(x.is_nan()),
                11 => assert!(x.is_infinite() && x.signum() == b[69 * n + j].signum()),
                _ => assert!(x.is_finite()),
            }
        }
    }
}

#[test]
fn long_k_bit_identical_to_one_row_at_a_time_on_the_pool() {
    if skip() {
        return;
    }
    // Three k blocks; transposed lhs (as dW = inpᵀ·dout).
    let (m, n, k) = (40usize, 90usize, 5001usize);
    let a = rand_vec(m * k, 7);
    let b = rand_vec(k * n, 8);
    let lhs = Strided::transposed(&a, m);
    let c = crate::Par { pool: true, operands: crate::Operands::Bf16 };
    let mut full = vec![0f32; m * n];
    crate::gemm_into(GemmDims { m, n, k }, &mut full, GemmOut::overwrite(n), lhs, Strided::rows(&b, n), 1.0, c);
    let two = rayon::ThreadPoolBuilder::new().num_threads(2).build().expect("pool");
    let rows: Vec<Vec<f32>> = two.install(|| {
        use rayon::prelude::*;
        (0..m)
            .into_par_iter()
            .map(|i| {
                let mut row = vec![0f32; n];
                let lhs_i = Strided { offset: i, ..lhs };
                let one = crate::Par { pool: false, ..c };
                crate::gemm_into(
                    GemmDims { m: 1, n, k },
                    &mut row,
                    GemmOut::overwrite(n),
                    lhs_i,
                    Strided::rows(&b, n),
                    1.0,
                    one,
                );
                row
            })
            .collect()
    });
    for (i, row) in rows.iter().enumerate() {
        assert_eq!(row[..], full[i * n..(i + 1) * n], "row {i}");
    }
}

/// Values that reach every corner of the instruction's arithmetic: O(1)
/// values, wide exponents (so sums cancel and round at every bit),
/// products below the normal range (FTZ), denormal operands (DAZ),
/// signed zeros, values that round to a bf16 tie, and now and then an
/// infinity or NaN.
fn nasty(len: usize, seed: u64) -> Vec<f32> {
    bits_from(seed, len, nasty_bits)
}

/// `len` values from `f(r)` of a xorshift stream seeded by `seed`.
fn bits_from(seed: u64, len: usize, f: fn(u64) -> u32) -> Vec<f32> {
    let mut next = xorshift(seed.wrapping_mul(0x2545_F491_4F6C_DD1D) | 1);
    (0..len).map(|_| f32::from_bits(f(next()))).collect()
}

/// One value of [`nasty`] from the random word `r`.
fn nasty_bits(r: u64) -> u32 {
    let sign = if r & 1 == 1 { 0x8000_0000u32 } else { 0 };
    let mant = ((r >> 8) as u32) & 0x007f_ffff;
    match (r >> 1) % 16 {
        0 => sign,                                                     // ±0
        1 => sign | mant,                                              // denormal
        2 => sign | (1 << 23) | mant,                                  // smallest exponent
        3 => sign | ((((r >> 40) % 20 + 1) as u32) << 23) | mant,      // products underflow
        4 => sign | ((127 + 2) << 23) | (mant & 0x007f_0000) | 0x8000, // a bf16 tie
        5 if (r >> 50).is_multiple_of(64) => sign | 0x7f80_0000,       // ±inf (rare)
        6 if (r >> 50).is_multiple_of(64) => 0x7fc0_1234,              // NaN (rare)
        7..=9 => sign | ((((r >> 40) % 60 + 97) as u32) << 23) | mant, // 2^-30 .. 2^29
        _ => sign | ((((r >> 40) % 6 + 124) as u32) << 23) | mant,     // O(1)
    }
}

/// Values whose products (2⁻¹³²‥2⁻¹²⁰) and running sums cross the bottom
/// of the normal range at every step, so the flush to zero (FTZ) of every
/// FMA result decides the outputs.
fn near_underflow(len: usize, seed: u64) -> Vec<f32> {
    bits_from(seed, len, |r| {
        let sign = if r & 1 == 1 { 0x8000_0000u32 } else { 0 };
        sign | ((((r >> 40) % 7 + 61) as u32) << 23) | (((r >> 8) as u32) & 0x007f_ffff)
    })
}

/// The portable kernel against the hardware's bits (where the CPU has
/// it) and against an exact model of the instruction's definition (two
/// f32 FMAs per pair, odd element first, DAZ/FTZ) everywhere, in each of its
/// tile implementations this CPU can run (scalar, AVX2, AVX-512).
#[test]
fn portable_kernel_has_the_instructions_bits() {
    let cases = [(1usize, 1usize, 1usize), (3, 5, 7), (12, 32, 64), (13, 33, 1025), (70, 40, 2051), (7, 200, 130)];
    for (c, &(m, n, k)) in cases.iter().enumerate() {
        for accumulate in [false, true] {
            for gen in [nasty, near_underflow] {
                let a = gen(m * k, 10 + c as u64);
                let b = gen(k * n, 20 + c as u64);
                let dst0 = rand_vec(m * n, 30 + c as u64);
                let run = |hardware: bool, pool: bool, tile: portable::Tile| {
                    let mut dst = dst0.clone();
                    let call = crate::Call {
                        m,
                        n,
                        k,
                        dst: dst.as_mut_ptr(),
                        dst_rs: n,
                        accumulate,
                        lhs: Strided::rows(&a, k),
                        rhs: Strided::rows(&b, n),
                        alpha: 0.75,
                    };
                    // SAFETY: dst holds the m × n block; the views hold the operands.
                    #[cfg(target_arch = "x86_64")]
                    if hardware {
                        unsafe { hardware::gemm(&call, pool) };
                        return dst;
                    }
                    let _ = hardware;
                    // SAFETY: as above.
                    unsafe { portable::gemm_with(tile, &call, pool) };
                    dst
                };
                let best = portable::Tile::best();
                let bits =
                    |v: &[f32]| v.iter().map(|x| if x.is_nan() { u32::MAX } else { x.to_bits() }).collect::<Vec<_>>();
                let port = run(false, false, portable::Tile::Scalar);
                for tile in portable::Tile::available() {
                    assert_eq!(
                        bits(&port),
                        bits(&run(false, false, tile)),
                        "{m}x{n}x{k}: the {tile:?} tile vs the scalar one"
                    );
                    assert_eq!(bits(&port), bits(&run(false, true, tile)), "{m}x{n}x{k}: {tile:?}, pool vs one thread");
                }
                // The definition, one element at a time.
                let r = portable::round;
                let ftz =
                    |x: f32| if x.abs() < f32::MIN_POSITIVE { f32::from_bits(x.to_bits() & 0x8000_0000) } else { x };
                for i in 0..m {
                    for j in 0..n {
                        let mut acc = 0f32;
                        for p in 0..k.div_ceil(2) {
                            let at = |kk: usize| if kk < k { (r(a[i * k + kk]), r(b[kk * n + j])) } else { (0.0, 0.0) };
                            let ((x1, y1), (x0, y0)) = (at(2 * p + 1), at(2 * p));
                            acc = ftz(x1.mul_add(y1, acc));
                            acc = ftz(x0.mul_add(y0, acc));
                        }
                        let want = if accumulate { 0.75f32.mul_add(acc, dst0[i * n + j]) } else { 0.75 * acc };
                        assert_eq!(bits(&[port[i * n + j]]), bits(&[want]), "({i},{j}) of {m}x{n}x{k}");
                    }
                }
                if detect() {
                    let hw = run(true, false, best);
                    let differ = bits(&hw).iter().zip(bits(&port)).filter(|(x, y)| **x != *y).count();
                    assert_eq!(
                        differ,
                        0,
                        "{m}x{n}x{k} acc {accumulate}: {differ} of {} elements differ from vdpbf16ps (first: {:?})",
                        m * n,
                        hw.iter().zip(&port).find(|(x, y)| x.to_bits() != y.to_bits())
                    );
                    assert_eq!(bits(&hw), bits(&run(true, true, best)), "hardware, pool vs one thread");
                } else {
                    eprintln!("no AVX512-BF16 here: the portable kernel checked against the definition only");
                }
            }
        }
    }
}

#[test]
fn rounding_matches_the_conversion_instruction() {
    let v = nasty(1 << 16, 99);
    for &x in &v {
        let want = if x.is_nan() {
            f32::from_bits((x.to_bits() | 0x0040_0000) & 0xffff_0000)
        } else if x.to_bits() & 0x7f80_0000 == 0 {
            f32::from_bits(x.to_bits() & 0x8000_0000)
        } else {
            half::bf16::from_f32(x).to_f32()
        };
        assert_eq!(portable::round(x).to_bits(), want.to_bits(), "{x:e}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn random_shapes(
        m in 1usize..40,
        n in 1usize..70,
        k in 1usize..80,
        lk in 0u8..4,
        rk in 0u8..4,
        accumulate: bool,
        alpha in -2.0f32..2.0,
        seed in 0u64..1000,
    ) {
        if supported() {
            let c = Case { m, n, k, lhs_kind: lk, rhs_kind: rk, accumulate, alpha };
            run_case(&c, seed % 2 == 0, seed);
        }
    }
}
