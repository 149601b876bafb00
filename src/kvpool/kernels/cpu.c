/* Fused fp32 CPU kernels for the Llama decode path (kvpool/kernels/__init__.py builds and
 * loads this file with the machine's C compiler; each function has a torch twin there).
 *
 * Why they exist: at batch 1 a SmolLM2-135M step reads ~540 MB of fp32 weights (~22 ms at
 * this machine's ~24 GB/s), and everything between the matmuls is microseconds of work
 * behind ~5-30 us of dispatch per torch op: F.rms_norm alone is ~17 us a call, 61 calls a
 * step, against ~2 us for one C call through ctypes (`kvpool bench engine --parts glue`).
 *
 * Conventions: every tensor is fp32 (indices int64), rows may be strided (row_stride in
 * elements), everything else is contiguous. Work large enough to pay for waking threads
 * (long decode contexts, prefill chunks) runs on torch's own OpenMP pool: built with
 * -fopenmp, this library needs libgomp.so.1, and the loader hands it the copy that torch
 * already loaded (same soname), so there is one pool and one thread count. No -ffast-math
 * (IEEE results, NaN kept): reductions vectorise through explicit lane arrays instead, and
 * exp is the Cephes polynomial below, written so it vectorises.
 * Functions that index the pool return 0, or a negative code for a bad index (nothing
 * written); the Python side turns that into an error.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
static int64_t max_threads(int parallel) { return parallel ? omp_get_max_threads() : 1; }
static int64_t thread_id(void) { return omp_get_thread_num(); }
int kv_openmp(void) { return 1; }
#else
static int64_t max_threads(int parallel) { (void)parallel; return 1; }
static int64_t thread_id(void) { return 0; }
int kv_openmp(void) { return 0; }
#endif

#define LANES 16
/* Below this many multiply-adds a call stays on one thread: waking the pool costs more. */
#define PARALLEL_MIN_WORK (1 << 18)

/* exp(x), within 1 ulp for x in [-87.3, 88] (clamped to that range: softmax arguments are
 * <= 0, and silu(g) = g / (1 + exp(-g)) needs no more). Cephes expf: x = n ln2 + r,
 * |r| <= ln2 / 2, exp(r) by a degree-7 polynomial, 2^n through the exponent bits. No
 * branches, libm calls or type-punning unions, so that GCC vectorises the loops calling it
 * (with -fno-trapping-math: the clamps are then selects, not control flow). */
