//! GPT-2 runs the engine's Model conformance suite (engine::conformance)
//! with a tiny configuration: plain, and with LoRA adapters on a frozen base.

use engine::conformance::{self, ModelUnderTest, TokenSamples};
use engine::rng::SplitMix64;
use engine::{Checkpointing, TensorSpec};
use gpt::{init_params, Batch, Gpt, GptConfig};
use nn::lora::LoraConfig;

const T: usize = 8;

fn cfg() -> GptConfig {
    GptConfig { n_layer: 2, n_head: 2, n_embd: 16, block_size: T, vocab_size: 32 }
}

struct GptFamily {
    /// 12 sequences; sequence i ignores its first i mod 5 targets, so
    /// samples hold different numbers of targets.
    seqs: TokenSamples,
    /// Activation checkpointing of the model under test.
    checkpointing: Checkpointing,
    /// Adapters on a frozen base.
    lora: Option<LoraConfig>,
    /// The most rows of logits the loss holds at once (`None`: the
    /// default, which at the suite's sizes is every row).
    loss_chunk: Option<usize>,
}

impl GptFamily {
    fn new(checkpointing: Checkpointing) -> Self {
        let seqs = TokenSamples::new(12, T, 32, 9);
        Self { seqs, checkpointing, lora: None, loss_chunk: None }
    }
}

impl ModelUnderTest for GptFamily {
    type M = Gpt;

    fn model(&self) -> Gpt {
        let mut m = match &self.lora {
            Some(l) => Gpt::with_lora(cfg(), l.clone(), engine::Precision::F32),
            None => Gpt::new(cfg()),
        }
        .expect("valid config")
        .with_checkpointing(self.checkpointing);
        nn::shell::Decoder::shell_mut(&mut m).loss_chunk = self.loss_chunk;
        m
    }

    /// GPT-2's initialisation plus N(0, 0.3) noise, so that every path
    /// (biases, LayerNorm gains, LoRA's B, which starts at zero) carries a
    /// visible gradient.
    fn init(&self) -> Vec<f32> {
        let mut p = self.model().init_params(3);
        let mut rng = SplitMix64::new(15);
        p.iter_mut().for_each(|x| *x += (rng.normal() * 0.3) as f32);
        p
    }

    fn batch(&self, samples: &[usize]) -> Batch {
        self.seqs.batch(samples)
    }

    fn n_samples(&self) -> usize {
        self.seqs.len()
    }

    /// All but the last block (the embeddings, tied head, block 0 and
    /// ln_f); with LoRA, everything but the adapters.
    fn frozen(&self, t: &TensorSpec) -> bool {
        match self.lora {
            Some(_) => !nn::lora::is_adapter(&t.name),
            None => !t.name.starts_with("transformer.h.1."),
        }
    }

    /// The forward runs in f32 over ~25 targets (loss sum ≈ 100): rounding
    /// makes a central difference with h = 3e-3 uncertain by about
    /// ε_f32 · 100 / h ≈ 4e-3 · 0.5 (errors partly cancel) — hence atol
    /// 2e-3, the floor for small gradients; truncation (h², smooth GELU and
    /// softmax) stays far below 1% of larger gradients — hence rtol 1e-2.
    /// (The kernel-level tests in gradcheck.rs check every element tightly.)
    fn fd_tolerance(&self) -> (f64, f64, f64) {
        (3e-3, 1e-2, 2e-3)
    }

    /// Summation orders differ (micro-batch splits, rank order, shards):
    /// gradients agree to ~1e-7 of their largest value; parameters after
    /// AdamW steps to ~1e-6 (a gradient near ε moves its parameter by up to
    /// lr, amplifying rounding), well inside 1e-5 of the largest value.
    fn rtol(&self) -> f32 {
        1e-5
    }
}

#[test]
fn gpt2_passes_the_conformance_suite() {
    conformance::run_all(&GptFamily::new(Checkpointing::None)).unwrap();
}

