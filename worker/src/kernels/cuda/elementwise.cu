// Row-wise and element-wise kernels of a decoder layer. Every value is computed from its own
// row only, in a fixed order, so a row's result never depends on its batch.
#include "common.cuh"

// out[t, :] = table[tokens[t], :]
extern "C" __global__ void embed_f32(const float* table, const u32* tokens, float* out, int cols) {
    const int t = blockIdx.x;
    const float* src = table + (u64)tokens[t] * cols;
    float* dst = out + (u64)t * cols;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) dst[c] = src[c];
}

// One row's RMSNorm a float4 per thread (`width` a multiple of four), after `x += y` when y is
// not null: the sum of squares in the order of each thread's strided float4s, then the scaled
// row into o (which may be x).
__device__ __forceinline__ void norm_row4(float* x, const float* y, const float* w, float* o, int width, float eps,
                                          float* partial) {
    float4* x4 = reinterpret_cast<float4*>(x);
    const float4* w4 = reinterpret_cast<const float4*>(w);
    float4* o4 = reinterpret_cast<float4*>(o);
    float ss = 0.0f;
    for (int c = threadIdx.x; c < width / 4; c += blockDim.x) {
        float4 v = x4[c];
        if (y != nullptr) {
            const float4 u = reinterpret_cast<const float4*>(y)[c];
            v.x += u.x;
            v.y += u.y;
            v.z += u.z;
            v.w += u.w;
            x4[c] = v;
        }
        ss += v.x * v.x;
        ss += v.y * v.y;
        ss += v.z * v.z;
        ss += v.w * v.w;
    }
    const float total = block_sum(ss, partial);
    const float scale = 1.0f / sqrtf(total / (float)width + eps);
    for (int c = threadIdx.x; c < width / 4; c += blockDim.x) {
        const float4 v = x4[c], g = w4[c];
        o4[c] = make_float4(v.x * scale * g.x, v.y * scale * g.y, v.z * scale * g.z, v.w * scale * g.w);
    }
}

// RMSNorm of each `width`-wide row of x (one block per row) into out, which may be x. A width
// that is a multiple of four is read a float4 per thread, so a row's loads are in flight
// together; the sum's order depends only on the width and the block size (set by the width).
extern "C" __global__ void rmsnorm(const float* x, const float* w, float* out, int width, float eps) {
    __shared__ float partial[32];
    const u64 row = blockIdx.x;
    const float* xr = x + row * width;
    float* o = out + row * width;
    float ss = 0.0f;
    if ((width & 3) == 0) {
        // Read only: no residual is added.
        norm_row4(const_cast<float*>(xr), nullptr, w, o, width, eps, partial);
        return;
    }
    for (int c = threadIdx.x; c < width; c += blockDim.x) ss += xr[c] * xr[c];
    const float total = block_sum(ss, partial);
    const float scale = 1.0f / sqrtf(total / (float)width + eps);
    for (int c = threadIdx.x; c < width; c += blockDim.x) o[c] = xr[c] * scale * w[c];
}

// Pair i of the (row, head, pair) enumeration of `rows` rows of `heads` heads of x: rotated by
// its row's angle, as rope and rope_qk both rotate it.
__device__ __forceinline__ void rotate_pair(float* x, const float* cos_t, const float* sin_t, u64 i, int heads,
                                            int head_dim, int half) {
    const int p = (int)(i % half);
    const u64 rh = i / half;
    const u64 t = rh / heads;
    float* h = x + t * heads * head_dim + (rh % heads) * head_dim;
    const float c = cos_t[t * half + p], s = sin_t[t * half + p];
    const float a = h[p], b = h[p + half];
    h[p] = a * c - b * s;
    h[p + half] = b * c + a * s;
}

