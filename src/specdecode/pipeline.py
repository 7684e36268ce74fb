"""The high-level API: load a target (and draft) once, then generate from text prompts.

Example::

    from specdecode import SpeculativeGenerator, GenerationConfig

    gen = SpeculativeGenerator.from_pretrained()          # offline Qwen2.5-Coder 1.5B + 0.5B
    result = gen.generate("Write a Python function that checks whether a number is prime.",
                          GenerationConfig(max_new_tokens=128))
    print(result.text, result.stats.acceptance_rate)

    for token_ids in gen.stream("Explain KV caches.", method="draft"):
        ...
"""

from __future__ import annotations

import logging

import torch

from specdecode.config import GenerationConfig
from specdecode.decoding import GenerationResult, GenerationStream, SpeculativeDecoder
from specdecode.drafters import DraftModelDrafter, Drafter
from specdecode.errors import InvalidArgumentError
from specdecode.models import LoadedModel, check_vocabularies, load_model

logger = logging.getLogger(__name__)

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"
METHODS = ("autoregressive", "draft")


def eos_token_ids(loaded: LoadedModel) -> set[int]:
    """End-of-sequence ids from the generation config (int or list), else the tokenizer's."""
    eos = loaded.model.generation_config.eos_token_id
    if eos is None:
        eos = loaded.tokenizer.eos_token_id
    if eos is None:
        return set()
    return {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}


class SpeculativeGenerator:
    """A target model, an optional draft model, and the decoders built on them.

    Args:
        target: The loaded target model and tokenizer.
        draft: The loaded draft model, needed for ``method="draft"``.

    Raises:
        VocabularyMismatchError: If the draft's tokenizer maps tokens differently.
    """

    def __init__(self, target: LoadedModel, draft: LoadedModel | None = None) -> None:
        self.target = target
        self.draft = draft
        if draft is not None:
            check_vocabularies(target, draft)
        self._eos = eos_token_ids(target)

    @classmethod
    def from_pretrained(
        cls,
        target: str = DEFAULT_TARGET,
        draft: str | None = DEFAULT_DRAFT,
        *,
        dtype: str | torch.dtype = "auto",
        device: str = "auto",
        cache_dir=None,
    ) -> SpeculativeGenerator:
        """Load target and draft (see ``specdecode.models.load_model`` for specs and errors)."""
        t = load_model(target, dtype=dtype, device=device, cache_dir=cache_dir)
        d = load_model(draft, dtype=t.model.dtype, device=str(t.model.device), cache_dir=cache_dir) if draft else None
        return cls(t, d)

    @property
    def tokenizer(self):
        return self.target.tokenizer

    def encode(self, prompt: str, chat: bool | None = None) -> torch.Tensor:
        """Prompt text -> (1, n) ids on the target's device.

        Args:
            prompt: Non-empty text.
            chat: Wrap it as a user turn with the tokenizer's chat template (and the
                assistant generation prompt). ``None`` uses the template when there is one.

        Raises:
            InvalidArgumentError: Empty prompt, or ``chat=True`` without a chat template.
        """
        if not isinstance(prompt, str) or not prompt.strip():
            raise InvalidArgumentError("the prompt is empty: pass some text to generate from")
        tok = self.tokenizer
        has_template = bool(getattr(tok, "chat_template", None))
        if chat and not has_template:
            raise InvalidArgumentError(f"chat=True but {self.target.name!r} has no chat template; use chat=False")
        if chat or (chat is None and has_template):
            ids = tok.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
        else:
            ids = tok(prompt, add_special_tokens=True)["input_ids"]
        return torch.tensor([list(ids)], dtype=torch.long, device=self.target.model.device)

    def make_drafter(self, method: str) -> Drafter | None:
        """The drafter for ``method`` (None for autoregressive).

        Raises:
            InvalidArgumentError: Unknown method, or "draft" without a draft model.
        """
        if method == "autoregressive":
            return None
        if method == "draft":
            if self.draft is None:
                raise InvalidArgumentError("method 'draft' needs a draft model; pass draft=...")
            return DraftModelDrafter(self.draft.model)
        raise InvalidArgumentError(f"unknown method {method!r}; allowed: {', '.join(METHODS)}")

    def decoder(self, method: str = "draft") -> SpeculativeDecoder:
        """A ``SpeculativeDecoder`` over the target with the drafter of ``method``."""
        return SpeculativeDecoder(
            self.target.model, self.make_drafter(method), eos_token_ids=self._eos, tokenizer=self.tokenizer
        )

    def stream(
        self, prompt: str, config: GenerationConfig | None = None, *, method: str = "draft", chat: bool | None = None
    ) -> GenerationStream:
        """Tokens as they are verified: iterate to get lists of ids; ``.stats`` after the end."""
        return self.decoder(method).stream(self.encode(prompt, chat), config)

    def generate(
        self, prompt: str, config: GenerationConfig | None = None, *, method: str = "draft", chat: bool | None = None
    ) -> GenerationResult:
        """Generate to the end; see ``SpeculativeDecoder.generate``."""
        return self.decoder(method).generate(self.encode(prompt, chat), config)
