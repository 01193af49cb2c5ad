//! `data.sources` through the command line: two sources of different
//! formats mixed by weight train, stop and resume bit for bit, the
//! checkpoint records the mixture's position and a resume under other
//! weights is refused; `data.sources` beside `data.path` or
//! `data.val_path` is refused before any run folder exists.

mod common;
use common::*;
use std::path::Path;

const CORPUS: &str = include_str!("../../../data/moby-dick.txt");

/// A text source (bytes 0..20000 of the corpus, byte tokens) and a JSON
/// Lines source of `text` lines (the next 6000 bytes, 120 bytes a line).
fn write_sources(dir: &Path) -> (String, String) {
    std::fs::create_dir_all(dir).unwrap();
    let text = dir.join("a.txt");
    std::fs::write(&text, &CORPUS.as_bytes()[..20000]).unwrap();
    let lines: Vec<String> = CORPUS.as_bytes()[20000..26000]
        .chunks(120)
        .map(|c| serde_json::json!({ "text": String::from_utf8_lossy(c) }).to_string())
        .collect();
    let jsonl = dir.join("b.jsonl");
    std::fs::write(&jsonl, lines.join("\n")).unwrap();
    (text.display().to_string(), jsonl.display().to_string())
}

fn sources_set(a: &str, b: &str, wb: f64) -> String {
    format!("data.sources=[{{path=\"{a}\", weight=1.0}}, {{path=\"{b}\", weight={wb}, val_fraction=0.2}}]")
}

fn sets(sources: &str) -> Vec<&str> {
    let mut s = SMALL.to_vec();
    s.extend(["batch.micro=4", "batch.accumulation_steps=2", "train.steps=12", "train.eval_every=4"]);
    s.extend(["train.checkpoint_every=4", "train.keep_checkpoints=0", "train.threads=1", sources]);
    s
}

fn loss_text(out: &Path) -> Vec<String> {
    metrics(out).iter().map(|r| format!("{} {}", r["loss"], r["val_loss"])).collect()
}

#[test]
fn a_mixture_resumes_bit_for_bit_and_records_its_position() {
    let dir = tmp("mix-data");
    let (a, b) = write_sources(&dir);
    let mix = sources_set(&a, &b, 3.0);
    let (straight, resumed) = (tmp("mix-straight"), tmp("mix-resumed"));
    let o = train(&straight, &sets(&mix));
    assert!(o.status.success(), "{}", stderr(&o));
    let mut c = bin();
    c.arg("train").arg("--out").arg(&resumed).args(["--stop-after", "4"]);
    with_sets(&mut c, &sets(&mix));
    let o = c.output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    // the checkpoint of step 4 says how many samples each source gave: 4 steps of G = 8
    let state: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(resumed.join("checkpoints/step-00000004/trainer_state.json")).unwrap(),
    )
    .unwrap();
    let drawn: Vec<u64> = state["mixture_drawn"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
    assert_eq!(drawn.len(), 2);
    assert_eq!(drawn.iter().sum::<u64>(), 4 * 8, "{drawn:?}");
    let o = resume(&resumed, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(loss_text(&straight), loss_text(&resumed), "every logged loss identical");
    assert_eq!(weights(&straight), weights(&resumed), "final parameters identical bit for bit");
    // other weights draw another mixture: refused, naming data.sources
    let (_, _) = (
        std::fs::remove_dir_all(resumed.join("checkpoints/step-00000012")),
        std::fs::remove_dir_all(resumed.join("checkpoints/step-00000008")),
    );
    let other = sources_set(&a, &b, 1.0);
    let o = resume(&resumed, &[other.as_str()]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("data.sources as configured now draws"), "{}", stderr(&o));
    for d in [&dir, &straight, &resumed] {
        let _ = std::fs::remove_dir_all(d);
    }
}

#[test]
fn sources_beside_path_or_val_path_are_refused() {
    let dir = tmp("mix-refused");
    let (a, b) = write_sources(&dir);
    let mix = sources_set(&a, &b, 2.0);
    let out = dir.join("run");
    let path = format!("data.path=\"{a}\"");
    let o = train(&out, &sets_with(&mix, &path));
    assert!(stderr(&o).contains("give either data.path (one file) or data.sources"), "{}", stderr(&o));
    let val = format!("data.val_path=\"{b}\"");
    let o = train(&out, &sets_with(&mix, &val));
    assert!(
        stderr(&o).contains("data.val_path") && stderr(&o).contains("does not combine with data.sources"),
        "{}",
        stderr(&o)
    );
    let zero = format!("data.sources=[{{path=\"{a}\", weight=0.0}}]");
    let o = train(&out, &sets(&zero));
    assert!(stderr(&o).contains("[0] weight = 0: a weight must be finite and > 0"), "{}", stderr(&o));
    assert!(!out.exists(), "refused before the run folder is made");
    let _ = std::fs::remove_dir_all(&dir);
}

fn sets_with<'a>(sources: &'a str, extra: &'a str) -> Vec<&'a str> {
    let mut s = sets(sources);
    s.push(extra);
    s
}
