//! The model-family boundary of the binary. Planning, training, memory
//! checks, checkpoints, Hugging Face I/O and generation see a model only
//! through [`Family`] (a shape: sizes, initialisation, files) and
//! [`LanguageModel`] (a built model: the engine's `Model` contract plus
//! sampling), so a new family plugs in here — one `impl` and one arm in
//! [`from_config`] / [`read_hf_config`] — without touching the CLI's logic.

use anyhow::{bail, Context, Result};
use config::{LoraConfig, ModelConfig, ModelFamily};
use engine::{Checkpointing, MicroStepStats, Model, ParamLayout, ParamStore, Precision, TensorSpec, TokenBatch};
use gpt::{Gpt, GptConfig};
use llama::{Llama, LlamaConfig};
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

/// The weights file of a model folder (Hugging Face's name).
pub const WEIGHTS_FILE: &str = gpt::hf::WEIGHTS_FILE;
/// The config file of a model folder (Hugging Face's name).
pub const CONFIG_FILE: &str = gpt::hf::CONFIG_FILE;

/// A family and parameters of one model.
pub type Loaded = (Arc<dyn Family>, Vec<f32>);

/// A model error of any family (the family's own error, boxed).
#[derive(Debug)]
pub struct ModelError(Box<dyn std::error::Error + Send + Sync>);

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

fn erase(e: impl std::error::Error + Send + Sync + 'static) -> ModelError {
    ModelError(Box::new(e))
}

/// A built model as the binary uses it: the engine's contract on token
/// batches, plus what sampling and memory reports need.
pub trait LanguageModel: Model<Batch = TokenBatch, Error = ModelError> + Send {
    /// Bytes of activation and scratch buffers allocated so far.
    fn activation_bytes(&self) -> usize;
    /// Of those, the bytes saved for backward.
    fn saved_activation_bytes(&self) -> usize;
    /// Logits of the token after `tokens` (at most the context length).
    fn next_token_logits(&mut self, params: &[f32], tokens: &[u32]) -> Result<Vec<f32>, ModelError>;
}

/// Adapts a family's model (with its own error type) to [`LanguageModel`].
pub struct Erased<M>(pub M);

impl<M: Model<Batch = TokenBatch>> Model for Erased<M> {
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
        self.0.micro_step(store, batch, loss_seed).map_err(erase)
    }

    fn loss(&mut self, store: &mut dyn ParamStore, batch: &TokenBatch) -> Result<MicroStepStats, ModelError> {
        self.0.loss(store, batch).map_err(erase)
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
}

/// [`LanguageModel`] for a family's model type, whose inherent methods
/// `activation_bytes`, `saved_activation_bytes` and `next_token_logits` it
/// forwards to.
macro_rules! language_model {
    ($($model:ty),*) => {$(
        impl LanguageModel for Erased<$model> {
            fn activation_bytes(&self) -> usize {
                self.0.activation_bytes()
            }

            fn saved_activation_bytes(&self) -> usize {
                self.0.saved_activation_bytes()
            }

            fn next_token_logits(&mut self, params: &[f32], tokens: &[u32]) -> Result<Vec<f32>, ModelError> {
                self.0.next_token_logits(params, tokens).map_err(erase)
            }
        }
    )*};
}

language_model!(Gpt, Llama);

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
    /// micro-batch of `micro` sequences of `seq_len` tokens (a lower bound).
    fn activation_bytes(&self, micro: usize, seq_len: usize, build: Build) -> u128;
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
    /// With adapters: the plain model with them merged into its weights
    /// (W + α/r·B·A), as a family and parameters; `None` without adapters.
    fn merged(&self, params: &[f32]) -> Result<Option<Loaded>> {
        let _ = params;
        Ok(None)
    }
    /// Writes this shape into `[model]`, so a resolved config rebuilds it.
    fn pin_shape(&self, m: &mut ModelConfig);
}

/// The family and shape `[model]` (and `[lora]`) ask for.
pub fn from_config(m: &ModelConfig, lora: Option<&LoraConfig>) -> Result<Arc<dyn Family>> {
    match m.family {
        ModelFamily::Gpt2 => {
            if lora.is_some() {
                bail!("[lora] applies to model.family = \"llama\"; remove the [lora] section for gpt2");
            }
            Ok(Arc::new(Gpt2::from_config(m)?))
        }
        ModelFamily::Llama => Ok(Arc::new(LlamaFamily::from_config(m, lora)?)),
    }
}

