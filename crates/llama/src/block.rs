//! Llama's decoder layer as the shared stack walk runs it: RMSNorm,
//! grouped-query attention with rotary q/k (and optional q/k/v biases and
//! per-head q/k norms) and a SwiGLU MLP, its four projections (q|k|v, o,
//! gate|up, down) each an [`nn::proj::Projection`], which carries the
//! adapters and the tensor-parallel split; and the sizes of every
//! activation buffer, the one definition that allocates them and reports
//! their bytes.

use crate::config::LlamaConfig;
use crate::frozen::{FrozenBase, Group};
use crate::layout::{Adapters, LayerParams, Proj};
use engine::{Checkpointing, EngineError, Inner, Precision, SavedTensor, SegmentGrads, TensorGroup};
use nn::attention::AttnShape;
use nn::flash::{flash_attention_forward, Visible};
use nn::grad::param_grad;
use nn::kv::Attention;
use nn::linear::add_into;
use nn::lora_dropout::Dropout;
use nn::norm::{rmsnorm_backward, rmsnorm_forward, HeadNorm, NormSaved};
use nn::proj::{Base, Grad, Module, Projection, Role, Site, Work};
use nn::rope::{rope_apply, Rope};
use nn::stack::{Block, Part, Saved, SavedView, StackSizes, PRE_NORM_KINDS};
use nn::{Operands, Positions};
use std::cell::Cell;
use std::sync::Mutex;

mod moe;
pub use moe::{state, MoeState};

/// Indices of a layer's saved tensors.
const H1: usize = 0; // input_layernorm's output
const QKV: usize = 1; // q | k | v, q and k rotated
const Y: usize = 2; // attention heads' output (o_proj's input)
const X2: usize = 3; // residual after attention
const H2: usize = 4; // post_attention_layernorm's output
const GU: usize = 5; // gate | up
const M: usize = 6; // silu(gate) · up (down_proj's input)
const OUT: usize = 7; // the layer's output
/// `XA + p`: projection `p`'s LoRA `x·Aᵀ` (`[n, r]`; empty without an adapter).
const XA: usize = 8;
/// `DZ + p`: with DoRA, projection `p`'s `x·Wᵀ + s·(x·Aᵀ)·Bᵀ` before the
/// magnitude's scaling (`[n, out]`; empty otherwise).
const DZ: usize = XA + 7;
/// With `qk_norm`: the query heads, then the key heads, before their norms
/// (`[n·H, d]` then `[n·KV, d]`; empty otherwise).
const QKN: usize = DZ + 7;
/// With Gemma's post norms: the attention's output (o_proj's, before its
/// norm) and the MLP's (down_proj's), `[n, C]` each (empty otherwise).
const PA: usize = QKN + 1;
const PF: usize = QKN + 2;
/// With a mixture of experts: the experts' outputs in dispatch order
/// (`[n·k, C]`; their gate|up and activations are `GU` and `M`, `[n·k, 2F]`
/// and `[n·k, F]`), the shared expert's gate|up, activation and output
/// (empty without one).
const YX: usize = QKN + 3;
const SGU: usize = QKN + 4;
const SM: usize = QKN + 5;
const SY: usize = QKN + 6;
/// Row statistics of a mixture: the router's probabilities `[n, E]`, its
/// log-sum-exps and the shared expert gate's logits `[n]` each.
const PROBS: usize = 7;
const LSE: usize = 8;
const SGATE: usize = 9;

/// Staging buffers: row tensors, the heads' output beside q|k|v, LoRA's `x·Aᵀ`.
const ROWS: usize = 0;
const HEADS: usize = 1;
const LORA: usize = 2;

