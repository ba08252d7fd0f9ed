/*
 * Synthetic KDA problems for the CLI, the tests and the benchmarks: random inputs (never zeros) in the
 * shapes and dtypes of a configuration, host buffers, and a kda_args_t that points at them.
 */
#ifndef KDA_SYNTH_H
#define KDA_SYNTH_H

#include <stdint.h>

#include "kda.h"

typedef enum {
    KDA_GATE_RAW = 0,             /* g is the log decay itself (logsigmoid of noise), no in-kernel gate */
    KDA_GATE_SOFTPLUS = 1,        /* in-kernel: -exp(A_log) softplus(g + dt_bias) */
    KDA_GATE_LOWER_BOUND = 2,     /* in-kernel: lower_bound sigmoid(exp(A_log) (g + dt_bias)), safe_gate */
    KDA_GATE_LOWER_BOUND_NO_A = 3 /* in-kernel: lower_bound sigmoid(g + dt_bias), no A_log */
} kda_gate_mode_t;

typedef struct {
    int64_t batch, seq_len; /* with num_seqs > 0: seq_len is ignored, lengths come from seqlens */
    int32_t hqk, hv, k, v;
    int64_t num_seqs; /* > 0: varlen with these lengths (batch must be 1) */
    const int64_t *seqlens;
    kda_dtype_t dtype, g_dtype, beta_dtype, o_dtype;
    int initial_state; /* 0 none, else its dtype is initial_state_dtype */
    kda_dtype_t initial_state_dtype;
    int final_state;
    kda_dtype_t final_state_dtype;
    int state_v_first;
    kda_gate_mode_t gate;
    int l2norm; /* use_qk_l2norm; when 0, k is generated unit-norm as models give it */
    int beta_sigmoid, allow_neg_eigval;
    float lower_bound; /* for the lower-bound gate modes; 0 -> -5 */
    float scale;       /* args.scale: 0 selects K^-1/2 */
    float decay;       /* scales the decay: 1 typical; 30 strong; used by every gate mode */
    uint64_t seed;
} kda_synth_config_t;

typedef struct {
    void *q, *k, *v, *g, *beta, *o, *h0, *ht;
    float *A_log, *dt_bias;
    int64_t *cu_seqlens;
    int64_t num_tokens, num_seqs;
    size_t q_bytes, v_bytes, g_bytes, beta_bytes, o_bytes, h0_bytes, ht_bytes;
} kda_synth_t;

/* A default configuration: bf16, K = V = 128, one head, typical decay. */
void kda_synth_defaults(kda_synth_config_t *cfg);

/* Allocate and fill buffers for cfg, and set args (kda_args_init'd first) to point at them. 0 on success; -1 out
 * of host memory; -2 a size (the total of the lengths, an element count or its bytes) overflows int64 or size_t.
 * Nothing stays allocated on failure. */
int kda_synth_make(const kda_synth_config_t *cfg, kda_synth_t *s, kda_args_t *args);
void kda_synth_free(kda_synth_t *s);

/* Fill n elements of dtype dt with a poison value (NaN) so that unwritten outputs are caught. */
void kda_synth_poison(void *x, kda_dtype_t dt, int64_t n);

/* ||x - ref|| / ||ref|| over n elements (inf if x has a NaN or ref is zero). */
double kda_rel_err(const void *x, kda_dtype_t xdt, const void *ref, kda_dtype_t rdt, int64_t n);

/* Number of NaN or Inf elements. */
int64_t kda_count_nonfinite(const void *x, kda_dtype_t dt, int64_t n);

#endif /* KDA_SYNTH_H */
