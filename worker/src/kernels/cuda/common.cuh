// Shared by every Baton CUDA kernel file. NVRTC compiles these without the CUDA headers, so
// the few types and intrinsics needed are spelled out here (half conversion and dp4a as PTX).
#pragma once

typedef unsigned int u32;
typedef unsigned short u16;
typedef signed char i8;
typedef unsigned long long u64;

// Values per Q8_0 block.
#define QK 32

// The sum of a warp's values, as lane 0 computes it, given to every lane: one fixed order, so
// a result never depends on which lane reads it.
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return __shfl_sync(0xffffffffu, v, 0);
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Each warp's value (already reduced over the warp) into shared[warp], for every thread of the
// block to read; returns the block's warps. `shared` holds at least 32 floats; the block size
// is a multiple of 32.
__device__ __forceinline__ int share_warps(float v, float* shared) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    __syncthreads();
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    return warps;
}

// The sum over a block of up to 32 warps, in one fixed order; every thread gets it.
__device__ __forceinline__ float block_sum(float v, float* shared) {
    const int warps = share_warps(warp_sum(v), shared);
    float total = 0.0f;
    for (int w = 0; w < warps; ++w) total += shared[w];
    return total;
}

// The largest value over a block, gathered as block_sum gathers its sum; every thread gets it.
__device__ __forceinline__ float block_max(float v, float* shared) {
    const int warps = share_warps(warp_max(v), shared);
    float m = shared[0];
    for (int w = 1; w < warps; ++w) m = fmaxf(m, shared[w]);
    return m;
}

// Lane `lane` of a warp holding value v of Q8_0 block b (every lane of the warp one value of
// it): the block's quants into q and, from lane 0, its scale max|x|/127 into d, rounding half
// away from zero (as the CPU path and ggml do). Every kernel that quantizes activations for a
// product goes through here, so a block's quants never depend on which kernel made them.
__device__ __forceinline__ void quantize_lane(float v, i8* q, float* d, u64 b) {
    const int lane = threadIdx.x & 31;
    const float amax = __shfl_sync(0xffffffffu, warp_max(fabsf(v)), 0);
    const float scale = amax / 127.0f;
    const float inv = scale != 0.0f ? 1.0f / scale : 0.0f;
    q[b * QK + lane] = (i8)fminf(fmaxf(roundf(v * inv), -127.0f), 127.0f);
    if (lane == 0) d[b] = scale;
}

#ifndef BATON_EMULATION // emulation/emu.h defines these for the CPU emulation
__device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u16 f2h(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// Both f16 values packed in `v` (low half first), widened in one step: the 16-bit registers stay
// inside the asm, which keeps ptxas from spilling around them in wide loops.
__device__ __forceinline__ float2 h2f2(u32 v) {
    float2 r;
    asm("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, %2; cvt.f32.f16 %0, lo; cvt.f32.f16 %1, hi; }"
        : "=f"(r.x), "=f"(r.y)
        : "r"(v));
    return r;
}

// Four signed byte products added to `c`.
__device__ __forceinline__ int dp4a(int a, int b, int c) {
    int d;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}
#endif
