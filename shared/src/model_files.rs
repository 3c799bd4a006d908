//! One view over a model on disk, whichever format it is in: a Hugging Face directory
//! (config.json + safetensors) or a GGUF file. Tensors are looked up by [`TensorSpec`] (both
//! names and the shape), so layer code never sees format-specific names or GGUF's q/k row
//! permutation.

use crate::sampling::{SamplingDefaults, SamplingDefaultsError};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use crate::dtype::{DType, dequantize};
use crate::gguf::{GgufError, GgufFile};
use crate::model_config::{Architecture, ConfigError, ModelConfig};
use crate::safetensors_dir::{SafetensorsDir, SafetensorsError, StTensorInfo};

/// One weight tensor as a model architecture names it in both file formats, with the shape its
/// config implies. Architecture modules (`baton_worker::model::arch`) build these; this module
/// only looks them up, so a new architecture or a per-expert tensor needs no change here.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    /// Hugging Face (safetensors) name.
    pub hf: String,
    /// GGUF (llama.cpp) name.
    pub gguf: String,
    /// Row-major shape.
    pub shape: Vec<usize>,
    /// llama.cpp stores this matrix's rows interleaved within each of this many heads (Llama's
    /// q/k in GGUF files); they are put back in Hugging Face order on load.
    pub gguf_heads_permuted: Option<usize>,
    /// How Hugging Face files keep this tensor inside a larger stored one (published
    /// Qwen3.5-MoE checkpoints keep a layer's experts as 3-D tensors).
    pub hf_packing: Packing,
    /// How GGUF files keep this tensor inside a larger stored one (llama.cpp stacks a layer's
    /// experts, and keeps Qwen3-Next's `b` and `a` projections as one interleaved `ssm_ba`).
    pub gguf_packing: Packing,
    /// GGUF files store the same values, in the same order, under this shape (llama.cpp drops
    /// unit dimensions: a conv's `[channels, 1, kernel]` taps are `[channels, kernel]`).
    pub gguf_shape: Option<Vec<usize>>,
    /// Where a file without this tensor keeps it instead (the fused expert layout of newer
    /// checkpoints), looked up only when this name is absent.
    pub otherwise: Option<Box<TensorSpec>>,
}

/// How a file keeps one tensor inside a larger stored tensor; the default: on its own.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Packing {
    /// The tensor is one slice of a stack along a new first dimension.
    pub stacked: Option<StackedSlice>,
    /// The tensor is some rows of each group of a larger matrix (of the slice, if stacked).
    pub rows: Option<RowGroups>,
}

/// Where a matrix's rows lie in a larger stored one: the stored rows come in `groups` groups
/// of `group_rows`, and this matrix is rows `start..start + take` of each group, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowGroups {
    pub groups: usize,
    pub group_rows: usize,
    pub start: usize,
    pub take: usize,
}

impl RowGroups {
    /// Rows of the stored matrix.
    fn stored_rows(&self) -> usize {
        self.groups * self.group_rows
    }

    /// The picked rows (`row_len` items each) of the stored matrix `w`.
    fn pick<T: Copy>(&self, w: &[T], row_len: usize) -> Vec<T> {
        let mut out = Vec::with_capacity(self.groups * self.take * row_len);
        for g in 0..self.groups {
            let first = g * self.group_rows + self.start;
            out.extend_from_slice(&w[first * row_len..(first + self.take) * row_len]);
        }
        out
    }
}

/// Slice `index` of a tensor stacked from `count` tensors of the spec's shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StackedSlice {
    pub index: usize,
    pub count: usize,
}

impl TensorSpec {
    /// A tensor named `hf` / `gguf` with `shape`, stored in the same row order by both.
    pub fn new(hf: impl Into<String>, gguf: impl Into<String>, shape: Vec<usize>) -> Self {
        Self {
            hf: hf.into(),
            gguf: gguf.into(),
            shape,
            gguf_heads_permuted: None,
            hf_packing: Packing::default(),
            gguf_packing: Packing::default(),
            gguf_shape: None,
            otherwise: None,
        }
    }

    /// The same tensor, stored by GGUF with rows interleaved within each of `heads` heads.
    pub fn permuted_in_gguf(mut self, heads: usize) -> Self {
        self.gguf_heads_permuted = Some(heads);
        self
    }

    /// The same tensor, stored by GGUF as slice `index` of `count` stacked ones.
    pub fn stacked_in_gguf(mut self, index: usize, count: usize) -> Self {
        self.gguf_packing.stacked = Some(StackedSlice { index, count });
        self
    }

