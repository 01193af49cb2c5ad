//! TensorBoard event files: every number of each `metrics.jsonl` line as a
//! scalar at the line's optimizer step, written by rank 0 beside the metrics
//! (`RUN/tensorboard/`, or `train --tensorboard DIR`).
//!
//! **Tags.** A field `G_rest` whose `G` is one of [`GROUPS`] is `G/rest`
//! (`val_loss` → `val/loss`, `mem_peak_rss` → `mem/peak_rss`, `comm_s` →
//! `comm/s`, `pipeline_bubble` → `pipeline/bubble`, `tp_bytes` →
//! `tp/bytes`, `cp_bytes` → `cp/bytes`); any other field `f` is `train/f` (`train/loss`, `train/lr`,
//! `train/grad_norm`, `train/loss_scale`, `train/tokens_per_s`, …). A list
//! adds its index (`train/micro_losses/0`, `pipeline/idle_s/1`); booleans
//! (`clipped`, `skipped`) are 0 or 1; absent and null fields are not
//! written; `step` is the event's step. Values are the record's f64 (or
//! integer) cast to f32, TensorBoard's `simple_value`: a reader finds
//! exactly `float32(x)` for each number `x` of the line.
//!
//! **Format.** A file is a sequence of records: the data's length (u64
//! little-endian), the masked CRC32C of those 8 bytes, the data, the masked
//! CRC32C of the data (mask: the CRC rotated right by 15 bits plus
//! 0xa282ead8). Each record's data is a protobuf `Event`: the first carries
//! `file_version = "brain.Event:2"`, the next a `SessionLog` START at the
//! first step this process writes, then one `Event { wall_time, step,
//! summary { value { tag, simple_value } … } }` per step. Readers merge the
//! files of a folder in name order; a START tells TensorBoard's
//! `EventAccumulator` to drop every step at or after it read from earlier
//! files, so after `--resume` (a new file, its first step one after the
//! checkpoint) the steps a crashed run logged past its checkpoint are not
//! shown twice, as `metrics.jsonl` is cut back to the checkpoint.
//!
//! **Encoding by hand.** The three messages take a few lines of varint and
//! length-delimited fields. The crates that write TensorBoard files were not
//! light or well kept: `tensorboard-rs` 0.5.9 pulls the `protobuf` 2.x
//! major and `image` 0.23 for its image summaries; `tboard` 0.1.1 (one
//! release) generates its messages with `prost-build`, which needs `protoc`
//! at build time. The checksum comes from the `crc32c` crate.

use crate::metrics::StepRecord;
use anyhow::{anyhow, bail, Context, Result};
use serde_json::Value;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

/// Field-name prefixes that become a tag group of their own (see the
/// module's documentation); every other field is under `train/`.
pub const GROUPS: &[&str] = &["val", "mem", "comm", "pipeline", "p2p", "tp", "cp"];

/// The start of every event file's name: what TensorBoard looks for.
pub const FILE_PREFIX: &str = "events.out.tfevents.";

/// The tag of a `metrics.jsonl` field.
pub fn tag(field: &str) -> String {
    match field.split_once('_') {
        Some((group, rest)) if GROUPS.contains(&group) => format!("{group}/{rest}"),
        _ => format!("train/{field}"),
    }
}

/// The scalars of one `metrics.jsonl` record (a JSON object): every number,
/// boolean and list of numbers but `step`, tagged by [`tag`].
pub fn scalars(record: &Value) -> Vec<(String, f32)> {
    let named = |(field, item, x): (&str, Option<usize>, f64)| match item {
        None => (tag(field), x as f32),
        Some(i) => (format!("{}/{i}", tag(field)), x as f32),
    };
    crate::metrics::numbers(record).into_iter().map(named).collect()
}

/// Appends `v` as a protobuf varint.
pub fn varint(buf: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        buf.push((v as u8) | 0x80);
        v >>= 7;
    }
    buf.push(v as u8);
}

/// Protobuf wire types.
const VARINT: u64 = 0;
const FIXED64: u64 = 1;
const LEN: u64 = 2;
const FIXED32: u64 = 5;

fn key(buf: &mut Vec<u8>, field: u64, wire: u64) {
    varint(buf, (field << 3) | wire);
}

fn len_field(buf: &mut Vec<u8>, field: u64, data: &[u8]) {
    key(buf, field, LEN);
    varint(buf, data.len() as u64);
    buf.extend_from_slice(data);
}

