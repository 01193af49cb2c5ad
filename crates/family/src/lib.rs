//! The model-family boundary. The CLI — planning, training, memory checks,
//! checkpoints, Hugging Face / GGUF I/O, LoRA and generation — sees a model
//! only through [`Family`] (a shape: sizes, initialisation, files) and
//! [`LanguageModel`] (a built model: the engine's `Model` contract plus
//! sampling), and finds a family only through its [`Registration`]: the
//! `model.family` name, the presets, the `config.json` `model_type` and GGUF
//! architecture it reads. A family crate implements these three and is
//! listed once in the binary's registry; nothing else names it.
//!
//! Errors cross this boundary as [`ModelError`] (the family's own error,
//! boxed): each family keeps its error type and converts it with one `From`
//! impl, and the binary adds context.

pub mod dpo;
pub mod generation;
mod packed;
pub mod reference;
pub mod round_trip;

use config::ModelConfig;
pub use engine::LossTerms;
use engine::{
    Checkpointing, MicroStepStats, Model, ParamLayout, ParamStore, Precision, StageSpec, StagedModel, TensorSpec,
    TokenBatch,
};
pub use packed::{
    chain, frozen_packing, safetensors_format, FrozenFormat, PackedSource, ReadBase, StoredWeight, StoredWeights,
};
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

/// Any family's error, boxed.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A result whose error is any family's error.
pub type Result<T, E = ModelError> = std::result::Result<T, E>;

/// The weights file of a Hugging Face model folder.
pub const WEIGHTS_FILE: &str = "model.safetensors";
/// The config file of a Hugging Face model folder.
pub const CONFIG_FILE: &str = "config.json";

/// A family and parameters of one model.
pub type Loaded = (Arc<dyn Family>, Vec<f32>);

/// A model error of any family (boxed): what [`Family`] and
/// [`Registration`] return, and the engine's `Model::Error` of an
/// [`Erased`] model. A family crate adds `impl From<ItsError> for ModelError`.
#[derive(Debug)]
pub struct ModelError(BoxError);

impl ModelError {
    /// Wraps a family's error.
    pub fn new(e: impl std::error::Error + Send + Sync + 'static) -> Self {
        Self(Box::new(e))
    }
}

impl From<BoxError> for ModelError {
    fn from(e: BoxError) -> Self {
        Self(e)
    }
}

/// A model as a GGUF file holds it, in llama.cpp's tensor names and layout
/// for the family's architecture: the architecture's metadata
/// (`general.architecture`, `{arch}.block_count`, …) and every tensor as a
/// view of the parameters with the reordering llama.cpp's layout needs.
/// The tokenizer's `tokenizer.*` keys are not here: the caller appends them
/// (`data::Tokenizer::gguf_metadata`) before writing. Nothing is copied
/// until [`GgufModel::write`] makes one tensor's values at a time, so
/// writing holds the parameters and one tensor, never a second model.
#[derive(Debug, Clone, PartialEq)]
pub struct GgufModel<'a> {
    /// Metadata in the order it is written.
    pub metadata: Vec<(String, gguf::Value)>,
    /// Tensors in the order they are written.
    pub tensors: Vec<GgufTensor<'a>>,
}

/// How a tensor's values are made from its parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgufLayout {
    /// As they are.
    Same,
    /// Rows permuted for llama.cpp's RoPE ([`gguf::llama::permute_rows`])
    /// over this many heads: the source is `[rows, cols]` row-major with
    /// `ne = [cols, rows]`, or a bias `[rows]` (one value per row).
    PermuteRows {
        /// The heads the rows belong to.
        heads: usize,
    },
    /// Transposed: the source is `[ne[0], ne[1]]` row-major (a GPT-2
    /// `Conv1D` weight `[in, out]`), the tensor `[ne[1], ne[0]]`.
    Transpose,
}

/// One tensor of a [`GgufModel`].
#[derive(Debug, Clone, PartialEq)]
pub struct GgufTensor<'a> {
    /// llama.cpp's name (`blk.0.attn_q.weight`).
    pub name: String,
    /// GGUF dimensions, fastest first: a row-major `[rows, cols]` matrix is
    /// `[cols, rows]`.
    pub ne: Vec<u64>,
    /// The parameters it is made from (or values made for the file, such
    /// as Llama 3's `rope_freqs`).
    pub source: std::borrow::Cow<'a, [f32]>,
    /// How.
    pub layout: GgufLayout,
}

