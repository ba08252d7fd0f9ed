#include "compare.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

kda_context_t *kda_test_reference(void) {
    static kda_context_t *ref;
    if (!ref && kda_create(&ref, KDA_BACKEND_REFERENCE, 0) != KDA_STATUS_SUCCESS) {
        fprintf(stderr, "cannot create the reference context: %s\n", kda_last_error());
        exit(1);
    }
    return ref;
}

kda_status_t kda_run_host(kda_context_t *ctx, const kda_args_t *args, kda_algo_t algo) {
    size_t ws = 0;
    kda_status_t st = algo == KDA_ALGO_FORWARD ? kda_forward_workspace_size(ctx, args, &ws)
                                               : kda_decode_workspace_size(ctx, args, &ws);
    if (st != KDA_STATUS_SUCCESS) return st;
    void *w = ws ? malloc(ws) : NULL;
    st = algo == KDA_ALGO_FORWARD ? kda_forward(ctx, args, w, ws, NULL) : kda_decode(ctx, args, w, ws, NULL);
    free(w);
    return st;
}

kda_compare_t kda_compare_host(kda_context_t *ctx, const kda_synth_config_t *cfg, kda_algo_t algo) {
    kda_compare_t r;
    memset(&r, 0, sizeof r);
    kda_synth_t s;
    kda_args_t args;
    if (kda_synth_make(cfg, &s, &args) != 0) {
        r.status = KDA_STATUS_ALLOC_FAILED;
        return r;
    }
    const int64_t o_elems = s.num_tokens * cfg->hv * cfg->v;
    const int64_t st_elems = s.num_seqs * cfg->hv * (int64_t)cfg->k * cfg->v;
    r.status = kda_run_host(ctx, &args, algo);
    if (r.status == KDA_STATUS_SUCCESS) {
        float *o_ref = (float *)malloc(sizeof(float) * (size_t)(o_elems > 0 ? o_elems : 1));
        float *ht_ref = (float *)malloc(sizeof(float) * (size_t)(st_elems > 0 ? st_elems : 1));
        kda_args_t ra = args;
        ra.o = o_ref;
        ra.o_dtype = KDA_FLOAT32;
        if (ra.final_state) {
            ra.final_state = ht_ref;
            ra.final_state_dtype = KDA_FLOAT32;
        }
        kda_status_t st = kda_run_host(kda_test_reference(), &ra, KDA_ALGO_FORWARD);
        if (st != KDA_STATUS_SUCCESS) {
            fprintf(stderr, "reference failed: %s\n", kda_last_error());
            r.status = KDA_STATUS_INTERNAL_ERROR;
        }
        r.o_unwritten = kda_count_nonfinite(s.o, cfg->o_dtype, o_elems);
        r.o_err = kda_rel_err(s.o, cfg->o_dtype, o_ref, KDA_FLOAT32, o_elems);
        if (args.final_state) {
            r.state_unwritten = kda_count_nonfinite(s.ht, cfg->final_state_dtype, st_elems);
            r.state_err = kda_rel_err(s.ht, cfg->final_state_dtype, ht_ref, KDA_FLOAT32, st_elems);
        }
        free(o_ref);
        free(ht_ref);
    }
    kda_synth_free(&s);
    return r;
}

static const char *dt(kda_dtype_t d) {
    return d == KDA_FLOAT32 ? "f32" : d == KDA_FLOAT16 ? "f16" : d == KDA_BFLOAT16 ? "bf16" : "?";
}

const char *kda_describe(const kda_synth_config_t *c) {
    static _Thread_local char buf[512];
    char seqs[128] = "";
    if (c->num_seqs > 0) {
        int n = snprintf(seqs, sizeof seqs, " varlen[");
        for (int64_t i = 0; i < c->num_seqs && n < (int)sizeof seqs - 8; i++)
            n += snprintf(seqs + n, sizeof seqs - (size_t)n, "%s%lld", i ? "," : "", (long long)c->seqlens[i]);
        snprintf(seqs + n, sizeof seqs - (size_t)n, "]");
    }
    snprintf(buf, sizeof buf,
             "B%lld T%lld HQK%d HV%d K%d V%d%s %s g=%s beta=%s o=%s gate=%d l2=%d bsig=%d neg=%d h0=%s ht=%s vfirst=%d "
             "decay=%g seed=%llu",
             (long long)c->batch, (long long)c->seq_len, c->hqk, c->hv, c->k, c->v, seqs, dt(c->dtype), dt(c->g_dtype),
             dt(c->beta_dtype), dt(c->o_dtype), (int)c->gate, c->l2norm, c->beta_sigmoid, c->allow_neg_eigval,
             c->initial_state ? dt(c->initial_state_dtype) : "-", c->final_state ? dt(c->final_state_dtype) : "-",
             c->state_v_first, (double)c->decay, (unsigned long long)c->seed);
    return buf;
}
