//! `macrobatch eval MODEL --data FILE`: the mean loss per target token of a
//! saved model (a run folder with its adapters, a Hugging Face folder or a
//! GGUF file) on held-out data, its perplexity, and for chat JSON Lines the
//! share of replies the model reproduces greedily (`--exact-match`).
//!
//! The data is read as training reads it: text and token files as windows
//! of `seq_len + 1` tokens, JSON Lines as fine-tuning examples with the same
//! masking (only the assistant's replies, or all of a `text`, are targets).
//! A run folder lends its `data.seq_len`, `data.pack`, `data.drop_empty` and
//! `batch.micro`, so `eval RUN --data VAL` measures what the run's own
//! validation measured, in the same micro-batches: the same sums, the same
//! loss.
//!
//! Thread ranks (`--world-size`) take micro-batches in turn; each batch's
//! sums land in its own slot and are added in batch order, so the result
//! does not depend on how many ranks computed it (beyond the GEMM backend a
//! thread count may choose for a shape).

use crate::family::{Build, Family};
use crate::saved;
use crate::EvalArgs;
use anyhow::{bail, Context, Result};
use comm::Communicator;
use data::{DataFormat, Samples, SftDataset, SftOptions, TokenDataset, Tokenizer};
use engine::{FullStore, Model};
use serde::Serialize;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What `eval` measured (`--json` prints it as one object).
#[derive(Debug, Serialize)]
pub struct Report {
    /// The model evaluated.
    pub model: String,
    /// Its parameters, and the frozen weights held packed beside them
    /// (`3.25M params + 0.11M frozen in q8_0`).
    pub weights: String,
    /// The data file.
    pub data: String,
    /// How the data was read.
    pub format: &'static str,
    /// Samples evaluated (windows, examples or packed rows).
    pub samples: usize,
    /// Target tokens (the loss's denominator).
    pub targets: u64,
    /// Input positions fed to the model, padding included.
    pub positions: u64,
    /// Mean loss per target token (nats).
    pub loss: f64,
    /// exp(loss).
    pub perplexity: f64,
    /// Wall time of the loss pass.
    pub seconds: f64,
    /// Input positions per second.
    pub tokens_per_s: f64,
    /// Thread ranks.
    pub world_size: usize,
    /// Positions per sample (windows), or the cut of an example.
    pub seq_len: usize,
    /// Samples per micro-batch.
    pub micro: usize,
    /// With `--exact-match`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub exact_match: Option<ExactMatch>,
}

/// Greedy replies against the reference replies of chat examples.
#[derive(Debug, Serialize)]
pub struct ExactMatch {
    /// Conversations asked.
    pub examples: usize,
    /// Replies equal to the reference (both trimmed of surrounding white space).
    pub matched: usize,
    /// matched / examples.
    pub rate: f64,
    /// Tokens generated in all.
    pub generated_tokens: usize,
    /// Wall time of the generation.
    pub seconds: f64,
}

/// The settings a run folder lends (from its `config.resolved.toml`).
#[derive(Debug, Default)]
struct RunDefaults {
    seq_len: Option<usize>,
    micro: Option<usize>,
    pack: bool,
    drop_empty: bool,
    schema: data::Schema,
}

fn run_defaults(model: &Path) -> Result<RunDefaults> {
    let path = model.join("config.resolved.toml");
    if !path.is_file() {
        return Ok(RunDefaults { drop_empty: true, ..Default::default() });
    }
    let text = std::fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
    let cfg = config::Config::from_toml(&text, &path.display().to_string(), &[])?;
    let micro = match cfg.batch.micro {
        Some(config::Micro::Sequences(n)) => Some(n),
        _ => None,
    };
    Ok(RunDefaults {
        seq_len: cfg.data.seq_len,
        micro,
        pack: cfg.data.pack,
        drop_empty: cfg.data.drop_empty,
        schema: cfg.data.schema,
    })
}

/// How `path` is read: `--format`, else as [`DataFormat::detect`] tells
/// (a Parquet / Arrow table, `.jsonl` / `.json` as fine-tuning examples, a
/// token file by the `meta.json` beside it, else text).
fn detect_format(path: &Path, given: Option<DataFormat>) -> Result<DataFormat> {
    match given {
        Some(f) => Ok(f),
        None => Ok(DataFormat::detect(path)?),
    }
}