impl<'a> GgufTensor<'a> {
    /// A tensor of row-major `shape` (the reverse of `ne`) made from `source`.
    pub fn new(
        name: impl Into<String>,
        shape: &[usize],
        source: impl Into<std::borrow::Cow<'a, [f32]>>,
        layout: GgufLayout,
    ) -> Self {
        let ne = shape.iter().rev().map(|&d| d as u64).collect();
        Self { name: name.into(), ne, source: source.into(), layout }
    }

    /// The values in the file's order (row-major over `ne` reversed).
    pub fn values(&self) -> std::borrow::Cow<'a, [f32]> {
        let cols = self.ne.first().copied().unwrap_or(1) as usize;
        match self.layout {
            GgufLayout::Same => self.source.clone(),
            GgufLayout::PermuteRows { heads } => {
                // [cols, rows] for a matrix, [rows] for a bias.
                let rows = self.ne.get(1).or(self.ne.first()).copied().unwrap_or(1) as usize;
                let mut v = self.source.to_vec();
                gguf::llama::permute_rows(&mut v, rows, self.source.len() / rows.max(1), heads);
                v.into()
            }
            GgufLayout::Transpose => {
                // The source is [cols, rows]: its element (c, r) goes to (r, c).
                let rows = self.source.len() / cols.max(1);
                let mut v = vec![0.0f32; self.source.len()];
                for (c, src_row) in self.source.chunks_exact(rows.max(1)).enumerate() {
                    for (r, &x) in src_row.iter().enumerate() {
                        v[r * cols + c] = x;
                    }
                }
                v.into()
            }
        }
    }
}

impl GgufModel<'_> {
    /// Writes the model as a GGUF v3 file at `path` (through `PATH.part`,
    /// renamed when complete), every tensor stored as `ty` where llama.cpp's
    /// converter would ([`gguf::storage_type`]: norms, biases and 1-D
    /// tensors in F32, rows that are not whole blocks in F16), with
    /// `general.file_type` and, for block types, `general.quantization_version`
    /// added. One tensor is made and encoded at a time.
    pub fn write(&self, path: &Path, ty: gguf::GgmlType) -> Result<()> {
        let file_type = gguf::file_type(ty).ok_or_else(|| format!("GGUF files cannot be written as {}", ty.name))?;
        let mut metadata = self.metadata.clone();
        metadata.push(("general.file_type".into(), gguf::Value::U32(file_type)));
        if ty.block_size > 1 {
            metadata.push(("general.quantization_version".into(), gguf::Value::U32(2)));
        }
        let headers: Vec<_> = self
            .tensors
            .iter()
            .map(|t| gguf::writer::TensorHeader {
                name: t.name.clone(),
                ne: t.ne.clone(),
                ty: gguf::storage_type(ty, &t.name, &t.ne),
            })
            .collect();
        gguf::writer::write_tensors::<_, gguf::GgufError, _>(path, &metadata, &headers, |i| {
            gguf::quantize(headers[i].ty, &self.tensors[i].values())
                .map_err(|e| gguf::GgufError::Encode(format!("tensor `{}`: {e}", headers[i].name)))
        })
        .map_err(ModelError::new)
    }
}

impl From<String> for ModelError {
    fn from(message: String) -> Self {
        Self(message.into())
    }
}

impl From<&str> for ModelError {
    fn from(message: &str) -> Self {
        Self(message.into())
    }
}

impl std::fmt::Display for ModelError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for ModelError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
}

/// What a family's model type offers beyond the engine's contract: memory
/// figures and the logits generation samples from.
pub trait TextModel: StagedModel<Batch = TokenBatch> + Send {
    /// Bytes of activation and scratch buffers allocated so far.
    fn activation_bytes(&self) -> usize;
    /// Of those, the bytes saved for backward.
    fn saved_activation_bytes(&self) -> usize;
    /// Logits of the token after `tokens` (at most the context length).
    fn next_token_logits(&mut self, params: &[f32], tokens: &[u32]) -> Result<Vec<f32>, Self::Error>;
    /// Keeps a key/value cache of up to `positions` positions (0: none),
    /// so that a call to `next_token_logits` whose tokens extend the
    /// previous call's runs only the new ones.
    fn set_kv_cache(&mut self, positions: usize) -> Result<(), Self::Error>;
    /// Adds label smoothing and z-loss to the training loss (the reported
    /// loss stays plain cross-entropy; [`engine::MicroStepStats::aux_sum`]
    /// carries what they add).
    fn set_loss_terms(&mut self, terms: engine::LossTerms);
}

