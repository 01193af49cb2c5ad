//! Llama's parameters: `LlamaForCausalLM`'s names and shapes (`nn.Linear`
//! weights `[out, in]`, optional q/k/v biases) in one flat buffer, with
//! LoRA adapters inside their layer.

use crate::config::LlamaConfig;
use crate::error::LlamaError;
use engine::ParamLayout;
use nn::lora::{LoraConfig, Targets};
use std::ops::Range;

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

    /// The projections one adapter at `self` spans: itself, or with
    /// `fused` modules (Phi-3's) the group it heads — q|k|v at Q, gate|up
    /// at Gate — and none at the group's other members.
    pub fn adapted(self, fused: bool) -> &'static [Proj] {
        let i = self as usize;
        match self.fused_in(fused) {
            Some(f) if f.parts[0] == self => f.parts,
            Some(_) => &[],
            None => &Proj::ALL[i..i + 1],
        }
    }

    /// The fused module (of [`QKV_AND_GATE_UP`]) `self` is part of, with
    /// `fused` modules.
    fn fused_in(self, fused: bool) -> Option<&'static Fused> {
        const GROUPS: &[Fused] = &QKV_AND_GATE_UP;
        GROUPS.iter().find(|f| fused && f.parts.contains(&self))
    }

    /// `[Σ out, in]` of what an adapter at `self` spans ([`Proj::adapted`]),
    /// and its module's path (`self_attn.qkv_proj` for a fused q|k|v).
    pub fn adapter_shape(self, cfg: &LlamaConfig) -> ([usize; 2], String) {
        let out = self.adapted(cfg.fused_modules).iter().map(|p| p.shape(cfg)[0]).sum();
        let path = self.fused_in(cfg.fused_modules).map_or_else(|| self.path(), |f| f.module.to_string());
        ([out, self.shape(cfg)[1]], path)
    }

    /// The projection called `name` (`q_proj`, ...).
    pub fn from_name(name: &str) -> Option<Proj> {
        Proj::ALL.into_iter().find(|p| p.name() == name)
    }
}

/// A weight a family's files store fused: the module's `[Σ out, in]`
/// weight is its parts' weights stacked in order, which the layout keeps
/// back to back (q|k|v and gate|up are each one matrix there too), so the
/// fused tensor is one range of the parameters and reading or writing it
/// copies nothing. Phi-3 stores `self_attn.qkv_proj` and `mlp.gate_up_proj`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fused {
    /// The module inside a layer (`self_attn.qkv_proj`).
    pub module: &'static str,
    /// llama.cpp's name of its weight inside a block (`attn_qkv`).
    pub gguf: &'static str,
    /// The projections stacked in it, in order.
    pub parts: &'static [Proj],
}

/// Phi-3's fused projections: q|k|v (`qkv_proj`, llama.cpp's `attn_qkv`)
/// and gate|up (`gate_up_proj`, llama.cpp's `ffn_up`, whose first half
/// its SwiGLU gates, as transformers' `chunk(2)` does).
pub const QKV_AND_GATE_UP: [Fused; 2] = [
    Fused { module: "self_attn.qkv_proj", gguf: "attn_qkv", parts: &[Proj::Q, Proj::K, Proj::V] },
    Fused { module: "mlp.gate_up_proj", gguf: "ffn_up", parts: &[Proj::Gate, Proj::Up] },
];

impl LlamaConfig {
    /// The weights this shape's files store fused: [`QKV_AND_GATE_UP`]
    /// with `fused_modules` (Phi-3), none otherwise.
    pub fn fused_weights(&self) -> &'static [Fused] {
        const GROUPS: &[Fused] = &QKV_AND_GATE_UP;
        if self.fused_modules {
            GROUPS
        } else {
            &[]
        }
    }
}

/// A tensor as a file stores it: name, row-major shape, its range of the parameters.
pub type StoredTensor = (String, Vec<usize>, Range<usize>);

/// `(layer, fused)` when `name` is a fused weight of `fused`
/// (`model.layers.3.self_attn.qkv_proj.weight`).
pub fn fused_weight(name: &str, fused: &[Fused]) -> Option<(usize, Fused)> {
    let (layer, rest) = in_layer(name)?;
    let f = fused.iter().find(|f| rest.strip_suffix(".weight") == Some(f.module))?;
    Some((layer, *f))
}

/// `(layer, rest)` of `model.layers.{layer}.{rest}`.
pub(crate) fn in_layer(name: &str) -> Option<(usize, &str)> {
    let (layer, rest) = name.strip_prefix("model.layers.")?.split_once('.')?;
    Some((layer.parse().ok()?, rest))
}

/// The layout names of `f`'s parts in `layer` (`model.layers.3.self_attn.q_proj.weight`, …).
pub fn part_names(layer: usize, f: Fused) -> Vec<String> {
    f.parts.iter().map(|p| format!("model.layers.{layer}.{}.weight", p.path())).collect()
}

