/*
 * libkda — Kimi Delta Attention (KDA) for CPUs and NVIDIA GPUs.
 *
 * The operation, per value head h and sequence, with a K×V state S (natural-log gates, as in FLA):
 *
 *     S_t = (I − β_t k_t k_tᵀ) Diag(exp(g_t)) S_{t−1} + β_t k_t v_tᵀ
 *     o_t = scale · S_tᵀ q_t
 *
 * Conventions (cuBLAS / NCCL style):
 *   - every entry point returns a kda_status_t; kda_status_string() names it and kda_last_error() gives the
 *     detail of the last failing call on the calling thread (which argument, and what was wrong with it);
 *   - on any error nothing is written to any output;
 *   - a context (kda_context_t) holds a backend: the CPU, the fp64 reference, or CUDA device N;
 *   - calls never allocate: scratch memory ("workspace") is queried with a *_workspace_size call and passed in;
 *   - on CUDA, the stream is an argument, calls are asynchronous on it and never synchronise with the host,
 *     so they can be captured in a CUDA graph. Every pointer then points to device memory, except the fields
 *     named *_host. On the CPU backends every pointer is a host pointer and calls are synchronous.
 *
 * Tensors are dense and row-major (C order) in the shapes given below; the letters are
 *   B batch rows, T tokens per row, N sequences, HQK query/key heads, HV value heads (a multiple of HQK:
 *   value head h reads query/key head h / (HV/HQK), "GVA"), K key head size, V value head size.
 * With cu_seqlens, B is 1, T is the total number of tokens and sequence n holds tokens
 * [cu_seqlens[n], cu_seqlens[n+1]); without it, N = B and sequence n is batch row n.
 *
 * Memory: no output may overlap any input or the other output (checked by address ranges: INVALID_VALUE),
 * except final_state == initial_state exactly (same address and dtype), the in-place state pool.
 *
 * Non-finite and out-of-range inputs (docs/ALGORITHM.md §7), the same on every entry point and backend:
 *   - each log decay (g, or the in-kernel gate's result) is clamped into [-80, 0]: positive or +inf -> 0,
 *     below -80 or -inf -> -80; NaN is kept;
 *   - a token whose q, k, v, log decay or beta (after the in-kernel transforms) holds an inf or NaN "poisons"
 *     its (sequence, value head): o of that token and of every later token, and the final state, are NaN;
 *     earlier tokens' outputs are exactly as without it; nothing else is affected (a q or k poisons the value
 *     heads of its group);
 *   - an inf or NaN in column j of a (sequence, value head)'s initial state (value channel j; row j of the
 *     [V, K] block with state_v_first) makes value channel j NaN: element j of o for every token of the
 *     sequence and column j of its final state; the other channels are exactly as without that column (the
 *     recurrence never mixes value channels);
 *   - huge finite values whose float32 arithmetic overflows (e.g. 1e30) leave the outputs from that token on
 *     unspecified, never earlier ones (the CUDA chunked forward treats an element of q, k, v or beta with
 *     |x| >= 2^56, after the in-kernel transforms, as poisoning: NaN from that token on);
 *   - state pool slots that no sequence names are left bit-identical.
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

/* ---------------------------------------------------------------------------------------------------------
 * Version
 * ------------------------------------------------------------------------------------------------------- */
#define KDA_VERSION_MAJOR 0
#define KDA_VERSION_MINOR 1
#define KDA_VERSION_PATCH 0
/* KDA_VERSION = MAJOR * 10000 + MINOR * 100 + PATCH, the value kda_version() returns at run time. */
#define KDA_VERSION (KDA_VERSION_MAJOR * 10000 + KDA_VERSION_MINOR * 100 + KDA_VERSION_PATCH)

/* The version of the library that is linked, as KDA_VERSION; compare with the header's to detect a mismatch. */
KDA_API int kda_version(void);

