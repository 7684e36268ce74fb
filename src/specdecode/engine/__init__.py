"""The engine: the decode loop and what it needs per token.

- ``decoder``: ``SpeculativeDecoder``, ``GenerationStream``, ``GenerationResult``
  (the four-step round: draft, verify, accept, emit);
- ``protocol``: what the engine asks of a drafter (``Drafter``, ``Draft``, ``ExitPolicy``:
  one batch-native protocol), of a runner (``BatchRunnerProtocol``, ``RoundRunnerProtocol``, ``TargetRunnerProtocol``)
  and of a draft-length policy (``DraftPolicy``); drafters live in ``specdecode.drafters``
  and reach the engine only through these;
- ``verification``: greedy verification and speculative sampling's rejection step;
- ``tree``: token trees (``TokenTree``): tree positions and ancestor masks for one verification
  forward over several candidates, and greedy tree verification (``BatchKVCache.prepare(trees=)`` and
  ``keep_path`` do the cache side); ``tree_sampling``: multi-candidate speculative sampling of many rows' trees
  on the device;
- ``sampling``: the ``Sampler`` shared by target and drafters (temperature, top-k, top-p, min-p);
- ``processors``: penalties, ``logit_bias`` and logprobs, applied to a verification block row by
  row as autoregressive decoding would (``LogitsProcessing``, ``TokenLogprob``);
- ``kv_cache``: ``DynamicCache`` helpers (prompt caches) and context lengths;
- ``fast_path``: the fast path's settings: an engine's (``FastPath``, ``engine_fast_path``, ``check_graphs``,
  ``check_dynamic_shapes``) and a model's (``ModelRunner``);
- ``batch_rows``: a batched request's state (``BatchRow``) and ``BatchEvent``;
- ``batched``: ``BatchedSpeculativeDecoder``, many rows at once with continuous batching,
  on ``batch_cache.BatchKVCache`` (per-row positions and masks); ``batch_runner``: its fast path (``BatchRunner``, forwards
  compiled at (rows, width) buckets, CUDA graphs on CUDA, each giving its argmax and finiteness; a greedy
  round's draft steps fed back in the runner, one graph each or, fused, one in all);
- ``draft_exit``: an adaptive draft exit read with the round's one sync (``DraftControl.exit_mode``
  "masked" and "previous-round");
- ``compat``: ``torch.compile`` options feature-detected for the torch installed (2.11 and later);
- ``compile_cache``: compiled graphs kept in specdecode's cache folder, reused by later processes;
- ``stopping``: EOS, budget and stop strings (``emit``);
- ``stats``: ``SpecDecodingStats``, one class for a generation and for a batched engine's
  lifetime, with one definition of τ (``BatchStats`` is the same class, by its old name).

The engine imports nothing above it (no drafter, pipeline, bench or search).
"""

from specdecode.engine.batch_cache import BatchKVCache
from specdecode.engine.batched import BatchedSpeculativeDecoder, BatchEvent
from specdecode.engine.decoder import GenerationResult, GenerationStream, SpeculativeDecoder
from specdecode.engine.processors import LogitsProcessing, TokenLogprob
from specdecode.engine.protocol import Draft, Drafter, DraftPolicy, ExitPolicy, RoundController
from specdecode.engine.sampling import Sampler, check_finite
from specdecode.engine.stats import BatchStats, SpecDecodingStats
from specdecode.engine.verification import VerificationResult, greedy_verify, rejection_sample

__all__ = [
    "BatchEvent",
    "BatchKVCache",
    "BatchStats",
    "BatchedSpeculativeDecoder",
    "Draft",
    "DraftPolicy",
    "Drafter",
    "ExitPolicy",
    "GenerationResult",
    "GenerationStream",
    "LogitsProcessing",
    "RoundController",
    "Sampler",
    "SpecDecodingStats",
    "SpeculativeDecoder",
    "TokenLogprob",
    "VerificationResult",
    "check_finite",
    "greedy_verify",
    "rejection_sample",
]
