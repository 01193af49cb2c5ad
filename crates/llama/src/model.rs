//! The Llama model: parameter layout with Hugging Face names (and LoRA
//! adapters inside their layer), activations, and one micro-step (forward,
//! fused loss, backward) over flat buffers.
//!
//! Each layer's forward ([`block_forward`]) and backward
//! ([`block_backward`]) read only that layer's parameters and activations,
//! so a layer's parameters can be gathered just before it runs (ZeRO-3) or
//! the layer recomputed later (activation checkpointing).

use crate::config::LlamaConfig;
use crate::error::LlamaError;
use crate::kernels::{self, columns, GqaShape, Rope};
use crate::lora::LoraConfig;
use engine::rng::SplitMix64;
use engine::{
    Checkpointing, FullStore, GradOut, MicroStepStats, Model, ParamLayout, ParamStore, Precision, SavedTensor,
    SegmentGrads, SegmentView,
};
use gpt::kernels::{gemm_into, parallelism, Operands, Strided};
use std::ops::Range;

pub use engine::batch::{TokenBatch, IGNORE_INDEX};

/// The seven linear projections of a decoder layer, in layout order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Proj {
    /// `self_attn.q_proj`.
    Q,
    /// `self_attn.k_proj`.
    K,
    /// `self_attn.v_proj`.
    V,
    /// `self_attn.o_proj`.
    O,
    /// `mlp.gate_proj`.
    Gate,
    /// `mlp.up_proj`.
    Up,
    /// `mlp.down_proj`.
    Down,
}

impl Proj {
    /// All seven, in layout order.
    pub const ALL: [Proj; 7] = [Proj::Q, Proj::K, Proj::V, Proj::O, Proj::Gate, Proj::Up, Proj::Down];

    /// The module's name (PEFT's `target_modules` spelling), e.g. `q_proj`.
    pub fn name(self) -> &'static str {
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"][self as usize]
    }

    /// Path inside a layer, e.g. `self_attn.q_proj`.
    pub fn path(self) -> String {
        let parent = if (self as usize) < 4 { "self_attn" } else { "mlp" };
        format!("{parent}.{}", self.name())
    }

    /// `[out, in]` of the weight (`nn.Linear` layout).
    pub fn shape(self, cfg: &LlamaConfig) -> [usize; 2] {
        let (c, f, qd, kvd) = (cfg.hidden_size, cfg.intermediate_size, cfg.q_dim(), cfg.kv_dim());
        match self {
            Proj::Q => [qd, c],
            Proj::K | Proj::V => [kvd, c],
            Proj::O => [c, qd],
            Proj::Gate | Proj::Up => [f, c],
            Proj::Down => [c, f],
        }
    }

    /// The projection called `name` (`q_proj`, ...).
    pub fn from_name(name: &str) -> Option<Proj> {
        Proj::ALL.into_iter().find(|p| p.name() == name)
    }
}

/// Element ranges of one LoRA adapter: `lora_A` `[r, in]`, `lora_B` `[out, r]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoraRanges {
    /// `lora_A.weight`.
    pub a: Range<usize>,
    /// `lora_B.weight`.
    pub b: Range<usize>,
}

/// Element ranges of one decoder layer's parameters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerParams {
    /// `input_layernorm.weight` `[C]`.
    pub attn_norm: Range<usize>,
    /// The projections' weights, indexed by [`Proj`] (q, k, v back to back,
    /// and gate, up: each group is one `[Σ out, in]` matrix).
    pub proj: [Range<usize>; 7],
    /// `post_attention_layernorm.weight` `[C]`.
    pub mlp_norm: Range<usize>,
    /// LoRA adapters of the targeted projections, after the base tensors.
    pub lora: [Option<LoraRanges>; 7],
}

impl LayerParams {
    /// The weight of projection `p`.
    pub fn w(&self, p: Proj) -> Range<usize> {
        self.proj[p as usize].clone()
    }

    /// q, k and v weights together: one `[(H + 2·KV)·d, C]` matrix.
    fn qkv(&self) -> Range<usize> {
        self.proj[0].start..self.proj[2].end
    }

    /// gate and up weights together: one `[2F, C]` matrix.
    fn gate_up(&self) -> Range<usize> {
        self.proj[4].start..self.proj[5].end
    }

    /// The contiguous range the whole layer occupies.
    pub fn span(&self) -> Range<usize> {
        let end = self.lora.iter().flatten().map(|l| l.b.end).max().unwrap_or(self.proj[6].end);
        self.attn_norm.start..end
    }
}

/// LoRA's shape inside the layout: rank and which projections carry adapters.
#[derive(Debug, Clone, Copy)]
struct Adapters {
    r: usize,
    targets: [bool; 7],
}

/// Appends a tensor `(name suffix, shape, decay)` and returns its range.
type Push<'a> = dyn FnMut(&str, &[usize], bool) -> Range<usize> + 'a;

/// Pushes one layer's tensors in layout order.
fn push_layer(cfg: &LlamaConfig, adapters: Option<Adapters>, push: &mut Push<'_>) -> LayerParams {
    let c = cfg.hidden_size;
    let attn_norm = push("input_layernorm.weight", &[c], false);
    let mut proj_w = |p: Proj| push(&format!("{}.weight", p.path()), &p.shape(cfg), true);
    let attn = [Proj::Q, Proj::K, Proj::V, Proj::O].map(&mut proj_w);
    let mlp_norm = push("post_attention_layernorm.weight", &[c], false);
    let mlp = [Proj::Gate, Proj::Up, Proj::Down].map(|p| push(&format!("{}.weight", p.path()), &p.shape(cfg), true));
    let [q, k, v, o] = attn;
    let [gate, up, down] = mlp;
    let lora = Proj::ALL.map(|p| {
        let a = adapters.filter(|a| a.targets[p as usize])?;
        let [out, inp] = p.shape(cfg);
        Some(LoraRanges {
            a: push(&format!("{}.lora_A.weight", p.path()), &[a.r, inp], true),
            b: push(&format!("{}.lora_B.weight", p.path()), &[out, a.r], true),
        })
    });
    LayerParams { attn_norm, proj: [q, k, v, o, gate, up, down], mlp_norm, lora }
}