/// The samples of `path` read as `format` for a model of `vocab` tokens.
fn load_samples(
    path: &Path,
    format: DataFormat,
    tok: &Tokenizer,
    seq_len: usize,
    vocab: usize,
    run: &RunDefaults,
) -> Result<Samples> {
    let name = path.display().to_string();
    let opts =
        SftOptions { max_len: Some(seq_len), pack_seq_len: run.pack.then_some(seq_len), drop_empty: run.drop_empty };
    let samples = match format {
        DataFormat::Parquet | DataFormat::Arrow => {
            data::Table::read(path, format)?.load(tok, &opts, run.schema)?.whole("eval", seq_len, vocab)?
        }
        DataFormat::Jsonl => {
            let ds = SftDataset::load_as(path, tok, &opts, run.schema)?;
            if ds.stats().n_without_targets > 0 {
                eprintln!(
                    "warning: {name}: {} examples keep no target within {seq_len} positions and are left out (lines {}); raise --seq-len to count them",
                    ds.stats().n_without_targets,
                    data::sft::line_list(ds.dropped_lines())
                );
            }
            Samples::Examples(ds)
        }
        DataFormat::Text => Samples::Windows(crate::setup::text_corpus(path, tok, vocab)?.split_all("eval", seq_len)?),
        DataFormat::U16 | DataFormat::U32 => {
            let dtype = format.dtype().context("a token format has a width")?;
            let file = data::open_token_file(path, dtype, vocab)?;
            let n = file.n_tokens();
            Samples::Windows(TokenDataset::from_file("eval", file, 0, n, seq_len, vocab)?)
        }
    };
    if samples.n_samples() == 0 {
        bail!("{name} holds no sample of {seq_len} positions to evaluate; give more data or a shorter --seq-len");
    }
    Ok(samples)
}

/// Per micro-batch: [loss sum, targets, positions].
const SLOT: usize = 3;

/// Loss sums of every micro-batch of the first `n` of `samples`, computed
/// by `world` thread ranks taking batches in turn, each into its own slot.
fn batch_sums(
    family: &Arc<dyn Family>,
    params: &Arc<Vec<f32>>,
    samples: &Arc<Samples>,
    n: usize,
    micro: usize,
    world: usize,
) -> Result<Vec<f64>> {
    let n_batches = n.div_ceil(micro);
    let out = Arc::new(std::sync::Mutex::new(Vec::new()));
    let (family, params, samples, out2) = (family.clone(), params.clone(), samples.clone(), out.clone());
    crate::ranks::run_thread_ranks(world, Duration::from_secs(600), move |comm| {
        let mut model = family.build(Build::default())?;
        let mut sums = vec![0.0f64; SLOT * n_batches];
        for b in (comm.rank()..n_batches).step_by(world) {
            let idx: Vec<usize> = (b * micro..((b + 1) * micro).min(n)).collect();
            let batch = samples.batch(&idx)?;
            let mut store = FullStore::read_only(model.layout(), model.segments(), &params)?;
            let s = model.loss(&mut store, &batch)?;
            sums[SLOT * b..SLOT * b + SLOT].copy_from_slice(&[
                s.loss_sum,
                s.n_targets as f64,
                samples.input_positions(&idx) as f64,
            ]);
        }
        // One rank writes each slot; the others add zeros: the sum is exact.
        comm.all_reduce_sum_f64(&mut sums)?;
        if comm.rank() == 0 {
            if let Ok(mut o) = out2.lock() {
                *o = sums;
            }
        }
        Ok(())
    })?;
    let sums = out.lock().map(|o| o.clone()).map_err(|_| anyhow::anyhow!("a rank panicked"))?;
    Ok(sums)
}

/// Greedy replies to the chat examples of `path` (read as `schema`)
/// against their last assistant message.
fn exact_match(
    path: &Path,
    schema: data::Schema,
    family: &Arc<dyn Family>,
    params: &[f32],
    tok: &Tokenizer,
    max_new: usize,
    limit: Option<usize>,
) -> Result<ExactMatch> {
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let mut convs = data::sft::conversations(path, &text, schema)?;
    if convs.is_empty() {
        bail!(
            "--exact-match: {} holds no chat example (messages, Alpaca, ShareGPT or conversational prompt/completion lines); exact match compares the model's reply with the last assistant message",
            path.display()
        );
    }
    if let Some(l) = limit {
        convs.truncate(l);
    }
    let stops = saved::turn_ends(tok);
    let context = family.max_seq_len();
    let mut model = family.build(Build::default())?;
    let (mut matched, mut generated) = (0, 0);
    let start = Instant::now();
    for (line, messages) in &convs {
        let Some(last) = messages.iter().rposition(|m| m.role == data::Role::Assistant) else { continue };
        let mut tokens = saved::chat_prompt(tok, &messages[..last])
            .with_context(|| format!("--exact-match: {} line {line}", path.display()))?;
        let prompt_len = tokens.len();
        model.set_kv_cache((prompt_len + max_new).min(context))?;
        saved::extend(&mut *model, params, &mut tokens, max_new, context, &stops, saved::argmax, |_, _| Ok(()))?;
        generated += tokens.len() - prompt_len;
        let reply = tok.decode(&tokens[prompt_len..])?;
        if reply.trim() == messages[last].content.trim() {
            matched += 1;
        }
    }
    let examples = convs.len();
    Ok(ExactMatch {
        examples,
        matched,
        rate: matched as f64 / examples as f64,
        generated_tokens: generated,
        seconds: start.elapsed().as_secs_f64(),
    })
}

