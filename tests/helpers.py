"""Test-only drafters, model surgery, and running the CLI on tiny model folders."""

from __future__ import annotations

import copy

import torch

from specdecode.drafters import Draft, Drafter, DraftModelDrafter


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
    """Proposes fixed tokens, to place EOS or rejections exactly where a test wants them."""

    def __init__(self, script: list[int]) -> None:
        self.script = script

    def begin(self, prompt_ids, sampler, target_cache) -> None:
        self.num_forwards = 0

    def propose(self, sequence, max_tokens):
        return Draft(torch.tensor(self.script[:max_tokens], dtype=torch.long))

    def rollback(self, num_valid) -> None:
        pass


class CorruptingDrafter(DraftModelDrafter):
    """A draft-model drafter that replaces every ``period``-th proposal with a wrong token."""

    def __init__(self, model, period: int = 3) -> None:
        super().__init__(model)
        self.period = period
        self._count = 0

    def propose(self, sequence, max_tokens):
        draft = super().propose(sequence, max_tokens)
        tokens = draft.tokens.clone()
        for i in range(len(tokens)):
            self._count += 1
            if self._count % self.period == 0:
                tokens[i] = (tokens[i] + 1) % 40 + 3
        return Draft(tokens, draft.probs)
