//! A rank's side of sharded checkpoints: writing its share of the
//! parameters and optimizer state as pieces of whole tensors, and
//! reading back what it keeps at whatever layout it now has.

use crate::checkpoint::sharded::{RankWriter, Reader, PARAMS};
use crate::setup::RankComms;
use anyhow::{bail, Result};
use engine::{Held, ParamLayout, PieceMap, Run, Trainer};
use std::ops::Range;
use std::path::Path;

/// Where a rank writes its share from: its place among the ranks holding
/// the same layout (data rank, data ranks), its world rank, and its
/// parameter and gradient-space buffers mapped onto the whole tensors.
pub struct Share {
    dp: (usize, usize),
    rank: usize,
    maps: (PieceMap, PieceMap),
}

impl Share {
    /// `trainer`'s share in `comms`.
    pub fn of(comms: &RankComms, trainer: &Trainer) -> Self {
        let maps = (comms.piece_map(trainer.layout(), false), comms.piece_map(trainer.layout(), true));
        Self { dp: comms.dp_place(), rank: comms.world.rank(), maps }
    }
}

/// Writes this rank's share — its ZeRO piece of each segment of every
/// buffer, of the tensors it is the writer of — into `dir`; `whole` names
/// the tensors. `poison` (a test fault) turns its first parameter NaN.
pub fn write(share: &Share, trainer: &mut Trainer, whole: &ParamLayout, dir: &Path, poison: bool) -> Result<()> {
    let ((dp_rank, dp_size), (pmap, gmap)) = (share.dp, &share.maps);
    let mut w = RankWriter::create(dir, share.rank)?;
    let name = |run: &Run| whole.tensors()[run.tensor].name.as_str();
    let params = trainer.resident_params();
    for (range, at) in trainer.share_runs(Held::Params, dp_rank, dp_size) {
        for run in pmap.runs(range, at, true) {
            let mut vals = params[run.at..run.at + run.numel()].to_vec();
            if poison && w.is_empty() {
                vals[0] = f32::NAN;
            }
            if let Some(i) = vals.iter().position(|v| !v.is_finite()) {
                bail!(
                    "checkpoint parameters: tensor `{}` holds a non-finite value ({}) at flat element {}; the training diverged, so nothing is saved and the previous checkpoints stay (lower optim.lr, raise optim.eps, or enable train.grad_clip)",
                    name(&run),
                    vals[i],
                    run.start + (i / run.len) * run.stride + i % run.len
                );
            }
            w.put(PARAMS, name(&run), &run, &vals)?;
        }
    }
    let shares: Vec<Vec<(Range<usize>, usize)>> = trainer
        .optimizer()
        .slot_names()
        .into_iter()
        .map(|n| trainer.share_runs(Held::Slot(n), dp_rank, dp_size))
        .collect();
    let (mut slot, mut failed) = (0, None);
    trainer.each_resident_slot(|_, slot_name, buf| {
        for (range, at) in &shares[slot] {
            for run in gmap.runs(range.clone(), *at, true) {
                let vals = &buf[run.at..run.at + run.numel()];
                if let Some(i) = vals.iter().position(|v| !v.is_finite()) {
                    failed.get_or_insert(anyhow::anyhow!(
                        "optimizer state `{slot_name}` of `{}` holds a non-finite value ({}); not saving a checkpoint that cannot be resumed (the previous checkpoints stay)",
                        name(&run),
                        vals[i]
                    ));
                } else if let Err(e) = w.put(slot_name, name(&run), &run, vals) {
                    failed.get_or_insert(e);
                }
            }
        }
        slot += 1;
        Ok(())
    })?;
    if let Some(e) = failed {
        return Err(e);
    }
    w.finish()
}

/// What this rank keeps of the whole model's parameters, read from a
/// sharded checkpoint one whole segment at a time: `segment(range)` gives
/// the whole layout's `range` (whole tensors) with every value this rank
/// holds filled in (the rest zero).
pub struct ParamSource<'a> {
    reader: &'a Reader,
    whole: &'a ParamLayout,
    /// The runs of this rank's parameter buffer, all of them.
    wants: Vec<Run>,
}

impl<'a> ParamSource<'a> {
    /// The source for a rank whose buffer `map` describes.
    pub fn new(reader: &'a Reader, whole: &'a ParamLayout, map: &PieceMap) -> Result<Self> {
        reader.check_layout(whole)?;
        let n = map.tensors().last().map_or(0, |t| t.span.end);
        Ok(Self { reader, whole, wants: map.runs(0..n, 0, false) })
    }

    /// The whole layout's parameters `range` (whole tensors), this rank's
    /// values filled in.
    pub fn segment(&self, range: Range<usize>) -> Result<Vec<f32>> {
        let ts = self.whole.tensors();
        let wants: Vec<Run> = self.wants.iter().filter(|r| range.contains(&ts[r.tensor].offset)).copied().collect();
        let mut out = vec![0.0; range.len()];
        self.reader.read(PARAMS, &wants, |w, k, col, vals| {
            let at = ts[w.tensor].offset - range.start + w.start + k * w.stride + col;
            out[at..at + vals.len()].copy_from_slice(vals);
        })?;
        Ok(out)
    }
}

/// Restores `trainer`'s optimizer state (and schedule position) from the
/// pieces of a sharded checkpoint: each slot as this rank holds it.
pub fn restore_optimizer(
    comms: &RankComms,
    trainer: &mut Trainer,
    reader: &Reader,
    (n_steps, n_updates): (u64, u64),
) -> Result<()> {
    let gmap = comms.piece_map(trainer.layout(), true);
    let slots: Vec<(&'static str, Vec<Run>, usize)> = trainer
        .optimizer()
        .slot_names()
        .into_iter()
        .map(|n| {
            let (runs, len) = trainer.resident_runs(Held::Slot(n));
            (n, runs.into_iter().flat_map(|(r, at)| gmap.runs(r, at, false)).collect(), len)
        })
        .collect();
    if let Some((n, ..)) = slots.iter().find(|(n, ..)| !reader.index().slots.iter().any(|s| s == n)) {
        bail!(
            "the checkpoint holds the optimizer state {:?}, not `{n}`: it was written with another optimizer (optim.name)",
            reader.index().slots
        );
    }
    let mut failed = None;
    let restored = trainer.restore_optimizer_resident(n_steps, n_updates, |name| {
        let (_, wants, len) = slots.iter().find(|s| s.0 == name)?;
        let mut buf = vec![0.0; *len];
        let read = reader.read(name, wants, |w, k, col, vals| {
            let at = w.at + k * w.len + col;
            buf[at..at + vals.len()].copy_from_slice(vals);
        });
        read.map_err(|e| failed = Some(e)).ok().map(|()| buf)
    });
    if let Some(e) = failed {
        return Err(e);
    }
    Ok(restored?)
}
