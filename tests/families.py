"""Question: which Mixture-of-Experts families of transformers does Sonar find and train exactly?

Every MoE causal-LM model type of the installed transformers (`sonar_fx.models.families`), from a tiny
config, fp32: what discovery finds, then `steps` steps of Sonar against its exact twin
(standard_no_expert_clip with the same expert/dense split), eager and under each compiler, compared
with `torch.equal` on every parameter. A family whose twin fails the same way under plain
`torch.compile` is marked "upstream" (the failure is not Sonar's). In the eager run a negative
control trains standard AdamW with a global clip: it must differ from Sonar (the clip is active).
Each family runs in its own process (a crash, a hang or a runaway compile stays contained) with a
time limit. Each row is one family under one of transformers' experts implementations (`eager`: a
loop over experts, `grouped_mm`: the default, `batched_mm`: gathered weights; "default" where the
family has no switch). Table cells: "exact" and where the expert updates ran: "graph" (the compiled
pass), "hooks" (graph breaks left the experts' gradients outside any graph), "after graph" (a graph
returned them un-rewritten: no saving), "fallback" (Sonar's compile fallback fired, with its cause);
then the saving: the measured peak of expert-gradient bytes alive at once in the last step, as a
fraction of one layer's (Sonar's bound; above 1 means more than one layer was alive together).

A check more than a measurement, so it lives with the tests: tests/test_families.py runs the same
`run_twins` on one family per layout; `python -m tests.families` runs every family and writes
results/families/ for the docs (`--quick`, a smoke run: OLMoE and Qwen2-MoE, eager and aot_eager, under
transformers' default experts implementation).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks import common
from benchmarks.common import Override, Table
from sonar_fx.config import AdamWConfig
from sonar_fx.experts.discovery import NoExpertsFoundError, discover_experts
from sonar_fx.methods import build_method
from sonar_fx.models.families import build_family, moe_model_types
from sonar_fx.workload import random_batches

SCRIPT = "families"
CFG = AdamWConfig(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01, max_grad_norm=0.5)
"""lr large enough that weights visibly move in a few steps; a small clip so clipping is active."""
COMPILERS = ("eager", "aot_eager", "inductor")
IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm")
"""transformers' experts implementations (`set_experts_implementation`)."""
REPRESENTATIVE = (
    "olmoe",
    "qwen2_moe",
    "gpt_oss",
    "nemotron_h",
    "jetmoe",
    "dbrx",
    "longcat_flash",
    "llama4_text",
)
"""One family of each layout discovery knows, and shared experts (the first two: --quick)."""
INDUCTOR_FAMILIES = (
    *REPRESENTATIVE,
    *("deepseek_v3", "qwen3_moe", "mixtral", "granitemoe", "qwen3_next", "doge", "jamba", "glm4_moe"),
)
"""Families the default run also compiles with inductor (minutes each on two CPU cores)."""

EXPLICIT_EXPERTS: dict[str, str] = {
    # Embedding-style experts (one (E, d) vector pair per expert): a shape routers share, so discovery
    # never takes them; the user names them.
    "doge": r"\.mlp\.(up|down)_embed\.weight$",
}
"""Families that need `experts=`: a regular expression over parameter names."""


@dataclass(frozen=True, kw_only=True)
class Config:
    """One run of this script."""

    families: tuple[str, ...] = ()
    """Model types to run (empty: every MoE causal-LM type of the installed transformers)."""
    compilers: tuple[str, ...] = COMPILERS
    implementations: tuple[str, ...] = IMPLEMENTATIONS
    """Experts implementations to run each family with (where the family has the switch)."""
    inductor_families: tuple[str, ...] = INDUCTOR_FAMILIES
    """Families run under inductor when it is among `compilers` ("all": every family)."""
    steps: int = 3
    timeout_s: int = 1500
    """Per family, all compilers together."""


QUICK = Config(
    families=REPRESENTATIVE[:2], compilers=("eager", "aot_eager"), implementations=("grouped_mm",), steps=2
)
PARTIAL = "partial.jsonl"
"""Each finished family's records, appended as it finishes (`--resume` skips those families)."""


@dataclass
class TwinRun:
    """Sonar against its twin on one family and one compiler."""

    differ: list[str] = field(default_factory=list)
    """Parameters whose values differ after training (empty: bitwise equal)."""
    sonar_error: str | None = None
    twin_error: str | None = None
    report: dict[str, Any] = field(default_factory=dict)
    """`SonarOptimizer.report()` after training."""
    clip_control_differs: bool | None = None
    """Eager only: standard AdamW with a global clip differs from Sonar (None: not run)."""


