/* llama.cpp's CPU arithmetic for the parts of a Gemma 3 layer around its products (those are ggml_ops.c's), so a
 * GGUF run on the CPU follows llama.cpp (llama-cpp-python's defaults: no flash attention, an fp16 KV cache) bit for
 * bit: RMSNorm summed in double (ggml_compute_forward_rms_norm_f32), GELU from ggml's fp16 table
 * (ggml_vec_geglu_f32 with GGML_GELU_FP16), and attention as ggml computes mul_mat(k, q), soft_max_ext and
 * mul_mat(v, kq) with fp16 K, V, queries and probabilities. The summation orders are those of ggml's AVX-512
 * build (GGML_NATIVE on an AVX-512 machine, compiled by GCC): 16-lane accumulators reduced as GCC's
 * _mm512_reduce_add_ps does, four of them in ggml_vec_dot_f16 (a one-token batch), one in llamafile's tinyBLAS (a
 * batch of two or more), ggml_v_expf for the exponentials. Written as scalar lanes, so every ISA tier computes
 * the same bits. The whole file keeps each float operation as written: no reassociation, no contraction. */
#pragma GCC optimize("no-associative-math", "fp-contract=off")
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float f16_round(float x) { return (float)(_Float16)x; }

/* GCC's _mm512_reduce_add_ps: halves added, 256, 128, then pairs. */
static inline float reduce16(const float *a) {
    float t3[8], t6[4];
    for (int i = 0; i < 8; i++) t3[i] = a[8 + i] + a[i];
    for (int i = 0; i < 4; i++) t6[i] = t3[4 + i] + t3[i];
    const float t8_0 = t6[0] + t6[2], t8_1 = t6[1] + t6[3];
    return t8_0 + t8_1;
}

/* residual (if not NULL) = x + residual; out = x / sqrt(mean(x^2) + eps) * weight, the sum of squares in double. */
void ggml_rms_norm_f32(float *out, const float *x, float *residual, const float *weight, int64_t rows,
                       int64_t hidden, float eps, int threads) {
    (void)threads;
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * hidden;
        float *rr = residual ? residual + r * hidden : NULL;
        if (rr)
            for (int64_t i = 0; i < hidden; i++) rr[i] = xr[i] + rr[i];
        const float *src = rr ? rr : xr;
        double sum = 0.0;
        for (int64_t i = 0; i < hidden; i++) sum += (double)(src[i] * src[i]);
        const float mean = (float)(sum / (double)hidden);
        const float scale = 1.0f / sqrtf(mean + eps);
        float *o = out + r * hidden;
        for (int64_t i = 0; i < hidden; i++) o[i] = (src[i] * scale) * weight[i];
    }
}

static uint16_t gelu_table[1 << 16];

/* ggml_gelu_f32 as GCC builds it into llama.cpp's table (read from the native build's disassembly: the inner
 * 1 + a x x contracted into one fma). */
static inline float ggml_gelu(float x) {
    const float inner = fmaf(0.044715f * x, x, 1.0f);
    return (0.5f * x) * (1.0f + tanhf((0.79788456080286535587989211986876f * x) * inner));
}

__attribute__((constructor)) static void build_gelu_table(void) {
    for (uint32_t i = 0; i < (1u << 16); i++) {
        const uint16_t bits = (uint16_t)i;
        _Float16 h, g;
        memcpy(&h, &bits, sizeof h);
        g = (_Float16)ggml_gelu((float)h);
        memcpy(&gelu_table[i], &g, sizeof g);
    }
}

static inline float table_gelu(float x) {
    const _Float16 h = (_Float16)x;
    uint16_t bits;
    memcpy(&bits, &h, sizeof bits);
    _Float16 g;
    memcpy(&g, &gelu_table[bits], sizeof g);
    return (float)g;
}

/* out = gelu(gate) * up over [rows, 2 * width] = [gate | up] rows. */
void ggml_geglu_f32(float *out, const float *gate_up, int64_t rows, int64_t width, int threads) {
    (void)threads;
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * width, *u = g + width;
        float *o = out + r * width;
        for (int64_t i = 0; i < width; i++) {
            const float x = g[i];
            o[i] = x <= -10.0f ? 0.0f : x >= 10.0f ? x * u[i] : table_gelu(x) * u[i];
        }
    }
}

