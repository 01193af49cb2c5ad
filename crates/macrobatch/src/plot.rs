//! `macrobatch plot`: one picture of one or more runs' `metrics.jsonl`, as
//! SVG or PNG (drawn by [`crate::charts`]).

use crate::charts::plot;
use crate::PlotArgs;
use anyhow::{Context, Result};

/// `macrobatch plot`.
pub fn run(args: PlotArgs) -> Result<()> {
    let out = match &args.out {
        Some(o) => o.clone(),
        None => args.runs.first().context("give at least one run folder to plot")?.join("plot.svg"),
    };
    for note in plot(&args.runs, &out, args.x)? {
        eprintln!("note: {note}");
    }
    eprintln!("wrote {}", out.display());
    Ok(())
}
