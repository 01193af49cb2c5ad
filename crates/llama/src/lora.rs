//! LoRA inside the model (`y = x·Wᵀ + (α/r)·(x·Aᵀ)·Bᵀ` on the targeted
//! projections), its initialisation as PEFT does it, merging into the base
//! weights, and adapters in PEFT's on-disk format (`adapter_config.json` +
//! `adapter_model.safetensors`), so `PeftModel.from_pretrained` loads ours
//! and we load theirs.

use crate::error::LlamaError;
use crate::frozen::FrozenBase;
use crate::layout::Proj;
use crate::model::Llama;
use engine::Model;
use nn::{gemm_into, parallelism, GemmDims, GemmOut, Strided};
use serde_json::Value;
use std::path::Path;

pub use crate::layout::{target_names, targets, targets_of, validate, ANY_TARGETS, FUSED_TARGETS, TARGETS};
pub use nn::lora::{is_adapter, kaiming_uniform, LoraConfig, ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, ALL_LINEAR};

fn require_lora(model: &Llama) -> Result<&LoraConfig, LlamaError> {
    model.lora().ok_or_else(|| LlamaError::lora("model", "has no LoRA adapters"))
}

/// Parameters for `model` (with adapters) from base-model parameters
/// (layout of `Llama::new`): base tensors copied by name, adapters
/// initialised as [`Llama::init_params`] does (A Kaiming-uniform, B zero,
/// a DoRA magnitude the row norms of the base weight) from `seed`.
pub fn attach(model: &Llama, base: &[f32], seed: u64) -> Result<Vec<f32>, LlamaError> {
    attach_with(model, base, seed, model.frozen_base().map(|b| &**b))
}

/// [`attach`] for a model whose projections are packed in `frozen`
/// (outside `base`, which then has the packed layout's tensors): DoRA's
/// magnitudes are the row norms of the dequantised projections.
pub fn attach_with(
    model: &Llama,
    base: &[f32],
    seed: u64,
    frozen: Option<&FrozenBase>,
) -> Result<Vec<f32>, LlamaError> {
    require_lora(model)?;
    let base_model = model.plain()?;
    let base_layout = base_model.layout();
    LlamaError::check_count("base model", base_layout.n_params(), base.len())?;
    let mut out = vec![0.0f32; model.layout().n_params()];
    for t in base_layout.tensors() {
        let dst = model.layout().get(&t.name).ok_or_else(|| LlamaError::MissingTensor { name: t.name.clone() })?;
        out[dst.range()].copy_from_slice(&base[t.range()]);
    }
    init_in_place(model, &mut out, seed, frozen)?;
    Ok(out)
}

/// [`attach_with`] on parameters already laid out for `model`, with the
/// base's tensors in place (the adapters' values are ignored): each
/// adapter starts as initialised from `seed` (B = 0, so the model is the
/// base's function), DoRA's magnitudes at the base's row norms. A loader
/// that places the base straight into the adapted layout needs no second
/// copy of the model.
pub fn init_in_place(
    model: &Llama,
    params: &mut [f32],
    seed: u64,
    frozen: Option<&FrozenBase>,
) -> Result<(), LlamaError> {
    require_lora(model)?;
    LlamaError::check_count("model with adapters", model.layout().n_params(), params.len())?;
    let segs = model.segments();
    for idx in 0..model.config().n_layer {
        let seg = segs[1 + idx].clone();
        model.init_adapters(seed, idx, &mut params[seg.clone()]);
        model.init_magnitudes(idx, &mut params[seg], frozen);
    }
    Ok(())
}

/// The base-model parameters (layout of `Llama::new`) with every adapter
/// merged: `W += (α/r)·B·A` (for `--merge`: a plain Llama checkpoint that
/// computes what the adapted model computes).
pub fn merge(model: &Llama, params: &[f32]) -> Result<Vec<f32>, LlamaError> {
    merge_with(model, params, model.frozen_base().map(|b| &**b))
}

