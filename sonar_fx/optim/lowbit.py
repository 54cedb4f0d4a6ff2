"""Low-bit (8-bit, 4-bit) Adam(W) states for expert tensors, through torchao (`pip install torchao`).

The update of one tensor is torchao's own: `torchao.optim.adam.single_param_adam`, compiled exactly as
`torchao.optim.AdamW8bit.step()` compiles and calls it, on states created the way torchao creates
them (block-quantized `OptimState8bit` / `OptimState4bit` for tensors of >= 4096 elements whose size
the block divides, plain tensors otherwise). So Sonar's in-backward update equals torchao's
optimizer run at the end of the step on the same gradient, bitwise. The LR reaches the compiled
function as a 0-d float32 tensor (as torchao keeps it), so LR schedules never recompile.
State dicts hold the quantized states as plain tensors (codes, scales, map), restored bitwise.
Never: import torchao before a config asks for low-bit states; change what torchao computes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from sonar_fx.errors import SonarUsageError
from sonar_fx.optim.adamw import grad_like_param
from sonar_fx.optim.update_rule import State, UpdateRule

BLOCK_SIZE = {8: 256, 4: 128}
"""torchao's default block size per state width (AdamW8bit / AdamW4bit)."""
MIN_QUANTIZED = 4096
"""torchao (following bitsandbytes) quantizes only tensors with at least this many elements."""
LOWBIT_KEY = "__sonar_lowbit__"


def torchao_optim() -> Any:
    """`torchao.optim`, or an ImportError that says how to install it."""
    try:
        import torchao.optim
    except ImportError as exc:
        raise ImportError(
            "state_bits=8 or 4 uses torchao's low-bit optimizer states: pip install torchao (install it "
            "with --no-deps if pip would otherwise replace your torch build)."
        ) from exc
    return torchao.optim


class LowBitAdamRule(UpdateRule):
    """AdamW (or Adam) with `bits`-bit moments, for expert tensors; see the module docstring."""

    def __init__(self, *, bits: int, decoupled: bool) -> None:
        if bits not in BLOCK_SIZE:
            raise ValueError(f"state_bits={bits}: low-bit states are 8 or 4 bits.")
        self.bits, self.decoupled = bits, decoupled
        self.name = f"{'adamw' if decoupled else 'adam'}{bits}bit"
        optim = torchao_optim()
        kinds = {
            (8, True): "AdamW8bit",
            (4, True): "AdamW4bit",
            (8, False): "Adam8bit",
            (4, False): "Adam4bit",
        }
        self.torchao_class = getattr(optim, kinds[(bits, decoupled)])
        self.single_param_adam = optim.adam.single_param_adam

    def defaults(self, cfg: Any) -> dict[str, Any]:
        return dict(lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)

    def init_state(self, param: Tensor, state: State) -> None:
        # As torchao's _AdamBase.step: the step is a 0-d float32 on the CPU, the moments quantized.
        state["step"] = torch.tensor(0.0)
        state["exp_avg"] = self._new_buffer(param, signed=True)
        state["exp_avg_sq"] = self._new_buffer(param, signed=False)

    def _new_buffer(self, param: Tensor, *, signed: bool) -> Tensor:
        block = BLOCK_SIZE[self.bits]
        if param.numel() >= MIN_QUANTIZED and param.numel() % block == 0:
            return self.torchao_class._subclass_zeros(param, signed, block)
        return torch.zeros_like(param)

    def update_(
        self,
        params: Sequence[Tensor],
        grads: Sequence[Tensor],
        states: Sequence[State],
        group: dict[str, Any],
        *,
        found_inf: Tensor | None = None,
    ) -> None:
        # torchao's kernel has no skip flag: a non-finite gradient is checked on the host (one sync).
        if found_inf is not None and bool(found_inf):
            return
        lr = torch.tensor(group["lr"], dtype=torch.float32)  # what torchao's param group holds
        compiled = torch.compile(self.single_param_adam, fullgraph=True, dynamic=False)
        with torch._dynamo.utils.disable_cache_limit():
            for p, g, s in zip(params, grads, states, strict=True):
                s["step"] += 1
                compiled(
                    p.detach(), grad_like_param(p, g), s["step"], s["exp_avg"], s["exp_avg_sq"], None, lr,
                    group["betas"][0], group["betas"][1], group["weight_decay"], group["eps"],
                    self.decoupled, False,
                )  # fmt: skip

    def update_slices_(self, param, grad, state, group, *, found_inf):
        # Unreachable: SonarOptimizer refuses granularity="per_expert" with low-bit states (torchao's
        # quantized states are blocks over the whole tensor, not sliceable per expert).
        raise SonarUsageError("granularity='per_expert' cannot use low-bit states: use state_bits=32.")

    def torch_optimizer(self, params: Sequence[nn.Parameter], cfg: Any) -> torch.optim.Optimizer:
        return self.torchao_class(list(params), **self.defaults(cfg))