    /// The same tensor, stored by Hugging Face files as slice `index` of `count` stacked ones.
    pub fn stacked_in_hf(mut self, index: usize, count: usize) -> Self {
        self.hf_packing.stacked = Some(StackedSlice { index, count });
        self
    }

    /// The same values, stored by GGUF under `shape`.
    pub fn shaped_in_gguf(mut self, shape: Vec<usize>) -> Self {
        self.gguf_shape = Some(shape);
        self
    }

    /// The same rows, stored by GGUF as rows `start..start + take` of each of `groups`
    /// groups of `group_rows` rows (`take · groups` is this matrix's row count).
    pub fn rows_in_gguf(mut self, groups: usize, group_rows: usize, start: usize) -> Self {
        self.gguf_packing.rows = Some(self.row_groups(groups, group_rows, start));
        self
    }

    /// The same rows, stored by Hugging Face files as rows `start..start + take` of each of
    /// `groups` groups of `group_rows` rows.
    pub fn rows_in_hf(mut self, groups: usize, group_rows: usize, start: usize) -> Self {
        self.hf_packing.rows = Some(self.row_groups(groups, group_rows, start));
        self
    }

    fn row_groups(&self, groups: usize, group_rows: usize, start: usize) -> RowGroups {
        let take = self.shape[0] / groups;
        debug_assert!(take * groups == self.shape[0] && start + take <= group_rows);
        RowGroups {
            groups,
            group_rows,
            start,
            take,
        }
    }

    /// The same tensor, kept as `other` says by files that lack this one's name.
    pub fn otherwise(mut self, other: TensorSpec) -> Self {
        debug_assert_eq!(self.shape, other.shape);
        self.otherwise = Some(Box::new(other));
        self
    }
}

/// Errors loading a model from disk.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error(transparent)]
    Safetensors(#[from] SafetensorsError),
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("{path}: not a model: expected a .gguf file or a directory with config.json")]
    NotAModel { path: PathBuf },
    #[error("{source_name}: missing tensor '{name}'{}", others.iter().map(|n| format!(" (nor '{n}')")).collect::<String>())]
    MissingTensor {
        source_name: String,
        name: String,
        /// The names the tensor could also have been kept under.
        others: Vec<String>,
    },
    #[error("{source_name}: unexpected tensors not used by a {arch:?} model: {names}")]
    UnexpectedTensors {
        source_name: String,
        arch: Architecture,
        names: String,
    },
    #[error("{source_name}: tensor '{name}' has shape {found:?}, expected {expected:?}")]
    Shape {
        source_name: String,
        name: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error("{source_name}: tensor '{name}' has a non-finite value ({value}) at index {index}")]
    NonFinite {
        source_name: String,
        name: String,
        index: usize,
        value: f32,
    },
    #[error("{source_name}: tensor '{name}' cannot be kept in its stored format: {reason}")]
    Blocks {
        source_name: String,
        name: String,
        reason: String,
    },
    #[error("layer range {start}..{end} is not inside the model's {layers} layers")]
    LayerRange { start: usize, end: usize, layers: usize },
}

/// A tensor as stored: type, row-major shape and bytes.
#[derive(Debug, Clone, Copy)]
pub struct StoredTensor<'a> {
    pub dtype: DType,
    pub shape: &'a [usize],
    pub data: &'a [u8],
}

/// A model on disk.
#[derive(Debug)]
pub enum ModelFiles {
    /// A Hugging Face directory.
    HfDir { dir: PathBuf, weights: SafetensorsDir },
    /// A GGUF file.
    Gguf(GgufFile),
}

impl ModelFiles {
    /// The model's own sampling recommendation: `generation_config.json` in a Hugging Face
    /// directory, `general.sampling.*` in a GGUF file; OpenAI's defaults where it has none.
    pub fn sampling_defaults(&self) -> Result<SamplingDefaults, SamplingDefaultsError> {
        match self {
            ModelFiles::HfDir { dir, .. } => match std::fs::read_to_string(dir.join("generation_config.json")) {
                Ok(text) => SamplingDefaults::from_generation_config(&text),
                Err(_) => Ok(SamplingDefaults::default()),
            },
            ModelFiles::Gguf(g) => SamplingDefaults::with_overrides("GGUF general.sampling", |k| {
                let key = match k {
                    "temperature" => "general.sampling.temp",
                    "top_k" => "general.sampling.top_k",
                    "top_p" => "general.sampling.top_p",
                    "min_p" => "general.sampling.min_p",
                    _ => return None,
                };
                g.get(key).and_then(|v| v.as_f64())
            }),
        }
    }

