#!/usr/bin/env bash
# Build Horovod 0.28.1 (PyTorch + Gloo + MPI, CPU only) against the torch that is
# already installed in a virtualenv, and install it into that virtualenv.
#
# Usage:  bash scripts/install_horovod.sh [/path/to/venv]     (default: .venv)
#
# Idempotent:
#   1. If `import horovod.torch` already works in the venv with horovod 0.28.1 built
#      against the venv's torch, print one line and exit 0.
#   2. Else, if a wheel is cached in
#        ${SPARTA_CACHE_DIR:-$HOME/.cache/sparta}/wheels/horovod-0.28.1-torch<ver>-<pytag>/
#      and matches the <wheel>.sha256 written beside it when it was built, install it
#      (pip --no-deps, plus horovod's runtime deps) and exit.
#   3. Else take the sdist (cached in .../sdist/ if it matches the sha256 PyPI publishes,
#      else downloaded), patch it for C++17 (torch >= 2.1 headers need it), build a wheel
#      with --no-build-isolation and one make job per CPU, cache it with its .sha256,
#      install it.
# A cached file that fails its hash is deleted (with a log line) and fetched or built again.
#
# torch is never installed or upgraded by this script.
#
# Environment knobs:
#   SPARTA_CACHE_DIR    cache root (default $HOME/.cache/sparta)
#   SPARTA_BUILD_JOBS   parallel make jobs (default: the CPUs this process may run on)
#   HOROVOD_CMAKE       cmake binary to use (default: system cmake if >= 3.13)
set -euo pipefail

HVD_VERSION="0.28.1"
# sha256 of horovod-0.28.1.tar.gz as PyPI publishes it (https://pypi.org/simple/horovod/).
SDIST_SHA256="92a43f5a94c43907a56805bad15f19700c62ffc83b7ca483f9e104e229f67ef0"

log()  { echo "[install_horovod] $*"; }
die()  { echo "[install_horovod] ERROR: $*" >&2; exit 1; }

VENV="${1:-.venv}"
[[ -d "$VENV" ]] || die "venv directory '$VENV' does not exist (create it with: python3 -m venv $VENV)"
VENV="$(cd "$VENV" && pwd)"
PY="$VENV/bin/python"
[[ -x "$PY" ]] || die "'$PY' is not an executable python; is '$VENV' a virtualenv?"

export PIP_DISABLE_PIP_VERSION_CHECK=1
export PIP_NO_INPUT=1
pip_() { "$PY" -m pip "$@"; }

# Runtime requirements of horovod 0.28.1 (setup.py: require_list, cffi added because
# the PyTorch extension is enabled). torch itself is deliberately NOT listed.
RUNTIME_DEPS=(cloudpickle psutil pyyaml packaging "cffi>=1.4.0")

# --------------------------------------------------------------------------------------
# Probe the venv in ONE python call: torch version, python tag, and whether
# horovod.torch imports (with the right version, built against this torch).
# --------------------------------------------------------------------------------------
probe() {
    "$PY" - "$HVD_VERSION" <<'EOF'
import json, os, sys
want = sys.argv[1]
tag = "cp%d%d" % sys.version_info[:2]
try:
    import torch
except Exception as e:  # noqa: BLE001
    print("NOTORCH", "-", tag, ("%s: %s" % (type(e).__name__, e)).replace("\n", " "))
    sys.exit(0)
tv = torch.__version__
try:
    import horovod
    hv = getattr(horovod, "__version__", "?")
    if hv != want:
        print("NOHVD", tv, tag, "installed horovod is %s, want %s" % (hv, want))
        sys.exit(0)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import horovod.torch as hvd  # noqa: F401
    meta = os.path.join(os.path.dirname(horovod.__file__), "metadata.json")
    built = None
    if os.path.exists(meta):
        with open(meta) as f:
            built = json.load(f).get("pytorch")
    if built is not None and built != tv:
        print("NOHVD", tv, tag, "horovod was built against torch %s, venv has %s" % (built, tv))
        sys.exit(0)
    print("OK", tv, tag, "gloo=%s mpi=%s" % (hvd.gloo_built(), hvd.mpi_built()))
except Exception as e:  # noqa: BLE001
    print("NOHVD", tv, tag, ("%s: %s" % (type(e).__name__, e)).replace("\n", " ")[:300])
EOF
}

