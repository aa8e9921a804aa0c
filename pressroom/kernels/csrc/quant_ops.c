/* Matrix products with weights kept as GGUF ships them, for decode-sized steps (a few tokens), as
 * llama.cpp computes them: the weights stream 4x fewer bytes than fp32, and
 * each block of 32 activations is rounded to int8 with its own scale (relative error under 1/254
 * of the block's largest value, about bf16's), so a block's dot product is integer arithmetic:
 * 32 multiply-adds in two instructions (one with VNNI).
 *
 * Layout: rows in tiles of 8 (the last one padded with zero rows), blocks of 32 inputs, w = q * d + m (Q4_0:
 * m = -8 d). A tile's block is 128 bytes, four quarters of 32: byte 4 r + e of quarter k holds input 4 k + e
 * of the tile's row r in its low nibble and input 16 + 4 k + e in its high one. So a quarter unpacks into two
 * vectors whose lane r holds four consecutive inputs of row r, and one integer dot product with four
 * broadcast activations advances all eight rows: no horizontal sums, and the unpacked block serves every
 * token of the step. d, m: fp32 [tiles, blocks, 8] (quant.NibbleMatrix packs all three).
 * x: [tokens, cols] fp32; out: [tokens, rows] fp32. Tiles are split between threads. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif
#include "int8_dot.h"

#define QBLOCK 32

/* x rounded per block of 32: xq = round(x / s) in [-127, 127], s = max|x| / 127; sums[b] = s * sum(xq). The
 * vector form rounds as lrintf does (to nearest, ties to even) and sums integers: the same values. */
static void quantize_blocks(int8_t *xq, float *scales, float *sums, const float *x, int64_t n) {
    for (int64_t b = 0; b < n / QBLOCK; b++) {
        const float *xb = x + b * QBLOCK;
#ifdef __AVX2__
        const __m256 sign = _mm256_set1_ps(-0.f);
        __m256 v[4], amax4 = _mm256_setzero_ps();
        for (int k = 0; k < 4; k++) {
            v[k] = _mm256_loadu_ps(xb + 8 * k);
            amax4 = _mm256_max_ps(_mm256_andnot_ps(sign, v[k]), amax4);  /* a NaN is skipped, as fmaxf skips it */
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax4), _mm256_extractf128_ps(amax4, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
        const float s = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
        __m256i q[4];
        for (int k = 0; k < 4; k++) q[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], _mm256_set1_ps(inv)));
        const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        _mm256_storeu_si256((__m256i *)(xq + b * QBLOCK),
                            _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        const __m256i total = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
        t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4E));
        const int sum = _mm_cvtsi128_si32(_mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xB1)));
#else
        float amax = 0.f;
        for (int i = 0; i < QBLOCK; i++) amax = fmaxf(amax, fabsf(xb[i]));
        const float s = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
        int sum = 0;
        for (int i = 0; i < QBLOCK; i++) {
            const int q = (int)lrintf(xb[i] * inv);
            xq[b * QBLOCK + i] = (int8_t)q;
            sum += q;
        }
#endif
        scales[b] = s;
        sums[b] = s * (float)sum;
    }
}

#ifdef __AVX2__
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

#define TILE 8
#define TILE_BYTES (TILE * QBLOCK / 2)
#define TOKEN_CHUNK 4 /* tokens that share one unpacking of a block: their accumulators stay in registers */

#ifdef __AVX2__
static inline __m256i broadcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return _mm256_set1_epi32(v);
}

