//! Hidden states on the wire: f32 rows to and from `proto::Tensor` bytes (f32, bf16 or f16,
//! little-endian), with the shape checked on arrival.

use half::{bf16, f16};

use crate::proto::{Dtype as WireDType, Tensor};

/// A tensor from the network that does not match what the stage expects.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum WireError {
    #[error("hidden states have shape {got:?}, expected [{rows}, {cols}]")]
    Shape { got: Vec<u32>, rows: usize, cols: usize },
    #[error("hidden states carry {got} bytes, expected {expected} for shape [{rows}, {cols}] of {dtype}")]
    Bytes {
        got: usize,
        expected: usize,
        rows: usize,
        cols: usize,
        dtype: &'static str,
    },
    #[error("unknown hidden-state dtype {0}")]
    DType(i32),
}

/// Wire name of a dtype, as in configuration (`f32`, `bf16`, `f16`).
pub fn parse_dtype(name: &str) -> Option<WireDType> {
    match name {
        "f32" => Some(WireDType::F32),
        "bf16" => Some(WireDType::Bf16),
        "f16" => Some(WireDType::F16),
        _ => None,
    }
}

/// Wall-clock now in ns since the Unix epoch (`MicroBatch::sent_unix_nanos`).
pub fn unix_nanos() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// Seconds a message stamped `sent_unix_nanos` has been on its way; None without a stamp or
/// when the sender's clock is ahead of ours.
pub fn hop_seconds(sent_unix_nanos: u64) -> Option<f64> {
    (sent_unix_nanos > 0)
        .then(|| unix_nanos().checked_sub(sent_unix_nanos))
        .flatten()
        .map(|ns| ns as f64 * 1e-9)
}

/// Encode `rows × cols` f32 values for sending.
pub fn encode(values: &[f32], rows: usize, cols: usize, dtype: WireDType, out: &mut Tensor) {
    debug_assert_eq!(values.len(), rows * cols);
    out.dtype = dtype as i32;
    out.shape = vec![rows as u32, cols as u32];
    out.data.clear();
    match dtype {
        WireDType::F32 => out.data.extend(values.iter().flat_map(|v| v.to_le_bytes())),
        WireDType::Bf16 => out
            .data
            .extend(values.iter().flat_map(|v| bf16::from_f32(*v).to_le_bytes())),
        WireDType::F16 => out
            .data
            .extend(values.iter().flat_map(|v| f16::from_f32(*v).to_le_bytes())),
    }
}

/// Decode a received tensor that must be `rows × cols` into `out` (resized to fit).
pub fn decode(t: &Tensor, rows: usize, cols: usize, out: &mut Vec<f32>) -> Result<(), WireError> {
    if t.shape != [rows as u32, cols as u32] {
        return Err(WireError::Shape {
            got: t.shape.clone(),
            rows,
            cols,
        });
    }
    let dtype = WireDType::try_from(t.dtype).map_err(|_| WireError::DType(t.dtype))?;
    let (size, name) = match dtype {
        WireDType::F32 => (4, "f32"),
        WireDType::Bf16 => (2, "bf16"),
        WireDType::F16 => (2, "f16"),
    };
    let expected = rows * cols * size;
    if t.data.len() != expected {
        return Err(WireError::Bytes {
            got: t.data.len(),
            expected,
            rows,
            cols,
            dtype: name,
        });
    }
    out.clear();
    match dtype {
        WireDType::F32 => out.extend(
            t.data
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        ),
        WireDType::Bf16 => out.extend(
            t.data
                .chunks_exact(2)
                .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32()),
        ),
        WireDType::F16 => out.extend(
            t.data
                .chunks_exact(2)
                .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32()),
        ),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_and_checks() {
        let x = [1.0f32, -2.5, 0.125, 3.0, 1e-3, 7.0];
        let mut t = Tensor::default();
        let mut y = Vec::new();
        for dt in [WireDType::F32, WireDType::Bf16, WireDType::F16] {
            encode(&x, 2, 3, dt, &mut t);
            decode(&t, 2, 3, &mut y).unwrap();
            let tol = if dt == WireDType::F32 { 0.0 } else { 0.02 };
            assert!(
                x.iter().zip(&y).all(|(a, b)| (a - b).abs() <= tol * a.abs().max(1.0)),
                "{dt:?}"
            );
        }
        assert!(matches!(decode(&t, 3, 2, &mut y), Err(WireError::Shape { .. })));
        t.data.pop();
        assert!(matches!(decode(&t, 2, 3, &mut y), Err(WireError::Bytes { .. })));
    }
}
