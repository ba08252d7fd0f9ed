"""Every keyword of FLA 0.6.0's chunk_kda and fused_recurrent_kda is accepted or refused by name."""

import inspect
import warnings

import numpy as np
import pytest

import kda
from kda_reference import make_inputs

_EMPTY = inspect.Parameter.empty

# FLA 0.6.0, fla/ops/kda/chunk.py: chunk_kda's parameters and defaults, in order (then **kwargs)
FLA_CHUNK = [
    ("q", _EMPTY), ("k", _EMPTY), ("v", _EMPTY), ("g", _EMPTY), ("beta", _EMPTY),
    ("scale", None), ("initial_state", None), ("output_final_state", False), ("use_qk_l2norm_in_kernel", False),
    ("use_gate_in_kernel", False), ("use_beta_sigmoid_in_kernel", False), ("allow_neg_eigval", False),
    ("safe_gate", False), ("lower_bound", None), ("disable_recompute", False), ("return_intermediate_states", False),
    ("state_v_first", False), ("cu_seqlens", None), ("cu_seqlens_cpu", None), ("cp_context", None),
    ("use_graph", False), ("max_num_seqs", None),
]
# the keyword arguments FLA's chunk_kda reads from **kwargs
FLA_CHUNK_KWARGS = ["A_log", "dt_bias", "chunk_size", "transpose_state_layout"]

# FLA 0.6.0, fla/ops/kda/fused_recurrent.py: fused_recurrent_kda
FLA_FUSED = [
    ("q", _EMPTY), ("k", _EMPTY), ("v", _EMPTY), ("g", _EMPTY), ("beta", _EMPTY),
    ("A_log", None), ("dt_bias", None), ("scale", None), ("initial_state", None), ("output_final_state", False),
    ("use_qk_l2norm_in_kernel", False), ("use_gate_in_kernel", False), ("use_beta_sigmoid_in_kernel", False),
    ("allow_neg_eigval", False), ("lower_bound", None), ("state_v_first", False), ("cu_seqlens", None),
]
# read from **kwargs: FLA's deprecated alias, and the keywords of FLA's fused_recurrent_kda_fwd / vLLM's decode
FLA_FUSED_KWARGS = ["transpose_state_layout", "ssm_state_indices", "inplace_final_state", "num_accepted_tokens",
                    "out"]


def params_of(fn):
    sig = inspect.signature(fn)
    names = [(p.name, p.default) for p in sig.parameters.values() if p.kind != inspect.Parameter.VAR_KEYWORD]
    has_kwargs = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values())
    return names, has_kwargs


@pytest.mark.parametrize("fn, expected", [(kda.chunk_kda, FLA_CHUNK), (kda.fused_recurrent_kda, FLA_FUSED)])
def test_signature_matches_fla_060(fn, expected):
    names, has_kwargs = params_of(fn)
    assert names == expected
    assert has_kwargs


@pytest.mark.parametrize("ours, path, name", [(kda.chunk_kda, "fla.ops.kda", "chunk_kda"),
                                               (kda.fused_recurrent_kda, "fla.ops.kda", "fused_recurrent_kda")])
def test_signature_matches_installed_fla(ours, path, name):
    try:
        mod = __import__(path, fromlist=[name])
    except Exception as e:  # noqa: BLE001 (fla needs torch and triton; any import failure means "absent")
        pytest.skip(f"fla is not importable here ({type(e).__name__}: {e})")
    theirs = inspect.unwrap(getattr(mod, name))
    assert params_of(ours) == params_of(theirs)


# ---------------------------------------------------------------------------------------------------------
# each keyword, with a non-default value: accepted (the call works) or refused by name
# ---------------------------------------------------------------------------------------------------------
B, T, H, HV, K, V = 1, 9, 1, 2, 16, 16


def base_inputs():
    return make_inputs(np.random.default_rng(0), B, T, H, HV, K, V)


def gate_extras():
    return dict(A_log=np.zeros(HV, np.float32), dt_bias=np.zeros(HV * K, np.float32))


CU = np.array([0, 4, 9], np.int32)
STATE = np.zeros((B, HV, K, V), np.float32)
STATE2 = np.zeros((2, HV, K, V), np.float32)