/* ---------------------------------------------------------------------------------------------------------
 * Status and errors
 * ------------------------------------------------------------------------------------------------------- */
typedef enum kda_status {
    KDA_STATUS_SUCCESS = 0,
    KDA_STATUS_INVALID_VALUE = 1,          /* an argument is wrong; kda_last_error() names it */
    KDA_STATUS_NOT_SUPPORTED = 2,          /* valid, but not available on this backend, build or device */
    KDA_STATUS_INSUFFICIENT_WORKSPACE = 3, /* workspace_bytes is smaller than the *_workspace_size answer */
    KDA_STATUS_ALLOC_FAILED = 4,           /* kda_create could not allocate the context */
    KDA_STATUS_BACKEND_ERROR = 5,          /* the CUDA runtime reported an error (its text is in the message) */
    KDA_STATUS_INTERNAL_ERROR = 6          /* a bug in libkda; please report it with the message */
} kda_status_t;

/* A short constant name for a status, e.g. "KDA_STATUS_INVALID_VALUE". Never NULL. */
KDA_API const char *kda_status_string(kda_status_t status);

/* The message of the last call on this thread that did not return KDA_STATUS_SUCCESS, e.g.
 * "kda_forward: argument 'cu_seqlens': not monotone (cu_seqlens[2] = 7 < cu_seqlens[1] = 9)".
 * A successful call leaves it as it was. "" if no call has failed on this thread. Never NULL. */
KDA_API const char *kda_last_error(void);

/* ---------------------------------------------------------------------------------------------------------
 * Data types
 * ------------------------------------------------------------------------------------------------------- */
typedef enum kda_dtype {
    KDA_FLOAT32 = 0,
    KDA_FLOAT16 = 1,
    KDA_BFLOAT16 = 2,
    KDA_INT32 = 3,
    KDA_INT64 = 4
} kda_dtype_t;

/* Bytes per element of a dtype (4, 2, 2, 4, 8), or 0 for a value outside the enum. */
KDA_API size_t kda_dtype_size(kda_dtype_t dtype);

/* ---------------------------------------------------------------------------------------------------------
 * Context: one backend
 * ------------------------------------------------------------------------------------------------------- */
typedef enum kda_backend {
    KDA_BACKEND_AUTO = 0,      /* CUDA device `device` if this build and machine have one, else the CPU */
    KDA_BACKEND_CPU = 1,       /* chunked algorithm, float32 arithmetic, multi-threaded */
    KDA_BACKEND_REFERENCE = 2, /* the oracle: float64 token-by-token recurrence, one thread; slow, exact */
    KDA_BACKEND_CUDA = 3       /* NVIDIA GPU (sm_90a kernels) */
} kda_backend_t;

typedef struct kda_context kda_context_t;

/* Create a context for `backend`. `device` is the CUDA device ordinal (ignored by the CPU backends).
 * CUDA on a build or machine without it returns KDA_STATUS_NOT_SUPPORTED; AUTO then falls back to the CPU and
 * leaves the reason CUDA was not used in kda_last_error() (no driver, no device, unsupported architecture, a
 * build without CUDA); kda_get_backend() tells which backend AUTO chose.
 * The CPU backend starts its worker threads here: KDA_NUM_THREADS from the environment (a whole number in
 * [1, 1024]; any other value fails with KDA_STATUS_INVALID_VALUE naming it), else one per core. */
KDA_API kda_status_t kda_create(kda_context_t **ctx, kda_backend_t backend, int device);

/* Destroy a context and join its threads. NULL is accepted and does nothing. */
KDA_API kda_status_t kda_destroy(kda_context_t *ctx);

/* The backend a context runs on (never KDA_BACKEND_AUTO). */
KDA_API kda_status_t kda_get_backend(const kda_context_t *ctx, kda_backend_t *backend);

/* A short name of a backend: "auto", "cpu", "reference", "cuda". Never NULL. */
KDA_API const char *kda_backend_name(kda_backend_t backend);

