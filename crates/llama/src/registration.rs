//! The Llama block as families of the binary. A [`Dialect`] says how one
//! family built on this block names itself, which presets it has and how it
//! reads and writes `config.json`; everything else — the model, its files,
//! LoRA adapters in PEFT's format, GGUF — is this module's, once. Llama is
//! the dialect [`LLAMA`]; a family such as Qwen2 is another dialect in its
//! own crate and registers with [`Registered`].

use crate::dialect::{Dialect, Names};
use crate::frozen::{self, FrozenBase, FrozenFormat};
use crate::frozen_load;
use crate::{hf, import, lora, Llama, LlamaConfig, LlamaError, LoraConfig, Proj};
use config::ModelConfig;
use engine::{Model, ParamLayout, Precision, TpRank};
use family::{
    BoxError, Build, Family, FrozenBytes, FrozenStorage, LanguageModel, Loaded, PackedSource, Registration, Result,
};
use nn::linear::PackFormat;
use std::path::{Path, PathBuf};
use std::sync::Arc;

mod section;
use section::Section;

/// Llama itself (SmolLM2, Llama 2 shapes).
#[derive(Debug)]
pub struct LlamaDialect;

/// Llama's dialect.
pub static LLAMA: LlamaDialect = LlamaDialect;

/// Llama's registration: `model.family = "llama"`, `model_type: "llama"`,
/// GGUF architecture `llama`.
pub static FAMILY: Registered = Registered(&LLAMA);

impl Dialect for LlamaDialect {
    fn names(&self) -> Names {
        Names { family: "llama", name: "Llama", presets: crate::config::PRESETS }
    }

    fn preset(&self, name: &str) -> Result<LlamaConfig> {
        Ok(LlamaConfig::preset(name)?)
    }

    fn parse_hf_json(&self, v: &serde_json::Value) -> Result<LlamaConfig> {
        Ok(LlamaConfig::from_hf_json(v)?)
    }

    fn hf_json(&self, cfg: &LlamaConfig) -> serde_json::Value {
        cfg.to_hf_json()
    }

    fn gguf_arch(&self) -> Option<crate::export::GgufArch> {
        Some(crate::export::GgufArch::plain("llama", true))
    }
}

/// A family on the Llama block, as the binary finds it.
#[derive(Debug)]
pub struct Registered(pub &'static dyn Dialect);

impl Registration for Registered {
    fn family(&self) -> &'static str {
        self.0.family()
    }

    fn presets(&self) -> &'static [&'static str] {
        self.0.presets()
    }

    fn gguf_architecture(&self) -> Option<&'static str> {
        self.0.gguf_architecture()
    }

    fn for_config(&self, m: &ModelConfig, lora: Option<&toml::Table>) -> Result<Arc<dyn Family>> {
        let lora = lora.map(parse_lora).transpose()?;
        Ok(Arc::new(LlamaFamily::from_config(self.0, m, lora)?))
    }

    fn for_hf_dir(&self, dir: &Path, config: &serde_json::Value) -> Result<Arc<dyn Family>> {
        let path = dir.join(family::CONFIG_FILE);
        let cfg = self.0.parse_hf_json(config).map_err(|e| format!("{}: {e}", path.display()))?;
        // A LoRA run's folder holds PEFT's adapter files beside the base.
        let lora = nn::lora::config_beside(dir, config, &lora::ANY_TARGETS).map_err(LlamaError::from)?;
        Ok(Arc::new(LlamaFamily::new(self.0, cfg, lora)?))
    }

    fn gguf_shape(&self, file: gguf::GgufFile) -> Result<Arc<dyn Family>> {
        let (cfg, _) = import::open(self.0, file)?;
        Ok(Arc::new(LlamaFamily::new(self.0, cfg, None)?))
    }

    fn load_gguf(&self, file: gguf::GgufFile) -> Result<Loaded> {
        // One tensor dequantised at a time, placed, then dropped: loading
        // holds the parameters and one tensor, never a second full copy.
        let (cfg, file) = import::open(self.0, file)?;
        let names: Vec<String> = file.tensor_names().into_iter().map(|(g, _)| g).collect();
        let layout = Llama::new(cfg.clone())?.layout().clone();
        let params = hf::from_gguf_into((layout, cfg.fused_weights()), &cfg, &file, &names)?;
        Ok((Arc::new(LlamaFamily::new(self.0, cfg, None)?), params))
    }
}

