"""Train from Python: a dataset and a reward passed as objects (docs/your-data.md).

    python examples/train_api.py [key=value ...]   # settings as for `rollstream train`
"""

import random
import sys

import rollstream


def count_rows(n: int, seed: int = 0) -> list[dict]:
    """Rows as a user has them: a prompt, an answer, and a column the reward reads."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        start, items = rng.randrange(100, 990), rng.randint(1, 6)
        answer = " ".join(f"{start + j}/0{items - j}" for j in range(items))
        rows.append({"prompt": f"T{start}#0{items}=", "answer": answer, "items": items})
    return rows


def item_credit(task: rollstream.Task, text: str, *, items: int) -> float:
    """The share of the answer's items that the response got right, in place."""
    right = sum(a == b for a, b in zip(text.split(), task.reference.split()))
    return right / items


if __name__ == "__main__":  # reward workers are spawned processes that import this file
    summary = rollstream.run(
        "examples/tick.yaml",
        ["name=api-demo", "train.steps=10", "tasks.sources=[{name: count, reward_kwargs: [items]}]",
         *sys.argv[1:]],
        datasets={"count": count_rows(2000)},
        rewards={"count": item_credit},
    )
    print(f"held-out reward {summary['reward_initial']:.3f} -> {summary['reward_final']:.3f} "
          f"in {summary['steps']} steps ({summary['wall_s']:.0f} s)")
