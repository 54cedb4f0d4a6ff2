"""Validation of a `TrainConfig`: the one place where a run's flags are checked and resolved.

For: every check of a flag's value (ranges, device, seed, the optimizer's hyper-parameters, model
overrides: known keys, value types and sizes) and the resolution of the None fields, raising
`ConfigError` with the flag named and the fix. Errors of the objects a config builds (`AdamWConfig`,
`Execution`) carry their field (`ConfigFieldError.field`), which `flag_of` turns into the flag: no
message is ever parsed. Never: read data, write files or train.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sonar_fx import api
from sonar_fx.config import OPTIMIZER_CONFIGS, ConfigFieldError, ExpertClip, OptimizerConfig
from sonar_fx.engines import ENGINES, engine_named
from sonar_fx.methods import METHODS, Method
from sonar_fx.models import TINY_MODELS, build_model
from sonar_fx.optim.optimizer import NONFINITE
from sonar_fx.trainer.config import DTYPES, ConfigError, TrainConfig, flag_of

SEED_RANGE = (-(2**63), 2**64)  # what torch.manual_seed accepts
_SIZE_KEY = re.compile(r"^num_|_size$|_dim$|^top_k$|_per_tok$|^max_position_embeddings$")
"""Override keys that are counts or sizes: they must be >= 1."""
_TOP_K = (("top_k", "num_experts"), ("num_experts_per_tok", "num_experts"),
          ("num_experts_per_tok", "num_local_experts"))  # fmt: skip


def field_error(exc: ConfigFieldError) -> ConfigError:
    """A `ConfigFieldError` of an object built from flags, as a `ConfigError` naming the flag."""
    flag = flag_of(exc.field)
    return ConfigError(f"{flag}: {exc}", flag=flag)


def check_flags(cfg: TrainConfig) -> None:
    """Range checks of single flags, in the order the flags read; raises the first failure."""
    checks = [
        (cfg.method in METHODS, "method", f"one of {', '.join(METHODS)}"),
        (cfg.nonfinite in NONFINITE, "nonfinite", f"one of {', '.join(NONFINITE)}"),
        (cfg.nonfinite == "raise" or _is_sonar(cfg.method), "nonfinite", "'raise' for a baseline"),
        (cfg.dtype in (None, *DTYPES), "dtype", f"one of {', '.join(DTYPES)}"),
        (cfg.steps is None or cfg.steps >= 1, "steps", ">= 1"),
        (cfg.batch_size >= 1, "batch_size", ">= 1"),
        (cfg.grad_accum >= 1, "grad_accum", ">= 1"),
        (cfg.clip_scope in (None, "all", "dense"), "clip_scope", "'all' or 'dense'"),
        (cfg.max_len >= 2, "max_len", ">= 2"),
        (cfg.warmup is None or cfg.warmup >= 0, "warmup", ">= 0"),
        (cfg.min_lr >= 0 and math.isfinite(cfg.min_lr), "min_lr", "a finite number >= 0"),
        (SEED_RANGE[0] <= cfg.seed < SEED_RANGE[1], "seed", "an integer in [-2**63, 2**64)"),
        (cfg.eval_every >= 0, "eval_every", ">= 0"),
        (cfg.held_out is None or cfg.held_out >= 0, "held_out", ">= 0"),
        (cfg.train_size is None or cfg.train_size >= 1, "train_size", ">= 1"),
        (cfg.save_every is None or cfg.save_every >= 0, "save_every", ">= 0"),
        (cfg.stop_after is None or cfg.stop_after >= 1, "stop_after", ">= 1"),
    ]
    for ok, name, expected in checks:
        if not ok:
            flag = flag_of(name)
            raise ConfigError(f"{flag} {getattr(cfg, name)!r} is invalid: expected {expected}", flag=flag)
    if cfg.lr is not None:
        optimizer_config(
            cfg, cfg.lr
        )  # --lr is checked by the optimizer config, before --min-lr compares to it
    check_device(cfg.device)
    if cfg.overwrite and cfg.resume is not None:
        resumed = Path(cfg.out if cfg.resume == "auto" else cfg.resume).resolve()
        if resumed == Path(cfg.out).resolve() or Path(cfg.out).resolve() in resumed.parents:
            raise ConfigError(
                "--overwrite replaces the run in --out, --resume continues it: pass one of them",
                flag="--overwrite",
            )


def check_device(device: str | None) -> None:
    """cpu, cuda or cuda:N (N a visible device); None picks one."""
    if device is None:
        return
    try:
        kind = torch.device(device)
    except (RuntimeError, ValueError):
        kind = None
    if kind is None or kind.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device {device!r} is invalid: expected cpu, cuda or cuda:N", flag="--device")
    if kind.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                f"--device {device}: CUDA is not available here; use --device cpu", flag="--device"
            )
        if kind.index is not None and kind.index >= torch.cuda.device_count():
            raise ConfigError(
                f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) here", flag="--device"
            )


def optimizer_config(cfg: TrainConfig, lr: float) -> OptimizerConfig:
    """The optimizer config of a run (`--optimizer` and its hyper-parameters); a bad value, or one
    the optimizer or method cannot honour, is blamed on its own flag."""
    kind = OPTIMIZER_CONFIGS.get(cfg.optimizer)
    if kind is None:
        raise ConfigError(
            f"--optimizer {cfg.optimizer!r} is invalid: expected one of {', '.join(OPTIMIZER_CONFIGS)}",
            flag="--optimizer",
        )
    fields: dict[str, Any] = dict(
        lr=lr,
        weight_decay=resolved_weight_decay(cfg),
        max_grad_norm=cfg.max_grad_norm,
        expert_clip=cfg.expert_clip,
        keep_budget=cfg.keep_budget,
    )
    momentum, nesterov = resolved_momentum(cfg)
    by_optimizer: dict[str, dict[str, Any]] = {
        "adamw": dict(
            betas=cfg.betas, eps=cfg.eps, state_bits=cfg.state_bits, dense_state_bits=cfg.dense_state_bits
        ),
        "adam": dict(
            betas=cfg.betas, eps=cfg.eps, state_bits=cfg.state_bits, dense_state_bits=cfg.dense_state_bits
        ),
        "sgd": dict(momentum=momentum, dampening=cfg.dampening, nesterov=nesterov),
        "lion": dict(betas=cfg.betas),
        "muon": dict(
            momentum=momentum,
            nesterov=nesterov,
            adjust_lr_fn=cfg.adjust_lr_fn,
            adamw_betas=cfg.betas,
            adamw_eps=cfg.eps,
        ),
    }
    extra = by_optimizer[cfg.optimizer]
    _refuse_unused(cfg, {name.removeprefix("adamw_") for name in extra})
    try:
        opt_cfg = kind(**fields, **extra)
        method = Method.named(cfg.method)
        method.check_clip(opt_cfg)
        # What the --parallel engine is verified with (the one rule, `sonar_fx.api.distributed_gap`).
        engine_named(cfg.parallel).check_optimizer(opt_cfg, method.schedule)
    except ConfigFieldError as exc:
        if exc.field == "schedule":
            raise _deferred_refused(cfg, exc) from exc
        raise field_error(exc) from exc
    if cfg.state_bits != 32 or cfg.dense_state_bits != 32:
        _check_torchao("--state-bits" if cfg.state_bits != 32 else "--dense-state-bits")
    return opt_cfg


def _deferred_refused(cfg: TrainConfig, exc: ConfigFieldError) -> ConfigError:
    """The deferred schedule refused on the --parallel engine, blamed on the flag that chose it, with the
    runs the command line offers instead."""
    flag = "--grad-accum" if cfg.grad_accum > 1 else "--clip-scope" if cfg.clip_scope == "all" else "--method"
    running = [e for e in ENGINES if e in api.DEFERRED_ENGINES]  # read at the call: the rule's now
    elsewhere = f"--parallel {' or '.join(running)} with the same flags; or " if running else ""
    return ConfigError(
        f"{flag}: --parallel {cfg.parallel} with --method {cfg.method} (the deferred schedule, which "
        f"--grad-accum > 1 and --clip-scope all choose for sonar): {exc}. On the command line: {elsewhere}"
        f"on {cfg.parallel}, --method sonar with --grad-accum 1 and --clip-scope dense (in-backward "
        "updates), or --method standard with the same flags (no saving)",
        flag=flag,
    )


def resolved_momentum(cfg: TrainConfig) -> tuple[float, bool]:
    """--momentum and --nesterov, or the optimizer's defaults for them (Muon: 0.95 and Nesterov;
    otherwise 0.0 and no Nesterov, SGD's)."""
    muon = cfg.optimizer == "muon"
    momentum = cfg.momentum if cfg.momentum is not None else (0.95 if muon else 0.0)
    nesterov = cfg.nesterov if cfg.nesterov is not None else muon
    return momentum, nesterov


