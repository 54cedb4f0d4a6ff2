"""Question: in the cases that used to save nothing in silence, where do the expert updates run now, and
how many expert-gradient bytes are alive at once?

Each case trains a tiny model a few steps under aot_eager, before and after (the "before" arm rebuilds
what the code did without the change: the partition without the weight hand-over, TRL's trainer without
the backbone compile), and reports from `SonarOptimizer.report()`: updates in the graph, by hook, after
a graph returned them; the measured peak of expert-gradient bytes alive at once in the last step beside
the one-layer and all-layers bounds; and the first sonar warning, as a user reads it. Every arm is
also compared with `torch.equal` against its standard twin where the case has one. Never asserts.
The tests assert the same facts (tests/test_saving_guard.py: batched_mm before and after, a replaced
forward; tests/test_hf_trainer.py: SonarSFTTrainer in graph); `python -m tests.saving_cases` writes the
table of results/saving_cases/ for the docs.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from benchmarks import common
from benchmarks.common import Table
from sonar_fx.backend import make_sonar_backend
from sonar_fx.config import AdamWConfig
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


QUICK = Config(cases=("batched_mm",))


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
    headers = ["case", "arm", "in graph", "by hook", "after graph", "peak KiB", "one layer KiB",
               "all layers KiB", "vs twin", "sonar warning (first 160 chars)"]  # fmt: skip
    note = (
        "Updates counted over the whole run; peak: expert-gradient bytes alive at once in the last step, "
        "measured by Sonar's meter; one layer: the most Sonar should hold; all layers: what standard "
        "training holds. before: the code without the change (batched_mm: the partition without the "
        "weight hand-over; sft_fused_head: TRL's trainer without the backbone compile)."
    )
    return [
        Table(title="Cases that used to save nothing in silence", headers=headers, rows=rows, note=note)
    ], records


def main(argv: list[str] | None = None) -> None:
    cases = common.Override(field="cases", choices=sorted(CASES), help="cases to run", many=True)
    inv = common.start(
        SCRIPT, __doc__, argv, default=Config(), quick=QUICK, overrides=[cases], module="tests.saving_cases"
    )
    tables, records = run(inv.cfg)
    inv.finish(tables, records=records)


if __name__ == "__main__":
    main()
