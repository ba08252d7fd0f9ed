"""Context parallelism across ranks (kda.build_cp_context, chunk_kda's cp_context): R = 1 .. 4 processes
(torch.multiprocessing, forked; the gloo backend, CPU tensors), each holding its slice of the packed tokens, against the
unsplit single-process call: o, the final states, every gradient (A_log's and dt_bias's summed over the ranks);
sequences spanning several ranks and boundaries on a rank's edge, GVA, in-kernel gates; bad contexts. One job of 4
processes runs every case (the groups of 1, 2, 3 ranks are subgroups of it); the tests read its report. A CUDA
variant (NCCL, one spawned rank, and FLA's own build_cp_context where FLA is installed) runs with a GPU."""

import datetime
import json
import os
import socket
import types

import numpy as np
import pytest

import kda
from kda_reference import rel_err

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
mp = pytest.importorskip("torch.multiprocessing")

PART, H, HV, K, V = 24, 1, 2, 16, 16  # tokens per rank; GVA: two value heads per query/key head
GATE = dict(use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True)
# name: (R, sequence lengths (sum R * PART), chunk_kda options)
CASES = {
    "r1_one": (1, [24], {}),
    "r1_two": (1, [10, 14], GATE),
    "r2_one_long": (2, [48], {}),
    "r2_edge": (2, [24, 24], dict(state_v_first=True)),
    "r2_cross": (2, [30, 18], GATE),
    "r3_one_long": (3, [72], GATE),
    "r3_middle": (3, [5, 60, 7], dict(scale=0.3)),
    "r3_edge_and_cross": (3, [24, 30, 18], dict(state_v_first=True, use_qk_l2norm_in_kernel=True)),
    "r4_one_long": (4, [96], {}),
    "r4_across_all": (4, [10, 70, 16], GATE),
    "r4_edges": (4, [24, 48, 24], dict(use_gate_in_kernel=True, lower_bound=-2.0)),
    "r4_many": (4, [3, 21, 9, 40, 1, 22], dict(use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True)),
}
BAD = ("world_size", "pre_beyond_rank", "post_beyond_ranks", "tokens", "cu_seqlens", "cu_seqlens_cpu", "not_int",
       "uneven")
FLA_FIELDS = ("group", "cu_seqlens", "cu_seqlens_cpu", "is_last_rank", "pre_num_ranks", "is_first_rank",
              "post_num_ranks", "conv1d_kernel_size", "pre_num_conv_tokens")


def problem(lens, opts, device="cpu"):
    """The unsplit problem: global inputs (the same in every process), loss weights, initial states."""
    g = torch.Generator().manual_seed(sum(lens) * 7 + len(lens))
    T, N = sum(lens), len(lens)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    x = dict(q=r(1, T, H, K), k=r(1, T, H, K), v=r(1, T, HV, V), beta=torch.rand(1, T, HV, generator=g))
    x["g"] = r(1, T, HV, K) if opts.get("use_gate_in_kernel") else -0.4 * torch.rand(1, T, HV, K, generator=g)
    if not opts.get("use_qk_l2norm_in_kernel"):
        x["k"] = torch.nn.functional.normalize(x["k"], dim=-1)
    if opts.get("use_gate_in_kernel"):
        x["A_log"], x["dt_bias"] = 0.3 * r(HV), 0.5 * r(HV * K)
    state = (N, HV, V, K) if opts.get("state_v_first") else (N, HV, K, V)
    x["initial_state"] = 0.5 * r(*state)
    w = dict(do=r(1, T, HV, V), dht=r(*state))
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int64)
    return {key: t.to(device) for key, t in x.items()}, {key: t.to(device) for key, t in w.items()}, cu.to(device)


def loss_and_grads(x, w, rows, **kw):
    """o, final state, and the gradients of sum(o * do) + sum(ht[rows] * dht[rows]) w.r.t. every input."""
    leaves = {key: t.clone().requires_grad_() for key, t in x.items()}
    o, ht = kda.chunk_kda(**leaves, output_final_state=True, **kw)
    loss = (o * w["do"]).sum() + (ht[rows] * w["dht"]).sum()
    loss.backward()
    return o.detach(), ht.detach(), {key: t.grad for key, t in leaves.items()}


