"""The fine-tuning trainer: one run of a training method on Alpaca-format data, from a `TrainConfig`.

One `Trainer` owns the step loop; its parts are small modules, each with one job:
`config` (the frozen `TrainConfig`, `ConfigError`, field -> flag), `validate` (every flag check, in one
place), `plan` (`plan_run`: flags, output folder, data, resume checkpoint, before any model exists),
`schedule` (warm-up + cosine LR), `checkpoint` (atomic, checksummed, refused when corrupted or from
another run), `rundir` (run files, lock, atomic writes, stale temp files), `metrics` (metrics.jsonl,
the summary's aggregates), `signals` (SIGTERM/SIGINT at step boundaries), `parallel` (this process's
place in the run: engine, rank, world), `loop` (`Trainer`), `run` (`train`: plan, build, train, summary).
Dependencies point one way: cli -> trainer -> methods -> api. Never: change a method's arithmetic,
contact a hub, or start training on input it has not validated.
"""

from sonar_fx.trainer.checkpoint import CheckpointError
from sonar_fx.trainer.config import DTYPES, ConfigError, TrainConfig
from sonar_fx.trainer.loop import Outcome, StepFailed, Trainer
from sonar_fx.trainer.plan import RunPlan, plan_run
from sonar_fx.trainer.run import RunResult, build, run_plan, train
from sonar_fx.trainer.schedule import WarmupCosine

__all__ = [
    "DTYPES",
    "CheckpointError",
    "ConfigError",
    "Outcome",
    "RunPlan",
    "RunResult",
    "StepFailed",
    "TrainConfig",
    "Trainer",
    "WarmupCosine",
    "build",
    "plan_run",
    "run_plan",
    "train",
]
