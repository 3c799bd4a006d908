//! Loading weights onto a device: each tensor read by its spec, checked, converted to the
//! stage's weight format (or kept as the file stores it) and uploaded through [`Ops`].

use baton_shared::dtype::DType;
use baton_shared::model_config::ModelConfig;
use baton_shared::model_files::{LoadError, ModelFiles, TensorSpec, keeps_blocks};

use crate::kernels::cpu::matmul::WeightFormat;
use crate::ops::{HostMatrix, Ops};

/// Reads tensors for one stage.
pub struct WeightLoader<'a, O: Ops> {
    pub files: &'a ModelFiles,
    pub config: &'a ModelConfig,
    pub ops: &'a O,
    /// Storage of the layers' matrices.
    pub format: WeightFormat,
    /// Reject NaN and infinity.
    pub check_finite: bool,
}

impl<O: Ops> WeightLoader<'_, O> {
    /// An f32 vector (norm scale, bias).
    pub fn vector(&self, spec: &TensorSpec) -> Result<O::Vector, LoadError> {
        Ok(self.ops.vector(self.host_vector(spec)?))
    }

    /// An f32 tensor in host memory, to be transformed before it is uploaded.
    pub fn host_vector(&self, spec: &TensorSpec) -> Result<Vec<f32>, LoadError> {
        self.files.load_f32(spec, self.check_finite)
    }

    /// An f32 table kept exactly (the embedding).
    pub fn table(&self, spec: &TensorSpec) -> Result<O::Mat, LoadError> {
        self.matrix_as(spec, WeightFormat::F32)
    }

    /// A matrix in the stage's format.
    pub fn matrix(&self, spec: &TensorSpec) -> Result<O::Mat, LoadError> {
        self.matrix_as(spec, self.format)
    }

    /// The format `native` keeps `spec` in: its ggml blocks (`Native`), its 16-bit floats
    /// (which widen to f32 exactly, so rounding back is lossless), or f32.
    pub fn native_format(&self, spec: &TensorSpec) -> WeightFormat {
        match self.files.stored(spec).map(|t| t.dtype) {
            Some(dtype) if keeps_blocks(dtype, &spec.shape) => WeightFormat::Native,
            Some(DType::BF16) => WeightFormat::Bf16,
            Some(DType::F16) => WeightFormat::F16,
            _ => WeightFormat::F32,
        }
    }

    /// A matrix in `format`: dequantized to f32 (checked for NaN/Inf) and converted by the
    /// device, one path for every file format; `Native` keeps the file's format instead
    /// ([`native_format`](Self::native_format)): its blocks go to the device as stored, checked
    /// by their scales, without being widened to f32 first.
    pub fn matrix_as(&self, spec: &TensorSpec, format: WeightFormat) -> Result<O::Mat, LoadError> {
        let cols = *spec.shape.last().unwrap_or(&1);
        let format = match format {
            WeightFormat::Native => self.native_format(spec),
            other => other,
        };
        let blocks = match format {
            WeightFormat::Native => self.files.load_blocks(spec, self.check_finite)?,
            _ => None,
        };
        let host = match blocks {
            Some((dtype, bytes)) => HostMatrix::Blocks {
                dtype,
                rows: spec.shape.iter().product::<usize>() / cols,
                bytes,
                cols,
            },
            None => HostMatrix::F32 {
                values: self.files.load_f32(spec, self.check_finite)?,
                cols,
            },
        };
        self.ops.matrix(host, format).map_err(|reason| LoadError::Blocks {
            source_name: self.files.source_name(),
            name: self.files.name_of(spec).to_string(),
            reason,
        })
    }
}
