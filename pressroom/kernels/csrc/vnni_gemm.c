/* Products of 4-bit matrices (Q4_0 / Q4_1) for steps of 9 to ~128 tokens (batched decode, a verification's
 * rows) on AVX-512 VNNI. The row kernel (quant_ops.c) unpacks nibbles and sums across lanes per 4 tokens; past
 * 8 tokens oneDNN's bf16 GEMM beat it. Here the codes wait unpacked in a panel of bytes, 16 rows x 4 inputs per
 * 64-byte vector, so one vpdpbusd advances 16 output rows of one token by 4 inputs, and a tile of 4 tokens x 32
 * rows keeps its 8 integer and 8 float accumulators in registers: a block of 32 inputs costs 64 integer dot
 * products against 16 float operations.
 *
 * The bits are the row kernel's: activations rounded per block of 32 as quant_ops.c rounds them (xq =
 * rint(x * 127 / amax), scale amax / 127, sum = scale * sum(xq)), each block's integer dot product, and per
 * output the same two fused multiply-adds a block in the same order: y += m * sum, then y += dot * (d * scale).
 * So a token's outputs do not depend on which kernel or which other tokens share its step.
 *
 * vnni_q8_gemm_f32 does the same for Q8_0 (the LM head) with llama.cpp's bits as ggml_ops.c's row kernel gives
 * them: there each lane of a 256-bit sum holds 4 of a block's 32 inputs, its own fp32 sum over the blocks, and
 * the 8 lanes meet at the end in a fixed tree. So here each group of 4 inputs keeps its own accumulator (8 per
 * token and 16 outputs) and the tree is taken over them: 3 vector operations per 64 pairs instead of ~10.
 *
 * Layout (quant.VnniPanel packs it): panel [ceil(N / 16), K / 32, 8, 16, 4] bytes, element [v, b, g, c, e] =
 * the code of output 16 v + c at input 32 b + 4 g + e (outputs past N are zero); d, m: fp32
 * [ceil(N / 16), K / 32, 16]. x: [M, K] fp32; out: [M, N] fp32. Column tiles are shared by workshare.h. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "workshare.h"

enum { PANEL_Q4 = 1, PANEL_Q8 = 2 };  /* vnni_gemm_available()'s bits: the products this build has */

/* A 4-bit product in flight (either ISA's kernel). */
struct gemm {
    float *out;
    const float *x;
    const uint8_t *panel;
    const float *d, *m;
    int8_t *xq;
    float *xs, *xsum;  /* per token and block: the scale, and the scale times the sum of the codes */
    int64_t tokens, k, n, blocks, vectors;
};

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>

/* The build lets the compiler reassociate float sums (kernels/cpu.py); these keep the row kernels' order. */
#pragma GCC optimize("no-associative-math")

#define QB 32
#define MR 4  /* tokens per tile */
#define NV 2  /* vectors of 16 outputs per tile */

int vnni_gemm_available(void) { return PANEL_Q4 | PANEL_Q8; }

/* Token t's row rounded per block of 32, as quant_ops.c's quantize_blocks rounds it (rint is its lrintf). */
static void round_token(void *ctx, int64_t t) {
    struct gemm *g = ctx;
    const __m512 sign = _mm512_set1_ps(-0.f);
    for (int64_t b = 0; b < g->blocks; b++) {
        const float *xb = g->x + t * g->k + b * QB;
        const __m512 lo = _mm512_loadu_ps(xb), hi = _mm512_loadu_ps(xb + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, lo), _mm512_andnot_ps(sign, hi)));
        const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
        const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv)), qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
        int8_t *q = g->xq + t * g->k + b * QB;
        _mm_storeu_si128((__m128i *)q, _mm512_cvtepi32_epi8(qlo));
        _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtepi32_epi8(qhi));
        const int64_t i = t * g->blocks + b;
        g->xs[i] = amax / 127.f;
        g->xsum[i] = g->xs[i] * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
    }
}

