//! Tests of the tiled attention kernels.

use super::*;
use crate::attention::{attention_backward, attention_forward};
use crate::testutil::{check_fd, randn};
use crate::Operands;

fn shape(b: usize, t: usize, n_head: usize, n_kv_head: usize, head_dim: usize) -> AttnShape {
    AttnShape { b, t, n_head, n_kv_head, head_dim, ops: Operands::F32 }
}

fn flash_fwd(qkv: &[f32], s: AttnShape) -> (Vec<f32>, Vec<f32>) {
    let n = s.b * s.t;
    let (mut y, mut lse) = (vec![f32::NAN; n * s.q_dim()], vec![f32::NAN; s.b * s.n_head * s.t]);
    flash_attention_forward(&mut y, &mut lse, qkv, s, Visible::CAUSAL);
    (y, lse)
}

fn flash_bwd(dy: &[f32], qkv: &[f32], y: &[f32], lse: &[f32], s: AttnShape) -> Vec<f32> {
    let n = s.b * s.t * s.qkv_width();
    let (mut dqkv, mut heads) = (vec![f32::NAN; n], vec![f32::NAN; n]);
    flash_attention_backward(&mut dqkv, &mut heads, dy, (qkv, y, lse), s, Visible::CAUSAL);
    dqkv
}

/// Largest |a − b| / (1 + |b|): relative for large values, absolute
/// near zero.
fn max_rel(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(&x, &y)| (x - y).abs() / (1.0 + y.abs())).fold(0.0, f32::max)
}

/// Against the materialised kernels. Both compute the same sums in f32
/// in different orders: the online softmax rescales its partial sums
/// (one extra rounding per key tile), the tile GEMMs add in other
/// blocks, and the backward takes Σ P·dP as Σ dy·y. Each of these is
/// a few ulp of values of order one; over sums of up to T = 200 terms
/// that stays below ~2e-6 relative (measured up to 1.6e-6), so 1e-5 (with the 1 + |x|
/// denominator guarding values near 0) separates rounding from any
/// masking or indexing error, which is O(1e-2) or more.
#[test]
fn flash_attention_matches_the_materialised_kernels() {
    let shapes = [
        shape(2, 1, 4, 2, 8),
        shape(2, 65, 4, 4, 8),
        shape(1, 130, 4, 1, 16),
        shape(2, 200, 6, 3, 8),
        shape(1, 128, 8, 2, 32),
    ];
    for (seed, s) in shapes.into_iter().enumerate() {
        let seed = seed as u64 * 10;
        let n = s.b * s.t;
        let (qd, w) = (s.q_dim(), s.qkv_width());
        let qkv = randn(n * w, seed + 1);
        let dy = randn(n * qd, seed + 2);
        let (mut y_ref, mut att, mut heads) = (vec![0.0; n * qd], vec![0.0; s.att_len()], vec![0.0; n * qd]);
        attention_forward(&mut y_ref, &mut att, &mut heads, &qkv, s);
        let (mut dqkv_ref, mut datt, mut hb) = (vec![0.0; n * w], vec![0.0; s.att_len()], vec![0.0; n * w]);
        attention_backward(&mut dqkv_ref, &mut datt, &mut hb, &dy, (&qkv, &att), s);

        let (y, lse) = flash_fwd(&qkv, s);
        let dqkv = flash_bwd(&dy, &qkv, &y, &lse, s);
        let (ey, eg) = (max_rel(&y, &y_ref), max_rel(&dqkv, &dqkv_ref));
        eprintln!("{s:?}: y {ey:.1e}, dqkv {eg:.1e}");
        assert!(ey < 1e-5, "{s:?}: y differs by {ey}");
        assert!(eg < 1e-5, "{s:?}: dqkv differs by {eg}");
        // lse reproduces the probabilities: at row 0 only key 0 is
        // visible, so lse = scale · q₀·k₀ exactly up to rounding.
        let scale = 1.0 / (s.head_dim as f32).sqrt();
        let group = s.n_head / s.n_kv_head;
        for h in 0..s.n_head {
            let (q0, k0) = (h * s.head_dim, qd + (h / group) * s.head_dim);
            let dot: f32 = (0..s.head_dim).map(|i| qkv[q0 + i] * qkv[k0 + i]).sum::<f32>() * scale;
            assert!((lse[h * s.t] - dot).abs() < 1e-5 * (1.0 + dot.abs()), "lse of head {h}");
        }
    }
}

