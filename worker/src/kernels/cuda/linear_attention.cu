// Gated DeltaNet (the linear attention of Qwen3-Next and Qwen3.5): the fused projections split
// apart, the causal conv1d with SiLU, the L2 norm of queries and keys, the gated delta rule,
// and the gated RMSNorm of its output. A sequence's recurrent state (its conv window, then
// each value head's [dk, dv] matrix) lives in the stage's state pool, slot by slot.
//
// The conv1d and the delta rule add in the CPU's order, each product and sum rounded on its
// own (no fused multiply-add), so they differ from the CPU only through the device's exp.
// Every position takes the delta rule token by token; the CPU runs whole windows of a prompt
// in the chunked form, the same function summed in another order, so prompts agree with the
// CPU within a tolerance rather than bit for bit. A row's result depends only on its own
// sequence, whatever else shares the batch.
#include "common.cuh"

#define MAX_KEY_DIM 256

// A sequence of the batch: its first row, its rows and its state slot (three ints).
struct LinearSeq {
    int row0;
    int rows;
    int slot;
};

__device__ __forceinline__ float* state_of(float* states, LinearSeq s, int layer, int state_layers, int state_values) {
    return states + ((u64)s.slot * state_layers + layer) * state_values;
}

// Each row of `qkvz` (per key head: q, k, then its value heads' v and z) into `qkv` (every q,
// every k, every v) and `z`. A thread per value of qkvz.
extern "C" __global__ void split_qkvz(const float* qkvz, float* qkv, float* z, u64 n, int key_heads, int dk,
                                      int per_k, int dv) {
    const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const int vw = per_k * dv, group = 2 * dk + 2 * vw;
    const int keys = key_heads * dk, values = key_heads * vw, channels = 2 * keys + values;
    const u64 t = i / ((u64)key_heads * group);
    const int rest = (int)(i % ((u64)key_heads * group));
    const int g = rest / group, e = rest % group;
    const float v = qkvz[i];
    if (e < dk) qkv[t * channels + g * dk + e] = v;
    else if (e < 2 * dk) qkv[t * channels + keys + g * dk + (e - dk)] = v;
    else if (e < 2 * dk + vw) qkv[t * channels + 2 * keys + g * vw + (e - 2 * dk)] = v;
    else z[t * values + g * vw + (e - 2 * dk - vw)] = v;
}

// Each row of `ba` (per key head: its value heads' b, then their a) into `b` and `a`. A thread
// per value of ba.
extern "C" __global__ void split_ba(const float* ba, float* b, float* a, u64 n, int key_heads, int per_k) {
    const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const int value_heads = key_heads * per_k;
    const u64 t = i / (2 * value_heads);
    const int rest = (int)(i % (2 * value_heads));
    const int g = rest / (2 * per_k), e = rest % (2 * per_k);
    if (e < per_k) b[t * value_heads + g * per_k + e] = ba[i];
    else a[t * value_heads + g * per_k + (e - per_k)] = ba[i];
}

// Causal depthwise conv1d with SiLU over each sequence's rows of `x` (`channels` wide), the
// `kernel` taps `[kernel, channels]`, into `out`; the sequence's conv state (the kernel - 1
// input rows before its first, oldest first) is read, then left holding those before the
// row after its last. A thread per (channel, sequence), its rows in order.
extern "C" __global__ void conv1d_silu(const float* x, float* out, const float* taps, const LinearSeq* seqs,
                                       float* states, int layer, int state_layers, int state_values, int channels,
                                       int kernel) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= channels) return;
    const LinearSeq s = seqs[blockIdx.y];
    float* state = state_of(states, s, layer, state_layers, state_values);
    const int hist = kernel - 1;
    const float* xs = x + (u64)s.row0 * channels;
    for (int t = 0; t < s.rows; ++t) {
        float o = 0.0f;
        for (int j = 0; j < kernel; ++j) {
            const int p = t + j; // row p of [state; x]
            const float in = p < hist ? state[p * channels + c] : xs[(u64)(p - hist) * channels + c];
            o = __fadd_rn(o, __fmul_rn(taps[j * channels + c], in));
        }
        out[((u64)s.row0 + t) * channels + c] = o / (1.0f + expf(-o));
    }
    // The new window: rows rows .. rows + hist of [state; x]. Row j is written after row
    // rows + j > j was read, so the old window is read before it is overwritten.
    for (int j = 0; j < hist; ++j) {
        const int p = s.rows + j;
        state[j * channels + c] = p < hist ? state[p * channels + c] : xs[(u64)(p - hist) * channels + c];
    }
}

