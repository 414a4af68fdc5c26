"""What an update costs an engine's users: a client streams greedy completions back to back
while the trainer publishes whole versions and 1 %-density steps of a bf16 model.

Measured in one run, for one engine (vLLM or SGLang, TP=1 or TP=2):
  quiet:     the client's p99 gap between two tokens it received, over a quiet stretch;
  per swap:  the worst gap across the swap (publish -> serving + 0.5 s), and what the swap
             added to it (worst gap - quiet p99); failed or aborted requests; the stall the
             engine reports; publish -> serving;
  split:     the same for gaps inside one answer (what a request in flight felt: the pause
             and the install) and for the waits for an answer's first token (what a new
             request felt: its prefill, which no swap makes shorter). Every request's prompt
             is a fresh one, so no prefix is cached in the quiet stretch that a swap (which
             drops the prefix cache with the weights) would then prefill again;
  the stall: the gap of a request in flight that spans the stall the engine reports,
             against a quiet step (the median gap): what the pause itself cost, apart from
             the window's other gaps;
  baselines: a memcpy of the model's bytes (this process, torch), and the engine's own
             reload of the same weights from disk while the client streams (vLLM:
             `reload_weights` between `/pause` (keep) and `/resume`, dev-mode routes;
             SGLang: `/update_weights_from_disk`), what it added to the worst gap.

Ratios are our figure over the baseline (a swap that adds 2 memcpys reads 2.0).

Run: python -m bench.engine_pause [--engine vllm|sglang] [--tp 2] [--updates 3]
     [--pause keep|keep_kv] [--checkpoint-layout]
(`TENSORHUB_BACKGROUND_NICE=10` before it runs the engine's TensorHub threads below the
engine's priority; the label says so.)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from collections.abc import Callable

import torch

from bench.results import Report
from bench.workdir import make_scratch, tear_down
from integration.engine_venvs import engine_python
from integration.faults import checkpoint_layout_env
from integration.sglang_server import SGLangServer
from integration.stream_client import StreamingClients, percentile
from integration.tiny_model import build_tiny_model, load_state_dict, make_prompts
from integration.vllm_server import VLLMServer
from tensorhub import Publisher, settings
from tensorhub.tools.cli import _change as next_version
from tensorhub_testing.local_fleet import coordinator_process
from tensorhub_testing.status import coordinator_status

ARCH = dict(hidden=896, layers=12, heads=14, kv_heads=2, intermediate=4864, vocab=1024)
QUIET_S = 20.0
AFTER_S = 0.5  # a swap's window ends this long after the engine serves the version
TOKENS = 48
PROMPTS = 4096  # more than a run asks for: no request's prompt is cached from an earlier one
PARTS = {"gap": None, "in flight": True, "first token": False}  # (`StreamingClients.gaps`)


def memcpy_seconds(state: dict[str, torch.Tensor]) -> float:
    dst = {k: torch.empty_like(v) for k, v in state.items()}
    times = []
    for _ in range(5):
        started = time.perf_counter()
        for k, v in state.items():
            dst[k].copy_(v)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def on_threads(threads: int, measure: Callable[[], float]) -> float:
    """`measure()` with torch computing on `threads` threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return measure()
    finally:
        torch.set_num_threads(before)


