"""Multi-token prediction (MTP): DeepSeek's next-token-prediction layer, shipped in the checkpoint after the
decoder layers, drafts with the target's own final hidden states.

The MTP layer at position j reads the target's final (normed) hidden state h_j and the embedding of the
next token x_{j+1}: eh_proj([enorm(embed(x_{j+1})); hnorm(h_j)]) goes through one decoder layer (MLA and
the MoE) and the shared LM head after shared_head.norm, predicting x_{j+2}. Its KV cache is a tensor of
its own in the target's block tables: MTP position j sits in the target's slot for position j, and the
scheduler keeps K slots past each request's step for the draft positions. After the target verified tokens
x_0..x_m, every MTP position up to m - 1 has been fed the target's hidden states (handed over after every
step as features), the last gives the first draft, and each further draft feeds the layer's own output back
in at the next position; those positions are computed again from the target's hidden states once the
target has verified them.

With several MTP layers (num_nextn_predict_layers = L), draft j (from 0) comes from layer j mod L, so a
checkpoint with fewer layers than drafts reuses them in turn (one layer: that layer for every draft, as
vLLM). Every layer catches up on the target's hidden states, so each one's cache holds every verified
position. Drafts are drawn as the draft model's are (argmax for greedy requests, from q otherwise, q
handed to the lossless rejection sampler); the speculative budget weighs a layer's measured step cost.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pressroom.config import SpeculativeConfig
from pressroom.model.layers.linear import ColumnParallelLinear
from pressroom.model.layers.norm import RMSNorm
from pressroom.model.loader import iter_safetensors
from pressroom.model.models.deepseek_v4 import DeepseekV4ForCausalLM
from pressroom.model.models.llama import LlamaDecoderLayer, RopeTables
from pressroom.model.quantization import checkpoint_quantization, resolve_method
from pressroom.model.weights import load_named_weights
from pressroom.spec_decode.draft_model import draw_rows
from pressroom.spec_decode.mtp_v4 import V4MultiTokenPredictor
from pressroom.worker.device import to_device
from pressroom.worker.model_runner import ModelRunner
from pressroom.worker.profiling import profile_step_costs
from pressroom.worker.proposer import Draft, DraftRequest, Proposer


class MTPModule(nn.Module):
    """One of the checkpoint's MTP layers (`model.layers.{index}.*`): its norms, eh_proj, decoder layer and
    shared_head.norm; the embedding and LM head are the target's."""

    def __init__(self, target: nn.Module, index: int) -> None:
        super().__init__()
        config = target.config
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.index = index
        self.enorm, self.hnorm = RMSNorm(hidden, eps), RMSNorm(hidden, eps)
        self.eh_proj = ColumnParallelLinear(2 * hidden, hidden, gather_output=True)  # whole on every rank
        self.layer = LlamaDecoderLayer(config, False, target.make_mlp(index), target.make_attention(index))
        self.shared_head_norm = RMSNorm(hidden, eps)


# checkpoint names (after `model.layers.{index}.`) of an MTP module's own tensors, and their parameters
_OWN = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
        "shared_head.norm.weight": "shared_head_norm.weight"}
_SHARED = ("embed_tokens.weight", "shared_head.head.weight")  # DeepSeek's copies of the target's


