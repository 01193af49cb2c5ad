//! `macrobatch`: train GPT-2 with gradient accumulation done right.

mod bench;
mod charts;
mod checkpoint;
mod digest;
mod dist;
mod eval;
mod export;
mod family;
mod folder;
mod generate;
mod heap;
mod memory;
mod metrics;
mod mlflow;
mod plan;
mod planning;
mod plot;
mod prepare;
mod ranks;
mod saved;
mod setup;
mod tensorboard;
mod train;
mod verify;

use clap::{Parser, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "macrobatch",
    version,
    about = "Train large models when memory is the wall: K micro-batches, one optimizer step, exactly as if the whole batch had fit."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Train a GPT-2 (default: the `tiny` preset on the bundled corpus).
    Train(TrainArgs),
    /// Sample text from a trained model directory.
    Generate(GenerateArgs),
    /// Measure a saved model on held-out data: loss per target token,
    /// perplexity, tokens/s; with --exact-match, greedy replies against chat references.
    Eval(EvalArgs),
    /// Write a run (its LoRA adapters merged into the base) as a standalone
    /// Hugging Face folder or a GGUF file for llama.cpp / Ollama.
    Export(ExportArgs),
    /// Prove that the configured micro × K × W computes the same step as one big batch.
    Verify(VerifyArgs),
    /// Measure the training step: ms/step, tokens/s, MFU, engine overhead, K sweep.
    Bench(BenchArgs),
    /// Plan memory: per-rank breakdown, the largest micro-batch under a budget
    /// at the same global batch, and what to change when nothing fits.
    Plan(PlanArgs),
    /// Draw runs' metrics (loss, validation loss, LR, grad norm, loss scale, tokens/s, memory) into one SVG or PNG.
    Plot(PlotArgs),
    /// Tokenize text files once into memory-mappable DIR/train.bin + DIR/val.bin (+ meta.json).
    Prepare(PrepareArgs),
}

