"""The high-level API: load a target (and draft) once, then generate from text prompts.

Example::

    from specdecode import SpeculativeGenerator, GenerationConfig

    gen = SpeculativeGenerator.from_pretrained()          # offline Qwen2.5-Coder 1.5B + 0.5B
    result = gen.generate("Write a Python function that checks whether a number is prime.",
                          GenerationConfig(max_new_tokens=128))
    print(result.text, result.stats.acceptance_rate)

    for token_ids in gen.stream("Explain KV caches.", method="draft"):
        ...

    # Self-speculative methods need no draft model:
    gen = SpeculativeGenerator.from_pretrained(draft=None)
    gen.generate("...", method="layer-skip", skip_layers="attn=2,15,18;mlp=2,15,18")
    gen.generate("...", method="early-exit", exit_layer=8,
                 draft_control=DraftControl(adaptive_exit=True))
    gen.generate("...", method="prompt-lookup", prompt_lookup_max_ngram=3)

The package: ``model_pair`` (``ModelPair``: loading the target and draft, and what is derived from
the draft model's files) and ``generator`` (``SpeculativeGenerator``: the decoders built on them).
Every name is imported from here, as when the pipeline was one module, with the commands'
defaults (``specdecode.defaults``) re-exported.
"""

from __future__ import annotations

from specdecode.defaults import (  # noqa: F401 (re-exported: the commands and tools import them from here)
    DEFAULT_TARGET,
    DEFAULT_DRAFT,
    METHODS,
    BATCH_METHODS,
    DRAFT_BACKENDS,
    BATCH_VERIFY_TOKENS_CPU,
    COMMAND_METHOD,
    ADAPTIVE_BY_DEFAULT,
    MAX_MODEL_PROMPT_TOKENS,
    adaptive_exit_by_default,
    length_schedule_by_default,
    target_float32_on_cpu,
    why_no_int4_draft,
    draft_quantize_by_default,
    prompt_limit_by_default,
    auto_verify_tokens,
    eos_token_ids,
)
from specdecode.pipeline.generator import TOKEN_RECYCLING_PROBE_EVERY, SpeculativeGenerator  # noqa: F401
from specdecode.pipeline.model_pair import ModelPair  # noqa: F401
