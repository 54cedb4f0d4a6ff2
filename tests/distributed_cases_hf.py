"""What each rank runs in the SonarTrainer-under-torchrun tests (`test_distributed_trainer_deferred`):
transformers' `Trainer` with its own DDP (accelerate's MULTI_CPU, 2 gloo ranks), as torchrun would
start it (RANK / WORLD_SIZE / LOCAL_RANK set; the process group already exists, accelerate joins it).

The drop-in claim: `SonarTrainer` with the plain Trainer's arguments (its default clip over every
parameter, `max_grad_norm=1.0`, and `gradient_accumulation_steps=4`: the deferred schedule) ends with
every parameter `torch.equal` to the plain `Trainer` on the same ranks, which accumulates under
accelerate's `no_sync()` on every micro-batch but the last."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import Trainer, TrainingArguments

from sonar_fx.models import build_model

from hf_cases import DEFAULTS, SHORT, logged_norms


def _as_torchrun(rank: int) -> None:
    world = dist.get_world_size()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS="1")  # fmt: skip


def _run(trainer_cls: Any, out: Path, **overrides: Any) -> tuple[torch.nn.Module, Any]:
    torch._dynamo.reset()
    model = build_model("tiny-olmoe", seed=0)
    args = TrainingArguments(output_dir=str(out), **{**DEFAULTS, **overrides})
    trainer = trainer_cls(model=model, args=args, train_dataset=SHORT)
    trainer.train()
    return model, trainer


def sonar_trainer_equals_the_plain_trainer(rank: int) -> dict[str, Any]:
    """Per clip (the Trainer's default 1.0, and 0.5: active on every step of this data at world size
    2): the tensors that differ between SonarTrainer and the plain Trainer, both wrappers, Sonar's
    schedule and the norms each logged; and the plain runs of the two clips against each other (the
    clip's teeth)."""
    from sonar_fx.integrations.hf import SonarTrainer

    _as_torchrun(rank)
    out = Path(tempfile.mkdtemp(prefix="sonar-hf-"))
    seen: dict[str, Any] = {}
    plains = {}
    for clip in (1.0, 0.5):
        plain, plain_trainer = _run(Trainer, out / f"plain-{clip}", max_grad_norm=clip)
        sonar, sonar_trainer = _run(SonarTrainer, out / f"sonar-{clip}", max_grad_norm=clip)
        plains[clip] = plain
        seen[str(clip)] = {
            "wrapped": type(plain_trainer.model_wrapped).__name__,
            "sonar_wrapped": type(sonar_trainer.model_wrapped).__name__,
            "schedule": sonar.sonar.schedule,
            "experts_in_ddp": _experts_in_ddp(sonar_trainer.model_wrapped, sonar),
            "differ": _differ(plain, sonar),
            "norms": logged_norms(sonar_trainer),
            "plain_norms": logged_norms(plain_trainer),
        }
    seen["clips_differ"] = _differ(plains[1.0], plains[0.5])
    # No clip, no accumulation: the in-backward schedule, each expert averaged in its hook.
    plain, plain_trainer = _run(Trainer, out / "plain-0", max_grad_norm=0.0, gradient_accumulation_steps=1)
    sonar, sonar_trainer = _run(
        SonarTrainer, out / "sonar-0", max_grad_norm=0.0, gradient_accumulation_steps=1
    )
    seen["in_backward"] = {
        "schedule": sonar.sonar.schedule,
        "differ": _differ(plain, sonar),
        "norms": logged_norms(sonar_trainer),
        "plain_norms": logged_norms(plain_trainer),
    }
    seen["prepared_for_one_process"] = _prepared_for_one_process(out / "prepared")
    return seen


def _differ(a: torch.nn.Module, b: torch.nn.Module) -> list[str]:
    theirs = dict(b.named_parameters())
    return [n for n, p in a.named_parameters() if not torch.equal(p, theirs[n])]


def _experts_in_ddp(wrapped: Any, model: torch.nn.Module) -> int:
    """Expert tensors DDP reduces (Sonar averages them itself: none must be)."""
    return sum(name not in wrapped.parameters_to_ignore for name in model.sonar.experts.names)


def _prepared_for_one_process(out: Path) -> str | None:
    """A model the user compiled for one process, given to SonarTrainer under torchrun: the refusal."""
    import sonar_fx
    from sonar_fx.errors import SonarUsageError
    from sonar_fx.integrations.hf import SonarTrainer, sonar_config

    args = TrainingArguments(output_dir=str(out), **DEFAULTS)
    model = build_model("tiny-olmoe", seed=0)
    model = sonar_fx.compile(model, sonar_config(args, "deferred", model=model), compiler="eager",
                             schedule="deferred")  # fmt: skip
    try:
        SonarTrainer(model=model, args=args, train_dataset=SHORT)
    except SonarUsageError as exc:
        return str(exc)
    return None