/// The family and shape of the `config.json` in `dir` (by its `model_type`).
pub fn read_hf_config(dir: &Path) -> Result<Arc<dyn Family>> {
    if is_gguf(dir) {
        let cfg = LlamaConfig::from_hf_json(gguf::llama::LlamaGguf::open(dir)?.config())?;
        return Ok(Arc::new(LlamaFamily::new(cfg, None)?));
    }
    let path = dir.join(CONFIG_FILE);
    let text = std::fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
    let json: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{} is not valid JSON", path.display()))?;
    match json.get("model_type").and_then(|v| v.as_str()) {
        Some("gpt2") | None => Ok(Arc::new(Gpt2(gpt::hf::load_config(&path)?))),
        Some("llama") => {
            let cfg = llama::hf::load_config(&path)?;
            // A LoRA run's folder holds PEFT's adapter files beside the base.
            let adapter = dir.join(llama::lora::ADAPTER_CONFIG_FILE);
            let lora = if adapter.exists() {
                let text =
                    std::fs::read_to_string(&adapter).with_context(|| format!("cannot read {}", adapter.display()))?;
                let v: serde_json::Value =
                    serde_json::from_str(&text).with_context(|| format!("{} is not valid JSON", adapter.display()))?;
                Some(llama::lora::lora_config_from_peft(&v)?.0)
            } else if dir.join(llama::lora::ADAPTER_WEIGHTS_FILE).exists() || json.get("macrobatch_lora").is_some() {
                // Adapters were saved here, but without their config they
                // cannot be applied: never silently the base alone.
                bail!(
                    "{}: the folder holds LoRA adapters (adapter_model.safetensors, or \"macrobatch_lora\" in config.json) but {} is missing, so they cannot be applied and the model would silently be the base alone; put the run's {} back beside them (or move the adapter files away to load the base on purpose)",
                    dir.display(),
                    llama::lora::ADAPTER_CONFIG_FILE,
                    llama::lora::ADAPTER_CONFIG_FILE
                );
            } else {
                None
            };
            Ok(Arc::new(LlamaFamily::new(cfg, lora)?))
        }
        Some(other) => bail!(
            "{}: model_type `{other}` is not a family macrobatch knows (it trains gpt2 and llama)",
            path.display()
        ),
    }
}

/// Whether `path` is a GGUF model file (by its name).
pub fn is_gguf(path: &Path) -> bool {
    path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
}

/// A saved model — a Hugging Face folder (`config.json` + weights, with
/// PEFT adapters beside them) or a GGUF file (Llama; dequantised to f32, Q/K
/// un-permuted to Hugging Face's layout) — as its family and parameters.
pub fn load_hf(dir: &Path) -> Result<Loaded> {
    if is_gguf(dir) {
        // One tensor dequantised at a time, placed, then dropped: loading
        // holds the parameters and one tensor, never a second full copy.
        let file = gguf::llama::LlamaGguf::open(dir)?;
        let cfg = LlamaConfig::from_hf_json(file.config())?;
        let mut failed = None;
        let tensors = file.tensor_names().into_iter().map_while(|(g, _)| match file.tensor(&g) {
            Ok(t) => Some(t),
            Err(e) => {
                failed = Some(e);
                None
            }
        });
        let params = llama::hf::from_named_tensors(&cfg, tensors);
        if let Some(e) = failed {
            return Err(e.into());
        }
        let params = params?;
        let family = LlamaFamily::new(cfg, None)?;
        check_finite(family.model.layout(), &params, dir)?;
        return Ok((Arc::new(family), params));
    }
    let family = read_hf_config(dir)?;
    let model = family.build(Build::default())?;
    let params = family.load_weights(dir, model.layout())?;
    check_finite(model.layout(), &params, dir)?;
    Ok((family, params))
}

/// Every loaded weight is finite; else the first NaN or infinity is named by
/// tensor and element (a damaged file, or one saved after a diverged step,
/// would otherwise surface as a NaN loss blamed on the learning rate).
pub fn check_finite(layout: &ParamLayout, params: &[f32], source: &Path) -> Result<()> {
    let Some(n) = crate::checkpoint::first_non_finite(layout, params) else { return Ok(()) };
    bail!(
        "{}: tensor `{}` (shape {:?}) holds {} at element {:?}, {} non-finite value(s) in all; the weights are damaged or were saved after training diverged. Load another copy of the model (or an earlier checkpoint)",
        source.display(),
        n.tensor,
        n.shape,
        n.value,
        n.index,
        n.count
    );
}

