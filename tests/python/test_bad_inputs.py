"""One table of bad inputs, each run on numpy arrays, torch CPU tensors and torch CUDA tensors (skipped without a
GPU): every case raises a KDAError of the expected built-in kind whose message names the caller's argument, and
writes nothing (every array passed, a poisoned out= and in-place state pool among them, is unchanged)."""

import numpy as np
import pytest

import kda
from kda_reference import make_inputs

B, T, H, HV, K, V = 1, 8, 1, 2, 16, 16
POISON = 12345.0
KINDS = ["numpy", "torch_cpu", "torch_cuda"]


class Kind:
    """Arrays of one kind: `arr` converts a numpy array, `cu` gives cu_seqlens (and, for CUDA tensors, the host
    copy libkda validates the offsets with)."""

    def __init__(self, name):
        self.name = name
        if name == "numpy":
            self.torch = None
            return
        self.torch = pytest.importorskip("torch")
        if name == "torch_cuda" and not self.torch.cuda.is_available():
            pytest.skip("no CUDA GPU visible to torch")
        self.device = "cuda" if name == "torch_cuda" else "cpu"

    def arr(self, x):
        x = np.asarray(x)
        if self.torch is None:
            return x
        return self.torch.from_numpy(np.ascontiguousarray(x)).to(self.device)

    def cu(self, offsets, dtype=np.int32):
        cu = np.asarray(offsets, dtype)
        extra = {"cu_seqlens_cpu": self.torch.from_numpy(cu)} if self.name == "torch_cuda" else {}
        return dict(cu_seqlens=self.arr(cu), **extra)

    def strided(self, x):
        """x's values in a non-contiguous array of x's kind (every other element of a wider one)."""
        wide = np.repeat(np.asarray(x)[..., None], 2, axis=-1)
        return self.arr(wide)[..., 0] if self.torch is not None else wide[..., 0]


def inputs(kind, **over):
    x = {key: kind.arr(val) for key, val in make_inputs(np.random.default_rng(0), B, T, H, HV, K, V).items()}
    x.update(over)
    return x


def fused_inputs(kind, **over):
    """fused_recurrent_kda's inputs with a poisoned out= and a poisoned state pool updated in place."""
    x = inputs(kind, out=kind.arr(np.full((B, T, HV, V), POISON, np.float32)),
               initial_state=kind.arr(np.full((4, HV, K, V), POISON / 1e6, np.float32)),
               ssm_state_indices=kind.arr(np.array([2], np.int32)), inplace_final_state=True)
    x.update(over)
    return x


def gated(kind):
    return dict(use_gate_in_kernel=True, A_log=kind.arr(np.zeros(HV, np.float32)),
                dt_bias=kind.arr(np.zeros(HV * K, np.float32)))


def gva(kind, H_=2, HV_=3):
    """q, k with H_ heads and v, g, beta with HV_ heads."""
    x = make_inputs(np.random.default_rng(1), B, T, H_, H_, K, V)
    y = make_inputs(np.random.default_rng(1), B, T, HV_, HV_, K, V)
    return dict(q=kind.arr(x["q"]), k=kind.arr(x["k"]), v=kind.arr(y["v"]), g=kind.arr(y["g"]),
                beta=kind.arr(y["beta"]))


def dtype_of(kind, x, dt):
    return kind.arr(np.asarray(x.cpu() if kind.torch is not None else x).astype(dt))


