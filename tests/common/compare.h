/*
 * Run a backend and the fp64 oracle on the same synthetic problem and compare their outputs.
 */
#ifndef KDA_TEST_COMPARE_H
#define KDA_TEST_COMPARE_H

#include "kda.h"
#include "synth.h"

typedef struct {
    double o_err;        /* ||o - o_ref|| / ||o_ref|| */
    double state_err;    /* same for the final state (0 when none) */
    int64_t o_unwritten; /* NaN/Inf left in o (poisoned before the call) */
    int64_t state_unwritten;
    kda_status_t status;
} kda_compare_t;

typedef enum { KDA_ALGO_FORWARD = 0, KDA_ALGO_DECODE = 1 } kda_algo_t;

/* The oracle context (created on first use, kept for the process). */
kda_context_t *kda_test_reference(void);

/* Run `algo` on ctx (host pointers: a CPU backend) and the oracle for cfg; compare. */
kda_compare_t kda_compare_host(kda_context_t *ctx, const kda_synth_config_t *cfg, kda_algo_t algo);

/* Run algo on ctx for args (host), with a workspace allocated here. */
kda_status_t kda_run_host(kda_context_t *ctx, const kda_args_t *args, kda_algo_t algo);

/* A short description of a configuration, for messages. */
const char *kda_describe(const kda_synth_config_t *cfg);

#endif /* KDA_TEST_COMPARE_H */
