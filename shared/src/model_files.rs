//! One view over a model on disk, whichever format it is in: a Hugging Face directory
//! (config.json + safetensors) or a GGUF file. Tensors are named by [`TensorRole`] and layer,
//! so the layer code never sees format-specific names or GGUF's q/k row permutation.

use crate::sampling::{SamplingDefaults, SamplingDefaultsError};
use std::collections::BTreeSet;
use std::ops::Range;
use std::path::{Path, PathBuf};

use crate::dtype::{DType, dequantize};
use crate::gguf::{GgufError, GgufFile};
use crate::model_config::{Architecture, ConfigError, ModelConfig};
use crate::safetensors_dir::{SafetensorsDir, SafetensorsError};

/// What a weight tensor is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum TensorRole {
    Embedding,
    AttnNorm,
    Q,
    K,
    V,
    QBias,
    KBias,
    VBias,
    QNorm,
    KNorm,
    O,
    FfnNorm,
    Gate,
    Up,
    Down,
    FinalNorm,
    LmHead,
}

impl TensorRole {
    /// Roles inside each decoder layer for an architecture.
    pub fn layer_roles(cfg: &ModelConfig) -> Vec<TensorRole> {
        use TensorRole::*;
        let mut roles = vec![AttnNorm, Q, K, V, O, FfnNorm, Gate, Up, Down];
        if cfg.qkv_bias {
            roles.extend([QBias, KBias, VBias]);
        }
        if cfg.qk_norm {
            roles.extend([QNorm, KNorm]);
        }
        roles
    }

    /// Hugging Face tensor name.
    pub fn hf_name(self, layer: Option<usize>) -> String {
        let l = layer.unwrap_or(0);
        let p = format!("model.layers.{l}");
        match self {
            Self::Embedding => "model.embed_tokens.weight".into(),
            Self::FinalNorm => "model.norm.weight".into(),
            Self::LmHead => "lm_head.weight".into(),
            Self::AttnNorm => format!("{p}.input_layernorm.weight"),
            Self::Q => format!("{p}.self_attn.q_proj.weight"),
            Self::K => format!("{p}.self_attn.k_proj.weight"),
            Self::V => format!("{p}.self_attn.v_proj.weight"),
            Self::QBias => format!("{p}.self_attn.q_proj.bias"),
            Self::KBias => format!("{p}.self_attn.k_proj.bias"),
            Self::VBias => format!("{p}.self_attn.v_proj.bias"),
            Self::QNorm => format!("{p}.self_attn.q_norm.weight"),
            Self::KNorm => format!("{p}.self_attn.k_norm.weight"),
            Self::O => format!("{p}.self_attn.o_proj.weight"),
            Self::FfnNorm => format!("{p}.post_attention_layernorm.weight"),
            Self::Gate => format!("{p}.mlp.gate_proj.weight"),
            Self::Up => format!("{p}.mlp.up_proj.weight"),
            Self::Down => format!("{p}.mlp.down_proj.weight"),
        }
    }

    /// GGUF (llama.cpp) tensor name.
    pub fn gguf_name(self, layer: Option<usize>) -> String {
        let l = layer.unwrap_or(0);
        let p = format!("blk.{l}");
        match self {
            Self::Embedding => "token_embd.weight".into(),
            Self::FinalNorm => "output_norm.weight".into(),
            Self::LmHead => "output.weight".into(),
            Self::AttnNorm => format!("{p}.attn_norm.weight"),
            Self::Q => format!("{p}.attn_q.weight"),
            Self::K => format!("{p}.attn_k.weight"),
            Self::V => format!("{p}.attn_v.weight"),
            Self::QBias => format!("{p}.attn_q.bias"),
            Self::KBias => format!("{p}.attn_k.bias"),
            Self::VBias => format!("{p}.attn_v.bias"),
            Self::QNorm => format!("{p}.attn_q_norm.weight"),
            Self::KNorm => format!("{p}.attn_k_norm.weight"),
            Self::O => format!("{p}.attn_output.weight"),
            Self::FfnNorm => format!("{p}.ffn_norm.weight"),
            Self::Gate => format!("{p}.ffn_gate.weight"),
            Self::Up => format!("{p}.ffn_up.weight"),
            Self::Down => format!("{p}.ffn_down.weight"),
        }
    }

