"""The env report's apex section: is the apex ``import apex`` finds NVIDIA's, does it still have ``apex.amp``, and do
its compiled extensions load next to this torch.

The extensions are loaded in a child process: one built for another torch can crash the interpreter that imports it
(the segmentation fault users meet in ``scaled_loss.backward()``).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from lightning_ddp_amp.amp.apex_loader import APEX_INSTALL, NATIVE_ALTERNATIVES, installation

#: apex's compiled extensions: what each one is for, as the report says it.
APEX_EXTENSIONS = {
    "amp_C": "fused multi-tensor kernels of apex.amp and apex.optimizers",
    "apex_C": "flatten/unflatten of apex.parallel.DistributedDataParallel",
    "syncbn": "apex.parallel.SyncBatchNorm",
    "fused_layer_norm_cuda": "apex.normalization.FusedLayerNorm",
}
_APEX_TIMEOUT_S = 120


def apex_section(problems: list[dict[str, str]]) -> dict[str, Any]:
    """What apex this process would import, and each reason it could not train with it."""
    found = installation()
    if found is None:
        return {
            "installed": False,
            "note": 'precision="apex-O*" is unavailable; "amp-O*" runs the same O-levels on native torch AMP',
        }
    root = Path(found["location"])
    section: dict[str, Any] = {"installed": True, "location": found["location"], "version": found["version"]}
    if found["namespace"]:
        # A directory named apex without __init__.py, found on the path: typically the folder holding a clone of
        # NVIDIA/apex, when the command runs next to it.
        section["nvidia"] = False
        problems.append(
            {
                "problem": f"'apex' resolves to the directory {root}, which is not an installed package (a source"
                " checkout on the path?) and shadows any installed apex",
                "fix": "run from another directory, or install NVIDIA apex: " + APEX_INSTALL,
            }
        )
        return section
    if found["test_double"]:
        section["test_double"] = True
    if not any((root / sub).is_dir() for sub in ("amp", "parallel", "optimizers", "normalization")):
        section["nvidia"] = False
        problems.append(
            {
                "problem": f"the 'apex' installed at {root} is not NVIDIA apex (the apex on PyPI is a web toolkit)",
                "fix": "pip uninstall apex, then " + APEX_INSTALL,
            }
        )
        return section
    section["nvidia"] = True
    section["amp"] = (root / "amp").is_dir()
    if not section["amp"]:
        problems.append(
            {
                "problem": "this NVIDIA apex has no apex.amp: it was removed after release 25.05",
                "fix": APEX_INSTALL,
            }
        )
    section["extensions"] = extensions = {name: _load_extension(name) for name in APEX_EXTENSIONS}
    for name, state in extensions.items():
        if state["state"] in ("fails", "crashes"):
            problems.append(
                {
                    "problem": f"apex's {name} ({APEX_EXTENSIONS[name]}) {state['state']} on import with torch"
                    f" {torch.__version__}: {state['detail']}; apex was built for another torch or CUDA, the"
                    " usual cause of segmentation faults in scaled_loss.backward()",
                    "fix": "pip uninstall apex, then rebuild it against this torch: " + APEX_INSTALL,
                }
            )
    if section["amp"] and extensions["amp_C"]["state"] == "missing" and not section.get("test_double"):
        problems.append(
            {
                "problem": "apex was built without its CUDA extensions (amp_C is missing): apex.amp falls back to"
                " slow Python loops and apex's fused optimizers do not exist",
                "fix": APEX_INSTALL,
            }
        )
    if section["amp"] and not torch.cuda.is_available():
        section["note"] = "apex amp needs CUDA; on this machine " + NATIVE_ALTERNATIVES
    return section


def _load_extension(name: str) -> dict[str, str]:
    """Whether apex's compiled module ``name`` loads next to this torch, tried in a child process."""
    if importlib.util.find_spec(name) is None:
        return {"state": "missing", "detail": "not built"}
    # The child searches exactly this interpreter's path, so it loads what an import here would load.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, sys.path))}
    try:
        child = subprocess.run(
            [sys.executable, "-c", f"import torch, {name}"],
            env=env,
            capture_output=True,
            text=True,
            timeout=_APEX_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return {"state": "fails", "detail": f"the import did not finish within {_APEX_TIMEOUT_S} s"}
    if child.returncode == 0:
        return {"state": "loads", "detail": "built for this torch"}
    if child.returncode < 0:
        return {"state": "crashes", "detail": f"the importing process died of signal {-child.returncode}"}
    last_line = (child.stderr.strip().splitlines() or ["no message"])[-1]
    return {"state": "fails", "detail": last_line}
