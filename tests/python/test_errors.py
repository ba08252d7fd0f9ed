"""Errors: FLA's checks with FLA's exception types, shapes named, libkda statuses mapped with their C message."""

import numpy as np
import pytest

import kda
from kda import _errors, _lib
from kda_reference import make_inputs

B, T, H, HV, K, V = 2, 8, 1, 2, 16, 16


def inputs(**over):
    x = make_inputs(np.random.default_rng(0), B, T, H, HV, K, V)
    x.update(over)
    return x


BOTH = pytest.mark.parametrize("fn", [kda.chunk_kda, kda.fused_recurrent_kda], ids=["chunk", "fused"])


# ---------------------------------------------------------------------------------------------------------
# shapes: ValueError naming the argument
# ---------------------------------------------------------------------------------------------------------
BAD_SHAPES = {
    "q": np.zeros((B, T, H, K, 1), np.float32),
    "k": np.zeros((B, T, H, K + 1), np.float32),
    "v": np.zeros((B, T + 1, HV, V), np.float32),
    "g": np.zeros((B, T, HV, K - 1), np.float32),
    "beta": np.zeros((B, T, HV + 1), np.float32),
}


@BOTH
@pytest.mark.parametrize("name", list(BAD_SHAPES))
def test_bad_shape_names_argument(fn, name):
    with pytest.raises(ValueError, match=f"'{name}'") as info:
        fn(**inputs(**{name: BAD_SHAPES[name]}))
    assert isinstance(info.value, kda.KDAError) and info.value.status is None


@pytest.mark.parametrize("name", ["k", "g", "beta"])
def test_fla_asserts_are_assertion_errors_too(name):
    # FLA checks these shapes with `assert`: both `except ValueError` and `except AssertionError` work
    with pytest.raises(AssertionError):
        kda.chunk_kda(**inputs(**{name: BAD_SHAPES[name]}))


def test_gva_head_count():
    x = inputs(v=np.zeros((B, T, 3, V), np.float32), g=np.zeros((B, T, 3, K), np.float32),
               beta=np.zeros((B, T, 3), np.float32), q=np.zeros((B, T, 2, K), np.float32),
               k=np.zeros((B, T, 2, K), np.float32))
    with pytest.raises(AssertionError, match="multiple"):
        kda.chunk_kda(**x)
    with pytest.raises(ValueError, match="'v'"):
        kda.fused_recurrent_kda(**x)


def test_key_head_size_limit():
    x = make_inputs(np.random.default_rng(0), 1, 2, 1, 1, 257, 16)
    with pytest.raises(AssertionError, match="256"):
        kda.chunk_kda(**x)
    x = make_inputs(np.random.default_rng(0), 1, 2, 1, 1, 16, 300)
    with pytest.raises(NotImplementedError, match="'v'"):
        kda.chunk_kda(**x)


@BOTH
def test_bad_initial_state_shape(fn):
    with pytest.raises(ValueError, match="'initial_state'"):
        fn(**inputs(), initial_state=np.zeros((B, HV, V + 1, K), np.float32))
    with pytest.raises(ValueError, match="'initial_state'"):
        fn(**inputs(), initial_state=np.zeros((B + 1, HV, K, V), np.float32))


@BOTH
def test_gate_parameter_shapes(fn):
    with pytest.raises(ValueError, match="'A_log'"):
        fn(**inputs(), use_gate_in_kernel=True, A_log=np.zeros(HV + 1, np.float32))
    with pytest.raises(ValueError, match="'dt_bias'"):
        fn(**inputs(), use_gate_in_kernel=True, A_log=np.zeros(HV, np.float32), dt_bias=np.zeros(HV, np.float32))


# ---------------------------------------------------------------------------------------------------------
# FLA's own checks (ValueError)
# ---------------------------------------------------------------------------------------------------------
@BOTH
def test_cu_seqlens_needs_batch_one(fn):
    with pytest.raises(ValueError, match="batch size"):
        fn(**inputs(), cu_seqlens=np.array([0, T], np.int32))


@BOTH
def test_initial_state_count_with_cu_seqlens(fn):
    x = make_inputs(np.random.default_rng(0), 1, T, H, HV, K, V)
    with pytest.raises(ValueError, match="number of initial states"):
        fn(**x, cu_seqlens=np.array([0, 3, T], np.int32), initial_state=np.zeros((3, HV, K, V), np.float32))


