#!/usr/bin/env bash
# Proves the CUDA extension (csrc/cuda) builds and registers, on a machine without a GPU (docs/platform.md,
# "CUDA extension without a GPU"):
#   1. a venv with torch==2.14.1 (its CUDA 13.0 build matches nvcc 13.0), cached outside the clone
#      (TORCHQKIT_CUDA_VENV, default ~/.cache/torchqkit-cuda-venv; reused when it already has that torch);
#   2. setup.py's CUDAExtension built against it (TORCHQKIT_BUILD_CPU=0, TORCHQKIT_CUDA_REQUIRED=1, gencode
#      sm80 / sm89 / sm90a), build tree cached next to the venv so a warm run only relinks what changed;
#   3. the binary must hold code for each architecture, with tensor-core (HMMA) instructions; the library
#      is loaded and every op csrc/cuda/registration.cpp registers must be a torchqkit op with a CUDA kernel.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
VENV=${TORCHQKIT_CUDA_VENV:-$HOME/.cache/torchqkit-cuda-venv}
BUILD=${VENV}-build
TORCH_VERSION=2.14.1
start=$(date +%s)

if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
  echo "build_cuda: creating $VENV with torch==$TORCH_VERSION"
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q "torch==$TORCH_VERSION" setuptools wheel ninja numpy safetensors
fi
"$VENV/bin/python" -c "import safetensors, numpy, ninja" 2>/dev/null || "$VENV/bin/pip" install -q setuptools wheel ninja numpy safetensors

# CUDA_HOME: the folder above the bin/ that holds the real nvcc (/usr/local/bin/nvcc may be a wrapper).
if [ -z "${CUDA_HOME:-}" ]; then
  for cand in "$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")" /usr/local/cuda; do
    if [ -x "$cand/bin/nvcc" ] && [ -f "$cand/include/cuda_runtime_api.h" ]; then CUDA_HOME=$cand; break; fi
  done
fi
[ -n "${CUDA_HOME:-}" ] || { echo "build_cuda: no CUDA toolkit found (set CUDA_HOME)"; exit 1; }
export CUDA_HOME PATH="$CUDA_HOME/bin:$PATH"
# cusparse.h / cublas headers of torch's CUDA build live in the nvidia-* wheels.
NV=$("$VENV/bin/python" -c "import os, nvidia; print(os.path.join(list(nvidia.__path__)[0], 'cu13'))")
export CPATH="$NV/include${CPATH:+:$CPATH}" LIBRARY_PATH="$NV/lib${LIBRARY_PATH:+:$LIBRARY_PATH}"
export LD_LIBRARY_PATH="$NV/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
echo "build_cuda: CUDA_HOME=$CUDA_HOME ($(nvcc --version | tail -1)); venv ready after $(( $(date +%s) - start )) s"

TORCHQKIT_BUILD_CPU=0 TORCHQKIT_CUDA_REQUIRED=1 MAX_JOBS=${MAX_JOBS:-2} \
  "$VENV/bin/python" setup.py -q build_ext --build-temp "$BUILD/temp" --build-lib "$BUILD/lib" 2>&1 \
  | grep -v -e "^WARNING: Location" || true
SO=$(ls "$BUILD"/lib/torchqkit/_C_cuda*.so 2>/dev/null | head -1)
[ -n "$SO" ] || { echo "build_cuda: FAILED, no torchqkit/_C_cuda*.so under $BUILD/lib"; exit 1; }
echo "build_cuda: built $SO after $(( $(date +%s) - start )) s"

# Code for every architecture, and tensor-core instructions (HMMA, from mma.sync) in each. The toolkit here
# has no cuobjdump; triton (a dependency of torch's CUDA build) ships one.
CUOBJDUMP=$(command -v cuobjdump || "$VENV/bin/python" -c "import os, triton; print(os.path.join(os.path.dirname(triton.__file__), 'backends/nvidia/bin/cuobjdump'))")
ELVES=$("$CUOBJDUMP" --list-elf "$SO")  # captured first: `| grep -q` would SIGPIPE it under pipefail
for arch in sm_80 sm_89 sm_90a; do
  grep -q "\.$arch\.cubin" <<<"$ELVES" || { echo "build_cuda: FAILED, no $arch code in $SO"; exit 1; }
  HMMA=$("$CUOBJDUMP" -sass -arch "$arch" "$SO" | grep -c HMMA || true)
  [ "$HMMA" -gt 0 ] || { echo "build_cuda: FAILED, no HMMA (mma.sync) for $arch"; exit 1; }
done
echo "build_cuda: $SO holds sm_80 / sm_89 / sm_90a code, each with HMMA (tensor-core) instructions"

TORCHQKIT_DISABLE_CPU_EXTENSION=1 PYTHONPATH="$REPO" "$VENV/bin/python" - "$SO" "$REPO/csrc/cuda/registration.cpp" <<'PY'
import re
import sys
import torch
from torchqkit import kernels  # defines the torchqkit:: schemas the library registers CUDA kernels for
torch.ops.load_library(sys.argv[1])
# The ops csrc/cuda registers, read from its TORCH_LIBRARY_IMPL block (no list kept by hand).
declared = [f"torchqkit::{name}" for name in re.findall(r'm\.impl\("(\w+)"', open(sys.argv[2]).read())]
unknown = [op for op in declared if op not in kernels.registry.OPS]
missing = [op for op in declared if not torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA")]
if not declared or unknown or missing:
    sys.exit(f"build_cuda: FAILED, csrc/cuda registers {declared}; not torchqkit ops: {unknown}; "
             f"no CUDA kernel after loading: {missing}")
print(f"build_cuda: torch {torch.__version__}: CUDA kernels registered for {', '.join(declared)}")
PY
echo "build_cuda: OK in $(( $(date +%s) - start )) s"