/// Element ranges of all parameters.
#[derive(Debug, Clone)]
struct ParamRanges {
    embed: Range<usize>,
    layers: Vec<LayerParams>,
    /// One layer's ranges relative to its first parameter (every layer alike).
    layer_rel: LayerParams,
    norm: Range<usize>,
    /// `lm_head.weight`, when untied.
    head: Option<Range<usize>>,
}

fn build_layout(cfg: &LlamaConfig, adapters: Option<Adapters>) -> (ParamLayout, ParamRanges) {
    let (v, c) = (cfg.vocab_size, cfg.hidden_size);
    let mut l = ParamLayout::new();
    let embed = l.push("model.embed_tokens.weight", &[v, c], true);
    let layers = (0..cfg.n_layer)
        .map(|i| {
            push_layer(cfg, adapters, &mut |s, shape, decay| l.push(format!("model.layers.{i}.{s}"), shape, decay))
        })
        .collect();
    let norm = l.push("model.norm.weight", &[c], false);
    let head = (!cfg.tie_word_embeddings).then(|| l.push("lm_head.weight", &[v, c], true));
    let mut at = 0;
    let layer_rel = push_layer(cfg, adapters, &mut |_, shape, _| {
        let n: usize = shape.iter().product();
        at += n;
        at - n..at
    });
    (l, ParamRanges { embed, layers, layer_rel, norm, head })
}

/// Indices of a layer's large saved tensors.
const H1: usize = 0; // input_layernorm's output
const QKV: usize = 1; // q | k | v, q and k rotated
const ATT: usize = 2; // attention probabilities
const Y: usize = 3; // attention heads' output (o_proj's input)
const X2: usize = 4; // residual after attention
const H2: usize = 5; // post_attention_layernorm's output
const GU: usize = 6; // gate | up
const M: usize = 7; // silu(gate) · up (down_proj's input)
const OUT: usize = 8; // the layer's output

/// What one layer's forward keeps for its backward.
#[derive(Debug, Default)]
struct SavedLayer {
    /// The nine large tensors above, in the storage precision.
    large: [SavedTensor; 9],
    /// The two RMSNorms' 1/rms (always f32).
    rstd: [Vec<f32>; 2],
    /// Per projection: `x · Aᵀ` of its LoRA adapter (`[n, r]`; empty without one).
    xa: [SavedTensor; 7],
}

impl SavedLayer {
    fn new(precision: Precision, d: &Dims, adapters: Option<Adapters>) -> Self {
        let (n, c, f) = (d.n, d.c, d.f);
        let sizes = [n * c, n * d.gqa.qkv_width(), d.att_len(), n * c, n * c, n * c, n * 2 * f, n * f, n * c];
        let xa = Proj::ALL.map(|p| match adapters {
            Some(a) if a.targets[p as usize] => SavedTensor::new(precision, n * a.r),
            _ => SavedTensor::default(),
        });
        SavedLayer { large: sizes.map(|n| SavedTensor::new(precision, n)), rstd: [vec![0.0; n], vec![0.0; n]], xa }
    }

    /// What a recomputed layer keeps: its output alone (the next layer's input).
    fn output_only(precision: Precision, d: &Dims) -> Self {
        let mut sv = SavedLayer { large: Default::default(), rstd: Default::default(), xa: Default::default() };
        sv.large[OUT] = SavedTensor::new(precision, d.n * d.c);
        sv
    }

    fn bytes(&self) -> usize {
        self.large.iter().chain(&self.xa).map(SavedTensor::bytes).sum::<usize>()
            + 4 * self.rstd.iter().map(Vec::len).sum::<usize>()
    }
}

/// Shapes of one layer call.
#[derive(Debug, Clone, Copy)]
struct Dims {
    /// Rows B·T.
    n: usize,
    c: usize,
    f: usize,
    gqa: GqaShape,
    eps: f32,
    /// LoRA rank (0 without adapters) and scale α/r.
    r: usize,
    lora_scale: f32,
    /// GEMM operands of the precision ([`gpt::kernels::operands`]).
    ops: Operands,
}

impl Dims {
    fn att_len(&self) -> usize {
        let s = self.gqa;
        s.b * s.n_head * s.t * s.t
    }
}

/// The working buffers: the forward's (each tensor is produced here and
/// swapped into its [`SavedLayer`] slot) and, the same memory, the
/// backward's scratch.
#[derive(Debug, Default)]
struct Bufs {
    /// `[n, C]`: residual gradient (forward: the residual after attention).
    dres: Vec<f32>,
    /// `[n, C]`: gradient of a norm's output or of the heads' output.
    dc: Vec<f32>,
    /// `[n, qkv_width]`.
    dqkv: Vec<f32>,
    /// `[B, H, T, T]`.
    datt: Vec<f32>,
    /// `[n, 2F]`.
    dgu: Vec<f32>,
    /// `[n, F]`.
    dm: Vec<f32>,
    /// `[n, r]`: LoRA's `x·Aᵀ` and its gradient.
    dxa: Vec<f32>,
    /// `[n, qkv_width]`: head-major attention scratch.
    heads: Vec<f32>,
}

impl Bufs {
    fn new(d: &Dims) -> Self {
        let (n, c, f, qkvw) = (d.n, d.c, d.f, d.gqa.qkv_width());
        let z = |n: usize| vec![0.0f32; n];
        Bufs {
            dres: z(n * c),
            dc: z(n * c),
            dqkv: z(n * qkvw),
            datt: z(d.att_len()),
            dgu: z(n * 2 * f),
            dm: z(n * f),
            dxa: z(n * d.r),
            heads: z(n * qkvw),
        }
    }

    fn len(&self) -> usize {
        [&self.dres, &self.dc, &self.dqkv, &self.datt, &self.dgu, &self.dm, &self.dxa, &self.heads]
            .iter()
            .map(|v| v.len())
            .sum()
    }
}

/// What a forward pass is for: what it keeps and which logits it computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pass {
    /// Keeps every layer's activations for the backward; logits of every position.
    Train,
    /// Forward only: every layer reuses one slot; logits of every position.
    Eval,
    /// Forward only: one slot; logits of each sequence's last position.
    NextToken,
}

