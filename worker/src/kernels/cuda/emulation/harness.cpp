// Baton's CUDA kernels compiled for the CPU emulation (emu.h), each behind a C entry point
// `emu_<kernel>(grid, block, arguments...)` that the unit tests in emulated.rs call.
#include "emu.h"

#include "../attention.cu"
#include "../elementwise.cu"
#include "../linear_attention.cu"
#include "../matmul.cu"
#include "../moe.cu"
#include "../sampling.cu"

#define EMULATE(name, params, args)                                                                                \
    extern "C" void emu_##name(dim3 grid, dim3 block, params) {                                                   \
        emu::launch(grid, block, [=] { name args; });                                                              \
    }
#define P(...) __VA_ARGS__

EMULATE(rmsnorm, P(const float* x, const float* w, float* out, int width, float eps), (x, w, out, width, eps))
EMULATE(argmax_rows, P(const float* x, u32* out, int cols), (x, out, cols))
EMULATE(matmul_f32, P(const float* x, Group g, int rows_x, int cols), (x, g, rows_x, cols))
EMULATE(matmul_f16, P(const float* x, Group g, int rows_x, int cols), (x, g, rows_x, cols))
EMULATE(matmul_bf16, P(const float* x, Group g, int rows_x, int cols), (x, g, rows_x, cols))
EMULATE(quantize_q8, P(const float* x, i8* q, float* d, u64 blocks), (x, q, d, blocks))
EMULATE(matmul_q8, P(const i8* xq, const float* xd, Group g, int rows_x, int cols), (xq, xd, g, rows_x, cols))
EMULATE(matmul_q8_mma, P(const i8* xq, const float* xd, Group g, int rows_x, int cols), (xq, xd, g, rows_x, cols))
EMULATE(matmul_q8_split32, P(const i8* xq, const float* xd, Group g, int rows_x, int cols), (xq, xd, g, rows_x, cols))
EMULATE(matmul_q8_split16, P(const i8* xq, const float* xd, Group g, int rows_x, int cols), (xq, xd, g, rows_x, cols))
EMULATE(embed_f32, P(const float* table, const u32* tokens, float* out, int cols), (table, tokens, out, cols))
EMULATE(rope, P(float* x, const float* c, const float* s, int rows, int width, int head_dim, int rotary),
        (x, c, s, rows, width, head_dim, rotary))
EMULATE(silu_mul, P(float* gate, const float* up, u64 n), (gate, up, n))
EMULATE(silu_mul_q8, P(float* gate, const float* up, i8* q, float* d, u64 blocks), (gate, up, q, d, blocks))
EMULATE(rmsnorm_q8, P(float* x, const float* y, const float* w, float* out, i8* q, float* d, int width, float eps),
        (x, y, w, out, q, d, width, eps))
EMULATE(rope_qk,
        P(float* q, float* k, const float* c, const float* s, int rows, int q_heads, int k_heads, int head_dim,
          int rotary),
        (q, k, c, s, rows, q_heads, k_heads, head_dim, rotary))
EMULATE(add, P(float* x, const float* y, u64 n), (x, y, n))
EMULATE(sigmoid_mul, P(float* x, const float* gate, u64 n), (x, gate, n))
EMULATE(deinterleave, P(const float* x, float* a, float* b, int piece, u64 n_half), (x, a, b, piece, n_half))
EMULATE(matmul_q4, P(const i8* xq, const float* xd, Group g, int rows_x, int cols), (xq, xd, g, rows_x, cols))
EMULATE(store_kv_f32, P(const float* k, const float* v, float* kp, float* vp, const int* slots, int kv_dim),
        (k, v, kp, vp, slots, kv_dim))
EMULATE(store_kv_f16, P(const float* k, const float* v, u16* kp, u16* vp, const int* slots, int kv_dim),
        (k, v, kp, vp, slots, kv_dim))
EMULATE(attention_f16,
        P(const float* q, const u16* kp, const u16* vp, const int* meta, const u32* tables, float* out, int heads,
          int kv_heads, int head_dim, int block_size, int mask_block, float scale),
        (q, kp, vp, meta, tables, out, heads, kv_heads, head_dim, block_size, mask_block, scale))
