"""CUDA graphs: one captured forward pass per step shape, replayed instead of launching every kernel.

Two families. Decode graphs (query length 1) are keyed by the padded number of requests R: a step of
n <= R single-token requests pads to R. Varlen graphs serve steps whose queries are up to Q tokens
each (verifications of up to Q - 1 drafts, mixed with plain decodes; short prefill chunks too) and are
keyed by the padded number of tokens T, with room for min(T, max_rows) requests: a step of t <= T
tokens pays for T, not for every request padded to Q. Padding requests have no query tokens and a
context length of 0, so they attend to nothing; padding tokens (past the step's last) belong to no
request and write no KV (slot -1). The paged-attention launch depends only on the request count, the
token count and Q, so one graph serves any context lengths and query lengths. Every graph shares one
memory pool, captured largest first.

With LoRA adapters (--enable-lora), every graph applies them: each token's adapter slot is a graph input (-1, the
base model, on padding tokens and in a step without adapters, whose updates are then exact zeros), and the adapters'
weights live in the slots' fixed buffers, which loading an adapter overwrites in place (lora/layers.py).

A model with recurrent layers (model/layers/state.py) replays decode graphs only: each row's state slot is a
graph input like its block table (padding rows step the padding slot 0), and a step that writes a prefix
checkpoint runs eager.

Decode graphs may also run the LM head (`head=True`: the target's runner; a drafter computes its own logits): the
logits of every row (one per request, so no row selection) and each row's greedy argmax are graph outputs
(`DecodeHead`), so a step of greedy requests takes its tokens without another launch over the vocabulary. Every
head graph writes its logits into one buffer, the largest head graph's rows x vocab: outputs kept per graph would
add up to several times that. Only graphs whose logits fit DECODE_HEAD_MAX_BYTES include the head (the larger
ones return hidden states, and their steps compute logits as eager steps do).
"""
from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass

import torch
from torch import nn

from pressroom.attention.backend import AttentionMetadata, AttentionMetadataBuilder, forward_context
from pressroom.attention.state import StateMetadata, StateRound
from pressroom.lora.layers import LoRAStep, current_step, lora_step

logger = logging.getLogger("pressroom")

# The LM head's logits a decode graph may keep (rows x vocab x element size); larger graphs leave the head out.
# 0: no graph runs the head. Tests switch the feature off through it.
DECODE_HEAD_MAX_BYTES = 128 << 20  # an 8B Llama's 512 rows (bf16, 128k vocabulary): 125 MiB

GraphKey = tuple[int, int]  # (query length: 1 or the varlen family's Q, padded requests or padded tokens)


@dataclass(frozen=True, slots=True)
class DecodeHead:
    """What a decode graph's LM head left for the step's rows: their logits ([rows, vocab], the head's own dtype:
    the graph's buffer, overwritten by the next replay) and each row's argmax ([rows] int64)."""
    logits: torch.Tensor
    argmax: torch.Tensor


def head_rows(decode_sizes: list[int], row_bytes: int, max_bytes: int) -> int:
    """The largest decode graph (padded request count) whose logits fit `max_bytes` (0: none)."""
    return max((s for s in decode_sizes if s * row_bytes <= max_bytes), default=0)


