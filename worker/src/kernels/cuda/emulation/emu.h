// A CPU emulation of the CUDA execution model, just wide enough for Baton's kernels: it lets
// the `.cu` files compile as plain C++ and run in unit tests on machines with no GPU (CI, and
// most sessions), so a kernel's indexing, synchronisation and arithmetic are checked against
// the CPU reference before a GPU is ever lent. It does not check what only a GPU shows
// (speed, the memory model between blocks, the CUDA compiler's code).
//
// Every thread of a block is an OS thread; the blocks of a launch run one after another, so a
// `__shared__` variable (a function-local `static` here) is the running block's own.
// `__syncthreads`, `__syncwarp` and the warp shuffles are barriers; a thread that returns
// drops out of them, as an exited GPU thread does. Launches are serialised.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#define BATON_EMULATION 1
#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __shared__ static

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};
struct alignas(8) float2 {
    float x, y;
};
struct alignas(16) float4 {
    float x, y, z, w;
};
struct alignas(16) int4 {
    int x, y, z, w;
};
struct alignas(8) uint2 {
    unsigned x, y;
};
struct alignas(16) uint4 {
    unsigned x, y, z, w;
};
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline int4 make_int4(int x, int y, int z, int w) { return {x, y, z, w}; }

inline thread_local dim3 threadIdx, blockIdx;
inline dim3 blockDim, gridDim;

namespace emu {

// The running block: its barriers and one exchange slot per thread for shuffles.
struct Block {
    std::barrier<> all;
    std::vector<std::unique_ptr<std::barrier<>>> warps;
    std::vector<uint64_t> slots;
    std::vector<std::array<int, 6>> fragments;
    explicit Block(int threads) : all(threads), slots(threads), fragments(threads) {
        for (int w = 0; w < threads; w += 32) warps.push_back(std::make_unique<std::barrier<>>(32));
    }
};

inline thread_local Block* block = nullptr;

inline std::barrier<>& warp_barrier() { return *block->warps[threadIdx.x / 32]; }

// Lane `src`'s `v` of this thread's warp.
template <class T> T exchange(T v, unsigned src) {
    static_assert(sizeof(T) <= 8, "a shuffle moves at most 8 bytes");
    uint64_t bits = 0;
    std::memcpy(&bits, &v, sizeof v);
    const unsigned base = threadIdx.x & ~31u;
    block->slots[threadIdx.x] = bits;
    warp_barrier().arrive_and_wait();
    const uint64_t got = block->slots[base + (src & 31u)];
    warp_barrier().arrive_and_wait();
    T r;
    std::memcpy(&r, &got, sizeof r);
    return r;
}

inline std::mutex launch_lock;

// Run `kernel` over `grid` blocks of `block_dim` threads (one-dimensional blocks of whole warps).
template <class F> void launch(dim3 grid, dim3 block_dim, F kernel) {
    std::lock_guard<std::mutex> serial(launch_lock);
    const int threads = (int)block_dim.x;
    if (threads <= 0 || threads % 32 != 0 || threads > 1024 || block_dim.y != 1 || block_dim.z != 1) std::abort();
    gridDim = grid;
    blockDim = block_dim;
    for (unsigned z = 0; z < grid.z; ++z)
        for (unsigned y = 0; y < grid.y; ++y)
            for (unsigned x = 0; x < grid.x; ++x) {
                Block b(threads);
                std::vector<std::thread> pool;
                pool.reserve(threads);
                for (int t = 0; t < threads; ++t)
                    pool.emplace_back([&b, &kernel, t, x, y, z] {
                        threadIdx = {(unsigned)t, 0, 0};
                        blockIdx = {x, y, z};
                        block = &b;
                        kernel();
                        b.warps[t / 32]->arrive_and_drop();
                        b.all.arrive_and_drop();
                    });
                for (auto& th : pool) th.join();
            }
}

} // namespace emu

inline void __syncthreads() { emu::block->all.arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu::warp_barrier().arrive_and_wait(); }

template <class T> T __shfl_sync(unsigned, T v, int src) { return emu::exchange(v, (unsigned)src); }
template <class T> T __shfl_xor_sync(unsigned, T v, int mask) {
    return emu::exchange(v, (threadIdx.x & 31u) ^ (unsigned)mask);
}
template <class T> T __shfl_up_sync(unsigned, T v, unsigned delta) {
    const unsigned lane = threadIdx.x & 31u;
    return emu::exchange(v, lane >= delta ? lane - delta : lane);
}
template <class T> T __shfl_down_sync(unsigned, T v, unsigned delta) {
    const unsigned lane = threadIdx.x & 31u;
    return emu::exchange(v, lane + delta < 32 ? lane + delta : lane);
}

