//! The host side of a mixture's experts in one go (`matmul_q8_experts` or `matmul_q4_experts`,
//! and `combine_rows`):
//! one launch per product for every expert of a layer, where going expert by expert costs
//! seven launches per active expert. The routing's entries (rows, expert after expert) are
//! cut into tiles of up to [`MATMUL_TILE`] entries of one expert, a block column each; and
//! each row's entries are listed in ascending expert order, the order the CPU adds them in.

use super::{Geometry, MATMUL_TILE, MATMUL_WARPS};
use crate::kernels::cpu::moe::Routing;

/// The largest grid y of a launch: tiles beyond it go to a further launch.
pub const MAX_TILES_PER_LAUNCH: usize = 65_535;

/// One expert's Q8_0 matrix, as matmul.cu's `ExpertQ8`: device addresses of its quants and
/// its f16 block scales.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ExpertQ8 {
    pub q: u64,
    pub d: u64,
}

/// One expert's Q4_0 or Q4_1 matrix, as matmul.cu's `ExpertQ4`: device addresses of its codes,
/// its f16 block scales and (Q4_1; 0 for Q4_0) its f16 block minimums.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ExpertQ4 {
    pub c: u64,
    pub d: u64,
    pub m: u64,
}

/// Up to [`MATMUL_TILE`] consecutive entries of one expert, as matmul.cu's `ExpertTile`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ExpertTile {
    pub expert: i32,
    pub first: i32,
    pub count: i32,
}

/// A batch's routing laid out for the one-go kernels; rebuilt per layer, keeping its memory.
#[derive(Debug, Default, Clone)]
pub struct ExpertPlan {
    /// Every expert's entries in tiles, experts in ascending order.
    pub tiles: Vec<ExpertTile>,
    /// Row `r`'s entries at `r * top_k ..`, their experts ascending.
    pub row_entries: Vec<u32>,
    /// Experts with at least one entry.
    pub active: usize,
    filled: Vec<usize>,
}

impl ExpertPlan {
    /// The plan of `routing` over `experts` experts.
    pub fn build(&mut self, routing: &Routing, experts: usize) {
        let (rows, top_k) = (routing.rows(), routing.top_k());
        let (entry_rows, _) = routing.entries();
        self.tiles.clear();
        self.active = 0;
        self.row_entries.clear();
        self.row_entries.resize(rows * top_k, 0);
        self.filled.clear();
        self.filled.resize(rows, 0);
        for e in 0..experts {
            let span = routing.span(e);
            self.active += usize::from(!span.is_empty());
            for first in span.clone().step_by(MATMUL_TILE as usize) {
                self.tiles.push(ExpertTile {
                    expert: e as i32,
                    first: first as i32,
                    count: (span.end - first).min(MATMUL_TILE as usize) as i32,
                });
            }
            // Experts ascend, so each row's list does.
            for i in span {
                let row = entry_rows[i] as usize;
                self.row_entries[row * top_k + self.filled[row]] = i as u32;
                self.filled[row] += 1;
            }
        }
    }
}

/// Where a packed routing's parts start, in 32-bit words ([`pack`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Packed {
    /// Each entry's routing weight (f32 bits); each entry's row starts the buffer, at 0.
    pub weights: usize,
    /// The plan's tiles, three words each ([`ExpertTile`]).
    pub tiles: usize,
    /// The plan's row entries.
    pub row_entries: usize,
}

/// `routing` and its `plan` as the kernels read them, in one buffer (one upload per layer):
/// entry rows, entry weights, tiles, row entries.
pub fn pack(routing: &Routing, plan: &ExpertPlan, out: &mut Vec<u32>) -> Packed {
    let (rows, weights) = routing.entries();
    out.clear();
    out.extend_from_slice(rows);
    let w = out.len();
    out.extend(weights.iter().map(|w| w.to_bits()));
    let tiles = out.len();
    out.extend(
        plan.tiles
            .iter()
            .flat_map(|t| [t.expert as u32, t.first as u32, t.count as u32]),
    );
    let row_entries = out.len();
    out.extend_from_slice(&plan.row_entries);
    Packed {
        weights: w,
        tiles,
        row_entries,
    }
}

/// The most experts a mixture routed on the device may have (moe.cu's `ROUTE_MAX_EXPERTS`,
/// one `align_experts` thread per expert).
pub const ROUTE_MAX_EXPERTS: usize = 1024;
/// The most experts a row may take when routed on the device (moe.cu's `ROUTE_MAX_TOP_K`).
pub const ROUTE_MAX_TOP_K: usize = 16;
/// `align_experts`' threads (its one block).
pub const ALIGN_THREADS: u32 = 1024;