# keyword -> (extra keywords the value needs, the keyword's value, "ok" or "refused")
CHUNK_CASES = {
    "scale": ({}, 0.5, "ok"),
    "initial_state": ({}, STATE, "ok"),
    "output_final_state": ({}, True, "ok"),
    "use_qk_l2norm_in_kernel": ({}, True, "ok"),
    "use_gate_in_kernel": (gate_extras(), True, "ok"),
    "use_beta_sigmoid_in_kernel": ({}, True, "ok"),
    "allow_neg_eigval": ({"use_beta_sigmoid_in_kernel": True}, True, "ok"),
    "safe_gate": ({}, True, "ok"),
    "lower_bound": (dict(gate_extras(), use_gate_in_kernel=True), -2.0, "ok"),
    "disable_recompute": ({}, True, "ok"),
    "return_intermediate_states": ({}, True, "refused"),
    "state_v_first": ({}, True, "ok"),
    "cu_seqlens": ({}, CU, "ok"),
    "cu_seqlens_cpu": ({"cu_seqlens": CU}, CU, "ok"),
    "cp_context": ({}, object(), "refused"),
    "use_graph": ({"cu_seqlens": CU}, True, "ok"),
    "max_num_seqs": ({"cu_seqlens": CU, "use_graph": True}, 2, "ok"),
    # read from **kwargs
    "A_log": ({"use_gate_in_kernel": True}, np.zeros(HV, np.float32), "ok"),
    "dt_bias": ({"use_gate_in_kernel": True, "lower_bound": -3.0}, np.zeros(HV * K, np.float32), "ok"),
    "chunk_size": ({}, 32, "ok"),
    "transpose_state_layout": ({}, True, "ok"),
}

FUSED_CASES = {
    "A_log": ({"use_gate_in_kernel": True}, np.zeros(HV, np.float32), "ok"),
    "dt_bias": ({"use_gate_in_kernel": True, "lower_bound": -3.0}, np.zeros(HV * K, np.float32), "ok"),
    "scale": ({}, 0.5, "ok"),
    "initial_state": ({}, STATE, "ok"),
    "output_final_state": ({}, True, "ok"),
    "use_qk_l2norm_in_kernel": ({}, True, "ok"),
    "use_gate_in_kernel": (gate_extras(), True, "ok"),
    "use_beta_sigmoid_in_kernel": ({}, True, "ok"),
    "allow_neg_eigval": ({"use_beta_sigmoid_in_kernel": True}, True, "ok"),
    "lower_bound": (dict(gate_extras(), use_gate_in_kernel=True), -2.0, "ok"),
    "state_v_first": ({}, True, "ok"),
    "cu_seqlens": ({}, CU, "ok"),
    # read from **kwargs
    "transpose_state_layout": ({}, True, "ok"),
    "ssm_state_indices": ({"initial_state": np.zeros((3, HV, K, V), np.float32)}, np.array([2], np.int32), "ok"),
    "inplace_final_state": ({"initial_state": np.zeros((B, HV, K, V), np.float32)}, True, "ok"),
    "num_accepted_tokens": ({"initial_state": np.zeros((12, HV, K, V), np.float32), "inplace_final_state": True,
                             "ssm_state_indices": np.arange(T, dtype=np.int32).reshape(1, T)},
                            np.array([2], np.int32), "ok"),
    "out": ({}, np.zeros((B, T, HV, V), np.float32), "ok"),
}


def test_cases_cover_every_keyword():
    assert set(CHUNK_CASES) == {n for n, _ in FLA_CHUNK[5:]} | set(FLA_CHUNK_KWARGS)
    assert set(FUSED_CASES) == {n for n, _ in FLA_FUSED[5:]} | set(FLA_FUSED_KWARGS)


def call_with(fn, name, extra, value):
    kw = dict(base_inputs(), **extra)
    kw[name] = value
    if "cu_seqlens" in kw and kw.get("initial_state") is not None:  # one state per sequence
        kw["initial_state"] = STATE2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return fn(**kw)