/// Activations and scratch for one (B, T).
#[derive(Debug, Default)]
struct Acts {
    b: usize,
    t: usize,
    precision: Precision,
    rope: Rope,
    /// One slot per layer for training; forward-only passes use slot 0 only.
    saved: Vec<SavedLayer>,
    /// The embeddings' output (layer 0's input).
    saved_embed: SavedTensor,
    /// The residual stream entering the current layer; after the forward,
    /// the last layer's output (read by the final norm's backward).
    x: Vec<f32>,
    /// f32 staging for decoding 16-bit saved tensors in backward: one
    /// row-tensor (`u`), the attention probabilities (`v`), LoRA's `x·Aᵀ` (`w`).
    u: Vec<f32>,
    v: Vec<f32>,
    w: Vec<f32>,
    /// Final norm's output and 1/rms.
    hf: Vec<f32>,
    rstd_f: Vec<f32>,
    /// Sized by each forward: all positions, or one per sequence when generating.
    logits: Vec<f32>,
    losses: Vec<f32>,
    bufs: Bufs,
    /// Which layers a training pass recomputes.
    checkpointing: Checkpointing,
    /// With checkpointing: where a recomputed layer lives (and every layer
    /// of a forward-only pass).
    recompute: Option<Recompute>,
}

/// One layer's activations, recomputed just before its backward, with
/// working buffers of its own (the backward's are busy then).
#[derive(Debug)]
struct Recompute {
    sv: SavedLayer,
    bufs: Bufs,
    /// The layer's input (then its output).
    x: Vec<f32>,
}

impl Acts {
    fn new(
        cfg: &LlamaConfig,
        precision: Precision,
        d: &Dims,
        adapters: Option<Adapters>,
        n_slots: usize,
        checkpointing: Checkpointing,
    ) -> Self {
        let (b, t) = (d.gqa.b, d.gqa.t);
        let (n, c, f, qkvw) = (d.n, d.c, d.f, d.gqa.qkv_width());
        let z = |n: usize| vec![0.0f32; n];
        let low = precision.is_low();
        Self {
            b,
            t,
            precision,
            rope: Rope::new(t, cfg.head_dim, cfg.rope_theta),
            saved: (0..n_slots)
                .map(|i| {
                    if checkpointing.recomputes(i) {
                        SavedLayer::output_only(precision, d)
                    } else {
                        SavedLayer::new(precision, d, adapters)
                    }
                })
                .collect(),
            saved_embed: SavedTensor::new(precision, n * c),
            x: z(n * c),
            u: if low { z(n * c.max(qkvw).max(2 * f)) } else { Vec::new() },
            v: if low { z(d.att_len()) } else { Vec::new() },
            w: if low { z(n * d.r) } else { Vec::new() },
            hf: z(n * c),
            rstd_f: z(n),
            logits: Vec::new(),
            losses: z(n),
            bufs: Bufs::new(d),
            checkpointing,
            recompute: checkpointing.is_on().then(|| Recompute {
                sv: SavedLayer::new(precision, d, adapters),
                bufs: Bufs::new(d),
                x: z(n * c),
            }),
        }
    }

    fn saved_bytes(&self) -> usize {
        self.saved.iter().map(SavedLayer::bytes).sum::<usize>()
            + self.saved_embed.bytes()
            + self.recompute.as_ref().map_or(0, |r| r.sv.bytes())
    }

    /// Bytes held (activations and scratch), for memory accounting.
    fn bytes(&self) -> usize {
        let rest = [&self.rope.cos, &self.rope.sin, &self.x, &self.u, &self.v, &self.w, &self.hf, &self.rstd_f]
            .iter()
            .chain([&self.logits, &self.losses].iter())
            .map(|v| v.len())
            .sum::<usize>();
        let recompute = self.recompute.as_ref().map_or(0, |r| r.bufs.len() + r.x.len());
        self.saved_bytes() + 4 * (rest + self.bufs.len() + recompute)
    }
}

/// A parameter gradient handed to a kernel: the buffer and whether to add
/// into it (`false`: overwrite) — `None` for a frozen tensor.
fn kgrad<'a>(g: Option<GradOut<'a>>) -> kernels::ParamGrad<'a> {
    g.map(|g| (g.buf, g.accumulate))
}

/// LoRA's forward for projection `p` of a layer, if it has an adapter:
/// `xa = x·Aᵀ` (kept for backward), then `y[:, col0..] += s · xa·Bᵀ`.
#[allow(clippy::too_many_arguments)]
fn lora_forward(
    y: &mut [f32],
    col0: usize,
    y_rs: usize,
    x: &[f32],
    lr: &Option<LoraRanges>,
    p: &[f32],
    saved: &mut SavedTensor,
    buf: &mut Vec<f32>,
    [oc, ic]: [usize; 2],
    d: &Dims,
    prec: Precision,
) {
    let Some(lr) = lr else { return };
    kernels::linear_forward(buf, 0, d.r, false, x, &p[lr.a.clone()], d.n, ic, d.r, 1.0, d.ops);
    saved.keep(buf, prec);
    kernels::linear_forward(y, col0, y_rs, true, saved.cur(buf), &p[lr.b.clone()], d.n, d.r, oc, d.lora_scale, d.ops);
}

