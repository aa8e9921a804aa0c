/* A whole decode step of a Llama-family model with 4-bit weights in one call: every layer's norms,
 * projections, rotary, cache write and attention, then the final norm. The Python path makes about a
 * dozen calls per layer; at batch 1 on a small model their overhead cost as much as the matmuls
 * (measured: 10 of 22 ms per step on the embedded model). Each piece is the kernel the Python path
 * calls (same order of operations, silu included), so in fp32 the two agree to the bit.
 *
 * The activations and the residual stream are fp32 throughout; the cache may be fp32 or bf16. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "layer_ops.h"

void q4_matmul_f32(float *out, const float *x, const uint8_t *qs, const float *d, const float *m,
                   int64_t tokens, int64_t rows, int64_t cols, int threads);
void vnni_gemm_f32(float *out, const float *x, int64_t tokens, int64_t k, const uint8_t *panel, const float *d,
                   const float *m, int64_t n, int threads);
int q4_row_kernel_max_tokens(void);

/* One layer's pointers, in this order (kernels/cpu.py's DECODE_LAYER_FIELDS names them): each matrix's 4-bit
 * tiles (q, d, m), then each one's byte panel (vnni_gemm.c: p, pd, pm; p = 0 where there is none). */
enum { LN1, QKV_Q, QKV_D, QKV_M, QKV_BIAS, O_Q, O_D, O_M, LN2, GU_Q, GU_D, GU_M, DOWN_Q, DOWN_D, DOWN_M,
       K_CACHE, V_CACHE, QKV_P, QKV_PD, QKV_PM, O_P, O_PD, O_PM, GU_P, GU_PD, GU_PM, DOWN_P, DOWN_PD, DOWN_PM,
       LAYER_FIELDS };
/* The shapes, in this order. */
enum { TOKENS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, BLOCK_SIZE, MAX_BLOCKS, CACHE_BF16, DIM_FIELDS };

#define PTR(type, layer, field) ((type)(intptr_t)(layer)[field])
/* Past this many tokens the panel (vnni_gemm.c) beats the row kernel (quant_ops.c): 12 where the row kernel
 * keeps a verification's 1 + K rows in registers over each unpacked block (AVX-512), else quant.py's INT4_MAX_ROWS. */
#define ROW_KERNEL_MAX_TOKENS q4_row_kernel_max_tokens()

/* out = x times the matrix whose row-kernel tiles start at field q and panel at field p (q, d, m; p, pd, pm):
 * the two give the same bits (vnni_gemm.c rounds and sums as quant_ops.c does). */
static void project(float *out, const float *x, const int64_t *layer, int q, int p, int64_t tokens, int64_t rows,
                    int64_t cols, int threads) {
    if (tokens > ROW_KERNEL_MAX_TOKENS && layer[p])
        vnni_gemm_f32(out, x, tokens, cols, PTR(const uint8_t *, layer, p), PTR(const float *, layer, p + 1),
                      PTR(const float *, layer, p + 2), rows, threads);
    else
        q4_matmul_f32(out, x, PTR(const uint8_t *, layer, q), PTR(const float *, layer, q + 1),
                      PTR(const float *, layer, q + 2), tokens, rows, cols, threads);
}

/* x: [tokens, hidden], the embedded tokens in and the final-normed hidden states out. Token t is the
 * one new token of sequence t: its cache slot is slots[t], its context tables[t] (lens[t] tokens,
 * itself included); cos, sin: [tokens, head_dim / 2] for its position. taps (a drafter's conditioning),
 * or NULL: tap_at[l] >= 0 writes layer l's output (the residual stream) to taps[tap_at[l]], [tokens, hidden]. */