/* out for tokens [t0, t0 + mr) and output vectors [v0, v0 + nv); mr and nv are constants once inlined. */
static inline __attribute__((always_inline)) void tile(const struct gemm *g, int64_t t0, int64_t v0, const int mr,
                                                       const int nv) {
    __m512 acc[MR][NV];
    for (int r = 0; r < mr; r++)
        for (int v = 0; v < nv; v++) acc[r][v] = _mm512_setzero_ps();
    const int64_t vstride = g->k * 16;
    const uint8_t *panel = g->panel + v0 * vstride;
    for (int64_t b = 0; b < g->blocks; b++) {
        __m512i dot[MR][NV];
        for (int r = 0; r < mr; r++)
            for (int v = 0; v < nv; v++) dot[r][v] = _mm512_setzero_si512();
        const uint8_t *p = panel + b * 512;
        for (int e = 0; e < 8; e++) {
            __m512i w[NV];
            for (int v = 0; v < nv; v++) w[v] = _mm512_loadu_si512(p + v * vstride + e * 64);
            for (int r = 0; r < mr; r++) {
                int32_t four;
                memcpy(&four, g->xq + (t0 + r) * g->k + b * QB + e * 4, sizeof four);
                const __m512i xv = _mm512_set1_epi32(four);
                for (int v = 0; v < nv; v++) dot[r][v] = _mm512_dpbusd_epi32(dot[r][v], w[v], xv);
            }
        }
        for (int v = 0; v < nv; v++) {
            const int64_t at = ((v0 + v) * g->blocks + b) * 16;
            const __m512 dv = _mm512_loadu_ps(g->d + at), mv = _mm512_loadu_ps(g->m + at);
            for (int r = 0; r < mr; r++) {
                const int64_t i = (t0 + r) * g->blocks + b;
                acc[r][v] = _mm512_fmadd_ps(mv, _mm512_set1_ps(g->xsum[i]), acc[r][v]);
                acc[r][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][v]), _mm512_mul_ps(dv, _mm512_set1_ps(g->xs[i])),
                                            acc[r][v]);
            }
        }
    }
    for (int v = 0; v < nv; v++) {
        const int64_t col = (v0 + v) * 16, valid = g->n - col < 16 ? g->n - col : 16;
        const __mmask16 keep = (__mmask16)((1u << valid) - 1u);
        for (int r = 0; r < mr; r++) _mm512_mask_storeu_ps(g->out + (t0 + r) * g->n + col, keep, acc[r][v]);
    }
}

#define TILE_CASE(R, V) case (R) * 4 + (V): tile(g, t0, v0, R, V); break;

/* Work item c: output vectors [NV c, NV c + NV) for every token (the panel's tile stays in cache for them). */
static void column(void *ctx, int64_t c) {
    const struct gemm *g = ctx;
    const int64_t v0 = c * NV;
    const int nv = g->vectors - v0 < NV ? (int)(g->vectors - v0) : NV;
    for (int64_t t0 = 0; t0 < g->tokens; t0 += MR) {
        const int mr = g->tokens - t0 < MR ? (int)(g->tokens - t0) : MR;
        switch (mr * 4 + nv) {
            TILE_CASE(1, 1) TILE_CASE(2, 1) TILE_CASE(3, 1) TILE_CASE(4, 1)
            TILE_CASE(1, 2) TILE_CASE(2, 2) TILE_CASE(3, 2) TILE_CASE(4, 2)
        }
    }
}

void vnni_gemm_f32(float *out, const float *x, int64_t tokens, int64_t k, const uint8_t *panel, const float *d,
                   const float *m, int64_t n, int threads) {
    const int64_t blocks = k / QB;
    struct gemm g = {out, x, panel, d, m, malloc(tokens * k + 64), malloc(sizeof(float) * tokens * blocks),
                     malloc(sizeof(float) * tokens * blocks), tokens, k, n, blocks, (n + 15) / 16};
    workshare_run(round_token, &g, tokens, tokens >= 16 ? threads : 1);
    workshare_run(column, &g, (g.vectors + NV - 1) / NV, threads);
    free(g.xq); free(g.xs); free(g.xsum);
}

