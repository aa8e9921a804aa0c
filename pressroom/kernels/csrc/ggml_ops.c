/* Matrix products with GGML-quantized weights (Q8_0, Q5_0, Q4_K, Q5_K, Q6_K), computed as llama.cpp's CPU
 * backend computes them, so that a GGUF model follows llama.cpp's numbers and not only the dequantized
 * weights': the activations are rounded per block first and each block's dot product is integer arithmetic.
 *
 *   Q8_0, Q5_0 weights meet Q8_0 activations: per 32 values, d = fp16(max|x| / 127), q = rint(x * 127 / max|x|).
 *   K-quant weights meet Q8_K activations: per 256 values, iscale = -127 / (the value of largest magnitude),
 *   q = rint(iscale * x), d = 1 / iscale (fp32), with the sums of q per 16 (llama.cpp's bsums).
 *
 * Weight layouts (row-major, one row per output; pressroom/model/layers/quant.py builds them from GGUF blocks,
 * keeping every bit and adding only fp32 scales in place of fp16 ones):
 *   Q8_0: qs int8 [cols]; d fp32 [cols / 32].                       w = q * d
 *   Q8_0_BLOCKS: GGUF's own blocks, [cols / 32] x (fp16 d, 32 int8 q), 34 bytes each.
 *   Q5_0: qs [cols / 2] (per block, 16 bytes: value j low nibble, j + 16 high), qh uint32 [cols / 32]
 *         (bit j: value j's fifth bit), d fp32 [cols / 32].          w = (u - 16) * d, u in 0..31
 *   Q4_K, Q5_K: qs [cols / 2] (per 256, four runs of 32 bytes: sub-block 2i low nibbles, 2i + 1 high),
 *         Q5_K's qh [cols / 8] (per 256, 32 bytes: bit i of byte l, value l of sub-block i's fifth bit),
 *         sc, mn uint8 [cols / 32] (6-bit), d, dmin fp32 [cols / 256].   w = d * sc * u - dmin * mn
 *   Q6_K: ql [cols / 2], qh [cols / 4] (GGUF's 6-bit layout), sc int8 [cols / 16], d fp32 [cols / 256].
 *         w = d * sc * (u - 32), u in 0..63
 * x: [tokens, cols] fp32; out: [tokens, rows] fp32. Rows are split between threads. AVX2 code (VNNI's dot
 * where the target has it), plain C elsewhere; both compute the same integer sums. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif
#include "ggml_matrix.h"
#include "int8_dot.h"
#include "workshare.h"

#define QK 32
#define QK_K 256
/* Products smaller than this many multiply-adds run on the calling thread: waking a helper for the few
 * microseconds of a small decode product costs about what it saves. Products share their rows through
 * workshare.h's pool, not OpenMP: on a machine shared with other processes OpenMP's spinning idle workers and
 * barriers made a 32-token prompt take 0.1 to 2.7 s, and decode steps twice their time. */
#define PARALLEL_MIN_MACS (1 << 18)

static int threads_for(int64_t tokens, int64_t rows, int64_t cols, int threads) {
    return tokens * rows * cols >= PARALLEL_MIN_MACS ? threads : 1;
}

/* f rounded to the nearest fp16 value (ties to even), as a float: llama.cpp stores Q8_0 scales in fp16. */
static float round_to_f16(float f) {
    const float a = fabsf(f);
    if (a >= 65520.f) return copysignf(INFINITY, f);
    if (a < 6.103515625e-05f) return copysignf(rintf(a * 16777216.f) / 16777216.f, f);  /* subnormal: 2^-24 steps */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0xFFFu + ((u >> 13) & 1u);
    u &= ~0x1FFFu;
    memcpy(&f, &u, sizeof f);
    return f;
}

struct acts {  /* one step's activations, rounded per block */
    int8_t *q;
    float *d;     /* per block (32 or 256 values) */
    int32_t *sum; /* sums of q: per 32 (Q8_0) or per 16 (Q8_K) */
};

static void free_acts(struct acts a) { free(a.q); free(a.d); free(a.sum); }

static void q8_0_row(int8_t *q, float *d, int32_t *sum, const float *x, int64_t cols) {
    for (int64_t b = 0; b < cols / QK; b++) {
        const float *xb = x + b * QK;
        float amax = 0.f;
        for (int i = 0; i < QK; i++) amax = fmaxf(amax, fabsf(xb[i]));
        const float id = amax != 0.f ? 127.f / amax : 0.f;
        int s = 0;
        for (int i = 0; i < QK; i++) {
            const int v = (int)rintf(xb[i] * id);
            q[b * QK + i] = (int8_t)v;
            s += v;
        }
        d[b] = round_to_f16(amax / 127.f);
        sum[b] = s;
    }
}

