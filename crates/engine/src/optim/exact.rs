//! Exact sums of non-negative f32 values ([`SumF32`]) and of f32 squares
//! ([`SumSq`]): fixed-point integers wide enough for any f32 (or its
//! square), so a sum does not depend on the order or the grouping of its
//! terms. Ranks holding different parts of a tensor add their partial
//! sums (as integers, over any collective) and get the bits one rank
//! holding all of it gets; the value is rounded to f64 once, at the end.
//!
//! Every f32 is an integer multiple of 2⁻¹⁴⁹ (its square of 2⁻²⁹⁸), below
//! 2¹²⁸ (2²⁵⁶). Limbs hold 32 bits each in a u64, so fewer than 2³² terms
//! add without carrying; [`ExactSum::normalize`] carries. The caller
//! normalizes at least every 2³¹ terms (merged sums count theirs), and
//! reading or sending a value normalizes a copy. Infinities and NaNs are counted apart:
//! a sum with a NaN is NaN, else with an infinity +∞ — what a float sum gives.

/// Terms a sum may take between two normalizations (each adds < 2³² to a limb).
pub const TERMS_BETWEEN_CARRIES: usize = 1 << 31;

/// An exact sum with `L` limbs of 32 bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExactSum<const L: usize> {
    limbs: [u64; L],
    inf: u64,
    nan: u64,
}

/// Sums of non-negative f32 values: least significant bit 2⁻¹⁴⁹; 277 bits
/// for one term and 32 for up to 2³² of them.
pub type SumF32 = ExactSum<10>;

/// Sums of f32 squares: least significant bit 2⁻²⁹⁸; 554 bits for one
/// term and 32 for up to 2³² of them.
pub type SumSq = ExactSum<19>;

impl<const L: usize> Default for ExactSum<L> {
    fn default() -> Self {
        Self { limbs: [0; L], inf: 0, nan: 0 }
    }
}

/// An f32's integer mantissa and the shift placing it on the 2⁻¹⁴⁹ grid
/// (`x = m · 2^(s − 149)`), or `None` for an infinity or NaN (`Some(true)`: NaN).
#[inline(always)]
fn decompose(x: f32) -> Result<(u64, u32), bool> {
    let b = x.to_bits() & 0x7fff_ffff;
    let e = b >> 23;
    let frac = b & 0x7f_ffff;
    if e == 0xff {
        return Err(frac != 0);
    }
    let m = if e == 0 { frac } else { frac | 0x80_0000 };
    Ok((m as u64, e.max(1) - 1))
}

impl<const L: usize> ExactSum<L> {
    /// f64 values one sum takes on the wire ([`ExactSum::write`]).
    pub const WIRE: usize = L + 2;

    #[inline(always)]
    fn non_finite(&mut self, nan: bool) {
        if nan {
            self.nan += 1;
        } else {
            self.inf += 1;
        }
    }

    /// Carries every limb's excess into the next: each limb < 2³² after.
    pub fn normalize(&mut self) {
        let mut carry = 0u64;
        for l in self.limbs.iter_mut() {
            let t = *l as u128 + carry as u128;
            *l = (t & 0xffff_ffff) as u64;
            carry = (t >> 32) as u64;
        }
        debug_assert_eq!(carry, 0, "an exact sum outgrew its limbs");
    }

    /// Adds `other` (the same kind of sum) limb by limb: the terms of both
    /// count towards [`TERMS_BETWEEN_CARRIES`].
    #[inline]
    pub fn merge(&mut self, other: &Self) {
        for (a, b) in self.limbs.iter_mut().zip(other.limbs) {
            *a += b;
        }
        self.inf += other.inf;
        self.nan += other.nan;
    }

    /// Writes the sum as [`ExactSum::WIRE`] f64 integers below 2³²:
    /// summing such buffers over up to 2²¹ ranks (f64 adds integers
    /// below 2⁵³ exactly, in any order) and [`ExactSum::read`]ing the
    /// result gives the sum of the ranks' sums.
    pub fn write(&self, out: &mut [f64]) {
        let mut s = *self;
        s.normalize();
        for (o, &l) in out.iter_mut().zip(&s.limbs) {
            *o = l as f64;
        }
        out[L] = s.inf.min(1) as f64;
        out[L + 1] = s.nan.min(1) as f64;
    }

    /// The sum written by [`ExactSum::write`] (or a sum of such buffers).
    pub fn read(src: &[f64]) -> Self {
        let mut s = Self::default();
        for (l, &x) in s.limbs.iter_mut().zip(src) {
            *l = x as u64;
        }
        s.inf = src[L] as u64;
        s.nan = src[L + 1] as u64;
        s.normalize();
        s
    }

