//! A model that is not a transformer, trained through the engine's public API
//! (`cargo run --release -p macrobatch-engine --example custom_model`): a
//! two-layer MLP predicting each character of the bundled Moby-Dick text from
//! the one before, `h = tanh(E[x] + b1)`, `logits = h·W2 + b2`. On 2 thread
//! ranks at ZeRO stage 3, 2 micro-steps each, it checks that the loss falls, that
//! the first step's gradient is one big batch's, and that a run restored from the
//! full state saved halfway continues bit for bit; a failed check exits non-zero.

use comm::Communicator;
use engine::rng::SplitMix64;
use engine::{AdamW, FullStore, LrSchedule, MicroStepStats, Model, Optimizer, ParamLayout, ParamStore, TensorSpec};
use engine::{EngineError, GradOut, TokenBatch, Trainer, TrainerOptions, ZeroConfig};

/// Vocabulary (7-bit ASCII), hidden width, and the embedding table's size.
pub const V: usize = 128;
const H: usize = 32;
const E: usize = V * H;

type Stats = Result<MicroStepStats, EngineError>;

/// The model: segment 0 = `[E, b1]`, segment 1 = `[W2, b2]`.
pub struct CharMlp {
    layout: ParamLayout,
}

impl Default for CharMlp {
    fn default() -> Self {
        let mut layout = ParamLayout::new();
        layout.push("embed", &[V, H], true);
        layout.push("b1", &[H], false);
        layout.push("w2", &[H, V], true);
        layout.push("b2", &[V], false);
        CharMlp { layout }
    }
}

impl CharMlp {
    /// Initial parameters from `init_seed`.
    pub fn init(init_seed: u64) -> Vec<f32> {
        let mut rng = SplitMix64::new(init_seed);
        (0..E + H + H * V + V).map(|i| (rng.normal() * if i < E + H { 0.5 } else { 0.2 }) as f32).collect()
    }

    /// Forward, and backward when given the loss seed, through the store one segment at a time.
    fn pass(&self, store: &mut dyn ParamStore, b: &TokenBatch, seed: Option<f32>) -> Stats {
        let p0 = store.segment(0)?.params.to_vec();
        store.done(0, false)?;
        let hs: Vec<[f32; H]> =
            b.inputs.iter().map(|&x| std::array::from_fn(|j| (p0[x as usize * H + j] + p0[E + j]).tanh())).collect();
        let (mut loss_sum, mut n_targets) = (0.0f64, 0u64);
        let (mut dw2, mut db2, mut de, mut db1) = (vec![0.0f32; H * V], vec![0.0; V], vec![0.0f32; E], vec![0.0; H]);
        let mut view = store.segment(1)?;
        let (w2, b2) = view.params.split_at(H * V);
        for (i, h) in hs.iter().enumerate().filter(|&(i, _)| b.targets[i] >= 0) {
            let target = b.targets[i] as usize;
            let logits: Vec<f64> =
                (0..V).map(|v| (b2[v] + (0..H).map(|j| h[j] * w2[j * V + v]).sum::<f32>()) as f64).collect();
            let max = logits.iter().fold(f64::MIN, |m, &x| m.max(x));
            let z: f64 = logits.iter().map(|x| (x - max).exp()).sum();
            (loss_sum, n_targets) = (loss_sum + z.ln() + max - logits[target], n_targets + 1);
            let Some(seed) = seed else { continue };
            let mut dh = [0.0f32; H];
            for (v, l) in logits.iter().enumerate() {
                let dl = seed * (((l - max).exp() / z) as f32 - (v == target) as u8 as f32);
                db2[v] += dl;
                for j in 0..H {
                    dw2[j * V + v] += h[j] * dl;
                    dh[j] += w2[j * V + v] * dl;
                }
            }
            for j in 0..H {
                let da = dh[j] * (1.0 - h[j] * h[j]);
                db1[j] += da;
                de[b.inputs[i] as usize * H + j] += da;
            }
        }
        put(view.grads.pair(0..H * V, H * V..H * V + V), &dw2, &db2);
        store.done(1, seed.is_some())?;
        if seed.is_some() {
            put(store.segment(0)?.grads.pair(0..E, E..E + H), &de, &db1);
            store.done(0, true)?;
        }
        Ok(MicroStepStats { loss_sum, n_targets, ..Default::default() })
    }
}

/// Adds into two tensors' gradients, or overwrites where the store says so (frozen: none).
fn put((a, b): (Option<GradOut<'_>>, Option<GradOut<'_>>), va: &[f32], vb: &[f32]) {
    for (g, vals) in [(a, va), (b, vb)].into_iter().filter_map(|(g, v)| Some((g?, v))) {
        g.buf.iter_mut().zip(vals).for_each(|(d, v)| *d = if g.accumulate { *d + v } else { *v });
    }
}

impl Model for CharMlp {
    type Batch = TokenBatch;
    type Error = EngineError;
    fn layout(&self) -> &ParamLayout {
        &self.layout
    }
    fn set_trainable(&mut self, trainable: &dyn Fn(&TensorSpec) -> bool) -> usize {
        self.layout.set_trainable(trainable)
    }
    fn segments(&self) -> Vec<std::ops::Range<usize>> {
        vec![0..E + H, E + H..E + H + H * V + V]
    }
    fn n_targets(&self, b: &TokenBatch) -> u64 {
        b.n_targets()
    }
    fn micro_step(&mut self, store: &mut dyn ParamStore, b: &TokenBatch, loss_seed: f32) -> Stats {
        self.pass(store, b, Some(loss_seed))
    }
    fn loss(&mut self, store: &mut dyn ParamStore, b: &TokenBatch) -> Stats {
        self.pass(store, b, None)
    }
}

