"""The dense cache: a de-quantized model saved once (safetensors + config + tokenizer), written atomically.

transformers loads a GGUF file by de-quantizing it to dense weights, which takes
45-95 s on a 2-core CPU. The first load therefore writes a dense copy to the
cache folder, and later loads read that in seconds. Every file is written under a
temporary name and renamed into place only once complete, so an interrupted run
never leaves a file that a later run trusts.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import PreTrainedModel

from specdecode.files import write_atomic
from specdecode.models.quantize import INT4_GROUP_SIZE, QUANTIZER_VERSION

CACHE_FORMAT_VERSION = 1


def dense_dir(cache_dir: Path, key: str, dtype: torch.dtype) -> Path:
    """The dense copy's folder for model ``key`` in ``dtype`` under ``cache_dir``."""
    return cache_dir / "dense" / f"{key}-{str(dtype).removeprefix('torch.')}"


def write_dense_cache(model: PreTrainedModel, tokenizer, folder: Path, meta: dict) -> None:
    """Write safetensors weights + config + tokenizer into ``folder``, atomically."""
    from safetensors.torch import save_model

    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".partial", dir=folder.parent))
    try:
        save_model(model, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config["dtype"] = str(model.dtype).removeprefix("torch.")
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "specdecode.json").write_text(json.dumps({**meta, "format": CACHE_FORMAT_VERSION}, indent=2))
        if folder.exists():  # another process finished first; theirs is as good as ours
            return
        os.replace(tmp, folder)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def dense_cache_valid(folder: Path) -> bool:
    """Whether ``folder`` holds a complete dense copy written by this cache format."""
    try:
        meta = json.loads((folder / "specdecode.json").read_text())
    except (OSError, ValueError):
        return False
    return meta.get("format") == CACHE_FORMAT_VERSION and (folder / "model.safetensors").is_file()


def quantized_path(folder: Path, scheme: str, head: str = "int8", group_size: int = INT4_GROUP_SIZE) -> Path:
    """Where the dense copy in ``folder`` keeps its ``scheme`` ("int8" / "int4") quantized weights.

    ``head`` is the LM head's storage asked for (``quantized_tensors``'s ``head``): the default
    "int8" keeps the file name it always had (``quantized-int4.safetensors``), an int4 head
    has a file of its own (``quantized-int4-head-int4.safetensors``), so a target (int8 head)
    and a draft (int4 head) of one model never read each other's. Likewise ``group_size``
    (the int4 group size, ``quantized_tensors``'s): the default 32 keeps the names above,
    another has files of its own (``quantized-int4-g64.safetensors``,
    ``quantized-int4-head-int4-g64.safetensors``).
    """
    suffix = ("" if head == "int8" else f"-head-{head}") + ("" if group_size == INT4_GROUP_SIZE else f"-g{group_size}")
    return folder / f"quantized-{scheme}{suffix}.safetensors"


def read_quantized(folder: Path, scheme: str, head: str = "int8",
                   group_size: int = INT4_GROUP_SIZE) -> dict[str, torch.Tensor] | None:
    """The cached quantized weights of the dense copy in ``folder``, or None when absent or stale.

    A file whose metadata names another scheme, quantizer version, head or int4 group size
    is stale (a file written before the head was recorded has an int8 head, one written
    before the group size was recorded groups of 32).
    """
    from safetensors import safe_open

    path = quantized_path(folder, scheme, head, group_size)
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if (meta.get("format") != str(CACHE_FORMAT_VERSION) or meta.get("scheme") != scheme
                    or meta.get("quantizer") != str(QUANTIZER_VERSION) or meta.get("head", "int8") != head
                    or meta.get("group_size", str(INT4_GROUP_SIZE)) != str(group_size)):
                return None  # written by another version of the quantizer: quantize again
            # Each tensor is copied out of the file's memory map, one at a time, so the mapping
            # (which would stay resident beside the copies) closes with the file.
            return {name: f.get_tensor(name).clone() for name in f.keys()}
    except (OSError, ValueError, RuntimeError):
        return None


def write_quantized(folder: Path, scheme: str, tensors: dict[str, torch.Tensor], head: str = "int8",
                    group_size: int = INT4_GROUP_SIZE) -> None:
    """Save quantized weights (made with LM head storage ``head`` and int4 groups of ``group_size``) next to
    the dense copy in ``folder``, atomically. The metadata records the group size of int4 files."""
    from safetensors.torch import save_file

    meta = {"format": str(CACHE_FORMAT_VERSION), "scheme": scheme, "quantizer": str(QUANTIZER_VERSION), "head": head,
            **({"group_size": str(group_size)} if scheme == "int4" else {})}
    write_atomic(quantized_path(folder, scheme, head, group_size),
                 lambda tmp: save_file(tensors, str(tmp), metadata=meta))
