"""Measurements the engine sizes and plans with: a forward pass's activation peak (the KV cache gets what
is left) and the time of step shapes (the adaptive speculative budget weighs them)."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from pressroom.worker.device import synchronize, to_device

if TYPE_CHECKING:
    from pressroom.attention.backend import AttentionMetadata
    from pressroom.worker.model_runner import ModelRunner


@torch.inference_mode()
def profile_peak_memory(runner: ModelRunner, num_tokens: int, num_seqs: int, max_position: int) -> int:
    """Peak bytes allocated by a forward pass of `num_tokens` prompt tokens plus sampling `num_seqs`
    rows: what the activations need on top of the weights. Runs before the KV cache exists, on a
    one-block cache (every position maps to block 0 and nothing is written)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    runner.initialize_kv_cache(1, runner.block_size)
    chunk = min(num_tokens, max_position)
    lengths = [chunk] * (num_tokens // chunk) + ([num_tokens % chunk] if num_tokens % chunk else [])
    loc = np.concatenate(([0], np.cumsum(lengths))).tolist()
    device, index = runner.device, runner.attn_builder.index_dtype
    meta = runner.attn_builder.build(
        num_decodes=0,
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=device),
        block_tables=torch.zeros(len(lengths), -(-chunk // runner.block_size), dtype=index, device=device),
        seq_lens=torch.tensor(lengths, dtype=index, device=device),
        query_start_loc=loc, seq_lens_host=lengths,
        query_start_loc_device=torch.tensor(loc, dtype=torch.int32, device=device),
        max_query_len=chunk)
    ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    positions = torch.cat([torch.arange(n, device=device) for n in lengths])
    hidden = runner.run_model(ids, positions, meta)
    rows = hidden[torch.arange(num_seqs, device=device) % num_tokens]
    logits = None
    if hasattr(runner.model, "compute_logits"):  # an encoder has no LM head: it only pools
        logits = runner.model.compute_logits(rows).float()
        torch.softmax(logits, dim=-1).sort(dim=-1)  # what top-p sampling of a full batch allocates
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del hidden, rows, logits
    runner.release_kv_cache()
    torch.cuda.empty_cache()
    return peak


@torch.inference_mode()
def profile_step_costs(runner: ModelRunner, token_counts: list[int], tokens_per_request: int,
                       context: int | None = None, repeats: int = 2) -> list[tuple[int, float]]:
    """Seconds of a step (forward pass and logits at every query token) for each token count, the
    tokens split into requests of `tokens_per_request` query tokens after `context` cached tokens
    (default one block): single-token decodes or draft verifications, the shapes the speculative
    budget weighs. Every position maps into the padding block (zeroed again after), so no real
    cache is touched."""
    costs = []
    for n in token_counts:
        ids, positions, meta = _profile_batch(runner, n, tokens_per_request, context or runner.block_size)
        best = float("inf")
        for _ in range(repeats + 1):  # the first run warms up
            synchronize(runner.device)
            start = time.perf_counter()
            hidden = runner.run_model(ids, positions, meta)
            runner.model.compute_logits(hidden).float()
            synchronize(runner.device)
            best = min(best, time.perf_counter() - start)
        costs.append((n, best))
    for cache in runner.kv_caches:
        cache[:, 0].zero_()
    return costs


def _profile_batch(runner: ModelRunner, n: int, per_request: int, context: int
                   ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    bs, dev = runner.block_size, runner.device
    lengths = [per_request] * (n // per_request) + ([n % per_request] if n % per_request else [])
    seq_lens = [context + q for q in lengths]
    loc = np.concatenate(([0], np.cumsum(lengths))).tolist()
    index = runner.attn_builder.index_dtype
    decodes = len(lengths) if per_request == 1 else 0
    meta = runner.attn_builder.build(
        num_decodes=decodes,
        slot_mapping=to_device(torch.cat([torch.arange(context, context + q) % bs for q in lengths]), dev),
        block_tables=torch.zeros(len(lengths), -(-max(seq_lens) // bs), dtype=index, device=dev),
        seq_lens=to_device(torch.tensor(seq_lens, dtype=index), dev),
        query_start_loc=loc, seq_lens_host=seq_lens, max_query_len=max(lengths))
    positions = torch.cat([torch.arange(context, context + q) for q in lengths])
    return torch.zeros(n, dtype=torch.long, device=dev), positions.to(dev), meta
