//! The GGUF writer: [`write_tensors`] streams a v3 file tensor by tensor (header
//! first, each tensor's bytes asked for in order, `PATH.part` renamed when
//! complete), and [`to_bytes`] / [`write()`] build small files in memory
//! with exactly the metadata and blocks a test needs. It writes what it is
//! given; [`crate::encode::quantize`] makes the bytes.

use crate::error::GgufError;
use crate::file::DEFAULT_ALIGNMENT;
use crate::quant::GgmlType;
use crate::value::{Value, ValueType};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

/// One tensor to write: name, GGUF dimensions (fastest first), ggml type id,
/// and its bytes as stored.
#[derive(Debug, Clone)]
pub struct RawTensor {
    /// Name.
    pub name: String,
    /// Dimensions, `ne[0]` fastest.
    pub ne: Vec<u64>,
    /// ggml type id.
    pub type_id: u32,
    /// The stored bytes.
    pub bytes: Vec<u8>,
}

fn type_id(t: ValueType) -> u32 {
    use ValueType::*;
    match t {
        U8 => 0,
        I8 => 1,
        U16 => 2,
        I16 => 3,
        U32 => 4,
        I32 => 5,
        F32 => 6,
        Bool => 7,
        String => 8,
        Array => 9,
        U64 => 10,
        I64 => 11,
        F64 => 12,
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => out.push(*x),
        Value::I8(x) => out.push(*x as u8),
        Value::U16(x) => out.extend(x.to_le_bytes()),
        Value::I16(x) => out.extend(x.to_le_bytes()),
        Value::U32(x) => out.extend(x.to_le_bytes()),
        Value::I32(x) => out.extend(x.to_le_bytes()),
        Value::F32(x) => out.extend(x.to_le_bytes()),
        Value::Bool(x) => out.push(u8::from(*x)),
        Value::String(s) => put_str(out, s),
        Value::Array(t, items) => {
            out.extend(type_id(*t).to_le_bytes());
            out.extend((items.len() as u64).to_le_bytes());
            for item in items {
                put_value(out, item);
            }
        }
        Value::U64(x) => out.extend(x.to_le_bytes()),
        Value::I64(x) => out.extend(x.to_le_bytes()),
        Value::F64(x) => out.extend(x.to_le_bytes()),
    }
}

/// One tensor's entry in the header: what [`write_tensors`] needs before the data.
#[derive(Debug, Clone)]
pub struct TensorHeader {
    /// Name.
    pub name: String,
    /// Dimensions, `ne[0]` fastest.
    pub ne: Vec<u64>,
    /// Its ggml type.
    pub ty: GgmlType,
}

impl TensorHeader {
    /// Bytes of the tensor's data (`None` when the element count is not a
    /// whole number of blocks, or overflows).
    pub fn n_bytes(&self) -> Option<u64> {
        let n = self.ne.iter().try_fold(1u64, |a, &d| a.checked_mul(d))?;
        self.ty.n_bytes(n)
    }
}

/// The alignment `metadata` asks for (`general.alignment`), else 32.
fn alignment_of<K: AsRef<str>>(metadata: &[(K, Value)]) -> u64 {
    metadata
        .iter()
        .find(|(k, _)| k.as_ref() == "general.alignment")
        .and_then(|(_, v)| v.as_u64())
        .filter(|&a| a > 0)
        .unwrap_or(DEFAULT_ALIGNMENT)
}

/// The header (magic to the padding before the data) of a file whose
/// tensors are `(name, ne, type id, bytes)`, and the alignment.
fn header<K: AsRef<str>>(
    version: u32,
    metadata: &[(K, Value)],
    tensors: &[(&str, &[u64], u32, u64)],
) -> (Vec<u8>, u64) {
    let alignment = alignment_of(metadata);
    let mut out = b"GGUF".to_vec();
    out.extend(version.to_le_bytes());
    out.extend((tensors.len() as u64).to_le_bytes());
    out.extend((metadata.len() as u64).to_le_bytes());
    for (key, value) in metadata {
        put_str(&mut out, key.as_ref());
        out.extend(type_id(value.value_type()).to_le_bytes());
        put_value(&mut out, value);
    }
    let mut offset = 0u64;
    for &(name, ne, ty, n_bytes) in tensors {
        put_str(&mut out, name);
        out.extend((ne.len() as u32).to_le_bytes());
        for d in ne {
            out.extend(d.to_le_bytes());
        }
        out.extend(ty.to_le_bytes());
        out.extend(offset.to_le_bytes());
        offset = (offset + n_bytes).div_ceil(alignment) * alignment;
    }
    out.resize((out.len() as u64).div_ceil(alignment) as usize * alignment as usize, 0);
    (out, alignment)
}

