"""Prompt dicts with vLLM's names (`vllm.inputs.TextPrompt` / `TokensPrompt`): what LLM.generate, LLM.embed and
the engines take besides plain strings and token-id lists."""
from __future__ import annotations

from typing import Any, NotRequired, TypedDict

# vLLM's prompt keys pressroom has no use for yet (embeddings in place of tokens, BERT segment ids, per-request
# processor settings): refused by name (check_prompt) rather than dropped.
UNSUPPORTED_PROMPT_KEYS = ("mm_processor_kwargs", "multi_modal_uuids", "media_io_kwargs", "prompt_embeds",
                           "token_type_ids")
MODALITIES = ("image", "audio", "video")  # multi_modal_data may hold (a model takes: multimodal/processor.py)
_KNOWN_KEYS = frozenset({"prompt", "prompt_token_ids", "cache_salt", "prompt_token_offsets", "multi_modal_data",
                         *UNSUPPORTED_PROMPT_KEYS})


class TextPrompt(TypedDict):
    prompt: str
    cache_salt: NotRequired[str]  # prefix-cache isolation: only requests with the same salt share cached blocks
    # {"image": a PIL image or a list of them, "audio": (samples, sample_rate) or a list of them}
    multi_modal_data: NotRequired[dict[str, Any]]


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    prompt: NotRequired[str]  # the text the ids came from (kept for the output, never re-tokenized)
    cache_salt: NotRequired[str]
    multi_modal_data: NotRequired[dict[str, Any]]


def check_prompt(prompt: object) -> None:
    """A prompt dict's keys as vLLM's: ValueError naming a key pressroom cannot honour, or one vLLM has not."""
    if not isinstance(prompt, dict):
        return
    unknown = sorted(k for k in prompt if k not in _KNOWN_KEYS)
    if unknown:
        raise ValueError(f"Unknown prompt key(s): {', '.join(map(str, unknown))}; a prompt dict takes prompt, "
                         "prompt_token_ids, cache_salt and multi_modal_data.")
    refused = [k for k in UNSUPPORTED_PROMPT_KEYS if prompt.get(k) is not None]
    if refused:
        raise ValueError(f"Prompt key(s) {', '.join(refused)} are not supported: pressroom runs models from token "
                         "ids and multi_modal_data (no prompt embeddings, token type ids or processor overrides).")
    if "prompt" not in prompt and "prompt_token_ids" not in prompt:
        raise ValueError("A prompt dict needs prompt (a TextPrompt) or prompt_token_ids (a TokensPrompt).")
    media_items(prompt)


def media_items(prompt: object) -> dict[str, list[Any]]:
    """A prompt's multi_modal_data as {modality: [items]} (a single item listed); {} where it has none."""
    data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError("multi_modal_data must be a dict such as {\"image\": [PIL images]}; "
                         f"got {type(data).__name__}.")
    other = sorted(str(k) for k in data if k not in MODALITIES)
    if other:
        raise ValueError(f"multi_modal_data modality {', '.join(other)} is not supported; "
                         f"it takes {', '.join(MODALITIES)}.")
    return {k: _listed(k, v) for k, v in data.items() if v is not None}


def _listed(modality: str, value: Any) -> list[Any]:
    """A modality's items as a list. An audio clip is itself a tuple, vLLM's (samples, sample_rate), and so is a
    video with its metadata, (frames, {"fps": ...}): one item."""
    if modality == "audio" and isinstance(value, tuple) and len(value) == 2 and not isinstance(value[1], tuple):
        return [value]
    if modality == "video" and isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], dict):
        return [value]  # vLLM's (frames, metadata)
    return list(value) if isinstance(value, (list, tuple)) else [value]