/// `[lora]` as written: PEFT's fields, α defaulting to PEFT's 8.
pub fn parse_lora(table: &toml::Table) -> Result<LoraConfig> {
    let l: LoraConfig = toml::Value::Table(table.clone()).try_into().map_err(|e| format!("[lora]: {e}"))?;
    l.validate(&lora::ANY_TARGETS).map_err(LlamaError::from)?;
    Ok(l)
}

/// A family on the Llama block at one shape, optionally with LoRA adapters
/// on a frozen base.
#[derive(Debug, Clone)]
pub struct LlamaFamily {
    dialect: &'static dyn Dialect,
    cfg: LlamaConfig,
    lora: Option<LoraConfig>,
    /// The layout (no activations): segments, initialisation, names.
    model: Arc<Llama>,
    /// The tensor-parallel rank this shape is held by (whole: every tensor).
    tp: TpRank,
    /// The frozen projections packed outside the layout, if so.
    packed: Option<Arc<PackedBase>>,
}

/// A frozen base kept packed: the family whose file it is (a GGUF file's
/// names are its architecture's), the format it is packed in, and the
/// file, bytes and base itself.
#[derive(Debug)]
struct PackedBase {
    dialect: &'static dyn Dialect,
    format: FrozenFormat,
    /// Whether the token embedding is kept packed too (forward passes only).
    embed: bool,
    base: PackedSource<FrozenBase>,
}

impl PackedBase {
    /// The base, read from the source on first use; also the layout's other
    /// tensors when they were read now (`None`: the base was loaded before).
    fn get(&self, cfg: &LlamaConfig, want_rest: bool) -> Result<(Arc<FrozenBase>, Option<Vec<f32>>)> {
        self.base.get(want_rest, &|source, rest| self.read(cfg, source, rest))
    }

    /// The base from `source` and, when asked, the layout's other tensors.
    fn read(&self, cfg: &LlamaConfig, source: &Path, rest: bool) -> std::result::Result<Read, BoxError> {
        let layout = match (rest, self.embed) {
            (true, false) => Some(Llama::with_packed_layout(cfg.clone(), None)?.layout().clone()),
            (true, true) => Some(Llama::with_packed_embedding_layout(cfg.clone(), None)?.layout().clone()),
            (false, _) => None,
        };
        Ok(frozen_load::load((self.dialect, cfg), source, (self.format, self.embed), layout)?)
    }
}

/// A base and the other tensors read with it.
type Read = (FrozenBase, Option<Vec<f32>>);

impl LlamaFamily {
    /// `dialect`'s family at `cfg`, with adapters when `lora` is given.
    pub fn new(dialect: &'static dyn Dialect, cfg: LlamaConfig, lora: Option<LoraConfig>) -> Result<Self> {
        let model = Self::build_with(&cfg, lora.as_ref(), Precision::F32, TpRank::WHOLE)?;
        Ok(Self { dialect, cfg, lora, model: Arc::new(model), tp: TpRank::WHOLE, packed: None })
    }

    /// This shape with its projections packed as `format` (`stored`: the
    /// source's projections, their stored types and packed forms), and its
    /// token embedding as `embed` when given (forward passes only), read
    /// from `source` on first use; `key` names the setting in errors.
    fn packed_family(
        &self,
        (key, source): (&str, Option<PathBuf>),
        format: FrozenFormat,
        stored: &[(String, String, Option<PackFormat>)],
        embed: Option<PackFormat>,
    ) -> Result<Arc<dyn Family>> {
        let cfg = &self.cfg;
        let shape = |name: &str| frozen::proj_of(name).map_or(Proj::Q, |(_, p)| p).shape(cfg);
        let all_in = |f| FrozenBase::planned_bytes(cfg, |_| f);
        let (formats, bytes) = format.planned((key, source.as_deref()), stored, &shape, &all_in)?;
        let (model, formats, bytes) = match embed {
            None => (Llama::with_packed_layout(cfg.clone(), self.lora.clone())?, formats, bytes),
            Some(f) => {
                let formats =
                    if formats.split('+').any(|n| n == f.name()) { formats } else { format!("{formats}+{}", f.name()) };
                let bytes = bytes + f.bytes_for(cfg.vocab_size, cfg.hidden_size);
                (Llama::with_packed_embedding_layout(cfg.clone(), self.lora.clone())?, formats, bytes)
            }
        };
        let values = self.model.layout().n_params().saturating_sub(model.layout().n_params()) as u128;
        let planned = FrozenBytes { formats, bytes, values };
        let base = PackedSource::new(source, planned);
        let packed = PackedBase { dialect: self.dialect, format, embed: embed.is_some(), base };
        Ok(Arc::new(Self { model: Arc::new(model), packed: Some(Arc::new(packed)), ..self.clone() }))
    }

