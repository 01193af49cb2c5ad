//! Tests of the mixture's draws: quotas, realised proportions, passes
//! through each source, determinism, and mixed micro-batches.

use super::*;
use crate::dataset::TokenDataset;
use crate::sampler::{BatchShape, Sampler};
use crate::samples::{Mixed, Samples};

fn names(k: usize) -> Vec<String> {
    (0..k).map(|i| format!("s{i}")).collect()
}

fn counts(m: &Mixture, order: &[usize]) -> Vec<u64> {
    let mut c = vec![0u64; m.sizes.len()];
    for &g in order {
        c[m.source_of(g)] += 1;
    }
    c
}

fn listed(o: &EpochOrder) -> Vec<usize> {
    (0..o.len()).map(|i| o.get(i)).collect()
}

/// Quotas are N·w/Σw by largest remainder and sum to N; a source that
/// would never be drawn is refused with its name and the fix.
#[test]
fn quotas_follow_the_weights() {
    let m = Mixture::new(&[100, 50, 10], &[1.0, 2.0, 1.0], &names(3)).unwrap();
    assert_eq!(m.quotas(), &[40, 80, 40]);
    // 10 · (1/3, 1/3, 1/3) = 3.33 each: the one left over goes to the lowest index
    let m = Mixture::new(&[4, 3, 3], &[1.0, 1.0, 1.0], &names(3)).unwrap();
    assert_eq!(m.quotas(), &[4, 3, 3]);
    let m = Mixture::new(&[5, 5], &[0.3, 0.7], &names(2)).unwrap();
    assert_eq!(m.quotas(), &[3, 7]);
    let e = Mixture::new(&[1000, 10], &[1.0, 1e-6], &names(2)).unwrap_err().to_string();
    assert!(e.contains("data.sources[1] (s1)") && e.contains("drawn 0 times") && e.contains("raise its weight"), "{e}");
    let e = Mixture::new(&[10, 0], &[1.0, 1.0], &names(2)).unwrap_err().to_string();
    assert!(e.contains("data.sources[1] (s1) holds no sample"), "{e}");
}

/// Over a run of many steps, each source's share of the draws is its
/// weight's. Over part of an epoch the count of source i is hypergeometric
/// (draws without replacement from the epoch's quota multiset), whose
/// variance is below the binomial's M·p·(1 − p), so 4 binomial standard
/// deviations bound it with a false-failure rate under 1e-4 per source
/// (normal tail); at every epoch's end the counts are the quotas exactly.
#[test]
fn realised_proportions_match_the_weights() {
    let sizes = [3000, 500, 1500];
    let weights = [1.0, 3.0, 1.0];
    let m = Mixture::new(&sizes, &weights, &names(3)).unwrap();
    let p: Vec<f64> = weights.iter().map(|w| w / 5.0).collect();
    for seed in [1u64, 7, 12345] {
        for epoch in 0..3 {
            let order = listed(&m.epoch_order(seed, epoch, true, usize::MAX));
            assert_eq!(counts(&m, &order), m.quotas().iter().map(|&q| q as u64).collect::<Vec<_>>());
            for draws in [64usize, 640, 2500] {
                let c = counts(&m, &order[..draws]);
                if (seed, epoch, draws) == (1, 0, 2500) {
                    println!(
                        "{draws} draws at weights 1:3:1 → {c:?} (expected {:?})",
                        p.iter().map(|p| p * draws as f64).collect::<Vec<_>>()
                    );
                }
                for i in 0..3 {
                    let (mean, sd) = (draws as f64 * p[i], (draws as f64 * p[i] * (1.0 - p[i])).sqrt());
                    let dev = (c[i] as f64 - mean).abs();
                    assert!(
                        dev <= 4.0 * sd,
                        "seed {seed} epoch {epoch}: {draws} draws, source {i}: {} vs {mean:.1} ± {sd:.1}",
                        c[i]
                    );
                }
            }
        }
    }
}

/// Each source is walked in passes: the draws of a source over the epochs,
/// in order, are its pass orders back to back — every pass a permutation
/// of its samples — whether it is oversampled (several passes an epoch) or
/// undersampled (a pass spanning epochs); the same (seed, epoch) gives the
/// same order and `drawn` counts what the order drew.
#[test]
fn sources_are_walked_in_whole_passes() {
    let sizes = [40, 7, 25];
    for shuffle in [true, false] {
        let m = Mixture::new(&sizes, &[1.0, 2.0, 0.5], &names(3)).unwrap();
        let mut per_source: Vec<Vec<usize>> = vec![Vec::new(); 3];
        for epoch in 0..5 {
            let order = listed(&m.epoch_order(9, epoch, shuffle, usize::MAX));
            assert_eq!(order, listed(&m.epoch_order(9, epoch, shuffle, usize::MAX)));
            for (at, &g) in order.iter().enumerate() {
                if at % 11 == 0 {
                    let want =
                        (0..3).map(|i| epoch * m.quotas()[i] as u64 + counts(&m, &order[..at])[i]).collect::<Vec<_>>();
                    assert_eq!(m.drawn(9, epoch, at, shuffle), want);
                }
                let i = m.source_of(g);
                per_source[i].push(g - m.starts[i]);
            }
        }
        for (i, drawn) in per_source.iter().enumerate() {
            let n = sizes[i];
            assert!(drawn.len() >= n, "source {i} finished a pass");
            for (pass_idx, pass) in drawn.chunks(n).enumerate() {
                let mut sorted = pass.to_vec();
                sorted.sort_unstable();
                sorted.dedup();
                assert_eq!(sorted.len(), pass.len(), "source {i} pass {pass_idx} repeats a sample");
                if !shuffle {
                    assert_eq!(pass, (0..pass.len()).collect::<Vec<_>>(), "unshuffled passes are in order");
                }
            }
        }
        if !shuffle {
            // a smooth round-robin: every prefix within one draw of each quota's share
            let order = listed(&m.epoch_order(9, 0, false, usize::MAX));
            let n = m.n_samples() as f64;
            for at in 1..order.len() {
                let c = counts(&m, &order[..at]);
                for (i, (&got, &q)) in c.iter().zip(m.quotas()).enumerate() {
                    let share = at as f64 * q as f64 / n;
                    assert!((got as f64 - share).abs() < 1.0 + 1e-9, "prefix {at} source {i}: {got} vs {share}");
                }
            }
        }
    }
}

