"""The gated delta rule in plain torch (CPU and CUDA, any float dtype): Qwen3-Next's Gated DeltaNet and Kimi's KDA.

The recurrence, per sequence and value head, with the state S of shape [d_k, d_v] (it maps a key to a value: S^T k):

    S'_t = diag(a_t) S_{t-1}                          gate: a_t = exp(g_t) <= 1
    S_t = S'_t + beta_t k_t (v_t - S'_t^T k_t)^T      = (I - beta_t k_t k_t^T) diag(a_t) S_{t-1} + beta_t k_t v_t^T
    o_t = S_t^T q_t

Gated DeltaNet's gate g_t is one log-decay per head (a_t a scalar); KDA's is one per key channel (a_t a diagonal).
q and k are L2-normalized (fp32, the `eps` under the root as HF and fla do) and q is scaled by d_k ** -0.5.

The chunked form (chunk size C) is exact: within a chunk starting from S_0, with G_t the cumulative log-gate,

    U = T (beta V - beta (K * exp G) S_0),    T = (I + L)^-1,    L_ij = beta_i sum_d k_i k_j exp(G_i - G_j)  (i > j)
    O = (Q * exp G) S_0 + (Q K^T decayed, i >= j) U
    S_C = diag(exp G_C) S_0 + (K * exp(G_C - G))^T U

where the rows of U are the delta-rule updates (the WY/UT transform turns C sequential updates into a triangular
solve). Every exponent is of a difference G_i - G_j with i >= j, so every factor is <= 1 and nothing overflows.

Layouts (tokens packed, the engine's shape): q, k [T, H_k, d_k]; v [T, H_v, d_v]; g [T, H_v] (GDN) or
[T, H_v, d_k] (KDA); beta [T, H_v]; cu_seqlens [N + 1] token offsets; states [N, H_v, d_k, d_v]. H_v is a
multiple of H_k and value head h reads key head h // (H_v // H_k). Arithmetic is fp32; outputs take v's dtype,
final states the initial states' dtype (fp32 when none are given).

On the CPU the one-token steps run in C (kernels/csrc/recurrent.c through kernels/cpu.py) where the tensors fit it
(fp32 states, fp32 or bf16 activations); the torch code here is their reference and the fallback, and
`CPU_KERNELS = False` forces it.
"""
from __future__ import annotations

import torch

from pressroom.kernels import cpu

CPU_KERNELS = True  # False: the torch forms below even where the C kernels fit (tests compare the two)

DEFAULT_CHUNK_SIZE = 64
L2NORM_EPS = 1e-6


