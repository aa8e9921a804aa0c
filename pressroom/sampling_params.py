"""Sampling parameters, with vLLM's names so users' scripts carry over."""
from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

_GREEDY_EPS = 1e-5
_MIN_TEMPERATURE = 1e-2  # vLLM's _MAX_TEMP: a smaller positive temperature is raised to it
MAX_NUM_BAD_WORDS = 128  # token sequences a request's bad_words may tokenize to (vLLM's VLLM_MAX_NUM_BAD_WORDS)


class RequestOutputKind(enum.Enum):
    """What each engine step reports for a request (vLLM's names)."""
    CUMULATIVE = 0  # everything so far, every step (streaming consumers)
    DELTA = 1  # vLLM's: only what is new each step. Refused by SamplingParams: pressroom's engines report cumulatively
    FINAL_ONLY = 2  # nothing until it finishes (LLM.generate: no per-step copies of growing outputs)


@dataclass(slots=True)
class RepetitionDetectionParams:
    """vLLM's: end generation once an N-gram of `min_pattern_size`..`max_pattern_size` tokens repeats
    `min_count` times. Validated as vLLM validates it; SamplingParams refuses an enabled one (max_pattern_size > 0):
    pressroom's stop checks have no repetition detection."""
    max_pattern_size: int = 0
    min_pattern_size: int = 0
    min_count: int = 0

    def __post_init__(self) -> None:
        if self.max_pattern_size < 0 or self.min_pattern_size < 0 or self.min_pattern_size > self.max_pattern_size:
            raise ValueError("repetition_detection: max_pattern_size and min_pattern_size must be >= 0, with "
                             "min_pattern_size <= max_pattern_size.")
        if self.max_pattern_size > 0 and self.min_count < 2:
            raise ValueError("repetition_detection: min_count must be >= 2 to detect a repeated pattern.")

    @property
    def enabled(self) -> bool:
        return self.max_pattern_size > 0


@dataclass(slots=True)
class StructuredOutputsParams:
    """Constrain a request's output (vLLM's names): exactly one of the kinds is set.

    `json` is a JSON schema (a dict, or its text); `json_object` asks for any JSON object; `regex`,
    `choice` (one of the strings) and `grammar` (EBNF, as xgrammar reads it) constrain the text itself.
    `parsed_grammar` is set by the server, never by a client: xgrammar's JSON of the constraint, parsed (and its
    compile tried) in the server's grammar sandbox, which the engine core compiles without parsing it again.
    """
    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    parsed_grammar: str | None = None

    def __post_init__(self) -> None:
        kinds = [name for name in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, name) not in (None, False)]
        if len(kinds) != 1:
            raise ValueError("structured_outputs takes exactly one of json, regex, choice, grammar or "
                             f"json_object; got {kinds or 'none'}.")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of strings.")

    @property
    def kind(self) -> str:
        return next(name for name in ("json", "regex", "choice", "grammar", "json_object")
                    if getattr(self, name) not in (None, False))


