//! The GPT-2 model: parameter layout, activations, and one micro-step
//! (forward, fused loss, backward) over flat buffers.
//!
//! Each block's forward ([`Gpt::block_forward`]) and backward
//! ([`Gpt::block_backward`]) read only that block's parameter ranges and
//! activations, so a block can be recomputed (activation checkpointing) or its
//! parameters gathered just before it runs (ZeRO-3).

use crate::config::GptConfig;
use crate::error::GptError;
use crate::kernels::{self, AttnShape, Strided};
use engine::rng::SplitMix64;
use engine::{
    Checkpointing, FullStore, GradOut, MicroStepStats, Model, ParamLayout, ParamStore, Precision, SavedTensor,
    SegmentGrads, SegmentView,
};
use std::ops::Range;

pub use engine::batch::{TokenBatch as Batch, IGNORE_INDEX};

/// Element ranges of one block's parameters inside the flat buffer.
#[derive(Debug, Clone)]
pub struct BlockParams {
    /// `ln_1.weight`.
    pub ln1_w: Range<usize>,
    /// `ln_1.bias`.
    pub ln1_b: Range<usize>,
    /// `attn.c_attn.weight` `[C, 3C]`.
    pub attn_w: Range<usize>,
    /// `attn.c_attn.bias`.
    pub attn_b: Range<usize>,
    /// `attn.c_proj.weight` `[C, C]`.
    pub proj_w: Range<usize>,
    /// `attn.c_proj.bias`.
    pub proj_b: Range<usize>,
    /// `ln_2.weight`.
    pub ln2_w: Range<usize>,
    /// `ln_2.bias`.
    pub ln2_b: Range<usize>,
    /// `mlp.c_fc.weight` `[C, 4C]`.
    pub fc_w: Range<usize>,
    /// `mlp.c_fc.bias`.
    pub fc_b: Range<usize>,
    /// `mlp.c_proj.weight` `[4C, C]`.
    pub fcproj_w: Range<usize>,
    /// `mlp.c_proj.bias`.
    pub fcproj_b: Range<usize>,
}

impl BlockParams {
    /// The contiguous range the whole block occupies.
    pub fn span(&self) -> Range<usize> {
        self.ln1_w.start..self.fcproj_b.end
    }
}

/// Element ranges of all parameters.
#[derive(Debug, Clone)]
struct ParamRanges {
    wte: Range<usize>,
    wpe: Range<usize>,
    blocks: Vec<BlockParams>,
    /// One block's ranges relative to the block's first parameter (every block alike).
    block_rel: BlockParams,
    lnf_w: Range<usize>,
    lnf_b: Range<usize>,
}

fn build_layout(cfg: &GptConfig) -> (ParamLayout, ParamRanges) {
    let c = cfg.n_embd;
    let mut l = ParamLayout::new();
    let wte = l.push("transformer.wte.weight", &[cfg.vocab_size, c], true);
    let wpe = l.push("transformer.wpe.weight", &[cfg.block_size, c], true);
    let blocks = (0..cfg.n_layer)
        .map(|i| {
            let p = format!("transformer.h.{i}");
            BlockParams {
                ln1_w: l.push(format!("{p}.ln_1.weight"), &[c], false),
                ln1_b: l.push(format!("{p}.ln_1.bias"), &[c], false),
                attn_w: l.push(format!("{p}.attn.c_attn.weight"), &[c, 3 * c], true),
                attn_b: l.push(format!("{p}.attn.c_attn.bias"), &[3 * c], false),
                proj_w: l.push(format!("{p}.attn.c_proj.weight"), &[c, c], true),
                proj_b: l.push(format!("{p}.attn.c_proj.bias"), &[c], false),
                ln2_w: l.push(format!("{p}.ln_2.weight"), &[c], false),
                ln2_b: l.push(format!("{p}.ln_2.bias"), &[c], false),
                fc_w: l.push(format!("{p}.mlp.c_fc.weight"), &[c, 4 * c], true),
                fc_b: l.push(format!("{p}.mlp.c_fc.bias"), &[4 * c], false),
                fcproj_w: l.push(format!("{p}.mlp.c_proj.weight"), &[4 * c, c], true),
                fcproj_b: l.push(format!("{p}.mlp.c_proj.bias"), &[c], false),
            }
        })
        .collect();
    let lnf_w = l.push("transformer.ln_f.weight", &[c], false);
    let lnf_b = l.push("transformer.ln_f.bias", &[c], false);
    let block_rel = relative_block(c);
    (l, ParamRanges { wte, wpe, blocks, block_rel, lnf_w, lnf_b })
}

