"""LoRA adapters (PEFT checkpoints) against PEFT itself on a tiny random Llama (fp32): four adapters of different
ranks and targets (fused qkv and gate_up slices, rsLoRA, a per-module alpha) and the base model mixed in one
batch give PEFT's merged model's greedy tokens and prompt logprobs; two adapters never share prefix blocks; bad
adapters are refused with the adapter's name."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import hf_greedy, hf_prompt_logprobs, random_prompts

from pressroom import LLM, SamplingParams
from pressroom.lora.request import LoRARequest

ATTENTION, MLP = ["q_proj", "k_proj", "v_proj", "o_proj"], ["gate_proj", "up_proj", "down_proj"]
ADAPTERS = {  # name: (rank, targets, extra LoraConfig arguments)
    "all-r16": (16, ATTENTION + MLP, {}),
    "attn-r8": (8, ATTENTION, {"use_rslora": True}),
    "mlp-r4": (4, MLP, {"lora_alpha": 16}),
    "qv-r2": (2, ["q_proj", "v_proj"], {"alpha_pattern": {"v_proj": 6}}),
}
NEW_TOKENS = 64


def write_adapter(base: str, path: Path, rank: int, targets: list[str], seed: int, **extra) -> None:
    import peft
    import transformers
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = peft.LoraConfig(r=rank, lora_alpha=extra.pop("lora_alpha", 2 * rank), target_modules=targets,
                             init_lora_weights=False, **extra)
    peft_model = peft.get_peft_model(model, config)
    with torch.no_grad():  # updates large enough to change the greedy tokens
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(4.0)
    peft_model.save_pretrained(path)


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory) -> tuple[str, dict[str, str]]:
    base = tiny_model_dir("llama")
    root = tmp_path_factory.mktemp("lora")
    paths = {}
    for i, (name, (rank, targets, extra)) in enumerate(ADAPTERS.items()):
        paths[name] = str(root / name)
        write_adapter(base, root / name, rank, targets, seed=10 + i, **dict(extra))
    return base, paths


def merged(base: str, path: str | None):
    """PEFT's model with the adapter merged (None: the base), fp32: the oracle."""
    import peft
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if path is None:
        return model.eval()
    return peft.PeftModel.from_pretrained(model, path).merge_and_unload().eval()


def requests(paths: dict[str, str]) -> dict[str, LoRARequest]:
    return {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(paths.items())}


def test_four_adapters_and_the_base_in_one_batch_match_peft(adapters):
    base, paths = adapters
    loras = requests(paths)
    names = [*ADAPTERS, None, *ADAPTERS]  # each adapter twice, the base once, all in one batch
    prompts = random_prompts(len(names), low=5, high=30, seed=3)
    llm = LLM(base, dtype="float32", kv_cache_memory_gib=0.05, enable_lora=True, max_loras=4, max_lora_rank=16,
              enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                        lora_request=[loras[n] if n else None for n in names])
    oracles = {name: merged(base, paths.get(name)) for name in set(names)}
    base_tokens = hf_greedy(oracles[None], prompts[len(ADAPTERS)], NEW_TOKENS)
    for name, prompt, out in zip(names, prompts, outs):
        want = hf_greedy(oracles[name], prompt, NEW_TOKENS)
        assert list(out.outputs[0].token_ids) == want, name
        ours = [next(iter(p.values())).logprob for p in out.prompt_logprobs[1:]]
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(hf_prompt_logprobs(oracles[name], prompt)),
                                   atol=1e-3, rtol=0)
    # the adapters change the output (so the comparison above could fail)
    assert hf_greedy(oracles["all-r16"], prompts[len(ADAPTERS)], NEW_TOKENS) != base_tokens
    llm.shutdown()


def test_more_adapters_than_slots_take_turns_and_two_adapters_never_share_prefix_blocks(adapters):
    base, paths = adapters
    loras = requests(paths)
    llm = LLM(base, dtype="float32", kv_cache_memory_gib=0.05, enable_lora=True, max_loras=1, max_cpu_loras=2,
              max_lora_rank=16)
    prompt = random_prompts(1, low=70, high=71, seed=5)[0]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def run(lora):
        return llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False, lora_request=lora)[0]

    first = run(loras["attn-r8"])
    assert run(loras["attn-r8"]).num_cached_tokens == 64  # the same adapter: its blocks are found again
    other = run(loras["mlp-r4"])
    assert other.num_cached_tokens == 0 and run(None).num_cached_tokens == 0  # another adapter, the base: none
    # one slot: the adapters took turns in it (and the pool of two read ones), outputs as each alone gives
    again = run(loras["attn-r8"])
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert other.outputs[0].token_ids != first.outputs[0].token_ids
    llm.shutdown()


def test_bad_adapters_are_refused_with_their_name(adapters, tmp_path):
    base, paths = adapters
    llm = LLM(base, dtype="float32", kv_cache_memory_gib=0.05, enable_lora=True, max_lora_rank=8)
    prompt = {"prompt_token_ids": [5, 6, 7]}
    with pytest.raises(ValueError, match="'all-r16': rank 16 .* exceeds --max-lora-rank 8"):
        llm.generate(prompt, use_tqdm=False, lora_request=LoRARequest("all-r16", 1, paths["all-r16"]))
    with pytest.raises(ValueError, match="'nowhere'.*no PEFT adapter directory"):
        llm.generate(prompt, use_tqdm=False, lora_request=LoRARequest("nowhere", 2, str(tmp_path / "none")))
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "adapter_config.json").write_text((Path(paths["qv-r2"]) / "adapter_config.json").read_text())
    (corrupt / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="'corrupt'.*not a readable safetensors file"):
        llm.generate(prompt, use_tqdm=False, lora_request=LoRARequest("corrupt", 3, str(corrupt)))
    assert llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids  # serving
    llm.shutdown()
    plain = LLM(base, dtype="float32", kv_cache_memory_gib=0.05)
    with pytest.raises(ValueError, match="started without LoRA"):
        plain.generate(prompt, use_tqdm=False, lora_request=LoRARequest("qv-r2", 1, paths["qv-r2"]))
    plain.shutdown()


