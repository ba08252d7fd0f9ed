/*
 * Causality in g on one backend (contract.h, kda_contract_causal_g). The chunked paths split e^{G_i − G_j} of
 * a 16-token diagonal block around a reference row, and take per-pair exponentials when the block's exponents
 * pass ±KDA_DIAG_RANGE: a gate at token t0 can change that row or that choice for the whole block, so the
 * block's earlier rows may move by float32 rounding (docs/ALGORITHM.md §7 item 6 states the bound); earlier
 * blocks read nothing of t0. The token-by-token paths read nothing after their token: exact.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "contract.h"
#include "internal.h"
#include "test_util.h"

enum { CT = 80, CHV = 2 };

/* Whether o[t][h][j] (x; clean: y) holds the rule for g = gv at token t0 of head 0; a move inside t0's block on
 * a chunked path (tol > 0) raises *worst (relative to omax). */
static int causal_ok(float x, float y, float gv, int t, int h, int t0, double tol, double omax, double *worst) {
    if (h == 0 && t >= t0) return isnan(gv) ? isnan(x) : isfinite(x); /* NaN for a NaN gate, else clamped */
    if (h == 0 && t / 16 == t0 / 16 && tol > 0.0) {
        const double dev = fabs((double)x - (double)y);
        if (isfinite(x)) *worst = fmax(*worst, dev / omax);
        return isfinite(x) && dev <= tol * omax;
    }
    return x == y; /* an earlier block, the other head, or a token-by-token path */
}

double kda_contract_causal_g(const kda_contract_backend_t *be, kda_algo_t algo, double tol, uint64_t seed) {
    static const float values[] = {NAN, INFINITY, -INFINITY, 1e30f, -1e30f, -100.0f, -30.0f, 100.0f};
    const int D = be->head_dim;
    kda_synth_config_t c;
    kda_synth_defaults(&c);
    c.batch = 1;
    c.seq_len = CT;
    c.hqk = 1;
    c.hv = CHV;
    c.k = c.v = D;
    c.seed = seed;
    c.dtype = c.g_dtype = c.beta_dtype = c.o_dtype = KDA_FLOAT32;
    c.initial_state = c.final_state = 1;
    kda_synth_t s;
    kda_args_t a;
    CHECK(kda_synth_make(&c, &s, &a) == 0, "synth");
    float *g = (float *)s.g, *o = (float *)s.o;
    const size_t n = (size_t)CT * CHV * D;
    float *g0 = (float *)malloc(n * sizeof(float)), *clean = (float *)malloc(n * sizeof(float));
    memcpy(g0, g, n * sizeof(float));
    CHECK(be->run(be->user, &a, algo) == KDA_STATUS_SUCCESS, "%s: %s", be->name, kda_last_error());
    memcpy(clean, o, n * sizeof(float));
    double omax = 0.0, worst = 0.0;
    for (size_t i = 0; i < n; i++)
        if (i / D % CHV == 0) omax = fmax(omax, fabs(clean[i])); /* head 0's */
    for (size_t vi = 0; vi < sizeof values / sizeof values[0]; vi++)
        for (int all = 0; all < 2; all++) /* one channel of token t0, or all of them */
            for (int t0 = 0; t0 < CT; t0++) {
                if (t0 > 48 && t0 < 60) continue;
                memcpy(g, g0, n * sizeof(float));
                for (int d = all ? 0 : 3; d < (all ? D : 4); d++) g[(t0 * CHV + 0) * D + d] = values[vi];
                kda_synth_poison(o, KDA_FLOAT32, (int64_t)n);
                CHECK(be->run(be->user, &a, algo) == KDA_STATUS_SUCCESS, "%s: %s", be->name, kda_last_error());
                int bad = 0;
                for (int t = 0; t < CT; t++)
                    for (int h = 0; h < CHV; h++)
                        for (int j = 0; j < D; j++) {
                            const size_t e = ((size_t)t * CHV + h) * D + j;
                            if (causal_ok(o[e], clean[e], values[vi], t, h, t0, tol, omax, &worst) || bad++ >= 3)
                                continue;
                            CHECK(0, "%s, K = V = %d: g = %g at token %d (all channels %d): o[%d][%d][%d] = %.9g, "
                                  "clean %.9g", be->name, D, (double)values[vi], t0, all, t, h, j, (double)o[e],
                                  (double)clean[e]);
                        }
            }
    free(g0);
    free(clean);
    kda_synth_free(&s);
    return worst;
}