CHUNK, FUSED = kda.chunk_kda, kda.fused_recurrent_kda
# name: (entry, kwargs(kind), exception, the argument named); `inputs` or `fused_inputs` fill the rest
CASES = {
    # dtypes and shapes
    "q_float64": (CHUNK, lambda X: {k: dtype_of(X, v, np.float64) for k, v in inputs(X).items()},
                  NotImplementedError, "q"),
    "k_dtype_differs": (FUSED, lambda X: dict(k=dtype_of(X, inputs(X)["k"], np.float16)), NotImplementedError,
                        "k"),
    "v_wrong_length": (CHUNK, lambda X: dict(v=X.arr(np.zeros((B, T + 1, HV, V), np.float32))), ValueError, "v"),
    "g_wrong_K": (FUSED, lambda X: dict(g=X.arr(np.zeros((B, T, HV, K - 1), np.float32))), ValueError, "g"),
    "beta_wrong_heads": (CHUNK, lambda X: dict(beta=X.arr(np.zeros((B, T, HV + 1), np.float32))), ValueError,
                         "beta"),
    "headwise_beta_wrong_shape": (FUSED, lambda X: dict(beta=X.arr(np.zeros((B, T, HV, V + 1), np.float32))),
                                  ValueError, "beta"),
    "q_five_dims": (FUSED, lambda X: dict(q=X.arr(np.zeros((B, T, H, K, 1), np.float32))), ValueError, "q"),
    "k_a_list": (CHUNK, lambda X: dict(k=np.zeros((B, T, H, K)).tolist()), TypeError, "k"),
    "gva_head_mismatch": (FUSED, lambda X: dict(gva(X), out=None, initial_state=None, ssm_state_indices=None,
                                                 inplace_final_state=False), ValueError, "v"),
    "gva_head_mismatch_chunk": (CHUNK, lambda X: gva(X), AssertionError, "v"),
    # states
    "initial_state_wrong_shape": (CHUNK, lambda X: dict(initial_state=X.arr(np.zeros((B, HV, V + 1, K), np.float32))),
                                  ValueError, "initial_state"),
    "initial_state_float16": (CHUNK, lambda X: dict(initial_state=X.arr(np.zeros((B, HV, K, V), np.float16))),
                              AssertionError, "initial_state"),
    "pool_wrong_tail": (FUSED, lambda X: dict(initial_state=X.arr(np.zeros((4, HV, K, V + 1), np.float32))),
                        ValueError, "initial_state"),
    "pool_not_contiguous": (FUSED, lambda X: dict(initial_state=X.strided(np.zeros((4, HV, K, V), np.float32))),
                            (ValueError, NotImplementedError), "initial_state"),
    "inplace_without_state": (FUSED, lambda X: dict(initial_state=None, ssm_state_indices=None), AssertionError,
                              "initial_state"),
    "states_per_sequence": (CHUNK, lambda X: dict(initial_state=X.arr(np.zeros((3, HV, K, V), np.float32)),
                                                  **X.cu([0, 3, T])), ValueError, "initial_state"),
    # cu_seqlens
    "cu_seqlens_empty_message": (CHUNK, lambda X: dict(cu_seqlens=X.arr(np.zeros(0, np.int32))), ValueError,
                                 "cu_seqlens", "empty"),
    "cu_seqlens_empty_list_message": (FUSED, lambda X: dict(cu_seqlens=[]), ValueError, "cu_seqlens", "empty"),
    "cu_seqlens_not_monotone": (CHUNK, lambda X: X.cu([0, 5, 3, T]), ValueError, "cu_seqlens", "monotone"),
    "cu_seqlens_float": (FUSED, lambda X: dict(cu_seqlens=X.arr(np.array([0.0, T])), ssm_state_indices=None,
                                               initial_state=None, inplace_final_state=False),
                         ValueError, "cu_seqlens"),
    "cu_seqlens_uint64_true_value": (CHUNK, lambda X: dict(cu_seqlens=X.arr(np.array([0, 2 ** 63 + 1], np.uint64))),
                                     ValueError, "cu_seqlens", "9223372036854775809"),
    "cu_seqlens_two_dims": (CHUNK, lambda X: dict(cu_seqlens=X.arr(np.zeros((1, 2), np.int32))), ValueError,
                            "cu_seqlens"),
    "cu_seqlens_end_not_T": (CHUNK, lambda X: X.cu([0, T - 1]), ValueError, "cu_seqlens"),
    "cu_seqlens_batch_two": (CHUNK, lambda X: dict(q=X.arr(np.zeros((2, T, H, K), np.float32)), **X.cu([0, T])),
                             ValueError, "q"),
    # scale and lower_bound: kda_args_t's floats
    "scale_string_refused": (CHUNK, lambda X: dict(scale="0.5"), TypeError, "scale"),
    "scale_rounds_to_zero_refused": (FUSED, lambda X: dict(scale=1e-46), ValueError, "scale", "rounds to 0"),
    "scale_nan_refused": (CHUNK, lambda X: dict(scale=float("nan")), ValueError, "scale"),
    "scale_overflows_float32": (FUSED, lambda X: dict(scale=1e39), ValueError, "scale"),
    "lower_bound_rounds_to_zero_refused": (CHUNK, lambda X: dict(gated(X), lower_bound=-1e-46), ValueError,
                                           "lower_bound", "rounds to 0"),
    "lower_bound_string_refused": (FUSED, lambda X: dict(gated(X), lower_bound="-1"), TypeError, "lower_bound"),
    "lower_bound_positive": (CHUNK, lambda X: dict(gated(X), lower_bound=0.5), ValueError, "lower_bound"),
    # gate parameters and flags
    "A_log_wrong_size": (FUSED, lambda X: dict(gated(X), A_log=X.arr(np.zeros(HV + 1, np.float32))), ValueError,
                         "A_log"),
    "dt_bias_wrong_size": (CHUNK, lambda X: dict(gated(X), dt_bias=X.arr(np.zeros(HV, np.float32))), ValueError,
                           "dt_bias"),
    "gate_without_A_log": (FUSED, lambda X: dict(use_gate_in_kernel=True), ValueError, "A_log"),
    "neg_eigval_without_sigmoid": (CHUNK, lambda X: dict(allow_neg_eigval=True), ValueError, "allow_neg_eigval"),
    "unknown_keyword": (FUSED, lambda X: dict(no_such_option=1), TypeError, "no_such_option"),
    "cp_piece_len_not_a_multiple": (CHUNK, lambda X: dict(cp_piece_len=100), ValueError, "cp_piece_len"),
    # out=
    "out_named_out": (FUSED, lambda X: dict(out=X.arr(np.zeros((B, T, HV, V + 1), np.float32))), AssertionError,
                      "out"),
    "out_wrong_dtype": (FUSED, lambda X: dict(out=X.arr(np.zeros((B, T, HV, V), np.float64))), NotImplementedError,
                        "out"),
    "out_aliases_v": (FUSED, "out=v", ValueError, "out"),
    "out_not_contiguous": (FUSED, lambda X: dict(out=X.strided(np.zeros((B, T, HV, V), np.float32))), ValueError,
                           "out"),
    # state pools
    "slot_out_of_range": (FUSED, lambda X: dict(ssm_state_indices=X.arr(np.array([4], np.int32))), ValueError,
                          "ssm_state_indices"),
    "slots_not_distinct": (FUSED, lambda X: dict(ssm_state_indices=X.arr(np.array([1, 1], np.int32)),
                                                 **X.cu([0, 4, T])), ValueError, "ssm_state_indices", "distinct"),
    "slots_not_integers": (FUSED, lambda X: dict(ssm_state_indices=X.arr(np.array([1.0], np.float32))), ValueError,
                           "ssm_state_indices"),
    "slots_per_sequence": (FUSED, lambda X: dict(ssm_state_indices=X.arr(np.array([0, 1], np.int32))), ValueError,
                           "ssm_state_indices"),
    "slot_beyond_int32": (FUSED, lambda X: dict(ssm_state_indices=np.array([2 ** 40], np.int64)), ValueError,
                          "ssm_state_indices"),
    "accepted_tokens_need_2d_slots": (FUSED, lambda X: dict(num_accepted_tokens=X.arr(np.array([1], np.int32))),
                                      ValueError, "num_accepted_tokens"),
}


