"""vLLM 0.32's Python API names: SamplingParams (every field of vLLM's is one of ours, each either honoured or refused
by name when set to a value pressroom cannot honour, vLLM's spellings of "off" normalised as vLLM's), and the
names `from vllm import ...` brings (AsyncLLMEngine, AsyncEngineArgs, TextPrompt, TokensPrompt)."""
from __future__ import annotations

import dataclasses

import pytest

import pressroom
from pressroom import LLM, AsyncEngineArgs, SamplingParams, TextPrompt, TokensPrompt
from pressroom.sampling_params import (
    REFUSED_FIELDS,
    RepetitionDetectionParams,
    RequestOutputKind,
    _refusals,
)

# vLLM 0.32's SamplingParams fields (vllm/sampling_params.py), in its order, less its private ones (_eos_token_id,
# _all_stop_token_ids, _watermarking_skipped, _bad_words_token_ids: set by its engine, never by a user).
VLLM_FIELDS = (
    "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "watermarking", "top_p",
    "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "max_tokens", "min_tokens", "logprobs",
    "prompt_logprobs", "prompt_logprob_token_ids", "prompt_logprob_start", "logprob_token_ids", "flat_logprobs",
    "detokenize", "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
    "output_kind", "stream_interval", "skip_clone", "output_text_buffer_length", "structured_outputs",
    "logit_bias", "allowed_token_ids", "extra_args", "bad_words", "skip_reading_prefix_cache",
    "thinking_token_budget", "repetition_detection", "routed_experts_prompt_start", "trace_decode_token_ids",
)

# A value of each refused field that pressroom cannot honour, and one it can (vLLM's default or its equal).
REFUSED_VALUES = {
    "watermarking": (True, False),
    "prompt_logprob_token_ids": ([[1, 2]], None),
    "prompt_logprob_start": (0, None),
    "logprob_token_ids": ([3], None),
    "flat_logprobs": (True, False),
    "output_kind": (RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY),
    "stream_interval": (4, 1),
    "skip_reading_prefix_cache": (True, False),
    "repetition_detection": (RepetitionDetectionParams(8, 2, 3), RepetitionDetectionParams()),
    "routed_experts_prompt_start": (5, 0),
    "trace_decode_token_ids": ([1, 2], None),
}


def test_every_vllm_field_is_ours_in_vllms_order():
    ours = [f.name for f in dataclasses.fields(SamplingParams) if f.init]
    assert ours[:len(VLLM_FIELDS)] == list(VLLM_FIELDS)
    assert set(REFUSED_FIELDS) == set(_refusals(SamplingParams())) == set(REFUSED_VALUES)
    assert not any(is_set for is_set, _ in _refusals(SamplingParams()).values())  # the defaults are honoured


@pytest.mark.parametrize("name", REFUSED_FIELDS)
def test_a_field_pressroom_cannot_honour_is_refused_by_name(name):
    refused, accepted = REFUSED_VALUES[name]
    with pytest.raises(ValueError, match=f"SamplingParams.{name}=.*not supported"):
        SamplingParams(**{name: refused})
    SamplingParams(**{name: accepted})


def test_prefix_cache_skip_is_accepted_where_pressroom_does_it():
    assert SamplingParams(prompt_logprobs=1, skip_reading_prefix_cache=True).prompt_logprobs == 1
    with pytest.raises(ValueError, match="skip_reading_prefix_cache"):
        SamplingParams(prompt_logprobs=1, skip_reading_prefix_cache=False)


def test_vllms_spellings_of_off_and_its_derived_fields():
    p = SamplingParams(seed=-1, top_k=-1, thinking_token_budget=-1, logprobs=True, stop=["abcd", "ef"],
                       stop_token_ids=[5, 3, 5])
    assert (p.seed, p.top_k, p.thinking_token_budget, p.logprobs) == (None, 0, None, 1)
    assert p.stop_token_ids == [5, 3] and p.all_stop_token_ids == {3, 5}
    assert p.output_text_buffer_length == 3  # the longest stop string less one, held back while it may complete
    assert SamplingParams(stop=["abcd"], include_stop_str_in_output=True).output_text_buffer_length == 0
    assert SamplingParams(temperature=0.001).temperature == 0.01  # vLLM's floor against overflow
    greedy = SamplingParams(temperature=0, top_p=0.5, top_k=3, min_p=0.2)
    assert (greedy.top_p, greedy.top_k, greedy.min_p) == (1.0, 0, 0.0)
    with pytest.raises(ValueError, match=r"temperature must be in \[0, 2\]"):
        SamplingParams(temperature=2.5)
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=-2)
    with pytest.raises(ValueError, match="min_count"):
        RepetitionDetectionParams(max_pattern_size=4, min_count=1)


