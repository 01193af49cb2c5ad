//! TensorBoard event files of `train`: every number of every
//! `metrics.jsonl` line is a scalar at its step with the line's value as
//! f32, and a reader sees no step twice after a crash and a `--resume`.
//!
//! Checked twice: by a reader here (the framing, both CRCs of every record,
//! the protobuf fields, TensorBoard's rule that a SessionLog START drops
//! the steps at and after it read before), and by TensorBoard's own
//! `EventAccumulator` (scripts/tensorboard_check.py), skipped with a note
//! when python3 cannot import tensorboard unless MACROBATCH_REQUIRE_PYTHON=1.
//!
//! Values are compared exactly: the writer stores `float32(x)` of each
//! number `x` of the line (TensorBoard's `simple_value` is a float), so the
//! reader must find that f32 bit for bit.

mod common;

use common::*;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The event format's CRC mask: rotate right by 15 bits, add 0xa282ead8.
fn mask(crc: u32) -> u32 {
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// The records of an event file, each record's two CRCs checked.
fn records(path: &Path) -> Vec<Vec<u8>> {
    let bytes = std::fs::read(path).unwrap();
    let mut out = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        assert!(bytes.len() - at >= 12, "{}: a torn header at byte {at}", path.display());
        let len_bytes = &bytes[at..at + 8];
        let len = u64::from_le_bytes(len_bytes.try_into().unwrap()) as usize;
        let len_crc = u32::from_le_bytes(bytes[at + 8..at + 12].try_into().unwrap());
        assert_eq!(len_crc, mask(crc32c::crc32c(len_bytes)), "{}: length CRC at byte {at}", path.display());
        let data = &bytes[at + 12..at + 12 + len];
        let data_crc = u32::from_le_bytes(bytes[at + 12 + len..at + 16 + len].try_into().unwrap());
        assert_eq!(data_crc, mask(crc32c::crc32c(data)), "{}: data CRC at byte {at}", path.display());
        out.push(data.to_vec());
        at += 16 + len;
    }
    out
}

/// A protobuf field's value.
enum Field<'a> {
    Varint(u64),
    Fixed64([u8; 8]),
    Fixed32([u8; 4]),
    Len(&'a [u8]),
}

fn varint(b: &[u8], at: &mut usize) -> u64 {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let byte = b[*at];
        *at += 1;
        v |= u64::from(byte & 0x7f) << shift;
        if byte < 0x80 {
            return v;
        }
    }
    panic!("varint longer than 10 bytes")
}

/// The fields of a protobuf message, in order.
fn fields(b: &[u8]) -> Vec<(u64, Field<'_>)> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < b.len() {
        let key = varint(b, &mut at);
        let field = match key & 7 {
            0 => Field::Varint(varint(b, &mut at)),
            1 => {
                at += 8;
                Field::Fixed64(b[at - 8..at].try_into().unwrap())
            }
            2 => {
                let len = varint(b, &mut at) as usize;
                at += len;
                Field::Len(&b[at - len..at])
            }
            5 => {
                at += 4;
                Field::Fixed32(b[at - 4..at].try_into().unwrap())
            }
            w => panic!("wire type {w}"),
        };
        out.push((key >> 3, field));
    }
    out
}

/// What a reader needs of one `Event`.
#[derive(Default)]
struct Event {
    wall_time: f64,
    step: u64,
    file_version: Option<String>,
    session_start: bool,
    values: Vec<(String, f32)>,
}