/* CPU backend: use `num_threads` worker threads (>= 1) from now on. Other backends: NOT_SUPPORTED.
 * Workspace sizes depend on the thread count: query them again after this call. */
KDA_API kda_status_t kda_set_num_threads(kda_context_t *ctx, int num_threads);

/* The number of threads of a CPU context (1 for the reference backend, 0 for CUDA). */
KDA_API kda_status_t kda_get_num_threads(const kda_context_t *ctx, int *num_threads);

/* ---------------------------------------------------------------------------------------------------------
 * Intra-card context parallelism: kda_args_t.cp_mode and cp_piece_len
 * ------------------------------------------------------------------------------------------------------- */
typedef enum kda_cp_mode {
    KDA_CP_AUTO = 0, /* the library decides per call whether and how to split (the default) */
    KDA_CP_OFF = 1,  /* never split: one serial chunk chain per (sequence, head) */
    KDA_CP_ON = 2    /* always take the split path, with pieces of cp_piece_len tokens */
} kda_cp_mode_t;

#define KDA_CHUNK_SIZE 64                  /* tokens per chunk of the chunked algorithm: chunk_states' rows */
#define KDA_CP_PIECE_MULTIPLE 64           /* cp_piece_len is a multiple of the chunk (tokens) */
/* The largest cp_piece_len: 2^24 = 16,777,216 tokens (262,144 chunks). A piece that long splits nothing a
 * card holds at a useful head count, and the bound keeps a piece's chunk and token counts far inside the
 * 32-bit arithmetic of the kernels. */
#define KDA_CP_MAX_PIECE_LEN (1 << 24)

/* ---------------------------------------------------------------------------------------------------------
 * The problem: one struct for the chunked forward (kda_forward) and the recurrent decode (kda_decode)
 *
 * Initialise it with kda_args_init(), which sets every field to its default (the defaults are written
 * beside each field), then set the fields you use. struct_size lets later versions append fields
 * (backward, intra-card context parallelism, per-chunk states) without breaking programs built against
 * this one: leave it as kda_args_init() set it.
 * ------------------------------------------------------------------------------------------------------- */
