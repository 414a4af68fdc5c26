#!/usr/bin/env bash
# Set up (first time only) and run the test suite. Extra arguments go to pytest.
#
# Every venv the suite uses is built here, before the tests that need it, never inside a
# timed test: the core venv runs pytest, the vLLM and SGLang venvs run the real engine
# servers of integration/, the verl venv runs verl's checkpoint-engine manager. On a bare
# machine the engine venvs are built side by side, in the background, while ruff and the
# fast loop run (each build logs its steps to $TENSORHUB_VENV_CACHE/<engine>.log and prints
# its duration); later runs find them in the cache and start at once.
# TENSORHUB_TEST_ENGINES=0 skips the engine venvs (and so the engine tests, which then say
# why they skip).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
started=$SECONDS
venv=$(bash "$here/scripts/setup.sh" core)
echo "test.sh: core venv ready in $((SECONDS - started)) s" >&2
logs=${TENSORHUB_VENV_CACHE:-$HOME/.cache/tensorhub/venvs}; mkdir -p "$logs"
builds=()
if [ "${TENSORHUB_TEST_ENGINES:-1}" != 0 ]; then
  for engine in vllm sglang verl; do
    # (a session of its own: on exit, the kill below reaches its pip processes too)
    setsid bash "$here/scripts/setup.sh" "$engine" >/dev/null 2>"$logs/$engine.log" &
    builds+=("$engine:$!")
  done
fi
trap 'for b in "${builds[@]}"; do kill -- "-${b#*:}" 2>/dev/null || true; done' EXIT
engines() {  # wait for the builds; a failed one stops the run with its log
  for b in "${builds[@]}"; do
    if ! wait "${b#*:}"; then
      echo "test.sh: building the ${b%%:*} venv failed; its log ($logs/${b%%:*}.log):" >&2
      tail -n 30 "$logs/${b%%:*}.log" >&2
      exit 1
    fi
    tail -n 1 "$logs/${b%%:*}.log" >&2
  done
  builds=()
  echo "test.sh: engine venvs ready ($((SECONDS - started)) s in all)" >&2
}
cd "$here"
"$venv/bin/ruff" check .
if [ $# -gt 0 ]; then  # (arguments: one pytest run with them, e.g. -m "not slow")
  engines
  exec "$venv/bin/python" -m pytest tests integration -q -p no:cacheprovider "$@"
fi
# The fast loop first (no engine, no namespace: under 3 minutes here), while the engine
# venvs build, so that a broken unit fails early; then everything else.
"$venv/bin/python" -m pytest tests integration -q -p no:cacheprovider -m "not slow"
engines
exec "$venv/bin/python" -m pytest tests integration -q -p no:cacheprovider -m slow
