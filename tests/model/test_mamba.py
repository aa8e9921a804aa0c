"""Mamba1 / Mamba2 against HF transformers (fp32): the mixers over packed steps that mix decode rows, whole
prefills and chunked prefills, states read and written at scattered slots; then whole models through `LLM`."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import DynamicCache, Mamba2Config, MambaConfig  # noqa: E402
from transformers.models.mamba.modeling_mamba import MambaMixer  # noqa: E402
from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer as HFMamba2Mixer  # noqa: E402

from pressroom.attention.backend import AttentionMetadata, forward_context  # noqa: E402
from pressroom.attention.state import StateMetadata  # noqa: E402
from pressroom.kernels import ssm  # noqa: E402
from pressroom.model.layers import mamba2_mixer  # noqa: E402
from pressroom.model.layers.state import RecurrentLayer  # noqa: E402
from pressroom.model.models.mamba import Mamba1Mixer, mamba2_mixer_config  # noqa: E402

HIDDEN = 16
NUM_SLOTS = 8
# request -> (state slot, prompt length); slot 0 is padding, so none uses it
REQUESTS = {"a": (3, 7), "b": (1, 20), "c": (6, 5)}
# each step: (request, tokens) in the step's order, decodes (one token after the prompt is done) first;
# b's prompt comes in two chunks, the second beside a decode of a and all of c's prompt
STEPS = [[("a", 7), ("b", 9)],
         [("a", 1), ("b", 11), ("c", 5)],
         [("a", 1), ("b", 1), ("c", 1)],
         [("c", 1), ("a", 1), ("b", 1)]]


def _decode_counts(requests: dict[str, tuple[int, int]], steps: list) -> dict[str, int]:
    """Tokens each request runs past its prompt."""
    counts = {name: -length for name, (_, length) in requests.items()}
    for step in steps:
        for name, n in step:
            counts[name] += n
    return counts


def _metadata(step: list[tuple[str, int]], slots: list[int], num_decodes: int) -> AttentionMetadata:
    qsl = [0]
    for _, n in step:
        qsl.append(qsl[-1] + n)
    return AttentionMetadata(num_decodes=num_decodes, num_decode_tokens=num_decodes, slot_mapping=torch.empty(0),
                             block_tables=torch.empty(0), seq_lens=torch.empty(0), query_start_loc=qsl,
                             seq_lens_host=[], state=StateMetadata.one_round(qsl, slots, "cpu", num_decodes))


def _bind_fresh_states(model: torch.nn.Module) -> list[RecurrentLayer]:
    layers = [m for m in model.modules() if isinstance(m, RecurrentLayer)]
    for layer in layers:
        layer.bind_states({name: torch.zeros(NUM_SLOTS, *s.shape, dtype=s.dtype)
                           for name, s in layer.state_shapes().items()})
    return layers


def _run_steps(forward, inputs: dict[str, torch.Tensor], requests: dict[str, tuple[int, int]],
               steps: list) -> dict[str, torch.Tensor]:
    """Each request's outputs over its whole input stream, the steps run as the engine packs them (decodes
    first, each request at its slot)."""
    done = {name: 0 for name in requests}
    outs: dict[str, list[torch.Tensor]] = {name: [] for name in requests}
    for step in steps:
        num_decodes = sum(1 for name, n in step if n == 1 and done[name] >= requests[name][1])
        assert all(n == 1 for _, n in step[:num_decodes])
        tokens = torch.cat([inputs[name][done[name]:done[name] + n] for name, n in step])
        with forward_context(_metadata(step, [requests[name][0] for name, _ in step], num_decodes)):
            y = forward(tokens)
        for (name, n), part in zip(step, y.split([n for _, n in step])):
            outs[name].append(part)
            done[name] += n
    return {name: torch.cat(parts) for name, parts in outs.items()}


def _run_hf(mixer, config, inputs: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Each request alone: its whole prompt in one call, then one call per decode token. Returns the outputs and
    the final SSM states."""
    outs, states = {}, {}
    for name, (_, length) in REQUESTS.items():
        cache = DynamicCache(config=config)
        x = inputs[name][None]
        parts = [mixer(x[:, :length], cache=cache)]
        assert cache.layers[0].recurrent_states[0] is not None, "HF's mixer ignored the cache"
        parts += [mixer(x[:, t:t + 1], cache=cache) for t in range(length, x.shape[1])]
        outs[name] = torch.cat(parts, dim=1)[0]
        states[name] = cache.layers[0].recurrent_states[0][0]
    return outs, states