/// `Event` fields (tensorflow/core/util/event.proto).
const EVENT_WALL_TIME: u64 = 1;
const EVENT_STEP: u64 = 2;
const EVENT_FILE_VERSION: u64 = 3;
const EVENT_SUMMARY: u64 = 5;
const EVENT_SESSION_LOG: u64 = 7;
/// `SessionLog.status` and its START value.
const SESSION_LOG_STATUS: u64 = 1;
const SESSION_START: u64 = 1;
/// `Summary.value`, `Summary.Value.tag` and `.simple_value`.
const SUMMARY_VALUE: u64 = 1;
const VALUE_TAG: u64 = 1;
const VALUE_SIMPLE: u64 = 2;

/// An `Event` with its wall time and step, to which one more field is added.
fn event(wall_time: f64, step: u64) -> Vec<u8> {
    let mut e = Vec::new();
    key(&mut e, EVENT_WALL_TIME, FIXED64);
    e.extend_from_slice(&wall_time.to_le_bytes());
    key(&mut e, EVENT_STEP, VARINT);
    varint(&mut e, step);
    e
}

/// The first event of a file: its format version.
pub fn file_version_event(wall_time: f64) -> Vec<u8> {
    let mut e = event(wall_time, 0);
    len_field(&mut e, EVENT_FILE_VERSION, b"brain.Event:2");
    e
}

/// A `SessionLog` START at `step`: readers drop what earlier files hold at
/// `step` and after.
pub fn session_start_event(wall_time: f64, step: u64) -> Vec<u8> {
    let mut log = Vec::new();
    key(&mut log, SESSION_LOG_STATUS, VARINT);
    varint(&mut log, SESSION_START);
    let mut e = event(wall_time, step);
    len_field(&mut e, EVENT_SESSION_LOG, &log);
    e
}

/// One step's scalars in one `Summary`.
pub fn scalars_event(wall_time: f64, step: u64, values: &[(String, f32)]) -> Vec<u8> {
    let mut summary = Vec::new();
    for (tag, v) in values {
        let mut value = Vec::new();
        len_field(&mut value, VALUE_TAG, tag.as_bytes());
        key(&mut value, VALUE_SIMPLE, FIXED32);
        value.extend_from_slice(&v.to_le_bytes());
        len_field(&mut summary, SUMMARY_VALUE, &value);
    }
    let mut e = event(wall_time, step);
    len_field(&mut e, EVENT_SUMMARY, &summary);
    e
}

/// The masked CRC32C of the event file format.
pub fn masked_crc(data: &[u8]) -> u32 {
    crc32c::crc32c(data).rotate_right(15).wrapping_add(0xa282_ead8)
}

/// Appends one record holding `data` to `out`.
pub fn frame(out: &mut Vec<u8>, data: &[u8]) {
    let len = (data.len() as u64).to_le_bytes();
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc(data).to_le_bytes());
}

/// Seconds since the Unix epoch.
fn now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

/// This machine's name, as TensorBoard's writers put it into file names.
fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: `buf` is valid for writes of its length, which is what
    // gethostname is told it may write.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    match String::from_utf8_lossy(&buf[..end]).replace('/', "_") {
        name if rc == 0 && !name.is_empty() => name,
        _ => "localhost".into(),
    }
}

/// The seconds in an event file's name, `events.out.tfevents.SECS.…`.
fn name_seconds(name: &str) -> Option<u64> {
    name.strip_prefix(FILE_PREFIX)?.split('.').next()?.parse().ok()
}

/// The name of a new event file in `dir`: `events.out.tfevents.SECS.HOST.PID.v2`
/// with SECS the current time, or one more than the newest file's there, so
/// the new file sorts after every file already in the folder (readers take
/// them in name order).
fn new_file_name(dir: &Path) -> Result<String> {
    let mut secs = now() as u64;
    for e in std::fs::read_dir(dir).with_context(|| format!("cannot read {}", dir.display()))? {
        let e = e.with_context(|| format!("cannot read {}", dir.display()))?;
        if let Some(s) = name_seconds(&e.file_name().to_string_lossy()) {
            secs = secs.max(s + 1);
        }
    }
    Ok(format!("{FILE_PREFIX}{secs}.{}.{}.v2", hostname(), std::process::id()))
}

