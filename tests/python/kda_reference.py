"""An fp64, token-by-token numpy reference for KDA, written from the definition (independent of libkda's oracle).

Per sequence and value head h (query/key head h // (HV // H)), with a K×V state S:

    S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T
    o_t = scale * S_t^T q_t

with FLA's input transforms:
    l2norm        x / sqrt(sum(x^2) + 1e-6) over K, for q and k
    softplus gate g = -exp(A_log[h]) * softplus(g + dt_bias[h, :])
    bounded gate  g = lower_bound * sigmoid(exp(A_log[h]) * (g + dt_bias[h, :]))   (A_log None: without exp(A_log))
    beta sigmoid  beta = sigmoid(beta), or 2 * sigmoid(beta) with allow_neg_eigval
"""

import numpy as np


def _f64(x):
    return None if x is None else np.asarray(x, dtype=np.float64)


def softplus(x):
    return np.logaddexp(0.0, x)


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def kda_reference(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                  use_qk_l2norm=False, use_gate_in_kernel=False, A_log=None, dt_bias=None, lower_bound=None,
                  use_beta_sigmoid=False, allow_neg_eigval=False, cu_seqlens=None, state_v_first=False,
                  state_indices=None, num_accepted_tokens=None):
    """Returns (o [B, T, HV, V] float64, final_state float64 or None).

    With state_indices, initial_state is a pool [slots, ...] and the returned final state is a copy of the pool
    with each sequence's final state written at its slot (negative slot: start from zeros, write nothing).
    A 2-D state_indices [N, T_max] is FLA's speculative decoding: sequence n starts from slot
    state_indices[n, num_accepted_tokens[n] - 1] (column 0 without them) and the state after its token t is
    written to slot state_indices[n, t]. beta [B, T, HV, V] is headwise (one beta per value channel).
    """
    q, k, v, g, beta = map(_f64, (q, k, v, g, beta))
    A_log, dt_bias, h0 = _f64(A_log), _f64(dt_bias), _f64(initial_state)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    G = HV // H
    if scale is None:
        scale = K ** -0.5
    if cu_seqlens is None:
        seqs = [(b, 0, T) for b in range(B)]
    else:
        cu = [int(c) for c in np.asarray(cu_seqlens)]
        seqs = [(0, cu[n], cu[n + 1]) for n in range(len(cu) - 1)]
    N = len(seqs)

    def to_kv(s):  # stored layout -> [HV, K, V]
        return np.swapaxes(s, -1, -2) if state_v_first else s

    def from_kv(s):
        return np.swapaxes(s, -1, -2) if state_v_first else s

    o = np.zeros((B, T, HV, V))
    if state_indices is not None:
        final = h0.copy()
    else:
        final = np.zeros((N, HV, V, K) if state_v_first else (N, HV, K, V))
    head_of = np.arange(HV) // G
    for n, (b, bos, eos) in enumerate(seqs):
        per_token = state_indices is not None and np.asarray(state_indices).ndim == 2
        if per_token:
            col = 0 if num_accepted_tokens is None else int(num_accepted_tokens[n]) - 1
            slot = int(state_indices[n][col])
        else:
            slot = n if state_indices is None else int(state_indices[n])
        if h0 is not None and slot >= 0:
            S = to_kv(h0[slot]).copy()
        else:
            S = np.zeros((HV, K, V))
        for t in range(bos, eos):
            qt = q[b, t][head_of]  # [HV, K]
            kt = k[b, t][head_of]
            if use_qk_l2norm:
                qt = qt / np.sqrt((qt * qt).sum(-1, keepdims=True) + 1e-6)
                kt = kt / np.sqrt((kt * kt).sum(-1, keepdims=True) + 1e-6)
            gt = g[b, t]  # [HV, K]
            if use_gate_in_kernel:
                x = gt + (dt_bias.reshape(HV, K) if dt_bias is not None else 0.0)
                if lower_bound is not None:
                    if A_log is not None:
                        x = np.exp(A_log.reshape(HV, 1)) * x
                    gt = lower_bound * sigmoid(x)
                else:
                    gt = -np.exp(A_log.reshape(HV, 1)) * softplus(x)
            bt = beta[b, t]  # [HV], or [HV, V] headwise
            if use_beta_sigmoid:
                bt = sigmoid(bt) * (2.0 if allow_neg_eigval else 1.0)
            if bt.ndim == 1:
                bt = bt[:, None]
            vt = v[b, t]  # [HV, V]
            S = np.exp(gt)[:, :, None] * S
            kS = np.einsum("hk,hkv->hv", kt, S)
            S = S + kt[:, :, None] * (bt * (vt - kS))[:, None, :]
            o[b, t] = scale * np.einsum("hk,hkv->hv", qt, S)
            if per_token and int(state_indices[n][t - bos]) >= 0:
                final[int(state_indices[n][t - bos])] = from_kv(S)
        if state_indices is None:
            final[n] = from_kv(S)
        elif slot >= 0 and not per_token:
            final[slot] = from_kv(S)
    return o, (final if (output_final_state or state_indices is not None) else None)


def rel_err(out, ref) -> float:
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    den = np.linalg.norm(ref)
    return float(np.linalg.norm(out - ref) / (den if den > 0 else 1.0))


def make_inputs(rng, B, T, H, HV, K, V, dtype=np.float32, *, l2=False, gate="none", beta_sigmoid=False,
                state=False, N=None, state_v_first=False, slots=None):
    """Random, never-zero inputs. k is unit-norm unless l2 (then q, k are scaled up so the norm matters).
    gate: "none" (log decay in (log 0.6, 0)), or the raw input of an in-kernel gate (any other value)."""
    q = rng.standard_normal((B, T, H, K))
    k = rng.standard_normal((B, T, H, K))
    if l2:
        q, k = 3.0 * q, 2.5 * k
    else:
        k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((B, T, HV, V))
    if gate == "none":
        g = np.log(rng.uniform(0.6, 0.999, (B, T, HV, K)))
    else:
        g = rng.standard_normal((B, T, HV, K))
    if beta_sigmoid:
        beta = rng.standard_normal((B, T, HV))
    else:
        beta = rng.uniform(0.05, 0.95, (B, T, HV))
    out = dict(q=q.astype(dtype), k=k.astype(dtype), v=v.astype(dtype), g=g.astype(dtype), beta=beta.astype(dtype))
    if state:
        n = slots if slots is not None else (N if N is not None else B)
        shape = (n, HV, V, K) if state_v_first else (n, HV, K, V)
        out["initial_state"] = (0.5 * rng.standard_normal(shape)).astype(np.float32)
    return out
