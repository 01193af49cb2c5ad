//! A key/value cache for generation, and the attention of rows that extend
//! a cached sequence.
//!
//! Generation runs one sequence a few tokens at a time: the prompt once,
//! then one token per step. [`KvCache`] keeps every layer's keys and values
//! (q and k already rotated where the family rotates them) of the positions
//! run so far, so a step runs the blocks on its new rows only: each layer
//! appends the rows' k and v at their positions and attends over all the
//! cached positions ([`KvCache::attend`]). It holds
//! `2 · n_layer · positions · kv_dim` f32 (keys and values).
//!
//! A block's forward takes an [`Attention`]: causal among the rows of the
//! call (training, evaluation, a full forward) or over the cache. The
//! cached kernel is [`crate::attention::attention_forward`]'s computation
//! for the new rows — scaled `q·kᵀ` by a GEMM, the causal softmax with the
//! same operations in the same order, `att·v` by a GEMM — over a key range
//! that starts at position 0, so only the GEMMs' row counts differ from a
//! full forward (one row instead of the whole window): the GEMM may block
//! its sums differently, which moves results by rounding only.

use crate::act::fast_exp;
use crate::attention::AttnShape;
use crate::flash::Scores;
use crate::{gemm_into, GemmDims, GemmOut, Par, Strided};
use engine::EngineError;
use multiversion::multiversion;
use rayon::prelude::*;
use std::sync::{Mutex, PoisonError};

/// Which attention a block's forward runs.
#[derive(Debug, Clone, Copy, Default)]
pub enum Attention<'a> {
    /// Causal attention among the rows of the call, positions `0..t` of
    /// each sequence.
    #[default]
    Causal,
    /// The call's rows are the next positions of the one sequence whose
    /// earlier positions `cache` holds: each layer appends their keys and
    /// values and attends over the cache ([`KvCache::attend`]).
    Cached(&'a KvCache),
}

impl Attention<'_> {
    /// The position of the call's first row: the positions already cached
    /// (0 for causal attention). Rotary tables and learned positions start there.
    pub fn first_position(&self) -> usize {
        match self {
            Attention::Causal => 0,
            Attention::Cached(kv) => kv.len(),
        }
    }
}

/// Keys and values of every layer, `[n_layer, positions, kv_dim]` each,
/// and the layer the pass in progress reaches next.
#[derive(Debug)]
struct Store {
    k: Vec<f32>,
    v: Vec<f32>,
    layer: usize,
}

/// Every layer's keys and values of one sequence's first positions, and
/// the token ids they were computed from (a position's k and v depend on
/// the tokens up to it only, so a cache serves any sequence that starts
/// with its tokens).
///
/// A pass over new rows: [`KvCache::feed_from`] says which of the
/// sequence's tokens to run; the model runs them through its layers in
/// order with [`Attention::Cached`], each layer calling
/// [`KvCache::attend`] once; [`KvCache::commit`] then counts them as cached.
#[derive(Debug)]
pub struct KvCache {
    n_layer: usize,
    positions: usize,
    kv_dim: usize,
    /// Written by the layers of a pass through a shared reference (a
    /// block's forward takes `&self`); a model holding a cache stays `Sync`.
    store: Mutex<Store>,
    /// The token ids of the cached positions.
    tokens: Vec<u32>,
    /// Sliding-window attention, per layer: each query sees its `w` latest
    /// keys (itself included); 0: every cached key.
    windows: Vec<usize>,
    /// How queries score keys (every layer).
    scores: Scores,
}

impl KvCache {
    /// Bytes of the keys and values of `n_layer` layers, `positions`
    /// positions and key/value width `kv_dim` (what [`KvCache::new`] allocates).
    pub fn bytes_for(n_layer: usize, positions: usize, kv_dim: usize) -> u128 {
        2 * 4 * n_layer as u128 * positions as u128 * kv_dim as u128
    }

