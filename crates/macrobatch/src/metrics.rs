//! Per-step metrics (JSON Lines) and progress display.

use anyhow::{Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use std::fs::File;
use std::io::IsTerminal;
use std::path::Path;
use std::time::Duration;

/// One line of `metrics.jsonl`.
#[derive(Debug, Serialize)]
pub struct StepRecord {
    /// Optimizer steps completed (1-based).
    pub step: u64,
    /// Epoch of this step (0-based).
    pub epoch: u64,
    /// Global-batch mean loss: plain cross-entropy per target token, also
    /// with `train.label_smoothing` / `train.z_loss` (see `loss_total`).
    pub loss: f64,
    /// With `train.label_smoothing`, `train.z_loss` or a mixture of
    /// experts' router losses: the loss the gradient is of — `loss` plus
    /// what those terms add per target token.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub loss_total: Option<f64>,
    /// Seconds of the forward-only routing pass a mixture's global-batch
    /// load-balancing loss runs before the step's micro-steps.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub routing_pass_s: Option<f64>,
    /// A mixture's load per expert: its share of the global batch's
    /// (layer, token, slot) choices (with the global-batch balance loss).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expert_load: Option<Vec<f64>>,
    /// Learning rate used.
    pub lr: f32,
    /// Gradient norm before clipping.
    pub grad_norm: f64,
    /// Whether clipping scaled the gradient.
    pub clipped: bool,
    /// Target tokens in the global batch.
    pub tokens: u64,
    /// Target tokens (all ranks) per second.
    pub tokens_per_s: f64,
    /// Input positions of the global batch (padding included): what the
    /// model processed, as peers count tokens.
    pub input_tokens: u64,
    /// Input positions (all ranks) per second.
    pub input_tokens_per_s: f64,
    /// Micro-steps in this optimizer step.
    pub micro_steps: usize,
    /// Mean loss of each micro-batch.
    pub micro_losses: Vec<f64>,
    /// Bytes this rank handed to collectives in the step (independent of K).
    pub comm_bytes: u64,
    /// Collective calls in the step.
    pub comm_calls: u64,
    /// Seconds rank 0 spent in the step's data-parallel collectives
    /// (transfer and waiting for the slowest rank).
    pub comm_s: f64,
    /// `dist.overlap_comm`: seconds of rank 0's gradient collectives it did
    /// not wait for (they ran under the backward or the boundary's own
    /// statistics; not in `comm_s`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub comm_hidden_s: Option<f64>,
    /// `dist.overlap_comm`: rank 0's step timeline (seconds from the step's
    /// start): the end of the last micro-step, and each gradient collective's
    /// hand-over, start and end.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub comm_timeline: Option<engine::OverlapReport>,
    /// `dist.overlap_comm`: every rank's step, in seconds: `[step,
    /// end of the last micro-step, waited for gradient collectives, spent
    /// in them on the communication thread]`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub overlap_ranks: Option<Vec<[f64; 4]>>,
    /// Wall time of the step.
    pub step_ms: f64,
    /// Wall time since the start of training.
    pub elapsed_s: f64,
    /// Validation loss, on evaluation steps.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub val_loss: Option<f64>,
    /// The step was skipped (f16 overflow): nothing was updated.
    pub skipped: bool,
    /// Loss scale used (1 unless f16).
    pub loss_scale: f32,
    /// Bytes of resident parameters on this rank.
    pub mem_params: usize,
    /// Bytes of gradient buffers.
    pub mem_grads: usize,
    /// Bytes of optimizer state.
    pub mem_optimizer: usize,
    /// Bytes of f32 master weights kept apart from the parameters.
    pub mem_master: usize,
    /// Bytes of activations and backward scratch.
    pub mem_activations: usize,
    /// Bytes of collective buffers.
    pub mem_comm_buffers: usize,
    /// Peak resident set size of this process (VmHWM).
    pub mem_peak_rss: Option<u64>,
    /// The memory model's prediction of the process's peak (`macrobatch plan`).
    pub mem_predicted: u64,
    /// With a pipeline: the schedule's bubble, idle ticks over all ticks of
    /// its ideal timeline ((P−1)/(K+P−1)).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pipeline_bubble: Option<f64>,
    /// With a pipeline: seconds each stage of rank 0's pipeline waited for
    /// activations or gradients from its neighbours in the step.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pipeline_idle_s: Option<Vec<f64>>,
    /// With a pipeline: bytes of activations and gradients rank 0 (stage 0)
    /// sent to its neighbour in the step.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub p2p_bytes: Option<u64>,
    /// With tensor parallelism: seconds rank 0 spent in the model's
    /// tensor-parallel all-reduces in the step (waiting for the slowest
    /// rank of its group included).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tp_allreduce_s: Option<f64>,
    /// With tensor parallelism: bytes rank 0 contributed to them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tp_bytes: Option<u64>,
    /// With tensor parallelism: how many there were.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tp_calls: Option<u64>,
    /// With context parallelism: seconds rank 0 spent in attention's
    /// key/value gathers and their gradients' reduce-scatters in the step.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cp_s: Option<f64>,
    /// With context parallelism: bytes rank 0 contributed to them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cp_bytes: Option<u64>,
    /// With context parallelism: how many there were.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cp_calls: Option<u64>,
    /// Why the run stopped after this step before `train.steps` (early
    /// stopping), on that step's line only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stop_reason: Option<String>,
    /// With `train.objective = "dpo"`: the step's rewards (then `loss` is
    /// the mean DPO loss and `tokens` counts pairs).
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub dpo: Option<DpoRecord>,
}

/// A DPO step's rewards, means over the pairs of the global batch (TRL's
/// `rewards/chosen`, `rewards/rejected`, `rewards/margins`,
/// `rewards/accuracies`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct DpoRecord {
    /// Mean of β·(log π(chosen) − log π_ref(chosen)).
    pub rewards_chosen: f64,
    /// Mean of β·(log π(rejected) − log π_ref(rejected)).
    pub rewards_rejected: f64,
    /// Mean of the chosen minus the rejected reward.
    pub rewards_margin: f64,
    /// Share of the pairs whose chosen reward is the larger.
    pub rewards_accuracy: f64,
}

