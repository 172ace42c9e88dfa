"""A local data file with a record that cannot be used is refused by a DataError that names the
file, the line and what is wrong (flame.data.records), loaded whole or streamed, and `flame-train`
prints it as one line."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from flame.data import DataError, build_dataloader, load_tokenizer
from flame.data.records import first_bad_record
from flame.train.__main__ import main

GOOD = json.dumps({"text": "a first document of a few words"}) + "\n"

BAD_FILES = {  # name: (content, the message's expected parts after the file name)
    "broken.jsonl": (GOOD + '{"text": "cut off\n' + GOOD, "line 2 is not valid JSON at column 10"),
    "no_text.jsonl": (GOOD + '{"body": "elsewhere"}\n', "line 2 has no field 'text' (data.text_field); "
                                                         "its fields are ['body']"),
    "null_text.jsonl": (GOOD + GOOD + '{"text": null}\n', "line 3: field 'text' is null, not a string"),
    "number_text.jsonl": (GOOD + '{"text": 7}\n', "line 2: field 'text' is 7, not a string"),
    "blank_line.jsonl": (GOOD + "\n" + GOOD, "line 2 is empty"),
    "latin1.jsonl": (GOOD.encode() + '{"text": "café"}\n'.encode("latin-1"),
                     "is not UTF-8 (line 2, byte 14 is 0xe9)"),
    "latin1.txt": ("first line\nvoilà\n".encode("latin-1"), "is not UTF-8 (line 2, byte 5 is 0xe0)"),
    "records.json": ('[\n{"text": "a"},\n{"txt": "b"}\n]\n', "record 1 has no field 'text'"),
}


def write(path: Path, content: str | bytes) -> Path:
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.mark.parametrize("streaming", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_a_bad_record_is_named_by_file_and_line(tmp_path, tokenizer, name, streaming):
    content, expected = BAD_FILES[name]
    path = write(tmp_path / name, content)
    with pytest.raises(DataError) as caught:
        loader = build_dataloader(dataset=str(path), tokenizer=tokenizer, batch_size=1, seq_len=4,
                                  val_fraction=0.0, streaming=streaming)
        next(iter(loader))
    assert str(caught.value).startswith(f"{path} {expected}"), str(caught.value)


def test_compressed_files_are_read_and_good_files_pass(tmp_path):
    path = tmp_path / "docs.jsonl.gz"
    path.write_bytes(gzip.compress((GOOD * 3 + '{"body": 1}\n').encode()))
    assert first_bad_record("json", [str(path)], "text") == (
        f"{path} line 4 has no field 'text' (data.text_field); its fields are ['body']")
    good = write(tmp_path / "good.jsonl", GOOD * 3)
    assert first_bad_record("json", [str(good)], "text") is None
    assert first_bad_record("parquet", [str(good)], "text") is None


def test_flame_train_prints_the_bad_record_in_one_line(tmp_path, capsys):
    path = write(tmp_path / "broken.jsonl", BAD_FILES["broken.jsonl"][0])
    tiny = Path(__file__).resolve().parents[2] / "configs" / "tiny.toml"
    assert main(["--config", str(tiny), "--job.dump_folder", str(tmp_path / "run"),
                 "--data.dataset", str(path), "--training.device", "cpu"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == f"flame-train: DataError: {path} line 2 is not valid JSON at column 10: Unterminated string starting at"
    assert not (tmp_path / "run" / "config.toml").exists()
