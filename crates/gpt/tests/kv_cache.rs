//! Generation with a key/value cache gives the greedy tokens of
//! generation without one, and each step's logits within rounding: the
//! cached pass runs the same block code on the new row only, with its
//! attention over the cache (the GEMMs see one row instead of the whole
//! window, so they may block their sums differently in the last bits).

use engine::rng::SplitMix64;
use family::generation::check_kv_cache;
use family::{Erased, LanguageModel};
use gpt::{init_params, Gpt, GptConfig};

/// A small GPT-2 whose context (24) a 40-token run crosses.
fn cfg() -> GptConfig {
    GptConfig { n_layer: 3, n_head: 4, n_embd: 32, block_size: 24, vocab_size: 64 }
}

/// Random parameters, scaled up from the training initialisation so the
/// logits are far apart (no near-ties for rounding to flip).
fn params() -> Vec<f32> {
    init_params(&cfg(), 3).into_iter().map(|x| x * 8.0).collect()
}

fn prompt(len: usize) -> Vec<u32> {
    let mut rng = SplitMix64::new(len as u64);
    (0..len).map(|_| rng.below(64) as u32).collect()
}

/// Logit differences relative to each step's largest logit, measured:
/// 2.8e-6 (f32 rounding, ~6e-8 per operation, grown by parameters scaled
/// ×8 through three blocks). A real error (a row at the wrong learned
/// position, a key missing from the cache) moves logits by whole percents;
/// the bound leaves 3× room for another CPU's GEMM blocking.
const TOLERANCE: f32 = 1e-5;

#[test]
fn cached_greedy_tokens_and_logits_match_the_uncached_ones() {
    let make = || -> family::Result<Box<dyn LanguageModel>> { Ok(Box::new(Erased(Gpt::new(cfg())?))) };
    // (prompt, new tokens): within the context; crossing it (the window
    // slides after 24 tokens); a prompt longer than the context.
    let runs = [(prompt(5), 15), (prompt(6), 42), (prompt(30), 12)];
    let seen = check_kv_cache(&make, &params(), &runs, cfg().block_size, TOLERANCE).unwrap();
    println!("largest relative logit difference {:e}", seen.rel);
    assert!(seen.distinct >= 6, "only {} distinct tokens generated: the check would see little", seen.distinct);
}

/// A cache sized for fewer positions than the sequence reaches is used
/// while the sequence fits and bypassed after; dropping it (0) restores
/// the uncached path bit for bit.
#[test]
fn a_short_cache_and_a_dropped_cache_change_nothing() {
    let params = params();
    let seq = prompt(20);
    let mut plain = Gpt::new(cfg()).unwrap();
    let want: Vec<Vec<f32>> = (1..=seq.len()).map(|t| plain.next_token_logits(&params, &seq[..t]).unwrap()).collect();
    let mut model = Gpt::new(cfg()).unwrap();
    model.set_kv_cache(8).unwrap();
    for (t, w) in (1..=seq.len()).zip(&want) {
        let got = model.next_token_logits(&params, &seq[..t]).unwrap();
        let err = got.iter().zip(w).fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(err <= TOLERANCE * 100.0, "position {t}: {err}");
        if t > 8 {
            assert_eq!(&got, w, "past the cache the whole sequence runs as without one");
        }
    }
    model.set_kv_cache(0).unwrap();
    assert_eq!(model.next_token_logits(&params, &seq[..5]).unwrap(), want[4]);
}
