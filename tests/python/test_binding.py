"""The ctypes binding: kda_args_t's layout, library discovery, contexts, threads, and what `import kda` imports."""

import ctypes
import os
import shutil
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import kda
from kda import _lib
from kda._lib import KdaArgs, KdaBackwardArgs
from kda_reference import make_inputs

REPO = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
PKG = os.path.join(REPO, "python")


# ---------------------------------------------------------------------------------------------------------
# kda_args_t
# ---------------------------------------------------------------------------------------------------------
def test_args_struct_size_matches_the_library():
    L = _lib.library()
    assert L.library_args_size == ctypes.sizeof(KdaArgs)


def test_set_cp_fills_the_context_parallel_fields():
    """The bindings' one number for cp_piece_len (-1 auto, 0 off, > 0 on) as kda_args_t's two fields."""
    a = KdaArgs.from_buffer_copy(_lib.library().template)
    assert (a.cp_mode, a.cp_piece_len) == (_lib.CP_AUTO, 0)
    _lib.set_cp(a, -1)
    assert (a.cp_mode, a.cp_piece_len) == (_lib.CP_AUTO, 0)
    _lib.set_cp(a, 0)
    assert (a.cp_mode, a.cp_piece_len) == (_lib.CP_OFF, 0)
    b = KdaArgs.from_buffer_copy(_lib.library().template)
    _lib.set_cp(b, 128)
    assert (b.cp_mode, b.cp_piece_len) == (_lib.CP_ON, 128)


def test_args_init_defaults_land_in_the_right_fields():
    """kda_args_init on the ctypes struct itself (filled with 0xAB first): every field gets its documented
    default, so a field at a wrong offset would show up here."""
    L = _lib.library()
    a = KdaArgs()
    ctypes.memset(ctypes.addressof(a), 0xAB, ctypes.sizeof(a))
    L.args_init(ctypes.byref(a))
    assert a.struct_size == ctypes.sizeof(KdaArgs)
    expected = dict(batch=1, seq_len=0, num_qk_heads=1, num_v_heads=1, head_dim_k=128, head_dim_v=128,
                    cu_seqlens_dtype=_lib.INT32, dtype=_lib.BFLOAT16, g_dtype=_lib.BFLOAT16,
                    beta_dtype=_lib.BFLOAT16, o_dtype=_lib.BFLOAT16, initial_state_dtype=_lib.FLOAT32,
                    final_state_dtype=_lib.FLOAT32)
    for name, _ in KdaArgs._fields_:
        if name == "struct_size":
            continue
        value = getattr(a, name)
        want = expected.get(name, None if _is_pointer(name) else 0)
        assert value == want, f"{name}: {value!r} != {want!r}"
    # and the template the package copies for each call is the same
    t = L.template
    assert bytes(t) == bytes(a)


def _is_pointer(name):
    return dict(KdaArgs._fields_)[name] is ctypes.c_void_p


@pytest.mark.parametrize("ctype_name, mirror", [("kda_args_t", KdaArgs), ("kda_backward_args_t", KdaBackwardArgs)])
def test_args_layout_matches_the_header(ctype_name, mirror):
    """offsetof() of every field from a C compiler, against the ctypes mirror (skipped without a compiler)."""
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        pytest.skip("no C compiler to read include/kda.h's layout")
    import tempfile
    fields = [name for name, _ in mirror._fields_]
    src = "#include <stddef.h>\n#include <stdio.h>\n#include \"kda.h\"\nint main(void) {\n"
    src += f'  printf("size %zu\\n", sizeof({ctype_name}));\n'
    for f in fields:
        src += f'  printf("{f} %zu %zu\\n", offsetof({ctype_name}, {f}), sizeof((({ctype_name} *)0)->{f}));\n'
    src += "  return 0;\n}\n"
    with tempfile.TemporaryDirectory() as d:
        c, exe = os.path.join(d, "layout.c"), os.path.join(d, "layout")
        with open(c, "w") as fh:
            fh.write(src)
        subprocess.check_call([cc, "-std=c11", "-I", os.path.join(REPO, "include"), c, "-o", exe])
        out = subprocess.check_output([exe], text=True).split("\n")
    got = {}
    for line in out:
        if line:
            parts = line.split()
            got[parts[0]] = tuple(int(p) for p in parts[1:])
    assert got.pop("size") == (ctypes.sizeof(mirror),)
    for name, ctype in mirror._fields_:
        assert got[name] == (getattr(mirror, name).offset, ctypes.sizeof(ctype)), name


# ---------------------------------------------------------------------------------------------------------
# library discovery
# ---------------------------------------------------------------------------------------------------------
def _run_python(code, env_over, pythonpath):
    env = {k: v for k, v in os.environ.items() if k not in ("KDA_LIBRARY", "PYTHONPATH")}
    env.update(env_over)
    env["PYTHONPATH"] = pythonpath
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=120)


CALL = """
    import numpy as np, kda
    x = np.full((1, 2, 1, 4), 0.5, np.float32)
    try:
        kda.chunk_kda(x, x, x, -x, np.full((1, 2, 1), 0.5, np.float32))
    except kda.KDALibraryNotFoundError as e:
        assert isinstance(e, OSError)
        print("NOTFOUND", e)
    else:
        print("LOADED", kda.library_path())
"""


