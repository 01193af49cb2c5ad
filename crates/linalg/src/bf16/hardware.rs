//! The AVX512-BF16 kernel (`vdpbf16ps`): blocking, pack format and
//! determinism as described in [`super`].

use crate::{with_buf, Strided};
use rayon::prelude::*;
use std::arch::x86_64::*;
use std::cell::Cell;
use std::mem::transmute;

/// Microkernel rows.
pub const MR: usize = 12;
/// Microkernel columns, in zmm registers of 16 f32.
pub const NV: usize = 2;
/// Microkernel columns.
pub const NR: usize = 16 * NV;
/// k pairs per k block (`KC = 2·KCP` values of k).
pub const KCP: usize = 512;
/// Rows per block of packed `A`.
pub const MC: usize = MR * 16;
/// Bytes of packed `B` per column chunk.
/// (Small in tests, so that they cover several chunks.)
const B_CHUNK_BYTES: usize = if cfg!(test) { 64 << 10 } else { 32 << 20 };
/// How many k pairs ahead the microkernel prefetches `B`.
const PF_B: usize = 16;
/// How many rows ahead the packing of a row-major `B` prefetches.
const PF_ROWS: usize = 16;
/// Tasks per thread when splitting over the pool.
const TASKS_PER_THREAD: usize = 4;
/// Below this many flops, one thread.
const MIN_PAR_FLOPS: usize = 1 << 24;

thread_local! {
    static PACK_B: Cell<Vec<u32>> = const { Cell::new(Vec::new()) };
    pub(super) static PACK_A: Cell<Vec<u32>> = const { Cell::new(Vec::new()) };
    pub(super) static SCRATCH: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
}

/// 32-bit values per cache line.
const LINE_U32: usize = 16;

/// [`with_buf`] with the buffer starting on a 64-byte boundary: a tile row
/// (AMX) or vector that straddles two cache lines costs two (AMX's tile
/// loads run 3× slower).
pub(super) fn with_aligned_buf<T: Copy + Default + 'static, R>(
    key: &'static std::thread::LocalKey<Cell<Vec<T>>>,
    len: usize,
    f: impl FnOnce(&mut [T]) -> R,
) -> R {
    const { assert!(std::mem::size_of::<T>() == 4) };
    with_buf(key, len + LINE_U32, |buf| {
        let off = buf.as_ptr().align_offset(64).min(LINE_U32);
        f(&mut buf[off..off + len])
    })
}

/// `pairs` k pairs (a multiple of `align`) cut into `(count, size)` blocks
/// of equal size, at most `max` and a multiple of `align` (the last one
/// shorter). Where they fall does not change the result: the accumulators
/// pass through the scratch tile exactly.
pub(super) fn k_blocks(pairs: usize, max: usize, align: usize) -> (usize, usize) {
    let count = pairs.div_ceil(max);
    (count, (pairs / align).div_ceil(count) * align)
}

/// Where the microkernel writes its finished tile.
#[derive(Clone, Copy)]
pub(super) struct Out {
    pub(super) dst: *mut f32,
    pub(super) rs: usize,
    pub(super) mr: usize,
    pub(super) nr: usize,
    pub(super) accumulate: bool,
    pub(super) alpha: f32,
}

/// 16-bit lane permutation interleaving two halves of 16 bf16:
/// lane `2j` takes `j`, lane `2j + 1` takes `16 + j`.
pub(super) static INTERLEAVE: [u16; 32] = {
    let mut t = [0u16; 32];
    let mut j = 0;
    while j < 16 {
        t[2 * j] = j as u16;
        t[2 * j + 1] = 16 + j as u16;
        j += 1;
    }
    t
};

pub(super) fn mask16(count: usize) -> u16 {
    if count >= 16 {
        u16::MAX
    } else {
        ((1u32 << count) - 1) as u16
    }
}

/// `u32` lane `j` = `(bf16(x[j]), bf16(y[j]))` (low, high).
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
#[inline]
pub(super) fn pairs(x: __m512, y: __m512, idx: __m512i) -> __m512i {
    let h = _mm512_cvtne2ps_pbh(y, x);
    // SAFETY: __m512bh and __m512i are both 64-byte SIMD vectors.
    let h: __m512i = unsafe { transmute::<__m512bh, __m512i>(h) };
    _mm512_permutexvar_epi16(idx, h)
}

