"""`tensorhub` command line: run a coordinator, look at its state, run a replica, the demo."""

from __future__ import annotations

import argparse
import json
import logging
import os
import queue
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING

from tensorhub import settings

if TYPE_CHECKING:
    import torch

DEFAULT_COORDINATOR = "tcp://127.0.0.1:5555"  # loopback: nothing is exposed unless asked


def _coordinator_default() -> str:
    """Where the commands that talk to a coordinator find it by default: the engines'
    TENSORHUB_COORDINATOR when set, else the loopback default."""
    return settings.COORDINATOR.get() or DEFAULT_COORDINATOR


def _coordinator_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--coordinator", default=_coordinator_default(),
                   help=f"the coordinator's address (default: $TENSORHUB_COORDINATOR, else "
                        f"{DEFAULT_COORDINATOR})")


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _coordinator(args: argparse.Namespace) -> int:
    from tensorhub.coordinator.owner_key import default_owner_key_file
    from tensorhub.coordinator.planner import PlannerConfig
    from tensorhub.coordinator.server import Coordinator, CoordinatorConfig, settle_gc
    from tensorhub.core import curve
    from tensorhub.core.client import token_from_env

    token = token_from_env()
    secret = (curve.read_key(args.curve_secret_file, "CURVE secret key file")
              if args.curve_secret_file else curve.server_secret_from_env())
    config = CoordinatorConfig(
        bind=args.bind, announce=args.announce, token=token, curve_secret=secret,
        owner_key_file=None if secret or args.owner_key_file == "none"
        else args.owner_key_file or str(default_owner_key_file()),
        heartbeat_interval=args.heartbeat_interval, worker_ttl=args.worker_ttl,
        lease_ttl=args.lease_ttl, busy_retry=args.busy_retry, stripes=args.stripes,
        planner=PlannerConfig(max_readers_per_holder=args.max_readers_per_holder,
                              **({} if args.chunk_mib is None else
                                 {"chunk_bytes": int(args.chunk_mib * 2**20), "min_chunks": 1})),
    )  # fmt: skip
    if token is None:
        logging.warning("no TENSORHUB_TOKEN: anyone who can reach %s can publish, and read "
                        "the weights of every worker; set the same token here and on every "
                        "worker", args.bind)
    coordinator = Coordinator(config)
    signal.signal(signal.SIGTERM, lambda *_: coordinator._stop.set())
    print(f"tensorhub coordinator: requests on {coordinator.address}, announcements on "
          f"{coordinator.announce_address}", flush=True)
    if coordinator.curve_public_key:
        print(f"CURVE on: clients need "
              f"{settings.CURVE_SERVER_KEY.name}='{coordinator.curve_public_key}'", flush=True)
    if args.metrics_port is not None:
        coordinator.serve_metrics(args.metrics_port, args.metrics_addr)
        print(f"metrics: http://{args.metrics_addr}:{args.metrics_port}/metrics", flush=True)
    settle_gc()
    try:
        coordinator.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


def _keygen(args: argparse.Namespace) -> int:
    """Write a CURVE keypair for the coordinator and say how to use it."""
    from tensorhub.core import curve

    public_path, secret_path = curve.write_keypair(args.out, args.name, force=args.force)
    public = curve.read_key(public_path)
    print(f"wrote {public_path} (public) and {secret_path} (secret, mode 600)\n"
          f"coordinator: tensorhub coordinator --curve-secret-file {secret_path}\n"
          f"   (or {settings.CURVE_SECRET_FILE.name}={secret_path})\n"
          f"clients:     {settings.CURVE_SERVER_KEY.name}='{public}'\n"
          f"   (or {settings.CURVE_SERVER_KEY_FILE.name}={public_path})")
    return 0


