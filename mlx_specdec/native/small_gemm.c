/* cblas_sgemm for the few rows of a decoding step, in front of OpenBLAS (see mlx_specdec/_blas.py).
 *
 * MLX's CPU backend computes every float32 product as cblas_sgemm. For a decoding step that is
 * x (M, K) @ W.T with M = 1 (a plain step) or a few (a verify), and OpenBLAS 0.3.21 runs it as a
 * GEMM: it packs W into panels first, so a one-row product reads and writes the weights more than
 * once. Here each weight row is streamed once for up to 8 rows of x, and a step is memory-bound,
 * so the weights' one pass sets its time: a few rows cost about what one does, and a one-token
 * forward gets markedly faster than through OpenBLAS (see docs/cpu-backend.md).
 *
 * Handled here: row-major, A not transposed, 1 <= M <= 64 (groups of 8 rows, each group streaming
 * B once); B transposed (x @ W.T: row-major weights, attention scores) or not (x @ W: column-major
 * weights, attention values). Everything else (a prefill's many rows) goes to OpenBLAS unchanged.
 * Each output element is one fixed sequence of vector FMAs over K and one fixed-order sum, so a
 * row's result has the same bits whatever M is (a token verified in a tree of 5 gets exactly the
 * logits it gets alone).
 */
#include <stddef.h>
#ifdef _OPENMP
#include <omp.h>
#endif

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112, MAX_ROWS = 8, MAX_CALL_ROWS = 64 };
#define PARALLEL_WORK (64 * 1024)  /* elements of B below which one thread does it all */
/* From 3 rows of A on, a weight row takes long enough to compute that the hardware prefetcher falls
 * behind the stream of B and the loads stop overlapping the FMAs: more rows cost clearly more than
 * one. Asking for B 16 KB ahead, into L2, brings a few rows back to about one row's time. For 1-2
 * rows it costs a little, so they go without. Past the end of B a prefetch is a no-op. */
#ifndef PREFETCH_MIN_ROWS  /* benchmarks/small_gemm_rows.py builds it with 99 to compare */
#define PREFETCH_MIN_ROWS 3
#endif
enum { PREFETCH_AHEAD = 4096 /* floats */, PREFETCH_TO_L2 = 1 /* __builtin_prefetch's locality */ };

typedef float v8 __attribute__((vector_size(32)));  /* 8 floats: as fast as 16 here, and any AVX2 CPU has it */
typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int, const float *, int,
                         float, float *, int);

static sgemm_fn next_sgemm;  /* OpenBLAS's cblas_sgemm, set by small_gemm_init */
static long calls_here, calls_forwarded;

static inline v8 load8(const float *p) { v8 v; __builtin_memcpy(&v, p, sizeof v); return v; }

typedef float v4 __attribute__((vector_size(16)));

/* acc + a * b with one rounding where the CPU has FMA, else two: the same instruction in every
 * kernel (compiled with -ffp-contract=off, so the compiler fuses nothing on its own, differently
 * from one kernel to the next) */
#if defined(__FMA__) && defined(__AVX__)
#include <immintrin.h>
static inline v8 fma8(v8 a, v8 b, v8 acc) { return (v8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)acc); }
#else
static inline v8 fma8(v8 a, v8 b, v8 acc) { return acc + a * b; }
#endif

static inline v8 splat8(float x) { return (v8){x, x, x, x, x, x, x, x}; }

static inline float sum8(v8 v) {  /* a fixed tree of halvings: the same bits whatever M is */
    v4 h = __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
    return (h[0] + h[2]) + (h[1] + h[3]);
}