static void q8_k_row(int8_t *q, float *d, int32_t *sum, const float *x, int64_t cols) {
    for (int64_t b = 0; b < cols / QK_K; b++) {
        const float *xb = x + b * QK_K;
        int8_t *qb = q + b * QK_K;
        float amax = 0.f, max = 0.f;
        for (int i = 0; i < QK_K; i++)
            if (fabsf(xb[i]) > amax) { amax = fabsf(xb[i]); max = xb[i]; }
        const float iscale = amax != 0.f ? -127.f / max : 0.f;
        for (int i = 0; i < QK_K; i++) {
            const int v = (int)rintf(iscale * xb[i]);
            qb[i] = (int8_t)(v < 127 ? v : 127);
        }
        for (int j = 0; j < QK_K / 16; j++) {
            int s = 0;
            for (int i = 0; i < 16; i++) s += qb[j * 16 + i];
            sum[b * (QK_K / 16) + j] = s;
        }
        d[b] = amax != 0.f ? 1.f / iscale : 0.f;
    }
}

struct rounding { const float *x; int64_t cols; int block; struct acts a; };

static void round_token(void *ctx, int64_t t) {
    const struct rounding *r = ctx;
    const int64_t cols = r->cols, blocks = cols / r->block, sums = r->block == QK ? blocks : cols / 16;
    if (r->block == QK) q8_0_row(r->a.q + t * cols, r->a.d + t * blocks, r->a.sum + t * sums, r->x + t * cols, cols);
    else q8_k_row(r->a.q + t * cols, r->a.d + t * blocks, r->a.sum + t * sums, r->x + t * cols, cols);
}

/* block: 32 (Q8_0) or 256 (Q8_K); tokens are rounded in parallel. */
static struct acts quantize(const float *x, int64_t tokens, int64_t cols, int block, int threads) {
    const int64_t blocks = cols / block, sums = block == QK ? blocks : cols / 16;
    struct rounding r = {x, cols, block, {malloc(tokens * cols + 64), malloc(sizeof(float) * tokens * blocks),
                                          malloc(sizeof(int32_t) * tokens * sums)}};
    workshare_run(round_token, &r, tokens, tokens > 16 ? threads : 1);
    return r.a;
}

void ggml_quantize_q8_0(int8_t *q, float *d, int32_t *sum, const float *x, int64_t tokens, int64_t cols) {
    for (int64_t t = 0; t < tokens; t++)
        q8_0_row(q + t * cols, d + t * (cols / QK), sum + t * (cols / QK), x + t * cols, cols);
}

void ggml_quantize_q8_k(int8_t *q, float *d, int32_t *sum, const float *x, int64_t tokens, int64_t cols) {
    for (int64_t t = 0; t < tokens; t++)
        q8_k_row(q + t * cols, d + t * (cols / QK_K), sum + t * (cols / 16), x + t * cols, cols);
}

#ifdef __AVX2__
static inline float hsum_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline int hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

static inline __m256i load256(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline __m256i nibbles_low(__m256i raw) { return _mm256_and_si256(raw, _mm256_set1_epi8(0x0F)); }
static inline __m256i nibbles_high(__m256i raw) {
    return _mm256_and_si256(_mm256_srli_epi16(raw, 4), _mm256_set1_epi8(0x0F));
}

/* byte i is 0xFF where bit i of `bits` is set, else 0 */
static inline __m256i bits_to_bytes(uint32_t bits) {
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
    const __m256i sel = _mm256_set1_epi64x((int64_t)0x8040201008040201ULL);
    const __m256i b = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), shuf);
    return _mm256_cmpeq_epi8(_mm256_and_si256(b, sel), sel);
}
#endif

/* ---- Q8_0 weights x Q8_0 activations ------------------------------------------------------------------- */

#ifdef __AVX2__
/* One block of 32 into a running sum: acc + dot(w, x) * scale, the dot unsigned x signed (|w| times x carrying
 * w's sign; `aw` is |w|). Every Q8_0 kernel below adds its blocks through this, so their sums agree to the bit. */
static inline __m256 q8_0_term(__m256 acc, __m256i wv, __m256i aw, const int8_t *x, float scale) {
    const __m256 dot = _mm256_cvtepi32_ps(dot_u8_i8(aw, _mm256_sign_epi8(load256(x), wv)));
    return _mm256_fmadd_ps(dot, _mm256_set1_ps(scale), acc);
}
#endif

static float q8_0_dot(const int8_t *w, const float *d, const int8_t *xq, const float *xd, int64_t blocks) {
#ifdef __AVX2__
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const __m256i wv = load256(w + b * QK);
        acc = q8_0_term(acc, wv, _mm256_sign_epi8(wv, wv), xq + b * QK, d[b] * xd[b]);
    }
    return hsum_ps(acc);
