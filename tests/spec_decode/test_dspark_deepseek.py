"""DSpark (method "dspark") over DeepSeek targets (fp32, tiny random weights): a tiny drafter in DeepSpec's
checkpoint layout drafts from the hidden states of a DeepSeek-V3 (MLA, MoE) or DeepSeek-V4 (hyper-connections:
each aux layer's hc_mult streams averaged into one hidden state, as vLLM hands DeepSeek's own V4 DSpark its
target layers) target. Greedy output equals plain decoding over prompts longer than V4's sliding window, with
chunked prefill; the context the drafter caches is what HF's modules give for those layers; a Markov head that
holds the target's greedy chain gets blocks accepted; the target's own embedding and LM head stand in where the
checkpoint leaves them out; a checkpoint for another target (hidden size, layer ids, V4's per-kind rope) is
refused at start, naming it."""
from __future__ import annotations

import functools
import json
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from test_dspark import _deepspec_config, _deepspec_tensors, _save

from pressroom import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from test_deepseek_v4 import TINY as V4_TINY  # noqa: E402
from test_deepseek_v4 import WINDOW, randomize_  # noqa: E402

ENGINE = dict(dtype="float32", kv_cache_memory_gib=0.05, skip_tokenizer_init=True, max_num_batched_tokens=32)
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
# Prompt lengths: one past V4's sliding window and past a prefill chunk (max_num_batched_tokens), two short.
LENGTHS = (5, 13, 40)
# Per target: the layers its drafter reads (V4's include the last, as DeepSeek's own V4 DSpark does) and the
# drafter's own shape keys where the target's config has none that fit a Qwen3-style drafter.
LAYERS = {"deepseek_v3": (0,), "deepseek_v32": (0,), "deepseek_v4": (1, 3)}
DRAFTER_KEYS = {"deepseek_v3": dict(head_dim=16), "deepseek_v32": dict(head_dim=16),
                "deepseek_v4": dict(intermediate_size=128, rope_parameters={"rope_type": "default",
                                                                            "rope_theta": 10000.0})}


@pytest.fixture(scope="module")
def targets(tiny_model_dir, tmp_path_factory):
    """arch -> a tiny checkpoint, made on first use: conftest's DeepSeek-V3 and V3.2 (DSA: its lightning indexer
    picks 32 tokens), or a V4 with every parameter random (its layers: sliding window, CSA, HCA, CSA; hash and
    scored MoE)."""
    import transformers

    @functools.cache
    def make(arch: str) -> str:
        if arch != "deepseek_v4":
            return tiny_model_dir(arch)
        path = tmp_path_factory.mktemp("tiny-v4")
        model = transformers.AutoModelForCausalLM.from_config(transformers.DeepseekV4Config(**V4_TINY),
                                                              dtype=torch.float32)
        randomize_(model, torch.Generator().manual_seed(0))
        model.save_pretrained(path)
        return str(path)

    return make


@pytest.fixture(scope="module")
def plain_outputs(targets):
    """arch -> prompts and the target's own greedy output (once per module, on first use)."""
    prompts = _prompts(seed=45)

    @functools.cache
    def run(arch: str) -> tuple[list[list[int]], list[list[int]]]:
        return prompts, _run(targets(arch), prompts)[0]

    return run


def _prompts(seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(100, 40000, (n,), generator=gen).tolist() for n in LENGTHS]


def _config(arch: str, target: str, **args) -> dict:
    return _deepspec_config(target, **dict(layer_ids=LAYERS[arch]) | DRAFTER_KEYS[arch] | args)


def _run(target: str, prompts, speculative_config: dict | None = None):
    llm = LLM(target, speculative_config=speculative_config, **ENGINE)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], llm


def _spec(drafter: str, k: int = 4) -> dict:
    return {"method": "dspark", "model": drafter, "num_speculative_tokens": k, "adaptive_token_budget": False}


def _hf_features(target: str, layers: tuple[int, ...], ids: list[int]) -> torch.Tensor:
    """HF's output of each of `layers` over `ids` (V4's hc_mult streams averaged), side by side [len(ids), ...]."""
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    taps: dict[int, torch.Tensor] = {}
    hooks = [model.model.layers[i].register_forward_hook(
        lambda _m, _in, out, i=i: taps.__setitem__(i, out[0] if isinstance(out, tuple) else out)) for i in layers]
    with torch.no_grad():
        model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return torch.cat([taps[i][0] if taps[i].dim() == 3 else taps[i][0].mean(dim=-2) for i in layers], dim=-1)