def run_case(name, rank, group, device="cpu", build=None):
    """This rank's part of case `name`: an error string, or None when every result matches the unsplit call."""
    R, lens, opts = CASES[name]
    x, w, cu = problem(lens, opts, device)
    o_ref, ht_ref, g_ref = loss_and_grads(x, w, slice(None), cu_seqlens=cu, **opts)
    ctx = (build or kda.build_cp_context)(cu, group)
    lo, hi = rank * PART, (rank + 1) * PART
    offsets = cu.tolist()
    first = int(np.searchsorted(offsets, lo, side="right")) - 1  # the global index of its first local sequence
    n_local = len(ctx.cu_seqlens) - 1
    seqs = list(range(first, first + n_local))
    ends_here = [i < n_local - 1 or ctx.post_num_ranks == 0 for i in range(n_local)]
    xl = {key: (t[:, lo:hi] if t.dim() >= 3 and key != "initial_state" else t) for key, t in x.items()}
    xl["initial_state"] = x["initial_state"][seqs].clone()
    if ctx.pre_num_ranks > 0:  # the state entering its first sequence comes from the earlier ranks: not read
        xl["initial_state"][0] = float("nan")
    wl = dict(do=w["do"][:, lo:hi], dht=w["dht"][seqs][ends_here])
    o, ht, grads = loss_and_grads(xl, wl, torch.tensor(ends_here), cp_context=ctx, **opts)
    checks = [("o", o, o_ref[:, lo:hi]), ("final_state", ht[ends_here], ht_ref[seqs][ends_here])]
    for key in ("q", "k", "v", "g", "beta"):
        checks.append(("d" + key, grads[key], g_ref[key][:, lo:hi]))
    dh0 = g_ref["initial_state"][seqs].clone()
    if ctx.pre_num_ranks > 0:
        dh0[0] = 0  # its gradient went to the earlier ranks through the summary
    checks.append(("d_initial_state", grads["initial_state"], dh0))
    for key in ("A_log", "dt_bias"):  # replicated parameters: each rank's gradient is its part of the sum
        if key in grads:
            total = grads[key].clone()
            dist.all_reduce(total, group=group)
            checks.append(("d" + key + " (summed)", total, g_ref[key]))
    errs = [f"{what}: relative error {rel_err(got.cpu().numpy(), ref.cpu().numpy()):.3g}"
            for what, got, ref in checks if not rel_err(got.cpu().numpy(), ref.cpu().numpy()) <= 2e-5]
    if build is None:  # FLA's FLACPContext has no world_size / rank: a plain object with its fields does as well
        fla_like = types.SimpleNamespace(**{f: getattr(ctx, f) for f in FLA_FIELDS})
        o2, _ = kda.chunk_kda(**{key: t for key, t in xl.items() if key != "initial_state"}, cp_context=fla_like,
                              **opts)
        o1, _ = kda.chunk_kda(**{key: t for key, t in xl.items() if key != "initial_state"}, cp_context=ctx, **opts)
        if not torch.equal(o1, o2):
            errs.append("an FLA-like context gives another o")
    return "; ".join(errs) or None


def run_bad(name, rank, group):
    """A bad context or argument: every rank of the group raises (before any exchange) a KDAError naming it."""
    R, lens, opts = 2, [30, 18], {}
    x, _, cu = problem(lens, opts)
    ctx = kda.build_cp_context(cu, group)
    xl = {key: t[:, rank * PART:(rank + 1) * PART] for key, t in x.items() if key != "initial_state"}
    arg, kw = "cp_context", {}
    if name == "world_size":
        kw["cp_context"] = ctx.__class__(**{**vars(ctx), "world_size": 3})
    elif name == "pre_beyond_rank":
        kw["cp_context"] = ctx.__class__(**{**vars(ctx), "pre_num_ranks": rank + 1})
    elif name == "post_beyond_ranks":
        kw["cp_context"] = ctx.__class__(**{**vars(ctx), "post_num_ranks": R - rank})
    elif name == "not_int":
        kw["cp_context"] = ctx.__class__(**{**vars(ctx), "pre_num_ranks": None})
    elif name == "tokens":
        xl = {key: t[:, :-1] for key, t in xl.items()}
    elif name in ("cu_seqlens", "cu_seqlens_cpu"):
        arg, kw[name] = name, cu  # the global offsets, where the context holds the rank's
    elif name == "uneven":
        try:
            kda.build_cp_context(torch.tensor([0, 47]), group)
        except ValueError as e:
            return None if isinstance(e, kda.KDAError) and "'cu_seqlens'" in str(e) else repr(e)
        return "no error"
    kw.setdefault("cp_context", ctx)
    try:
        kda.chunk_kda(**xl, **kw)
    except (ValueError, TypeError) as e:
        ok = isinstance(e, kda.KDAError) and str(e).startswith("chunk_kda: ") and f"'{arg}'" in str(e)
        return None if ok else repr(e)
    return "no error"


