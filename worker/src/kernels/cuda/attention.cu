// Paged attention over a micro-batch's sequences, and storing their new K/V in the pool.
//
// K/V live in a pool of blocks of `block_size` positions (`kv_dim` values each); a sequence's
// block table names its blocks in position order. Per query row, `meta` holds
// {position, causal end, block end, offset of its table in `tables`}. One thread block serves
// one (row, head). Its warps take tiles of 32 keys in turn: each lane scores one key of the
// tile (so the 32 keys' loads are in flight together, not one after another), the warp folds
// the tile into its online softmax, then its lanes add the tile's values dimension by
// dimension. The warps merge in a fixed order, so a row's result depends only on its own
// sequence and the summation order only on the shapes.
#include "common.cuh"

#define ATT_WARPS 8
#define MAX_DIMS 8 // head_dim up to 256: eight values per lane

__device__ __forceinline__ float load_kv(const float* p) { return *p; }
__device__ __forceinline__ float load_kv(const u16* p) { return h2f(*p); }
__device__ __forceinline__ void store_kv(float* p, float v) { *p = v; }
__device__ __forceinline__ void store_kv(u16* p, float v) { *p = f2h(v); }

template <typename KV>
__device__ void store_rows(const float* k, const float* v, KV* kpool, KV* vpool, const int* slots, int kv_dim) {
    const u64 t = blockIdx.x;
    const u64 dst = (u64)slots[t] * kv_dim;
    for (int c = threadIdx.x; c < kv_dim; c += blockDim.x) {
        store_kv(kpool + dst + c, k[t * kv_dim + c]);
        store_kv(vpool + dst + c, v[t * kv_dim + c]);
    }
}

extern "C" __global__ void store_kv_f32(const float* k, const float* v, float* kp, float* vp, const int* slots,
                                        int kv_dim) {
    store_rows(k, v, kp, vp, slots, kv_dim);
}

extern "C" __global__ void store_kv_f16(const float* k, const float* v, u16* kp, u16* vp, const int* slots,
                                        int kv_dim) {
    store_rows(k, v, kp, vp, slots, kv_dim);
}

// q · k over `n` dimensions, summed in dimension order whatever the load width, so every path
// below gives the same bits. Wide loads need n to be a multiple of their width (every real
// head is); `q` is in shared memory, read by all lanes at once.
__device__ __forceinline__ float dot_key(const float* q, const float* k, int n) {
    float s = 0.0f;
    if ((n & 3) == 0) {
        const float4* k4 = reinterpret_cast<const float4*>(k);
#pragma unroll 8
        for (int i = 0; i < n / 4; ++i) {
            const float4 v = k4[i];
            s += q[4 * i] * v.x;
            s += q[4 * i + 1] * v.y;
            s += q[4 * i + 2] * v.z;
            s += q[4 * i + 3] * v.w;
        }
    } else {
        for (int d = 0; d < n; ++d) s += q[d] * k[d];
    }
    return s;
}

// Eight f16 values (one 16-byte load) folded into s in order.
__device__ __forceinline__ float dot8(float s, const float* q, uint4 v) {
    const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        s += q[2 * j] * h2f((u16)(w[j] & 0xffffu));
        s += q[2 * j + 1] * h2f((u16)(w[j] >> 16));
    }
    return s;
}

__device__ __forceinline__ float dot_key(const float* q, const u16* k, int n) {
    float s = 0.0f;
    if ((n & 7) == 0) {
        const uint4* k8 = reinterpret_cast<const uint4*>(k);
#pragma unroll 4
        for (int i = 0; i < n / 8; ++i) s = dot8(s, q + 8 * i, k8[i]);
    } else {
        for (int d = 0; d < n; ++d) s += q[d] * h2f(k[d]);
    }
    return s;
}

// A head of HD f16 values: all of its loads issued before the first product, so a lane waits
// on memory once per key, not once per 16 bytes.
template <int HD>
__device__ __forceinline__ float dot_key_fixed(const float* q, const u16* k) {
    const uint4* k8 = reinterpret_cast<const uint4*>(k);
    uint4 v[HD / 8];
#pragma unroll
    for (int i = 0; i < HD / 8; ++i) v[i] = k8[i];
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < HD / 8; ++i) s = dot8(s, q + 8 * i, v[i]);
    return s;
}

template <int HD, typename KV>
__device__ __forceinline__ float score(const float* q, const KV* k, int head_dim) {
    if constexpr (HD != 0 && sizeof(KV) == 2) {
        return dot_key_fixed<HD>(q, reinterpret_cast<const u16*>(k));
    } else {
        return dot_key(q, k, HD != 0 ? HD : head_dim);
    }
}

// Keys whose values a lane loads before adding any of them.
#define V_BATCH 8

// A block's scratch, declared once per kernel (not once per instantiation of `attend`).
struct AttShared {
    float q[MAX_DIMS * 32];
    float p[ATT_WARPS][32];
    u64 row[ATT_WARPS][32];
    float m[ATT_WARPS], l[ATT_WARPS];
    float acc[ATT_WARPS][MAX_DIMS * 32];
};

