"""The compile cache of a run: torch.compile's on-disk caches in a folder that restarts find.

A compiled run's first step compiles every block: Dynamo traces it, AOTAutograd builds its
forward and backward, Inductor generates and compiles their code and Triton compiles the kernels
(flame's own and Inductor's). Inductor keeps the compiled graphs (its FX graph and AOTAutograd
caches) under TORCHINDUCTOR_CACHE_DIR and Triton its kernels under TRITON_CACHE_DIR; by default
both live on the node (/tmp, ~/.triton), which a preempted job's next node does not have.
`CompileCache.setup` points both at `training.compile_cache_dir` (by default
`<job.dump_folder>/compile_cache`) before anything compiles, so that a restart on any node that
sees the folder loads the compiled code instead of compiling it again; Dynamo's tracing and the
CUDA-graph capture still run. A variable already set in the environment is left as the user set
it. Every rank uses the same folder: Inductor and Triton write each entry to a temporary file and
rename it into place, so ranks and runs may share it.

The caches key their entries on the traced graph, torch's and Triton's versions, the device and
the kernels' source, but not on the Python of flame's custom ops (their backward formulas and
fake implementations, `flame.ops`) that AOTAutograd traces into the graphs: each version of
flame's source (`source_fingerprint`) gets a subfolder of its own, so that a changed flame never
loads graphs compiled from the old one. The same fingerprint is the `cache_hash` that torch's
AOTAutograd cache asks of a selective activation-checkpointing policy
(`flame.train.parallel.recompute_elementwise`): without it, graphs with the policy are not cached.

torch also has a "mega-cache" (`torch.compiler.save_cache_artifacts` / `load_cache_artifacts`)
that packs the same entries into one blob for caches that do not survive; here the caches
themselves are in the folder that survives, so there is nothing to pack.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

logger = logging.getLogger("flame.train")

CACHE_VARIABLES = {"TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton"}
"""The environment variables of the caches, and the subfolder of the compile cache for each."""

OFF = "none"
"""training.compile_cache_dir's value that leaves the caches where torch and Triton put them."""

_set_by_flame: dict[str, str] = {}
"""The values that this process's flame put into the cache variables: a later run in the same
process (tests, benchmarks) may point them elsewhere; any other value is the user's."""


FLAME_SOURCE = Path(__file__).resolve().parents[1]
"""The folder of the flame package."""


def fingerprint(root: Path) -> str:
    """A hash of the Python source under `root`: every .py file, by relative path and content."""
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(b"\0")
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


@cache
def source_fingerprint() -> str:
    """The fingerprint of flame's own source, once per process."""
    return fingerprint(FLAME_SOURCE)


def cache_folder(setting: str, dump_folder: str) -> Path | None:
    """The compile cache's folder for training.compile_cache_dir = `setting` (absolute): "" is
    `<dump_folder>/compile_cache`, "none" is None (no cache of flame's), any other value a folder
    (relative to the working directory, like job.dump_folder). The folder of this version of
    flame's source is its subfolder `flame-<source_fingerprint()>`."""
    if setting.strip().lower() == OFF:
        return None
    base = Path(setting).expanduser() if setting else Path(dump_folder) / "compile_cache"
    return base.resolve() / f"flame-{source_fingerprint()}"


def count_entries(folders) -> int:
    """The files under `folders` (those that exist), each folder counted once."""
    total = 0
    for folder in {Path(f).resolve() for f in folders}:
        for _, _, files in os.walk(folder):
            total += len(files)
    return total


def user_setting(variable: str) -> str | None:
    """The value of the cache variable `variable` that the user set; None where it is unset or
    holds a value that flame or torch put there. torch sets TORCHINDUCTOR_CACHE_DIR to its default
    folder the first time it looks for it (importing Dynamo does), and TRITON_CACHE_DIR to
    `<Inductor's folder>/triton/<device>` when Inductor first compiles a kernel."""
    value = os.environ.get(variable)
    if value is None or value == _set_by_flame.get(variable):
        return None
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    inductor_folder = Path(default_cache_dir()).absolute()
    if variable == "TORCHINDUCTOR_CACHE_DIR":
        return None if Path(value).absolute() == inductor_folder else value
    inductor_folder = Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR", inductor_folder)).absolute()
    return None if Path(value).absolute().parent == inductor_folder / "triton" else value