/* rows n0..n1 of C for R rows of A: C[m, n] = alpha * dot(A[m, :], B[n, :]) + beta * C[m, n] */
#define NT_ROWS(R)                                                                            \
static void nt_rows_##R(int n0, int n1, int K, float alpha, const float *A, int lda,          \
                        const float *B, int ldb, float beta, float *C, int ldc) {             \
    int K8 = K & ~7;                                                                          \
    for (int n = n0; n < n1; n++) {                                                           \
        const float *b = B + (size_t)n * ldb;                                                 \
        v8 acc[R];                                                                            \
        for (int m = 0; m < R; m++) acc[m] = (v8){0};                                         \
        for (int k = 0; k < K8; k += 8) {                                                     \
            if (R >= PREFETCH_MIN_ROWS && !(k & 15))  /* once a 64-byte line */                \
                __builtin_prefetch(b + k + PREFETCH_AHEAD, 0, PREFETCH_TO_L2);                  \
            v8 bv = load8(b + k);                                                             \
            for (int m = 0; m < R; m++) acc[m] = fma8(bv, load8(A + (size_t)m * lda + k), acc[m]); \
        }                                                                                     \
        for (int m = 0; m < R; m++) {                                                         \
            const float *a = A + (size_t)m * lda;                                             \
            float s = sum8(acc[m]);                                                           \
            for (int k = K8; k < K; k++) s += a[k] * b[k];                                    \
            float *c = C + (size_t)m * ldc + n;                                               \
            *c = beta == 0.f ? alpha * s : alpha * s + beta * *c;                             \
        }                                                                                     \
    }                                                                                         \
}
NT_ROWS(1) NT_ROWS(2) NT_ROWS(3) NT_ROWS(4) NT_ROWS(5) NT_ROWS(6) NT_ROWS(7) NT_ROWS(8)

/* nt_rows two weight rows at a time. An FMA waits for the one before it on the same accumulator
 * (4-5 cycles), and nt_rows has R accumulators in flight, so from ~4 rows, once the weights are
 * prefetched, it is bound by that chain at about one FMA a cycle where the CPU can start two, and
 * each row past 4 adds visibly to the time.
 * Two weight rows give 2R independent chains, and each row of A loaded feeds two FMAs. 2R + 3
 * registers of 16: up to 6 rows. Each element is still one accumulator over k in order and the
 * same sum: the same bits as nt_rows. */
#ifndef NT_PAIR_MAX_ROWS  /* benchmarks/small_gemm_rows.py builds it with 0 to compare */
#define NT_PAIR_MAX_ROWS 8
#endif
#ifndef NT_PAIR_MIN_ROWS
#define NT_PAIR_MIN_ROWS 5
#endif
#define NT_PAIR(R)                                                                            \
static void nt_pair_##R(int n0, int n1, int K, float alpha, const float *A, int lda,          \
                        const float *B, int ldb, float beta, float *C, int ldc) {             \
    int K8 = K & ~7, n = n0;                                                                  \
    for (; n + 2 <= n1; n += 2) {                                                             \
        const float *b0 = B + (size_t)n * ldb, *b1 = b0 + ldb;                                \
        v8 acc0[R], acc1[R];                                                                  \
        for (int m = 0; m < R; m++) acc0[m] = acc1[m] = (v8){0};                              \
        for (int k = 0; k < K8; k += 8) {                                                     \
            if (R >= PREFETCH_MIN_ROWS && !(k & 15)) {                                        \
                __builtin_prefetch(b0 + k + PREFETCH_AHEAD, 0, PREFETCH_TO_L2);                 \
                __builtin_prefetch(b1 + k + PREFETCH_AHEAD, 0, PREFETCH_TO_L2);                 \
            }                                                                                 \
            v8 bv0 = load8(b0 + k), bv1 = load8(b1 + k);                                      \
            for (int m = 0; m < R; m++) {                                                     \
                v8 av = load8(A + (size_t)m * lda + k);                                       \
                acc0[m] = fma8(bv0, av, acc0[m]);                                             \
                acc1[m] = fma8(bv1, av, acc1[m]);                                             \
            }                                                                                 \
        }                                                                                     \
        for (int m = 0; m < R; m++) {                                                         \
            const float *a = A + (size_t)m * lda;                                             \
            float s0 = sum8(acc0[m]), s1 = sum8(acc1[m]);                                     \
            for (int k = K8; k < K; k++) { s0 += a[k] * b0[k]; s1 += a[k] * b1[k]; }          \
            float *c = C + (size_t)m * ldc + n;                                               \
            c[0] = beta == 0.f ? alpha * s0 : alpha * s0 + beta * c[0];                       \
            c[1] = beta == 0.f ? alpha * s1 : alpha * s1 + beta * c[1];                       \
        }                                                                                     \
    }                                                                                         \
    if (n < n1) nt_rows_##R(n, n1, K, alpha, A, lda, B, ldb, beta, C, ldc);                   \
}
NT_PAIR(1) NT_PAIR(2) NT_PAIR(3) NT_PAIR(4) NT_PAIR(5) NT_PAIR(6) NT_PAIR(7) NT_PAIR(8)