#else
    float s = 0.f;
    for (int64_t b = 0; b < blocks; b++) {
        int dot = 0;
        for (int i = 0; i < QK; i++) dot += w[b * QK + i] * xq[b * QK + i];
        s += (float)dot * (d[b] * xd[b]);
    }
    return s;
#endif
}

/* q8_0_dot for four tokens at once (x and its scales at a stride of cols and blocks), each weight block loaded
 * once for the four; each token's sum in q8_0_dot's order. out[j * stride] for token j. */
static void q8_0_dot4(float *out, int64_t stride, const int8_t *w, const float *d, const int8_t *xq, const float *xd,
                      int64_t cols, int64_t blocks) {
#ifdef __AVX2__
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
    for (int64_t b = 0; b < blocks; b++) {
        const __m256i wv = load256(w + b * QK), aw = _mm256_sign_epi8(wv, wv);
        const int8_t *x = xq + b * QK;
        acc0 = q8_0_term(acc0, wv, aw, x, d[b] * xd[b]);
        acc1 = q8_0_term(acc1, wv, aw, x + cols, d[b] * xd[blocks + b]);
        acc2 = q8_0_term(acc2, wv, aw, x + 2 * cols, d[b] * xd[2 * blocks + b]);
        acc3 = q8_0_term(acc3, wv, aw, x + 3 * cols, d[b] * xd[3 * blocks + b]);
    }
    out[0] = hsum_ps(acc0), out[stride] = hsum_ps(acc1), out[2 * stride] = hsum_ps(acc2), out[3 * stride] = hsum_ps(acc3);
#else
    for (int j = 0; j < 4; j++) out[j * stride] = q8_0_dot(w, d, xq + j * cols, xd + j * blocks, blocks);
#endif
}

/* Q8_0 as GGUF ships it, the LM head's form: per block of 32, the fp16 scale then the codes. One stream a row
 * read ~8% faster than the codes and fp32 scales as two arrays (a 262144 x 640 head, two threads; 6% fewer
 * bytes). The sums are q8_0_dot's, in its order: the same bits. */
struct q8_0_block { uint16_t d; int8_t qs[QK]; } __attribute__((packed));

static float f16_to_f32(uint16_t h) {
#ifdef __AVX2__
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 31u, man = h & 1023u;
    float f;
    if (exp == 0) {
        f = ldexpf((float)man, -24);  /* zero or subnormal */
        return sign ? -f : f;
    }
    const uint32_t bits = sign | (exp == 31 ? 0x7F800000u | man << 13 : (exp + 112u) << 23 | man << 13);
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

static float q8_0_block_dot(const struct q8_0_block *w, const int8_t *xq, const float *xd, int64_t blocks) {
#ifdef __AVX2__
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const __m256i wv = load256(w[b].qs);
        acc = q8_0_term(acc, wv, _mm256_sign_epi8(wv, wv), xq + b * QK, f16_to_f32(w[b].d) * xd[b]);
    }
    return hsum_ps(acc);
#else
    float s = 0.f;
    for (int64_t b = 0; b < blocks; b++) {
        int dot = 0;
        for (int i = 0; i < QK; i++) dot += w[b].qs[i] * xq[b * QK + i];
        s += (float)dot * (f16_to_f32(w[b].d) * xd[b]);
    }
    return s;
#endif
}

/* q8_0_block_dot for four tokens at once (x and its scales at a stride of cols and blocks): each weight block is
 * loaded, its magnitudes taken and its scale converted once for the four. Each token's sum is q8_0_block_dot's,
 * in its order: the same bits. out[j * stride] for token j. */
static void q8_0_block_dot4(float *out, int64_t stride, const struct q8_0_block *w, const int8_t *xq, const float *xd,
                            int64_t cols, int64_t blocks) {
#ifdef __AVX2__
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
    for (int64_t b = 0; b < blocks; b++) {
        const __m256i wv = load256(w[b].qs), aw = _mm256_sign_epi8(wv, wv);
        const float dw = f16_to_f32(w[b].d);
        const int8_t *x = xq + b * QK;
        acc0 = q8_0_term(acc0, wv, aw, x, dw * xd[b]);
        acc1 = q8_0_term(acc1, wv, aw, x + cols, dw * xd[blocks + b]);
        acc2 = q8_0_term(acc2, wv, aw, x + 2 * cols, dw * xd[2 * blocks + b]);
        acc3 = q8_0_term(acc3, wv, aw, x + 3 * cols, dw * xd[3 * blocks + b]);
    }
    out[0] = hsum_ps(acc0), out[stride] = hsum_ps(acc1), out[2 * stride] = hsum_ps(acc2), out[3 * stride] = hsum_ps(acc3);
#else
    for (int j = 0; j < 4; j++) out[j * stride] = q8_0_block_dot(w, xq + j * cols, xd + j * blocks, blocks);
#endif
}

