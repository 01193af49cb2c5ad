//! Tables written by `datasets` and pyarrow (scripts/data_tables_write.py)
//! read into the examples their JSON Lines give; bad tables name what is
//! wrong. Skipped, with a note, where python3 cannot import datasets and
//! pyarrow, unless `MACROBATCH_REQUIRE_PYTHON=1` (CI), where that fails.

use super::*;
use crate::sft::tests::byte_chatml;
use crate::sft::Example;

/// The tables the script writes, in a folder of this process (`None`:
/// skipped).
fn written(test: &str) -> Option<PathBuf> {
    let ok = std::process::Command::new("python3")
        .args(["-c", "import datasets, pyarrow"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        assert!(
            std::env::var("MACROBATCH_REQUIRE_PYTHON").as_deref() != Ok("1"),
            "MACROBATCH_REQUIRE_PYTHON=1 but python3 cannot import datasets and pyarrow"
        );
        println!("{test} skipped: python3 cannot import datasets and pyarrow");
        return None;
    }
    let dir = std::env::temp_dir().join(format!("macrobatch-tables-{test}-{}", std::process::id()));
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/data_tables_write.py");
    let out = std::process::Command::new("python3").arg(script).arg(&dir).output().unwrap();
    assert!(out.status.success(), "data_tables_write.py failed:\n{}", String::from_utf8_lossy(&out.stderr));
    Some(dir)
}

fn opts() -> SftOptions {
    SftOptions { max_len: Some(512), pack_seq_len: None, drop_empty: true }
}

fn examples_of_jsonl(path: &Path) -> Vec<Example> {
    SftDataset::load(path, &byte_chatml(), &opts()).unwrap().examples().to_vec()
}

fn load(path: &Path, format: DataFormat, schema: Schema) -> Result<TableData, DataError> {
    Table::read(path, format)?.load(&byte_chatml(), &opts(), schema)
}

fn examples(data: TableData) -> Vec<Example> {
    match data {
        TableData::Examples(ds) => ds.examples().to_vec(),
        TableData::Corpus(c) => panic!("{} read as a corpus", c.name),
    }
}

/// Every schema as Parquet (`to_parquet`, snappy) and as a `save_to_disk`
/// folder gives the examples — tokens and targets — of its JSON Lines
/// (`to_json`); the formats are told by the names; a `text` table is a
/// corpus whose documents are the lines' texts with EOS between.
#[test]
fn tables_read_as_their_json_lines() {
    let Some(dir) = written("as_jsonl") else { return };
    for name in ["messages", "alpaca", "sharegpt", "prompt_completion", "prompt_completion_chat"] {
        let want = examples_of_jsonl(&dir.join(format!("{name}.jsonl")));
        assert_eq!(want.len(), 8, "{name}: the script writes 8 rows");
        for (path, format) in [
            (dir.join(format!("{name}.parquet")), DataFormat::Parquet),
            (dir.join(format!("{name}_disk")), DataFormat::Arrow),
        ] {
            assert_eq!(DataFormat::detect(&path).unwrap(), format, "{}", path.display());
            assert_eq!(DataFormat::Text.resolved_for(Some(&path)), format);
            let got = examples(load(&path, format, Schema::Auto).unwrap());
            assert_eq!(got, want, "{}", path.display());
        }
    }
    // alpaca forced, and a forced schema the columns do not have
    let forced = examples(load(&dir.join("alpaca.parquet"), DataFormat::Parquet, Schema::Alpaca).unwrap());
    assert_eq!(forced, examples_of_jsonl(&dir.join("alpaca.jsonl")));
    let e = load(&dir.join("messages.parquet"), DataFormat::Parquet, Schema::Alpaca).unwrap_err().to_string();
    assert!(
        e.contains("no columns of \"instruction\" and \"output\"") && e.contains("its columns are: messages"),
        "{e}"
    );
    // text: documents joined with EOS, as text files are
    let texts: Vec<String> = std::fs::read_to_string(dir.join("text.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap()["text"].as_str().unwrap().to_string())
        .collect();
    let want = Corpus::from_documents("t", texts.iter().map(Ok::<_, DataError>), &byte_chatml()).unwrap().tokens;
    for (path, format) in [(dir.join("text.parquet"), DataFormat::Parquet), (dir.join("text_disk"), DataFormat::Arrow)]
    {
        match load(&path, format, Schema::Auto).unwrap() {
            TableData::Corpus(c) => assert_eq!(c.tokens, want, "{}", path.display()),
            TableData::Examples(_) => panic!("{} read as examples", path.display()),
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// pyarrow's own writes: an IPC stream of large_string / large_list
/// columns in two record batches, and gzip Parquet, read as the messages
/// lines; an `id` column beside them is ignored.
#[test]
fn large_types_batches_and_gzip() {
    let Some(dir) = written("large") else { return };
    let want = examples_of_jsonl(&dir.join("messages.jsonl"));
    assert_eq!(examples(load(&dir.join("large.arrow"), DataFormat::Arrow, Schema::Auto).unwrap()), want);
    assert_eq!(examples(load(&dir.join("gzip.parquet"), DataFormat::Parquet, Schema::Auto).unwrap()), want);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Bad tables are errors naming the file and what is wrong: a codec this
/// build lacks (and its column), columns of no schema (and the columns
/// found), a DatasetDict folder (and its splits), a file that is not a
/// table.
#[test]
fn bad_tables_name_the_problem() {
    let Some(dir) = written("bad") else { return };
    let e = Table::read(&dir.join("zstd.parquet"), DataFormat::Parquet).unwrap_err().to_string();
    assert!(e.contains("compressed with ZSTD") && e.contains("column \"id\""), "{e}");
    let e = load(&dir.join("columns.parquet"), DataFormat::Parquet, Schema::Auto).unwrap_err().to_string();
    assert!(e.contains("its columns are: question, answer"), "{e}");
    assert!(e.contains("\"text\" (a string)") && e.contains("\"messages\""), "{e}");
    let e = Table::read(&dir.join("dict_disk"), DataFormat::Arrow).unwrap_err().to_string();
    assert!(e.contains("a DatasetDict folder (splits: train, test)") && e.contains("dict_disk/train"), "{e}");
    let e = Table::read(&dir.join("messages.jsonl"), DataFormat::Parquet).unwrap_err().to_string();
    assert!(e.contains("messages.jsonl: not a Parquet file"), "{e}");
    let e = Table::read(&dir.join("messages.parquet"), DataFormat::Arrow).unwrap_err().to_string();
    assert!(e.contains("not an Arrow IPC stream"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}
