//! GPT-2's parameters: Hugging Face names and `Conv1D` layouts in one
//! flat buffer (with LoRA adapters at the end of each block, when the
//! model has them), and their initialisation.

use crate::config::GptConfig;
use engine::rng::SplitMix64;
use engine::ParamLayout;
use nn::lora::{Targets, MAGNITUDE};
use std::ops::Range;

/// The block's four linear layers (`Conv1D`, weights `[in, out]`), in
/// block order: the index of each in [`BlockParams::lora`].
pub const CONVS: [&str; 4] = ["attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"];

/// The block's linear layers as PEFT's `target_modules` names them: a
/// name matches the end of a module's path, so `c_proj` is both the
/// attention's and the MLP's output projection (PEFT's meaning too);
/// `all-linear` is all four. `Conv1D` weights: `fan_in_fan_out` on.
pub const TARGETS: Targets = Targets {
    modules: &[("c_attn", &[0]), ("c_proj", &[1, 3]), ("c_fc", &[2]), ("attn.c_proj", &[1]), ("mlp.c_proj", &[3])],
    n: 4,
    fan_in_fan_out: true,
};

/// Which linear layers carry LoRA adapters, and their rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Adapters {
    pub r: usize,
    /// Indexed as [`CONVS`].
    pub targets: [bool; 4],
    /// DoRA: a magnitude per output feature of each adapted layer.
    pub dora: bool,
    /// LoRA dropout on the adapters' inputs (training passes).
    pub dropout: bool,
}

/// Element ranges of one LoRA adapter in a block.
pub use nn::lora::LoraRanges;

/// `[in, out]` of linear layer `i` (as [`CONVS`]) at widths `w`.
pub(crate) fn conv_shape(i: usize, c: usize, w: Widths) -> [usize; 2] {
    let Widths { a, m, .. } = w;
    [[c, 3 * a], [a, c], [c, m], [m, c]][i]
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
    /// The LoRA adapter of each linear layer (as [`CONVS`]), if it has one.
    pub lora: [Option<LoraRanges>; 4],
}

impl BlockParams {
    /// The contiguous range the whole block occupies (its adapters last).
    pub fn span(&self) -> Range<usize> {
        let end = self
            .lora
            .iter()
            .flatten()
            .map(|l| l.m.as_ref().map_or(l.b.end, |m| m.end))
            .max()
            .unwrap_or(self.fcproj_b.end);
        self.ln1_w.start..end
    }
}

/// Element ranges of all parameters.
#[derive(Debug, Clone)]
pub(crate) struct ParamRanges {
    pub wte: Range<usize>,
    pub wpe: Range<usize>,
    pub blocks: Vec<BlockParams>,
    /// One block's ranges relative to the block's first parameter (every block alike).
    pub block_rel: BlockParams,
    pub lnf_w: Range<usize>,
    pub lnf_b: Range<usize>,
}

/// The widths of a block as one tensor-parallel rank holds it: its
/// attention heads' width `a` (C / T), its MLP width `m` (4C / T) and its
/// vocabulary rows `v` (V / T where the vocabulary is split) — C, 4C and
/// V for the whole model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Widths {
    pub a: usize,
    pub m: usize,
    /// Vocabulary rows of the token embedding (V, or V / T split by vocabulary).
    pub v: usize,
}

impl Widths {
    /// The widths of rank `tp` (whole at `TpRank::WHOLE`); T divides n_head.
    pub fn of(cfg: &GptConfig, tp: engine::TpRank) -> Self {
        Widths { a: cfg.n_embd / tp.size, m: 4 * cfg.n_embd / tp.size, v: tp.vocab_rows(cfg.vocab_size).len() }
    }

    /// The whole model's widths: C and 4C.
    pub fn whole(cfg: &GptConfig) -> Self {
        Self::of(cfg, engine::TpRank::WHOLE)
    }
}

