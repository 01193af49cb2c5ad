//! Dropout on the LoRA branch's input, as PEFT applies it
//! (`lora_B(lora_A(dropout(x))) · s`; the base product sees `x` whole):
//! each input feature is zeroed with probability p and the others scaled
//! by 1/(1 − p), during training only.
//!
//! The masks come from a counter-based stream, not from a generator that
//! advances with every micro-step: the mask of element `(t, k)` of a
//! sequence in projection `pr` of layer `l` is a pure function of the
//! optimizer step, the sequence's own tokens (inputs and targets), `t`,
//! `l`, `pr` and `k`. So
//! - the random stream's position is the optimizer step, which every
//!   checkpoint already holds: a resumed run draws the masks the
//!   uninterrupted run drew, bit for bit;
//! - a sequence gets the same masks whichever micro-batch, rank or
//!   position within its micro-batch it lands in: K micro-batches of m
//!   sequences equal one of K·m (and `verify` holds) under dropout too;
//! - two identical sequences in one optimizer step share their masks (the
//!   only correlation the keying introduces).

use engine::rng::SplitMix64;
use engine::TokenBatch;
use rayon::prelude::*;

/// Stream constant separating LoRA dropout from every other use of the
/// step counter or of token hashes.
const STREAM: u64 = 0xD0_0D_10_4A;

/// The dropout of one micro-batch's forward and backward: probability,
/// the optimizer step and one key per sequence.
#[derive(Debug, Clone)]
pub struct Dropout {
    /// Probability of zeroing a feature.
    pub p: f32,
    /// This model's place in its tensor-parallel group (0 unsplit): a
    /// row-parallel projection's input is its slice `rank·ic..`, whose
    /// masks are those columns of the whole input's.
    pub rank: usize,
    /// Per sequence: its key (step and tokens hashed).
    keys: Vec<u64>,
    /// Sequence length T (row `i` is position `i % T` of sequence `i / T`).
    t: usize,
}

/// The key of a sequence at optimizer step `step`: its inputs and targets
/// folded into one stream seed.
fn sequence_key(step: u64, inputs: &[u32], targets: &[i32]) -> u64 {
    let mut h = SplitMix64::derive(STREAM, &[step, inputs.len() as u64]).next_u64();
    for (&i, &t) in inputs.iter().zip(targets) {
        let word = (i as u64) << 32 | (t as u32) as u64;
        h = SplitMix64::new(h ^ word.wrapping_mul(0x9E37_79B9_7F4A_7C15)).next_u64();
    }
    h
}

impl Dropout {
    /// The dropout of `batch` at optimizer step `step` with probability `p`.
    pub fn new(p: f32, step: u64, batch: &TokenBatch) -> Self {
        let t = batch.seq_len.max(1);
        let keys = (0..batch.n_seqs)
            .map(|b| sequence_key(step, &batch.inputs[b * t..(b + 1) * t], &batch.targets[b * t..(b + 1) * t]))
            .collect();
        Dropout { p, rank: 0, keys, t }
    }

    /// The multiplier of kept features, 1/(1 − p).
    fn keep_scale(&self) -> f32 {
        (1.0 / (1.0 - self.p as f64)) as f32
    }

    /// The same masks on rank `rank` of a tensor-parallel group.
    pub fn on_rank(self, rank: usize) -> Self {
        Dropout { rank, ..self }
    }

    /// The mask row of row `i` for projection `proj` of layer `layer`:
    /// `out.len()` factors, each 0 or 1/(1 − p), for input features
    /// `col0..` (the stream's first `col0` draws are the features before).
    fn mask_row(&self, (layer, proj): (usize, usize), i: usize, col0: usize, out: &mut [f32]) {
        let (seq, pos) = (i / self.t, i % self.t);
        let key = self.keys.get(seq).copied().unwrap_or(0);
        let mut rng = SplitMix64::derive(key, &[pos as u64, layer as u64, proj as u64]);
        for _ in 0..col0 {
            rng.next_f64();
        }
        let (p, keep) = (self.p as f64, self.keep_scale());
        for v in out.iter_mut() {
            *v = if rng.next_f64() < p { 0.0 } else { keep };
        }
    }

