"""The results folder of a run: what it is tied to, what it ran on, and its records.

``run_identity`` gives the settings a folder is tied to (stored in ``settings.json``),
``environment`` the machine and versions (stored in ``results.json``), and
``RecordStore`` the append-only ``records.jsonl`` that makes a run resumable.
"""

from __future__ import annotations

import json
import logging
import os
import platform
from collections.abc import Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from specdecode import pipeline
from specdecode.bench.settings import BenchSettings
from specdecode.errors import InvalidArgumentError
from specdecode.files import write_text_atomic
from specdecode.models.quantize import INT4_GROUP_SIZE

logger = logging.getLogger(__name__)

RECORDS_FILE = "records.jsonl"
SETTINGS_FILE = "settings.json"
CPU_FLAGS_OF_INTEREST = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


def run_identity(generator: pipeline.SpeculativeGenerator, settings: BenchSettings) -> dict:
    """The settings a results folder is tied to: records made under other values are not comparable.

    Repeats, prompts and methods are not part of it: a later run may add them.
    """
    model = generator.target.model
    draft_quantize = generator.draft.quantize if generator.draft is not None else "none"
    # Only quantized runs name their quantization, so folders made before it existed still resume.
    quantized = {"quantize": generator.target.quantize, "draft_quantize": draft_quantize}
    # Likewise only an int4 LM head is named (before it existed every quantized head was int8): a
    # folder of an int4 draft with the int8 head resumes with draft_quantize_head="int8"
    # (--draft-quantize-head int8), not with the int4 head, which is another draft model.
    roles = (("quantize_head", generator.target), ("draft_quantize_head", generator.draft))
    heads = {key: "int4" for key, loaded in roles if loaded is not None and loaded.quantize_head == "int4"}
    # And only an int4 group size other than 32 (every int4 model had groups of 32 before it could be
    # chosen). from_pretrained gives the pair's int4 models one size; models grouped apart are named by role.
    sizes = {role: loaded.quantize_group_size for role, loaded in (("target", generator.target),
                                                                   ("draft", generator.draft))
             if loaded is not None and loaded.quantize_group_size is not None}
    distinct = set(sizes.values())
    groups = ({} if distinct <= {INT4_GROUP_SIZE}
              else {"quantize_group_size": distinct.pop() if len(distinct) == 1 else sizes})
    # And only models whose float32 linears run on oneDNN (models.prepacked_linear) say so, by role.
    prepacked = [role for role, loaded in (("target", generator.target), ("draft", generator.draft))
                 if loaded is not None and getattr(loaded, "prepacked", False)]
    return {
        "target": generator.target.name,
        "draft": generator.draft.name if generator.draft is not None else None,
        "dtype": str(model.dtype).removeprefix("torch."),
        **({} if set(quantized.values()) == {"none"} else quantized),
        **heads,
        **groups,
        **({"prepacked_linears": prepacked} if prepacked else {}),
        "device": str(model.device),
        "max_new_tokens": settings.max_new_tokens,
        "temperature": settings.temperature,
        "num_speculative_tokens": settings.num_speculative_tokens,
        "seed": settings.seed,
        "drafter_options": dict(settings.drafter_options),
        "prompt_cache": settings.prompt_cache,
        **settings.banned_words_settings(),
        **settings.processor_settings(),  # [processors] only those on: older folders still resume
        # Only runs that set the fast path name it, so folders made before the setting existed still resume.
        **({"compile": settings.compile} if settings.compile is not None else {}),
        # Likewise only a target run by llama.cpp names its backend (and what decides its numbers).
        **({"backend": generator.backend, **_llama_cpp_target(generator)} if generator.backend != "torch" else {}),
    }


def _llama_cpp_target(generator: pipeline.SpeculativeGenerator) -> dict:
    """What runs a target in llama.cpp: its GGUF file, threads and KV cache type (empty for a torch target)."""
    model = getattr(generator.target.model, "model", None)
    if generator.backend != "llama-cpp" or model is None:
        return {}
    return {"gguf_file": str(getattr(model, "path", None)), "n_threads": getattr(model, "n_threads", None),
            "kv_cache_type": getattr(model, "kv_cache_type", None)}


def environment(generator: pipeline.SpeculativeGenerator) -> dict:
    """Versions, CPU and threads: what a tokens/s number depends on."""
    import transformers

    from specdecode.version import __version__

    cpu_model, flags = None, set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and cpu_model is None:
                    cpu_model = value.strip()
                elif key == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = None
    model = generator.target.model
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "specdecode": __version__,
        "platform": platform.platform(),
        "cpu_model": cpu_model or platform.processor() or None,
        "cpu_flags": {f: f in flags for f in CPU_FLAGS_OF_INTEREST} if flags else None,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": affinity,
        "torch_threads": torch.get_num_threads(),
        "dtype": str(model.dtype).removeprefix("torch."),
        "quantization": {
            role: summary.as_dict()
            for role, loaded in (("target", generator.target), ("draft", generator.draft))
            if loaded is not None and (summary := getattr(loaded.model, "specdecode_quantization", None)) is not None
        },
        "device": str(model.device),
        "cuda_device": torch.cuda.get_device_name(model.device) if model.device.type == "cuda" else None,
        "backend": generator.backend,
        **({"llama_cpp_target": {**_llama_cpp_target(generator), "llama_cpp_python": _llama_cpp_version()}}
           if generator.backend == "llama-cpp" else {}),
    }


