//! A mixture of experts' routing, once: the router's softmax (with its
//! log-sum-exp, for the z-loss), the top-k choice per row, the dispatch of
//! rows to experts (dropless: every row reaches its k experts, whatever the
//! load), the weighted combine, and the router's backward with the
//! load-balancing and z-losses' gradients. The experts themselves are
//! gated MLPs the family runs on the dispatched rows with
//! [`crate::linear`]; a row's result never depends on which other rows
//! share its micro-batch beyond the GEMMs' own rounding.
//!
//! The load-balancing loss (Switch Transformer's, as transformers'
//! `load_balancing_loss_func` computes it over every layer's router at
//! once) is `α·E·Σᵢ fᵢ·Pᵢ`, with `fᵢ` the share of (layer, row, slot)
//! choices that went to expert `i` and `Pᵢ` the mean router probability of
//! `i` over (layer, row). `fᵢ` is held constant (an argmax has no
//! gradient), so once `fᵢ` is known the loss is a sum over rows of
//! `Σᵢ aᵢ·p_{row,i}`: [`Tally::coefficients`] gives `aᵢ`, and the loss is
//! exact under any cut of the batch exactly when `fᵢ` is the whole batch's.

use crate::act::Glu;
use rayon::prelude::*;

/// The shape of one mixture-of-experts call.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MoeShape {
    /// Rows.
    pub n: usize,
    /// Input (and output) width.
    pub c: usize,
    /// Each expert's hidden width (its gate and up are `[f, c]`, down `[c, f]`).
    pub f: usize,
    /// Experts.
    pub experts: usize,
    /// Experts per row.
    pub top_k: usize,
    /// Whether the k chosen probabilities are renormalised to sum to 1
    /// (Mixtral always; Qwen-MoE as `norm_topk_prob` says).
    pub norm_topk: bool,
    /// The experts' activation.
    pub glu: Glu,
}

impl MoeShape {
    /// Dispatched rows: every row once per chosen expert.
    pub fn slots(&self) -> usize {
        self.n * self.top_k
    }

    /// Parameters of one expert: gate | up `[2f, c]`, then down `[c, f]`.
    pub fn expert_len(&self) -> usize {
        3 * self.f * self.c
    }
}

/// Router probabilities: `probs[n, E] = softmax(logits)` row by row (in
/// place over `logits`), each row's log-sum-exp into `lse[n]`.
pub fn router_softmax(logits: &mut [f32], lse: &mut [f32], experts: usize) {
    assert_eq!(logits.len(), lse.len() * experts, "router_softmax: logits are not [n, E]");
    logits.par_chunks_mut(experts).zip(lse.par_iter_mut()).for_each(|(row, lse)| {
        let max = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
        let mut sum = 0.0f64;
        for x in row.iter_mut() {
            *x = (*x - max).exp();
            sum += *x as f64;
        }
        let inv = (1.0 / sum) as f32;
        row.iter_mut().for_each(|x| *x *= inv);
        *lse = max + (sum.ln() as f32);
    });
}

/// Which experts each row goes to, with what weight, and the dispatch
/// order: the (row, slot) pairs sorted by expert, then row.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Routing {
    /// `[n, k]`: the chosen experts, by descending probability (ties: the
    /// lower index first, as `torch.topk` on CPU returns them).
    pub expert: Vec<u32>,
    /// `[n, k]`: their weights (probabilities, renormalised if asked).
    pub weight: Vec<f32>,
    /// `[n·k]`: the (row·k + slot) at each dispatched position.
    pub order: Vec<u32>,
    /// `[n·k]`: the dispatched position of each (row·k + slot).
    pub pos: Vec<u32>,
    /// `[E + 1]`: expert `e`'s dispatched rows are `offsets[e]..offsets[e + 1]`.
    pub offsets: Vec<usize>,
}