/* ggml_v_expf, one lane (the caller handles -inf: 0). */
static inline float v_expf(float x) {
    const float r = 0x1.8p23f;
    const float z = fmaf(x, 0x1.715476p+0f, r);
    const float n = z - r;
    const float b = fmaf(-n, 0x1.7f7d1cp-20f, fmaf(-n, 0x1.62e4p-1f, x));
    const float u = b * b;
    const float j = fmaf(fmaf(fmaf(0x1.0e4020p-7f, b, 0x1.573e2ep-5f), u, fmaf(0x1.555e66p-3f, b, 0x1.fffdb6p-2f)),
                         u, fmaf(0x1.ffffecp-1f, b, 1.0f));
    if (fabsf(n) > 192.0f) return n <= 0.0f ? 0.0f : INFINITY;
    return ldexpf(j, (int)n);
}

/* A dot product of fp16 values held as fp32: `gemm`, one 16-lane accumulator (tinyBLAS); else four
 * (ggml_vec_dot_f16), the tail past the last 64 in double. */
static inline float dot_order(const float *x, const float *y, int64_t n, int gemm) {
    if (gemm) {
        float acc[16] = {0};
        for (int64_t i = 0; i < n; i += 16)
            for (int l = 0; l < 16; l++) acc[l] = fmaf(x[i + l], y[i + l], acc[l]);
        return reduce16(acc);
    }
    float acc[4][16] = {{0}};
    const int64_t np = n & ~(int64_t)63;
    for (int64_t i = 0; i < np; i += 64)
        for (int a = 0; a < 4; a++)
            for (int l = 0; l < 16; l++) acc[a][l] = fmaf(x[i + 16 * a + l], y[i + 16 * a + l], acc[a][l]);
    for (int l = 0; l < 16; l++) {
        acc[0][l] = acc[0][l] + acc[2][l];
        acc[1][l] = acc[1][l] + acc[3][l];
        acc[0][l] = acc[0][l] + acc[1][l];
    }
    double sum = (double)reduce16(acc[0]);
    for (int64_t i = np; i < n; i++) sum += (double)(x[i] * y[i]);
    return (float)sum;
}

/* Paged attention as llama.cpp computes it, one query token a row. q, out: [rows, heads, dim]; k_cache, v_cache:
 * [blocks, block_size, kv_heads, dim] fp32 holding fp16 values; row r attends to its sequence's first lens[r]
 * tokens (token i in cache slot tables[r][i / block_size] * block_size + i % block_size, at llama.cpp's KV cell i),
 * the last `window` of them where window > 0. gemm[r]: the token came in a batch of two or more (tinyBLAS order)
 * or alone (ggml_vec_dot_f16 order, whose tail depends on the cache's padded length: a multiple of 32). */
