//! GPT-2 as a family of the binary: its `[model]` keys, presets,
//! `config.json` and files, behind the `family` crate's traits.

use crate::layout::TARGETS;
use crate::{hf, lora, FrozenBase, Gpt, GptConfig, GptError};
use config::ModelConfig;
use engine::{Model, ParamLayout, Precision, StagedModel, TpRank};
use family::FrozenFormat;
use family::{Build, Family, FrozenBytes, FrozenStorage, LanguageModel, PackedSource, Registration, Result};
use nn::linear::PackFormat;
use nn::lora::LoraConfig;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// GPT-2's registration: `model.family = "gpt2"`, `model_type: "gpt2"`.
pub static FAMILY: Gpt2Registration = Gpt2Registration;

/// The `model.family` name (and `config.json` `model_type`).
pub const NAME: &str = "gpt2";

/// What the binary finds GPT-2 by.
#[derive(Debug)]
pub struct Gpt2Registration;

impl Registration for Gpt2Registration {
    fn family(&self) -> &'static str {
        NAME
    }

    fn presets(&self) -> &'static [&'static str] {
        crate::config::PRESETS
    }

    fn for_config(&self, m: &ModelConfig, lora: Option<&toml::Table>) -> Result<Arc<dyn Family>> {
        let base = Gpt2::from_config(m)?;
        match lora {
            None => Ok(Arc::new(base)),
            Some(table) => {
                let l: LoraConfig = toml::Value::Table(table.clone()).try_into().map_err(|e| format!("[lora]: {e}"))?;
                Ok(Arc::new(Gpt2Lora::new(base.0, l)?))
            }
        }
    }

    fn for_hf_dir(&self, dir: &Path, config: &serde_json::Value) -> Result<Arc<dyn Family>> {
        let cfg = hf::load_config(&dir.join(family::CONFIG_FILE))?;
        // A LoRA run's folder holds PEFT's adapter files beside the base.
        match nn::lora::config_beside(dir, config, &TARGETS).map_err(GptError::from)? {
            Some(l) => Ok(Arc::new(Gpt2Lora::new(cfg, l)?)),
            None => Ok(Arc::new(Gpt2(cfg))),
        }
    }
}

/// GPT-2's `[model]` keys: single dimensions over the preset's.
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Section {
    n_layer: Option<usize>,
    n_head: Option<usize>,
    n_embd: Option<usize>,
    block_size: Option<usize>,
    vocab_size: Option<usize>,
}

const KEYS: &[&str] = &["n_layer", "n_head", "n_embd", "block_size", "vocab_size"];

/// GPT-2 at one shape.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Gpt2(pub GptConfig);