    /// Open a `.gguf` file or a Hugging Face directory.
    pub fn open(path: &Path) -> Result<Self, LoadError> {
        if path.is_dir() {
            if !path.join("config.json").is_file() {
                return Err(LoadError::NotAModel { path: path.into() });
            }
            let mut weights = SafetensorsDir::open(path)?;
            if qwen3_5_layout(&path.join("config.json")) {
                text_model_names(&mut weights.tensors);
            }
            Ok(Self::HfDir {
                dir: path.into(),
                weights,
            })
        } else if path.is_file() {
            Ok(Self::Gguf(GgufFile::open(path)?))
        } else {
            Err(LoadError::NotAModel { path: path.into() })
        }
    }

    /// Whether this is a GGUF file (llama.cpp's names and conventions).
    pub fn is_gguf(&self) -> bool {
        matches!(self, Self::Gguf(_))
    }

    /// Human-readable name of the source, for error messages.
    pub fn source_name(&self) -> String {
        match self {
            Self::HfDir { dir, .. } => dir.display().to_string(),
            Self::Gguf(g) => g.path().display().to_string(),
        }
    }

    /// The model's hyper-parameters.
    pub fn config(&self) -> Result<ModelConfig, LoadError> {
        Ok(match self {
            Self::HfDir { dir, .. } => ModelConfig::from_hf_json(&dir.join("config.json"))?,
            Self::Gguf(g) => ModelConfig::from_gguf(g)?,
        })
    }

