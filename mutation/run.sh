#!/usr/bin/env bash
# Mutation testing of the reference scheduler's core (impl/scheduler.py,
# impl/recovery.py) with cosmic-ray, judged by the spec-driven killer suite
# (mutation/test_killer.py + tests/test_scenarios.py).
#
# cosmic-ray mutates the files IN PLACE, one mutant at a time, and restores
# them: run it on a clean checkout that nothing else imports from meanwhile.
#   bash mutation/run.sh               # every mutant (~800; hours on one core)
#   SAMPLE=150 bash mutation/run.sh    # a uniform random sample (seed 0)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
SESSION=${SESSION:-.kvspec/mutation.sqlite}
SAMPLE=${SAMPLE:-0}
python -m pip install -q "cosmic-ray>=8.3"
mkdir -p "$(dirname "$SESSION")"
rm -f "$SESSION"
cosmic-ray init mutation/cosmic-ray.toml "$SESSION"
if [ "$SAMPLE" -gt 0 ]; then
    python mutation/sample.py "$SESSION" "$SAMPLE"
fi
cosmic-ray exec mutation/cosmic-ray.toml "$SESSION"
cr-report "$SESSION" --show-pending
