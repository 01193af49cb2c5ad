//! DPO over a LoRA-adapted Llama: the loss equals TRL's formula computed
//! from separately measured log probabilities (the reference with its
//! `lora_B` tensors zeroed in a copy of the parameters), its gradient
//! equals central finite differences, and a pair's numbers do not depend
//! on the rows it shares a micro-batch with.

mod common;
use common::fixture;
use engine::rng::SplitMix64;
use engine::{FullStore, Model, Precision, TokenBatch, IGNORE_INDEX};
use family::dpo::{pair_rows, Dpo, AUX_CHOSEN_REWARD, AUX_CORRECT, AUX_REJECTED_REWARD};
use family::Erased;
use llama::lora::{self, LoraConfig};
use llama::{hf, Llama};

const BETA: f32 = 0.5;

/// The untied fixture with LoRA on q and v; only the adapters train.
fn build() -> Llama {
    let (cfg, _) = hf::load(&fixture("untied")).unwrap();
    let mut model = Llama::with_lora(cfg, LoraConfig::new(2, 4.0, &["q_proj", "v_proj"]), Precision::F32).unwrap();
    model.set_trainable(&|t| t.name.contains(".lora_"));
    model
}

/// [`build`] and its parameters, the adapters' B set to N(0, 0.2) so that
/// the policy differs from the reference.
fn adapted() -> (Llama, Vec<f32>) {
    let (_, base) = hf::load(&fixture("untied")).unwrap();
    let model = build();
    let mut params = lora::attach(&model, &base, 3).unwrap();
    let mut rng = SplitMix64::new(9);
    for t in model.layout().tensors() {
        if t.name.ends_with("lora_B.weight") {
            params[t.range()].iter_mut().for_each(|p| *p = (rng.normal() * 0.2) as f32);
        }
    }
    (model, params)
}

/// Two pairs as four rows `[c₀, r₀, c₁, r₁]`: a 3-token prompt (ignored)
/// and replies of different lengths, padded to the longest row.
fn pair_batch(vocab: u32) -> TokenBatch {
    let rows: [(&[u32], usize); 4] =
        [(&[5, 9, 2, 7, 7, 1], 3), (&[5, 9, 2, 4], 3), (&[3, 3, 8, 1, 2], 3), (&[3, 3, 8, 6, 6, 6, 9], 3)];
    let t = rows.iter().map(|(r, _)| r.len() - 1).max().unwrap();
    let mut b = TokenBatch { n_seqs: 4, seq_len: t, ..TokenBatch::default() };
    for (tokens, n_prompt) in rows {
        let tokens: Vec<u32> = tokens.iter().map(|x| x % vocab).collect();
        for j in 0..t {
            b.inputs.push(tokens.get(j).copied().unwrap_or(0));
            let target = tokens.get(j + 1).filter(|_| j + 1 >= n_prompt);
            b.targets.push(target.map_or(IGNORE_INDEX, |&x| x as i32));
        }
    }
    b
}

/// Σ log p of a row's targets under `params`, measured with the plain model.
fn logp(model: &mut Llama, params: &[f32], row: &TokenBatch) -> f64 {
    -model.loss(&mut FullStore::read_only_for(model, params).unwrap(), row).unwrap().loss_sum
}