/// Forward of one decoder layer, for every storage precision: each tensor
/// is produced in f32 in a working buffer and kept in `sv` at once; what
/// follows reads the kept tensor. On entry `x` holds the layer's input, on
/// exit its output.
#[allow(clippy::too_many_arguments)]
fn block_forward(
    cfg: &LlamaConfig,
    r: &LayerParams,
    p: &[f32],
    x: &mut [f32],
    sv: &mut SavedLayer,
    bufs: &mut Bufs,
    rope: &Rope,
    d: &Dims,
    prec: Precision,
) {
    let (n, c, f) = (d.n, d.c, d.f);
    let (qd, qkvw) = (d.gqa.q_dim(), d.gqa.qkv_width());
    let kvd = cfg.kv_dim();
    let Bufs { dres: x2, dc: a, dqkv: qkv, datt: att, dgu: gu, dm: m, dxa, heads } = bufs;
    let SavedLayer { large, rstd: [rstd1, rstd2], xa } = sv;
    let shape = |pr: Proj| pr.shape(cfg);
    // Attention: h1 = norm(x); q|k|v = h1·Wqkvᵀ (+ LoRA); rotate q, k.
    kernels::rmsnorm_forward(a, rstd1, x, &p[r.attn_norm.clone()], c, d.eps);
    large[H1].keep(a, prec);
    let h1 = large[H1].cur(a);
    kernels::linear_forward(qkv, 0, qkvw, false, h1, &p[r.qkv()], n, c, qkvw, 1.0, d.ops);
    for (pr, col0) in [(Proj::Q, 0), (Proj::K, qd), (Proj::V, qd + kvd)] {
        let i = pr as usize;
        lora_forward(qkv, col0, qkvw, h1, &r.lora[i], p, &mut xa[i], dxa, shape(pr), d, prec);
    }
    kernels::rope_apply(qkv, rope, qkvw, cfg.n_head + cfg.n_kv_head, false);
    large[QKV].keep(qkv, prec);
    kernels::attention_forward(a, att, &mut heads[..n * qd], large[QKV].cur(qkv), d.gqa);
    large[ATT].keep(att, prec);
    large[Y].keep(a, prec);
    // x2 = x + y·Woᵀ (+ LoRA).
    let y = large[Y].cur(a);
    x2.copy_from_slice(x);
    kernels::linear_forward(x2, 0, c, true, y, &p[r.w(Proj::O)], n, qd, c, 1.0, d.ops);
    let i = Proj::O as usize;
    lora_forward(x2, 0, c, y, &r.lora[i], p, &mut xa[i], dxa, shape(Proj::O), d, prec);
    large[X2].keep(x2, prec);
    // MLP: h2 = norm(x2); g|u = h2·Wguᵀ (+ LoRA); m = silu(g)·u; out = x2 + m·Wdᵀ (+ LoRA).
    kernels::rmsnorm_forward(a, rstd2, large[X2].cur(x2), &p[r.mlp_norm.clone()], c, d.eps);
    large[H2].keep(a, prec);
    let h2 = large[H2].cur(a);
    kernels::linear_forward(gu, 0, 2 * f, false, h2, &p[r.gate_up()], n, c, 2 * f, 1.0, d.ops);
    for (pr, col0) in [(Proj::Gate, 0), (Proj::Up, f)] {
        let i = pr as usize;
        lora_forward(gu, col0, 2 * f, h2, &r.lora[i], p, &mut xa[i], dxa, shape(pr), d, prec);
    }
    large[GU].keep(gu, prec);
    kernels::swiglu_forward(m, large[GU].cur(gu), f);
    large[M].keep(m, prec);
    let mm = large[M].cur(m);
    x.copy_from_slice(large[X2].cur(x2));
    kernels::linear_forward(x, 0, c, true, mm, &p[r.w(Proj::Down)], n, f, c, 1.0, d.ops);
    let i = Proj::Down as usize;
    lora_forward(x, 0, c, mm, &r.lora[i], p, &mut xa[i], dxa, shape(Proj::Down), d, prec);
    // The output stays in `x` as the next layer's input: kept by copy.
    large[OUT].keep_copy(x, prec);
}

/// Where a layer's backward reads what its forward saved: each tensor as
/// f32, directly or decoded into staging just before use.
struct SavedView<'a> {
    sv: &'a SavedLayer,
    /// The layer's input.
    x: &'a SavedTensor,
    u: &'a mut [f32],
    v: &'a mut [f32],
    w: &'a mut [f32],
    prec: Precision,
}

impl SavedView<'_> {
    /// Saved tensor `k` as f32.
    fn get(&mut self, k: usize) -> &[f32] {
        self.sv.large[k].read(self.prec, self.u)
    }

    /// Saved tensor `k` (a projection's input) and projection `p`'s `x·Aᵀ`.
    fn with_xa(&mut self, k: usize, p: Proj) -> (&[f32], &[f32]) {
        (self.sv.large[k].read(self.prec, self.u), self.sv.xa[p as usize].read(self.prec, self.w))
    }

    /// q|k|v and the attention probabilities, together.
    fn qkv_att(&mut self) -> (&[f32], &[f32]) {
        (self.sv.large[QKV].read(self.prec, self.u), self.sv.large[ATT].read(self.prec, self.v))
    }

    /// The layer's input.
    fn input(&mut self) -> &[f32] {
        self.x.read(self.prec, self.u)
    }
}

/// Weight gradients of projection `p` (input `x`, output gradient the
/// column block `dy`), and its LoRA branch if any: `dB (+)= s·dyᵀ·xa`,
/// `dxa = s·dy·B`, `dA (+)= dxaᵀ·x`, and `dx += dxa·A` (the base's `dy·W`
/// is already in `dx`). Frozen tensors' gradients are skipped, the input
/// gradient never is.
#[allow(clippy::too_many_arguments)]
fn proj_backward(
    pr: Proj,
    dx: &mut [f32],
    dy: Strided<'_>,
    x_idx: usize,
    r: &LayerParams,
    p: &[f32],
    grads: &mut SegmentGrads<'_>,
    saved: &mut SavedView<'_>,
    dxa: &mut [f32],
    [oc, ic]: [usize; 2],
    d: &Dims,
) {
    let (x, xa) = saved.with_xa(x_idx, pr);
    kernels::linear_backward_weight(kgrad(grads.tensor(r.w(pr))), dy, x, d.n, ic, oc, 1.0, d.ops);
    let Some(lr) = &r.lora[pr as usize] else { return };
    let (ga, gb) = grads.pair(lr.a.clone(), lr.b.clone());
    kernels::linear_backward_weight(kgrad(gb), dy, xa, d.n, d.r, oc, d.lora_scale, d.ops);
    kernels::linear_backward_input(dxa, false, dy, &p[lr.b.clone()], d.n, d.r, oc, d.lora_scale, d.ops);
    kernels::linear_backward_weight(kgrad(ga), Strided::rows(dxa, d.r), x, d.n, ic, d.r, 1.0, d.ops);
    kernels::linear_backward_input(dx, true, Strided::rows(dxa, d.r), &p[lr.a.clone()], d.n, ic, d.r, 1.0, d.ops);
}

