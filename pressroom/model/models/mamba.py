"""Mamba (HF "mamba": Mamba1's selective scan) and Mamba2 (HF "mamba2": the SSD scan): attention-free stacks of
state-space mixers, each a pre-norm residual block, with no KV cache, only a fixed-size state per request and layer.

Each mixer is a `RecurrentLayer` (layers/state.py) with two states: the causal conv's last w-1 inputs (the
model's dtype) and the SSM state (fp32). A step's tokens advance them round by round: decode rows (one token
each, first) through the batched one-step kernels on the state pools, prefill rows through the packed varlen
kernels (kernels/ssm.py; Triton's on CUDA for both), each reading its request's states at `round.slots` and
writing them back.
Mamba1's mixer is here; Mamba2's is the shared layers/mamba2_mixer.py (Nemotron-H and Falcon-H1 carry it too).

Weights load from HF checkpoints under HF's names (backbone.embeddings, backbone.layers.N.{norm, mixer.*},
backbone.norm_f, lm_head); the head shares the embedding where the config ties them.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pressroom.attention.state import StateRound
from pressroom.distributed.parallel_state import get_tp_size
from pressroom.model.layers import state
from pressroom.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pressroom.model.layers.linear import ColumnParallelLinear
from pressroom.model.layers.mamba2_mixer import DepthwiseConv, Mamba2Mixer, Mamba2MixerConfig
from pressroom.model.layers.norm import RMSNorm
from pressroom.model.layers.state import RecurrentLayer, StateShape
from pressroom.model.weights import expected_names, load_named_weights


def _prefill_cu_seqlens(r: StateRound) -> torch.Tensor:
    """The round's prefill rows packed from 0: decodes come first, one token each."""
    return r.cu_seqlens[r.num_decodes:] - r.num_decodes


def _has_prefill(r: StateRound) -> bool:
    return r.num_tokens > r.num_decodes


def _conv_round(r: StateRound, x: torch.Tensor, conv: DepthwiseConv, states: torch.Tensor) -> torch.Tensor:
    """silu(causal conv) over a round's tokens x [tokens, channels]: decode rows shift their conv states by one
    input, prefill rows run on from theirs; each request's state is read and written at its slot."""
    nd, taps = r.num_decodes, conv.weight[:, 0]
    parts = []
    if nd:
        parts.append(state.pool_kernels(x).causal_conv1d_update_pool(x[:nd], states, r.slots[:nd], taps, conv.bias))
    if _has_prefill(r):
        parts.append(state.prefill_kernels(x).causal_conv1d_varlen(x[nd:], _prefill_cu_seqlens(r), taps, conv.bias,
                                                                   states, r.slots[nd:]))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _check_config(config) -> None:
    if get_tp_size() > 1:
        raise ValueError("Mamba models do not run with tensor parallelism yet; use tensor_parallel_size=1.")
    if config.hidden_act != "silu":
        raise ValueError(f"Mamba's kernels apply silu; the config asks for {config.hidden_act!r}.")


class Mamba1Mixer(RecurrentLayer):
    """in_proj -> (x, z); x through the causal conv; x_proj -> (dt, B, C); dt_proj; selective scan gated by
    silu(z); out_proj."""

    def __init__(self, config) -> None:
        super().__init__()
        hidden, self.d_inner, self.d_state = config.hidden_size, config.intermediate_size, config.state_size
        self.dt_rank, self.width = int(config.time_step_rank), config.conv_kernel
        self.in_proj = ColumnParallelLinear(hidden, 2 * self.d_inner, bias=config.use_bias)
        self.conv1d = DepthwiseConv(self.d_inner, self.width, config.use_conv_bias)
        self.x_proj = ColumnParallelLinear(self.d_inner, self.dt_rank + 2 * self.d_state, bias=False)
        # its bias is dt's: added here, before the kernels' softplus, as HF adds it
        self.dt_proj = ColumnParallelLinear(self.dt_rank, self.d_inner, bias=True)
        self.A_log = nn.Parameter(torch.empty(self.d_inner, self.d_state), requires_grad=False)
        self.D = nn.Parameter(torch.empty(self.d_inner), requires_grad=False)
        self.out_proj = ColumnParallelLinear(self.d_inner, hidden, bias=config.use_bias)

    def state_shapes(self) -> dict[str, StateShape]:
        return {"conv": StateShape((self.d_inner, self.width - 1), self.conv1d.weight.dtype),
                "ssm": StateShape((self.d_inner, self.d_state), torch.float32)}

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x, z = self.in_proj(hidden).chunk(2, dim=-1)
        return self.out_proj(self.run_rounds(self._mix, x, z))

    def _mix(self, r: StateRound, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        x = _conv_round(r, x, self.conv1d, self.states["conv"])
        dt, B, C = self.x_proj(x).split([self.dt_rank, self.d_state, self.d_state], dim=-1)
        dt = self.dt_proj(dt)
        A = -torch.exp(self.A_log.float())
        nd, states = r.num_decodes, self.states["ssm"]
        y = torch.empty_like(x)
        if nd:
            y[:nd] = state.pool_kernels(x).selective_state_update_pool(states, r.slots[:nd], x[:nd], dt[:nd], A,
                                                                       B[:nd], C[:nd], self.D, z[:nd])
        if _has_prefill(r):
            y[nd:] = state.prefill_kernels(x).selective_scan_varlen(x[nd:], dt[nd:], A, B[nd:], C[nd:],
                                                                    _prefill_cu_seqlens(r), states, r.slots[nd:],
                                                                    self.D, z[nd:])
        return y


def mamba2_mixer_config(config) -> Mamba2MixerConfig:
    """HF Mamba2's mixer: the gated per-group RMSNorm, one eps for it and the blocks' norms, dt clamped in prefill."""
    return Mamba2MixerConfig(
        hidden_size=config.hidden_size, num_heads=config.num_heads, head_dim=config.head_dim,
        n_groups=config.n_groups, d_state=config.state_size, conv_kernel=config.conv_kernel,
        chunk_size=config.chunk_size, conv_bias=config.use_conv_bias, in_proj_bias=config.use_bias,
        out_proj_bias=config.use_bias, norm_eps=config.layer_norm_epsilon,
        dt_limit=tuple(float(v) for v in config.time_step_limit))


class MambaBlock(nn.Module):
    """stream + mixer(norm(stream)): the norm reads the stream in the model's dtype, as HF's block casts it."""

    def __init__(self, config, mixer: RecurrentLayer) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.layer_norm_epsilon)
        self.mixer = mixer

    def forward(self, stream: torch.Tensor) -> torch.Tensor:
        return stream + self.mixer(self.norm(stream.to(self.norm.weight.dtype)))


