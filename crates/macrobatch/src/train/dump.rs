//! `--dump-steps DIR`: the initial trainable tensors and every step's
//! micro-batches, for a peer (scripts/lora_vs_peft.py) to replay the run.

use anyhow::{bail, Context, Result};
use engine::{TokenBatch, Trainer};
use std::path::Path;

/// `--dump-steps`: appends step `step`'s micro-batches to `DIR/steps.jsonl`
/// and, with `initial`, first writes the trainable tensors' values.
pub fn dump_step(
    dir: &Path,
    step: u64,
    batches: &[TokenBatch],
    initial: Option<(&Trainer, &engine::ParamLayout)>,
) -> Result<()> {
    use std::io::Write;
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    if let Some((trainer, layout)) = initial {
        let params = trainer.params();
        if params.len() != layout.n_params() {
            bail!("--dump-steps needs unsharded parameters (dist.zero_stage < 3 and f32 or stage 0)");
        }
        let tensors: Vec<(String, Vec<usize>, &[f32])> = layout
            .tensors()
            .iter()
            .filter(|t| t.trainable)
            .map(|t| (t.name.clone(), t.shape.clone(), &params[t.range()]))
            .collect();
        nn::io::write_safetensors(&dir.join("initial_trainable.safetensors"), &tensors, &[])?;
    }
    let line = serde_json::json!({
        "step": step,
        "micro_batches": batches.iter().map(|b| serde_json::json!({
            "n_seqs": b.n_seqs, "seq_len": b.seq_len, "inputs": b.inputs, "targets": b.targets,
        })).collect::<Vec<_>>(),
    });
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("steps.jsonl"))
        .with_context(|| format!("cannot write {}", dir.join("steps.jsonl").display()))?;
    writeln!(f, "{line}")?;
    Ok(())
}