/// Backward of one layer: on entry `bufs.dres` holds the gradient of the
/// layer's output; on exit, of its input. Parameter gradients go where the
/// store says (`grads`).
#[allow(clippy::too_many_arguments)]
fn block_backward(
    cfg: &LlamaConfig,
    r: &LayerParams,
    p: &[f32],
    grads: &mut SegmentGrads<'_>,
    mut saved: SavedView<'_>,
    bufs: &mut Bufs,
    rope: &Rope,
    d: &Dims,
) {
    let (n, c, f) = (d.n, d.c, d.f);
    let (qd, qkvw) = (d.gqa.q_dim(), d.gqa.qkv_width());
    let kvd = cfg.kv_dim();
    let Bufs { dres, dc, dqkv, datt, dgu, dm, dxa, heads } = bufs;
    let sv = saved.sv;
    let [rstd1, rstd2] = &sv.rstd;
    let shape = |pr: Proj| pr.shape(cfg);
    // down_proj, SwiGLU, gate|up.
    kernels::linear_backward_input(dm, false, Strided::rows(dres, c), &p[r.w(Proj::Down)], n, f, c, 1.0, d.ops);
    let dy = Strided::rows(dres, c);
    proj_backward(Proj::Down, dm, dy, M, r, p, grads, &mut saved, dxa, shape(Proj::Down), d);
    kernels::swiglu_backward(dgu, dm, saved.get(GU), f);
    kernels::linear_backward_input(dc, false, Strided::rows(dgu, 2 * f), &p[r.gate_up()], n, c, 2 * f, 1.0, d.ops);
    for (pr, col0) in [(Proj::Gate, 0), (Proj::Up, f)] {
        proj_backward(pr, dc, columns(dgu, col0, 2 * f), H2, r, p, grads, &mut saved, dxa, shape(pr), d);
    }
    let w2 = &p[r.mlp_norm.clone()];
    kernels::rmsnorm_backward(dres, kgrad(grads.tensor(r.mlp_norm.clone())), dc, saved.get(X2), rstd2, w2, c);
    // o_proj, attention, rotation, q|k|v.
    kernels::linear_backward_input(dc, false, Strided::rows(dres, c), &p[r.w(Proj::O)], n, qd, c, 1.0, d.ops);
    let dy = Strided::rows(dres, c);
    proj_backward(Proj::O, dc, dy, Y, r, p, grads, &mut saved, dxa, shape(Proj::O), d);
    let (qkv, att) = saved.qkv_att();
    kernels::attention_backward(dqkv, datt, heads, dc, qkv, att, d.gqa);
    kernels::rope_apply(dqkv, rope, qkvw, cfg.n_head + cfg.n_kv_head, true);
    kernels::linear_backward_input(dc, false, Strided::rows(dqkv, qkvw), &p[r.qkv()], n, c, qkvw, 1.0, d.ops);
    for (pr, col0) in [(Proj::Q, 0), (Proj::K, qd), (Proj::V, qd + kvd)] {
        proj_backward(pr, dc, columns(dqkv, col0, qkvw), H1, r, p, grads, &mut saved, dxa, shape(pr), d);
    }
    let w1 = &p[r.attn_norm.clone()];
    kernels::rmsnorm_backward(dres, kgrad(grads.tensor(r.attn_norm.clone())), dc, saved.input(), rstd1, w1, c);
}

/// The Llama model with its activation buffers.
#[derive(Debug)]
pub struct Llama {
    cfg: LlamaConfig,
    lora: Option<LoraConfig>,
    adapters: Option<Adapters>,
    layout: ParamLayout,
    ranges: ParamRanges,
    precision: Precision,
    checkpointing: Checkpointing,
    acts: Acts,
}

impl Llama {
    /// A model of the given shape (parameters live outside, in a flat buffer).
    pub fn new(cfg: LlamaConfig) -> Result<Self, LlamaError> {
        Self::build(cfg, None, Precision::F32)
    }

    /// A model whose saved activations (and, under f16, activation gradients
    /// between layers) are stored in `precision`; kernels compute in f32.
    pub fn with_precision(cfg: LlamaConfig, precision: Precision) -> Result<Self, LlamaError> {
        Self::build(cfg, None, precision)
    }

    /// A model with LoRA adapters on `lora`'s target projections; its
    /// layout holds the base tensors and, inside each layer, the adapters.
    pub fn with_lora(cfg: LlamaConfig, lora: LoraConfig, precision: Precision) -> Result<Self, LlamaError> {
        Self::build(cfg, Some(lora), precision)
    }

    fn build(cfg: LlamaConfig, lora: Option<LoraConfig>, precision: Precision) -> Result<Self, LlamaError> {
        cfg.validate()?;
        let adapters = match &lora {
            Some(l) => {
                l.validate()?;
                let targets = l.targets()?;
                // The adapters' parameters and tensors count too.
                let on = Proj::ALL.into_iter().filter(|&p| targets[p as usize]);
                let per_layer: u128 = on.clone().map(|p| p.shape(&cfg).iter().map(|&d| d as u128).sum::<u128>()).sum();
                let n = cfg.param_count() + cfg.n_layer as u128 * l.r as u128 * per_layer;
                engine::check_shape_size(n, cfg.n_layer, 9 + 2 * on.count() as u128, 3)
                    .map_err(LlamaError::TooLarge)?;
                Some(Adapters { r: l.r, targets })
            }
            None => None,
        };
        let (layout, ranges) = build_layout(&cfg, adapters);
        let checkpointing = Checkpointing::None;
        Ok(Self { cfg, lora, adapters, layout, ranges, precision, checkpointing, acts: Acts::default() })
    }

    /// The model's shape.
    pub fn config(&self) -> &LlamaConfig {
        &self.cfg
    }

    /// The LoRA configuration, if the model has adapters.
    pub fn lora(&self) -> Option<&LoraConfig> {
        self.lora.as_ref()
    }

    /// The storage precision of activations.
    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// Parameter ranges of layer `idx`.
    pub fn layer_params(&self, idx: usize) -> &LayerParams {
        &self.ranges.layers[idx]
    }

    /// Bytes of activations and scratch currently allocated.
    pub fn activation_bytes(&self) -> usize {
        self.acts.bytes()
    }

    /// The [`Llama::activation_bytes`] a training micro-step on `b`
    /// sequences of `t` tokens allocates, computed from the shape alone (u128:
    /// planning shapes far beyond this machine never overflows).
    pub fn planned_activation_bytes(&self, b: usize, t: usize) -> u128 {
        self.planned_activation_bytes_as(b, t, self.precision, self.checkpointing)
    }

