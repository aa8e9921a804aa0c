/* Paged decode attention for the CPU: one query token per sequence, keys and values read
 * straight out of the paged cache (no gather copy), fp32 accumulation, grouped-query heads
 * sharing each key/value read. Built at first use by pressroom/kernels/cpu.py. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "workshare.h"

struct decode_args {
    float *out;
    const float *q;
    const void *k_cache, *v_cache;
    const int64_t *block_tables, *seq_lens;
    int64_t heads, kv_heads, dim, block_size, max_blocks, window;
    float scale;
};

/* q, out: [seqs, heads, dim] fp32; k_cache, v_cache: [blocks, block_size, kv_heads, dim];
 * block_tables: [seqs, max_blocks] int64; seq_lens: [seqs] int64; window > 0: each sequence sees its last
 * `window` keys only (a sliding-window layer), 0: every key.
 * One task per sequence walks its tokens in order, reading each token's keys (then values) for all kv heads as
 * one contiguous row (what hardware prefetchers follow best), converted to fp32 once and shared by the query
 * heads of each group. */
#define DEFINE_PAGED_DECODE(NAME, T, LOAD, DIM)                                                   \
static void NAME(void *ctx, int64_t s) {                                                          \
    const struct decode_args *a = ctx;                                                            \
    float *out = a->out;                                                                          \
    const float *q = a->q, scale = a->scale;                                                      \
    const T *k_cache = a->k_cache, *v_cache = a->v_cache;                                         \
    const int64_t *block_tables = a->block_tables, *seq_lens = a->seq_lens;                       \
    const int64_t heads = a->heads, block_size = a->block_size, window = a->window;               \
    const int64_t dim = DIM ? DIM : a->dim; /* a constant head size lets loops unroll fully */   \
    const int64_t group = heads / a->kv_heads;                                                    \
    const int64_t row = a->kv_heads * dim; /* elements between consecutive tokens of a block */   \
    {                                                                                             \
        const int64_t end = seq_lens[s], first = window > 0 && end > window ? end - window : 0;  \
        const int64_t len = end - first; /* keys seen; token t of them is at position first + t */ \
        const int64_t *table = block_tables + s * a->max_blocks;                                  \
        const float *qs = q + s * heads * dim;                                                    \
        float *scores = (float *)malloc(sizeof(float) * heads * (len > 0 ? len : 1));             \
        float *acc = (float *)calloc(heads * dim, sizeof(float));                                 \
        float *krow = (float *)malloc(sizeof(float) * row); /* one token's keys or values, fp32 */ \
        for (int64_t t = 0; t < len; t++) {                                                       \
            const int64_t p = first + t;                                                          \
            const T *k = k_cache + (table[p / block_size] * block_size + p % block_size) * row;   \
            if (p % block_size == 0 && p + block_size < end) /* the next block lives elsewhere */  \
                __builtin_prefetch(k_cache + table[p / block_size + 1] * block_size * row);        \
            for (int64_t e = 0; e < row; e++) krow[e] = LOAD(k[e]);                               \
            for (int64_t h = 0; h < heads; h++) {                                                 \
                const float *kh = krow + (h / group) * dim;                                       \
                const float *qh = qs + h * dim;                                                   \
                float dot = 0.f;                                                                  \
                for (int64_t d = 0; d < dim; d++) dot += qh[d] * kh[d];                           \
                scores[h * len + t] = dot * scale;                                                \
            }                                                                                     \
        }                                                                                         \
        for (int64_t h = 0; h < heads; h++) {                                                     \
            float *sc = scores + h * len, m = -INFINITY, sum = 0.f;                               \
            for (int64_t t = 0; t < len; t++) m = sc[t] > m ? sc[t] : m;                          \
            _Pragma("omp simd reduction(+:sum)")                                                  \
            for (int64_t t = 0; t < len; t++) { sc[t] = fast_expf(sc[t] - m); sum += sc[t]; }     \
            const float inv = sum > 0.f ? 1.f / sum : 0.f;                                        \
            for (int64_t t = 0; t < len; t++) sc[t] *= inv;                                       \
        }                                                                                         \
        for (int64_t t = 0; t < len; t++) {                                                       \
            const int64_t p = first + t;                                                          \
            const T *v = v_cache + (table[p / block_size] * block_size + p % block_size) * row;   \
            for (int64_t e = 0; e < row; e++) krow[e] = LOAD(v[e]);                               \
            for (int64_t h = 0; h < heads; h++) {                                                 \
                const float *vh = krow + (h / group) * dim;                                       \
                const float p = scores[h * len + t];                                              \
                float *a = acc + h * dim;                                                         \
                for (int64_t d = 0; d < dim; d++) a[d] += p * vh[d];                              \
            }                                                                                     \
        }                                                                                         \
        memcpy(out + s * heads * dim, acc, sizeof(float) * heads * dim);                          \
        free(scores);                                                                             \
        free(acc);                                                                                \
        free(krow);                                                                               \
    }                                                                                             \
}