/// Shapes of one layer call.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Dims {
    /// Rows B·T.
    pub n: usize,
    pub c: usize,
    pub f: usize,
    /// Attention (its GEMMs on f32 operands in every precision).
    pub gqa: AttnShape,
    pub eps: f32,
    /// LoRA rank (0 without adapters) and scale α/r.
    pub r: usize,
    pub lora_scale: f32,
    /// GEMM operands of the precision ([`nn::operands`]).
    pub ops: Operands,
    /// Storage precision of saved tensors.
    pub prec: Precision,
    /// Sequence parallelism: this rank's rows of the residual stream
    /// (start, end); `None`: all `n`.
    pub seq: Option<(usize, usize)>,
    /// Context parallelism: where the rows of each sequence sit.
    pub cx: nn::context::Context,
    /// A mixture of experts' shape (`f` its experts' width), in place of the MLP.
    pub moe: Option<nn::moe::MoeShape>,
}

impl Dims {
    /// Rows of the residual stream held here (norms, residual additions).
    fn local(&self) -> usize {
        self.seq.map_or(self.n, |(a, b)| b - a)
    }
}

/// Element counts of every activation buffer of a Llama for one (B, T),
/// pass, storage precision and checkpointing: what the model allocates and
/// what [`ActSizes::bytes`] reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ActSizes {
    /// The layer stack: per layer h1, qkv, y, x2, h2, gate|up (2F), m (F),
    /// out, LoRA's x·Aᵀ per adapted projection, two f32 1/rms per row (four
    /// with Gemma's post norms, which also keep their inputs) and
    /// the attention's f32 log-sum-exp per (sequence, head, row) — no
    /// T × T matrix; working buffers dres, dc, dqkv, dgu, dm, dxa,
    /// attention scratch, the post norms' output and gradient; 16-bit staging (row tensors, heads' output, x·Aᵀ).
    pub stack: StackSizes,
    /// RoPE tables, the final norm's output and 1/rms, the logits of one
    /// chunk of the loss ([`nn::head::loss_chunk_rows`]), the per-row
    /// losses.
    pub head: [u128; 5],
    /// Micro-batches in flight, each with its own stack, RoPE tables and
    /// final-norm buffers (the logits and losses are shared: used within a forward).
    pub in_flight: usize,
}