/// `tensors` (layout order) as a family with `fused` weights stores them:
/// each run of a fused weight's parts becomes the one fused tensor. The
/// parts must follow each other with adjacent ranges (every layout of
/// `build_layout` without a packed base keeps them so); otherwise the
/// name of the first part that does not is returned.
pub fn stored_as(tensors: Vec<StoredTensor>, fused: &[Fused]) -> Result<Vec<StoredTensor>, String> {
    let mut out = Vec::with_capacity(tensors.len());
    let mut it = tensors.into_iter().peekable();
    while let Some((name, shape, range)) = it.next() {
        let first = in_layer(&name).and_then(|(layer, rest)| {
            let f = fused.iter().find(|f| rest.strip_suffix(".weight") == Some(f.parts[0].path().as_str()))?;
            Some((layer, *f))
        });
        let Some((layer, f)) = first else {
            out.push((name, shape, range));
            continue;
        };
        let (mut rows, mut end) = (shape[0], range.end);
        for part in &part_names(layer, f)[1..] {
            match it.next() {
                Some((n, s, r)) if &n == part && r.start == end && s[1..] == shape[1..] => {
                    rows += s[0];
                    end = r.end;
                }
                _ => return Err(part.clone()),
            }
        }
        let mut fused_shape = shape;
        fused_shape[0] = rows;
        out.push((format!("model.layers.{layer}.{}.weight", f.module), fused_shape, range.start..end));
    }
    Ok(out)
}

/// Element ranges of one LoRA adapter (and DoRA magnitude) in a layer.
pub use nn::lora::LoraRanges;

/// Element ranges of one decoder layer's parameters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerParams {
    /// `input_layernorm.weight` `[C]`.
    pub attn_norm: Range<usize>,
    /// The projections' weights, indexed by [`Proj`] (q, k, v back to back,
    /// and gate, up: each group is one `[Σ out, in]` matrix).
    pub proj: [Range<usize>; 7],
    /// `self_attn.{q,k,v}_proj.bias` back to back (one `[Σ out]` vector,
    /// the columns of the fused q|k|v output), with `attention_bias`.
    pub qkv_bias: Option<[Range<usize>; 3]>,
    /// `self_attn.q_norm.weight` and `self_attn.k_norm.weight` `[d]` (one
    /// gain for every query head, one for every key head), with `qk_norm`.
    pub qk_norm: Option<[Range<usize>; 2]>,
    /// The norm before the MLP `[C]`: `post_attention_layernorm.weight`
    /// (Gemma's `pre_feedforward_layernorm.weight`).
    pub mlp_norm: Range<usize>,
    /// Gemma's norms of the attention's and the MLP's outputs before they
    /// join the residual `[C]` each: `post_attention_layernorm.weight` and
    /// `post_feedforward_layernorm.weight`.
    pub post_norms: Option<[Range<usize>; 2]>,
    /// LoRA adapters of the targeted projections, after the base tensors.
    pub lora: [Option<LoraRanges>; 7],
    /// A mixture of experts in place of the MLP (gate, up and down's
    /// ranges in `proj` are then empty).
    pub moe: Option<MoeParams>,
}

/// Element ranges of one layer's mixture of experts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MoeParams {
    /// The router `[E, C]`.
    pub router: Range<usize>,
    /// The experts back to back, each gate `[F, C]`, up `[F, C]`, down `[C, F]`.
    pub experts: Range<usize>,
    /// The shared expert: gate `[Fs, C]`, up `[Fs, C]`, down `[C, Fs]`, its gate `[1, C]`.
    pub shared: Option<[Range<usize>; 4]>,
}

impl MoeParams {
    /// Expert `e`'s gate, up and down weights (gate | up one `[2f, c]`
    /// matrix), each expert `3·f·c` long.
    pub fn expert(&self, e: usize, (f, c): (usize, usize)) -> [Range<usize>; 3] {
        let at = self.experts.start + e * 3 * f * c;
        [at..at + f * c, at + f * c..at + 2 * f * c, at + 2 * f * c..at + 3 * f * c]
    }

    /// The last element's end.
    fn end(&self) -> usize {
        self.shared.as_ref().map_or(self.experts.end, |s| s[3].end)
    }
}

impl LayerParams {
    /// The weight of projection `p`.
    pub fn w(&self, p: Proj) -> Range<usize> {
        self.proj[p as usize].clone()
    }

    /// The weights an adapter at `p` spans ([`Proj::adapted`]): one
    /// matrix, the group's weights being back to back.
    pub fn adapted_w(&self, p: Proj, fused: bool) -> Range<usize> {
        match p.adapted(fused) {
            [first, .., last] => self.w(*first).start..self.w(*last).end,
            _ => self.w(p),
        }
    }