/// Implements [`TextModel`] for a model type whose inherent methods
/// `activation_bytes`, `saved_activation_bytes`, `next_token_logits`, `set_kv_cache`
/// and `set_loss_terms` have those signatures, and `From` its error for [`ModelError`]:
/// `family::text_model!(Gpt, GptError);`.
#[macro_export]
macro_rules! text_model {
    ($model:ty, $error:ty) => {
        impl From<$error> for $crate::ModelError {
            fn from(e: $error) -> Self {
                Self::new(e)
            }
        }

        impl $crate::TextModel for $model {
            fn activation_bytes(&self) -> usize {
                <$model>::activation_bytes(self)
            }

            fn saved_activation_bytes(&self) -> usize {
                <$model>::saved_activation_bytes(self)
            }

            fn next_token_logits(&mut self, params: &[f32], tokens: &[u32]) -> Result<Vec<f32>, $error> {
                <$model>::next_token_logits(self, params, tokens)
            }

            fn set_kv_cache(&mut self, positions: usize) -> Result<(), $error> {
                <$model>::set_kv_cache(self, positions)
            }

            fn set_loss_terms(&mut self, terms: $crate::LossTerms) {
                <$model>::set_loss_terms(self, terms)
            }
        }
    };
}

/// A built model as the binary uses it: a [`TextModel`] whose errors are
/// [`ModelError`] (a family's model behind [`Erased`]). The methods are
/// [`TextModel`]'s, written once.
pub trait LanguageModel: TextModel<Error = ModelError> {}

impl<T: TextModel<Error = ModelError> + ?Sized> LanguageModel for T {}

/// A family's [`TextModel`] as a [`LanguageModel`] (its error boxed).
pub struct Erased<M>(pub M);

impl<M: TextModel> Model for Erased<M> {
    type Batch = TokenBatch;
    type Error = ModelError;

    fn layout(&self) -> &ParamLayout {
        self.0.layout()
    }

    fn set_trainable(&mut self, trainable: &dyn Fn(&TensorSpec) -> bool) -> usize {
        self.0.set_trainable(trainable)
    }

    fn segments(&self) -> Vec<Range<usize>> {
        self.0.segments()
    }

    fn n_targets(&self, batch: &TokenBatch) -> u64 {
        self.0.n_targets(batch)
    }

    fn micro_step(
        &mut self,
        store: &mut dyn ParamStore,
        batch: &TokenBatch,
        loss_seed: f32,
    ) -> Result<MicroStepStats, ModelError> {
        self.0.micro_step(store, batch, loss_seed).map_err(ModelError::new)
    }

    fn loss(&mut self, store: &mut dyn ParamStore, batch: &TokenBatch) -> Result<MicroStepStats, ModelError> {
        self.0.loss(store, batch).map_err(ModelError::new)
    }

    fn begin_step(&mut self, step: u64) {
        self.0.begin_step(step)
    }

    fn take_aux_stats(&mut self) -> engine::AuxStats {
        self.0.take_aux_stats()
    }

    fn step_stats_len(&self) -> usize {
        self.0.step_stats_len()
    }

    fn collect_step_stats(
        &mut self,
        store: &mut dyn ParamStore,
        batch: &TokenBatch,
        into: &mut [f64],
    ) -> Result<(), ModelError> {
        self.0.collect_step_stats(store, batch, into).map_err(ModelError::new)
    }

    fn set_step_stats(&mut self, stats: &[f64]) {
        self.0.set_step_stats(stats)
    }
}

impl<M: TextModel> StagedModel for Erased<M> {
    fn n_blocks(&self) -> usize {
        self.0.n_blocks()
    }

    fn tied_head(&self) -> bool {
        self.0.tied_head()
    }

    fn set_stage(&mut self, spec: StageSpec) {
        self.0.set_stage(spec)
    }

    fn tensor_shards(&self) -> Option<engine::TensorShards> {
        self.0.tensor_shards()
    }

    fn context_parallel(&mut self, cp: engine::ContextRank) -> Result<(), String> {
        self.0.context_parallel(cp)
    }

    fn boundary_len(&self, batch: &TokenBatch) -> usize {
        self.0.boundary_len(batch)
    }

    fn stage_forward(
        &mut self,
        store: &mut dyn ParamStore,
        batch: &TokenBatch,
        slot: usize,
        input: &[f32],
        output: &mut [f32],
        loss_seed: Option<f32>,
    ) -> Result<MicroStepStats, ModelError> {
        self.0.stage_forward(store, batch, slot, input, output, loss_seed).map_err(ModelError::new)
    }