def _status(args: argparse.Namespace) -> int:
    from tensorhub.core.client import CoordinatorClient
    from tensorhub.core.data_types import StatusRequest
    from tensorhub.core.patch import PATCH_SUFFIX, is_patch_model, patch_model

    if args.watch:
        try:
            from tensorhub.tools.live_view import watch
        except ModuleNotFoundError as exc:
            if (exc.name or "").partition(".")[0] != "rich":
                raise
            raise SystemExit("tensorhub status --watch needs the rich package: pip install "
                             "rich (or pip install 'tensorhub[watch]')") from None

        watch(args.coordinator, interval=args.interval, timeout=args.timeout)
        return 0
    client = CoordinatorClient(args.coordinator, timeout=args.timeout)
    try:
        reply = client.call(StatusRequest())
    finally:
        client.close()
    if args.json:
        print(json.dumps(reply.model_dump(mode="json"), indent=2))
        return 0
    print(f"coordinator {args.coordinator}: {len(reply.workers)} workers, "
          f"{reply.reads_in_flight} reads in flight")
    for w in reply.workers:
        print(f"  worker {w['worker_id']:<28} {w['role']:<8} {w['transport']:<5} "
              f"seen {w['seen_ago']}s ago  {w.get('labels', '')}")
    for p in reply.pulls:
        print(f"  pulling {p.reader} <- {p.model} v{p.version}: {p.done / 2**20:.1f} of "
              f"{p.total / 2**20:.1f} MiB in {p.seconds:.0f} s")
    listed = {m.model for m in reply.models}
    patches = {m.model: m for m in reply.models if is_patch_model(m.model)
               and m.model.removesuffix(PATCH_SUFFIX) in listed}
    for m in reply.models:
        if m.model in patches:
            continue  # (shown under the model it patches)
        print(f"model {m.model}: latest v{m.latest}")
        _print_versions(m, "  ")
        if patch_model(m.model) in patches:
            print(f"  patches ({patch_model(m.model)}):")
            _print_versions(patches[patch_model(m.model)], "    ")
    if reply.suspect_readers:
        print(f"readers failing on every holder they try (check their transport settings): "
              f"{', '.join(reply.suspect_readers)}")
    if reply.transfers:
        print("recent pulls (reader <- source):")
        for t in reply.transfers[-20:]:
            rate = t.nbytes / t.seconds / 1e9 if t.seconds else 0.0
            at = time.strftime("%H:%M:%S ", time.localtime(t.ended_at)) if t.ended_at else ""
            print(f"  {at}{t.reader} <- {t.source}: {t.model} v{t.version} "
                  f"{t.nbytes / 2**20:.1f} MiB {rate:.2f} GB/s {'ok' if t.ok else t.error}")
    return 0


def _print_versions(m, indent: str) -> None:
    for v in m.versions:
        holders = ", ".join(
            f"{h.name}{'(withdrawn)' if h.withdrawn else ''}[{h.active_reads} reads]"
            for h in v.holders) or "no holder"
        print(f"{indent}v{v.version} layout {v.layout_id} {v.nbytes / 2**20:.1f} MiB: "
              f"{holders}")


def _forget(args: argparse.Namespace) -> int:
    """Drop a model nobody uses any more (and its patches) from the coordinator."""
    from tensorhub.core.client import CoordinatorClient
    from tensorhub.core.data_types import Forget

    client = CoordinatorClient(args.coordinator, timeout=args.timeout)
    try:
        reply = client.call(Forget(model=args.model))
    finally:
        client.close()
    print("forgot " + "; ".join(f"{m} ({', '.join(f'v{v}' for v in vs) or 'no version'})"
                                for m, vs in reply.versions.items()))
    return 0