/// One block's parameter ranges relative to its first parameter.
fn relative_block(c: usize) -> BlockParams {
    let mut at = 0;
    let mut next = |n: usize| {
        let r = at..at + n;
        at += n;
        r
    };
    BlockParams {
        ln1_w: next(c),
        ln1_b: next(c),
        attn_w: next(3 * c * c),
        attn_b: next(3 * c),
        proj_w: next(c * c),
        proj_b: next(c),
        ln2_w: next(c),
        ln2_b: next(c),
        fc_w: next(4 * c * c),
        fc_b: next(4 * c),
        fcproj_w: next(4 * c * c),
        fcproj_b: next(c),
    }
}

/// GPT-2 initialisation: N(0, 0.02) for matrices and embeddings, residual
/// projections scaled by 1/√(2·n_layer), zero biases, unit LayerNorm gains.
pub fn init_params(cfg: &GptConfig, seed: u64) -> Vec<f32> {
    (0..cfg.n_layer + 2).flat_map(|seg| init_segment(cfg, seed, seg)).collect()
}

/// The initial values of segment `seg` alone (0: embeddings, 1..=n_layer:
/// blocks, n_layer+1: final LayerNorm), each from its own random stream, so a
/// ZeRO-3 rank can initialise one segment at a time and keep only its piece.
pub fn init_segment(cfg: &GptConfig, seed: u64, seg: usize) -> Vec<f32> {
    let c = cfg.n_embd;
    let mut rng = SplitMix64::derive(seed, &[0x1a17, seg as u64]);
    let mut normal = |n: usize, std: f64| -> Vec<f32> { (0..n).map(|_| (rng.normal() * std) as f32).collect() };
    let resid_std = 0.02 / (2.0 * cfg.n_layer as f64).sqrt();
    if seg == 0 {
        let mut v = normal(cfg.vocab_size * c, 0.02);
        v.extend(normal(cfg.block_size * c, 0.02));
        return v;
    }
    if seg == cfg.n_layer + 1 {
        let mut v = vec![1.0; c];
        v.extend(vec![0.0; c]);
        return v;
    }
    let r = relative_block(c);
    let mut v = vec![0.0f32; r.span().len()];
    let mut put = |range: Range<usize>, vals: Vec<f32>| v[range].copy_from_slice(&vals);
    put(r.attn_w.clone(), normal(r.attn_w.len(), 0.02));
    put(r.proj_w.clone(), normal(r.proj_w.len(), resid_std));
    put(r.fc_w.clone(), normal(r.fc_w.len(), 0.02));
    put(r.fcproj_w.clone(), normal(r.fcproj_w.len(), resid_std));
    put(r.ln1_w.clone(), vec![1.0; c]);
    put(r.ln2_w.clone(), vec![1.0; c]);
    v
}

/// Indices of a block's large saved tensors.
const LN1: usize = 0;
const QKV: usize = 1;
const ATT: usize = 2;
const ATTY: usize = 3;
const RES2: usize = 4;
const LN2: usize = 5;
const FCH: usize = 6;
const FCH_GELU: usize = 7;
const RES3: usize = 8;

/// What one block's forward keeps for its backward: nine large tensors
/// (in the storage precision) and the LayerNorm statistics (always f32).
#[derive(Debug, Default)]
struct SavedBlock {
    /// ln1, qkv, att, atty, res2, ln2, fch, fch_gelu, res3 (the block's output).
    large: [SavedTensor; 9],
    /// ln1 mean, ln1 1/std, ln2 mean, ln2 1/std.
    stats: [Vec<f32>; 4],
}

impl SavedBlock {
    fn new(precision: Precision, c: usize, nh: usize, b: usize, t: usize) -> Self {
        let bt = b * t;
        let sizes = [bt * c, bt * 3 * c, b * nh * t * t, bt * c, bt * c, bt * c, bt * 4 * c, bt * 4 * c, bt * c];
        SavedBlock { large: sizes.map(|n| SavedTensor::new(precision, n)), stats: [bt; 4].map(|n| vec![0.0; n]) }
    }

    /// What a recomputed block keeps: its output alone (the next block's input).
    fn output_only(precision: Precision, c: usize, b: usize, t: usize) -> Self {
        let mut sv = SavedBlock::default();
        sv.large[RES3] = SavedTensor::new(precision, b * t * c);
        sv
    }

