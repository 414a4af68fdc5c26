"""Patches against whole versions: how small a version's patch is, and what it saves a fleet.

- encodings: a bf16 transformer trained with AdamW at RL learning rates (1e-6, 3e-6, 1e-5;
  `tensorhub/tools/synthetic_weights.py`), each step's patch in the encodings considered, as bytes /
  model bytes, with the share of bf16 words the step changed (its density). TensorHub's is
  the byte-planar gaps + XOR with zstd (`core/patch.py`); the others are what it was chosen
  over.
- density: synthetic bf16 weights of which a share of elements moves by one bf16 step:
  patch bytes / model bytes, and the trainer's cost to make it and a reader's to apply it.
- wan: trainer in DC A, readers in DC B behind a WAN link (emulated hosts, shaped links):
  per version, the time from publish until every reader holds it and the bytes over the
  WAN, with patches against whole versions (`TENSORHUB_PATCHES=0`), beside one WAN copy
  of the model and of the patch (the bounds), measured in the same run. Bit-exact: every
  reader's checksums equal the trainer's, every version.

- steps: synthetic bf16 and float32 weights of which 0.1 %, 1 %, 10 % or 100 % of elements
  move by one step of their dtype: the trainer's publish call and the time from publish
  until every reader holds it, with patches (the trainer weighs each before building it,
  each reader before taking it: `core/patch_budget.py`) against every version whole, on
  one host (beside one memcpy of the model) and with 2 readers across a WAN (beside one
  WAN copy of the model), each measured in the same run.

Run: python -m bench.patches [--only encodings density wan steps] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import zlib

import numpy as np
import torch
import zstandard

from bench.results import Report
from tensorhub.core.patch import PatchWriter, apply_patch, changes
from tensorhub.tools.synthetic_weights import AdamWSteps
from tensorhub_testing.cluster import Cluster, HostSpec, available, tcp_transfer
from tensorhub_testing.fleet import Fleet


def _items(state: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    return [t.reshape(-1).view(torch.uint8) for t in state.values()]


def _alternatives(old: list[torch.Tensor], new: list[torch.Tensor]) -> dict[str, int]:
    """Bytes of the same changes in the encodings TensorHub's was chosen over."""
    out = {"uint32 index + new value": 0, "uint16 gaps + new value, zstd": 0,
           "bitmap + XOR, zstd": 0, "planar gaps + XOR, zlib": 0}
    z = zstandard.ZstdCompressor(level=1)
    for a, b in zip(old, new, strict=True):
        positions, xor = changes(a, b)
        if not len(positions):
            continue
        values = b.view(torch.int16).numpy()[positions] if b.numel() % 2 == 0 \
            else b.numpy()[positions]
        gaps = np.minimum(np.diff(positions, prepend=-1), 0xFFFF).astype(np.uint16)
        out["uint32 index + new value"] += len(positions) * (4 + values.itemsize)
        out["uint16 gaps + new value, zstd"] += len(z.compress(gaps.tobytes()
                                                              + values.tobytes()))
        mask = np.zeros(a.numel() // xor.itemsize, dtype=bool)
        mask[positions] = True
        out["bitmap + XOR, zstd"] += len(z.compress(np.packbits(mask).tobytes()
                                                    + xor.tobytes()))
        planes = gaps.view(np.uint8).reshape(-1, 2).T.tobytes() + \
            xor.view(np.uint8).reshape(-1, xor.itemsize).T.tobytes()
        out["planar gaps + XOR, zlib"] += len(zlib.compress(planes, 1))
    return out


def _patch(old: list[torch.Tensor], new: list[torch.Tensor]) -> tuple[bytes, PatchWriter, float]:
    started = time.perf_counter()
    writer = PatchWriter(1, 2, "bench")
    for k, (a, b) in enumerate(zip(old, new, strict=True)):
        writer.item(k, a, b)
    data = writer.finish()
    return data, writer, time.perf_counter() - started


def encodings(report: Report, size_mb: float, steps: int) -> None:
    for lr in (1e-6, 3e-6, 1e-5):
        trainer = AdamWSteps(size_mb, lr)
        for _ in range(3):  # AdamW's first steps change nearly every element
            trainer.step()
        sizes: dict[str, list[float]] = {}
        densities, seconds = [], []
        nbytes = sum(t.numel() * 2 for t in trainer.state_dict().values())
        for _ in range(steps):
            old = [t.clone() for t in _items(trainer.state_dict())]
            trainer.step()
            new = _items(trainer.state_dict())
            data, writer, took = _patch(old, new)
            densities.append(writer.density)
            seconds.append(took)
            sizes.setdefault("ours", []).append(len(data) / nbytes)
            for name, n in _alternatives(old, new).items():
                sizes.setdefault(name, []).append(n / nbytes)
        density = statistics.mean(densities)
        name = f"AdamW bf16 step at lr {lr:g} ({nbytes / 2**20:.0f} MiB)"
        report.add(f"{name}: density (share of bf16 words changed)", density, "")
        ours = statistics.mean(sizes["ours"])
        for alt in [k for k in sizes if k != "ours"]:
            report.add(f"{name}: patch bytes / model bytes", ours, "x", alt,
                       statistics.mean(sizes[alt]), higher_is_better=False)
        report.add(f"{name}: patch bytes / model bytes", ours, "x", "the whole version", 1.0,
                   higher_is_better=False)
        report.add(f"{name}: making the patch (trainer, CPU)", statistics.median(seconds), "s")
        print(f"{name}: density {density:.4f}, patch {ours:.4f} of the model "
              f"({', '.join(f'{k} {statistics.mean(v):.4f}' for k, v in sizes.items())})",
              flush=True)


def density(report: Report, size_mb: float) -> None:
    g = torch.Generator().manual_seed(0)
    n = int(size_mb * 2**20 / 2)
    base = (torch.randn(n, generator=g) * 0.02).to(torch.bfloat16)
    for share in (0.001, 0.005, 0.01, 0.02, 0.05, 0.1):
        new = base.clone()
        idx = torch.randperm(n, generator=g)[:int(share * n)]
        new.view(torch.int16)[idx] += 1
        old_b, new_b = base.view(torch.uint8), new.view(torch.uint8)
        data, _, made = _patch([old_b], [new_b])
        target = old_b.clone()
        started = time.perf_counter()
        apply_patch(data, [target], base=1, layout_id="bench")
        applied = time.perf_counter() - started
        assert torch.equal(target, new_b)
        name = f"{size_mb:g} MiB bf16, {share:.1%} of elements one step each"
        report.add(f"{name}: patch bytes / model bytes", len(data) / (2 * n), "x",
                   "the whole version", 1.0, higher_is_better=False)
        report.add(f"{name}: making / applying the patch (CPU)", made, "s", "applying",
                   applied, higher_is_better=False)
        print(f"{name}: patch {len(data) / (2 * n):.4f} of the model, made in {made:.3f} s, "
              f"applied in {applied:.3f} s", flush=True)


def _run_wan(cluster: Cluster, readers: list, size_mb: float, versions: int, patches: bool,
             workload: tuple[str, ...], log_dir: str) -> list[dict]:
    """`versions` versions to `readers`; per version after the first: seconds from publish
    to every reader holding it, WAN bytes, bytes each reader pulled, patch or not."""
    n = len(readers)
    env = {} if patches else {"TENSORHUB_PATCHES": "0"}
    out = []
    with Fleet(cluster, log_dir=log_dir, env=env) as fleet:
        procs = [fleet.replica(h, versions=versions, pull_timeout=600) for h in readers]
        time.sleep(1.0)
        trainer = fleet.trainer(cluster.hosts[0], size_mb, versions=versions, wait_replicas=n,
                                extra=(*workload, "--timeout", "900"))
        for k in range(versions):
            wan0 = cluster.wan_traffic(1).received
            published = trainer.next_json(900)
            events = [p.next_json(900) for p in procs]
            assert trainer.next_json(900)["event"] == "held"
            assert all(e["event"] == "pulled" and e["version"] == published["version"]
                       and e["checksums"] == published["checksums"] for e in events), events
            if k:
                out.append({
                    "seconds": max(e["ended_at"] for e in events) - published["at"],
                    "wan_bytes": cluster.wan_traffic(1).received - wan0,
                    "nbytes": published["nbytes"],
                    "pulled": max(e["nbytes"] for e in events),
                    "patch": (published.get("patch") or {}).get("nbytes"),
                    "density": (published.get("patch") or {}).get("density"),
                    "patched": all(e["patches"] for e in events)})
    return out


def wan(report: Report, readers: int, size_mb: float, adamw_mb: float, nic: str, wan_rate: str,
        versions: int, log_root: str) -> None:
    specs = [HostSpec("a0", dc=0), *(HostSpec(f"b{i}", dc=1) for i in range(readers))]
    workloads = {
        f"{size_mb:g} MiB bf16, 1% of elements one step each":
            (size_mb, ("--dtype", "bfloat16", "--density", "0.01")),
        f"{adamw_mb:g} MiB bf16 transformer, AdamW lr 3e-6":
            (adamw_mb, ("--adamw-lr", "3e-6")),
    }
    for label, (mb, workload) in workloads.items():
        with Cluster(specs, egress=nic, wan=wan_rate) as cluster:
            probe = tcp_transfer(cluster.hosts[0], cluster.hosts[1], 8 << 20)
            goodput = probe["bytes"] / probe["seconds"]
            runs = {mode: _run_wan(cluster, cluster.hosts[1:], mb, versions, mode == "patches",
                                   workload, f"{log_root}/{label[:12]}-{mode}")
                    for mode in ("patches", "whole")}
        ours, whole = runs["patches"], runs["whole"]
        assert all(r["patched"] for r in ours), ours
        model = ours[0]["nbytes"]
        name = f"WAN {wan_rate}, {readers} readers in DC B, {label}"
        t_ours = statistics.median(r["seconds"] for r in ours)
        t_whole = statistics.median(r["seconds"] for r in whole)
        report.add(f"{name}: publish to all readers holding it", t_ours, "s",
                   "whole versions", t_whole, higher_is_better=False)
        report.add(f"{name}: WAN bytes per version / model bytes",
                   statistics.median(r["wan_bytes"] for r in ours) / model, "x",
                   "whole versions", statistics.median(r["wan_bytes"] for r in whole) / model,
                   higher_is_better=False)
        report.add(f"{name}: bytes a reader pulled per version / model bytes",
                   statistics.median(r["pulled"] for r in ours) / model, "x",
                   "whole versions", statistics.median(r["pulled"] for r in whole) / model,
                   higher_is_better=False)
        patch = statistics.median(r["patch"] for r in ours)
        report.add(f"{name}: publish to all / one WAN copy of the patch", t_ours /
                   (patch / goodput), "x", "whole versions / one WAN copy of the model",
                   t_whole / (model / goodput), higher_is_better=False)
        report.add(f"{name}: density", statistics.median(r["density"] for r in ours), "")
        print(f"{name}: {t_ours:.2f} s vs {t_whole:.2f} s whole ({t_whole / t_ours:.1f} x); "
              f"WAN {statistics.median(r['wan_bytes'] for r in ours) / model:.4f} vs "
              f"{statistics.median(r['wan_bytes'] for r in whole) / model:.2f} copies; "
              f"patch {patch / model:.4f} of the model", flush=True)


STEP_DENSITIES = (0.001, 0.01, 0.1, 1.0)


def memcpy_seconds(nbytes: int) -> float:
    """One same-host copy of `nbytes` (the bound of a pull on one host), best of 3."""
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - started)
    return best


