"""The offline API, with vLLM's names: `LLM(model=...).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pressroom.config import EngineArgs
from pressroom.engine import beam_search
from pressroom.engine.beam_search import BeamSearch, BeamSearchOutput
from pressroom.engine.classify import (
    ClassificationOutput,
    ClassificationRequestOutput,
    ClassifierHead,
    ScoringOutput,
    ScoringRequestOutput,
    check_pair_segments,
    classifier_pooling,
    cosine,
    pair_token_ids,
    pair_up,
)
from pressroom.engine.core import CoreOutputs, EngineCore
from pressroom.engine.inputs import check_prompt
from pressroom.engine.llm_engine import LLMEngine, PromptType
from pressroom.lora.request import LoRARequest
from pressroom.outputs import PoolingOutput, PoolingRequestOutput, RequestOutput
from pressroom.pooling_params import PoolingParams
from pressroom.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

Messages = list[dict[str, Any]]  # content: a string, or OpenAI content parts


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

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """vLLM's `LLM.sleep` (needs enable_sleep_mode=True). Level 1: the weights move to host memory (on the CPU
        they are there already) and the KV cache is freed, its contents forgotten (the prefix cache is emptied);
        level 2: the weights are freed too, and wake_up reloads them from the checkpoint; level 0 only pauses
        scheduling. `mode`: what happens to requests in flight ("abort" ends them; none are between this API's
        calls). Generating while asleep is an error: call wake_up first."""
        core = self._local_core("sleep")
        ended = core.sleep(level, mode)
        if ended:  # the front-end forgets them too
            self.engine.process_outputs(CoreOutputs(ended, []))

    def wake_up(self, tags: list[str] | None = None) -> None:
        """vLLM's `LLM.wake_up`: restores the weights and the KV cache, or only those `tags` names ("weights",
        "kv_cache"; "scheduling" ends a level-0 pause). Generation resumes once nothing is asleep."""
        self._local_core("wake_up").wake_up(tags)

    def is_sleeping(self) -> bool:
        """Whether the engine is asleep at any level (vLLM's `LLM.is_sleeping`)."""
        return self._local_core("is_sleeping").is_sleeping()

    def _local_core(self, what: str) -> EngineCore:
        if self.engine is None:
            raise RuntimeError("This LLM was shut down; create a new one.")
        core = self.engine.core
        if not isinstance(core, EngineCore):
            raise ValueError(f"{what} needs the engine core in this process (data_parallel_size 1).")
        return core

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

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: the sampling fields the model's generation_config.json sets (as the server's
        --generation-config auto takes them), else SamplingParams' own defaults."""
        from pressroom.engine.sampling_defaults import load_sampling_defaults
        if self.engine is None:
            raise RuntimeError("This LLM was shut down; create a new one.")
        values = load_sampling_defaults("auto", None, self.engine.model_path).values
        return SamplingParams(**values)

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """`lora_request`: the adapter every prompt runs with, or one per prompt (None: the base model); needs
        an engine started with enable_lora."""
        prompts = _as_list(prompts)
        params = _broadcast(sampling_params or self.get_default_sampling_params(), len(prompts), "sampling_params")
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
              use_tqdm: bool = True, lora_request: LoRARequest | None = None,
              tokenization_kwargs: dict | None = None) -> list[PoolingRequestOutput]:
        """One vector per prompt (`out.outputs.embedding`), pooled as the model's config says unless
        `pooling_params` override it; needs a model started with runner="pooling" (an encoder's default)."""
        _refuse_pooling_extras(lora_request, tokenization_kwargs)
        if self._classifier() is not None:
            raise ValueError("This model is a classifier (its checkpoint's head gives class logits, not embeddings); "
                             "use LLM.classify, or LLM.score for a cross-encoder.")
        prompts = _as_list(prompts)
        return self._pool(prompts, _broadcast(pooling_params or PoolingParams(), len(prompts), "pooling_params"),
                          use_tqdm)

    def classify(self, prompts: PromptType | Sequence[PromptType], *,
                 pooling_params: PoolingParams | Sequence[PoolingParams] | None = None, use_tqdm: bool = True,
                 lora_request: LoRARequest | None = None,
                 tokenization_kwargs: dict | None = None) -> list[ClassificationRequestOutput]:
        """Each prompt's class probabilities (vLLM's LLM.classify: `out.outputs.probs`), with the activation vLLM
        applies (softmax over several labels, sigmoid for one, or the config's); `pooling_params.use_activation`
        False gives the logits. Needs an `*ForSequenceClassification` checkpoint."""
        _refuse_pooling_extras(lora_request, tokenization_kwargs)
        head = self._classifier()
        if head is None:
            raise ValueError("LLM.classify needs a classification model (an *ForSequenceClassification checkpoint); "
                             "this one is not. Use LLM.embed for embeddings.")
        prompts = _as_list(prompts)
        params = [classifier_pooling(p) for p in _broadcast(pooling_params, len(prompts), "pooling_params")]
        outs = self._pool(prompts, params, use_tqdm)
        return [ClassificationRequestOutput(o.request_id, ClassificationOutput(head.probs(o.outputs.data,
                                                                                          p.use_activation)),
                                            o.prompt_token_ids) for o, p in zip(outs, params)]

    def score(self, data_1: str | Sequence[str], data_2: str | Sequence[str], /, *, use_tqdm: bool = True,
              pooling_params: PoolingParams | None = None, lora_request: LoRARequest | None = None,
              tokenization_kwargs: dict | None = None, chat_template: str | None = None) -> list[ScoringRequestOutput]:
        """vLLM's LLM.score: a score for each pair of texts, paired 1:1, 1:N (data_1's one text with each of
        data_2's) or N:N. A cross-encoder (a one-label classifier) reads each pair as one prompt and gives its
        activated logit; an embedding model gives the cosine similarity of the two texts' embeddings."""
        _refuse_pooling_extras(lora_request, tokenization_kwargs)
        if chat_template is not None:
            raise ValueError("chat_template is not supported by LLM.score: pressroom scores text pairs as the "
                             "tokenizer pairs them (multimodal scoring templates are not supported).")
        if self.engine is None:
            raise RuntimeError("This LLM was shut down; create a new one.")
        if self.engine.pooling_defaults is None:
            raise ValueError("LLM.score() is only supported for pooling models; start the LLM with runner='pooling'.")
        pairs = pair_up(_score_texts(data_1, "data_1"), _score_texts(data_2, "data_2"))
        head = self._classifier()
        if head is not None:
            return self._cross_encode(head, pairs, pooling_params, use_tqdm)
        return self._bi_encode(pairs, pooling_params, use_tqdm)

    def _cross_encode(self, head: ClassifierHead, pairs: list[tuple[str, str]], pooling_params: PoolingParams | None,
                      use_tqdm: bool) -> list[ScoringRequestOutput]:
        if not head.is_cross_encoder:
            raise ValueError(f"Scoring needs a cross-encoder (num_labels == 1); this classifier has {head.num_labels} "
                             "labels: use LLM.classify.")
        check_pair_segments(self.engine.hf_config)
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError("LLM.score needs a tokenizer to pair texts; this LLM was started with "
                             "skip_tokenizer_init.")
        params = classifier_pooling(pooling_params)
        prompts = [{"prompt_token_ids": pair_token_ids(tokenizer, a, b)} for a, b in pairs]
        outs = self._pool(prompts, [params] * len(prompts), use_tqdm)
        return [ScoringRequestOutput(o.request_id, ScoringOutput(head.probs(o.outputs.data, params.use_activation)[0]),
                                     o.prompt_token_ids) for o in outs]

    def _bi_encode(self, pairs: list[tuple[str, str]], pooling_params: PoolingParams | None,
                   use_tqdm: bool) -> list[ScoringRequestOutput]:
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))  # each text embedded once
        outs = dict(zip(texts, self._pool(texts, [pooling_params or PoolingParams()] * len(texts), use_tqdm)))
        return [ScoringRequestOutput(f"{outs[a].request_id}_{outs[b].request_id}",
                                     ScoringOutput(cosine(outs[a].outputs.data, outs[b].outputs.data)),
                                     outs[a].prompt_token_ids + outs[b].prompt_token_ids) for a, b in pairs]

    def _classifier(self) -> ClassifierHead | None:
        if self.engine is None:
            raise RuntimeError("This LLM was shut down; create a new one.")
        if self.engine.pooling_defaults is None:
            return None
        return ClassifierHead.of(self.engine.hf_config)

    def _pool(self, prompts: list, params: list[PoolingParams], use_tqdm: bool) -> list[PoolingRequestOutput]:
        """One pooling request per prompt (all or none: a rejected one aborts the rest), run to their vectors."""
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

    def encode(self, prompts: PromptType | Sequence[PromptType],
               pooling_params: PoolingParams | Sequence[PoolingParams] | None = None, *, use_tqdm: bool = True,
               lora_request: LoRARequest | None = None, pooling_task: str | None = None,
               tokenization_kwargs: dict | None = None) -> list[PoolingRequestOutput]:
        """vLLM's generic pooling call: `pooling_task` "embed" (embed's vectors) or "classify" (classify's
        probabilities as each output's data); None: the model's own task (vLLM asks for it). The per-token tasks
        (token_embed, token_classify) and plugins are refused."""
        task = pooling_task or ("classify" if self._classifier() is not None else "embed")
        if task == "embed":
            return self.embed(prompts, pooling_params, use_tqdm, lora_request, tokenization_kwargs)
        if task == "classify":
            outs = self.classify(prompts, pooling_params=pooling_params, use_tqdm=use_tqdm, lora_request=lora_request,
                                 tokenization_kwargs=tokenization_kwargs)
            return [PoolingRequestOutput(o.request_id, o.prompt_token_ids, PoolingOutput(o.outputs.probs))
                    for o in outs]
        raise ValueError(f"pooling_task {task!r} is not supported: pressroom pools one vector per prompt (embed, "
                         "classify); per-token tasks and plugins are not implemented.")

    def chat(self, messages: Messages | Sequence[Messages], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """vLLM's: each conversation rendered by the model's chat template; a message's content may be OpenAI
        content parts, images (`image_url` with a data URL, or `image_pil`) and audio (`input_audio`, `audio_url`)
        among them, for a model that takes them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self._chat_prompt(c, add_generation_prompt, chat_template_kwargs) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _chat_prompt(self, messages: Messages, add_generation_prompt: bool, chat_template_kwargs: dict | None
                     ) -> dict:
        """A conversation as a TokensPrompt, with its media (images, audio) as multi_modal_data."""
        from pressroom.multimodal.chat import extract_media
        from pressroom.multimodal.processor import supported_modalities
        hf_config = self.engine.hf_config
        messages, media = extract_media(messages, supported_modalities(hf_config),
                                        model=f"this model ({getattr(hf_config, 'model_type', '?')})")
        prompt = {"prompt_token_ids": self.apply_chat_template(messages, add_generation_prompt, chat_template_kwargs)}
        if media:
            prompt["multi_modal_data"] = media
        return prompt

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
        if isinstance(self.engine.core, EngineCore) and self.engine.core.is_sleeping():
            raise RuntimeError("The engine is asleep (LLM.sleep): call wake_up() before generating.")
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
                            _advance(bar, out)
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


def _score_texts(data: str | Sequence[str], name: str) -> list[str]:
    texts = [data] if isinstance(data, str) else list(data)
    if not all(isinstance(t, str) and t for t in texts):
        raise ValueError(f"{name} must be a non-empty text or a list of them (pressroom scores text only).")
    return texts


def _refuse_pooling_extras(lora_request: LoRARequest | None, tokenization_kwargs: dict | None) -> None:
    """vLLM's pooling calls' arguments pressroom's pooling cannot honour, refused by name when given."""
    if lora_request is not None:
        raise ValueError("lora_request is not supported for pooling (embed, classify, score): adapters apply to "
                         "generation only.")
    if tokenization_kwargs:
        raise ValueError("tokenization_kwargs is not supported: prompts are tokenized as the model's tokenizer "
                         "does by default; pass token ids (TokensPrompt) to tokenize otherwise.")


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
    """vLLM's bar over finished requests, whatever their number, with its token-speed postfix."""
    if not enabled or total < 1:
        return None
    from tqdm import tqdm
    bar = tqdm(total=total, desc="Processed prompts", unit="req", dynamic_ncols=True)
    bar.tokens = [0, 0]  # prompt, generated
    return bar


def _advance(bar, out) -> None:
    bar.tokens[0] += len(getattr(out, "prompt_token_ids", None) or ())
    bar.tokens[1] += sum(len(c.token_ids) for c in getattr(out, "outputs", ()) if hasattr(c, "token_ids"))
    seconds = max(bar.format_dict["elapsed"], 1e-9)
    bar.set_postfix_str(f"est. speed input: {bar.tokens[0] / seconds:.2f} toks/s, output: "
                        f"{bar.tokens[1] / seconds:.2f} toks/s", refresh=False)
    bar.update(1)
