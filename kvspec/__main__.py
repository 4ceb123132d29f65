"""``python -m kvspec`` and the ``kvspec`` console script.

The hash seed is pinned before anything heavy is imported (the process may
start again, see kvspec/hashseed.py). Importing the command line takes a
second or more (typer, rich, Hypothesis); an interrupt in that second is an
interrupt like any other: "kvspec: interrupted", exit 130, no traceback.
"""
import sys


def main() -> None:
    try:
        from kvspec.hashseed import pin_hash_seed
        pin_hash_seed()
        from kvspec.gc_policy import tune_collector
        tune_collector()
        from kvspec.cli import main as run_command_line
    except KeyboardInterrupt:
        print("kvspec: interrupted", file=sys.stderr)
        exec("pass", {})  # noqa: S102 (interrupt.forget_caught_interrupt, not importable yet)
        sys.exit(130)
    run_command_line()


if __name__ == "__main__":
    main()