typedef struct kda_args {
    size_t struct_size;           /* sizeof(kda_args_t) of the header the caller was built with */

    /* -- Problem size ------------------------------------------------------------------------------------ */
    int64_t batch;                /* B >= 0: number of equal-length rows; must be 1 with cu_seqlens. N * HV * K
                                     * V must not exceed 2^52, whatever seq_len. Default 1 */
    int64_t seq_len;              /* T >= 0: tokens per row (total tokens with cu_seqlens). Default 0 */
    int32_t num_qk_heads;         /* HQK >= 1: query/key heads. Default 1 */
    int32_t num_v_heads;          /* HV >= 1: value heads, a multiple of HQK (GVA when larger). Default 1 */
    int32_t head_dim_k;           /* K in [1, 256]: key head size (every backend). Default 128 */
    int32_t head_dim_v;           /* V in [1, 256]: value head size, independent of K. Default 128 */

    /* -- Variable-length sequences (optional) ------------------------------------------------------------ */
    const void *cu_seqlens;       /* [N+1] offsets: 0 = cu[0] <= cu[1] <= ... <= cu[N] = T; empty sequences
                                     are allowed. NULL: N = B equal-length sequences. Default NULL */
    kda_dtype_t cu_seqlens_dtype; /* KDA_INT32 or KDA_INT64. Default KDA_INT32 */
    int64_t num_seqs;             /* N >= 0 with cu_seqlens (the array has N+1 entries). Default 0 */
    const void *cu_seqlens_host;  /* CUDA only, optional: a host copy of cu_seqlens; when given, its contents
                                     are validated (device contents cannot be read without a sync, so the
                                     kernels only clamp them). Default NULL */

    /* -- Inputs ------------------------------------------------------------------------------------------ */
    kda_dtype_t dtype;            /* dtype of q, k and v: FLOAT32, FLOAT16 or BFLOAT16. Default BFLOAT16 */
    const void *q;                /* [B, T, HQK, K] queries */
    const void *k;                /* [B, T, HQK, K] keys */
    const void *v;                /* [B, T, HV, V] values */
    const void *g;                /* [B, T, HV, K] gate: log decay (<= 0), or the raw gate input when
                                     use_gate_in_kernel is set */
    kda_dtype_t g_dtype;          /* FLOAT32, FLOAT16 or BFLOAT16. Default BFLOAT16 */
    const void *beta;             /* [B, T, HV] write strength β, or its logit when use_beta_sigmoid is set
                                     ([B, T, HV, V] with beta_headwise) */
    kda_dtype_t beta_dtype;       /* FLOAT32, FLOAT16 or BFLOAT16. Default BFLOAT16 */

    /* -- Output ------------------------------------------------------------------------------------------ */
    void *o;                      /* [B, T, HV, V] output, fully written */
    kda_dtype_t o_dtype;          /* FLOAT32, FLOAT16 or BFLOAT16. Default BFLOAT16 */

    /* -- States (optional) ------------------------------------------------------------------------------- */
    const void *initial_state;    /* [N, HV, K, V] (V-first: [N, HV, V, K]) state before each sequence, or
                                     with state_indices a pool of [num_state_slots, ...]. NULL: zeros */
    kda_dtype_t initial_state_dtype; /* FLOAT32 or BFLOAT16. Default FLOAT32 */
    void *final_state;            /* [N, HV, K, V] (V-first: [N, HV, V, K]) state after each sequence, or
                                     with state_indices a pool of [num_state_slots, ...]; may be the same
                                     memory as initial_state (in-place update). NULL: not written */
    kda_dtype_t final_state_dtype; /* FLOAT32 or BFLOAT16. Default FLOAT32 */
    int state_v_first;            /* 1: states are stored [V, K] per head (FLA's state_v_first). Default 0 */
    const int32_t *state_indices; /* [N] optional slot of each sequence in the state pools (vLLM's
                                     ssm_state_indices): sequence n reads initial_state[state_indices[n]] and
                                     writes final_state[state_indices[n]]; a negative index means no slot
                                     (start from zeros, write nothing). Slots must be distinct. 2-D [N, T_max]
                                     for speculative decoding: see state_indices_cols. On the CPU backends the
                                     contents are checked (range, distinct, O(N)); on CUDA they cannot be read
                                     without a sync: the kernels treat a slot outside [0, num_state_slots) as
                                     negative and clamp num_accepted_tokens into [1, T_max]; a slot named by
                                     several rows belongs to the last of them (highest sequence index), and
                                     the other rows' entries naming it act as negative (start from zeros,
                                     write nothing): the same bytes on every run. That takes one int32 of
                                     workspace per slot (num_state_slots) when N >= 2. Default NULL */
    int64_t num_state_slots;      /* number of slots in the pools when state_indices is set. Default 0 */

    /* -- Options (FLA's chunk_kda flags, same meaning) --------------------------------------------------- */
    float scale;                  /* output scale; 0 selects K^-1/2. Default 0 */
    int use_qk_l2norm;            /* 1: q and k are divided by sqrt(sum over K of x^2 + 1e-6) before use.
                                     (use_qk_l2norm_in_kernel) Default 0 */
    int use_gate_in_kernel;       /* 1: g is the raw gate input; the log decay is
                                     -exp(A_log[h]) * softplus(g + dt_bias[h, :]), or, when lower_bound is set,
                                     lower_bound * sigmoid(exp(A_log[h]) * (g + dt_bias[h, :])) (A_log NULL:
                                     lower_bound * sigmoid(g + dt_bias[h, :])). Default 0 */
    const float *A_log;           /* [HV] float32, with use_gate_in_kernel; required unless lower_bound is set */
    const float *dt_bias;         /* [HV * K] float32, optional, with use_gate_in_kernel */
    float lower_bound;            /* the sigmoid gate's bound, < 0; 0 means unset. With safe_gate and
                                     use_gate_in_kernel it is required and must lie in [-5, 0). Default 0 */
    int safe_gate;                /* 1: the caller promises bounded gates (FLA's safe_gate); with
                                     use_gate_in_kernel it requires lower_bound. Default 0 */
    int use_beta_sigmoid;         /* 1: beta is a logit and β = sigmoid(beta). (use_beta_sigmoid_in_kernel)
                                     CUDA forms it as torch does in fp32 (1 / (1 + expf(-x)), IEEE
                                     division): the same β bits as a caller's torch.sigmoid in float32.
                                     Default 0 */
    int allow_neg_eigval;         /* 1: β = 2 * sigmoid(beta), in (0, 2); requires use_beta_sigmoid. Default 0 */

    /* -- Speculative decoding and headwise β (appended after the first release; see struct_size) --------- */
    int64_t state_indices_cols;   /* 0: state_indices is 1-D, [N], one slot per sequence (above). T_max >= 1:
                                     state_indices is 2-D, [N, T_max] (FLA/vLLM speculative decoding, FLA's 2-D
                                     ssm_state_indices): sequence n reads its initial state from slot
                                     state_indices[n][a_n - 1], a_n = num_accepted_tokens[n] (1 without it), and
                                     writes the state after each of its tokens t = 0 .. len_n - 1 (len_n <= T_max)
                                     to slot state_indices[n][t] of final_state (the pools may be one memory).
                                     A negative entry: read zeros / write nothing. The slots a row touches must
                                     not be touched by another row, and a row's written slots are distinct (its
                                     read slot may be one of them: it is read before anything is written).
                                     Default 0 */
    int64_t state_indices_row_stride; /* elements between the rows of a 2-D state_indices; 0 means
                                     state_indices_cols (contiguous rows). Default 0 */
    const int32_t *num_accepted_tokens; /* [N] int32 in [1, T_max], with a 2-D state_indices only: the number
                                     of tokens the previous step accepted (the slot of the last one holds the
                                     state to start from). Device memory on CUDA. NULL: every a_n = 1.
                                     Default NULL */
    int beta_headwise;            /* 1: beta is [B, T, HV, V], one β per value channel (FLA's headwise β):
                                     S_t = S' + k_t (β_t ⊙ (v_t − S'ᵀ k_t))ᵀ with S' = Diag(exp(g_t)) S_{t−1}.
                                     Default 0 */

    /* -- Intra-card context parallelism (appended; see struct_size) --------------------------------------
     * CUDA kda_forward may split a long sequence into pieces of whole chunks that run in parallel (each
     * piece's affine map of the state, then a short scan over the pieces: docs/ALGORITHM.md §4). The split is
     * exact: results do not depend on it beyond float rounding. KDA_CP_AUTO lets the library decide per call
     * from the sequence lengths, heads and SM count (no split for short sequences or when the (sequence,
     * head) grid already fills the card; in a mixed batch only the long sequences are split); the other
     * modes are for tests and benchmarks. Problems the CUDA backend runs through its recurrent kernel
     * (headwise β, 2-D state_indices, kda_decode's short sequences) are never split, whatever the mode. The
     * CPU and reference backends accept these fields and ignore them. */
    kda_cp_mode_t cp_mode;        /* KDA_CP_AUTO, KDA_CP_OFF or KDA_CP_ON. Default KDA_CP_AUTO (0) */
    int64_t cp_piece_len;         /* with KDA_CP_ON: tokens per piece, a multiple of KDA_CP_PIECE_MULTIPLE
                                     (the chunk, 64) in [64, KDA_CP_MAX_PIECE_LEN]; sequences no longer than it
                                     stay whole. Must be 0 with the other modes. Default 0 */

    /* -- Chunk-start states (appended; see struct_size) --------------------------------------------------
     * For prefix caching in serving engines (FLA's return_intermediate_states): kda_forward also writes the
     * state before every chunk of KDA_CHUNK_SIZE tokens of every sequence, S at token 0, 64, 128, ... of the
     * sequence, read or written in the layout of the other states (state_v_first). Sequence n's chunks are rows
     * rows_n .. rows_n + ceil(len_n / 64) − 1, with rows_n = Σ_{m<n} ceil(len_m / 64) (equal-length rows:
     * b · ceil(T / 64) + c), so row rows_n is the sequence's initial state (zeros without one) and an empty
     * sequence has no row. Under the non-finite contract (docs/ALGORITHM.md §7) a chunk's row is the state
     * before its tokens: rows after a poisoning token are NaN. kda_forward only (kda_decode refuses it); not
     * with beta_headwise or a 2-D state_indices (KDA_STATUS_NOT_SUPPORTED); the CUDA backend writes it for
     * K <= 128, with one more pass of its recurrence kernel (no O products). */
    void *chunk_states;           /* [Σ_n ceil(len_n / 64), HV, K, V] (V-first: [.., HV, V, K]) or NULL: not
                                     written. Default NULL */
    kda_dtype_t chunk_states_dtype; /* FLOAT32 or BFLOAT16. Default FLOAT32 */

    /* -- Training: what the forward keeps for the backward (appended; see struct_size) ------------------
     * A training step can let kda_forward keep what kda_backward would otherwise recompute. The CUDA backend
     * keeps the chunk blocks of its preparation stage (docs/ALGORITHM.md §6: 1,160 bytes per token and value
     * head at K = V = 128, 644 at 64), so that kda_backward does not rerun that stage and its workspace is
     * smaller by as much, and with bfloat16 inputs, where the backward's stage that recomputes the states would
     * fill the GPU (many sequence-heads), the state at every chunk start in bfloat16 (+512 bytes per token and
     * value head at K = V = 128, +128 at 64; that stage then does not run), and where that stage's state-gradient
     * chain may be split by intra-card CP, the forward's maps of its split pieces (+64 KB per piece and value
     * head at K = 128), which spare the backward half of its pre-scan; the CPU backends keep nothing. Ask
     * kda_forward_saved_size for the bytes, give kda_forward that memory here (device memory, any alignment), leave it unchanged until the
     * backward, and pass the same kda_args_t, these fields included, as kda_backward's problem: it then reads
     * the memory instead of recomputing (its contents are not checked: a buffer of another call or other
     * inputs gives wrong gradients). kda_forward only (kda_decode refuses it). */
    void *saved;                  /* the forward writes, the backward reads; NULL: nothing kept, the backward
                                     recomputes. Default NULL */
    size_t saved_bytes;           /* bytes at saved: at least kda_forward_saved_size's answer when saved is
                                     set. Default 0 */
} kda_args_t;

