//! QLoRA on GPT-2: the four `Conv1D` weights of every block held packed
//! outside the parameters ([`gpt::FrozenBase`], bf16 or NF4) compute what
//! the f32 LoRA / DoRA model computes on the base's dequantised values;
//! DoRA's magnitudes start at the packed rows' norms, merging dequantises
//! the base into the plain model, and a model folder saved from the packed
//! layout holds the dequantised base.

mod common;

use engine::rng::SplitMix64;
use engine::{FullStore, Model, Precision};
use gpt::{lora, Batch, FrozenBase, Gpt, GptConfig};
use nn::linear::PackFormat;
use nn::lora::LoraConfig;
use std::sync::Arc;

/// Every input width (64, 256) a multiple of NF4's blocks of 64.
fn cfg() -> GptConfig {
    GptConfig { n_layer: 2, n_head: 2, n_embd: 64, block_size: 8, vocab_size: 32 }
}

const FORMATS: [PackFormat; 3] =
    [PackFormat::Bf16, PackFormat::Nf4 { double_quant: false }, PackFormat::Nf4 { double_quant: true }];

/// Three sequences of 8 random tokens.
fn batch() -> Batch {
    let mut rng = SplitMix64::new(21);
    let (b, t) = (3, 8);
    let inputs: Vec<u32> = (0..b * t).map(|_| rng.below(32) as u32).collect();
    let targets: Vec<i32> = (0..b * t).map(|_| rng.below(32) as i32).collect();
    Batch { n_seqs: b, seq_len: t, inputs, targets, positions: Vec::new() }
}

/// A noisy base (layout of `Gpt::new`), packed in `format`, and the base
/// with its `Conv1D` weights replaced by the packed ones' values.
fn bases(format: PackFormat) -> (FrozenBase, Vec<f32>) {
    let mut rng = SplitMix64::new(5);
    let mut base = gpt::init_params(&cfg(), 5);
    base.iter_mut().for_each(|x| *x += (0.1 * rng.normal()) as f32);
    let frozen = FrozenBase::quantize(&cfg(), &base, format).unwrap();
    let plain = Gpt::new(cfg()).unwrap();
    let mut deq = base.clone();
    for b in 0..cfg().n_layer {
        for (i, conv) in gpt::layout::CONVS.iter().enumerate() {
            let r = plain.layout().get(&format!("transformer.h.{b}.{conv}.weight")).unwrap().range();
            deq[r].copy_from_slice(&frozen.dequantize(b, i));
        }
    }
    (frozen, deq)
}

/// bf16 values pack exactly, in place: each layer dequantises to the
/// `Conv1D` weight it was packed from (`[in, out]`, not transposed).
#[test]
fn bf16_values_pack_exactly_in_place() {
    let plain = Gpt::new(cfg()).unwrap();
    let base: Vec<f32> =
        gpt::init_params(&cfg(), 8).iter().map(|x| f32::from_bits(x.to_bits() & 0xffff_0000)).collect();
    let frozen = FrozenBase::quantize(&cfg(), &base, PackFormat::Bf16).unwrap();
    assert_eq!(frozen.format_names(), "bf16");
    assert_eq!(frozen.bytes() as u128, FrozenBase::planned_bytes(&cfg(), PackFormat::Bf16));
    for b in 0..cfg().n_layer {
        for (i, conv) in gpt::layout::CONVS.iter().enumerate() {
            let r = plain.layout().get(&format!("transformer.h.{b}.{conv}.weight")).unwrap().range();
            assert_eq!(bits(&frozen.dequantize(b, i)), bits(&base[r]), "{conv} of block {b}");
        }
    }
}

/// `params` (laid out by `from`) cut to `to`'s tensors, by name.
fn by_name(from: &Gpt, params: &[f32], to: &Gpt) -> Vec<f32> {
    let mut out = Vec::with_capacity(to.layout().n_params());
    for t in to.layout().tensors() {
        out.extend_from_slice(&params[from.layout().get(&t.name).unwrap().range()]);
    }
    out
}

