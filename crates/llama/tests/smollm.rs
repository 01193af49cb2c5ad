//! A real pretrained model: SmolLM2-135M-Instruct read from its GGUF file
//! (Q4_1 / Q8_0 dequantised, Q/K un-permuted) computes the logits and the
//! masked chat loss that transformers' `LlamaForCausalLM` computes from the
//! same file (fixtures/smollm_reference.json, made by
//! fixtures/make_smollm_reference.py). Needs the file
//! (scripts/fetch-smollm.sh); CI requires it.

use engine::{FullStore, Model};
use llama::{hf, Llama, LlamaConfig, TokenBatch};

#[test]
fn smollm2_logits_and_masked_loss_equal_transformers() {
    let Some(path) = gguf::testing::smollm2_or_skip("smollm2_logits_and_masked_loss_equal_transformers") else {
        return;
    };
    let reference: serde_json::Value =
        serde_json::from_str(include_str!("fixtures/smollm_reference.json")).expect("reference JSON");
    let (config, tensors) = gguf::llama::load(&path).unwrap();
    let cfg = LlamaConfig::from_hf_json(&config).unwrap();
    let params = hf::from_named_tensors(&cfg, tensors).unwrap();
    let mut model = Llama::new(cfg.clone()).unwrap();
    let ints = |k: &str| reference[k].as_array().unwrap().iter().map(|v| v.as_i64().unwrap()).collect::<Vec<_>>();
    let inputs: Vec<u32> = ints("inputs").iter().map(|&x| x as u32).collect();
    let targets: Vec<i32> = ints("targets").iter().map(|&x| x as i32).collect();
    let t = inputs.len();
    let batch = TokenBatch { n_seqs: 1, seq_len: t, inputs, targets, positions: Vec::new() };
    let logits = model.logits(&params, &batch).unwrap();
    let v = cfg.vocab_size;
    let probe: Vec<usize> = ints("probe_ids").iter().map(|&x| x as usize).collect();
    // Tolerance: both sides compute in f32, but sum the 576- to 1536-term dot
    // products of 30 layers in different orders (our GEMM vs MKL); rounding
    // of ~1e-7 relative per operation accumulates to ~1e-4 absolute on
    // logits of magnitude ~30 (measured below). 2e-3 leaves a 10× margin and
    // still catches any real error (a wrong RoPE pairing or permutation is
    // off by whole units).
    const ATOL: f64 = 2e-3;
    let mut worst = 0.0f64;
    for row in reference["rows"].as_array().unwrap() {
        let p = row["position"].as_u64().unwrap() as usize;
        let ours = &logits[p * v..(p + 1) * v];
        let want = |k: &str| row[k].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect::<Vec<_>>();
        for (&id, &w) in probe.iter().zip(&want("probe_values")) {
            worst = worst.max((ours[id] as f64 - w).abs());
        }
        let top_ids: Vec<usize> =
            row["top_ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as usize).collect();
        for (&id, &w) in top_ids.iter().zip(&want("top_values")) {
            worst = worst.max((ours[id] as f64 - w).abs());
        }
        // The same most likely token.
        let argmax = (0..v).max_by(|&a, &b| ours[a].total_cmp(&ours[b])).unwrap();
        assert_eq!(argmax, top_ids[0], "position {p}: most likely token");
        let max = ours.iter().fold(f64::MIN, |m, &x| m.max(x as f64));
        let lse = max + ours.iter().map(|&x| (x as f64 - max).exp()).sum::<f64>().ln();
        worst = worst.max((lse - row["logsumexp"].as_f64().unwrap()).abs());
    }
    println!("largest logit difference to transformers: {worst:.2e}");
    assert!(worst <= ATOL, "logits differ from transformers by {worst:e} (tolerance {ATOL:e})");
    // The masked loss: only the assistant's reply (and its end of turn) counts.
    let mut store = FullStore::read_only(model.layout(), model.segments(), &params).unwrap();
    let stats = model.loss(&mut store, &batch).unwrap();
    let n = reference["n_targets"].as_u64().unwrap();
    assert_eq!(stats.n_targets, n, "targets counted");
    let want = reference["loss_mean"].as_f64().unwrap();
    let got = stats.loss_sum / n as f64;
    println!("masked loss {got:.7} vs transformers {want:.7} over {n} targets");
    // A mean of a few log-probabilities: the logits' 1e-4 carries over at most.
    assert!((got - want).abs() <= 1e-4 * want.abs().max(1.0), "loss {got} vs {want}");
}
