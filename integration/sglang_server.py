"""Start and stop a real SGLang server from tests (core venv side).

The server runs in the SGLang venv (its own torch pin: 2.14.1), so it is launched as a
subprocess with that venv's python (``scripts/setup.sh sglang`` prints the venv path).
On these CPU-only machines SGLang 0.5.23 needs ``SGLANG_USE_CPU_ENGINE=1`` and the test
shim ``integration/cpu_shims/sgl_kernel`` first on ``PYTHONPATH`` (the PyPI sgl_kernel is
CUDA-only and fails to import without libcuda). Both are set here. See
docs/notes/sglang-0.5.23-cpu.md for the facts behind every flag.

Extra modules for the server (a custom weight loader, a plugin) go in ``pythonpath``;
they are appended after the shim. The server gets its own process group
(``start_new_session``) and ``stop()`` signals the whole group by the leader's PID: the
scheduler and detokenizer children die with it, and no process is ever matched by name.
Startup takes ~20-35 s on 2 cores (import of sglang dominates).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from integration.engine_server import EngineServer, base_env, free_port

CPU_SHIM_DIR = Path(__file__).resolve().parent / "cpu_shims"


class SGLangServer(EngineServer):
    """One `python -m sglang.launch_server` process tree on CPU, float32 by default."""

    kind = "sglang"

    def __init__(self, python: str | Path, model: str | Path, *, port: int | None = None,
                 extra_args: Sequence[str] = (), env: Mapping[str, str] | None = None,
                 pythonpath: Sequence[str | Path] = (), log_path: str | Path | None = None,
                 dtype: str = "float32", max_total_tokens: int = 8192,
                 attention_backend: str = "torch_native", skip_warmup: bool = True,
                 sleep_on_idle: bool = True):
        self.model = str(model)
        port = port or free_port()
        args = [str(python), "-m", "sglang.launch_server", "--model-path", self.model,
                "--device", "cpu", "--host", "127.0.0.1", "--port", str(port),
                "--attention-backend", attention_backend,
                "--max-total-tokens", str(max_total_tokens), "--dtype", dtype,
                # An idle scheduler otherwise spins a core, taken from the other engines
                # on these 2 cores and from TensorHub's own thread in its process.
                *(["--sleep-on-idle"] if sleep_on_idle else []),
                *(["--skip-server-warmup"] if skip_warmup else []), *extra_args]
        env = base_env({
            "SGLANG_USE_CPU_ENGINE": "1",
            # Keep torch from spawning one OpenMP thread per core in each of 3 processes.
            "OMP_NUM_THREADS": "1",
            # On a scheduler crash SGLang otherwise sleeps 5 s, tries py-spy, then waits 60 s
            # for CUDA coredumps before exiting. Off: a crashed server is gone at once.
            "SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0",
            "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0",
            **(env or {})})
        parts = [str(CPU_SHIM_DIR), *(str(p) for p in pythonpath)]
        if env.get("PYTHONPATH"):
            parts.append(env["PYTHONPATH"])
        env["PYTHONPATH"] = ":".join(parts)
        super().__init__(args, env, port, log_path)

    def greedy(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy completions as token ids, comparable with `tiny_model.hf_greedy`: one
        batched `/generate` with `input_ids`, temperature 0, `ignore_eos`."""
        r = self.request("/generate", {
            "input_ids": [list(p) for p in prompts],
            "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens,
                                "ignore_eos": True},
        })
        assert isinstance(r, list), r
        return [list(x["output_ids"]) for x in r]

    # Weight-update endpoints (SGLang 0.5.23): see docs/notes/sglang-0.5.23-cpu.md.
    def begin_weight_update(self) -> dict:
        return self.request("/begin_weight_update", {})

    def end_weight_update(self) -> dict:
        return self.request("/end_weight_update", {})

    def flush_cache(self) -> None:
        self.request("/flush_cache", {})
