//! Matrix multiplication for the model kernels.
//!
//! One entry point, [`gemm_into`] (and its raw-pointer twin [`gemm_raw`]),
//! computes `dst (+)= alpha · lhs · rhs` on strided f32 views. [`Par`] says
//! how: on the whole rayon pool or on the calling thread only, and with f32
//! or bf16 operands ([`Operands`]). bf16 operands are rounded to bf16 (round
//! to nearest even) while packing and multiplied with f32 accumulation by
//! the AVX512-BF16 kernel of [`bf16`]; on a CPU without it they fall back to
//! f32 (see [`Operands::effective`]), unless `MACROBATCH_BF16=portable`
//! selects [`bf16::portable`], the same arithmetic and bits without the
//! instruction.
//!
//! Invariant: for a given shape, layout and [`Par`], the result does not
//! depend on the number of threads in the pool — work is split over rows and
//! columns of `dst`, never over the summed dimension `k`.

pub mod backend;
pub mod bf16;
pub mod packed;

pub use backend::{Backend, Key, ShapeStats};
pub use packed::{gemm_dy_w, gemm_x_wt, PackError, PackFormat, PackedMatrix};

use std::cell::Cell;
use std::thread::LocalKey;

/// The vector instruction set the f32 kernels run at on this CPU: the
/// `gemm` crate's micro-kernels and our `multiversion` loops both pick it at
/// run time. `"AVX-512"` (AVX-512 F, BW, VL and DQ: what our clones ask
/// for), `"AVX2"` (with FMA), else the baseline (`"SSE2"` on x86-64, or the
/// architecture's name). Each path computes every dot product and loop as
/// the same IEEE operations in the same order, so a run's bits do not depend
/// on it (`crates/macrobatch/tests/isa.rs` runs the AVX2 path under qemu and
/// compares).
pub fn vector_isa() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("avx512dq")
        {
            "AVX-512"
        } else if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            "AVX2"
        } else {
            "SSE2"
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        std::env::consts::ARCH
    }
}

/// Runs `f` on this thread's buffer `key` of at least `len` elements.
/// The buffer is taken out of the cell meanwhile, so a nested call (work
/// stealing inside `f`) gets a fresh one instead of aliasing it.
pub(crate) fn with_buf<T: Copy + Default + 'static, R>(
    key: &'static LocalKey<Cell<Vec<T>>>,
    len: usize,
    f: impl FnOnce(&mut [T]) -> R,
) -> R {
    let mut v = key.take();
    if v.len() < len {
        v.resize(len, T::default());
    }
    let r = f(&mut v[..len]);
    key.set(v);
    r
}

/// A strided view of a matrix: element `(i, j)` is at `offset + i·rs + j·cs`.
#[derive(Debug, Clone, Copy)]
pub struct Strided<'a> {
    /// Backing slice.
    pub data: &'a [f32],
    /// First element.
    pub offset: usize,
    /// Row stride.
    pub rs: usize,
    /// Column stride.
    pub cs: usize,
}

impl<'a> Strided<'a> {
    /// A dense row-major matrix with `cols` columns.
    pub fn rows(data: &'a [f32], cols: usize) -> Self {
        Self { data, offset: 0, rs: cols, cs: 1 }
    }

    /// The transpose of a dense row-major matrix with `cols` columns.
    pub fn transposed(data: &'a [f32], cols: usize) -> Self {
        Self { data, offset: 0, rs: 1, cs: cols }
    }

    /// The same matrix, transposed.
    pub fn t(self) -> Self {
        Self { rs: self.cs, cs: self.rs, ..self }
    }

    fn check(&self, n_rows: usize, n_cols: usize) {
        if n_rows > 0 && n_cols > 0 {
            // Checked: a wrapped sum would pass and point outside `data`.
            let last = last_index(self.offset, n_rows, self.rs, n_cols, self.cs);
            assert!(
                last.is_some_and(|l| l < self.data.len()),
                "matrix view out of bounds: {last:?} >= {}",
                self.data.len()
            );
        }
    }

    /// Pointer to element (0, 0).
    fn ptr(&self) -> *const f32 {
        // SAFETY: `check` was called by every public entry point before this.
        unsafe { self.data.as_ptr().add(self.offset) }
    }
}

/// `offset + (rows - 1)·rs + (cols - 1)·cs` (`rows, cols ≥ 1`), `None` on overflow.
fn last_index(offset: usize, rows: usize, rs: usize, cols: usize, cs: usize) -> Option<usize> {
    (rows - 1).checked_mul(rs)?.checked_add((cols - 1).checked_mul(cs)?)?.checked_add(offset)
}

