#!/usr/bin/env bash
# The prepared GPU check: one run on a machine with one Hopper GPU (H200), about 9 minutes.
#
#   bash scripts/sonicmoe_env.sh fetch     # first, where PyPI is reachable (optional: without it sonicmoe is skipped)
#   bash scripts/gpu_check.sh              # then on the GPU machine, from the repository root
#   bash scripts/gpu_check.sh --rehearse   # here, on CPU: every stage, tiny shapes (make gpu-rehearsal)
#
# With the device tool: carry `.whl`, run `bash scripts/gpu_check.sh` with timeout_s=600; the files
# under $OUT come back (at most 8): gpu_check.log, preflight.txt, junit.xml, results/gpu/results.json,
# results/gpu_kernels/results.json. Copy $OUT/results/* into this repository's results/ and run
# `python -m benchmarks.readme`: the gpu and gpu_kernels sections of docs/results-gpu.md are generated from them.
#
# Stages, in order of value, each under its own time limit (GPU_CHECK_<STAGE>_S) so that one slow
# stage cannot starve the rest; a stage that fails or times out is logged and the next one runs, and
# the script exits 1 if any stage failed:
#   env        sonar-fx importable from this checkout without network (a symlink maps sonar_fx.passes
#              to passes/, as the package-dir does when installed); sonic-moe from .whl/ when present
#   preflight  versions, the GPU, the torch APIs the pass relies on, whether sonic-moe imports
#   gpu        full-size OLMoE-1B-7B shapes (16 layers, bf16, batch 2, seq 256): standard,
#              standard_no_expert_clip, sonar eager hooks, sonar compiled pass (inductor); memory and time
#   kernels    every expert kernel backend against the fp32 reference (bf16 and fp32, tiny/OLMoE/Granite
#              layer shapes; fp32 skipped with the reason where a backend has none), and exactness and
#              memory of Sonar vs its twin per backend with eager hooks (2-layer OLMoE shapes); stopped
#              at its limit (SIGTERM), it still writes what it measured
#   tests      the gpu-marked tests (tests/test_kernels_gpu.py, tests/test_gpu_runtime.py): the kernels
#              against the reference (fp32 tolerance per path), Sonar bitwise equal to its twin per
#              backend, eager and inductor (tiny OLMoE), and an LR schedule under CUDA graphs
# --rehearse runs the same stages and scripts with the device taken from the argument (cpu), tiny
# shapes, Triton interpreted, no install and a generous time limit per stage, so that no first run on a
# GPU fails on a Python error (tests/test_gpu_check.py runs it in `make test`; docs/gpu-check.md lists
# what only a GPU can verify).
# Nothing here downloads anything. Run on the image's own python3, torch, triton and transformers
# (the project's pins do not apply there).
set -uo pipefail

case "${1:-}" in
  "") REHEARSE=0 ;;
  --rehearse) REHEARSE=1 ;;
  *) echo "usage: bash scripts/gpu_check.sh [--rehearse]" >&2; exit 2 ;;
esac
OUT=${OUT:-/tmp/sonar_gpu_check}
PY=${PYTHON:-python3}
mkdir -p "$OUT/results"
LOG="$OUT/gpu_check.log"
: >"$LOG"
export PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8 TOKENIZERS_PARALLELISM=false
unset TRITON_INTERPRET
SIZE=()  # the GPU, full size
GPU_COMPILER=()  # the gpu stage's compiled arm: inductor
TESTS_DEVICE=()
if ((REHEARSE)); then
  SIZE=(--device cpu --tiny)
  # Inductor, as on the GPU, unless REHEARSE_COMPILER=aot_eager (the suite's rehearsal: the same script,
  # arms and pass without C++ codegen; with a cold inductor cache that one compile was most of the
  # stage's time; tests/test_compiled_inductor.py covers the pass under inductor). The tests stage
  # inherits it: test_kernels_gpu.py's inductor cases compile with it on CPU (`rehearsed`).
  GPU_COMPILER=(--compiler "${REHEARSE_COMPILER:-inductor}")
  TESTS_DEVICE=(--gpu-device cpu)
  export TRITON_INTERPRET=1 OMP_NUM_THREADS=1  # Triton kernels run interpreted on CPU; one thread each
fi
FAILED=0

stage() {  # stage NAME SECONDS COMMAND...: run with a time limit, log output and status, never abort
  local name=$1 limit=$2 start rc
  shift 2
  ((REHEARSE)) && limit=${REHEARSE_LIMIT_S:-1200}  # CPU, shared: time is not what a rehearsal checks
  start=$(date +%s)
  echo "=== [$name] $* (limit ${limit}s)" | tee -a "$LOG"
  timeout --kill-after=10 "$limit" "$@" >>"$LOG" 2>&1
  rc=$?
  ((rc == 0)) || FAILED=$((FAILED + 1))
  echo "=== [$name] rc=$rc in $(($(date +%s) - start))s$([[ $rc == 124 ]] && echo ' (TIMED OUT)')" | tee -a "$LOG"
}

# env: no network on the GPU machine, so no pip install of this package: where it is not installed,
# map the package-dir (passes/ ships as sonar_fx.passes) with a symlink in this throwaway copy.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import sonar_fx.passes" 2>/dev/null || ln -sfn ../passes sonar_fx/passes
if ((REHEARSE)); then
  echo "rehearsal: nothing installed; scripts/sonicmoe_env.sh parses: $(bash -n scripts/sonicmoe_env.sh && echo yes)" | tee -a "$LOG"
elif compgen -G ".whl/*.whl" >/dev/null; then
  # shellcheck source=scripts/sonicmoe_env.sh
  source scripts/sonicmoe_env.sh install >>"$LOG" 2>&1 || echo "sonic-moe install failed (see log)" | tee -a "$LOG"
else
  echo "no .whl/: sonic-moe not installed (run scripts/sonicmoe_env.sh fetch first); sonicmoe is skipped" | tee -a "$LOG"
fi

stage preflight "${GPU_CHECK_PREFLIGHT_S:-60}" \
  bash -c "set -o pipefail; '$PY' scripts/gpu_preflight.py 2>&1 | tee '$OUT/preflight.txt'"
stage gpu "${GPU_CHECK_GPU_S:-240}" "$PY" -m scripts.gpu.olmoe --quick "${SIZE[@]}" "${GPU_COMPILER[@]}" \
  --out "$OUT/results"
stage kernels "${GPU_CHECK_KERNELS_S:-130}" "$PY" -m scripts.gpu.kernels --quick --compilers eager \
  "${SIZE[@]}" --out "$OUT/results"
stage tests "${GPU_CHECK_TESTS_S:-100}" "$PY" -m pytest -q -rs --durations=10 -p no:cacheprovider \
  --junitxml="$OUT/junit.xml" "${TESTS_DEVICE[@]}" tests/test_kernels_gpu.py tests/test_gpu_runtime.py

echo "=== done, $FAILED stage(s) failed; files under $OUT:" | tee -a "$LOG"
find "$OUT" -type f | tee -a "$LOG"
exit $((FAILED > 0))
