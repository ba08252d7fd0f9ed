/*
 * Bad input: each case breaks one argument of a valid problem and checks the status, that the message names
 * the argument, and that the poisoned outputs (o, final_state) are byte-for-byte unchanged — on both entry
 * points.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "compare.h"
#include "test_util.h"

static kda_context_t *cpu(void) {
    static kda_context_t *ctx;
    if (!ctx && kda_create(&ctx, KDA_BACKEND_CPU, 0) != KDA_STATUS_SUCCESS) exit(1);
    return ctx;
}

typedef struct {
    kda_synth_t s;
    kda_args_t a;
    int64_t cu[4];
    int32_t idx[3];
    void *ws;
    size_t ws_bytes;
} fixture_t;

/* A valid varlen problem: 3 sequences, GVA, initial and final state, a workspace of the right size. */
static void make(fixture_t *f) {
    static const int64_t lens[] = {5, 0, 20};
    kda_synth_config_t c;
    kda_synth_defaults(&c);
    c.num_seqs = 3;
    c.seqlens = lens;
    c.hqk = 1;
    c.hv = 2;
    c.k = c.v = 64;
    c.initial_state = c.final_state = 1;
    memset(f, 0, sizeof *f);
    if (kda_synth_make(&c, &f->s, &f->a) != 0) exit(1);
    f->cu[0] = 0;
    f->cu[1] = 5;
    f->cu[2] = 5;
    f->cu[3] = 25;
    f->a.cu_seqlens = f->cu;
    f->a.cu_seqlens_dtype = KDA_INT64;
}

static void expect_bad(const char *name, void (*mutate)(fixture_t *), kda_status_t want, const char *arg) {
    for (int algo = 0; algo < 2; algo++) {
        fixture_t f;
        make(&f);
        size_t need = 0;
        kda_status_t q = algo == 0 ? kda_forward_workspace_size(cpu(), &f.a, &need)
                                   : kda_decode_workspace_size(cpu(), &f.a, &need);
        if (q != KDA_STATUS_SUCCESS) exit(1);
        f.ws_bytes = need;
        f.ws = malloc(need);
        mutate(&f);
        void *o_before = malloc(f.s.o_bytes), *ht_before = malloc(f.s.ht_bytes);
        memcpy(o_before, f.s.o, f.s.o_bytes);
        memcpy(ht_before, f.s.ht, f.s.ht_bytes);
        const kda_args_t *args = strcmp(name, "bad_args_null") == 0 ? NULL : &f.a;
        kda_context_t *ctx = strcmp(name, "bad_ctx_null") == 0 ? NULL : cpu();
        kda_status_t st = algo == 0 ? kda_forward(ctx, args, f.ws, f.ws_bytes, NULL)
                                    : kda_decode(ctx, args, f.ws, f.ws_bytes, NULL);
        const char *fn = algo == 0 ? "kda_forward" : "kda_decode";
        char quoted[64];
        snprintf(quoted, sizeof quoted, "'%s'", arg);
        CHECK(st == want, "%s/%s: status %s, expected %s (%s)", name, fn, kda_status_string(st),
              kda_status_string(want), kda_last_error());
        CHECK(strstr(kda_last_error(), quoted) != NULL, "%s/%s: message does not name %s: \"%s\"", name, fn, quoted,
              kda_last_error());
        CHECK(strstr(kda_last_error(), fn) == kda_last_error(), "%s: message does not start with %s: \"%s\"", name,
              fn, kda_last_error());
        CHECK(memcmp(o_before, f.s.o, f.s.o_bytes) == 0, "%s/%s: o was written", name, fn);
        CHECK(memcmp(ht_before, f.s.ht, f.s.ht_bytes) == 0, "%s/%s: final_state was written", name, fn);
        free(o_before);
        free(ht_before);
        free(f.ws);
        kda_synth_free(&f.s);
    }
}