    /// The tensor's name in this file's naming scheme (GGUF or Hugging Face), where this file
    /// keeps it (see [`TensorSpec::otherwise`]).
    pub fn name_of<'s>(&self, spec: &'s TensorSpec) -> &'s str {
        self.own_name(self.resolve(spec))
    }

    fn own_name<'s>(&self, spec: &'s TensorSpec) -> &'s str {
        match self {
            Self::HfDir { .. } => &spec.hf,
            Self::Gguf(_) => &spec.gguf,
        }
    }

    /// `spec`, or the first of its [`otherwise`](TensorSpec::otherwise) chain this file holds;
    /// `spec` itself when the file holds none of them.
    fn resolve<'s>(&self, spec: &'s TensorSpec) -> &'s TensorSpec {
        let mut at = spec;
        while self.stored_as_named(at).is_none() {
            match at.otherwise.as_deref() {
                Some(next) => at = next,
                None => return spec,
            }
        }
        at
    }

    /// How this file's format keeps `spec`'s tensor.
    fn packing(&self, spec: &TensorSpec) -> Packing {
        match self {
            Self::HfDir { .. } => spec.hf_packing,
            Self::Gguf(_) => spec.gguf_packing,
        }
    }

    /// The stored tensor (the whole stored tensor where the spec is packed in a larger one), or
    /// None if the file has no such tensor.
    pub fn stored(&self, spec: &TensorSpec) -> Option<StoredTensor<'_>> {
        self.stored_as_named(self.resolve(spec))
    }

    fn stored_as_named(&self, spec: &TensorSpec) -> Option<StoredTensor<'_>> {
        let name = self.own_name(spec);
        match self {
            Self::HfDir { weights, .. } => weights.tensors.get(name).map(|t| StoredTensor {
                dtype: t.dtype,
                shape: &t.shape,
                data: weights.tensor_data(t),
            }),
            Self::Gguf(g) => g.tensors.get(name).map(|t| StoredTensor {
                dtype: t.dtype,
                shape: &t.shape,
                data: g.tensor_data(t),
            }),
        }
    }

    /// Every tensor name in the file(s).
    pub fn tensor_names(&self) -> BTreeSet<String> {
        match self {
            Self::HfDir { weights, .. } => weights.tensors.keys().cloned().collect(),
            Self::Gguf(g) => g.tensors.keys().cloned().collect(),
        }
    }

    /// Check that the files hold exactly the tensors `expected` (an architecture's whole list),
    /// with the right shapes; `tolerated` may be present too (a tied checkpoint may still carry
    /// its identical head).
    pub fn validate_complete(
        &self,
        cfg: &ModelConfig,
        expected: &[TensorSpec],
        tolerated: &[TensorSpec],
    ) -> Result<(), LoadError> {
        let source_name = self.source_name();
        let mut unexpected = self.tensor_names();
        for spec in expected {
            self.checked(self.resolve(spec))?;
            unexpected.remove(self.name_of(spec));
        }
        for spec in tolerated {
            unexpected.remove(self.name_of(spec));
        }
        // Rotary caches are derived data.
        unexpected.retain(|n| !n.ends_with("rotary_emb.inv_freq"));
        // A Qwen3.5 GGUF may carry its multi-token-prediction layers as blocks after the
        // model's own (`nextn_predict_layers`); Baton does not run them.
        if let Self::Gguf(g) = self
            && crate::model_config::gguf_nextn_layers(g) > 0
        {
            unexpected.retain(|n| gguf_block(n).is_none_or(|b| b < cfg.num_layers));
        }
        if !unexpected.is_empty() {
            let names: Vec<_> = unexpected.into_iter().take(8).collect();
            return Err(LoadError::UnexpectedTensors {
                source_name,
                arch: cfg.architecture,
                names: names.join(", "),
            });
        }
        Ok(())
    }

    /// The stored tensor of a [resolved](Self::resolve) spec, checked to exist with the shape
    /// the spec gives; for a stacked one, just the spec's slice of it; for one whose rows are
    /// kept in a larger matrix, that whole matrix (see [`picked`](Self::picked)).
    fn checked<'s>(&'s self, spec: &'s TensorSpec) -> Result<StoredTensor<'s>, LoadError> {
        let source_name = self.source_name();
        let name = self.own_name(spec);
        let t = self.stored_as_named(spec).ok_or_else(|| LoadError::MissingTensor {
            source_name: source_name.clone(),
            name: name.to_string(),
            others: std::iter::successors(spec.otherwise.as_deref(), |s| s.otherwise.as_deref())
                .map(|s| self.own_name(s).to_string())
                .collect(),
        })?;
        let packing = self.packing(spec);
        // The shape of what is stored per slice: the spec's own, or its rows' whole matrix.
        let per_slice: Vec<usize> = match packing.rows {
            Some(rows) => std::iter::once(rows.stored_rows())
                .chain(spec.shape[1..].iter().copied())
                .collect(),
            None if self.is_gguf() => spec.gguf_shape.clone().unwrap_or_else(|| spec.shape.clone()),
            None => spec.shape.clone(),
        };
        let Some(slice) = packing.stacked else {
            if self.is_gguf() && ggml_dims(t.shape) == ggml_dims(&per_slice) {
                // ggml pads every shape with unit dimensions: llama.cpp's converter writes the
                // shared expert's gate as [1, hidden] and llama.cpp loads it as [hidden].
                return Ok(t);
            }
            check_shape(&source_name, name, t.shape, &per_slice)?;
            return Ok(t);
        };
        let stacked: Vec<usize> = std::iter::once(slice.count).chain(per_slice.iter().copied()).collect();
        check_shape(&source_name, name, t.shape, &stacked)?;
        // The shape check above makes the slice whole rows of whole blocks.
        let bytes = t.dtype.n_bytes(per_slice.iter().product());
        Ok(StoredTensor {
            dtype: t.dtype,
            shape: &t.shape[1..],
            data: &t.data[slice.index * bytes..(slice.index + 1) * bytes],
        })
    }

    /// `values` (the [`checked`](Self::checked) tensor's rows, `row_len` items each) cut down
    /// to the spec's own rows where the file keeps them in a larger matrix.
    fn picked<T: Copy>(&self, spec: &TensorSpec, values: Vec<T>, row_len: usize) -> Vec<T> {
        match self.packing(spec).rows {
            Some(rows) => rows.pick(&values, row_len),
            None => values,
        }
    }

    /// GGUF's head permutation of this tensor's rows, if this file applies one.
    fn gguf_heads(&self, spec: &TensorSpec) -> Option<usize> {
        spec.gguf_heads_permuted.filter(|_| self.is_gguf())
    }

    /// One tensor's stored bytes in Hugging Face row order, for a matrix kept in the file's own
    /// block format. Shape-checked, and with `check_finite` every block's scale checked (which
    /// decides whether its values are finite, without widening them); `None` for tensors that
    /// are not 2-D block formats (Q8_0, Q4_0, Q4_1).
    pub fn load_blocks(&self, spec: &TensorSpec, check_finite: bool) -> Result<Option<(DType, Vec<u8>)>, LoadError> {
        let spec = self.resolve(spec);
        let t = self.checked(spec)?;
        if !keeps_blocks(t.dtype, &spec.shape) {
            return Ok(None);
        }
        if check_finite && let Some((index, value)) = crate::dtype::non_finite_block(t.dtype, t.data) {
            return Err(LoadError::NonFinite {
                source_name: self.source_name(),
                name: self.own_name(spec).to_string(),
                index,
                value,
            });
        }
        let row_bytes = t.dtype.n_bytes(spec.shape[1]);
        let mut data = self.picked(spec, t.data.to_vec(), row_bytes);
        if let Some(heads) = self.gguf_heads(spec) {
            data = move_rows(&data, heads, row_bytes, |gguf, hf| (gguf, hf));
        }
        Ok(Some((t.dtype, data)))
    }

    /// Load one tensor as f32 in Hugging Face layout.
    ///
    /// With `check_finite`, a NaN or infinity anywhere is an error naming the tensor.
    pub fn load_f32(&self, spec: &TensorSpec, check_finite: bool) -> Result<Vec<f32>, LoadError> {
        let spec = self.resolve(spec);
        let t = self.checked(spec)?;
        let mut out = vec![0f32; t.shape.iter().product()];
        dequantize(t.dtype, t.data, &mut out);
        let row_len = spec.shape[1..].iter().product();
        let mut out = self.picked(spec, out, row_len);
        if check_finite && let Some((index, &value)) = out.iter().enumerate().find(|(_, v)| !v.is_finite()) {
            return Err(LoadError::NonFinite {
                source_name: self.source_name(),
                name: self.own_name(spec).to_string(),
                index,
                value,
            });
        }
        if let Some(heads) = self.gguf_heads(spec) {
            out = unpermute_rows(&out, heads, spec.shape[1]);
        }
        Ok(out)
    }
}

