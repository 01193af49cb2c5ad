//! The GGUF container: header, metadata, tensor infos and the memory-mapped
//! tensor data.
//!
//! Layout (all little-endian; versions 2 and 3 are identical on disk for
//! little-endian files):
//! ```text
//! "GGUF"  u32 version  u64 n_tensors  u64 n_kv
//! n_kv × (string key, u32 value type, value)        string = u64 length + UTF-8
//! n_tensors × (string name, u32 n_dims, n_dims × u64 ne, u32 ggml type, u64 offset)
//! padding to `general.alignment` (default 32)        ← data section starts here
//! tensor data; each tensor at data start + its offset (a multiple of the alignment)
//! ```
//! `ne[0]` is the fastest-varying dimension, so a row-major (PyTorch) shape is
//! `ne` reversed.
//!
//! The file is memory-mapped: metadata is parsed once, tensor bytes are read
//! only when a tensor is dequantised, so a model of many GB costs address
//! space, not memory, until its tensors are used.

use crate::error::GgufError;
use crate::quant::{self, GgmlType};
use crate::value::{Value, ValueType};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// The alignment of tensor data when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;

/// Where one tensor lives and what it holds.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    /// Its name, e.g. `blk.0.attn_q.weight`.
    pub name: String,
    /// GGUF dimensions, fastest first (`ne[0]` = row length).
    pub ne: Vec<u64>,
    /// The ggml type id as stored.
    pub type_id: u32,
    /// Byte offset from the start of the data section.
    pub offset: u64,
}

impl TensorInfo {
    /// Number of values.
    pub fn n_elements(&self) -> u64 {
        self.ne.iter().product()
    }

    /// The row-major shape (PyTorch / Hugging Face order): `ne` reversed.
    pub fn shape(&self) -> Vec<usize> {
        self.ne.iter().rev().map(|&d| d as usize).collect()
    }
}

/// An open GGUF file.
pub struct GgufFile {
    path: PathBuf,
    mmap: memmap2::Mmap,
    version: u32,
    metadata: Vec<(String, Value)>,
    metadata_idx: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_idx: HashMap<String, usize>,
    alignment: u64,
    data_offset: u64,
}

impl std::fmt::Debug for GgufFile {
    // The derived form would print every metadata value (a vocabulary of 50k tokens).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("n_metadata", &self.metadata.len())
            .field("n_tensors", &self.tensors.len())
            .field("alignment", &self.alignment)
            .field("data_offset", &self.data_offset)
            .finish()
    }
}

