"""`python -m flame.config [--config FILE] [--section.key VALUE ...]`: check a job config and print
it resolved, as TOML (the same as `--print-config`); a bad config prints the error and exits 2."""

import sys

from flame.config.loader import ConfigError, load_config, to_toml


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = load_config(sys.argv[1:] if argv is None else argv)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    print(to_toml(cfg), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