    fn stage_backward(
        &mut self,
        store: &mut dyn ParamStore,
        batch: &TokenBatch,
        slot: usize,
        grad_out: &[f32],
        grad_in: &mut [f32],
    ) -> Result<(), ModelError> {
        self.0.stage_backward(store, batch, slot, grad_out, grad_in).map_err(ModelError::new)
    }
}

impl<M: TextModel> TextModel for Erased<M> {
    fn activation_bytes(&self) -> usize {
        self.0.activation_bytes()
    }

    fn saved_activation_bytes(&self) -> usize {
        self.0.saved_activation_bytes()
    }

    fn next_token_logits(&mut self, params: &[f32], tokens: &[u32]) -> Result<Vec<f32>, ModelError> {
        self.0.next_token_logits(params, tokens).map_err(ModelError::new)
    }

    fn set_kv_cache(&mut self, positions: usize) -> Result<(), ModelError> {
        self.0.set_kv_cache(positions).map_err(ModelError::new)
    }

    fn set_loss_terms(&mut self, terms: engine::LossTerms) {
        self.0.set_loss_terms(terms)
    }
}

/// How a model is built for training: the storage precision of its
/// activations and which blocks it recomputes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Build {
    /// Storage precision of saved activations.
    pub precision: Precision,
    /// Activation checkpointing.
    pub checkpointing: Checkpointing,
    /// For plans: the whole sequences' length when a context-parallel rank
    /// runs a part of each (its rotary tables cover every position); `None`:
    /// whole sequences.
    pub whole_len: Option<usize>,
}

/// How a run asks its frozen tensors to be stored: `train.frozen_dtype`,
/// `train.frozen_double_quant` and the file or folder the frozen base is
/// read from (`--init-from`, kept as `train.frozen_source` for a resume).
#[derive(Debug, Clone, PartialEq)]
pub struct FrozenStorage {
    /// `train.frozen_dtype`.
    pub dtype: config::FrozenDtype,
    /// `train.frozen_double_quant` (NF4 only).
    pub double_quant: bool,
    /// Where the pretrained base is read from (none: a random base).
    pub source: Option<std::path::PathBuf>,
}

impl FrozenStorage {
    /// Whether a packed format was asked for by name (not `auto` or `f32`).
    pub fn packs_by_name(&self) -> bool {
        !matches!(self.dtype, config::FrozenDtype::Auto | config::FrozenDtype::F32)
    }
}

/// Frozen tensors a family holds packed outside its layout: their formats
/// (`q4_1`, `bf16+q8_0`) and bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FrozenBytes {
    /// The formats, joined by `+`.
    pub formats: String,
    /// Bytes of every packed tensor.
    pub bytes: u128,
    /// Values they hold (what `n_params` leaves out).
    pub values: u128,
}

/// [`Family::with_frozen_storage`] of a shape without adapters: nothing
/// to pack unless a packed format is named, which is refused.
pub fn no_adapters_to_pack(s: &FrozenStorage) -> Result<Option<Arc<dyn Family>>> {
    match s.packs_by_name() {
        true => Err(format!(
            "train.frozen_dtype = \"{}\" packs the frozen base of a LoRA run, and there is no [lora]: add [lora] or set train.frozen_dtype = \"auto\"",
            s.dtype.name()
        )
        .into()),
        false => Ok(None),
    }
}

