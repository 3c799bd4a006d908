// Matrix products out[t, r] = x[t, :] · w[r, :] (+ bias[r]) for a micro-batch of rows.
//
// One warp owns one weight row and a tile of up to TILE activation rows: it streams the weight
// row once per tile and keeps one accumulator per activation row. Each output's reduction
// order (lane-strided partial sums, then the warp's fixed butterfly) depends only on the
// matrix width, never on how many rows share the batch, so continuous batching stays
// deterministic.
#include "common.cuh"

#define TILE 8
#define WARPS 4

// Up to three products of the same activations (q/k/v, gate/up) in one launch: their weight
// rows are numbered one after another, and each warp finds the product its row belongs to.
struct Group {
    u64 w[3];     // weights: f32 rows, or Q8_0 quants
    u64 d[3];     // Q8_0 / Q4 block scales (f16 bits); unused for f32
    u64 m[3];     // Q4_1 block minimums (f16 bits); 0 otherwise
    u64 bias[3];  // 0: no bias
    u64 out[3];
    int rows[4];  // weight rows of each product (the fourth is padding)
};

// Product and row within it of the group's row `r`; false past the last. Fields are picked
// by comparisons, not by indexing, so the group stays in registers.
__device__ __forceinline__ bool locate(const Group& g, int r, int& p, int& row) {
    const int a = g.rows[0], b = g.rows[1], c = g.rows[2];
    p = r < a ? 0 : (r < a + b ? 1 : 2);
    row = r - (p == 0 ? 0 : (p == 1 ? a : a + b));
    return r < a + b + c;
}

__device__ __forceinline__ u64 pick(int p, u64 a, u64 b, u64 c) { return p == 0 ? a : (p == 1 ? b : c); }
__device__ __forceinline__ int pick_rows(const Group& g, int p) {
    return p == 0 ? g.rows[0] : (p == 1 ? g.rows[1] : g.rows[2]);
}

// What the group kernels do around their format's loop: warp w's weight row of the group,
// against tile blockIdx.y of the activation rows. `partials(p, r, t0, nt, acc)` is the format's
// loop for row r of product p over activation rows t0 .. t0 + nt; each output then gets the
// warp's sum plus its bias.
template <class Partials>
__device__ __forceinline__ void group_tile(const Group& g, int rows_x, Partials partials) {
    const int lane = threadIdx.x & 31;
    int p, r;
    if (!locate(g, blockIdx.x * WARPS + (threadIdx.x >> 5), p, r)) return;
    const int rows_w = pick_rows(g, p);
    const float* bias = (const float*)pick(p, g.bias[0], g.bias[1], g.bias[2]);
    float* out = (float*)pick(p, g.out[0], g.out[1], g.out[2]);
    const int t0 = blockIdx.y * TILE;
    const int nt = min(TILE, rows_x - t0);
    float acc[TILE];
    partials(p, r, t0, nt, acc);
    const float bv = bias ? bias[r] : 0.0f;
#pragma unroll
    for (int j = 0; j < TILE; ++j) {
        const float s = warp_sum(acc[j]);
        if (lane == 0 && j < nt) out[(u64)(t0 + j) * rows_w + r] = s + bv;
    }
}

// Weights held as f32, f16 or bf16 (KIND 0, 1, 2), read as f32: the half formats widen
// exactly, so a product computes with the same values in the same order as on f32 weights
// holding the rounded values, at half the memory and half the bytes streamed.
#define W_F32 0
#define W_F16 1
#define W_BF16 2

__device__ __forceinline__ float bf2f(u32 bits16) { return __uint_as_float(bits16 << 16); }

template <int KIND> __device__ __forceinline__ float widen1(const void* w, u64 i) {
    if constexpr (KIND == W_F32) return ((const float*)w)[i];
    else if constexpr (KIND == W_F16) return h2f2((u32)((const u16*)w)[i]).x; // (h2f spills on sm_86/89 here)
    else return bf2f(((const u16*)w)[i]);
}