DEFINE_PAGED_DECODE(decode_bf16_any, uint16_t, bf16_to_f32, 0)
DEFINE_PAGED_DECODE(decode_bf16_64, uint16_t, bf16_to_f32, 64)
DEFINE_PAGED_DECODE(decode_bf16_128, uint16_t, bf16_to_f32, 128)
DEFINE_PAGED_DECODE(decode_bf16_256, uint16_t, bf16_to_f32, 256)
DEFINE_PAGED_DECODE(decode_f32_any, float, f32_to_f32, 0)
DEFINE_PAGED_DECODE(decode_f32_64, float, f32_to_f32, 64)
DEFINE_PAGED_DECODE(decode_f32_128, float, f32_to_f32, 128)
DEFINE_PAGED_DECODE(decode_f32_256, float, f32_to_f32, 256)

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
/* The same attention with vectors, for head sizes of 64 and 128 and groups of up to 8 query heads a key/value head,
 * by key/value head: the group's queries stay in registers (AVX-512; AVX2 spills some to the stack) while the keys
 * go by, and so do its outputs while the values go by (the loop above reloads and stores them for every key).
 * Scores come a vector's width of keys at a time: each key's partial dot products meet the others' in one
 * transposing sum instead of a horizontal sum each. The scores, softmax and weighted sum of values are the loop
 * above's but for the order of a dot product's terms. */
#ifdef __AVX512F__
#define VL 16
typedef __m512 vec;
#define vzero _mm512_setzero_ps
#define vload _mm512_loadu_ps
#define vstore _mm512_storeu_ps
#define vfma _mm512_fmadd_ps
#define vmul _mm512_mul_ps
#define vset1 _mm512_set1_ps
static inline vec vload_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
/* VL vectors in, the vector of their lane sums out (vector i's sum in lane i). */
static inline vec vsum_lanes(const vec *v) {
    __m512 a[8], b[4];
    for (int i = 0; i < 8; i++)  /* per 128-bit lane: (v2i, v2i+1) interleaved, pairs added */
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++)  /* per 128-bit lane: one partial of each of 4 vectors */
        b[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0x44), _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0xEE));
    const __m512 x = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x44), _mm512_shuffle_f32x4(b[0], b[1], 0xEE));
    const __m512 y = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x44), _mm512_shuffle_f32x4(b[2], b[3], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xDD));
}
#else
#define VL 8
typedef __m256 vec;
#define vzero _mm256_setzero_ps
#define vload _mm256_loadu_ps
#define vstore _mm256_storeu_ps
#define vfma _mm256_fmadd_ps
#define vmul _mm256_mul_ps
#define vset1 _mm256_set1_ps
static inline vec vload_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline vec vsum_lanes(const vec *v) {
    const __m256 a0 = _mm256_hadd_ps(v[0], v[1]), a1 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 a2 = _mm256_hadd_ps(v[4], v[5]), a3 = _mm256_hadd_ps(v[6], v[7]);
    const __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3);  /* halves of v0-3, of v4-7 */
    return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}
#endif
static inline vec vload_f32(const float *p) { return vload(p); }
#define MAX_DV (128 / VL)