/// One model family at one shape: everything the binary needs before (and
/// without) building the model, so shapes too large for this machine can
/// still be planned and reported.
pub trait Family: Send + Sync {
    /// Human name of the family (`GPT-2`).
    fn name(&self) -> &'static str;
    /// The shape in a few words (`4 layers, d=128`).
    fn describe(&self) -> String;
    /// Number of parameters (u128: hostile shapes overflow `usize`).
    fn n_params(&self) -> u128;
    /// Vocabulary size.
    fn vocab_size(&self) -> usize;
    /// Longest sequence the model accepts.
    fn max_seq_len(&self) -> usize;
    /// Forward + backward FLOPs per token at sequence length `seq_len`.
    fn flops_per_token(&self, seq_len: usize) -> f64;
    /// Bytes of activations and backward scratch one rank allocates for a
    /// micro-batch of `micro` sequences of `seq_len` tokens.
    fn activation_bytes(&self, micro: usize, seq_len: usize, build: Build) -> u128;
    /// [`Family::activation_bytes`] of one pipeline stage: its blocks,
    /// `spec.in_flight` micro-batches of them alive at once, the head's
    /// buffers on the last stage only.
    fn stage_activation_bytes(&self, micro: usize, seq_len: usize, build: Build, spec: &StageSpec) -> u128;
    /// The shape rank `tp.rank` of a tensor-parallel group of `tp.size`
    /// holds (Megatron-LM's split: its attention heads, its MLP columns,
    /// with `tp.vocab` its rows of the embedding and the head, the
    /// replicated rest): its `n_params`, activation bytes and `build`
    /// are that rank's, its `init_segment` that rank's slice of this
    /// shape's. An error names what cannot be split (heads not divisible
    /// by T, a family without tensor parallelism).
    fn tensor_parallel(&self, tp: engine::TpRank) -> Result<Arc<dyn Family>> {
        Err(format!(
            "the {} family cannot split its tensors (dist.tensor_parallel = {}); set dist.tensor_parallel = 1",
            self.name(),
            tp.size
        )
        .into())
    }
    /// Whether the family's model can recompute blocks (activation checkpointing).
    fn supports_checkpointing(&self) -> bool {
        true
    }
    /// The model, storing activations as `build` says (no activation
    /// memory is allocated before the first batch).
    fn build(&self, build: Build) -> Result<Box<dyn LanguageModel>>;
    /// Initial values of segment `seg` (only that segment's elements).
    fn init_segment(&self, seed: u64, seg: usize) -> Vec<f32>;
    /// The shape as Hugging Face's `config.json` (two shapes are equal when
    /// these are).
    fn hf_config(&self) -> serde_json::Value;
    /// Writes `config.json` and `model.safetensors` into `dir` (which exists).
    fn save_hf(&self, dir: &Path, layout: &ParamLayout, params: &[f32]) -> Result<()>;
    /// Reads the weights of the model folder `dir` into `layout`'s order.
    fn load_weights(&self, dir: &Path, layout: &ParamLayout) -> Result<Vec<f32>>;
    /// The parameters to start from, given a pretrained model's (same
    /// shape): themselves, or with adapters initialised from `seed` added.
    fn start_from_pretrained(&self, params: Vec<f32>, seed: u64) -> Result<Vec<f32>> {
        let _ = seed;
        Ok(params)
    }
    /// With adapters: writes only them, in PEFT's format
    /// (`adapter_config.json` naming `base` as `base_model_name_or_path`,
    /// `adapter_model.safetensors`), into `dir` (which exists): every
    /// trainable tensor, none of the frozen base. An error without adapters.
    fn save_adapters(&self, dir: &Path, layout: &ParamLayout, params: &[f32], base: &str) -> Result<()> {
        let _ = (dir, layout, params, base);
        Err(format!("this {} shape has no adapters to save apart from its base", self.name()).into())
    }
    /// With adapters: the adapters PEFT's files in `dir` hold, copied into
    /// `params` (in `layout`'s order); the file must hold every adapter
    /// tensor of the layout and nothing else. An error without adapters.
    fn load_adapters(&self, dir: &Path, layout: &ParamLayout, params: &mut [f32]) -> Result<()> {
        let _ = (layout, params);
        Err(format!("{}: this {} shape has no adapters to read", dir.display(), self.name()).into())
    }
    /// With a packed frozen base: this shape with every tensor in its f32
    /// layout, and `params` (this shape's) in it — the base dequantised,
    /// the values the packed GEMMs compute with. `None` without one.
    fn unpacked(&self, params: &[f32]) -> Result<Option<Loaded>> {
        let _ = params;
        Ok(None)
    }
    /// With adapters: the plain model with them merged into its weights
    /// (W + α/r·B·A), as a family and parameters; `None` without adapters.
    fn merged(&self, params: &[f32]) -> Result<Option<Loaded>> {
        let _ = params;
        Ok(None)
    }
    /// The model as a GGUF file holds it for llama.cpp (names, layout and
    /// the architecture's metadata, no tokenizer). `params` is in `layout`'s
    /// order and holds no adapters: merge them first ([`Family::merged`]);
    /// the model's tensors are views of it.
    fn gguf_export<'a>(&self, layout: &ParamLayout, params: &'a [f32]) -> Result<GgufModel<'a>> {
        let _ = (layout, params);
        Err(format!("the {} family cannot be written as a GGUF file (export it as a Hugging Face folder)", self.name())
            .into())
    }
    /// Writes this shape into `[model]`, so a resolved config rebuilds it.
    fn pin_shape(&self, m: &mut ModelConfig);
    /// The `[model]` keys a pretrained shape may take from `--set`: how
    /// positions are encoded where no parameter depends on them (rotary
    /// tables: the context length and the frequency scaling), so a
    /// pretrained model can be trained on longer sequences than it was
    /// (context extension). Every other key is its shape.
    fn position_keys(&self) -> &'static [&'static str] {
        &[]
    }
    /// This shape with its frozen tensors stored as `s` asks: `None` when
    /// they stay f32 tensors of the layout (`f32`, or `auto` on a source
    /// that is not 16-bit); an error names what cannot be packed.
    fn with_frozen_storage(&self, s: &FrozenStorage) -> Result<Option<Arc<dyn Family>>> {
        if !s.packs_by_name() {
            return Ok(None);
        }
        Err(format!(
            "train.frozen_dtype = \"{}\" packs the frozen projections of a LoRA base (GPT-2 and the Llama block's families: llama, qwen2, qwen3, mistral, phi3, gemma2); the {} family keeps every tensor in f32: set train.frozen_dtype = \"auto\"",
            s.dtype.name(),
            self.name()
        )
        .into())
    }
    /// The frozen tensors held packed outside the layout, if any.
    fn frozen_bytes(&self) -> Option<FrozenBytes> {
        None
    }
    /// The experts of a mixture of experts in place of each MLP; `None`: dense.
    fn n_experts(&self) -> Option<usize> {
        None
    }
    /// A mixture's load per expert (shares of the step's choices, summing
    /// to 1) from a step's [`engine::StepReport::step_stats`] (the E
    /// experts' choices first); `None` for a dense model or without them.
    fn expert_load(&self, step_stats: &[f64]) -> Option<Vec<f64>> {
        let chosen = step_stats.get(..self.n_experts()?)?;
        let total: f64 = chosen.iter().sum();
        Some(chosen.iter().map(|&c| if total > 0.0 { c / total } else { 0.0 }).collect())
    }
    /// With a packed frozen base: the layout's own tensors (no adapters:
    /// [`Family::start_from_pretrained`] adds them) read from `source`.
    fn load_unfrozen(&self, source: &Path) -> Result<Vec<f32>> {
        Err(format!("{}: the {} family holds no packed frozen base", source.display(), self.name()).into())
    }
    /// This shape for a forward-only use (`generate`, `eval`) of the model
    /// file `source`, holding its projections as the file stores them (a
    /// GGUF's Q8_0 / Q4_0 / Q4_1 blocks, 16-bit halves) instead of
    /// dequantised to f32: its layout is then the other tensors, read with
    /// [`Family::load_unfrozen`]. The packed GEMMs compute what the f32
    /// model computes on the dequantised values, to the bit. `None` when the
    /// family keeps every tensor f32, or the file's projections have no
    /// packed form (F32).
    fn packed_for_inference(&self, source: &Path) -> Result<Option<Arc<dyn Family>>> {
        let _ = source;
        Ok(None)
    }
}