class MambaBackbone(nn.Module):
    def __init__(self, config, make_mixer: Callable[[Any], RecurrentLayer]) -> None:
        super().__init__()
        self.embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(MambaBlock(config, make_mixer(config)) for _ in range(config.num_hidden_layers))
        self.norm_f = RMSNorm(config.hidden_size, config.layer_norm_epsilon)
        # HF keeps the residual stream in fp32 (each block adds its mixer's output to an fp32 residual): the same
        # as the model's dtype in fp32, a wider stream in bf16
        self.residual_in_fp32 = bool(getattr(config, "residual_in_fp32", True))

    def forward(self, input_ids: torch.Tensor, aux_layers: tuple[int, ...] = ()
                ) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        x = self.embeddings(input_ids)
        dtype = x.dtype
        stream = x.float() if self.residual_in_fp32 else x
        taps = {}
        for i, layer in enumerate(self.layers):
            stream = layer(stream)
            if i in aux_layers:
                taps[i] = stream.to(dtype)
        out = self._final_norm(stream, dtype)
        return (out, [taps[i] for i in aux_layers]) if aux_layers else out

    def _final_norm(self, stream: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """norm_f over the stream as it is (HF does not round an fp32 stream first), then in the model's dtype."""
        if stream.dtype == dtype:
            return self.norm_f(stream)
        weight = self.norm_f.weight
        return F.rms_norm(stream, weight.shape, weight.float(), self.norm_f.eps).to(dtype)


class MambaForCausalLM(nn.Module):
    # Decode rounds should be graph-safe (the Triton pool kernels read slots on the device, no host sync), but
    # capturing them is not verified yet: off until a GPU test replays a captured decode against eager.
    cuda_graphs_supported = True  # state slots are graph inputs; checked on an H100 (tests/gpu)

    def __init__(self, config) -> None:
        super().__init__()
        _check_config(config)
        self.config = config
        self.backbone = MambaBackbone(config, self.make_mixer)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.backbone.embeddings.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, aux_layers: tuple[int, ...] = ()
                ) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        """`positions` are unused: the state carries the order."""
        return self.backbone(input_ids, aux_layers)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    @staticmethod
    def make_mixer(config) -> RecurrentLayer:
        return Mamba1Mixer(config)

    # ---- the name map (model/weights.py): HF's names are the parameters' own ----

    def skips(self, name: str) -> bool:
        return self.tie_word_embeddings and name == "lm_head.weight"

    def checkpoint_target(self, name: str) -> tuple[str, object]:
        return name, None

    def checkpoint_parts(self, name: str) -> list[str]:
        return [name]

    def checkpoint_tensors(self, weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
        """Older checkpoints name the embedding `backbone.embedding` (HF renames it on load too)."""
        for name, tensor in weights:
            yield name.replace("backbone.embedding.", "backbone.embeddings."), tensor

    def expected_weights(self) -> set[str]:
        return expected_names(self)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        loaded = load_named_weights(self, self.checkpoint_tensors(weights))
        if self.tie_word_embeddings:
            self.lm_head.tie_to(self.backbone.embeddings)
            loaded.add("lm_head.weight")
        return loaded


class Mamba2ForCausalLM(MambaForCausalLM):
    @staticmethod
    def make_mixer(config) -> RecurrentLayer:
        return Mamba2Mixer(mamba2_mixer_config(config))