#[test]
fn flash_attention_backward_matches_central_differences() {
    // T spans two tiles of which the second is partial, with groups of 2.
    for s in [shape(1, TILE + 3, 4, 2, 2), shape(2, 3, 2, 1, 4)] {
        let n = s.b * s.t;
        let qkv = randn(n * s.qkv_width(), 7);
        let dy = randn(n * s.q_dim(), 8);
        let (y, lse) = flash_fwd(&qkv, s);
        let dqkv = flash_bwd(&dy, &qkv, &y, &lse, s);
        check_fd("flash attention dqkv", &|x| flash_fwd(x, s).0, &qkv, &dy, &dqkv);
    }
}

/// 1 and 2 threads, and 1 and B·KV + 1 threads: the backward runs one
/// task per (sequence, key/value head) on 1 thread and the split tasks
/// on B·KV + 1 (and on 2 where B·KV = 1), which must agree bit for bit.
#[test]
fn flash_attention_does_not_depend_on_the_thread_count() {
    for s in [shape(2, 150, 6, 2, 16), shape(1, 150, 4, 1, 16)] {
        let n = s.b * s.t;
        let qkv = randn(n * s.qkv_width(), 11);
        let dy = randn(n * s.q_dim(), 12);
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("thread pool");
            pool.install(|| {
                let (y, lse) = flash_fwd(&qkv, s);
                let dqkv = flash_bwd(&dy, &qkv, &y, &lse, s);
                (y, lse, dqkv)
            })
        };
        let one = run(1);
        assert!(one.2.iter().all(|x| x.is_finite()));
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for threads in [2, s.b * s.n_kv_head + 1] {
            let other = run(threads);
            assert_eq!(bits(&one.0), bits(&other.0), "y, {threads} threads");
            assert_eq!(bits(&one.1), bits(&other.1), "lse, {threads} threads");
            assert_eq!(bits(&one.2), bits(&other.2), "dqkv, {threads} threads");
        }
    }
}

#[test]
fn flash_attention_rejects_slices_of_the_wrong_length() {
    let s = shape(1, 4, 2, 1, 4);
    let (n, w, qd) = (4, s.qkv_width(), s.q_dim());
    let fwd = |y: usize, lse: usize, qkv: usize| {
        std::panic::catch_unwind(|| {
            flash_attention_forward(&mut vec![0.0; y], &mut vec![0.0; lse], &vec![0.1; qkv], s, Visible::CAUSAL);
        })
        .is_ok()
    };
    assert!(fwd(n * qd, 2 * 4, n * w));
    assert!(!fwd(n * qd, 2 * 4 + 1, n * w), "long lse");
    assert!(!fwd(n * qd - 1, 2 * 4, n * w), "short y");
    assert!(!fwd(n * qd, 2 * 4, n * w - 1), "short qkv");
    let bwd = |dqkv: usize, heads: usize, lse: usize| {
        std::panic::catch_unwind(|| {
            let (mut a, mut h) = (vec![0.0; dqkv], vec![0.0; heads]);
            let (dy, y, q) = (vec![0.1; n * qd], vec![0.1; n * qd], vec![0.1; n * w]);
            flash_attention_backward(&mut a, &mut h, &dy, (&q, &y, &vec![0.0; lse]), s, Visible::CAUSAL);
        })
        .is_ok()
    };
    assert!(bwd(n * w, n * w, 8));
    assert!(!bwd(n * w - 1, n * w, 8), "short dqkv");
    assert!(!bwd(n * w, n * w, 7), "short lse");
    let huge = shape(usize::MAX / 2 + 1, 1, 1, 1, 2);
    assert!(std::panic::catch_unwind(|| flash_attention_forward(&mut [], &mut [], &[], huge, Visible::CAUSAL)).is_err());
}

/// Document starts of a row made of documents of these lengths.
fn starts_of(lens: &[usize]) -> Vec<u32> {
    let mut out = Vec::new();
    for &l in lens {
        let s = out.len() as u32;
        out.extend(std::iter::repeat_n(s, l));
    }
    out
}

