"""Runs tests on a CUDA GPU machine with the real Triton compiler, in parallel pytest processes.

    python scripts/gpu_tests.py --name gsa --groups 8 --timeout 300 tests/ops/test_gsa_triton.py tests/models/test_gpu.py

On a GPU machine the suite's time is Triton's compile time, one CPU core per pytest process, so
the tests of PYTEST_ARGS are collected and dealt round robin to --groups pytest processes that run
at once (a file's slow GPU-only tests sit next to each other: a contiguous split would put them in
one group). Each process is killed after --timeout seconds. The summary, also written to
<out>/<name>.log, gives per group its pytest summary line, or "TIMED OUT" with the ids it did not
finish, then the failed tests and the first error lines of each group; each group's whole log is
<out>/<name>-group<i>.log. --gpus N deals the processes over N GPUs. Exit status 0 only when
every collected test passed or was skipped.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

SUMMARY_LINE = re.compile(r"^[0-9]+ (passed|failed|skipped|error)|^=+ .*(passed|failed|error).* =+$|no tests ran")
PYTEST = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider"]


def collect(pytest_args: list[str]) -> list[str]:
    """The test ids that pytest collects from pytest_args."""
    listing = subprocess.run([*PYTEST, "--collect-only", "-q", *pytest_args], capture_output=True, text=True)
    return [line for line in listing.stdout.splitlines() if "::" in line]


def run_groups(groups: list[list[str]], timeout: float, logs: Path, name: str,
               gpus: int = 1) -> list[tuple[list[str], str, bool]]:
    """Run each group of ids in its own pytest process, all at once, group i on the (i % gpus)-th
    GPU (of CUDA_VISIBLE_DEVICES where it is set) when gpus > 1; each writes logs/<name>-group<i>.log as it goes. Returns (ids, log text, timed out)."""
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    devices = visible[:gpus] if visible else [str(d) for d in range(gpus)]
    running = []
    for i, ids in enumerate(groups):
        log = logs / f"{name}-group{i}.log"
        env = dict(os.environ)
        if gpus > 1:
            env["CUDA_VISIBLE_DEVICES"] = devices[i % len(devices)]
        with open(log, "wb") as out:
            proc = subprocess.Popen([*PYTEST, "-q", "-rf", "--tb=short", *ids], stdout=out, env=env,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        running.append((ids, log, proc))
    deadline = time.monotonic() + timeout
    results = []
    for ids, log, proc in running:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            timed_out = True
        results.append((ids, log.read_text(errors="replace"), timed_out))
    return results


def summarize(name: str, total: int, n_groups: int, timeout: float,
              results: list[tuple[list[str], str, bool]]) -> tuple[str, bool]:
    """The summary text, and whether every test passed or was skipped."""
    ok = True
    lines = [f"== {name}: {total} tests in {n_groups} groups, {timeout:.0f}s each"]
    for ids, text, timed_out in results:
        found = [line for line in text.splitlines() if SUMMARY_LINE.search(line)]
        if timed_out or not found:
            lines.append(f"TIMED OUT ({len(ids)} tests): {' '.join(ids)}")
            ok = False
        else:
            lines.append(found[-1])
            ok = ok and not re.search(r"failed|error", found[-1])
        lines += [line for line in text.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    for _, text, _ in results:
        lines += [line for line in text.splitlines() if line.startswith("E ")][:5]
    return "\n".join(lines), ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--name", required=True, help="name of this batch of tests (the log's name)")
    parser.add_argument("--groups", type=int, default=8, help="pytest processes run at once")
    parser.add_argument("--timeout", type=float, default=300, help="seconds each process may run")
    parser.add_argument("--gpus", type=int, default=1,
                        help="deal the groups over this many GPUs (CUDA_VISIBLE_DEVICES per process)")
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"),
                        help="folder of the summary log (default: $OUT, else /tmp/out)")
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER, metavar="PYTEST_ARGS ...",
                        help="test files and pytest options (-k, -m), after this tool's options")
    args = parser.parse_args(argv)
    if not args.pytest_args:
        parser.error("give the tests to run (PYTEST_ARGS)")
    if args.groups < 1:
        parser.error(f"--groups must be >= 1, got {args.groups}")
    if args.gpus < 1:
        parser.error(f"--gpus must be >= 1, got {args.gpus}")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ids = collect(args.pytest_args)
    if not ids:
        text = f"== {args.name}: no tests collected from: {' '.join(args.pytest_args)}"
        (out / f"{args.name}.log").write_text(text + "\n")
        print(text)
        return 1
    groups = [group for group in (ids[i::args.groups] for i in range(args.groups)) if group]
    results = run_groups(groups, args.timeout, out, args.name, args.gpus)
    text, ok = summarize(args.name, len(ids), args.groups, args.timeout, results)
    (out / f"{args.name}.log").write_text(text + "\n")
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