/* Fill `args` with the defaults written beside each field and set struct_size. kda_args_init passes the
 * size of the struct this header declares, so that a newer library never writes past an older program's
 * struct: the library writes min(struct_size, its own sizeof(kda_args_t)) bytes of defaults and zeros the
 * rest. A struct larger than the library's (a program built against a newer header) is then refused by
 * every call with KDA_STATUS_NOT_SUPPORTED; a smaller one, from an older header, is accepted and its
 * missing fields take their defaults. */
KDA_API void kda_args_init_sized(kda_args_t *args, size_t struct_size);
#define kda_args_init(args) kda_args_init_sized((args), sizeof(kda_args_t))
/* The same as a function (writes sizeof(kda_args_t) of the library): for bindings that call by symbol. */
KDA_API void(kda_args_init)(kda_args_t *args);

/* ---------------------------------------------------------------------------------------------------------
 * Prefill forward: the chunked (WY) algorithm, for any number of tokens
 * ------------------------------------------------------------------------------------------------------- */

/* Bytes of workspace kda_forward needs for this problem on this context (may be 0). Validates args. */
KDA_API kda_status_t kda_forward_workspace_size(const kda_context_t *ctx, const kda_args_t *args,
                                                size_t *workspace_bytes);

/* Bytes kda_forward keeps at args->saved for kda_backward (0: this backend or problem keeps nothing, and
 * saved may stay NULL). Validates args as kda_forward_workspace_size does; args->saved is not read. */