/* ---- Q8_0: codes q + 128 in the panel, d fp32 (GGUF's fp16 scales, exactly) -------------------------------- */

#define MR8 2  /* tokens per Q8_0 tile: 8 accumulators each */

struct q8_gemm {
    float *out;
    const float *x;
    const uint8_t *panel;
    const float *d;
    int8_t *xq;
    float *xd;      /* per token and block: llama.cpp's scale, amax / 127 rounded to fp16 */
    int32_t *xoff;  /* per token, block and group of 4: 128 times the codes' sum (what the + 128 added) */
    int64_t tokens, k, n, blocks, vectors;
};

static float round_to_f16(float f) { return _cvtsh_ss(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT)); }

/* As ggml_ops.c's q8_0_row: codes rint(x * 127 / amax), the scale rounded to fp16. */
static void round_token_q8(void *ctx, int64_t t) {
    struct q8_gemm *g = ctx;
    const __m512 sign = _mm512_set1_ps(-0.f);
    for (int64_t b = 0; b < g->blocks; b++) {
        const float *xb = g->x + t * g->k + b * QB;
        const __m512 lo = _mm512_loadu_ps(xb), hi = _mm512_loadu_ps(xb + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, lo), _mm512_andnot_ps(sign, hi)));
        const __m512 inv = _mm512_set1_ps(amax != 0.f ? 127.f / amax : 0.f);
        const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv)), qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
        int8_t *q = g->xq + t * g->k + b * QB;
        _mm_storeu_si128((__m128i *)q, _mm512_cvtepi32_epi8(qlo));
        _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtepi32_epi8(qhi));
        const int64_t i = t * g->blocks + b;
        g->xd[i] = round_to_f16(amax / 127.f);
        for (int e = 0; e < 8; e++) {
            int32_t sum = 0;
            for (int j = 0; j < 4; j++) sum += q[4 * e + j];
            g->xoff[i * 8 + e] = -128 * sum;
        }
    }
}

/* Lane j of the row kernel's sum is group j of every block; its hsum_ps adds lanes (j, j + 4), then (0, 2) and
 * (1, 3), then the two: the same tree over the groups' vectors. */
static inline __m512 lanes_tree(const __m512 *a) {
    const __m512 s0 = _mm512_add_ps(a[0], a[4]), s1 = _mm512_add_ps(a[1], a[5]);
    const __m512 s2 = _mm512_add_ps(a[2], a[6]), s3 = _mm512_add_ps(a[3], a[7]);
    return _mm512_add_ps(_mm512_add_ps(s0, s2), _mm512_add_ps(s1, s3));
}

static inline __attribute__((always_inline)) void q8_tile(const struct q8_gemm *g, int64_t t0, int64_t v, const int mr) {
    __m512 acc[MR8][8];
    for (int r = 0; r < mr; r++)
        for (int e = 0; e < 8; e++) acc[r][e] = _mm512_setzero_ps();
    const uint8_t *panel = g->panel + v * g->k * 16;
    for (int64_t b = 0; b < g->blocks; b++) {
        const __m512 dv = _mm512_loadu_ps(g->d + (v * g->blocks + b) * 16);
        __m512 scale[MR8];
        for (int r = 0; r < mr; r++) scale[r] = _mm512_mul_ps(dv, _mm512_set1_ps(g->xd[(t0 + r) * g->blocks + b]));
        for (int e = 0; e < 8; e++) {
            const __m512i w = _mm512_loadu_si512(panel + b * 512 + e * 64);
            for (int r = 0; r < mr; r++) {
                const int64_t i = (t0 + r) * g->blocks + b;
                int32_t four;
                memcpy(&four, g->xq + (t0 + r) * g->k + b * QB + e * 4, sizeof four);
                /* starting from -128 sum(x) leaves exactly sum(q x) */
                const __m512i dot = _mm512_dpbusd_epi32(_mm512_set1_epi32(g->xoff[i * 8 + e]), w, _mm512_set1_epi32(four));
                acc[r][e] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale[r], acc[r][e]);
            }
        }
    }
    const int64_t col = v * 16, valid = g->n - col < 16 ? g->n - col : 16;
    const __mmask16 keep = (__mmask16)((1u << valid) - 1u);
    for (int r = 0; r < mr; r++) _mm512_mask_storeu_ps(g->out + (t0 + r) * g->n + col, keep, lanes_tree(acc[r]));
}

