/* cpu_ops.c's per-layer kernels, as the fused decode stacks (decode_stack.c, gemma3_stack.c) call them. */
#pragma once
#include <stdint.h>
#include <string.h>

#include "common.h"

void rms_norm_f32(float *out, const float *x, float *residual, const float *weight, int64_t rows,
                  int64_t hidden, float eps, int threads);
void rotary_f32(float *x, const float *cos, const float *sin, int64_t tokens, int64_t heads,
                int64_t head_dim, int64_t rot_dim, int64_t token_stride, int threads);
void silu_and_mul_f32(float *out, const float *gate_up, int64_t rows, int64_t width, int threads);
/* paged_decode_*: sequences shared through OpenMP (the layer-by-layer path's pool); *_shared: through workshare.h's
 * (the decode stacks', whose products run on it). */
void paged_decode_f32(float *out, const float *q, const float *k, const float *v, const int64_t *tables,
                      const int64_t *lens, int64_t seqs, int64_t heads, int64_t kv_heads, int64_t dim,
                      int64_t block_size, int64_t max_blocks, int64_t window, float scale, int threads);
void paged_decode_bf16(float *out, const float *q, const uint16_t *k, const uint16_t *v,
                       const int64_t *tables, const int64_t *lens, int64_t seqs, int64_t heads,
                       int64_t kv_heads, int64_t dim, int64_t block_size, int64_t max_blocks, int64_t window,
                       float scale, int threads);
void paged_decode_f32_shared(float *out, const float *q, const float *k, const float *v, const int64_t *tables,
                             const int64_t *lens, int64_t seqs, int64_t heads, int64_t kv_heads, int64_t dim,
                             int64_t block_size, int64_t max_blocks, int64_t window, float scale, int threads);
void paged_decode_bf16_shared(float *out, const float *q, const uint16_t *k, const uint16_t *v,
                              const int64_t *tables, const int64_t *lens, int64_t seqs, int64_t heads,
                              int64_t kv_heads, int64_t dim, int64_t block_size, int64_t max_blocks, int64_t window,
                              float scale, int threads);

/* One token's K or V row into a paged cache slot, fp32 or bf16. */
static inline void write_cache(void *cache, int bf16, const float *src, int64_t slot, int64_t width) {
    if (bf16) {
        uint16_t *dst = (uint16_t *)cache + slot * width;
        for (int64_t i = 0; i < width; i++) dst[i] = f32_to_bf16(src[i]);
    } else {
        memcpy((float *)cache + slot * width, src, sizeof(float) * width);
    }
}