/* ---- Q5_0, Q4_K, Q5_K, Q6_K: each row's codes are unpacked once into bytes (u, unsigned), which then meet
 * every token's activations: one load and one dot per 32 values and token, whatever the bit layout. -------- */

static void unpack_q5_0(uint8_t *u, const uint8_t *qs, const uint32_t *qh, int64_t blocks) {
    for (int64_t b = 0; b < blocks; b++) {
#ifdef __AVX2__
        const __m128i raw = _mm_loadu_si128((const __m128i *)(qs + b * 16));
        const __m128i lo = _mm_and_si128(raw, _mm_set1_epi8(0x0F));
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0F));
        const __m256i high = _mm256_and_si256(bits_to_bytes(qh[b]), _mm256_set1_epi8(0x10));
        _mm256_storeu_si256((__m256i *)(u + b * QK), _mm256_or_si256(_mm256_set_m128i(hi, lo), high));
#else
        for (int i = 0; i < QK; i++) {
            const int nib = i < 16 ? qs[b * 16 + i] & 15 : qs[b * 16 + i - 16] >> 4;
            u[b * QK + i] = (uint8_t)(nib | (int)((qh[b] >> i) & 1u) << 4);
        }
#endif
    }
}

static void unpack_k4(uint8_t *u, const uint8_t *qs, const uint8_t *qh, int64_t supers) {
    for (int64_t k = 0; k < supers; k++) {
        const uint8_t *q = qs + k * 128, *h = qh ? qh + k * 32 : NULL;
        uint8_t *o = u + k * QK_K;
#ifdef __AVX2__
        const __m256i hv = h ? load256(h) : _mm256_setzero_si256(), one = _mm256_set1_epi8(1);
        for (int p = 0; p < 4; p++) {  /* fifth bits: bits 2p and 2p + 1 of each qh byte */
            const __m256i raw = load256(q + p * 32);
            __m256i u0 = nibbles_low(raw), u1 = nibbles_high(raw);
            if (h) {
                u0 = _mm256_or_si256(u0, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hv, 2 * p), one), 4));
                u1 = _mm256_or_si256(u1, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hv, 2 * p + 1), one), 4));
            }
            _mm256_storeu_si256((__m256i *)(o + 64 * p), u0);
            _mm256_storeu_si256((__m256i *)(o + 64 * p + 32), u1);
        }
#else
        for (int j = 0; j < 8; j++)
            for (int l = 0; l < 32; l++) {
                const uint8_t byte = q[j / 2 * 32 + l];
                int v = j % 2 ? byte >> 4 : byte & 15;
                if (h) v |= ((h[l] >> j) & 1) << 4;
                o[j * 32 + l] = (uint8_t)v;
            }
#endif
    }
}

static void unpack_q6_k(uint8_t *u, const uint8_t *ql, const uint8_t *qh, int64_t supers) {
    for (int64_t k = 0; k < supers; k++)
        for (int half = 0; half < 2; half++) {
            /* per half of 256: ql's 64 bytes give values 0-63 (low nibbles) and 64-127 (high); each qh byte
             * four 2-bit high parts, one per run of 32 */
            const uint8_t *l = ql + k * 128 + half * 64, *h = qh + k * 64 + half * 32;
            uint8_t *o = u + k * QK_K + half * 128;
#ifdef __AVX2__
            const __m256i mask4 = _mm256_set1_epi8(0x0F), mask2 = _mm256_set1_epi8(0x03);
            const __m256i l0 = load256(l), l1 = load256(l + 32), hv = load256(h);
            for (int c = 0; c < 4; c++) {
                const __m256i low = c % 2 ? l1 : l0;
                const __m256i nib = c < 2 ? _mm256_and_si256(low, mask4) : nibbles_high(low);
                const __m256i top = _mm256_and_si256(_mm256_srli_epi16(hv, 2 * c), mask2);
                _mm256_storeu_si256((__m256i *)(o + 32 * c), _mm256_or_si256(nib, _mm256_slli_epi16(top, 4)));
            }
#else
            for (int c = 0; c < 4; c++)
                for (int i = 0; i < 32; i++) {
                    const uint8_t lb = l[(c % 2) * 32 + i];
                    o[32 * c + i] = (uint8_t)((c < 2 ? lb & 15 : lb >> 4) | ((h[i] >> (2 * c)) & 3) << 4);
                }
#endif
        }
}

#ifdef __AVX2__
/* 8 lanes of sum(scale * u * x) over 32 values, scale per pair of bytes as int16 lanes: the K-quants' scales
 * folded into the widening add (u * x pairs fit int16 for u < 64), no separate multiply */
