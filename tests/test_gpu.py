"""The GPU paths on a real CUDA device: buffers allocated, packed and scattered in VRAM,
VRAM registered with NIXL and read one-sided, versions moved between GPU and host memory,
the zmq fallback refusing GPU memory by name. Where no CUDA device exists every test here
skips and says so; `bash scripts/gpu-check.sh` runs them (and only them) on a GPU machine."""

from __future__ import annotations

import pytest
import torch

from tensorhub import Publisher, Replica
from tensorhub.core.checksum import checksum
from tensorhub.core.layout import BoundLayout, manifest_of
from tensorhub.tools.synthetic_weights import synthetic_state_dict

GPU = "cuda"
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device here: the GPU paths did not run")


def sums(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    return {n: checksum(t) for n, t in tensors.items()}


@pytest.fixture
def state() -> dict[str, torch.Tensor]:
    return synthetic_state_dict(16, n_tiny=40, seed=7)


def test_a_layout_in_gpu_memory_packs_and_checksums_as_in_host_memory(state):
    named = list(state.items())
    manifest = manifest_of(named, 1 << 20, None)
    on_gpu = BoundLayout.allocate(manifest, GPU)
    on_gpu.copy_large_from([t.to(GPU) for _, t in named])
    on_gpu.pack([t.to(GPU) for _, t in named])
    on_cpu = BoundLayout.allocate(manifest, "cpu")
    on_cpu.copy_large_from([t for _, t in named])
    on_cpu.pack([t for _, t in named])
    assert all(b.device.type == torch.device(GPU).type for b in on_gpu.item_bytes)
    assert on_gpu.checksums() == on_cpu.checksums()


@pytest.mark.parametrize(("publisher_on", "reader_on"),
                         [(GPU, GPU), ("cpu", GPU), (GPU, "cpu")])
def test_a_version_moves_bit_exact_between_gpu_and_host_memory_over_nixl(
        coordinator, state, publisher_on, reader_on):
    with Publisher(coordinator.address, "policy", transport="nixl") as pub:
        pub.publish({n: t.to(publisher_on) for n, t in state.items()})
        dest = {n: torch.empty_like(t, device=reader_on) for n, t in state.items()}
        with Replica(coordinator.address, "policy", dest, transport="nixl",
                     name="gpu-reader") as replica:
            assert replica.pull(timeout=120) == 1
            on = {t.device.type for t in replica.tensors.values()}
            assert on == {torch.device(reader_on).type}
            assert sums(replica.tensors) == sums(state)


def test_a_gpu_reader_serves_the_version_on_to_the_next_reader(coordinator, state):
    with Publisher(coordinator.address, "policy", transport="nixl") as pub:
        pub.publish({n: t.to(GPU) for n, t in state.items()})
        first = Replica(coordinator.address, "policy",
                        {n: torch.empty_like(t, device=GPU) for n, t in state.items()},
                        transport="nixl", name="first")
        with first:
            assert first.pull(timeout=120) == 1
            pub.release()
            with Replica(coordinator.address, "policy",
                         {n: torch.empty_like(t, device=GPU) for n, t in state.items()},
                         transport="nixl", name="second") as second:
                assert second.pull(timeout=120) == 1
                assert second.last_pull.sources == ["first"]
                assert sums(second.tensors) == sums(state)


def test_the_zmq_fallback_refuses_gpu_memory_by_name(coordinator, state):
    with Publisher(coordinator.address, "policy", transport="zmq") as pub, \
            pytest.raises(ValueError, match="CPU memory only"):
        pub.publish({n: t.to(GPU) for n, t in state.items()})
