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
use engine::{MicroStepStats, Model, ParamLayout};
use std::ops::Range;

/// Targets below zero are ignored (PyTorch's `ignore_index = -100`).
pub const IGNORE_INDEX: i32 = -100;

/// One micro-batch of token sequences.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Batch {
    /// Number of sequences B (0 is allowed: a rank without data).
    pub n_seqs: usize,
    /// Sequence length T.
    pub seq_len: usize,
    /// `B·T` input tokens, row-major.
    pub inputs: Vec<u32>,
    /// `B·T` targets; negative values are ignored.
    pub targets: Vec<i32>,
}

impl Batch {
    /// Number of targets that count.
    pub fn n_targets(&self) -> u64 {
        self.targets.iter().filter(|&&t| t >= 0).count() as u64
    }
}

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
    (l, ParamRanges { wte, wpe, blocks, lnf_w, lnf_b })
}

/// GPT-2 initialisation: N(0, 0.02) for matrices and embeddings, residual
/// projections scaled by 1/√(2·n_layer), zero biases, unit LayerNorm gains.
pub fn init_params(cfg: &GptConfig, seed: u64) -> Vec<f32> {
    let (layout, ranges) = build_layout(cfg);
    let mut params = vec![0.0f32; layout.n_params()];
    let mut rng = SplitMix64::derive(seed, &[0x1a17]);
    let resid_std = 0.02 / (2.0 * cfg.n_layer as f64).sqrt();
    let mut fill = |r: Range<usize>, std: f64| params[r].iter_mut().for_each(|p| *p = (rng.normal() * std) as f32);
    fill(ranges.wte.clone(), 0.02);
    fill(ranges.wpe.clone(), 0.02);
    for b in &ranges.blocks {
        fill(b.attn_w.clone(), 0.02);
        fill(b.proj_w.clone(), resid_std);
        fill(b.fc_w.clone(), 0.02);
        fill(b.fcproj_w.clone(), resid_std);
    }
    for b in &ranges.blocks {
        params[b.ln1_w.clone()].fill(1.0);
        params[b.ln2_w.clone()].fill(1.0);
    }
    params[ranges.lnf_w.clone()].fill(1.0);
    params
}

/// Saved activations of one block.
#[derive(Debug, Default)]
struct BlockActs {
    ln1: Vec<f32>,
    ln1_mean: Vec<f32>,
    ln1_rstd: Vec<f32>,
    qkv: Vec<f32>,
    att: Vec<f32>,
    atty: Vec<f32>,
    res2: Vec<f32>,
    ln2: Vec<f32>,
    ln2_mean: Vec<f32>,
    ln2_rstd: Vec<f32>,
    fch: Vec<f32>,
    fch_gelu: Vec<f32>,
    res3: Vec<f32>,
}

/// Activations and backward scratch for one (B, T).
#[derive(Debug, Default)]
struct Acts {
    b: usize,
    t: usize,
    encoded: Vec<f32>,
    blocks: Vec<BlockActs>,
    lnf: Vec<f32>,
    lnf_mean: Vec<f32>,
    lnf_rstd: Vec<f32>,
    logits: Vec<f32>,
    losses: Vec<f32>,
    dres: Vec<f32>,
    dbuf_c: Vec<f32>,
    dbuf_4c: Vec<f32>,
    dqkv: Vec<f32>,
    datt: Vec<f32>,
}

impl Acts {
    fn new(cfg: &GptConfig, b: usize, t: usize) -> Self {
        let (c, nh, v) = (cfg.n_embd, cfg.n_head, cfg.vocab_size);
        let bt = b * t;
        let z = |n: usize| vec![0.0f32; n];
        let blocks = (0..cfg.n_layer)
            .map(|_| BlockActs {
                ln1: z(bt * c),
                ln1_mean: z(bt),
                ln1_rstd: z(bt),
                qkv: z(bt * 3 * c),
                att: z(b * nh * t * t),
                atty: z(bt * c),
                res2: z(bt * c),
                ln2: z(bt * c),
                ln2_mean: z(bt),
                ln2_rstd: z(bt),
                fch: z(bt * 4 * c),
                fch_gelu: z(bt * 4 * c),
                res3: z(bt * c),
            })
            .collect();
        Self {
            b,
            t,
            encoded: z(bt * c),
            blocks,
            lnf: z(bt * c),
            lnf_mean: z(bt),
            lnf_rstd: z(bt),
            logits: z(bt * v),
            losses: z(bt),
            dres: z(bt * c),
            dbuf_c: z(bt * c),
            dbuf_4c: z(bt * 4 * c),
            dqkv: z(bt * 3 * c),
            datt: z(b * nh * t * t),
        }
    }