@dataclass(slots=True)
class SamplingParams:
    """vLLM 0.32's SamplingParams: its fields in its order (keyword use carries over, and so does positional), then
    pressroom's own. Every vLLM field is honoured, or refused with a ValueError naming it when set to a value
    pressroom cannot honour (REFUSED_FIELDS says which and why); vLLM's private fields (_eos_token_id, ...) are
    internal to vLLM's engine and absent here."""
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    # None or False: this engine has no watermark (vLLM's watermark_config) to apply; True is refused.
    watermarking: bool | None = None
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None  # -1: None (vLLM's)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    prompt_logprob_token_ids: list[list[int]] | None = None  # refused when set
    prompt_logprob_start: int | None = None  # refused when set
    logprob_token_ids: list[int] | None = None  # refused when set
    flat_logprobs: bool = False  # refused when True
    detokenize: bool = True
    skip_special_tokens: bool = True
    # Accepted and carried as vLLM's; the Rust tokenizers' decode (every fast tokenizer) has no such option, so it
    # changes the text only where a tokenizer's own decode takes it.
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Tokens per streamed output: pressroom's engines report every step, i.e. 1; more is refused.
    stream_interval: int | None = None
    # vLLM's clone() deep-copies unless this is set; pressroom's clone never deep-copies, so either value behaves.
    skip_clone: bool = False
    # Characters of the output held back while a stop string may still be completing (vLLM's, set here as vLLM
    # sets it; an input value is replaced, as in vLLM).
    output_text_buffer_length: int = 0
    # Constrained decoding (xgrammar): the sampler masks every token the grammar forbids.
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None
    # Only these tokens may be sampled (vLLM's): every other logit is masked.
    allowed_token_ids: list[int] | None = None
    # vLLM's extra_args (the server's `vllm_xargs`): carried for extensions; no in-tree sampling reads them.
    extra_args: dict[str, Any] | None = None
    # Words never generated (vLLM's rule): a word's last token is masked when the output so far ends with the
    # tokens before it. LLMEngine tokenizes them into `bad_words_token_ids` (bad_words_token_ids below).
    bad_words: list[str] | None = None
    # None: skip the prefix cache exactly when prompt_logprobs are asked (vLLM's default, and what pressroom's cache
    # does); a value that differs from that is refused.
    skip_reading_prefix_cache: bool | None = None
    # Reasoning models: once this many tokens were generated inside the thinking span without its end
    # marker, the sampler forces `think_end_token_ids` next, then generation goes on with the answer.
    # The span opens after `think_start_token_ids` (in the prompt, as a chat template that opens `<think>`
    # puts it, or in the output); with no start ids the output starts inside the span. LLMEngine fills
    # both from the tokenizer's `<think>` / `</think>` when the budget is set and they are left out. -1: None.
    thinking_token_budget: int | None = None
    repetition_detection: RepetitionDetectionParams | None = None  # refused when enabled
    routed_experts_prompt_start: int = 0  # refused when not 0: pressroom returns no routed experts
    trace_decode_token_ids: list[int] | None = None  # refused when set
    # ---- pressroom's own ----
    bad_words_token_ids: list[list[int]] | None = None  # vLLM's private _bad_words_token_ids
    # Keep only the prompt's last k tokens (left truncation); -1: max_model_len of them (truncated_prompt below).
    truncate_prompt_tokens: int | None = None
    think_start_token_ids: list[int] | None = None
    think_end_token_ids: list[int] | None = None
    stop_strings: list[str] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self._normalise_as_vllm()
        self.stop_strings = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(dict.fromkeys(self.stop_token_ids or []))  # vLLM drops repeats
        self.logit_bias = _normalise_logit_bias(self.logit_bias)
        if self.think_start_token_ids is not None:
            self.think_start_token_ids = list(self.think_start_token_ids)
        if self.think_end_token_ids is not None:
            self.think_end_token_ids = list(self.think_end_token_ids)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        self.bad_words = list(dict.fromkeys(self.bad_words)) if self.bad_words else None  # vLLM drops repeats
        self.output_text_buffer_length = (max(map(len, self.stop_strings)) - 1
                                          if self.stop_strings and not self.include_stop_str_in_output else 0)
        self._validate()
        self._refuse_unsupported()
        if self.greedy:  # vLLM's: greedy ignores the truncations, so they are reset
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    def _normalise_as_vllm(self) -> None:
        """vLLM's spellings of "off": top_k -1, seed -1, thinking_token_budget -1; logprobs True means 1; a
        temperature below 0.01 (but not 0) is raised to 0.01, as vLLM does against numerical overflow."""
        if self.top_k == -1:
            self.top_k = 0
        if self.seed == -1:
            self.seed = None
        if self.thinking_token_budget == -1 and type(self.thinking_token_budget) is int:
            self.thinking_token_budget = None
        if self.logprobs is True:
            self.logprobs = 1
        if self.prompt_logprobs is True:
            self.prompt_logprobs = 1
        if 0 < self.temperature < _MIN_TEMPERATURE:
            self.temperature = _MIN_TEMPERATURE

    def _refuse_unsupported(self) -> None:
        for name, (is_set, reason) in _refusals(self).items():
            if is_set:
                raise ValueError(f"SamplingParams.{name}={getattr(self, name)!r} is not supported by pressroom: "
                                 f"{reason}.")

    @property
    def all_stop_token_ids(self) -> set[int]:
        """vLLM's property: the stop token ids (the engine adds the end-of-sequence id where it applies)."""
        return set(self.stop_token_ids)

    def _validate(self) -> None:
        checks = [
            (self.n >= 1, f"n must be at least 1, got {self.n}."),
            (math.isfinite(self.temperature), f"temperature must be non-negative and finite, got {self.temperature}."),
            (self.temperature >= 0, f"temperature must be non-negative, got {self.temperature}."),
            (self.temperature <= 2, f"temperature must be in [0, 2], got {self.temperature}."),  # vLLM's bound
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}."),
            (type(self.top_k) is int and self.top_k >= 0,
             f"top_k must be -1 (off), 0 (off) or a positive integer, got {self.top_k}."),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}."),
            (-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}."),
            (-2 <= self.frequency_penalty <= 2, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}."),
            (self.repetition_penalty > 0, f"repetition_penalty must be positive, got {self.repetition_penalty}."),
            (self.max_tokens is None or self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}."),
            (self.min_tokens >= 0, f"min_tokens must be non-negative, got {self.min_tokens}."),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens,
             f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})."),
            (self.logprobs is None or self.logprobs >= 0, f"logprobs must be non-negative, got {self.logprobs}."),
            (self.prompt_logprobs is None or self.prompt_logprobs >= 0,
             f"prompt_logprobs must be non-negative, got {self.prompt_logprobs}."),
            (all(isinstance(s, str) and s for s in self.stop_strings),
             "stop strings must not be empty, and must be strings."),
            (all(type(t) is int for t in self.stop_token_ids), "stop_token_ids must be integers."),
            (self.thinking_token_budget is None or (type(self.thinking_token_budget) is int
                                                    and self.thinking_token_budget >= 0),
             f"thinking_token_budget must be a non-negative integer, got {self.thinking_token_budget}."),
            (self.think_end_token_ids is None or (len(self.think_end_token_ids) > 0 and all(
                type(t) is int for t in self.think_end_token_ids)),
             "think_end_token_ids must be a non-empty list of integers."),
            (all(type(t) is int for t in self.think_start_token_ids or []),
             "think_start_token_ids must be integers."),
            (self.allowed_token_ids is None or len(self.allowed_token_ids) > 0, "allowed_token_ids is empty."),
            (all(type(t) is int for t in self.allowed_token_ids or []), "allowed_token_ids must be integers."),
            (all(isinstance(w, str) and w for w in self.bad_words or []),
             "bad_words must be non-empty strings."),
            (self.truncate_prompt_tokens is None or (type(self.truncate_prompt_tokens) is int
                                                     and (self.truncate_prompt_tokens >= 1
                                                          or self.truncate_prompt_tokens == -1)),
             f"truncate_prompt_tokens must be an integer >= 1 or -1, got {self.truncate_prompt_tokens}."),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def needs_penalties(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1.0)

    @property
    def needs_token_masks(self) -> bool:
        """Whether sampling masks tokens by the request's allowed or bad words (the host sampler's work)."""
        return self.allowed_token_ids is not None or bool(self.bad_words_token_ids)

    def clone(self, **changes) -> SamplingParams:
        values = {name: getattr(self, name) for name in self.__dataclass_fields__ if name != "stop_strings"}
        values.update(changes)
        return SamplingParams(**values)


