"""A smaller model with the target's vocabulary drafts K tokens autoregressively, with its own KV cache.

Each step the draft model first catches up on the tokens the target verified since its last call
(the accepted drafts and the target's own next token; KV of rejected drafts is overwritten), then
runs K single-token steps for all requests at once. At temperature > 0 each draft token is drawn
from the draft's distribution q (temperature, top-k/p, min-p as the request asks), and q goes to
the rejection sampler, so verification stays lossless; greedy requests draft the argmax.

Under async scheduling (`propose_on_device`) nothing may wait for the host, so the draft model
mirrors the target's steps instead: its cache has the target's block layout (same block ids and
slots), and each step it runs, for every request the budget planned drafts for, the target's query
tokens up to the drafts, then the tokens the target emitted (padded to 1 + k, at the positions that
follow), takes the logits at the last emitted one (an index computed on the device), and runs up to
K - 1 single-token steps, each over the rows planned that deep (`TargetStep.draft_limits`; the other
rows keep filler drafts, never verified). A request planned no drafts is not run at all: it falls
behind, and the next pass that mirrors it first catches up on those tokens from the host. Positions
past the verified ones hold garbage until a later step writes them again; the scheduler reserves K
slots past each request's step for these writes. Every pass replays a CUDA graph where one fits.
"""
from __future__ import annotations

import itertools
from collections.abc import Iterable

import torch

from pressroom.attention.backend import AttentionMetadata
from pressroom.config import ModelConfig, SpeculativeConfig
from pressroom.core.kv_cache_manager import KVCacheManager
from pressroom.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from pressroom.core.request import Request
from pressroom.model.loader import load_model
from pressroom.sampling_params import SamplingParams
from pressroom.worker.device import to_device
from pressroom.worker.model_runner import ModelRunner
from pressroom.worker.profiling import profile_step_costs
from pressroom.worker.proposer import DeviceDrafts, Draft, DraftRequest, Proposer, TargetStep
from pressroom.worker.sampler import probabilities