    /// Expected row-major shape.
    pub fn shape(self, c: &ModelConfig) -> Vec<usize> {
        let (h, q, kv, f, v, d) = (
            c.hidden_size,
            c.q_dim(),
            c.kv_dim(),
            c.intermediate_size,
            c.vocab_size,
            c.head_dim,
        );
        match self {
            Self::Embedding | Self::LmHead => vec![v, h],
            Self::AttnNorm | Self::FfnNorm | Self::FinalNorm => vec![h],
            Self::Q => vec![q, h],
            Self::K | Self::V => vec![kv, h],
            Self::QBias => vec![q],
            Self::KBias | Self::VBias => vec![kv],
            Self::QNorm | Self::KNorm => vec![d],
            Self::O => vec![h, q],
            Self::Gate | Self::Up => vec![f, h],
            Self::Down => vec![h, f],
        }
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
    #[error("{source_name}: missing tensor '{name}'")]
    MissingTensor { source_name: String, name: String },
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
            Ok(Self::HfDir {
                dir: path.into(),
                weights: SafetensorsDir::open(path)?,
            })
        } else if path.is_file() {
            Ok(Self::Gguf(GgufFile::open(path)?))
        } else {
            Err(LoadError::NotAModel { path: path.into() })
        }
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

    /// The tensor's name in this file's naming scheme (GGUF or Hugging Face).
    pub fn name_of(&self, role: TensorRole, layer: Option<usize>) -> String {
        match self {
            Self::HfDir { .. } => role.hf_name(layer),
            Self::Gguf(_) => role.gguf_name(layer),
        }
    }