/// [`merge`] of a model whose projections are packed in `base` (outside
/// `params`): each projection dequantised, one at a time, into the result.
pub fn merge_with(model: &Llama, params: &[f32], base: Option<&FrozenBase>) -> Result<Vec<f32>, LlamaError> {
    let lora = require_lora(model)?;
    let layout = model.layout();
    LlamaError::check_count("model", layout.n_params(), params.len())?;
    let base_model = Llama::new(model.config().clone())?;
    let mut out = vec![0.0f32; base_model.layout().n_params()];
    for t in base_model.layout().tensors() {
        if let Some(src) = layout.get(&t.name) {
            out[t.range()].copy_from_slice(&params[src.range()]);
            continue;
        }
        match (base, crate::frozen::proj_of(&t.name)) {
            (Some(b), Some((layer, pr))) => out[t.range()].copy_from_slice(&b.dequantize(model.config(), layer, pr)),
            _ => return Err(LlamaError::MissingTensor { name: t.name.clone() }),
        }
    }
    for idx in 0..model.config().n_layer {
        let (bl, ml) = (base_model.layer_params(idx), model.layer_params(idx));
        let fused = model.config().fused_modules;
        for pr in Proj::ALL {
            let Some(lr) = &ml.lora[pr as usize] else { continue };
            let ([oc, ic], _) = pr.adapter_shape(model.config());
            let (a, b) = (&params[lr.a.clone()], &params[lr.b.clone()]);
            let w = &mut out[bl.adapted_w(pr, fused)];
            // W[oc, ic] += s · B[oc, r] · A[r, ic]
            let (bv, av) = (Strided::rows(b, lora.r), Strided::rows(a, ic));
            gemm_into(
                GemmDims { m: oc, n: ic, k: lora.r },
                w,
                GemmOut { offset: 0, rs: ic, accumulate: true },
                bv,
                av,
                lora.scale(),
                parallelism(false),
            );
            // DoRA: each row of W + s·B·A rescaled to its magnitude (PEFT's merge).
            if let Some(m) = &lr.m {
                nn::dora::rescale_rows(w, &params[m.clone()], ic);
            }
        }
    }
    Ok(out)
}

/// `adapter_config.json` as PEFT writes it for a causal LM (`fused`:
/// Phi-3's modules, [`FUSED_TARGETS`]).
pub fn adapter_config_json(
    lora: &LoraConfig,
    fused: bool,
    base_model_name_or_path: Option<&str>,
) -> Result<Value, LlamaError> {
    Ok(lora.adapter_config_json(targets_of(fused), base_model_name_or_path)?)
}

/// Saves `model`'s adapters (from `params`) into `dir` in PEFT's format:
/// `adapter_config.json` and `adapter_model.safetensors` with keys
/// `base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`...,
/// each written atomically.
pub fn save_adapter(
    dir: &Path,
    model: &Llama,
    params: &[f32],
    base_model_name_or_path: Option<&str>,
) -> Result<(), LlamaError> {
    let lora = require_lora(model)?;
    let layout = model.layout();
    LlamaError::check_count("model", layout.n_params(), params.len())?;
    let config = adapter_config_json(lora, model.config().fused_modules, base_model_name_or_path)?;
    Ok(nn::lora::save_adapter(dir, layout, params, &config)?)
}

/// A LoRA adapter read from disk (its configuration, source and tensors:
/// [`nn::lora::Adapter`]'s fields).
#[derive(Debug, Clone)]
pub struct Adapter(pub nn::lora::Adapter);

impl std::ops::Deref for Adapter {
    type Target = nn::lora::Adapter;
    fn deref(&self) -> &nn::lora::Adapter {
        &self.0
    }
}

impl std::ops::DerefMut for Adapter {
    fn deref_mut(&mut self) -> &mut nn::lora::Adapter {
        &mut self.0
    }
}

/// Reads PEFT's `adapter_config.json` into a [`LoraConfig`]. Settings that
/// change the math and are not implemented (per-layer ranks, biases, regex
/// targets) are errors naming the key. Module names of either kind of
/// block are read ([`ANY_TARGETS`]); the model checks them against its own.
pub fn lora_config_from_peft(v: &Value) -> Result<(LoraConfig, Option<String>), LlamaError> {
    Ok(LoraConfig::from_peft(v, &ANY_TARGETS)?)
}

/// Loads an adapter saved in PEFT's format from `dir` (names as
/// [`lora_config_from_peft`] reads them).
pub fn load_adapter(dir: &Path) -> Result<Adapter, LlamaError> {
    Ok(Adapter(nn::lora::load_adapter(dir, &ANY_TARGETS)?))
}

impl Adapter {
    /// Copies the adapter's tensors into `params` (laid out for `model`,
    /// which must carry the same targets and rank). Every adapter tensor of
    /// the model must be present with its shape, and nothing else.
    pub fn apply(&self, model: &Llama, params: &mut [f32]) -> Result<(), LlamaError> {
        let lora = require_lora(model)?;
        Ok(self.0.apply((model.layout(), lora, targets_of(model.config().fused_modules)), params)?)
    }
}
