"""The LoRA adapters a server serves by name: `--lora-modules` at start, `/v1/load_lora_adapter` and
`/v1/unload_lora_adapter` at run time (only with VLLM_ALLOW_RUNTIME_LORA_UPDATING, as vLLM gates them). A
request names one as its `model`; the engine gets its LoRARequest."""
from __future__ import annotations

import itertools
import json
import os
from dataclasses import dataclass

from pressroom.lora.request import LoRARequest

RUNTIME_UPDATING_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


@dataclass(frozen=True, slots=True)
class LoRAModule:
    """One `--lora-modules` entry: `name=path`, or vLLM's JSON form {"name", "path", "base_model_name"}."""
    name: str
    path: str
    base_model_name: str | None = None

    @classmethod
    def parse(cls, text: str) -> LoRAModule:
        text = text.strip()
        if text.startswith("{"):
            try:
                values = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"--lora-modules {text!r}: not valid JSON: {e}") from None
            if not isinstance(values, dict) or not values.get("name") or not values.get("path"):
                raise ValueError(f'--lora-modules {text!r}: a JSON entry needs "name" and "path".')
            return cls(str(values["name"]), str(values["path"]), values.get("base_model_name"))
        name, sep, path = text.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules {text!r}: expected name=path or a JSON object.")
        return cls(name, path)


def runtime_updating_allowed() -> bool:
    return os.environ.get(RUNTIME_UPDATING_ENV, "").strip().lower() in ("1", "true")


class Adapters:
    """Name -> LoRARequest; each adapter added gets a new id (a reloaded name is a new adapter to the engine)."""

    def __init__(self, base_name: str) -> None:
        self.base_name = base_name
        self.by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def get(self, name: str) -> LoRARequest | None:
        return self.by_name.get(name)

    def add(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        if name in self.by_name:
            raise ValueError(f"The LoRA adapter {name!r} is already loaded; unload it first.")
        request = LoRARequest(name, next(self._ids), path, base_model_name or self.base_name)
        self.by_name[name] = request
        return request

    def remove(self, name: str) -> LoRARequest | None:
        return self.by_name.pop(name, None)
