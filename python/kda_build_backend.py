"""The PEP 517 build backend of the kda package: setuptools' own, plus CMake as a build requirement when the
machine has no usable one (>= 3.22): `pip install ./python` then fetches CMake from PyPI into its isolated build
environment. With a system CMake nothing more is fetched. setup.py builds libkda with it and bundles libkda.so.

With --no-build-isolation the build requirements must be installed beforehand:
    pip install "setuptools>=70.1"          (and "cmake>=3.22" if the system has no CMake)
"""

import re
import shutil
import subprocess

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F401,F403  (build_wheel, build_sdist, prepare_metadata_..., ...)

CMAKE_MIN = (3, 22)


def _cmake_usable() -> bool:
    cmake = shutil.which("cmake")
    if cmake is None:
        return False
    try:
        out = subprocess.run([cmake, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    m = re.search(r"(\d+)\.(\d+)", out)
    return bool(m) and (int(m.group(1)), int(m.group(2))) >= CMAKE_MIN


def _native_requirements() -> list:
    need = [] if _cmake_usable() else ["cmake>=%d.%d" % CMAKE_MIN]
    if need and not shutil.which("ninja") and not shutil.which("make"):
        need.append("ninja")  # CMake from PyPI brings no build tool
    return need


def get_requires_for_build_wheel(config_settings=None):
    return _setuptools.get_requires_for_build_wheel(config_settings) + _native_requirements()


def get_requires_for_build_editable(config_settings=None):
    return _setuptools.get_requires_for_build_editable(config_settings) + _native_requirements()
