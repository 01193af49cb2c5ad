//! Rotary position embeddings as transformers computes them: f32 inverse
//! frequencies, f32 angles, the `rotate_half` pairing `(j, j + d/2)`, and
//! Llama 3's frequency scaling (`rope_scaling.rope_type = "llama3"`).

use crate::Positions;
use rayon::prelude::*;

/// Llama 3's RoPE frequency scaling: transformers'
/// `_compute_llama3_parameters`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Llama3Scaling {
    /// `factor`: low frequencies are divided by it.
    pub factor: f64,
    /// `low_freq_factor`.
    pub low_freq_factor: f64,
    /// `high_freq_factor`.
    pub high_freq_factor: f64,
    /// `original_max_position_embeddings`: the context length of pretraining.
    pub original_max_position_embeddings: usize,
}

impl Llama3Scaling {
    /// Scales default inverse frequencies in place, in f32 as transformers
    /// does (torch computes with the Python scalars cast to the tensor's
    /// float32):
    ///
    /// ```python
    /// low_freq_wavelen = old_context_len / low_freq_factor
    /// high_freq_wavelen = old_context_len / high_freq_factor
    /// wavelen = 2 * math.pi / inv_freq
    /// inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    /// smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    /// smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    /// is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    /// inv_freq_llama = torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)
    /// ```
    pub fn apply(&self, inv_freq: &mut [f32]) {
        let old = self.original_max_position_embeddings as f64;
        let low_wavelen = (old / self.low_freq_factor) as f32;
        let high_wavelen = (old / self.high_freq_factor) as f32;
        let (factor, low, span) =
            (self.factor as f32, self.low_freq_factor as f32, (self.high_freq_factor - self.low_freq_factor) as f32);
        let two_pi = (2.0 * std::f64::consts::PI) as f32;
        for f in inv_freq.iter_mut() {
            let wavelen = two_pi / *f;
            let scaled = if wavelen > low_wavelen { *f / factor } else { *f };
            let medium = wavelen >= high_wavelen && wavelen <= low_wavelen;
            *f = if medium {
                let smooth = (old as f32 / wavelen - low) / span;
                (1.0 - smooth) * scaled / factor + smooth * scaled
            } else {
                scaled
            };
        }
    }
}

/// Rotary tables for positions `0..t`: `cos`/`sin` `[t, head_dim/2]`,
/// computed as transformers does (f32 inverse frequencies `1/θ^(2j/d)`,
/// f32 angles `pos·inv_freq`), so long positions round the same way.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Rope {
    /// Positions covered.
    pub t: usize,
    /// Half the head width.
    pub half: usize,
    /// `cos(pos · inv_freq[j])`, row-major `[t, half]`.
    pub cos: Vec<f32>,
    /// `sin(pos · inv_freq[j])`.
    pub sin: Vec<f32>,
}

/// The inverse frequencies `1/θ^(2j/d)` of heads `head_dim` wide, in f32,
/// scaled as `scaling` says.
pub fn inv_freq(head_dim: usize, theta: f64, scaling: Option<&Llama3Scaling>) -> Vec<f32> {
    let theta = theta as f32;
    let mut f: Vec<f32> = (0..head_dim / 2).map(|j| 1.0 / theta.powf((2 * j) as f32 / head_dim as f32)).collect();
    if let Some(s) = scaling {
        s.apply(&mut f);
    }
    f
}

/// What Llama 3's scaling divides each pair's plain inverse frequency by
/// (`inv_freq(.., None) / inv_freq(.., Some(scaling))`, in f32): llama.cpp's
/// `rope_freqs` tensor.
pub fn divisors(head_dim: usize, theta: f64, scaling: &Llama3Scaling) -> Vec<f32> {
    let plain = inv_freq(head_dim, theta, None);
    let scaled = inv_freq(head_dim, theta, Some(scaling));
    plain.iter().zip(&scaled).map(|(p, s)| p / s).collect()
}

impl Rope {
    /// Tables for `t` positions of heads `head_dim` wide (even), with
    /// optional Llama 3 frequency scaling.
    pub fn new(t: usize, head_dim: usize, theta: f64, scaling: Option<&Llama3Scaling>) -> Self {
        Self::for_positions(0..t, head_dim, theta, scaling)
    }

    /// Tables for `positions` (rows `positions.end − positions.start`): the
    /// rows [`Rope::new`] computes for those positions, for rows that
    /// continue a sequence (generation with a key/value cache).
    pub fn for_positions(
        positions: std::ops::Range<usize>,
        head_dim: usize,
        theta: f64,
        scaling: Option<&Llama3Scaling>,
    ) -> Self {
        let inv_freq = inv_freq(head_dim, theta, scaling);
        let t = positions.len();
        let angles: Vec<f32> = positions.flat_map(|p| inv_freq.iter().map(move |&f| p as f32 * f)).collect();
        Rope {
            t,
            half: head_dim / 2,
            cos: angles.iter().map(|&a| (a as f64).cos() as f32).collect(),
            sin: angles.iter().map(|&a| (a as f64).sin() as f32).collect(),
        }
    }

    /// Elements held by the two tables (`2·t·head_dim/2`): what
    /// [`Rope::new`] allocates.
    pub fn len_for(t: usize, head_dim: usize) -> usize {
        2 * t * (head_dim / 2)
    }
}