/// Refuses a `--tensorboard` folder that cannot be one before anything
/// runs: the path or a folder above it is a file, or the nearest folder
/// that exists cannot be written (probed with a file created and removed
/// there). Otherwise the run would fail only at its first recorded step and
/// leave a folder that holds a checkpoint-less half-run.
pub fn check_writable(dir: &Path) -> Result<()> {
    let fix =
        "name a folder that can be created and written (or leave --tensorboard out for the run folder's tensorboard/)";
    let mut at = Some(dir);
    while let Some(p) = at {
        match std::fs::metadata(p) {
            Ok(m) if m.is_dir() => {
                let probe = p.join(format!(".macrobatch-write-probe-{}", std::process::id()));
                return match File::options().write(true).create_new(true).open(&probe) {
                    Ok(_) => {
                        let _ = std::fs::remove_file(&probe);
                        Ok(())
                    }
                    Err(e) => {
                        Err(anyhow!("--tensorboard {}: cannot write into {} ({e}); {fix}", dir.display(), p.display()))
                    }
                };
            }
            Ok(_) => bail!("--tensorboard {}: {} is a file, not a folder; {fix}", dir.display(), p.display()),
            // Absent, or below a file (ENOTDIR): the folder above says which.
            Err(e) if matches!(e.kind(), std::io::ErrorKind::NotFound | std::io::ErrorKind::NotADirectory) => {
                at = p.parent().filter(|q| !q.as_os_str().is_empty())
            }
            Err(e) => bail!("--tensorboard {}: cannot read {} ({e}); {fix}", dir.display(), p.display()),
        }
    }
    // A relative path whose every component is new goes into the working
    // folder.
    if dir == Path::new(".") {
        bail!("--tensorboard {}: the working folder cannot be read; {fix}", dir.display());
    }
    check_writable(Path::new("."))
}

/// One event file, written record by record.
pub struct EventWriter {
    /// Unbuffered: each step goes out in one write.
    file: File,
    path: PathBuf,
    /// Length up to the last complete step.
    len: u64,
}

impl EventWriter {
    /// A new event file in `dir` (created if absent), its version record
    /// written.
    pub fn create(dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
        let path = dir.join(new_file_name(dir)?);
        let file = File::options()
            .write(true)
            .create_new(true)
            .open(&path)
            .with_context(|| format!("cannot create {}", path.display()))?;
        let mut w = Self { file, path, len: 0 };
        w.write(&[file_version_event(now())])?;
        Ok(w)
    }

    /// The file's path.
    #[cfg(test)]
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends `events` in one write; a failed write is cut back to the
    /// last complete record before the error is returned.
    pub fn write(&mut self, events: &[Vec<u8>]) -> Result<()> {
        let mut bytes = Vec::new();
        for e in events {
            frame(&mut bytes, e);
        }
        if let Err(e) = nn::io::write_all_budgeted(&mut self.file, &bytes).and_then(|()| self.file.flush()) {
            let _ = self.file.set_len(self.len);
            return Err(e).with_context(|| format!("cannot write to {}", self.path.display()));
        }
        self.len += bytes.len() as u64;
        Ok(())
    }
}

/// Rank 0's TensorBoard log: the event file is created at the first step
/// recorded, so a run that fails before it leaves none.
pub struct TensorBoard {
    dir: PathBuf,
    writer: Option<EventWriter>,
}

impl TensorBoard {
    /// A log into `dir`.
    pub fn new(dir: PathBuf) -> Self {
        Self { dir, writer: None }
    }

