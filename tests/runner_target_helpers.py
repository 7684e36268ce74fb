"""A stand-in for a llama.cpp model (target or draft) and llama.cpp's own greedy decoding, for the tests of
models run outside torch (tests/engine/test_runner_target.py, tests/test_llama_cpp_backend.py,
tests/models/test_llama_cpp.py, tests/engine/test_one_engine.py)."""

from __future__ import annotations

import torch

from specdecode.engine.kv_cache import new_cache
from specdecode.models.llama_cpp import LlamaCppModel

#: A prompt whose n-grams repeat, so that prompt lookup drafts.
PROMPT = [1, 5, 9, 11, 5, 9, 17, 23, 5, 9, 30, 12, 5, 9, 11]


class TorchBackedModel:
    """A ``LlamaCppModel`` stand-in running a tiny transformers model on a ``DynamicCache``; ``decode``
    refuses a position that is not the end of what it holds (llama.cpp's own rule)."""

    n_ctx = 1 << 20
    n_ctx_train = 512
    name = "torch-backed"
    role = "target model"
    n_threads = 1

    def __init__(self, model, role: str = "target model"):
        self.model = model
        self.role = role
        self.generation = 0
        self.vocab_size = model.config.vocab_size
        self.cache = new_cache(model)

    def ensure_context(self, num_positions, cached):
        pass

    take_over = LlamaCppModel.take_over  # the real bookkeeping over this stand-in's remove_from and ensure_context

    def remove_from(self, position):
        held = self.cache.get_seq_length()
        if position == 0:
            self.cache = new_cache(self.model)
        elif position < held:
            self.cache.crop(position - held)

    @torch.inference_mode()
    def decode(self, ids, first_position, logits_to_keep):
        held = self.cache.get_seq_length()
        if first_position != held:
            raise AssertionError(f"forward at position {first_position}, but the model holds {held}")
        out = self.model(torch.tensor([ids]), past_key_values=self.cache, use_cache=True,
                         logits_to_keep=logits_to_keep)
        return out.logits[0].float()


def llama_cpp_greedy(path, prompt, n) -> list[int]:
    """llama.cpp's own greedy decoding of ``path`` (llama-cpp-python's ``Llama.generate``, float32 KV cache)."""
    import llama_cpp

    f32 = llama_cpp.GGML_TYPE_F32
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, n_threads=1, n_threads_batch=1, type_k=f32, type_v=f32,
                          verbose=False)
    out = []
    for token in llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
        out.append(int(token))
        if len(out) == n:
            break
    llm.close()
    return out
