"""Prompt-lookup drafting: copy what followed an earlier occurrence of the last n-gram.

Prompt lookup decoding (Saxena 2023, "Prompt Lookup Decoding",
github.com/apoorvumang/prompt-lookup-decoding; transformers'
``PromptLookupCandidateGenerator``) needs no model: when the sequence's last n
tokens occurred before, in the prompt or in the text generated so far, the tokens
that followed that occurrence are proposed. It pays off when the output quotes
its input (code edits, summaries, retrieval answers).

Differences from transformers: the most recent earlier occurrence wins (transformers
takes the leftmost), as the nearest context is the likeliest to repeat; n is tried
from ``max_ngram`` down to ``min_ngram``.

A datastore of a corpus (``drafters.datastore``, REST's retrieval; ``PromptLookupDrafter``'s
``datastore``) drafts where the sequence itself has no match of two tokens or more. Each block says
where it came from (``Draft.match_sources``), so a cost model prices each source's blocks by their
own acceptance (``engine.speculation_cost``). A history of earlier outputs (SuffixDecoding, Oliaro
et al. 2024) was built and measured beside it and left out: on 10 HumanEval prompts with a
llama.cpp target it changed nothing (15.82 against 15.81 tok/s,
docs/benchmarks/2026-11-27-datastore.md), and it would draft one client's replies for another.
"""

from __future__ import annotations

import numpy as np
import torch

from specdecode.drafters.datastore import NgramDatastore
from specdecode.engine.batch_cache import to_device
from specdecode.engine.protocol import Draft, Drafter
from specdecode.engine.sampling import Sampler
from specdecode.engine.tree import TokenTree
from specdecode.errors import InvalidArgumentError


def find_continuation(sequence, max_tokens: int, max_ngram: int, min_ngram: int):
    """The tokens that followed the most recent earlier occurrence of the sequence's last n-gram.

    Args:
        sequence: (L,) long token ids: a tensor, or an int64 numpy array (the decoder's host
            copy, matched with numpy: no torch op, so no host sync whatever the device).
        max_tokens: Most tokens to return (>= 1).
        max_ngram, min_ngram: n is tried from ``max_ngram`` down to ``min_ngram``
            (n < L); the first n with a match decides. ``min_ngram`` >= 1.

    Returns:
        (k,) long, 0 <= k <= max_tokens: ``sequence[j + n : j + n + k]`` for the largest
        start j < L - n whose n tokens equal the last n, or empty when none matches; of the
        input's kind (a new tensor or array, never a view of the input).

    Raises:
        InvalidArgumentError: ``min_ngram`` < 1 (the drafters check both sizes once: ``check_ngram_sizes``).
    """
    if isinstance(sequence, np.ndarray):
        return match_continuation(sequence, max_tokens, max_ngram, min_ngram)[0]
    _check_ngram_size("min_ngram", min_ngram)
    length = sequence.shape[0]
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        # Windows starting at 0 .. L-n-1: each has at least one token after it,
        # and the sequence's own last n-gram (start L-n) is excluded.
        windows = sequence[: length - 1].unfold(0, n, 1)
        hits = (windows == sequence[length - n :]).all(dim=1).nonzero()
        if hits.numel():
            start = int(hits[-1, 0]) + n
            return sequence[start : start + max_tokens].clone()  # not a view of the caller's buffer
    return sequence[:0]


def match_continuation(sequence: np.ndarray, max_tokens: int, max_ngram: int, min_ngram: int) -> tuple[np.ndarray, int]:
    """``find_continuation`` on an (L,) int64 numpy array, and the n whose match decided (0: none).

    Returns:
        ``(continuation, n)``: the (k,) int64 continuation (a new array), and the length n of the
        matched n-gram (``Draft.ngram_sizes``: a longer match is accepted more often); ``(empty, 0)``
        when no n-gram matches.

    Raises:
        InvalidArgumentError: ``min_ngram`` < 1.
    """
    levels = _match_ends(sequence, max_ngram, min_ngram)
    n = len(levels)
    if n < min_ngram:
        return sequence[:0].copy(), 0
    start = int(levels[-1][-1]) + 1
    return sequence[start : start + max_tokens].copy(), n


