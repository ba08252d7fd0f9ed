/*
 * libkda — Kimi Delta Attention (KDA) for CPUs and NVIDIA GPUs.
 *
 * The full contract (shapes, memory rules, state pools, saved blocks, CP controls, non-finite inputs,
 * struct_size versioning) is docs/API.md; here each field and function has a short comment.
 *
 * Per value head h and sequence, with a K×V state S (natural-log gates, as in FLA):
 *     S_t = (I − β_t k_t k_tᵀ) Diag(exp(g_t)) S_{t−1} + β_t k_t v_tᵀ,    o_t = scale · S_tᵀ q_t
 *
 * Every call returns a kda_status_t and writes no output on error; calls never allocate (workspace is queried
 * and passed in); on CUDA they are asynchronous on the given stream and pointers are device pointers (except
 * *_host fields). Tensors are dense row-major: B rows, T tokens, N sequences, HQK query/key heads, HV value
 * heads (a multiple of HQK), K and V head sizes.
 */
#ifndef KDA_H
#define KDA_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define KDA_API __declspec(dllexport)
#else
#define KDA_API __attribute__((visibility("default")))
#endif

/* ---- Version ----------------------------------------------------------------------------------------- */
#define KDA_VERSION_MAJOR 0
#define KDA_VERSION_MINOR 1
#define KDA_VERSION_PATCH 0
/* KDA_VERSION = MAJOR * 10000 + MINOR * 100 + PATCH, the value kda_version() returns at run time. */
#define KDA_VERSION (KDA_VERSION_MAJOR * 10000 + KDA_VERSION_MINOR * 100 + KDA_VERSION_PATCH)

/* The version of the linked library, as KDA_VERSION; compare with the header's to detect a mismatch. */
KDA_API int kda_version(void);

/* ---- Status and errors ------------------------------------------------------------------------------- */
typedef enum kda_status {
    KDA_STATUS_SUCCESS = 0,
    KDA_STATUS_INVALID_VALUE = 1,          /* an argument is wrong; kda_last_error() names it */
    KDA_STATUS_NOT_SUPPORTED = 2,          /* valid, but not available on this backend, build or device */
    KDA_STATUS_INSUFFICIENT_WORKSPACE = 3, /* workspace_bytes is smaller than the *_workspace_size answer */
    KDA_STATUS_ALLOC_FAILED = 4,           /* kda_create could not allocate the context */
    KDA_STATUS_BACKEND_ERROR = 5,          /* the CUDA runtime reported an error (its text is in the message) */
    KDA_STATUS_INTERNAL_ERROR = 6,         /* a bug in libkda; please report it with the message */
    KDA_STATUS_CONTEXT_IN_USE = 7          /* kda_set_num_threads, kda_destroy: a call runs on the context */
} kda_status_t;

/* A short constant name for a status, e.g. "KDA_STATUS_INVALID_VALUE". Never NULL. */
KDA_API const char *kda_status_string(kda_status_t status);

/* The message of the last failing call on this thread (which argument, what was wrong); "" if none. Never NULL.
 * A successful call leaves it as it was. */
KDA_API const char *kda_last_error(void);

/* ---- Data types -------------------------------------------------------------------------------------- */
typedef enum kda_dtype {
    KDA_FLOAT32 = 0,
    KDA_FLOAT16 = 1,
    KDA_BFLOAT16 = 2,
    KDA_INT32 = 3,
    KDA_INT64 = 4,
    KDA_FLOAT64 = 5 /* cross-rank CP summaries only (cp_summary_dtype) */
} kda_dtype_t;

/* Bytes per element of a dtype (4, 2, 2, 4, 8, 8), or 0 for a value outside the enum. */
KDA_API size_t kda_dtype_size(kda_dtype_t dtype);

/* ---- Context: one backend ---------------------------------------------------------------------------- */
typedef enum kda_backend {
    KDA_BACKEND_AUTO = 0,      /* CUDA device `device` if this build and machine have one, else the CPU */
    KDA_BACKEND_CPU = 1,       /* chunked algorithm, float32 arithmetic, multi-threaded */
    KDA_BACKEND_REFERENCE = 2, /* the oracle: float64 token-by-token recurrence, one thread; slow, exact */
    KDA_BACKEND_CUDA = 3       /* NVIDIA GPU (sm_90a / sm_100a builds) */
} kda_backend_t;

typedef struct kda_context kda_context_t;