/// Whether a mixture of `experts` experts, `top_k` a row, can be routed on the device.
pub fn routes_on_device(experts: usize, top_k: usize) -> bool {
    (1..=ROUTE_MAX_EXPERTS).contains(&experts) && (1..=ROUTE_MAX_TOP_K.min(experts)).contains(&top_k)
}

/// The most tiles a routing of `entries` entries over `experts` experts can need: an expert
/// with c entries takes ⌈c / tile⌉ ≤ c tiles, and at most c / tile + 1; so the routing at most
/// `entries` and at most `entries / tile` plus one per expert with entries. A routing made on
/// the device sizes its grids for this many, the unused tiles holding no entries.
pub fn max_tiles(entries: usize, experts: usize) -> usize {
    entries.min(entries / MATMUL_TILE as usize + experts.min(entries))
}

/// Where `align_experts` puts a device routing's parts for `entries` entries and room for
/// `max_tiles` tiles, and the words it writes in all.
pub fn device_layout(entries: usize, max_tiles: usize) -> (Packed, usize) {
    let at = Packed {
        weights: entries,
        tiles: 2 * entries,
        row_entries: 2 * entries + 3 * max_tiles,
    };
    (at, at.row_entries + entries)
}

/// `route_rows` over `rows` rows: a warp per row.
pub fn route_geometry(rows: usize) -> Geometry {
    Geometry {
        grid: (rows as u32, 1, 1),
        block: (32, 1, 1),
    }
}

/// `align_experts`: one block.
pub fn align_geometry() -> Geometry {
    Geometry {
        grid: (1, 1, 1),
        block: (ALIGN_THREADS, 1, 1),
    }
}