@pytest.mark.parametrize("name", list(CHUNK_CASES))
def test_chunk_keyword(name):
    extra, value, verdict = CHUNK_CASES[name]
    if verdict == "ok":
        o, _ = call_with(kda.chunk_kda, name, extra, value)
        assert np.isfinite(o).all()
    else:
        with pytest.raises(NotImplementedError, match=name):
            call_with(kda.chunk_kda, name, extra, value)


@pytest.mark.parametrize("name", list(FUSED_CASES))
def test_fused_keyword(name):
    extra, value, verdict = FUSED_CASES[name]
    if verdict == "ok":
        o, _ = call_with(kda.fused_recurrent_kda, name, extra, value)
        assert np.isfinite(o).all()
    else:
        with pytest.raises(NotImplementedError, match=name):
            call_with(kda.fused_recurrent_kda, name, extra, value)


@pytest.mark.parametrize("fn", [kda.chunk_kda, kda.fused_recurrent_kda])
def test_unknown_keyword_is_a_type_error(fn):
    # as a Python function without **kwargs: TypeError naming the keyword (FLA would ignore it silently)
    name = fn.__name__
    with pytest.raises(TypeError, match=rf"^{name}\(\) got an unexpected keyword argument 'no_such_option'$"):
        fn(**base_inputs(), no_such_option=1)
    with pytest.raises(TypeError, match=rf"^{name}\(\) got unexpected keyword arguments 'first_unknown', "
                                        rf"'second_unknown'"):
        fn(**base_inputs(), first_unknown=1, second_unknown=None)
    with pytest.raises(TypeError, match="did you mean 'use_qk_l2norm_in_kernel'"):
        fn(**base_inputs(), use_qk_l2norm=True)


def test_mistyped_keyword_suggests_the_name():
    with pytest.raises(TypeError, match="'state_indices': did you mean 'ssm_state_indices'"):
        kda.fused_recurrent_kda(**base_inputs(), state_indices=np.array([0], np.int32))


def test_chunk_kda_refuses_vllm_keywords():
    # FLA's chunk_kda would ignore them: kda says whose keyword it is instead
    with pytest.raises(TypeError, match="'ssm_state_indices' is a keyword of fused_recurrent_kda"):
        kda.chunk_kda(**base_inputs(), ssm_state_indices=np.array([0], np.int32))


@pytest.mark.parametrize("fn", [kda.chunk_kda, kda.fused_recurrent_kda])
def test_transpose_state_layout_alias(fn):
    x = base_inputs()
    h = np.random.default_rng(1).standard_normal((B, HV, V, K)).astype(np.float32)
    with pytest.warns(DeprecationWarning, match="state_v_first"):
        a = fn(**x, initial_state=h, output_final_state=True, transpose_state_layout=True)
    b = fn(**x, initial_state=h, output_final_state=True, state_v_first=True)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    with pytest.raises(ValueError, match="transpose_state_layout"):
        fn(**x, state_v_first=True, transpose_state_layout=True)


def test_forward_neutral_flags_change_nothing():
    x = base_inputs()
    ref = kda.chunk_kda(**x, cu_seqlens=CU, output_final_state=True)
    for extra in (dict(chunk_size=32), dict(disable_recompute=True), dict(use_graph=True),
                  dict(use_graph=True, max_num_seqs=2), dict(safe_gate=True), dict(cu_seqlens_cpu=CU)):
        out = kda.chunk_kda(**x, cu_seqlens=CU, output_final_state=True, **extra)
        np.testing.assert_array_equal(ref[0], out[0])
        np.testing.assert_array_equal(ref[1], out[1])


def test_gate_parameters_ignored_without_gate_in_kernel():
    # as in FLA: A_log, dt_bias and lower_bound only matter with use_gate_in_kernel
    x = base_inputs()
    ref = kda.chunk_kda(**x)
    junk = dict(A_log=np.full(7, np.nan, np.float32), dt_bias=np.ones(3, np.float32), lower_bound=-2.0)
    np.testing.assert_array_equal(ref[0], kda.chunk_kda(**x, **junk)[0])
    np.testing.assert_array_equal(kda.fused_recurrent_kda(**x)[0], kda.fused_recurrent_kda(**x, **junk)[0])
