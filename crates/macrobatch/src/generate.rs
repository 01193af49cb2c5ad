//! `macrobatch generate`: sample from a saved model.

use crate::GenerateArgs;
use anyhow::{Context, Result};
use data::ByteTokenizer;
use engine::rng::SplitMix64;
use std::io::Write;

/// Samples `max_new_tokens` tokens after the prompt and prints the text.
pub fn run(args: GenerateArgs) -> Result<()> {
    crate::memory::check_load(&args.dir, &format!("generate {}", args.dir.display()))
        .with_context(|| format!("cannot load a model from {}", args.dir.display()))?;
    let (family, params) = crate::family::load_hf(&args.dir)
        .with_context(|| format!("cannot load a model from {}", args.dir.display()))?;
    if !(args.temperature >= 0.0 && args.temperature.is_finite()) {
        anyhow::bail!("--temperature must be finite and >= 0, got {}", args.temperature);
    }
    let mut model = family.build(crate::family::Build::default())?;
    let (vocab_size, context) = (family.vocab_size(), family.max_seq_len());
    let tok = ByteTokenizer;
    let mut tokens = tok.encode(&args.prompt);
    if tokens.is_empty() {
        tokens.push(b'\n' as u32);
    }
    if let Some(&t) = tokens.iter().find(|&&t| t as usize >= vocab_size) {
        anyhow::bail!("prompt byte {t} is outside the model's vocabulary of {vocab_size}");
    }
    let mut rng = SplitMix64::new(args.seed);
    let mut out = std::io::stdout().lock();
    write!(out, "{}", args.prompt)?;
    let mut pending = Vec::new();
    for _ in 0..args.max_new_tokens {
        let ctx = &tokens[tokens.len().saturating_sub(context)..];
        let logits = model.next_token_logits(&params, ctx)?;
        let next = sample(&logits, args.temperature, args.top_k, &mut rng);
        tokens.push(next);
        // Print whole UTF-8 characters as they complete.
        pending.push(next);
        let text = tok.decode(&pending);
        if !text.ends_with('\u{FFFD}') || pending.len() >= 4 {
            write!(out, "{text}")?;
            out.flush()?;
            pending.clear();
        }
    }
    writeln!(out, "{}", tok.decode(&pending))?;
    Ok(())
}

fn sample(logits: &[f32], temperature: f32, top_k: usize, rng: &mut SplitMix64) -> u32 {
    let mut idx: Vec<usize> = (0..logits.len()).collect();
    idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
    if temperature == 0.0 {
        return idx[0] as u32;
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