/// How the binary finds a family: its names and its constructors. Each
/// family crate exports one, and the binary lists it once.
pub trait Registration: Sync {
    /// The `model.family` value, which is also Hugging Face's `model_type`
    /// in `config.json` (`gpt2`).
    fn family(&self) -> &'static str;
    /// The presets `model.preset` may name.
    fn presets(&self) -> &'static [&'static str];
    /// The GGUF `general.architecture` this family loads, if any.
    fn gguf_architecture(&self) -> Option<&'static str> {
        None
    }
    /// The shape `[model]` (and `[lora]`, when given) describe; `m.family`
    /// is this family's.
    fn for_config(&self, m: &ModelConfig, lora: Option<&toml::Table>) -> Result<Arc<dyn Family>>;
    /// The shape of the model folder `dir`, whose `config.json` is `config`
    /// (adapter files beside it are the family's to read).
    fn for_hf_dir(&self, dir: &Path, config: &serde_json::Value) -> Result<Arc<dyn Family>>;
    /// The shape of an open GGUF file (metadata only).
    fn gguf_shape(&self, file: gguf::GgufFile) -> Result<Arc<dyn Family>> {
        Err(format!("{}: the {} family reads no GGUF files", file.path().display(), self.family()).into())
    }
    /// The shape and weights of an open GGUF file.
    fn load_gguf(&self, file: gguf::GgufFile) -> Result<Loaded> {
        Err(format!("{}: the {} family reads no GGUF files", file.path().display(), self.family()).into())
    }
}