// Values 4c .. 4c + 3 (16 bytes of f32, 8 of a half format per lane).
template <int KIND> __device__ __forceinline__ float4 widen4(const void* w, u64 c) {
    if constexpr (KIND == W_F32) {
        return ((const float4*)w)[c];
    } else {
        const uint2 v = ((const uint2*)w)[c];
        if constexpr (KIND == W_F16) {
            const float2 a = h2f2(v.x), b = h2f2(v.y);
            return make_float4(a.x, a.y, b.x, b.y);
        } else {
            return make_float4(bf2f(v.x & 0xffffu), bf2f(v.x >> 16), bf2f(v.y & 0xffffu), bf2f(v.y >> 16));
        }
    }
}

// `vec4` (chosen from `cols` alone) reads four values per lane per step.
template <int KIND> __device__ __forceinline__ void matmul_wide(const float* x, Group g, int rows_x, int cols) {
    const int lane = threadIdx.x & 31;
    int p, r;
    if (!locate(g, blockIdx.x * WARPS + (threadIdx.x >> 5), p, r)) return;
    const int rows_w = pick_rows(g, p);
    const void* w = (const void*)pick(p, g.w[0], g.w[1], g.w[2]);
    const float* bias = (const float*)pick(p, g.bias[0], g.bias[1], g.bias[2]);
    float* out = (float*)pick(p, g.out[0], g.out[1], g.out[2]);
    const int t0 = blockIdx.y * TILE;
    const int nt = min(TILE, rows_x - t0);
    float acc[TILE];
#pragma unroll
    for (int j = 0; j < TILE; ++j) acc[j] = 0.0f;
    const u64 row0 = (u64)r * cols;
    if ((cols & 3) == 0) {
        for (int c = lane; c < cols / 4; c += 32) {
            const float4 a = widen4<KIND>(w, row0 / 4 + c);
#pragma unroll
            for (int j = 0; j < TILE; ++j) {
                if (j < nt) {
                    const float4 b = ((const float4*)(x + (u64)(t0 + j) * cols))[c];
                    acc[j] += a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
                }
            }
        }
    } else {
        for (int c = lane; c < cols; c += 32) {
            const float a = widen1<KIND>(w, row0 + c);
#pragma unroll
            for (int j = 0; j < TILE; ++j)
                if (j < nt) acc[j] += a * x[(u64)(t0 + j) * cols + c];
        }
    }
    const float b = bias ? bias[r] : 0.0f;
#pragma unroll
    for (int j = 0; j < TILE; ++j) {
        const float s = warp_sum(acc[j]);
        if (lane == 0 && j < nt) out[(u64)(t0 + j) * rows_w + r] = s + b;
    }
}

extern "C" __global__ void __launch_bounds__(WARPS * 32) matmul_f32(const float* x, Group g, int rows_x, int cols) {
    matmul_wide<W_F32>(x, g, rows_x, cols);
}

extern "C" __global__ void __launch_bounds__(WARPS * 32) matmul_f16(const float* x, Group g, int rows_x, int cols) {
    matmul_wide<W_F16>(x, g, rows_x, cols);
}

extern "C" __global__ void __launch_bounds__(WARPS * 32) matmul_bf16(const float* x, Group g, int rows_x, int cols) {
    matmul_wide<W_BF16>(x, g, rows_x, cols);
}