def _refusals(p: SamplingParams) -> dict[str, tuple[bool, str]]:
    """vLLM's fields pressroom cannot honour: name -> (set to a value pressroom would not honour, why)."""
    cache_default = p.prompt_logprobs is not None
    return {
        "watermarking": (p.watermarking is True, "it has no watermarking (vLLM's watermark config)"),
        "prompt_logprob_token_ids": (p.prompt_logprob_token_ids is not None,
                                     "prompt logprobs come as each position's top-k (prompt_logprobs)"),
        "prompt_logprob_start": (p.prompt_logprob_start is not None,
                                 "prompt logprobs cover the whole prompt (prompt_logprobs)"),
        "logprob_token_ids": (p.logprob_token_ids is not None, "sample logprobs come as the top-k (logprobs)"),
        "flat_logprobs": (p.flat_logprobs is not False, "logprobs come as a list of dicts per position"),
        "output_kind": (p.output_kind is RequestOutputKind.DELTA,
                        "its engines report cumulative outputs (CUMULATIVE or FINAL_ONLY)"),
        "stream_interval": (p.stream_interval not in (None, 1), "its engines report every step (1)"),
        "skip_reading_prefix_cache": (p.skip_reading_prefix_cache not in (None, cache_default),
                                      "its prefix cache is skipped exactly when prompt_logprobs are asked"),
        "repetition_detection": (p.repetition_detection is not None and p.repetition_detection.enabled,
                                 "it has no repetition detection"),
        "routed_experts_prompt_start": (p.routed_experts_prompt_start != 0, "it returns no routed experts"),
        "trace_decode_token_ids": (p.trace_decode_token_ids is not None, "it has no forced-trace decoding"),
    }


