"""The built-in synthetic instruction set: short tasks with checkable answers.

For: a deterministic dataset that needs no download (same ``(n, seed)``, same records). Never: use
process state (no Python ``hash()``, no global RNG: every draw comes from a seeded ``random.Random``).
"""

from __future__ import annotations

import json
import random

_WORD_TEXT = (
    "apple river stone cloud tiger lemon piano rocket garden silver window candle forest yellow "
    "planet bridge orange castle dragon winter summer pepper rabbit mirror ocean violet copper "
    "button meadow falcon harbor marble pencil thunder velvet kitten saddle lantern cactus"
)
_WORDS = tuple(_WORD_TEXT.split())
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _task_add(rng: random.Random) -> tuple[str, str, str]:
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    return f"Add {a} and {b}.", "", str(a + b)


def _task_subtract(rng: random.Random) -> tuple[str, str, str]:
    a = rng.randint(0, 99)
    b = rng.randint(0, a)
    return f"Subtract {b} from {a}.", "", str(a - b)


def _task_reverse(rng: random.Random) -> tuple[str, str, str]:
    s = "".join(rng.choice(_LETTERS) for _ in range(rng.randint(3, 8)))
    return "Reverse the string.", s, s[::-1]


def _task_sort(rng: random.Random) -> tuple[str, str, str]:
    xs = [rng.randint(0, 99) for _ in range(rng.randint(3, 6))]
    return f"Sort {', '.join(map(str, xs))} in ascending order.", "", ", ".join(map(str, sorted(xs)))


def _task_to_json(rng: random.Random) -> tuple[str, str, str]:
    keys = rng.sample(_LETTERS, rng.randint(1, 3))
    pairs = {k: rng.randint(0, 9) for k in keys}
    src = ";".join(f"{k}={v}" for k, v in pairs.items())
    return f"Convert '{src}' to JSON.", "", json.dumps(pairs)


def _task_upper(rng: random.Random) -> tuple[str, str, str]:
    text = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 2)))
    return "Uppercase this.", text, text.upper()


def _task_count(rng: random.Random) -> tuple[str, str, str]:
    word = rng.choice(_WORDS) + rng.choice(_WORDS)
    letter = rng.choice(word)
    return f"How many times does the letter '{letter}' appear in '{word}'?", "", str(word.count(letter))


_TASKS = (_task_add, _task_subtract, _task_reverse, _task_sort, _task_to_json, _task_upper, _task_count)


def synthetic_records(n: int, seed: int = 0) -> list[dict[str, str]]:
    """A deterministic synthetic instruction set with short, checkable outputs.

    Task kinds rotate (add, subtract, reverse, sort, key=value -> JSON, uppercase, letter count) so every
    kind is equally present; some use the ``input`` field, some not, covering both prompt templates.
    Every record fits in 256 byte tokens untruncated (the Alpaca preamble alone is 140-205 bytes, so
    tasks with an ``input`` stay short). Duplicates are avoided (bounded retries) so held-out records
    are unseen in training. Same
    ``(n, seed)`` gives identical records, and ``synthetic_records(m, s)`` is a prefix of
    ``synthetic_records(n, s)`` for m <= n.
    """
    if n < 0:
        raise ValueError(f"synthetic_records: n must be >= 0, got {n}")
    rng = random.Random(seed)
    seen: set[tuple[str, str]] = set()
    records = []
    for i in range(n):
        task = _TASKS[i % len(_TASKS)]
        for _ in range(64):  # small task spaces (add: 10^4 pairs) may run out; then accept a repeat
            instruction, inp, output = task(rng)
            if (instruction, inp) not in seen:
                break
        seen.add((instruction, inp))
        records.append({"instruction": instruction, "input": inp, "output": output})
    return records