/* Attention's scores in a verify (x @ K.T with K = head dim 64, 4-8 rows a group: the query heads of
 * a KV head times the tokens verified). A key row is short, so the dot products' horizontal sums,
 * not the loads, bound nt_rows: 8 dot products of 64 and ~6 adds and shuffles to sum each. Here a
 * row of A meets 8 keys at once and their 8 accumulators are summed together (sum8x8): the same
 * additions in the same order as sum8 for each, a third of the instructions. Same bits as nt_rows.
 * Only for short rows of B (8 keys' rows stay in L1 while each row of A passes). */
enum { NT8_MAX_K = 256, NT8_MIN_ROWS = 4 };
#ifndef NT8_ENABLED  /* benchmarks/small_gemm_rows.py --scores builds it with 0 to compare */
#define NT8_ENABLED 1
#endif

static inline v8 lanes(v8 a, v8 b, int high) {  /* (a's half, b's half): the low 4 floats of each, or the high */
    return high ? __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15)
                : __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11);
}

/* out[j] = sum8(acc[j]) for the 8 accumulators, bit for bit: sum8 adds h = v[0:4] + v[4:8], then
 * (h[0] + h[2]) + (h[1] + h[3]); the same pairs are added here, 8 sums a vector */
static inline v8 sum8x8(const v8 *acc) {
    v8 h01 = lanes(acc[0], acc[1], 0) + lanes(acc[0], acc[1], 1);  /* h0 | h1 */
    v8 h23 = lanes(acc[2], acc[3], 0) + lanes(acc[2], acc[3], 1);
    v8 h45 = lanes(acc[4], acc[5], 0) + lanes(acc[4], acc[5], 1);
    v8 h67 = lanes(acc[6], acc[7], 0) + lanes(acc[6], acc[7], 1);
    /* per 4-lane half: (h[0] + h[2], h[1] + h[3]) of two accumulators */
    v8 q0123 = __builtin_shufflevector(h01, h23, 0, 1, 8, 9, 4, 5, 12, 13) +
               __builtin_shufflevector(h01, h23, 2, 3, 10, 11, 6, 7, 14, 15);  /* h0, h2 | h1, h3 */
    v8 q4567 = __builtin_shufflevector(h45, h67, 0, 1, 8, 9, 4, 5, 12, 13) +
               __builtin_shufflevector(h45, h67, 2, 3, 10, 11, 6, 7, 14, 15);  /* h4, h6 | h5, h7 */
    v8 s = __builtin_shufflevector(q0123, q4567, 0, 2, 8, 10, 4, 6, 12, 14) +
           __builtin_shufflevector(q0123, q4567, 1, 3, 9, 11, 5, 7, 13, 15);  /* s0 s2 s4 s6 | s1 s3 s5 s7 */
    return __builtin_shufflevector(s, s, 0, 4, 1, 5, 2, 6, 3, 7);
}

