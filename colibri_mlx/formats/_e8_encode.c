/* fmt 6 (E8/IQ3) encoder core: row rotation and the per-sub-block code/grid search.
 *
 * Compiled on first use by colibri_mlx/formats/e8.py (cc -O2 -ffp-contract=off -shared) and
 * called through ctypes; e8.py keeps the numpy implementation as the reference. The bytes must
 * equal upstream iq3_pack.encode on numpy/OpenBLAS, so every float32 operation that decides an
 * output is spelled out in the same order and rounding as there:
 *   q      = m / max(db, 1e-20f)
 *   score  = |g|^2 - 2 * dot(q, g), dot a fused multiply-add chain k = 0..3 (OpenBLAS sgemm)
 *   err    = sum_32 (g * db - m)^2, summed like numpy's pairwise sum (8 accumulators)
 * Everything else here only decides which candidates need that exact arithmetic, with error
 * bounds that leave a margin; see nearest() and search_sub(). -ffp-contract=off is required:
 * a contracted a*b+c anywhere below would change bytes.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define QK 256
#define SUB 32
#define NGRID 256

static float G[NGRID][4];            /* halved grid magnitudes: integers 2..31 */
static float G2[NGRID];              /* |g|^2, exact */

/* ---- nearest grid point ---------------------------------------------------------------
 * Query space [0, 64)^4 is cut into cells: 16 bins of width 2 over [0, 32), 8 of width 4 over
 * [32, 64). A cell lists (ascending) the grid points that may score lowest for some q in it:
 * j is dropped when some i beats it on the whole closed box by more than float32 rounding of
 * both scores can bridge (the score difference is linear in q, so its box minimum sits at a
 * corner). Dropped points then score strictly worse than a listed one for every q in the box,
 * so the first minimum over the list is upstream's first minimum over all 256. Cells are built
 * on first visit; more than CELL_MAX candidates, or q outside the cells, score all 256. */
#define NBIN 24
#define NCELL (NBIN * NBIN * NBIN * NBIN)
#define CELL_MAX 15
#define CELL_BRUTE 255
static uint8_t cells[NCELL][CELL_MAX + 1];  /* [0]: 0 = not built, CELL_BRUTE, or count */

static inline float score(const float q[4], int j) {
    float acc = q[0] * G[j][0];                 /* fma(q0, g0, 0) rounds the same */
    acc = fmaf(q[1], G[j][1], acc);
    acc = fmaf(q[2], G[j][2], acc);
    acc = fmaf(q[3], G[j][3], acc);
    return G2[j] - 2.0f * acc;
}

static inline int bin_of(float q) {             /* q in [0, 64) */
    return q < 32.0f ? (int)(q * 0.5f) : 16 + (int)((q - 32.0f) * 0.25f);
}

static void bin_box(int b, double *lo, double *hi) {
    if (b < 16) { *lo = 2.0 * b; *hi = *lo + 2.0; }
    else { *lo = 32.0 + 4.0 * (b - 16); *hi = *lo + 4.0; }
}

/* Upper bound on |upstream score - exact score| summed over two grid points, for q in a box
 * with coordinate sum <= qsum: dot chain <= 4.0001u*dot, subtraction <= u*(|g|^2 + 2 dot),
 * dot <= 31*qsum, |g|^2 <= 3844, u = 2^-24; doubled and rounded up generously. */
static double score_margin(double qsum) { return ldexp(8192.0 + 640.0 * qsum, -24); }