/// A packed row of documents attends like each document alone: every
/// row of y, lse and dqkv equals the document run as its own sequence.
/// Not bit for bit: the tiles start at other positions, so sums are
/// grouped differently (the same rounding argument and bound as against
/// the materialised kernel, 1e-5); a document seeing its neighbour would
/// move values by O(1e-2).
#[test]
fn packed_documents_attend_as_if_alone() {
    let lens = [70, 1, 100, 29, 64];
    let t: usize = lens.iter().sum();
    for (n_head, n_kv_head) in [(4, 2), (2, 2)] {
        let s = shape(1, t, n_head, n_kv_head, 8);
        let (qd, w) = (s.q_dim(), s.qkv_width());
        let qkv = randn(t * w, 21);
        let dy = randn(t * qd, 22);
        let starts = starts_of(&lens);
        let docs = Visible::documents(&starts);
        let (mut y, mut lse) = (vec![f32::NAN; t * qd], vec![f32::NAN; n_head * t]);
        flash_attention_forward(&mut y, &mut lse, &qkv, s, docs);
        let (mut dqkv, mut heads) = (vec![f32::NAN; t * w], vec![f32::NAN; t * w]);
        flash_attention_backward(&mut dqkv, &mut heads, &dy, (&qkv, &y, &lse), s, docs);
        let mut at = 0;
        for &l in &lens {
            let sd = shape(1, l, n_head, n_kv_head, 8);
            let q = &qkv[at * w..(at + l) * w];
            let (yd, lsed) = flash_fwd(q, sd);
            let dd = flash_bwd(&dy[at * qd..(at + l) * qd], q, &yd, &lsed, sd);
            assert!(max_rel(&y[at * qd..(at + l) * qd], &yd) < 1e-5, "y of the document at {at}");
            assert!(max_rel(&dqkv[at * w..(at + l) * w], &dd) < 1e-5, "dqkv of the document at {at}");
            for h in 0..n_head {
                assert!(max_rel(&lse[h * t + at..][..l], &lsed[h * l..][..l]) < 1e-5, "lse of head {h} at {at}");
            }
            at += l;
        }
    }
}

#[test]
fn packed_backward_matches_central_differences() {
    let lens = [3, TILE - 1, 5];
    let t: usize = lens.iter().sum();
    let s = shape(1, t, 2, 1, 2);
    let starts = starts_of(&lens);
    let qkv = randn(t * s.qkv_width(), 31);
    let dy = randn(t * s.q_dim(), 32);
    let fwd = |x: &[f32]| {
        let (mut y, mut lse) = (vec![0.0; t * s.q_dim()], vec![0.0; s.n_head * t]);
        flash_attention_forward(&mut y, &mut lse, x, s, Visible::documents(&starts));
        (y, lse)
    };
    let (y, lse) = fwd(&qkv);
    let (mut dqkv, mut heads) = (vec![0.0; qkv.len()], vec![0.0; qkv.len()]);
    flash_attention_backward(&mut dqkv, &mut heads, &dy, (&qkv, &y, &lse), s, Visible::documents(&starts));
    check_fd("packed flash attention dqkv", &|x| fwd(x).0, &qkv, &dy, &dqkv);
}

#[test]
fn document_starts_are_checked() {
    let s = shape(1, 4, 2, 1, 4);
    let (n, w, qd) = (4, s.qkv_width(), s.q_dim());
    let run = |starts: &[u32]| {
        std::panic::catch_unwind(|| {
            flash_attention_forward(
                &mut vec![0.0; n * qd],
                &mut [0.0; 8],
                &vec![0.1; n * w],
                s,
                Visible::documents(starts),
            );
        })
        .is_ok()
    };
    assert!(run(&[0, 0, 2, 2]));
    assert!(!run(&[0, 0, 3, 3]), "a start past its position");
    assert!(!run(&[0, 1, 0, 3]), "a start that decreases");
    assert!(!run(&[0, 0, 2]), "too few");
}

