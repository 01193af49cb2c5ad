//! LoRA on GPT-2 (the branch itself is `nn::lora`'s): adapters attached to
//! a base, merged into it, and saved and loaded in PEFT's format with
//! PEFT's names for GPT-2 (`c_attn`, `c_proj`, `c_fc`; `fan_in_fan_out`
//! on, as PEFT sets it for `Conv1D`), so `PeftModel.from_pretrained` on
//! transformers' `GPT2LMHeadModel` loads ours.

use crate::error::GptError;
use crate::frozen::FrozenBase;
use crate::layout::{conv_shape, Widths, CONVS, TARGETS};
use crate::model::Gpt;
use engine::Model;
use nn::lora::{Adapter, LoraConfig};
use nn::{gemm_into, parallelism, GemmDims, GemmOut, Strided};
use std::path::Path;

pub use nn::lora::is_adapter;

fn require_lora(model: &Gpt) -> Result<&LoraConfig, GptError> {
    model.lora().ok_or_else(|| nn::lora::LoraError::invalid("model", "has no LoRA adapters").into())
}

fn check_count(what: &str, expected: usize, got: usize) -> Result<(), GptError> {
    match got == expected {
        true => Ok(()),
        false => Err(GptError::InvalidConfig(format!("{what}: {got} parameters given, the model has {expected}"))),
    }
}

/// Parameters for `model` (with adapters) from base-model parameters
/// (layout of `Gpt::new`): base tensors copied by name, adapters
/// initialised as [`Gpt::init_params`] does (A Kaiming-uniform, B zero)
/// from `seed`, so the model computes the base's function.
pub fn attach(model: &Gpt, base: &[f32], seed: u64) -> Result<Vec<f32>, GptError> {
    attach_with(model, base, seed, None)
}

/// [`attach`] for a model that may hold its `Conv1D` weights packed
/// (`frozen`): then `base` is the other tensors (the layout of
/// [`Gpt::with_packed_layout`] without adapters) and DoRA's magnitudes
/// start at `frozen`'s row norms.
pub fn attach_with(model: &Gpt, base: &[f32], seed: u64, frozen: Option<&FrozenBase>) -> Result<Vec<f32>, GptError> {
    require_lora(model)?;
    let plain = match model.packs_base() {
        true => Gpt::with_packed_layout(*model.config(), None)?,
        false => Gpt::new(*model.config())?,
    };
    check_count("base model", plain.layout().n_params(), base.len())?;
    let mut out = vec![0.0f32; model.layout().n_params()];
    for t in plain.layout().tensors() {
        let dst =
            model.layout().get(&t.name).ok_or_else(|| GptError::InvalidConfig(format!("no tensor {}", t.name)))?;
        out[dst.range()].copy_from_slice(&base[t.range()]);
    }
    init_in_place(model, &mut out, seed, frozen)?;
    Ok(out)
}

/// [`attach_with`] on parameters already laid out for `model`, the base's
/// tensors in place: each adapter starts as initialised from `seed`.
pub fn init_in_place(model: &Gpt, params: &mut [f32], seed: u64, frozen: Option<&FrozenBase>) -> Result<(), GptError> {
    require_lora(model)?;
    check_count("model with adapters", model.layout().n_params(), params.len())?;
    let Some(ad) = model.adapter_set() else { return Ok(()) };
    if ad.dora && model.packs_base() && frozen.is_none() {
        return Err(GptError::InvalidConfig(
            "DoRA's magnitudes start at the base's norms: pass the packed base".into(),
        ));
    }
    for idx in 0..model.config().n_layer {
        // The adapters are the block's tail; DoRA's magnitudes read its base.
        let span = model.block_params(idx).span();
        let first = model.block_params(idx).fcproj_b.end;
        params[first..span.end].copy_from_slice(&crate::layout::init_adapters(model.config(), ad, seed, idx));
        crate::layout::init_magnitudes(model.block_rel(), &mut params[span], frozen.map(|f| f.block(idx)));
    }
    Ok(())
}