/// Rotates, in place, the first `n_heads` heads of every row of `x` (rows
/// `row_width` apart; row `r` at position `pos.at(r)`, below the tables'
/// length) with HF's
/// `rotate_half` pairing `(j, j + d/2)`:
/// `x'_j = x_j·cos − x_{j+d/2}·sin`, `x'_{j+d/2} = x_{j+d/2}·cos + x_j·sin`.
/// `inverse` applies the transpose rotation (−sin): the backward pass.
pub fn rope_apply(x: &mut [f32], rope: &Rope, row_width: usize, n_heads: usize, inverse: bool, pos: Positions<'_>) {
    engine::profile::timed(engine::profile::Kind::Rope, || {
        let (t, half) = (rope.t, rope.half);
        assert!(n_heads * 2 * half <= row_width, "rope_apply: {n_heads} heads of {} exceed the row width", 2 * half);
        assert!(x.len().is_multiple_of(row_width), "rope_apply: {} values are not rows of {row_width}", x.len());
        assert!(x.is_empty() || t > 0, "rope_apply: empty tables");
        let sign = if inverse { -1.0 } else { 1.0 };
        x.par_chunks_mut(row_width).enumerate().for_each(|(r, row)| {
            let pos = pos.at(r);
            assert!(pos < t, "rope_apply: position {pos} beyond the tables' {t}");
            let (cos, sin) = (&rope.cos[pos * half..][..half], &rope.sin[pos * half..][..half]);
            for head in row[..n_heads * 2 * half].chunks_mut(2 * half) {
                let (a, b) = head.split_at_mut(half);
                for j in 0..half {
                    let (s, c) = (sign * sin[j], cos[j]);
                    let (x1, x2) = (a[j], b[j]);
                    a[j] = x1 * c - x2 * s;
                    b[j] = x2 * c + x1 * s;
                }
            }
        });
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::randn;

    #[test]
    fn rope_inverse_undoes_it_and_matches_rotate_half() {
        let (t, d, heads, w) = (5, 8, 3, 30);
        let rope = Rope::new(t, d, 10000.0, None);
        assert_eq!(rope.cos.len() + rope.sin.len(), Rope::len_for(t, d));
        let x = randn(2 * t * w, 4);
        let mut y = x.clone();
        rope_apply(&mut y, &rope, w, heads, false, Positions::rows(t));
        // Position 3, head 1, pair j = 1: the rotate_half formula by hand.
        let (r, j, half) = (3, 1, d / 2);
        let inv = 1.0 / 10000f64.powf(2.0 * j as f64 / d as f64);
        let (c, s) = ((3.0 * inv).cos(), (3.0 * inv).sin());
        let at = |v: &[f32], k: usize| v[r * w + d + k] as f64;
        assert!((at(&y, j) - (at(&x, j) * c - at(&x, j + half) * s)).abs() < 1e-6);
        assert!((at(&y, j + half) - (at(&x, j + half) * c + at(&x, j) * s)).abs() < 1e-6);
        // Columns past the rotated heads are untouched; the inverse restores x.
        assert_eq!(y[w - 6..w], x[w - 6..w]);
        rope_apply(&mut y, &rope, w, heads, true, Positions::rows(t));
        let err = y.iter().zip(&x).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        assert!(err < 1e-5, "rotation then inverse differs by {err}");
    }

    /// Rows for later positions are the rows of the tables from position 0.
    #[test]
    fn tables_for_later_positions_are_rows_of_the_full_tables() {
        let s = Llama3Scaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 16,
        };
        let full = Rope::new(40, 8, 10000.0, Some(&s));
        let part = Rope::for_positions(29..33, 8, 10000.0, Some(&s));
        assert_eq!((part.t, part.half), (4, 4));
        assert_eq!(part.cos, full.cos[29 * 4..33 * 4]);
        assert_eq!(part.sin, full.sin[29 * 4..33 * 4]);
    }

    /// Llama 3 scaling on head_dim 8, θ = 10000, factor 8, low 1, high 4,
    /// original context 16, computed by hand from transformers' formula:
    /// inv_freq = [1, 0.1, 0.01, 0.001] (= 10000^(-j/4));
    /// wavelen = 2π/inv_freq = [6.283, 62.83, 628.3, 6283];
    /// low_freq_wavelen = 16/1 = 16, high_freq_wavelen = 16/4 = 4.
    /// j=0: 6.283 is neither < 4 nor > 16: medium; smooth = (16/6.283 − 1)/3
    ///      = 0.51549, so (1 − 0.51549)·1/8 + 0.51549·1 = 0.57606.
    /// j=1..3: wavelen > 16: divided by 8 → 0.0125, 0.00125, 0.000125.
    #[test]
    fn llama3_scaling_matches_the_hand_computed_case() {
        let s = Llama3Scaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 16,
        };
        let got = inv_freq(8, 10000.0, Some(&s));
        let smooth = (16.0 / (2.0 * std::f64::consts::PI) - 1.0) / 3.0;
        let want = [(1.0 - smooth) / 8.0 + smooth, 0.0125, 0.00125, 0.000125];
        for (j, (&g, w)) in got.iter().zip(want).enumerate() {
            assert!((g as f64 - w).abs() <= 1e-6 * w, "inv_freq[{j}] = {g}, want {w}");
        }
        assert!((want[0] - 0.57606).abs() < 1e-5);
        // A high frequency (wavelen < high_freq_wavelen) is left alone.
        let s2 = Llama3Scaling { original_max_position_embeddings: 64, ..s };
        assert_eq!(inv_freq(8, 10000.0, Some(&s2))[0], 1.0);
        // The tables use the scaled frequencies.
        let rope = Rope::new(3, 8, 10000.0, Some(&s));
        assert!((rope.cos[4 + 1] as f64 - (0.0125f64).cos()).abs() < 1e-6);
    }
}