def batches(n: int, *, seed: int = 1) -> list[dict]:
    """Random token batches below 256, the tiny family configs' smallest vocabulary."""
    return random_batches(n, vocab=256, seed=seed)


def explicit_experts(model_type: str, model: nn.Module) -> list[str] | None:
    """The `experts=` names a family needs (None: discovery finds them)."""
    pattern = EXPLICIT_EXPERTS.get(model_type)
    return None if pattern is None else [n for n, _ in model.named_parameters() if re.search(pattern, n)]


def train(
    method: str,
    model_type: str,
    compiler: str,
    steps: int,
    *,
    overrides: Mapping[str, Any] | None = None,
    implementation: str | None = None,
    **kwargs: Any,
) -> tuple[nn.Module, Any, str | None]:
    """A fresh tiny model (config `overrides` applied, its experts implementation set when given)
    trained `steps` steps with `method`: (model, method, error or None); `kwargs` go to `build_method`."""
    if compiler != "eager":
        # Every family's forward runs through one transformers wrapper (one code object), whose dynamo
        # recompile limit counts the graphs of every earlier run: past it, dynamo runs the model eagerly.
        torch._dynamo.reset()
    model = build_family(model_type, seed=0, **(overrides or {}))
    if implementation is not None:
        model.set_experts_implementation(implementation)  # type: ignore[operator]
    experts = explicit_experts(model_type, model)
    torch.manual_seed(0)  # the same random stream (dropout, router jitter) for every method
    m = None
    try:
        m = build_method(method, model, CFG, compiler=compiler, experts=experts, **kwargs)
        for b in batches(steps):
            m.train_step(b)
    except Exception as err:
        return model, m, f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:300]
    return model, m, None


def run_twins(
    model_type: str, compiler: str, *, steps: int = 3, control: bool = False, **kwargs: Any
) -> TwinRun:
    """Sonar and standard_no_expert_clip on fresh copies of one family; `kwargs` go to `train`."""
    twin, _, twin_error = train("standard_no_expert_clip", model_type, compiler, steps, **kwargs)
    sonar, m, sonar_error = train("sonar", model_type, compiler, steps, **kwargs)
    out = TwinRun(sonar_error=sonar_error, twin_error=twin_error)
    if m is not None and m.optimizer is not None:
        out.report = m.optimizer.report()
    if sonar_error or twin_error:
        return out
    out.differ = differing(sonar, twin)
    if control:
        standard, _, err = train("standard", model_type, compiler, steps, **kwargs)
        out.clip_control_differs = None if err else bool(differing(sonar, standard))
    return out


def differing(a: nn.Module, b: nn.Module) -> list[str]:
    pb = dict(b.named_parameters())
    return [n for n, p in a.named_parameters() if not torch.equal(p, pb[n])]


def discovery_summary(model_type: str) -> dict[str, Any]:
    """What discovery finds in the family (built on the meta device)."""
    model = build_family(model_type, device="meta")
    experts = explicit_experts(model_type, model)
    try:
        layers = discover_experts(model)
    except NoExpertsFoundError:
        if experts is None:
            return {"found": False, "needs_experts": None}
        layers = discover_experts(model, experts)
    return {
        "found": experts is None,
        "needs_experts": experts,
        "layers": len(layers),
        "layouts": sorted({layer.layout for layer in layers}),
        "tensors_per_layer": sorted({len(layer.tensors) for layer in layers}),
        "roles": sorted({t.role for layer in layers for t in layer.tensors}),
        "num_experts": sorted({layer.num_experts for layer in layers}),
    }


def verdict(run: TwinRun) -> str:
    """One table cell: exact (and where the updates ran), DIFFERS, FAILS or upstream."""
    if run.twin_error and run.sonar_error:
        return f"upstream: {run.twin_error}"
    if run.sonar_error:
        return f"FAILS: {run.sonar_error}"
    if run.twin_error:
        return f"twin fails: {run.twin_error}"
    if run.differ:
        return f"DIFFERS ({len(run.differ)} tensors, e.g. {run.differ[0]})"
    r = run.report
    after = r.get("updates_after_graph", 0)
    hooks = r.get("updates_by_hook", 0) - after
    counts = (("graph", r.get("updates_in_graph")), ("hooks", hooks), ("after graph", after))
    where = [p for p, n in counts if n]
    fallback = f"; fallback: {'; '.join(r['fallbacks'])}" if r.get("fallbacks") else ""
    return f"exact ({'+'.join(where) or 'no updates'}{saving(r)}{fallback})"


