"""``specdecode bench --backend llama-cpp``: our methods with the target's GGUF file in llama.cpp, next to
llama.cpp's own decoding of the same file (the ``llama-cpp`` and ``llama-cpp-lookup`` reference columns).

What that backend cannot run is refused (named) or skipped with the reason (unnamed), checked on a
torch-backed stand-in for the llama.cpp target; the report's agreement with ``llama-cpp`` is checked
on hand-made records. The last tests run llama.cpp on a float32 GGUF file of a tiny model, through
``run_bench`` and through the command: our methods give exactly the ``llama-cpp`` column's tokens
(100% agreement), and the report shows each method's tok/s ÷ llama.cpp's and that agreement.
"""

from __future__ import annotations

import json

import pytest
import torch

from bench_helpers import _write_jsonl
from conftest import make_tiny_model, make_tiny_tokenizer
from runner_target_helpers import TorchBackedModel
from specdecode import GenerationConfig, cli
from specdecode.bench import BenchSettings, markdown_report, resolve_methods, run_bench, summarize
from specdecode.bench.datasets import Prompt
from specdecode.errors import InvalidArgumentError
from specdecode.models import LoadedModel
from specdecode.models.llama_cpp_target import LlamaCppTargetRunner
from specdecode.pipeline import SpeculativeGenerator

PROMPTS = [  # n-grams repeat, so prompt lookup drafts
    Prompt("t/1", "code", "w5 w9 w12 w7 w5 w9 w12 w30 w5 w9", False),
    Prompt("t/2", "code", "w11 w13 w17 w11 w13 w19 w11 w13", False),
    Prompt("t/3", "chat", "w30 w31 w32 w30 w31 w8 w30 w31", False),
]
OURS = ("autoregressive", "prompt-lookup", "prompt-lookup:num_speculative_tokens=2")
REFERENCES = ("llama-cpp", "llama-cpp-lookup")


@pytest.fixture(scope="module")
def stand_in():
    """A generator whose target is a ``LlamaCppTargetRunner`` over a tiny torch model (no llama.cpp needed)."""
    runner = LlamaCppTargetRunner(TorchBackedModel(make_tiny_model("qwen2", num_layers=2, seed=4)))
    return SpeculativeGenerator(LoadedModel(runner, make_tiny_tokenizer(), "tiny"))


# ---------------------------------------------------------------------------------------------
# what the backend cannot run


@pytest.mark.parametrize(("method", "message"), [
    ("hf-generate", r"method 'hf-generate' runs transformers' generate on the target's torch model, but with "
                    r"backend 'llama-cpp' the target runs in llama.cpp and has none"),
    ("hf-assisted", r"method 'hf-assisted' runs transformers' generate"),
    ("layer-skip:skip_layers=attn=1", r"method 'layer-skip' does not run with backend='llama-cpp': it drafts with "
                                      r"the target's own torch layers"),
    ("early-exit:exit_layer=1", r"method 'early-exit' does not run with backend='llama-cpp'"),
    ("autoregressive:compile=1", r"compile=True compiles torch forwards, but the target model runs in llama.cpp"),
])
def test_named_methods_it_cannot_run_are_refused(stand_in, tmp_path, method, message):
    with pytest.raises(InvalidArgumentError, match=message):
        run_bench(stand_in, PROMPTS, ["autoregressive", method], BenchSettings(max_new_tokens=4), tmp_path / "o")
    assert not (tmp_path / "o").exists()  # refused before anything ran