/// Llama (the `llama` crate), optionally with LoRA adapters on a frozen base.
#[derive(Debug, Clone)]
pub struct LlamaFamily {
    cfg: LlamaConfig,
    lora: Option<LoraConfig>,
    /// The layout (no activations): segments, initialisation, names.
    model: Arc<Llama>,
}

impl LlamaFamily {
    /// The family at `cfg`, with adapters when `lora` is given.
    pub fn new(cfg: LlamaConfig, lora: Option<LoraConfig>) -> Result<Self> {
        let model = Self::build_with(&cfg, lora.as_ref(), Precision::F32)?;
        Ok(Self { cfg, lora, model: Arc::new(model) })
    }

    fn build_with(cfg: &LlamaConfig, lora: Option<&LoraConfig>, precision: Precision) -> Result<Llama> {
        Ok(match lora {
            Some(l) => Llama::with_lora(cfg.clone(), l.clone(), precision)?,
            None => Llama::with_precision(cfg.clone(), precision)?,
        })
    }

    /// The preset with single dimensions overridden.
    fn from_config(m: &ModelConfig, lora: Option<&LoraConfig>) -> Result<Self> {
        let base = LlamaConfig::preset(&m.preset).context("model.preset")?;
        let hidden = m.n_embd.unwrap_or(base.hidden_size);
        let n_head = m.n_head.unwrap_or(base.n_head);
        let cfg = LlamaConfig {
            vocab_size: m.vocab_size.unwrap_or(base.vocab_size),
            hidden_size: hidden,
            intermediate_size: m.intermediate_size.unwrap_or(base.intermediate_size),
            n_layer: m.n_layer.unwrap_or(base.n_layer),
            n_head,
            n_kv_head: m.n_kv_head.unwrap_or(base.n_kv_head),
            head_dim: hidden.checked_div(n_head).unwrap_or(0),
            rms_norm_eps: m.rms_norm_eps.unwrap_or(base.rms_norm_eps),
            rope_theta: m.rope_theta.unwrap_or(base.rope_theta),
            max_position_embeddings: m.block_size.unwrap_or(base.max_position_embeddings),
            tie_word_embeddings: m.tie_word_embeddings.unwrap_or(base.tie_word_embeddings),
            bos_token_id: m.bos_token_id.or(base.bos_token_id),
            eos_token_id: m.eos_token_id.clone().unwrap_or(base.eos_token_id),
            attention_bias: base.attention_bias,
            rope_scaling: base.rope_scaling,
        };
        cfg.validate()?;
        Self::new(cfg, lora.cloned())
    }
}

