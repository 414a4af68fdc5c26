"""A vLLM engine following a trainer that takes real AdamW steps: patches against whole
versions.

The trainer is HF transformers' Qwen2 (random, bf16, ~50 MiB) trained with AdamW at an RL
learning rate on next-token loss over random tokens, one version per optimizer step; one
`vllm serve` engine with the TensorHub plugin follows it (follow mode). Measured in one run:
per version, publish -> the engine serves it, and the bytes the engine pulled, first with
every version whole (`Publisher(patches=False)`), then with patches; the density (share of
bf16 words each step changed) beside them. Bit-exact: the engine's copy verifies each
version's checksums before the engine loads it (a patched one item by item against the
trainer's).

Run: python -m bench.vllm_patches [--updates 3] [--lr 3e-6]   (needs the vllm venv)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from bench.results import Report
from bench.workdir import make_scratch, tear_down
from integration.engine_venvs import engine_python
from integration.tiny_model import build_tiny_model
from integration.vllm_server import VLLMServer
from tensorhub import Publisher
from tensorhub.core.client import CoordinatorClient
from tensorhub.core.data_types import StatusRequest
from tensorhub_testing.local_fleet import coordinator_process

ARCH = dict(hidden=512, layers=8, heads=8, kv_heads=2, intermediate=1408, vocab=1024)


class Trainer:
    """The HF model and its AdamW; `step()` is one optimizer step on a random batch."""

    def __init__(self, model_dir, lr: float, seed: int = 0):
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir),
                                                          dtype=torch.bfloat16)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)
        self.vocab = self.model.config.vocab_size

    def step(self) -> None:
        tokens = torch.randint(0, self.vocab, (2, 33))
        self.model(input_ids=tokens, labels=tokens).loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def state(self) -> dict[str, torch.Tensor]:
        return {n: t.detach() for n, t in self.model.state_dict().items()}


def pulled_bytes(address: str, version: int) -> int:
    """Bytes engines read for `version` (the version or its patch)."""
    client = CoordinatorClient(address)
    try:
        transfers = client.call(StatusRequest()).transfers
    finally:
        client.close()
    return sum(t.nbytes for t in transfers
               if t.version == version and t.ok and t.reader.startswith("vllm"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--updates", type=int, default=3)
    p.add_argument("--lr", type=float, default=3e-6)
    args = p.parse_args()
    report = Report("vllm_patches")
    work = make_scratch("vllm-patches")
    model_dir = build_tiny_model(work / "model", dtype=torch.bfloat16, **ARCH)
    trainer = Trainer(model_dir, args.lr)
    for _ in range(3):  # AdamW's first steps change nearly every element
        trainer.step()
    nbytes = sum(t.numel() * t.element_size() for t in trainer.state().values())
    print(f"model: {nbytes / 2**20:.0f} MiB bf16, AdamW lr {args.lr:g}", flush=True)
    python = engine_python("vllm")
    coordinator, address = coordinator_process()
    servers: list[VLLMServer] = []
    publisher = None
    results: dict[str, dict[str, list[float]]] = {}
    try:
        coordinator.next_line(timeout=60)
        engine = VLLMServer(python, model_dir, dtype="bfloat16",
                            extra_args=["--weight-transfer-config",
                                        json.dumps({"backend": "tensorhub"})],
                            env={"VLLM_PLUGINS": "tensorhub", "TENSORHUB_COORDINATOR": address,
                                 "TENSORHUB_MODEL": "policy"}, log_path=work / "engine.log")
        servers.append(engine)
        for k, mode in enumerate(("whole", "patches")):
            publisher = Publisher(address, "policy", patches=mode == "patches")
            version = publisher.publish(trainer.state())  # the base: whole either way
            if k == 0:
                engine.start(timeout=600)
            engine.wait_serving(version, timeout=300)
            got = results[mode] = {"seconds": [], "pulled": [], "density": []}
            for _ in range(args.updates):
                trainer.step()
                started = time.perf_counter()
                version = publisher.publish(trainer.state())
                engine.wait_serving(version, timeout=300, interval=0.01)
                got["seconds"].append(time.perf_counter() - started)
                got["pulled"].append(pulled_bytes(address, version))
                if publisher.last_patch is not None:
                    got["density"].append(publisher.last_patch.density)
                print(f"{mode} v{version}: {got['seconds'][-1]:.2f} s to serving, engine "
                      f"pulled {got['pulled'][-1] / nbytes:.4f} of the model", flush=True)
            publisher.close()
            publisher = None
        med = statistics.median
        ours, whole = results["patches"], results["whole"]
        name = f"vLLM engine, {nbytes / 2**20:.0f} MiB bf16 Qwen2, AdamW lr {args.lr:g}"
        report.add(f"{name}: publish to serving", med(ours["seconds"]), "s",
                   "whole versions", med(whole["seconds"]), higher_is_better=False)
        report.add(f"{name}: bytes the engine pulled per version / model bytes",
                   med(ours["pulled"]) / nbytes, "x", "whole versions",
                   med(whole["pulled"]) / nbytes, higher_is_better=False)
        report.add(f"{name}: density (share of bf16 words a step changed)",
                   med(ours["density"]), "")
        report.write()
    finally:
        tear_down(servers, publisher, coordinator, work)


if __name__ == "__main__":
    main()
