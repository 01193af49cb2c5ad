//! bf16-operand GEMM with f32 accumulation on AVX512-BF16 (`vdpbf16ps`).

use crate::Strided;

/// Whether this CPU has AVX512-BF16 (and AVX-512F/BW), detected once.
pub fn supported() -> bool {
    false
}

/// `dst (+)= alpha · bf16(lhs) · bf16(rhs)`; see [`crate::gemm_raw`].
///
/// # Safety
/// As [`crate::gemm_raw`], and [`supported`] must be true.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn gemm(
    _m: usize,
    _n: usize,
    _k: usize,
    _dst: *mut f32,
    _dst_rs: usize,
    _accumulate: bool,
    _lhs: Strided<'_>,
    _rhs: Strided<'_>,
    _alpha: f32,
    _pool: bool,
) {
    unreachable!("bf16 GEMM without AVX512-BF16")
}
