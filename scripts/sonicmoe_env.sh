#!/usr/bin/env bash
# sonic-moe next to the torch that sonar-fx runs on, for a Hopper (H100/H200) or Blackwell GPU.
#
#   bash scripts/sonicmoe_env.sh fetch      # where PyPI is reachable: the wheels, into .whl/
#   source scripts/sonicmoe_env.sh install  # on the GPU machine (no network needed): install, export PYTHONPATH
#   bash scripts/sonicmoe_env.sh check      # import sonic-moe's kernels and print what was found
#
# Why a script and not `pip install sonic-moe`: sonic-moe 0.1.2.post1 pins torch>=2.7.1,<=2.9.1,
# Python>=3.12 and nvidia-cutlass-dsl==4.4.2, while sonar-fx needs a newer torch; pip cannot resolve
# both. sonar-fx calls only sonic-moe's functional kernels (sonicmoe.functional), which import torch,
# triton, QuACK (quack-kernels), the CUTLASS Python DSL and cuda-bindings. So sonic-moe and the
# packages it needs that a CUDA torch image lacks are installed with --no-deps, next to the torch,
# triton, numpy and cuda-bindings already there. Whether sonic-moe's kernels work with that torch is
# what `check` and the GPU tests find out (see scripts/gpu_check.sh).
# The other route, sonar-fx on sonic-moe's torch (<= 2.9.1), is not taken: the compiled pass relies on
# inductor's `custom_partitioner_fn` / `CustomPartitionerFn` and on
# `torch._functorch.config.force_non_lazy_backward_lowering`, and is built and tested on torch 2.13
# only; whether 2.9.1 has them is unverified (scripts/gpu_preflight.py reports them on any torch).
#
# Target: CPython 3.12 on x86-64 Linux (the H200 image: Python 3.12, torch 2.11 + CUDA 13,
# triton 3.6, cuda-bindings 13). CUDA 13 needs the CUTLASS DSL's cu13 libraries (the [cu13] extra);
# set SONICMOE_CUDA=12 for a CUDA 12 torch. The DSL wheel (~75 MB) is repacked with LZMA (~55 MB,
# same files, same RECORD hashes) so that .whl/ travels in a 64 MiB working-tree copy.
if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then set -euo pipefail; fi  # sourced: leave the caller's options alone

WHEELS=${SONICMOE_WHEELS:-.whl}
SITE=${SONICMOE_SITE:-/tmp/sonicmoe_site}
CUDA_MAJOR=${SONICMOE_CUDA:-13}
PY=${PYTHON:-python3}

if [[ "$CUDA_MAJOR" == 13 ]]; then DSL_LIBS=nvidia-cutlass-dsl-libs-cu13; else DSL_LIBS=nvidia-cutlass-dsl-libs-base; fi
PINS=(
  sonic-moe==0.1.2.post1
  quack-kernels==0.4.1
  nvidia-cutlass-dsl==4.4.2
  "$DSL_LIBS==4.4.2"
  apache-tvm-ffi==0.1.15.post2
  torch-c-dlpack-ext==0.1.5
)

fetch() {
  mkdir -p "$WHEELS"
  local exclude
  exclude=$(git rev-parse --git-path info/exclude)  # keep the wheels out of commits (a worktree shares it)
  mkdir -p "$(dirname "$exclude")"
  grep -qxF "/$WHEELS/" "$exclude" 2>/dev/null || echo "/$WHEELS/" >>"$exclude"
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$WHEELS" "${PINS[@]}"
  for whl in "$WHEELS"/nvidia_cutlass_dsl_libs_*.whl; do
    "$PY" - "$whl" <<'EOF'
import os, sys, zipfile
path = sys.argv[1]
with zipfile.ZipFile(path) as src:
    if all(i.compress_type == zipfile.ZIP_LZMA for i in src.infolist() if i.file_size):
        sys.exit(0)
    tmp = path + ".lzma"
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_LZMA) as dst:
        for info in src.infolist():
            dst.writestr(info, src.read(info), compress_type=zipfile.ZIP_LZMA)
os.replace(tmp, path)
EOF
  done
  du -ch "$WHEELS"/*.whl | tail -1
}

install() {
  compgen -G "$WHEELS/*.whl" >/dev/null || { echo "no wheels in $WHEELS: run 'bash $0 fetch' where PyPI is reachable" >&2; return 1; }
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl
  # --target does not process .pth files; the CUTLASS DSL's puts nvidia_cutlass_dsl/python_packages on the path.
  local extra=$SITE
  for pth in "$SITE"/*.pth; do
    [[ -e "$pth" ]] || continue
    while read -r line || [[ -n "$line" ]]; do [[ -n "$line" && "$line" != import* ]] && extra+=":$SITE/$line"; done <"$pth"
  done
  export PYTHONPATH="$extra${PYTHONPATH:+:$PYTHONPATH}"
  echo "PYTHONPATH=$PYTHONPATH"
}

check() {
  "$PY" - <<'EOF'
import importlib.metadata as md
import torch
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), GPU:",
      torch.cuda.get_device_name() if torch.cuda.is_available() else None,
      torch.cuda.get_device_capability() if torch.cuda.is_available() else "")
for dist in ("sonic-moe", "quack-kernels", "nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-cu13",
             "nvidia-cutlass-dsl-libs-base", "apache-tvm-ffi", "triton", "cuda-bindings", "transformers"):
    try:
        print(f"{dist} {md.version(dist)}")
    except md.PackageNotFoundError:
        print(f"{dist} -")
import sonicmoe.functional  # noqa: F401  (imports QuACK, the CUTLASS DSL and cuda-bindings)
print("sonicmoe.functional imports")
EOF
}

case "${1:-}" in
  fetch) fetch ;;
  install) install ;;
  check) check ;;
  *) echo "usage: scripts/sonicmoe_env.sh fetch | install | check   (source it for install)" >&2; return 2 2>/dev/null || exit 2 ;;
esac
