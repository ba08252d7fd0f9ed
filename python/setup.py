"""Builds libkda with CMake from the repository (the parent of this directory) and bundles libkda.so into the
``kda`` package, so that ``pip install ./python`` gives a working ``import kda``.

Environment:
  KDA_BUNDLE_LIBRARY  path of a prebuilt libkda.so to bundle instead of building one
  KDA_CMAKE_ARGS      extra arguments for the CMake configure step (e.g. "-DKDA_WITH_CUDA=OFF")
Without nvcc (on PATH or in $CUDACXX) the CUDA backend is switched off; otherwise CMake decides (KDA_WITH_CUDA=AUTO).
"""

import os
import shlex
import shutil
import subprocess

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
    if not shutil.which("nvcc") and not os.environ.get("CUDACXX"):
        cfg.append("-DKDA_WITH_CUDA=OFF")  # no CUDA compiler: the CPU backends only
    cfg += shlex.split(os.environ.get("KDA_CMAKE_ARGS", ""))
    subprocess.check_call(cfg)
    # (all targets: with Ninja, "--target kda" would name the CLI executable's file rather than the library)
    subprocess.check_call([cmake, "--build", build_dir, "-j", str(os.cpu_count() or 2)])
    lib = os.path.join(build_dir, "libkda.so")
    if not os.path.exists(lib):
        raise RuntimeError(f"kda: the CMake build did not produce {lib}")
    return lib


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
    pass

setup(cmdclass=cmdclass, distclass=BinaryDistribution)
