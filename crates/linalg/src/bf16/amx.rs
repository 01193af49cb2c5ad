//! The AMX kernel (`tdpbf16ps` on the tile matrix unit): bf16 operands, f32
//! accumulation, at about 5× the rate of `vdpbf16ps` on Sapphire Rapids.
//!
//! # Blocking
//!
//! `hardware::drive` packs `B` exactly as for the `vdpbf16ps`
//! kernel (panels of `NR = 32` columns, k pairs in order, `NR` u32 per
//! pair), with each panel's pairs padded with zeros to a multiple of 16 (one
//! tile's depth), and splits rows or panels into tasks. A task walks its
//! rows in blocks of at most [`MC`] and `k` in equal blocks of at most
//! [`KCP`] pairs (a multiple of 16), packs that block of `A` as 1 KiB tiles
//! (16 rows × 16 k pairs; rows past `m` zero), and
//! for each panel of `B` runs the microkernel on each 32-row tile.
//!
//! The microkernel holds a 32 × 32 block of f32 accumulators in four tiles
//! (`tmm0..3`, 16 × 16 each) and, per 32 values of `k`, loads two tiles of
//! `A` (`tmm4`, `tmm5`: rows 0–15 and 16–31) and two of `B` (`tmm6`, `tmm7`:
//! columns 0–15 and 16–31, read from the packed panel with a 128-byte row
//! stride) and issues the four `tdpbf16ps`. Its accumulators start at zero,
//! or are loaded from the scratch tile of the previous k block, and are
//! stored to the scratch tile (exact), from which the last k block writes
//! `alpha · S` or `fma(alpha, S, dst)` to `dst` through masked AVX-512
//! stores, as the `vdpbf16ps` kernel does — except a whole 32 × 32 block
//! with `alpha = 1` and no accumulation, stored by the tiles straight into
//! `dst` (`1 · S` is `S`: the same bits).
//!
//! # Determinism
//!
//! Every element of `dst` takes the same sequence whatever its tile, the
//! split or the thread count: its accumulator starts at `+0`, takes one
//! `tdpbf16ps` per 16 pairs of `k` (zero-padded past `k`: a function of `k`
//! only) in increasing `k`, passes through f32 scratch between k blocks
//! (exact), and is written once. `tdpbf16ps` computes each output element
//! from its own row of `A` and column of `B` only. The kernel is chosen per
//! process, not per shape, so a row's bits never depend on how many rows
//! its batch has.
//!
//! # Arithmetic
//!
//! `tdpbf16ps` adds 32 products of bf16 (exact in f32) to each f32
//! accumulator with round-to-nearest-even, DAZ and FTZ. The SDM writes it as
//! one FMA per element in turn, but Sapphire Rapids sums in another order:
//! ~30% of its elements differ in the last bits from that sequence (and
//! from `vdpbf16ps`). So the hardware is checked against an f64 reference
//! with the error bound of any order of f32 additions (the tests), and the
//! blocking and packing, which decide which products meet in which
//! accumulator, are checked bit for bit on any CPU with AVX512-BF16 through
//! `Emulated`, a portable implementation of the three tile operations
//! (load, dot product, store) behind `Tiles`.
//!
//! # The operating system
//!
//! Linux keeps the tile data out of a thread's saved state until the process
//! asks for it (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`);
//! `detect` ([`super::amx_detect`]) asks once, and reports AMX only when the CPU lists AMX-TILE and
//! AMX-BF16 (CPUID leaf 7), the `vdpbf16ps` kernel's features (its packing
//! is shared) and the kernel grants the request.

use super::hardware::{
    consecutive_pairs, drive, k_blocks, load16, load32, mask16, pairs, transpose16x16_u32, with_aligned_buf, Micro,
    Out, INTERLEAVE, NR, PACK_A, SCRATCH,
};
use crate::Strided;
use std::arch::asm;
use std::arch::x86_64::*;
use std::sync::OnceLock;

/// Rows of the microkernel (two tiles of 16).
pub const MR: usize = 32;
/// Rows per block of packed `A`.
pub const MC: usize = MR * 6;
/// k pairs per k block at most (a multiple of 16): the block's `B`
/// micro-panel (`KCP × NR` u32, 32 KiB) stays in L1.
pub const KCP: usize = 256;
/// k pairs per tile row.
const TK: usize = 16;