KDA_API kda_status_t kda_forward_saved_size(const kda_context_t *ctx, const kda_args_t *args, size_t *saved_bytes);

/* Compute o (and final_state if set) for every sequence. `workspace` points to workspace_bytes bytes, at
 * least the size kda_forward_workspace_size answered, on the context's device (host memory for the CPU
 * backends), with any alignment; it may be NULL when that size is 0. Its contents need not be initialised
 * and are garbage afterwards. `stream` is a cudaStream_t (NULL: the legacy default stream); the CPU
 * backends ignore it. A context may be used by one thread at a time. */
KDA_API kda_status_t kda_forward(kda_context_t *ctx, const kda_args_t *args, void *workspace,
                                 size_t workspace_bytes, void *stream);

/* ---------------------------------------------------------------------------------------------------------
 * Decode: the token-by-token recurrence (FLA's fused_recurrent_kda), for few tokens per sequence
 *
 * Same arguments and results as kda_forward; with state_indices and final_state == initial_state it
 * updates a state pool in place, as vLLM's decode step does. Best for T <= 16 tokens per sequence.
 * Speculative decoding (2-D state_indices, num_accepted_tokens) and headwise β run on every backend through
 * both entry points (kda_forward then takes the token recurrence).
 * CUDA: a dedicated recurrent kernel (fp32 arithmetic; any K, V in [1, 256], no alignment requirement) for
 * fp32 / fp16 inputs at any length and bf16 inputs up to 8 tokens per sequence on average (num_tokens / N,
 * KDA_DECODE_MAX_TOKENS_PER_SEQ in src/internal.h); longer bf16 problems run through the chunked kernels.
 * Workspace 0 for the recurrent kernel.
 * ------------------------------------------------------------------------------------------------------- */
