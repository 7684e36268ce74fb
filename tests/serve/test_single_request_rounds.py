"""One request alone in the server's engine makes the rounds ``generate``'s engine makes (issue 31).

``specdecode serve`` runs ``SpeculativeGenerator.batch_decoder`` (8 rows, ``max_verify_tokens="auto"``);
``specdecode generate`` runs ``SpeculativeGenerator.decoder`` (one row, no verification budget). With
the CPU budget of 12, a lone row's adaptive blocks stopped at 11 tokens where ``generate`` drafts 12,
so a server request took more verifications than the same ``generate`` run.
"""

from __future__ import annotations

import pytest
import torch

from conftest import make_tiny_model, make_tiny_tokenizer
from helpers import perturbed_copy
from specdecode import GenerationConfig, SpeculativeDecoder
from specdecode.drafters.control import DraftControl
from specdecode.models import LoadedModel
from specdecode.pipeline import BATCH_VERIFY_TOKENS_CPU, SpeculativeGenerator, auto_verify_tokens

PROMPT = [5, 9, 12, 30, 41, 8, 11, 19, 7, 3, 13, 14, 15, 16, 5, 9, 12, 30]


def _recording(stats) -> list[tuple[int, int]]:
    """Makes ``stats.record_block`` also append each round's (drafted, accepted) to the returned list."""
    blocks: list[tuple[int, int]] = []
    record = stats.record_block

    def record_block(num_drafted, num_accepted, depth=None):
        blocks.append((num_drafted, num_accepted))
        return record(num_drafted, num_accepted, depth)

    stats.record_block = record_block
    return blocks


@pytest.mark.parametrize("method", ["cascade", "draft"])
@pytest.mark.parametrize("noise", [0.0, 0.05])
def test_one_request_in_the_server_engine_makes_generates_rounds(method, noise):
    """Float32, greedy, adaptive draft exit (threshold 0, so blocks reach ``max_draft_tokens``): the
    8-row engine with one request drafts and accepts, round by round, what the one-row engine does."""
    torch.manual_seed(0)
    target = make_tiny_model("qwen2", num_layers=3)
    tok = make_tiny_tokenizer()
    gen = SpeculativeGenerator(LoadedModel(target, tok, "tiny"), LoadedModel(perturbed_copy(target, noise, 1), tok, "d"))
    control = DraftControl(adaptive_exit=True, exit_threshold=0.0)
    config = GenerationConfig(max_new_tokens=60, stop_on_eos=False)

    stream = gen.decoder(method, draft_control=control).stream(PROMPT, config)
    alone = _recording(stream.stats)
    for _ in stream:
        pass

    server = gen.batch_decoder(method, max_batch_size=8, max_length=128, draft_control=control)
    rows = _recording(server.stats)
    (result,) = server.generate([PROMPT], config)

    assert result.token_ids == stream.token_ids == SpeculativeDecoder(target).generate(PROMPT, config).token_ids
    assert max(k for k, _ in alone) == control.max_draft_tokens  # the budget would have cut these blocks
    assert rows == alone


def test_auto_verify_tokens():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    adaptive = DraftControl(adaptive_exit=True)  # blocks of up to 12
    assert auto_verify_tokens(cpu, 5, None) == BATCH_VERIFY_TOKENS_CPU
    assert auto_verify_tokens(cpu, 5, adaptive) == adaptive.max_draft_tokens + 1 == 13
    assert auto_verify_tokens(cpu, 20, None) == 21
    assert auto_verify_tokens(cpu, 5, DraftControl(confidence_gate=0.5)) == BATCH_VERIFY_TOKENS_CPU  # γ blocks
    assert auto_verify_tokens(cuda, 5, adaptive) is None
    for rows in range(2, 9):  # with the default blocks, 2..8 rows draft what a budget of 12 gave them
        assert 13 // rows - 1 == BATCH_VERIFY_TOKENS_CPU // rows - 1