@BOTH
def test_allow_neg_eigval_needs_sigmoid(fn):
    with pytest.raises(ValueError, match="allow_neg_eigval"):
        fn(**inputs(), allow_neg_eigval=True)


@BOTH
def test_gate_in_kernel_needs_a_log_or_bound(fn):
    with pytest.raises(ValueError, match="A_log"):
        fn(**inputs(), use_gate_in_kernel=True)


def test_chunk_size():
    with pytest.raises(ValueError, match="chunk_size"):
        kda.chunk_kda(**inputs(), chunk_size=48)


def test_safe_gate_bound_fla_checks():
    gate = dict(use_gate_in_kernel=True, A_log=np.zeros(HV, np.float32), safe_gate=True)
    with pytest.raises(ValueError, match="lower_bound"):
        kda.chunk_kda(**inputs(), **gate)
    with pytest.raises(ValueError, match="lower_bound"):
        kda.chunk_kda(**inputs(), **gate, lower_bound=-6.0)


def test_chunk_initial_state_dtype_is_asserted():
    with pytest.raises(AssertionError, match="initial_state"):
        kda.chunk_kda(**inputs(), initial_state=np.zeros((B, HV, K, V), np.float16))


def test_use_graph_padding_check():
    x = make_inputs(np.random.default_rng(0), 1, T, H, HV, K, V)
    with pytest.raises(AssertionError, match="max_num_seqs"):
        kda.chunk_kda(**x, cu_seqlens=np.array([0, 3, T], np.int32), use_graph=True, max_num_seqs=4)


def test_fused_out_shape_and_inplace_state():
    with pytest.raises(AssertionError, match="'out'"):
        kda.fused_recurrent_kda(**inputs(), out=np.zeros((B, T, HV, V + 1), np.float32))
    with pytest.raises(AssertionError, match="initial_state"):
        kda.fused_recurrent_kda(**inputs(), inplace_final_state=True)


# ---------------------------------------------------------------------------------------------------------
# libkda's checks: ValueError carrying the C message and status
# ---------------------------------------------------------------------------------------------------------
@BOTH
def test_c_level_non_monotone_cu_seqlens(fn):
    x = make_inputs(np.random.default_rng(0), 1, T, H, HV, K, V)
    with pytest.raises(ValueError, match="not monotone") as info:
        fn(**x, cu_seqlens=np.array([0, 5, 3, T], np.int32))
    e = info.value
    assert isinstance(e, kda.KDAInvalidValueError)
    assert e.status == _errors.INVALID_VALUE and e.status_name == "KDA_STATUS_INVALID_VALUE"
    # in the caller's terms: the Python function, the argument as passed, no C entry point
    assert e.message.startswith(f"{fn.__name__}: argument 'cu_seqlens'") and "kda_" not in e.message


def test_c_level_safe_gate_bound():
    # fused_recurrent_kda takes safe_gate as a keyword (FLA's chunk_kda meaning): libkda checks the bound
    with pytest.raises(ValueError, match=r"^fused_recurrent_kda: argument 'lower_bound': -6 is outside the safe range"):
        kda.fused_recurrent_kda(**inputs(), use_gate_in_kernel=True, A_log=np.zeros(HV, np.float32),
                                lower_bound=-6.0, safe_gate=True)


@BOTH
def test_c_level_positive_lower_bound(fn):
    with pytest.raises(ValueError, match="argument 'lower_bound'.*negative"):
        fn(**inputs(), use_gate_in_kernel=True, lower_bound=0.5)


def test_c_level_duplicate_pool_slots():
    pool = np.zeros((4, HV, K, V), np.float32)
    with pytest.raises(ValueError, match="distinct"):
        kda.fused_recurrent_kda(**inputs(), initial_state=pool, ssm_state_indices=np.array([1, 1], np.int32),
                                inplace_final_state=True)
    with pytest.raises(ValueError, match=r"^fused_recurrent_kda: argument 'ssm_state_indices': ssm_state_indices\[1\] "
                                         r"= 4 .*the number of slots of initial_state = 4") as info:
        kda.fused_recurrent_kda(**inputs(), initial_state=pool, ssm_state_indices=np.array([0, 4], np.int32),
                                inplace_final_state=True)
    assert "(libkda's field 'state_indices')" in info.value.message


