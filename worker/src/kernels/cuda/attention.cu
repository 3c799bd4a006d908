// Paged attention over a micro-batch's sequences, and storing their new K/V in the pool.
//
// K/V live in a pool of blocks of `block_size` positions (`kv_dim` values each); a sequence's
// block table names its blocks in position order. Per query row, `meta` holds
// {position, causal end, block end, offset of its table in `tables`}. One thread block serves
// one (row, head); its warps take keys in turn with an online softmax each, then merge in a
// fixed order, so a row's result depends only on its own sequence.
#include "common.cuh"

#define ATT_WARPS 4
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

template <typename KV>
__device__ void attend(const float* q, const KV* kpool, const KV* vpool, const int* meta, const u32* tables,
                       float* out, int heads, int kv_heads, int head_dim, int block_size, int mask_block,
                       float scale) {
    __shared__ float m_s[ATT_WARPS], l_s[ATT_WARPS];
    __shared__ float acc_s[ATT_WARPS][MAX_DIMS * 32];
    const int t = blockIdx.x, h = blockIdx.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int kvh = h / (heads / kv_heads);
    const int kv_dim = kv_heads * head_dim;
    const int* m = meta + 4 * t;
    const int keys = mask_block ? m[2] : m[1];
    const u32* table = tables + m[3];
    const float* qr = q + ((u64)t * heads + h) * head_dim;
    float qv[MAX_DIMS], acc[MAX_DIMS];
#pragma unroll
    for (int i = 0; i < MAX_DIMS; ++i) {
        const int d = lane + 32 * i;
        qv[i] = d < head_dim ? qr[d] : 0.0f;
        acc[i] = 0.0f;
    }
    float mx = -__int_as_float(0x7f800000), l = 0.0f;
    for (int j = warp; j < keys; j += ATT_WARPS) {
        const u64 row = (u64)table[j / block_size] * block_size + j % block_size;
        const KV* kr = kpool + row * kv_dim + kvh * head_dim;
        float s = 0.0f;
#pragma unroll
        for (int i = 0; i < MAX_DIMS; ++i) {
            const int d = lane + 32 * i;
            if (d < head_dim) s += qv[i] * load_kv(kr + d);
        }
        s = warp_sum(s) * scale;
        const float mn = fmaxf(mx, s);
        const float corr = expf(mx - mn), p = expf(s - mn);
        l = l * corr + p;
        const KV* vr = vpool + row * kv_dim + kvh * head_dim;
#pragma unroll
        for (int i = 0; i < MAX_DIMS; ++i) {
            const int d = lane + 32 * i;
            acc[i] = acc[i] * corr + (d < head_dim ? p * load_kv(vr + d) : 0.0f);
        }
        mx = mn;
    }
    if (lane == 0) {
        m_s[warp] = mx;
        l_s[warp] = l;
    }
#pragma unroll
    for (int i = 0; i < MAX_DIMS; ++i) acc_s[warp][lane + 32 * i] = acc[i];
    __syncthreads();
    if (warp != 0) return;
    float gm = m_s[0];
    for (int w = 1; w < ATT_WARPS; ++w) gm = fmaxf(gm, m_s[w]);
    float total = 0.0f;
    float f[ATT_WARPS];
    for (int w = 0; w < ATT_WARPS; ++w) {
        // A warp that saw no key has l = 0 and m = -inf: it adds nothing.
        f[w] = l_s[w] > 0.0f ? expf(m_s[w] - gm) : 0.0f;
        total += l_s[w] * f[w];
    }
    float* o = out + ((u64)t * heads + h) * head_dim;
#pragma unroll
    for (int i = 0; i < MAX_DIMS; ++i) {
        const int d = lane + 32 * i;
        if (d < head_dim) {
            float v = 0.0f;
            for (int w = 0; w < ATT_WARPS; ++w) v += acc_s[w][d] * f[w];
            o[d] = v / total;
        }
    }
}

extern "C" __global__ void __launch_bounds__(ATT_WARPS * 32)
attention_f32(const float* q, const float* kp, const float* vp, const int* meta, const u32* tables, float* out,
              int heads, int kv_heads, int head_dim, int block_size, int mask_block, float scale) {
    attend(q, kp, vp, meta, tables, out, heads, kv_heads, head_dim, block_size, mask_block, scale);
}

extern "C" __global__ void __launch_bounds__(ATT_WARPS * 32)
attention_f16(const float* q, const u16* kp, const u16* vp, const int* meta, const u32* tables, float* out,
              int heads, int kv_heads, int head_dim, int block_size, int mask_block, float scale) {
    attend(q, kp, vp, meta, tables, out, heads, kv_heads, head_dim, block_size, mask_block, scale);
}