def test_unnamed_methods_it_cannot_run_are_skipped_with_the_reason(stand_in):
    runners, skipped = resolve_methods(stand_in, None, BenchSettings(max_new_tokens=4))
    assert {"autoregressive", "prompt-lookup"} <= set(runners)
    assert not any(name.startswith("hf-") or name in ("layer-skip", "early-exit") for name in runners)
    for name in ("hf-generate", "hf-generate-static", "hf-assisted", "hf-prompt-lookup"):
        assert "the target runs in llama.cpp and has none" in skipped[name]
    for name in ("layer-skip", "early-exit"):
        assert "does not run with backend='llama-cpp'" in skipped[name]
    for name in REFERENCES:  # not "runs only when named": tried, and this stand-in has no GGUF file to run
        assert "the target's llama.cpp model 'torch-backed' names none" in skipped[name]
    assert all(not runner.supports_prompt_cache for runner in runners.values())


def test_the_prompt_cache_is_off_and_refused_when_asked_for(stand_in, tmp_path):
    with pytest.raises(InvalidArgumentError, match=r"prompt_cache=True, but autoregressive cannot start from a "
                                                   r"cached prompt \(the target runs in llama.cpp"):
        run_bench(stand_in, PROMPTS[:1], ["autoregressive"], BenchSettings(max_new_tokens=4, prompt_cache=True),
                  tmp_path / "o")
    results = run_bench(stand_in, PROMPTS[:1], ["autoregressive"], BenchSettings(max_new_tokens=4), tmp_path / "p")
    assert results["settings"]["prompt_cache"] is False and results["backend"] == "llama-cpp"
    assert results["identity"]["backend"] == "llama-cpp"
    assert json.loads((tmp_path / "p" / "settings.json").read_text())["identity"]["backend"] == "llama-cpp"
    assert results["records"][0]["prompt_cache_tokens"] == 0


@pytest.mark.parametrize(("flags", "needle"), [
    (["--methods", "autoregressive", "hf-generate"],
     "method 'hf-generate' does not run with --backend llama-cpp: it runs transformers' generate"),
    (["--methods", "layer-skip:skip_layers=attn=1"],
     "method 'layer-skip:skip_layers=attn=1' does not run with --backend llama-cpp: it drafts with the target's"),
    (["--batch-size", "1"], "--batch-size 1 decodes several rows at once, but with --backend llama-cpp"),
    (["--compile"], "--compile compiles torch forwards, but with --backend llama-cpp"),
    (["--prompt-cache"], "--prompt-cache copies a torch target's KV cache, but with --backend llama-cpp"),
    (["--quantize", "int8"], "quantize='int8' quantize torch weights, but backend='llama-cpp'"),
    (["--dtype", "bfloat16"], "dtype='bfloat16': backend='llama-cpp' runs the GGUF file's own weight types"),
])
def test_cli_refuses_before_loading(tmp_path, capsys, flags, needle):
    code = cli.main(["bench", "--backend", "llama-cpp", "--target", str(tmp_path / "missing.gguf"), "--draft", "none",
                     "--out", str(tmp_path / "o"), *flags])
    assert code == 2 and needle in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


# ---------------------------------------------------------------------------------------------
# agreement with llama-cpp's tokens, on hand-made records


def _record(method: str, prompt: str, tokens: list[int], seconds: float) -> dict:
    return {"method": method, "prompt_id": prompt, "category": "code", "repeat": 0, "token_ids": tokens,
            "new_tokens": len(tokens), "seconds": seconds, "drafted": 0, "accepted": 0,
            "verify_tokens": len(tokens) - 1, "verify_forwards": len(tokens) - 1, "target_forwards": len(tokens),
            "peak_rss_mb": None}


