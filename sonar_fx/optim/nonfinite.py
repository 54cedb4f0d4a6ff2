"""The non-finite policy of a Sonar step: what a gradient holding inf or NaN does to the step.

An in-backward update cannot wait for a verdict: each expert update takes a device-side flag (no
sync) and the kernel leaves a flagged tensor untouched. This module sets those flags and, once a
backward or a step ends, reads them all in one sync and applies `nonfinite`: "raise" stops the run
naming the tensors, "skip" skips the step (counted in the stats, warned once), "ignore" trains on.
Every rank decides alike (`any_rank`). It never updates a weight or a moment.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Literal

import torch
from torch import Tensor

from sonar_fx.errors import NonFiniteGradientError
from sonar_fx.optim.adamw import nonfinite_flag
from sonar_fx.optim.norms import is_dtensor
from sonar_fx.optim.stats import SonarStats

NonFinite = Literal["raise", "skip", "ignore"]
NONFINITE = ("raise", "skip", "ignore")

AnyRank = Callable[[bool], bool]
"""`local` on any rank (one process: `local`)."""

_ABANDON = "Call optimizer.abandon_step() to drop the step and go on"
_SKIP = "or pass nonfinite='skip' to skip such steps."
_EXPERTS_MOVED = "The expert tensors were updated in backward with finite gradients"
_EXPERTS_KEPT = "No expert tensor was touched either (the deferred schedule updates them after the dense)"


class NonFinitePolicy:
    """The flags of the step in progress and the verdicts on them (one per `SonarOptimizer`)."""

    def __init__(self, mode: NonFinite) -> None:
        if mode not in NONFINITE:
            raise ValueError(f"nonfinite={mode!r}: expected one of {', '.join(map(repr, NONFINITE))}.")
        self.mode = mode
        self.flags: dict[str, Tensor] = {}
        """Expert tensor name -> 1.0 if its gradient in this step was non-finite (device-side)."""

    def flag(self, name: str, grad: Tensor, norm: Tensor | None) -> Tensor | None:
        """The kernel's skip flag for `grad` (None under "ignore"). With the gradient's norm at hand it
        decides (an inf or NaN makes the norm non-finite), so the logged norm costs no extra pass over
        the gradient; a finite gradient whose norm overflows (entries near 1e19 in fp32) counts as
        non-finite too."""
        if self.mode == "ignore":
            return None
        if norm is not None and _norm_decides(grad, norm):
            bad = (~torch.isfinite(norm)).to(torch.float32)
            self.flags[name] = bad
            return bad
        flag = nonfinite_flag(grad)
        # An FSDP2 shard's flag is a replicated DTensor (the whole tensor's verdict): keep its plain value.
        full = getattr(flag, "full_tensor", None)
        self.flags[name] = full() if full is not None else flag
        return flag

    def flagged(self) -> list[str]:
        """Expert tensors whose gradient was non-finite since the last step (one sync for all)."""
        if not self.flags:
            return []
        flags = torch.stack(list(self.flags.values())).tolist()
        return [name for name, flag in zip(self.flags, flags, strict=True) if flag]

    def after_backward(self, updated: Sequence[str], any_rank: AnyRank) -> NonFiniteGradientError | None:
        """At the end of a backward that updated experts (`updated`): the error to raise under "raise"
        (its `tensors`: the non-finite ones), or None to go on."""
        if self.mode != "raise" or not self.flags:
            return None
        bad = self.flagged()
        if not any_rank(bool(bad)):
            return None
        done = [n for n in updated if n not in bad]
        where = _listing(bad, none="expert tensors of another rank")
        return NonFiniteGradientError(
            f"non-finite expert gradients (inf or NaN) in {where} "
            f"(nonfinite='raise'): their weights and moments are untouched. {len(done)} expert tensor(s) "
            f"with finite gradients were already updated in this backward. {_ABANDON}, restore the last "
            f"checkpoint for an exact run, {_SKIP}",
            bad,
        )

    def at_step(
        self,
        dense_norm: Tensor | None,
        dense_bad: Callable[[], list[str]],
        any_rank: AnyRank,
        stats: SonarStats,
        *,
        experts_moved: bool = True,
    ) -> list[str] | None:
        """At `step()`: the flagged expert names if the step is skipped (the caller drops the dense
        gradients), None to step. A non-finite dense norm raises under "raise", naming `dense_bad()`.
        `experts_moved`: the experts were updated in backward (the deferred schedule updates them after
        the dense step), which the message says."""
        if self.mode == "ignore":
            return None
        skipped = self.flagged()
        dense = dense_norm is not None and not bool(torch.isfinite(dense_norm))
        if dense and self.mode == "raise":
            bad = dense_bad()
            raise NonFiniteGradientError(
                f"dense gradients hold inf or NaN ({_listing(bad)}; nonfinite='raise'); no dense weight or "
                f"moment was touched. {_EXPERTS_MOVED if experts_moved else _EXPERTS_KEPT}: "
                f"{_ABANDON} (drops this step's dense gradients), {_SKIP}",
                bad,
            )
        if not any_rank(dense or bool(skipped)):
            return None
        _count_skip(stats, skipped, f"experts skipped: {len(skipped)}, dense: {'yes' if dense else 'no'}")
        return skipped

    def skip_before_update(self, bad: list[str], stats: SonarStats) -> None:
        """The deferred schedule found the non-finite expert gradients `bad` before any update
        (nonfinite="skip"): the step is skipped whole, as if its batches had never been seen."""
        _count_skip(stats, bad, f"in {_listing(bad)}, found before any update (schedule='deferred')")

    def at_global_norm(
        self,
        total: Tensor,
        expert_norms: dict[str, Tensor],
        dense_bad: Callable[[], list[str]],
        stats: SonarStats,
        *,
        clip: str = "expert_clip='global'",
    ) -> bool:
        """Between the two passes of expert_clip="global" (or after the deferred schedule's
        `clip`: the user's), before any weight or moment was touched: True if the step is skipped for
        a non-finite global norm; raises under "raise"."""
        if self.mode == "ignore" or bool(torch.isfinite(total)):  # one sync per step
            return False
        bad = [n for n, v in expert_norms.items() if not bool(torch.isfinite(v))] + dense_bad()
        where = _listing(bad)
        if self.mode == "raise":
            raise NonFiniteGradientError(
                f"non-finite gradients (inf or NaN) in {where} (nonfinite='raise', "
                f"{clip}): found by the norm pass, before any weight or moment was touched. "
                f"{_ABANDON}, {_SKIP}",
                bad,
            )
        _count_skip(stats, [n for n in expert_norms if n in bad], f"in {where}, {clip}")
        return True


def _norm_decides(grad: Tensor, norm: Tensor) -> bool:
    """Whether `norm` gives `grad`'s verdict: a plain gradient's own norm does. An FSDP2 shard's
    (a DTensor) does when `norm` is the whole tensor's, already reduced over ranks (a plain tensor, as
    `ExpertClipper.norm_of` records it): every rank then reads the same verdict, with no pass over the
    shard and no collective of its own (the shard's `nonfinite_flag` costs two all-reduces and a
    `full_tensor`). Not for float16: DTensor reduces a shard's norm as the sum of its squares in the
    gradient's dtype, which overflows float16 from a norm of 256, a finite gradient."""
    if not is_dtensor(grad):
        return True
    return not is_dtensor(norm) and grad.dtype != torch.float16


