"""A smaller model with the target's vocabulary drafts K tokens autoregressively, with its own KV cache.

Each step the draft model first catches up on the tokens the target verified since its last call
(the accepted drafts and the target's own next token; KV of rejected drafts is overwritten), then
runs K single-token steps for all requests at once. At temperature > 0 each draft token is drawn
from the draft's distribution q (temperature, top-k/p, min-p as the request asks), and q goes to
the rejection sampler, so verification stays lossless; greedy requests draft the argmax.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

from pressroom.config import ModelConfig, SpeculativeConfig
from pressroom.core.kv_cache_manager import KVCacheManager
from pressroom.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from pressroom.core.request import Request
from pressroom.model.loader import load_model
from pressroom.spec_decode.proposer import Draft, DraftRequest
from pressroom.worker.sampler import probabilities


class DraftModelProposer:
    def __init__(self, config: SpeculativeConfig, target) -> None:
        from pressroom.worker.model_runner import ModelRunner
        self.k = config.num_speculative_tokens
        loaded = load_model(ModelConfig(model=config.model, dtype=target.dtype, skip_tokenizer_init=True,
                                        quantization="none"), target.device)
        target_vocab = target.model.config.vocab_size
        if loaded.hf_config.vocab_size != target_vocab:
            raise ValueError(f"The draft model's vocabulary ({loaded.hf_config.vocab_size} tokens) differs from the "
                             f"target's ({target_vocab}); a draft model must share the target's tokenizer.")
        self.max_len = getattr(loaded.hf_config, "max_position_embeddings", None) or 2048
        self.runner = ModelRunner(loaded.model, target.block_size, target.dtype, seed=1, device=target.device)
        self.kv: KVCacheManager | None = None  # sized like the target's cache on first use
        self.target = target
        self.requests: dict[str, Request] = {}  # the draft cache's view of each request
        self.generator = torch.Generator(device=target.device).manual_seed(1)

    def forget(self, req_ids: Iterable[str]) -> None:
        for rid in req_ids:
            req = self.requests.pop(rid, None)
            if req is not None and self.kv is not None:
                self.kv.free(req)
                self.runner.states.pop(rid, None)

    def propose(self, requests: list[DraftRequest]) -> dict[str, Draft]:
        wanted = [r for r in requests if r.max_drafts > 0 and len(r.token_ids) + self.k <= self.max_len]
        if not wanted:
            return {}
        self._ensure_cache()
        k = min(self.k, max(r.max_drafts for r in wanted))
        drafts: dict[str, list[int]] = {r.req_id: [] for r in wanted}
        probs: dict[str, list[torch.Tensor]] = {r.req_id: [] for r in wanted}
        active = wanted
        sched = self._catch_up(active)
        for step in range(k):
            if sched is None:
                break
            states, logits = self.runner.step_logits(sched)
            by_id = {r.req_id: r for r in active}
            for state, row in zip(states, logits):
                token, q = self._draw(row, by_id[state.req_id])
                state.token_ids.append(token)
                drafts[state.req_id].append(token)
                if q is not None:
                    probs[state.req_id].append(q)
            active = [r for r in active if len(drafts[r.req_id]) < min(k, r.max_drafts)]
            sched = self._one_more(active) if step + 1 < k else None
        return {rid: Draft(ids, torch.stack(probs[rid]) if probs[rid] else None)
                for rid, ids in drafts.items() if ids}

    # ---- the draft cache ----

    def _ensure_cache(self) -> None:
        if self.kv is None:
            num_blocks = self.target.kv_caches[0].shape[1]
            self.runner.initialize_kv_cache(num_blocks, self.max_len)
            self.kv = KVCacheManager(num_blocks, self.target.block_size, enable_caching=False)

    def _catch_up(self, requests: list[DraftRequest]) -> SchedulerOutput | None:
        """Schedules every verified token the draft cache lacks; the step ends at each request's last token."""
        new, cached, counts = [], [], {}
        for r in requests:
            req = self.requests.get(r.req_id)
            if req is None:
                req = Request(r.req_id, list(r.token_ids), r.params, None)
                self.requests[r.req_id] = req
                valid = 0
            else:
                valid = self._valid_prefix(req, r.token_ids)
                req.prompt_token_ids = list(r.token_ids)
                req.output_token_ids = []
            req.num_computed_tokens = valid
            n = len(r.token_ids) - valid
            old = len(self.kv.block_ids(r.req_id))
            if not self.kv.allocate_slots(req, n):
                raise RuntimeError("The draft model's KV cache is full; lower max_num_seqs.")
            counts[r.req_id] = n
            if r.req_id in self.runner.states:
                state = self.runner.states[r.req_id]
                state.token_ids = list(r.token_ids)
                cached.append(CachedRequestData(r.req_id, self.kv.block_ids(r.req_id)[old:], valid))
            else:
                new.append(NewRequestData(r.req_id, list(r.token_ids), len(r.token_ids), r.params,
                                          self.kv.block_ids(r.req_id), valid))
            req.num_computed_tokens += n
        return SchedulerOutput(new, cached, counts, sum(counts.values()))

    def _valid_prefix(self, req: Request, token_ids: list[int]) -> int:
        """How many leading tokens of the draft cache still match (its drafts past them were rejected)."""
        state = self.runner.states.get(req.request_id)
        known = state.token_ids if state is not None else []
        limit = min(req.num_computed_tokens, len(token_ids) - 1, len(known))
        n = 0
        while n < limit and known[n] == token_ids[n]:
            n += 1
        return n

    def _one_more(self, requests: list[DraftRequest]) -> SchedulerOutput | None:
        """One token each: the draft just sampled, so the next draft position gets logits."""
        if not requests:
            return None
        cached, counts = [], {}
        for r in requests:
            req = self.requests[r.req_id]
            req.prompt_token_ids = list(self.runner.states[r.req_id].token_ids)
            old = len(self.kv.block_ids(r.req_id))
            if not self.kv.allocate_slots(req, 1):
                raise RuntimeError("The draft model's KV cache is full; lower max_num_seqs.")
            cached.append(CachedRequestData(r.req_id, self.kv.block_ids(r.req_id)[old:], req.num_computed_tokens))
            counts[r.req_id] = 1
            req.num_computed_tokens += 1
        return SchedulerOutput([], cached, counts, len(counts))

    def _draw(self, logits: torch.Tensor, r: DraftRequest) -> tuple[int, torch.Tensor | None]:
        if r.params.greedy:
            return int(logits.argmax()), None
        q = probabilities([r.params], logits.unsqueeze(0))[0]
        noise = torch.empty_like(q).exponential_(generator=self.generator)
        return int((q / noise).argmax()), q