def test_agreement_with_llama_cpp_and_the_ratios_in_the_report(tmp_path):
    from specdecode.bench.report import write_reports

    records = [_record("llama-cpp", "a", [5, 6, 7, 8], 0.4), _record("llama-cpp", "b", [9, 9, 9, 9], 0.4),
               _record("llama-cpp-lookup", "a", [5, 6, 7, 8], 0.2), _record("llama-cpp-lookup", "b", [9, 9, 9, 9], 0.2),
               _record("autoregressive", "a", [5, 6, 7, 8], 0.4), _record("autoregressive", "b", [9, 9, 1, 9], 0.4),
               _record("prompt-lookup", "a", [5, 6, 7, 8], 0.1), _record("prompt-lookup", "b", [9, 9, 9, 3], 0.3)]
    info = {"backend": "llama-cpp", "categories": ["code"], "num_prompts": 2, "settings": {"repeats": 1},
            "methods": {"llama-cpp": {"n_threads": 2}}}
    results = write_reports(tmp_path, records, info)
    o = results["summary"]["prompt-lookup"]["overall"]
    assert o["exact_match_rate_vs_llama_cpp"] == 0.5 and o["mean_first_divergence_vs_llama_cpp"] == 3
    assert o["compared_vs_llama_cpp"] == 2
    assert o["vs_llama_cpp"] == pytest.approx(2.0) and o["vs_llama_cpp_lookup"] == pytest.approx(1.0)
    ar = results["summary"]["autoregressive"]["overall"]
    assert (ar["exact_match_rate_vs_llama_cpp"], ar["mean_first_divergence_vs_llama_cpp"]) == (0.5, 2)
    assert (o["exact_match_rate"], o["mean_first_divergence"]) == (0.5, 2)  # against autoregressive's tokens
    assert results["summary"]["llama-cpp"]["overall"]["exact_match_rate_vs_llama_cpp"] is None  # the reference
    md = (tmp_path / "results.md").read_text()
    assert "| Exact match vs llama.cpp |" in md and "| vs llama.cpp | vs llama-cpp-lookup |" in md
    main_row = next(line for line in md.splitlines() if line.startswith("| `prompt-lookup` |"))
    assert "| 2.00× | 2.00× | 1.00× |" in main_row  # speedup, vs llama.cpp, vs llama-cpp-lookup
    assert "| 50% (1st diff @2) | 50% (1st diff @3) |" in main_row  # exact match vs AR, then vs llama.cpp
    by_category = md.split("Tok/s ÷ `llama-cpp`'s tok/s, by category:")[1]
    row = next(line for line in by_category.splitlines() if line.startswith("| `prompt-lookup` |"))
    assert row == "| `prompt-lookup` | 2.00× | 2.00× | 50% (1st diff @3) |"  # code, overall, agreement
    assert "Tok/s ÷ `llama-cpp-lookup`'s tok/s, by category:" in md
    # a torch-backend run keeps the agreement column out of its main table (its tokens come from other weights)
    torch_md = markdown_report({**results, "backend": "torch"})
    assert "| Exact match vs llama.cpp |" not in torch_md.split("Tok/s ÷")[0]
    without = summarize([r for r in records if r["method"] not in REFERENCES])
    assert without["methods"]["prompt-lookup"]["overall"]["exact_match_rate_vs_llama_cpp"] is None


# ---------------------------------------------------------------------------------------------
# llama.cpp on a tiny float32 GGUF file


@pytest.fixture(scope="module")
def llama_gen(tiny_gguf):
    from specdecode.models.llama_cpp import LlamaCppModel

    model = LlamaCppModel(tiny_gguf, n_threads=1, role="target model")  # llama.cpp's default f16 KV cache
    yield SpeculativeGenerator(LoadedModel(LlamaCppTargetRunner(model), make_tiny_tokenizer(), "tiny"))
    model.close()


def _tokens(results: dict, method: str) -> dict[str, list[int]]:
    return {r["prompt_id"]: r["token_ids"] for r in results["records"] if r["method"] == method}


