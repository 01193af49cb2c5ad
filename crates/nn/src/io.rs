//! Files: atomic writes (temporary file, fsync, rename), a process-wide
//! write budget for fault-injection tests, f32 safetensors files streamed
//! out and read back, and weight files mapped rather than read
//! ([`map_file`]).

use safetensors::tensor::{Dtype, SafeTensors};
use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use thiserror::Error;

/// What can go wrong reading or writing a file.
#[derive(Debug, Error)]
pub enum FileError {
    /// Reading or writing a file failed.
    #[error("{}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A file is malformed or does not hold what it should.
    #[error("{}: {problem}", path.display())]
    Malformed {
        /// The file.
        path: PathBuf,
        /// What is wrong and how to fix it.
        problem: String,
    },
}

/// Maps an OS error on `path` to a [`FileError`].
pub fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> FileError + '_ {
    move |source| FileError::Io { path: path.to_path_buf(), source }
}

/// A [`FileError::Malformed`] of `path`.
pub fn bad(path: &Path, problem: impl Into<String>) -> FileError {
    FileError::Malformed { path: path.to_path_buf(), problem: problem.into() }
}

/// Bytes this process may still write before writes fail with ENOSPC (test
/// fault injection; `u64::MAX`: no limit).
static WRITE_BUDGET: AtomicU64 = AtomicU64::new(u64::MAX);

/// Fault injection for tests: after `bytes` more bytes written through
/// [`write_all_budgeted`] (every file this crate and the `macrobatch` binary
/// write), writes fail with ENOSPC as on a full disk. `None` lifts the limit.
pub fn set_write_budget(bytes: Option<u64>) {
    WRITE_BUDGET.store(bytes.unwrap_or(u64::MAX), Ordering::SeqCst);
}

/// `f.write_all(bytes)`, honouring [`set_write_budget`]: past the budget the
/// allowed prefix is written (as a real full disk does) and the call fails
/// with ENOSPC.
pub fn write_all_budgeted(f: &mut impl Write, bytes: &[u8]) -> std::io::Result<()> {
    let want = bytes.len() as u64;
    let before = WRITE_BUDGET
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |b| (b != u64::MAX).then(|| b.saturating_sub(want)))
        .unwrap_or(u64::MAX);
    if before >= want {
        return f.write_all(bytes);
    }
    f.write_all(&bytes[..before as usize])?;
    Err(std::io::Error::from_raw_os_error(28)) // ENOSPC
}

/// Name of the temporary file [`write_atomic`] uses for `name`
/// (`.NAME.tmp-PID`); leftovers of killed writers match [`is_temp_file`].
fn temp_name(name: &str) -> String {
    format!(".{name}.tmp-{}", std::process::id())
}

/// Whether `file_name` is a temporary file of [`write_atomic`] (of any process).
pub fn is_temp_file(file_name: &str) -> bool {
    file_name.starts_with('.') && file_name.rsplit_once(".tmp-").is_some_and(|(_, pid)| pid.parse::<u32>().is_ok())
}

/// Writes `bytes` to `path` atomically: a temporary file in the same
/// directory, fsync, rename, fsync of the directory. A crash leaves either
/// the old file or the new one, never a torn one; a failed write (e.g. a full
/// disk) removes its temporary file.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), FileError> {
    write_atomic_with(path, |w| write_all_budgeted(w, bytes))
}

/// [`write_atomic`] with the contents produced by `fill` in pieces (through
/// [`write_all_budgeted`]), so a large file never needs a copy in memory.
pub fn write_atomic_with(
    path: &Path,
    fill: impl FnOnce(&mut std::io::BufWriter<std::fs::File>) -> std::io::Result<()>,
) -> Result<(), FileError> {
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp: PathBuf = dir.join(temp_name(&name));
    let write = || -> Result<(), FileError> {
        let f = std::fs::File::create(&tmp).map_err(io_err(&tmp))?;
        let mut w = std::io::BufWriter::with_capacity(1 << 20, f);
        fill(&mut w).map_err(io_err(&tmp))?;
        let f = w.into_inner().map_err(|e| io_err(&tmp)(e.into_error()))?;
        f.sync_all().map_err(io_err(&tmp))?;
        drop(f);
        std::fs::rename(&tmp, path).map_err(io_err(path))
    };
    if let Err(e) = write() {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all(); // best effort: not every filesystem syncs directories
    }
    Ok(())
}

