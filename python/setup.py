"""Builds libkda with CMake from the repository (the parent of this directory) and bundles libkda.so into the
``kda`` package, so that ``pip install ./python`` gives a working ``import kda``.

Environment (read by this build only; the library itself reads none of these):
  KDA_WITH_CUDA       AUTO (default), ON or OFF: CMake's KDA_WITH_CUDA. AUTO builds the CUDA backend only when a
                      supported GPU is visible (nvidia-smi answers) and nvcc works, for that GPU's architecture;
                      without a GPU the package is CPU-only unless this is ON
  KDA_CUDA_ARCHS      CUDA architectures to build, e.g. "90a,100a" (CMake's KDA_CUDA_ARCHS; implies CUDA)
  KDA_BUNDLE_LIBRARY  path of a prebuilt libkda.so to bundle instead of building one
  KDA_CMAKE_ARGS      extra arguments for the CMake configure step, e.g. "-DKDA_CPU_ISAS=v3;v4" for a package that
                      runs each x86-64 machine at its level (the default builds for this machine's level only)
  KDA_BUILD_PROGRESS  0: no progress lines on the terminal (see _Progress)
The libkda build took 39 s on a fresh clone on an idle 2-core x86-64 machine with nvcc and no GPU (so CPU-only);
with CUDA, nvcc's kernel builds take most of the time (build only the architectures you need).
"""

import os
import shlex
import shutil
import re
import subprocess
import sys
import time

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _build_libkda(build_temp: str) -> str:
    prebuilt = os.environ.get("KDA_BUNDLE_LIBRARY")
    if prebuilt:
        if not os.path.isfile(prebuilt):
            raise RuntimeError(f"KDA_BUNDLE_LIBRARY={prebuilt} is not a file")
        return prebuilt
    if not os.path.isfile(os.path.join(ROOT, "CMakeLists.txt")) or not os.path.isfile(
            os.path.join(ROOT, "include", "kda.h")):
        raise RuntimeError(f"kda: libkda's sources are not at {ROOT} (build from the repository's python/ directory, "
                           f"or set KDA_BUNDLE_LIBRARY to a prebuilt libkda.so)")
    cmake = shutil.which("cmake")
    if cmake is None:
        raise RuntimeError("kda: CMake (>= 3.22) is needed to build libkda: install it (apt-get install cmake, or "
                           "pip install cmake) or set KDA_BUNDLE_LIBRARY to a prebuilt libkda.so")
    build_dir = os.path.join(os.path.abspath(build_temp), "libkda")
    cfg = [cmake, "-S", ROOT, "-B", build_dir, "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_TESTING=OFF"]
    if shutil.which("ninja") and not os.path.exists(os.path.join(build_dir, "CMakeCache.txt")):
        cfg += ["-G", "Ninja"]
    with_cuda = os.environ.get("KDA_WITH_CUDA", "").strip().upper() or "AUTO"
    if with_cuda not in ("AUTO", "ON", "OFF"):
        raise RuntimeError(f"kda: KDA_WITH_CUDA must be AUTO, ON or OFF (is {os.environ['KDA_WITH_CUDA']!r})")
    archs = os.environ.get("KDA_CUDA_ARCHS", "").strip().replace(";", ",")
    if with_cuda == "AUTO" and not archs and not shutil.which("nvcc") and not os.environ.get("CUDACXX"):
        with_cuda = "OFF"  # no CUDA compiler: the CPU backends only
    cfg.append(f"-DKDA_WITH_CUDA={with_cuda}")
    if archs:
        cfg.append(f"-DKDA_CUDA_ARCHS={archs}")
    cfg += shlex.split(os.environ.get("KDA_CMAKE_ARGS", ""))
    progress = _Progress()
    progress.say("kda: configuring libkda with CMake (%s)" % {
        "OFF": "CUDA off", "ON": "CUDA on", "AUTO": "CUDA when a supported GPU is visible and nvcc works"}[with_cuda])
    _run_logged(cfg, progress)
    # (all targets: with Ninja, "--target kda" would name the CLI executable's file rather than the library)
    progress.say(f"kda: building libkda ({os.cpu_count() or 2} jobs; about 1.5 min on 2 cores without CUDA, longer with it)")
    _run_logged([cmake, "--build", build_dir, "-j", str(os.cpu_count() or 2)], progress)
    progress.say(f"kda: libkda built in {time.monotonic() - progress.t0:.0f} s")
    lib = os.path.join(build_dir, "libkda.so")
    if not os.path.exists(lib):
        raise RuntimeError(f"kda: the CMake build did not produce {lib}")
    return lib


