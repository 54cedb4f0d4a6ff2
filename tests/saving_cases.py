"""Question: in the cases that used to save nothing in silence, where do the expert updates run now, and
how many expert-gradient bytes are alive at once?

Each case trains a tiny model a few steps under aot_eager, before and after (the "before" arm rebuilds
what the code did without the change: the partition without the weight hand-over, TRL's trainer without
the backbone compile), and reports from `SonarOptimizer.report()`: updates in the graph, by hook, after
a graph returned them; the measured peak of expert-gradient bytes alive at once in the last step beside
the one-layer and all-layers bounds; and the first sonar warning, as a user reads it. Every arm is
also compared with `torch.equal` against its standard twin where the case has one. A second table
measures the saving of each path Sonar trains on (`PATHS`): the step's peak against plain torch's, the
report's expert-gradient peak beside the allocator's, and what the report says was lost. Never asserts.
The tests assert the same facts (tests/test_saving_guard.py: batched_mm before and after, a replaced
forward; tests/test_hf_trainer.py: SonarSFTTrainer in graph); `python -m tests.saving_cases` writes the
table of results/saving_cases/ for the docs.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, cast

import torch
from torch import nn

from benchmarks import common
from benchmarks.common import Table
from sonar_fx.backend import make_sonar_backend
from sonar_fx.config import AdamWConfig
from sonar_fx.experts.discovery import discover_experts
from sonar_fx.memory import ExpertGradBytes, measure_peak
from sonar_fx.methods import build_method
from sonar_fx.models import build_model
from sonar_fx.optim.optimizer import SonarOptimizer
from sonar_fx.workload import random_batches

SCRIPT = "saving_cases"
CFG = AdamWConfig(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01, max_grad_norm=0.5)
KiB = 2**10


@dataclass(frozen=True, kw_only=True)
class Config:
    """One run of this script."""

    steps: int = 2
    cases: tuple[str, ...] = ("batched_mm", "sft_fused_head")
    paths: tuple[str, ...] = ()
    """Paths of `PATHS` whose saving is measured (the second table); the default: all of them."""


QUICK = Config(cases=("batched_mm",), paths=("hooks", "deferred"))


# ------------------------------------------------------------------ the saving of each path, measured
#
# Each path Sonar trains on, one step measured after two (tiny Qwen3-MoE, bf16, 32 experts, 2 layers,
# 24 tokens: no activation of these shapes has an expert gradient's byte size, so the allocator events
# of those sizes are the expert gradients: `measure_peak(sizes=...)`), against plain torch's step.
# tests/test_memory.py holds the report to it on every path.

QWEN = dict(num_experts=32, moe_intermediate_size=64, num_hidden_layers=2)
TOKENS = dict(batch=2, seq=12)


@dataclass(frozen=True, kw_only=True)
class SavingPath:
    """One way to train with Sonar."""

    compiler: str = "eager"
    schedule: str = "in_backward"
    experts: str | None = None
    """transformers' experts implementation (None: the default, grouped_mm)."""
    user_backend: str | None = None
    """prepare, then the user's own torch.compile with this backend."""
    accum: int = 1
    scratch: int = 0
    """Expert-gradient-sized blocks alive beside the gradients that the meter does not count, in
    tensors: under aot_eager, batched_mm's gradient is a functional index_put, whose zero-filled
    buffer and its copy are both alive for a moment inside the graph."""
    saves: bool = True
    """Whether the path keeps the saving (False: it loses more than half, and says why)."""
    operands_prediction: bool = False
    """Also held to the deferred schedule's own prediction: every expert gradient but the one tensor
    the step holds, less the kept operands (`PathResult.operands_prediction`)."""