/// Whether a tensor of `dtype` and `shape` can be kept as its ggml blocks: a 2-D Q8_0, Q4_0 or
/// Q4_1 matrix.
pub fn keeps_blocks(dtype: DType, shape: &[usize]) -> bool {
    matches!(dtype, DType::Q8_0 | DType::Q4_0 | DType::Q4_1) && shape.len() == 2
}

/// The block number of a GGUF tensor name (`blk.N.…`).
fn gguf_block(name: &str) -> Option<usize> {
    name.strip_prefix("blk.")?.split('.').next()?.parse().ok()
}

/// A shape as ggml sees it: without outer unit dimensions (ggml pads every shape to four with
/// ones, so `[1, n]` and `[n]` are the same tensor to it).
fn ggml_dims(shape: &[usize]) -> &[usize] {
    let outer_ones = shape.iter().take_while(|&&d| d == 1).count();
    &shape[outer_ones.min(shape.len().saturating_sub(1))..]
}

fn check_shape(source_name: &str, name: &str, found: &[usize], expected: &[usize]) -> Result<(), LoadError> {
    if found != expected {
        return Err(LoadError::Shape {
            source_name: source_name.into(),
            name: name.into(),
            expected: expected.to_vec(),
            found: found.to_vec(),
        });
    }
    Ok(())
}

/// Undo llama.cpp's conversion permutation of q/k rows.
///
/// The converter reorders each head's rows from "first half, second half" (rotate-half RoPE) to
/// interleaved pairs; row `2i + j` of a GGUF head is row `j * head_dim/2 + i` of the HF head.
pub fn unpermute_rows(w: &[f32], n_heads: usize, cols: usize) -> Vec<f32> {
    move_rows(w, n_heads, cols, |gguf, hf| (gguf, hf))
}

/// Inverse of [`unpermute_rows`]: Hugging Face layout to GGUF layout.
pub fn permute_rows(w: &[f32], n_heads: usize, cols: usize) -> Vec<f32> {
    move_rows(w, n_heads, cols, |gguf, hf| (hf, gguf))
}

