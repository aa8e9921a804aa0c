/* Paged decode attention for the CPU: one query token per sequence, keys and values read
 * straight out of the paged cache (no gather copy), fp32 accumulation, grouped-query heads
 * sharing each key/value read. Built at first use by pressroom/attention/cpu_kernels.py. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float f32_to_f32(float x) { return x; }

/* q, out: [seqs, heads, dim] fp32; k_cache, v_cache: [blocks, block_size, kv_heads, dim];
 * block_tables: [seqs, max_blocks] int64; seq_lens: [seqs] int64. */
#define DEFINE_PAGED_DECODE(NAME, T, LOAD)                                                        \
void NAME(float *out, const float *q, const T *k_cache, const T *v_cache,                         \
          const int64_t *block_tables, const int64_t *seq_lens, int64_t seqs, int64_t heads,      \
          int64_t kv_heads, int64_t dim, int64_t block_size, int64_t max_blocks, float scale,     \
          int threads) {                                                                          \
    const int64_t group = heads / kv_heads;                                                       \
    const int64_t row = kv_heads * dim; /* elements between consecutive tokens of a block */      \
    _Pragma("omp parallel for collapse(2) schedule(dynamic, 1) num_threads(threads)")             \
    for (int64_t s = 0; s < seqs; s++) {                                                          \
        for (int64_t kh = 0; kh < kv_heads; kh++) {                                               \
            const int64_t len = seq_lens[s];                                                      \
            const int64_t *table = block_tables + s * max_blocks;                                 \
            float *scores = (float *)malloc(sizeof(float) * group * (len > 0 ? len : 1));         \
            float acc[group * dim];                                                               \
            float maxs[group], sums[group];                                                       \
            const float *qh = q + (s * heads + kh * group) * dim;                                 \
            for (int64_t g = 0; g < group; g++) maxs[g] = -INFINITY;                              \
            for (int64_t t = 0; t < len; t++) {                                                   \
                const T *k = k_cache + (table[t / block_size] * block_size + t % block_size) * row \
                             + kh * dim;                                                          \
                for (int64_t g = 0; g < group; g++) {                                             \
                    const float *qg = qh + g * dim;                                               \
                    float dot = 0.f;                                                              \
                    for (int64_t d = 0; d < dim; d++) dot += qg[d] * LOAD(k[d]);                  \
                    dot *= scale;                                                                 \
                    scores[g * len + t] = dot;                                                    \
                    if (dot > maxs[g]) maxs[g] = dot;                                             \
                }                                                                                 \
            }                                                                                     \
            for (int64_t g = 0; g < group; g++) {                                                 \
                float sum = 0.f;                                                                  \
                for (int64_t t = 0; t < len; t++) {                                               \
                    float e = expf(scores[g * len + t] - maxs[g]);                                \
                    scores[g * len + t] = e;                                                      \
                    sum += e;                                                                     \
                }                                                                                 \
                sums[g] = sum;                                                                    \
            }                                                                                     \
            memset(acc, 0, sizeof acc);                                                           \
            for (int64_t t = 0; t < len; t++) {                                                   \
                const T *v = v_cache + (table[t / block_size] * block_size + t % block_size) * row \
                             + kh * dim;                                                          \
                for (int64_t g = 0; g < group; g++) {                                             \
                    const float p = scores[g * len + t];                                          \
                    float *a = acc + g * dim;                                                     \
                    for (int64_t d = 0; d < dim; d++) a[d] += p * LOAD(v[d]);                     \
                }                                                                                 \
            }                                                                                     \
            for (int64_t g = 0; g < group; g++) {                                                 \
                float *o = out + (s * heads + kh * group + g) * dim;                              \
                const float inv = sums[g] > 0.f ? 1.f / sums[g] : 0.f;                            \
                for (int64_t d = 0; d < dim; d++) o[d] = acc[g * dim + d] * inv;                  \
            }                                                                                     \
            free(scores);                                                                         \
        }                                                                                         \
    }                                                                                             \
}

DEFINE_PAGED_DECODE(paged_decode_bf16, uint16_t, bf16_to_f32)
DEFINE_PAGED_DECODE(paged_decode_f32, float, f32_to_f32)
