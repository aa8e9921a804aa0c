/* A GGML-quantized matrix as the callers hand it over (kernels/cpu.py's GGML_PART_FIELDS): up to MAX_PARTS runs
 * of rows, each of one type, stacked (a q/k/v projection whose parts came in two types). Every field is an int64
 * (pointers as integers), so Python builds it as a plain int64 array. The arrays are ggml_ops.c's layouts: Q8_0
 * (qs, d), Q5_0 (qs, qh, d), Q4_K / Q5_K (qs, qh or 0, sc, mn, d, dmin), Q6_K (ql as qs, qh, sc, d),
 * Q8_0_BLOCKS (GGUF's blocks as qs). */
#pragma once
#include <stdint.h>

enum ggml_kind { Q8_0, Q5_0, K4, Q6_K, Q8_0_BLOCKS };
#define MAX_PARTS 3
struct ggml_part { int64_t kind, rows, qs, qh, sc, mn, d, dmin; };
struct ggml_matrix { int64_t parts; struct ggml_part part[MAX_PARTS]; };

/* out [tokens, rows of every part] = x [tokens, cols] times the matrix's rows, as ggml_ops.c computes them. */
void ggml_matrix_matmul_f32(float *out, const float *x, const struct ggml_matrix *m, int64_t tokens, int64_t cols,
                            int threads);
