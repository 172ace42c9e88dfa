"""The first record of a local data file that cannot be used, named by file and line.

`datasets` reports a bad record of a local file without its place ("Unmatched ''"'", "KeyError:
'text'", "An error occurred while generating the dataset"). When a load fails, or its text field
holds something other than text, the files are read again here, line by line, for the first
record that is not UTF-8, not JSON, not an object, without the text field, or whose text is not a
string. The files are read only then, so a good load costs nothing.
"""

from __future__ import annotations

import json

import fsspec

RECORD_KINDS = ("json", "text")
"""The file types read line by line (parquet's records have no lines)."""


def first_bad_record(kind: str, files: list[str], text_field: str) -> str | None:
    """What is wrong with the first unusable record of `files` (of type `kind`, whose text is
    in `text_field`) and where, as "FILE line N: ..."; None when every record can be used."""
    if kind not in RECORD_KINDS:
        return None
    for path in files:
        problem = _first_bad_line(kind, path, text_field)
        if problem is not None:
            return problem
    return None


def _first_bad_line(kind: str, path: str, text_field: str) -> str | None:
    with fsspec.open(path, "rb", compression="infer") as f:
        for number, raw in enumerate(f, start=1):
            place = f"{path} line {number}"
            try:
                line = raw.decode("utf-8").strip()
            except UnicodeDecodeError as err:
                return _not_utf8(path, raw, err.start, number)
            if kind == "text":  # a text file is one document: only its encoding can be wrong
                continue
            if not line:
                return f"{place} is empty: a JSON-lines file holds one JSON object on every line"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                problem = f"{place} is not valid JSON at column {err.colno}: {err.msg}"
                if number == 1:  # perhaps one JSON document over many lines, not JSON lines
                    return _bad_json_document(path, text_field, problem)
                return problem
            problem = _bad_record(place, record, text_field)
            if problem is not None:
                return problem
    return None


def _bad_json_document(path: str, text_field: str, first_line_problem: str) -> str | None:
    """The problem of a .json file read as one JSON value (a list of records, as `datasets`
    reads it); `first_line_problem` when it is not one either and fails at its first line."""
    with fsspec.open(path, "rb", compression="infer") as f:
        data = f.read()
    try:
        document = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as err:
        return _not_utf8(path, data, err.start)
    except json.JSONDecodeError as err:
        if err.lineno == 1:
            return first_line_problem
        return f"{path} line {err.lineno} is not valid JSON at column {err.colno}: {err.msg}"
    if not isinstance(document, list):
        return None  # a dict of columns: the records are not where this reader looks
    for index, record in enumerate(document):
        problem = _bad_record(f"{path} record {index}", record, text_field)
        if problem is not None:
            return problem
    return None


def _not_utf8(path: str, data: bytes, offset: int, first_line: int = 1) -> str:
    """The problem of a file whose byte `offset` of `data` (which starts at line `first_line`)
    is not UTF-8."""
    line = first_line + data.count(b"\n", 0, offset)
    column = offset - data.rfind(b"\n", 0, offset)
    return (f"{path} is not UTF-8 (line {line}, byte {column} is 0x{data[offset]:02x}): flame reads "
            f"UTF-8 text; convert the file, e.g. with `iconv -f latin1 -t utf-8`")


def _bad_record(place: str, record, text_field: str) -> str | None:
    if not isinstance(record, dict):
        return f"{place} is a JSON {type(record).__name__}, not an object with a {text_field!r} field"
    if text_field not in record:
        return (f"{place} has no field {text_field!r} (data.text_field); its fields are "
                f"{sorted(record)}")
    if not isinstance(record[text_field], str):
        return (f"{place}: field {text_field!r} is {json.dumps(record[text_field])[:80]}, not a "
                f"string")
    return None


__all__ = ["RECORD_KINDS", "first_bad_record"]