    fn bytes(&self) -> usize {
        self.large.iter().map(SavedTensor::bytes).sum::<usize>() + 4 * self.stats.iter().map(Vec::len).sum::<usize>()
    }
}

/// Activations and backward scratch for one (B, T).
///
/// Per block a [`SavedBlock`]; forward produces each tensor in f32 in the
/// idle backward scratch and keeps it there (16 bits under mixed precision,
/// so no f32 copy of a block exists). Backward reads saved tensors through a
/// [`SavedView`].
#[derive(Debug, Default)]
struct Acts {
    b: usize,
    t: usize,
    precision: Precision,
    saved: Vec<SavedBlock>,
    /// The embeddings' output (block 0's input).
    saved_encoded: SavedTensor,
    /// The residual stream entering the current block (forward), and the
    /// last block's output (read by the final LayerNorm).
    x_buf: Vec<f32>,
    /// f32 staging: GELU's output in forward; under mixed precision one
    /// saved tensor at a time in backward (4C per row), and the attention
    /// probabilities (`v`).
    u: Vec<f32>,
    v: Vec<f32>,
    lnf: Vec<f32>,
    lnf_mean: Vec<f32>,
    lnf_rstd: Vec<f32>,
    logits: Vec<f32>,
    losses: Vec<f32>,
    /// Backward scratch (and the forward's working set).
    scratch: ScratchBufs,
    /// With activation checkpointing: where recomputed blocks live.
    recompute: Option<Recompute>,
}

/// One block's activations, recomputed just before its backward, with a
/// working set of its own (the backward scratch is busy then).
#[derive(Debug)]
struct Recompute {
    /// The block's saved tensors, as its forward produces them.
    sv: SavedBlock,
    /// The forward's working buffers.
    work: ScratchBufs,
    /// GELU's output.
    u: Vec<f32>,
    /// The block's input (then its output).
    x: Vec<f32>,
}

/// The buffers behind [`Scratch`].
#[derive(Debug, Default)]
struct ScratchBufs {
    dres: Vec<f32>,
    dc: Vec<f32>,
    d4c: Vec<f32>,
    dqkv: Vec<f32>,
    datt: Vec<f32>,
}

impl ScratchBufs {
    fn view(&mut self) -> Scratch<'_> {
        Scratch {
            dres: &mut self.dres,
            dc: &mut self.dc,
            d4c: &mut self.d4c,
            dqkv: &mut self.dqkv,
            datt: &mut self.datt,
        }
    }

    /// The same buffers as the forward's [`Work`], with GELU's output `u`.
    fn work<'a>(&'a mut self, u: &'a mut Vec<f32>) -> Work<'a> {
        Work {
            dres: &mut self.dres,
            dc: &mut self.dc,
            d4c: &mut self.d4c,
            dqkv: &mut self.dqkv,
            datt: &mut self.datt,
            u,
        }
    }

    fn len(&self) -> usize {
        [&self.dres, &self.dc, &self.d4c, &self.dqkv, &self.datt].iter().map(|v| v.len()).sum()
    }
}

impl ScratchBufs {
    fn new(c: usize, nh: usize, b: usize, t: usize) -> Self {
        let (bt, z) = (b * t, |n: usize| vec![0.0f32; n]);
        ScratchBufs { dres: z(bt * c), dc: z(bt * c), d4c: z(bt * 4 * c), dqkv: z(bt * 3 * c), datt: z(b * nh * t * t) }
    }
}

impl Acts {
    fn new(cfg: &GptConfig, precision: Precision, checkpointing: Checkpointing, b: usize, t: usize) -> Self {
        let (c, nh, v) = (cfg.n_embd, cfg.n_head, cfg.vocab_size);
        let bt = b * t;
        let z = |n: usize| vec![0.0f32; n];
        let low = precision.is_low();
        let saved_block = |idx: usize| {
            if checkpointing.recomputes(idx) {
                SavedBlock::output_only(precision, c, b, t)
            } else {
                SavedBlock::new(precision, c, nh, b, t)
            }
        };
        Self {
            b,
            t,
            precision,
            saved: (0..cfg.n_layer).map(saved_block).collect(),
            saved_encoded: SavedTensor::new(precision, bt * c),
            x_buf: z(bt * c),
            u: z(bt * 4 * c),
            v: if low { z(b * nh * t * t) } else { Vec::new() },
            lnf: z(bt * c),
            lnf_mean: z(bt),
            lnf_rstd: z(bt),
            logits: z(bt * v),
            losses: z(bt),
            scratch: ScratchBufs::new(c, nh, b, t),
            recompute: checkpointing.is_on().then(|| Recompute {
                sv: SavedBlock::new(precision, c, nh, b, t),
                work: ScratchBufs::new(c, nh, b, t),
                u: z(bt * 4 * c),
                x: z(bt * c),
            }),
        }
    }