static inline __m256i scaled_dot32(const uint8_t *u, const int8_t *x, __m256i scale16) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(load256(u), load256(x)), scale16);
}
#endif

/* 8 lanes of sum(u x) over 32 values (plain C: lane 0 holds it all) */
#ifdef __AVX2__
typedef __m256i dot32_t;
static inline dot32_t dot32(const uint8_t *u, const int8_t *x) { return dot_u8_i8(load256(u), load256(x)); }
#else
typedef int dot32_t;
static inline dot32_t dot32(const uint8_t *u, const int8_t *x) {
    int s = 0;
    for (int i = 0; i < 32; i++) s += u[i] * x[i];
    return s;
}
#endif

/* Q5_0: sum((u - 16) x) = sum(u x) - 16 sum(x), per block of 32 */
static float q5_0_dot(const uint8_t *u, const float *d, const int8_t *xq, const float *xd, const int32_t *xs,
                      int64_t blocks) {
#ifdef __AVX2__
    static const uint8_t sixteen[QK] = {16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16,
                                        16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16};
    (void)xs;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        /* per lane (4 values) sum((u - 16) x), as llama.cpp's lanes hold it: the 16 x off each lane's own sum */
        const __m256i dot = _mm256_sub_epi32(dot32(u + b * QK, xq + b * QK), dot32(sixteen, xq + b * QK));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d[b] * xd[b]), acc);
    }
    return hsum_ps(acc);
#else
    float s = 0.f;
    for (int64_t b = 0; b < blocks; b++) s += (float)(dot32(u + b * QK, xq + b * QK) - 16 * xs[b]) * (d[b] * xd[b]);
    return s;
#endif
}

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
/* Q5_0 for one token straight from its blocks, two at a time in 512 bits (no unpacked copy): the same integer
 * per block and the same single accumulator, in block order, as q5_0_dot. */
static float q5_0_dot_packed(const uint8_t *qs, const uint32_t *qh, const float *d, const int8_t *xq,
                             const float *xd, const int32_t *xs, int64_t blocks) {
    const int64_t four = 0x0004000400040004LL;  /* per 16 bytes: shift the high nibbles' copies down by 4 */
    const __m512i shifts = _mm512_set_epi64(four, four, 0, 0, four, four, 0, 0);
    const __m512i low4 = _mm512_set1_epi8(0x0F), bit4 = _mm512_set1_epi8(0x10);
    (void)xs;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b += 2) {  /* an even number of blocks */
        const __m512i raw = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(qs + b * 16)));
        const __m512i nib = _mm512_and_si512(_mm512_srlv_epi16(_mm512_shuffle_i64x2(raw, raw, 0x50), shifts), low4);
        const __m512i u = _mm512_or_si512(nib, _mm512_maskz_mov_epi8((uint64_t)qh[b] | (uint64_t)qh[b + 1] << 32, bit4));
        const __m512i x = _mm512_loadu_si512(xq + b * QK);
        const __m512i dot = _mm512_sub_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u, x),
                                             _mm512_dpbusd_epi32(_mm512_setzero_si512(), bit4, x));  /* 16 x per lane */
        const __m256i lo = _mm512_castsi512_si256(dot), hi = _mm512_extracti32x8_epi32(dot, 1);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), _mm256_set1_ps(d[b] * xd[b]), acc);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), _mm256_set1_ps(d[b + 1] * xd[b + 1]), acc);
    }
    return hsum_ps(acc);
}
#endif

/* Tokens whose Q4_K products take llama.cpp's gemm order (below), NULL: none; set by ggml_set_q4_k_gemm_rows. */
static const int64_t *q4_k_gemm_rows = NULL;

/* flags: int64 per token of the next products, 1 where llama.cpp would run the token through its 4-row gemm
 * (the first n - n % 4 tokens of a batch of n), or NULL. */
void ggml_set_q4_k_gemm_rows(const int64_t *flags) { q4_k_gemm_rows = flags; }

/* Q4_K / Q5_K, per 256: d_x * (d * sum_j sc_j dot_j - dmin * sum_j mn_j xsum_j) over sub-blocks of 32.
 * Q4_K (`repacked`: llama.cpp's x86 builds repack Q4_K weights to q4_K_8x8, whose kernels sum differently from
 * its vec_dot): two accumulators, sum * (d d_x) and mins * (dmin d_x), the second taken from the first at the
 * end; one fma each per 256 (repacked 1: its gemv, a lone token or a batch's last n % 4) or per 64 (repacked 2:
 * its 4-row gemm). Q5_K: vec_dot_q5_K_q8_K's single sum. */
