/* The token loops of the recurrent layers on the CPU: Mamba1's selective scan (prefill and the one-token step are
 * one kernel), Mamba2's one-token SSD step and the gated delta rule's one-token step (Gated DeltaNet's scalar gate,
 * KDA's per-channel one), each on a state pool [num_slots, ...] at per-sequence slots, a negative slot being padding
 * (zero output, state untouched). The math and layouts are kernels/ssm.py's and kernels/delta_rule.py's (their
 * torch forms are the references); states are fp32, activations fp32 or bf16, arithmetic fp32.
 *
 * Mamba1 runs LANES channels side by side: each token's update is, per state index n, LANES independent
 * h = exp(dt A) h + dt B x, and y = sum_n C h accumulates lane-wise, so the compiler's vectors (AVX-512 or AVX2,
 * whichever -march allows) hold channels and no horizontal sum is needed. A block's state [d_state, LANES] stays
 * in L1 along all of its sequence's tokens; a sequence of one token (a decode row) skips that transpose and
 * updates each channel's state row where it lies, d_state in the lanes. Mamba2's step and the delta rule work a
 * (row, head) at a time. The pieces of work are shared by workshare.c's helpers. Each entry point returns 0, or
 * -1 (nothing done) when a slot lies outside the pool.
 *
 * Measured on one thread of a busy 2-core AVX-512 machine, against the torch forms: a 512-token Mamba-130M scan
 * (1536 channels, d_state 16) 5.0 ms (torch 30-47 ms); a decode row of GDN or KDA (32 heads, 128 x 128) 0.09 ms
 * in place (torch 0.5 ms, gathering and scattering the states). */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "common.h"
#include "workshare.h"

#define LANES 16
#define CHUNK_CHANNELS 64    /* Mamba1: channels a work piece (a multiple of LANES) */
#define DELTA_COLS 32        /* delta rule: state columns a pass (d_k x 32 fp32: 16 KiB at d_k 128) */
#define MAX_DIM 256          /* d_state, d_k, d_v: the stack buffers' size (kernels/cpu.py checks) */