    /// Bytes held (activations and scratch), for memory accounting.
    fn bytes(&self) -> usize {
        let saved: usize = self.saved.iter().map(SavedBlock::bytes).sum::<usize>() + self.saved_encoded.bytes();
        let rest =
            [&self.x_buf, &self.u, &self.v, &self.lnf, &self.lnf_mean, &self.lnf_rstd, &self.logits, &self.losses]
                .iter()
                .map(|v| v.len())
                .sum::<usize>();
        let recompute =
            self.recompute.as_ref().map_or(0, |r| r.sv.bytes() + 4 * (r.work.len() + r.u.len() + r.x.len()));
        saved + 4 * (rest + self.scratch.len()) + recompute
    }
}

/// Shapes of one block call.
#[derive(Debug, Clone, Copy)]
struct Dims {
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
}

/// Backward scratch shared by all blocks.
struct Scratch<'a> {
    dres: &'a mut [f32],
    dc: &'a mut [f32],
    d4c: &'a mut [f32],
    dqkv: &'a mut [f32],
    datt: &'a mut [f32],
}

/// The forward's working buffers (the idle backward scratch), as vectors so
/// that an f32 tensor can be kept by swapping buffers instead of copying.
struct Work<'a> {
    dres: &'a mut Vec<f32>,
    dc: &'a mut Vec<f32>,
    d4c: &'a mut Vec<f32>,
    dqkv: &'a mut Vec<f32>,
    datt: &'a mut Vec<f32>,
    /// GELU's output.
    u: &'a mut Vec<f32>,
}

/// Forward of one block, for every storage precision: each tensor is
/// produced in f32 in a working buffer and kept in `sv` at once (swapped in
/// for f32, encoded in 16 bits otherwise); what follows reads the kept
/// tensor. On entry `x` holds the block's input; on exit its output.
fn block_forward(
    r: &BlockParams,
    p: &[f32],
    x: &mut [f32],
    sv: &mut SavedBlock,
    w: Work<'_>,
    d: Dims,
    prec: Precision,
) {
    let Dims { b, t, c, nh } = d;
    let n = b * t;
    let Work { dres: res2, dc: a, d4c: f, dqkv: qkv, datt: att, u: g } = w;
    let SavedBlock { large, stats } = sv;
    let [ln1_mean, ln1_rstd, ln2_mean, ln2_rstd] = stats;
    let ops = kernels::operands(prec);
    kernels::layernorm_forward(a, ln1_mean, ln1_rstd, x, &p[r.ln1_w.clone()], &p[r.ln1_b.clone()], c);
    large[LN1].keep(a, prec);
    let attn_b = Some(&p[r.attn_b.clone()]);
    kernels::matmul_forward(qkv, large[LN1].cur(a), &p[r.attn_w.clone()], attn_b, None, n, c, 3 * c, ops);
    large[QKV].keep(qkv, prec);
    kernels::attention_forward(a, att, large[QKV].cur(qkv), AttnShape { b, t, c, n_head: nh, ops });
    large[ATT].keep(att, prec);
    large[ATTY].keep(a, prec);
    let proj_b = Some(&p[r.proj_b.clone()]);
    kernels::matmul_forward(res2, large[ATTY].cur(a), &p[r.proj_w.clone()], proj_b, Some(x), n, c, c, ops);
    large[RES2].keep(res2, prec);
    let (ln2_w, ln2_b) = (&p[r.ln2_w.clone()], &p[r.ln2_b.clone()]);
    kernels::layernorm_forward(a, ln2_mean, ln2_rstd, large[RES2].cur(res2), ln2_w, ln2_b, c);
    large[LN2].keep(a, prec);
    kernels::matmul_forward(f, large[LN2].cur(a), &p[r.fc_w.clone()], Some(&p[r.fc_b.clone()]), None, n, c, 4 * c, ops);
    large[FCH].keep(f, prec);
    kernels::gelu_forward(g, large[FCH].cur(f));
    large[FCH_GELU].keep(g, prec);
    let (gelu, res) = (large[FCH_GELU].cur(g), Some(large[RES2].cur(res2)));
    kernels::matmul_forward(x, gelu, &p[r.fcproj_w.clone()], Some(&p[r.fcproj_b.clone()]), res, n, 4 * c, c, ops);
    // The output stays in `x` as the next block's input: kept by copy.
    large[RES3].keep_copy(x, prec);
}

