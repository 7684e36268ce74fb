"""``bench`` with processors (issue 31): every specdecode method gets them and gives the same
tokens as target-only decoding with them; transformers' methods take their own repetition
penalty and min_p and are left out of a run with the OpenAI penalties or logit_bias."""

from __future__ import annotations

import json

import pytest

from bench_helpers import PROMPTS, SMALL, generator  # noqa: F401
from specdecode.bench import BenchSettings, run_bench
from specdecode.bench.methods import resolve_methods
from specdecode.cli import main
from specdecode.config import GenerationConfig
from specdecode.errors import InvalidArgumentError


def test_processors_reach_every_specdecode_method(generator, tmp_path):
    methods = ["autoregressive", "draft", "cascade", "prompt-lookup"]
    options = dict(frequency_penalty=1.5, repetition_penalty=1.3, logit_bias={9: 3.0})
    settings = BenchSettings(max_new_tokens=12, warmup_tokens=2, **options)
    results = run_bench(generator, PROMPTS, methods, settings, tmp_path / "p")
    changed = 0
    for r in results["records"]:
        prompt = next(p for p in PROMPTS if p.id == r["prompt_id"])
        ids = generator.encode(prompt.text, prompt.chat)
        want = generator.decoder("autoregressive").generate(ids, GenerationConfig(max_new_tokens=12, **options))
        plain = generator.decoder("autoregressive").generate(ids, GenerationConfig(max_new_tokens=12))
        assert r["token_ids"] == want.token_ids, r["method"]
        changed += want.token_ids != plain.token_ids
    assert changed
    stored = json.loads((tmp_path / "p" / "settings.json").read_text())["identity"]
    assert stored["frequency_penalty"] == 1.5 and stored["logit_bias"] == {"9": 3.0}
    assert "min_p" not in stored  # only the processors that are on are recorded


def test_transformers_methods_take_their_own_processors_only(generator):
    settings = BenchSettings(**SMALL, presence_penalty=1.0)
    with pytest.raises(InvalidArgumentError, match="'hf-generate' has no presence_penalty"):
        resolve_methods(generator, ["hf-generate", "autoregressive"], settings)
    runners, _ = resolve_methods(generator, ["hf-generate"], BenchSettings(**SMALL, repetition_penalty=1.2))
    assert runners["hf-generate"].generation_config(4).repetition_penalty == 1.2


def test_bad_processor_flags_are_refused(tmp_path, capsys):
    code = main(["bench", "--presence-penalty", "9", "--out", str(tmp_path / "o")])
    assert code == 2 and "presence_penalty must be a number in [-2, 2] (0 = off), got 9.0" in capsys.readouterr().err
    code = main(["bench", "--logit-bias", "x=1", "--out", str(tmp_path / "o")])
    assert code == 2 and "--logit-bias takes ID=BIAS" in capsys.readouterr().err