def _randomize(module: torch.nn.Module) -> None:
    """Every parameter matters: random D, norm weight and biases on top of HF's init."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name in ("D", "norm.weight") or name.endswith("bias") and name != "dt_proj.bias":
                p.copy_(torch.randn(p.shape, generator=g))


def _use_kernels(kind: str, monkeypatch) -> None:
    """The mixers on torch's kernels, or on the Triton ones that CUDA runs (on the CPU Triton's interpreter runs
    them) with the views the mixers hand them, for decode and prefill rows."""
    if kind == "triton":
        from pressroom.kernels import triton as triton_kernels
        if not triton_kernels.available():
            pytest.skip("neither CUDA nor TRITON_INTERPRET=1: Triton kernels cannot run")
        from pressroom.model.layers import state
        monkeypatch.setattr(state, "on_triton", lambda x: True)


def _check_against_hf(hf_mixer, config, ours) -> None:
    _randomize(hf_mixer)
    ours.load_state_dict(hf_mixer.state_dict())
    counts = _decode_counts(REQUESTS, STEPS)
    g = torch.Generator().manual_seed(7)
    inputs = {name: torch.randn(length + counts[name], HIDDEN, generator=g)
              for name, (_, length) in REQUESTS.items()}
    with torch.no_grad():
        expected, hf_states = _run_hf(hf_mixer, config, inputs)
        _bind_fresh_states(ours)
        actual = _run_steps(ours, inputs, REQUESTS, STEPS)
    for name, (slot, _) in REQUESTS.items():
        torch.testing.assert_close(actual[name], expected[name], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(ours.states["ssm"][slot], hf_states[name], atol=1e-4, rtol=1e-4)
    assert not ours.states["ssm"][0].any() and not ours.states["conv"][0].any(), "the padding slot was written"


@pytest.mark.parametrize("use_bias,kernels", [(False, "torch"), (True, "torch"), (False, "triton")])
def test_mamba1_mixer_matches_hf_over_packed_steps(use_bias: bool, kernels: str, monkeypatch):
    _use_kernels(kernels, monkeypatch)
    torch.manual_seed(0)
    config = MambaConfig(hidden_size=HIDDEN, state_size=4, intermediate_size=32, conv_kernel=4, time_step_rank=4,
                         num_hidden_layers=1, vocab_size=16, use_bias=use_bias, use_conv_bias=not use_bias)
    _check_against_hf(MambaMixer(config, 0).eval(), config, Mamba1Mixer(config))


@pytest.mark.parametrize("n_groups,chunk_size,dt_limit,kernels", [
    (2, 4, ssm.DT_LIMIT, "torch"), (1, 256, ssm.DT_LIMIT, "torch"), (2, 8, (0.02, 0.3), "torch"),
    (2, 8, (0.02, 0.3), "triton")])
def test_mamba2_mixer_matches_hf_over_packed_steps(n_groups: int, chunk_size: int, dt_limit: tuple[float, float],
                                                   kernels: str, monkeypatch):
    """b's 20-token prompt spans several chunks (split 9 + 11 on our side); a dt limit tighter than HF's init
    spread clamps some prefill time steps (HF's one-token step does not clamp: neither do we)."""
    _use_kernels(kernels, monkeypatch)
    torch.manual_seed(0)
    config = Mamba2Config(hidden_size=HIDDEN, num_heads=8, head_dim=4, state_size=4, n_groups=n_groups,
                          conv_kernel=4, chunk_size=chunk_size, num_hidden_layers=1, vocab_size=16, expand=2,
                          use_conv_bias=True, time_step_limit=dt_limit)
    _check_against_hf(HFMamba2Mixer(config, 0).eval(), config, mamba2_mixer.Mamba2Mixer(mamba2_mixer_config(config)))


# ---------------------------------------------------------------- whole models from HF checkpoints

VOCAB = 49152  # the tiny tokenizer's (tests/conftest.py)


def tiny_mamba_config(version: int):
    """Mamba1 ties its head to the embedding (HF's default), Mamba2 does not; Mamba2's 16-token chunks put the
    longer prompts over several of them."""
    if version == 1:
        return MambaConfig(vocab_size=VOCAB, hidden_size=64, state_size=8, num_hidden_layers=2, conv_kernel=4,
                           expand=2, use_conv_bias=True, residual_in_fp32=True, tie_word_embeddings=True)
    return Mamba2Config(vocab_size=VOCAB, hidden_size=64, num_heads=8, head_dim=16, state_size=16, n_groups=2,
                        expand=2, conv_kernel=4, chunk_size=16, num_hidden_layers=2, tie_word_embeddings=False)


def save_tiny_mamba(version: int, path: str) -> torch.nn.Module:
    """A tiny random HF Mamba (1) or Mamba2 (2) saved at `path`, with random norms, D and conv biases so that
    every parameter shows in the logits; returns the HF model."""
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(tiny_mamba_config(version), dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "norm_f.weight")):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith((".D", "conv1d.bias")):
                p.copy_(torch.randn(p.shape, generator=g))
    model.save_pretrained(path)
    return model