impl Gpt2 {
    /// The preset with single dimensions overridden.
    pub fn from_config(m: &ModelConfig) -> Result<Self> {
        let base = GptConfig::preset(m.base_preset()).map_err(|e| format!("model.preset: {e}"))?;
        let s: Section = family::parse_section(NAME, KEYS, &m.shape)?;
        let g = GptConfig {
            n_layer: s.n_layer.unwrap_or(base.n_layer),
            n_head: s.n_head.unwrap_or(base.n_head),
            n_embd: s.n_embd.unwrap_or(base.n_embd),
            block_size: s.block_size.unwrap_or(base.block_size),
            vocab_size: s.vocab_size.unwrap_or(base.vocab_size),
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
        crate::ActSizes::new(&self.0, micro, seq_len, build.precision, build.checkpointing).bytes()
    }

    fn stage_activation_bytes(&self, micro: usize, seq_len: usize, build: Build, spec: &engine::StageSpec) -> u128 {
        let part = nn::stack::Part::of(spec);
        crate::ActSizes::for_part(&self.0, micro, seq_len, (build.precision, build.checkpointing), part).bytes()
    }

    fn build(&self, build: Build) -> Result<Box<dyn LanguageModel>> {
        let model = Gpt::with_precision(self.0, build.precision)?.with_checkpointing(build.checkpointing);
        Ok(Box::new(family::Erased(model)))
    }

    fn tensor_parallel(&self, tp: TpRank) -> Result<Arc<dyn Family>> {
        let model = Gpt::tensor_parallel(self.0, Precision::F32, tp)?;
        Ok(Arc::new(Gpt2Rank { whole: *self, tp, model: Arc::new(model) }))
    }

    fn init_segment(&self, seed: u64, seg: usize) -> Vec<f32> {
        crate::init_segment(&self.0, seed, seg)
    }

    fn hf_config(&self) -> serde_json::Value {
        hf::config_json(&self.0)
    }

    fn save_hf(&self, dir: &Path, layout: &ParamLayout, params: &[f32]) -> Result<()> {
        Ok(hf::save(dir, &self.0, layout, params)?)
    }

    fn load_weights(&self, dir: &Path, layout: &ParamLayout) -> Result<Vec<f32>> {
        Ok(hf::load_weights(&dir.join(family::WEIGHTS_FILE), layout)?)
    }

    fn gguf_export<'a>(&self, layout: &ParamLayout, params: &'a [f32]) -> Result<family::GgufModel<'a>> {
        Ok(crate::export::gguf_model(self.name(), &self.0, layout, params)?)
    }

    fn with_frozen_storage(&self, s: &FrozenStorage) -> Result<Option<Arc<dyn Family>>> {
        family::no_adapters_to_pack(s)
    }

    fn pin_shape(&self, m: &mut ModelConfig) {
        let c = &self.0;
        let s = Section {
            n_layer: Some(c.n_layer),
            n_head: Some(c.n_head),
            n_embd: Some(c.n_embd),
            block_size: Some(c.block_size),
            vocab_size: Some(c.vocab_size),
        };
        family::pin_section(m, NAME, &s);
    }
}

/// GPT-2 as tensor-parallel rank `tp` holds it: its heads and MLP
/// columns, the rest whole. What sizes memory is the rank's; files are
/// the whole model's (saved and loaded through [`Gpt2`]).
#[derive(Debug, Clone)]
pub struct Gpt2Rank {
    whole: Gpt2,
    tp: TpRank,
    /// The rank's layout (no activations).
    model: Arc<Gpt>,
}

impl Gpt2Rank {
    fn whole_only<T>(&self, what: &str) -> Result<T> {
        family::whole_only(self.tp, what)?;
        Err(format!("{what}: rank {} of {} is not split", self.tp.rank, self.tp.size).into())
    }
}

impl Family for Gpt2Rank {
    fn name(&self) -> &'static str {
        self.whole.name()
    }

    fn describe(&self) -> String {
        format!("{}, {}", self.whole.describe(), self.tp)
    }

    fn n_params(&self) -> u128 {
        self.model.layout().n_params() as u128
    }

    fn vocab_size(&self) -> usize {
        self.whole.vocab_size()
    }

    fn max_seq_len(&self) -> usize {
        self.whole.max_seq_len()
    }

    fn flops_per_token(&self, seq_len: usize) -> f64 {
        self.whole.flops_per_token(seq_len)
    }

    fn activation_bytes(&self, micro: usize, seq_len: usize, build: Build) -> u128 {
        self.stage_activation_bytes(micro, seq_len, build, &engine::StageSpec::whole(self.whole.0.n_layer))
    }

    fn stage_activation_bytes(&self, micro: usize, seq_len: usize, build: Build, spec: &engine::StageSpec) -> u128 {
        let part = nn::stack::Part::of(spec);
        let prec = (build.precision, build.checkpointing);
        crate::ActSizes::for_rank(&self.whole.0, self.tp, (micro, seq_len), prec, part).bytes()
    }

    fn build(&self, build: Build) -> Result<Box<dyn LanguageModel>> {
        let model = Gpt::tensor_parallel(self.whole.0, build.precision, self.tp)?;
        Ok(Box::new(family::Erased(model.with_checkpointing(build.checkpointing))))
    }

    fn tensor_parallel(&self, tp: TpRank) -> Result<Arc<dyn Family>> {
        self.whole.tensor_parallel(tp)
    }

    fn init_segment(&self, seed: u64, seg: usize) -> Vec<f32> {
        let whole = self.whole.init_segment(seed, seg);
        let (Some(map), Ok(model)) = (self.model.tensor_shards(), Gpt::new(self.whole.0)) else { return whole };
        map.take_range(model.segments()[seg].clone(), &whole)
    }

    fn hf_config(&self) -> serde_json::Value {
        self.whole.hf_config()
    }

    fn save_hf(&self, _dir: &Path, _layout: &ParamLayout, _params: &[f32]) -> Result<()> {
        self.whole_only("saving Hugging Face files")
    }

    fn load_weights(&self, _dir: &Path, _layout: &ParamLayout) -> Result<Vec<f32>> {
        self.whole_only("loading weights")
    }

    fn pin_shape(&self, m: &mut ModelConfig) {
        self.whole.pin_shape(m)
    }
}

