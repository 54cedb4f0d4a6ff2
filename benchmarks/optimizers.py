"""Question: what do Sonar's optimizers, expert clipping modes, logged norms and low-bit states cost?

For each element-wise optimizer (AdamW, Adam, SGD with momentum, Lion): Sonar against its exact twin
(standard training clipping the dense gradients only): step time and the step's transient memory.
For the clipping modes (AdamW): expert_clip=None / "per_tensor" / "global" against standard training
with global clipping, whose exact twin is "global" (two backward passes instead of holding every
expert gradient). The cost of logging each expert gradient's norm (taken inside the update) against
the same run with the norms off. Low-bit expert states (torchao, 8 and 4 bits): the bytes of the
expert optimizer states and the step time. All arms of a table run round-robin in one process, so
every time ratio pairs steps taken under the same load; memory is measured once per arm. The cost of
the non-finite check (`nonfinite="raise"`, the default) against the same run with `nonfinite="ignore"`.
Muon (`muon` table): the optimizer state and the step's transient memory against AdamW, and the step time
of Sonar's in-backward Muon against the same batched Muon run at `step()` with every expert gradient kept
(and against torch.optim.Muon per expert matrix at `step()`, the twin). `--only` picks tables.
Arms are measured by `sonar_fx.measure` (interleaved rounds, paired ratios).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import torch
from torch.utils.benchmark import timer

from benchmarks import common
from benchmarks.common import Goal, Output, Table, goal, mib
from sonar_fx.config import AdamConfig, AdamWConfig, LionConfig, MuonConfig, OptimizerConfig, SGDConfig
from sonar_fx.experts.discovery import discover_experts
from sonar_fx.measure import ArmResult, Spread, fmt_ratio, measure_arm, ratio, run_rounds, side_by_side
from sonar_fx.methods import Method, TrainingMethod, build_method
from sonar_fx.models import build_model
from sonar_fx.optim.adamw import nonfinite_flag
from sonar_fx.optim.lowbit import is_lowbit
from sonar_fx.optim.matrices import matrix_params
from sonar_fx.optim.norms import tensor_norm
from sonar_fx.optim.optimizer import SonarOptimizer
from sonar_fx.optim.rules import MuonRule, end_of_step_optimizer
from sonar_fx.workload import random_batches

SCRIPT = "optimizers"
TABLES = ("optimizers", "clipping", "lowbit", "muon")


@dataclass(frozen=True, kw_only=True)
class Config:
    """One run of this script."""

    model: str = "tiny-olmoe"
    overrides: dict[str, Any] = field(
        default_factory=lambda: dict(
            hidden_size=256, intermediate_size=256, num_experts=32, num_hidden_layers=4
        )
    )
    """A CPU-sized OLMoE: experts hold most of the parameters, as in the real model (93%)."""
    batch: int = 2
    seq: int = 64
    """Few tokens, as in the paper's runs (batch 2): expert gradients, not activations, dominate."""
    warmup: int = 2
    rounds: int = 10
    compiler: str = "eager"
    """"eager" (hooks) or "aot_eager" (the compiled pass)."""
    lowbit: bool = True
    """Include the torchao low-bit arms (skipped with a note when torchao is missing)."""
    muon_overrides: dict[str, Any] = field(
        default_factory=lambda: dict(
            hidden_size=64, intermediate_size=128, num_experts=32, num_hidden_layers=4
        )
    )
    """The Muon table's model: narrower than `overrides`, because Muon's Newton-Schulz runs in bf16 (as
    torch.optim.Muon's does) and bf16 GEMMs on a CPU without native bf16 instructions are slow (one
    256 x 512 matrix: ~1 s on 2 cores). Experts hold 97% of its parameters."""
    only: tuple[str, ...] = TABLES
    """Which tables to measure (`--only`); a run of some of them writes results/optimizers_<names>/."""