/// The element type a GEMM's operands are rounded to before multiplying.
/// Accumulation is f32 either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Operands {
    /// f32 operands, f32 accumulation.
    #[default]
    F32,
    /// Operands rounded to bf16 (nearest even), f32 accumulation.
    Bf16,
}

impl Operands {
    /// What this CPU will actually do when asked for `self`: bf16 runs where
    /// [`bf16::kernel`] names a kernel (AVX512-BF16, detected at run time, or
    /// the portable one when selected); elsewhere the GEMM runs in f32.
    pub fn effective(self) -> Operands {
        match self {
            Operands::Bf16 if bf16::supported() => Operands::Bf16,
            _ => Operands::F32,
        }
    }
}

/// How one GEMM runs: on the rayon pool or on the calling thread, and with
/// which operands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Par {
    /// Use the whole rayon pool (false inside a parallel loop).
    pub pool: bool,
    /// Operand type.
    pub operands: Operands,
}

impl Par {
    /// The calling thread only, f32.
    pub const ONE: Par = Par { pool: false, operands: Operands::F32 };

    /// The same threading with these operands (taken only where the CPU
    /// supports them, see [`Operands::effective`]).
    pub fn with(self, operands: Operands) -> Par {
        Par { operands: operands.effective(), ..self }
    }
}

/// Threads to give one GEMM: all of the pool at top level, one inside a
/// parallel loop. f32 operands.
pub fn parallelism(inside_parallel_loop: bool) -> Par {
    Par { pool: !inside_parallel_loop && rayon::current_num_threads() > 1, operands: Operands::F32 }
}

/// The sizes of one GEMM: `dst[m×n] = lhs[m×k] · rhs[k×n]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GemmDims {
    /// Rows of `dst` and `lhs`.
    pub m: usize,
    /// Columns of `dst` and `rhs`.
    pub n: usize,
    /// The summed dimension.
    pub k: usize,
}

/// Where a GEMM writes: element (0, 0) at `offset`, rows `rs` apart, added
/// into what is there (`accumulate`) or overwriting it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GemmOut {
    /// Index of element (0, 0) in the destination.
    pub offset: usize,
    /// Row stride of the destination.
    pub rs: usize,
    /// Add into the destination (else overwrite).
    pub accumulate: bool,
}

impl GemmOut {
    /// Overwrite a destination that starts at element 0 with rows `rs` apart
    /// (`rs` = n: a dense `m × n` matrix).
    pub fn overwrite(rs: usize) -> Self {
        GemmOut { offset: 0, rs, accumulate: false }
    }
}

/// `dst[m×n] (at out.offset, row stride out.rs) = (out.accumulate ? dst : 0)
/// + alpha · lhs[m×k] · rhs[k×n]`.
///
/// All three views are bounds-checked (`dst` here, the operands by
/// [`gemm_raw`]); `dst` is a plain mutable slice.
pub fn gemm_into(
    dims: GemmDims,
    dst: &mut [f32],
    out: GemmOut,
    lhs: Strided<'_>,
    rhs: Strided<'_>,
    alpha: f32,
    par: Par,
) {
    let GemmDims { m, n, .. } = dims;
    if m == 0 || n == 0 {
        return;
    }
    assert!(last_index(out.offset, m, out.rs, n, 1).is_some_and(|l| l < dst.len()), "gemm dst out of bounds");
    // SAFETY: the m × n block of `dst` was checked above and `dst` is
    // exclusively borrowed; `gemm_raw` checks the operand views.
    unsafe { gemm_raw(dims, dst.as_mut_ptr().add(out.offset), GemmOut { offset: 0, ..out }, lhs, rhs, alpha, par) }
}

/// One GEMM: `dst[m×n]` (row stride `dst_rs`) `= (accumulate ? dst : 0) +
/// alpha · lhs[m×k] · rhs[k×n]`. What every backend receives.
#[derive(Debug, Clone, Copy)]
pub struct Call<'a> {
    /// Rows of `dst`.
    pub m: usize,
    /// Columns of `dst`.
    pub n: usize,
    /// The summed dimension.
    pub k: usize,
    /// Element (0, 0) of `dst`.
    pub dst: *mut f32,
    /// Row stride of `dst`.
    pub dst_rs: usize,
    /// Add into `dst` (else overwrite).
    pub accumulate: bool,
    /// The `m × k` operand.
    pub lhs: Strided<'a>,
    /// The `k × n` operand.
    pub rhs: Strided<'a>,
    /// Scale of the product.
    pub alpha: f32,
}