def test_v4_one_request_past_its_window(targets, tmp_path):
    """The default suite's check: one V4 request past the sliding window, greedy equal to plain
    decoding, and its cached context the drafter's k/v of HF's stream means at every verified position."""
    target, layers = targets("deepseek_v4"), LAYERS["deepseek_v4"]
    cfg = _config("deepseek_v4", target)
    drafter = _save(tmp_path / "dspark", cfg, _deepspec_tensors(cfg, seed=3))
    prompt = _prompts(seed=47)[-1][:WINDOW + 8]
    params, outputs = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), {}
    for name, spec in (("plain", None), ("dspark", _spec(drafter, k=3))):
        llm = LLM(target, speculative_config=spec, **ENGINE)
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
        outputs[name] = list(out.token_ids)
    assert outputs["dspark"] == outputs["plain"]
    assert llm.engine.stats().spec.num_draft_tokens > 0
    _assert_context_is_hfs(llm.engine.runner.proposer, target, layers, prompt, outputs["plain"])


def _assert_context_is_hfs(proposer, target: str, layers: tuple[int, ...], prompt: list[int], output: list[int]):
    """The longest cached context: the drafter's k/v of HF's layer outputs at every verified position."""
    context = max(proposer.contexts.values(), key=lambda c: c.n)
    sequence = prompt + output
    assert WINDOW < len(prompt) < context.n <= len(sequence)
    features = _hf_features(target, layers, sequence[:context.n])
    with torch.no_grad():
        want = proposer.drafter.context_kv(features, torch.arange(context.n))
    for (k, v), k_buf, v_buf in zip(want, context.k, context.v):
        assert torch.allclose(k_buf[:context.n], k, atol=1e-4), (k_buf[:context.n] - k).abs().max()
        assert torch.allclose(v_buf[:context.n], v, atol=1e-4)


@pytest.mark.slow  # nine engines over three prompts x 32 tokens, ~60 s on 2 idle cores
@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v32", "deepseek_v4"])
def test_greedy_equals_plain_decoding_and_the_context_is_hfs_layers(arch, targets, plain_outputs, tmp_path):
    target, (prompts, plain) = targets(arch), plain_outputs(arch)
    drafter = _save(tmp_path / "dspark", cfg := _config(arch, target, markov_head_type="gated"),
                    _deepspec_tensors(cfg, seed=3))
    spec, llm = _run(target, prompts, _spec(drafter))
    assert spec == plain
    stats = llm.engine.stats().spec
    assert stats.num_drafts > 10 and stats.num_draft_tokens > 3 * stats.num_drafts, stats  # full blocks verified
    _assert_context_is_hfs(llm.engine.runner.proposer, target, LAYERS[arch], prompts[-1], plain[-1])


@pytest.mark.slow  # as above: the target's greedy chain first, then an engine per target
@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v4"])
def test_markov_chain_of_the_target_gets_blocks_accepted_with_its_embedding_and_head(arch, targets,
                                                                                     plain_outputs, tmp_path):
    """A drafter that leaves out embed_tokens and lm_head (the target's stand in) and whose Markov head holds the
    target's greedy bigrams, with a bias that outweighs any logit: blocks are accepted several tokens deep, so the
    drafts travel through the engine, and the output is still plain decoding's."""
    target, (prompts, plain) = targets(arch), plain_outputs(arch)
    pairs = Counter((a, b) for p, out in zip(prompts, plain) for a, b in zip([p[-1]] + out, out))
    chain: dict[int, int] = {}
    for (a, b), _ in pairs.most_common():
        chain.setdefault(a, b)
    cfg = _config(arch, target, markov_rank=len(chain))
    tensors = {k: t for k, t in _deepspec_tensors(cfg, seed=4).items()
               if k not in ("embed_tokens.weight", "lm_head.weight")}
    w1, w2 = torch.zeros_like(tensors["markov_head.markov_w1.weight"]), torch.zeros_like(
        tensors["markov_head.markov_w2.weight"])
    for j, (a, b) in enumerate(chain.items()):
        w1[a, j], w2[b, j] = 1.0, 1000.0  # outweighs the target's own logits over the drafter's hidden state
    tensors["markov_head.markov_w1.weight"], tensors["markov_head.markov_w2.weight"] = w1, w2
    spec, llm = _run(target, prompts, _spec(_save(tmp_path / "chain", cfg, tensors)))
    assert spec == plain
    proposer = llm.engine.runner.proposer
    assert proposer.embed is llm.engine.runner.model.model.embed_tokens
    assert proposer.head == llm.engine.runner.model.compute_logits
    stats = llm.engine.stats().spec
    assert stats.num_accepted_tokens > 1.5 * stats.num_drafts, stats
    assert stats.num_accepted_tokens > 0.5 * stats.num_draft_tokens, stats


