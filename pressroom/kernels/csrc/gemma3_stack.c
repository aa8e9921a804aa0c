/* A whole decode step of Gemma 3 over GGML-quantized projections (a GGUF kept as shipped) in one call: every
 * layer's four norms, q/k norms, products, rotary, cache write and (sliding-window or global) attention, GELU,
 * then the final norm. The layer-by-layer path makes about 25 Python calls a layer, ~12 ms a step for the 270M
 * model's 18 layers, as much as its products. Each piece here is the kernel that path calls, with the same
 * inputs in the same order, so on an fp32 model the two give the same bits.
 *
 * The activations and the residual stream are fp32 throughout; the cache may be fp32 or bf16. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "ggml_matrix.h"
#include "layer_ops.h"

void gelu_tanh_and_mul_f32(float *out, const float *gate_up, int64_t rows, int64_t width, int threads);
/* ggml_numerics.c: llama.cpp's norm, GELU and attention, for `ggml` mode (a GGUF, fp32 cache) */
void ggml_rms_norm_f32(float *out, const float *x, float *residual, const float *weight, int64_t rows,
                       int64_t hidden, float eps, int threads);
void ggml_geglu_f32(float *out, const float *gate_up, int64_t rows, int64_t width, int threads);
void ggml_attention_f32(float *out, const float *q, const float *k_cache, const float *v_cache,
                        const int64_t *tables, const int64_t *lens, const int64_t *gemm, int64_t rows, int64_t heads,
                        int64_t kv_heads, int64_t dim, int64_t block_size, int64_t max_blocks, int64_t window,
                        float scale, int threads);

void ggml_rotary_f32(float *x, const float *cos, const float *sin, int64_t tokens, int64_t heads, int64_t head_dim,
                     int64_t rot_dim, int64_t token_stride, int threads);

typedef void (*norm_fn)(float *, const float *, float *, const float *, int64_t, int64_t, float, int);

/* One layer, as kernels/cpu.py's GEMMA3_LAYER_FIELDS lists it: pointers and sizes as int64. */
struct gemma3_layer {
    int64_t attn_in, q_norm, k_norm, attn_out, ffn_in, ffn_out;  /* RMSNorm weights (1 + w), fp32 */
    int64_t k_cache, v_cache;
    int64_t window;  /* keys a query sees (a local layer), 0: all (a global one) */
    int64_t global;  /* which rope table: 0 local, 1 global */
    struct ggml_matrix qkv, o, gate_up, down;
};

int64_t gemma3_layer_fields(void) { return sizeof(struct gemma3_layer) / sizeof(int64_t); }

/* The shapes, in kernels/cpu.py's DECODE_DIM_FIELDS order (decode_stack.c's). */
enum { TOKENS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, BLOCK_SIZE, MAX_BLOCKS, CACHE_BF16, DIM_FIELDS };

#define PTR(type, value) ((type)(intptr_t)(value))

struct buffers {
    float *residual, *normed, *y, *qkv, *q, *attn, *gate_up, *act;
};

static struct buffers alloc_buffers(const int64_t *dims) {
    const int64_t t = dims[TOKENS], hidden = dims[HIDDEN], q_width = dims[HEADS] * dims[HEAD_DIM];
    const int64_t qkv_width = q_width + 2 * dims[KV_HEADS] * dims[HEAD_DIM], inter = dims[INTER];
    return (struct buffers){malloc(sizeof(float) * t * hidden), malloc(sizeof(float) * t * hidden),
                            malloc(sizeof(float) * t * hidden), malloc(sizeof(float) * t * qkv_width),
                            malloc(sizeof(float) * t * q_width), malloc(sizeof(float) * t * q_width),
                            malloc(sizeof(float) * t * 2 * inter), malloc(sizeof(float) * t * inter)};
}

static void free_buffers(struct buffers b) {
    free(b.residual); free(b.normed); free(b.y); free(b.qkv); free(b.q); free(b.attn); free(b.gate_up); free(b.act);
}

/* q/k norms (each head a row), rotary over q and k heads, keys and values into the cache, queries into b.q. */
static void prepare_heads(const struct gemma3_layer *L, struct buffers b, const float *cos, const float *sin,
                          const int64_t *slots, const int64_t *dims, float eps, int ggml) {
    const norm_fn norm = ggml ? ggml_rms_norm_f32 : rms_norm_f32;
    const int64_t tokens = dims[TOKENS], heads = dims[HEADS], kv_heads = dims[KV_HEADS], head_dim = dims[HEAD_DIM];
    const int64_t q_width = heads * head_dim, kv_width = kv_heads * head_dim, qkv_width = q_width + 2 * kv_width;
    for (int64_t t = 0; t < tokens; t++) {
        float *row = b.qkv + t * qkv_width;
        norm(row, row, NULL, PTR(const float *, L->q_norm), heads, head_dim, eps, 1);
        norm(row + q_width, row + q_width, NULL, PTR(const float *, L->k_norm), kv_heads, head_dim, eps, 1);
    }
    (ggml ? ggml_rotary_f32 : rotary_f32)(b.qkv, cos, sin, tokens, heads + kv_heads, head_dim, head_dim, qkv_width, 1);
    for (int64_t t = 0; t < tokens; t++) {
        float *row = b.qkv + t * qkv_width;
        if (ggml) /* llama.cpp's fp16 cache */
            for (int64_t i = q_width; i < qkv_width; i++) row[i] = (float)(_Float16)row[i];
        write_cache(PTR(void *, L->k_cache), (int)dims[CACHE_BF16], row + q_width, slots[t], kv_width);
        write_cache(PTR(void *, L->v_cache), (int)dims[CACHE_BF16], row + q_width + kv_width, slots[t], kv_width);
        memcpy(b.q + t * q_width, row, sizeof(float) * q_width);
    }
}