    /// The stored tensor for a role, or None if the file has no such tensor.
    pub fn stored(&self, role: TensorRole, layer: Option<usize>) -> Option<StoredTensor<'_>> {
        let name = self.name_of(role, layer);
        match self {
            Self::HfDir { weights, .. } => weights.tensors.get(&name).map(|t| StoredTensor {
                dtype: t.dtype,
                shape: &t.shape,
                data: weights.tensor_data(t),
            }),
            Self::Gguf(g) => g.tensors.get(&name).map(|t| StoredTensor {
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

    /// Which (role, layer) pairs a stage holding `layers` needs; the embedding and head on request.
    pub fn required(
        cfg: &ModelConfig,
        layers: Range<usize>,
        embedding: bool,
        head: bool,
    ) -> Vec<(TensorRole, Option<usize>)> {
        let mut out = Vec::new();
        if embedding || (head && cfg.tie_word_embeddings) {
            out.push((TensorRole::Embedding, None));
        }
        for l in layers {
            out.extend(TensorRole::layer_roles(cfg).into_iter().map(|r| (r, Some(l))));
        }
        if head {
            out.push((TensorRole::FinalNorm, None));
            if !cfg.tie_word_embeddings {
                out.push((TensorRole::LmHead, None));
            }
        }
        out
    }

    /// Check that the files hold exactly the tensors the config implies, with the right shapes.
    pub fn validate_complete(&self, cfg: &ModelConfig) -> Result<(), LoadError> {
        let source_name = self.source_name();
        let mut unexpected = self.tensor_names();
        for (role, layer) in Self::required(cfg, 0..cfg.num_layers, true, true) {
            let name = self.name_of(role, layer);
            let t = self.stored(role, layer).ok_or_else(|| LoadError::MissingTensor {
                source_name: source_name.clone(),
                name: name.clone(),
            })?;
            check_shape(&source_name, &name, t.shape, &role.shape(cfg))?;
            unexpected.remove(&name);
        }
        // A tied checkpoint may still carry its (identical) head; rotary caches are derived data.
        unexpected.remove(&self.name_of(TensorRole::LmHead, None));
        unexpected.retain(|n| !n.ends_with("rotary_emb.inv_freq"));
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

    /// The stored tensor for a role, checked to exist with the shape `cfg` implies.
    fn checked(
        &self,
        cfg: &ModelConfig,
        role: TensorRole,
        layer: Option<usize>,
    ) -> Result<(StoredTensor<'_>, Vec<usize>), LoadError> {
        let source_name = self.source_name();
        let name = self.name_of(role, layer);
        let t = self.stored(role, layer).ok_or_else(|| LoadError::MissingTensor {
            source_name: source_name.clone(),
            name: name.clone(),
        })?;
        let expected = role.shape(cfg);
        check_shape(&source_name, &name, t.shape, &expected)?;
        Ok((t, expected))
    }

    /// One tensor's stored bytes in Hugging Face row order (GGUF llama q/k rows un-permuted),
    /// for a matrix kept in the file's own block format. Shape-checked; `None` for tensors that
    /// are not 2-D block formats (Q8_0, Q4_0, Q4_1).
    pub fn load_blocks(
        &self,
        cfg: &ModelConfig,
        role: TensorRole,
        layer: Option<usize>,
    ) -> Result<Option<(DType, Vec<u8>)>, LoadError> {
        let (t, expected) = self.checked(cfg, role, layer)?;
        if !matches!(t.dtype, DType::Q8_0 | DType::Q4_0 | DType::Q4_1) || expected.len() != 2 {
            return Ok(None);
        }
        let mut data = t.data.to_vec();
        if matches!(self, Self::Gguf(_)) && cfg.architecture == Architecture::Llama {
            let row_bytes = t.dtype.n_bytes(expected[1]);
            match role {
                TensorRole::Q => data = move_rows(&data, cfg.num_heads, row_bytes, |gguf, hf| (gguf, hf)),
                TensorRole::K => data = move_rows(&data, cfg.num_kv_heads, row_bytes, |gguf, hf| (gguf, hf)),
                _ => {}
            }
        }
        Ok(Some((t.dtype, data)))
    }

    /// Load one tensor as f32 in Hugging Face layout (GGUF llama q/k rows un-permuted).
    ///
    /// With `check_finite`, a NaN or infinity anywhere is an error naming the tensor.
    pub fn load_f32(
        &self,
        cfg: &ModelConfig,
        role: TensorRole,
        layer: Option<usize>,
        check_finite: bool,
    ) -> Result<Vec<f32>, LoadError> {
        let (t, expected) = self.checked(cfg, role, layer)?;
        let mut out = vec![0f32; expected.iter().product()];
        dequantize(t.dtype, t.data, &mut out);
        if check_finite && let Some((index, &value)) = out.iter().enumerate().find(|(_, v)| !v.is_finite()) {
            return Err(LoadError::NonFinite {
                source_name: self.source_name(),
                name: self.name_of(role, layer),
                index,
                value,
            });
        }
        if matches!(self, Self::Gguf(_)) && cfg.architecture == Architecture::Llama {
            match role {
                TensorRole::Q => out = unpermute_rows(&out, cfg.num_heads, cfg.hidden_size),
                TensorRole::K => out = unpermute_rows(&out, cfg.num_kv_heads, cfg.hidden_size),
                _ => {}
            }
        }
        Ok(out)
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permutation_roundtrip_and_layout() {
        // 2 heads of head_dim 4, 1 column: HF rows [a0 a1 | b0 b1] become GGUF [a0 b0 a1 b1].
        let hf: Vec<f32> = (0..8).map(|x| x as f32).collect();
        let gg = permute_rows(&hf, 2, 1);
        assert_eq!(gg, vec![0., 2., 1., 3., 4., 6., 5., 7.]);
        assert_eq!(unpermute_rows(&gg, 2, 1), hf);
    }
}
