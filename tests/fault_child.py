"""A `sonar-fx` process that hurts itself on cue, for the tests of run-data safety.

Usage: python tests/fault_child.py FAULT N finetune ...
  kill-in-save N   SIGKILL in the middle of writing the N-th checkpoint of this process
  kill-in-step N   SIGKILL in the N-th step of this process, after its backward (experts updated)
  term-at-step N   SIGTERM to itself at the start of the N-th step of this process
Then runs the command line with the remaining arguments and exits with its status.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

import torch

from sonar_fx.cli import main
from sonar_fx.methods import TrainingMethod


def _on_nth_call(owner: Any, name: str, n: int, act: Any) -> None:
    original = getattr(owner, name)
    calls = [0]

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return act(original, args, kwargs) if calls[0] == n else original(*args, **kwargs)

    setattr(owner, name, wrapper)


def _kill_while_writing(save: Any, args: tuple, kwargs: dict) -> None:
    f = args[1]
    f.write(b"PK\x03\x04 the first bytes of a checkpoint")
    f.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _kill_after_backward(forward_backward: Any, args: tuple, kwargs: dict) -> Any:
    forward_backward(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGKILL)


def _term_then_step(train_step: Any, args: tuple, kwargs: dict) -> Any:
    os.kill(os.getpid(), signal.SIGTERM)
    return train_step(*args, **kwargs)


FAULTS = {
    "kill-in-save": (torch, "save", _kill_while_writing),
    "kill-in-step": (TrainingMethod, "forward_backward", _kill_after_backward),
    "term-at-step": (TrainingMethod, "train_step", _term_then_step),
}

if __name__ == "__main__":
    fault, n, *argv = sys.argv[1:]
    owner, name, act = FAULTS[fault]
    _on_nth_call(owner, name, int(n), act)
    sys.exit(main(argv))