/// A family's typed `[model]` keys from the table as written: a key the
/// family does not have is named with the fix (`keys` lists the ones it
/// has), a mistyped value with serde's message.
pub fn parse_section<T: DeserializeOwned>(family: &str, keys: &[&str], table: &toml::Table) -> Result<T> {
    if let Some(k) = table.keys().find(|k| !keys.contains(&k.as_str())) {
        return Err(format!(
            "model.{k} does not apply to model.family = \"{family}\"; remove it (its keys: {})",
            keys.join(", ")
        )
        .into());
    }
    toml::Value::Table(table.clone()).try_into().map_err(|e| ModelError::from(format!("[model] for {family}: {e}")))
}

/// `params` (laid out as `packed`) in `layout`, which holds the same
/// tensors and the frozen ones `dequantized` gives by name (`None`: a
/// tensor neither has, an error naming it).
pub fn unpack(
    (layout, packed): (&ParamLayout, &ParamLayout),
    params: &[f32],
    dequantized: impl Fn(&str) -> Option<Vec<f32>>,
) -> Result<Vec<f32>> {
    check_count(Path::new("the packed parameters"), packed, params.len())?;
    let mut out = vec![0.0; layout.n_params()];
    for t in layout.tensors() {
        let values = match packed.get(&t.name) {
            Some(s) => std::borrow::Cow::Borrowed(&params[s.range()]),
            None => std::borrow::Cow::Owned(
                dequantized(&t.name)
                    .ok_or_else(|| format!("tensor `{}` is neither packed nor in the layout", t.name))?,
            ),
        };
        if values.len() != t.numel() {
            return Err(format!(
                "tensor `{}`: {} values, its shape {:?} holds {}",
                t.name,
                values.len(),
                t.shape,
                t.numel()
            )
            .into());
        }
        out[t.range()].copy_from_slice(&values);
    }
    Ok(out)
}

/// Errors unless `n` values fill `layout` (the folder `dir` is named).
pub fn check_count(dir: &Path, layout: &ParamLayout, n: usize) -> Result<()> {
    match layout.n_params() == n {
        true => Ok(()),
        false => Err(format!("{}: {n} parameters given, the model has {}", dir.display(), layout.n_params()).into()),
    }
}

/// Errors on tensor-parallel rank `tp` of a split: `what` (files, merging)
/// needs the whole model.
pub fn whole_only(tp: engine::TpRank, what: &str) -> Result<()> {
    match tp.is_split() {
        true => {
            Err(format!("{what} needs the whole model, not tensor-parallel rank {} of {}", tp.rank, tp.size).into())
        }
        false => Ok(()),
    }
}