    /// [`Llama::planned_activation_bytes`] of this shape built with another
    /// storage precision and checkpointing (no model is built for it).
    pub fn planned_activation_bytes_as(&self, b: usize, t: usize, precision: Precision, ck: Checkpointing) -> u128 {
        let cfg = &self.cfg;
        let w = |x: usize| x as u128;
        let (n, c, f, v) = (w(b) * w(t), w(cfg.hidden_size), w(cfg.intermediate_size), w(cfg.vocab_size));
        let qkvw = w(cfg.n_head + 2 * cfg.n_kv_head) * w(cfg.head_dim);
        let att = w(b) * w(cfg.n_head) * w(t) * w(t);
        let (r, n_xa) = self.adapters.map_or((0, 0), |a| (w(a.r), a.targets.iter().filter(|&&x| x).count() as u128));
        let elem = precision.bytes() as u128;
        let low = precision.is_low();
        // Per layer (`SavedLayer`): x, qkv, att, and the rest of the row
        // tensors (5C + qkv + 3F per row), LoRA's x·Aᵀ per adapted
        // projection, two f32 1/rms per row.
        let layer = elem * (5 * n * c + n * qkvw + att + 3 * n * f + n_xa * n * r) + 4 * 2 * n;
        // A recomputed layer keeps its output alone; one shared slot (a
        // full layer, its own working buffers and input) recomputes.
        let n_recomputed = (0..cfg.n_layer).filter(|&i| ck.recomputes(i)).count() as u128;
        let bufs = 2 * n * c + 2 * n * qkvw + att + 3 * n * f + n * r;
        let slot = if ck.is_on() { layer + 4 * (bufs + n * c) } else { 0 };
        let saved = (w(cfg.n_layer) - n_recomputed) * layer + n_recomputed * elem * n * c + slot + elem * n * c;
        // f32: RoPE tables (t × head_dim), x, final norm output and 1/rms,
        // logits, losses; 16-bit staging; the working buffers (`Bufs`).
        let staging = if low { n * c.max(qkvw).max(2 * f) + att + n * r } else { 0 };
        let rest = w(t) * w(cfg.head_dim / 2) * 2 + n * c + n * c + n + n * v + n + staging;
        saved + 4 * (rest + bufs)
    }

    /// Bytes of the saved activations (every layer's slot and the embeddings' output).
    pub fn saved_activation_bytes(&self) -> usize {
        self.acts.saved_bytes()
    }

    /// Number of segments: the embedding, each layer, the final norm (+ head).
    pub fn n_segments(&self) -> usize {
        self.cfg.n_layer + 2
    }

    /// Hugging Face / PEFT initialisation: N(0, 0.02) for the embedding,
    /// projections and head, ones for the RMSNorm gains; LoRA A
    /// Kaiming-uniform as `nn.Linear`'s default (bound 1/√in), B zero.
    pub fn init_params(&self, seed: u64) -> Vec<f32> {
        (0..self.n_segments()).flat_map(|seg| self.init_segment(seed, seg)).collect()
    }

    /// The initial values of segment `seg` alone, from its own random
    /// streams (so a ZeRO-3 rank can initialise one segment at a time); the
    /// base tensors do not depend on whether adapters exist.
    pub fn init_segment(&self, seed: u64, seg: usize) -> Vec<f32> {
        let mut rng = SplitMix64::derive(seed, &[0x11a3a, seg as u64]);
        let mut normal = |n: usize| -> Vec<f32> { (0..n).map(|_| (rng.normal() * 0.02) as f32).collect() };
        let (v, c) = (self.cfg.vocab_size, self.cfg.hidden_size);
        if seg == 0 {
            return normal(v * c);
        }
        if seg == self.cfg.n_layer + 1 {
            let mut out = vec![1.0; c];
            if !self.cfg.tie_word_embeddings {
                out.extend(normal(v * c));
            }
            return out;
        }
        let r = &self.ranges.layer_rel;
        let mut out = vec![0.0f32; r.span().len()];
        out[r.attn_norm.clone()].fill(1.0);
        out[r.mlp_norm.clone()].fill(1.0);
        for pr in Proj::ALL {
            let w = r.w(pr);
            out[w.clone()].copy_from_slice(&normal(w.len()));
        }
        self.init_adapters(seed, seg - 1, &mut out);
        out
    }

    /// Initialises layer `idx`'s adapters inside `layer` (the layer's
    /// parameters): A Kaiming-uniform from its own stream, B zero.
    pub(crate) fn init_adapters(&self, seed: u64, idx: usize, layer: &mut [f32]) {
        let r = &self.ranges.layer_rel;
        for (pr, lr) in Proj::ALL.iter().zip(&r.lora) {
            if let Some(lr) = lr {
                let fan_in = pr.shape(&self.cfg)[1];
                let mut rng = SplitMix64::derive(seed, &[0x10ea, idx as u64, *pr as u64]);
                layer[lr.a.clone()].copy_from_slice(&crate::lora::kaiming_uniform(&mut rng, lr.a.len(), fan_in));
                layer[lr.b.clone()].fill(0.0);
            }
        }
    }

    fn check(&self, batch: &TokenBatch) -> Result<(), LlamaError> {
        let max = self.cfg.max_position_embeddings;
        match batch.problem(max, "max_position_embeddings", self.cfg.vocab_size) {
            Some(p) => Err(LlamaError::InvalidBatch(p)),
            None => Ok(()),
        }
    }

    fn dims(&self, b: usize, t: usize) -> Dims {
        let cfg = &self.cfg;
        let gqa = GqaShape { b, t, n_head: cfg.n_head, n_kv_head: cfg.n_kv_head, head_dim: cfg.head_dim };
        Dims {
            n: b * t,
            c: cfg.hidden_size,
            f: cfg.intermediate_size,
            gqa,
            eps: cfg.rms_norm_eps as f32,
            r: self.adapters.map_or(0, |a| a.r),
            lora_scale: self.lora.as_ref().map_or(0.0, LoraConfig::scale),
            ops: gpt::kernels::operands(self.precision),
        }
    }

