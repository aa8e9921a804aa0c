"""Turn a batch of logits into tokens, honouring each request's SamplingParams.

Logprobs are reported from the raw model distribution (before penalties, temperature and
truncation), as vLLM does by default. A seeded request draws its noise from a generator keyed
by (seed, output position), so its tokens do not depend on batch composition or preemption.

`allowed_token_ids` masks every other token; `bad_words` masks a bad word's last token where the output so far
ends with the tokens before it (vLLM's rule: the output alone, not the prompt, is matched).

A request with a `thinking_token_budget` that has spent it inside its thinking span gets the
end-of-thinking token(s) forced: every other logit is masked, so the forced token is sampled like
any other (it enters the KV cache through the normal path, and its logprob is the model's own).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pressroom.core.outputs import TopLogprobs
from pressroom.kernels import cpu
from pressroom.sampling_params import SamplingParams
from pressroom.worker.device import to_device

_MASK = float("-inf")


@dataclass(slots=True)
class SamplingRow:
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_id: int | None
    logit_bias: tuple[torch.Tensor, torch.Tensor] | None = None  # params.logit_bias as tensors (bias_tensors)
    allowed: torch.Tensor | None = None  # params.allowed_token_ids as a device tensor (allowed_tensor)


def sample(logits: torch.Tensor, rows: list[SamplingRow], generator: torch.Generator | None = None
           ) -> tuple[list[int], list[TopLogprobs | None]]:
    """logits: [rows, vocab] float32. Returns one token per row and, where asked, its logprobs."""
    raw_logprobs = _raw_logprobs(logits, rows)
    logits = _apply_processors(logits, rows)
    tokens = _choose(logits, rows, generator)
    lps = [None if lp is None else top_logprobs(lp, tokens[i], rows[i].params.logprobs)
           for i, lp in enumerate(raw_logprobs)]
    return tokens, lps


def top_logprobs(logprobs: torch.Tensor, chosen: int, n: int) -> TopLogprobs:
    """The chosen token with its rank, then the top n tokens with theirs."""
    chosen_lp = logprobs[chosen]
    rank = int((logprobs > chosen_lp).sum()) + 1
    ids, lps, ranks = [chosen], [float(chosen_lp)], [rank]
    if n:
        values, indices = logprobs.topk(n)
        ids += indices.tolist()
        lps += values.tolist()
        ranks += list(range(1, n + 1))
    return ids, lps, ranks


def _raw_logprobs(logits: torch.Tensor, rows: list[SamplingRow]) -> list[torch.Tensor | None]:
    wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    out: list[torch.Tensor | None] = [None] * len(rows)
    if wanted:
        lp = torch.log_softmax(logits[wanted], dim=-1)
        for j, i in enumerate(wanted):
            out[i] = lp[j]
    return out


def _apply_processors(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    cloned = False
    for i, row in enumerate(rows):
        p = row.params
        banned = _banned_tokens(row) + _bad_word_tokens(row)
        forced = forced_token(row)
        if not (p.logit_bias or p.needs_penalties or banned or forced is not None or p.allowed_token_ids):
            continue
        if not cloned:
            logits, cloned = logits.clone(), True
        if p.allowed_token_ids:
            _keep_only(logits[i], row.allowed if row.allowed is not None else allowed_tensor(p.allowed_token_ids,
                                                                                               logits.device))
        if p.logit_bias:
            ids, values = row.logit_bias or bias_tensors(p.logit_bias, logits.device)
            logits[i, ids] += values.to(logits.dtype)
        if p.needs_penalties:
            _apply_penalties(logits[i], row)
        if banned:
            logits[i, banned] = _MASK
        if forced is not None:
            logits[i] = _MASK
            logits[i, forced] = 0.0
    return logits


def bias_tensors(bias: dict[int, float], device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """A logit_bias as (token ids, float32 values) on `device`: made once per request (its state keeps them), as
    converting a vocabulary-wide bias (~50k entries) for every row at every step cost more than the step."""
    ids = torch.tensor(list(bias.keys()), dtype=torch.long)
    values = torch.tensor(list(bias.values()), dtype=torch.float32)
    return to_device(ids, device), to_device(values, device)


def allowed_tensor(allowed: list[int], device: torch.device | str) -> torch.Tensor:
    """allowed_token_ids as token ids on `device`, made once per request (its state keeps them)."""
    return to_device(torch.tensor(allowed, dtype=torch.long), device)


def _keep_only(logits: torch.Tensor, allowed: torch.Tensor) -> None:
    kept = logits[allowed]
    logits.fill_(_MASK)
    logits[allowed] = kept


def _bad_word_tokens(row: SamplingRow) -> list[int]:
    """The last token of each bad word whose other tokens end the output so far."""
    out = row.output_token_ids
    banned = []
    for word in row.params.bad_words_token_ids or ():
        prefix = len(word) - 1
        if prefix <= len(out) and (prefix == 0 or out[-prefix:] == word[:-1]):
            banned.append(word[-1])
    return banned


def forced_token(row: SamplingRow) -> int | None:
    """The end-of-thinking token this row must emit next because its thinking budget is spent, or None.

    Stateless: derived from the prompt and output ids each step, so preemption and recompute agree."""
    p = row.params
    budget, end = p.thinking_token_budget, p.think_end_token_ids
    if budget is None or not end:
        return None
    out, start = row.output_token_ids, p.think_start_token_ids
    opened = 0  # output index where the thinking span's tokens begin
    if start:
        opened = _end_of_last(out, start)
        if opened < 0:  # not opened in the output: only in the prompt, if it ends inside an open span
            prompt = row.prompt_token_ids
            in_prompt = _end_of_last(prompt, start)
            if in_prompt < 0 or _end_of_last(prompt, end) > in_prompt:
                return None
            opened = 0
    if _closes(out, end, opened):
        return None
    j = len(out) - (opened + budget)
    return end[j] if 0 <= j < len(end) else None


def _end_of_last(ids: list[int], seq: list[int]) -> int:
    """Index just past the last occurrence of `seq` in `ids`, or -1."""
    n = len(seq)
    first = seq[0]
    for i in range(len(ids) - n, -1, -1):
        if ids[i] == first and ids[i:i + n] == seq:
            return i + n
    return -1


def _closes(ids: list[int], seq: list[int], start: int) -> bool:
    n, first = len(seq), seq[0]
    return any(ids[i] == first and ids[i:i + n] == seq for i in range(start, len(ids) - n + 1))


def _banned_tokens(row: SamplingRow) -> list[int]:
    """Stop tokens are masked until min_tokens outputs exist."""
    p = row.params
    if len(row.output_token_ids) >= p.min_tokens:
        return []
    banned = list(p.stop_token_ids)
    if row.eos_token_id is not None and not p.ignore_eos:
        banned.append(row.eos_token_id)
    return banned


def _apply_penalties(logits: torch.Tensor, row: SamplingRow) -> None:
    p, vocab, device = row.params, logits.shape[-1], logits.device
    out_ids = torch.tensor(row.output_token_ids, dtype=torch.long, device=device)
    if p.repetition_penalty != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool, device=device)
        seen[torch.tensor(row.prompt_token_ids, dtype=torch.long, device=device)] = True
        seen[out_ids] = True
        penalised = torch.where(logits > 0, logits / p.repetition_penalty, logits * p.repetition_penalty)
        logits.copy_(torch.where(seen, penalised, logits))
    if (p.frequency_penalty or p.presence_penalty) and len(out_ids):
        counts = torch.bincount(out_ids, minlength=vocab)[:vocab].to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def needs_host_history(params: SamplingParams) -> bool:
    """Whether sampling this request reads its token history or reports more than a token id (then
    its step cannot run ahead of the previous step's results under async scheduling)."""
    return bool(params.logprobs is not None or params.prompt_logprobs is not None or params.seed is not None
                or params.logit_bias or params.needs_penalties or params.min_tokens
                or params.thinking_token_budget is not None or params.needs_token_masks)


def takes_raw_argmax(params: SamplingParams) -> bool:
    """Whether this request's token is the argmax of the model's raw logits, which a decode graph computes
    (worker/cuda_graphs.py's DecodeHead): greedy, with nothing that changes the logits (penalties, logit bias,
    allowed or bad words, min_tokens, a thinking budget, a grammar's mask) or reports them (logprobs)."""
    return params.greedy and params.structured_outputs is None and not needs_host_history(params)


def sample_on_device(logits: torch.Tensor, rows: list[SamplingRow], generator: torch.Generator | None
                     ) -> torch.Tensor:
    """Tokens as a device tensor, with no host round trip, for rows where needs_host_history is False."""
    return _choose_tensor(logits, rows, generator)


def _choose(logits: torch.Tensor, rows: list[SamplingRow], generator: torch.Generator | None) -> list[int]:
    return _choose_tensor(logits, rows, generator).tolist()


def _choose_tensor(logits: torch.Tensor, rows: list[SamplingRow], generator: torch.Generator | None
                   ) -> torch.Tensor:
    """Greedy rows take the argmax; random rows race exponential noise: argmax(p / E), E ~ Exp(1),
    samples from p. Unseeded rows share one noise draw, so a step costs one device-to-host copy."""
    choice = greedy_tokens(logits)
    random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
    if random_rows:
        probs = probabilities([rows[i].params for i in random_rows], logits[random_rows])
        noise = torch.empty_like(probs).exponential_(generator=generator)
        for j, i in enumerate(random_rows):
            seed = rows[i].params.seed
            if seed is not None:  # keyed by (seed, output position): independent of batch and preemption
                g = torch.Generator().manual_seed(_mix(seed, len(rows[i].output_token_ids)))
                noise[j] = torch.empty(probs.shape[1]).exponential_(generator=g).to(noise.device)
        index = to_device(torch.tensor(random_rows), logits.device)
        choice = choice.index_copy(0, index, (probs / noise).argmax(dim=-1))
    return choice


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax; host fp32 rows take the C kernel (torch's CPU argmax is ten times slower)."""
    if (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
            and logits.stride(1) == 1 and cpu.available()):
        return cpu.argmax_rows(logits)
    return logits.argmax(dim=-1)


def probabilities(params: list[SamplingParams], logits: torch.Tensor) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p truncation, then softmax."""
    temps = to_device(torch.tensor([p.temperature for p in params], dtype=logits.dtype), logits.device).unsqueeze(1)
    logits = logits / temps
    if any(p.top_k for p in params):
        logits = _top_k(logits, [p.top_k for p in params])
    if any(p.top_p < 1.0 for p in params):
        logits = _top_p(logits, to_device(torch.tensor([p.top_p for p in params], dtype=logits.dtype), logits.device))
    probs = torch.softmax(logits, dim=-1)
    if any(p.min_p > 0 for p in params):
        min_p = to_device(torch.tensor([p.min_p for p in params], dtype=probs.dtype), probs.device).unsqueeze(1)
        probs = probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def _top_k(logits: torch.Tensor, ks: list[int]) -> torch.Tensor:
    vocab = logits.shape[-1]
    k = to_device(torch.tensor([min(k, vocab) if k else vocab for k in ks]), logits.device).unsqueeze(1)
    sorted_desc = logits.sort(dim=-1, descending=True).values
    kth = sorted_desc.gather(1, k - 1)
    return logits.masked_fill(logits < kth, _MASK)


def _top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    # Drop a token when the mass strictly before it already reaches top_p (the first always stays).
    mass_before = probs.cumsum(dim=-1) - probs
    drop_sorted = mass_before >= top_p.unsqueeze(1)
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return logits.masked_fill(drop, _MASK)


def _mix(seed: int, step: int) -> int:
    return (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9) & 0x7FFFFFFFFFFFFFFF