read -r STATE TORCH_VER PY_TAG REST < <(probe) || true
case "${STATE:-}" in
    OK)
        log "horovod ${HVD_VERSION} already installed in $VENV (torch ${TORCH_VER}, ${PY_TAG}, ${REST}); nothing to do."
        exit 0 ;;
    NOTORCH)
        die "torch is not importable in $VENV (${REST:-}); install torch first (this script never installs torch)." ;;
    NOHVD)
        log "horovod.torch not usable in $VENV yet: ${REST}" ;;
    *)
        die "could not probe $PY (is it a working python?)" ;;
esac

CACHE_ROOT="${SPARTA_CACHE_DIR:-$HOME/.cache/sparta}"
WHEEL_DIR="$CACHE_ROOT/wheels/horovod-${HVD_VERSION}-torch${TORCH_VER}-${PY_TAG}"
SDIST_DIR="$CACHE_ROOT/sdist"
LOG_DIR="$CACHE_ROOT/logs"

install_runtime_deps() {
    log "installing horovod runtime deps: ${RUNTIME_DEPS[*]}"
    pip_ install -q "${RUNTIME_DEPS[@]}"
}

verify_import() {
    local out
    read -r out _ _ _ < <(probe) || true
    [[ "${out:-}" == "OK" ]]
}

find_cached_wheel() {
    local w
    for w in "$WHEEL_DIR"/horovod-"${HVD_VERSION}"-*.whl; do
        [[ -f "$w" ]] && { echo "$w"; return 0; }
    done
    return 1
}

sha256_of() { sha256sum "$1" | cut -d' ' -f1; }

# --------------------------------------------------------------------------------------
# Cache path
# --------------------------------------------------------------------------------------
if WHEEL="$(find_cached_wheel)"; then
    WANT="$(cut -d' ' -f1 "$WHEEL.sha256" 2>/dev/null || true)"
    GOT="$(sha256_of "$WHEEL")"
    if [[ "$GOT" != "${WANT:-none}" ]]; then
        log "cached wheel $WHEEL has sha256 $GOT, its $(basename "$WHEEL").sha256 says ${WANT:-nothing (file missing)}; removing it and rebuilding from source."
        rm -f "$WHEEL" "$WHEEL.sha256"
        unset WHEEL
    fi
fi
if [[ -n "${WHEEL:-}" ]]; then
    log "installing cached wheel $WHEEL (sha256 matches)"
    install_runtime_deps
    pip_ install -q --no-deps --force-reinstall "$WHEEL"
    if verify_import; then
        log "horovod ${HVD_VERSION} installed from cache into $VENV."
        exit 0
    fi
    log "cached wheel does not import correctly; removing it and rebuilding from source."
    rm -f "$WHEEL" "$WHEEL.sha256"
fi

# --------------------------------------------------------------------------------------
# Build path: prerequisites
# --------------------------------------------------------------------------------------
command -v mpicxx >/dev/null 2>&1 || die "mpicxx not found. Horovod is built with MPI support; install Open MPI first: apt-get install -y openmpi-bin libopenmpi-dev"
command -v mpirun >/dev/null 2>&1 || die "mpirun not found. Install Open MPI: apt-get install -y openmpi-bin libopenmpi-dev"
command -v g++ >/dev/null 2>&1 || command -v c++ >/dev/null 2>&1 || die "no C++ compiler found. Install one: apt-get install -y build-essential"
command -v make >/dev/null 2>&1 || die "make not found. Install it: apt-get install -y build-essential"

PY_INC="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
[[ -f "$PY_INC/Python.h" ]] || die "Python.h not found in $PY_INC. Install the Python development headers (Debian system python: apt-get install -y python3-dev)."

# --------------------------------------------------------------------------------------
# Build path: temp dir, build deps, cmake
# --------------------------------------------------------------------------------------
TMP="$(mktemp -d "${TMPDIR:-/tmp}/horovod-build.XXXXXX")"
cleanup() { rm -rf "$TMP"; }
trap cleanup EXIT

log "installing build deps into $VENV (setuptools, wheel) and runtime deps"
# setup.py has setup_requires=<runtime deps> for build actions, so they must be present
# before the --no-build-isolation build (setuptools would otherwise try to fetch them).
pip_ install -q "setuptools>=40.8" wheel
install_runtime_deps