/// `u32` lane `q` = `(bf16(v[2q]), bf16(v[2q+1]))` for the 32 values
/// `v = lo ++ hi`.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
#[inline]
pub(super) fn consecutive_pairs(lo: __m512, hi: __m512) -> __m512i {
    // SAFETY: __m512bh and __m512i are both 64-byte SIMD vectors.
    unsafe { transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(hi, lo)) }
}

/// Loads the first `min(count, 32)` of the values `src[0],
/// src[stride], …` (zeros past `count`) as two vectors of 16.
///
/// # Safety
/// Those `min(count, 32)` addresses must be readable.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
#[inline]
pub(super) unsafe fn load32(src: *const f32, stride: usize, count: usize) -> (__m512, __m512) {
    if stride == 1 {
        // SAFETY: masked-off lanes are not accessed (no fault); the
        // others are readable by the contract.
        unsafe {
            (
                _mm512_maskz_loadu_ps(mask16(count), src),
                _mm512_maskz_loadu_ps(mask16(count.saturating_sub(16)), src.wrapping_add(16)),
            )
        }
    } else {
        let mut t = [0f32; 32];
        for (q, slot) in t.iter_mut().enumerate().take(count.min(32)) {
            // SAFETY: readable by the contract.
            *slot = unsafe { *src.add(q * stride) };
        }
        // SAFETY: `t` holds 32 f32.
        unsafe { (_mm512_loadu_ps(t.as_ptr()), _mm512_loadu_ps(t.as_ptr().add(16))) }
    }
}

/// Packs columns `j0 .. j0 + ncols` of a row-major `rhs` (`cs == 1`), all
/// `k`, into `⌈ncols/NR⌉` `B` panels `kps × NR` u32 apart (`kp = ⌈k/2⌉ ≤
/// kps` pairs written in each, the rows past `kp` left as they are), the
/// last one zero-padded. Several panels at once read
/// longer runs of each row (fewer pages touched per row pair).
///
/// # Safety
/// `rhs` must hold the `k × (j0 + ncols)` view (checked by the caller).
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn pack_b_rows(out: &mut [u32], rhs: &Strided<'_>, k: usize, kps: usize, j0: usize, ncols: usize) {
    let kp = k.div_ceil(2);
    let panels = ncols.div_ceil(NR);
    assert!(rhs.cs == 1 && kps >= kp && out.len() >= (panels - 1) * kps * NR + kp * NR);
    // SAFETY: INTERLEAVE holds 32 u16.
    let idx = unsafe { _mm512_loadu_si512(INTERLEAVE.as_ptr().cast()) };
    let (base, rs) = (rhs.ptr(), rhs.rs);
    let o = out.as_mut_ptr();
    for p in 0..kp {
        let r0 = base.wrapping_add(2 * p * rs + j0);
        // Rows far apart defeat the hardware prefetcher: fetch the part
        // of the rows PF_ROWS ahead that this call packs.
        let ahead = r0.wrapping_add(PF_ROWS * rs);
        for l in 0..ncols.div_ceil(16) {
            _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(16 * l).cast());
            _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(rs + 16 * l).cast());
        }
        let second = 2 * p + 1 < k;
        for g in 0..panels {
            for v in 0..NV {
                let c = g * NR + 16 * v;
                let mask = mask16(ncols.saturating_sub(c));
                // SAFETY: row 2p (< k) and, if `second`, row 2p + 1,
                // columns j0 + c .. j0 + ncols are inside the view;
                // masked-off lanes are not accessed; the store lies in
                // panel g (asserted above).
                unsafe {
                    let x = _mm512_maskz_loadu_ps(mask, r0.wrapping_add(c));
                    let y =
                        if second { _mm512_maskz_loadu_ps(mask, r0.wrapping_add(rs + c)) } else { _mm512_setzero_ps() };
                    _mm512_storeu_si512(o.add(g * kps * NR + p * NR + 16 * v).cast(), pairs(x, y, idx));
                }
            }
        }
    }
}