void ggml_attention_f32(float *out, const float *q, const float *k_cache, const float *v_cache,
                        const int64_t *tables, const int64_t *lens, const int64_t *gemm, int64_t rows, int64_t heads,
                        int64_t kv_heads, int64_t dim, int64_t block_size, int64_t max_blocks, int64_t window,
                        float scale, int threads) {
    const int64_t group = heads / kv_heads, row = kv_heads * dim;
    _Pragma("omp parallel for schedule(dynamic, 1) num_threads(threads) if(rows * heads > 4)")
    for (int64_t rh = 0; rh < rows * heads; rh++) {
        const int64_t r = rh / heads, h = rh % heads, kvh = h / group;
        const int64_t len = lens[r], first = window > 0 && len > window ? len - window : 0;
        const int64_t n_kv = len <= 32 ? 32 : (len + 31) / 32 * 32;
        const int g = (int)gemm[r];
        const int64_t *table = tables + r * max_blocks;
        float *qh = malloc(sizeof(float) * dim), *p = malloc(sizeof(float) * n_kv);
        for (int64_t d = 0; d < dim; d++) qh[d] = f16_round(q[(r * heads + h) * dim + d] * scale);
        float max = -INFINITY;
        for (int64_t j = 0; j < n_kv; j++) {
            if (j < first || j >= len) { p[j] = -INFINITY; continue; }
            const float *k = k_cache + (table[j / block_size] * block_size + j % block_size) * row + kvh * dim;
            p[j] = dot_order(k, qh, dim, g);
            max = p[j] > max ? p[j] : max;
        }
        double sum = 0.0;
        for (int64_t b = 0; b < n_kv; b += 16) {
            for (int64_t j = b; j < b + 16; j++) p[j] = p[j] == -INFINITY ? 0.0f : v_expf(p[j] - max);
            sum += (double)reduce16(p + b);
        }
        const float inv = (float)(1.0 / sum);
        for (int64_t j = 0; j < n_kv; j++) p[j] = f16_round(p[j] * inv);
        /* the PV product, lanes over the context as in dot_order, vectorised over the head's dims */
        float *o = out + (r * heads + h) * dim;
        const int64_t lanes = g ? 16 : 64, np = g ? n_kv : n_kv & ~(int64_t)63;
        float *acc = calloc((size_t)(lanes * dim), sizeof(float));
        for (int64_t j = first; j < len && j < np; j++) {
            const float *v = v_cache + (table[j / block_size] * block_size + j % block_size) * row + kvh * dim;
            float *a = acc + (j % lanes) * dim;
            const float pj = p[j];
            for (int64_t d = 0; d < dim; d++) a[d] = fmaf(v[d], pj, a[d]);
        }
        float lane[16];
        for (int64_t d = 0; d < dim; d++) {
            if (g) {
                for (int l = 0; l < 16; l++) lane[l] = acc[l * dim + d];
                o[d] = reduce16(lane);
                continue;
            }
            for (int l = 0; l < 16; l++) {
                const float a0 = acc[l * dim + d], a1 = acc[(16 + l) * dim + d];
                const float a2 = acc[(32 + l) * dim + d], a3 = acc[(48 + l) * dim + d];
                lane[l] = (a0 + a2) + (a1 + a3);
            }
            double sum = (double)reduce16(lane);
            for (int64_t j = np > first ? np : first; j < len; j++)
                sum += (double)(v_cache[(table[j / block_size] * block_size + j % block_size) * row + kvh * dim + d]
                                * p[j]);
            o[d] = (float)sum;
        }
        free(acc);
        free(qh);
        free(p);
    }
}

/* ggml's rope tables (ggml_rope_cache_init, no YaRN): for position p, theta_0 = p * freq_scale and each next
 * frequency's theta the previous one times powf(base, -2 / dims), in float; cos, sin: [positions, half]. */
void ggml_rope_tables(float *cos, float *sin, int64_t positions, int64_t half, float base, float freq_scale) {
    const float theta_scale = powf(base, -2.0f / (float)(2 * half));
    for (int64_t p = 0; p < positions; p++) {
        float theta = (float)p;
        for (int64_t i = 0; i < half; i++) {
            const float t = freq_scale * theta;
            cos[p * half + i] = cosf(t);
            sin[p * half + i] = sinf(t);
            theta *= theta_scale;
        }
    }
}

/* ggml's NeoX rope (ggml_compute_forward_rope_f32) in place, as GCC builds it: x0 cos - x1 sin and x0 sin + x1 cos
 * each one fma over the rounded second product. Arguments as cpu_ops.c's rotary_f32 (rot_dim = head_dim). */
void ggml_rotary_f32(float *x, const float *cos, const float *sin, int64_t tokens, int64_t heads, int64_t head_dim,
                     int64_t rot_dim, int64_t token_stride, int threads) {
    (void)threads;
    const int64_t half = rot_dim / 2;
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos + t * half, *s = sin + t * half;
        for (int64_t h = 0; h < heads; h++) {
            float *v = x + t * token_stride + h * head_dim;
            for (int64_t i = 0; i < half; i++) {
                const float x0 = v[i], x1 = v[i + half];
                v[i] = fmaf(x0, c[i], -(x1 * s[i]));
                v[i + half] = fmaf(x0, s[i], x1 * c[i]);
            }
        }
    }
}