impl Family for LlamaFamily {
    fn name(&self) -> &'static str {
        "Llama"
    }

    fn describe(&self) -> String {
        let c = &self.cfg;
        let lora = self
            .lora
            .as_ref()
            .map_or(String::new(), |l| format!(", LoRA r={} alpha={} on {}", l.r, l.alpha, l.target_modules.join(",")));
        format!(
            "{} layers, d={}, {} heads / {} KV heads, FFN {}{}",
            c.n_layer, c.hidden_size, c.n_head, c.n_kv_head, c.intermediate_size, lora
        )
    }

    fn n_params(&self) -> u128 {
        // The layout knows the adapters too (70B is 6.9e10: far inside usize).
        self.model.layout().n_params() as u128
    }

    fn vocab_size(&self) -> usize {
        self.cfg.vocab_size
    }

    fn max_seq_len(&self) -> usize {
        self.cfg.max_position_embeddings
    }

    fn flops_per_token(&self, seq_len: usize) -> f64 {
        self.cfg.flops_per_token(seq_len)
    }

    fn activation_bytes(&self, micro: usize, seq_len: usize, build: Build) -> u128 {
        self.model.planned_activation_bytes_as(micro, seq_len, build.precision, build.checkpointing)
    }

    fn build(&self, build: Build) -> Result<Box<dyn LanguageModel>> {
        let model = Self::build_with(&self.cfg, self.lora.as_ref(), build.precision)?;
        Ok(Box::new(Erased(model.with_checkpointing(build.checkpointing))))
    }

    fn init_segment(&self, seed: u64, seg: usize) -> Vec<f32> {
        self.model.init_segment(seed, seg)
    }

    fn hf_config(&self) -> serde_json::Value {
        let mut v = self.cfg.to_hf_json();
        if let (Some(l), Some(o)) = (&self.lora, v.as_object_mut()) {
            // Not a transformers key: makes a LoRA shape differ from its base.
            o.insert("macrobatch_lora".into(), serde_json::to_value(l).unwrap_or_default());
        }
        v
    }

    /// The base as Hugging Face Llama files and, with adapters, the
    /// adapters in PEFT's format beside them (`PeftModel.from_pretrained(base, DIR)`).
    fn save_hf(&self, dir: &Path, layout: &ParamLayout, params: &[f32]) -> Result<()> {
        if layout.n_params() != params.len() {
            bail!("{} parameters to save, the model has {}", params.len(), layout.n_params());
        }
        llama::hf::save_base(dir, &self.model, params)?;
        if self.lora.is_some() {
            llama::lora::save_adapter(dir, &self.model, params, None)?;
        }
        Ok(())
    }

    fn start_from_pretrained(&self, params: Vec<f32>, seed: u64) -> Result<Vec<f32>> {
        let n = self.model.layout().n_params();
        match &self.lora {
            Some(_) if params.len() != n => Ok(llama::lora::attach(&self.model, &params, seed)?),
            _ => Ok(params),
        }
    }

    fn merged(&self, params: &[f32]) -> Result<Option<Loaded>> {
        if self.lora.is_none() {
            return Ok(None);
        }
        let merged = llama::lora::merge(&self.model, params)?;
        Ok(Some((Arc::new(LlamaFamily::new(self.cfg.clone(), None)?), merged)))
    }

    fn load_weights(&self, dir: &Path, layout: &ParamLayout) -> Result<Vec<f32>> {
        let base = llama::hf::load_weights(dir, &self.cfg)?;
        if self.lora.is_none() {
            return Ok(base);
        }
        // Adapters start as initialised (B = 0: the base's function), then
        // take the folder's trained ones when it has them.
        let mut params = llama::lora::attach(&self.model, &base, 0)?;
        if dir.join(llama::lora::ADAPTER_CONFIG_FILE).exists() {
            llama::lora::load_adapter(dir)?.apply(&self.model, &mut params)?;
        }
        if params.len() != layout.n_params() {
            bail!("{}: {} parameters loaded, the model has {}", dir.display(), params.len(), layout.n_params());
        }
        Ok(params)
    }

    fn pin_shape(&self, m: &mut ModelConfig) {
        let c = &self.cfg;
        m.family = ModelFamily::Llama;
        m.n_layer = Some(c.n_layer);
        m.n_head = Some(c.n_head);
        m.n_embd = Some(c.hidden_size);
        m.block_size = Some(c.max_position_embeddings);
        m.vocab_size = Some(c.vocab_size);
        m.n_kv_head = Some(c.n_kv_head);
        m.intermediate_size = Some(c.intermediate_size);
        m.rope_theta = Some(c.rope_theta);
        m.tie_word_embeddings = Some(c.tie_word_embeddings);
        m.rms_norm_eps = Some(c.rms_norm_eps);
        m.bos_token_id = c.bos_token_id;
        m.eos_token_id = Some(c.eos_token_id.clone());
    }
}

/// GPT-2 (the `gpt` crate).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Gpt2(pub GptConfig);

impl Gpt2 {
    /// The preset with single dimensions overridden.
    fn from_config(m: &ModelConfig) -> Result<Self> {
        let base = GptConfig::preset(&m.preset).context("model.preset")?;
        for (key, given) in [
            ("model.n_kv_head", m.n_kv_head.is_some()),
            ("model.intermediate_size", m.intermediate_size.is_some()),
            ("model.rope_theta", m.rope_theta.is_some()),
            ("model.tie_word_embeddings", m.tie_word_embeddings.is_some()),
            ("model.rms_norm_eps", m.rms_norm_eps.is_some()),
            ("model.bos_token_id", m.bos_token_id.is_some()),
            ("model.eos_token_id", m.eos_token_id.is_some()),
        ] {
            if given {
                bail!("{key} does not apply to model.family = \"gpt2\"; remove it");
            }
        }
        let g = GptConfig {
            n_layer: m.n_layer.unwrap_or(base.n_layer),
            n_head: m.n_head.unwrap_or(base.n_head),
            n_embd: m.n_embd.unwrap_or(base.n_embd),
            block_size: m.block_size.unwrap_or(base.block_size),
            vocab_size: m.vocab_size.unwrap_or(base.vocab_size),
        };
        g.validate()?;
        Ok(Self(g))
    }
}

