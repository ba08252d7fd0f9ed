"""numpy inputs through kda.chunk_kda and kda.fused_recurrent_kda against the fp64 reference of kda_reference.py."""

import numpy as np
import pytest

import kda
from kda_reference import kda_reference, make_inputs, rel_err

TOL = {np.float32: 1e-5, np.float16: 1e-2}
ENTRIES = {"chunk": kda.chunk_kda, "fused": kda.fused_recurrent_kda}


def gate_params(rng, mode, HV, K):
    """Keyword arguments of a gate mode, for kda (kw) and for the reference (ref)."""
    A_log = rng.uniform(-1.0, 1.0, HV).astype(np.float32)
    dt_bias = (0.5 * rng.standard_normal(HV * K)).astype(np.float32)
    if mode == "none":
        return {}, {}
    if mode == "softplus":
        kw = dict(use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)
    elif mode == "softplus_nobias":
        kw = dict(use_gate_in_kernel=True, A_log=A_log)
    elif mode == "lb":
        kw = dict(use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, lower_bound=-3.0)
    elif mode == "lb_noA":
        kw = dict(use_gate_in_kernel=True, dt_bias=dt_bias, lower_bound=-2.0)
    elif mode == "safe":
        kw = dict(use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0, safe_gate=True)
    else:
        raise AssertionError(mode)
    ref = {key: val for key, val in kw.items() if key != "safe_gate"}
    return kw, ref


def beta_params(mode):
    if mode == "plain":
        return {}, {}
    if mode == "sigmoid":
        return dict(use_beta_sigmoid_in_kernel=True), dict(use_beta_sigmoid=True)
    if mode == "neg":
        return (dict(use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True),
                dict(use_beta_sigmoid=True, allow_neg_eigval=True))
    raise AssertionError(mode)


# name: B, T, H, HV, K, V, cu_seqlens, dtype, l2, gate, beta, initial state, final state, state_v_first
CASES = {
    "basic":         (2, 37, 2, 2, 32, 32, None, np.float32, False, "none", "plain", False, False, False),
    "k_ne_v":        (1, 70, 1, 1, 32, 48, None, np.float32, False, "none", "plain", True, True, False),
    "gva2":          (2, 20, 2, 4, 16, 16, None, np.float32, False, "none", "sigmoid", True, True, False),
    "gva4_l2":       (1, 65, 1, 4, 32, 16, None, np.float32, True, "none", "plain", False, True, False),
    "varlen":        (1, 100, 2, 4, 32, 32, [0, 5, 5, 70, 71, 100], np.float32, False, "softplus", "plain",
                      True, True, False),
    "t1":            (3, 1, 1, 2, 64, 64, None, np.float32, False, "none", "plain", True, True, False),
    "t130_bounded":  (1, 130, 1, 1, 64, 64, None, np.float32, False, "lb", "plain", False, True, False),
    "v_first":       (2, 33, 1, 2, 16, 24, None, np.float32, False, "none", "plain", True, True, True),
    "v_first_varlen": (1, 40, 1, 2, 32, 32, [0, 0, 17, 40], np.float32, False, "lb_noA", "sigmoid", True, True,
                       True),
    "softplus_nobias": (2, 25, 1, 1, 32, 32, None, np.float32, False, "softplus_nobias", "neg", True, False,
                        False),
    "safe_gate_l2":  (1, 50, 2, 2, 32, 32, None, np.float32, True, "safe", "sigmoid", True, True, False),
    "fp16":          (2, 40, 1, 2, 32, 32, None, np.float16, True, "softplus", "sigmoid", True, True, False),
    "fp16_varlen":   (1, 48, 1, 2, 64, 64, [0, 1, 30, 30, 48], np.float16, False, "none", "plain", True, True,
                      True),
}


