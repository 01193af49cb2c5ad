//! A saved model as the commands that read one use it (`generate`, `eval`,
//! `export`): the checkpoint to point to when a run folder holds no final
//! model, the tokenizer that comes with it, and continuing a token
//! sequence with it (chat prompts, where a turn ends, greedy decoding).

use crate::family::base_ref::{self, BaseRef};
use crate::family::{self, LanguageModel};
use anyhow::{bail, Context, Result};
use data::{Message, Tokenizer, TokenizerSpec};
use std::path::Path;
use std::sync::Arc;

/// A saved model for a forward-only use (`generate`, `eval`), as
/// [`family::load_hf`] loads it, except that packed projections stay packed: a
/// file whose projections are packed (a GGUF's Q8_0 / Q4_0 / Q4_1 blocks,
/// 16-bit safetensors) keeps them in its bytes, and a LoRA run folder whose
/// run kept its frozen base packed (`train.frozen_dtype`, read from
/// `train.frozen_source`) reads that base packed again, checking the
/// folder's f32 copy of it against it (a folder of adapters alone: the
/// bytes its `base.json` names). The same logits to the bit (the
/// packed GEMMs dequantise a panel and run the f32 kernel) in a fraction
/// of the memory. `what` names the job in the memory check made before
/// the weights are read; `dequantize` holds every weight as f32, as
/// [`family::load_hf`] does.
pub(crate) fn load_for_inference(dir: &Path, what: &str, dequantize: bool) -> Result<family::Loaded> {
    let dir = &crate::checkpoint::model_dir(dir)?;
    let shape = family::read_hf_config(dir)?;
    if crate::checkpoint::is_sharded(dir) {
        crate::memory::check_load_of(what, shape.n_params())?;
        return load_whole(dir);
    }
    if !dequantize {
        // A folder of adapters alone on a base held as its file's values:
        // that file is read as a model file is (its embedding packed too).
        let base = BaseRef::read(dir)?;
        let file = match &base {
            None => Some(dir.to_path_buf()),
            Some(b) if b.held_as == base_ref::FILE_VALUES => Some(b.path.clone()),
            Some(_) => None,
        };
        if let Some(packed) = file.as_deref().map(|f| shape.packed_for_inference(f)).transpose()?.flatten() {
            check_packed(&*packed, dir, base.as_ref(), what)?;
            let params = match &base {
                Some(b) => base_ref::load(dir, &*packed, b)?,
                // PEFT's adapters beside a base file of packable weights.
                None if dir.join(nn::lora::ADAPTER_CONFIG_FILE).exists() => {
                    base_ref::with_adapters(dir, &*packed, dir)?
                }
                None => {
                    // The other tensors first: reading them reads the base
                    // too, which the build then finds loaded.
                    let params = packed.load_unfrozen(dir)?;
                    family::check_finite(packed.build(family::Build::default())?.layout(), &params, dir)?;
                    params
                }
            };
            return Ok((packed, params));
        }
        if let Some(packed) = run_base_packed(&shape, dir, base.as_ref())? {
            check_packed(&*packed, dir, base.as_ref(), what)?;
            if let Some(base) = &base {
                let params = base_ref::load(dir, &*packed, base)?;
                return Ok((packed, params));
            }
            let model = packed.build(family::Build::default())?;
            let params = packed.load_weights(dir, model.layout())?;
            family::check_finite(model.layout(), &params, dir)?;
            return Ok((packed, params));
        }
    }
    crate::memory::check_load_of(what, shape.n_params())?;
    load_whole(dir)
}

/// The resolved config a run folder or checkpoint `dir` was written with, if any.
fn run_config(dir: &Path) -> Result<Option<config::Config>> {
    let path = dir.join(crate::checkpoint::CONFIG);
    if !path.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
    Ok(Some(config::Config::from_toml(&text, &path.display().to_string(), &[])?))
}

/// A saved model with every weight f32, as [`family::load_hf`] reads it;
/// a folder of adapters alone (a LoRA run's, [`base_ref`]) reads its base
/// as the run held it — packed where the run packed it, then dequantised:
/// the values the run trained on, not the source's where packing rounded.
pub(crate) fn load_whole(dir: &Path) -> Result<family::Loaded> {
    let dir = &crate::checkpoint::model_dir(dir)?;
    if let Some(loaded) = crate::checkpoint::sharded_params(dir)? {
        return Ok(loaded);
    }
    let Some(base) = BaseRef::read(dir)? else { return family::load_hf(dir) };
    let shape = family::read_hf_config(dir)?;
    let run = run_base_packed(&shape, dir, Some(&base))?.unwrap_or(shape);
    let params = base_ref::load(dir, &*run, &base)?;
    Ok(run.unpacked(&params)?.unwrap_or((run, params)))
}

/// The memory check of a model whose projections stay packed (a folder
/// of adapters alone maps its `base` file too).
fn check_packed(packed: &dyn family::Family, dir: &Path, base: Option<&BaseRef>, what: &str) -> Result<()> {
    let frozen = packed.frozen_bytes().map_or(0, |f| f.bytes);
    let mapped = crate::memory::file_bytes(dir) + base.map_or(0, |b| b.bytes);
    crate::memory::check_packed_load(what, packed.n_params(), frozen, mapped)
}