// One (row, head) of attention. HD is the head width when known at compile time (the common
// widths, so loads are unrolled and registers sized), or 0 for any width up to MAX_DIMS * 32.
template <typename KV, int HD>
__device__ void attend(const float* q, const KV* kpool, const KV* vpool, const int* meta, const u32* tables,
                       float* out, int heads, int kv_heads, int head_dim, int block_size, int mask_block,
                       float scale, AttShared& sh) {
    constexpr int DIMS = HD != 0 ? (HD + 31) / 32 : MAX_DIMS;
    float* q_s = sh.q;
    auto& p_s = sh.p;
    auto& row_s = sh.row;
    float* m_s = sh.m;
    float* l_s = sh.l;
    auto& acc_s = sh.acc;
    const int t = blockIdx.x, h = blockIdx.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int kvh = h / (heads / kv_heads);
    const int kv_dim = kv_heads * head_dim;
    const int* m = meta + 4 * t;
    const int keys = mask_block ? m[2] : m[1];
    const u32* table = tables + m[3];
    const float* qr = q + ((u64)t * heads + h) * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) q_s[d] = qr[d];
    __syncthreads();
    float acc[DIMS];
#pragma unroll
    for (int i = 0; i < DIMS; ++i) acc[i] = 0.0f;
    float mx = -__int_as_float(0x7f800000), l = 0.0f;
    for (int tile = 32 * warp; tile < keys; tile += 32 * ATT_WARPS) {
        const int j = tile + lane;
        float s = -__int_as_float(0x7f800000);
        u64 row = 0;
        if (j < keys) {
            row = (u64)table[j / block_size] * block_size + j % block_size;
            s = score<HD>(q_s, kpool + row * kv_dim + kvh * head_dim, head_dim) * scale;
        }
        // The tile has at least one key (lane 0's), so mn is finite.
        const float mn = fmaxf(mx, warp_max(s));
        const float corr = expf(mx - mn), p = j < keys ? expf(s - mn) : 0.0f;
        l = l * corr + warp_sum(p);
        p_s[warp][lane] = p;
        row_s[warp][lane] = row;
        __syncwarp();
        const int n = min(32, keys - tile);
#pragma unroll
        for (int i = 0; i < DIMS; ++i) acc[i] *= corr;
        // Values V_BATCH keys at a time: every load of the batch in flight, then the products
        // in key order (a key past the tile adds 0 · 0).
        for (int k0 = 0; k0 < n; k0 += V_BATCH) {
            float pk[V_BATCH], v[V_BATCH][DIMS];
#pragma unroll
            for (int u = 0; u < V_BATCH; ++u) {
                const int key = k0 + u;
                pk[u] = key < n ? p_s[warp][key] : 0.0f;
                const KV* vr = vpool + row_s[warp][key < n ? key : 0] * kv_dim + kvh * head_dim;
#pragma unroll
                for (int i = 0; i < DIMS; ++i) {
                    const int d = lane + 32 * i;
                    v[u][i] = key < n && d < head_dim ? load_kv(vr + d) : 0.0f;
                }
            }
#pragma unroll
            for (int u = 0; u < V_BATCH; ++u) {
#pragma unroll
                for (int i = 0; i < DIMS; ++i) acc[i] += pk[u] * v[u][i];
            }
        }
        mx = mn;
        __syncwarp();
    }
    if (lane == 0) {
        m_s[warp] = mx;
        l_s[warp] = l;
    }
#pragma unroll
    for (int i = 0; i < DIMS; ++i) acc_s[warp][lane + 32 * i] = acc[i];
    __syncthreads();
    if (warp != 0) return;
    float gm = m_s[0];
    for (int w = 1; w < ATT_WARPS; ++w) gm = fmaxf(gm, m_s[w]);
    float total = 0.0f;
    float f[ATT_WARPS];
#pragma unroll
    for (int w = 0; w < ATT_WARPS; ++w) {
        // A warp that saw no key has l = 0 and m = -inf: it adds nothing.
        f[w] = l_s[w] > 0.0f ? expf(m_s[w] - gm) : 0.0f;
        total += l_s[w] * f[w];
    }
    float* o = out + ((u64)t * heads + h) * head_dim;
#pragma unroll
    for (int i = 0; i < DIMS; ++i) {
        const int d = lane + 32 * i;
        if (d < head_dim) {
            float v = 0.0f;
            for (int w = 0; w < ATT_WARPS; ++w) v += acc_s[w][d] * f[w];
            o[d] = v / total;
        }
    }
}

// The kernels pick the compiled width for the common heads, the general loop otherwise.
template <typename KV>
__device__ __forceinline__ void attend_any(const float* q, const KV* kp, const KV* vp, const int* meta,
                                           const u32* tables, float* out, int heads, int kv_heads, int head_dim,
                                           int block_size, int mask_block, float scale) {
    __shared__ AttShared sh;
    switch (head_dim) {
    case 64:
        attend<KV, 64>(q, kp, vp, meta, tables, out, heads, kv_heads, head_dim, block_size, mask_block, scale, sh);
        break;
    case 128:
        attend<KV, 128>(q, kp, vp, meta, tables, out, heads, kv_heads, head_dim, block_size, mask_block, scale, sh);
        break;
    default:
        attend<KV, 0>(q, kp, vp, meta, tables, out, heads, kv_heads, head_dim, block_size, mask_block, scale, sh);
    }
}

extern "C" __global__ void __launch_bounds__(ATT_WARPS * 32)
attention_f32(const float* q, const float* kp, const float* vp, const int* meta, const u32* tables, float* out,
              int heads, int kv_heads, int head_dim, int block_size, int mask_block, float scale) {
    attend_any(q, kp, vp, meta, tables, out, heads, kv_heads, head_dim, block_size, mask_block, scale);
}

extern "C" __global__ void __launch_bounds__(ATT_WARPS * 32)
attention_f16(const float* q, const u16* kp, const u16* vp, const int* meta, const u32* tables, float* out,
              int heads, int kv_heads, int head_dim, int block_size, int mask_block, float scale) {
    attend_any(q, kp, vp, meta, tables, out, heads, kv_heads, head_dim, block_size, mask_block, scale);
}
