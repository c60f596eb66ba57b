#!/usr/bin/env bash
# The GPU half of the checks, sized for the GPU machine a session is sometimes lent (one GPU, no network, nothing
# pip-installed, about 15 minutes in all): at most GPU_CHECK_SECONDS (420) seconds, in parts that each have their
# own timeout and write their results as they finish, so a run stopped from outside keeps the finished parts.
#
#   bash scripts/gpu_check.sh        # in the repository root; PYTHON=... to choose the interpreter
#
# The package runs from src/ (PYTHONPATH), not installed. Real NVIDIA apex 25.05 runs from a source copy in the
# git-ignored .apex-src/ (.apex-src/apex/__init__.py ...): without its compiled extensions apex.amp uses its
# Python fallbacks. Nothing here downloads or builds it; without .apex-src the apex parts are skipped and say so.
#
# Parts (results in $OUT/gpu_check/ when $OUT is set, else gpu_check_results/), with the time each should take on
# an H200 (most of it is starting processes: torch, Lightning and CUDA load in each, ~8 s per training run):
#   env        5 s  torch, CUDA, the GPUs and apex as this machine has them; without CUDA the rest is skipped
#   apex     150 s  envddp with apex O1 (overflow at step 3), O2, O3 against the hand-written apex recipe, RNNs fed
#                   fp16 under O1 (workers/rnn_pairs.py) against the recipe with torch's RNN check lifted, one rank,
#                   and examples/fabric/train.py under Fabric apex-O1 and O2 against examples/classic/train.py,
#                   and apex's DCGAN example (tests/workers/gan_pairs.py) by hand against Fabric, O1 and O2
#   native    35 s  AmpPrecision native fp16 (overflow at step 3) and bf16 against the hand-written native recipe
#   overflow  30 s  compare's overflow locator on CUDA fp16: tests/workers/compare_train.py's net.2 leaves fp16's
#                   range at step 5; native-O1 (and apex-O1 with apex) must skip it and name net.2, float16
#   benchmark 50 s  step time of fp32, native fp16/bf16 and apex O1/O2/O3 on a small conv net (60 s budget)
#   rest      25 s  the other CUDA tests of tests/test_cuda.py (device pinning, `lightning-ddp-amp env`); two-GPU tests skip
#   compare   45 s  `lightning-ddp-amp compare apex-O1 native-O1 amp-O1 bf16-mixed` on examples/two_models_one_optimizer.py
#                   (100 steps, one GPU; without apex: 32-true native-O1 bf16-mixed); the report in compare/
# Both runs of every compared pair use deterministic algorithms (CUBLAS_WORKSPACE_CONFIG below; the workers turn
# on torch.use_deterministic_algorithms). The tolerance and why it holds: TOLERANCE in tests/test_cuda.py.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON=${PYTHON:-$(command -v python3 || command -v python)}
TOTAL=${GPU_CHECK_SECONDS:-420}
RESULTS=${OUT:+$OUT/gpu_check}
RESULTS=${RESULTS:-$ROOT/gpu_check_results}
mkdir -p "$RESULTS"
: >"$RESULTS/summary.txt"

export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
if [[ -f .apex-src/apex/__init__.py ]]; then
    PYTHONPATH="$ROOT/.apex-src:$PYTHONPATH"
    APEX="apex from .apex-src/apex"
else
    APEX=""
fi
export CUBLAS_WORKSPACE_CONFIG=:4096:8
export PYTHONUNBUFFERED=1
PYTEST=("$PYTHON" -m pytest tests/test_cuda.py -v -rA -p no:cacheprovider)
failures=0

note() {  # note PART STATUS: one line in the summary, and on the console
    echo "$1: $2" | tee -a "$RESULTS/summary.txt"
}