def l2normalize(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim, in fp32 (HF's and fla's convention, not F.normalize's max)."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def prepare_qk(q: torch.Tensor, k: torch.Tensor, num_v_heads: int, normalize_qk: bool = True,
               scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 q and k expanded to the value heads, optionally L2-normalized, q scaled (by d_k ** -0.5 unless given)."""
    q, k = (l2normalize(x) for x in (q, k)) if normalize_qk else (q.float(), k.float())
    group = num_v_heads // k.shape[-2]
    if group != 1:
        q, k = (x.repeat_interleave(group, dim=-2) for x in (q, k))
    return q * (scale if scale is not None else q.shape[-1] ** -0.5), k


def delta_rule_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of N sequences on prepared fp32 inputs: q, k [N, H, d_k] (expanded, normalized, scaled),
    v [N, H, d_v], g [N, H] or [N, H, d_k], beta [N, H], state [N, H, d_k, d_v] fp32. Returns (o [N, H, d_v], state)."""
    state = state * _gate_factor(g, scalar=_is_scalar_gate(g, v))
    delta = (v.float() - torch.einsum("nhkv,nhk->nhv", state, k)) * beta.float().unsqueeze(-1)
    state = state + k.unsqueeze(-1) * delta.unsqueeze(-2)
    return torch.einsum("nhkv,nhk->nhv", state, q), state


def _gate_factor(g: torch.Tensor, scalar: bool) -> torch.Tensor:
    """exp(g) shaped to multiply states [..., H, d_k, d_v]: a scalar gate per head, or one per key channel."""
    a = g.float().exp()
    return a[..., None, None] if scalar else a[..., None]


def _is_scalar_gate(g: torch.Tensor, v: torch.Tensor) -> bool:
    """GDN's gate has v's heads as its last dim ([T, H]); KDA's carries d_k after them ([T, H, d_k])."""
    return g.dim() == v.dim() - 1


def _check_layouts(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   initial_state: torch.Tensor | None, num_seqs: int) -> None:
    """The module docstring's layouts, or a ValueError that names every shape."""
    tokens, h_k, d_k = k.shape
    h_v, d_v = v.shape[-2:]
    state_ok = initial_state is None or initial_state.shape == (num_seqs, h_v, d_k, d_v)
    if (q.shape != k.shape or v.shape[0] != tokens or h_v % h_k or g.shape not in ((tokens, h_v), (tokens, h_v, d_k))
            or beta.shape != (tokens, h_v) or not state_ok):
        raise ValueError(f"gated delta rule: q, k [T, H_k, d_k], v [T, H_v, d_v] (H_v a multiple of H_k), g [T, H_v] "
                         f"or [T, H_v, d_k], beta [T, H_v], initial_state [{num_seqs} sequences, H_v, d_k, d_v]; got "
                         f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, g {tuple(g.shape)}, beta "
                         f"{tuple(beta.shape)}, initial_state "
                         f"{None if initial_state is None else tuple(initial_state.shape)}")


def _initial_states(initial_state: torch.Tensor | None, num_seqs: int, v: torch.Tensor,
                    d_k: int) -> torch.Tensor:
    """The given states, or zeros in fp32 (a fresh sequence)."""
    if initial_state is None:
        return torch.zeros(num_seqs, v.shape[-2], d_k, v.shape[-1], dtype=torch.float32, device=v.device)
    return initial_state


def _sequence_bounds(q: torch.Tensor, cu_seqlens: torch.Tensor | None) -> list[int]:
    """cu_seqlens as a list, or one sequence of all the tokens when there is none."""
    return [0, q.shape[0]] if cu_seqlens is None else cu_seqlens.tolist()


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, initial_state: torch.Tensor | None = None,
                               cu_seqlens: torch.Tensor | None = None, normalize_qk: bool = True,
                               scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact token-by-token recurrence over packed sequences (layouts in the module docstring): the reference
    the other forms are tested against (decode batches go through `recurrent_decode_step`, with no token loop).
    Returns (o [T, H_v, d_v], final states [N, H_v, d_k, d_v])."""
    bounds = _sequence_bounds(q, cu_seqlens)
    _check_layouts(q, k, v, g, beta, initial_state, len(bounds) - 1)
    q, k = prepare_qk(q, k, v.shape[-2], normalize_qk, scale)
    states = _initial_states(initial_state, len(bounds) - 1, v, q.shape[-1])
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    final = torch.empty_like(states)
    for n, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        state = states[n:n + 1].float()
        for t in range(start, end):
            sl = slice(t, t + 1)
            o, state = delta_rule_step(q[sl], k[sl], v[sl], g[sl], beta[sl], state)
            out[t] = o[0]
        final[n] = state[0]
    return out.to(v.dtype), final


def recurrent_decode_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                          states: torch.Tensor, normalize_qk: bool = True,
                          scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of N sequences, batched (no loop): q, k [N, H_k, d_k], states [N, H_v, d_k, d_v].
    Returns (o [N, H_v, d_v] in v's dtype, new states in the states' dtype)."""
    _check_layouts(q, k, v, g, beta, states, q.shape[0])
    if _on_c(states, q, k, v, g, beta):
        new = states.clone(memory_format=torch.contiguous_format)
        return cpu.delta_rule_step(q, k, v, g, beta, new, None, normalize_qk, _scale(k, scale)), new
    q, k = prepare_qk(q, k, v.shape[-2], normalize_qk, scale)
    o, new = delta_rule_step(q, k, v, g, beta, states.float())
    return o.to(v.dtype), new.to(states.dtype)


def recurrent_decode_step_pool(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, state_pool: torch.Tensor, slots: torch.Tensor,
                               normalize_qk: bool = True, scale: float | None = None) -> torch.Tensor:
    """`recurrent_decode_step` on a state pool [num_slots, H_v, d_k, d_v]: row n advances state_pool[slots[n]] in
    place; a negative slot is padding (zero output, no state touched). Returns o [N, H_v, d_v] in v's dtype. The
    arguments of the Triton kernel (kernels/triton/delta_rule.py's fused_recurrent_decode)."""
    n, _, d_k = k.shape
    _check_layouts(q, k, v, g, beta, None, n)
    if state_pool.shape[1:] != (v.shape[1], d_k, v.shape[2]) or slots.shape != (n,):
        raise ValueError(f"gated delta rule decode: state_pool [slots, H_v, d_k, d_v] and slots [N] for q "
                         f"{tuple(q.shape)}, v {tuple(v.shape)}; got {tuple(state_pool.shape)}, {tuple(slots.shape)}")
    if _on_c(state_pool, q, k, v, g, beta):
        return cpu.delta_rule_step(q, k, v, g, beta, state_pool, slots, normalize_qk, _scale(k, scale))
    o = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    rows = (slots >= 0).nonzero().flatten()
    if rows.numel():
        picked = slots[rows].long()
        o[rows], new = recurrent_decode_step(q[rows], k[rows], v[rows], g[rows], beta[rows], state_pool[picked],
                                             normalize_qk, scale)
        state_pool[picked] = new
    return o


def _on_c(states: torch.Tensor, *tensors: torch.Tensor) -> bool:
    """This call goes to the C kernels: switched on, and they take its states and tensors."""
    return CPU_KERNELS and cpu.recurrent_fits(states, 2, *tensors)


def _scale(k: torch.Tensor, scale: float | None) -> float:
    return scale if scale is not None else k.shape[-1] ** -0.5


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           initial_state: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
                           normalize_qk: bool = True, scale: float | None = None,
                           chunk_size: int = DEFAULT_CHUNK_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunkwise-parallel form over packed sequences, each continuing from its initial state (so a prompt
    may be prefilled over several engine chunks). Same arguments and results as `recurrent_gated_delta_rule`."""
    bounds = _sequence_bounds(q, cu_seqlens)
    _check_layouts(q, k, v, g, beta, initial_state, len(bounds) - 1)
    q, k = prepare_qk(q, k, v.shape[-2], normalize_qk, scale)
    states = _initial_states(initial_state, len(bounds) - 1, v, q.shape[-1])
    scalar = _is_scalar_gate(g, v)
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    final = torch.empty_like(states)
    for n, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        state = states[n].float()
        for c in range(start, end, chunk_size):
            sl = slice(c, min(c + chunk_size, end))
            out[sl], state = _chunk(q[sl], k[sl], v[sl].float(), g[sl].float(), beta[sl].float(), state, scalar)
        final[n] = state
    return out.to(v.dtype), final


def _chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
           state: torch.Tensor, scalar: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of one sequence, heads batched: q, k [C, H, d_k], v [C, H, d_v], g [C, H(, d_k)], beta [C, H],
    state [H, d_k, d_v]. Returns (o [C, H, d_v], the state after the chunk)."""
    q, k, v = (x.transpose(0, 1) for x in (q, k, v))  # [H, C, d]
    beta = beta.transpose(0, 1).unsqueeze(-1)  # [H, C, 1]
    cum = g.cumsum(0).transpose(0, 1)  # [H, C] or [H, C, d_k]
    cum = cum.unsqueeze(-1) if scalar else cum  # [H, C, 1 or d_k]: exp(cum) scales key channels
    kk = _decayed_scores(k, k, cum, scalar, diagonal=-1)
    system = torch.eye(k.shape[1], device=k.device) + beta * kk  # I + L, unit lower triangular
    rhs = torch.cat((beta * v, beta * k * cum.exp()), dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    values, decayed_keys = solved.split((v.shape[-1], k.shape[-1]), dim=-1)
    updates = values - decayed_keys @ state  # U: the delta-rule updates of the chunk's tokens
    o = (q * cum.exp()) @ state + _decayed_scores(q, k, cum, scalar, diagonal=0) @ updates
    last = cum[:, -1:]  # [H, 1, 1 or d_k]
    state = state * last.transpose(1, 2).exp() + (k * (last - cum).exp()).transpose(1, 2) @ updates
    return o.transpose(0, 1), state


def _decayed_scores(a: torch.Tensor, b: torch.Tensor, cum: torch.Tensor, scalar: bool,
                    diagonal: int) -> torch.Tensor:
    """[H, C, C] sum_d a_i[d] b_j[d] exp(cum_i[d] - cum_j[d]) on and below `diagonal`, zero above (where the
    exponent would be positive: masked before exp, so it never overflows)."""
    size = a.shape[1]
    keep = torch.ones(size, size, dtype=torch.bool, device=a.device).tril(diagonal)
    if scalar:
        log_decay = (cum - cum.transpose(1, 2)).masked_fill(~keep, float("-inf"))  # [H, C, C]
        return (a @ b.transpose(1, 2)) * log_decay.exp()
    log_decay = (cum.unsqueeze(2) - cum.unsqueeze(1)).masked_fill(~keep[..., None], float("-inf"))  # [H, C, C, d_k]
    return torch.einsum("hid,hjd,hijd->hij", a, b, log_decay.exp())