class DraftModelProposer(Proposer):
    works_on_device = True

    def __init__(self, config: SpeculativeConfig, target: ModelRunner) -> None:
        self.k = config.num_speculative_tokens
        loaded = load_model(ModelConfig(model=config.model, dtype=target.dtype, skip_tokenizer_init=True,
                                        quantization="none"), target.device)
        target_vocab = target.model.config.vocab_size
        if loaded.hf_config.vocab_size != target_vocab:
            raise ValueError(f"The draft model's vocabulary ({loaded.hf_config.vocab_size} tokens) differs from the "
                             f"target's ({target_vocab}); a draft model must share the target's tokenizer.")
        self.max_len = getattr(loaded.hf_config, "max_position_embeddings", None) or 2048
        self.hf_config = loaded.hf_config
        self.runner = ModelRunner(loaded.model, target.block_size, target.dtype, seed=1, device=target.device)
        self.kv: KVCacheManager | None = None  # sized like the target's cache on first use
        self.target = target
        self.requests: dict[str, Request] = {}  # the draft cache's view of each request
        # Async: tokens a request's last steps ran on the target but not here (positions just before its
        # next query), caught up from the host the next time it is mirrored.
        self.behind: dict[str, int] = {}
        self.generator = torch.Generator(device=target.device).manual_seed(1)

    def forget(self, req_ids: Iterable[str]) -> None:
        for rid in req_ids:
            self.behind.pop(rid, None)
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

    def kv_bytes_per_block(self) -> int:
        """The draft cache holds as many blocks as the target's: its bytes per block join the target's
        when the KV memory is divided into blocks."""
        return self.runner.kv_cache_bytes_per_block()

    def profile_decode_steps(self, counts: list[int]) -> list[tuple[int, float]]:
        """Seconds of one draft step over each number of single-token rows (the budget's draft cost)."""
        self._ensure_any_cache()
        return profile_step_costs(self.runner, counts, 1)

    def profile_first_draft_steps(self, counts: list[int]) -> list[tuple[int, float]] | None:
        """Under async scheduling, seconds of the mirror pass that makes the first draft, over each number
        of rows (two tokens each: the step's input and the target's token); None when the first draft
        comes with the catch-up the synchronous path runs anyway."""
        if not self.target.device_drafting:
            return None
        self._ensure_mirror_cache()
        return [(n // 2, t) for n, t in profile_step_costs(self.runner, [2 * c for c in counts], 2)]

    def capture_cudagraphs(self, compilation, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        """The draft model's own graphs: single-token draft steps, and under async scheduling its mirror
        passes (up to 2 + K tokens per request: the step's input, K verified drafts, the target's token)."""
        self._ensure_any_cache()
        longest = 2 + self.k if self.target.device_drafting else 1
        self.runner.capture_cudagraphs(compilation.graph_shapes(max_num_seqs, max_num_batched_tokens, longest),
                                       max_num_seqs)

    def _ensure_any_cache(self) -> None:
        if self.target.device_drafting:
            self._ensure_mirror_cache()
        else:
            self._ensure_cache()

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

    # ---- async scheduling: the draft model mirrors each target step on the device ----

    @torch.inference_mode()
    def propose_on_device(self, step: TargetStep) -> DeviceDrafts | None:
        """K drafts per sampled request ([sampled, K]) and their q ([sampled, K, vocab], zero rows for
        greedy requests; None when all are greedy); None when no request is mirrored. Rows the budget
        planned no drafts for (and that verified none) are not run: their tokens wait, on the host, for
        the next pass that mirrors them (`self.behind`), so a batch that drafts nothing costs nothing."""
        self._ensure_mirror_cache()
        mirrored = self._mirrored_rows(step)
        if not mirrored:
            return None
        meta, ids, positions, pick = self._mirror_batch(step, mirrored)
        hidden = self.runner.run_model(ids, self._rotary(positions), meta)
        token, q = draw_rows(self.runner.model.compute_logits(hidden[pick]).float(),
                             [step.params[j] for j in mirrored], self.generator)
        dev, n = ids.device, len(step.sampled)
        where = None if len(mirrored) == n else to_device(torch.tensor(mirrored), dev)
        token, q, base = (_spread(t, where, n) for t in (token, q, positions[pick]))
        drafts, probs = [token], [q]
        tables = step.meta.block_tables[to_device(torch.tensor(step.sampled), dev)]
        bound = [step.meta.seq_lens_host[i] for i in step.sampled]
        active = mirrored
        for j in range(1, self.k):
            # Only the rows the budget planned this deep (the first draft came with the mirror pass).
            active = [r for r in active if step.draft_limits[r] > j]
            if not active:
                break
            idx = None if len(active) == n else to_device(torch.tensor(active), dev)
            position = _rows(base, idx) + j
            meta = self._decode_meta(_rows(tables, idx), position, [bound[r] + j for r in active])
            hidden = self.runner.run_model(_rows(drafts[-1], idx), self._rotary(position), meta)
            token, q = draw_rows(self.runner.model.compute_logits(hidden).float(),
                                 [step.params[r] for r in active], self.generator)
            if idx is not None:  # rows that stopped keep a filler draft, never verified
                token = drafts[-1].index_copy(0, idx, token)
                q = None if probs[-1] is None else probs[-1].index_copy(0, idx, q) if q is not None else probs[-1]
            drafts.append(token)
            probs.append(q)
        drafts += [drafts[-1]] * (self.k - len(drafts))
        probs += [probs[-1]] * (self.k - len(probs))
        return torch.stack(drafts, dim=1), None if probs[0] is None else torch.stack(probs, dim=1)

    def _ensure_mirror_cache(self) -> None:
        if not self.runner.kv_caches:
            # The target's block layout, room for the same context (the target's tables include the lookahead).
            self.runner.initialize_kv_cache(self.target.kv_caches[0].shape[1],
                                            self.target.max_blocks_per_seq * self.target.block_size)

    def _mirrored_rows(self, step: TargetStep) -> list[int]:
        """Sampled rows (indices into step.sampled) the draft model runs this step: those the budget planned
        drafts for, and those that verified drafts (their accepted ones are known only on the device).
        Every other request of the batch falls behind by its query tokens."""
        mirrored = [j for j in range(len(step.sampled)) if step.draft_limits[j] > 0 or step.num_drafts[j] > 0]
        running = {step.sampled[j] for j in mirrored}
        loc = step.meta.query_start_loc
        for i, rid in enumerate(step.req_ids):
            if i not in running:
                self.behind[rid] = self.behind.get(rid, 0) + loc[i + 1] - loc[i]
        return mirrored

    def _mirror_batch(self, step: TargetStep, mirrored: list[int]
                      ) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per mirrored request: the tokens it fell behind by (from the host, at the positions before this
        step's), the target's query tokens before its drafts, then its emitted tokens padded to 1 + k at
        the positions after the last of those. Also the flat index of each one's last emitted token
        (where its first draft's logits are).

        A request behind verified no drafts in its last step, so this step's positions, known on the
        host, are exact, and its missing tokens all come from steps already resolved."""
        loc, dev, bs = step.meta.query_start_loc, step.input_ids.device, self.target.block_size
        width = step.tokens.shape[1]
        caught_up_from = loc[-1] + len(step.sampled) * width  # where the host's catch-up tokens go in `tokens`
        src, pos_src, pos_add, owner, pick, catch_up, draft_loc = [], [], [], [], [], [], [0]
        for j in mirrored:
            i, k = step.sampled[j], step.num_drafts[j]
            behind = self.behind.pop(step.req_ids[i], 0)
            if behind:
                start = step.starts[i]
                missing = step.token_ids[i][start - behind:start]
                assert len(missing) == behind, "a mirrored request's missing tokens are not on the host yet"
                src.extend(range(caught_up_from + len(catch_up), caught_up_from + len(catch_up) + behind))
                catch_up.extend(missing)
                pos_src.extend([loc[i]] * behind)
                pos_add.extend(range(-behind, 0))
            known = loc[i + 1] - loc[i] - k
            src.extend(range(loc[i], loc[i] + known))
            pos_src.extend(range(loc[i], loc[i] + known))
            pos_add.extend([0] * known)
            pick.append(draft_loc[-1] + behind + known)
            src.extend(loc[-1] + j * width + t for t in range(k + 1))
            pos_src.extend([loc[i] + known - 1] * (k + 1))
            pos_add.extend(range(1, k + 2))
            m = behind + known + k + 1
            owner.extend([len(draft_loc) - 1] * m)
            draft_loc.append(draft_loc[-1] + m)
        parts = [step.input_ids, step.tokens.flatten()]
        if catch_up:
            parts.append(to_device(torch.tensor(catch_up, dtype=step.input_ids.dtype), dev))
        ids = torch.cat(parts)[to_device(torch.tensor(src), dev)]
        positions = step.positions[to_device(torch.tensor(pos_src), dev)] + to_device(torch.tensor(pos_add), dev)
        rows = to_device(torch.tensor([step.sampled[j] for j in mirrored]), dev)
        tables = step.meta.block_tables[rows]
        blocks = tables[to_device(torch.tensor(owner), dev), positions // bs].long()
        seq_lens = step.meta.seq_lens[rows] + 1  # the target's token emitted past the drafts runs here too
        cuda = dev.type == "cuda"
        host_lens = [step.meta.seq_lens_host[step.sampled[j]] + 1 for j in mirrored]
        # The draft runner's builder makes the device query starts too, where its backend reads them.
        meta = self.runner.attn_builder.build(
            num_decodes=0, slot_mapping=blocks * bs + positions % bs, block_tables=tables, seq_lens=seq_lens,
            query_start_loc=draft_loc,
            # The CPU backend reads exact host lengths (free there); on CUDA an upper bound, never read.
            seq_lens_host=host_lens if cuda else seq_lens.tolist(),
            max_query_len=max(b - a for a, b in itertools.pairwise(draft_loc)))
        counts = step.counts if len(mirrored) == len(step.sampled) else step.counts[rows.new_tensor(mirrored)]
        return meta, ids, positions, to_device(torch.tensor(pick, dtype=torch.long), dev) + counts.long() - 1

    def _decode_meta(self, tables: torch.Tensor, position: torch.Tensor, bound: list[int]) -> AttentionMetadata:
        """A single-token draft step over `tables`' rows, made by the draft runner's builder: it splits the
        step as the draft's decode graph of its padded size does (`split_as_graphs`, at capture)."""
        n, bs, dev = len(bound), self.target.block_size, position.device
        builder = self.runner.attn_builder
        seq_lens = (position + 1).to(builder.index_dtype)
        blocks = tables[torch.arange(n, device=dev), position // bs].long()
        return builder.build(
            num_decodes=n, slot_mapping=blocks * bs + position % bs, block_tables=tables, seq_lens=seq_lens,
            query_start_loc=list(range(n + 1)),
            # The CPU backend reads exact host lengths (free there); on CUDA an upper bound, never read.
            seq_lens_host=bound if dev.type == "cuda" else seq_lens.tolist(), max_query_len=1)

    def _rotary(self, positions: torch.Tensor) -> torch.Tensor:
        """Positions the draft model can embed: past its own limit only garbage or weak drafts are made,
        and verification keeps the output exact either way."""
        return positions.clamp(max=self.max_len - 1)


def draw_rows(logits: torch.Tensor, params: list[SamplingParams], generator: torch.Generator
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One draft per row: the argmax for greedy rows, a draw from q otherwise; q is kept for verification
    (zero rows for greedy ones; None when every row is greedy)."""
    tokens = logits.argmax(dim=-1)
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if not sampled:
        return tokens, None
    index = to_device(torch.tensor(sampled), logits.device)
    q_rows = probabilities([params[i] for i in sampled], logits[index])
    noise = torch.empty_like(q_rows).exponential_(generator=generator)
    tokens = tokens.index_copy(0, index, (q_rows / noise).argmax(dim=-1))
    return tokens, logits.new_zeros(logits.shape).index_copy_(0, index, q_rows)


def _rows(t: torch.Tensor, idx: torch.Tensor | None) -> torch.Tensor:
    return t if idx is None else t.index_select(0, idx)


def _spread(t: torch.Tensor | None, where: torch.Tensor | None, n: int) -> torch.Tensor | None:
    """Rows computed for a subset (`where`) of n rows, placed into n rows (zeros elsewhere: fillers)."""
    if t is None or where is None:
        return t
    return t.new_zeros((n, *t.shape[1:])).index_copy_(0, where, t)