    /// Bytes held (activations and scratch), for memory accounting.
    fn bytes(&self) -> usize {
        let block: usize = self
            .blocks
            .iter()
            .map(|a| {
                [
                    &a.ln1,
                    &a.ln1_mean,
                    &a.ln1_rstd,
                    &a.qkv,
                    &a.att,
                    &a.atty,
                    &a.res2,
                    &a.ln2,
                    &a.ln2_mean,
                    &a.ln2_rstd,
                    &a.fch,
                    &a.fch_gelu,
                    &a.res3,
                ]
                .iter()
                .map(|v| v.len())
                .sum::<usize>()
            })
            .sum();
        let rest = [
            &self.encoded,
            &self.lnf,
            &self.lnf_mean,
            &self.lnf_rstd,
            &self.logits,
            &self.losses,
            &self.dres,
            &self.dbuf_c,
            &self.dbuf_4c,
            &self.dqkv,
            &self.datt,
        ]
        .iter()
        .map(|v| v.len())
        .sum::<usize>();
        4 * (block + rest)
    }
}

/// Two disjoint mutable ranges of one buffer (`a` before `b`).
fn two_mut(buf: &mut [f32], a: Range<usize>, b: Range<usize>) -> (&mut [f32], &mut [f32]) {
    assert!(a.end <= b.start, "ranges overlap or are out of order");
    let (lo, hi) = buf.split_at_mut(b.start);
    (&mut lo[a], &mut hi[..b.end - b.start])
}

/// The GPT-2 model with its activation buffers.
#[derive(Debug)]
pub struct Gpt {
    cfg: GptConfig,
    layout: ParamLayout,
    ranges: ParamRanges,
    acts: Acts,
}