#[test]
fn dpo_loss_is_trls_formula_and_its_gradient_matches_finite_differences() {
    let (mut model, params) = adapted();
    let vocab = model.config().vocab_size as u32;
    let batch = pair_batch(vocab);
    let mut reference_params = params.clone();
    for t in model.layout().tensors() {
        if t.name.ends_with("lora_B.weight") {
            reference_params[t.range()].fill(0.0);
        }
    }
    // TRL (loss_type "sigmoid"): logits = (π_c − π_r) − (ρ_c − ρ_r);
    // loss = −logsigmoid(β·logits); rewards = β·(π − ρ).
    let rows = pair_rows(&batch).unwrap();
    let (mut want_loss, mut want_c, mut want_r) = (0.0, 0.0, 0.0);
    for p in rows.chunks(2) {
        let (pc, pr) = (logp(&mut model, &params, &p[0]), logp(&mut model, &params, &p[1]));
        let (rc, rr) = (logp(&mut model, &reference_params, &p[0]), logp(&mut model, &reference_params, &p[1]));
        let z = BETA as f64 * ((pc - rc) - (pr - rr));
        want_loss += (1.0 + (-z).exp()).ln();
        want_c += BETA as f64 * (pc - rc);
        want_r += BETA as f64 * (pr - rr);
    }
    let mut dpo = Dpo::new(Box::new(Erased(build())), BETA).unwrap();
    let trainable = dpo.layout().n_trainable();
    let mut grads = vec![0.0; trainable];
    let stats = dpo.micro_step(&mut FullStore::for_model(&dpo, &params, &mut grads).unwrap(), &batch, 1.0).unwrap();
    let aux = dpo.take_aux_stats();
    // The same log probabilities in the same order: only softplus's
    // formula differs (ours is the overflow-safe form), ~1e-16 relative.
    assert_eq!(stats.n_targets, 2);
    assert!((stats.loss_sum - want_loss).abs() < 1e-12, "{} vs {want_loss}", stats.loss_sum);
    assert!((aux[AUX_CHOSEN_REWARD] - want_c).abs() < 1e-12 && (aux[AUX_REJECTED_REWARD] - want_r).abs() < 1e-12);
    assert!(aux[AUX_CORRECT] <= 2.0);
    assert!(stats.loss_sum != 2.0 * std::f64::consts::LN_2, "the policy must differ from the reference here");
    assert_eq!(dpo.take_aux_stats(), [0.0; engine::AUX_STATS], "taking the sums resets them");

    // Finite differences over every 5th trainable value (the adapters):
    // rounding noise of the f32 forwards (log-probability sums of O(10),
    // ~1e-6 each) over 2h = 2e-2 is ~1e-4, the truncation O(h²) smaller;
    // tolerances as in the GPT-2 whole-model check.
    let layout = dpo.layout().clone();
    let trained: Vec<usize> =
        layout.tensors().iter().filter(|t| t.trainable).flat_map(|t| t.range()).step_by(5).collect();
    let grad_of: std::collections::HashMap<usize, usize> = layout
        .tensors()
        .iter()
        .filter(|t| t.trainable)
        .flat_map(|t| t.range())
        .enumerate()
        .map(|(g, p)| (p, g))
        .collect();
    let x: Vec<f32> = trained.iter().map(|&i| params[i]).collect();
    let analytic: Vec<f32> = trained.iter().map(|&i| grads[grad_of[&i]]).collect();
    let loss = |sub: &[f32]| {
        let mut p = params.clone();
        trained.iter().zip(sub).for_each(|(&i, &v)| p[i] = v);
        let mut d = Dpo::new(Box::new(Erased(build())), BETA).unwrap();
        d.loss(&mut FullStore::read_only(&layout, d.segments(), &p).unwrap(), &batch).unwrap().loss_sum
    };
    nn::fd::check_gradient("dpo", &x, &analytic, (1e-2, 1e-3, 1e-2), loss);
}

#[test]
fn a_pairs_loss_does_not_depend_on_its_micro_batch() {
    let (model, params) = adapted();
    let batch = pair_batch(model.config().vocab_size as u32);
    let mut dpo = Dpo::new(Box::new(Erased(model)), BETA).unwrap();
    let together = dpo.loss(&mut FullStore::read_only_for(&dpo, &params).unwrap(), &batch).unwrap().loss_sum;
    // Each pair alone, with its rows cut to their own length.
    let rows = pair_rows(&batch).unwrap();
    let mut alone = 0.0;
    for p in rows.chunks(2) {
        let t = p[0].seq_len.max(p[1].seq_len);
        let mut b = TokenBatch { n_seqs: 2, seq_len: t, ..TokenBatch::default() };
        for r in p {
            b.inputs.extend(r.inputs.iter().copied().chain(std::iter::repeat(0)).take(t));
            b.targets.extend(r.targets.iter().copied().chain(std::iter::repeat(IGNORE_INDEX)).take(t));
        }
        alone += dpo.loss(&mut FullStore::read_only_for(&dpo, &params).unwrap(), &b).unwrap().loss_sum;
    }
    assert_eq!(together.to_bits(), alone.to_bits(), "pairs are computed row by row, whatever shares their batch");
}

#[test]
fn dpo_needs_adapters_and_a_positive_beta() {
    let (cfg, _) = hf::load(&fixture("untied")).unwrap();
    let plain = Llama::new(cfg).unwrap();
    let e = Dpo::new(Box::new(Erased(plain)), BETA).err().unwrap();
    assert!(e.to_string().contains("[lora]"), "{e}");
    let (model, _) = adapted();
    assert!(Dpo::new(Box::new(Erased(model)), 0.0).err().unwrap().to_string().contains("dpo_beta"));
}
