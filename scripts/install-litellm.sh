#!/usr/bin/env bash
# Install (once) LiteLLM's proxy into its own cached virtual environment, for the LiteLLM
# row of bench/overhead.py (SPEC §13 measures corrallm beside it). Never a dependency of
# corrallm itself: it is about 750 MB.
#
#     ${CORRALLM_CACHE:-~/.cache/corrallm}/litellm/<version>/bin/litellm
#
# Usage: scripts/install-litellm.sh          install if needed; print the executable's path
#        scripts/install-litellm.sh --path   print where it lives (no install)
set -euo pipefail

LITELLM_VERSION=1.108.7 # the one pin: the version measured in bench/README.md
CACHE_ROOT="${CORRALLM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/corrallm}"
PREFIX="$CACHE_ROOT/litellm/$LITELLM_VERSION"
BINARY="$PREFIX/bin/litellm"
PYTHON="${PYTHON:-python3}"

if [[ "${1:-}" == "--path" ]]; then
    echo "$BINARY"
    exit 0
fi
if [[ -x "$BINARY" ]]; then
    echo "$BINARY"
    exit 0
fi
echo "install-litellm: installing litellm[proxy]==$LITELLM_VERSION into $PREFIX" >&2
rm -rf "$PREFIX.tmp"
"$PYTHON" -m venv "$PREFIX.tmp"
"$PREFIX.tmp/bin/pip" install -q "litellm[proxy]==$LITELLM_VERSION" >&2
rm -rf "$PREFIX"
mv "$PREFIX.tmp" "$PREFIX"
# A venv's scripts name their interpreter by absolute path: rewrite them for the new place.
for script in "$PREFIX"/bin/*; do
    if [[ -f "$script" && ! -L "$script" ]]; then
        sed -i "1s|$PREFIX.tmp|$PREFIX|" "$script"
    fi
done
sed -i "s|$PREFIX.tmp|$PREFIX|g" "$PREFIX/pyvenv.cfg" "$PREFIX/bin/activate"
echo "$BINARY"
