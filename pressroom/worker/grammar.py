"""Structured outputs in the model runner: a grammar matcher per request and the step's token bitmasks.

A matcher lives beside the request's token history in the runner and catches up on the tokens appended
since the last step (`catch_up`), so every path that emits tokens (host or device sampling, verification,
an async step resolved late, a recompute after preemption) advances it alike. Masks are filled on the host
and applied to the logits on their device (xgrammar's kernels). With drafts to verify, a request owns
1 + k logits rows: the matcher accepts each draft in turn to fill the next row, then rolls them all back;
a draft the grammar forbids leaves its own row masked against it, so verification rejects it.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import xgrammar as xgr

from pressroom.worker.device import to_device

logger = logging.getLogger("pressroom")


class GrammarReader:
    """Compiled grammars as a worker process receives them: xgrammar's JSON (a compiled grammar does not
    pickle), read back with the engine core's tokenizer info; the last few read are kept, so a schema many
    requests share is read once. In the engine core's process grammars arrive compiled and pass through."""

    def __init__(self, keep: int = 64) -> None:
        self.tokenizer_info: xgr.TokenizerInfo | None = None
        self._read: OrderedDict[str, xgr.CompiledGrammar] = OrderedDict()
        self._keep = keep

    def set_tokenizer(self, info_json: str) -> None:
        self.tokenizer_info = xgr.TokenizerInfo.deserialize_json(info_json)

    def compiled(self, grammar: xgr.CompiledGrammar | str) -> xgr.CompiledGrammar:
        if not isinstance(grammar, str):
            return grammar
        compiled = self._read.get(grammar)
        if compiled is None:
            compiled = self._read[grammar] = xgr.CompiledGrammar.deserialize_json(grammar, self.tokenizer_info)
            if len(self._read) > self._keep:
                self._read.popitem(last=False)
        self._read.move_to_end(grammar)
        return compiled


@dataclass(slots=True)
class RequestGrammar:
    matcher: xgr.GrammarMatcher
    eos_token_id: int | None
    next_index: int  # the first token id (in the request's prompt + outputs) the matcher has not seen
    broken: bool = False  # an emitted token the grammar refused (a forced token): no longer constrained

    @classmethod
    def start(cls, compiled: xgr.CompiledGrammar, eos_token_id: int | None, num_prompt_tokens: int
              ) -> RequestGrammar:
        return cls(xgr.GrammarMatcher(compiled), eos_token_id, num_prompt_tokens)  # rollback is unbounded

    def catch_up(self, token_ids: list[int]) -> None:
        """Accepts the request's tokens emitted since the last call. After termination (the stop token was
        accepted) only EOS follows, which needs no matching."""
        m = self.matcher
        for token in token_ids[self.next_index:]:
            if m.is_terminated():
                break
            if not m.accept_token(token):
                self.broken = True
                logger.warning("an emitted token (%d) breaks its request's grammar; the rest of that request is "
                               "not constrained", token)
                break
        self.next_index = len(token_ids)

    def fill(self, bitmask: torch.Tensor, first: int, drafts: Sequence[int]) -> list[int]:
        """Fills rows first .. first + k (k = len(drafts)): row j for the state after drafts[:j]. Stops after a
        draft the grammar forbids (verification rejects it there; later rows are never used). Returns the
        rows filled."""
        m, rows = self.matcher, []
        accepted = 0
        for j in range(len(drafts) + 1):
            self._fill_row(bitmask, first + j)
            rows.append(first + j)
            if j == len(drafts) or m.is_terminated() or not m.accept_token(drafts[j]):
                break
            accepted += 1
        if accepted:
            m.rollback(accepted)
        return rows

    def allowed_prefix(self, token_ids: list[int], drafts: list[int]) -> list[int]:
        """`drafts` up to the first the grammar forbids after `token_ids` (verifying past it is wasted)."""
        if self.broken:
            return drafts
        self.catch_up(token_ids)
        return drafts[:self.valid_prefix(drafts)]

    def valid_prefix(self, drafts: list[int]) -> int:
        """How many leading drafts the grammar allows (the matcher is left as it was)."""
        m, n = self.matcher, 0
        while n < len(drafts) and not m.is_terminated() and m.accept_token(drafts[n]):
            n += 1
        if n:
            m.rollback(n)
        return n

    def _fill_row(self, bitmask: torch.Tensor, row: int) -> None:
        if not self.matcher.is_terminated():
            self.matcher.fill_next_token_bitmask(bitmask, row)
            return
        bitmask[row] = 0  # the grammar is done and its stop token taken: only EOS (ignore_eos runs on with it)
        if self.eos_token_id is not None:
            bitmask[row, self.eos_token_id // 32] = _bit(self.eos_token_id % 32)


def _bit(k: int) -> int:
    """Bit k of an int32 word, as a signed value (xgrammar's bitmask dtype)."""
    return (1 << k) - (1 << 32) if k == 31 else 1 << k


def constrain(logits: torch.Tensor, rows: list[tuple[RequestGrammar | None, list[int], Sequence[int]]]) -> None:
    """Masks, in place, every token a request's grammar forbids. `rows`: per request, in the order of the
    logits' rows: its grammar (None: unconstrained), its token ids (prompt and outputs), its drafts (it owns
    1 + len(drafts) rows)."""
    bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[1])  # all allowed
    constrained, first = [], 0
    for grammar, token_ids, drafts in rows:
        if grammar is not None:
            grammar.catch_up(token_ids)
            if not grammar.broken:
                constrained += grammar.fill(bitmask, first, drafts)
        first += 1 + len(drafts)
    if constrained:  # both staged through pinned memory: a pageable copy would wait for the step in flight
        rows = to_device(torch.tensor(constrained, dtype=torch.int32), logits.device)
        xgr.apply_token_bitmask_inplace(logits, to_device(bitmask, logits.device), vocab_size=logits.shape[1],
                                        indices=rows)
