"""specdecode.bench.records: resuming a run from its results folder, and refusing one made otherwise."""

from __future__ import annotations

import pytest

from bench_helpers import PROMPTS, SMALL, _lines, generator, target_only  # noqa: F401
from specdecode import bench
from specdecode.bench import BenchSettings, run_bench
from specdecode.bench import methods as bench_methods
from specdecode.bench.datasets import Prompt
from specdecode.errors import InvalidArgumentError


def test_resume_after_interrupt_skips_finished_records(generator, tmp_path, monkeypatch):
    methods = ["hf-generate", "autoregressive", "draft"]
    settings = BenchSettings(**SMALL)
    full_runs: list[tuple[str, tuple[int, ...]]] = []
    original = bench_methods._SpecdecodeRunner.__call__
    hf_original = bench_methods._HFRunner.__call__
    second_prompt = tuple(generator.encode(PROMPTS[1].text)[0].tolist())

    def interrupting(self, input_ids, max_new_tokens, seed, prefix=None):
        if self.name == "autoregressive" and tuple(input_ids[0].tolist()) == second_prompt:
            raise KeyboardInterrupt  # Ctrl-C in the middle of prompt 2
        return original(self, input_ids, max_new_tokens, seed, prefix)

    monkeypatch.setattr(bench_methods._SpecdecodeRunner, "__call__", interrupting)
    with pytest.raises(KeyboardInterrupt):
        run_bench(generator, PROMPTS, methods, settings, tmp_path)
    kept = _lines(tmp_path / "records.jsonl")
    assert [(r["method"], r["prompt_id"]) for r in kept] == [
        ("hf-generate", "t/1"), ("autoregressive", "t/1"), ("draft", "t/1"), ("hf-generate", "t/2")]
    assert not (tmp_path / "results.json").exists()

    def spy(original_call):
        def call(self, input_ids, max_new_tokens, seed, prefix=None):
            if max_new_tokens == settings.max_new_tokens:  # not a warm-up
                full_runs.append((self.name, tuple(input_ids[0].tolist())))
            return original_call(self, input_ids, max_new_tokens, seed, prefix)
        return call

    monkeypatch.setattr(bench_methods._SpecdecodeRunner, "__call__", spy(original))
    monkeypatch.setattr(bench_methods._HFRunner, "__call__", spy(hf_original))
    results = run_bench(generator, PROMPTS, methods, settings, tmp_path)
    assert full_runs == [("autoregressive", second_prompt), ("draft", second_prompt)]
    lines = _lines(tmp_path / "records.jsonl")
    keys = [(r["method"], r["prompt_id"], r["repeat"]) for r in lines]
    assert len(keys) == len(set(keys)) == 6
    assert lines[:4] == kept  # finished records untouched
    assert len(results["records"]) == 6
    reported = {(r["method"], r["prompt_id"]): r["seconds"] for r in results["records"]}
    assert all(reported[(r["method"], r["prompt_id"])] == r["seconds"] for r in kept)  # not re-timed

    # a third run has nothing left to do, and adding a repeat runs only the new repeat
    full_runs.clear()
    run_bench(generator, PROMPTS, methods, settings, tmp_path)
    assert full_runs == []
    run_bench(generator, PROMPTS, methods, BenchSettings(**SMALL, repeats=2), tmp_path)
    assert len(full_runs) == 6
    assert len(_lines(tmp_path / "records.jsonl")) == 12


def test_torn_last_record_is_dropped(generator, tmp_path):
    run_bench(generator, PROMPTS[:1], ["autoregressive"], BenchSettings(**SMALL), tmp_path)
    path = tmp_path / "records.jsonl"
    good = path.read_text()
    path.write_text(good + '{"method": "hf-gen')  # killed mid-write
    records = bench.RecordStore(tmp_path).load()
    assert len(records) == 1 and path.read_text() == good


@pytest.mark.parametrize(("change", "named"), [
    (dict(max_new_tokens=5), "max_new_tokens: 6 there, 5 now"),
    (dict(temperature=0.7), "temperature: 0.0 there, 0.7 now"),
])
def test_resume_refuses_other_settings(generator, tmp_path, change, named):
    run_bench(generator, PROMPTS[:1], ["autoregressive"], BenchSettings(**SMALL), tmp_path)
    before = (tmp_path / "records.jsonl").read_text()
    with pytest.raises(InvalidArgumentError, match="different settings") as e:
        run_bench(generator, PROMPTS[:1], ["autoregressive"], BenchSettings(**{**SMALL, **change}), tmp_path)
    assert named in str(e.value)
    assert (tmp_path / "records.jsonl").read_text() == before


def test_resume_refuses_a_prompt_that_encodes_differently(generator, tmp_path):
    run_bench(generator, PROMPTS[:1], ["autoregressive"], BenchSettings(**SMALL), tmp_path)
    edited = Prompt("t/1", "code", "w5 w6")  # same id, other text (or another --chat setting)
    with pytest.raises(InvalidArgumentError, match="'t/1' now encodes to different tokens"):
        run_bench(generator, [edited], ["autoregressive"], BenchSettings(**SMALL), tmp_path)