def saving(report: Mapping[str, Any]) -> str:
    """The measured expert-gradient peak of the last step as a fraction of one layer's (Sonar's bound)."""
    grads = report.get("expert_grad_bytes") or {}
    peak, layer = grads.get("measured_peak"), grads.get("one_layer")
    return f"; peak {peak / layer:.2f} layer" if peak and layer else ""


def implementations_of(model_type: str, cfg: Config) -> list[str | None]:
    """The experts implementations to run `model_type` with (None: the family has no switch)."""
    model = build_family(model_type, device="meta")
    can_set = getattr(model, "_can_set_experts_implementation", None)
    return list(cfg.implementations) if callable(can_set) and can_set() else [None]


def worker(model_type: str, cfg: Config) -> None:
    """Run one family in this process, printing one JSON record per line (read by `run_family`)."""
    common.setup(argparse.Namespace(threads=torch.get_num_threads()))
    _emit({"family": model_type, "discovery": discovery_summary(model_type)})
    implementations = implementations_of(model_type, cfg)
    for implementation, compiler in itertools.product(implementations, cfg.compilers):
        # (the parent already dropped inductor where not asked for)
        start = time.perf_counter()
        control = compiler == "eager" and implementation in (None, implementations[0])
        run = run_twins(model_type, compiler, steps=cfg.steps, control=control, implementation=implementation)
        _emit(
            {
                "family": model_type,
                "implementation": implementation or "default",
                "compiler": compiler,
                "verdict": verdict(run),
                "exact": not (run.differ or run.sonar_error or run.twin_error),
                "differ": run.differ[:5],
                "sonar_error": run.sonar_error,
                "twin_error": run.twin_error,
                "clip_control_differs": run.clip_control_differs,
                "report": {k: v for k, v in run.report.items() if k != "last_step"},
                "seconds": round(time.perf_counter() - start, 1),
            }
        )


def _compilers_for(model_type: str, cfg: Config) -> list[str]:
    run_inductor = "all" in cfg.inductor_families or model_type in cfg.inductor_families
    return [c for c in cfg.compilers if c != "inductor" or run_inductor]


def _emit(record: Mapping[str, Any]) -> None:
    print("RECORD " + json.dumps(record), flush=True)


def run_family(model_type: str, cfg: Config, threads: int) -> list[dict[str, Any]]:
    """`worker` in a child process; records it printed, and one for a crash or a timeout."""
    cmd = [sys.executable, "-m", "tests.families", "--worker", model_type, "--steps", str(cfg.steps)]
    compilers = _compilers_for(model_type, cfg)
    cmd += ["--compiler", *compilers, "--implementation", *cfg.implementations, "--threads", str(threads)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=cfg.timeout_s, env=env)
        out, err, rc = done.stdout, done.stderr, done.returncode
    except subprocess.TimeoutExpired as exc:
        out, err, rc = _text(exc.stdout), _text(exc.stderr), None
    records = [json.loads(line[7:]) for line in out.splitlines() if line.startswith("RECORD ")]
    if rc != 0:  # a crash or a timeout: the row it was on says what stopped it (None: timed out)
        ran = [r for r in records if "compiler" in r]
        why = f"timeout after {cfg.timeout_s}s" if rc is None else f"process exited {rc}: {err[-300:]}"
        implementation = ran[-1].get("implementation", "default") if ran else "default"
        records.append(
            {"family": model_type, "implementation": implementation, "compiler": "(next)",
             "verdict": why, "exact": False}
        )  # fmt: skip
    return records


def _text(data: bytes | str | None) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


def table(records: list[dict[str, Any]], compilers: tuple[str, ...]) -> Table:
    discovery = {r["family"]: r["discovery"] for r in records if "discovery" in r}
    by_row: dict[tuple[str, str], dict[str, Any]] = {}
    for r in records:
        if "compiler" in r:
            by_row.setdefault((r["family"], r.get("implementation", "default")), {})[r["compiler"]] = r
    rows = []
    for (family, implementation), row in sorted(by_row.items()):
        control = {True: "yes", False: "NO", None: "-"}[row.get("eager", {}).get("clip_control_differs")]
        cells = [_short(row.get(c, {}).get("verdict", "not run")) for c in compilers]
        broken = row.get("(next)", {}).get("verdict")
        if broken:
            cells[-1] = _short(f"{cells[-1]}; then {broken}")
        rows.append([family, implementation, _found(discovery.get(family, {})), control, *cells])
    if not rows:
        rows.append(["(none)", "", "", "", *["" for _ in compilers]])
    note = (
        "experts impl: transformers' experts implementation (default: the family has no switch). "
        "found: what discovery takes per layer (layout, tensors, E); `experts=` when the family needs "
        "them listed. clip matters: standard AdamW with a global clip differs from Sonar (eager), so the "
        "clip is active and exactness has teeth (NO: the tiny model's gradient norm stays under the "
        "clip). Cells: Sonar vs standard_no_expert_clip after the run's steps, torch.equal on every "
        "parameter, and where the expert updates ran (after graph: returned by the graph, no saving); "
        "peak: expert-gradient bytes alive at once in the last step (measured) over one layer's; "
        "upstream: plain torch.compile (the twin) fails the same way. The full error of each cell is in "
        "results.json."
    )
    headers = ["model type", "experts impl", "found", "clip matters", *compilers]
    return Table(title="MoE families", headers=headers, rows=rows, note=note)