PATHS = {
    "hooks": SavingPath(),
    "deferred": SavingPath(schedule="deferred"),
    "deferred_aot_eager": SavingPath(compiler="aot_eager", schedule="deferred"),
    "deferred_loop": SavingPath(schedule="deferred", experts="eager"),
    # No deferred path left that saves nothing by its experts implementation: eager batched_mm (the
    # example once) keeps operands now. A gradient kept whole is tests/test_saving_guard.py's (a penalty
    # on the weight); transformers' eager loop under compile keeps operands too (the eager capture runs
    # where dynamo runs the loop: tests/test_deferred_compiled_loop.py).
    "deferred_user_compile": SavingPath(schedule="deferred", user_backend="aot_eager", saves=False),
    "batched_mm_hooks": SavingPath(experts="batched_mm", saves=False),
    "batched_mm_aot_eager": SavingPath(compiler="aot_eager", experts="batched_mm", scratch=1, saves=False),
    "deferred_batched_mm_aot_eager": SavingPath(
        compiler="aot_eager", schedule="deferred", experts="batched_mm", accum=2
    ),
    # batched_mm's gathered rows: the deferred schedule gathers them again in backward (no saved copy)
    # and its step scatters the product a few experts at a time (tests/test_scatter_chunks.py).
    "deferred_batched_mm": SavingPath(schedule="deferred", experts="batched_mm", operands_prediction=True),
    "deferred_batched_mm_aot_eager_accum1": SavingPath(
        compiler="aot_eager", schedule="deferred", experts="batched_mm", operands_prediction=True
    ),
    # Under inductor the product is a float32 multiply (chunked as well) and the layers share one zero
    # buffer node, which each program makes for itself (kept, it crossed every tensor over).
    "deferred_batched_mm_inductor": SavingPath(
        compiler="inductor", schedule="deferred", experts="batched_mm", operands_prediction=True
    ),
}


@dataclass(frozen=True, kw_only=True)
class PathResult:
    peak: int
    """The measured step's peak (transient bytes)."""
    plain_torch_peak: int
    """Plain torch's (fused AdamW, one clip over every parameter), same model, batches and steps."""
    allocator_peak: int
    """The most bytes of expert-gradient-sized blocks the allocator held at once in the step."""
    predicted: int
    """`ExpertGradBytes.predicted_saving`."""
    largest: int
    """The largest expert gradient's bytes."""
    report: dict[str, Any]
    """`SonarOptimizer.report()` after the step."""
    warnings: list[str]
    """Sonar's warnings over the run."""

    @property
    def saved(self) -> int:
        return self.plain_torch_peak - self.peak

    @property
    def operands_prediction(self) -> int:
        """The deferred schedule's prediction: all expert gradients but the largest, less the operands."""
        deferred = self.report["deferred"] or {}
        kept = deferred.get("kept_operand_peak", 0)
        return self.report["expert_grad_bytes"]["all_layers"] - self.largest - kept


def qwen(experts: str | None) -> nn.Module:
    model = build_model("tiny-qwen3moe", dtype=torch.bfloat16, seed=0, **QWEN)
    if experts is not None:
        model.set_experts_implementation(experts)  # type: ignore[operator]
    return model


def measure_path(name: str) -> PathResult:
    """Path `name` of `PATHS` and plain torch, each measured at its third step."""
    path = PATHS[name]
    bounds = ExpertGradBytes.of(discover_experts(qwen(path.experts)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt, step = _sonar(path)
        peak, sized = _measured(step, path.accum, bounds.tensor_sizes)
    return PathResult(
        peak=peak, plain_torch_peak=_measured(_plain_torch(path.experts), path.accum, bounds.tensor_sizes)[0],
        allocator_peak=sized, predicted=bounds.predicted_saving, largest=max(bounds.tensor_sizes),
        report=opt.report(), warnings=[str(w.message) for w in caught if str(w.message).startswith("sonar:")],
    )  # fmt: skip


def _measured(step: Callable[[list[Any]], None], accum: int, sizes: frozenset[int]) -> tuple[int, int]:
    """(step peak, expert-gradient-sized peak) of the third step of `step(micro_batches)`."""
    data = random_batches(3 * accum, **TOKENS)
    for s in range(2):
        step(data[s * accum : (s + 1) * accum])
    _, peak = measure_peak(lambda: step(data[2 * accum :]), sizes=sizes)
    return peak.peak_bytes, cast(int, peak.sized_peak_bytes)


def _plain_torch(experts: str | None) -> Callable[[list[Any]], None]:
    model = qwen(experts)
    opt = torch.optim.AdamW(model.parameters(), lr=CFG.lr, fused=True)

    def step(micro_batches: list[Any]) -> None:
        for b in micro_batches:
            model(**b).loss.backward()
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), CFG.max_grad_norm)
        opt.step()
        opt.zero_grad()

    return step