#define DEFINE_GROUPED_DECODE(NAME, T, LOADV)                                                      \
static inline __attribute__((always_inline)) void NAME(const struct decode_args *a, int64_t s,    \
                                                       const int G, const int DV) {               \
    const int64_t dim = VL * DV, row = a->kv_heads * dim, bs = a->block_size;                     \
    const int64_t end = a->seq_lens[s], first = a->window > 0 && end > a->window ? end - a->window : 0; \
    const int64_t len = end - first, *table = a->block_tables + s * a->max_blocks;                \
    const T *k_cache = a->k_cache, *v_cache = a->v_cache;                                         \
    float *scores = malloc(sizeof(float) * G * (len + VL));                                       \
    float *keys = malloc(sizeof(float) * VL * dim); /* VL keys of one head, fp32 */               \
    for (int64_t kv = 0; kv < a->kv_heads; kv++) {                                                \
        const float *qs = a->q + (s * a->heads + kv * G) * dim;                                   \
        vec q[8][MAX_DV];                                                                         \
        for (int h = 0; h < G; h++)                                                               \
            for (int i = 0; i < DV; i++) q[h][i] = vload(qs + h * dim + VL * i);                  \
        for (int64_t t0 = 0; t0 < len; t0 += VL) {                                                \
            const int n = len - t0 < VL ? (int)(len - t0) : VL;                                   \
            for (int64_t j = t0 + VL; j < t0 + 2 * VL && j < len; j++) /* the next keys, ahead */ \
                for (int64_t line = 0; line < dim * (int64_t)sizeof(T); line += 64)              \
                    __builtin_prefetch((const char *)(k_cache + (table[(first + j) / bs] * bs + (first + j) % bs) * row \
                                                      + kv * dim) + line);                        \
            for (int j = 0; j < n; j++) {                                                         \
                const int64_t p = first + t0 + j;                                                 \
                const T *k = k_cache + (table[p / bs] * bs + p % bs) * row + kv * dim;            \
                for (int i = 0; i < DV; i++) vstore(keys + j * dim + VL * i, LOADV(k + VL * i));  \
            }                                                                                     \
            for (int h = 0; h < G; h++) {                                                         \
                vec part[VL];                                                                     \
                for (int j = 0; j < VL; j++) {                                                    \
                    vec acc = vzero();                                                            \
                    if (j < n)                                                                    \
                        for (int i = 0; i < DV; i++) acc = vfma(q[h][i], vload(keys + j * dim + VL * i), acc); \
                    part[j] = acc;                                                                \
                }                                                                                 \
                vstore(scores + h * (len + VL) + t0, vmul(vsum_lanes(part), vset1(a->scale)));    \
            }                                                                                     \
        }                                                                                         \
        for (int h = 0; h < G; h++) {                                                             \
            float *sc = scores + h * (len + VL), m = -INFINITY, sum = 0.f;                        \
            for (int64_t t = 0; t < len; t++) m = sc[t] > m ? sc[t] : m;                          \
            _Pragma("omp simd reduction(+:sum)")                                                  \
            for (int64_t t = 0; t < len; t++) { sc[t] = fast_expf(sc[t] - m); sum += sc[t]; }     \
            const float inv = sum > 0.f ? 1.f / sum : 0.f;                                        \
            for (int64_t t = 0; t < len; t++) sc[t] *= inv;                                       \
        }                                                                                         \
        vec acc[8][MAX_DV];                                                                       \
        for (int h = 0; h < G; h++)                                                               \
            for (int i = 0; i < DV; i++) acc[h][i] = vzero();                                     \
        for (int64_t t = 0; t < len; t++) {                                                       \
            const int64_t p = first + t;                                                          \
            const T *v = v_cache + (table[p / bs] * bs + p % bs) * row + kv * dim;                \
            if (t + VL < len) /* the value a vector's width of keys ahead */                      \
                for (int64_t line = 0; line < dim * (int64_t)sizeof(T); line += 64)              \
                    __builtin_prefetch((const char *)(v_cache + (table[(p + VL) / bs] * bs + (p + VL) % bs) * row \
                                                      + kv * dim) + line);                        \
            vec vv[MAX_DV];                                                                       \
            for (int i = 0; i < DV; i++) vv[i] = LOADV(v + VL * i);                               \
            for (int h = 0; h < G; h++) {                                                         \
                const vec w = vset1(scores[h * (len + VL) + t]);                                  \
                for (int i = 0; i < DV; i++) acc[h][i] = vfma(w, vv[i], acc[h][i]);               \
            }                                                                                     \
        }                                                                                         \
        float *o = a->out + (s * a->heads + kv * G) * dim;                                        \
        for (int h = 0; h < G; h++)                                                               \
            for (int i = 0; i < DV; i++) vstore(o + h * dim + VL * i, acc[h][i]);                 \
    }                                                                                             \
    free(scores);                                                                                 \
    free(keys);                                                                                   \
}

DEFINE_GROUPED_DECODE(grouped_bf16, uint16_t, vload_bf16)
DEFINE_GROUPED_DECODE(grouped_f32, float, vload_f32)