static float k4_dot(const uint8_t *u, const uint8_t *sc, const uint8_t *mn, const float *d, const float *dmin,
                    const int8_t *xq, const float *xd, const int32_t *xs, int64_t supers, int repacked) {
    float s = 0.f, s_min = 0.f;
    for (int64_t k = 0; k < supers; k++) {
        const uint8_t *scale = sc + k * 8, *low = mn + k * 8;
        const int32_t *bs = xs + k * 16;
        if (repacked == 2) {
            for (int p = 0; p < 4; p++) {
                int sum = 0, mins = 0;
                for (int j = 2 * p; j < 2 * p + 2; j++) {
#ifdef __AVX2__
                    sum += hsum_epi32(scaled_dot32(u + k * QK_K + 32 * j, xq + k * QK_K + 32 * j,
                                                   _mm256_set1_epi16(scale[j])));
#else
                    int dot = 0;
                    for (int i = 0; i < 32; i++) dot += u[k * QK_K + 32 * j + i] * xq[k * QK_K + 32 * j + i];
                    sum += scale[j] * dot;
#endif
                    mins += low[j] * (bs[2 * j] + bs[2 * j + 1]);
                }
                s = fmaf((float)sum, d[k] * xd[k], s);
                s_min = fmaf((float)mins, dmin[k] * xd[k], s_min);
            }
            continue;
        }
        int mins = 0;
        for (int j = 0; j < 8; j++) mins += low[j] * (bs[2 * j] + bs[2 * j + 1]);
#ifdef __AVX2__
        __m256i isum = _mm256_setzero_si256();
        for (int j = 0; j < 8; j++)
            isum = _mm256_add_epi32(isum, scaled_dot32(u + k * QK_K + 32 * j, xq + k * QK_K + 32 * j,
                                                       _mm256_set1_epi16(scale[j])));
        const int sum = hsum_epi32(isum);
#else
        int sum = 0;
        for (int j = 0; j < 8; j++) sum += scale[j] * dot32(u + k * QK_K + 32 * j, xq + k * QK_K + 32 * j);
#endif
        if (repacked) {
            s = fmaf((float)sum, d[k] * xd[k], s);
            s_min = fmaf((float)mins, dmin[k] * xd[k], s_min);
        } else {
            s += xd[k] * (d[k] * (float)sum - dmin[k] * (float)mins);
        }
    }
    return s - s_min;
}

/* Q6_K, per 256: d_x d sum_j sc_j (sum(u x) - 32 xsum_j) over 16 runs of 16. AVX2: as vec_dot_q6_K_q8_K's lanes
 * (lane i: values 4i .. 4i + 3 of every 32, the 32 x taken off each lane's own sum), one fma per 256 and lane. */
static float q6_k_dot(const uint8_t *u, const int8_t *sc, const float *d, const int8_t *xq, const float *xd,
                      const int32_t *xs, int64_t supers) {
#ifdef __AVX2__
    static const uint8_t thirty_two[32] = {32, 32, 32, 32, 32, 32, 32, 32, 32, 32, 32, 32, 32, 32, 32, 32,
                                           32, 32, 32, 32, 32, 32, 32, 32, 32, 32, 32, 32, 32, 32, 32, 32};
    (void)xs;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t k = 0; k < supers; k++) {
        const int8_t *scale = sc + k * 16;
        __m256i isum = _mm256_setzero_si256();
        for (int c = 0; c < 8; c++) {  /* 32 values: runs 2c and 2c + 1, four lanes each */
            const __m256i scales = _mm256_set_m128i(_mm_set1_epi16(scale[2 * c + 1]), _mm_set1_epi16(scale[2 * c]));
            const int8_t *x = xq + k * QK_K + 32 * c;
            isum = _mm256_add_epi32(isum, _mm256_sub_epi32(scaled_dot32(u + k * QK_K + 32 * c, x, scales),
                                                           scaled_dot32(thirty_two, x, scales)));
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(xd[k] * d[k]), _mm256_cvtepi32_ps(isum), acc);
    }
    return hsum_ps(acc);
#else
    float s = 0.f;
    for (int64_t k = 0; k < supers; k++) {
        const int8_t *scale = sc + k * 16;
        const int32_t *bs = xs + k * 16;
        int offset = 0;
        for (int j = 0; j < 16; j++) offset += scale[j] * bs[j];
        int sum = 0;
        for (int i = 0; i < QK_K; i++) sum += scale[i / 16] * u[k * QK_K + i] * xq[k * QK_K + i];
        s += xd[k] * d[k] * (float)(sum - 32 * offset);
    }
    return s;
#endif
}

int64_t ggml_matrix_fields(void) { return sizeof(struct ggml_matrix) / sizeof(int64_t); }

#define ARRAY(type, p, field) ((type)(intptr_t)(p)->field)