/// Where a block's backward reads what its forward saved: each tensor as
/// f32, directly or decoded into `u` just before use (the attention
/// probabilities into `v`).
struct SavedView<'a> {
    sv: &'a SavedBlock,
    /// The block's input.
    x: &'a SavedTensor,
    u: &'a mut [f32],
    v: &'a mut [f32],
    prec: Precision,
}

impl SavedView<'_> {
    /// Saved tensor `k` as f32.
    fn get(&mut self, k: usize) -> &[f32] {
        self.sv.large[k].read(self.prec, self.u)
    }

    /// q|k|v and the attention probabilities, together.
    fn qkv_att(&mut self) -> (&[f32], &[f32]) {
        (self.sv.large[QKV].read(self.prec, self.u), self.sv.large[ATT].read(self.prec, self.v))
    }

    /// The block's input.
    fn input(&mut self) -> &[f32] {
        self.x.read(self.prec, self.u)
    }
}

/// A parameter gradient handed to a kernel: the buffer and whether to add
/// into it (`false`: overwrite) — `None` for a frozen tensor.
fn kgrad<'a>(g: Option<GradOut<'a>>) -> kernels::ParamGrad<'a> {
    g.map(|g| (g.buf, g.accumulate))
}

/// Backward of one block: on entry `s.dres` holds the gradient of the
/// block's output; on exit, of its input. Parameter gradients go where the
/// store says (`grads`).
fn block_backward(
    r: &BlockParams,
    p: &[f32],
    grads: &mut SegmentGrads<'_>,
    mut saved: SavedView<'_>,
    s: Scratch<'_>,
    d: Dims,
) {
    let Dims { b, t, c, nh } = d;
    let n = b * t;
    let Scratch { dres, dc, d4c, dqkv, datt } = s;
    let sv = saved.sv;
    let [ln1_mean, ln1_rstd, ln2_mean, ln2_rstd] = &sv.stats;
    let ops = kernels::operands(saved.prec);
    let (gw, gb) = grads.pair(r.fcproj_w.clone(), r.fcproj_b.clone());
    kernels::matmul_backward(
        d4c,
        kgrad(gw),
        kgrad(gb),
        dres,
        saved.get(FCH_GELU),
        &p[r.fcproj_w.clone()],
        n,
        4 * c,
        c,
        ops,
    );
    kernels::gelu_backward_inplace(d4c, saved.get(FCH));
    let (gw, gb) = grads.pair(r.fc_w.clone(), r.fc_b.clone());
    kernels::matmul_backward(dc, kgrad(gw), kgrad(gb), d4c, saved.get(LN2), &p[r.fc_w.clone()], n, c, 4 * c, ops);
    let (gw, gb) = grads.pair(r.ln2_w.clone(), r.ln2_b.clone());
    kernels::layernorm_backward(
        dres,
        kgrad(gw),
        kgrad(gb),
        dc,
        saved.get(RES2),
        ln2_mean,
        ln2_rstd,
        &p[r.ln2_w.clone()],
        c,
    );
    let (gw, gb) = grads.pair(r.proj_w.clone(), r.proj_b.clone());
    kernels::matmul_backward(dc, kgrad(gw), kgrad(gb), dres, saved.get(ATTY), &p[r.proj_w.clone()], n, c, c, ops);
    let (qkv, att) = saved.qkv_att();
    kernels::attention_backward(dqkv, datt, dc, qkv, att, AttnShape { b, t, c, n_head: nh, ops });
    let (gw, gb) = grads.pair(r.attn_w.clone(), r.attn_b.clone());
    kernels::matmul_backward(dc, kgrad(gw), kgrad(gb), dqkv, saved.get(LN1), &p[r.attn_w.clone()], n, c, 3 * c, ops);
    let (gw, gb) = grads.pair(r.ln1_w.clone(), r.ln1_b.clone());
    kernels::layernorm_backward(
        dres,
        kgrad(gw),
        kgrad(gb),
        dc,
        saved.input(),
        ln1_mean,
        ln1_rstd,
        &p[r.ln1_w.clone()],
        c,
    );
}

/// The GPT-2 model with its activation buffers.
#[derive(Debug)]
pub struct Gpt {
    cfg: GptConfig,
    layout: ParamLayout,
    ranges: ParamRanges,
    precision: Precision,
    checkpointing: Checkpointing,
    acts: Acts,
}