def run_case(entry, name, seed=0, **extra):
    B, T, H, HV, K, V, cu, dtype, l2, gate, bmode, state, final, vfirst = CASES[name]
    rng = np.random.default_rng(seed)
    N = B if cu is None else len(cu) - 1
    x = make_inputs(rng, B, T, H, HV, K, V, dtype, l2=l2, gate=gate, beta_sigmoid=bmode != "plain", state=state,
                    N=N, state_v_first=vfirst)
    gkw, gref = gate_params(rng, gate, HV, K)
    bkw, bref = beta_params(bmode)
    kw = dict(x, output_final_state=final, use_qk_l2norm_in_kernel=l2, state_v_first=vfirst, **gkw, **bkw, **extra)
    if cu is not None:
        kw["cu_seqlens"] = np.asarray(cu, dtype=np.int32)
    o, ht = ENTRIES[entry](**kw)
    ref_o, ref_ht = kda_reference(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x.get("initial_state"),
                                  output_final_state=final, use_qk_l2norm=l2, cu_seqlens=cu, state_v_first=vfirst,
                                  scale=extra.get("scale"), **gref, **bref)
    return o, ht, ref_o, ref_ht, dtype, final


@pytest.mark.parametrize("entry", ["chunk", "fused"])
@pytest.mark.parametrize("name", list(CASES))
def test_against_reference(entry, name):
    o, ht, ref_o, ref_ht, dtype, final = run_case(entry, name)
    assert isinstance(o, np.ndarray) and o.dtype == dtype and o.shape == ref_o.shape
    assert np.isfinite(o).all()
    assert rel_err(o, ref_o) <= TOL[dtype], f"o: relative error {rel_err(o, ref_o):.3g}"
    if final:
        assert isinstance(ht, np.ndarray) and ht.dtype == np.float32 and ht.shape == ref_ht.shape
        assert rel_err(ht, ref_ht) <= TOL[dtype], f"final_state: relative error {rel_err(ht, ref_ht):.3g}"
    else:
        assert ht is None


@pytest.mark.parametrize("entry", ["chunk", "fused"])
def test_explicit_scale(entry):
    o, _, ref_o, _, _, _ = run_case(entry, "gva2", scale=0.3)
    assert rel_err(o, ref_o) <= 1e-5


@pytest.mark.parametrize("entry", ["chunk", "fused"])
def test_scale_zero_gives_zero_output(entry):
    # FLA multiplies by the scale it is given; libkda reads 0 as "default", which kda must not pass on.
    o, ht, _, ref_ht, _, _ = run_case(entry, "k_ne_v", scale=0.0)
    assert not o.any()
    assert rel_err(ht, ref_ht) <= 1e-5


@pytest.mark.parametrize("entry", ["chunk", "fused"])
def test_int64_offsets_and_lists(entry):
    rng = np.random.default_rng(3)
    cu = [0, 4, 4, 19]
    x = make_inputs(rng, 1, 19, 1, 2, 16, 16, state=True, N=3)
    a = ENTRIES[entry](**x, cu_seqlens=np.asarray(cu, np.int32), output_final_state=True)
    b = ENTRIES[entry](**x, cu_seqlens=np.asarray(cu, np.int64), output_final_state=True)
    c = ENTRIES[entry](**x, cu_seqlens=cu, output_final_state=True)
    for other in (b, c):
        np.testing.assert_array_equal(a[0], other[0])
        np.testing.assert_array_equal(a[1], other[1])


@pytest.mark.parametrize("entry", ["chunk", "fused"])
def test_non_contiguous_inputs(entry):
    rng = np.random.default_rng(4)
    x = make_inputs(rng, 2, 12, 1, 2, 16, 16, state=True)
    ref = ENTRIES[entry](**x, output_final_state=True)
    # the same values in Fortran order and as strided views
    y = {key: np.asfortranarray(val) for key, val in x.items()}
    y["q"] = np.concatenate([x["q"], x["q"]], axis=-1)[..., :16]
    out = ENTRIES[entry](**y, output_final_state=True)
    np.testing.assert_array_equal(ref[0], out[0])
    np.testing.assert_array_equal(ref[1], out[1])


@pytest.mark.parametrize("entry", ["chunk", "fused"])
def test_empty_problem(entry):
    rng = np.random.default_rng(5)
    x = make_inputs(rng, 1, 0, 1, 1, 16, 16, state=True)
    o, ht = ENTRIES[entry](**x, output_final_state=True)
    assert o.shape == (1, 0, 1, 16)
    np.testing.assert_array_equal(ht, x["initial_state"])  # no token: the state passes through