class MultiTokenPredictor(nn.Module):
    """The checkpoint's MTP layers over the target's embedding, rotary and LM head (shared, not copied). The
    proposer sets, before each forward pass, `active` (which layer runs) and `previous_hidden` [tokens,
    hidden]: the hidden state each token position continues from (zeros where it is None: the cost
    profiles). Each layer has its own KV cache; only the active one's is read and written in a pass."""

    def __init__(self, target: nn.Module) -> None:
        super().__init__()
        config = target.config
        self.config = config
        first = config.num_hidden_layers  # the first MTP layer's number in the checkpoint
        self.mtp = nn.ModuleList(MTPModule(target, first + i) for i in range(config.num_nextn_predict_layers))
        self._target = (target,)  # a tuple: the target's modules are not this module's (its caches stay its own)
        self.active = 0
        self.previous_hidden: torch.Tensor | None = None
        self.cuda_graphs_supported = False  # previous_hidden is set from the host before each pass

    @property
    def target(self) -> nn.Module:
        return self._target[0]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The active layer's output hidden state (before shared_head.norm) at each position."""
        model, mtp = self.target.model, self.mtp[self.active]
        embedded = model.embed_tokens(input_ids)
        embedded = embedded.masked_fill((positions == 0).unsqueeze(-1), 0.0)  # as vLLM: position 0 has no past
        previous = self.previous_hidden
        if previous is None:
            previous = torch.zeros_like(embedded)
        x = mtp.eh_proj(torch.cat((mtp.enorm(embedded), mtp.hnorm(previous.to(embedded.dtype))), dim=-1))
        rope = RopeTables(model.rotary, *model.rotary.cos_sin(positions))
        x, residual = mtp.layer(rope, x, None)
        return x + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target.lm_head(self.mtp[self.active].shared_head_norm(hidden))

    def features(self, rows: torch.Tensor) -> torch.Tensor:
        """What the target hands over (its last layer's residual stream) as the layer reads it: normed."""
        return self.target.model.norm(rows)

    @property
    def checkpoint_pattern(self) -> str:
        """The checkpoint names of the first MTP layer (for an error that finds none)."""
        return f"model.layers.{self.mtp[0].index}.*"

    def mtp_tensors(self, weights):
        """The checkpoint's tensors as they come: `load_mtp_weights` picks the MTP layers' own by name."""
        return weights

    def load_mtp_weights(self, weights) -> set[str]:
        """The MTP layers' tensors of a checkpoint (`model.layers.{index}.*`), through the target's own name
        handling (expert stacking, rope row order); their copies of the embedding and LM head are skipped.
        Returns the checkpoint names loaded."""
        names = _MtpNames(self)
        wanted = ((n, t) for n, t in weights if not names.skips(n))  # the target's own tensors are never read
        return load_named_weights(self, (names.reorder(n, t) for n, t in wanted), names)

    def expected_weights(self) -> set[str]:
        """Checkpoint names every parameter needs."""
        names = set()
        for m in self.mtp:
            prefix = f"model.layers.{m.index}."
            names.update(prefix + own for own in _OWN)
            for name, _ in m.layer.named_parameters():
                names.update(self.target.checkpoint_parts(prefix + name))
        return names


class _MtpNames:
    """The MTP layers' name map: checkpoint `model.layers.{index}.X` loads into `mtp.{i}.X` for an MTP module's
    own tensors (_OWN), else into `mtp.{i}.layer.` + the target's parameter for X."""

    def __init__(self, predictor: MultiTokenPredictor) -> None:
        self.target = predictor.target
        self.modules = {f"model.layers.{m.index}.": i for i, m in enumerate(predictor.mtp)}

    @staticmethod
    def _split(name: str) -> tuple[str, str]:
        prefix = ".".join(name.split(".")[:3]) + "."
        return prefix, name[len(prefix):]

    def skips(self, name: str) -> bool:
        prefix, rest = self._split(name)
        return prefix not in self.modules or rest in _SHARED

    def reorder(self, name: str, tensor):
        """The target's rope row order, for the decoder layer's tensors."""
        return (name, tensor) if self._split(name)[1] in _OWN else self.target.deinterleave_rope(name, tensor)

    def checkpoint_target(self, name: str) -> tuple[str, object]:
        prefix, rest = self._split(name)
        here = f"mtp.{self.modules[prefix]}."
        if rest in _OWN:
            return here + _OWN[rest], None
        target, shard = self.target.checkpoint_target(name)
        return here + "layer." + target[len(prefix):], shard


