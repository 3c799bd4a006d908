// Sampling on the GPU: each row's next token under its own temperature, top-k, top-p and
// min-p, from one uniform number the host drew for it, so a seeded stream draws what the CPU
// path draws (one number per sampled token, none for a greedy row, which comes as top_k = 1).
//
// The kept set is the CPU sampler's: tokens ranked by logit (the lower id first on ties); the
// first top_k of them; of those, the shortest prefix of the ranking whose probability reaches
// top_p of theirs; of those, every token at least min_p times as likely as the most likely.
// The draw walks the kept tokens in id order. A token weighs exp(l / T - max / T) in units of
// 2^-40, as an integer, so every sum is exact: a row's token depends on its logits and draw
// alone, never on the order threads add in. The cuts are found by radix selection over the
// logits' bits (four passes of 8 bits), not by sorting.
#include "common.cuh"

#define SAMPLE_THREADS 1024
// A weight of 1 (the most likely token's) as an integer.
#define MASS_ONE 1099511627776.0f

// One row's settings (`SampleRow` in mod.rs).
struct SampleRow {
    float temperature;
    int top_k;   // 0: no limit
    float top_p; // 1: no limit
    float min_p; // 0: no limit
    float u;     // the draw, in [0, 1)
};

// A logit's bits in the order of the values, NaN lowest.
__device__ __forceinline__ u32 order_key(float l) {
    if (l != l) return 0;
    const u32 b = __float_as_uint(l);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// What a pass over a row's tokens sees of one token.
struct Token {
    int id;
    u32 key;
    u64 w;     // weight, in units of 2^-40
    bool in_k; // within the top-k cut
    bool kept; // within every cut
};

// One thread's contiguous share of a row, and the cuts found so far. A cut keeps the tokens
// with keys above its threshold and, of those at the threshold, the first in id order: up to
// `need` of them (top-k: a count; top-p: weight before them). `before` is what this thread's
// share starts with (the ties, or their weight, in earlier shares).
struct RowView {
    const float* l;
    int begin, end;
    float t, m, min_p;
    bool k_on, p_on;
    u32 k_key, p_key;
    u64 k_need, k_before, p_need, p_before;

    template <class F> __device__ __forceinline__ void each(F f) const {
        u64 k_ties = k_before, p_ties = p_before;
        for (int i = begin; i < end; ++i) {
            const float l_i = l[i];
            const u32 key = order_key(l_i);
            const float w = expf(l_i / t - m);
            const u64 mass = w > 0.0f ? (u64)(w * MASS_ONE) : 0;
            bool in_k = true;
            if (k_on && key <= k_key) in_k = key == k_key && k_ties++ < k_need;
            bool in_p = in_k;
            if (in_k && p_on && key <= p_key) {
                in_p = key == p_key && p_ties < p_need;
                if (key == p_key) p_ties += mass;
            }
            f(Token{i, key, mass, in_k, in_p && w >= min_p});
        }
    }
};

// The block's scratch.
struct SampleShared {
    u64 hist[256];
    u64 warp_total[32];
    float warp_max[32];
    u32 prefix;
    u64 above;
    u32 first;
};

// The exclusive prefix sum of `v` over the block's threads, in thread order; `total` gets the
// whole sum. Integer sums: exact whatever the order.
__device__ u64 block_scan(u64 v, SampleShared& sh, u64& total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    u64 inclusive = v;
    for (int o = 1; o < 32; o <<= 1) {
        const u64 n = __shfl_up_sync(0xffffffffu, inclusive, o);
        if (lane >= o) inclusive += n;
    }
    __syncthreads();
    if (lane == 31) sh.warp_total[warp] = inclusive;
    __syncthreads();
    u64 before = 0, all = 0;
    for (int w = 0; w < warps; ++w) {
        before += w < warp ? sh.warp_total[w] : 0;
        all += sh.warp_total[w];
    }
    total = all;
    return before + inclusive - v;
}

// The threshold key t over the tokens within the top-k cut: those with keys above t count
// (or weigh, `by_mass`) less than `need`, those at t or above at least `need`. `above` gets
// the count (weight) above t.
__device__ u32 radix_select(const RowView& v, bool by_mass, u64 need, u64& above, SampleShared& sh) {
    u32 prefix = 0;
    u64 sum_above = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        const u32 high = shift == 24 ? 0u : (0xffffffffu << (shift + 8));
        for (int d = threadIdx.x; d < 256; d += blockDim.x) sh.hist[d] = 0;
        __syncthreads();
        // Neighbouring tokens often share a digit: add runs, not tokens.
        int run_digit = -1;
        u64 run = 0;
        v.each([&](const Token& t) {
            if (!t.in_k || ((t.key ^ prefix) & high) != 0) return;
            const int d = (int)((t.key >> shift) & 255u);
            if (d != run_digit) {
                if (run != 0) atomicAdd(&sh.hist[run_digit], run);
                run_digit = d;
                run = 0;
            }
            run += by_mass ? t.w : 1;
        });
        if (run != 0) atomicAdd(&sh.hist[run_digit], run);
        __syncthreads();
        if (threadIdx.x == 0) {
            int d = 255;
            for (; d > 0; --d) {
                if (sum_above + sh.hist[d] >= need) break;
                sum_above += sh.hist[d];
            }
            sh.prefix = prefix | ((u32)d << shift);
            sh.above = sum_above;
        }
        __syncthreads();
        prefix = sh.prefix;
        sum_above = sh.above;
    }
    above = sum_above;
    return prefix;
}