fn event(data: &[u8]) -> Event {
    let mut e = Event::default();
    for (n, f) in fields(data) {
        match (n, f) {
            (1, Field::Fixed64(b)) => e.wall_time = f64::from_le_bytes(b),
            (2, Field::Varint(v)) => e.step = v,
            (3, Field::Len(s)) => e.file_version = Some(String::from_utf8(s.to_vec()).unwrap()),
            (5, Field::Len(summary)) => {
                for (n, f) in fields(summary) {
                    let (1, Field::Len(value)) = (n, f) else { panic!("Summary field {n}") };
                    let (mut tag, mut v) = (None, None);
                    for (n, f) in fields(value) {
                        match (n, f) {
                            (1, Field::Len(t)) => tag = Some(String::from_utf8(t.to_vec()).unwrap()),
                            (2, Field::Fixed32(b)) => v = Some(f32::from_le_bytes(b)),
                            (n, _) => panic!("Summary.Value field {n}"),
                        }
                    }
                    e.values.push((tag.expect("a tag"), v.expect("a simple_value")));
                }
            }
            (7, Field::Len(log)) => {
                e.session_start = fields(log).iter().any(|(n, f)| *n == 1 && matches!(f, Field::Varint(1)));
            }
            (n, _) => panic!("Event field {n}"),
        }
    }
    e
}

/// The event files of `dir` in name order (the order readers take them).
fn event_files(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with("events.out.tfevents."))
        .collect();
    v.sort();
    v
}

type Series = BTreeMap<String, BTreeMap<u64, f32>>;

/// Every scalar series of `dir` as TensorBoard shows it: files in name
/// order, each opening with its version; a START at step s drops what was
/// read at steps ≥ s; a step read twice otherwise is an error. Also
/// returns how many scalars the START events dropped.
fn read_series(dir: &Path) -> (Series, usize) {
    let mut series = Series::new();
    let mut dropped = 0;
    for path in event_files(dir) {
        let events: Vec<Event> = records(&path).iter().map(|d| event(d)).collect();
        assert_eq!(events[0].file_version.as_deref(), Some("brain.Event:2"), "{}", path.display());
        for e in &events[1..] {
            assert!(e.wall_time > 1.6e9, "wall time {} is seconds since 1970", e.wall_time);
            if e.session_start {
                for steps in series.values_mut() {
                    let before = steps.len();
                    steps.retain(|s, _| *s < e.step);
                    dropped += before - steps.len();
                }
            }
            for (tag, v) in &e.values {
                let old = series.entry(tag.clone()).or_default().insert(e.step, *v);
                assert!(old.is_none(), "{tag} at step {} twice in {}", e.step, path.display());
            }
        }
    }
    (series, dropped)
}

/// The tag of a `metrics.jsonl` field: `G_rest` → `G/rest` for the groups
/// below, `train/f` for the others (docs: README's TensorBoard section).
fn tag(field: &str) -> String {
    match field.split_once('_') {
        Some((g, rest)) if ["val", "mem", "comm", "pipeline", "p2p", "tp"].contains(&g) => format!("{g}/{rest}"),
        _ => format!("train/{field}"),
    }
}

/// Every series `metrics.jsonl` says there should be: each number, boolean
/// (0/1) and list item of each line but `step`, as f32.
fn expected_series(run: &Path) -> Series {
    let mut series = Series::new();
    for line in metrics(run) {
        let step = line["step"].as_u64().unwrap();
        for (name, v) in line.as_object().unwrap().iter().filter(|(n, _)| *n != "step") {
            let items: Vec<(String, f64)> = match v {
                serde_json::Value::Number(n) => vec![(tag(name), n.as_f64().unwrap())],
                serde_json::Value::Bool(b) => vec![(tag(name), f64::from(u8::from(*b)))],
                serde_json::Value::Array(a) => a
                    .iter()
                    .enumerate()
                    .filter_map(|(i, x)| Some((format!("{}/{i}", tag(name)), x.as_f64()?)))
                    .collect(),
                _ => vec![],
            };
            for (t, x) in items {
                series.entry(t).or_default().insert(step, x as f32);
            }
        }
    }
    series
}

fn python_tensorboard() -> bool {
    let ok = Command::new("python3").args(["-c", "import tensorboard"]).output().is_ok_and(|o| o.status.success());
    assert!(
        ok || std::env::var("MACROBATCH_REQUIRE_PYTHON").as_deref() != Ok("1"),
        "MACROBATCH_REQUIRE_PYTHON=1 but python3 cannot import tensorboard"
    );
    ok
}