/// Packs columns `j0 .. j0 + nr` (`nr ≤ NR`) of `rhs`, all `k`, into one
/// `B` panel (`kp × NR` u32, `kp = ⌈k/2⌉`).
///
/// # Safety
/// `rhs` must hold the `k × (j0 + nr)` view (checked by the caller).
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn pack_b_panel(out: &mut [u32], rhs: &Strided<'_>, k: usize, j0: usize, nr: usize) {
    let kp = k.div_ceil(2);
    debug_assert!(out.len() >= kp * NR && nr <= NR && nr > 0);
    let base = rhs.ptr();
    let (rs, cs) = (rhs.rs, rhs.cs);
    let o = out.as_mut_ptr();
    if cs == 1 || rs != 1 {
        // Rows of B, 16 columns at a time (gathered unless cs == 1;
        // row-major B normally goes through `pack_b_rows`).
        // SAFETY: INTERLEAVE holds 32 u16.
        let idx = unsafe { _mm512_loadu_si512(INTERLEAVE.as_ptr().cast()) };
        for p in 0..kp {
            let r0 = base.wrapping_add(2 * p * rs + j0 * cs);
            for v in 0..NV {
                let cols = nr.saturating_sub(16 * v).min(16);
                let zero = _mm512_setzero_ps();
                let (x, y) = if cols == 0 {
                    (zero, zero)
                } else {
                    // SAFETY: row 2p (< k) and, if present, row 2p + 1,
                    // columns j0 + 16v .. + cols are inside the view.
                    unsafe {
                        let x = load16(r0.wrapping_add(16 * v * cs), cs, cols);
                        let y = if 2 * p + 1 < k { load16(r0.wrapping_add(rs + 16 * v * cs), cs, cols) } else { zero };
                        (x, y)
                    }
                };
                // SAFETY: p·NR + 16v + 16 ≤ kp·NR ≤ out.len().
                unsafe { _mm512_storeu_si512(o.add(p * NR + 16 * v).cast(), pairs(x, y, idx)) };
            }
        }
    } else {
        // Columns of B are contiguous along k: 32 values of k (16 pairs)
        // of 16 columns at a time, turned pair-major by a 16 × 16
        // transpose of u32.
        for v in 0..NV {
            let cols = nr.saturating_sub(16 * v).min(16);
            for q0 in (0..kp).step_by(16) {
                let mut t: [__m512i; 16] = std::array::from_fn(|j| {
                    if j < cols {
                        let col = base.wrapping_add((j0 + 16 * v + j) * cs + 2 * q0);
                        // SAFETY: values 2·q0 .. k of this column are inside the view.
                        let (lo, hi) = unsafe { load32(col, 1, k - 2 * q0) };
                        consecutive_pairs(lo, hi)
                    } else {
                        _mm512_setzero_si512()
                    }
                });
                transpose16x16_u32(&mut t);
                for (q, row) in t.iter().enumerate().take(kp - q0) {
                    // SAFETY: (q0 + q)·NR + 16v + 16 ≤ kp·NR ≤ out.len().
                    unsafe { _mm512_storeu_si512(o.add((q0 + q) * NR + 16 * v).cast(), *row) };
                }
            }
        }
    }
}

/// Loads the first `min(count, 16)` of the values `src[0], src[stride],
/// …`, zeros past `count`.
///
/// # Safety
/// Those `min(count, 16)` addresses must be readable.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
#[inline]
pub(super) unsafe fn load16(src: *const f32, stride: usize, count: usize) -> __m512 {
    if stride == 1 {
        // SAFETY: masked-off lanes are not accessed.
        unsafe { _mm512_maskz_loadu_ps(mask16(count), src) }
    } else {
        let mut t = [0f32; 16];
        for (q, slot) in t.iter_mut().enumerate().take(count.min(16)) {
            // SAFETY: readable by the contract.
            *slot = unsafe { *src.add(q * stride) };
        }
        // SAFETY: `t` holds 16 f32.
        unsafe { _mm512_loadu_ps(t.as_ptr()) }
    }
}