    fn build_with(
        cfg: &LlamaConfig,
        lora: Option<&LoraConfig>,
        precision: Precision,
        tp: TpRank,
    ) -> Result<Llama, LlamaError> {
        Llama::tensor_parallel(cfg.clone(), lora.cloned(), precision, tp)
    }

    /// Errors when this is one tensor-parallel rank's shape (`what` needs the whole model).
    fn whole(&self, what: &str) -> Result<()> {
        family::whole_only(self.tp, what)
    }
}

impl Family for LlamaFamily {
    fn name(&self) -> &'static str {
        self.dialect.name()
    }

    fn describe(&self) -> String {
        let c = &self.cfg;
        let lora = self
            .lora
            .as_ref()
            .map_or(String::new(), |l| format!(", LoRA r={} alpha={} on {}", l.r, l.alpha, l.target_modules.join(",")));
        let rank = if self.tp.is_split() { format!(", {}", self.tp) } else { String::new() };
        let mut attn = String::new();
        if c.q_dim() != c.hidden_size {
            attn += &format!(" of {}", c.head_dim);
        }
        if let Some(w) = c.sliding_window {
            attn += &format!(", window {w}");
            let windowed = (0..c.n_layer).filter(|&i| c.window_of(i).is_some()).count();
            if windowed < c.n_layer {
                attn += &format!(" on {windowed} of {} layers", c.n_layer);
            }
        }
        if let Some(g) = &c.gemma {
            let cap = |x: Option<f64>| x.map_or("none".to_string(), |x| x.to_string());
            attn += &format!(", soft caps {} / {}", cap(g.attn_softcap), cap(g.final_softcap));
        }
        format!(
            "{} layers, d={}, {} heads / {} KV heads{attn}, FFN {}{}{rank}",
            c.n_layer, c.hidden_size, c.n_head, c.n_kv_head, c.intermediate_size, lora
        )
    }

    fn tensor_parallel(&self, tp: TpRank) -> Result<Arc<dyn Family>> {
        if self.packed.is_some() && tp.is_split() {
            return Err(format!(
                "a packed frozen base is kept whole (dist.tensor_parallel = {}); set train.frozen_dtype = \"f32\" or dist.tensor_parallel = 1",
                tp.size
            )
            .into());
        }
        let model = Self::build_with(&self.cfg, self.lora.as_ref(), Precision::F32, tp)?;
        Ok(Arc::new(Self { model: Arc::new(model), tp, ..self.clone() }))
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
        self.model.planned_activation_bytes_as(micro, (seq_len, build.whole_len), build.precision, build.checkpointing)
    }

    fn stage_activation_bytes(&self, micro: usize, seq_len: usize, build: Build, spec: &engine::StageSpec) -> u128 {
        let how = (build.precision, build.checkpointing);
        self.model.planned_stage_activation_bytes(micro, (seq_len, build.whole_len), how, spec)
    }

    fn build(&self, build: Build) -> Result<Box<dyn LanguageModel>> {
        let model = match &self.packed {
            // A plan of a shape without its file: the layout alone (a pass is refused).
            Some(p) if p.base.source.is_none() => Llama::with_packed_layout(self.cfg.clone(), self.lora.clone())?,
            Some(p) => {
                let (base, _) = p.get(&self.cfg, false)?;
                Llama::with_frozen_base(self.cfg.clone(), self.lora.clone(), build.precision, base)?
            }
            None => Self::build_with(&self.cfg, self.lora.as_ref(), build.precision, self.tp)?,
        };
        Ok(Box::new(family::Erased(model.with_checkpointing(build.checkpointing))))
    }

    fn init_segment(&self, seed: u64, seg: usize) -> Vec<f32> {
        self.model.init_segment(seed, seg)
    }

    fn hf_config(&self) -> serde_json::Value {
        let mut v = self.dialect.hf_json(&self.cfg);
        if let (Some(l), Some(o)) = (&self.lora, v.as_object_mut()) {
            o.insert(nn::lora::CONFIG_KEY.into(), nn::lora::config_value(l, lora::targets_of(self.cfg.fused_modules)));
        }
        v
    }

    /// The base as Hugging Face files and, with adapters, the adapters in
    /// PEFT's format beside them (`PeftModel.from_pretrained(base, DIR)`).
    fn save_hf(&self, dir: &Path, layout: &ParamLayout, params: &[f32]) -> Result<()> {
        self.whole("saving Hugging Face files")?;
        if layout.n_params() != params.len() {
            return Err(format!("{} parameters to save, the model has {}", params.len(), layout.n_params()).into());
        }
        let base = self.packed.as_ref().map(|p| p.get(&self.cfg, false)).transpose()?.map(|(b, _)| b);
        let how = (base.as_deref(), self.cfg.fused_weights());
        hf::save_base_packed(dir, &self.model, params, how, &self.dialect.hf_json(&self.cfg))?;
        if self.lora.is_some() {
            lora::save_adapter(dir, &self.model, params, None)?;
        }
        Ok(())
    }

    fn save_adapters(&self, dir: &Path, layout: &ParamLayout, params: &[f32], base: &str) -> Result<()> {
        self.whole("saving adapters")?;
        family::check_count(dir, layout, params.len())?;
        Ok(lora::save_adapter(dir, &self.model, params, Some(base))?)
    }

    fn load_adapters(&self, dir: &Path, layout: &ParamLayout, params: &mut [f32]) -> Result<()> {
        self.whole("loading adapters")?;
        family::check_count(dir, layout, params.len())?;
        Ok(lora::load_adapter(dir)?.apply(&self.model, params)?)
    }

    fn unpacked(&self, params: &[f32]) -> Result<Option<Loaded>> {
        self.whole("unpacking the frozen base")?;
        let Some(p) = self.packed.as_ref().filter(|p| p.base.source.is_some()) else { return Ok(None) };
        let (base, _) = p.get(&self.cfg, false)?;
        let whole = LlamaFamily::new(self.dialect, self.cfg.clone(), self.lora.clone())?;
        let dequantized = |name: &str| frozen::proj_of(name).map(|(l, pr)| base.dequantize(&self.cfg, l, pr));
        let params = family::unpack((whole.model.layout(), self.model.layout()), params, dequantized)?;
        Ok(Some((Arc::new(whole), params)))
    }

    fn start_from_pretrained(&self, params: Vec<f32>, seed: u64) -> Result<Vec<f32>> {
        let n = self.model.layout().n_params();
        match &self.lora {
            Some(_) if params.len() != n => {
                // DoRA's magnitudes start at the packed base's row norms.
                let base = self.packed.as_ref().filter(|p| p.base.source.is_some());
                let base = base.map(|p| p.get(&self.cfg, false)).transpose()?.map(|(b, _)| b);
                Ok(lora::attach_with(&self.model, &params, seed, base.as_deref())?)
            }
            _ => Ok(params),
        }
    }

    fn merged(&self, params: &[f32]) -> Result<Option<Loaded>> {
        self.whole("merging adapters")?;
        if self.lora.is_none() {
            return Ok(None);
        }
        let base = self.packed.as_ref().map(|p| p.get(&self.cfg, false)).transpose()?.map(|(b, _)| b);
        let merged = lora::merge_with(&self.model, params, base.as_deref())?;
        Ok(Some((Arc::new(LlamaFamily::new(self.dialect, self.cfg.clone(), None)?), merged)))
    }

    fn load_weights(&self, dir: &Path, layout: &ParamLayout) -> Result<Vec<f32>> {
        self.whole("loading weights")?;
        if self.lora.is_none() {
            return Ok(hf::load_weights_stored_as(dir, &self.cfg, self.cfg.fused_weights())?);
        }
        // The base goes straight into the adapted layout (with a packed
        // base, the folder's projections are checked against it instead);
        // adapters start as initialised (B = 0: the base's function), then
        // take the folder's trained ones when it has them.
        let base = self.packed.as_ref().map(|p| p.get(&self.cfg, false)).transpose()?.map(|(b, _)| b);
        let mut params = hf::load_base_into_adapted(dir, &self.cfg, self.model.layout().clone(), base.as_deref())?;
        lora::init_in_place(&self.model, &mut params, 0, base.as_deref())?;
        if dir.join(lora::ADAPTER_CONFIG_FILE).exists() {
            lora::load_adapter(dir)?.apply(&self.model, &mut params)?;
        }
        if params.len() != layout.n_params() {
            return Err(format!(
                "{}: {} parameters loaded, the model has {}",
                dir.display(),
                params.len(),
                layout.n_params()
            )
            .into());
        }
        Ok(params)
    }

    fn with_frozen_storage(&self, s: &FrozenStorage) -> Result<Option<Arc<dyn Family>>> {
        if self.lora.is_none() {
            return family::no_adapters_to_pack(s);
        }
        let cfg = &self.cfg;
        let weights: Vec<_> = Proj::ALL.into_iter().map(|pr| (pr.name(), pr.shape(cfg))).collect();
        let stored_of = |p: &Path| {
            let stored = frozen_load::source_formats((self.dialect, cfg), p);
            Ok(stored.map_err(|e| format!("{}: {e}", p.display()))?)
        };
        let files = "a GGUF file or a Hugging Face folder";
        let Some((format, stored)) = family::frozen_packing(s, &stored_of, &weights, files)? else { return Ok(None) };
        let key = format!("train.frozen_dtype = \"{}\"", s.dtype.name());
        Ok(Some(self.packed_family((&key, s.source.clone()), format, &stored, None)?))
    }

    fn packed_for_inference(&self, source: &Path) -> Result<Option<Arc<dyn Family>>> {
        // An already packed shape and a tensor-parallel rank's are
        // training's; generation and evaluation load whole models (a LoRA
        // shape's base packed, its adapters in the layout). Packing reads
        // projections by their own names: fused files load whole.
        // A mixture's experts are not packed (yet): its files load whole.
        if self.packed.is_some() || self.tp.is_split() || self.cfg.fused_modules || self.cfg.moe.is_some() {
            return Ok(None);
        }
        let stored = frozen_load::source_formats((self.dialect, &self.cfg), source)
            .map_err(|e| format!("{}: {e}", source.display()))?;
        if stored.is_empty() || stored.iter().any(|(_, _, f)| f.is_none()) {
            return Ok(None);
        }
        let key = format!("reading {} packed", source.display());
        // The embedding stays packed when its type has a packed form (a
        // tied one is the head too; an untied head stays f32).
        let embed =
            frozen_load::embed_format(self.dialect, source).map_err(|e| format!("{}: {e}", source.display()))?;
        let packed = self.packed_family((&key, Some(source.to_path_buf())), FrozenFormat::Source, &stored, embed)?;
        Ok(Some(packed))
    }

    fn n_experts(&self) -> Option<usize> {
        self.cfg.moe.as_ref().map(|m| m.n_experts)
    }

    fn frozen_bytes(&self) -> Option<FrozenBytes> {
        self.packed.as_ref().map(|p| p.base.planned.clone())
    }

    fn load_unfrozen(&self, source: &Path) -> Result<Vec<f32>> {
        let Some(p) = &self.packed else {
            return Err(format!("{}: this {} shape holds no packed frozen base", source.display(), self.name()).into());
        };
        p.base.load_unfrozen(source, &|source, rest| p.read(&self.cfg, source, rest))
    }

    fn gguf_export<'a>(&self, layout: &ParamLayout, params: &'a [f32]) -> Result<family::GgufModel<'a>> {
        self.whole("writing a GGUF file")?;
        let arch = self.dialect.gguf_arch().ok_or_else(|| {
            format!("the {} family cannot be written as a GGUF file (export it as a Hugging Face folder)", self.name())
        })?;
        if self.lora.is_some() || self.packed.is_some() {
            return Err(format!(
                "this {} model has LoRA adapters: merge them into the base (Family::merged) before writing a GGUF file",
                self.name()
            )
            .into());
        }
        Ok(crate::export::gguf_model((arch, self.cfg.fused_weights()), self.dialect.name(), &self.cfg, layout, params)?)
    }

    fn pin_shape(&self, m: &mut ModelConfig) {
        let preset_window = self.dialect.preset(m.base_preset()).ok().and_then(|b| b.sliding_window);
        family::pin_section(m, self.dialect.family(), &Section::pinned(&self.cfg, preset_window));
    }

    fn position_keys(&self) -> &'static [&'static str] {
        // `max_position_embeddings` and `rope_scaling`: the rotary tables are computed, not learned.
        &["block_size", "rope_scaling"]
    }
}

family::text_model!(Llama, LlamaError);
