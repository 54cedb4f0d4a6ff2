# Two commands set everything up on a fresh machine: `make demo` and `make test`.
# Both bootstrap .venv; torch is pinned to 2.13.0 (the CPU wheel on local disk) before anything else
# can ask pip for an unpinned, multi-GB CUDA build.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.sonar-fx-installed

.PHONY: demo test test-fast test-latest pins test-gpu-versions lint docs bench bench-quick bench-gpu gpu-rehearsal clean

# Every install takes its versions from constraints.txt (the set `make test` last passed with), so a
# library released yesterday cannot turn a fresh clone red; `make test-latest` is how a pin moves.
$(STAMP): pyproject.toml constraints.txt requirements-torchtitan.txt Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0 -c constraints.txt
	$(PY) -m pip install -q -e ".[dev]" -c constraints.txt
	$(PY) -m pip install -q --no-deps -r requirements-torchtitan.txt
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m sonar_fx demo

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy sonar_fx passes benchmarks scripts/gpu

# The reference site (docs/, mkdocs.yml): --strict, so a broken link or a missing page fails.
docs: $(STAMP)
	$(PY) -m mkdocs build --strict --quiet

# The suite on every core (pytest-xdist; tests/conftest.py gives each worker one torch thread, keeps
# a module's shared compiled fixtures on one worker and starts the longest modules first).
# `make test` runs every tier; `make test-fast`, the inner loop, leaves out the four markers
# (pyproject.toml): inductor compiles and >10 s tests, multi-process, child-process and GPU tests.
# One worker per CPU this process may run on (its affinity: a container's cpuset counts, not the host's
# CPUs). Not xdist's `auto`: it counts physical cores (psutil), which is 1 on a 2-vCPU host whose vCPUs
# are the two hyper-threads of one core (common on Intel), and would run the suite on one worker.
PYTEST_WORKERS ?= $(shell $(PYTHON) -c "import os; print(len(os.sched_getaffinity(0)))" 2>/dev/null || echo logical)
PYTEST := $(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadgroup --no-loadscope-reorder
FAST := not slow and not multiprocess and not subprocess and not gpu

# pytest exits 5 when it collects no test: report it plainly rather than fail the build on it.
# --durations: the slowest tests in every log, so a slower suite (a cold inductor cache) shows where.
test: lint docs
	@rc=0; $(PYTEST) --durations=25 $(PYTEST_ARGS) || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests (exit 5)"; rc=0; fi; exit $$rc

test-fast: $(STAMP)
	@rc=0; $(PYTEST) -m "$(FAST)" $(PYTEST_ARGS) || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests (exit 5)"; rc=0; fi; exit $$rc

# The fast tier against the newest release of every dependency but torch (pinned: the CPU wheel on local
# disk), in its own venv, rebuilt on every run. When it passes, `make pins` writes those versions into
# constraints.txt; then `make test` on the new pins decides whether the move lands.
LATEST_VENV := .venv-latest
LATEST_PY := $(LATEST_VENV)/bin/python
test-latest:
	rm -rf $(LATEST_VENV) && $(PYTHON) -m venv $(LATEST_VENV)
	$(LATEST_PY) -m pip install -q torch==2.13.0
	$(LATEST_PY) -m pip install -q --upgrade -e ".[dev]" torch==2.13.0
	$(LATEST_PY) -c "import transformers; print('transformers', transformers.__version__)"
	@rc=0; $(LATEST_PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadgroup --no-loadscope-reorder \
		-m "$(FAST)" $(PYTEST_ARGS) || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests (exit 5)"; rc=0; fi; exit $$rc

pins: $(LATEST_VENV)/bin/python
	{ sed -n '/^#/p' constraints.txt; $(LATEST_PY) -m pip freeze --exclude-editable | grep -v '^sonar-fx' \
		| sed 's/^torch==\([0-9.]*\)+cpu/torch==\1/'; } > constraints.txt.new && mv constraints.txt.new constraints.txt

# The fast tier against the GPU image's library versions (transformers 5.17, triton 3.6; the image has
# torch 2.11), in a second venv, so that a GPU run finds no version problem the CPU could have found.
# Not part of `make test`. torch defaults to 2.13.0, the CPU wheel on local disk: torch 2.11 is on the
# registry only as a CUDA build (with GBs of nvidia-* libraries). Where torch 2.11's CPU wheel is
# reachable (e.g. a folder in PIP_FIND_LINKS), `make test-gpu-versions TORCH=2.11.0` runs the same tier
# against it. Each version is pinned in every install, so pip can never swap one; torch as `+cpu`, which
# PyPI's CUDA build never matches (a missing CPU wheel fails at once instead of pulling GBs); triton goes
# in with --no-deps, as the image's does (it brings no torch).
TORCH ?= 2.13.0
TRANSFORMERS ?= 5.17.0
TRITON ?= 3.6.0
GPU_VENV := .venv-gpu-versions
GPU_PY := $(GPU_VENV)/bin/python
GPU_PINS := torch==$(TORCH)+cpu transformers==$(TRANSFORMERS) triton==$(TRITON)
GPU_STAMP := $(GPU_VENV)/.installed-torch$(TORCH)-transformers$(TRANSFORMERS)-triton$(TRITON)

$(GPU_STAMP): pyproject.toml Makefile
	test -x $(GPU_PY) || $(PYTHON) -m venv $(GPU_VENV)
	$(GPU_PY) -m pip install -q torch==$(TORCH)+cpu
	$(GPU_PY) -m pip install -q --no-deps triton==$(TRITON)
	$(GPU_PY) -m pip install -q -e ".[dev]" $(GPU_PINS)
	$(GPU_PY) -c "import torch, transformers, triton; print('torch', torch.__version__, \
		'transformers', transformers.__version__, 'triton', triton.__version__)"
	rm -f $(GPU_VENV)/.installed-* && touch $(GPU_STAMP)

test-gpu-versions: $(GPU_STAMP)
	@rc=0; $(GPU_PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadgroup --no-loadscope-reorder \
		-m "$(FAST)" $(PYTEST_ARGS) || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests (exit 5)"; rc=0; fi; exit $$rc

# Benchmarks: one process each, one torch thread (two threads per process on two shared cores make
# step times swing), then the docs' Results pages and the README's headline are regenerated from their JSON.
BENCH_ARGS ?= --threads 1
# Every CPU run: a module and its option, comma-separated (the GPU ones run on a lent GPU: bench-gpu).
BENCHMARKS := benchmarks.methods benchmarks.methods,--granularity benchmarks.methods,--batch-sweep \
	benchmarks.methods,--accumulation benchmarks.methods,--timeline benchmarks.methods,--profile \
	benchmarks.compile benchmarks.compile,--endurance benchmarks.optimizers benchmarks.distributed \
	benchmarks.plan_accuracy tests.saving_cases tests.families
bench: $(STAMP)
	for b in $(BENCHMARKS); do $(PY) -m $$(echo $$b | tr , ' ') $(BENCH_ARGS) || exit 1; done
	$(PY) -m benchmarks.readme

# Every run above as a smoke run, into build/bench-quick (results/ and the docs stay as they are): a check
# that each script and option runs (tiny models, two timed rounds; about 6 minutes on two shared cores).
bench-quick: $(STAMP)
	for b in $(BENCHMARKS); do $(PY) -m $$(echo $$b | tr , ' ') --quick --out build/bench-quick $(BENCH_ARGS) \
		|| exit 1; done

# On a CUDA machine (H200), offline, on its own python/torch: the full-size OLMoE-1B-7B run, the
# kernel-backend checks and the GPU tests (scripts/gpu_check.sh says what and how long). Then, here:
# copy its results/ into results/ and run `python -m benchmarks.readme`.
bench-gpu:
	bash scripts/gpu_check.sh

# The same stages on this machine's CPU, tiny shapes (docs/gpu-check.md); tests/test_gpu_check.py runs it.
gpu-rehearsal: $(STAMP)
	PYTHON=$(PY) bash scripts/gpu_check.sh --rehearse

clean:
	rm -rf $(VENV) $(GPU_VENV) $(LATEST_VENV) .pytest_cache .ruff_cache .mypy_cache build/site  # results/ is committed: the docs quote it