TINY = dict(hidden_size=32, intermediate_size=32, num_experts=4, num_hidden_layers=2)
QUICK = Config(overrides=TINY, muon_overrides=TINY, seq=16, warmup=1, rounds=2)
"""A smoke run: every arm of every table on a tiny model, two timed rounds."""
LR = 1e-3
OPTIMIZERS: dict[str, OptimizerConfig] = {
    "adamw": AdamWConfig(lr=LR),
    "adam": AdamConfig(lr=LR),
    "sgd": SGDConfig(lr=LR, momentum=0.9),
    "lion": LionConfig(lr=LR),
}
MUON = MuonConfig(lr=LR)


@dataclass(kw_only=True)
class Arm(ArmResult):
    """One trained setup: how to build it, and what it measured."""

    build: Callable[[], TrainingMethod]
    expert_state_bytes: int = 0
    state_bytes: int = 0
    """Every optimizer state tensor of the arm (dense and experts)."""
    method: TrainingMethod | None = None


def _arm(
    label: str,
    method: str,
    cfg: OptimizerConfig,
    run: Config,
    *,
    norms: bool = True,
    nonfinite: str = "raise",
    overrides: dict[str, Any] | None = None,
) -> Arm:
    def build() -> TrainingMethod:
        model = build_model(run.model, seed=0, **(run.overrides if overrides is None else overrides))
        extra: dict[str, Any] = {"nonfinite": nonfinite} if Method.named(method).sonar else {}
        m = build_method(method, model, cfg, compiler=run.compiler, **extra)
        if isinstance(m.optimizer, SonarOptimizer):
            m.optimizer.clipper.track_norms = norms
        return m

    return Arm(label=label, build=build)


def _expert_state_bytes(method: TrainingMethod) -> int:
    """Bytes of the optimizer states of the expert tensors (a quantized state counts its parts)."""
    opt = method.optimizer
    if not isinstance(opt, SonarOptimizer):
        return 0
    total = 0
    for p in opt.expert_group["params"]:
        for v in opt.state[p].values():
            if is_lowbit(v):
                names, _ = v.__tensor_flatten__()
                total += sum(getattr(v, n).numel() * getattr(v, n).element_size() for n in names)
            elif isinstance(v, torch.Tensor):
                total += v.numel() * v.element_size()
    return total


def _state_bytes(method: TrainingMethod) -> int:
    """Bytes of every optimizer state tensor of `method` (plain tensors; each counted once)."""
    tensors = {id(v): v for opt in method.optimizers for st in opt.state.values() for v in st.values()
               if isinstance(v, torch.Tensor) and not is_lowbit(v)}  # fmt: skip
    return sum(t.numel() * t.element_size() for t in tensors.values())


def run_arms(arms: Sequence[Arm], run: Config) -> None:
    """Build and warm each arm up, measure its step memory once, then time the arms in interleaved
    rounds (`sonar_fx.measure`); every arm stays alive throughout."""
    data = random_batches(run.warmup + 1 + run.rounds, batch=run.batch, seq=run.seq, seed=0)
    steps = []
    torch._dynamo.reset()
    with side_by_side():
        for arm in arms:
            arm.method = arm.build()
            step = partial(_synced_step, arm.method)
            measure_arm(arm, step, data[: run.warmup], data[run.warmup])
            arm.expert_state_bytes = _expert_state_bytes(arm.method)
            arm.state_bytes = _state_bytes(arm.method)
            print(f"  {arm.label}: {arm.error or 'ready'}", flush=True)
            steps.append((arm, step))
        run_rounds(steps, data[run.warmup + 1 :])


def _synced_step(method: TrainingMethod, batch: dict[str, torch.Tensor]) -> float:
    return float(method.train_step(batch))  # reading the loss waits for the step


def _row(arm: Arm, base: Arm) -> list[str]:
    ms = arm.step_ms.fmt(1) if arm.ok else f"failed: {arm.error}"
    return [arm.label, ms, fmt_ratio(ratio(arm, base)), f"{mib(arm.peak_bytes):.1f}",
            f"{arm.peak_bytes / max(base.peak_bytes, 1):.2f}x"]  # fmt: skip


HEADERS = ["arm", "step ms [q25-q75]", "time vs base", "step transient MiB", "memory vs base"]