/// The tiny default with evaluation every 2 steps, checkpoints every 2.
fn sets<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    tiny(&[&["train.eval_every=2", "train.checkpoint_every=2", "train.tensorboard=true"], extra].concat())
}

#[test]
fn every_metrics_number_is_a_scalar_and_a_resume_after_a_crash_shows_no_step_twice() {
    let run = tmp("tensorboard-resume");
    // A crash at the start of step 6: steps 1-5 logged, the checkpoint at 4.
    let mut c = bin();
    c.arg("train").arg("--out").arg(&run).env("MACROBATCH_FAULT", "kind=kill,step=6");
    with_sets(&mut c, &sets(&["train.steps=8"]));
    let o = c.output().unwrap();
    assert!(!o.status.success(), "the run was killed: {}", stderr(&o));
    let tb = run.join("tensorboard");
    let (before, _) = read_series(&tb);
    assert_eq!(before["train/loss"].keys().copied().collect::<Vec<_>>(), [1, 2, 3, 4, 5], "every step flushed");

    let mut c = bin();
    c.arg("train").arg("--resume").arg(&run);
    let o = c.output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(event_files(&tb).len(), 2, "a resume writes a new file");

    let (got, dropped) = read_series(&tb);
    let want = expected_series(&run);
    assert_eq!(metrics(&run).len(), 8);
    // Step 5 of the crashed run (every series of it) is dropped by the START at 5.
    assert_eq!(dropped, before.values().filter(|s| s.contains_key(&5)).count());
    for t in ["train/loss", "val/loss", "train/lr", "train/grad_norm", "train/loss_scale", "train/tokens_per_s"] {
        assert!(got.contains_key(t), "{t} is logged: {:?}", got.keys());
    }
    for t in ["comm/s", "comm/bytes", "mem/params", "mem/predicted", "train/clipped", "train/micro_losses/1"] {
        assert!(got.contains_key(t), "{t} is logged: {:?}", got.keys());
    }
    assert_eq!(got["val/loss"].keys().copied().collect::<Vec<_>>(), [2, 4, 6, 8]);
    // Same tags, same steps, same f32 bits.
    assert_eq!(got.keys().collect::<Vec<_>>(), want.keys().collect::<Vec<_>>());
    for (t, steps) in &want {
        for (s, v) in steps {
            assert_eq!(got[t].get(s).map(|x| x.to_bits()), Some(v.to_bits()), "{t} at step {s}");
        }
        assert_eq!(got[t].len(), steps.len(), "{t}: no extra steps");
    }

    if python_tensorboard() {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/tensorboard_check.py");
        let o = Command::new("python3").arg(&script).arg(&run).output().unwrap();
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(o.status.success(), "{out}\n{}", String::from_utf8_lossy(&o.stderr));
        assert!(out.contains("0 mismatches"), "{out}");
        eprintln!("{}", out.trim_end());
        // The check can fail: metrics.jsonl with step 3's loss moved by 1e-6
        // of itself (about 8 f32 ulps) against the same log.
        let tampered = tmp("tensorboard-tampered");
        std::fs::create_dir_all(&tampered).unwrap();
        let lines: Vec<String> = metrics(&run)
            .into_iter()
            .map(|mut l| {
                if l["step"] == 3 {
                    l["loss"] = serde_json::json!(l["loss"].as_f64().unwrap() * (1.0 + 1e-6));
                }
                l.to_string()
            })
            .collect();
        std::fs::write(tampered.join("metrics.jsonl"), lines.join("\n") + "\n").unwrap();
        let o = Command::new("python3").arg(script).arg(&tampered).arg("--logdir").arg(&tb).output().unwrap();
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(!o.status.success() && out.contains("MISMATCH train/loss step 3"), "{out}");
        let _ = std::fs::remove_dir_all(&tampered);
    } else {
        eprintln!("skipped the EventAccumulator check: python3 cannot import tensorboard (pip install tensorboard)");
    }
    let _ = std::fs::remove_dir_all(&run);
}

