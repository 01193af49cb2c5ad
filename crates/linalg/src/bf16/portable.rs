//! The bf16 kernel's arithmetic without AVX512-BF16: the same bits on any
//! CPU.
//!
//! Intel's definition of `vdpbf16ps` (SDM, "VDPBF16PS"): each f32 lane `j`
//! of the accumulator takes, per k pair, two FP32 fused multiply-adds with
//! DAZ on the inputs, FTZ on the output and round-to-nearest-even, the odd
//! element of the pair first:
//!
//! ```text
//! acc[j] = ftz(fma(a[2p+1], b[2p+1], acc[j]))
//! acc[j] = ftz(fma(a[2p],   b[2p],   acc[j]))
//! ```
//!
//! The operands were rounded to bf16 by `vcvtne2ps2bf16` (nearest even,
//! denormals to signed zero, NaN quieted). This module does exactly that
//! with ordinary f32 FMAs: operands are rounded while packing ([`round`]),
//! the pairs' halves are laid out odd first, every FMA result below 2⁻¹²⁶ in
//! magnitude is flushed to a zero of its sign, and an odd `k` gets the same
//! zero pad as the hardware kernel's last pair (which turns an accumulated
//! `-0` into `+0`, as the instruction does). The accumulator starts at `+0`
//! and is written back as `alpha · S` or `fma(alpha, S, dst)`, as the
//! hardware kernel writes it. So every element has the hardware kernel's
//! bits (tested bit for bit where the CPU has the instruction), whatever the
//! shape, split or thread count.
//!
//! Blocking is simple: `n` in chunks whose packed `B` holds at most 32 MiB
//! (packed once, shared), `MR × NR` tiles over all of `k` (`Tile`: on
//! AVX-512 or AVX2 lanes where the CPU has them, the same bits), tasks of
//! row panels (or of column panels when `m` is short) on the rayon pool.
//! Measured with `cargo run --release -p macrobatch-linalg --example
//! bf16_gemm 1 1024x256x768` under `MACROBATCH_BF16=portable` on 2 cores of
//! a Zen 4 EPYC: 3.3 GFLOP/s with the plain loop (LLVM vectorised it across
//! `k` with gathers), 58 (AVX-512) and 61 (AVX2) with `MR = 8`, 42 with 6;
//! the hardware kernel 248.

use crate::{with_buf, Call, SendCall};
use rayon::prelude::*;
use std::cell::Cell;

/// Microkernel rows.
const MR: usize = 8;
/// Microkernel columns.
const NR: usize = 16;
/// Bytes of packed `B` per column chunk (small in tests, to cover several).
const B_CHUNK_BYTES: usize = if cfg!(test) { 64 << 10 } else { 32 << 20 };
/// Below this many flops, one thread.
const MIN_PAR_FLOPS: usize = 1 << 22;
/// Tasks per thread when splitting over the pool.
const TASKS_PER_THREAD: usize = 4;

thread_local! {
    static PACK_B: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
    static PACK_A: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
}

/// `x` rounded to bf16 as `vcvtne2ps2bf16` rounds it, returned as the f32
/// of the same value: nearest even; a denormal input becomes a zero of its
/// sign (DAZ); NaN stays NaN (quieted).
#[inline(always)]
pub fn round(x: f32) -> f32 {
    let b = x.to_bits();
    if b & 0x7f80_0000 == 0 {
        return f32::from_bits(b & 0x8000_0000);
    }
    if x.is_nan() {
        return f32::from_bits((b | 0x0040_0000) & 0xffff_0000);
    }
    f32::from_bits(b.wrapping_add(0x7fff + ((b >> 16) & 1)) & 0xffff_0000)
}

/// A result below the normal range becomes a zero of its sign (FTZ).
#[inline(always)]
fn ftz(x: f32) -> f32 {
    let b = x.to_bits();
    // A zero exponent field: a denormal (or already a zero).
    f32::from_bits(if b & 0x7f80_0000 == 0 { b & 0x8000_0000 } else { b })
}

