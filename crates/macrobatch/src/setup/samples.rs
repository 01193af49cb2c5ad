//! The samples of a plan: the training and validation data of `[data]`,
//! the sampler of the resolved batch, and a rank's micro-batches of a step.

use super::Plan;
use crate::folder;
use anyhow::{bail, Context, Result};
use config::{Config, DataFormat, Objective, ResolvedBatch};
use data::{
    BatchShape, Corpus, EpochOrder, PairDataset, Sampler, Samples, SftDataset, SftOptions, TokenFileMeta, Tokenizer,
};
use engine::TokenBatch;
use std::path::{Path, PathBuf};

/// The bundled public-domain corpus (see data/README.md).
const BUNDLED_CORPUS: &[u8] = include_bytes!("../../../../data/moby-dick.txt");
const BUNDLED_NAME: &str = "bundled corpus (Moby-Dick)";

/// Training and validation samples of `[data]`: windows of a token stream
/// (the bundled corpus or `data.path` as text through `tokenizer`, or a
/// token file), fine-tuning examples (`jsonl`, or a Parquet / Arrow table
/// of records, at most `seq_len` positions each), or the sources of
/// `data.sources` end to end.
pub(super) fn load_samples(
    cfg: &Config,
    tokenizer: &Tokenizer,
    seq_len: usize,
    vocab: usize,
) -> Result<(Samples, Samples)> {
    let d = &cfg.data;
    if let (Some(p), Some(v)) = (&d.path, &d.val_path) {
        if folder::same_path(Path::new(p), Path::new(v)) {
            bail!(
                "data.val_path = \"{v}\" is the training file data.path = \"{p}\": the validation loss would be measured on the examples trained on; give a held-out file, or unset data.val_path to hold out the last data.val_fraction of data.path"
            );
        }
    }
    let read = Reading { cfg, tokenizer, seq_len, vocab };
    if let Some(sources) = &d.sources {
        return super::sources::mixed_samples(&read, sources);
    }
    match &d.path {
        Some(p) if cfg.train.objective == Objective::Dpo => pair_samples(cfg, tokenizer, seq_len, p),
        Some(p) => {
            let format = token_file_format(d.format.resolved_for(Some(Path::new(p))), Path::new(p))?;
            read.splits(p, d.val_path.as_deref(), format, d.schema, d.val_fraction)
        }
        None => {
            let text = std::str::from_utf8(BUNDLED_CORPUS).context("the bundled corpus is UTF-8")?;
            let corpus = Corpus::from_text_with(BUNDLED_NAME, text, tokenizer)?;
            corpus.check_vocab(vocab)?;
            let (train, val) = corpus.split(d.val_fraction, seq_len)?;
            Ok((Samples::Windows(train), Samples::Windows(val)))
        }
    }
}

/// The format of the file `p` configured as `format`: `text` (the default)
/// on a file with the `meta.json` of `macrobatch prepare` beside it is the
/// token format that meta.json names, as [`DataFormat::detect`] tells
/// `eval` — its raw bytes are token ids, not text. Any other is kept.
fn token_file_format(format: DataFormat, p: &Path) -> Result<DataFormat> {
    if format != DataFormat::Text || !p.is_file() {
        return Ok(format);
    }
    let Some(meta) = TokenFileMeta::beside(p)? else { return Ok(format) };
    let detected = match meta.dtype {
        data::TokenDtype::U16 => DataFormat::U16,
        data::TokenDtype::U32 => DataFormat::U32,
    };
    eprintln!(
        "note: {} is read as {} token ids, as the meta.json that `macrobatch prepare` wrote beside it says (and as eval reads it); set data.format = \"{}\" to say so",
        p.display(),
        meta.dtype.name(),
        detected.name()
    );
    Ok(detected)
}

/// What reading a data file needs besides the file: the config's `[data]`
/// options, the tokenizer, the row length and the vocabulary.
pub(super) struct Reading<'a> {
    pub(super) cfg: &'a Config,
    pub(super) tokenizer: &'a Tokenizer,
    pub(super) seq_len: usize,
    pub(super) vocab: usize,
}