/// `[model]` pinned to `family`, its keys replaced by `section` (fields
/// left `None` are omitted) and its preset dropped: the shape is no preset's.
pub fn pin_section(m: &mut ModelConfig, family: &str, section: &impl Serialize) {
    m.family = family.to_string();
    m.preset = None;
    m.shape = toml::Table::try_from(section).unwrap_or_default();
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A model that only has statistics of its own, to see what `Erased`
    /// passes on: every provided method of `Model` must reach the family's
    /// model (a default would report zeros where the model has sums).
    struct Stats(ParamLayout, u64);

    impl Model for Stats {
        type Batch = TokenBatch;
        type Error = std::io::Error;
        fn layout(&self) -> &ParamLayout {
            &self.0
        }
        fn set_trainable(&mut self, _: &dyn Fn(&TensorSpec) -> bool) -> usize {
            0
        }
        fn n_targets(&self, _: &TokenBatch) -> u64 {
            0
        }
        fn micro_step(
            &mut self,
            _: &mut dyn ParamStore,
            _: &TokenBatch,
            _: f32,
        ) -> Result<MicroStepStats, Self::Error> {
            Err(std::io::Error::other("not for this test"))
        }
        fn loss(&mut self, _: &mut dyn ParamStore, _: &TokenBatch) -> Result<MicroStepStats, Self::Error> {
            Err(std::io::Error::other("not for this test"))
        }
        fn take_aux_stats(&mut self) -> engine::AuxStats {
            [1.5, -2.0, 0.25, self.1 as f64]
        }
        fn begin_step(&mut self, step: u64) {
            self.1 = step;
        }
        fn segments(&self) -> Vec<Range<usize>> {
            vec![0..1, 1..3]
        }
    }

    impl StagedModel for Stats {
        fn n_blocks(&self) -> usize {
            0
        }
        fn tied_head(&self) -> bool {
            false
        }
        fn set_stage(&mut self, _: StageSpec) {}
        fn boundary_len(&self, _: &TokenBatch) -> usize {
            0
        }
        fn stage_forward(
            &mut self,
            _: &mut dyn ParamStore,
            _: &TokenBatch,
            _: usize,
            _: &[f32],
            _: &mut [f32],
            _: Option<f32>,
        ) -> Result<MicroStepStats, Self::Error> {
            Err(std::io::Error::other("not for this test"))
        }
        fn stage_backward(
            &mut self,
            _: &mut dyn ParamStore,
            _: &TokenBatch,
            _: usize,
            _: &[f32],
            _: &mut [f32],
        ) -> Result<(), Self::Error> {
            Err(std::io::Error::other("not for this test"))
        }
    }

    impl TextModel for Stats {
        fn activation_bytes(&self) -> usize {
            0
        }
        fn saved_activation_bytes(&self) -> usize {
            0
        }
        fn next_token_logits(&mut self, _: &[f32], _: &[u32]) -> Result<Vec<f32>, Self::Error> {
            Ok(Vec::new())
        }
        fn set_kv_cache(&mut self, _: usize) -> Result<(), Self::Error> {
            Ok(())
        }
        fn set_loss_terms(&mut self, _: engine::LossTerms) {}
    }

    #[test]
    fn erased_passes_on_the_models_own_statistics_and_step() {
        let mut m: Box<dyn LanguageModel> = Box::new(Erased(Stats(ParamLayout::new(), 0)));
        m.begin_step(7);
        assert_eq!(m.take_aux_stats(), [1.5, -2.0, 0.25, 7.0]);
        assert_eq!(m.segments(), [0..1, 1..3]);
    }

    #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Shape {
        n_layer: Option<usize>,
        rope_theta: Option<f64>,
    }

    #[test]
    fn gguf_tensors_make_their_values_from_their_source() {
        let src: Vec<f32> = (0..8).map(|v| v as f32).collect();
        let same = GgufTensor::new("a", &[2, 4], &src, GgufLayout::Same);
        assert_eq!((same.ne.clone(), same.values().into_owned()), (vec![4, 2], src.clone()));
        // [in = 2, out = 4] → [4, 2]: row o holds column o of the source.
        let tr = GgufTensor::new("b", &[4, 2], &src, GgufLayout::Transpose);
        assert_eq!(tr.ne, [2, 4]);
        assert_eq!(tr.values().into_owned(), [0.0, 4.0, 1.0, 5.0, 2.0, 6.0, 3.0, 7.0]);
        // One head of 4 rows: rows (0, 1 | 2, 3) interleave as 0, 2, 1, 3,
        // for a [4, 2] matrix and a [4] bias alike.
        let m = GgufTensor::new("c", &[4, 2], &src, GgufLayout::PermuteRows { heads: 1 });
        assert_eq!(m.values().into_owned(), [0.0, 1.0, 4.0, 5.0, 2.0, 3.0, 6.0, 7.0]);
        let b = GgufTensor::new("d", &[4], &src[..4], GgufLayout::PermuteRows { heads: 1 });
        assert_eq!(b.values().into_owned(), [0.0, 2.0, 1.0, 3.0]);
    }

    #[test]
    fn sections_parse_typed_and_name_foreign_keys() {
        let t: toml::Table = toml::from_str("n_layer = 3\nrope_theta = 10000").unwrap_or_default();
        let s: Shape = parse_section("x", &["n_layer", "rope_theta"], &t).unwrap_or_else(|e| panic!("{e}"));
        // An integer where a float is expected reads as the float (--set model.rope_theta=10000).
        assert_eq!(s, Shape { n_layer: Some(3), rope_theta: Some(10000.0) });
        let e = parse_section::<Shape>("x", &["n_layer"], &t).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("model.rope_theta does not apply to model.family = \"x\""), "{e}");
        let bad: toml::Table = toml::from_str("n_layer = \"four\"").unwrap_or_default();
        let e = parse_section::<Shape>("x", &["n_layer"], &bad).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("[model] for x") && e.contains("n_layer"), "{e}");
        let mut m = ModelConfig::default();
        pin_section(&mut m, "x", &Shape { n_layer: Some(2), rope_theta: None });
        assert_eq!((m.family.as_str(), m.shape.len()), ("x", 1));
    }
}