/// Packs rows `i0 .. i1` of `lhs`, k pairs `p0 .. p0 + kcp`, into
/// `⌈(i1 - i0)/MR⌉` consecutive `A` panels (`kcp × MR` u32 each) at `out`.
///
/// # Safety
/// `out` must be valid for that many panels; `lhs` must hold the
/// `i1 × k` view; `p0 + kcp ≤ ⌈k/2⌉`.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
#[inline(never)]
unsafe fn pack_a_block(out: *mut u32, lhs: &Strided<'_>, k: usize, i0: usize, i1: usize, p0: usize, kcp: usize) {
    let tiles = (i1 - i0).div_ceil(MR);
    if lhs.rs != 1 {
        for it in 0..tiles {
            let row = i0 + it * MR;
            // SAFETY: as this function's contract, panel by panel.
            unsafe { pack_a_panel(out.add(it * kcp * MR), lhs, k, row, MR.min(i1 - row), p0, kcp) };
        }
        return;
    }
    // Columns of A are contiguous along i: for each k pair, the rows of
    // the whole block in one pass over memory (MR rows per panel).
    let (base, cs) = (lhs.ptr(), lhs.cs);
    // SAFETY: INTERLEAVE holds 32 u16.
    let idx = unsafe { _mm512_loadu_si512(INTERLEAVE.as_ptr().cast()) };
    let store = mask16(MR);
    for p in 0..kcp {
        let kk = 2 * (p0 + p);
        // The block's part of the columns PF_ROWS ahead (see pack_b_rows).
        let ahead = base.wrapping_add((kk + PF_ROWS) * cs + i0);
        for l in 0..(i1 - i0).div_ceil(16) {
            _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(16 * l).cast());
            _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(cs + 16 * l).cast());
        }
        for it in 0..tiles {
            let row = i0 + it * MR;
            let rows = mask16(MR.min(i1 - row));
            let c0 = base.wrapping_add(kk * cs + row);
            // SAFETY: rows row .. min(i1, row + MR) of columns kk (< k)
            // and kk + 1 (if < k) are inside the view; masked-off lanes
            // are not accessed; the panel's row p is writable.
            unsafe {
                let x = _mm512_maskz_loadu_ps(rows, c0);
                let y = if kk + 1 < k { _mm512_maskz_loadu_ps(rows, c0.wrapping_add(cs)) } else { _mm512_setzero_ps() };
                _mm512_mask_storeu_epi32(out.add(it * kcp * MR + p * MR).cast(), store, pairs(x, y, idx));
            }
        }
    }
}

/// Packs rows `i0 .. i0 + mr` (`mr ≤ MR`) of `lhs`, k pairs
/// `p0 .. p0 + kcp`, into one `A` panel (`kcp × MR` u32 at `out`).
///
/// # Safety
/// `out` must be valid for `kcp · MR` writes; `lhs` must hold the
/// `(i0 + mr) × k` view; `p0 + kcp ≤ ⌈k/2⌉`; `lhs.rs != 1` (see
/// [`pack_a_block`]).
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn pack_a_panel(out: *mut u32, lhs: &Strided<'_>, k: usize, i0: usize, mr: usize, p0: usize, kcp: usize) {
    const { assert!(MR <= 16) };
    let base = lhs.ptr();
    let (rs, cs) = (lhs.rs, lhs.cs);
    if cs == 1 && mr == MR && MR > 8 {
        // Full panel of row-major A: 8 pairs of each row per step, turned
        // into pair-major order by an 8×8 transpose of 64-bit (f32 pair)
        // elements for rows 0..8 and another for rows 8..MR.
        let mut q = 0;
        while q < kcp {
            let kk = 2 * (p0 + q);
            let mask = mask16(k - kk);
            let row = |i: usize| base.wrapping_add((i0 + i) * rs + kk);
            // SAFETY: values kk .. min(k, kk + 16) of rows i0 .. i0 + MR
            // are inside the view; masked-off lanes are not accessed.
            let mut lo: [__m512i; 8] =
                std::array::from_fn(|i| unsafe { _mm512_castps_si512(_mm512_maskz_loadu_ps(mask, row(i))) });
            let mut hi: [__m512i; 8] = std::array::from_fn(|i| {
                if 8 + i < MR {
                    // SAFETY: as above.
                    unsafe { _mm512_castps_si512(_mm512_maskz_loadu_ps(mask, row(8 + i))) }
                } else {
                    _mm512_setzero_si512()
                }
            });
            transpose8x8_u64(&mut lo);
            transpose8x8_u64(&mut hi);
            for p in 0..(kcp - q).min(8) {
                let v = consecutive_pairs(_mm512_castsi512_ps(lo[p]), _mm512_castsi512_ps(hi[p]));
                // SAFETY: (q + p)·MR + MR ≤ kcp·MR.
                unsafe { _mm512_mask_storeu_epi32(out.add((q + p) * MR).cast(), mask16(MR), v) };
            }
            q += 8;
        }
    } else {
        // Rows of A, 32 values of k at a time (contiguous when cs == 1).
        let mut t = [0u32; 16];
        for i in 0..MR {
            if i >= mr {
                for p in 0..kcp {
                    // SAFETY: p·MR + i < kcp·MR.
                    unsafe { *out.add(p * MR + i) = 0 };
                }
                continue;
            }
            let row = base.wrapping_add((i0 + i) * rs);
            for q0 in (0..kcp).step_by(16) {
                let kk = 2 * (p0 + q0);
                // SAFETY: values kk .. k of row i0 + i are inside the view.
                unsafe {
                    let (lo, hi) = load32(row.add(kk * cs), cs, k - kk);
                    _mm512_storeu_si512(t.as_mut_ptr().cast(), consecutive_pairs(lo, hi));
                }
                for (q, &w) in t.iter().enumerate().take(kcp - q0) {
                    // SAFETY: (q0 + q)·MR + i < kcp·MR.
                    unsafe { *out.add((q0 + q) * MR + i) = w };
                }
            }
        }
    }
}