/// Position of value `kk` of `k` in the packed order: pairs in order, the
/// odd element of each pair first.
#[inline(always)]
fn slot(kk: usize) -> usize {
    kk ^ 1
}

/// Packs columns `j0 .. j0 + nr` (`nr ≤ NR`) of `rhs`, all `k`, into one
/// panel of `2·kp × NR` rounded values (zero past `k` and past `nr`).
fn pack_b_panel(out: &mut [f32], call: &Call<'_>, j0: usize, nr: usize) {
    let (k, rhs) = (call.k, &call.rhs);
    out.fill(0.0);
    for kk in 0..k {
        let row = &mut out[slot(kk) * NR..][..nr];
        let at = rhs.offset + kk * rhs.rs + j0 * rhs.cs;
        for (j, o) in row.iter_mut().enumerate() {
            *o = round(rhs.data[at + j * rhs.cs]);
        }
    }
}

/// Packs rows `i0 .. i0 + mr` (`mr ≤ MR`) of `lhs`, all `k`, into one panel
/// of `2·kp × MR` rounded values (zero past `k` and past `mr`).
fn pack_a_panel(out: &mut [f32], call: &Call<'_>, i0: usize, mr: usize) {
    let (k, lhs) = (call.k, &call.lhs);
    out.fill(0.0);
    for i in 0..mr {
        let at = lhs.offset + (i0 + i) * lhs.rs;
        for kk in 0..k {
            out[slot(kk) * MR + i] = round(lhs.data[at + kk * lhs.cs]);
        }
    }
}

/// One implementation of the `MR × NR` tile: the same FMAs and flushes in
/// the same order, so the same bits (each lane is one output element; lanes
/// never mix). The SIMD ones are written with intrinsics because LLVM
/// vectorises the plain loop across `k` with gathers and scatters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Tile {
    /// Plain Rust, any CPU.
    Scalar,
    /// Eight lanes (AVX2 + FMA), the tile's two column halves in turn.
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// Sixteen lanes (AVX-512 F): one register per row.
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

impl Tile {
    /// Every implementation this CPU can run, the fastest last.
    pub(crate) fn available() -> Vec<Tile> {
        let mut v = vec![Tile::Scalar];
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                v.push(Tile::Avx2);
            }
            if is_x86_feature_detected!("avx512f") {
                v.push(Tile::Avx512);
            }
        }
        v
    }

    /// The fastest implementation this CPU can run.
    pub(crate) fn best() -> Tile {
        static BEST: std::sync::OnceLock<Tile> = std::sync::OnceLock::new();
        *BEST.get_or_init(|| *Tile::available().last().expect("Scalar is always available"))
    }

    /// `acc` after the FMAs of `2·kp` packed values of `a` (`MR` per step)
    /// and `b` (`NR` per step), in the instruction's order.
    fn run(self, a: &[f32], b: &[f32], acc: &mut [[f32; NR]; MR]) {
        match self {
            Tile::Scalar => tile_scalar(a, b, acc),
            // SAFETY: `available` offered this variant only where the CPU
            // has its features.
            #[cfg(target_arch = "x86_64")]
            Tile::Avx2 => unsafe { simd::tile_avx2(a, b, acc) },
            // SAFETY: as above.
            #[cfg(target_arch = "x86_64")]
            Tile::Avx512 => unsafe { simd::tile_avx512(a, b, acc) },
        }
    }
}