@pytest.mark.parametrize("entry", ["chunk", "fused"])
def test_lower_bound_zero_means_no_decay(entry):
    # FLA's bounded gate with lower_bound=0 is 0 * sigmoid(...) = 0: no decay at all.
    rng = np.random.default_rng(6)
    x = make_inputs(rng, 1, 20, 1, 1, 16, 16, gate="raw", state=True)
    o, ht = ENTRIES[entry](**x, use_gate_in_kernel=True, lower_bound=0.0, output_final_state=True,
                           dt_bias=np.ones(16, np.float32))
    ref_o, ref_ht = kda_reference(x["q"], x["k"], x["v"], np.zeros_like(x["g"]), x["beta"],
                                  initial_state=x["initial_state"], output_final_state=True)
    assert rel_err(o, ref_o) <= 1e-5 and rel_err(ht, ref_ht) <= 1e-5


def test_chunk_and_fused_agree():
    rng = np.random.default_rng(7)
    x = make_inputs(rng, 2, 90, 2, 4, 32, 32, state=True)
    a = kda.chunk_kda(**x, output_final_state=True)
    b = kda.fused_recurrent_kda(**x, output_final_state=True)
    assert rel_err(a[0], b[0]) <= 1e-5 and rel_err(a[1], b[1]) <= 1e-5


@pytest.mark.parametrize("v_first", [False, True])
def test_inplace_state_pool(v_first):
    """vLLM's decode: a pool of slots, ssm_state_indices, the final state written back in place."""
    rng = np.random.default_rng(8)
    B, H, HV, K, V, slots = 1, 1, 2, 32, 16, 6
    cu = np.array([0, 1, 3, 3, 7], np.int32)  # T = 1, 2, 0 and 4 tokens
    idx = np.array([4, -1, 0, 1], np.int32)
    x = make_inputs(rng, B, 7, H, HV, K, V, state=True, slots=slots, state_v_first=v_first)
    pool = x.pop("initial_state")
    before = pool.copy()
    o, ht = kda.fused_recurrent_kda(**x, initial_state=pool, inplace_final_state=True, ssm_state_indices=idx,
                                    cu_seqlens=cu, state_v_first=v_first)
    assert ht is pool
    ref_o, ref_pool = kda_reference(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=before, cu_seqlens=cu,
                                    state_indices=idx, state_v_first=v_first)
    assert rel_err(o, ref_o) <= 1e-5
    for s in (4, 1):
        assert rel_err(pool[s], ref_pool[s]) <= 1e-5
    np.testing.assert_array_equal(pool[0], before[0])  # an empty sequence's slot is not changed by its 0 tokens
    for s in (2, 3, 5):  # no sequence's slot: bit-identical
        assert pool[s].tobytes() == before[s].tobytes()


def test_inplace_state_pool_batch_decode():
    """T = 1 per sequence without cu_seqlens (B sequences), int64 indices."""
    rng = np.random.default_rng(9)
    B, H, HV, K, V, slots = 3, 2, 4, 16, 16, 5
    x = make_inputs(rng, B, 1, H, HV, K, V, state=True, slots=slots, l2=True)
    pool = x.pop("initial_state")
    before = pool.copy()
    idx = np.array([3, 0, 2], np.int64)
    o, ht = kda.fused_recurrent_kda(**x, initial_state=pool, inplace_final_state=True, ssm_state_indices=idx,
                                    use_qk_l2norm_in_kernel=True)
    ref_o, ref_pool = kda_reference(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=before,
                                    state_indices=idx, use_qk_l2norm=True)
    assert rel_err(o, ref_o) <= 1e-5
    assert rel_err(pool, ref_pool) <= 1e-5
    assert pool[1].tobytes() == before[1].tobytes() and pool[4].tobytes() == before[4].tobytes()


def test_pool_read_only():
    """ssm_state_indices without inplace_final_state reads the pool and writes nothing."""
    rng = np.random.default_rng(10)
    x = make_inputs(rng, 2, 3, 1, 1, 16, 16, state=True, slots=4)
    pool = x.pop("initial_state")
    before = pool.copy()
    idx = np.array([2, 0], np.int32)
    o, ht = kda.fused_recurrent_kda(**x, initial_state=pool, ssm_state_indices=idx)
    assert ht is None
    assert pool.tobytes() == before.tobytes()
    ref_o, _ = kda_reference(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=before, state_indices=idx)
    assert rel_err(o, ref_o) <= 1e-5


