// Mixture-of-experts rows: the rows the routing sends to one expert, packed for its products,
// and the expert's weighted outputs added back into their rows (expert by expert), or every
// row's experts summed at once (after matmul_q8_experts ran them all in one go); and a shared
// expert's gate. The routing (which rows, what weight) is the host's, uploaded once per layer:
// one expert's entries name distinct rows, so no two blocks of one launch write the same
// value, and expert by expert the launches follow each other on the stream in ascending
// expert order, the order the CPU adds them in.
#include "common.cuh"

// out[i, :] = x[rows[i], :] for each of one expert's entries (one block per entry).
extern "C" __global__ void gather_rows(const float* x, const u32* rows, float* out, int width) {
    const u64 i = blockIdx.x;
    const float* src = x + (u64)rows[i] * width;
    float* dst = out + i * width;
    for (int c = threadIdx.x; c < width; c += blockDim.x) dst[c] = src[c];
}

// out[rows[i], :] += y[i, :] · weights[i] (one block per entry). A product, then a sum, each
// rounded (no fused multiply-add), as the CPU rounds them: the same expert outputs give the
// CPU's mixture bit for bit.
extern "C" __global__ void scatter_add_rows(const float* y, const u32* rows, const float* weights, float* out,
                                            int width) {
    const u64 i = blockIdx.x;
    const float w = weights[i];
    const float* src = y + i * width;
    float* dst = out + (u64)rows[i] * width;
    for (int c = threadIdx.x; c < width; c += blockDim.x) dst[c] = __fadd_rn(dst[c], __fmul_rn(w, src[c]));
}

// out[r, :] += sigmoid(gate[r]) · y[r, :]: a shared expert weighted by its own gate, one gate
// value per row (one block per row).
extern "C" __global__ void add_sigmoid_scaled(float* out, const float* y, const float* gate, int width) {
    const u64 r = blockIdx.x;
    const float s = 1.0f / (1.0f + expf(-gate[r]));
    const float* src = y + r * width;
    float* dst = out + r * width;
    for (int c = threadIdx.x; c < width; c += blockDim.x) dst[c] = __fadd_rn(dst[c], __fmul_rn(s, src[c]));
}

// out[r, :] = Σ weights[e] · y[e, :] over row r's `top_k` entries e (`entries`, its experts in
// ascending order), summed from zero in that order: what zeroing out and then scatter_add_rows
// expert by expert give, bit for bit, in one launch (one block per row).
extern "C" __global__ void combine_rows(const float* y, const u32* entries, const float* weights, float* out, int top_k,
                                        int width) {
    const u64 r = blockIdx.x;
    const u32* mine = entries + r * top_k;
    for (int c = threadIdx.x; c < width; c += blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < top_k; ++j) {
            const u32 e = mine[j];
            acc = __fadd_rn(acc, __fmul_rn(weights[e], y[(u64)e * width + c]));
        }
        out[r * width + c] = acc;
    }
}
