"""Development: run a bench script with a development build's process-wide tuning set first (kda_dev_set_tuning).

    KDA_LIBRARY=build-dev/libkda.so DEV_SKIP=16384 PYTHONPATH=python:bench python3 dev/with_tuning.py bench/bwd_stages.py ...

DEV_SKIP: the KDA_SKIP bits (src/cuda/kda_cuda.h); e.g. for the dstate recurrence kernel (bwd_dstate.cu) 4096 / 8192
leave out dSᵀ's / dΔᵀ's lo parts and 16384 gives back the narrow mma.sync tile. DEV_BV, DEV_REC_MMA, DEV_STAGES: the
forward recurrence's tiling. A shipped build has no such entry point.
"""
import ctypes
import os
import runpy
import sys

ctypes.CDLL(os.environ["KDA_LIBRARY"]).kda_dev_set_tuning(
    int(os.environ.get("DEV_SKIP", "0")), int(os.environ.get("DEV_BV", "0")),
    int(os.environ.get("DEV_REC_MMA", "0")), int(os.environ.get("DEV_STAGES", "0")))
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