@pytest.mark.parametrize("field, arg", [("num_v_heads", "v"), ("state_indices", "ssm_state_indices"),
                                        ("use_qk_l2norm", "use_qk_l2norm_in_kernel"), ("cu_seqlens", "cu_seqlens")])
def test_c_messages_in_callers_terms(field, arg):
    e = _errors.error_from_status(_errors.INVALID_VALUE, f"kda_forward_workspace_size: argument '{field}': detail")
    t = _errors.in_callers_terms(e, "chunk_kda")
    assert type(t) is type(e) and t.status == e.status
    assert t.message.startswith(f"chunk_kda: argument '{arg}': detail")
    assert "kda_forward" not in t.message and (field == arg) == ("libkda's field" not in t.message)


def test_bad_environment_reported():
    # KDA_NUM_THREADS=abc: the CPU context is refused, naming the variable (a new process: contexts are cached)
    import os
    import subprocess
    import sys
    code = ("import numpy as np, kda\n"
            "x = np.zeros((1, 2, 1, 16), np.float32)\n"
            "try:\n"
            "    kda.chunk_kda(x, x, x, x, np.zeros((1, 2, 1), np.float32))\n"
            "except ValueError as e:\n"
            "    print(type(e).__name__, e)\n")
    env = dict(os.environ, KDA_NUM_THREADS="abc")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("KDAInvalidValueError chunk_kda: ") and "KDA_NUM_THREADS='abc'" in out.stdout


# ---------------------------------------------------------------------------------------------------------
# what kda does not implement: NotImplementedError naming it
# ---------------------------------------------------------------------------------------------------------
def test_headwise_beta_wrong_shape():
    with pytest.raises(ValueError, match="'beta'"):
        kda.fused_recurrent_kda(**inputs(beta=np.full((B, T, HV, V + 1), 0.5, np.float32)))


def test_num_accepted_tokens_needs_2d_indices():
    with pytest.raises(ValueError, match="'num_accepted_tokens'"):
        kda.fused_recurrent_kda(**inputs(), initial_state=np.zeros((4, HV, K, V), np.float32),
                                ssm_state_indices=np.array([0, 1], np.int32), inplace_final_state=True,
                                num_accepted_tokens=np.array([1, 1], np.int32))


def test_2d_state_indices_too_few_columns():
    """T = 8 tokens per sequence need 8 slot columns: libkda's INVALID_VALUE naming the argument."""
    with pytest.raises(ValueError, match="state_indices_cols"):
        kda.fused_recurrent_kda(**inputs(), initial_state=np.zeros((40, HV, K, V), np.float32),
                                ssm_state_indices=np.arange(2 * 4, dtype=np.int32).reshape(2, 4),
                                inplace_final_state=True)


def test_num_accepted_tokens_out_of_range():
    with pytest.raises(ValueError, match="'num_accepted_tokens'"):
        kda.fused_recurrent_kda(**inputs(), initial_state=np.zeros((40, HV, K, V), np.float32),
                                ssm_state_indices=np.arange(2 * 8, dtype=np.int32).reshape(2, 8),
                                inplace_final_state=True, num_accepted_tokens=np.array([9, 1], np.int32))


def test_pool_final_state_without_inplace_not_implemented():
    with pytest.raises(NotImplementedError, match="inplace_final_state"):
        kda.fused_recurrent_kda(**inputs(), initial_state=np.zeros((4, HV, K, V), np.float32),
                                ssm_state_indices=np.array([0, 1], np.int32), output_final_state=True)


@BOTH
def test_unsupported_numpy_dtype(fn):
    x = {key: val.astype(np.float64) for key, val in inputs().items()}
    with pytest.raises(NotImplementedError, match="'q'.*float64"):
        fn(**x)


@BOTH
def test_mixed_qkv_dtypes(fn):
    with pytest.raises(NotImplementedError, match="'v'"):
        fn(**inputs(v=inputs()["v"].astype(np.float16)))