/// Transposes 8 × 8 64-bit elements: row `i` in `v[i]` on entry,
/// column `i` in `v[i]` on exit.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
#[inline]
fn transpose8x8_u64(v: &mut [__m512i; 8]) {
    const ROUNDS: [(usize, [i64; 8], [i64; 8]); 3] = [
        (1, [0, 8, 2, 10, 4, 12, 6, 14], [1, 9, 3, 11, 5, 13, 7, 15]),
        (2, [0, 1, 8, 9, 4, 5, 12, 13], [2, 3, 10, 11, 6, 7, 14, 15]),
        (4, [0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]),
    ];
    for (d, lo, hi) in ROUNDS {
        // SAFETY: both index arrays hold 8 i64.
        let (lo, hi) = unsafe { (_mm512_loadu_si512(lo.as_ptr().cast()), _mm512_loadu_si512(hi.as_ptr().cast())) };
        for i in 0..8 {
            if i & d == 0 {
                let (a, b) = (v[i], v[i + d]);
                v[i] = _mm512_permutex2var_epi64(a, lo, b);
                v[i + d] = _mm512_permutex2var_epi64(a, hi, b);
            }
        }
    }
}

/// `permutex2var` indices of the transposes: round `d` exchanges the
/// `d × d` off-diagonal blocks of rows `i` and `i + d` (`i & d == 0`).
const fn transpose_idx<const N: usize>(d: usize, high: bool) -> [u32; N] {
    let mut t = [0u32; N];
    let mut l = 0;
    while l < N {
        t[l] = match (l & d == 0, high) {
            (true, false) => l,
            (false, false) => N + l - d,
            (true, true) => l + d,
            (false, true) => N + l,
        } as u32;
        l += 1;
    }
    t
}

/// Transposes 16 × 16 u32: row `i` in `v[i]` on entry, column `i` on exit.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
#[inline]
pub(super) fn transpose16x16_u32(v: &mut [__m512i; 16]) {
    const IDX: [[[u32; 16]; 2]; 4] = {
        let mut t = [[[0u32; 16]; 2]; 4];
        let mut r = 0;
        while r < 4 {
            t[r] = [transpose_idx::<16>(1 << r, false), transpose_idx::<16>(1 << r, true)];
            r += 1;
        }
        t
    };
    for (r, [lo, hi]) in IDX.iter().enumerate() {
        let d = 1 << r;
        // SAFETY: both index arrays hold 16 u32.
        let (lo, hi) = unsafe { (_mm512_loadu_si512(lo.as_ptr().cast()), _mm512_loadu_si512(hi.as_ptr().cast())) };
        for i in 0..16 {
            if i & d == 0 {
                let (a, b) = (v[i], v[i + d]);
                v[i] = _mm512_permutex2var_epi32(a, lo, b);
                v[i + d] = _mm512_permutex2var_epi32(a, hi, b);
            }
        }
    }
}