#define BAD(name, want, arg, body)                                                                          \
    static void mutate_##name(fixture_t *f) {                                                               \
        (void)f;                                                                                            \
        body;                                                                                               \
    }                                                                                                       \
    TEST(name) { expect_bad(#name, mutate_##name, want, arg); }

#define INVALID KDA_STATUS_INVALID_VALUE

BAD(bad_ctx_null, INVALID, "ctx", {})
BAD(bad_args_null, INVALID, "args", {})
BAD(bad_struct_size, INVALID, "struct_size", f->a.struct_size = 8)
BAD(bad_num_v_heads_not_multiple, INVALID, "num_v_heads", { f->a.num_qk_heads = 2; f->a.num_v_heads = 3; })
BAD(bad_num_qk_heads_zero, INVALID, "num_qk_heads", f->a.num_qk_heads = 0)
BAD(bad_head_dim_k_zero, INVALID, "head_dim_k", f->a.head_dim_k = 0)
BAD(bad_head_dim_v_too_large, INVALID, "head_dim_v", f->a.head_dim_v = 300)
BAD(bad_seq_len_negative, INVALID, "seq_len", f->a.seq_len = -1)
BAD(bad_dtype_int, INVALID, "dtype", f->a.dtype = KDA_INT32)
BAD(bad_beta_dtype, INVALID, "beta_dtype", f->a.beta_dtype = (kda_dtype_t)42)
BAD(bad_o_dtype, INVALID, "o_dtype", f->a.o_dtype = KDA_INT64)
BAD(bad_q_null, INVALID, "q", f->a.q = NULL)
BAD(bad_beta_null, INVALID, "beta", f->a.beta = NULL)
BAD(bad_o_aliases_input, INVALID, "o", f->a.o = (void *)f->a.v)
BAD(bad_o_aliases_beta, INVALID, "o", f->a.o = (void *)f->a.beta)
BAD(bad_o_aliases_initial_state, INVALID, "o", f->a.o = (void *)f->a.initial_state)
BAD(bad_o_partial_overlap_v, INVALID, "o", f->a.o = (char *)f->a.v + 2)
BAD(bad_o_aliases_cu_seqlens, INVALID, "o", f->a.o = f->cu)
BAD(bad_o_aliases_final_state, INVALID, "o", f->a.o = f->a.final_state)
BAD(bad_final_state_aliases_q, INVALID, "final_state", f->a.final_state = (void *)f->a.q)
BAD(bad_final_state_aliases_dt_bias, INVALID, "final_state", {
    f->a.use_gate_in_kernel = 1;
    f->a.A_log = f->s.A_log;
    f->a.dt_bias = f->s.dt_bias;
    f->a.final_state = (void *)((const char *)f->s.dt_bias - 8);
})
BAD(bad_final_state_partial_overlap_initial_state, INVALID, "final_state",
    f->a.final_state = (float *)f->a.initial_state + 1)
BAD(bad_final_state_aliases_state_indices, INVALID, "final_state", {
    f->idx[0] = 0; f->idx[1] = -1; f->idx[2] = 1;
    f->a.state_indices = f->idx;
    f->a.num_state_slots = 2;
    f->a.final_state = (char *)f->idx - 4;
})
BAD(bad_batch_huge_seq_len_zero, INVALID, "batch", {
    f->a.cu_seqlens = NULL;
    f->a.num_seqs = 0;
    f->a.seq_len = 0;
    f->a.batch = (int64_t)1 << 62;
})
BAD(bad_num_state_slots_huge, INVALID, "num_state_slots", {
    f->idx[0] = 0; f->idx[1] = -1; f->idx[2] = 1;
    f->a.state_indices = f->idx;
    f->a.num_state_slots = (int64_t)1 << 60;
})
BAD(bad_cu_seqlens_not_start_zero, INVALID, "cu_seqlens", f->cu[0] = 1)
BAD(bad_cu_seqlens_not_monotone, INVALID, "cu_seqlens", f->cu[2] = 3)
BAD(bad_cu_seqlens_wrong_end, INVALID, "cu_seqlens", f->cu[3] = 24)
BAD(bad_cu_seqlens_dtype, INVALID, "cu_seqlens_dtype", f->a.cu_seqlens_dtype = KDA_FLOAT32)
BAD(bad_cu_seqlens_batch_not_one, INVALID, "batch", f->a.batch = 2)
BAD(bad_num_seqs_without_cu_seqlens, INVALID, "num_seqs", { f->a.cu_seqlens = NULL; f->a.seq_len = 25; })
BAD(bad_initial_state_dtype_f16, INVALID, "initial_state_dtype", f->a.initial_state_dtype = KDA_FLOAT16)
BAD(bad_inplace_state_dtype_mismatch, INVALID, "final_state", {
    f->a.final_state = (void *)f->a.initial_state;
    f->a.final_state_dtype = KDA_BFLOAT16;
})
BAD(bad_state_indices_out_of_range, INVALID, "state_indices", {
    f->idx[0] = 0; f->idx[1] = 3; f->idx[2] = 1;
    f->a.state_indices = f->idx;
    f->a.num_state_slots = 3;
})
BAD(bad_state_indices_duplicate, INVALID, "state_indices", {
    f->idx[0] = 1; f->idx[1] = -1; f->idx[2] = 1;
    f->a.state_indices = f->idx;
    f->a.num_state_slots = 3;
})
BAD(bad_num_state_slots_without_indices, INVALID, "num_state_slots", f->a.num_state_slots = 4)
BAD(bad_scale_nan, INVALID, "scale", f->a.scale = NAN)
BAD(bad_softplus_gate_without_alog, INVALID, "A_log", f->a.use_gate_in_kernel = 1)
BAD(bad_alog_without_gate_in_kernel, INVALID, "A_log", f->a.A_log = f->s.A_log)
BAD(bad_dt_bias_without_gate_in_kernel, INVALID, "dt_bias", f->a.dt_bias = f->s.dt_bias)
BAD(bad_safe_gate_without_lower_bound, INVALID, "lower_bound", {
    f->a.use_gate_in_kernel = 1;
    f->a.A_log = f->s.A_log;
    f->a.safe_gate = 1;
})
BAD(bad_lower_bound_outside_safe_range, INVALID, "lower_bound", {
    f->a.use_gate_in_kernel = 1;
    f->a.safe_gate = 1;
    f->a.lower_bound = -6.0f;
})
BAD(bad_lower_bound_positive, INVALID, "lower_bound", {
    f->a.use_gate_in_kernel = 1;
    f->a.lower_bound = 1.0f;
})
BAD(bad_lower_bound_without_gate_in_kernel, INVALID, "lower_bound", f->a.lower_bound = -5.0f)
BAD(bad_allow_neg_eigval_without_sigmoid, INVALID, "allow_neg_eigval", f->a.allow_neg_eigval = 1)
BAD(bad_workspace_too_small, KDA_STATUS_INSUFFICIENT_WORKSPACE, "workspace_bytes", f->ws_bytes -= 1)
BAD(bad_workspace_null, INVALID, "workspace", { free(f->ws); f->ws = NULL; })

TEST(bad_workspace_size_query) {
    fixture_t f;
    make(&f);
    size_t bytes = 12345;
    f.a.head_dim_k = 0;
    CHECK(kda_forward_workspace_size(cpu(), &f.a, &bytes) == KDA_STATUS_INVALID_VALUE, "status");
    CHECK(bytes == 12345, "workspace size written on error");
    CHECK(strstr(kda_last_error(), "'head_dim_k'") != NULL, "message: %s", kda_last_error());
    CHECK(kda_forward_workspace_size(cpu(), &f.a, NULL) == KDA_STATUS_INVALID_VALUE, "NULL out");
    CHECK(strstr(kda_last_error(), "'workspace_bytes'") != NULL, "message: %s", kda_last_error());
    kda_synth_free(&f.s);
}

/* 2-D state_indices (speculative decoding): rows of T_max = 20 columns; sequence 0 has 5 tokens, 1 none, 2 has
 * 20. A valid layout of 60 distinct slots, then one thing broken. (The fixture's pools are smaller than 60
 * slots, so every case must fail before anything runs.) */
static int32_t idx2[3 * 20];
static int32_t nat2[3];
static void spec_layout(fixture_t *f) {
    for (int i = 0; i < 60; i++) idx2[i] = i;
    nat2[0] = 1; nat2[1] = 20; nat2[2] = 3;
    f->a.state_indices = idx2;
    f->a.state_indices_cols = 20;
    f->a.num_accepted_tokens = nat2;
    f->a.num_state_slots = 60;
}
BAD(bad_state_indices_2d_out_of_range, INVALID, "state_indices", { spec_layout(f); idx2[40 + 19] = 60; })
BAD(bad_state_indices_2d_read_slot_out_of_range, INVALID, "state_indices", { spec_layout(f); idx2[20 + 19] = 61; })
BAD(bad_state_indices_2d_duplicate_across_rows, INVALID, "state_indices", { spec_layout(f); idx2[40 + 7] = 3; })
BAD(bad_state_indices_2d_duplicate_within_row, INVALID, "state_indices", { spec_layout(f); idx2[4] = 1; })
BAD(bad_state_indices_2d_read_slot_of_other_row, INVALID, "state_indices", { spec_layout(f); idx2[20 + 19] = 42; })
BAD(bad_num_accepted_tokens_zero, INVALID, "num_accepted_tokens", { spec_layout(f); nat2[2] = 0; })
BAD(bad_num_accepted_tokens_above_t_max, INVALID, "num_accepted_tokens", { spec_layout(f); nat2[1] = 21; })
BAD(bad_num_accepted_tokens_with_1d_indices, INVALID, "num_accepted_tokens", {
    f->idx[0] = 0; f->idx[1] = 1; f->idx[2] = 2;
    f->a.state_indices = f->idx;
    f->a.num_state_slots = 3;
    nat2[0] = nat2[1] = nat2[2] = 1;
    f->a.num_accepted_tokens = nat2;
})
BAD(bad_state_indices_cols_below_seq_len, INVALID, "state_indices_cols", { spec_layout(f); f->a.state_indices_cols = 10; })
BAD(bad_state_indices_cols_negative, INVALID, "state_indices_cols", { spec_layout(f); f->a.state_indices_cols = -2; })
BAD(bad_state_indices_cols_without_indices, INVALID, "state_indices_cols", f->a.state_indices_cols = 4)
BAD(bad_state_indices_row_stride_below_cols, INVALID, "state_indices_row_stride", {
    spec_layout(f);
    f->a.state_indices_row_stride = 19;
})
BAD(bad_beta_headwise_not_flag, INVALID, "beta_headwise", f->a.beta_headwise = 2)

/* Intra-card context parallelism (issue 9): the fields are checked on every backend, the CPU ignores them */
BAD(bad_cp_mode_out_of_range, INVALID, "cp_mode", f->a.cp_mode = (kda_cp_mode_t)3)
BAD(bad_cp_mode_negative, INVALID, "cp_mode", f->a.cp_mode = (kda_cp_mode_t)-1)
BAD(bad_cp_piece_len_zero_with_on, INVALID, "cp_piece_len", f->a.cp_mode = KDA_CP_ON)
BAD(bad_cp_piece_len_negative_with_on, INVALID, "cp_piece_len", { f->a.cp_mode = KDA_CP_ON; f->a.cp_piece_len = -64; })
BAD(bad_cp_piece_len_not_chunk_multiple, INVALID, "cp_piece_len", {
    f->a.cp_mode = KDA_CP_ON;
    f->a.cp_piece_len = 96;
})
BAD(bad_cp_piece_len_too_large, INVALID, "cp_piece_len", {
    f->a.cp_mode = KDA_CP_ON;
    f->a.cp_piece_len = (int64_t)KDA_CP_MAX_PIECE_LEN + 64;
})
BAD(bad_cp_piece_len_huge, INVALID, "cp_piece_len", { f->a.cp_mode = KDA_CP_ON; f->a.cp_piece_len = INT64_MAX - 63; })
BAD(bad_cp_piece_len_without_on, INVALID, "cp_piece_len", f->a.cp_piece_len = 128)
BAD(bad_cp_piece_len_with_off, INVALID, "cp_piece_len", { f->a.cp_mode = KDA_CP_OFF; f->a.cp_piece_len = 128; })
/* chunk_states (kda_forward only: kda_decode refuses any, so every case names the field on both entry points) */
static float chunk_states_buf[4 * 2 * 64 * 64];
BAD(bad_chunk_states_dtype, INVALID, "chunk_states_dtype", {
    f->a.chunk_states = chunk_states_buf;
    f->a.chunk_states_dtype = KDA_FLOAT16;
})
BAD(bad_chunk_states_headwise_beta, KDA_STATUS_NOT_SUPPORTED, "chunk_states", {
    f->a.chunk_states = chunk_states_buf;
    f->a.beta_headwise = 1;
})
BAD(bad_chunk_states_aliases_o, INVALID, "chunk_states", f->a.chunk_states = f->a.o)
BAD(bad_chunk_states_aliases_k, INVALID, "chunk_states", f->a.chunk_states = (char *)f->a.k + 4)
BAD(bad_chunk_states_aliases_final_state, INVALID, "chunk_states", f->a.chunk_states = f->a.final_state)
/* saved (what kda_forward keeps for kda_backward: nothing on the CPU backends, but the buffer is still checked;
   kda_decode refuses any) */
static unsigned char saved_buf[256];
BAD(bad_saved_bytes_without_saved, INVALID, "saved_bytes", f->a.saved_bytes = 64)
BAD(bad_saved_aliases_q, INVALID, "saved", { f->a.saved = (char *)f->a.q + 4; f->a.saved_bytes = 16; })
BAD(bad_saved_aliases_final_state, INVALID, "saved", { f->a.saved = f->a.final_state; f->a.saved_bytes = 16; })
BAD(bad_saved_aliases_o, INVALID, "saved", { f->a.saved = saved_buf; f->a.saved_bytes = sizeof saved_buf;
                                              f->a.o = saved_buf + 8; })
