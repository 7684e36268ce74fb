"""``draft_vocab_size`` (``--draft-vocab-size``) through ``SpeculativeGenerator``, the bench and the CLI."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import make_tiny_model, make_tiny_tokenizer
from helpers import perturbed_copy, run_generate, save_tiny_folders
from selfspec_helpers import one_thread  # noqa: F401
from specdecode import GenerationConfig, InvalidArgumentError, SpeculativeDecoder, SpeculativeGenerator
from specdecode.bench.methods import MethodSpec, build_decoder
from specdecode.drafters import CascadeDrafter, DraftModelDrafter
from specdecode.models import LoadedModel, load_model, write_dense_cache
from specdecode.models import token_frequencies as tf
from specdecode.models.token_frequencies import FREQUENCY_FILE, count_tokens

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = "w5 w9 w12 w7 w5 w9 w12 w7 w5"
CORPUS_TEXT = "w5 w9 w12 w7 w5 w9 w30 w31 w32 w5"  # a few words often, most never


@pytest.fixture
def small_corpus(monkeypatch):
    """The pipeline counts this text instead of the installation's (seconds with the tiny tokenizer)."""
    calls = []

    def count(tokenizer, corpus=None):
        calls.append(tokenizer)
        return tf.TokenFrequencies(count_tokens(tokenizer, [CORPUS_TEXT]), tf.tokenizer_fingerprint(tokenizer),
                                   {"kind": "test"})

    monkeypatch.setattr(tf, "count_corpus", count)
    return calls


@pytest.fixture(scope="module")
def generator():
    tok = make_tiny_tokenizer()
    target = make_tiny_model("qwen2", num_layers=2)
    draft = perturbed_copy(target, noise=0.5, seed=3)
    return SpeculativeGenerator(LoadedModel(target, tok, "tiny-target"), LoadedModel(draft, tok, "tiny-draft"))


def test_make_drafter_builds_the_truncated_head(generator, small_corpus):
    gen = SpeculativeGenerator(generator.target, generator.draft)
    d = gen.make_drafter("draft", draft_vocab_size=8)
    assert isinstance(d, DraftModelDrafter)
    # the 3 special tokens, then the corpus's most frequent words: w5 (3x), w9 (2x), then w7 w12 w30 (ties: lower id)
    assert d.head.ids.tolist() == [0, 1, 2, 5, 7, 9, 12, 30]
    c = gen.make_drafter("cascade", draft_vocab_size=8, prompt_lookup_max_ngram=2)
    assert isinstance(c, CascadeDrafter) and torch.equal(c.head.ids, d.head.ids)
    assert len(small_corpus) == 1  # counted once per generator
    for k in (None, 0):
        assert gen.make_drafter("draft", draft_vocab_size=k).head.ids is None


def test_generate_with_a_truncated_head_equals_autoregressive(generator, small_corpus):
    config = GenerationConfig(max_new_tokens=20, num_speculative_tokens=3, stop_on_eos=False)
    expected = generator.generate(PROMPT, config, method="autoregressive").token_ids
    for method in ("draft", "cascade"):
        assert generator.generate(PROMPT, config, method=method, draft_vocab_size=6).token_ids == expected


@pytest.mark.parametrize("k, message", [
    (-1, r"draft_vocab_size -1 is out of range: allowed 3\.\.48 .*or 0 / None for the full head"),
    (49, r"draft_vocab_size 49 is out of range: allowed 3\.\.48"),
    (2, r"draft_vocab_size 2 is out of range: allowed 3\.\.48 \(the draft tokenizer has 48 tokens, 3 of them special"),
    (True, r"draft_vocab_size True is out of range"),
    ("8", r"draft_vocab_size '8' is out of range"),
])
def test_bad_draft_vocab_size(generator, small_corpus, k, message):
    with pytest.raises(InvalidArgumentError, match=message):
        generator.make_drafter("draft", draft_vocab_size=k)
    assert small_corpus == []  # refused before any counting


@pytest.mark.parametrize("method", ["layer-skip", "early-exit", "prompt-lookup", "autoregressive"])
def test_draft_vocab_size_is_refused_without_a_draft_model_method(generator, method):
    with pytest.raises(InvalidArgumentError, match=f"applies to the methods with a draft model, 'draft' and "
                                                   f"'cascade', not to '{method}'"):
        generator.make_drafter(method, draft_vocab_size=8, exit_layer=1, skip_layers="attn=1")


def test_frequencies_are_stored_with_the_dense_cache_and_reused(tmp_path, small_corpus):
    tok = make_tiny_tokenizer()
    target = make_tiny_model("llama", num_layers=2)
    folder = tmp_path / "dense" / "tiny-draft-float32"
    write_dense_cache(perturbed_copy(target, 0.5, seed=1), tok, folder, {"source": "test"})
    draft = load_model(str(folder), dtype="float32", device="cpu")
    gen = SpeculativeGenerator(LoadedModel(target, tok, "tiny-target"), draft)
    gen.make_drafter("draft", draft_vocab_size=5)
    assert (folder / FREQUENCY_FILE).is_file() and len(small_corpus) == 1
    fresh = SpeculativeGenerator(LoadedModel(target, tok, "tiny-target"), draft)  # the next start
    assert fresh.make_drafter("draft", draft_vocab_size=5).head.ids.tolist() == [0, 1, 2, 5, 9]
    assert len(small_corpus) == 1  # read, not counted


