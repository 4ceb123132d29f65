#!/usr/bin/env bash
# kvspec's review of a vLLM pull request, as a plain shell script (docs/ci/README.md).
#
#   docs/ci/kvspec-review.sh BASE HEAD
#
# BASE and HEAD are the vLLM before and after the change: checkouts, wheels or
# sdists, or git refs of $KVSPEC_REPO; HEAD may also be a patch of BASE (a pull
# request's .diff, or - for one piped in: gh pr diff 123 | kvspec-review.sh BASE -). Runs `kvspec review` within the budget and
# leaves in $KVSPEC_REPORTS: review.md (the pull-request comment; also appended to
# $GITHUB_STEP_SUMMARY when that is set), review.json and the traces.
#
# Fails only on what the change did: exit 1 for a regression (a counterexample on
# HEAD that BASE does not have). Findings BASE has too are reported, not failed.
# An incomplete review (exit 3: a fix stopped fitting, the budget was spent before
# the check ran, the change was never exercised) fails too, with its reason, since a
# green there would say nothing; KVSPEC_ALLOW_INCOMPLETE=1 turns it into a warning.
#
# An interrupted review (exit 130: the job cancelled, SIGINT or SIGTERM) says so in
# review.md and fails: it is no verdict either way.
#
# Settings (environment): KVSPEC_BUDGET (default 10m), or KVSPEC_EXAMPLES (a budget
# in runs instead: the same verdict on any runner, however fast) with, optionally,
# KVSPEC_TIME_LIMIT (its wall-clock safety net, e.g. 30m: set it below the job's
# timeout so that review.md is written; a review it cuts short is incomplete unless
# it found a regression), KVSPEC_SEED (0), KVSPEC_REPO, KVSPEC_REPORTS
# (./kvspec-review), KVSPEC (the kvspec command).
set -uo pipefail

if [ $# -ne 2 ]; then
    echo "usage: $0 BASE HEAD" >&2
    exit 2
fi
KVSPEC=${KVSPEC:-kvspec}
OUT=${KVSPEC_REPORTS:-$PWD/kvspec-review}
if [ -n "${KVSPEC_EXAMPLES:-}" ] && [ -n "${KVSPEC_BUDGET:-}" ]; then
    echo "$0: KVSPEC_EXAMPLES is a budget in runs instead of KVSPEC_BUDGET: set one of them" >&2
    exit 2
fi
if [ -n "${KVSPEC_TIME_LIMIT:-}" ] && [ -z "${KVSPEC_EXAMPLES:-}" ]; then
    echo "$0: KVSPEC_TIME_LIMIT is the safety net of KVSPEC_EXAMPLES (KVSPEC_BUDGET is a time limit already)" >&2
    exit 2
fi
if [ -n "${KVSPEC_EXAMPLES:-}" ]; then
    args=(--examples "$KVSPEC_EXAMPLES")
    if [ -n "${KVSPEC_TIME_LIMIT:-}" ]; then
        args+=(--time-limit "$KVSPEC_TIME_LIMIT")
    fi
else
    args=(--budget "${KVSPEC_BUDGET:-10m}")
fi
args+=(--seed "${KVSPEC_SEED:-0}" --out "$OUT" --markdown "$OUT/review.md")
if [ -n "${KVSPEC_REPO:-}" ]; then
    args+=(--repo "$KVSPEC_REPO")
fi
mkdir -p "$OUT"

status=0
HF_HUB_OFFLINE=1 $KVSPEC review "$1" "$2" "${args[@]}" --json > "$OUT/review.json" || status=$?
if [ -n "${GITHUB_STEP_SUMMARY:-}" ] && [ -f "$OUT/review.md" ]; then
    cat "$OUT/review.md" >> "$GITHUB_STEP_SUMMARY"
fi
case "$status" in
    0) echo "kvspec-review: no regression" >&2 ;;
    1) echo "kvspec-review: REGRESSION (see $OUT/review.md)" >&2 ;;
    3) if [ "${KVSPEC_ALLOW_INCOMPLETE:-0}" = 1 ]; then
           echo "kvspec-review: incomplete, allowed by KVSPEC_ALLOW_INCOMPLETE (see $OUT/review.md)" >&2
           status=0
       else
           echo "kvspec-review: INCOMPLETE: nothing was shown either way (see $OUT/review.md)" >&2
       fi ;;
    130) echo "kvspec-review: INTERRUPTED: a partial review, no verdict (see $OUT/review.md)" >&2 ;;
    *) echo "kvspec-review: kvspec exited $status" >&2 ;;
esac
exit "$status"