def optimizer_table(run: Config) -> tuple[Table, list[Arm]]:
    arms = []
    for name, cfg in OPTIMIZERS.items():
        arms += [_arm(f"{name}: standard_no_expert_clip", "standard_no_expert_clip", cfg, run),
                 _arm(f"{name}: sonar", "sonar", cfg, run)]  # fmt: skip
    run_arms(arms, run)
    rows = [_row(arm, arms[i - i % 2]) for i, arm in enumerate(arms)]
    note = "base: the same optimizer's standard_no_expert_clip (Sonar's exact twin)."
    return Table(title=f"Optimizers ({run.compiler})", headers=HEADERS, rows=rows, note=note), arms


def clipping_table(run: Config) -> tuple[Table, list[Arm]]:
    plain = AdamWConfig(lr=LR, max_grad_norm=1.0)
    arms = [
        _arm("standard (global clip)", "standard", plain, run),
        _arm("sonar expert_clip=None", "sonar", plain, run),
        _arm("sonar expert_clip=per_tensor", "sonar", replace(plain, expert_clip="per_tensor"), run),
        _arm("sonar expert_clip=global", "sonar", replace(plain, expert_clip="global"), run),
        _arm("sonar expert_clip=None, norms off", "sonar", plain, run, norms=False),
        _arm("sonar expert_clip=None, nonfinite=ignore", "sonar", plain, run, nonfinite="ignore"),
    ]
    run_arms(arms, run)
    rows = [_row(arm, arms[0]) for arm in arms]
    note = ("base: standard training clipping all gradients by one global norm (the exact twin of "
            "expert_clip='global'). 'norms off': no per-expert norm (nonfinite check: own pass); "
            "'nonfinite=ignore': no non-finite check.")  # fmt: skip
    return Table(title=f"Expert clipping, logged norms, AdamW ({run.compiler})", headers=HEADERS, rows=rows,
                 note=note), arms  # fmt: skip


def lowbit_table(run: Config) -> tuple[Table, list[Arm]] | None:
    try:
        import torchao.optim  # noqa: F401
    except ImportError:
        print("torchao is not installed: no low-bit arms (pip install torchao --no-deps)")
        return None
    arms = [_arm(f"sonar adamw, {bits}-bit expert states", "sonar", AdamWConfig(lr=LR, state_bits=bits), run)
            for bits in (32, 8, 4)]  # fmt: skip
    run_arms(arms, run)
    base = arms[0]
    rows = [[*_row(arm, base), f"{mib(arm.expert_state_bytes):.2f}",
             f"{arm.expert_state_bytes / base.expert_state_bytes:.3f}x"] for arm in arms]  # fmt: skip
    note = "Expert state MiB: exp_avg + exp_avg_sq (+ step) of the expert tensors; quantized codes + scales."
    return Table(title=f"Low-bit expert states ({run.compiler})", headers=[*HEADERS, "expert state MiB",
                 "state vs 32-bit"], rows=rows, note=note), arms  # fmt: skip


class RuleAtStep(torch.optim.Optimizer):
    """An end-of-step optimizer that runs an update rule on each tensor, one call per tensor as Sonar
    makes them in backward: Sonar's expert arithmetic with every expert gradient kept until step()."""

    def __init__(self, params: Sequence[torch.nn.Parameter], rule: MuonRule, cfg: MuonConfig) -> None:
        super().__init__(list(params), rule.defaults(cfg))
        self.rule = rule

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        group = self.param_groups[0]
        for p in group["params"]:
            if p.grad is not None:
                if not self.state[p]:
                    self.rule.init_state(p, self.state[p])
                self.rule.update_([p], [p.grad], [self.state[p]], group)


