/* Matrix products with weights kept as GGUF ships them, for decode-sized steps (a few tokens), as
 * llama.cpp computes them: the weights stream 4x fewer bytes than fp32, and
 * each block of 32 activations is rounded to int8 with its own scale (relative error under 1/254
 * of the block's largest value, about bf16's), so a block's dot product is integer arithmetic:
 * 32 multiply-adds in two instructions (one with VNNI).
 *
 * Layout, per output row, blocks of 32 inputs:
 *   Q4 (Q4_0 / Q4_1): blocks in pairs, 32 bytes a pair: byte j holds input j of the even block (low
 *                     nibble) and of the odd block (high), so one load and two masks unpack 64
 *                     weights; an odd last block has high nibbles 0. w = q * d + m, d and m fp32 per
 *                     block (Q4_0: m = -8 d). A row is q4_row_bytes(cols) bytes.
 * x: [tokens, cols] fp32; out: [tokens, rows] fp32. Rows are split between threads. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif
#include "int8_dot.h"

#define QBLOCK 32
#define MAX_TOKENS 16

/* x rounded per block of 32: xq = round(x / s) in [-127, 127], s = max|x| / 127; sums[b] = s * sum(xq). */
static void quantize_blocks(int8_t *xq, float *scales, float *sums, const float *x, int64_t n) {
    for (int64_t b = 0; b < n / QBLOCK; b++) {
        const float *xb = x + b * QBLOCK;
        float amax = 0.f;
        for (int i = 0; i < QBLOCK; i++) amax = fmaxf(amax, fabsf(xb[i]));
        const float s = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
        int sum = 0;
        for (int i = 0; i < QBLOCK; i++) {
            const int q = (int)lrintf(xb[i] * inv);
            xq[b * QBLOCK + i] = (int8_t)q;
            sum += q;
        }
        scales[b] = s;
        sums[b] = s * (float)sum;
    }
}

#ifdef __AVX2__
static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline __m256i low_nibbles(__m256i raw) { return _mm256_and_si256(raw, _mm256_set1_epi8(0x0F)); }
static inline __m256i high_nibbles(__m256i raw) {
    return _mm256_and_si256(_mm256_srli_epi16(raw, 4), _mm256_set1_epi8(0x0F));
}
static inline __m256i load256(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }
#endif

struct qx {  /* the step's activations, rounded per block */
    int8_t *q;
    float *scale, *sum;
};

static struct qx quantize_tokens(const float *x, int64_t tokens, int64_t cols) {
    const int64_t blocks = cols / QBLOCK;
    struct qx r = {malloc(tokens * cols), malloc(sizeof(float) * tokens * blocks),
                   malloc(sizeof(float) * tokens * blocks)};
    for (int64_t t = 0; t < tokens; t++)
        quantize_blocks(r.q + t * cols, r.scale + t * blocks, r.sum + t * blocks, x + t * cols, cols);
    return r;
}

static void free_qx(struct qx r) { free(r.q); free(r.scale); free(r.sum); }

/* A single token takes rows four at a time; several tokens take one row at a time, each weight block
 * unpacked once for all of them. */

static int64_t q4_row_bytes(int64_t cols) { return (cols / QBLOCK + 1) / 2 * 32; }

static inline int q4_value(const uint8_t *row, int64_t b, int j) {
    const uint8_t byte = row[b / 2 * 32 + j];
    return b % 2 ? byte >> 4 : byte & 15;
}

/* sum over blocks of m * (the block's activation sum): the offset part of w = q * d + m. */
static float q4_offset(const float *m, const float *xsum, int64_t blocks) {
    float s = 0.f;
    for (int64_t b = 0; b < blocks; b++) s += m[b] * xsum[b];
    return s;
}

