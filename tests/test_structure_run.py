"""A run is built whole and names its files in one place: two checks over the source."""

from __future__ import annotations

import ast
from pathlib import Path

from rollstream import run_files

SRC = Path(__file__).resolve().parents[1] / "src" / "rollstream"
# what the controller and the engines are given at construction, never set afterwards
WIRED = {"after_step", "before_stop", "train_pool", "supervisor", "training", "passes",
         "autoscaler"}


def _chain(node: ast.expr) -> list[str]:
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        names.append(node.id)
    return names[::-1]


def test_nothing_is_wired_into_a_controller_or_an_engine_after_it_is_built():
    found = []
    for path in [*(SRC / "runtime").rglob("*.py"), *(SRC / "sim").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            targets = (node.targets if isinstance(node, ast.Assign)
                       else [node.target] if isinstance(node, ast.AugAssign | ast.AnnAssign)
                       else [])
            for target in targets:
                chain = _chain(target) if isinstance(target, ast.Attribute) else []
                if chain and chain[0] != "self" and (
                        "controller" in chain or chain[-1] in WIRED or "passes" in chain):
                    found.append(f"{path.relative_to(SRC)}:{node.lineno} {'.'.join(chain)}")
    assert found == []


def test_run_folder_file_names_are_spelled_only_in_run_files():
    names = {v for k, v in vars(run_files).items()
             if k.isupper() and isinstance(v, str)}
    assert {"ledger.jsonl", "metrics.jsonl", "summary.json", "checkpoints"} <= names
    found = []
    for path in SRC.rglob("*.py"):
        if path == SRC / "run_files.py":
            continue
        tree = ast.parse(path.read_text())
        keys = {id(k) for d in ast.walk(tree) if isinstance(d, ast.Dict) for k in d.keys}
        for node in ast.walk(tree):  # a dict's key ("checkpoint" in the summary) is no path
            if isinstance(node, ast.Constant) and node.value in names and id(node) not in keys:
                found.append(f"{path.relative_to(SRC)}:{node.lineno} {node.value!r}")
    assert found == []