def worker(rank, world, port, out_dir, backend):
    global K, V
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if backend == "nccl":
        torch.cuda.set_device(rank)
        K = V = 64  # head sizes the CUDA backend's chunked kernels and backward take
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    report = {}
    try:
        if backend == "nccl":
            for name in ("r1_one", "r1_two"):
                report[name] = run_case(name, rank, dist.group.WORLD, "cuda")
            try:
                from fla.ops.cp import build_cp_context as fla_build
            except Exception:  # noqa: BLE001 (fla needs triton; any import failure means "absent")
                fla_build = None
            if fla_build is not None:
                report["fla_context"] = run_case("r1_two", rank, dist.group.WORLD, "cuda", fla_build)
        else:
            kda.set_num_threads(1)
            groups = {R: dist.new_group(list(range(R))) for R in range(1, world)}
            groups[world] = dist.group.WORLD
            for name, (R, _, _) in CASES.items():
                if rank < R:
                    report[name] = run_case(name, rank, groups[R])
            for name in BAD:
                if rank < 2:
                    report["bad_" + name] = run_bad(name, rank, groups[2])
    except Exception as e:  # noqa: BLE001: reported to the test, with the case it stopped at
        report["job"] = f"{type(e).__name__}: {e}"
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(tmp, world, backend):
    """The job's report: {case: {rank: error or None}}."""
    ctx = mp.start_processes(worker, args=(world, _free_port(), str(tmp), backend), nprocs=world, join=False,
                             start_method="spawn" if backend == "nccl" else "fork")
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=240)
    while not ctx.join(timeout=5):
        if datetime.datetime.now() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("the CP job did not finish in 240 s (a rank waiting on a collective?)")
    report = {}
    for r in range(world):
        with open(tmp / f"rank{r}.json") as f:
            for case, err in json.load(f).items():
                report.setdefault(case, {})[r] = err
    return report


@pytest.fixture(scope="module")
def cpu_job(tmp_path_factory):
    return run_job(tmp_path_factory.mktemp("cp_gloo"), 4, "gloo")


@pytest.mark.parametrize("name", list(CASES))
def test_split_matches_unsplit(cpu_job, name):
    assert "job" not in cpu_job, cpu_job["job"]
    R = CASES[name][0]
    assert cpu_job[name] == {r: None for r in range(R)}


@pytest.mark.parametrize("name", BAD)
def test_bad_context(cpu_job, name):
    assert "job" not in cpu_job, cpu_job["job"]
    assert cpu_job["bad_" + name] == {0: None, 1: None}


def test_context_fields_as_fla():
    """build_cp_context's split, by hand: three ranks of 24 tokens, sequences [0, 30), [30, 54), [54, 72)."""
    group = object()
    calls = {}

    class FakeDist:
        group = types.SimpleNamespace(WORLD=None)

        @staticmethod
        def get_world_size(g):
            return 3

        @staticmethod
        def get_rank(g):
            return calls["rank"]

    from kda import _cp
    real = _cp.dist
    _cp.dist = FakeDist
    try:
        got = []
        for r in range(3):
            calls["rank"] = r
            c = kda.build_cp_context(torch.tensor([0, 30, 54, 72]), group)
            got.append((c.cu_seqlens.tolist(), c.cu_seqlens_cpu.tolist(), c.pre_num_ranks, c.post_num_ranks,
                         c.is_first_rank, c.is_last_rank, c.pre_num_conv_tokens, c.world_size, c.rank))
            assert c.group is group and c.cu_seqlens.dtype == torch.int32
    finally:
        _cp.dist = real
    assert got == [([0, 24], [0, 24], 0, 1, True, False, 0, 3, 0),
                   ([0, 6, 24], [0, 6, 24], 1, 1, False, False, 24, 3, 1),
                   ([0, 6, 24], [0, 6, 24], 1, 0, False, True, 18, 3, 2)]


def test_numpy_inputs_refused():
    x = {key: t.numpy() for key, t in problem([8], {})[0].items() if key != "initial_state"}
    with pytest.raises(NotImplementedError, match="'cp_context'"):
        kda.chunk_kda(**x, cp_context=kda.CPContext(cu_seqlens=torch.tensor([0, 8])))


def test_needs_torch_distributed():
    if dist.is_initialized():
        pytest.skip("torch.distributed is initialized in this process")
    x = {key: t for key, t in problem([8], {})[0].items() if key != "initial_state"}
    ctx = kda.CPContext(cu_seqlens=torch.tensor([0, 8], dtype=torch.int32), pre_num_ranks=0, post_num_ranks=0)
    with pytest.raises(ValueError, match="'cp_context'.*init_process_group"):
        kda.chunk_kda(**x, cp_context=ctx)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU visible to torch")
def test_cuda_nccl_one_rank(tmp_path):
    report = run_job(tmp_path, 1, "nccl")
    assert "job" not in report, report["job"]
    assert report["r1_one"] == {0: None} and report["r1_two"] == {0: None}
    assert report.get("fla_context", {0: None}) == {0: None}