// Each dk-wide query and key head of each row (the first 2 · key_heads heads of a
// `channels`-wide row: every q, then every k) times scale / sqrt(sum of squares + 1e-6), the
// scale `q_scale` for queries and 1 for keys. A warp per (row, head).
extern "C" __global__ void l2norm_heads(float* x, u64 pieces, int key_heads, int dk, int channels, float q_scale) {
    const u64 w = (u64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (w >= pieces) return;
    const int lane = threadIdx.x & 31;
    const u64 t = w / (2 * key_heads);
    const int head = (int)(w % (2 * key_heads));
    float* p = x + t * channels + (u64)head * dk;
    float ss = 0.0f;
    for (int i = lane; i < dk; i += 32) ss += p[i] * p[i];
    ss = warp_sum(ss);
    const float inv = (head < key_heads ? q_scale : 1.0f) / sqrtf(ss + 1e-6f);
    for (int i = lane; i < dk; i += 32) p[i] *= inv;
}

__device__ __forceinline__ float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

// The gated delta rule over each sequence's rows in order, a block per (value head, sequence),
// a thread per state column (dv of the block's whole warps): per token the state decays by
// exp(a_rate · softplus(a + dt_bias)), learns v at k at rate sigmoid(b) (only what the decayed
// state does not already predict), and is read at q into `out` (`value_heads · dv` wide). A
// column's sums run along the key dimension in order, as the CPU's token-by-token step adds.
// Value head h reads key head h % key_heads when `tiled`, else h / (value_heads / key_heads).
extern "C" __global__ void delta_rule(const float* conv, const float* b, const float* a, const float* dt_bias,
                                      const float* a_rate, float* out, const LinearSeq* seqs, float* states,
                                      int layer, int state_layers, int state_values, int conv_state, int key_heads,
                                      int value_heads, int dk, int dv, int tiled) {
    __shared__ float qs[MAX_KEY_DIM], ks[MAX_KEY_DIM];
    const int h = blockIdx.x, c = threadIdx.x;
    const int g = tiled ? h % key_heads : h / (value_heads / key_heads);
    const int keys = key_heads * dk, values = value_heads * dv, channels = 2 * keys + values;
    const LinearSeq s = seqs[blockIdx.y];
    float* S = state_of(states, s, layer, state_layers, state_values) + conv_state + (u64)h * dk * dv;
    const float rate = a_rate[h], bias = dt_bias[h];
    for (int t = s.row0; t < s.row0 + s.rows; ++t) {
        const float* row = conv + (u64)t * channels;
        for (int i = c; i < dk; i += blockDim.x) {
            qs[i] = row[g * dk + i];
            ks[i] = row[keys + g * dk + i];
        }
        __syncthreads();
        if (c < dv) {
            const float beta = 1.0f / (1.0f + expf(-b[(u64)t * value_heads + h]));
            const float decay = expf(rate * softplus(a[(u64)t * value_heads + h] + bias));
            const float v = row[2 * keys + h * dv + c];
            float m = 0.0f;
            for (int i = 0; i < dk; ++i) {
                const float sv = __fmul_rn(S[(u64)i * dv + c], decay);
                S[(u64)i * dv + c] = sv;
                m = __fadd_rn(m, __fmul_rn(sv, ks[i]));
            }
            const float d = __fmul_rn(__fsub_rn(v, m), beta);
            float o = 0.0f;
            for (int i = 0; i < dk; ++i) {
                const float sv = __fadd_rn(S[(u64)i * dv + c], __fmul_rn(ks[i], d));
                S[(u64)i * dv + c] = sv;
                o = __fadd_rn(o, __fmul_rn(sv, qs[i]));
            }
            out[(u64)t * values + h * dv + c] = o;
        }
        __syncthreads(); // every thread has read q and k before the next row's are loaded
    }
}

// RMSNorm of each `n`-wide piece of x in place, times silu(z) of the same values: Gated
// DeltaNet's output norm. A block per piece.
extern "C" __global__ void rmsnorm_gated(float* x, const float* w, const float* z, int n, float eps) {
    __shared__ float partial[32];
    float* p = x + (u64)blockIdx.x * n;
    const float* zp = z + (u64)blockIdx.x * n;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) ss += p[i] * p[i];
    const float total = block_sum(ss, partial);
    const float inv = 1.0f / sqrtf(total / (float)n + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float zv = zp[i];
        p[i] = w[i] * (p[i] * inv) * (zv * (1.0f / (1.0f + expf(-zv))));
    }
}
