"""`python -m kimi_perf` and the `kimi-perf` command: the CLI, with an interruption while
it is still being imported (numpy, pyarrow: a few tenths of a second) said as one during a
command is, not as a traceback of the import."""

import sys


def main() -> None:
    try:
        from kimi_perf.cli import main as cli
    except KeyboardInterrupt:
        print("kimi-perf: interrupted", file=sys.stderr)
        sys.exit(130)
    cli()


if __name__ == "__main__":
    main()
