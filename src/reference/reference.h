/* The fp64 oracle backend (reference.c forward and decode, reference_bwd.c backward, reference_cp.c the
 * piece maps of context parallelism): every value in double, the recurrence of docs/ALGORITHM.md §1 token by
 * token. The other backends are tested against it. */
#ifndef KDA_REFERENCE_H
#define KDA_REFERENCE_H

#include <math.h>

#include "../internal.h"

static inline double kda_softplus(double x) { return x > 0.0 ? x + log1p(exp(-x)) : log1p(exp(x)); }
static inline double kda_sigmoid(double x) { return 1.0 / (1.0 + exp(-x)); }

/* The oracles' initial state, K×V float64: each column j that holds an inf or NaN becomes NaN whole (value
 * channel j is poisoned: the non-finite contract, docs/ALGORITHM.md §7). */
void kda_reference_poison_columns(double *S, int K, int V);

kda_status_t kda_reference_backward_workspace(const kda_context_t *ctx, const kda_bwd_problem_t *p, size_t *bytes);
kda_status_t kda_reference_backward(kda_context_t *ctx, const kda_bwd_problem_t *p, void *ws, size_t ws_bytes,
                                    void *stream);

#endif /* KDA_REFERENCE_H */