def build_predictor(config: SpeculativeConfig, target: ModelRunner) -> MultiTokenPredictor | V4MultiTokenPredictor:
    model = target.model
    if not getattr(model.config, "num_nextn_predict_layers", 0):
        raise ValueError(f'speculative_config method "mtp" needs a checkpoint with next-token-prediction layers '
                         f"(num_nextn_predict_layers > 0); {type(model).__name__}'s config has none.")
    if isinstance(model, DeepseekV4ForCausalLM):
        kind = V4MultiTokenPredictor
    elif hasattr(model, "deinterleave_rope"):
        kind = MultiTokenPredictor
    else:
        raise ValueError(f'speculative_config method "mtp" serves DeepSeek-V3-style checkpoints; '
                         f"{type(model).__name__} has no MTP layers pressroom can load.")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(target.dtype)
    try:
        with torch.device(target.device):
            predictor = kind(model)
    finally:
        torch.set_default_dtype(previous)
    weights = predictor.mtp_tensors(iter_safetensors(config.model))
    method = resolve_method("none", checkpoint_quantization(model.config, config.model))
    if method is not None:  # an FP8 block checkpoint: its weights joined with their scales, dequantized
        weights = method.checkpoint_weights(predictor, weights)
    loaded = predictor.load_mtp_weights(weights)
    if not loaded:
        raise ValueError(f'speculative_config method "mtp": the checkpoint at {config.model!r} has no next-token-'
                         f"prediction layer ({predictor.checkpoint_pattern}), though its config says "
                         f"num_nextn_predict_layers={model.config.num_nextn_predict_layers}; use a checkpoint "
                         "that ships it.")
    missing = sorted(predictor.expected_weights() - loaded)
    if missing:
        raise ValueError(f"The checkpoint's MTP layers lack {len(missing)} tensor(s), e.g. {missing[:3]}.")
    return predictor.eval()