#define GROUPED_CASE(FN, G, DV) case (G) * 16 + (DV): FN(a, s, G, DV); return;
#define GROUPED_DISPATCH(NAME, FN)                                                                \
static void NAME(void *ctx, int64_t s) {                                                          \
    const struct decode_args *a = ctx;                                                            \
    switch ((a->heads / a->kv_heads) * 16 + a->dim / VL) {                                        \
        GROUPED_CASE(FN, 1, 64 / VL) GROUPED_CASE(FN, 2, 64 / VL) GROUPED_CASE(FN, 3, 64 / VL)    \
        GROUPED_CASE(FN, 4, 64 / VL) GROUPED_CASE(FN, 5, 64 / VL) GROUPED_CASE(FN, 6, 64 / VL)    \
        GROUPED_CASE(FN, 7, 64 / VL) GROUPED_CASE(FN, 8, 64 / VL)                                 \
        GROUPED_CASE(FN, 1, 128 / VL) GROUPED_CASE(FN, 2, 128 / VL) GROUPED_CASE(FN, 3, 128 / VL) \
        GROUPED_CASE(FN, 4, 128 / VL) GROUPED_CASE(FN, 5, 128 / VL) GROUPED_CASE(FN, 6, 128 / VL) \
        GROUPED_CASE(FN, 7, 128 / VL) GROUPED_CASE(FN, 8, 128 / VL)                               \
    }                                                                                             \
}
GROUPED_DISPATCH(decode_bf16_grouped, grouped_bf16)
GROUPED_DISPATCH(decode_f32_grouped, grouped_f32)

static int grouped_takes(int64_t heads, int64_t kv_heads, int64_t dim) {
    const int64_t group = heads / kv_heads;
    return (dim == 64 || dim == 128) && group >= 1 && group <= 8 && group * kv_heads == heads;
}
#define GROUPED_PICK(fn, PREFIX, heads, kv_heads, dim) if (grouped_takes(heads, kv_heads, dim)) fn = PREFIX##_grouped;
#else
#define GROUPED_PICK(fn, PREFIX, heads, kv_heads, dim)
#endif

/* Two entry points a kernel: NAME shares the sequences through OpenMP, the pool torch's own ops use, for the
 * layer-by-layer path (between oneDNN's products; a second pool's thread would meet OpenMP's spinning ones);
 * NAME##_shared through workshare.h's pool, for the decode stacks, whose products run on it (under OpenMP's
 * barrier, which waits for preempted threads, a batch-32 stack step ran 6x slower beside another process). */
