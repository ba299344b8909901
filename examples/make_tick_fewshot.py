"""Write examples/data/tick_fewshot.jsonl, the long-prompt workload of
examples/tick_fewshot.yaml: tick tasks (count up from a 3-digit number while counting the
items left down to 01) each asked after a few-shot instruction of worked examples.

Each row's prompt is its own instruction of 256 to about 1,030 characters (the kit's tokenizer
is one token a character), then the question ``T123#07=``; its answer has 3 to 18 items
(20 to 125 tokens). Seeded, so the file is the same on every run:

    python examples/make_tick_fewshot.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

ROWS = 128
OUT = Path(__file__).parent / "data" / "tick_fewshot.jsonl"


def items(start: int, n: int) -> str:
    return " ".join(f"{start + i:03d}/{n - i:02d}" for i in range(n))


def row(rng: random.Random, i: int) -> dict[str, str]:
    target, shots = rng.randint(256, 940), []
    while sum(map(len, shots)) < target:  # passed by less than one shot (<= 92)
        n, start = rng.randint(1, 12), rng.randint(100, 900)
        shots.append(f"T{start:03d}#{n:02d}={items(start, n)}\n")
    n, start = rng.randint(3, 18), rng.randint(100, 900)
    return {"id": f"fs{i:03d}", "prompt": "".join(shots) + f"T{start:03d}#{n:02d}=",
            "answer": items(start, n)}


def main() -> None:
    rng = random.Random(0)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text("".join(json.dumps(row(rng, i)) + "\n" for i in range(ROWS)))


if __name__ == "__main__":
    main()