template <class T> T __ldg(const T* p) { return *p; }

template <class T> T atomicAdd(T* p, T v) { return std::atomic_ref<T>(*p).fetch_add(v); }
template <class T> T atomicMin(T* p, T v) {
    std::atomic_ref<T> a(*p);
    T old = a.load();
    while (v < old && !a.compare_exchange_weak(old, v)) {
    }
    return old;
}

// The bits of one 4-byte value as another type.
template <class To, class From> To bit_cast4(From v) {
    static_assert(sizeof(To) == 4 && sizeof(From) == 4, "4-byte values");
    To r;
    std::memcpy(&r, &v, 4);
    return r;
}
inline float __int_as_float(int i) { return bit_cast4<float>(i); }
inline int __float_as_int(float f) { return bit_cast4<int>(f); }
inline float __uint_as_float(unsigned i) { return bit_cast4<float>(i); }
inline unsigned __float_as_uint(float f) { return bit_cast4<unsigned>(f); }
// The CUDA compiler never fuses these into a multiply-add; ISO C++ (-std=c++20) does not fuse
// plain operations either.
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fsub_rn(float a, float b) { return a - b; }

// CUDA's integer min and max (both arguments of one type in Baton's kernels).
template <class T> T min(T a, T b) { return a < b ? a : b; }
template <class T> T max(T a, T b) { return a > b ? a : b; }

// What common.cuh writes as inline PTX.
inline float h2f(unsigned short h) {
    _Float16 v;
    std::memcpy(&v, &h, 2);
    return (float)v;
}
inline unsigned short f2h(float f) {
    const _Float16 v = (_Float16)f;
    unsigned short h;
    std::memcpy(&h, &v, 2);
    return h;
}
inline float2 h2f2(unsigned v) { return {h2f((unsigned short)(v & 0xffffu)), h2f((unsigned short)(v >> 16))}; }
inline int dp4a(int a, int b, int c) {
    for (int i = 0; i < 4; ++i) c += (int)(signed char)(a >> (8 * i)) * (int)(signed char)(b >> (8 * i));
    return c;
}

// `mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32` with a zero accumulator, as the PTX ISA
// lays its fragments out (groupID g = lane / 4, threadID_in_group t = lane % 4): A's registers
// hold row g, k 4t..4t+3; row g + 8, the same k; row g, k 16 + 4t..; row g + 8, k 16 + 4t..
// (the low byte first); B's hold column g at k 4t.. and k 16 + 4t..; D holds rows g and g + 8
// by columns 2t and 2t + 1. Written from that description, not from the kernels' loads, so a
// kernel that lays out its tiles otherwise fails its test here.
inline void mma_s8(int d[4], const int a[4], const int b[2]) {
    emu::Block* blk = emu::block;
    const unsigned t = threadIdx.x, base = t & ~31u, lane = t & 31u;
    blk->fragments[t] = {a[0], a[1], a[2], a[3], b[0], b[1]};
    emu::warp_barrier().arrive_and_wait();
    auto byte = [](int reg, int k) { return (int)(signed char)(reg >> (8 * (k & 3))); };
    auto a_at = [&](int row, int k) {
        const auto& f = blk->fragments[base + (row & 7) * 4 + ((k & 15) >> 2)];
        return byte(f[(row >= 8 ? 1 : 0) + (k >= 16 ? 2 : 0)], k);
    };
    auto b_at = [&](int k, int col) {
        const auto& f = blk->fragments[base + col * 4 + ((k & 15) >> 2)];
        return byte(f[4 + (k >= 16 ? 1 : 0)], k);
    };
    const int g = (int)(lane >> 2), tg = (int)(lane & 3);
    for (int i = 0; i < 4; ++i) {
        const int row = g + (i >= 2 ? 8 : 0), col = 2 * tg + (i & 1);
        int sum = 0;
        for (int k = 0; k < 32; ++k) sum += a_at(row, k) * b_at(k, col);
        d[i] = sum;
    }
    emu::warp_barrier().arrive_and_wait();
}
