/* RowNorm's two elementwise passes on CPU as plain loops, one row at a time (dit_train/optim/native_rownorm.py).
 *
 * momentum: M <- lerp(M, G, keep); X = G + c M (nesterov) or c M; U <- X when u is not NULL; and the sums of
 *           squares of X over the rows of O(X): per row (wide: sums[rows]) or per column (tall: sums[cols]).
 * update:   W <- decay W + alpha X s, X read from u or recomputed from G and M; s per row (wide) or column (tall).
 * Each reads and writes every element once, in memory order, in the same loop that accumulates the sums (inductor
 * splits the reduction and the stores into two loop nests, reading G and M twice, and walks a tall matrix's
 * columns with a stride). lerp follows torch's formula (the branch on weight < 0.5). */

#include <stddef.h>

#define LERP(m, g, w) ((w) < 0.5 ? (m) + (w) * ((g) - (m)) : (g) - ((g) - (m)) * (1 - (w)))

#define DEFINE(T, SUFFIX)                                                                                          \
void rownorm_momentum_##SUFFIX(const T *g, T *m, T *u, T *sums, long rows, long cols, T keep, T c, int nesterov, \
                               int tall) {                                                                      \
    T a = nesterov ? (T)1 : (T)0; /* X = a G + c M */                                                             \
    if (tall)                                                                                                   \
        for (long j = 0; j < cols; ++j) sums[j] = 0;                                                            \
    for (long i = 0; i < rows; ++i) {                                                                           \
        const T *gi = g + i * cols;                                                                             \
        T *mi = m + i * cols;                                                                                   \
        T *ui = u ? u + i * cols : NULL;                                                                        \
        T acc = 0;                                                                                              \
        if (tall && ui) {                                                                                       \
            _Pragma("omp simd") for (long j = 0; j < cols; ++j) {                                               \
                T mv = LERP(mi[j], gi[j], keep); mi[j] = mv;                                                    \
                T x = a * gi[j] + c * mv; ui[j] = x; sums[j] += x * x;                                          \
            }                                                                                                   \
        } else if (tall) {                                                                                      \
            _Pragma("omp simd") for (long j = 0; j < cols; ++j) {                                               \
                T mv = LERP(mi[j], gi[j], keep); mi[j] = mv;                                                    \
                T x = a * gi[j] + c * mv; sums[j] += x * x;                                                     \
            }                                                                                                   \
        } else if (ui) {                                                                                        \
            _Pragma("omp simd reduction(+ : acc)") for (long j = 0; j < cols; ++j) {                            \
                T mv = LERP(mi[j], gi[j], keep); mi[j] = mv;                                                    \
                T x = a * gi[j] + c * mv; ui[j] = x; acc += x * x;                                              \
            }                                                                                                   \
        } else {                                                                                                \
            _Pragma("omp simd reduction(+ : acc)") for (long j = 0; j < cols; ++j) {                            \
                T mv = LERP(mi[j], gi[j], keep); mi[j] = mv;                                                    \
                T x = a * gi[j] + c * mv; acc += x * x;                                                         \
            }                                                                                                   \
        }                                                                                                       \
        if (!tall) sums[i] = acc;                                                                               \
    }                                                                                                           \
}                                                                                                               \
                                                                                                                \
void rownorm_update_##SUFFIX(T *p, const T *g, const T *m, const T *u, const T *s, long rows, long cols, T decay, \
                             T alpha, T c, int nesterov, int tall) {                                            \
    T a = nesterov ? (T)1 : (T)0;                                                                               \
    for (long i = 0; i < rows; ++i) {                                                                           \
        T *pi = p + i * cols;                                                                                   \
        const T *gi = g + i * cols, *mi = m + i * cols;                                                         \
        const T *ui = u ? u + i * cols : NULL;                                                                  \
        T si = tall ? (T)0 : s[i];                                                                              \
        if (tall && ui) {                                                                                       \
            _Pragma("omp simd") for (long j = 0; j < cols; ++j) pi[j] = pi[j] * decay + alpha * ui[j] * s[j];  \
        } else if (tall) {                                                                                      \
            _Pragma("omp simd") for (long j = 0; j < cols; ++j)                                                 \
                pi[j] = pi[j] * decay + alpha * (a * gi[j] + c * mi[j]) * s[j];                                 \
        } else if (ui) {                                                                                        \
            _Pragma("omp simd") for (long j = 0; j < cols; ++j) pi[j] = pi[j] * decay + alpha * ui[j] * si;    \
        } else {                                                                                                \
            _Pragma("omp simd") for (long j = 0; j < cols; ++j)                                                 \
                pi[j] = pi[j] * decay + alpha * (a * gi[j] + c * mi[j]) * si;                                   \
        }                                                                                                       \
    }                                                                                                           \
}

DEFINE(float, f32)
DEFINE(double, f64)