impl Routing {
    /// The routing `probs` (`[n, E]`, softmaxed) asks for.
    pub fn new(probs: &[f32], s: &MoeShape) -> Self {
        let (e, k) = (s.experts, s.top_k);
        assert!(k >= 1 && k <= e, "top-{k} of {e} experts");
        assert_eq!(probs.len(), s.n * e, "Routing::new: probs are not [n, E]");
        let mut expert = vec![0u32; s.n * k];
        let mut weight = vec![0f32; s.n * k];
        expert.par_chunks_mut(k).zip(weight.par_chunks_mut(k)).zip(probs.par_chunks(e)).for_each(|((ex, w), p)| {
            for j in 0..k {
                // The largest not yet taken; ties to the lower index.
                let mut best = usize::MAX;
                for i in 0..e {
                    if ex[..j].contains(&(i as u32)) {
                        continue;
                    }
                    if best == usize::MAX || p[i] > p[best] {
                        best = i;
                    }
                }
                ex[j] = best as u32;
                w[j] = p[best];
            }
            if s.norm_topk {
                let sum: f32 = w.iter().sum();
                w.iter_mut().for_each(|x| *x /= sum);
            }
        });
        let mut offsets = vec![0usize; e + 1];
        for &x in &expert {
            offsets[x as usize + 1] += 1;
        }
        for i in 0..e {
            offsets[i + 1] += offsets[i];
        }
        let mut next = offsets[..e].to_vec();
        let (mut order, mut pos) = (vec![0u32; s.n * k], vec![0u32; s.n * k]);
        for (slot, &x) in expert.iter().enumerate() {
            let at = next[x as usize];
            next[x as usize] += 1;
            order[at] = slot as u32;
            pos[slot] = at as u32;
        }
        Routing { expert, weight, order, pos, offsets }
    }

    /// Rows dispatched to expert `e`.
    pub fn rows_of(&self, e: usize) -> std::ops::Range<usize> {
        self.offsets[e]..self.offsets[e + 1]
    }

    /// The experts some row was sent to, with their dispatched rows (an
    /// expert no row chose runs nothing).
    pub fn busy(&self) -> impl Iterator<Item = (usize, std::ops::Range<usize>)> + '_ {
        (0..self.offsets.len() - 1).map(|e| (e, self.rows_of(e))).filter(|(_, r)| !r.is_empty())
    }
}

/// `xs[p] = h[row of p]`: the rows in dispatch order (`[n·k, c]`).
pub fn gather(xs: &mut [f32], h: &[f32], r: &Routing, s: &MoeShape) {
    let c = s.c;
    xs[..s.slots() * c].par_chunks_mut(c).zip(r.order.par_iter()).for_each(|(x, &o)| {
        let row = o as usize / s.top_k;
        x.copy_from_slice(&h[row * c..(row + 1) * c]);
    });
}

/// `out[row] = res[row] + Σ_slot w·ys[pos(row, slot)]`, the slots in
/// order (a fixed sum per row).
pub fn combine(out: &mut [f32], res: &[f32], ys: &[f32], r: &Routing, s: &MoeShape) {
    let (c, k) = (s.c, s.top_k);
    out[..s.n * c].par_chunks_mut(c).enumerate().for_each(|(row, o)| {
        o.copy_from_slice(&res[row * c..(row + 1) * c]);
        for j in 0..k {
            let (w, p) = (r.weight[row * k + j], r.pos[row * k + j] as usize);
            for (o, y) in o.iter_mut().zip(&ys[p * c..(p + 1) * c]) {
                *o += w * y;
            }
        }
    });
}

/// `dys[pos(row, slot)] = w·dy[row]` (`[n·k, c]`) and the weights'
/// gradients `dw[row·k + slot] = ⟨dy[row], ys[pos]⟩`.
pub fn combine_backward(dys: &mut [f32], dw: &mut [f32], dy: &[f32], ys: &[f32], r: &Routing, s: &MoeShape) {
    let (c, k) = (s.c, s.top_k);
    dys[..s.slots() * c].par_chunks_mut(c).zip(r.order.par_iter()).for_each(|(d, &o)| {
        let (row, w) = (o as usize / k, r.weight[o as usize]);
        d.iter_mut().zip(&dy[row * c..(row + 1) * c]).for_each(|(d, g)| *d = w * g);
    });
    dw[..s.slots()].par_iter_mut().enumerate().for_each(|(slot, dw)| {
        let (row, p) = (slot / k, r.pos[slot] as usize);
        let dot: f64 =
            dy[row * c..(row + 1) * c].iter().zip(&ys[p * c..(p + 1) * c]).map(|(a, b)| (a * b) as f64).sum();
        *dw = dot as f32;
    });
}