/// The loss over chunks of at most 5 rows (the suite's batches hold 0 to
/// 96 rows), plain and recomputing blocks: the tied head's gradient sums
/// the chunks' shares, in another order than one GEMM over all rows,
/// which the suite's rtol covers as it covers micro-batch splits.
#[test]
fn gpt2_with_a_chunked_loss_passes_the_conformance_suite() {
    for ck in [Checkpointing::None, Checkpointing::Blocks] {
        let f = GptFamily { loss_chunk: Some(5), ..GptFamily::new(ck) };
        conformance::run_all(&f).unwrap_or_else(|e| panic!("{ck}: {e}"));
    }
}

/// LoRA on every linear layer (`all-linear`: c_attn, both c_proj, c_fc)
/// of a frozen base, plain and recomputing blocks (the adapters' x·Aᵀ are
/// recomputed with them).
#[test]
fn gpt2_with_lora_on_a_frozen_base_passes_the_conformance_suite() {
    for ck in [Checkpointing::None, Checkpointing::Blocks, Checkpointing::Selective] {
        let lora = Some(LoraConfig::new(2, 4.0, &["all-linear"]));
        conformance::run_all(&GptFamily { lora, ..GptFamily::new(ck) }).unwrap_or_else(|e| panic!("{ck}: {e}"));
    }
}

/// DoRA on GPT-2's `Conv1D` layers (through the same projection type as
/// every family): the suite's checks but finite differences (DoRA's
/// gradient holds the row norms constant by design: lora.rs checks it
/// against the merged model's chain rule), with and without recomputation.
#[test]
fn gpt2_with_dora_passes_the_conformance_checks_but_finite_differences() {
    let lora = LoraConfig { use_dora: true, ..LoraConfig::new(2, 4.0, &["c_attn", "mlp.c_proj", "c_fc"]) };
    for ck in [Checkpointing::None, Checkpointing::Blocks, Checkpointing::Selective] {
        let f = GptFamily { lora: Some(lora.clone()), ..GptFamily::new(ck) };
        conformance::check_k_invariance(&f).unwrap_or_else(|e| panic!("{ck}: {e}"));
        conformance::check_several_steps(&f).unwrap_or_else(|e| panic!("{ck}: {e}"));
        conformance::check_frozen(&f).unwrap_or_else(|e| panic!("{ck}: {e}"));
    }
    let f = GptFamily { lora: Some(lora), ..GptFamily::new(Checkpointing::None) };
    conformance::check_ranks_and_zero(&f).unwrap();
    conformance::check_resume(&f).unwrap();
}

