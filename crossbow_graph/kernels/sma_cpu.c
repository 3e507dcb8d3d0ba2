/* SMA update kernels for the CPU (docs/design-overview.md §2 steps 1–3, §4): the C backend of
 * crossbow_graph/kernels/c_sma.py, compiled on first use with the system's C compiler.
 *
 * Same mathematics as kernels/torch_ref.py (the oracle) and the Triton kernels, in one pass over
 * memory: sma_local reads ŵ, v, g, z once and writes w, v and the device's sum of corrections
 * acc; the torch version makes about eight passes over [m, P]. Columns are taken in blocks of
 * BLOCK floats and, inside a block, the m replicas one after the other, so that a block of acc
 * and z stays in L1 while the rows go by; acc is summed in row order (deterministic).
 * Plain float32 arithmetic (no -ffast-math): the compiler vectorises the element loops, which
 * have no reductions; the finite test ORs integer bits, which vectorises too.
 */
#include <stdint.h>
#include <string.h>

#define BLOCK 2048

/* Rows of g [m, P] (row stride sg) with a NaN or Inf: bad[j] = 1 for those, else 0.
 * Returns how many rows are bad. */
int64_t sma_rows_nonfinite(int64_t m, int64_t P, const float *g, int64_t sg, uint8_t *bad) {
    int64_t n = 0;
    for (int64_t j = 0; j < m; ++j) {
        const uint32_t *row = (const uint32_t *)(g + j * sg);
        uint32_t hit = 0;
        for (int64_t i = 0; i < P; ++i)
            hit |= (uint32_t)((row[i] & 0x7f800000u) == 0x7f800000u); /* exponent all ones */
        bad[j] = (uint8_t)(hit != 0);
        n += bad[j];
    }
    return n;
}

/* One row's block [a, e): d = g + λ·ŵ; v ← μ·v + d (v ← d on the first step); u = d + μ·v
 * (Nesterov) or v (or d without momentum); c = α·(ŵ − z); w ← ŵ − η·u − c; acc (+)= c.
 * The flags are compile-time constants at every call below, so each variant is its own loop. */
static inline void local_row(float *restrict w, float *restrict v, const float *restrict g,
                             const float *restrict z, float *restrict acc, int64_t a, int64_t e,
                             float lr, float mu, float wd, float alpha, const int momentum,
                             const int nesterov, const int decay, const int first,
                             const int correct, const int add) {
    for (int64_t i = a; i < e; ++i) {
        float wi = w[i];
        float d = decay ? g[i] + wd * wi : g[i];
        float u = d;
        if (momentum) {
            float vi = first ? d : mu * v[i] + d;
            v[i] = vi;
            u = nesterov ? d + mu * vi : vi;
        }
        float step = wi - lr * u;
        if (correct) {
            float c = alpha * (wi - z[i]);
            w[i] = step - c;
            acc[i] = add ? acc[i] + c : c;
        } else {
            w[i] = step;
        }
    }
}

#define ROWS(MOM, NES, DEC, FIRST, CORR)                                                        \
    for (int64_t a = 0; a < P; a += BLOCK) {                                                   \
        int64_t e = a + BLOCK < P ? a + BLOCK : P;                                             \
        for (int64_t j = 0; j < m; ++j) {                                                      \
            if (j == 0)                                                                        \
                local_row(w, v, g, z, acc, a, e, lr, mu, wd, alpha, MOM, NES, DEC, FIRST, CORR, 0); \
            else                                                                               \
                local_row(w + j * sw, v + j * sv, g + j * sg, z, acc, a, e, lr, mu, wd, alpha, \
                          MOM, NES, DEC, FIRST, CORR, 1);                                      \
        }                                                                                      \
    }                                                                                          \
    return;

#define BY_CORRECT(MOM, NES, DEC, FIRST)                                                         \
    if (correct) { ROWS(MOM, NES, DEC, FIRST, 1) } else { ROWS(MOM, NES, DEC, FIRST, 0) }

#define BY_FIRST(MOM, NES, DEC)                                                                  \
    if (first) { BY_CORRECT(MOM, NES, DEC, 1) } else { BY_CORRECT(MOM, NES, DEC, 0) }

/* The local update of m replicas: w, v, g [m, P] with row strides sw, sv, sg (elements); z and
 * acc [P] (ignored unless correct). Flags as in kernels/torch_ref.py's sma_local_update. */
void sma_local(int64_t m, int64_t P, float *w, int64_t sw, float *v, int64_t sv,
               const float *g, int64_t sg, const float *z, float *acc, float lr, float mu,
               float wd, float alpha, int momentum, int nesterov, int first, int correct) {
    int decay = wd != 0.0f;
    if (!momentum) {
        if (decay) { BY_CORRECT(0, 0, 1, 0) } else { BY_CORRECT(0, 0, 0, 0) }
    }
    if (nesterov) {
        if (decay) { BY_FIRST(1, 1, 1) } else { BY_FIRST(1, 1, 0) }
    }
    if (decay) { BY_FIRST(1, 0, 1) } else { BY_FIRST(1, 0, 0) }
}

/* The central average model's update, z_new = z + C + μ_z·(z − z_prev), z_prev ← z, z ← z_new,
 * fused with the sum of the devices' corrections and the copies of z (CPU devices share one
 * memory): C = parts[0] + … + parts[n_parts−1] (in that order), z = zs[0], z_prev = zps[0];
 * then every other device d gets zps[d] ← z and zs[d] ← z_new. One device and one part is the
 * plain central update. One pass over memory, in blocks of BLOCK columns. */
void sma_central_sum(int64_t P, int64_t n_parts, const float *const *parts, int64_t n_copies,
                     float *const *zs, float *const *zps, float mu) {
    float c[BLOCK];
    for (int64_t a = 0; a < P; a += BLOCK) {
        int64_t n = a + BLOCK < P ? BLOCK : P - a;
        const float *p0 = parts[0] + a;
        for (int64_t i = 0; i < n; ++i)
            c[i] = p0[i];
        for (int64_t q = 1; q < n_parts; ++q) {
            const float *pq = parts[q] + a;
            for (int64_t i = 0; i < n; ++i)
                c[i] += pq[i];
        }
        float *z = zs[0] + a, *zp = zps[0] + a;
        for (int64_t i = 0; i < n; ++i) {
            float zi = z[i];
            float moved = mu == 0.0f ? zi : zi + mu * (zi - zp[i]);
            zp[i] = zi;
            z[i] = moved + c[i];
        }
        for (int64_t d = 1; d < n_copies; ++d) {
            memcpy(zs[d] + a, z, (size_t)n * sizeof(float));
            memcpy(zps[d] + a, zp, (size_t)n * sizeof(float));
        }
    }
}