def _refused(target: str, drafter: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LLM(target, speculative_config=_spec(drafter), **ENGINE)


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v4"])
def test_checkpoint_for_another_target_is_refused_at_start(arch, targets, tmp_path):
    target = targets(arch)

    def checkpoint(name: str, **args) -> str:
        cfg = _config(arch, target, **args)
        return _save(tmp_path / name, cfg, _deepspec_tensors(cfg))

    _refused(target, checkpoint("width", hidden_size=32, intermediate_size=64), f"'{tmp_path}/width'.*hidden size 32")
    depth = json.loads((Path(target) / "config.json").read_text())["num_hidden_layers"]
    _refused(target, checkpoint("ids", layer_ids=(0, depth)), rf"target_layer_ids \[0, {depth}\]")


def test_v4_last_layer_is_read_but_a_plain_targets_is_not(targets, tmp_path):
    """V4's streams are handed over before the hyper head and final norm, so its last layer is a valid source; a
    plain target's last HF hidden state is normed, and a drafter reading it is refused."""
    v3 = targets("deepseek_v3")
    cfg = _config("deepseek_v3", v3, layer_ids=(0, 1))
    _refused(v3, _save(tmp_path / "last", cfg, _deepspec_tensors(cfg)), r"hands over layers 0\.\.0 .*nor the last")


def test_v4_rope_per_attention_kind_is_refused_by_name(targets, tmp_path):
    """A drafter config copied from V4's (rope_parameters per attention kind: main, compress) does not say
    which rope the drafter was trained with."""
    v4 = targets("deepseek_v4")
    cfg = _config("deepseek_v4", v4)
    cfg["rope_parameters"] = json.loads((Path(v4) / "config.json").read_text())["rope_parameters"]
    _refused(v4, _save(tmp_path / "rope", cfg, _deepspec_tensors(cfg)), "one set per attention kind")


def test_yarn_of_a_v3_config_rotates_as_hfs_qwen3_drafter(tiny_model_dir, tmp_path):
    """A drafter config copied from DeepSeek-V3's (YaRN, DeepSeek's mscale pair) rotates as DeepSpec's drafter
    does, through HF's Qwen3 rotary embedding over the same rope_parameters: YaRN's frequencies and its
    attention factor on cos and sin."""
    import transformers

    from pressroom.spec_decode.dspark import load_drafter
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 64,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8}
    cfg = _config("deepseek_v3", tiny_model_dir("deepseek_v3"), rope_parameters=yarn, max_position_embeddings=4096)
    drafter, _ = load_drafter(_save(tmp_path / "yarn", cfg, _deepspec_tensors(cfg)))
    positions = torch.tensor([0, 1, 63, 64, 1000, 4000])
    cos, sin = drafter.rope(positions, torch.float32)
    hf = transformers.Qwen3Config(hidden_size=cfg["hidden_size"], num_attention_heads=cfg["num_attention_heads"],
                                  head_dim=cfg["head_dim"], rope_parameters=yarn, max_position_embeddings=4096)
    want_cos, want_sin = transformers.models.qwen3.modeling_qwen3.Qwen3RotaryEmbedding(hf)(
        torch.zeros(1), positions[None])
    assert drafter.rope.magnitude != 1.0
    assert torch.allclose(cos, want_cos[0], atol=1e-5) and torch.allclose(sin, want_sin[0], atol=1e-5)
