// Mixture-of-experts rows: the rows the routing sends to one expert, packed for its products,
// and the expert's weighted outputs added back into their rows (expert by expert), or every
// row's experts summed at once (after matmul_q8_experts ran them all in one go); and a shared
// expert's gate. The routing (which rows, what weight) is made on the host and uploaded once
// per layer, or made on the device (route_rows, align_experts, below) for the one-go path:
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

// Routing on the device, for a mixture whose experts run in one go: route_rows picks each
// row's experts, align_experts lays the picks out as the one-go kernels read them. The host
// then never waits for the router's logits, so such a stage's decode step can be a CUDA graph.
// Both follow the CPU's moe::route step by step (the softmax's sum in expert order, the first
// of equal probabilities, the renormalization in pick order); only expf may differ from the
// host's exp, by an ulp or two, so a row's experts can differ from the CPU's only where two
// probabilities (nearly) tie.
#define ROUTE_MAX_EXPERTS 1024
#define ROUTE_MAX_TOP_K 16
#define ALIGN_THREADS 1024
// The one-go kernels' entries per tile (matmul.cu's TILE).
#define ROUTE_TILE 8

// Row blockIdx.x of `logits` (`experts` wide): its `top_k` experts, ascending, into `chosen`,
// and their probabilities (renormalized to sum to one when `normalize`) into `weights`, at
// row * top_k. One warp per row.
extern "C" __global__ void route_rows(const float* logits, u32* chosen, float* weights, int experts, int top_k,
                                      int normalize) {
    __shared__ float p[ROUTE_MAX_EXPERTS];
    const int lane = threadIdx.x & 31;
    const u64 r = blockIdx.x;
    const float* x = logits + r * experts;
    const float neg_inf = __int_as_float(0xff800000);
    float m = neg_inf;
    for (int e = lane; e < experts; e += 32) m = fmaxf(m, x[e]);
    m = warp_max(m);
    for (int e = lane; e < experts; e += 32) p[e] = expf(x[e] - m);
    __syncwarp();
    float sum = 0.0f;
    if (lane == 0)
        for (int e = 0; e < experts; ++e) sum = __fadd_rn(sum, p[e]);
    sum = __shfl_sync(0xffffffffu, sum, 0);
    __syncwarp(); // lane 0's reads of p come before any lane writes it
    for (int e = lane; e < experts; e += 32) p[e] = p[e] / sum;
    __syncwarp();
    u32 ce[ROUTE_MAX_TOP_K];
    float cw[ROUTE_MAX_TOP_K];
    for (int k = 0; k < top_k; ++k) {
        // The first largest: a lane's own in expert order, then the lower expert of equals.
        float best = neg_inf;
        int at = -1;
        for (int e = lane; e < experts; e += 32)
            if (p[e] > best) best = p[e], at = e;
        for (int o = 16; o > 0; o >>= 1) {
            const float ob = __shfl_xor_sync(0xffffffffu, best, o);
            const int oa = __shfl_xor_sync(0xffffffffu, at, o);
            if (ob > best || (ob == best && (unsigned)oa < (unsigned)at)) best = ob, at = oa;
        }
        // Nothing above -inf (NaN logits): expert 0, as the CPU's fold leaves it.
        if (at < 0) at = 0;
        ce[k] = (u32)at;
        cw[k] = best;
        __syncwarp();
        if (lane == 0) p[at] = neg_inf;
        __syncwarp();
    }
    if (lane != 0) return;
    if (normalize) {
        float s = 0.0f;
        for (int k = 0; k < top_k; ++k) s = __fadd_rn(s, cw[k]);
        for (int k = 0; k < top_k; ++k) cw[k] = cw[k] / s;
    }
    // Experts ascending (insertion sort of a few): each expert's entries then ascend by row.
    for (int k = 1; k < top_k; ++k) {
        const u32 e = ce[k];
        const float w = cw[k];
        int j = k - 1;
        for (; j >= 0 && ce[j] > e; --j) ce[j + 1] = ce[j], cw[j + 1] = cw[j];
        ce[j + 1] = e, cw[j + 1] = w;
    }
    for (int k = 0; k < top_k; ++k) chosen[r * top_k + k] = ce[k], weights[r * top_k + k] = cw[k];
}