/// GPT-2 with LoRA adapters on a frozen base: the base's files as
/// [`Gpt2`] writes them, the adapters beside them in PEFT's format. The
/// base's `Conv1D` weights are f32 tensors of the layout, or packed
/// outside it (`train.frozen_dtype`: QLoRA).
#[derive(Debug, Clone)]
pub struct Gpt2Lora {
    base: Gpt2,
    lora: LoraConfig,
    /// The tensor-parallel rank this family builds (whole: all of it).
    tp: TpRank,
    /// The rank's layout (no activations): segments, initialisation, names.
    model: Arc<Gpt>,
    /// The whole model's layout (what a rank's initial values are cut from).
    whole: Arc<Gpt>,
    /// The `Conv1D` weights packed outside the layout, if so.
    packed: Option<Arc<crate::frozen_load::Packed>>,
}

impl Gpt2Lora {
    /// `cfg` with `lora`'s adapters (checked: what GPT-2 does not support is named).
    pub fn new(cfg: GptConfig, lora: LoraConfig) -> Result<Self> {
        let model = Arc::new(Gpt::with_lora(cfg, lora.clone(), Precision::F32)?);
        Ok(Self { base: Gpt2(cfg), lora, tp: TpRank::WHOLE, whole: model.clone(), model, packed: None })
    }

    /// The packed base, read on first use (`None`: the layout holds it,
    /// or a plan without its file).
    fn frozen(&self) -> Result<Option<Arc<FrozenBase>>> {
        let p = self.packed.as_ref().filter(|p| p.base.source.is_some());
        p.map(|p| p.get(&self.base.0)).transpose()
    }

    /// This shape with its `Conv1D` weights packed as `format` (`stored`:
    /// each weight's stored type and the format that keeps it), read from
    /// `source` on first use; `key` names the setting in errors.
    fn packed_family(
        &self,
        key: &str,
        source: Option<PathBuf>,
        format: FrozenFormat,
        stored: &[(String, String, Option<PackFormat>)],
    ) -> Result<Arc<dyn Family>> {
        let cfg = &self.base.0;
        let shape = |name: &str| {
            let (_, i) = crate::frozen::conv_of(name).unwrap_or((0, 0));
            let [inp, out] = crate::layout::conv_shape(i, cfg.n_embd, crate::layout::Widths::whole(cfg));
            [out, inp]
        };
        let all_in = |f| FrozenBase::planned_bytes(cfg, f);
        let (formats, bytes) = format.planned((key, source.as_deref()), stored, &shape, &all_in)?;
        let model = Arc::new(Gpt::with_packed_layout(*cfg, Some(self.lora.clone()))?);
        let values = self.model.layout().n_params().saturating_sub(model.layout().n_params()) as u128;
        let planned = FrozenBytes { formats, bytes, values };
        let packed = crate::frozen_load::Packed { format, base: PackedSource::new(source, planned) };
        Ok(Arc::new(Self { model: model.clone(), whole: model, packed: Some(Arc::new(packed)), ..self.clone() }))
    }

    /// Errors on a tensor-parallel rank: files hold the whole model.
    fn whole_only(&self, what: &str) -> Result<()> {
        family::whole_only(self.tp, what)
    }

    fn sizes(&self, micro: usize, seq_len: usize, build: Build, spec: &engine::StageSpec) -> crate::ActSizes {
        let ad = (self.tp, self.model.adapter_set());
        let how = (build.precision, build.checkpointing);
        crate::ActSizes::adapted(&self.base.0, ad, (micro, seq_len), how, nn::stack::Part::of(spec))
    }
}