/// The tile unit: eight tile registers of 16 rows × 64 bytes, the three
/// operations the kernel needs on them, and the configuration around them.
/// `t`, `c`, `a`, `b` name registers `0..8` (constants at every call, so the
/// hardware's `match` folds away).
pub(crate) trait Tiles {
    /// Configures all eight registers as 16 rows × 64 bytes.
    ///
    /// # Safety
    /// On [`Amx`], the CPU has AMX and the process has tile permission.
    unsafe fn begin(&mut self);
    /// Releases the tile state.
    ///
    /// # Safety
    /// After [`Tiles::begin`] on this thread.
    unsafe fn end(&mut self);
    /// Sets register `t` to zero.
    ///
    /// # Safety
    /// Between [`Tiles::begin`] and [`Tiles::end`] on this thread.
    unsafe fn zero(&mut self, t: usize);
    /// Loads register `t` from 16 rows of 64 bytes, `stride` bytes apart.
    ///
    /// # Safety
    /// As [`Tiles::zero`]; the 16 rows are readable.
    unsafe fn load(&mut self, t: usize, src: *const u8, stride: usize);
    /// Stores register `t` to 16 rows of 64 bytes, `stride` bytes apart.
    ///
    /// # Safety
    /// As [`Tiles::zero`]; the 16 rows are writable.
    unsafe fn store(&mut self, t: usize, dst: *mut u8, stride: usize);
    /// `c[i][j] += Σ_p a[i][p]·b[p][j]` over the 16 pairs `p` of bf16
    /// (`tdpbf16ps`): `a`'s rows are 16 pairs of one row of `A`, `b`'s rows
    /// 16 columns of one pair of `B`.
    ///
    /// # Safety
    /// As [`Tiles::zero`].
    unsafe fn dot(&mut self, c: usize, a: usize, b: usize);
}

/// The hardware's tile unit.
#[derive(Default)]
pub(crate) struct Amx;

/// The tile configuration: palette 1, registers 0..8 of 16 rows × 64 bytes.
#[repr(C, align(64))]
struct Config([u8; 64]);

static CONFIG: Config = Config({
    let mut c = [0u8; 64];
    c[0] = 1;
    let mut t = 0;
    while t < 8 {
        c[16 + 2 * t] = 64;
        c[48 + t] = 16;
        t += 1;
    }
    c
});

impl Tiles for Amx {
    #[inline(always)]
    unsafe fn begin(&mut self) {
        // SAFETY: CONFIG is a valid 64-byte configuration (palette 1); the
        // caller guarantees AMX and the permission.
        unsafe { asm!("ldtilecfg [{0}]", in(reg) CONFIG.0.as_ptr(), options(nostack, readonly)) };
    }

    #[inline(always)]
    unsafe fn end(&mut self) {
        // SAFETY: as begin.
        unsafe { asm!("tilerelease", options(nostack, nomem)) };
    }

    #[inline(always)]
    unsafe fn zero(&mut self, t: usize) {
        // SAFETY: tiles configured (the caller).
        unsafe {
            match t {
                0 => asm!("tilezero tmm0", options(nostack, nomem)),
                1 => asm!("tilezero tmm1", options(nostack, nomem)),
                2 => asm!("tilezero tmm2", options(nostack, nomem)),
                3 => asm!("tilezero tmm3", options(nostack, nomem)),
                _ => unreachable!("accumulators are tmm0..3"),
            }
        }
    }

    #[inline(always)]
    unsafe fn load(&mut self, t: usize, src: *const u8, stride: usize) {
        // SAFETY: the 16 rows are readable (the caller).
        unsafe {
            match t {
                0 => asm!("tileloadd tmm0, [{0} + {1}*1]", in(reg) src, in(reg) stride, options(nostack, readonly)),
                1 => asm!("tileloadd tmm1, [{0} + {1}*1]", in(reg) src, in(reg) stride, options(nostack, readonly)),
                2 => asm!("tileloadd tmm2, [{0} + {1}*1]", in(reg) src, in(reg) stride, options(nostack, readonly)),
                3 => asm!("tileloadd tmm3, [{0} + {1}*1]", in(reg) src, in(reg) stride, options(nostack, readonly)),
                4 => asm!("tileloadd tmm4, [{0} + {1}*1]", in(reg) src, in(reg) stride, options(nostack, readonly)),
                5 => asm!("tileloadd tmm5, [{0} + {1}*1]", in(reg) src, in(reg) stride, options(nostack, readonly)),
                6 => asm!("tileloadd tmm6, [{0} + {1}*1]", in(reg) src, in(reg) stride, options(nostack, readonly)),
                7 => asm!("tileloadd tmm7, [{0} + {1}*1]", in(reg) src, in(reg) stride, options(nostack, readonly)),
                _ => unreachable!("eight tile registers"),
            }
        }
    }