/// A bounds-checked little-endian reader over the mapped bytes.
struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: u64, what: &dyn Fn() -> String) -> Result<&'a [u8], GgufError> {
        let end = usize::try_from(n).ok().and_then(|n| self.pos.checked_add(n)).filter(|&e| e <= self.bytes.len());
        match end {
            Some(end) => {
                let s = &self.bytes[self.pos..end];
                self.pos = end;
                Ok(s)
            }
            None => Err(GgufError::Truncated {
                path: self.path.into(),
                what: what(),
                offset: self.pos as u64,
                needed: n,
                file_len: self.bytes.len() as u64,
            }),
        }
    }

    fn array<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N], GgufError> {
        let s = self.take(N as u64, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32, GgufError> {
        self.array(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64, GgufError> {
        self.array(what).map(u64::from_le_bytes)
    }

    fn string(&mut self, what: &dyn Fn() -> String) -> Result<String, GgufError> {
        let len = self.u64(what)?;
        let start = self.pos;
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| GgufError::Invalid {
            path: self.path.into(),
            problem: format!("{} at byte {start} is not UTF-8", what()),
        })
    }

    fn value(&mut self, ty: ValueType, what: &dyn Fn() -> String) -> Result<Value, GgufError> {
        Ok(match ty {
            ValueType::U8 => Value::U8(self.array::<1>(what)?[0]),
            ValueType::I8 => Value::I8(self.array::<1>(what)?[0] as i8),
            ValueType::U16 => Value::U16(u16::from_le_bytes(self.array(what)?)),
            ValueType::I16 => Value::I16(i16::from_le_bytes(self.array(what)?)),
            ValueType::U32 => Value::U32(self.u32(what)?),
            ValueType::I32 => Value::I32(i32::from_le_bytes(self.array(what)?)),
            ValueType::F32 => Value::F32(f32::from_le_bytes(self.array(what)?)),
            ValueType::Bool => {
                let at = self.pos;
                match self.array::<1>(what)?[0] {
                    0 => Value::Bool(false),
                    1 => Value::Bool(true),
                    b => {
                        return Err(GgufError::Invalid {
                            path: self.path.into(),
                            problem: format!("{} at byte {at} is a bool of value {b}", what()),
                        })
                    }
                }
            }
            ValueType::String => Value::String(self.string(what)?),
            ValueType::U64 => Value::U64(self.u64(what)?),
            ValueType::I64 => Value::I64(i64::from_le_bytes(self.array(what)?)),
            ValueType::F64 => Value::F64(f64::from_le_bytes(self.array(what)?)),
            ValueType::Array => {
                let elem = self.value_type(what)?;
                let n = self.u64(what)?;
                // Every element takes at least one byte: a count beyond the
                // file is corrupt, and must not reserve memory for it.
                let left = (self.bytes.len() - self.pos) as u64;
                let min_size = elem.fixed_size().unwrap_or(8) as u64;
                if n.saturating_mul(min_size) > left {
                    return Err(GgufError::Truncated {
                        path: self.path.into(),
                        what: format!("{} ({n} elements of {elem:?})", what()),
                        offset: self.pos as u64,
                        needed: n.saturating_mul(min_size),
                        file_len: self.bytes.len() as u64,
                    });
                }
                let mut v = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    v.push(self.value(elem, what)?);
                }
                Value::Array(elem, v)
            }
        })
    }

    fn value_type(&mut self, what: &dyn Fn() -> String) -> Result<ValueType, GgufError> {
        let at = self.pos;
        let id = self.u32(what)?;
        ValueType::from_id(id).ok_or_else(|| GgufError::Invalid {
            path: self.path.into(),
            problem: format!("{} at byte {at} has unknown value type {id}", what()),
        })
    }
}

impl GgufFile {
    /// Opens and memory-maps `path`, parses header, metadata and tensor
    /// infos, and checks that every tensor of a known type lies inside the
    /// file.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, GgufError> {
        let path = path.as_ref();
        let io = |source| GgufError::Io { path: path.into(), source };
        let file = std::fs::File::open(path).map_err(io)?;
        // SAFETY: the map is read-only. Like every memory-mapped reader we
        // rely on the file not being truncated while it is open (a model file
        // is not written in place); bounds are checked against the length
        // seen here.
        let mmap = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
        Self::parse(path.to_path_buf(), mmap)
    }

    fn parse(path: PathBuf, mmap: memmap2::Mmap) -> Result<Self, GgufError> {
        let mut c = Cursor { bytes: &mmap, pos: 0, path: &path };
        let magic = c
            .take(4, &|| "the magic".into())
            .map_err(|_| GgufError::BadMagic { path: path.clone(), found: mmap[..mmap.len().min(4)].to_vec() })?;
        if magic != b"GGUF" {
            return Err(GgufError::BadMagic { path: path.clone(), found: magic.to_vec() });
        }
        let version = c.u32(&|| "the version".into())?;
        if !(version == 2 || version == 3) {
            return Err(GgufError::UnsupportedVersion { path: path.clone(), version });
        }
        let n_tensors = c.u64(&|| "the tensor count".into())?;
        let n_kv = c.u64(&|| "the metadata count".into())?;

        let mut metadata = Vec::new();
        let mut metadata_idx = HashMap::new();
        for kv_idx in 0..n_kv {
            let key = c.string(&|| format!("metadata key {kv_idx}"))?;
            let what = || format!("metadata `{key}`");
            let ty = c.value_type(&what)?;
            let value = c.value(ty, &what)?;
            if metadata_idx.insert(key.clone(), metadata.len()).is_some() {
                return Err(GgufError::Invalid {
                    path: path.clone(),
                    problem: format!("metadata key `{key}` repeats"),
                });
            }
            metadata.push((key, value));
        }

        let alignment = match metadata_idx.get("general.alignment").map(|&i| &metadata[i].1) {
            None => DEFAULT_ALIGNMENT,
            Some(v) => match v.as_u64() {
                Some(a) if a > 0 && a.is_power_of_two() => a,
                _ => {
                    return Err(GgufError::Invalid {
                        path: path.clone(),
                        problem: format!("general.alignment = {v} is not a power of two"),
                    })
                }
            },
        };

        let mut tensors = Vec::new();
        let mut tensor_idx = HashMap::new();
        for t_idx in 0..n_tensors {
            let name = c.string(&|| format!("tensor name {t_idx}"))?;
            let what = || format!("tensor info `{name}`");
            let n_dims = c.u32(&what)?;
            if n_dims > 8 {
                return Err(GgufError::Invalid {
                    path: path.clone(),
                    problem: format!("tensor `{name}` claims {n_dims} dimensions"),
                });
            }
            let ne = (0..n_dims).map(|_| c.u64(&what)).collect::<Result<Vec<_>, _>>()?;
            let type_id = c.u32(&what)?;
            let offset = c.u64(&what)?;
            if !offset.is_multiple_of(alignment) {
                return Err(GgufError::Invalid {
                    path: path.clone(),
                    problem: format!("tensor `{name}` at data offset {offset} is not aligned to {alignment}"),
                });
            }
            if tensor_idx.insert(name.clone(), tensors.len()).is_some() {
                return Err(GgufError::Invalid { path: path.clone(), problem: format!("tensor `{name}` repeats") });
            }
            tensors.push(TensorInfo { name, ne, type_id, offset });
        }

        let data_offset = (c.pos as u64).div_ceil(alignment) * alignment;
        let file = Self { version, metadata, metadata_idx, tensors, tensor_idx, alignment, data_offset, path, mmap };
        for t in &file.tensors {
            if let Some(ty) = GgmlType::from_id(t.type_id) {
                file.byte_range(t, ty)?;
            }
        }
        Ok(file)
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The format version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// The alignment of tensor data.
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Where the data section starts, in bytes from the start of the file.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    /// All metadata in file order.
    pub fn metadata(&self) -> &[(String, Value)] {
        &self.metadata
    }

    /// One metadata value.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata_idx.get(key).map(|&i| &self.metadata[i].1)
    }

    fn require(&self, key: &str) -> Result<&Value, GgufError> {
        self.get(key).ok_or_else(|| GgufError::MissingKey { path: self.path.clone(), key: key.into() })
    }

    fn wrong(&self, key: &str, expected: &'static str, v: &Value) -> GgufError {
        GgufError::WrongType { path: self.path.clone(), key: key.into(), expected, found: v.describe() }
    }

    /// A required non-negative integer of any width.
    pub fn get_u64(&self, key: &str) -> Result<u64, GgufError> {
        let v = self.require(key)?;
        v.as_u64().ok_or_else(|| self.wrong(key, "a non-negative integer", v))
    }

    /// An optional non-negative integer of any width (present with another
    /// type is an error).
    pub fn get_u64_opt(&self, key: &str) -> Result<Option<u64>, GgufError> {
        self.get(key).is_some().then(|| self.get_u64(key)).transpose()
    }

    /// A required float (f32 or f64; see [`Value::as_f64`]).
    pub fn get_f64(&self, key: &str) -> Result<f64, GgufError> {
        let v = self.require(key)?;
        v.as_f64().ok_or_else(|| self.wrong(key, "a float", v))
    }

    /// An optional float.
    pub fn get_f64_opt(&self, key: &str) -> Result<Option<f64>, GgufError> {
        self.get(key).is_some().then(|| self.get_f64(key)).transpose()
    }

    /// An optional bool.
    pub fn get_bool_opt(&self, key: &str) -> Result<Option<bool>, GgufError> {
        self.get(key).map(|v| v.as_bool().ok_or_else(|| self.wrong(key, "a bool", v))).transpose()
    }

    /// A required string.
    pub fn get_str(&self, key: &str) -> Result<&str, GgufError> {
        let v = self.require(key)?;
        v.as_str().ok_or_else(|| self.wrong(key, "a string", v))
    }

    /// An optional string.
    pub fn get_str_opt(&self, key: &str) -> Result<Option<&str>, GgufError> {
        self.get(key).is_some().then(|| self.get_str(key)).transpose()
    }

    /// A required array of strings.
    pub fn get_str_array(&self, key: &str) -> Result<Vec<&str>, GgufError> {
        let v = self.require(key)?;
        let bad = || self.wrong(key, "an array of strings", v);
        v.as_array().ok_or_else(bad)?.iter().map(|e| e.as_str().ok_or_else(bad)).collect()
    }

    /// An optional array of integers (any width, widened).
    pub fn get_i64_array_opt(&self, key: &str) -> Result<Option<Vec<i64>>, GgufError> {
        let Some(v) = self.get(key) else { return Ok(None) };
        let bad = || self.wrong(key, "an array of integers", v);
        v.as_array().ok_or_else(bad)?.iter().map(|e| e.as_i64().ok_or_else(bad)).collect::<Result<_, _>>().map(Some)
    }

    /// All tensor infos in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// One tensor's info.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_idx.get(name).map(|&i| &self.tensors[i])
    }

    /// The tensor's ggml type, if the format defines its id.
    fn ggml_type(&self, t: &TensorInfo) -> Result<GgmlType, GgufError> {
        GgmlType::from_id(t.type_id).ok_or(GgufError::UnsupportedType {
            tensor: t.name.clone(),
            type_id: t.type_id,
            type_name: "unknown",
        })
    }

    fn byte_range(&self, t: &TensorInfo, ty: GgmlType) -> Result<std::ops::Range<usize>, GgufError> {
        let n_elements = t.ne.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
        let n_bytes = n_elements.filter(|_| t.ne.first().is_none_or(|&d| d.is_multiple_of(ty.block_size as u64)));
        let Some(n_bytes) = n_bytes.and_then(|n| ty.n_bytes(n)) else {
            return Err(GgufError::Invalid {
                path: self.path.clone(),
                problem: format!(
                    "tensor `{}` of shape {:?} is not a whole number of {}-value {} blocks per row",
                    t.name, t.ne, ty.block_size, ty.name
                ),
            });
        };
        let start = self.data_offset.checked_add(t.offset);
        match start.and_then(|s| s.checked_add(n_bytes).map(|e| (s, e))) {
            Some((s, e)) if e <= self.mmap.len() as u64 => Ok(s as usize..e as usize),
            _ => Err(GgufError::Truncated {
                path: self.path.clone(),
                what: format!("tensor `{}` ({} bytes of {})", t.name, n_bytes, ty.name),
                offset: self.data_offset.saturating_add(t.offset),
                needed: n_bytes,
                file_len: self.mmap.len() as u64,
            }),
        }
    }

    /// The whole file, mapped (a loader drops the pages of what it has read).
    pub fn mapped(&self) -> &memmap2::Mmap {
        &self.mmap
    }

    /// The raw bytes of a tensor (as stored, still quantised).
    pub fn tensor_bytes(&self, name: &str) -> Result<(&TensorInfo, &[u8]), GgufError> {
        let t =
            self.tensor(name).ok_or_else(|| GgufError::MissingTensor { path: self.path.clone(), name: name.into() })?;
        let range = self.byte_range(t, self.ggml_type(t)?)?;
        Ok((t, &self.mmap[range]))
    }

    /// A tensor dequantised to f32, in GGUF order (`ne[0]` fastest, which is
    /// row-major for [`TensorInfo::shape`]).
    pub fn dequantize(&self, name: &str) -> Result<Vec<f32>, GgufError> {
        let n = self.tensor(name).map_or(0, |t| t.n_elements() as usize);
        let mut out = vec![0f32; n];
        self.dequantize_into(name, &mut out)?;
        Ok(out)
    }

    /// [`GgufFile::dequantize`] into `out`, which holds exactly the
    /// tensor's elements (a loader places it straight into the parameters,
    /// with no second copy of the tensor).
    pub fn dequantize_into(&self, name: &str, out: &mut [f32]) -> Result<(), GgufError> {
        let (t, bytes) = self.tensor_bytes(name)?;
        let ty = self.ggml_type(t)?;
        if !ty.is_supported() {
            return Err(GgufError::UnsupportedType { tensor: t.name.clone(), type_id: ty.id, type_name: ty.name });
        }
        if out.len() as u64 != t.n_elements() {
            return Err(GgufError::UnsupportedModel {
                path: self.path.clone(),
                what: format!("tensor `{name}` holds {} values, and {} were asked for", t.n_elements(), out.len()),
            });
        }
        quant::dequantize(&t.name, ty, bytes, out)
    }
}