// Quantize each 32-value block of x to i8 (quantize_lane). One warp per block.
extern "C" __global__ void quantize_q8(const float* x, i8* q, float* d, u64 blocks) {
    const u64 b = (u64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (b >= blocks) return;
    quantize_lane(x[b * QK + (threadIdx.x & 31)], q, d, b);
}

// Q8_0 weights (row-major i8 quants, f16 block scales) against activations quantized by
// quantize_q8: per block an integer dot product (dp4a), scaled by both blocks' scales. A lane
// takes whole 32-byte blocks, so a warp reads 1 KiB of consecutive weights per step; each lane
// issues the loads of UNROLL blocks before using any, so enough bytes are in flight to stream
// the matrix at close to the memory's bandwidth. A lane's blocks and their order depend only
// on the matrix width.
#define UNROLL 4

__device__ __forceinline__ int dot_block(int4 w0, int4 w1, int4 a0, int4 a1) {
    int dot = dp4a(w0.x, a0.x, 0);
    dot = dp4a(w0.y, a0.y, dot);
    dot = dp4a(w0.z, a0.z, dot);
    dot = dp4a(w0.w, a0.w, dot);
    dot = dp4a(w1.x, a1.x, dot);
    dot = dp4a(w1.y, a1.y, dot);
    dot = dp4a(w1.z, a1.z, dot);
    return dp4a(w1.w, a1.w, dot);
}

// At least MIN_BLOCKS blocks per multiprocessor: enough warps in flight to cover memory latency.
#define MIN_BLOCKS 5

// One lane's TILE partial sums of weight row (wr, sr) against the activation rows
// `row_of(j)`, j < nt: the lane's blocks (lane, lane + 32, ...) in increasing order, UNROLL
// blocks' loads issued before any is used, each block's dot added by an explicit fma (not left
// to contraction), as matmul_q8_mma adds. `row_of` is inlined: a computed row (matmul_q8) or
// one read ahead from a table (matmul_q8_experts) costs no loads in the loop.
template <class RowOf>
__device__ __forceinline__ void q8_partials(const i8* __restrict__ xq, const float* __restrict__ xd, const int4* wr,
                                            const u16* sr, int nb, int cols, int nt, RowOf row_of, float acc[TILE]) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int j = 0; j < TILE; ++j) acc[j] = 0.0f;
    for (int b0 = lane; b0 < nb; b0 += 32 * UNROLL) {
        int4 w0[UNROLL], w1[UNROLL];
        float ws[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int b = b0 + 32 * u;
            if (b < nb) {
                w0[u] = __ldg(wr + 2 * b);
                w1[u] = __ldg(wr + 2 * b + 1);
                ws[u] = h2f(__ldg(sr + b));
            }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int b = b0 + 32 * u;
            if (b < nb) {
#pragma unroll
                for (int j = 0; j < TILE; ++j) {
                    if (j < nt) {
                        const u64 row = row_of(j);
                        const int4* xr = (const int4*)(xq + row * cols);
                        const int dot = dot_block(w0[u], w1[u], __ldg(xr + 2 * b), __ldg(xr + 2 * b + 1));
                        acc[j] = fmaf(ws[u] * __ldg(xd + row * nb + b), (float)dot, acc[j]);
                    }
                }
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(WARPS * 32, MIN_BLOCKS)
matmul_q8(const i8* __restrict__ xq, const float* __restrict__ xd, Group g, int rows_x, int cols) {
    const int nb = cols / QK;
    group_tile(g, rows_x, [&](int p, int r, int t0, int nt, float* acc) {
        const i8* __restrict__ wq = (const i8*)pick(p, g.w[0], g.w[1], g.w[2]);
        const u16* __restrict__ wd = (const u16*)pick(p, g.d[0], g.d[1], g.d[2]);
        q8_partials(xq, xd, (const int4*)(wq + (u64)r * cols), wd + (u64)r * nb, nb, cols, nt,
                    [t0](int j) { return (u64)(t0 + j); }, acc);
    });
}

// The experts of a mixture in one launch. Each expert's entries (the rows routed to it) are
// cut into tiles of up to TILE (by the host, or by align_experts; tiles past the routing's last
// hold no entries and their blocks return); block (x, y) computes weight rows x·WARPS .. of
// tile y's expert for the tile's entries. An entry's activation row is `rows[entry]` (the
// batch row a gate/up product reads) or the entry itself when `rows` is null (the down
// product, over the gated hidden rows packed by entry). Every output has matmul_q8's bits for
// that row and that expert's matrix: the same lanes, blocks, order and fma.
struct ExpertQ8 {
    u64 q;  // the expert's quants
    u64 d;  // its block scales (f16 bits)
};
struct ExpertTile {
    int expert;
    int first;  // the tile's first entry
    int count;  // entries in the tile (1 .. TILE; 0: an unused tile, skipped)
};

// What both one-go kernels do around their format's loop: warp r's weight row of tile
// blockIdx.y's expert against the tile's entries. `partials(e, r, nt, row_of, acc)` is the
// format's loop (q8_partials, q4_partials) over the expert record `e`; each output is then
// stored as the product kernels store it.
template <class Expert, class Partials>
__device__ __forceinline__ void experts_tile(const Expert* experts, const ExpertTile* tiles, const u32* rows,
                                             float* out, int rows_w, Partials partials) {
    const int lane = threadIdx.x & 31;
    const int r = blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (r >= rows_w) return;
    const ExpertTile tile = tiles[blockIdx.y];
    // A tile past the routing's last (a routing made on the device sizes the grid for the most
    // tiles any routing of its entries can need).
    if (tile.count <= 0) return;
    const Expert e = experts[tile.expert];
    int xrow[TILE];
#pragma unroll
    for (int j = 0; j < TILE; ++j) {
        const int entry = tile.first + min(j, tile.count - 1);
        xrow[j] = rows ? (int)rows[entry] : entry;
    }
    float acc[TILE];
    partials(e, r, tile.count, [&xrow](int j) { return (u64)xrow[j]; }, acc);
#pragma unroll
    for (int j = 0; j < TILE; ++j) {
        const float s = warp_sum(acc[j]);
        // + 0: the product kernels' missing bias, so even a -0 has their bits.
        if (lane == 0 && j < tile.count) out[(u64)(tile.first + j) * rows_w + r] = s + 0.0f;
    }
}

// Four blocks per multiprocessor, not MIN_BLOCKS: the entries' rows take eight registers more
// than matmul_q8 has, which at MIN_BLOCKS would spill.
extern "C" __global__ void __launch_bounds__(WARPS * 32, 4)
matmul_q8_experts(const i8* __restrict__ xq, const float* __restrict__ xd, const ExpertQ8* experts,
                  const ExpertTile* tiles, const u32* rows, float* out, int rows_w, int cols) {
    const int nb = cols / QK;
    experts_tile(experts, tiles, rows, out, rows_w, [&](const ExpertQ8& e, int r, int nt, auto row_of, float* acc) {
        q8_partials(xq, xd, (const int4*)((const i8*)e.q + (u64)r * cols), (const u16*)e.d + (u64)r * nb, nb, cols,
                    nt, row_of, acc);
    });
}

// Q8_0 products on the tensor cores, for batches: one warp computes a tile of 16 weight rows by
// 8 activation rows per Q8_0 block with one int8 `mma` (m16n8k32: a block is exactly its k).
// The result has matmul_q8's bits, so a row's output never depends on which kernel its batch
// took: per output, block b's dot (exact in int32) is scaled and added by fma into partial
// b mod 32, blocks in increasing order, as lane b mod 32 of matmul_q8 adds it; the 32
// partials are then summed in the tree of `warp_sum`'s butterfly, built bottom-up by a stack
// over the partials in bit-reversed order (no shared memory).
#define MMA_WARPS 4

// d = a · b for one 16 × 32 tile of s8 (a: rows g and g + 8, k 4t .. 4t + 3 and 16 + 4t ..)
// and one 32 × 8 tile (b: column g, the same k), g = lane / 4 and t = lane % 4; d holds
// rows g and g + 8 by columns 2t and 2t + 1.
#ifndef BATON_EMULATION
__device__ __forceinline__ void mma_s8(int d[4], const int a[4], const int b[2]) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%10, %11, %12, %13};"
                 : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(0), "r"(0), "r"(0), "r"(0));
}
#endif