/// Writes named f32 tensors `(name, shape, data)` to a safetensors file,
/// atomically, with `format = pt` metadata plus `metadata`. The file is
/// streamed (header, then each tensor's little-endian bytes in chunks): no
/// copy of the tensors is ever held in memory, so saving a model costs no
/// more than a buffer, not two more copies of it.
pub fn write_safetensors(
    path: &Path,
    tensors: &[(String, Vec<usize>, &[f32])],
    metadata: &[(&str, String)],
) -> Result<(), FileError> {
    let heads: Vec<(String, Vec<usize>)> = tensors.iter().map(|(n, s, _)| (n.clone(), s.clone())).collect();
    for ((name, shape), (_, _, data)) in heads.iter().zip(tensors) {
        if shape.iter().product::<usize>() != data.len() {
            return Err(bad(path, format!("tensor `{name}`: shape {shape:?} does not hold {} values", data.len())));
        }
    }
    write_safetensors_with(path, &heads, metadata, &mut |i| std::borrow::Cow::Borrowed(tensors[i].2))
}

/// [`write_safetensors`] of tensors `(name, shape)` whose values `data(i)`
/// hands over one at a time, in order (borrowed, or made for the moment:
/// a packed tensor dequantised, so no more than one exists at once).
pub fn write_safetensors_with<'a>(
    path: &Path,
    tensors: &[(String, Vec<usize>)],
    metadata: &[(&str, String)],
    data: &mut dyn FnMut(usize) -> std::borrow::Cow<'a, [f32]>,
) -> Result<(), FileError> {
    // The format: u64 LE header length, a JSON header (padded with spaces to
    // a multiple of 8) naming each tensor's dtype, shape and byte range in
    // the data that follows, then the data.
    let mut header = serde_json::Map::new();
    let mut meta = serde_json::Map::from_iter([("format".to_string(), serde_json::Value::from("pt"))]);
    meta.extend(metadata.iter().map(|(k, v)| (k.to_string(), serde_json::Value::from(v.as_str()))));
    header.insert("__metadata__".into(), serde_json::Value::Object(meta));
    let mut offset = 0usize;
    for (name, shape) in tensors {
        if header.contains_key(name) {
            return Err(bad(path, format!("tensor `{name}` appears twice")));
        }
        let end = offset + 4 * shape.iter().product::<usize>();
        header
            .insert(name.clone(), serde_json::json!({ "dtype": "F32", "shape": shape, "data_offsets": [offset, end] }));
        offset = end;
    }
    let mut head = serde_json::to_vec(&header).map_err(|e| bad(path, format!("cannot serialise the header: {e}")))?;
    head.resize(head.len().next_multiple_of(8), b' ');
    write_atomic_with(path, |w| {
        write_all_budgeted(w, &(head.len() as u64).to_le_bytes())?;
        write_all_budgeted(w, &head)?;
        let mut chunk = Vec::with_capacity(1 << 16);
        for (i, (name, shape)) in tensors.iter().enumerate() {
            let data = data(i);
            if data.len() != shape.iter().product::<usize>() {
                let what = format!("tensor `{name}`: shape {shape:?} does not hold {} values", data.len());
                return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, what));
            }
            for part in data.chunks(1 << 14) {
                chunk.clear();
                chunk.extend(part.iter().flat_map(|x| x.to_le_bytes()));
                write_all_budgeted(w, &chunk)?;
            }
        }
        Ok(())
    })
}

/// Decodes a stored tensor's little-endian `bytes` of `dtype` (F32, F16 or
/// BF16, widened exactly) into `dst`. `Err` says what does not fit: a dtype
/// other than those, or a byte count that is not `dst`'s length of it.
pub fn decode_into(dtype: Dtype, bytes: &[u8], dst: &mut [f32]) -> Result<(), String> {
    let width = match dtype {
        Dtype::F32 => 4,
        Dtype::F16 | Dtype::BF16 => 2,
        other => return Err(format!("is {other:?}; only F32, F16 and BF16 are supported")),
    };
    if bytes.len() != dst.len() * width {
        return Err(format!("holds {} values, the model needs {}", bytes.len() / width, dst.len()));
    }
    match dtype {
        Dtype::F32 => {
            for (d, s) in dst.iter_mut().zip(bytes.chunks_exact(4)) {
                *d = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
            }
        }
        Dtype::F16 => {
            for (d, s) in dst.iter_mut().zip(bytes.chunks_exact(2)) {
                *d = half::f16::from_bits(u16::from_le_bytes([s[0], s[1]])).to_f32();
            }
        }
        _ => {
            for (d, s) in dst.iter_mut().zip(bytes.chunks_exact(2)) {
                *d = f32::from_bits((u16::from_le_bytes([s[0], s[1]]) as u32) << 16);
            }
        }
    }
    Ok(())
}