def _sonar(path: SavingPath) -> tuple[SonarOptimizer, Callable[[list[Any]], None]]:
    import sonar_fx

    torch._dynamo.reset()
    model = qwen(path.experts)
    cfg = replace(CFG, expert_clip="global") if path.schedule == "deferred" else CFG
    options: dict[str, Any] = dict(schedule=path.schedule, on_saving_lost="warn")
    if path.user_backend is not None:
        opt = sonar_fx.prepare(model, cfg, **options)
        run: Any = torch.compile(model, backend=path.user_backend)
    else:
        run = sonar_fx.compile(model, cfg, compiler=path.compiler, **options)  # type: ignore[arg-type]
        opt = run.sonar

    def step(micro_batches: list[Any]) -> None:
        for b in micro_batches:
            run(**b).loss.backward()
        opt.step()
        opt.zero_grad()

    return opt, step


def paths_table(names: Sequence[str]) -> tuple[Table, list[dict[str, Any]]]:
    rows, records = [], []
    for name in names:
        print(f"path: {name}", flush=True)
        r = measure_path(name)
        lost = r.report["saving_lost_by_cause"]
        rows.append([
            name, f"{r.saved / KiB:.0f} / {r.predicted / KiB:.0f} ({r.saved / r.predicted:.0%})",
            f"{r.report['expert_grad_bytes']['measured_peak'] / KiB:.0f}", f"{r.allocator_peak / KiB:.0f}",
            ", ".join(f"{c} {b / KiB:.0f}" for c, b in lost.items()) or "-",
            r.warnings[0][:120] if r.warnings else "(none)",
        ])  # fmt: skip
        records.append({"path": name, "saved": r.saved, "predicted": r.predicted, "peak": r.peak,
                        "plain_torch_peak": r.plain_torch_peak, "allocator_peak": r.allocator_peak,
                        "report": {k: v for k, v in r.report.items() if k != "last_step"},
                        "warnings": r.warnings})  # fmt: skip
    headers = ["path", "saved / predicted KiB", "reported peak KiB", "allocator's peak KiB",
               "lost KiB by cause", "sonar warning (first 120 chars)"]  # fmt: skip
    note = (
        f"tiny-qwen3moe bf16 {QWEN}, batch {TOKENS['batch']} x seq {TOKENS['seq']}, one clip over every "
        "parameter (deferred) or the dense ones; step 3 measured. saved: plain torch's step peak minus "
        "Sonar's (allocator events); predicted: every expert gradient but one layer's. reported peak: "
        "report()['expert_grad_bytes']['measured_peak']; allocator's peak: the most bytes of expert-"
        "gradient-sized blocks alive at once (aot_eager batched_mm: one more, the functional index_put's "
        "zero buffer beside its copy). lost: report()['saving_lost_by_cause']."
    )
    return Table(title="The saving of each path, measured", headers=headers, rows=rows, note=note), records


def _batched_mm() -> nn.Module:
    model = build_model("tiny-qwen3moe", dtype=torch.bfloat16, seed=0)
    model.set_experts_implementation("batched_mm")  # type: ignore[operator]
    return model


def batched_mm(steps: int, *, save_params: bool) -> tuple[SonarOptimizer, nn.Module]:
    import sonar_fx

    torch._dynamo.reset()
    model = _batched_mm()
    opt = sonar_fx.prepare(model, CFG, on_saving_lost="warn")
    compiled = torch.compile(model, backend=make_sonar_backend("aot_eager", save_params=save_params))
    for batch in random_batches(steps):
        compiled(**batch).loss.backward()
        opt.step()
        opt.zero_grad()
    return opt, model


def batched_mm_twin(steps: int) -> nn.Module:
    model = _batched_mm()
    method = build_method("standard_no_expert_clip", model, CFG)
    for batch in random_batches(steps):
        method.train_step(batch)
    return model


