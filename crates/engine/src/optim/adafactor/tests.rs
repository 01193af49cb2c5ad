//! Adafactor's sharded statistics against the whole tensors' bits, and the
//! checkpoint layout.

use super::super::{aligned_chunks, Optimizer, StateRun};
use super::*;
use crate::layout::ParamLayout;
use comm::Communicator;

/// A matrix of 1.1M elements (three statistics tasks on one rank) and a
/// vector, updated whole on one rank and cut into three ranks' parts
/// (cuts inside rows and inside the vector, one task per part) whose
/// sums go through a real all-reduce: the same bits, step after step,
/// with every option that reads a sum (first moment, parameter scale,
/// an active clip).
#[test]
fn parts_summed_over_ranks_give_the_whole_tensors_bits() {
    let (rows, cols, vec_len) = (1100, 1000, 777);
    let mut layout = ParamLayout::new();
    layout.push("w", &[rows, cols], true);
    layout.push("b", &[vec_len], false);
    let n = layout.n_params();
    let value = |i: usize, salt: u32| {
        let h = (i as u32).wrapping_mul(2654435761).wrapping_add(salt.wrapping_mul(40503));
        (h >> 8) as f32 / (1 << 24) as f32 - 0.5
    };
    let config =
        AdafactorConfig { beta1: Some(0.9), scale_parameter: true, clip_threshold: 0.01, ..Default::default() };
    let opt = Optimizer::Adafactor(Adafactor::new(config, 0.1).unwrap());
    let init: Vec<f32> = (0..n).map(|i| value(i, 1)).collect();
    let grads = |step: u32| -> Vec<f32> { (0..n).map(|i| value(i, 10 + step) * 0.3).collect() };
    let steps = 3;

    let mut whole = opt.for_layout(&layout).unwrap();
    let mut p = init.clone();
    for step in 0..steps {
        whole.update(&layout, &mut p, &grads(step), 1e-2, 0.5).unwrap();
    }

    let world = 3;
    let cut = |r: usize| r * n / world..(r + 1) * n / world;
    let parts: Vec<Vec<f32>> = std::thread::scope(|s| {
        let handles: Vec<_> = comm::threads::group(world, std::time::Duration::from_secs(60))
            .into_iter()
            .map(|mut c| {
                let (opt, layout, init) = (&opt, &layout, &init);
                s.spawn(move || {
                    let own = cut(c.rank());
                    // This rank's runs: its part of each tensor, state indexed from 0.
                    let mut runs = Vec::new();
                    for (t, spec) in layout.tensors().iter().enumerate() {
                        let r = spec.range();
                        let (a, b) = (r.start.max(own.start), r.end.min(own.end));
                        if a < b {
                            let state = a - own.start..b - own.start;
                            let shape = spec.shape.clone();
                            runs.push(StateRun { state, shape, at: a - r.start, seg_at: a, tensor: t });
                        }
                    }
                    let tensors = layout.tensors().iter().map(|t| t.shape.clone()).collect();
                    let sr = StateRuns { runs, tensors };
                    let mut o = opt.for_state(own.len(), &sr).unwrap();
                    let mut p = init[own.clone()].to_vec();
                    for step in 0..steps {
                        let g = grads(step);
                        let mut pieces = Vec::new();
                        let mut rest = &mut p[..];
                        for r in &sr.runs {
                            for (o, m) in aligned_chunks(r.seg_at, r.state.len()) {
                                let (head, tail) = std::mem::take(&mut rest).split_at_mut(m);
                                let s = r.state.start + o;
                                let decay = layout.tensors()[r.tensor].decay;
                                let grads = &g[own.start + s..own.start + s + m];
                                pieces.push(Piece { params: head, grads, state: s..s + m, decay });
                                rest = tail;
                            }
                        }
                        let mut sum = |buf: &mut [f64]| {
                            c.all_reduce_sum_f64(buf).map_err(|e| EngineError::Optimizer(e.to_string()))
                        };
                        o.update_pieces(pieces, 1e-2, 0.5, Some(&mut sum)).unwrap();
                    }
                    p
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let joined: Vec<u32> = parts.concat().iter().map(|x| x.to_bits()).collect();
    let want: Vec<u32> = p.iter().map(|x| x.to_bits()).collect();
    assert_eq!(joined.len(), want.len());
    let diff = joined.iter().zip(&want).filter(|(a, b)| a != b).count();
    assert_eq!(diff, 0, "{diff} of {n} parameters differ");
    assert!(p.iter().zip(&init).filter(|(a, b)| a != b).count() > n / 2, "the updates moved the parameters");
}

/// A checkpoint in the earlier back-to-back layout is refused with
/// what to do, not misread; the current slot restores.
#[test]
fn the_earlier_statistics_layout_is_named_not_misread() {
    let mut layout = ParamLayout::new();
    layout.push("w", &[3, 4], true);
    let opt = Optimizer::Adafactor(Adafactor::new(AdafactorConfig::default(), 0.0).unwrap());
    let mut o = opt.for_layout(&layout).unwrap();
    let e = o.restore(1, |n| (n == "exp_avg_sq").then(|| vec![0.0; 12])).unwrap_err().to_string();
    assert!(e.contains("earlier layout") && e.contains("--init-from"), "{e}");
    let e = o.restore(1, |_| None).unwrap_err().to_string();
    assert!(e.contains(STATS_SLOT), "{e}");
    o.restore(1, |n| (n == STATS_SLOT).then(|| vec![1.0; 12])).unwrap();
    let slot = &o.state_buffers()[0].1;
    assert_eq!((&slot[..7], &slot[7..]), (&[1.0; 7][..], &[0.0; 5][..]), "3 rows, 4 columns, then zeros");
}