    #[inline(always)]
    unsafe fn store(&mut self, t: usize, dst: *mut u8, stride: usize) {
        // SAFETY: the 16 rows are writable (the caller).
        unsafe {
            match t {
                0 => asm!("tilestored [{0} + {1}*1], tmm0", in(reg) dst, in(reg) stride, options(nostack)),
                1 => asm!("tilestored [{0} + {1}*1], tmm1", in(reg) dst, in(reg) stride, options(nostack)),
                2 => asm!("tilestored [{0} + {1}*1], tmm2", in(reg) dst, in(reg) stride, options(nostack)),
                3 => asm!("tilestored [{0} + {1}*1], tmm3", in(reg) dst, in(reg) stride, options(nostack)),
                _ => unreachable!("accumulators are tmm0..3"),
            }
        }
    }

    #[inline(always)]
    unsafe fn dot(&mut self, c: usize, a: usize, b: usize) {
        // SAFETY: tiles configured (the caller).
        unsafe {
            match (c, a, b) {
                (0, 4, 6) => asm!("tdpbf16ps tmm0, tmm4, tmm6", options(nostack, nomem)),
                (1, 4, 7) => asm!("tdpbf16ps tmm1, tmm4, tmm7", options(nostack, nomem)),
                (2, 5, 6) => asm!("tdpbf16ps tmm2, tmm5, tmm6", options(nostack, nomem)),
                (3, 5, 7) => asm!("tdpbf16ps tmm3, tmm5, tmm7", options(nostack, nomem)),
                _ => unreachable!("the kernel's four products"),
            }
        }
    }
}

/// The tile unit in memory, for any CPU: the same data movement as [`Amx`];
/// its dot product sums each element's 16 pair sums (each pair's two exact
/// products rounded once to f32) as a binary tree in f32, then adds the
/// accumulator, rounding to nearest even, with no DAZ/FTZ of its own (the
/// packing already flushed denormal operands). That is one valid order of
/// the hardware's additions (it matches ~93% of Sapphire Rapids' elements
/// bit for bit); what it checks exactly is the blocking and packing.
#[cfg(test)]
pub(crate) struct Emulated {
    regs: Box<[[u32; 256]; 8]>,
}

#[cfg(test)]
impl Default for Emulated {
    fn default() -> Self {
        Emulated { regs: Box::new([[0; 256]; 8]) }
    }
}

#[cfg(test)]
impl Emulated {
    /// One element of [`Tiles::dot`]: `acc + Σ_p a[p]·b[p]` over 16 pairs
    /// (`a`, `b`: the pairs as u32, low half the even element).
    pub(crate) fn dot_element(acc: f32, a: impl Fn(usize) -> u32, b: impl Fn(usize) -> u32) -> f32 {
        let f = |w: u32, hi: bool| f32::from_bits(if hi { w & 0xffff_0000 } else { w << 16 }) as f64;
        let mut s: [f32; TK] = std::array::from_fn(|p| {
            let (x, y) = (a(p), b(p));
            (f(x, false) * f(y, false) + f(x, true) * f(y, true)) as f32
        });
        let mut len = TK;
        while len > 1 {
            len /= 2;
            for q in 0..len {
                s[q] = s[2 * q] + s[2 * q + 1];
            }
        }
        acc + s[0]
    }
}

#[cfg(test)]
impl Tiles for Emulated {
    unsafe fn begin(&mut self) {}

    unsafe fn end(&mut self) {}

    unsafe fn zero(&mut self, t: usize) {
        self.regs[t] = [0; 256];
    }

    unsafe fn load(&mut self, t: usize, src: *const u8, stride: usize) {
        for r in 0..16 {
            for (q, w) in self.regs[t][r * 16..][..16].iter_mut().enumerate() {
                // SAFETY: the 16 rows of 64 bytes are readable (the caller).
                *w = unsafe { src.add(r * stride + 4 * q).cast::<u32>().read_unaligned() };
            }
        }
    }