// Where weight row `r` of the group lives: its quants and scales, or none past the last row.
struct WRow {
    const i8* q;
    const u16* d;
};

__device__ __forceinline__ WRow weight_row(const Group& g, int r, int cols, int& product, int& row) {
    if (!locate(g, r, product, row)) return WRow{nullptr, nullptr};
    const i8* q = (const i8*)pick(product, g.w[0], g.w[1], g.w[2]);
    const u16* d = (const u16*)pick(product, g.d[0], g.d[1], g.d[2]);
    return WRow{q + (u64)row * cols, d + (u64)row * (cols / QK)};
}

__device__ __forceinline__ int load4(const i8* p) { return __ldg((const int*)p); }

// The weight rows of lane (g, t) in an mma tile starting at group row r0: rows r0 + g (`lo`) and
// r0 + g + 8 (`hi`), with the product and row within it of each.
struct TileRows {
    WRow lo, hi;
    int p_lo, row_lo, p_hi, row_hi;
};

__device__ __forceinline__ TileRows tile_rows(const Group& g, int r0, int gid, int cols) {
    TileRows t;
    t.lo = weight_row(g, r0 + gid, cols, t.p_lo, t.row_lo);
    t.hi = weight_row(g, r0 + gid + 8, cols, t.p_hi, t.row_hi);
    return t;
}