def test_an_adapter_for_another_model_is_refused_naming_the_module(adapters, tmp_path):
    """Shapes that do not match the base: the worker's check names the adapter and the module."""
    from pressroom.lora.adapter import load_peft_adapter
    base, paths = adapters
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    config = json.loads((Path(paths["qv-r2"]) / "adapter_config.json").read_text())
    (wrong / "adapter_config.json").write_text(json.dumps(config))
    from safetensors.torch import load_file, save_file
    tensors = load_file(Path(paths["qv-r2"]) / "adapter_model.safetensors")
    tensors = {k: torch.cat((v, v), dim=1) if "lora_A" in k else v for k, v in tensors.items()}  # in: 64 -> 128
    save_file(tensors, wrong / "adapter_model.safetensors")
    llm = LLM(base, dtype="float32", kv_cache_memory_gib=0.05)
    with pytest.raises(ValueError, match=r"'wrong': .*q_proj maps 128 -> 64 features; the model's layer maps 64"):
        load_peft_adapter("wrong", str(wrong), llm.engine.model, 16)
    llm.shutdown()


def test_requests_on_more_adapters_than_slots_wait_their_turn(adapters, caplog):
    """One generate() call over three adapters with --max-loras 1: the scheduler runs one adapter's requests at a
    time (the others wait; no step fails for holding too many), each output as with a slot for every adapter."""
    base, paths = adapters
    loras = requests(paths)
    names = ["attn-r8", "mlp-r4", "qv-r2", "attn-r8", None, "qv-r2"]
    prompts = random_prompts(len(names), low=5, high=20, seed=6)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts]
    chosen = [loras[n] if n else None for n in names]
    outputs = {}
    for slots in (1, 4):
        llm = LLM(base, dtype="float32", kv_cache_memory_gib=0.05, enable_lora=True, max_loras=slots,
                  max_cpu_loras=4, max_lora_rank=16)
        outputs[slots] = [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False,
                                                                         lora_request=chosen)]
        llm.shutdown()
    assert outputs[1] == outputs[4]
    assert "step of" not in caplog.text and "failed" not in caplog.text


def test_adapters_under_speculative_decoding_and_structured_outputs(adapters):
    """Drafts verified with the adapter's updates (n-gram drafts on a repetitive prompt) keep the adapter's greedy
    tokens; a JSON-schema request on an adapter answers valid JSON."""
    from pressroom.sampling_params import StructuredOutputsParams
    base, paths = adapters
    lora = requests(paths)["all-r16"]
    prompt = (random_prompts(1, low=7, high=8, seed=12)[0] * 5)[:32]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    engine = dict(dtype="float32", kv_cache_memory_gib=0.05, enable_lora=True, max_lora_rank=16)
    plain = LLM(base, **engine)
    want = plain.generate({"prompt_token_ids": prompt}, params, use_tqdm=False, lora_request=lora)[0]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    shaped = plain.generate("Answer:", SamplingParams(temperature=0, max_tokens=40,
                                                      structured_outputs=StructuredOutputsParams(json=schema)),
                            use_tqdm=False, lora_request=lora)[0]
    assert isinstance(json.loads(shaped.outputs[0].text)["a"], int)
    plain.shutdown()
    # every draft verified: the adaptive budget, judging by costs timed at start-up, may skip them on a busy machine
    spec = LLM(base, speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                                         "adaptive_token_budget": False}, **engine)
    got = spec.generate({"prompt_token_ids": prompt}, params, use_tqdm=False, lora_request=lora)[0]
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert spec.engine.stats().spec.num_draft_tokens > 0
    spec.shutdown()



def test_lora_requests_info_names_the_running_and_waiting_adapters(adapters):
    """The scheduler's stats name the adapters of its running and waiting requests (one slot: the second adapter's
    request waits), and /metrics renders them as vLLM's lora_requests_info labels."""
    from prometheus_client.parser import text_string_to_metric_families

    from pressroom.entrypoints.openai.metrics import EngineShape, ServerMetrics
    base, paths = adapters
    loras = requests(paths)
    llm = LLM(base, dtype="float32", kv_cache_memory_gib=0.05, enable_lora=True, max_loras=1, max_lora_rank=16)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    llm.engine.add_request("a", {"prompt_token_ids": [5, 6, 7]}, params, lora_request=loras["attn-r8"])
    llm.engine.add_request("b", {"prompt_token_ids": [5, 6, 8]}, params, lora_request=loras["mlp-r4"])
    llm.engine.step()
    stats = llm.engine.core.stats()
    assert stats.running_loras == ["attn-r8"] and stats.waiting_loras == ["mlp-r4"]
    assert stats.num_waiting_deferred == 1  # "b" waits for a LoRA slot: vLLM's reason "deferred", not "capacity"
    metrics = ServerMetrics("tiny", log_requests=False, shape=EngineShape(max_loras=1))
    text = metrics.render([stats]).decode()
    (sample,) = [s for f in text_string_to_metric_families(text) for s in f.samples
                 if s.name == "vllm:lora_requests_info"]
    assert sample.labels == {"model_name": "tiny", "engine": "0", "max_lora": "1",
                             "waiting_lora_adapters": "mlp-r4", "running_lora_adapters": "attn-r8"}
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    llm.shutdown()