part() {  # part NAME SECONDS COMMAND...: run COMMAND for at most SECONDS (less when the total budget is short)
    local name=$1 seconds=$2 start=$SECONDS rc=0
    shift 2
    local left=$((TOTAL - SECONDS))
    ((seconds > left)) && seconds=$left
    if ((seconds < 15)); then
        note "$name" "not run: the ${TOTAL}s budget is spent"
        failures=$((failures + 1))
        return
    fi
    echo "== $name (at most ${seconds}s): $*"
    timeout --kill-after=10 "$seconds" "$@" 2>&1 | tee "$RESULTS/$name.log"
    rc=${PIPESTATUS[0]}
    case $rc in
        0) note "$name" "passed in $((SECONDS - start))s" ;;
        124 | 137) note "$name" "TIMED OUT after ${seconds}s (finished results kept in $RESULTS)" ;;
        *) note "$name" "FAILED (exit code $rc) in $((SECONDS - start))s" ;;
    esac
    ((rc == 0)) || failures=$((failures + 1))
}

part env 60 "$PYTHON" - "$APEX" <<'PY'
import shutil
import subprocess
import sys

import torch

print(f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}")
gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
print(f"cuda devices: {gpus}")
for index in range(gpus):
    print(f"  cuda:{index} {torch.cuda.get_device_name(index)}")
if gpus and shutil.which("nvidia-smi"):
    subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"])
if not sys.argv[1]:
    print("apex: NO .apex-src/apex here, so the real-apex parts are skipped (copy apex 25.05's apex/ package there)")
else:
    import apex.amp
    from apex.multi_tensor_apply import multi_tensor_applier

    kind = "with its CUDA extensions" if multi_tensor_applier.available else "Python fallbacks, no CUDA extensions"
    print(f"apex: {apex.__file__} ({kind})")
PY

if ! grep -Eq '^cuda devices: [1-9]' "$RESULTS/env.log" 2>/dev/null; then
    note gpu "no CUDA: torch sees no GPU here, so the GPU parts are skipped"
    exit "$failures"
fi

if [[ -n $APEX ]]; then
    part apex 240 "${PYTEST[@]}" -m apex --junitxml="$RESULTS/apex.xml"
else
    note apex "skipped: no .apex-src/apex (real NVIDIA apex 25.05 is not carried to this machine)"
fi
part native 70 "${PYTEST[@]}" -k native_amp_matches --junitxml="$RESULTS/native.xml"
OVERFLOWING=(native-O1)
[[ -n $APEX ]] && OVERFLOWING+=(apex-O1)
part overflow 50 bash -c '"$0" -m lightning_ddp_amp compare 32-true "${@:2}" --steps 12 --out "$1" \
    -- "$0" tests/workers/compare_train.py --accelerator cuda --gain 1e5 --gain-at 5 --val-every 4
rc=$?; [[ $rc == 0 || $rc == 1 ]] || exit "$rc"  # 1: a candidate apart, as an fp16 skip may make it
"$0" - "$1/compare.json" <<"PY"
import json, sys
report = json.load(open(sys.argv[1]))
for entry in report["candidates"][1:]:
    found = [(o["step"], o["module"], o["phase"], o["dtype"]) for o in entry["overflows"]]
    print(entry["name"], entry["status"], found, entry["summary"]["scale_trend"])
    assert found == [(5, "net.2", "forward", "torch.float16")], found
    assert entry["summary"]["scale_trend"]["recovered"]
print("overflow located on CUDA:", [e["name"] for e in report["candidates"][1:]])
PY' "$PYTHON" "$RESULTS/overflow" "${OVERFLOWING[@]}"
part benchmark 80 "$PYTHON" benchmarks/gpu.py --budget 60 --results "$RESULTS"
part rest 60 "${PYTEST[@]}" -m "cuda and not apex" -k "not native_amp_matches" --junitxml="$RESULTS/rest.xml"
if [[ -n $APEX ]]; then
    CANDIDATES=(apex-O1 native-O1 amp-O1 bf16-mixed)  # amp-O1 runs apex here: the report says it matches apex-O1
else
    CANDIDATES=(32-true native-O1 bf16-mixed)
fi
part compare 70 "$PYTHON" -m lightning_ddp_amp compare "${CANDIDATES[@]}" --steps 100 --out "$RESULTS/compare" \
    -- "$PYTHON" examples/two_models_one_optimizer.py --accelerator cuda --epochs 4

echo "results: $RESULTS ($SECONDS s in all)"
exit "$((failures > 0))"