static void attend(const struct gemma3_layer *L, struct buffers b, const int64_t *tables, const int64_t *lens,
                   const int64_t *dims, float scale, int ggml, int threads) {
    if (ggml) {
        int64_t *gemm = calloc((size_t)dims[TOKENS], sizeof(int64_t)); /* single-token decodes */
        ggml_attention_f32(b.attn, b.q, PTR(const float *, L->k_cache), PTR(const float *, L->v_cache), tables, lens,
                           gemm, dims[TOKENS], dims[HEADS], dims[KV_HEADS], dims[HEAD_DIM], dims[BLOCK_SIZE],
                           dims[MAX_BLOCKS], L->window, scale, threads);
        free(gemm);
    } else if (dims[CACHE_BF16])
        paged_decode_bf16(b.attn, b.q, PTR(const uint16_t *, L->k_cache), PTR(const uint16_t *, L->v_cache), tables,
                          lens, dims[TOKENS], dims[HEADS], dims[KV_HEADS], dims[HEAD_DIM], dims[BLOCK_SIZE],
                          dims[MAX_BLOCKS], L->window, scale, threads);
    else
        paged_decode_f32(b.attn, b.q, PTR(const float *, L->k_cache), PTR(const float *, L->v_cache), tables, lens,
                         dims[TOKENS], dims[HEADS], dims[KV_HEADS], dims[HEAD_DIM], dims[BLOCK_SIZE],
                         dims[MAX_BLOCKS], L->window, scale, threads);
}

/* x: [tokens, hidden], the embedded (and scaled) tokens in, the final-normed hidden states out. Token t is the
 * one new token of sequence t: its cache slot is slots[t], its context tables[t] (lens[t] tokens, itself
 * included); cos_*, sin_*: [tokens, head_dim / 2] for its position, from the local and the global rope.
 * ggml: llama.cpp's arithmetic around the products (ggml_numerics.c; an fp32 cache). */
void gemma3_decode_stack(float *x, const int64_t *layer_table, int64_t layers, const float *final_norm,
                         const float *cos_local, const float *sin_local, const float *cos_global,
                         const float *sin_global, const int64_t *slots, const int64_t *tables, const int64_t *lens,
                         const int64_t *dims, float eps, float scale, int ggml, int threads) {
    const norm_fn norm = ggml ? ggml_rms_norm_f32 : rms_norm_f32;
    const int64_t tokens = dims[TOKENS], hidden = dims[HIDDEN], inter = dims[INTER];
    const int64_t q_width = dims[HEADS] * dims[HEAD_DIM];
    const struct buffers b = alloc_buffers(dims);
    const struct gemma3_layer *all = (const struct gemma3_layer *)layer_table;
    for (int64_t l = 0; l < layers; l++) {
        const struct gemma3_layer *L = all + l;
        if (l == 0) {
            memcpy(b.residual, x, sizeof(float) * tokens * hidden);
            norm(b.normed, x, NULL, PTR(const float *, L->attn_in), tokens, hidden, eps, 1);
        } else {
            norm(b.normed, b.y, b.residual, PTR(const float *, L->attn_in), tokens, hidden, eps, 1);
        }
        ggml_matrix_matmul_f32(b.qkv, b.normed, &L->qkv, tokens, hidden, threads);
        prepare_heads(L, b, L->global ? cos_global : cos_local, L->global ? sin_global : sin_local, slots, dims, eps, ggml);
        attend(L, b, tables, lens, dims, scale, ggml, threads);
        ggml_matrix_matmul_f32(b.y, b.attn, &L->o, tokens, q_width, threads);
        norm(b.normed, b.y, NULL, PTR(const float *, L->attn_out), tokens, hidden, eps, 1);
        norm(b.normed, b.normed, b.residual, PTR(const float *, L->ffn_in), tokens, hidden, eps, 1);
        ggml_matrix_matmul_f32(b.gate_up, b.normed, &L->gate_up, tokens, hidden, threads);
        (ggml ? ggml_geglu_f32 : gelu_tanh_and_mul_f32)(b.act, b.gate_up, tokens, inter, 1);
        ggml_matrix_matmul_f32(b.normed, b.act, &L->down, tokens, inter, threads);
        norm(b.y, b.normed, NULL, PTR(const float *, L->ffn_out), tokens, hidden, eps, 1);
    }
    norm(x, b.y, b.residual, final_norm, tokens, hidden, eps, 1);
    free_buffers(b);
}