def test_inplace_without_indices():
    rng = np.random.default_rng(11)
    x = make_inputs(rng, 2, 5, 1, 2, 16, 16, state=True)
    h = x.pop("initial_state")
    before = h.copy()
    o, ht = kda.fused_recurrent_kda(**x, initial_state=h, inplace_final_state=True)
    assert ht is h
    ref_o, ref_ht = kda_reference(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=before,
                                  output_final_state=True)
    assert rel_err(o, ref_o) <= 1e-5 and rel_err(h, ref_ht) <= 1e-5


def test_out_argument():
    rng = np.random.default_rng(12)
    x = make_inputs(rng, 1, 6, 1, 2, 16, 16)
    out = np.full((1, 6, 2, 16), np.nan, np.float32)
    o, _ = kda.fused_recurrent_kda(**x, out=out)
    assert o is out
    ref_o, _ = kda_reference(x["q"], x["k"], x["v"], x["g"], x["beta"])
    assert rel_err(out, ref_o) <= 1e-5


@pytest.mark.parametrize("entry", ["chunk", "fused"])
def test_inputs_not_modified(entry):
    rng = np.random.default_rng(13)
    x = make_inputs(rng, 1, 30, 1, 2, 16, 16, state=True)
    copies = {key: val.copy() for key, val in x.items()}
    ENTRIES[entry](**x, output_final_state=True)
    for key in x:
        assert x[key].tobytes() == copies[key].tobytes(), key


# ---------------------------------------------------------------------------------------------------------
# chunk_kda_backward: the gradients for numpy users, against central differences of the fp64 numpy reference
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("gate", ["none", "softplus", "lb"])
def test_backward_against_finite_differences(gate):
    rng = np.random.default_rng(21)
    B, T, H, HV, K, V = 1, 9, 1, 2, 6, 5
    cu = [0, 4, 4, 9]
    x = make_inputs(rng, B, T, H, HV, K, V, l2=True, gate=gate, beta_sigmoid=True, state=True, N=3)
    opts = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    if gate != "none":
        opts.update(use_gate_in_kernel=True, A_log=rng.uniform(-1, 1, HV).astype(np.float32),
                    dt_bias=(0.5 * rng.standard_normal(HV * K)).astype(np.float32))
        if gate == "lb":
            opts.update(lower_bound=-4.0)
    do = rng.standard_normal((B, T, HV, V)).astype(np.float32)
    dht = rng.standard_normal(x["initial_state"].shape).astype(np.float32)
    grads = kda.chunk_kda_backward(x["q"], x["k"], x["v"], x["g"], x["beta"], do, dht,
                                   initial_state=x["initial_state"], cu_seqlens=cu, **opts)
    names = ["q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias"]
    ref_opts = dict(use_qk_l2norm=True, use_beta_sigmoid=True, use_gate_in_kernel=gate != "none",
                    lower_bound=opts.get("lower_bound"))
    point = {n: np.asarray(x[n] if n in x else opts[n], np.float64) for n in names if n in x or n in opts}

    def loss(p):
        o, ht = kda_reference(p["q"], p["k"], p["v"], p["g"], p["beta"], initial_state=p["initial_state"],
                              output_final_state=True, cu_seqlens=cu, A_log=p.get("A_log"),
                              dt_bias=p.get("dt_bias"), **ref_opts)
        return float((o * do).sum() + (ht * dht).sum())

    h = 1e-6
    for name, grad in zip(names, grads):
        if name not in point:
            assert grad is None, name
            continue
        assert grad.shape == point[name].shape, name
        fd = np.empty_like(point[name])
        flat = point[name].reshape(-1)
        for i in range(flat.size):
            x0 = flat[i]
            flat[i] = x0 + h
            lp = loss(point)
            flat[i] = x0 - h
            lm = loss(point)
            flat[i] = x0
            fd.reshape(-1)[i] = (lp - lm) / (2 * h)
        assert rel_err(grad, fd) <= 2e-5, f"{name}: {rel_err(grad, fd):.3g}"


def test_backward_refuses_torch_and_bad_do():
    rng = np.random.default_rng(22)
    x = make_inputs(rng, 1, 5, 1, 1, 4, 4)
    with pytest.raises(kda.KDAInvalidValueError, match="'do'"):
        kda.chunk_kda_backward(x["q"], x["k"], x["v"], x["g"], x["beta"], np.zeros((1, 5, 1, 3), np.float32))
    g = kda.chunk_kda_backward(x["q"], x["k"], x["v"], x["g"], x["beta"], np.ones((1, 5, 1, 4), np.float32))
    assert g[5] is None and g[6] is None and g[7] is None and g[0].dtype == np.float32