def _match_ends(sequence: np.ndarray, max_ngram: int, min_ngram: int) -> list[np.ndarray]:
    """Where earlier windows end that equal the sequence's last n tokens: entry n - 1 holds, ascending, the ends
    e in n - 1 .. L - 2 (so a token follows) of the windows ``sequence[e - n + 1 : e + 1]`` equal to the last n,
    for n = 1 up to the longest n <= min(max_ngram, L - 1) that has one (callers ignore n < ``min_ngram``); []
    where ``min(max_ngram, L - 1) < min_ngram`` or the last token did not occur before.

    The ends that match the last token, then those kept while the token n before them matches too: matches are
    nested, so each step compares only the ends still in play (one pass over the sequence in all), not every
    window for every n.
    """
    _check_ngram_size("min_ngram", min_ngram)
    length = sequence.shape[0]
    top = min(max_ngram, length - 1)
    if top < min_ngram:
        return []
    ends, levels = (sequence[: length - 1] == sequence[length - 1]).nonzero()[0], []
    while ends.size and len(levels) < top:
        levels.append(ends)
        n = len(levels)
        if n < top:
            if ends[0] < n:  # ascending: drop the ends too early for n + 1 tokens
                ends = ends[ends >= n]
            ends = ends[sequence[ends - n] == sequence[length - 1 - n]]
    return levels


def find_continuations(sequence: np.ndarray, max_tokens: int, max_ngram: int, min_ngram: int,
                       max_branches: int) -> list[list[int]]:
    """Up to ``max_branches`` different continuations of earlier matches of the sequence's last n-gram.

    Matches of the longest n first, most recent first within an n (the first is
    ``find_continuation``'s); then shorter n while fewer were found. Identical continuations
    count once, and a continuation that is a prefix of one already found adds nothing.

    Args:
        sequence: (L,) int64 numpy array.
        max_tokens, max_ngram, min_ngram: As ``find_continuation``.
        max_branches: Most continuations (>= 1).

    Returns:
        Lists of 1 .. ``max_tokens`` ids, best first.

    Raises:
        InvalidArgumentError: ``min_ngram`` < 1.
    """
    levels, found = _match_ends(sequence, max_ngram, min_ngram), []
    for n in range(len(levels), min_ngram - 1, -1):
        for end in levels[n - 1][::-1].tolist():
            cont = sequence[end + 1 : end + 1 + max_tokens].tolist()
            if cont and not any(f[: len(cont)] == cont for f in found):
                found.append(cont)
                if len(found) == max_branches:
                    return found
    return found


def continuation_tree(continuations: list[list[int]], max_nodes: int) -> tuple[list[int], list[int]]:
    """The continuations merged into a trie of at most ``max_nodes`` drafted nodes (shared prefixes once).

    The first continuation keeps all it can after one node is reserved for each other
    continuation's first token that differs from it; the others follow in order while nodes
    are left.

    Returns:
        ``(tokens, parents)``: the nodes' tokens, and per node its parent (0: the pending token;
        node i is ``tokens[i - 1]``), each parent before its children.
    """
    others = len({c[0] for c in continuations[1:]} - {continuations[0][0]}) if continuations else 0
    tokens: list[int] = []
    parents: list[int] = []
    child: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    for i, cont in enumerate(continuations):
        limit = max(1, max_nodes - others) if i == 0 else max_nodes
        node = 0
        for token in cont:
            nxt = child.get((node, token))
            if nxt is None:
                if len(tokens) >= limit:
                    break
                tokens.append(token)
                parents.append(node)
                nxt = child[(node, token)] = len(tokens)
            node = nxt
    return tokens, parents