/// The `MR × NR` microkernel over `kcp` k pairs: starts from zero
/// (`first`) or from the scratch tile, and ends in the scratch tile
/// (`out == None`) or in `dst`.
///
/// # Safety
/// `a` holds `kcp × MR` and `b` `kcp × NR` packed u32 (row stride NR);
/// `scratch` is valid for `MR·NR` f32 (read unless `first`, written when
/// `out` is `None`); `out.dst` is valid for the `out.mr × out.nr` tile.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
#[inline(never)]
unsafe fn kernel(
    kcp: usize,
    a: *const u32,
    b: *const u32,
    scratch: *mut f32,
    first: bool,
    out: Option<Out>,
    prefetch: Option<(*const f32, usize)>,
) {
    if let Some((pf, rs)) = prefetch {
        // The next tile's accumulators (scratch or dst): bring them to
        // L1 while this one computes. Prefetches never fault.
        for i in 0..MR {
            for l in 0..NR / 16 {
                _mm_prefetch::<_MM_HINT_T0>(pf.wrapping_add(i * rs + 16 * l).cast());
            }
        }
    }
    let mut acc = [[_mm512_setzero_ps(); NV]; MR];
    if !first {
        for (i, row) in acc.iter_mut().enumerate() {
            for (v, c) in row.iter_mut().enumerate() {
                // SAFETY: inside the MR·NR scratch tile.
                *c = unsafe { _mm512_loadu_ps(scratch.add((i * NV + v) * 16)) };
            }
        }
    }
    for p in 0..kcp {
        // SAFETY: p < kcp, inside the packed panels.
        unsafe {
            let bp = b.add(p * NR);
            for l in 0..NV {
                _mm_prefetch::<_MM_HINT_T0>(bp.wrapping_add(PF_B * NR + 16 * l).cast());
            }
            let bv: [__m512bh; NV] =
                std::array::from_fn(|v| transmute::<__m512i, __m512bh>(_mm512_loadu_si512(bp.add(16 * v).cast())));
            let ap = a.add(p * MR);
            for (i, row) in acc.iter_mut().enumerate() {
                let ai = transmute::<__m512i, __m512bh>(_mm512_set1_epi32(*ap.add(i) as i32));
                for (c, &bvv) in row.iter_mut().zip(bv.iter()) {
                    *c = _mm512_dpbf16_ps(*c, ai, bvv);
                }
            }
        }
    }
    match out {
        None => {
            for (i, row) in acc.iter().enumerate() {
                for (v, c) in row.iter().enumerate() {
                    // SAFETY: inside the MR·NR scratch tile.
                    unsafe { _mm512_storeu_ps(scratch.add((i * NV + v) * 16), *c) };
                }
            }
        }
        Some(o) => {
            let alpha = _mm512_set1_ps(o.alpha);
            let masks: [u16; NV] = std::array::from_fn(|v| mask16(o.nr.saturating_sub(16 * v)));
            for (i, row) in acc.iter().enumerate().take(o.mr) {
                for (v, c) in row.iter().enumerate() {
                    if masks[v] == 0 {
                        continue;
                    }
                    let d = o.dst.wrapping_add(i * o.rs + 16 * v);
                    // SAFETY: the unmasked lanes are inside the
                    // mr × nr tile of dst.
                    unsafe {
                        let r = if o.accumulate {
                            _mm512_fmadd_ps(alpha, *c, _mm512_maskz_loadu_ps(masks[v], d))
                        } else {
                            _mm512_mul_ps(alpha, *c)
                        };
                        _mm512_mask_storeu_ps(d, masks[v], r);
                    }
                }
            }
        }
    }
}