@pytest.mark.parametrize("v_first", [False, True])
@pytest.mark.parametrize("accepted", [False, True])
def test_spec_decoding_2d_indices(v_first, accepted):
    """FLA's speculative decoding: 2-D ssm_state_indices [N, T_max], num_accepted_tokens, the state after every
    token written to that token's slot in place; slots nobody writes stay bit-identical."""
    rng = np.random.default_rng(12)
    H, HV, K, V, T_max = 1, 2, 32, 16, 4
    cu = np.array([0, 3, 4, 4, 8], np.int32)  # 3, 1, 0 and 4 tokens
    idx = np.array([[5, 11, 2, 13], [-1, 7, 8, 9], [14, -1, 3, 12], [10, 1, -1, 0]], np.int32)
    nat = np.array([2, 1, 3, 4], np.int32)
    x = make_inputs(rng, 1, 8, H, HV, K, V, state=True, slots=16, state_v_first=v_first, l2=True)
    pool = x.pop("initial_state")
    before = pool.copy()
    kw = dict(num_accepted_tokens=nat) if accepted else {}
    o, ht = kda.fused_recurrent_kda(**x, initial_state=pool, inplace_final_state=True, ssm_state_indices=idx,
                                    cu_seqlens=cu, state_v_first=v_first, use_qk_l2norm_in_kernel=True, **kw)
    assert ht is pool
    ref_o, ref_pool = kda_reference(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=before, cu_seqlens=cu,
                                    state_indices=idx, num_accepted_tokens=nat if accepted else None,
                                    state_v_first=v_first, use_qk_l2norm=True)
    assert rel_err(o, ref_o) <= 1e-5
    written = {int(idx[n, t]) for n in range(4) for t in range(cu[n + 1] - cu[n]) if idx[n, t] >= 0}
    for s in range(16):
        if s in written:
            assert rel_err(pool[s], ref_pool[s]) <= 1e-5
        else:
            assert pool[s].tobytes() == before[s].tobytes()


@pytest.mark.parametrize("sigmoid", [False, True])
def test_headwise_beta(sigmoid):
    """beta [B, T, HV, V]: one beta per value channel, as FLA's fused_recurrent_kda accepts."""
    rng = np.random.default_rng(13)
    B, T, H, HV, K, V = 2, 5, 1, 2, 16, 24
    x = make_inputs(rng, B, T, H, HV, K, V, state=True)
    bh = rng.standard_normal((B, T, HV, V)).astype(np.float32)
    if not sigmoid:
        bh = 1.0 / (1.0 + np.exp(-bh))
    x["beta"] = bh
    o, ht = kda.fused_recurrent_kda(**x, output_final_state=True, use_beta_sigmoid_in_kernel=sigmoid)
    ref_o, ref_ht = kda_reference(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
                                  output_final_state=True, use_beta_sigmoid=sigmoid)
    assert rel_err(o, ref_o) <= 1e-5 and rel_err(ht, ref_ht) <= 1e-5
    # all V entries equal to a scalar beta: the scalar result
    x["beta"] = np.repeat(bh[..., :1], V, axis=-1)
    o2, _ = kda.fused_recurrent_kda(**x, use_beta_sigmoid_in_kernel=sigmoid)
    x["beta"] = np.ascontiguousarray(bh[..., 0])
    o3, _ = kda.fused_recurrent_kda(**x, use_beta_sigmoid_in_kernel=sigmoid)
    np.testing.assert_array_equal(o2, o3)


def test_cp_piece_len_changes_nothing_on_cpu():
    """cp_piece_len (None: auto, 0: off, a piece length: on) reaches libkda, which checks it; the CPU backend
    ignores it, so every setting gives the same bits."""
    rng = np.random.default_rng(8)
    x = make_inputs(rng, 1, 300, 1, 2, 16, 16, state=True)
    want = kda.chunk_kda(**x, output_final_state=True)
    for cp in (None, 0, 64, 128, np.int64(192), 2 ** 24):
        o, ht = kda.chunk_kda(**x, output_final_state=True, cp_piece_len=cp)
        np.testing.assert_array_equal(o, want[0])
        np.testing.assert_array_equal(ht, want[1])