    /// The sum rounded to the nearest f64, the limbs' unit being 2^`lsb`.
    fn value(&self, lsb: i32) -> f64 {
        if self.nan > 0 {
            return f64::NAN;
        }
        if self.inf > 0 {
            return f64::INFINITY;
        }
        let mut s = *self;
        s.normalize();
        let Some(h) = s.limbs.iter().rposition(|&l| l != 0) else { return 0.0 };
        // The top three limbs (≥ 65 significant bits) and a sticky bit for
        // the rest: one correctly rounded conversion.
        let lo = h.saturating_sub(2);
        let mut top: u128 = 0;
        for i in (lo..=h).rev() {
            top = (top << 32) | s.limbs[i] as u128;
        }
        if s.limbs[..lo].iter().any(|&l| l != 0) {
            top |= 1;
        }
        let exp = lsb + 32 * lo as i32;
        // 2^exp stays a normal f64 here (|exp| < 1022).
        top as f64 * f64::from_bits(((exp + 1023) as u64) << 52)
    }
}

impl SumF32 {
    /// Adds `x ≥ 0` (a negative x counts as |x|).
    #[inline(always)]
    pub fn add(&mut self, x: f32) {
        match decompose(x) {
            Ok((m, s)) => {
                let v = m << (s % 32);
                // s < 254, so i ≤ 7 (the mask lets the compiler see it).
                let i = (s / 32) as usize & 7;
                self.limbs[i] += v & 0xffff_ffff;
                self.limbs[i + 1] += v >> 32;
            }
            Err(nan) => self.non_finite(nan),
        }
    }

    /// The sum, rounded to the nearest f64.
    pub fn get(&self) -> f64 {
        self.value(-149)
    }
}

impl SumSq {
    /// Adds `x²` (exact: a square of an f32 has at most 48 significant bits).
    #[inline(always)]
    pub fn add_square(&mut self, x: f32) {
        match decompose(x) {
            Ok((m, s)) => {
                let s = 2 * s;
                let v = ((m * m) as u128) << (s % 32);
                // s < 508, so i ≤ 15.
                let i = (s / 32) as usize & 15;
                self.limbs[i] += (v & 0xffff_ffff) as u64;
                self.limbs[i + 1] += ((v >> 32) & 0xffff_ffff) as u64;
                self.limbs[i + 2] += (v >> 64) as u64;
            }
            Err(nan) => self.non_finite(nan),
        }
    }

    /// The sum of squares, rounded to the nearest f64.
    pub fn get(&self) -> f64 {
        self.value(-298)
    }

