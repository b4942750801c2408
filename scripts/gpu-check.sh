#!/usr/bin/env bash
# One-command GPU check of the optimized backend (issue 13, item 5), a few minutes on one GPU:
#   1. tests/test_optimized_cuda.py, which must run, not skip;
#   2. scripts/gpu_check.py --device cuda: every golden trace replayed on
#      TorchKVCacheManager(..., device="cuda") with invariants, the block tables resident on the
#      device, and at most one host→device copy per decode step (torch.profiler);
#   3. python -m hybridkv.bench --device cuda (and --device cpu beside it, for comparison).
# Logs go to $OUT when it is set (else to ./gpu-check-out). Every stage runs; the exit status is
# non-zero if any failed. Python: $PYTHON, else python3. Missing pure-Python dependencies are
# installed from wheels in .whl/ (if present) into a private folder; torch is never installed.
# Dry run without a GPU: GPU_CHECK_DEVICE=cpu bash scripts/gpu-check.sh (CUDA tests may skip,
# the helper runs on CPU, the benchmark is --quick).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
LOGS=${OUT:-gpu-check-out}
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
mkdir -p "$LOGS"

main() {
    local failed=()
    # COMMIT: written beside a copy of the tree that travels without its .git
    local commit
    commit=$(cat COMMIT 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo '?')
    echo "== gpu-check: $(date -u +%FT%TZ), commit $commit"
    nvidia-smi -L || echo "nvidia-smi: not available"
    "$PY" -c 'import sys, torch
print("python", sys.version.split()[0], "| torch", torch.__version__, "| CUDA", torch.version.cuda,
      "| available", torch.cuda.is_available())
if sys.argv[1] != "cpu":
    if not torch.cuda.is_available():
        sys.exit("gpu-check: CUDA is not available")
    print("device:", torch.cuda.get_device_name(0))' "$DEVICE"

    echo "== dependencies"
    local site=/tmp/hybridkv-gpu-check-site
    local missing
    missing=$("$PY" - <<'EOF'
import re
from importlib.metadata import PackageNotFoundError, version

least = {"cbor2": (5, 4), "click": (8, 1), "rich": (13, 7), "pytest": (8, 0),
         "hypothesis": (6, 100), "pluggy": (1, 5), "iniconfig": (0, 0)}
for name, minimum in least.items():
    try:
        have = tuple(int(x) for x in re.findall(r"\d+", version(name))[:2])
    except PackageNotFoundError:
        have = ()
    if have < minimum:
        print(name)
EOF
)
    if [ -n "$missing" ]; then
        echo "missing or too old: $(echo $missing)"
        local wheels=() name
        for name in $missing; do
            wheels+=($(ls .whl/"$name"-*.whl 2>/dev/null || echo))
        done
        if [ ${#wheels[@]} -gt 0 ]; then
            "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
                --target "$site" "${wheels[@]}"
        else
            echo "no wheels for them in .whl/"
        fi
    else
        echo "all present"
    fi
    mkdir -p "$site"
    # hybridkv itself (package-dir maps spec/, reference/, ... into it): built here, no index.
    if ! "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade \
        --target "$site/hkv" . 2>&1 | tail -3; then
        echo "building hybridkv failed; trying a carried wheel"
        "$PY" -m pip install -q --no-index --no-deps --target "$site/hkv" .whl/hybridkv/*.whl
    fi
    export PYTHONPATH="$site/hkv:$site${PYTHONPATH:+:$PYTHONPATH}"
    export PYTHONUNBUFFERED=1
    "$PY" -c 'import hybridkv, cbor2, click, rich, pytest, hypothesis
print("hybridkv from", hybridkv.__file__)'

    echo "== [1/3] pytest tests/test_optimized_cuda.py"
    local t0=$SECONDS
    if "$PY" -m pytest -q -rs -p no:cacheprovider --junitxml="$LOGS/pytest-cuda.xml" \
        tests/test_optimized_cuda.py; then
        "$PY" - "$LOGS/pytest-cuda.xml" "$DEVICE" <<'EOF' || failed+=("cuda tests skipped")
import sys
import xml.etree.ElementTree as ET
suite = ET.parse(sys.argv[1]).getroot()
suite = suite if suite.tag == "testsuite" else suite[0]
print({k: suite.get(k) for k in ("tests", "failures", "errors", "skipped", "time")})
sys.exit(1 if int(suite.get("skipped", "0")) and sys.argv[2] != "cpu" else 0)
EOF
    else
        failed+=("cuda tests")
    fi
    echo "(took $((SECONDS - t0)) s)"

    echo "== [2/3] golden traces, residency and copies per step on $DEVICE"
    t0=$SECONDS
    "$PY" scripts/gpu_check.py --device "$DEVICE" || failed+=("gpu_check.py")
    echo "(took $((SECONDS - t0)) s)"

    echo "== [3/3] python -m hybridkv.bench --device $DEVICE"
    t0=$SECONDS
    local full=()
    [ "$DEVICE" = cpu ] && full=(--quick)
    if ! timeout 240 "$PY" -m hybridkv.bench --device "$DEVICE" "${full[@]}" \
        | tee "$LOGS/bench-$DEVICE.txt"; then
        echo "the full benchmark failed or ran past 240 s; the quick one instead"
        failed+=("bench (full)")
        timeout 60 "$PY" -m hybridkv.bench --device "$DEVICE" --quick \
            | tee "$LOGS/bench-$DEVICE.txt" || failed+=("bench (quick)")
    fi
    echo "(took $((SECONDS - t0)) s)"
    if [ "$DEVICE" != cpu ]; then
        echo "== for comparison: python -m hybridkv.bench --device cpu (same machine)"
        t0=$SECONDS
        timeout 120 "$PY" -m hybridkv.bench --device cpu | tee "$LOGS/bench-cpu.txt" \
            || echo "the CPU benchmark failed or ran past 120 s (not counted as a failure)"
        echo "(took $((SECONDS - t0)) s)"
    fi

    if [ ${#failed[@]} -gt 0 ]; then
        echo "== gpu-check: FAILED: ${failed[*]}"
        return 1
    fi
    echo "== gpu-check: all passed"
}

main "$@" 2>&1 | tee "$LOGS/gpu-check.log"
