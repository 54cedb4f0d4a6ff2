"""Options an optimizer config does not have, refused naming what to do instead.

A torch optimizer's keyword (`maximize=`, `amsgrad=`, `foreach=`, ...) passed to a Sonar config would
otherwise stop at the dataclass's bare "unexpected keyword argument", which says neither that Sonar
computes no such variant nor what to use. `refuse_unknown_options` runs before a config is built
(`_OptimizerConfig.__new__`), so nothing is half-made. It only checks; it imports nothing of the
project but the errors.
"""

from __future__ import annotations

import difflib
from collections.abc import Collection, Mapping

from sonar_fx.errors import UnsupportedOptionError

_FUSED = (
    "Sonar always runs torch's fused kernel (bitwise torch.optim.AdamW/Adam/SGD(fused=True); CPU bf16 SGD "
    "takes foreach SGD, since the fused kernel leaves those unchanged): drop the option"
)
ALTERNATIVES: dict[str, str] = {
    "maximize": "Sonar minimizes the loss; to maximize an objective, minimize its negative (-objective)",
    "amsgrad": (
        "Sonar does not compute AMSGrad (no running max of the second moments); train with plain "
        "torch.optim.AdamW(amsgrad=True) and no Sonar (the 'standard' method)"
    ),
    "foreach": _FUSED,
    "fused": _FUSED,
    "capturable": (
        "Sonar's expert update runs from Python inside backward, outside any captured CUDA graph: drop it"
    ),
    "differentiable": (
        "Sonar's updates run under no_grad and cannot be differentiated through: use torch's optimizer"
    ),
    "decoupled_weight_decay": (
        "pick the config instead: AdamWConfig decays decoupled (True), AdamConfig adds L2 decay (False)"
    ),
    "grad_scaler": "pass a torch.amp.GradScaler to the loop, as with torch's optimizers (scaler.step(opt))",
}
"""torch optimizer keywords no Sonar config takes -> what to do instead."""

_BY_CONFIG: dict[tuple[str, str], str] = {
    ("AdamWConfig", "momentum"): "Adam's momentum is betas[0]",
    ("AdamConfig", "momentum"): "Adam's momentum is betas[0]",
    ("LionConfig", "momentum"): "Lion's momentum is betas[1] (betas[0] interpolates the update)",
    ("MuonConfig", "betas"): "Muon's momentum is `momentum`; the AdamW half's are `adamw_betas`",
    ("SGDConfig", "betas"): "SGD's momentum is `momentum` (with `dampening`, `nesterov`)",
}
"""Options that exist in a neighbouring family, per config: where the same knob lives here."""


def refuse_unknown_options(config: str, fields: Collection[str], given: Mapping[str, object]) -> None:
    """Raise `UnsupportedOptionError` naming the first keyword in `given` that `config` (a class name)
    has no field for, and the alternative; nothing when every keyword is a field."""
    unknown = [k for k in given if k not in fields]
    if not unknown:
        return
    name = unknown[0]
    instead = _BY_CONFIG.get((config, name)) or ALTERNATIVES.get(name)
    if instead is None:
        close = difflib.get_close_matches(name, sorted(fields), n=1)
        instead = (
            f"did you mean {close[0]}=? " if close else ""
        ) + f"its options are {', '.join(sorted(fields))}"
    raise UnsupportedOptionError(f"{config}({name}=...) is not supported by Sonar: {instead}.", option=name)
