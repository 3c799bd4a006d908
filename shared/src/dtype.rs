//! Tensor element types as stored in model files, and their conversion to f32.
//!
//! Block formats follow ggml: Q8_0 is 32 values as an f16 scale plus 32 signed bytes; Q4_0 is an
//! f16 scale plus 16 bytes of nibbles offset by 8; Q4_1 is an f16 scale, an f16 minimum and 16
//! bytes of nibbles. In a block, byte j holds value j in its low nibble and value j+16 in its high.

use half::{bf16, f16};

/// Element type of a stored tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F16,
    BF16,
    Q8_0,
    Q4_0,
    Q4_1,
}

/// Values per quantization block for the block formats.
pub const QK: usize = 32;

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DType::F32 => "F32",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::Q8_0 => "Q8_0",
            DType::Q4_0 => "Q4_0",
            DType::Q4_1 => "Q4_1",
        })
    }
}

impl DType {
    /// Map a ggml type id; the error is the name of a known but unsupported type.
    pub fn from_ggml(id: u32) -> Result<Self, &'static str> {
        Ok(match id {
            0 => DType::F32,
            1 => DType::F16,
            2 => DType::Q4_0,
            3 => DType::Q4_1,
            8 => DType::Q8_0,
            30 => DType::BF16,
            6 => return Err("Q5_0"),
            7 => return Err("Q5_1"),
            9 => return Err("Q8_1"),
            10..=15 => return Err("k-quant (Q2_K..Q8_K)"),
            16..=23 => return Err("i-quant"),
            24..=28 => return Err("integer tensor"),
            _ => return Err("unknown"),
        })
    }

    /// The ggml type id.
    pub fn ggml_id(self) -> u32 {
        match self {
            DType::F32 => 0,
            DType::F16 => 1,
            DType::Q4_0 => 2,
            DType::Q4_1 => 3,
            DType::Q8_0 => 8,
            DType::BF16 => 30,
        }
    }

    /// Values per block (1 for plain floats).
    pub fn block_size(self) -> usize {
        match self {
            DType::F32 | DType::F16 | DType::BF16 => 1,
            DType::Q8_0 | DType::Q4_0 | DType::Q4_1 => QK,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::Q8_0 => 2 + QK,
            DType::Q4_0 => 2 + QK / 2,
            DType::Q4_1 => 4 + QK / 2,
        }
    }

    /// Bytes needed for `n` values (n must be a multiple of the block size).
    pub fn n_bytes(self, n: usize) -> usize {
        n / self.block_size() * self.block_bytes()
    }
}

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// The first non-finite scale (or minimum) of a block format's `bytes`, as the index of the
/// first value of its block and the scale itself. A block's values are finite exactly when its
/// f16 scale (and Q4_1's minimum) are: the quants are small integers. `None` for other types.
pub fn non_finite_block(dtype: DType, bytes: &[u8]) -> Option<(usize, f32)> {
    let halves: &[usize] = match dtype {
        DType::Q8_0 | DType::Q4_0 => &[0],
        DType::Q4_1 => &[0, 2],
        _ => return None,
    };
    bytes
        .chunks_exact(dtype.block_bytes())
        .enumerate()
        .find_map(|(b, block)| {
            halves
                .iter()
                .map(|&at| f16_at(block, at))
                .find(|v| !v.is_finite())
                .map(|v| (b * dtype.block_size(), v))
        })
}

/// Convert `src` (holding exactly `out.len()` values of type `dtype`) to f32.
///
/// Panics if the byte length does not match; callers validate sizes when loading.
pub fn dequantize(dtype: DType, src: &[u8], out: &mut [f32]) {
    assert_eq!(
        src.len(),
        dtype.n_bytes(out.len()),
        "dequantize: {dtype} byte length mismatch"
    );
    match dtype {
        DType::F32 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        DType::F16 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(2)) {
                *o = f16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        DType::BF16 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(2)) {
                *o = bf16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        DType::Q8_0 => {
            for (o, b) in out
                .chunks_exact_mut(QK)
                .zip(src.chunks_exact(DType::Q8_0.block_bytes()))
            {
                let d = f16_at(b, 0);
                for (x, &q) in o.iter_mut().zip(&b[2..]) {
                    *x = f32::from(q as i8) * d;
                }
            }
        }
        DType::Q4_0 => {
            for (o, b) in out
                .chunks_exact_mut(QK)
                .zip(src.chunks_exact(DType::Q4_0.block_bytes()))
            {
                let d = f16_at(b, 0);
                for (j, &q) in b[2..].iter().enumerate() {
                    o[j] = (f32::from(q & 0x0f) - 8.0) * d;
                    o[j + QK / 2] = (f32::from(q >> 4) - 8.0) * d;
                }
            }
        }
        DType::Q4_1 => {
            for (o, b) in out
                .chunks_exact_mut(QK)
                .zip(src.chunks_exact(DType::Q4_1.block_bytes()))
            {
                let d = f16_at(b, 0);
                let m = f16_at(b, 2);
                for (j, &q) in b[4..].iter().enumerate() {
                    o[j] = f32::from(q & 0x0f) * d + m;
                    o[j + QK / 2] = f32::from(q >> 4) * d + m;
                }
            }
        }
    }
}

