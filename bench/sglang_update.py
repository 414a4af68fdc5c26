"""SGLang update benchmark: ~0.4B random Qwen2 (the vLLM bench's ARCH), bf16.

Measured in one run, on this machine, per update (trainer weights change, then):
  TensorHub:   trainer `Publisher.publish` -> an SGLang engine with the plugin (follow mode)
               serves the version: publish-to-serving time, and the engine's stall (pause ->
               continue, recorded by the plugin's driver, read from `/tensorhub/status`).
  disk:        the trainer saves a safetensors checkpoint (counted), then SGLang's own
               `/update_weights_from_disk` on a plain SGLang server: save + update time, and
               the stall (the request's duration; SGLang pauses internally).
  distributed: SGLang's `/update_weights_from_distributed` over a gloo group (the NCCL
               route's CPU twin; `/init_weights_update_group` once): the trainer process
               broadcasts every tensor while the request runs, between pause and continue.
               Update time = stall (the engine cannot serve a half-received model).
Then, with `--engines 2`, the plain server is stopped (at most two SGLang servers live at
once), a second plugin engine of the same layout starts, and `--updates` more versions are
published: the second engine's stall is reported as the native-path row, beside the first
engine's stall for the same versions, with the `path` its driver reports (if any). The
extra memory each engine spends on TensorHub (compact region, checkpoint copy) is read from
the same status route.
Checksums (`/weights_checker`) of the engines are compared after the last update of each
phase, so a figure never comes from an update that did not land.

Run: python -m bench.sglang_update [--updates 3] [--engines 2] [--quick]
(needs the SGLang venv: scripts/setup.sh sglang; --quick: a small model, a fast check)
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch

from bench.results import RESULTS, Report
from bench.workdir import make_scratch, tear_down
from integration.engine_server import free_port
from integration.engine_venvs import engine_python
from integration.sglang_server import SGLangServer
from integration.tiny_model import build_tiny_model, load_state_dict
from tensorhub import Publisher
from tensorhub_plugins.sglang.naming import LOADER
from tensorhub_testing.local_fleet import coordinator_process

ARCH = dict(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, vocab=1024)
QUICK_ARCH = dict(hidden=256, layers=4, heads=4, kv_heads=2, intermediate=1024, vocab=1024)
MODEL = "policy"
GROUP = "weight_update_group"
ENGINE_START_TIMEOUT = 900.0
UPDATE_TIMEOUT = 600.0


def _checkpoint_dir(model_dir: Path, out: Path) -> Path:
    """A directory with the model's config and tokenizer, where the baseline trainer saves
    its checkpoint (kept apart from the directory engines start from)."""
    out.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors"):
            shutil.copy2(f, out / f.name)
    return out


def _ok(reply: object, what: str) -> dict:
    """SGLang answers failures of weight updates with `success: false` (and sometimes 200)."""
    if not isinstance(reply, dict) or reply.get("success") is False:
        raise RuntimeError(f"{what} failed: {reply}")
    return reply


def wait_driver(server: SGLangServer, version: int, timeout: float) -> dict:
    """Until the plugin's driver serves `version` (its `/tensorhub/status`, polled every
    10 ms: the publish-to-serving figure is read from it); its status."""
    return server.wait_serving(version, timeout, interval=0.01)


def checksum(server: SGLangServer) -> str:
    """The engine's own checksum of its native parameters (CPU: sha256 over bytes)."""
    return _ok(server.request("/weights_checker", {"action": "checksum"}, timeout=600),
               "weights_checker")["per_engine_checksum"]