/// One thread's share of a column chunk: rows `r0 .. r1` (`r0` a
/// multiple of `MR`) × panels `q0 .. q1` of the packed chunk `b` whose
/// first column is `jc`.
///
/// # Safety
/// As [`gemm`]; no other thread writes this block of dst.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn block(pr: &crate::SendCall<'_>, b: &[u32], jc: usize, r0: usize, r1: usize, q0: usize, q1: usize) {
    if r0 >= r1 || q0 >= q1 {
        return;
    }
    let pr = &pr.0;
    let kp = pr.k.div_ceil(2);
    let (nkb, kcb) = k_blocks(kp, KCP, 1);
    let mc_max = MC.min((r1 - r0).next_multiple_of(MR));
    let a_len = mc_max * kcb;
    let scratch_len = if nkb > 1 { mc_max * (q1 - q0) * NR } else { 0 };
    with_buf(&PACK_A, a_len, |abuf| {
        with_buf(&SCRATCH, scratch_len, |sbuf| {
            let a = abuf.as_mut_ptr();
            let s = sbuf.as_mut_ptr();
            for ic in (r0..r1).step_by(MC) {
                let mc = MC.min(r1 - ic);
                let mtiles = mc.div_ceil(MR);
                for kb in 0..nkb {
                    let p0 = kb * kcb;
                    let kcp = kcb.min(kp - p0);
                    // SAFETY: the mtiles panels lie inside abuf
                    // (mtiles·MR ≤ mc_max, kcp ≤ kcb); lhs holds the m × k view.
                    unsafe { pack_a_block(a, &pr.lhs, pr.k, ic, ic + mc, p0, kcp) };
                    let last = kb + 1 == nkb;
                    for q in q0..q1 {
                        let col = jc + q * NR;
                        let nr = NR.min(pr.n - col);
                        let bp = b[q * kp * NR + p0 * NR..].as_ptr();
                        for it in 0..mtiles {
                            let row = ic + it * MR;
                            let out = last.then(|| Out {
                                dst: pr.dst.wrapping_add(row * pr.dst_rs + col),
                                rs: pr.dst_rs,
                                mr: MR.min(r1 - row),
                                nr,
                                accumulate: pr.accumulate,
                                alpha: pr.alpha,
                            });
                            let tile = s.wrapping_add(((q - q0) * mtiles + it) * MR * NR);
                            // The next tile's accumulators: its dst rows
                            // (last k block) or its scratch tile. Only
                            // prefetched, so it may lie past the block.
                            let prefetch = if last {
                                let next = if it + 1 < mtiles { (row + MR, col) } else { (ic, col + NR) };
                                Some((pr.dst.wrapping_add(next.0 * pr.dst_rs + next.1).cast_const(), pr.dst_rs))
                            } else {
                                (kb > 0).then(|| (tile.wrapping_add(MR * NR).cast_const(), NR))
                            };
                            // SAFETY: the packed panels hold kcp pairs
                            // from p0; the scratch tile is inside sbuf
                            // whenever it is used (nkb > 1); the dst tile
                            // is inside the caller's m × n block.
                            unsafe { kernel(kcp, a.add(it * kcp * MR), bp, tile, kb == 0, out, prefetch) };
                        }
                    }
                }
            }
        })
    })
}

/// See [`super::gemm`].
///
/// # Safety
/// As [`crate::gemm_raw`], and the CPU has AVX512-BF16.
pub(super) unsafe fn gemm(call: &crate::Call<'_>, pool: bool) {
    // SAFETY: as this function's; `block` is this kernel's.
    unsafe { drive(call, pool, Micro { mr: MR, mc: MC, pair_align: 1, block }) }
}