cmake_ok() {  # $1 = cmake binary; true if version >= 3.13
    local v
    v="$("$1" --version 2>/dev/null | sed -n 's/^cmake version \([0-9][0-9]*\)\.\([0-9][0-9]*\).*/\1 \2/p')" || return 1
    [[ -n "$v" ]] || return 1
    set -- $v
    (( $1 > 3 || ($1 == 3 && $2 >= 13) ))
}
if [[ -z "${HOROVOD_CMAKE:-}" ]]; then
    if command -v cmake >/dev/null 2>&1 && cmake_ok "$(command -v cmake)"; then
        HOROVOD_CMAKE="$(command -v cmake)"
    else
        log "no system cmake >= 3.13; installing the 'cmake' package into $VENV"
        pip_ install -q "cmake>=3.13,<4"
        HOROVOD_CMAKE="$VENV/bin/cmake"
    fi
fi
export HOROVOD_CMAKE
log "using cmake: $HOROVOD_CMAKE ($("$HOROVOD_CMAKE" --version | head -n1))"

# --------------------------------------------------------------------------------------
# Build path: sdist (cached), extract, patch
# --------------------------------------------------------------------------------------
SDIST="$SDIST_DIR/horovod-${HVD_VERSION}.tar.gz"
if [[ -f "$SDIST" ]]; then
    GOT="$(sha256_of "$SDIST")"
    if [[ "$GOT" == "$SDIST_SHA256" ]]; then
        log "using cached sdist $SDIST (sha256 matches PyPI's)"
    else
        log "cached sdist $SDIST has sha256 $GOT, PyPI publishes $SDIST_SHA256; removing it and downloading again."
        rm -f "$SDIST"
    fi
fi
if [[ ! -f "$SDIST" ]]; then
    log "downloading horovod ${HVD_VERSION} sdist"
    mkdir -p "$TMP/dl" "$SDIST_DIR"
    pip_ download -q --no-deps --no-binary :all: --no-build-isolation \
        -d "$TMP/dl" "horovod==${HVD_VERSION}" \
        || die "pip download of horovod==${HVD_VERSION} failed (network / PyPI reachable?)"
    DL="$TMP/dl/horovod-${HVD_VERSION}.tar.gz"
    [[ -f "$DL" ]] || die "sdist not found after download (got: $(ls "$TMP/dl"))"
    GOT="$(sha256_of "$DL")"
    [[ "$GOT" == "$SDIST_SHA256" ]] \
        || die "downloaded horovod-${HVD_VERSION}.tar.gz has sha256 $GOT, PyPI publishes $SDIST_SHA256; not building it (check your index / proxy)."
    mv "$DL" "$SDIST.part"
    mv "$SDIST.part" "$SDIST"
fi
tar -xzf "$SDIST" -C "$TMP" || die "could not extract $SDIST"
SRC="$TMP/horovod-${HVD_VERSION}"
[[ -f "$SRC/setup.py" ]] || die "unexpected sdist layout: $SRC/setup.py missing"

# patch FILE SED_EXPR MUST_MATCH_BEFORE(ERE) MUST_MATCH_AFTER(ERE) MUST_NOT_MATCH_AFTER(ERE)
patch_file() {
    local f="$SRC/$1" expr="$2" before="$3" after="$4" forbidden="$5"
    [[ -f "$f" ]] || die "patch: $1 not found in sdist"
    grep -Eq -- "$before" "$f" || die "patch: pattern '$before' not found in $1 -- the sdist layout changed, patch must be updated"
    sed -i -E -- "$expr" "$f"
    grep -Eq -- "$after" "$f" || die "patch: after patching $1, '$after' is missing -- patch did not apply"
    if grep -Eq -- "$forbidden" "$f"; then
        die "patch: after patching $1, '$forbidden' still present -- patch did not apply fully"
    fi
    log "patched $1"
}
# torch >= 2.1 headers require C++17; horovod 0.28.1 sets C++14.
STD_SET='^[[:space:]]*set\(CMAKE_CXX_STANDARD [0-9]+\)'
STD_17='^[[:space:]]*set\(CMAKE_CXX_STANDARD 17\)'
STD_NOT17='^[[:space:]]*set\(CMAKE_CXX_STANDARD ([0-9]|1[0-689]|[2-9][0-9])\)'
patch_file CMakeLists.txt \
    's/^([[:space:]]*)set\(CMAKE_CXX_STANDARD [0-9]+\)/\1set(CMAKE_CXX_STANDARD 17)/' \
    "$STD_SET" "$STD_17" "$STD_NOT17"