static void q8_column(void *ctx, int64_t v) {
    const struct q8_gemm *g = ctx;
    for (int64_t t0 = 0; t0 < g->tokens; t0 += MR8) {
        if (g->tokens - t0 >= 2) q8_tile(g, t0, v, 2);
        else q8_tile(g, t0, v, 1);
    }
}

void vnni_q8_gemm_f32(float *out, const float *x, int64_t tokens, int64_t k, const uint8_t *panel, const float *d,
                      int64_t n, int threads) {
    const int64_t blocks = k / QB;
    struct q8_gemm g = {out, x, panel, d, malloc(tokens * k + 64), malloc(sizeof(float) * tokens * blocks),
                        malloc(sizeof(int32_t) * tokens * blocks * 8), tokens, k, n, blocks, (n + 15) / 16};
    workshare_run(round_token_q8, &g, tokens, tokens >= 16 ? threads : 1);
    workshare_run(q8_column, &g, g.vectors, threads);
    free(g.xq); free(g.xd); free(g.xoff);
}
#elif defined(__AVX2__)
/* AVX2: the same panels, each 64-byte vector as two halves of 8 outputs, the integer dot products as
 * int8_dot.h's (maddubs + madd, or AVX-VNNI): codes under 16 never saturate maddubs' 16-bit sums. A tile is 2
 * tokens x 16 outputs (16 registers). The Q8_0 panel needs codes up to 255, which maddubs would saturate: none. */
#include <immintrin.h>
#include <math.h>

#include "int8_dot.h"

#pragma GCC optimize("no-associative-math")

#define QB 32
#define MR 2

int vnni_gemm_available(void) { return PANEL_Q4; }

/* As quant_ops.c's quantize_blocks (cvtps_epi32 rounds to nearest even, as its lrintf). */
static void round_token(void *ctx, int64_t t) {
    struct gemm *g = ctx;
    const __m256 sign = _mm256_set1_ps(-0.f);
    for (int64_t b = 0; b < g->blocks; b++) {
        const float *xb = g->x + t * g->k + b * QB;
        __m256 v[4], mx = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) v[i] = _mm256_loadu_ps(xb + 8 * i), mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[i]));
        float lanes[8], amax = 0.f;
        _mm256_storeu_ps(lanes, mx);
        for (int i = 0; i < 8; i++) amax = fmaxf(amax, lanes[i]);
        const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
        int32_t codes[QB], sum = 0;
        for (int i = 0; i < 4; i++) _mm256_storeu_si256((__m256i *)(codes + 8 * i), _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv)));
        int8_t *q = g->xq + t * g->k + b * QB;
        for (int i = 0; i < QB; i++) q[i] = (int8_t)codes[i], sum += codes[i];
        const int64_t i = t * g->blocks + b;
        g->xs[i] = amax / 127.f;
        g->xsum[i] = g->xs[i] * (float)sum;
    }
}