/* Create a context for `backend` (`device`: the CUDA ordinal). CUDA without a build or device for it:
 * NOT_SUPPORTED; AUTO then takes the CPU and leaves the reason in kda_last_error(). A CPU context starts its
 * threads here: KDA_NUM_THREADS (a whole number in [1, 1024]) or one per core. docs/API.md §3. */
KDA_API kda_status_t kda_create(kda_context_t **ctx, kda_backend_t backend, int device);

/* Destroy a context and join its threads. NULL is accepted and does nothing. While a call runs on the context
 * on another thread: KDA_STATUS_CONTEXT_IN_USE, and nothing is destroyed. */
KDA_API kda_status_t kda_destroy(kda_context_t *ctx);

/* The backend a context runs on (never KDA_BACKEND_AUTO). */
KDA_API kda_status_t kda_get_backend(const kda_context_t *ctx, kda_backend_t *backend);

/* A short name of a backend: "auto", "cpu", "reference", "cuda". Never NULL. */
KDA_API const char *kda_backend_name(kda_backend_t backend);

/* CPU backend: use `num_threads` (>= 1) worker threads from now on; query workspace sizes again after it.
 * Other backends: NOT_SUPPORTED. While a call runs on the context on another thread: KDA_STATUS_CONTEXT_IN_USE,
 * and the threads stay as they were. */
KDA_API kda_status_t kda_set_num_threads(kda_context_t *ctx, int num_threads);

/* The number of threads of a CPU context (1 for the reference backend, 0 for CUDA). */
KDA_API kda_status_t kda_get_num_threads(const kda_context_t *ctx, int *num_threads);

/* ---- Intra-card context parallelism: kda_args_t.cp_mode and cp_piece_len (docs/API.md §8) ------------- */
typedef enum kda_cp_mode {
    KDA_CP_AUTO = 0, /* the library decides per call whether and how to split (the default) */
    KDA_CP_OFF = 1,  /* never split: one serial chunk chain per (sequence, head) */
    KDA_CP_ON = 2    /* always take the split path, with pieces of cp_piece_len tokens */
} kda_cp_mode_t;

#define KDA_CHUNK_SIZE 64              /* tokens per chunk of the chunked algorithm: chunk_states' rows */
#define KDA_CP_PIECE_MULTIPLE 64       /* cp_piece_len is a multiple of the chunk (tokens) */
#define KDA_CP_MAX_PIECE_LEN (1 << 24) /* the largest cp_piece_len (tokens) */

/* ---- The problem: one struct for kda_forward and kda_decode (docs/API.md §5) ---------------------------
 * kda_args_init() sets every field to its default (given beside it; unstated: 0 / NULL); then set the fields
 * you use. Leave struct_size as kda_args_init() set it (docs/API.md §13). */
