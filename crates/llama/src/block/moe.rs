//! The layer's mixture of experts in place of its MLP (Mixtral,
//! Qwen2-MoE, Qwen3-MoE): the router (f32 GEMM and softmax), the top-k
//! dispatch ([`nn::moe`]), each expert's gate|up, activation and down on
//! the rows it was sent, the weighted combine, and Qwen2-MoE's shared
//! expert scaled by its sigmoid gate. Saved: the experts' gate|up (`GU`),
//! activations (`M`) and outputs (`YX`), the shared expert's three, and in
//! f32 the router's probabilities, log-sum-exps and the shared gate's logits.

use super::{Back, Layer, GU, H2, M, SGU, SM, SY, YX};
use engine::{EngineError, SavedTensor};
use nn::grad::param_grad;
use nn::linear::{columns, linear_backward_input, linear_backward_weight, linear_forward, Cols, LinearShape};
use nn::moe::{
    combine, combine_backward, gather, router_backward, router_softmax, scatter, MoeShape, RouterLoss, Routing, Tally,
};
use nn::{Operands, Strided};

/// What a pass's routing needs besides the layers: the tally the forward
/// adds to (when counting), the router losses' coefficients and the loss
/// seed the backward scales them by.
#[derive(Debug, Default)]
pub struct MoeState {
    /// Counted by the forward of a training or evaluation pass (never by a
    /// recomputation).
    pub tally: Tally,
    /// This micro-batch's coefficients.
    pub loss: RouterLoss,
    /// The backward's loss seed.
    pub seed: f32,
}

/// The state behind its lock (a panic elsewhere leaves it readable).
pub fn state(m: &std::sync::Mutex<MoeState>) -> std::sync::MutexGuard<'_, MoeState> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Row statistics of the mixture: probabilities `[n, E]`, log-sum-exps `[n]`, shared gate logits `[n]`.
pub(super) type MoeStats<'a> = (&'a mut [f32], &'a mut [f32], &'a mut [f32]);

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