void decode_stack(float *x, const int64_t *layer_ptrs, int64_t layers, const float *final_norm,
                  const float *cos, const float *sin, const int64_t *slots, const int64_t *tables,
                  const int64_t *lens, const int64_t *dims, float eps, float scale, float *taps,
                  const int64_t *tap_at, int threads) {
    const int64_t tokens = dims[TOKENS], hidden = dims[HIDDEN], heads = dims[HEADS], kv_heads = dims[KV_HEADS];
    const int64_t head_dim = dims[HEAD_DIM], inter = dims[INTER];
    const int64_t q_width = heads * head_dim, kv_width = kv_heads * head_dim;
    const int64_t qkv_width = q_width + 2 * kv_width;
    float *residual = malloc(sizeof(float) * tokens * hidden), *normed = malloc(sizeof(float) * tokens * hidden);
    float *y = malloc(sizeof(float) * tokens * hidden), *qkv = malloc(sizeof(float) * tokens * qkv_width);
    float *q = malloc(sizeof(float) * tokens * q_width), *attn = malloc(sizeof(float) * tokens * q_width);
    float *gate_up = malloc(sizeof(float) * tokens * 2 * inter), *act = malloc(sizeof(float) * tokens * inter);
    /* Norms and rotary are microseconds even at 128 rows: an OpenMP region for them cost more than it saved, and
     * beside another process its barrier waits for a preempted thread. */
    const int row_threads = tokens * hidden >= (1 << 18) ? threads : 1;
    for (int64_t l = 0; l < layers; l++) {
        const int64_t *p = layer_ptrs + l * LAYER_FIELDS;
        if (l == 0) {
            memcpy(residual, x, sizeof(float) * tokens * hidden);
            rms_norm_f32(normed, x, NULL, PTR(const float *, p, LN1), tokens, hidden, eps, row_threads);
        } else {
            rms_norm_f32(normed, y, residual, PTR(const float *, p, LN1), tokens, hidden, eps, row_threads);
        }
        project(qkv, normed, p, QKV_Q, QKV_P, tokens, qkv_width, hidden, threads);
        const float *bias = PTR(const float *, p, QKV_BIAS);
        if (bias)
            for (int64_t t = 0; t < tokens; t++)
                for (int64_t i = 0; i < qkv_width; i++) qkv[t * qkv_width + i] += bias[i];
        rotary_f32(qkv, cos, sin, tokens, heads + kv_heads, head_dim, head_dim, qkv_width, row_threads);
        for (int64_t t = 0; t < tokens; t++) {
            const float *row = qkv + t * qkv_width;
            write_cache(PTR(void *, p, K_CACHE), (int)dims[CACHE_BF16], row + q_width, slots[t], kv_width);
            write_cache(PTR(void *, p, V_CACHE), (int)dims[CACHE_BF16], row + q_width + kv_width, slots[t], kv_width);
            memcpy(q + t * q_width, row, sizeof(float) * q_width);
        }
        /* attention on the pool the step's products run on: the panels' (workshare) or the row kernel's (OpenMP) */
        const int panels = tokens > ROW_KERNEL_MAX_TOKENS && p[QKV_P];
        if (dims[CACHE_BF16])
            (panels ? paged_decode_bf16_shared : paged_decode_bf16)(
                attn, q, PTR(const uint16_t *, p, K_CACHE), PTR(const uint16_t *, p, V_CACHE), tables, lens, tokens,
                heads, kv_heads, head_dim, dims[BLOCK_SIZE], dims[MAX_BLOCKS], 0, scale, threads);
        else
            (panels ? paged_decode_f32_shared : paged_decode_f32)(
                attn, q, PTR(const float *, p, K_CACHE), PTR(const float *, p, V_CACHE), tables, lens, tokens,
                heads, kv_heads, head_dim, dims[BLOCK_SIZE], dims[MAX_BLOCKS], 0, scale, threads);
        project(y, attn, p, O_Q, O_P, tokens, hidden, q_width, threads);
        rms_norm_f32(normed, y, residual, PTR(const float *, p, LN2), tokens, hidden, eps, row_threads);
        project(gate_up, normed, p, GU_Q, GU_P, tokens, 2 * inter, hidden, threads);
        silu_and_mul_f32(act, gate_up, tokens, inter, 1);
        project(y, act, p, DOWN_Q, DOWN_P, tokens, hidden, inter, threads);
        if (taps && tap_at[l] >= 0) {
            float *tap = taps + tap_at[l] * tokens * hidden;
            for (int64_t i = 0; i < tokens * hidden; i++) tap[i] = y[i] + residual[i];
        }
    }
    rms_norm_f32(x, y, residual, final_norm, tokens, hidden, eps, row_threads);
    free(residual); free(normed); free(y); free(qkv); free(q); free(attn); free(gate_up); free(act);
}