/// With a run folder `dir` whose run kept its frozen base packed: `shape`
/// with that base read packed from `train.frozen_source` (a folder of
/// adapters alone: from the path its `base.json` names) again (`None`
/// without such a run, or when that file is gone: a note says the
/// folder's f32 base is read instead; a folder without one refuses).
fn run_base_packed(
    shape: &Arc<dyn family::Family>,
    dir: &Path,
    base: Option<&BaseRef>,
) -> Result<Option<Arc<dyn family::Family>>> {
    let Some(cfg) = run_config(dir)? else { return Ok(None) };
    // A folder of adapters alone (`base`): its base is where its reference says.
    let storage = crate::setup::frozen_storage(&cfg, base.map(|b| b.path.as_path()));
    let Some(source) = storage.source.as_deref() else { return Ok(None) };
    if !source.exists() {
        if let Some(base) = base {
            base.check(dir)?;
        }
        if !storage.packs_by_name() {
            return Ok(None);
        }
        eprintln!(
            "note: this run's frozen base {} is gone; reading the folder's f32 copy of it (more memory, the same logits)",
            source.display()
        );
        return Ok(None);
    }
    Ok(shape.with_frozen_storage(&storage)?)
}

/// The tokenizer a model folder (or GGUF file) carries; a checkpoint's
/// (which carries none) is its run's `data.tokenizer`; else bytes.
pub(crate) fn tokenizer_of(model: &Path) -> Result<Tokenizer> {
    let spec = if family::is_gguf(model) {
        TokenizerSpec::Gguf(model.to_path_buf())
    } else if model.join("tokenizer.json").exists() {
        TokenizerSpec::TokenizerJson(model.join("tokenizer.json"))
    } else {
        run_config(model)?.and_then(|cfg| cfg.data.tokenizer).unwrap_or(TokenizerSpec::Byte)
    };
    spec.build().with_context(|| format!("cannot load the tokenizer of {}", model.display()))
}

/// A run folder stopped before its end holds checkpoints but no final
/// model: say where the newest one is instead of "no config.json".
pub(crate) fn point_to_checkpoints(dir: &Path) -> Result<()> {
    let has_model = [family::WEIGHTS_FILE, base_ref::FILE, crate::checkpoint::FINAL_POINTER];
    if !dir.is_dir() || has_model.iter().any(|f| dir.join(f).exists()) || crate::checkpoint::is_sharded(dir) {
        return Ok(());
    }
    let newest = crate::checkpoint::list(dir).ok().and_then(|l| l.into_iter().max_by_key(|(step, _)| *step));
    if let Some((step, path)) = newest {
        let what = "holds no final model (the run stopped before its last step)";
        bail!(
            "{} {what}; its newest checkpoint is step {step}: generate from {} (or finish the run with `train --resume {}`)",
            dir.display(),
            path.display(),
            dir.display()
        );
    }
    Ok(())
}

/// The prompt of a conversation whose next turn is the assistant's, through
/// the tokenizer's chat template.
pub(crate) fn chat_prompt(tok: &Tokenizer, messages: &[Message]) -> Result<Vec<u32>> {
    let template = tok.chat_template().context("the model's tokenizer has no chat template")?;
    Ok(tok.encode_chat(&template.render(messages, true)?)?.ids)
}

/// Where an assistant's turn ends: the tokenizer's end-of-sequence and `<|im_end|>`.
pub(crate) fn turn_ends(tok: &Tokenizer) -> Vec<u32> {
    tok.eos_id().into_iter().chain(tok.token_id("<|im_end|>")).collect()
}

/// The ids generation stops at, as transformers reads them:
/// `generation_config.json`'s `eos_token_id` (one id or a list), else
/// `config.json`'s, else the tokenizer's end-of-sequence (a GGUF file's
/// `tokenizer.ggml.eos_token_id`).
pub(crate) fn eos_ids(model: &Path, tok: &Tokenizer) -> Result<Vec<u32>> {
    for file in ["generation_config.json", family::CONFIG_FILE] {
        let path = model.join(file);
        if !model.is_dir() || !path.exists() {
            continue;
        }
        let text = std::fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
        let json: serde_json::Value =
            serde_json::from_str(&text).with_context(|| format!("{} is not JSON", path.display()))?;
        let ids = match &json["eos_token_id"] {
            serde_json::Value::Null => continue,
            serde_json::Value::Array(a) => a.iter().map(|v| v.as_u64()).collect::<Option<Vec<_>>>(),
            v => v.as_u64().map(|id| vec![id]),
        };
        let ids =
            ids.with_context(|| format!("{}: eos_token_id is not a token id or a list of them", path.display()))?;
        return ids.into_iter().map(|id| u32::try_from(id).context("eos_token_id out of range")).collect();
    }
    Ok(tok.eos_id().into_iter().collect())
}

/// Extends `tokens` by at most `max_new` tokens, each chosen by `pick` from
/// the logits of the model's last `context` tokens, stopping before a token
/// of `stops`. `emit(token, length)` sees each new token and the sequence's
/// length with it.
#[allow(clippy::too_many_arguments)]
pub(crate) fn extend(
    model: &mut dyn LanguageModel,
    params: &[f32],
    tokens: &mut Vec<u32>,
    max_new: usize,
    context: usize,
    stops: &[u32],
    mut pick: impl FnMut(&[f32]) -> u32,
    mut emit: impl FnMut(u32, usize) -> Result<()>,
) -> Result<()> {
    for _ in 0..max_new {
        let logits = model.next_token_logits(params, ::family::generation::window(tokens, context))?;
        let next = pick(&logits);
        if stops.contains(&next) {
            break;
        }
        tokens.push(next);
        emit(next, tokens.len())?;
    }
    Ok(())
}

/// The most likely token (the first of equals): greedy decoding.
pub(crate) fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, l) in logits.iter().enumerate() {
        if l.total_cmp(&logits[best]).is_gt() {
            best = i;
        }
    }
    best as u32
}