// route_rows' picks (`rows` rows of `top_k`, experts ascending in a row) laid out in `packed` as
// the CUDA operations pack a host routing (kernels/cuda/experts.rs): every entry's row, then
// its weight (f32 bits), expert after expert and rows ascending within one; `max_tiles` tiles
// of up to ROUTE_TILE entries of one expert (the tiles past the last hold no entries); each
// row's entries, experts ascending. One block: thread (g, e) walks group g of the rows for
// expert e, counting, then writing; groups and experts are summed in between. The experts with
// entries are added to `*active` (a counter the host reads when it likes), since the host
// never sees the routing itself.
extern "C" __global__ void __launch_bounds__(ALIGN_THREADS, 1)
    align_experts(const u32* chosen, const float* weights, u32* packed, int rows, int top_k, int experts,
                  int max_tiles, u32* active) {
    __shared__ int part[ALIGN_THREADS];   // thread (g, e)'s entries, then where they start in e's
    __shared__ int start[ALIGN_THREADS];  // expert e's entries (then its first entry)
    __shared__ int tiles[ALIGN_THREADS];  // expert e's tiles (then its first tile)
    const int t = threadIdx.x;
    const int groups = max(1, min(ALIGN_THREADS / experts, rows));
    const int g = t / experts, e = t % experts;
    const bool walker = g < groups;
    const int per = (rows + groups - 1) / groups;
    const int r0 = min(rows, g * per), r1 = min(rows, r0 + per);
    const u64 n = (u64)rows * top_k;
    u32* entry_rows = packed;
    u32* entry_weights = packed + n;
    u32* tile_words = packed + 2 * n;
    u32* row_entries = packed + 2 * n + 3 * (u64)max_tiles;
    int count = 0;
    if (walker)
        for (u64 i = (u64)r0 * top_k; i < (u64)r1 * top_k; ++i) count += chosen[i] == (u32)e;
    part[t] = count;
    __syncthreads();
    if (t < experts) {
        int total = 0;
        for (int h = 0; h < groups; ++h) {
            const int c = part[h * experts + t];
            part[h * experts + t] = total;
            total += c;
        }
        start[t] = total;
        tiles[t] = (total + ROUTE_TILE - 1) / ROUTE_TILE;
    }
    __syncthreads();
    // Inclusive sums over experts (Hillis-Steele), then each expert's own taken off.
    int own_entries = t < experts ? start[t] : 0, own_tiles = t < experts ? tiles[t] : 0;
    for (int o = 1; o < experts; o <<= 1) {
        int a = 0, b = 0;
        if (t < experts && t >= o) a = start[t - o], b = tiles[t - o];
        __syncthreads();
        if (t < experts && t >= o) start[t] += a, tiles[t] += b;
        __syncthreads();
    }
    const int used_tiles = tiles[experts - 1];
    if (t < experts && own_entries > 0) atomicAdd(active, 1u);
    __syncthreads();
    if (t < experts) start[t] -= own_entries, tiles[t] -= own_tiles;
    __syncthreads();
    if (walker) {
        u32 at = (u32)(start[e] + part[t]);
        for (u64 i = (u64)r0 * top_k; i < (u64)r1 * top_k; ++i) {
            if (chosen[i] != (u32)e) continue;
            entry_rows[at] = (u32)(i / top_k);
            entry_weights[at] = __float_as_uint(weights[i]);
            row_entries[i] = at;
            ++at;
        }
    }
    if (t < experts)
        for (int k = 0; k < own_tiles; ++k) {
            u32* w = tile_words + 3 * (u64)(tiles[t] + k);
            w[0] = (u32)t;
            w[1] = (u32)(start[t] + k * ROUTE_TILE);
            w[2] = (u32)min(ROUTE_TILE, own_entries - k * ROUTE_TILE);
        }
    for (int k = used_tiles + t; k < max_tiles; k += blockDim.x) {
        u32* w = tile_words + 3 * (u64)k;
        w[0] = 0, w[1] = 0, w[2] = 0;
    }
}