impl ActSizes {
    /// The sizes for `b` sequences of `t` tokens.
    pub(crate) fn new(
        cfg: &LlamaConfig,
        (tp, adapters): (engine::TpRank, Option<Adapters>),
        (b, t): (usize, usize),
        (precision, checkpointing): (Precision, Checkpointing),
        train: bool,
        part: Part,
    ) -> Self {
        let w = |x: usize| x as u128;
        let (n, c, f, v) = (w(b) * w(t), w(cfg.hidden_size), w(cfg.intermediate_size), w(cfg.vocab_size));
        // Sequence parallelism: the residual stream's tensors hold this rank's rows.
        let (nl, seq) = (w(tp.seq_rows(b * t).len()), tp.splits_seq());
        let sp = |x: u128| if seq { x } else { 0 };
        let qkvw = w(cfg.n_head + 2 * cfg.n_kv_head) * w(cfg.head_dim);
        let lse = w(b) * w(cfg.n_head) * w(t);
        let r = w(adapters.map_or(0, |a| a.r));
        let xa = Proj::ALL.map(|p| match adapters {
            Some(a) if a.targets[p as usize] => n * r,
            _ => 0,
        });
        let qd = w(cfg.q_dim());
        let dora = |p: Proj| adapters.is_some_and(|a| a.dora && a.targets[p as usize]);
        // DoRA's z and norms per adapter: the rows it spans.
        let out = |p: Proj| w(p.adapter_shape(cfg).0[0]);
        let dz = Proj::ALL.map(|p| if dora(p) { n * out(p) } else { 0 });
        let max_dz = Proj::ALL.into_iter().filter(|&p| dora(p)).map(out).max().unwrap_or(0);
        let norms = Proj::ALL.iter().filter(|&&p| dora(p)).map(|&p| out(p)).sum::<u128>();
        let dropout = adapters.is_some_and(|a| a.dropout);
        let max_in = if dropout { Proj::ALL.into_iter().map(|p| w(p.shape(cfg)[1])).max().unwrap_or(0) } else { 0 };
        // A mixture's experts run on n·k dispatched rows of their own width.
        let moe = cfg.moe.as_ref();
        let (mrows, mf) = moe.map_or((n, f), |m| (n * w(m.top_k), w(m.expert_size)));
        let (e, fs) = moe.map_or((0, 0), |m| (w(m.n_experts), w(m.shared_expert_size.unwrap_or(0))));
        let yx = if moe.is_some() { mrows * c } else { 0 };
        let sy = if fs > 0 { n * c } else { 0 };
        let mut large = vec![nl * c, n * qkvw, n * qd, nl * c, nl * c, mrows * 2 * mf, mrows * mf, nl * c];
        large.extend(xa);
        large.extend(dz);
        // Per-head q/k norms: their inputs kept, one 1/rms per (row, head).
        let qk_heads = if cfg.qk_norm { w(cfg.n_head + cfg.n_kv_head) } else { 0 };
        large.push(n * qk_heads * w(cfg.head_dim));
        let post = if cfg.gemma.is_some() { nl * c } else { 0 };
        large.extend([post, post]);
        large.extend([yx, n * 2 * fs, n * fs, sy]);
        // Working buffer: the q/k norms' (gathered heads) and, when the
        // heads are wider than the residual (H·d > C), the heads' output
        // and its gradient.
        let wide = (qk_heads * w(cfg.head_dim)).max(if qd > c { qd } else { 0 });
        let mut kinds = PRE_NORM_KINDS.to_vec(); // LoRA's and DoRA's tensors (after the eight) are kept
        kinds.resize(large.len(), Inner::Kept);
        let low = precision.is_low();
        let stack = StackSizes {
            precision,
            checkpointing,
            n_slots: if train { part.n_blocks } else { 1 },
            large,
            kinds,
            redo_scratch: nl.max(lse),
            output: OUT,
            stats: vec![
                nl,
                nl,
                lse,
                norms,
                n * qk_heads,
                post / c.max(1),
                post / c.max(1),
                n * e,
                if moe.is_some() { n } else { 0 },
                if fs > 0 { n } else { 0 },
            ],
            x: nl * c,
            bufs: vec![
                nl * c,
                n * c,
                n * qkvw,
                (mrows * 2 * mf).max(n * 2 * fs),
                (mrows * mf).max(n * fs),
                n * r,
                n * qkvw,
                n * max_dz,
                n * max_in,
                n * wide,
                post,
                // A mixture's dispatched rows (twice) and the router's gradients.
                yx,
                yx,
                n * (e + moe.map_or(0, |m| w(m.top_k))),
            ],
            staging: if low {
                vec![(n * c.max(qkvw).max(2 * f)).max(mrows * (2 * mf).max(c)).max(n * 2 * fs), n * qd, n * r]
            } else {
                vec![0; 3]
            },
            extra: Vec::new(),
            // Sequence parallelism: a column input gathered, a row output
            // before its reduce-scatter (the embedding's rows in the first).
            scratch: vec![sp(n * c), sp(n * c)],
        };
        let rope = Rope::len_for(t, cfg.head_dim) as u128;
        // The final norm's output (gathered to every row: the head's input).
        let head =
            if part.last { [rope, n * c, nl, nn::head::loss_chunk_rows(n, v) * v, n] } else { [rope, 0, 0, 0, 0] };
        ActSizes { stack, head, in_flight: if train { part.in_flight } else { 1 } }
    }

    /// The same with rotary tables for `positions` positions (context
    /// parallelism: every position of the whole sequences).
    pub fn with_rope(mut self, positions: usize, head_dim: usize) -> Self {
        self.head[0] = Rope::len_for(positions, head_dim) as u128;
        self
    }

    /// Bytes of every buffer.
    pub fn bytes(&self) -> u128 {
        let [a, b, c, logits, losses] = self.head;
        let shared = self.stack.scratch_bytes() + 4 * (logits + losses);
        self.in_flight.max(1) as u128 * (self.stack.bytes() + 4 * (a + b + c)) + shared
    }
}