/// The base-model parameters (layout of `Gpt::new`) with every adapter
/// merged: `W += s·(B·A)ᵀ` (`Conv1D` weights are `[in, out]`), with DoRA
/// each output feature then rescaled to its magnitude `m_j / ‖W[:, j]‖`, for
/// `--merge` and export: a plain GPT-2 that computes what the adapted one does.
pub fn merge(model: &Gpt, params: &[f32]) -> Result<Vec<f32>, GptError> {
    merge_with(model, params, None)
}

/// [`merge`] of a model whose `Conv1D` weights may be packed outside its
/// layout (`frozen`): they are dequantised into the merged model.
pub fn merge_with(model: &Gpt, params: &[f32], frozen: Option<&FrozenBase>) -> Result<Vec<f32>, GptError> {
    let lora = require_lora(model)?;
    let layout = model.layout();
    check_count("model", layout.n_params(), params.len())?;
    let cfg = *model.config();
    let plain = Gpt::new(cfg)?;
    let mut out = vec![0.0f32; plain.layout().n_params()];
    for t in plain.layout().tensors() {
        match (layout.get(&t.name), crate::frozen::conv_of(&t.name), frozen) {
            (Some(src), _, _) => out[t.range()].copy_from_slice(&params[src.range()]),
            (None, Some((b, i)), Some(f)) => out[t.range()].copy_from_slice(&f.dequantize(b, i)),
            _ => return Err(GptError::InvalidConfig(format!("no tensor {}", t.name))),
        }
    }
    let w = Widths::whole(&cfg);
    for idx in 0..cfg.n_layer {
        for (i, lr) in model.block_params(idx).lora.iter().enumerate() {
            let Some(lr) = lr else { continue };
            let [inp, oc] = conv_shape(i, cfg.n_embd, w);
            let name = format!("transformer.h.{idx}.{}.weight", CONVS[i]);
            let wt = plain.layout().get(&name).ok_or_else(|| GptError::InvalidConfig(format!("no tensor {name}")))?;
            // W[in, out] += s · Aᵀ[in, r] · Bᵀ[r, out]
            gemm_into(
                GemmDims { m: inp, n: oc, k: lora.r },
                &mut out[wt.range()],
                GemmOut { offset: 0, rs: oc, accumulate: true },
                Strided::transposed(&params[lr.a.clone()], inp),
                Strided::transposed(&params[lr.b.clone()], lora.r),
                lora.scale(),
                parallelism(false),
            );
            if let Some(m) = &lr.m {
                // DoRA: each output feature's column rescaled to its magnitude.
                let wt = &mut out[wt.range()];
                let mut rows: Vec<f32> =
                    (0..oc).flat_map(|j| (0..inp).map(move |k| (j, k))).map(|(j, k)| wt[k * oc + j]).collect();
                nn::dora::rescale_rows(&mut rows, &params[m.clone()], inp);
                for (j, row) in rows.chunks_exact(inp).enumerate() {
                    row.iter().enumerate().for_each(|(k, &v)| wt[k * oc + j] = v);
                }
            }
        }
    }
    Ok(out)
}

/// Saves `model`'s adapters (from `params`) into `dir` in PEFT's format:
/// `adapter_config.json` and `adapter_model.safetensors` with keys
/// `base_model.model.transformer.h.{i}.attn.c_attn.lora_A.weight`...
pub fn save_adapter(dir: &Path, model: &Gpt, params: &[f32], base: Option<&str>) -> Result<(), GptError> {
    let lora = require_lora(model)?;
    check_count("model", model.layout().n_params(), params.len())?;
    let config = lora.adapter_config_json(&TARGETS, base)?;
    Ok(nn::lora::save_adapter(dir, model.layout(), params, &config)?)
}

/// Loads an adapter saved in PEFT's format (by us or by PEFT on a GPT-2) from `dir`.
pub fn load_adapter(dir: &Path) -> Result<Adapter, GptError> {
    Ok(nn::lora::load_adapter(dir, &TARGETS)?)
}

/// Copies `adapter`'s tensors into `params` (laid out for `model`, built
/// with the adapter's configuration).
pub fn apply(adapter: &Adapter, model: &Gpt, params: &mut [f32]) -> Result<(), GptError> {
    let lora = require_lora(model)?;
    Ok(adapter.apply((model.layout(), lora, &TARGETS), params)?)
}