typedef struct kda_args {
    size_t struct_size; /* sizeof(kda_args_t) of the header the caller was built with */

    /* -- Problem size (docs/API.md §4) ------------------------------------------------------------------- */
    int64_t batch;        /* B >= 0 equal-length rows; 1 with cu_seqlens. Default 1 */
    int64_t seq_len;      /* T >= 0 tokens per row (total tokens with cu_seqlens). Default 0 */
    int32_t num_qk_heads; /* HQK >= 1 query/key heads. Default 1 */
    int32_t num_v_heads;  /* HV >= 1 value heads, a multiple of HQK (GVA when larger). Default 1 */
    int32_t head_dim_k;   /* K in [1, 256]. Default 128 */
    int32_t head_dim_v;   /* V in [1, 256], independent of K. Default 128 */

    /* -- Variable-length sequences (optional) ------------------------------------------------------------ */
    const void *cu_seqlens;       /* [N+1] monotone offsets from 0 to T; NULL: N = B equal-length rows */
    kda_dtype_t cu_seqlens_dtype; /* KDA_INT32 or KDA_INT64. Default KDA_INT32 */
    int64_t num_seqs;             /* N >= 0 with cu_seqlens */
    const void *cu_seqlens_host;  /* CUDA, optional: a host copy of cu_seqlens, whose contents are then validated */

    /* -- Inputs ------------------------------------------------------------------------------------------ */
    kda_dtype_t dtype;      /* dtype of q, k and v: FLOAT32, FLOAT16 or BFLOAT16. Default BFLOAT16 */
    const void *q;          /* [B, T, HQK, K] queries */
    const void *k;          /* [B, T, HQK, K] keys */
    const void *v;          /* [B, T, HV, V] values */
    const void *g;          /* [B, T, HV, K] log decay (<= 0), or the raw gate with use_gate_in_kernel */
    kda_dtype_t g_dtype;    /* FLOAT32, FLOAT16 or BFLOAT16. Default BFLOAT16 */
    const void *beta;       /* [B, T, HV] β, or its logit with use_beta_sigmoid ([.., HV, V] headwise) */
    kda_dtype_t beta_dtype; /* FLOAT32, FLOAT16 or BFLOAT16. Default BFLOAT16 */

    /* -- Output ------------------------------------------------------------------------------------------ */
    void *o;             /* [B, T, HV, V] output, fully written */
    kda_dtype_t o_dtype; /* FLOAT32, FLOAT16 or BFLOAT16. Default BFLOAT16 */

    /* -- States (optional; pools and slots: docs/API.md §6) ---------------------------------------------- */
    const void *initial_state;       /* [N, HV, K, V] (V-first: [N, HV, V, K]), or a pool; NULL: zeros */
    kda_dtype_t initial_state_dtype; /* FLOAT32 or BFLOAT16. Default FLOAT32 */
    void *final_state;               /* as initial_state, may be the same memory (in place); NULL: not written */
    kda_dtype_t final_state_dtype;   /* FLOAT32 or BFLOAT16. Default FLOAT32 */
    int state_v_first;               /* 1: states are stored [V, K] per head (FLA's state_v_first) */
    const int32_t *state_indices;    /* [N] slot of each sequence in the state pools (negative: none), or NULL */
    int64_t num_state_slots;         /* slots in the pools when state_indices is set */

    /* -- Options (FLA's chunk_kda flags, same meaning; docs/API.md §5) ----------------------------------- */
    float scale;            /* output scale; 0 selects K^-1/2 (a binding refuses values that round to 0.0f) */
    int use_qk_l2norm;      /* 1: q and k are l2-normalised over K first (use_qk_l2norm_in_kernel) */
    int use_gate_in_kernel; /* 1: g is the raw gate; log decay from A_log, dt_bias, lower_bound */
    const float *A_log;     /* [HV] float32, with use_gate_in_kernel; required unless lower_bound is set */
    const float *dt_bias;   /* [HV * K] float32, optional, with use_gate_in_kernel */
    float lower_bound;      /* the sigmoid gate's bound, < 0; 0: unset (softplus gate; bindings: as scale) */
    int safe_gate;          /* 1: the caller promises bounded gates (FLA's safe_gate) */
    int use_beta_sigmoid;   /* 1: beta is a logit, β = sigmoid(beta) (use_beta_sigmoid_in_kernel) */
    int allow_neg_eigval;   /* 1: β = 2 * sigmoid(beta), in (0, 2); requires use_beta_sigmoid */

    /* -- Speculative decoding and headwise β (appended; docs/API.md §6, §13) ------------------------------ */
    int64_t state_indices_cols;         /* 0: state_indices is [N]; T_max >= 1: it is [N, T_max] (speculative) */
    int64_t state_indices_row_stride;   /* elements between rows of a 2-D state_indices (<= 2^40); 0: the cols */
    const int32_t *num_accepted_tokens; /* [N] in [1, T_max], with a 2-D state_indices; NULL: all 1 */
    int beta_headwise;                  /* 1: beta is [B, T, HV, V], one β per value channel */

    /* -- Intra-card context parallelism (appended; CUDA kda_forward; docs/API.md §8) --------------------- */
    kda_cp_mode_t cp_mode; /* KDA_CP_AUTO, KDA_CP_OFF or KDA_CP_ON. Default KDA_CP_AUTO (0) */
    int64_t cp_piece_len;  /* KDA_CP_ON: tokens per piece, a multiple of 64 up to KDA_CP_MAX_PIECE_LEN */

    /* -- Chunk-start states (appended; kda_forward; docs/API.md §9) -------------------------------------- */
    void *chunk_states;             /* [Σ_n ceil(len_n / 64), HV, K, V]: the state before every chunk; NULL: none */
    kda_dtype_t chunk_states_dtype; /* FLOAT32 or BFLOAT16. Default FLOAT32 */

    /* -- Training: what the forward keeps for the backward (appended; docs/API.md §10) ------------------- */
    void *saved;        /* kda_forward writes, kda_backward reads; NULL: the backward recomputes */
    size_t saved_bytes; /* bytes at saved, at least kda_forward_saved_size's answer */

    /* -- Context parallelism across ranks (appended; kda_forward, kda_backward; docs/API.md §14) --------- */
    int32_t cp_num_ranks;         /* R >= 1 ranks the packed tokens are split over; 0: none (the default) */
    int32_t cp_rank;              /* this rank, in [0, R) */
    int32_t cp_pre_ranks;         /* ranks before this one whose parts chain into its first sequence, <= cp_rank */
    int32_t cp_post_ranks;        /* ranks after this one its last sequence continues on, <= R - 1 - cp_rank */
    kda_dtype_t cp_summary_dtype; /* FLOAT32 or FLOAT64 (CPU backends): the summaries' elements. Default FLOAT32 */
    const void *cp_summaries;     /* [R, HV, K, K + V] every rank's forward summary (all-gathered); cp_pre_ranks > 0 */
    size_t cp_summaries_bytes;    /* bytes at cp_summaries, at least R * kda_cp_summary_size's answer */
    int32_t cp_primed; /* 1: kda_forward reuses the work kda_cp_forward_summary left in the same workspace (§14) */
} kda_args_t;