/// One decoder layer: the configuration, its parameter ranges (relative
/// to the layer's segment), the rotary tables (of the rows' positions),
/// the call's shapes, its attention (causal over the call's rows, or over
/// a key/value cache when generating), the micro-batch's positions and
/// the keys each query sees (document starts of packed rows, the sliding
/// window); with a packed frozen base, the base and
/// the layer the stack is in.
pub(crate) struct Layer<'a> {
    pub cfg: &'a LlamaConfig,
    pub r: &'a LayerParams,
    pub rope: &'a Rope,
    pub d: Dims,
    pub attn: Attention<'a>,
    pub pos: Positions<'a>,
    pub visible: Visible<'a>,
    pub base: Option<&'a FrozenBase>,
    /// The layer being run (set by [`Block::enter`]).
    pub at: Cell<usize>,
    /// LoRA dropout's masks of this micro-batch (training passes only).
    pub drop: Option<&'a Dropout>,
    /// A mixture's routing state of this pass.
    pub moe: Option<&'a Mutex<MoeState>>,
    /// Whether this walk's forwards count their routing (not a backward's recomputations).
    pub counting: bool,
}

/// What the post norms' backward reads and writes besides its buffers.
struct Back<'s, 'g> {
    grads: &'s mut SegmentGrads<'g>,
    saved: SavedView<'s>,
}