@BOTH
def test_wrong_container_type(fn):
    x = inputs()
    with pytest.raises(TypeError, match="'q'"):
        fn(**dict(x, q=x["q"].tolist()))
    with pytest.raises(TypeError, match="'k'"):
        fn(**dict(x, k=x["k"].tolist()))
    with pytest.raises(TypeError, match="'initial_state'"):
        fn(**x, initial_state=np.zeros((B, HV, K, V), np.float32).tolist())


def test_inplace_needs_writable_contiguous_pool():
    pool = np.zeros((B, HV, K, V), np.float32)
    pool.flags.writeable = False
    with pytest.raises(ValueError, match="initial_state"):
        kda.fused_recurrent_kda(**inputs(), initial_state=pool, inplace_final_state=True)


# ---------------------------------------------------------------------------------------------------------
# the status -> exception table
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("status, cls, builtin", [
    (_errors.INVALID_VALUE, kda.KDAInvalidValueError, ValueError),
    (_errors.NOT_SUPPORTED, kda.KDANotSupportedError, NotImplementedError),
    (_errors.INSUFFICIENT_WORKSPACE, kda.KDAInsufficientWorkspaceError, RuntimeError),
    (_errors.ALLOC_FAILED, kda.KDAAllocError, RuntimeError),
    (_errors.BACKEND_ERROR, kda.KDABackendError, RuntimeError),
    (_errors.INTERNAL_ERROR, kda.KDAInternalError, RuntimeError),
    (_errors.CONTEXT_IN_USE, kda.KDARuntimeError, RuntimeError),
    (99, kda.KDARuntimeError, RuntimeError),
])
def test_status_mapping(status, cls, builtin):
    e = _errors.error_from_status(status, "kda_forward: argument 'x': message")
    assert type(e) is cls and isinstance(e, builtin) and isinstance(e, kda.KDAError)
    assert e.status == status and str(e) == e.message == "kda_forward: argument 'x': message"
    if status == _errors.INVALID_VALUE:
        assert not isinstance(e, RuntimeError)
    assert e.status_name == {7: "KDA_STATUS_CONTEXT_IN_USE", 99: "KDA_STATUS_99"}.get(status, e.status_name)
    assert _errors.error_from_status(status, "").message  # an empty C message still names the status


def test_not_supported_from_the_library():
    """A C status other than INVALID_VALUE reaches Python with its C message (here: CUDA on this build/machine,
    or the CPU-only kda_set_num_threads on the reference backend)."""
    with pytest.raises(NotImplementedError, match="kda_set_num_threads") as info:
        _lib.get_context(_lib.BACKEND_REFERENCE, 0).set_num_threads(2)
    assert info.value.status == _errors.NOT_SUPPORTED
    try:
        _lib.get_context(_lib.BACKEND_CUDA, 0)
    except kda.KDAError as e:
        assert e.status in (_errors.NOT_SUPPORTED, _errors.BACKEND_ERROR) and e.message.startswith("kda_create")
        assert isinstance(e, NotImplementedError if e.status == _errors.NOT_SUPPORTED else RuntimeError)


# ---------------------------------------------------------------------------------------------------------
# cp_piece_len (libkda's keyword: intra-card context parallelism), checked in the caller's terms
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad, exc, match", [
    (100, ValueError, "multiple of the chunk, 64 tokens, got 100"),
    (-64, ValueError, "positive multiple of 64, got -64"),
    (2 ** 24 + 64, ValueError, f"at most {2 ** 24} tokens"),
    (64.0, TypeError, "whole number of tokens, got float"),
    (True, TypeError, "whole number of tokens, got bool"),
    ("64", TypeError, "whole number of tokens, got str"),
])
def test_cp_piece_len_bad(bad, exc, match):
    with pytest.raises(exc, match=match) as info:
        kda.chunk_kda(**inputs(), cp_piece_len=bad)
    assert "chunk_kda: `cp_piece_len`" in str(info.value) and isinstance(info.value, kda.KDAError)


def test_cp_piece_len_is_chunk_kda_only():
    with pytest.raises(TypeError, match="'cp_piece_len' is a keyword of chunk_kda"):
        kda.fused_recurrent_kda(**inputs(), cp_piece_len=64)
    with pytest.raises(TypeError, match="did you mean 'cp_piece_len'"):
        kda.chunk_kda(**inputs(), cp_piece_length=64)