/* out for tokens [t0, t0 + mr) and the 16 outputs of panel vector v, as two halves of 8. */
static inline __attribute__((always_inline)) void tile(const struct gemm *g, int64_t t0, int64_t v, const int mr) {
    __m256 acc[MR][2];
    for (int r = 0; r < mr; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const uint8_t *panel = g->panel + v * g->k * 16;
    for (int64_t b = 0; b < g->blocks; b++) {
        __m256i dot[MR][2];
        for (int r = 0; r < mr; r++) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
        const uint8_t *p = panel + b * 512;
        for (int e = 0; e < 8; e++) {
            const __m256i w0 = _mm256_loadu_si256((const __m256i *)(p + e * 64));
            const __m256i w1 = _mm256_loadu_si256((const __m256i *)(p + e * 64 + 32));
            for (int r = 0; r < mr; r++) {
                int32_t four;
                memcpy(&four, g->xq + (t0 + r) * g->k + b * QB + e * 4, sizeof four);
                const __m256i xv = _mm256_set1_epi32(four);
                dot[r][0] = dot_acc_u8_i8(dot[r][0], w0, xv);
                dot[r][1] = dot_acc_u8_i8(dot[r][1], w1, xv);
            }
        }
        const int64_t at = (v * g->blocks + b) * 16;
        for (int h = 0; h < 2; h++) {
            const __m256 dv = _mm256_loadu_ps(g->d + at + 8 * h), mv = _mm256_loadu_ps(g->m + at + 8 * h);
            for (int r = 0; r < mr; r++) {
                const int64_t i = (t0 + r) * g->blocks + b;
                acc[r][h] = _mm256_fmadd_ps(mv, _mm256_set1_ps(g->xsum[i]), acc[r][h]);
                acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][h]), _mm256_mul_ps(dv, _mm256_set1_ps(g->xs[i])),
                                            acc[r][h]);
            }
        }
    }
    const int64_t col = v * 16;
    for (int h = 0; h < 2; h++) {
        const int64_t c0 = col + 8 * h, valid = g->n - c0 < 8 ? g->n - c0 : 8;
        for (int r = 0; r < mr; r++) {
            if (valid == 8) {
                _mm256_storeu_ps(g->out + (t0 + r) * g->n + c0, acc[r][h]);
            } else if (valid > 0) {
                float lanes[8];
                _mm256_storeu_ps(lanes, acc[r][h]);
                memcpy(g->out + (t0 + r) * g->n + c0, lanes, sizeof(float) * valid);
            }
        }
    }
}

static void column(void *ctx, int64_t v) {
    const struct gemm *g = ctx;
    for (int64_t t0 = 0; t0 < g->tokens; t0 += MR) {
        if (g->tokens - t0 >= 2) tile(g, t0, v, 2);
        else tile(g, t0, v, 1);
    }
}

void vnni_gemm_f32(float *out, const float *x, int64_t tokens, int64_t k, const uint8_t *panel, const float *d,
                   const float *m, int64_t n, int threads) {
    const int64_t blocks = k / QB;
    struct gemm g = {out, x, panel, d, m, malloc(tokens * k + 64), malloc(sizeof(float) * tokens * blocks),
                     malloc(sizeof(float) * tokens * blocks), tokens, k, n, blocks, (n + 15) / 16};
    workshare_run(round_token, &g, tokens, tokens >= 16 ? threads : 1);
    workshare_run(column, &g, g.vectors, threads);
    free(g.xq); free(g.xs); free(g.xsum);
}

void vnni_q8_gemm_f32(float *out, const float *x, int64_t tokens, int64_t k, const uint8_t *panel, const float *d,
                      int64_t n, int threads) {
    (void)out; (void)x; (void)tokens; (void)k; (void)panel; (void)d; (void)n; (void)threads;
    abort();  /* callers ask vnni_gemm_available() first */
}
#else
int vnni_gemm_available(void) { return 0; }

void vnni_gemm_f32(float *out, const float *x, int64_t tokens, int64_t k, const uint8_t *panel, const float *d,
                   const float *m, int64_t n, int threads) {
    (void)out; (void)x; (void)tokens; (void)k; (void)panel; (void)d; (void)m; (void)n; (void)threads;
    abort();  /* callers ask vnni_gemm_available() first */
}

void vnni_q8_gemm_f32(float *out, const float *x, int64_t tokens, int64_t k, const uint8_t *panel, const float *d,
                      int64_t n, int threads) {
    (void)out; (void)x; (void)tokens; (void)k; (void)panel; (void)d; (void)n; (void)threads;
    abort();
}
#endif