EMULATE(attention_f32,
        P(const float* q, const float* kp, const float* vp, const int* meta, const u32* tables, float* out, int heads,
          int kv_heads, int head_dim, int block_size, int mask_block, float scale),
        (q, kp, vp, meta, tables, out, heads, kv_heads, head_dim, block_size, mask_block, scale))
EMULATE(sample_rows, P(const float* logits, const SampleRow* rows, u32* out, int vocab), (logits, rows, out, vocab))
EMULATE(gather_rows, P(const float* x, const u32* rows, float* out, int width), (x, rows, out, width))
EMULATE(scatter_add_rows, P(const float* y, const u32* rows, const float* weights, float* out, int width),
        (y, rows, weights, out, width))
EMULATE(add_sigmoid_scaled, P(float* out, const float* y, const float* gate, int width), (out, y, gate, width))
EMULATE(combine_rows, P(const float* y, const u32* entries, const float* weights, float* out, int top_k, int width),
        (y, entries, weights, out, top_k, width))
EMULATE(matmul_q8_experts,
        P(const i8* xq, const float* xd, const ExpertQ8* experts, const ExpertTile* tiles, const u32* rows, float* out,
          int rows_w, int cols),
        (xq, xd, experts, tiles, rows, out, rows_w, cols))
EMULATE(matmul_q4_experts,
        P(const i8* xq, const float* xd, const ExpertQ4* experts, const ExpertTile* tiles, const u32* rows, float* out,
          int rows_w, int cols),
        (xq, xd, experts, tiles, rows, out, rows_w, cols))
EMULATE(split_qkvz, P(const float* qkvz, float* qkv, float* z, u64 n, int key_heads, int dk, int per_k, int dv),
        (qkvz, qkv, z, n, key_heads, dk, per_k, dv))
EMULATE(split_ba, P(const float* ba, float* b, float* a, u64 n, int key_heads, int per_k), (ba, b, a, n, key_heads, per_k))
EMULATE(conv1d_silu,
        P(const float* x, float* out, const float* taps, const LinearSeq* seqs, float* states, int layer,
          int state_layers, int state_values, int channels, int kernel),
        (x, out, taps, seqs, states, layer, state_layers, state_values, channels, kernel))
EMULATE(l2norm_heads, P(float* x, u64 pieces, int key_heads, int dk, int channels, float q_scale),
        (x, pieces, key_heads, dk, channels, q_scale))
EMULATE(delta_rule,
        P(const float* conv, const float* b, const float* a, const float* dt_bias, const float* a_rate, float* out,
          const LinearSeq* seqs, float* states, int layer, int state_layers, int state_values, int conv_state,
          int key_heads, int value_heads, int dk, int dv, int tiled, int after),
        (conv, b, a, dt_bias, a_rate, out, seqs, states, layer, state_layers, state_values, conv_state, key_heads,
         value_heads, dk, dv, tiled, after))
EMULATE(delta_rule_windows,
        P(const float* conv, const float* b, const float* a, const float* dt_bias, const float* a_rate, float* out,
          const LinearSeq* seqs, float* states, int layer, int state_layers, int state_values, int conv_state,
          int key_heads, int value_heads, int dk, int dv, int tiled, int after),
        (conv, b, a, dt_bias, a_rate, out, seqs, states, layer, state_layers, state_values, conv_state, key_heads,
         value_heads, dk, dv, tiled, after))
EMULATE(rmsnorm_gated, P(float* x, const float* w, const float* z, int n, float eps), (x, w, z, n, eps))
EMULATE(route_rows, P(const float* logits, u32* chosen, float* weights, int experts, int top_k, int normalize),
        (logits, chosen, weights, experts, top_k, normalize))
EMULATE(align_experts,
        P(const u32* chosen, const float* weights, u32* packed, int rows, int top_k, int experts, int max_tiles,
          u32* active),
        (chosen, weights, packed, rows, top_k, experts, max_tiles, active))
