/*
 * The non-finite input contract (docs/ALGORITHM.md §7, "Non-finite and out-of-range inputs"), checked on one
 * backend: every input class of the table (finite, huge ±1e30, ±inf, NaN) in q, k, v, g, β and the initial
 * state, injected at one token (the initial state: one element, which poisons its value channel), through
 * kda_forward and kda_decode, against the backend's own clean run and the fp64 oracle, with the states K-first
 * and V-first, per sequence and in a pool (state_indices). Shared by the CPU test (host memory) and the GPU test
 * (the runner copies to the device).
 */
#ifndef KDA_TEST_CONTRACT_H
#define KDA_TEST_CONTRACT_H

#include "compare.h"
#include "kda.h"

typedef struct {
    const char *name;
    /* Run `algo` for args (host pointers, float32 o and final_state); results back in args' host o and
     * final_state. */
    kda_status_t (*run)(void *user, const kda_args_t *args, kda_algo_t algo);
    void *user;
    int head_dim;     /* K = V */
    double tol;       /* finite outputs against the fp64 oracle (relative to the largest |o|) */
    double same_tol;  /* outputs that must not change against this backend's clean run (same, relative) */
    int known_gaps;   /* classes not checked, each with a message: 2: kda_forward with a non-finite or huge q, k,
                         v, g or β; 4: kda_forward with a non-finite or huge initial state. No backend has a
                         gap left (the CUDA chunked kernels closed 4, then 2; 1, kda_decode with a non-finite
                         initial state on CUDA, was retired before). */
} kda_contract_backend_t;

/* Check every class at token `t` of sequence 0 (a 70-token sequence beside a 9-token one), in each of the four
 * state configurations; CHECKs inside. */
void kda_contract_check(const kda_contract_backend_t *be, int t);

/* Causality in g (docs/ALGORITHM.md §7 item 6; tests/common/causal.c): each class of g (NaN, ±inf, ±1e30, -100,
 * -30, 100) in one channel or all channels of head 0 at token t0, for every t0 of the first three 16-token blocks
 * and around the 64-token chunk boundary, of an 80-token sequence with two value heads, K = V = be->head_dim.
 * From t0 on, head 0's o is NaN for a NaN gate and finite otherwise; earlier blocks and head 1 are bit-identical
 * to the clean run; the earlier rows of t0's block are too where tol is 0 (a token-by-token path), and
 * otherwise finite and within tol of head 0's largest |o|. Returns the largest such move seen (relative); CHECKs
 * inside. The stated bounds: KDA_CAUSAL_TOL on the CPU (float32 arithmetic), KDA_CAUSAL_TOL_CUDA on CUDA (its
 * chunked kernels take some products with 16-bit operands). */
#define KDA_CAUSAL_TOL 1e-5
#define KDA_CAUSAL_TOL_CUDA 1e-2
double kda_contract_causal_g(const kda_contract_backend_t *be, kda_algo_t algo, double tol, uint64_t seed);

#endif /* KDA_TEST_CONTRACT_H */
