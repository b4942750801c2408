#!/usr/bin/env bash
# Installs vLLM 0.33.0 for the CPU next to hybridkv, for `hybridkv vllm-check`, the vLLM
# integration tests and vLLM's own scheduler tests (python -m hybridkv.integrations.vllm.own_tests).
#
# vLLM itself comes without its dependencies, then its requirements except the GPU stack
# (torch, torchaudio, torchvision, torchcodec, xformers, flashinfer, nvidia-*): hybridkv's dev
# extras already pin a CPU torch. Run it inside the environment hybridkv is installed in.
#
# Nothing to do when vLLM 0.33.0 is already installed. With --optional (the README's test
# command) a failed install (no network, say) is reported and the script exits 0: the tests that
# need vLLM then skip, each saying why.
set -euo pipefail
PYTHON="${PYTHON:-python}"
OPTIONAL=0
[ "${1:-}" = "--optional" ] && OPTIONAL=1
if "$PYTHON" -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm') != '0.33.0')" 2>/dev/null; then
    echo "vLLM 0.33.0 already installed"
    exit 0
fi
install() {
    "$PYTHON" -m pip install -q --no-deps "vllm==0.33.0" || return 1
    "$PYTHON" - <<'PY' > /tmp/hybridkv-vllm-requirements.txt || return 1
import re
from importlib.metadata import requires

skip = re.compile(r"^(torch|torchaudio|torchvision|torchcodec|xformers|flashinfer\S*|nvidia-\S*)$")
for requirement in requires("vllm") or []:
    if "extra ==" in requirement:
        continue
    name = re.split(r"[\s<>=!~;\[(]", requirement, maxsplit=1)[0].lower()
    if not skip.match(name):
        print(requirement)
PY
    echo "Installing vLLM's requirements without its GPU stack: pip's resolver error" \
        "\"vllm 0.33.0 requires torch==2.14.0\" is expected and harmless (the CPU torch 2.13.0" \
        "of hybridkv's dev extras is kept on purpose)" >&2
    "$PYTHON" -m pip install -q -r /tmp/hybridkv-vllm-requirements.txt || return 1
}
if ! (install); then
    if [ "$OPTIONAL" = 1 ]; then
        echo "vLLM 0.33.0 could not be installed; the tests that need it will skip" >&2
        exit 0
    fi
    exit 1
fi
# The scheduler runs on the CPU: no CUDA device to infer.
echo "vLLM 0.33.0 installed; run with VLLM_TARGET_DEVICE=cpu"