static inline float exp_poly(float x) {
    x = x < -87.33654f ? -87.33654f : x;
    x = x > 88.0f ? 88.0f : x;
    int32_t ni = (int32_t)(x * 1.44269504088896341f + 128.5f) - 128; /* floor(x log2(e) + 1/2) */
    float n = (float)ni;
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = (ni + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

static float sum_squares(const float *x, int64_t n) {
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += x[i + l] * x[i + l];
    float s = 0.0f;
    for (int l = 0; l < LANES; l++) s += acc[l];
    for (; i < n; i++) s += x[i] * x[i];
    return s;
}

static float sum_values(const float *x, int64_t n) {
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += x[i + l];
    float s = 0.0f;
    for (int l = 0; l < LANES; l++) s += acc[l];
    for (; i < n; i++) s += x[i];
    return s;
}

static float max_value(const float *x, int64_t n) { /* n >= 1 */
    float acc[LANES];
    for (int l = 0; l < LANES; l++) acc[l] = x[0];
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) acc[l] = x[i + l] > acc[l] ? x[i + l] : acc[l];
    float m = acc[0];
    for (int l = 1; l < LANES; l++) m = acc[l] > m ? acc[l] : m;
    for (; i < n; i++) m = x[i] > m ? x[i] : m;
    return m;
}

/* x [n, hidden] (+)= delta [n, hidden] (when delta is not NULL), then
 * out [n, hidden] = x / sqrt(mean(x^2) + eps) * w: the residual add fused with the next norm. */
void kv_add_rms_norm(float *x, const float *delta, const float *w, float *out, int64_t n, int64_t hidden, float eps) {
#pragma omp parallel for schedule(static) if (n * hidden >= PARALLEL_MIN_WORK)
    for (int64_t r = 0; r < n; r++) {
        float *xr = x + r * hidden;
        if (delta) {
            const float *dr = delta + r * hidden;
            for (int64_t i = 0; i < hidden; i++) xr[i] += dr[i];
        }
        float inv = 1.0f / sqrtf(sum_squares(xr, hidden) / (float)hidden + eps);
        float *o = out + r * hidden;
        for (int64_t i = 0; i < hidden; i++) o[i] = (xr[i] * inv) * w[i];
    }
}

/* RMSNorm in place over each head of the first hq + hk heads of each row of x [n, row_stride]
 * (heads of d values): heads [0, hq) scaled by wq [d], heads [hq, hq + hk) by wk [d]; Qwen3's
 * q / k norms on the qkv rows before RoPE, as kv_add_rms_norm rounds a row. */
void kv_head_rms_norm(float *x, int64_t n, int64_t row_stride, int64_t hq, int64_t hk, int64_t d, const float *wq,
                      const float *wk, float eps) {
#pragma omp parallel for schedule(static) if (n * (hq + hk) * d >= PARALLEL_MIN_WORK)
    for (int64_t r = 0; r < n; r++) {
        for (int64_t h = 0; h < hq + hk; h++) {
            float *v = x + r * row_stride + h * d;
            const float *w = h < hq ? wq : wk;
            float inv = 1.0f / sqrtf(sum_squares(v, d) / (float)d + eps);
            for (int64_t i = 0; i < d; i++) v[i] = (v[i] * inv) * w[i];
        }
    }
}

/* Rotate-half RoPE in place on the first `heads` heads of each row of x [n, row_stride]:
 * v = v * cos + [v2 | v1] * sin_signed, cos / sin_signed [max_position, d] (sin_signed is
 * [-sin | +sin]), row r at position pos[r]. Returns -1 (nothing rotated) for a position
 * outside [0, max_position). */
int kv_rope(float *x, int64_t n, int64_t row_stride, int64_t heads, int64_t d, const int64_t *pos,
            const float *cos_table, const float *sin_table, int64_t max_position) {
    int64_t half = d / 2;
    for (int64_t r = 0; r < n; r++)
        if (pos[r] < 0 || pos[r] >= max_position) return -1;
    for (int64_t r = 0; r < n; r++) {
        const float *c = cos_table + pos[r] * d;
        const float *s = sin_table + pos[r] * d;
        for (int64_t h = 0; h < heads; h++) {
            float *v = x + r * row_stride + h * d;
            for (int64_t i = 0; i < half; i++) {
                float a = v[i], b = v[i + half];
                v[i] = a * c[i] + b * s[i];
                v[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
    }
    return 0;
}

/* Store n tokens' K / V, rows of k and v [n, kvh, d] (row stride in elements), into the
 * layer's pool at slots[r] = block * bs + offset:
 *   k_cache [num_blocks, kvh, d, bs]  (K^T per block)     v_cache [num_blocks, kvh, bs, d]
 * Returns -1 (nothing written) if a slot lies outside the pool. */
int kv_write(const float *k, const float *v, int64_t n, int64_t row_stride, int64_t kvh, int64_t d,
             const int64_t *slots, int64_t bs, int64_t num_blocks, float *k_cache, float *v_cache) {
    for (int64_t r = 0; r < n; r++)
        if (slots[r] < 0 || slots[r] >= num_blocks * bs) return -1;
    for (int64_t r = 0; r < n; r++) {
        int64_t block = slots[r] / bs, off = slots[r] % bs;
        for (int64_t h = 0; h < kvh; h++) {
            const float *kr = k + r * row_stride + h * d;
            float *kb = k_cache + (block * kvh + h) * d * bs + off;
            for (int64_t i = 0; i < d; i++) kb[i * bs] = kr[i];
            memcpy(v_cache + ((block * kvh + h) * bs + off) * d, v + r * row_stride + h * d, (size_t)d * sizeof(float));
        }
    }
    return 0;
}

/* 8-float vectors (GCC / clang vector extensions: AVX on x86, NEON on ARM). Used where
 * the auto-vectoriser keeps sums in memory; the unaligned type loads any float address. */
typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));
static inline v8 load8(const float *p) { return *(const v8u *)p; }
static inline void store8(float *p, v8 x) { *(v8u *)p = x; }

/* Scores of one block: s[t] = sum_i q[i] K^T[i, t] for t < bs, kt [d, bs]. In 16-slot
 * strips, the sums in registers: eight accumulators (two halves x i mod 4) so that
 * the FMAs overlap instead of waiting on each other. Block sizes that are not a multiple
 * of 16 take the plain loop. */
static void block_scores(const float *restrict q, const float *restrict kt, int64_t d, int64_t bs, float *restrict s) {
    if (bs % 16 != 0) {
        for (int64_t t = 0; t < bs; t++) s[t] = 0.0f;
        for (int64_t i = 0; i < d; i++)
            for (int64_t t = 0; t < bs; t++) s[t] += q[i] * kt[i * bs + t];
        return;
    }
    for (int64_t t0 = 0; t0 < bs; t0 += 16) {
        v8 lo[4] = {0}, hi[4] = {0};
        const float *k = kt + t0;
        int64_t i = 0;
        for (; i + 4 <= d; i += 4)
            for (int u = 0; u < 4; u++) {
                lo[u] += q[i + u] * load8(k + (i + u) * bs);
                hi[u] += q[i + u] * load8(k + (i + u) * bs + 8);
            }
        for (; i < d; i++) {
            lo[0] += q[i] * load8(k + i * bs);
            hi[0] += q[i] * load8(k + i * bs + 8);
        }
        store8(s + t0, (lo[0] + lo[1]) + (lo[2] + lo[3]));
        store8(s + t0 + 8, (hi[0] + hi[1]) + (hi[2] + hi[3]));
    }
}

/* o[i] += sum_t p[t] V[t, i] for t < slots, v [bs, d]: 64-dim strips held in registers
 * across the block's slots (the plain loop would load and store o for every slot). */
static void block_weighted_sum(const float *restrict p, const float *restrict v, int64_t slots, int64_t d,
                               float *restrict o) {
    int64_t i0 = 0;
    for (; i0 + 64 <= d; i0 += 64) {
        v8 acc[8] = {0};
        for (int64_t t = 0; t < slots; t++)
            for (int u = 0; u < 8; u++) acc[u] += p[t] * load8(v + t * d + i0 + 8 * u);
        for (int u = 0; u < 8; u++) store8(o + i0 + 8 * u, load8(o + i0 + 8 * u) + acc[u]);
    }
    for (int64_t t = 0; t < slots; t++)
        for (int64_t i = i0; i < d; i++) o[i] += p[t] * v[t * d + i];
}

/* The decode kernels' arguments, checked before anything is read or written: the CSR
 * tables (blocks[] is read only within [0, nnz)), each table covering exactly its context,
 * block ids inside the pool, query rows inside q and strictly increasing (no two sequences,
 * or threads, write one output row). *width: the longest table's slots. Returns 0, or the
 * error codes of kv_decode_attention. */
static int check_tables(int64_t num_rows, const int64_t *rows, int64_t num_seqs, const int64_t *indptr, int64_t nnz,
                        const int64_t *blocks, const int64_t *ctx_lens, int64_t num_blocks, int64_t bs,
                        int64_t *width) {
    if (indptr[0] != 0 || indptr[num_seqs] != nnz) return -2;
    for (int64_t b = 0; b < num_seqs; b++)
        if (indptr[b + 1] < indptr[b] || indptr[b + 1] > nnz) return -2;
    for (int64_t b = 0; b < num_seqs; b++) {
        if (rows[b] < 0 || rows[b] >= num_rows || (b > 0 && rows[b] <= rows[b - 1])) return -4;
        int64_t nb = indptr[b + 1] - indptr[b];
        if (ctx_lens[b] <= 0 || nb * bs < ctx_lens[b] || (nb - 1) * bs >= ctx_lens[b]) return -2;
        for (int64_t j = indptr[b]; j < indptr[b + 1]; j++)
            if (blocks[j] < 0 || blocks[j] >= num_blocks) return -1;
        if (nb * bs > *width) *width = nb * bs;
    }
    return 0;
}

/* s[0, len) -> softmax(s) in place (len >= 1). */
static void softmax_in_place(float *s, int64_t len) {
    float m = max_value(s, len);
    for (int64_t t = 0; t < len; t++) s[t] = exp_poly(s[t] - m);
    float inv = 1.0f / sum_values(s, len);
    for (int64_t t = 0; t < len; t++) s[t] *= inv;
}

/* Whether a decode batch is worth spreading over threads: its work is the keys it reads,
 * summed over the sequences, times H heads of d. */
static int decode_in_parallel(int64_t num_seqs, const int64_t *ctx_lens, int64_t heads, int64_t d) {
    int64_t total = 0;
    for (int64_t b = 0; b < num_seqs; b++) total += ctx_lens[b];
    return total * heads * d >= PARALLEL_MIN_WORK;
}

/* The G query heads of one KV head, scaled: qs [g_size * d] = scale * qh [g_size * d]. */
static void scaled_queries(const float *restrict qh, int64_t n, float scale, float *restrict qs) {
    for (int64_t x = 0; x < n; x++) qs[x] = qh[x] * scale;
}

/* The G heads' scores [g_size, width] -> softmax over [0, len) each, and their output rows
 * o [g_size, d] zeroed for the weighted sums that follow. */
static void softmax_heads(float *scores, int64_t g_size, int64_t width, int64_t len, float *restrict o, int64_t d) {
    for (int64_t g = 0; g < g_size; g++) {
        softmax_in_place(scores + g * width, len);
        for (int64_t i = 0; i < d; i++) o[g * d + i] = 0.0f;
    }
}

/* A decode batch's query side, as both decode kernels take it (kv_decode_attention says
 * what each argument holds). */
typedef struct {
    const float *q;
    int64_t q_row_stride;
    const int64_t *rows, *indptr, *blocks, *ctx_lens;
    float *out;
    int64_t out_row_stride, kvh, g_size, d;
    float scale;
} decode_batch;

/* One work item of a decode batch: sequence b's KV head kh. */
typedef struct {
    int64_t b, nb, len;   /* the sequence, its blocks, its keys */
    const int64_t *table; /* its block ids [nb] */
    float *o;             /* its G query heads' output rows [g_size, d] */
} decode_item;

/* Work item `item` (sequence item / kvh, KV head item % kvh), its G query heads scaled
 * into qs [g_size * d]. */
static inline decode_item begin_item(const decode_batch *x, int64_t item, float *restrict qs) {
    int64_t b = item / x->kvh, kh = item % x->kvh, head0 = kh * x->g_size * x->d;
    decode_item it = {b, x->indptr[b + 1] - x->indptr[b], x->ctx_lens[b], x->blocks + x->indptr[b],
                      x->out + x->rows[b] * x->out_row_stride + head0};
    scaled_queries(x->q + x->rows[b] * x->q_row_stride + head0, x->g_size * x->d, x->scale, qs);
    return it;
}

/* Decode attention, one query per sequence, straight from the pool in any block order.
 * Sequence b: query row rows[b] of q [*, q_row_stride] holding H heads of d; its blocks
 * blocks[indptr[b] .. indptr[b+1]) cover keys [0, ctx_lens[b]); output row rows[b] of
 * out [*, out_row_stride]. GQA: query heads [kh * G, kh * G + G) read KV head kh, so each
 * K^T row (bs floats) and V row (d floats) is loaded once for its G heads.
 *   scores[g, t] = scale * sum_i q[g, i] K^T[block(t), kh, i, slot(t)]     (vector over slots)
 *   out[g, :]    = sum_t softmax(scores[g])[t] V[block(t), kh, slot(t), :]  (vector over d)
 * Returns -1 for a block id outside the pool, -2 for a table that does not cover its
 * context, -3 when out of memory, -4 for a query row outside [0, num_rows) or rows not
 * strictly increasing; nothing is written then. */
int kv_decode_attention(const float *q, int64_t q_row_stride, int64_t num_rows, const int64_t *rows, int64_t num_seqs,
                        const int64_t *indptr, int64_t nnz, const int64_t *blocks, const int64_t *ctx_lens,
                        const float *restrict k_cache, const float *restrict v_cache, int64_t num_blocks, int64_t heads,
                        int64_t kvh, int64_t d, int64_t bs, float scale, float *restrict out, int64_t out_row_stride) {
    int64_t g_size = heads / kvh, width = 0;
    int rc = check_tables(num_rows, rows, num_seqs, indptr, nnz, blocks, ctx_lens, num_blocks, bs, &width);
    if (rc) return rc;
    /* One work item per (sequence, KV head), shared over torch's OpenMP threads when there
     * is enough of it: the pool of libgomp.so.1 that torch loaded, not a second one. */
    int parallel = decode_in_parallel(num_seqs, ctx_lens, heads, d);
    int64_t per_thread = g_size * width + g_size * d; /* scores, then the G scaled queries */
    /* every thread's buffer allocated before any output is written: an allocation failure
     * leaves out untouched */
    float *buffers = malloc((size_t)(max_threads(parallel) * per_thread) * sizeof(float));
    if (!buffers) return -3;
    const decode_batch batch = {q, q_row_stride, rows, indptr, blocks, ctx_lens,
                                out, out_row_stride, kvh, g_size, d, scale};
#pragma omp parallel if (parallel)
    {
        float *restrict scores = buffers + thread_id() * per_thread;
        float *restrict qs = scores + g_size * width;
#pragma omp for schedule(static)
        for (int64_t item = 0; item < num_seqs * kvh; item++) {
            decode_item it = begin_item(&batch, item, qs);
            int64_t kh = item % kvh, nb = it.nb, len = it.len;
            for (int64_t j = 0; j < nb; j++) {
                const float *kt = k_cache + (it.table[j] * kvh + kh) * d * bs; /* [d, bs] */
                for (int64_t g = 0; g < g_size; g++) block_scores(qs + g * d, kt, d, bs, scores + g * width + j * bs);
            }
            softmax_heads(scores, g_size, width, len, it.o, d);
            for (int64_t g = 0; g < g_size; g++)
                for (int64_t j = 0; j < nb; j++) {
                    const float *vb = v_cache + (it.table[j] * kvh + kh) * bs * d; /* [bs, d] */
                    int64_t slots = len - j * bs < bs ? len - j * bs : bs;
                    block_weighted_sum(scores + g * width + j * bs, vb, slots, d, it.o + g * d);
                }
        }
    }
    free(buffers);
    return 0;
}

/* out [n, inter] = silu(gate) * up for gate_up [n, 2 * inter] = [gate | up] per row. */
void kv_silu_mul(const float *restrict gate_up, float *restrict out, int64_t n, int64_t inter) {
#pragma omp parallel for schedule(static) if (n * inter >= PARALLEL_MIN_WORK)
    for (int64_t r = 0; r < n; r++) {
        const float *g = gate_up + r * 2 * inter, *u = g + inter;
        float *o = out + r * inter;
        for (int64_t i = 0; i < inter; i++) {
            /* e = exp(-|g|) in (0, 1]: silu(g) = g / (1 + exp(-g)) = g * (g >= 0 ? 1 : e) / (1 + e).
             * The plain form lets GCC divide by exp(88) for clamped lanes of every vector,
             * making subnormals that cost ~100 cycles each. */
            float e = exp_poly(-fabsf(g[i]));
            o[i] = g[i] * (g[i] >= 0.0f ? 1.0f : e) / (1.0f + e) * u[i];
        }
    }
}

/* out[r, j] = dot(w[j, :], x[r, :]) for r < m, j < vocab: the LM head over a row-major
 * [vocab, hidden] matrix (the tied embedding itself, no transposed copy) for the few rows
 * of a small decode batch. Each row of w is read once, from memory, and kept in L1 for the
 * m dot products; four accumulators a product let the FMAs overlap. */
void kv_row_dots(const float *restrict x, int64_t m, int64_t hidden, const float *restrict w, int64_t vocab,
                 float *restrict out) {
#pragma omp parallel for schedule(static) if (vocab * hidden >= PARALLEL_MIN_WORK)
    for (int64_t j = 0; j < vocab; j++) {
        const float *wj = w + j * hidden;
        for (int64_t r = 0; r < m; r++) {
            const float *xr = x + r * hidden;
            v8 acc[4] = {0};
            int64_t k = 0;
            for (; k + 32 <= hidden; k += 32)
                for (int u = 0; u < 4; u++) acc[u] += load8(wj + k + 8 * u) * load8(xr + k + 8 * u);
            for (; k + 8 <= hidden; k += 8) acc[0] += load8(wj + k) * load8(xr + k);
            v8 s = (acc[0] + acc[1]) + (acc[2] + acc[3]);
            float sum = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
            for (; k < hidden; k++) sum += wj[k] * xr[k];
            out[r * vocab + j] = sum;
        }
    }
}

/* ---- decode attention over 8-bit quantized blocks (kvpool/storage/kv.py QuantizedKVStorage) ----
 * Codes are bytes: kind 0 int8, 1 FP8 E4M3 (bias 7), 2 FP8 E5M2 (bias 15); the value is
 * code * scale. Scales are fp32, one per (block, KV head, slot) (scales_per_block = bs) or
 * per (block, KV head) (scales_per_block = 1). The byte -> float conversions are exact and
 * branch-free so that GCC vectorises them: a normal FP8 value's exponent and mantissa bits
 * move into a float's, its exponent rebased by an integer add; a subnormal one (exponent
 * field 0) is its mantissa times 2^(1 - bias - mantissa bits). NaN codes never occur (the
 * quantizer saturates). */
static inline float fp8_to_float(uint8_t c, int kind) {
    uint32_t mag = c & 0x7f, sign = (uint32_t)(c & 0x80) << 24, bits;
    float f;
    if (kind == 1) {
        bits = (mag << 20) + (120u << 23);
        memcpy(&f, &bits, sizeof f);
        f = mag < 8 ? (float)mag * 0x1p-9f : f;
    } else {
        bits = (mag << 21) + (112u << 23);
        memcpy(&f, &bits, sizeof f);
        f = mag < 4 ? (float)mag * 0x1p-16f : f;
    }
    uint32_t fb;
    memcpy(&fb, &f, sizeof fb);
    fb |= sign;
    memcpy(&f, &fb, sizeof f);
    return f;
}

#if defined(__F16C__) && defined(__AVX2__)
#include <immintrin.h>
/* FP8 -> fp32 eight codes at a time through fp16, whose conversion the CPU does in one
 * instruction (F16C), subnormals included: an E5M2 code is the high byte of the fp16 of
 * the same value; an E4M3 code's sign, exponent and mantissa placed into an fp16's fields
 * give its value times 2^-8 (exponent bias 15 against 7, subnormals alike), which the
 * scale takes back. Returns how many codes it did (a multiple of 8). */
static int64_t decode_fp8_f16c(const uint8_t *restrict codes, int64_t n, int kind, const float *restrict scales,
                               int64_t scale_step, float *restrict out) {
    const float unit = kind == 1 ? 256.0f : 1.0f;
    const __m128i sign = _mm_set1_epi16(0x80), mag = _mm_set1_epi16(0x7f);
    int64_t x = 0;
    for (; x + 8 <= n; x += 8) {
        __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(codes + x)));
        if (kind == 1)
            w = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(w, sign), 8), _mm_slli_epi16(_mm_and_si128(w, mag), 7));
        else
            w = _mm_slli_epi16(w, 8);
        __m256 s = scale_step ? _mm256_loadu_ps(scales + x) : _mm256_set1_ps(scales[0]);
        _mm256_storeu_ps(out + x, _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtph_ps(w), _mm256_set1_ps(unit)), s));
    }
    return x;
}
#endif