def resolved_weight_decay(cfg: TrainConfig) -> float:
    """--weight-decay, or its default: 0.1 for Muon (torch.optim.Muon's), 0.0 for the others."""
    if cfg.weight_decay is not None:
        return cfg.weight_decay
    return 0.1 if cfg.optimizer == "muon" else 0.0


def _check_keep_budget(cfg: TrainConfig, device: str) -> None:
    """--keep-budget only where the deferred schedule's norm pass can honour it (one process; "auto" on
    CUDA), checked once the method is resolved."""
    if cfg.keep_budget == 0:
        return
    why = None
    if Method.named(cfg.method).schedule != "deferred":
        why = f"it is the deferred schedule's (--clip-scope all, --grad-accum N), not --method {cfg.method}'s"
    elif cfg.parallel is not None:
        why = f"not under --parallel {cfg.parallel} (ranks cross over differently); drop it there"
    elif cfg.keep_budget == "auto" and not device.startswith("cuda"):
        why = "'auto' reads the CUDA caching allocator's free memory; on this device give bytes (or 0)"
    if why is not None:
        raise ConfigError(f"--keep-budget {cfg.keep_budget}: {why}", flag="--keep-budget")


def _refuse_unused(cfg: TrainConfig, used: set[str]) -> None:
    """A flag the chosen optimizer has no use for is refused, not silently dropped."""
    defaults = TrainConfig()
    # What "not given" looks like: the default, or what `resolve` makes of it (0.0 and False, as before).
    unset = {"momentum": (None, 0.0), "nesterov": (None, False)}
    names = (
        "betas",
        "eps",
        "momentum",
        "dampening",
        "nesterov",
        "state_bits",
        "dense_state_bits",
        "adjust_lr_fn",
    )
    for name in names:
        if name not in used and getattr(cfg, name) not in unset.get(name, (getattr(defaults, name),)):
            flag = flag_of(name)
            raise ConfigError(
                f"{flag} does not apply to --optimizer {cfg.optimizer} (betas are Adam(W)'s, Lion's and "
                "Muon's AdamW half's, eps Adam(W)'s and Muon's AdamW half's, state bits Adam(W)'s, "
                "momentum and nesterov SGD's and Muon's, dampening SGD's, adjust-lr-fn Muon's); drop it or "
                "pick the optimizer it belongs to",
                flag=flag,
            )


