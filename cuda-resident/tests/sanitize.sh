#!/usr/bin/env bash
# compute-sanitizer over the GPU tests: memcheck (with device leak checking) over every GPU
# test binary, racecheck and synccheck over the tests that run the copy kernel hardest.
#
# Usage: cuda-resident/tests/sanitize.sh DEPS_DIR
#   DEPS_DIR holds the test binaries: target/release/deps after
#   `cargo test --release --workspace --no-run`, or the same folder of an extracted nextest
#   archive. Needs an NVIDIA GPU and compute-sanitizer (CUDA toolkit).
# Prints each tool's ERROR SUMMARY; exits non-zero if any run reports an error.
set -uo pipefail
deps=${1:?usage: cuda-resident/tests/sanitize.sh DEPS_DIR}
cs=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
bin() { find "$deps" -maxdepth 1 -type f -executable -name "$1-*" | head -n 1; }
status=0
# The tests compare the device's free memory before and after; the sanitizer's own device
# allocations move it, so under it they only report the difference (tests/common/mod.rs).
export CUDA_RESIDENT_SANITIZER=1
run() {
  local tool=$1 test=$2
  shift 2
  local exe
  exe=$(bin "$test")
  if [ -z "$exe" ]; then echo "sanitize: no test binary $test in $deps" >&2; status=1; return; fi
  local log
  log=$(mktemp)
  "$cs" --tool "$tool" --error-exitcode 86 "$@" "$exe" --include-ignored --test-threads 1 >"$log" 2>&1
  local rc=$?
  local summary
  summary=$(grep -E "ERROR SUMMARY|LEAK SUMMARY|RACECHECK SUMMARY" "$log" | tail -n 1)
  local tests
  tests=$(grep -E "^test result" "$log" | tail -n 1)
  echo "$tool $test: rc=$rc | ${summary:-no summary} | ${tests:-no test result}"
  if [ "$rc" -ne 0 ]; then status=1; tail -n 40 "$log"; fi
  rm -f "$log"
}
for t in gpu_core gpu_transfer gpu_drop gpu_peer; do
  run memcheck "$t" --leak-check full
done
# The fault matrix under memcheck: a few call numbers per entry point keep it short.
FAULT_CALLS_PER_ENTRY=${FAULT_CALLS_PER_ENTRY:-3} run memcheck gpu_faults --leak-check full
for tool in racecheck synccheck; do
  run "$tool" gpu_transfer
done
# The peer kernel path (a kernel reading another GPU's memory); needs two GPUs.
run racecheck gpu_peer
exit $status