impl Reading<'_> {
    /// (training, validation) samples of the file `p` read as `format`
    /// (records as `schema`): validation from `val_path` when given, else
    /// the last `val_fraction` of `p`.
    pub(super) fn splits(
        &self,
        p: &str,
        val_path: Option<&str>,
        format: DataFormat,
        schema: data::Schema,
        val_fraction: f64,
    ) -> Result<(Samples, Samples)> {
        let (d, tokenizer, seq_len, vocab) = (&self.cfg.data, self.tokenizer, self.seq_len, self.vocab);
        let opts =
            SftOptions { max_len: Some(seq_len), pack_seq_len: d.pack.then_some(seq_len), drop_empty: d.drop_empty };
        Ok(match format {
            DataFormat::Jsonl => {
                let load = |path: &str| -> Result<SftDataset> {
                    let ds = SftDataset::load_as(Path::new(path), tokenizer, &opts, schema)?;
                    warn_cuts(path, &ds, seq_len);
                    Ok(ds)
                };
                let (train, val) = match val_path {
                    Some(v) => (load(p)?, load(v)?),
                    None => load(p)?.split_tail(val_fraction)?,
                };
                (Samples::Examples(train), Samples::Examples(val))
            }
            DataFormat::Parquet | DataFormat::Arrow => {
                let load = |path: &str| -> Result<data::TableData> {
                    let loaded = data::Table::read(Path::new(path), format)?.load(tokenizer, &opts, schema)?;
                    if let data::TableData::Examples(ds) = &loaded {
                        warn_cuts(path, ds, seq_len);
                    }
                    Ok(loaded)
                };
                match val_path {
                    Some(v) => {
                        (load(p)?.whole("train", seq_len, vocab)?, load(v)?.whole("validation", seq_len, vocab)?)
                    }
                    None => load(p)?.split(val_fraction, seq_len, vocab)?,
                }
            }
            // A folder is read as eval reads it, through any tokenizer.
            DataFormat::Text
                if !matches!(tokenizer, Tokenizer::Byte(_))
                    || Path::new(p).is_dir()
                    || val_path.is_some_and(|v| Path::new(v).is_dir()) =>
            {
                let load_text = |p: &str| text_corpus(Path::new(p), tokenizer, vocab);
                let corpus = load_text(p)?;
                let (train, val) = match val_path {
                    None => corpus.split(val_fraction, seq_len)?,
                    Some(v) => {
                        let val = load_text(v)?;
                        (corpus.split_all("train", seq_len)?, val.split_all("validation", seq_len)?)
                    }
                };
                (Samples::Windows(train), Samples::Windows(val))
            }
            DataFormat::Text | DataFormat::U16 | DataFormat::U32 => {
                let (train, val) =
                    data::load_splits(Path::new(p), val_path.map(Path::new), format, val_fraction, seq_len, vocab)?;
                (Samples::Windows(train), Samples::Windows(val))
            }
        })
    }
}

/// Warnings about fine-tuning examples that cutting to `seq_len` shortened
/// or dropped.
fn warn_cuts(path: &str, ds: &SftDataset, seq_len: usize) {
    let s = ds.stats();
    if s.n_truncated > 0 {
        let n_read = s.n_examples + s.n_without_targets;
        eprintln!("warning: {path}: {} of {n_read} examples cut to data.seq_len = {seq_len} positions", s.n_truncated);
    }
    if s.n_without_targets > 0 {
        eprintln!(
            "warning: {path}: dropped {} examples that keep no target once cut (their replies lie beyond data.seq_len = {seq_len}): lines {}; raise data.seq_len to keep them, or set data.drop_empty = false to refuse such data",
            s.n_without_targets,
            data::sft::line_list(ds.dropped_lines())
        );
    }
}