def _check_ngram_size(name: str, value: int) -> None:
    """One n-gram size, an integer >= 1 (``check_ngram_sizes``; the matches check ``min_ngram`` themselves, a few
    comparisons a call: n = 0 would match the empty n-gram everywhere)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgumentError(f"prompt lookup {name} must be an integer >= 1, got {value!r}")


def check_ngram_sizes(max_ngram: int, min_ngram: int) -> None:
    """Raise unless 1 <= min_ngram <= max_ngram (integers).

    Raises:
        InvalidArgumentError: Naming the bad value and the allowed range.
    """
    _check_ngram_size("min_ngram", min_ngram)
    _check_ngram_size("max_ngram", max_ngram)
    if min_ngram > max_ngram:
        raise InvalidArgumentError(
            f"prompt lookup min_ngram ({min_ngram}) must be <= max_ngram ({max_ngram}); "
            "allowed: 1 <= min_ngram <= max_ngram"
        )


class HostSequences:
    """Each row's tokens as an int64 numpy array, for matching on the host: a round copies only new tokens.

    ``Drafter.propose`` gets each row's sequence as a Python list; ``np.asarray`` of the whole list costs
    O(L) every round (10-17 us at 400 tokens, 39-60 us at 1,500 on a 2-core AMD EPYC, where the match itself
    takes 9-14 us: ``docs/benchmarks/2026-11-28-ngram-match.md``). The engine calls the drafter's ``rollback``
    with each row's confirmed count after every round, and after any rewind of a row's tokens (a banned word's)
    before the next ``propose`` (``protocol.Drafter.rollback``), so the first ``num_valid`` tokens held for a
    slot are still its row's at the next ``arrays``; ``join`` starts a slot anew and ``move`` moves one, as the
    drafter's own. A row whose tokens were only cut from the end needs no ``rollback``: what is held still
    starts with them.
    """

    def __init__(self) -> None:
        self._buffers: list[np.ndarray] = []  # per slot, room for its tokens
        self._valid: list[int] = []  # per slot, how many of the held tokens are its row's

    def arrays(self, sequences) -> list[np.ndarray]:
        """Per row b (slot b), an (L_b,) int64 view of ``sequences[b]``, valid until the next call.

        Args:
            sequences: Per row, its tokens (a list of ints, as ``propose`` gets them).
        """
        out = []
        for b, tokens in enumerate(sequences):
            self._slot(b)
            length, buffer, valid = len(tokens), self._buffers[b], self._valid[b]
            if buffer.shape[0] < length:  # room for twice as many: a row's buffer grows a few times at most
                grown = np.empty(max(2 * length, 256), dtype=np.int64)
                grown[:valid] = buffer[:valid]
                buffer = self._buffers[b] = grown
            if valid < length:
                buffer[valid:length] = tokens[valid:]
            self._valid[b] = length
            out.append(buffer[:length])
        return out

    def join(self, slot: int) -> None:
        """A new row in ``slot`` (a slot index, as the drafter's ``join``): nothing held is its."""
        self._slot(slot)
        self._valid[slot] = 0

    def rollback(self, num_valid: list[int]) -> None:
        """Keep at most the first ``num_valid[b]`` tokens held for slot b.

        Args:
            num_valid: Per slot b (rows 0 .. n - 1), how many leading tokens of its row are confirmed (a token
                count, as the drafter's ``rollback``); slots past the list keep theirs.
        """
        for b, valid in enumerate(num_valid[: len(self._valid)]):
            self._valid[b] = min(self._valid[b], valid)

    def move(self, src: int, dst: int, num_valid: int) -> None:
        """Slot ``src``'s row moves to ``dst`` with ``num_valid`` confirmed tokens; ``src`` holds nothing.

        Args:
            src, dst: Slot indices, as the drafter's ``move``.
            num_valid: The row's confirmed tokens (a count): at most these of what is held stay its.
        """
        self._slot(max(src, dst))
        self._buffers[src], self._buffers[dst] = self._buffers[dst], self._buffers[src]
        self._valid[dst], self._valid[src] = min(self._valid[src], num_valid), 0

    def _slot(self, slot: int) -> None:
        while len(self._valid) <= slot:
            self._buffers.append(np.empty(0, dtype=np.int64))
            self._valid.append(0)


#: Shortest match, in tokens, of the sequence that is drafted before the datastore is asked; a shorter one is
#: drafted only where the datastore has nothing.
SEQUENCE_FIRST_NGRAM = 2


class PromptLookupDrafter(Drafter):
    """Per row, proposes the continuation of the most recent earlier match of its last n-gram.

    Deterministic, so ``Draft.probs`` is None (verification treats it as one-hot);
    ``num_forwards`` stays 0. A linear draft reports each row's matched n (``Draft.ngram_sizes``) and
    where the match was (``Draft.match_sources``), by which a cost model decides how much of it to
    verify (``engine.speculation_cost``). A row without a match proposes nothing, and takes a plain
    target step. The match runs on the host, in numpy, on the sequences the engine passes
    (no torch op, so no host sync whatever the device).

    With ``branches`` > 1 it drafts a token tree (``engine.tree``): several matches' continuations
    merged into a trie (``find_continuations``, ``continuation_tree``), so the target's single
    verification forward checks several guesses where the most recent match is wrong (the
    multi-match n-gram drafter of issue 29). A round's nodes are at most the row's budget.

    With a ``datastore``, where the sequence has no match of ``SEQUENCE_FIRST_NGRAM`` tokens or more, a
    linear draft asks it (``NgramDatastore.lookup``), then takes the sequence's shorter match.

    It keeps each row's tokens between rounds (``HostSequences``), so one instance serves one engine at a
    time (``Drafter.bind``), as every drafter.

    Args:
        max_ngram: Longest n-gram to match (>= min_ngram).
        min_ngram: Shortest n-gram to match (>= 1).
        branches: Most continuations per round (>= 1; 1: a linear draft, the most recent match).
        datastore: An ``NgramDatastore`` to match in, or None.

    Raises:
        InvalidArgumentError: Unless 1 <= min_ngram <= max_ngram; ``branches`` < 1; a ``datastore`` that is
            not an ``NgramDatastore``, or one with ``branches`` > 1 (trees continue the sequence's matches only).
    """

    who = "prompt lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, branches: int = 1,
                 datastore: NgramDatastore | None = None) -> None:
        check_ngram_sizes(max_ngram, min_ngram)
        if isinstance(branches, bool) or not isinstance(branches, int) or branches < 1:
            raise InvalidArgumentError(f"prompt lookup branches must be an integer >= 1, got {branches!r}")
        if datastore is not None and not isinstance(datastore, NgramDatastore):
            raise InvalidArgumentError(f"prompt lookup datastore must be an NgramDatastore or None, got {datastore!r}")
        if branches > 1 and datastore is not None:
            raise InvalidArgumentError(f"prompt lookup branches={branches} drafts trees of the sequence's own matches; "
                                       "a datastore needs branches=1")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.branches = branches
        self.datastore = datastore
        self.reports_ngram_sizes = branches == 1  # a tree's nodes continue several matches
        self._device = None
        self._host = HostSequences()

    def bind(self, target_cache) -> None:
        self._device = target_cache.device
        self.num_forwards = 0
        self._host = HostSequences()

    def join(self, slot: int, prompt_ids: torch.Tensor, sampler: Sampler) -> None:
        """The row's host copy starts anew (``HostSequences``): its sequence comes with every ``propose``."""
        self._host.join(slot)

    def propose(self, sequences, max_tokens, exits=None, exit_rule="row") -> Draft:
        if self.branches > 1:
            return self._propose_trees(sequences, max_tokens)
        found, sizes, sources = [], [], []
        for s, cap in zip(self._host.arrays(sequences), max_tokens):
            tokens, n, source = self._match(s, cap) if cap > 0 else ([], 0, "sequence")
            found.append(tokens)
            sizes.append(n if tokens else 0)
            sources.append(source)
        width = max(1, max(len(f) for f in found))
        ids = to_device([f + [0] * (width - len(f)) for f in found], self._device)
        return Draft(ids, [len(f) for f in found], None, None, self.who, ngram_sizes=sizes, match_sources=sources)

    def _match(self, sequence: np.ndarray, cap: int) -> tuple[list[int], int, str]:
        """One row's block: ``(tokens, n, source)`` (class docstring)."""
        tokens, n = match_continuation(sequence, cap, self.max_ngram, self.min_ngram)
        if n < SEQUENCE_FIRST_NGRAM and self.datastore is not None:
            hit, m = self.datastore.lookup(sequence, cap)
            if hit:
                return hit, m, "datastore"
        return tokens.tolist(), n, "sequence"

    def _propose_trees(self, sequences, max_tokens) -> Draft:
        rows, trees = [], []
        for s, cap in zip(self._host.arrays(sequences), max_tokens):
            found = find_continuations(s, cap, self.max_ngram, self.min_ngram,
                                       self.branches) if cap > 0 else []
            tokens, parents = continuation_tree(found, cap)
            rows.append(tokens)
            trees.append(TokenTree((-1, *parents)) if tokens else None)
        width = max(1, max(len(r) for r in rows))
        ids = to_device([r + [0] * (width - len(r)) for r in rows], self._device)
        return Draft(ids, [len(r) for r in rows], None, None, self.who, trees=trees)

    def rollback(self, num_valid: list[int]) -> None:
        """The host copies keep at most each row's first ``num_valid[b]`` tokens."""
        self._host.rollback(num_valid)

    def move(self, src: int, dst: int, num_valid: int) -> None:
        """The row's host copy moves with it."""
        self._host.move(src, dst, num_valid)
