//! A LoRA run's frozen base projections (q, k, v, o, gate, up, down of every
//! layer) kept packed — bf16, a GGUF file's own blocks, or NF4 — outside the
//! engine's f32 parameter buffer: the model reads them through the packed
//! GEMMs ([`nn::linear::Weight::Packed`]), which dequantise a panel at a
//! time. q|k|v and gate|up are stacked into one matrix each when their
//! formats agree (one GEMM, as the f32 layout), and kept as parts otherwise.

use crate::config::LlamaConfig;
use crate::error::LlamaError;
use crate::layout::{fused_weight, Proj};
use nn::linear::{linear_backward_input, linear_forward, Cols, LinearShape, PackFormat, PackedMatrix, Weight};
use nn::Strided;
use std::ops::Range;
use std::sync::Arc;

/// The projection groups a layer multiplies with one GEMM each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Group {
    /// q | k | v.
    Qkv,
    /// o.
    O,
    /// gate | up.
    GateUp,
    /// down.
    Down,
}

impl Group {
    /// The projections of the group, in their output-column order.
    pub(crate) fn projs(self) -> &'static [Proj] {
        match self {
            Group::Qkv => &[Proj::Q, Proj::K, Proj::V],
            Group::O => &[Proj::O],
            Group::GateUp => &[Proj::Gate, Proj::Up],
            Group::Down => &[Proj::Down],
        }
    }

    const ALL: [Group; 4] = [Group::Qkv, Group::O, Group::GateUp, Group::Down];
}

/// One group's weight `[Σ out, in]`: packed matrices, each holding the
/// output rows from `row0` on.
#[derive(Debug, Clone)]
pub(crate) struct PackedGroup {
    parts: Vec<(usize, PackedMatrix)>,
}

impl nn::proj::Frozen for PackedGroup {
    fn forward(&self, y: Cols<'_>, accumulate: bool, x: &[f32], s: LinearShape) {
        PackedGroup::forward(self, y, accumulate, x, s)
    }

    fn backward_input(&self, dx: &mut [f32], accumulate: bool, dy: Strided<'_>, s: LinearShape) {
        PackedGroup::backward_input(self, dx, accumulate, dy, s)
    }

    fn rows(&self, rows: std::ops::Range<usize>) -> Vec<f32> {
        self.dequantize_rows(rows)
    }
}

impl PackedGroup {
    /// The group from its projections' matrices in order: one stacked
    /// matrix when their formats agree, parts otherwise.
    fn new(mats: Vec<PackedMatrix>) -> Self {
        let same = mats.windows(2).all(|w| w[0].format() == w[1].format());
        if same && mats.len() > 1 {
            if let Ok(m) = PackedMatrix::concat_rows(mats.clone()) {
                return PackedGroup { parts: vec![(0, m)] };
            }
        }
        let mut row0 = 0;
        let parts = mats
            .into_iter()
            .map(|m| {
                row0 += m.rows();
                (row0 - m.rows(), m)
            })
            .collect();
        PackedGroup { parts }
    }

    /// `y[:, col0 ..] (+)= x · Wᵀ` (`s.oc` = the group's rows).
    pub(crate) fn forward(&self, y: Cols<'_>, accumulate: bool, x: &[f32], s: LinearShape) {
        let Cols { buf, col0, rs } = y;
        for (row0, m) in &self.parts {
            let cols = Cols { buf: &mut *buf, col0: col0 + row0, rs };
            let part = LinearShape { oc: m.rows(), ..s };
            linear_forward(cols, accumulate, x, Weight::Packed(m, 0..m.rows()), part);
        }
    }

    /// `dx (+)= dy · W` (`dy` `[n, s.oc]`): the parts' products summed in order.
    pub(crate) fn backward_input(&self, dx: &mut [f32], accumulate: bool, dy: Strided<'_>, s: LinearShape) {
        for (i, (row0, m)) in self.parts.iter().enumerate() {
            let dyp = Strided { offset: dy.offset + row0 * dy.cs, ..dy };
            let part = LinearShape { oc: m.rows(), ..s };
            linear_backward_input(dx, accumulate || i > 0, dyp, Weight::Packed(m, 0..m.rows()), part);
        }
    }

    fn bytes(&self) -> usize {
        self.parts.iter().map(|(_, m)| m.stored_bytes()).sum()
    }

    /// Rows `rows` of the group dequantised (`rows` inside one part).
    fn dequantize_rows(&self, rows: std::ops::Range<usize>) -> Vec<f32> {
        let part = self.parts.iter().rev().find(|(r0, _)| *r0 <= rows.start);
        let Some((r0, m)) = part else { return Vec::new() };
        let mut out = vec![0.0; rows.len() * m.cols()];
        m.dequantize_rows(rows.start - r0..rows.end - r0, &mut out);
        out
    }
}