impl Family for Gpt2Lora {
    fn name(&self) -> &'static str {
        self.base.name()
    }

    fn describe(&self) -> String {
        let names = self.lora.target_names(&TARGETS).unwrap_or_default().join(", ");
        let rank = match self.tp.is_split() {
            true => format!(", {}", self.tp),
            false => String::new(),
        };
        format!("{}, LoRA r={} on {names}{rank}", self.base.describe(), self.lora.r)
    }

    fn n_params(&self) -> u128 {
        self.model.layout().n_params() as u128
    }

    fn vocab_size(&self) -> usize {
        self.base.vocab_size()
    }

    fn max_seq_len(&self) -> usize {
        self.base.max_seq_len()
    }

    fn flops_per_token(&self, seq_len: usize) -> f64 {
        self.base.flops_per_token(seq_len)
    }

    fn activation_bytes(&self, micro: usize, seq_len: usize, build: Build) -> u128 {
        self.sizes(micro, seq_len, build, &engine::StageSpec::whole(self.base.0.n_layer)).bytes()
    }

    fn stage_activation_bytes(&self, micro: usize, seq_len: usize, build: Build, spec: &engine::StageSpec) -> u128 {
        self.sizes(micro, seq_len, build, spec).bytes()
    }

    /// The rank's heads and MLP columns with their adapters' pieces.
    fn tensor_parallel(&self, tp: TpRank) -> Result<Arc<dyn Family>> {
        if self.packed.is_some() {
            return match tp.is_split() {
                true => Err(format!(
                    "a packed frozen base is kept whole (dist.tensor_parallel = {}); set train.frozen_dtype = \"f32\" or dist.tensor_parallel = 1",
                    tp.size
                )
                .into()),
                false => Ok(Arc::new(self.clone())),
            };
        }
        let model = Gpt::tensor_parallel_with_lora(self.base.0, self.lora.clone(), Precision::F32, tp)?;
        Ok(Arc::new(Self { model: Arc::new(model), tp, ..self.clone() }))
    }

    fn build(&self, build: Build) -> Result<Box<dyn LanguageModel>> {
        let (cfg, lora) = (self.base.0, self.lora.clone());
        let model = match (&self.packed, self.frozen()?) {
            // A plan of a shape without its file: the layout alone (a pass is refused).
            (Some(_), None) => Gpt::with_packed_layout(cfg, Some(lora))?,
            (_, Some(base)) => Gpt::with_frozen_base(cfg, lora, build.precision, base)?,
            (None, None) => Gpt::tensor_parallel_with_lora(cfg, lora, build.precision, self.tp)?,
        };
        Ok(Box::new(family::Erased(model.with_checkpointing(build.checkpointing))))
    }

    /// The whole model's values of segment `seg`, cut to this rank's pieces.
    fn init_segment(&self, seed: u64, seg: usize) -> Vec<f32> {
        let whole = self.whole.init_segment(seed, seg);
        match self.model.tensor_shards() {
            Some(map) => map.take_range(self.whole.segments()[seg].clone(), &whole),
            None => whole,
        }
    }

    fn hf_config(&self) -> serde_json::Value {
        let mut v = self.base.hf_config();
        if let Some(o) = v.as_object_mut() {
            o.insert(nn::lora::CONFIG_KEY.into(), nn::lora::config_value(&self.lora, &TARGETS));
        }
        v
    }

    /// The base as Hugging Face files and the adapters in PEFT's format
    /// beside them (`PeftModel.from_pretrained(base, DIR)`).
    fn save_hf(&self, dir: &Path, layout: &ParamLayout, params: &[f32]) -> Result<()> {
        self.whole_only("saving Hugging Face files")?;
        if layout.n_params() != params.len() {
            return Err(format!("{} parameters to save, the model has {}", params.len(), layout.n_params()).into());
        }
        hf::save_with_base(dir, &self.base.0, (layout, params), self.frozen()?.as_deref())?;
        Ok(lora::save_adapter(dir, &self.model, params, None)?)
    }

    /// The base, the adapters as initialised (B = 0: the base's function),
    /// then the folder's trained adapters when it has them. With a packed
    /// base, the folder's `Conv1D` weights must be that base's values.
    fn load_weights(&self, dir: &Path, layout: &ParamLayout) -> Result<Vec<f32>> {
        self.whole_only("loading weights")?;
        let frozen = self.frozen()?;
        let path = dir.join(family::WEIGHTS_FILE);
        // `init_in_place` refuses a layout other than the model's.
        let mut params = hf::load_weights_with(&path, layout, &mut |name, view| {
            let (Some((b, i)), Some(f)) = (crate::frozen::conv_of(name), &frozen) else { return Ok(false) };
            crate::frozen::check_stored(&self.base.0, (name, (b, i)), view.shape(), &path)?;
            let mut w = vec![0.0; view.shape().iter().product()];
            nn::io::decode_into(view.dtype(), view.data(), &mut w)
                .map_err(|e| GptError::File(nn::io::bad(&path, format!("tensor `{name}` {e}"))))?;
            let base = f.dequantize(b, i);
            match w.iter().zip(&base).position(|(x, y)| x.to_bits() != y.to_bits()) {
                None => Ok(true),
                Some(at) => Err(GptError::File(nn::io::bad(&path, format!(
                    "`{name}` in this folder differs from the packed base it was trained on (train.frozen_source) at element {at}: that file changed after the run; restore it, or read the folder's own f32 base (generate / eval --dequantize)"
                )))),
            }
        })?;
        lora::init_in_place(&self.model, &mut params, 0, frozen.as_deref())?;
        if dir.join(nn::lora::ADAPTER_CONFIG_FILE).exists() {
            lora::apply(&lora::load_adapter(dir)?, &self.model, &mut params)?;
        }
        Ok(params)
    }

    fn save_adapters(&self, dir: &Path, layout: &ParamLayout, params: &[f32], base: &str) -> Result<()> {
        self.whole_only("saving adapters")?;
        family::check_count(dir, layout, params.len())?;
        Ok(lora::save_adapter(dir, &self.model, params, Some(base))?)
    }

    fn load_adapters(&self, dir: &Path, layout: &ParamLayout, params: &mut [f32]) -> Result<()> {
        self.whole_only("loading adapters")?;
        family::check_count(dir, layout, params.len())?;
        Ok(lora::apply(&lora::load_adapter(dir)?, &self.model, params)?)
    }

    fn unpacked(&self, params: &[f32]) -> Result<Option<family::Loaded>> {
        self.whole_only("unpacking the frozen base")?;
        let Some(base) = self.frozen()? else { return Ok(None) };
        let whole = Gpt2Lora::new(self.base.0, self.lora.clone())?;
        let dequantized = |name: &str| crate::frozen::conv_of(name).map(|(b, i)| base.dequantize(b, i));
        let params = family::unpack((whole.model.layout(), self.model.layout()), params, dequantized)?;
        Ok(Some((Arc::new(whole), params)))
    }

    fn start_from_pretrained(&self, params: Vec<f32>, seed: u64) -> Result<Vec<f32>> {
        self.whole_only("attaching adapters")?;
        match params.len() == self.model.layout().n_params() {
            true => Ok(params),
            false => Ok(lora::attach_with(&self.model, &params, seed, self.frozen()?.as_deref())?),
        }
    }

    fn merged(&self, params: &[f32]) -> Result<Option<family::Loaded>> {
        self.whole_only("merging adapters")?;
        let merged = lora::merge_with(&self.model, params, self.frozen()?.as_deref())?;
        Ok(Some((Arc::new(self.base), merged)))
    }

    fn pin_shape(&self, m: &mut ModelConfig) {
        self.base.pin_shape(m)
    }

    fn with_frozen_storage(&self, s: &FrozenStorage) -> Result<Option<Arc<dyn Family>>> {
        let cfg = &self.base.0;
        let weights: Vec<_> = crate::layout::CONVS
            .iter()
            .enumerate()
            .map(|(i, name)| {
                let [inp, out] = crate::layout::conv_shape(i, cfg.n_embd, crate::layout::Widths::whole(cfg));
                (*name, [out, inp])
            })
            .collect();
        let stored_of =
            |p: &Path| Ok(crate::frozen_load::source_formats(p).map_err(|e| format!("{}: {e}", p.display()))?);
        let files = "a Hugging Face folder";
        let Some((format, stored)) = family::frozen_packing(s, &stored_of, &weights, files)? else { return Ok(None) };
        let key = format!("train.frozen_dtype = \"{}\"", s.dtype.name());
        Ok(Some(self.packed_family(&key, s.source.clone(), format, &stored)?))
    }

    fn frozen_bytes(&self) -> Option<FrozenBytes> {
        self.packed.as_ref().map(|p| p.base.planned.clone())
    }

    fn load_unfrozen(&self, source: &Path) -> Result<Vec<f32>> {
        let Some(p) = &self.packed else {
            return Err(format!("{}: this {} shape holds no packed frozen base", source.display(), self.name()).into());
        };
        p.base.load_unfrozen(source, &|dir, rest| p.read(&self.base.0, dir, rest))
    }
}

