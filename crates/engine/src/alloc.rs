//! Fallible allocation of large buffers. A failed `try_reserve` is an
//! [`EngineError::OutOfMemory`] the caller reports with its phase and what
//! to change, instead of the allocator's abort. A global allocator may ask
//! [`failure_is_handled`] whether the allocation in progress on this thread
//! has such a fallback (the binary's reports every other failure itself).

use crate::EngineError;
use std::cell::Cell;

thread_local! {
    static HANDLED: Cell<bool> = const { Cell::new(false) };
}

/// Whether a failure of the allocation in progress on this thread is
/// returned to its caller (inside [`try_zeros`] / [`try_copy`]).
pub fn failure_is_handled() -> bool {
    HANDLED.try_with(Cell::get).unwrap_or(false)
}

/// Reserves room for `n` more elements, marking the reservation as handled.
fn try_reserve<T>(v: &mut Vec<T>, n: usize, what: &'static str) -> Result<(), EngineError> {
    let _ = HANDLED.try_with(|h| h.set(true));
    let r = v.try_reserve_exact(n);
    let _ = HANDLED.try_with(|h| h.set(false));
    r.map_err(|_| EngineError::OutOfMemory { what, bytes: n as u128 * std::mem::size_of::<T>() as u128 })
}

/// `n` zeros, or [`EngineError::OutOfMemory`] naming `what`.
pub fn try_zeros(n: usize, what: &'static str) -> Result<Vec<f32>, EngineError> {
    let mut v = Vec::new();
    try_reserve(&mut v, n, what)?;
    v.resize(n, 0.0);
    Ok(v)
}

/// A copy of `src`, or [`EngineError::OutOfMemory`] naming `what`.
pub fn try_copy(src: &[f32], what: &'static str) -> Result<Vec<f32>, EngineError> {
    let mut v = Vec::new();
    try_reserve(&mut v, src.len(), what)?;
    v.extend_from_slice(src);
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_impossible_buffer_is_an_error_not_an_abort() {
        let e = try_zeros(usize::MAX / 8, "the test buffer").unwrap_err().to_string();
        assert!(e.contains("the test buffer") && e.contains("out of memory"), "{e}");
        assert!(!failure_is_handled(), "the mark ends with the reservation");
        assert_eq!(try_copy(&[1.0, 2.0], "x").unwrap(), [1.0, 2.0]);
        assert_eq!(try_zeros(3, "x").unwrap(), [0.0; 3]);
    }
}