/* out[x] = value(codes[x]) * scales[x * scale_step] for x < n (scale_step 0: one scale). */
static void decode_codes(const uint8_t *restrict codes, int64_t n, int kind, const float *restrict scales,
                         int64_t scale_step, float *restrict out) {
    if (kind == 0) {
        const int8_t *c = (const int8_t *)codes;
        if (scale_step == 0)
            for (int64_t x = 0; x < n; x++) out[x] = (float)c[x] * scales[0];
        else
            for (int64_t x = 0; x < n; x++) out[x] = (float)c[x] * scales[x];
        return;
    }
#if defined(__F16C__) && defined(__AVX2__)
    int64_t done = decode_fp8_f16c(codes, n, kind, scales, scale_step, out);
    codes += done, out += done, n -= done;
    scales += done * scale_step;
#endif
    if (kind == 1) {
        if (scale_step == 0)
            for (int64_t x = 0; x < n; x++) out[x] = fp8_to_float(codes[x], 1) * scales[0];
        else
            for (int64_t x = 0; x < n; x++) out[x] = fp8_to_float(codes[x], 1) * scales[x];
    } else {
        if (scale_step == 0)
            for (int64_t x = 0; x < n; x++) out[x] = fp8_to_float(codes[x], 2) * scales[0];
        else
            for (int64_t x = 0; x < n; x++) out[x] = fp8_to_float(codes[x], 2) * scales[x];
    }
}