    unsafe fn store(&mut self, t: usize, dst: *mut u8, stride: usize) {
        for r in 0..16 {
            for (q, &w) in self.regs[t][r * 16..][..16].iter().enumerate() {
                // SAFETY: the 16 rows of 64 bytes are writable (the caller).
                unsafe { dst.add(r * stride + 4 * q).cast::<u32>().write_unaligned(w) };
            }
        }
    }

    unsafe fn dot(&mut self, c: usize, a: usize, b: usize) {
        let (ta, tb) = (self.regs[a], self.regs[b]);
        for i in 0..16 {
            for j in 0..16 {
                let acc = f32::from_bits(self.regs[c][i * 16 + j]);
                let v = Self::dot_element(acc, |p| ta[i * 16 + p], |p| tb[p * 16 + j]);
                self.regs[c][i * 16 + j] = v.to_bits();
            }
        }
    }
}

/// Whether the AMX kernel can run here: AMX-TILE and AMX-BF16, the
/// `vdpbf16ps` kernel's features, and Linux's permission for tile data
/// (asked once).
pub(crate) fn detect() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| {
        // CPUID leaf 7, sub-leaf 0, EDX: bit 22 AMX-BF16, bit 24 AMX-TILE.
        let edx = __cpuid_count(7, 0).edx;
        let cpu = edx & (1 << 22) != 0 && edx & (1 << 24) != 0 && super::detect();
        cpu && request_permission()
    })
}

#[cfg(target_os = "linux")]
fn request_permission() -> bool {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: arch_prctl with these arguments only changes which state the
    // kernel saves for this process's threads.
    unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 }
}

#[cfg(not(target_os = "linux"))]
fn request_permission() -> bool {
    false
}

/// Where pair `q` (a multiple of 16) of row `r` starts in a packed block of
/// `A` with `kcp` pairs per row: each 16 rows × 16 pairs (one tile, 1 KiB)
/// contiguous, the tiles of 16 rows in k order, so that the microkernel
/// reads its `A` tiles as one stream.
#[inline(always)]
fn a_at(r: usize, q: usize, kcp: usize) -> usize {
    ((r / 16) * (kcp / TK) + q / TK) * 256 + (r % 16) * 16
}

/// Packs rows `i0 .. i1` of `lhs` (zero rows up to the next multiple of
/// [`MR`]), k pairs `p0 .. p0 + kcp` (`kcp` a multiple of 16; zero pairs
/// past `⌈k/2⌉`), as tiles of 16 rows × 16 u32 pairs at `out` ([`a_at`]).
///
/// # Safety
/// `out` must be valid for `⌈(i1 - i0)/MR⌉·MR·kcp` writes; `lhs` must hold
/// the `i1 × k` view.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn pack_a(out: *mut u32, lhs: &Strided<'_>, k: usize, i0: usize, i1: usize, p0: usize, kcp: usize) {
    let rows = (i1 - i0).next_multiple_of(MR);
    let (base, rs, cs) = (lhs.ptr(), lhs.rs, lhs.cs);
    if rs == 1 && cs != 1 {
        // Columns of A are contiguous: 16 rows × 16 pairs at a time, a
        // pair of columns per vector, turned row-major by a transpose.
        // SAFETY: INTERLEAVE holds 32 u16.
        let idx = unsafe { _mm512_loadu_si512(INTERLEAVE.as_ptr().cast()) };
        for r0 in (0..rows).step_by(16) {
            let live = (i1 - i0).saturating_sub(r0).min(16);
            for q0 in (0..kcp).step_by(TK) {
                let mut t: [__m512i; 16] = std::array::from_fn(|q| {
                    let kk = 2 * (p0 + q0 + q);
                    if live == 0 || kk >= k {
                        return _mm512_setzero_si512();
                    }
                    let col = base.wrapping_add(kk * cs + i0 + r0);
                    // SAFETY: rows i0 + r0 .. + live of columns kk (< k) and
                    // kk + 1 (if < k) are inside the view.
                    unsafe {
                        let x = load16(col, 1, live);
                        let y = if kk + 1 < k { load16(col.wrapping_add(cs), 1, live) } else { _mm512_setzero_ps() };
                        pairs(x, y, idx)
                    }
                });
                transpose16x16_u32(&mut t);
                for (r, v) in t.iter().enumerate() {
                    // SAFETY: row r0 + r < rows, pairs q0 .. q0 + 16 ≤ kcp.
                    unsafe { _mm512_storeu_si512(out.add(a_at(r0 + r, q0, kcp)).cast(), *v) };
                }
            }
        }
        return;
    }
    for r in 0..rows {
        let i = i0 + r;
        for q0 in (0..kcp).step_by(TK) {
            let kk = 2 * (p0 + q0);
            let v = if i < i1 && kk < k {
                // Only this block's pairs: the next block's values stay out.
                let count = (k - kk).min(2 * (kcp - q0));
                // SAFETY: values kk .. kk + count of row i are inside the view.
                let (lo, hi) = unsafe { load32(base.wrapping_add(i * rs + kk * cs), cs, count) };
                consecutive_pairs(lo, hi)
            } else {
                _mm512_setzero_si512()
            };
            // SAFETY: pairs q0 .. q0 + 16 ≤ kcp of row r < rows.
            unsafe { _mm512_storeu_si512(out.add(a_at(r, q0, kcp)).cast(), v) };
        }
    }
}