def scatter_seconds(nbytes: int, density: float, g: torch.Generator) -> float:
    """The floor of a sparse install on this machine: writing `density` of the words of a
    buffer of the model's size at random places (sorted, as a plan's) with the engine's
    `index_copy_`."""
    flat = torch.zeros(nbytes // 2, dtype=torch.int16)
    index = torch.randint(0, flat.numel(), (int(density * flat.numel()),),
                          generator=g).unique()
    bits = torch.ones(index.numel(), dtype=torch.int16)
    times = []
    for _ in range(5):
        started = time.perf_counter()
        flat.index_copy_(0, index, bits)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def start_engine(kind: str, tp: int, model_dir, address: str, work, pause: str = "keep",
                 checkpoint_layout: bool = False) -> VLLMServer | SGLangServer:
    env = {"TENSORHUB_COORDINATOR": address, "TENSORHUB_MODEL": "policy",
           "TENSORHUB_PAUSE": pause}
    if kind == "vllm":
        if checkpoint_layout:  # (the CPU twin of a GPU's weights: `integration/faults`)
            env.update(checkpoint_layout_env())
        extra = ["--weight-transfer-config", json.dumps({"backend": "tensorhub"})]
        if tp > 1:
            extra += ["--tensor-parallel-size", str(tp)]
            env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
        return VLLMServer(engine_python("vllm"), model_dir, dtype="bfloat16", extra_args=extra,
                          env={**env, "VLLM_PLUGINS": "tensorhub", "VLLM_SERVER_DEV_MODE": "1"},
                          log_path=work / "engine.log").start(timeout=900)
    extra = ["--custom-weight-loader", "tensorhub_plugins.sglang.loader.apply"]
    if tp > 1:
        extra += ["--tp-size", str(tp)]
        env["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(str(r % os.cpu_count()) for r in range(tp))
    return SGLangServer(engine_python("sglang"), model_dir, dtype="bfloat16", extra_args=extra,
                        env={**env, "SGLANG_PLUGINS": "tensorhub"},
                        log_path=work / "engine.log").start(timeout=900)


def own_reload(engine, kind: str, folder) -> None:
    """The engine's own update from a checkpoint folder, as its users would run it."""
    if kind == "vllm":
        engine.request("/pause?mode=keep", {})  # (a query parameter: a body is ignored)
        engine.request("/collective_rpc", {"method": "reload_weights",
                                           "kwargs": {"weights_path": str(folder)}})
        engine.request("/reset_prefix_cache", {})
        engine.request("/resume", {})
    else:
        engine.request("/update_weights_from_disk", {"model_path": str(folder)})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=["vllm", "sglang"], default="vllm")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--updates", type=int, default=3, help="swaps of each kind (default 3)")
    p.add_argument("--pause", choices=["keep", "keep_kv"], default="keep",
                   help="the engine's TENSORHUB_PAUSE (default keep)")
    p.add_argument("--layers", type=int, default=ARCH["layers"])
    p.add_argument("--checkpoint-layout", action="store_true",
                   help="vLLM: keep its live weights in the checkpoint's layout, as on a GPU "
                        "(its CPU build's linear fallback), so sparse steps install sparse")
    args = p.parse_args()
    from safetensors.torch import save_file

    report = Report("engine_pause")
    work = make_scratch("pause")
    model_dir = build_tiny_model(work / "model", dtype=torch.bfloat16,
                                 **{**ARCH, "layers": args.layers})
    state = load_state_dict(model_dir)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    label = f"{args.engine} TP={args.tp}, {nbytes / 2**20:.0f} MiB bf16" + (
        f", pause {args.pause}" if args.pause != "keep" else "") + (
        ", weights in the checkpoint's layout" if args.checkpoint_layout else "") + (
        f", background nice {settings.BACKGROUND_NICE.get()}"
        if settings.BACKGROUND_NICE.is_set() else "")
    print(f"{label}: building done", flush=True)
    coordinator, address = coordinator_process()
    servers, publisher = [], None
    try:
        coordinator.next_line(timeout=60)
        publisher = Publisher(address, "policy", name="trainer")
        version = publisher.publish(state)
        engine = start_engine(args.engine, args.tp, model_dir, address, work, args.pause,
                              args.checkpoint_layout)
        servers.append(engine)
        engine.wait_serving(version, timeout=600)
        # Every version is made before the client starts: a trainer's step is computed on
        # the trainer's own hosts, and here it would take the engine's cores.
        g = torch.Generator().manual_seed(0)
        steps = []
        for kind, density in (("whole", 1.0), ("1 %", 0.01)) * args.updates:
            next_version(state, density, g)
            steps.append((kind, {k: t.clone() for k, t in state.items()}))
        client = StreamingClients(engine.url, make_prompts(PROMPTS, 16, ARCH["vocab"], seed=7),
                                  TOKENS, clients=2, model=engine.model).start()
        time.sleep(2.0)  # (warm)
        quiet_from = time.perf_counter()
        time.sleep(QUIET_S)
        quiet_to = time.perf_counter()
        quiet_gaps = {part: client.gaps(quiet_from, quiet_to, within)
                      for part, within in PARTS.items()}
        quiet = {part: percentile(gaps, 0.99) for part, gaps in quiet_gaps.items()}
        got: dict[str, dict[str, list[float]]] = {}
        for kind, step in steps:
            published, published_at = time.perf_counter(), time.time()
            version = publisher.publish(step)
            returned = time.perf_counter()
            # (asked seldom: each status request costs the engine a call of its own)
            status = engine.wait_serving(version, timeout=600, interval=0.25)
            last = status.get("last_update") or {}
            serving = published + (last.get("at", time.time()) - published_at)
            time.sleep(AFTER_S + 0.5)
            row = got.setdefault(kind, {"window": [], "stalled": [], "stall": [], "serving": []})
            row["window"].append((published, serving + AFTER_S))
            row["stall"].append(last.get("stall_ms", 0.0) / 1e3)
            row["stalled"].append((serving - row["stall"][-1], serving))
            row["serving"].append(serving - published)
            pulls = [t for t in coordinator_status(address).transfers
                     if t.version == version and t.ok and t.reader != "trainer"]
            print(f"{kind} v{version} ({last.get('install', 'whole')}): reported stall "
                  f"{row['stall'][-1] * 1e3:.0f} ms, serving after {row['serving'][-1]:.2f} s "
                  f"(publish {returned - published:.2f} s, the copy's pull "
                  f"{sum(t.seconds for t in pulls):.2f} s of {sum(t.nbytes for t in pulls)} B, "
                  f"check {last.get('check_ms', 0.0):.0f} ms; the stall's steps "
                  f"{last.get('stall_steps_ms')}, the install's {last.get('steps_ms')} ms)",
                  flush=True)
        # the engine's own reload of the same weights, from disk
        folder = work / "reload"
        shutil.copytree(model_dir, folder, ignore=shutil.ignore_patterns("*.safetensors"))
        save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
        own = []
        for _ in range(args.updates):
            started = time.perf_counter()
            own_reload(engine, args.engine, folder)
            own.append((started, time.perf_counter() + AFTER_S))
            time.sleep(AFTER_S + 0.5)
        time.sleep(3.0)  # (the tokens that end the last gaps)
        answers = client.stop()
        # every swap's worst gap, once the tokens after it have come
        for kind, row in got.items():
            for part, within in PARTS.items():  # (None: no such gap overlapped the swap)
                row[part] = [max(client.gaps(*w, within), default=None) for w in row["window"]]
            row["own"] = [max(client.gaps(*w, True), default=None) for w in row.pop("stalled")]
            for (start, end), served in zip(row.pop("window"), row["serving"], strict=True):
                a, b = client.worst_gap_at(start, end)
                print(f"{kind}: the worst gap ran from {a - start:+.2f} s to {b - start:+.2f} s "
                      f"after the publish (serving at {served:.2f} s)", flush=True)
        own = {part: [max(client.gaps(*w, within), default=None) for w in own]
               for part, within in PARTS.items()}
        print("quiet p99, median (ms), of how many gaps: " + str(
            {p: (round(quiet[p] * 1e3), round(statistics.median(g or [0.0]) * 1e3), len(g))
             for p, g in quiet_gaps.items()}), flush=True)
        for part in PARTS:
            print(f"worst gaps, {part} (ms): " + "; ".join(
                f"{kind} {[g and round(g * 1e3) for g in row[part]]}" for kind, row in got.items())
                + f"; own reload {[g and round(g * 1e3) for g in own[part]]}", flush=True)
        print("the gap of a request in flight across the stall (ms): " + "; ".join(
            f"{kind} {[g and round(g * 1e3) for g in row['own']]}" for kind, row in got.items()),
            flush=True)
        failed = len(client.failed())
        for a in client.failed():
            print(f"failed request (started {a.started - quiet_from:.1f} s after the quiet "
                  f"stretch began, {len(a.token_ids)} tokens): {a.error}", flush=True)
        copy = memcpy_seconds(state)
        # (vLLM binds its one worker to the cores less one it keeps for its front end;
        # SGLang's scheduler, and TP ranks left unbound, compute on torch's default)
        threads = max(1, len(os.sched_getaffinity(0)) - 1) \
            if args.engine == "vllm" and args.tp == 1 else torch.get_num_threads()
        scatter = on_threads(threads, lambda: scatter_seconds(nbytes, 0.01, g))
        copy_alike = on_threads(threads, lambda: memcpy_seconds(state))  # (the same threads)
        def med(values: list[float | None]) -> float:
            """The median of the swaps that had such a gap."""
            return statistics.median([v for v in values if v is not None] or [0.0])

        ms = 1e3
        for part, name in (("gap", "the client's worst gap"),
                           ("in flight", "a request in flight's worst gap"),
                           ("first token", "a new request's wait for its first token")):
            whole_adds = med(got["whole"][part]) - quiet[part]
            step_adds = med(got["1 %"][part]) - quiet[part]
            own_adds = med(own[part]) - quiet[part]
            quiet_name = ("client's quiet p99 gap between tokens" if part == "gap"
                          else f"quiet p99 of {name.removeprefix('a ')}")
            report.add(f"{label}: {quiet_name}", quiet[part] * ms, "ms")
            report.add(f"{label}: a whole swap adds to {name}", whole_adds * ms, "ms",
                       "a memcpy of the model's bytes", copy * ms)
            report.add(f"{label}: a whole swap adds to {name} (against the engine's own reload "
                       "from disk)", whole_adds * ms, "ms", "the engine's own reload adds",
                       own_adds * ms)
            report.add(f"{label}: a 1 % step adds to {name}", step_adds * ms, "ms",
                       "a whole swap adds", whole_adds * ms)
        # The stall's own gap against a quiet step: what the pause itself cost a request in
        # flight, apart from the other gaps of the window (the check before the pause and
        # the pull share the engine's cores here; on a GPU they do not).
        step = statistics.median(quiet_gaps["in flight"] or [0.0])
        report.add(f"{label}: a quiet step (median gap of a request in flight)", step * ms, "ms")
        whole_own = med(got["whole"]["own"]) - step
        report.add(f"{label}: a whole swap's stall adds to the gap of a request in flight "
                   "across it", whole_own * ms, "ms", "a memcpy of the model's bytes", copy * ms)
        report.add(f"{label}: a 1 % step's stall adds to the gap of a request in flight across "
                   "it", (med(got["1 %"]["own"]) - step) * ms, "ms", "a whole swap's stall adds",
                   whole_own * ms)
        # (a ratio of what the two kinds add can be no lower than this on this machine's
        # memory: a random 1 % of the words touches about a quarter of its cache lines)
        report.add(f"{label}: the floor of a 1 % step's install, a scatter of 1 % of the "
                   f"model's words on {threads} thread(s)", scatter * ms, "ms",
                   "a memcpy of the model's bytes on as many", copy_alike * ms)
        report.add(f"{label}: stall the engine reports, whole", med(got["whole"]["stall"]) * ms,
                   "ms", "worst gap across it", med(got["whole"]["gap"]) * ms)
        report.add(f"{label}: stall the engine reports, 1 % step",
                   med(got["1 %"]["stall"]) * ms, "ms", "worst gap across it",
                   med(got["1 %"]["gap"]) * ms)
        report.add(f"{label}: publish to serving, whole", med(got["whole"]["serving"]), "s")
        report.add(f"{label}: publish to serving, 1 % step", med(got["1 %"]["serving"]), "s")
        report.add(f"{label}: requests that failed or were aborted", failed,
                   f"of {len(answers)}")
        report.write(keep_earlier=True)
    finally:
        tear_down(servers, publisher, coordinator, work)


if __name__ == "__main__":
    main()