/// One layer's packed projections.
#[derive(Debug, Clone)]
pub(crate) struct LayerBase {
    groups: [PackedGroup; 4],
}

impl LayerBase {
    /// The weight of `g`.
    pub(crate) fn group(&self, g: Group) -> &PackedGroup {
        &self.groups[g as usize]
    }
}

pub use family::FrozenFormat;

/// Every layer's frozen projections, packed; shared (`Arc`) by the models
/// of one process — thread ranks hold one copy.
#[derive(Debug, Clone)]
pub struct FrozenBase {
    layers: Vec<LayerBase>,
    /// The token embedding (and a tied head), when it is kept packed too.
    embed: Option<Arc<PackedMatrix>>,
    /// The formats present, for reports (`q4_1`, `bf16+q8_0`).
    formats: Vec<PackFormat>,
}

impl FrozenBase {
    /// The base of `cfg` from its projections' packed matrices, handed
    /// over as `(layer, projection, matrix)` in any order: each checked
    /// against the projection's `[out, in]` shape, every one present once.
    pub fn from_matrices(
        cfg: &LlamaConfig,
        mats: impl IntoIterator<Item = (usize, Proj, PackedMatrix)>,
    ) -> Result<Self, LlamaError> {
        let mut slots: Vec<[Option<PackedMatrix>; 7]> = (0..cfg.n_layer).map(|_| Default::default()).collect();
        for (layer, pr, m) in mats {
            let name = format!("model.layers.{layer}.{}.weight", pr.path());
            let slot =
                slots.get_mut(layer).ok_or_else(|| LlamaError::UnexpectedTensors { names: vec![name.clone()] })?;
            let want = pr.shape(cfg);
            if [m.rows(), m.cols()] != want {
                return Err(LlamaError::ShapeMismatch { name, got: vec![m.rows(), m.cols()], expected: want.to_vec() });
            }
            if slot[pr as usize].replace(m).is_some() {
                return Err(LlamaError::DuplicateTensor { name });
            }
        }
        let mut formats = Vec::new();
        let mut layers = Vec::with_capacity(cfg.n_layer);
        for (i, mut slot) in slots.into_iter().enumerate() {
            let mut built = Vec::with_capacity(4);
            for g in Group::ALL {
                let mut mats = Vec::with_capacity(g.projs().len());
                for &p in g.projs() {
                    let m = slot[p as usize].take().ok_or_else(|| LlamaError::MissingTensor {
                        name: format!("model.layers.{i}.{}.weight", p.path()),
                    })?;
                    if !formats.contains(&m.format()) {
                        formats.push(m.format());
                    }
                    mats.push(m);
                }
                built.push(PackedGroup::new(mats));
            }
            let groups: [PackedGroup; 4] =
                built.try_into().map_err(|_| LlamaError::config("frozen base", "four projection groups per layer"))?;
            layers.push(LayerBase { groups });
        }
        Ok(FrozenBase { layers, formats, embed: None })
    }

    /// The base of `cfg` packed in `format` from f32 parameters in the
    /// layout of [`crate::Llama::new`] (tests; a model already in memory).
    pub fn quantize(cfg: &LlamaConfig, params: &[f32], format: PackFormat) -> Result<Self, LlamaError> {
        let (layout, ranges) = crate::layout::build_layout(cfg, None, (false, false));
        LlamaError::check_count("base model", layout.n_params(), params.len())?;
        let mut mats = Vec::with_capacity(cfg.n_layer * 7);
        for layer in 0..cfg.n_layer {
            for pr in Proj::ALL {
                let [rows, cols] = pr.shape(cfg);
                let w = &params[ranges.layers[layer].w(pr)];
                mats.push((layer, pr, pack(rows, cols, w, format)?));
            }
        }
        Self::from_matrices(cfg, mats)
    }

    /// The base with the token embedding `[V, C]` kept packed too
    /// (`generate` / `eval` of a model file: [`crate::Llama::with_packed_embedding_layout`]).
    pub fn with_embedding(mut self, m: PackedMatrix) -> Self {
        if !self.formats.contains(&m.format()) {
            self.formats.push(m.format());
        }
        self.embed = Some(Arc::new(m));
        self
    }

    /// The token embedding, when it is kept packed.
    pub fn embedding(&self) -> Option<&Arc<PackedMatrix>> {
        self.embed.as_ref()
    }