impl Layer<'_> {
    /// The mixture's parameter ranges.
    fn moe_params(&self) -> &crate::layout::MoeParams {
        self.r.moe.as_ref().unwrap_or_else(|| unreachable!("a mixture without its parameters"))
    }

    /// What this layer's queries see: the micro-batch's documents, the
    /// layer's window and the family's scores.
    fn visible_here(&self) -> Visible<'_> {
        self.visible.window(self.cfg.window_of(self.at.get()))
    }

    /// Gemma's post norm `k` (0: the attention's, 1: the MLP's) of the
    /// branch output `z`, kept in `kept` with its 1/rms in `rstd`: `z`
    /// becomes `res + norm(z)` (`out` is scratch).
    fn post_norm(
        &self,
        p: &[f32],
        k: usize,
        (kept, rstd): (&mut SavedTensor, &mut [f32]),
        z: &mut [f32],
        out: &mut [f32],
        res: &[f32],
    ) {
        let Some(norms) = &self.r.post_norms else { unreachable!("post norms without their gains") };
        kept.keep_copy(z, self.d.prec);
        rmsnorm_forward(out, rstd, z, &self.cfg.gains(&p[norms[k].clone()]), self.d.c, self.d.eps);
        add_into(out, res);
        z.copy_from_slice(out);
    }

    /// Backward of post norm `k` from the residual's gradient `dres` into
    /// `dz` (overwritten), its gains' gradient added.
    fn post_norm_backward(
        &self,
        p: &[f32],
        k: usize,
        dres: &[f32],
        dz: &mut [f32],
        (back, rstd): (&mut Back<'_, '_>, &[f32]),
    ) {
        let Some(norms) = &self.r.post_norms else { unreachable!("post norms without their gains") };
        dz.fill(0.0);
        let dw = param_grad(back.grads.tensor(norms[k].clone()));
        let saved = NormSaved { inp: back.saved.get([PA, PF][k]), mean: &[], rstd };
        rmsnorm_backward(dz, dw, dres, saved, &self.cfg.gains(&p[norms[k].clone()]));
    }

    /// The gradient of the branch that ends in o (`k` = 0) or down (1)
    /// from the residual's `dres`: `dres` itself, or with Gemma's post
    /// norms the norm's input gradient (into `dz`).
    fn branch_grad<'b>(
        &self,
        p: &[f32],
        k: usize,
        (dres, dz): (&'b [f32], &'b mut [f32]),
        (back, rstd): (&mut Back<'_, '_>, &[f32]),
    ) -> Grad<'b> {
        if self.r.post_norms.is_none() {
            return Grad::Shared(dres);
        }
        self.post_norm_backward(p, k, dres, dz, (back, rstd));
        Grad::Own(dz)
    }

    /// The per-head norms of the query heads and of the key heads in a
    /// row of q|k|v.
    fn head_norms(&self) -> [HeadNorm; 2] {
        let g = &self.d.gqa;
        let (d, rs) = (g.head_dim, g.qkv_width());
        [HeadNorm { col0: 0, heads: g.n_head, d, rs }, HeadNorm { col0: g.q_dim(), heads: g.n_kv_head, d, rs }]
    }

    /// What the layer's projections share in this call.
    fn site(&self) -> Site<'_> {
        let d = &self.d;
        Site {
            n: d.n,
            seq: d.seq,
            ops: d.ops,
            prec: d.prec,
            lora: &self.r.lora,
            r: d.r,
            scale: d.lora_scale,
            drop: self.drop.map(|drop| (drop, self.at.get())),
            saved: (XA, DZ, LORA),
        }
    }

    /// The seven modules as column blocks of their projections (indexed by
    /// [`Proj`]); with fused modules (Phi-3's) q's adapter spans q|k|v and
    /// gate's gate|up.
    fn parts(&self) -> [Module; 7] {
        let (d, r, fused) = (&self.d, self.r, self.cfg.fused_modules);
        let (qd, kvd) = (d.gqa.q_dim(), self.cfg.kv_dim());
        let col0 = [0, qd, qd + kvd, 0, 0, d.f, 0];
        let oc = [qd, kvd, kvd, d.c, d.f, d.f, d.c];
        Proj::ALL.map(|pr| {
            let i = pr as usize;
            let bias = r.qkv_bias.as_ref().and_then(|b| b.get(i)).cloned();
            let lora_oc = pr.adapted(fused).iter().map(|&p| oc[p as usize]).sum();
            Module { idx: i, col0: col0[i], oc: oc[i], lora_oc, w: r.w(pr), bias }
        })
    }

    /// The layer's projections over `parts`: q|k|v and gate|up
    /// column-parallel, o and down row-parallel; their weights the
    /// segment's f32 values or the packed frozen base.
    fn projections<'s>(&'s self, parts: &'s [Module; 7]) -> [Projection<'s>; 4] {
        let d = &self.d;
        let base = |g: Group| match self.base {
            Some(b) => Base::Frozen(b.layer(self.at.get()).group(g)),
            None => Base::Linear,
        };
        let proj = |role, ic, g, parts| Projection { role, ic, base: base(g), parts };
        [
            proj(Role::Column, d.c, Group::Qkv, &parts[0..3]),
            proj(Role::Row, d.gqa.q_dim(), Group::O, &parts[3..4]),
            proj(Role::Column, d.c, Group::GateUp, &parts[4..6]),
            proj(Role::Row, d.f, Group::Down, &parts[6..7]),
        ]
    }
}