def _run_steps(cluster: Cluster, trainer_host, readers: list, size_mb: float, dtype: str,
               patches: bool, log_dir: str) -> dict[float, dict]:
    """v1 and a dense v2 (warm whole pulls, as an optimizer's first steps make), then two
    versions at each density of `STEP_DENSITIES` (the second is kept: by then the trainer
    and readers have measured their rates): per density, the trainer's publish call,
    publish -> every reader holds it, and how it moved."""
    env = {} if patches else {"TENSORHUB_PATCHES": "0"}
    sequence = [1.0, *(d for d in STEP_DENSITIES for _ in range(2))]
    out: dict[float, dict] = {}
    with Fleet(cluster, log_dir=log_dir, env=env) as fleet:
        procs = [fleet.replica(h, name=f"r{i}", versions=1 + len(sequence), pull_timeout=600)
                 for i, h in enumerate(readers)]
        time.sleep(1.0)
        trainer = fleet.trainer(trainer_host, size_mb, versions=1 + len(sequence),
                                wait_replicas=len(readers),
                                extra=("--dtype", dtype, "--tiny", "8", "--density",
                                       *map(str, sequence), "--timeout", "900"))
        for k in range(1 + len(sequence)):
            published = trainer.next_json(900)
            events = [p.next_json(900) for p in procs]
            assert trainer.next_json(900)["event"] == "held"
            assert all(e["event"] == "pulled" and e["version"] == published["version"]
                       and e["checksums"] == published["checksums"] for e in events), events
            if k >= 3 and k % 2 == 1:
                out[sequence[k - 1]] = {
                    "publish_s": published["publish_seconds"],
                    "all_s": max(e["ended_at"] for e in events) - published["at"],
                    "nbytes": published["nbytes"],
                    "patch": (published.get("patch") or {}).get("nbytes"),
                    "built": (published.get("patch_weighed") or {}).get("build", False),
                    "patched": sum(bool(e["patches"]) for e in events)}
    return out