    /// The contiguous range the whole layer occupies.
    pub fn span(&self) -> Range<usize> {
        let end = self.lora.iter().flatten().map(|l| l.m.as_ref().map_or(l.b.end, |m| m.end)).max();
        let mlp = self.moe.as_ref().map_or(self.proj[6].end, MoeParams::end);
        let end = end.unwrap_or(self.post_norms.as_ref().map_or(mlp, |n| n[1].end));
        self.attn_norm.start..end
    }
}

/// LoRA's shape inside the layout: rank, which projections carry adapters,
/// whether each has a DoRA magnitude, and whether the branch's input is
/// dropped out (a working buffer for the dropped input).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Adapters {
    pub r: usize,
    pub targets: [bool; 7],
    pub dora: bool,
    pub dropout: bool,
}

/// Appends a tensor `(name suffix, shape, decay)` and returns its range.
pub(crate) type Push<'a> = dyn FnMut(&str, &[usize], bool) -> Range<usize> + 'a;

/// Pushes one layer's tensors in layout order. With `packed_base` the
/// projections' weights are held outside the layout ([`crate::FrozenBase`]):
/// their ranges are empty, at the place they would take.
fn push_layer(cfg: &LlamaConfig, adapters: Option<Adapters>, packed_base: bool, push: &mut Push<'_>) -> LayerParams {
    let c = cfg.hidden_size;
    let attn_norm = push("input_layernorm.weight", &[c], false);
    let mut end = attn_norm.end;
    let proj_w = |p: Proj, end: &mut usize, push: &mut Push<'_>| {
        if !packed_base {
            *end = push(&format!("{}.weight", p.path()), &p.shape(cfg), true).end;
            return *end - p.shape(cfg).iter().product::<usize>()..*end;
        }
        *end..*end
    };
    let [q, k, v] = [Proj::Q, Proj::K, Proj::V].map(|p| proj_w(p, &mut end, push));
    // Biases after v's weight, so that q|k|v weights stay one matrix.
    let qkv_bias = cfg
        .attention_bias
        .then(|| [Proj::Q, Proj::K, Proj::V].map(|p| push(&format!("{}.bias", p.path()), &[p.shape(cfg)[0]], false)));
    if let Some([.., vb]) = &qkv_bias {
        end = vb.end;
    }
    let qk_norm = cfg
        .qk_norm
        .then(|| ["q_norm", "k_norm"].map(|s| push(&format!("self_attn.{s}.weight"), &[cfg.head_dim], false)));
    if let Some([_, kn]) = &qk_norm {
        end = kn.end;
    }
    let o = proj_w(Proj::O, &mut end, push);
    let gemma = cfg.gemma.is_some();
    let post_attn = gemma.then(|| push("post_attention_layernorm.weight", &[c], false));
    let mlp_norm =
        push(if gemma { "pre_feedforward_layernorm.weight" } else { "post_attention_layernorm.weight" }, &[c], false);
    end = mlp_norm.end;
    let (mlp, moe) = match &cfg.moe {
        None => ([Proj::Gate, Proj::Up, Proj::Down].map(|p| proj_w(p, &mut end, push)), None),
        Some(m) => {
            let (f, e) = (m.expert_size, m.n_experts);
            let router = push(m.router_name(), &[e, c], true);
            let experts = (0..e)
                .map(|i| {
                    let [g, u, d] = m.expert_names(i);
                    let first = push(&g, &[f, c], true);
                    push(&u, &[f, c], true);
                    first.start..push(&d, &[c, f], true).end
                })
                .reduce(|a, b| a.start..b.end)
                .unwrap_or(router.end..router.end);
            let shared = m.shared_expert_size.map(|fs| {
                let g = push("mlp.shared_expert.gate_proj.weight", &[fs, c], true);
                let u = push("mlp.shared_expert.up_proj.weight", &[fs, c], true);
                let d = push("mlp.shared_expert.down_proj.weight", &[c, fs], true);
                [g, u, d, push("mlp.shared_expert_gate.weight", &[1, c], true)]
            });
            let moe = MoeParams { router, experts, shared };
            end = moe.end();
            ([end..end, end..end, end..end], Some(moe))
        }
    };
    let [gate, up, down] = mlp;
    let post_norms = post_attn.map(|a| [a, push("post_feedforward_layernorm.weight", &[c], false)]);
    let lora = Proj::ALL.map(|p| {
        let a = adapters.filter(|a| a.targets[p as usize])?;
        let ([out, inp], path) = p.adapter_shape(cfg);
        Some(LoraRanges {
            a: push(&format!("{path}.lora_A.weight"), &[a.r, inp], true),
            b: push(&format!("{path}.lora_B.weight"), &[out, a.r], true),
            // A per-feature scale, like a norm's gain: no weight decay.
            m: a.dora.then(|| push(&format!("{path}.{}", nn::lora::MAGNITUDE), &[out], false)),
        })
    });
    LayerParams { attn_norm, proj: [q, k, v, o, gate, up, down], qkv_bias, qk_norm, mlp_norm, post_norms, lora, moe }
}