def _check_torchao(flag: str) -> None:
    try:
        import torchao.optim  # noqa: F401
    except ImportError as exc:
        raise ConfigError(
            f"{flag} needs torchao's low-bit optimizer states, which cannot be imported here ({exc}); "
            f"pip install torchao (with --no-deps if pip would replace torch), or use {flag} 32",
            flag=flag,
        ) from exc


def check_overrides(model: str, overrides: Mapping[str, Any]) -> None:
    """Refuse override keys the model's config does not have, values of the wrong type, sizes < 1 and
    a top-k above the expert count, naming the key."""
    if not overrides:
        return
    if model not in TINY_MODELS:
        raise ConfigError(
            "--model-override applies to built-in tiny models only; drop it for a checkpoint",
            flag="--model-override",
        )
    cls, extra = _config_class(model)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    aliases: dict[str, str] = dict(getattr(cls, "attribute_map", {}))
    for key, value in overrides.items():
        name = aliases.get(key, key)
        if name not in fields:
            close = difflib.get_close_matches(key, [*fields, *aliases], n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            raise ConfigError(
                f"--model-override {key}: {model}'s config ({cls.__name__}) has no field {key!r}; {hint}"
                f"known fields include {', '.join(sorted(n for n in fields if _SIZE_KEY.search(n)))}",
                flag="--model-override",
            )
        _check_override_value(key, value, fields[name].default)
    try:
        built = cls(**{**extra, **overrides})
    except Exception as exc:  # the config class's own validation; re-raised naming the flag
        raise ConfigError(
            f"--model-override: {model}'s config refuses these values ({type(exc).__name__}: {exc})",
            flag="--model-override",
        ) from exc
    for k, n in _TOP_K:
        top_k, experts = getattr(built, k, None), getattr(built, n, None)
        if isinstance(top_k, int) and isinstance(experts, int) and top_k > experts:
            raise ConfigError(
                f"--model-override: {k}={top_k} routes each token to more experts than {n}={experts}",
                flag="--model-override",
            )


def _check_override_value(key: str, value: Any, default: Any) -> None:
    kind = type(default)
    ok = True
    if default is None or default is dataclasses.MISSING:
        return  # no default to learn the type from: the config class validates it
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif kind is str:
        ok = isinstance(value, str)
    if not ok:
        raise ConfigError(
            f"--model-override {key}={value!r}: expected {kind.__name__} (like the default {default!r})",
            flag="--model-override",
        )
    if kind is int and _SIZE_KEY.search(key) and value < 1:
        raise ConfigError(
            f"--model-override {key}={value}: a count or size, expected >= 1", flag="--model-override"
        )


def _config_class(model: str) -> tuple[type, dict[str, Any]]:
    cls_name, extra = TINY_MODELS[model]
    if cls_name == "ReferenceMoEConfig":
        from sonar_fx.models.reference import ReferenceMoEConfig

        return ReferenceMoEConfig, dict(extra)
    import transformers

    return getattr(transformers, cls_name), dict(extra)


def build_checked_model(cfg: TrainConfig) -> nn.Module:
    """The run's model (seeded init); a model that cannot be built from the overrides names the flag."""
    assert cfg.dtype is not None
    try:
        return build_model(cfg.model, dtype=DTYPES[cfg.dtype], seed=cfg.seed, **cfg.model_overrides)
    except (TypeError, ValueError, RuntimeError) as exc:
        if not cfg.model_overrides:
            raise
        raise ConfigError(
            f"--model-override: {cfg.model} cannot be built with {dict(cfg.model_overrides)} "
            f"({type(exc).__name__}: {exc})",
            flag="--model-override",
        ) from exc


def resolve(
    cfg: TrainConfig, *, local: bool, n_train: int, n_held_out: int
) -> tuple[TrainConfig, OptimizerConfig]:
    """The config with every None field resolved (see `TrainConfig`), and its optimizer config."""
    per_step = cfg.batch_size * cfg.grad_accum
    if n_train < per_step:
        raise ConfigError(
            f"only {n_train} training examples for --batch-size {cfg.batch_size} x --grad-accum "
            f"{cfg.grad_accum}; lower them or add data (--train-size, --data)",
            flag="--batch-size",
        )
    cfg = resolve_schedule(cfg)
    device = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
    _check_keep_budget(cfg, device)
    steps = cfg.steps or n_train // per_step
    lr = cfg.lr if cfg.lr is not None else (2e-5 if local else 3e-3)
    opt_cfg = optimizer_config(cfg, lr)
    if cfg.min_lr > lr:
        raise ConfigError(
            f"--min-lr {cfg.min_lr} is above --lr {lr}: the cosine decays down to --min-lr", flag="--min-lr"
        )
    momentum, nesterov = resolved_momentum(cfg)
    resolved = dataclasses.replace(
        cfg,
        momentum=momentum,
        nesterov=nesterov,
        weight_decay=resolved_weight_decay(cfg),
        device=device,
        steps=steps,
        lr=lr,
        warmup=cfg.warmup if cfg.warmup is not None else math.ceil(0.03 * steps),
        dtype=cfg.dtype or ("bf16" if device.startswith("cuda") else "fp32"),
        train_size=n_train,
        held_out=n_held_out,
        save_every=cfg.save_every if cfg.save_every is not None else math.ceil(steps / 10),
        pad_to_max_len=cfg.pad_to_max_len if cfg.pad_to_max_len is not None else cfg.execution.compiled,
    )
    return resolved, opt_cfg


def resolve_schedule(cfg: TrainConfig) -> TrainConfig:
    """`--clip-scope` and `--grad-accum` resolved into the method and `expert_clip` they need: sonar with
    an all-parameter clip or accumulation trains with the deferred schedule (method sonar_deferred,
    exact); a baseline must already clip as the scope says. Contradictions are refused by flag."""
    method, expert_clip = cfg.method, cfg.expert_clip
    sonar = _is_sonar(method)
    if cfg.clip_scope is not None:
        wanted: tuple[ExpertClip, ...] = {"all": ("global",), "dense": (None,)}[cfg.clip_scope]
        if sonar and expert_clip not in (None, *wanted):
            raise ConfigError(
                f"--clip-scope {cfg.clip_scope} contradicts --expert-clip {expert_clip}: pass one of them",
                flag="--clip-scope",
            )
        if sonar:
            expert_clip = wanted[0]
        elif method in METHODS and Method.named(method).clip != cfg.clip_scope:
            fits = [
                m for m in ("standard", "standard_no_expert_clip") if Method.named(m).clip == cfg.clip_scope
            ]
            raise ConfigError(
                f"--clip-scope {cfg.clip_scope}: --method {method} clips {Method.named(method).clip} "
                f"gradients; for this scope use --method {fits[0]}",
                flag="--clip-scope",
            )
    end_of_step = cfg.grad_accum > 1 or (cfg.clip_scope == "all" and cfg.max_grad_norm is not None)
    if sonar and end_of_step:
        if method not in ("sonar", "sonar_deferred"):
            raise ConfigError(
                f"--method {method} updates experts inside backward: --grad-accum > 1 and --clip-scope all "
                "need the deferred schedule (--method sonar)",
                flag="--grad-accum" if cfg.grad_accum > 1 else "--clip-scope",
            )
        method = "sonar_deferred"
    if cfg.grad_accum > 1 and method == "oib_all":
        raise ConfigError(
            "--method oib_all updates every tensor inside backward: it cannot accumulate (--grad-accum 1)",
            flag="--grad-accum",
        )
    return dataclasses.replace(cfg, method=method, expert_clip=expert_clip)


def _is_sonar(method: str) -> bool:
    return method in METHODS and Method.named(method).sonar