    /// An empty cache for up to `positions` positions of a model with
    /// `n_layer` layers whose key/value heads are `kv_dim` wide together;
    /// [`EngineError::OutOfMemory`] when it cannot be allocated.
    pub fn new(n_layer: usize, positions: usize, kv_dim: usize) -> Result<Self, EngineError> {
        let n = usize::try_from(Self::bytes_for(n_layer, positions, kv_dim) / 8).unwrap_or(usize::MAX);
        let k = engine::alloc::try_zeros(n, "the key cache")?;
        let v = engine::alloc::try_zeros(n, "the value cache")?;
        let store = Mutex::new(Store { k, v, layer: 0 });
        let (windows, scores) = (vec![0; n_layer], Scores::default());
        Ok(KvCache { n_layer, positions, kv_dim, store, tokens: Vec::new(), windows, scores })
    }

    /// The same cache attending over at most the `w` latest keys (`None`:
    /// all), as [`crate::flash::Visible::window`]. The keys before the
    /// window stay cached (the cache holds `positions` whatever the window).
    ///
    /// # Panics
    /// On a window of 0.
    pub fn window(self, w: Option<usize>) -> Self {
        let n = self.n_layer;
        self.layer_windows(&vec![w; n])
    }

    /// The same cache with a window per layer, as [`KvCache::window`].
    ///
    /// # Panics
    /// On a window of 0, or unless there is one entry per layer.
    pub fn layer_windows(self, ws: &[Option<usize>]) -> Self {
        assert!(ws.iter().all(|&w| w != Some(0)), "a sliding window of 0 keys");
        assert_eq!(ws.len(), self.n_layer, "KvCache::layer_windows: one window per layer");
        KvCache { windows: ws.iter().map(|w| w.unwrap_or(0)).collect(), ..self }
    }

    /// The same cache scoring keys by `scores`, as [`crate::flash::Visible::scored`].
    pub fn scored(self, scores: Scores) -> Self {
        KvCache { scores, ..self }
    }

    /// Positions cached.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Whether no position is cached.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Positions the cache can hold.
    pub fn positions(&self) -> usize {
        self.positions
    }

    /// Bytes of the keys and values.
    pub fn bytes(&self) -> u128 {
        Self::bytes_for(self.n_layer, self.positions, self.kv_dim)
    }

    /// The store, through `&mut self` (no other reference exists: a pass
    /// that panicked left nothing but positions past the cached ones).
    fn store_mut(&mut self) -> &mut Store {
        self.store.get_mut().unwrap_or_else(PoisonError::into_inner)
    }

    /// Prepares a pass for the sequence `tokens` (from its position 0):
    /// keeps the cached positions it starts with, but always leaves its
    /// last token to run (its logits are what the caller wants), and
    /// returns the index of the first token to run. `None` when `tokens`
    /// has more positions than the cache holds: the caller runs without it.
    pub fn feed_from(&mut self, tokens: &[u32]) -> Option<usize> {
        self.store_mut().layer = 0;
        if tokens.is_empty() || tokens.len() > self.positions {
            self.tokens.clear();
            return None;
        }
        let common = self.tokens.iter().zip(tokens).take_while(|(a, b)| a == b).count();
        let from = common.min(tokens.len() - 1);
        self.tokens.truncate(from);
        Some(from)
    }