// rmsnorm's float4 path (`width` a multiple of 32, the same block size, so the same sums), after
// `x += y` when y is not null, and then each normed row quantized for the next product
// (quantize_lane) when q is not null: the residual add, the norm and the activations'
// quantization of a layer in one launch, with the bits of the three kernels run one by one.
extern "C" __global__ void rmsnorm_q8(float* x, const float* y, const float* w, float* out, i8* q, float* d, int width,
                                      float eps) {
    __shared__ float partial[32];
    const u64 row = blockIdx.x;
    norm_row4(x + row * width, y != nullptr ? y + row * width : nullptr, w, out + row * width, width, eps, partial);
    if (q == nullptr) return;
    // The row's normed values, written by the whole block, are read back by warps of 32.
    __syncthreads();
    const int blocks = width / QK, warps = blockDim.x >> 5;
    const u64 first = row * blocks;
    for (int b = threadIdx.x >> 5; b < blocks; b += warps)
        quantize_lane(out[(first + b) * QK + (threadIdx.x & 31)], q, d, first + b);
}

// Rotate-half RoPE of the first `rotary` values of each `head_dim`-wide head of every
// `width`-wide row; row t uses cos/sin[t * rotary/2 ..]. One thread per (row, head, pair).
extern "C" __global__ void rope(float* x, const float* cos_t, const float* sin_t, int rows, int width,
                                int head_dim, int rotary) {
    const int half = rotary / 2, heads = width / head_dim;
    const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (u64)rows * heads * half) return;
    rotate_pair(x, cos_t, sin_t, i, heads, head_dim, half);
}

// rope over the queries q (`q_heads` heads a row) and the keys k (`k_heads`) of the same rows in
// one launch: the pairs of q, then those of k.
extern "C" __global__ void rope_qk(float* q, float* k, const float* cos_t, const float* sin_t, int rows, int q_heads,
                                   int k_heads, int head_dim, int rotary) {
    const int half = rotary / 2;
    const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u64 nq = (u64)rows * q_heads * half;
    if (i < nq) {
        rotate_pair(q, cos_t, sin_t, i, q_heads, head_dim, half);
    } else if (i < nq + (u64)rows * k_heads * half) {
        rotate_pair(k, cos_t, sin_t, i - nq, k_heads, head_dim, half);
    }
}

__device__ __forceinline__ float silu_times(float g, float u) {
    return g / (1.0f + expf(-g)) * u;
}

// gate = silu(gate) * up
extern "C" __global__ void silu_mul(float* gate, const float* up, u64 n) {
    const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    gate[i] = silu_times(gate[i], up[i]);
}

// silu_mul, and its result quantized for the next product (quantize_lane) in the same pass: a
// warp per 32-value block, as quantize_q8.
extern "C" __global__ void silu_mul_q8(float* gate, const float* up, i8* q, float* d, u64 blocks) {
    const u64 b = (u64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (b >= blocks) return;
    const u64 i = b * QK + (threadIdx.x & 31);
    const float v = silu_times(gate[i], up[i]);
    gate[i] = v;
    quantize_lane(v, q, d, b);
}

// x += y
extern "C" __global__ void add(float* x, const float* y, u64 n) {
    const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += y[i];
}

// The index of the largest value of each `cols`-wide row (the first on ties), one block per row.
extern "C" __global__ void argmax_rows(const float* x, u32* out, int cols) {
    __shared__ float best_v[1024];
    __shared__ int best_i[1024];
    const float* r = x + (u64)blockIdx.x * cols;
    float v = -__int_as_float(0x7f800000);
    int at = 0x7fffffff;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        if (r[c] > v || at == 0x7fffffff) { v = r[c]; at = c; }
    }
    best_v[threadIdx.x] = v;
    best_i[threadIdx.x] = at;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            const float ov = best_v[threadIdx.x + s];
            const int oi = best_i[threadIdx.x + s];
            if (ov > best_v[threadIdx.x] || (ov == best_v[threadIdx.x] && oi < best_i[threadIdx.x])) {
                best_v[threadIdx.x] = ov;
                best_i[threadIdx.x] = oi;
            }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) out[blockIdx.x] = (u32)best_i[0];
}

// x *= sigmoid(gate)
extern "C" __global__ void sigmoid_mul(float* x, const float* gate, u64 n) {
    const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= 1.0f / (1.0f + expf(-gate[i]));
}

// Each 2·piece-wide run of x: its first half to a, its second to b.
extern "C" __global__ void deinterleave(const float* x, float* a, float* b, int piece, u64 n_half) {
    const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n_half) return;
    const u64 run = i / piece, at = i % piece;
    a[i] = x[run * 2 * piece + at];
    b[i] = x[run * 2 * piece + piece + at];
}