/* element i of an fp32 or bf16 array, as fp32 */
static inline float load1(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* n <= LANES elements to fp32 lanes, zeros past n (a full block keeps the vector loop) */
static inline void load_lanes(float *dst, const void *src, int64_t n, int bf16) {
    if (n == LANES && bf16) {
        for (int l = 0; l < LANES; l++) dst[l] = bf16_to_f32(((const uint16_t *)src)[l]);
    } else if (n == LANES) {
        memcpy(dst, src, sizeof(float) * LANES);
    } else {
        for (int l = 0; l < LANES; l++) dst[l] = l < n ? load1(src, l, bf16) : 0.f;
    }
}

static inline void load_row(float *dst, const void *src, int64_t n, int bf16) {
    if (bf16) {
        for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(((const uint16_t *)src)[i]);
    } else {
        memcpy(dst, src, sizeof(float) * n);
    }
}

static inline void store_row(void *dst, const float *src, int64_t n, int bf16) {
    if (bf16) {
        for (int64_t i = 0; i < n; i++) ((uint16_t *)dst)[i] = f32_to_bf16(src[i]);
    } else {
        memcpy(dst, src, sizeof(float) * n);
    }
}

static inline void *offset(void *p, int64_t elements, int bf16) {
    return (char *)p + elements * (bf16 ? 2 : 4);
}

static inline const void *coffset(const void *p, int64_t elements, int bf16) {
    return (const char *)p + elements * (bf16 ? 2 : 4);
}

/* exp(x) to about an ulp (Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-5 polynomial). common.h's
 * fast_expf scales x by log2(e) in one rounding, an error that grows with |x| (7e-6 relative near |x| = 27): along
 * a scan the state would drift by that much a token. r takes ln2 in two parts, as fused multiply-adds where the
 * target has them (the build's reassociation would merge the parts of plain products back into one), else in
 * double. Vectorises as well. */
static inline float exp_f32(float x) {
    x = x < -87.f ? -87.f : (x > 88.f ? 88.f : x);
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
#ifdef __FP_FAST_FMAF
    float r = __builtin_fmaf(-n, 0.693359375f, x);
    r = __builtin_fmaf(n, 2.12194440e-4f, r);
#else
    const float r = (float)((double)x - (double)n * 0.69314718055994531);
#endif
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    uint32_t bits;
    memcpy(&bits, &p, sizeof bits);
    bits += (uint32_t)(int32_t)n << 23;
    memcpy(&p, &bits, sizeof p);
    return p;
}

/* log(1 + w) for w >= 0, finite, to about an ulp (Cephes' logf on the mantissa in [sqrt(1/2), sqrt(2)), a
 * degree-9 polynomial in its offset from 1; below sqrt(2) that offset is w itself, not the rounded (1 + w) - 1,
 * whose absolute error of 6e-8 would be a large relative one for small w); unlike libm's log1pf it vectorises. */
static inline float log1p_pos(float w) {
    const float u = 1.f + w;
    uint32_t bits;
    memcpy(&bits, &u, sizeof bits);
    float e = (float)((int32_t)(bits >> 23) - 126);
    bits = (bits & 0x007FFFFFu) | 0x3F000000u;  /* mantissa in [0.5, 1) */
    float m;
    memcpy(&m, &bits, sizeof m);
    const int low = m < 0.70710678f;
    e = low ? e - 1.f : e;
    const float x = e == 0.f ? w : (low ? m + m - 1.f : m - 1.f);
    const float z = x * x;
    float p = 7.0376836292e-2f;
    p = p * x - 1.1514610310e-1f;
    p = p * x + 1.1676998740e-1f;
    p = p * x - 1.2420140846e-1f;
    p = p * x + 1.4249322787e-1f;
    p = p * x - 1.6668057665e-1f;
    p = p * x + 2.0000714765e-1f;
    p = p * x - 2.4999993993e-1f;
    p = p * x + 3.3333331174e-1f;
    const float y = p * x * z - 2.12194440e-4f * e - 0.5f * z;
    return x + y + 0.693359375f * e;
}

/* torch's softplus: log1p(exp(x)), x itself above 20 */
static inline float softplus(float x) {
    const float lp = log1p_pos(exp_f32(x));
    return x > 20.f ? x : lp;
}

static inline float silu(float z) { return z / (1.f + exp_f32(-z)); }

static int slots_fit(const int64_t *slots, int64_t n, int64_t num_slots) {
    for (int64_t i = 0; i < n; i++)
        if (slots[i] >= num_slots) return 0;
    return 1;
}

/* ---------------------------------------------------------------- Mamba1 selective scan */

typedef struct {
    const void *x, *dt, *z, *B, *C;      /* x, dt, z [tokens, d_inner]; B, C [tokens, d_state] */
    int64_t sx, sdt, sz, sB, sC;         /* their row strides, in elements */
    const float *A, *D, *dt_bias;        /* A [d_inner, d_state]; D, dt_bias [d_inner] or NULL */
    float *states;                       /* [num_slots, d_inner, d_state] */
    const int64_t *cu_seqlens, *slots;   /* cu_seqlens NULL: sequence i is token i alone (a decode batch) */
    void *y;                             /* [tokens, d_inner], dense */
    int64_t d_inner, d_state, chunks_per_seq;
    int bf16, dt_softplus;
} Mamba1Scan;

/* One sequence's tokens [start, end) through channels [d0, d0 + nl), nl <= LANES, from and to state row `slot`. */
static void mamba1_block(const Mamba1Scan *a, int64_t start, int64_t end, int64_t slot, int64_t d0, int64_t nl) {
    const int64_t S = a->d_state;
    const int bf16 = a->bf16;
    float h[MAX_DIM][LANES], At[MAX_DIM][LANES];  /* the state and A, transposed: lanes are channels */
    float *state = a->states + (slot * a->d_inner + d0) * S;
    for (int64_t n = 0; n < S; n++)
        for (int l = 0; l < LANES; l++) {
            h[n][l] = l < nl ? state[l * S + n] : 0.f;
            At[n][l] = l < nl ? a->A[(d0 + l) * S + n] : 0.f;
        }
    float bias[LANES] = {0}, D[LANES] = {0};
    for (int l = 0; l < nl; l++) {
        if (a->dt_bias) bias[l] = a->dt_bias[d0 + l];
        if (a->D) D[l] = a->D[d0 + l];
    }
    for (int64_t t = start; t < end; t++) {
        float dt[LANES], x[LANES], dtx[LANES], y[LANES] = {0}, z[LANES], b[MAX_DIM], c[MAX_DIM];
        load_lanes(dt, coffset(a->dt, t * a->sdt + d0, bf16), nl, bf16);
        load_lanes(x, coffset(a->x, t * a->sx + d0, bf16), nl, bf16);
        load_row(b, coffset(a->B, t * a->sB, bf16), S, bf16);
        load_row(c, coffset(a->C, t * a->sC, bf16), S, bf16);
        #pragma omp simd
        for (int l = 0; l < LANES; l++) dt[l] += bias[l];
        if (a->dt_softplus) {
            #pragma omp simd
            for (int l = 0; l < LANES; l++) dt[l] = softplus(dt[l]);
        }
        #pragma omp simd
        for (int l = 0; l < LANES; l++) dtx[l] = dt[l] * x[l];
        for (int64_t n = 0; n < S; n++) {
            #pragma omp simd
            for (int l = 0; l < LANES; l++) {
                h[n][l] = exp_f32(dt[l] * At[n][l]) * h[n][l] + dtx[l] * b[n];
                y[l] += h[n][l] * c[n];
            }
        }
        #pragma omp simd
        for (int l = 0; l < LANES; l++) y[l] += x[l] * D[l];
        if (a->z) {
            load_lanes(z, coffset(a->z, t * a->sz + d0, bf16), nl, bf16);
            #pragma omp simd
            for (int l = 0; l < LANES; l++) y[l] *= silu(z[l]);
        }
        store_row(offset(a->y, t * a->d_inner + d0, bf16), y, nl, bf16);
    }
    for (int64_t n = 0; n < S; n++)
        for (int l = 0; l < nl; l++) state[l * S + n] = h[n][l];
}

/* A sequence of one token (a decode row) on channels [d0, d0 + count): each channel's state row updated where it
 * lies, its d_state in the vector lanes; a transpose into lanes would cost more than the one token's update. */
static void mamba1_token(const Mamba1Scan *a, int64_t t, int64_t slot, int64_t d0, int64_t count) {
    const int64_t S = a->d_state;
    const int bf16 = a->bf16;
    float dt[CHUNK_CHANNELS], x[CHUNK_CHANNELS], y[CHUNK_CHANNELS], z[CHUNK_CHANNELS], b[MAX_DIM], c[MAX_DIM];
    load_row(dt, coffset(a->dt, t * a->sdt + d0, bf16), count, bf16);
    load_row(x, coffset(a->x, t * a->sx + d0, bf16), count, bf16);
    load_row(b, coffset(a->B, t * a->sB, bf16), S, bf16);
    load_row(c, coffset(a->C, t * a->sC, bf16), S, bf16);
    if (a->dt_bias)
        for (int64_t i = 0; i < count; i++) dt[i] += a->dt_bias[d0 + i];
    if (a->dt_softplus) {
        #pragma omp simd
        for (int64_t i = 0; i < count; i++) dt[i] = softplus(dt[i]);
    }
    for (int64_t i = 0; i < count; i++) {
        float *h = a->states + (slot * a->d_inner + d0 + i) * S, acc = 0.f;
        const float *A = a->A + (d0 + i) * S, dtx = dt[i] * x[i];
        #pragma omp simd reduction(+:acc)
        for (int64_t n = 0; n < S; n++) {
            h[n] = exp_f32(dt[i] * A[n]) * h[n] + dtx * b[n];
            acc += h[n] * c[n];
        }
        y[i] = acc + (a->D ? x[i] * a->D[d0 + i] : 0.f);
    }
    if (a->z) {
        load_row(z, coffset(a->z, t * a->sz + d0, bf16), count, bf16);
        #pragma omp simd
        for (int64_t i = 0; i < count; i++) y[i] *= silu(z[i]);
    }
    store_row(offset(a->y, t * a->d_inner + d0, bf16), y, count, bf16);
}

static void mamba1_chunk(void *ctx, int64_t chunk) {
    const Mamba1Scan *a = ctx;
    const int64_t seq = chunk / a->chunks_per_seq, first = chunk % a->chunks_per_seq * CHUNK_CHANNELS;
    const int64_t start = a->cu_seqlens ? a->cu_seqlens[seq] : seq;
    const int64_t end = a->cu_seqlens ? a->cu_seqlens[seq + 1] : seq + 1;
    const int64_t slot = a->slots[seq];
    if (slot < 0) return;  /* padding: its output rows stay zero */
    if (end - start == 1) {
        const int64_t count = a->d_inner - first < CHUNK_CHANNELS ? a->d_inner - first : CHUNK_CHANNELS;
        mamba1_token(a, start, slot, first, count);
        return;
    }
    for (int64_t d0 = first; d0 < first + CHUNK_CHANNELS && d0 < a->d_inner; d0 += LANES) {
        const int64_t nl = a->d_inner - d0 < LANES ? a->d_inner - d0 : LANES;
        mamba1_block(a, start, end, slot, d0, nl);
    }
}

/* Packed sequences (cu_seqlens [seqs + 1]) or one token a sequence (cu_seqlens NULL, seqs = tokens). */
int64_t mamba1_scan(void *y, const void *x, const void *dt, const void *z, const void *B, const void *C,
                    const int64_t *strides, const float *A, const float *D, const float *dt_bias, float *states,
                    const int64_t *cu_seqlens, const int64_t *slots, int64_t seqs, int64_t num_slots,
                    int64_t d_inner, int64_t d_state, int bf16, int dt_softplus, int threads) {
    if (!slots_fit(slots, seqs, num_slots)) return -1;
    Mamba1Scan a = {x, dt, z, B, C, strides[0], strides[1], strides[2], strides[3], strides[4], A, D, dt_bias,
                    states, cu_seqlens, slots, y, d_inner, d_state, (d_inner + CHUNK_CHANNELS - 1) / CHUNK_CHANNELS,
                    bf16, dt_softplus};
    workshare_run(mamba1_chunk, &a, seqs * a.chunks_per_seq, threads);
    return 0;
}

/* ---------------------------------------------------------------- Mamba2 one-token SSD step */

typedef struct {
    const void *x, *dt, *B, *C;          /* x [rows, heads, head_dim]; dt [rows, heads]; B, C [rows, groups, d_state] */
    int64_t sx0, sx1, sdt, sB0, sB1, sC0, sC1;
    const float *A, *D, *dt_bias;        /* [heads]; D, dt_bias may be NULL */
    float *states;                       /* [num_slots, heads, head_dim, d_state] */
    const int64_t *slots;
    void *y;                             /* [rows, heads, head_dim], dense */
    int64_t heads, head_dim, d_state, heads_per_group;
    float dt_min, dt_max;
    int bf16, dt_softplus;
} SsdStep;

static void ssd_chunk(void *ctx, int64_t chunk) {
    const SsdStep *a = ctx;
    const int64_t row = chunk / a->heads, head = chunk % a->heads, slot = a->slots[row];
    const int64_t P = a->head_dim, S = a->d_state, group = head / a->heads_per_group;
    const int bf16 = a->bf16;
    float out[MAX_DIM], x[MAX_DIM], b[MAX_DIM], c[MAX_DIM];
    if (slot < 0) return;  /* padding: its output stays zero */
    load_row(x, coffset(a->x, row * a->sx0 + head * a->sx1, bf16), P, bf16);
    load_row(b, coffset(a->B, row * a->sB0 + group * a->sB1, bf16), S, bf16);
    load_row(c, coffset(a->C, row * a->sC0 + group * a->sC1, bf16), S, bf16);
    float dt = load1(a->dt, row * a->sdt + head, bf16) + (a->dt_bias ? a->dt_bias[head] : 0.f);
    if (a->dt_softplus) dt = softplus(dt);
    dt = dt < a->dt_min ? a->dt_min : (dt > a->dt_max ? a->dt_max : dt);
    const float decay = exp_f32(dt * a->A[head]), skip = a->D ? a->D[head] : 0.f;
    float *state = a->states + (slot * a->heads + head) * P * S;
    for (int64_t p = 0; p < P; p++) {
        float *s = state + p * S, acc = 0.f;
        const float dtx = dt * x[p];
        #pragma omp simd reduction(+:acc)
        for (int64_t n = 0; n < S; n++) {
            s[n] = decay * s[n] + dtx * b[n];
            acc += s[n] * c[n];
        }
        out[p] = acc + x[p] * skip;
    }
    store_row(offset(a->y, (row * a->heads + head) * P, bf16), out, P, bf16);
}

/* strides: x's row and head strides, dt's row stride, B's and C's row and group strides (elements) */
int64_t ssd_step(void *y, const void *x, const void *dt, const void *B, const void *C, const int64_t *strides,
                 const float *A, const float *D, const float *dt_bias, float *states, const int64_t *slots,
                 int64_t rows, int64_t num_slots, int64_t heads, int64_t head_dim, int64_t d_state, int64_t groups,
                 float dt_min, float dt_max, int bf16, int dt_softplus, int threads) {
    if (!slots_fit(slots, rows, num_slots)) return -1;
    SsdStep a = {x, dt, B, C, strides[0], strides[1], strides[2], strides[3], strides[4], strides[5], strides[6],
                 A, D, dt_bias, states, slots, y, heads, head_dim, d_state, heads / groups, dt_min, dt_max, bf16,
                 dt_softplus};
    workshare_run(ssd_chunk, &a, rows * heads, threads);
    return 0;
}

/* ---------------------------------------------------------------- gated delta rule, one-token step */

typedef struct {
    const void *q, *k, *v;               /* q, k [rows, key_heads, d_k]; v [rows, heads, d_v] */
    int64_t sq0, sq1, sk0, sk1, sv0, sv1;
    const float *g, *beta;               /* g [rows, heads] or [rows, heads, d_k]; beta [rows, heads]; dense */
    float *states;                       /* [num_slots, heads, d_k, d_v] */
    const int64_t *slots;                /* NULL: row i's state is states[i] */
    void *o;                             /* [rows, heads, d_v], dense */
    int64_t heads, group, d_k, d_v;
    float scale;
    int bf16, scalar_gate, normalize_qk;
} DeltaStep;

#define L2NORM_EPS 1e-6f  /* kernels/delta_rule.py's */

static void prepare_key(float *dst, const void *src, int64_t n, int bf16, int normalize, float scale) {
    load_row(dst, src, n, bf16);
    float sum = 0.f;
    #pragma omp simd reduction(+:sum)
    for (int64_t i = 0; i < n; i++) sum += dst[i] * dst[i];
    const float inv = normalize ? 1.f / sqrtf(sum + L2NORM_EPS) : 1.f;
    for (int64_t i = 0; i < n; i++) dst[i] = dst[i] * inv * scale;
}

static void delta_chunk(void *ctx, int64_t chunk) {
    const DeltaStep *a = ctx;
    const int64_t row = chunk / a->heads, head = chunk % a->heads, kh = head / a->group;
    const int64_t slot = a->slots ? a->slots[row] : row, K = a->d_k, V = a->d_v;
    const int bf16 = a->bf16;
    float q[MAX_DIM], k[MAX_DIM], v[MAX_DIM], decay[MAX_DIM], read[MAX_DIM], out[MAX_DIM];
    if (slot < 0) return;  /* padding: its output stays zero */
    prepare_key(q, coffset(a->q, row * a->sq0 + kh * a->sq1, bf16), K, bf16, a->normalize_qk, a->scale);
    prepare_key(k, coffset(a->k, row * a->sk0 + kh * a->sk1, bf16), K, bf16, a->normalize_qk, 1.f);
    load_row(v, coffset(a->v, row * a->sv0 + head * a->sv1, bf16), V, bf16);
    const float *g = a->g + (row * a->heads + head) * (a->scalar_gate ? 1 : K);
    for (int64_t i = 0; i < K; i++) decay[i] = exp_f32(g[a->scalar_gate ? 0 : i]);
    const float beta = a->beta[row * a->heads + head];
    float *state = a->states + (slot * a->heads + head) * K * V;
    /* A block of DELTA_COLS columns at a time (the columns are independent), small enough to stay in L1 between
     * its two passes: S = diag(a) S and the read S^T k, then the update and the output. */
    for (int64_t j0 = 0; j0 < V; j0 += DELTA_COLS) {
        const int64_t w = V - j0 < DELTA_COLS ? V - j0 : DELTA_COLS;
        float *r = read + j0, *d = v + j0, *y = out + j0;
        for (int64_t j = 0; j < w; j++) r[j] = 0.f, y[j] = 0.f;
        for (int64_t i = 0; i < K; i++) {
            float *s = state + i * V + j0;
            for (int64_t j = 0; j < w; j++) {
                s[j] *= decay[i];
                r[j] += s[j] * k[i];
            }
        }
        for (int64_t j = 0; j < w; j++) d[j] = (d[j] - r[j]) * beta;  /* v becomes the delta */
        for (int64_t i = 0; i < K; i++) {
            float *s = state + i * V + j0;
            for (int64_t j = 0; j < w; j++) {
                s[j] += k[i] * d[j];
                y[j] += s[j] * q[i];
            }
        }
    }
    store_row(offset(a->o, (row * a->heads + head) * V, bf16), out, V, bf16);
}

/* strides: q's, k's and v's row and head strides (elements); q, k, v share a dtype (bf16 flag) and o takes it */
int64_t delta_rule_step(void *o, const void *q, const void *k, const void *v, const int64_t *strides, const float *g,
                        const float *beta, float *states, const int64_t *slots, int64_t rows, int64_t num_slots,
                        int64_t heads, int64_t key_heads, int64_t d_k, int64_t d_v, float scale, int bf16,
                        int scalar_gate, int normalize_qk, int threads) {
    if (slots && !slots_fit(slots, rows, num_slots)) return -1;
    DeltaStep a = {q, k, v, strides[0], strides[1], strides[2], strides[3], strides[4], strides[5], g, beta, states,
                   slots, o, heads, heads / key_heads, d_k, d_v, scale, bf16, scalar_gate, normalize_qk};
    workshare_run(delta_chunk, &a, rows * heads, threads);
    return 0;
}
