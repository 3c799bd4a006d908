//! The weight format a stage loads when the user names none (`auto`): Q8_0, kept as the file
//! stores it when the file is Q8_0 and re-quantized from anything else, so serving is fast by
//! default and `f32` is the opt-in reference mode.
//!
//! A 4-bit file is widened to Q8_0 rather than run as stored because the Q8_0 panels are the
//! faster CPU path for what a server does. Measured on the default SmolLM2 Q4_1 file (2-vCPU
//! EPYC, docs/benchmarks.md): 16 streams through `baton serve --workers 0` 348–376 out tok/s
//! as `q8_0` against 198–221 as stored, and a 512-token prefill 907–938 against 418–481 tok/s;
//! only batch-1 decode is faster as stored (1.1–1.2×). The cost is a second rounding of
//! values that are Q4_1 already (perplexity +0.87% against f32, where as stored it is -0.09%).
//! `native`, `q4_0` and `q4_1` keep 4 bits for whoever needs the memory.

use baton_shared::dtype::DType;
use baton_shared::model_files::ModelFiles;

use super::registry;

use crate::kernels::cpu::matmul::{UnknownFormat, WeightFormat};

/// The name that picks a format from the model file.
pub const AUTO: &str = "auto";

/// The format `auto` means for `files`: `native` when every layer's matrices are stored as
/// Q8_0 (no second rounding), else `q8_0` (float and 4-bit files re-quantized; quantized GGUF
/// files often mix block types across layers, so every layer is looked at).
pub fn auto_format(files: &ModelFiles) -> WeightFormat {
    let Ok(config) = files.config() else {
        return WeightFormat::Q8_0;
    };
    let arch = registry::for_config(&config);
    let all_q8 = (0..config.num_layers).all(|l| {
        arch.layer(&config, l)
            .matrices()
            .iter()
            .all(|t| files.stored(t).is_some_and(|t| t.dtype == DType::Q8_0))
    });
    if config.num_layers > 0 && all_q8 {
        WeightFormat::Native
    } else {
        WeightFormat::Q8_0
    }
}

/// A weight format name (`auto` included) resolved for `files`.
pub fn resolve_format(name: &str, files: &ModelFiles) -> Result<WeightFormat, UnknownFormat> {
    if name.eq_ignore_ascii_case(AUTO) {
        Ok(auto_format(files))
    } else {
        name.parse()
    }
}