def test_our_methods_give_llama_cpp_s_own_greedy_tokens(llama_gen, tiny_gguf, tmp_path):
    settings = BenchSettings(max_new_tokens=40, warmup_tokens=2)
    results = run_bench(llama_gen, PROMPTS, [*OURS, *REFERENCES], settings, tmp_path / "o")
    reference = _tokens(results, "llama-cpp")
    assert len(reference) == len(PROMPTS) and all(len(t) == 40 for t in reference.values())
    for method in OURS:
        assert _tokens(results, method) == reference, method
    s = results["summary"]
    assert sum(r["drafted"] for r in results["records"] if r["method"] == "prompt-lookup") > 0
    for method in OURS:
        for cat in ("code", "chat", "overall"):
            m, llama = s[method][cat], s["llama-cpp"][cat]["tokens_per_s"]
            assert m["exact_match_rate_vs_llama_cpp"] == 1.0 and m["compared_vs_llama_cpp"] >= 1
            assert m["vs_llama_cpp"] == pytest.approx(m["tokens_per_s"] / llama)
            lookup = s["llama-cpp-lookup"][cat]["tokens_per_s"]
            assert m["vs_llama_cpp_lookup"] == pytest.approx(m["tokens_per_s"] / lookup)
    # the speedup baseline stays ours, target-only: autoregressive with the target in llama.cpp
    assert set(results["baselines_used"].values()) == {"autoregressive"}
    # the references run the very file, threads and KV cache of the target
    model = llama_gen.target.model.model
    for name in REFERENCES:
        about = results["methods"][name]
        assert (about["gguf_file"], about["n_threads"], about["kv_cache_type"]) == (str(tiny_gguf), 1, "f16")
    assert results["methods"]["prompt-lookup"]["draft_control"]["policy"] == "SpeculationCostPolicy"
    assert results["methods"]["autoregressive"]["backend"] == "llama-cpp"
    ident = results["identity"]
    assert (ident["backend"], ident["gguf_file"], ident["n_threads"], ident["kv_cache_type"]) == (
        "llama-cpp", str(model.path), 1, "f16")
    assert results["environment"]["llama_cpp_target"]["gguf_file"] == str(tiny_gguf)
    md = (tmp_path / "o" / "results.md").read_text()
    assert f"backend llama-cpp: the target's GGUF file `{tiny_gguf}` in llama.cpp (1 threads, f16 KV cache)" in md
    assert "| Exact match vs llama.cpp |" in md and "Tok/s ÷ `llama-cpp`'s tok/s, by category:" in md
    row = next(line for line in md.splitlines() if line.startswith("| `prompt-lookup` |"))
    assert "| 100% | 100% |" in row  # exact match vs AR, then vs llama.cpp


def test_the_references_run_by_default(llama_gen):
    runners, skipped = resolve_methods(llama_gen, None, BenchSettings(max_new_tokens=4))
    assert {"autoregressive", "prompt-lookup", *REFERENCES} <= set(runners)
    assert not set(REFERENCES) & set(skipped)


def test_llama_cpp_runs_in_the_target_s_own_context(llama_gen, monkeypatch):
    """One loaded copy of the file: the reference's forwards are our target's (a second copy ran ~6% apart)."""
    model = llama_gen.target.model.model
    runners, _ = resolve_methods(llama_gen, list(REFERENCES), BenchSettings(max_new_tokens=6))
    assert runners["llama-cpp"].llm is model._llm
    assert runners["llama-cpp-lookup"].llm is not model._llm  # its own Llama: a draft_model, logits_all=True
    ours = llama_gen.decoder("autoregressive")
    ids = torch.tensor([[5, 9, 12, 7, 5, 9]])
    expected = ours.generate(ids, GenerationConfig(max_new_tokens=6, temperature=0.0)).token_ids
    held = runners["llama-cpp"].llm
    before = model.generation
    grown = []
    monkeypatch.setattr(model, "ensure_context", lambda n, cached: grown.append((n, list(cached))))
    record = runners["llama-cpp"](ids, 6, 0)
    assert model.generation == before + 1  # it took the context over: the older generation's cache refuses
    assert grown == [(ids.shape[1] + 6, [])]  # the target's context grows for it (here: no need)
    assert record["token_ids"] == expected and runners["llama-cpp"].llm is held
    monkeypatch.undo()
    assert ours.generate(ids, GenerationConfig(max_new_tokens=6, temperature=0.0)).token_ids == expected


