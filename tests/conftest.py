"""Fixtures shared by the test modules, the test tiers, and the settings that let pytest-xdist share
two cores.

Tiers: markers declared in pyproject.toml; `make test` runs every test, `make test-fast` deselects
these four (docs/development.md):
  slow          compiles with inductor, or takes more than about 10 s
  multiprocess  spawns processes (gloo ranks, torchrun)
  subprocess    runs the CLI, a script or Python in a child process
  gpu           needs CUDA (skips without it)
A test that compiles with inductor, starts a process or runs a Python child without its marker
fails, naming the marker, so the fast tier stays fast as tests are added.

Sharing the machine: every test process and its children run one torch thread and compile inductor
code in-process (no compile-worker pool), so two xdist workers never oversubscribe two cores. Tests
that use a module-scoped fixture (often a compiled model) are one xdist group, run by one worker in
file order, so the fixture is built once; modules with slow or multi-process tests are handed out
first, and within them the module groups (see `pytest_collection_modifyitems`), so no long test
starts last. Never: change what a test computes or asserts.
"""

from __future__ import annotations

import collections
import functools
import multiprocessing.process
import os
import subprocess
import sys
import warnings
from pathlib import Path

# Before torch is imported: children (CLI runs, gloo ranks, torchrun) inherit these.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import pytest
import torch

from sonar_fx.optim.saving import ON_SAVING_LOST_ENV

# The saving guard raises in the whole suite (and in the CLI and worker processes tests start, which
# inherit the environment): a compiled graph that quietly leaves expert gradients to the hooks fails the
# test that compiled it. Tests of that path pass on_saving_lost="warn".
os.environ[ON_SAVING_LOST_ENV] = "raise"

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

ORDER = ("slow", "multiprocess", "subprocess")
"""Modules holding a test with one of these markers are handed out first, in this order: the longest
tests (and module groups) start early, so no worker is left with one at the end."""
STARTED: collections.Counter[str] = collections.Counter()
"""What tests started, by the marker it needs: inductor compiles (slow), processes, Python children."""
CHILDREN = {"bash", "sh", "torchrun", "sonar-fx"}
"""Programs whose start needs the `subprocess` marker, besides Python itself."""
LIBRARIES = ("torch", "triton")
"""Packages whose own child processes are not the test's (see `_started_by_a_library`)."""
CONFIGS = ("torch._dynamo.config", "torch._inductor.config", "torch._functorch.config")
"""Settings every test finds as the one before it found them (`torch_settings_restored`)."""


@pytest.fixture(autouse=True)
def torch_settings_restored():
    """Each test leaves torch's process-wide settings as it found them: a test that sets a dynamo,
    inductor or functorch option, the deterministic switch or the thread count (a benchmark's `main()`
    does, for its process) must not change the tests that run after it on the same xdist worker."""
    configs = {name: sys.modules[name] for name in CONFIGS if name in sys.modules}
    saved = {name: config.get_config_copy() for name, config in configs.items()}
    deterministic, threads = torch.are_deterministic_algorithms_enabled(), torch.get_num_threads()
    yield
    for name, config in configs.items():
        now = config.get_config_copy()  # not getattr: reading a deprecated key warns
        for key, value in saved[name].items():
            if now[key] is not value and now[key] != value:
                setattr(config, key, value)
    torch.use_deterministic_algorithms(deterministic)
    torch.set_num_threads(threads)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--gpu-device",
        default="cuda",
        help="device of the gpu-marked tests: cuda (default; they skip without it) or cpu, the rehearsal "
        "of scripts/gpu_check.sh (tiny shapes, Triton interpreted: the code runs, not the GPU kernels)",
    )


@pytest.fixture
def gpu_device(request: pytest.FixtureRequest) -> torch.device:
    """The device a gpu-marked test runs on (`--gpu-device`); skips when it is CUDA and there is none."""
    device = torch.device(request.config.getoption("--gpu-device"))
    if device.type == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (--gpu-device cpu rehearses the test's code on CPU)")
    return device


@pytest.fixture
def deferred_saving_lost(monkeypatch: pytest.MonkeyPatch):
    """For a test of the deferred schedule's arithmetic where its saving is lost: a tiny model with many
    tokens per step (its expert tensors cross over: a step's kept operands outgrow them), or experts the
    eager capture cannot defer (kept whole: tests/test_deferred_paths.py names them). The suite's
    "raise" would refuse the run (tests/test_saving_guard.py tests that refusal); here it trains with
    the saving guard's warning, which is let through."""
    monkeypatch.setenv(ON_SAVING_LOST_ENV, "warn")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"sonar: schedule='deferred' ke", category=UserWarning)
        yield


