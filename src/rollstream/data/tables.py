"""Arrow-backed rows for :class:`~rollstream.data.dataset.DatasetSource`: a Parquet file, or a
folder written by Hugging Face ``datasets``' ``Dataset.save_to_disk``.

Both are read with pyarrow, batch by batch, into plain Python values (nested structs become
dicts, lists lists): a saved ``datasets`` folder is its ``state.json`` plus Arrow stream
files (``_data_files``), which is all ``load_from_disk`` reads too, so the ``datasets``
package is not needed at run time. Rows are numbered from 0, as ``dataset[i]`` and pandas
number them.

Simplifications: a ``DatasetDict`` folder (``dataset_dict.json``) is not read as a whole:
its split's folder is (``path/train``); rows are held in memory once read.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def parquet_rows(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        batches = pq.ParquetFile(path).iter_batches()
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{path} is not a readable Parquet file: {e}") from None
    yield from _numbered(path, batches)


def saved_dataset_rows(folder: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    import pyarrow as pa

    problem = saved_dataset_problem(folder)
    if problem is not None:
        raise ValueError(problem)
    state = json.loads((folder / "state.json").read_text())
    files = [folder / f["filename"] for f in state.get("_data_files", ())]

    def batches() -> Iterator[Any]:
        for file in files:
            try:
                with pa.memory_map(str(file)) as f:
                    yield from pa.ipc.open_stream(f)
            except (pa.ArrowException, OSError) as e:
                raise ValueError(f"{file} is not a readable Arrow file: {e}") from None

    yield from _numbered(folder, batches())


def saved_dataset_problem(folder: Path) -> str | None:
    """Why ``folder`` is not a ``Dataset.save_to_disk`` folder, or None. Reads nothing but
    the folder's listing."""
    shown = str(folder)
    if not folder.exists():
        return f"dataset folder {shown!r} does not exist (looked for {folder.absolute()})"
    if not folder.is_dir():
        return (f"dataset folder {shown!r} is a file; kind hf_dataset reads a folder written "
                "by Dataset.save_to_disk")
    if (folder / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in folder.iterdir() if (p / "state.json").is_file())
        return (f"dataset folder {shown!r} holds a DatasetDict (splits {splits}): set path to "
                f"one split's folder, e.g. {shown}/{splits[0] if splits else 'train'}")
    if not (folder / "state.json").is_file():
        return (f"dataset folder {shown!r} has no state.json: not a folder written by "
                "Dataset.save_to_disk")
    return None


def _numbered(path: Path, batches: Any) -> Iterator[tuple[int, dict[str, Any]]]:
    import pyarrow as pa

    index = 0
    try:
        for batch in batches:
            for row in batch.to_pylist():
                yield index, row
                index += 1
    except pa.ArrowException as e:
        raise ValueError(f"{path}: cannot read row {index} on: {e}") from None