KDA_API kda_status_t kda_decode_workspace_size(const kda_context_t *ctx, const kda_args_t *args,
                                               size_t *workspace_bytes);
KDA_API kda_status_t kda_decode(kda_context_t *ctx, const kda_args_t *args, void *workspace,
                                size_t workspace_bytes, void *stream);

/* ---------------------------------------------------------------------------------------------------------
 * Training backward: the gradients of every input of kda_forward
 *
 * The backward has its own argument struct. It points to the forward's kda_args_t (not a copy embedded in
 * it) so that the two structs can each grow by appending fields without moving the other's, and so that the
 * caller passes the very struct the forward ran with: its sizes, inputs, options and initial_state are read;
 * its o and final_state are ignored. initial_state must still hold the state the forward started from (after
 * an in-place forward on a state pool it holds the final state: keep a copy).
 *
 * Loss L: d_o = ∂L/∂o and optionally d_final_state = ∂L/∂final_state (FLA's dht; NULL: zero). Every gradient
 * is with respect to the caller's raw input, through the in-kernel options (l2norm of q and k, the gate, the
 * β sigmoid, scale); the gate's clamp into [-80, 0] passes no gradient where it clamps. With GVA the G value
 * heads that share a query/key head sum into its dq and dk. dA_log and ddt_bias sum over every token and
 * sequence. Gradient outputs are fully written (d_initial_state too, zeros for slots no sequence reads).
 * A column of initial_state holding an inf or NaN is NaN as in the forward; then for that (sequence, value
 * head) dg and dbeta of its tokens, dq and dk of its query/key head at those tokens, and its dA_log and
 * ddt_bias are NaN, while dv and d_initial_state are as without the column (docs/ALGORITHM.md §7).
 * ------------------------------------------------------------------------------------------------------- */