/// `matmul_q8_experts` or `matmul_q4_experts` over `tiles` tiles (at most [`MAX_TILES_PER_LAUNCH`]) of a product
/// with `rows_w` weight rows.
pub fn experts_geometry(rows_w: usize, tiles: usize) -> Geometry {
    Geometry {
        grid: ((rows_w as u32).div_ceil(MATMUL_WARPS), tiles as u32, 1),
        block: (MATMUL_WARPS * 32, 1, 1),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::cpu::moe;

    #[test]
    fn tiles_cover_each_experts_entries_and_rows_list_theirs_in_expert_order() {
        // 20 rows, 3 experts, 2 each: row r prefers expert r % 3, then (r + 1) % 3.
        let (rows, experts) = (20usize, 3usize);
        let logits: Vec<f32> = (0..rows)
            .flat_map(|r| (0..experts).map(move |e| [3.0, 2.0, 0.0][(e + experts - r % experts) % experts]))
            .collect();
        let mut routing = moe::Routing::default();
        moe::route(&logits, experts, 2, true, &mut routing);
        let mut plan = ExpertPlan::default();
        plan.build(&routing, experts);
        assert_eq!(plan.active, 3);
        for e in 0..experts {
            let span = routing.span(e);
            let tiles: Vec<_> = plan.tiles.iter().filter(|t| t.expert == e as i32).collect();
            assert_eq!(tiles.len(), span.len().div_ceil(MATMUL_TILE as usize), "expert {e}");
            let mut next = span.start as i32;
            for t in tiles {
                assert_eq!(t.first, next);
                assert!((1..=MATMUL_TILE as i32).contains(&t.count));
                next += t.count;
            }
            assert_eq!(next, span.end as i32);
        }
        let (entry_rows, _) = routing.entries();
        for r in 0..rows {
            let mine = &plan.row_entries[r * 2..r * 2 + 2];
            let experts_of: Vec<usize> = mine
                .iter()
                .map(|&i| (0..experts).find(|&e| routing.span(e).contains(&(i as usize))).unwrap())
                .collect();
            assert!(experts_of[0] < experts_of[1], "row {r}: {experts_of:?}");
            assert!(mine.iter().all(|&i| entry_rows[i as usize] == r as u32));
            let mut chosen: Vec<usize> = routing.chosen(r).iter().map(|c| c.0 as usize).collect();
            chosen.sort();
            assert_eq!(experts_of, chosen);
        }
        // An idle expert has no tiles; a smaller batch keeps the memory.
        moe::route(&logits[..3 * experts], experts, 1, true, &mut routing);
        let at = plan.row_entries.as_ptr();
        plan.build(&routing, experts);
        assert_eq!((plan.active, plan.tiles.len(), plan.row_entries.len()), (3, 3, 3));
        assert_eq!(plan.row_entries.as_ptr(), at);
        assert_eq!(experts_geometry(1536, 7).grid, (384, 7, 1));
    }

    #[test]
    fn max_tiles_bounds_every_routing_and_is_reached() {
        let mut routing = moe::Routing::default();
        let mut plan = ExpertPlan::default();
        for (rows, experts, top_k) in [(1, 128, 8), (3, 5, 2), (17, 4, 4), (40, 64, 8), (9, 512, 10)] {
            let n = rows * top_k;
            for seed in 0..20u64 {
                // Random logits, with every row once sent to the same first experts (long
                // spans) and once spread.
                let logits: Vec<f32> = (0..rows * experts)
                    .map(|i| {
                        let h = (i as u64 ^ seed.wrapping_mul(0x9e37_79b9)).wrapping_mul(0x2545_f491_4f6c_dd1d);
                        let skew = if seed % 2 == 0 { (i % experts) as f32 * 0.5 } else { 0.0 };
                        (h >> 40) as f32 / (1u64 << 24) as f32 + skew
                    })
                    .collect();
                moe::route(&logits, experts, top_k, true, &mut routing);
                plan.build(&routing, experts);
                assert!(
                    plan.tiles.len() <= max_tiles(n, experts),
                    "{rows} × {top_k} of {experts}"
                );
            }
        }
        // Reached: one entry for each of 8 experts (8 tiles), or 9 for one and 1 for another.
        assert_eq!(max_tiles(8, 128), 8);
        assert_eq!(max_tiles(10, 2), 3);
        let (at, words) = device_layout(10, 3);
        assert_eq!((at.weights, at.tiles, at.row_entries, words), (10, 20, 29, 39));
        assert!(routes_on_device(512, 10) && routes_on_device(1, 1));
        assert!(!routes_on_device(1025, 8) && !routes_on_device(128, 17) && !routes_on_device(4, 5));
        assert!(!routes_on_device(128, 0));
        let src = include_str!("moe.cu");
        for (name, value) in [
            ("ROUTE_MAX_EXPERTS", ROUTE_MAX_EXPERTS),
            ("ROUTE_MAX_TOP_K", ROUTE_MAX_TOP_K),
            ("ALIGN_THREADS", ALIGN_THREADS as usize),
            ("ROUTE_TILE", MATMUL_TILE as usize),
        ] {
            assert!(src.contains(&format!("#define {name} {value}\n")), "moe.cu's {name}");
        }
    }

    #[test]
    fn a_packed_routing_holds_every_part_at_its_offset() {
        let logits = [0.5, 2.0, -1.0, 1.0, 0.0, 3.0, 1.5, 1.5, 0.2];
        let mut routing = moe::Routing::default();
        moe::route(&logits, 3, 2, true, &mut routing);
        let mut plan = ExpertPlan::default();
        plan.build(&routing, 3);
        let mut packed = vec![7u32; 3];
        let at = pack(&routing, &plan, &mut packed);
        let (rows, weights) = routing.entries();
        assert_eq!(&packed[..at.weights], rows);
        let w: Vec<f32> = packed[at.weights..at.tiles]
            .iter()
            .map(|&b| f32::from_bits(b))
            .collect();
        assert_eq!(w, weights);
        let tiles: Vec<ExpertTile> = packed[at.tiles..at.row_entries]
            .chunks_exact(3)
            .map(|t| ExpertTile {
                expert: t[0] as i32,
                first: t[1] as i32,
                count: t[2] as i32,
            })
            .collect();
        assert_eq!(tiles, plan.tiles);
        assert_eq!(&packed[at.row_entries..], &plan.row_entries[..]);
        // The kernels read a tile as three 32-bit words, in matmul.cu's order.
        assert_eq!(size_of::<ExpertTile>(), 12);
        assert_eq!(size_of::<ExpertQ8>(), 16);
        let src = include_str!("matmul.cu");
        assert!(src.contains("struct ExpertQ8 {\n    u64 q;") && src.contains("\n    u64 d;  // its block scales"));
        assert!(
            src.contains("struct ExpertTile {\n    int expert;\n    int first;") && src.contains("\n    int count;")
        );
    }
}