patch_file horovod/torch/CMakeLists.txt \
    's/^([[:space:]]*)set\(CMAKE_CXX_STANDARD [0-9]+\)/\1set(CMAKE_CXX_STANDARD 17)/' \
    "$STD_SET" "$STD_17" "$STD_NOT17"
# gloo forces -std=c++11; mixing with C++17 duplicates gloo::rendezvous::Store::kDefaultTimeout.
patch_file third_party/gloo/CMakeLists.txt \
    's/-std=c\+\+11/-std=c++17/g' \
    '-std=c\+\+11' '-std=c\+\+17' '-std=c\+\+11'

# --------------------------------------------------------------------------------------
# Build path: build the wheel
# --------------------------------------------------------------------------------------
export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1
export HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1
unset HOROVOD_WITHOUT_PYTORCH HOROVOD_WITH_TENSORFLOW HOROVOD_WITH_MXNET HOROVOD_WITHOUT_GLOO HOROVOD_WITHOUT_MPI
unset HOROVOD_GPU_OPERATIONS HOROVOD_GPU_ALLREDUCE HOROVOD_GPU_ALLGATHER HOROVOD_GPU_BROADCAST HOROVOD_GPU HOROVOD_LOCAL_VERSION
# make reads its job count from MAKEFLAGS (horovod's setup.py adds -j8 only when it is
# unset). An inherited MAKEFLAGS is not ours to pass on: under make it holds that make's own
# flags (k, s, or a jobserver whose pipes this script never gets). nproc alone is not the
# CPU count either: it honours OMP_NUM_THREADS, which Sparta's Makefile exports as 1.
JOBS="${SPARTA_BUILD_JOBS:-$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc 2>/dev/null || echo 2)}"
export MAKEFLAGS="-j${JOBS}"
unset MFLAGS MAKELEVEL

mkdir -p "$LOG_DIR" "$TMP/wheelhouse"
BUILD_LOG="$LOG_DIR/horovod-${HVD_VERSION}-torch${TORCH_VER}-${PY_TAG}-build.log"
log "building horovod ${HVD_VERSION} wheel against torch ${TORCH_VER} with make -j${JOBS}; this takes several minutes"
log "build log: $BUILD_LOG"
T0=$SECONDS
echo "[install_horovod] MAKEFLAGS=$MAKEFLAGS" >"$BUILD_LOG"
if ! pip_ wheel -v --no-build-isolation --no-deps -w "$TMP/wheelhouse" "$SRC" >>"$BUILD_LOG" 2>&1; then
    echo "----- last 60 lines of $BUILD_LOG -----" >&2
    tail -n 60 "$BUILD_LOG" >&2
    echo "---------------------------------------" >&2
    die "horovod wheel build failed; full log: $BUILD_LOG"
fi
BUILT=("$TMP"/wheelhouse/horovod-"${HVD_VERSION}"-*.whl)
[[ -f "${BUILT[0]}" ]] || die "build succeeded but no horovod wheel found in $TMP/wheelhouse"
log "built $(basename "${BUILT[0]}") in $((SECONDS - T0))s with make -j${JOBS} ($(du -h "${BUILT[0]}" | cut -f1))"

# The hash goes in first: a wheel seen without its .sha256 counts as damaged and is rebuilt.
WHEEL="$WHEEL_DIR/$(basename "${BUILT[0]}")"
mkdir -p "$WHEEL_DIR"
echo "$(sha256_of "${BUILT[0]}")  $(basename "$WHEEL")" >"$WHEEL.sha256.part"
mv "$WHEEL.sha256.part" "$WHEEL.sha256"
cp "${BUILT[0]}" "$WHEEL_DIR/.tmp-$(basename "$WHEEL")"
mv "$WHEEL_DIR/.tmp-$(basename "$WHEEL")" "$WHEEL"
log "cached wheel in $WHEEL_DIR (sha256 in $(basename "$WHEEL").sha256)"

pip_ install -q --no-deps --force-reinstall "$WHEEL"
verify_import || die "horovod was built and installed, but 'import horovod.torch' still fails in $VENV; run: $PY -c 'import horovod.torch'"
log "horovod ${HVD_VERSION} built and installed into $VENV."