/// Arguments of `macrobatch plan`.
#[derive(clap::Args)]
pub struct PlanArgs {
    /// TOML config file, or a DeepSpeed JSON config (`*.json`; optional).
    pub config: Option<PathBuf>,
    /// Override a config key, e.g. --set model.preset=gpt2-xl --set batch.global=512.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    #[command(flatten)]
    pub deepspeed: DeepSpeedArgs,
    /// Memory per process (rank), e.g. 80GiB; default: what this machine has available now.
    #[arg(long, value_name = "SIZE")]
    pub memory: Option<String>,
    /// Plan for this many ranks, one per process (default: dist.world_size as threads).
    #[arg(long)]
    pub world_size: Option<usize>,
    /// The global batch the configured optim.lr was tuned for: prints scaled learning rates.
    #[arg(long)]
    pub base_batch: Option<usize>,
    /// Read no data: plan the shape at data.seq_len (unset: the model's
    /// context) on synthetic windows, whatever `[data]` says (its files,
    /// tokenizer and chat template are not opened; the data set's own
    /// memory, a few MB for most, is not counted).
    #[arg(long)]
    pub no_data: bool,
    /// Plan the run `train --init-from PATH` would make: the pretrained
    /// model's shape and tokenizer, and its file's formats for a packed
    /// frozen base (train.frozen_dtype), read from its metadata.
    #[arg(long, value_name = "PATH")]
    pub init_from: Option<PathBuf>,
    /// One JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

/// How a DeepSpeed JSON config (CONFIG ending in `.json`) is read; see docs/deepspeed.md.
#[derive(clap::Args, Clone, Default)]
pub struct DeepSpeedArgs {
    /// With a DeepSpeed JSON config: a TOML file for what DeepSpeed does not
    /// describe (`[model]`, `[data]`, train.steps, dist.world_size, …).
    #[arg(long, value_name = "FILE")]
    pub config_model: Option<PathBuf>,
    /// With a DeepSpeed JSON config: keys macrobatch cannot honour are errors, not warnings.
    #[arg(long)]
    pub strict: bool,
}

/// Arguments of `macrobatch plot`.
#[derive(clap::Args)]
pub struct PlotArgs {
    /// Run folders (as written by `train --out DIR`); each is one colour, named after its folder.
    #[arg(required = true, value_name = "RUN")]
    pub runs: Vec<PathBuf>,
    /// The picture: FILE.svg or FILE.png (default: FIRST_RUN/plot.svg).
    #[arg(long, value_name = "FILE")]
    pub out: Option<PathBuf>,
    /// Replace --out FILE if it exists.
    #[arg(long)]
    pub force: bool,
    /// What the x axis counts.
    #[arg(long, value_enum, default_value = "step")]
    pub x: charts::XAxis,
}

/// Arguments of `macrobatch prepare`.
#[derive(clap::Args)]
pub struct PrepareArgs {
    /// Text files, or folders (every file below them, in path order).
    #[arg(required = true, value_name = "INPUT")]
    pub inputs: Vec<PathBuf>,
    /// Tokenizer: byte, gpt2 (bundled), a GGUF model file (PATH.gguf: its own tokenizer) or a Hugging Face PATH/tokenizer.json.
    #[arg(long, default_value = "byte")]
    pub tokenizer: String,
    /// Output folder for train.bin, val.bin and meta.json (created; must not hold them yet).
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    /// Share of the tokens (from the end) written to val.bin; 0 writes no val.bin.
    #[arg(long, default_value_t = 0.1)]
    pub val_fraction: f64,
    /// Bytes of text per parallel work item (cut at the next newline); tests make it small.
    #[arg(long, default_value_t = 8 << 20, hide = true)]
    pub chunk_bytes: usize,
}

/// Arguments of `macrobatch bench`.
#[derive(clap::Args)]
pub struct BenchArgs {
    /// TOML config file, or a DeepSpeed JSON config (`*.json`; optional).
    pub config: Option<PathBuf>,
    /// Override a config key, e.g. --set model.preset=gpt2 --set batch.micro=4.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    #[command(flatten)]
    pub deepspeed: DeepSpeedArgs,
    /// Unmeasured steps first.
    #[arg(long, default_value_t = 3)]
    pub warmup: usize,
    /// Measured steps.
    #[arg(long, default_value_t = 10)]
    pub steps: usize,
    /// Skip the K ∈ {1, 2, 4, 8} sweep.
    #[arg(long)]
    pub no_k_sweep: bool,
    /// One JSON object instead of text.
    #[arg(long)]
    pub json: bool,
    /// Start from a pretrained model (a GGUF file or a Hugging Face folder)
    /// as `train --init-from` does: a fine-tuning step measured on its real
    /// weights (and a packed frozen base read from it). The K sweep's steps
    /// start from a fresh initialisation of the same shape: the pretrained
    /// values are let go once the first trainer holds them.
    #[arg(long, value_name = "MODEL")]
    pub init_from: Option<PathBuf>,
}

/// Arguments of `macrobatch verify`.
#[derive(clap::Args)]
pub struct VerifyArgs {
    /// TOML config file, or a DeepSpeed JSON config (`*.json`; optional).
    pub config: Option<PathBuf>,
    /// Override a config key, e.g. --set batch.accumulation_steps=8 --set dist.world_size=2.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    #[command(flatten)]
    pub deepspeed: DeepSpeedArgs,
    /// Micro-batch of the reference run (default: the whole global batch at once).
    #[arg(long)]
    pub reference_micro: Option<usize>,
    /// Check from a pretrained model's weights (and shape, tokenizer), as
    /// `train --init-from PATH` starts: a Hugging Face folder, a GGUF file
    /// or a run folder (default: the configured model's random initialisation).
    #[arg(long, value_name = "PATH")]
    pub init_from: Option<PathBuf>,
}

/// Arguments of `macrobatch train`.
#[derive(clap::Args)]
pub struct TrainArgs {
    /// TOML config file, or a DeepSpeed JSON config (`*.json`) (optional: defaults train `tiny` on the bundled corpus).
    pub config: Option<PathBuf>,
    /// Override a config key, e.g. --set train.steps=30 --set batch.micro=4.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    #[command(flatten)]
    pub deepspeed: DeepSpeedArgs,
    /// Output directory (default: runs/run-ID, created new). Must not hold a run already.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Continue the run in DIR (or --out) from its newest valid checkpoint, bit for bit.
    /// Its saved config is used; --set still overrides (e.g. train.steps to extend).
    #[arg(long, value_name = "DIR", num_args = 0..=1)]
    pub resume: Option<Option<PathBuf>>,
    /// Start from a pretrained model, e.g. to fine-tune: a Hugging Face folder
    /// (config.json + model.safetensors, or a sharded index) or a GGUF file
    /// (llama, qwen2, qwen3, phi3, gemma2); its tokenizer comes along unless data.tokenizer is set.
    #[arg(long, value_name = "PATH")]
    pub init_from: Option<PathBuf>,
    /// Stop cleanly after this many optimizer steps in this invocation (checkpoint, exit 0).
    /// (Stopped by SIGINT / SIGTERM instead: checkpoint, exit 130 / 143.)
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub stop_after: Option<u64>,
    /// Write the initial trainable tensors (`initial_trainable.safetensors`)
    /// and every step's micro-batches (`steps.jsonl`) into DIR, so a peer
    /// (scripts/lora_vs_peft.py) can replay the run exactly. One rank only.
    #[arg(long, value_name = "DIR", hide = true)]
    pub dump_steps: Option<PathBuf>,
    /// With `[lora]`: also write DIR/merged/, the model with the adapters
    /// folded into its weights (a plain Hugging Face Llama folder).
    #[arg(long)]
    pub merge: bool,
    /// Write TensorBoard event files into DIR (turns train.tensorboard on;
    /// with the key alone they go into the run folder's tensorboard/).
    #[arg(long, value_name = "DIR")]
    pub tensorboard: Option<PathBuf>,
}

/// Arguments of `macrobatch generate`.
#[derive(clap::Args)]
pub struct GenerateArgs {
    /// A model: a folder with model.safetensors and config.json (a `train
    /// --out DIR`, with its tokenizer and LoRA adapters if it has them), or a
    /// GGUF file.
    pub dir: PathBuf,
    /// Text to continue (with --chat: the user's message).
    #[arg(long, default_value = "")]
    pub prompt: String,
    /// Treat the prompt as a user message and answer it as the assistant,
    /// through the tokenizer's chat template; stops at end of turn.
    #[arg(long)]
    pub chat: bool,
    /// With --chat: a system message first.
    #[arg(long, requires = "chat")]
    pub system: Option<String>,
    /// Tokens to generate.
    #[arg(long, default_value_t = 200)]
    pub max_new_tokens: usize,
    /// Sampling temperature (0: greedy).
    #[arg(long, default_value_t = 0.8)]
    pub temperature: f32,
    /// Sample among the k most likely tokens (0: all).
    #[arg(long, default_value_t = 40)]
    pub top_k: usize,
    /// Sampling seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Run the whole sequence for every new token instead of keeping a
    /// key/value cache. The cache (2 × layers × positions × key/value width
    /// f32, positions = prompt + new tokens, at most the context) lets each
    /// step run only the new token; once the sequence is longer than the
    /// context the window slides, every position shifts, and each token
    /// recomputes the window either way.
    #[arg(long)]
    pub no_kv_cache: bool,
    /// Hold every weight as f32, dequantising a GGUF's blocks or a 16-bit
    /// file on load. By default a file whose projections are packed keeps
    /// them packed (the same logits to the bit, a fraction of the memory).
    #[arg(long)]
    pub dequantize: bool,
    /// Keep generating past the end-of-sequence token (and, with --chat,
    /// the end of turn) up to --max-new-tokens. By default generation stops
    /// at the model's eos_token_id: generation_config.json's, else
    /// config.json's, else the tokenizer's (a GGUF's
    /// tokenizer.ggml.eos_token_id), one id or several.
    #[arg(long)]
    pub ignore_eos: bool,
}

/// Arguments of `macrobatch eval`.
#[derive(clap::Args)]
pub struct EvalArgs {
    /// A model: a run folder (with its LoRA adapters, if any), a Hugging
    /// Face folder (config.json + model.safetensors) or a GGUF file.
    pub model: PathBuf,
    /// Hold every weight as f32, dequantising a GGUF's blocks or a 16-bit
    /// file on load. By default a file whose projections are packed keeps
    /// them packed (the same logits to the bit, a fraction of the memory).
    #[arg(long)]
    pub dequantize: bool,
    /// Held-out data: text (a file or folder), a token file (u16 / u32, by
    /// the meta.json `prepare` writes beside it) or JSON Lines (`text` or
    /// `messages` examples: only the assistant's replies are scored).
    #[arg(long, value_name = "FILE")]
    pub data: PathBuf,
    /// How to read --data (default: by its name and the meta.json beside it).
    #[arg(long, value_parser = parse_format)]
    pub format: Option<data::DataFormat>,
    /// Positions per window, or the cut of an example (default: the run's
    /// data.seq_len, else the model's context up to 1024).
    #[arg(long)]
    pub seq_len: Option<usize>,
    /// Samples per forward pass (default: the run's batch.micro, else 1).
    #[arg(long)]
    pub micro: Option<usize>,
    /// Thread ranks that split the micro-batches.
    #[arg(long, default_value_t = 1)]
    pub world_size: usize,
    /// Evaluate only the first N samples (and with --exact-match, the first N conversations).
    #[arg(long, value_name = "N")]
    pub max_samples: Option<usize>,
    /// Chat JSON Lines: also generate a greedy reply to each conversation
    /// (all but its last assistant message) and count the replies equal to
    /// that message.
    #[arg(long)]
    pub exact_match: bool,
    /// With --exact-match: the longest reply generated.
    #[arg(long, default_value_t = 256)]
    pub max_new_tokens: usize,
    /// One JSON object instead of text.
    #[arg(long)]
    pub json: bool,
    /// Write the logits at every position of the first sample (at most 64
    /// positions) to FILE.safetensors (`input_ids` and `logits`, f32), for
    /// comparisons with other implementations (scripts/export_check.py).
    #[arg(long, value_name = "FILE", hide = true)]
    pub dump_logits: Option<PathBuf>,
}

fn parse_format(s: &str) -> Result<data::DataFormat, String> {
    data::DataFormat::ALL.into_iter().find(|f| f.name() == s).ok_or_else(|| {
        let names: Vec<&str> = data::DataFormat::ALL.iter().map(|f| f.name()).collect();
        format!("`{s}` is not a data format: choose {}", names.join(", "))
    })
}

/// Arguments of `macrobatch export`.
#[derive(clap::Args)]
pub struct ExportArgs {
    /// The model to export: a run folder (LoRA adapters are merged into
    /// the base: W + alpha/r · B·A in f32), a Hugging Face folder or a GGUF file.
    pub run: PathBuf,
    /// hf: a folder transformers loads (config.json, model.safetensors,
    /// tokenizer files, generation_config.json); gguf: one file llama.cpp,
    /// Ollama and transformers load.
    #[arg(long, value_enum)]
    pub format: export::Format,
    /// Weight type: f32, f16, bf16 (both formats) or q8_0, q4_0 (GGUF:
    /// matrices whose rows are whole 32-value blocks; norms stay f32).
    #[arg(long, value_enum, default_value = "f32")]
    pub dtype: export::Dtype,
    /// The folder (hf) or file (gguf) to write.
    #[arg(long, value_name = "PATH")]
    pub out: PathBuf,
    /// Replace --out if it exists (it is replaced only once the new one is complete).
    #[arg(long)]
    pub force: bool,
}

#[global_allocator]
static ALLOCATOR: heap::Counting = heap::Counting;

fn main() -> ExitCode {
    // The program's own resident size, before anything is allocated (the
    // memory model's "program" line).
    planning::runtime_bytes();
    let cli = Cli::parse();
    if let Err(e) = linalg::backend::check_env().and_then(|()| linalg::bf16::check_env()) {
        eprintln!("error: {e}");
        return ExitCode::from(2);
    }
    let result = match cli.command {
        Command::Train(args) => match train::run(args) {
            // Stopped by SIGINT / SIGTERM after the checkpoint is safe: 128 + signal
            // (130, 143), so `train && generate` does not take a stopped run for a finished one.
            Ok(train::Outcome::Signalled(sig)) => return ExitCode::from((128 + sig).clamp(1, 255) as u8),
            r => r.map(|_| true),
        },
        Command::Generate(args) => generate::run(args).map(|()| true),
        Command::Eval(args) => eval::run(args).map(|()| true),
        Command::Export(args) => export::run(args).map(|()| true),
        Command::Verify(args) => verify::run(args),
        Command::Bench(args) => bench::run(args).map(|()| true),
        Command::Plan(args) => plan::run(args).map(|()| true),
        Command::Plot(args) => plot::run(args).map(|()| true),
        Command::Prepare(args) => prepare::run(args).map(|()| true),
    };
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(2)
        }
    }
}
