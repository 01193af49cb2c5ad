//! A GPT-2 LoRA run's frozen base (the four `Conv1D` weights of every
//! block: `c_attn`, the attention's `c_proj`, `c_fc`, the MLP's `c_proj`)
//! kept packed — bf16, NF4, or the 16-bit halves of its file — outside the
//! engine's f32 parameter buffer. Each weight is held transposed, `[out,
//! in]` as `nn.Linear` stores it: the row layout the packed GEMMs read
//! ([`nn::proj::Frozen`]), which dequantise a panel at a time.

use crate::config::GptConfig;
use crate::error::GptError;
use crate::layout::{build_layout, conv_shape, Widths, CONVS};
use nn::linear::{PackFormat, PackedMatrix};

/// Every block's four `Conv1D` weights, packed `[out, in]`; shared (`Arc`)
/// by the models of one process.
#[derive(Debug, Clone)]
pub struct FrozenBase {
    layers: Vec<[PackedMatrix; 4]>,
    /// The formats present, for reports (`bf16`, `f16+bf16`).
    formats: Vec<PackFormat>,
}

/// `(block, layer)` of a `Conv1D` weight's name (`transformer.h.3.mlp.c_fc.weight`,
/// with or without `transformer.`; the layer indexed as [`CONVS`]).
pub(crate) fn conv_of(name: &str) -> Option<(usize, usize)> {
    let rest = name.strip_prefix("transformer.").unwrap_or(name).strip_prefix("h.")?;
    let (block, rest) = rest.split_once('.')?;
    let i = CONVS.iter().position(|c| rest.strip_suffix(".weight") == Some(c))?;
    Some((block.parse().ok()?, i))
}

/// Errors unless a file's `Conv1D` weight `name` (block `b`, layer `i`)
/// is one of the model's blocks and has its `[in, out]` shape (`path`:
/// the file, named in the error).
pub(crate) fn check_stored(
    cfg: &GptConfig,
    (name, (b, i)): (&str, (usize, usize)),
    shape: &[usize],
    path: &std::path::Path,
) -> Result<(), GptError> {
    let want = conv_shape(i, cfg.n_embd, Widths::whole(cfg));
    let problem = match (b < cfg.n_layer, shape == want) {
        (true, true) => return Ok(()),
        (false, _) => format!("tensor `{name}` is in block {b}, and the model has {} blocks", cfg.n_layer),
        (true, false) => format!("tensor `{name}` has shape {shape:?} but the model needs {want:?}"),
    };
    Err(GptError::File(nn::io::bad(path, format!("{problem} (is config.json from the same model?)"))))
}

/// `[in, out]` f32 `Conv1D` values as `[out, in]` rows.
fn transpose(w: &[f32], inp: usize, out: usize) -> Vec<f32> {
    (0..out).flat_map(|j| (0..inp).map(move |k| w[k * out + j])).collect()
}

impl FrozenBase {
    /// The base of `cfg` from its weights' packed matrices, handed over as
    /// `(block, layer, matrix)` in any order: each checked against the
    /// layer's `[out, in]` shape, every one present once.
    pub fn from_matrices(
        cfg: &GptConfig,
        mats: impl IntoIterator<Item = (usize, usize, PackedMatrix)>,
    ) -> Result<Self, GptError> {
        let name = |b: usize, i: usize| format!("transformer.h.{b}.{}.weight", CONVS[i]);
        let mut slots: Vec<[Option<PackedMatrix>; 4]> = (0..cfg.n_layer).map(|_| Default::default()).collect();
        for (b, i, m) in mats {
            let slot = slots.get_mut(b).ok_or_else(|| {
                GptError::InvalidConfig(format!("`{}`: the model has {} blocks", name(b, i), cfg.n_layer))
            })?;
            let [inp, out] = conv_shape(i, cfg.n_embd, Widths::whole(cfg));
            if [m.rows(), m.cols()] != [out, inp] {
                let got = [m.cols(), m.rows()];
                return Err(GptError::InvalidConfig(format!(
                    "`{}` is {got:?}, the model's is [{inp}, {out}]",
                    name(b, i)
                )));
            }
            if slot[i].replace(m).is_some() {
                return Err(GptError::InvalidConfig(format!("`{}` is given twice", name(b, i))));
            }
        }
        let mut formats = Vec::new();
        let mut layers = Vec::with_capacity(cfg.n_layer);
        for (b, slot) in slots.into_iter().enumerate() {
            let mut convs = Vec::with_capacity(4);
            for (i, m) in slot.into_iter().enumerate() {
                let m = m.ok_or_else(|| GptError::InvalidConfig(format!("`{}` is missing", name(b, i))))?;
                if !formats.contains(&m.format()) {
                    formats.push(m.format());
                }
                convs.push(m);
            }
            layers.push(convs.try_into().map_err(|_| GptError::InvalidConfig("four layers per block".into()))?);
        }
        Ok(FrozenBase { layers, formats })
    }