// One block per row of `vocab` logits; out[row] = the sampled id.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
sample_rows(const float* logits, const SampleRow* rows, u32* out, int vocab) {
    __shared__ SampleShared sh;
    const SampleRow s = rows[blockIdx.x];
    RowView v;
    v.l = logits + (u64)blockIdx.x * vocab;
    const int share = (vocab + (int)blockDim.x - 1) / (int)blockDim.x;
    v.begin = min(vocab, (int)threadIdx.x * share);
    v.end = min(vocab, v.begin + share);
    float mx = -__int_as_float(0x7f800000);
    for (int i = v.begin; i < v.end; ++i) mx = fmaxf(mx, v.l[i]);
    mx = block_max(mx, sh.warp_max);
    v.t = s.temperature;
    v.m = mx / s.temperature;
    v.min_p = s.min_p;
    v.k_on = v.p_on = false;
    v.k_key = v.p_key = 0;
    v.k_need = v.k_before = v.p_need = v.p_before = 0;
    u64 total;
    if (s.top_k > 0 && s.top_k < vocab) {
        u64 above;
        v.k_key = radix_select(v, false, (u64)s.top_k, above, sh);
        u64 ties = 0;
        v.each([&](const Token& t) { ties += t.key == v.k_key; });
        v.k_before = block_scan(ties, sh, total);
        v.k_need = (u64)s.top_k - above;
        v.k_on = true;
    }
    if (s.top_p < 1.0f) {
        u64 mass = 0;
        v.each([&](const Token& t) { mass += t.in_k ? t.w : 0; });
        block_scan(mass, sh, total);
        u64 want = (u64)((double)s.top_p * (double)total);
        want = want < 1 ? 1 : want;
        u64 above;
        v.p_key = radix_select(v, true, want, above, sh);
        u64 ties = 0;
        v.each([&](const Token& t) { ties += t.in_k && t.key == v.p_key ? t.w : 0; });
        v.p_before = block_scan(ties, sh, total);
        v.p_need = want - above;
        v.p_on = true;
    }
    u64 mass = 0;
    v.each([&](const Token& t) { mass += t.kept ? t.w : 0; });
    const u64 before = block_scan(mass, sh, total);
    if (total == 0) {
        // Only non-finite logits weigh nothing at all: take the first kept token, else 0.
        if (threadIdx.x == 0) sh.first = 0xffffffffu;
        __syncthreads();
        v.each([&](const Token& t) {
            if (t.kept) atomicMin(&sh.first, (u32)t.id);
        });
        __syncthreads();
        if (threadIdx.x == 0) out[blockIdx.x] = sh.first == 0xffffffffu ? 0 : sh.first;
        return;
    }
    u64 r = (u64)((double)s.u * (double)total);
    r = r < total ? r : total - 1;
    if (r < before || r >= before + mass) return;
    u64 acc = before;
    bool found = false;
    v.each([&](const Token& t) {
        if (found || !t.kept) return;
        acc += t.w;
        if (r < acc) {
            out[blockIdx.x] = (u32)t.id;
            found = true;
        }
    });
}