def finite(t: Tensor | None) -> bool:
    """`t` holds no inf or NaN (None: no gradient, nothing to hold)."""
    return t is None or bool(nonfinite_flag(t) == 0)


def _count_skip(stats: SonarStats, experts: list[str], detail: str) -> None:
    if stats.record_skipped_step(experts):
        warnings.warn(
            f"sonar: non-finite gradients, step skipped (nonfinite='skip'; {detail}); report() counts "
            "every skip.",
            stacklevel=_caller_level(),
        )


_LIBRARIES = tuple(
    os.path.dirname(path) + os.sep for path in (os.path.dirname(__file__), torch.__file__ or "")
)
"""Where frames are not the user's: sonar-fx's and torch's own files (its no_grad and step wrappers)."""


def _caller_level() -> int:
    """The `stacklevel` that names the first frame outside sonar-fx and torch: the user's `step()` or
    `backward()` line, however deep the call came (Python 3.11 has no warnings' `skip_file_prefixes`)."""
    frame, level = sys._getframe(1), 1  # the function that warns: level 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_LIBRARIES):
        frame, level = frame.f_back, level + 1
    return level


def _listing(names: Sequence[str], none: str = "the gradients of another rank") -> str:
    """Up to four of `names`; `none` where this rank found none (the verdict is over every rank)."""
    if not names:
        return none
    return ", ".join(names[:4]) + (" ..." if len(names) > 4 else "")