def _replica(args: argparse.Namespace) -> int:
    """A replica process with no weights of its own: allocate from the manifest (or from the
    declared first version, `--standby`), then follow announcements or, `--on-demand`, pull
    each version named on stdin."""
    from tensorhub.core.checksum import checksum
    from tensorhub.core.errors import TensorHubError
    from tensorhub.replica import Replica

    deadline = time.monotonic() + args.timeout
    replica = Replica(args.coordinator, args.model, name=args.name, transport=args.transport,
                      whole_items=args.whole_items, coordinator_wait=min(120.0, args.timeout))
    name = replica.session.name  # (its default: replica-HOST-PID)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    asked = _stdin_lines(stop) if args.on_demand else None
    pulled = 0
    try:
        if args.standby and _stand_by(replica, deadline, stop) and args.json:
            print(json.dumps({"event": "standing_by", "name": name}), flush=True)
        while not stop and (args.versions == 0 or pulled < args.versions):
            left = min(1.0, max(0.0, deadline - time.monotonic()))
            if asked is not None:  # as an RL driver tells its rollout workers at a sync
                try:
                    target: int | str | None = int(asked.get(timeout=left))
                except queue.Empty:
                    target = None
            else:
                target = "latest" if replica.wait_for_newer(timeout=left) is not None else None
            if target is None:
                if time.monotonic() > deadline:
                    print(json.dumps({"event": "timeout"}) if args.json else "timed out",
                          flush=True)
                    return 1
                continue
            started_at = time.time()  # wall clock: comparable across processes and hosts
            try:
                version = replica.pull(version=target, timeout=args.pull_timeout)
            except TensorHubError as exc:
                print(json.dumps({"event": "error", "code": exc.code, "message": str(exc),
                                  "started_at": started_at, "ended_at": time.time()})
                      if args.json else f"pull failed: {exc}", flush=True)
                continue
            pulled += 1
            s = replica.last_pull
            if args.json:
                event = {"event": "pulled", "name": name, "version": version,
                         "sources": s.sources, "by_source": s.by_source, "nbytes": s.nbytes,
                         "seconds": s.seconds, "gbps": s.gbps, "started_at": started_at,
                         "ended_at": time.time(), "planned": replica.last_pull_planned,
                         "patches": replica.last_pull_patches}
                if args.checksums:
                    event["checksums"] = {n: checksum(t) for n, t in replica.tensors.items()}
                print(json.dumps(event), flush=True)
            else:
                print(f"{name}: v{version} from {'+'.join(s.sources)} "
                      f"{s.nbytes / 2**20:.1f} MiB in {s.seconds * 1e3:.1f} ms "
                      f"({s.gbps:.2f} GB/s)", flush=True)
        if args.linger:
            while not stop:  # keep serving what we hold until told to stop
                time.sleep(0.1)
    finally:
        replica.close()
    return 0


def _stdin_lines(stop: list) -> queue.Queue[str]:
    """Lines of stdin as they come, read on a thread (the main one stays free to stop);
    end of input stops the process."""
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        for line in sys.stdin:
            if line.strip():
                lines.put(line.strip())
        stop.append(1)

    threading.Thread(target=read, daemon=True, name="tensorhub-stdin").start()
    return lines


def _stand_by(replica, deadline: float, stop: list) -> bool:
    """Allocate buffers from the declared first version once the trainer declared it, and
    stand by in its forest (`Replica.stand_by`); False if a version came out first (the
    follow loop pulls it) or the time ran out."""
    from tensorhub.core.data_types import GetDeclared
    from tensorhub.core.errors import CoordinatorError

    while not stop and time.monotonic() < deadline:
        if replica.layout is None:
            try:
                replica.allocate(replica.session.call(GetDeclared(model=replica.model)).manifest)
            except CoordinatorError as exc:
                if exc.code != "unknown_model":
                    raise
        if replica.layout is not None and replica.stand_by():
            return True
        if replica.wait_for_newer(timeout=0.1, than=None) is not None:
            return False
    return False


def _load_weights(path: str) -> dict:
    """Every tensor of the `*.safetensors` files in a folder (an HF checkpoint), in order."""
    from pathlib import Path

    try:
        from safetensors.torch import load_file
    except ImportError:
        raise SystemExit("tensorhub publish PATH needs the safetensors package "
                         "(pip install safetensors)") from None
    files = sorted(Path(path).glob("*.safetensors")) if Path(path).is_dir() else [Path(path)]
    if not files or not all(f.is_file() for f in files):
        raise SystemExit(f"tensorhub publish: no *.safetensors file at {path}")
    state: dict = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def _wait_replicas(pub, version: int, count: int, timeout: float, stop: list) -> bool:
    """Whether `count` replicas hold `version` within `timeout` (they may not have started:
    unlike `Publisher.retained`, no replica registered yet is no reason to stop waiting)."""
    from tensorhub.core.data_types import RetentionRequest

    deadline = time.monotonic() + timeout
    while not stop and time.monotonic() < deadline:
        reply = pub.session.client.call(RetentionRequest(model=pub.model, version=version,
                                                         layout_id=pub.layout_id))
        if reply.replica_holders >= count:
            return True
        time.sleep(0.05)
    return False