def _muon_at_step(run: Config) -> Arm:
    """Muon at step() with Sonar's batched expert update, and the same dense recipe as the twin."""

    def build() -> TrainingMethod:
        model = build_model(run.model, seed=0, **run.muon_overrides)
        method = build_method("standard_no_expert_clip", model, MUON, compiler=run.compiler)
        layers = discover_experts(model)
        experts = {id(t.param) for layer in layers for t in layer.tensors}
        params = [p for p in model.parameters() if p.requires_grad]
        dense = [p for p in params if id(p) not in experts]
        method.optimizer = end_of_step_optimizer(MUON, dense, matrices=matrix_params(MUON, model, layers))
        method.expert_optimizer = RuleAtStep([p for p in params if id(p) in experts], MuonRule(), MUON)
        return method

    return Arm(label="muon at step() (same batched math)", build=build)


def muon_table(run: Config) -> tuple[Table, list[Arm]]:
    shape = run.muon_overrides
    arms = [
        _arm("adamw: sonar", "sonar", AdamWConfig(lr=LR), run, overrides=shape),
        _arm("muon: sonar (in backward)", "sonar", MUON, run, overrides=shape),
        _muon_at_step(run),
        _arm("muon: torch.optim.Muon per matrix at step()", "standard_no_expert_clip", MUON, run,
             overrides=shape),
        _arm("muon: sonar, nonfinite=ignore", "sonar", MUON, run, overrides=shape, nonfinite="ignore"),
    ]  # fmt: skip
    run_arms(arms, run)
    adamw, at_step = arms[0], arms[2]
    rows = []
    for arm in arms:
        expert = f"{mib(arm.expert_state_bytes):.2f}" if arm.expert_state_bytes else "-"
        rows.append([arm.label, arm.step_ms.fmt(1) if arm.ok else f"failed: {arm.error}",
                     fmt_ratio(ratio(arm, at_step)), f"{mib(arm.peak_bytes):.2f}",
                     f"{arm.peak_bytes / max(adamw.peak_bytes, 1):.2f}x", f"{mib(arm.state_bytes):.2f}",
                     f"{arm.state_bytes / max(adamw.state_bytes, 1):.2f}x", expert])  # fmt: skip
    headers = ["arm", "step ms [q25-q75]", "time vs muon at step()", "step transient MiB",
               "transient vs adamw", "optimizer state MiB", "state vs adamw", "expert state MiB"]  # fmt: skip
    note = (f"Model: {run.model} with {shape}. Muon keeps one momentum buffer per matrix where AdamW "
            "keeps two moments (and a step); embeddings, head, routers and norms take AdamW in the Muon "
            "recipe. 'at step()': Sonar's batched expert update run by an end-of-step optimizer, every "
            "expert gradient kept; 'per matrix': torch.optim.Muon on each expert matrix as its own "
            "parameter (the twin); 'nonfinite=ignore': no device-side skip of a non-finite gradient (Muon "
            "has no fused kernel taking the flag: the guard swaps a skipped gradient for the momentum "
            "and zeroes the update on the device).")  # fmt: skip
    return Table(title=f"Muon ({run.compiler})", headers=headers, rows=rows, note=note), arms


def muon_goals(arms: list[Arm]) -> list[Goal]:
    adamw, sonar, at_step, _, unguarded = arms
    time, guard = ratio(sonar, at_step), ratio(sonar, unguarded)
    state = sonar.expert_state_bytes / max(adamw.expert_state_bytes, 1)
    memory = sonar.peak_bytes / max(at_step.peak_bytes, 1)
    return [
        goal("optimizers.muon_state", "Muon expert state", state, f"{state:.3f}x"),
        goal("optimizers.muon_time", "in-backward Muon time", time, fmt_ratio(time)),
        goal("optimizers.muon_memory", "in-backward Muon memory", memory, f"{memory:.2f}x"),
        goal("optimizers.muon_guard", "Muon non-finite guard cost", guard,
             f"raise/ignore step ratio {fmt_ratio(guard)}"),
    ]  # fmt: skip