impl Gpt {
    /// A model of the given shape (parameters live outside, in a flat buffer).
    pub fn new(cfg: GptConfig) -> Result<Self, GptError> {
        Self::with_precision(cfg, Precision::F32)
    }

    /// A model whose saved activations (and, under f16, activation gradients
    /// between blocks) are stored in `precision`; kernels compute in f32.
    pub fn with_precision(cfg: GptConfig, precision: Precision) -> Result<Self, GptError> {
        cfg.validate()?;
        let (layout, ranges) = build_layout(&cfg);
        Ok(Self { cfg, layout, ranges, precision, checkpointing: Checkpointing::None, acts: Acts::default() })
    }

    /// The same model recomputing the blocks `checkpointing` selects in
    /// backward (keeping only their outputs in forward). Gradients are
    /// bit-identical: the same kernels run on the same inputs.
    pub fn with_checkpointing(mut self, checkpointing: Checkpointing) -> Self {
        self.checkpointing = checkpointing;
        self.acts = Acts::default();
        self
    }

    /// Which blocks are recomputed.
    pub fn checkpointing(&self) -> Checkpointing {
        self.checkpointing
    }

    /// The storage precision of activations.
    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// The model's shape.
    pub fn config(&self) -> &GptConfig {
        &self.cfg
    }

    /// Parameter ranges of block `idx`.
    pub fn block_params(&self, idx: usize) -> &BlockParams {
        &self.ranges.blocks[idx]
    }

    /// Bytes of activations and backward scratch currently allocated.
    pub fn activation_bytes(&self) -> usize {
        self.acts.bytes()
    }

    /// Bytes of the activations kept from forward for backward: every
    /// block's saved tensors (16-bit under mixed precision; a recomputed
    /// block's output only, plus the one block being recomputed) and the
    /// embeddings.
    pub fn saved_activation_bytes(&self) -> usize {
        self.acts.saved.iter().map(SavedBlock::bytes).sum::<usize>()
            + self.acts.saved_encoded.bytes()
            + self.acts.recompute.as_ref().map_or(0, |r| r.sv.bytes())
    }

    fn check(&self, batch: &Batch) -> Result<(), GptError> {
        match batch.problem(self.cfg.block_size, "block_size", self.cfg.vocab_size) {
            Some(p) => Err(GptError::InvalidBatch(p)),
            None => Ok(()),
        }
    }

    fn ensure_acts(&mut self, b: usize, t: usize) {
        let recompute_ready = self.acts.recompute.is_some() == self.checkpointing.is_on();
        if self.acts.b != b || self.acts.t != t || self.acts.precision != self.precision || !recompute_ready {
            self.acts = Acts::new(&self.cfg, self.precision, self.checkpointing, b, t);
        }
    }

    /// Segment index of block `idx` (segment 0 is the embeddings, the last the final LayerNorm).
    fn block_seg(idx: usize) -> usize {
        1 + idx
    }

    fn lnf_seg(&self) -> usize {
        1 + self.cfg.n_layer
    }

    /// Forward through the final LayerNorm and the tied head into `logits`.
    /// Leaves segment 0 (the embeddings, whose `wte` is the head) held.
    fn forward(&mut self, store: &mut dyn ParamStore, inputs: &[u32]) -> Result<(), GptError> {
        let (t, c, v) = (self.acts.t, self.cfg.n_embd, self.cfg.vocab_size);
        let n = self.acts.b * t;
        let (wte, wpe) = (self.ranges.wte.clone(), self.ranges.wpe.clone());
        let prec = self.precision;
        {
            let seg = store.segment(0)?;
            let acts = &mut self.acts;
            kernels::encoder_forward(&mut acts.x_buf, inputs, &seg.params[wte.clone()], &seg.params[wpe], t, c);
            acts.saved_encoded.keep_copy(&mut acts.x_buf, prec);
        }
        store.done(0, false)?;
        let d = Dims { b: self.acts.b, t, c, nh: self.cfg.n_head };
        for idx in 0..self.cfg.n_layer {
            let seg = store.segment(Self::block_seg(idx))?;
            let acts = &mut self.acts;
            let work = acts.scratch.work(&mut acts.u);
            let r = &self.ranges.block_rel;
            match acts.recompute.as_mut().filter(|_| self.checkpointing.recomputes(idx)) {
                // Recomputed in backward: its tensors go to the shared
                // recompute slot; only its output (the next block's input) stays.
                Some(rc) => {
                    block_forward(r, seg.params, &mut acts.x_buf, &mut rc.sv, work, d, prec);
                    std::mem::swap(&mut rc.sv.large[RES3], &mut acts.saved[idx].large[RES3]);
                }
                None => block_forward(r, seg.params, &mut acts.x_buf, &mut acts.saved[idx], work, d, prec),
            }
            store.done(Self::block_seg(idx), false)?;
        }
        let lnf = self.lnf_seg();
        {
            let seg = store.segment(lnf)?;
            let acts = &mut self.acts;
            kernels::layernorm_forward(
                &mut acts.lnf,
                &mut acts.lnf_mean,
                &mut acts.lnf_rstd,
                &acts.x_buf,
                &seg.params[..c],
                &seg.params[c..2 * c],
                c,
            );
        }
        store.done(lnf, false)?;
        // logits = lnf · wteᵀ (the head is tied to the token embedding).
        let seg = store.segment(0)?;
        kernels::gemm_into(
            n,
            v,
            c,
            &mut self.acts.logits,
            0,
            v,
            false,
            Strided::rows(&self.acts.lnf, c),
            Strided::transposed(&seg.params[wte], c),
            1.0,
            kernels::parallelism(false).with(kernels::operands(self.precision)),
        );
        Ok(())
    }