def _change(state: dict[str, torch.Tensor], density: float, g: torch.Generator) -> None:
    """A synthetic next version: every element changes (`density` 1), or that share of
    each tensor's elements moves by one step of its dtype (the next representable value)."""
    import torch

    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    for t in state.values():
        flat = t.view(-1)
        if density >= 1:
            flat.add_(1)
        else:
            n = max(1, int(density * flat.numel()))
            idx = torch.randint(0, flat.numel(), (n,), generator=g)
            flat.view(ints[t.element_size()])[idx] += 1


def _publish(args: argparse.Namespace) -> int:
    """A trainer process: publish versions, each once `--wait-replicas` replicas hold the
    previous one, then keep serving (`--linger`). For seeding a fleet from a checkpoint, and
    for tests and benchmarks that need a trainer on a host of its own."""
    from tensorhub.core.checksum import checksum
    from tensorhub.publisher import Publisher
    from tensorhub.tools.synthetic_weights import synthetic_state_dict

    if args.path is None and args.synthetic_mb is None:
        raise SystemExit("tensorhub publish: nothing to publish: give a checkpoint PATH (a "
                         "safetensors file or folder) or --synthetic-mb MIB")
    if args.path is not None and args.synthetic_mb is not None:
        raise SystemExit("tensorhub publish: give a checkpoint PATH or --synthetic-mb, not both")
    import torch

    trainer = None
    if args.adamw_lr is not None:
        from tensorhub.tools.synthetic_weights import AdamWSteps
        trainer = AdamWSteps(args.synthetic_mb, args.adamw_lr, seed=args.seed)
        for _ in range(args.warmup):
            trainer.step()
        state = trainer.state_dict()
    else:
        state = (_load_weights(args.path) if args.path is not None
                 else synthetic_state_dict(args.synthetic_mb, n_tiny=args.tiny, seed=args.seed,
                                           dtype=getattr(torch, args.dtype)))
    g = torch.Generator().manual_seed(args.seed + 1)
    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    pub = Publisher(args.coordinator, args.model, name=args.name, transport=args.transport,
                    min_replicas=args.wait_replicas, retain_timeout=args.timeout)
    try:
        if args.declare is not None and pub.declare(state):
            # readers allocate from the declaration and stand by before the version exists
            print(json.dumps({"event": "declared"}) if args.json else
                  f"{args.name}: declared {args.model}'s first version", flush=True)
            time.sleep(args.declare)
        for k in range(args.versions):
            if k and trainer is not None:
                trainer.step()
            elif k:
                _change(state, args.density[(k - 1) % len(args.density)], g)
            # (checksummed before it is published: afterwards the trainer's cores serve
            # its first readers)
            sums = {n: checksum(t) for n, t in state.items()} if args.checksums else None
            started, at = time.monotonic(), time.time()
            version = pub.publish(state)
            event = {"event": "published", "name": args.name, "version": version,
                     "nbytes": sum(t.numel() * t.element_size() for t in state.values()),
                     "at": at, "publish_seconds": round(time.monotonic() - started, 4)}
            decision = pub.last_patch_decision
            if decision is not None and decision.version == version:
                event["patch_weighed"] = {"build": decision.verdict.patch,
                                          "why": decision.verdict.why}
            if pub.last_patch is not None and pub.last_patch.version == version:
                event["patch"] = {"nbytes": pub.last_patch.nbytes,
                                  "density": pub.last_patch.density}
            if sums is not None:
                event["checksums"] = sums
            print(json.dumps(event) if args.json else
                  f"{args.name}: published {args.model} v{version} "
                  f"({event['nbytes'] / 2**20:.1f} MiB)", flush=True)
            if args.wait_replicas:
                held = _wait_replicas(pub, version, args.wait_replicas, args.timeout, stop)
                event = {"event": "held" if held else "timeout", "version": version,
                         "seconds": round(time.monotonic() - started, 4)}
                print(json.dumps(event) if args.json else
                      f"v{version}: {args.wait_replicas} replica(s) "
                      f"{'hold it after' if held else 'did not hold it within'} "
                      f"{event['seconds']:.2f} s", flush=True)
                if not held:
                    return 1
        while args.linger and not stop:  # keep serving the last version until told to stop
            time.sleep(0.1)
    finally:
        pub.close(retain=not stop)  # told to stop: no waiting for retention
    return 0