def per_step_seconds(arm: Arm, fn: Callable[[torch.Tensor], torch.Tensor], repeats: int = 20) -> float:
    """Median seconds of `fn` over every expert gradient of one step (random values of each expert
    tensor's shape): the calls an update makes once per expert tensor."""
    assert isinstance(arm.method, TrainingMethod) and isinstance(arm.method.optimizer, SonarOptimizer)
    grads = [torch.randn_like(p) for p in arm.method.optimizer.expert_group["params"]]
    times = []
    for _ in range(repeats):
        started = timer()
        for g in grads:
            float(fn(g))
        times.append(timer() - started)
    return Spread.of(times).median


def goals(clip_arms: list[Arm], lowbit_arms: list[Arm] | None) -> list[Goal]:
    by = {a.label: a for a in clip_arms}
    on, off = by["sonar expert_clip=None"], by["sonar expert_clip=None, norms off"]
    unchecked = by["sonar expert_clip=None, nonfinite=ignore"]
    # The end-to-end ratio is within the noise of a shared CPU: the norms' own time is the measure.
    # With nonfinite="raise"/"skip" the norm also makes the non-finite check, replacing its own pass
    # (`nonfinite_flag`), so the net cost is the difference.
    step = Spread.of(on.step_s).median
    gross = per_step_seconds(on, tensor_norm) / step
    own_check = per_step_seconds(on, nonfinite_flag) / step
    net = gross - own_check
    end_to_end = ratio(on, off)
    checked = ratio(on, unchecked)
    glob, std = by["sonar expert_clip=global"], by["standard (global clip)"]
    memory = glob.peak_bytes / std.peak_bytes
    out = [
        goal("optimizers.norms", "logged norms cost", net,
             f"net {net * 100:.2f}% (norm calls {gross * 100:.2f}% minus the non-finite pass they "
             f"replace; on/off step ratio {fmt_ratio(end_to_end)})"),
        goal("optimizers.nonfinite", "non-finite check cost", checked,
             f"raise/ignore step ratio {fmt_ratio(checked)}; as its own aminmax pass (norms off) "
             f"{own_check * 100:.2f}% of a step"),
        goal("optimizers.global_clip_memory", "global clip memory", memory, f"{memory:.2f}x"),
    ]  # fmt: skip
    if lowbit_arms:
        shrink = lowbit_arms[1].expert_state_bytes / lowbit_arms[0].expert_state_bytes
        out.append(goal("optimizers.lowbit_8", "8-bit expert states", shrink, f"{shrink:.3f}x"))
    return out


def run(cfg: Config) -> Output:
    """The tables of `cfg.only`, measured in this order (low-bit before clipping: its goal needs both)."""
    measure = {"optimizers": optimizer_table, "lowbit": lowbit_table, "clipping": clipping_table,
               "muon": muon_table}  # fmt: skip
    found = {}
    for name in ("optimizers", "lowbit", "clipping", "muon"):
        if name in cfg.only and (cfg.lowbit or name != "lowbit") and (out := measure[name](cfg)) is not None:
            found[name] = out
    found_goals = []
    if "clipping" in found:
        found_goals += goals(found["clipping"][1], found["lowbit"][1] if "lowbit" in found else None)
    if "muon" in found:
        found_goals += muon_goals(found["muon"][1])
    shown = [name for name in TABLES if name in found]
    records = [{"arm": arm.label, "step_s": arm.step_s, "peak_bytes": arm.peak_bytes,
                "state_bytes": arm.state_bytes, "expert_state_bytes": arm.expert_state_bytes,
                "error": arm.error} for name in shown for arm in found[name][1]]  # fmt: skip
    partial_run = (
        None if tuple(cfg.only) == TABLES else "_".join((SCRIPT, *cfg.only))
    )  # never the full results
    return Output(tables=[found[n][0] for n in shown], goals=found_goals, records=records, script=partial_run)


def main(argv: Sequence[str] | None = None) -> None:
    overrides = [common.Override(field="compiler", choices=("eager", "aot_eager"), help="arms' compiler"),
                 common.Override(field="only", choices=TABLES, many=True,
                                 help="measure only these tables (results/optimizers_<names>/)")]  # fmt: skip
    common.main(SCRIPT, __doc__, argv, run=run, default=Config(), quick=QUICK, overrides=overrides)


if __name__ == "__main__":
    main()
