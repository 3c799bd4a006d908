//! The host side of the Gated DeltaNet kernels (`linear_attention.cu`): a batch's sequences
//! as the kernels read them, and each kernel's launch shape.

use super::{ELEMENTWISE_THREADS, Geometry};
use crate::kv_cache::{PagedSeq, delta_windows};

/// The widest query/key head the delta rule holds (`MAX_KEY_DIM` in linear_attention.cu).
pub const MAX_KEY_DIM: usize = 256;

/// The widest value head (`MAX_VALUE_DIM` in linear_attention.cu): one thread per state column,
/// and the block's threads each hold a chunked window's registers (real models have 128).
pub const MAX_VALUE_DIM: usize = 512;

/// One sequence of a batch, as linear_attention.cu's `LinearSeq`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LinearSeq {
    /// Its first row in the batch.
    pub row0: i32,
    pub rows: i32,
    /// Its recurrent-state slot.
    pub slot: i32,
    /// Its rows (from `row0`) in whole delta-rule windows, which take the chunked form:
    /// `win0..win1` ([`delta_windows`]).
    pub win0: i32,
    pub win1: i32,
}

/// `seqs` as the kernels read them (rows back to back in order), into `out`.
pub fn linear_seqs(seqs: &[PagedSeq<'_>], out: &mut Vec<LinearSeq>) {
    out.clear();
    let mut row0 = 0;
    for s in seqs {
        let windows = delta_windows(s.pos0, s.len, s.prompt_len);
        out.push(LinearSeq {
            row0: row0 as i32,
            rows: s.len as i32,
            slot: s.state_slot as i32,
            win0: (windows.start - s.pos0) as i32,
            win1: (windows.end - s.pos0) as i32,
        });
        row0 += s.len;
    }
}

/// `conv1d_silu`: a thread per channel, a grid row per sequence.
pub fn conv_geometry(channels: usize, seqs: usize) -> Geometry {
    Geometry {
        grid: ((channels as u32).div_ceil(ELEMENTWISE_THREADS), seqs as u32, 1),
        block: (ELEMENTWISE_THREADS, 1, 1),
    }
}

/// `l2norm_heads`: a warp per (row, query or key head), eight warps a block.
pub fn l2norm_geometry(pieces: usize) -> Geometry {
    Geometry {
        grid: ((pieces as u64).div_ceil(8) as u32, 1, 1),
        block: (256, 1, 1),
    }
}

/// `delta_rule`: a block per (value head, sequence), a thread per state column, in whole warps.
pub fn delta_geometry(value_heads: usize, seqs: usize, value_dim: usize) -> Geometry {
    Geometry {
        grid: (value_heads as u32, seqs as u32, 1),
        block: ((value_dim as u32).div_ceil(32) * 32, 1, 1),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequences_take_their_rows_back_to_back_and_the_kernels_bounds_are_their_sources() {
        let table = [0u32];
        let seq = |len, slot, prompt_len| PagedSeq {
            pos0: 3,
            len,
            stored: 3,
            table: &table,
            state_slot: slot,
            prompt_len,
        };
        let mut out = vec![LinearSeq::default(); 9];
        // The last is a prompt's chunk from position 3 to 43 of 40: its window 16..32 takes
        // rows 13..29.
        linear_seqs(&[seq(5, 2, 0), seq(1, 0, 0), seq(7, 4, 0), seq(40, 1, 40)], &mut out);
        let want = [(0, 5, 2, 5), (5, 1, 0, 1), (6, 7, 4, 7), (13, 40, 1, 40)].map(|(row0, rows, slot, end)| {
            let (win0, win1) = if rows == 40 { (13, 29) } else { (end, end) };
            LinearSeq {
                row0,
                rows,
                slot,
                win0,
                win1,
            }
        });
        assert_eq!(out, want);
        assert_eq!(size_of::<LinearSeq>(), 20);
        let src = include_str!("linear_attention.cu");
        assert!(src.contains(&format!("#define MAX_KEY_DIM {MAX_KEY_DIM}\n")));
        assert!(src.contains(&format!("#define MAX_VALUE_DIM {MAX_VALUE_DIM}\n")));
        let window = baton_shared::model_config::DELTA_RULE_WINDOW;
        assert!(src.contains(&format!("#define DELTA_WINDOW {window}\n")));
        assert!(src.contains(
            "struct LinearSeq {\n    int row0;\n    int rows;\n    int slot;\n    int win0;\n    int win1;\n};"
        ));
        assert_eq!(conv_geometry(1000, 3).grid, (4, 3, 1));
        assert_eq!(l2norm_geometry(17).grid.0, 3);
        assert_eq!(delta_geometry(32, 2, 128).block, (128, 1, 1));
        assert_eq!(delta_geometry(4, 2, 24).block, (32, 1, 1));
    }
}