/// `MR × NR` accumulators over `kcp` pairs (a multiple of 16): from zero
/// (`first`) or from `acc` (`MR × NR` f32, row stride `NR`), into `to`
/// (`MR × NR` f32, row stride `to_rs`).
///
/// # Safety
/// `a` holds `MR` rows of `kcp` pairs (as [`a_at`] lays them out), `b` `kcp` rows of
/// `NR` (row stride `NR`); `acc` is valid for `MR·NR` f32 and `to` for its
/// block; tiles begun.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn micro<U: Tiles>(
    u: &mut U,
    kcp: usize,
    a: *const u32,
    b: *const u32,
    acc: *const f32,
    first: bool,
    to: *mut f32,
    to_rs: usize,
) {
    const ROW: usize = NR * 4;
    let c = |i: usize, j: usize| acc.wrapping_add(i * 16 * NR + j * 16).cast::<u8>();
    let t = |i: usize, j: usize| to.wrapping_add(i * 16 * to_rs + j * 16).cast::<u8>();
    // SAFETY: the caller's contract, tile by tile.
    unsafe {
        if first {
            (0..4).for_each(|t| u.zero(t));
        } else {
            u.load(0, c(0, 0), ROW);
            u.load(1, c(0, 1), ROW);
            u.load(2, c(1, 0), ROW);
            u.load(3, c(1, 1), ROW);
        }
        for p in (0..kcp).step_by(TK) {
            u.load(4, a.add(a_at(0, p, kcp)).cast(), 64);
            u.load(5, a.add(a_at(16, p, kcp)).cast(), 64);
            u.load(6, b.add(p * NR).cast(), ROW);
            u.load(7, b.add(p * NR + 16).cast(), ROW);
            u.dot(0, 4, 6);
            u.dot(1, 4, 7);
            u.dot(2, 5, 6);
            u.dot(3, 5, 7);
        }
        u.store(0, t(0, 0), to_rs * 4);
        u.store(1, t(0, 1), to_rs * 4);
        u.store(2, t(1, 0), to_rs * 4);
        u.store(3, t(1, 1), to_rs * 4);
    }
}

/// Writes a finished `MR × NR` accumulator block (row stride `NR`) to
/// `dst`: `alpha · S` or `fma(alpha, S, dst)`, masked to `out.mr × out.nr`.
///
/// # Safety
/// `acc` holds `MR·NR` f32; `out.dst` is valid for the `mr × nr` tile.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn write_back(acc: *const f32, o: Out) {
    let alpha = _mm512_set1_ps(o.alpha);
    for i in 0..o.mr {
        for v in 0..NR / 16 {
            let mask = mask16(o.nr.saturating_sub(16 * v));
            if mask == 0 {
                continue;
            }
            let d = o.dst.wrapping_add(i * o.rs + 16 * v);
            // SAFETY: row i < MR of acc; the unmasked lanes of d are inside
            // the mr × nr tile.
            unsafe {
                let s = _mm512_loadu_ps(acc.add(i * NR + 16 * v));
                let r = if o.accumulate {
                    _mm512_fmadd_ps(alpha, s, _mm512_maskz_loadu_ps(mask, d))
                } else {
                    _mm512_mul_ps(alpha, s)
                };
                _mm512_mask_storeu_ps(d, mask, r);
            }
        }
    }
}