/// The tile's definition: per step, per row `i` and column `j`,
/// `acc[i][j] = ftz(fma(a[i], b[j], acc[i][j]))`.
fn tile_scalar(a: &[f32], b: &[f32], acc: &mut [[f32; NR]; MR]) {
    for (av, bv) in a.chunks_exact(MR).zip(b.chunks_exact(NR)) {
        for (row, &x) in acc.iter_mut().zip(av) {
            for (c, &y) in row.iter_mut().zip(bv) {
                *c = ftz(x.mul_add(y, *c));
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod simd {
    //! [`super::tile_scalar`] on 8 and 16 lanes. The flush: a result whose
    //! exponent field is zero keeps only its sign bit, as [`super::ftz`].

    use super::{MR, NR};
    use std::arch::x86_64::*;

    /// # Safety
    /// The CPU has AVX2 and FMA; `a` and `b` hold the same number of steps.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn tile_avx2(a: &[f32], b: &[f32], acc: &mut [[f32; NR]; MR]) {
        let expo = _mm256_set1_epi32(0x7f80_0000);
        let sign = _mm256_set1_epi32(i32::MIN);
        let zero = _mm256_setzero_si256();
        for half in 0..NR / 8 {
            // SAFETY: each row has NR = 16 values; columns 8·half .. +8.
            let mut c: [__m256; MR] = std::array::from_fn(|i| unsafe { _mm256_loadu_ps(acc[i][8 * half..].as_ptr()) });
            for (av, bv) in a.chunks_exact(MR).zip(b.chunks_exact(NR)) {
                // SAFETY: bv has NR values.
                let y = unsafe { _mm256_loadu_ps(bv[8 * half..].as_ptr()) };
                for (c, &x) in c.iter_mut().zip(av) {
                    let r = _mm256_castps_si256(_mm256_fmadd_ps(_mm256_set1_ps(x), y, *c));
                    let tiny = _mm256_cmpeq_epi32(_mm256_and_si256(r, expo), zero);
                    *c = _mm256_castsi256_ps(_mm256_blendv_epi8(r, _mm256_and_si256(r, sign), tiny));
                }
            }
            for (row, c) in acc.iter_mut().zip(c) {
                // SAFETY: as the loads.
                unsafe { _mm256_storeu_ps(row[8 * half..].as_mut_ptr(), c) };
            }
        }
    }

    /// # Safety
    /// The CPU has AVX-512 F; `a` and `b` hold the same number of steps.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn tile_avx512(a: &[f32], b: &[f32], acc: &mut [[f32; NR]; MR]) {
        let expo = _mm512_set1_epi32(0x7f80_0000);
        let sign = _mm512_set1_epi32(i32::MIN);
        // SAFETY: each row has NR = 16 values.
        let mut c: [__m512; MR] = std::array::from_fn(|i| unsafe { _mm512_loadu_ps(acc[i].as_ptr()) });
        for (av, bv) in a.chunks_exact(MR).zip(b.chunks_exact(NR)) {
            // SAFETY: bv has NR values.
            let y = unsafe { _mm512_loadu_ps(bv.as_ptr()) };
            for (c, &x) in c.iter_mut().zip(av) {
                let r = _mm512_castps_si512(_mm512_fmadd_ps(_mm512_set1_ps(x), y, *c));
                let normal = _mm512_test_epi32_mask(r, expo);
                *c = _mm512_castsi512_ps(_mm512_mask_mov_epi32(_mm512_and_si512(r, sign), normal, r));
            }
        }
        for (row, c) in acc.iter_mut().zip(c) {
            // SAFETY: as the loads.
            unsafe { _mm512_storeu_ps(row.as_mut_ptr(), c) };
        }
    }
}

/// Rows `r0 .. r1` × panels `q0 .. q1` of the packed chunk `b` (first
/// column `jc`).
///
/// # Safety
/// No other thread writes this block of `dst`; `dst` is valid for the
/// caller's `m × n` block.
unsafe fn block(tile: Tile, call: &Call<'_>, b: &[f32], jc: usize, (r0, r1): (usize, usize), (q0, q1): (usize, usize)) {
    let kk2 = 2 * call.k.div_ceil(2);
    with_buf(&PACK_A, kk2 * MR, |a| {
        for row in (r0..r1).step_by(MR) {
            let mr = MR.min(r1 - row);
            pack_a_panel(a, call, row, mr);
            for q in q0..q1 {
                let col = jc + q * NR;
                let nr = NR.min(call.n - col);
                let mut acc = [[0f32; NR]; MR];
                tile.run(a, &b[q * kk2 * NR..][..kk2 * NR], &mut acc);
                for (i, r) in acc.iter().enumerate().take(mr) {
                    // SAFETY: row + i < r1 ≤ m and col + nr ≤ n: inside the
                    // caller's block, written by this task only.
                    let d = unsafe { std::slice::from_raw_parts_mut(call.dst.add((row + i) * call.dst_rs + col), nr) };
                    for (o, &s) in d.iter_mut().zip(r) {
                        *o = if call.accumulate { call.alpha.mul_add(s, *o) } else { call.alpha * s };
                    }
                }
            }
        }
    });
}

/// `dst (+)= alpha · bf16(lhs) · bf16(rhs)` with the bits of the
/// AVX512-BF16 kernel.
///
/// # Safety
/// As [`crate::gemm_raw`] (views checked, `k > 0`).
pub(crate) unsafe fn gemm(call: &Call<'_>, pool: bool) {
    // SAFETY: as this function's.
    unsafe { gemm_with(Tile::best(), call, pool) }
}

/// [`gemm`] with the tile implementation `tile` (one of
/// [`Tile::available`]).
///
/// # Safety
/// As [`gemm`].
pub(crate) unsafe fn gemm_with(tile: Tile, call: &Call<'_>, pool: bool) {
    let (m, n, k) = (call.m, call.n, call.k);
    let kk2 = 2 * k.div_ceil(2);
    let flops = 2usize.saturating_mul(m).saturating_mul(n).saturating_mul(k);
    let threads = if pool && flops >= MIN_PAR_FLOPS { rayon::current_num_threads().max(1) } else { 1 };
    let nc = ((B_CHUNK_BYTES / 4 / kk2) / NR).max(1) * NR;
    let nc = nc.min(n.next_multiple_of(NR));
    let pr = &SendCall(*call);
    let mt = m.div_ceil(MR);
    with_buf(&PACK_B, kk2 * nc, |bbuf| {
        for jc in (0..n).step_by(nc) {
            let np = (n.min(jc + nc) - jc).div_ceil(NR);
            let b = &mut bbuf[..np * kk2 * NR];
            let pack = |(q, panel): (usize, &mut [f32])| {
                let pr: &SendCall<'_> = pr;
                let j0 = jc + q * NR;
                pack_b_panel(panel, &pr.0, j0, NR.min(n - j0));
            };
            if threads > 1 {
                b.par_chunks_mut(kk2 * NR).enumerate().for_each(pack);
            } else {
                b.chunks_mut(kk2 * NR).enumerate().for_each(pack);
            }
            let b = &*b;
            if threads == 1 {
                // SAFETY: the whole block is this thread's.
                unsafe { block(tile, &pr.0, b, jc, (0, m), (0, np)) };
            } else if mt >= 2 * threads {
                let per = mt.div_ceil(threads * TASKS_PER_THREAD);
                (0..mt.div_ceil(per)).into_par_iter().for_each(|t| {
                    let pr: &SendCall<'_> = pr;
                    // SAFETY: tasks own disjoint row ranges.
                    unsafe { block(tile, &pr.0, b, jc, (t * per * MR, ((t + 1) * per * MR).min(m)), (0, np)) };
                });
            } else {
                let per = np.div_ceil(threads * TASKS_PER_THREAD);
                (0..np.div_ceil(per)).into_par_iter().for_each(|t| {
                    let pr: &SendCall<'_> = pr;
                    // SAFETY: tasks own disjoint panel ranges.
                    unsafe { block(tile, &pr.0, b, jc, (0, m), (t * per, ((t + 1) * per).min(np))) };
                });
            }
        }
    });
}