// Lane (g, t)'s four outputs of an mma tile, d's layout (rows lo, lo, hi, hi by activation rows
// tc, tc + 1, tc, tc + 1), stored as matmul_q8 stores them: plus the product's bias, if any.
__device__ __forceinline__ void store_quad(const Group& g, const TileRows& w, int tc, int rows_x, const float v[4]) {
    const int rows_w[2] = {w.lo.q ? pick_rows(g, w.p_lo) : 0, w.hi.q ? pick_rows(g, w.p_hi) : 0};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const bool upper = i >= 2;
        const int t = tc + (i & 1);
        if (!(upper ? w.hi : w.lo).q || t >= rows_x) continue;
        const int p = upper ? w.p_hi : w.p_lo, r = upper ? w.row_hi : w.row_lo;
        const float* bias = (const float*)pick(p, g.bias[0], g.bias[1], g.bias[2]);
        float* out = (float*)pick(p, g.out[0], g.out[1], g.out[2]);
        out[(u64)t * rows_w[upper] + r] = v[i] + (bias ? bias[r] : 0.0f);
    }
}

extern "C" __global__ void __launch_bounds__(MMA_WARPS * 32, 4)
matmul_q8_mma(const i8* __restrict__ xq, const float* __restrict__ xd, Group g, int rows_x, int cols) {
    const int lane = threadIdx.x & 31, gid = lane >> 2, tig = lane & 3;
    // Activation tiles vary fastest over the grid, so the blocks reading the same weight rows
    // run together and all but the first find them in L2.
    const int r0 = (blockIdx.y * MMA_WARPS + (threadIdx.x >> 5)) * 16;
    const int total = g.rows[0] + g.rows[1] + g.rows[2];
    if (r0 >= total) return; // the whole warp: mma needs every lane
    const int nb = cols / QK;
    const TileRows rows = tile_rows(g, r0, gid, cols);
    const WRow &lo = rows.lo, &hi = rows.hi;
    const int t0 = blockIdx.x * 8;
    const int tb = t0 + gid;        // the activation row this lane loads for b
    const int tc = t0 + 2 * tig;    // the activation rows of its outputs: tc, tc + 1
    const i8* xb = tb < rows_x ? xq + (u64)tb * cols : nullptr;
    const bool c0 = tc < rows_x, c1 = tc + 1 < rows_x;
    // The bottom-up tree: stack[l] holds a finished subtree of 2^l partials.
    float stack[5][4];
#pragma unroll
    for (int k = 0; k < 32; ++k) {
        // Partial k's blocks: bit-reversed k, so neighbours in k pair as the butterfly does.
        const int first = ((k & 1) << 4) | ((k & 2) << 2) | (k & 4) | ((k & 8) >> 2) | ((k & 16) >> 4);
        float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int b = first; b < nb; b += 32) {
            const int o = b * QK + 4 * tig;
            const int a[4] = {lo.q ? load4(lo.q + o) : 0, hi.q ? load4(hi.q + o) : 0, lo.q ? load4(lo.q + o + 16) : 0,
                              hi.q ? load4(hi.q + o + 16) : 0};
            const int bx[2] = {xb ? load4(xb + o) : 0, xb ? load4(xb + o + 16) : 0};
            int d[4];
            mma_s8(d, a, bx);
            const float w_lo = lo.d ? h2f(__ldg(lo.d + b)) : 0.0f, w_hi = hi.d ? h2f(__ldg(hi.d + b)) : 0.0f;
            const float x0 = c0 ? __ldg(xd + (u64)tc * nb + b) : 0.0f;
            const float x1 = c1 ? __ldg(xd + (u64)(tc + 1) * nb + b) : 0.0f;
            part[0] = fmaf(w_lo * x0, (float)d[0], part[0]);
            part[1] = fmaf(w_lo * x1, (float)d[1], part[1]);
            part[2] = fmaf(w_hi * x0, (float)d[2], part[2]);
            part[3] = fmaf(w_hi * x1, (float)d[3], part[3]);
        }
        // Fold: each trailing one bit of k closes a subtree with the one on the stack.
        int level = 0;
#pragma unroll
        for (int l = 0; l < 5; ++l) {
            if (level == l && ((k >> l) & 1)) {
#pragma unroll
                for (int i = 0; i < 4; ++i) part[i] = stack[l][i] + part[i];
                level = l + 1;
            }
        }
#pragma unroll
        for (int l = 0; l < 5; ++l) {
            if (level == l && k != 31) {
#pragma unroll
                for (int i = 0; i < 4; ++i) stack[l][i] = part[i];
            }
        }
        if (k == 31) store_quad(g, rows, tc, rows_x, part); // the root: the four outputs
    }
}