def _llama_cpp_version() -> str | None:
    try:
        import llama_cpp
    except ImportError:
        return None
    return getattr(llama_cpp, "__version__", None)


def record_key(record: Mapping[str, Any]) -> tuple[str, str, int]:
    """(method, prompt id, repeat): what makes a record unique."""
    return record["method"], record["prompt_id"], int(record["repeat"])


class RecordStore:
    """``settings.json`` and the append-only ``records.jsonl`` of one results folder.

    Args:
        out_dir: The folder (created on the first write).
    """

    def __init__(self, out_dir: str | Path) -> None:
        self.dir = Path(out_dir)
        self.records_path = self.dir / RECORDS_FILE
        self.settings_path = self.dir / SETTINGS_FILE

    def check_settings(self, identity: Mapping[str, Any]) -> bool:
        """Compare with the folder's stored settings; store them when there are none.

        Returns:
            True when the folder already had (matching) settings, i.e. this run resumes.

        Raises:
            InvalidArgumentError: The folder was made with different settings (listed), or it
                cannot be created or written.
        """
        if self.settings_path.is_file():
            try:
                stored = json.loads(self.settings_path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as e:
                raise InvalidArgumentError(f"cannot read {self.settings_path}: {e}; use another --out folder") from e
            old = stored.get("identity", {})
            diff = [k for k in sorted(set(old) | set(identity)) if old.get(k) != identity.get(k)]
            if diff:
                changes = "; ".join(f"{k}: {old.get(k)!r} there, {identity.get(k)!r} now" for k in diff)
                hint = ""
                if "draft_quantize_head" in diff and old.get("draft_quantize_head") is None:
                    # an int4 draft got the int8 head before the int4 LM head existed (run_identity)
                    hint = ("; folders made before the int4 LM head (an int4 draft, from --draft-quantize int4 "
                            "or --quantize int4) resume with --draft-quantize-head int8")
                if "prepacked_linears" in diff and old.get("prepacked_linears") is None:
                    # float32 CPU runs made before the prepacked linears became the default (run_identity)
                    hint = "; folders made with stock float32 linears resume with --no-prepack-linears"
                raise InvalidArgumentError(
                    f"results folder {str(self.dir)!r} was made with different settings ({changes}); "
                    f"resume with the same settings or use another --out folder{hint}"
                )
            return True
        if self.records_path.exists():
            raise InvalidArgumentError(
                f"{self.records_path} exists but {SETTINGS_FILE} does not, so its settings are unknown; "
                "use another --out folder"
            )
        payload = {"identity": dict(identity), "created": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            write_text_atomic(self.settings_path, json.dumps(payload, indent=2) + "\n")
        except OSError as e:  # a path under a file, a read-only place, /proc: the user's --out, not a bug
            raise InvalidArgumentError(f"cannot write the results folder {str(self.dir)!r}: "
                                       f"{e.strerror or e}; pass a writable --out folder") from e
        return False

    def load(self) -> list[dict]:
        """Every stored record, first copy of each key. A torn last line (a kill mid-write) is cut off.

        Raises:
            InvalidArgumentError: A line before the last is not a JSON record.
        """
        if not self.records_path.is_file():
            return []
        data = self.records_path.read_bytes()
        if data and not data.endswith(b"\n"):
            keep = data.rfind(b"\n") + 1
            logger.warning("%s ends in a torn line (interrupted write); dropping it", self.records_path)
            with open(self.records_path, "r+b") as f:
                f.truncate(keep)
                f.flush()
                os.fsync(f.fileno())
            data = data[:keep]
        records, seen = [], set()
        for lineno, line in enumerate(data.decode("utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                key = record_key(record)
            except (ValueError, KeyError, TypeError) as e:
                raise InvalidArgumentError(
                    f"{self.records_path}:{lineno} is not a bench record ({e}); use another --out folder"
                ) from e
            if key not in seen:
                seen.add(key)
                records.append(record)
        return records

    def append(self, record: Mapping[str, Any]) -> None:
        """Append one record durably (flush + fsync) before returning."""
        line = json.dumps(record, separators=(",", ":")) + "\n"
        with open(self.records_path, "a", encoding="utf-8") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