def test_bench_method_option(generator, small_corpus):
    spec = MethodSpec.parse("cascade:draft_vocab_size=6+adaptive")
    assert spec.options == {"draft_vocab_size": 6}
    dec = build_decoder(generator, spec.base, {**spec.options, "draft_control": spec.draft_control})
    assert isinstance(dec, SpeculativeDecoder) and dec.drafter.head.size == 6
    with pytest.raises(InvalidArgumentError, match="not to 'prompt-lookup'"):
        build_decoder(generator, "prompt-lookup", MethodSpec.parse("prompt-lookup:draft_vocab_size=6").options)


def test_a_run_wide_draft_head_reaches_only_the_draft_model_methods(generator, small_corpus):
    """``--drafter-option draft_vocab_size=K`` must not abort the methods without a draft model."""
    from specdecode.bench.methods import resolve_methods
    from specdecode.bench.settings import BenchSettings

    settings = BenchSettings(max_new_tokens=4, warmup_tokens=1, drafter_options={"draft_vocab_size": 6})
    runners, skipped = resolve_methods(generator, ["autoregressive", "draft", "prompt-lookup"], settings)
    assert set(runners) == {"autoregressive", "draft", "prompt-lookup"} and not skipped
    assert runners["draft"].decoder.drafter.head.size == 6


# --- the command line -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory):
    target = make_tiny_model("llama", num_layers=3)
    draft = perturbed_copy(target, 0.5, seed=2)
    return (*save_tiny_folders(tmp_path_factory.mktemp("models"), make_tiny_tokenizer(), target, draft), target)


_run = run_generate


def test_cli_generate_with_draft_vocab_size(tiny_folders, capsys, small_corpus):
    target_dir, draft_dir, target = tiny_folders
    code, out, err = _run(
        capsys, "--target", target_dir, "--draft", draft_dir, "--method", "cascade", "--prompt", "w5 w9 w11",
        "--max-new-tokens", 12, "--dtype", "float32", "--device", "cpu", "-g", 3, "--draft-vocab-size", 6, "--json",
    )
    assert code == 0, err
    result = json.loads(out)
    expected = SpeculativeDecoder(target, eos_token_ids=[2]).generate(
        torch.tensor([[5, 9, 11]]), GenerationConfig(max_new_tokens=12)
    )
    assert result["token_ids"] == expected.token_ids and result["draft_vocab_size"] == 6
    assert len(small_corpus) == 1


@pytest.mark.parametrize("args, message", [
    (["--draft-vocab-size", "-5"], "--draft-vocab-size -5 is out of range: use K in S..V (S special tokens, V the vocabulary size) or 0"),
    (["--method", "prompt-lookup", "--draft-vocab-size", "100"],
     "--draft-vocab-size applies to --method draft or cascade (a draft model's head), not 'prompt-lookup'"),
])
def test_cli_bad_draft_vocab_size_fails_before_loading(capsys, args, message):
    code, out, err = _run(capsys, "--prompt", "w5", "--target", "not-loaded-model", *args)
    assert code == 2 and message in err and out == ""


def test_cli_draft_vocab_size_above_the_vocabulary(tiny_folders, capsys):
    target_dir, draft_dir, _ = tiny_folders
    code, out, err = _run(capsys, "--target", target_dir, "--draft", draft_dir, "--prompt", "w5",
                          "--dtype", "float32", "--draft-vocab-size", 1000)
    assert code == 2 and "draft_vocab_size 1000 is out of range: allowed 3..48" in err


def test_batch_decoder_builds_the_truncated_head(generator, small_corpus):
    """The batched engine's draft model and cascade take ``draft_vocab_size``; greedy output is the target's."""
    ids = generator.encode(PROMPT, chat=False)
    config = GenerationConfig(max_new_tokens=8)
    expected = generator.decoder("autoregressive").generate(ids, config).token_ids
    for method in ("draft", "cascade"):
        dec = generator.batch_decoder(method, draft_vocab_size=6, max_batch_size=2, max_length=64)
        assert dec.drafter.head.size == 6
        assert [r.token_ids for r in dec.generate([ids, ids], [config, config])] == [expected, expected]
    with pytest.raises(InvalidArgumentError, match="not to 'prompt-lookup'"):
        generator.batch_decoder("prompt-lookup", draft_vocab_size=6)


def test_a_run_wide_draft_head_reaches_only_the_batched_draft_model_methods(generator, small_corpus):
    from specdecode.bench.batched import run_batched_bench
    from specdecode.bench.datasets import Prompt
    from specdecode.bench.settings import BenchSettings

    settings = BenchSettings(max_new_tokens=4, warmup_tokens=1, drafter_options={"draft_vocab_size": 6})
    records = run_batched_bench(generator, [Prompt("p", "c", PROMPT)], ["autoregressive", "cascade", "prompt-lookup"],
                                [1], settings)
    assert [r["method"] for r in records] == ["autoregressive", "cascade", "prompt-lookup"]
    assert records[1]["exact_match_rate"] == 1.0