impl Layer<'_> {
    fn moe_shape(&self) -> MoeShape {
        self.d.moe.unwrap_or_else(|| unreachable!("a mixture without its shape"))
    }

    /// `x = res + Σ_k w·expert(h2) (+ σ(g·h2)·shared(h2))`; `kept`: GU, M,
    /// YX, SGU, SM, SY; `bufs`: gate|up, m, two `[n·k, C]` and the router's.
    pub(super) fn moe_forward(
        &self,
        p: &[f32],
        (h2, res, x): (&[f32], &[f32], &mut [f32]),
        kept: [&mut SavedTensor; 6],
        (probs, lse, sgate): MoeStats<'_>,
        [gu, m, a, b]: [&mut Vec<f32>; 4],
    ) {
        let (s, mp, prec, ops) = (self.moe_shape(), self.moe_params(), self.d.prec, self.d.ops);
        let (n, c, f, e, nk) = (s.n, s.c, s.f, s.experts, s.slots());
        let [gu_t, m_t, yx_t, sgu_t, sm_t, sy_t] = kept;
        // Router: (n, C) @ (C, E) in f32, softmax, top-k.
        linear_forward(Cols::all(probs, e), false, h2, &p[mp.router.clone()], LinearShape::new(n, c, e, Operands::F32));
        router_softmax(probs, lse, e);
        let route = Routing::new(probs, &s);
        if let Some(st) = self.moe.filter(|_| self.counting) {
            state(st).tally.add(probs, lse, &route, e);
        }
        // Each expert on its rows: (m_e, C) @ (C, 2F) → SwiGLU → (m_e, F) @ (F, C).
        gather(a, h2, &route, &s);
        for (ex, rows) in route.busy() {
            let [g, _, _] = mp.expert(ex, (f, c));
            let w = &p[g.start..g.start + 2 * f * c];
            let (out, inp) = (&mut gu[rows.start * 2 * f..rows.end * 2 * f], &a[rows.start * c..rows.end * c]);
            linear_forward(Cols::all(out, 2 * f), false, inp, w, LinearShape::new(rows.len(), c, 2 * f, ops));
        }
        gu_t.keep_prefix(gu, nk * 2 * f, prec);
        self.cfg.glu().forward(&mut m[..nk * f], gu_t.cur(&gu[..nk * 2 * f]), f);
        m_t.keep_prefix(m, nk * f, prec);
        let mm = m_t.cur(&m[..nk * f]);
        for (ex, rows) in route.busy() {
            let [_, _, d] = mp.expert(ex, (f, c));
            let (out, inp) = (&mut b[rows.start * c..rows.end * c], &mm[rows.start * f..rows.end * f]);
            linear_forward(Cols::all(out, c), false, inp, &p[d], LinearShape::new(rows.len(), f, c, ops));
        }
        yx_t.keep_prefix(b, nk * c, prec);
        combine(x, res, yx_t.cur(&b[..nk * c]), &route, &s);
        let (Some(sh), Some(fs)) = (&mp.shared, self.cfg.moe.as_ref().and_then(|m| m.shared_expert_size)) else {
            return;
        };
        // The shared expert on every row, scaled by σ(h2 · gᵀ).
        linear_forward(Cols::all(sgate, 1), false, h2, &p[sh[3].clone()], LinearShape::new(n, c, 1, Operands::F32));
        let w = &p[sh[0].start..sh[1].end];
        linear_forward(Cols::all(&mut gu[..n * 2 * fs], 2 * fs), false, h2, w, LinearShape::new(n, c, 2 * fs, ops));
        sgu_t.keep_prefix(gu, n * 2 * fs, prec);
        self.cfg.glu().forward(&mut m[..n * fs], sgu_t.cur(&gu[..n * 2 * fs]), fs);
        sm_t.keep_prefix(m, n * fs, prec);
        let smm = sm_t.cur(&m[..n * fs]);
        linear_forward(Cols::all(&mut a[..n * c], c), false, smm, &p[sh[2].clone()], LinearShape::new(n, fs, c, ops));
        sy_t.keep_prefix(a, n * c, prec);
        let sy = sy_t.cur(&a[..n * c]);
        for ((xr, yr), &g) in x.chunks_mut(c).zip(sy.chunks(c)).zip(sgate.iter()) {
            let gate = sigmoid(g);
            xr.iter_mut().zip(yr).for_each(|(x, y)| *x += gate * y);
        }
    }

    /// The mixture's backward from the layer output's gradient `dres` into
    /// `dh` (the gradient of its input h2, overwritten), its weights'
    /// gradients added as the store says; the router's losses enter here.
    pub(super) fn moe_backward(
        &self,
        p: &[f32],
        dres: &[f32],
        dh: &mut [f32],
        back: &mut Back<'_, '_>,
        [dgu, dm, a, b, r]: [&mut Vec<f32>; 5],
    ) -> Result<(), EngineError> {
        let (s, mp, ops) = (self.moe_shape(), self.moe_params(), self.d.ops);
        let (n, c, f, e, nk) = (s.n, s.c, s.f, s.experts, s.slots());
        let sv = back.saved.sv;
        let [probs, lse, sgate] = [&sv.stats[super::PROBS], &sv.stats[super::LSE], &sv.stats[super::SGATE]];
        let route = Routing::new(probs, &s);
        let (dw, dl) = r.split_at_mut(nk);
        combine_backward(a, dw, dres, back.saved.get(YX), &route, &s);
        // down: dW_e += dysᵀ·m_e; dm_e = dys·W_e.
        {
            let mm = back.saved.get(M);
            for (ex, rows) in route.busy() {
                let [_, _, d] = mp.expert(ex, (f, c));
                let (len, dys) = (rows.len(), Strided::rows(&a[rows.start * c..rows.end * c], c));
                let shape = LinearShape::new(len, f, c, ops);
                linear_backward_weight(
                    param_grad(back.grads.tensor(d.clone())),
                    dys,
                    &mm[rows.start * f..rows.end * f],
                    shape,
                );
                linear_backward_input(&mut dm[rows.start * f..rows.end * f], false, dys, &p[d], shape);
            }
        }
        self.cfg.glu().backward(&mut dgu[..nk * 2 * f], &dm[..nk * f], back.saved.get(GU), f);
        // gate|up: dW_gate, dW_up += (dgu's halves)ᵀ·xs; dxs = dgu·W_gu.
        gather(b, back.saved.get(H2), &route, &s);
        for (ex, rows) in route.busy() {
            let [g, u, _] = mp.expert(ex, (f, c));
            let (len, xs) = (rows.len(), &b[rows.start * c..rows.end * c]);
            let dg = &dgu[rows.start * 2 * f..rows.end * 2 * f];
            for (col0, w) in [(0, g.clone()), (f, u)] {
                linear_backward_weight(
                    param_grad(back.grads.tensor(w)),
                    columns(dg, col0, 2 * f),
                    xs,
                    LinearShape::new(len, c, f, ops),
                );
            }
            let w = &p[g.start..g.start + 2 * f * c];
            let shape = LinearShape::new(len, c, 2 * f, ops);
            linear_backward_input(&mut a[rows.start * c..rows.end * c], false, Strided::rows(dg, 2 * f), w, shape);
        }
        scatter(dh, a, &route, &s);
        // The router: its losses' coefficients and the seed from this pass's state.
        {
            let st = self.moe.map(state);
            let none = RouterLoss::default();
            let (loss, seed) = st.as_ref().map_or((&none, 1.0), |st| (&st.loss, st.seed));
            router_backward(dl, dw, (probs, lse), &route, &s, (loss, seed));
        }
        let h2 = back.saved.get(H2);
        let router = mp.router.clone();
        let (rs, dls) = (LinearShape::new(n, c, e, Operands::F32), Strided::rows(&dl[..n * e], e));
        linear_backward_weight(param_grad(back.grads.tensor(router.clone())), dls, h2, rs);
        linear_backward_input(dh, true, dls, &p[router], rs);
        let (Some(sh), Some(fs)) = (&mp.shared, self.cfg.moe.as_ref().and_then(|m| m.shared_expert_size)) else {
            return Ok(());
        };
        // Shared expert: dsy = σ·dres, d(gate logit) = ⟨dres, sy⟩·σ(1 − σ).
        let dg = &mut dw[..n];
        {
            let sy = back.saved.get(SY);
            for (row, dg) in dg.iter_mut().enumerate() {
                let sg = sigmoid(sgate[row]);
                let (dr, y) = (&dres[row * c..(row + 1) * c], &sy[row * c..(row + 1) * c]);
                let dot: f64 = dr.iter().zip(y).map(|(a, b)| (a * b) as f64).sum();
                *dg = (dot * (sg * (1.0 - sg)) as f64) as f32;
                a[row * c..(row + 1) * c].iter_mut().zip(dr).for_each(|(a, d)| *a = sg * d);
            }
        }
        let dsy = Strided::rows(&a[..n * c], c);
        let shape = LinearShape::new(n, fs, c, ops);
        linear_backward_weight(param_grad(back.grads.tensor(sh[2].clone())), dsy, back.saved.get(SM), shape);
        linear_backward_input(&mut dm[..n * fs], false, dsy, &p[sh[2].clone()], shape);
        self.cfg.glu().backward(&mut dgu[..n * 2 * fs], &dm[..n * fs], back.saved.get(SGU), fs);
        let h2 = back.saved.get(H2);
        let dsg = &dgu[..n * 2 * fs];
        for (col0, w) in [(0, sh[0].clone()), (fs, sh[1].clone())] {
            linear_backward_weight(
                param_grad(back.grads.tensor(w)),
                columns(dsg, col0, 2 * fs),
                h2,
                LinearShape::new(n, c, fs, ops),
            );
        }
        let w = &p[sh[0].start..sh[1].end];
        linear_backward_input(dh, true, Strided::rows(dsg, 2 * fs), w, LinearShape::new(n, c, 2 * fs, ops));
        let gs = LinearShape::new(n, c, 1, Operands::F32);
        linear_backward_weight(param_grad(back.grads.tensor(sh[3].clone())), Strided::rows(dg, 1), h2, gs);
        linear_backward_input(dh, true, Strided::rows(dg, 1), &p[sh[3].clone()], gs);
        Ok(())
    }
}
