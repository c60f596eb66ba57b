#!/usr/bin/env bash
# The GPU half of the test suite: real CUDA, NCCL, native AMP on the GPU and, where NVIDIA apex (≤ 25.05, with
# apex.amp) is installed, real apex. Run on a GPU machine, in an environment with a CUDA build of torch 2.13 and
# this package installed (pip install -e ".[dev]"). Tests needing two GPUs are skipped on one. About 3 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
python - <<'PY'
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s)")
try:
    import apex, apex.amp
    print("apex.amp:", "the CPU test double" if getattr(apex, "IS_TEST_DOUBLE", False) else apex.__file__)
except ImportError as error:
    print("apex.amp: not importable:", error)
PY
exec python -m pytest -m "cuda or apex" -v -rs tests/test_cuda.py "$@"
