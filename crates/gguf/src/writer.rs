//! A minimal GGUF writer, so tests (here and in other crates) can build small
//! files with exactly the metadata and blocks they need. Not a converter: it
//! writes what it is given, bytes and all.

use crate::file::DEFAULT_ALIGNMENT;
use crate::value::{Value, ValueType};
use std::io::Write;
use std::path::Path;

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

/// The bytes of a GGUF file of `version` with `metadata` and `tensors`,
/// tensor data aligned to `general.alignment` if the metadata sets it (as a
/// u32), else to 32.
pub fn to_bytes(version: u32, metadata: &[(&str, Value)], tensors: &[RawTensor]) -> Vec<u8> {
    let alignment = metadata
        .iter()
        .find(|(k, _)| *k == "general.alignment")
        .and_then(|(_, v)| v.as_u64())
        .unwrap_or(DEFAULT_ALIGNMENT) as usize;
    let mut out = b"GGUF".to_vec();
    out.extend(version.to_le_bytes());
    out.extend((tensors.len() as u64).to_le_bytes());
    out.extend((metadata.len() as u64).to_le_bytes());
    for (key, value) in metadata {
        put_str(&mut out, key);
        out.extend(type_id(value.value_type()).to_le_bytes());
        put_value(&mut out, value);
    }
    let mut offset = 0usize;
    for t in tensors {
        put_str(&mut out, &t.name);
        out.extend((t.ne.len() as u32).to_le_bytes());
        for d in &t.ne {
            out.extend(d.to_le_bytes());
        }
        out.extend(t.type_id.to_le_bytes());
        out.extend((offset as u64).to_le_bytes());
        offset = (offset + t.bytes.len()).div_ceil(alignment) * alignment;
    }
    out.resize(out.len().div_ceil(alignment) * alignment, 0);
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