    /// Backward from `dlogits` (held in `logits`) to every parameter, segment
    /// by segment in reverse; segment 0 is still held from the forward pass.
    /// Frozen tensors' weight gradients are not computed.
    fn backward(&mut self, store: &mut dyn ParamStore, inputs: &[u32]) -> Result<(), GptError> {
        let (t, c, v) = (self.acts.t, self.cfg.n_embd, self.cfg.vocab_size);
        let n = self.acts.b * t;
        let (wte, wpe) = (self.ranges.wte.clone(), self.ranges.wpe.clone());
        let prec = self.precision;
        let par = kernels::parallelism(false).with(kernels::operands(prec));
        if prec == Precision::F16 {
            // The scaled logits gradient in f16: this is where a too-large loss scale overflows.
            prec.round(&mut self.acts.logits);
        }
        {
            let SegmentView { params, mut grads } = store.segment(0)?;
            let acts = &mut self.acts;
            // dlnf = dlogits · wte ; dwte (+)= dlogitsᵀ · lnf
            kernels::gemm_into(
                n,
                c,
                v,
                &mut acts.scratch.dc,
                0,
                c,
                false,
                Strided::rows(&acts.logits, v),
                Strided::rows(&params[wte.clone()], c),
                1.0,
                par,
            );
            if let Some(g) = grads.tensor(wte.clone()) {
                kernels::gemm_into(
                    v,
                    c,
                    n,
                    g.buf,
                    0,
                    c,
                    g.accumulate,
                    Strided::transposed(&acts.logits, v),
                    Strided::rows(&acts.lnf, c),
                    1.0,
                    par,
                );
            }
        }
        // The head's share of wte's gradient is complete for this pass.
        store.done(0, true)?;
        let lnf = self.lnf_seg();
        {
            let SegmentView { params, mut grads } = store.segment(lnf)?;
            let acts = &mut self.acts;
            acts.scratch.dres.fill(0.0);
            let (gw, gb) = grads.pair(0..c, c..2 * c);
            kernels::layernorm_backward(
                &mut acts.scratch.dres,
                kgrad(gw),
                kgrad(gb),
                &acts.scratch.dc,
                &acts.x_buf, // still the last block's output
                &acts.lnf_mean,
                &acts.lnf_rstd,
                &params[..c],
                c,
            );
        }
        store.done(lnf, true)?;
        let d = Dims { b: self.acts.b, t, c, nh: self.cfg.n_head };
        for idx in (0..self.cfg.n_layer).rev() {
            if prec == Precision::F16 {
                prec.round(&mut self.acts.scratch.dres); // activation gradients between blocks are f16
            }
            let SegmentView { params, mut grads } = store.segment(Self::block_seg(idx))?;
            let acts = &mut self.acts;
            let scratch = acts.scratch.view();
            let x = if idx == 0 { &acts.saved_encoded } else { &acts.saved[idx - 1].large[RES3] };
            let sv = match acts.recompute.as_mut().filter(|_| self.checkpointing.recomputes(idx)) {
                // The block's forward again, on its saved input, with the same kernels.
                Some(rc) => {
                    match x {
                        SavedTensor::F32(v) => rc.x.copy_from_slice(v),
                        SavedTensor::Low(v) => prec.decode(v, &mut rc.x),
                    }
                    let work = rc.work.work(&mut rc.u);
                    block_forward(&self.ranges.block_rel, params, &mut rc.x, &mut rc.sv, work, d, prec);
                    &rc.sv
                }
                None => &acts.saved[idx],
            };
            let saved = SavedView { sv, x, u: &mut acts.u, v: &mut acts.v, prec };
            block_backward(&self.ranges.block_rel, params, &mut grads, saved, scratch, d);
            store.done(Self::block_seg(idx), true)?;
        }
        if prec == Precision::F16 {
            prec.round(&mut self.acts.scratch.dres);
        }
        {
            let SegmentView { mut grads, .. } = store.segment(0)?;
            let (gwte, gwpe) = grads.pair(wte, wpe);
            // The embeddings' gradient is only ever added to.
            let (gwte, gwpe) = (gwte.map(GradOut::for_adding), gwpe.map(GradOut::for_adding));
            kernels::encoder_backward(gwte, gwpe, &self.acts.scratch.dres, inputs, t, c);
        }
        store.done(0, true)?;
        Ok(())
    }

