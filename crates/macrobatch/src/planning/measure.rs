//! Tests' ground truth for the memory model: plans of small shapes, and
//! one optimizer step of a real P × T grid (D = 1) on thread ranks with
//! each rank thread's heap peak measured by the binary's counting
//! allocator.

use crate::setup::{self, Plan};
use comm::Communicator;
use engine::pipeline::partition_layers;
use engine::{
    AdamW, LrSchedule, Optimizer, PipelineStage, ScheduleKind, TokenBatch, TpRank, Trainer, TrainerOptions, ZeroConfig,
};

/// A plan of `sets` on `world` thread ranks.
pub fn plan(sets: &[&str], world: usize) -> Plan {
    let mut sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    sets.push(format!("dist.world_size={world}"));
    let cfg = setup::load_config(None, &sets, &Default::default()).unwrap();
    super::plan(cfg, crate::dist::Backend::Threads(world)).unwrap()
}

/// What one rank of a measured step held.
#[derive(Debug, Clone, Copy)]
pub struct Measured {
    /// The rank thread's heap peak over building its model, its trainer
    /// and one optimizer step (what its trainer, model, messages and
    /// micro-batches allocate).
    pub peak: u64,
    /// The model's activation bytes after the step.
    pub activations: u64,
}

/// One optimizer step of `k` micro-batches of `micro` sequences on `p`
/// pipeline stages × `t` tensor ranks (1 data rank; world rank = s·t +
/// tensor rank, as the grid lays them out), f32, AdamW, ZeRO 0: each world
/// rank's measurement.
pub fn measure(pl: &Plan, p: usize, t: usize, kind: ScheduleKind, k: usize, micro: usize) -> Vec<Measured> {
    measure_grid(pl, (p, 1, t), kind, k, micro)
}

/// [`measure`] on `p` stages × `c` context ranks × `t` tensor ranks (world
/// rank = s·(c·t) + context rank·t + tensor rank; the context ranks are
/// the data-parallel group).
pub fn measure_grid(
    pl: &Plan,
    (p, c, t): (usize, usize, usize),
    kind: ScheduleKind,
    k: usize,
    micro: usize,
) -> Vec<Measured> {
    let n_blocks = setup::model_for(pl).unwrap().n_blocks();
    let cuts = partition_layers(n_blocks, p, None).unwrap();
    let seq = pl.train.seq_len();
    let comms = comm::threads::group(p * c * t, std::time::Duration::from_secs(300));
    std::thread::scope(|sc| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|mut world| {
                let cuts = &cuts;
                sc.spawn(move || {
                    let r = world.rank();
                    let (stage, cr, tr) = (r / (c * t), (r / t) % c, r % t);
                    let mut dp = world.split(stage * t + tr, cr).unwrap();
                    let mut pipe = world.split(cr * t + tr, stage).unwrap();
                    let mut tp = world.split(stage * c + cr, tr).unwrap();
                    let mut cp = world.split(stage * t + tr, cr).unwrap();
                    let base = crate::heap::reset_peak();
                    let mut model = setup::model_for_rank(
                        pl,
                        TpRank::new(tr, t)
                            .with_vocab(pl.cfg.dist.vocab_parallel)
                            .with_seq(pl.cfg.dist.sequence_parallel),
                    )
                    .unwrap();
                    if c > 1 {
                        model
                            .context_parallel(engine::ContextRank::new(cr, c).with(pl.cfg.dist.context_attention))
                            .unwrap();
                    }
                    let ps = PipelineStage::new(&mut model, cuts, stage, kind, k).unwrap();
                    let n = ps.layout.layout.n_params();
                    let opt = Optimizer::AdamW(AdamW::new(n, 0.9, 0.95, 1e-8, 0.1).unwrap());
                    let init = |seg: usize| std::borrow::Cow::Owned(pl.family.init_segment(1, seg));
                    let zero = ZeroConfig { stage: 0, reduce_every_micro_step: false };
                    let (lr, opts) = (LrSchedule::constant(1e-3), TrainerOptions::default());
                    let mut trainer = Trainer::for_stage(&ps, &init, opt, lr, opts, zero, dp.as_mut()).unwrap();
                    let batches: Vec<TokenBatch> = (0..k)
                        .map(|i| TokenBatch {
                            n_seqs: micro,
                            seq_len: seq,
                            inputs: (0..micro * seq).map(|j| ((i * 7 + j) % 200) as u32).collect(),
                            targets: (0..micro * seq).map(|j| ((i * 5 + j) % 200) as i32).collect(),
                            positions: Vec::new(),
                        })
                        .collect();
                    let tp_group: Option<&mut dyn Communicator> = if t > 1 { Some(tp.as_mut()) } else { None };
                    let cp_group: Option<&mut dyn Communicator> = if c > 1 { Some(cp.as_mut()) } else { None };
                    trainer
                        .step_pipeline(&mut model, &ps, dp.as_mut(), pipe.as_mut(), (tp_group, cp_group), &batches)
                        .unwrap();
                    drop((tp, cp));
                    let peak = (crate::heap::peak() - base).max(0) as u64;
                    Measured { peak, activations: model.activation_bytes() as u64 }
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}