// Q8_0 products on the tensor cores with a block's columns split over its warps. Warp w of
// SPLIT_WARPS accumulates partials w and w + SPLIT_WARPS, ... (each over blocks b ≡ partial mod
// 32, increasing, by fma, as lane `partial` of matmul_q8 adds them) for a tile of 16 weight rows
// by N · 8 activation rows; the 32 partials then meet in warp_sum's butterfly order, the first
// levels inside a warp and the last through shared memory, so every output has matmul_q8's bits
// again. What differs from matmul_q8_mma is how the weights stream: a block reads its 16 rows
// whole, every warp's loads of SPLIT_UNROLL blocks in flight together (as many as 64 registers
// a thread hold without spilling), each weight fragment
// serves N mma, and the blocks sharing weight rows are neighbours in the grid (activation tiles
// vary fastest) so a batch wider than N · 8 rows reads them again from L2, not from memory.
// Lane (g, t) loads bytes 8t .. 8t + 7 of its rows' block for both operands: A's k order and
// B's are the same permutation of the PTX layout's, and the int32 dot over a block is exact in
// any order.
__device__ __forceinline__ uint2 load8(const i8* p) { return __ldg((const uint2*)p); }

template <int WARPS_, int N, int SPLIT_UNROLL>
__device__ __forceinline__ void q8_split(const i8* __restrict__ xq, const float* __restrict__ xd, const Group& g,
                                         int rows_x, int cols, float (*shared)[N * 4][32]) {
    constexpr int CLASSES = 32 / WARPS_; // partials per warp
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, gid = lane >> 2, tig = lane & 3;
    const int nb = cols / QK;
    const TileRows rows = tile_rows(g, blockIdx.y * 16, gid, cols);
    const WRow &lo = rows.lo, &hi = rows.hi;
    const int t0 = blockIdx.x * (8 * N);
    // Activation tiles past the batch's last row are skipped whole (the same for the block).
    const int tiles = min(N, (rows_x - t0 + 7) / 8);
    float acc[CLASSES][N][4];
#pragma unroll
    for (int c = 0; c < CLASSES; ++c)
#pragma unroll
        for (int j = 0; j < N; ++j)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[c][j][i] = 0.0f;
#pragma unroll
    for (int c = 0; c < CLASSES; ++c) {
        const int partial = w + c * WARPS_;
        for (int b0 = partial; b0 < nb; b0 += 32 * SPLIT_UNROLL) {
            uint2 wl[SPLIT_UNROLL], wh[SPLIT_UNROLL];
            float sl[SPLIT_UNROLL], sh[SPLIT_UNROLL];
#pragma unroll
            for (int u = 0; u < SPLIT_UNROLL; ++u) {
                const int b = b0 + 32 * u;
                if (b < nb) {
                    const uint2 zero = {0u, 0u};
                    wl[u] = lo.q ? load8(lo.q + b * QK + 8 * tig) : zero;
                    wh[u] = hi.q ? load8(hi.q + b * QK + 8 * tig) : zero;
                    sl[u] = lo.d ? h2f(__ldg(lo.d + b)) : 0.0f;
                    sh[u] = hi.d ? h2f(__ldg(hi.d + b)) : 0.0f;
                }
            }
#pragma unroll
            for (int u = 0; u < SPLIT_UNROLL; ++u) {
                const int b = b0 + 32 * u;
                if (b >= nb) continue;
                const int a[4] = {(int)wl[u].x, (int)wh[u].x, (int)wl[u].y, (int)wh[u].y};
#pragma unroll
                for (int j = 0; j < N; ++j) {
                    if (j >= tiles) continue;
                    const int tb = t0 + 8 * j + gid, tc = t0 + 8 * j + 2 * tig;
                    const uint2 xb = tb < rows_x ? load8(xq + (u64)tb * cols + b * QK + 8 * tig) : uint2{0u, 0u};
                    const int bx[2] = {(int)xb.x, (int)xb.y};
                    int d[4];
                    mma_s8(d, a, bx);
                    const float x0 = tc < rows_x ? __ldg(xd + (u64)tc * nb + b) : 0.0f;
                    const float x1 = tc + 1 < rows_x ? __ldg(xd + (u64)(tc + 1) * nb + b) : 0.0f;
                    acc[c][j][0] = fmaf(sl[u] * x0, (float)d[0], acc[c][j][0]);
                    acc[c][j][1] = fmaf(sl[u] * x1, (float)d[1], acc[c][j][1]);
                    acc[c][j][2] = fmaf(sh[u] * x0, (float)d[2], acc[c][j][2]);
                    acc[c][j][3] = fmaf(sh[u] * x1, (float)d[3], acc[c][j][3]);
                }
            }
        }
    }
    // The butterfly's levels: partial p takes p + s for s = 16, 8, ... 1. Those between a warp's
    // own partials (s ≥ WARPS_) are register adds; the rest go through shared memory, warps
    // [s, 2s) handing theirs to warps [0, s).
#pragma unroll
    for (int s = 16; s >= WARPS_; s >>= 1) {
        // Partial w + c·WARPS_ takes w + (c + s / WARPS_)·WARPS_.
#pragma unroll
        for (int c = 0; c < s / WARPS_; ++c)
#pragma unroll
            for (int j = 0; j < N; ++j)
#pragma unroll
                for (int i = 0; i < 4; ++i) acc[c][j][i] = acc[c][j][i] + acc[c + s / WARPS_][j][i];
    }
    for (int s = WARPS_ / 2; s > 0; s >>= 1) {
        if (w >= s && w < 2 * s) {
#pragma unroll
            for (int j = 0; j < N; ++j)
                if (j < tiles)
#pragma unroll
                    for (int i = 0; i < 4; ++i) shared[w - s][4 * j + i][lane] = acc[0][j][i];
        }
        __syncthreads();
        if (w < s) {
#pragma unroll
            for (int j = 0; j < N; ++j)
                if (j < tiles)
#pragma unroll
                    for (int i = 0; i < 4; ++i) acc[0][j][i] = acc[0][j][i] + shared[w][4 * j + i][lane];
        }
        __syncthreads();
    }
    if (w != 0) return;
#pragma unroll
    for (int j = 0; j < N; ++j) store_quad(g, rows, t0 + 8 * j + 2 * tig, rows_x, acc[0][j]);
}