static void build_cell(int cell, uint8_t *slot) {
    double lo[4], hi[4], qsum = 0.0, center[4];
    int c = cell;
    for (int k = 0; k < 4; k++) {
        bin_box(c % NBIN, &lo[k], &hi[k]);
        c /= NBIN;
        qsum += hi[k];
        center[k] = 0.5 * (lo[k] + hi[k]);
    }
    double margin = score_margin(qsum);
    /* references: the few grid points closest to the box centre */
    enum { NREF = 6 };
    int ref[NREF];
    double refd[NREF];
    for (int r = 0; r < NREF; r++) { ref[r] = -1; refd[r] = INFINITY; }
    for (int j = 0; j < NGRID; j++) {
        double dd = 0.0;
        for (int k = 0; k < 4; k++) dd += (center[k] - G[j][k]) * (center[k] - G[j][k]);
        for (int r = 0; r < NREF; r++) {
            if (dd < refd[r]) {
                for (int s = NREF - 1; s > r; s--) { refd[s] = refd[s - 1]; ref[s] = ref[s - 1]; }
                refd[r] = dd; ref[r] = j;
                break;
            }
        }
    }
    int n = 0;
    uint8_t list[NGRID];
    for (int j = 0; j < NGRID; j++) {
        int dropped = 0;
        for (int r = 0; r < NREF && !dropped; r++) {
            int i = ref[r];
            if (i == j) continue;
            /* min over the box of score_j - score_i = |g_j|^2 - |g_i|^2 - 2 q.(g_j - g_i) */
            double diff = (double)G2[j] - (double)G2[i];
            for (int k = 0; k < 4; k++) {
                double slope = -2.0 * ((double)G[j][k] - (double)G[i][k]);
                diff += slope * (slope < 0 ? hi[k] : lo[k]);
            }
            dropped = diff > margin;
        }
        if (!dropped) list[n++] = (uint8_t)j;
    }
    if (n > CELL_MAX) {
        __atomic_store_n(&slot[0], (uint8_t)CELL_BRUTE, __ATOMIC_RELEASE);
        return;
    }
    memcpy(slot + 1, list, (size_t)n);
    /* Threads that build the same cell at once write the same bytes; the count is published
     * last so a reader never sees a count before its list. */
    __atomic_store_n(&slot[0], (uint8_t)n, __ATOMIC_RELEASE);
}

static int brute_nearest(const float q[4]) {
    int best_j = 0;
    float best = score(q, 0);
    for (int j = 1; j < NGRID; j++) {
        float s = score(q, j);
        if (s < best) { best = s; best_j = j; }
    }
    return best_j;
}

static inline int cell_of(const float q[4]) {    /* -1: outside the cells (or NaN) */
    if (!(q[0] < 64.0f && q[1] < 64.0f && q[2] < 64.0f && q[3] < 64.0f)) return -1;
    return bin_of(q[0]) + NBIN * (bin_of(q[1]) + NBIN * (bin_of(q[2]) + NBIN * bin_of(q[3])));
}

/* upstream's argmin (first minimum) of score over the 256 grid points; q finite, >= 0 */
static inline int nearest(const float q[4], int cell) {
    if (cell < 0) return brute_nearest(q);
    uint8_t *slot = cells[cell];
    int n = __atomic_load_n(&slot[0], __ATOMIC_ACQUIRE);
    if (n == 0) {
        build_cell(cell, slot);
        n = __atomic_load_n(&slot[0], __ATOMIC_ACQUIRE);
    }
    if (n == CELL_BRUTE) return brute_nearest(q);
    int best_j = slot[1];
    float best = score(q, best_j);
    for (int t = 2; t <= n; t++) {              /* ascending j: strict < keeps the first */
        float s = score(q, slot[t]);
        if (s < best) { best = s; best_j = slot[t]; }
    }
    return best_j;
}

/* ---- code search ----------------------------------------------------------------------
 * Lower bound on a code's float32 error from each weight's distance to the nearest of the 8
 * scalar levels L*(code+0.5)/2 (in units of d), tabulated over bins of r = m/d. The bins are
 * widened by 1e-6 for the rounding of r and db, the distance is reduced by 2^-14 for the
 * rounding of g*db - m (<= 31u*db/d + 248u < 2^-14), and the squared sum is scaled by
 * (1 - 2^-16) for the rounding of the float32 sums: the bound stays below the error the
 * exact arithmetic computes, so a code whose bound exceeds an error already measured can
 * never be chosen. */
#define R_PER 8                     /* bins per unit of r */
#define R_BINS 2048                 /* r in [0, 256), last bin open */
static float LB[R_BINS][16];
static const double LEVELS[8] = {2, 6, 10, 14, 18, 22, 26, 31};