class _Progress:
    """Progress of the long native build where the person running pip can see it. pip shows a build's output only
    with -v (else "still running..."), so besides the build log (stdout, always), one line every few seconds
    and each step ("[12/37] Building CUDA object ...") go to the terminal (/dev/tty) when there is one and
    KDA_BUILD_PROGRESS is not 0."""

    def __init__(self):
        self.t0 = time.monotonic()
        self.last = 0.0
        self.tty = None
        if os.environ.get("KDA_BUILD_PROGRESS", "1") != "0" and not sys.stdout.isatty():
            try:
                self.tty = open("/dev/tty", "w")
            except OSError:
                self.tty = None

    def say(self, line: str, step: bool = False) -> None:
        print(line, flush=True)
        now = time.monotonic()
        if self.tty is not None and (not step or now - self.last >= 3.0):
            self.last = now
            try:
                self.tty.write(f"\n{line} [{now - self.t0:.0f} s]" if step else f"\n{line}")
                self.tty.flush()
            except OSError:
                self.tty = None


_STEP = re.compile(r"^\[\s*\d+/\s*\d+\]|^\[\s*\d+%\]")  # Ninja's "[12/37] ..." and Make's "[ 40%] ..."


def _run_logged(cmd: list, progress: _Progress) -> None:
    """Run cmd, passing its output on line by line (the build steps to the terminal as well)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
    tail = []
    for line in proc.stdout:
        line = line.rstrip("\n")
        tail = (tail + [line])[-40:]
        if _STEP.match(line):
            progress.say("kda: " + line[:150], step=True)
        elif line.startswith("-- libkda: CUDA backend"):  # whether CUDA is built, and why not
            progress.say("kda: " + line[3:])
        else:
            print(line, flush=True)
    if proc.wait() != 0:
        raise RuntimeError(f"kda: {cmd[0]} failed (exit {proc.returncode}); its last lines:\n" + "\n".join(tail))


class BuildPyWithLibkda(build_py):
    """build_py, plus libkda.so built (or taken from KDA_BUNDLE_LIBRARY) and copied into kda/."""

    def run(self):
        super().run()
        build_temp = self.get_finalized_command("build").build_temp
        lib = _build_libkda(build_temp)
        dest = os.path.join(self.build_lib, "kda", "libkda.so")
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        shutil.copyfile(lib, dest)  # follows the libkda.so -> libkda.so.0 -> ... links
        os.chmod(dest, 0o755)


class BinaryDistribution(Distribution):
    """The wheel holds a native library: it is platform-specific."""

    def has_ext_modules(self):
        return True


cmdclass = {"build_py": BuildPyWithLibkda}
try:  # tag the wheel py3-none-<platform>: no CPython extension inside, any Python 3 loads it
    try:
        from setuptools.command.bdist_wheel import bdist_wheel
    except ImportError:
        from wheel.bdist_wheel import bdist_wheel

    class BdistWheel(bdist_wheel):
        def finalize_options(self):
            super().finalize_options()
            self.root_is_pure = False

        def get_tag(self):
            _, _, plat = super().get_tag()
            return "py3", "none", plat

    cmdclass["bdist_wheel"] = BdistWheel
except ImportError:  # pragma: no cover
    if "bdist_wheel" in sys.argv:  # pip's build_wheel with an old setuptools and no `wheel` package
        raise SystemExit("kda: building a wheel needs setuptools >= 70.1 (or the `wheel` package): "
                         "pip install 'setuptools>=70.1', or drop --no-build-isolation so that pip installs it")

setup(cmdclass=cmdclass, distclass=BinaryDistribution)