def sft(steps: int, *, backbone_compiled: bool) -> tuple[SonarOptimizer, nn.Module]:
    """TRL's SFTTrainer with its defaults on a model compiled by sonar_fx.compile (aot_eager)."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    import sonar_fx
    from sonar_fx.data import synthetic_records
    from sonar_fx.integrations.hf import SonarTrainerMixin, byte_tokenizer, sonar_config
    from sonar_fx.integrations.sft import SonarSFTTrainer, prompt_completion

    class Before(SonarTrainerMixin, SFTTrainer):  # SonarSFTTrainer without the backbone compile
        pass

    torch._dynamo.reset()
    args = SFTConfig(
        output_dir="unused", per_device_train_batch_size=2, max_steps=steps, max_grad_norm=0.5, seed=0,
        save_strategy="no", learning_rate=1e-2, report_to=[], logging_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0, use_cpu=True, max_length=256, pad_to_multiple_of=256,
    )  # fmt: skip
    model = sonar_fx.compile(build_model("tiny-qwen3moe", seed=0), sonar_config(args), compiler="aot_eager")
    trainer_cls = SonarSFTTrainer if backbone_compiled else Before
    data = Dataset.from_list(prompt_completion(synthetic_records(12)))
    trainer_cls(model=model, args=args, train_dataset=data, processing_class=byte_tokenizer()).train()
    return cast(SonarOptimizer, model.sonar), model


CASES: dict[str, tuple[Callable[..., Any], Callable[..., Any], str]] = {
    "batched_mm": (
        lambda steps: batched_mm(steps, save_params=False),
        lambda steps: batched_mm(steps, save_params=True),
        "tiny-qwen3moe bf16, experts_implementation='batched_mm', aot_eager",
    ),
    "sft_fused_head": (
        lambda steps: sft(steps, backbone_compiled=False),
        lambda steps: sft(steps, backbone_compiled=True),
        "SonarSFTTrainer (TRL's defaults: fused LM head, bf16, checkpointing), aot_eager",
    ),
}


def run_arm(fn: Callable[[int], tuple[SonarOptimizer, nn.Module]], steps: int) -> dict[str, Any]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt, model = fn(steps)
    sonar = [str(w.message) for w in caught if str(w.message).startswith("sonar:")]
    report = opt.report()
    return {"report": report, "warning": sonar[0] if sonar else "", "model": model}


def run(cfg: Config) -> tuple[list[Table], list[dict[str, Any]]]:
    rows, records = [], []
    for case in cfg.cases:
        before_fn, after_fn, what = CASES[case]
        twin = batched_mm_twin(cfg.steps) if case == "batched_mm" else None
        for label, fn in (("before", before_fn), ("after", after_fn)):
            print(f"{case}: {label}", flush=True)
            out = run_arm(fn, cfg.steps)
            r, grads = out["report"], out["report"]["expert_grad_bytes"]
            exact = "-"
            if twin is not None:
                twins = dict(twin.named_parameters())
                same = all(torch.equal(p, twins[n]) for n, p in out["model"].named_parameters())
                exact = "bitwise" if same else "DIFFERS"
            after_graph = r["updates_after_graph"]
            rows.append([
                case, label, str(r["updates_in_graph"]), str(r["updates_by_hook"] - after_graph),
                str(after_graph), f"{grads['measured_peak'] / KiB:.0f}", f"{grads['one_layer'] / KiB:.0f}",
                f"{grads['all_layers'] / KiB:.0f}", exact, out["warning"][:160] or "(none)",
            ])  # fmt: skip
            records.append({"case": case, "what": what, "arm": label, "warning": out["warning"],
                            "report": {k: v for k, v in r.items() if k != "last_step"}})  # fmt: skip
    paths, path_records = paths_table(cfg.paths or tuple(PATHS))
    records += path_records
    headers = ["case", "arm", "in graph", "by hook", "after graph", "peak KiB", "one layer KiB",
               "all layers KiB", "vs twin", "sonar warning (first 160 chars)"]  # fmt: skip
    note = (
        "Updates counted over the whole run; peak: expert-gradient bytes alive at once in the last step, "
        "measured by Sonar's meter; one layer: the most Sonar should hold; all layers: what standard "
        "training holds. before: the code without the change (batched_mm: the partition without the "
        "weight hand-over; sft_fused_head: TRL's trainer without the backbone compile)."
    )
    return [
        Table(title="Cases that used to save nothing in silence", headers=headers, rows=rows, note=note),
        paths,
    ], records


def main(argv: list[str] | None = None) -> None:
    cases = common.Override(field="cases", choices=sorted(CASES), help="cases to run", many=True)
    paths = common.Override(field="paths", choices=sorted(PATHS), help="paths to measure", many=True)
    inv = common.start(
        SCRIPT,
        __doc__,
        argv,
        default=Config(),
        quick=QUICK,
        overrides=[cases, paths],
        module="tests.saving_cases",
    )
    tables, records = run(inv.cfg)
    inv.finish(tables, records=records)


if __name__ == "__main__":
    main()
