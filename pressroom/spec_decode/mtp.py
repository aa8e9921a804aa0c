"""Multi-token prediction (MTP): DeepSeek's next-token-prediction layer, shipped in the checkpoint after the
decoder layers, drafts with the target's own final hidden states.

The MTP layer at position j reads the target's final (normed) hidden state h_j and the embedding of the
next token x_{j+1}: eh_proj([enorm(embed(x_{j+1})); hnorm(h_j)]) goes through one decoder layer (MLA and
the MoE, with a KV cache of its own in as many blocks as the target's) and the shared LM head after
shared_head.norm, predicting x_{j+2}. So after the target verified tokens x_0..x_m, the MTP positions up
to m - 1 are fed with the target's hidden states (handed over after every step as features), the last of
them gives the first draft, and each further draft feeds the layer's own output hidden state back in at
the next position (one layer reused for every draft position, as vLLM does). Positions computed from the
layer's own hidden states are recomputed from the target's once the target has verified them.

Drafts are drawn as the draft model's are (argmax for greedy requests, from q otherwise, q handed to the
lossless rejection sampler); the speculative budget weighs the layer's measured step cost.
"""
from __future__ import annotations

import torch
from torch import nn

from pressroom.config import SpeculativeConfig
from pressroom.core.outputs import SchedulerOutput
from pressroom.core.request import Request
from pressroom.model.layers.linear import ColumnParallelLinear
from pressroom.model.layers.norm import RMSNorm
from pressroom.model.loader import iter_safetensors
from pressroom.model.models.llama import LlamaDecoderLayer, RopeTables
from pressroom.spec_decode.draft_model import DraftModelProposer
from pressroom.worker.model_runner import ModelRunner
from pressroom.worker.proposer import Draft, DraftRequest


class MultiTokenPredictor(nn.Module):
    """The checkpoint's first MTP layer over the target's embedding, rotary and LM head (shared, not copied).
    `previous_hidden` [tokens, hidden] is set by the proposer before each forward pass: the hidden state
    each token position continues from (zeros where it is None: the cost profiles)."""

    def __init__(self, target: nn.Module) -> None:
        super().__init__()
        config = target.config
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.config = config
        self.index = config.num_hidden_layers  # the MTP layer's number in the checkpoint
        self.enorm, self.hnorm = RMSNorm(hidden, eps), RMSNorm(hidden, eps)
        self.eh_proj = ColumnParallelLinear(2 * hidden, hidden)
        self.layer = LlamaDecoderLayer(config, False, target.make_mlp(self.index), target.make_attention(self.index))
        self.shared_head_norm = RMSNorm(hidden, eps)
        self._target = (target,)  # a tuple: the target's modules are not this module's (its caches stay its own)
        self.previous_hidden: torch.Tensor | None = None
        self.cuda_graphs_supported = False  # previous_hidden is set from the host before each pass

    @property
    def target(self) -> nn.Module:
        return self._target[0]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The layer's output hidden state (before shared_head.norm) at each position."""
        model = self.target.model
        embedded = model.embed_tokens(input_ids)
        embedded = embedded.masked_fill((positions == 0).unsqueeze(-1), 0.0)  # as vLLM: position 0 has no past
        previous = self.previous_hidden
        if previous is None:
            previous = torch.zeros_like(embedded)
        x = self.eh_proj(torch.cat((self.enorm(embedded), self.hnorm(previous.to(embedded.dtype))), dim=-1))
        rope = RopeTables(model.rotary, *model.rotary.cos_sin(positions))
        x, residual = self.layer(rope, x, None)
        return x + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target.lm_head(self.shared_head_norm(hidden))

    def load_mtp_weights(self, weights) -> set[str]:
        """The MTP layer's tensors of a checkpoint (`model.layers.{index}.*`), through the target's own name
        handling (expert stacking, rope row order); its copies of the embedding and LM head are skipped
        (DeepSeek's are the target's). Returns the names loaded."""
        prefix = f"model.layers.{self.index}."
        own = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
               "shared_head.norm.weight": "shared_head_norm.weight"}
        shared = ("embed_tokens.weight", "shared_head.head.weight")
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            if not name.startswith(prefix):
                continue
            rest = name[len(prefix):]
            if rest in shared:
                continue
            if rest in own:
                target_name, shard = own[rest], None
            else:
                name, tensor = self.target._deinterleave_rope(name, tensor)
                target_name, shard = self.target.checkpoint_target(name)
                target_name = "layer." + target_name[len(prefix):]
            param = params.get(target_name)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the MTP layer.")
            loader = getattr(param, "weight_loader", None)
            if loader is None:
                if param.shape != tensor.shape:
                    raise ValueError(f"{name}: shape {tuple(tensor.shape)}, the MTP layer expects "
                                     f"{tuple(param.shape)}.")
                param.data.copy_(tensor)
            else:
                loader(param, tensor, shard) if shard is not None else loader(param, tensor)
            loaded.add(rest)
        return loaded

    def expected_weights(self) -> set[str]:
        """Checkpoint names (after `model.layers.{index}.`) every parameter needs."""
        names = set()
        for name, _ in self.named_parameters():
            if name.startswith("layer."):
                full = f"model.layers.{self.index}.{name[len('layer.'):]}"
                names.update(part[len(f"model.layers.{self.index}."):] for part in self.target.checkpoint_parts(full))
        return names | {"enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"}


