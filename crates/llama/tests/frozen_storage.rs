//! A packed frozen base (bf16, Q8_0, Q4_0, Q4_1, NF4 with and without
//! double quantisation) held outside the layout computes what the f32
//! model computes on the base's dequantised values: logits, the summed
//! loss and every adapter gradient, with and without activation
//! checkpointing. The packed GEMMs dequantise a panel and multiply it with
//! the f32 kernel, so the products are the f32 model's to the bit.

use engine::rng::SplitMix64;
use engine::{Checkpointing, FullStore, Model, Precision, TokenBatch};
use llama::lora::{self, LoraConfig};
use llama::{FrozenBase, Llama, LlamaConfig, Proj};
use nn::linear::PackFormat;
use std::sync::Arc;

/// The tiny preset with an MLP width every block size divides.
fn cfg() -> LlamaConfig {
    LlamaConfig { intermediate_size: 192, ..LlamaConfig::preset("tiny").unwrap() }
}

fn batch(cfg: &LlamaConfig) -> TokenBatch {
    let mut rng = SplitMix64::new(9);
    let (b, t) = (2, 12);
    let mut tok = || (rng.next_u64() % cfg.vocab_size as u64) as u32;
    let inputs: Vec<u32> = (0..b * t).map(|_| tok()).collect();
    let targets = (0..b * t).map(|_| tok() as i32).collect();
    TokenBatch { n_seqs: b, seq_len: t, inputs, targets, positions: Vec::new() }
}

fn trainable_adapters(m: &mut Llama) {
    m.set_trainable(&|t| lora::is_adapter(&t.name));
}

/// Loss and the trainable gradients of one micro-step.
fn step(m: &mut Llama, params: &[f32], b: &TokenBatch) -> (f64, Vec<f32>) {
    let mut g = vec![0.0; m.layout().n_trainable()];
    let mut store = FullStore::for_model(m, params, &mut g).unwrap();
    let stats = m.micro_step(&mut store, b, 1.0).unwrap();
    (stats.loss_sum, g)
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn packed_base_computes_the_f32_model_on_its_dequantised_values() {
    let cfg = cfg();
    let plain = Llama::new(cfg.clone()).unwrap();
    let base_params = plain.init_params(3);
    let b = batch(&cfg);
    // DoRA's row norms read the packed base too (a block of rows dequantised at a time).
    let dora = LoraConfig { use_dora: true, ..LoraConfig::new(4, 8.0, &["all-linear"]) };
    for (fmt, lora_cfg) in
        PackFormat::ALL.into_iter().flat_map(|f| [(f, LoraConfig::new(4, 8.0, &["all-linear"])), (f, dora.clone())])
    {
        let base = FrozenBase::quantize(&cfg, &base_params, fmt).unwrap();
        assert_eq!(base.bytes() as u128, FrozenBase::planned_bytes(&cfg, |_| fmt), "{fmt}: bytes as planned");
        // The f32 model on the dequantised base.
        let mut deq = base_params.clone();
        for layer in 0..cfg.n_layer {
            for pr in Proj::ALL {
                let w = base.dequantize(&cfg, layer, pr);
                let range = plain.layer_params(layer).w(pr);
                assert_eq!(w.len(), range.len());
                // Quantising moved the values (bf16 at least rounds some of them).
                deq[range].copy_from_slice(&w);
            }
        }
        assert_ne!(bits(&deq), bits(&base_params), "{fmt}: packing rounds the base");
        for ck in [Checkpointing::None, Checkpointing::Blocks] {
            let mut f32_model =
                Llama::with_lora(cfg.clone(), lora_cfg.clone(), Precision::F32).unwrap().with_checkpointing(ck);
            let mut pf = lora::attach(&f32_model, &deq, 5).unwrap();
            // Non-zero B, so every adapter takes part.
            let mut rng = SplitMix64::new(6);
            for t in f32_model.layout().tensors().iter().filter(|t| t.name.contains("lora_B")) {
                pf[t.range()].iter_mut().for_each(|x| *x = (rng.normal() * 0.05) as f32);
            }
            let base = Arc::new(base.clone());
            let mut packed = Llama::with_frozen_base(cfg.clone(), Some(lora_cfg.clone()), Precision::F32, base)
                .unwrap()
                .with_checkpointing(ck);
            // The packed model's layout is the f32 one without the projections' weights.
            let names: Vec<_> = packed.layout().tensors().iter().map(|t| t.name.clone()).collect();
            let projs = 7 * cfg.n_layer;
            // Attached to the packed base, the adapters start as on the dequantised f32 base
            // (DoRA's magnitudes: the packed rows' norms).
            let rest: Vec<f32> = packed
                .plain()
                .unwrap()
                .layout()
                .tensors()
                .iter()
                .flat_map(|t| deq[plain.layout().get(&t.name).unwrap().range()].to_vec())
                .collect();
            let (init_p, init_f) =
                (lora::attach(&packed, &rest, 5).unwrap(), lora::attach(&f32_model, &deq, 5).unwrap());
            for t in packed.layout().tensors().iter().filter(|t| lora::is_adapter(&t.name)) {
                let want = &init_f[f32_model.layout().get(&t.name).unwrap().range()];
                assert!(bits(&init_p[t.range()]) == bits(want), "{fmt}: {} at attach", t.name);
            }
            assert_eq!(names.len() + projs, f32_model.layout().tensors().len(), "{fmt}");
            assert!(names.iter().all(|n| n.contains("lora_") || !n.ends_with("proj.weight")), "{names:?}");
            let pp: Vec<f32> = packed
                .layout()
                .tensors()
                .iter()
                .flat_map(|t| pf[f32_model.layout().get(&t.name).unwrap().range()].to_vec())
                .collect();
            let lf = f32_model.logits(&pf, &b).unwrap();
            let lp = packed.logits(&pp, &b).unwrap();
            assert!(bits(&lf) == bits(&lp), "{fmt} {ck:?}: logits differ");
            trainable_adapters(&mut f32_model);
            trainable_adapters(&mut packed);
            let (loss_f, gf) = step(&mut f32_model, &pf, &b);
            let (loss_p, gp) = step(&mut packed, &pp, &b);
            assert_eq!(loss_f.to_bits(), loss_p.to_bits(), "{fmt} {ck:?}: loss");
            assert!(gf.iter().any(|&g| g != 0.0), "the adapters get a gradient");
            assert!(bits(&gf) == bits(&gp), "{fmt} {ck:?}: adapter gradients differ");
        }
    }
}

#[test]
fn a_base_of_the_wrong_shape_is_refused() {
    let cfg = cfg();
    let params = Llama::new(cfg.clone()).unwrap().init_params(1);
    let base = Arc::new(FrozenBase::quantize(&cfg, &params, PackFormat::Bf16).unwrap());
    let deeper = LlamaConfig { n_layer: 3, ..cfg.clone() };
    let e = Llama::with_frozen_base(deeper, None, Precision::F32, base).err().map(|e| e.to_string());
    assert!(e.as_deref().is_some_and(|e| e.contains("2 layers packed for a model of 3")), "{e:?}");
    // Q4_0 blocks of 32 cannot hold rows of 176 values (the tiny preset's MLP).
    let odd = LlamaConfig::preset("tiny").unwrap();
    let p = Llama::new(odd.clone()).unwrap().init_params(1);
    let e = FrozenBase::quantize(&odd, &p, PackFormat::Q4_0).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("train.frozen_dtype") && e.contains("176"), "{e}");
}