family::text_model!(Gpt, GptError);

#[cfg(test)]
mod tests {
    use super::*;
    use engine::{Checkpointing, FullStore, Model, Precision, TokenBatch};

    #[test]
    fn parameter_count_matches_the_model() {
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
    /// model would let the memory check pass runs that abort), with and
    /// without LoRA adapters.
    #[test]
    fn activation_estimate_equals_the_allocation() {
        let g = GptConfig { n_layer: 3, n_head: 2, n_embd: 16, block_size: 8, vocab_size: 37 };
        let lora = LoraConfig::new(3, 6.0, &["c_attn", "c_proj", "c_fc"]);
        let adapted = Gpt2Lora::new(g, lora).unwrap_or_else(|e| panic!("{e}"));
        let families: [(&dyn Family, Vec<f32>); 2] =
            [(&Gpt2(g), crate::init_params(&g, 1)), (&adapted, adapted.model.init_params(1))];
        for (family, params) in families {
            activation_estimate_of(family, &params);
        }
    }

    fn activation_estimate_of(family: &dyn Family, params: &[f32]) {
        for precision in [Precision::F32, Precision::Bf16, Precision::F16] {
            for checkpointing in [Checkpointing::None, Checkpointing::Blocks, Checkpointing::EveryK(2)] {
                let build = Build { precision, checkpointing, whole_len: None };
                let mut model = family.build(build).unwrap_or_else(|e| panic!("{e}"));
                let (b, t) = (3, 8);
                let batch = TokenBatch {
                    n_seqs: b,
                    seq_len: t,
                    inputs: vec![1; b * t],
                    targets: vec![2; b * t],
                    positions: Vec::new(),
                };
                let mut grads = vec![0.0; params.len()];
                let mut store = FullStore::for_model(&model, params, &mut grads).unwrap_or_else(|e| panic!("{e}"));
                model.micro_step(&mut store, &batch, 1.0).unwrap_or_else(|e| panic!("{e}"));
                drop(store);
                let want = model.activation_bytes() as u128;
                assert_eq!(family.activation_bytes(b, t, build), want, "{precision} {checkpointing}");
            }
        }
    }

    #[test]
    fn shape_round_trips_through_the_model_section() {
        let mut m = ModelConfig { preset: Some("mini".into()), ..ModelConfig::default() };
        m.shape.insert("n_layer".into(), toml::Value::Integer(3));
        let f = Gpt2::from_config(&m).unwrap_or_else(|e| panic!("{e}"));
        let mut pinned = ModelConfig { preset: Some("tiny".into()), ..ModelConfig::default() };
        f.pin_shape(&mut pinned);
        let g = Gpt2::from_config(&pinned).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(f.hf_config(), g.hf_config());
        assert_eq!(g.0.n_layer, 3);
        m.shape.insert("n_kv_head".into(), toml::Value::Integer(2));
        let e = Gpt2::from_config(&m).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("model.n_kv_head"), "{e}");
    }
}
