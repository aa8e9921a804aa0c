"""The server's default sampling parameters, as vLLM takes them from a checkpoint's generation_config.json: one
`SamplingDefaults`, built at start-up (`--generation-config`, `--override-generation-config`), that every
generation handler applies to a request's unset fields.

vLLM's rules (ModelConfig.get_diff_sampling_param and the serving layer's max_tokens):
- `--generation-config auto` (the default) reads the model folder's generation_config.json, `vllm` reads nothing
  (the API's own defaults), a folder reads that folder's;
- of what it holds, the values transformers' GenerationConfig would not have by default (`to_diff_dict`), updated by
  `--override-generation-config`, the sampling ones are kept: repetition_penalty, temperature, top_k, top_p, min_p,
  and max_new_tokens as max_tokens;
- a request field left out (or null) takes the default; one the request sets is its own;
- max_tokens: the request's, else the default's (within the context left); a cap on any request's when it comes
  from a `--generation-config` folder, or from `--override-generation-config`'s max_new_tokens.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, TypeVar

logger = logging.getLogger("pressroom")

GENERATION_CONFIG_FILE = "generation_config.json"
# vLLM's choices besides a folder: the model's own file, or none
GENERATION_CONFIG_AUTO, GENERATION_CONFIG_NONE = "auto", "vllm"
# what vLLM takes from a generation config, in its order; max_new_tokens becomes max_tokens
GENERATION_FIELDS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p", "max_new_tokens")

Req = TypeVar("Req")  # a request model (pydantic): not imported here, the CLI reads this module at start-up


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    """`values`: request field -> default (max_tokens among them), in vLLM's order; `max_tokens_cap`: a bound on
    every request's max_tokens (None: none); `source`: where they came from, for the start-up line."""
    values: dict[str, Any] = field(default_factory=dict)
    max_tokens_cap: int | None = None
    source: str = GENERATION_CONFIG_NONE

    def fill(self, request: Req) -> Req:
        """`request` with each field it leaves unset (None) at its default."""
        unset = {name: value for name, value in self.values.items()
                 if name != "max_tokens" and getattr(request, name, 0) is None}
        return request.model_copy(update=unset) if unset else request  # type: ignore[attr-defined]

    def max_tokens(self, requested: int | None, room: int) -> int | None:
        """A request's output budget: its own (`requested`), else the default bounded by `room` (the context the
        prompt leaves); both under the cap. None: no bound (the engine stops at the context's end)."""
        budget = requested
        if budget is None and "max_tokens" in self.values:
            budget = min(self.values["max_tokens"], room)
        if self.max_tokens_cap is not None:
            budget = min(room if budget is None else budget, self.max_tokens_cap)
        return budget

    def log(self, api: str) -> None:
        """vLLM's start-up line, once per API that applies them (chat, completion)."""
        if self.values:
            logger.info("Using default %s sampling params from %s: %s", api, self.source, self.values)


def check_generation_config(value: str) -> None:
    """A ValueError for a --generation-config that is neither auto, vllm nor a folder."""
    if value not in (GENERATION_CONFIG_AUTO, GENERATION_CONFIG_NONE) and not os.path.isdir(value):
        raise ValueError(f"--generation-config {value!r}: not a folder (one holding {GENERATION_CONFIG_FILE}); "
                         f"or {GENERATION_CONFIG_AUTO} (the model's own) or {GENERATION_CONFIG_NONE} (none).")


def load_sampling_defaults(generation_config: str, override: dict[str, Any] | None,
                           model_path: str) -> SamplingDefaults:
    """The defaults as vLLM derives them (the module's docstring): `model_path` is the model's local folder or
    file (a file, a GGUF, has no generation_config.json beside it that counts)."""
    override = dict(override or {})
    if generation_config == GENERATION_CONFIG_NONE:
        config: dict[str, Any] = {}
    else:
        folder = model_path if generation_config == GENERATION_CONFIG_AUTO else generation_config
        config = read_generation_config(folder)
    config.update(override)
    values = {name: config[name] for name in GENERATION_FIELDS if config.get(name) is not None}
    if "max_new_tokens" in values:
        values["max_tokens"] = values.pop("max_new_tokens")
    explicit = generation_config not in (GENERATION_CONFIG_AUTO, GENERATION_CONFIG_NONE)
    cap = values.get("max_tokens") if explicit else override.get("max_new_tokens")
    source = "model" if generation_config == GENERATION_CONFIG_AUTO else generation_config
    return SamplingDefaults(values, None if cap is None else int(cap), source)


def read_generation_config(folder: str) -> dict[str, Any]:
    """What `folder`'s generation_config.json sets apart from transformers' defaults (vLLM's `to_diff_dict`), or
    nothing when there is no such file."""
    if not os.path.isfile(os.path.join(folder, GENERATION_CONFIG_FILE)):
        return {}
    from transformers import GenerationConfig  # the API process has it loaded already (tokenizers)
    try:
        return GenerationConfig.from_pretrained(folder).to_diff_dict()
    except (OSError, ValueError) as e:
        raise ValueError(f"{os.path.join(folder, GENERATION_CONFIG_FILE)}: not a generation config ({e})") from None
