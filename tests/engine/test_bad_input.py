"""Bad input fails fast with a ValueError that names the problem, and never disturbs a running engine."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from pressroom import LLM, SamplingParams
from pressroom.config import EngineArgs
from pressroom.engine.llm_engine import LLMEngine

MAX_LEN = 64


@pytest.fixture(scope="module")
def tiny_dir(tiny_model_dir) -> str:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def llm(tiny_dir) -> LLM:
    return LLM(tiny_dir, dtype="float32", kv_cache_memory_gib=0.1, max_model_len=MAX_LEN)


def _engine(path: str) -> LLMEngine:
    return LLMEngine.from_engine_args(EngineArgs(model=path, dtype="float32", kv_cache_memory_gib=0.1,
                                                 max_model_len=MAX_LEN))


# ---- prompts --------------------------------------------------------------------------------

@pytest.mark.parametrize("prompt", ["", {"prompt_token_ids": []}, {"prompt": ""}, []])
def test_empty_prompt(llm, prompt):
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)


@pytest.mark.parametrize("length", [MAX_LEN + 1, 300])
def test_prompt_longer_than_max_model_len(llm, length):
    with pytest.raises(ValueError, match=rf"prompt is {length} tokens long.*max_model_len={MAX_LEN}"):
        llm.generate({"prompt_token_ids": [100] * length}, SamplingParams(max_tokens=2), use_tqdm=False)
    text = "word " * (length + 5)  # a text prompt over the limit, too
    with pytest.raises(ValueError, match=rf"max_model_len={MAX_LEN}"):
        llm.generate(text, SamplingParams(max_tokens=2), use_tqdm=False)


def test_llm_still_serves_after_rejected_prompts(llm):
    for bad in ("", {"prompt_token_ids": [5] * 500}):
        with pytest.raises(ValueError):
            llm.generate(bad, SamplingParams(max_tokens=2), use_tqdm=False)
    out = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out) == 1 and len(out[0].outputs[0].token_ids) == 3


def test_rejected_batch_leaves_no_request_behind(llm):
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate(["fine prompt", "another one", ""], SamplingParams(max_tokens=2), use_tqdm=False)
    leftover = llm.engine.has_unfinished_requests()
    if leftover:  # leave the module's engine clean for the tests after this one
        llm.engine.abort_request(list(llm.engine.parents))
    assert not leftover


def test_model_max_len_over_the_models_limit(tiny_dir):
    with pytest.raises(ValueError, match="max_model_len 100000 exceeds the model's limit of 2048"):
        LLM(tiny_dir, kv_cache_memory_gib=0.1, max_model_len=100_000)


# ---- sampling parameters ------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, match", [
    (dict(max_tokens=0), r"max_tokens must be at least 1, got 0"),
    (dict(max_tokens=-3), r"max_tokens must be at least 1, got -3"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\], got 1.5"),
    (dict(top_p=-0.1), r"top_p must be in \(0, 1\]"),
    (dict(temperature=-0.5), r"temperature must be non-negative, got -0.5"),
    (dict(temperature=float("nan")), r"temperature must be non-negative"),
    (dict(top_k=-2), r"top_k must be -1 \(off\), 0 \(off\) or a positive integer, got -2"),
    (dict(min_p=1.5), r"min_p must be in \[0, 1\]"),
    (dict(n=0), r"n must be at least 1"),
    (dict(repetition_penalty=0.0), r"repetition_penalty must be positive"),
    (dict(presence_penalty=2.5), r"presence_penalty must be in \[-2, 2\]"),
    (dict(frequency_penalty=-3.0), r"frequency_penalty must be in \[-2, 2\]"),
    (dict(min_tokens=-1), r"min_tokens must be non-negative"),
    (dict(min_tokens=5, max_tokens=4), r"min_tokens \(5\) must not exceed max_tokens \(4\)"),
    (dict(logprobs=-1), r"logprobs must be non-negative"),
    (dict(stop=["ok", ""]), r"stop strings must not be empty"),
])
def test_invalid_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_clone_validates_too():
    with pytest.raises(ValueError, match="top_p must be in"):
        SamplingParams().clone(top_p=2.0)


# ---- model files ----------------------------------------------------------------------------

@pytest.mark.parametrize("kv_cache_dtype, device, match", [
    ("int4", "cpu", "kv_cache_dtype must be one of auto, fp8"),
    ("fp8", "cpu", "needs the CUDA backend"),
])
def test_kv_cache_dtype_the_backend_cannot_store(kv_cache_dtype, device, match):
    with pytest.raises(ValueError, match=match):
        EngineArgs(model="unused", device=device, kv_cache_dtype=kv_cache_dtype).create_engine_config()


def test_unknown_model_path():
    with pytest.raises(ValueError, match=r"Model path '/nonexistent/x' does not exist"):
        LLM("/nonexistent/x", kv_cache_memory_gib=0.1)


def test_directory_without_config(tmp_path):
    with pytest.raises(ValueError, match="has no config.json"):
        LLM(str(tmp_path), kv_cache_memory_gib=0.1)


def _copy_model(src: str, dst) -> str:
    path = str(dst / "model")
    shutil.copytree(src, path)
    return path


def _damage(path: str, how: str) -> None:
    file = os.path.join(path, "model.safetensors")
    with open(file, "rb") as f:
        data = bytearray(f.read())
    if how == "truncated":
        data = data[:len(data) // 2]
    elif how == "garbage_length":  # the 8-byte little-endian header length
        data[:8] = b"\xfe\xed\xfa\xce\xde\xad\xbe\xef"
    elif how == "garbage_json":  # the JSON header itself
        data[8:48] = b"\x00\x01garbage" * 4
    elif how == "empty":
        data = bytearray()
    with open(file, "wb") as f:
        f.write(data)


@pytest.mark.parametrize("how, match", [
    ("truncated", r"model\.safetensors' is truncated or corrupt"),
    ("garbage_length", r"model\.safetensors' is truncated or corrupt.*header"),
    ("garbage_json", r"model\.safetensors' is truncated or corrupt.*header"),
    ("empty", r"model\.safetensors' is truncated or corrupt"),
])
def test_damaged_safetensors(tiny_dir, tmp_path, how, match):
    path = _copy_model(tiny_dir, tmp_path)
    _damage(path, how)
    with pytest.raises(ValueError, match=match):
        LLM(path, kv_cache_memory_gib=0.1)


def test_missing_safetensors(tiny_dir, tmp_path):
    path = _copy_model(tiny_dir, tmp_path)
    os.remove(os.path.join(path, "model.safetensors"))
    with pytest.raises(ValueError, match=r"has no \*\.safetensors weights"):
        LLM(path, kv_cache_memory_gib=0.1)


def test_corrupt_config_json(tiny_dir, tmp_path):
    path = _copy_model(tiny_dir, tmp_path)
    with open(os.path.join(path, "config.json"), "w") as f:
        f.write("{ not json")
    with pytest.raises(ValueError, match=r"Could not read .*config\.json"):
        LLM(path, kv_cache_memory_gib=0.1)


def _rewrite_weights(path: str, edit) -> None:
    from safetensors.torch import load_file, save_file
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_checkpoint_with_an_unknown_tensor(tiny_dir, tmp_path):
    path = _copy_model(tiny_dir, tmp_path)
    _rewrite_weights(path, lambda t: t.__setitem__("model.bogus.weight", t["model.norm.weight"].clone()))
    with pytest.raises(ValueError, match=r"'model\.bogus\.weight' has no place"):
        LLM(path, kv_cache_memory_gib=0.1)


def test_checkpoint_missing_a_whole_tensor(tiny_dir, tmp_path):
    path = _copy_model(tiny_dir, tmp_path)
    _rewrite_weights(path, lambda t: t.pop("model.layers.1.post_attention_layernorm.weight"))
    with pytest.raises(ValueError, match=r"lacks 1 tensor.*post_attention_layernorm"):
        LLM(path, kv_cache_memory_gib=0.1)


@pytest.mark.parametrize("part", ["mlp.up_proj", "self_attn.k_proj"])
def test_checkpoint_missing_part_of_a_stacked_weight(tiny_dir, tmp_path, part):
    path = _copy_model(tiny_dir, tmp_path)
    _rewrite_weights(path, lambda t: t.pop(f"model.layers.1.{part}.weight"))
    with pytest.raises(ValueError, match=part.split(".")[-1]):
        LLM(path, kv_cache_memory_gib=0.1)


@pytest.mark.parametrize("key, value", [("intermediate_size", 96), ("intermediate_size", 160),
                                        ("num_key_value_heads", 1)])
def test_config_and_checkpoint_shapes_disagree(tiny_dir, tmp_path, key, value):
    path = _copy_model(tiny_dir, tmp_path)
    cfg_file = os.path.join(path, "config.json")
    with open(cfg_file) as f:
        cfg = json.load(f)
    cfg[key] = value
    with open(cfg_file, "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="shape"):
        LLM(path, kv_cache_memory_gib=0.1)


def test_truncated_gguf(embedded_path, tmp_path):
    with open(embedded_path, "rb") as f:
        data = f.read()
    path = tmp_path / "half.gguf"
    path.write_bytes(data[:len(data) // 2])
    with pytest.raises(ValueError, match=r"half\.gguf is truncated"):
        LLM(str(path), kv_cache_memory_gib=0.1)
    head = tmp_path / "head.gguf"
    head.write_bytes(data[:1000])  # cut inside the metadata
    with pytest.raises(ValueError, match=r"head\.gguf is truncated or corrupt in its header"):
        LLM(str(head), kv_cache_memory_gib=0.1)


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"this is not a model" * 10)
    with pytest.raises(ValueError, match=r"is not a GGUF file"):
        LLM(str(path), kv_cache_memory_gib=0.1)


# ---- a running engine -----------------------------------------------------------------------

IN_FLIGHT = [
    ("greedy", "The quick brown fox", SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)),
    ("seeded", "Once upon a time", SamplingParams(temperature=1.0, seed=7, max_tokens=10, ignore_eos=True,
                                                 logprobs=2)),
]


def _run(engine: LLMEngine, prefix: str, inject=None) -> dict[str, list[int]]:
    """Runs the IN_FLIGHT pair; `inject(engine)` is called after two steps."""
    for rid, prompt, params in IN_FLIGHT:
        engine.add_request(prefix + rid, prompt, params)
    done: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id[len(prefix):]] = out.outputs[0].token_ids
        steps += 1
        if steps == 2 and inject is not None:
            assert len(done) == 0  # both requests really are in flight
            inject(engine)
    return done


@pytest.fixture(scope="module")
def clean_tokens(llm) -> dict[str, list[int]]:
    tokens = _run(llm.engine, "clean-")
    assert all(len(t) == 10 for t in tokens.values())
    return tokens


BAD_REQUESTS = [
    ("dup", ("bad-greedy", "hello", SamplingParams()), r"Request id 'bad-greedy' is already in use"),
    ("empty", ("x-empty", "", SamplingParams()), "prompt is empty"),
    ("too_long", ("x-long", {"prompt_token_ids": [7] * 200}, SamplingParams()), "max_model_len"),
    ("token_oob", ("x-oob", {"prompt_token_ids": [5, 10**6]}, SamplingParams()),
     r"Prompt token ids must lie in \[0, 49152\)"),
    ("token_neg", ("x-neg", {"prompt_token_ids": [-1, 5]}, SamplingParams()), "Prompt token ids"),
    ("logprobs", ("x-lp", "hello", SamplingParams(logprobs=21)),
     r"Requested sample logprobs of 21, which is greater than max allowed: 20"),
    ("prompt_logprobs", ("x-plp", "hello", SamplingParams(prompt_logprobs=50)),
     "Requested prompt logprobs of 50, which is greater than max allowed: 20"),
    ("bias", ("x-bias", "hello", SamplingParams(logit_bias={49152: 1.0})), "logit_bias token ids"),
]


def test_running_engine_rejects_bad_requests_and_keeps_serving(llm, clean_tokens):
    def inject(engine):
        for _name, (rid, prompt, params), match in BAD_REQUESTS:
            with pytest.raises(ValueError, match=match):
                engine.add_request(rid, prompt, params)
        assert engine.get_num_unfinished_requests() == 2
        engine.add_request("bad-late", "A late but valid request", SamplingParams(temperature=0.0, max_tokens=3))

    done = _run(llm.engine, "bad-", inject)
    assert len(done.pop("late")) == 3
    assert {k: done[k] for k in ("greedy", "seeded")} == clean_tokens
    assert not llm.engine.has_unfinished_requests()


ACCEPTED_THEN_CRASH = {
    # Passes add_request's checks, then makes step() raise for the whole batch.
    "float_token_ids": ({"prompt_token_ids": [1.5, 200.7, 300.2]}, SamplingParams(max_tokens=3)),
    "str_logit_bias_key": ("hello", SamplingParams(max_tokens=3, logit_bias={"5": 1.0})),
    "stop_token_id_oob_with_min_tokens": ("hello", SamplingParams(max_tokens=3, min_tokens=2,
                                                                  stop_token_ids=[10**9])),
}


@pytest.mark.parametrize("case", list(ACCEPTED_THEN_CRASH))
def test_request_that_passes_validation_must_not_break_the_engine(tiny_dir, clean_tokens, case):
    prompt, params = ACCEPTED_THEN_CRASH[case]

    def inject(engine):
        try:
            engine.add_request("intruder", prompt, params)
        except ValueError:
            pass  # rejecting it up front is fine

    done = _run(_engine(tiny_dir), "", inject)
    assert {k: done[k] for k in ("greedy", "seeded")} == clean_tokens


@pytest.mark.parametrize("order", ["parent_first", "child_id_first"])
def test_request_id_colliding_with_an_n_child_id(tiny_dir, order):
    engine = _engine(tiny_dir)
    parent = ("x", "Hello there", SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=4, ignore_eos=True))
    single = ("0_x", "Other prompt", SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    first, second = (parent, single) if order == "parent_first" else (single, parent)
    engine.add_request(*first)
    try:
        engine.add_request(*second)
    except ValueError:
        return  # rejecting the clash is fine
    done = {}
    for _ in range(50):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert set(done) == {"x", "0_x"}
    assert len(done["x"].outputs) == 2 and all(len(c.token_ids) == 4 for c in done["x"].outputs)
    assert len(done["0_x"].outputs) == 1 and len(done["0_x"].outputs[0].token_ids) == 4