def call_case(name, kind):
    entry, make, exc, arg, *rest = CASES[name]
    X = Kind(kind)
    base = fused_inputs(X) if entry is FUSED else inputs(X)
    if make == "out=v":
        base["out"] = base["v"]
    else:
        base.update(make(X))
    kw = {key: val for key, val in base.items() if val is not None}  # None: the case takes the argument away
    return entry, kw, exc, arg, (rest[0] if rest else None)


def snapshot(kw):
    return {key: (val.cpu().numpy() if hasattr(val, "cpu") else val).copy()
            for key, val in kw.items() if hasattr(val, "shape")}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", list(CASES))
def test_bad_input(name, kind):
    entry, kw, exc, arg, words = call_case(name, kind)
    before = snapshot(kw)
    with pytest.raises(exc) as info:
        entry(**kw)
    e = info.value
    assert isinstance(e, kda.KDAError), type(e)
    msg = str(e)
    assert msg.startswith(entry.__name__) and (f"'{arg}" in msg or f"`{arg}" in msg), msg
    if words:
        assert words in msg, msg
    after = snapshot(kw)
    for key, val in before.items():
        np.testing.assert_array_equal(after[key], val, err_msg=f"{name}: {key} was written")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("entry", [CHUNK, FUSED], ids=["chunk", "fused"])
