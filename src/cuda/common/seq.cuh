/*
 * Sequences on the device: bounds from cu_seqlens (clamped, so that bad offsets can never index out of
 * range: device contents cannot be validated without a host sync), and chunk numbering.
 */
#ifndef KDA_CUDA_SEQ_CUH
#define KDA_CUDA_SEQ_CUH

#include "common.cuh"

DEV int64_t cu_at(const kda_cuda_seqs_t &s, int64_t i) {
    return s.cu_seqlens_64 ? ((const int64_t *)s.cu_seqlens)[i] : (int64_t)((const int32_t *)s.cu_seqlens)[i];
}

/* First and last+1 row of sequence n. */
DEV void seq_bounds(const kda_cuda_seqs_t &s, int64_t n, int64_t *bos, int64_t *eos) {
    if (!s.cu_seqlens) {
        *bos = n * s.seq_len;
        *eos = *bos + s.seq_len;
        return;
    }
    int64_t a = cu_at(s, n), b = cu_at(s, n + 1);
    a = a < 0 ? 0 : (a > s.num_tokens ? s.num_tokens : a);
    b = b < a ? a : (b > s.num_tokens ? s.num_tokens : b);
    *bos = a;
    *eos = b;
}

/* Global index of the first chunk of sequence n (chunks are numbered sequence after sequence). */
DEV int64_t seq_chunk0(const kda_cuda_seqs_t &s, int64_t n) {
    return s.cu_seqlens ? (int64_t)s.chunk_offsets[n] : n * s.chunks_per_row;
}

/* The sequence of global chunk c, or -1 past the last chunk. */
DEV int64_t chunk_seq(const kda_cuda_seqs_t &s, int64_t c) {
    if (!s.cu_seqlens) {
        int64_t n = c / s.chunks_per_row;
        return n < s.num_seqs ? n : -1;
    }
    if (c >= s.chunk_offsets[s.num_seqs]) return -1;
    /* largest n with chunk_offsets[n] <= c: then chunk_offsets[n + 1] > c, so sequence n is not empty */
    int64_t lo = 0, hi = s.num_seqs; /* invariant: offsets[lo] <= c < offsets[hi] */
    while (hi - lo > 1) {
        int64_t mid = (lo + hi) >> 1;
        if (s.chunk_offsets[mid] <= c) lo = mid;
        else hi = mid;
    }
    return lo;
}

/* The tokens of global chunk c: its first token into *t0 and its length (≤ 0, *t0 untouched, past the last chunk;
 * ≤ 0 too for a chunk of no tokens). The backward's chunk-parallel kernels' CTA → chunk step; prep.cuh spells the
 * same lines out (its binaries are the measured ones: to be switched with a GPU run to check them). */
DEV int chunk_tokens(const kda_cuda_seqs_t &s, int64_t c, int64_t *t0) {
    const int64_t n = chunk_seq(s, c);
    if (n < 0) return 0;
    int64_t bos, eos;
    seq_bounds(s, n, &bos, &eos);
    *t0 = bos + (c - seq_chunk0(s, n)) * KDA_CHUNK;
    return (int)min((int64_t)KDA_CHUNK, eos - *t0);
}

/* The state slot of sequence n, or -1 for none (negative index, or one past the pool: clamped, see above; or a
 * slot that a later sequence names too, when `claim` is given: slots.cu). */
DEV int64_t seq_slot(const int32_t *state_indices, const int32_t *claim, int64_t num_state_slots, int64_t n) {
    if (!state_indices) return n;
    int64_t s = state_indices[n];
    if (s < 0 || s >= num_state_slots) return -1;
    return claim && claim[s] != (int32_t)n ? -1 : s;
}

#endif /* KDA_CUDA_SEQ_CUH */