def steps(report: Report, size_mb: float, readers: int, wan_rate: str, nic: str,
          log_root: str) -> None:
    """Publish and pull times with patches (the trainer and readers weigh each) against
    every version whole, per density and dtype, on one host and across a WAN."""
    places = {
        "one host": ([HostSpec("h0")], lambda c: (c.hosts[0], [c.hosts[0]] * readers), None),
        f"WAN {wan_rate}": ([HostSpec("a0", dc=0), *(HostSpec(f"b{i}", dc=1)
                                                    for i in range(readers))],
                            lambda c: (c.hosts[0], c.hosts[1:]), wan_rate),
    }
    for place, (specs, roles, wan_link) in places.items():
        for dtype in ("bfloat16", "float32"):
            with Cluster(specs, egress=nic if wan_link else None, wan=wan_link) as cluster:
                trainer_host, reader_hosts = roles(cluster)
                runs = {mode: _run_steps(cluster, trainer_host, reader_hosts, size_mb, dtype,
                                         mode == "patches", f"{log_root}/{place[:3]}-{dtype}"
                                         f"-{mode}") for mode in ("patches", "whole")}
                if wan_link:
                    probe = tcp_transfer(cluster.hosts[0], cluster.hosts[1], 8 << 20)
                    rate = probe["bytes"] / probe["seconds"]
                    bound_name = "one WAN copy of the model (TCP goodput)"
                else:
                    bound_name = "one memcpy of the model"
            for density in STEP_DENSITIES:
                ours, whole = runs["patches"][density], runs["whole"][density]
                model = ours["nbytes"]
                bound = model / rate if wan_link else memcpy_seconds(model)
                name = (f"{place}, {readers} readers, {size_mb:g} MiB {dtype}, "
                        f"{density:.1%} of elements one step each")
                how = (f"patch built, {ours['patched']} of {readers} readers took it"
                       if ours["built"] else "no patch built")
                report.add(f"{name}: publish call ({how})", ours["publish_s"], "s",
                           "every version whole", whole["publish_s"], higher_is_better=False)
                report.add(f"{name}: publish to all readers holding it ({how})",
                           ours["all_s"], "s", "every version whole", whole["all_s"],
                           higher_is_better=False)
                report.add(f"{name}: publish to all / {bound_name}", ours["all_s"] / bound,
                           "x", "every version whole / the same bound", whole["all_s"] / bound,
                           higher_is_better=False)
                print(f"{name}: {how}; publish {ours['publish_s']:.3f} s (whole "
                      f"{whole['publish_s']:.3f}), to all {ours['all_s']:.3f} s (whole "
                      f"{whole['all_s']:.3f}), bound {bound:.3f} s", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+",
                        choices=["encodings", "density", "wan", "steps"],
                        default=["encodings", "density", "wan", "steps"])
    parser.add_argument("--steps-mb", type=float, default=32,
                        help="steps: the model's size")
    parser.add_argument("--size-mb", type=float, default=128)
    parser.add_argument("--adamw-mb", type=float, default=64)
    parser.add_argument("--readers", type=int, default=4)
    parser.add_argument("--nic", default="1gbit")
    parser.add_argument("--wan", default="200mbit")
    parser.add_argument("--versions", type=int, default=4)
    parser.add_argument("--quick", action="store_true",
                        help="small: 32 MiB (steps: 8 MiB), 2 readers")
    args = parser.parse_args(argv)
    if args.quick:
        args.size_mb, args.adamw_mb, args.readers, args.versions = 32, 16, 2, 3
        args.steps_mb = 8
    report = Report("patches")
    if "encodings" in args.only:
        encodings(report, args.adamw_mb, steps=2 if args.quick else 3)
    if "density" in args.only:
        density(report, args.size_mb)
    hosts = [k for k in ("wan", "steps") if k in args.only]
    reason = available() if hosts else None
    if reason is not None:
        print(f"bench.patches: cannot emulate hosts here: {reason}", file=sys.stderr)
    elif hosts:
        logs = tempfile.mkdtemp(prefix="tensorhub-bench-patches-")
        print(f"logs in {logs}", flush=True)
        if "wan" in args.only:
            wan(report, args.readers, args.size_mb, args.adamw_mb, args.nic, args.wan,
                args.versions, logs)
        if "steps" in args.only:
            steps(report, args.steps_mb, 2, args.wan, args.nic, logs)
    report.write(keep_earlier=len(args.only) < 4)
    return 0


if __name__ == "__main__":
    sys.exit(main())