class GlooSender:
    """The trainer end (rank 0) of SGLang's weight-update group, over gloo.

    SGLang builds its side with `init_custom_process_group` (rendezvous, then a group on a
    `PrefixStore(group_name, ...)`), so the trainer must do the same; a plain
    `init_process_group` would not meet it (docs/notes/sglang-0.5.23-cpu.md §6)."""

    def __init__(self, server: SGLangServer, timeout: float = 300.0):
        from torch.distributed.distributed_c10d import (
            Backend,
            PrefixStore,
            _new_process_group_helper,
            _world,
            rendezvous,
        )

        self.server = server
        port = free_port()
        replies: list = []
        joiner = threading.Thread(target=lambda: replies.append(server.request(
            "/init_weights_update_group",
            {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
             "world_size": 2, "group_name": GROUP, "backend": "gloo"}, timeout=timeout)),
            daemon=True)
        joiner.start()
        store, _, _ = next(rendezvous(f"tcp://127.0.0.1:{port}", 0, 2,
                                      timeout=timedelta(seconds=timeout)))
        self.group, _ = _new_process_group_helper(
            2, 0, [], Backend("gloo"), PrefixStore(GROUP, store), group_name=GROUP,
            backend_options=None, timeout=timedelta(seconds=timeout))
        _world.pg_group_ranks[self.group] = {0: 0, 1: 1}
        joiner.join(timeout)
        if not replies:
            raise TimeoutError(f"/init_weights_update_group did not answer in {timeout}s")
        _ok(replies[0], "init_weights_update_group")

    def update(self, state: dict[str, torch.Tensor], version: int,
               timeout: float = UPDATE_TIMEOUT) -> float:
        """Pause, open a session, broadcast every tensor while
        `/update_weights_from_distributed` receives them, close, continue. Returns seconds."""
        import torch.distributed as dist

        names = list(state)
        body = {"names": names, "dtypes": [str(state[n].dtype).removeprefix("torch.")
                                           for n in names],
                "shapes": [list(state[n].shape) for n in names], "group_name": GROUP,
                "weight_version": str(version), "flush_cache": True}
        replies: list = []
        started = time.perf_counter()
        self.server.request("/pause_generation", {"mode": "abort"})
        try:
            _ok(self.server.request("/begin_weight_update", {}), "begin_weight_update")
            try:
                receiver = threading.Thread(target=lambda: replies.append(self.server.request(
                    "/update_weights_from_distributed", body, timeout=timeout)), daemon=True)
                receiver.start()
                for n in names:
                    dist.broadcast(state[n], src=0, group=self.group)
                receiver.join(timeout)
            finally:
                _ok(self.server.request("/end_weight_update", {}), "end_weight_update")
        finally:
            self.server.request("/continue_generation", {})
        elapsed = time.perf_counter() - started
        if not replies:
            raise TimeoutError(f"/update_weights_from_distributed did not answer in {timeout}s")
        _ok(replies[0], "update_weights_from_distributed")
        return elapsed

    def close(self) -> None:
        import torch.distributed as dist

        try:
            self.server.request("/destroy_weights_update_group", {"group_name": GROUP})
        finally:
            dist.destroy_process_group(self.group)


