//! The weight format a stage loads when the user names none (`auto`): Q8_0, kept as the file
//! stores it when the file is Q8_0 and re-quantized from anything else, so serving is fast by
//! default and `f32` is the opt-in reference mode.
//!
//! A 4-bit file is widened to Q8_0 rather than run as stored: on the CPU path the 4-bit
//! products (8-bit activations against 4-bit weights) measurably change small models' answers
//! (the default SmolLM2 Q4_1 file stops answering "Paris" to the capital of France, which it
//! does in f32 and Q8_0), and the Q8_0 panels are Baton's fastest kernels. `native`, `q4_0`
//! and `q4_1` keep 4 bits for whoever needs the memory.

use baton_shared::dtype::DType;
use baton_shared::model_files::{ModelFiles, TensorRole};

use crate::kernels::cpu::matmul::{UnknownFormat, WeightFormat};

/// The name that picks a format from the model file.
pub const AUTO: &str = "auto";

/// The format `auto` means for `files`: `native` when every layer's matrices are stored as
/// Q8_0 (no second rounding), else `q8_0` (float and 4-bit files re-quantized; quantized GGUF
/// files often mix block types across layers, so every layer is looked at).
pub fn auto_format(files: &ModelFiles) -> WeightFormat {
    use TensorRole::*;
    let roles = [Q, K, V, O, Gate, Up, Down];
    let mut layers = 0;
    let mut all_q8 = true;
    for layer in 0.. {
        let stored: Vec<_> = roles.iter().map(|&r| files.stored(r, Some(layer))).collect();
        if stored.iter().all(Option::is_none) {
            break;
        }
        layers += 1;
        all_q8 &= stored.iter().all(|t| t.is_some_and(|t| t.dtype == DType::Q8_0));
    }
    if layers > 0 && all_q8 {
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