    /// Sizes the activations for (b, t) and `pass`: a training pass needs a
    /// slot per layer, a forward-only pass one (evaluation between training
    /// steps reuses the training buffers instead of reallocating).
    fn ensure_acts(&mut self, b: usize, t: usize, pass: Pass) {
        let n_slots = if pass == Pass::Train { self.cfg.n_layer } else { 1 };
        let a = &self.acts;
        let same = a.precision == self.precision && a.checkpointing == self.checkpointing;
        if a.b != b || a.t != t || !same || a.saved.len() < n_slots {
            let d = self.dims(b, t);
            self.acts = Acts::new(&self.cfg, self.precision, &d, self.adapters, n_slots, self.checkpointing);
        }
    }

    /// The same model recomputing the layers `checkpointing` selects in
    /// backward (keeping only their outputs in forward). Gradients are
    /// bit-identical: the same kernels run on the same inputs.
    pub fn with_checkpointing(mut self, checkpointing: Checkpointing) -> Self {
        self.checkpointing = checkpointing;
        self.acts = Acts::default();
        self
    }

    /// Segment of the head: the embedding's (tied) or the final norm's.
    fn head_seg(&self) -> usize {
        if self.cfg.tie_word_embeddings {
            0
        } else {
            self.norm_seg()
        }
    }

    fn norm_seg(&self) -> usize {
        self.cfg.n_layer + 1
    }

    /// Range of the head inside its segment.
    fn head_rel(&self) -> Range<usize> {
        match &self.ranges.head {
            Some(h) => h.start - self.ranges.norm.start..h.end - self.ranges.norm.start,
            None => self.ranges.embed.clone(),
        }
    }

    /// Forward through the final norm and the head into `logits`. Leaves
    /// the head's segment ([`Llama::head_seg`]) held.
    fn forward(&mut self, store: &mut dyn ParamStore, inputs: &[u32], pass: Pass) -> Result<(), LlamaError> {
        let (c, v) = (self.cfg.hidden_size, self.cfg.vocab_size);
        let d = self.dims(self.acts.b, self.acts.t);
        let prec = self.precision;
        {
            let seg = store.segment(0)?;
            let acts = &mut self.acts;
            kernels::embedding_forward(&mut acts.x, inputs, &seg.params[self.ranges.embed.clone()], c);
            acts.saved_embed.keep_copy(&mut acts.x, prec);
        }
        store.done(0, false)?;
        for idx in 0..self.cfg.n_layer {
            let seg = store.segment(1 + idx)?;
            let acts = &mut self.acts;
            let r = &self.ranges.layer_rel;
            let train = pass == Pass::Train;
            match acts.recompute.as_mut() {
                // Recomputed in backward (or a forward-only pass): the
                // shared slot; a training pass keeps the output alone.
                Some(rc) if !train || self.checkpointing.recomputes(idx) => {
                    let sv = &mut rc.sv;
                    block_forward(&self.cfg, r, seg.params, &mut acts.x, sv, &mut acts.bufs, &acts.rope, &d, prec);
                    if train {
                        std::mem::swap(&mut rc.sv.large[OUT], &mut acts.saved[idx].large[OUT]);
                    }
                }
                _ => {
                    let sv = &mut acts.saved[if train { idx } else { 0 }];
                    block_forward(&self.cfg, r, seg.params, &mut acts.x, sv, &mut acts.bufs, &acts.rope, &d, prec);
                }
            }
            store.done(1 + idx, false)?;
        }
        let norm_seg = self.norm_seg();
        {
            let seg = store.segment(norm_seg)?;
            let acts = &mut self.acts;
            kernels::rmsnorm_forward(&mut acts.hf, &mut acts.rstd_f, &acts.x, &seg.params[..c], c, d.eps);
        }
        if self.head_seg() != norm_seg {
            store.done(norm_seg, false)?;
        }
        // logits = hf · headᵀ, for every row or each sequence's last one.
        let (b, t) = (self.acts.b, self.acts.t);
        let (rows, hf) = match pass {
            Pass::NextToken => (b, Strided { data: &self.acts.hf, offset: (t - 1) * c, rs: t * c, cs: 1 }),
            Pass::Train | Pass::Eval => (d.n, Strided::rows(&self.acts.hf, c)),
        };
        self.acts.logits.resize(rows * v, 0.0);
        let seg = store.segment(self.head_seg())?;
        let head = Strided::transposed(&seg.params[self.head_rel()], c);
        gemm_into(rows, v, c, &mut self.acts.logits, 0, v, false, hf, head, 1.0, parallelism(false).with(d.ops));
        Ok(())
    }