/* out[t][r] for the tile's `valid` rows and tokens t0 .. t0 + n - 1. */
static void q4_tile_chunk(float *out, struct qx x, const uint8_t *qs, const float *d, const float *m,
                          int64_t t0, int n, int valid, int64_t rows, int64_t cols) {
    const int64_t blocks = cols / QBLOCK;
    __m256 acc[TOKEN_CHUNK];
    for (int i = 0; i < n; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *p = qs + b * TILE_BYTES;
        __m256i w[8];
        for (int k = 0; k < 4; k++) {
            const __m256i raw = load256(p + 32 * k);
            w[k] = low_nibbles(raw);
            w[4 + k] = high_nibbles(raw);
        }
        const __m256 dv = _mm256_loadu_ps(d + b * TILE), mv = _mm256_loadu_ps(m + b * TILE);
        for (int i = 0; i < n; i++) {
            const int64_t t = t0 + i;
            const int8_t *xb = x.q + t * cols + b * QBLOCK;
            __m256i lo = dot_u8_i8(w[0], broadcast4(xb)), hi = dot_u8_i8(w[4], broadcast4(xb + 16));
            for (int k = 1; k < 4; k++) {
                lo = dot_acc_u8_i8(lo, w[k], broadcast4(xb + 4 * k));
                hi = dot_acc_u8_i8(hi, w[4 + k], broadcast4(xb + 16 + 4 * k));
            }
            const __m256 dot = _mm256_cvtepi32_ps(_mm256_add_epi32(lo, hi));
            acc[i] = _mm256_fmadd_ps(mv, _mm256_set1_ps(x.sum[t * blocks + b]), acc[i]);
            acc[i] = _mm256_fmadd_ps(dot, _mm256_mul_ps(dv, _mm256_set1_ps(x.scale[t * blocks + b])), acc[i]);
        }
    }
    for (int i = 0; i < n; i++) {
        float lanes[TILE];
        _mm256_storeu_ps(lanes, acc[i]);
        memcpy(out + (t0 + i) * rows, lanes, sizeof(float) * valid);
    }
}
#else
static void q4_tile_chunk(float *out, struct qx x, const uint8_t *qs, const float *d, const float *m,
                          int64_t t0, int n, int valid, int64_t rows, int64_t cols) {
    const int64_t blocks = cols / QBLOCK;
    for (int i = 0; i < n; i++) {
        const int64_t t = t0 + i;
        for (int r = 0; r < valid; r++) {
            float s = 0.f;
            for (int64_t b = 0; b < blocks; b++) {
                const uint8_t *p = qs + b * TILE_BYTES;
                const int8_t *xb = x.q + t * cols + b * QBLOCK;
                int dot = 0;
                for (int j = 0; j < QBLOCK; j++) {
                    const uint8_t byte = p[32 * (j % 16 / 4) + 4 * r + j % 4];
                    dot += (j < 16 ? byte & 15 : byte >> 4) * xb[j];
                }
                s += m[b * TILE + r] * x.sum[t * blocks + b];
                s += (float)dot * (d[b * TILE + r] * x.scale[t * blocks + b]);
            }
            out[t * rows + r] = s;
        }
    }
}
#endif

#if defined(__AVX512VL__) && defined(__AVX512VNNI__)
/* With AVX-512's 32 vector registers, up to WIDE_TOKENS tokens share one unpacking of a block, their accumulators
 * held in registers: a verification's 1 + K rows (K <= 8) stream the nibbles once (TOKEN_CHUNK's 4 a pass took
 * three passes for 9). Each token's operations are q4_tile_chunk's in its order: the same bits. */
#define WIDE_TOKENS 12

/* q4_tile_chunk for n tokens, n a constant in each caller (the loops over tokens unroll into registers). */
static inline __attribute__((always_inline)) void q4_wide_chunk(float *out, struct qx x, const uint8_t *qs,
                                                                const float *d, const float *m, int64_t t0,
                                                                const int n, int valid, int64_t rows, int64_t cols) {
    const int64_t blocks = cols / QBLOCK;
    __m256 acc[WIDE_TOKENS];
    _Pragma("GCC unroll 12") for (int i = 0; i < n; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *p = qs + b * TILE_BYTES;
        __m256i w[8];
        _Pragma("GCC unroll 4") for (int k = 0; k < 4; k++) {
            const __m256i raw = load256(p + 32 * k);
            w[k] = low_nibbles(raw);
            w[4 + k] = high_nibbles(raw);
        }
        const __m256 dv = _mm256_loadu_ps(d + b * TILE), mv = _mm256_loadu_ps(m + b * TILE);
        _Pragma("GCC unroll 12") for (int i = 0; i < n; i++) {
            const int64_t t = t0 + i;
            const int8_t *xb = x.q + t * cols + b * QBLOCK;
            __m256i lo = dot_u8_i8(w[0], broadcast4(xb)), hi = dot_u8_i8(w[4], broadcast4(xb + 16));
            _Pragma("GCC unroll 3") for (int k = 1; k < 4; k++) {
                lo = dot_acc_u8_i8(lo, w[k], broadcast4(xb + 4 * k));
                hi = dot_acc_u8_i8(hi, w[4 + k], broadcast4(xb + 16 + 4 * k));
            }
            const __m256 dot = _mm256_cvtepi32_ps(_mm256_add_epi32(lo, hi));
            acc[i] = _mm256_fmadd_ps(mv, _mm256_set1_ps(x.sum[t * blocks + b]), acc[i]);
            acc[i] = _mm256_fmadd_ps(dot, _mm256_mul_ps(dv, _mm256_set1_ps(x.scale[t * blocks + b])), acc[i]);
        }
    }
    _Pragma("GCC unroll 12") for (int i = 0; i < n; i++) {
        float lanes[TILE];
        _mm256_storeu_ps(lanes, acc[i]);
        memcpy(out + (t0 + i) * rows, lanes, sizeof(float) * valid);
    }
}