/// The bytes of `path`, mapped read-only: a weights file is read through
/// the page cache instead of copied onto the heap, so loading a model holds
/// its parameters once (the mapped pages are the kernel's to drop), not the
/// file's bytes and the parameters.
pub fn map_file(path: &Path) -> Result<memmap2::Mmap, FileError> {
    let file = std::fs::File::open(path).map_err(io_err(path))?;
    // SAFETY: the map is read-only (shared with the page cache); a file
    // truncated or rewritten under it by another process is the one hazard,
    // as for any reader of a file that changes while read (GGUF files are
    // read so too).
    unsafe { memmap2::Mmap::map(&file) }.map_err(io_err(path))
}

/// Drops the resident pages of `bytes`, a part of `map`, once a loader has
/// copied or converted them: the file stays mapped (a later read faults the
/// same bytes back in from it), but a model read tensor by tensor then holds
/// about one tensor's pages beside what it made of them, not the whole file.
pub fn release_pages(map: &memmap2::Mmap, bytes: &[u8]) {
    let start = (bytes.as_ptr() as usize).wrapping_sub(map.as_ptr() as usize);
    if bytes.is_empty() || start.checked_add(bytes.len()).is_none_or(|end| end > map.len()) {
        return; // not inside this map
    }
    // SAFETY: the map is a read-only shared mapping of a file. MADV_DONTNEED
    // on it only drops pages, which the next access reads back from the
    // file: every borrowed slice keeps seeing the file's bytes. A failure
    // (say, an unaligned range on an odd page size) leaves the pages resident.
    // (Elsewhere than Unix the pages simply stay.)
    #[cfg(unix)]
    let _ = unsafe { map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, bytes.len()) };
}

/// Named tensors as `(shape, data)`.
pub type Tensors = HashMap<String, (Vec<usize>, Vec<f32>)>;

/// Reads every F32 tensor of a safetensors file, and its metadata.
pub fn read_safetensors(path: &Path) -> Result<(Tensors, HashMap<String, String>), FileError> {
    let bytes = map_file(path)?;
    let (_, meta) = SafeTensors::read_metadata(&bytes)
        .map_err(|e| bad(path, format!("not a valid safetensors file ({e}); it may be truncated or corrupt")))?;
    let st = SafeTensors::deserialize(&bytes)
        .map_err(|e| bad(path, format!("not a valid safetensors file ({e}); it may be truncated or corrupt")))?;
    let mut out = HashMap::new();
    for (name, view) in st.tensors() {
        if view.dtype() != Dtype::F32 {
            return Err(bad(path, format!("tensor `{name}` is {:?}; only F32 is supported so far", view.dtype())));
        }
        let data = view.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        release_pages(&bytes, view.data());
        out.insert(name, (view.shape().to_vec(), data));
    }
    Ok((out, meta.metadata().clone().unwrap_or_default()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmpdir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("macrobatch-nn-io-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn a_failed_atomic_write_leaves_no_temporary_file() {
        // The publishing rename fails (the target is a non-empty directory);
        // the temporary file must not stay behind. (ENOSPC is covered by the
        // CLI tests: the write budget is process-wide.)
        let dir = tmpdir("failed-write");
        std::fs::create_dir_all(dir.join("x.json").join("inside")).unwrap();
        assert!(write_atomic(&dir.join("x.json"), b"new contents").is_err());
        let names: Vec<String> =
            std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        assert_eq!(names, vec!["x.json".to_string()], "no .x.json.tmp-PID left behind");
        assert!(is_temp_file(".x.json.tmp-1234") && !is_temp_file("x.json") && !is_temp_file(".x.tmp-abc"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn safetensors_round_trip_and_refuse_bad_shapes() {
        let dir = tmpdir("st");
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.safetensors");
        let (a, b) = (vec![1.0f32, -2.5, 3.0, 0.0], vec![7.0f32]);
        let tensors = [("a".to_string(), vec![2, 2], a.as_slice()), ("b".to_string(), vec![1], b.as_slice())];
        write_safetensors(&path, &tensors, &[("k", "v".to_string())]).unwrap();
        let (read, meta) = read_safetensors(&path).unwrap();
        assert_eq!(read["a"], (vec![2, 2], a.clone()));
        assert_eq!(read["b"], (vec![1], b.clone()));
        assert_eq!(meta.get("k").map(String::as_str), Some("v"));
        let bad = [("a".to_string(), vec![3], a.as_slice())];
        let e = write_safetensors(&path, &bad, &[]).unwrap_err().to_string();
        assert!(e.contains("shape [3] does not hold 4 values"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