@pytest.fixture
def deterministic():
    """Deterministic kernels for one test: inductor's CPU kernels otherwise accumulate in parallel, so
    two equal compiled runs could differ in the last bit."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before)


# ------------------------------------------------------------------------------------------- tiers


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("numprocesses", None) and not hasattr(config, "workerinput"):
        return  # the xdist controller runs no test
    import torch._inductor.compile_fx as compile_fx  # here, not at the top: only where tests run

    compile_fx.compile_fx = _counted("slow", compile_fx.compile_fx)
    base = multiprocessing.process.BaseProcess
    base.start = _counted("multiprocess", base.start)  # type: ignore[method-assign]
    popen_init = subprocess.Popen.__init__

    @functools.wraps(popen_init)
    def init(self: subprocess.Popen, args: object, *rest: object, **kwargs: object) -> None:
        if _is_ours(args) and not _started_by_a_library():
            STARTED["subprocess"] += 1
        popen_init(self, args, *rest, **kwargs)  # type: ignore[arg-type]

    subprocess.Popen.__init__ = init  # type: ignore[method-assign]


def _counted(kind: str, fn):
    @functools.wraps(fn)
    def counted(*args, **kwargs):
        STARTED[kind] += 1
        return fn(*args, **kwargs)

    return counted


def _started_by_a_library() -> bool:
    """Whether the code that started the child is torch's or triton's (inductor runs Python once per
    process to check the CPU's vector ISA): only a test's own children need the marker."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename == subprocess.__file__:
        frame = frame.f_back  # subprocess.run -> Popen.__init__
    where = frame.f_code.co_filename if frame is not None else ""
    return any(f"{os.sep}{lib}{os.sep}" in where for lib in LIBRARIES)


def _is_ours(args: object) -> bool:
    """A Python process, a shell script or the CLI (not the C++ compiler inductor runs, say)."""
    first = args[0] if isinstance(args, (list, tuple)) and args else args
    program = Path(str(first).split()[0]) if isinstance(first, str) else Path(str(first))
    return program.name.startswith("python") or program.name in CHILDREN or str(program) == sys.executable


# Old-style wrappers (hookwrapper=True): the GPU image's pytest may predate wrapper=True.
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    before = STARTED.copy()
    outcome = yield
    _check_tier(item, before, outcome)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):
    before = STARTED.copy()
    outcome = yield
    _check_tier(item, before, outcome)


def _check_tier(item: pytest.Item, before: collections.Counter[str], outcome) -> None:
    missing = [kind for kind in STARTED if STARTED[kind] > before[kind] and not item.get_closest_marker(kind)]
    if missing and outcome.excinfo is None:
        what = {"slow": "compiled with inductor", "multiprocess": "started a process",
                "subprocess": "ran a child process"}  # fmt: skip
        outcome.force_exception(
            pytest.fail.Exception(
                f"{item.nodeid} {' and '.join(what[k] for k in missing)} but is not marked "
                f"{', '.join(missing)}: add @pytest.mark.<marker> (docs/development.md, test tiers)",
                pytrace=False,
            )
        )


# -------------------------------------------------------------------------------- xdist scheduling


# tryfirst: xdist's own hook turns the xdist_group marks into node ids; marks added after it are ignored.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    grouping = config.pluginmanager.hasplugin("xdist")  # a GPU image may run pytest without it
    for item in items:
        if grouping and _uses_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))  # type: ignore[attr-defined]
    modules: dict[str, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::")[0], []).append(item)

    def tier(group: list[pytest.Item]) -> int:
        marked = {m.name for item in group for m in item.iter_markers()}
        return next((i for i, name in enumerate(ORDER) if name in marked), len(ORDER))

    tiers = {item: tier(group) for group in modules.values() for item in group}
    # Within a tier, the module-fixture groups first: each is one indivisible unit (a compiled model,
    # a rehearsal run) that only one worker can run, so it starts while the single tests of the same
    # tier are still left to even out the two workers' ends (longest processing time first).
    ordered = [item for group in modules.values() for item in group]
    items[:] = sorted(ordered, key=lambda item: (tiers[item], not _in_a_group(item)))


def _in_a_group(item: pytest.Item) -> bool:
    return item.get_closest_marker("xdist_group") is not None


def _uses_module_fixture(item: pytest.Item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    return any(defs and defs[-1].scope == "module" for defs in info.name2fixturedefs.values())
