"""A public corpus that every machine with Python has: the source files of the Python installation.

    python -m bench.python_corpus --out .rwkvlm/python_sources.jsonl [--packages torch]

Writes one JSON line {"text": ..., "path": ...} per `.py` file of the running interpreter's standard
library (`sysconfig`'s "stdlib" folder, site-packages excluded) and of each named installed
package, in sorted path order, skipping files that are not UTF-8. The comparison with RWKV-LM's
trainer (bench/rwkvlm.py, docs/rwkv-lm.md) tokenizes it with the RWKV World tokenizer through
`python -m flame.data.prepare`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import sysconfig
from pathlib import Path


def source_files(packages: list[str]) -> list[Path]:
    """The `.py` files of the standard library and of `packages`, sorted within each root."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    roots = [stdlib]
    for name in packages:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit(f"python_corpus: package {name!r} is not installed")
        roots.append(Path(list(spec.submodule_search_locations)[0]))
    files = []
    for root in roots:
        files += sorted(p for p in root.rglob("*.py")
                        if p.is_file() and (root != stdlib or "site-packages" not in p.parts))
    return files


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] + " Runs on any machine (CPU).")
    parser.add_argument("--out", required=True, help="the JSONL file to write")
    parser.add_argument("--packages", default="torch",
                        help="comma-separated installed packages whose sources are added")
    args = parser.parse_args(argv)
    packages = [p for p in args.packages.split(",") if p]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    count = size = skipped = 0
    with out.open("w", encoding="utf-8") as f:
        for path in source_files(packages):
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                skipped += 1
                continue
            if not text.strip():
                continue
            f.write(json.dumps({"text": text, "path": str(path)}) + "\n")
            count, size = count + 1, size + len(text)
    print(f"wrote {count} files ({size / 1e6:.1f}M characters; {skipped} not UTF-8) of Python "
          f"{sys.version.split()[0]}'s standard library and {packages} to {out}")


if __name__ == "__main__":
    main()