def test_the_shared_reference_follows_the_target_s_context_when_it_grows(tiny_gguf, monkeypatch):
    """Our prefill may grow (reload) the target's context, freeing the Llama the reference held: the reference
    must then generate with, and describe, the new one."""
    from specdecode.models import llama_cpp as llama_cpp_module
    from specdecode.models import llama_cpp_target as llama_cpp_target_module
    from specdecode.models.llama_cpp import LlamaCppModel

    for module in (llama_cpp_module, llama_cpp_target_module):
        monkeypatch.setattr(module, "CONTEXT_STEP", 256)  # llama.cpp pads a context to 256 positions
    model = LlamaCppModel(tiny_gguf, n_threads=1, role="target model")
    try:
        gen = SpeculativeGenerator(LoadedModel(LlamaCppTargetRunner(model), make_tiny_tokenizer(), "tiny"))
        runners, _ = resolve_methods(gen, ["llama-cpp"], BenchSettings(max_new_tokens=8))
        reference = runners["llama-cpp"]
        short = torch.tensor([[5, 9, 12, 7, 5, 9]])
        first = reference(short, 8, 0)["token_ids"]
        old = model._llm
        long = torch.tensor([[5 + i % 40 for i in range(230)]])
        ours = gen.decoder("autoregressive").generate(long, GenerationConfig(max_new_tokens=8, temperature=0.0))
        assert model.n_ctx == 512 and model._llm is not old  # 230 + 8 + 256 // 4 positions: it grew
        assert reference.llm is model._llm and reference.n_ctx == 512
        assert reference(long, 8, 0)["token_ids"] == ours.token_ids
        assert reference(short, 8, 0)["token_ids"] == first
        assert reference.describe()["n_ctx"] == 512
    finally:
        model.close()


def test_a_gguf_file_other_than_the_target_s_is_refused(llama_gen, tmp_path):
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGUF")
    with pytest.raises(InvalidArgumentError, match=r"method 'llama-cpp' runs the GGUF file the target runs with "
                                                   r"backend 'llama-cpp' \(.*qwen2.gguf\), but gguf_file is"):
        resolve_methods(llama_gen, ["llama-cpp"], BenchSettings(gguf_file=str(other)))


def test_command_with_backend_llama_cpp(tiny_gguf, tmp_path, capsys, monkeypatch):
    from specdecode.models import llama_cpp_target

    monkeypatch.setattr(llama_cpp_target, "_target_tokenizer", lambda spec, path, cache_dir: make_tiny_tokenizer())
    monkeypatch.setenv("COLUMNS", "300")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    data = _write_jsonl(tmp_path / "q.jsonl", [{"prompt": p.text, "category": p.category} for p in PROMPTS])
    code = cli.main(["bench", "--backend", "llama-cpp", "--target", str(tiny_gguf), "--draft", "none",
                     "--dataset", data, "--no-chat", "--max-new-tokens", "24", "--warmup-tokens", "2",
                     "--methods", "autoregressive,prompt-lookup,llama-cpp,llama-cpp-lookup",
                     "--out", str(tmp_path / "o")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "target in llama.cpp (--backend llama-cpp)" in out
    assert "vs llama.cpp" in out and "exact match vs llama.cpp" in out
    line = next(line for line in out.splitlines() if "prompt-lookup" in line and "llama-cpp-lookup" not in line)
    assert line.count("100%") == 2  # exact match vs AR and vs llama.cpp
    results = json.loads((tmp_path / "o" / "results.json").read_text())
    assert results["backend"] == "llama-cpp" and results["identity"]["backend"] == "llama-cpp"
    reference = _tokens(results, "llama-cpp")
    assert _tokens(results, "prompt-lookup") == _tokens(results, "autoregressive") == reference
