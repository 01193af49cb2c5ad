//! Logits, loss and every gradient against transformers' LlamaForCausalLM
//! and PEFT's LoRA on the same weights and batch (fixtures made by
//! tests/fixtures/make_fixtures.py; its docstring has the command).
//!
//! Tolerances: both sides compute in f32 with different summation orders
//! (GEMM blocking, our row-ordered reductions, fast_exp vs libm exp within
//! 2 ulp), so each value carries rounding of ~1e-7 relative per operation,
//! grown through 2 layers and the backward's chains of GEMMs. 1e-5 of a
//! tensor's largest magnitude is ~10× the largest error measured (printed
//! by each test) and far below any real mistake (a wrong RoPE pairing,
//! head grouping or scale changes values at the 1e-1 level).

mod common;
use common::{batch, compare, fixture, loss_and_grad, reference, rel_err, TOL};
use engine::Model;
use engine::Precision;
use llama::{hf, lora, Llama};

#[test]
fn untied_gqa_llama_matches_transformers() {
    let (cfg, params) = hf::load(&fixture("untied")).unwrap();
    assert!(!cfg.tie_word_embeddings && cfg.n_kv_head < cfg.n_head);
    compare("untied", &mut Llama::new(cfg).unwrap(), &params);
}

#[test]
fn tied_llama_with_another_rope_theta_matches_transformers() {
    let (cfg, params) = hf::load(&fixture("tied")).unwrap();
    assert!(cfg.tie_word_embeddings && cfg.rope_theta == 500.0);
    compare("tied", &mut Llama::new(cfg).unwrap(), &params);
}

#[test]
fn peft_lora_adapter_matches_peft() {
    let (cfg, base) = hf::load(&fixture("untied")).unwrap();
    let adapter = lora::load_adapter(&fixture("lora")).unwrap();
    assert_eq!((adapter.config.r, adapter.config.alpha), (4, 8.0));
    let mut model = Llama::with_lora(cfg, adapter.config.clone(), Precision::F32).unwrap();
    let mut params = lora::attach(&model, &base, 0).unwrap();
    adapter.apply(&model, &mut params).unwrap();
    // PEFT freezes the base: only the adapters have gradients.
    model.set_trainable(&|t| lora::is_adapter(&t.name));
    compare("lora", &mut model, &params);
}

#[test]
fn next_token_logits_match_transformers_last_position_and_keep_one_layer() {
    let (cfg, params) = hf::load(&fixture("untied")).unwrap();
    let (want, b) = (reference("untied"), batch("untied"));
    let (t, v) = (b.seq_len, cfg.vocab_size);
    let mut model = Llama::new(cfg.clone()).unwrap();
    for seq in 0..b.n_seqs {
        let got = model.next_token_logits(&params, &b.inputs[seq * t..(seq + 1) * t]).unwrap();
        let last = &want["logits"][(seq * t + t - 1) * v..(seq * t + t) * v];
        let e = rel_err(&got, last);
        assert!(e <= TOL, "sequence {seq}: {e:e}");
    }
    // A forward-only pass keeps one layer's activations; training keeps every layer's.
    let one = b.inputs[..t].to_vec();
    let single = common::TokenBatch {
        n_seqs: 1,
        seq_len: t,
        targets: b.targets[..t].to_vec(),
        inputs: one,
        positions: Vec::new(),
    };
    let mut trained = Llama::new(cfg.clone()).unwrap();
    loss_and_grad(&mut trained, &params, &single);
    // Both also keep the embedding's output (T·C f32).
    let embed = 4 * t * cfg.hidden_size;
    let layer = model.saved_activation_bytes() - embed;
    assert_eq!(trained.saved_activation_bytes(), embed + cfg.n_layer * layer);
}
