"""CUDA graphs for decode and verification steps: one captured forward pass per (query length, padded
number of requests).

A step of n requests whose query lengths are all at most q (decodes: q = 1; a verification of k
drafts: 1 + k; prefill chunks that short too) copies its inputs into static buffers and replays the
graph of the smallest captured q' >= q and size R >= n. Padding requests have no query tokens and a
context length of 0, so they attend to nothing; padding tokens (past the step's last) belong to no
request and write no KV (slot -1). The paged-attention launch depends only on R, R * q' and q', so one
graph serves any context lengths and any query lengths up to q'. Every graph shares one memory pool,
captured largest first.
"""
from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable

import torch
from torch import nn

from pressroom.attention.backend import AttentionMetadata, forward_context

logger = logging.getLogger("pressroom")

GraphKey = tuple[int, int]  # (query length, padded number of requests)


class CudaGraphs:
    def __init__(self, model: nn.Module, shapes: dict[int, list[int]], max_blocks_per_seq: int,
                 num_kv_splits: Callable[[int], int], device: str) -> None:
        """`shapes`: query length -> padded request counts to capture at that length."""
        self.model, self.num_kv_splits = model, num_kv_splits
        self.shapes = {q: sorted(sizes) for q, sizes in sorted(shapes.items()) if sizes}
        self.query_lens = sorted(self.shapes)
        max_reqs = max(s[-1] for s in self.shapes.values())
        max_tokens = max(q * s[-1] for q, s in self.shapes.items())
        self.input_ids = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_tokens,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(max_reqs, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(max_reqs, dtype=torch.int32, device=device)
        self.query_start_loc = torch.zeros(max_reqs + 1, dtype=torch.int32, device=device)
        self.graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[GraphKey, torch.Tensor] = {}
        # A drafter's target features (the model's aux_hidden) as each graph left them.
        self.aux: dict[GraphKey, list[torch.Tensor]] = {}

    @property
    def max_decodes(self) -> int:
        return self.shapes[1][-1] if 1 in self.shapes else 0

    def padded_size(self, num_decodes: int) -> int:
        """The request count of the decode graph a step of `num_decodes` single-token requests replays."""
        sizes = self.shapes[1]
        return sizes[bisect.bisect_left(sizes, num_decodes)]

    def key_for(self, num_reqs: int, max_query_len: int) -> GraphKey | None:
        """The graph a step of `num_reqs` requests with queries of at most `max_query_len` tokens replays;
        None where none was captured that large (the step runs eager)."""
        i = bisect.bisect_left(self.query_lens, max_query_len)
        for q in self.query_lens[i:]:
            sizes = self.shapes[q]
            if num_reqs <= sizes[-1]:
                return q, sizes[bisect.bisect_left(sizes, num_reqs)]
        return None

    def _meta(self, q: int, size: int) -> AttentionMetadata:
        decodes = size if q == 1 else 0
        return AttentionMetadata(
            num_decodes=decodes, num_decode_tokens=decodes, slot_mapping=self.slot_mapping[:q * size],
            block_tables=self.block_tables[:size], seq_lens=self.seq_lens[:size],
            query_start_loc=[], seq_lens_host=[],
            query_start_loc_device=self.query_start_loc[:size + 1], max_query_len=q,
            num_kv_splits=self.num_kv_splits(size) if q == 1 else 1)

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        free_before = torch.cuda.mem_get_info()[0]
        pool = torch.cuda.graph_pool_handle()
        keys = sorted(((q, s) for q, sizes in self.shapes.items() for s in sizes), key=lambda k: -k[0] * k[1])
        for q, size in keys:
            n = q * size
            self.query_start_loc[:size + 1].copy_(torch.arange(0, n + 1, q, dtype=torch.int32))
            meta = self._meta(q, size)
            with forward_context(meta):
                self.model(self.input_ids[:n], self.positions[:n])  # compiles kernels outside capture
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[q, size] = self.model(self.input_ids[:n], self.positions[:n])
            self.graphs[q, size] = graph
            self.aux[q, size] = list(getattr(getattr(self.model, "model", None), "aux_hidden", ()))
        torch.cuda.synchronize()
        used = free_before - torch.cuda.mem_get_info()[0]
        shapes = ", ".join(f"q={q}: {len(s)} sizes up to {s[-1]}" for q, s in self.shapes.items())
        logger.info("captured %d CUDA graphs (%s) in %.1fs, %.2f GiB", len(keys), shapes,
                    time.perf_counter() - start, used / (1 << 30))

    def replay(self, key: GraphKey, input_ids: torch.Tensor, positions: torch.Tensor,
               meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states of the step's tokens from the graph `key` (from `key_for`)."""
        q, size = key
        n, t = len(meta.query_start_loc) - 1, input_ids.shape[0]
        self.input_ids[:t].copy_(input_ids)
        self.positions[:t].copy_(positions)
        self.slot_mapping[:t].copy_(meta.slot_mapping)
        self.slot_mapping[t:q * size].fill_(-1)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.seq_lens[n:size].fill_(0)
        self.query_start_loc[:n + 1].copy_(meta.query_start_loc_device)
        self.query_start_loc[n + 1:size + 1].fill_(t)
        width = meta.block_tables.shape[1]
        self.block_tables[:n, :width].copy_(meta.block_tables)
        self.graphs[key].replay()
        if self.aux[key]:
            self.model.model.aux_hidden = self.aux[key]
        return self.outputs[key][:t]