def _simulate(args: argparse.Namespace) -> int:
    """Fleet sizes through the real coordinator on a simulated clock and network."""
    from pathlib import Path

    from tensorhub.sim.config import SimConfig
    from tensorhub.sim.sweep import plot, run_sweep

    base = SimConfig(model_bytes=int(args.model_gib * 2**30),
                     chunk_bytes=int(args.chunk_mib * 2**20), nic_gbps=args.nic_gbps,
                     dcs=args.dcs)
    rows = run_sweep(base, args.sizes)
    if args.plot:
        print(f"plot: {plot(rows, Path(args.plot))}")
    return 0 if all(r.unfinished == 0 for r in rows) else 1


def _demo(args: argparse.Namespace) -> int:
    from tensorhub.tools.demo import run_demo

    return run_demo(args)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tensorhub-plugins")  # (the distribution's name, pyproject.toml)
    except PackageNotFoundError:  # (run from a source tree that is not installed)
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tensorhub",
        description="TensorHub: publish LLM weight versions from a trainer; engines pull them "
                    "one-sided from whichever peer already holds them.")
    parser.add_argument("--version", action="version", version=f"tensorhub {_version()}")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING (default INFO)")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("coordinator", help="run the coordinator (references, plans, leases)",
                       description="Run the coordinator. It stores no weights, only which "
                       "worker holds which version. Set TENSORHUB_TOKEN (or "
                       "TENSORHUB_TOKEN_FILE) to require a shared token from every client.")
    p.add_argument("--bind", default=DEFAULT_COORDINATOR,
                   help=f"ZeroMQ address for requests (default {DEFAULT_COORDINATOR})")
    p.add_argument("--announce", default=None,
                   help="ZeroMQ address for version announcements (default: bind port + 1)")
    p.add_argument("--heartbeat-interval", type=float, default=1.0,
                   help="seconds between worker heartbeats (default 1)")
    p.add_argument("--worker-ttl", type=float, default=5.0,
                   help="a worker silent this long loses its references (default 5)")
    p.add_argument("--lease-ttl", type=float, default=120.0,
                   help="longest a read may keep a holder from overwriting (default 120)")
    p.add_argument("--busy-retry", type=_positive, default=0.05,
                   help="the longest a reader refused as busy waits before asking again "
                        "(default 0.05 s); the coordinator asks for less, a quarter of a "
                        "chunk's time at the rate reads have had lately, down to 5 ms")
    p.add_argument("--max-readers-per-holder", type=int, default=2,
                   help="concurrent readers per holder; forms trees, not stars (default 2)")
    p.add_argument("--stripes", type=int, default=2, choices=range(1, 65), metavar="K",
                   help="a version's chunks are dealt into K stripes, each pulled from its "
                        "own parent (a tree per stripe; default 2)")
    p.add_argument("--chunk-mib", type=_positive, default=None,
                   help="size of the chunks a version is pulled and served in, in MiB (default: "
                        "64, or less for a version under 4 GiB, which is cut into 64 chunks of "
                        "at least 8 MiB: a fan-out's tail is a few chunk times)")
    p.add_argument("--curve-secret-file", default=None,
                   help="encrypt and authenticate the control plane with ZeroMQ CURVE, using "
                   "this secret key (from `tensorhub keygen`; default: "
                   "$TENSORHUB_CURVE_SECRET_FILE, else no CURVE)")
    p.add_argument("--owner-key-file", default=None, metavar="PATH",
                   help="the key the credential binding each model to its trainer is made "
                        "with, kept so that trainers keep their models across coordinator "
                        "restarts (made at the first start, mode 600; default "
                        "$XDG_STATE_HOME/tensorhub/coordinator-owner.key, i.e. "
                        "~/.local/state/...; 'none': a new key each start; with "
                        "--curve-secret-file the CURVE secret is the key)")
    p.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="serve Prometheus metrics on http://ADDR:PORT/metrics: versions, "
                        "holders, plans and busy replies, plan latency, evictions, bytes by "
                        "source, reads in flight (default: off)")
    p.add_argument("--metrics-addr", default="0.0.0.0",
                   help="address the metrics server listens on (default 0.0.0.0)")
    p.set_defaults(func=_coordinator)

    p = sub.add_parser("keygen", help="write a CURVE keypair for the coordinator",
                       description="Write NAME.key (public: give it to every client as "
                       "TENSORHUB_CURVE_SERVER_KEY) and NAME.key_secret (for the coordinator's "
                       "--curve-secret-file only, mode 600).")
    p.add_argument("--out", default=".", help="directory to write the two files into")
    p.add_argument("--name", default="coordinator", help="file name stem (default coordinator)")
    p.add_argument("--force", action="store_true", help="replace an existing secret key")
    p.set_defaults(func=_keygen)

    p = sub.add_parser("status", help="models, versions, holders and recent pulls")
    _coordinator_flag(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--watch", action="store_true",
                   help="redraw the fleet every --interval seconds (Ctrl-C ends): versions, "
                        "holders, pulls in flight with progress and GB/s, recent pulls")
    p.add_argument("--interval", type=_positive, default=1.0,
                   help="seconds between redraws with --watch (default 1)")
    p.add_argument("--timeout", type=float, default=5.0,
                   help="seconds to wait for the coordinator's answer (default 5)")
    p.set_defaults(func=_status)

    p = sub.add_parser("forget", help="drop a model nobody uses any more, and its patches",
                       description="Drop MODEL and its patches (MODEL.patch) from the "
                       "coordinator's records, so that status lists only the models in use. "
                       "Refused, naming them, while any worker holds, publishes or reads it.")
    p.add_argument("model", help="the model to forget")
    _coordinator_flag(p)
    p.add_argument("--timeout", type=float, default=5.0,
                   help="seconds to wait for the coordinator's answer (default 5)")
    p.set_defaults(func=_forget)

    p = sub.add_parser("replica", help="a replica process: pull each new version, serve it on",
                       description="Allocate buffers from the model's manifest, pull every new "
                       "version as it is announced (or as stdin names it: --on-demand), and "
                       "serve it to other readers.")
    _coordinator_flag(p)
    p.add_argument("--model", default="policy", help="the model to follow (default policy)")
    p.add_argument("--name", default=None,
                   help="this worker's name in status and logs (default replica-HOST-PID)")
    p.add_argument("--transport", choices=["nixl", "zmq", "cma", "auto"], default=None,
                   help="default: $TENSORHUB_TRANSPORT or auto")
    p.add_argument("--versions", type=int, default=0, help="stop after N pulls (0: never)")
    p.add_argument("--timeout", type=float, default=600.0, help="give up after this long")
    p.add_argument("--pull-timeout", type=float, default=60.0,
                   help="longest one pull may take (default 60 s)")
    p.add_argument("--linger", action="store_true",
                   help="after the last pull, keep serving until SIGTERM")
    p.add_argument("--json", action="store_true", help="one JSON line per pull")
    p.add_argument("--checksums", action="store_true", help="with --json: per-tensor checksums")
    p.add_argument("--on-demand", action="store_true",
                   help="pull the versions named on stdin, one a line, when each is named "
                        "(as an RL framework's rollout workers sync), instead of following")
    p.add_argument("--standby", action="store_true",
                   help="allocate from the trainer's declared first version and stand by in "
                        "its forest before it is published (publish --declare)")
    p.add_argument("--whole-items", action="store_true",
                   help="ask for whole-item plans from one holder (no pipelining: peers are "
                        "used only once they hold the whole version); default: striped "
                        "pulls, a parent per stripe, serving each finished chunk at once")
    p.set_defaults(func=_replica)

    p = sub.add_parser("publish", help="a trainer process: publish a checkpoint or synthetic "
                       "weights as new versions",
                       description="Publish the tensors of a safetensors checkpoint (PATH: a "
                       "file or an HF model folder) or synthetic weights (--synthetic-mb) as "
                       "--versions new versions, each after --wait-replicas replicas hold the "
                       "previous one; --linger keeps serving the last until SIGTERM.")
    p.add_argument("path", nargs="?", default=None, help="safetensors file or folder")
    _coordinator_flag(p)
    p.add_argument("--model", default="policy", help="the model to publish (default policy)")
    p.add_argument("--name", default="trainer",
                   help="this worker's name in status and logs (default trainer)")
    p.add_argument("--transport", choices=["nixl", "zmq", "cma", "auto"], default=None,
                   help="default: $TENSORHUB_TRANSPORT or auto")
    p.add_argument("--synthetic-mb", type=float, default=None,
                   help="publish synthetic weights of this many MiB instead of PATH")
    p.add_argument("--tiny", type=int, default=100,
                   help="with --synthetic-mb: small tensors among them (default 100)")
    p.add_argument("--seed", type=int, default=0,
                   help="with --synthetic-mb: seed of the synthetic weights (default 0)")
    p.add_argument("--versions", type=int, default=1, help="versions to publish (default 1)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="with --synthetic-mb: the weights' dtype (default float32)")
    p.add_argument("--density", type=float, nargs="+", default=[1.0],
                   help="with --synthetic-mb: the share of elements each new version changes "
                        "(default 1: all, so every version moves whole; at a few percent "
                        "readers take it as a patch); several: version k+1 takes the k-th, "
                        "round and round")
    p.add_argument("--adamw-lr", type=float, default=None,
                   help="with --synthetic-mb: publish a small bf16 transformer of that size "
                        "instead, one AdamW step at this learning rate per version (RL "
                        "learning rates: 1e-6 to 1e-5)")
    p.add_argument("--warmup", type=int, default=3,
                   help="with --adamw-lr: optimizer steps before the first version "
                        "(default 3: AdamW's first steps change nearly every element)")
    p.add_argument("--wait-replicas", type=int, default=0,
                   help="before the next version (and before exiting), wait until this many "
                        "replicas hold the current one (default 0: do not wait)")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="longest wait for --wait-replicas (default 300 s)")
    p.add_argument("--declare", type=float, default=None, metavar="SECONDS",
                   help="declare the first version's tensors (Publisher.declare) and publish "
                        "it this many seconds later, so that readers stand by for it")
    p.add_argument("--linger", action="store_true",
                   help="after the last version, keep serving it until SIGTERM")
    p.add_argument("--json", action="store_true", help="one JSON line per event")
    p.add_argument("--checksums", action="store_true", help="with --json: per-tensor checksums")
    p.set_defaults(func=_publish)

    p = sub.add_parser("simulate", help="simulated fan-out to N replicas, real planner",
                       description="Drive the real coordinator with simulated workers and "
                       "links; print completion time / lower bound per fleet size, beside a "
                       "star and a ring.")
    p.add_argument("--sizes", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256],
                   help="fleet sizes to simulate, one run each (default 8 16 32 64 128 256)")
    p.add_argument("--model-gib", type=float, default=8.0,
                   help="size of the simulated version in GiB (default 8)")
    p.add_argument("--chunk-mib", type=float, default=64.0,
                   help="chunk size in MiB the version is pulled and served in (default 64)")
    p.add_argument("--nic-gbps", type=float, default=100.0,
                   help="each simulated worker's NIC bandwidth in Gbit/s (default 100)")
    p.add_argument("--dcs", type=int, default=1,
                   help="datacenters, workers dealt round robin among them (default 1)")
    p.add_argument("--plot", default=None, metavar="PNG",
                   help="write a plot of the runs to this PNG file (needs matplotlib)")
    p.set_defaults(func=_simulate)

    p = sub.add_parser("demo", help="coordinator + trainer + replicas on this machine",
                       description="Start a coordinator and replica processes, publish a few "
                       "versions from an in-process trainer, and show who pulled from whom.")
    p.add_argument("--replicas", type=int, default=2,
                   help="replica processes to start (default 2)")
    p.add_argument("--versions", type=int, default=3,
                   help="versions the trainer publishes (default 3)")
    p.add_argument("--size-mb", type=int, default=256, help="size of the fake model (MiB)")
    p.add_argument("--transport", choices=["nixl", "zmq", "cma", "auto"], default=None,
                   help="default: $TENSORHUB_TRANSPORT or auto (shared memory / cma on this "
                        "host)")
    p.add_argument("--port", type=int, default=5655,
                   help="the demo coordinator's request port on 127.0.0.1; announcements "
                        "use the next one (default 5655)")
    p.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("nixl").setLevel(logging.WARNING)
    from tensorhub.core.errors import TensorHubError

    try:
        return args.func(args)
    except TensorHubError as exc:
        print(f"tensorhub: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # (`tensorhub status | head`: the reader has gone)
        # What is still buffered for stdout goes nowhere, not into a second error at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # as a shell reports a process ended by SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