    /// The exact Σ x² of `xs`, normalized: the same sum as
    /// [`SumSq::add_square`] of each, faster for long slices. Squared
    /// mantissas (< 2⁴⁸) are first added per exponent in u64 bins — 2¹⁶
    /// values at a time, so a bin stays below 2⁶⁴ — and the bins then
    /// placed on the grid.
    pub fn of_squares(xs: &[f32]) -> Self {
        let mut out = Self::default();
        for block in xs.chunks(1 << 16) {
            let mut bins = [0u64; 256];
            for &x in block {
                let b = x.to_bits() & 0x7fff_ffff;
                let e = (b >> 23) as usize;
                let m = (b & 0x7f_ffff | u32::from(e != 0) << 23) as u64;
                bins[e] += m * m;
            }
            // e = 255 holds the non-finite values' (meaningless) squares.
            for x in block.iter().filter(|x| !x.is_finite()) {
                out.non_finite(x.is_nan());
            }
            for (e, &bin) in bins[..255].iter().enumerate() {
                if bin != 0 {
                    let s = 2 * (e.max(1) as u32 - 1);
                    let v = (bin as u128) << (s % 32);
                    let i = (s / 32) as usize & 15;
                    out.limbs[i] += (v & 0xffff_ffff) as u64;
                    out.limbs[i + 1] += ((v >> 32) & 0xffff_ffff) as u64;
                    out.limbs[i + 2] += (v >> 64) as u64;
                }
            }
            out.normalize();
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Values across the f32 range: subnormals, tiny, ordinary, huge.
    fn any_value() -> impl Strategy<Value = f32> {
        prop_oneof![
            (0u32..0x80_0000).prop_map(f32::from_bits),
            (1e-30f32..1e-20),
            (0.0f32..10.0),
            (1e20f32..1e30),
            Just(0.0f32),
        ]
    }

    /// Exact rational reference: the sum as an arbitrary-precision integer
    /// multiple of 2⁻²⁹⁸ (u32 digits), rounded to f64 by its top bits.
    fn reference(xs: &[f32], square: bool) -> f64 {
        let mut digits = vec![0u64; 40];
        for &x in xs {
            let x = x as f64;
            let t = if square { x * x } else { x };
            // t is exact in f64 (squares of f32 have ≤ 48 bits): t = m · 2^e.
            if t == 0.0 {
                continue;
            }
            let bits = t.to_bits();
            let e = ((bits >> 52) & 0x7ff) as i32;
            let m = if e == 0 { bits & ((1 << 52) - 1) } else { (bits & ((1 << 52) - 1)) | (1 << 52) };
            // In units of 2⁻²⁹⁸ (m's trailing zeros absorb a negative shift).
            let sh = e.max(1) - 1075 + 298;
            let (m, shift) = if sh < 0 { (m >> -sh, 0u32) } else { (m, sh as u32) };
            let v = (m as u128) << (shift % 32);
            let i = (shift / 32) as usize;
            for k in 0..4 {
                digits[i + k] += ((v >> (32 * k)) & 0xffff_ffff) as u64;
            }
        }
        let mut carry = 0;
        for d in digits.iter_mut() {
            let t = *d + carry;
            *d = t & 0xffff_ffff;
            carry = t >> 32;
        }
        let mut acc = 0.0f64;
        for (i, &d) in digits.iter().enumerate().rev() {
            // Only the top few digits matter for an f64; add them high to low.
            if d != 0 {
                acc += d as f64 * 2f64.powi(32 * i as i32 - 298);
            }
        }
        acc
    }

    proptest! {
        /// The sum is the same for any split into parts and any order of
        /// merging them, and it is the exact sum rounded once (to 1 ulp of
        /// the reference's own top-digit rounding).
        #[test]
        fn any_grouping_gives_the_same_bits(
            xs in proptest::collection::vec(any_value(), 0..200),
            cuts in proptest::collection::vec(0usize..200, 0..5),
        ) {
            let whole = xs.iter().fold(SumF32::default(), |mut s, &x| { s.add(x); s });
            let whole_sq = xs.iter().fold(SumSq::default(), |mut s, &x| { s.add_square(x); s });
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c.min(xs.len())).collect();
            cuts.sort();
            let mut parts = Vec::new();
            let mut at = 0;
            for &c in cuts.iter().chain([xs.len()].iter()) {
                parts.push(&xs[at..c.max(at)]);
                at = c.max(at);
            }
            // Merged last to first, and through the wire format.
            let mut merged = SumF32::default();
            let mut wire = vec![0.0f64; SumSq::WIRE];
            for p in parts.iter().rev() {
                let mut s = SumF32::default();
                p.iter().for_each(|&x| s.add(x));
                merged.merge(&s);
                let mut q = SumSq::default();
                p.iter().for_each(|&x| q.add_square(x));
                let mut w = vec![0.0; SumSq::WIRE];
                q.write(&mut w);
                wire.iter_mut().zip(&w).for_each(|(a, b)| *a += b);
            }
            prop_assert_eq!(merged.get().to_bits(), whole.get().to_bits());
            let mut with_special = xs.clone();
            with_special.extend(cuts.iter().map(|&c| [f32::INFINITY, f32::NAN, -0.0, -1.5][c % 4]));
            let mut one_by_one = SumSq::default();
            with_special.iter().for_each(|&x| one_by_one.add_square(x));
            prop_assert_eq!(SumSq::of_squares(&with_special).get().to_bits(), one_by_one.get().to_bits());
            prop_assert_eq!(SumSq::read(&wire).get().to_bits(), whole_sq.get().to_bits());
            for (got, square) in [(whole.get(), false), (whole_sq.get(), true)] {
                let want = reference(&xs, square);
                prop_assert!((got - want).abs() <= want * 2.0 * f64::EPSILON, "{} vs {}", got, want);
            }
        }
    }

    #[test]
    fn hand_checked_sums_and_non_finite_terms() {
        let mut s = SumF32::default();
        for x in [1.0f32, 2.0, 0.5, f32::from_bits(1)] {
            s.add(x);
        }
        // 3.5 + 2⁻¹⁴⁹ rounds to 3.5 in f64; the tiny term is still held exactly.
        assert_eq!(s.get(), 3.5);
        let mut q = SumSq::default();
        for x in [3.0f32, 4.0] {
            q.add_square(x);
        }
        assert_eq!(q.get(), 25.0);
        let mut big = SumF32::default();
        big.add(f32::MAX);
        big.add(f32::MAX);
        assert_eq!(big.get(), 2.0 * f32::MAX as f64);
        let (mut inf, mut nan) = (s, s);
        inf.add(f32::INFINITY);
        nan.add(f32::NAN);
        nan.add(f32::INFINITY);
        assert_eq!(inf.get(), f64::INFINITY);
        assert!(nan.get().is_nan());
        // 1 + 2⁻⁵³ is a tie and rounds to even (1); 2⁻¹⁴⁰ more lies below
        // the limbs the conversion reads, and its sticky bit rounds up.
        let mut t = SumF32::default();
        for x in [1.0f32, 2f32.powi(-53)] {
            t.add(x);
        }
        assert_eq!(t.get(), 1.0);
        t.add(2f32.powi(-140));
        assert_eq!(t.get(), 1.0 + f64::EPSILON);
    }
}
