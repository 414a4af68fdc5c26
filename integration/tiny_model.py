"""Tiny random LLMs built on the spot, and the HF transformers oracle that checks engines.

No model hub is reachable from the test machines, so integration tests build their own
model directory (config + safetensors + tokenizer) in a few seconds. Runs in the CORE venv
(torch CPU, transformers, tokenizers, safetensors) — never import it from engine venvs.

Why the odd choices (see shared ENGINES.md):
- ``initializer_range=0.2``: with HF's default 0.02 a tiny random model just repeats the
  last prompt token, so a test could not tell old weights from new ones.
- float32 everywhere: in bfloat16 HF and the engines disagree on near-ties; in float32
  their greedy tokens are identical, so the oracle can demand exact equality.
- ``hf_greedy`` asserts a top-1/top-2 logit gap >= 1e-3 at every step: if the oracle
  itself is on a near-tie, a mismatch would say nothing about the weight transfer.
- Greedy decoding never stops at EOS (random weights emit it at random); engines must be
  asked with ``ignore_eos`` so both sides produce exactly ``max_new_tokens`` tokens.

Typical use::

    d = build_tiny_model(tmp / "v1", arch="qwen2", tie_word_embeddings=False)
    sd1 = load_state_dict(d)
    sd2 = perturb_state_dict(sd1, seed=1)
    prompts = make_prompts(8, 12)
    want_v1 = hf_greedy(d, prompts, 16)
    want_v2 = hf_greedy(d, prompts, 16, state_dict=sd2)
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

# Special tokens first, so their ids are fixed: 0 pad, 1 bos, 2 eos.
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2

_TEXT = (
    "weight version trainer engine publish pull tensor shard layer rank step reward policy "
    "gradient token prompt sample batch update model cache prefix memory transfer agent "
    "read write buffer register metadata coordinator lease fence commit rollout inference "
    "the a of to and in is it that for on with as was by at be this from or have not are"
)
_WORDS = tuple(_TEXT.split())


def _corpus(seed: int = 0, lines: int = 3000) -> list[str]:
    """A deterministic pseudo-text corpus: enough variety for a ~1k-token BPE vocabulary.

    Mixes words, numbers, punctuation and code-like fragments so byte-level BPE learns
    merges of many kinds; generated (not read from disk) so the tokenizer is reproducible.
    """
    rng = random.Random(seed)
    out = []
    for i in range(lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
        if i % 3 == 0:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 99999)))
        if i % 5 == 0:
            words.append(f"{rng.choice(_WORDS)}_{rng.choice(_WORDS)}({rng.randint(0, 9)})")
        line = " ".join(words)
        out.append(line[0].upper() + line[1:] + rng.choice(".!?;:,"))
    return out


def build_tokenizer(out_dir: str | Path, vocab: int = 1024, seed: int = 0):
    """Train a byte-level BPE tokenizer on the generated corpus and save it to ``out_dir``.

    Wrapped in ``PreTrainedTokenizerFast`` with bos/eos/pad set, because engines (vLLM,
    SGLang) load tokenizers through ``AutoTokenizer`` and want those special tokens.
    Returns the wrapped tokenizer; its ``len()`` is the model's vocabulary size.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=SPECIAL_TOKENS[PAD_ID],
        bos_token=SPECIAL_TOKENS[BOS_ID],
        eos_token=SPECIAL_TOKENS[EOS_ID],
        model_max_length=2048,
    )
    assert fast.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == [PAD_ID, BOS_ID, EOS_ID]
    fast.save_pretrained(str(out_dir))
    return fast


