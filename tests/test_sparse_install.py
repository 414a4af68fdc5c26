"""A sparse step written word by word into live parameters (`engines/sparse_install.py`),
on a model whose loaders fuse q/k/v as both engines' do: one through a loader function of
the layer (SGLang's, vLLM's first kind), one through a method of the parameter's own class
(vLLM's `weight_loader_v2`). The result is byte-equal to loading the whole version; a
weight the engine repacked is refused, so that model is installed whole."""

from __future__ import annotations

import pytest
import torch

from tensorhub.engines import sparse_install

Q, K, HIDDEN = 8, 4, 6  # rows of q and of k (and of v) in the fused qkv weight


def _default_loader(param, loaded):
    param.data.copy_(loaded)


def _offset(shard: str) -> tuple[int, int]:
    return {"q": (0, Q), "k": (Q, K), "v": (Q + K, K)}[shard]


def _qkv_loader(param, loaded, shard):  # (a layer's loader: where each shard's rows go)
    start, rows = _offset(shard)
    param.data[start:start + rows].copy_(loaded)


class OwnLoaderParameter(torch.nn.Parameter):
    """A parameter whose class loads it (vLLM's `ModelWeightParameter` kind)."""

    def __new__(cls, data):
        return torch.Tensor._make_subclass(cls, data, False)

    def __init__(self, data):
        self._shards = dict(q=_offset("q"), k=_offset("k"), v=_offset("v"))

    def load_qkv_weight(self, loaded, shard):
        start, rows = self._shards[shard]
        self.data[start:start + rows].copy_(loaded)


def _v2_loader(param, loaded, shard):
    param.load_qkv_weight(loaded, shard)


class Model(torch.nn.Module):
    def __init__(self, own_class: bool):
        super().__init__()
        fused = torch.zeros(Q + 2 * K, HIDDEN)
        self.qkv = OwnLoaderParameter(fused) if own_class else \
            torch.nn.Parameter(fused, requires_grad=False)
        self.qkv.weight_loader = _v2_loader if own_class else _qkv_loader
        self.norm = torch.nn.Parameter(torch.zeros(HIDDEN), requires_grad=False)

    def named_parameters(self, *args, **kwargs):
        yield "model.layers.0.self_attn.qkv_proj.weight", self.qkv
        yield "model.norm.weight", self.norm

    def load(self, named):  # a whole install, as `load_weights` would do it
        for name, t in named:
            if name == "model.norm.weight":
                self.norm.data.copy_(t)
            else:
                _qkv_loader(self.qkv, t, name.split(".")[-2][0])


def _version(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(f"model.layers.0.self_attn.{p}_proj.weight",
             torch.randn(Q if p == "q" else K, HIDDEN, generator=g)) for p in "qkv"] + \
        [("model.norm.weight", torch.randn(HIDDEN, generator=g))]


def _step(named, changed: int) -> list[tuple[str, torch.Tensor]]:
    out = [(n, t.clone()) for n, t in named]
    out[0][1].view(-1)[:changed] += 1.0
    out[2][1][1, 2] = -7.0
    return out


@pytest.mark.parametrize("own_class", [False, True], ids=["layer loader", "param class"])
def test_a_sparse_install_writes_the_changed_words_and_equals_a_whole_install(own_class):
    before, whole = Model(own_class), Model(own_class)
    v1 = _version(1)
    before.load(v1)
    v2 = _step(v1, changed=3)
    blocks = sparse_install.live_blocks(before, v2, _default_loader)
    assert blocks["model.layers.0.self_attn.v_proj.weight"].dst == (slice(Q + K, Q + 2 * K),
                                                                    slice(0, HIDDEN))
    plan = sparse_install.plan(before, blocks, v2, version=2, key=(1, 0))
    assert plan.changed == 4 and plan.total == (Q + 2 * K) * HIDDEN + HIDDEN
    sparse_install.install(plan)
    whole.load(v2)
    assert torch.equal(before.qkv.view(torch.int32), whole.qkv.view(torch.int32))
    assert torch.equal(before.norm, whole.norm)


def test_a_dense_change_makes_no_plan():
    model = Model(False)
    v1 = _version(1)
    model.load(v1)
    v2 = _version(2)  # every word differs
    blocks = sparse_install.live_blocks(model, v2, _default_loader)
    assert sparse_install.plan(model, blocks, v2, version=2, key=(1, 0)) is None


def test_a_weight_the_engine_repacked_means_whole_installs():
    """vLLM's CPU GEMMs keep a packed copy and leave an empty parameter in its place."""
    model = Model(False)
    model.qkv = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    with pytest.raises(sparse_install.Unsupported, match="repacked"):
        sparse_install.live_blocks(model, _version(1), _default_loader)


def test_an_embedding_whose_loader_zero_fills_the_padding_is_found_as_a_block():
    """Both engines pad the vocabulary and fill the padding rows with zeros as they load."""
    vocab, padded = 10, 12

    def embedding_loader(param, loaded):
        param.data[:vocab].copy_(loaded)
        param.data[vocab:].fill_(0)

    class Embedding(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(padded, HIDDEN), requires_grad=False)
            self.w.weight_loader = embedding_loader

        def named_parameters(self, *args, **kwargs):
            yield "model.embed_tokens.weight", self.w

    model = Embedding()
    v1 = [("model.embed_tokens.weight", torch.randn(vocab, HIDDEN))]
    embedding_loader(model.w, v1[0][1])
    blocks = sparse_install.live_blocks(model, v1, _default_loader)
    assert blocks["model.embed_tokens.weight"].dst == (slice(0, vocab), slice(0, HIDDEN))
    v2 = [(n, t.clone()) for n, t in v1]
    v2[0][1][3, 4] = 5.0
    plan = sparse_install.plan(model, blocks, v2, version=2, key=(1, 0))
    sparse_install.install(plan)
    assert plan.changed == 1 and torch.equal(model.w[:vocab], v2[0][1])
    assert not model.w[vocab:].any()


def test_a_plan_that_cannot_be_made_installs_whole_from_then_on():
    """Live weights the engine re-laid since the blocks were learnt (a transposed copy):
    no plan, and the model is installed whole for good, never refused."""
    model, live = Model(False), sparse_install.LiveBlocks()
    v1 = _version(1)
    model.load(v1)
    assert live.learn(model, v1, lambda: _default_loader)
    model.qkv.data = model.qkv.data.t().contiguous().t()
    assert live.plan(model, _step(v1, changed=3), version=2, key=(1, 0)) is None
    assert "not contiguous" in live.error