/// Copy rows between the GGUF and HF orders; `pick(gguf_row, hf_row)` gives `(src, dst)`.
fn move_rows<T: Copy + Default>(
    w: &[T],
    n_heads: usize,
    cols: usize,
    pick: impl Fn(usize, usize) -> (usize, usize),
) -> Vec<T> {
    let head_dim = w.len() / cols / n_heads;
    let half = head_dim / 2;
    let mut out = vec![T::default(); w.len()];
    for h in 0..n_heads {
        for i in 0..half {
            for j in 0..2 {
                let (src, dst) = pick(h * head_dim + 2 * i + j, h * head_dim + j * half + i);
                out[dst * cols..(dst + 1) * cols].copy_from_slice(&w[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

/// Whether `config` is a Qwen3.5 model's (text, MoE text, or the multimodal wrappers), whose
/// published checkpoints keep the text model under `model.language_model.`.
fn qwen3_5_layout(config: &Path) -> bool {
    let Ok(text) = std::fs::read_to_string(config) else {
        return false;
    };
    let Ok(json) = serde_json::from_str::<serde_json::Value>(&text) else {
        return false;
    };
    let model_type = json.get("model_type").and_then(|v| v.as_str()).unwrap_or("");
    crate::model_config::language_model_prefixed(model_type)
}

/// A Qwen3.5 checkpoint as published holds the multimodal model: the text model's tensors
/// under `model.language_model.`, the vision tower under `model.visual.` and the multi-token
/// prediction layers under `mtp.`. Baton serves the text model: its tensors take the names a
/// text-only checkpoint gives them, and the others are set aside (as transformers' text model
/// ignores them).
fn text_model_names(tensors: &mut BTreeMap<String, StTensorInfo>) {
    let names: Vec<String> = tensors
        .keys()
        .filter(|n| n.starts_with("model.language_model.") || n.starts_with("model.visual.") || n.starts_with("mtp."))
        .cloned()
        .collect();
    for name in names {
        let Some(t) = tensors.remove(&name) else { continue };
        if let Some(rest) = name.strip_prefix("model.language_model.") {
            tensors.insert(format!("model.{rest}"), t);
        }
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn a_published_qwen3_5_checkpoint_keeps_its_text_model_under_plain_names() {
        let dir = std::env::temp_dir().join(format!("baton-qwen35-names-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let stored = [
            "model.language_model.embed_tokens.weight",
            "model.language_model.layers.0.mlp.gate.weight",
            "model.visual.blocks.0.attn.qkv.weight",
            "mtp.layers.0.mlp.gate.weight",
            "lm_head.weight",
        ];
        let data = [0u8; 8];
        let views = stored.map(|n| {
            let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![2], &data).unwrap();
            (n, view)
        });
        safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
        for (model_type, renamed) in [("qwen3_5_moe", true), ("qwen3_5_text", true), ("qwen3_moe", false)] {
            std::fs::write(dir.join("config.json"), format!("{{\"model_type\": \"{model_type}\"}}")).unwrap();
            let names = ModelFiles::open(&dir).unwrap().tensor_names();
            let want: BTreeSet<String> = match renamed {
                true => [
                    "model.embed_tokens.weight",
                    "model.layers.0.mlp.gate.weight",
                    "lm_head.weight",
                ]
                .map(String::from)
                .into(),
                false => stored.map(String::from).into(),
            };
            assert_eq!(names, want, "{model_type}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    use super::*;

    #[test]
    fn ggml_shapes_ignore_outer_unit_dimensions_only() {
        assert_eq!(ggml_dims(&[1, 64]), ggml_dims(&[64]));
        assert_eq!(ggml_dims(&[1, 1, 8, 4]), &[8, 4]);
        assert_eq!(ggml_dims(&[1]), &[1]);
        assert_ne!(ggml_dims(&[64, 1]), ggml_dims(&[64]), "an inner unit dimension is kept");
        assert_ne!(ggml_dims(&[2, 64]), ggml_dims(&[64]));
    }

    #[test]
    fn permutation_roundtrip_and_layout() {
        // 2 heads of head_dim 4, 1 column: HF rows [a0 a1 | b0 b1] become GGUF [a0 b0 a1 b1].
        let hf: Vec<f32> = (0..8).map(|x| x as f32).collect();
        let gg = permute_rows(&hf, 2, 1);
        assert_eq!(gg, vec![0., 2., 1., 3., 4., 6., 5., 7.]);
        assert_eq!(unpermute_rows(&gg, 2, 1), hf);
    }

    #[test]
    fn a_stacked_gguf_tensor_gives_each_expert_its_own_rows_and_blocks() {
        use crate::gguf::writer::{TensorToWrite, to_bytes};
        // Three experts of 2 × 32 as one Q8_0 [3, 2, 32] tensor: each row one block with scale
        // 1.0 (f16 0x3C00) and every quant equal to 10 × expert + row.
        let mut data = Vec::new();
        for e in 0..3u8 {
            for row in 0..2u8 {
                data.extend_from_slice(&0x3C00u16.to_le_bytes());
                data.extend(std::iter::repeat_n(10 * e + row, 32));
            }
        }
        let tensor = TensorToWrite {
            name: "blk.0.ffn_up_exps.weight".into(),
            shape: vec![3, 2, 32],
            ggml_type: 8,
            data,
        };
        let path = std::env::temp_dir().join(format!("baton-stacked-{}.gguf", std::process::id()));
        std::fs::write(&path, to_bytes(&[], &[tensor])).unwrap();
        let files = ModelFiles::open(&path).unwrap();
        let spec = |e| TensorSpec::new("up", "blk.0.ffn_up_exps.weight", vec![2, 32]).stacked_in_gguf(e, 3);
        let values = files.load_f32(&spec(1), true).unwrap();
        assert_eq!(values.len(), 64);
        assert!(values[..32].iter().all(|&v| v == 10.0) && values[32..].iter().all(|&v| v == 11.0));
        let (dtype, blocks) = files.load_blocks(&spec(2), true).unwrap().unwrap();
        assert_eq!((dtype, blocks.len()), (DType::Q8_0, 2 * 34));
        assert_eq!(blocks[2], 20);
        // A file with a different expert count is refused by name and shape.
        let wrong = TensorSpec::new("up", "blk.0.ffn_up_exps.weight", vec![2, 32]).stacked_in_gguf(0, 4);
        let e = files.load_f32(&wrong, true).unwrap_err().to_string();
        assert!(e.contains("ffn_up_exps") && e.contains("[4, 2, 32]"), "{e}");
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn rows_picked_from_groups_of_a_gguf_matrix_keep_their_order_and_blocks() {
        use crate::gguf::writer::{TensorToWrite, to_bytes};
        // Qwen3-Next's `ssm_ba` for 2 key heads of 3 value heads each: per key head 3 rows of
        // b, then 3 of a; one Q8_0 block per row, every quant equal to the row's index.
        let mut data = Vec::new();
        for row in 0..12u8 {
            data.extend_from_slice(&0x3C00u16.to_le_bytes());
            data.extend(std::iter::repeat_n(row, 32));
        }
        let tensor = TensorToWrite {
            name: "blk.0.ssm_ba.weight".into(),
            shape: vec![12, 32],
            ggml_type: 8,
            data,
        };
        let path = std::env::temp_dir().join(format!("baton-rows-{}.gguf", std::process::id()));
        std::fs::write(&path, to_bytes(&[], &[tensor])).unwrap();
        let files = ModelFiles::open(&path).unwrap();
        let spec = |start| TensorSpec::new("ba", "blk.0.ssm_ba.weight", vec![6, 32]).rows_in_gguf(2, 6, start);
        let rows = |values: &[f32]| -> Vec<f32> { values.chunks(32).map(|r| r[0]).collect() };
        assert_eq!(rows(&files.load_f32(&spec(0), true).unwrap()), [0., 1., 2., 6., 7., 8.]);
        let (_, blocks) = files.load_blocks(&spec(3), true).unwrap().unwrap();
        let firsts: Vec<u8> = blocks.chunks(34).map(|b| b[2]).collect();
        assert_eq!(firsts, [3, 4, 5, 9, 10, 11]);
        // A stored matrix of another height is refused by name and shape.
        let wrong = TensorSpec::new("ba", "blk.0.ssm_ba.weight", vec![6, 32]).rows_in_gguf(2, 5, 0);
        let e = files.load_f32(&wrong, true).unwrap_err().to_string();
        assert!(e.contains("ssm_ba") && e.contains("[12, 32]"), "{e}");
        // Another shape for the same values: a conv's unit dimension dropped.
        let squeezed = TensorSpec::new("ba", "blk.0.ssm_ba.weight", vec![12, 1, 32]).shaped_in_gguf(vec![12, 32]);
        assert_eq!(files.load_f32(&squeezed, true).unwrap().len(), 12 * 32);
        std::fs::remove_file(&path).unwrap();
    }

    /// Expert `e`'s up projection (`[2, cols]`), per expert or else in the fused layout: gate
    /// and up as one `[2, 4, cols]` tensor, each expert's 2 gate rows before its 2 up rows.
    fn expert_up(e: usize, cols: usize) -> TensorSpec {
        let fused = TensorSpec::new(
            "model.layers.0.mlp.experts.gate_up_proj",
            "blk.0.ffn_gate_up_exps.weight",
            vec![2, cols],
        )
        .stacked_in_hf(e, 2)
        .stacked_in_gguf(e, 2)
        .rows_in_hf(1, 4, 2)
        .rows_in_gguf(1, 4, 2);
        TensorSpec::new(
            format!("model.layers.0.mlp.experts.{e}.up_proj.weight"),
            "blk.0.ffn_up_exps.weight",
            vec![2, cols],
        )
        .stacked_in_gguf(e, 2)
        .otherwise(fused)
    }

    #[test]
    fn fused_experts_are_read_where_the_per_expert_names_are_absent() {
        use crate::gguf::writer::{TensorToWrite, to_bytes};
        // GGUF: Q8_0 [2, 4, 32], one block per row with scale 1.0 and every quant 10 × expert +
        // row; expert 1's up rows are 12 and 13.
        let mut data = Vec::new();
        for e in 0..2u8 {
            for row in 0..4u8 {
                data.extend_from_slice(&0x3C00u16.to_le_bytes());
                data.extend(std::iter::repeat_n(10 * e + row, 32));
            }
        }
        let tensor = TensorToWrite {
            name: "blk.0.ffn_gate_up_exps.weight".into(),
            shape: vec![2, 4, 32],
            ggml_type: 8,
            data,
        };
        let path = std::env::temp_dir().join(format!("baton-fused-{}.gguf", std::process::id()));
        std::fs::write(&path, to_bytes(&[], &[tensor])).unwrap();
        let files = ModelFiles::open(&path).unwrap();
        let spec = expert_up(1, 32);
        assert_eq!(files.name_of(&spec), "blk.0.ffn_gate_up_exps.weight");
        let firsts = |v: &[f32]| -> Vec<f32> { v.chunks(32).map(|r| r[0]).collect() };
        assert_eq!(firsts(&files.load_f32(&spec, true).unwrap()), [12., 13.]);
        let (dtype, blocks) = files.load_blocks(&expert_up(0, 32), true).unwrap().unwrap();
        assert_eq!(
            (dtype, blocks.len(), blocks[2], blocks[34 + 2]),
            (DType::Q8_0, 2 * 34, 2, 3)
        );
        // A file with neither layout is refused naming both.
        let mut absent = expert_up(1, 32);
        absent.otherwise.as_mut().unwrap().gguf = "blk.0.ffn_gate_up.weight".into();
        let e = files.load_f32(&absent, true).unwrap_err().to_string();
        assert!(
            e.contains("missing tensor 'blk.0.ffn_up_exps.weight' (nor 'blk.0.ffn_gate_up.weight')"),
            "{e}"
        );
        std::fs::remove_file(&path).unwrap();

        // Hugging Face: F32 [2, 4, 3] under the name published Qwen3.5-MoE checkpoints use.
        let dir = std::env::temp_dir().join(format!("baton-fused-hf-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("config.json"), r#"{"model_type": "qwen3_moe"}"#).unwrap();
        let values: Vec<u8> = (0..24).flat_map(|i| (i as f32).to_le_bytes()).collect();
        let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![2, 4, 3], &values).unwrap();
        let name = "model.layers.0.mlp.experts.gate_up_proj";
        safetensors::serialize_to_file([(name, view)], None, &dir.join("model.safetensors")).unwrap();
        let files = ModelFiles::open(&dir).unwrap();
        // Expert 1 starts at value 12; its up rows are its rows 2 and 3.
        assert_eq!(
            files.load_f32(&expert_up(1, 3), true).unwrap(),
            [18., 19., 20., 21., 22., 23.]
        );
        assert_eq!(
            files.load_f32(&expert_up(0, 3), true).unwrap(),
            [6., 7., 8., 9., 10., 11.]
        );
        // The stack's shape is checked against the spec's expert count and rows.
        let e = files.load_f32(&expert_up(1, 4), true).unwrap_err().to_string();
        assert!(e.contains("gate_up_proj") && e.contains("[2, 4, 4]"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn blocks_kept_as_stored_are_checked_by_their_scales() {
        use crate::gguf::writer::{TensorToWrite, to_bytes};
        // Two Q8_0 rows of one block each; the second row's scale is an f16 NaN.
        let mut data = Vec::new();
        for scale in [0x3C00u16, 0x7E00] {
            data.extend_from_slice(&scale.to_le_bytes());
            data.extend([1u8; 32]);
        }
        let tensor = TensorToWrite {
            name: "w".into(),
            shape: vec![2, 32],
            ggml_type: 8,
            data,
        };
        let path = std::env::temp_dir().join(format!("baton-nan-scale-{}.gguf", std::process::id()));
        std::fs::write(&path, to_bytes(&[], &[tensor])).unwrap();
        let files = ModelFiles::open(&path).unwrap();
        let spec = TensorSpec::new("w", "w", vec![2, 32]);
        let e = files.load_blocks(&spec, true).unwrap_err().to_string();
        assert!(e.contains("'w' has a non-finite value (NaN) at index 32"), "{e}");
        // The same answer the widened values give.
        let e = files.load_f32(&spec, true).unwrap_err().to_string();
        assert!(e.contains("at index 32"), "{e}");
        assert!(files.load_blocks(&spec, false).unwrap().is_some());
        std::fs::remove_file(&path).unwrap();
    }
}
