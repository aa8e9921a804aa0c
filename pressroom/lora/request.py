"""`LoRARequest`, as vLLM spells it: which adapter a request runs with."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """`lora_name`: how clients name it (the `model` of a request); `lora_int_id`: a positive id unique per
    adapter (the engine keys its slots, caches and prefix-cache blocks by it); `lora_path`: the PEFT directory
    (adapter_config.json + adapter_model.safetensors); `base_model_name`: the model it was trained on, as
    /v1/models lists it (None: the served model)."""
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if type(self.lora_int_id) is not int or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_int_id must be a positive integer; got "
                             f"{self.lora_int_id!r}.")
        if not self.lora_path:
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_path names no adapter directory.")
