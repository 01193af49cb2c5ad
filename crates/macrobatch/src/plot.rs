//! `macrobatch plot`: one picture of one or more runs' `metrics.jsonl`, as
//! SVG or PNG (drawn by [`crate::charts`]).

use crate::charts::plot;
use crate::PlotArgs;
use anyhow::{bail, Context, Result};

/// `macrobatch plot`. A `--out` that exists (maybe the user's) is replaced
/// only with `--force`; the default, the first run's `plot.svg`, is ours.
pub fn run(args: PlotArgs) -> Result<()> {
    let out = match &args.out {
        Some(o) if !args.force && o.symlink_metadata().is_ok() => bail!(
            "--out {} exists; nothing is overwritten without --force: give --force to replace it, or choose another path",
            o.display()
        ),
        Some(o) => o.clone(),
        None => args.runs.first().context("give at least one run folder to plot")?.join("plot.svg"),
    };
    for note in plot(&args.runs, &out, args.x)? {
        eprintln!("note: {note}");
    }
    eprintln!("wrote {}", out.display());
    Ok(())
}