def build_predictor(config: SpeculativeConfig, target: ModelRunner) -> MultiTokenPredictor:
    model = target.model
    if not getattr(model.config, "num_nextn_predict_layers", 0):
        raise ValueError(f'speculative_config method "mtp" needs a checkpoint with next-token-prediction layers '
                         f"(num_nextn_predict_layers > 0); {type(model).__name__}'s config has none.")
    if not hasattr(model, "_deinterleave_rope"):
        raise ValueError(f'speculative_config method "mtp" serves DeepSeek-V3-style checkpoints; '
                         f"{type(model).__name__} has no MTP layers pressroom can load.")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(target.dtype)
    try:
        with torch.device(target.device):
            predictor = MultiTokenPredictor(model)
    finally:
        torch.set_default_dtype(previous)
    loaded = predictor.load_mtp_weights(iter_safetensors(config.model))
    if not loaded:
        raise ValueError(f'speculative_config method "mtp": the checkpoint at {config.model!r} has no next-token-'
                         f"prediction layer (model.layers.{predictor.index}.*), though its config says "
                         f"num_nextn_predict_layers={model.config.num_nextn_predict_layers}; use a checkpoint "
                         "that ships it.")
    missing = sorted(predictor.expected_weights() - loaded)
    if missing:
        raise ValueError(f"The checkpoint's MTP layer lacks {len(missing)} tensor(s), e.g. {missing[:3]}.")
    return predictor.eval()