typedef struct kda_backward_args {
    size_t struct_size;            /* sizeof(kda_backward_args_t) of the header the caller was built with */
    const kda_args_t *problem;     /* the forward's arguments (o and final_state are not read). Required */

    /* -- Incoming gradients ------------------------------------------------------------------------------ */
    const void *d_o;               /* [B, T, HV, V] ∂L/∂o. Required when B * T > 0 */
    kda_dtype_t d_o_dtype;         /* FLOAT32, FLOAT16 or BFLOAT16. Default BFLOAT16 */
    const void *d_final_state;     /* ∂L/∂final_state, shaped and laid out as final_state (state_v_first,
                                      state pools). NULL: zero. Default NULL */
    kda_dtype_t d_final_state_dtype; /* FLOAT32 or BFLOAT16. Default FLOAT32 */

    /* -- Gradient outputs: each in its input's dtype or FLOAT32 ------------------------------------------ */
    void *dq;                      /* [B, T, HQK, K]. Required when B * T > 0 */
    kda_dtype_t dq_dtype;          /* Default BFLOAT16 */
    void *dk;                      /* [B, T, HQK, K]. Required when B * T > 0 */
    kda_dtype_t dk_dtype;          /* Default BFLOAT16 */
    void *dv;                      /* [B, T, HV, V]. Required when B * T > 0 */
    kda_dtype_t dv_dtype;          /* Default BFLOAT16 */
    void *dg;                      /* [B, T, HV, K] gradient of g (of the raw gate input with
                                      use_gate_in_kernel). Required when B * T > 0 */
    kda_dtype_t dg_dtype;          /* Default BFLOAT16 */
    void *dbeta;                   /* [B, T, HV] gradient of beta (of the logit with use_beta_sigmoid).
                                      Required when B * T > 0 */
    kda_dtype_t dbeta_dtype;       /* Default BFLOAT16 */
    void *d_initial_state;         /* shaped as initial_state (FLA's dh0); requires initial_state. NULL: not
                                      computed. Default NULL */
    kda_dtype_t d_initial_state_dtype; /* FLOAT32 or BFLOAT16. Default FLOAT32 */
    float *dA_log;                 /* [HV] float32; requires use_gate_in_kernel and A_log. NULL: not
                                      computed. Default NULL */
    float *ddt_bias;               /* [HV * K] float32; requires use_gate_in_kernel and dt_bias. NULL: not
                                      computed. Default NULL */
} kda_backward_args_t;

/* As kda_args_init_sized, for the backward's struct (struct_size = the caller's sizeof). */
KDA_API void kda_backward_args_init_sized(kda_backward_args_t *args, size_t struct_size);
#define kda_backward_args_init(args) kda_backward_args_init_sized((args), sizeof(kda_backward_args_t))
KDA_API void(kda_backward_args_init)(kda_backward_args_t *args);

/* Bytes of workspace kda_backward needs (may depend on the longest sequence). Validates args. */
KDA_API kda_status_t kda_backward_workspace_size(const kda_context_t *ctx, const kda_backward_args_t *args,
                                                 size_t *workspace_bytes);

/* Compute every requested gradient. Workspace and stream as for kda_forward. The CUDA backend takes K, V <= 128
 * (KDA_STATUS_NOT_SUPPORTED naming head_dim_k or head_dim_v beyond) and needs no host sync (graph-capturable). */
KDA_API kda_status_t kda_backward(kda_context_t *ctx, const kda_backward_args_t *args, void *workspace,
                                  size_t workspace_bytes, void *stream);

#ifdef __cplusplus
}
#endif

#endif /* KDA_H */