/* Set the defaults of the first struct_size bytes of `args` and struct_size itself (docs/API.md §13). */
KDA_API void kda_args_init_sized(kda_args_t *args, size_t struct_size);
#define kda_args_init(args) kda_args_init_sized((args), sizeof(kda_args_t))
/* The same as a function (writes sizeof(kda_args_t) of the library): for bindings that call by symbol. */
KDA_API void(kda_args_init)(kda_args_t *args);

/* ---- Prefill forward: the chunked (WY) algorithm, for any number of tokens ----------------------------- */

/* Bytes of workspace kda_forward needs for this problem on this context (may be 0). Validates args. */
KDA_API kda_status_t kda_forward_workspace_size(const kda_context_t *ctx, const kda_args_t *args,
                                                size_t *workspace_bytes);

/* Bytes kda_forward keeps at args->saved for kda_backward (0: nothing, saved may stay NULL). Validates args;
 * args->saved is not read. docs/API.md §10. */
KDA_API kda_status_t kda_forward_saved_size(const kda_context_t *ctx, const kda_args_t *args, size_t *saved_bytes);

/* Compute o (and final_state, chunk_states, saved when set) for every sequence. `workspace`: at least the
 * kda_forward_workspace_size answer on the context's device, any alignment (NULL when 0). `stream`: a
 * cudaStream_t (NULL: the default stream; ignored on the CPU). One thread at a time per context. Causal, except
 * that a token's g may move the earlier tokens of its 16-token block by rounding (docs/API.md §12). */
KDA_API kda_status_t kda_forward(kda_context_t *ctx, const kda_args_t *args, void *workspace, size_t workspace_bytes,
                                 void *stream);

/* ---- Decode: the token-by-token recurrence, for few tokens per sequence (docs/API.md §7) -------------
 * Same arguments and results as kda_forward; best for T <= 16 tokens per sequence; with state_indices and
 * final_state == initial_state it updates a state pool in place. */
KDA_API kda_status_t kda_decode_workspace_size(const kda_context_t *ctx, const kda_args_t *args,
                                               size_t *workspace_bytes);
KDA_API kda_status_t kda_decode(kda_context_t *ctx, const kda_args_t *args, void *workspace, size_t workspace_bytes,
                                void *stream);

/* ---- Training backward: the gradients of every input of kda_forward (docs/API.md §11) ------------------
 * `problem` is the very kda_args_t the forward ran with (its o and final_state are not read); its
 * initial_state must still hold the state the forward started from. Gradients are with respect to the raw
 * inputs, through the in-kernel options. */