@pytest.fixture(scope="module")
def tiny_llm(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama"), dtype="float32", device="cpu")
    yield llm
    llm.shutdown()


def _step_outputs(llm: LLM, params: SamplingParams) -> list:
    """Every output the engine reports for one request, step by step."""
    engine = llm.engine
    engine.add_request("kind", {"prompt_token_ids": [1, 2, 3]}, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.request_id == "kind"]
    return outputs


def test_output_kind_and_detokenize_reach_the_engine(tiny_llm):
    base = dict(temperature=0, max_tokens=4, ignore_eos=True)
    cumulative = _step_outputs(tiny_llm, SamplingParams(**base))
    final_only = _step_outputs(tiny_llm, SamplingParams(**base, output_kind=RequestOutputKind.FINAL_ONLY))
    assert len(cumulative) == 4 and [len(o.outputs[0].token_ids) for o in cumulative] == [1, 2, 3, 4]
    assert len(final_only) == 1 and final_only[0].finished
    assert final_only[0].outputs[0].token_ids == cumulative[-1].outputs[0].token_ids
    texts = [tiny_llm.generate([[1, 2, 3]], SamplingParams(**base, detokenize=d), use_tqdm=False)[0].outputs[0].text
             for d in (True, False)]
    assert texts[0] and texts[1] == ""
    # skip_clone, stream_interval=1 and the accepted values above change nothing in the output
    same = tiny_llm.generate([[1, 2, 3]], SamplingParams(**base, skip_clone=True, stream_interval=1,
                                                          watermarking=False), use_tqdm=False)
    assert same[0].outputs[0].token_ids == cumulative[-1].outputs[0].token_ids


def test_vllms_top_level_names_are_exported():
    for name in ("LLM", "SamplingParams", "AsyncLLMEngine", "AsyncEngineArgs", "EngineArgs", "TextPrompt",
                 "TokensPrompt", "RequestOutput", "CompletionOutput", "PoolingParams", "PoolingRequestOutput",
                 "BeamSearchParams", "RequestOutputKind", "StructuredOutputsParams", "ClassificationOutput",
                 "ClassificationRequestOutput", "ScoringOutput", "ScoringRequestOutput"):
        assert name in pressroom.__all__ and getattr(pressroom, name) is not None, name
    args = AsyncEngineArgs.from_kwargs(model="m", tensor_parallel_size=1)
    assert isinstance(args, pressroom.EngineArgs) and args.enable_log_requests is False
    with pytest.raises(ValueError, match="enable_log_requests"):
        AsyncEngineArgs(model="m", enable_log_requests=True)


def test_text_and_tokens_prompts_as_vllms(tiny_llm):
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    ids = tiny_llm.get_tokenizer().encode("hello there")
    by_text = tiny_llm.generate(TextPrompt(prompt="hello there"), params, use_tqdm=False)[0]
    by_ids = tiny_llm.generate(TokensPrompt(prompt_token_ids=ids, cache_salt="a"), params, use_tqdm=False)[0]
    assert by_text.prompt_token_ids == ids and by_ids.outputs[0].token_ids == by_text.outputs[0].token_ids
    with pytest.raises(ValueError, match="multi_modal_data"):
        tiny_llm.generate({"prompt": "hi", "multi_modal_data": {"image": b"x"}}, params, use_tqdm=False)
    with pytest.raises(ValueError, match="Unknown prompt key"):
        tiny_llm.generate({"prompt": "hi", "promt_token_ids": [1]}, params, use_tqdm=False)


def test_async_engine_takes_vllms_calling_convention(tiny_async_engine):
    """vLLM's `generate(prompt, sampling_params, request_id)`, awaited abort and get_tokenizer, and pressroom's own
    order still, on the session's engine (its methods called as pressroom.AsyncLLMEngine's)."""
    import asyncio

    from pressroom import AsyncLLMEngine

    engine = tiny_async_engine
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    async def final(stream):
        last = None
        async for out in stream:
            last = out
        return last

    async def run():
        ours = await final(AsyncLLMEngine.generate(engine, "vllm-order", [1, 2, 3], params))
        theirs = await final(AsyncLLMEngine.generate(engine, [1, 2, 3], params, "vllm-order"))
        keywords = await final(AsyncLLMEngine.generate(engine, prompt=[1, 2, 3], sampling_params=params,
                                                       request_id="kw", priority=0))
        assert await AsyncLLMEngine.get_tokenizer(engine) is engine.tokenizer
        await AsyncLLMEngine.abort(engine, ["not-running"])
        with pytest.raises(ValueError, match="trace_headers"):
            await final(AsyncLLMEngine.generate(engine, [1], params, "x", trace_headers={"a": "b"}))
        return ours, theirs, keywords

    ours, theirs, keywords = asyncio.run(run())
    assert theirs.finished and theirs.request_id == "vllm-order"
    assert list(theirs.outputs[0].token_ids) == list(ours.outputs[0].token_ids) == list(keywords.outputs[0].token_ids)
    with pytest.raises(ValueError, match="stat_loggers"):
        AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model="m"), stat_loggers=[object()])


def test_generate_without_params_takes_the_models_generation_config(tiny_model_dir, tmp_path):
    """vLLM's LLM.get_default_sampling_params: the checkpoint's generation_config.json fields (max_new_tokens as
    max_tokens), which generate() uses when given no SamplingParams; a model without one gets the plain defaults."""
    import shutil

    from transformers import GenerationConfig
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), model)
    (model / "generation_config.json").unlink(missing_ok=True)
    with LLM(str(model), dtype="float32", device="cpu") as plain:
        assert plain.get_default_sampling_params() == SamplingParams()
        GenerationConfig(do_sample=True, temperature=0.7, top_k=1, max_new_tokens=5).save_pretrained(str(model))
        defaults = plain.get_default_sampling_params()
        assert (defaults.temperature, defaults.top_k, defaults.max_tokens) == (0.7, 1, 5)
        out = plain.generate({"prompt_token_ids": [1, 2, 3]}, use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 5