def _short(verdict: str, limit: int = 80) -> str:
    return verdict if len(verdict) <= limit else verdict[: limit - 3] + "..."


def _found(d: Mapping[str, Any]) -> str:
    if not d:
        return "?"
    if d.get("needs_experts") is not None:
        return f"needs experts= ({len(d['needs_experts'])} tensors)"
    if not d.get("found"):
        return "NOT FOUND"
    tensors = "/".join(map(str, d["tensors_per_layer"]))
    experts = "/".join(map(str, d["num_experts"]))
    return f"{d['layers']} x {'+'.join(d['layouts'])} ({tensors} tensors, E={experts})"


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--retable"]:
        retable(Path(argv[1]) if len(argv) > 1 else common.RESULTS_DIR / SCRIPT / "results.json")
        return
    if "--worker" in argv:
        p = argparse.ArgumentParser()
        p.add_argument("--worker", required=True)
        p.add_argument("--steps", type=int, default=Config.steps)
        p.add_argument("--compiler", nargs="+", default=list(COMPILERS))
        p.add_argument("--implementation", nargs="+", default=list(IMPLEMENTATIONS))
        p.add_argument("--threads", type=int, default=None)
        args = p.parse_args(argv)
        if args.threads:
            torch.set_num_threads(args.threads)
        cfg = Config(
            compilers=tuple(args.compiler), implementations=tuple(args.implementation), steps=args.steps
        )
        worker(args.worker, cfg)
        return
    families = Override(field="families", choices=moe_model_types(), help="model types to run", many=True)
    compilers = Override(field="compilers", choices=COMPILERS, help="compilers to run", many=True)
    implementations = Override(
        field="implementations", choices=IMPLEMENTATIONS, help="experts implementations to run", many=True
    )
    inductor = Override(
        field="inductor_families", choices=("all", *moe_model_types()), many=True,
        help="families also compiled with inductor (default: a representative set; 'all': every family)",
    )  # fmt: skip
    resume = "--resume" in argv
    argv = [a for a in argv if a != "--resume"]
    # One thread unless asked: inductor's CPU scatter-add (per-expert bias gradients) is not
    # deterministic across threads, so even plain training would differ from itself.
    argv = argv if "--threads" in argv else [*argv, "--threads", "1"]
    inv = common.start(
        SCRIPT, __doc__, argv, default=Config(), quick=QUICK,
        overrides=[families, compilers, implementations, inductor], module="tests.families",
    )  # fmt: skip
    cfg, partial = inv.cfg, inv.out / PARTIAL
    records = _read_partial(partial) if resume else []
    if not resume:
        partial.unlink(missing_ok=True)
    done = {r["family"] for r in records}
    for model_type in cfg.families or moe_model_types():
        if model_type in done:
            continue
        new = run_family(model_type, cfg, inv.args.threads)
        _append_partial(partial, new)
        records += new
        cells = [f"{r['compiler']}: {r['verdict']}" for r in new if "compiler" in r]
        print(f"{model_type}: " + " | ".join(cells), flush=True)
    inv.finish([table(records, cfg.compilers)], records=records)
    partial.unlink(missing_ok=True)  # everything is in results.json now


def retable(path: Path) -> None:
    """Render the table of an existing results.json again from its records (no training)."""
    data = json.loads(path.read_text())
    data["tables"] = [dataclasses.asdict(table(data["records"], tuple(data["config"]["compilers"])))]
    path.write_text(json.dumps(data, indent=1) + "\n")
    print(Table(**data["tables"][0]).render())


def _read_partial(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []


def _append_partial(path: Path, records: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


if __name__ == "__main__":
    main()