/// One thread's share of a packed column chunk: `(call, b, jc, r0, r1, q0,
/// q1)` as [`block`] takes it.
pub(super) type BlockFn = unsafe fn(&crate::SendCall<'_>, &[u32], usize, usize, usize, usize, usize);

/// What [`drive`] needs of a microkernel: its rows (a task's rows start at
/// a multiple of `mr`), the rows of its blocks of packed `A` (a multiple of
/// `mr`), the multiple that each panel's k pairs are padded to (with zeros)
/// in packed `B`, and the function that runs one task.
#[derive(Clone, Copy)]
pub(super) struct Micro {
    pub(super) mr: usize,
    pub(super) mc: usize,
    pub(super) pair_align: usize,
    pub(super) block: BlockFn,
}

/// The blocking shared by the `vdpbf16ps` and AMX kernels: column chunks of
/// `B` packed in `NR`-column panels of `kps = ⌈⌈k/2⌉ / pair_align⌉ ·
/// pair_align` pairs (once, on the pool), and the tasks over rows or panels
/// of each chunk (see the module's "Blocking").
///
/// # Safety
/// As [`crate::gemm_raw`], and the CPU has what `micro.block` needs.
pub(super) unsafe fn drive(call: &crate::Call<'_>, pool: bool, micro: Micro) {
    let Micro { mr, mc, pair_align, block } = micro;
    let &crate::Call { m, n, k, dst, dst_rs, accumulate, rhs, .. } = call;
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        // An empty sum (gemm_raw handles this before calling us).
        if !accumulate {
            for i in 0..m {
                // SAFETY: row i of the m × n block of dst.
                unsafe { std::ptr::write_bytes(dst.add(i * dst_rs), 0, n) };
            }
        }
        return;
    }
    let flops = 2usize.saturating_mul(m).saturating_mul(n).saturating_mul(k);
    let threads = if pool && flops >= MIN_PAR_FLOPS { rayon::current_num_threads().max(1) } else { 1 };
    let kp = k.div_ceil(2);
    let kps = kp.next_multiple_of(pair_align);
    let nc = ((B_CHUNK_BYTES / 4 / kps.max(1)) / NR).max(1) * NR;
    let nc = nc.min(n.next_multiple_of(NR));
    let pr = crate::SendCall(*call);
    let mt = m.div_ceil(mr);
    let run = move || {
        with_aligned_buf(&PACK_B, kps * nc, |bbuf| {
            for jc in (0..n).step_by(nc) {
                let chunk_end = n.min(jc + nc);
                let np = (chunk_end - jc).div_ceil(NR);
                let b = &mut bbuf[..np * kps * NR];
                if kps > kp {
                    // The pad pairs of every panel: zero products.
                    b.chunks_mut(kps * NR).for_each(|panel| panel[kp * NR..].fill(0));
                }
                if rhs.cs == 1 {
                    // Row-major B: groups of up to 8 panels, about 8 per thread.
                    let group = (np / (threads * 8)).clamp(1, 8);
                    let pack = |(g, panels): (usize, &mut [u32])| {
                        let j0 = jc + g * group * NR;
                        // SAFETY: rhs holds the k × n view; j0 < chunk_end ≤ n.
                        unsafe { pack_b_rows(panels, &rhs, k, kps, j0, (group * NR).min(chunk_end - j0)) }
                    };
                    if threads > 1 {
                        b.par_chunks_mut(group * kps * NR).enumerate().for_each(pack);
                    } else {
                        b.chunks_mut(group * kps * NR).enumerate().for_each(pack);
                    }
                } else {
                    let pack = |(q, panel): (usize, &mut [u32])| {
                        let j0 = jc + q * NR;
                        // SAFETY: rhs holds the k × n view; j0 < chunk_end ≤ n.
                        unsafe { pack_b_panel(panel, &rhs, k, j0, NR.min(chunk_end - j0)) }
                    };
                    if threads > 1 {
                        b.par_chunks_mut(kps * NR).enumerate().for_each(pack);
                    } else {
                        b.chunks_mut(kps * NR).enumerate().for_each(pack);
                    }
                }
                let b = &*b;
                if threads == 1 {
                    // SAFETY: the whole block is this thread's.
                    unsafe { block(&pr, b, jc, 0, m, 0, np) };
                } else if mt >= 2 * threads {
                    // Row blocks, several per thread so that a slower core
                    // (shared machine) takes fewer of them.
                    let per = mt.div_ceil(threads * TASKS_PER_THREAD).min(mc / mr);
                    (0..mt.div_ceil(per)).into_par_iter().for_each(|t| {
                        let (r0, r1) = (t * per * mr, ((t + 1) * per * mr).min(m));
                        // SAFETY: tasks own disjoint row ranges.
                        unsafe { block(&pr, b, jc, r0, r1, 0, np) };
                    });
                } else {
                    // Few rows: blocks of column panels.
                    let per = np.div_ceil(threads * TASKS_PER_THREAD);
                    (0..np.div_ceil(per)).into_par_iter().for_each(|t| {
                        // SAFETY: tasks own disjoint panel ranges.
                        unsafe { block(&pr, b, jc, 0, m, t * per, ((t + 1) * per).min(np)) };
                    });
                }
            }
        })
    };
    if threads > 1 && rayon::current_thread_index().is_none() {
        // From outside the pool: enter it once, so that the parallel
        // loops below are spawned by a worker, not injected cold each.
        rayon::scope(|_| run());
    } else {
        run();
    }
}