typedef struct kda_backward_args {
    size_t struct_size;        /* sizeof(kda_backward_args_t) of the header the caller was built with */
    const kda_args_t *problem; /* the forward's arguments (o and final_state are not read). Required */

    /* -- Incoming gradients ------------------------------------------------------------------------------ */
    const void *d_o;                 /* [B, T, HV, V] ∂L/∂o. Required when B * T > 0 */
    kda_dtype_t d_o_dtype;           /* FLOAT32, FLOAT16 or BFLOAT16. Default BFLOAT16 */
    const void *d_final_state;       /* ∂L/∂final_state, laid out as final_state. NULL: zero */
    kda_dtype_t d_final_state_dtype; /* FLOAT32 or BFLOAT16. Default FLOAT32 */

    /* -- Gradient outputs: each in its input's dtype or FLOAT32; required when B * T > 0 ----------------- */
    void *dq;                          /* [B, T, HQK, K] */
    kda_dtype_t dq_dtype;              /* Default BFLOAT16 */
    void *dk;                          /* [B, T, HQK, K] */
    kda_dtype_t dk_dtype;              /* Default BFLOAT16 */
    void *dv;                          /* [B, T, HV, V] */
    kda_dtype_t dv_dtype;              /* Default BFLOAT16 */
    void *dg;                          /* [B, T, HV, K] gradient of g (of the raw gate with use_gate_in_kernel) */
    kda_dtype_t dg_dtype;              /* Default BFLOAT16 */
    void *dbeta;                       /* [B, T, HV] gradient of beta (of the logit with use_beta_sigmoid) */
    kda_dtype_t dbeta_dtype;           /* Default BFLOAT16 */
    void *d_initial_state;             /* shaped as initial_state; requires it. NULL: not computed */
    kda_dtype_t d_initial_state_dtype; /* FLOAT32 or BFLOAT16. Default FLOAT32 */
    float *dA_log;                     /* [HV] float32; needs use_gate_in_kernel and A_log. NULL: not computed */
    float *ddt_bias;                   /* [HV * K] float32; needs use_gate_in_kernel and dt_bias. NULL: not computed */

    /* -- Context parallelism across ranks (appended; docs/API.md §14): problem->cp_* describe the split -- */
    const void *cp_summaries;  /* [R, HV, K, K + V] every rank's backward summary; problem->cp_post_ranks > 0 */
    size_t cp_summaries_bytes; /* bytes at cp_summaries, at least R * kda_cp_summary_size's answer */
} kda_backward_args_t;

/* As kda_args_init_sized, for the backward's struct (struct_size = the caller's sizeof). */
KDA_API void kda_backward_args_init_sized(kda_backward_args_t *args, size_t struct_size);
#define kda_backward_args_init(args) kda_backward_args_init_sized((args), sizeof(kda_backward_args_t))
KDA_API void(kda_backward_args_init)(kda_backward_args_t *args);

/* Bytes of workspace kda_backward needs (may depend on the longest sequence). Validates args. */
KDA_API kda_status_t kda_backward_workspace_size(const kda_context_t *ctx, const kda_backward_args_t *args,
                                                 size_t *workspace_bytes);

/* Compute every requested gradient; workspace and stream as for kda_forward. CUDA: K, V <= 128 (else
 * NOT_SUPPORTED naming head_dim_k or head_dim_v), no host sync (graph-capturable). */
KDA_API kda_status_t kda_backward(kda_context_t *ctx, const kda_backward_args_t *args, void *workspace,
                                  size_t workspace_bytes, void *stream);

/* ---- Context parallelism across ranks: the transport-free building blocks (docs/API.md §14) -------------
 * Each rank writes its summary, the caller all-gathers the R summaries (any collective: NCCL, MPI, torch), and
 * the rank's kda_forward / kda_backward fold the ones that chain into its sequences (args->cp_summaries). Every
 * backend; with cp_primed the summary and the forward share their work through the workspace (docs/API.md §14). */

/* Bytes of one rank's summary: HV * K * (K + V) elements of args->cp_summary_dtype. Validates args. */
KDA_API kda_status_t kda_cp_summary_size(const kda_context_t *ctx, const kda_args_t *args, size_t *summary_bytes);

/* Workspace of kda_cp_forward_summary (may be 0). Validates args. */
KDA_API kda_status_t kda_cp_forward_summary_workspace_size(const kda_context_t *ctx, const kda_args_t *args,
                                                           size_t *workspace_bytes);

/* This rank's forward summary into `summary` (summary_bytes >= kda_cp_summary_size): per value head [M | E] of
 * its last local sequence part. Reads the inputs and initial_state of args only; writes nothing else. */
KDA_API kda_status_t kda_cp_forward_summary(kda_context_t *ctx, const kda_args_t *args, void *summary,
                                            size_t summary_bytes, void *workspace, size_t workspace_bytes,
                                            void *stream);

/* Workspace of kda_cp_backward_summary (may be 0). Validates args. */
KDA_API kda_status_t kda_cp_backward_summary_workspace_size(const kda_context_t *ctx, const kda_backward_args_t *args,
                                                            size_t *workspace_bytes);

/* This rank's backward summary into `summary`: per value head [Mᵀ | dE] of its first local sequence part. Reads
 * the problem's inputs, d_o and d_final_state; writes no gradient. */
KDA_API kda_status_t kda_cp_backward_summary(kda_context_t *ctx, const kda_backward_args_t *args, void *summary,
                                             size_t summary_bytes, void *workspace, size_t workspace_bytes,
                                             void *stream);

#ifdef __cplusplus
}
#endif

#endif /* KDA_H */
