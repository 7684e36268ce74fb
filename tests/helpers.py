"""Test-only drafters, model surgery, and running the CLI on tiny model folders."""

from __future__ import annotations

import copy

import torch
from transformers.generation.logits_process import (LogitsProcessorList, MinPLogitsWarper, TemperatureLogitsWarper,
                                                    TopKLogitsWarper, TopPLogitsWarper)

from specdecode.drafters import Draft, Drafter, DraftModelDrafter
from specdecode.engine.protocol import RoundController


def transformers_probs(settings: dict, logits: torch.Tensor) -> torch.Tensor:
    """transformers' warpers over all V logits (temperature, top-k, ``TopPLogitsWarper``, min-p: ``Sampler``'s
    order) from ``settings`` (``GenerationConfig`` fields), then a softmax: (m, V) float32. The reference that
    ``Sampler.nucleus_probs`` is checked against."""
    warpers = LogitsProcessorList([TemperatureLogitsWarper(settings.get("temperature", 1.0))])
    if settings.get("top_k"):
        warpers.append(TopKLogitsWarper(settings["top_k"]))
    if settings.get("top_p", 1.0) < 1.0:
        warpers.append(TopPLogitsWarper(settings["top_p"]))
    if settings.get("min_p"):
        warpers.append(MinPLogitsWarper(settings["min_p"]))
    return torch.softmax(warpers(torch.empty(0, dtype=torch.long), logits.float()), dim=-1)


def save_tiny_folders(root, tokenizer, target, draft):
    """Save ``target`` and ``draft`` (with ``tokenizer``) as model folders root/target and root/draft."""
    for name, model in (("target", target), ("draft", draft)):
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    return root / "target", root / "draft"


def run_generate(capsys, *args) -> tuple[int, str, str]:
    """``specdecode generate ARGS``: (exit status, stdout, stderr)."""
    from specdecode.cli import main

    code = main(["generate", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def perturbed_copy(model: torch.nn.Module, noise: float, seed: int = 0) -> torch.nn.Module:
    """A draft that agrees with ``model`` often but not always (acceptance strictly between 0 and 1)."""
    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * noise * p.abs().mean())
    return draft


class ScriptedDrafter(Drafter):
    """Proposes fixed tokens to every row, to place EOS or rejections exactly where a test wants them."""

    def __init__(self, script: list[int]) -> None:
        self.script = script

    def bind(self, target_cache) -> None:
        self.num_forwards = 0

    def join(self, slot, prompt_ids, sampler) -> None:
        pass

    def propose(self, sequences, max_tokens, exits=None, exit_rule="row"):
        rows = [self.script[:cap] for cap in max_tokens]
        width = max(1, max(len(r) for r in rows))
        ids = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.long)
        return Draft(ids, [len(r) for r in rows])

    def rollback(self, num_valid) -> None:
        pass

    def move(self, src, dst, num_valid) -> None:
        pass


class CorruptingDrafter(DraftModelDrafter):
    """A draft-model drafter that replaces every ``period``-th proposed token with a wrong one."""

    def __init__(self, model, period: int = 3) -> None:
        super().__init__(model)
        self.period = period
        self._count = 0

    def propose(self, sequences, max_tokens, exits=None, exit_rule="row"):
        draft = super().propose(sequences, max_tokens, exits, exit_rule)
        tokens = draft.tokens.clone()
        for b, k in enumerate(draft.num_tokens):
            for i in range(k):
                self._count += 1
                if self._count % self.period == 0:
                    tokens[b, i] = (tokens[b, i] + 1) % 40 + 3
        return Draft(tokens, draft.num_tokens, draft.probs, draft.finite, draft.who)


class Recorder(Drafter):
    """Wraps a drafter at B = 1; records (sequence length, tokens proposed) and the cap of every
    ``propose`` (row 0)."""

    supports_exit_policy = True

    def __init__(self, inner: Drafter) -> None:
        self.inner, self.calls, self.caps = inner, [], []
        self.who = inner.who

    @property
    def num_forwards(self) -> int:
        return self.inner.num_forwards

    def bind(self, target_cache) -> None:
        self.inner.bind(target_cache)

    def warm_up(self, max_rows, max_block) -> None:
        self.inner.warm_up(max_rows, max_block)

    def join(self, slot, prompt_ids, sampler) -> None:
        self.inner.join(slot, prompt_ids, sampler)

    def propose(self, sequences, max_tokens, exits=None, exit_rule="row"):
        draft = self.inner.propose(sequences, max_tokens, exits, exit_rule)
        self.calls.append((len(sequences[0]), draft.num_tokens[0]))
        self.caps.append(max_tokens[0])
        return draft

    def rollback(self, num_valid) -> None:
        self.inner.rollback(num_valid)

    def move(self, src, dst, num_valid) -> None:
        self.inner.move(src, dst, num_valid)


class FixedCapController(RoundController):
    """A round controller that gives every round 4 tokens and logs ``("record", num_drafted)`` per verified block."""

    exit = None
    gate = None

    def __init__(self, log) -> None:
        self.max_tokens, self.log = 4, log

    @property
    def gated(self) -> bool:
        return False

    def round_cap(self) -> int:
        return 4

    def record(self, cap, num_drafted, num_accepted) -> None:
        self.log.append(("record", num_drafted))