    /// `buf *= mask` for the rows of `buf` (`width` features each): the
    /// dropped input (forward), or a gradient through the dropout
    /// (backward: the same mask). `col0`: the first of the input features
    /// `buf`'s rows hold (a row-parallel rank's slice), 0 for all of them.
    pub fn mask(&self, at: (usize, usize), buf: &mut [f32], (width, col0): (usize, usize)) {
        buf.par_chunks_mut(width).enumerate().for_each_init(
            || vec![0.0f32; width],
            |m, (i, row)| {
                self.mask_row(at, i, col0, m);
                row.iter_mut().zip(m.iter()).for_each(|(v, &k)| *v *= k);
            },
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(rows: &[&[u32]]) -> TokenBatch {
        let t = rows[0].len();
        TokenBatch {
            n_seqs: rows.len(),
            seq_len: t,
            inputs: rows.concat(),
            targets: rows.concat().iter().map(|&x| x as i32 + 1).collect(),
            positions: Vec::new(),
        }
    }

    /// A row-parallel rank's slice of the input gets those columns of the
    /// whole input's masks, whatever the cut.
    #[test]
    fn a_slice_gets_the_whole_inputs_columns() {
        let b = batch(&[&[1, 2, 3, 4], &[5, 6, 7, 8]]);
        let d = Dropout::new(0.4, 2, &b);
        let (n, w) = (8, 48);
        let mut whole = vec![1.0f32; n * w];
        d.mask((0, 3), &mut whole, (w, 0));
        for parts in [2, 3, 4] {
            let k = w / parts;
            for r in 0..parts {
                let mut slice = vec![1.0f32; n * k];
                d.mask((0, 3), &mut slice, (k, r * k));
                let want: Vec<f32> = whole.chunks(w).flat_map(|row| row[r * k..(r + 1) * k].to_vec()).collect();
                assert_eq!(slice, want, "rank {r} of {parts}");
            }
        }
    }

    #[test]
    fn masks_drop_the_asked_fraction_and_scale_the_rest() {
        let b = batch(&[&[1, 2, 3, 4], &[5, 6, 7, 8]]);
        let d = Dropout::new(0.3, 9, &b);
        let (n, w) = (8, 4096);
        let mut out = vec![1.0f32; n * w];
        d.mask((1, 2), &mut out, (w, 0));
        let dropped = out.iter().filter(|&&v| v == 0.0).count() as f64 / out.len() as f64;
        // 32768 Bernoulli(0.3) draws: standard error 0.0025; 4 of them.
        assert!((dropped - 0.3).abs() < 0.01, "{dropped}");
        let keep = (1.0 / 0.7f64) as f32;
        assert!(out.iter().all(|&v| v == 0.0 || v == keep));
    }

    #[test]
    fn a_sequence_gets_its_masks_wherever_it_sits_and_they_change_with_the_step_and_place() {
        let (s1, s2): (&[u32], &[u32]) = (&[1, 2, 3], &[4, 5, 6]);
        let w = 64;
        let x: Vec<f32> = (0..3 * w).map(|i| i as f32 + 1.0).collect();
        let masked = |d: &Dropout, seq: usize, at: (usize, usize)| {
            let mut all: Vec<f32> = x.iter().chain(&x).copied().collect();
            d.mask(at, &mut all, (w, 0));
            all[seq * 3 * w..(seq + 1) * 3 * w].to_vec()
        };
        let (ab, ba) = (batch(&[s1, s2]), batch(&[s2, s1]));
        let (d_ab, d_ba) = (Dropout::new(0.5, 3, &ab), Dropout::new(0.5, 3, &ba));
        assert_eq!(masked(&d_ab, 0, (0, 0)), masked(&d_ba, 1, (0, 0)), "s1 first or second");
        assert_eq!(masked(&d_ab, 1, (0, 0)), masked(&d_ba, 0, (0, 0)), "s2 first or second");
        assert_ne!(masked(&d_ab, 0, (0, 0)), masked(&d_ab, 1, (0, 0)), "another sequence");
        assert_ne!(masked(&d_ab, 0, (0, 0)), masked(&Dropout::new(0.5, 4, &ab), 0, (0, 0)), "another step");
        assert_ne!(masked(&d_ab, 0, (0, 0)), masked(&d_ab, 0, (1, 0)), "another layer");
        assert_ne!(masked(&d_ab, 0, (0, 0)), masked(&d_ab, 0, (0, 1)), "another projection");
    }
}
