//! `macrobatch generate`: sample from a saved model (a run folder, a
//! Hugging Face folder or a GGUF file) with its own tokenizer; `--chat`
//! answers the prompt as the assistant through the chat template.
//!
//! The model keeps a key/value cache (unless `--no-kv-cache`): the prompt
//! runs once, then each step runs the new token only. Once the sequence is
//! longer than the context the model sees its last `context` tokens, as
//! without the cache: every position shifts each step, so each step
//! recomputes that window.

use crate::family::{self, Build, LanguageModel};
use crate::GenerateArgs;
use anyhow::{bail, Context, Result};
use data::{Message, Role, Tokenizer, TokenizerSpec};
use engine::rng::SplitMix64;
use std::io::Write;
use std::path::Path;

/// The tokenizer a model folder (or GGUF file) carries, else bytes.
pub(crate) fn tokenizer_of(model: &Path) -> Result<Tokenizer> {
    let spec = if family::is_gguf(model) {
        TokenizerSpec::Gguf(model.to_path_buf())
    } else if model.join("tokenizer.json").exists() {
        TokenizerSpec::TokenizerJson(model.join("tokenizer.json"))
    } else {
        TokenizerSpec::Byte
    };
    spec.build().with_context(|| format!("cannot load the tokenizer of {}", model.display()))
}

/// A run folder stopped before its end holds checkpoints but no final
/// model: say where the newest one is instead of "no config.json".
pub(crate) fn point_to_checkpoints(dir: &Path) -> Result<()> {
    if !dir.is_dir() || dir.join(family::WEIGHTS_FILE).exists() {
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

/// Samples `max_new_tokens` tokens after the prompt and prints the text.
pub fn run(args: GenerateArgs) -> Result<()> {
    if !(args.temperature >= 0.0 && args.temperature.is_finite()) {
        bail!("--temperature must be finite and >= 0, got {}", args.temperature);
    }
    point_to_checkpoints(&args.dir)?;
    crate::memory::check_load(&args.dir, &format!("generate {}", args.dir.display()))
        .with_context(|| format!("cannot load a model from {}", args.dir.display()))?;
    let (family, params) =
        family::load_hf(&args.dir).with_context(|| format!("cannot load a model from {}", args.dir.display()))?;
    let tok = tokenizer_of(&args.dir)?;
    let mut model = family.build(Build::default())?;
    let (vocab_size, context) = (family.vocab_size(), family.max_seq_len());
    let mut tokens = if args.chat {
        let mut messages = Vec::new();
        if let Some(s) = &args.system {
            messages.push(Message { role: Role::System, content: s.clone() });
        }
        messages.push(Message { role: Role::User, content: args.prompt.clone() });
        chat_prompt(&tok, &messages).with_context(|| format!("--chat: {}", args.dir.display()))?
    } else {
        let mut t = tok.encode(&args.prompt)?;
        if t.is_empty() {
            t.push(tok.bos_id().unwrap_or(b'\n' as u32));
        }
        t
    };
    if let Some(&t) = tokens.iter().find(|&&t| t as usize >= vocab_size) {
        bail!("prompt token {t} is outside the model's vocabulary of {vocab_size}");
    }
    if tokens.len() >= context {
        eprintln!(
            "warning: the prompt is {} tokens, the model's context is {context}: the model sees only the last {} of them (and of what it generates)",
            tokens.len(),
            context.saturating_sub(1).max(1)
        );
    }
    if !args.no_kv_cache {
        model.set_kv_cache((tokens.len() + args.max_new_tokens).min(context))?;
    }
    let stops = if args.chat { turn_ends(&tok) } else { Vec::new() };
    let mut rng = SplitMix64::new(args.seed);
    let mut out = std::io::stdout().lock();
    if !args.chat {
        write!(out, "{}", args.prompt)?;
    }
    let mut pending = Vec::new();
    let prompt_len = tokens.len();
    let pick = |logits: &[f32]| sample(logits, args.temperature, args.top_k, &mut rng);
    extend(&mut *model, &params, &mut tokens, args.max_new_tokens, context, &stops, pick, |next, len| {
        // Print whole UTF-8 characters as they complete.
        pending.push(next);
        let text = tok.decode(&pending)?;
        if !text.ends_with('\u{FFFD}') || pending.len() >= 4 {
            write!(out, "{text}")?;
            out.flush()?;
            pending.clear();
        }
        if len == context + 1 && prompt_len <= context && !args.no_kv_cache {
            eprintln!(
                "\nnote: the sequence is longer than the model's context of {context} tokens: each token now recomputes the last {context}"
            );
        }
        Ok(())
    })?;
    writeln!(out, "{}", tok.decode(&pending)?)?;
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

fn sample(logits: &[f32], temperature: f32, top_k: usize, rng: &mut SplitMix64) -> u32 {
    let mut idx: Vec<usize> = (0..logits.len()).collect();
    idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
    if temperature == 0.0 {
        return argmax(logits);
    }
    let k = if top_k == 0 { idx.len() } else { top_k.min(idx.len()) };
    let top = &idx[..k];
    let max = logits[top[0]];
    let weights: Vec<f64> = top.iter().map(|&i| (((logits[i] - max) / temperature) as f64).exp()).collect();
    let mut u = rng.next_f64() * weights.iter().sum::<f64>();
    for (&i, w) in top.iter().zip(&weights) {
        if u < *w {
            return i as u32;
        }
        u -= w;
    }
    top[k - 1] as u32
}