def test_import_works_without_the_library_and_the_call_names_the_places(tmp_path):
    res = _run_python(CALL, {"KDA_LIBRARY": str(tmp_path / "nowhere" / "libkda.so")}, PKG)
    assert res.returncode == 0, res.stderr
    assert "NOTFOUND" in res.stdout and "KDA_LIBRARY" in res.stdout and "nowhere" in res.stdout


def test_search_order_without_env(tmp_path):
    # a copy of the package, away from the build tree: bundled library first
    pkg = tmp_path / "site" / "kda"
    shutil.copytree(os.path.join(PKG, "kda"), pkg, ignore=shutil.ignore_patterns("__pycache__", "libkda.so*"))
    res = _run_python(CALL, {}, str(tmp_path / "site"))
    assert res.returncode == 0, res.stderr
    if "LOADED" in res.stdout:  # only a system-wide libkda (find_library) can have been found
        assert ctypes.util.find_library("kda") is not None
    else:
        for place in ("bundled with the package", "build tree", "find_library"):
            assert place in res.stdout
    shutil.copyfile(_lib.library_path(), pkg / "libkda.so")
    res = _run_python(CALL, {}, str(tmp_path / "site"))
    assert res.returncode == 0, res.stderr
    assert f"LOADED {pkg / 'libkda.so'}" in res.stdout


def test_env_library_is_used():
    res = _run_python(CALL, {"KDA_LIBRARY": _lib.library_path()}, PKG)
    assert res.returncode == 0, res.stderr
    assert f"LOADED {_lib.library_path()}" in res.stdout


def test_numpy_path_never_imports_torch():
    code = textwrap.dedent(CALL) + "import sys\nprint('TORCH' if 'torch' in sys.modules else 'NO-TORCH')\n"
    res = _run_python(code, {"KDA_LIBRARY": _lib.library_path()}, PKG)
    assert res.returncode == 0, res.stderr
    assert "LOADED" in res.stdout and "NO-TORCH" in res.stdout


# ---------------------------------------------------------------------------------------------------------
# contexts and threads
# ---------------------------------------------------------------------------------------------------------
def test_contexts_are_cached_per_backend_and_device():
    a = _lib.get_context(_lib.BACKEND_CPU, 0)
    assert _lib.get_context(_lib.BACKEND_CPU, 0) is a
    r = _lib.get_context(_lib.BACKEND_REFERENCE, 0)
    assert r is not a and r.backend == _lib.BACKEND_REFERENCE
    backend = ctypes.c_int()
    assert _lib.library().get_backend(r.handle, ctypes.byref(backend)) == 0 and backend.value == 2


def test_num_threads_round_trip():
    n = kda.get_num_threads()
    try:
        kda.set_num_threads(1)
        assert kda.get_num_threads() == 1
    finally:
        kda.set_num_threads(n)
    with pytest.raises(ValueError, match="num_threads"):
        kda.set_num_threads(0)


def test_concurrent_calls_from_threads():
    rng = np.random.default_rng(0)
    problems = [make_inputs(rng, 2, 40, 1, 2, 32, 32, state=True) for _ in range(6)]
    expected = [kda.chunk_kda(**p, output_final_state=True) for p in problems]
    results = [None] * len(problems)
    errors = []

    def work(i):
        try:
            for _ in range(10):
                fn = kda.chunk_kda if i % 2 == 0 else kda.fused_recurrent_kda
                fn(**problems[i], output_final_state=True)
            results[i] = kda.chunk_kda(**problems[i], output_final_state=True)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(problems))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for r, e in zip(results, expected):
        np.testing.assert_array_equal(r[0], e[0])
        np.testing.assert_array_equal(r[1], e[1])


def test_errors_are_per_thread():
    """kda_last_error() is thread-local: a failure in one thread carries its own message."""
    x = make_inputs(np.random.default_rng(0), 1, 8, 1, 1, 16, 16)
    messages = {}

    def fail(i):
        cu = np.array([0, 5 + i, 3, 8], np.int32)
        try:
            kda.chunk_kda(**x, cu_seqlens=cu)
        except ValueError as e:
            messages[i] = str(e)

    threads = [threading.Thread(target=fail, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(3):
        assert f"cu_seqlens[1] = {5 + i}" in messages[i]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork on this platform")
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_calls_work_in_a_forked_child():
    """A forked child (e.g. a DataLoader worker) gets fresh contexts: the parent's CPU worker threads are gone."""
    import time
    x = make_inputs(np.random.default_rng(0), 1, 40, 1, 2, 16, 16)
    expected, _ = kda.chunk_kda(**x)  # the parent has a CPU context with its threads
    pid = os.fork()
    if pid == 0:  # child
        code = 1
        try:
            o, _ = kda.chunk_kda(**x)
            code = 0 if np.array_equal(o, expected) else 2
        finally:
            os._exit(code)
    deadline = time.monotonic() + 60
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the call in the forked child hung")
        time.sleep(0.01)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
