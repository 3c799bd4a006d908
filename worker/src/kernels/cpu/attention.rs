//! Causal GQA attention for the forward pass: [`reference::attention_rows`]'s arithmetic, in the
//! same order, with the q·k products on the SIMD dot kernels (bit-identical to the reference
//! dot) and the (sequence, head) pairs of a batch spread over the stage's thread pool.
//!
//! Each (query row, head) output depends only on its own inputs, so the result is the
//! reference's bit for bit whatever the path or thread count. A chunk's rows over f32 caches
//! go in tiles that read each block of keys and values into L1 once for all their rows
//! ([`tile`]); other rows go one at a time ([`one_head`]).

use super::dispatch::{KernelPath, Kernels};
use super::elementwise::softmax;
use super::f32 as kf32;
use super::half::{self, HalfKind};
use super::reference::AttnShape;
use crate::threads::{SharedMut, ThreadPool};

/// Where a sequence's K/V rows live: position `p` is storage row `row(p)`.
#[derive(Debug, Clone, Copy)]
pub enum Rows<'a> {
    /// Row `p` is position `p`.
    Contiguous,
    /// Position `p` is in block `table[p / block_size]`, at offset `p % block_size`.
    Paged { table: &'a [u32], block_size: usize },
}

impl Rows<'_> {
    /// Storage row of position `p`.
    #[inline]
    pub fn row(&self, p: usize) -> usize {
        match *self {
            Rows::Contiguous => p,
            Rows::Paged { table, block_size } => table[p / block_size] as usize * block_size + p % block_size,
        }
    }
}

/// A KV cache's keys or values, `kv_dim` per storage row, as stored.
#[derive(Debug, Clone, Copy)]
pub enum KvData<'a> {
    F32(&'a [f32]),
    /// IEEE half bits: half the memory; widened exactly when read.
    F16(&'a [u16]),
}

/// Which cached positions a query row attends to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AttnMask {
    /// Positions up to its own: a decoder's causal attention.
    #[default]
    Causal,
    /// Every position up to the last row its sequence has in the batch, so the rows of one
    /// chunk see each other both ways (a DFlash draft block, which is denoised as a whole).
    Block,
}

/// One sequence of a batched attention: its query rows (positions `pos0..pos0+rows`), where
/// they start in the batch, and its keys/values.
#[derive(Debug, Clone, Copy)]
pub struct SeqAttn<'a> {
    pub pos0: usize,
    pub rows: usize,
    /// First row of this sequence in the batch's `q` and `out`.
    pub offset: usize,
    pub k: KvData<'a>,
    pub v: KvData<'a>,
    pub layout: Rows<'a>,
}

impl Rows<'_> {
    /// Positions `0..n` as runs of consecutive storage rows: `(first position, first row,
    /// length)`. Walking runs instead of calling [`Rows::row`] per position saves a division per
    /// key on a paged cache.
    fn runs(&self, n: usize) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
        self.runs_in(0, n, usize::MAX)
    }

    /// Positions `a..b` as runs of consecutive storage rows of at most `most` positions each.
    fn runs_in(&self, a: usize, b: usize, most: usize) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
        let block = match *self {
            Rows::Contiguous => usize::MAX,
            Rows::Paged { block_size, .. } => block_size,
        };
        let mut p = a;
        std::iter::from_fn(move || {
            (p < b).then(|| {
                let len = (block - p % block).min(b - p).min(most);
                let run = (p, self.row(p), len);
                p += len;
                run
            })
        })
    }
}

/// `acc += w[i]·v[row0 + i]` for each `i`, rows `kv_dim` apart starting at value `off`: a multiply
/// then an add per element, in position order, exactly as the reference. With `HD` known the
/// accumulator lives in registers across the whole run.
#[inline(always)]
fn pv_run<const HD: usize>(acc: &mut [f32; HD], w: &[f32], v: &[f32], row0: usize, kv_dim: usize, off: usize) {
    let mut a = *acc;
    for (i, &wp) in w.iter().enumerate() {
        let vr: &[f32; HD] = v[(row0 + i) * kv_dim + off..][..HD].try_into().expect("HD values");
        for j in 0..HD {
            a[j] += wp * vr[j];
        }
    }
    *acc = a;
}