impl Gpt {
    /// A model of the given shape (parameters live outside, in a flat buffer).
    pub fn new(cfg: GptConfig) -> Result<Self, GptError> {
        cfg.validate()?;
        let (layout, ranges) = build_layout(&cfg);
        Ok(Self { cfg, layout, ranges, acts: Acts::default() })
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

    fn check(&self, params: &[f32], batch: &Batch) -> Result<(), GptError> {
        let (b, t) = (batch.n_seqs, batch.seq_len);
        if params.len() != self.layout.n_params() {
            return Err(GptError::InvalidBatch(format!(
                "parameter buffer has {} values, the model needs {}",
                params.len(),
                self.layout.n_params()
            )));
        }
        if t == 0 || t > self.cfg.block_size {
            return Err(GptError::InvalidBatch(format!(
                "sequence length {t} must be between 1 and the model's block_size {}",
                self.cfg.block_size
            )));
        }
        if batch.inputs.len() != b * t || batch.targets.len() != b * t {
            return Err(GptError::InvalidBatch(format!(
                "{} inputs and {} targets for {b} sequences of {t} tokens",
                batch.inputs.len(),
                batch.targets.len()
            )));
        }
        let v = self.cfg.vocab_size;
        if let Some(&tok) = batch.inputs.iter().find(|&&x| x as usize >= v) {
            return Err(GptError::InvalidBatch(format!("input token {tok} is outside the vocabulary of {v}")));
        }
        if let Some(&tok) = batch.targets.iter().find(|&&x| x >= 0 && x as usize >= v) {
            return Err(GptError::InvalidBatch(format!("target token {tok} is outside the vocabulary of {v}")));
        }
        Ok(())
    }

    fn ensure_acts(&mut self, b: usize, t: usize) {
        if self.acts.b != b || self.acts.t != t || self.acts.blocks.len() != self.cfg.n_layer {
            self.acts = Acts::new(&self.cfg, b, t);
        }
    }

    /// Forward of block `idx` on the residual stream `x` (the embeddings for
    /// block 0, the previous block's output otherwise).
    pub fn block_forward(&mut self, params: &[f32], idx: usize) {
        let (b, t, c, nh) = (self.acts.b, self.acts.t, self.cfg.n_embd, self.cfg.n_head);
        let n = b * t;
        let p = &self.ranges.blocks[idx];
        let (before, rest) = self.acts.blocks.split_at_mut(idx);
        let x: &[f32] = if idx == 0 { &self.acts.encoded } else { &before[idx - 1].res3 };
        let a = &mut rest[0];
        kernels::layernorm_forward(
            &mut a.ln1,
            &mut a.ln1_mean,
            &mut a.ln1_rstd,
            x,
            &params[p.ln1_w.clone()],
            &params[p.ln1_b.clone()],
            c,
        );
        kernels::matmul_forward(
            &mut a.qkv,
            &a.ln1,
            &params[p.attn_w.clone()],
            Some(&params[p.attn_b.clone()]),
            None,
            n,
            c,
            3 * c,
        );
        kernels::attention_forward(&mut a.atty, &mut a.att, &a.qkv, AttnShape { b, t, c, n_head: nh });
        kernels::matmul_forward(
            &mut a.res2,
            &a.atty,
            &params[p.proj_w.clone()],
            Some(&params[p.proj_b.clone()]),
            Some(x),
            n,
            c,
            c,
        );
        kernels::layernorm_forward(
            &mut a.ln2,
            &mut a.ln2_mean,
            &mut a.ln2_rstd,
            &a.res2,
            &params[p.ln2_w.clone()],
            &params[p.ln2_b.clone()],
            c,
        );
        kernels::matmul_forward(
            &mut a.fch,
            &a.ln2,
            &params[p.fc_w.clone()],
            Some(&params[p.fc_b.clone()]),
            None,
            n,
            c,
            4 * c,
        );
        kernels::gelu_forward(&mut a.fch_gelu, &a.fch);
        kernels::matmul_forward(
            &mut a.res3,
            &a.fch_gelu,
            &params[p.fcproj_w.clone()],
            Some(&params[p.fcproj_b.clone()]),
            Some(&a.res2),
            n,
            4 * c,
            c,
        );
    }

    /// Backward of block `idx`: on entry the scratch `dres` holds the gradient
    /// of the block's output; on exit, of its input. Adds into `grads`.
    pub fn block_backward(&mut self, params: &[f32], grads: &mut [f32], idx: usize) {
        let (b, t, c, nh) = (self.acts.b, self.acts.t, self.cfg.n_embd, self.cfg.n_head);
        let n = b * t;
        let p = &self.ranges.blocks[idx];
        let acts = &mut self.acts;
        let x: &[f32] = if idx == 0 { &acts.encoded } else { &acts.blocks[idx - 1].res3 };
        let a = &acts.blocks[idx];
        let (dres, dc, d4c, dqkv, datt) =
            (&mut acts.dres, &mut acts.dbuf_c, &mut acts.dbuf_4c, &mut acts.dqkv, &mut acts.datt);

        let (gw, gb) = two_mut(grads, p.fcproj_w.clone(), p.fcproj_b.clone());
        kernels::matmul_backward(d4c, gw, Some(gb), dres, &a.fch_gelu, &params[p.fcproj_w.clone()], n, 4 * c, c);
        kernels::gelu_backward_inplace(d4c, &a.fch);
        let (gw, gb) = two_mut(grads, p.fc_w.clone(), p.fc_b.clone());
        kernels::matmul_backward(dc, gw, Some(gb), d4c, &a.ln2, &params[p.fc_w.clone()], n, c, 4 * c);
        let (gw, gb) = two_mut(grads, p.ln2_w.clone(), p.ln2_b.clone());
        kernels::layernorm_backward(dres, gw, gb, dc, &a.res2, &a.ln2_mean, &a.ln2_rstd, &params[p.ln2_w.clone()], c);
        let (gw, gb) = two_mut(grads, p.proj_w.clone(), p.proj_b.clone());
        kernels::matmul_backward(dc, gw, Some(gb), dres, &a.atty, &params[p.proj_w.clone()], n, c, c);
        kernels::attention_backward(dqkv, datt, dc, &a.qkv, &a.att, AttnShape { b, t, c, n_head: nh });
        let (gw, gb) = two_mut(grads, p.attn_w.clone(), p.attn_b.clone());
        kernels::matmul_backward(dc, gw, Some(gb), dqkv, &a.ln1, &params[p.attn_w.clone()], n, c, 3 * c);
        let (gw, gb) = two_mut(grads, p.ln1_w.clone(), p.ln1_b.clone());
        kernels::layernorm_backward(dres, gw, gb, dc, x, &a.ln1_mean, &a.ln1_rstd, &params[p.ln1_w.clone()], c);
    }

    /// Forward through the final LayerNorm and the tied head into `logits`.
    fn forward(&mut self, params: &[f32], inputs: &[u32]) {
        let (t, c, v) = (self.acts.t, self.cfg.n_embd, self.cfg.vocab_size);
        let n = self.acts.b * t;
        let (wte, wpe) = (self.ranges.wte.clone(), self.ranges.wpe.clone());
        kernels::encoder_forward(&mut self.acts.encoded, inputs, &params[wte], &params[wpe], t, c);
        for idx in 0..self.cfg.n_layer {
            self.block_forward(params, idx);
        }
        let r = &self.ranges;
        let acts = &mut self.acts;
        let last: &[f32] = acts.blocks.last().map_or(&acts.encoded, |a| &a.res3);
        kernels::layernorm_forward(
            &mut acts.lnf,
            &mut acts.lnf_mean,
            &mut acts.lnf_rstd,
            last,
            &params[r.lnf_w.clone()],
            &params[r.lnf_b.clone()],
            c,
        );
        // logits = lnf · wteᵀ (the head is tied to the token embedding).
        kernels::gemm_into(
            n,
            v,
            c,
            &mut acts.logits,
            0,
            v,
            false,
            Strided::rows(&acts.lnf, c),
            Strided::transposed(&params[r.wte.clone()], c),
            1.0,
            kernels::parallelism(false),
        );
    }

    /// Backward from `dlogits` (held in `logits`) to every parameter.
    fn backward(&mut self, params: &[f32], grads: &mut [f32], inputs: &[u32]) {
        let (t, c, v) = (self.acts.t, self.cfg.n_embd, self.cfg.vocab_size);
        let n = self.acts.b * t;
        let r = self.ranges.clone();
        {
            let acts = &mut self.acts;
            let par = kernels::parallelism(false);
            // dlnf = dlogits · wte ; dwte += dlogitsᵀ · lnf
            kernels::gemm_into(
                n,
                c,
                v,
                &mut acts.dbuf_c,
                0,
                c,
                false,
                Strided::rows(&acts.logits, v),
                Strided::rows(&params[r.wte.clone()], c),
                1.0,
                par,
            );
            kernels::gemm_into(
                v,
                c,
                n,
                &mut grads[r.wte.clone()],
                0,
                c,
                true,
                Strided::transposed(&acts.logits, v),
                Strided::rows(&acts.lnf, c),
                1.0,
                par,
            );
            let last: &[f32] = acts.blocks.last().map_or(&acts.encoded, |a| &a.res3);
            acts.dres.fill(0.0);
            let (gw, gb) = two_mut(grads, r.lnf_w.clone(), r.lnf_b.clone());
            kernels::layernorm_backward(
                &mut acts.dres,
                gw,
                gb,
                &acts.dbuf_c,
                last,
                &acts.lnf_mean,
                &acts.lnf_rstd,
                &params[r.lnf_w.clone()],
                c,
            );
        }
        for idx in (0..self.cfg.n_layer).rev() {
            self.block_backward(params, grads, idx);
        }
        let (gwte, gwpe) = two_mut(grads, r.wte.clone(), r.wpe.clone());
        kernels::encoder_backward(gwte, gwpe, &self.acts.dres, inputs, t, c);
    }

    /// Sums the per-row losses in row order (f64, deterministic).
    fn loss_sum(&self, n: usize) -> f64 {
        self.acts.losses[..n].iter().map(|&l| l as f64).sum()
    }

    /// Logits of the last position of `tokens` (one sequence), for sampling.
    pub fn next_token_logits(&mut self, params: &[f32], tokens: &[u32]) -> Result<Vec<f32>, GptError> {
        let t = tokens.len();
        let batch = Batch { n_seqs: 1, seq_len: t, inputs: tokens.to_vec(), targets: vec![IGNORE_INDEX; t] };
        self.check(params, &batch)?;
        self.ensure_acts(1, t);
        self.forward(params, tokens);
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

    fn n_targets(&self, batch: &Batch) -> u64 {
        batch.n_targets()
    }

    fn micro_step(
        &mut self,
        params: &[f32],
        grads: &mut [f32],
        batch: &Batch,
        grad_scale: f32,
    ) -> Result<MicroStepStats, GptError> {
        if batch.n_seqs == 0 {
            return Ok(MicroStepStats::default());
        }
        self.check(params, batch)?;
        if grads.len() != params.len() {
            return Err(GptError::InvalidBatch(format!(
                "gradient buffer has {} values, parameters {}",
                grads.len(),
                params.len()
            )));
        }
        self.ensure_acts(batch.n_seqs, batch.seq_len);
        self.forward(params, &batch.inputs);
        let n = batch.n_seqs * batch.seq_len;
        kernels::softmax_cross_entropy(
            &mut self.acts.logits,
            &mut self.acts.losses,
            &batch.targets,
            self.cfg.vocab_size,
            Some(grad_scale),
        );
        let loss_sum = self.loss_sum(n);
        self.backward(params, grads, &batch.inputs);
        Ok(MicroStepStats { loss_sum, n_targets: batch.n_targets() })
    }

    fn loss(&mut self, params: &[f32], batch: &Batch) -> Result<MicroStepStats, GptError> {
        if batch.n_seqs == 0 {
            return Ok(MicroStepStats::default());
        }
        self.check(params, batch)?;
        self.ensure_acts(batch.n_seqs, batch.seq_len);
        self.forward(params, &batch.inputs);
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
