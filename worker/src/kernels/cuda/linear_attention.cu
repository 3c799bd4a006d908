// Gated DeltaNet (the linear attention of Qwen3-Next and Qwen3.5): the fused projections split
// apart, the causal conv1d with SiLU, the L2 norm of queries and keys, the gated delta rule,
// and the gated RMSNorm of its output. A sequence's recurrent state (its conv window, then
// each value head's [dk, dv] matrix) lives in the stage's state pool, slot by slot.
//
// The conv1d and the delta rule add in the CPU's order, each product and sum rounded on its
// own (no fused multiply-add), so they differ from the CPU only through the device's exp.
// The delta rule runs whole windows of DELTA_WINDOW prompt positions (aligned to position 0,
// as the host marks them) in the chunked form, as the CPU does, and every other position token
// by token; a window's arithmetic follows the CPU's chunked form step by step but for the
// device's exp and the order of the window's k·k and q·k dot products (in order here, in 16
// lanes on the CPU), so prompts agree with the CPU within a tolerance rather than bit for bit.
// A row's result depends only on its own sequence and positions, whatever else shares the
// batch.
#include "common.cuh"

#define MAX_KEY_DIM 256
// The widest value head: a thread per state column, and a chunked window's registers (under
// 128 a thread) for every thread of the block.
#define MAX_VALUE_DIM 512
// Positions of one chunked window (baton_shared::model_config::DELTA_RULE_WINDOW).
#define DELTA_WINDOW 16