/// The loss sum and gradient of one micro-step at `params`.
fn step(model: &mut Gpt, params: &[f32]) -> (f64, Vec<f32>) {
    common::step(model, params, &batch())
}

/// max |a − b| over max |b|.
fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    a.iter().zip(b).fold(0.0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// The packed model against the f32 model on the dequantised values, for
/// LoRA and DoRA on all four layers, under each format. The adapters
/// (and DoRA's magnitudes, set from the base) start bit-identical; then B
/// is made random so every adapter acts. Loss and gradients agree to
/// summation order only: the f32 model multiplies `Conv1D` weights `[in,
/// out]`, the packed one the same values transposed through the packed
/// GEMM, and neither order is fixed across CPU kinds. Each output is a dot
/// product of at most 4C = 256 terms, whose reordering moves it by at most
/// 256·2⁻²⁴ ≈ 1.5e-5 of the sum of its terms' magnitudes; the gradient
/// bound below (1e-4 of the largest) leaves that a factor of 6 through two
/// blocks and the head, while a weight taken from the wrong place or not
/// transposed moves the loss and gradients by O(1).
#[test]
fn a_packed_base_computes_the_f32_model_on_its_dequantised_values() {
    for format in FORMATS {
        let (frozen, deq) = bases(format);
        let frozen = Arc::new(frozen);
        for dora in [false, true] {
            let lora = LoraConfig { use_dora: dora, ..LoraConfig::new(4, 8.0, &["all-linear"]) };
            let mut f32_model = Gpt::with_lora(cfg(), lora.clone(), Precision::F32).unwrap();
            let mut packed = Gpt::with_frozen_base(cfg(), lora, Precision::F32, frozen.clone()).unwrap();
            assert!(packed.packs_base() && !f32_model.packs_base());
            let mut p32 = lora::attach(&f32_model, &deq, 3).unwrap();
            let rest = by_name(&Gpt::new(cfg()).unwrap(), &deq, &Gpt::with_packed_layout(cfg(), None).unwrap());
            let pp = lora::attach_with(&packed, &rest, 3, Some(&frozen)).unwrap();
            assert_eq!(bits(&pp), bits(&by_name(&f32_model, &p32, &packed)), "{format:?} dora {dora}: the start");
            let mut rng = SplitMix64::new(9);
            for t in f32_model.layout().tensors().iter().filter(|t| t.name.contains("lora_B")) {
                p32[t.range()].iter_mut().for_each(|x| *x = (0.2 * rng.normal()) as f32);
            }
            let pp = by_name(&f32_model, &p32, &packed);
            let (loss32, g32) = step(&mut f32_model, &p32);
            let (lossp, gp) = step(&mut packed, &pp);
            let what = format!("{format:?} dora {dora}");
            assert!((loss32 - lossp).abs() <= 1e-5 * loss32.abs(), "{what}: loss {lossp} vs {loss32}");
            let err = rel_err(&gp, &by_name(&f32_model, &g32, &packed));
            assert!(err <= 1e-4, "{what}: gradients differ by {err:e} of the largest");
            // Merged: the plain model on the dequantised base, to the bit.
            let merged = lora::merge_with(&packed, &pp, Some(&frozen)).unwrap();
            assert_eq!(bits(&merged), bits(&lora::merge(&f32_model, &p32).unwrap()), "{what}: merged");
        }
    }
}

/// A model folder written from the packed layout holds the dequantised
/// base (what PEFT and transformers load); a packed layout without its
/// base refuses a pass instead of reading empty weights.
#[test]
fn files_hold_the_dequantised_base_and_a_layout_alone_runs_no_pass() {
    let (frozen, deq) = bases(PackFormat::Nf4 { double_quant: false });
    let lora = LoraConfig::new(4, 8.0, &["c_attn", "c_fc"]);
    let mut layout_only = Gpt::with_packed_layout(cfg(), Some(lora.clone())).unwrap();
    let packed = Gpt::with_frozen_base(cfg(), lora, Precision::F32, Arc::new(frozen.clone())).unwrap();
    let rest = by_name(&Gpt::new(cfg()).unwrap(), &deq, &Gpt::with_packed_layout(cfg(), None).unwrap());
    let params = lora::attach_with(&packed, &rest, 3, Some(&frozen)).unwrap();
    let dir = std::env::temp_dir().join(format!("gpt-frozen-save-{}", std::process::id()));
    gpt::hf::save_with_base(&dir, &cfg(), (packed.layout(), &params), Some(&frozen)).unwrap();
    let (saved_cfg, saved) = gpt::hf::load(&dir).unwrap();
    assert_eq!(saved_cfg, cfg());
    assert_eq!(bits(&saved), bits(&deq));
    // Reading it back packed: the same matrices, the other tensors as saved.
    let format = family::FrozenFormat::Pack(PackFormat::Nf4 { double_quant: false });
    let packed_plain = Gpt::with_packed_layout(cfg(), None).unwrap();
    let (again, others) = gpt::frozen_load::load(&cfg(), &dir, format, Some(packed_plain.layout().clone())).unwrap();
    assert_eq!(others.map(|o| bits(&o)), Some(bits(&rest)));
    for b in 0..cfg().n_layer {
        for i in 0..4 {
            assert_eq!(bits(&again.dequantize(b, i)), bits(&frozen.dequantize(b, i)), "block {b} layer {i}");
        }
    }
    // "source" keeps a 16-bit file's values; this one is F32.
    let e = gpt::frozen_load::load(&cfg(), &dir, family::FrozenFormat::Source, None).unwrap_err().to_string();
    assert!(e.contains("train.frozen_dtype") && e.contains("F32") && e.contains("nf4"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
    let pass = layout_only.micro_step(
        &mut FullStore::for_model(&layout_only, &params, &mut vec![0.0; params.len()]).unwrap(),
        &batch(),
        1.0,
    );
    assert!(pass.unwrap_err().to_string().contains("frozen base"));
}

/// PEFT loads what a QLoRA GPT-2 writes (the NF4 base dequantised into
/// `GPT2LMHeadModel`'s files, the adapters beside them) and computes the
/// packed model's logits and loss (scripts/peft_check.py's tolerance,
/// explained there, is far above the summation-order differences of
/// [`a_packed_base_computes_the_f32_model_on_its_dequantised_values`];
/// [`common::peft_computes`]).
#[test]
fn peft_loads_a_qlora_gpt2_and_computes_our_logits_and_loss() {
    let (frozen, deq) = bases(PackFormat::Nf4 { double_quant: true });
    let lora = LoraConfig::new(4, 8.0, &["all-linear"]);
    let mut model = Gpt::with_frozen_base(cfg(), lora, Precision::F32, Arc::new(frozen.clone())).unwrap();
    let rest = by_name(&Gpt::new(cfg()).unwrap(), &deq, &Gpt::with_packed_layout(cfg(), None).unwrap());
    let mut params = lora::attach_with(&model, &rest, 3, Some(&frozen)).unwrap();
    let mut rng = SplitMix64::new(9);
    for t in model.layout().tensors().iter().filter(|t| t.name.contains("lora_B")) {
        params[t.range()].iter_mut().for_each(|x| *x = (0.2 * rng.normal()) as f32);
    }
    let dir = std::env::temp_dir().join(format!("macrobatch-gpt-qlora-peft-{}", std::process::id()));
    gpt::hf::save_with_base(&dir.join("base"), &cfg(), (model.layout(), &params), Some(&frozen)).unwrap();
    lora::save_adapter(&dir.join("adapter"), &model, &params, dir.join("base").to_str()).unwrap();
    let base_logits = Gpt::new(cfg()).unwrap().logits(&deq, &batch()).unwrap();
    common::peft_computes(&dir, (&mut model, &params), base_logits, &batch());
}

/// `train.frozen_dtype` on GPT-2's family: what packs is counted before
/// anything is read, and what cannot be packed is refused naming the key
/// and the fix — a split base, `"source"` without a file or on an F32
/// file, NF4 on input widths its blocks of 64 do not divide.
#[test]
fn the_family_plans_a_packed_base_and_refuses_what_cannot_be_packed() {
    use config::FrozenDtype;
    use family::{Family, FrozenStorage};
    let fam = gpt::registration::Gpt2Lora::new(cfg(), LoraConfig::new(4, 8.0, &["all-linear"])).unwrap();
    let s = |dtype, source: Option<&std::path::Path>| FrozenStorage {
        dtype,
        double_quant: true,
        source: source.map(std::path::Path::to_path_buf),
    };
    let nf4 = PackFormat::Nf4 { double_quant: true };
    let packed = fam.with_frozen_storage(&s(FrozenDtype::Nf4, None)).unwrap().unwrap();
    let planned = packed.frozen_bytes().unwrap();
    assert_eq!((planned.formats.as_str(), planned.bytes), ("nf4-dq", FrozenBase::planned_bytes(&cfg(), nf4)));
    let conv_weights = cfg().n_layer as u128 * 12 * 64 * 64;
    assert_eq!(packed.n_params() + conv_weights, fam.n_params());
    let e = packed.tensor_parallel(engine::TpRank::new(0, 2)).err().unwrap().to_string();
    assert!(e.contains("dist.tensor_parallel = 1"), "{e}");
    let e = packed.build(family::Build::default()).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.is_empty(), "a plan's layout builds: {e}");
    for dtype in [FrozenDtype::F32, FrozenDtype::Auto] {
        assert!(fam.with_frozen_storage(&s(dtype, None)).unwrap().is_none());
    }
    let e = fam.with_frozen_storage(&s(FrozenDtype::Source, None)).err().unwrap().to_string();
    assert!(e.contains("--init-from"), "{e}");
    // An F32 folder: "auto" keeps f32, "source" has nothing to keep.
    let dir = std::env::temp_dir().join(format!("gpt-frozen-refusals-{}", std::process::id()));
    gpt::hf::save(&dir, &cfg(), Gpt::new(cfg()).unwrap().layout(), &gpt::init_params(&cfg(), 1)).unwrap();
    assert!(fam.with_frozen_storage(&s(FrozenDtype::Auto, Some(&dir))).unwrap().is_none());
    let e = fam.with_frozen_storage(&s(FrozenDtype::Source, Some(&dir))).err().unwrap().to_string();
    assert!(e.contains("F32") && e.contains("\"nf4\""), "{e}");
    // A folder of another shape: its weights are named, not packed.
    let bf16 = family::FrozenFormat::Pack(PackFormat::Bf16);
    let wider = GptConfig { n_embd: 128, ..cfg() };
    let e = gpt::frozen_load::load(&wider, &dir, bf16, None).err().unwrap().to_string();
    assert!(e.contains("has shape [") && e.contains("but the model needs [") && e.contains("config.json"), "{e}");
    let shallower = GptConfig { n_layer: 1, ..cfg() };
    let e = gpt::frozen_load::load(&shallower, &dir, bf16, None).err().unwrap().to_string();
    assert!(e.contains("is in block 1, and the model has 1 blocks"), "{e}");
    // Input widths of 48 and 192: not whole blocks of 64.
    let odd = GptConfig { n_embd: 48, ..cfg() };
    gpt::hf::save(&dir, &odd, Gpt::new(odd).unwrap().layout(), &gpt::init_params(&odd, 1)).unwrap();
    let fam = gpt::registration::Gpt2Lora::new(odd, LoraConfig::new(4, 8.0, &["all-linear"])).unwrap();
    let e = fam.with_frozen_storage(&s(FrozenDtype::Nf4, Some(&dir))).err().unwrap().to_string();
    assert!(e.contains("blocks of 64") && e.contains("\"bf16\""), "{e}");
    assert!(fam.with_frozen_storage(&s(FrozenDtype::Bf16, Some(&dir))).unwrap().is_some());
    let _ = std::fs::remove_dir_all(&dir);
}