#define DEFINE_DECODE_DISPATCH(NAME, T, PREFIX)                                                   \
static chunk_fn NAME##_kernel(int64_t heads, int64_t kv_heads, int64_t dim) {                     \
    chunk_fn fn = dim == 64 ? PREFIX##_64 : dim == 128 ? PREFIX##_128 : dim == 256 ? PREFIX##_256 \
                            : PREFIX##_any;                                                       \
    GROUPED_PICK(fn, PREFIX, heads, kv_heads, dim)                                                \
    return fn;                                                                                    \
}                                                                                                 \
void NAME(float *out, const float *q, const T *k, const T *v, const int64_t *tables,              \
          const int64_t *lens, int64_t seqs, int64_t heads, int64_t kv_heads, int64_t dim,        \
          int64_t block_size, int64_t max_blocks, int64_t window, float scale, int threads) {     \
    const chunk_fn fn = NAME##_kernel(heads, kv_heads, dim);                                      \
    struct decode_args a = {out, q, k, v, tables, lens, heads, kv_heads, dim, block_size,         \
                            max_blocks, window, scale};                                           \
    _Pragma("omp parallel for schedule(dynamic, 1) num_threads(threads) if(seqs > 1)")            \
    for (int64_t s = 0; s < seqs; s++) fn(&a, s);                                                 \
}                                                                                                 \
void NAME##_shared(float *out, const float *q, const T *k, const T *v, const int64_t *tables,     \
                   const int64_t *lens, int64_t seqs, int64_t heads, int64_t kv_heads, int64_t dim, \
                   int64_t block_size, int64_t max_blocks, int64_t window, float scale, int threads) { \
    struct decode_args a = {out, q, k, v, tables, lens, heads, kv_heads, dim, block_size,         \
                            max_blocks, window, scale};                                           \
    workshare_run(NAME##_kernel(heads, kv_heads, dim), &a, seqs, seqs > 1 ? threads : 1);         \
}

DEFINE_DECODE_DISPATCH(paged_decode_bf16, uint16_t, decode_bf16)
DEFINE_DECODE_DISPATCH(paged_decode_f32, float, decode_f32)

/* ---- elementwise kernels: one pass over each row instead of a chain of torch ops ---- */

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
DEFINE_ROTARY(rotary_bf16, uint16_t, bf16_to_f32, store_bf16)
DEFINE_ROTARY(rotary_f32, float, f32_to_f32, store_f32)

/* out = gelu_tanh(gate) * up over [rows, 2 * width] = [gate | up] rows, each product rounded to the storage
 * type as torch rounds F.gelu(gate) * up. 1 + tanh(u) = 2 / (1 + exp(-2u)): no cancellation near u = 0. */
#define DEFINE_GELU_TANH_AND_MUL(NAME, T, LOAD, STORE)                                            \
void NAME(T *out, const T *gate_up, int64_t rows, int64_t width, int threads) {                   \
    _Pragma("omp parallel for schedule(static) num_threads(threads) if(rows > 4)")                \
    for (int64_t r = 0; r < rows; r++) {                                                          \
        const T *g = gate_up + r * 2 * width, *u = g + width;                                     \
        T *o = out + r * width;                                                                   \
        for (int64_t i = 0; i < width; i++) {                                                     \
            const float x = LOAD(g[i]);                                                           \
            const float inner = 0.7978845608028654f * (x + 0.044715f * x * x * x);                \
            o[i] = STORE(LOAD(STORE(x / (1.f + fast_expf(-2.f * inner)))) * LOAD(u[i]));          \
        }                                                                                         \
    }                                                                                             \
}

/* out = silu(gate) * up, rounded as torch rounds F.silu(gate) * up: the layer-by-layer path and the decode stack
 * (decode_stack.c) both call it, so their activations agree to the bit. */
#define DEFINE_SILU_AND_MUL(NAME, T, LOAD, STORE)                                                 \
void NAME(T *out, const T *gate_up, int64_t rows, int64_t width, int threads) {                   \
    _Pragma("omp parallel for schedule(static) num_threads(threads) if(rows > 4)")                \
    for (int64_t r = 0; r < rows; r++) {                                                          \
        const T *g = gate_up + r * 2 * width, *u = g + width;                                     \
        T *o = out + r * width;                                                                   \
        for (int64_t i = 0; i < width; i++) {                                                     \
            const float x = LOAD(g[i]);                                                           \
            o[i] = STORE(LOAD(STORE(x / (1.f + fast_expf(-x)))) * LOAD(u[i]));                    \
        }                                                                                         \
    }                                                                                             \
}

DEFINE_SILU_AND_MUL(silu_and_mul_bf16, uint16_t, bf16_to_f32, store_bf16)
DEFINE_SILU_AND_MUL(silu_and_mul_f32, float, f32_to_f32, store_f32)
DEFINE_GELU_TANH_AND_MUL(gelu_tanh_and_mul_bf16, uint16_t, bf16_to_f32, store_bf16)
DEFINE_GELU_TANH_AND_MUL(gelu_tanh_and_mul_f32, float, f32_to_f32, store_f32)

/* out[r] = the index of row r's largest value, the first of equal ones, a NaN counting as the largest: what
 * torch.argmax gives. torch's CPU argmax took 440 us over a 262144-entry vocabulary (2% of a Gemma 3 270M
 * decode step); a max pass and a search for its first index take about a tenth of that. */
#ifdef __AVX2__
#include <immintrin.h>
#endif

static int64_t first_nan(const float *v, int64_t cols) {
    for (int64_t i = 0; i < cols; i++)
        if (v[i] != v[i]) return i;
    return -1;
}

static int64_t argmax_row(const float *v, int64_t cols) {
    float m = -INFINITY;
    int64_t i = 0;
    int nan = 0;
#ifdef __AVX2__
    __m256 mv = _mm256_set1_ps(-INFINITY), unordered = _mm256_setzero_ps();
    for (; i + 8 <= cols; i += 8) {
        const __m256 a = _mm256_loadu_ps(v + i);
        mv = _mm256_max_ps(mv, a);
        unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
    }
    nan = _mm256_movemask_ps(unordered) != 0;
    float lanes[8];
    _mm256_storeu_ps(lanes, mv);
    for (int l = 0; l < 8; l++) m = lanes[l] > m ? lanes[l] : m;
#endif
    for (; i < cols; i++) {
        if (v[i] != v[i]) nan = 1;
        else if (v[i] > m) m = v[i];
    }
    if (nan) return first_nan(v, cols);
    i = 0;
#ifdef __AVX2__
    const __m256 target = _mm256_set1_ps(m);
    for (; i + 8 <= cols; i += 8) {
        const int hits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(v + i), target, _CMP_EQ_OQ));
        if (hits) return i + __builtin_ctz(hits);
    }
#endif
    for (; i < cols; i++)
        if (v[i] == m) return i;
    return 0;  /* every value -inf */
}

void argmax_rows_f32(int64_t *out, const float *x, int64_t rows, int64_t cols, int64_t stride) {
    for (int64_t r = 0; r < rows; r++) out[r] = argmax_row(x + r * stride, cols);
}
