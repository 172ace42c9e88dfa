"""The results of bench/scale.py: summary.json, the markdown rows of each run, and their merge
into a results file (bench/RESULTS.md) between the markers that the file keeps for them."""

from __future__ import annotations

import json
from pathlib import Path

from bench.scale_runs import EFFICIENCY_TARGET, RUNS, Plan, ScaleError

RESULTS_ROWS = ("<!-- scale.py rows -->", "<!-- /scale.py rows -->")
RESULTS_COMMANDS = ("<!-- scale.py commands -->", "<!-- /scale.py commands -->")
TABLE_HEADER = ("| config | run | world | global batch (tokens) | tok/s/GPU | MFU | "
                "peak mem/GPU (GiB) | scaling eff. | result | measured |\n"
                "|---|---|---|---|---|---|---|---|---|---|")


def write_outputs(plan: Plan, summary: dict, summary_path: Path, results: Path) -> list[str]:
    """summary.json, and the rows of every run of this plan in the results file (an earlier
    invocation's too: the efficiencies use the baseline). Returns the rows."""
    summary_path.write_text(json.dumps(summary, indent=2) + "\n")
    rows = table_rows(plan, summary)
    commands = {(plan.name, plan.label(r)): f"- **{plan.name} · {plan.label(r)}**: "
                f"`{summary[r]['invocation']}` ({summary[r]['measured']})"
                for r in RUNS if r in summary}
    update_results(results, rows, commands)
    return list(rows.values())


def fmt(value, pattern: str = "{:,.0f}") -> str:
    return "n/a" if value is None else pattern.format(value)


def table_rows(plan: Plan, summary: dict) -> dict[tuple[str, str], str]:
    """{(config, run label): markdown row} for the runs in `summary`."""
    rows = {}
    base = summary.get("single", {}).get("tokens_per_s_per_gpu")
    for run in RUNS:
        result = summary.get(run)
        if result is None:
            continue
        label = plan.label(run)
        world = str(result.get("world", ""))
        if "error" in result:
            cells = ["—"] * 5 + [f"FAILED: {result['error'].splitlines()[0][:200]}"]
        elif run in ("fsdp", "single", "hsdp"):
            batch = plan.global_batch_tokens if run != "single" else plan.global_batch_tokens // plan.nproc
            eff = None if base is None or run == "single" else result["tokens_per_s_per_gpu"] / base
            note = "baseline" if run == "single" else (
                "no baseline" if eff is None else
                f"{'meets' if eff >= EFFICIENCY_TARGET else 'BELOW'} the 90% target")
            cells = [f"{batch:,}", fmt(result["tokens_per_s_per_gpu"]),
                     fmt(result["mfu"], "{:.1%}"), fmt(result["peak_memory_gib"], "{:.1f}"),
                     fmt(eff, "{:.1%}"), note]
        elif run == "resume":
            detail = ("bitwise equal" if result["bitwise"] else
                      f"max abs loss difference {result['max_abs_diff_after_resume']:.3g} "
                      f"(tolerance {result['tolerance']:g})")
            pre = result["max_abs_diff_before_kill"]
            cells = [f"{plan.global_batch_tokens:,}", "—", "—", "—", "—",
                     f"{'PASS' if result['passed'] else 'FAIL'}: killed at step "
                     f"{result['killed_at_step']}, resumed from {result['resumed_from']}, "
                     f"{result['compared_steps']} losses {detail}"
                     + ("" if pre is None else f"; before the kill: max abs difference {pre:.3g}")]
        else:
            cells = [f"{plan.global_batch_tokens // plan.nproc:,}", "—", "—", "—", "—",
                     f"{'PASS' if result['passed'] else 'FAIL'}: step-{plan.kill_step} weights, "
                     f"first loss {result['loaded_first_loss']:.4f} vs untrained "
                     f"{result['untrained_loss']:.4f} ({result['untrained_on']}); P-run loss "
                     f"with these weights {result['p_run_loss_same_weights']:.4f} (its own batch)"
                     + (f"; {result['note']}" if result.get("note") else "")]
        rows[(plan.name, label)] = "| " + " | ".join(
            [plan.name, label, world, *cells, result["measured"]]) + " |"
    return rows


def update_results(path: Path, rows: dict[tuple[str, str], str], commands: dict[tuple[str, str], str]) -> None:
    """Replace the rows (and command lines) with the same (config, run) key, append new ones."""
    text = path.read_text() if path.is_file() else (
        "# Benchmark results\n\n## Scaling (bench/scale.py)\n\n"
        f"{RESULTS_ROWS[0]}\n{TABLE_HEADER}\n{RESULTS_ROWS[1]}\n\n"
        f"### Commands\n\n{RESULTS_COMMANDS[0]}\n{RESULTS_COMMANDS[1]}\n")
    text = merge_block(text, RESULTS_ROWS, rows, key_of_row, keep_prefix=2)
    text = merge_block(text, RESULTS_COMMANDS, commands, key_of_command, keep_prefix=0)
    path.write_text(text)


def merge_block(text: str, markers: tuple[str, str], entries: dict, key_of, keep_prefix: int) -> str:
    start, end = markers
    if start not in text or end not in text:
        raise ScaleError(f"the results file lacks the markers {start} ... {end}")
    head, rest = text.split(start, 1)
    body, tail_text = rest.split(end, 1)
    lines = [line for line in body.strip("\n").splitlines() if line.strip()]
    prefix, items = lines[:keep_prefix], lines[keep_prefix:]
    pending = dict(entries)
    merged = []
    for line in items:
        key = key_of(line)
        merged.append(pending.pop(key) if key in pending else line)
    merged.extend(pending.values())
    return head + start + "\n" + "\n".join(prefix + merged) + "\n" + end + tail_text


def key_of_row(line: str) -> tuple[str, str]:
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    return (cells[0], cells[1]) if len(cells) > 1 else (line, "")


def key_of_command(line: str) -> tuple[str, str]:
    # "- **config · run label**: ..."
    inner = line.split("**", 2)[1] if line.count("**") >= 2 else line
    config, _, label = inner.partition(" · ")
    return config.strip(), label.strip()

