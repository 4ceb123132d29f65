"""Steps per second of the reference scheduler, checked vs bare.

"checked": every step goes through ``kvspec.harness.runner.Runner`` (relations,
every invariant, the data oracle's worker model). "bare": the same target and
environment connector, stepped directly with a trivial worker (sampled tokens
only, no content model, no checks). Both run side by side in one process, so
their ratio is comparable; absolute numbers depend on the machine.

Workload: ``N`` concurrent requests (max_num_seqs = N), prompts of 16 tokens
whose first 8 tokens are one of 8 shared prefixes, ``max_tokens`` = 32; a
finished request is replaced at once so ``N`` requests stay alive.

    python bench/bench_steps.py                 # 5 s per configuration
    python bench/bench_steps.py --seconds 2 --concurrency 1 16
"""
from __future__ import annotations

from pathlib import Path

from drivers import PRODUCTION, WORKLOADS, compare, environment, parse_args, write_and_print

DEFAULT_OUT = Path(__file__).resolve().parent / "results.json"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(__doc__, DEFAULT_OUT, argv)

    rows = [compare("impl", n, args.seconds, (1, 999)) for n in args.concurrency]
    if args.production:
        rows.append(compare("impl", args.production, args.seconds, (1, 999), PRODUCTION))
    result = {
        "note": ("steps/s of the reference implementation; bare and checked were measured "
                 "side by side in one run, so ratios compare, absolute numbers depend on "
                 "the machine"),
        **environment(args.seconds), "workloads": WORKLOADS, "results": rows,
    }
    write_and_print(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