/// Evaluates the model and prints the report.
pub fn run(args: EvalArgs) -> Result<()> {
    if args.world_size == 0 || args.micro == Some(0) || args.seq_len == Some(0) {
        bail!("--world-size, --micro and --seq-len must be at least 1");
    }
    if args.max_samples == Some(0) {
        bail!(
            "--max-samples must be at least 1 (it counts the samples to evaluate); leave it out to evaluate them all"
        );
    }
    saved::point_to_checkpoints(&args.model)?;
    let (family, params) =
        crate::saved::load_for_inference(&args.model, &format!("eval {}", args.model.display()), args.dequantize)
            .with_context(|| format!("cannot load a model from {}", args.model.display()))?;
    let tok = saved::tokenizer_of(&args.model)?;
    let run = run_defaults(&args.model)?;
    let context = family.max_seq_len();
    let seq_len = args.seq_len.or(run.seq_len).unwrap_or(context.min(1024));
    if seq_len > context {
        bail!("--seq-len {seq_len} is longer than the model's context of {context} tokens; give --seq-len {context} or less");
    }
    let micro = args.micro.or(run.micro).unwrap_or(1);
    let format = detect_format(&args.data, args.format)?;
    if args.exact_match && format != DataFormat::Jsonl {
        bail!(
            "--exact-match needs chat JSON Lines (messages, Alpaca, ShareGPT or conversational prompt/completion lines), but {} is read as {}",
            args.data.display(),
            format.name()
        );
    }
    let vocab = family.vocab_size();
    let samples = load_samples(&args.data, format, &tok, seq_len, vocab, &run)
        .with_context(|| format!("cannot evaluate on {}", args.data.display()))?;
    let n_samples = args.max_samples.map_or(samples.n_samples(), |m| m.min(samples.n_samples()));
    let (params, samples) = (Arc::new(params), Arc::new(samples));
    let start = Instant::now();
    let sums = batch_sums(&family, &params, &samples, n_samples, micro, args.world_size)?;
    let seconds = start.elapsed().as_secs_f64();
    let (mut loss_sum, mut targets, mut positions) = (0.0f64, 0u64, 0u64);
    for s in sums.chunks(SLOT) {
        loss_sum += s[0];
        targets += s[1] as u64;
        positions += s[2] as u64;
    }
    if targets == 0 {
        bail!("{} holds no target token to score", args.data.display());
    }
    let loss = loss_sum / targets as f64;
    if let Some(path) = &args.dump_logits {
        dump_logits(path, &family, &params, &samples)?;
    }
    let exact = if args.exact_match {
        Some(exact_match(&args.data, run.schema, &family, &params, &tok, args.max_new_tokens, args.max_samples)?)
    } else {
        None
    };
    let report = Report {
        model: args.model.display().to_string(),
        weights: crate::family::params_label(&*family),
        data: args.data.display().to_string(),
        format: format.name(),
        samples: n_samples,
        targets,
        positions,
        loss,
        perplexity: loss.exp(),
        seconds,
        tokens_per_s: positions as f64 / seconds.max(1e-9),
        world_size: args.world_size,
        seq_len,
        micro,
        exact_match: exact,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_report(&report);
    }
    Ok(())
}

/// The logits at each of the first (at most 64) positions of sample 0.
fn dump_logits(path: &Path, family: &Arc<dyn Family>, params: &[f32], samples: &Samples) -> Result<()> {
    let batch = samples.batch(&[0])?;
    let ids: Vec<u32> = batch.inputs.iter().take(64).copied().collect();
    let mut model = family.build(Build::default())?;
    model.set_kv_cache(ids.len())?;
    let mut logits = Vec::with_capacity(ids.len() * family.vocab_size());
    for t in 1..=ids.len() {
        logits.extend(model.next_token_logits(params, &ids[..t])?);
    }
    let ids_f: Vec<f32> = ids.iter().map(|&i| i as f32).collect();
    let tensors = [
        ("input_ids".to_string(), vec![ids.len()], ids_f.as_slice()),
        ("logits".to_string(), vec![ids.len(), family.vocab_size()], logits.as_slice()),
    ];
    nn::io::write_safetensors(path, &tensors, &[])?;
    Ok(())
}

fn print_report(r: &Report) {
    println!("model       {} ({})", r.model, r.weights);
    println!("data        {} ({}, {} samples, seq_len {}, micro {})", r.data, r.format, r.samples, r.seq_len, r.micro);
    println!("loss        {:.6} nats per target token ({} targets)", r.loss, r.targets);
    println!("perplexity  {:.4}", r.perplexity);
    println!(
        "speed       {:.0} tokens/s ({} positions in {:.2} s, {} thread rank{})",
        r.tokens_per_s,
        r.positions,
        r.seconds,
        r.world_size,
        if r.world_size == 1 { "" } else { "s" }
    );
    if let Some(e) = &r.exact_match {
        println!(
            "exact match {}/{} = {:.1}% of greedy replies equal the reference ({} tokens generated in {:.1} s)",
            e.matched,
            e.examples,
            100.0 * e.rate,
            e.generated_tokens,
            e.seconds
        );
    }
}
