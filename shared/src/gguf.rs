//! GGUF (v2/v3) reader: header, metadata, tensor infos and tensor data, memory-mapped.
//!
//! Every length and offset read from the file is checked against the file size before use,
//! so a truncated or corrupt file gives a [`GgufError`] naming the file and the offending part.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use crate::dtype::DType;

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;
/// Bounds that no real model file comes near; they keep a corrupt count from allocating the world.
const MAX_TENSORS: u64 = 1 << 20;
const MAX_METADATA: u64 = 1 << 20;
const MAX_DIMS: u32 = 4;

/// Errors reading a GGUF file.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("{path}: cannot open: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}: not a GGUF file (magic bytes are {found:?}, expected \"GGUF\")")]
    BadMagic { path: PathBuf, found: [u8; 4] },
    #[error("{path}: unsupported GGUF version {version} (supported: 2, 3)")]
    Version { path: PathBuf, version: u32 },
    #[error("{path}: truncated or corrupt while reading {what} at byte {offset}")]
    Truncated { path: PathBuf, what: String, offset: u64 },
    #[error("{path}: corrupt: {what}")]
    Corrupt { path: PathBuf, what: String },
    #[error("{path}: tensor '{tensor}' has ggml type {ggml_type} ({type_name}), which Baton does not support")]
    UnsupportedType {
        path: PathBuf,
        tensor: String,
        ggml_type: u32,
        type_name: &'static str,
    },
}

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Vec<GgufValue>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl GgufValue {
    /// The value as an unsigned integer, when it is a non-negative integer of any width.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            GgufValue::U8(v) => Some(v.into()),
            GgufValue::U16(v) => Some(v.into()),
            GgufValue::U32(v) => Some(v.into()),
            GgufValue::U64(v) => Some(v),
            GgufValue::I8(v) => u64::try_from(v).ok(),
            GgufValue::I16(v) => u64::try_from(v).ok(),
            GgufValue::I32(v) => u64::try_from(v).ok(),
            GgufValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a float, when it is numeric.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            GgufValue::F32(v) => Some(v.into()),
            GgufValue::F64(v) => Some(v),
            _ => self.as_u64().map(|v| v as f64),
        }
    }

    /// The value as a string slice.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }

    /// The value as a bool.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            GgufValue::Bool(b) => Some(b),
            _ => None,
        }
    }

    /// The value as an array.
    pub fn as_array(&self) -> Option<&[GgufValue]> {
        match self {
            GgufValue::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// Where one tensor lives in the file.
#[derive(Debug, Clone)]
pub struct GgufTensorInfo {
    pub name: String,
    /// Shape in row-major (PyTorch) order: outermost dimension first.
    pub shape: Vec<usize>,
    pub dtype: DType,
    /// Absolute byte offset of the data in the file.
    pub offset: usize,
    pub n_bytes: usize,
}

/// An opened, memory-mapped GGUF file.
pub struct GgufFile {
    path: PathBuf,
    mmap: Mmap,
    pub version: u32,
    pub metadata: BTreeMap<String, GgufValue>,
    pub tensors: BTreeMap<String, GgufTensorInfo>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

struct Cursor<'a> {
    path: &'a Path,
    data: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], GgufError> {
        match self.pos.checked_add(n) {
            Some(end) if end <= self.data.len() => {
                let s = &self.data[self.pos..end];
                self.pos = end;
                Ok(s)
            }
            _ => Err(GgufError::Truncated {
                path: self.path.to_path_buf(),
                what: what.to_string(),
                offset: self.pos as u64,
            }),
        }
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], GgufError> {
        let s = self.take(N, what)?;
        let mut out = [0u8; N];
        out.copy_from_slice(s);
        Ok(out)
    }

    fn u32(&mut self, what: &str) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A length that must fit in what is left of the file (each element takes at least `min_elem` bytes).
    fn len(&mut self, what: &str, min_elem: usize) -> Result<usize, GgufError> {
        let at = self.pos as u64;
        let n = self.u64(what)?;
        let left = (self.data.len() - self.pos) as u64;
        if n.saturating_mul(min_elem.max(1) as u64) > left {
            return Err(GgufError::Truncated {
                path: self.path.to_path_buf(),
                what: format!("{what} (length {n})"),
                offset: at,
            });
        }
        Ok(n as usize)
    }

    fn string(&mut self, what: &str) -> Result<String, GgufError> {
        let n = self.len(what, 1)?;
        let bytes = self.take(n, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| GgufError::Corrupt {
            path: self.path.to_path_buf(),
            what: format!("{what} is not valid UTF-8"),
        })
    }

    fn value(&mut self, ty: u32, what: &str, depth: u32) -> Result<GgufValue, GgufError> {
        Ok(match ty {
            0 => GgufValue::U8(self.array::<1>(what)?[0]),
            1 => GgufValue::I8(self.array::<1>(what)?[0] as i8),
            2 => GgufValue::U16(u16::from_le_bytes(self.array(what)?)),
            3 => GgufValue::I16(i16::from_le_bytes(self.array(what)?)),
            4 => GgufValue::U32(self.u32(what)?),
            5 => GgufValue::I32(i32::from_le_bytes(self.array(what)?)),
            6 => GgufValue::F32(f32::from_le_bytes(self.array(what)?)),
            7 => GgufValue::Bool(self.array::<1>(what)?[0] != 0),
            8 => GgufValue::String(self.string(what)?),
            9 if depth == 0 => {
                let elem_ty = self.u32(what)?;
                let n = self.len(what, 1)?;
                let mut items = Vec::with_capacity(n.min(1 << 20));
                for _ in 0..n {
                    items.push(self.value(elem_ty, what, depth + 1)?);
                }
                GgufValue::Array(items)
            }
            10 => GgufValue::U64(self.u64(what)?),
            11 => GgufValue::I64(i64::from_le_bytes(self.array(what)?)),
            12 => GgufValue::F64(f64::from_le_bytes(self.array(what)?)),
            _ => {
                return Err(GgufError::Corrupt {
                    path: self.path.to_path_buf(),
                    what: format!("{what} has unknown metadata value type {ty}"),
                });
            }
        })
    }
}

impl GgufFile {
    /// Open and parse a GGUF file; tensor data stays memory-mapped until asked for.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, GgufError> {
        let path = path.as_ref().to_path_buf();
        let io = |source| GgufError::Io {
            path: path.clone(),
            source,
        };
        let file = File::open(&path).map_err(io)?;
        // SAFETY: the mapping is read-only; Baton never writes model files while serving them.
        let mmap = unsafe { Mmap::map(&file) }.map_err(io)?;
        let mut c = Cursor {
            path: &path,
            data: &mmap,
            pos: 0,
        };
        let magic: [u8; 4] = c.array("magic")?;
        if &magic != MAGIC {
            return Err(GgufError::BadMagic {
                path: path.clone(),
                found: magic,
            });
        }
        let version = c.u32("version")?;
        if !(2..=3).contains(&version) {
            return Err(GgufError::Version {
                path: path.clone(),
                version,
            });
        }
        let n_tensors = c.u64("tensor count")?;
        let n_kv = c.u64("metadata count")?;
        if n_tensors > MAX_TENSORS || n_kv > MAX_METADATA {
            return Err(GgufError::Corrupt {
                path: path.clone(),
                what: format!("implausible counts: {n_tensors} tensors, {n_kv} metadata entries"),
            });
        }
        let mut metadata = BTreeMap::new();
        for i in 0..n_kv {
            let key = c.string(&format!("metadata key #{i}"))?;
            let ty = c.u32(&format!("type of metadata '{key}'"))?;
            let value = c.value(ty, &format!("metadata '{key}'"), 0)?;
            metadata.insert(key, value);
        }
        let mut infos = Vec::with_capacity(n_tensors as usize);
        for i in 0..n_tensors {
            let name = c.string(&format!("tensor name #{i}"))?;
            let n_dims = c.u32(&format!("dimension count of tensor '{name}'"))?;
            if n_dims == 0 || n_dims > MAX_DIMS {
                return Err(GgufError::Corrupt {
                    path: path.clone(),
                    what: format!("tensor '{name}' has {n_dims} dimensions"),
                });
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                dims.push(c.u64(&format!("dimensions of tensor '{name}'"))?);
            }
            let ggml_type = c.u32(&format!("type of tensor '{name}'"))?;
            let offset = c.u64(&format!("offset of tensor '{name}'"))?;
            infos.push((name, dims, ggml_type, offset));
        }
        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(v) => match v.as_u64() {
                Some(a) if a > 0 && a.is_power_of_two() => a,
                _ => {
                    return Err(GgufError::Corrupt {
                        path: path.clone(),
                        what: format!("general.alignment is {v:?}, expected a power of two"),
                    });
                }
            },
        };
        let data_start = (c.pos as u64).div_ceil(alignment) * alignment;
        let file_len = mmap.len() as u64;
        let mut tensors = BTreeMap::new();
        for (name, dims, ggml_type, rel) in infos {
            let dtype = DType::from_ggml(ggml_type).map_err(|type_name| GgufError::UnsupportedType {
                path: path.clone(),
                tensor: name.clone(),
                ggml_type,
                type_name,
            })?;
            let corrupt = |what: String| GgufError::Corrupt {
                path: path.clone(),
                what,
            };
            let n_elems = dims
                .iter()
                .try_fold(1u64, |acc, &d| acc.checked_mul(d))
                .filter(|&n| n > 0 && n < (1 << 40));
            let Some(n_elems) = n_elems else {
                return Err(corrupt(format!("tensor '{name}' has implausible shape {dims:?}")));
            };
            if dims[0] % dtype.block_size() as u64 != 0 {
                return Err(corrupt(format!(
                    "tensor '{name}' row length {} is not a multiple of the {dtype} block size {}",
                    dims[0],
                    dtype.block_size()
                )));
            }
            let n_bytes = dtype.n_bytes(n_elems as usize);
            let start = data_start.checked_add(rel).filter(|_| rel % alignment == 0);
            let end = start.and_then(|s| s.checked_add(n_bytes as u64));
            match (start, end) {
                (Some(s), Some(e)) if e <= file_len => {
                    // GGUF lists the innermost dimension first; Baton uses row-major order.
                    let shape = dims.iter().rev().map(|&d| d as usize).collect();
                    let info = GgufTensorInfo {
                        name: name.clone(),
                        shape,
                        dtype,
                        offset: s as usize,
                        n_bytes,
                    };
                    if tensors.insert(name.clone(), info).is_some() {
                        return Err(corrupt(format!("tensor '{name}' appears twice")));
                    }
                }
                _ => {
                    return Err(GgufError::Truncated {
                        path: path.clone(),
                        what: format!("data of tensor '{name}' ({n_bytes} bytes at relative offset {rel})"),
                        offset: data_start.saturating_add(rel),
                    });
                }
            }
        }
        Ok(GgufFile {
            path,
            mmap,
            version,
            metadata,
            tensors,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The raw bytes of a tensor (validated at open to lie inside the file).
    pub fn tensor_data(&self, info: &GgufTensorInfo) -> &[u8] {
        &self.mmap[info.offset..info.offset + info.n_bytes]
    }

    /// A metadata entry.
    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.metadata.get(key)
    }

    /// A metadata string, or None when missing or of another type.
    pub fn get_str(&self, key: &str) -> Option<&str> {
        self.get(key).and_then(GgufValue::as_str)
    }

    /// A metadata integer, or None when missing or not an integer.
    pub fn get_u64(&self, key: &str) -> Option<u64> {
        self.get(key).and_then(GgufValue::as_u64)
    }

    /// A metadata float, or None when missing or not numeric.
    pub fn get_f64(&self, key: &str) -> Option<f64> {
        self.get(key).and_then(GgufValue::as_f64)
    }
}

/// Writes GGUF files; used by tests to build small and deliberately broken files.
pub mod writer {
    use super::GgufValue;

    /// One tensor to write: name, row-major shape, ggml type id and its raw bytes.
    pub struct TensorToWrite {
        pub name: String,
        pub shape: Vec<usize>,
        pub ggml_type: u32,
        pub data: Vec<u8>,
    }

    fn put_str(out: &mut Vec<u8>, s: &str) {
        out.extend_from_slice(&(s.len() as u64).to_le_bytes());
        out.extend_from_slice(s.as_bytes());
    }

    fn type_id(v: &GgufValue) -> u32 {
        match v {
            GgufValue::U8(_) => 0,
            GgufValue::I8(_) => 1,
            GgufValue::U16(_) => 2,
            GgufValue::I16(_) => 3,
            GgufValue::U32(_) => 4,
            GgufValue::I32(_) => 5,
            GgufValue::F32(_) => 6,
            GgufValue::Bool(_) => 7,
            GgufValue::String(_) => 8,
            GgufValue::Array(_) => 9,
            GgufValue::U64(_) => 10,
            GgufValue::I64(_) => 11,
            GgufValue::F64(_) => 12,
        }
    }

    fn put_value(out: &mut Vec<u8>, v: &GgufValue) {
        match v {
            GgufValue::U8(x) => out.push(*x),
            GgufValue::I8(x) => out.push(*x as u8),
            GgufValue::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
            GgufValue::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
            GgufValue::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
            GgufValue::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
            GgufValue::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
            GgufValue::Bool(x) => out.push(u8::from(*x)),
            GgufValue::String(s) => put_str(out, s),
            GgufValue::Array(items) => {
                let elem = items.first().map(type_id).unwrap_or(4);
                out.extend_from_slice(&elem.to_le_bytes());
                out.extend_from_slice(&(items.len() as u64).to_le_bytes());
                for item in items {
                    put_value(out, item);
                }
            }
            GgufValue::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
            GgufValue::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
            GgufValue::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
        }
    }

    /// Tensor data offsets are multiples of this.
    pub const ALIGN: usize = 32;

    /// One tensor's entry in the header: name, row-major shape, ggml type id and byte size.
    pub struct TensorHeader {
        pub name: String,
        pub shape: Vec<usize>,
        pub ggml_type: u32,
        pub n_bytes: usize,
    }

    /// The header of a GGUF v3 file (magic, metadata, tensor table), padded to [`ALIGN`]: the
    /// tensors' data follows in `tensors`' order, each padded to [`ALIGN`].
    pub fn header_bytes<'a>(
        metadata: &[(String, GgufValue)],
        tensors: impl ExactSizeIterator<Item = &'a TensorHeader>,
    ) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(b"GGUF");
        out.extend_from_slice(&3u32.to_le_bytes());
        out.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
        for (k, v) in metadata {
            put_str(&mut out, k);
            out.extend_from_slice(&type_id(v).to_le_bytes());
            put_value(&mut out, v);
        }
        let mut offset = 0usize;
        for t in tensors {
            put_str(&mut out, &t.name);
            out.extend_from_slice(&(t.shape.len() as u32).to_le_bytes());
            for d in t.shape.iter().rev() {
                out.extend_from_slice(&(*d as u64).to_le_bytes());
            }
            out.extend_from_slice(&t.ggml_type.to_le_bytes());
            out.extend_from_slice(&(offset as u64).to_le_bytes());
            offset += t.n_bytes.div_ceil(ALIGN) * ALIGN;
        }
        out.resize(out.len().div_ceil(ALIGN) * ALIGN, 0);
        out
    }

    /// Zero bytes that pad `n` bytes of data to [`ALIGN`].
    pub fn padding(n: usize) -> usize {
        n.div_ceil(ALIGN) * ALIGN - n
    }

    /// Serialize a GGUF v3 file with 32-byte alignment.
    pub fn to_bytes(metadata: &[(String, GgufValue)], tensors: &[TensorToWrite]) -> Vec<u8> {
        let headers: Vec<TensorHeader> = tensors
            .iter()
            .map(|t| TensorHeader {
                name: t.name.clone(),
                shape: t.shape.clone(),
                ggml_type: t.ggml_type,
                n_bytes: t.data.len(),
            })
            .collect();
        let mut out = header_bytes(metadata, headers.iter());
        for t in tensors {
            out.extend_from_slice(&t.data);
            out.resize(out.len() + padding(t.data.len()), 0);
        }
        out
    }
}
