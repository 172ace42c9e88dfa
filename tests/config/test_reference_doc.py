"""docs/config.md, the README's configuration reference, matches the schema it documents."""

from pathlib import Path

from flame.config.loader import help_text

DOC = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def test_config_reference_doc_is_current():
    text = DOC.read_text()
    assert "```text\n" + help_text() + "\n```" in text, (
        "docs/config.md is out of date with flame/config/job.py; regenerate it (see its header)"
    )