/// `dh[row] = Σ_slot dxs[pos(row, slot)]` (overwritten), the slots in order.
pub fn scatter(dh: &mut [f32], dxs: &[f32], r: &Routing, s: &MoeShape) {
    let (c, k) = (s.c, s.top_k);
    dh[..s.n * c].par_chunks_mut(c).enumerate().for_each(|(row, d)| {
        d.fill(0.0);
        for j in 0..k {
            let p = r.pos[row * k + j] as usize;
            d.iter_mut().zip(&dxs[p * c..(p + 1) * c]).for_each(|(d, x)| *d += x);
        }
    });
}

/// The router's losses this layer adds, as coefficients: the
/// load-balancing loss's `aᵢ` (the sum adds `Σᵢ aᵢ·p_{row,i}` per row) and
/// the z-loss's `z` (the sum adds `z·lse²` per row).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RouterLoss {
    /// `[E]`.
    pub balance: Vec<f64>,
    /// The z-loss's factor per row.
    pub z: f64,
}

/// The router's backward: from the weights' gradients `dw` (`[n·k]`,
/// already scaled by the loss seed) and the router losses (scaled by
/// `seed` here), the logits' gradient `dlogits` `[n, E]` (overwritten).
pub fn router_backward(
    dlogits: &mut [f32],
    dw: &[f32],
    (probs, lse): (&[f32], &[f32]),
    r: &Routing,
    s: &MoeShape,
    (loss, seed): (&RouterLoss, f32),
) {
    let (e, k) = (s.experts, s.top_k);
    dlogits[..s.n * e].par_chunks_mut(e).enumerate().for_each(|(row, dl)| {
        let p = &probs[row * e..(row + 1) * e];
        // ∂/∂p: the chosen experts' weights (through the renormalisation
        // w_j = p_j / Σ p_chosen), the balance loss's constant aᵢ.
        for (i, d) in dl.iter_mut().enumerate() {
            *d = (seed as f64 * loss.balance.get(i).copied().unwrap_or(0.0)) as f32;
        }
        let (ex, w, g) =
            (&r.expert[row * k..(row + 1) * k], &r.weight[row * k..(row + 1) * k], &dw[row * k..(row + 1) * k]);
        if s.norm_topk {
            let sum: f32 = ex.iter().map(|&i| p[i as usize]).sum();
            let gw: f32 = g.iter().zip(w).map(|(g, w)| g * w).sum();
            for j in 0..k {
                dl[ex[j] as usize] += (g[j] - gw) / sum;
            }
        } else {
            for j in 0..k {
                dl[ex[j] as usize] += g[j];
            }
        }
        // Softmax: dl = p ⊙ (dp − Σ p·dp); the z-loss z·lse² adds 2z·lse·p.
        let dot: f64 = p.iter().zip(dl.iter()).map(|(p, d)| (p * d) as f64).sum();
        let zg = 2.0 * loss.z * seed as f64 * lse[row] as f64;
        for (d, &p) in dl.iter_mut().zip(p) {
            *d = ((*d as f64 - dot + zg) * p as f64) as f32;
        }
    });
}

/// What a step's router losses need counted over the layers of a pass:
/// the choices of each expert, the rows routed, the probabilities' sums
/// and the squared log-sum-exps.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Tally {
    /// `[E]`: (layer, row, slot) choices of each expert.
    pub chosen: Vec<f64>,
    /// `[E]`: Σ over (layer, row) of the router probability of each expert.
    pub prob: Vec<f64>,
    /// (layer, row) pairs routed.
    pub rows: f64,
    /// Σ over (layer, row) of lse².
    pub lse2: f64,
}

