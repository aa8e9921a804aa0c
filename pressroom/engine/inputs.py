"""Prompt dicts with vLLM's names (`vllm.inputs.TextPrompt` / `TokensPrompt`): what LLM.generate, LLM.embed and
the engines take besides plain strings and token-id lists."""
from __future__ import annotations

from typing import NotRequired, TypedDict

# vLLM's prompt keys pressroom has no model for (multimodal inputs, embeddings in place of tokens, BERT segment
# ids): refused by name (check_prompt) rather than dropped.
UNSUPPORTED_PROMPT_KEYS = ("multi_modal_data", "mm_processor_kwargs", "multi_modal_uuids", "media_io_kwargs",
                           "prompt_embeds", "token_type_ids")
_KNOWN_KEYS = frozenset({"prompt", "prompt_token_ids", "cache_salt", "prompt_token_offsets",
                         *UNSUPPORTED_PROMPT_KEYS})


class TextPrompt(TypedDict):
    prompt: str
    cache_salt: NotRequired[str]  # prefix-cache isolation: only requests with the same salt share cached blocks


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    prompt: NotRequired[str]  # the text the ids came from (kept for the output, never re-tokenized)
    cache_salt: NotRequired[str]


def check_prompt(prompt: object) -> None:
    """A prompt dict's keys as vLLM's: ValueError naming a key pressroom cannot honour, or one vLLM has not."""
    if not isinstance(prompt, dict):
        return
    unknown = sorted(k for k in prompt if k not in _KNOWN_KEYS)
    if unknown:
        raise ValueError(f"Unknown prompt key(s): {', '.join(map(str, unknown))}; a prompt dict takes prompt, "
                         "prompt_token_ids and cache_salt.")
    refused = [k for k in UNSUPPORTED_PROMPT_KEYS if prompt.get(k) is not None]
    if refused:
        raise ValueError(f"Prompt key(s) {', '.join(refused)} are not supported: pressroom runs text-only models "
                         "from token ids (no multimodal inputs, prompt embeddings or token type ids).")
    if "prompt" not in prompt and "prompt_token_ids" not in prompt:
        raise ValueError("A prompt dict needs prompt (a TextPrompt) or prompt_token_ids (a TokensPrompt).")