/* The fp32 tail block of KV head kh [block_floats] that a sequence's last block (is_last)
 * is read from when it has one (tail >= 0: its slot in tails [num_tails, kvh,
 * block_floats]); NULL: the block is read from its codes. */
static inline const float *tail_block(const float *tails, int64_t tail, int is_last, int64_t kvh, int64_t kh,
                                      int64_t block_floats) {
    return is_last && tail >= 0 ? tails + (tail * kvh + kh) * block_floats : NULL;
}

/* As kv_decode_attention, over a QuantizedKVStorage layer: k_codes [num_blocks, kvh, d, bs]
 * and v_codes [num_blocks, kvh, bs, d] bytes, k_scales / v_scales [num_blocks, kvh,
 * scales_per_block] fp32. tails[b] >= 0: sequence b's last block is partly written and
 * read, whole, from tail slot tails[b] of tail_k [num_tails, kvh, d, bs] / tail_v
 * [num_tails, kvh, bs, d] fp32 (the full-precision tail of a block-scaled format). Each
 * block is decoded once per (sequence, KV head) into a block-sized fp32 buffer that the
 * fp32 block routines then read: the pool traffic is a quarter of fp32's, the decoding is
 * arithmetic in L1. Returns as kv_decode_attention, and -5 for a tail slot outside
 * [0, num_tails) or a bad kind. */
