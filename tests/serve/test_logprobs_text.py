"""Logprobs' token texts (``openai_format.logprobs_json``): what each token adds to the returned text,
decoded in context, so that the tokens join to the text, also where a UTF-8 character is split over
tokens; chat's ``bytes`` are each token's own bytes, which join to the text's UTF-8. Before, a token's
text was its own decode: U+FFFD for each half of a split character ("h", "\ufffd", "\ufffd", "llo" for
"héllo"), and "w40" where the token adds " w40"."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

from specdecode.engine.processors import TokenLogprob
from specdecode.serve.openai_format import LogprobsMismatchError, logprobs_json, token_bytes
from specdecode.serve.text import TextAssembler

TEXT = "héllo wörld"


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """GPT-2 style byte-level BPE without merges (Qwen's kind of tokenizer): every byte is a token, so 'é' is
    two tokens, 'Ã' (0xC3) and '©' (0xA9)."""
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    vocab.update({c: b + 3 for b, c in bytes_to_unicode().items()})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def byte_fallback_tokenizer() -> PreTrainedTokenizerFast:
    """SentencePiece style (Llama 2's, Gemma's decoder): pieces with '▁' for a space, and byte tokens <0xNN>
    for what no piece covers."""
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<0xC3>": 3, "<0xA9>": 4, "<0xA8>": 5, "▁h": 6, "llo": 7}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<pad>"))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def entries(ids: list[int], top: dict[int, list[int]] | None = None) -> list[TokenLogprob]:
    top = top or {}
    return [TokenLogprob(t, -0.5, tuple((a, -1.0) for a in top.get(i, []))) for i, t in enumerate(ids)]


def test_a_character_split_over_two_byte_level_tokens_is_carried_by_the_token_completing_it():
    tok = byte_level_tokenizer()
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert len(ids) == len(TEXT.encode()) == 13 and tok.decode([ids[1]]) == "\ufffd"  # the case at hand
    got = logprobs_json(False, entries(ids), tok)
    assert "".join(got["tokens"]) == TEXT  # it was "h\ufffd\ufffdllo w\ufffd\ufffdrld"
    assert got["tokens"][:4] == ["h", "", "é", "l"]
    assert got["text_offset"][:4] == [0, 1, 1, 2]
    assert all(TEXT[o:o + len(t)] == t for o, t in zip(got["text_offset"], got["tokens"]))


def test_chat_bytes_are_each_token_s_own_and_join_to_the_text_s_utf8():
    tok = byte_level_tokenizer()
    ids = tok.encode(TEXT, add_special_tokens=False)
    content = logprobs_json(True, entries(ids), tok)["content"]
    assert "".join(c["token"] for c in content) == TEXT
    assert [c["bytes"] for c in content[:3]] == [[0x68], [0xC3], [0xA9]]  # were U+FFFD's [239, 191, 189] twice
    assert b"".join(bytes(c["bytes"]) for c in content) == TEXT.encode()


def test_byte_fallback_tokens_give_their_byte_and_a_space_piece_its_space():
    tok = byte_fallback_tokenizer()
    ids = [6, 3, 4, 7]  # "▁h", <0xC3>, <0xA9>, "llo"
    text = tok.decode(ids, skip_special_tokens=True)
    assert text == " héllo"
    content = logprobs_json(True, entries(ids), tok)["content"]
    assert [c["token"] for c in content] == [" h", "", "é", "llo"]
    assert [c["bytes"] for c in content] == [list(b" h"), [0xC3], [0xA9], list(b"llo")]
    assert token_bytes(tok, 5) == b"\xa8"


def test_top_tokens_are_what_they_would_add_in_the_same_place():
    """After <0xC3>, <0xA9> would complete 'é' and <0xA8> 'è': each top token's text is the character it
    completes, as the chosen token's is (so the chosen token is found among them by its text)."""
    tok = byte_fallback_tokenizer()
    ids = [6, 3, 4]
    got = logprobs_json(False, entries(ids, {1: [3, 6], 2: [4, 5]}), tok)
    assert got["tokens"] == [" h", "", "é"]
    assert got["top_logprobs"][1] == {"": -1.0, " h": -1.0}  # <0xC3> alone adds nothing yet
    assert got["top_logprobs"][2] == {"é": -1.0, "è": -1.0}
    chat = logprobs_json(True, entries(ids, {2: [4, 5]}), tok)["content"][2]["top_logprobs"]
    assert [(t["token"], t["bytes"]) for t in chat] == [("é", [0xA9]), ("è", [0xA8])]


def test_a_stream_s_chunks_give_the_whole_completion_s_token_texts():
    """Chunk by chunk (split between the two halves of 'é' and 'ö'), the token texts and offsets are those of
    the whole completion decoded at once."""
    tok = byte_level_tokenizer()
    ids = tok.encode(TEXT, add_special_tokens=False)
    whole = logprobs_json(False, entries(ids), tok)
    assembler = TextAssembler(tok, offsets=True)
    chunks, sent = [], 0
    for cut in (2, 5, 9, 13):
        assembler.push(ids[sent:cut], final=cut == len(ids))
        chunks.append(logprobs_json(False, entries(ids)[sent:cut], tok, assembler.tokens[sent:cut]))
        sent = cut
    assert [t for c in chunks for t in c["tokens"]] == whole["tokens"]
    assert [o for c in chunks for o in c["text_offset"]] == whole["text_offset"]
    assert assembler.text == TEXT


def test_a_character_cut_off_at_the_end_shows_as_the_text_does():
    """A completion that ends between the bytes of a character: its text ends in U+FFFD, and so do the tokens."""
    tok = byte_level_tokenizer()
    ids = tok.encode("hé", add_special_tokens=False)[:2]
    text = tok.decode(ids, skip_special_tokens=True)
    assert text == "h\ufffd"
    assert "".join(logprobs_json(False, entries(ids), tok)["tokens"]) == text


def test_logprobs_of_other_tokens_are_refused_as_an_internal_error():
    tok = byte_level_tokenizer()
    ids = tok.encode(TEXT, add_special_tokens=False)
    assembler = TextAssembler(tok, offsets=True)
    assembler.push(ids, final=True)
    with pytest.raises(LogprobsMismatchError, match="12 logprobs .* for 13 tokens"):
        logprobs_json(False, entries(ids[:-1]), tok, assembler.tokens)
    with pytest.raises(LogprobsMismatchError, match="13 logprobs"):
        logprobs_json(True, entries([*ids[:-1], 5]), tok, assembler.tokens)


# --- through the server: a tiny model whose greedy output holds a character split over two tokens ------------


@pytest.fixture(scope="module")
def split_character_server(tmp_path_factory):
    """A server over the tiny Llama pair with a byte-level tokenizer made for its greedy output: the first two
    different tokens it emits in a row become the two bytes of 'é' (0xC3 0xA9), every other id an ASCII
    letter or digit. Yields (base URL, prompt ids, greedy ids, tokenizer)."""
    import torch

    from conftest import VOCAB, make_tiny_model
    from helpers import perturbed_copy, save_tiny_folders
    from serve_helpers import running_server
    from specdecode.pipeline import SpeculativeGenerator

    target = make_tiny_model("llama", num_layers=4, seed=2)
    prompt = [10, 7, 14, 14, 17]
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(12):
            ids.append(int(target(torch.tensor([ids])).logits[0, -1].argmax()))
    out = ids[len(prompt):]
    first = next(i for i in range(len(out) - 1) if out[i] != out[i + 1] and min(out[i], out[i + 1]) >= 3)
    ascii_bytes = iter(b"abcdefghijklmnopqrstuvwxyz0123456789ABCDEFGHIJKLMNOP")
    byte_of = {t: next(ascii_bytes) for t in range(3, VOCAB) if t not in out[first:first + 2]}
    byte_of.update({out[first]: 0xC3, out[first + 1]: 0xA9})
    char_of = bytes_to_unicode()
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{char_of[b]: t for t, b in byte_of.items()}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    root = tmp_path_factory.mktemp("split_character")
    t, d = save_tiny_folders(root, tok, target, perturbed_copy(target, noise=0.1, seed=1))
    gen = SpeculativeGenerator.from_pretrained(str(t), str(d), dtype="float32", device="cpu")
    with running_server(gen) as (url, _, _):
        yield url, prompt, out, gen.tokenizer


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_server_s_logprob_tokens_join_to_the_text_across_a_split_character(split_character_server, stream):
    import httpx

    url, prompt, out, tok = split_character_server
    body = {"prompt": prompt, "max_tokens": len(out), "temperature": 0, "logprobs": 1, "stream": stream}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    if stream:
        chunks = [json_line[len("data: "):] for json_line in r.text.splitlines() if json_line.startswith("data: ")]
        assert chunks[-1] == "[DONE]"
        choices = [json.loads(c)["choices"][0] for c in chunks[:-1]]
        text = "".join(c["text"] for c in choices)
        lp = {k: [v for c in choices if c["logprobs"] for v in c["logprobs"][k]] for k in ("tokens", "text_offset",
                                                                                          "top_logprobs")}
    else:
        choice = r.json()["choices"][0]
        text, lp = choice["text"], choice["logprobs"]
    assert text == tok.decode(out, skip_special_tokens=True) and "é" in text  # the case at hand
    assert "".join(lp["tokens"]) == text  # was two U+FFFD for 'é'
    i = text.index("é")
    k = lp["text_offset"].index(i)
    assert lp["tokens"][k:k + 2] == ["", "é"] and lp["text_offset"][k + 1] == i
    assert all(token in top for token, top in zip(lp["tokens"], lp["top_logprobs"]))  # greedy: chosen = top


def test_top_tokens_whose_text_was_not_decoded_are_refused():
    tok = byte_fallback_tokenizer()
    assembler = TextAssembler(tok, offsets=True)
    assembler.push([6, 3], final=True)  # no alternatives given
    with pytest.raises(LogprobsMismatchError, match="the text of top token 7 at token 6 was not decoded"):
        logprobs_json(False, entries([6, 3], {0: [7]}), tok, assembler.tokens)
