// Mixture-of-experts rows: the rows the routing sends to one expert, packed for its products,
// and the expert's weighted outputs added back into their rows; and a shared expert's gate.
// The routing (which rows, what weight) is the host's, uploaded once per layer: one expert's
// entries name distinct rows, so no two blocks of one launch write the same value, and the
// experts' launches follow each other on the stream in ascending expert order, the order the
// CPU adds them in.
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