/// Element ranges of all parameters.
#[derive(Debug, Clone)]
pub(crate) struct ParamRanges {
    pub embed: Range<usize>,
    pub layers: Vec<LayerParams>,
    /// One layer's ranges relative to its first parameter (every layer alike).
    pub layer_rel: LayerParams,
    pub norm: Range<usize>,
    /// `lm_head.weight`, when untied.
    pub head: Option<Range<usize>>,
}

/// The layout of `cfg` with `adapters`; with `packed_base` the projections'
/// weights are not in it (held packed by the model), with `packed_embed`
/// the token embedding neither (its range empty).
pub(crate) fn build_layout(
    cfg: &LlamaConfig,
    adapters: Option<Adapters>,
    (packed_base, packed_embed): (bool, bool),
) -> (ParamLayout, ParamRanges) {
    let (v, c) = (cfg.vocab_size, cfg.hidden_size);
    let mut l = ParamLayout::new();
    let embed = match packed_embed {
        true => 0..0,
        false => l.push("model.embed_tokens.weight", &[v, c], true),
    };
    let layers = (0..cfg.n_layer)
        .map(|i| {
            push_layer(cfg, adapters, packed_base, &mut |s, shape, decay| {
                l.push(format!("model.layers.{i}.{s}"), shape, decay)
            })
        })
        .collect();
    let norm = l.push("model.norm.weight", &[c], false);
    let head = (!cfg.tie_word_embeddings).then(|| l.push("lm_head.weight", &[v, c], true));
    let mut at = 0;
    let layer_rel = push_layer(cfg, adapters, packed_base, &mut |_, shape, _| {
        let n: usize = shape.iter().product();
        at += n;
        at - n..at
    });
    (l, ParamRanges { embed, layers, layer_rel, norm, head })
}

/// Every module name of either kind of block: the Llama block's seven
/// projections, then Phi-3's fused `qkv_proj` and `gate_up_proj` (adapted
/// at their first projection).
const MODULES: [(&str, &[usize]); 9] = [
    ("q_proj", &[0]),
    ("k_proj", &[1]),
    ("v_proj", &[2]),
    ("o_proj", &[3]),
    ("gate_proj", &[4]),
    ("up_proj", &[5]),
    ("down_proj", &[6]),
    ("qkv_proj", &[0]),
    ("gate_up_proj", &[4]),
];

/// The Llama block's projections as `target_modules` names them, in
/// [`Proj`] order (`nn.Linear` weights: `fan_in_fan_out` off).
pub const TARGETS: Targets = Targets { modules: MODULES.split_at(7).0, n: 7, fan_in_fan_out: false };

/// Phi-3's modules as `target_modules` names them (`fused_modules`): q|k|v
/// is one `qkv_proj` and gate|up one `gate_up_proj`, each adapted whole by
/// one adapter at its first projection ([`Proj::adapted`]).
pub const FUSED_TARGETS: Targets = Targets {
    modules: &[("qkv_proj", &[0]), ("o_proj", &[3]), ("gate_up_proj", &[4]), ("down_proj", &[6])],
    n: 7,
    fan_in_fan_out: false,
};

/// Every name either kind of block answers to: what a `[lora]` table or
/// a PEFT file is read with before a model of one kind checks it against
/// its own ([`targets_of`]).
pub const ANY_TARGETS: Targets = Targets { modules: &MODULES, n: 7, fan_in_fan_out: false };

/// The module names of a block with `fused` modules or without.
pub fn targets_of(fused: bool) -> &'static Targets {
    if fused {
        &FUSED_TARGETS
    } else {
        &TARGETS
    }
}

/// Checks every field of `lora` for the Llama block (`fused`: Phi-3's modules).
pub fn validate(lora: &LoraConfig, fused: bool) -> Result<(), LlamaError> {
    Ok(lora.validate(targets_of(fused))?)
}

/// Which projections carry adapters, indexed by [`Proj`] (with `fused`
/// modules only the groups' first ones: [`Proj::adapted`]).
pub fn targets(lora: &LoraConfig, fused: bool) -> Result<[bool; 7], LlamaError> {
    let on = lora.targets(targets_of(fused))?;
    Ok(std::array::from_fn(|i| on[i]))
}

/// The targeted modules' names in layout order (`all-linear` expanded).
pub fn target_names(lora: &LoraConfig, fused: bool) -> Result<Vec<&'static str>, LlamaError> {
    Ok(lora.target_names(targets_of(fused))?)
}
