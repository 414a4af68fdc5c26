"""A trainer that learns: real optimizer steps on a tiny model toward a target anyone sees.

The reward of an answer is the share of its tokens that are the target word, so any reader
of the engines' answers can score them. The trainer raises it with Adam steps on the
likelihood of answering the prompt with the target word: a supervised stand-in for a policy
gradient, since a tiny random model almost never samples the target word by itself and a
sampled policy gradient would have nothing to learn from for a long time. Each call of
`train` is one version's worth of steps; `state` is what the trainer publishes (checkpoint
names, float32, the same tensors HF loads).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from integration.tiny_model import load_state_dict

PROMPTS = (
    "the trainer will publish a new policy and the engine",
    "a rollout of the model is a sample of tokens",
    "every engine will pull the weights from a peer",
    "the coordinator has a lease on the version",
    "gradient step on a batch of prompts",
    "inference with a cache of the prefix",
    "the agent will read the buffer and write",
    "update the layer with a shard of the tensor",
)
TARGET_WORD = " reward"
ANSWER_TOKENS = 12


class Learner:
    def __init__(self, model_dir: str | Path, prompts: Sequence[str] = PROMPTS,
                 target_word: str = TARGET_WORD, answer_tokens: int = ANSWER_TOKENS,
                 lr: float = 1.5e-3, steps_per_version: int = 1, seed: int = 0):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.manual_seed(seed)
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.prompts = [self.tokenizer(p)["input_ids"] for p in prompts]
        target = self.tokenizer(target_word)["input_ids"]
        if len(target) != 1:
            raise ValueError(f"the target word {target_word!r} must be one token, not {target}")
        self.target_word, self.target_id = target_word, target[0]
        self.answer_tokens = answer_tokens
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        self.names = sorted(load_state_dict(model_dir))  # what the checkpoint holds
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=lr)
        self.steps_per_version = steps_per_version

    def reward(self, answers: Sequence[Sequence[int]]) -> float:
        """The share of the answers' tokens that are the target word (0 to 1)."""
        tokens = [t for answer in answers for t in answer]
        return sum(t == self.target_id for t in tokens) / max(len(tokens), 1)

    def train(self) -> float:
        """One version's optimizer steps; returns the last step's loss."""
        self.model.train()
        loss = torch.zeros(())
        for _ in range(self.steps_per_version):
            self.optimizer.zero_grad()
            for prompt in self.prompts:  # one batch, prompt by prompt (no padding)
                ids = torch.tensor([prompt + [self.target_id] * self.answer_tokens])
                labels = ids.clone()
                labels[0, :len(prompt)] = -100  # only the answer is learned
                loss = self.model(input_ids=ids, labels=labels).loss
                (loss / len(self.prompts)).backward()
            self.optimizer.step()
        self.model.eval()
        return float(loss.detach())

    def state(self) -> dict[str, torch.Tensor]:
        """The weights to publish, in the checkpoint's names (detached copies: the next
        `train` does not change a version already handed out)."""
        params = self.model.state_dict()
        return {name: params[name].detach().clone() for name in self.names}