impl Call<'_> {
    /// The same call on rows `r0..r0 + rows` of `dst` (and `lhs`).
    fn rows(&self, r0: usize, rows: usize) -> Self {
        // SAFETY (of later use): a sub-block of the caller's `dst` block.
        let dst = self.dst.wrapping_add(r0 * self.dst_rs);
        Call { m: rows, dst, lhs: Strided { offset: self.lhs.offset + r0 * self.lhs.rs, ..self.lhs }, ..*self }
    }

    /// The same call on columns `c0..c0 + cols` of `dst` (and `rhs`).
    fn cols(&self, c0: usize, cols: usize) -> Self {
        let dst = self.dst.wrapping_add(c0);
        Call { n: cols, dst, rhs: Strided { offset: self.rhs.offset + c0 * self.rhs.cs, ..self.rhs }, ..*self }
    }
}

/// A [`Call`] shared with other threads, each of which writes a disjoint
/// block of its `dst` (rows or column panels; `split` and the bf16 kernel).
#[derive(Clone, Copy)]
pub(crate) struct SendCall<'a>(pub(crate) Call<'a>);
// SAFETY: the threads a SendCall reaches write disjoint blocks of `dst`,
// which the caller of `gemm_raw` guarantees nobody else touches meanwhile;
// the operands are shared reads.
unsafe impl Send for SendCall<'_> {}
// SAFETY: as above.
unsafe impl Sync for SendCall<'_> {}

/// [`gemm_into`] writing through a raw pointer, for disjoint strided outputs
/// written from several threads (attention heads).
///
/// # Safety
/// `dst` + `out.offset` must be valid for writes of the `m × n` block with
/// row stride `out.rs`, no other thread may touch that block meanwhile, and
/// `lhs`/`rhs` must hold the `m × k` and `k × n` views (checked). Rows of
/// `dst` may not overlap (`out.rs ≥ n` unless `m == 1`; checked).
pub unsafe fn gemm_raw(
    dims: GemmDims,
    dst: *mut f32,
    out: GemmOut,
    lhs: Strided<'_>,
    rhs: Strided<'_>,
    alpha: f32,
    par: Par,
) {
    let (GemmDims { m, n, k }, dst, dst_rs, accumulate) = (dims, dst.wrapping_add(out.offset), out.rs, out.accumulate);
    if m == 0 || n == 0 {
        return;
    }
    // Overlapping rows of dst would be written by several threads at once.
    assert!(m == 1 || dst_rs >= n, "gemm dst rows overlap: row stride {dst_rs} < {n} columns");
    lhs.check(m, k);
    rhs.check(k, n);
    if k == 0 {
        if !accumulate {
            for i in 0..m {
                std::ptr::write_bytes(dst.add(i * dst_rs), 0, n);
            }
        }
        return;
    }
    let call = Call { m, n, k, dst, dst_rs, accumulate, lhs, rhs, alpha };
    if par.operands == Operands::Bf16 && bf16::supported() {
        if par.pool {
            let key = Key::new(&call, true);
            let t = std::time::Instant::now();
            bf16::gemm(&call, true);
            backend::record(key, Backend::Bf16, t.elapsed().as_secs_f64(), false);
        } else {
            bf16::gemm(&call, false);
        }
        return;
    }
    if par.pool && rayon::current_num_threads() > 1 {
        backend::pool_f32(&call);
    } else {
        crate_gemm(&call, gemm::Parallelism::None);
    }
}

/// The `gemm` crate (0.19, AVX-512 kernels through `x86-v4`).
///
/// # Safety
/// As [`gemm_raw`].
unsafe fn crate_gemm(c: &Call<'_>, threads: gemm::Parallelism) {
    // gemm computes dst := alpha·dst + beta·lhs·rhs (alpha ignored unless read_dst).
    gemm::gemm(
        c.m,
        c.n,
        c.k,
        c.dst,
        1,
        c.dst_rs as isize,
        c.accumulate,
        c.lhs.ptr(),
        c.lhs.cs as isize,
        c.lhs.rs as isize,
        c.rhs.ptr(),
        c.rhs.cs as isize,
        c.rhs.rs as isize,
        1.0,
        c.alpha,
        false,
        false,
        false,
        threads,
    );
}
