"""Method ``llama-cpp-lookup`` (specdecode.bench.llamacpp.LlamaCppLookupRunner): llama-cpp-python's own
prompt-lookup speculation, a reference column like ``llama-cpp``, never a speedup baseline.

As for ``llama-cpp`` (test_llamacpp.py), most tests run against a scripted stand-in for
``llama_cpp.Llama`` (here one that speculates: it evaluates each drafted block in one call and
keeps the agreeing prefix); the last ones run llama.cpp itself on a float32 GGUF file of the
tiny target (tests/tiny_gguf.py), next to ``llama-cpp`` and our ``autoregressive``.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from bench_helpers import PROMPTS, SMALL, generator, target_only  # noqa: F401
from conftest import VOCAB, make_tiny_tokenizer
from specdecode.bench import BenchSettings, markdown_report, resolve_methods, run_bench
from specdecode.bench.llamacpp import LlamaCppLookupRunner
from specdecode.errors import InvalidArgumentError
from tiny_gguf import write_tiny_gguf


class SpeculatingLlama:
    """``llama_cpp.Llama`` with a ``draft_model``, as ``Llama.generate`` runs it: each eval after the prompt
    feeds the pending token and the draft; the drafted tokens that ``next_token`` agrees with are kept."""

    def __init__(self, module, **kwargs):
        self.module, self.kwargs = module, kwargs
        self.draft_model = kwargs.get("draft_model")
        self.context: list[int] = []
        self.evals: list[list[int]] = []
        self.n_batch = 512
        module.instances.append(self)

    def n_ctx(self) -> int:
        return self.kwargs["n_ctx"]

    def n_vocab(self) -> int:
        return VOCAB

    def reset(self) -> None:
        self.context = []

    def set_seed(self, seed: int) -> None:
        self.seed = seed

    def eval(self, tokens) -> None:
        self.evals.append(list(tokens))
        self.context += list(tokens)

    def generate(self, tokens, reset=True, **sampling):
        self.sampling = sampling
        self.eval(tokens)
        next_token = self.module.next_token
        while True:
            token = next_token(self.context)
            yield token
            draft = [int(t) for t in self.draft_model(list(self.context) + [token])] if self.draft_model else []
            kept = len(self.context)
            self.eval([token, *draft])
            self.context = self.context[: kept + 1]
            for d in draft:
                if next_token(self.context) != d:
                    break
                self.context.append(d)
                yield d

    def close(self) -> None:
        pass


class FakeLookup:
    """``LlamaPromptLookupDecoding``: the tokens after the latest earlier occurrence of the last token."""

    def __init__(self, max_ngram_size: int, num_pred_tokens: int):
        self.max_ngram_size, self.num_pred_tokens = max_ngram_size, num_pred_tokens

    def __call__(self, input_ids):
        ids = list(input_ids)
        for i in range(len(ids) - 2, -1, -1):
            if ids[i] == ids[-1]:
                return ids[i + 1: i + 1 + self.num_pred_tokens]
        return []


def _fake_module(next_token) -> types.ModuleType:
    module = types.ModuleType("llama_cpp")
    module.instances = []
    module.next_token = next_token
    module.Llama = lambda **kwargs: SpeculatingLlama(module, **kwargs)
    module.llama_speculative = types.SimpleNamespace(LlamaPromptLookupDecoding=FakeLookup)
    module.__version__ = "0.0-fake"
    module.llama_print_system_info = lambda: b"CPU : FAKE = 1 |"
    return module


def _cycle(ctx: list[int]) -> int:
    """A text that repeats: w10 w11 w12 w13 w10 w11 .. (prompt lookup finds it after one period)."""
    return 10 + len(ctx) % 4


@pytest.fixture
def fake_gguf(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF not really")
    return str(path)


def test_the_lookup_column_drafts_and_counts_like_llama_cpp_python(target_only, fake_gguf, tmp_path, monkeypatch):
    fake = _fake_module(_cycle)
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    settings = BenchSettings(max_new_tokens=12, warmup_tokens=2, gguf_file=fake_gguf)
    results = run_bench(target_only, PROMPTS, ["autoregressive", "llama-cpp", "llama-cpp-lookup"], settings,
                        tmp_path / "o")
    plain, lookup = fake.instances  # one Llama per column, loaded once
    assert "draft_model" not in plain.kwargs
    drafter = lookup.kwargs["draft_model"]
    assert (drafter.num_pred_tokens, drafter.max_ngram_size) == (2, 2)  # llama-cpp-python's advice for a CPU
    assert lookup.kwargs["n_threads"] == lookup.kwargs["n_threads_batch"] == torch.get_num_threads()
    assert lookup.sampling == plain.sampling and lookup.sampling["temp"] == 0.0

    records = {(r["method"], r["prompt_id"]): r for r in results["records"]}
    for prompt in PROMPTS:
        ours, ref = records["llama-cpp-lookup", prompt.id], records["llama-cpp", prompt.id]
        assert ours["token_ids"] == ref["token_ids"]  # speculation changes no greedy token
        assert ours["drafted"] > 0 and 0 < ours["accepted"] <= ours["drafted"]
        assert ours["target_forwards"] < ref["target_forwards"]  # blocks verified in one forward
        assert ours["verify_forwards"] == ours["target_forwards"] - 1
    desc = results["methods"]["llama-cpp-lookup"]
    assert desc["kind"] == "llama.cpp prompt lookup" and desc["num_pred_tokens"] == 2

    s = results["summary"]
    assert set(results["baselines_used"].values()) == {"autoregressive"}  # never a baseline
    for cat in ("code", "chat", "overall"):
        assert s["llama-cpp-lookup"][cat]["vs_llama_cpp"] == pytest.approx(
            s["llama-cpp-lookup"][cat]["tokens_per_s"] / s["llama-cpp"][cat]["tokens_per_s"])
        assert s["llama-cpp-lookup"][cat]["acceptance_rate"] is not None
    md = (tmp_path / "o" / "results.md").read_text()
    assert "`llama-cpp-lookup` is a reference column too, not a speedup baseline" in md
    assert "num_pred_tokens 2" in md and "| `llama-cpp-lookup` |" in md


def test_the_lookup_column_is_shown_without_llama_cpp(target_only, fake_gguf, tmp_path, monkeypatch):
    """Named alone it is still reported (and never the baseline); there is no vs llama.cpp column then."""
    monkeypatch.setitem(sys.modules, "llama_cpp", _fake_module(_cycle))
    settings = BenchSettings(**SMALL, gguf_file=fake_gguf)
    results = run_bench(target_only, PROMPTS, ["autoregressive", "llama-cpp-lookup"], settings, tmp_path / "o")
    assert results["baselines_used"]["overall"] == "autoregressive"
    md = markdown_report(results)
    assert "| `llama-cpp-lookup` |" in md and "vs llama.cpp |" not in md
    assert "`llama-cpp-lookup` is a reference column too" in md


def test_lookup_errors_name_the_method(target_only, fake_gguf, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    with pytest.raises(InvalidArgumentError, match=r"method 'llama-cpp-lookup' needs llama-cpp-python.*"
                                                   r"or leave 'llama-cpp-lookup' out"):
        run_bench(target_only, PROMPTS, ["llama-cpp-lookup"], BenchSettings(**SMALL, gguf_file=fake_gguf),
                  tmp_path / "o")
    monkeypatch.setitem(sys.modules, "llama_cpp", _fake_module(_cycle))
    with pytest.raises(InvalidArgumentError, match="'llama-cpp-lookup' takes no options or modifiers"):
        run_bench(target_only, PROMPTS, ["llama-cpp-lookup:n=3"], BenchSettings(**SMALL), tmp_path / "o")
    with pytest.raises(InvalidArgumentError, match="method 'llama-cpp-lookup' cannot ban words"):
        LlamaCppLookupRunner(target_only, BenchSettings(**SMALL, gguf_file=fake_gguf, banned_words=("w9",)))
    with pytest.raises(InvalidArgumentError, match="method 'llama-cpp-lookup' runs the target's GGUF file, but "
                                                   "target 'tiny-target' is not a GGUF file"):
        LlamaCppLookupRunner(target_only, BenchSettings(**SMALL))
    runners, skipped = resolve_methods(target_only, None, BenchSettings(**SMALL, gguf_file=fake_gguf))
    assert "llama-cpp-lookup" not in runners and "runs only when named" in skipped["llama-cpp-lookup"]


# ---------------------------------------------------------------------------------------------
# llama.cpp on a float32 GGUF file of the tiny target


def test_real_lookup_gives_llama_cpps_greedy_tokens(target_only, tmp_path):
    """float32 weights, so a drafted block's logits equal single steps': the lookup column's tokens are the
    plain column's, and both are our float32 autoregressive decoding's (the same weights)."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed (pip install 'specdecode[llamacpp]')")
    path = write_tiny_gguf(target_only.target.model, make_tiny_tokenizer(), tmp_path / "tiny.gguf")
    settings = BenchSettings(max_new_tokens=24, warmup_tokens=2, gguf_file=str(path))
    results = run_bench(target_only, PROMPTS, ["autoregressive", "llama-cpp", "llama-cpp-lookup"], settings,
                        tmp_path / "o")
    records = {(r["method"], r["prompt_id"]): r for r in results["records"]}
    drafted = 0
    for prompt in PROMPTS:
        lookup, plain = records["llama-cpp-lookup", prompt.id], records["llama-cpp", prompt.id]
        assert lookup["token_ids"] == plain["token_ids"] == records["autoregressive", prompt.id]["token_ids"]
        drafted += lookup["drafted"]
    assert drafted > 0  # the tiny model repeats itself: the lookup found n-grams to draft
    assert results["methods"]["llama-cpp-lookup"]["llama_cpp_python"] not in (None, "0.0-fake")


def test_real_lookup_takes_a_prompt_longer_than_llama_cpps_batch(tmp_path):
    """A prompt past n_batch (512): llama-cpp-python sizes its scores array from the logits_all it is
    given, while a draft model evaluates with every position's logits, so without logits_all=True this
    failed in ``Llama.eval`` (seen on Spec-Bench's longer prompts with the real target)."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed (pip install 'specdecode[llamacpp]')")
    from conftest import make_tiny_model

    from specdecode import SpeculativeGenerator
    from specdecode.models import LoadedModel

    model = make_tiny_model("llama", num_layers=1, max_position_embeddings=1024)
    gen = SpeculativeGenerator(LoadedModel(model, make_tiny_tokenizer(), "tiny-long"))
    path = write_tiny_gguf(model, make_tiny_tokenizer(), tmp_path / "long.gguf")
    runner = LlamaCppLookupRunner(gen, BenchSettings(max_new_tokens=8, warmup_tokens=2, gguf_file=str(path)))
    ids = torch.tensor([[(7 * i) % 40 + 3 for i in range(600)]])  # repetitive: the lookup drafts
    out = runner(ids, 8, 0)
    assert len(out["token_ids"]) == 8 and runner.llm.n_ctx() >= 600 + 8