/// Quantize f32 values (a multiple of 32 of them) to Q8_0 the way ggml does (round to nearest).
pub fn quantize_q8_0(src: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(DType::Q8_0.n_bytes(src.len()));
    for block in src.chunks_exact(QK) {
        let amax = block.iter().fold(0f32, |m, &x| m.max(x.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
        out.extend(block.iter().map(|&x| (x * id).round() as i8 as u8));
    }
    out
}

/// Quantize f32 values to Q4_0 (scale chosen from the value of largest magnitude, as ggml does).
pub fn quantize_q4_0(src: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(DType::Q4_0.n_bytes(src.len()));
    for block in src.chunks_exact(QK) {
        let max = block.iter().fold(0f32, |m, &x| if x.abs() > m.abs() { x } else { m });
        let d = max / -8.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
        for j in 0..QK / 2 {
            let lo = ((block[j] * id + 8.5) as i32).clamp(0, 15) as u8;
            let hi = ((block[j + QK / 2] * id + 8.5) as i32).clamp(0, 15) as u8;
            out.push(lo | (hi << 4));
        }
    }
    out
}

/// Quantize f32 values to Q4_1 (per-block minimum and scale).
pub fn quantize_q4_1(src: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(DType::Q4_1.n_bytes(src.len()));
    for block in src.chunks_exact(QK) {
        let min = block.iter().copied().fold(f32::INFINITY, f32::min);
        let max = block.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let d = (max - min) / 15.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
        out.extend_from_slice(&f16::from_f32(min).to_le_bytes());
        for j in 0..QK / 2 {
            let lo = (((block[j] - min) * id + 0.5) as i32).clamp(0, 15) as u8;
            let hi = (((block[j + QK / 2] - min) * id + 0.5) as i32).clamp(0, 15) as u8;
            out.push(lo | (hi << 4));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ramp(n: usize) -> Vec<f32> {
        (0..n).map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0).collect()
    }

    fn roundtrip(dtype: DType, bytes: &[u8], n: usize) -> Vec<f32> {
        let mut out = vec![0.0; n];
        dequantize(dtype, bytes, &mut out);
        out
    }

    #[test]
    fn q8_0_roundtrip_within_half_step() {
        let x = ramp(128);
        let y = roundtrip(DType::Q8_0, &quantize_q8_0(&x), x.len());
        for (b, (a, c)) in x.chunks(QK).zip(y.chunks(QK)).enumerate() {
            let amax = a.iter().fold(0f32, |m, v| m.max(v.abs()));
            for (u, v) in a.iter().zip(c) {
                assert!((u - v).abs() <= amax / 127.0 * 0.51 + 1e-3, "block {b}: {u} vs {v}");
            }
        }
    }

    #[test]
    fn q4_roundtrips_within_one_step() {
        let x = ramp(96);
        for dtype in [DType::Q4_0, DType::Q4_1] {
            let q = if dtype == DType::Q4_0 {
                quantize_q4_0(&x)
            } else {
                quantize_q4_1(&x)
            };
            assert_eq!(q.len(), dtype.n_bytes(x.len()));
            let y = roundtrip(dtype, &q, x.len());
            for (a, c) in x.chunks(QK).zip(y.chunks(QK)) {
                let range = a.iter().fold(0f32, |m, v| m.max(v.abs())) * 2.0;
                for (u, v) in a.iter().zip(c) {
                    assert!((u - v).abs() <= range / 15.0 + 1e-3, "{dtype}: {u} vs {v}");
                }
            }
        }
    }

    #[test]
    fn nibble_layout_matches_ggml() {
        // Byte j: low nibble is value j, high nibble is value j+16.
        let mut block = vec![0u8; DType::Q4_1.block_bytes()];
        block[..2].copy_from_slice(&f16::from_f32(1.0).to_le_bytes());
        block[2..4].copy_from_slice(&f16::from_f32(0.0).to_le_bytes());
        block[4] = 0x3a;
        let y = roundtrip(DType::Q4_1, &block, QK);
        assert_eq!(y[0], 10.0);
        assert_eq!(y[16], 3.0);
    }

    #[test]
    fn half_formats() {
        let x = [1.5f32, -2.25, 0.0, 65504.0];
        let f: Vec<u8> = x.iter().flat_map(|&v| f16::from_f32(v).to_le_bytes()).collect();
        assert_eq!(roundtrip(DType::F16, &f, 4), x);
        let b: Vec<u8> = x.iter().flat_map(|&v| bf16::from_f32(v).to_le_bytes()).collect();
        assert_eq!(roundtrip(DType::BF16, &b, 4)[..3], x[..3]);
    }

    #[test]
    fn unsupported_types_are_named() {
        assert_eq!(DType::from_ggml(6), Err("Q5_0"));
        assert_eq!(DType::from_ggml(12), Err("k-quant (Q2_K..Q8_K)"));
        assert_eq!(DType::from_ggml(8), Ok(DType::Q8_0));
    }
}