/// The sampler of a resolved batch (drawing from the mixture of
/// `data.sources` when the samples are theirs).
pub(super) fn sampler_for(cfg: &Config, batch: &ResolvedBatch, train: &Samples) -> Result<Sampler> {
    let shape =
        BatchShape { micro: batch.micro, accumulation_steps: batch.accumulation_steps, world_size: batch.world_size };
    let sampler = Sampler::new(train.n_samples(), shape, cfg.data.shuffle, cfg.data.drop_last, cfg.train.seed)?;
    Ok(sampler.with_mixture(super::sources::mixture_of(cfg, train)?))
}

/// This rank's K micro-batches of global step `step_idx` (an error names a
/// token file that cannot be read any more).
pub fn rank_batches(
    plan: &Plan,
    sampler: &Sampler,
    order: &EpochOrder,
    step_in_epoch: usize,
    rank: usize,
) -> Result<Vec<TokenBatch>> {
    (0..sampler.shape().accumulation_steps)
        .map(|k| Ok(plan.train.batch(&sampler.micro_batch(order, step_in_epoch, k, rank))?))
        .collect()
}

/// The names `prepare` writes into its output folder.
const OUTPUTS: [&str; 4] = ["train.bin", "val.bin", TokenFileMeta::FILE, "train.bin.partial"];

/// The text files of a folder (or the file itself), as
/// [`data::text_files`] lists them (recursively, in path order, dot-names
/// skipped, links to folders not followed), less the outputs of `prepare`
/// (`train.bin`, `val.bin`, `meta.json` beside a prepare `meta.json`): each
/// entry left out is named on stderr.
pub fn text_files(input: &Path) -> Result<Vec<PathBuf>> {
    let listed = data::text_files(input)?;
    for (p, why) in &listed.skipped {
        eprintln!("skipped {}: {why}", p.display());
    }
    let is_output = |p: &Path| {
        let named = p.file_name().and_then(|n| n.to_str()).is_some_and(|n| OUTPUTS.contains(&n));
        named && matches!(TokenFileMeta::beside(p), Ok(Some(_)))
    };
    let (outputs, files): (Vec<PathBuf>, Vec<PathBuf>) = listed.files.into_iter().partition(|p| is_output(p));
    for p in &outputs {
        eprintln!("skipped {}: an output of macrobatch prepare (token ids, not text)", p.display());
    }
    Ok(files)
}

/// The UTF-8 text of the file or folder `path` (its [`text_files`]) through
/// `tokenizer`, each file one document: how `train` and `eval` read text.
pub fn text_corpus(path: &Path, tokenizer: &Tokenizer, vocab: usize) -> Result<Corpus> {
    let corpus = Corpus::load_files(&path.display().to_string(), &text_files(path)?, tokenizer)?;
    corpus.check_vocab(vocab)?;
    Ok(corpus)
}

/// Training and validation preference pairs (`train.objective = "dpo"`)
/// of the JSON Lines file `path`.
fn pair_samples(cfg: &Config, tokenizer: &Tokenizer, seq_len: usize, path: &str) -> Result<(Samples, Samples)> {
    let d = &cfg.data;
    let opts = SftOptions { max_len: Some(seq_len), pack_seq_len: None, drop_empty: d.drop_empty };
    let load = |path: &str| -> Result<PairDataset> {
        let ds = PairDataset::load(Path::new(path), tokenizer, &opts)?;
        let dropped = ds.dropped_lines();
        if !dropped.is_empty() {
            eprintln!(
                "warning: {path}: dropped {} preference pairs with a reply that keeps no target once cut to data.seq_len = {seq_len}: lines {}",
                dropped.len(),
                data::sft::line_list(&dropped)
            );
        }
        Ok(ds)
    };
    let (train, val) = match d.val_path.as_deref() {
        Some(v) => (load(path)?, load(v)?),
        None => load(path)?.split_tail(d.val_fraction)?,
    };
    Ok((Samples::Pairs(train), Samples::Pairs(val)))
}