/* nt_rows for K a multiple of 8: blocks of 8 columns of C through sum8x8, the rest as nt_rows_1 does */
static void nt8_rows(int R, int n0, int n1, int K, float alpha, const float *A, int lda, const float *B,
                     int ldb, float beta, float *C, int ldc) {
    int n = n0;
    for (; n + 8 <= n1; n += 8) {
        const float *b = B + (size_t)n * ldb;
        for (int m = 0; m < R; m++) {
            const float *a = A + (size_t)m * lda;
            v8 acc[8];
            for (int j = 0; j < 8; j++) acc[j] = (v8){0};
            for (int k = 0; k < K; k += 8) {
                v8 av = load8(a + k);
                for (int j = 0; j < 8; j++) acc[j] = fma8(load8(b + (size_t)j * ldb + k), av, acc[j]);
            }
            v8 dots = sum8x8(acc);
            float *out = C + (size_t)m * ldc + n;
            v8 result = beta == 0.f ? splat8(alpha) * dots : splat8(alpha) * dots + splat8(beta) * load8(out);
            __builtin_memcpy(out, &result, sizeof result);
        }
    }
    if (n < n1)
        for (int m = 0; m < R; m++)
            nt_rows_1(n, n1, K, alpha, A + (size_t)m * lda, lda, B, ldb, beta, C + (size_t)m * ldc, ldc);
}

/* columns n0..n1 of C for R rows of A: C[m, n] = alpha * sum_k A[m, k] B[k, n] + beta * C[m, n].
 * V vectors of 8 columns a pass, R x V accumulators: a row of B is read V x 32 bytes at a time. With
 * one vector a pass, attention's values (K = thousands of cached tokens, N = 64) would be read in
 * 32-byte pieces 256 bytes apart, each cache line fetched twice: a large share of a one-token
 * forward over a long cache. Each lane still sums over k in order with one FMA
 * a step, so the bits are those of one vector a pass. V by the registers: R x V + V + 1 of them. */
#if defined(SMALL_GEMM_NN_ONE_VECTOR)  /* one vector a pass: benchmarks/small_gemm_rows.py --values compares */
#define NN_V(R) 1
#elif defined(__AVX512F__)
#define NN_V(R) ((R) <= 6 ? 4 : 3)  /* 32 vector registers */
#else
#define NN_V(R) ((R) <= 2 ? 4 : (R) == 3 ? 3 : (R) <= 6 ? 2 : 1)  /* 16 */
#endif
/* R rows x U vectors of columns n.. of C, summed over all of k (the inner loop of nn_rows) */
#define NN_BLOCK(R, U)                                                                        \
    {                                                                                         \
        v8 acc[R][U];                                                                         \
        for (int m = 0; m < R; m++)                                                           \
            for (int v = 0; v < U; v++) acc[m][v] = (v8){0};                                  \
        for (int k = 0; k < K; k++) {                                                         \
            const float *b = B + (size_t)k * ldb + n;                                         \
            v8 bv[U];                                                                         \
            for (int v = 0; v < U; v++) bv[v] = load8(b + 8 * v);                             \
            for (int m = 0; m < R; m++) {                                                     \
                v8 a = splat8(A[(size_t)m * lda + k]);                                        \
                for (int v = 0; v < U; v++) acc[m][v] = fma8(bv[v], a, acc[m][v]);            \
            }                                                                                 \
        }                                                                                     \
        for (int m = 0; m < R; m++)                                                           \
            for (int v = 0; v < U; v++) {                                                     \
                float *c = C + (size_t)m * ldc + n + 8 * v;                                   \
                for (int i = 0; i < 8; i++)                                                   \
                    c[i] = beta == 0.f ? alpha * acc[m][v][i] : alpha * acc[m][v][i] + beta * c[i]; \
            }                                                                                 \
    }
#define NN_ROWS(R)                                                                            \
static void nn_rows_##R(int n0, int n1, int K, float alpha, const float *A, int lda,          \
                        const float *B, int ldb, float beta, float *C, int ldc) {             \
    enum { V = NN_V(R) };                                                                     \
    int n = n0;                                                                               \
    for (; n + 8 * V <= n1; n += 8 * V) NN_BLOCK(R, V)                                        \
    for (; n + 8 <= n1; n += 8) NN_BLOCK(R, 1)                                                \
    for (; n < n1; n++)                                                                       \
        for (int m = 0; m < R; m++) {                                                         \
            float s = 0.f;                                                                    \
            for (int k = 0; k < K; k++) s += A[(size_t)m * lda + k] * B[(size_t)k * ldb + n]; \
            float *c = C + (size_t)m * ldc + n;                                               \
            *c = beta == 0.f ? alpha * s : alpha * s + beta * *c;                             \
        }                                                                                     \
}
NN_ROWS(1) NN_ROWS(2) NN_ROWS(3) NN_ROWS(4) NN_ROWS(5) NN_ROWS(6) NN_ROWS(7) NN_ROWS(8)