static void build_bounds(void) {
    for (int b = 0; b < R_BINS; b++) {
        double lo = (double)b / R_PER * (1 - 1e-6);
        double hi = b == R_BINS - 1 ? INFINITY : (double)(b + 1) / R_PER * (1 + 1e-6);
        for (int c = 0; c < 16; c++) {
            double t = INFINITY;
            for (int l = 0; l < 8; l++) {
                double lv = LEVELS[l] * (0.5 + c) * 0.5;
                double dist = lv < lo ? lo - lv : (lv > hi ? lv - hi : 0.0);
                if (dist < t) t = dist;
            }
            t -= ldexp(1.0, -14);
            LB[b][c] = t > 0 ? (float)(t * t * (1 - 1e-7)) : 0.0f;
        }
    }
}

static inline float pairwise32(const float t[32]) {  /* numpy pairwise_sum for n = 32 */
    float r[8];
    for (int k = 0; k < 8; k++) r[k] = t[k];
    for (int i = 8; i < 32; i += 8)
        for (int k = 0; k < 8; k++) r[k] += t[i + k];
    return ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
}

/* Float32 error of one code, and its 8 grid indices. With a finite cutoff it gives up (returns
 * INFINITY) once the groups done plus the lower bounds of the groups left (rest[g]: bound of
 * groups g+1..7, scaled like code_bounds) exceed the cutoff: the full error would too. */
static float code_error(const float m[32], float db, uint8_t idx[8], float cutoff,
                        const double rest[8]) {
    float guard = db > 1e-20f ? db : 1e-20f;    /* np.maximum(db, 1e-20) */
    float q[32], t[32];
    int cell[8];
    for (int i = 0; i < 32; i++) q[i] = m[i] / guard;
    for (int g = 0; g < 8; g++) {               /* start all 8 table reads before using one */
        cell[g] = cell_of(q + 4 * g);
        if (cell[g] >= 0) __builtin_prefetch(cells[cell[g]]);
    }
    double done = 0.0;
    for (int g = 0; g < 8; g++) {
        int j = nearest(q + 4 * g, cell[g]);
        idx[g] = (uint8_t)j;
        for (int k = 0; k < 4; k++) {
            float diff = G[j][k] * db - m[4 * g + k];
            t[4 * g + k] = diff * diff;
            done += (double)t[4 * g + k];
        }
        if (g < 7 && (done * (1 - ldexp(1.0, -16)) + rest[g]) > (double)cutoff) return INFINITY;
    }
    return pairwise32(t);
}

static inline float code_db(float d, int c) { return d * (0.5f + (float)c) * 0.5f; }

/* Lower bounds on the float32 error of all 16 codes (d > 0); with rest != NULL also, per code,
 * the bound of the groups after each group (rest[c][g]: groups g+1..7). */
static void code_bounds(const float m[32], float d, double bound[16], double rest[16][8]) {
    float gsum[8][16];
    for (int g = 0; g < 8; g++) {
        for (int c = 0; c < 16; c++) gsum[g][c] = 0.0f;
        for (int i = 4 * g; i < 4 * g + 4; i++) {
            float r = m[i] / d;
            int b = r < (float)(R_BINS - 1) / R_PER ? (int)(r * R_PER) : R_BINS - 1;
            for (int c = 0; c < 16; c++) gsum[g][c] += LB[b][c];
        }
    }
    /* (1 - 2^-16) covers the float32 rounding of these sums and of the error's own sum */
    double scale = (double)d * (double)d * (1 - ldexp(1.0, -16));
    for (int c = 0; c < 16; c++) {
        double acc = 0.0;
        for (int g = 7; g >= 0; g--) {
            if (rest) rest[c][g] = acc * scale;
            acc += (double)gsum[g][c];
        }
        bound[c] = acc * scale;
    }
}

