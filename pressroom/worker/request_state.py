"""The model runner's view of each request it runs: its tokens, blocks and progress."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pressroom.core.outputs import NewRequestData
from pressroom.lora.request import LoRARequest
from pressroom.pooling_params import PoolingParams
from pressroom.sampling_params import SamplingParams
from pressroom.worker.grammar import GrammarReader, RequestGrammar
from pressroom.worker.sampler import SamplingRow, allowed_tensor, bias_tensors


@dataclass(slots=True)
class CachedRequestState:
    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    eos_token_id: int | None
    # Tokens steps in flight may emit, not yet appended to token_ids (async scheduling): 1 + drafts each.
    num_inflight: int = 0
    pooling: PoolingParams | None = None  # a pooling request: pooled after its prompt, never sampled
    grammar: RequestGrammar | None = None  # structured outputs: the matcher that masks its logits
    logit_bias: tuple[torch.Tensor, torch.Tensor] | None = None  # its logit_bias as tensors, made once
    allowed: torch.Tensor | None = None  # its allowed_token_ids as a tensor, made once
    state_slot: int = -1  # its recurrent layers' live state slot (-1: the model has none)
    lora: LoRARequest | None = None  # the adapter it runs with (None: the base model)

    @classmethod
    def start(cls, new: NewRequestData, grammars: GrammarReader, device: str) -> CachedRequestState:
        grammar = None if new.grammar is None else \
            RequestGrammar.start(grammars.compiled(new.grammar), new.eos_token_id, new.num_prompt_tokens)
        bias, allowed = new.sampling_params.logit_bias, new.sampling_params.allowed_token_ids
        return cls(new.req_id, list(new.token_ids), new.num_prompt_tokens, new.sampling_params, list(new.block_ids),
                   new.num_computed_tokens, new.eos_token_id, pooling=new.pooling, grammar=grammar,
                   logit_bias=bias_tensors(bias, device) if bias else None,
                   allowed=allowed_tensor(allowed, device) if allowed else None, state_slot=new.state_slot,
                   lora=new.lora)

    @property
    def num_outputs(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def sampling_row(self, drafts: list[int] = ()) -> SamplingRow:
        """The sampler's view, its output followed by `drafts` (a verification position's history)."""
        return SamplingRow(self.params, self.token_ids[:self.num_prompt_tokens],
                           self.token_ids[self.num_prompt_tokens:] + list(drafts), self.eos_token_id, self.logit_bias,
                           self.allowed)

    def bare_sampling_row(self) -> SamplingRow:
        """The sampler's view without token histories (copied only where the sampler reads them)."""
        return SamplingRow(self.params, [], [], self.eos_token_id, self.logit_bias, self.allowed)