def point_caches_at(folder: Path | None) -> dict[str, str]:
    """Set each cache variable to its subfolder of `folder`, unless the user set it
    (`user_setting`: then it is left alone); with `folder` None, remove the values that flame or
    torch set before in this process (torch's and Triton's defaults apply). Returns the variables
    that the user set, with their values."""
    settings = {variable: user_setting(variable) for variable in CACHE_VARIABLES}  # before any change
    from_user = {variable: value for variable, value in settings.items() if value is not None}
    for variable, subfolder in CACHE_VARIABLES.items():
        if variable in from_user:
            continue
        _set_by_flame.pop(variable, None)
        if folder is None:
            os.environ.pop(variable, None)
            continue
        path = folder / subfolder
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as err:  # errno and file name kept: the entry point prints one line
            raise OSError(err.errno, f"training.compile_cache_dir: cannot create the compile cache folder "
                          f"({err.strerror}); set training.compile_cache_dir to a writable folder, or to "
                          f"\"{OFF}\" to leave the caches where torch puts them", str(path)) from err
        os.environ[variable] = _set_by_flame[variable] = str(path)
    return from_user


def process_age() -> float | None:
    """Seconds since this process started (Linux /proc); None where that cannot be read."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: start time in ticks
    except (OSError, ValueError, IndexError):
        return None


@dataclass
class CompileCache:
    """Where a run's compiled code is cached, what the cache held at the start, and the report of
    the run's first step."""

    enabled: bool
    """training.compile is on: there is something to cache."""
    folder: Path | None = None
    """flame's folder of the caches (None: training.compile_cache_dir = "none")."""
    from_user: dict[str, str] = field(default_factory=dict)
    """Cache variables that the environment set, which point where the user said."""
    entries: int = 0
    """Files in the caches in use when the run started (counted on rank 0 only)."""
    reported: bool = False
    """The first step's line is logged."""

    @property
    def state(self) -> str:
        """"off" (no folder of flame's nor of the user's), "warm" (entries found) or "cold"."""
        if self.folder is None and not self.from_user:
            return "off"
        return "warm" if self.entries > 0 else "cold"

    @classmethod
    def setup(cls, training, dump_folder: str, rank: int = 0) -> "CompileCache":
        """Point the caches at training.compile_cache_dir when training.compile is on (before
        anything compiles), count what they hold (rank 0) and log it."""
        if not training.compile:
            return cls(enabled=False)
        folder = cache_folder(training.compile_cache_dir, dump_folder)
        from_user = point_caches_at(folder)
        in_use = [os.environ[variable] for variable in CACHE_VARIABLES if variable in os.environ]
        entries = count_entries(in_use) if rank == 0 and in_use else 0
        compile_cache = cls(enabled=True, folder=folder, from_user=from_user, entries=entries)
        logger.info("compile cache: %s", compile_cache.describe())
        return compile_cache

    def describe(self) -> str:
        """The start's log line: the folders, and the count of entries in them."""
        if self.state == "off":
            return (f"off (training.compile_cache_dir = \"{OFF}\"): Inductor and Triton cache on this "
                    f"node, in their default folders")
        where = [f"{variable}={value} (from the environment)" for variable, value in self.from_user.items()]
        if self.folder is not None and len(self.from_user) < len(CACHE_VARIABLES):
            where.insert(0, str(self.folder))
        return f"{', '.join(where)}, {self.entries} entries found ({self.state})"

    def first_step_done(self, step: int, seconds: float) -> None:
        """Log, once, how long the run's first step took (`seconds`, its compile included) and
        whether the cache was warm."""
        if not self.enabled or self.reported:
            return
        self.reported = True
        age = process_age()
        since = f", {age:.1f}s after the process started" if age is not None else ""
        logger.info("compile cache: the first step (step %d) took %.1fs, compile included%s (%s)", step,
                    seconds, since, "compile cache off" if self.state == "off" else f"{self.state} cache")