# vLLM 0.32's SamplingParams fields pressroom refuses at some values (those _refusals names); it honours the rest.
REFUSED_FIELDS = ("watermarking", "prompt_logprob_token_ids", "prompt_logprob_start", "logprob_token_ids",
                  "flat_logprobs", "output_kind", "stream_interval", "skip_reading_prefix_cache",
                  "repetition_detection", "routed_experts_prompt_start", "trace_decode_token_ids")


@dataclass(slots=True)
class BeamSearchParams:
    """LLM.beam_search's parameters (vLLM's BeamSearchParams). Each step asks the engine for 2 * beam_width
    candidates of every live beam; `temperature` is that step's sampling (vLLM's: a sampled token joins the
    candidates); `length_penalty` divides a finished beam's cumulative logprob by its length to that power."""
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        checks = [
            (type(self.beam_width) is int and self.beam_width >= 1,
             f"beam_width must be a positive integer, got {self.beam_width}."),
            (type(self.max_tokens) is int and self.max_tokens >= 1,
             f"max_tokens must be a positive integer, got {self.max_tokens}."),
            (0 <= self.temperature < math.inf, f"temperature must be non-negative and finite, got {self.temperature}."),
            (math.isfinite(self.length_penalty), f"length_penalty must be finite, got {self.length_penalty}."),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


def _normalise_logit_bias(bias: dict | None) -> dict[int, float] | None:
    """JSON clients send token ids as strings; accept them, reject what is not a finite number."""
    if not bias:
        return None
    out = {}
    for token, value in bias.items():
        try:
            token_id, value = int(token), float(value)
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias maps token ids to numbers; got {token!r}: {value!r}.") from None
        if not math.isfinite(value):
            raise ValueError(f"logit_bias values must be finite, got {value} for token {token_id}.")
        out[token_id] = value
    return out


def bad_words_token_ids(words: list[str], encode: Callable[[str], list[int]]) -> list[list[int]]:
    """Each bad word's token ids, as vLLM makes them: the word (leading spaces stripped) as it starts a text, and
    again after a space when that spelling starts with a different token but has as many tokens (a word in the
    middle of a text). `encode` tokenizes without special tokens. More than MAX_NUM_BAD_WORDS sequences are a
    ValueError, raised as soon as they are (a long list costs no more tokenizing than that)."""
    out: list[list[int]] = []
    for word in words:
        bare = encode(word.lstrip())
        if not bare:
            raise ValueError(f"bad_words entry {word!r} tokenizes to no tokens.")
        out.append(bare)
        spaced = encode(" " + word.lstrip())
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(spaced)
        if len(out) > MAX_NUM_BAD_WORDS:
            raise ValueError(f"Too many bad words after tokenization: more than {MAX_NUM_BAD_WORDS}, the maximum.")
    return out


def truncated_prompt(token_ids: list[int], truncate_prompt_tokens: int | None, max_model_len: int) -> list[int]:
    """The prompt's last `truncate_prompt_tokens` tokens (vLLM's rules: None keeps all, -1 means max_model_len,
    more than max_model_len is a ValueError)."""
    k = truncate_prompt_tokens
    if k is None:
        return token_ids
    if k == -1:
        k = max_model_len
    if k < 1:
        raise ValueError(f"truncate_prompt_tokens must be an integer >= 1 or -1, got {k}.")
    if k > max_model_len:
        raise ValueError(f"truncate_prompt_tokens value ({k}) is greater than max_model_len ({max_model_len}). "
                         "Please, select a smaller truncation size.")
    return token_ids[-k:]