def build_tiny_model(
    out_dir: str | Path,
    arch: str = "qwen2",
    tie_word_embeddings: bool = False,
    hidden: int = 64,
    layers: int = 2,
    vocab: int = 1024,
    heads: int = 2,
    kv_heads: int = 1,
    intermediate: int | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    experts: int = 4,
) -> Path:
    """Build a random ``arch`` ("qwen2", "llama", or "qwen3_moe": ``experts`` routed experts
    of ``intermediate`` each, two per token) model + tokenizer in ``out_dir``.

    Defaults give head_dim 32 and grouped-query attention (kv_heads < heads), so engines'
    fused qkv / gate_up layouts are exercised. ``vocab`` is the BPE target; the config's
    ``vocab_size`` is set to the trained tokenizer's real size so every id the model can
    emit decodes. Weights are saved as safetensors in ``dtype`` (keep float32 for oracle
    tests). Returns ``out_dir`` as a Path.
    """
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3MoeConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out, vocab=vocab, seed=seed)
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=intermediate or 2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=2048,
        initializer_range=0.2,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        torch_dtype=dtype,
    )
    if arch == "qwen2":
        config = Qwen2Config(**common)
    elif arch == "llama":
        config = LlamaConfig(**common)
    elif arch == "qwen3_moe":
        config = Qwen3MoeConfig(**common, moe_intermediate_size=common["intermediate_size"],
                                num_experts=experts, num_experts_per_tok=2,
                                decoder_sparse_step=1, norm_topk_prob=True)
    else:
        raise ValueError(f"arch must be 'qwen2', 'llama' or 'qwen3_moe', not {arch!r}")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    # Qwen2 has q/k/v biases that HF initialises to zero; randomise them too, so a
    # transfer that forgets biases shows up in the tokens.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.2)
    model.save_pretrained(str(out), safe_serialization=True)
    return out


