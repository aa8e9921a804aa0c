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

/* ---- elementwise kernels: one pass over each row instead of a chain of torch ops ---- */

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7FFFu + ((u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(u >> 16);
}

static inline float f32_round(float x) { return x; }
static inline float bf16_round(float x) { return bf16_to_f32(f32_to_bf16(x)); }
static inline uint16_t store_bf16(float x) { return f32_to_bf16(x); }
static inline float store_f32(float x) { return x; }

/* residual (if not NULL) = x + residual; out = rmsnorm(residual or x) * weight, rounded as torch
 * rounds: the sum, the normalised value and the weighted value each to the storage type. */
#define DEFINE_RMS_NORM(NAME, T, LOAD, STORE, ROUND)                                              \
void NAME(T *out, const T *x, T *residual, const T *weight, int64_t rows, int64_t hidden,         \
          float eps, int threads) {                                                               \
    _Pragma("omp parallel for schedule(static) num_threads(threads) if(rows > 4)")                \
    for (int64_t r = 0; r < rows; r++) {                                                          \
        const T *xr = x + r * hidden;                                                             \
        T *rr = residual ? residual + r * hidden : NULL;                                          \
        T *o = out + r * hidden;                                                                  \
        float sq = 0.f;                                                                           \
        for (int64_t i = 0; i < hidden; i++) {                                                    \
            float v = LOAD(xr[i]);                                                                \
            if (rr) { v = ROUND(v + LOAD(rr[i])); rr[i] = STORE(v); }                            \
            sq += v * v;                                                                          \
        }                                                                                         \
        const float inv = 1.f / sqrtf(sq / (float)hidden + eps);                                  \
        const T *src = rr ? rr : xr;                                                              \
        for (int64_t i = 0; i < hidden; i++)                                                      \
            o[i] = STORE(ROUND(LOAD(src[i]) * inv) * LOAD(weight[i]));                            \
    }                                                                                             \
}

/* out[r, i] = silu(x[r, i]) * x[r, inter + i] */
#define DEFINE_SILU_AND_MUL(NAME, T, LOAD, STORE, ROUND)                                          \
void NAME(T *out, const T *x, int64_t rows, int64_t inter, int threads) {                        \
    _Pragma("omp parallel for schedule(static) num_threads(threads) if(rows > 4)")                \
    for (int64_t r = 0; r < rows; r++) {                                                          \
        const T *g = x + r * 2 * inter, *u = g + inter;                                           \
        T *o = out + r * inter;                                                                   \
        for (int64_t i = 0; i < inter; i++) {                                                     \
            float a = LOAD(g[i]);                                                                 \
            o[i] = STORE(ROUND(a / (1.f + expf(-a))) * LOAD(u[i]));                               \
        }                                                                                         \
    }                                                                                             \
}

/* In place on x: [tokens, heads, head_dim] with row stride `token_stride` (elements);
 * NeoX layout: the first half of the rotary dims pairs with the second half. */
#define DEFINE_ROTARY(NAME, T, LOAD, STORE)                                                       \
void NAME(T *x, const float *cos, const float *sin, int64_t tokens, int64_t heads,                \
          int64_t head_dim, int64_t rot_dim, int64_t token_stride, int threads) {                 \
    const int64_t half = rot_dim / 2;                                                             \
    _Pragma("omp parallel for schedule(static) num_threads(threads) if(tokens > 4)")              \
    for (int64_t t = 0; t < tokens; t++) {                                                        \
        const float *c = cos + t * half, *s = sin + t * half;                                     \
        for (int64_t h = 0; h < heads; h++) {                                                     \
            T *v = x + t * token_stride + h * head_dim;                                           \
            for (int64_t i = 0; i < half; i++) {                                                  \
                float x1 = LOAD(v[i]), x2 = LOAD(v[i + half]);                                    \
                float cc = LOAD(STORE(c[i])), ss = LOAD(STORE(s[i]));                             \
                v[i] = STORE(LOAD(STORE(x1 * cc)) - LOAD(STORE(x2 * ss)));                        \
                v[i + half] = STORE(LOAD(STORE(x2 * cc)) + LOAD(STORE(x1 * ss)));                 \
            }                                                                                     \
        }                                                                                         \
    }                                                                                             \
}

DEFINE_RMS_NORM(rms_norm_bf16, uint16_t, bf16_to_f32, store_bf16, bf16_round)
DEFINE_RMS_NORM(rms_norm_f32, float, f32_to_f32, store_f32, f32_round)
DEFINE_SILU_AND_MUL(silu_and_mul_bf16, uint16_t, bf16_to_f32, store_bf16, bf16_round)
DEFINE_SILU_AND_MUL(silu_and_mul_f32, float, f32_to_f32, store_f32, f32_round)
DEFINE_ROTARY(rotary_bf16, uint16_t, bf16_to_f32, store_bf16)
DEFINE_ROTARY(rotary_f32, float, f32_to_f32, store_f32)