/// The bytes of a GGUF file of `version` with `metadata` and `tensors`,
/// tensor data aligned to `general.alignment` if the metadata sets it (as a
/// u32), else to 32.
pub fn to_bytes(version: u32, metadata: &[(&str, Value)], tensors: &[RawTensor]) -> Vec<u8> {
    let entries: Vec<_> =
        tensors.iter().map(|t| (t.name.as_str(), t.ne.as_slice(), t.type_id, t.bytes.len() as u64)).collect();
    let (mut out, alignment) = header(version, metadata, &entries);
    let alignment = alignment as usize;
    for t in tensors {
        out.extend(&t.bytes);
        out.resize(out.len().div_ceil(alignment) * alignment, 0);
    }
    out
}

/// Writes [`to_bytes`] to `path`.
pub fn write(path: &Path, version: u32, metadata: &[(&str, Value)], tensors: &[RawTensor]) -> std::io::Result<()> {
    std::fs::File::create(path)?.write_all(&to_bytes(version, metadata, tensors))
}

/// Writes a GGUF v3 file at `path` without holding more than one tensor's
/// bytes: the header from `tensors`, then `data(i)` for each tensor in
/// order, checked against the size its header announced. The file is
/// written as `PATH.part` and renamed to `path` once complete (an existing
/// `path` is replaced; refusing to is the caller's choice), so a failed
/// write never leaves a truncated file under the final name; the `.part`
/// file is removed on failure. A metadata key given twice is refused
/// (readers reject such files).
pub fn write_tensors<K, E, F>(
    path: &Path,
    metadata: &[(K, Value)],
    tensors: &[TensorHeader],
    mut data: F,
) -> Result<(), E>
where
    K: AsRef<str>,
    E: From<GgufError>,
    F: FnMut(usize) -> Result<Vec<u8>, E>,
{
    let mut part = path.as_os_str().to_owned();
    part.push(".part");
    let part = PathBuf::from(part);
    let result = write_part(&part, metadata, tensors, &mut data).and_then(|()| {
        std::fs::rename(&part, path).map_err(|source| E::from(GgufError::Write { path: path.into(), source }))
    });
    if result.is_err() {
        let _ = std::fs::remove_file(&part);
    }
    result
}

fn write_part<K, E, F>(part: &Path, metadata: &[(K, Value)], tensors: &[TensorHeader], data: &mut F) -> Result<(), E>
where
    K: AsRef<str>,
    E: From<GgufError>,
    F: FnMut(usize) -> Result<Vec<u8>, E>,
{
    let io = |source| E::from(GgufError::Write { path: part.into(), source });
    let mut keys = std::collections::HashSet::new();
    if let Some((key, _)) = metadata.iter().find(|(k, _)| !keys.insert(k.as_ref())) {
        return Err(E::from(GgufError::Encode(format!("metadata key `{}` is given twice", key.as_ref()))));
    }
    let mut sizes = Vec::with_capacity(tensors.len());
    for t in tensors {
        let n = t.n_bytes().ok_or_else(|| {
            GgufError::Encode(format!(
                "tensor `{}` of shape {:?} is not a whole number of {} blocks",
                t.name, t.ne, t.ty.name
            ))
        })?;
        sizes.push(n);
    }
    let entries: Vec<_> =
        tensors.iter().zip(&sizes).map(|(t, &n)| (t.name.as_str(), t.ne.as_slice(), t.ty.id, n)).collect();
    let (head, alignment) = header(3, metadata, &entries);
    let mut out = BufWriter::new(std::fs::File::create(part).map_err(io)?);
    out.write_all(&head).map_err(io)?;
    let pad = [0u8; 64];
    for (i, (t, &n)) in tensors.iter().zip(&sizes).enumerate() {
        let bytes = data(i)?;
        if bytes.len() as u64 != n {
            return Err(E::from(GgufError::Encode(format!(
                "tensor `{}`: {} bytes given, its header says {n}",
                t.name,
                bytes.len()
            ))));
        }
        out.write_all(&bytes).map_err(io)?;
        let mut fill = n.div_ceil(alignment) * alignment - n;
        while fill > 0 {
            let k = fill.min(pad.len() as u64);
            out.write_all(&pad[..k as usize]).map_err(io)?;
            fill -= k;
        }
    }
    out.into_inner().map_err(|e| io(e.into_error()))?.sync_all().map_err(io)
}