static void q4_row(float *out, struct qx x, const uint8_t *qs, const float *d, const float *m, int64_t tokens,
                   int64_t rows, int64_t cols) {
    const int64_t blocks = cols / QBLOCK;
#ifdef __AVX2__
    __m256 acc[MAX_TOKENS];  /* each block is unpacked once and meets every token */
    for (int64_t t = 0; t < tokens; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const __m256i raw = load256(qs + b / 2 * 32), w = b % 2 ? high_nibbles(raw) : low_nibbles(raw);
        for (int64_t t = 0; t < tokens; t++) {
            const __m256 dot = _mm256_cvtepi32_ps(dot_u8_i8(w, load256(x.q + t * cols + b * QBLOCK)));
            acc[t] = _mm256_fmadd_ps(dot, _mm256_set1_ps(d[b] * x.scale[t * blocks + b]), acc[t]);
        }
    }
#endif
    for (int64_t t = 0; t < tokens; t++) {
        float s = q4_offset(m, x.sum + t * blocks, blocks);
#ifdef __AVX2__
        s += hsum256(acc[t]);
#else
        for (int64_t b = 0; b < blocks; b++) {
            const int8_t *xb = x.q + t * cols + b * QBLOCK;
            int dot = 0;
            for (int j = 0; j < QBLOCK; j++) dot += q4_value(qs, b, j) * xb[j];
            s += (float)dot * d[b] * x.scale[t * blocks + b];
        }
#endif
        out[t * rows] = s;
    }
}

#ifdef __AVX2__
/* One token, four rows at once: each activation block is loaded once for four weight blocks, and
 * the four accumulators are independent chains (one would wait on each fma's latency). */
static void q4_four_rows(float *out, struct qx x, const uint8_t *qs, const float *d, const float *m,
                         int64_t cols) {
    const int64_t blocks = cols / QBLOCK, stride = q4_row_bytes(cols);
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    int64_t b = 0;
    for (; b + 1 < blocks; b += 2) {
        const __m256i xa = load256(x.q + b * QBLOCK), xb = load256(x.q + (b + 1) * QBLOCK);
        for (int i = 0; i < 4; i++) {
            const __m256i raw = load256(qs + i * stride + b / 2 * 32);
            const __m256 da = _mm256_cvtepi32_ps(dot_u8_i8(low_nibbles(raw), xa));
            const __m256 db = _mm256_cvtepi32_ps(dot_u8_i8(high_nibbles(raw), xb));
            acc[i] = _mm256_fmadd_ps(da, _mm256_set1_ps(d[i * blocks + b] * x.scale[b]), acc[i]);
            acc[i] = _mm256_fmadd_ps(db, _mm256_set1_ps(d[i * blocks + b + 1] * x.scale[b + 1]), acc[i]);
        }
    }
    if (b < blocks) {  /* an odd last block: low nibbles only */
        const __m256i xa = load256(x.q + b * QBLOCK);
        for (int i = 0; i < 4; i++) {
            const __m256 da = _mm256_cvtepi32_ps(dot_u8_i8(low_nibbles(load256(qs + i * stride + b / 2 * 32)), xa));
            acc[i] = _mm256_fmadd_ps(da, _mm256_set1_ps(d[i * blocks + b] * x.scale[b]), acc[i]);
        }
    }
    for (int i = 0; i < 4; i++) out[i] = q4_offset(m + i * blocks, x.sum, blocks) + hsum256(acc[i]);
}
#endif

void q4_matmul_f32(float *out, const float *x, const uint8_t *qs, const float *d, const float *m,
                   int64_t tokens, int64_t rows, int64_t cols, int threads) {
    const int64_t blocks = cols / QBLOCK;
    struct qx xq = quantize_tokens(x, tokens, cols);
#ifdef __AVX2__
    if (tokens == 1 && rows % 4 == 0) {
        _Pragma("omp parallel for schedule(static) num_threads(threads)")
        for (int64_t r = 0; r < rows; r += 4)
            q4_four_rows(out + r, xq, qs + r * q4_row_bytes(cols), d + r * blocks, m + r * blocks, cols);
        free_qx(xq);
        return;
    }
#endif
    _Pragma("omp parallel for schedule(static) num_threads(threads)")
    for (int64_t r = 0; r < rows; r++)
        q4_row(out + r, xq, qs + r * q4_row_bytes(cols), d + r * blocks, m + r * blocks, tokens, rows, cols);
    free_qx(xq);
}