class CudaGraphs:
    def __init__(self, model: nn.Module, shapes: dict[int, list[int]], max_rows: int, max_blocks_per_seq: int,
                 builder: AttentionMetadataBuilder, device: str, aux_layers: tuple[int, ...] = (),
                 recurrent: bool = False, lora_slots: int = 0, head: bool = False) -> None:
        """`shapes`: {1: padded request counts of decode steps, Q: padded token counts of varlen steps}
        (either may be missing; at most one Q > 1); `max_rows`: requests a varlen step may hold;
        `builder`: the attention backend's metadata builder, which from here on splits a decode step as
        the graph of its padded size does; `aux_layers`: target layers a drafter conditions on, whose
        outputs every graph also returns; `recurrent`: the model has recurrent layers (decode graphs only);
        `lora_slots`: the LoRA manager's device slots (0: no adapters); `head`: decode graphs of up to
        DECODE_HEAD_MAX_BYTES of logits also run the model's `compute_logits` and the greedy argmax."""
        self.model, self.builder, self.max_rows = model, builder, max_rows
        self.aux_layers, self.recurrent = aux_layers, recurrent
        self.shapes = {q: sorted(sizes) for q, sizes in sorted(shapes.items()) if sizes and (q == 1 or not recurrent)}
        if len([q for q in self.shapes if q > 1]) > 1:
            raise ValueError("CUDA graphs hold one varlen family (one max query length).")
        self.varlen_q = max((q for q in self.shapes if q > 1), default=0)
        builder.split_as_graphs(self.shapes.get(1, []))
        max_reqs = max(self.rows(q, s[-1]) for q, s in self.shapes.items())
        max_tokens = max(s[-1] for s in self.shapes.values())
        self.input_ids = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_tokens,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(max_reqs, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(max_reqs, dtype=torch.int32, device=device)
        self.query_start_loc = torch.zeros(max_reqs + 1, dtype=torch.int32, device=device)
        self.state_slots = torch.zeros(max_reqs, dtype=torch.int64, device=device)  # 0: the padding slot
        self.lora_slots = lora_slots
        self.lora_token_slots = torch.full((max_tokens,), -1, dtype=torch.int64, device=device) if lora_slots else None
        self.graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[GraphKey, torch.Tensor] = {}
        # With aux layers: each one's output, as each graph leaves them.
        self.aux: dict[GraphKey, list[torch.Tensor]] = {}
        self.head = head
        self.head_rows = 0  # decode graphs up to this many requests run the head (set at capture)
        self.logits: torch.Tensor | None = None  # [head_rows, vocab]: every head graph's logits
        self.argmax: dict[GraphKey, torch.Tensor] = {}  # each head graph's rows' argmax

    def rows(self, q: int, size: int) -> int:
        """Requests the graph (q, size) holds: `size` for decodes; for varlen, as many as its tokens allow."""
        return size if q == 1 else min(size, self.max_rows)

    @property
    def max_decodes(self) -> int:
        return self.shapes[1][-1] if 1 in self.shapes else 0

    def padded_size(self, num_decodes: int) -> int:
        """The request count of the decode graph a step of `num_decodes` single-token requests replays."""
        sizes = self.shapes[1]
        return sizes[bisect.bisect_left(sizes, num_decodes)]

    def key_for(self, num_reqs: int, max_query_len: int, num_tokens: int,
                state: StateMetadata | None = None) -> GraphKey | None:
        """The graph a step replays; None where none was captured that large, or where the step writes a
        recurrent state's checkpoint (the step runs eager)."""
        if state is not None and (len(state.rounds) > 1 or state.rounds[0].saves is not None):
            return None
        if max_query_len == 1 and num_reqs <= self.max_decodes:
            return 1, self.padded_size(num_reqs)
        sizes = self.shapes.get(self.varlen_q)
        if sizes and max_query_len <= self.varlen_q and num_reqs <= self.max_rows and num_tokens <= sizes[-1]:
            return self.varlen_q, sizes[bisect.bisect_left(sizes, num_tokens)]
        return None

    def _meta(self, q: int, size: int) -> AttentionMetadata:
        rows = self.rows(q, size)
        meta = self.builder.build(
            num_decodes=rows if q == 1 else 0, slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:rows], seq_lens=self.seq_lens[:rows],
            query_start_loc=[], seq_lens_host=[], max_query_len=q,
            query_start_loc_device=self.query_start_loc[:rows + 1])
        if self.recurrent:  # decodes: one token per row
            meta.state = StateMetadata([StateRound(None, list(range(rows + 1)), self.query_start_loc[:rows + 1],
                                                   self.state_slots[:rows], rows)])
        return meta

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        free_before = torch.cuda.mem_get_info()[0]
        pool = torch.cuda.graph_pool_handle()
        keys = sorted(((q, s) for q, sizes in self.shapes.items() for s in sizes), key=lambda k: -k[1])
        for q, n in keys:  # n: the graph's tokens
            rows = self.rows(q, n)
            self.query_start_loc[:rows + 1].copy_(torch.arange(rows + 1, dtype=torch.int32).clamp_(max=n))
            meta = self._meta(q, n)
            with forward_context(meta):
                with lora_step(self._lora_step(n)):
                    hidden = self._forward(n)[0]  # compiles kernels outside capture
                    with_head = q == 1 and self._has_head(n, hidden)
                    if with_head:
                        self._run_head(hidden)
                del hidden
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                # a LoRAStep of its own: masks cached by the run above live outside the graph's memory
                with torch.cuda.graph(graph, pool=pool), lora_step(self._lora_step(n)):
                    self.outputs[q, n], self.aux[q, n] = self._forward(n)
                    if with_head:
                        self.argmax[q, n] = self._run_head(self.outputs[q, n])
            self.graphs[q, n] = graph
        torch.cuda.synchronize()
        used = free_before - torch.cuda.mem_get_info()[0]
        shapes = ", ".join(f"decodes: {len(s)} sizes up to {s[-1]} requests" if q == 1 else
                           f"queries up to {q} tokens: {len(s)} sizes up to {s[-1]} tokens"
                           for q, s in self.shapes.items())
        logger.info("captured %d CUDA graphs (%s) in %.1fs, %.2f GiB", len(keys), shapes,
                    time.perf_counter() - start, used / (1 << 30))
        if self.logits is not None:
            logger.info("decode graphs of up to %d requests run the LM head and greedy argmax (logits buffer "
                        "%.1f MiB)", self.head_rows, self.logits.nbytes / (1 << 20))

    def _has_head(self, n: int, hidden: torch.Tensor) -> bool:
        """Whether the decode graph of `n` requests runs the head. The first one asked (the largest: graphs are
        captured largest first) sizes the logits buffer from one row's logits (the vocabulary and dtype)."""
        if not self.head:
            return False
        if self.logits is None:
            row = self.model.compute_logits(hidden[:1])
            self.head_rows = head_rows(self.shapes[1], row.shape[-1] * row.element_size(), DECODE_HEAD_MAX_BYTES)
            self.head = self.head_rows > 0
            if not self.head:
                return False
            self.logits = torch.empty(self.head_rows, row.shape[-1], dtype=row.dtype, device=row.device)
        return n <= self.head_rows

    def _run_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Every row's logits into the shared buffer, and their argmax (the sampler's greedy_tokens on CUDA:
        argmax over the head's values, which `.float()` converts exactly, so the same index as over fp32)."""
        logits = self.model.compute_logits(hidden)
        self.logits[:hidden.shape[0]].copy_(logits)
        return logits.argmax(dim=-1)

    def _lora_step(self, n: int) -> LoRAStep | None:
        """The adapters a graph of `n` tokens applies: the slots in its input buffer (its own masks' cache)."""
        return LoRAStep(self.lora_token_slots[:n], self.lora_slots) if self.lora_slots else None

    def _forward(self, n: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        if not self.aux_layers:
            return self.model(self.input_ids[:n], self.positions[:n]), []
        return self.model(self.input_ids[:n], self.positions[:n], self.aux_layers)

    def replay(self, key: GraphKey, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
               ) -> tuple[torch.Tensor, torch.Tensor | None, DecodeHead | None]:
        """Hidden states of the step's tokens from the graph `key` (from `key_for`), the aux layers'
        outputs side by side where the graphs were captured with some, and the LM head's outputs for the
        step's rows where the graph runs it."""
        q, size = key
        rows, tokens = self.rows(q, size), size
        n, t = len(meta.query_start_loc) - 1, input_ids.shape[0]
        self.input_ids[:t].copy_(input_ids)
        self.positions[:t].copy_(positions)
        self.slot_mapping[:t].copy_(meta.slot_mapping)
        self.slot_mapping[t:tokens].fill_(-1)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.seq_lens[n:rows].fill_(0)
        self.query_start_loc[:n + 1].copy_(meta.query_start_loc_device)
        self.query_start_loc[n + 1:rows + 1].fill_(t)
        width = meta.block_tables.shape[1]
        self.block_tables[:n, :width].copy_(meta.block_tables)
        if self.recurrent:
            self.state_slots[:n].copy_(meta.state.rounds[0].slots)
            self.state_slots[n:rows].fill_(0)
        if self.lora_slots:
            self._set_lora_slots(t, tokens)
        self.graphs[key].replay()
        # Features are concatenated here, not in the graph: a fresh tensor outlives the next replay.
        features = torch.cat([a[:t] for a in self.aux[key]], dim=-1) if self.aux_layers else None
        argmax = self.argmax.get(key)
        head = None if argmax is None else DecodeHead(self.logits[:t], argmax[:t])
        return self.outputs[key][:t], features, head

    def _set_lora_slots(self, t: int, tokens: int) -> None:
        """The step's adapter slot per token into the graphs' input (-1 past its tokens, and for a step without
        adapters)."""
        step = current_step()
        if step is None:
            self.lora_token_slots[:tokens].fill_(-1)
            return
        self.lora_token_slots[:t].copy_(step.token_slots)
        self.lora_token_slots[t:tokens].fill_(-1)