def load_state_dict(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """The HF-named tensors of a model directory, as a trainer would publish them.

    Read from the safetensors files, so a tied model has ``model.embed_tokens.weight`` and
    no ``lm_head.weight`` (the same thing HF saves; engines skip the tied lm_head).
    """
    from safetensors.torch import load_file

    sd: dict[str, torch.Tensor] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        sd.update(load_file(str(f)))
    return sd


def perturb_state_dict(
    sd: Mapping[str, torch.Tensor], seed: int = 1, scale: float = 0.1
) -> dict[str, torch.Tensor]:
    """Return "the next version": every tensor plus ``scale * std(tensor)`` Gaussian noise.

    Noise is relative to each tensor's spread, so norms and biases move as much as big
    matrices, and greedy outputs change noticeably (tests should still assert that they
    did). Tensors that share storage (tied embeddings in ``model.state_dict()``) stay
    shared. Deterministic in ``seed``; the input is not modified.
    """
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    done: dict[int, torch.Tensor] = {}
    for name in sorted(sd):
        t = sd[name]
        if t.data_ptr() in done:
            out[name] = done[t.data_ptr()]
            continue
        std = t.float().std() if t.numel() > 1 else t.float().abs().mean()
        noise = torch.randn(t.shape, generator=gen, dtype=torch.float32) * (scale * std)
        out[name] = done[t.data_ptr()] = (t.float() + noise).to(t.dtype).contiguous()
    return out


def save_version(
    model_dir: str | Path, sd: Mapping[str, torch.Tensor], out_dir: str | Path
) -> Path:
    """Write a full model directory for ``sd`` (config + tokenizer copied from ``model_dir``).

    Useful as an engine's disk-loaded reference for a later version.
    """
    import shutil

    from safetensors.torch import save_file

    src, out = Path(model_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy2(f, out / f.name)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return out


def make_prompts(n: int = 8, length: int = 12, vocab: int = 1024, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of ``length`` random non-special token ids (< ``vocab``)."""
    rng = random.Random(seed)
    return [[rng.randrange(len(SPECIAL_TOKENS), vocab) for _ in range(length)] for _ in range(n)]


@torch.no_grad()
def _loaded_as_a_checkpoint(config, state_dict: Mapping[str, torch.Tensor]) -> torch.nn.Module:
    """An HF model of `config` loaded from `state_dict` as from a checkpoint on disk: for
    checkpoint names the model converts as it loads (transformers fuses a mixture of
    experts' per-expert weights)."""
    import tempfile

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as folder:
        config.save_pretrained(folder)
        save_file({k: v.float().contiguous() for k, v in state_dict.items()},
                  f"{folder}/model.safetensors")
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return model.float().eval()


def hf_greedy(
    model: str | Path | torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int = 16,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    min_gap: float = 1e-3,
    skip_ties: bool = False,
) -> list[list[int]]:
    """Greedy completions (new token ids only) from HF transformers in float32: the oracle.

    ``model`` is a model directory or an already loaded HF model; ``state_dict`` (HF names)
    replaces its weights first, e.g. a perturbed version. One prompt at a time with HF's
    KV cache and no padding, so no batching effects.
    Never stops at EOS. Raises AssertionError if the top-1/top-2 logit gap at any step
    is below ``min_gap`` (the comparison would then be meaningless); with ``skip_ties``
    that prompt's entry is None instead (see ``pick_stable_prompts``).
    """
    from transformers import AutoModelForCausalLM

    if isinstance(model, (str, Path)):
        model = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
    model = model.float().eval()
    if state_dict is not None and set(state_dict) - set(model.state_dict()):
        model = _loaded_as_a_checkpoint(model.config, state_dict)
    elif state_dict is not None:
        sd = {k: v.float() for k, v in state_dict.items()}
        missing, unexpected = model.load_state_dict(sd, strict=False)
        tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
        assert not unexpected and set(missing) <= tied, (missing, unexpected)
        if tied:
            model.tie_weights()
    results = []
    for p, prompt in enumerate(prompts):
        ids = torch.tensor([list(prompt)], dtype=torch.long)
        new: list[int] = []
        past = None
        for step in range(max_new_tokens):
            out = model(input_ids=ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits = out.logits[0, -1].float()
            top2 = torch.topk(logits, 2)
            gap = (top2.values[0] - top2.values[1]).item()
            if gap < min_gap:
                assert skip_ties, f"near-tie: prompt {p} step {step} gap {gap:.2e}"
                new = None
                break
            tok = int(top2.indices[0])
            new.append(tok)
            ids = torch.tensor([[tok]])
        results.append(new)
    return results


def pick_stable_prompts(
    model_dir: str | Path,
    n: int,
    length: int,
    max_new_tokens: int,
    state_dicts: Sequence[Mapping[str, torch.Tensor] | None] = (None,),
    seed: int = 0,
) -> tuple[list[list[int]], list[list[list[int]]]]:
    """``n`` random prompts whose greedy decode has no near-tie under every version.

    A 1024-way random softmax has a top-1/top-2 gap below 1e-3 at a few tenths of a percent
    of steps, so 8 prompts x 32 tokens hit one often. Rather than hunting seeds, draw
    candidates and keep the tie-free ones. ``state_dicts`` lists the versions to check
    (None = the weights on disk). Returns ``(prompts, expected)`` with
    ``expected[v][i]`` the oracle tokens of prompt i under version v.
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    vocab = model.config.vocab_size
    prompts: list[list[int]] = []
    expected: list[list[list[int]]] = [[] for _ in state_dicts]
    for attempt in range(20):
        cands = make_prompts(2 * n, length, vocab, seed=seed * 1000 + attempt)
        outs = []
        for sd in state_dicts:
            outs.append(hf_greedy(model, cands, max_new_tokens,
                                  state_dict=base if sd is None else sd, skip_ties=True))
        for i, c in enumerate(cands):
            if len(prompts) < n and all(o[i] is not None for o in outs):
                prompts.append(c)
                for v, o in enumerate(outs):
                    expected[v].append(o[i])
        if len(prompts) == n:
            return prompts, expected
    raise RuntimeError("could not find tie-free prompts; use a bigger model or fewer tokens")


if __name__ == "__main__":  # quick manual check: python integration/tiny_model.py /tmp/tm
    import sys

    d = build_tiny_model(sys.argv[1] if len(sys.argv) > 1 else "/tmp/tiny_model")
    prompts = make_prompts(4, 8)
    a = hf_greedy(d, prompts, 8)
    b = hf_greedy(d, prompts, 8, state_dict=perturb_state_dict(load_state_dict(d)))
    print(d, a, b, "differ:", a != b, sep="\n")


class Versions:
    """A tiny model on disk (version 1) and perturbed next versions, all float32."""

    def __init__(self, root: Path, arch: str = "qwen2", tied: bool = False, count: int = 4,
                 **shape: int):
        """`shape`: `build_tiny_model`'s sizes (heads, kv_heads, ...), where the defaults
        do not suit (tensor parallelism needs heads divisible by the TP size)."""
        self.dir = build_tiny_model(root / "model", arch=arch, tie_word_embeddings=tied,
                                    **shape)
        self.states = [load_state_dict(self.dir)]
        for k in range(1, count):
            self.states.append(perturb_state_dict(self.states[-1], seed=k, scale=0.3))

    def state(self, version: int) -> dict:
        return self.states[version - 1]

    def weightless_dir(self, root: Path) -> Path:
        """The model directory without its weights: config and tokenizer only. An engine
        started from it (`--load-format dummy`) can only serve what it pulls from peers."""
        import shutil

        out = root / "weightless"
        out.mkdir(parents=True, exist_ok=True)
        for f in self.dir.iterdir():
            if f.is_file() and not f.name.endswith((".safetensors", ".safetensors.index.json")):
                shutil.copy2(f, out / f.name)
        return out
