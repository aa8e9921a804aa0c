"""The offline API, with vLLM's names: `LLM(model=...).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

from collections.abc import Sequence

from pressroom.config import EngineArgs
from pressroom.engine import beam_search
from pressroom.engine.beam_search import BeamSearch, BeamSearchOutput
from pressroom.engine.inputs import check_prompt
from pressroom.engine.llm_engine import LLMEngine, PromptType
from pressroom.lora.request import LoRARequest
from pressroom.outputs import PoolingRequestOutput, RequestOutput
from pressroom.pooling_params import PoolingParams
from pressroom.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

Messages = list[dict[str, str]]


class LLM:
    def __init__(self, model: str | None = None, **engine_args) -> None:
        self.engine = LLMEngine.from_engine_args(EngineArgs.from_kwargs(model=model, **engine_args))
        self._counter = 0

    def get_tokenizer(self):
        return self.engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix (vLLM's `LLM.reset_prefix_cache`); False, changing nothing, while requests
        run (none do between this API's calls)."""
        core = self.engine.core
        if not hasattr(core, "kv_cache"):
            raise ValueError("reset_prefix_cache needs the engine core in this process (data_parallel_size 1).")
        if core.has_unfinished_requests():
            return False
        core.kv_cache.reset_prefix_cache()
        return True

    def sleep(self, level: int = 1) -> None:
        raise ValueError("pressroom has no sleep mode (vLLM's enable_sleep_mode): its weights and KV cache stay on "
                         "the device; call shutdown() to free them.")

    wake_up = sleep

    def shutdown(self) -> None:
        """Frees the model, its KV cache and the device memory they held, now (not at the next garbage
        collection). The LLM cannot generate afterwards. `with LLM(...) as llm:` and `del llm` call it."""
        engine = getattr(self, "engine", None)
        if engine is not None:
            self.engine = None
            engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self) -> None:
        self.shutdown()

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """`lora_request`: the adapter every prompt runs with, or one per prompt (None: the base model); needs
        an engine started with enable_lora."""
        prompts = _as_list(prompts)
        params = _broadcast(sampling_params or SamplingParams(), len(prompts), "sampling_params")
        priorities = _broadcast(list(priority) if priority is not None else 0, len(prompts), "priority")
        loras = _broadcast(lora_request if not isinstance(lora_request, Sequence) else list(lora_request),
                           len(prompts), "lora_request")
        ids: list[str] = []
        try:
            for p, sp, pr, lora in zip(prompts, params, priorities, loras):
                ids.append(self._add(p, sp, pr, lora))
        except ValueError:
            self.engine.abort_request(ids)  # a rejected batch leaves nothing queued
            raise
        return self._run(ids, use_tqdm)

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams,
                    lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                    use_tqdm: bool = False, concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
        """vLLM's beam search: each prompt's best beams (at most beam_width, best first), each with its tokens
        (the prompt's and the generated ones), the candidates of each step, its cumulative logprob and its
        text (all its tokens decoded, as vLLM's). Every step runs the live beams of up to `concurrency_limit`
        prompts (None: all of them) as one batch. `use_tqdm` is taken for vLLM's signature; no bar is shown."""
        prompts = _as_list(prompts)
        loras = _broadcast(lora_request if not isinstance(lora_request, Sequence) else list(lora_request),
                           len(prompts), "lora_request")
        if concurrency_limit is not None and concurrency_limit < 1:
            raise ValueError(f"concurrency_limit must be a positive integer, got {concurrency_limit}.")
        engine = self.engine
        if engine is None:
            raise RuntimeError("This LLM was shut down; create a new one.")
        searches = [BeamSearch(engine.tokenize_prompt(p)[1], params, engine.eos_token_id, engine.max_model_len,
                               context=(_cache_salt(p), lora)) for p, lora in zip(prompts, loras)]
        batch = concurrency_limit or max(len(prompts), 1)
        for start in range(0, len(searches), batch):
            beam_search.run(searches[start:start + batch], lambda beams: self._beam_step(beams, params))
        tokenizer = engine.tokenizer
        outputs = []
        for search in searches:
            best = search.best()
            for beam in best:
                beam.text = tokenizer.decode(beam.tokens) if tokenizer is not None else None
            outputs.append(BeamSearchOutput(best))
        return outputs

    def _beam_step(self, beams: beam_search.Beams, params: BeamSearchParams) -> list:
        """One step of beam search: every live beam's next token, as one batch."""
        step = beam_search.step_params(params)
        ids: list[str] = []
        try:
            for (salt, lora), tokens in beams:
                ids.append(self._add({**salt, "prompt_token_ids": tokens}, step, 0, lora))
        except ValueError:
            self.engine.abort_request(ids)
            raise
        return [beam_search.candidates_of(out) for out in self._run(ids, use_tqdm=False)]

    def embed(self, prompts: PromptType | Sequence[PromptType],
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              use_tqdm: bool = True) -> list[PoolingRequestOutput]:
        """One vector per prompt (`out.outputs.embedding`), pooled as the model's config says unless
        `pooling_params` override it; needs a model started with runner="pooling" (an encoder's default)."""
        prompts = _as_list(prompts)
        params = _broadcast(pooling_params or PoolingParams(), len(prompts), "pooling_params")
        ids: list[str] = []
        try:
            for p, pp in zip(prompts, params):
                check_prompt(p)
                ids.append(self._next_id())
                self.engine.add_pooling_request(ids[-1], p, pp)
        except ValueError:
            self.engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    encode = embed  # vLLM's generic pooling call

    def chat(self, messages: Messages | Sequence[Messages], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [{"prompt_token_ids": self.apply_chat_template(c, add_generation_prompt, chat_template_kwargs)}
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(self, messages: Messages, add_generation_prompt: bool = True,
                            chat_template_kwargs: dict | None = None) -> list[int]:
        tokenizer = self.engine.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("This model's tokenizer has no chat template; use generate() with a plain prompt.")
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                            **(chat_template_kwargs or {}))
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    def _add(self, prompt: PromptType, params: SamplingParams, priority: int, lora: LoRARequest | None = None) -> str:
        check_prompt(prompt)
        rid = self._next_id()
        self.engine.add_request(rid, prompt, params.clone(output_kind=RequestOutputKind.FINAL_ONLY), priority=priority,
                                lora_request=lora)
        return rid

    def _next_id(self) -> str:
        if self.engine is None:
            raise RuntimeError("This LLM was shut down; create a new one.")
        self._counter += 1
        return str(self._counter - 1)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = _progress(len(ids), use_tqdm)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return [finished[i] for i in ids]


def _as_list(prompts) -> list:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and isinstance(prompts[0], int):
        return [prompts]  # one prompt given as token ids
    return prompts


def _cache_salt(prompt: PromptType) -> dict:
    """The prompt's cache salt as a prompt-dict entry (the beams of a salted prompt share only its cache)."""
    if isinstance(prompt, dict) and prompt.get("cache_salt") is not None:
        return {"cache_salt": prompt["cache_salt"]}
    return {}


def _broadcast(value, n: int, name: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for {n} prompts.")
        return list(value)
    return [value] * n


def _progress(total: int, enabled: bool):
    if not enabled or total < 2:
        return None
    from tqdm import tqdm
    return tqdm(total=total, desc="Processed prompts", unit="req", dynamic_ncols=True)