/// Ranks, micro-steps per rank, sequences per micro-batch, characters per sequence, steps.
const W: usize = 2;
const K: usize = 2;
const MICRO: usize = 4;
const T: usize = 64;
const STEPS: usize = 60;

/// Samples `first..first + n`: windows spread over the book, bytes as 7-bit
/// tokens. Micro-step `k` of rank `r` in step `s` starts at sample
/// `((s·K + k)·W + r)·MICRO`: a global batch is consecutive samples.
fn batch(text: &[u8], first: usize, n: usize) -> TokenBatch {
    let starts: Vec<usize> = (first..first + n).map(|i| (i * 7919) % (text.len() / T - 1) * T).collect();
    let seq = |at: usize| text[at..at + T].iter().map(|&c| c.min(127));
    TokenBatch {
        n_seqs: n,
        seq_len: T,
        inputs: starts.iter().flat_map(|&at| seq(at).map(u32::from)).collect(),
        targets: starts.iter().flat_map(|&at| seq(at + 1).map(i32::from)).collect(),
        positions: Vec::new(),
    }
}

/// AdamW at ZeRO stage 3 on this rank of `comm`.
fn trainer(model: &CharMlp, comm: &mut dyn Communicator) -> Result<Trainer, EngineError> {
    let adamw = Optimizer::AdamW(AdamW::new(0, 0.9, 0.95, 1e-8, 0.01)?);
    let (options, zero) = (TrainerOptions::default(), ZeroConfig { stage: 3, reduce_every_micro_step: false });
    Trainer::distributed(model, CharMlp::init(7), adamw, LrSchedule::constant(1e-2), options, zero, comm)
}

/// A rank's losses, first gradient, and final parameters of the straight and the restored run.
type RankRun = (Vec<f64>, Vec<f32>, Vec<f32>, Vec<f32>);

fn run_rank(text: &[u8], rank: usize, comm: &mut dyn Communicator) -> Result<RankRun, EngineError> {
    let micro = |s| (0..K).map(|k| batch(text, ((s * K + k) * W + rank) * MICRO, MICRO)).collect::<Vec<_>>();
    let (mut model, mut losses) = (CharMlp::default(), Vec::new());
    let mut tr = trainer(&model, comm)?;
    losses.push(tr.step(&mut model, comm, &micro(0))?.loss);
    let first_grad = tr.full_gradient(comm)?;
    for s in 1..STEPS / 2 {
        losses.push(tr.step(&mut model, comm, &micro(s))?.loss);
    }
    // The full state a checkpoint holds, restored into a fresh trainer.
    let (params, state) = (tr.full_params(comm)?, tr.full_optimizer_state(comm, true)?);
    let mut resumed = trainer(&model, comm)?;
    let saved = |name: &str| state.iter().find(|(n, _)| n == name).map(|(_, v)| v.clone());
    resumed.restore(params, tr.n_steps(), tr.optimizer().n_updates(), saved)?;
    for s in STEPS / 2..STEPS {
        losses.push(tr.step(&mut model, comm, &micro(s))?.loss);
        resumed.step(&mut model, comm, &micro(s))?;
    }
    Ok((losses, first_grad, tr.full_params(comm)?, resumed.full_params(comm)?))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let text: &[u8] = include_bytes!("../../../data/moby-dick.txt");
    let comms = comm::threads::group(W, std::time::Duration::from_secs(60));
    let runs: Vec<Result<RankRun, EngineError>> = std::thread::scope(|scope| {
        let ranks: Vec<_> =
            comms.into_iter().enumerate().map(|(r, mut c)| scope.spawn(move || run_rank(text, r, &mut c))).collect();
        ranks.into_iter().map(|h| h.join().expect("a rank panicked")).collect()
    });
    let (losses, grad, straight, resumed) = runs.into_iter().next().expect("rank 0")?;
    println!("loss every 10 steps: {:.3?}", losses.iter().step_by(10).collect::<Vec<_>>());
    let (first, last) = (losses[0], losses[STEPS - 5..].iter().sum::<f64>() / 5.0);
    assert!(last < first - 1.0, "the loss did not fall: {first:.3} -> {last:.3}");
    println!("loss falls: {first:.3} -> {last:.3} (mean of the last 5 steps)");

    // One rank, one micro-batch of every sample of the first global batch:
    // its mean gradient is the first step's.
    let (mut model, big) = (CharMlp::default(), batch(text, 0, W * K * MICRO));
    let mut want = vec![0.0; model.layout().n_params()];
    let n = model.micro_step(&mut FullStore::for_model(&model, &CharMlp::init(7), &mut want)?, &big, 1.0)?.n_targets;
    let max = want.iter().fold(0.0f32, |m, g| m.max(g.abs() / n as f32));
    let diff = grad.iter().zip(&want).map(|(g, w)| (g - w / n as f32).abs()).fold(0.0, f32::max);
    assert!(diff <= 1e-5 * max, "{K} micro-steps x {W} ranks differ from one big batch by {diff:e} (max {max:e})");
    println!("{K} micro-steps x {W} ranks = one batch of {} sequences (largest difference {diff:.1e})", W * K * MICRO);

    assert!(straight.iter().zip(&resumed).all(|(a, b)| a.to_bits() == b.to_bits()), "the resumed run differs");
    println!("restored after step {}: step {STEPS}'s parameters equal the straight run's bit for bit", STEPS / 2);
    Ok(())
}
