"""Owns the model, the KV cache tensors and per-request device-side state; runs one step.

Each step flattens the scheduled requests into one varlen batch (decodes first), runs the
model under a forward context carrying the attention metadata, and samples where a request's
known tokens are all computed.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from pressroom.attention.backend import AttentionMetadata, forward_context
from pressroom.attention.torch_ref import make_cpu_backend
from pressroom.core.outputs import ModelRunnerOutput, SchedulerOutput, TopLogprobs
from pressroom.model.layers.attention import Attention
from pressroom.sampling_params import SamplingParams
from pressroom.worker.sampler import SamplingRow, sample, top_logprobs


@dataclass(slots=True)
class CachedRequestState:
    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    eos_token_id: int | None

    def sampling_row(self) -> SamplingRow:
        return SamplingRow(self.params, self.token_ids[:self.num_prompt_tokens],
                           self.token_ids[self.num_prompt_tokens:], self.eos_token_id)


@dataclass(slots=True)
class StepBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    order: list[CachedRequestState]
    query_ends: list[int]  # exclusive end of each request's tokens in the flat batch


def kv_cache_bytes_per_block(hf_config, block_size: int, dtype: torch.dtype) -> int:
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    return 2 * hf_config.num_hidden_layers * block_size * kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()


class ModelRunner:
    def __init__(self, model: nn.Module, num_blocks: int, block_size: int, dtype: torch.dtype,
                 seed: int = 0, device: str = "cpu") -> None:
        self.model, self.block_size, self.device = model, block_size, device
        self.states: dict[str, CachedRequestState] = {}
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.backend = make_cpu_backend(dtype)
        self.kv_caches = self._bind_kv_caches(num_blocks, dtype)

    def _bind_kv_caches(self, num_blocks: int, dtype: torch.dtype) -> list[torch.Tensor]:
        caches = []
        for layer in (m for m in self.model.modules() if isinstance(m, Attention)):
            # Zeroed: padded attention positions read block 0 and must not hold NaN garbage.
            layer.kv_cache = torch.zeros(2, num_blocks, self.block_size, layer.num_kv_heads, layer.head_dim,
                                         dtype=dtype, device=self.device)
            layer.backend = self.backend
            caches.append(layer.kv_cache)
        return caches

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(sched)
        if sched.is_empty:
            return ModelRunnerOutput({})
        batch = self._prepare(sched)
        with forward_context(batch.meta):
            hidden = self.model(batch.input_ids, batch.positions)
        return self._sample(batch, sched, hidden)

    def _update_states(self, sched: SchedulerOutput) -> None:
        for rid in sched.finished_req_ids:
            self.states.pop(rid, None)
        for new in sched.new_requests:
            self.states[new.req_id] = CachedRequestState(
                new.req_id, list(new.token_ids), new.num_prompt_tokens, new.sampling_params,
                list(new.block_ids), new.num_computed_tokens, new.eos_token_id)
        for cached in sched.cached_requests:
            state = self.states[cached.req_id]
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def _prepare(self, sched: SchedulerOutput) -> StepBatch:
        counts = sched.num_scheduled_tokens
        reqs = sorted((self.states[rid] for rid in counts), key=lambda s: counts[s.req_id] != 1)
        num_decodes = sum(1 for s in reqs if counts[s.req_id] == 1)
        bs = self.block_size
        ids, positions, slots, seq_lens, loc = [], [], [], [], [0]
        max_blocks = max(len(s.block_ids) for s in reqs)
        tables = np.zeros((len(reqs), max_blocks), dtype=np.int64)
        for i, s in enumerate(reqs):
            start, n = s.num_computed_tokens, counts[s.req_id]
            pos = np.arange(start, start + n)
            blocks = np.asarray(s.block_ids, dtype=np.int64)
            tables[i, :len(blocks)] = blocks
            ids.extend(s.token_ids[start:start + n])
            positions.append(pos)
            slots.append(blocks[pos // bs] * bs + pos % bs)
            seq_lens.append(start + n)
            loc.append(loc[-1] + n)
        meta = AttentionMetadata(
            num_decodes=num_decodes, num_decode_tokens=num_decodes,
            slot_mapping=torch.from_numpy(np.concatenate(slots)),
            block_tables=torch.from_numpy(tables),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
            query_start_loc=loc, seq_lens_host=seq_lens,
            max_decode_seq_len=max(seq_lens[:num_decodes], default=0))
        return StepBatch(torch.tensor(ids, dtype=torch.long), torch.from_numpy(np.concatenate(positions)),
                         meta, reqs, loc[1:])

    def _sample(self, batch: StepBatch, sched: SchedulerOutput, hidden: torch.Tensor) -> ModelRunnerOutput:
        out = ModelRunnerOutput({s.req_id: [] for s in batch.order})
        sampling = [(i, s) for i, s in enumerate(batch.order)
                    if s.num_computed_tokens + sched.num_scheduled_tokens[s.req_id] >= len(s.token_ids)]
        for i, s in enumerate(batch.order):
            if s.params.prompt_logprobs is not None and s.num_computed_tokens < max(1, s.num_prompt_tokens - 1):
                out.prompt_logprobs[s.req_id] = self._prompt_logprobs(s, hidden, batch, i, sched)
        if sampling:
            rows = hidden[[batch.query_ends[i] - 1 for i, _ in sampling]]
            logits = self.model.compute_logits(rows).float()
            tokens, lps = sample(logits, [s.sampling_row() for _, s in sampling], self.generator)
            for (_, s), token, lp in zip(sampling, tokens, lps):
                s.token_ids.append(token)
                out.sampled_token_ids[s.req_id] = [token]
                if lp is not None:
                    out.logprobs[s.req_id] = [lp]
        return out

    def _prompt_logprobs(self, s: CachedRequestState, hidden: torch.Tensor, batch: StepBatch, i: int,
                         sched: SchedulerOutput) -> list[TopLogprobs | None]:
        """Logprob of each next prompt token at the positions this chunk computed."""
        start, n = s.num_computed_tokens, sched.num_scheduled_tokens[s.req_id]
        end = min(start + n, s.num_prompt_tokens - 1)
        first = batch.query_ends[i] - n
        logprobs = torch.log_softmax(self.model.compute_logits(hidden[first:first + end - start]).float(), dim=-1)
        result: list[TopLogprobs | None] = [None] if start == 0 else []
        for j, pos in enumerate(range(start, end)):
            result.append(top_logprobs(logprobs[j], s.token_ids[pos + 1], s.params.prompt_logprobs))
        return result
