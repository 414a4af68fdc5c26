#!/usr/bin/env bash
# Set up (first time only) and run the demo: coordinator + trainer + two `vllm serve`
# engines + one SGLang server on this machine. `--sglang 0` / `--vllm 0` skip an engine
# kind; `--engines none` runs replica processes only. `--help` lists the options.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
case " $* " in *" -h "*|*" --help "*) ;; *)
  echo "TensorHub demo: a coordinator, a trainer publishing versions of a tiny model, and real" >&2
  echo "  engines pulling each version from each other. The first run builds its venvs (core" >&2
  echo "  ~1 min, vLLM ~2.5 min, SGLang ~4 min; each step prints its time); later runs start at once." >&2
esac
venv=$(bash "$here/scripts/setup.sh" core)
cd "$here"
exec "$venv/bin/python" -m integration.demo "$@"