/// [`pv_run`] compiled for AVX-512 (same arithmetic; element-wise operations vectorize exactly).
///
/// # Safety
/// The CPU must support AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn pv_run_avx512<const HD: usize>(
    acc: &mut [f32; HD],
    w: &[f32],
    v: &[f32],
    row0: usize,
    kv_dim: usize,
    off: usize,
) {
    pv_run(acc, w, v, row0, kv_dim, off);
}

/// [`pv_run`] compiled for AVX2.
///
/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn pv_run_avx2<const HD: usize>(
    acc: &mut [f32; HD],
    w: &[f32],
    v: &[f32],
    row0: usize,
    kv_dim: usize,
    off: usize,
) {
    pv_run(acc, w, v, row0, kv_dim, off);
}

/// `acc += w·v` through the dispatched [`pv_run`] (rows `kv_dim` apart from value `off`).
#[inline(always)]
fn pv_dispatch<const HD: usize>(
    kern: Kernels,
    acc: &mut [f32; HD],
    w: &[f32],
    v: &[f32],
    row0: usize,
    kv_dim: usize,
    off: usize,
) {
    match kern.path() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Kernels` is only made for paths the CPU supports.
        KernelPath::Avx512 | KernelPath::Avx512Vnni => unsafe { pv_run_avx512(acc, w, v, row0, kv_dim, off) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        KernelPath::Avx2 | KernelPath::AvxVnni => unsafe { pv_run_avx2(acc, w, v, row0, kv_dim, off) },
        _ => pv_run(acc, w, v, row0, kv_dim, off),
    }
}

/// [`pv_run`] for `R` rows of weights over the same value rows: `acc[r] += w[r][i]·v[row0 + i]`,
/// each row's arithmetic [`pv_run`]'s, with each value row loaded once for all of them.
#[inline(always)]
fn pv_rows<const HD: usize, const R: usize>(
    acc: &mut [[f32; HD]; R],
    w: [&[f32]; R],
    v: &[f32],
    row0: usize,
    kv_dim: usize,
    off: usize,
) {
    let mut a = *acc;
    for i in 0..w[0].len() {
        let vr: &[f32; HD] = v[(row0 + i) * kv_dim + off..][..HD].try_into().expect("HD values");
        for r in 0..R {
            let wp = w[r][i];
            for j in 0..HD {
                a[r][j] += wp * vr[j];
            }
        }
    }
    *acc = a;
}

/// [`pv_rows`] compiled for AVX-512 (element-wise operations vectorize exactly).
///
/// # Safety
/// The CPU must support AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn pv_rows_avx512<const HD: usize, const R: usize>(
    acc: &mut [[f32; HD]; R],
    w: [&[f32]; R],
    v: &[f32],
    row0: usize,
    kv_dim: usize,
    off: usize,
) {
    pv_rows(acc, w, v, row0, kv_dim, off);
}

/// `oh = Σ_p sc[p]·v(p)` over the positions of `s`'s layout, for head dims with a register kernel.
/// f16 values are widened one row at a time, then take the same arithmetic as f32 ones.
fn weighted_values<const HD: usize>(
    kern: Kernels,
    sc: &[f32],
    s: &SeqAttn<'_>,
    kv_dim: usize,
    off: usize,
    oh: &mut [f32],
) {
    let mut acc = [0f32; HD];
    for (p, row0, len) in s.layout.runs(sc.len()) {
        let w = &sc[p..p + len];
        match s.v {
            KvData::F32(v) => pv_dispatch(kern, &mut acc, w, v, row0, kv_dim, off),
            KvData::F16(v) => {
                let mut row = [0f32; HD];
                for (i, wi) in w.chunks_exact(1).enumerate() {
                    half::widen(kern, HalfKind::F16, &v[(row0 + i) * kv_dim + off..][..HD], &mut row);
                    pv_dispatch(kern, &mut acc, wi, &row, 0, HD, 0);
                }
            }
        }
    }
    oh.copy_from_slice(&acc);
}

/// Attention of query row at position `pos` for head `h` into `oh` (`head_dim` values).
#[allow(clippy::too_many_arguments)]
#[inline]
fn one_head(
    kern: Kernels,
    qh: &[f32],
    s: &SeqAttn<'_>,
    pos: usize,
    kvh: usize,
    shape: AttnShape,
    scores: &mut [f32],
    oh: &mut [f32],
) {
    let (hd, kv_dim) = (shape.head_dim, shape.num_kv_heads * shape.head_dim);
    let off = kvh * hd;
    let scale = 1.0 / (hd as f32).sqrt();
    let sc = &mut scores[..pos + 1];
    for (p, row0, len) in s.layout.runs(pos + 1) {
        let keys = (row0..row0 + len).map(|r| r * kv_dim + off);
        match s.k {
            KvData::F32(k) => {
                // Eight keys per call share the query's loads and one reduction tree.
                let mut eights = sc[p..p + len].chunks_exact_mut(8);
                for (g, s8) in (&mut eights).enumerate() {
                    let at = |j: usize| (row0 + 8 * g + j) * kv_dim + off;
                    let d = kf32::dot8(kern, qh, std::array::from_fn(|j| &k[at(j)..at(j) + hd]));
                    s8.iter_mut().zip(d).for_each(|(s, d)| *s = d * scale);
                }
                let done = len / 8 * 8;
                for (score, at) in eights.into_remainder().iter_mut().zip(keys.skip(done)) {
                    *score = kf32::dot(kern, qh, &k[at..at + hd]) * scale;
                }
            }
            KvData::F16(k) => {
                for (score, at) in sc[p..p + len].iter_mut().zip(keys) {
                    *score = half::dot(kern, HalfKind::F16, qh, &k[at..at + hd]) * scale;
                }
            }
        }
    }
    softmax(kern, sc);
    match hd {
        64 => weighted_values::<64>(kern, sc, s, kv_dim, off, oh),
        128 => weighted_values::<128>(kern, sc, s, kv_dim, off, oh),
        _ => {
            oh.fill(0.0);
            let mut buf = [0f32; 64];
            for (p, row0, len) in s.layout.runs(sc.len()) {
                for (i, &w) in sc[p..p + len].iter().enumerate() {
                    let at = (row0 + i) * kv_dim + off;
                    // Piecewise, so f16 rows of any head size widen into a stack buffer.
                    for (c, o) in oh.chunks_mut(buf.len()).enumerate() {
                        let from = at + c * buf.len();
                        let vr = match s.v {
                            KvData::F32(v) => &v[from..from + o.len()],
                            KvData::F16(v) => {
                                let row = &mut buf[..o.len()];
                                half::widen(kern, HalfKind::F16, &v[from..from + o.len()], row);
                                &*row
                            }
                        };
                        for (o, &x) in o.iter_mut().zip(vr) {
                            *o += w * x;
                        }
                    }
                }
            }
        }
    }
}

/// Query rows a group kernel attends at once on the AVX-512 paths, where [`kf32::dot8_rows`]
/// shares key loads between them (one row elsewhere).
const ROWS: usize = kf32::DOT8_ROWS;

/// Query rows of one sequence and head a task attends as one tile. Their scores (a tile's rows ×
/// the context, about 100 KiB at 1,000 positions) stay in L2, and each key block is read into L1
/// once for the whole tile instead of once per row group: a row group alone streamed the head's
/// keys and values from L2 (or, past the L2's size, from L3) for every three rows.
const TILE: usize = 24;

/// Positions per key block: its keys and values (16 KiB at head size 64) stay in L1 while every
/// row group of a tile goes over them.
const KEY_BLOCK: usize = 32;

/// Whether [`tile`] runs this attention: causal rows over f32 caches, with a head size of whole
/// 64-wide value slices.
fn tile_fits(s: &SeqAttn<'_>, shape: AttnShape, mask: AttnMask) -> bool {
    mask == AttnMask::Causal
        && matches!((s.k, s.v), (KvData::F32(_), KvData::F32(_)))
        && shape.head_dim.is_multiple_of(64)
}

/// A tile's row groups, `(first row, rows)`: [`ROWS`] at a time where `wide`, then one by one.
fn row_groups(n: usize, wide: bool) -> impl Iterator<Item = (usize, usize)> {
    let full = if wide { n / ROWS * ROWS } else { 0 };
    (0..full)
        .step_by(ROWS)
        .map(|r| (r, ROWS))
        .chain((full..n).map(|r| (r, 1)))
}

/// One tile: the query rows at batch rows `first_row..first_row + n` (positions `pos..pos + n`)
/// of head `h`, over KV head `kvh`, into `out`. Each row's scores, softmax and weighted values
/// are [`one_head`]'s bit for bit: every score is the same dot product, and every output element
/// adds the same products in position order, whichever key block or row group carries them.
/// `scores` holds at least `n` rows of `stride ≥ pos + n` positions.
#[allow(clippy::too_many_arguments)]
fn tile(
    kern: Kernels,
    q: &[f32],
    h: usize,
    first_row: usize,
    n: usize,
    s: &SeqAttn<'_>,
    pos: usize,
    kvh: usize,
    shape: AttnShape,
    scores: &mut [f32],
    stride: usize,
    out: &SharedMut<f32>,
) {
    let (KvData::F32(k), KvData::F32(v)) = (s.k, s.v) else {
        unreachable!("tile runs on f32 caches (tile_fits)")
    };
    let (hd, kv_dim, q_dim) = (
        shape.head_dim,
        shape.num_kv_heads * shape.head_dim,
        shape.num_heads * shape.head_dim,
    );
    let off = kvh * hd;
    let scale = 1.0 / (hd as f32).sqrt();
    let wide = matches!(kern.path(), KernelPath::Avx512 | KernelPath::Avx512Vnni);
    let q_row = |r: usize| &q[(first_row + r) * q_dim + h * hd..][..hd];
    let key = |row: usize| &k[row * kv_dim + off..][..hd];
    // Scores of group (g0, gn) over the run of positions p.. at storage rows row0..
    let group_scores = |scores: &mut [f32], g0: usize, gn: usize, p: usize, row0: usize, len: usize| {
        let mut i = 0;
        while i + 8 <= len {
            let keys: [&[f32]; 8] = std::array::from_fn(|j| key(row0 + i + j));
            if gn == ROWS {
                let d = kf32::dot8_rows::<ROWS>(kern, std::array::from_fn(|r| q_row(g0 + r)), keys);
                for (r, d) in d.iter().enumerate() {
                    let sc = &mut scores[(g0 + r) * stride + p + i..][..8];
                    sc.iter_mut().zip(d).for_each(|(s, d)| *s = d * scale);
                }
            } else {
                let d = kf32::dot8(kern, q_row(g0), keys);
                let sc = &mut scores[g0 * stride + p + i..][..8];
                sc.iter_mut().zip(d).for_each(|(s, d)| *s = d * scale);
            }
            i += 8;
        }
        for i in i..len {
            for r in g0..g0 + gn {
                scores[r * stride + p + i] = kf32::dot(kern, q_row(r), key(row0 + i)) * scale;
            }
        }
    };
    // Keys every row of the tile sees, block by block; then those every row of a group sees;
    // then each row's own last ones (a group of one). Each row's softmax after.
    for (p, row0, len) in s.layout.runs_in(0, pos + 1, KEY_BLOCK) {
        for (g0, gn) in row_groups(n, wide) {
            group_scores(scores, g0, gn, p, row0, len);
        }
    }
    for (g0, gn) in row_groups(n, wide) {
        for (p, row0, len) in s.layout.runs_in(pos + 1, pos + g0 + 1, KEY_BLOCK) {
            group_scores(scores, g0, gn, p, row0, len);
        }
        for r in g0..g0 + gn {
            for (p, row0, len) in s.layout.runs_in(pos + g0 + 1, pos + r + 1, KEY_BLOCK) {
                group_scores(scores, r, 1, p, row0, len);
            }
            softmax(kern, &mut scores[r * stride..][..pos + r + 1]);
        }
    }
    // Weighted values, 64 dimensions at a time (each output element sums on its own, so the
    // split changes no bit), in the same three parts.
    let mut acc = [[0f32; 64]; TILE];
    for half in 0..hd / 64 {
        let off = off + 64 * half;
        acc[..n].iter_mut().for_each(|a| *a = [0.0; 64]);
        let group_pv = |acc: &mut [[f32; 64]; TILE], g0: usize, gn: usize, p: usize, row0: usize, len: usize| {
            if gn == ROWS {
                let w: [&[f32]; ROWS] = std::array::from_fn(|r| &scores[(g0 + r) * stride + p..][..len]);
                let a: &mut [[f32; 64]; ROWS] = (&mut acc[g0..g0 + ROWS]).try_into().expect("a row group");
                // SAFETY: groups of ROWS are formed on the AVX-512 paths only (`wide`).
                #[cfg(target_arch = "x86_64")]
                unsafe {
                    pv_rows_avx512::<64, ROWS>(a, w, v, row0, kv_dim, off)
                };
                #[cfg(not(target_arch = "x86_64"))]
                pv_rows::<64, ROWS>(a, w, v, row0, kv_dim, off);
            } else {
                for r in g0..g0 + gn {
                    pv_dispatch(
                        kern,
                        &mut acc[r],
                        &scores[r * stride + p..][..len],
                        v,
                        row0,
                        kv_dim,
                        off,
                    );
                }
            }
        };
        for (p, row0, len) in s.layout.runs_in(0, pos + 1, KEY_BLOCK) {
            for (g0, gn) in row_groups(n, wide) {
                group_pv(&mut acc, g0, gn, p, row0, len);
            }
        }
        for (g0, gn) in row_groups(n, wide) {
            for (p, row0, len) in s.layout.runs_in(pos + 1, pos + g0 + 1, KEY_BLOCK) {
                group_pv(&mut acc, g0, gn, p, row0, len);
            }
            for r in g0..g0 + gn {
                for (p, row0, len) in s.layout.runs_in(pos + g0 + 1, pos + r + 1, KEY_BLOCK) {
                    group_pv(&mut acc, r, 1, p, row0, len);
                }
                // SAFETY: the caller's task alone writes head h of rows first_row..first_row + n.
                let o = unsafe { out.slice((first_row + r) * q_dim + h * hd + 64 * half, 64) };
                o.copy_from_slice(&acc[r]);
            }
        }
    }
}

#[allow(clippy::too_many_arguments)]
pub fn attention_batch<'a>(
    kern: Kernels,
    pool: &ThreadPool,
    q: &[f32],
    n_seqs: usize,
    seq: &(dyn Fn(usize) -> SeqAttn<'a> + Sync),
    longest: usize,
    shape: AttnShape,
    mask: AttnMask,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    let q_dim = shape.num_heads * shape.head_dim;
    let group = shape.num_heads / shape.num_kv_heads;
    let tasks = n_seqs * shape.num_heads;
    // Each task's scores: one row, or a tile's rows.
    let tile_rows = (0..n_seqs).map(|i| seq(i).rows).max().unwrap_or(0).clamp(1, TILE);
    let per_task = tile_rows * longest;
    if scores.len() < tasks * per_task {
        scores.resize(tasks * per_task, 0.0);
    }
    let scores = SharedMut::new(&mut scores[..tasks * per_task]);
    let shared = SharedMut::new(out);
    pool.run(tasks, &|task| {
        let (si, h) = (task / shape.num_heads, task % shape.num_heads);
        let s = seq(si);
        assert!(s.pos0 + s.rows <= longest, "attention_batch: sequence beyond `longest`");
        // SAFETY: each task owns its scores buffer and the (row, head h) outputs of sequence si.
        let sc = unsafe { scores.slice(task * per_task, per_task) };
        let mut first = 0;
        // A lone row (a decode) has nothing to share a key block with: one_head spares it the
        // tile's set-up, about a tenth of its attention (`baton-bench attention --rows 1`).
        if s.rows > 1 && tile_fits(&s, shape, mask) {
            while first < s.rows {
                let n = (s.rows - first).min(tile_rows);
                let (row, pos) = (s.offset + first, s.pos0 + first);
                tile(kern, q, h, row, n, &s, pos, h / group, shape, sc, longest, &shared);
                first += n;
            }
        }
        let sc = &mut sc[..longest];
        for i in first..s.rows {
            let row = s.offset + i;
            let qh = &q[row * q_dim + h * shape.head_dim..][..shape.head_dim];
            // SAFETY: as above; rows of different sequences never overlap.
            let oh = unsafe { shared.slice(row * q_dim + h * shape.head_dim, shape.head_dim) };
            let pos = match mask {
                AttnMask::Causal => s.pos0 + i,
                AttnMask::Block => s.pos0 + s.rows - 1,
            };
            one_head(kern, qh, &s, pos, h / group, shape, sc, oh);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::cpu::dispatch::KernelPath;
    use crate::kernels::cpu::paths_run::PathsRun;
    use crate::kernels::cpu::reference;
    use crate::kernels::cpu::testdata::noise;

    #[test]
    fn batched_attention_equals_the_reference_bit_for_bit_on_every_path_and_thread_count() {
        let mut paths = PathsRun::new(
            "kernels::cpu::attention::tests::batched_attention_equals_the_reference_bit_for_bit_on_every_path_and_thread_count",
        );
        // f16 caches must give the reference's bits on their widened values.
        for f16 in [false, true] {
            for (heads, kv_heads, hd) in [(4, 2, 8), (9, 3, 64), (3, 3, 20), (2, 1, 128), (2, 2, 72)] {
                check_batched_attention(
                    AttnShape {
                        num_heads: heads,
                        num_kv_heads: kv_heads,
                        head_dim: hd,
                    },
                    f16,
                    &mut paths,
                );
            }
        }
        paths.check(&KernelPath::ALL);
    }

    fn check_batched_attention(shape: AttnShape, f16: bool, paths: &mut PathsRun) {
        let (qd, kvd) = (shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim);
        // Five sequences: a decode row at 37, a 5-row chunk from 0, 3 rows from 10, 21 from 19
        // (rows attended three at a time, keys in groups of eight and a remainder) and 30 from
        // 40 (two tiles, the second of 6 rows; keys in several blocks).
        let spans = [(37, 1), (0, 5), (10, 3), (19, 21), (40, 30)];
        let to_bits = |v: Vec<f32>| -> Vec<u16> { v.iter().map(|&x| HalfKind::F16.from_f32(x)).collect() };
        let widened = |b: &[u16]| -> Vec<f32> { b.iter().map(|&x| HalfKind::F16.to_f32(x)).collect() };
        let caches: Vec<(Vec<u16>, Vec<u16>)> = spans
            .iter()
            .enumerate()
            .map(|(i, (p, n))| {
                (
                    to_bits(noise((p + n) * kvd, 10 + i as u64, 1.0)),
                    to_bits(noise((p + n) * kvd, 20 + i as u64, 1.0)),
                )
            })
            .collect();
        let wide: Vec<(Vec<f32>, Vec<f32>)> = caches.iter().map(|(k, v)| (widened(k), widened(v))).collect();
        let total: usize = spans.iter().map(|s| s.1).sum();
        let q = noise(total * qd, 7, 1.0);
        let mut want = vec![0f32; total * qd];
        let mut offset = 0;
        for ((p, n), (k, v)) in spans.iter().zip(&wide) {
            let mut sc = vec![0f32; p + n];
            let rows = offset * qd..(offset + n) * qd;
            reference::attention(&q[rows.clone()], k, v, *p, shape, &mut sc, &mut want[rows]);
            offset += n;
        }
        // The same caches paged: blocks of 16 positions stored out of order.
        let (table, block) = ([2u32, 0, 4, 1, 3], 16);
        let page = |rows: &[f32]| -> Vec<f32> {
            let mut out = vec![0f32; table.len() * block * kvd];
            for (p, row) in rows.chunks_exact(kvd).enumerate() {
                let at = (table[p / block] as usize * block + p % block) * kvd;
                out[at..at + kvd].copy_from_slice(row);
            }
            out
        };
        let paged: Vec<(Vec<f32>, Vec<f32>)> = wide.iter().map(|(k, v)| (page(k), page(v))).collect();
        let mut layouts = vec![false];
        if !f16 {
            layouts.push(true);
        }
        for paged_layout in layouts {
            let mut offset = 0;
            let seqs: Vec<SeqAttn<'_>> = spans
                .iter()
                .zip(caches.iter().zip(wide.iter().zip(&paged)))
                .map(|((p, n), ((kb, vb), ((k, v), (kp, vp))))| {
                    let (k, v, layout) = if f16 {
                        (KvData::F16(kb), KvData::F16(vb), Rows::Contiguous)
                    } else if paged_layout {
                        (
                            KvData::F32(kp),
                            KvData::F32(vp),
                            Rows::Paged {
                                table: &table,
                                block_size: block,
                            },
                        )
                    } else {
                        (KvData::F32(k), KvData::F32(v), Rows::Contiguous)
                    };
                    let s = SeqAttn {
                        pos0: *p,
                        rows: *n,
                        offset,
                        k,
                        v,
                        layout,
                    };
                    offset += n;
                    s
                })
                .collect();
            for threads in [1, 2, 3] {
                let pool = ThreadPool::new(threads);
                for kern in Kernels::all_supported() {
                    paths.record(kern.path());
                    let mut got = vec![0f32; total * qd];
                    let seq = |i: usize| seqs[i];
                    attention_batch(
                        kern,
                        &pool,
                        &q,
                        seqs.len(),
                        &seq,
                        70,
                        shape,
                        AttnMask::Causal,
                        &mut Vec::new(),
                        &mut got,
                    );
                    assert_eq!(
                        got,
                        want,
                        "{shape:?} f16={f16} paged={paged_layout}, {threads} threads, {}",
                        kern.path()
                    );
                }
            }
        }
    }

    #[test]
    fn under_a_block_mask_every_row_of_a_chunk_attends_to_the_whole_chunk() {
        let shape = AttnShape {
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: 16,
        };
        let (qd, kvd) = (shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim);
        // A block of 4 rows after 5 cached positions, and a block of 3 from position 0.
        let spans = [(5usize, 4usize), (0, 3)];
        let caches: Vec<(Vec<f32>, Vec<f32>)> = spans
            .iter()
            .enumerate()
            .map(|(i, (p, n))| {
                (
                    noise((p + n) * kvd, 30 + i as u64, 1.0),
                    noise((p + n) * kvd, 40 + i as u64, 1.0),
                )
            })
            .collect();
        let total: usize = spans.iter().map(|s| s.1).sum();
        let q = noise(total * qd, 9, 1.0);
        // Each row as a lone query at its block's last position.
        let mut want = vec![0f32; total * qd];
        let mut row = 0;
        for ((p, n), (k, v)) in spans.iter().zip(&caches) {
            for _ in 0..*n {
                let mut sc = vec![0f32; p + n];
                let at = row * qd..(row + 1) * qd;
                reference::attention(&q[at.clone()], k, v, p + n - 1, shape, &mut sc, &mut want[at]);
                row += 1;
            }
        }
        let mut offset = 0;
        let seqs: Vec<SeqAttn<'_>> = spans
            .iter()
            .zip(&caches)
            .map(|((p, n), (k, v))| {
                let s = SeqAttn {
                    pos0: *p,
                    rows: *n,
                    offset,
                    k: KvData::F32(k),
                    v: KvData::F32(v),
                    layout: Rows::Contiguous,
                };
                offset += n;
                s
            })
            .collect();
        let pool = ThreadPool::new(2);
        for kern in Kernels::all_supported() {
            let mut got = vec![0f32; total * qd];
            let seq = |i: usize| seqs[i];
            let mut scores = Vec::new();
            attention_batch(
                kern,
                &pool,
                &q,
                seqs.len(),
                &seq,
                9,
                shape,
                AttnMask::Block,
                &mut scores,
                &mut got,
            );
            assert_eq!(got, want, "{}", kern.path());
        }
    }

    #[test]
    fn paged_rows_follow_the_block_table() {
        let rows = Rows::Paged {
            table: &[4, 0, 2],
            block_size: 16,
        };
        assert_eq!(rows.row(0), 64);
        assert_eq!(rows.row(17), 1);
        assert_eq!(rows.row(40), 40);
        assert_eq!(Rows::Contiguous.row(9), 9);
    }
}
