"""The real-size arms of `python -m benchmarks.plan_accuracy --real-size`: their models, table and goals.

Two models at the layer shapes of their published configs: OLMoE-1B-7B's dimensions with 2 of its 16
layers (hidden 2048, 64 experts of width 1024, top-8, vocabulary 50304: 1.05 B parameters) and
Granite-3.1-1B-A400M whole (its config.json: 24 layers, hidden 1024, 32 experts of width 512, top-8,
tied vocabulary of 49155: 1.33 B parameters); bf16, batch 1 and 2, seq 256; standard, sonar and
sonar_deferred, eager (no compile). `plan_accuracy` plans and measures each as it does its tiny cases
(step 1 makes the optimizer states, step 2 is measured with the profiler's allocator events) and times
the steps after it without the profiler. This module never builds a model or measures.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from benchmarks.common import Goal, Table, grade
from sonar_fx.planner.models import PRESETS

GIB, MIB = 2**30, 2**20
METHODS = ("standard", "sonar", "sonar_deferred")
OLMOE_2L: dict[str, Any] = {
    **PRESETS["olmoe-1b-7b"].fields,
    "num_hidden_layers": 2,
    **dict(max_position_embeddings=4096, pad_token_id=1, bos_token_id=None, eos_token_id=50279),
}
"""OLMoE-1B-7B's dimensions (the planner's preset) and special tokens, 2 layers instead of 16."""
GRANITE_1B: dict[str, Any] = dict(
    hidden_size=1024, intermediate_size=512, num_hidden_layers=24, num_attention_heads=16,
    num_key_value_heads=8, num_local_experts=32, num_experts_per_tok=8, vocab_size=49155,
    tie_word_embeddings=True, max_position_embeddings=131072, rms_norm_eps=1e-6,
    rope_parameters=dict(rope_type="default", rope_theta=1500000.0), attention_bias=False,
    attention_dropout=0.0, embedding_multiplier=12.0, logits_scaling=6.0, residual_multiplier=0.22,
    attention_multiplier=0.015625, router_aux_loss_coef=0.0, output_router_logits=False,
    pad_token_id=0, bos_token_id=0, eos_token_id=0,
)  # fmt: skip
"""ibm-granite/granite-3.1-1b-a400m's config.json (every field that shapes or runs the step)."""


def rows(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per arm: peaks (absolute and the step's transient) and the saving against standard's arm
    of the same case, planned and measured, and the median time of the unprofiled steps."""
    standard = {r["label"]: r for r in records if r["method"] == "standard"}
    out = []
    for r in records:
        measured_peak = r["measured_start"] + r["measured_transient"]
        row: dict[str, Any] = {
            "label": r["label"], "family": r["case"]["family"], "batch": r["case"]["batch"],
            "method": r["method"], "planned_peak": r["predicted_peak"], "measured_peak": measured_peak,
            "peak_error": r["predicted_peak"] / measured_peak - 1,
            "planned_transient": r["predicted_transient"], "measured_transient": r["measured_transient"],
            "transient_error": r["predicted_transient"] / r["measured_transient"] - 1,
            "step_s": statistics.median(r["step_s"]) if r["step_s"] else None,
            "timed_steps": len(r["step_s"]), "profiled_step_s": r["profiled_step_s"],
        }  # fmt: skip
        std = standard.get(r["label"])
        if std is not None and std is not r:
            planned = std["predicted_transient"] - r["predicted_transient"]
            measured = std["measured_transient"] - r["measured_transient"]
            row.update(planned_saving=planned, measured_saving=measured,
                       saving_error=planned / measured - 1 if measured else None)  # fmt: skip
        out.append(row)
    return out


def table(arm_rows: Sequence[dict[str, Any]], tolerance: float, saving_tolerance: float) -> Table:
    headers = ["model", "batch", "method", "peak planned / measured GiB", "peak error",
               "step transient planned / measured MiB", "transient error",
               "saving vs standard planned / measured MiB", "saving error", "step s"]  # fmt: skip
    body = []
    for r in arm_rows:
        saving = r.get("saving_error")
        body.append([
            r["family"], str(r["batch"]), r["method"],
            f"{r['planned_peak'] / GIB:.3f} / {r['measured_peak'] / GIB:.3f}", _pct(r["peak_error"]),
            f"{r['planned_transient'] / MIB:.1f} / {r['measured_transient'] / MIB:.1f}",
            _graded(r["transient_error"], tolerance),
            "-" if "planned_saving" not in r
            else f"{r['planned_saving'] / MIB:.1f} / {r['measured_saving'] / MIB:.1f}",
            "-" if saving is None else _graded(saving, saving_tolerance),
            "-" if r["step_s"] is None else f"{r['step_s']:.1f}",
        ])  # fmt: skip
    note = (
        "bf16 weights, gradients and AdamW states (torch.optim.AdamW: moments in bf16), seq 256, eager "
        "(no compile), transformers' own expert kernels, the plan made with --device cpu. Peak: bytes "
        "alive at step 2's start (weights, states, the batch) plus the step's transient; step transient: "
        "the profiler's allocator events above the start, the number the plan and the step differ in; "
        "error: planned / measured - 1, MISSED past "
        f"{tolerance:.0%} (transient) or {saving_tolerance:.0%} (saving). Saving: standard's transient "
        "minus the method's. step s: the median of the steps after the measured one, without the profiler."
    )
    return Table(title="Real layer shapes: plan vs a measured step on CPU", headers=headers, rows=body,
                 note=note)  # fmt: skip


def goals(arm_rows: Sequence[dict[str, Any]], tolerance: float, saving_tolerance: float) -> list[Goal]:
    transient = [abs(r["transient_error"]) for r in arm_rows]
    peak = [abs(r["peak_error"]) for r in arm_rows]
    savings = [abs(r["saving_error"]) for r in arm_rows if r.get("saving_error") is not None]
    return [
        _worst("real shapes: planned step transient vs measured", f"each within {tolerance:.0%}", transient,
               tolerance),
        _worst("real shapes: planned peak vs measured", f"each within {tolerance:.0%}", peak, tolerance),
        _worst("real shapes: planned saving vs measured", f"each within {saving_tolerance:.0%}", savings,
               saving_tolerance),
    ]  # fmt: skip


def _worst(name: str, target: str, errors: list[float], tolerance: float) -> Goal:
    worst = max(errors, default=None)
    measured = "no arm" if worst is None else f"worst {worst:.2%} over {len(errors)}"
    return Goal(name=name, target=target, measured=measured, status=grade(worst, tolerance, "<="))


def _graded(error: float, tolerance: float) -> str:
    return _pct(error) + ("" if abs(error) <= tolerance else " MISSED")


def _pct(x: float) -> str:
    return f"{100 * x:+.2f}%"