def test_resume_refuses_other_model(generator, target_only, tmp_path):
    run_bench(generator, PROMPTS[:1], ["autoregressive"], BenchSettings(**SMALL), tmp_path)
    with pytest.raises(InvalidArgumentError, match="draft: 'tiny-draft' there, None now"):
        run_bench(target_only, PROMPTS[:1], ["autoregressive"], BenchSettings(**SMALL), tmp_path)


def test_an_int4_draft_head_is_named_and_an_int8_head_keeps_old_folders_resumable(tmp_path):
    """Before the int4 LM head every quantized head was int8: only an int4 head enters the identity."""
    from conftest import make_tiny_model, make_tiny_tokenizer
    from specdecode.models import LoadedModel
    from specdecode.models.quantize import quantize_model
    from specdecode.pipeline import SpeculativeGenerator

    tok = make_tiny_tokenizer()
    target = LoadedModel(make_tiny_model("qwen2", 2, seed=0), tok, "tiny-target")
    identities = {}
    for head in ("int8", "int4"):
        draft = make_tiny_model("qwen2", 2, seed=0)
        quantize_model(draft, "int4", head)
        gen = SpeculativeGenerator(target, LoadedModel(draft, tok, "tiny-draft"))
        identities[head] = bench.run_identity(gen, BenchSettings(**SMALL))
    old, new = identities["int8"], identities["int4"]
    assert old["draft_quantize"] == new["draft_quantize"] == "int4"
    assert "draft_quantize_head" not in old and "quantize_head" not in old  # as the identity before the option
    assert new["draft_quantize_head"] == "int4" and {k: v for k, v in new.items() if k != "draft_quantize_head"} == old
    store = bench.RecordStore(tmp_path)
    assert store.check_settings(old) is False and store.check_settings(old) is True  # resumes with the int8 head
    with pytest.raises(InvalidArgumentError) as refused:
        store.check_settings(new)  # another draft model: not mixed into the old folder's records
    assert str(refused.value).endswith(
        "(draft_quantize_head: None there, 'int4' now); resume with the same settings or use another --out folder; "
        "folders made before the int4 LM head (an int4 draft, from --draft-quantize int4 or --quantize int4) resume "
        "with --draft-quantize-head int8"
    )
    # the hint is for that change alone
    other = bench.RecordStore(tmp_path / "other")
    other.check_settings(new)
    with pytest.raises(InvalidArgumentError, match=r"draft_quantize_head: 'int4' there, None now\); resume with the "
                                                   r"same settings or use another --out folder$"):
        other.check_settings(old)


def test_an_int4_group_size_other_than_32_is_named_and_32_keeps_old_folders_resumable(tmp_path):
    """Before the group size could be chosen every int4 model had groups of 32: only another size enters the
    identity, and a folder made at one size does not resume at another."""
    from conftest import make_tiny_model, make_tiny_tokenizer
    from specdecode.models import LoadedModel
    from specdecode.models.quantize import quantize_model
    from specdecode.pipeline import SpeculativeGenerator

    tok = make_tiny_tokenizer()

    def identity(target_group: int | None, draft_group: int | None) -> dict:
        models = []
        for group, name in ((target_group, "tiny-target"), (draft_group, "tiny-draft")):
            model = make_tiny_model("qwen2", 2, seed=0)
            if group is not None:  # int8 heads: an int4 head would stay int8 at 64 here (32 inputs), at 32 not
                quantize_model(model, "int4", "int8", group)
            models.append(LoadedModel(model, tok, name))
        return bench.run_identity(SpeculativeGenerator(*models), BenchSettings(**SMALL))

    old, new = identity(32, 32), identity(64, 64)
    assert old["quantize"] == new["quantize"] == "int4" and "quantize_group_size" not in old
    assert new["quantize_group_size"] == 64 and {k: v for k, v in new.items() if k != "quantize_group_size"} == old
    assert "quantize_group_size" not in identity(None, 32)
    assert identity(None, 128)["quantize_group_size"] == 128  # an int4 draft alone (generate's default on CPU)
    assert identity(64, 128)["quantize_group_size"] == {"target": 64, "draft": 128}  # grouped apart: by role
    store = bench.RecordStore(tmp_path)
    assert store.check_settings(old) is False and store.check_settings(old) is True
    with pytest.raises(InvalidArgumentError, match=r"\(quantize_group_size: None there, 64 now\); resume with the same "
                                                   r"settings or use another --out folder$"):
        store.check_settings(new)
    other = bench.RecordStore(tmp_path / "other")
    other.check_settings(new)
    with pytest.raises(InvalidArgumentError, match=r"\(quantize_group_size: 64 there, 128 now\)"):
        other.check_settings(identity(128, 128))


def test_a_folder_that_cannot_be_written_is_named(tmp_path):
    """'bench --out' under a file (or in /proc) ended in a FileNotFoundError traceback."""
    (tmp_path / "a-file").write_text("x")
    store = bench.RecordStore(tmp_path / "a-file" / "out")
    with pytest.raises(InvalidArgumentError, match=r"cannot write the results folder '.*a-file/out': Not a directory; "
                                                   r"pass a writable --out folder"):
        store.check_settings({"target": "tiny"})