typedef void (*rows_fn)(int, int, int, float, const float *, int, const float *, int, float, float *, int);
static const rows_fn NT[MAX_ROWS + 1] = {0, nt_rows_1, nt_rows_2, nt_rows_3, nt_rows_4,
                                         nt_rows_5, nt_rows_6, nt_rows_7, nt_rows_8};
static const rows_fn NT_PAIRED[MAX_ROWS + 1] = {0, nt_pair_1, nt_pair_2, nt_pair_3, nt_pair_4,
                                                nt_pair_5, nt_pair_6, nt_pair_7, nt_pair_8};
static const rows_fn NN[MAX_ROWS + 1] = {0, nn_rows_1, nn_rows_2, nn_rows_3, nn_rows_4,
                                         nn_rows_5, nn_rows_6, nn_rows_7, nn_rows_8};

/* C (M, N) = alpha * A (M, K) @ op(B) + beta * C, row-major, M <= MAX_CALL_ROWS: op(B) = B (N, K).T
 * when b_transposed, else B (K, N). Rows in groups of MAX_ROWS (each group streams B once), columns
 * split over the threads (aligned to 8), one thread for a small B. */
void small_gemm(int b_transposed, int M, int N, int K, float alpha, const float *A, int lda,
                const float *B, int ldb, float beta, float *C, int ldc) {
    const rows_fn *kernels = b_transposed ? NT : NN;
    int parallel = (long)N * K >= PARALLEL_WORK;
    #pragma omp parallel if (parallel)
    {
        int threads = 1, me = 0;
#ifdef _OPENMP
        threads = omp_get_num_threads();
        me = omp_get_thread_num();
#endif
        int per = ((N + threads - 1) / threads + 7) & ~7;
        int n0 = me * per < N ? me * per : N, n1 = n0 + per < N ? n0 + per : N;
        for (int m0 = 0; m0 < M && n0 < n1; m0 += MAX_ROWS) {
            int rows = M - m0 < MAX_ROWS ? M - m0 : MAX_ROWS;
            if (NT8_ENABLED && b_transposed && rows >= NT8_MIN_ROWS && K <= NT8_MAX_K && K % 8 == 0)
                nt8_rows(rows, n0, n1, K, alpha, A + (size_t)m0 * lda, lda, B, ldb, beta, C + (size_t)m0 * ldc, ldc);
            else
                (b_transposed && rows >= NT_PAIR_MIN_ROWS && rows <= NT_PAIR_MAX_ROWS ? NT_PAIRED : kernels)[rows](
                    n0, n1, K, alpha, A + (size_t)m0 * lda, lda, B, ldb, beta, C + (size_t)m0 * ldc, ldc);
        }
    }
}

void small_gemm_init(void *openblas_sgemm) { next_sgemm = (sgemm_fn)openblas_sgemm; }

void small_gemm_counts(long *here, long *forwarded) { *here = calls_here; *forwarded = calls_forwarded; }

void cblas_sgemm(int order, int trans_a, int trans_b, int M, int N, int K, float alpha, const float *A,
                 int lda, const float *B, int ldb, float beta, float *C, int ldc) {
    if (order == ROW_MAJOR && trans_a == NO_TRANS && (trans_b == TRANS || trans_b == NO_TRANS) &&
        M >= 1 && M <= MAX_CALL_ROWS && K >= 1 && N >= 1) {
        __atomic_add_fetch(&calls_here, 1, __ATOMIC_RELAXED);
        small_gemm(trans_b == TRANS, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
        return;
    }
    __atomic_add_fetch(&calls_forwarded, 1, __ATOMIC_RELAXED);
    next_sgemm(order, trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}