impl Tally {
    /// Adds one layer's routing of `n` rows.
    pub fn add(&mut self, probs: &[f32], lse: &[f32], r: &Routing, experts: usize) {
        if self.chosen.len() != experts {
            self.chosen = vec![0.0; experts];
            self.prob = vec![0.0; experts];
        }
        for &x in &r.expert {
            self.chosen[x as usize] += 1.0;
        }
        for row in probs.chunks(experts) {
            self.prob.iter_mut().zip(row).for_each(|(s, &p)| *s += p as f64);
        }
        self.rows += lse.len() as f64;
        self.lse2 += lse.iter().map(|&z| (z as f64) * (z as f64)).sum::<f64>();
    }

    /// The load-balancing coefficients `aᵢ = α·E·(targets / routed)·fᵢ / routed`
    /// for the choices `chosen` among `routed` (layer, row) pairs and the
    /// targets they are weighed against (the loss is `α·E·Σ fᵢPᵢ` per
    /// target, transformers' `loss + α·aux` with the mean taken over
    /// targets), `fᵢ = chosen_i / routed`.
    pub fn coefficients(alpha: f64, chosen: &[f64], routed: f64, targets: f64) -> Vec<f64> {
        if routed <= 0.0 {
            return vec![0.0; chosen.len()];
        }
        let e = chosen.len() as f64;
        chosen.iter().map(|&c| alpha * e * targets * (c / routed) / routed).collect()
    }

    /// `Σᵢ aᵢ·probᵢ`: the balance loss's sum over this tally's rows.
    pub fn balance_sum(&self, a: &[f64]) -> f64 {
        a.iter().zip(&self.prob).map(|(a, p)| a * p).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::randn;

    fn shape(n: usize, norm_topk: bool) -> MoeShape {
        MoeShape { n, c: 3, f: 2, experts: 5, top_k: 2, norm_topk, glu: Glu::Silu }
    }

    #[test]
    fn routing_takes_the_k_largest_and_dispatches_each_row_k_times() {
        let s = shape(4, false);
        let mut probs = randn(s.n * s.experts, 3);
        let mut lse = vec![0.0; s.n];
        router_softmax(&mut probs, &mut lse, s.experts);
        let r = Routing::new(&probs, &s);
        for row in 0..s.n {
            let p = &probs[row * 5..(row + 1) * 5];
            let mut sorted: Vec<usize> = (0..5).collect();
            sorted.sort_by(|&a, &b| p[b].total_cmp(&p[a]));
            assert_eq!(r.expert[row * 2..row * 2 + 2], [sorted[0] as u32, sorted[1] as u32]);
        }
        assert_eq!(r.offsets[5], 8);
        for (at, &o) in r.order.iter().enumerate() {
            assert_eq!(r.pos[o as usize] as usize, at);
            let e = r.expert[o as usize] as usize;
            assert!(r.rows_of(e).contains(&at));
        }
        // Renormalised weights sum to one.
        let r = Routing::new(&probs, &shape(4, true));
        for w in r.weight.chunks(2) {
            assert!((w[0] + w[1] - 1.0).abs() < 1e-6);
        }
    }

    /// The router's backward against central differences of
    /// `L = Σ_rows Σ_slots g·w + Σᵢ aᵢ·Σ_rows p_i + z·Σ lse²` with the
    /// routing held (the chosen experts do not move under a small step).
    #[test]
    fn router_backward_matches_finite_differences() {
        for norm in [false, true] {
            let s = shape(3, norm);
            let logits = randn(s.n * s.experts, 7);
            let g = randn(s.slots(), 8);
            let loss = RouterLoss { balance: vec![0.3, -0.2, 0.5, 0.1, 0.7], z: 0.05 };
            let route = {
                let (mut p, mut l) = (logits.clone(), vec![0.0; s.n]);
                router_softmax(&mut p, &mut l, s.experts);
                Routing::new(&p, &s)
            };
            let f = |x: &[f32]| -> f64 {
                let (mut p, mut l) = (x.to_vec(), vec![0.0; s.n]);
                router_softmax(&mut p, &mut l, s.experts);
                let mut total = 0.0f64;
                for row in 0..s.n {
                    let pr = &p[row * 5..(row + 1) * 5];
                    let ex = &route.expert[row * 2..row * 2 + 2];
                    let sum: f32 = if norm { ex.iter().map(|&i| pr[i as usize]).sum() } else { 1.0 };
                    for j in 0..2 {
                        total += (g[row * 2 + j] * pr[ex[j] as usize] / sum) as f64;
                    }
                    total += loss.balance.iter().zip(pr).map(|(a, &p)| a * p as f64).sum::<f64>();
                    total += loss.z * (l[row] as f64).powi(2);
                }
                total
            };
            let (mut probs, mut lse) = (logits.clone(), vec![0.0; s.n]);
            router_softmax(&mut probs, &mut lse, s.experts);
            let mut dl = vec![0.0; logits.len()];
            router_backward(&mut dl, &g, (&probs, &lse), &route, &s, (&loss, 1.0));
            for i in 0..logits.len() {
                let h = 1e-2f32;
                let (mut a, mut b) = (logits.clone(), logits.clone());
                a[i] += h;
                b[i] -= h;
                let fd = (f(&a) - f(&b)) / (2.0 * h as f64);
                // f32 softmax under a step of 1e-2: the difference quotient's
                // rounding (~1e-7 / 1e-2) and its h² term (~1e-4·|f'''|).
                assert!((fd - dl[i] as f64).abs() < 2e-3, "norm {norm}, logit {i}: fd {fd}, analytic {}", dl[i]);
            }
        }
    }

    #[test]
    fn combine_and_scatter_are_each_others_transposes() {
        let s = shape(4, true);
        let (mut probs, mut lse) = (randn(s.n * s.experts, 11), vec![0.0; s.n]);
        router_softmax(&mut probs, &mut lse, s.experts);
        let r = Routing::new(&probs, &s);
        let (h, ys, dy) = (randn(s.n * s.c, 12), randn(s.slots() * s.c, 13), randn(s.n * s.c, 14));
        let mut xs = vec![0.0; s.slots() * s.c];
        gather(&mut xs, &h, &r, &s);
        let mut out = vec![0.0; s.n * s.c];
        combine(&mut out, &vec![0.0; s.n * s.c], &ys, &r, &s);
        let (mut dys, mut dw) = (vec![0.0; s.slots() * s.c], vec![0.0; s.slots()]);
        combine_backward(&mut dys, &mut dw, &dy, &ys, &r, &s);
        // ⟨dy, combine(ys)⟩ = ⟨dys, ys⟩ = Σ w·dw.
        let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(a, b)| (a * b) as f64).sum::<f64>();
        let lhs = dot(&dy, &out);
        assert!((lhs - dot(&dys, &ys)).abs() < 1e-5 && (lhs - dot(&r.weight, &dw)).abs() < 1e-5);
        // ⟨scatter(dxs), h⟩ = ⟨dxs, gather(h)⟩.
        let mut dh = vec![0.0; s.n * s.c];
        scatter(&mut dh, &ys, &r, &s);
        assert!((dot(&dh, &h) - dot(&ys, &xs)).abs() < 1e-5);
    }

