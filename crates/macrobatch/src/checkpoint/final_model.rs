//! A sharded run's final model: its last checkpoint, named by the run
//! folder (`model.sharded.json`) in place of the gathered weights.

use super::step_dir_name;
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// A sharded run's final model (`train.checkpoint_sharded`): the run
/// folder names the checkpoint of its last step instead of holding the
/// gathered weights (which no rank need hold).
pub const FINAL_POINTER: &str = "model.sharded.json";

#[derive(Debug, Serialize, Deserialize)]
struct FinalPointer {
    /// The checkpoint folder, relative to the run folder.
    checkpoint: String,
    /// Its step.
    step: u64,
}

/// Rank 0 of a sharded run: points the run folder's model at the
/// checkpoint of `step`.
pub fn write_final_pointer(run_dir: &Path, step: u64) -> Result<()> {
    let p = FinalPointer { checkpoint: format!("checkpoints/{}", step_dir_name(step)), step };
    nn::io::write_atomic(&run_dir.join(FINAL_POINTER), serde_json::to_string_pretty(&p)?.as_bytes())?;
    Ok(())
}

/// The folder holding the model of `dir`: a sharded run folder's final
/// checkpoint, else `dir` itself.
pub fn model_dir(dir: &Path) -> Result<PathBuf> {
    let ptr = dir.join(FINAL_POINTER);
    if !ptr.is_file() {
        return Ok(dir.to_path_buf());
    }
    let text = std::fs::read_to_string(&ptr).with_context(|| format!("cannot read {}", ptr.display()))?;
    let p: FinalPointer = serde_json::from_str(&text).with_context(|| format!("{} is corrupt", ptr.display()))?;
    let target = dir.join(&p.checkpoint);
    if !target.is_dir() {
        bail!(
            "{} names the final model {} (a sharded checkpoint of step {}), which is gone; point at another checkpoint in {}",
            ptr.display(),
            target.display(),
            p.step,
            dir.join("checkpoints").display()
        );
    }
    Ok(target)
}