class MTPProposer(DraftModelProposer):
    """The draft model's machinery (own cache, catch-up, single-token draft steps), over the MTP layer's
    sequence: its position j holds token x_{j+1} (the request's tokens shifted by one) and reads the
    target's hidden state h_j (or, past the verified tokens, its own)."""

    works_on_device = False  # the hidden states it continues from are handed over on the host side

    def __init__(self, config: SpeculativeConfig, target: ModelRunner) -> None:  # no super(): no model to load
        self.k = config.num_speculative_tokens
        self.predictor = build_predictor(config, target)
        self.max_len = getattr(target.model.config, "max_position_embeddings", None) or 4096
        self.hf_config = target.model.config
        self.runner = ModelRunner(self.predictor, target.block_size, target.dtype, seed=1, device=target.device)
        self.kv = None
        self.target = target
        self.requests: dict[str, Request] = {}
        self.behind: dict[str, int] = {}
        self.generator = torch.Generator(device=target.device).manual_seed(1)
        self.final_norm = target.model.model.norm
        self.pending: dict[str, list[torch.Tensor]] = {}  # target features not yet fed to the MTP layer
        self.fed: dict[str, int] = {}  # MTP positions computed from the target's hidden states
        self.last_hidden: dict[str, torch.Tensor] = {}  # the layer's newest output, per drafting request

    def aux_layers(self) -> tuple[int, ...]:
        return (self.hf_config.num_hidden_layers - 1,)

    def observe_features(self, req_id: str, rows: torch.Tensor) -> None:
        self.pending.setdefault(req_id, []).append(rows)

    def forget(self, req_ids) -> None:
        req_ids = list(req_ids)
        for rid in req_ids:
            self.pending.pop(rid, None)
            self.fed.pop(rid, None)
            self.last_hidden.pop(rid, None)
        super().forget(req_ids)

    def capture_cudagraphs(self, compilation, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        """None: each pass's hidden states come from the host."""

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> dict[str, Draft]:
        wanted = [r for r in requests if r.max_drafts > 0 and len(r.token_ids) + self.k <= self.max_len]
        if not wanted:
            return {}
        self._ensure_cache()
        shifted = [DraftRequest(r.req_id, r.token_ids[1:], r.max_drafts, r.params) for r in wanted]
        k = min(self.k, max(r.max_drafts for r in wanted))
        drafts: dict[str, list[int]] = {r.req_id: [] for r in wanted}
        probs: dict[str, list[torch.Tensor]] = {r.req_id: [] for r in wanted}
        sched = self._catch_up(shifted)
        inputs = self._target_hidden(shifted, sched)
        active = shifted
        for step in range(k):
            states, logits = self._step(sched, inputs)
            by_id = {r.req_id: r for r in active}
            for state, row in zip(states, logits):
                token, q = self._draw(row, by_id[state.req_id])
                state.token_ids.append(token)
                drafts[state.req_id].append(token)
                if q is not None:
                    probs[state.req_id].append(q)
            active = [r for r in active if len(drafts[r.req_id]) < min(k, r.max_drafts)]
            if step + 1 == k or not active:
                break
            sched = self._one_more(active)
            inputs = {r.req_id: self.last_hidden[r.req_id] for r in active}
        return {rid: Draft(ids, torch.stack(probs[rid]) if probs[rid] else None)
                for rid, ids in drafts.items() if ids}

    def _valid_prefix(self, req: Request, token_ids: list[int]) -> int:
        """Also no further than the positions fed with the target's hidden states: the rest used the layer's."""
        return min(super()._valid_prefix(req, token_ids), self.fed.get(req.request_id, 0))

    def _target_hidden(self, requests: list[DraftRequest], sched: SchedulerOutput) -> dict[str, torch.Tensor]:
        """Per request, the target's normed hidden state at each MTP position the catch-up schedules: the
        features handed over since the last proposal end at the request's newest position; positions
        before them (a prefix the target's cache already held) continue from zeros."""
        inputs = {}
        for r in requests:
            count = sched.num_scheduled_tokens[r.req_id]
            end = len(r.token_ids)  # MTP positions fed after this step: every shifted token's
            rows = self.pending.pop(r.req_id, [])
            known = torch.cat(rows)[-count:] if rows else None
            have = 0 if known is None else known.shape[0]
            hidden = self.final_norm(known) if known is not None else None
            if have < count:
                pad = torch.zeros(count - have, self.hf_config.hidden_size, dtype=self.target.dtype,
                                  device=self.target.device)
                hidden = pad if hidden is None else torch.cat((pad, hidden))
            inputs[r.req_id] = hidden
            self.fed[r.req_id] = end
        return inputs

    def _step(self, sched: SchedulerOutput, inputs: dict[str, torch.Tensor]):
        """One MTP pass: each request's positions read their rows of `inputs`; returns the states that
        reached their end and their logits, and keeps each one's last output hidden state."""
        runner = self.runner
        runner._update_states(sched)
        batch = runner._prepare(sched)
        self.predictor.previous_hidden = torch.cat([inputs[s.req_id] for s in batch.order])
        try:
            hidden = runner.run_model(batch.input_ids, batch.positions, batch.meta)
        finally:
            self.predictor.previous_hidden = None
        rows = runner._sampling_rows(batch, sched)
        last = runner._last_hidden(batch, hidden, rows)
        for (_, state), h in zip(rows, last):
            self.last_hidden[state.req_id] = h.unsqueeze(0)
        return [s for _, s in rows], self.predictor.compute_logits(last).float()