    /// Runs the sequence `tokens` (from its position 0) through
    /// `run(rows, attention)`: the tokens past the cached positions with
    /// [`Attention::Cached`], then counted as cached if `run` succeeds; all
    /// of them with [`Attention::Causal`] where they do not fit in the cache.
    pub fn pass<T, E>(
        &mut self,
        tokens: &[u32],
        run: impl FnOnce(&[u32], Attention<'_>) -> Result<T, E>,
    ) -> Result<T, E> {
        match self.feed_from(tokens) {
            Some(from) => run(&tokens[from..], Attention::Cached(self)).inspect(|_| self.commit(&tokens[from..])),
            None => run(tokens, Attention::Causal),
        }
    }

    /// Counts the rows of the pass just run, `fed` (the tokens from
    /// [`KvCache::feed_from`]'s index on), as cached.
    ///
    /// # Panics
    /// Unless every layer attended over the cache once in this pass.
    pub fn commit(&mut self, fed: &[u32]) {
        let n_layer = self.n_layer;
        let layers_run = std::mem::take(&mut self.store_mut().layer);
        assert_eq!(layers_run, n_layer, "KvCache::commit: a pass must run every layer once");
        self.tokens.extend_from_slice(fed);
    }

    /// The next layer's attention for the pass in progress: `qkv` holds the
    /// new rows `[t, q | k | v]` (one sequence, `s.b == 1`), at positions
    /// `len()..len() + t`; their keys and values are stored at those
    /// positions, then each row attends causally over positions
    /// `0..=its own`; `y` receives the heads' outputs `[t, n_head·d]`.
    ///
    /// # Panics
    /// Unless the shape matches the cache, the rows fit in it, this pass
    /// has a layer left, and the slices have the lengths the shape implies.
    pub fn attend(&self, y: &mut [f32], qkv: &[f32], s: AttnShape) {
        let AttnShape { b, t: n, n_head, n_kv_head, head_dim: d, ops } = s;
        let (qd, w, kvd) = (s.q_dim(), s.qkv_width(), n_kv_head * d);
        s.check("KvCache::attend", &[("y", y.len(), &[b, n, qd]), ("qkv", qkv.len(), &[b, n, w])]);
        let (pos, end) = (self.len(), self.len() + n);
        assert!(b == 1 && kvd == self.kv_dim, "KvCache::attend: {s:?} is not one sequence of width {}", self.kv_dim);
        assert!(end <= self.positions, "KvCache::attend: positions {pos}..{end} exceed the cache's {}", self.positions);
        let mut store = self.store.lock().unwrap_or_else(PoisonError::into_inner);
        let Store { k, v, layer } = &mut *store;
        assert!(*layer < self.n_layer, "KvCache::attend: a pass runs {} layers", self.n_layer);
        let span = self.positions * kvd;
        let (k, v) = (&mut k[*layer * span..][..span], &mut v[*layer * span..][..span]);
        let window = self.windows[*layer];
        *layer += 1;
        for (i, row) in qkv.chunks_exact(w).enumerate() {
            k[(pos + i) * kvd..][..kvd].copy_from_slice(&row[qd..qd + kvd]);
            v[(pos + i) * kvd..][..kvd].copy_from_slice(&row[qd + kvd..]);
        }
        let (k, v) = (&k[..end * kvd], &v[..end * kvd]);
        let group = n_head / n_kv_head;
        let scale = self.scores.scale_for(d);
        // One task per query head: its GEMMs run on one thread.
        let par = Par::ONE.with(ops);
        let mut scores = vec![0.0f32; n_head * n * end];
        let mut heads = vec![0.0f32; n_head * n * d];
        scores.par_chunks_mut(n * end).zip(heads.par_chunks_mut(n * d)).enumerate().for_each(|(h, (a, yh))| {
            let kv = (h / group) * d;
            let q = Strided { data: qkv, offset: h * d, rs: w, cs: 1 };
            let k_t = Strided { data: k, offset: kv, rs: 1, cs: kvd };
            let v = Strided { data: v, offset: kv, rs: kvd, cs: 1 };
            // scores = scale · q · kᵀ: (n, d) @ (d, end) -> (n, end)
            gemm_into(GemmDims { m: n, n: end, k: d }, a, GemmOut::overwrite(end), q, k_t, scale, par);
            self.scores.cap(a);
            causal_softmax_after(a, end, pos, window);
            // y_h = att · v: (n, end) @ (end, d) -> (n, d)
            gemm_into(GemmDims { m: n, n: d, k: end }, yh, GemmOut::overwrite(d), Strided::rows(a, end), v, 1.0, par);
        });
        // Head-major [H, n, d] → rows [n, H·d].
        y.par_chunks_mut(qd).enumerate().for_each(|(r, row)| {
            for (h, dst) in row.chunks_mut(d).enumerate() {
                dst.copy_from_slice(&heads[(h * n + r) * d..][..d]);
            }
        });
    }
}

/// Causal softmax, in place, of score rows `width` wide whose first row is
/// position `pos`: row `i` becomes softmax over its first `pos + i + 1`
/// entries — with a `window` (0: none), over the last `window` of them —
/// (max-subtracted, summed in f32 in order, as
/// [`crate::attention::causal_softmax_rows`]), and the rest become 0.
#[multiversion(targets("x86_64+avx512f+avx512bw+avx512vl+avx512dq+avx2+fma", "x86_64+avx2+fma"))]
fn causal_softmax_after(a: &mut [f32], width: usize, pos: usize, window: usize) {
    for (i, row) in a.chunks_mut(width).enumerate() {
        let (valid, masked) = row.split_at_mut(pos + i + 1);
        let (before, valid) = valid.split_at_mut(crate::flash::window_start(pos + i, window));
        before.fill(0.0);
        let max = valid.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
        valid.iter_mut().for_each(|x| *x = fast_exp(*x - max));
        let sum = valid.iter().fold(0.0f32, |acc, &x| acc + x);
        let inv = 1.0 / sum;
        valid.iter_mut().for_each(|x| *x *= inv);
        masked.fill(0.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attention::attention_forward;
    use crate::testutil::randn;
    use crate::Operands;

    fn shape(t: usize, n_head: usize, n_kv_head: usize, head_dim: usize) -> AttnShape {
        AttnShape { b: 1, t, n_head, n_kv_head, head_dim, ops: Operands::F32 }
    }

    /// Runs `qkv`'s rows through a one-layer cache in pieces of `steps`
    /// rows (the cache sized for all of them) and returns the outputs.
    fn cached(qkv: &[f32], s: AttnShape, steps: &[usize]) -> Vec<f32> {
        let (w, qd, t) = (s.qkv_width(), s.q_dim(), s.t);
        let mut kv = KvCache::new(1, t, s.n_kv_head * s.head_dim).unwrap();
        let mut y = Vec::new();
        let mut at = 0;
        for &n in steps {
            assert_eq!(kv.feed_from(&vec![7; at + n]), Some(at), "the cache holds the first {at} positions");
            let mut yn = vec![0.0; n * qd];
            kv.attend(&mut yn, &qkv[at * w..(at + n) * w], AttnShape { t: n, ..s });
            kv.commit(&vec![7; n]);
            y.extend(yn);
            at += n;
        }
        assert_eq!(at, t);
        y
    }

    /// Prefill then one row at a time gives the full causal attention's
    /// rows: bit for bit for the prefill (the same GEMM shapes), within
    /// rounding for the single rows (a one-row GEMM may sum in another order).
    #[test]
    fn cached_rows_match_full_causal_attention() {
        for s in [shape(9, 4, 2, 8), shape(7, 3, 3, 4), shape(6, 4, 1, 16)] {
            let (qd, w, t) = (s.q_dim(), s.qkv_width(), s.t);
            let qkv = randn(t * w, 11);
            let (mut y, mut att, mut heads) = (vec![0.0; t * qd], vec![0.0; s.att_len()], vec![0.0; t * qd]);
            attention_forward(&mut y, &mut att, &mut heads, &qkv, s);
            assert_eq!(cached(&qkv, s, &[t]), y, "a prefill of every row is the full forward");
            let prefill = 3;
            let steps: Vec<usize> = std::iter::once(prefill).chain(std::iter::repeat_n(1, t - prefill)).collect();
            let got = cached(&qkv, s, &steps);
            assert_eq!(got[..prefill * qd], y[..prefill * qd]);
            let err = got.iter().zip(&y).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
            assert!(err <= 1e-6, "{s:?}: one row at a time differs by {err}");
        }
    }

    /// With a sliding window, prefill then one row at a time gives the
    /// tiled kernel's windowed rows within rounding (both f32, other
    /// summation orders: the bound of the test above, scaled to the
    /// flash kernel's 1e-5 against materialised attention); a key one step
    /// inside or outside the window moves rows by O(1e-1). The same with
    /// Gemma 2's scores (another scale, a soft cap) and with a window on
    /// one layer of two (each layer's rows against its own kernel call).
    #[test]
    fn a_windowed_cache_sees_what_windowed_attention_sees() {
        let s = shape(40, 4, 2, 8);
        let (qd, w, t) = (s.q_dim(), s.qkv_width(), s.t);
        let qkv: Vec<f32> = randn(t * w, 12).iter().map(|x| 2.0 * x).collect();
        let capped = Scores { scale: Some(0.2), softcap: Some(1.5) };
        let cases = [
            (vec![Some(1)], Scores::default()),
            (vec![Some(6)], Scores::default()),
            (vec![Some(39)], Scores::default()),
            (vec![Some(6)], capped),
            (vec![Some(6), None], capped),
        ];
        for (windows, scores) in cases {
            let mut kv = KvCache::new(windows.len(), t, s.n_kv_head * s.head_dim).unwrap();
            kv = kv.layer_windows(&windows).scored(scores);
            let mut got = vec![Vec::new(); windows.len()];
            for (at, n) in [(0, 10)].into_iter().chain((10..t).map(|i| (i, 1))) {
                assert_eq!(kv.feed_from(&vec![7; at + n]), Some(at));
                for got in &mut got {
                    let mut yn = vec![0.0; n * qd];
                    kv.attend(&mut yn, &qkv[at * w..(at + n) * w], AttnShape { t: n, ..s });
                    got.extend(yn);
                }
                kv.commit(&vec![7; n]);
            }
            for (&window, got) in windows.iter().zip(&got) {
                let v = crate::flash::Visible::CAUSAL.window(window).scored(scores);
                let (mut y, mut lse) = (vec![0.0; t * qd], vec![0.0; s.n_head * t]);
                crate::flash::flash_attention_forward(&mut y, &mut lse, &qkv, s, v);
                let err = got.iter().zip(&y).map(|(a, b)| (a - b).abs() / (1.0 + b.abs())).fold(0.0f32, f32::max);
                assert!(err <= 1e-5, "window {window:?}, {scores:?}: cached rows differ by {err}");
            }
        }
    }

    /// The cache keeps the longest prefix of a new sequence it holds,
    /// always runs the last token, and refuses a sequence it cannot hold.
    #[test]
    fn feed_from_keeps_the_common_prefix() {
        let mut kv = KvCache::new(2, 5, 4).unwrap();
        assert_eq!(kv.bytes(), 2 * 4 * 2 * 5 * 4);
        assert_eq!(kv.feed_from(&[1, 2, 3]), Some(0));
        kv.store_mut().layer = 2;
        kv.commit(&[1, 2, 3]);
        assert_eq!(kv.feed_from(&[1, 2, 3, 4]), Some(3), "extends the cached tokens");
        assert_eq!(kv.feed_from(&[1, 2, 3]), Some(2), "the last token runs again for its logits");
        assert_eq!(kv.len(), 2);
        assert_eq!(kv.feed_from(&[1, 9, 3]), Some(1), "diverges after the first token");
        assert_eq!(kv.feed_from(&[5, 1, 2]), Some(0), "a shifted window shares nothing");
        assert_eq!(kv.feed_from(&[1; 6]), None, "more positions than the cache holds");
        assert!(kv.is_empty());
    }

    /// A pass must run every layer once before it is committed.
    #[test]
    #[should_panic(expected = "every layer once")]
    fn commit_refuses_a_partial_pass() {
        let mut kv = KvCache::new(2, 4, 4).unwrap();
        assert_eq!(kv.feed_from(&[1]), Some(0));
        let mut y = vec![0.0; 4];
        kv.attend(&mut y, &randn(12, 1), shape(1, 1, 1, 4));
        kv.commit(&[1]);
    }
}
