"""FLA's own KDA tests as libkda's external yardstick: libkda swapped in for FLA's entry points.

Not collected by libkda's suite. scripts/fla-tests.sh copies this file into a folder holding FLA's `fla/` and
`tests/ops/test_kda.py` (from FLA's source; an ignored folder, FLA's code is never committed here) and runs
    python3 -m pytest tests/ops/test_kda.py -k "not flash_kda and not ascend"
with KDA_LIBRARY and PYTHONPATH pointing at a GPU build of libkda. This conftest runs before test_kda.py is
imported, so the test module's `from fla.ops.kda import ...` picks up libkda's functions.
"""
import fla.ops.kda
import fla.ops.kda.fused_recurrent

import kda

_FLA_CHUNK = fla.ops.kda.chunk_kda


def _fused_recurrent_kda_fwd(q, k, v, g, beta, A_log=None, dt_bias=None, initial_state=None, scale=None,
                             output_final_state=False, inplace_final_state=True, state_v_first=False,
                             cu_seqlens=None, ssm_state_indices=None, num_accepted_tokens=None,
                             use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                             use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None, out=None,
                             **kwargs):
    """FLA's fused_recurrent_kda_fwd signature (fla/ops/kda/fused_recurrent.py) on kda.fused_recurrent_kda."""
    extra = {}
    if ssm_state_indices is not None:
        extra["ssm_state_indices"] = ssm_state_indices
    if num_accepted_tokens is not None:
        extra["num_accepted_tokens"] = num_accepted_tokens
    o, ht = kda.fused_recurrent_kda(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, scale=scale,
                                    initial_state=initial_state, output_final_state=output_final_state,
                                    inplace_final_state=inplace_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                    use_gate_in_kernel=use_gate_in_kernel,
                                    use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                                    allow_neg_eigval=allow_neg_eigval, lower_bound=lower_bound,
                                    state_v_first=state_v_first, cu_seqlens=cu_seqlens, **extra)
    if out is not None:
        out.copy_(o)
        o = out
    if inplace_final_state:
        ht = initial_state
    return o, ht


fla.ops.kda.chunk_kda = kda.chunk_kda
fla.ops.kda.fused_recurrent_kda = kda.fused_recurrent_kda
fla.ops.kda.fused_recurrent.fused_recurrent_kda_fwd = _fused_recurrent_kda_fwd