#define WIDE_CASE(N) case N: q4_wide_chunk(out, x, qs, d, m, t0, N, valid, rows, cols); break;
static void q4_tile_tokens(float *out, struct qx x, const uint8_t *qs, const float *d, const float *m,
                           int64_t tokens, int valid, int64_t rows, int64_t cols) {
    for (int64_t t0 = 0; t0 < tokens; t0 += WIDE_TOKENS) {
        switch (tokens - t0 < WIDE_TOKENS ? (int)(tokens - t0) : WIDE_TOKENS) {
            WIDE_CASE(1) WIDE_CASE(2) WIDE_CASE(3) WIDE_CASE(4) WIDE_CASE(5) WIDE_CASE(6)
            WIDE_CASE(7) WIDE_CASE(8) WIDE_CASE(9) WIDE_CASE(10) WIDE_CASE(11) WIDE_CASE(12)
        }
    }
}
#define HAVE_WIDE 1
#else
static void q4_tile_tokens(float *out, struct qx x, const uint8_t *qs, const float *d, const float *m,
                           int64_t tokens, int valid, int64_t rows, int64_t cols) {
    for (int64_t t0 = 0; t0 < tokens; t0 += TOKEN_CHUNK)
        q4_tile_chunk(out, x, qs, d, m, t0, tokens - t0 < TOKEN_CHUNK ? (int)(tokens - t0) : TOKEN_CHUNK, valid,
                      rows, cols);
}
#define HAVE_WIDE 0
#endif


/* The most tokens the row kernel should take before a panel product (vnni_gemm.c) beats it: decode_stack.c asks. */
int q4_row_kernel_max_tokens(void) {
#if HAVE_WIDE
    return WIDE_TOKENS;  /* one pass over the weights (a verification of K <= 11 drafts) */
#else
    return 2 * TOKEN_CHUNK;  /* quant.py's INT4_MAX_ROWS */
#endif
}

static void q4_tile(float *out, struct qx xq, const uint8_t *qs, const float *d, const float *m, int64_t g,
                    int64_t blocks, int64_t tokens, int64_t rows, int64_t cols) {
    const int valid = rows - g * TILE < TILE ? (int)(rows - g * TILE) : TILE;
    q4_tile_tokens(out + g * TILE, xq, qs + g * blocks * TILE_BYTES, d + g * blocks * TILE, m + g * blocks * TILE,
                   tokens, valid, rows, cols);
}

void q4_matmul_f32(float *out, const float *x, const uint8_t *qs, const float *d, const float *m,
                   int64_t tokens, int64_t rows, int64_t cols, int threads) {
    const int64_t blocks = cols / QBLOCK, tiles = (rows + TILE - 1) / TILE;
    struct qx xq = quantize_tokens(x, tokens, cols);
    _Pragma("omp parallel for schedule(static) num_threads(threads)")
    for (int64_t g = 0; g < tiles; g++) q4_tile(out, xq, qs, d, m, g, blocks, tokens, rows, cols);
    free_qx(xq);
}