static void unpack_row(uint8_t *u, const struct ggml_part *w, int64_t r, int64_t cols) {
    if (w->kind == Q5_0)
        unpack_q5_0(u, ARRAY(const uint8_t *, w, qs) + r * cols / 2, ARRAY(const uint32_t *, w, qh) + r * cols / QK,
                    cols / QK);
    else if (w->kind == K4)
        unpack_k4(u, ARRAY(const uint8_t *, w, qs) + r * cols / 2, w->qh ? ARRAY(const uint8_t *, w, qh) + r * cols / 8
                  : NULL, cols / QK_K);
    else
        unpack_q6_k(u, ARRAY(const uint8_t *, w, qs) + r * cols / 2, ARRAY(const uint8_t *, w, qh) + r * cols / 4,
                    cols / QK_K);
}

static float row_dot(const uint8_t *u, const struct ggml_part *w, int64_t r, int64_t cols, const struct acts *a, int64_t t) {
    if (w->kind == Q5_0) {
        const int64_t blocks = cols / QK;
        return q5_0_dot(u, ARRAY(const float *, w, d) + r * blocks, a->q + t * cols, a->d + t * blocks,
                        a->sum + t * blocks, blocks);
    }
    const int64_t supers = cols / QK_K;
    const int8_t *xq = a->q + t * cols;
    const int32_t *xs = a->sum + t * cols / 16;
    if (w->kind == K4)
        return k4_dot(u, ARRAY(const uint8_t *, w, sc) + r * cols / 32, ARRAY(const uint8_t *, w, mn) + r * cols / 32,
                      ARRAY(const float *, w, d) + r * supers, ARRAY(const float *, w, dmin) + r * supers, xq,
                      a->d + t * supers, xs, supers, w->qh ? 0 : q4_k_gemm_rows && q4_k_gemm_rows[t] ? 2 : 1);
    return q6_k_dot(u, ARRAY(const int8_t *, w, sc) + r * cols / 16, ARRAY(const float *, w, d) + r * supers, xq,
                    a->d + t * supers, xs, supers);
}

/* Rows r0 .. r1 of one part for every token: out[t * stride + r]. `u`: scratch of cols bytes. */
static void part_rows(float *out, int64_t stride, const struct ggml_part *w, int64_t r0, int64_t r1, int64_t cols,
                      const struct acts *a, int64_t tokens, uint8_t *u) {
    if (w->kind == Q8_0) {  /* a row at a time (interleaving rows ran at half the speed), four tokens a pass */
        const int8_t *qs = ARRAY(const int8_t *, w, qs);
        const float *d = ARRAY(const float *, w, d);
        const int64_t blocks = cols / QK;
        for (int64_t r = r0; r < r1; r++) {
            int64_t t = 0;
            for (; t + 4 <= tokens; t += 4)
                q8_0_dot4(out + t * stride + r, stride, qs + r * cols, d + r * blocks, a->q + t * cols,
                          a->d + t * blocks, cols, blocks);
            for (; t < tokens; t++)
                out[t * stride + r] = q8_0_dot(qs + r * cols, d + r * blocks, a->q + t * cols, a->d + t * blocks, blocks);
        }
        return;
    }
    if (w->kind == Q8_0_BLOCKS) {  /* four tokens a pass over each row, then the rest one by one */
        const struct q8_0_block *blk = ARRAY(const struct q8_0_block *, w, qs);
        const int64_t blocks = cols / QK;
        for (int64_t r = r0; r < r1; r++) {
            int64_t t = 0;
            for (; t + 4 <= tokens; t += 4)
                q8_0_block_dot4(out + t * stride + r, stride, blk + r * blocks, a->q + t * cols, a->d + t * blocks,
                                cols, blocks);
            for (; t < tokens; t++)
                out[t * stride + r] = q8_0_block_dot(blk + r * blocks, a->q + t * cols, a->d + t * blocks, blocks);
        }
        return;
    }
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
    if (w->kind == Q5_0 && tokens == 1 && (cols / QK) % 2 == 0) {
        for (int64_t r = r0; r < r1; r++)
            out[r] = q5_0_dot_packed(ARRAY(const uint8_t *, w, qs) + r * cols / 2, ARRAY(const uint32_t *, w, qh) +
                                     r * cols / QK, ARRAY(const float *, w, d) + r * cols / QK, a->q, a->d, a->sum,
                                     cols / QK);
        return;
    }
#endif
    for (int64_t r = r0; r < r1; r++) {
        unpack_row(u, w, r, cols);
        for (int64_t t = 0; t < tokens; t++) out[t * stride + r] = row_dot(u, w, r, cols, a, t);
    }
}

/* Rows are dealt to threads in chunks as they come free, so a thread another process preempts holds up at
 * most its chunk (a static split waits for its whole share). */