impl Family for Gpt2 {
    fn name(&self) -> &'static str {
        "GPT-2"
    }

    fn describe(&self) -> String {
        format!("{} layers, d={}, {} heads", self.0.n_layer, self.0.n_embd, self.0.n_head)
    }

    fn n_params(&self) -> u128 {
        self.0.param_count()
    }

    fn vocab_size(&self) -> usize {
        self.0.vocab_size
    }

    fn max_seq_len(&self) -> usize {
        self.0.block_size
    }

    fn flops_per_token(&self, seq_len: usize) -> f64 {
        self.0.flops_per_token(seq_len)
    }

    fn activation_bytes(&self, micro: usize, seq_len: usize, build: Build) -> u128 {
        gpt::ActSizes::new(&self.0, micro, seq_len, build.precision, build.checkpointing).bytes()
    }

    fn build(&self, build: Build) -> Result<Box<dyn LanguageModel>> {
        let model = Gpt::with_precision(self.0, build.precision)?.with_checkpointing(build.checkpointing);
        Ok(Box::new(Erased(model)))
    }

    fn init_segment(&self, seed: u64, seg: usize) -> Vec<f32> {
        gpt::init_segment(&self.0, seed, seg)
    }

    fn hf_config(&self) -> serde_json::Value {
        gpt::hf::config_json(&self.0)
    }

    fn save_hf(&self, dir: &Path, layout: &ParamLayout, params: &[f32]) -> Result<()> {
        Ok(gpt::hf::save(dir, &self.0, layout, params)?)
    }

    fn load_weights(&self, dir: &Path, layout: &ParamLayout) -> Result<Vec<f32>> {
        Ok(gpt::hf::load_weights(&dir.join(WEIGHTS_FILE), layout)?)
    }

    fn pin_shape(&self, m: &mut ModelConfig) {
        m.family = ModelFamily::Gpt2;
        m.n_layer = Some(self.0.n_layer);
        m.n_head = Some(self.0.n_head);
        m.n_embd = Some(self.0.n_embd);
        m.block_size = Some(self.0.block_size);
        m.vocab_size = Some(self.0.vocab_size);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt2_parameter_count_matches_the_model() {
        for preset in ["tiny", "gpt2", "gpt2-xl"] {
            let g = GptConfig::preset(preset).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(Gpt2(g).n_params(), g.n_params() as u128, "{preset}");
        }
        // Hostile shapes do not overflow.
        let huge =
            GptConfig { n_embd: 1 << 40, n_head: 1, ..GptConfig::preset("gpt2").unwrap_or_else(|e| panic!("{e}")) };
        assert!(Gpt2(huge).n_params() > u64::MAX as u128);
    }

    /// The estimate is exact: it equals what the model allocates, for every
    /// precision and checkpointing choice (an estimate that drifts from the
    /// model would let the memory check pass runs that abort).
    #[test]
    fn gpt2_activation_estimate_equals_the_allocation() {
        use engine::FullStore;
        let g = GptConfig { n_layer: 3, n_head: 2, n_embd: 16, block_size: 8, vocab_size: 37 };
        let family = Gpt2(g);
        let params = gpt::init_params(&g, 1);
        for precision in [Precision::F32, Precision::Bf16, Precision::F16] {
            for checkpointing in [Checkpointing::None, Checkpointing::Blocks, Checkpointing::EveryK(2)] {
                let build = Build { precision, checkpointing };
                let mut model = family.build(build).unwrap_or_else(|e| panic!("{e:#}"));
                let (b, t) = (3, 8);
                let batch = TokenBatch { n_seqs: b, seq_len: t, inputs: vec![1; b * t], targets: vec![2; b * t] };
                let mut grads = vec![0.0; params.len()];
                let mut store = FullStore::for_model(&model, &params, &mut grads).unwrap_or_else(|e| panic!("{e}"));
                model.micro_step(&mut store, &batch, 1.0).unwrap_or_else(|e| panic!("{e}"));
                drop(store);
                let want = model.activation_bytes() as u128;
                assert_eq!(family.activation_bytes(b, t, build), want, "{precision} {checkpointing}");
            }
        }
    }

    #[test]
    fn shape_round_trips_through_the_model_section() {
        let mut m = ModelConfig { preset: "mini".into(), n_layer: Some(3), ..ModelConfig::default() };
        let f = from_config(&m, None).unwrap_or_else(|e| panic!("{e:#}"));
        let mut pinned = ModelConfig { preset: "tiny".into(), ..ModelConfig::default() };
        f.pin_shape(&mut pinned);
        let g = from_config(&pinned, None).unwrap_or_else(|e| panic!("{e:#}"));
        assert_eq!(f.hf_config(), g.hf_config());
        m.n_kv_head = Some(2);
        let e = from_config(&m, None).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("model.n_kv_head"), "{e}");
    }
}
