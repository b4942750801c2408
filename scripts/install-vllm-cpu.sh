#!/usr/bin/env bash
# Installs vLLM 0.33.0 for the CPU next to hybridkv, for `hybridkv vllm-check`, the vLLM
# integration tests and vLLM's own scheduler tests (tests/vllm_plugin.py).
#
# vLLM itself comes without its dependencies, then its requirements except the GPU stack
# (torch, torchaudio, torchvision, torchcodec, xformers, flashinfer, nvidia-*): hybridkv's dev
# extras already pin a CPU torch. Run it inside the environment hybridkv is installed in.
set -euo pipefail
PYTHON="${PYTHON:-python}"
"$PYTHON" -m pip install --no-deps "vllm==0.33.0"
"$PYTHON" - <<'PY' > /tmp/hybridkv-vllm-requirements.txt
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
"$PYTHON" -m pip install -r /tmp/hybridkv-vllm-requirements.txt
# The scheduler runs on the CPU: no CUDA device to infer.
echo "vLLM 0.33.0 installed; run with VLLM_TARGET_DEVICE=cpu"
