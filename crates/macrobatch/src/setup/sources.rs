//! `data.sources`: each source read in its own format and schema and split
//! into its training part and its held-out tail; the training parts end to
//! end, drawn by weight ([`data::Mixture`]); the held-out parts interleaved
//! into one validation set.

use super::samples::Reading;
use anyhow::{Context, Result};
use config::{Config, SourceConfig};
use data::{Mixed, Mixture, Samples};

/// (training, validation) samples of `sources`: source i's training part
/// is indices `[Σ_{j<i} n_j, Σ_{j≤i} n_j)` of the training samples; the
/// validation set is every source's last `val_fraction`, interleaved in
/// proportion to their sizes.
pub(super) fn mixed_samples(read: &Reading<'_>, sources: &[SourceConfig]) -> Result<(Samples, Samples)> {
    let d = &read.cfg.data;
    let (mut train, mut val) = (Vec::new(), Vec::new());
    for (i, s) in sources.iter().enumerate() {
        let what = || format!("data.sources[{i}] ({})", s.path);
        let format = s.format().with_context(what)?;
        let schema = s.schema.unwrap_or(d.schema);
        let (t, v) =
            read.splits(&s.path, None, format, schema, s.val_fraction.unwrap_or(d.val_fraction)).with_context(what)?;
        train.push(t);
        val.push(v);
    }
    let pad_id = read.tokenizer.pad_id().or(read.tokenizer.eos_id()).unwrap_or(0);
    Ok((Samples::Mixed(Box::new(Mixed::new(train, pad_id))), Samples::Mixed(Box::new(Mixed::interleaved(val, pad_id)))))
}

/// The mixture `cfg`'s sources draw `train` by (`None` without
/// `data.sources`).
pub(super) fn mixture_of(cfg: &Config, train: &Samples) -> Result<Option<Mixture>> {
    let (Some(sources), Samples::Mixed(m)) = (&cfg.data.sources, train) else { return Ok(None) };
    let sizes: Vec<usize> = m.parts().iter().map(Samples::n_samples).collect();
    let weights: Vec<f64> = sources.iter().map(|s| s.weight).collect();
    let names: Vec<String> = sources.iter().map(|s| s.path.clone()).collect();
    Ok(Some(Mixture::new(&sizes, &weights, &names)?))
}

/// Refuses to resume at `step` when the mixture the config draws is not at
/// the position the checkpoint recorded (`saved`: samples drawn from each
/// source): sources, their sizes or weights, or the seed changed.
pub fn check_mixture_position(plan: &super::Plan, step: u64, saved: &[u64]) -> Result<()> {
    let now = plan.sampler.mixture_drawn(step);
    if now.as_deref() != Some(saved) {
        anyhow::bail!(
            "the checkpoint's data mixture had drawn {saved:?} samples from its sources by step {step}, but data.sources as configured now draws {} by then: the sources, their contents or weights, data.shuffle or train.seed changed; resume with the run's own [data] settings",
            now.map_or("nothing (no data.sources)".into(), |n| format!("{n:?}"))
        );
    }
    Ok(())
}
