//! Central finite differences, for the gradient checks of every kernel and
//! family (tests in this crate and the families' tests).

/// Checks `analytic`, the gradient of `f` at `x`, against central
/// differences with step `h` at every element: panics unless
/// `|analytic − numeric| ≤ atol + rtol·|numeric|` everywhere. Prints the
/// worst error (with `--nocapture`). The step is measured as stored in f32
/// (`(x + h) − (x − h)`), so rounding of `x ± h` does not bias the quotient.
pub fn check_gradient(
    what: &str,
    x: &[f32],
    analytic: &[f32],
    (h, atol, rtol): (f32, f64, f64),
    f: impl Fn(&[f32]) -> f64,
) {
    assert_eq!(x.len(), analytic.len(), "{what}: gradient length");
    let mut worst = (0.0f64, 0usize);
    let mut xs = x.to_vec();
    for i in 0..x.len() {
        let orig = xs[i];
        xs[i] = orig + h;
        let up = f(&xs);
        let hi = xs[i];
        xs[i] = orig - h;
        let down = f(&xs);
        let lo = xs[i];
        xs[i] = orig;
        let numeric = (up - down) / (hi - lo) as f64;
        let err = (analytic[i] as f64 - numeric).abs();
        let allowed = atol + rtol * numeric.abs();
        assert!(err <= allowed, "{what}[{i}]: analytic {} vs numeric {numeric} (err {err:.2e})", analytic[i]);
        if err > worst.0 {
            worst = (err, i);
        }
    }
    eprintln!("{what}: {} elements, worst abs error {:.2e} at {}", x.len(), worst.0, worst.1);
}

/// `Σ a·b` in f64: the probe that turns an output into a scalar loss.
pub fn dot(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(&x, &y)| x as f64 * y as f64).sum()
}