/* one 32-weight sub-block: lowest code of minimal error and its 8 grid indices */
static void search_sub(const float m[32], float d, uint8_t *code_out, uint8_t idx_out[8]) {
    uint8_t idx[8];
    if (d == 0.0f) {               /* every code has db = 1e-20 for q, 0 for err: code 0 wins */
        static const double none[8];
        code_error(m, 0.0f, idx_out, INFINITY, none);
        *code_out = 0;
        return;
    }
    double bound[16], rest[16][8];
    code_bounds(m, d, bound, rest);
    int order[16];
    for (int c = 0; c < 16; c++) {              /* insertion sort by bound, stable */
        int p = c;
        while (p > 0 && bound[order[p - 1]] > bound[c]) { order[p] = order[p - 1]; p--; }
        order[p] = c;
    }
    float best = INFINITY;
    int best_c = -1;
    for (int t = 0; t < 16; t++) {
        int c = order[t];
        if (best_c >= 0 && bound[c] > (double)best) break;
        float err = code_error(m, code_db(d, c), idx, best, rest[c]);
        if (best_c < 0 || err < best || (err == best && c < best_c)) {
            best = err; best_c = c;
            memcpy(idx_out, idx, 8);
        }
    }
    *code_out = (uint8_t)best_c;
}

/* ---- entry points ---------------------------------------------------------------------- */

/* grid: [256][4] uint8 (e8.GRID, GGML's iq3xxs_grid). Call once before anything else. */
int e8_init(const uint8_t *grid) {
    for (int j = 0; j < NGRID; j++) {
        double g2 = 0.0;
        for (int k = 0; k < 4; k++) {
            G[j][k] = (float)grid[4 * j + k] * 0.5f;
            g2 += (double)G[j][k] * G[j][k];
        }
        G2[j] = (float)g2;
    }
    build_bounds();
    return 0;
}

/* mag: [n_sub][32] magnitudes, d: [n_sub] stored super-scales (finite, >= 0).
 * Writes codes [n_sub] and indices [n_sub][8]. */
void e8_search(const float *mag, const float *d, int64_t n_sub, uint8_t *codes, uint8_t *idx) {
    for (int64_t s = 0; s < n_sub; s++) search_sub(mag + SUB * s, d[s], codes + s, idx + 8 * s);
}

/* Nearest grid point for n queries [n][4] (finite, >= 0): the search's own lookup, for tests. */
void e8_nearest(const float *q, int64_t n, uint8_t *out) {
    for (int64_t i = 0; i < n; i++) out[i] = (uint8_t)nearest(q + 4 * i, cell_of(q + 4 * i));
}

/* The search's per-code error lower bounds for n sub-blocks [n][32], d [n] > 0, for tests. */
void e8_code_bounds(const float *mag, const float *d, int64_t n, double *out) {
    for (int64_t s = 0; s < n; s++) code_bounds(mag + SUB * s, d[s], out + 16 * s, NULL);
}

/* Cell table access: its size, a pointer to it (cells[i][0] == 0: not built yet), building
 * cells [lo, hi) ahead of use, and clearing it (tests of the lazy build). */
int64_t e8_cell_table_bytes(void) { return (int64_t)sizeof cells; }
uint8_t *e8_cell_table(void) { return &cells[0][0]; }
void e8_build_cells(int64_t lo, int64_t hi) {
    for (int64_t c = lo; c < hi; c++)
        if (__atomic_load_n(&cells[c][0], __ATOMIC_ACQUIRE) == 0) build_cell((int)c, cells[c]);
}
void e8_clear_cells(void) { memset(cells, 0, sizeof cells); }

/* Rotate rows [rows][dim] into out: per block of the tiling, sign flip, unnormalized FWHT
 * with butterflies at stride 1, 2, 4, ..., then division by sqrt(b) (float32 divisors given). */
void e8_rotate(const float *in, float *out, int64_t rows, int64_t dim, const int64_t *tiling,
               int64_t n_tiles, const float *signs, const float *divisors) {
    for (int64_t r = 0; r < rows; r++) {
        const float *src = in + r * dim;
        float *x = out + r * dim;
        const float *sg = signs;
        for (int64_t t = 0; t < n_tiles; t++) {
            int64_t b = tiling[t];
            for (int64_t i = 0; i < b; i++) x[i] = src[i] * sg[i];
            for (int64_t h = 1; h < b; h <<= 1)
                for (int64_t i = 0; i < b; i += 2 * h)
                    for (int64_t k = i; k < i + h; k++) {
                        float a = x[k], c = x[k + h];
                        x[k] = a + c;
                        x[k + h] = a - c;
                    }
            float dv = divisors[t];
            for (int64_t i = 0; i < b; i++) x[i] /= dv;
            x += b; src += b; sg += b;
        }
    }
}