    /// Layer `i` of block `b` from its f32 `Conv1D` values `[in, out]`,
    /// packed as `format` (errors name the weight and the format).
    pub fn pack(
        cfg: &GptConfig,
        (b, i): (usize, usize),
        w: &[f32],
        format: PackFormat,
    ) -> Result<PackedMatrix, GptError> {
        let [inp, out] = conv_shape(i, cfg.n_embd, Widths::whole(cfg));
        PackedMatrix::quantize(out, inp, &transpose(w, inp, out), format).map_err(|e| {
            GptError::Setting(format!(
                "train.frozen_dtype: cannot pack `transformer.h.{b}.{}.weight` as {}: {e}",
                CONVS[i],
                format.name()
            ))
        })
    }

    /// The base of `cfg` packed in `format` from f32 parameters in the
    /// layout of [`crate::Gpt::new`] (tests; a model already in memory).
    pub fn quantize(cfg: &GptConfig, params: &[f32], format: PackFormat) -> Result<Self, GptError> {
        let (layout, _) = build_layout(cfg, Widths::whole(cfg), None, false);
        let mut mats = Vec::with_capacity(4 * cfg.n_layer);
        for t in layout.tensors() {
            let Some(at) = conv_of(&t.name) else { continue };
            let w = params.get(t.range()).ok_or_else(|| {
                GptError::InvalidConfig(format!(
                    "{} parameters given, the model has {}",
                    params.len(),
                    layout.n_params()
                ))
            })?;
            mats.push((at.0, at.1, Self::pack(cfg, at, w, format)?));
        }
        Self::from_matrices(cfg, mats)
    }

    /// Layer `i` (as [`CONVS`]) of block `b`, `[out, in]`.
    pub(crate) fn conv(&self, b: usize, i: usize) -> &PackedMatrix {
        &self.layers[b][i]
    }

    /// Block `b`'s four layers (as [`CONVS`]), `[out, in]`.
    pub(crate) fn block(&self, b: usize) -> &[PackedMatrix; 4] {
        &self.layers[b]
    }

    /// Layer `i` of block `b` dequantised to f32 in `Conv1D`'s `[in, out]`
    /// order (one tensor at a time: for files and merging).
    pub fn dequantize(&self, b: usize, i: usize) -> Vec<f32> {
        let m = &self.layers[b][i];
        transpose(&m.dequantize(), m.rows(), m.cols())
    }

    /// Blocks held.
    pub fn n_layers(&self) -> usize {
        self.layers.len()
    }

    /// Bytes of every packed matrix (what memory accounting counts).
    pub fn bytes(&self) -> usize {
        self.layers.iter().flatten().map(PackedMatrix::stored_bytes).sum()
    }

    /// The formats the weights are stored in, joined by `+`.
    pub fn format_names(&self) -> String {
        self.formats.iter().map(|f| f.name()).collect::<Vec<_>>().join("+")
    }

    /// Bytes the base of `cfg` takes with every weight in `format` (what
    /// plans count before anything is loaded).
    pub fn planned_bytes(cfg: &GptConfig, format: PackFormat) -> u128 {
        let per_block: u128 = (0..4)
            .map(|i| {
                let [inp, out] = conv_shape(i, cfg.n_embd, Widths::whole(cfg));
                format.bytes_for(out, inp)
            })
            .sum();
        cfg.n_layer as u128 * per_block
    }
}
