"""Text sources: the embedded corpus, local files and HF hub datasets, all loaded through `datasets`.

A source spec is one string:
- "embedded": the shipped Shakespeare corpus (flame/data/embedded/shakespeare.jsonl.gz);
- "json", "parquet" or "text" together with `data_files` globs;
- a local glob such as "data/*.jsonl" (the type follows the extension);
- anything else is a HF hub dataset name, optionally "name:config".
Text files are read one document per file.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path

from flame.data.errors import DataError
from flame.data.records import first_bad_record
from flame.data.tokenizer import EMBEDDED_DIR

EMBEDDED_CORPUS = EMBEDDED_DIR / "shakespeare.jsonl.gz"
LOCAL_TYPES = ("json", "parquet", "text")
EXTENSION_TYPES = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}


def is_local_spec(spec: str) -> bool:
    return spec == "embedded" or spec in LOCAL_TYPES or file_type(spec) is not None


def file_type(path: str) -> str | None:
    name = path.lower()
    for compressed in (".gz", ".bz2", ".xz", ".zst"):
        name = name.removesuffix(compressed)
    return EXTENSION_TYPES.get(Path(name).suffix)


def expand_globs(patterns: list[str]) -> list[str]:
    """Every file matching the patterns, sorted; DataError when a pattern matches nothing."""
    files = []
    for pattern in patterns:
        matches = sorted(p for p in glob.glob(os.path.expanduser(pattern), recursive=True)
                         if os.path.isfile(p))
        if not matches:
            raise DataError(f"no files match {pattern!r}")
        files.extend(matches)
    return files


def num_rows(kind: str, path: str) -> int | None:
    """0 for an empty file (or a parquet file without rows), else None (unknown, not empty)."""
    if os.path.getsize(path) == 0:
        return 0
    if kind == "parquet":
        import pyarrow.parquet as pq

        return pq.read_metadata(path).num_rows or 0
    return None


def offline() -> bool:
    flags = (os.environ.get(k, "").lower() for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))
    return any(f in ("1", "true", "yes", "on") for f in flags)


def local_files(spec: str, data_files: list[str] | tuple = ()) -> tuple[str | None, list[str]]:
    """(file type, files) of a local source spec; (None, []) for a HF hub dataset."""
    if spec == "embedded":
        return "json", [str(EMBEDDED_CORPUS)]
    if spec in LOCAL_TYPES:
        if not data_files:
            raise DataError(f"data.dataset = {spec!r} needs data.data_files (glob patterns)")
        return spec, expand_globs(list(data_files))
    if file_type(spec) is not None:
        return file_type(spec), expand_globs([spec])
    return None, []


def load_documents(spec: str, *, data_files: list[str] | tuple = (), name: str = "",
                   split: str = "train", streaming: bool = False, text_field: str = "text"):
    """Load a source as a `datasets.Dataset` (or `IterableDataset` when streaming) and check it.

    Returns (dataset, text_field, description); the text field of "text" files is "text".
    """
    import datasets

    kind, files = local_files(spec, data_files)
    if kind is not None:
        for f in files:
            if file_type(f) is not None and file_type(f) != kind:
                raise DataError(f"{f} is not a {kind} file (data.dataset = {spec!r})")
        description = "embedded" if spec == "embedded" else (
            f"{kind}:{','.join(files) if len(files) <= 3 else files[0] + ', ...'}")
        if all(num_rows(kind, f) == 0 for f in files):
            raise DataError(f"dataset {description} is empty")
        extra = {"sample_by": "document"} if kind == "text" else {}
        if kind == "text":
            text_field = "text"
        try:
            ds = datasets.load_dataset(kind, data_files=files, split="train",
                                       streaming=streaming, **extra)
        except Exception as err:  # datasets raises many types, StopIteration included
            # datasets names no file or line: find the bad record and say where it is
            raise DataError(first_bad_record(kind, files, text_field) or
                            f"cannot read {kind} files {files[:3]}: {type(err).__name__}: {err}") from err
    else:
        hub_name, _, config = spec.partition(":")
        config = config or name or None
        try:
            ds = datasets.load_dataset(hub_name, config, split=split, streaming=streaming)
        except Exception as err:
            if offline() or isinstance(err, ConnectionError) or "offline" in str(err).lower():
                raise DataError(
                    f"dataset {hub_name!r} is not in the local cache and there is no network; "
                    f"download it first with `python -c \"import datasets; "
                    f"datasets.load_dataset('{hub_name}'{', ' + repr(config) if config else ''})\"` "
                    f"on a machine with network access ({type(err).__name__}: {err})"
                ) from err
            raise DataError(f"cannot load HF dataset {hub_name!r}: {type(err).__name__}: {err}") from err
        description = f"hub:{hub_name}" + (f":{config}" if config else "") + f"[{split}]"

    columns = ds.column_names
    if columns is not None and text_field not in columns:
        raise DataError(f"field {text_field!r} not found in {description}; fields are {columns}")
    if not streaming and len(ds) == 0:
        raise DataError(f"dataset {description} is empty")
    if not streaming:
        check_texts(ds, text_field, description, kind, files)
    return ds, text_field, description


def check_texts(ds, text_field: str, description: str, kind: str | None, files: list[str]) -> None:
    """DataError unless every document's `text_field` is a string (a null or a number in a record
    would fail inside the tokenizer); for local files the error names the file and line."""
    import pyarrow as pa

    column = ds.data.column(text_field)
    if (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)) and not column.null_count:
        return
    problem = first_bad_record(kind, files, text_field) if kind is not None else None
    raise DataError(problem or f"field {text_field!r} of {description} holds {column.type} values "
                               f"({column.null_count} null), not text")
