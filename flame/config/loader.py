"""Load a job: one TOML file plus `--section.key value` overrides, into a validated `JobConfig`.

`load_config(argv)` is the only entry the trainer needs. It reads `--config FILE` (default:
`configs/tiny.toml` of the repository), applies the command-line overrides, checks every name,
type, range, choice and cross-field fact, and returns the config or raises `ConfigError` naming
every problem. `--print-config` and `--help` print to stdout and raise `SystemExit(0)` from inside
`load_config`, so the caller exits before any work starts.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import math
import sys
import tomllib
import types
import typing
from pathlib import Path
from typing import Any

import flame
from flame.config import job as job_schema
from flame.config.foreign_keys import FOREIGN_KEYS, foreign_hint
from flame.config.job import JobConfig

HELP_FLAGS = ("-h", "--help")
PRINT_FLAG = "--print-config"
CONFIG_FLAG = "--config"
CONFIG_FLAGS = (CONFIG_FLAG, "--job.config_file")
"""`--job.config_file FILE` is torchtitan's and fla-org/flame's spelling of `--config FILE`."""
NEGATIONS = ("no-", "no_")
"""Prefixes of other tools' false flags (`--no-training.compile`, `--training.no_compile`), which
flame answers with its own spelling, `--training.compile false`."""
BOOL_WORDS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
SCALAR_TYPES = (bool, int, float, str)


class ConfigError(ValueError):
    """A config file or command line that cannot be turned into a valid `JobConfig`."""


# ----------------------------------------------------------------------------------------------
# The schema, read from the dataclasses of job.py


@dataclasses.dataclass(frozen=True)
class Key:
    """One config key: its section, name, Python type, default, constraints and docstring."""

    section: str
    name: str
    type: Any
    default: Any
    constraints: dict
    doc: str

    @property
    def path(self) -> str:
        return f"{self.section}.{self.name}"


@functools.cache
def schema() -> dict[str, dict[str, Key]]:
    """{section: {key: Key}} in the order of job.py."""
    docs = _field_docstrings()
    sections: dict[str, dict[str, Key]] = {}
    for section_field in dataclasses.fields(JobConfig):
        section_cls = section_field.default_factory
        hints = typing.get_type_hints(section_cls)
        for name, tp in hints.items():
            item = typing.get_args(tp)[0] if typing.get_origin(tp) is list else tp
            if any(member not in SCALAR_TYPES for member in union_members(item)):
                raise TypeError(
                    f"{section_field.name}.{name}: field type {tp} is not supported by the config "
                    f"loader (use bool, int, float, str, a union of them such as bool | str, or a list "
                    f"of one of them)"
                )
        default_section = section_cls()
        sections[section_field.name] = {
            f.name: Key(
                section=section_field.name,
                name=f.name,
                type=hints[f.name],
                default=getattr(default_section, f.name),
                constraints=dict(f.metadata),
                doc=docs.get((section_cls.__name__, f.name), ""),
            )
            for f in dataclasses.fields(section_cls)
        }
    return sections


def _field_docstrings() -> dict[tuple[str, str], str]:
    """{(class name, field name): docstring}: the string literal right after each field."""
    tree = ast.parse(inspect.getsource(job_schema))
    docs = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        body = node.body
        for stmt, after in zip(body, body[1:]):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[(node.name, stmt.target.id)] = inspect.cleandoc(after.value.value)
    return docs


def union_members(tp: Any) -> tuple:
    """The types of a union annotation (`bool | str`), in its order; (tp,) for any other type."""
    return typing.get_args(tp) if isinstance(tp, types.UnionType) else (tp,)


def type_name(tp: Any) -> str:
    if typing.get_origin(tp) is list:
        return f"list of {type_name(typing.get_args(tp)[0])}"
    return " or ".join(member.__name__ for member in union_members(tp))


def _did_you_mean(name: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(name, choices, n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _unknown_section(name: str) -> str:
    valid = list(schema())
    suggestion = _did_you_mean(name, valid)
    return f"unknown section '{name}'{suggestion}; valid sections: {', '.join(valid)}"


def _unknown_key(section: str, name: str) -> str:
    """Suggests flame's key for another trainer's key (`flame.config.foreign_keys`), else the
    closest key of the section, or else the same key in another section."""
    valid = list(schema()[section])
    foreign = foreign_hint(f"{section}.{name}")
    suggestion = f" ({foreign})" if foreign else _did_you_mean(name, valid)
    if not suggestion:
        elsewhere = [f"{s}.{name}" for s, keys in schema().items() if name in keys]
        if elsewhere:
            suggestion = f" (did you mean {' or '.join(map(repr, elsewhere))}?)"
    return (
        f"unknown key '{section}.{name}'{suggestion}; "
        f"valid keys of [{section}]: {', '.join(valid)}"
    )


def _unknown_name(section: str, name: str) -> str:
    """The problem of `section.name`, which the schema lacks: an unknown key of a known section, a
    key of another trainer (whose section flame may lack), or else an unknown section."""
    if section in schema():
        return _unknown_key(section, name)
    foreign = foreign_hint(f"{section}.{name}")
    if foreign:
        return f"unknown key '{section}.{name}' ({foreign}); flame's sections: {', '.join(schema())}"
    return _unknown_section(section)


# ----------------------------------------------------------------------------------------------
# Values: type checks, command-line parsing, constraints


def _describe(value: Any) -> str:
    """'str 'ten'', 'float 1.5', 'table {...}': the type and value a user gave."""
    kind = {dict: "table", list: "array"}.get(type(value), type(value).__name__)
    return f"{kind} {value!r}"


def check_type(key: Key, value: Any, where: str = "") -> Any:
    """The value converted to the key's type (int -> float, integral float -> int); a value of
    another type is a ConfigError naming the key, the expected type and the value."""
    label = key.path + where
    tp = key.type
    if typing.get_origin(tp) is list:
        if not isinstance(value, list):
            raise ConfigError(f"{label}: expected {type_name(tp)}, got {_describe(value)}")
        item = Key(key.section, key.name, typing.get_args(tp)[0], None, {}, "")
        return [check_type(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(tp, types.UnionType):
        for member in union_members(tp):
            try:
                return check_type(dataclasses.replace(key, type=member), value, where)
            except ConfigError:
                pass
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if isinstance(value, int) and abs(value) > sys.float_info.max:
                raise ConfigError(f"{label}: expected a finite float, got an int too large for one")
            if not math.isfinite(value):
                raise ConfigError(f"{label}: expected a finite float, got {value!r}")
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    raise ConfigError(f"{label}: expected {type_name(tp)}, got {_describe(value)}")


def parse_cli_value(key: Key, text: str) -> Any:
    """A command-line string parsed by the key's type; unparseable text stays a string, so that
    `check_type` reports it ("expected int, got str 'ten'")."""
    tp = key.type
    if typing.get_origin(tp) is list:
        stripped = text.strip()
        if stripped.startswith("["):
            try:
                return tomllib.loads(f"value = {stripped}")["value"]
            except tomllib.TOMLDecodeError as e:
                raise ConfigError(
                    f"{key.path}: cannot parse {text!r} as a TOML array ({e}); "
                    f"write it like [0.9, 0.95] or as comma-separated values 0.9,0.95"
                ) from None
        if not stripped:
            return []
        item = Key(key.section, key.name, typing.get_args(tp)[0], None, {}, "")
        return [parse_cli_value(item, part.strip()) for part in stripped.split(",")]
    if isinstance(tp, types.UnionType):  # the first member type that reads the text
        for member in union_members(tp):
            value = parse_cli_value(dataclasses.replace(key, type=member), text)
            if member is str or not isinstance(value, str):
                return value
        return text
    if tp is bool:
        return BOOL_WORDS.get(text.strip().lower(), text)
    if tp is int:
        for parse in (int, float):
            try:
                return parse(text)
            except ValueError:
                pass
        return text
    if tp is float:
        try:
            return float(text)
        except ValueError:
            return text
    return text


def check_constraints(key: Key, value: Any) -> list[str]:
    """Problems of a well-typed value against the key's metadata: choices, ge, gt, le, lt, ne
    (numbers), nonempty, length, item_range (lists: each item in [low, high)), item_choices (lists:
    each item one of them, none twice)."""
    c = key.constraints
    problems = []
    if "choices" in c and value not in c["choices"]:
        choices = ", ".join(map(_choice_text, c["choices"]))
        hint = ""
        if isinstance(value, str) and value.lower() in BOOL_WORDS and bool in union_members(key.type):
            hint = " (a string; write true or false without quotes)"
        problems.append(f"{key.path} must be one of {choices}, got {value!r}{hint}")
    for op, test in (
        ("ge", lambda a, b: a >= b),
        ("gt", lambda a, b: a > b),
        ("le", lambda a, b: a <= b),
        ("lt", lambda a, b: a < b),
        ("ne", lambda a, b: a != b),
    ):
        if op in c and not test(value, c[op]):
            symbol = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<", "ne": "!="}[op]
            problems.append(f"{key.path} must be {symbol} {c[op]}, got {value!r}")
    if c.get("nonempty") and len(value) == 0:
        problems.append(f"{key.path} must not be empty")
    if "length" in c and len(value) != c["length"]:
        problems.append(f"{key.path} must have {c['length']} values, got {len(value)}: {value!r}")
    if "item_range" in c:
        low, high = c["item_range"]
        if any(not low <= v < high for v in value):
            problems.append(f"{key.path} values must each be in [{low}, {high}), got {value!r}")
    if "item_choices" in c:
        unknown = [v for v in value if v not in c["item_choices"]]
        if unknown:
            choices = ", ".join(map(str, c["item_choices"]))
            problems.append(f"{key.path}: {', '.join(map(str, unknown))} not among {choices}")
        repeated = sorted({v for v in value if value.count(v) > 1})
        if repeated:
            problems.append(f"{key.path} names {', '.join(map(str, repeated))} more than once")
    return problems


def cross_field_problems(cfg: JobConfig) -> list[str]:
    """Facts that involve several keys and can be checked from the config alone."""
    m, problems = cfg.model, []
    if m.family in ("rwkv6", "rwkv7") and m.head_dim > 0 and m.hidden_size % m.head_dim:
        problems.append(
            f"model.hidden_size ({m.hidden_size}) must be divisible by model.head_dim "
            f"({m.head_dim}) for {m.family}"
        )
    if m.family == "gsa":
        if m.num_heads > 0 and m.hidden_size % m.num_heads:
            problems.append(
                f"model.hidden_size ({m.hidden_size}) must be divisible by model.num_heads "
                f"({m.num_heads}) for gsa"
            )
        if m.num_kv_heads > 0 and m.num_heads % m.num_kv_heads:
            problems.append(
                f"model.num_heads ({m.num_heads}) must be divisible by model.num_kv_heads "
                f"({m.num_kv_heads}) for grouped queries"
            )
    if cfg.parallel.fsdp_hold_weights is True and cfg.parallel.reshard_after_forward != "default":
        problems.append(
            f"parallel.reshard_after_forward = {cfg.parallel.reshard_after_forward!r} applies only "
            f"to freed weights, not with parallel.fsdp_hold_weights = true (held weights stay gathered "
            f"over the step); set it to false, or to \"auto\" to let memory choose"
        )
    if cfg.lr_scheduler.lr_min > cfg.optimizer.lr:
        problems.append(
            f"lr_scheduler.lr_min ({cfg.lr_scheduler.lr_min}) must be <= optimizer.lr "
            f"({cfg.optimizer.lr}): it is an absolute learning rate, not a factor of optimizer.lr "
            f"as in fla-org/flame and torchtitan"
        )
    if cfg.data.dataset in ("json", "parquet", "text") and not cfg.data.data_files:
        problems.append(
            f"data.data_files must name at least one file when data.dataset is "
            f"'{cfg.data.dataset}' (a local dataset type)"
        )
    if cfg.metrics.val_freq > 0 and cfg.data.val_fraction == 0:
        problems.append(
            f"metrics.val_freq ({cfg.metrics.val_freq}) asks for validation, but "
            f"data.val_fraction = 0 disables the validation split; set one of them"
        )
    if cfg.training.nan_recovery and not cfg.checkpoint.enable:
        problems.append(
            "training.nan_recovery needs checkpoint.enable = true "
            "(it reloads the last good checkpoint)"
        )
    if cfg.checkpoint.interval_minutes > 0 and not cfg.checkpoint.enable:
        problems.append(
            f"checkpoint.interval_minutes ({cfg.checkpoint.interval_minutes}) asks for timed saves, "
            f"but checkpoint.enable = false"
        )
    return problems


# ----------------------------------------------------------------------------------------------
# From raw TOML data to a JobConfig


def config_from_dict(data: dict, origin: dict[str, str] | None = None) -> JobConfig:
    """A validated JobConfig from {section: {key: value}} (as tomllib returns it); absent keys
    take their defaults. `origin` maps "section" and "section.key" to where they came from
    ("in FILE", "from --OPTION"), for messages. Raises ConfigError listing every problem found."""
    origin = origin or {}
    known = schema()
    problems: list[str] = []
    sections: dict[str, dict[str, Any]] = {}
    for name, table in data.items():
        if name not in known:
            owners = [s for s, keys in known.items() if name in keys]
            if owners and not isinstance(table, dict):
                under = " or ".join(f"[{s}]" for s in owners)
                problem = f"top-level key '{name}' must be inside a section: put it under {under}"
            elif isinstance(table, dict) and any(f"{name}.{key}" in FOREIGN_KEYS for key in table):
                # another trainer's section ([parallelism], [compile]): flame's key for each key
                found = {_unknown_name(name, key): origin.get(f"{name}.{key}") for key in table}
                problems += [_with_origin(problem, where) for problem, where in found.items()]
                continue
            else:
                problem = _unknown_section(name)
            problems.append(_with_origin(problem, origin.get(name)))
            continue
        if not isinstance(table, dict):
            problem = f"'{name}' must be a section ([{name}]), got {_describe(table)}"
            problems.append(_with_origin(problem, origin.get(name)))
            continue
        sections[name] = {}
        for key_name, value in table.items():
            where = origin.get(f"{name}.{key_name}")
            if key_name not in known[name]:
                problems.append(_with_origin(_unknown_key(name, key_name), where))
                continue
            key = known[name][key_name]
            try:
                sections[name][key_name] = check_type(key, value)
            except ConfigError as e:
                problems.append(_with_origin(str(e), where))
                continue
            for problem in check_constraints(key, sections[name][key_name]):
                problems.append(_with_origin(problem, where))
    if problems:
        raise ConfigError(_join(problems))
    section_classes = {f.name: f.default_factory for f in dataclasses.fields(JobConfig)}
    cfg = JobConfig(**{name: section_classes[name](**sections.get(name, {})) for name in known})
    problems = cross_field_problems(cfg)
    if problems:
        raise ConfigError(_join(problems))
    return cfg


def _with_origin(message: str, origin: str | None) -> str:
    return f"{message} ({origin})" if origin else message


def _join(problems: list[str]) -> str:
    if len(problems) == 1:
        return problems[0]
    return f"{len(problems)} problems in the config:\n" + "\n".join(f"  - {p}" for p in problems)


def read_toml(path: Path) -> dict:
    """The parsed TOML file; a missing file or a syntax error is a ConfigError naming the file."""
    if not path.exists():
        raise ConfigError(f"config file not found: {path}")
    if not path.is_file():
        raise ConfigError(f"config path is not a file: {path}")
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text: {e}") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e}") from None


def default_config_path() -> Path:
    return Path(flame.__file__).parents[1] / "configs" / "tiny.toml"


# ----------------------------------------------------------------------------------------------
# The command line


@dataclasses.dataclass
class CommandLine:
    config: Path | None = None
    print_config: bool = False
    help: bool = False
    overrides: dict[str, str] = dataclasses.field(default_factory=dict)
    """{"section.key": raw text}, in command-line order."""


def parse_command_line(argv: list[str]) -> CommandLine:
    """Split argv into --config (or --job.config_file), --print-config, --help and --section.key
    overrides (raw text; a boolean key given alone is "true")."""
    cl = CommandLine()
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if arg in HELP_FLAGS:
            cl.help = True
            continue
        if arg == PRINT_FLAG:
            cl.print_config = True
            continue
        if not arg.startswith("--") or arg == "--":
            raise ConfigError(
                f"unexpected argument {arg!r}; options are --config FILE, --print-config, "
                f"--help and overrides like --training.steps 100"
            )
        name, has_value, value = arg[2:].partition("=")
        flag = f"--{name}"
        if flag in (PRINT_FLAG, *HELP_FLAGS):
            raise ConfigError(f"{flag} takes no value, got {arg!r}")
        if flag not in CONFIG_FLAGS and "." not in name:
            options = ["config", "print-config", "help"]
            raise ConfigError(
                f"unknown option '{arg}'{_did_you_mean(name, options)}; overrides look like "
                f"--section.key VALUE (e.g. --training.steps 100)"
            )
        if flag not in CONFIG_FLAGS:
            _check_not_negated(name)
        if not has_value:
            if i >= len(argv) or argv[i].startswith("--"):
                value = _bare_flag_value(flag)
            else:
                value = argv[i]
                i += 1
        if flag in CONFIG_FLAGS:
            if cl.config is not None:
                raise ConfigError(f"--config given twice: {str(cl.config)!r} and {value!r} "
                                  f"(--job.config_file is the same option)")
            cl.config = Path(value)
            continue
        if name in cl.overrides:
            raise ConfigError(
                f"{flag} given twice on the command line ({cl.overrides[name]!r} and {value!r}); "
                f"give each key once"
            )
        cl.overrides[name] = value
    return cl


def _bare_flag_value(flag: str) -> str:
    """The value of an option given without one: "true" for a boolean key. Any other is an error;
    for a key flame lacks, the unknown-key message (with flame's key for another trainer's flag,
    such as fla-org/flame's `--checkpoint.enable_checkpoint`)."""
    section, _, name = flag[2:].partition(".")
    key = schema().get(section, {}).get(name)
    if key is not None and key.type is bool:
        return "true"
    if key is None and flag not in CONFIG_FLAGS:
        raise ConfigError(_with_origin(_unknown_name(section, name), f"from {flag}"))
    raise ConfigError(f"{flag} needs a value (e.g. {flag} VALUE or {flag}=VALUE)")


def _check_not_negated(name: str) -> None:
    """Refuse another tool's false flag (`--no-training.compile`, `--training.no_compile`) with
    flame's spelling of it; a name that is not one passes."""
    section, _, key = name.partition(".")
    if section in schema() and key in schema()[section]:
        return
    for prefix in NEGATIONS:
        for negated, rest in ((section, f"{section.removeprefix(prefix)}.{key}"),
                              (key, f"{section}.{key.removeprefix(prefix)}")):
            if not negated.startswith(prefix):
                continue
            target = FOREIGN_KEYS[rest].flame_key if rest in FOREIGN_KEYS else rest
            target_section, _, target_name = target.partition(".")
            found = schema().get(target_section, {}).get(target_name)
            if found is not None and found.type is bool:
                raise ConfigError(f"--{name}: flame turns a boolean key off with "
                                  f"--{found.path} false (and on with --{found.path})")


def apply_overrides(data: dict, overrides: dict[str, str], origin: dict[str, str]) -> None:
    """Write the overrides into the TOML data, parsed by their key's type, and where each came
    from into `origin` (both in place). Unknown names are written as given, for
    `config_from_dict` to report together with every other problem."""
    known = schema()
    for path, text in overrides.items():
        section, _, name = path.partition(".")
        table = data.setdefault(section, {})
        if not isinstance(table, dict):
            continue  # config_from_dict reports the section that is not a table
        key = known.get(section, {}).get(name)
        table[name] = text if key is None else parse_cli_value(key, text)
        origin[path] = f"from --{path}"
        origin.setdefault(section, f"from --{path}")


def load_config(argv: list[str] | None = None) -> JobConfig:
    """The job config from the command line (default: sys.argv[1:]).

    `--config FILE` (default `configs/tiny.toml` of the repository), overrides
    `--section.key VALUE` / `--section.key=VALUE` win over the file. With `--print-config`
    the resolved config is printed as TOML and `SystemExit(0)` is raised; `--help` prints the
    reference of every key and raises `SystemExit(0)`. Raises ConfigError for any bad input.
    """
    cl = parse_command_line(sys.argv[1:] if argv is None else list(argv))
    if cl.help:
        print(help_text())
        raise SystemExit(0)
    path = cl.config
    if path is None:
        path = default_config_path()
        if not path.exists():
            raise ConfigError(
                f"no --config given and the default config {path} does not exist; "
                f"pass --config FILE"
            )
    data = read_toml(path)
    origin = {section: f"in {path}" for section in data}
    for section, table in data.items():
        if isinstance(table, dict):
            origin.update({f"{section}.{key}": f"in {path}" for key in table})
    apply_overrides(data, cl.overrides, origin)
    cfg = config_from_dict(data, origin)
    if cl.print_config:
        print(to_toml(cfg), end="")
        raise SystemExit(0)
    return cfg


# ----------------------------------------------------------------------------------------------
# Output


def to_dict(cfg: JobConfig) -> dict[str, dict[str, Any]]:
    """{section: {key: value}}, a deep copy."""
    return dataclasses.asdict(cfg)


def to_toml(cfg: JobConfig) -> str:
    """The config as TOML text that tomllib reads back into an equal config."""
    blocks = []
    for section, values in to_dict(cfg).items():
        lines = [f"[{section}]"]
        lines += [f"{key} = {_toml_value(value)}" for key, value in values.items()]
        blocks.append("\n".join(lines) + "\n")
    return "\n".join(blocks)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)  # shortest text that round-trips; always has '.', 'e' or is inf/nan
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} {value!r} as TOML")