/// The layout of a model at widths `w` with `adapters`; `packed`: the
/// four `Conv1D` weights of every block left out (a frozen base held
/// packed, [`crate::FrozenBase`]), their ranges empty.
pub(crate) fn build_layout(
    cfg: &GptConfig,
    w: Widths,
    adapters: Option<Adapters>,
    packed: bool,
) -> (ParamLayout, ParamRanges) {
    let c = cfg.n_embd;
    let Widths { a, m, .. } = w;
    let mut l = ParamLayout::new();
    let weight = |l: &mut ParamLayout, name: String, shape: &[usize]| match packed {
        true => l.n_params()..l.n_params(),
        false => l.push(name, shape, true),
    };
    let wte = l.push("transformer.wte.weight", &[w.v, c], true);
    let wpe = l.push("transformer.wpe.weight", &[cfg.block_size, c], true);
    let blocks = (0..cfg.n_layer)
        .map(|i| {
            let p = format!("transformer.h.{i}");
            BlockParams {
                ln1_w: l.push(format!("{p}.ln_1.weight"), &[c], false),
                ln1_b: l.push(format!("{p}.ln_1.bias"), &[c], false),
                attn_w: weight(&mut l, format!("{p}.attn.c_attn.weight"), &[c, 3 * a]),
                attn_b: l.push(format!("{p}.attn.c_attn.bias"), &[3 * a], false),
                proj_w: weight(&mut l, format!("{p}.attn.c_proj.weight"), &[a, c]),
                proj_b: l.push(format!("{p}.attn.c_proj.bias"), &[c], false),
                ln2_w: l.push(format!("{p}.ln_2.weight"), &[c], false),
                ln2_b: l.push(format!("{p}.ln_2.bias"), &[c], false),
                fc_w: weight(&mut l, format!("{p}.mlp.c_fc.weight"), &[c, m]),
                fc_b: l.push(format!("{p}.mlp.c_fc.bias"), &[m], false),
                fcproj_w: weight(&mut l, format!("{p}.mlp.c_proj.weight"), &[m, c]),
                fcproj_b: l.push(format!("{p}.mlp.c_proj.bias"), &[c], false),
                lora: std::array::from_fn(|i| {
                    let a = adapters.filter(|a| a.targets[i])?;
                    let [inp, out] = conv_shape(i, c, w);
                    let a_range = l.push(format!("{p}.{}.lora_A.weight", CONVS[i]), &[a.r, inp], true);
                    let b = l.push(format!("{p}.{}.lora_B.weight", CONVS[i]), &[out, a.r], true);
                    let m = a.dora.then(|| l.push(format!("{p}.{}.{MAGNITUDE}", CONVS[i]), &[out], false));
                    Some(LoraRanges { a: a_range, b, m })
                }),
            }
        })
        .collect();
    let lnf_w = l.push("transformer.ln_f.weight", &[c], false);
    let lnf_b = l.push("transformer.ln_f.bias", &[c], false);
    let block_rel = relative_block(c, w, adapters, packed);
    (l, ParamRanges { wte, wpe, blocks, block_rel, lnf_w, lnf_b })
}