// Two shapes of it, both timed by CudaOps::open: 32 warps each owning one partial of 32
// activation rows (one block a multiprocessor at 64 registers), and 16 warps each owning two
// partials of 8 activation rows, three blocks' loads in flight a partial (two blocks a
// multiprocessor, so one's reduction can overlap the other's loads).
extern "C" __global__ void __launch_bounds__(32 * 32, 1)
matmul_q8_split32(const i8* __restrict__ xq, const float* __restrict__ xd, Group g, int rows_x, int cols) {
    __shared__ float shared[16][4 * 4][32];
    q8_split<32, 4, 2>(xq, xd, g, rows_x, cols, shared);
}

extern "C" __global__ void __launch_bounds__(16 * 32, 2)
matmul_q8_split16(const i8* __restrict__ xq, const float* __restrict__ xd, Group g, int rows_x, int cols) {
    __shared__ float shared[8][1 * 4][32];
    q8_split<16, 1, 3>(xq, xd, g, rows_x, cols, shared);
}

// Q4_0 / Q4_1 weights (16 code bytes per block as ggml packs them, f16 scales d and, for Q4_1,
// f16 minimums m; Q4_0's minimum is -8 d) against activations quantized by quantize_q8. A weight
// is code·d + m, so a block contributes d·dx·Σ code·x + m·dx·Σ x: two integer sums (dp4a).
// One lane's TILE partial sums of weight row r (wc codes, sd scales, sm minimums or null) against
// the activation rows `row_of(j)`, j < nt, as q8_partials walks them: the lane's blocks in
// increasing order, UNROLL blocks' loads before any is used. matmul_q4 and matmul_q4_experts
// both inline this one loop, so each output's arithmetic is the same in both.
template <class RowOf>
__device__ __forceinline__ void q4_partials(const i8* __restrict__ xq, const float* __restrict__ xd,
                                            const int4* __restrict__ wc, const u16* __restrict__ sd,
                                            const u16* __restrict__ sm, u64 r, int nb, int cols, int nt,
                                            RowOf row_of, float acc[TILE]) {
    const int4* wr = wc + r * nb;
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int j = 0; j < TILE; ++j) acc[j] = 0.0f;
    for (int b0 = lane; b0 < nb; b0 += 32 * UNROLL) {
        int4 c[UNROLL];
        float ds[UNROLL], ms[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int b = b0 + 32 * u;
            if (b < nb) {
                c[u] = __ldg(wr + b);
                ds[u] = h2f(__ldg(sd + r * nb + b));
                ms[u] = sm ? h2f(__ldg(sm + r * nb + b)) : -8.0f * ds[u];
            }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int b = b0 + 32 * u;
            if (b < nb) {
                const int4 lo = make_int4(c[u].x & 0x0f0f0f0f, c[u].y & 0x0f0f0f0f, c[u].z & 0x0f0f0f0f,
                                          c[u].w & 0x0f0f0f0f);
                const int4 hi = make_int4((c[u].x >> 4) & 0x0f0f0f0f, (c[u].y >> 4) & 0x0f0f0f0f,
                                          (c[u].z >> 4) & 0x0f0f0f0f, (c[u].w >> 4) & 0x0f0f0f0f);
#pragma unroll
                for (int j = 0; j < TILE; ++j) {
                    if (j < nt) {
                        const u64 row = row_of(j);
                        const int4* xr = (const int4*)(xq + row * cols);
                        const int4 a0 = __ldg(xr + 2 * b), a1 = __ldg(xr + 2 * b + 1);
                        const int dot = dot_block(lo, hi, a0, a1);
                        const int ones = 0x01010101;
                        int sum = dp4a(ones, a0.x, 0);
                        sum = dp4a(ones, a0.y, sum);
                        sum = dp4a(ones, a0.z, sum);
                        sum = dp4a(ones, a0.w, sum);
                        sum = dp4a(ones, a1.x, sum);
                        sum = dp4a(ones, a1.y, sum);
                        sum = dp4a(ones, a1.z, sum);
                        sum = dp4a(ones, a1.w, sum);
                        const float dx = __ldg(xd + row * nb + b);
                        acc[j] += (ds[u] * dx) * (float)dot + (ms[u] * dx) * (float)sum;
                    }
                }
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(WARPS * 32, MIN_BLOCKS)
matmul_q4(const i8* __restrict__ xq, const float* __restrict__ xd, Group g, int rows_x, int cols) {
    const int nb = cols / QK;
    group_tile(g, rows_x, [&](int p, int r, int t0, int nt, float* acc) {
        const int4* __restrict__ wc = (const int4*)pick(p, g.w[0], g.w[1], g.w[2]);
        const u16* __restrict__ wd = (const u16*)pick(p, g.d[0], g.d[1], g.d[2]);
        const u16* __restrict__ wm = (const u16*)pick(p, g.m[0], g.m[1], g.m[2]);
        q4_partials(xq, xd, wc, wd, wm, (u64)r, nb, cols, nt, [t0](int j) { return (u64)(t0 + j); }, acc);
    });
}

// matmul_q8_experts for Q4_0 / Q4_1 experts: the same tiles and entries, q4_partials for the
// sums, so every output has matmul_q4's bits for its row and expert.
struct ExpertQ4 {
    u64 c;  // the expert's codes
    u64 d;  // its block scales (f16 bits)
    u64 m;  // its block minimums (f16 bits) for Q4_1; 0 for Q4_0
};

extern "C" __global__ void __launch_bounds__(WARPS * 32, 4)
matmul_q4_experts(const i8* __restrict__ xq, const float* __restrict__ xd, const ExpertQ4* experts,
                  const ExpertTile* tiles, const u32* rows, float* out, int rows_w, int cols) {
    const int nb = cols / QK;
    experts_tile(experts, tiles, rows, out, rows_w, [&](const ExpertQ4& e, int r, int nt, auto row_of, float* acc) {
        q4_partials(xq, xd, (const int4*)e.c, (const u16*)e.d, (const u16*)e.m, (u64)r, nb, cols, nt, row_of, acc);
    });
}