impl DpoRecord {
    /// The means of a DPO model's sums ([`family::dpo`]) over `n_pairs`.
    pub fn from_sums(aux: &engine::AuxStats, n_pairs: u64) -> Option<Self> {
        use family::dpo::{AUX_CHOSEN_REWARD, AUX_CORRECT, AUX_REJECTED_REWARD};
        let n = (n_pairs > 0).then_some(n_pairs as f64)?;
        let (c, r) = (aux[AUX_CHOSEN_REWARD] / n, aux[AUX_REJECTED_REWARD] / n);
        Some(Self {
            rewards_chosen: c,
            rewards_rejected: r,
            rewards_margin: c - r,
            rewards_accuracy: aux[AUX_CORRECT] / n,
        })
    }
}

/// Writes metrics and shows progress.
pub struct Reporter {
    /// Unbuffered: each line goes out in one write of the whole line.
    file: File,
    path: std::path::PathBuf,
    /// Length of the file up to its last complete line.
    len: u64,
    bar: Option<ProgressBar>,
    total: u64,
    log_every: u64,
}

impl Reporter {
    /// Opens `path`: a new file, or with `append` the log of a resumed run.
    pub fn new(path: &Path, total: u64, log_every: u64, append: bool) -> Result<Self> {
        let mut opts = File::options();
        if append {
            opts.append(true).create(true);
        } else {
            opts.write(true).create_new(true);
        }
        let file = opts.open(path).with_context(|| format!("cannot create {}", path.display()))?;
        let len = file.metadata().with_context(|| format!("cannot read {}", path.display()))?.len();
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = ProgressBar::new(total);
            let style = ProgressStyle::with_template("{bar:30} {pos}/{len} {msg} [{elapsed_precise} < {eta_precise}]")
                .unwrap_or_else(|_| ProgressStyle::default_bar());
            bar.set_style(style);
            bar.enable_steady_tick(Duration::from_millis(250));
            bar
        });
        Ok(Self { file, path: path.to_path_buf(), len, bar, total, log_every })
    }

    /// Records one step: the whole line in one write, so a crash keeps every
    /// finished step; a failed write (e.g. a full disk) is cut back to the
    /// last complete line before the error is returned.
    pub fn record(&mut self, r: &StepRecord) -> Result<()> {
        let mut line = serde_json::to_string(r).context("cannot serialise metrics")?;
        line.push('\n');
        if let Err(e) = nn::io::write_all_budgeted(&mut self.file, line.as_bytes()) {
            let cut = self.file.set_len(self.len);
            let what = match cut {
                Ok(()) => "cut back to its last complete line".to_string(),
                Err(c) => format!(
                    "and cutting it back to its last complete line failed too ({c}); a resume drops the torn line"
                ),
            };
            return Err(e).with_context(|| {
                format!("cannot write step {} to {} (the file was {what})", r.step, self.path.display())
            });
        }
        self.len += line.len() as u64;
        let val = r.val_loss.map_or(String::new(), |v| format!(" | val {v:.4}"));
        // Input tokens/s as peers report it; the targets (what the loss is
        // normalised by: target tokens, or under DPO preference pairs)
        // separately where they differ (fine-tuning data).
        let unit = if r.dpo.is_some() { "pairs" } else { "targets" };
        let targets =
            if r.tokens == r.input_tokens { String::new() } else { format!(" ({:.0} {unit}/s)", r.tokens_per_s) };
        // Time in the data-parallel collectives, where there are any.
        let comm = if r.comm_s > 0.0 {
            format!(" | comm {:.0} ms ({:.0}%)", r.comm_s * 1e3, 100.0 * r.comm_s * 1e3 / r.step_ms.max(1e-9))
        } else {
            String::new()
        };
        let msg =
            format!("loss {:.4}{val} | lr {:.2e} | {:.0} tok/s{targets}{comm}", r.loss, r.lr, r.input_tokens_per_s);
        match &self.bar {
            Some(bar) => {
                bar.set_position(r.step);
                bar.set_message(msg);
            }
            None => {
                if r.step == 1 || r.step.is_multiple_of(self.log_every) || r.step == self.total || r.val_loss.is_some()
                {
                    let eta = r.elapsed_s / r.step as f64 * (self.total - r.step) as f64;
                    eprintln!("step {}/{} | {msg} | {:.0} ms/step | ETA {eta:.0}s", r.step, self.total, r.step_ms);
                }
            }
        }
        Ok(())
    }

    /// Prints a line without breaking the bar.
    pub fn println(&self, line: &str) {
        match &self.bar {
            Some(bar) => bar.println(line),
            None => eprintln!("{line}"),
        }
    }

    /// Ends the progress display.
    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish();
        }
    }
}

/// The numbers of one `metrics.jsonl` record (a JSON object), as every
/// sink logs them: each field's number, a boolean as 0 / 1, each number of
/// a list with its index (`Some(i)`); `step` and everything else left out.
pub fn numbers(record: &serde_json::Value) -> Vec<(&str, Option<usize>, f64)> {
    use serde_json::Value;
    let mut out = Vec::new();
    let Some(fields) = record.as_object() else { return out };
    for (name, v) in fields.iter().filter(|(name, _)| *name != "step") {
        match v {
            Value::Number(n) => out.extend(n.as_f64().map(|x| (name.as_str(), None, x))),
            Value::Bool(b) => out.push((name.as_str(), None, if *b { 1.0 } else { 0.0 })),
            Value::Array(items) => {
                out.extend(items.iter().enumerate().filter_map(|(i, x)| Some((name.as_str(), Some(i), x.as_f64()?))))
            }
            _ => {}
        }
    }
    out
}