int kv_decode_attention_q8(const float *q, int64_t q_row_stride, int64_t num_rows, const int64_t *rows,
                           int64_t num_seqs, const int64_t *indptr, int64_t nnz, const int64_t *blocks,
                           const int64_t *ctx_lens, const uint8_t *restrict k_codes, const uint8_t *restrict v_codes,
                           const float *restrict k_scales, const float *restrict v_scales, int64_t scales_per_block,
                           int kind, const int64_t *tails, const float *restrict tail_k, const float *restrict tail_v,
                           int64_t num_tails, int64_t num_blocks, int64_t heads, int64_t kvh, int64_t d, int64_t bs,
                           float scale, float *restrict out, int64_t out_row_stride) {
    int64_t g_size = heads / kvh, width = 0;
    if (kind < 0 || kind > 2 || (scales_per_block != 1 && scales_per_block != bs)) return -5;
    int rc = check_tables(num_rows, rows, num_seqs, indptr, nnz, blocks, ctx_lens, num_blocks, bs, &width);
    if (rc) return rc;
    for (int64_t b = 0; b < num_seqs; b++)
        if (tails[b] >= num_tails) return -5;
    int parallel = decode_in_parallel(num_seqs, ctx_lens, heads, d);
    int64_t per_thread = g_size * width + g_size * d + 2 * d * bs; /* scores, queries, one K and one V block */
    float *buffers = malloc((size_t)(max_threads(parallel) * per_thread) * sizeof(float));
    if (!buffers) return -3;
    int64_t step = scales_per_block == 1 ? 0 : 1;
    const decode_batch batch = {q, q_row_stride, rows, indptr, blocks, ctx_lens,
                                out, out_row_stride, kvh, g_size, d, scale};
#pragma omp parallel if (parallel)
    {
        float *restrict scores = buffers + thread_id() * per_thread;
        float *restrict qs = scores + g_size * width;
        float *restrict kf = qs + g_size * d;
        float *restrict vf = kf + d * bs;
#pragma omp for schedule(static)
        for (int64_t item = 0; item < num_seqs * kvh; item++) {
            decode_item it = begin_item(&batch, item, qs);
            int64_t b = it.b, kh = item % kvh, nb = it.nb, len = it.len;
            for (int64_t j = 0; j < nb; j++) {
                const float *kt = tail_block(tail_k, tails[b], j == nb - 1, kvh, kh, d * bs);
                if (!kt) {
                    int64_t bh = it.table[j] * kvh + kh;
                    const float *ks = k_scales + bh * scales_per_block;
                    for (int64_t i = 0; i < d; i++) decode_codes(k_codes + (bh * d + i) * bs, bs, kind, ks, step, kf + i * bs);
                    kt = kf;
                }
                for (int64_t g = 0; g < g_size; g++) block_scores(qs + g * d, kt, d, bs, scores + g * width + j * bs);
            }
            softmax_heads(scores, g_size, width, len, it.o, d);
            for (int64_t j = 0; j < nb; j++) {
                int64_t slots = len - j * bs < bs ? len - j * bs : bs;
                const float *vb = tail_block(tail_v, tails[b], j == nb - 1, kvh, kh, bs * d);
                if (!vb) {
                    int64_t bh = it.table[j] * kvh + kh;
                    const float *vs = v_scales + bh * scales_per_block;
                    for (int64_t t = 0; t < slots; t++)
                        decode_codes(v_codes + (bh * bs + t) * d, d, kind, vs + t * step, 0, vf + t * d);
                    vb = vf;
                }
                for (int64_t g = 0; g < g_size; g++)
                    block_weighted_sum(scores + g * width + j * bs, vb, slots, d, it.o + g * d);
            }
        }
    }
    free(buffers);
    return 0;
}

/* decode_codes on its own, for the tests: out[x] = value(codes[x]) * scales[x or 0]. */
int kv_decode_codes(const uint8_t *codes, int64_t n, int kind, const float *scales, int64_t scale_step, float *out) {
    if (kind < 0 || kind > 2 || scale_step < 0 || scale_step > 1) return -5;
    decode_codes(codes, n, kind, scales, scale_step, out);
    return 0;
}