#[test]
fn the_flag_names_the_folder_and_turns_the_log_on_and_the_default_is_off() {
    let run = tmp("tensorboard-flag");
    let elsewhere = tmp("tensorboard-flag-logs");
    let mut c = bin();
    c.arg("train").arg("--out").arg(&run).arg("--tensorboard").arg(&elsewhere);
    with_sets(&mut c, &tiny(&["train.steps=2"]));
    let o = c.output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!run.join("tensorboard").exists());
    let (got, _) = read_series(&elsewhere);
    assert_eq!(got, expected_series(&run));
    let resolved = std::fs::read_to_string(run.join("config.resolved.toml")).unwrap();
    assert!(resolved.contains("tensorboard = true"), "{resolved}");

    let plain = tmp("tensorboard-off");
    let o = train(&plain, &tiny(&["train.steps=1"]));
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!plain.join("tensorboard").exists(), "off unless asked for");
    for d in [run, elsewhere, plain] {
        let _ = std::fs::remove_dir_all(d);
    }
}

#[test]
fn a_tensorboard_path_that_cannot_be_a_folder_is_refused_before_the_first_step() {
    // Onto a file, and below one: refused with exit 2 before the run folder
    // exists, so nothing is left to clean up or resume.
    let file = tmp("tensorboard-onto-file");
    std::fs::write(&file, "mine\n").unwrap();
    for (target, needle) in [(file.clone(), "is a file, not a folder"), (file.join("logs"), "is a file, not a folder")]
    {
        let run = tmp("tensorboard-refused-run");
        let mut c = bin();
        c.arg("train").arg("--out").arg(&run).arg("--tensorboard").arg(&target);
        with_sets(&mut c, &tiny(&["train.steps=2"]));
        let err = fails(&c.output().unwrap(), needle);
        assert!(err.contains("--tensorboard"), "{err}");
        assert!(!run.exists(), "refused before the run folder was made: {err}");
    }
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "mine\n", "the user's file is untouched");
    let _ = std::fs::remove_file(file);
}

/// The disk fills up inside step 5's TensorBoard record, its
/// `metrics.jsonl` line already written: a clear error naming the event
/// file, which is cut back to its last whole record; the resume from step
/// 4's checkpoint logs steps 5-8 once each, equal to `metrics.jsonl`.
#[test]
fn a_full_disk_in_a_tensorboard_record_is_cut_back_and_the_resume_logs_each_step_once() {
    let straight = tmp("tensorboard-enospc-straight");
    let mut c = bin();
    c.arg("train").arg("--out").arg(&straight);
    with_sets(&mut c, &sets(&["train.steps=8"]));
    let o = c.output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    // Step 5's metrics line fits (its timings may be a few bytes longer in
    // the second run); the event record, hundreds of bytes, does not.
    let line5 = std::fs::read_to_string(straight.join("metrics.jsonl")).unwrap().lines().nth(4).unwrap().len() + 1;
    let run = tmp("tensorboard-enospc");
    let mut c = bin();
    c.arg("train").arg("--out").arg(&run).env("MACROBATCH_FAULT", format!("kind=enospc,step=5,bytes={}", line5 + 40));
    with_sets(&mut c, &sets(&["train.steps=8"]));
    let err = fails(&c.output().unwrap(), "No space left on device");
    assert!(err.contains("tfevents"), "the event file is named: {err}");
    let o = resume(&run, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let (got, _) = read_series(&run.join("tensorboard"));
    assert_eq!(got, expected_series(&run));
    assert_eq!(metrics(&run).len(), 8);
    for d in [straight, run] {
        let _ = std::fs::remove_dir_all(d);
    }
}