    #[test]
    fn balance_coefficients_give_transformers_aux_loss() {
        // Two layers' routings of 4 rows: α·E·Σ fᵢPᵢ with both over (layer, row).
        let s = shape(4, false);
        let mut tally = Tally::default();
        let mut want_f = [0.0f64; 5];
        let mut want_p = [0.0f64; 5];
        for seed in [21, 22] {
            let (mut probs, mut lse) = (randn(s.n * s.experts, seed), vec![0.0; s.n]);
            router_softmax(&mut probs, &mut lse, s.experts);
            let r = Routing::new(&probs, &s);
            tally.add(&probs, &lse, &r, s.experts);
            r.expert.iter().for_each(|&x| want_f[x as usize] += 1.0 / 8.0);
            probs.chunks(5).for_each(|p| p.iter().enumerate().for_each(|(i, &x)| want_p[i] += x as f64 / 8.0));
        }
        let aux: f64 = 0.01 * 5.0 * want_f.iter().zip(&want_p).map(|(f, p)| f * p).sum::<f64>();
        let a = Tally::coefficients(0.01, &tally.chosen, tally.rows, 4.0);
        // Per target: the sum over the 4 targets is 4·aux.
        assert!((tally.balance_sum(&a) - 4.0 * aux).abs() < 1e-12 * aux.abs().max(1.0));
    }
}