    /// Backward from `dlogits` (held in `logits`) to every parameter,
    /// segment by segment in reverse; the head's segment is still held
    /// from the forward. Frozen tensors' weight gradients are skipped.
    fn backward(&mut self, store: &mut dyn ParamStore, inputs: &[u32]) -> Result<(), LlamaError> {
        let (c, v) = (self.cfg.hidden_size, self.cfg.vocab_size);
        let d = self.dims(self.acts.b, self.acts.t);
        let prec = self.precision;
        if prec == Precision::F16 {
            // The scaled logits gradient in f16: where a too-large loss scale overflows.
            prec.round(&mut self.acts.logits);
        }
        let (head_seg, norm_seg, head_rel) = (self.head_seg(), self.norm_seg(), self.head_rel());
        {
            let SegmentView { params, mut grads } = store.segment(head_seg)?;
            let acts = &mut self.acts;
            let dlogits = Strided::rows(&acts.logits, v);
            // dhf = dlogits · head ; dhead (+)= dlogitsᵀ · hf
            kernels::linear_backward_input(
                &mut acts.bufs.dc,
                false,
                dlogits,
                &params[head_rel.clone()],
                d.n,
                c,
                v,
                1.0,
                d.ops,
            );
            kernels::linear_backward_weight(kgrad(grads.tensor(head_rel)), dlogits, &acts.hf, d.n, c, v, 1.0, d.ops);
        }
        if head_seg != norm_seg {
            // The head's share of the embedding's gradient is complete for this pass.
            store.done(head_seg, true)?;
        }
        {
            let SegmentView { params, mut grads } = store.segment(norm_seg)?;
            let acts = &mut self.acts;
            acts.bufs.dres.fill(0.0);
            let gw = kgrad(grads.tensor(0..c));
            let (dres, dc) = (&mut acts.bufs.dres, &acts.bufs.dc);
            // acts.x is still the last layer's output.
            kernels::rmsnorm_backward(dres, gw, dc, &acts.x, &acts.rstd_f, &params[..c], c);
        }
        store.done(norm_seg, true)?;
        for idx in (0..self.cfg.n_layer).rev() {
            if prec == Precision::F16 {
                prec.round(&mut self.acts.bufs.dres); // activation gradients between layers are f16
            }
            let SegmentView { params, mut grads } = store.segment(1 + idx)?;
            let acts = &mut self.acts;
            let x = if idx == 0 { &acts.saved_embed } else { &acts.saved[idx - 1].large[OUT] };
            let r = &self.ranges.layer_rel;
            let sv = match acts.recompute.as_mut().filter(|_| self.checkpointing.recomputes(idx)) {
                // The layer's forward again, on its saved input, with the same kernels.
                Some(rc) => {
                    match x {
                        SavedTensor::F32(v) => rc.x.copy_from_slice(v),
                        SavedTensor::Low(v) => prec.decode(v, &mut rc.x),
                    }
                    let (cfg, rope) = (&self.cfg, &acts.rope);
                    block_forward(cfg, r, params, &mut rc.x, &mut rc.sv, &mut rc.bufs, rope, &d, prec);
                    &rc.sv
                }
                None => &acts.saved[idx],
            };
            let saved = SavedView { sv, x, u: &mut acts.u, v: &mut acts.v, w: &mut acts.w, prec };
            block_backward(&self.cfg, r, params, &mut grads, saved, &mut acts.bufs, &acts.rope, &d);
            store.done(1 + idx, true)?;
        }
        if prec == Precision::F16 {
            prec.round(&mut self.acts.bufs.dres);
        }
        {
            let SegmentView { mut grads, .. } = store.segment(0)?;
            // The embedding's gradient is only ever added to.
            let g = grads.tensor(self.ranges.embed.clone()).map(GradOut::for_adding);
            kernels::embedding_backward(g, &self.acts.bufs.dres, inputs, c);
        }
        store.done(0, true)?;
        Ok(())
    }

    /// Checks `batch`, sizes the activations and runs the forward; the
    /// head's segment stays held.
    fn forward_batch(&mut self, store: &mut dyn ParamStore, batch: &TokenBatch, pass: Pass) -> Result<(), LlamaError> {
        self.check(batch)?;
        self.ensure_acts(batch.n_seqs, batch.seq_len, pass);
        self.forward(store, &batch.inputs, pass)
    }

    /// Fused softmax + cross-entropy of the logits (replaced by
    /// `grad_scale ·` their gradient when given); returns the loss summed in
    /// row order (f64, deterministic).
    fn cross_entropy(&mut self, batch: &TokenBatch, grad_scale: Option<f32>) -> f64 {
        let acts = &mut self.acts;
        let v = self.cfg.vocab_size;
        gpt::kernels::softmax_cross_entropy(&mut acts.logits, &mut acts.losses, &batch.targets, v, grad_scale);
        acts.losses[..batch.n_seqs * batch.seq_len].iter().map(|&l| l as f64).sum()
    }

    fn logits_of(&mut self, params: &[f32], batch: &TokenBatch, pass: Pass) -> Result<Vec<f32>, LlamaError> {
        let mut store = FullStore::read_only(&self.layout, self.segments(), params)?;
        self.forward_batch(&mut store, batch, pass)?;
        store.done(self.head_seg(), false)?;
        Ok(std::mem::take(&mut self.acts.logits))
    }

    /// Logits `[B·T, V]` of every position of `batch` (targets unused).
    pub fn logits(&mut self, params: &[f32], batch: &TokenBatch) -> Result<Vec<f32>, LlamaError> {
        self.logits_of(params, batch, Pass::Eval)
    }

    /// Logits `[V]` of the last position of `tokens` (one sequence), for
    /// sampling: the head runs on that position only, and the layers keep
    /// no activations for a backward.
    pub fn next_token_logits(&mut self, params: &[f32], tokens: &[u32]) -> Result<Vec<f32>, LlamaError> {
        let t = tokens.len();
        let batch = TokenBatch { n_seqs: 1, seq_len: t, inputs: tokens.to_vec(), targets: vec![IGNORE_INDEX; t] };
        self.logits_of(params, &batch, Pass::NextToken)
    }
}

impl Model for Llama {
    type Batch = TokenBatch;
    type Error = LlamaError;

    fn layout(&self) -> &ParamLayout {
        &self.layout
    }

    /// A frozen tensor's weight-gradient computation is skipped.
    fn set_trainable(&mut self, trainable: &dyn Fn(&engine::TensorSpec) -> bool) -> usize {
        self.layout.set_trainable(trainable)
    }

    fn segments(&self) -> Vec<Range<usize>> {
        let r = &self.ranges;
        let last = r.head.as_ref().map_or(r.norm.end, |h| h.end);
        std::iter::once(r.embed.clone())
            .chain(r.layers.iter().map(LayerParams::span))
            .chain(std::iter::once(r.norm.start..last))
            .collect()
    }

    fn n_targets(&self, batch: &TokenBatch) -> u64 {
        batch.n_targets()
    }

    /// A batch of zero sequences (a rank without data in the tail) runs the
    /// same code on zero rows: the same segment visits and collectives as
    /// every other rank, and a zero gradient.
    fn micro_step(
        &mut self,
        store: &mut dyn ParamStore,
        batch: &TokenBatch,
        grad_scale: f32,
    ) -> Result<MicroStepStats, LlamaError> {
        self.forward_batch(store, batch, Pass::Train)?;
        let loss_sum = self.cross_entropy(batch, Some(grad_scale));
        self.backward(store, &batch.inputs)?;
        Ok(MicroStepStats { loss_sum, n_targets: batch.n_targets() })
    }

    fn loss(&mut self, store: &mut dyn ParamStore, batch: &TokenBatch) -> Result<MicroStepStats, LlamaError> {
        self.forward_batch(store, batch, Pass::Eval)?;
        store.done(self.head_seg(), false)?;
        Ok(MicroStepStats { loss_sum: self.cross_entropy(batch, None), n_targets: batch.n_targets() })
    }
}