_TOML_ESCAPES = {
    '"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"
}


def _toml_string(text: str) -> str:
    out = []
    for ch in text:
        if ch in _TOML_ESCAPES:
            out.append(_TOML_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def help_text() -> str:
    """Every section and key with its type, default, constraints and docstring."""
    lines = [
        "usage: python -m flame.train [--config FILE] [--print-config] [-h]",
        "                             [--section.key VALUE | --section.key=VALUE ...]",
        "",
        "  --config FILE     the job's TOML file (default: configs/tiny.toml of the repository);",
        "                    --job.config_file FILE is the same option",
        "  --print-config    print the resolved config as TOML and exit",
        "  -h, --help        show this reference and exit",
        "",
        "Values are parsed by the key's type: bool true/false/1/0/yes/no, and a bool key given",
        "alone means true (--training.compile; --training.compile false turns it off); lists as a",
        "TOML array [0.9, 0.95] or comma-separated 0.9,0.95; strings verbatim. A key of",
        "fla-org/flame or torchtitan that flame names otherwise is refused with flame's name for it",
        "(the table is in docs/config.md).",
    ]
    for section, keys in schema().items():
        lines += ["", f"[{section}]"]
        for key in keys.values():
            rules = _describe_constraints(key.constraints)
            default = _toml_value(key.default)
            lines.append(f"  {key.name} ({type_name(key.type)}, default {default}{rules})")
            for doc_line in key.doc.splitlines():
                lines.append(f"      {doc_line}")
    return "\n".join(lines)


def _choice_text(choice: Any) -> str:
    """A choice as a config file writes it, quotes aside: true and false for bools."""
    return _toml_value(choice) if isinstance(choice, bool) else str(choice)


def _describe_constraints(c: dict) -> str:
    parts = []
    if "choices" in c:
        parts.append("one of " + "/".join(map(_choice_text, c["choices"])))
    for op, symbol in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"), ("ne", "!=")):
        if op in c:
            parts.append(f"{symbol} {c[op]}")
    if c.get("nonempty"):
        parts.append("non-empty")
    if "length" in c:
        parts.append(f"{c['length']} values")
    if "item_range" in c:
        parts.append("each in [{}, {})".format(*c["item_range"]))
    if "item_choices" in c:
        parts.append("each one of " + "/".join(map(str, c["item_choices"])))
    return "; " + ", ".join(parts) if parts else ""
