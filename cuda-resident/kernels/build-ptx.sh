#!/usr/bin/env bash
# Regenerates kernels/copy.ptx from kernels/copy.cu. Needs nvcc (CUDA 12 or newer).
# The PTX targets compute_75, so the driver can JIT it for any GPU from Turing on (CUDA 13 supports nothing older); the
# resource report for sm_90 (the H200) is printed for review.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-$here/copy.ptx}
nvcc --version | tail -1
nvcc -ptx -arch=compute_75 -O3 -o "$out" "$here/copy.cu"
nvcc -cubin -arch=sm_90 -O3 -Xptxas -v -o /dev/null "$here/copy.cu"
echo "wrote $out"