// A sequence of the batch: its first row, its rows, its state slot, and the rows (from its
// first) that lie in whole delta-rule windows, [win0, win1) (five ints).
struct LinearSeq {
    int row0;
    int rows;
    int slot;
    int win0;
    int win1;
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

// One window of DELTA_WINDOW rows from row t0 in the chunked form, as the CPU's delta_chunk
// computes it (kernels/cpu/linear_attention.rs), with G_t the running sum of the log decays
// and S the state before the window: token t learns δ_t = β_t (v_t − e^{G_t} Sᵀk_t −
// Σ_{j<t} e^{G_t−G_j} (k_t·k_j) δ_j), reads o_t = e^{G_t} Sᵀq_t + Σ_{j≤t} e^{G_t−G_j} (q_t·k_j)
// δ_j, and the state becomes e^{G_last} S + Σ_j e^{G_last−G_j} k_j ⊗ δ_j. The state is read
// twice a window instead of twice a token, each read feeding DELTA_WINDOW independent sums.
// The dot products k_t·k_j and q_t·k_j and the decays between positions are the block's to
// share; thread c keeps column c's Sᵀk, Sᵀq and δ in registers.
// q and k rows are dk + 1 apart, so the 16 rows a warp's dot products read at once fall in
// different banks.
struct DeltaWindow {
    float q[DELTA_WINDOW * (MAX_KEY_DIM + 1)];
    float k[DELTA_WINDOW * (MAX_KEY_DIM + 1)];
    float kk[DELTA_WINDOW * DELTA_WINDOW];   // k_t·k_j, j ≤ t
    float qk[DELTA_WINDOW * DELTA_WINDOW];   // q_t·k_j, j ≤ t
    float gap[DELTA_WINDOW * DELTA_WINDOW];  // e^{G_t − G_j}, j < t
    float cum[DELTA_WINDOW];                 // G_t
    float beta[DELTA_WINDOW];
    float head[DELTA_WINDOW];                // e^{G_t}
    float tail[DELTA_WINDOW];                // e^{G_last − G_t}
};

// What a block of delta_rule or delta_rule_windows works on: value head blockIdx.x of
// sequence blockIdx.y, which reads key head g (h % key_heads when `tiled`, else
// h / (value_heads / key_heads)), and its [dk, dv] state S.
struct DeltaHead {
    LinearSeq s;
    float* S;
    float rate, bias;
    int h, g, keys, values, channels;
};

__device__ __forceinline__ DeltaHead delta_head(const float* dt_bias, const float* a_rate, const LinearSeq* seqs,
                                                float* states, int layer, int state_layers, int state_values,
                                                int conv_state, int key_heads, int value_heads, int dk, int dv,
                                                int tiled) {
    DeltaHead d;
    d.h = blockIdx.x;
    d.g = tiled ? d.h % key_heads : d.h / (value_heads / key_heads);
    d.keys = key_heads * dk;
    d.values = value_heads * dv;
    d.channels = 2 * d.keys + d.values;
    d.s = seqs[blockIdx.y];
    d.S = state_of(states, d.s, layer, state_layers, state_values) + conv_state + (u64)d.h * dk * dv;
    d.rate = a_rate[d.h];
    d.bias = dt_bias[d.h];
    return d;
}

__device__ __forceinline__ void delta_window(DeltaWindow& w, const float* conv, const float* b, const float* a,
                                             float* out, const DeltaHead& hd, int t0, int value_heads, int dk,
                                             int dv) {
    const int c = threadIdx.x, ld = dk + 1, h = hd.h, keys = hd.keys, values = hd.values, channels = hd.channels;
    float* S = hd.S;
    for (int i = c; i < DELTA_WINDOW * dk; i += blockDim.x) {
        const int j = i / dk, e = i % dk;
        const float* row = conv + (u64)(t0 + j) * channels;
        w.q[j * ld + e] = row[hd.g * dk + e];
        w.k[j * ld + e] = row[keys + hd.g * dk + e];
    }
    if (c < DELTA_WINDOW) {
        const u64 at = (u64)(t0 + c) * value_heads + h;
        w.beta[c] = 1.0f / (1.0f + expf(-b[at]));
        w.cum[c] = __fmul_rn(hd.rate, softplus(a[at] + hd.bias));
    }
    __syncthreads();
    if (c == 0)
        for (int j = 1; j < DELTA_WINDOW; ++j) w.cum[j] = __fadd_rn(w.cum[j - 1], w.cum[j]);
    __syncthreads();
    for (int i = c; i < DELTA_WINDOW * DELTA_WINDOW; i += blockDim.x) {
        const int t = i / DELTA_WINDOW, j = i % DELTA_WINDOW;
        if (j > t) continue;
        float dkk = 0.0f, dqk = 0.0f;
        for (int e = 0; e < dk; ++e) {
            dkk = __fadd_rn(dkk, __fmul_rn(w.k[t * ld + e], w.k[j * ld + e]));
            dqk = __fadd_rn(dqk, __fmul_rn(w.q[t * ld + e], w.k[j * ld + e]));
        }
        w.kk[i] = dkk;
        w.qk[i] = dqk;
        if (j < t) w.gap[i] = expf(__fsub_rn(w.cum[t], w.cum[j]));
    }
    if (c < DELTA_WINDOW) {
        w.head[c] = expf(w.cum[c]);
        w.tail[c] = expf(__fsub_rn(w.cum[DELTA_WINDOW - 1], w.cum[c]));
    }
    __syncthreads();
    if (c < dv) {
        float sk[DELTA_WINDOW], sq[DELTA_WINDOW], d[DELTA_WINDOW];
#pragma unroll
        for (int t = 0; t < DELTA_WINDOW; ++t) sk[t] = 0.0f, sq[t] = 0.0f;
        for (int e = 0; e < dk; ++e) {
            const float sv = S[(u64)e * dv + c];
#pragma unroll
            for (int t = 0; t < DELTA_WINDOW; ++t) {
                sk[t] = __fadd_rn(sk[t], __fmul_rn(w.k[t * ld + e], sv));
                sq[t] = __fadd_rn(sq[t], __fmul_rn(w.q[t * ld + e], sv));
            }
        }
#pragma unroll
        for (int t = 0; t < DELTA_WINDOW; ++t) {
            const float et = w.head[t], bt = w.beta[t];
            const float v = conv[(u64)(t0 + t) * channels + 2 * keys + h * dv + c];
            float dt = __fmul_rn(bt, __fsub_rn(v, __fmul_rn(et, sk[t])));
#pragma unroll
            for (int j = 0; j < t; ++j) {
                const float coef = __fmul_rn(__fmul_rn(bt, w.gap[t * DELTA_WINDOW + j]), w.kk[t * DELTA_WINDOW + j]);
                dt = __fsub_rn(dt, __fmul_rn(coef, d[j]));
            }
            float o = __fmul_rn(sq[t], et);
#pragma unroll
            for (int j = 0; j < t; ++j) {
                const float coef = __fmul_rn(w.gap[t * DELTA_WINDOW + j], w.qk[t * DELTA_WINDOW + j]);
                o = __fadd_rn(o, __fmul_rn(coef, d[j]));
            }
            o = __fadd_rn(o, __fmul_rn(w.qk[t * DELTA_WINDOW + t], dt));
            d[t] = dt;
            out[(u64)(t0 + t) * values + h * dv + c] = o;
        }
        const float el = w.head[DELTA_WINDOW - 1];
        for (int e = 0; e < dk; ++e) {
            float acc = __fmul_rn(el, S[(u64)e * dv + c]);
#pragma unroll
            for (int j = 0; j < DELTA_WINDOW; ++j)
                acc = __fadd_rn(acc, __fmul_rn(__fmul_rn(w.tail[j], w.k[j * ld + e]), d[j]));
            S[(u64)e * dv + c] = acc;
        }
    }
    __syncthreads(); // every thread is done with the window before the next rows are loaded
}

// The gated delta rule token by token over each sequence's rows before its windows (`after`
// 0) or after them (1): a block per (value head, sequence), a thread per state column (dv of
// the block's whole warps). Per token the state decays by exp(a_rate · softplus(a + dt_bias)),
// learns v at k at rate sigmoid(b) (only what the decayed state does not already predict), and
// is read at q into `out` (`value_heads · dv` wide). A column's sums run along the key
// dimension in order, as the CPU's token-by-token step adds. Decode rows have no windows, so
// this is the one launch of a decode step; a prompt's windows run between the two launches
// (delta_rule_windows), whose shared memory and registers the steps do not carry.
extern "C" __global__ void __launch_bounds__(MAX_VALUE_DIM)
    delta_rule(const float* conv, const float* b, const float* a, const float* dt_bias, const float* a_rate, float* out,
               const LinearSeq* seqs, float* states, int layer, int state_layers, int state_values, int conv_state,
               int key_heads, int value_heads, int dk, int dv, int tiled, int after) {
    __shared__ float qs[MAX_KEY_DIM], ks[MAX_KEY_DIM];
    const DeltaHead hd = delta_head(dt_bias, a_rate, seqs, states, layer, state_layers, state_values, conv_state,
                                    key_heads, value_heads, dk, dv, tiled);
    const int c = threadIdx.x, h = hd.h, g = hd.g, keys = hd.keys, values = hd.values;
    const LinearSeq s = hd.s;
    float* S = hd.S;
    const int first = after ? s.win1 : 0, last = after ? s.rows : s.win0;
    for (int t = s.row0 + first; t < s.row0 + last; ++t) {
        const float* row = conv + (u64)t * hd.channels;
        for (int i = c; i < dk; i += blockDim.x) {
            qs[i] = row[g * dk + i];
            ks[i] = row[keys + g * dk + i];
        }
        __syncthreads();
        if (c < dv) {
            const float beta = 1.0f / (1.0f + expf(-b[(u64)t * value_heads + h]));
            const float decay = expf(hd.rate * softplus(a[(u64)t * value_heads + h] + hd.bias));
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

// Each sequence's whole windows, [win0, win1) of its rows, in the chunked form
// (delta_window), between delta_rule's two launches; the same blocks, threads and parameters
// (`after` unused), so the host launches both from one list.
extern "C" __global__ void __launch_bounds__(MAX_VALUE_DIM)
    delta_rule_windows(const float* conv, const float* b, const float* a, const float* dt_bias, const float* a_rate,
                       float* out, const LinearSeq* seqs, float* states, int layer, int state_layers,
                       int state_values, int conv_state, int key_heads, int value_heads, int dk, int dv, int tiled,
                       int after) {
    __shared__ DeltaWindow window;
    const DeltaHead hd = delta_head(dt_bias, a_rate, seqs, states, layer, state_layers, state_values, conv_state,
                                    key_heads, value_heads, dk, dv, tiled);
    for (int t = hd.s.row0 + hd.s.win0; t < hd.s.row0 + hd.s.win1; t += DELTA_WINDOW)
        delta_window(window, conv, b, a, out, hd, t, value_heads, dk, dv);
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
