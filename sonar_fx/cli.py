"""Command line: `sonar-fx finetune ...` (one fine-tuning run), `sonar-fx demo` (the comparison),
`sonar-fx inspect --model ...` (which tensors discovery takes as experts, before any training) and
`sonar-fx plan --model ...` (a training step's peak memory per method, predicted on fake tensors).

For: turning flags into a `TrainConfig` / `DemoConfig`, bad input into one clear line on stderr
before anything trains, and what happened into the exit status:
  0    the run finished (or was already finished: nothing is rewritten);
  1    an unexpected error (a bug: the traceback is printed);
  2    bad input: the message names the flag, file, line or key and the fix;
  3    a training step raised: nothing from that step was written; `--resume` continues from the
       last checkpoint exactly;
  128+N  stopped by signal N (130 SIGINT, 143 SIGTERM) at a step boundary, after saving a checkpoint.
Never: hold training logic; it calls `sonar_fx.trainer`, `sonar_fx.demo`, `sonar_fx.experts.report` and
`sonar_fx.planner.report`.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from collections.abc import Sequence
from typing import Any

from sonar_fx.api import COMPILERS
from sonar_fx.config import EXPERT_CLIPS, OPTIMIZER_CONFIGS, STATE_BITS, ConfigFieldError
from sonar_fx.data import DataError
from sonar_fx.engines import ENGINES
from sonar_fx.experts.discovery import DEFAULT_EXPERT_BIASES, EXPERT_BIASES
from sonar_fx.experts.report import discovery_report, format_report, report_json
from sonar_fx.methods import METHODS, Execution
from sonar_fx.models import TINY_MODELS
from sonar_fx.optim.optimizer import NONFINITE
from sonar_fx.planner.fake import PlanError
from sonar_fx.planner.planning import parse_bytes
from sonar_fx.planner.report import add_plan_flags, plan_command
from sonar_fx.trainer import (
    DTYPES,
    CheckpointError,
    ConfigError,
    StepFailed,
    TrainConfig,
    plan_run,
    run_plan,
)
from sonar_fx.trainer.signals import SecondSignal
from sonar_fx.trainer.validate import field_error

USER_ERRORS = (ConfigError, DataError, CheckpointError)
EXIT_BAD_INPUT, EXIT_STEP_FAILED, EXIT_SIGNAL_BASE = 2, 3, 128


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `sonar-fx` console script and of `python -m sonar_fx` (see the exit statuses
    in the module docstring)."""
    args = build_parser().parse_args(argv)
    try:
        if args.command == "finetune":
            return _finetune(args)
        if args.command == "inspect":
            return _inspect(args)
        if args.command == "plan":
            return plan_command(args)
        return _demo(args)
    except USER_ERRORS as exc:
        _error(args, str(exc))
        return EXIT_BAD_INPUT
    except StepFailed as exc:
        traceback.print_exception(exc.cause, file=sys.stderr)
        _error(args, str(exc))
        return EXIT_STEP_FAILED
    except SecondSignal as exc:
        _error(args, f"{exc}; --resume continues from the last checkpoint")
        return EXIT_SIGNAL_BASE + exc.signum