class MTPProposer(Proposer):
    """Drafts with the MTP layer over the target's block tables: MTP position j of a request sits in the
    target's slot for position j, in a cache tensor of the layer's own (as many blocks as the target's), and
    the scheduler keeps K slots past each request's step for the draft positions."""

    works_on_device = False  # it continues from hidden states handed over on the host side
    shares_block_tables = True

    def __init__(self, config: SpeculativeConfig, target: ModelRunner) -> None:
        self.k = config.num_speculative_tokens
        self.predictor = build_predictor(config, target)
        self.runner = ModelRunner(self.predictor, target.block_size, target.dtype, seed=1, device=target.device,
                                  kv_dtype=target.kv_dtype)
        self.target = target
        self.generator = torch.Generator(device=target.device).manual_seed(1)
        self.pending: dict[str, list[torch.Tensor]] = {}  # target features not yet fed to the MTP layer

    # ---- what the runner hands over ----

    def aux_layers(self) -> tuple[int, ...]:
        return (self.predictor.config.num_hidden_layers - 1,)

    def observe_features(self, req_id: str, rows: torch.Tensor) -> None:
        self.pending.setdefault(req_id, []).append(rows)

    def forget(self, req_ids: Iterable[str]) -> None:
        for rid in req_ids:
            self.pending.pop(rid, None)

    # ---- costs and set-up ----

    def kv_bytes_per_block(self) -> int:
        return self.runner.kv_cache_bytes_per_block()

    def profile_decode_steps(self, counts: list[int]) -> list[tuple[int, float]]:
        self._ensure_cache()
        return profile_step_costs(self.runner, counts, 1)

    def _ensure_cache(self) -> None:
        if not self.runner.kv_caches:  # the target's blocks; its tables' width includes the lookahead
            self.runner.initialize_kv_cache(self.target.kv_caches[0].shape[1],
                                            self.target.max_blocks_per_seq * self.target.block_size)

    # ---- drafting ----

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> dict[str, Draft]:
        """Every request with new target hidden states catches up (so none piles them up); those that want
        drafts then get up to K, the first from the catch-up's last position."""
        caught = [r for r in requests if r.req_id in self.pending and self._pending_rows(r.req_id)]
        if not caught:
            return {}
        self._ensure_cache()
        caught.sort(key=lambda r: self._pending_rows(r.req_id) != 1)  # decodes first, as the backends want
        tables = self._tables(caught)
        last = self._catch_up(caught, tables)
        wanted = [i for i, r in enumerate(caught) if r.max_drafts > 0]
        if not wanted:
            return {}
        rows = self._dev(torch.tensor(wanted))
        tables, last = tables[rows], last[rows]
        reqs = [caught[i] for i in wanted]
        k = min(self.k, max(r.max_drafts for r in reqs))
        token, q = draw_rows(self.predictor.compute_logits(last).float(), [r.params for r in reqs], self.generator)
        drafts, probs = [token], [q]
        first = torch.tensor([len(r.token_ids) - 1 for r in reqs])  # the MTP position after the catch-up's
        for j in range(1, k):
            # rows still drafting continue; the others keep their last draft as a filler, cut off below
            self.predictor.active = j % len(self.predictor.mtp)
            last = self._draft_step(drafts[-1], last, first + j - 1, tables)
            token, q = draw_rows(self.predictor.compute_logits(last).float(), [r.params for r in reqs], self.generator)
            drafts.append(token)
            probs.append(q)
        ids = torch.stack(drafts, dim=1).tolist()
        out = {}
        for i, r in enumerate(reqs):
            n = min(k, r.max_drafts)
            out[r.req_id] = Draft(ids[i][:n], None if r.params.greedy else torch.stack([p[i] for p in probs[:n]]))
        return out

    def _pending_rows(self, req_id: str) -> int:
        return sum(rows.shape[0] for rows in self.pending[req_id])

    def _catch_up(self, caught: list[DraftRequest], tables: torch.Tensor) -> torch.Tensor:
        """For a request of m tokens whose last P target hidden states came since its last catch-up: MTP
        positions m-1-P..m-2, position j reading token x_{j+1} and the target's normed hidden state h_j
        (positions before were fed at earlier catch-ups, or, first time round, lie in a prefix the target's
        cache held: the MTP entries its blocks hold are taken as they are), through every MTP layer. Returns
        layer 0's output at each request's last position."""
        ids, positions, hidden, loc, lens = [], [], [], [0], []
        for r in caught:
            rows = torch.cat(self.pending.pop(r.req_id))
            end = len(r.token_ids) - 1
            start = end - rows.shape[0]
            ids.extend(r.token_ids[start + 1:end + 1])
            positions.extend(range(start, end))
            hidden.append(self.predictor.features(rows))
            loc.append(loc[-1] + end - start)
            lens.append(end)
        counts = torch.tensor(loc[1:]) - torch.tensor(loc[:-1])
        owners = torch.repeat_interleave(torch.arange(len(caught)), counts)
        positions_t = torch.tensor(positions)
        meta = self._meta(tables, owners, positions_t, loc, lens, num_decodes=int((counts == 1).sum()))
        ids_t, hidden_t = torch.tensor(ids), torch.cat(hidden)
        for layer in reversed(range(len(self.predictor.mtp))):  # layer 0 last: its output gives the first draft
            self.predictor.active = layer
            out = self._run(ids_t, positions_t, hidden_t, meta)
        return out[self._dev(torch.tensor(loc[1:]) - 1)]

    def _draft_step(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                    tables: torch.Tensor) -> torch.Tensor:
        """One draft position per row (host `positions`): the previous draft and the layer's own previous
        output; returns the layer's output."""
        n = positions.shape[0]
        lens = (positions + 1).tolist()
        meta = self._meta(tables, torch.arange(n), positions, list(range(n + 1)), lens, num_decodes=n)
        return self._run(tokens, positions, hidden, meta)

    def _run(self, ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, meta) -> torch.Tensor:
        self.predictor.previous_hidden = hidden
        try:
            return self.runner.run_model(self._dev(ids), self._dev(positions), meta)
        finally:
            self.predictor.previous_hidden = None

    def _tables(self, wanted: list[DraftRequest]) -> torch.Tensor:
        """The target's block tables of the requests (its blocks hold the lookahead slots too)."""
        blocks = [self.target.states[r.req_id].block_ids for r in wanted]
        table = torch.zeros(len(blocks), max(len(b) for b in blocks), dtype=self.runner.attn_builder.index_dtype)
        for i, b in enumerate(blocks):
            table[i, :len(b)] = torch.tensor(b)
        return self._dev(table)

    def _meta(self, tables: torch.Tensor, owners: torch.Tensor, positions: torch.Tensor, loc: list[int],
              lens: list[int], num_decodes: int):
        bs = self.target.block_size
        blocks = tables[self._dev(owners), self._dev(positions // bs)].long()
        builder = self.runner.attn_builder
        return builder.build(num_decodes=num_decodes, slot_mapping=blocks * bs + self._dev(positions % bs),
                             block_tables=tables, seq_lens=self._dev(torch.tensor(lens, dtype=builder.index_dtype)),
                             query_start_loc=loc, seq_lens_host=lens,
                             max_query_len=max(b - a for a, b in zip(loc, loc[1:])))

    def _dev(self, t: torch.Tensor) -> torch.Tensor:
        return to_device(t, self.target.device)