def test_base_inputs_are_valid(entry, kind):
    """The table's starting point runs: each case's error is the one it introduces."""
    X = Kind(kind)
    kw = fused_inputs(X) if entry is FUSED else inputs(X)
    o, _ = entry(**kw)
    o = o.cpu().numpy() if hasattr(o, "cpu") else o
    assert np.isfinite(o).all() and not (o == POISON).any()


# ssm_state_indices [N] or [N, T_max], cu_seqlens, num_accepted_tokens: each a bad pool index of one kind
SLOT_CASES = {
    "1d_range": ([40], None, None),
    "1d_repeat": ([1, 5, 1], [0, 2, 4, T], None),
    "2d_read_range": ([[0] * 8, [8] * 7 + [50]], [0, 4, T], [1, 8]),
    "2d_write_range": ([list(range(8)), [8, 40] + [9] * 6], [0, 6, T], None),
    "2d_twice": ([[0, 1, 0, 3, 4, 5, 6, 7], list(range(8, 16))], [0, 4, T], None),
    "2d_read_taken": ([list(range(8)), list(range(8, 15)) + [1]], [0, 4, T], [1, 8]),
    "2d_accepted": ([list(range(8)), list(range(8, 16))], [0, 4, T], [0, 1]),
    "2d_columns": ([[0, 1, 2, 3], [8, 9, 10, 11]], [0, 3, T], None),
    "2d_columns_T": ([list(range(4))], None, None),
}


@pytest.mark.parametrize("name", list(SLOT_CASES))
def test_device_slot_check_words_as_libkda(name):
    """kda._torch.device_slots (CUDA tensors' ssm_state_indices, read on the host in eager calls) reports each bad
    pool index as libkda's check of host indices does (here on the CPU backend): the same argument and words."""
    torch = pytest.importorskip("torch")
    from kda import _torch
    idx, cu, nat = (None if x is None else np.array(x, np.int32) for x in SLOT_CASES[name])
    X = Kind("numpy")
    kw = fused_inputs(X, initial_state=np.zeros((40, HV, K, V), np.float32), ssm_state_indices=idx,
                      num_accepted_tokens=nat, **({} if cu is None else X.cu(cu)))
    with pytest.raises(ValueError) as c_side:
        FUSED(**kw)
    t = {key: None if val is None else torch.from_numpy(val) for key, val in (("idx", idx), ("nat", nat), ("cu", cu))}
    with pytest.raises(ValueError) as py_side:
        _torch.device_slots("fused_recurrent_kda", t["idx"], t["nat"], t["cu"], T, 40)
    c_msg = str(c_side.value).split(" (libkda's field")[0]
    assert str(py_side.value).split("': ", 1)[1] == c_msg.split("': ", 1)[1], (str(py_side.value), c_msg)
    assert "argument 'ssm_state_indices'" in str(py_side.value) or "'num_accepted_tokens'" in c_msg


def test_table_size():
    assert len(CASES) >= 30