    /// Layer `idx`'s projections.
    pub(crate) fn layer(&self, idx: usize) -> &LayerBase {
        &self.layers[idx]
    }

    /// Layers held.
    pub fn n_layers(&self) -> usize {
        self.layers.len()
    }

    /// Bytes of every packed matrix (what memory accounting counts).
    pub fn bytes(&self) -> usize {
        let embed = self.embed.as_ref().map_or(0, |m| m.stored_bytes());
        embed + self.layers.iter().flat_map(|l| l.groups.iter()).map(PackedGroup::bytes).sum::<usize>()
    }

    /// The formats the projections are stored in, joined by `+`.
    pub fn format_names(&self) -> String {
        self.formats.iter().map(|f| f.name()).collect::<Vec<_>>().join("+")
    }

    /// Projection `pr` of layer `layer` dequantised to f32 (`[out, in]`,
    /// one tensor at a time: for exports).
    pub fn dequantize(&self, cfg: &LlamaConfig, layer: usize, pr: Proj) -> Vec<f32> {
        self.proj_rows(cfg, layer, pr, 0..pr.shape(cfg)[0])
    }

    /// Rows `rows` of projection `pr` of layer `layer` dequantised to f32
    /// (`[rows, in]`: DoRA's row norms read the base a block of rows at a time).
    pub(crate) fn proj_rows(
        &self,
        cfg: &LlamaConfig,
        layer: usize,
        pr: Proj,
        rows: std::ops::Range<usize>,
    ) -> Vec<f32> {
        let (group, row0) = group_row0(cfg, pr);
        self.layers[layer].group(group).dequantize_rows(row0 + rows.start..row0 + rows.end)
    }

    /// Bytes the frozen projections of `cfg` take when every one is stored
    /// in `format` (what plans count before anything is loaded).
    pub fn planned_bytes(cfg: &LlamaConfig, format: impl Fn(Proj) -> PackFormat) -> u128 {
        let per_layer: u128 = Proj::ALL
            .into_iter()
            .map(|p| {
                let [rows, cols] = p.shape(cfg);
                format(p).bytes_for(rows, cols)
            })
            .sum();
        cfg.n_layer as u128 * per_layer
    }
}

/// The group projection `pr` belongs to, and its first row in it.
fn group_row0(cfg: &LlamaConfig, pr: Proj) -> (Group, usize) {
    match pr {
        Proj::Q => (Group::Qkv, 0),
        Proj::K => (Group::Qkv, cfg.q_dim()),
        Proj::V => (Group::Qkv, cfg.q_dim() + cfg.kv_dim()),
        Proj::O => (Group::O, 0),
        Proj::Gate => (Group::GateUp, 0),
        Proj::Up => (Group::GateUp, cfg.intermediate_size),
        Proj::Down => (Group::Down, 0),
    }
}

/// A `[rows, cols]` f32 weight packed in `format` (errors name the format).
pub(crate) fn pack(rows: usize, cols: usize, w: &[f32], format: PackFormat) -> Result<PackedMatrix, LlamaError> {
    PackedMatrix::quantize(rows, cols, w, format)
        .map_err(|e| LlamaError::config("train.frozen_dtype", format!("cannot pack a [{rows}, {cols}] weight: {e}")))
}

/// `(layer, projection)` of a projection weight's Hugging Face name
/// (`model.layers.3.self_attn.q_proj.weight`).
pub(crate) fn proj_of(name: &str) -> Option<(usize, Proj)> {
    let rest = name.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let pr = Proj::ALL.into_iter().find(|p| rest.strip_suffix(".weight") == Some(p.path().as_str()))?;
    Some((layer.parse().ok()?, pr))
}

/// A stored weight's layer and its projections, each with its rows in it.
pub(crate) type StoredProjs = (usize, Vec<(Proj, Range<usize>)>);

/// The projections a stored weight `name` holds, each with its rows in it:
/// a projection's own weight (`model.layers.3.self_attn.q_proj.weight`:
/// all its rows) or one `cfg` stores fused (`…self_attn.qkv_proj.weight`:
/// its parts' rows, stacked in order); `None` for any other tensor.
pub(crate) fn stored_projs(name: &str, cfg: &LlamaConfig) -> Option<StoredProjs> {
    if let Some((layer, f)) = fused_weight(name, cfg.fused_weights()) {
        let mut at = 0;
        let parts = f.parts.iter().map(|&p| {
            at += p.shape(cfg)[0];
            (p, at - p.shape(cfg)[0]..at)
        });
        return Some((layer, parts.collect()));
    }
    let (layer, pr) = proj_of(name)?;
    Some((layer, vec![(pr, 0..pr.shape(cfg)[0])]))
}
