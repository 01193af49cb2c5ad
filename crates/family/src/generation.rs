//! Generation's window rule, and greedy generation with and without a
//! key/value cache side by side (the check every family's cached pass
//! must pass).

use crate::{LanguageModel, Result};

/// The tokens a model reads to predict the next one: the whole sequence
/// while it fits the context, then its last `context` tokens (the window
/// slides, so every position shifts by one each step).
pub fn window(tokens: &[u32], context: usize) -> &[u32] {
    &tokens[tokens.len().saturating_sub(context)..]
}

/// The greedy choice: the largest logit, the lowest index among equals.
pub fn argmax(logits: &[f32]) -> u32 {
    let best =
        logits.iter().enumerate().fold(0, |best, (i, x)| if x.total_cmp(&logits[best]).is_gt() { i } else { best });
    best as u32
}

/// A greedy run: the tokens after the prompt and the logits each was chosen from.
#[derive(Debug, Clone, PartialEq)]
pub struct Greedy {
    /// The generated tokens.
    pub tokens: Vec<u32>,
    /// The logits of every step.
    pub logits: Vec<Vec<f32>>,
}

/// `n_new` greedy tokens after `prompt`, each from the logits of the
/// [`window`] of `context` tokens, as `macrobatch generate` runs at
/// temperature 0.
pub fn greedy(
    model: &mut dyn LanguageModel,
    params: &[f32],
    prompt: &[u32],
    n_new: usize,
    context: usize,
) -> Result<Greedy> {
    let mut seq = prompt.to_vec();
    let mut logits = Vec::with_capacity(n_new);
    for _ in 0..n_new {
        let l = model.next_token_logits(params, window(&seq, context))?;
        seq.push(argmax(&l));
        logits.push(l);
    }
    Ok(Greedy { tokens: seq.split_off(prompt.len()), logits })
}

/// Greedy generation of `n_new` tokens after `prompt` by `plain` (no
/// cache) and by `cached` with a key/value cache as `macrobatch generate`
/// sizes it (the prompt and the new tokens, at most the context). Returns
/// both runs and the largest difference of a step's logits relative to
/// that step's largest logit magnitude.
pub fn with_and_without_cache(
    plain: &mut dyn LanguageModel,
    cached: &mut dyn LanguageModel,
    params: &[f32],
    prompt: &[u32],
    (n_new, context): (usize, usize),
) -> Result<(Greedy, Greedy, f32)> {
    plain.set_kv_cache(0)?;
    let without = greedy(plain, params, prompt, n_new, context)?;
    cached.set_kv_cache((prompt.len() + n_new).min(context))?;
    let with = greedy(cached, params, prompt, n_new, context)?;
    let rel = without
        .logits
        .iter()
        .zip(&with.logits)
        .map(|(a, b)| {
            let scale = a.iter().fold(0.0f32, |m, x| m.max(x.abs())).max(f32::MIN_POSITIVE);
            a.iter().zip(b).fold(0.0f32, |m, (x, y)| m.max((x - y).abs())) / scale
        })
        .fold(0.0f32, f32::max);
    Ok((without, with, rel))
}

/// What [`check_kv_cache`] saw.
#[derive(Debug, Clone, PartialEq)]
pub struct CacheCheck {
    /// The largest difference of a step's logits with and without the
    /// cache, relative to that step's largest logit magnitude.
    pub rel: f32,
    /// Distinct tokens generated over all runs (a check that saw one
    /// repeated token saw little).
    pub distinct: usize,
}

/// For each `(prompt, n_new)` of `runs`: greedy generation by a model from
/// `make` with a key/value cache gives the tokens a model without one
/// gives, and every step's logits within `tolerance` of the step's largest
/// logit magnitude; an error says which run differs and how.
pub fn check_kv_cache(
    make: &dyn Fn() -> Result<Box<dyn LanguageModel>>,
    params: &[f32],
    runs: &[(Vec<u32>, usize)],
    context: usize,
    tolerance: f32,
) -> Result<CacheCheck> {
    let (mut worst, mut seen) = (0.0f32, std::collections::BTreeSet::new());
    for (prompt, n_new) in runs {
        let (mut plain, mut cached) = (make()?, make()?);
        let (without, with, rel) =
            with_and_without_cache(&mut *plain, &mut *cached, params, prompt, (*n_new, context))?;
        let what = format!("prompt of {} tokens, {n_new} new, context {context}", prompt.len());
        if with.tokens != without.tokens {
            return Err(format!(
                "{what}: greedy tokens {:?} with the cache, {:?} without",
                with.tokens, without.tokens
            )
            .into());
        }
        if rel.is_nan() || rel > tolerance {
            return Err(format!("{what}: logits differ by {rel:e} of the largest (tolerance {tolerance:e})").into());
        }
        worst = worst.max(rel);
        seen.extend(with.tokens);
    }
    Ok(CacheCheck { rel: worst, distinct: seen.len() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_window_slides_past_the_context_and_argmax_takes_the_first_maximum() {
        assert_eq!(window(&[1, 2, 3], 4), &[1, 2, 3]);
        assert_eq!(window(&[1, 2, 3, 4, 5], 3), &[3, 4, 5]);
        assert_eq!(argmax(&[0.5, 2.0, -1.0, 2.0]), 1);
        assert_eq!(argmax(&[-3.0]), 0);
    }
}