/// One task: rows `r0 .. r1` × panels `q0 .. q1` of the packed chunk `b`
/// (first column `jc`); see [`super::hardware::BlockFn`].
///
/// # Safety
/// As [`gemm`]; no other thread writes this block of dst; on [`Amx`], the
/// CPU has AMX ([`detect`]).
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn block<U: Tiles + Default>(
    pr: &crate::SendCall<'_>,
    b: &[u32],
    jc: usize,
    r0: usize,
    r1: usize,
    q0: usize,
    q1: usize,
) {
    if r0 >= r1 || q0 >= q1 {
        return;
    }
    let pr = &pr.0;
    let kps = pr.k.div_ceil(2).next_multiple_of(TK);
    let (nkb, kcb) = k_blocks(kps, KCP, TK);
    let mc_max = MC.min((r1 - r0).next_multiple_of(MR));
    let tiles_per_block = mc_max / MR * (q1 - q0);
    // One accumulator block per (row tile, panel) while k blocks remain;
    // one in all when there is a single k block.
    let scratch_len = if nkb > 1 { tiles_per_block } else { 1 } * MR * NR;
    let mut u = U::default();
    with_aligned_buf(&PACK_A, mc_max * kcb, |abuf| {
        with_aligned_buf(&SCRATCH, scratch_len, |sbuf| {
            let (a, s) = (abuf.as_mut_ptr(), sbuf.as_mut_ptr());
            // SAFETY: the caller guarantees the tile unit can run.
            unsafe { u.begin() };
            for ic in (r0..r1).step_by(MC) {
                let mc = MC.min(r1 - ic);
                let mtiles = mc.div_ceil(MR);
                for kb in 0..nkb {
                    let p0 = kb * kcb;
                    let kcp = kcb.min(kps - p0);
                    // SAFETY: mtiles·MR ≤ mc_max rows of kcp ≤ kcb pairs
                    // fit abuf; lhs holds the m × k view.
                    unsafe { pack_a(a, &pr.lhs, pr.k, ic, ic + mc, p0, kcp) };
                    let last = kb + 1 == nkb;
                    for q in q0..q1 {
                        let col = jc + q * NR;
                        let bp = b[q * kps * NR + p0 * NR..].as_ptr();
                        for it in 0..mtiles {
                            let row = ic + it * MR;
                            let tile = if nkb > 1 { s.wrapping_add(((q - q0) * mtiles + it) * MR * NR) } else { s };
                            let whole = MR <= r1 - row && col + NR <= pr.n;
                            let dst = pr.dst.wrapping_add(row * pr.dst_rs + col);
                            let direct = last && whole && pr.alpha == 1.0 && !pr.accumulate;
                            let (to, to_rs) = if direct { (dst, pr.dst_rs) } else { (tile, NR) };
                            // SAFETY: the packed rows and panel hold kcp
                            // pairs from p0; the accumulator block is
                            // inside sbuf; a direct store's block is inside
                            // the caller's m × n block of dst.
                            unsafe { micro(&mut u, kcp, a.add(it * MR * kcp), bp, tile, kb == 0, to, to_rs) };
                            if last && !direct {
                                let out = Out {
                                    dst,
                                    rs: pr.dst_rs,
                                    mr: MR.min(r1 - row),
                                    nr: NR.min(pr.n - col),
                                    accumulate: pr.accumulate,
                                    alpha: pr.alpha,
                                };
                                // SAFETY: the dst tile is inside the
                                // caller's m × n block.
                                unsafe { write_back(tile, out) };
                            }
                        }
                    }
                }
            }
            // SAFETY: begun above, on this thread.
            unsafe { u.end() };
        })
    })
}

/// See [`super::gemm`]: the AMX kernel.
///
/// # Safety
/// As [`crate::gemm_raw`], and [`detect`] is true.
pub(super) unsafe fn gemm(call: &crate::Call<'_>, pool: bool) {
    // SAFETY: as this function's.
    unsafe { drive(call, pool, Micro { mr: MR, mc: MC, pair_align: TK, block: block::<Amx> }) }
}

/// The AMX kernel's blocking and packing with [`Emulated`] tiles: any CPU
/// with AVX512-BF16.
///
/// # Safety
/// As [`crate::gemm_raw`], and the CPU has AVX512-BF16.
#[cfg(test)]
unsafe fn gemm_emulated(call: &crate::Call<'_>, pool: bool) {
    // SAFETY: as this function's.
    unsafe { drive(call, pool, Micro { mr: MR, mc: MC, pair_align: TK, block: block::<Emulated> }) }
}

#[cfg(test)]
mod tests;
