//! Tables of examples: Parquet files and Arrow IPC streams as Hugging Face
//! `datasets` writes them (`Dataset.to_parquet`, `Dataset.save_to_disk`),
//! read into the rows the JSON Lines path reads.
//!
//! Every row becomes a JSON object of its columns (a `null` cell left out,
//! so a table written from lines of several schemas tells each row's
//! schema by the keys it has, as a JSON line does), lists as arrays and
//! structs as objects. A table whose only schema column is `text` (or read
//! as `data.schema = "text"`) is a corpus: each row one document, joined
//! with the tokenizer's EOS and cut into windows like text files. Any other
//! table is fine-tuning examples, masked as JSON Lines are
//! ([`crate::sft`]).
//!
//! Parquet is read through the `parquet` crate's row API, built with the
//! codecs pyarrow and `datasets` write by default (snappy) and gzip;
//! another codec is an error naming it and the column. Arrow files are
//! IPC *streams* (what `datasets` writes), uncompressed.

use crate::dataset::{Corpus, DataFormat};
use crate::error::DataError;
use crate::samples::Samples;
use crate::schemas::{Line, Schema};
use crate::sft::{SftDataset, SftOptions};
use crate::tokenizer::Tokenizer;
use arrow_array::cast::AsArray;
use arrow_array::types::{
    Float32Type, Float64Type, Int16Type, Int32Type, Int64Type, Int8Type, UInt16Type, UInt32Type, UInt64Type, UInt8Type,
};
use arrow_array::Array;
use arrow_schema::DataType;
use parquet::basic::Compression;
use parquet::file::reader::{FileReader, SerializedFileReader};
use serde_json::{Map, Value};
use std::path::{Path, PathBuf};

/// The rows of one file of a table.
#[derive(Debug, Clone)]
pub struct TableFile {
    /// The file.
    pub path: PathBuf,
    /// Its top-level column names, in schema order.
    pub columns: Vec<String>,
    /// Its rows, each an object of its non-null cells.
    pub rows: Vec<Value>,
}

/// A table read whole: its files in order.
#[derive(Debug, Clone)]
pub struct Table {
    /// What was asked for (a file or a folder).
    pub path: PathBuf,
    /// The files, in the order their rows are read.
    pub files: Vec<TableFile>,
}

/// What a table holds once read.
#[derive(Debug, Clone)]
pub enum TableData {
    /// Documents of a `text` column, tokenized and joined with EOS.
    Corpus(Corpus),
    /// Fine-tuning examples.
    Examples(SftDataset),
}