def _error(args: argparse.Namespace, message: str) -> None:
    print(f"sonar-fx {args.command}: error: {message}", file=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sonar-fx",
        description="Sonar-MoE: in-backward expert updates for memory-efficient MoE training",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_finetune(sub.add_parser("finetune", help="fine-tune an MoE model on Alpaca-format data"))
    demo = sub.add_parser("demo", help="Sonar vs its baselines on tiny-olmoe (`make demo`)")
    demo.add_argument("--out", default="runs/demo", help="folder for demo.json, demo.png and each arm's run")
    demo.add_argument(
        "--compiler", choices=("inductor", "aot_eager"), default="inductor",
        help="compiler of the compiled arms (aot_eager: same graphs, no codegen, faster to start)",
    )  # fmt: skip
    demo.add_argument("--steps", type=_positive_int, default=None, help="steps per arm (default: the demo's)")
    demo.add_argument("--no-progress", action="store_true", help="no progress bars")
    _add_inspect(
        sub.add_parser("inspect", help="list the expert tensors Sonar finds in a model (no training)")
    )
    add_plan_flags(
        sub.add_parser("plan", help="predict a training step's peak memory per method (fake tensors)")
    )
    return parser


def _add_inspect(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", required=True,
        help="a built-in tiny model name, hf:<model_type> (a tiny config of any MoE family in transformers, "
        "built on the meta device), or a local checkpoint directory (its config, on the meta device)",
    )  # fmt: skip
    p.add_argument("--expert-biases", choices=EXPERT_BIASES, default=DEFAULT_EXPERT_BIASES)
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def _add_finetune(p: argparse.ArgumentParser) -> None:
    """Model, data, method and optimizer flags (the rest: `_add_run_flags`)."""
    d = TrainConfig()
    add = p.add_argument
    add("--model", default=d.model, help=f"{', '.join(TINY_MODELS)}, or a local checkpoint directory")
    add("--model-override", action="append", default=[], metavar="KEY=VALUE",
        help="override a tiny model's config field, e.g. num_experts=64 (repeatable)")  # fmt: skip
    add("--data", default=None, help="Alpaca .json/.jsonl file (default: the built-in synthetic set)")
    add("--tokenizer", default=None, help="'byte' or a local tokenizer directory (default: byte for "
        "built-in models, the model directory for a checkpoint)")  # fmt: skip
    add("--method", choices=METHODS, default=d.method)
    add("--compiler", choices=COMPILERS, default=d.execution.compiler)
    add("--hooks-on-compiled", dest="sonar_pass", action="store_false",
        help="sonar under a compiler: keep the eager hooks on the compiled model, no graph pass")  # fmt: skip
    add("--steps", type=int, default=None, help="optimizer steps (default: one pass over the train split)")
    add("--batch-size", type=int, default=d.batch_size)
    add("--grad-accum", type=int, default=d.grad_accum, metavar="N",
        help="micro-batches per optimizer step, gradients accumulated (every method alike; sonar: exact, "
        "through the deferred schedule)")  # fmt: skip
    add("--max-len", type=int, default=d.max_len, help="tokens per example; longer ones are truncated")
    add(
        "--lr",
        type=float,
        default=None,
        help="peak LR (default: 2e-5 checkpoint, 3e-3 tiny model)",
    )
    add("--warmup", type=int, default=None, help="linear warm-up steps (default: 3%% of the steps)")
    add("--min-lr", type=float, default=d.min_lr, help="LR at the end of the cosine decay")
    add("--optimizer", choices=tuple(OPTIMIZER_CONFIGS), default=d.optimizer,
        help="optimizer of dense and expert tensors (adam: L2 decay; sgd: --momentum; muon: Muon for expert "
        "and hidden matrices, AdamW for the rest)")  # fmt: skip
    add("--betas", type=float, nargs=2, default=d.betas, metavar=("BETA1", "BETA2"),
        help="adamw, adam, lion; muon: its AdamW tensors")  # fmt: skip
    add("--eps", type=float, default=d.eps, help="adamw, adam; muon: its AdamW tensors")
    add("--weight-decay", type=float, default=None,
        help="decoupled (adam: L2); default 0.1 for muon (torch.optim.Muon's), 0 otherwise")  # fmt: skip
    add("--momentum", type=float, default=None, help="sgd (default 0), muon (default 0.95)")
    add("--dampening", type=float, default=d.dampening, help="sgd")
    add("--nesterov", action=argparse.BooleanOptionalAction, default=None,
        help="sgd (default off), muon (default on): Nesterov momentum")  # fmt: skip
    add("--adjust-lr-fn", choices=("original", "match_rms_adamw"), default=None,
        help="muon: how a matrix's shape scales its LR (default: original)")  # fmt: skip
    add("--max-grad-norm", type=_optional_float, default=d.max_grad_norm, help="'none': no clip")
    add("--expert-clip", type=_expert_clip, default=d.expert_clip, metavar="{none,per_tensor,global}",
        help="clip expert gradients to --max-grad-norm: not at all (none, the paper), each tensor by its "
        "own norm (per_tensor), or with the dense ones by one norm (global: 2 backward passes)")  # fmt: skip
    add("--keep-budget", type=_keep_budget, default=d.keep_budget, metavar="BYTES|auto",
        help="deferred schedule, clip over all: bytes of expert gradients the norm pass keeps instead of "
        "computing them twice (e.g. 2GiB; auto: CUDA's free memory less a margin; default 0)")  # fmt: skip
    add("--clip-scope", choices=("all", "dense"), default=None,
        help="gradients one global norm clips: all (every parameter; sonar: exact, one backward, the "
        "deferred schedule) or dense (sonar's in-backward default); default: the method's")  # fmt: skip
    add("--state-bits", type=int, choices=STATE_BITS, default=d.state_bits,
        help="adamw, adam: bits of expert moments (8, 4: torchao low-bit states)")  # fmt: skip
    add("--dense-state-bits", type=int, choices=STATE_BITS, default=d.dense_state_bits,
        help="adamw, adam: bits of dense moments (8, 4: torchao low-bit states)")  # fmt: skip
    add("--nonfinite", choices=NONFINITE, default=d.nonfinite,
        help="sonar: an inf/NaN gradient stops the run, skips the step, or is trained on")  # fmt: skip
    add("--parallel", choices=tuple(ENGINES), default=None,
        help="under torchrun (one node or several): data parallel with DDP, FSDP2 (fully_shard), expert "
        "parallelism (ep: experts E/world per rank) or FSDP2 x expert parallelism (fsdp2_ep: a (dp, ep) "
        "mesh, see --ep-size), with every optimizer flag and compiler; rank 0 logs and writes")  # fmt: skip
    add("--ep-size", type=_positive_int, default=None, metavar="N",
        help="--parallel fsdp2_ep: the expert-parallel degree, ranks that split each layer's experts "
        "(E/N per rank); the rest, world/N, is FSDP2's data-parallel degree over each expert shard. "
        "Must divide the world size and the experts (default: the world size, a 1 x world mesh; "
        "on 2 ranks each rank holds half the experts)")  # fmt: skip
    _add_run_flags(p, d)


def _add_run_flags(p: argparse.ArgumentParser, d: TrainConfig) -> None:
    add = p.add_argument
    add("--seed", type=int, default=d.seed, help="model init, split and batch order")
    add(
        "--eval-every",
        type=int,
        default=d.eval_every,
        help="evaluate every N steps (0: first/last)",
    )
    add("--held-out", type=int, default=None, help="held-out examples (default 500; 0: no evaluation)")
    add(
        "--train-size",
        type=int,
        default=None,
        help="default: 8000 built-in, all for a file",
    )
    add("--dtype", choices=tuple(DTYPES), default=None, help="default: bf16 on CUDA, fp32 on CPU")
    add("--device", default=None, help="default: cuda when available, else cpu")
    add("--out", default=d.out, help="folder for metrics.jsonl, summary.json, checkpoint.pt (a fresh run "
        "refuses a folder that holds a run)")  # fmt: skip
    add("--overwrite", action="store_true", help="a fresh run replaces the run already in --out")
    add("--resume", nargs="?", const="auto", default=None, metavar="CHECKPOINT",
        help="continue from a checkpoint file or run folder (no value: the one in --out)")  # fmt: skip
    add("--save-every", type=int, default=None,
        help="checkpoint every N steps (default: every 10%% of the steps; 0: only at the end)")  # fmt: skip
    add(
        "--stop-after",
        type=int,
        default=None,
        help="stop with a checkpoint after N steps",
    )
    add("--no-checkpoint", dest="checkpoint", action="store_false", help="write no checkpoint.pt")
    add("--pad-to-max-len", action=argparse.BooleanOptionalAction, default=None,
        help="pad batches to --max-len (default: when compiled, so one graph serves every step)")  # fmt: skip
    add("--deterministic", action="store_true",
        help="deterministic kernels, so compiled runs reproduce bitwise")  # fmt: skip
    add("--no-progress", dest="progress", action="store_false", help="no progress bar")


def train_config(args: argparse.Namespace) -> TrainConfig:
    """The `TrainConfig` of parsed `finetune` flags."""
    fields = {k: v for k, v in vars(args).items() if k in TrainConfig.__dataclass_fields__}
    fields["betas"] = tuple(args.betas)
    fields["model_overrides"] = dict(_override(item) for item in args.model_override)
    try:
        fields["execution"] = Execution(compiler=args.compiler, sonar_pass=args.sonar_pass)
    except ConfigFieldError as exc:
        raise field_error(exc) from exc
    return TrainConfig(**fields)


def _finetune(args: argparse.Namespace) -> int:
    plan = plan_run(train_config(args))
    if plan.nothing_to_do:
        print(f"{plan.out}: {plan.nothing_to_do}; nothing to do (its files are left as they are)")
        return 0
    result = run_plan(plan, handle_signals=True)
    summary, outcome = result.summary, result.outcome
    if not plan.parallel.writer:  # rank 0 speaks for the run
        return EXIT_SIGNAL_BASE + outcome.signum if outcome.signum is not None else 0
    if outcome.signum is not None:
        print(
            f"stopped by {outcome.stopped_by} after step {outcome.steps_done}"
            + (f"; checkpoint saved in {plan.out}: continue with --resume" if plan.cfg.checkpoint else
               " (--no-checkpoint: nothing to resume from)"),
            file=sys.stderr,
        )  # fmt: skip
        return EXIT_SIGNAL_BASE + outcome.signum
    ranks = summary["world_size"]
    plural = "s" * (ranks != 1)
    world = f" on {ranks} rank{plural} ({plan.cfg.parallel})" if plan.cfg.parallel is not None else ""
    print(
        f"done: {summary['steps_done']} steps{world}; "
        f"held-out loss {_fmt(summary['held_out_loss_initial'])} -> "
        f"{_fmt(summary['held_out_loss'])}; median step {_fmt(summary['median_step_ms'], '.1f')} ms; "
        f"{_fmt(summary['supervised_tokens_per_s'], '.0f')} supervised tokens/s; "
        f"{_memory_line(summary)}; written to {summary['config']['out']}"
    )
    return 0


def _inspect(args: argparse.Namespace) -> int:
    """`sonar-fx inspect`: print what discovery finds; exit 2 for a model it cannot build or without
    experts."""
    from sonar_fx.models.families import build_for_inspect

    try:
        model = build_for_inspect(args.model)
    except ValueError as err:
        _error(args, str(err))
        return EXIT_BAD_INPUT
    report = discovery_report(model, expert_biases=args.expert_biases)
    print(report_json(report) if args.json else format_report(report))
    return 0 if report["found"] else EXIT_BAD_INPUT


def _memory_line(summary: dict[str, Any]) -> str:
    """The summary's memory figures, each named for what it measures."""
    mem, mib = summary["memory"], 2**20
    if "cuda_max_allocated_bytes" in mem:
        line = f"CUDA allocated high-water {_fmt(mem['cuda_max_allocated_bytes'] / mib, '.1f')} MiB"
    else:
        peak = mem.get("peak_bytes")
        line = f"step peak (state + step transient) {_fmt(peak and peak / mib, '.1f')} MiB"
    grads = (summary.get("sonar") or {}).get("expert_grad_bytes") or {}
    if grads.get("measured_peak") is not None:
        line += (
            f"; expert gradients alive at once {grads['measured_peak'] / mib:.2f} MiB (one layer "
            f"{grads['one_layer'] / mib:.2f}, all layers {grads['all_layers'] / mib:.2f})"
        )
    return line


def _demo(args: argparse.Namespace) -> int:
    from sonar_fx.demo import DemoConfig, run_demo

    fields: dict[str, Any] = {"out": args.out, "compiler": args.compiler, "progress": not args.no_progress}
    if args.steps is not None:
        fields["steps"] = args.steps
    return run_demo(DemoConfig(**fields))


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def _optional_float(text: str) -> float | None:
    if text.lower() in ("none", "off", "inf"):
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'none', got {text!r}") from None


def _keep_budget(text: str) -> int | str:
    if text in ("auto", "0"):
        return 0 if text == "0" else text
    try:
        return parse_bytes(text)
    except PlanError:
        raise argparse.ArgumentTypeError(
            f"expected a size (2GiB, 500MB, bytes), 0 or auto, got {text!r}"
        ) from None


def _expert_clip(text: str) -> str | None:
    choices = tuple(c or "none" for c in EXPERT_CLIPS)
    if text not in choices:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(choices)}, got {text!r}")
    return None if text == "none" else text


def _override(item: str) -> tuple[str, Any]:
    key, sep, raw = item.partition("=")
    if not sep or not key:
        raise ConfigError(
            f"--model-override {item!r}: expected KEY=VALUE, e.g. num_experts=64", flag="--model-override"
        )
    try:
        return key, json.loads(raw)  # numbers, booleans, null; anything else stays a string
    except json.JSONDecodeError:
        return key, raw


def _fmt(value: float | None, spec: str = ".4f") -> str:
    return "n/a" if value is None else format(value, spec)