/// A sampler with a mixture hands out the mixture's order in its windows,
/// and records the mixture's position per step.
#[test]
fn sampler_draws_the_mixture() {
    let m = Mixture::new(&[30, 10], &[1.0, 1.0], &names(2)).unwrap();
    let shape = BatchShape { micro: 2, accumulation_steps: 2, world_size: 1 };
    let s = Sampler::new(40, shape, true, true, 5).unwrap().with_mixture(Some(m.clone()));
    assert_eq!(listed(&s.epoch_order(1)), listed(&m.epoch_order(5, 1, true, crate::LAZY_ORDER_FROM)));
    assert_eq!(s.mixture_drawn(0), Some(vec![0, 0]));
    // step 12 = epoch 1, step 2 (10 steps of 4 an epoch): quotas 20 / 20 plus the first 8 draws
    let order = listed(&s.epoch_order(1));
    let c = counts(&m, &order[..8]);
    assert_eq!(s.mixture_drawn(12), Some(vec![20 + c[0], 20 + c[1]]));
    let plain = Sampler::new(40, shape, true, true, 5).unwrap();
    assert_eq!(plain.mixture_drawn(3), None);
}

/// Rows from sources of different kinds share a micro-batch: each padded
/// to the longest, targets of the padding ignored, positions given to all
/// rows when one carries them.
#[test]
fn mixed_batches_pad_rows_of_different_sources() {
    let windows = Samples::Windows(TokenDataset::new("train", (0..20).collect(), 4).unwrap());
    let tok = crate::sft::tests::byte_chatml();
    let jsonl = "{\"text\": \"ab\"}\n{\"text\": \"cdefgh\"}";
    let opts = crate::SftOptions { max_len: Some(6), pack_seq_len: None, drop_empty: true };
    let sft = crate::SftDataset::from_jsonl(std::path::Path::new("t.jsonl"), jsonl, &tok, &opts).unwrap();
    let mixed = Mixed::new(vec![windows.clone(), Samples::Examples(sft.clone())], 0);
    assert_eq!(mixed.n_samples(), 4 + 2);
    assert_eq!(mixed.locate(4), (1, 0));
    let b = mixed.batch(&[4, 1, 5]).unwrap();
    assert_eq!((b.n_seqs, b.seq_len), (3, 6));
    let short = sft.micro_batch(&[0]);
    assert_eq!(short.seq_len, 2, "a, b and EOS: two positions");
    assert_eq!(&b.inputs[..2], &short.inputs[..]);
    assert_eq!(&b.targets[..6], &[short.targets[0], short.targets[1], -100, -100, -100, -100]);
    assert_eq!(&b.inputs[6..10], &[4, 5, 6, 7]);
    assert_eq!(&b.targets[10..12], &[-100, -100]);
    assert!(b.positions.is_empty());
    assert_eq!(b.n_targets(), windows.batch(&[1]).unwrap().n_targets() + sft.micro_batch(&[0, 1]).n_targets());
    assert_eq!(mixed.input_positions(&[4, 1, 5]), 18);
    // a packed source gives positions: every row gets them
    let packed = crate::SftDataset::from_jsonl(
        std::path::Path::new("p.jsonl"),
        jsonl,
        &tok,
        &crate::SftOptions { max_len: None, pack_seq_len: Some(8), drop_empty: true },
    )
    .unwrap();
    let mixed = Mixed::new(vec![windows, Samples::Examples(packed)], 0);
    let b = mixed.batch(&[0, 4]).unwrap();
    assert_eq!((b.n_seqs, b.seq_len), (2, 8));
    assert_eq!(&b.positions[..8], &[0, 1, 2, 3, 0, 1, 2, 3]);
    // the empty micro-batch of a rank without data
    assert_eq!(mixed.batch(&[]).unwrap().n_seqs, 0);
}

/// Validation interleaves its parts: any prefix holds each in proportion.
#[test]
fn interleaved_view_spreads_every_part() {
    let part = |n: u32| Samples::Windows(TokenDataset::new("validation", (0..n * 2 + 1).collect(), 2).unwrap());
    let v = Mixed::interleaved(vec![part(6), part(3)], 0);
    let sources: Vec<usize> = (0..9).map(|i| v.locate(i).0).collect();
    assert_eq!(sources, [0, 1, 0, 0, 1, 0, 0, 1, 0]);
    let locals: Vec<usize> = (0..9).map(|i| v.locate(i).1).collect();
    assert_eq!(locals, [0, 0, 1, 2, 1, 3, 4, 2, 5]);
}