def disk_update(server: SGLangServer, ckpt: Path, state: dict[str, torch.Tensor],
                version: int) -> tuple[float, float]:
    """Trainer saves the checkpoint, then `/update_weights_from_disk`: (save s, request s)."""
    from safetensors.torch import save_file

    started = time.perf_counter()
    save_file(state, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    saved = time.perf_counter()
    _ok(server.request("/update_weights_from_disk",
                       {"model_path": str(ckpt), "load_format": "auto",
                        "weight_version": str(version), "flush_cache": True},
                       timeout=UPDATE_TIMEOUT), "update_weights_from_disk")
    return saved - started, time.perf_counter() - saved


def plugin_server(python: str, model_dir: Path, address: str, log: Path, dtype: str,
                  name: str) -> SGLangServer:
    return SGLangServer(python, model_dir, dtype=dtype, log_path=log,
                        extra_args=["--custom-weight-loader", LOADER],
                        env={"SGLANG_PLUGINS": "tensorhub", "TENSORHUB_COORDINATOR": address,
                             "TENSORHUB_MODEL": MODEL, "TENSORHUB_NAME": name})


def _bump(state: dict[str, torch.Tensor]) -> None:
    """The trainer's next version: every tensor changes (the same for every route)."""
    with torch.no_grad():
        for t in state.values():
            t.add_(0.01)


def _path_of(status: dict) -> str:
    """The path the plugin says an update took (A1's native path adds it); else 'unreported'."""
    last = status.get("last_update") or {}
    return str(last.get("path") or status.get("path") or "unreported")


def add_memory(report: Report, engine: str, status: dict, model_mib: float) -> None:
    """The extra memory an engine spends on TensorHub (its driver sums its schedulers'),
    beside the model's own size: the goal is the compact region only."""
    memory = status.get("memory") or {}
    for key, what in (("compact_bytes", "compact region"),
                      ("checkpoint_copy_bytes", "checkpoint copy")):
        if key in memory:
            report.add(f"TensorHub memory, {engine}: {what} (model {model_mib:.0f} MiB)",
                       memory[key] / 2**20, "MiB")
    report.notes[f"params_moved_{engine.replace(' ', '_')}"] = status.get("params_moved")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--updates", type=int, default=3, help="updates per phase (default 3)")
    p.add_argument("--engines", type=int, choices=(1, 2), default=1,
                   help="2: afterwards, a second plugin engine; its stall is the native row")
    p.add_argument("--quick", action="store_true", help="small model, for a fast check")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    args = p.parse_args()
    if args.updates < 1:
        p.error("--updates must be at least 1")
    med = statistics.median
    arch = QUICK_ARCH if args.quick else ARCH
    torch_dtype = getattr(torch, args.dtype)

    report = Report("sglang_update")
    work = make_scratch("sglang")
    model_dir = build_tiny_model(work / "model", dtype=torch_dtype, **arch)
    ckpt = _checkpoint_dir(model_dir, work / "ckpt")
    state = load_state_dict(model_dir)
    params = sum(t.numel() for t in state.values())
    mib = sum(t.numel() * t.element_size() for t in state.values()) / 2**20
    print(f"model: {params / 1e6:.0f}M parameters, {mib:.0f} MiB {args.dtype}", flush=True)
    report.notes.update({"model": f"random Qwen2 {arch}", "params_m": round(params / 1e6, 1),
                         "mib": round(mib, 1), "dtype": args.dtype, "updates": args.updates,
                         "engines": args.engines, "sglang": "0.5.23 CPU, torch_native attention",
                         "driver_poll_s": 0.2})
    python = engine_python("sglang")
    coordinator, address = coordinator_process("--max-readers-per-holder", "1")
    servers: list[SGLangServer] = []
    publisher = None
    sender = None
    try:
        coordinator.next_line(timeout=60)
        publisher = Publisher(address, MODEL)
        version = publisher.publish(state)

        ours = plugin_server(python, model_dir, address, work / "ours.log", args.dtype,
                             "sglang-a")
        baseline = SGLangServer(python, model_dir, dtype=args.dtype, log_path=work / "base.log")
        servers += [ours, baseline]
        for s in (ours.launch(), baseline.launch()):
            s.wait_healthy(ENGINE_START_TIMEOUT)
        wait_driver(ours, version, ENGINE_START_TIMEOUT)
        sender = GlooSender(baseline)

        ours_total, ours_stall, save, disk, disk_total, dist_update = [], [], [], [], [], []
        for _ in range(args.updates):
            _bump(state)
            started = time.perf_counter()
            version = publisher.publish(state)
            status = wait_driver(ours, version, UPDATE_TIMEOUT)
            ours_total.append(time.perf_counter() - started)
            ours_stall.append(status["last_update"]["stall_ms"] / 1e3)
            saved, requested = disk_update(baseline, ckpt, state, version)
            save.append(saved)
            disk.append(requested)
            disk_total.append(saved + requested)
            dist_update.append(sender.update(state, version))
            print(f"v{version}: TensorHub {ours_total[-1]:.2f}s (stall "
                  f"{ours_stall[-1] * 1e3:.0f} ms, path {_path_of(status)}); disk save "
                  f"{save[-1]:.2f}s + update {disk[-1]:.2f}s; gloo {dist_update[-1]:.2f}s",
                  flush=True)
        same = checksum(ours) == checksum(baseline)
        print(f"checksums after v{version}: TensorHub engine == baseline engine: {same}")
        if not same:
            raise AssertionError("the TensorHub engine and the baseline disagree on weights")

        report.add("engine stall per update (TensorHub)", med(ours_stall) * 1e3, "ms",
                   "SGLang /update_weights_from_disk (request)", med(disk) * 1e3,
                   higher_is_better=False)
        report.add("engine stall per update (TensorHub)", med(ours_stall) * 1e3, "ms",
                   "SGLang /update_weights_from_distributed, gloo", med(dist_update) * 1e3,
                   higher_is_better=False)
        report.add("publish to serving (TensorHub)", med(ours_total), "s",
                   "trainer save + /update_weights_from_disk",
                   med(disk_total), higher_is_better=False)
        report.add("publish to serving (TensorHub)", med(ours_total), "s",
                   "gloo broadcast + /update_weights_from_distributed", med(dist_update),
                   higher_is_better=False)
        report.add("trainer save of the checkpoint (disk baseline only)", med(save), "s")
        add_memory(report, "1st engine", status, mib)

        if args.engines == 2:
            sender.close()
            sender = None
            baseline.stop()  # at most two SGLang servers at once
            second = plugin_server(python, model_dir, address, work / "second.log",
                                   args.dtype, "sglang-b")
            servers.append(second)
            second.start(ENGINE_START_TIMEOUT)
            wait_driver(second, version, ENGINE_START_TIMEOUT)
            first_stall, second_stall, second_total, paths = [], [], [], []
            for _ in range(args.updates):
                _bump(state)
                started = time.perf_counter()
                version = publisher.publish(state)
                a = wait_driver(ours, version, UPDATE_TIMEOUT)
                b = wait_driver(second, version, UPDATE_TIMEOUT)
                second_total.append(time.perf_counter() - started)
                first_stall.append(a["last_update"]["stall_ms"] / 1e3)
                second_stall.append(b["last_update"]["stall_ms"] / 1e3)
                paths.append(_path_of(b))
                print(f"v{version}: 1st engine stall {first_stall[-1] * 1e3:.0f} ms (path "
                      f"{_path_of(a)}); 2nd engine stall {second_stall[-1] * 1e3:.0f} ms "
                      f"(path {paths[-1]}), both serving after {second_total[-1]:.2f}s; "
                      f"2nd status {b.get('last_update')}", flush=True)
            same = checksum(ours) == checksum(second)
            print(f"checksums after v{version}: 1st engine == 2nd engine: {same}")
            if not same:
                raise AssertionError("the two TensorHub engines disagree on weights")
            path = "/".join(sorted(set(paths)))
            report.notes["second_engine_paths"] = paths
            report.add(f"engine stall per update, 2nd engine (native path; plugin says: "
                       f"{path})", med(second_stall) * 1e3, "ms",
                       "1st engine, same versions (checkpoint layout from the trainer)",
                       med(first_stall) * 1e3, higher_is_better=False)
            report.add(f"engine stall per update, 2nd engine (plugin says: {path})",
                       med(second_stall) * 1e3, "ms",
                       "SGLang /update_weights_from_disk (request, phase 1)",
                       med(disk) * 1e3, higher_is_better=False)
            report.add("publish to both engines serving (TensorHub)", med(second_total), "s",
                       "trainer save + /update_weights_from_disk (one engine, phase 1)",
                       med(disk_total), higher_is_better=False)
            add_memory(report, "1st engine after phase 2", a, mib)
            add_memory(report, "2nd engine", b, mib)
        if args.quick:
            print("--quick: figures not written to bench/results")
        else:
            report.write()
            with (RESULTS / f"{report.bench}.md").open("a") as f:
                f.write("\nMachine and run notes: " + json.dumps(report.notes) + "\n")
    finally:
        if sender is not None:
            try:
                sender.close()
            except Exception as exc:  # the server may be gone already
                print(f"closing the gloo group: {exc}")
        tear_down(servers, publisher, coordinator, work)


if __name__ == "__main__":
    main()