/// Attention computed directly in f64, the query at position `i` over keys
/// from the later of its document's start (`starts`, empty: 0) and
/// `i + 1 − window` to `i`, scoring `q·k` times `scale` (`None`: 1/√d)
/// and, with a `cap`, as `cap · tanh(score / cap)`: `y` `[B·T, n_head·d]`
/// and the log-sum-exps `[B, n_head, T]`.
fn direct(
    qkv: &[f32],
    s: AttnShape,
    (starts, window): (&[u32], usize),
    (scale, cap): (Option<f64>, Option<f64>),
) -> (Vec<f32>, Vec<f32>) {
    let (qd, w, d) = (s.q_dim(), s.qkv_width(), s.head_dim);
    let group = s.n_head / s.n_kv_head;
    let scale = scale.unwrap_or(1.0 / (d as f64).sqrt());
    let cap = |x: f64| cap.map_or(x, |c| c * (x / c).tanh());
    let (mut y, mut lse) = (vec![0.0f32; s.b * s.t * qd], vec![0.0f32; s.b * s.n_head * s.t]);
    for bi in 0..s.b {
        for h in 0..s.n_head {
            let (kc, vc) = (qd + (h / group) * d, qd + (s.n_kv_head + h / group) * d);
            for i in 0..s.t {
                let row = |j: usize, c: usize| &qkv[(bi * s.t + j) * w + c..][..d];
                let doc = starts.get(bi * s.t + i).map_or(0, |&x| x as usize);
                let keys = doc.max((i + 1).saturating_sub(window))..=i;
                let sc: Vec<f64> = keys
                    .clone()
                    .map(|j| {
                        cap(row(i, h * d).iter().zip(row(j, kc)).map(|(&a, &b)| a as f64 * b as f64).sum::<f64>()
                            * scale)
                    })
                    .collect();
                let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = sc.iter().map(|x| (x - m).exp()).sum();
                lse[(bi * s.n_head + h) * s.t + i] = (m + z.ln()) as f32;
                for c in 0..d {
                    let o: f64 = keys.clone().zip(&sc).map(|(j, x)| (x - m).exp() / z * row(j, vc)[c] as f64).sum();
                    y[(bi * s.t + i) * qd + h * d + c] = o as f32;
                }
            }
        }
    }
    (y, lse)
}

/// Sliding windows (alone, narrower and wider than a tile, and with
/// packed documents) against the direct f64 computation: the same bound
/// as against the materialised kernel (1e-5, f32 sums in other orders);
/// a key one step outside or inside the window moves values by O(1e-2).
/// The backward against central differences, across tiles, with whole
/// key tiles outside some query tiles' windows.
#[test]
fn sliding_windows_see_the_latest_keys_only() {
    let lens = [70, 1, 100, 29];
    let starts = starts_of(&lens);
    let t: usize = lens.iter().sum();
    for (window, docs) in [(1, false), (5, false), (TILE, false), (TILE + 7, false), (30, true), (90, true)] {
        let s = shape(2, t, 4, 2, 8);
        let (qd, w) = (s.q_dim(), s.qkv_width());
        let both: Vec<u32> = if docs { [&starts[..], &starts[..]].concat() } else { Vec::new() };
        let v = Visible::documents(&both).window(Some(window));
        let qkv = randn(s.b * t * w, 41 + window as u64);
        let (mut y, mut lse) = (vec![f32::NAN; s.b * t * qd], vec![f32::NAN; s.b * s.n_head * t]);
        flash_attention_forward(&mut y, &mut lse, &qkv, s, v);
        let (y_ref, lse_ref) = direct(&qkv, s, (&both, window), (None, None));
        let (ey, el) = (max_rel(&y, &y_ref), max_rel(&lse, &lse_ref));
        eprintln!("window {window}, documents {docs}: y {ey:.1e}, lse {el:.1e}");
        assert!(ey < 1e-5 && el < 1e-5, "window {window}, documents {docs}: y {ey}, lse {el}");
    }
    let s = shape(1, TILE + 30, 2, 1, 2);
    let v = Visible::CAUSAL.window(Some(9));
    let qkv = randn(s.t * s.qkv_width(), 51);
    let dy = randn(s.t * s.q_dim(), 52);
    let fwd = |x: &[f32]| {
        let (mut y, mut lse) = (vec![0.0; s.t * s.q_dim()], vec![0.0; s.n_head * s.t]);
        flash_attention_forward(&mut y, &mut lse, x, s, v);
        (y, lse)
    };
    let (y, lse) = fwd(&qkv);
    let (mut dqkv, mut heads) = (vec![f32::NAN; qkv.len()], vec![f32::NAN; qkv.len()]);
    flash_attention_backward(&mut dqkv, &mut heads, &dy, (&qkv, &y, &lse), s, v);
    check_fd("windowed flash attention dqkv", &|x| fwd(x).0, &qkv, &dy, &dqkv);
}

