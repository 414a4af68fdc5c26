"""Bytes per node: what an engine spanning nodes pulls of a version in tiles, for real
models' shapes, against one copy per node and a copy per rank.

An engine of TP = 8N ranks on N nodes of 8 (vLLM and SGLang place an engine's ranks on
its nodes in consecutive blocks). Each version is laid out by `tensorhub.tiles.tile` in TP
tiles (the real code, on tensors of the models' shapes on the meta device: no memory), and
each node pulls the parts `tensorhub.tiles.node_share` gives its ranks: its tiles of the
q/k/v/gate/up projections, the embeddings and the LM head (rows) and of the o/down
projections (columns), and the part every rank loads whole (norms, biases). Where TP exceeds
the K/V heads, a group of TP / heads ranks loads one head's K/V rows, and a node whose ranks
take part of a group pulls the group's tiles: with 8 K/V heads and 8 ranks a node, from 16
nodes on. The figures are computed, not timed: bytes of the parts each node pulls, summed
over the engine's nodes, / the model's bytes. The engine tests across two emulated hosts
(`integration/test_*_nodes.py`) check the same sums against the bytes the coordinator saw
pulled.

A pipeline-parallel engine of PP = N stages on N nodes pulls a version in layer blocks
(`tensorhub.stages.split`, B blocks) as each stage's parts (`tensorhub.stages.stage_share`,
given the parameter names of the layers vLLM places on that stage:
`core.layer_blocks.pp_layers`): its layers' blocks (a block a stage edge cuts goes to
both), the embeddings on the first stage and the head on the last; by default the blocks
end where the engines' stages do at PP = 2, 4 and 8, beside 8 equal blocks. With TP = 8
ranks a stage, the TP ranks of each stage on its node share one copy
(`engines.shared_copy.copy_holders`), against a copy per rank.

An expert-parallel engine of a mixture of experts (TP = EP = 8N on N nodes) pulls a version
in tiles with its experts placed (`TiledPublisher(experts="placed")`) as its ranks'
attention tiles and the tiles of their experts (vLLM's linear placement), against every
part when the experts are split for tensor-parallel engines.

Run: python -m bench.node_shares
"""

from __future__ import annotations

import argparse

import torch

from bench.results import Report
from tensorhub.core.data_types import Manifest
from tensorhub.core.layer_blocks import pp_layers
from tensorhub.engines.shared_copy import copy_holders
from tensorhub.stages import split, stage_share
from tensorhub.tiles import NodeExperts, kv_split, node_share, tile

# config.json values: hidden, intermediate, heads, KV heads, head dim, vocab, layers,
# q/k/v biases, tied embeddings.
MODELS = {
    "Llama-3.1-8B": (4096, 14336, 32, 8, 128, 128256, 32, False, False),
    "Llama-3.1-70B": (8192, 28672, 64, 8, 128, 128256, 80, False, False),
    "Qwen2-72B": (8192, 29568, 64, 8, 128, 152064, 80, True, False),
    "Llama-3.1-405B": (16384, 53248, 128, 8, 128, 128256, 126, False, False),
}
# Mixtures of experts (config.json): hidden, expert intermediate, heads, KV heads, head
# dim, vocab, layers, routed experts.
MOE_MODELS = {
    "Qwen3-30B-A3B": (2048, 768, 32, 4, 128, 151936, 48, 128),
    "Qwen3-235B-A22B": (4096, 1536, 64, 4, 128, 151936, 94, 128),
}
RANKS_PER_NODE = 8


def _meta(*shape: int) -> torch.Tensor:
    return torch.empty(*shape, dtype=torch.bfloat16, device="meta")


def _attention(p: str, hidden: int, heads: int, kv: int,
               head_dim: int) -> list[tuple[str, torch.Tensor]]:
    """One decoder layer's attention projections."""
    return [(f"{p}.self_attn.q_proj.weight", _meta(heads * head_dim, hidden)),
            (f"{p}.self_attn.k_proj.weight", _meta(kv * head_dim, hidden)),
            (f"{p}.self_attn.v_proj.weight", _meta(kv * head_dim, hidden)),
            (f"{p}.self_attn.o_proj.weight", _meta(hidden, heads * head_dim))]


def _norms(p: str, hidden: int) -> list[tuple[str, torch.Tensor]]:
    return [(f"{p}.input_layernorm.weight", _meta(hidden)),
            (f"{p}.post_attention_layernorm.weight", _meta(hidden))]