def is_lowbit(t: object) -> bool:
    """A torchao quantized state tensor (a torchao subclass with inner tensors; an FSDP2 state's
    DTensor is a subclass too, and DCP needs it whole)."""
    return (
        isinstance(t, Tensor)
        and type(t).__module__.startswith("torchao.")
        and hasattr(t, "__tensor_flatten__")
    )


def pack_state(t: Tensor) -> dict[str, Any]:
    """A quantized state as plain values (safe for `torch.load(weights_only=True)` and checksums)."""
    names, attributes = t.__tensor_flatten__()  # type: ignore[attr-defined]
    packed: dict[str, Any] = {LOWBIT_KEY: type(t).__name__, "attributes": [_encode(a) for a in attributes]}
    packed.update({n: getattr(t, n) for n in names})
    return packed


def is_packed(value: object) -> bool:
    return isinstance(value, dict) and LOWBIT_KEY in value


def unpack_state(packed: dict[str, Any], device: torch.device) -> Tensor:
    """The quantized state `pack_state` wrote, rebuilt bitwise on `device`."""
    optim = torchao_optim()
    kinds = {"OptimState8bit": optim.subclass_8bit.OptimState8bit,
             "OptimState4bit": optim.subclass_4bit.OptimState4bit}  # fmt: skip
    cls = kinds[packed[LOWBIT_KEY]]
    inner = {n: packed[n].to(device) for n in cls.tensor_attrs}
    return cls.__tensor_unflatten__(inner, [_decode(a) for a in packed["attributes"]])


def _encode(attribute: Any) -> list[Any]:
    if isinstance(attribute, torch.dtype):
        return ["dtype", str(attribute).removeprefix("torch.")]
    if isinstance(attribute, (torch.Size, tuple)):
        return ["shape", list(attribute)]
    return ["value", attribute]


def _decode(encoded: list[Any]) -> Any:
    kind, value = encoded
    if kind == "dtype":
        return getattr(torch, value)
    if kind == "shape":
        return torch.Size(value)
    return value


def pack_state_dict(sd: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state dict with every quantized state packed (`pack_state`); others unchanged."""
    if not any(is_lowbit(v) for st in sd["state"].values() for v in st.values()):
        return sd
    state = {
        k: {n: pack_state(v) if is_lowbit(v) else v for n, v in st.items()} for k, st in sd["state"].items()
    }
    return {**sd, "state": state}


def load_packed_state_dict(
    optimizer: torch.optim.Optimizer, sd: dict[str, Any], load: Callable[[dict[str, Any]], None] | None = None
) -> None:
    """Load `sd` (from `pack_state_dict`) into `optimizer`: plain entries through `load` (default: its
    `load_state_dict`), packed ones rebuilt on their parameter's device, never cast (torch's loader
    would cast a quantized state's fp32 scales to a bf16 parameter's dtype)."""
    load = load or optimizer.load_state_dict
    packed = {(k, n): v for k, st in sd["state"].items() for n, v in st.items() if is_packed(v)}
    if not packed:
        load(sd)
        return
    plain = {k: {n: v for n, v in st.items() if (k, n) not in packed} for k, st in sd["state"].items()}
    load({**sd, "state": plain})
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for (k, n), v in packed.items():
        param = params[int(k)]
        optimizer.state[param][n] = unpack_state(v, param.device)