/// A window at least as long as the sequence changes nothing, bit for bit;
/// with a narrower one, the backward's two task splits (1 thread, and
/// B·KV + 1 threads) agree bit for bit.
#[test]
fn a_window_past_the_sequence_is_causal_and_windows_do_not_depend_on_threads() {
    let s = shape(2, 150, 6, 2, 16);
    let n = s.b * s.t;
    let qkv = randn(n * s.qkv_width(), 61);
    let dy = randn(n * s.q_dim(), 62);
    let run = |v: Visible<'_>, threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("thread pool");
        pool.install(|| {
            let (mut y, mut lse) = (vec![f32::NAN; n * s.q_dim()], vec![f32::NAN; s.b * s.n_head * s.t]);
            flash_attention_forward(&mut y, &mut lse, &qkv, s, v);
            let (mut dqkv, mut heads) = (vec![f32::NAN; n * s.qkv_width()], vec![f32::NAN; n * s.qkv_width()]);
            flash_attention_backward(&mut dqkv, &mut heads, &dy, (&qkv, &y, &lse), s, v);
            [y, lse, dqkv].map(|x| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>())
        })
    };
    assert!(run(Visible::CAUSAL.window(Some(s.t)), 1) == run(Visible::CAUSAL, 1), "window T");
    let narrow = Visible::CAUSAL.window(Some(70));
    assert!(run(narrow, 1) == run(narrow, s.b * s.n_kv_head + 1), "window 70, split tasks");
    assert!(run(narrow, 1) != run(Visible::CAUSAL, 1), "the window changes what is seen");
}

/// Gemma 2's scores: another scale and a soft cap `c·tanh(s/c)`. Against
/// the direct f64 computation at the same 1e-5 as the windows (the cap
/// adds one f32 tanh per score, a few ulp of a value below `c`); a cap
/// applied after the softmax, or not at all, moves values by O(1e-2) at
/// caps this tight. The backward against central differences — with the
/// cap's `1 − tanh²` missing it is off by far more than their tolerance
/// — and its two task splits bit for bit.
#[test]
fn soft_capped_scores_match_the_direct_computation_and_their_derivative() {
    let lens = [70, 50, 30];
    let starts = starts_of(&lens);
    let t: usize = lens.iter().sum();
    let s = shape(1, t, 4, 2, 8);
    let qkv: Vec<f32> = randn(t * s.qkv_width(), 71).iter().map(|x| 3.0 * x).collect();
    for (window, docs, scale, cap) in [(0, false, None, 2.0), (9, true, Some(0.3), 1.5), (0, true, Some(0.05), 50.0)] {
        let sc = Scores { scale, softcap: Some(cap) };
        let st: &[u32] = if docs { &starts } else { &[] };
        let v = Visible::documents(st).window((window > 0).then_some(window)).scored(sc);
        let (mut y, mut lse) = (vec![f32::NAN; t * s.q_dim()], vec![f32::NAN; s.n_head * t]);
        flash_attention_forward(&mut y, &mut lse, &qkv, s, v);
        // `direct`'s window of usize::MAX is none.
        let w_ref = if window == 0 { usize::MAX } else { window };
        let (y_ref, lse_ref) = direct(&qkv, s, (st, w_ref), (scale.map(f64::from), Some(cap as f64)));
        let (ey, el) = (max_rel(&y, &y_ref), max_rel(&lse, &lse_ref));
        eprintln!("cap {cap}, scale {scale:?}, window {window}: y {ey:.1e}, lse {el:.1e}");
        assert!(ey < 1e-5 && el < 1e-5, "cap {cap}, scale {scale:?}, window {window}: y {ey}, lse {el}");
    }
    let s = shape(1, TILE + 30, 2, 1, 2);
    let v = Visible::CAUSAL.window(Some(40)).scored(Scores { scale: Some(0.8), softcap: Some(1.0) });
    let qkv: Vec<f32> = randn(s.t * s.qkv_width(), 72).iter().map(|x| 2.0 * x).collect();
    let dy = randn(s.t * s.q_dim(), 73);
    let fwd = |x: &[f32]| {
        let (mut y, mut lse) = (vec![0.0; s.t * s.q_dim()], vec![0.0; s.n_head * s.t]);
        flash_attention_forward(&mut y, &mut lse, x, s, v);
        (y, lse)
    };
    let (y, lse) = fwd(&qkv);
    let bwd = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("thread pool");
        let (mut dqkv, mut heads) = (vec![f32::NAN; qkv.len()], vec![f32::NAN; qkv.len()]);
        pool.install(|| flash_attention_backward(&mut dqkv, &mut heads, &dy, (&qkv, &y, &lse), s, v));
        dqkv
    };
    let dqkv = bwd(1);
    check_fd("soft-capped flash attention dqkv", &|x| fwd(x).0, &qkv, &dy, &dqkv);
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&dqkv), bits(&bwd(2)), "the split tasks agree bit for bit");
}

