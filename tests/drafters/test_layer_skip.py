"""Layer-skip (Draft & Verify) drafting: skip sets, draft mode, the shared cache, exactness."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import make_tiny_model
from selfspec_helpers import (
    CacheCheckingDrafter,
    autoregressive,
    exact_marginals,
    one_thread,  # noqa: F401  (fixture)
    prompt_ids,
    sample_counts,
    violations,
)
from specdecode import GenerationConfig, InvalidArgumentError, SpeculativeDecoder
from specdecode.drafters.layer_skip import LayerSkipDrafter, SkipSet, decoder_layers, draft_mode

pytestmark = pytest.mark.usefixtures("one_thread")

# ---------------------------------------------------------------- skip sets


def test_skip_set_parse():
    s = SkipSet.parse("attn=15,2,18;mlp=2,15,18")
    assert s == SkipSet(attn=(2, 15, 18), mlp=(2, 15, 18))
    assert s.attn == (2, 15, 18)  # sorted
    assert SkipSet.parse(" mlp = 3 , 1 ") == SkipSet(mlp=(1, 3))
    assert SkipSet.parse("attn=4;mlp=") == SkipSet(attn=(4,))
    assert SkipSet.parse(str(s)) == s
    assert s.to_dict() == {"attn": [2, 15, 18], "mlp": [2, 15, 18]}


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "skip set text is empty"),
        ("attn=1;ffn=2", "part 'ffn=2' must be 'attn=i,j,...'"),
        ("attn 1,2", "part 'attn 1,2' must be"),
        ("attn=1,x", "'x' in 'attn' is not an integer"),
        ("attn=1;attn=2", "'attn' is given twice"),
        ("attn=1,2,1", "'attn' repeats layer index 1"),
        ("mlp=-1", "layer index -1; indices must be >= 0 (allowed 0..L-1)"),
        ("attn=;mlp=", "the skip set is empty"),
    ],
)
def test_skip_set_parse_errors(text, message):
    with pytest.raises(InvalidArgumentError) as e:
        SkipSet.parse(text)
    assert message in str(e.value)


def test_skip_set_range_is_checked_against_the_model():
    model = make_tiny_model("llama", num_layers=4)
    SkipSet(attn=(0, 3)).check(4)
    with pytest.raises(InvalidArgumentError, match=r"'mlp' has layer index 4, out of range: the model has 4 "
                       r"decoder layers, allowed 0\.\.3"):
        LayerSkipDrafter(model, SkipSet(attn=(1,), mlp=(4,)))
    with pytest.raises(InvalidArgumentError, match=r"allowed 0\.\.3"):
        with draft_mode(model, SkipSet(attn=(9,))):
            pass


def test_skip_set_json(tmp_path):
    full = tmp_path / "result.json"
    full.write_text(json.dumps({"model": "x", "gamma": 4, "dtype": "float32", "measured": {"tps": 1.0},
                                "skip_set": {"attn": [3, 1], "mlp": [2]}}))
    assert SkipSet.from_json(full) == SkipSet(attn=(1, 3), mlp=(2,))
    bare = tmp_path / "bare.json"
    bare.write_text('{"attn": [0], "mlp": []}')
    assert SkipSet.from_json(str(bare)) == SkipSet(attn=(0,))

    cases = {
        "bad.json": ("{not json", "is not valid JSON: Expecting property name"),
        "nolists.json": ('{"model": "x"}', 'needs "attn" and/or "mlp"'),
        "unknown.json": ('{"skip_set": {"attn": [1], "ffn": [2]}}', "unknown key(s) ['ffn']"),
        "notint.json": ('{"attn": [1, "2"]}', "integer layer indices, got '2'"),
        "notlist.json": ('{"attn": 3}', "must be a list of layer indices, got 3"),
        "dup.json": ('{"mlp": [2, 2]}', "repeats layer index 2"),
    }
    for name, (text, message) in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(InvalidArgumentError) as e:
            SkipSet.from_json(tmp_path / name)
        assert message in str(e.value) and name in str(e.value), str(e.value)
    with pytest.raises(InvalidArgumentError, match="cannot read skip-set file"):
        SkipSet.from_json(tmp_path / "missing.json")


# ---------------------------------------------------------------- draft mode


def _layer_io(model, index, ids, cache=None):
    """(input, output) hidden states of decoder layer ``index`` in one forward, and the logits."""
    seen = {}

    def hook(module, args, kwargs, output):
        seen["in"] = (args[0] if args else kwargs["hidden_states"]).clone()
        seen["out"] = (output[0] if isinstance(output, tuple) else output).clone()

    handle = decoder_layers(model)[index].register_forward_hook(hook, with_kwargs=True)
    try:
        with torch.inference_mode():
            logits = model(ids, past_key_values=cache, use_cache=cache is not None).logits
    finally:
        handle.remove()
    return seen["in"], seen["out"], logits


def test_skipped_sublayers_contribute_nothing(arch):
    """Zero attention and zero MLP outputs leave the residual stream unchanged, post-norms
    (Gemma 2/3) included: nesting an attention-only and an MLP-only skip of layer 1 makes the
    layer the identity, and equals bypassing the layer whole."""
    model = make_tiny_model(arch, num_layers=3)
    ids = prompt_ids(9, 0)
    _, _, full_logits = _layer_io(model, 1, ids)
    with draft_mode(model, SkipSet(mlp=(1,))), draft_mode(model, SkipSet(attn=(1,))):
        h_in, h_out, nested_logits = _layer_io(model, 1, ids)
    assert torch.equal(h_in, h_out)
    with draft_mode(model, SkipSet(attn=(1,), mlp=(1,))):
        _, _, bypass_logits = _layer_io(model, 1, ids)
    assert torch.equal(nested_logits, bypass_logits)
    assert not torch.allclose(nested_logits, full_logits, atol=1e-3)  # the skip does something
    # Only one sublayer skipped: the layer is neither the identity nor the full layer.
    with draft_mode(model, SkipSet(attn=(1,))):
        a_in, a_out, attn_logits = _layer_io(model, 1, ids)
    with draft_mode(model, SkipSet(mlp=(1,))):
        _, _, mlp_logits = _layer_io(model, 1, ids)
    assert not torch.equal(a_in, a_out)
    for logits in (attn_logits, mlp_logits):
        assert not torch.allclose(logits, full_logits, atol=1e-3)
        assert not torch.allclose(logits, nested_logits, atol=1e-3)


def test_draft_mode_keeps_cache_layers_equal_length(arch):
    from specdecode.engine.kv_cache import new_cache

    model = make_tiny_model(arch, num_layers=4)
    cache = new_cache(model)
    with torch.inference_mode():
        model(prompt_ids(5, 1), past_key_values=cache, use_cache=True)
        with draft_mode(model, SkipSet(attn=(0, 2), mlp=(2, 3))):
            for _ in range(4):
                model(prompt_ids(2, 2), past_key_values=cache, use_cache=True)
    assert [layer.get_seq_length() for layer in cache.layers] == [13] * 4
    # also when draft mode writes first, into an empty cache (placeholder shape from the config)
    empty = new_cache(model)
    with torch.inference_mode():
        with draft_mode(model, SkipSet(attn=(0,), mlp=(0, 3))):
            model(prompt_ids(3, 3), past_key_values=empty, use_cache=True)
        model(prompt_ids(1, 4), past_key_values=empty, use_cache=True)
    assert [layer.get_seq_length() for layer in empty.layers] == [4] * 4
    b, h, _, d = cache.layers[0].keys.shape
    assert (empty.layers[0].keys.shape[:2], empty.layers[0].keys.shape[3]) == ((b, h), d)


def test_draft_mode_restores_forwards_even_on_error():
    model = make_tiny_model("gemma2", num_layers=3)
    ids = prompt_ids(5, 3)
    with torch.inference_mode():
        before = model(ids).logits
    layers = decoder_layers(model)
    originals = [(l.forward, l.self_attn.forward, l.mlp.forward) for l in layers]
    with pytest.raises(RuntimeError, match="boom"):
        with draft_mode(model, SkipSet(attn=(0, 1), mlp=(1, 2))):
            assert "forward" in layers[1].__dict__ and "forward" in layers[0].self_attn.__dict__
            raise RuntimeError("boom")
    for layer, (f, a, m) in zip(layers, originals):
        for module in (layer, layer.self_attn, layer.mlp):
            assert "forward" not in module.__dict__
        assert (layer.forward, layer.self_attn.forward, layer.mlp.forward) == (f, a, m)
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, before)


# ---------------------------------------------------------------- the drafter and the shared cache

SKIP_SETS = {
    "many": SkipSet(attn=(0, 1, 2), mlp=(1, 2, 3)),
    "few": SkipSet(attn=(2,)),
    "attn-only": SkipSet(attn=(1, 3)),
    "mlp-only": SkipSet(mlp=(0, 2)),
}


@pytest.mark.parametrize("gamma", [3, 8])
def test_propose_leaves_target_cache_unchanged(arch, gamma):
    """Sequences run well past the sliding window (6): draft blocks straddle it."""
    model = make_tiny_model(arch, num_layers=4)
    for name in ("many", "attn-only"):
        drafter = CacheCheckingDrafter(LayerSkipDrafter(model, SKIP_SETS[name]))
        config = GenerationConfig(max_new_tokens=30, num_speculative_tokens=gamma, stop_on_eos=False)
        result = SpeculativeDecoder(model, drafter).generate(prompt_ids(8, 4), config)
        assert drafter.checked == result.stats.num_draft_blocks > 3
        assert result.token_ids == autoregressive(model, prompt_ids(8, 4), config)


def test_cache_after_round_equals_fresh_forward():
    """After each round the shared cache holds exactly the full model's entries for the confirmed
    tokens (slot 0 of the one-row engine's batch cache; drafted positions past them are overwritten)."""
    from specdecode.engine.kv_cache import new_cache

    model = make_tiny_model("gemma3", num_layers=4)
    config = GenerationConfig(max_new_tokens=40, num_speculative_tokens=5, stop_on_eos=False)
    dec = SpeculativeDecoder(model, LayerSkipDrafter(model, SKIP_SETS["attn-only"]))
    stream = dec.stream(prompt_ids(4, 5), config)
    rounds = iter(stream)
    next(rounds)
    for _ in range(6):
        next(rounds)
        confirmed = stream._row.tokens[:-1]
        n = len(confirmed)
        fresh = new_cache(model)
        with torch.inference_mode():
            model(torch.tensor([confirmed]), past_key_values=fresh, use_cache=True)
        fresh.crop(0)
        for got, want in zip(dec._engine.cache.layers, fresh.layers):
            kept = want.keys.shape[-2]  # a trimmed sliding layer keeps the last ones
            torch.testing.assert_close(got.keys[:1, :, n - kept : n], want.keys, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got.values[:1, :, n - kept : n], want.values, rtol=1e-5, atol=1e-5)
    assert 0 < stream.stats.acceptance_rate < 1


@pytest.mark.parametrize("gamma", [1, 3, 8])
def test_greedy_equals_autoregressive(arch, gamma):
    model = make_tiny_model(arch, num_layers=4)
    rates = []
    for seed, length in [(gamma, 5)]:  # 5 + 20 tokens: the sliding window (6) is crossed while decoding
        prompt = prompt_ids(length, seed)
        config = GenerationConfig(max_new_tokens=20, num_speculative_tokens=gamma, stop_on_eos=False)
        expected = autoregressive(model, prompt, config)
        for name, skip_set in SKIP_SETS.items():
            result = SpeculativeDecoder(model, LayerSkipDrafter(model, skip_set)).generate(prompt, config)
            assert result.token_ids == expected, (arch, gamma, name, seed)
            assert result.stats.num_draft_forwards >= result.stats.num_drafted_tokens > 0
            rates.append(result.stats.acceptance_rate)
    assert any(0 < r < 1 for r in rates), rates  # some drafts accepted, some rejected


def test_bind_rejects_a_foreign_cache():
    from specdecode.engine.batch_cache import BatchKVCache

    drafter = LayerSkipDrafter(make_tiny_model("llama", num_layers=4), SkipSet(attn=(1,)))
    with pytest.raises(InvalidArgumentError, match="layer-skip drafter must wrap the batched decoder's own target "
                                                   "model: its cache belongs to another model"):
        drafter.bind(BatchKVCache(make_tiny_model("llama", num_layers=4), 1, 16))


# ---------------------------------------------------------------- speculative sampling keeps the target law

V_SMALL = 8
PROMPT = [1, 5, 3, 6]
N_SAMPLES = 600


@pytest.fixture(scope="module")
def small_model():
    return make_tiny_model("llama", num_layers=2, vocab_size=V_SMALL, seed=1)


SAMPLING = {
    "t1": dict(temperature=1.0),
    "t0.8-topk6-topp0.9": dict(temperature=0.8, top_k=6, top_p=0.9),
}


@pytest.mark.parametrize("name", list(SAMPLING))
def test_sampling_preserves_target_distribution(small_model, name):
    """Marginals of tokens 1-3 and the joint of tokens 1-2 match the exact target law; tokens
    2-3 come from one draft block (k = 2 with 4 new tokens: room for the bonus), so acceptance,
    residual and bonus draws at both block positions all count."""
    skip = SkipSet(attn=(1,), mlp=(0,))
    config = GenerationConfig(max_new_tokens=4, num_speculative_tokens=3, stop_on_eos=False, **SAMPLING[name])
    exact = exact_marginals(small_model, PROMPT, config, V_SMALL)
    with draft_mode(small_model, skip):
        draft_law = exact_marginals(small_model, PROMPT, config, V_SMALL)
    assert (draft_law["x2"] - exact["x2"]).abs().max() > 0.05  # the draft is a different model
    dec = SpeculativeDecoder(small_model, LayerSkipDrafter(small_model, skip))
    freq = sample_counts(dec, PROMPT, config, N_SAMPLES, V_SMALL)
    assert violations(exact, freq, N_SAMPLES) == []


def test_sampling_check_catches_sampling_from_the_draft(small_model, monkeypatch):
    """Negative control: a verifier that accepts every draft token makes tokens 2-3 follow the
    draft's law, and the same check with the same sample size flags it."""
    skip = SkipSet(attn=(1,), mlp=(0,))
    config = GenerationConfig(max_new_tokens=4, num_speculative_tokens=3, stop_on_eos=False, temperature=1.0)
    exact = exact_marginals(small_model, PROMPT, config, V_SMALL)

    def accept_all(samplers, probs, drafted, num_tokens, draft_probs, contain_errors=False, cut=None):
        tokens = [s.sample(probs[j, k : k + 1]) for j, (s, k) in enumerate(zip(samplers, num_tokens))]
        return torch.stack([torch.tensor(num_tokens), torch.cat(tokens)], dim=1), {}

    monkeypatch.setattr("specdecode.engine.verification.rejection_sample_rows", accept_all)  # in sample_rows
    dec = SpeculativeDecoder(small_model, LayerSkipDrafter(small_model, skip))
    freq = sample_counts(dec, PROMPT, config, N_SAMPLES, V_SMALL)
    bad = violations(exact, freq, N_SAMPLES)
    assert any(b.startswith("x2") for b in bad) and any(b.startswith("x3") for b in bad), bad
    assert not any(b.startswith("x1[") for b in bad), bad  # token 1 still comes from the target's prefill