    /// Sums the per-row losses in row order (f64, deterministic).
    fn loss_sum(&self, n: usize) -> f64 {
        self.acts.losses[..n].iter().map(|&l| l as f64).sum()
    }

    /// Logits of the last position of `tokens` (one sequence), for sampling.
    pub fn next_token_logits(&mut self, params: &[f32], tokens: &[u32]) -> Result<Vec<f32>, GptError> {
        let t = tokens.len();
        let batch = Batch { n_seqs: 1, seq_len: t, inputs: tokens.to_vec(), targets: vec![IGNORE_INDEX; t] };
        self.check(&batch)?;
        self.ensure_acts(1, t);
        let mut store = FullStore::read_only(&self.layout, self.segments(), params)?;
        self.forward(&mut store, tokens)?;
        store.done(0, false)?;
        let v = self.cfg.vocab_size;
        Ok(self.acts.logits[(t - 1) * v..t * v].to_vec())
    }
}

impl Model for Gpt {
    type Batch = Batch;
    type Error = GptError;

    fn layout(&self) -> &ParamLayout {
        &self.layout
    }

    /// A frozen tensor's weight-gradient computation is skipped.
    fn set_trainable(&mut self, trainable: &dyn Fn(&engine::TensorSpec) -> bool) -> usize {
        self.layout.set_trainable(trainable)
    }

    fn segments(&self) -> Vec<Range<usize>> {
        let r = &self.ranges;
        std::iter::once(r.wte.start..r.wpe.end)
            .chain(r.blocks.iter().map(|b| b.span()))
            .chain(std::iter::once(r.lnf_w.start..r.lnf_b.end))
            .collect()
    }

    fn n_targets(&self, batch: &Batch) -> u64 {
        batch.n_targets()
    }

    /// A batch of zero sequences (a rank without data in the tail) runs the
    /// same code on zero rows: the same segment visits and collectives as
    /// every other rank, and a zero gradient.
    fn micro_step(
        &mut self,
        store: &mut dyn ParamStore,
        batch: &Batch,
        grad_scale: f32,
    ) -> Result<MicroStepStats, GptError> {
        self.check(batch)?;
        self.ensure_acts(batch.n_seqs, batch.seq_len);
        let n = batch.n_seqs * batch.seq_len;
        self.forward(store, &batch.inputs)?;
        kernels::softmax_cross_entropy(
            &mut self.acts.logits,
            &mut self.acts.losses,
            &batch.targets,
            self.cfg.vocab_size,
            Some(grad_scale),
        );
        let loss_sum = self.loss_sum(n);
        self.backward(store, &batch.inputs)?;
        Ok(MicroStepStats { loss_sum, n_targets: batch.n_targets() })
    }

    fn loss(&mut self, store: &mut dyn ParamStore, batch: &Batch) -> Result<MicroStepStats, GptError> {
        self.check(batch)?;
        self.ensure_acts(batch.n_seqs, batch.seq_len);
        self.forward(store, &batch.inputs)?;
        store.done(0, false)?;
        let n = batch.n_seqs * batch.seq_len;
        kernels::softmax_cross_entropy(
            &mut self.acts.logits,
            &mut self.acts.losses,
            &batch.targets,
            self.cfg.vocab_size,
            None,
        );
        Ok(MicroStepStats { loss_sum: self.loss_sum(n), n_targets: batch.n_targets() })
    }
}