def meta_state(hidden: int, inter: int, heads: int, kv: int, head_dim: int, vocab: int,
               layers: int, bias: bool, tied: bool) -> list[tuple[str, torch.Tensor]]:
    """A Llama/Qwen2 state dict's names and shapes (bf16, on the meta device)."""
    named = [("model.embed_tokens.weight", _meta(vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}"
        named += _attention(p, hidden, heads, kv, head_dim)
        named += [(f"{p}.mlp.gate_proj.weight", _meta(inter, hidden)),
                  (f"{p}.mlp.up_proj.weight", _meta(inter, hidden)),
                  (f"{p}.mlp.down_proj.weight", _meta(hidden, inter))]
        named += _norms(p, hidden)
        if bias:
            named += [(f"{p}.self_attn.{x}_proj.bias", _meta(n)) for x, n in
                      (("q", heads * head_dim), ("k", kv * head_dim), ("v", kv * head_dim))]
    named.append(("model.norm.weight", _meta(hidden)))
    if not tied:
        named.append(("lm_head.weight", _meta(vocab, hidden)))
    return named


def meta_moe_state(hidden: int, inter: int, heads: int, kv: int, head_dim: int, vocab: int,
                   layers: int, experts: int) -> list[tuple[str, torch.Tensor]]:
    """A Qwen3-MoE state dict's names and shapes (bf16, on the meta device)."""
    named = [("model.embed_tokens.weight", _meta(vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}"
        named += _attention(p, hidden, heads, kv, head_dim)
        named += [(f"{p}.self_attn.q_norm.weight", _meta(head_dim)),
                  (f"{p}.self_attn.k_norm.weight", _meta(head_dim)),
                  (f"{p}.mlp.gate.weight", _meta(experts, hidden))]
        named += _norms(p, hidden)
        for e in range(experts):
            named += [(f"{p}.mlp.experts.{e}.gate_proj.weight", _meta(inter, hidden)),
                      (f"{p}.mlp.experts.{e}.up_proj.weight", _meta(inter, hidden)),
                      (f"{p}.mlp.experts.{e}.down_proj.weight", _meta(hidden, inter))]
    named += [("model.norm.weight", _meta(hidden)), ("lm_head.weight", _meta(vocab, hidden))]
    return named


def expert_parallel_rows(report: Report, nodes_list: list[int]) -> None:
    """An expert-parallel engine (TP = EP = 8N ranks on N nodes, vLLM's linear placement:
    rank r runs experts [rE/TP, (r+1)E/TP)) pulling a version in TP tiles with its experts
    placed, against the same engine pulling one with its experts split (every part)."""
    for model, config in MOE_MODELS.items():
        named = meta_moe_state(*config)
        total, experts = nbytes(named), config[7]
        for nodes in nodes_list:
            tp = RANKS_PER_NODE * nodes
            if config[2] % tp or experts % tp:
                continue
            per_node = node_bytes(named, tp, nodes, config[3], experts=experts)
            label = (f"{model} ({total / 2**30:.0f} GiB bf16), TP=EP={tp} on {nodes} nodes, "
                     f"experts placed")
            report.add(f"{label}: bytes an engine pulls / the model's", sum(per_node) / total,
                       "x", "experts split (each node pulls every part)", nodes,
                       higher_is_better=False)
            if tp > config[3] * RANKS_PER_NODE:
                by_head = node_bytes(named, tp, nodes, config[3], by_head=True,
                                     experts=experts)
                report.add(f"{label}, its K/V by head: bytes an engine pulls / the model's",
                           sum(by_head) / total, "x", "K/V in the tiles",
                           sum(per_node) / total, higher_is_better=False)


def stage_parameters(named: list[tuple[str, torch.Tensor]], layers: range, first: bool,
                     last: bool, tied: bool) -> list[str]:
    """The names of what a stage runs: its layers, the embeddings on the first (and on the
    last where the head is tied to them), the final norm and LM head on the last."""
    keep = []
    for name, _ in named:
        parts = name.split(".")
        if parts[1] == "layers":
            if int(parts[2]) in layers:
                keep.append(name)
        elif "embed_tokens" in name:
            if first or (last and tied):
                keep.append(name)
        elif last:
            keep.append(name)
    return keep


def node_bytes(named: list[tuple[str, torch.Tensor]], tp: int, nodes: int, kv_heads: int,
               by_head: bool = False, experts: int | None = None) -> list[int]:
    """The bytes each node of a TP=`tp` engine pulls of a version of `named` in TP tiles
    (`by_head`: its K/V split by head in parts of their own; `experts`: a mixture of
    experts' count, placed, each rank running its 1/tp of them)."""
    heads = kv_heads if by_head else None
    parts = [nbytes(part.tensors) for part in tile(named, tp, experts=(
        "placed" if experts else "split"), kv_heads=heads)]
    manifest = Manifest.model_construct(tensors=[], compact_threshold=0, tiles=tp,
                                        blocks=None, experts="placed" if experts else None,
                                        kv_heads=kv_split(tp, heads))
    per_node = []
    for n in range(nodes):
        ranks = range(n * RANKS_PER_NODE, (n + 1) * RANKS_PER_NODE)
        runs = None
        if experts:
            runs = NodeExperts(frozenset(e for r in ranks for e in range(
                r * experts // tp, (r + 1) * experts // tp)), experts)
        share = node_share(ranks, tp, kv_heads, runs)
        per_node.append(sum(parts[k] for k in share(len(parts), manifest)))
    return per_node


def nbytes(named: list[tuple[str, torch.Tensor]]) -> int:
    return sum(x.numel() * x.element_size() for _, x in named)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", default="2,4,8,16", help="nodes per engine, comma-separated")
    args = p.parse_args(argv)
    report = Report("node_shares")
    for model, config in MODELS.items():
        named = meta_state(*config)
        total = nbytes(named)
        for nodes in (int(n) for n in args.nodes.split(",")):
            tp = RANKS_PER_NODE * nodes
            if config[2] % tp:  # (engines refuse a TP size that does not divide the heads)
                continue
            kv_heads = config[3]
            per_node = node_bytes(named, tp, nodes, kv_heads)
            label = f"{model} ({total / 2**30:.0f} GiB bf16), TP={tp} on {nodes} nodes"
            report.add(f"{label}: bytes an engine pulls / the model's", sum(per_node) / total,
                       "x", "one copy per node", nodes, higher_is_better=False)
            report.add(f"{label}: bytes a node pulls / its 1/{nodes} of the model",
                       max(per_node) / (total / nodes), "x", "a copy per rank", tp,
                       higher_is_better=False)
            if tp > kv_heads * RANKS_PER_NODE:  # (a K/V group spans nodes)
                by_head = node_bytes(named, tp, nodes, kv_heads, by_head=True)
                report.add(f"{label}, its K/V by head: bytes an engine pulls / the model's",
                           sum(by_head) / total, "x", "K/V in the tiles",
                           sum(per_node) / total, higher_is_better=False)
        for blocks in (None, 8):
            parts, edges = split(named, blocks)
            sizes = [nbytes(part) for part in parts]
            manifest = Manifest(tensors=[], compact_threshold=0, blocks=edges)
            for stages in (2, 4, 8):
                per_stage = [sum(sizes[k] for k in stage_share(stage_parameters(
                    named, pp_layers(edges[-1], s, stages), s == 0, s == stages - 1,
                    config[8]))(len(parts), manifest)) for s in range(stages)]
                how = f"{len(edges) - 1} blocks at the stages' edges" if blocks is None \
                    else f"{blocks} equal blocks"
                label = f"{model}, PP={stages} on {stages} nodes, {how}"
                report.add(f"{label}: bytes an engine pulls / the model's",
                           sum(per_stage) / total, "x", "a whole copy per stage", stages,
                           higher_is_better=False)
                if blocks is None:  # the same stages, each of TP=8 ranks on its node
                    ranks = stages * RANKS_PER_NODE
                    held = [per_stage[r // RANKS_PER_NODE]
                            for r in copy_holders(ranks, nodes=stages, stages=stages)]
                    report.add(f"{model}, PP={stages} x TP={RANKS_PER_NODE} on {stages} "
                               f"nodes, {how}: bytes an engine pulls and holds / the model's",
                               sum(held) / total, "x", "a copy per rank (its stage's share)",
                               RANKS_PER_NODE * sum(per_stage) / total,
                               higher_is_better=False)
    expert_parallel_rows(report, [int(n) for n in args.nodes.split(",")])
    report.write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