    /// Writes the scalars of one `metrics.jsonl` line: with a START on the
    /// first step of this file.
    pub fn record(&mut self, r: &StepRecord) -> Result<()> {
        let value = serde_json::to_value(r).context("cannot serialise metrics")?;
        let wall_time = now();
        let mut events = Vec::with_capacity(2);
        let writer = match &mut self.writer {
            Some(w) => w,
            None => {
                events.push(session_start_event(wall_time, r.step));
                self.writer.insert(EventWriter::create(&self.dir)?)
            }
        };
        events.push(scalars_event(wall_time, r.step, &scalars(&value)));
        writer.write(&events)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_is_castagnolis_and_the_mask_rotates_then_adds() {
        // The check value of CRC-32C (RFC 3720 / the CRC catalogue).
        assert_eq!(crc32c::crc32c(b"123456789"), 0xE306_9283);
        // ((c >> 15) | (c << 17)) + 0xa282ead8 by hand for c = 0xE3069283:
        // c >> 15 = 0x1C60D, c << 17 (32 bits) = 0x25060000 → 0x2507C60D,
        // + 0xA282EAD8 = 0xC78AB0E5.
        assert_eq!(masked_crc(b"123456789"), 0xC78A_B0E5);
    }

    #[test]
    fn a_record_is_length_crc_data_crc() {
        let mut out = Vec::new();
        frame(&mut out, b"123456789");
        assert_eq!(out.len(), 8 + 4 + 9 + 4);
        assert_eq!(&out[..8], &9u64.to_le_bytes());
        assert_eq!(&out[8..12], &masked_crc(&9u64.to_le_bytes()).to_le_bytes());
        assert_eq!(&out[12..21], b"123456789");
        assert_eq!(&out[21..], &0xC78A_B0E5u32.to_le_bytes());
    }

    #[test]
    fn varints_are_little_endian_groups_of_seven_bits() {
        let enc = |v| {
            let mut b = Vec::new();
            varint(&mut b, v);
            b
        };
        assert_eq!(enc(0), [0x00]);
        assert_eq!(enc(1), [0x01]);
        assert_eq!(enc(127), [0x7f]);
        // The protobuf documentation's example: 150 = 0x96 0x01.
        assert_eq!(enc(150), [0x96, 0x01]);
        assert_eq!(enc(300), [0xac, 0x02]);
        assert_eq!(enc(u64::MAX), [0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01]);
    }

    #[test]
    fn events_encode_field_by_field() {
        // wall_time 1.5 (field 1, fixed64), step 3 (field 2, varint), then
        // summary (field 5) { value (1) { tag (1) "a/b", simple_value (2) 2.0 } }.
        let e = scalars_event(1.5, 3, &[("a/b".into(), 2.0)]);
        let mut want = vec![0x09];
        want.extend_from_slice(&1.5f64.to_le_bytes());
        want.extend_from_slice(&[0x10, 3, 0x2a, 12, 0x0a, 10, 0x0a, 3, b'a', b'/', b'b', 0x15]);
        want.extend_from_slice(&2.0f32.to_le_bytes());
        assert_eq!(e, want);
        let v = file_version_event(0.0);
        assert!(v.ends_with(b"\x1a\x0dbrain.Event:2"), "{v:?}");
        // session_log (field 7; 6 is the deprecated log_message) { status (1) = START (1) }.
        assert!(session_start_event(0.0, 7).ends_with(&[0x10, 7, 0x3a, 2, 0x08, 1]));
    }

    #[test]
    fn tags_group_by_prefix_and_values_are_f32_casts() {
        let r = serde_json::json!({
            "step": 4, "loss": 2.25, "val_loss": 1.0000001, "lr": 3e-4, "clipped": true, "skipped": false,
            "mem_peak_rss": 123456789, "mem_master": null, "comm_s": 0.5, "micro_losses": [1.0, 2.0],
            "pipeline_bubble": 0.25, "p2p_bytes": 8, "tp_allreduce_s": 0.125, "epoch": 0
        });
        let mut got = scalars(&r);
        got.sort_by(|a, b| a.0.cmp(&b.0));
        let want: Vec<(String, f32)> = [
            ("comm/s", 0.5),
            ("mem/peak_rss", 123456789.0f64 as f32),
            ("p2p/bytes", 8.0),
            ("pipeline/bubble", 0.25),
            ("tp/allreduce_s", 0.125),
            ("train/clipped", 1.0),
            ("train/epoch", 0.0),
            ("train/loss", 2.25),
            ("train/lr", 3e-4f64 as f32),
            ("train/micro_losses/0", 1.0),
            ("train/micro_losses/1", 2.0),
            ("train/skipped", 0.0),
            ("val/loss", 1.0000001f64 as f32),
        ]
        .into_iter()
        .map(|(t, v)| (t.to_string(), v))
        .collect();
        assert_eq!(got, want);
    }

    #[test]
    fn new_files_sort_after_those_in_the_folder() {
        let dir = std::env::temp_dir().join(format!("macrobatch-tb-names-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let first = EventWriter::create(&dir).unwrap();
        // A file from the future (another clock, or a run in the same second).
        let later = now() as u64 + 1000;
        std::fs::write(dir.join(format!("{FILE_PREFIX}{later}.other.1.v2")), b"").unwrap();
        let second = EventWriter::create(&dir).unwrap();
        let name = |w: &EventWriter| w.path().file_name().unwrap().to_string_lossy().into_owned();
        assert_eq!(name_seconds(&name(&second)), Some(later + 1));
        assert!(name(&first) < name(&second));
        // The version record alone: 8 + 4 + data + 4 bytes.
        let bytes = std::fs::read(first.path()).unwrap();
        assert_eq!(bytes.len(), 16 + file_version_event(0.0).len());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
