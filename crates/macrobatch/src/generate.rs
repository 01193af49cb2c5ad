//! `macrobatch generate`: sample from a saved model (a run folder, a
//! Hugging Face folder or a GGUF file) with its own tokenizer; `--chat`
//! answers the prompt as the assistant through the chat template. Either
//! stops at the model's end-of-sequence token (`--ignore-eos`: never).
//!
//! The model keeps a key/value cache (unless `--no-kv-cache`): the prompt
//! runs once, then each step runs the new token only. Once the sequence is
//! longer than the context the model sees its last `context` tokens, as
//! without the cache: every position shifts each step, so each step
//! recomputes that window.

use crate::family::Build;
use crate::saved::{argmax, chat_prompt, eos_ids, extend, point_to_checkpoints, tokenizer_of, turn_ends};
use crate::GenerateArgs;
use anyhow::{bail, Context, Result};
use data::{Message, Role};
use engine::rng::SplitMix64;
use std::io::Write;

/// Samples `max_new_tokens` tokens after the prompt and prints the text.
pub fn run(args: GenerateArgs) -> Result<()> {
    if !(args.temperature >= 0.0 && args.temperature.is_finite()) {
        bail!("--temperature must be finite and >= 0, got {}", args.temperature);
    }
    point_to_checkpoints(&args.dir)?;
    let (family, params) =
        crate::saved::load_for_inference(&args.dir, &format!("generate {}", args.dir.display()), args.dequantize)
            .with_context(|| format!("cannot load a model from {}", args.dir.display()))?;
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
    // Plain text stops at the model's end of sequence, as transformers'
    // `generate` and llama.cpp do; a chat also at the end of a turn.
    let mut stops = eos_ids(&args.dir, &tok)?;
    if args.chat {
        for t in turn_ends(&tok) {
            if !stops.contains(&t) {
                stops.push(t);
            }
        }
    }
    if args.ignore_eos {
        stops.clear();
    }
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