/// LoRA dropout's masks are keyed on the optimizer step and each
/// sequence's own tokens: K micro-batches equal one big batch and W ranks
/// one rank under dropout, a resumed run continues bit for bit, and the
/// gradient is that of the dropped-out loss (the same masks at every
/// evaluation of one step).
#[test]
fn gpt2_lora_dropout_is_invariant_to_the_split_and_its_gradient_is_the_dropped_out_loss() {
    use engine::Model;
    let lora = LoraConfig { dropout: 0.3, ..LoraConfig::new(2, 4.0, &["all-linear"]) };
    let f = GptFamily { lora: Some(lora), ..GptFamily::new(Checkpointing::None) };
    conformance::check_k_invariance(&f).unwrap();
    conformance::check_ranks_and_zero(&f).unwrap();
    conformance::check_resume(&f).unwrap();
    // The training loss and the adapters' gradient at optimizer step `step`
    // (the suite's finite differences evaluate without dropout).
    let (mut model, params, b) = (f.model(), f.init(), f.batch(&[0, 1, 2, 3]));
    model.set_trainable(&|t| nn::lora::is_adapter(&t.name));
    let train = |m: &mut Gpt, p: &[f32], step: u64| {
        m.begin_step(step);
        let mut g = vec![0.0; m.layout().n_trainable()];
        let mut store = engine::FullStore::for_model(&*m, p, &mut g).unwrap();
        let loss = m.micro_step(&mut store, &b, 1.0).unwrap().loss_sum;
        (loss, g)
    };
    let adapters: Vec<std::ops::Range<usize>> =
        model.layout().tensors().iter().filter(|t| t.trainable).map(|t| t.range()).collect();
    let x: Vec<f32> = adapters.iter().flat_map(|r| params[r.clone()].to_vec()).collect();
    let (_, g) = train(&mut model, &params, 7);
    let (h, rtol, atol) = f.fd_tolerance();
    let model = std::cell::RefCell::new(model);
    nn::fd::check_gradient("adapters under dropout", &x, &g, (h as f32, atol, rtol), |xs| {
        let (mut p, mut o) = (params.clone(), 0);
        for r in &adapters {
            p[r.clone()].copy_from_slice(&xs[o..o + r.len()]);
            o += r.len();
        }
        train(&mut model.borrow_mut(), &p, 7).0
    });
    // Dropout is applied in training only, and another step draws other masks.
    let mut model = model.into_inner();
    let train = |m: &mut Gpt, step: u64| train(m, &params, step).0;
    let mut store = engine::FullStore::read_only_for(&model, &params).unwrap();
    let eval = model.loss(&mut store, &b).unwrap().loss_sum;
    let no_drop = Some(LoraConfig::new(2, 4.0, &["all-linear"]));
    let mut plain = GptFamily { lora: no_drop, ..GptFamily::new(Checkpointing::None) }.model();
    let mut store = engine::FullStore::read_only_for(&plain, &params).unwrap();
    assert_eq!(eval.to_bits(), plain.loss(&mut store, &b).unwrap().loss_sum.to_bits(), "evaluation drops nothing");
    let (s7, s8) = (train(&mut model, 7), train(&mut model, 8));
    assert!((s7 - eval).abs() > 1e-3 * eval.abs(), "dropout changes the training loss: {s7} vs {eval}");
    assert_ne!(s7.to_bits(), s8.to_bits(), "another step, other masks");
    assert_eq!(train(&mut model, 7).to_bits(), s7.to_bits(), "the same step, the same masks");
}

/// Recomputing blocks in backward keeps every property: ZeRO-3 gathers a
/// segment again for the recomputation, frozen blocks are recomputed too,
/// and several steps in a row reuse the recompute slot; selective
/// recomputation too.
#[test]
fn gpt2_with_activation_checkpointing_passes_the_conformance_suite() {
    conformance::run_all(&GptFamily::new(Checkpointing::Blocks)).unwrap();
    conformance::run_all(&GptFamily::new(Checkpointing::EveryK(2))).unwrap();
    conformance::run_all(&GptFamily::new(Checkpointing::Selective)).unwrap();
}

/// Documents packed into one row with their positions (learned positions
/// restart with each document; attention never crosses into the previous
/// one) give the loss and gradient of the same documents one per row,
/// with and without checkpointing. 1e-5: the same f32 sums grouped
/// differently (attention tiles of 64 start at other positions, GEMMs see
/// 128 rows instead of 3 × 70) differ by ~1e-7 of the values; a document
/// seeing its neighbour moves the loss by percents.
#[test]
fn gpt2_packed_documents_are_kept_apart() {
    let cfg = GptConfig { block_size: 128, ..cfg() };
    let mut params = init_params(&cfg, 3);
    let mut rng = SplitMix64::new(15);
    params.iter_mut().for_each(|x| *x += (rng.normal() * 0.3) as f32);
    for ck in [Checkpointing::None, Checkpointing::Blocks, Checkpointing::Attention] {
        let mut model = Gpt::new(cfg).expect("valid config").with_checkpointing(ck);
        conformance::check_packed_documents(&mut model, &params, (&[40, 70, 18], 32), 1e-5).unwrap();
    }
}
