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

void q4_matmul_f32(float *out, const float *x, const uint8_t *qs, const float *d, const float *m,
                   int64_t tokens, int64_t rows, int64_t cols, int threads) {
    const int64_t blocks = cols / QBLOCK, tiles = (rows + TILE - 1) / TILE;
    struct qx xq = quantize_tokens(x, tokens, cols);
    _Pragma("omp parallel for schedule(static) num_threads(threads)")
    for (int64_t g = 0; g < tiles; g++) {
        const int valid = rows - g * TILE < TILE ? (int)(rows - g * TILE) : TILE;
        for (int64_t t0 = 0; t0 < tokens; t0 += TOKEN_CHUNK)
            q4_tile_chunk(out + g * TILE, xq, qs + g * blocks * TILE_BYTES, d + g * blocks * TILE,
                          m + g * blocks * TILE, t0, tokens - t0 < TOKEN_CHUNK ? (int)(tokens - t0) : TOKEN_CHUNK,
                          valid, rows, cols);
    }
    free_qx(xq);
}