impl Block for Layer<'_> {
    /// Segment `seg` holds layer `seg - 1` (segment 0 is the embedding).
    fn enter(&self, seg: usize) {
        self.at.set(seg.saturating_sub(1));
    }

    /// Each tensor is produced in f32 in a working buffer and kept in `sv`
    /// at once; what follows reads the kept tensor.
    fn forward(
        &self,
        p: &[f32],
        tp: &mut TensorGroup<'_>,
        x: &mut [f32],
        sv: &mut Saved,
        bufs: &mut [Vec<f32>],
        _: &mut [Vec<f32>],
    ) -> Result<(), EngineError> {
        let (cfg, r, d) = (self.cfg, self.r, &self.d);
        let (n, nl, c, f, prec) = (d.n, d.local(), d.c, d.f, d.prec);
        let (qd, qkvw) = (d.gqa.q_dim(), d.gqa.qkv_width());
        let [x2, buf_c, qkv, gu, m, dxa, heads, zb, xd, wide, pn, ma, mb, _, gx, gd] = bufs else {
            unreachable!("Llama has fourteen working buffers and two of scratch")
        };
        let Saved { large, stats } = sv;
        let [rstd1, rstd2, lse, norms, rstd_qk, rstd_pa, rstd_pf, probs, lse_r, sgate] = &mut stats[..] else {
            unreachable!("row statistics, log-sum-exps, norms, head, post-norm and router statistics")
        };
        let (large, adapted) = large.split_at_mut(XA);
        let (adapted, qkn) = adapted.split_at_mut(QKN - XA);
        let (qkn, post) = qkn.split_at_mut(PA - QKN);
        let [pa, pf, yx, sgu, sm, sy] = post else { unreachable!("the post norms' inputs and the mixture's") };
        let post = r.post_norms.is_some();
        let (site, parts) = (self.site(), self.parts());
        let [qkv_p, o_p, gu_p, down_p] = self.projections(&parts);
        for pj in [&qkv_p, &o_p, &gu_p, &down_p] {
            pj.dora_norms(&site, p, norms);
        }
        let norms = &*norms;
        let mut work = Work::new(dxa, zb, xd, (gx, gd));
        // Attention: h1 = norm(x); q|k|v = h1·Wqkvᵀ (+ bias) (+ adapters); rotate q, k.
        // The norms and residual additions run on this rank's rows (all of
        // them unless sequence-parallel); the projections between see every row.
        rmsnorm_forward(&mut buf_c[..nl * c], rstd1, x, &self.cfg.gains(&p[r.attn_norm.clone()]), c, d.eps);
        large[H1].keep_prefix(buf_c, nl * c, prec);
        let h1 = large[H1].cur(&buf_c[..nl * c]);
        // (n, C) @ (C, (H + 2·KV)·d) -> (n, (H + 2·KV)·d)
        qkv_p.forward(&site, p, (qkv, h1, None), adapted, &mut work, norms, tp)?;
        if let Some(gains) = &r.qk_norm {
            // Each query and key head normalised over its width, its input kept.
            let norms = self.head_norms();
            let [lq, lk] = norms.map(|h| h.len(n));
            norms[0].gather(&mut wide[..lq], qkv);
            norms[1].gather(&mut wide[lq..lq + lk], qkv);
            qkn[0].keep_prefix(wide, lq + lk, prec);
            let kept = qkn[0].cur(&wide[..lq + lk]);
            let (rq, rk) = rstd_qk.split_at_mut(n * norms[0].heads);
            norms[0].forward(qkv, heads, rq, &kept[..lq], &p[gains[0].clone()], d.eps);
            norms[1].forward(qkv, heads, rk, &kept[lq..], &p[gains[1].clone()], d.eps);
        }
        rope_apply(qkv, self.rope, qkvw, cfg.n_head + cfg.n_kv_head, false, self.pos);
        large[QKV].keep(qkv, prec);
        // The heads' output is n × H·d: all of buf_c (n × C) unless the heads
        // are split, or in the q|k|v-wide buffer when H·d > C.
        let yb = if qd <= c { &mut *buf_c } else { &mut *heads };
        match self.attn {
            Attention::Causal => {
                let shape = (d.gqa, self.visible_here());
                nn::context::attention_forward(&mut yb[..n * qd], lse, large[QKV].cur(qkv), shape, d.cx, tp)?
            }
            Attention::Cached(kv) => kv.attend(&mut yb[..n * qd], large[QKV].cur(qkv), d.gqa),
        }
        large[Y].keep_prefix(yb, n * qd, prec);
        // x2 = x + y·Woᵀ (+ adapters): (n, H·d) @ (H·d, C) -> (n, C); with
        // post norms the branch's output z is normed first: x2 = x + norm(z).
        let y = large[Y].cur(&yb[..n * qd]);
        o_p.forward(&site, p, (x2, y, (!post).then_some(&*x)), adapted, &mut work, norms, tp)?;
        if post {
            self.post_norm(p, 0, (pa, rstd_pa), x2, pn, x);
        }
        large[X2].keep(x2, prec);
        // MLP: h2 = norm(x2); g|u = h2·Wguᵀ (+ adapters); m = silu(g)·u; out = x2 + m·Wdᵀ (+ adapters).
        let g2 = self.cfg.gains(&p[r.mlp_norm.clone()]);
        rmsnorm_forward(&mut buf_c[..nl * c], rstd2, large[X2].cur(x2), &g2, c, d.eps);
        large[H2].keep_prefix(buf_c, nl * c, prec);
        if r.moe.is_some() {
            let (lo, hi) = large.split_at_mut(GU);
            let [gu_t, m_t, out_t] = hi else { unreachable!("gate|up, m and the output") };
            let (h2, res) = (lo[H2].cur(&buf_c[..nl * c]), lo[X2].cur(x2));
            let kept = [gu_t, m_t, yx, sgu, sm, sy];
            self.moe_forward(p, (h2, res, x), kept, (probs, lse_r, sgate), [gu, m, ma, mb]);
            out_t.keep_copy(x, prec);
            return Ok(());
        }
        let h2 = large[H2].cur(&buf_c[..nl * c]);
        // (n, C) @ (C, 2F) -> (n, 2F)
        gu_p.forward(&site, p, (gu, h2, None), adapted, &mut work, norms, tp)?;
        large[GU].keep(gu, prec);
        cfg.glu().forward(m, large[GU].cur(gu), f);
        large[M].keep(m, prec);
        // (n, F) @ (F, C) -> (n, C), joining the residual (with post norms, normed first)
        let (mm, res) = (large[M].cur(m), large[X2].cur(x2));
        down_p.forward(&site, p, (x, mm, (!post).then_some(res)), adapted, &mut work, norms, tp)?;
        if post {
            self.post_norm(p, 1, (pf, rstd_pf), x, pn, res);
        }
        // The output stays in `x` as the next layer's input: kept by copy.
        large[OUT].keep_copy(x, prec);
        Ok(())
    }

    /// RMSNorm (its 1/rms into the scratch), the attention (its
    /// log-sum-exps into the scratch) or SwiGLU, run again on the kept input.
    fn redo(&self, p: &[f32], k: usize, saved: &mut SavedView<'_>, out: &mut [f32], scratch: &mut [f32]) {
        let (r, d) = (self.r, &self.d);
        let rstd = &mut scratch[..d.local()];
        match k {
            H1 => rmsnorm_forward(out, rstd, saved.input(), &self.cfg.gains(&p[r.attn_norm.clone()]), d.c, d.eps),
            H2 => rmsnorm_forward(out, rstd, saved.get(X2), &self.cfg.gains(&p[r.mlp_norm.clone()]), d.c, d.eps),
            Y => {
                let lse = &mut scratch[..d.gqa.b * d.gqa.n_head * d.gqa.t];
                // Refused at assembly under context parallelism (no group here).
                assert!(!d.cx.is_split(), "attention recomputed without its context group");
                flash_attention_forward(out, lse, saved.get(QKV), d.gqa, self.visible_here());
            }
            M => self.cfg.glu().forward(out, saved.get(GU), d.moe.map_or(d.f, |s| s.f)),
            _ => unreachable!("Llama keeps saved tensor {k}"),
        }
    }

    fn backward(
        &self,
        p: &[f32],
        tp: &mut TensorGroup<'_>,
        grads: &mut SegmentGrads<'_>,
        saved: SavedView<'_>,
        bufs: &mut [Vec<f32>],
    ) -> Result<(), EngineError> {
        let (cfg, r, d) = (self.cfg, self.r, &self.d);
        let (c, f, nl) = (d.c, d.f, d.local());
        let (qd, qkvw) = (d.gqa.q_dim(), d.gqa.qkv_width());
        let [dres, dc, dqkv, dgu, dm, dxa, heads, zb, xd, wide, dz, ma, mb, mr, gx, gd] = bufs else {
            unreachable!("Llama has fourteen working buffers and two of scratch")
        };
        let sv = saved.sv;
        let [rstd1, rstd2, lse, norms, rstd_qk, rstd_pa, rstd_pf, ..] = &sv.stats[..] else {
            unreachable!("row statistics, log-sum-exps, norms, head and post-norm statistics")
        };
        let (site, parts) = (self.site(), self.parts());
        let [qkv_p, o_p, gu_p, down_p] = self.projections(&parts);
        let mut back = Back { grads, saved };
        let mut work = Work::new(dxa, zb, xd, (gx, gd));
        // down_proj: d(n, F) = d(n, C) @ (C, F); SwiGLU; gate|up: d(n, C) = d(n, 2F) @ (2F, C).
        // With post norms the branch's gradient is the norm's input gradient.
        if r.moe.is_some() {
            self.moe_backward(p, dres, &mut dc[..nl * c], &mut back, [dgu, dm, ma, mb, mr])?;
        } else {
            let g = self.branch_grad(p, 1, (dres, dz), (&mut back, rstd_pf));
            let b = (&mut *back.grads, &mut back.saved);
            down_p.backward(&site, p, (dm, g, (M, ROWS)), b, &mut work, norms, tp)?;
            cfg.glu().backward(dgu, dm, back.saved.get(GU), f);
            let b = (&mut *back.grads, &mut back.saved);
            gu_p.backward(&site, p, (&mut dc[..nl * c], Grad::Own(dgu), (H2, ROWS)), b, &mut work, norms, tp)?;
        }
        let (w2, g2) = (self.cfg.gains(&p[r.mlp_norm.clone()]), param_grad(back.grads.tensor(r.mlp_norm.clone())));
        let x2 = NormSaved { inp: back.saved.get(X2), mean: &[], rstd: rstd2 };
        rmsnorm_backward(dres, g2, &dc[..nl * c], x2, &w2);
        // o_proj: d(n, H·d) = d(n, C) @ (C, H·d); attention; rotation; q|k|v: d(n, C) = d(n, qkv) @ (qkv, C).
        let dy = if qd <= c { &mut dc[..d.n * qd] } else { &mut wide[..d.n * qd] };
        let g = self.branch_grad(p, 0, (dres, dz), (&mut back, rstd_pa));
        let b = (&mut *back.grads, &mut back.saved);
        o_p.backward(&site, p, (dy, g, (Y, ROWS)), b, &mut work, norms, tp)?;
        let (qkv, y) = back.saved.pair((QKV, ROWS), (Y, HEADS));
        nn::context::attention_backward(dqkv, heads, dy, (qkv, y, lse), (d.gqa, self.visible_here()), d.cx, tp)?;
        rope_apply(dqkv, self.rope, qkvw, cfg.n_head + cfg.n_kv_head, true, self.pos);
        if let Some(gains) = &r.qk_norm {
            // Through each head's norm, from the kept input (the gains'
            // gradients: under tensor parallelism a part, summed at the boundary).
            let norms = self.head_norms();
            let lq = norms[0].len(d.n);
            let kept = back.saved.get(QKN);
            let rstd = rstd_qk.split_at(d.n * norms[0].heads);
            for (i, (inp, rstd)) in [(&kept[..lq], rstd.0), (&kept[lq..], rstd.1)].into_iter().enumerate() {
                let dw = param_grad(back.grads.tensor(gains[i].clone()));
                let saved = NormSaved { inp, mean: &[], rstd };
                norms[i].backward(dqkv, (&mut heads[..], &mut wide[..]), saved, &p[gains[i].clone()], dw);
            }
        }
        let b = (&mut *back.grads, &mut back.saved);
        qkv_p.backward(&site, p, (&mut dc[..nl * c], Grad::Own(dqkv), (H1, ROWS)), b, &mut work, norms, tp)?;
        let (w1, g1) = (self.cfg.gains(&p[r.attn_norm.clone()]), param_grad(back.grads.tensor(r.attn_norm.clone())));
        let h = NormSaved { inp: back.saved.input(), mean: &[], rstd: rstd1 };
        rmsnorm_backward(dres, g1, &dc[..nl * c], h, &w1);
        Ok(())
    }
}