impl Table {
    /// Reads the table at `path` in `format` (`parquet` or `arrow`): a
    /// file, or a folder — a `datasets` `save_to_disk` folder (its
    /// `state.json` lists the files), else every `.parquet` / `.arrow` file
    /// in it, in name order.
    pub fn read(path: &Path, format: DataFormat) -> Result<Self, DataError> {
        let files = table_files(path, format)?;
        let files = files
            .into_iter()
            .map(|f| match format {
                DataFormat::Arrow => read_arrow(&f),
                _ => read_parquet(&f),
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self { path: path.into(), files })
    }

    /// Rows in all files.
    pub fn n_rows(&self) -> usize {
        self.files.iter().map(|f| f.rows.len()).sum()
    }

    /// Every row with where it came from (file, 1-based row): what the
    /// example builder reads in place of JSON lines.
    pub(crate) fn rows(&self) -> impl Iterator<Item = Result<(Line<'_>, Value), DataError>> + '_ {
        self.files
            .iter()
            .flat_map(|f| f.rows.iter().enumerate().map(|(i, v)| Ok((Line { path: &f.path, line: i + 1 }, v.clone()))))
    }

    /// Whether the table is a corpus of documents: read as `text`, or
    /// (`auto`) no file has a column set of another schema and the `text`
    /// column is there. Errors when a file has no column set of any schema
    /// (or of the forced one), naming the columns it has.
    pub fn is_corpus(&self, schema: Schema) -> Result<bool, DataError> {
        let mut corpus = true;
        for f in &self.files {
            let has = |k: &str| f.columns.iter().any(|c| c == k);
            let fitting = Schema::fitting(&has);
            let ok = match schema {
                Schema::Auto => !fitting.is_empty(),
                forced => fitting.contains(&forced),
            };
            if !ok {
                return Err(DataError::MissingColumns {
                    path: f.path.clone(),
                    expected: Schema::describe_columns(schema),
                    found: if f.columns.is_empty() { "none".into() } else { f.columns.join(", ") },
                });
            }
            corpus &= match schema {
                Schema::Auto => fitting == [Schema::Text],
                forced => forced == Schema::Text,
            };
        }
        Ok(corpus)
    }

    /// The table as a corpus (each row's `text` one document, EOS between)
    /// or as fine-tuning examples in `schema` ([`Self::is_corpus`] tells
    /// which).
    pub fn load(&self, tok: &Tokenizer, opts: &SftOptions, schema: Schema) -> Result<TableData, DataError> {
        if !self.is_corpus(schema)? {
            return Ok(TableData::Examples(SftDataset::from_rows(&self.path, self.rows(), tok, opts, schema)?));
        }
        let docs = self.rows().map(|row| {
            let (at, v) = row?;
            match v.get("text") {
                Some(Value::String(s)) => Ok(s.clone()),
                _ => Err(at.bad("\"text\" must be a string")),
            }
        });
        let name = self.path.display().to_string();
        Ok(TableData::Corpus(Corpus::from_documents(&name, docs, tok)?))
    }
}

/// The files of a table at `path`: the file itself, the files a
/// `save_to_disk` folder's `state.json` lists, or the folder's files with
/// the format's extension in name order. A `DatasetDict` folder is an
/// error naming its splits.
fn table_files(path: &Path, format: DataFormat) -> Result<Vec<PathBuf>, DataError> {
    let meta = std::fs::metadata(path).map_err(|source| DataError::Read { path: path.into(), source })?;
    if !meta.is_dir() {
        return Ok(vec![path.into()]);
    }
    let bad = |problem: String| DataError::Table { path: path.into(), problem };
    if let Ok(text) = std::fs::read_to_string(path.join("dataset_dict.json")) {
        let splits = serde_json::from_str::<Value>(&text)
            .ok()
            .and_then(|v| v.get("splits").and_then(Value::as_array).cloned())
            .unwrap_or_default();
        let names: Vec<String> = splits.iter().filter_map(|s| s.as_str().map(String::from)).collect();
        return Err(bad(format!(
            "a DatasetDict folder (splits: {}); give one split's folder, e.g. {}",
            names.join(", "),
            path.join(names.first().map_or("train", String::as_str)).display()
        )));
    }
    if let Ok(text) = std::fs::read_to_string(path.join("state.json")) {
        let v: Value = serde_json::from_str(&text).map_err(|e| bad(format!("state.json is not JSON: {e}")))?;
        let listed = v.get("_data_files").and_then(Value::as_array).ok_or_else(|| {
            bad("state.json lists no \"_data_files\" (is it a `datasets` save_to_disk folder?)".into())
        })?;
        return listed
            .iter()
            .map(|f| {
                f.get("filename")
                    .and_then(Value::as_str)
                    .map(|n| path.join(n))
                    .ok_or_else(|| bad("a state.json \"_data_files\" entry has no \"filename\"".into()))
            })
            .collect();
    }
    let ext = format.name();
    let mut files = Vec::new();
    for entry in std::fs::read_dir(path).map_err(|source| DataError::Read { path: path.into(), source })? {
        let p = entry.map_err(|source| DataError::Read { path: path.into(), source })?.path();
        if p.extension().is_some_and(|e| e.eq_ignore_ascii_case(ext)) {
            files.push(p);
        }
    }
    files.sort();
    if files.is_empty() {
        return Err(bad(format!("holds no .{ext} file and no state.json")));
    }
    Ok(files)
}

/// Codecs this build decodes.
fn codec_supported(c: Compression) -> bool {
    matches!(c, Compression::UNCOMPRESSED | Compression::SNAPPY | Compression::GZIP(_))
}

/// A Parquet file's rows. Every column chunk's codec is checked first, so
/// an unsupported one is named (with its column) before any page is read.
fn read_parquet(path: &Path) -> Result<TableFile, DataError> {
    let bad = |problem: String| DataError::Table { path: path.into(), problem };
    let file = std::fs::File::open(path).map_err(|source| DataError::Read { path: path.into(), source })?;
    let reader = SerializedFileReader::new(file).map_err(|e| bad(format!("not a Parquet file: {e}")))?;
    let meta = reader.metadata();
    for rg in meta.row_groups() {
        for col in rg.columns() {
            if !codec_supported(col.compression()) {
                return Err(DataError::UnsupportedCodec {
                    path: path.into(),
                    codec: format!("{:?}", col.compression()),
                    column: col.column_path().string(),
                });
            }
        }
    }
    let columns =
        meta.file_metadata().schema_descr().root_schema().get_fields().iter().map(|f| f.name().into()).collect();
    let rows_iter = reader.get_row_iter(None).map_err(|e| bad(e.to_string()))?;
    let mut rows = Vec::with_capacity(meta.file_metadata().num_rows().max(0) as usize);
    for row in rows_iter {
        let row = row.map_err(|e| bad(format!("row {}: {e}", rows.len() + 1)))?;
        rows.push(without_nulls(row.to_json_value()));
    }
    Ok(TableFile { path: path.into(), columns, rows })
}

/// An object without its `null` members (a row's missing cells).
fn without_nulls(v: Value) -> Value {
    match v {
        Value::Object(m) => Value::Object(m.into_iter().filter(|(_, v)| !v.is_null()).collect()),
        v => v,
    }
}

/// An Arrow IPC stream's rows.
fn read_arrow(path: &Path) -> Result<TableFile, DataError> {
    let bad = |problem: String| DataError::Table { path: path.into(), problem };
    let file = std::fs::File::open(path).map_err(|source| DataError::Read { path: path.into(), source })?;
    let reader = arrow_ipc::reader::StreamReader::try_new_buffered(file, None)
        .map_err(|e| bad(format!("not an Arrow IPC stream (as `datasets` writes): {e}")))?;
    let columns: Vec<String> = reader.schema().fields().iter().map(|f| f.name().clone()).collect();
    let mut rows = Vec::new();
    for batch in reader {
        let batch = batch.map_err(|e| bad(format!("after row {}: {e}", rows.len())))?;
        let schema = batch.schema();
        for i in 0..batch.num_rows() {
            let mut obj = Map::new();
            for (field, col) in schema.fields().iter().zip(batch.columns()) {
                let v = cell(col.as_ref(), i).map_err(|t| {
                    bad(format!("column \"{}\" holds {t}, which this reader does not convert", field.name()))
                })?;
                if !v.is_null() {
                    obj.insert(field.name().clone(), v);
                }
            }
            rows.push(Value::Object(obj));
        }
    }
    Ok(TableFile { path: path.into(), columns, rows })
}

/// Element `i` of an Arrow array as JSON: strings, numbers, booleans,
/// lists and structs (what `datasets` stores text and chats in); another
/// type is an error naming it.
fn cell(a: &dyn Array, i: usize) -> Result<Value, String> {
    if a.is_null(i) {
        return Ok(Value::Null);
    }
    let num = |x: f64| serde_json::Number::from_f64(x).map_or(Value::Null, Value::Number);
    Ok(match a.data_type() {
        DataType::Null => Value::Null,
        DataType::Boolean => Value::Bool(a.as_boolean().value(i)),
        DataType::Utf8 => Value::String(a.as_string::<i32>().value(i).into()),
        DataType::LargeUtf8 => Value::String(a.as_string::<i64>().value(i).into()),
        DataType::Utf8View => Value::String(a.as_string_view().value(i).into()),
        DataType::Int8 => a.as_primitive::<Int8Type>().value(i).into(),
        DataType::Int16 => a.as_primitive::<Int16Type>().value(i).into(),
        DataType::Int32 => a.as_primitive::<Int32Type>().value(i).into(),
        DataType::Int64 => a.as_primitive::<Int64Type>().value(i).into(),
        DataType::UInt8 => a.as_primitive::<UInt8Type>().value(i).into(),
        DataType::UInt16 => a.as_primitive::<UInt16Type>().value(i).into(),
        DataType::UInt32 => a.as_primitive::<UInt32Type>().value(i).into(),
        DataType::UInt64 => a.as_primitive::<UInt64Type>().value(i).into(),
        DataType::Float32 => num(a.as_primitive::<Float32Type>().value(i) as f64),
        DataType::Float64 => num(a.as_primitive::<Float64Type>().value(i)),
        DataType::List(_) => list(a.as_list::<i32>().value(i).as_ref())?,
        DataType::LargeList(_) => list(a.as_list::<i64>().value(i).as_ref())?,
        DataType::Struct(fields) => {
            let s = a.as_struct();
            let mut obj = Map::new();
            for (f, col) in fields.iter().zip(s.columns()) {
                obj.insert(f.name().clone(), cell(col.as_ref(), i)?);
            }
            Value::Object(obj)
        }
        other => return Err(format!("values of type {other}")),
    })
}

fn list(a: &dyn Array) -> Result<Value, String> {
    (0..a.len()).map(|j| cell(a, j)).collect::<Result<Vec<_>, _>>().map(Value::Array)
}

impl TableData {
    /// (training, validation) of a table read whole: a corpus's last
    /// `val_fraction` of tokens or the examples' last `val_fraction` (as
    /// `text` and `jsonl` files split); a corpus's tokens checked against
    /// `vocab_size`.
    pub fn split(self, val_fraction: f64, seq_len: usize, vocab_size: usize) -> Result<(Samples, Samples), DataError> {
        match self {
            TableData::Corpus(c) => {
                c.check_vocab(vocab_size)?;
                let (train, val) = c.split(val_fraction, seq_len)?;
                Ok((Samples::Windows(train), Samples::Windows(val)))
            }
            TableData::Examples(ds) => {
                let (train, val) = ds.split_tail(val_fraction)?;
                Ok((Samples::Examples(train), Samples::Examples(val)))
            }
        }
    }

    /// All of it as the samples of one split (`split` names it in errors).
    pub fn whole(self, split: &'static str, seq_len: usize, vocab_size: usize) -> Result<Samples, DataError> {
        match self {
            TableData::Corpus(c) => {
                c.check_vocab(vocab_size)?;
                Ok(Samples::Windows(c.split_all(split, seq_len)?))
            }
            TableData::Examples(ds) => Ok(Samples::Examples(ds)),
        }
    }
}

#[cfg(test)]
mod tests;