# request -> (slot, prompt length); the long prompt comes in two chunks, the second beside a decode
MODEL_REQUESTS = {"a": (2, 5), "b": (5, 45), "c": (4, 17)}
MODEL_STEPS = [[("a", 5), ("b", 20)], [("a", 1), ("b", 25), ("c", 17)]] + [[("a", 1), ("b", 1), ("c", 1)]] * 3


@pytest.mark.parametrize("version", [1, 2])
def test_model_loads_hf_checkpoint_and_matches_hf_logits(version: int, tmp_path):
    """Logits of every position of each request's stream (prompt, then tokens fed one per step) against HF's
    forward over the whole stream."""
    from safetensors.torch import load_file

    from pressroom.model.models.mamba import Mamba2ForCausalLM, MambaForCausalLM
    hf_model = save_tiny_mamba(version, str(tmp_path))
    config = transformers.AutoConfig.from_pretrained(str(tmp_path))
    ours = (MambaForCausalLM if version == 1 else Mamba2ForCausalLM)(config).eval()
    checkpoint = load_file(str(tmp_path / "model.safetensors"))
    assert ("lm_head.weight" in checkpoint) == (version == 2)  # Mamba1's head is the tied embedding
    if version == 1:  # older Mamba checkpoints name the embedding backbone.embedding
        checkpoint["backbone.embedding.weight"] = checkpoint.pop("backbone.embeddings.weight")
    assert ours.load_weights(checkpoint.items()) == ours.expected_weights()
    counts = _decode_counts(MODEL_REQUESTS, MODEL_STEPS)
    g = torch.Generator().manual_seed(11)
    ids = {name: torch.randint(0, VOCAB, (length + counts[name],), generator=g)
           for name, (_, length) in MODEL_REQUESTS.items()}
    with torch.no_grad():
        _bind_fresh_states(ours)
        actual = _run_steps(lambda t: ours.compute_logits(ours(t, torch.zeros_like(t))), ids, MODEL_REQUESTS,
                            MODEL_STEPS)
        for name, stream in ids.items():
            torch.testing.assert_close(actual[name], hf_model(stream[None]).logits[0], atol=1e-4, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("version", [1, 2])
def test_model_in_bf16_strays_from_fp32_as_hf_does(version: int, tmp_path):
    """bf16 weights and conv states, fp32 SSM states, and (residual_in_fp32, as HF) an fp32 residual stream
    between blocks: our logits stray from HF's fp32 ones about as far as HF's own bf16 run does."""
    from safetensors.torch import load_file

    from pressroom.model.models.mamba import Mamba2ForCausalLM, MambaForCausalLM
    hf_model = save_tiny_mamba(version, str(tmp_path))
    config = transformers.AutoConfig.from_pretrained(str(tmp_path))
    assert config.residual_in_fp32
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        ours = (MambaForCausalLM if version == 1 else Mamba2ForCausalLM)(config).eval()
    finally:
        torch.set_default_dtype(previous)
    ours.load_weights(load_file(str(tmp_path / "model.safetensors")).items())
    streams = []
    ours.backbone.layers[0].register_forward_hook(lambda module, args, out: streams.append(out.dtype))
    counts = _decode_counts(MODEL_REQUESTS, MODEL_STEPS)
    g = torch.Generator().manual_seed(11)
    ids = {name: torch.randint(0, VOCAB, (length + counts[name],), generator=g)
           for name, (_, length) in MODEL_REQUESTS.items()}
    with torch.no_grad():
        _bind_fresh_states(ours)
        actual = _run_steps(lambda t: ours.compute_logits(ours(t, torch.zeros_like(t))), ids, MODEL_REQUESTS,
                            MODEL_STEPS)
        exact = {name: hf_model(stream[None]).logits[0] for name, stream in ids.items()}
        hf_bf16 = hf_model.to(torch.bfloat16)
        theirs = max((hf_bf16(stream[None]).logits[0].float() - exact[name]).abs().max().item()
                      for name, stream in ids.items())
    assert set(streams) == {torch.float32}
    assert all(a.dtype == torch.bfloat16 for a in actual.values())
    ours_error = max((actual[name].float() - exact[name]).abs().max().item() for name in ids)
    assert ours_error < 1.5 * theirs


# ---------------------------------------------------------------- through the engine

def _hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation through HF's recurrent cache, one token per forward (conftest's hf_greedy passes
    past_key_values, which HF's Mamba models do not take)."""
    out = model(input_ids=torch.tensor([prompt_ids]), use_cache=True)
    tokens = []
    for _ in range(max_new_tokens):
        next_id = out.logits[0, -1].argmax()
        tokens.append(int(next_id))
        out = model(input_ids=next_id.view(1, 1), cache=out.cache, use_cache=True)
    return tokens


@pytest.mark.parametrize("version,lengths,max_tokens", [
    (2, (7, 90), 8),
    pytest.param(1, (3, 40, 150, 97), 64, marks=pytest.mark.slow),
    pytest.param(2, (3, 40, 150, 97), 64, marks=pytest.mark.slow)])
def test_llm_matches_hf_greedy_and_prompt_logprobs(version: int, lengths: tuple[int, ...], max_tokens: int, tmp_path,
                                                   smollm_tokenizer):
    """A batch of mixed prompt lengths, the longer ones prefilled over several 64-token steps (and many of
    Mamba2's 16-token chunks) beside other requests' decodes, with state checkpoints every 32 tokens (rounds
    inside a step): the greedy tokens and prompt logprobs equal HF's; the prompts' second run resumes from the
    last checkpoint before its last token, to the same tokens."""
    from conftest import hf_prompt_logprobs

    from pressroom import LLM, SamplingParams
    hf_model = save_tiny_mamba(version, str(tmp_path))
    smollm_tokenizer.save_pretrained(str(tmp_path))
    llm = LLM(str(tmp_path), dtype="float32", kv_cache_memory_gib=0.05, max_num_batched_tokens=64,
              mamba_block_size=32)
    g = torch.Generator().manual_seed(40 + version)
    prompts = [torch.randint(100, VOCAB - 100, (n,), generator=g).tolist() for n in lengths]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, prompt_logprobs=0)
    with torch.no_grad():
        expected = [(_hf_greedy(hf_model, p, max_tokens), hf_prompt_logprobs(hf_model, p)) for p in prompts]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for out, (tokens, logprobs) in zip(outs, expected):
        assert out.outputs[0].token_ids == tokens
        ours = [next(iter(pos.values())).logprob for pos in out.prompt_logprobs[1:]]
        assert max(abs(a - b) for a, b in zip(ours, logprobs)) < 1e-3
    # again without prompt logprobs (which compute every prompt token): served from the state checkpoints
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [out.num_cached_tokens for out in outs] == [(n - 1) // 32 * 32 for n in lengths]
    assert [out.outputs[0].token_ids for out in outs] == [tokens for tokens, _ in expected]