/// One block's parameter ranges relative to its first parameter (`packed`:
/// no `Conv1D` weights).
fn relative_block(c: usize, w: Widths, adapters: Option<Adapters>, packed: bool) -> BlockParams {
    let Widths { a, m, .. } = w;
    let mut at = 0;
    let mut next = |n: usize| {
        let r = at..at + n;
        at += n;
        r
    };
    BlockParams {
        ln1_w: next(c),
        ln1_b: next(c),
        attn_w: next(if packed { 0 } else { 3 * a * c }),
        attn_b: next(3 * a),
        proj_w: next(if packed { 0 } else { a * c }),
        proj_b: next(c),
        ln2_w: next(c),
        ln2_b: next(c),
        fc_w: next(if packed { 0 } else { m * c }),
        fc_b: next(m),
        fcproj_w: next(if packed { 0 } else { m * c }),
        fcproj_b: next(c),
        lora: std::array::from_fn(|i| {
            let a = adapters.filter(|a| a.targets[i])?;
            let [inp, out] = conv_shape(i, c, w);
            Some(LoraRanges { a: next(a.r * inp), b: next(out * a.r), m: a.dora.then(|| next(out)) })
        }),
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
    let r = relative_block(c, Widths::whole(cfg), None, false);
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

/// [`init_segment`] of a model with `adapters`: the base's values (the
/// same whether adapters exist), then each adapter as PEFT starts it —
/// `lora_A` Kaiming-uniform (`nn.Linear`'s default, bound 1/√in) from a
/// stream of its own, `lora_B` zero, so the model computes the base's
/// function. `packed`: a block without its `Conv1D` weights (DoRA's
/// magnitudes still those of the random ones).
pub(crate) fn init_segment_with(
    cfg: &GptConfig,
    (adapters, packed): (Option<Adapters>, bool),
    seed: u64,
    seg: usize,
) -> Vec<f32> {
    let mut v = init_segment(cfg, seed, seg);
    if !(1..=cfg.n_layer).contains(&seg) {
        return v;
    }
    let r = relative_block(cfg.n_embd, Widths::whole(cfg), adapters, false);
    if let Some(ad) = adapters {
        v.extend(init_adapters(cfg, ad, seed, seg - 1));
        init_magnitudes(&r, &mut v, None);
    }
    if packed {
        for w in [&r.fcproj_w, &r.fc_w, &r.proj_w, &r.attn_w] {
            v.drain(w.clone());
        }
    }
    v
}

/// DoRA's magnitudes in a block's values `v` (ranges `r` relative to
/// the block, whole widths): each output feature's weight norm — a column
/// of the `Conv1D` weight `[in, out]`, as PEFT's `fan_in_fan_out` reads
/// it, or a row of the block's packed `base` layers `[out, in]` — so the
/// adapted model starts as the base.
pub(crate) fn init_magnitudes(r: &BlockParams, v: &mut [f32], base: Option<&[nn::linear::PackedMatrix; 4]>) {
    let weights = [&r.attn_w, &r.proj_w, &r.fc_w, &r.fcproj_w];
    for (i, lr) in r.lora.iter().enumerate() {
        let Some(m) = lr.as_ref().and_then(|l| l.m.clone()) else { continue };
        let out = m.len();
        let mut mags = vec![0.0f32; out];
        match base {
            Some(convs) => {
                let w = &convs[i];
                let rows = |rows: Range<usize>| nn::proj::Frozen::rows(w, rows);
                nn::dora::initial_magnitude([out, w.cols()], &rows, &mut mags);
            }
            None => {
                let inp = weights[i].len() / out.max(1);
                let w = &v[weights[i].clone()];
                let cols = |rows: Range<usize>| rows.flat_map(|j| (0..inp).map(move |k| w[k * out + j])).collect();
                nn::dora::initial_magnitude([out, inp], &cols, &mut mags);
            }
        }
        v[m].copy_from_slice(&mags);
    }
}

/// The initial adapters of block `idx` (its segment's tail): each `lora_A`
/// then `lora_B`, in [`CONVS`] order.
pub(crate) fn init_adapters(cfg: &GptConfig, ad: Adapters, seed: u64, idx: usize) -> Vec<f32> {
    let w = Widths::whole(cfg);
    let mut v = Vec::new();
    for (i, _) in ad.targets.iter().enumerate().filter(|(_, on)| **on) {
        let [inp, out] = conv_shape(i, cfg.n_embd, w);
        let mut rng = SplitMix64::derive(seed, &[0x10ba, idx as u64, i as u64]);
        v.extend(nn::lora::kaiming_uniform(&mut rng, ad.r * inp, inp));
        v.extend(std::iter::repeat_n(0.0, out * ad.r));
        // DoRA's magnitudes: set from the base by [`init_magnitudes`].
        v.extend(std::iter::repeat_n(0.0, if ad.dora { out } else { 0 }));
    }
    v
}
