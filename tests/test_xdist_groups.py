"""scripts/test.sh runs the suite with `--dist loadgroup`, so that tests marked with one
`xdist_group` (those sharing a module fixture that runs for a minute: two-rank runs, stop signals,
the CPU compile test's eager trace) run on one worker and the fixture runs once. A pytest and
pytest-xdist pair that drops the groups still passes every test, only slower; this test catches it."""

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("xdist")

GROUPED = textwrap.dedent("""
    import os
    import pytest

    pytestmark = pytest.mark.xdist_group("one")

    @pytest.mark.parametrize("i", range(6))
    def test_grouped(i, tmp_path_factory):
        (tmp_path_factory.getbasetemp().parent / f"{i}.worker").write_text(os.environ["PYTEST_XDIST_WORKER"])
""")


def test_tests_of_one_xdist_group_run_on_one_worker(tmp_path):
    (tmp_path / "test_grouped.py").write_text(GROUPED)
    base = tmp_path / "base"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}  # this suite's own worker's
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup",
                          "-p", "no:cacheprovider", "--basetemp", str(base), "test_grouped.py"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    workers = [p.read_text() for p in base.glob("*.worker")]
    assert len(workers) == 6, run.stdout
    assert len(set(workers)) == 1, f"the group ran on {sorted(set(workers))}"