/// Rank `r` of `c`'s query rows of a sequence of `t` under context
/// parallelism's load balancing: chunks `r` and `2c − 1 − r` of `⌈t/2c⌉`.
fn chunks_of(r: usize, c: usize, t: usize) -> [(usize, usize); 2] {
    let l = t.div_ceil(2 * c);
    let at = |k: usize| ((k * l).min(t), ((k + 1) * l).min(t));
    [at(r), at(2 * c - 1 - r)]
}

/// Rows `pos` of each of `b` sequences of `t` rows of `src` (rows of
/// `w`), the `cols` columns from `col`, as `stride` rows per sequence.
fn pick(src: &[f32], (b, t, w): (usize, usize, usize), pos: &[usize], stride: usize, cols: (usize, usize)) -> Vec<f32> {
    let (col, n) = cols;
    let mut out = vec![0.0f32; b * stride * n];
    for bi in 0..b {
        for (li, &p) in pos.iter().enumerate() {
            out[(bi * stride + li) * n..][..n].copy_from_slice(&src[(bi * t + p) * w + col..][..n]);
        }
    }
    out
}

/// A sequence's queries and keys split over ranks as context parallelism
/// splits them, on packed documents. Against every key at once (the
/// all-gather form) a rank's rows of y and lse equal the whole call's —
/// bit for bit where its chunks start on multiples of the tile (their
/// tiles are the whole call's tiles), within 1e-5 where they do not (the
/// tiles' GEMMs group the sums differently: the rounding argument and
/// bound of `packed_documents_attend_as_if_alone`). Against one rank's
/// block of keys at a time, folded in ring order by `merge_partial`
/// (blocks a row does not see give `lse = −∞`), within 1e-5 too: each
/// fold adds a few ulp (two `exp`, one `ln_1p`, one rounding of the
/// weighted sum) to values of order one, at most 3 folds here. The
/// backward of each (query rows, key block) pair with the whole softmax's
/// y and lse, dq summed over blocks and dk|dv over ranks, equals the whole
/// backward within 1e-5 (each key's dk and dv the same products summed in
/// another grouping).
#[test]
fn queries_and_key_blocks_split_over_ranks_add_up_to_the_whole_call() {
    use crate::context::merge_partial;
    let cases = [(256, 2, vec![256]), (200, 4, vec![70, 1, 100, 29]), (8, 2, vec![3, 5]), (130, 3, vec![130])];
    for (t, c, lens) in cases {
        let (b, n_head, n_kv_head, d) = (2, 4, 2, 8);
        let s = shape(b, t, n_head, n_kv_head, d);
        let (qd, w, n) = (s.q_dim(), s.qkv_width(), b * t);
        let kvw = w - qd;
        let qkv = randn(n * w, t as u64);
        let dy = randn(n * qd, t as u64 + 1);
        let starts: Vec<u32> = (0..b).flat_map(|_| starts_of(&lens)).collect();
        let docs = Visible::documents(&starts);
        let (mut y, mut lse) = (vec![f32::NAN; n * qd], vec![f32::NAN; b * n_head * t]);
        flash_attention_forward(&mut y, &mut lse, &qkv, s, docs);
        let (mut dqkv, mut heads) = (vec![f32::NAN; n * w], vec![f32::NAN; n * w]);
        flash_attention_backward(&mut dqkv, &mut heads, &dy, (&qkv, &y, &lse), s, docs);
        let pos = |r: usize| chunks_of(r, c, t).iter().flat_map(|&(a, e)| a..e).collect::<Vec<_>>();
        let (blk, whole) = (2 * t.div_ceil(2 * c), [(0, t)]);
        let spans: Vec<_> = (0..c).map(|k| chunks_of(k, c, t)).collect();
        let blocks: Vec<_> = (0..c).map(|k| pick(&qkv, (b, t, w), &pos(k), blk, (qd, kvw))).collect();
        let block = |k: usize| Rows { data: &blocks[k], width: kvw, col: 0, stride: blk, spans: &spans[k] };
        let all_kv = pick(&qkv, (b, t, w), &(0..t).collect::<Vec<_>>(), t, (qd, kvw));
        let all = Rows { data: &all_kv, width: kvw, col: 0, stride: t, spans: &whole };
        let mut summed = vec![0.0f32; n * w];
        for (r, mine) in spans.iter().enumerate() {
            let p = pos(r);
            let tl = p.len();
            let local = pick(&qkv, (b, t, w), &p, tl, (0, w));
            let q = Rows { data: &local, width: w, col: 0, stride: tl, spans: mine };
            let want_y = pick(&y, (b, t, qd), &p, tl, (0, qd));
            let want_l = pick(&lse, (b * n_head, t, 1), &p, tl, (0, 1));
            let (mut yg, mut lg) = (vec![f32::NAN; b * tl * qd], vec![f32::NAN; b * n_head * tl]);
            flash_attention_forward_spans(&mut yg, &mut lg, (q, all), s, docs);
            let (mut yr, mut lr) = (vec![0.0f32; yg.len()], vec![f32::NEG_INFINITY; lg.len()]);
            for step in 0..c {
                let (mut py, mut pl) = (vec![f32::NAN; yg.len()], vec![f32::NAN; lg.len()]);
                flash_attention_forward_spans(&mut py, &mut pl, (q, block((r + c - step) % c)), s, docs);
                merge_partial((&mut yr, &mut lr), (&py, &pl), (b, tl, n_head, d));
            }
            match mine.iter().all(|&(a, _)| a % TILE == 0) {
                true => assert_eq!(yg, want_y, "t {t}, rank {r}: gathered rows"),
                false => assert!(max_rel(&yg, &want_y) < 1e-5, "t {t}, rank {r}: gathered rows"),
            }
            for (what, (got_y, got_l)) in [("gathered", (&yg, &lg)), ("ring", (&yr, &lr))] {
                let (ey, el) = (max_rel(got_y, &want_y), max_rel(got_l, &want_l));
                assert!(ey < 1e-5 && el < 1e-5, "t {t}, rank {r}, {what}: y off by {ey}, lse by {el}");
            }
            let dyl = pick(&dy, (b, t, qd), &p, tl, (0, qd));
            for k in 0..c {
                let (mut dq, mut dkv) = (vec![f32::NAN; b * tl * qd], vec![f32::NAN; b * blk * kvw]);
                let mut scratch = vec![f32::NAN; b * (tl * qd + blk * kvw)];
                let out = Grads::Split((&mut dq, qd), &mut dkv);
                flash_attention_backward_spans(out, &mut scratch, &dyl, (q, block(k)), (&yr, &lr), s, docs);
                for bi in 0..b {
                    for (li, &pq) in p.iter().enumerate() {
                        let row = &mut summed[(bi * t + pq) * w..][..qd];
                        row.iter_mut().zip(&dq[(bi * tl + li) * qd..][..qd]).for_each(|(a, &x)| *a += x);
                    }
                    for (li, &pk) in pos(k).iter().enumerate() {
                        let row = &mut summed[(bi * t + pk) * w + qd..][..kvw];
                        row.iter_mut().zip(&dkv[(bi * blk + li) * kvw..][..kvw]).for_each(|(a, &x)| *a += x);
                    }
                }
            }
        }
        let e = max_rel(&summed, &dqkv);
        assert!(e < 1e-5, "t {t} over {c} ranks: dqkv differs by {e}");
    }
}