#define CHUNK_ROWS 64

static int64_t matrix_rows(const struct ggml_matrix *m) {
    int64_t rows = 0;
    for (int64_t i = 0; i < m->parts; i++) rows += m->part[i].rows;
    return rows;
}

struct product { float *out; int64_t stride, cols, tokens; const struct ggml_part *w; const struct acts *a; };

static uint8_t *scratch(int64_t bytes) {  /* a thread's buffer for unpacked rows, kept for its next product */
    static _Thread_local uint8_t *buffer;
    static _Thread_local int64_t size;
    if (size < bytes) {
        free(buffer);
        buffer = malloc(bytes);
        size = bytes;
    }
    return buffer;
}

static void product_chunk(void *ctx, int64_t c) {
    const struct product *p = ctx;
    const int64_t r0 = c * CHUNK_ROWS, r1 = r0 + CHUNK_ROWS < p->w->rows ? r0 + CHUNK_ROWS : p->w->rows;
    part_rows(p->out, p->stride, p->w, r0, r1, p->cols, p->a, p->tokens, scratch(p->cols + 64));
}

static int takes_q8_0(int64_t kind) { return kind == Q8_0 || kind == Q8_0_BLOCKS || kind == Q5_0; }

void ggml_matrix_matmul_f32(float *out, const float *x, const struct ggml_matrix *m, int64_t tokens, int64_t cols,
                            int threads) {
    int need32 = 0, need256 = 0;
    for (int64_t i = 0; i < m->parts; i++) {
        if (takes_q8_0(m->part[i].kind)) need32 = 1;
        else need256 = 1;
    }
    struct acts a32 = {0}, a256 = {0};  /* each rounding once, shared by the parts that read it */
    if (need32) a32 = quantize(x, tokens, cols, QK, threads);
    if (need256) a256 = quantize(x, tokens, cols, QK_K, threads);
    const int64_t rows = matrix_rows(m);
    int64_t offset = 0;
    for (int64_t i = 0; i < m->parts; i++) {
        const struct ggml_part *w = &m->part[i];
        struct product p = {out + offset, rows, cols, tokens, w, takes_q8_0(w->kind) ? &a32 : &a256};
        const int64_t chunks = (w->rows + CHUNK_ROWS - 1) / CHUNK_ROWS;
        workshare_run(product_chunk, &p, chunks, threads_for(tokens, w->rows, cols, threads));
        offset += w->rows;
    }
    if (need32) free_acts(a32);
    if (need256) free_acts(a256);
}

static void one_part(float *out, const float *x, struct ggml_part p, int64_t tokens, int64_t cols, int threads) {
    struct ggml_matrix m = {1, {p}};
    ggml_matrix_matmul_f32(out, x, &m, tokens, cols, threads);
}

#define I(p) ((int64_t)(intptr_t)(p))

void ggml_q8_0_matmul_f32(float *out, const float *x, const int8_t *qs, const float *d, int64_t tokens,
                          int64_t rows, int64_t cols, int threads) {
    one_part(out, x, (struct ggml_part){Q8_0, rows, I(qs), 0, 0, 0, I(d), 0}, tokens, cols, threads);
}

void ggml_q8_0_blocks_matmul_f32(float *out, const float *x, const uint8_t *blocks, int64_t tokens, int64_t rows,
                                 int64_t cols, int threads) {
    one_part(out, x, (struct ggml_part){Q8_0_BLOCKS, rows, I(blocks), 0, 0, 0, 0, 0}, tokens, cols, threads);
}

void ggml_q5_0_matmul_f32(float *out, const float *x, const uint8_t *qs, const uint32_t *qh, const float *d,
                          int64_t tokens, int64_t rows, int64_t cols, int threads) {
    one_part(out, x, (struct ggml_part){Q5_0, rows, I(qs), I(qh), 0, 0, I(d), 0}, tokens, cols, threads);
}

void ggml_k4_matmul_f32(float *out, const float *x, const uint8_t *qs, const uint8_t *qh, const uint8_t *sc,
                        const uint8_t *mn, const float *d, const float *dmin, int64_t tokens, int64_t rows,
                        int64_t cols, int threads) {
    one_part(out, x, (struct ggml_part){K4, rows, I(qs), I(qh), I(sc), I(mn), I(d), I(dmin)}, tokens, cols, threads);
}

void ggml_q6_k_matmul_f32(float *out, const float *x, const uint8_t *ql, const uint8_t *qh, const int8_t *sc,
                          const float *d, int64_t tokens, int64_t rows, int64_t cols, int threads) {
    one_part(out, x, (struct ggml_part){Q6_K, rows, I(ql), I(qh), I(sc), 0, I(d), 0}, tokens, cols, threads);
}
